//! `checkpoints stats --plot FILE.svg`: checkpoint duration and size over the
//! checkpoints, as a self-contained SVG (two panels sharing the checkpoint axis).

use std::fmt::Write as _;

use stillpoint::CheckpointStats;

const WIDTH: f64 = 760.0;
const PANEL: f64 = 200.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const GAP: f64 = 60.0;

struct Series<'a> {
    label: &'a str,
    color: &'a str,
    values: Vec<f64>,
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The tick spacing nearest to `raw` per step among 1, 2 and 5 × 10ⁿ.
fn nice_step(raw: f64) -> f64 {
    if !raw.is_finite() || raw <= 0.0 {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let fraction = raw / magnitude;
    let nice = if fraction < 1.5 {
        1.0
    } else if fraction < 3.0 {
        2.0
    } else if fraction < 7.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// One panel at vertical offset `top`: axes, ticks, a polyline per series.
fn panel(out: &mut String, top: f64, title: &str, unit: &str, ids: &[u64], series: &[Series<'_>]) {
    let peak = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .fold(0.0_f64, f64::max);
    let step = nice_step(peak / 4.0);
    let ticks = (peak / step).ceil().max(1.0);
    let max = step * ticks;
    let plot_width = WIDTH - LEFT - RIGHT;
    let x = |i: usize| {
        if ids.len() <= 1 {
            LEFT + plot_width / 2.0
        } else {
            LEFT + plot_width * i as f64 / (ids.len() - 1) as f64
        }
    };
    let y = |v: f64| top + PANEL - PANEL * v / max;
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
        top - 10.0,
        escape(title)
    );
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{top}" width="{plot_width}" height="{PANEL}" fill="none" stroke="#888"/>"##
    );
    let decimals = match step {
        s if s >= 1.0 => 0,
        s if s >= 0.1 => 1,
        s if s >= 0.01 => 2,
        _ => 3,
    };
    let mut tick = 0.0;
    while tick <= max + step / 2.0 {
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" x2="{}" y1="{y0:.1}" y2="{y0:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" font-size="11" text-anchor="end">{tick:.decimals$} {unit}</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            y(tick) + 4.0,
            y0 = y(tick),
        );
        tick += step;
    }
    let labels = ids.len().clamp(1, 10);
    for k in 0..labels {
        let i = if labels == 1 {
            0
        } else {
            k * (ids.len() - 1) / (labels - 1)
        };
        if let Some(id) = ids.get(i) {
            let _ = writeln!(
                out,
                r#"<text x="{:.1}" y="{}" font-size="11" text-anchor="middle">{id}</text>"#,
                x(i),
                top + PANEL + 16.0
            );
        }
    }
    for (n, s) in series.iter().enumerate() {
        let points: Vec<String> = s
            .values
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            s.color,
            points.join(" ")
        );
        for point in &points {
            if let Some((px, py)) = point.split_once(',') {
                let _ = writeln!(
                    out,
                    r#"<circle cx="{px}" cy="{py}" r="2.5" fill="{}"/>"#,
                    s.color
                );
            }
        }
        // Legends sit in the title row, right-aligned, so they never cover data.
        let legend_x = WIDTH - RIGHT - 150.0 * (series.len() - n) as f64;
        let legend_y = top - 10.0;
        let _ = writeln!(
            out,
            r#"<rect x="{legend_x}" y="{:.1}" width="12" height="4" fill="{}"/><text x="{}" y="{legend_y:.1}" font-size="12">{}</text>"#,
            legend_y - 5.0,
            s.color,
            legend_x + 18.0,
            escape(s.label)
        );
    }
}

/// The chart of `history` (oldest first).
pub(crate) fn svg(history: &[CheckpointStats], title: &str) -> String {
    let ids: Vec<u64> = history.iter().map(|s| s.checkpoint).collect();
    let height = TOP + 2.0 * PANEL + GAP + 50.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="20" font-size="15" text-anchor="middle">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    panel(
        &mut out,
        TOP + 10.0,
        "Duration (trigger → commit), longest stall",
        "ms",
        &ids,
        &[
            Series {
                label: "duration",
                color: "#1f77b4",
                values: history.iter().map(|s| s.duration_millis as f64).collect(),
            },
            Series {
                label: "stall (sync snapshot)",
                color: "#d62728",
                values: history
                    .iter()
                    .map(|s| s.max_sync_micros as f64 / 1e3)
                    .collect(),
            },
        ],
    );
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    panel(
        &mut out,
        TOP + PANEL + GAP + 10.0,
        "Size: full state, uploaded",
        "MiB",
        &ids,
        &[
            Series {
                label: "full state",
                color: "#2ca02c",
                values: history.iter().map(|s| mib(s.state_bytes)).collect(),
            },
            Series {
                label: "uploaded",
                color: "#ff7f0e",
                values: history.iter().map(|s| mib(s.uploaded_bytes)).collect(),
            },
        ],
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">checkpoint</text>"#,
        WIDTH / 2.0,
        height - 8.0
    );
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_has_a_point_per_checkpoint_and_escapes_its_title() {
        let history: Vec<CheckpointStats> = (1..=5)
            .map(|i| CheckpointStats {
                checkpoint: i,
                kind: "checkpoint".into(),
                duration_millis: 100 + i,
                max_alignment_micros: 10,
                max_sync_micros: 300,
                state_bytes: 10 << 20,
                uploaded_bytes: 1 << 20,
                tasks: Vec::new(),
            })
            .collect();
        let svg = svg(&history, "a <store>");
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("a &lt;store&gt;"));
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert_eq!(svg.matches("<circle").count(), 20);
        // Round ticks: 0, 20, …, 120 ms for durations up to 105 ms.
        assert!(svg.contains(">120 ms<") && svg.contains(">0 ms<"), "{svg}");
    }

    #[test]
    fn ticks_are_round_numbers() {
        assert!((nice_step(210.75) - 200.0).abs() < 1e-9);
        assert!((nice_step(80.0) - 100.0).abs() < 1e-9);
        assert!((nice_step(1.55) - 2.0).abs() < 1e-9);
        assert!((nice_step(0.03) - 0.05).abs() < 1e-12);
        assert!((nice_step(0.0) - 1.0).abs() < 1e-12);
        assert!((nice_step(f64::NAN) - 1.0).abs() < 1e-12);
    }
}
