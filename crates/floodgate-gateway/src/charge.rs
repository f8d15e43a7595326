//! The one charger for what responses cost after the fact: tokens to a chain's token limits and
//! spend to its budgets (docs/design.md §6), each charged once, never replayed on Redis for
//! spend.
//!
//! Every charge is **tracked**: a metered response body holds a [`Held`] from the moment it is
//! built until its charge has landed (through any read-on after its caller left), and a charge
//! made in the background holds one until its store call returns. [`Charger::settled`] resolves
//! once nothing is held, so a draining worker waits for its charges instead of sleeping, and
//! tests await the charge itself instead of a fixed time.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Waker};

use floodgate::store::Spent;
use floodgate::{Budgets, Chain, Timestamp};
use tokio::sync::Notify;

use crate::metrics::{Metrics, StoreOp};
use crate::openai::usage::TokenUsage;
use crate::store::GatewayStore;

/// What an admitted request reserved on its chain's reserving token limits: the estimate, at the
/// decision's instant (which names the bucket it went into).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// The admission decision's instant.
    pub at: Timestamp,
    /// Each limit's own instant, when the chain was decided slot by slot on a Redis Cluster
    /// ([`floodgate::ChainDecision::charged_at`]); empty when all were charged at `at`.
    pub charged_at: Vec<Timestamp>,
    /// The tokens reserved.
    pub estimate: u64,
}

impl Reservation {
    /// The difference to charge once `tokens` are known: `exact` from the response's usage
    /// (charged or refunded as it falls), or a count of a cut stream's chunks, which keeps the
    /// reservation unless it is more (towards stricter: the prompt is not in the count).
    pub fn delta(&self, tokens: u64, exact: bool) -> i64 {
        let used = i64::try_from(tokens).unwrap_or(i64::MAX);
        let reserved = i64::try_from(self.estimate).unwrap_or(i64::MAX);
        let delta = used.saturating_sub(reserved);
        if exact { delta } else { delta.max(0) }
    }
}

/// What an admitted request reserved on its chain's enforced budgets (`[gateway] tokens =
/// "reserve"`): the estimate's price, at the reservation's instant (its period).
#[derive(Clone, Debug)]
pub struct BudgetReservation {
    /// The budgets reserved on.
    pub budgets: Arc<Budgets>,
    /// The instant of the reservation.
    pub at: Timestamp,
    /// The price reserved, in micro-USD.
    pub micro_usd: u64,
}

impl BudgetReservation {
    /// The difference to charge once the spend is known: as [`Reservation::delta`].
    pub fn delta(&self, micro_usd: u64, exact: bool) -> i64 {
        Reservation {
            at: self.at,
            charged_at: Vec::new(),
            estimate: self.micro_usd,
        }
        .delta(micro_usd, exact)
    }
}

/// A budget reservation taken before the chain's admission, taken back unless the request is
/// admitted ([`keep`](Self::keep)). It refunds when dropped still held, so that a request whose
/// future is dropped mid-admission (its caller gone while the store answers) does not leave its
/// price on the budgets for the rest of the period (docs/design.md §12).
pub struct HeldReservation {
    charger: Charger,
    reservation: Option<BudgetReservation>,
}

impl HeldReservation {
    /// Holds `reservation`, to be refunded through `charger` unless kept.
    pub fn new(charger: &Charger, reservation: BudgetReservation) -> HeldReservation {
        HeldReservation {
            charger: charger.clone(),
            reservation: Some(reservation),
        }
    }

    /// The reservation, kept: the request was admitted, and its response reconciles it.
    pub fn keep(mut self) -> Option<BudgetReservation> {
        self.reservation.take()
    }

    /// Takes the reservation back and waits for the refund to land. The refund runs on its
    /// own: dropping this future does not stop it.
    pub async fn refund(mut self) {
        if let Some(landed) = self.give_back() {
            // An error only says the refund was dropped unpolled (no runtime): nothing to wait
            // for.
            let _ = landed.await;
        }
    }

