//! Sans-IO state machines of stillpoint's checkpoint protocol: one [`TaskMachine`] per
//! task (source, aggregate, sink) and one [`Coordinator`] per stream.
//!
//! Nothing here reads a clock, spawns a thread, locks, or touches a file or socket:
//! every input is a `handle_*(now, …)` call, every output is drained with
//! `poll_action()` / `poll_timeout()`. The same inputs always give the same outputs,
//! which is what lets [`sim`] (feature `sim`) check the protocol over thousands of
//! seeded runs with lost, duplicated and reordered messages and crashing tasks.
//!
//! ```
//! use stillpoint_task::{Coordinator, CoordinatorAction, CoordinatorConfig, TaskAction,
//!     TaskConfig, TaskLevel, TaskMachine, Time};
//! use stillpoint_wire::{CheckpointId, Message, NodeId, RelativePath, Sha256Digest,
//!     SnapshotReport, StreamId, TaskId};
//!
//! let (stream, node) = (StreamId(1), NodeId(1));
//! let (source, sink) = (TaskId(1), TaskId(2));
//! let mut src = TaskMachine::new(
//!     TaskConfig::new(stream, source, node, TaskLevel::Source).downstreams([sink]), None)?;
//! let mut snk = TaskMachine::new(
//!     TaskConfig::new(stream, sink, node, TaskLevel::Sink).upstreams([source]), None)?;
//! let mut coordinator = Coordinator::new(
//!     CoordinatorConfig::new(stream, vec![source], vec![source, sink]),
//!     Time::ZERO, None, CheckpointId(1))?;
//!
//! // One second in, the coordinator triggers checkpoint 1 at the source.
//! let now = Time::from_millis(1000);
//! coordinator.handle_timeout(now);
//! let Some(CoordinatorAction::Send(request)) = coordinator.poll_action() else { panic!() };
//! src.handle_message(now, &request)?;
//! assert!(matches!(src.poll_action(), Some(TaskAction::QueueBarrier { .. })));
//!
//! // The driver reaches the barrier in its input: flush, snapshot, forward.
//! src.handle_source_barrier(now, CheckpointId(1));
//! let actions: Vec<TaskAction> = std::iter::from_fn(|| src.poll_action()).collect();
//! assert!(matches!(actions[1], TaskAction::Snapshot { .. }));
//! let TaskAction::Send(barrier) = &actions[2] else { panic!() };
//!
//! // The sink aligns (one input), pre-commits, and builds once its export is done.
//! snk.handle_message(now, barrier)?;
//! let report = |path: &str| SnapshotReport {
//!     manifest: RelativePath::new(path).unwrap(), manifest_sha256: Sha256Digest([0; 32]),
//!     state_bytes: 10, uploaded_bytes: 10, files: 1, uploaded_files: 1,
//!     alignment_micros: 0, sync_micros: 5, async_micros: 50, source_offset: None };
//! snk.handle_snapshot_exported(now, CheckpointId(1), report("sink.manifest"));
//! src.handle_snapshot_exported(now, CheckpointId(1), report("source.manifest"));
//!
//! // Ready flows up to the source, reports go to the coordinator.
//! fn sent(machine: &mut TaskMachine) -> Vec<Message> {
//!     std::iter::from_fn(|| machine.poll_action())
//!         .filter_map(|a| if let TaskAction::Send(m) = a { Some(m) } else { None })
//!         .collect()
//! }
//! for m in sent(&mut snk) {
//!     match m {
//!         Message::CheckpointReport(_) => coordinator.handle_message(now, &m)?,
//!         _ => src.handle_message(now, &m)?, // BarrierAck, CheckpointReady
//!     }
//! }
//! for m in sent(&mut src) {
//!     match m {
//!         Message::CheckpointReadyAck(_) => snk.handle_message(now, &m)?,
//!         _ => coordinator.handle_message(now, &m)?, // CheckpointSourceRsp, CheckpointReport
//!     }
//! }
//! let Some(CoordinatorAction::WriteManifest(request)) = coordinator.poll_action() else { panic!() };
//! assert_eq!(request.tasks.len(), 2);
//! coordinator.handle_manifest_written(now, CheckpointId(1), Ok(1_764_633_600_000));
//! assert_eq!(coordinator.last_completed(), Some(CheckpointId(1)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! `docs/state-machines.md` draws both machines and maps every case of the protocol
//! to its handler and test.

mod cluster;
mod combine;
mod coordinator;
mod debloat;
mod event_time;
mod graph;
mod job_end;
mod replay_role;
mod restore_plan;
#[cfg(feature = "sim")]
pub mod sim;
mod task;
mod time;

pub use cluster::{
    ClusterAction, ClusterConfig, ClusterCoordinator, ClusterError, ClusterNode, NodeAction,
    NodeReport, Order, RunEnd,
};
pub use combine::{Combine, CombineClock};
pub use coordinator::{
    CompletedCheckpoint, Coordinator, CoordinatorAction, CoordinatorConfig, CoordinatorError,
    ManifestRequest, TaskReport,
};
pub use debloat::{Debloater, MIN_RECORDS_PER_MESSAGE, records_to_read};
pub use event_time::{EventClock, EventTimeUpdate, WatermarkGenerator, WatermarkStrategy};
pub use graph::{GraphError, Partitioning, StageError, StageShape, TaskGraph, check_stages};
pub use job_end::JobEnd;
pub use replay_role::{ReplayRole, SourceGate};
pub use restore_plan::{
    Bounds, Published, Replay, Republish, RestorePlan, RestoreQuestion, plan_restore,
};
pub use task::{
    ConfigError, RestoredCheckpoint, TaskAction, TaskConfig, TaskError, TaskLevel, TaskMachine,
    TaskStatus,
};
pub use time::Time;

/// The crate README's example, compiled and run as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctest;
