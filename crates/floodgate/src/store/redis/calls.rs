//! The store's batched operations: admissions (gated by a budget check or not), budget reads
//! and charges, each queued for its slot's next step (`step.rs`), which sends them in one call
//! and answers each; on a cluster, a read or a charge over several slots is one part per slot.
//! The parts of a call are packed and answered by `batch.rs` (admissions), `reads.rs` and
//! `charges.rs`.

use ::redis::cluster_routing::Slot;

use super::RedisStore;
use super::batch::PendingAdmit;
use super::charges::{Charged, PendingCharge, Reply, Work};
use super::conn::Failure;
use super::group::{self, Answer, Queued};
use super::reads::PendingRead;
use super::step::Pending;
use crate::chain::{ChainLimit, Costs};
use crate::clock::Timestamp;
use crate::period::PeriodCounter;
use crate::store::{Observation, PeriodObservation, Spent};
use crate::window::{Charge, Snapshot};

impl RedisStore {
    /// Admits through a batch. While one batch is in flight, admissions queue; the next batch
    /// takes them all (group commit), so a busy store sends one script call, one MGET and one
    /// SET per distinct key for many requests, while an idle one sends each admission at once,
    /// alone. The sending runs in a task of its own, so a caller that gives up (a client that
    /// disconnects) never strands the others.
    pub(super) async fn admit_inner(
        &self,
        limits: &[ChainLimit],
        costs: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Result<Observation, Failure> {
        let (seen, _) = self.admit_gated(limits, costs, &[], &[], now).await?;
        Ok(seen)
    }

    /// Admits through a batch as [`admit_inner`](Self::admit_inner) does, only if every counter
    /// of `counters` is under its cap (`caps`) when the call is made: the counters are read in the
    /// same call (a budget check). Returns the admission's observation (not admitted if a
    /// counter was at its cap) and the counters' totals.
    pub(super) async fn admit_gated(
        &self,
        limits: &[ChainLimit],
        costs: Costs<'_>,
        counters: &[PeriodCounter],
        caps: &[u64],
        now: Option<Timestamp>,
    ) -> Result<(Observation, Vec<u64>), Failure> {
        let gate = counters.iter().cloned().zip(caps.iter().copied()).collect();
        // On a cluster, the chain's slot (all its keys lie in one: `RedisStore::admit_across`).
        let slot = limits.first().and_then(|l| self.slot(l.key()));
        // Only a pinned time is fixed now: the client's clock is read when the batch goes out,
        // so that unpinned admissions share a batch under either clock.
        let time = now.map(Timestamp::as_micros);
        let answer = self.step(slot, |reply| {
            Pending::Admit(PendingAdmit::new(limits, costs, gate, time, reply))
        })?;
        let (t, admitted, counts, totals) = group::answer(answer, "admission").await?;
        let snapshots = limits
            .iter()
            .zip(counts)
            .map(|(l, (cur, prev))| {
                let w = l.limit().window_micros();
                Snapshot {
                    bucket: t / w,
                    elapsed: t % w,
                    cur,
                    prev,
                }
            })
            .collect();
        // An admission its gate stopped was not decided by its limits: not counted as one.
        if !totals.iter().zip(caps).any(|(t, c)| t >= c) {
            self.count(admitted);
        }
        let seen = Observation {
            now: Timestamp::from_micros(t),
            admitted,
            enforced: true,
            snapshots,
            running: Vec::new(),
            at: Vec::new(),
        };
        Ok((seen, totals))
    }
}

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
            return landed(self.charge(slot, Work::record(reactive, units), now, false)?)
                .await
                .map(drop);
        }
        // Every part queued is awaited, whichever fails: the caller (a response's charge) is
        // told the charge is done only once no part of it is still on its way, so a process
        // that waits for its charges before it exits waits for all of them.
        let mut waits = Vec::new();
        let mut failed = None;
        for (slot, part) in self.by_slot(&reactive, |l| l.key()) {
            let part = part.iter().map(|&i| reactive[i].clone()).collect();
            match self.charge(slot, Work::record(part, units), now, false) {
                Ok(wait) => waits.push(wait),
                Err(f) => {
                    failed = Some(f);
                    break;
                }
            }
        }
        for wait in waits {
            if let Err(f) = landed(wait).await {
                failed.get_or_insert(f);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Adds `amount` to every counter of `counters` (not empty), through a charge batch (on a
    /// cluster, one per slot, the totals put back in order). With `whole` (a reservation, a
    /// decision), a cluster's add that fails in one slot is taken back from the slots whose
    /// adds landed, as one server's failed add adds nothing; without (a spend), each slot keeps
    /// what it took.
    pub(super) async fn add_periods_inner(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
        whole: bool,
    ) -> Result<PeriodObservation, Failure> {
        if !self.is_cluster() {
            let work = Work::periods(counters.to_vec(), amount);
            let (t, totals) = landed(self.charge(None, work, now, whole)?).await?;
            return Ok(PeriodObservation {
                now: Timestamp::from_micros(t),
                enforced: true,
                totals,
            });
        }
        let parts = self.by_slot(counters, |c| c.key());
        let mut waits = Vec::with_capacity(parts.len());
        let mut failed = None;
        for (slot, part) in &parts {
            let list = part.iter().map(|&i| counters[i].clone()).collect();
            match self.charge(*slot, Work::periods(list, amount), now, whole) {
                Ok(wait) => waits.push(wait),
                Err(f) => {
                    failed = Some(f);
                    break;
                }
            }
        }
        let mut at = None;
        let mut totals = vec![0; counters.len()];
        // Each part that landed, with its instant (the period it went into).
        let mut took = Vec::with_capacity(waits.len());
        for ((_, part), wait) in parts.iter().zip(waits) {
            match landed(wait).await {
                Ok((t, seen)) => {
                    at.get_or_insert(t);
                    for (&i, total) in part.iter().zip(seen) {
                        totals[i] = total;
                    }
                    took.push((part, t));
                }
                Err(f) => {
                    failed.get_or_insert(f);
                }
            }
        }
        if let Some(failure) = failed {
            if whole {
                let refund = -i64::try_from(amount).unwrap_or(i64::MAX);
                for (part, t) in took {
                    let list: Vec<PeriodCounter> =
                        part.iter().map(|&i| counters[i].clone()).collect();
                    let at = Timestamp::from_micros(t);
                    // A refund that fails is counted and leaves that part (towards stricter).
                    let _ =
                        crate::store::Store::reconcile_periods(self, &list, at, refund, now).await;
                }
            }
            return Err(failure);
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
        urgent: bool,
    ) -> Result<Answer<Charged>, Failure> {
        let time = now.map(Timestamp::as_micros);
        self.step(slot, |reply| {
            Pending::Charge(PendingCharge {
                work,
                time,
                reply: Reply::Waiting(reply),
                urgent,
            })
        })
    }
}

impl RedisStore {
    /// [`RedisStore::charge_then`], with `landed` given the store's failure.
    pub(super) fn charge_then_inner<F>(&self, spent: Spent<'_>, landed: F)
    where
        F: FnOnce(Result<(), Failure>) + Send + 'static,
    {
        let reactive = spent
            .limits
            .iter()
            .filter(|l| l.charge() == Charge::Reactive);
        let work = Work {
            record: spent
                .records()
                .then(|| (reactive.cloned().collect(), spent.units)),
            periods: spent
                .adds()
                .then(|| (spent.counters.to_vec(), spent.amount)),
        };
        // Answered exactly once, whatever happens to it: dropped unanswered (a task cancelled
        // at shutdown), it answers that the charge was abandoned.
        let reply = Reply::then(move |answer: Result<Charged, Failure>| {
            landed(answer.map(drop));
        });
        if work.record.is_none() && work.periods.is_none() {
            return reply.send(Ok((0, Vec::new())));
        }
        if self.is_cluster() {
            // The keys may lie in several slots: the record and the add, each by slot, in a
            // task that awaits them.
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                return reply.send(Err(Failure::Unavailable("no runtime to charge on".into())));
            };
            let store = self.clone();
            drop(runtime.spawn(async move {
                let mut done = Ok(());
                if let Some((limits, units)) = &work.record {
                    done = store.record_inner(limits, *units, None).await;
                }
                if let Some((counters, amount)) = &work.periods {
                    let added = store
                        .add_periods_inner(counters, *amount, None, false)
                        .await;
                    done = done.and(added.map(drop));
                }
                reply.send(done.map(|()| (0, Vec::new())));
            }));
            return;
        }
        let call = Pending::Charge(PendingCharge {
            work,
            time: None,
            reply,
            urgent: false,
        });
        if let Err(call) = self.queue_step(None, call) {
            call.fail(&Failure::Unavailable("circuit breaker open".into()));
        }
    }
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
