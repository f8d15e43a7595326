//! Charges in a batch (group commit, `step.rs`): tokens recorded to reactive limits and spend
//! added to period counters ride the next step's call, applied after its admissions in the
//! order they came. A charge whose caller gave up still goes: the response it charges for was
//! served. Never replayed: a call carrying charges whose connection dropped fails them, as each
//! of them alone would have.

use ::redis::Cmd;
use ::redis::cluster_routing::Slot;

use super::RedisStore;
use super::conn::Failure;
use super::group::{self, Answer};
use super::step::{Counters, Pending, Windows};
use crate::chain::ChainLimit;
use crate::clock::Timestamp;
use crate::period::{MAX_TOTAL, PeriodCounter};
use crate::store::PeriodObservation;
use crate::window::Charge;

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
    pub(super) time: Option<u64>,
    reply: tokio::sync::oneshot::Sender<Result<Charged, Failure>>,
}

impl PendingCharge {
    /// How many keys it names.
    pub(super) fn keys(&self) -> usize {
        match &self.work {
            Work::Record(limits, _) => limits.len(),
            Work::Periods(counters, _) => counters.len(),
        }
    }

    /// Answers it with `failure`.
    pub(super) fn fail(self, failure: &Failure) {
        let _ = self.reply.send(Err(failure.again()));
    }
}

/// One charge's answer: the batch's instant and, for counters, their totals after it.
type Charged = (u64, Vec<u64>);

/// The answer of a queued charge.
async fn landed(answer: Answer<Charged>) -> Result<Charged, Failure> {
    group::answer(answer, "charge").await
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

    /// Queues `work` (its keys all in `slot`) for its slot's next step.
    fn charge(
        &self,
        slot: Option<Slot>,
        work: Work,
        now: Option<Timestamp>,
    ) -> Result<Answer<Charged>, Failure> {
        let time = now.map(Timestamp::as_micros);
        self.step(slot, |reply| {
            Pending::Charge(PendingCharge { work, time, reply })
        })
    }
}

/// A call's charges, packed: each one's kind, units and key indices (windows 0-based among the
/// windows, counters 0-based among the counters), and, for the counters of every period charge
/// in order, the index of each among the counters.
pub(super) struct Packed {
    charges: Vec<(bool, u64, Vec<usize>)>,
    order: Vec<usize>,
}

/// Interns `batch`'s keys into the call's `windows` and `counters`.
pub(super) fn pack<'a>(
    windows: &mut Windows<'a>,
    counters: &mut Counters<'a>,
    batch: &'a [PendingCharge],
) -> Packed {
    let mut charges = Vec::with_capacity(batch.len());
    let mut order = Vec::new();
    for p in batch {
        match &p.work {
            Work::Record(limits, units) => {
                let keys = limits.iter().map(|l| windows.intern(l)).collect();
                charges.push((true, *units, keys));
            }
            Work::Periods(list, amount) => {
                let keys: Vec<usize> = list.iter().map(|c| counters.intern(c)).collect();
                order.extend(&keys);
                charges.push((false, *amount, keys));
            }
        }
    }
    Packed { charges, order }
}

impl Packed {
    /// How many arguments [`write`](Self::write) appends.
    pub(super) fn args(&self) -> usize {
        self.charges.iter().map(|(_, _, k)| 3 + k.len()).sum()
    }

    /// Appends the charges as admit.lua takes them: each one's kind, units, how many keys, and
    /// their 1-based indices into `KEYS` (the counters after the call's `nw` windows).
    pub(super) fn write(&self, cmd: &mut Cmd, nw: usize) {
        for (window, units, keys) in &self.charges {
            cmd.arg(if *window { "r" } else { "p" })
                .arg(*units)
                .arg(keys.len());
            let offset = if *window { 1 } else { 1 + nw };
            for k in keys {
                cmd.arg(k + offset);
            }
        }
    }
}

/// Answers each charge of `batch` (packed as `packed`): a period charge gets its counters'
/// totals after it, the adds replayed in order on `totals` (each counter's before the call), as
/// the script applied them.
pub(super) fn answer(batch: Vec<PendingCharge>, packed: &Packed, mut totals: Vec<u64>, now: u64) {
    let mut counters = packed.order.iter();
    for p in batch {
        let seen = match &p.work {
            Work::Record(..) => Vec::new(),
            Work::Periods(list, amount) => {
                let mut seen = Vec::with_capacity(list.len());
                for &k in counters.by_ref().take(list.len()) {
                    let total = &mut totals[k];
                    *total = total.saturating_add(*amount).min(MAX_TOTAL);
                    seen.push(*total);
                }
                seen
            }
        };
        let _ = p.reply.send(Ok((now, seen)));
    }
}
