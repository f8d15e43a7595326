//! Time: one clock decides, and tests pin it.
//!
//! Every decision is a function of a [`Timestamp`]: microseconds since the Unix epoch. Stores read
//! a [`Clock`] when the caller does not pass the time explicitly (the `*_at` forms do). Window
//! buckets are aligned to the epoch, so a per-minute window turns over on the wall-clock minute.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An instant, in whole microseconds since the Unix epoch.
///
/// Whole microseconds keep the arithmetic exact on every store: a Redis script sees the same
/// integer (Lua numbers are doubles, exact up to 2^53 µs, about 285 years).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The epoch itself.
    pub const ZERO: Timestamp = Timestamp(0);

    /// An instant `micros` microseconds after the epoch.
    pub const fn from_micros(micros: u64) -> Self {
        Timestamp(micros)
    }

    /// An instant `secs` whole seconds after the epoch.
    pub const fn from_secs(secs: u64) -> Self {
        Timestamp(secs.saturating_mul(1_000_000))
    }

    /// An instant `millis` milliseconds after the epoch.
    pub const fn from_millis(millis: u64) -> Self {
        Timestamp(millis.saturating_mul(1_000))
    }

    /// Microseconds since the epoch.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// The wall clock now.
    pub fn now() -> Self {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        // Not as_micros(): its u128 arithmetic shows on the memory store's hot path.
        Timestamp(since.as_secs() * 1_000_000 + u64::from(since.subsec_micros()))
    }

    /// This instant plus `d`, saturating, truncated to whole microseconds.
    pub fn saturating_add(self, d: Duration) -> Self {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_add(micros))
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:06}", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}

/// A source of the current time.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Timestamp;
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// The wall clock read through the CPU's time-stamp counter: a few nanoseconds a reading
/// where `clock_gettime` can cost tens (as in many VMs), which shows in a memory-store decision.
///
/// It is anchored to the system clock when created and then counts elapsed time, so it never
/// goes backwards and does not follow later steps or slews of the system clock: over a day it
/// may drift from it by the TSC calibration's error (parts per million). That is harmless to a
/// store whose decisions stay in one process, and the memory store uses it by default; decisions
/// shared across processes use one clock of their own (the Redis server's `TIME`). Where the CPU
/// has no usable counter it falls back to the monotonic clock.
#[derive(Clone, Debug)]
pub struct FastClock {
    counter: quanta::Clock,
    start_raw: u64,
    start: Timestamp,
}

impl Default for FastClock {
    fn default() -> Self {
        Self::new()
    }
}

impl FastClock {
    /// A clock anchored to the system clock now.
    pub fn new() -> Self {
        let counter = quanta::Clock::new();
        let start_raw = counter.raw();
        FastClock {
            counter,
            start_raw,
            start: Timestamp::now(),
        }
    }
}

impl Clock for FastClock {
    #[inline]
    fn now(&self) -> Timestamp {
        let nanos = self
            .counter
            .delta_as_nanos(self.start_raw, self.counter.raw());
        Timestamp(self.start.0 + nanos / 1_000)
    }
}

/// A clock that moves only when told to: tests pin and advance it.
///
/// Clones share the same time, so a test keeps one handle and gives another to a store.
///
/// ```
/// use floodgate::clock::{Clock, FakeClock, Timestamp};
/// use std::time::Duration;
///
/// let clock = FakeClock::new(Timestamp::from_secs(60));
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now(), Timestamp::from_millis(61_500));
/// ```
#[derive(Clone, Debug, Default)]
pub struct FakeClock(Arc<AtomicU64>);

impl FakeClock {
    /// A clock stopped at `start`.
    pub fn new(start: Timestamp) -> Self {
        FakeClock(Arc::new(AtomicU64::new(start.as_micros())))
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.0.fetch_add(micros, Ordering::SeqCst);
    }

    /// Sets the clock to `t`.
    pub fn set(&self, t: Timestamp) {
        self.0.store(t.as_micros(), Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}
