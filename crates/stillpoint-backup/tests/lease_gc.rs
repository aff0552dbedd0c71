//! Lease and fencing, retention and garbage collection, and checkpoints on a store
//! that fails a share of its operations.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod support;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use stillpoint_backup::{
    FaultConfig, Lease, ListingStatus, ManualClock, Retention, RetryPolicy, Store, StoreError,
    StoreOptions, VerifyDepth, gc, lease_holder,
};
use stillpoint_wire::{CheckpointId, CheckpointKind, NodeId, TaskId};
use support::*;

#[test]
fn a_held_lease_is_refused_with_its_holder_and_expiry_and_taken_over_after_it() {
    let rt = runtime();
    rt.block_on(async {
        let store = Store::open("memory://", StoreOptions::default()).unwrap();
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let first = job_lease(&store, "node-a pid 1", &clock).await;
        assert_eq!(first.owner(), 1);

        let error = Lease::acquire_job(&store, quick_lease("node-b pid 2"), clock.clone())
            .await
            .unwrap_err();
        let message = error.to_string();
        assert!(
            matches!(&error, StoreError::LeaseHeld { holder, owner: 1, .. } if holder == "node-a pid 1"),
            "{message}"
        );
        assert!(message.contains("node-a pid 1") && message.contains("2023-11-14T22:14:20Z"), "{message}");

        // Refreshing keeps it: 50 s later the lease still has 60 s to run.
        clock.advance(Duration::from_secs(50));
        assert!(first.needs_refresh());
        first.refresh().await.unwrap();
        assert!(!first.needs_refresh());
        clock.advance(Duration::from_secs(50));
        assert!(Lease::acquire_job(&store, quick_lease("b"), clock.clone()).await.is_err());

        // Unrefreshed past its expiry, it is taken over with a higher owner id...
        clock.advance(Duration::from_secs(61));
        let second = job_lease(&store, "node-b pid 2", &clock).await;
        assert_eq!(second.owner(), 2);
        // ...and the old owner is fenced: it can neither refresh nor commit.
        assert!(matches!(first.check().await, Err(StoreError::LeaseLost { owner: 1, .. })));
        assert!(matches!(first.refresh().await, Err(StoreError::LeaseLost { .. })));
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("s");
        let manifest = snapshot(&local, TaskId(1), CheckpointId(1), &[("a", bytes(1, 10))], None);
        let uploaded = store.upload_snapshot(&local, &manifest, NodeId(1), &()).await.unwrap();
        let checkpoint = checkpoint_manifest(CheckpointId(1), CheckpointKind::Checkpoint, &[uploaded]);
        let refused = store.commit(&checkpoint, &first).await.unwrap_err();
        assert!(matches!(refused, StoreError::LeaseLost { owner: 1, .. }), "{refused}");
        assert!(store.committed_ids().await.unwrap().is_empty(), "the fenced writer committed");
        store.commit(&checkpoint, &second).await.unwrap();

        // Released leases are free at once, and owner ids keep growing.
        let now = clock.now();
        assert_eq!(lease_holder(&store, "lease/", now).await.unwrap().unwrap().owner, 2);
        second.release().await.unwrap();
        assert!(lease_holder(&store, "lease/", now).await.unwrap().is_none());
        let third = job_lease(&store, "node-c", &clock).await;
        assert_eq!(third.owner(), 3);
    });
}

trait Now {
    fn now(&self) -> u64;
}
impl Now for ManualClock {
    fn now(&self) -> u64 {
        stillpoint_backup::Clock::now_millis(self)
    }
}

