//! Decisions on a Redis Cluster whose keys lie in several slots (docs/redis.md, "Redis
//! Cluster").
//!
//! A script's keys must lie in one slot. A chain's limits within one tenant (key, project, team,
//! business unit, org) share the tenant's hash tag, so they lie in one slot and are decided in
//! one script, as on one server. A customer's limits and the gateway's lie in slots of their
//! own. Such a chain is decided slot by slot, in chain order (the key's tenant first), each step
//! one atomic admission in its slot:
//!
//! - a step that refuses ends the decision: the steps before it, admitted and charged, are
//!   refunded (their at-admission charges taken back from the very buckets they went to, their
//!   concurrency slots given back), and the steps after it are only read, so that a refusal is
//!   charged to none and still reports every limit;
//! - every step admitting admits the request, charged once in every slot.
//!
//! How this errs, and by how much: between a step's charge and its refund, another request in
//! that slot sees the charge. It can be refused where an atomic decision would have admitted it,
//! never admitted where one would have refused it: towards stricter, by at most the cost of the
//! requests in flight that a later slot refuses. A refund whose bucket has rolled out of the
//! window is dropped, as a reservation's is; it then no longer counts either.

use ::redis::cluster_routing::Slot;

use super::conn::Failure;
use super::scripts::STATE_READ;
use super::stats::bump;
use super::{RedisStore, ttl_millis};
use crate::chain::{ChainLimit, Costs};
use crate::clock::Timestamp;
use crate::in_flight::{InFlightLimit, Lease};
use crate::store::Observation;
use crate::window::Snapshot;

/// The limits and concurrency slots of one slot, by their positions in the chain.
struct Step {
    slot: Option<Slot>,
    limits: Vec<usize>,
    slots: Vec<usize>,
}

/// One step's part of the chain.
struct Part {
    limits: Vec<ChainLimit>,
    costs: Vec<u64>,
    slots: Vec<InFlightLimit>,
}

impl Step {
    fn part(&self, limits: &[ChainLimit], slots: &[InFlightLimit], costs: Costs<'_>) -> Part {
        Part {
            limits: self.limits.iter().map(|&i| limits[i].clone()).collect(),
            costs: self.limits.iter().map(|&i| costs.of(i)).collect(),
            slots: self.slots.iter().map(|&i| slots[i].clone()).collect(),
        }
    }
}

/// A cross-slot admission's slots, given back if its future is dropped between its steps.
///
/// A step that holds slots adds its lease to the store's renewed leases as its script answers;
/// only the admission's own end (an undo, or the caller's release of an admitted lease) takes it
/// out. Dropped before that end, this stops renewing the lease and releases the chain's slot
/// sets under it (a set the lease never entered is unchanged) in a task. The steps' rate-limit
/// charges stay: they expire with their windows, an error towards stricter.
struct Unwind {
    store: RedisStore,
    lease: Option<Lease>,
    slots: Vec<InFlightLimit>,
}

impl Unwind {
    fn new(store: &RedisStore, lease: Option<Lease>, slots: &[InFlightLimit]) -> Unwind {
        let holds = lease.is_some() && !slots.is_empty();
        Unwind {
            store: store.clone(),
            lease: lease.filter(|_| holds),
            slots: if holds { slots.to_vec() } else { Vec::new() },
        }
    }

    /// The admission answered: nothing to give back here.
    fn disarm(&mut self) {
        self.lease = None;
    }
}

impl Drop for Unwind {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        self.store.forget_lease(lease);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, slots) = (self.store.clone(), std::mem::take(&mut self.slots));
        runtime.spawn(async move {
            let member = store.member(lease);
            if let Err(Failure::Unavailable(why) | Failure::Backend(why)) =
                store.release_batched(&slots, member).await
            {
                bump(&store.inner.counters.errors);
                tracing::warn!(
                    error = why,
                    "floodgate: a dropped admission's slots were not released"
                );
            }
        });
    }
}

impl RedisStore {
    /// The chain's limits and concurrency slots grouped by slot, in chain order: the step of the
    /// first limit (the key's tenant) first.
    fn steps(&self, limits: &[ChainLimit], slots: &[InFlightLimit]) -> Vec<Step> {
        let mut steps: Vec<Step> = Vec::new();
        let mut step_of = |slot: Option<Slot>| match steps.iter().position(|s| s.slot == slot) {
            Some(i) => i,
            None => {
                steps.push(Step {
                    slot,
                    limits: Vec::new(),
                    slots: Vec::new(),
                });
                steps.len() - 1
            }
        };
        let mut placed_limits = Vec::with_capacity(limits.len());
        for l in limits {
            placed_limits.push(step_of(self.slot(l.key())));
        }
        let mut placed_slots = Vec::with_capacity(slots.len());
        for s in slots {
            placed_slots.push(step_of(self.slot(s.key())));
        }
        for (i, k) in placed_limits.into_iter().enumerate() {
            steps[k].limits.push(i);
        }
        for (i, k) in placed_slots.into_iter().enumerate() {
            steps[k].slots.push(i);
        }
        steps
    }

