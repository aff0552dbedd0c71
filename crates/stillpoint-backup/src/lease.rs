//! Lease and fencing: one writer per job (or per journal) at a time.
//!
//! A lease scope (`lease/` for the job, `journal/<name>/lease/` for a journal) holds
//! `current.json` — owner id, holder, expiry — and one `claims/<owner>.json` per owner
//! id ever taken. A new owner takes the next id by *creating* its claim file
//! (if-not-exists, atomic on every store), and judges whether the lease is free from
//! the newest of `current.json` and the highest claim: two writers racing for an
//! expired lease cannot both get an id (the loser's create fails), and a writer that
//! read the lease just before another claimed it finds that claim when it tries the
//! same id, so of any number of racers at most one acquires. The winner then writes
//! `current.json`, waits a settle delay and reads it back to catch a writer that
//! skipped the protocol (the seed's re-read). Owner ids only grow — releasing marks
//! the lease released rather than deleting it — so an owner id is a fencing token:
//! [`Lease::check`], run by [`crate::Store::commit`] right before the global manifest
//! is written, fails once anybody else has taken a later id.
//!
//! Every write on the holder's behalf goes through a store [fenced](crate::Store::fenced)
//! by the lease's [`Fence`]: a local deadline, a quarter of the TTL before the lease
//! lapses, after which nothing more is written until a refresh has confirmed the
//! lease. An owner that was paused (a stopped process, a long GC pause, a suspended
//! VM) therefore writes nothing when it resumes, and a commit is given up at that
//! deadline, before a successor may take over.
//!
//! Holders are identified by a random instance token drawn once per process, with
//! the kernel's boot id and the process's pid namespace: host names and pids repeat
//! across containers (pid 1 everywhere), tokens do not. A process reclaims its own
//! lease only with the token it holds, and judges a holder dead only when it ran
//! under the same kernel boot and pid namespace and its pid is gone.
//!
//! Expiry compares wall clocks of different machines; keep the TTL far above their
//! skew (the default is 60 s, refreshed every 20 s).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rand::RngCore;
use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

/// Milliseconds since the Unix epoch, from a clock the caller chooses.
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current time.
    fn now_millis(&self) -> u64;
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_millis(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to (for tests of expiry and takeover).
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock showing `millis`.
    #[must_use]
    pub fn new(millis: u64) -> Self {
        Self(AtomicU64::new(millis))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.0.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_millis(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// How a lease is taken and kept.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// How long a lease lasts unless refreshed (default 60 s).
    pub ttl: Duration,
    /// How long to wait before reading the lease back after taking it (default 1 s;
    /// the seed waits 3 s). Zero skips the wait but not the read.
    pub settle: Duration,
    /// Who we are, shown to a writer that finds the lease held (default
    /// `HOSTNAME pid PID`).
    pub holder: String,
    /// Take over an unexpired lease held by this very process (default false): by
    /// an earlier run of the job in this process that crashed (the engine restarts
    /// jobs in-process). Judged by the process's random instance token, never by
    /// the holder's name. The takeover still claims a new owner id, so the earlier
    /// run is fenced.
    pub reclaim_own: bool,
    /// Take over an unexpired lease whose holder was a process that has exited,
    /// under this kernel boot and in this pid namespace (default true): a
    /// coordinator restarted after a crash need not wait out its dead predecessor's
    /// TTL. Only judged where `/proc` shows processes; a holder from another boot,
    /// another container (pid namespace) or an older version is waited for, and a
    /// reused pid makes us wait, never take over from a live holder. The dead holder
    /// is fenced by the new owner id like any lost lease.
    pub reclaim_dead_local: bool,
}

fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown-host".to_owned())
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(60),
            settle: Duration::from_secs(1),
            holder: format!("{} pid {}", host_name(), std::process::id()),
            reclaim_own: false,
            reclaim_dead_local: true,
        }
    }
}

/// Who this process is, in lease records.
#[derive(Debug)]
struct Identity {
    /// Random, drawn once per process: the token a process reclaims its own lease with.
    instance: String,
    /// `/proc/sys/kernel/random/boot_id`, empty where there is none.
    boot_id: String,
    /// The pid namespace (`/proc/self/ns/pid`), empty where there is none.
    pid_namespace: String,
}