#[test]
fn racing_writers_never_both_get_the_lease() {
    let rt = runtime();
    rt.block_on(async {
        for round in 0..20u64 {
            let dir = tempfile::tempdir().unwrap();
            let store = file_store(dir.path(), StoreOptions::default());
            let clock = Arc::new(ManualClock::new(1_000 + round));
            let attempts: Vec<_> = (0..4)
                .map(|i| {
                    let store = store.clone();
                    let clock = clock.clone();
                    tokio::spawn(async move {
                        Lease::acquire_job(&store, quick_lease(&format!("writer-{i}")), clock).await
                    })
                })
                .collect();
            let mut winners = Vec::new();
            for attempt in attempts {
                match attempt.await.unwrap() {
                    Ok(lease) => winners.push(lease),
                    Err(StoreError::LeaseHeld { .. } | StoreError::LeaseLost { .. }) => {}
                    Err(other) => panic!("unexpected {other}"),
                }
            }
            // At most one holds it now (the claim file makes ids unique); whoever
            // lost a race after writing sees it at its re-read or at its next check.
            let mut live = 0;
            for lease in &winners {
                if lease.check().await.is_ok() {
                    live += 1;
                }
            }
            assert!(live <= 1, "round {round}: {live} writers hold the lease");
            assert!(!winners.is_empty() || live == 0);
        }
    });
}

/// Commits checkpoints `ids` (2 is a savepoint), each adding one new file and keeping
/// one shared file.
async fn history(store: &Store, lease: &Lease, dir: &std::path::Path, ids: &[u64]) -> Vec<stillpoint_wire::SnapshotManifest> {
    let mut manifests: Vec<stillpoint_wire::SnapshotManifest> = Vec::new();
    for &id in ids {
        let kind = if id == 2 { CheckpointKind::Savepoint } else { CheckpointKind::Checkpoint };
        let files = vec![
            ("base.sst", bytes(0, 2000)),
            ("own.sst", bytes(id, 1000 + id as usize)),
        ];
        let (manifest, _) = checkpoint_with(store, lease, dir, CheckpointId(id), kind, &files, manifests.last()).await;
        manifests.push(manifest);
    }
    manifests
}

#[test]
fn gc_keeps_the_newest_checkpoints_and_savepoints_and_deletes_only_the_unreferenced() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        let store = file_store(&root, StoreOptions::default());
        let clock = Arc::new(ManualClock::new(1_000));
        let lease = job_lease(&store, "gc", &clock).await;
        history(&store, &lease, dir.path(), &[1, 2, 3, 4, 6, 7]).await;
        // An abandoned attempt (5, older than the newest commit) and one in flight (8).
        for (id, name) in [(5u64, "abandoned.sst"), (8, "new.sst")] {
            let local = dir.path().join(format!("attempt-{id}"));
            let manifest = snapshot(&local, TaskId(1), CheckpointId(id), &[(name, bytes(id * 11, 500))], None);
            store.upload_snapshot(&local, &manifest, NodeId(1), &()).await.unwrap();
        }

        let retention = Retention {
            keep_last: 2,
            grace: Duration::from_secs(3600),
            max_delete_failures: 4,
        };
        // Everything was just written: inside the grace period nothing shared goes.
        let now = SystemTime::now();
        let young = gc::plan(&store, &retention, now).await.unwrap();
        assert_eq!(young.retained, vec![CheckpointId(2), CheckpointId(6), CheckpointId(7)]);
        assert_eq!(young.expired, vec![CheckpointId(1), CheckpointId(3), CheckpointId(4)]);
        assert_eq!(young.untouched, vec![CheckpointId(5), CheckpointId(8)]);
        assert!(young.abandoned.is_empty());
        assert!(young.orphans.is_empty());
        assert_eq!(young.young, 3, "own.sst of 1, 3 and 4 are unreferenced but young");

        // An hour later: a dry run (the plan) lists exactly what a run then deletes.
        let later = now + Duration::from_secs(7200);
        let plan = gc::plan(&store, &retention, later).await.unwrap();
        assert_eq!(plan.abandoned, vec![CheckpointId(5)]);
        assert_eq!(plan.untouched, vec![CheckpointId(8)]);
        // own.sst of 1, 3 and 4 and the abandoned file are referenced by nothing kept.
        assert_eq!(plan.orphans.len(), 4, "{:?}", plan.orphans);
        assert_eq!(plan.orphan_bytes, 1001 + 1003 + 1004 + 500);
        let report = gc::collect(&store, &retention, &lease, later).await.unwrap();
        assert_eq!(report.plan, plan);
        assert_eq!(report.orphans_deleted, 4);
        let ids: Vec<_> = store.checkpoints().await.unwrap().into_iter().map(|l| l.id).collect();
        assert_eq!(ids, vec![CheckpointId(2), CheckpointId(6), CheckpointId(7), CheckpointId(8)]);
        for id in [2, 6, 7] {
            let report = store.verify(CheckpointId(id), VerifyDepth::Content, &()).await.unwrap();
            assert!(report.is_intact(), "{id}: {:?}", report.problems);
        }
        // The in-flight attempt's file survived and it can still commit.
        assert!(matches!(
            store.checkpoints().await.unwrap().last().unwrap().status,
            ListingStatus::Incomplete { .. }
        ));

        // Idempotent: a second run finds nothing.
        let again = gc::collect(&store, &retention, &lease, later).await.unwrap();
        assert!(again.plan.is_empty(), "{:?}", again.plan);

        // A GC by a writer that lost the lease deletes nothing.
        clock.advance(Duration::from_secs(120));
        let _taker = job_lease(&store, "other", &clock).await;
        let tighter = Retention { keep_last: 1, ..retention };
        let before = files_under(&root).len();
        assert!(matches!(
            gc::collect(&store, &tighter, &lease, later).await,
            Err(StoreError::LeaseLost { .. })
        ));
        assert_eq!(files_under(&root).len(), before);
        assert!(matches!(
            gc::plan(&store, &Retention { keep_last: 0, ..Retention::default() }, later).await,
            Err(StoreError::InvalidOption { .. })
        ));
    });
}

