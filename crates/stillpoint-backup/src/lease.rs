//! Lease and fencing: one writer per job (or per journal) at a time.
//!
//! A lease scope (`lease/` for the job, `journal/<name>/lease/` for a journal) holds
//! `current.json` — owner id, holder, expiry — and one `claims/<owner>.json` per owner
//! id ever taken. A new owner takes the next id by *creating* its claim file
//! (if-not-exists), so two writers racing for the same expired lease cannot both get
//! an id: the loser's create fails. The winner then writes `current.json`, waits a
//! settle delay and reads it back to catch a writer that skipped the protocol (the
//! seed's re-read). Owner ids only grow — releasing marks the lease released rather
//! than deleting it — so an owner id is a fencing token: [`Lease::check`], run by
//! [`crate::Store::commit`] right before the global manifest is written, fails once
//! anybody else has taken a later id.
//!
//! Expiry compares wall clocks of different machines; keep the TTL far above their
//! skew (the default is 60 s, refreshed every 20 s).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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
    /// Take over an unexpired lease whose holder is exactly `holder` (default
    /// false). For a process that restarts a job in-process after a crash of its own
    /// earlier run: the earlier holder is known dead. The takeover still claims a new
    /// owner id, so the dead run is fenced.
    pub reclaim_own: bool,
    /// Take over an unexpired lease whose holder is a process of this host that no
    /// longer exists (default true): a coordinator restarted after a crash need not
    /// wait out its dead predecessor's TTL. Only holders named `HOST pid PID` with
    /// this host's name are judged, and only where `/proc` shows processes; a reused
    /// pid makes us wait, never take over from a live holder. The dead holder is
    /// fenced by the new owner id like any lost lease.
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

/// Whether `holder` names a process of this host (`HOST pid PID`) that has exited.
fn is_dead_local(holder: &str) -> bool {
    let Some((host, pid)) = holder.rsplit_once(" pid ") else {
        return false;
    };
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    let proc = std::path::Path::new("/proc");
    host == host_name()
        && pid != std::process::id()
        && proc.join("self").exists()
        && !proc.join(pid.to_string()).exists()
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
}

impl LeaseRecord {
    fn live_at(&self, now: u64) -> bool {
        !self.released && self.expires_at_millis > now
    }

    fn same_holder(&self, other: &Self) -> bool {
        self.owner == other.owner && self.nonce == other.nonce
    }
}

/// A held lease. Refresh it before it expires ([`Lease::needs_refresh`]); a commit
/// checks it ([`Lease::check`]).
#[derive(Debug)]
pub struct Lease {
    store: Store,
    scope: String,
    config: LeaseConfig,
    clock: Arc<dyn Clock>,
    record: Mutex<LeaseRecord>,
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
        if config.ttl.is_zero() {
            return Err(StoreError::InvalidOption {
                option: "lease.ttl",
                reason: "must be above zero".to_owned(),
            });
        }
        let scope = scope.to_owned();
        let now = clock.now_millis();
        let current = read_current(store, &scope).await?;
        if let Some(current) = &current {
            if current.live_at(now) {
                let own = config.reclaim_own && current.holder == config.holder;
                let dead = config.reclaim_dead_local && is_dead_local(&current.holder);
                if !own && !dead {
                    return Err(held(current));
                }
                if dead {
                    tracing::info!(
                        holder = current.holder,
                        owner = current.owner,
                        "taking over the lease of a process of this host that has exited"
                    );
                }
            }
        }
        let highest_claim = claims(store, &scope).await?.last().copied().unwrap_or(0);
        let owner = current
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
        Ok(Self {
            store: store.clone(),
            scope,
            config,
            clock,
            record: Mutex::new(record),
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

    /// Whether a third of the TTL has passed since the last refresh.
    #[must_use]
    pub fn needs_refresh(&self) -> bool {
        let record = self.record();
        let now = self.clock.now_millis();
        let ttl = ttl_millis(&self.config);
        now.saturating_add(ttl - ttl / 3) >= record.expires_at_millis
    }

    /// Fencing: succeeds only if the lease in the store is still ours, unexpired, and
    /// no later owner id has been claimed.
    pub async fn check(&self) -> Result<(), StoreError> {
        let ours = self.record();
        let now = self.clock.now_millis();
        let lost = |reason: String| StoreError::LeaseLost {
            owner: ours.owner,
            reason,
        };
        if !ours.live_at(now) {
            return Err(lost(format!(
                "it expired at {} without being refreshed",
                rfc3339(ours.expires_at_millis)
            )));
        }
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
        next.expires_at_millis = self
            .clock
            .now_millis()
            .saturating_add(ttl_millis(&self.config));
        self.store
            .put_raw(&current_path(&self.scope), encode(&next), false)
            .await?;
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
