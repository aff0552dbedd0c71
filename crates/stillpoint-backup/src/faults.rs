//! Fault injection on top of a real store: an OpenDAL layer that fails a seeded
//! fraction of operations with temporary errors.
//!
//! OpenDAL's own `ChaosLayer` fails only reads; checkpoints must survive failing
//! writes, stats, lists and deletes too. This layer sits *below* the retry layer, so
//! it exercises the same path a flaky network does: an injected failure is retried,
//! and when retries run out the store's callers see a temporary error. A failed write
//! fails at `close`, after its bytes went through but before the completing request
//! (the PUT or multipart completion), so the object never becomes visible.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use opendal::raw::*;
use opendal::{Buffer, Capability, Error, ErrorKind, Metadata, OperationContext, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
        }
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
}

impl Dice {
    fn roll(&self, operation: &'static str, path: &str) -> Result<()> {
        if !self.operations.includes(operation) {
            return Ok(());
        }
        // A poisoned lock only means another roll panicked; the generator is intact.
        let mut rng = self
            .rng
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if rng.gen_bool(self.ratio) {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(ErrorKind::Unexpected, "injected fault")
                .with_operation(operation)
                .with_context("path", path)
                .set_temporary());
        }
        Ok(())
    }
}

impl FaultLayer {
    pub(crate) fn new(config: &FaultConfig) -> Self {
        Self {
            dice: Arc::new(Dice {
                rng: Mutex::new(StdRng::seed_from_u64(config.seed)),
                ratio: config.error_ratio.clamp(0.0, 1.0),
                injected: Arc::clone(&config.injected),
                operations: config.operations,
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

    fn info(&self) -> ServiceInfo {
        self.inner.info()
    }

    fn capability(&self) -> Capability {
        let mut capability = self.inner.capability();
        capability.write_can_copy_from = false;
        capability
    }

    fn compose(&self, ctx: &OperationContext, to: &str, args: OpCompose) -> Result<Self::Composer> {
        self.inner.compose(ctx, to, args)
    }

    async fn create_dir(
        &self,
        ctx: &OperationContext,
        path: &str,
        args: OpCreateDir,
    ) -> Result<RpCreateDir> {
        self.inner.create_dir(ctx, path, args).await
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
            inner: self.inner.write(ctx, path, args)?,
            dice: Arc::clone(&self.dice),
            path: path.to_owned(),
        })
    }

    fn copy(
        &self,
        ctx: &OperationContext,
        from: &str,
        to: &str,
        args: OpCopy,
    ) -> Result<Self::Copier> {
        self.inner.copy(ctx, from, to, args)
    }

    fn list(&self, ctx: &OperationContext, path: &str, args: OpList) -> Result<Self::Lister> {
        self.dice.roll("list", path)?;
        self.inner.list(ctx, path, args)
    }

    fn delete(&self, ctx: &OperationContext) -> Result<Self::Deleter> {
        self.dice.roll("delete", "")?;
        self.inner.delete(ctx)
    }

    async fn rename(
        &self,
        ctx: &OperationContext,
        from: &str,
        to: &str,
        args: OpRename,
    ) -> Result<RpRename> {
        self.inner.rename(ctx, from, to, args).await
    }

    async fn restore(
        &self,
        ctx: &OperationContext,
        path: &str,
        args: OpRestore,
    ) -> Result<RpRestore> {
        self.inner.restore(ctx, path, args).await
    }

    async fn presign(
        &self,
        ctx: &OperationContext,
        path: &str,
        args: OpPresign,
    ) -> Result<RpPresign> {
        self.inner.presign(ctx, path, args).await
    }
}

/// A writer whose close may fail.
struct FaultWriter {
    inner: oio::Writer,
    dice: Arc<Dice>,
    path: String,
}

impl oio::Write for FaultWriter {
    async fn write(&mut self, bs: Buffer) -> Result<()> {
        self.inner.write_dyn(bs).await
    }

    async fn close(&mut self) -> Result<Metadata> {
        // The completing request fails before it reaches the store: nothing becomes
        // visible, and the retry layer may close again.
        self.dice.roll("write", &self.path)?;
        self.inner.close_dyn().await
    }

    async fn abort(&mut self) -> Result<()> {
        self.inner.abort_dyn().await
    }
}
