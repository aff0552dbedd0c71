//! `cargo xtask bench [--quick] [--no-peers]`: every criterion bench of the workspace,
//! then the peers (Flink, Bytewax: see `peers.rs`), then a report.
//!
//! Benches print figures as lines of the form
//!
//! ```text
//! FIGURE <name> = <value> <unit> [goal <op> <target>] [(<note>)]
//! ```
//!
//! where `<op>` is `>=` or `<=`. They are collected into `target/bench/report.json`
//! and `target/bench/report.md` with the machine's facts. Each figure is a ratio or
//! rate measured within one run, never compared with another machine's timings.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::util::{capture, cargo_bin, target_dir};

/// One collected figure.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Figure {
    pub(crate) name: String,
    pub(crate) value: f64,
    pub(crate) unit: String,
    pub(crate) goal: Option<(String, f64)>,
    pub(crate) note: String,
}

impl Figure {
    pub(crate) fn met(&self) -> Option<bool> {
        let (op, target) = self.goal.as_ref()?;
        Some(match op.as_str() {
            ">=" => self.value >= *target,
            "<=" => self.value <= *target,
            _ => return None,
        })
    }

    /// The figure as the `FIGURE` line [`parse_figure`] reads.
    pub(crate) fn line(&self) -> String {
        let goal = self
            .goal
            .as_ref()
            .map_or_else(String::new, |(op, t)| format!(" goal {op} {t}"));
        let note = if self.note.is_empty() {
            String::new()
        } else {
            format!(" ({})", self.note)
        };
        format!(
            "FIGURE {} = {} {}{goal}{note}",
            self.name, self.value, self.unit
        )
    }
}

/// Parses one `FIGURE` line; `None` for any other line.
pub(crate) fn parse_figure(line: &str) -> Option<Figure> {
    let rest = line.trim().strip_prefix("FIGURE ")?;
    let (name, rest) = rest.split_once(" = ")?;
    let (rest, note) = match rest.split_once(" (") {
        Some((head, note)) => (head, note.trim_end_matches(')').to_owned()),
        None => (rest, String::new()),
    };
    let mut words = rest.split_whitespace();
    let value: f64 = words.next()?.parse().ok()?;
    let unit = words.next()?.to_owned();
    let goal = match (words.next(), words.next(), words.next()) {
        (Some("goal"), Some(op), Some(target)) => Some((op.to_owned(), target.parse().ok()?)),
        _ => None,
    };
    Some(Figure {
        name: name.trim().to_owned(),
        value,
        unit,
        goal,
        note,
    })
}

fn machine_facts() -> Vec<(String, String)> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, model)| model.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let rustc = capture(Command::new("rustc").arg("--version"))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default();
    let date = capture(Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default();
    vec![
        ("cpu".into(), cpu),
        ("cores".into(), cores.to_string()),
        ("rustc".into(), rustc),
        ("date".into(), date),
    ]
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let quick = args.iter().any(|a| a == "--quick");
    let peers = !args.iter().any(|a| a == "--no-peers");
    if let Some(other) = args.iter().find(|a| *a != "--quick" && *a != "--no-peers") {
        bail!("unknown bench option `{other}`");
    }
    let mut command = Command::new(cargo_bin());
    // Only the `benches/` targets: library test harnesses reject criterion options.
    command.args(["bench", "--workspace", "--locked", "--bench", "*", "--"]);
    if quick {
        command.arg("--quick");
        // State benches: 1 M keys (~100 MiB) instead of 10 M (~1 GiB) and 8× that.
        command.env("STILLPOINT_BENCH_KEYS", "1000000");
        // Backup benches: a 128 MiB snapshot instead of 1 GiB.
        command.env("STILLPOINT_BENCH_SNAPSHOT_MIB", "128");
    }
    let mut figures = collect(&mut command)?;
    let missing = missing(&figures);
    if peers {
        let theirs = crate::peers::run(quick, &figures)?;
        for f in &theirs {
            println!("{}", f.line());
        }
        figures.extend(theirs);
    }
    write_report(&figures, quick)?;
    if !missing.is_empty() {
        bail!("no figure printed for {}", missing.join(", "));
    }
    Ok(())
}

