//! The public limiters: a [`Chain`] of sliding windows and a [`TokenBucket`], each running
//! unchanged on any [`Store`].

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::Error;
use crate::bucket::{Admission, BucketLimit, Rate};
use crate::budget::{BudgetDecision, Budgets};
use crate::chain::{ChainDecision, ChainLimit, Costs};
use crate::clock::Timestamp;
use crate::in_flight::{InFlightLimit, InFlightStatus, Lease};
use crate::refusals::Refusals;
use crate::spare;
use crate::store::{BucketKey, NameRef, Observation, Store};
use crate::window::Charge;

/// A chain of sliding-window limits, narrowest scope first, admitted as one atomic step.
///
/// ```
/// use floodgate::{Chain, ChainLimit, Charge, ScopeKind, WindowLimit};
/// use floodgate::store::MemoryStore;
///
/// # async fn demo() -> Result<(), floodgate::Error> {
/// let chain = Chain::new(vec![
///     ChainLimit::new("org:acme", ScopeKind::Key, "alice", Charge::Admission, WindowLimit::per_minute(5)),
///     ChainLimit::new("org:acme", ScopeKind::Org, "acme", Charge::Admission, WindowLimit::per_minute(600)),
///     ChainLimit::new("org:acme", ScopeKind::Org, "acme", Charge::Reactive, WindowLimit::per_minute(100_000)),
/// ]);
/// let store = MemoryStore::new();
/// let decision = chain.admit(&store, 1).await?;
/// assert!(decision.admitted);
/// // After the response: charge its tokens to the chain's token limits.
/// chain.record(&store, 1234).await?;
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone, Debug, Default)]
pub struct Chain {
    limits: Vec<ChainLimit>,
    /// The largest cost every limit can pass, `None` if some limit passes none: what
    /// [`Costs::never_fits`] answers for one cost across the chain, worked out once.
    fits_up_to: Option<u64>,
    in_flight: Vec<InFlightLimit>,
    /// The refusal cache, when turned on ([`cache_refusals`](Self::cache_refusals)); clones
    /// share it, as they share the limits.
    refusals: Option<Arc<Refusals>>,
}

/// Two chains are equal when their limits are: a refusal cache holds what a store said, not
/// what the chain is.
impl PartialEq for Chain {
    fn eq(&self, other: &Chain) -> bool {
        self.limits == other.limits && self.in_flight == other.in_flight
    }
}

impl Eq for Chain {}

impl Chain {
    /// A chain of `limits`, narrowest first. Each limit must have its own storage key.
    pub fn new(limits: Vec<ChainLimit>) -> Self {
        debug_assert!(
            limits
                .iter()
                .enumerate()
                .all(|(i, l)| limits[..i].iter().all(|m| m.key() != l.key())),
            "a chain's limits must have distinct storage keys"
        );
        let fits_up_to = limits.iter().try_fold(u64::MAX, |up_to, l| {
            let max = l.limit().max();
            let bound = match l.charge() {
                _ if l.is_shadow() => u64::MAX,
                Charge::Admission => max,
                Charge::Reactive if max > 0 => u64::MAX,
                Charge::Reserved if max > 0 => max,
                Charge::Reactive | Charge::Reserved => return None,
            };
            Some(up_to.min(bound))
        });
        Chain {
            limits,
            fits_up_to,
            in_flight: Vec::new(),
            refusals: None,
        }
    }