fn identity() -> &'static Identity {
    static IDENTITY: OnceLock<Identity> = OnceLock::new();
    IDENTITY.get_or_init(|| Identity {
        instance: format!(
            "{:016x}{:016x}",
            rand::rngs::OsRng.next_u64(),
            rand::rngs::OsRng.next_u64()
        ),
        boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|id| id.trim().to_owned())
            .unwrap_or_default(),
        pid_namespace: std::fs::read_link("/proc/self/ns/pid")
            .map(|ns| ns.to_string_lossy().into_owned())
            .unwrap_or_default(),
    })
}

/// Whether `record` was taken by this process (same instance token).
fn is_own(record: &LeaseRecord) -> bool {
    !record.instance.is_empty() && record.instance == identity().instance
}

/// Whether `record`'s holder was a process of this kernel boot and pid namespace
/// that has exited.
fn is_dead_local(record: &LeaseRecord) -> bool {
    let us = identity();
    let proc = std::path::Path::new("/proc");
    !us.boot_id.is_empty()
        && !us.pid_namespace.is_empty()
        && record.boot_id == us.boot_id
        && record.pid_namespace == us.pid_namespace
        && record.pid != 0
        && record.pid != std::process::id()
        && proc.join("self").exists()
        && !proc.join(record.pid.to_string()).exists()
}

/// The content of a lease file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRecord {
    /// The owner id: strictly increasing over the life of the store.
    pub owner: u64,
    /// Who holds it.
    pub holder: String,
    /// Random, so that two records with the same owner id never compare equal.
    pub nonce: u64,
    /// When it was taken.
    pub acquired_at_millis: u64,
    /// When it lapses unless refreshed.
    pub expires_at_millis: u64,
    /// Given up by its owner.
    pub released: bool,
    /// The holder process's random instance token (empty in records of older
    /// versions).
    #[serde(default)]
    pub instance: String,
    /// The holder's kernel boot id.
    #[serde(default)]
    pub boot_id: String,
    /// The holder's pid namespace.
    #[serde(default)]
    pub pid_namespace: String,
    /// The holder's pid, within that namespace.
    #[serde(default)]
    pub pid: u32,
}

impl LeaseRecord {
    fn live_at(&self, now: u64) -> bool {
        !self.released && self.expires_at_millis > now
    }

    fn same_holder(&self, other: &Self) -> bool {
        self.owner == other.owner && self.nonce == other.nonce
    }
}

/// A held lease. Refresh it before it expires ([`Lease::needs_refresh`]), or let a
/// keeper task do it ([`Lease::keep`]); a commit checks it ([`Lease::check`]).
#[derive(Debug)]
pub struct Lease {
    store: Store,
    scope: String,
    config: LeaseConfig,
    clock: Arc<dyn Clock>,
    record: Mutex<LeaseRecord>,
    fence: Fence,
}

/// The local half of fencing: until when a lease holder may start writes.
///
/// Cheap to clone and check (no I/O). It allows writes until a quarter of the TTL
/// before the lease lapses, is moved on by every successful [`Lease::refresh`], and
/// is closed for good when the lease is found lost or is released. A store
/// [fenced](crate::Store::fenced) by it refuses every write and delete once it is
/// closed, with [`StoreError::LeaseLost`].
#[derive(Clone, Debug)]
pub struct Fence {
    state: Arc<FenceState>,
}

#[derive(Debug)]
struct FenceState {
    owner: u64,
    write_until_millis: AtomicU64,
    lost: AtomicBool,
    clock: Arc<dyn Clock>,
}

impl Fence {
    fn new(owner: u64, clock: Arc<dyn Clock>) -> Self {
        Self {
            state: Arc::new(FenceState {
                owner,
                write_until_millis: AtomicU64::new(0),
                lost: AtomicBool::new(false),
                clock,
            }),
        }
    }

    /// Whether `other` is this very fence (a clone of it).
    #[must_use]
    pub fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    /// The owner id it fences for.
    #[must_use]
    pub fn owner(&self) -> u64 {
        self.state.owner
    }

