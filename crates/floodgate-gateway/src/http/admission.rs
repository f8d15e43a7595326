//! Admission: the one step that decides whether a request goes on, for every entry point (a
//! proxied request, a realtime upgrade). docs/design.md §2 and §6.
//!
//! A [`Ctx`] is one request's context through the pipeline: the key, its resolved chain and
//! budgets, the request line and when it arrived. Its answers are the pipeline's only ways to
//! refuse, each logged once and, for a 429, counted in the refusal tally:
//!
//! - [`Ctx::reject`]: refused before admission (a request that cannot be read or forwarded),
//!   nothing charged, with the chain's rate-limit state read at a cost of 0;
//! - [`Ctx::admit`]: the chain's budgets read (charging nothing), or under `tokens = "reserve"`
//!   reserved (the estimate's price, taken back on a refusal), then the chain admitted in one
//!   atomic step; a refusal is charged to no limit;
//! - [`Ctx::upstream_failed`]: the upstream could not answer an admitted request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use floodgate::chain::Costs;
use floodgate::store::Store;
use floodgate::{BudgetDecision, Budgets, Chain, ChainDecision, Charge, ScopeKind};

use super::state::{AppState, LimitKind, Live};
use crate::access_log::{self, CallerGone, Decision, PendingLine};
use crate::auth::{KeyEntry, ResolvedChain};
use crate::charge::{BudgetReservation, HeldReservation, Reservation};
use crate::config::usd;
use crate::error::{AppError, NoWait};
use crate::headers::{self, ChainHeaders};
use crate::metrics::{LimitOutcome, Outcome, StoreOp};
use crate::openai::request::Estimate;
use crate::slots::{HoldingBody, Slots};
use crate::tally::Subject;

/// One request's context: who sent it, what limits it, what it is.
pub(super) struct Ctx {
    pub(super) state: AppState,
    /// The config in force when the request started: it keeps it to its end.
    pub(super) live: Arc<Live>,
    pub(super) key: Arc<KeyEntry>,
    pub(super) chain: Arc<Chain>,
    /// The chain's reactive view, for a request that reserves nothing
    /// ([`ResolvedChain::reactive`]).
    reactive: Option<Arc<Chain>>,
    fixed: Arc<ChainHeaders>,
    pub(super) budgets: Option<Arc<Budgets>>,
    /// The shadow budgets: read, never refusing.
    pub(super) shadow_budgets: Option<Arc<Budgets>>,
    /// Every budget (shadow ones too): what the answer's spend is added to.
    pub(super) spend_budgets: Option<Arc<Budgets>>,
    pub(super) method: Method,
    pub(super) uri: Uri,
    pub(super) start: Instant,
}

/// An admitted request: the chain's decision (its headers go on every answer) and how the log
/// line names it.
pub(super) struct Admitted {
    decision: ChainDecision,
    /// [`Decision::Admitted`], or [`Decision::Unenforced`] when the store failed open.
    pub(super) log_as: Decision,
    /// The concurrency slots the request holds, if its chain has concurrency limits: given back
    /// when this is dropped, or when the body it is moved into ends.
    slots: Option<Slots>,
    /// What it reserved on its chain's reserving token limits (`tokens = "reserve"`), to
    /// reconcile with its usage; `None` for a chain without them, or one that failed open.
    pub(super) reservation: Option<Reservation>,
    /// What it reserved on its enforced budgets (`[gateway] tokens = "reserve"`): the estimate's
    /// price, to reconcile with its spend.
    pub(super) budget_reservation: Option<BudgetReservation>,
}

impl Ctx {
    /// The context of a request by `key` (authenticated), whose chain is resolved from the
    /// request's `headers` (the customer it names).
    pub(super) fn new(
        state: AppState,
        live: Arc<Live>,
        key: Arc<KeyEntry>,
        (method, uri, headers): (&Method, &Uri, &HeaderMap),
        start: Instant,
    ) -> Ctx {
        let ResolvedChain {
            chain,
            headers: fixed,
            budgets,
            shadow_budgets,
            spend_budgets,
            reactive,
        } = live.keys.chain_for_request(&key, headers);
        Ctx {
            state,
            live,
            key,
            chain,
            reactive,
            fixed,
            budgets,
            shadow_budgets,
            spend_budgets,
            method: method.clone(),
            uri: uri.clone(),
            start,
        }
    }