#[test]
fn checkpoints_complete_on_a_store_failing_a_fifth_of_its_operations() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        let faults = FaultConfig::new(0.2, 7);
        let options = StoreOptions {
            faults: Some(faults.clone()),
            retry: RetryPolicy {
                max_retries: 12,
                min_delay: Duration::from_millis(1),
                max_delay: Duration::from_millis(5),
            },
            ..StoreOptions::default()
        };
        let store = file_store(&root, options);
        let clock = Arc::new(ManualClock::new(1_000));
        let lease = loop {
            // Even taking the lease may fail once retries run out; try again.
            match Lease::acquire_job(&store, quick_lease("flaky"), clock.clone()).await {
                Ok(lease) => break lease,
                Err(e) => assert!(e.is_temporary() || matches!(e, StoreError::LeaseHeld { .. }), "{e}"),
            }
            clock.advance(Duration::from_secs(61));
        };
        let mut previous = None;
        let mut committed = 0;
        for id in 1..=30u64 {
            let local = dir.path().join(format!("local-{id}"));
            let files = vec![("base.sst", bytes(0, 3000)), ("own.sst", bytes(id, 2000))];
            let manifest = snapshot(&local, TaskId(1), CheckpointId(id), &files, previous.as_ref());
            let outcome = async {
                let uploaded = store.upload_snapshot(&local, &manifest, NodeId(1), &()).await?;
                store
                    .commit(&checkpoint_manifest(CheckpointId(id), CheckpointKind::Checkpoint, &[uploaded]), &lease)
                    .await
            }
            .await;
            match outcome {
                Ok(()) => committed += 1,
                Err(e) => assert!(e.is_temporary() || e.is_not_found(), "checkpoint {id}: {e}"),
            }
            previous = Some(manifest);
        }
        assert!(faults.injected() > 20, "only {} faults injected", faults.injected());
        assert!(committed >= 25, "only {committed} of 30 checkpoints committed");
        // Read back without faults: nothing listed as complete has a file missing.
        let clean = file_store(&root, StoreOptions::default());
        let ids = clean.committed_ids().await.unwrap();
        assert_eq!(ids.len(), committed);
        for id in ids {
            let report = clean.verify(id, VerifyDepth::Content, &()).await.unwrap();
            assert!(report.is_intact(), "{id}: {:?}", report.problems);
        }
    });
}
