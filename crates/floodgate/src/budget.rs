//! Budgets: caps on what a scope spends per calendar period, checked before a request and
//! charged after it.
//!
//! A budget is reactive, like a token limit: what a request spends is known only once its
//! response is done. So [`Budgets::check`] reads the current period's spend of every budget
//! (charging nothing) and refuses while any has reached its cap, and [`Budgets::spend`] adds the
//! response's spend to every budget afterwards. Requests admitted together before a budget is
//! reached can overrun it by what they spend in flight; nothing is lost by the read not being
//! atomic with the spend, since the spend is not known when the request is admitted.
//!
//! A budget can also reserve ([`Budgets::reserve`]): an estimate's price added at admission,
//! admitted only if it fits, and reconciled with the spend after ([`Budgets::reconcile`]), so that
//! concurrent requests cannot overrun it by more than their estimates' error (docs/design.md §12).
//!
//! Amounts are integers in a unit of the caller's choosing (the gateway uses micro-USD).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::Error;
use crate::chain::ScopeKind;
use crate::clock::Timestamp;
use crate::period::{Period, PeriodCounter};
use crate::store::{PeriodObservation, Store};

/// A cap on what one scope spends per calendar period.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Budget {
    scope: ScopeKind,
    id: Arc<str>,
    cap: u64,
    counter: PeriodCounter,
}

impl Budget {
    /// A budget of `cap` units per `period` on scope `scope` named `id`.
    ///
    /// `tenant` names the hash tag its state is stored under, as for
    /// [`ChainLimit::new`](crate::ChainLimit::new): the storage key is
    /// `{tenant}:scope:id:budget:period`, e.g. `{org:acme}:org:acme:budget:day`.
    pub fn new(tenant: &str, scope: ScopeKind, id: &str, period: Period, cap: u64) -> Self {
        let key = format!("{{{tenant}}}:{scope}:{id}:budget:{period}");
        Budget {
            scope,
            id: id.into(),
            cap,
            counter: PeriodCounter::new(key, period),
        }
    }

    /// The scope kind.
    pub fn scope(&self) -> ScopeKind {
        self.scope
    }

    /// The scope's id (tenant data: never show it to another tenant).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The period.
    pub fn period(&self) -> Period {
        self.counter.period()
    }

    /// The cap: requests are refused once the period's spend reaches it.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// The counter holding the spend.
    pub fn counter(&self) -> &PeriodCounter {
        &self.counter
    }
}

/// The budgets that apply to one caller, narrowest scope first.
///
/// ```
/// use floodgate::ScopeKind;
/// use floodgate::budget::{Budget, Budgets};
/// use floodgate::period::Period;
/// use floodgate::store::MemoryStore;
///
/// # async fn demo() -> Result<(), floodgate::Error> {
/// let budgets = Budgets::new(vec![Budget::new("org:acme", ScopeKind::Org, "acme", Period::Day, 100)]);
/// let store = MemoryStore::new();
/// assert!(budgets.check(&store).await?.allowed());
/// budgets.spend(&store, 100).await?;
/// let refused = budgets.check(&store).await?;
/// assert_eq!(refused.exceeded_by, Some(0));
/// assert!(refused.retry_after.is_some()); // until midnight UTC
/// # Ok(()) }
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Budgets {
    budgets: Vec<Budget>,
    counters: Vec<PeriodCounter>,
    /// Each budget's cap, in order.
    caps: Vec<u64>,
}

/// The answer to a budget check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetDecision {
    /// The instant the spend was read at.
    pub now: Timestamp,
    /// Whether the store was read; `false` when it failed open (nothing is then exceeded).
    pub enforced: bool,
    /// Each budget's spend in its current period, in order (empty when not enforced).
    pub spent: Vec<u64>,
    /// The first budget, in order, whose spend has reached its cap.
    pub exceeded_by: Option<usize>,
    /// For a refusal, the wait until every exceeded budget's period has ended; none when an
    /// exceeded budget's cap is 0, which no period's end lets through.
    pub retry_after: Option<Duration>,
    /// For a refusal, the exceeded budget whose period ends last (the first of those that end
    /// together): the one `retry_after` waits for.
    pub waits_for: Option<usize>,
}

impl BudgetDecision {
    /// Whether no budget is exceeded.
    pub fn allowed(&self) -> bool {
        self.exceeded_by.is_none()
    }
}

impl Budgets {
    /// The budgets `budgets`, narrowest first. Each must have its own storage key.
    pub fn new(budgets: Vec<Budget>) -> Self {
        debug_assert!(
            budgets
                .iter()
                .enumerate()
                .all(|(i, b)| budgets[..i].iter().all(|c| c.counter != b.counter)),
            "budgets must have distinct storage keys"
        );
        let counters = budgets.iter().map(|b| b.counter.clone()).collect();
        let caps = budgets.iter().map(|b| b.cap).collect();
        Budgets {
            budgets,
            counters,
            caps,
        }
    }

