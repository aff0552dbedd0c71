//! One named test per behaviour of the checkpoint coordinator (the table in
//! `docs/state-machines.md` points here).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use stillpoint_task::*;
use stillpoint_wire::*;

const S: StreamId = StreamId(1);

fn t(n: u32) -> TaskId {
    TaskId(n)
}

fn c(n: u64) -> CheckpointId {
    CheckpointId(n)
}

fn at(ms: u64) -> Time {
    Time::from_millis(ms)
}

/// Sources 1 and 2, sink 3; interval 1 s, timeout 10 s.
fn config() -> CoordinatorConfig {
    let mut config = CoordinatorConfig::new(S, vec![t(1), t(2)], vec![t(1), t(2), t(3)]);
    config.timeout = Duration::from_secs(10);
    config
}

fn coordinator(config: CoordinatorConfig) -> Coordinator {
    Coordinator::new(config, Time::ZERO, None, c(1)).unwrap()
}

fn actions(co: &mut Coordinator) -> Vec<CoordinatorAction> {
    std::iter::from_fn(|| co.poll_action()).collect()
}

/// The checkpoint ids of `CheckpointSource` requests among `actions`, per task.
fn requests(actions: &[CoordinatorAction]) -> Vec<(TaskId, CheckpointId, CheckpointKind)> {
    actions
        .iter()
        .filter_map(|a| match a {
            CoordinatorAction::Send(Message::CheckpointSource(m)) => {
                Some((m.task, m.checkpoint, m.kind))
            }
            _ => None,
        })
        .collect()
}

fn snapshot_report(offset: Option<u64>) -> SnapshotReport {
    SnapshotReport {
        manifest: RelativePath::new("m").unwrap(),
        manifest_sha256: Sha256Digest([0; 32]),
        state_bytes: 100,
        uploaded_bytes: 10,
        files: 1,
        uploaded_files: 1,
        alignment_micros: 5,
        sync_micros: 2,
        async_micros: 50,
        source_offset: offset.map(SourceOffset::from_u64),
    }
}

fn built(task: u32, id: u64, trans: u32) -> Message {
    let offset = (task != 3).then_some(u64::from(task) * 100);
    CheckpointReport {
        stream: S,
        task: t(task),
        node: NodeId(1),
        checkpoint: c(id),
        trans: TransId(trans),
        outcome: ReportOutcome::Built(snapshot_report(offset)),
    }
    .into()
}

fn failed(task: u32, id: u64, trans: u32) -> Message {
    CheckpointReport {
        stream: S,
        task: t(task),
        node: NodeId(1),
        checkpoint: c(id),
        trans: TransId(trans),
        outcome: ReportOutcome::Failed {
            reason: "disk".into(),
        },
    }
    .into()
}

fn responded(task: u32, id: u64, trans: u32) -> Message {
    CheckpointSourceRsp {
        stream: S,
        task: t(task),
        node: NodeId(1),
        checkpoint: c(id),
        trans: TransId(trans),
    }
    .into()
}

/// Everything checkpoint `id` (transaction `trans`) needs except the last report.
fn all_but_sink(co: &mut Coordinator, now: Time, id: u64, trans: u32) {
    for m in [
        built(1, id, trans),
        built(2, id, trans),
        responded(1, id, trans),
        responded(2, id, trans),
    ] {
        co.handle_message(now, &m).unwrap();
    }
}

/// Both sources of the test dataflow asked for checkpoint `id`.
fn sources_asked(id: u64) -> Vec<(TaskId, CheckpointId, CheckpointKind)> {
    vec![
        (t(1), c(id), CheckpointKind::Checkpoint),
        (t(2), c(id), CheckpointKind::Checkpoint),
    ]
}

#[test]
fn triggers_on_the_interval() {
    let mut co = coordinator(config());
    assert_eq!(co.poll_timeout(), Some(at(1000)));
    co.handle_timeout(at(999));
    assert_eq!(actions(&mut co), vec![]);
    co.handle_timeout(at(1000));
    assert_eq!(requests(&actions(&mut co)), sources_asked(1));
}

