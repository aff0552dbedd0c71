//! Fault injection on top of a real store: an OpenDAL layer that fails a seeded
//! fraction of operations with temporary errors.
//!
//! OpenDAL's own `ChaosLayer` fails only reads; checkpoints must survive failing
//! writes, stats, lists and deletes too. This layer sits *below* the retry layer, so
//! it exercises the same path a flaky network does: an injected failure is retried,
//! and when retries run out the store's callers see a temporary error.
//!
//! A failed write fails at `close` in one of two ways, chosen by the same dice:
//! before the completing request (the PUT or multipart completion) reaches the store,
//! so the object never becomes visible; or — with [`FaultConfig::lost_replies`] —
//! after the store applied it, with the reply lost on the way back. The second is the
//! case that breaks naive retries of conditional writes: the retry finds the object
//! it created itself and reports that somebody else did.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use opendal::raw::*;
use opendal::{Buffer, Capability, Error, ErrorKind, Metadata, OperationContext, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::forward::forward_to_inner;

/// Which operations fail, how often, and from which seed.
#[derive(Clone, Debug)]
pub struct FaultConfig {
    /// Fraction of operations that fail, within `0.0..=1.0`.
    pub error_ratio: f64,
    /// Seed of the decision sequence (the same seed injects the same sequence given
    /// the same order of operations).
    pub seed: u64,
    /// A shared counter of injected failures (for tests that assert they happened).
    pub injected: Arc<AtomicU64>,
    /// Which operations may fail (default: all of them).
    pub operations: FaultOperations,
    /// Half of the failed writes are applied by the store and only their reply is
    /// lost (default true).
    pub lost_replies: bool,
    /// A shared counter of injected lost replies (a subset of `injected`).
    pub replies_lost: Arc<AtomicU64>,
}

/// The operations a [`FaultConfig`] may fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultOperations {
    /// Metadata lookups.
    pub stat: bool,
    /// Reads.
    pub read: bool,
    /// Writes (they fail at close, before the object becomes visible).
    pub write: bool,
    /// Listings.
    pub list: bool,
    /// Deletes.
    pub delete: bool,
}

impl FaultOperations {
    /// Every operation.
    pub const ALL: Self = Self {
        stat: true,
        read: true,
        write: true,
        list: true,
        delete: true,
    };

    /// Reads only.
    pub const READS: Self = Self {
        stat: false,
        read: true,
        write: false,
        list: false,
        delete: false,
    };

    fn includes(self, operation: &str) -> bool {
        match operation {
            "stat" => self.stat,
            "read" => self.read,
            "write" => self.write,
            "list" => self.list,
            "delete" => self.delete,
            _ => false,
        }
    }
}

impl FaultConfig {
    /// Fail `error_ratio` of operations, decided from `seed`.
    #[must_use]
    pub fn new(error_ratio: f64, seed: u64) -> Self {
        Self {
            error_ratio,
            seed,
            injected: Arc::new(AtomicU64::new(0)),
            operations: FaultOperations::ALL,
            lost_replies: true,
            replies_lost: Arc::new(AtomicU64::new(0)),
        }
    }

    /// How many of the injected failures were writes applied with their reply lost.
    #[must_use]
    pub fn replies_lost(&self) -> u64 {
        self.replies_lost.load(Ordering::Relaxed)
    }

    /// How many failures have been injected so far.
    #[must_use]
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }
}

/// The OpenDAL layer built from a [`FaultConfig`].
#[derive(Clone, Debug)]
pub(crate) struct FaultLayer {
    dice: Arc<Dice>,
}

#[derive(Debug)]
struct Dice {
    rng: Mutex<StdRng>,
    ratio: f64,
    injected: Arc<AtomicU64>,
    operations: FaultOperations,
    lost_replies: bool,
    replies_lost: Arc<AtomicU64>,
}

/// What an injected write failure does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WriteFault {
    None,
    /// The completing request never reaches the store.
    Before,
    /// The store applies it; the reply is lost.
    ReplyLost,
}

impl Dice {
    fn roll(&self, operation: &'static str, path: &str) -> Result<()> {
        if self.fails(operation) {
            return Err(injected(operation, path, "injected fault"));
        }
        Ok(())
    }

    fn fails(&self, operation: &'static str) -> bool {
        if !self.operations.includes(operation) {
            return false;
        }
        let failed = self.rng().gen_bool(self.ratio);
        if failed {
            self.injected.fetch_add(1, Ordering::Relaxed);
        }
        failed
    }

    fn roll_write(&self) -> WriteFault {
        if !self.fails("write") {
            return WriteFault::None;
        }
        if self.lost_replies && self.rng().gen_bool(0.5) {
            self.replies_lost.fetch_add(1, Ordering::Relaxed);
            return WriteFault::ReplyLost;
        }
        WriteFault::Before
    }

