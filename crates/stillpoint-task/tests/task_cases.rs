//! One named test per case of the per-task protocol (the table in
//! `docs/state-machines.md` points here).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation
)]

use std::time::Duration;

use stillpoint_task::*;
use stillpoint_wire::*;

const S: StreamId = StreamId(1);
const NODE: NodeId = NodeId(1);
const T0: Time = Time::ZERO;

fn t(n: u32) -> TaskId {
    TaskId(n)
}

fn c(n: u64) -> CheckpointId {
    CheckpointId(n)
}

/// Task 10 as a source feeding `downstreams`.
fn source(downstreams: &[u32]) -> TaskMachine {
    let config = TaskConfig::new(S, t(10), NODE, TaskLevel::Source)
        .downstreams(downstreams.iter().map(|d| t(*d)));
    TaskMachine::new(config, None).unwrap()
}

/// Task 20 as an aggregate between `upstreams` and `downstreams`.
fn aggregate(upstreams: &[u32], downstreams: &[u32]) -> TaskMachine {
    let config = TaskConfig::new(S, t(20), NODE, TaskLevel::Aggregate)
        .upstreams(upstreams.iter().map(|u| t(*u)))
        .downstreams(downstreams.iter().map(|d| t(*d)));
    TaskMachine::new(config, None).unwrap()
}

/// Task 30 as a sink reading `upstreams`.
fn sink(upstreams: &[u32]) -> TaskMachine {
    let config =
        TaskConfig::new(S, t(30), NODE, TaskLevel::Sink).upstreams(upstreams.iter().map(|u| t(*u)));
    TaskMachine::new(config, None).unwrap()
}

fn actions(m: &mut TaskMachine) -> Vec<TaskAction> {
    std::iter::from_fn(|| m.poll_action()).collect()
}

fn sent(actions: &[TaskAction]) -> Vec<MessageKind> {
    actions
        .iter()
        .filter_map(|a| {
            if let TaskAction::Send(m) = a {
                Some(m.kind())
            } else {
                None
            }
        })
        .collect()
}

fn barrier(from: u32, to: u32, id: u64) -> Message {
    Barrier {
        stream: S,
        upstream: t(from),
        downstream: t(to),
        checkpoint: c(id),
        trans: TransId(id as u32),
        kind: CheckpointKind::Checkpoint,
    }
    .into()
}

fn ready(upstream: u32, from: u32, id: u64) -> Message {
    CheckpointReady {
        stream: S,
        upstream: t(upstream),
        downstream: t(from),
        downstream_node: NODE,
        checkpoint: c(id),
        trans: TransId(id as u32),
    }
    .into()
}

fn source_request(task: u32, id: u64) -> Message {
    CheckpointSource {
        stream: S,
        task: t(task),
        checkpoint: c(id),
        trans: TransId(id as u32),
        kind: CheckpointKind::Checkpoint,
    }
    .into()
}

fn complete(task: u32, id: u64) -> Message {
    CheckpointComplete {
        stream: S,
        task: t(task),
        checkpoint: c(id),
        trans: TransId(id as u32),
        completed_at_millis: 1,
        source_offset: None,
    }
    .into()
}

fn abort(task: u32, id: u64) -> Message {
    CheckpointAbort {
        stream: S,
        task: t(task),
        checkpoint: c(id),
        trans: TransId(id as u32),
        reason: AbortReason::Timeout,
    }
    .into()
}

fn report(task: u32) -> SnapshotReport {
    SnapshotReport {
        manifest: RelativePath::new(format!("tasks/{task}.manifest")).unwrap(),
        manifest_sha256: Sha256Digest([1; 32]),
        state_bytes: 100,
        uploaded_bytes: 10,
        files: 2,
        uploaded_files: 1,
        alignment_micros: 0,
        sync_micros: 3,
        async_micros: 300,
        source_offset: None,
    }
}

fn snapshot(id: u64) -> TaskAction {
    TaskAction::Snapshot {
        checkpoint: c(id),
        trans: TransId(id as u32),
        kind: CheckpointKind::Checkpoint,
    }
}

/// Aggregate 20 (upstreams 1, 2; downstream 40) aligned and snapshotted for `id`.
fn aligned_aggregate(id: u64) -> TaskMachine {
    let mut agg = aggregate(&[1, 2], &[40]);
    agg.handle_message(T0, &barrier(1, 20, id)).unwrap();
    agg.handle_message(T0, &barrier(2, 20, id)).unwrap();
    actions(&mut agg);
    agg
}