    /// Starts the refund of a reservation still held, at once or in a task; says when it has
    /// landed. `None`: nothing was held.
    fn give_back(&mut self) -> Option<tokio::sync::oneshot::Receiver<()>> {
        let r = self.reservation.take()?;
        let (done, landed) = tokio::sync::oneshot::channel();
        let charger = self.charger.clone();
        now_or_in_a_task(Box::pin(async move {
            charger.reconcile_spend_now(&r, refund_of(&r)).await;
            let _ = done.send(());
        }));
        Some(landed)
    }
}

impl Drop for HeldReservation {
    fn drop(&mut self) {
        // Dropped still held: the request's future went before its admission answered.
        let _ = self.give_back();
    }
}

/// The delta that takes all of `r` back.
fn refund_of(r: &BudgetReservation) -> i64 {
    -i64::try_from(r.micro_usd).unwrap_or(i64::MAX)
}

/// Charges tokens and spend on one worker's store, and tracks every charge in flight. A cheap
/// clone: every clone tracks into the same count.
#[derive(Clone, Debug)]
pub struct Charger {
    store: GatewayStore,
    tracked: Arc<Tracked>,
    metrics: Metrics,
}

#[derive(Debug, Default)]
struct Tracked {
    live: AtomicUsize,
    idle: Notify,
    /// Charges lost to a store that could not take them (logged at `debug` each, and counted
    /// for the line a worker writes at its end).
    lost: AtomicU64,
}

/// A charge (or a response that will charge) in flight; [`Charger::settled`] waits for it to be
/// dropped.
#[derive(Debug)]
pub struct Held(Arc<Tracked>);