    /// This chain with a refusal cache (docs/design.md §11): its last refusal is remembered in
    /// the process, and its next requests are refused from it, without asking the store, for as
    /// long as the counts that refusal saw, carried forward in time, still refuse them. Exact:
    /// counts only grow between resets, so what those counts refuse the store refuses too, with
    /// the same statuses when no other traffic came (on the store's clock, the instant is the
    /// refusal's plus the process's monotonic time since its answer, which errs stricter by at
    /// most the round trip). A flood from one over-limit caller then costs the store one call
    /// per retry time instead of one per request.
    ///
    /// What lowers a count (a refund, [`Store::clear_state`]) made through the store moves its
    /// count of lowerings ([`Store::lowered`]), and every cache on that store in the process,
    /// whichever chain's, stops answering from a refusal asked for before it. Counts lowered
    /// otherwise (another process, a store that keeps no count) call
    /// [`forget_refusals`](Self::forget_refusals), or the cache refuses until the remembered
    /// refusal's retry time, as if the lowering had not happened.
    ///
    /// ```
    /// use floodgate::{Chain, ChainLimit, Charge, ScopeKind, Timestamp, WindowLimit};
    /// use floodgate::store::MemoryStore;
    ///
    /// # async fn demo() -> Result<(), floodgate::Error> {
    /// let chain = Chain::new(vec![ChainLimit::new(
    ///     "org:acme", ScopeKind::Key, "alice", Charge::Admission, WindowLimit::per_minute(1),
    /// )])
    /// .cache_refusals();
    /// let store = MemoryStore::new();
    /// let t = Timestamp::from_secs(1_000);
    /// assert!(chain.admit_at(&store, 1, t).await?.admitted);
    /// let refused = chain.admit_at(&store, 1, t).await?;
    /// assert!(!refused.admitted);
    /// // The next refusal comes from the cache, and is the one the store would give.
    /// let cached = chain.cached_refusal(&store, 1, Some(t)).expect("remembered");
    /// assert_eq!(cached, refused);
    /// # Ok(()) }
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn cache_refusals(self) -> Self {
        Chain {
            refusals: Some(Arc::default()),
            ..self
        }
    }

    /// Drops the remembered refusal, if any: after a reset or a refund has lowered a count of
    /// the chain's limits (see [`cache_refusals`](Self::cache_refusals)).
    pub fn forget_refusals(&self) {
        if let Some(cache) = &self.refusals {
            cache.forget();
        }
    }