// --- sources ---------------------------------------------------------------------------

#[test]
fn source_queues_the_barrier_behind_accepted_input() {
    let mut src = source(&[40]);
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    assert_eq!(
        actions(&mut src),
        vec![TaskAction::QueueBarrier { checkpoint: c(1) }]
    );
    assert_eq!(src.status(), TaskStatus::Checkpointing);
    // Nothing is snapshotted until the driver's processing reaches the marker.
    src.handle_timeout(Time::from_millis(10));
    assert_eq!(actions(&mut src), vec![]);
}

#[test]
fn source_flushes_snapshots_then_sends_the_barrier_to_every_downstream() {
    let mut src = source(&[40, 41]);
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    actions(&mut src);
    src.handle_source_barrier(T0, c(1));
    let got = actions(&mut src);
    assert_eq!(got[0], TaskAction::FlushOutput { checkpoint: c(1) });
    assert_eq!(got[1], snapshot(1));
    assert_eq!(got[2], TaskAction::Send(barrier(10, 40, 1)));
    assert_eq!(got[3], TaskAction::Send(barrier(10, 41, 1)));
    assert_eq!(got.len(), 4);
}

#[test]
fn source_marker_of_an_aborted_checkpoint_is_ignored() {
    let mut src = source(&[40]);
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    src.handle_message(T0, &abort(10, 1)).unwrap();
    actions(&mut src);
    src.handle_source_barrier(T0, c(1));
    assert_eq!(actions(&mut src), vec![]);
    assert_eq!(src.status(), TaskStatus::Ready);
}

#[test]
fn duplicate_checkpoint_source_is_ignored_until_built_then_answered_again() {
    let mut src = source(&[40]);
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    assert_eq!(actions(&mut src).len(), 1, "one marker only");
    src.handle_source_barrier(T0, c(1));
    src.handle_snapshot_exported(T0, c(1), report(10));
    src.handle_message(T0, &ready(10, 40, 1)).unwrap();
    let built = sent(&actions(&mut src));
    assert_eq!(
        built,
        vec![
            MessageKind::Barrier,
            MessageKind::CheckpointReadyAck,
            MessageKind::CheckpointSourceRsp,
            MessageKind::CheckpointReport
        ]
    );
    // The coordinator re-sends its request: our response was lost.
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    assert_eq!(
        sent(&actions(&mut src)),
        vec![
            MessageKind::CheckpointSourceRsp,
            MessageKind::CheckpointReport
        ]
    );
}

#[test]
fn source_without_downstreams_builds_once_exported() {
    let config = TaskConfig::new(S, t(10), NODE, TaskLevel::Source);
    let mut src = TaskMachine::new(config, None).unwrap();
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    src.handle_source_barrier(T0, c(1));
    actions(&mut src);
    src.handle_snapshot_exported(T0, c(1), report(10));
    assert_eq!(
        sent(&actions(&mut src)),
        vec![
            MessageKind::CheckpointSourceRsp,
            MessageKind::CheckpointReport
        ]
    );
}

// --- alignment -------------------------------------------------------------------------

#[test]
fn alignment_blocks_exactly_the_upstreams_whose_barrier_arrived() {
    let mut agg = aggregate(&[1, 2, 3], &[40]);
    agg.handle_message(T0, &barrier(2, 20, 1)).unwrap();
    let got = actions(&mut agg);
    assert_eq!(sent(&got), vec![MessageKind::BarrierAck]);
    assert!(got.contains(&TaskAction::BlockInput(t(2))));
    assert_eq!(
        agg.blocked_inputs().iter().copied().collect::<Vec<_>>(),
        vec![t(2)]
    );
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    assert!(actions(&mut agg).contains(&TaskAction::BlockInput(t(1))));
    // The last barrier aligns: flush, snapshot, barrier out, then reopen — never
    // blocking the last input at all.
    agg.handle_message(Time::from_millis(5), &barrier(3, 20, 1))
        .unwrap();
    let got = actions(&mut agg);
    let kinds: Vec<&TaskAction> = got
        .iter()
        .filter(|a| !matches!(a, TaskAction::Send(Message::BarrierAck(_))))
        .collect();
    assert_eq!(*kinds[0], TaskAction::FlushOutput { checkpoint: c(1) });
    assert_eq!(*kinds[1], snapshot(1));
    assert_eq!(*kinds[2], TaskAction::Send(barrier(20, 40, 1)));
    assert_eq!(
        kinds[3..].iter().map(|a| (*a).clone()).collect::<Vec<_>>(),
        vec![TaskAction::OpenInput(t(1)), TaskAction::OpenInput(t(2))]
    );
    assert!(agg.blocked_inputs().is_empty());
}