impl Drop for Held {
    fn drop(&mut self) {
        if self.0.live.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Charger {
    /// A charger on `store`, with nothing in flight, counting what it charges in `metrics`.
    pub fn new(store: GatewayStore, metrics: Metrics) -> Charger {
        Charger {
            store,
            tracked: Arc::default(),
            metrics,
        }
    }

    /// Counts a metered response's (or a realtime turn's) usage in the metrics.
    pub fn count_usage(&self, usage: &TokenUsage) {
        let input = usage.input.unwrap_or(0);
        let output = usage.output.unwrap_or(usage.total.saturating_sub(input));
        self.metrics.tokens(input, output);
    }

    /// Counts `micro_usd` spent in the metrics (a realtime turn's, which [`spend_now`](
    /// Self::spend_now) adds to its budgets).
    pub fn count_spend(&self, micro_usd: u64) {
        if micro_usd > 0 {
            self.metrics.spend(micro_usd);
        }
    }

    /// The store charges go to.
    pub fn store(&self) -> &GatewayStore {
        &self.store
    }

    /// Counts something that will charge until the returned guard is dropped.
    pub fn hold(&self) -> Held {
        self.tracked.live.fetch_add(1, Ordering::SeqCst);
        Held(Arc::clone(&self.tracked))
    }

    /// How many charges (token records, spend, reconciliations) were lost so far to a store
    /// that could not take them.
    pub fn lost(&self) -> u64 {
        self.tracked.lost.load(Ordering::Relaxed)
    }

    /// Resolves once no charge is in flight and no metered response is still to charge.
    pub async fn settled(&self) {
        loop {
            let idle = self.tracked.idle.notified();
            if self.tracked.live.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }

    /// Charges `tokens` to `chain`'s token limits (with `reconcile`, the request's reservation
    /// and the difference its reserving limits are charged: [`tokens_now`](Self::tokens_now))
    /// and `micro_usd` to `budgets`, in the background, once each; `held` (the response's
    /// guard, if any) is released when both have landed.
    ///
    /// With `reserved`, the budgets a reservation was made on are reconciled by its difference
    /// (the other `budgets`, shadow ones, are charged `micro_usd` as usual).
    pub fn later(
        &self,
        (chain, reconcile): (Option<&Arc<Chain>>, Option<(Reservation, i64)>),
        tokens: u64,
        (budgets, reserved): (Option<&Arc<Budgets>>, Option<(BudgetReservation, i64)>),
        micro_usd: u64,
        held: Option<Held>,
    ) {
        let chain = chain
            .filter(|c| tokens > 0 && c.has_reactive() || c.has_reserved())
            .cloned();
        let budgets = budgets.filter(|b| micro_usd > 0 && !b.is_empty()).cloned();
        // The spend is counted once, whichever way it lands: added to budgets, or settling a
        // reservation (whose difference can be 0 when the estimate was exact).
        if micro_usd > 0 && (budgets.is_some() || reserved.is_some()) {
            self.metrics.spend(micro_usd);
        }
        let reserved = reserved.filter(|(_, delta)| *delta != 0);
        if chain.is_none() && budgets.is_none() && reserved.is_none() {
            return;
        }
        let held = held.unwrap_or_else(|| self.hold());
        let reserving = chain.as_ref().is_some_and(|c| c.has_reserved());
        if reconcile.is_none() && reserved.is_none() && !reserving {
            // The common case, tokens and spend added: the store takes both as one charge and
            // calls back where it lands (at once in memory, when the next call answers on
            // Redis), without a future or a task per response (docs/design.md §6).
            self.charge_then(
                chain.as_deref(),
                tokens,
                budgets.as_deref(),
                micro_usd,
                held,
            );
            return;
        }
        let charger = self.clone();
        let charge = Box::pin(async move {
            // Both at once: on Redis they then go out in one charge batch (one script call).
            let spend = async {
                if let Some(budgets) = &budgets {
                    charger.spend_now(budgets, micro_usd).await;
                }
                if let Some((r, delta)) = &reserved {
                    charger.reconcile_spend_now(r, *delta).await;
                }
            };
            let tokens = async {
                if let Some(chain) = &chain {
                    charger.tokens_now(chain, tokens, reconcile).await;
                }
            };
            tokio::join!(spend, tokens);
            drop(held);
        });
        if !now_or_in_a_task(charge) {
            tracing::warn!(tokens, micro_usd, "no runtime to charge on: dropped");
        }
    }

    /// Adds `tokens` to `chain`'s reactive limits and `micro_usd` to `budgets` as one charge
    /// ([`floodgate::store::AnyStore::charge_then`]); `held` is released, and the calls counted
    /// and any failure logged, where it lands.
    fn charge_then(
        &self,
        chain: Option<&Chain>,
        tokens: u64,
        budgets: Option<&Budgets>,
        micro_usd: u64,
        held: Held,
    ) {
        let spent = Spent {
            limits: chain.map_or(&[][..], |c| c.limits()),
            units: tokens,
            counters: budgets.map_or(&[][..], |b| b.counters()),
            amount: micro_usd,
        };
        // What is timed is what the store charges.
        let tokens = if spent.records() { tokens } else { 0 };
        let micro_usd = if spent.adds() { micro_usd } else { 0 };
        let metrics = self.metrics.clone();
        let start = std::time::Instant::now();
        let landed = move |done: Result<(), floodgate::Error>| {
            let took = start.elapsed();
            for (op, charged) in [(StoreOp::Record, tokens), (StoreOp::Spend, micro_usd)] {
                if charged > 0 {
                    metrics.store_call(op, took, done.is_err());
                }
            }
            match done {
                Ok(()) => {}
                // The store logs an outage (or a dropped connection) once; a line for every
                // metered response would flood the log for as long as it lasts.
                Err(e @ floodgate::Error::Unavailable(_)) => {
                    held.0.lost.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, tokens, micro_usd, "could not charge");
                }
                Err(e) => tracing::warn!(error = %e, tokens, micro_usd, "could not charge"),
            }
            drop(held);
        };
        self.store.charge_then(spent, landed);
    }

    /// Charges `tokens` to `chain`'s token limits now, once; a failure is logged, not returned
    /// (the response or session it came from is over, or must not be held up by it).
    ///
    /// Reactive limits are charged `tokens`. Reserving limits are reconciled: with
    /// `reconcile`, the request's reservation and the difference to charge into its bucket
    /// ([`Reservation::delta`]); without (a realtime session's turn, which reserved nothing),
    /// `tokens` into the current bucket on this process's clock, as a reactive limit is charged.
    pub async fn tokens_now(
        &self,
        chain: &Chain,
        tokens: u64,
        reconcile: Option<(Reservation, i64)>,
    ) {
        if chain.has_reserved() {
            let (at, charged_at, delta) = match reconcile {
                Some((r, delta)) => (r.at, r.charged_at, delta),
                None => (
                    Timestamp::now(),
                    Vec::new(),
                    i64::try_from(tokens).unwrap_or(i64::MAX),
                ),
            };
            self.reconcile_now(chain, at, &charged_at, delta).await;
        }
        if tokens == 0 || !chain.has_reactive() {
            return;
        }
        let _held = self.hold();
        let start = std::time::Instant::now();
        let recorded = chain.record(&self.store, tokens).await;
        let metrics = &self.metrics;
        metrics.store_call(StoreOp::Record, start.elapsed(), recorded.is_err());
        match recorded {
            Ok(()) => {}
            // The store logs an outage (or a dropped connection) once; a line for every
            // metered response would flood the log for as long as it lasts.
            Err(e @ floodgate::Error::Unavailable(_)) => {
                self.tracked.lost.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, tokens, "could not record tokens");
            }
            Err(e) => tracing::warn!(error = %e, tokens, "could not record tokens"),
        }
    }

    /// Reconciles `chain`'s reserving limits now, once: `delta` into the bucket of `at` (or of
    /// each limit's own instant in `charged_at`, for a chain decided slot by slot).
    async fn reconcile_now(
        &self,
        chain: &Chain,
        at: Timestamp,
        charged_at: &[Timestamp],
        delta: i64,
    ) {
        if delta == 0 {
            return;
        }
        let _held = self.hold();
        let start = std::time::Instant::now();
        let done = chain
            .reconcile_charged(&self.store, at, charged_at, delta)
            .await;
        let metrics = &self.metrics;
        metrics.store_call(StoreOp::Reconcile, start.elapsed(), done.is_err());
        match done {
            Ok(()) => {}
            // The store logs an outage once. The reservation stays charged: stricter.
            Err(e @ floodgate::Error::Unavailable(_)) => {
                self.tracked.lost.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, delta, "could not reconcile a reservation");
            }
            Err(e) => tracing::warn!(error = %e, delta, "could not reconcile a reservation"),
        }
    }