    /// An admission on a cluster (holding slots under `lease` if given): one step, as on one
    /// server, when the chain lies in one slot; else slot by slot, as the module says.
    pub(super) async fn admit_across(
        &self,
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        costs: Costs<'_>,
        lease: Option<Lease>,
        now: Option<Timestamp>,
    ) -> Result<Observation, Failure> {
        let steps = self.steps(limits, slots);
        if steps.len() <= 1 {
            return match lease {
                Some(lease) => {
                    self.admit_holding_inner(limits, slots, costs, lease, now)
                        .await
                }
                None => self.admit_inner(limits, costs, now).await,
            };
        }
        // Armed until the admission answers: dropped between its steps (its caller gone), it
        // gives back the slots the steps before took, which would otherwise be renewed for
        // the process's life.
        let mut unwind = Unwind::new(self, lease, slots);
        let mut snapshots: Vec<Option<Snapshot>> = vec![None; limits.len()];
        let mut running = vec![0; slots.len()];
        let mut first: Option<Timestamp> = None;
        // The steps admitted so far, each with its instant (the buckets it charged).
        let mut admitted: Vec<(&Step, Timestamp)> = Vec::new();
        for (k, step) in steps.iter().enumerate() {
            let part = step.part(limits, slots, costs);
            let cost = Costs::PerLimit(&part.costs);
            let decided = match lease {
                Some(lease) if !part.slots.is_empty() => {
                    self.admit_holding_inner(&part.limits, &part.slots, cost, lease, now)
                        .await
                }
                _ => self.admit_inner(&part.limits, cost, now).await,
            };
            let seen = match decided {
                Ok(seen) => seen,
                Err(failure) => {
                    self.undo(&admitted, limits, slots, costs, lease, now).await;
                    unwind.disarm();
                    return Err(failure);
                }
            };
            let at = *first.get_or_insert(seen.now);
            for (&i, snapshot) in step.limits.iter().zip(&seen.snapshots) {
                snapshots[i] = Some(*snapshot);
            }
            for (&i, n) in step.slots.iter().zip(&seen.running) {
                running[i] = *n;
            }
            if !seen.admitted {
                self.undo(&admitted, limits, slots, costs, lease, now).await;
                unwind.disarm();
                for later in &steps[k + 1..] {
                    self.read_step(later, limits, slots, (&mut snapshots, &mut running), now)
                        .await;
                }
                return Ok(Observation {
                    now: at,
                    admitted: false,
                    enforced: true,
                    snapshots: filled(snapshots, limits, at),
                    running,
                    at: Vec::new(),
                });
            }
            admitted.push((step, seen.now));
        }
        // Admitted: the slots are the caller's to release under its lease.
        unwind.disarm();
        let at = first.unwrap_or_else(Timestamp::now);
        // Each limit was charged at its own step's instant, on its node's clock: a later step
        // may have decided in a later bucket (a boundary between the steps, or a node's clock
        // ahead), and its reservation is reconciled into that bucket, not the first step's.
        let mut charged_at = vec![at; limits.len()];
        for (step, t) in &admitted {
            for &i in &step.limits {
                charged_at[i] = *t;
            }
        }
        if charged_at.iter().all(|&t| t == at) {
            // One instant for all (a pinned one): as a decision of one step says it.
            charged_at.clear();
        }
        Ok(Observation {
            now: at,
            admitted: true,
            enforced: true,
            snapshots: filled(snapshots, limits, at),
            running,
            at: charged_at,
        })
    }