#[test]
fn expired_barrier_is_discarded() {
    let mut agg = aligned_aggregate(3);
    agg.handle_message(T0, &complete(20, 3)).unwrap();
    actions(&mut agg);
    agg.handle_message(T0, &barrier(1, 20, 2)).unwrap();
    assert_eq!(actions(&mut agg), vec![]);
}

#[test]
fn barrier_of_the_completed_checkpoint_resends_ready_and_reopens() {
    let mut agg = aligned_aggregate(3);
    agg.handle_message(T0, &complete(20, 3)).unwrap();
    actions(&mut agg);
    agg.handle_message(T0, &barrier(1, 20, 3)).unwrap();
    assert_eq!(actions(&mut agg), vec![TaskAction::Send(ready(1, 20, 3))]);
}

#[test]
fn barrier_of_another_older_checkpoint_is_discarded_while_aligning() {
    let mut agg = aggregate(&[1, 2], &[40]);
    agg.handle_message(T0, &barrier(1, 20, 5)).unwrap();
    actions(&mut agg);
    agg.handle_message(T0, &barrier(2, 20, 4)).unwrap();
    assert_eq!(actions(&mut agg), vec![]);
    assert_eq!(agg.aligning().map(|(id, _)| id), Some(c(5)));
}

#[test]
fn newer_barrier_supersedes_an_alignment_that_can_no_longer_complete() {
    let mut agg = aggregate(&[1, 2], &[40]);
    agg.handle_message(T0, &barrier(1, 20, 5)).unwrap();
    actions(&mut agg);
    // Upstream 1 sends 6: it never had 5 to send on this channel again, and upstream 2
    // skipped 5 entirely. 5 is dead; align 6.
    agg.handle_message(T0, &barrier(2, 20, 6)).unwrap();
    let got = actions(&mut agg);
    assert!(
        got.contains(&TaskAction::OpenInput(t(1))),
        "input blocked for 5 reopened"
    );
    assert!(got.contains(&TaskAction::BlockInput(t(2))));
    assert_eq!(agg.aligning().map(|(id, _)| id), Some(c(6)));
}

#[test]
fn barrier_after_all_barriers_are_in_is_discarded() {
    let mut agg = aligned_aggregate(1);
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    assert_eq!(actions(&mut agg), vec![]);
}

#[test]
fn second_barrier_from_the_same_upstream_is_discarded() {
    let mut agg = aggregate(&[1, 2], &[40]);
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    actions(&mut agg);
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    assert_eq!(actions(&mut agg), vec![]);
    assert_eq!(agg.aligning().map(|(_, arrived)| arrived.len()), Some(1));
}

// --- ready fan-in, build ---------------------------------------------------------------

#[test]
fn ready_fan_in_waits_for_every_downstream_and_acknowledges_duplicates() {
    let mut agg = aggregate(&[1], &[40, 41]);
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    agg.handle_snapshot_exported(T0, c(1), report(20));
    actions(&mut agg);
    agg.handle_message(T0, &ready(20, 40, 1)).unwrap();
    assert_eq!(
        sent(&actions(&mut agg)),
        vec![MessageKind::CheckpointReadyAck]
    );
    agg.handle_message(T0, &ready(20, 40, 1)).unwrap();
    assert_eq!(
        sent(&actions(&mut agg)),
        vec![MessageKind::CheckpointReadyAck],
        "duplicate acked again, no build"
    );
    agg.handle_message(T0, &ready(20, 41, 1)).unwrap();
    assert_eq!(
        sent(&actions(&mut agg)),
        vec![
            MessageKind::CheckpointReadyAck,
            MessageKind::CheckpointReport,
            MessageKind::CheckpointReady
        ]
    );
}