    /// Reconciles a budget reservation now, once: `delta` into the period it was made in. A
    /// failure is logged; the reservation then stays as it was (towards stricter).
    pub async fn reconcile_spend_now(&self, r: &BudgetReservation, delta: i64) {
        if delta == 0 {
            return;
        }
        let _held = self.hold();
        let start = std::time::Instant::now();
        let done = r.budgets.reconcile(&self.store, r.at, delta).await;
        let metrics = &self.metrics;
        metrics.store_call(StoreOp::Reconcile, start.elapsed(), done.is_err());
        match done {
            Ok(()) => {}
            // The store logs an outage once; a line a request would flood the log.
            Err(e @ floodgate::Error::Unavailable(_)) => {
                self.tracked.lost.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, delta, "could not reconcile a budget reservation");
            }
            Err(e) => tracing::warn!(error = %e, delta, "could not reconcile a budget reservation"),
        }
    }

    /// Adds `micro_usd` to every budget of `budgets` now, once: spend is never replayed, since
    /// a double-applied increment would corrupt a budget (docs/design.md §5). Not counted in
    /// the metrics: the caller counts what was spent ([`count_spend`](Self::count_spend)).
    pub async fn spend_now(&self, budgets: &Budgets, micro_usd: u64) {
        if micro_usd == 0 || budgets.is_empty() {
            return;
        }
        let _held = self.hold();
        let start = std::time::Instant::now();
        let spent = budgets.spend(&self.store, micro_usd).await;
        let metrics = &self.metrics;
        metrics.store_call(StoreOp::Spend, start.elapsed(), spent.is_err());
        match spent {
            Ok(()) => {}
            // The store logs an outage (or a dropped connection) once.
            Err(e @ floodgate::Error::Unavailable(_)) => {
                self.tracked.lost.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, micro_usd, "could not record spend");
            }
            Err(e) => tracing::warn!(error = %e, micro_usd, "could not record spend"),
        }
    }
}

