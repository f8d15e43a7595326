//! A window's state in the memory store, behind a lock of its own, and where a limit remembers
//! it (docs/design.md §2, "The memory store's step").
//!
//! The memory store keeps each window in a [`WindowCell`]; its tables map a storage key to the
//! cell. A [`ChainLimit`](crate::ChainLimit) remembers the cell of the first memory store that
//! looks it up ([`CellCache`]), so that its later decisions on that store go straight to the
//! cell: no hash probe, no key compared, no table lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use crate::clock::Timestamp;
use crate::window::WindowState;

/// One window of the memory store: its state under a lock of its own. Small (with its `Arc`'s
/// counts, 56 bytes): a decision touches a cell per limit, and a busy store's cells should stay
/// in the cores' caches. (The store's table keeps the key beside it.)
#[derive(Debug, Default)]
pub(crate) struct WindowCell {
    state: Mutex<CellState>,
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

impl WindowCell {
    /// Locks the cell. A panic cannot leave a state half-written (each write is one
    /// assignment), so a poisoned lock's state is still sound.
    pub(crate) fn lock(&self) -> MutexGuard<'_, CellState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Locks the cell if no one holds it.
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, CellState>> {
        match self.state.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
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