    /// Fails with [`StoreError::LeaseLost`] unless writes may start now.
    pub fn check(&self) -> Result<(), StoreError> {
        let lost = |reason: String| StoreError::LeaseLost {
            owner: self.state.owner,
            reason,
        };
        if self.state.lost.load(Ordering::SeqCst) {
            return Err(lost(
                "it was taken over or released; this writer must stop".to_owned(),
            ));
        }
        let until = self.state.write_until_millis.load(Ordering::SeqCst);
        if self.state.clock.now_millis() >= until {
            return Err(lost(format!(
                "its write deadline {} passed without a refresh",
                rfc3339(until)
            )));
        }
        Ok(())
    }

    /// Fails with [`StoreError::LeaseLost`] once the lease was found lost or was
    /// released (the fence closed for good). Unlike [`Fence::check`], a refresh that
    /// is late but may still get through is not a failure.
    pub fn check_held(&self) -> Result<(), StoreError> {
        if self.state.lost.load(Ordering::SeqCst) {
            return self.check();
        }
        Ok(())
    }

    /// How long writes may still start (zero once closed).
    #[must_use]
    pub fn time_left(&self) -> Duration {
        if self.state.lost.load(Ordering::SeqCst) {
            return Duration::ZERO;
        }
        let until = self.state.write_until_millis.load(Ordering::SeqCst);
        Duration::from_millis(until.saturating_sub(self.state.clock.now_millis()))
    }

    fn extend(&self, expires_at_millis: u64, ttl_millis: u64) {
        self.state.write_until_millis.store(
            expires_at_millis.saturating_sub(ttl_millis / 4),
            Ordering::SeqCst,
        );
    }

    fn close(&self) {
        self.state.lost.store(true, Ordering::SeqCst);
    }
}

/// RFC 3339 UTC of a millisecond timestamp.
pub(crate) fn rfc3339(millis: u64) -> String {
    i64::try_from(millis)
        .ok()
        .and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(|| format!("{millis} ms after the epoch"), |t| t.to_string())
}

impl Lease {
    /// Takes the job's lease (`lease/` in the store).
    pub async fn acquire_job(
        store: &Store,
        config: LeaseConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        Self::acquire(store, crate::layout::JOB_LEASE, config, clock).await
    }

