//! The store contract on `file://` and `memory://` (the S3 run is in `s3.rs`).
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

macro_rules! on_backend {
    ($backend:ident: $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let env = crate::support::Env::new(crate::support::Backend::$backend);
                crate::support::runtime().block_on(crate::cases::$name(&env));
            }
        )*
    };
}

mod file {
    macro_rules! file_cases { ($($name:ident),* $(,)?) => { on_backend!(File: $($name),*); } }
    contract_cases!(file_cases);
}

mod memory {
    macro_rules! memory_cases { ($($name:ident),* $(,)?) => { on_backend!(Memory: $($name),*); } }
    contract_cases!(memory_cases);
}

/// A store on an operator the caller built: the store's layers go on top, and the
/// contract's first case holds on it.
#[test]
fn a_store_opens_on_an_operator_the_caller_built() {
    use std::sync::Arc;

    use stillpoint_backup::{ManualClock, Store, StoreOptions, VerifyDepth};
    use stillpoint_wire::{CheckpointId, CheckpointKind};

    let op = opendal::Operator::new(opendal::services::Memory::default()).unwrap();
    let store = Store::from_operator(op, StoreOptions::default()).unwrap();
    assert!(store.can_write());
    assert!(
        store.uri().to_string().starts_with("memory://"),
        "{}",
        store.uri()
    );
    let env = crate::support::Env::new(crate::support::Backend::Memory);
    crate::support::runtime().block_on(async {
        let clock = Arc::new(ManualClock::new(1_000));
        let lease = crate::support::job_lease(&store, "test", &clock).await;
        crate::support::checkpoint_with(
            &store,
            &lease,
            env.path(),
            CheckpointId(1),
            CheckpointKind::Checkpoint,
            &[("000001.sst", crate::support::bytes(1, 10_000))],
            None,
        )
        .await;
        let report = store
            .verify(CheckpointId(1), VerifyDepth::Content, &())
            .await
            .unwrap();
        assert!(report.is_intact(), "{:?}", report.problems);
    });
}

/// Retention beside the checkpoints (`BackgroundGc`): a collection runs on the
/// runtime and is waited for only at the end; one that fails (here: the lease was
/// taken over) backs off, so the next checkpoint does not start another at once.
#[test]
fn background_gc_applies_retention_and_backs_off_after_a_failure() {
    use std::sync::Arc;
    use std::time::Duration;

    use stillpoint_backup::{BackgroundGc, ListingStatus, ManualClock, Retention, StoreOptions};
    use stillpoint_wire::{CheckpointId, CheckpointKind};

    let env = crate::support::Env::new(crate::support::Backend::File);
    let runtime = crate::support::runtime();
    let store = env.store("store", StoreOptions::default());
    let clock = Arc::new(ManualClock::new(1_000));
    let lease = Arc::new(runtime.block_on(crate::support::job_lease(&store, "gc", &clock)));
    let commit = |id: u64| {
        runtime.block_on(crate::support::checkpoint_with(
            &store,
            &lease,
            env.path(),
            CheckpointId(id),
            CheckpointKind::Checkpoint,
            &[(&format!("{id}.sst"), crate::support::bytes(id, 300))],
            None,
        ));
    };
    let committed = || -> Vec<u64> {
        let listing = runtime.block_on(store.checkpoints()).unwrap();
        listing
            .iter()
            .filter(|c| matches!(c.status, ListingStatus::Committed(_)))
            .map(|c| c.id.get())
            .collect()
    };
    for id in 1..=3 {
        commit(id);
    }
    let retention = Retention {
        keep_last: 1,
        grace: Duration::ZERO,
        ..Retention::default()
    };
    let mut gc = BackgroundGc::new(
        store.clone(),
        retention,
        Arc::clone(&lease),
        runtime.handle().clone(),
    );
    gc.after_checkpoint();
    gc.finish();
    assert_eq!(committed(), vec![3]);
    assert_eq!(gc.failures(), 0);

    commit(4);
    clock.advance(Duration::from_secs(120));
    let _other = runtime.block_on(crate::support::job_lease(&store, "other", &clock));
    gc.after_checkpoint();
    gc.finish();
    assert_eq!(gc.failures(), 1, "a collection under a lost lease fails");
    assert_eq!(committed(), vec![3, 4], "and deletes nothing");
    gc.after_checkpoint();
    gc.finish();
    assert_eq!(gc.failures(), 1, "within the backoff none starts");
}
