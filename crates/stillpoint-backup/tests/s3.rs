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

use stillpoint_backup::{RetryPolicy, S3Credentials, Store, StoreError, StoreOptions};
use support::s3::{ACCESS_KEY, BUCKET, ENDPOINT, S3Server};
use support::{Backend, Env, runtime};

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
    ($($name:ident),* $(,)?) => {
        $(
            {
                let env = Env::new(Backend::S3);
                let started = Instant::now();
                runtime().block_on(cases::$name(&env));
                eprintln!("s3: {} passed in {:.1} s", stringify!($name), started.elapsed().as_secs_f64());
            }
        )*
    };
}

#[test]
fn the_store_contract_holds_on_a_real_s3_server() {
    let _server = S3Server::start();
    let probe = Env::new(Backend::S3);
    runtime().block_on(wait_until_ready(
        &probe.store("probe", StoreOptions::default()),
    ));

    contract_cases!(run_on_s3);

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
