//! Budget reads in a batch (group commit, `step.rs`): period counters read before admissions (a
//! budget check) ride the next step's call, which reads the distinct counters of every read
//! before anything in it adds to them, and each read gets its own totals from it. A read changes
//! nothing, so it goes again once after a dropped connection, as a read alone would.

use ::redis::cluster_routing::Slot;

use super::RedisStore;
use super::conn::Failure;
use super::group::{self, Answer};
use super::step::{Counters, Pending};
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

/// The answer of a queued read.
async fn read(answer: Answer<PeriodObservation>) -> Result<PeriodObservation, Failure> {
    group::answer(answer, "budget read").await
}

impl RedisStore {
    /// Reads each counter of `counters` (not empty) in its period, through a read batch (on a
    /// cluster, one per slot, the totals put back in order; the first slot's instant is the
    /// answer's).
    pub(super) async fn read_periods_inner(
        &self,
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Failure> {
        if !self.is_cluster() {
            return read(self.queue_read(None, counters.to_vec(), now)?).await;
        }
        let parts = self.by_slot(counters, |c| c.key());
        let mut waits = Vec::with_capacity(parts.len());
        for (slot, part) in &parts {
            let list = part.iter().map(|&i| counters[i].clone()).collect();
            waits.push(self.queue_read(*slot, list, now)?);
        }
        let mut at = None;
        let mut totals = vec![0; counters.len()];
        for ((_, part), wait) in parts.iter().zip(waits) {
            let seen = read(wait).await?;
            at.get_or_insert(seen.now);
            for (&i, total) in part.iter().zip(seen.totals) {
                totals[i] = total;
            }
        }
        Ok(PeriodObservation {
            now: at.unwrap_or_else(Timestamp::now),
            enforced: true,
            totals,
        })
    }

    /// Queues a read of `counters` (all in `slot`) for its slot's next step.
    fn queue_read(
        &self,
        slot: Option<Slot>,
        counters: Vec<PeriodCounter>,
        now: Option<Timestamp>,
    ) -> Result<Answer<PeriodObservation>, Failure> {
        let time = now.map(Timestamp::as_micros);
        self.step(slot, |reply| {
            Pending::Read(PendingRead {
                counters,
                time,
                replayed: false,
                reply,
            })
        })
    }
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