/// Runs `work` to its end here if it completes on its first poll, else in a task of the current
/// runtime (false if there is none: then it is dropped unpolled). A store call that completes at
/// once (the memory store's) thus costs no task: a task's spawn, scheduling and wake-up cost
/// more than the call itself (docs/design.md §6). One that waits (on Redis, for its batch) goes
/// on in the task, which polls it again with a waker of its own.
pub fn now_or_in_a_task(mut work: Pin<Box<dyn Future<Output = ()> + Send>>) -> bool {
    // Not even polled outside a runtime: a store call may need one to queue its batch.
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    let mut cx = Context::from_waker(Waker::noop());
    if work.as_mut().poll(&mut cx).is_pending() {
        drop(rt.spawn(work));
    }
    true
}

#[cfg(test)]
mod tests {
    use floodgate::store::MemoryStore;
    use floodgate::{Budget, Period, ScopeKind};

    use super::*;

    #[tokio::test]
    async fn a_held_budget_reservation_goes_back_unless_kept() {
        let store: GatewayStore = MemoryStore::new().into();
        let charger = Charger::new(store.clone(), Metrics::new());
        let budgets = Arc::new(Budgets::new(vec![Budget::new(
            "org:a",
            ScopeKind::Org,
            "a",
            Period::Day,
            1_000,
        )]));
        let reserve = || async {
            let d = budgets.reserve(&store, 300).await.expect("reserve");
            assert!(d.allowed());
            let r = BudgetReservation {
                budgets: Arc::clone(&budgets),
                at: d.now,
                micro_usd: 300,
            };
            HeldReservation::new(&charger, r)
        };
        let spent = || async { budgets.check(&store).await.expect("check").spent[0] };
        // Dropped while held (a request's future dropped mid-admission): refunded.
        drop(reserve().await);
        charger.settled().await;
        assert_eq!(spent().await, 0);
        // Refused: refunded before the refusal is answered.
        reserve().await.refund().await;
        assert_eq!(spent().await, 0);
        // Admitted: kept, for the response to reconcile.
        let kept = reserve().await.keep();
        assert_eq!(kept.map(|r| r.micro_usd), Some(300));
        charger.settled().await;
        assert_eq!(spent().await, 300);
    }

    #[test]
    fn a_reservation_is_reconciled_by_the_usage_and_kept_by_a_cut_streams_count() {
        let r = Reservation {
            at: Timestamp::ZERO,
            charged_at: Vec::new(),
            estimate: 100,
        };
        // The usage: charged or refunded as it falls.
        assert_eq!(r.delta(30, true), -70);
        assert_eq!(r.delta(130, true), 30);
        // A cut stream's chunk count: kept whole unless the count is more.
        assert_eq!(r.delta(30, false), 0);
        assert_eq!(r.delta(130, false), 30);
        assert_eq!(r.delta(u64::MAX, true), i64::MAX - 100);
    }
}
