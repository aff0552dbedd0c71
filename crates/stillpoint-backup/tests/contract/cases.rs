//! The store contract: every case runs against `file://`, `memory://` and a real S3
//! server (`tests/contract.rs`, `tests/s3.rs`), reaching objects directly only
//! through the raw operator to damage them.

#![allow(unreachable_pub, clippy::cast_possible_truncation)]

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use stillpoint_backup::journal::{self, JournalFile, JournalFileKind};
use stillpoint_backup::{
    Clock, EncryptionKey, FaultConfig, FaultOperations, Journal, JournalConfig, Lease, LeaseConfig,
    LeaseRecord, ListingStatus, ManualClock, Resumed, Retention, RetryPolicy, Store, StoreError,
    StoreOptions, SystemClock, TransferEvent, VerifyDepth, gc, lease_holder, restore_checkpoint,
    restore_journal, restore_journal_dir,
};
use stillpoint_wire::{CheckpointId, CheckpointKind, NodeId, TaskId};

use crate::support::*;

/// Calls `$m!` with the name of every contract case.
/// Runs the named cases in turn on one server-backed `Backend`, each on a fresh
/// namespace, printing each one's time under `label` (`s3`, `sftp`).
#[allow(unused_macros)]
macro_rules! run_timed {
    ($backend:ident, $label:literal: $($name:ident),* $(,)?) => {
        $(
            {
                let env = crate::support::Env::new(crate::support::Backend::$backend);
                let started = std::time::Instant::now();
                crate::support::runtime().block_on(crate::cases::$name(&env));
                eprintln!("{}: {} passed in {:.1} s", $label, stringify!($name), started.elapsed().as_secs_f64());
            }
        )*
    };
}

macro_rules! contract_cases {
    ($m:ident) => {
        $m!(
            an_unreadable_store_never_makes_a_checkpoint_look_corrupt,
            upload_is_incremental_and_a_committed_checkpoint_round_trips,
            an_unfinished_checkpoint_is_never_listed_as_complete,
            a_local_file_that_changed_after_its_manifest_is_not_uploaded,
            large_files_go_up_and_down_in_parts_with_their_checksums_checked,
            verify_names_every_damaged_object_and_latest_verified_falls_back,
            encrypted_stores_hold_no_plaintext_and_refuse_the_wrong_key,
            a_held_lease_is_refused_with_its_holder_and_expiry_and_taken_over_after_it,
            racing_writers_never_both_get_the_lease,
            a_conditional_create_has_one_winner_among_concurrent_writers,
            a_fenced_store_writes_nothing_once_its_lease_lapses_or_is_lost,
            a_kept_lease_outlives_a_blocked_holder_on_a_flaky_store_and_stops_when_taken,
            a_holder_paused_inside_a_refresh_writes_nothing_when_it_resumes,
            a_corrupt_lease_file_is_ignored_but_a_live_claim_still_holds,
            damage_only_in_the_store_restores_from_intact_local_copies,
            gc_keeps_the_newest_checkpoints_and_savepoints_and_deletes_only_the_unreferenced,
            checkpoints_complete_on_a_store_failing_a_fifth_of_its_operations,
            records_flush_on_their_interval_and_resume_across_runs_with_elapsed_time,
            corrupt_files_are_skipped_and_reported_and_a_wrong_key_is_an_error,
            the_first_background_error_is_returned_by_every_later_call,
            an_interrupted_restore_resumes_keeping_what_is_already_restored
        );
    };
}

fn sst(seed: u64, len: usize) -> Vec<u8> {
    bytes(seed, len)
}

pub async fn upload_is_incremental_and_a_committed_checkpoint_round_trips(env: &Env) {
    let dir = env;
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "test", &clock).await;

    let first_files = vec![
        ("000001.sst", sst(1, 100_000)),
        ("000002.sst", sst(2, 50_000)),
        ("MANIFEST-000003", sst(3, 700)),
    ];
    let (m1, u1) = checkpoint_with(
        &store,
        &lease,
        dir.path(),
        CheckpointId(1),
        CheckpointKind::Checkpoint,
        &first_files,
        None,
    )
    .await;
    assert_eq!(u1.files_uploaded, 3);
    assert_eq!(u1.bytes_uploaded, 150_700);
    assert_eq!(u1.state_bytes, 150_700);

    // Second snapshot: one SST kept, one new, a new MANIFEST.
    let second_files = vec![
        ("000001.sst", sst(1, 100_000)),
        ("000004.sst", sst(4, 10_000)),
        ("MANIFEST-000005", sst(5, 800)),
    ];
    let (m2, u2) = checkpoint_with(
        &store,
        &lease,
        dir.path(),
        CheckpointId(2),
        CheckpointKind::Checkpoint,
        &second_files,
        Some(&m1),
    )
    .await;
    assert_eq!(u2.files_uploaded, 2, "only the new files move");
    assert_eq!(u2.bytes_uploaded, 10_800);
    assert_eq!(u2.files_reused, 1);

    // A fresh handle (no memory of what it uploaded) still skips stored files.
    let fresh = env.store("store", StoreOptions::default());
    let local = dir.path().join("local-2");
    let again = fresh
        .upload_snapshot(&local, &m2, NodeId(1), &())
        .await
        .unwrap();
    assert_eq!(again.files_uploaded, 0);

    let listing = store.checkpoints().await.unwrap();
    assert_eq!(listing.len(), 2);
    assert!(
        listing
            .iter()
            .all(|l| matches!(l.status, ListingStatus::Committed(_)))
    );
    let latest = store.latest().await.unwrap().unwrap();
    assert_eq!(latest.checkpoint, CheckpointId(2));
    assert_eq!(latest.state_bytes(), 110_800);

    let report = store
        .verify(CheckpointId(2), VerifyDepth::Content, &())
        .await
        .unwrap();
    assert!(report.is_intact(), "{:?}", report.problems);
    assert_eq!(report.files_checked, 3);

    // Download into an empty directory, then again: everything is reused.
    let target = dir.path().join("restore");
    let snapshot = store.task_manifest(&latest.tasks[0]).await.unwrap();
    assert_eq!(snapshot, m2);
    let events = Mutex::new(Vec::new());
    let record = |e: &TransferEvent<'_>| events.lock().unwrap().push(format!("{e:?}"));
    let downloaded = store
        .download_snapshot(&snapshot, &target, &record)
        .await
        .unwrap();
    assert_eq!(downloaded.files_downloaded, 3);
    assert_eq!(
        events.lock().unwrap().len(),
        5,
        "started, 3 files, finished"
    );
    for (name, content) in &second_files {
        assert_eq!(&std::fs::read(target.join(name)).unwrap(), content);
    }
    let again = store
        .download_snapshot(&snapshot, &target, &())
        .await
        .unwrap();
    assert_eq!(again.files_downloaded, 0);
    assert_eq!(again.files_reused, 3);

    // A local file that was changed is fetched again.
    std::fs::write(target.join("000004.sst"), b"changed").unwrap();
    let repaired = store
        .download_snapshot(&snapshot, &target, &())
        .await
        .unwrap();
    assert_eq!(repaired.files_downloaded, 1);
    assert_eq!(
        std::fs::read(target.join("000004.sst")).unwrap(),
        second_files[1].1
    );
}

