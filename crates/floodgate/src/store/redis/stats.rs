//! The store's counters: what [`RedisStore::stats`] reports, for metrics.

use std::sync::atomic::{AtomicU64, Ordering};

use super::RedisStore;

/// Counters since the store was created, for metrics. Decisions count chain admissions and
/// token-bucket acquires alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Decisions Redis took that admitted.
    pub admitted: u64,
    /// Decisions Redis took that refused.
    pub refused: u64,
    /// Decisions admitted unchecked because Redis was unreachable.
    pub failed_open: u64,
    /// Decisions refused with [`Error::Unavailable`](crate::Error::Unavailable) because Redis was
    /// unreachable.
    pub failed_closed: u64,
    /// Other failed calls: recording and resets while unreachable, and errors Redis answered.
    pub errors: u64,
    /// Operations replayed after a dropped connection.
    pub replays: u64,
    /// Outages: times the circuit breaker opened.
    pub outages: u64,
    /// Script calls that carried admissions: fewer than admissions when they were batched.
    pub admit_batches: u64,
    /// Script calls that carried charges (tokens recorded, spend added): fewer than charges
    /// when they were batched.
    pub charge_batches: u64,
    /// Script calls that carried budget reads (period counters read before admissions): fewer
    /// than reads when they were batched.
    pub read_batches: u64,
    /// Whether the circuit breaker is open now (Redis is being probed).
    pub breaker_open: bool,
}

/// What [`RedisStats`] reads: bumped where each event happens.
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) admitted: AtomicU64,
    pub(super) refused: AtomicU64,
    pub(super) failed_open: AtomicU64,
    pub(super) failed_closed: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) replays: AtomicU64,
    pub(super) outages: AtomicU64,
    pub(super) admit_batches: AtomicU64,
    pub(super) charge_batches: AtomicU64,
    pub(super) read_batches: AtomicU64,
}

/// Counts one event.
pub(super) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl RedisStore {
    /// The counters since the store was created.
    pub fn stats(&self) -> RedisStats {
        let c = &self.inner.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RedisStats {
            admitted: load(&c.admitted),
            refused: load(&c.refused),
            failed_open: load(&c.failed_open),
            failed_closed: load(&c.failed_closed),
            errors: load(&c.errors),
            replays: load(&c.replays),
            outages: load(&c.outages),
            admit_batches: load(&c.admit_batches),
            charge_batches: load(&c.charge_batches),
            read_batches: load(&c.read_batches),
            breaker_open: self.inner.open.load(Ordering::Acquire),
        }
    }
}