    /// Takes the lease of `scope` (a directory path ending in `/`).
    pub async fn acquire(
        store: &Store,
        scope: &str,
        config: LeaseConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StoreError> {
        store.require_writable()?;
        if config.ttl.is_zero() {
            return Err(StoreError::InvalidOption {
                option: "lease.ttl",
                reason: "must be above zero".to_owned(),
            });
        }
        let scope = scope.to_owned();
        // The lease's own files are written whatever the fence of the handle says.
        let store = &store.unfenced();
        let now = clock.now_millis();
        let current = read_current(store, &scope).await?;
        let highest_claim = claims(store, &scope).await?.last().copied().unwrap_or(0);
        // The newest word on who holds the lease: `current.json`, or a claim newer
        // than it (taken by a writer that has not written `current.json` yet).
        let newest = match &current {
            Some(current) if current.owner >= highest_claim => Some(current.clone()),
            _ if highest_claim > 0 => {
                match read_record(store, &claim_path(&scope, highest_claim)).await {
                    Ok(claim) => Some(claim),
                    Err(StoreError::NotFound { .. }) => current.clone(),
                    Err(StoreError::Corrupt { path, problem }) => {
                        tracing::warn!(path, problem, "ignoring a corrupt lease claim");
                        current.clone()
                    }
                    Err(other) => return Err(other),
                }
            }
            _ => current.clone(),
        };
        if let Some(newest) = &newest
            && newest.live_at(now)
        {
            let own = config.reclaim_own && is_own(newest);
            let dead = config.reclaim_dead_local && is_dead_local(newest);
            if !own && !dead {
                return Err(held(newest));
            }
            if dead {
                tracing::info!(
                    holder = newest.holder,
                    owner = newest.owner,
                    "taking over the lease of a process of this host that has exited"
                );
            }
        }
        let owner = newest
            .as_ref()
            .map_or(0, |c| c.owner)
            .max(highest_claim)
            .checked_add(1)
            .ok_or_else(|| StoreError::InvalidOption {
                option: "lease owner",
                reason: "owner ids are exhausted".to_owned(),
            })?;
        let record = LeaseRecord {
            owner,
            holder: config.holder.clone(),
            nonce: rand::rngs::OsRng.next_u64(),
            acquired_at_millis: now,
            expires_at_millis: now.saturating_add(ttl_millis(&config)),
            released: false,
            instance: identity().instance.clone(),
            boot_id: identity().boot_id.clone(),
            pid_namespace: identity().pid_namespace.clone(),
            pid: std::process::id(),
        };
        let claim = claim_path(&scope, owner);
        if !store.put_raw(&claim, encode(&record), true).await? {
            // Somebody created this id's claim between our reads and our create.
            let theirs = read_record(store, &claim).await?;
            return Err(held(&theirs));
        }
        store
            .put_raw(&current_path(&scope), encode(&record), false)
            .await?;
        if !config.settle.is_zero() {
            tokio::time::sleep(config.settle).await;
        }
        match read_current(store, &scope).await? {
            Some(found) if found.same_holder(&record) => {}
            Some(found) => return Err(held(&found)),
            None => {
                return Err(StoreError::LeaseLost {
                    owner,
                    reason: "the lease file vanished right after it was written".to_owned(),
                });
            }
        }
        tracing::info!(scope, owner, holder = record.holder, "lease acquired");
        // Old claims are history; keep a few for diagnosis.
        let stale: Vec<String> = claims(store, &scope)
            .await?
            .into_iter()
            .filter(|id| *id + 8 < owner)
            .map(|id| claim_path(&scope, id))
            .collect();
        if let Err(error) = store.delete_all(stale, 4).await {
            tracing::debug!(%error, "pruning old lease claims failed");
        }
        let fence = Fence::new(owner, Arc::clone(&clock));
        fence.extend(record.expires_at_millis, ttl_millis(&config));
        Ok(Self {
            store: store.clone(),
            scope,
            config,
            clock,
            record: Mutex::new(record),
            fence,
        })
    }

    /// Our owner id: the fencing token.
    #[must_use]
    pub fn owner(&self) -> u64 {
        self.record().owner
    }

    /// A copy of our lease record.
    #[must_use]
    pub fn record(&self) -> LeaseRecord {
        self.record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The lease's fence, for [`crate::Store::fenced`].
    #[must_use]
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// Whether a third of the TTL has passed since the last refresh.
    #[must_use]
    pub fn needs_refresh(&self) -> bool {
        self.until_refresh().is_zero()
    }

    /// Fencing: succeeds only if the lease in the store is still ours, unexpired, and
    /// no later owner id has been claimed.
    pub async fn check(&self) -> Result<(), StoreError> {
        let outcome = self.check_store().await;
        if matches!(outcome, Err(StoreError::LeaseLost { .. })) {
            self.fence.close();
        }
        outcome
    }

    async fn check_store(&self) -> Result<(), StoreError> {
        let ours = self.record();
        let lost = |reason: String| StoreError::LeaseLost {
            owner: ours.owner,
            reason,
        };
        self.live_now(&ours, "without being refreshed")?;
        match read_current(&self.store, &self.scope).await? {
            Some(found) if found.same_holder(&ours) => {}
            Some(found) => {
                return Err(lost(format!(
                    "{} (owner {}) holds it now",
                    found.holder, found.owner
                )));
            }
            None => return Err(lost("the lease file was deleted".to_owned())),
        }
        let next = claim_path(&self.scope, ours.owner + 1);
        if self.store.size_of(&next).await?.is_some() {
            let theirs = read_record(&self.store, &next).await?;
            return Err(lost(format!(
                "{} claimed owner {} and is taking over",
                theirs.holder, theirs.owner
            )));
        }
        Ok(())
    }

    /// Extends the lease by a TTL from now, after checking it is still ours.
    pub async fn refresh(&self) -> Result<(), StoreError> {
        self.check().await?;
        let mut next = self.record();
        // The store has no compare-and-swap: a holder paused between the check and
        // the write (a stopped process, a stalled thread) must not land a stale
        // refresh over its successor's record when it resumes. Like every fenced
        // write, the refresh goes out only while the lease is still live now.
        let now = self
            .live_now(
                &next,
                "while it was being refreshed (the holder was paused)",
            )
            .inspect_err(|_| self.fence.close())?;
        next.expires_at_millis = now.saturating_add(ttl_millis(&self.config));
        self.store
            .put_raw(&current_path(&self.scope), encode(&next), false)
            .await?;
        self.fence
            .extend(next.expires_at_millis, ttl_millis(&self.config));
        *self
            .record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = next;
        Ok(())
    }

    /// Gives the lease up (marks it released; the owner id stays, so ids keep
    /// growing). A lease already lost is left alone.
    pub async fn release(self) -> Result<(), StoreError> {
        if let Err(error) = self.check().await {
            tracing::warn!(%error, "not releasing a lease that is no longer ours");
            return Ok(());
        }
        self.fence.close();
        let mut released = self.record();
        released.released = true;
        released.expires_at_millis = self.clock.now_millis();
        self.store
            .put_raw(&current_path(&self.scope), encode(&released), false)
            .await?;
        tracing::info!(scope = self.scope, owner = released.owner, "lease released");
        Ok(())
    }
}

impl Lease {
    /// Hands the lease to a keeper task on `runtime` that refreshes it whenever a
    /// third of its TTL has passed, whatever the holder is doing.
    ///
    /// A holder that renews its lease between its own steps loses it to any step
    /// that takes longer than the refresh margin — a commit waiting out retries on a
    /// flaky store, a long garbage collection. The keeper runs beside it instead
    /// (give it a multi-thread runtime, so it runs while the holder's thread is
    /// busy or blocked). A refresh that fails on a temporary error is retried; the
    /// fence stays the safety net, closing writes a quarter of the TTL before the
    /// lease would lapse if no refresh gets through. A lease found lost closes the
    /// fence for good and stops the keeper.
    #[must_use]
    pub fn keep(self, runtime: &tokio::runtime::Handle) -> KeptLease {
        let lease = Arc::new(self);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let keeper = runtime.spawn(keep_fresh(Arc::clone(&lease), stopped));
        KeptLease {
            lease,
            stop: Some(stop),
            keeper: Some(keeper),
        }
    }

    /// The time now, or [`StoreError::LeaseLost`] when `ours` has expired by then
    /// (`how` tells the circumstance).
    fn live_now(&self, ours: &LeaseRecord, how: &str) -> Result<u64, StoreError> {
        let now = self.clock.now_millis();
        if ours.live_at(now) {
            return Ok(now);
        }
        Err(StoreError::LeaseLost {
            owner: ours.owner,
            reason: format!("it expired at {} {how}", rfc3339(ours.expires_at_millis)),
        })
    }

    /// How long until the lease needs a refresh (zero when it does now).
    fn until_refresh(&self) -> Duration {
        let record = self.record();
        let ttl = ttl_millis(&self.config);
        let due = record.expires_at_millis.saturating_sub(ttl - ttl / 3);
        Duration::from_millis(due.saturating_sub(self.clock.now_millis()))
    }
}

/// A lease refreshed by a task of its own ([`Lease::keep`]). It derefs to the
/// [`Lease`] for commits and checks; [`KeptLease::release`] stops the keeper and
/// gives the lease up, and dropping it stops the keeper without releasing (a
/// crashed holder's lease runs out its TTL).
#[derive(Debug)]
pub struct KeptLease {
    lease: Arc<Lease>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    keeper: Option<tokio::task::JoinHandle<()>>,
}

impl KeptLease {
    /// The lease itself, shared (for work that outlives a borrow, such as a
    /// background collection; the keeper goes on refreshing it).
    #[must_use]
    pub fn shared(&self) -> Arc<Lease> {
        Arc::clone(&self.lease)
    }
}

impl std::ops::Deref for KeptLease {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        &self.lease
    }
}

impl KeptLease {
    /// Stops the keeper (after a refresh in flight finishes) and releases the lease.
    pub async fn release(mut self) -> Result<(), StoreError> {
        self.stop_keeper().await;
        let lease = Arc::clone(&self.lease);
        drop(self);
        match Arc::try_unwrap(lease) {
            Ok(lease) => lease.release().await,
            // Only the keeper shared it; a keeper that could not be joined may still.
            Err(lease) => {
                lease.fence.close();
                tracing::warn!("the lease is still shared; left to run out its TTL");
                Ok(())
            }
        }
    }

