//! API-level tests of the checkpoint store on `file://` and `memory://`: incremental
//! upload, the commit, listing, verification, corruption, download, encryption.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod support;

use std::sync::{Arc, Mutex};

use stillpoint_backup::{
    EncryptionKey, ListingStatus, ManualClock, Store, StoreError, StoreOptions, TransferEvent,
    VerifyDepth,
};
use stillpoint_wire::{CheckpointId, CheckpointKind, NodeId, TaskId};
use support::*;

fn sst(seed: u64, len: usize) -> Vec<u8> {
    bytes(seed, len)
}

#[test]
fn upload_is_incremental_and_a_committed_checkpoint_round_trips() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store = file_store(&dir.path().join("store"), StoreOptions::default());
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
        let fresh = file_store(&dir.path().join("store"), StoreOptions::default());
        let local = dir.path().join("local-2");
        let again = fresh
            .upload_snapshot(&local, &m2, NodeId(1), &())
            .await
            .unwrap();
        assert_eq!(again.files_uploaded, 0);

        let listing = store.checkpoints().await.unwrap();
        assert_eq!(listing.len(), 2);
        assert!(listing.iter().all(|l| matches!(l.status, ListingStatus::Committed(_))));
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
        let downloaded = store.download_snapshot(&snapshot, &target, &record).await.unwrap();
        assert_eq!(downloaded.files_downloaded, 3);
        assert_eq!(events.lock().unwrap().len(), 5, "started, 3 files, finished");
        for (name, content) in &second_files {
            assert_eq!(&std::fs::read(target.join(name)).unwrap(), content);
        }
        let again = store.download_snapshot(&snapshot, &target, &()).await.unwrap();
        assert_eq!(again.files_downloaded, 0);
        assert_eq!(again.files_reused, 3);

        // A local file that was changed is fetched again.
        std::fs::write(target.join("000004.sst"), b"changed").unwrap();
        let repaired = store.download_snapshot(&snapshot, &target, &()).await.unwrap();
        assert_eq!(repaired.files_downloaded, 1);
        assert_eq!(std::fs::read(target.join("000004.sst")).unwrap(), second_files[1].1);
    });
}

#[test]
fn an_unfinished_checkpoint_is_never_listed_as_complete() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open("memory://", StoreOptions::default()).unwrap();
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
        let manifest = snapshot(&local, TaskId(1), CheckpointId(2), &[("b.sst", sst(2, 10))], None);
        store
            .upload_snapshot(&local, &manifest, NodeId(1), &())
            .await
            .unwrap();
        let listing = store.checkpoints().await.unwrap();
        assert!(matches!(
            listing[1].status,
            ListingStatus::Incomplete { task_manifests: 1 }
        ));
        assert_eq!(store.latest().await.unwrap().unwrap().checkpoint, CheckpointId(1));
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
    });
}

#[test]
fn a_local_file_that_changed_after_its_manifest_is_not_uploaded() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open("memory://", StoreOptions::default()).unwrap();
        let local = dir.path().join("snap");
        let manifest = snapshot(&local, TaskId(1), CheckpointId(1), &[("a.sst", sst(1, 64))], None);
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
        assert!(matches!(&error, StoreError::LocalMismatch { problem, .. } if problem.contains("10 bytes")));
        std::fs::remove_file(local.join("a.sst")).unwrap();
        let error = store
            .upload_snapshot(&local, &manifest, NodeId(1), &())
            .await
            .unwrap_err();
        assert!(matches!(error, StoreError::Local { kind: std::io::ErrorKind::NotFound, .. }));
        assert!(store.checkpoints().await.unwrap().is_empty(), "no manifest was written");
    });
}

#[test]
fn large_files_go_up_and_down_in_parts_with_their_checksums_checked() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions {
            part_size: 5 * 1024 * 1024,
            ..StoreOptions::default()
        };
        let store = file_store(&dir.path().join("store"), options);
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
        store.download_snapshot(&manifest, &target, &()).await.unwrap();
        assert_eq!(std::fs::read(target.join("big.sst")).unwrap(), big);
        // Corrupt the stored object: the streamed download is rejected and nothing is
        // left behind under the file's name.
        let object = files_under(&dir.path().join("store/shared"))[0].clone();
        let mut stored = std::fs::read(&object).unwrap();
        stored[6 * 1024 * 1024] ^= 0x40;
        std::fs::write(&object, stored).unwrap();
        let fresh = dir.path().join("fresh");
        let error = store.download_snapshot(&manifest, &fresh, &()).await.unwrap_err();
        assert!(
            matches!(&error, StoreError::Corrupt { path, problem } if path.starts_with("shared/") && problem.contains("SHA-256")),
            "{error}"
        );
        assert!(files_under(&fresh).is_empty(), "{:?}", files_under(&fresh));
    });
}