    /// This request reserves no tokens (a realtime session; a request whose body is not read):
    /// from here it is admitted and charged on its chain's reserving token limits as reactive
    /// ones (docs/gateway.md, "Token reservation"). Its admission then needs room in each token
    /// window, as a reactive one does, where a reservation of 0 would pass a full one; its
    /// tokens are charged when they come.
    pub(super) fn reserves_nothing(&mut self) {
        if let Some(reactive) = self.reactive.take() {
            self.chain = reactive;
        } else if self.chain.has_reserved() {
            // A customer's chain, built for this request: its view too.
            self.chain = Arc::new(self.chain.reserving_as_reactive());
        }
    }

    /// Writes the request's line now.
    pub(super) fn log(&self, status: StatusCode, decision: Decision) {
        access_log::write(
            Some(&self.key.id),
            &self.method,
            self.uri.path(),
            status,
            self.start,
            decision,
            None,
        );
    }

    /// The line to write when an admitted request's streaming answer with `status` is done.
    pub(super) fn pending_line(&self, status: StatusCode, admitted: &Admitted) -> PendingLine {
        PendingLine {
            key: Arc::clone(&self.key.id),
            method: self.method.clone(),
            uri: self.uri.clone(),
            status,
            start: self.start,
            decision: admitted.log_as,
        }
    }

