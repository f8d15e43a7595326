//! A spare list of snapshots per thread, so that a chain's admission on the memory store
//! allocates only the statuses its decision returns (docs/design.md §2).
//!
//! The memory store's short step fills its observation's snapshots into the list
//! [`take`] hands it; [`Chain`](crate::Chain) reads them into its decision and gives the list
//! back ([`give`]). Two allocations a decision were a tenth of its time; one is left. The lists
//! this module makes have room for the short step's longest chain, so chains of any length on a
//! thread share one; a longer list given back (the general step's) is dropped rather than kept,
//! and one given back on another thread (a task moved between the two) only changes which
//! thread keeps it.

use std::cell::Cell;

use crate::window::Snapshot;

/// The room of a list this module makes, and the most a list kept may have: the short step's
/// most limits.
const KEPT: usize = 8;

thread_local! {
    static SPARE: Cell<Vec<Snapshot>> = const { Cell::new(Vec::new()) };
}

/// An empty list with room for `n` snapshots: this thread's spare, or a new one with room for
/// [`KEPT`] (so that chains of other lengths on the thread share it).
#[inline]
pub(crate) fn take(n: usize) -> Vec<Snapshot> {
    // A thread whose locals are gone (a decision from another local's destructor) makes one.
    let mut list = SPARE.try_with(Cell::take).unwrap_or_default();
    list.clear();
    if list.capacity() < n {
        list = Vec::with_capacity(n.max(KEPT));
    }
    list
}

/// Gives `list` back, to be this thread's spare if it is short enough to keep (dropped
/// otherwise, and when the thread's locals are gone).
#[inline]
pub(crate) fn give(list: Vec<Snapshot>) {
    if list.capacity() != 0 && list.capacity() <= KEPT {
        let _ = SPARE.try_with(|spare| spare.set(list));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_given_back_is_the_next_one_taken_emptied() {
        let mut list = take(3);
        list.push(Snapshot::default());
        let kept = list.as_ptr();
        give(list);
        // Held while the spare is taken: a list made anew could not be given its place.
        let held = list_of(KEPT);
        let again = take(KEPT);
        assert_eq!(again.as_ptr(), kept);
        assert!(again.is_empty());
        drop(held);
    }

    #[test]
    fn a_list_too_long_to_keep_is_dropped() {
        give(list_of(KEPT + 1));
        let next = take(1);
        assert_eq!(next.capacity(), KEPT);
    }

    #[test]
    fn a_short_list_given_back_grows_to_the_room_every_chain_fits() {
        give(list_of(2));
        assert_eq!(take(5).capacity(), KEPT);
    }

    fn list_of(room: usize) -> Vec<Snapshot> {
        Vec::with_capacity(room)
    }
}
