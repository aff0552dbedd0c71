//! The checkpoint work in flight, read back from a running job's endpoint: what
//! `stillpoint checkpoints stats` shows beside the store's history (the history
//! holds completed checkpoints only; a stuck one is visible only in the process).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One task's part in the checkpoints in flight, as its process shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskInFlight {
    /// The task.
    pub task: u32,
    /// Its node, on a cluster.
    pub node: Option<u32>,
    /// The checkpoint whose barriers it aligns, if it does.
    pub aligning: Option<u64>,
    /// While aligning: the upstream tasks whose barrier has not arrived.
    pub awaiting: Vec<u32>,
    /// Snapshots it took that are not yet complete or aborted.
    pub snapshots_in_flight: u64,
}

impl TaskInFlight {
    /// What the task is doing, in words.
    #[must_use]
    pub fn state(&self) -> String {
        let mut parts = Vec::new();
        if let Some(checkpoint) = self.aligning {
            let upstreams: Vec<String> =
                self.awaiting.iter().map(|u| format!("task {u}")).collect();
            parts.push(format!(
                "aligning checkpoint {checkpoint}, waiting for the barrier of {}",
                if upstreams.is_empty() {
                    "none".to_owned()
                } else {
                    upstreams.join(", ")
                }
            ));
        }
        if self.snapshots_in_flight > 0 {
            parts.push(format!(
                "{} snapshot(s) exporting or awaiting completion",
                self.snapshots_in_flight
            ));
        }
        if parts.is_empty() {
            "ready (nothing in flight)".to_owned()
        } else {
            parts.join("; ")
        }
    }
}

/// Why an endpoint could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the metrics endpoint at {address}: {reason}")]
pub struct ScrapeError {
    /// The endpoint.
    pub address: SocketAddr,
    /// Why.
    pub reason: String,
}

/// Longest answer read from an endpoint.
const MAX_ANSWER: u64 = 4 << 20;

/// `GET /metrics` from `address`, waiting at most `timeout` to connect and for each
/// read; the body (at most 4 MiB are read).
pub fn scrape(address: SocketAddr, timeout: Duration) -> Result<String, ScrapeError> {
    let fail = |reason: String| ScrapeError { address, reason };
    let mut stream =
        TcpStream::connect_timeout(&address, timeout).map_err(|e| fail(e.to_string()))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .and_then(|()| {
            write!(
                stream,
                "GET /metrics HTTP/1.1\r\nHost: stillpoint\r\nConnection: close\r\n\r\n"
            )
        })
        .map_err(|e| fail(e.to_string()))?;
    let mut answer = Vec::new();
    stream
        .take(MAX_ANSWER)
        .read_to_end(&mut answer)
        .map_err(|e| fail(e.to_string()))?;
    let answer = String::from_utf8_lossy(&answer);
    let Some((head, body)) = answer.split_once("\r\n\r\n") else {
        return Err(fail("not an HTTP answer".to_owned()));
    };
    if !head.starts_with("HTTP/1.1 200") {
        let status = head.lines().next().unwrap_or_default();
        return Err(fail(format!("answered {status:?}")));
    }
    Ok(body.to_owned())
}

/// The tasks an exposition (of [`crate::Metrics::render`]) shows, by task.
#[must_use]
pub fn in_flight(exposition: &str) -> Vec<TaskInFlight> {
    let mut tasks: BTreeMap<u32, TaskInFlight> = BTreeMap::new();
    for line in exposition.lines() {
        let Some((name, labels, value)) = sample(line) else {
            continue;
        };
        let label = |key: &str| {
            labels
                .iter()
                .find(|(k, _)| *k == key)
                .and_then(|(_, v)| v.parse::<u32>().ok())
        };
        let Some(task) = label("task") else {
            continue;
        };
        let entry = tasks.entry(task).or_insert_with(|| TaskInFlight {
            task,
            ..TaskInFlight::default()
        });
        entry.node = entry.node.or(label("node"));
        match name {
            "stillpoint_task_aligning_checkpoint" => {
                entry.aligning = (value > 0).then_some(value);
            }
            "stillpoint_task_awaiting_barrier" => {
                if let Some(upstream) = label("upstream").filter(|_| value > 0) {
                    entry.awaiting.push(upstream);
                }
            }
            "stillpoint_task_snapshots_in_flight" => entry.snapshots_in_flight = value,
            _ => {}
        }
    }
    let mut out: Vec<TaskInFlight> = tasks.into_values().collect();
    for task in &mut out {
        task.awaiting.sort_unstable();
        if task.aligning.is_none() {
            task.awaiting.clear();
        }
    }
    out
}

/// A sample's labels, `(key, value)`.
type Labels<'a> = Vec<(&'a str, &'a str)>;

/// `name{k="v",…} value` of a whole-number sample; `None` for anything else.
fn sample(line: &str) -> Option<(&str, Labels<'_>, u64)> {
    let (series, value) = line.rsplit_once(' ')?;
    let value = value.parse::<u64>().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => (name, rest.strip_suffix('}')?),
        None => (series, ""),
    };
    let labels = labels
        .split(',')
        .filter(|pair| !pair.is_empty())
        .filter_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            Some((key, value.strip_prefix('"')?.strip_suffix('"')?))
        })
        .collect();
    Some((name, labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_is_read_back_per_task() {
        let text = "\
# HELP stillpoint_task_aligning_checkpoint The checkpoint the task aligns on (0: none).
stillpoint_task_aligning_checkpoint{task=\"3\",node=\"1\"} 7
stillpoint_task_aligning_checkpoint{task=\"4\",node=\"2\"} 0
stillpoint_task_awaiting_barrier{task=\"3\",node=\"1\",upstream=\"2\"} 1
stillpoint_task_awaiting_barrier{task=\"3\",node=\"1\",upstream=\"1\"} 0
stillpoint_task_awaiting_barrier{task=\"4\",node=\"2\",upstream=\"1\"} 1
stillpoint_task_snapshots_in_flight{task=\"4\",node=\"2\"} 2
stillpoint_task_records_total{task=\"3\",node=\"1\"} 10
garbage{task=\"x\"} 1
stillpoint_task_aligning_checkpoint{task=\"5\"} -1
";
        let tasks = in_flight(text);
        assert_eq!(tasks.len(), 2, "{tasks:?}");
        assert_eq!(
            tasks[0],
            TaskInFlight {
                task: 3,
                node: Some(1),
                aligning: Some(7),
                awaiting: vec![2],
                snapshots_in_flight: 0
            }
        );
        assert_eq!(
            tasks[0].state(),
            "aligning checkpoint 7, waiting for the barrier of task 2"
        );
        // An upstream gauge left from an earlier alignment does not count.
        assert!(tasks[1].awaiting.is_empty() && tasks[1].aligning.is_none());
        assert_eq!(
            tasks[1].state(),
            "2 snapshot(s) exporting or awaiting completion"
        );
    }
}