    /// A guard that writes a 499 line if the caller leaves while the upstream is asked.
    pub(super) fn caller_gone(&self, admitted: &Admitted) -> CallerGone<'_> {
        CallerGone::new(
            &self.key.id,
            &self.method,
            &self.uri,
            self.start,
            admitted.log_as,
        )
    }

    /// `err` as the answer to a request not admitted, logged as `decision` and counted in the
    /// metrics, without rate-limit headers.
    pub(super) fn answer(&self, err: AppError, decision: Decision) -> Response {
        self.state.metrics().request(outcome_of(decision));
        self.log(err.status(), decision);
        err.into_response()
    }

    /// Counts a 429 in the refusal tally: against the gateway if its own scope refused, else
    /// against the key.
    pub(super) fn count_refusal(&self, refused_by: ScopeKind) {
        let subject = match refused_by {
            ScopeKind::Gateway => Subject::Gateway,
            _ => Subject::Key(self.key.index),
        };
        self.live.refusals.refused(subject);
    }

    /// The answer `err` to a request refused before admission (nothing charged), logged as
    /// `decision`, with the chain's rate-limit state read by an admission of cost 0
    /// (docs/design.md §6: every response carries it). No limit's `Retry-After`: waiting for a
    /// limit does not mend the request; an error that waiting mends (a busy gateway) keeps its
    /// own.
    pub(super) async fn reject(&self, err: AppError, decision: Decision) -> Response {
        let own_wait = err.retry_after();
        let mut resp = self.answer(err, decision);
        if let Some(rates) = self.rates().await {
            let h = resp.headers_mut();
            headers::apply(h, &rates, &self.fixed);
            h.remove(axum::http::header::RETRY_AFTER);
            h.remove("retry-after-ms");
            if let Some(wait) = own_wait {
                headers::apply_retry_after(h, wait);
            }
        }
        resp
    }

    /// The chain's rate-limit state, read by an admission of cost 0 (nothing charged);
    /// `None` when the store cannot say.
    async fn rates(&self) -> Option<ChainDecision> {
        // A limit that no request can pass (`requests = 0`) passes a cost of 0 and would read
        // as free with a reset of 0, an invitation to retry forever: asked at cost 1 instead,
        // the chain answers "never" without reading (or charging) the store, as an admission
        // would.
        let never = self.chain.limits().iter().any(|l| !l.fits(1));
        let cost = u64::from(never);
        self.timed_admit(cost).await.ok()
    }

    /// `budgets` read (charging nothing), timed for the metrics.
    async fn timed_check(&self, budgets: &Budgets) -> Result<BudgetDecision, floodgate::Error> {
        let start = Instant::now();
        let checked = budgets.check(self.state.store()).await;
        let failed = checked.as_ref().map_or(true, |d| !d.enforced);
        let metrics = self.state.metrics();
        metrics.store_call(StoreOp::ReadBudgets, start.elapsed(), failed);
        checked
    }

    /// The chain's admission at `cost`, timed for the metrics.
    async fn timed_admit(&self, cost: u64) -> Result<ChainDecision, floodgate::Error> {
        self.timed_admit_costs(cost, None).await
    }

    /// The chain's admission at `cost` a request limit, timed for the metrics; with
    /// `reserve`, its reserving token limits cost that estimate instead, in the same atomic
    /// step (docs/design.md, "Token reservation").
    async fn timed_admit_costs(
        &self,
        cost: u64,
        reserve: Option<u64>,
    ) -> Result<ChainDecision, floodgate::Error> {
        // A handful of limits: one small vector per reserving request.
        let costs: Option<Vec<u64>> = reserve.map(|tokens| {
            self.chain
                .limits()
                .iter()
                .map(|l| match l.charge() {
                    Charge::Reserved => tokens,
                    Charge::Admission | Charge::Reactive => cost,
                })
                .collect()
        });
        // A refusal the chain still remembers is answered without the store, exactly as the
        // store would answer it (docs/design.md §11): no store call to time.
        let store = self.state.store();
        let cached = match &costs {
            Some(costs) => self
                .chain
                .cached_refusal(store, Costs::PerLimit(costs), None),
            None => self.chain.cached_refusal(store, cost, None),
        };
        if let Some(refused) = cached {
            return Ok(refused);
        }
        let start = Instant::now();
        let decided = match &costs {
            Some(costs) => self.chain.admit_costs(store, costs).await,
            None => self.chain.admit(store, cost).await,
        };
        let failed = decided.as_ref().map_or(true, |d| !d.enforced);
        self.state
            .metrics()
            .store_call(StoreOp::Admit, start.elapsed(), failed);
        self.state.note_breaker(failed);
        decided
    }

    /// Admits the request: its budgets first, read without charging anything, so that a spent
    /// budget refuses before any rate limit is charged; then the chain, in one atomic step, at a
    /// cost of one request. `Err` is the answer to send: a refusal (429, logged and counted in
    /// the tally) or the store's failure (503 failing closed, else 500), nothing charged.
    ///
    /// The budget read is not part of the chain's atomic step because a budget is reactive (a
    /// response's spend is known only after it), so an atomic check would be no more exact;
    /// concurrent requests can overrun a budget by what they spend in flight.
    ///
    /// A chain with reserving token limits (`tokens = "reserve"`) is admitted with `estimate`
    /// as their cost, beside the request's cost of 1, in the same step: admitted only if
    /// every limit has room for it, and then charged it, to be reconciled with the usage. An
    /// estimate that no wait would let through (above a reserving limit itself) is a 400 that
    /// says which cap to lower, charged nothing.
    ///
    /// With `price` (`[gateway] tokens = "reserve"`: the estimate priced), the enforced budgets
    /// are not read but reserved: admitted only if each one's spend plus the price fits its cap,
    /// the price then added, to be reconciled with the spend; a refusal later in the admission
    /// takes it back. A price above a budget's cap itself, which no period's end would let
    /// through, is a 400 that says which budget and what to lower, charged nothing.
    pub(super) async fn admit(
        &self,
        estimate: Estimate,
        price: Option<u64>,
    ) -> Result<Admitted, Response> {
        let never_fits = self
            .budgets
            .as_deref()
            .zip(price)
            .and_then(|(budgets, price)| budget_never_fits(budgets, price, estimate));
        if let Some(err) = never_fits {
            // A client's mistake, not a refusal: not counted in the tally, charged nothing, and
            // answered with the chain's state, as any request refused before admission is.
            return Err(self.reject(err, Decision::BadRequest).await);
        }
        if let Some(budgets) = &self.budgets
            && price.is_none()
            && !self.chain.has_reserved()
            && self.shadow_budgets.is_none()
        {
            return self.admit_within(budgets, estimate).await;
        }
        let mut budget_reservation = None;
        if let Some(budgets) = &self.budgets {
            let checked = match price {
                Some(price) => {
                    let start = Instant::now();
                    let reserved = budgets.reserve(self.state.store(), price).await;
                    let failed = reserved.is_err();
                    let metrics = self.state.metrics();
                    metrics.store_call(StoreOp::ReadBudgets, start.elapsed(), failed);
                    if let Some(d) = reserved.as_ref().ok().filter(|d| d.allowed()) {
                        // Held from here: taken back if the admission refuses, fails or is
                        // dropped before it answers.
                        let r = BudgetReservation {
                            budgets: Arc::clone(budgets),
                            at: d.now,
                            micro_usd: price,
                        };
                        budget_reservation = Some(HeldReservation::new(self.state.charges(), r));
                    }
                    reserved
                }
                None => self.timed_check(budgets).await,
            };
            match checked {
                Ok(d) if d.allowed() => {}
                Ok(d) => return Err(self.refuse_budget(budgets, &d, estimate).await),
                // Budgets fail open on their own (`on_error.budgets`): read as unspent.
                Err(floodgate::Error::Unavailable(_))
                    if self.state.fails_open(LimitKind::Budgets) => {}
                Err(e) => return Err(self.answer(e.into(), Decision::StoreError)),
            }
        }
        let admitted = self.admit_chain(estimate).await;
        match admitted {
            Ok(mut a) => {
                a.budget_reservation = budget_reservation.and_then(HeldReservation::keep);
                Ok(a)
            }
            Err(refused) => {
                // Refused after all (or failed): the budgets' reservation goes back.
                if let Some(r) = budget_reservation {
                    r.refund().await;
                }
                Err(refused)
            }
        }
    }

    /// [`admit`](Self::admit) for a chain with enforced budgets and no reservation or shadow
    /// budget (the common metered chain): the budgets' check and the chain's admission as one
    /// store call where the store can (`Chain::admit_within`; on Redis one script call, so the
    /// request waits for one round trip, not two). The answers are those of the check and then
    /// the admission, failures included: a store that cannot be reached fails as the read would
    /// (`on_error.budgets`) and then as the admission would.
    async fn admit_within(
        &self,
        budgets: &Budgets,
        estimate: Estimate,
    ) -> Result<Admitted, Response> {
        self.state.forget_refusals_after_reset(&self.live);
        let start = Instant::now();
        let both = self
            .chain
            .admit_within(self.state.store(), budgets, 1)
            .await;
        // One call served both: timed under each op the two calls it stands for would have
        // made. A failure is the read's; the admission after it is counted too where the
        // budgets fail open, as that admission would have been tried (and failed).
        let elapsed = start.elapsed();
        let metrics = self.state.metrics();
        let (read_failed, admitted) = match &both {
            Ok((b, c)) => (!b.enforced, c.as_ref().map(|c| !c.enforced)),
            Err(_) => (
                true,
                self.state.fails_open(LimitKind::Budgets).then_some(true),
            ),
        };
        metrics.store_call(StoreOp::ReadBudgets, elapsed, read_failed);
        if let Some(failed) = admitted {
            metrics.store_call(StoreOp::Admit, elapsed, failed);
        }
        self.state
            .note_breaker(read_failed || admitted == Some(true));
        let decision = match both {
            Ok((_, Some(decision))) => decision,
            Ok((checked, None)) => {
                return Err(self.refuse_budget(budgets, &checked, estimate).await);
            }
            // Budgets fail open on their own (`on_error.budgets`): read as unspent, and then the
            // chain fails as its kinds say.
            Err(floodgate::Error::Unavailable(_))
                if self.state.fails_open(LimitKind::Budgets) && self.chain_fails_open() =>
            {
                ChainDecision::unenforced(floodgate::Timestamp::now())
            }
            Err(e) => return Err(self.answer(e.into(), Decision::StoreError)),
        };
        self.decided(decision, None)
    }

    /// The chain's part of [`admit`](Self::admit): its shadow budgets read, then its rate limits
    /// admitted in one atomic step.
    async fn admit_chain(&self, estimate: Estimate) -> Result<Admitted, Response> {
        if let Some(shadow) = &self.shadow_budgets {
            self.observe_shadow_budgets(shadow).await;
        }
        self.state.forget_refusals_after_reset(&self.live);
        let reserve = self.chain.has_reserved().then(|| estimate.total());
        let decision = match self.timed_admit_costs(1, reserve).await {
            Ok(d) => d,
            // The store fails closed for the kinds that differ (`on_error` by kind): the
            // chain goes through unchecked when every kind of limit it has fails open.
            Err(floodgate::Error::Unavailable(_)) if self.chain_fails_open() => {
                ChainDecision::unenforced(floodgate::Timestamp::now())
            }
            Err(e) => return Err(self.answer(e.into(), Decision::StoreError)),
        };
        if let Some(err) = self.never_fits(&decision, estimate) {
            // A client's mistake, not a refusal: not counted in the tally, charged nothing, and
            // answered with the chain's state, as any request refused before admission is.
            return Err(self.reject(err, Decision::BadRequest).await);
        }
        self.decided(decision, reserve)
    }

    /// The rest of an admission once the chain has decided: the limits counted, a refusal
    /// answered 429, else the admission's slots and reservation kept for the answer.
    #[expect(
        clippy::result_large_err,
        reason = "the error is the answer to send, as from the async admissions that call this"
    )]
    fn decided(&self, decision: ChainDecision, reserve: Option<u64>) -> Result<Admitted, Response> {
        self.count_limits(&decision);
        if !decision.admitted {
            return Err(self.refuse(&decision));
        }
        for i in decision.shadow_over() {
            if let Some(s) = decision.statuses.get(i) {
                tracing::info!(
                    key = %self.key.id,
                    shadow_over = s.scope.as_str(),
                    limit = s.limit.max(),
                    window_sec = s.limit.window().as_secs(),
                    "a shadow limit would have refused this request"
                );
            }
        }
        for s in decision.in_flight.iter().filter(|s| s.shadow && s.over) {
            tracing::info!(
                key = %self.key.id,
                shadow_over = s.scope.as_str(),
                max_in_flight = s.max,
                "a shadow concurrency limit would have refused this request"
            );
        }
        let (log_as, outcome) = if decision.enforced {
            (Decision::Admitted, Outcome::Admitted)
        } else {
            (Decision::Unenforced, Outcome::Unenforced)
        };
        self.state.metrics().request(outcome);
        let charger = self.state.charges();
        let slots = decision
            .lease
            .map(|lease| Slots::new(charger, Arc::clone(&self.chain), lease));
        // Only a decided admission reserved anything (one that failed open charged nothing).
        let reservation = reserve
            .filter(|_| decision.enforced)
            .map(|estimate| Reservation {
                at: decision.now,
                charged_at: decision.charged_at.clone(),
                estimate,
            });
        Ok(Admitted {
            decision,
            log_as,
            slots,
            reservation,
            budget_reservation: None,
        })
    }

    /// The 400 for a request whose token estimate is above a reserving limit itself, so that
    /// no wait would let it through: which limit, and which part of the estimate to lower.
    fn never_fits(&self, decision: &ChainDecision, estimate: Estimate) -> Option<AppError> {
        let r = decision.refusing()?;
        let max = r.limit.max();
        // A limit of 0 is no estimate's fault: refused as a limit of 0 is, with no wait.
        if decision.admitted
            || decision.retry_after.is_some()
            || r.charge != Charge::Reserved
            || max == 0
        {
            return None;
        }
        let window = r.limit.window().as_secs();
        let limit = format!("{} token limit of {max} tokens per {window}s", r.scope);
        Some(AppError::BadRequest(estimate.cannot_fit(&limit, max)))
    }

    /// Reads the shadow budgets (charging nothing): one spent is logged, never refusing.
    async fn observe_shadow_budgets(&self, shadow: &Budgets) {
        let checked = self.timed_check(shadow).await;
        let exceeded = checked.ok().and_then(|d| d.exceeded_by);
        if let Some(b) = exceeded.and_then(|i| shadow.budgets().get(i)) {
            tracing::info!(
                key = %self.key.id,
                shadow_over = b.scope().as_str(),
                budget = %b.period(),
                "a shadow budget would have refused this request"
            );
        }
    }

    /// Whether a store failure lets this request's chain through unchecked: every kind of
    /// enforced limit it has (requests, concurrency counted as requests, tokens) fails open. A
    /// shadow limit never refuses, so it never refuses for want of a store either: a chain of
    /// shadow limits alone goes through, as one with no limits does.
    fn chain_fails_open(&self) -> bool {
        let limits = self.chain.limits().iter().filter(|l| !l.is_shadow());
        let has_tokens = limits.clone().any(|l| l.charge().counts_tokens());
        // Concurrency limits count requests: they fail as request limits do.
        let counts_requests = limits.clone().any(|l| l.charge() == Charge::Admission)
            || self.chain.in_flight().iter().any(|l| !l.is_shadow());
        // A reserving token limit is a token limit: it fails as `on_error.tokens` says.
        (!counts_requests || self.state.fails_open(LimitKind::Requests))
            && (!has_tokens || self.state.fails_open(LimitKind::Tokens))
    }

    /// Counts each limit of a decided chain in the metrics: over (it refused), near (80% used
    /// or more after the request's charge) or within.
    fn count_limits(&self, decision: &ChainDecision) {
        let metrics = self.state.metrics();
        let refusing = decision.refused_by;
        for (i, s) in decision.statuses.iter().enumerate() {
            let max = s.limit.max();
            let outcome = if s.shadow && s.over {
                LimitOutcome::ShadowOver
            } else if refusing == Some(i) {
                LimitOutcome::Over
            } else if max == 0 || s.remaining.saturating_mul(5) <= max {
                LimitOutcome::Near
            } else {
                LimitOutcome::Within
            };
            let tokens = s.charge.counts_tokens();
            metrics.limit(s.scope, tokens, outcome);
        }
        // The refusing one is the first enforced full one, when no rate limit refused.
        let mut refusing = decision.refused_in_flight().is_some();
        for s in &decision.in_flight {
            let outcome = if s.shadow && s.over {
                LimitOutcome::ShadowOver
            } else if refusing && s.over {
                refusing = false;
                LimitOutcome::Over
            } else if s.remaining().saturating_mul(5) <= s.max {
                LimitOutcome::Near
            } else {
                LimitOutcome::Within
            };
            metrics.in_flight_limit(s.scope, outcome);
        }
    }

    /// The 429 for a request the chain refused, with the refusing limit's headers; counted in
    /// the refusal tally.
    fn refuse(&self, decision: &ChainDecision) -> Response {
        let (err, log_as) = match (decision.refusing(), decision.refused_in_flight()) {
            (None, Some(r)) => {
                self.count_refusal(r.scope);
                let err = AppError::ConcurrencyLimited {
                    scope: r.scope,
                    max: r.max,
                };
                (err, Decision::InFlight(r.scope))
            }
            (Some(r), _) => {
                self.count_refusal(r.scope);
                let err = AppError::RateLimited {
                    scope: r.scope,
                    charge: r.charge,
                    limit: r.limit,
                    retry_after: decision.retry_after,
                };
                (err, Decision::Refused(r.scope))
            }
            (None, None) => {
                let err = AppError::Internal("refused without a refusing limit".into());
                (err, Decision::RefusedUnnamed)
            }
        };
        let own_wait = err.retry_after();
        let mut resp = self.answer(err, log_as);
        headers::apply(resp.headers_mut(), decision, &self.fixed);
        headers::apply_in_flight(resp.headers_mut(), decision);
        if let Some(wait) = own_wait {
            // A concurrency refusal: no rate limit refused, so no limit's wait was set.
            headers::apply_retry_after(resp.headers_mut(), wait);
        }
        resp
    }

    /// The 429 for a request refused by a spent budget: `insufficient_quota`, with
    /// `Retry-After` until the budget's period ends and the chain's rate-limit state when it
    /// could be read. Counted in the refusal tally like a rate-limit refusal.
    async fn refuse_budget(
        &self,
        budgets: &Budgets,
        decision: &BudgetDecision,
        estimate: Estimate,
    ) -> Response {
        let Some(b) = decision.exceeded_by.and_then(|i| budgets.budgets().get(i)) else {
            let err = AppError::Internal("refused without an exceeded budget".into());
            return self.answer(err, Decision::RefusedUnnamed);
        };
        // The request passes once its budgets' periods have ended and its rate limits have room
        // for it: `Retry-After` is the later of the two (a window of a day can outlast the day's
        // budget), so that a client pacing on it is not refused again. A budget with a cap of 0,
        // or a rate limit the request can never pass (`requests = 0`, an estimate above a
        // reserving limit), lets nothing through, ever: no wait is announced, as for a limit of
        // 0 alone.
        let rates = self.rates().await;
        let wait = match (decision.retry_after, &rates) {
            (Some(budget_wait), Some(rates)) => self
                .window_wait(rates, budget_wait, estimate)
                .await
                .ok_or(NoWait::RateLimit),
            (Some(budget_wait), None) => Ok(budget_wait),
            (None, _) => Err(budgets
                .budgets()
                .iter()
                .find(|b| b.cap() == 0)
                .map_or(NoWait::RateLimit, |z| {
                    NoWait::ZeroCap(z.scope(), z.period())
                })),
        };
        // The wait is until every exceeded budget's period ends: when another one's ends after
        // the named one's, the message says which kind it is, or "retry after 23 days" under a
        // "daily cap" would read as a mistake.
        let later = decision
            .waits_for
            .filter(|&i| Some(i) != decision.exceeded_by)
            .and_then(|i| budgets.budgets().get(i))
            .map(|other| (other.scope(), other.period()));
        let err = AppError::BudgetExceeded {
            scope: b.scope(),
            period: b.period(),
            later,
            retry_after: wait,
        };
        self.count_refusal(b.scope());
        let mut resp = self.answer(err, Decision::Budget(b.scope()));
        let h = resp.headers_mut();
        if let Some(rates) = &rates {
            // The state only: a wait the read itself was refused with is not this answer's.
            headers::apply(h, rates, &self.fixed);
            h.remove(axum::http::header::RETRY_AFTER);
            h.remove("retry-after-ms");
        }
        if let Ok(wait) = wait {
            headers::apply_retry_after(h, wait);
        }
        resp
    }

    /// How long a request of this one's costs (1 a request limit, `estimate` a reserving token
    /// limit) waits on its chain's enforced rate limits with no other traffic, where that can be
    /// longer than `floor`; `floor` where it cannot, or the store cannot say; `None` when it can
    /// never pass (a limit of 0, a cost above a limit's max). `rates`, the
    /// chain's state at cost 0, bounds each limit's wait by its reset (the time its window
    /// takes to empty) unless that read refused it: only a limit short of room whose reset is
    /// past `floor`, or one over its max, is worth an exact answer, read from the windows without charging (one store call, in a budget refusal
    /// whose period ends before such a window frees: a day's window, or a few seconds before
    /// midnight).
    async fn window_wait(
        &self,
        rates: &ChainDecision,
        floor: Duration,
        estimate: Estimate,
    ) -> Option<Duration> {
        let cost_of = |charge: Charge| match charge {
            Charge::Reserved => estimate.total(),
            Charge::Admission | Charge::Reactive => 1,
        };
        let limits = self.chain.limits();
        if limits.iter().any(|l| !l.fits(cost_of(l.charge()))) {
            return None;
        }
        let may_outlast = rates.statuses.iter().any(|st| {
            // A limit the cost-0 read itself refused (over its max: a reservation's overshoot,
            // a lowered limit) has that read's wait as its reset, which a larger cost
            // outlasts: it is no bound.
            !st.shadow && (st.over || st.remaining < cost_of(st.charge) && st.reset > floor)
        });
        if !may_outlast {
            return Some(floor);
        }
        let start = Instant::now();
        let seen = self.state.store().read_state(limits, &[], None).await;
        // Timed as the admission of cost 0 it stands beside.
        let metrics = self.state.metrics();
        metrics.store_call(StoreOp::Admit, start.elapsed(), seen.is_err());
        let Ok(seen) = seen else {
            return Some(floor);
        };
        let mut wait = floor;
        for (l, s) in limits.iter().zip(&seen.snapshots) {
            let cost = cost_of(l.charge());
            if l.refuses(s, cost) {
                // A limit that refuses with no time to wait never lets the request through.
                wait = wait.max(s.retry_after(l.limit(), l.charge(), cost)?);
            }
        }
        Some(wait)
    }

    /// The answer to an admitted request that the upstream could not answer (502, 504, ...):
    /// logged, with the chain's headers. The request stays charged. Its concurrency slots are
    /// held until that answer is sent, as for any answer (docs/design.md §10).
    pub(super) fn upstream_failed(&self, admitted: &mut Admitted, err: AppError) -> Response {
        self.log(err.status(), admitted.log_as);
        let mut resp = err.into_response();
        admitted.apply_headers(resp.headers_mut(), self);
        match admitted.take_slots() {
            Some(slots) => resp.map(|body| Body::new(HoldingBody::new(body, slots))),
            None => resp,
        }
    }
}