    /// The refusal the cache would answer for a request of `costs` (one cost, or one per limit)
    /// at `now` (`None`: the store's clock) on `store`, without asking it: `None` if the chain
    /// has no cache, nothing is remembered, `store` has lowered counts since (a refund or reset
    /// by any chain: [`Store::lowered`]), or the remembered counts would admit it (then the
    /// store decides).
    pub fn cached_refusal<'a, S: Store>(
        &self,
        store: &S,
        costs: impl Into<Costs<'a>>,
        now: Option<Timestamp>,
    ) -> Option<ChainDecision> {
        self.cached_refusal_at(store, costs.into(), now, store.lowered())
    }

    /// [`cached_refusal`](Self::cached_refusal) with the store's count of lowerings read.
    fn cached_refusal_at<S: Store>(
        &self,
        store: &S,
        costs: Costs<'_>,
        now: Option<Timestamp>,
        lowered: u128,
    ) -> Option<ChainDecision> {
        // An admission of cost 0 is a read of the state: the store answers it.
        if costs.is_zero() {
            return None;
        }
        // Unpinned, on the store's own clock where it is in this process (read only when a
        // refusal is remembered).
        let clock = || now.or_else(|| store.local_now());
        self.refusals
            .as_ref()?
            .answer(&self.limits, costs, clock, lowered)
    }

    /// This chain with concurrency limits, narrowest first, each with its own storage key: an
    /// admitted request holds a slot in each until [`release`](Self::release)d.
    ///
    /// ```
    /// use floodgate::{Chain, ChainLimit, Charge, InFlightLimit, ScopeKind, WindowLimit};
    /// use floodgate::store::MemoryStore;
    ///
    /// # async fn demo() -> Result<(), floodgate::Error> {
    /// let chain = Chain::new(vec![ChainLimit::new(
    ///     "org:acme", ScopeKind::Key, "alice", Charge::Admission, WindowLimit::per_minute(100),
    /// )])
    /// .with_in_flight(vec![InFlightLimit::new("org:acme", ScopeKind::Key, "alice", 1)]);
    /// let store = MemoryStore::new();
    /// let first = chain.admit(&store, 1).await?;
    /// assert!(first.admitted);
    /// assert!(!chain.admit(&store, 1).await?.admitted, "one at a time");
    /// chain.release(&store, first.lease).await?;
    /// assert!(chain.admit(&store, 1).await?.admitted);
    /// # Ok(()) }
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn with_in_flight(self, in_flight: Vec<InFlightLimit>) -> Self {
        debug_assert!(
            in_flight
                .iter()
                .enumerate()
                .all(|(i, l)| in_flight[..i].iter().all(|m| m.key() != l.key())),
            "a chain's concurrency limits must have distinct storage keys"
        );
        Chain { in_flight, ..self }
    }

    /// The limits, narrowest first.
    pub fn limits(&self) -> &[ChainLimit] {
        &self.limits
    }

    /// The concurrency limits, narrowest first.
    pub fn in_flight(&self) -> &[InFlightLimit] {
        &self.in_flight
    }

    /// Whether any limit counts tokens reactively ([`Charge::Reactive`]): what
    /// [`record`](Self::record) charges.
    pub fn has_reactive(&self) -> bool {
        self.limits.iter().any(|l| l.charge() == Charge::Reactive)
    }

    /// Whether any limit reserves tokens ([`Charge::Reserved`]): what
    /// [`reconcile`](Self::reconcile) adjusts.
    pub fn has_reserved(&self) -> bool {
        self.limits.iter().any(|l| l.charge() == Charge::Reserved)
    }

    /// This chain with its reserving token limits ([`Charge::Reserved`]) taken as reactive ones
    /// ([`Charge::Reactive`]), on the same state (a reserved and a reactive token limit of one
    /// scope share it), with the same concurrency limits, and a refusal cache of its own if this
    /// chain has one: for a request that has no estimate to reserve and is charged its tokens
    /// as they come. Admitted with a reservation of 0, a reserving limit would pass a window
    /// that is exactly full; a reactive one needs room left in it.
    ///
    /// ```
    /// use floodgate::{Chain, ChainLimit, Charge, ScopeKind, WindowLimit};
    /// use floodgate::store::MemoryStore;
    ///
    /// # async fn demo() -> Result<(), floodgate::Error> {
    /// let chain = Chain::new(vec![
    ///     ChainLimit::new("org:a", ScopeKind::Org, "a", Charge::Admission, WindowLimit::per_minute(100)),
    ///     ChainLimit::new("org:a", ScopeKind::Org, "a", Charge::Reserved, WindowLimit::per_minute(1000)),
    /// ]);
    /// let store = MemoryStore::new();
    /// let now = floodgate::Timestamp::from_secs(0);
    /// assert!(chain.admit_costs_at(&store, &[1, 1000], now).await?.admitted);
    /// // The token window is exactly full: nothing more to reserve passes, and nothing to
    /// // reserve passes there only as a reservation.
    /// assert!(chain.admit_costs_at(&store, &[1, 0], now).await?.admitted);
    /// assert!(!chain.reserving_as_reactive().admit_at(&store, 1, now).await?.admitted);
    /// # Ok(()) }
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
    /// ```
    pub fn reserving_as_reactive(&self) -> Chain {
        let limits = self
            .limits
            .iter()
            .map(|l| match l.charge() {
                Charge::Reserved => l.clone().with_charge(Charge::Reactive),
                Charge::Admission | Charge::Reactive => l.clone(),
            })
            .collect();
        Chain {
            refusals: self.refusals.as_ref().map(|_| Arc::default()),
            ..Chain::new(limits).with_in_flight(self.in_flight.clone())
        }
    }

    /// Admits a request of `cost` units on the store's clock. See [`admit_at`](Self::admit_at).
    pub fn admit<S: Store>(
        &self,
        store: &S,
        cost: u64,
    ) -> impl Future<Output = Result<ChainDecision, Error>> {
        self.admit_inner(store, Costs::Each(cost), None)
    }

    /// Admits a request costing each limit its own units, on the store's clock: `costs[i]` for
    /// limit `i`. See [`admit_costs_at`](Self::admit_costs_at).
    ///
    /// # Panics
    ///
    /// If `costs` does not have one cost per limit.
    pub fn admit_costs<S: Store>(
        &self,
        store: &S,
        costs: &[u64],
    ) -> impl Future<Output = Result<ChainDecision, Error>> {
        assert_eq!(costs.len(), self.limits.len(), "one cost per limit");
        self.admit_inner(store, Costs::PerLimit(costs), None)
    }

    /// Admits a request at `now` costing each limit its own units, `costs[i]` for limit `i`,
    /// in the one atomic step [`admit_at`](Self::admit_at) takes: a request that reserves tokens
    /// costs 1 on its request limits and its estimate on its [`Charge::Reserved`] limits, and
    /// passes only if all pass, charged nothing otherwise.
    ///
    /// ```
    /// use floodgate::{Chain, ChainLimit, Charge, ScopeKind, WindowLimit};
    /// use floodgate::store::MemoryStore;
    ///
    /// # async fn demo() -> Result<(), floodgate::Error> {
    /// let chain = Chain::new(vec![
    ///     ChainLimit::new("org:a", ScopeKind::Org, "a", Charge::Admission, WindowLimit::per_minute(100)),
    ///     ChainLimit::new("org:a", ScopeKind::Org, "a", Charge::Reserved, WindowLimit::per_minute(1000)),
    /// ]);
    /// let store = MemoryStore::new();
    /// let now = floodgate::Timestamp::from_secs(0);
    /// let first = chain.admit_costs_at(&store, &[1, 600], now).await?;
    /// assert!(first.admitted);
    /// assert!(!chain.admit_costs_at(&store, &[1, 600], now).await?.admitted, "1200 > 1000");
    /// // The first used 100 tokens: 500 go back into the bucket it reserved in.
    /// chain.reconcile_at(&store, first.now, 100 - 600, now).await?;
    /// assert!(chain.admit_costs_at(&store, &[1, 600], now).await?.admitted);
    /// # Ok(()) }
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
    /// ```
    ///
    /// # Panics
    ///
    /// If `costs` does not have one cost per limit.
    pub fn admit_costs_at<S: Store>(
        &self,
        store: &S,
        costs: &[u64],
        now: Timestamp,
    ) -> impl Future<Output = Result<ChainDecision, Error>> {
        assert_eq!(costs.len(), self.limits.len(), "one cost per limit");
        self.admit_inner(store, Costs::PerLimit(costs), Some(now))
    }

    /// Admits a request of `cost` units at `now`: all limits pass or nothing is charged; the
    /// decision names the first refusing limit, the chain's exact retry time, and every limit's
    /// remaining units and reset for response headers.
    ///
    /// A shadow limit ([`ChainLimit::shadow`]) is read and charged like the others but never
    /// refuses: a request only it would refuse is admitted, and the decision reports it
    /// ([`ChainDecision::shadow_over`]).
    ///
    /// With concurrency limits ([`with_in_flight`](Self::with_in_flight)), an admitted request
    /// also takes a slot in each, in the same step, and the decision carries the
    /// [`lease`](ChainDecision::lease) to [`release`](Self::release) when it is done; a request
    /// that finds an enforced concurrency limit full is refused
    /// ([`ChainDecision::refused_in_flight`]), with no retry time (none is known: a slot frees
    /// when a running request ends), and charged nothing. An admission of cost 0 (a read of
    /// the rate limits' state) takes no slot and reports none.
    ///
    /// A request that can never pass (`cost` above an enforced charged limit's max, or an
    /// enforced token limit of zero) is refused without a retry time and without touching the
    /// store; a chain without limits admits without touching it either.
    pub fn admit_at<S: Store>(
        &self,
        store: &S,
        cost: u64,
        now: Timestamp,
    ) -> impl Future<Output = Result<ChainDecision, Error>> {
        self.admit_inner(store, Costs::Each(cost), Some(now))
    }

    /// [`Costs::never_fits`] for this chain: for one cost across it, from the bound worked out
    /// when the chain was built, without walking its limits.
    #[inline]
    fn never_fits(&self, costs: Costs<'_>) -> Option<usize> {
        match (costs, self.fits_up_to) {
            (Costs::Each(cost), Some(up_to)) if cost <= up_to => None,
            _ => costs.never_fits(&self.limits),
        }
    }

    async fn admit_inner<S: Store>(
        &self,
        store: &S,
        cost: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Result<ChainDecision, Error> {
        if let Some(i) = self.never_fits(cost) {
            let now = now.unwrap_or_else(Timestamp::now);
            return Ok(ChainDecision::impossible(&self.limits, i, now));
        }
        // Read before the store is asked: a refund that lands after this moves it, so that a
        // refusal decided before the refund is not remembered past it (docs/design.md §11).
        // Only a chain with a cache needs it.
        let lowered = if self.refusals.is_some() {
            store.lowered()
        } else {
            0
        };
        if let Some(cached) = self.cached_refusal_at(store, cost, now, lowered) {
            return Ok(cached);
        }
        // An admission of cost 0 reads the rate limits and charges nothing: it takes no slot.
        if !self.in_flight.is_empty() && !cost.is_zero() {
            return self.admit_holding(store, cost, now, lowered).await;
        }
        if self.limits.is_empty() {
            // Nothing to decide (docs/design.md §2: a scope with no limit is skipped), so nothing
            // to ask the store: an unlimited caller neither waits for it nor fails with it.
            let now = now.unwrap_or_else(Timestamp::now);
            return Ok(ChainDecision::unlimited(now));
        }
        let seen = store.admit(&self.limits, cost, now).await?;
        Ok(self.decided(seen, cost, now.is_some(), lowered))
    }

    /// The decision the store's observation `seen` of an admission at `cost` (at a `pinned`
    /// instant, or on the store's clock) gives, told to the refusal cache.
    fn decided(
        &self,
        seen: Observation,
        cost: Costs<'_>,
        pinned: bool,
        lowered: u128,
    ) -> ChainDecision {
        if !seen.enforced {
            return ChainDecision::unenforced(seen.now);
        }
        let mut decision = ChainDecision::from_snapshots(
            &self.limits,
            &seen.snapshots,
            seen.now,
            cost,
            seen.admitted,
        );
        if seen.admitted {
            decision.charged_at = seen.at;
        }
        self.remember(&decision, &seen.snapshots, cost, pinned, lowered);
        // The memory store's next step fills the list again (`spare`).
        spare::give(seen.snapshots);
        decision
    }

    /// Checks `budgets` (reads their spend, charging nothing, as [`Budgets::check`]) and then,
    /// unless one of them is spent, admits a request of `cost` as [`admit`](Self::admit) does:
    /// the budget decision, and the chain's (`None`: a budget refused, nothing admitted or
    /// charged). The answer is the one the check and then the admission give; where the store
    /// can (Redis, one server), both go in one call, sparing the request a round trip
    /// ([`Store::admit_within`]). A budget is reactive (a response's spend is known only after
    /// it), so concurrent requests can still overrun one by what they spend in flight.
    pub fn admit_within<S: Store>(
        &self,
        store: &S,
        budgets: &Budgets,
        cost: u64,
    ) -> impl Future<Output = Result<(BudgetDecision, Option<ChainDecision>), Error>> {
        self.admit_within_inner(store, budgets, cost, None)
    }

    /// [`admit_within`](Self::admit_within) at `now`.
    pub fn admit_within_at<S: Store>(
        &self,
        store: &S,
        budgets: &Budgets,
        cost: u64,
        now: Timestamp,
    ) -> impl Future<Output = Result<(BudgetDecision, Option<ChainDecision>), Error>> {
        self.admit_within_inner(store, budgets, cost, Some(now))
    }

    async fn admit_within_inner<S: Store>(
        &self,
        store: &S,
        budgets: &Budgets,
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<(BudgetDecision, Option<ChainDecision>), Error> {
        let costs = Costs::Each(cost);
        let lowered = if self.refusals.is_some() {
            store.lowered()
        } else {
            0
        };
        // What the one call does not cover (no budget, a request that can never fit, a
        // remembered refusal, concurrency slots, no limits) goes as the check, then the chain.
        let one_call = !budgets.is_empty()
            && self.never_fits(costs).is_none()
            && self.in_flight.is_empty()
            && !self.limits.is_empty()
            && !costs.is_zero()
            && self.cached_refusal_at(store, costs, now, lowered).is_none();
        if !one_call {
            let checked = match now {
                Some(now) => budgets.check_at(store, now).await?,
                None => budgets.check(store).await?,
            };
            if !checked.allowed() {
                return Ok((checked, None));
            }
            let decision = self.admit_inner(store, costs, now).await?;
            return Ok((checked, Some(decision)));
        }
        let (read, seen) = store
            .admit_within(budgets.counters(), budgets.caps(), &self.limits, costs, now)
            .await?;
        let checked = budgets.decision_of(read);
        Ok((
            checked,
            seen.map(|seen| self.decided(seen, costs, now.is_some(), lowered)),
        ))
    }

    /// Tells the refusal cache, if any, what the store decided.
    fn remember(
        &self,
        decision: &ChainDecision,
        snapshots: &[crate::window::Snapshot],
        costs: Costs<'_>,
        pinned: bool,
        lowered: u128,
    ) {
        if let Some(cache) = &self.refusals
            && !costs.is_zero()
        {
            cache.remember(decision, snapshots, pinned, lowered);
        }
    }

    async fn admit_holding<S: Store>(
        &self,
        store: &S,
        cost: Costs<'_>,
        now: Option<Timestamp>,
        lowered: u128,
    ) -> Result<ChainDecision, Error> {
        let lease = store.lease();
        let seen = store
            .admit_holding(&self.limits, &self.in_flight, cost, lease, now)
            .await?;
        if !seen.enforced {
            // Nothing was checked, so nothing is held.
            return Ok(ChainDecision::unenforced(seen.now));
        }
        let mut decision = ChainDecision::from_snapshots(
            &self.limits,
            &seen.snapshots,
            seen.now,
            cost,
            seen.admitted,
        );
        decision.in_flight = self
            .in_flight
            .iter()
            .zip(&seen.running)
            .map(|(l, &running)| InFlightStatus::of(l, running, seen.admitted))
            .collect();
        decision.lease = seen.admitted.then_some(lease);
        if seen.admitted {
            decision.charged_at = seen.at;
        }
        self.remember(&decision, &seen.snapshots, cost, now.is_some(), lowered);
        Ok(decision)
    }

    /// Gives back the slots `lease` holds in the chain's concurrency limits (the
    /// [`lease`](ChainDecision::lease) of its admission; `None`, or a chain without concurrency
    /// limits, does nothing). Call it once the request is done: its answer sent, its stream
    /// ended or cut, its caller gone.
    pub async fn release<S: Store>(&self, store: &S, lease: Option<Lease>) -> Result<(), Error> {
        match lease {
            Some(lease) if !self.in_flight.is_empty() => {
                store.release(&self.in_flight, lease, None).await
            }
            _ => Ok(()),
        }
    }

    /// Adds `units` (tokens of a finished response) to every reactive limit of the chain.
    pub fn record<S: Store>(
        &self,
        store: &S,
        units: u64,
    ) -> impl Future<Output = Result<(), Error>> {
        self.record_inner(store, units, None)
    }

    /// Adds `units` to every reactive limit of the chain at `now`.
    pub fn record_at<S: Store>(
        &self,
        store: &S,
        units: u64,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), Error>> {
        self.record_inner(store, units, Some(now))
    }

    async fn record_inner<S: Store>(
        &self,
        store: &S,
        units: u64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        if units == 0 || !self.has_reactive() {
            return Ok(());
        }
        store.record(&self.limits, units, now).await
    }

    /// Reconciles the reservation of a request admitted at `reserved_at` (its decision's
    /// [`now`](ChainDecision::now)) on the store's clock: `delta`, its actual usage minus what
    /// it reserved, goes into every [`Charge::Reserved`] limit's bucket that the reservation was
    /// charged to, once. See [`reconcile_at`](Self::reconcile_at).
    pub fn reconcile<S: Store>(
        &self,
        store: &S,
        reserved_at: Timestamp,
        delta: i64,
    ) -> impl Future<Output = Result<(), Error>> {
        self.reconcile_inner(store, reserved_at, delta, None)
    }

    /// Reconciles a reservation at `now`: a positive `delta` is charged, a negative one refunded,
    /// into the bucket holding the reservation made at `reserved_at`, never below zero; a
    /// refund whose bucket no longer counts is dropped, units owed then go into the current
    /// bucket ([`Snapshot::reconciled`](crate::window::Snapshot::reconciled)). Never replayed on
    /// Redis: run twice it would count twice. A refund lowers a count, so a refusal decided
    /// before it may be one that would now pass (docs/design.md, "Token reservation").
    pub fn reconcile_at<S: Store>(
        &self,
        store: &S,
        reserved_at: Timestamp,
        delta: i64,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), Error>> {
        self.reconcile_inner(store, reserved_at, delta, Some(now))
    }

    /// Reconciles the reservation of an admitted request by its `decision` on the store's
    /// clock: as [`reconcile`](Self::reconcile) at the decision's [`now`](ChainDecision::now),
    /// or, for a decision whose limits were charged at instants of their own
    /// ([`ChainDecision::charged_at`]: a chain decided slot by slot on a Redis Cluster), each
    /// limit into the bucket its own instant names. `decision` may be any admission of this
    /// chain: take its `now` and `charged_at`.
    pub fn reconcile_charged<S: Store>(
        &self,
        store: &S,
        now: Timestamp,
        charged_at: &[Timestamp],
        delta: i64,
    ) -> impl Future<Output = Result<(), Error>> {
        self.reconcile_each(store, now, charged_at, delta, None)
    }

    fn reconcile_inner<S: Store>(
        &self,
        store: &S,
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<(), Error>> {
        self.reconcile_each(store, reserved_at, &[], delta, now)
    }

    async fn reconcile_each<S: Store>(
        &self,
        store: &S,
        reserved_at: Timestamp,
        charged_at: &[Timestamp],
        delta: i64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        if delta == 0 || !self.has_reserved() {
            return Ok(());
        }
        if delta < 0 {
            // A refund lowers a count: a remembered refusal may be one that would now pass
            // (docs/design.md §11). Forgotten before the refund lands, and again after, so that
            // no refusal decided before it outlives it.
            self.forget_refusals();
        }
        let done = if charged_at.len() != self.limits.len() {
            store.reconcile(&self.limits, reserved_at, delta, now).await
        } else {
            // Each instant's limits into the buckets that instant names: one call per instant.
            let mut done = Ok(());
            let mut instants: Vec<Timestamp> = charged_at.to_vec();
            instants.sort_unstable();
            instants.dedup();
            for t in instants {
                let limits: Vec<ChainLimit> = self
                    .limits
                    .iter()
                    .zip(charged_at)
                    .filter(|(_, at)| **at == t)
                    .map(|(l, _)| l.clone())
                    .collect();
                let one = store.reconcile(&limits, t, delta, now).await;
                done = done.and(one);
            }
            done
        };
        if delta < 0 {
            self.forget_refusals();
        }
        done
    }
}

/// A token bucket per name: up to `capacity` tokens, refilled continuously at a [`Rate`],
/// starting full. Names are typed: `TokenBucket<str>`, `TokenBucket<u64>`, any [`BucketName`].
///
/// ```
/// use floodgate::{Admission, Rate, TokenBucket};
/// use floodgate::store::MemoryStore;
/// use std::time::Duration;
///
/// const LOGIN: TokenBucket<str> =
///     TokenBucket::new("login", 20, Rate::new(1, Duration::from_secs(3)));
///
/// # async fn demo() -> Result<(), floodgate::Error> {
/// let store = MemoryStore::new();
/// match LOGIN.acquire(&store, "alice", 1).await? {
///     Admission::Allowed { remaining } => assert_eq!(remaining, 19),
///     Admission::Denied { retry_after } => panic!("denied, retry in {retry_after:?}"),
/// }
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
/// ```
pub struct TokenBucket<N: ?Sized> {
    name: &'static str,
    limit: BucketLimit,
    names: PhantomData<fn(&N)>,
}

impl<N: ?Sized> Clone for TokenBucket<N> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<N: ?Sized> Copy for TokenBucket<N> {}

impl<N: ?Sized> fmt::Debug for TokenBucket<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenBucket")
            .field("name", &self.name)
            .field("capacity", &self.limit.capacity)
            .field("rate", &self.limit.rate)
            .finish()
    }
}

