//! The processes of a stillpoint cluster job: one coordinator process and one
//! process per node, over TCP, every connection authenticated.
//!
//! ```
//! use std::net::{SocketAddr, TcpListener};
//! use stillpoint::{JobConfig, RunOptions};
//! use stillpoint_cluster::{ClusterConfig, ClusterSecret, run_coordinator, run_node};
//! use stillpoint_connectors::{WordCount, read_committed};
//!
//! let free = || -> std::io::Result<SocketAddr> { TcpListener::bind("127.0.0.1:0")?.local_addr() };
//! let dir = tempfile::tempdir()?;
//! let mut config = JobConfig::new(dir.path().join("work"));
//! config.checkpoint_interval = std::time::Duration::from_millis(50);
//! let cluster = ClusterConfig {
//!     coordinator: free()?,
//!     nodes: vec![free()?, free()?],
//!     connect_timeout: std::time::Duration::from_secs(20),
//!     node_metrics: Vec::new(),
//!     secret: ClusterSecret::new(b"sixteen bytes or more")?,
//! };
//! let job = WordCount::generated(2, 2, 500, dir.path().join("out"));
//! let nodes: Vec<_> = (1..=2)
//!     .map(|node| {
//!         let (config, cluster, job) = (config.clone(), cluster.clone(), job.clone());
//!         std::thread::spawn(move || run_node(&config, &cluster, &job, stillpoint_wire::NodeId(node)))
//!     })
//!     .collect();
//! let report = run_coordinator(&config, &cluster, &job, RunOptions::default())?;
//! for node in nodes {
//!     node.join().expect("node thread")?;
//! }
//! assert!(!report.checkpoints.is_empty());
//! // Every word was counted exactly once, across two processes' worth of tasks.
//! assert_eq!(read_committed(&job.output)?.len(), 1_000);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Every node connects to the coordinator and says who it is. The coordinator, which
//! holds the store's lease, waits for all nodes, picks the checkpoint to restore and
//! starts a *generation*: each node restores its tasks (downloading their snapshots
//! from the store), opens one connection per data edge that leaves it, and reports
//! ready; then checkpoints run as in one process, with protocol messages carried as
//! wire frames. A node whose connection breaks (it crashed, was killed, or its
//! machine went away) ends the generation: the in-flight checkpoint is aborted, every
//! other node tears its tasks down, and once the node is back a new generation
//! restores from the newest complete checkpoint. Messages carry their generation, so
//! nothing from a torn-down generation reaches the next one.
//!
//! Both sides follow the cluster protocol's sans-IO machines
//! (`stillpoint_task::ClusterCoordinator`, `stillpoint_task::ClusterNode`), which the
//! task crate's simulator drives through crashes, lost connections and restarts; the
//! node's tasks are the engine's ([`stillpoint::Engine::start_tasks`]) with this
//! crate's TCP transport.

mod auth;
mod coordinator;
mod net;
mod node;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use stillpoint::{Engine, EngineError};
use stillpoint_wire::{CheckpointId, NodeId, TaskId};

pub use auth::{ClusterSecret, MIN_SECRET_BYTES};
pub use coordinator::run_coordinator;
pub use node::run_node;

/// Where the processes of a cluster job listen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// The coordinator's address; nodes connect to it.
    pub coordinator: SocketAddr,
    /// Node `i + 1` listens at `nodes[i]` for the edge connections of other nodes.
    pub nodes: Vec<SocketAddr>,
    /// How long a node keeps trying to reach the coordinator or a peer (default 60 s).
    pub connect_timeout: Duration,
    /// Node `i + 1` serves its tasks' Prometheus metrics at `node_metrics[i]` (empty:
    /// none; the coordinator serves the checkpoints' at `JobConfig::metrics_listen`).
    pub node_metrics: Vec<SocketAddr>,
    /// What every process of the cluster knows and proves on every connection.
    pub secret: ClusterSecret,
}

