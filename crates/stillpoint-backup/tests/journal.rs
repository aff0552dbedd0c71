//! The progress journal (append, interval flushes, summaries, finish, resume across
//! runs, corrupt files, wrong keys, background errors, remove) and the resumable
//! restore built on it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use stillpoint_backup::journal::{self, JournalFile, JournalFileKind};
use stillpoint_backup::{
    EncryptionKey, Journal, JournalConfig, ManualClock, Resumed, Store, StoreError, StoreOptions,
    SystemClock, restore_checkpoint,
};
use stillpoint_wire::{CheckpointId, CheckpointKind};
use support::*;

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

async fn files(store: &Store, name: &str) -> usize {
    let resumed: Resumed<u32, Range, Checksum> = journal::resume(store, name).await.unwrap();
    resumed.records.values().map(Vec::len).sum()
}

#[test]
fn records_flush_on_their_interval_and_resume_across_runs_with_elapsed_time() {
    let rt = runtime();
    rt.block_on(async {
        let store = Store::open("memory://", StoreOptions::default()).unwrap();
        let clock: Arc<dyn stillpoint_backup::Clock> = Arc::new(SystemClock);
        let run1: Backup = Journal::start(&store, "backup/job-1", config(20), clock.clone(), Duration::ZERO)
            .await
            .unwrap();
        run1.append(1, vec![range(0), range(1)]).await.unwrap();
        run1.summarize(1, Checksum { crc64xor: 7, kvs: 2, bytes: 20 }).await.unwrap();
        // The background loop flushes without being asked (bounded wait).
        let mut waited = 0;
        while files(&store, "backup/job-1").await < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            waited += 1;
            assert!(waited < 500, "no interval flush within 5 s");
        }
        run1.append(2, vec![range(2)]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(30)).await;
        // Finishing without flush drops what is pending, as the seed's runner does.
        run1.append(3, vec![range(3)]).await.unwrap();
        run1.finish(false).await.unwrap();

        let resumed: Resumed<u32, Range, Checksum> = journal::resume(&store, "backup/job-1").await.unwrap();
        assert_eq!(resumed.records[&1], vec![range(0), range(1)]);
        assert_eq!(resumed.records[&2], vec![range(2)]);
        assert!(!resumed.records.contains_key(&3));
        assert_eq!(resumed.summaries[&1].kvs, 2);
        assert!(resumed.skipped.is_empty());
        let first_elapsed = resumed.elapsed;
        assert!(first_elapsed >= Duration::from_millis(20), "{first_elapsed:?}");

        // Second run: continues the clock; finish(true) flushes everything.
        let run2: Backup = Journal::start(&store, "backup/job-1", config(60_000), clock, first_elapsed)
            .await
            .unwrap();
        run2.append(1, vec![range(9)]).await.unwrap();
        run2.summarize(1, Checksum { crc64xor: 9, kvs: 3, bytes: 30 }).await.unwrap();
        run2.finish(true).await.unwrap();
        let resumed: Resumed<u32, Range, Checksum> = journal::resume(&store, "backup/job-1").await.unwrap();
        assert_eq!(resumed.records[&1], vec![range(0), range(1), range(9)]);
        assert_eq!(resumed.summaries[&1], Checksum { crc64xor: 9, kvs: 3, bytes: 30 });
        assert!(resumed.elapsed >= first_elapsed);

        // Remove deletes every file of the journal, lease included.
        let removed = journal::remove(&store, "backup/job-1", quick_lease("rm"), Arc::new(SystemClock), 4)
            .await
            .unwrap();
        assert!(removed >= 4, "{removed}");
        let empty: Resumed<u32, Range, Checksum> = journal::resume(&store, "backup/job-1").await.unwrap();
        assert!(empty.records.is_empty() && empty.summaries.is_empty());
        assert_eq!(empty.elapsed, Duration::ZERO);
    });
}