/// Every figure the workspace's benches print, at any size (the smoke run under
/// `cargo test` included). The peers' figures are computed here, not printed.
const EXPECTED: [&str; 27] = [
    "wire.control_encode_decode",
    "wire.data_decode_throughput",
    "wire.data_decode_vs_memcpy_crc32c",
    "wire.data_encode_vs_memcpy_crc32c",
    "task.events_per_second_64_tasks",
    "state.rmw_hot_1000_cached_vs_raw",
    "state.rmw_uniform_cached_vs_raw",
    "state.barrier_stall_p99",
    "state.second_snapshot_manifest",
    "state.export_8x_vs_1x",
    "state.sync_snapshot_8x_vs_1x",
    "state.restore_changelog_vs_materialized",
    "backup.upload_vs_copy",
    "backup.download_vs_copy",
    "backup.second_upload_bytes_ratio",
    "engine.throughput_ckpt_1s_vs_off",
    "engine.stall_p99",
    "engine.keyed_count_1000_keys",
    "engine.keyed_count_1000_keys_checkpoint_p99",
    "engine.keyed_count_1000_keys_batch_1024x1",
    "engine.keyed_count_1000_keys_combined",
    "engine.upload_vs_state_1pct",
    "engine.checkpoint_duration_p99_4_tasks",
    "engine.checkpoint_duration_p99_16_tasks",
    "engine.checkpoint_duration_p99_64_tasks",
    "engine.shortest_sustained_interval",
    "engine.windowed_count_vs_plain_ckpt_1s",
];

/// The expected figures `figures` lacks.
pub(crate) fn missing(figures: &[Figure]) -> Vec<&'static str> {
    EXPECTED
        .into_iter()
        .filter(|name| !figures.iter().any(|f| f.name == *name))
        .collect()
}

/// Runs `command`, passing its stdout through, and returns the figures it printed.
pub(crate) fn collect(command: &mut Command) -> Result<Vec<Figure>> {
    eprintln!("xtask: $ {command:?}");
    let mut child = command
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {command:?}"))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut figures = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("{line}");
        figures.extend(parse_figure(&line));
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(figures)
}

fn write_report(figures: &[Figure], quick: bool) -> Result<()> {
    let dir = target_dir()?.join("bench");
    std::fs::create_dir_all(&dir)?;
    let facts = machine_facts();

    let mut md = String::from("# stillpoint bench report\n\n");
    for (key, value) in &facts {
        let _ = writeln!(md, "- {key}: {value}");
    }
    let _ = writeln!(md, "- mode: {}\n", if quick { "quick" } else { "full" });
    md.push_str("| figure | value | goal | met |\n| --- | --- | --- | --- |\n");
    for f in figures {
        let goal = f
            .goal
            .as_ref()
            .map_or_else(|| "—".into(), |(op, t)| format!("{op} {t}"));
        let met = match f.met() {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "—",
        };
        let _ = writeln!(
            md,
            "| {} | {} {} | {goal} | {met} |",
            f.name, f.value, f.unit
        );
    }
    std::fs::write(dir.join("report.md"), &md)?;

    let json = json!({
        "machine": facts.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "quick": quick,
        "figures": figures.iter().map(|f| json!({
            "name": f.name,
            "value": f.value,
            "unit": f.unit,
            "goal": f.goal.as_ref().map(|(op, t)| format!("{op} {t}")),
            "met": f.met(),
            "note": f.note,
        })).collect::<Vec<_>>(),
    });
    std::fs::write(
        dir.join("report.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    println!("\n{md}");
    eprintln!("xtask: bench report in {}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_figure_lines() {
        let f =
            parse_figure("FIGURE wire.ratio = 1.25 ratio goal >= 1.0 (decode ÷ baseline)").unwrap();
        assert_eq!(f.name, "wire.ratio");
        assert_eq!(f.value, 1.25);
        assert_eq!(f.unit, "ratio");
        assert_eq!(f.goal, Some((">=".into(), 1.0)));
        assert_eq!(f.note, "decode ÷ baseline");
        assert_eq!(f.met(), Some(true));

        let f = parse_figure("FIGURE p99 = 12 ms goal <= 10").unwrap();
        assert_eq!(f.met(), Some(false));
        let f = parse_figure("FIGURE rate = 5 msg/s").unwrap();
        assert_eq!((f.met(), f.goal), (None, None));
        assert_eq!(parse_figure("control/barrier time: [1 ns 2 ns 3 ns]"), None);
        assert_eq!(parse_figure("FIGURE broken = x ratio"), None);

        let f = parse_figure("FIGURE peers.x = 7.5 ratio goal >= 5 (a ÷ b)").unwrap();
        assert_eq!(parse_figure(&f.line()), Some(f));
    }

    #[test]
    fn names_the_figures_a_run_did_not_print() {
        let all: Vec<Figure> = EXPECTED
            .iter()
            .map(|name| parse_figure(&format!("FIGURE {name} = 1 ratio")).unwrap())
            .collect();
        assert!(missing(&all).is_empty());
        let without_p9: Vec<Figure> = all
            .into_iter()
            .filter(|f| f.name != "state.sync_snapshot_8x_vs_1x")
            .collect();
        assert_eq!(missing(&without_p9), ["state.sync_snapshot_8x_vs_1x"]);
    }
}
