//! `Time`: a point on the driver's clock. The machines never read a clock; every
//! handler is given `now`, so a simulated hour runs in milliseconds.

use std::fmt;
use std::ops::Add;
use std::time::Duration;

/// A point in time, in microseconds since an epoch the driver chooses (process start,
/// simulation start). Only differences between two `Time`s mean anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(u64);

impl Time {
    /// The epoch.
    pub const ZERO: Self = Self(0);

    /// `micros` microseconds after the epoch.
    #[must_use]
    pub const fn from_micros(micros: u64) -> Self {
        Self(micros)
    }

    /// `millis` milliseconds after the epoch.
    #[must_use]
    pub const fn from_millis(millis: u64) -> Self {
        Self(millis.saturating_mul(1000))
    }

    /// `elapsed` after the epoch (saturating at `u64::MAX` microseconds).
    #[must_use]
    pub fn from_duration(elapsed: Duration) -> Self {
        Self(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
    }

    /// Microseconds since the epoch.
    #[must_use]
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    #[must_use]
    pub const fn saturating_since(self, earlier: Self) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }

    /// Microseconds from `earlier` to `self`, zero if `earlier` is later.
    #[must_use]
    pub const fn micros_since(self, earlier: Self) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Time {
    type Output = Self;

    fn add(self, rhs: Duration) -> Self {
        Self(
            self.0
                .saturating_add(u64::try_from(rhs.as_micros()).unwrap_or(u64::MAX)),
        )
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:06}s", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}