    /// The budgets, in order.
    pub fn budgets(&self) -> &[Budget] {
        &self.budgets
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.budgets.is_empty()
    }

    /// Reads every budget's spend on the store's clock. See [`check_at`](Self::check_at).
    pub fn check<S: Store>(
        &self,
        store: &S,
    ) -> impl Future<Output = Result<BudgetDecision, Error>> {
        self.check_inner(store, None)
    }

    /// Reads every budget's spend in its period at `now`, charging nothing: refused (with the
    /// first exceeded budget and the wait until every exceeded one's period ends) if any has
    /// reached its cap.
    pub fn check_at<S: Store>(
        &self,
        store: &S,
        now: Timestamp,
    ) -> impl Future<Output = Result<BudgetDecision, Error>> {
        self.check_inner(store, Some(now))
    }

    async fn check_inner<S: Store>(
        &self,
        store: &S,
        now: Option<Timestamp>,
    ) -> Result<BudgetDecision, Error> {
        if self.budgets.is_empty() {
            return Ok(decide(&[], &[], now.unwrap_or_else(Timestamp::now)));
        }
        let seen = store.read_periods(&self.counters, now).await?;
        Ok(self.decision_of(seen))
    }

    /// The decision a read of every budget's counter gives (`seen`, in order).
    pub(crate) fn decision_of(&self, seen: PeriodObservation) -> BudgetDecision {
        if !seen.enforced {
            return BudgetDecision {
                now: seen.now,
                enforced: false,
                spent: Vec::new(),
                exceeded_by: None,
                retry_after: None,
                waits_for: None,
            };
        }
        decided(&self.budgets, seen.totals, seen.now)
    }

    /// Every budget's counter, in order: where its spend is stored.
    pub fn counters(&self) -> &[PeriodCounter] {
        &self.counters
    }

    /// Every budget's cap, in order.
    pub(crate) fn caps(&self) -> &[u64] {
        &self.caps
    }

    /// Adds `amount` to every budget's spend on the store's clock, once: the store never
    /// replays it.
    pub fn spend<S: Store>(
        &self,
        store: &S,
        amount: u64,
    ) -> impl Future<Output = Result<(), Error>> {
        self.spend_inner(store, amount, None)
    }

    /// Adds `amount` to every budget's spend in its period at `now`.
    pub fn spend_at<S: Store>(
        &self,
        store: &S,
        amount: u64,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), Error>> {
        self.spend_inner(store, amount, Some(now))
    }

    async fn spend_inner<S: Store>(
        &self,
        store: &S,
        amount: u64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        if amount == 0 || self.budgets.is_empty() {
            return Ok(());
        }
        store
            .add_periods(&self.counters, amount, now)
            .await
            .map(drop)
    }
}

impl Budgets {
    /// Reserves `amount` (an estimate's price) on every budget, on the store's clock: admitted
    /// iff every budget's spend plus `amount` fits its cap, and then `amount` is added to each;
    /// refused, nothing stays added. The decision's `spent` is each budget's spend before this
    /// reservation, its `now` the instant to [`reconcile`](Self::reconcile) against.
    ///
    /// The add comes first and is taken back on a refusal: each counter's add is atomic, so of
    /// requests reserving together each sees the reservations before its own, and the admitted
    /// ones never sum past a cap. A refused reservation is counted for the moment between its
    /// add and its refund, which errs towards stricter for concurrent requests.
    ///
    /// An amount above a budget's cap fits in no period: refused without adding anything, with
    /// no time to wait (as a chain refuses a cost above a limit's max), its spend read.
    pub async fn reserve<S: Store>(&self, store: &S, amount: u64) -> Result<BudgetDecision, Error> {
        if self.budgets.is_empty() {
            return Ok(decide(&[], &[], Timestamp::now()));
        }
        if let Some(i) = self.budgets.iter().position(|b| amount > b.cap) {
            let mut decision = self.check(store).await?;
            decision.exceeded_by = Some(decision.exceeded_by.map_or(i, |e| e.min(i)));
            decision.retry_after = None;
            decision.waits_for = None;
            return Ok(decision);
        }
        let seen = store.reserve_periods(&self.counters, amount, None).await?;
        let before: Vec<u64> = seen
            .totals
            .iter()
            .map(|t| t.saturating_sub(amount))
            .collect();
        // Over when the reservation does not fit, or when the budget was spent already: a
        // reservation of 0 (a free model's) on a spent budget is refused, as `check` refuses it.
        let over = |i: usize, b: &Budget| {
            seen.totals.get(i).is_some_and(|&t| t > b.cap)
                || before.get(i).is_some_and(|&s| s >= b.cap)
        };
        let exceeded_by = self
            .budgets
            .iter()
            .enumerate()
            .position(|(i, b)| over(i, b));
        let (retry_after, waits_for) = longest_wait(&self.budgets, seen.now, over);
        let mut decision = decided(&self.budgets, before, seen.now);
        decision.exceeded_by = exceeded_by;
        decision.retry_after = retry_after;
        decision.waits_for = waits_for;
        if !decision.allowed() {
            let refund = -i64::try_from(amount).unwrap_or(i64::MAX);
            store
                .reconcile_periods(&self.counters, seen.now, refund, None)
                .await?;
        }
        Ok(decision)
    }

