//! A real S3-compatible server for tests: SeaweedFS (`weed mini`) on loopback, with
//! signature checking on, and its WebDAV face over the same files. `cargo xtask setup` installs it; its binary is found through
//! `STILLPOINT_WEED` or the default install location.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ACCESS_KEY: &str = "testkey";
pub const SECRET_KEY: &str = "testsecret";
pub const BUCKET: &str = "stillpoint-test";
pub const ENDPOINT: &str = "http://127.0.0.1:8333";
/// The same server's WebDAV endpoint; bucket `B` is directory `/buckets/B` there.
#[allow(dead_code)] // only the store's own S3 tests read it back over WebDAV
pub const WEBDAV_ENDPOINT: &str = "http://127.0.0.1:7333";

/// A running server; stopped (and its data removed) on drop.
pub struct S3Server {
    child: Child,
    _data: tempfile::TempDir,
}

fn weed() -> PathBuf {
    if let Ok(path) = std::env::var("STILLPOINT_WEED") {
        return path.into();
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let default = PathBuf::from(home).join(".cache/stillpoint-s3/bin/weed");
    assert!(
        default.is_file(),
        "SeaweedFS is not installed at {} and STILLPOINT_WEED is unset: run `cargo xtask setup` (it installs the S3 server the tests use)",
        default.display()
    );
    default
}

impl S3Server {
    /// Starts the server and waits (at most 60 s) until its S3 port answers.
    pub fn start() -> Self {
        let data = tempfile::tempdir().unwrap();
        let config = data.path().join("s3.json");
        std::fs::write(
            &config,
            format!(
                r#"{{"identities":[{{"name":"admin","credentials":[{{"accessKey":"{ACCESS_KEY}","secretKey":"{SECRET_KEY}"}}],"actions":["Admin","Read","List","Tagging","Write"]}}]}}"#
            ),
        )
        .unwrap();
        let store_dir = data.path().join("data");
        std::fs::create_dir_all(&store_dir).unwrap();
        let log = std::fs::File::create(data.path().join("weed.log")).unwrap();
        let child = Command::new(weed())
            .arg("mini")
            .arg(format!("-dir={}", store_dir.display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-s3.config={}", config.display()))
            .args([
                "-webdav=true",
                "-webdav.port=7333",
                "-admin.ui=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.telemetry=false",
            ])
            .arg(format!("-bucket={BUCKET}"))
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("SeaweedFS starts");
        let server = Self { child, _data: data };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect("127.0.0.1:8333").is_err()
            || TcpStream::connect("127.0.0.1:7333").is_err()
        {
            assert!(
                Instant::now() < deadline,
                "SeaweedFS did not open its S3 port within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        // SIGTERM lets it exit cleanly in 3-5 s; SIGKILL keeps the test bounded.
        let _killed = self.child.kill();
        let _waited = self.child.wait();
    }
}