impl ClusterConfig {
    /// Where node `node` serves its metrics, if anywhere.
    pub(crate) fn node_metrics_address(
        &self,
        node: NodeId,
    ) -> Result<Option<SocketAddr>, EngineError> {
        if self.node_metrics.is_empty() {
            return Ok(None);
        }
        if self.node_metrics.len() != self.nodes.len() {
            return Err(EngineError::Invalid(format!(
                "[metrics] nodes lists {} addresses for {} nodes: one per node, in [cluster] nodes' order",
                self.node_metrics.len(),
                self.nodes.len()
            )));
        }
        self.node_address(node)?;
        Ok(self
            .node_metrics
            .get(node.get().saturating_sub(1) as usize)
            .copied())
    }

    pub(crate) fn node_address(&self, node: NodeId) -> Result<SocketAddr, EngineError> {
        self.nodes
            .get(node.get().saturating_sub(1) as usize)
            .copied()
            .ok_or_else(|| {
                EngineError::Invalid(format!(
                    "{node} is not in the cluster (it has {} nodes)",
                    self.nodes.len()
                ))
            })
    }

    pub(crate) fn node_count(&self) -> u32 {
        u32::try_from(self.nodes.len()).unwrap_or(u32::MAX)
    }

    pub(crate) fn check(&self) -> Result<(), EngineError> {
        if self.nodes.is_empty() {
            return Err(EngineError::Invalid("[cluster] lists no nodes".into()));
        }
        Ok(())
    }
}

/// The node a task runs on, of `nodes` (round robin by task id, so every stage
/// spreads over the nodes and most edges cross them).
fn node_of(task: TaskId, nodes: u32) -> NodeId {
    NodeId((task.get().saturating_sub(1)) % nodes.max(1) + 1)
}

/// The checkpoint the job finished at, when that is still the newest committed one
/// (a newer checkpoint means the job was run again since); says so when it is.
fn finished_at(engine: &Engine) -> Result<Option<CheckpointId>, EngineError> {
    let done = engine.finished_at()?;
    if let Some(id) = done {
        tracing::info!(checkpoint = %id, "the job already finished at this checkpoint (job/finished.json in the store); nothing to do");
    }
    Ok(done)
}

pub(crate) fn io_net(what: &str, error: &std::io::Error) -> EngineError {
    EngineError::Net(format!("{what}: {error}"))
}

/// Handshakes in progress at most: a further connection is closed at once.
const MAX_HANDSHAKES: usize = 16;

/// Accepts connections on `listener` until `halt`, handing each to `on_accept` on
/// its own short-lived handshake thread, at most [`MAX_HANDSHAKES`] at a time.
pub(crate) fn accept_loop(
    listener: TcpListener,
    halt: Arc<AtomicBool>,
    on_accept: impl Fn(TcpStream, SocketAddr) + Send + Sync + 'static,
) -> Result<JoinHandle<()>, EngineError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| io_net("listen", &e))?;
    let on_accept = Arc::new(on_accept);
    let busy = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("accept".into())
        .spawn(move || {
            while !halt.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        if busy.fetch_add(1, Ordering::SeqCst) >= MAX_HANDSHAKES {
                            busy.fetch_sub(1, Ordering::SeqCst);
                            tracing::warn!(%peer, "refused a connection: {MAX_HANDSHAKES} handshakes are in progress");
                            continue;
                        }
                        let (on_accept, busy) = (Arc::clone(&on_accept), Arc::clone(&busy));
                        let spawned = std::thread::Builder::new()
                            .name("handshake".into())
                            .spawn(move || {
                                if stream.set_nonblocking(false).is_ok()
                                    && stream.set_nodelay(true).is_ok()
                                {
                                    on_accept(stream, peer);
                                }
                                busy.fetch_sub(1, Ordering::SeqCst);
                            });
                        if spawned.is_err() {
                            tracing::warn!(%peer, "refused a connection: no thread for its handshake");
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
        .map_err(|e| EngineError::io("spawn", "accept thread", &e))
}
