//! A window's state in the memory store, behind a lock of its own, and where a limit remembers
//! it (docs/design.md §2, "The memory store's step").
//!
//! The memory store keeps each window in a [`WindowCell`]; its tables map a storage key to the
//! cell. A [`ChainLimit`](crate::ChainLimit) remembers the cell of the first memory store that
//! looks it up ([`CellCache`]), so that its later decisions on that store go straight to the
//! cell: no hash probe, no key compared, no table lock.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::clock::Timestamp;
use crate::window::WindowState;

/// One window of the memory store: its state under a lock of its own. Small (with its `Arc`'s
/// counts, 56 bytes): a decision touches a cell per limit, and a busy store's cells should stay
/// in the cores' caches. (The store's table keeps the key beside it.)
///
/// The lock is a flag taken by an atomic exchange and given back by a plain release store, not a
/// `std::sync::Mutex`, whose unlock is a second atomic exchange (it must learn whether a thread
/// sleeps on it) and whose waiters sleep in the kernel. A cell is held for a few loads and stores,
/// never across a call that can block, so a thread that finds one held spins until it is free,
/// then yields its core and at last sleeps between looks if the holder was descheduled
/// (docs/design.md §2). The state is in
/// atomics read and written only under the flag (its acquire and release order them), so no
/// `unsafe` is needed to share it.
#[derive(Debug)]
pub(crate) struct WindowCell {
    held: AtomicBool,
    /// Where the cell comes in the order decisions lock cells in ([`lock_order`]).
    ///
    /// [`lock_order`]: WindowCell::lock_order
    rank: u8,
    bucket: AtomicU64,
    cur: AtomicU64,
    prev: AtomicU64,
    expires: AtomicU64,
}

/// A cell's state: the window, and when it stops mattering (`2W` after its last write). An
/// expired state reads as none.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CellState {
    pub(crate) window: WindowState,
    pub(crate) expires: Timestamp,
}

impl CellState {
    /// The window, if it still matters at `now`.
    pub(crate) fn live(&self, now: Timestamp) -> Option<WindowState> {
        (self.expires > now).then_some(self.window)
    }
}

/// Spins a waiter makes on a held cell before it yields its core between looks: far longer
/// than any holder holds one, unless the holder was descheduled.
const SPINS: u32 = 128;
/// Yields after the spins before a waiter sleeps between looks instead: a holder still not done
/// is off its core (a virtual machine's vCPU preempted by its host, say), and a waiter that only
/// yielded would keep its own core busy until the holder ran again.
const YIELDS: u32 = 16;
/// The sleep between a waiter's looks after its spins and yields.
const NAP: std::time::Duration = std::time::Duration::from_micros(50);

/// How a waiter on a held cell passes the time after its `looks`-th look: spins, then yields,
/// then naps.
fn back_off(looks: u32) {
    if looks <= SPINS {
        std::hint::spin_loop();
    } else if looks <= SPINS + YIELDS {
        std::thread::yield_now();
    } else {
        std::thread::sleep(NAP);
    }
}

impl WindowCell {
    /// An empty cell, ranked `rank` in the order cells are locked in ([`lock_order`]): the
    /// breadth of the limit's scope (its `ScopeKind`'s place, narrowest first).
    ///
    /// [`lock_order`]: WindowCell::lock_order
    pub(crate) const fn new(rank: u8) -> WindowCell {
        WindowCell {
            held: AtomicBool::new(false),
            rank,
            bucket: AtomicU64::new(0),
            cur: AtomicU64::new(0),
            prev: AtomicU64::new(0),
            expires: AtomicU64::new(0),
        }
    }

    /// The cell's scope rank, the first part of its [`lock_order`](Self::lock_order).
    #[inline]
    pub(crate) fn rank(&self) -> u8 {
        self.rank
    }

    /// The cell's place in the one order every decision locks its cells in: narrow scopes
    /// first, the gateway's last, then by address. Any fixed order keeps two decisions from
    /// waiting on each other; this one takes the cells many requests share (an org's, the
    /// gateway's) last, so that they are held the shortest (docs/design.md §2).
    #[inline]
    pub(crate) fn lock_order(&self) -> (u8, usize) {
        (self.rank, std::ptr::from_ref(self).addr())
    }

    /// Locks the cell.
    #[inline]
    pub(crate) fn lock(&self) -> CellGuard<'_> {
        if self
            .held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.wait_and_lock(back_off);
        }
        CellGuard(self)
    }

    /// [`lock`](Self::lock) for a cell another thread holds: looks until it is free, calling
    /// `pause` with the number of looks so far after each look that finds it held.
    #[cold]
    fn wait_and_lock(&self, mut pause: impl FnMut(u32)) {
        let mut looks = 0;
        loop {
            // Waits by reading, which leaves the holder its cache line; only a free cell is
            // tried again.
            while self.held.load(Ordering::Relaxed) {
                looks += 1;
                pause(looks);
            }
            if self
                .held
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    /// Locks the cell if no one holds it.
    pub(crate) fn try_lock(&self) -> Option<CellGuard<'_>> {
        self.held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            // Built only on success: a guard built eagerly and dropped with the `None` would
            // unlock the holder's cell.
            .then(|| CellGuard(self))
    }
}

