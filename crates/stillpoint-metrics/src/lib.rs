//! Observability of a stillpoint job: the [`CheckpointStats`] kept in the store for
//! every completed checkpoint, the job's [`Metrics`] (prometheus-client), and the
//! [`MetricsServer`] that serves them at `GET /metrics` — hyper on the engine's tokio
//! runtime, with a cap on connections and a deadline per connection.
//!
//! ```
//! use std::sync::Arc;
//! use stillpoint_metrics::{CheckpointStats, Metrics, MetricsServer};
//! use stillpoint_wire::TaskId;
//!
//! let metrics = Arc::new(Metrics::new(&[TaskId(1)]));
//! metrics.records_of(TaskId(1)).inc_by(5);
//! metrics.checkpoint_completed(&CheckpointStats {
//!     checkpoint: 3, kind: "checkpoint".into(), duration_millis: 40,
//!     max_alignment_micros: 10, max_sync_micros: 90, state_bytes: 4096, uploaded_bytes: 512,
//!     tasks: Vec::new(),
//! });
//! assert!(metrics.render().contains("stillpoint_last_checkpoint_id 3"));
//!
//! let runtime = tokio::runtime::Runtime::new()?;
//! let server = MetricsServer::start("127.0.0.1:0".parse()?, metrics, runtime.handle())?;
//! assert_ne!(server.address.port(), 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod in_flight;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

pub use in_flight::{ScrapeError, TaskInFlight, in_flight, scrape};

/// A counter of the job's metrics (a task's records).
pub use prometheus_client::metrics::counter::Counter;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use stillpoint_task::{CompletedCheckpoint, TaskMachine};
use stillpoint_wire::{NodeId, TaskId};

/// Statistics of one completed checkpoint, kept in the store next to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointStats {
    /// The checkpoint.
    pub checkpoint: u64,
    /// `checkpoint` or `savepoint`.
    pub kind: String,
    /// Trigger to commit, milliseconds.
    pub duration_millis: u64,
    /// Longest alignment of any task, microseconds.
    pub max_alignment_micros: u64,
    /// Longest synchronous snapshot (the task's stall), microseconds.
    pub max_sync_micros: u64,
    /// Full state size.
    pub state_bytes: u64,
    /// Bytes uploaded for this checkpoint.
    pub uploaded_bytes: u64,
    /// Each task's part (empty in stats written before they were kept).
    #[serde(default)]
    pub tasks: Vec<TaskCheckpointStats>,
}

/// One task's part in a completed checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskCheckpointStats {
    /// The task.
    pub task: u32,
    /// From its first barrier to its last (waiting on the others), microseconds.
    pub alignment_micros: u64,
    /// The synchronous snapshot (the task's stall), microseconds.
    pub sync_micros: u64,
    /// The asynchronous part: writing, checkpointing and uploading, microseconds.
    pub async_micros: u64,
    /// Its state's size.
    pub state_bytes: u64,
    /// Bytes it uploaded.
    pub uploaded_bytes: u64,
}

impl From<&CompletedCheckpoint> for CheckpointStats {
    fn from(done: &CompletedCheckpoint) -> Self {
        Self {
            checkpoint: done.checkpoint.get(),
            kind: done.kind.to_string(),
            duration_millis: u64::try_from(done.duration.as_millis()).unwrap_or(u64::MAX),
            max_alignment_micros: done.max_alignment_micros,
            max_sync_micros: done.max_sync_micros,
            state_bytes: done.state_bytes,
            uploaded_bytes: done.uploaded_bytes,
            tasks: done
                .tasks
                .iter()
                .map(|(task, report)| TaskCheckpointStats {
                    task: task.get(),
                    alignment_micros: report.alignment_micros,
                    sync_micros: report.sync_micros,
                    async_micros: report.async_micros,
                    state_bytes: report.state_bytes,
                    uploaded_bytes: report.uploaded_bytes,
                })
                .collect(),
        }
    }
}