pub async fn an_unfinished_checkpoint_is_never_listed_as_complete(env: &Env) {
    let dir = env;
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "test", &clock).await;
    checkpoint_with(
        &store,
        &lease,
        dir.path(),
        CheckpointId(1),
        CheckpointKind::Checkpoint,
        &[("a.sst", sst(1, 10))],
        None,
    )
    .await;
    // Checkpoint 2: uploaded but never committed.
    let local = dir.path().join("two");
    let manifest = snapshot(
        &local,
        TaskId(1),
        CheckpointId(2),
        &[("b.sst", sst(2, 10))],
        None,
    );
    store
        .upload_snapshot(&local, &manifest, NodeId(1), &())
        .await
        .unwrap();
    let listing = store.checkpoints().await.unwrap();
    assert!(matches!(
        listing[1].status,
        ListingStatus::Incomplete { task_manifests: 1 }
    ));
    assert_eq!(
        store.latest().await.unwrap().unwrap().checkpoint,
        CheckpointId(1)
    );
    assert_eq!(store.committed_ids().await.unwrap(), vec![CheckpointId(1)]);
    assert!(matches!(
        store.checkpoint(CheckpointId(2)).await,
        Err(StoreError::NoSuchCheckpoint(CheckpointId(2)))
    ));

    // A commit that names a task manifest that is not stored is refused.
    let mut missing = checkpoint_manifest(CheckpointId(3), CheckpointKind::Checkpoint, &[]);
    missing.tasks.push(stillpoint_wire::TaskSnapshotRef {
        task: TaskId(9),
        node: NodeId(1),
        manifest: stillpoint_backup::task_manifest_path(CheckpointId(3), TaskId(9)),
        sha256: stillpoint_wire::Sha256Digest::of(b"nothing"),
        state_bytes: 0,
    });
    assert!(matches!(
        store.commit(&missing, &lease).await,
        Err(StoreError::NotFound { .. })
    ));
    assert_eq!(store.committed_ids().await.unwrap(), vec![CheckpointId(1)]);

    // Committing the same id twice is refused; the first commit stands.
    let again = checkpoint_manifest(CheckpointId(1), CheckpointKind::Savepoint, &[]);
    assert!(matches!(
        store.commit(&again, &lease).await,
        Err(StoreError::AlreadyCommitted(CheckpointId(1)))
    ));
    assert_eq!(
        store.checkpoint(CheckpointId(1)).await.unwrap().kind,
        CheckpointKind::Checkpoint
    );
}

pub async fn a_local_file_that_changed_after_its_manifest_is_not_uploaded(env: &Env) {
    let dir = env;
    let store = env.store("store", StoreOptions::default());
    let local = dir.path().join("snap");
    let manifest = snapshot(
        &local,
        TaskId(1),
        CheckpointId(1),
        &[("a.sst", sst(1, 64))],
        None,
    );
    std::fs::write(local.join("a.sst"), sst(9, 64)).unwrap();
    let error = store
        .upload_snapshot(&local, &manifest, NodeId(1), &())
        .await
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::LocalMismatch { problem, .. } if problem.contains("SHA-256")),
        "{error}"
    );
    std::fs::write(local.join("a.sst"), sst(1, 10)).unwrap();
    let error = store
        .upload_snapshot(&local, &manifest, NodeId(1), &())
        .await
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::LocalMismatch { problem, .. } if problem.contains("10 bytes"))
    );
    std::fs::remove_file(local.join("a.sst")).unwrap();
    let error = store
        .upload_snapshot(&local, &manifest, NodeId(1), &())
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        StoreError::Local {
            kind: std::io::ErrorKind::NotFound,
            ..
        }
    ));
    assert!(
        store.checkpoints().await.unwrap().is_empty(),
        "no manifest was written"
    );
}

pub async fn large_files_go_up_and_down_in_parts_with_their_checksums_checked(env: &Env) {
    let dir = env;
    let options = StoreOptions {
        part_size: 5 * 1024 * 1024,
        ..StoreOptions::default()
    };
    let store = env.store("store", options);
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "test", &clock).await;
    let big = sst(7, 12 * 1024 * 1024 + 17);
    let (manifest, uploaded) = checkpoint_with(
        &store,
        &lease,
        dir.path(),
        CheckpointId(1),
        CheckpointKind::Checkpoint,
        &[("big.sst", big.clone())],
        None,
    )
    .await;
    assert_eq!(uploaded.bytes_uploaded, big.len() as u64);
    let target = dir.path().join("restore");
    store
        .download_snapshot(&manifest, &target, &())
        .await
        .unwrap();
    assert_eq!(std::fs::read(target.join("big.sst")).unwrap(), big);
    // Corrupt the stored object: the streamed download is rejected and nothing is
    // left behind under the file's name.
    let object = raw_list(&store, "shared/").await[0].clone();
    let mut stored = raw_read(&store, &object).await;
    stored[6 * 1024 * 1024] ^= 0x40;
    raw_write(&store, &object, stored).await;
    let fresh = dir.path().join("fresh");
    let error = store
        .download_snapshot(&manifest, &fresh, &())
        .await
        .unwrap_err();
    assert!(
        matches!(&error, StoreError::Corrupt { path, problem } if path.starts_with("shared/") && problem.contains("SHA-256")),
        "{error}"
    );
    assert!(files_under(&fresh).is_empty(), "{:?}", files_under(&fresh));
}

/// One data-driven corruption table: damage one stored object, expect `verify` to
/// name it at the given depth.
pub async fn verify_names_every_damaged_object_and_latest_verified_falls_back(env: &Env) {
    #[derive(Debug, Clone, Copy)]
    enum Damage {
        FlipByte,
        Truncate,
        Delete,
    }
    for (case_index, (target, damage, depth_needed)) in [
        ("shared", Damage::FlipByte, VerifyDepth::Content),
        ("shared", Damage::Truncate, VerifyDepth::Presence),
        ("shared", Damage::Delete, VerifyDepth::Presence),
        ("task", Damage::FlipByte, VerifyDepth::Presence),
        ("task", Damage::Truncate, VerifyDepth::Presence),
        ("task", Damage::Delete, VerifyDepth::Presence),
        ("commit", Damage::FlipByte, VerifyDepth::Presence),
        ("commit", Damage::Truncate, VerifyDepth::Presence),
    ]
    .into_iter()
    .enumerate()
    {
        {
            let dir = env;
            let store = env.store(&format!("store-{case_index}"), StoreOptions::default());
            let clock = Arc::new(ManualClock::new(1_000));
            let lease = job_lease(&store, "test", &clock).await;
            let (m1, _) = checkpoint_with(
                &store,
                &lease,
                dir.path(),
                CheckpointId(1),
                CheckpointKind::Checkpoint,
                &[("1.sst", sst(1, 4000)), ("2.sst", sst(2, 4000))],
                None,
            )
            .await;
            let (_, u2) = checkpoint_with(
                &store,
                &lease,
                dir.path(),
                CheckpointId(2),
                CheckpointKind::Checkpoint,
                &[("1.sst", sst(1, 4000)), ("3.sst", sst(3, 4000))],
                Some(&m1),
            )
            .await;
            // Pick an object only checkpoint 2 uses, so checkpoint 1 stays intact.
            let victim = match target {
                "shared" => {
                    let snapshot = store.task_manifest(&u2.reference).await.unwrap();
                    let file = snapshot
                        .files
                        .iter()
                        .find(|f| f.path.as_str() == "3.sst")
                        .unwrap();
                    let hex = file.sha256.to_hex();
                    format!("shared/{}/{hex}", &hex[..2])
                }
                "task" => u2.reference.manifest.as_str().to_owned(),
                _ => "checkpoints/00000000000000000002/_checkpoint.json".to_owned(),
            };
            let bytes = raw_read(&store, &victim).await;
            match damage {
                Damage::FlipByte => {
                    let mut b = bytes.clone();
                    let i = b.len() / 2;
                    b[i] ^= 0x01;
                    raw_write(&store, &victim, b).await;
                }
                Damage::Truncate => {
                    raw_write(&store, &victim, bytes[..bytes.len() / 2].to_vec()).await
                }
                Damage::Delete => raw_delete(&store, &victim).await,
            }
            let shallow = store
                .verify(CheckpointId(2), VerifyDepth::Presence, &())
                .await
                .unwrap();
            let deep = store
                .verify(CheckpointId(2), VerifyDepth::Content, &())
                .await
                .unwrap();
            let case = format!("{target} {damage:?}");
            assert!(!deep.is_intact(), "{case}: content verify missed it");
            assert!(
                deep.problems.iter().any(|p| p.object == victim),
                "{case}: {:?}",
                deep.problems
            );
            if depth_needed == VerifyDepth::Presence {
                assert!(
                    shallow.problems.iter().any(|p| p.object == victim),
                    "{case}: {:?}",
                    shallow.problems
                );
            }
            let fallback = store
                .latest_verified(VerifyDepth::Content)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(fallback.manifest.checkpoint, CheckpointId(1), "{case}");
            assert_eq!(fallback.rejected.len(), 1, "{case}");
            assert_eq!(fallback.rejected[0].id, CheckpointId(2));
            let restorable = store
                .restorable(&BTreeSet::new(), VerifyDepth::Content)
                .await
                .unwrap();
            assert_eq!(restorable.checkpoint, Some(CheckpointId(1)), "{case}");
            assert_eq!(restorable.committed, 2);
            assert_eq!(restorable.rejected[0].0, CheckpointId(2), "{case}");
            assert!(
                restorable.rejected[0].1.contains(&victim),
                "{case}: {restorable:?}"
            );
            let none_left = store
                .restorable(&BTreeSet::from([CheckpointId(1)]), VerifyDepth::Content)
                .await
                .unwrap();
            assert_eq!(none_left.checkpoint, None, "{case}: 1 excluded, 2 damaged");
            assert!(
                store
                    .verify(CheckpointId(1), VerifyDepth::Content, &())
                    .await
                    .unwrap()
                    .is_intact(),
                "{case}"
            );
        }
    }
}