impl<N: ?Sized + BucketName> TokenBucket<N> {
    /// A bucket of `capacity` tokens per name, refilled at `rate`; `name` names the limiter
    /// (it is part of every storage key).
    pub const fn new(name: &'static str, capacity: u64, rate: Rate) -> Self {
        TokenBucket {
            name,
            limit: BucketLimit { capacity, rate },
            names: PhantomData,
        }
    }

    /// The limiter's name: part of every storage key, and its policy's name in response headers.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The bucket's capacity and rate.
    pub const fn limit(&self) -> BucketLimit {
        self.limit
    }

    /// The storage key of `name`'s bucket, hash-tagged on the name: `{tb:limiter:name}`.
    pub fn key(&self, name: &N) -> String {
        self.bucket(name).to_string()
    }

    fn bucket<'a>(&self, name: &'a N) -> BucketKey<'a> {
        BucketKey {
            limiter: self.name,
            name: name.name_ref(),
        }
    }

    /// Takes `cost` tokens from `name`'s bucket on the store's clock.
    pub fn acquire<S: Store>(
        &self,
        store: &S,
        name: &N,
        cost: u64,
    ) -> impl Future<Output = Result<Admission, Error>> {
        self.acquire_inner(store, name, cost, None)
    }

    /// Takes `cost` tokens from `name`'s bucket at `now`. A denied request takes nothing (its
    /// refill is still stored); `cost > capacity` is denied with no retry time, without touching
    /// the store.
    pub fn acquire_at<S: Store>(
        &self,
        store: &S,
        name: &N,
        cost: u64,
        now: Timestamp,
    ) -> impl Future<Output = Result<Admission, Error>> {
        self.acquire_inner(store, name, cost, Some(now))
    }

    async fn acquire_inner<S: Store>(
        &self,
        store: &S,
        name: &N,
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<Admission, Error> {
        if !self.limit.fits(cost) {
            return Ok(Admission::Denied { retry_after: None });
        }
        let key = self.bucket(name);
        let seen = store.acquire(key, self.limit, cost, now).await?;
        if !seen.enforced {
            return Ok(Admission::Allowed {
                remaining: self.limit.capacity,
            });
        }
        Ok(self.limit.admission(seen.allowed, seen.tokens, cost))
    }

    /// Deletes `name`'s bucket; says whether it had been used (was not full).
    pub fn reset<S: Store>(
        &self,
        store: &S,
        name: &N,
    ) -> impl Future<Output = Result<bool, Error>> {
        store.reset(self.bucket(name), self.limit, None)
    }

    /// Deletes `name`'s bucket; says whether it had been used (was not full at `now`).
    pub fn reset_at<S: Store>(
        &self,
        store: &S,
        name: &N,
        now: Timestamp,
    ) -> impl Future<Output = Result<bool, Error>> {
        store.reset(self.bucket(name), self.limit, Some(now))
    }
}

