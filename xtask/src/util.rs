//! Running commands and finding the workspace.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The workspace root: the parent of this package's directory. `cargo run` tells us
/// where that is; the path compiled in is only a fallback, as cargo reuses one
/// build of xtask for every checkout that shares a target directory (a stale
/// path would send every task to another checkout, or to one since deleted).
pub(crate) fn workspace_root() -> Result<PathBuf> {
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .context("xtask has no parent directory")
}

/// The cargo that runs us.
pub(crate) fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Runs `cargo ARGS`, inheriting stdio; fails on a non-zero exit.
pub(crate) fn cargo(args: &[&str]) -> Result<()> {
    let mut command = Command::new(cargo_bin());
    command.args(args);
    run_command(&mut command)
}

/// Runs `command`, inheriting stdio; fails on a non-zero exit.
pub(crate) fn run_command(command: &mut Command) -> Result<()> {
    let shown = format!("{command:?}");
    eprintln!("xtask: $ {shown}");
    let status = command
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed: {status}");
    }
    Ok(())
}

/// Runs `command` and returns its stdout; stderr passes through.
pub(crate) fn capture(command: &mut Command) -> Result<String> {
    let shown = format!("{command:?}");
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot start {shown}"))?;
    if !output.status.success() {
        bail!("{shown} failed: {}", output.status);
    }
    String::from_utf8(output.stdout).with_context(|| format!("{shown} printed non-UTF-8"))
}

/// Whether `program --version` (or `program ARG`) runs successfully.
pub(crate) fn runs(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// The cargo target directory (honours `CARGO_TARGET_DIR`).
pub(crate) fn target_dir() -> Result<PathBuf> {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => Ok(PathBuf::from(dir)),
        None => Ok(workspace_root()?.join("target")),
    }
}
