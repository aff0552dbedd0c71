//! Job metrics and their Prometheus text endpoint: a small HTTP/1.1 responder on a
//! local port serving `GET /metrics` (anything else is 404), on its own thread,
//! until the job ends.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use stillpoint_wire::{NodeId, TaskId};

use crate::transport::Signals;
use crate::{CheckpointStats, EngineError};

/// Counters and gauges of one running job, updated by its threads.
#[derive(Debug, Default)]
pub struct Metrics {
    records: BTreeMap<TaskId, Arc<AtomicU64>>,
    completed: AtomicU64,
    aborted: AtomicU64,
    last_checkpoint: AtomicU64,
    last_duration_micros: AtomicU64,
    last_stall_micros: AtomicU64,
    last_alignment_micros: AtomicU64,
    state_bytes: AtomicU64,
    uploaded_bytes_total: AtomicU64,
    restored_from: AtomicU64,
    /// Set for a cluster node's metrics: its tasks' counters only (the coordinator
    /// serves the checkpoints'), each sample labelled with the node.
    node: Option<NodeId>,
}

impl Metrics {
    /// Metrics for a job of these tasks.
    pub(crate) fn new(tasks: &[TaskId]) -> Self {
        Self {
            records: tasks
                .iter()
                .map(|t| (*t, Arc::new(AtomicU64::new(0))))
                .collect(),
            ..Self::default()
        }
    }

    /// Metrics of cluster node `node`, running `tasks`.
    pub(crate) fn for_node(node: NodeId, tasks: &[TaskId]) -> Self {
        Self {
            node: Some(node),
            ..Self::new(tasks)
        }
    }

    /// The record counter of `task` (records it took in: read, or received).
    pub(crate) fn records_of(&self, task: TaskId) -> Arc<AtomicU64> {
        self.records
            .get(&task)
            .cloned()
            .unwrap_or_else(|| Arc::new(AtomicU64::new(0)))
    }

    pub(crate) fn checkpoint_completed(&self, stats: &CheckpointStats) {
        self.completed.fetch_add(1, Ordering::Relaxed);
        self.last_checkpoint
            .store(stats.checkpoint, Ordering::Relaxed);
        self.last_duration_micros.store(
            stats.duration_millis.saturating_mul(1000),
            Ordering::Relaxed,
        );
        self.last_stall_micros
            .store(stats.max_sync_micros, Ordering::Relaxed);
        self.last_alignment_micros
            .store(stats.max_alignment_micros, Ordering::Relaxed);
        self.state_bytes.store(stats.state_bytes, Ordering::Relaxed);
        self.uploaded_bytes_total
            .fetch_add(stats.uploaded_bytes, Ordering::Relaxed);
    }

    pub(crate) fn checkpoint_aborted(&self) {
        self.aborted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn restored(&self, checkpoint: u64) {
        self.restored_from.store(checkpoint, Ordering::Relaxed);
    }

    /// The Prometheus text exposition (format 0.0.4).
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            out.push_str(&value);
        };
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        let seconds = |micros: u64| format!("{:.6}", micros as f64 / 1e6);
        let mut records = String::new();
        let node = self
            .node
            .map_or_else(String::new, |n| format!(",node=\"{}\"", n.get()));
        for (task, counter) in &self.records {
            let _ = writeln!(
                records,
                "stillpoint_task_records_total{{task=\"{}\"{node}}} {}",
                task.get(),
                load(counter)
            );
        }
        metric(
            "stillpoint_task_records_total",
            "counter",
            "Records each task took in.",
            records,
        );
        if self.node.is_some() {
            return out;
        }
        let plain = |name: &str, value: String| format!("{name} {value}\n");
        metric(
            "stillpoint_checkpoints_completed_total",
            "counter",
            "Checkpoints completed by this run.",
            plain(
                "stillpoint_checkpoints_completed_total",
                load(&self.completed).to_string(),
            ),
        );
        metric(
            "stillpoint_checkpoints_aborted_total",
            "counter",
            "Checkpoints aborted by this run.",
            plain(
                "stillpoint_checkpoints_aborted_total",
                load(&self.aborted).to_string(),
            ),
        );
        metric(
            "stillpoint_last_checkpoint_id",
            "gauge",
            "The newest completed checkpoint.",
            plain(
                "stillpoint_last_checkpoint_id",
                load(&self.last_checkpoint).to_string(),
            ),
        );
        metric(
            "stillpoint_last_checkpoint_duration_seconds",
            "gauge",
            "Trigger to commit of the newest completed checkpoint.",
            plain(
                "stillpoint_last_checkpoint_duration_seconds",
                seconds(load(&self.last_duration_micros)),
            ),
        );
        metric(
            "stillpoint_last_checkpoint_stall_seconds",
            "gauge",
            "Longest synchronous snapshot of any task in the newest checkpoint.",
            plain(
                "stillpoint_last_checkpoint_stall_seconds",
                seconds(load(&self.last_stall_micros)),
            ),
        );
        metric(
            "stillpoint_last_checkpoint_alignment_seconds",
            "gauge",
            "Longest barrier alignment of any task in the newest checkpoint.",
            plain(
                "stillpoint_last_checkpoint_alignment_seconds",
                seconds(load(&self.last_alignment_micros)),
            ),
        );
        metric(
            "stillpoint_state_bytes",
            "gauge",
            "Full state size of the newest checkpoint.",
            plain(
                "stillpoint_state_bytes",
                load(&self.state_bytes).to_string(),
            ),
        );
        metric(
            "stillpoint_uploaded_bytes_total",
            "counter",
            "Bytes uploaded to the store by this run's checkpoints.",
            plain(
                "stillpoint_uploaded_bytes_total",
                load(&self.uploaded_bytes_total).to_string(),
            ),
        );
        metric(
            "stillpoint_restored_from_checkpoint",
            "gauge",
            "The checkpoint this run restored from (0: none).",
            plain(
                "stillpoint_restored_from_checkpoint",
                load(&self.restored_from).to_string(),
            ),
        );
        out
    }
}

