//! The peers of `cargo xtask bench`: the same keyed count (1,000 keys, records
//! generated in-process, checkpoints every second, state in RocksDB or the peer's own
//! store, checkpoints to a local directory) on Apache Flink (PyFlink, a Table/SQL job)
//! and on Bytewax, each installed on demand into a virtualenv under the target
//! directory — never by the tests. Each peer's script (`xtask/peers/*.py`) prints one
//! `PEER {json}` line; the figures divide stillpoint's rate, measured by the engine
//! bench in the same `cargo xtask bench` run, by the peer's. Every peer setting runs
//! [`RUNS`] times and its median counts, as stillpoint's does; Flink runs with the
//! same parallelism as stillpoint's job (2 sources → 3 keyed tasks) both in its
//! default setting and in its best one for this job (`xtask/peers/flink_count.py`).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::bench::Figure;
use crate::util::{capture, run_command, target_dir, workspace_root};

/// The engine bench's figures the peers are compared with: the plain keyed count,
/// and the same count combined per key before the shuffle (stillpoint's counterpart
/// of Flink's mini-batch two-phase aggregation).
const STILLPOINT_RATE: &str = "engine.keyed_count_1000_keys";
const STILLPOINT_COMBINED_RATE: &str = "engine.keyed_count_1000_keys_combined";
const STILLPOINT_CHECKPOINT: &str = "engine.keyed_count_1000_keys_checkpoint_p99";

struct Peer {
    name: &'static str,
    /// What `pip install` gets, and a module whose import proves it is installed.
    package: &'static str,
    module: &'static str,
    script: &'static str,
    /// Records of the measured run, quick and full.
    rows: (u64, u64),
    /// Whether the script needs a free local port (Flink's REST API).
    port: bool,
    /// The settings it runs in (the script's last argument), each with the name of
    /// its figures and the ratio stillpoint is to reach against it.
    settings: &'static [Setting],
}

struct Setting {
    /// The script's argument (none when empty).
    arg: &'static str,
    /// `peers.<figure>.keyed_count`, `peers.stillpoint_vs_<figure>`.
    figure: &'static str,
    /// How the report names the ratio.
    label: &'static str,
    goal: f64,
    /// The engine bench's figure divided by the peer's rate: the same kind of job —
    /// with pre-aggregation before the shuffle on both sides or on neither.
    ours: &'static str,
}

/// Runs of each peer setting; the median counts.
const RUNS: usize = 3;

const PEERS: [Peer; 2] = [
    Peer {
        name: "flink",
        package: "apache-flink==2.3.0",
        module: "pyflink",
        script: "flink_count.py",
        rows: (6_000_000, 30_000_000),
        port: true,
        settings: &[
            Setting {
                arg: "default",
                figure: "flink_default",
                label: "÷ Flink default",
                goal: 5.0,
                ours: STILLPOINT_RATE,
            },
            Setting {
                arg: "tuned",
                figure: "flink_tuned",
                label: "÷ Flink tuned",
                goal: 3.0,
                ours: STILLPOINT_COMBINED_RATE,
            },
        ],
    },
    Peer {
        name: "bytewax",
        package: "bytewax==0.21.1",
        module: "bytewax",
        script: "bytewax_count.py",
        rows: (4_000_000, 20_000_000),
        port: false,
        settings: &[Setting {
            arg: "",
            figure: "bytewax",
            label: "÷ Bytewax",
            goal: 5.0,
            ours: STILLPOINT_RATE,
        }],
    },
];

