//! Charge batching: tokens recorded to reactive limits and spend added to period counters go
//! out in batches (group commit, `group.rs`): while one charge call is in flight, charges
//! queue, and the next call carries them all, applied in the order they came (`charge.lua`). A
//! charge whose caller gave up still goes: the response it charges for was served.
//! Never replayed: a batch whose connection dropped fails whole, as each of its charges alone
//! would have.

use std::collections::HashMap;

use ::redis::Cmd;
use ::redis::cluster_routing::Slot;

use super::conn::Failure;
use super::group::{self, Answer, Bounds, Queue, Queued, intern};
use super::scripts::CHARGE;
use super::stats::bump;
use super::{RedisStore, periods_reply, ttl_millis};
use crate::chain::ChainLimit;
use crate::clock::Timestamp;
use crate::period::{MAX_TOTAL, Period, PeriodCounter};
use crate::store::PeriodObservation;
use crate::window::Charge;

/// Charges queued for the next batch.
pub(super) type ChargeQueue = Queue<PendingCharge>;

/// What one charge adds.
enum Work {
    /// `units` to each reactive limit.
    Record(Vec<ChainLimit>, u64),
    /// `amount` to each counter.
    Periods(Vec<PeriodCounter>, u64),
}

/// One queued charge: what it adds, its time argument and where its answer goes.
pub(super) struct PendingCharge {
    work: Work,
    /// A pinned time (µs); `None`: the store's clock, read when the batch goes out.
    time: Option<u64>,
    reply: tokio::sync::oneshot::Sender<Result<Charged, Failure>>,
}

/// One charge's answer: the batch's instant and, for counters, their totals after it.
type Charged = (u64, Vec<u64>);

/// The answer of a queued charge.
async fn landed(answer: Answer<Charged>) -> Result<Charged, Failure> {
    group::answer(answer, "charge").await
}

/// The most one batch carries: charges, and keys over all of them past its first (the script
/// unpacks its keys onto Lua's stack for MGET).
const BOUNDS: Bounds = Bounds {
    calls: 256,
    keys: 4096,
};

impl Queued for PendingCharge {
    fn time(&self) -> Option<u64> {
        self.time
    }
    fn keys(&self) -> usize {
        match &self.work {
            Work::Record(limits, _) => limits.len(),
            Work::Periods(counters, _) => counters.len(),
        }
    }
    fn fail(self, failure: &Failure) {
        let _ = self.reply.send(Err(failure.again()));
    }
}

impl RedisStore {
    /// Adds `units` to every reactive limit of `limits`, through a charge batch (on a cluster,
    /// one per slot the limits lie in, each a charge of its own: a charge is an add to each
    /// key, with nothing to decide across them).
    pub(super) async fn record_inner(
        &self,
        limits: &[ChainLimit],
        units: u64,
        now: Option<Timestamp>,
    ) -> Result<(), Failure> {
        let reactive: Vec<ChainLimit> = limits
            .iter()
            .filter(|l| l.charge() == Charge::Reactive)
            .cloned()
            .collect();
        if reactive.is_empty() {
            return Ok(());
        }
        if !self.is_cluster() {
            let slot = None;
            return landed(self.charge(slot, Work::Record(reactive, units), now)?)
                .await
                .map(drop);
        }
        let mut waits = Vec::new();
        for (slot, part) in self.by_slot(&reactive, |l| l.key()) {
            let part = part.iter().map(|&i| reactive[i].clone()).collect();
            waits.push(self.charge(slot, Work::Record(part, units), now)?);
        }
        for wait in waits {
            landed(wait).await?;
        }
        Ok(())
    }

