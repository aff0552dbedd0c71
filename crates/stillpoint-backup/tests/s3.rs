//! The store contract against a real S3-compatible server (SeaweedFS on loopback,
//! signatures checked), plus what only S3 has: credentials. One test owns the server
//! (it listens on fixed ports) and runs every contract case in turn.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;
#[macro_use]
#[path = "contract/cases.rs"]
mod cases;

use std::time::{Duration, Instant};

use std::sync::Arc;

use stillpoint_backup::{
    Lease, ManualClock, RetryPolicy, S3Credentials, Store, StoreError, StoreOptions, VerifyDepth,
};
use stillpoint_wire::{CheckpointId, CheckpointKind};
use support::s3::{ACCESS_KEY, BUCKET, ENDPOINT, S3Server, WEBDAV_ENDPOINT};
use support::{Backend, Env, bytes, checkpoint_with, job_lease, quick_lease, runtime};

async fn wait_until_ready(store: &Store) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match store.checkpoints().await {
            Ok(_) => return,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "S3 server not ready within 60 s: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

macro_rules! run_on_s3 {
    ($($name:ident),* $(,)?) => { run_timed!(S3, "s3": $($name),*) };
}

#[test]
fn the_store_contract_holds_on_a_real_s3_server() {
    let _server = S3Server::start();
    let probe = Env::new(Backend::S3);
    runtime().block_on(wait_until_ready(
        &probe.store("probe", StoreOptions::default()),
    ));

    contract_cases!(run_on_s3);
    runtime().block_on(a_checkpoint_written_over_s3_restores_over_webdav(
        &Env::new(Backend::S3),
    ));

    // A wrong secret is a permanent error that does not show the secret.
    runtime().block_on(async {
        let denied = Store::open(
            &format!("s3://{BUCKET}/denied?endpoint={ENDPOINT}"),
            StoreOptions {
                s3_credentials: Some(S3Credentials {
                    access_key_id: ACCESS_KEY.into(),
                    secret_access_key: "not-the-secret".into(),
                    session_token: None,
                }),
                retry: RetryPolicy {
                    max_retries: 0,
                    ..RetryPolicy::default()
                },
                ..StoreOptions::default()
            },
        )
        .unwrap();
        let error = denied.checkpoints().await.unwrap_err();
        assert!(!error.is_temporary(), "{error}");
        assert!(
            matches!(&error, StoreError::Backend { source, .. } if source.kind() == opendal::ErrorKind::PermissionDenied),
            "{error}"
        );
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
    assert!(
        matches!(error, StoreError::MissingCredentials { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("AWS_ACCESS_KEY_ID"), "{error}");
}

/// WebDAV cannot create an object only if it is absent, so a WebDAV store is
/// read-only: a checkpoint written through the server's S3 face is listed, verified
/// and restored through its WebDAV face, and a writer there is refused saying why.
async fn a_checkpoint_written_over_s3_restores_over_webdav(env: &Env) {
    let store = env.store("dav", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = job_lease(&store, "test", &clock).await;
    let files = vec![
        ("000001.sst", bytes(1, 100_000)),
        ("MANIFEST-000002", bytes(2, 700)),
    ];
    let (manifest, _) = checkpoint_with(
        &store,
        &lease,
        env.path(),
        CheckpointId(1),
        CheckpointKind::Checkpoint,
        &files,
        None,
    )
    .await;

    let dav = Store::open(
        &format!(
            "webdav:///buckets/{BUCKET}/{}/dav?endpoint={WEBDAV_ENDPOINT}",
            env.namespace
        ),
        StoreOptions::default(),
    )
    .unwrap();
    assert!(!dav.can_write());
    let latest = dav
        .latest()
        .await
        .unwrap()
        .expect("the checkpoint is listed");
    assert_eq!(latest.checkpoint, CheckpointId(1));
    let report = dav
        .verify(CheckpointId(1), VerifyDepth::Content, &())
        .await
        .unwrap();
    assert!(report.is_intact(), "{:?}", report.problems);
    let snapshot = dav.task_manifest(&latest.tasks[0]).await.unwrap();
    assert_eq!(snapshot, manifest);
    let target = env.path().join("from-webdav");
    let downloaded = dav
        .download_snapshot(&snapshot, &target, &())
        .await
        .unwrap();
    assert_eq!(downloaded.files_downloaded, 2);
    for (name, content) in &files {
        assert_eq!(&std::fs::read(target.join(name)).unwrap(), content);
    }

    let refused = Lease::acquire_job(&dav, quick_lease("writer"), Arc::clone(&clock) as _)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, StoreError::ReadOnly { .. })
            && refused.to_string().contains("only if it is absent"),
        "{refused}"
    );
}