/// Runs every peer and returns its figures, next to stillpoint's from `figures`.
pub(crate) fn run(quick: bool, figures: &[Figure]) -> Result<Vec<Figure>> {
    // A figure of the engine bench by name.
    let rate_of = |name: &str| {
        figures
            .iter()
            .find(|f| f.name == name)
            .map(|f| f.value)
            .with_context(|| format!("the engine bench printed no `{name}` figure"))
    };
    let our_checkpoint = rate_of(STILLPOINT_CHECKPOINT).ok();
    let home = target_dir()?.join("bench").join("peers");
    let mut out = Vec::new();
    for peer in &PEERS {
        let python = install(peer, &home)?;
        let rows = if quick { peer.rows.0 } else { peer.rows.1 };
        for setting in peer.settings {
            let ours = rate_of(setting.ours)?;
            let mut reports = Vec::new();
            for _ in 0..RUNS {
                reports.push(measure(peer, setting, &python, &home, rows)?);
            }
            let rates = reports
                .iter()
                .map(|r| number(r, "records_per_second"))
                .collect::<Result<Vec<_>>>()?;
            let rate = median(&rates);
            let name = setting.figure;
            out.push(figure(
                &format!("peers.{name}.keyed_count"),
                rate,
                "records/s",
                None,
                format!(
                    "{rows} records, median of {RUNS} ({})",
                    rates
                        .iter()
                        .map(|r| format!("{r:.0}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
            out.push(figure(
                &format!("peers.stillpoint_vs_{name}"),
                ours / rate,
                "ratio",
                Some(setting.goal),
                format!(
                    "stillpoint {} : {ours:.0} (`{}`) ÷ {rate:.0} records/s",
                    setting.label, setting.ours
                ),
            ));
            let p99s: Vec<f64> = reports
                .iter()
                .filter_map(|r| number(r, "checkpoint_p99_ms").ok())
                .collect();
            if !p99s.is_empty() {
                let vs = our_checkpoint.map_or_else(String::new, |ms| {
                    format!("; stillpoint p99 {ms:.0} ms on the same job")
                });
                out.push(figure(
                    &format!("peers.{name}.checkpoint_duration_p99"),
                    median(&p99s),
                    "ms",
                    None,
                    format!(
                        "{}'s own REST statistics, median of the runs' p99, {} checkpoints in the last run{vs}",
                        peer.name,
                        reports
                            .last()
                            .and_then(|r| number(r, "checkpoints_completed").ok())
                            .unwrap_or(0.0)
                    ),
                ));
            }
        }
    }
    Ok(out)
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
}

fn figure(name: &str, value: f64, unit: &str, at_least: Option<f64>, note: String) -> Figure {
    // Two decimals are all a figure of a shared machine can claim.
    Figure {
        name: name.to_owned(),
        value: (value * 100.0).round() / 100.0,
        unit: unit.to_owned(),
        goal: at_least.map(|t| (">=".to_owned(), t)),
        note,
    }
}

fn number(report: &Value, field: &str) -> Result<f64> {
    report
        .get(field)
        .and_then(Value::as_f64)
        .with_context(|| format!("the peer's report has no number `{field}`: {report}"))
}

/// The peer's virtualenv python, creating the virtualenv and installing the peer the
/// first time.
fn install(peer: &Peer, home: &Path) -> Result<PathBuf> {
    let venv = home.join(format!("{}-venv", peer.name));
    let python = venv.join("bin").join("python");
    let installed = python.exists()
        && Command::new(&python)
            .args(["-c", &format!("import {}", peer.module)])
            .output()
            .is_ok_and(|o| o.status.success());
    if installed {
        return Ok(python);
    }
    eprintln!("xtask: installing {} into {}", peer.package, venv.display());
    std::fs::create_dir_all(home)?;
    run_command(Command::new("python3").arg("-m").arg("venv").arg(&venv))
        .context("creating a virtualenv needs python3 with the venv module")?;
    run_command(Command::new(&python).args(["-m", "pip", "install", "--quiet", peer.package]))?;
    Ok(python)
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn measure(peer: &Peer, setting: &Setting, python: &Path, home: &Path, rows: u64) -> Result<Value> {
    let work = home.join(format!("{}-run", peer.name));
    if work.exists() {
        std::fs::remove_dir_all(&work)?;
    }
    std::fs::create_dir_all(&work)?;
    let script = workspace_root()?
        .join("xtask")
        .join("peers")
        .join(peer.script);
    let mut command = Command::new(python);
    command.arg(&script).arg(rows.to_string()).arg(&work);
    if peer.port {
        command.arg(free_port()?.to_string());
    }
    if !setting.arg.is_empty() {
        command.arg(setting.arg);
    }
    eprintln!("xtask: $ {command:?}");
    let stdout = capture(&mut command)?;
    std::fs::remove_dir_all(&work)?;
    let Some(line) = stdout.lines().find_map(|l| l.strip_prefix("PEER ")) else {
        bail!("{} printed no `PEER` line:\n{stdout}", peer.name);
    };
    serde_json::from_str(line).with_context(|| format!("{}'s `PEER` line: {line}", peer.name))
}