#[test]
fn a_requested_checkpoint_comes_at_once_but_within_the_limits() {
    let mut cfg = config();
    cfg.interval = Duration::from_secs(3600);
    cfg.min_pause = Duration::from_millis(500);
    let mut co = coordinator(cfg);
    co.request_checkpoint(at(10));
    assert_eq!(requests(&actions(&mut co)), sources_asked(1));
    // One in flight already: a second request waits for it.
    co.request_checkpoint(at(20));
    assert_eq!(requests(&actions(&mut co)), vec![]);
    all_but_sink(&mut co, at(30), 1, 1);
    co.handle_message(at(30), &built(3, 1, 1)).unwrap();
    co.handle_manifest_written(at(40), c(1), Ok(7));
    actions(&mut co);
    // The minimum pause still holds after a completion, and the interval restarted
    // from the requested trigger.
    co.request_checkpoint(at(100));
    assert_eq!(requests(&actions(&mut co)), vec![]);
    assert_eq!(co.poll_timeout(), Some(at(540)));
    co.handle_timeout(at(540));
    assert_eq!(requests(&actions(&mut co)).len(), 2);
}

#[test]
fn at_most_max_concurrent_checkpoints_are_in_flight() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    co.handle_timeout(at(2000));
    co.handle_timeout(at(3000));
    assert_eq!(co.in_flight().collect::<Vec<_>>(), vec![c(1)]);
    let mut two = config();
    two.max_concurrent = 2;
    let mut co = coordinator(two);
    co.handle_timeout(at(1000));
    co.handle_timeout(at(2000));
    co.handle_timeout(at(3000));
    assert_eq!(co.in_flight().collect::<Vec<_>>(), vec![c(1), c(2)]);
}

#[test]
fn minimum_pause_separates_the_end_of_one_checkpoint_from_the_next() {
    let mut cfg = config();
    cfg.min_pause = Duration::from_millis(1500);
    let mut co = coordinator(cfg);
    co.handle_timeout(at(1000));
    all_but_sink(&mut co, at(1200), 1, 1);
    co.handle_message(at(1200), &built(3, 1, 1)).unwrap();
    co.handle_manifest_written(at(1300), c(1), Ok(7));
    actions(&mut co);
    // The interval says 2000; the pause since completion at 1300 says 2800.
    assert_eq!(co.poll_timeout(), Some(at(2800)));
    co.handle_timeout(at(2000));
    assert_eq!(requests(&actions(&mut co)), vec![]);
    co.handle_timeout(at(2800));
    assert_eq!(requests(&actions(&mut co)).len(), 2);
}

#[test]
fn completes_only_when_every_source_responded_and_every_report_is_in_and_the_manifest_is_written() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    actions(&mut co);
    all_but_sink(&mut co, at(1100), 1, 1);
    assert_eq!(actions(&mut co), vec![], "the sink has not reported");
    co.handle_message(at(1200), &built(3, 1, 1)).unwrap();
    let got = actions(&mut co);
    let [CoordinatorAction::WriteManifest(request)] = &got[..] else {
        panic!("{got:?}")
    };
    assert_eq!(
        request.tasks.iter().map(|r| r.task).collect::<Vec<_>>(),
        vec![t(1), t(2), t(3)]
    );
    assert_eq!(
        co.last_completed(),
        None,
        "not complete before the manifest is written"
    );
    co.handle_manifest_written(at(1300), c(1), Ok(1_764_633_600_000));
    let got = actions(&mut co);
    let completes: Vec<(TaskId, Option<u64>)> = got
        .iter()
        .filter_map(|a| match a {
            CoordinatorAction::Send(Message::CheckpointComplete(m)) => Some((
                m.task,
                m.source_offset.as_ref().and_then(SourceOffset::as_u64),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        completes,
        vec![(t(1), Some(100)), (t(2), Some(200)), (t(3), None)]
    );
    let Some(CoordinatorAction::Completed(done)) = got.last() else {
        panic!("{got:?}")
    };
    assert_eq!(
        (done.checkpoint, done.duration, done.state_bytes),
        (c(1), Duration::from_millis(300), 300)
    );
    assert_eq!(co.last_completed(), Some(c(1)));
}

#[test]
fn a_source_response_alone_does_not_complete() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    for m in [
        built(1, 1, 1),
        built(2, 1, 1),
        built(3, 1, 1),
        responded(1, 1, 1),
    ] {
        co.handle_message(at(1100), &m).unwrap();
    }
    assert!(
        !actions(&mut co)
            .iter()
            .any(|a| matches!(a, CoordinatorAction::WriteManifest(_)))
    );
}

#[test]
fn failed_manifest_write_aborts() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    all_but_sink(&mut co, at(1100), 1, 1);
    co.handle_message(at(1100), &built(3, 1, 1)).unwrap();
    actions(&mut co);
    co.handle_manifest_written(at(1200), c(1), Err("lease lost".into()));
    let got = actions(&mut co);
    assert!(got.contains(&CoordinatorAction::Aborted {
        checkpoint: c(1),
        reason: AbortReason::StoreFailed
    }));
    assert_eq!(
        got.iter()
            .filter(|a| matches!(a, CoordinatorAction::Send(Message::CheckpointAbort(_))))
            .count(),
        3
    );
    assert_eq!(co.last_completed(), None);
}

