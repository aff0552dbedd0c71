//! The operator API: replayable sources, keyed operators, two-phase sinks. The
//! built-in ones (generated words, files, logs, a keyed counter, a transactional file
//! sink) are in the `stillpoint-connectors` crate.

use stillpoint_state::{CachedState, Timer};
/// When the engine flushes a stage's [`Combiner`], besides barriers, watermarks, the
/// end of input and an idle task.
pub use stillpoint_task::Combine;
use stillpoint_task::WatermarkStrategy;
use stillpoint_wire::{CheckpointId, SourceOffset};

use crate::{EngineError, Record};

/// What a poll of a source produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourcePoll {
    /// Records were appended.
    Records,
    /// Nothing now; poll again later.
    Idle,
    /// The input is exhausted (a bounded source).
    Finished,
}

/// A replayable source: it can be positioned at any offset it reported.
pub trait Source: Send {
    /// Positions the source at `offset` (`None`: the beginning).
    fn seek(&mut self, offset: Option<&SourceOffset>) -> Result<(), EngineError>;
    /// Appends at most `max` records to `out`.
    fn poll(&mut self, max: usize, out: &mut Vec<Record>) -> Result<SourcePoll, EngineError>;
    /// The offset just after the last record returned: where a restore resumes.
    fn offset(&self) -> SourceOffset;

    /// Whether [`Source::poll_until`] can stop this source exactly at an offset it
    /// reported. The engine needs it to replay exactly up to where output a sink
    /// already published ends (after a fallback past a damaged checkpoint); without
    /// it such a restore is refused unless duplicates are allowed. Default: `false`.
    fn stops_at_offsets(&self) -> bool {
        false
    }

    /// Like [`Source::poll`], but never past `bound` — an offset this source reported
    /// (one recorded with published output). Once [`Source::offset`] equals `bound`
    /// it appends nothing. Only called when [`Source::stops_at_offsets`] says so; the
    /// default polls without a bound.
    fn poll_until(
        &mut self,
        max: usize,
        bound: &SourceOffset,
        out: &mut Vec<Record>,
    ) -> Result<SourcePoll, EngineError> {
        let _ = bound;
        self.poll(max, out)
    }

    /// How this source's tasks generate watermarks from the event times of the
    /// records they read ([`Record::time`], which the source sets); `None` (the
    /// default): no watermarks, and event time downstream stays at its start.
    fn watermarks(&self) -> Option<WatermarkStrategy> {
        None
    }
}

/// A keyed operator: each record is processed with the task's keyed state (whose key
/// groups are the task's own; records arrive partitioned by the key group of their
/// key). State must be keyed by the record's key bytes: the key group of a state key
/// is computed from those bytes, so a typed state (`ValueState<K, _>`, which keys by
/// the postcard encoding of `K`) only fits when that encoding is the record key.
///
/// Besides [`Operator::process`] an operator has hooks, each a no-op by default, that
/// the task calls on its own thread with the task's state:
///
/// - [`Operator::open`] once the state is restored, before the first record;
/// - [`Operator::on_barrier`] at every checkpoint's barrier, before the barrier goes
///   on: what it emits lands in that checkpoint. An operator that buffers output in
///   memory (mini-batches, async lookups) flushes it here — memory is not in the
///   checkpoint, so output still buffered at the barrier would be lost by a restore;
/// - [`Operator::on_timer`] when a timer it set fires: an event-time timer once the
///   task's watermark reaches it, a processing-time one once the wall clock does;
/// - [`Operator::on_end_of_input`] once every upstream's input has ended (a bounded
///   job), after every event-time timer has fired: what it emits lands before the
///   final checkpoint's barrier;
/// - [`Operator::close`] when the task stops with the job (not on a crash or failure).
pub trait Operator: Send {
    /// Called once the task's state is restored (or opened empty), before any record
    /// or hook.
    fn open(&mut self, state: &mut CachedState) -> Result<(), EngineError> {
        let _ = state;
        Ok(())
    }