/// A locked [`WindowCell`]: its state is read and written through the guard, and the cell is
/// unlocked when the guard drops (a panic unwinding through a decision unlocks it too; each
/// write is whole before anything that can panic, so the state stays sound).
pub(crate) struct CellGuard<'a>(&'a WindowCell);

impl CellGuard<'_> {
    /// The cell's state.
    #[inline]
    pub(crate) fn state(&self) -> CellState {
        let c = self.0;
        CellState {
            window: WindowState {
                bucket: c.bucket.load(Ordering::Relaxed),
                cur: c.cur.load(Ordering::Relaxed),
                prev: c.prev.load(Ordering::Relaxed),
            },
            expires: Timestamp::from_micros(c.expires.load(Ordering::Relaxed)),
        }
    }

    /// The window, if it still matters at `now`.
    #[inline]
    pub(crate) fn live(&self, now: Timestamp) -> Option<WindowState> {
        self.state().live(now)
    }

    /// Writes the cell's state.
    #[inline]
    pub(crate) fn set(&mut self, state: CellState) {
        let c = self.0;
        c.bucket.store(state.window.bucket, Ordering::Relaxed);
        c.cur.store(state.window.cur, Ordering::Relaxed);
        c.prev.store(state.window.prev, Ordering::Relaxed);
        c.expires
            .store(state.expires.as_micros(), Ordering::Relaxed);
    }
}

impl Drop for CellGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.held.store(false, Ordering::Release);
    }
}

/// Where a limit remembers its cell: set once, by the first memory store that resolves the
/// limit (a clone made after keeps it too). Another store resolves the limit through its tables
/// every time. Kept in the limit itself, not behind a pointer: one cache line less to a limit.
#[derive(Clone, Debug, Default)]
pub(crate) struct CellCache(OnceLock<(StoreId, Arc<WindowCell>)>);

impl CellCache {
    /// The cell remembered for `store`, if any.
    #[inline]
    pub(crate) fn get(&self, store: StoreId) -> Option<&WindowCell> {
        match self.0.get() {
            Some((id, cell)) if *id == store => Some(cell),
            _ => None,
        }
    }

    /// Remembers `cell` for `store`, unless a cell is remembered already; returns the cell
    /// remembered for `store`, if it is now.
    pub(crate) fn remember(&self, store: StoreId, cell: &Arc<WindowCell>) -> Option<&WindowCell> {
        let (id, kept) = self.0.get_or_init(|| (store, Arc::clone(cell)));
        (*id == store).then_some(&**kept)
    }
}

/// A memory store's identity, unique in the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StoreId(u64);

impl StoreId {
    /// A new identity, never handed out before in this process.
    pub(crate) fn next() -> StoreId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        StoreId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::sync::atomic::AtomicU32;
    use std::thread;

    use super::*;

    /// Adds one to the cell's count under its lock, `times` times.
    fn count(cell: &WindowCell, times: u64) {
        for _ in 0..times {
            let mut guard = cell.lock();
            let mut state = guard.state();
            state.window.cur += 1;
            guard.set(state);
        }
    }

    #[test]
    fn no_increment_is_lost_between_threads() {
        let cell = WindowCell::new(0);
        let start = Barrier::new(4);
        thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    start.wait();
                    count(&cell, 20_000);
                });
            }
        });
        assert_eq!(cell.lock().state().window.cur, 80_000);
    }

    #[test]
    fn a_waiter_gets_the_cell_once_a_slow_holder_lets_go() {
        let cell = WindowCell::new(0);
        let held = cell.lock();
        assert!(cell.try_lock().is_none(), "held");
        assert!(cell.try_lock().is_none(), "a failed try leaves it held");
        // The waiter's looks, published as it makes them.
        let looks = AtomicU32::new(0);
        thread::scope(|s| {
            let waiter = s.spawn(|| {
                cell.wait_and_lock(|n| {
                    looks.store(n, Ordering::Relaxed);
                    back_off(n);
                });
                let mut guard = CellGuard(&cell);
                let mut state = guard.state();
                state.window.cur += 1;
                guard.set(state);
            });
            // Held until the waiter has spun, yielded and gone to sleep between looks.
            while looks.load(Ordering::Relaxed) <= SPINS + YIELDS {
                thread::yield_now();
            }
            drop(held);
            waiter.join().expect("waiter");
        });
        assert!(looks.load(Ordering::Relaxed) > SPINS + YIELDS);
        assert_eq!(cell.lock().state().window.cur, 1);
        assert!(cell.try_lock().is_some(), "let go");
    }
}