/// A type that names token buckets: text or an integer, part of the storage key.
///
/// Implemented for `str`, `String` and the integers up to 64 bits; implement it for your own id
/// types:
///
/// ```
/// use floodgate::BucketName;
/// use floodgate::store::NameRef;
///
/// struct UserId(String);
///
/// impl BucketName for UserId {
///     fn name_ref(&self) -> NameRef<'_> {
///         NameRef::Text(&self.0)
///     }
/// }
/// ```
pub trait BucketName {
    /// This name as a store sees it.
    fn name_ref(&self) -> NameRef<'_>;
}

impl BucketName for str {
    fn name_ref(&self) -> NameRef<'_> {
        NameRef::Text(self)
    }
}

impl BucketName for String {
    fn name_ref(&self) -> NameRef<'_> {
        NameRef::Text(self)
    }
}

macro_rules! unsigned_names {
    ($($t:ty),*) => {$(
        impl BucketName for $t {
            fn name_ref(&self) -> NameRef<'_> {
                NameRef::Unsigned(*self as u64)
            }
        }
    )*};
}

macro_rules! signed_names {
    ($($t:ty),*) => {$(
        impl BucketName for $t {
            fn name_ref(&self) -> NameRef<'_> {
                // Non-negative values name the same bucket as the unsigned integer.
                match u64::try_from(*self) {
                    Ok(n) => NameRef::Unsigned(n),
                    Err(_) => NameRef::Negative(*self as i64),
                }
            }
        }
    )*};
}