#[test]
fn corrupt_files_are_skipped_and_reported_and_a_wrong_key_is_an_error() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        let key = EncryptionKey::generate();
        let encrypted = StoreOptions { encryption: Some(key), ..StoreOptions::default() };
        let store = file_store(&root, encrypted.clone());
        let clock: Arc<dyn stillpoint_backup::Clock> = Arc::new(SystemClock);
        for group in 0..3u32 {
            let run: Backup = Journal::start(&store, "j", config(60_000), clock.clone(), Duration::ZERO)
                .await
                .unwrap();
            run.append(group, vec![range(group)]).await.unwrap();
            run.finish(true).await.unwrap();
        }
        let record_files: Vec<_> = files_under(&root.join("journal/j/records"));
        assert_eq!(record_files.len(), 3);
        // Nothing readable in the encrypted files.
        for file in &record_files {
            let bytes = std::fs::read(file).unwrap();
            assert!(!bytes.windows(5).any(|w| w == b"k0001"));
        }
        // Damage one: it is skipped and named, the others still resume.
        let mut damaged = std::fs::read(&record_files[1]).unwrap();
        let middle = damaged.len() / 2;
        damaged[middle] ^= 0xff;
        std::fs::write(&record_files[1], damaged).unwrap();
        let resumed: Resumed<u32, Range, Checksum> = journal::resume(&store, "j").await.unwrap();
        assert_eq!(resumed.records.len(), 2);
        assert_eq!(resumed.skipped.len(), 1);
        assert!(resumed.skipped[0].0.ends_with(".spj"));

        // A wrong key opens no file: that is an error, not an empty journal.
        let wrong = file_store(&root, StoreOptions { encryption: Some(EncryptionKey::generate()), ..StoreOptions::default() });
        let error = journal::resume::<u32, Range, Checksum>(&wrong, "j").await.unwrap_err();
        assert!(matches!(error, StoreError::Decrypt { .. }), "{error}");

        // Unencrypted: a file that is not a journal file and one with a bad body are
        // both skipped with their reason; the good one resumes.
        let plain_root = dir.path().join("plain");
        let plain = file_store(&plain_root, StoreOptions::default());
        let run: Backup = Journal::start(&plain, "p", config(60_000), clock.clone(), Duration::ZERO).await.unwrap();
        run.append(5, vec![range(5)]).await.unwrap();
        run.finish(true).await.unwrap();
        let records = plain_root.join("journal/p/records");
        std::fs::write(records.join("zz-garbage.spj"), b"not a journal file at all").unwrap();
        std::fs::write(
            records.join("zz-undecodable.spj"),
            JournalFile::encode(JournalFileKind::Records, Duration::ZERO, b"{\"not\": \"a list\"}"),
        )
        .unwrap();
        let resumed: Resumed<u32, Range, Checksum> = journal::resume(&plain, "p").await.unwrap();
        assert_eq!(resumed.records[&5], vec![range(5)]);
        let reasons: Vec<&str> = resumed.skipped.iter().map(|(_, why)| why.as_str()).collect();
        assert_eq!(reasons.len(), 2, "{reasons:?}");
        assert!(reasons[0].contains("truncated: 25 bytes"), "{reasons:?}");
        assert!(reasons[1].contains("records do not decode"), "{reasons:?}");
    });
}

#[test]
fn the_first_background_error_is_returned_by_every_later_call() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        let store = file_store(&root, StoreOptions::default());
        let clock: Arc<dyn stillpoint_backup::Clock> = Arc::new(SystemClock);
        let run: Backup = Journal::start(&store, "j", config(10), clock, Duration::ZERO).await.unwrap();
        // Another writer takes the journal over (its lease file now names someone else).
        let mut record: serde_json::Value =
            serde_json::from_slice(&std::fs::read(root.join("journal/j/lease/current.json")).unwrap()).unwrap();
        record["holder"] = "intruder".into();
        record["nonce"] = 1.into();
        std::fs::write(root.join("journal/j/lease/current.json"), serde_json::to_vec(&record).unwrap()).unwrap();
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
        assert!(matches!(run.summarize(1, Checksum { crc64xor: 0, kvs: 0, bytes: 0 }).await, Err(StoreError::LeaseLost { .. })));
        assert!(matches!(run.finish(true).await, Err(StoreError::LeaseLost { .. })));
        // A second journal on the same name is refused while the intruder holds it.
        let again = Journal::<u32, Range, Checksum>::start(&store, "j", config(10), Arc::new(SystemClock), Duration::ZERO).await;
        assert!(matches!(again, Err(StoreError::LeaseHeld { .. })));
    });
}

#[test]
fn an_interrupted_restore_resumes_trusting_what_its_journal_recorded() {
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store = file_store(&dir.path().join("store"), StoreOptions::default());
        let clock = Arc::new(ManualClock::new(1_000));
        let lease = job_lease(&store, "writer", &clock).await;
        let files: Vec<(String, Vec<u8>)> = (0..6).map(|i| (format!("{i:06}.sst"), bytes(i, 5_000))).collect();
        let borrowed: Vec<(&str, Vec<u8>)> = files.iter().map(|(n, b)| (n.as_str(), b.clone())).collect();
        checkpoint_with(&store, &lease, dir.path(), CheckpointId(3), CheckpointKind::Savepoint, &borrowed, None).await;

        // An earlier run restored two files and recorded them, then died.
        let target = dir.path().join("restore");
        let task_dir = target.join("task-1");
        std::fs::create_dir_all(&task_dir).unwrap();
        for (name, content) in &files[..2] {
            std::fs::write(task_dir.join(name), content).unwrap();
        }
        // A third file is on disk but unrecorded and damaged: it must be fetched.
        std::fs::write(task_dir.join(&files[2].0), b"half a file").unwrap();
        let earlier: Journal<u32, String> = Journal::start(
            &store,
            "restore/00000000000000000003",
            config(60_000),
            Arc::new(SystemClock),
            Duration::ZERO,
        )
        .await
        .unwrap();
        earlier.append(1, files[..2].iter().map(|(n, _)| n.clone()).collect()).await.unwrap();
        earlier.finish(true).await.unwrap();

        let report = restore_checkpoint(&store, CheckpointId(3), &target, &(), config(60_000), Arc::new(SystemClock))
            .await
            .unwrap();
        assert_eq!(report.files_reused, 2);
        assert_eq!(report.files_downloaded, 4);
        for (name, content) in &files {
            assert_eq!(&std::fs::read(task_dir.join(name)).unwrap(), content, "{name}");
        }
        assert!(target.join("_checkpoint.json").is_file());
        // Done: the journal is gone.
        assert!(files_under(&dir.path().join("store/journal")).is_empty());

        // A checkpoint that does not exist is a typed error.
        assert!(matches!(
            restore_checkpoint(&store, CheckpointId(9), &target, &(), config(60_000), Arc::new(SystemClock)).await,
            Err(StoreError::NoSuchCheckpoint(CheckpointId(9)))
        ));
    });
}