/// Binds `listen` and serves the metrics until the job halts. Returns the bound
/// address (port 0 picks a free one).
pub(crate) fn serve(
    listen: SocketAddr,
    metrics: Arc<Metrics>,
    signals: Arc<Signals>,
) -> Result<(SocketAddr, std::thread::JoinHandle<()>), EngineError> {
    let listener = TcpListener::bind(listen)
        .map_err(|e| EngineError::io("listen on", listen.to_string(), &e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| EngineError::io("listen on", listen.to_string(), &e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| EngineError::io("listen on", listen.to_string(), &e))?;
    tracing::info!(address = %bound, "metrics at http://{bound}/metrics");
    let handle = std::thread::Builder::new()
        .name("metrics".to_owned())
        .spawn(move || {
            while !signals.halted() {
                match listener.accept() {
                    Ok((stream, _)) => {
                        if let Err(error) = answer(stream, &metrics) {
                            tracing::debug!(%error, "metrics request failed");
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(error) => {
                        tracing::warn!(%error, "metrics endpoint stopped");
                        return;
                    }
                }
            }
        })
        .map_err(|e| EngineError::io("spawn", "metrics thread", &e))?;
    Ok((bound, handle))
}

/// A metrics endpoint that stops when dropped (for the processes of a cluster job,
/// which have no job-wide signals).
pub(crate) struct Served {
    /// The bound address.
    pub(crate) address: SocketAddr,
    signals: Arc<Signals>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    /// Serves `metrics` at `listen` until the returned guard is dropped.
    pub(crate) fn start(listen: SocketAddr, metrics: Arc<Metrics>) -> Result<Self, EngineError> {
        let signals = Arc::new(Signals::default());
        let (address, handle) = serve(listen, metrics, Arc::clone(&signals))?;
        Ok(Self {
            address,
            signals,
            handle: Some(handle),
        })
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.signals.stop();
        if let Some(handle) = self.handle.take() {
            let _joined = handle.join();
        }
    }
}

/// Reads one request (bounded: 8 KiB, 2 s) and answers it.
fn answer(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut request = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
        let read = stream.read(&mut chunk)?;
        if read == 0 {
            break;
        }
        request.extend_from_slice(chunk.get(..read).unwrap_or_default());
    }
    let line = request.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, content_type, body) = if method == "GET" && path == "/metrics" {
        ("200 OK", "text/plain; version=0.0.4", metrics.render())
    } else {
        (
            "404 Not Found",
            "text/plain",
            "stillpoint serves GET /metrics\n".to_owned(),
        )
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes())?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(address: SocketAddr, path: &str) -> String {
        let mut stream = TcpStream::connect(address).unwrap();
        write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        response
    }

    #[test]
    fn the_endpoint_serves_prometheus_text_and_stops_with_the_job() {
        let metrics = Arc::new(Metrics::new(&[TaskId(1), TaskId(2)]));
        metrics
            .records_of(TaskId(2))
            .fetch_add(7, Ordering::Relaxed);
        metrics.checkpoint_completed(&CheckpointStats {
            checkpoint: 4,
            kind: "checkpoint".to_owned(),
            duration_millis: 120,
            max_alignment_micros: 30,
            max_sync_micros: 250,
            state_bytes: 1000,
            uploaded_bytes: 100,
        });
        let signals = Arc::new(Signals::default());
        let (address, handle) = serve(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&metrics),
            Arc::clone(&signals),
        )
        .unwrap();
        let response = get(address, "/metrics");
        assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
        for line in [
            "stillpoint_task_records_total{task=\"2\"} 7",
            "stillpoint_checkpoints_completed_total 1",
            "stillpoint_last_checkpoint_id 4",
            "stillpoint_last_checkpoint_duration_seconds 0.120000",
            "stillpoint_last_checkpoint_stall_seconds 0.000250",
            "stillpoint_uploaded_bytes_total 100",
            "# TYPE stillpoint_state_bytes gauge",
        ] {
            assert!(response.contains(line), "missing {line}: {response}");
        }
        assert!(get(address, "/other").starts_with("HTTP/1.1 404"));
        signals.stop();
        handle.join().unwrap();
    }

    #[test]
    fn a_node_serves_its_own_tasks_labelled_with_the_node() {
        let metrics = Metrics::for_node(NodeId(2), &[TaskId(2), TaskId(4)]);
        metrics
            .records_of(TaskId(4))
            .fetch_add(3, Ordering::Relaxed);
        let text = metrics.render();
        assert!(
            text.contains("stillpoint_task_records_total{task=\"4\",node=\"2\"} 3"),
            "{text}"
        );
        assert!(!text.contains("task=\"1\""), "{text}");
        // Checkpoints are the coordinator's to report.
        assert!(
            !text.contains("stillpoint_checkpoints_completed_total"),
            "{text}"
        );
    }

    #[test]
    fn a_taken_port_is_an_error_naming_it() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = taken.local_addr().unwrap();
        let error = serve(
            address,
            Arc::new(Metrics::default()),
            Arc::new(Signals::default()),
        )
        .unwrap_err();
        assert!(error.to_string().contains(&address.to_string()), "{error}");
    }
}