    fn rng(&self) -> std::sync::MutexGuard<'_, StdRng> {
        // A poisoned lock only means another roll panicked; the generator is intact.
        self.rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn injected(operation: &'static str, path: &str, what: &'static str) -> Error {
    Error::new(ErrorKind::Unexpected, what)
        .with_operation(operation)
        .with_context("path", path)
        .set_temporary()
}

impl FaultLayer {
    pub(crate) fn new(config: &FaultConfig) -> Self {
        Self {
            dice: Arc::new(Dice {
                rng: Mutex::new(StdRng::seed_from_u64(config.seed)),
                ratio: config.error_ratio.clamp(0.0, 1.0),
                injected: Arc::clone(&config.injected),
                operations: config.operations,
                lost_replies: config.lost_replies,
                replies_lost: Arc::clone(&config.replies_lost),
            }),
        }
    }
}

impl Layer for FaultLayer {
    fn apply_service(&self, inner: Servicer) -> Servicer {
        Arc::new(FaultService {
            inner,
            dice: Arc::clone(&self.dice),
        })
    }
}

#[derive(Debug)]
struct FaultService {
    inner: Servicer,
    dice: Arc<Dice>,
}

impl Service for FaultService {
    type Reader = oio::Reader;
    type Writer = FaultWriter;
    type Lister = oio::Lister;
    type Deleter = oio::Deleter;
    type Copier = oio::Copier;
    type Composer = oio::Composer;

    forward_to_inner!(info, compose, create_dir, copy, rename, restore, presign);

    fn capability(&self) -> Capability {
        let mut capability = self.inner.capability();
        capability.write_can_copy_from = false;
        capability
    }

    async fn stat(&self, ctx: &OperationContext, path: &str, args: OpStat) -> Result<RpStat> {
        self.dice.roll("stat", path)?;
        self.inner.stat(ctx, path, args).await
    }

    fn read(&self, ctx: &OperationContext, path: &str, args: OpRead) -> Result<Self::Reader> {
        self.dice.roll("read", path)?;
        self.inner.read(ctx, path, args)
    }

    fn write(&self, ctx: &OperationContext, path: &str, args: OpWrite) -> Result<Self::Writer> {
        Ok(FaultWriter {
            if_not_exists: args.if_not_exists(),
            inner: self.inner.write(ctx, path, args.clone())?,
            dice: Arc::clone(&self.dice),
            path: path.to_owned(),
            applied: None,
        })
    }

    fn list(&self, ctx: &OperationContext, path: &str, args: OpList) -> Result<Self::Lister> {
        self.dice.roll("list", path)?;
        self.inner.list(ctx, path, args)
    }

    fn delete(&self, ctx: &OperationContext) -> Result<Self::Deleter> {
        self.dice.roll("delete", "")?;
        self.inner.delete(ctx)
    }
}

/// A writer whose close may fail.
struct FaultWriter {
    inner: oio::Writer,
    dice: Arc<Dice>,
    path: String,
    if_not_exists: bool,
    /// The store applied this write but the caller was told it failed: what the
    /// store answers when the same request is sent again.
    applied: Option<Metadata>,
}

impl oio::Write for FaultWriter {
    async fn write(&mut self, bs: Buffer) -> Result<()> {
        self.inner.write_dyn(bs).await
    }

    async fn close(&mut self) -> Result<Metadata> {
        if let Some(applied) = &self.applied {
            // The request is sent again: a conditional create now finds the object it
            // created itself; a plain write replaces it with the same bytes.
            return if self.if_not_exists {
                Err(Error::new(
                    ErrorKind::ConditionNotMatch,
                    "the object already exists (if_not_exists)",
                )
                .with_operation("write")
                .with_context("path", &self.path))
            } else {
                Ok(applied.clone())
            };
        }
        match self.dice.roll_write() {
            WriteFault::None => self.inner.close_dyn().await,
            // The completing request fails before it reaches the store: nothing
            // becomes visible, and the retry layer may close again.
            WriteFault::Before => Err(injected("write", &self.path, "injected fault")),
            // The store applies the write; its caller hears only a failure and retries
            // (a conditional create then finds the object it made itself).
            WriteFault::ReplyLost => {
                self.applied = Some(self.inner.close_dyn().await?);
                Err(injected(
                    "write",
                    &self.path,
                    "injected fault: the write was applied but its reply was lost",
                ))
            }
        }
    }

    async fn abort(&mut self) -> Result<()> {
        self.inner.abort_dyn().await
    }
}