/// The endpoint could not listen where it was asked to.
#[derive(Debug, thiserror::Error)]
#[error("the metrics endpoint (`metrics.listen`) cannot listen on {address}: {source}")]
pub struct ListenError {
    /// The address asked for.
    pub address: SocketAddr,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

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
    /// Per task, the newest checkpoint's alignment, sync and async seconds.
    task_times: [Family<TaskLabels, Gauge<f64, AtomicU64>>; 3],
    /// Per task, what it is doing for checkpoints now.
    progress: BTreeMap<TaskId, TaskProgress>,
}

/// What a task is doing for checkpoints right now, as gauges its driver sets.
#[derive(Clone, Debug, Default)]
pub struct TaskProgress {
    /// While aligning: the inputs whose barrier has not arrived (0 otherwise).
    pub missing_barriers: Gauge,
    /// Snapshots taken and not yet completed or aborted (exporting, or waiting for
    /// downstreams and the coordinator).
    pub snapshots_in_flight: Gauge,
    /// The checkpoint being aligned (0: none).
    pub aligning: Gauge,
    /// Records per data message the task asks its upstreams for (buffer debloating;
    /// 0 until it first changes from the configured size).
    pub message_records: Gauge,
    /// Per upstream: 1 while the task aligns and that upstream's barrier is missing.
    awaiting: Family<TaskLabels, Gauge>,
    labels: TaskLabels,
    /// What the gauges show: (aligned checkpoint, barriers in, snapshots in flight).
    shown: (u64, usize, usize),
}

impl TaskProgress {
    /// Sets both counts.
    pub fn set(&self, missing_barriers: usize, snapshots_in_flight: usize) {
        let whole = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.missing_barriers.set(whole(missing_barriers));
        self.snapshots_in_flight.set(whole(snapshots_in_flight));
    }