    /// Processes one record, appending outputs to `out`.
    fn process(
        &mut self,
        record: Record,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError>;

    /// At the barrier of `checkpoint`, once every input has delivered it and before
    /// the task's snapshot and the barrier go on: outputs appended to `out` are sent
    /// ahead of the barrier (they belong to `checkpoint`), and state changed here is in
    /// its snapshot.
    fn on_barrier(
        &mut self,
        checkpoint: CheckpointId,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        let _ = (checkpoint, state, out);
        Ok(())
    }

    /// A timer set with [`CachedState::register_timer`] is due (it is removed from
    /// state as it fires). Timers are keyed state: a restore brings them back and a
    /// rescale moves them with their key's group. Outputs appended to `out` follow.
    fn on_timer(
        &mut self,
        timer: Timer,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        let _ = (timer, state, out);
        Ok(())
    }

    /// Every upstream's input has ended: emit what was waiting for more input (open
    /// windows, partial aggregates). It lands before the final checkpoint's barrier.
    /// A restore from a checkpoint taken after the end calls it again, so emit from
    /// state and clear what was emitted (then the second call emits nothing).
    fn on_end_of_input(
        &mut self,
        state: &mut CachedState,
        out: &mut Vec<Record>,
    ) -> Result<(), EngineError> {
        let _ = (state, out);
        Ok(())
    }

    /// The task stops with the job (after the last checkpoint it took part in); not
    /// called when it crashes or fails.
    fn close(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    /// Whether the operator's output is a function of its keyed state and the
    /// records of each key, whatever the order in which its inputs interleave (no
    /// clock, no randomness, no cross-key order). A fallback past published output
    /// replays that stretch and drops what it reproduces, which is exact only then;
    /// an operator answering `false` makes such a restore refused unless duplicates
    /// are allowed. Default: `true`.
    fn deterministic(&self) -> bool {
        true
    }
}

/// Pre-aggregation before the shuffle (Flink's local aggregation of its two-phase
/// aggregates, a MapReduce combiner): a stage's output is folded per key on the
/// stage's own tasks, so the next stage receives one partial aggregate per key per
/// flush instead of every record. Attach one with [`crate::Dataflow::combine`].
///
/// A combiner holds records only in memory, between two flushes the engine decides
/// ([`Combine`]): when [`Combine::max_records`] records were added or
/// [`Combine::max_delay`] passed since the first one, when the task has nothing to do,
/// before every barrier (so a checkpoint never has records inside a combiner: nothing
/// of it is state), before every watermark (a record folded before a watermark is
/// sent before it) and at the end of input. A crash loses what it buffers, which is
/// input after the last checkpoint, replayed by the restore.
///
/// What [`Combiner::flush`] emits must keep the keys of the records it folded (they
/// are partitioned after it) and be what the next stage's operator understands: a
/// partial count (`stillpoint_connectors::CountCombiner`) is merged by an operator
/// that adds partial counts, not by one that counts records.
pub trait Combiner: Send {
    /// Folds one output record into what is buffered.
    fn add(&mut self, record: Record) -> Result<(), EngineError>;
    /// Appends everything buffered to `out` and forgets it.
    fn flush(&mut self, out: &mut Vec<Record>) -> Result<(), EngineError>;
}

/// The durable half of a pre-commit, run on the task's export thread: the task never
/// waits for the disk at a barrier, and the checkpoint cannot complete before it has
/// run. If it fails the transaction's records are gone from memory, so the task fails
/// and the job restores (they are replayed), never a silent loss.
pub type Persist = Box<dyn FnOnce() -> Result<(), EngineError> + Send>;

/// An exactly-once sink: output is written into a transaction per checkpoint,
/// pre-committed (made durable but invisible) at the barrier and committed when the
/// checkpoint completes.
pub trait Sink: Send {
    /// Adds a record to the open transaction.
    fn write(&mut self, record: Record) -> Result<(), EngineError>;
    /// Closes the open transaction as transaction `checkpoint` (still invisible) and
    /// opens the next one; returns the work that makes it durable ([`Persist`]), or
    /// `None` when closing it already did. An error here fails the checkpoint and
    /// keeps the records in the open transaction.
    fn pre_commit(&mut self, checkpoint: CheckpointId) -> Result<Option<Persist>, EngineError>;
    /// Publishes every pre-committed transaction up to and including `checkpoint`.
    /// Idempotent.
    fn commit(&mut self, checkpoint: CheckpointId) -> Result<(), EngineError>;
    /// After a restart: publishes what `restored` covers and rolls back every later
    /// pre-committed transaction (its records will be replayed).
    fn recover(&mut self, restored: Option<CheckpointId>) -> Result<(), EngineError>;
}