/// One data-driven corruption table: damage one stored object, expect `verify` to
/// name it at the given depth.
#[test]
fn verify_names_every_damaged_object_and_latest_verified_falls_back() {
    #[derive(Debug, Clone, Copy)]
    enum Damage {
        FlipByte,
        Truncate,
        Delete,
    }
    let rt = runtime();
    for (target, damage, depth_needed) in [
        ("shared", Damage::FlipByte, VerifyDepth::Content),
        ("shared", Damage::Truncate, VerifyDepth::Presence),
        ("shared", Damage::Delete, VerifyDepth::Presence),
        ("task", Damage::FlipByte, VerifyDepth::Presence),
        ("task", Damage::Truncate, VerifyDepth::Presence),
        ("task", Damage::Delete, VerifyDepth::Presence),
        ("commit", Damage::FlipByte, VerifyDepth::Presence),
        ("commit", Damage::Truncate, VerifyDepth::Presence),
    ] {
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let root = dir.path().join("store");
            let store = file_store(&root, StoreOptions::default());
            let clock = Arc::new(ManualClock::new(1_000));
            let lease = job_lease(&store, "test", &clock).await;
            let (m1, _) = checkpoint_with(
                &store, &lease, dir.path(), CheckpointId(1), CheckpointKind::Checkpoint,
                &[("1.sst", sst(1, 4000)), ("2.sst", sst(2, 4000))], None,
            )
            .await;
            let (_, u2) = checkpoint_with(
                &store, &lease, dir.path(), CheckpointId(2), CheckpointKind::Checkpoint,
                &[("1.sst", sst(1, 4000)), ("3.sst", sst(3, 4000))], Some(&m1),
            )
            .await;
            // Pick an object only checkpoint 2 uses, so checkpoint 1 stays intact.
            let victim = match target {
                "shared" => {
                    let snapshot = store.task_manifest(&u2.reference).await.unwrap();
                    let file = snapshot.files.iter().find(|f| f.path.as_str() == "3.sst").unwrap();
                    let hex = file.sha256.to_hex();
                    format!("shared/{}/{hex}", &hex[..2])
                }
                "task" => u2.reference.manifest.as_str().to_owned(),
                _ => "checkpoints/00000000000000000002/_checkpoint.json".to_owned(),
            };
            let path = root.join(&victim);
            let bytes = std::fs::read(&path).unwrap();
            match damage {
                Damage::FlipByte => {
                    let mut b = bytes.clone();
                    let i = b.len() / 2;
                    b[i] ^= 0x01;
                    std::fs::write(&path, b).unwrap();
                }
                Damage::Truncate => std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap(),
                Damage::Delete => std::fs::remove_file(&path).unwrap(),
            }
            let shallow = store.verify(CheckpointId(2), VerifyDepth::Presence, &()).await.unwrap();
            let deep = store.verify(CheckpointId(2), VerifyDepth::Content, &()).await.unwrap();
            let case = format!("{target} {damage:?}");
            assert!(!deep.is_intact(), "{case}: content verify missed it");
            assert!(deep.problems.iter().any(|p| p.object == victim), "{case}: {:?}", deep.problems);
            if depth_needed == VerifyDepth::Presence {
                assert!(
                    shallow.problems.iter().any(|p| p.object == victim),
                    "{case}: {:?}",
                    shallow.problems
                );
            }
            let fallback = store.latest_verified(VerifyDepth::Content).await.unwrap().unwrap();
            assert_eq!(fallback.manifest.checkpoint, CheckpointId(1), "{case}");
            assert_eq!(fallback.rejected.len(), 1, "{case}");
            assert_eq!(fallback.rejected[0].id, CheckpointId(2));
            assert!(
                store.verify(CheckpointId(1), VerifyDepth::Content, &()).await.unwrap().is_intact(),
                "{case}"
            );
        });
    }
}

#[test]
fn encrypted_stores_hold_no_plaintext_and_refuse_the_wrong_key() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        let key = EncryptionKey::generate();
        let options = StoreOptions {
            encryption: Some(key.clone()),
            ..StoreOptions::default()
        };
        let store = file_store(&root, options.clone());
        let clock = Arc::new(ManualClock::new(1_000));
        let lease = job_lease(&store, "test", &clock).await;
        let secret = b"user-record: alice owes bob 42".repeat(50);
        let (manifest, _) = checkpoint_with(
            &store, &lease, dir.path(), CheckpointId(1), CheckpointKind::Checkpoint,
            &[("000001.sst", secret.clone()), ("big.sst", sst(5, 9 * 1024 * 1024))], None,
        )
        .await;
        // Scan every stored byte: no record, no file name, no key.
        let key_hex = key.to_hex();
        let needles: [&[u8]; 4] = [b"alice owes bob", b"000001.sst", key_hex.as_bytes(), b"max_parallelism"];
        for file in files_under(&root) {
            if file.starts_with(root.join("lease")) {
                continue; // the lease is plaintext by design: it says who holds it
            }
            let stored = std::fs::read(&file).unwrap();
            for needle in needles {
                assert!(
                    !stored.windows(needle.len()).any(|w| w == needle),
                    "{} holds plaintext {:?}",
                    file.display(),
                    String::from_utf8_lossy(needle)
                );
            }
        }
        assert!(store.verify(CheckpointId(1), VerifyDepth::Content, &()).await.unwrap().is_intact());
        let target = dir.path().join("restore");
        store.download_snapshot(&manifest, &target, &()).await.unwrap();
        assert_eq!(std::fs::read(target.join("000001.sst")).unwrap(), secret);

        let wrong = file_store(
            &root,
            StoreOptions {
                encryption: Some(EncryptionKey::generate()),
                ..StoreOptions::default()
            },
        );
        assert!(matches!(
            wrong.checkpoint(CheckpointId(1)).await,
            Err(StoreError::Decrypt { .. })
        ));
        let keyless = file_store(&root, StoreOptions::default());
        let error = keyless.checkpoint(CheckpointId(1)).await.unwrap_err();
        assert!(matches!(error, StoreError::KeyRequired { .. }), "{error}");
        assert!(error.to_string().contains("no encryption key was configured"));
        // A wrong key lists the checkpoint as unreadable, never as valid.
        let listing = wrong.checkpoints().await.unwrap();
        assert!(matches!(listing[0].status, ListingStatus::Corrupt(StoreError::Decrypt { .. })));
        assert!(wrong.latest_verified(VerifyDepth::Presence).await.unwrap().is_none());
    });
}
