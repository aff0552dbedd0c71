//! The in-process transport: bounded data channels per edge (barriers travel in-band
//! with the records, backpressure reaches the sources), unbounded control channels
//! per task and one to the coordinator, and the routing of every protocol message.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use crossbeam_channel::{SendTimeoutError, Sender};
use stillpoint_wire::{Message, SourceOffset, TaskId};

use crate::EngineError;

/// Shared control channels of the tasks in one process.
pub(crate) type ControlMap = Arc<BTreeMap<TaskId, Sender<Message>>>;

/// The records per data message each task of this process asks its upstreams for
/// (buffer debloating, [`stillpoint_task::Debloater`]): the task writes its own, its
/// upstreams here read it.
pub(crate) type MessageSizes = Arc<BTreeMap<TaskId, Arc<AtomicU32>>>;

/// What the coordinator driver receives: the tasks' messages and reports, and
/// events of the process around it (`E`: a cluster's node connections).
#[derive(Debug)]
pub enum CoordinatorInput<E = std::convert::Infallible> {
    /// A protocol message from a task.
    Message(Message),
    /// A bounded source reached its end at this offset.
    SourceFinished {
        /// The source task.
        task: TaskId,
        /// Its offset at the end.
        offset: SourceOffset,
    },
    /// A replaying source reached its bound (the end of published output).
    SourceAtBound {
        /// The source task.
        task: TaskId,
    },
    /// A task stopped with an error.
    TaskFailed {
        /// The task.
        task: TaskId,
        /// What it failed with.
        error: String,
    },
    /// An event of the process that runs the driver (a cluster node connecting,
    /// lost or reporting). One with `ends_run` ends a running generation with that
    /// error — the checkpoints in flight are aborted and the event handed back to
    /// the caller; any other is left to the caller between generations.
    Process {
        /// The event.
        event: E,
        /// Why it ends a running generation, if it does.
        ends_run: Option<EngineError>,
    },
}

/// Flags every thread of one generation (or job) watches.
#[derive(Debug, Default)]
pub struct Signals {
    stop: AtomicBool,
    crash: AtomicBool,
    pause: AtomicBool,
}

impl Signals {
    /// Pauses or resumes the sources of this process ([`crate::StopHandle::pause`]).
    pub fn set_paused(&self, paused: bool) {
        self.pause.store(paused, Ordering::SeqCst);
    }

    pub(crate) fn paused(&self) -> bool {
        self.pause.load(Ordering::SeqCst)
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    pub(crate) fn crash(&self) {
        self.crash.store(true, Ordering::SeqCst);
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    pub(crate) fn crashed(&self) -> bool {
        self.crash.load(Ordering::SeqCst)
    }

    /// Whether a thread should leave its loop now.
    #[must_use]
    pub fn halted(&self) -> bool {
        self.stopping() || self.crashed()
    }
}

/// Where a task's outgoing messages go.
#[derive(Clone, Debug)]
pub(crate) struct Links {
    pub(crate) data: BTreeMap<TaskId, Sender<Message>>,
    pub(crate) control: ControlMap,
    pub(crate) coordinator: Sender<CoordinatorInput>,
    pub(crate) signals: Arc<Signals>,
    pub(crate) sizes: MessageSizes,
}

impl Links {
    /// The most records one data message to `to` should carry: what it asks for
    /// when it runs in this process, else no limit.
    pub(crate) fn records_per_message(&self, to: TaskId) -> usize {
        let asked = self.sizes.get(&to).map(|size| size.load(Ordering::Relaxed));
        asked.map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// Sends a message where the protocol says it goes. Data and barriers wait for room
    /// in their bounded channel (backpressure) but give up when the job halts.
    pub(crate) fn route(&self, message: Message) -> Result<(), EngineError> {
        match &message {
            Message::Barrier(m) => return self.send_data(m.downstream, message),
            Message::Data(m) => return self.send_data(m.downstream, message),
            Message::EndOfInput(m) => return self.send_data(m.downstream, message),
            Message::Watermark(m) => return self.send_data(m.downstream, message),
            Message::CheckpointSourceRsp(_) | Message::CheckpointReport(_) => {
                // The coordinator outlives every task; a closed channel means the job is
                // stopping, when late reports no longer matter.
                let _closed = self.coordinator.send(CoordinatorInput::Message(message));
                return Ok(());
            }
            _ => {}
        }
        let Some(target) = message.recipient() else {
            return Err(EngineError::Invalid(format!(
                "a task cannot send {:?}",
                message.kind()
            )));
        };
        match self.control.get(&target) {
            Some(channel) => {
                // Control traffic to a task that already stopped is lost, as it would be
                // on a network; the protocol tolerates lost control messages.
                let _closed = channel.send(message);
                Ok(())
            }
            None => Err(EngineError::Invalid(format!("no route to {target}"))),
        }
    }

    fn send_data(&self, to: TaskId, message: Message) -> Result<(), EngineError> {
        let channel = self
            .data
            .get(&to)
            .ok_or_else(|| EngineError::Invalid(format!("no data channel to {to}")))?;
        let mut message = message;
        loop {
            match channel.send_timeout(message, Duration::from_millis(20)) {
                Ok(()) => return Ok(()),
                Err(SendTimeoutError::Timeout(back)) => {
                    if self.signals.halted() {
                        return Err(EngineError::Stopped(format!("the data channel to {to}")));
                    }
                    message = back;
                }
                Err(SendTimeoutError::Disconnected(_)) => {
                    return Err(EngineError::Stopped(format!("{to}")));
                }
            }
        }
    }
}