pub async fn encrypted_stores_hold_no_plaintext_and_refuse_the_wrong_key(env: &Env) {
    let dir = env;
    let key = EncryptionKey::generate();
    let options = StoreOptions {
        encryption: Some(key.clone()),
        ..StoreOptions::default()
    };
    let store = env.store("store", options.clone());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "test", &clock).await;
    let secret = b"user-record: alice owes bob 42".repeat(50);
    let (manifest, _) = checkpoint_with(
        &store,
        &lease,
        dir.path(),
        CheckpointId(1),
        CheckpointKind::Checkpoint,
        &[
            ("000001.sst", secret.clone()),
            ("big.sst", sst(5, 9 * 1024 * 1024)),
        ],
        None,
    )
    .await;
    // Scan every stored byte: no record, no file name, no key.
    let key_hex = key.to_hex();
    let needles: [&[u8]; 4] = [
        b"alice owes bob",
        b"000001.sst",
        key_hex.as_bytes(),
        b"max_parallelism",
    ];
    for file in raw_list(&store, "").await {
        if file.starts_with("lease/") {
            continue; // the lease is plaintext by design: it says who holds it
        }
        let stored = raw_read(&store, &file).await;
        for needle in needles {
            assert!(
                !stored.windows(needle.len()).any(|w| w == needle),
                "{file} holds plaintext {:?}",
                String::from_utf8_lossy(needle)
            );
        }
    }
    assert!(
        store
            .verify(CheckpointId(1), VerifyDepth::Content, &())
            .await
            .unwrap()
            .is_intact()
    );
    let target = dir.path().join("restore");
    store
        .download_snapshot(&manifest, &target, &())
        .await
        .unwrap();
    assert_eq!(std::fs::read(target.join("000001.sst")).unwrap(), secret);

    let wrong = env.store(
        "store",
        StoreOptions {
            encryption: Some(EncryptionKey::generate()),
            ..StoreOptions::default()
        },
    );
    assert!(matches!(
        wrong.checkpoint(CheckpointId(1)).await,
        Err(StoreError::Decrypt { .. })
    ));
    let keyless = env.store("store", StoreOptions::default());
    let error = keyless.checkpoint(CheckpointId(1)).await.unwrap_err();
    assert!(matches!(error, StoreError::KeyRequired { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains("no encryption key was configured")
    );
    // A wrong key lists the checkpoint as unreadable, never as valid.
    let listing = wrong.checkpoints().await.unwrap();
    assert!(matches!(
        listing[0].status,
        ListingStatus::Corrupt(StoreError::Decrypt { .. })
    ));
    assert!(
        wrong
            .latest_verified(VerifyDepth::Presence)
            .await
            .unwrap()
            .is_none()
    );
}

pub async fn a_held_lease_is_refused_with_its_holder_and_expiry_and_taken_over_after_it(env: &Env) {
    let store = env.store("store", StoreOptions::default());
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
    assert!(
        message.contains("node-a pid 1") && message.contains("2023-11-14T22:14:20Z"),
        "{message}"
    );

    // Refreshing keeps it: 50 s later the lease still has 60 s to run.
    clock.advance(Duration::from_secs(50));
    assert!(first.needs_refresh());
    first.refresh().await.unwrap();
    assert!(!first.needs_refresh());
    clock.advance(Duration::from_secs(50));
    assert!(
        Lease::acquire_job(&store, quick_lease("b"), clock.clone())
            .await
            .is_err()
    );

    // Unrefreshed past its expiry, it is taken over with a higher owner id...
    clock.advance(Duration::from_secs(61));
    let second = job_lease(&store, "node-b pid 2", &clock).await;
    assert_eq!(second.owner(), 2);
    // ...and the old owner is fenced: it can neither refresh nor commit.
    assert!(matches!(
        first.check().await,
        Err(StoreError::LeaseLost { owner: 1, .. })
    ));
    assert!(matches!(
        first.refresh().await,
        Err(StoreError::LeaseLost { .. })
    ));
    let local = env.path().join("s");
    let manifest = snapshot(
        &local,
        TaskId(1),
        CheckpointId(1),
        &[("a", bytes(1, 10))],
        None,
    );
    let uploaded = store
        .upload_snapshot(&local, &manifest, NodeId(1), &())
        .await
        .unwrap();
    let checkpoint = checkpoint_manifest(CheckpointId(1), CheckpointKind::Checkpoint, &[uploaded]);
    let refused = store.commit(&checkpoint, &first).await.unwrap_err();
    assert!(
        matches!(refused, StoreError::LeaseLost { owner: 1, .. }),
        "{refused}"
    );
    assert!(
        store.committed_ids().await.unwrap().is_empty(),
        "the fenced writer committed"
    );
    store.commit(&checkpoint, &second).await.unwrap();

    // Released leases are free at once, and owner ids keep growing.
    let now = clock.now();
    assert_eq!(
        lease_holder(&store, "lease/", now)
            .await
            .unwrap()
            .unwrap()
            .owner,
        2
    );
    second.release().await.unwrap();
    assert!(lease_holder(&store, "lease/", now).await.unwrap().is_none());
    let third = job_lease(&store, "node-c", &clock).await;
    assert_eq!(third.owner(), 3);

    // A process restarting its own crashed run reclaims its unexpired lease, with
    // `reclaim_own` only, judged by the process's random instance token (whatever the
    // holder's name), and fences the old run.
    assert!(matches!(
        Lease::acquire_job(&store, quick_lease("node-c"), clock.clone()).await,
        Err(StoreError::LeaseHeld { .. })
    ));
    let own = LeaseConfig {
        reclaim_own: true,
        ..quick_lease("node-d")
    };
    let reclaimed = Lease::acquire_job(&store, own, clock.clone())
        .await
        .unwrap();
    assert_eq!(reclaimed.owner(), 4);
    assert!(matches!(
        third.check().await,
        Err(StoreError::LeaseLost { .. })
    ));
    // The fence closed with it: the old run's writes are refused without any I/O.
    assert!(matches!(
        third.fence().check(),
        Err(StoreError::LeaseLost { .. })
    ));
    reclaimed.release().await.unwrap();

    // Another process with our very host name and pid (containers: pid 1 everywhere)
    // but its own instance token holds a live lease: never reclaimed as ours, never
    // judged dead.
    let ours = job_lease(&store, "probe", &clock).await.record();
    let twin = LeaseRecord {
        owner: ours.owner + 1,
        instance: "another-process".to_owned(),
        ..ours.clone()
    };
    plant(&store, &twin).await;
    let own = LeaseConfig {
        reclaim_own: true,
        ..quick_lease(&ours.holder)
    };
    assert!(matches!(
        Lease::acquire_job(&store, own, clock.clone()).await,
        Err(StoreError::LeaseHeld { .. })
    ));

    // A restarted process need not wait out the TTL of a dead predecessor: a holder
    // of this kernel boot and pid namespace whose pid is gone is taken over (and
    // fenced); a gone pid of another pid namespace (another container) is not judged,
    // and neither is a live pid.
    let in_other_container = LeaseRecord {
        owner: twin.owner + 1,
        instance: "other-container".to_owned(),
        pid_namespace: "pid:[1]".to_owned(),
        pid: 4_194_303,
        ..ours.clone()
    };
    plant(&store, &in_other_container).await;
    assert!(matches!(
        Lease::acquire_job(&store, quick_lease("node-e"), clock.clone()).await,
        Err(StoreError::LeaseHeld { .. })
    ));
    let dead = LeaseRecord {
        owner: in_other_container.owner + 1,
        instance: "exited".to_owned(),
        pid: 4_194_303,
        ..ours.clone()
    };
    plant(&store, &dead).await;
    let refused = LeaseConfig {
        reclaim_dead_local: false,
        ..quick_lease("node-e")
    };
    assert!(matches!(
        Lease::acquire_job(&store, refused, clock.clone()).await,
        Err(StoreError::LeaseHeld { .. })
    ));
    let successor = Lease::acquire_job(&store, quick_lease("node-e"), clock.clone())
        .await
        .unwrap();
    let successor_owner = successor.owner();
    assert!(successor_owner > dead.owner);
    successor.release().await.unwrap();
    let alive = LeaseRecord {
        owner: successor_owner + 1,
        instance: "alive".to_owned(),
        pid: 1,
        ..ours
    };
    plant(&store, &alive).await;
    assert!(matches!(
        Lease::acquire_job(&store, quick_lease("node-f"), clock.clone()).await,
        Err(StoreError::LeaseHeld { .. })
    ));
}

/// Writes a lease record as another process would have: its claim, then `current.json`.
async fn plant(store: &Store, record: &LeaseRecord) {
    let bytes = serde_json::to_vec(record).unwrap();
    let op = store.raw_operator();
    op.write(
        &format!("lease/claims/{:020}.json", record.owner),
        bytes.clone(),
    )
    .await
    .unwrap();
    op.write("lease/current.json", bytes).await.unwrap();
}

trait Now {
    fn now(&self) -> u64;
}
impl Now for ManualClock {
    fn now(&self) -> u64 {
        stillpoint_backup::Clock::now_millis(self)
    }
}

pub async fn racing_writers_never_both_get_the_lease(env: &Env) {
    for round in 0..20u64 {
        let store = env.store(&format!("race-{round}"), StoreOptions::default());
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
        // Exactly one acquires: the claim file makes ids unique, and a racer that read
        // the lease free before another claimed finds that claim when it tries the
        // same id. (OS processes racing on `file://`: tests/races.rs.)
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} writers acquired",
            winners.len()
        );
        winners[0].check().await.unwrap();
    }
}