    /// Adds `amount` to every counter of `counters` (not empty), through a charge batch (on a
    /// cluster, one per slot, the totals put back in order).
    pub(super) async fn add_periods_inner(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Failure> {
        if !self.is_cluster() {
            let work = Work::Periods(counters.to_vec(), amount);
            let (t, totals) = landed(self.charge(None, work, now)?).await?;
            return Ok(PeriodObservation {
                now: Timestamp::from_micros(t),
                enforced: true,
                totals,
            });
        }
        let parts = self.by_slot(counters, |c| c.key());
        let mut waits = Vec::with_capacity(parts.len());
        for (slot, part) in &parts {
            let list = part.iter().map(|&i| counters[i].clone()).collect();
            waits.push(self.charge(*slot, Work::Periods(list, amount), now)?);
        }
        let mut at = None;
        let mut totals = vec![0; counters.len()];
        for ((_, part), wait) in parts.iter().zip(waits) {
            let (t, seen) = landed(wait).await?;
            at.get_or_insert(t);
            for (&i, total) in part.iter().zip(seen) {
                totals[i] = total;
            }
        }
        Ok(PeriodObservation {
            now: Timestamp::from_micros(at.unwrap_or_default()),
            enforced: true,
            totals,
        })
    }

    /// Queues `work` (its keys all in `slot`) for its slot's batch.
    fn charge(
        &self,
        slot: Option<Slot>,
        work: Work,
        now: Option<Timestamp>,
    ) -> Result<Answer<Charged>, Failure> {
        if self.inner.open.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Failure::Unavailable("circuit breaker open".into()));
        }
        let time = now.map(Timestamp::as_micros);
        Ok(group::submit(
            self,
            self.inner.charges.lane(slot),
            BOUNDS,
            |reply| PendingCharge { work, time, reply },
            |store: RedisStore, batch| async move { store.send_charge_batch(batch).await },
        ))
    }

    async fn send_charge_batch(&self, batch: Vec<PendingCharge>) {
        let (cmd, distinct, order) = self.pack_charges(&batch);
        bump(&self.inner.counters.charge_batches);
        let answer = self
            .inner
            .run::<Vec<::redis::Value>>(&CHARGE, &cmd)
            .await
            .and_then(|reply| periods_reply(&reply, distinct));
        let PeriodObservation {
            now, mut totals, ..
        } = match answer {
            Ok(answer) => answer,
            Err(failure) => {
                for p in batch {
                    p.fail(&failure);
                }
                return;
            }
        };
        // Each charge's totals after it: the adds replayed in order, as the script applied them.
        let mut counters = order.into_iter();
        for p in batch {
            let seen = match &p.work {
                Work::Record(..) => Vec::new(),
                Work::Periods(list, amount) => {
                    let mut seen = Vec::with_capacity(list.len());
                    for k in counters.by_ref().take(list.len()) {
                        let total = &mut totals[k];
                        *total = total.saturating_add(*amount).min(MAX_TOTAL);
                        seen.push(*total);
                    }
                    seen
                }
            };
            let _ = p.reply.send(Ok((now.as_micros(), seen)));
        }
    }

    /// The charge script's call for `batch`: its distinct window keys, then its distinct
    /// counters, then each charge with its keys' indices. Returns the call, how many distinct
    /// counters it names, and, for the counters of every period charge in order, the index of
    /// each among them.
    fn pack_charges(&self, batch: &[PendingCharge]) -> (Cmd, usize, Vec<usize>) {
        type Index<'a> = HashMap<&'a str, usize, foldhash::fast::RandomState>;
        let mut windows: Vec<&ChainLimit> = Vec::new();
        let mut window_index: Index<'_> = HashMap::default();
        let mut counters: Vec<&PeriodCounter> = Vec::new();
        let mut counter_index: Index<'_> = HashMap::default();
        // Per charge, its keys: windows by their index, counters by theirs (offset below).
        let mut charges: Vec<(char, u64, Vec<usize>)> = Vec::with_capacity(batch.len());
        let mut order = Vec::new();
        for p in batch {
            match &p.work {
                Work::Record(limits, units) => {
                    let keys = limits
                        .iter()
                        .map(|l| intern(&mut window_index, &mut windows, l.key(), l))
                        .collect();
                    charges.push(('r', *units, keys));
                }
                Work::Periods(list, amount) => {
                    let keys: Vec<usize> = list
                        .iter()
                        .map(|c| intern(&mut counter_index, &mut counters, c.key(), c))
                        .collect();
                    order.extend(&keys);
                    charges.push(('p', *amount, keys));
                }
            }
        }
        let nw = windows.len();
        let argc = 2
            + 2 * nw
            + counters.len()
            + charges.iter().map(|(_, _, k)| 3 + k.len()).sum::<usize>();
        let mut cmd = self.evalsha(&CHARGE, nw + counters.len(), argc);
        for l in &windows {
            self.key_arg(&mut cmd, &[l.key()]);
        }
        for c in &counters {
            self.key_arg(&mut cmd, &[c.key()]);
        }
        match batch[0].time.or_else(|| self.time_of(None)) {
            Some(t) => cmd.arg(t),
            None => cmd.arg(""),
        };
        cmd.arg(nw);
        for l in &windows {
            let w = l.limit().window_micros();
            cmd.arg(w).arg(ttl_millis(w));
        }
        for c in &counters {
            cmd.arg(match c.period() {
                Period::Day => "day",
                Period::Month => "month",
            });
        }
        for (kind, units, keys) in &charges {
            cmd.arg(if *kind == 'r' { "r" } else { "p" })
                .arg(*units)
                .arg(keys.len());
            let offset = if *kind == 'r' { 1 } else { 1 + nw };
            for k in keys {
                cmd.arg(k + offset);
            }
        }
        (cmd, counters.len(), order)
    }
}