    /// Shows what `machine` is doing: the checkpoint it aligns, which upstreams'
    /// barriers it waits for, its snapshots in flight. Cheap when nothing changed (the
    /// driver calls it on every step).
    pub fn show(&mut self, machine: &TaskMachine) {
        let aligning = machine.aligning();
        let now = (
            aligning.map_or(0, |(c, _)| c.get()),
            aligning.map_or(0, |(_, arrived)| arrived.len()),
            machine.building().count(),
        );
        if self.shown == now {
            return;
        }
        self.shown = now;
        self.set(machine.missing_barriers(), now.2);
        self.aligning.set(i64::try_from(now.0).unwrap_or(i64::MAX));
        for upstream in &machine.config().upstreams {
            let mut labels = self.labels.clone();
            labels.push(("upstream", upstream.get().to_string()));
            let missing = aligning.is_some_and(|(_, arrived)| !arrived.contains(upstream));
            self.awaiting.get_or_create(&labels).set(i64::from(missing));
        }
    }
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
        let missing = Family::<TaskLabels, Gauge>::default();
        registry.register(
            "stillpoint_task_missing_barriers",
            "While the task aligns: inputs whose barrier has not arrived",
            missing.clone(),
        );
        let building = Family::<TaskLabels, Gauge>::default();
        registry.register(
            "stillpoint_task_snapshots_in_flight",
            "Snapshots the task took that are not yet complete or aborted",
            building.clone(),
        );
        let aligning = Family::<TaskLabels, Gauge>::default();
        registry.register(
            "stillpoint_task_aligning_checkpoint",
            "The checkpoint the task aligns on (0: none)",
            aligning.clone(),
        );
        let awaiting = Family::<TaskLabels, Gauge>::default();
        registry.register(
            "stillpoint_task_awaiting_barrier",
            "1 while the task aligns and the barrier of this upstream has not arrived",
            awaiting.clone(),
        );
        let message_records = Family::<TaskLabels, Gauge>::default();
        registry.register(
            "stillpoint_task_message_records",
            "Records per data message the task asks its upstreams for (buffer debloating; 0: the configured size, unchanged)",
            message_records.clone(),
        );
        let mut records = BTreeMap::new();
        let mut progress = BTreeMap::new();
        for task in tasks {
            let mut labels = vec![("task", task.get().to_string())];
            if let Some(node) = node {
                labels.push(("node", node.get().to_string()));
            }
            records.insert(*task, family.get_or_create(&labels).clone());
            let gauges = TaskProgress {
                missing_barriers: missing.get_or_create(&labels).clone(),
                snapshots_in_flight: building.get_or_create(&labels).clone(),
                aligning: aligning.get_or_create(&labels).clone(),
                message_records: message_records.get_or_create(&labels).clone(),
                awaiting: awaiting.clone(),
                labels: labels.clone(),
                shown: (0, 0, 0),
            };
            progress.insert(*task, gauges);
        }
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
            task_times: Default::default(),
            progress,
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
        let names = [
            ("stillpoint_task_checkpoint_alignment_seconds", "alignment"),
            (
                "stillpoint_task_checkpoint_sync_seconds",
                "synchronous snapshot (stall)",
            ),
            (
                "stillpoint_task_checkpoint_async_seconds",
                "asynchronous part (write, upload)",
            ),
        ];
        for ((name, what), family) in names.into_iter().zip(&metrics.task_times) {
            r.register(
                name,
                format!("The task's {what} in the newest checkpoint"),
                family.clone(),
            );
        }
        r.register(
            "stillpoint_restored_from_checkpoint",
            "The checkpoint this run restored from (0: none)",
            metrics.restored_from.clone(),
        );
        metrics
    }

    /// The record counter of `task` (records it took in: read, or received).
    pub fn records_of(&self, task: TaskId) -> Counter {
        self.records.get(&task).cloned().unwrap_or_default()
    }

    /// Records a completed checkpoint.
    pub fn checkpoint_completed(&self, stats: &CheckpointStats) {
        let whole = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let seconds = |micros: u64| micros as f64 / 1e6;
        self.completed.inc();
        self.last_checkpoint.set(whole(stats.checkpoint));
        self.last_duration.set(stats.duration_millis as f64 / 1e3);
        self.last_stall.set(seconds(stats.max_sync_micros));
        self.last_alignment.set(seconds(stats.max_alignment_micros));
        self.state_bytes.set(whole(stats.state_bytes));
        self.uploaded_bytes.inc_by(stats.uploaded_bytes);
        for task in &stats.tasks {
            let labels = vec![("task", task.task.to_string())];
            let times = [task.alignment_micros, task.sync_micros, task.async_micros];
            for (family, micros) in self.task_times.iter().zip(times) {
                family.get_or_create(&labels).set(seconds(micros));
            }
        }
    }

    /// The checkpoint-progress gauges of `task`.
    #[must_use]
    pub fn progress_of(&self, task: TaskId) -> TaskProgress {
        self.progress.get(&task).cloned().unwrap_or_default()
    }

    /// Counts an aborted checkpoint.
    pub fn checkpoint_aborted(&self) {
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

/// A Prometheus endpoint serving [`Metrics`] at `GET /metrics` (anything else is
/// 404) until dropped: hyper's HTTP/1.1 server on the engine's runtime, at most
/// [`MetricsServer::MAX_CONNECTIONS`] connections at once, each given
/// [`MetricsServer::CONNECTION_TIMEOUT`] to send its request and take the answer.
#[derive(Debug)]
pub struct MetricsServer {
    /// Where it listens (the port chosen when asked for port 0).
    pub address: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    stopped: std::sync::mpsc::Receiver<()>,
}

impl MetricsServer {
    /// Connections served at once; more wait to be accepted.
    pub const MAX_CONNECTIONS: usize = 16;
    /// How long one connection may take, request and answer.
    pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(5);

    /// Listens on `listen` and serves `metrics` on `runtime`. A taken address is an
    /// error naming it.
    pub fn start(
        listen: SocketAddr,
        metrics: Arc<Metrics>,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Self, ListenError> {
        let failed = |source| ListenError {
            address: listen,
            source,
        };
        let listener = std::net::TcpListener::bind(listen).map_err(failed)?;
        listener.set_nonblocking(true).map_err(failed)?;
        let address = listener.local_addr().map_err(failed)?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(failed)?
        };
        tracing::info!(%address, "metrics at http://{address}/metrics");
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let (done, stopped) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            serve(listener, metrics, stop_rx).await;
            drop(done);
        });
        Ok(Self {
            address,
            stop: Some(stop),
            stopped,
        })
    }
}

