//! A spare list of snapshots per thread, so that a chain's admission on the memory store
//! allocates only the statuses its decision returns (docs/design.md §2).
//!
//! The memory store's short step fills its observation's snapshots into the list
//! [`take`] hands it; [`Chain`](crate::Chain) reads them into its decision and gives the list
//! back ([`give`]). Two allocations a decision were a tenth of its time; one is left. A list
//! given back on another thread (a task moved between the two) only changes which thread keeps
//! it, and a list too long for the short step is dropped rather than kept.

use std::cell::Cell;

use crate::window::Snapshot;

/// The longest list kept: the short step's most limits.
const KEPT: usize = 8;

thread_local! {
    static SPARE: Cell<Vec<Snapshot>> = const { Cell::new(Vec::new()) };
}

/// An empty list with room for `n` snapshots: this thread's spare, or a new one.
#[inline]
pub(crate) fn take(n: usize) -> Vec<Snapshot> {
    let mut list = SPARE.with(Cell::take);
    list.clear();
    list.reserve(n);
    list
}

/// Gives `list` back, to be this thread's spare if it is short enough to keep.
#[inline]
pub(crate) fn give(list: Vec<Snapshot>) {
    if list.capacity() != 0 && list.capacity() <= KEPT {
        SPARE.with(|spare| spare.set(list));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_given_back_is_the_next_one_taken_emptied() {
        let mut list = take(KEPT);
        list.push(Snapshot::default());
        let kept = (list.as_ptr(), list.capacity());
        give(list);
        // A new list for one would have room for four (the least a `Vec` of them reserves).
        let again = take(1);
        assert_eq!((again.as_ptr(), again.capacity()), kept);
        assert!(again.is_empty());
    }

    #[test]
    fn a_list_too_long_to_keep_is_dropped() {
        give(Vec::with_capacity(KEPT + 1));
        let next = take(1);
        assert!(next.capacity() < KEPT + 1);
    }
}