#[test]
fn ready_for_a_checkpoint_not_in_progress_is_discarded() {
    let mut agg = aggregate(&[1], &[40]);
    agg.handle_message(T0, &ready(20, 40, 7)).unwrap();
    assert_eq!(actions(&mut agg), vec![]);
}

#[test]
fn build_waits_for_the_export() {
    let mut agg = aggregate(&[1], &[40]);
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    agg.handle_message(T0, &ready(20, 40, 1)).unwrap();
    assert!(!sent(&actions(&mut agg)).contains(&MessageKind::CheckpointReport));
    agg.handle_snapshot_exported(Time::from_millis(3), c(1), report(20));
    let got = actions(&mut agg);
    let report = got.iter().find_map(|a| match a {
        TaskAction::Send(Message::CheckpointReport(r)) => Some(r.clone()),
        _ => None,
    });
    assert!(matches!(
        report.map(|r| r.outcome),
        Some(ReportOutcome::Built(_))
    ));
}

#[test]
fn sink_pre_commits_at_alignment_reopens_and_builds_after_export() {
    let mut snk = sink(&[1, 2]);
    snk.handle_message(T0, &barrier(1, 30, 1)).unwrap();
    snk.handle_message(T0, &barrier(2, 30, 1)).unwrap();
    let got = actions(&mut snk);
    assert!(
        !got.iter()
            .any(|a| matches!(a, TaskAction::FlushOutput { .. })),
        "a sink has no output to flush"
    );
    let at = got.iter().position(|a| *a == snapshot(1)).unwrap();
    assert!(
        got[at..].contains(&TaskAction::OpenInput(t(1))),
        "inputs reopen after the pre-commit"
    );
    snk.handle_snapshot_exported(T0, c(1), report(30));
    assert_eq!(
        sent(&actions(&mut snk)),
        vec![
            MessageKind::CheckpointReport,
            MessageKind::CheckpointReady,
            MessageKind::CheckpointReady
        ]
    );
}

#[test]
fn alignment_time_is_reported() {
    let mut snk = sink(&[1, 2]);
    snk.handle_message(Time::from_millis(10), &barrier(1, 30, 1))
        .unwrap();
    snk.handle_message(Time::from_millis(17), &barrier(2, 30, 1))
        .unwrap();
    snk.handle_snapshot_exported(Time::from_millis(20), c(1), report(30));
    let alignment = actions(&mut snk).iter().find_map(|a| match a {
        TaskAction::Send(Message::CheckpointReport(CheckpointReport {
            outcome: ReportOutcome::Built(r),
            ..
        })) => Some(r.alignment_micros),
        _ => None,
    });
    assert_eq!(alignment, Some(7_000));
}

// --- failure ---------------------------------------------------------------------------

#[test]
fn failed_snapshot_clears_reports_and_is_remembered() {
    let mut agg = aligned_aggregate(1);
    agg.handle_snapshot_failed(T0, c(1), "disk full");
    let got = actions(&mut agg);
    assert!(got.contains(&TaskAction::Discard { checkpoint: c(1) }));
    let failure = got.iter().find_map(|a| match a {
        TaskAction::Send(Message::CheckpointReport(r)) => Some(r.outcome.clone()),
        _ => None,
    });
    assert_eq!(
        failure,
        Some(ReportOutcome::Failed {
            reason: "disk full".into()
        })
    );
    assert_eq!(agg.failed_checkpoint(), Some(c(1)));
    assert_eq!(agg.status(), TaskStatus::Ready);
    assert!(agg.blocked_inputs().is_empty());
    // Messages for the failed id are discarded.
    agg.handle_message(T0, &ready(20, 40, 1)).unwrap();
    assert_eq!(actions(&mut agg), vec![]);
}

// --- barrier monitor -------------------------------------------------------------------

#[test]
fn barrier_monitor_retrieves_missing_barriers_and_rearms() {
    let mut agg = aggregate(&[1, 2, 3], &[40]);
    agg.handle_message(T0, &barrier(2, 20, 1)).unwrap();
    actions(&mut agg);
    let due = agg.poll_timeout().unwrap();
    assert_eq!(due, T0 + Duration::from_secs(10));
    agg.handle_timeout(due);
    let retrieved: Vec<TaskId> = actions(&mut agg)
        .iter()
        .filter_map(|a| match a {
            TaskAction::Send(Message::RetrieveBarrier(r)) => Some(r.upstream),
            _ => None,
        })
        .collect();
    assert_eq!(retrieved, vec![t(1), t(3)]);
    assert_eq!(agg.poll_timeout(), Some(due + Duration::from_secs(10)));
}

