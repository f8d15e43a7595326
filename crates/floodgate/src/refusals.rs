//! The refusal cache: a chain's last refusal, remembered in the process, answers the chain's
//! next requests without asking the store for as long as it still refuses them
//! (docs/design.md §11).
//!
//! Why it is exact: between two of its writes, a window's counts change only by charges, which
//! only add, and by time, which the store applies by the same pure function
//! ([`Snapshot::at`]). So the counts a refusal saw, carried forward to a later instant, are a
//! lower bound on what the store holds then, and a request those carried counts refuse, the
//! store refuses too, with the same statuses when no other traffic came. Only what lowers a
//! count breaks the bound: a reset, a refund, by any chain that shares a limit. So each entry
//! keeps the store's count of lowerings ([`Store::lowered`](crate::store::Store::lowered)) as
//! it was before the refusal was asked for, and answers only while that count has not moved:
//! one atomic load. A chain's own refunds also drop its entry
//! ([`Chain::forget_refusals`](crate::Chain::forget_refusals)), for a store that keeps no count.
//!
//! Which instant: a pinned one (`admit_at`) as given; on a store whose clock is in this process
//! (the memory store's, [`Store::local_now`](crate::store::Store::local_now)), its reading, so
//! the cache decides at the instant the store would, on any clock (a test's, stepped); on a
//! store whose clock is elsewhere (Redis's `TIME`), the store's instant of the refusal plus what
//! the process's monotonic clock has counted since its answer arrived. That is never later
//! than the store's clock (the answer took time to arrive), so the cache errs stricter, by at
//! most one round trip, and never by a clock step. A refusal decided at a pinned instant does
//! not answer an unpinned request there: the store's clock may be anywhere from it.
//!
//! Not remembered: the refusal of a chain with concurrency limits. It reports the slots in use,
//! which requests ending free at any moment, so a remembered one would repeat a stale count.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use crate::chain::{ChainDecision, ChainLimit, Costs, first_refusal};
use crate::clock::Timestamp;
use crate::window::{Snapshot, WindowState};

/// A chain's remembered refusal, if any.
///
/// `held` says, without the lock, whether one is remembered: a chain that is not being refused
/// (most of them, most of the time) is asked and told of every admission, and its requests, on
/// every core, then read one flag instead of taking one lock twice a request. It is written
/// only under the lock, as the entry changes. A request that reads it just before a refusal is
/// remembered asks the store, as it would have a moment earlier; an admission that finds
/// nothing remembered leaves a refusal remembered meanwhile in place, which is still exact: a
/// remembered refusal answers only while its counts, carried forward, still refuse, and an
/// admission only adds to counts.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    last: Mutex<Option<Remembered>>,
    held: AtomicBool,
}

/// What a refusal saw: enough to decide again at a later instant as the store would.
#[derive(Debug)]
struct Remembered {
    /// The store's instant of the refusal.
    now: Timestamp,
    /// When its answer arrived, on the process's monotonic clock.
    arrived: Instant,
    /// Whether `now` was pinned by the caller rather than read from the store's clock.
    pinned: bool,
    /// Each limit's counts at `now`, in chain order.
    snapshots: Vec<Snapshot>,
    /// The store's count of lowerings before the refusal was asked for.
    lowered: u128,
}

impl Refusals {
    fn last(&self) -> MutexGuard<'_, Option<Remembered>> {
        // Every write replaces the whole entry, so a poisoned lock holds a consistent one.
        self.last.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The refusal of a request of `costs` at `now()` (`None`: the store's clock, where it is
    /// elsewhere) that the remembered counts still give, decided as [`ChainDecision::from_snapshots`] decides the
    /// store's; `None` when nothing is remembered, the store has lowered counts since (its
    /// count `lowered` moved) or the remembered counts would admit it (then the entry is
    /// dropped: only the store can say more).
    pub(crate) fn answer(
        &self,
        limits: &[ChainLimit],
        costs: Costs<'_>,
        now: impl FnOnce() -> Option<Timestamp>,
        lowered: u128,
    ) -> Option<ChainDecision> {
        if !self.held.load(Ordering::Acquire) {
            return None;
        }
        let now = now();
        let mut last = self.last();
        let seen = last.as_ref()?;
        if seen.lowered != lowered {
            // A refund or a reset since: the counts may now be below what the refusal saw.
            self.put(&mut last, None);
            return None;
        }
        let t = match now {
            Some(t) => t,
            // The store's clock, elsewhere: carried from its instant of the refusal. Not from a
            // pinned instant, which may be anywhere from the store's clock.
            None if !seen.pinned => seen.now.saturating_add(seen.arrived.elapsed()),
            None => return None,
        };
        if t < seen.now || seen.snapshots.len() != limits.len() {
            // A pinned instant before the refusal: the counts then may have been lower.
            return None;
        }
        let carried: Vec<Snapshot> = limits
            .iter()
            .zip(&seen.snapshots)
            .map(|(l, s)| {
                let state = WindowState {
                    bucket: s.bucket,
                    cur: s.cur,
                    prev: s.prev,
                };
                Snapshot::at(Some(state), t, l.limit())
            })
            .collect();
        if first_refusal(limits, &carried, costs).is_none() {
            self.put(&mut last, None);
            return None;
        }
        Some(ChainDecision::from_snapshots(
            limits, &carried, t, costs, false,
        ))
    }

    /// Remembers `decision`, taken from `snapshots` by the store at a `pinned` instant or on
    /// its clock, if it is a refusal that a wait can cure (a rate limit refused and a retry
    /// time is known) of a chain without concurrency limits (their states change as requests
    /// end); anything else forgets what was remembered. `lowered` is the store's count of
    /// lowerings read before the decision was asked for: a refund that lands after that read
    /// moves the count.
    pub(crate) fn remember(
        &self,
        decision: &ChainDecision,
        snapshots: &[Snapshot],
        pinned: bool,
        lowered: u128,
    ) {
        let cacheable = decision.enforced
            && !decision.admitted
            && decision.refused_by.is_some()
            && decision.retry_after.is_some()
            && decision.in_flight.is_empty();
        if !cacheable && !self.held.load(Ordering::Acquire) {
            // Nothing to forget: the common admission takes no lock.
            return;
        }
        let entry = cacheable.then(|| Remembered {
            now: decision.now,
            arrived: Instant::now(),
            pinned,
            snapshots: snapshots.to_vec(),
            lowered,
        });
        self.put(&mut self.last(), entry);
    }

    /// Forgets the remembered refusal.
    pub(crate) fn forget(&self) {
        self.put(&mut self.last(), None);
    }

    /// Writes the entry, under the lock (`last`), and whether there is one.
    fn put(&self, last: &mut Option<Remembered>, entry: Option<Remembered>) {
        self.held.store(entry.is_some(), Ordering::Release);
        *last = entry;
    }
}
