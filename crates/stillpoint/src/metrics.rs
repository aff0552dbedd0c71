//! Job metrics (prometheus-client) and their endpoint: a small HTTP/1.1 responder on a
//! local port serving `GET /metrics` (anything else is 404), on its own thread,
//! until the job ends.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use stillpoint_wire::{NodeId, TaskId};

use crate::transport::Signals;
use crate::{CheckpointStats, EngineError};

/// Counters and gauges of one running job, updated by its threads; exposed in the
/// OpenMetrics text format by prometheus-client.
pub struct Metrics {
    registry: Registry,
    records: BTreeMap<TaskId, Counter>,
    completed: Counter,
    aborted: Counter,
    last_checkpoint: Gauge,
    last_duration: Gauge<f64, AtomicU64>,
    last_stall: Gauge<f64, AtomicU64>,
    last_alignment: Gauge<f64, AtomicU64>,
    state_bytes: Gauge,
    uploaded_bytes: Counter,
    restored_from: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("tasks", &self.records.len())
            .finish_non_exhaustive()
    }
}

/// A task's labels: its id, and its node's on a cluster node.
type TaskLabels = Vec<(&'static str, String)>;

impl Metrics {
    /// Metrics for a job of these tasks.
    #[must_use]
    pub fn new(tasks: &[TaskId]) -> Self {
        Self::with(None, tasks)
    }

    /// Metrics of cluster node `node`, running `tasks`: its tasks' counters only (the
    /// coordinator serves the checkpoints'), each labelled with the node.
    #[must_use]
    pub fn for_node(node: NodeId, tasks: &[TaskId]) -> Self {
        Self::with(Some(node), tasks)
    }

    fn with(node: Option<NodeId>, tasks: &[TaskId]) -> Self {
        let mut registry = Registry::default();
        let family = Family::<TaskLabels, Counter>::default();
        registry.register(
            "stillpoint_task_records",
            "Records each task took in",
            family.clone(),
        );
        let records = tasks
            .iter()
            .map(|task| {
                let mut labels = vec![("task", task.get().to_string())];
                if let Some(node) = node {
                    labels.push(("node", node.get().to_string()));
                }
                (*task, family.get_or_create(&labels).clone())
            })
            .collect();
        let metrics = Self {
            registry,
            records,
            completed: Counter::default(),
            aborted: Counter::default(),
            last_checkpoint: Gauge::default(),
            last_duration: Gauge::default(),
            last_stall: Gauge::default(),
            last_alignment: Gauge::default(),
            state_bytes: Gauge::default(),
            uploaded_bytes: Counter::default(),
            restored_from: Gauge::default(),
        };
        if node.is_some() {
            return metrics;
        }
        let mut metrics = metrics;
        let r = &mut metrics.registry;
        r.register(
            "stillpoint_checkpoints_completed",
            "Checkpoints completed by this run",
            metrics.completed.clone(),
        );
        r.register(
            "stillpoint_checkpoints_aborted",
            "Checkpoints aborted by this run",
            metrics.aborted.clone(),
        );
        r.register(
            "stillpoint_last_checkpoint_id",
            "The newest completed checkpoint",
            metrics.last_checkpoint.clone(),
        );
        r.register(
            "stillpoint_last_checkpoint_duration_seconds",
            "Trigger to commit of the newest completed checkpoint",
            metrics.last_duration.clone(),
        );
        r.register(
            "stillpoint_last_checkpoint_stall_seconds",
            "Longest synchronous snapshot of any task in the newest checkpoint",
            metrics.last_stall.clone(),
        );
        r.register(
            "stillpoint_last_checkpoint_alignment_seconds",
            "Longest barrier alignment of any task in the newest checkpoint",
            metrics.last_alignment.clone(),
        );
        r.register(
            "stillpoint_state_bytes",
            "Full state size of the newest checkpoint",
            metrics.state_bytes.clone(),
        );
        r.register(
            "stillpoint_uploaded_bytes",
            "Bytes uploaded to the store by this run's checkpoints",
            metrics.uploaded_bytes.clone(),
        );
        r.register(
            "stillpoint_restored_from_checkpoint",
            "The checkpoint this run restored from (0: none)",
            metrics.restored_from.clone(),
        );
        metrics
    }

    /// The record counter of `task` (records it took in: read, or received).
    pub(crate) fn records_of(&self, task: TaskId) -> Counter {
        self.records.get(&task).cloned().unwrap_or_default()
    }

    pub(crate) fn checkpoint_completed(&self, stats: &CheckpointStats) {
        let whole = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let seconds = |micros: u64| micros as f64 / 1e6;
        self.completed.inc();
        self.last_checkpoint.set(whole(stats.checkpoint));
        self.last_duration.set(stats.duration_millis as f64 / 1e3);
        self.last_stall.set(seconds(stats.max_sync_micros));
        self.last_alignment.set(seconds(stats.max_alignment_micros));
        self.state_bytes.set(whole(stats.state_bytes));
        self.uploaded_bytes.inc_by(stats.uploaded_bytes);
    }

    pub(crate) fn checkpoint_aborted(&self) {
        self.aborted.inc();
    }

    /// Records the checkpoint the job restored from.
    pub fn restored(&self, checkpoint: u64) {
        self.restored_from
            .set(i64::try_from(checkpoint).unwrap_or(i64::MAX));
    }

    /// The OpenMetrics text exposition.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// A Prometheus endpoint serving [`Metrics`] at `GET /metrics` until dropped.
#[derive(Debug)]
pub struct MetricsServer {
    /// The bound address (port 0 picks a free one).
    pub address: SocketAddr,
    signals: Arc<Signals>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `listen` and serves `metrics` there until the server is dropped.
    pub fn start(listen: SocketAddr, metrics: Arc<Metrics>) -> Result<Self, EngineError> {
        let listener = TcpListener::bind(listen)
            .map_err(|e| EngineError::io("listen on", listen.to_string(), &e))?;
        let address = listener
            .local_addr()
            .map_err(|e| EngineError::io("listen on", listen.to_string(), &e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| EngineError::io("listen on", listen.to_string(), &e))?;
        tracing::info!(%address, "metrics at http://{address}/metrics");
        let signals = Arc::new(Signals::default());
        let halt = Arc::clone(&signals);
        let handle = std::thread::Builder::new()
            .name("metrics".to_owned())
            .spawn(move || {
                while !halt.halted() {
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
        Ok(Self {
            address,
            signals,
            handle: Some(handle),
        })
    }
}

impl Drop for MetricsServer {
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
        (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(),
        )
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
        metrics.records_of(TaskId(2)).inc_by(7);
        metrics.checkpoint_completed(&CheckpointStats {
            checkpoint: 4,
            kind: "checkpoint".to_owned(),
            duration_millis: 120,
            max_alignment_micros: 30,
            max_sync_micros: 250,
            state_bytes: 1000,
            uploaded_bytes: 100,
        });
        let server =
            MetricsServer::start("127.0.0.1:0".parse().unwrap(), Arc::clone(&metrics)).unwrap();
        let address = server.address;
        let response = get(address, "/metrics");
        assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
        for line in [
            "stillpoint_task_records_total{task=\"2\"} 7",
            "stillpoint_checkpoints_completed_total 1",
            "stillpoint_last_checkpoint_id 4",
            "stillpoint_last_checkpoint_duration_seconds 0.12\n",
            "stillpoint_last_checkpoint_stall_seconds 0.00025\n",
            "stillpoint_uploaded_bytes_total 100",
            "# TYPE stillpoint_state_bytes gauge",
            "# EOF\n",
        ] {
            assert!(response.contains(line), "missing {line}: {response}");
        }
        assert!(get(address, "/other").starts_with("HTTP/1.1 404"));
        // Dropped with the job: the thread is joined and the port closed.
        drop(server);
        assert!(TcpStream::connect(address).is_err());
    }

    #[test]
    fn a_node_serves_its_own_tasks_labelled_with_the_node() {
        let metrics = Metrics::for_node(NodeId(2), &[TaskId(2), TaskId(4)]);
        metrics.records_of(TaskId(4)).inc_by(3);
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
        let error = MetricsServer::start(address, Arc::new(Metrics::new(&[]))).unwrap_err();
        assert!(error.to_string().contains(&address.to_string()), "{error}");
    }
}