#[test]
fn a_task_failure_aborts_the_checkpoint() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    actions(&mut co);
    co.handle_message(at(1100), &failed(3, 1, 1)).unwrap();
    assert!(actions(&mut co).contains(&CoordinatorAction::Aborted {
        checkpoint: c(1),
        reason: AbortReason::TaskFailed(t(3))
    }));
    assert_eq!(co.consecutive_failures(), 1);
}

#[test]
fn timeout_aborts_and_too_many_consecutive_failures_fail_the_job() {
    let mut cfg = config();
    cfg.tolerable_failures = 1;
    let mut co = coordinator(cfg);
    co.handle_timeout(at(1000));
    actions(&mut co);
    co.handle_timeout(at(11_000));
    let got = actions(&mut co);
    assert!(got.contains(&CoordinatorAction::Aborted {
        checkpoint: c(1),
        reason: AbortReason::Timeout
    }));
    assert!(
        !got.iter()
            .any(|a| matches!(a, CoordinatorAction::FailJob { .. })),
        "one failure is tolerated"
    );
    co.handle_timeout(at(21_000));
    let got = actions(&mut co);
    assert!(got.contains(&CoordinatorAction::FailJob {
        consecutive_failures: 2,
        last: AbortReason::Timeout
    }));
    // Nothing new starts until the failover is handled.
    co.handle_timeout(at(40_000));
    assert_eq!(requests(&actions(&mut co)), vec![]);
    co.handle_failover(at(40_000)).unwrap();
    assert_eq!(co.consecutive_failures(), 0);
    co.handle_timeout(at(41_000));
    assert_eq!(
        requests(&actions(&mut co)).first().map(|r| r.1),
        Some(c(3)),
        "1 and 2 are never reused"
    );
}

#[test]
fn a_completion_resets_the_failure_count() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    co.handle_timeout(at(11_000)); // 1 times out, 2 triggers
    all_but_sink(&mut co, at(11_100), 2, 2);
    co.handle_message(at(11_100), &built(3, 2, 2)).unwrap();
    co.handle_manifest_written(at(11_200), c(2), Ok(1));
    assert_eq!(co.consecutive_failures(), 0);
}

#[test]
fn user_savepoint_is_triggered_at_once_as_a_savepoint() {
    let mut co = coordinator(config());
    assert!(!co.savepoint_pending());
    co.request_savepoint(at(10)).unwrap();
    assert_eq!(requests(&actions(&mut co))[0].2, CheckpointKind::Savepoint);
    assert!(!co.savepoint_pending(), "triggered, so no longer pending");
    assert_eq!(co.request_savepoint(at(20)), Ok(()));
    assert!(co.savepoint_pending(), "queued behind the one in flight");
    assert_eq!(
        co.request_savepoint(at(30)),
        Err(CoordinatorError::SavepointPending),
        "queued behind the one in flight"
    );
}

#[test]
fn unanswered_source_requests_are_resent() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    actions(&mut co);
    co.handle_message(at(1100), &responded(1, 1, 1)).unwrap();
    co.handle_timeout(at(2000));
    assert_eq!(
        requests(&actions(&mut co)),
        vec![(t(2), c(1), CheckpointKind::Checkpoint)]
    );
}

