//! The store against a real S3-compatible server (SeaweedFS on loopback, signatures
//! checked): incremental and multipart upload, conditional commit, lease, GC, journal,
//! encryption, faults and credential errors. One test: the server owns fixed ports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use stillpoint_backup::{
    EncryptionKey, FaultConfig, Journal, JournalConfig, Lease, ManualClock, Resumed, Retention,
    RetryPolicy, S3Credentials, Store, StoreError, StoreOptions, SystemClock, VerifyDepth, gc,
    journal,
};
use stillpoint_wire::{CheckpointId, CheckpointKind, NodeId, TaskId};
use support::s3::{ACCESS_KEY, BUCKET, ENDPOINT, S3Server, SECRET_KEY};
use support::*;

fn s3(prefix: &str, options: StoreOptions) -> Store {
    let options = StoreOptions {
        s3_credentials: options.s3_credentials.or(Some(S3Credentials {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: SECRET_KEY.into(),
            session_token: None,
        })),
        ..options
    };
    Store::open(&format!("s3://{BUCKET}/{prefix}?endpoint={ENDPOINT}&region=us-east-1"), options).unwrap()
}

async fn wait_until_ready(store: &Store) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match store.checkpoints().await {
            Ok(_) => return,
            Err(e) => {
                assert!(Instant::now() < deadline, "S3 server not ready within 60 s: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

#[test]
fn the_store_works_against_a_real_s3_server() {
    let _server = S3Server::start();
    let rt = runtime();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store = s3("jobs/wordcount", StoreOptions { part_size: 5 * 1024 * 1024, ..StoreOptions::default() });
        wait_until_ready(&store).await;
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let lease = job_lease(&store, "s3-writer", &clock).await;

        // Incremental upload with a multipart file, commit, verify, download.
        let big = bytes(42, 11 * 1024 * 1024 + 3);
        let (m1, u1) = checkpoint_with(
            &store, &lease, dir.path(), CheckpointId(1), CheckpointKind::Checkpoint,
            &[("big.sst", big.clone()), ("small.sst", bytes(1, 3000))], None,
        )
        .await;
        assert_eq!(u1.files_uploaded, 2);
        let (m2, u2) = checkpoint_with(
            &store, &lease, dir.path(), CheckpointId(2), CheckpointKind::Checkpoint,
            &[("big.sst", big.clone()), ("new.sst", bytes(2, 3000))], Some(&m1),
        )
        .await;
        assert_eq!((u2.files_uploaded, u2.bytes_uploaded), (1, 3000));
        let report = store.verify(CheckpointId(2), VerifyDepth::Content, &()).await.unwrap();
        assert!(report.is_intact(), "{:?}", report.problems);
        let target = dir.path().join("restore");
        let downloaded = store.download_snapshot(&m2, &target, &()).await.unwrap();
        assert_eq!(downloaded.files_downloaded, 2);
        assert_eq!(std::fs::read(target.join("big.sst")).unwrap(), big);

        // The commit is conditional: a second one for the same id is refused.
        let again = checkpoint_manifest(CheckpointId(2), CheckpointKind::Savepoint, &[u2.clone()]);
        assert!(matches!(store.commit(&again, &lease).await, Err(StoreError::AlreadyCommitted(_))));
        // An uncommitted upload is not listed as complete.
        let local = dir.path().join("three");
        let m3 = snapshot(&local, TaskId(1), CheckpointId(3), &[("x.sst", bytes(3, 10))], None);
        store.upload_snapshot(&local, &m3, NodeId(1), &()).await.unwrap();
        assert_eq!(store.latest().await.unwrap().unwrap().checkpoint, CheckpointId(2));

        // A second writer is refused with the holder's name; a fenced one cannot commit.
        let error = Lease::acquire_job(&store, quick_lease("intruder"), clock.clone()).await.unwrap_err();
        assert!(error.to_string().contains("s3-writer"), "{error}");
        clock.advance(Duration::from_secs(120));
        let taker = job_lease(&store, "taker", &clock).await;
        assert!(taker.owner() > lease.owner());
        let fenced = checkpoint_manifest(CheckpointId(4), CheckpointKind::Checkpoint, &[u2.clone()]);
        assert!(matches!(store.commit(&fenced, &lease).await, Err(StoreError::LeaseLost { .. })));

        // GC with a zero grace period: checkpoint 1 expires, its unique file goes.
        let retention = Retention { keep_last: 1, grace: Duration::ZERO, max_delete_failures: 4 };
        let report = gc::collect(&store, &retention, &taker, SystemTime::now() + Duration::from_secs(5)).await.unwrap();
        assert_eq!(report.plan.expired, vec![CheckpointId(1)]);
        assert_eq!(report.orphans_deleted, 1, "{:?}", report.plan.orphans);
        assert!(store.verify(CheckpointId(2), VerifyDepth::Content, &()).await.unwrap().is_intact());

        // The journal on S3.
        let config = JournalConfig { lease: quick_lease("journal"), ..JournalConfig::default() };
        let run: Journal<String, u64> =
            Journal::start(&store, "backup", config, Arc::new(SystemClock), Duration::ZERO).await.unwrap();
        run.append("t1".into(), vec![1, 2, 3]).await.unwrap();
        run.finish(true).await.unwrap();
        let resumed: Resumed<String, u64, ()> = journal::resume(&store, "backup").await.unwrap();
        assert_eq!(resumed.records["t1"], vec![1, 2, 3]);

        // Encryption at rest on S3, and the wrong key.
        let key = EncryptionKey::generate();
        let sealed = s3("jobs/sealed", StoreOptions { encryption: Some(key), ..StoreOptions::default() });
        let sealed_lease = job_lease(&sealed, "sealed", &clock).await;
        checkpoint_with(&sealed, &sealed_lease, dir.path(), CheckpointId(10), CheckpointKind::Checkpoint,
            &[("s.sst", bytes(10, 5000))], None).await;
        assert!(sealed.verify(CheckpointId(10), VerifyDepth::Content, &()).await.unwrap().is_intact());
        let wrong = s3("jobs/sealed", StoreOptions { encryption: Some(EncryptionKey::generate()), ..StoreOptions::default() });
        assert!(matches!(wrong.checkpoint(CheckpointId(10)).await, Err(StoreError::Decrypt { .. })));

        // 10 % of operations failing: checkpoints still commit, none with a file missing.
        let faults = FaultConfig::new(0.1, 3);
        let flaky = s3("jobs/flaky", StoreOptions {
            faults: Some(faults.clone()),
            retry: RetryPolicy { max_retries: 8, min_delay: Duration::from_millis(5), max_delay: Duration::from_millis(50) },
            ..StoreOptions::default()
        });
        let flaky_lease = loop {
            match Lease::acquire_job(&flaky, quick_lease("flaky"), clock.clone()).await {
                Ok(lease) => break lease,
                Err(e) => assert!(e.is_temporary(), "{e}"),
            }
        };
        let mut previous = None;
        let mut committed = 0;
        for id in 1..=10u64 {
            let local = dir.path().join(format!("flaky-{id}"));
            let manifest = snapshot(&local, TaskId(1), CheckpointId(id), &[("base.sst", bytes(0, 2000)), ("own.sst", bytes(id, 2000))], previous.as_ref());
            let outcome = async {
                let uploaded = flaky.upload_snapshot(&local, &manifest, NodeId(1), &()).await?;
                flaky.commit(&checkpoint_manifest(CheckpointId(id), CheckpointKind::Checkpoint, &[uploaded]), &flaky_lease).await
            }
            .await;
            match outcome {
                Ok(()) => committed += 1,
                Err(e) => assert!(e.is_temporary() || e.is_not_found(), "{e}"),
            }
            previous = Some(manifest);
        }
        assert!(faults.injected() > 0);
        assert!(committed >= 8, "{committed}");
        let clean = s3("jobs/flaky", StoreOptions::default());
        for id in clean.committed_ids().await.unwrap() {
            assert!(clean.verify(id, VerifyDepth::Content, &()).await.unwrap().is_intact(), "{id}");
        }

        // A wrong secret is a permanent error that does not show the secret.
        let denied = s3("jobs/wordcount", StoreOptions {
            s3_credentials: Some(S3Credentials {
                access_key_id: ACCESS_KEY.into(),
                secret_access_key: "not-the-secret".into(),
                session_token: None,
            }),
            retry: RetryPolicy { max_retries: 0, ..RetryPolicy::default() },
            ..StoreOptions::default()
        });
        let error = denied.checkpoints().await.unwrap_err();
        assert!(!error.is_temporary(), "{error}");
        assert!(matches!(&error, StoreError::Backend { source, .. } if source.kind() == opendal::ErrorKind::PermissionDenied), "{error}");
        assert!(!error.to_string().contains("not-the-secret"));
        assert!(!format!("{error:?}").contains("not-the-secret"));
    });
}

#[test]
fn an_s3_store_without_credentials_says_where_it_looked() {
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_some() {
        // The environment supplies credentials; the case cannot arise here.
        assert!(Store::open("s3://bucket/p", StoreOptions::default()).is_ok());
        return;
    }
    let error = Store::open("s3://bucket/prefix", StoreOptions::default()).unwrap_err();
    assert!(matches!(error, StoreError::MissingCredentials { .. }), "{error}");
    assert!(error.to_string().contains("AWS_ACCESS_KEY_ID"), "{error}");
}