    async fn stop_keeper(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _stopped = stop.send(());
        }
        if let Some(keeper) = self.keeper.take()
            && let Err(error) = keeper.await
        {
            tracing::warn!(%error, "the lease keeper ended abnormally");
        }
    }
}

impl Drop for KeptLease {
    fn drop(&mut self) {
        if let Some(keeper) = &self.keeper {
            keeper.abort();
        }
    }
}

/// The keeper's loop: wake when a refresh is due (or at least every sixth of the
/// TTL, so a clock that jumps is noticed), refresh, retry temporary failures.
async fn keep_fresh(lease: Arc<Lease>, mut stop: tokio::sync::oneshot::Receiver<()>) {
    let ttl = lease.config.ttl;
    let poll = (ttl / 6).max(Duration::from_millis(1));
    let retry = (ttl / 20).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let mut retrying = false;
    loop {
        let wait = if retrying {
            retry
        } else {
            lease.until_refresh().min(poll)
        };
        tokio::select! {
            _ = &mut stop => return,
            () = tokio::time::sleep(wait) => {}
        }
        if !lease.needs_refresh() {
            retrying = false;
            continue;
        }
        retrying = match lease.refresh().await {
            Ok(()) => false,
            Err(error @ StoreError::LeaseLost { .. }) => {
                tracing::error!(%error, "the lease is lost; this holder's writes are fenced");
                return;
            }
            Err(error) => {
                tracing::warn!(
                    %error,
                    retry_in = ?retry,
                    write_time_left = ?lease.fence.time_left(),
                    "refreshing the lease failed; retrying"
                );
                true
            }
        };
    }
}