impl Admitted {
    /// Sets the chain's rate-limit headers on an answer to the admitted request.
    pub(super) fn apply_headers(&self, headers: &mut HeaderMap, ctx: &Ctx) {
        headers::apply(headers, &self.decision, &ctx.fixed);
        headers::apply_in_flight(headers, &self.decision);
    }

    /// The request's concurrency slots, to hold for as long as its answer is sent (a body, a
    /// realtime session); `None` when its chain has none, or once taken.
    pub(super) fn take_slots(&mut self) -> Option<Slots> {
        self.slots.take()
    }
}

/// How the metrics count an answer logged as `decision`.
fn outcome_of(decision: Decision) -> Outcome {
    match decision {
        Decision::Admitted => Outcome::Admitted,
        Decision::Unenforced => Outcome::Unenforced,
        Decision::Refused(scope) | Decision::InFlight(scope) => Outcome::Refused(scope),
        Decision::Budget(scope) => Outcome::Budget(scope),
        // The process's own cap refused: a refusal of the gateway, as the tally counts it.
        Decision::TooManyConnections => Outcome::Refused(ScopeKind::Gateway),
        Decision::Unauthenticated
        | Decision::RefusedUnnamed
        | Decision::BadRequest
        | Decision::UpgradeUnsupported
        | Decision::TransferCodingUnsupported
        | Decision::BodyEncodingUnsupported
        | Decision::BodyTooLarge
        | Decision::BodyTimeout
        | Decision::StoreError
        | Decision::ServerBusy => Outcome::Rejected,
    }
}

