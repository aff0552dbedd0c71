//! `cargo xtask fuzz [SECS] [TARGET...]`: bounded libFuzzer campaigns over every
//! cargo-fuzz target of the workspace (`crates/*/fuzz`).
//!
//! The toolchain here is stable-only, so targets run with `cargo fuzz run -s none`
//! (libFuzzer with coverage, no sanitizer; AddressSanitizer would need nightly or
//! `RUSTC_BOOTSTRAP=1`). Committed seed corpora in `crates/*/fuzz/corpus/TARGET` are
//! read-only inputs: new corpus entries go to `target/fuzz/corpus/TARGET`, logs to
//! `target/fuzz/logs/TARGET.log`, crashes to the crate's `fuzz/artifacts/TARGET`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::util::{cargo_bin, run_command, target_dir, workspace_root};

const DEFAULT_SECS: u64 = 60;

struct Target {
    crate_dir: PathBuf,
    name: String,
}

fn discover() -> Result<Vec<Target>> {
    let mut targets = Vec::new();
    let crates = workspace_root()?.join("crates");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("fuzz/Cargo.toml").is_file())
        .collect();
    dirs.sort();
    for crate_dir in dirs {
        let mut names: Vec<String> = std::fs::read_dir(crate_dir.join("fuzz/fuzz_targets"))?
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_suffix(".rs").map(str::to_owned)
            })
            .collect();
        names.sort();
        targets.extend(names.into_iter().map(|name| Target {
            crate_dir: crate_dir.clone(),
            name,
        }));
    }
    Ok(targets)
}

fn ensure_cargo_fuzz() -> Result<()> {
    let present = Command::new(cargo_bin())
        .args(["fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !present {
        run_command(Command::new(cargo_bin()).args(["install", "cargo-fuzz", "--locked"]))?;
    }
    Ok(())
}

/// The directory of the newest `librocksdb.a` the workspace's own builds produced.
fn built_rocksdb() -> Result<Option<PathBuf>> {
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for profile in ["debug", "release"] {
        let Ok(entries) = std::fs::read_dir(target_dir()?.join(profile).join("build")) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            if !entry
                .file_name()
                .to_string_lossy()
                .starts_with("librocksdb-sys-")
            {
                continue;
            }
            let out = entry.path().join("out");
            let Ok(modified) =
                std::fs::metadata(out.join("librocksdb.a")).and_then(|m| m.modified())
            else {
                continue;
            };
            if newest.as_ref().is_none_or(|(time, _)| modified > *time) {
                newest = Some((modified, out));
            }
        }
    }
    Ok(newest.map(|(_, dir)| dir))
}

/// `Done 278832 runs in 11 second(s)` → 278832.
fn executions(log: &str) -> Option<u64> {
    log.lines().rev().find_map(|line| {
        line.strip_prefix("Done ")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

fn campaign(target: &Target, secs: u64, out: &Path) -> Result<u64> {
    let corpus = out.join("corpus").join(&target.name);
    let logs = out.join("logs");
    std::fs::create_dir_all(&corpus)?;
    std::fs::create_dir_all(&logs)?;
    let seeds = target.crate_dir.join("fuzz/corpus").join(&target.name);
    let log_path = logs.join(format!("{}.log", target.name));
    let log = std::fs::File::create(&log_path)?;

    let mut command = Command::new(cargo_bin());
    if let Some(lib_dir) = built_rocksdb()? {
        // The fuzz build has its own target dir and flags; link the RocksDB the
        // workspace already compiled instead of building it again (~25 min).
        command
            .env("ROCKSDB_LIB_DIR", lib_dir)
            .env("ROCKSDB_STATIC", "1");
    }
    command
        .current_dir(&target.crate_dir)
        .args(["fuzz", "run", "-s", "none", &target.name])
        .arg(&corpus)
        .arg(&seeds)
        .arg("--")
        .arg(format!("-max_total_time={secs}"))
        .arg("-print_final_stats=1")
        .stdout(log.try_clone()?)
        .stderr(log);
    eprintln!(
        "xtask: fuzz {} for {secs} s (log {})",
        target.name,
        log_path.display()
    );
    let status = command.status().context("cannot start cargo fuzz")?;
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    if !status.success() {
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "fuzz target {} failed ({status}); artifacts in {}; log tail:\n{}",
            target.name,
            target
                .crate_dir
                .join("fuzz/artifacts")
                .join(&target.name)
                .display(),
            tail.join("\n")
        );
    }
    executions(&text).context("libFuzzer did not report its executions")
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut secs = DEFAULT_SECS;
    let mut wanted = Vec::new();
    for arg in args {
        match arg.parse::<u64>() {
            Ok(n) => secs = n,
            Err(_) => wanted.push(arg.clone()),
        }
    }
    let targets: Vec<Target> = discover()?
        .into_iter()
        .filter(|t| wanted.is_empty() || wanted.contains(&t.name))
        .collect();
    if targets.is_empty() {
        bail!("no fuzz target matches {wanted:?}");
    }
    ensure_cargo_fuzz()?;
    let out = target_dir()?.join("fuzz");
    let mut results = Vec::new();
    for target in &targets {
        let execs = campaign(target, secs, &out)?;
        eprintln!(
            "xtask: fuzz {}: {execs} executions, no finding",
            target.name
        );
        results.push((target.name.clone(), execs));
    }
    println!("fuzz campaign, {secs} s per target:");
    for (name, execs) in results {
        println!("  {name:<24} {execs:>12} executions, 0 crashes");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::executions;

    #[test]
    fn reads_libfuzzer_execution_count() {
        let log = "#1024\tpulse\nDone 278832 runs in 11 second(s)\nstat::number_of_executed_units: 278832\n";
        assert_eq!(executions(log), Some(278_832));
        assert_eq!(executions("crash"), None);
    }
}