    /// Refunds the steps `admitted` (a later one refused or failed): each at-admission limit's
    /// cost taken back from the bucket it was charged to, the lease's slots given back. Never
    /// replayed (a refund twice would take back what another request charged); one that fails
    /// leaves that step's charge standing, towards stricter, and is counted as an error.
    async fn undo(
        &self,
        admitted: &[(&Step, Timestamp)],
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        costs: Costs<'_>,
        lease: Option<Lease>,
        now: Option<Timestamp>,
    ) {
        // A refund lowers a count: this process's refusal caches on this data stop answering
        // from what they saw before it, before it goes out and again once it has landed, as for
        // a reconcile's refund (docs/design.md §11). (A refusal seen between the charge and its
        // refund, of another chain sharing a key, would otherwise stand until its retry time.)
        // An admission refused at its first step charged nothing and lowers nothing: it leaves
        // the caches be, its own refusal among them (the common flood, an over-limit key
        // refused by its own slot's step).
        let refunds = !admitted.is_empty();
        if refunds {
            self.inner.lowered.bump();
        }
        for (step, at) in admitted {
            // One call per distinct cost (the script takes one amount): one, for requests.
            let mut charged: Vec<(u64, Vec<&ChainLimit>)> = Vec::new();
            for &i in &step.limits {
                let (l, cost) = (&limits[i], costs.of(i));
                if !l.charge().at_admission() || cost == 0 {
                    continue;
                }
                match charged.iter_mut().find(|(c, _)| *c == cost) {
                    Some((_, ls)) => ls.push(l),
                    None => charged.push((cost, vec![l])),
                }
            }
            for (cost, ls) in charged {
                let delta = -i64::try_from(cost).unwrap_or(i64::MAX);
                if let Err(Failure::Unavailable(why) | Failure::Backend(why)) =
                    self.add_to_buckets(&ls, *at, delta, now).await
                {
                    bump(&self.inner.counters.errors);
                    tracing::warn!(error = why, "floodgate: a cross-slot refund failed");
                }
            }
            if let Some(lease) = lease
                && !step.slots.is_empty()
            {
                let sets: Vec<InFlightLimit> =
                    step.slots.iter().map(|&i| slots[i].clone()).collect();
                if let Err(Failure::Unavailable(why) | Failure::Backend(why)) =
                    self.release_batched(&sets, self.member(lease)).await
                {
                    bump(&self.inner.counters.errors);
                    tracing::warn!(error = why, "floodgate: a cross-slot slot release failed");
                }
            }
        }
        if refunds {
            self.inner.lowered.bump();
        }
        if let Some(lease) = lease {
            self.forget_lease(lease);
        }
    }

    /// Reads a step that was not run (an earlier one refused): its limits' counts and its slots'
    /// running requests, so that the refusal reports them as now. A read that fails leaves
    /// them empty.
    async fn read_step(
        &self,
        step: &Step,
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        (snapshots, running): (&mut [Option<Snapshot>], &mut [u64]),
        now: Option<Timestamp>,
    ) {
        let part = step.part(limits, slots, Costs::Each(0));
        if !part.limits.is_empty()
            && let Ok(seen) = self.state_call(&STATE_READ, &part.limits, &[], now).await
        {
            for (&i, snapshot) in step.limits.iter().zip(seen.snapshots) {
                snapshots[i] = Some(snapshot);
            }
        }
        if !part.slots.is_empty()
            && let Ok(counts) = self.read_running_inner(&part.slots, now).await
        {
            for (&i, n) in step.slots.iter().zip(counts) {
                running[i] = n;
            }
        }
    }

    /// Adds `delta` (signed) to each of `limits`' bucket of instant `at` (`reconcile.lua`): a
    /// reservation's difference, or a cross-slot refund. On a cluster, one call per slot: one
    /// that fails leaves its part undone and the others are still sent; the first failure is
    /// returned.
    pub(super) async fn add_to_buckets(
        &self,
        limits: &[&ChainLimit],
        at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> Result<(), Failure> {
        use super::scripts::RECONCILE;
        let mut failed = None;
        for (_, part) in self.by_slot(limits, |l| l.key()) {
            let n = part.len();
            let mut cmd = self.evalsha(&RECONCILE, n, 2 + 3 * n);
            for &i in &part {
                self.key_arg(&mut cmd, &[limits[i].key()]);
            }
            self.time_arg(&mut cmd, now);
            cmd.arg(delta);
            for &i in &part {
                let w = limits[i].limit().window_micros();
                cmd.arg(w).arg(at.as_micros() / w).arg(ttl_millis(w));
            }
            if let Err(f) = self.inner.run::<()>(&RECONCILE, &cmd).await {
                failed.get_or_insert(f);
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

/// Every limit's snapshot, one never read counted empty at `at`.
fn filled(snapshots: Vec<Option<Snapshot>>, limits: &[ChainLimit], at: Timestamp) -> Vec<Snapshot> {
    snapshots
        .into_iter()
        .zip(limits)
        .map(|(s, l)| s.unwrap_or_else(|| Snapshot::at(None, at, l.limit())))
        .collect()
}