/// Everything written on a lease holder's behalf goes through its fence: uploads,
/// task manifests, commits and deletes stop at once when the lease is found lost,
/// and when its write deadline (a quarter TTL before expiry) passes without a
/// refresh — a paused owner writes nothing when it resumes.
pub async fn a_fenced_store_writes_nothing_once_its_lease_lapses_or_is_lost(env: &Env) {
    let dir = env;
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "owner", &clock).await;
    let fenced = store.fenced(lease.fence());
    let upload = |id: u64| {
        let local = dir.path().join(format!("local-{id}"));
        let manifest = snapshot(
            &local,
            TaskId(1),
            CheckpointId(id),
            &[("own.sst", bytes(id, 2_000))],
            None,
        );
        let fenced = fenced.clone();
        async move {
            fenced
                .upload_snapshot(&local, &manifest, NodeId(1), &())
                .await
        }
    };
    let first = upload(1).await.unwrap();
    fenced
        .commit(
            &checkpoint_manifest(CheckpointId(1), CheckpointKind::Checkpoint, &[first]),
            &lease,
        )
        .await
        .unwrap();

    // Paused for 46 s of a 60 s TTL: past the write deadline, not yet expired.
    clock.advance(Duration::from_secs(46));
    let lapsed = upload(2).await.unwrap_err();
    assert!(matches!(lapsed, StoreError::LeaseLost { .. }), "{lapsed}");
    assert!(lapsed.to_string().contains("deadline"), "{lapsed}");
    assert!(
        raw_list(&store, "checkpoints/00000000000000000002/")
            .await
            .is_empty()
    );
    assert!(matches!(
        fenced.delete_checkpoint(CheckpointId(1)).await,
        Err(StoreError::LeaseLost { .. })
    ));
    // A refresh confirms the lease: writes resume.
    lease.refresh().await.unwrap();
    let second = upload(2).await.unwrap();
    fenced
        .commit(
            &checkpoint_manifest(CheckpointId(2), CheckpointKind::Checkpoint, &[second]),
            &lease,
        )
        .await
        .unwrap();

    // Expired and taken over: the first check closes the fence for good.
    clock.advance(Duration::from_secs(61));
    let successor = job_lease(&store, "successor", &clock).await;
    assert!(matches!(
        lease.check().await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert!(matches!(upload(3).await, Err(StoreError::LeaseLost { .. })));
    assert!(
        raw_list(&store, "checkpoints/00000000000000000003/")
            .await
            .is_empty()
    );
    assert!(lease.refresh().await.is_err());
    assert!(matches!(upload(3).await, Err(StoreError::LeaseLost { .. })));
    // Both committed checkpoints verify; the successor writes through its own fence.
    for id in [1, 2] {
        let report = store
            .verify(CheckpointId(id), VerifyDepth::Content, &())
            .await
            .unwrap();
        assert!(report.is_intact(), "{id}: {:?}", report.problems);
    }
    successor.fence().check().unwrap();
}

/// A clock that jumps forward on a chosen later reading: a holder paused (SIGSTOP)
/// between two readings of its clock.
#[derive(Debug)]
struct PausingClock {
    now: std::sync::atomic::AtomicU64,
    /// Readings left until the jump (0: none armed).
    jump_in: std::sync::atomic::AtomicU64,
    by: u64,
}

impl Clock for PausingClock {
    fn now_millis(&self) -> u64 {
        use std::sync::atomic::Ordering::SeqCst;
        let left = self.jump_in.load(SeqCst);
        if left > 0 {
            self.jump_in.store(left - 1, SeqCst);
            if left == 1 {
                self.now.fetch_add(self.by, SeqCst);
            }
        }
        self.now.load(SeqCst)
    }
}

/// A holder paused after its refresh checked the lease and before it wrote the new
/// expiry resumes long after the lease lapsed: the refresh fails as lost and writes
/// nothing, so the lease is free for a successor (it would otherwise hold a fresh
/// record of the dead holder's).
pub async fn a_holder_paused_inside_a_refresh_writes_nothing_when_it_resumes(env: &Env) {
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(PausingClock {
        now: std::sync::atomic::AtomicU64::new(1_000_000),
        jump_in: std::sync::atomic::AtomicU64::new(0),
        by: 150_000,
    });
    let first = Lease::acquire_job(&store, quick_lease("a"), Arc::clone(&clock) as _)
        .await
        .unwrap();
    // The check reads the clock once; the pause comes right after it.
    clock.jump_in.store(2, std::sync::atomic::Ordering::SeqCst);
    let refreshed = first.refresh().await;
    assert!(
        matches!(&refreshed, Err(StoreError::LeaseLost { owner: 1, reason }) if reason.contains("paused")),
        "{refreshed:?}"
    );
    assert!(first.fence().check().is_err(), "the fence stays closed");
    let second = Lease::acquire_job(&store, quick_lease("b"), Arc::clone(&clock) as _)
        .await
        .unwrap();
    assert_eq!(second.owner(), 2);
}

/// Polls `done` every 20 ms until it holds; fails with `never` after `within`.
async fn wait_until(within: Duration, never: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{never}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A kept lease is refreshed by its keeper task while the holder's own thread is
/// blocked for several TTLs on a store failing 15 % of its operations (a holder that
/// refreshed between its own steps lost it: the coordinator, blocked in a commit
/// waiting out retries). Taken over, the keeper stops and never overwrites the
/// successor; released, the lease is free.
pub async fn a_kept_lease_outlives_a_blocked_holder_on_a_flaky_store_and_stops_when_taken(
    env: &Env,
) {
    let faults = FaultConfig::new(0.15, 11);
    let options = StoreOptions {
        faults: Some(faults.clone()),
        retry: RetryPolicy {
            max_retries: 8,
            min_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(40),
        },
        ..StoreOptions::default()
    };
    let store = env.store("store", options);
    // 3 s: the keeper's refreshes (retried through the faults, each a synced write
    // on file://) must fit in a TTL even when the machine runs this binary's other
    // tests at once (600 ms did not; 1.5 s once did not either, fsyncs queued behind
    // the other tests' on 2 cores).
    let ttl = Duration::from_millis(3_000);
    let config = |reclaim_own| LeaseConfig {
        ttl,
        reclaim_own,
        ..quick_lease("kept")
    };
    let lease = Lease::acquire_job(&store, config(false), Arc::new(SystemClock))
        .await
        .unwrap();
    let first_expiry = lease.record().expires_at_millis;
    let kept = lease.keep(&tokio::runtime::Handle::current());

    // The holder's thread blocks for more than three TTLs. The lease is never lost
    // meanwhile; the fence may be shut for a moment when a refresh is late (a synced
    // write on file:// can stall behind the other tests' fsyncs for over a second:
    // the fence then does its job), but the keeper opens it again by itself.
    std::thread::sleep(ttl * 7 / 2);
    kept.fence().check_held().unwrap();
    wait_until(ttl, "the keeper never refreshed a late lease", || {
        kept.fence().check().is_ok()
    })
    .await;
    kept.check().await.unwrap();
    assert!(
        kept.record().expires_at_millis >= first_expiry + 2 * 3_000,
        "never refreshed"
    );
    assert!(faults.injected() > 0, "no fault was injected");

    // Another process claims the next owner id and writes the lease: the keeper's
    // next refresh finds it lost and closes the fence.
    let successor = LeaseRecord {
        owner: kept.owner() + 1,
        instance: "successor".to_owned(),
        expires_at_millis: SystemClock.now_millis() + 60_000,
        ..kept.record()
    };
    plant(&store, &successor).await;
    wait_until(ttl * 10, "the keeper never noticed", || {
        kept.fence().check_held().is_err()
    })
    .await;
    assert!(matches!(
        kept.fence().check(),
        Err(StoreError::LeaseLost { .. })
    ));
    // Stopped: it never writes the lease again (a refresh in flight during the
    // takeover may have, which is why the successor writes it once more here).
    plant(&store, &successor).await;
    std::thread::sleep(ttl * 2);
    let now = SystemClock.now_millis();
    let holder = lease_holder(&store, "lease/", now).await.unwrap().unwrap();
    assert_eq!(holder.owner, successor.owner);
    assert_eq!(holder.instance, "successor");
    // Releasing a lost lease leaves the successor's alone.
    kept.release().await.unwrap();
    let holder = lease_holder(&store, "lease/", now).await.unwrap().unwrap();
    assert_eq!(holder.instance, "successor");

    // The successor releases it; a lease kept and released is free at once.
    let released = LeaseRecord {
        released: true,
        expires_at_millis: SystemClock.now_millis(),
        ..successor.clone()
    };
    plant(&store, &released).await;
    let fresh = Lease::acquire_job(&store, config(true), Arc::new(SystemClock))
        .await
        .unwrap();
    assert!(fresh.owner() > successor.owner);
    let kept = fresh.keep(&tokio::runtime::Handle::current());
    std::thread::sleep(ttl);
    kept.release().await.unwrap();
    let now = SystemClock.now_millis();
    assert!(lease_holder(&store, "lease/", now).await.unwrap().is_none());
}

/// A lease file that does not parse protects nobody and is ignored with a warning;
/// the claims still order owner ids, and a live claim still holds the lease.
pub async fn a_corrupt_lease_file_is_ignored_but_a_live_claim_still_holds(env: &Env) {
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let first = job_lease(&store, "first", &clock).await;
    let op = store.raw_operator();
    op.write("lease/current.json", b"{ not a lease".to_vec())
        .await
        .unwrap();
    // Held: the first owner's claim is live although current.json is garbage.
    let refused = Lease::acquire_job(&store, quick_lease("second"), clock.clone()).await;
    assert!(
        matches!(&refused, Err(StoreError::LeaseHeld { holder, .. }) if holder == "first"),
        "{refused:?}"
    );
    // Expired: taken, with a higher owner id, and the first owner is fenced.
    clock.advance(Duration::from_secs(61));
    op.write("lease/current.json", b"\x00\x01garbage".to_vec())
        .await
        .unwrap();
    let second = job_lease(&store, "second", &clock).await;
    assert!(second.owner() > first.owner());
    assert!(matches!(
        first.check().await,
        Err(StoreError::LeaseLost { .. })
    ));
    second.check().await.unwrap();
}

/// A checkpoint damaged only in the store (a file flipped, same size) while the
/// local copy is intact: the download hashes the local file, keeps it, and the state
/// is right; `verify` still reports the store's damage.
pub async fn damage_only_in_the_store_restores_from_intact_local_copies(env: &Env) {
    let dir = env;
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "writer", &clock).await;
    let files = vec![
        ("000001.sst", sst(1, 20_000)),
        ("MANIFEST-000002", sst(2, 900)),
    ];
    let (manifest, _) = checkpoint_with(
        &store,
        &lease,
        dir.path(),
        CheckpointId(1),
        CheckpointKind::Checkpoint,
        &files,
        None,
    )
    .await;
    let local = dir.path().join("restored");
    store
        .download_snapshot(&manifest, &local, &())
        .await
        .unwrap();
    // Replace (not modify: a `file://` store may share the SST's inode with the
    // snapshot it came from) the stored SST with same-size garbage.
    let object = raw_list(&store, "shared/")
        .await
        .into_iter()
        .find(|path| {
            path.ends_with(
                &manifest
                    .files
                    .iter()
                    .find(|f| f.path.as_str() == "000001.sst")
                    .unwrap()
                    .sha256
                    .to_hex(),
            )
        })
        .unwrap();
    store
        .raw_operator()
        .write(&object, sst(99, 20_000))
        .await
        .unwrap();
    let report = store
        .download_snapshot(&manifest, &local, &())
        .await
        .unwrap();
    assert_eq!((report.files_downloaded, report.files_reused), (0, 2));
    for (name, content) in &files {
        assert_eq!(&std::fs::read(local.join(name)).unwrap(), content, "{name}");
    }
    let verified = store
        .verify(CheckpointId(1), VerifyDepth::Content, &())
        .await
        .unwrap();
    assert_eq!(verified.problems.len(), 1, "{:?}", verified.problems);
    assert_eq!(verified.problems[0].object, object);
}

/// A conditional create — what a commit and a lease claim are made of — has exactly
/// one winner among concurrent writers, and the object holds the winner's bytes.
pub async fn a_conditional_create_has_one_winner_among_concurrent_writers(env: &Env) {
    let store = env.store("store", StoreOptions::default());
    for round in 0..20u64 {
        let path = format!("race-{round}/_checkpoint.json");
        let attempts: Vec<_> = (0..6)
            .map(|writer| {
                let store = store.clone();
                let path = path.clone();
                tokio::spawn(async move {
                    let created = store
                        .raw_operator()
                        .write_with(&path, format!("writer {writer}"))
                        .if_not_exists(true)
                        .await;
                    match created {
                        Ok(_) => Some(writer),
                        Err(e) if e.kind() == opendal::ErrorKind::ConditionNotMatch => None,
                        Err(e) => panic!("writer {writer}: {e}"),
                    }
                })
            })
            .collect();
        let mut winners = Vec::new();
        for attempt in attempts {
            winners.extend(attempt.await.unwrap());
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let stored = store.raw_operator().read(&path).await.unwrap().to_vec();
        assert_eq!(stored, format!("writer {}", winners[0]).into_bytes());
    }
}

/// Commits checkpoints `ids` (2 is a savepoint), each adding one new file and keeping
/// one shared file.
async fn history(
    store: &Store,
    lease: &Lease,
    dir: &std::path::Path,
    ids: &[u64],
) -> Vec<stillpoint_wire::SnapshotManifest> {
    let mut manifests: Vec<stillpoint_wire::SnapshotManifest> = Vec::new();
    for &id in ids {
        let kind = if id == 2 {
            CheckpointKind::Savepoint
        } else {
            CheckpointKind::Checkpoint
        };
        let files = vec![
            ("base.sst", bytes(0, 2000)),
            ("own.sst", bytes(id, 1000 + id as usize)),
        ];
        let (manifest, _) = checkpoint_with(
            store,
            lease,
            dir,
            CheckpointId(id),
            kind,
            &files,
            manifests.last(),
        )
        .await;
        manifests.push(manifest);
    }
    manifests
}

pub async fn gc_keeps_the_newest_checkpoints_and_savepoints_and_deletes_only_the_unreferenced(
    env: &Env,
) {
    let dir = env;
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "gc", &clock).await;
    history(&store, &lease, dir.path(), &[1, 2, 3, 4, 6, 7]).await;
    for id in [1u64, 2, 3, 4, 6, 7] {
        store.put_stats(CheckpointId(id), &id).await.unwrap();
    }
    // An abandoned attempt (5, older than the newest commit) and one in flight (8).
    for (id, name) in [(5u64, "abandoned.sst"), (8, "new.sst")] {
        let local = dir.path().join(format!("attempt-{id}"));
        let manifest = snapshot(
            &local,
            TaskId(1),
            CheckpointId(id),
            &[(name, bytes(id * 11, 500))],
            None,
        );
        store
            .upload_snapshot(&local, &manifest, NodeId(1), &())
            .await
            .unwrap();
    }

    let retention = Retention {
        keep_last: 2,
        grace: Duration::from_secs(3600),
        max_delete_failures: 4,
        history: 4,
    };
    // Everything was just written: inside the grace period nothing shared goes.
    let now = SystemTime::now();
    let young = gc::plan(&store, &retention, now).await.unwrap();
    assert_eq!(
        young.retained,
        vec![CheckpointId(2), CheckpointId(6), CheckpointId(7)]
    );
    assert_eq!(
        young.expired,
        vec![CheckpointId(1), CheckpointId(3), CheckpointId(4)]
    );
    assert_eq!(young.untouched, vec![CheckpointId(5), CheckpointId(8)]);
    assert!(young.abandoned.is_empty());
    assert!(young.orphans.is_empty());
    // The history window (4) outlives retention: the statistics of expired 3 and 4
    // stay; of the two oldest, 2 is a savepoint and stays with it.
    assert_eq!(young.stats_expired, vec![CheckpointId(1)]);
    assert_eq!(
        young.young, 3,
        "own.sst of 1, 3 and 4 are unreferenced but young"
    );

    // An hour later: a dry run (the plan) lists exactly what a run then deletes.
    let later = now + Duration::from_secs(7200);
    let plan = gc::plan(&store, &retention, later).await.unwrap();
    if env.backend == Backend::Memory {
        // memory:// keeps no modification times, and an object whose age the store
        // cannot tell is never deleted: only expired manifests go.
        assert!(
            plan.orphans.is_empty() && plan.abandoned.is_empty(),
            "{plan:?}"
        );
        assert_eq!(plan.young, 3);
        let report = gc::collect(&store, &retention, &lease, later)
            .await
            .unwrap();
        assert_eq!(report.orphans_deleted, 0);
        for id in [2, 6, 7] {
            let report = store
                .verify(CheckpointId(id), VerifyDepth::Content, &())
                .await
                .unwrap();
            assert!(report.is_intact(), "{id}: {:?}", report.problems);
        }
        return;
    }
    assert_eq!(plan.abandoned, vec![CheckpointId(5)]);
    assert_eq!(plan.untouched, vec![CheckpointId(8)]);
    // own.sst of 1, 3 and 4 and the abandoned file are referenced by nothing kept.
    assert_eq!(plan.orphans.len(), 4, "{:?}", plan.orphans);
    assert_eq!(plan.orphan_bytes, 1001 + 1003 + 1004 + 500);
    let report = gc::collect(&store, &retention, &lease, later)
        .await
        .unwrap();
    assert_eq!(report.plan, plan);
    assert_eq!(report.orphans_deleted, 4);
    let kept_stats: Vec<u64> = store
        .stats::<u64>()
        .await
        .unwrap()
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    assert_eq!(kept_stats, vec![2, 3, 4, 6, 7]);
    let ids: Vec<_> = store
        .checkpoints()
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(
        ids,
        vec![
            CheckpointId(2),
            CheckpointId(6),
            CheckpointId(7),
            CheckpointId(8)
        ]
    );
    for id in [2, 6, 7] {
        let report = store
            .verify(CheckpointId(id), VerifyDepth::Content, &())
            .await
            .unwrap();
        assert!(report.is_intact(), "{id}: {:?}", report.problems);
    }
    // The in-flight attempt's file survived and it can still commit.
    assert!(matches!(
        store.checkpoints().await.unwrap().last().unwrap().status,
        ListingStatus::Incomplete { .. }
    ));

    // Idempotent: a second run finds nothing.
    let again = gc::collect(&store, &retention, &lease, later)
        .await
        .unwrap();
    assert!(again.plan.is_empty(), "{:?}", again.plan);

    // A GC by a writer that lost the lease deletes nothing.
    clock.advance(Duration::from_secs(120));
    let _taker = job_lease(&store, "other", &clock).await;
    let tighter = Retention {
        keep_last: 1,
        ..retention
    };
    let before = raw_list(&store, "").await.len();
    assert!(matches!(
        gc::collect(&store, &tighter, &lease, later).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert_eq!(raw_list(&store, "").await.len(), before);
    assert!(matches!(
        gc::plan(
            &store,
            &Retention {
                keep_last: 0,
                ..Retention::default()
            },
            later
        )
        .await,
        Err(StoreError::InvalidOption { .. })
    ));
}

pub async fn checkpoints_complete_on_a_store_failing_a_fifth_of_its_operations(env: &Env) {
    let dir = env;
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
    let store = env.store("store", options);
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = loop {
        // Even taking the lease may fail once retries run out; try again.
        match Lease::acquire_job(&store, quick_lease("flaky"), clock.clone()).await {
            Ok(lease) => break lease,
            Err(e) => assert!(
                e.is_unavailable() || matches!(e, StoreError::LeaseHeld { .. }),
                "{e}"
            ),
        }
        clock.advance(Duration::from_secs(61));
    };
    let mut previous = None;
    let mut committed = 0;
    for id in 1..=30u64 {
        let local = dir.path().join(format!("local-{id}"));
        let files = vec![("base.sst", bytes(0, 3000)), ("own.sst", bytes(id, 2000))];
        let manifest = snapshot(
            &local,
            TaskId(1),
            CheckpointId(id),
            &files,
            previous.as_ref(),
        );
        let outcome = async {
            let uploaded = store
                .upload_snapshot(&local, &manifest, NodeId(1), &())
                .await?;
            store
                .commit(
                    &checkpoint_manifest(CheckpointId(id), CheckpointKind::Checkpoint, &[uploaded]),
                    &lease,
                )
                .await
        }
        .await;
        // A write whose reply was lost is retried: a retried create that finds its own
        // object is a success, never "already committed" or "already written".
        match outcome {
            Ok(()) => committed += 1,
            Err(e) => assert!(
                e.is_unavailable() || e.is_not_found(),
                "checkpoint {id}: {e}"
            ),
        }
        previous = Some(manifest);
    }
    assert!(
        faults.injected() > 20,
        "only {} faults injected",
        faults.injected()
    );
    assert!(
        faults.replies_lost() > 5,
        "only {} writes applied with their reply lost",
        faults.replies_lost()
    );
    assert!(
        committed >= 25,
        "only {committed} of 30 checkpoints committed"
    );
    // Read back without faults: nothing listed as complete has a file missing.
    let clean = env.store("store", StoreOptions::default());
    let ids = clean.committed_ids().await.unwrap();
    // A commit whose every retry lost its reply is committed though its caller heard
    // an error (the outcome of a timed-out write is unknown): never fewer.
    assert!(
        ids.len() >= committed,
        "{} listed, {committed} committed",
        ids.len()
    );
    for id in ids {
        let report = clean.verify(id, VerifyDepth::Content, &()).await.unwrap();
        assert!(report.is_intact(), "{id}: {:?}", report.problems);
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Range {
    start: String,
    end: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Checksum {
    crc64xor: u64,
    kvs: u64,
    bytes: u64,
}

fn range(i: u32) -> Range {
    Range {
        start: format!("k{i:04}"),
        end: format!("k{:04}", i + 1),
    }
}

fn config(flush_ms: u64) -> JournalConfig {
    JournalConfig {
        flush_interval: Duration::from_millis(flush_ms),
        summary_interval: Duration::from_millis(flush_ms),
        lease: quick_lease("journal-test"),
        capacity: 16,
    }
}

type Backup = Journal<u32, Range, Checksum>;

pub async fn records_flush_on_their_interval_and_resume_across_runs_with_elapsed_time(env: &Env) {
    let store = env.store("store", StoreOptions::default());
    let clock: Arc<dyn stillpoint_backup::Clock> = Arc::new(SystemClock);
    let run1: Backup = Journal::start(
        &store,
        "backup/job-1",
        config(20),
        clock.clone(),
        Duration::ZERO,
    )
    .await
    .unwrap();
    run1.append(1, vec![range(0), range(1)]).await.unwrap();
    run1.summarize(
        1,
        Checksum {
            crc64xor: 7,
            kvs: 2,
            bytes: 20,
        },
    )
    .await
    .unwrap();
    // The background loop flushes records and summaries without being asked
    // (bounded wait).
    let mut waited = 0;
    loop {
        let seen: Resumed<u32, Range, Checksum> =
            journal::resume(&store, "backup/job-1").await.unwrap();
        if seen.records.values().map(Vec::len).sum::<usize>() == 2 && !seen.summaries.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
        assert!(waited < 500, "no interval flush within 5 s");
    }
    run1.append(2, vec![range(2)]).await.unwrap();
    run1.finish(true).await.unwrap();
    // Finishing without flush drops what is pending, as the seed's runner does.
    let dropped: Backup = Journal::start(
        &store,
        "backup/job-1",
        config(60_000),
        clock.clone(),
        Duration::ZERO,
    )
    .await
    .unwrap();
    dropped.append(3, vec![range(3)]).await.unwrap();
    dropped.finish(false).await.unwrap();

    let resumed: Resumed<u32, Range, Checksum> =
        journal::resume(&store, "backup/job-1").await.unwrap();
    assert_eq!(resumed.records[&1], vec![range(0), range(1)]);
    assert_eq!(resumed.records[&2], vec![range(2)]);
    assert!(!resumed.records.contains_key(&3));
    assert_eq!(resumed.summaries[&1].kvs, 2);
    assert!(resumed.skipped.is_empty());
    let first_elapsed = resumed.elapsed;
    assert!(
        first_elapsed >= Duration::from_millis(20),
        "{first_elapsed:?}"
    );

    // Second run: continues the clock; finish(true) flushes everything.
    let run2: Backup = Journal::start(&store, "backup/job-1", config(60_000), clock, first_elapsed)
        .await
        .unwrap();
    run2.append(1, vec![range(9)]).await.unwrap();
    run2.summarize(
        1,
        Checksum {
            crc64xor: 9,
            kvs: 3,
            bytes: 30,
        },
    )
    .await
    .unwrap();
    run2.finish(true).await.unwrap();
    let resumed: Resumed<u32, Range, Checksum> =
        journal::resume(&store, "backup/job-1").await.unwrap();
    assert_eq!(resumed.records[&1], vec![range(0), range(1), range(9)]);
    assert_eq!(
        resumed.summaries[&1],
        Checksum {
            crc64xor: 9,
            kvs: 3,
            bytes: 30
        }
    );
    assert!(resumed.elapsed >= first_elapsed);

    // Remove deletes every file of the journal, lease included.
    let removed = journal::remove(
        &store,
        "backup/job-1",
        quick_lease("rm"),
        Arc::new(SystemClock),
        4,
    )
    .await
    .unwrap();
    assert!(removed >= 4, "{removed}");
    let empty: Resumed<u32, Range, Checksum> =
        journal::resume(&store, "backup/job-1").await.unwrap();
    assert!(empty.records.is_empty() && empty.summaries.is_empty());
    assert_eq!(empty.elapsed, Duration::ZERO);
}

pub async fn corrupt_files_are_skipped_and_reported_and_a_wrong_key_is_an_error(env: &Env) {
    let key = EncryptionKey::generate();
    let encrypted = StoreOptions {
        encryption: Some(key),
        ..StoreOptions::default()
    };
    let store = env.store("store", encrypted.clone());
    let clock: Arc<dyn stillpoint_backup::Clock> = Arc::new(SystemClock);
    for group in 0..3u32 {
        let run: Backup =
            Journal::start(&store, "j", config(60_000), clock.clone(), Duration::ZERO)
                .await
                .unwrap();
        run.append(group, vec![range(group)]).await.unwrap();
        run.finish(true).await.unwrap();
    }
    let record_files = raw_list(&store, "journal/j/records/").await;
    assert_eq!(record_files.len(), 3);
    // Nothing readable in the encrypted files.
    for file in &record_files {
        let bytes = raw_read(&store, file).await;
        assert!(!bytes.windows(5).any(|w| w == b"k0001"));
    }
    // Damage one: it is skipped and named, the others still resume.
    let mut damaged = raw_read(&store, &record_files[1]).await;
    let middle = damaged.len() / 2;
    damaged[middle] ^= 0xff;
    raw_write(&store, &record_files[1], damaged).await;
    let resumed: Resumed<u32, Range, Checksum> = journal::resume(&store, "j").await.unwrap();
    assert_eq!(resumed.records.len(), 2);
    assert_eq!(resumed.skipped.len(), 1);
    assert!(resumed.skipped[0].0.ends_with(".spj"));

    // A wrong key opens no file: that is an error, not an empty journal.
    let wrong = env.store(
        "store",
        StoreOptions {
            encryption: Some(EncryptionKey::generate()),
            ..StoreOptions::default()
        },
    );
    let error = journal::resume::<u32, Range, Checksum>(&wrong, "j")
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::Decrypt { .. }), "{error}");

    // Unencrypted: a file that is not a journal file and one with a bad body are
    // both skipped with their reason; the good one resumes.
    let plain = env.store("plain", StoreOptions::default());
    let run: Backup = Journal::start(&plain, "p", config(60_000), clock.clone(), Duration::ZERO)
        .await
        .unwrap();
    run.append(5, vec![range(5)]).await.unwrap();
    run.finish(true).await.unwrap();
    raw_write(
        &plain,
        "journal/p/records/zz-garbage.spj",
        b"not a journal file at all".to_vec(),
    )
    .await;
    raw_write(
        &plain,
        "journal/p/records/zz-undecodable.spj",
        JournalFile::encode(
            JournalFileKind::Records,
            Duration::ZERO,
            b"{\"not\": \"a list\"}",
        ),
    )
    .await;
    let resumed: Resumed<u32, Range, Checksum> = journal::resume(&plain, "p").await.unwrap();
    assert_eq!(resumed.records[&5], vec![range(5)]);
    let reasons: Vec<&str> = resumed
        .skipped
        .iter()
        .map(|(_, why)| why.as_str())
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(reasons[0].contains("truncated: 25 bytes"), "{reasons:?}");
    assert!(reasons[1].contains("records do not decode"), "{reasons:?}");
}

pub async fn the_first_background_error_is_returned_by_every_later_call(env: &Env) {
    let store = env.store("store", StoreOptions::default());
    let clock: Arc<dyn stillpoint_backup::Clock> = Arc::new(SystemClock);
    let run: Backup = Journal::start(&store, "j", config(10), clock, Duration::ZERO)
        .await
        .unwrap();
    // Another writer takes the journal over (its lease file now names someone else).
    let lease_file = "journal/j/lease/current.json";
    let mut record: serde_json::Value =
        serde_json::from_slice(&raw_read(&store, lease_file).await).unwrap();
    record["holder"] = "intruder".into();
    record["nonce"] = 1.into();
    raw_write(&store, lease_file, serde_json::to_vec(&record).unwrap()).await;
    run.append(1, vec![range(1)]).await.unwrap();
    // The next flush finds the lease lost; from then on every call says so.
    let mut attempts = 0;
    let error = loop {
        match run.append(2, vec![range(2)]).await {
            Err(e) => break e,
            Ok(()) => {
                attempts += 1;
                assert!(attempts < 500, "the lost lease was never noticed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    assert!(matches!(error, StoreError::LeaseLost { .. }), "{error}");
    assert!(matches!(
        run.summarize(
            1,
            Checksum {
                crc64xor: 0,
                kvs: 0,
                bytes: 0
            }
        )
        .await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert!(matches!(
        run.finish(true).await,
        Err(StoreError::LeaseLost { .. })
    ));
    // A second journal on the same name is refused while the intruder holds it.
    let again = Journal::<u32, Range, Checksum>::start(
        &store,
        "j",
        config(10),
        Arc::new(SystemClock),
        Duration::ZERO,
    )
    .await;
    assert!(matches!(again, Err(StoreError::LeaseHeld { .. })));
}

pub async fn an_interrupted_restore_resumes_keeping_what_is_already_restored(env: &Env) {
    let dir = env;
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "writer", &clock).await;
    let files: Vec<(String, Vec<u8>)> = (0..6)
        .map(|i| (format!("{i:06}.sst"), bytes(i, 5_000)))
        .collect();
    let borrowed: Vec<(&str, Vec<u8>)> =
        files.iter().map(|(n, b)| (n.as_str(), b.clone())).collect();
    checkpoint_with(
        &store,
        &lease,
        dir.path(),
        CheckpointId(3),
        CheckpointKind::Savepoint,
        &borrowed,
        None,
    )
    .await;

    // An earlier run restored two files and recorded them, then died.
    let target = dir.path().join("restore");
    let task_dir = target.join("task-1");
    std::fs::create_dir_all(&task_dir).unwrap();
    for (name, content) in &files[..2] {
        std::fs::write(task_dir.join(name), content).unwrap();
    }
    // A third file is on disk but unrecorded and damaged: it must be fetched.
    std::fs::write(task_dir.join(&files[2].0), b"half a file").unwrap();
    // Its journal lies beside the target (the store is only read), and it had run 5 s.
    let earlier: Journal<u32, String> = Journal::start(
        &restore_journal(&target).unwrap(),
        "restore/00000000000000000003",
        config(60_000),
        Arc::new(SystemClock),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    earlier
        .append(1, files[..2].iter().map(|(n, _)| n.clone()).collect())
        .await
        .unwrap();
    earlier.finish(true).await.unwrap();

    let report = restore_checkpoint(
        &store,
        CheckpointId(3),
        &target,
        &(),
        config(60_000),
        Arc::new(SystemClock),
        false,
    )
    .await
    .unwrap();
    // The recorded files are kept on their record (not hashed again), the rest fetched.
    assert!(report.resumed);
    assert_eq!(report.download.files_trusted, 2);
    assert_eq!(report.download.files_reused, 0);
    assert_eq!(report.download.files_downloaded, 4);
    assert!(report.elapsed >= Duration::from_secs(5), "{report:?}");
    assert!(!target.join("_checkpoint.json.partial").exists());
    for (name, content) in &files {
        assert_eq!(
            &std::fs::read(task_dir.join(name)).unwrap(),
            content,
            "{name}"
        );
    }
    assert!(target.join("_checkpoint.json").is_file());
    // Done: the journal is gone, and the store never held one.
    assert!(!restore_journal_dir(&target).exists());
    assert!(raw_list(&store, "journal/").await.is_empty());

    // Two restores of one checkpoint into two directories run at once.
    let (left, right) = (dir.path().join("left"), dir.path().join("right"));
    let (a, b) = tokio::join!(
        restore_checkpoint(
            &store,
            CheckpointId(3),
            &left,
            &(),
            config(60_000),
            Arc::new(SystemClock),
            false
        ),
        restore_checkpoint(
            &store,
            CheckpointId(3),
            &right,
            &(),
            config(60_000),
            Arc::new(SystemClock),
            false
        ),
    );
    for (report, target) in [(a.unwrap(), &left), (b.unwrap(), &right)] {
        assert!(!report.resumed);
        assert_eq!(report.download.files_downloaded, files.len());
        assert!(target.join("_checkpoint.json").is_file());
    }

    // A checkpoint that does not exist is a typed error.
    assert!(matches!(
        restore_checkpoint(
            &store,
            CheckpointId(9),
            &target,
            &(),
            config(60_000),
            Arc::new(SystemClock),
            false,
        )
        .await,
        Err(StoreError::NoSuchCheckpoint(CheckpointId(9)))
    ));

    // A directory holding anything but an interrupted restore of the same checkpoint
    // is refused untouched, unless overwriting is asked for.
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), b"mine").unwrap();
    let refused = restore_checkpoint(
        &store,
        CheckpointId(3),
        &other,
        &(),
        config(60_000),
        Arc::new(SystemClock),
        false,
    )
    .await;
    assert!(
        matches!(&refused, Err(StoreError::TargetNotEmpty { path }) if *path == other),
        "{refused:?}"
    );
    assert_eq!(std::fs::read_dir(&other).unwrap().count(), 1);
    // The complete restore above, asked again: its marker is not trusted, the
    // restore is redone (every file reused) and marked again.
    for (target, overwrite) in [(&other, true), (&target, true)] {
        let report = restore_checkpoint(
            &store,
            CheckpointId(3),
            target,
            &(),
            config(60_000),
            Arc::new(SystemClock),
            overwrite,
        )
        .await
        .unwrap();
        assert_eq!(
            report.download.files_downloaded + report.download.files_reused,
            files.len()
        );
        assert!(target.join("_checkpoint.json").is_file());
    }
}

pub async fn an_unreadable_store_never_makes_a_checkpoint_look_corrupt(env: &Env) {
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "test", &clock).await;
    checkpoint_with(
        &store,
        &lease,
        env.path(),
        CheckpointId(1),
        CheckpointKind::Checkpoint,
        &[("a.sst", sst(1, 100))],
        None,
    )
    .await;
    // Every read fails (retries included): listing works, reading does not.
    let faults = FaultConfig {
        operations: FaultOperations::READS,
        ..FaultConfig::new(1.0, 5)
    };
    let failing = env.store(
        "store",
        StoreOptions {
            faults: Some(faults),
            retry: RetryPolicy {
                max_retries: 1,
                min_delay: Duration::from_millis(1),
                max_delay: Duration::from_millis(1),
            },
            ..StoreOptions::default()
        },
    );
    for outcome in [
        failing.checkpoints().await.map(|_| ()),
        failing.latest().await.map(|_| ()),
        failing
            .latest_verified(VerifyDepth::Presence)
            .await
            .map(|_| ()),
        failing
            .verify(CheckpointId(1), VerifyDepth::Content, &())
            .await
            .map(|_| ()),
    ] {
        let error = outcome.unwrap_err();
        assert!(error.is_unavailable(), "{error}");
    }
    // Read back without faults, the checkpoint is intact.
    assert_eq!(
        store.latest().await.unwrap().unwrap().checkpoint,
        CheckpointId(1)
    );
}