impl Drop for MetricsServer {
    /// Stops accepting and closes the port before returning.
    fn drop(&mut self) {
        let _gone = self.stop.take().map(|stop| stop.send(()));
        let _closed = self.stopped.recv_timeout(Duration::from_secs(5));
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MetricsServer::MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => return,
            accepted = accept(&listener, &permits) => accepted,
        };
        let (stream, permit) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors, say: try again shortly rather than spin.
                tracing::warn!(%error, "metrics endpoint cannot accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let answer = respond(&request, &metrics);
                async move { Ok::<_, std::convert::Infallible>(answer) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(MetricsServer::CONNECTION_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            match tokio::time::timeout(MetricsServer::CONNECTION_TIMEOUT, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::debug!(%error, "metrics request failed"),
                Err(_) => tracing::debug!("metrics request timed out"),
            }
            drop(permit);
        });
    }
}

async fn accept(
    listener: &tokio::net::TcpListener,
    permits: &Arc<tokio::sync::Semaphore>,
) -> std::io::Result<(tokio::net::TcpStream, tokio::sync::OwnedSemaphorePermit)> {
    let permit = Arc::clone(permits)
        .acquire_owned()
        .await
        .map_err(std::io::Error::other)?;
    let (stream, _) = listener.accept().await?;
    Ok((stream, permit))
}

fn respond(request: &Request<Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let (status, content_type, body) =
        if request.method() == Method::GET && request.uri().path() == "/metrics" {
            (
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                metrics.render(),
            )
        } else {
            (
                StatusCode::NOT_FOUND,
                "text/plain",
                "stillpoint serves GET /metrics\n".to_owned(),
            )
        };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctest;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

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
            tasks: vec![TaskCheckpointStats {
                task: 2,
                alignment_micros: 30,
                sync_micros: 250,
                async_micros: 1_500,
                state_bytes: 600,
                uploaded_bytes: 60,
            }],
        });
        let progress = metrics.progress_of(TaskId(1));
        progress.missing_barriers.set(1);
        progress.snapshots_in_flight.set(2);
        let runtime = runtime();
        let listen = "127.0.0.1:0".parse().unwrap();
        let server = MetricsServer::start(listen, Arc::clone(&metrics), runtime.handle()).unwrap();
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
            "stillpoint_task_checkpoint_async_seconds{task=\"2\"} 0.0015\n",
            "stillpoint_task_missing_barriers{task=\"1\"} 1\n",
            "stillpoint_task_snapshots_in_flight{task=\"1\"} 2\n",
            "# TYPE stillpoint_state_bytes gauge",
            "# EOF\n",
        ] {
            assert!(response.contains(line), "missing {line}: {response}");
        }
        assert!(get(address, "/other").starts_with("HTTP/1.1 404"));
        // A client that connects and says nothing holds no more than its own
        // connection: the endpoint still answers.
        let _silent = TcpStream::connect(address).unwrap();
        assert!(get(address, "/metrics").starts_with("HTTP/1.1 200 OK"));
        // Dropped with the job: the port is closed when the drop returns.
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
        let runtime = runtime();
        let error = MetricsServer::start(address, Arc::new(Metrics::new(&[])), runtime.handle())
            .unwrap_err();
        assert!(error.to_string().contains(&address.to_string()), "{error}");
    }
}