#[test]
fn retrieve_is_answered_not_yet_or_already_sent() {
    let mut src = source(&[40]);
    let ask: Message = RetrieveBarrier {
        stream: S,
        upstream: t(10),
        downstream: t(40),
        downstream_node: NODE,
        checkpoint: c(1),
    }
    .into();
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    actions(&mut src);
    src.handle_message(T0, &ask).unwrap();
    let answer = |got: Vec<TaskAction>| match &got[..] {
        [TaskAction::Send(Message::RetrieveBarrierRsp(r))] => r.answer,
        other => panic!("{other:?}"),
    };
    assert_eq!(answer(actions(&mut src)), RetrieveAnswer::NotYetSent);
    src.handle_source_barrier(T0, c(1));
    actions(&mut src);
    src.handle_message(T0, &ask).unwrap();
    assert_eq!(
        answer(actions(&mut src)),
        RetrieveAnswer::AlreadySent {
            trans: TransId(1),
            kind: CheckpointKind::Checkpoint
        }
    );
}

#[test]
fn already_sent_answer_does_not_stand_in_for_the_barrier() {
    let mut agg = aggregate(&[1, 2], &[40]);
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    actions(&mut agg);
    let answer: Message = RetrieveBarrierRsp {
        stream: S,
        upstream: t(2),
        downstream: t(20),
        checkpoint: c(1),
        answer: RetrieveAnswer::AlreadySent {
            trans: TransId(1),
            kind: CheckpointKind::Checkpoint,
        },
    }
    .into();
    agg.handle_message(T0, &answer).unwrap();
    assert_eq!(
        actions(&mut agg),
        vec![],
        "still waiting for the in-band barrier"
    );
    assert_eq!(
        agg.retrieve_answers().and_then(|a| a.get(&t(2)).copied()),
        Some(RetrieveAnswer::AlreadySent {
            trans: TransId(1),
            kind: CheckpointKind::Checkpoint
        })
    );
}

#[test]
fn barrier_ack_is_recorded() {
    let mut src = source(&[40]);
    src.handle_message(T0, &source_request(10, 1)).unwrap();
    src.handle_source_barrier(T0, c(1));
    actions(&mut src);
    let ack: Message = BarrierAck {
        stream: S,
        upstream: t(10),
        downstream: t(40),
        checkpoint: c(1),
    }
    .into();
    src.handle_message(T0, &ack).unwrap();
    assert_eq!(actions(&mut src), vec![]);
}

// --- complete, abort, re-sends ---------------------------------------------------------

#[test]
fn complete_commits_reopens_and_returns_to_ready() {
    let mut agg = aggregate(&[1, 2], &[40]);
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    agg.handle_message(T0, &barrier(2, 20, 1)).unwrap();
    agg.handle_message(T0, &barrier(1, 20, 2)).unwrap(); // aligning 2, input 1 blocked
    actions(&mut agg);
    agg.handle_message(T0, &complete(20, 2)).unwrap();
    let got = actions(&mut agg);
    assert!(got.contains(&TaskAction::OpenInput(t(1))));
    assert!(got.contains(&TaskAction::Commit {
        checkpoint: c(2),
        source_offset: None
    }));
    assert_eq!(agg.last_completed(), Some(c(2)));
    assert_eq!(agg.status(), TaskStatus::Ready);
}

#[test]
fn stale_complete_is_ignored() {
    let mut agg = aligned_aggregate(2);
    agg.handle_message(T0, &complete(20, 2)).unwrap();
    actions(&mut agg);
    agg.handle_message(T0, &complete(20, 1)).unwrap();
    agg.handle_message(T0, &complete(20, 2)).unwrap();
    assert_eq!(actions(&mut agg), vec![]);
}

#[test]
fn complete_subsumes_older_builds() {
    let mut agg = aligned_aggregate(1);
    agg.handle_message(T0, &barrier(1, 20, 2)).unwrap();
    agg.handle_message(T0, &barrier(2, 20, 2)).unwrap();
    actions(&mut agg);
    agg.handle_message(T0, &complete(20, 2)).unwrap();
    let got = actions(&mut agg);
    assert_eq!(
        got,
        vec![
            TaskAction::Discard { checkpoint: c(1) },
            TaskAction::Commit {
                checkpoint: c(2),
                source_offset: None
            }
        ]
    );
    assert_eq!(agg.building().count(), 0);
}