#[test]
fn a_late_report_gets_its_verdict_again() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    all_but_sink(&mut co, at(1100), 1, 1);
    co.handle_message(at(1100), &built(3, 1, 1)).unwrap();
    co.handle_manifest_written(at(1200), c(1), Ok(9));
    actions(&mut co);
    // Task 2 missed its complete and re-sends its report.
    co.handle_message(at(1500), &built(2, 1, 1)).unwrap();
    let got = actions(&mut co);
    assert!(
        matches!(&got[..], [CoordinatorAction::Send(Message::CheckpointComplete(m))] if m.task == t(2) && m.source_offset.as_ref().and_then(SourceOffset::as_u64) == Some(200))
    );
    // A report for an aborted checkpoint gets an abort.
    co.handle_timeout(at(2000));
    co.handle_timeout(at(12_000));
    actions(&mut co);
    co.handle_message(at(12_100), &built(3, 2, 2)).unwrap();
    assert!(
        matches!(&actions(&mut co)[..], [CoordinatorAction::Send(Message::CheckpointAbort(m))] if m.checkpoint == c(2))
    );
}

#[test]
fn reports_of_an_older_attempt_are_ignored() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    actions(&mut co);
    co.handle_message(at(1100), &failed(3, 1, 99)).unwrap();
    assert_eq!(actions(&mut co), vec![]);
}

#[test]
fn failover_drops_checkpoints_in_flight_and_refuses_during_a_manifest_write() {
    let mut co = coordinator(config());
    co.handle_timeout(at(1000));
    actions(&mut co);
    co.handle_failover(at(1500)).unwrap();
    assert_eq!(
        actions(&mut co),
        vec![CoordinatorAction::Aborted {
            checkpoint: c(1),
            reason: AbortReason::Cancelled
        }]
    );
    assert_eq!(co.poll_timeout(), Some(at(2500)));
    co.handle_timeout(at(2500));
    all_but_sink(&mut co, at(2600), 2, 2);
    co.handle_message(at(2600), &built(3, 2, 2)).unwrap();
    assert_eq!(
        co.handle_failover(at(2700)),
        Err(CoordinatorError::ManifestWriteInFlight(c(2)))
    );
}

#[test]
fn recovery_continues_after_the_latest_checkpoint_and_never_reuses_an_id() {
    let mut co = Coordinator::new(config(), Time::ZERO, Some(c(41)), c(45)).unwrap();
    assert_eq!(co.last_completed(), Some(c(41)));
    co.handle_timeout(at(1000));
    assert_eq!(requests(&actions(&mut co))[0].1, c(45));
    let mut co = Coordinator::new(config(), Time::ZERO, Some(c(41)), c(1)).unwrap();
    co.handle_timeout(at(1000));
    assert_eq!(requests(&actions(&mut co))[0].1, c(42));
}

#[test]
fn foreign_messages_and_bad_configs_are_typed_errors() {
    let mut co = coordinator(config());
    let foreign: Message = CheckpointSourceRsp {
        stream: StreamId(2),
        task: t(1),
        node: NodeId(1),
        checkpoint: c(1),
        trans: TransId(1),
    }
    .into();
    assert_eq!(
        co.handle_message(Time::ZERO, &foreign),
        Err(CoordinatorError::WrongStream {
            expected: S,
            found: StreamId(2)
        })
    );
    assert_eq!(
        co.handle_message(Time::ZERO, &responded(3, 1, 1)),
        Err(CoordinatorError::UnknownTask(t(3))),
        "not a source"
    );
    assert_eq!(
        co.handle_message(Time::ZERO, &built(9, 1, 1)),
        Err(CoordinatorError::UnknownTask(t(9)))
    );
    let barrier: Message = BarrierAck {
        stream: S,
        upstream: t(1),
        downstream: t(3),
        checkpoint: c(1),
    }
    .into();
    assert_eq!(
        co.handle_message(Time::ZERO, &barrier),
        Err(CoordinatorError::UnexpectedKind(MessageKind::BarrierAck))
    );

    let new = |cfg: CoordinatorConfig| Coordinator::new(cfg, Time::ZERO, None, c(1)).map(|_| ());
    assert_eq!(
        new(CoordinatorConfig::new(S, vec![], vec![t(1)])),
        Err(CoordinatorError::NoSources)
    );
    assert_eq!(
        new(CoordinatorConfig::new(S, vec![t(5)], vec![t(1)])),
        Err(CoordinatorError::SourceNotATask(t(5)))
    );
    let mut zero = config();
    zero.max_concurrent = 0;
    assert_eq!(new(zero), Err(CoordinatorError::ZeroSetting));
}
