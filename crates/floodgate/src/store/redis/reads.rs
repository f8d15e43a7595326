//! Budget reads in a batch (group commit, `step.rs`): period counters read before admissions (a
//! budget check) ride the next step's call, which reads the distinct counters of every read
//! before anything in it adds to them, and each read gets its own totals from it. A read changes
//! nothing, so it goes again once after a dropped connection, as a read alone would.

use super::conn::Failure;
use super::group::Counters;
use crate::clock::Timestamp;
use crate::period::PeriodCounter;
use crate::store::PeriodObservation;

/// One queued read: its counters, its time argument and where its answer goes.
pub(super) struct PendingRead {
    pub(super) counters: Vec<PeriodCounter>,
    /// A pinned time (µs); `None`: the store's clock, read when the batch goes out.
    pub(super) time: Option<u64>,
    /// Whether it already went out in a call whose connection dropped under it.
    pub(super) replayed: bool,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<PeriodObservation, Failure>>,
}

/// Interns the counters of `batch`'s reads into the call's `counters`; returns each read's
/// positions among them.
pub(super) fn intern<'a>(counters: &mut Counters<'a>, batch: &'a [PendingRead]) -> Vec<Vec<usize>> {
    batch
        .iter()
        .map(|r| r.counters.iter().map(|c| counters.intern(c)).collect())
        .collect()
}

/// Answers each read of `batch` with its counters' totals among `totals` (at `positions`, as
/// [`intern`] gave them), before the call added anything.
pub(super) fn answer(batch: Vec<PendingRead>, positions: &[Vec<usize>], totals: &[u64], now: u64) {
    for (r, positions) in batch.into_iter().zip(positions) {
        let _ = r.reply.send(Ok(PeriodObservation {
            now: Timestamp::from_micros(now),
            enforced: true,
            totals: positions.iter().map(|&i| totals[i]).collect(),
        }));
    }
}