#[test]
fn abort_drops_the_snapshot_and_the_alignment() {
    let mut agg = aligned_aggregate(1);
    agg.handle_message(T0, &abort(20, 1)).unwrap();
    assert_eq!(
        actions(&mut agg),
        vec![TaskAction::Discard { checkpoint: c(1) }]
    );
    agg.handle_message(T0, &barrier(1, 20, 2)).unwrap();
    actions(&mut agg);
    agg.handle_message(T0, &abort(20, 2)).unwrap();
    assert_eq!(actions(&mut agg), vec![TaskAction::OpenInput(t(1))]);
    assert_eq!(agg.status(), TaskStatus::Ready);
}

#[test]
fn report_and_ready_are_resent_until_acknowledged_or_decided() {
    let mut snk = sink(&[1, 2]);
    snk.handle_message(T0, &barrier(1, 30, 1)).unwrap();
    snk.handle_message(T0, &barrier(2, 30, 1)).unwrap();
    snk.handle_snapshot_exported(T0, c(1), report(30));
    actions(&mut snk);
    let ack: Message = CheckpointReadyAck {
        stream: S,
        upstream: t(1),
        downstream: t(30),
        checkpoint: c(1),
    }
    .into();
    snk.handle_message(T0, &ack).unwrap();
    let due = snk.poll_timeout().unwrap();
    assert_eq!(due, T0 + Duration::from_secs(1));
    snk.handle_timeout(due);
    let got = actions(&mut snk);
    assert_eq!(
        sent(&got),
        vec![MessageKind::CheckpointReport, MessageKind::CheckpointReady]
    );
    assert!(
        got.contains(&TaskAction::Send(ready(2, 30, 1))),
        "only the upstream that did not acknowledge"
    );
    snk.handle_message(T0, &complete(30, 1)).unwrap();
    actions(&mut snk);
    assert_eq!(snk.poll_timeout(), None, "decided: nothing more to re-send");
}

// --- lifecycle -------------------------------------------------------------------------

#[test]
fn halt_fails_the_alignment_and_refuses_new_checkpoints_until_resumed() {
    let mut agg = aggregate(&[1, 2], &[40]);
    agg.handle_message(T0, &barrier(1, 20, 1)).unwrap();
    actions(&mut agg);
    agg.handle_halt(T0);
    let got = actions(&mut agg);
    assert!(got.contains(&TaskAction::OpenInput(t(1))));
    assert_eq!(sent(&got), vec![MessageKind::CheckpointReport]);
    assert_eq!(agg.status(), TaskStatus::Halted);
    agg.handle_message(T0, &barrier(1, 20, 2)).unwrap();
    assert_eq!(
        sent(&actions(&mut agg)),
        vec![MessageKind::CheckpointReport],
        "refused with a failure report"
    );
    agg.handle_resume(T0);
    agg.handle_message(T0, &barrier(1, 20, 3)).unwrap();
    assert!(actions(&mut agg).contains(&TaskAction::BlockInput(t(1))));
}

#[test]
fn pause_keeps_checkpoint_traffic_going() {
    let mut agg = aligned_aggregate(1);
    agg.handle_pause(T0);
    assert_eq!(agg.status(), TaskStatus::Paused);
    agg.handle_snapshot_exported(T0, c(1), report(20));
    agg.handle_message(T0, &ready(20, 40, 1)).unwrap();
    assert!(sent(&actions(&mut agg)).contains(&MessageKind::CheckpointReport));
    agg.handle_resume(T0);
    assert_eq!(agg.status(), TaskStatus::Checkpointing);
}

#[test]
fn drop_discards_everything_and_stop_ignores_all_input() {
    let mut agg = aligned_aggregate(1);
    agg.handle_message(T0, &barrier(1, 20, 2)).unwrap();
    actions(&mut agg);
    agg.handle_drop(T0);
    let got = actions(&mut agg);
    assert!(got.contains(&TaskAction::Discard { checkpoint: c(1) }));
    assert!(got.contains(&TaskAction::OpenInput(t(1))));
    assert_eq!(agg.status(), TaskStatus::Dropping);
    agg.handle_message(T0, &barrier(2, 20, 3)).unwrap();
    agg.handle_message(T0, &complete(20, 1)).unwrap();
    assert_eq!(actions(&mut agg), vec![]);
    agg.handle_stop(T0);
    assert_eq!(agg.status(), TaskStatus::Stopped);
    assert_eq!(agg.poll_timeout(), None);
}