/// How the metrics count an answer logged as `decision`, for the pipeline's other phases.
pub(super) fn count(state: &AppState, decision: Decision) {
    state.metrics().request(outcome_of(decision));
}

/// The 400 for a request whose estimate's `price` (micro-USD) is above an enforced budget's cap
/// itself, so that no period's end would let it through: the budget (its scope's kind and
/// period, never its id) and what to lower. The budget named is the smallest one it exceeds.
fn budget_never_fits(budgets: &Budgets, price: u64, estimate: Estimate) -> Option<AppError> {
    let b = budgets
        .budgets()
        .iter()
        .filter(|b| price > b.cap())
        .min_by_key(|b| b.cap())?;
    let Estimate {
        prompt,
        output,
        named_cap,
        choices,
    } = estimate;
    let caps = "`max_tokens` (`max_completion_tokens`, `max_output_tokens`)";
    let n = if choices > 1 { " or `n`" } else { "" };
    let assumed = if named_cap {
        String::new()
    } else {
        let each = if choices > 1 { " for each choice" } else { "" };
        format!(
            " (the request names no cap, so the gateway's default of {} is assumed{each})",
            output / choices.max(1)
        )
    };
    Some(AppError::BadRequest(format!(
        "This request can never fit the {}'s {} budget of {}: it reserves the price of its \
         estimate, {} for up to {} tokens ({prompt} for the prompt, bounded by its length in \
         bytes, plus {output} of output). To fit, lower {caps}{n}{assumed}, or send a shorter \
         prompt.",
        b.scope(),
        crate::error::adjective(b.period()),
        usd(b.cap()),
        usd(price),
        estimate.total(),
    )))
}
