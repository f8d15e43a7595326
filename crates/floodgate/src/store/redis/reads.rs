//! Budget-read batching: period counters read before admissions (a budget check) go out in
//! batches (group commit, `group.rs`): one `periods_read.lua` call reads the distinct counters of
//! every queued read, and each read gets its own totals from it. A read changes nothing, so a
//! batch whose connection dropped is replayed once, as a read alone would be.

use std::collections::HashMap;

use ::redis::cluster_routing::Slot;

use super::conn::Failure;
use super::group::{self, Answer, Bounds, Queue, Queued, intern};
use super::scripts::PERIODS_READ;
use super::stats::bump;
use super::{RedisStore, periods_reply};
use crate::clock::Timestamp;
use crate::period::PeriodCounter;
use crate::store::PeriodObservation;

/// Reads queued for the next batch.
pub(super) type ReadQueue = Queue<PendingRead>;

/// One queued read: its counters, its time argument and where its answer goes.
pub(super) struct PendingRead {
    counters: Vec<PeriodCounter>,
    /// A pinned time (µs); `None`: the store's clock, read when the batch goes out.
    time: Option<u64>,
    reply: tokio::sync::oneshot::Sender<Result<PeriodObservation, Failure>>,
}

impl Queued for PendingRead {
    fn time(&self) -> Option<u64> {
        self.time
    }
    fn keys(&self) -> usize {
        self.counters.len()
    }
    fn fail(self, failure: &Failure) {
        let _ = self.reply.send(Err(failure.again()));
    }
}

/// The answer of a queued read.
async fn read(answer: Answer<PeriodObservation>) -> Result<PeriodObservation, Failure> {
    group::answer(answer, "budget read").await
}

/// The most one batch carries: reads, and counters over all of them past its first.
const BOUNDS: Bounds = Bounds {
    calls: 256,
    keys: 4096,
};

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

    /// Queues a read of `counters` (all in `slot`) for its slot's batch.
    fn queue_read(
        &self,
        slot: Option<Slot>,
        counters: Vec<PeriodCounter>,
        now: Option<Timestamp>,
    ) -> Result<Answer<PeriodObservation>, Failure> {
        if self.inner.open.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Failure::Unavailable("circuit breaker open".into()));
        }
        let time = now.map(Timestamp::as_micros);
        Ok(group::submit(
            self,
            self.inner.reads.lane(slot),
            BOUNDS,
            |reply| PendingRead {
                counters,
                time,
                reply,
            },
            |store: RedisStore, batch| async move { store.send_read_batch(batch).await },
        ))
    }

    async fn send_read_batch(&self, batch: Vec<PendingRead>) {
        // A read whose caller gave up is left out: nobody reads its answer.
        let batch: Vec<PendingRead> = batch.into_iter().filter(|r| !r.reply.is_closed()).collect();
        if batch.is_empty() {
            return;
        }
        let mut index: HashMap<&str, usize, foldhash::fast::RandomState> = HashMap::default();
        let mut distinct: Vec<&PeriodCounter> = Vec::new();
        let positions: Vec<Vec<usize>> = batch
            .iter()
            .map(|r| {
                r.counters
                    .iter()
                    .map(|c| intern(&mut index, &mut distinct, c.key(), c))
                    .collect()
            })
            .collect();
        let n = distinct.len();
        let distinct: Vec<PeriodCounter> = distinct.into_iter().cloned().collect();
        let time = batch[0].time.map(Timestamp::from_micros);
        let cmd = self.periods_cmd(&PERIODS_READ, &distinct, None, time);
        bump(&self.inner.counters.read_batches);
        let answer = self
            .inner
            .run::<Vec<::redis::Value>>(&PERIODS_READ, &cmd)
            .await
            .and_then(|reply| periods_reply(&reply, n));
        let PeriodObservation { now, totals, .. } = match answer {
            Ok(answer) => answer,
            Err(failure) => {
                for r in batch {
                    r.fail(&failure);
                }
                return;
            }
        };
        for (r, positions) in batch.into_iter().zip(positions) {
            let _ = r.reply.send(Ok(PeriodObservation {
                now,
                enforced: true,
                totals: positions.iter().map(|&i| totals[i]).collect(),
            }));
        }
    }
}
