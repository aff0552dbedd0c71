//! A real SFTP server for tests: OpenSSH's `sshd` on loopback (`cargo xtask setup`
//! installs it), with a fresh host key and one client key, public-key logins only.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The port the test server listens on.
pub const PORT: u16 = 2222;

/// A running server; stopped (and its keys and data removed) on drop.
pub struct SftpServer {
    child: Child,
    dir: tempfile::TempDir,
}

fn sshd() -> PathBuf {
    let path =
        std::env::var_os("STILLPOINT_SSHD").map_or_else(|| "/usr/sbin/sshd".into(), PathBuf::from);
    assert!(
        path.is_file(),
        "OpenSSH's sshd is not at {}: run `cargo xtask setup` (it installs the SFTP server the tests use)",
        path.display()
    );
    path
}

fn keygen(path: &Path) {
    let status = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .stdout(Stdio::null())
        .status()
        .expect("ssh-keygen runs");
    assert!(status.success(), "ssh-keygen failed for {}", path.display());
}

impl SftpServer {
    /// Starts the server and waits (at most 30 s) until its port answers.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let host_key = dir.path().join("host_key");
        let client_key = dir.path().join("client_key");
        keygen(&host_key);
        keygen(&client_key);
        let authorized = dir.path().join("authorized_keys");
        std::fs::copy(client_key.with_extension("pub"), &authorized).unwrap();
        // sshd refuses keys readable by others.
        let config = dir.path().join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "Port {PORT}\nListenAddress 127.0.0.1\nHostKey {}\nAuthorizedKeysFile {}\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n\
                 StrictModes no\nPermitRootLogin prohibit-password\nPidFile none\n\
                 MaxStartups 64\nMaxSessions 64\nSubsystem sftp internal-sftp\n",
                host_key.display(),
                authorized.display()
            ),
        )
        .unwrap();
        std::fs::create_dir_all("/run/sshd").unwrap();
        let log = std::fs::File::create(dir.path().join("sshd.log")).unwrap();
        let child = Command::new(sshd())
            .arg("-D")
            .arg("-e")
            .arg("-f")
            .arg(&config)
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("sshd starts");
        let server = Self { child, dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", PORT)).is_err() {
            assert!(
                Instant::now() < deadline,
                "sshd did not open port {PORT} within 30 s: {}",
                std::fs::read_to_string(server.dir.path().join("sshd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    /// The client's private key (for the store's `key` option).
    pub fn client_key(&self) -> PathBuf {
        self.dir.path().join("client_key")
    }

    /// The account the tests log in as: whoever runs them (sshd checks the key of
    /// that account against `authorized_keys` above).
    pub fn user(&self) -> String {
        let out = Command::new("id").arg("-un").output().expect("id runs");
        String::from_utf8(out.stdout)
            .expect("a user name")
            .trim()
            .to_owned()
    }

    /// A directory the stores of one test live under.
    pub fn data_dir(&self) -> PathBuf {
        let data = self.dir.path().join("data");
        std::fs::create_dir_all(&data).unwrap();
        data
    }
}

impl Drop for SftpServer {
    fn drop(&mut self) {
        let _killed = self.child.kill();
        let _waited = self.child.wait();
    }
}