unsigned_names!(u8, u16, u32, u64, usize);
signed_names!(i8, i16, i32, i64, isize);

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{Rate, ScopeKind, WindowLimit};

    proptest! {
        /// The bound a chain works out once answers as its limits, asked one by one, do.
        #[test]
        fn a_chain_knows_what_can_never_fit_as_its_limits_do(
            parts in prop::collection::vec((0u8..3, 0u64..4, any::<bool>()), 0..5),
            cost in 0u64..6,
        ) {
            let charges = [Charge::Admission, Charge::Reactive, Charge::Reserved];
            let limits: Vec<ChainLimit> = parts
                .iter()
                .enumerate()
                .map(|(i, &(charge, max, shadow))| {
                    let charge = charges[usize::from(charge)];
                    let limit = WindowLimit::per_minute(max);
                    ChainLimit::new("t", ScopeKind::Key, &format!("k{i}"), charge, limit)
                        .with_shadow(shadow)
                })
                .collect();
            let costs = Costs::Each(cost);
            let chain = Chain::new(limits.clone());
            prop_assert_eq!(chain.never_fits(costs), costs.never_fits(&limits));
        }
    }

    #[test]
    fn keys_are_tagged_on_the_name() {
        const S: TokenBucket<str> = TokenBucket::new("login", 1, Rate::per_second(1));
        const U: TokenBucket<u64> = TokenBucket::new("api", 1, Rate::per_second(1));
        const I: TokenBucket<i32> = TokenBucket::new("api", 1, Rate::per_second(1));
        assert_eq!(S.key("alice"), "{tb:login:alice}");
        assert_eq!(U.key(&0), "{tb:api:0}");
        assert_eq!(U.key(&u64::MAX), "{tb:api:18446744073709551615}");
        assert_eq!(I.key(&-42), "{tb:api:-42}");
        assert_eq!(I.key(&i32::MIN), "{tb:api:-2147483648}");
        const W: TokenBucket<i64> = TokenBucket::new("api", 1, Rate::per_second(1));
        assert_eq!(W.key(&i64::MIN), format!("{{tb:api:{}}}", i64::MIN));
        // A non-negative signed name is the same bucket as the unsigned one.
        assert_eq!(W.bucket(&7), U.bucket(&7));
        let long = "x".repeat(300);
        assert_eq!(S.key(&long), format!("{{tb:login:{long}}}"));
    }
}