#[test]
fn restored_task_commits_its_checkpoint_first() {
    let config = TaskConfig::new(S, t(30), NODE, TaskLevel::Sink).upstreams([t(1)]);
    let restored = RestoredCheckpoint {
        checkpoint: c(4),
        trans: TransId(4),
        kind: CheckpointKind::Checkpoint,
        source_offset: None,
    };
    let mut snk = TaskMachine::new(config, Some(restored)).unwrap();
    assert_eq!(
        actions(&mut snk),
        vec![TaskAction::Commit {
            checkpoint: c(4),
            source_offset: None
        }]
    );
    snk.handle_message(T0, &barrier(1, 30, 4)).unwrap();
    assert_eq!(sent(&actions(&mut snk)), vec![MessageKind::CheckpointReady]);
}

// --- bad input -------------------------------------------------------------------------

#[test]
fn misrouted_messages_are_typed_errors_and_change_nothing() {
    let mut agg = aggregate(&[1], &[40]);
    let foreign: Message = Barrier {
        stream: StreamId(9),
        upstream: t(1),
        downstream: t(20),
        checkpoint: c(1),
        trans: TransId(1),
        kind: CheckpointKind::Checkpoint,
    }
    .into();
    assert_eq!(
        agg.handle_message(T0, &foreign),
        Err(TaskError::WrongStream {
            expected: S,
            found: StreamId(9)
        })
    );
    assert_eq!(
        agg.handle_message(T0, &barrier(1, 21, 1)),
        Err(TaskError::WrongTask {
            kind: MessageKind::Barrier,
            to: t(21),
            this: t(20)
        })
    );
    assert_eq!(
        agg.handle_message(T0, &barrier(7, 20, 1)),
        Err(TaskError::UnknownPeer {
            kind: MessageKind::Barrier,
            from: t(7),
            direction: "upstream"
        })
    );
    assert_eq!(
        agg.handle_message(T0, &ready(20, 41, 1)),
        Err(TaskError::UnknownPeer {
            kind: MessageKind::CheckpointReady,
            from: t(41),
            direction: "downstream"
        })
    );
    assert_eq!(
        agg.handle_message(T0, &source_request(20, 1)),
        Err(TaskError::NotASource(t(20)))
    );
    let data: Message = Data {
        stream: S,
        upstream: t(1),
        downstream: t(20),
        records: 0,
        payload: bytes::Bytes::new(),
    }
    .into();
    assert_eq!(
        agg.handle_message(T0, &data),
        Err(TaskError::UnexpectedKind(MessageKind::Data))
    );
    assert_eq!(actions(&mut agg), vec![]);
    assert_eq!(agg.status(), TaskStatus::Ready);
}

#[test]
fn invalid_task_configs_are_refused() {
    let base = |level| TaskConfig::new(S, t(5), NODE, level);
    let check = |config: TaskConfig, expected: ConfigError| {
        assert_eq!(TaskMachine::new(config, None).map(|_| ()), Err(expected));
    };
    check(
        base(TaskLevel::Source).upstreams([t(1)]),
        ConfigError::Upstreams {
            level: TaskLevel::Source,
            count: 1,
        },
    );
    check(
        base(TaskLevel::Aggregate).downstreams([t(9)]),
        ConfigError::Upstreams {
            level: TaskLevel::Aggregate,
            count: 0,
        },
    );
    check(
        base(TaskLevel::Sink).upstreams([t(1)]).downstreams([t(9)]),
        ConfigError::Downstreams {
            level: TaskLevel::Sink,
            count: 1,
        },
    );
    check(
        base(TaskLevel::Sink).upstreams([t(1), t(1)]),
        ConfigError::DuplicatePeer(t(1)),
    );
    check(
        base(TaskLevel::Sink).upstreams([t(5)]),
        ConfigError::SelfEdge(t(5)),
    );
    let mut zero = base(TaskLevel::Sink).upstreams([t(1)]);
    zero.barrier_wait = Duration::ZERO;
    check(zero, ConfigError::ZeroInterval);
}