    /// Reconciles a reservation made at `reserved_at` (its decision's `now`): `delta`, actual
    /// minus reserved, added to each budget's spend in that period, never below zero (a refund
    /// after the period ended is dropped). Never replayed.
    pub async fn reconcile<S: Store>(
        &self,
        store: &S,
        reserved_at: Timestamp,
        delta: i64,
    ) -> Result<(), Error> {
        if delta == 0 || self.budgets.is_empty() {
            return Ok(());
        }
        store
            .reconcile_periods(&self.counters, reserved_at, delta, None)
            .await
    }
}

/// The decision for `budgets` with their spend `spent` (same order) at `now`: pure.
pub fn decide(budgets: &[Budget], spent: &[u64], now: Timestamp) -> BudgetDecision {
    decided(budgets, spent.to_vec(), now)
}

/// [`decide`], keeping `spent` in the decision rather than a copy: a request's check allocates
/// one list, not two.
fn decided(budgets: &[Budget], spent: Vec<u64>, now: Timestamp) -> BudgetDecision {
    let over = |i: usize, b: &Budget| spent.get(i).is_some_and(|&s| s >= b.cap);
    let exceeded_by = budgets.iter().enumerate().position(|(i, b)| over(i, b));
    let (retry_after, waits_for) = longest_wait(budgets, now, over);
    BudgetDecision {
        now,
        enforced: true,
        spent,
        exceeded_by,
        retry_after,
        waits_for,
    }
}

/// The wait until every budget that is `over` has its period end, and the one that ends last
/// (the first of those that end together); none when no budget is over, or when one that is over
/// has a cap of 0, which no period's end lets through (a limit of 0 has no retry time either).
fn longest_wait(
    budgets: &[Budget],
    now: Timestamp,
    over: impl Fn(usize, &Budget) -> bool,
) -> (Option<Duration>, Option<usize>) {
    let mut longest: Option<(usize, Duration)> = None;
    for (i, b) in budgets.iter().enumerate().filter(|(i, b)| over(*i, b)) {
        if b.cap == 0 {
            return (None, None);
        }
        let wait = b.period().remaining(now);
        if longest.is_none_or(|(_, w)| wait > w) {
            longest = Some((i, wait));
        }
    }
    (longest.map(|(_, w)| w), longest.map(|(i, _)| i))
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} per {}", self.cap, self.period())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_exceeded_is_named_and_the_longest_wait_kept() {
        // 2023-11-14T22:14:00Z: 6360 s to midnight, 1_388_760 s to December.
        let now = Timestamp::from_secs(1_700_000_040);
        let b = [
            Budget::new("org:a", ScopeKind::Key, "k", Period::Day, 10),
            Budget::new("org:a", ScopeKind::Org, "a", Period::Month, 100),
            Budget::new("org:a", ScopeKind::Org, "a", Period::Day, 50),
        ];
        assert_eq!(b[1].counter().key(), "{org:a}:org:a:budget:month");
        let d = decide(&b, &[9, 99, 49], now);
        assert!(d.allowed() && d.retry_after.is_none());
        let d = decide(&b, &[10, 99, 50], now);
        assert_eq!(d.exceeded_by, Some(0));
        assert_eq!(d.retry_after, Some(Duration::from_secs(6_360)));
        assert_eq!(d.waits_for, Some(0), "two days end together: the first");
        let d = decide(&b, &[10, 100, 0], now);
        assert_eq!(d.exceeded_by, Some(0));
        assert_eq!(d.retry_after, Some(Duration::from_secs(1_388_760)));
        assert_eq!(d.waits_for, Some(1));
        // A cap of 0 refuses from the start, and forever: no time to wait, even beside a
        // budget that a period's end would free.
        let zero = [
            Budget::new("org:a", ScopeKind::Key, "k", Period::Day, 0),
            Budget::new("org:a", ScopeKind::Org, "a", Period::Month, 100),
        ];
        let d = decide(&zero, &[0, 100], now);
        assert_eq!(d.exceeded_by, Some(0));
        assert_eq!((d.retry_after, d.waits_for), (None, None));
    }
}