/// Who holds the lease of `scope` right now, if anybody.
pub async fn lease_holder(
    store: &Store,
    scope: &str,
    now_millis: u64,
) -> Result<Option<LeaseRecord>, StoreError> {
    Ok(read_current(store, scope)
        .await?
        .filter(|record| record.live_at(now_millis)))
}

fn ttl_millis(config: &LeaseConfig) -> u64 {
    u64::try_from(config.ttl.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

fn held(record: &LeaseRecord) -> StoreError {
    StoreError::LeaseHeld {
        holder: record.holder.clone(),
        owner: record.owner,
        expires_at: rfc3339(record.expires_at_millis),
    }
}

fn current_path(scope: &str) -> String {
    format!("{scope}current.json")
}

fn claim_path(scope: &str, owner: u64) -> String {
    format!("{scope}claims/{owner:020}.json")
}

fn encode(record: &LeaseRecord) -> Vec<u8> {
    // A struct of integers, a bool and a string always serializes.
    serde_json::to_vec(record).unwrap_or_default()
}

async fn read_record(store: &Store, path: &str) -> Result<LeaseRecord, StoreError> {
    let bytes = store.get_raw(path).await?;
    serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
        path: path.to_owned(),
        problem: format!("not a lease record: {e}"),
    })
}

async fn read_current(store: &Store, scope: &str) -> Result<Option<LeaseRecord>, StoreError> {
    let path = current_path(scope);
    match read_record(store, &path).await {
        Ok(record) => Ok(Some(record)),
        Err(StoreError::NotFound { .. }) => Ok(None),
        // An unreadable lease protects nobody; the claims still order owner ids.
        Err(StoreError::Corrupt { path, problem }) => {
            tracing::warn!(path, problem, "ignoring a corrupt lease file");
            Ok(None)
        }
        Err(other) => Err(other),
    }
}

/// Owner ids claimed in `scope`, ascending.
async fn claims(store: &Store, scope: &str) -> Result<Vec<u64>, StoreError> {
    let prefix = format!("{scope}claims/");
    Ok(store
        .list(&prefix)
        .await?
        .iter()
        .filter_map(|o| {
            o.path
                .strip_prefix(&prefix)?
                .strip_suffix(".json")?
                .parse()
                .ok()
        })
        .collect())
}
