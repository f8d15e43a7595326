//! The admin API's answers (docs/gateway.md, "The admin API"): usage, reset, alerts, config.
//! Each reads the config in force ([`Process::running`]) and the store; none shows a secret.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use floodgate::store::{StateObservation, Store};
use floodgate::window::Snapshot;
use floodgate::{Budget, ChainLimit, InFlightLimit, PeriodCounter, ScopeKind, Timestamp};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::scopes::{Catalogue, Scope};
use crate::http::Process;
use crate::store::GatewayStore;
use crate::tally::Alert;

/// Scopes per usage page when the call names no `limit`.
pub const DEFAULT_PAGE: usize = 100;
/// The most scopes one usage page holds.
pub const MAX_PAGE: usize = 1000;

/// Days of each subject's chart on a page of alerts, up to the newest day listed.
pub const CHART_DAYS: usize = 14;

/// A failure of an admin call: a client's mistake with its status and message, or the store
/// (503, its cause logged, never echoed).
#[derive(Debug)]
pub enum ApiError {
    /// 400 with why.
    BadRequest(String),
    /// 404: no such scope in the config in force.
    NoScope {
        /// The kind asked for.
        kind: ScopeKind,
        /// The id asked for.
        id: String,
    },
    /// 503: the store or the tally could not be read; the cause is logged.
    Unavailable(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            ApiError::BadRequest(why) => (StatusCode::BAD_REQUEST, why),
            ApiError::NoScope { kind, id } => (
                StatusCode::NOT_FOUND,
                format!("the config in force has no {kind} `{id}`"),
            ),
            ApiError::Unavailable(cause) => {
                tracing::warn!(error = %cause, "admin API: the store or the tally cannot be read");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the store or the refusal tally cannot be read now".to_owned(),
                )
            }
        };
        (status, Json(json!({ "error": { "message": message } }))).into_response()
    }
}

impl From<floodgate::Error> for ApiError {
    fn from(e: floodgate::Error) -> ApiError {
        ApiError::Unavailable(e.to_string())
    }
}

/// The query of `GET /admin/usage`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    /// Only scopes of this kind (`key`, `team`, ...).
    pub scope: Option<String>,
    /// Only the scope with this id (with `scope`: one scope).
    pub id: Option<String>,
    /// Only scopes whose id contains this text (case-insensitive): the console's search.
    pub q: Option<String>,
    /// Scopes per page: [`DEFAULT_PAGE`] by default, at most [`MAX_PAGE`].
    pub limit: Option<usize>,
    /// Where the page starts: the `next_cursor` of the page before.
    pub cursor: Option<String>,
}

/// One limit's state, as `GET /admin/usage` shows it.
#[derive(Debug, Serialize)]
pub struct LimitUsage {
    /// `requests` or `tokens`.
    pub kind: &'static str,
    /// The limit's units per window.
    pub limit: u64,
    /// The window, in seconds.
    pub window_sec: u64,
    /// The sliding-window estimate now (docs/design.md §1), to a thousandth.
    pub used: f64,
    /// Whole units left now.
    pub remaining: u64,
    /// Seconds until the window is whole again with no more traffic (rounded up).
    pub reset_sec: u64,
    /// A shadow limit: counted, never refusing.
    pub shadow: bool,
}

/// One budget's state, as `GET /admin/usage` shows it.
#[derive(Debug, Serialize)]
pub struct BudgetUsage {
    /// `day` or `month` (UTC).
    pub period: &'static str,
    /// The cap, in USD.
    pub cap_usd: f64,
    /// Spent in the current period, in USD.
    pub spent_usd: f64,
    /// Left in the current period, in USD (0 once the cap is reached).
    pub remaining_usd: f64,
    /// When the current period ends (RFC 3339, UTC).
    pub period_end: String,
    /// A shadow budget: counted, never refusing.
    pub shadow: bool,
}

/// Requests of a scope running now against its concurrency limit (`max_in_flight`): live slots,
/// across every replica on Redis.
#[derive(Debug, Serialize)]
pub struct InFlight {
    /// Requests in flight now.
    pub current: u64,
    /// The cap.
    pub max: u64,
}

/// One scope's state.
#[derive(Debug, Serialize)]
pub struct ScopeUsage {
    /// The kind.
    pub scope: &'static str,
    /// The id.
    pub id: String,
    /// The hash tag its state is stored under (a team of two orgs is listed once per org).
    pub tenant: String,
    /// Each limit.
    pub limits: Vec<LimitUsage>,
    /// Each budget.
    pub budgets: Vec<BudgetUsage>,
    /// Requests running against the scope's concurrency limit; `null` for a scope without one
    /// (and, in a reset's answer, when the store could not read them after the reset).
    pub in_flight: Option<InFlight>,
}

/// A page of `GET /admin/usage`.
#[derive(Debug, Serialize)]
pub struct Usage {
    /// The instant every figure is at (RFC 3339, UTC; the store's clock).
    pub now: String,
    /// `memory` or `redis`.
    pub store: &'static str,
    /// Scopes matching the filter, over every page.
    pub total: usize,
    /// This page.
    pub scopes: Vec<ScopeUsage>,
    /// The `cursor` of the next page; `null` on the last.
    pub next_cursor: Option<String>,
}

/// Rounds to a thousandth, for estimates and USD.
fn thousandths(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn usd(micros: u64) -> f64 {
    micros as f64 / 1_000_000.0
}

fn rfc3339(t: Timestamp) -> String {
    let micros = i64::try_from(t.as_micros()).unwrap_or(i64::MAX);
    chrono::DateTime::from_timestamp_micros(micros)
        .map(|d| d.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

fn limit_usage(l: &ChainLimit, s: &Snapshot) -> LimitUsage {
    let limit = l.limit();
    LimitUsage {
        kind: if l.charge().counts_tokens() {
            "tokens"
        } else {
            "requests"
        },
        limit: limit.max(),
        window_sec: limit.window().as_secs(),
        used: thousandths(s.estimate(limit)),
        remaining: s.remaining(limit, 0),
        reset_sec: ceil_secs(s.until_empty(limit, 0)),
        shadow: l.is_shadow(),
    }
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_micros()
        .div_ceil(1_000_000)
        .try_into()
        .unwrap_or(u64::MAX)
}

fn budget_usage(b: &Budget, shadow: bool, spent: u64, now: Timestamp) -> BudgetUsage {
    BudgetUsage {
        period: b.period().as_str(),
        cap_usd: usd(b.cap()),
        spent_usd: usd(spent),
        remaining_usd: usd(b.cap().saturating_sub(spent)),
        period_end: rfc3339(b.period().bounds(now).1),
        shadow,
    }
}

/// Every limit and budget counter of `scopes`, in order, for one store call.
fn state_of<'a>(
    scopes: impl Iterator<Item = &'a Scope> + Clone,
) -> (Vec<ChainLimit>, Vec<PeriodCounter>) {
    let limits = scopes
        .clone()
        .flat_map(|s| s.limits.iter().cloned())
        .collect();
    let counters = scopes
        .flat_map(|s| s.budgets.iter().map(|(b, _)| b.counter().clone()))
        .collect();
    (limits, counters)
}

/// Each of `scopes` with its share of `seen` (read for [`state_of`] of them, in order) and of
/// `running` (one count per scope with a concurrency limit, in order).
fn usage_of<'a>(
    scopes: impl Iterator<Item = &'a Scope>,
    seen: &StateObservation,
    running: Option<&[u64]>,
) -> Vec<ScopeUsage> {
    let mut snapshots = seen.snapshots.iter();
    let mut totals = seen.totals.iter();
    let mut running = running.map(<[u64]>::iter);
    scopes
        .map(|s| ScopeUsage {
            scope: s.kind.as_str(),
            id: s.id.clone(),
            tenant: s.tenant.clone(),
            limits: s
                .limits
                .iter()
                .zip(snapshots.by_ref())
                .map(|(l, snap)| limit_usage(l, snap))
                .collect(),
            budgets: s
                .budgets
                .iter()
                .zip(totals.by_ref())
                .map(|((b, shadow), spent)| budget_usage(b, *shadow, *spent, seen.now))
                .collect(),
            in_flight: s.in_flight.as_ref().and_then(|l| {
                Some(InFlight {
                    current: running.as_mut()?.next().copied().unwrap_or(0),
                    max: l.max(),
                })
            }),
        })
        .collect()
}

/// The concurrency limits of `scopes`, in order, for one store call.
fn slots_of<'a>(scopes: impl Iterator<Item = &'a Scope>) -> Vec<InFlightLimit> {
    scopes.filter_map(|s| s.in_flight.clone()).collect()
}

/// The part of a list of `len` that a page of `limit` (default [`DEFAULT_PAGE`], at most
/// [`MAX_PAGE`]) from `cursor` (an offset this API gave as a `next_cursor`; none: the start)
/// holds.
fn page_of(
    len: usize,
    limit: Option<usize>,
    cursor: Option<&str>,
) -> Result<Range<usize>, ApiError> {
    let per_page = limit.unwrap_or(DEFAULT_PAGE);
    if per_page == 0 || per_page > MAX_PAGE {
        return Err(ApiError::BadRequest(format!(
            "`limit` must be 1 to {MAX_PAGE}"
        )));
    }
    let start = match cursor {
        None | Some("") => 0,
        Some(c) => c
            .parse::<usize>()
            .ok()
            .filter(|&at| at <= len)
            .ok_or_else(|| {
                ApiError::BadRequest(format!("`cursor` {c} is not one this API gave"))
            })?,
    };
    Ok(start..(start + per_page).min(len))
}

fn parse_kind(name: &str) -> Result<ScopeKind, ApiError> {
    ScopeKind::parse(name).ok_or_else(|| {
        ApiError::BadRequest(format!(
            "unknown scope `{name}`: one of key, project, team, business_unit, org, customer, gateway"
        ))
    })
}

/// `GET /admin/usage`: a page of scopes, filtered, with every limit and budget read in one
/// store call (on Redis a script per thousand keys), charging nothing.
pub async fn usage(
    catalogue: &Catalogue,
    store: &GatewayStore,
    query: UsageQuery,
) -> Result<Usage, ApiError> {
    let kind = query.scope.as_deref().map(parse_kind).transpose()?;
    let needle = query.q.as_deref().map(str::to_lowercase);
    let matching: Vec<&Scope> = catalogue
        .scopes()
        .iter()
        .filter(|s| kind.is_none_or(|k| s.kind == k))
        .filter(|s| query.id.as_deref().is_none_or(|id| s.id == id))
        .filter(|s| {
            needle
                .as_deref()
                .is_none_or(|n| s.id.to_lowercase().contains(n))
        })
        .collect();
    if let (Some(kind), Some(id), true) = (kind, &query.id, matching.is_empty()) {
        return Err(ApiError::NoScope {
            kind,
            id: id.clone(),
        });
    }
    let range = page_of(matching.len(), query.limit, query.cursor.as_deref())?;
    let end = range.end;
    let page = &matching[range];
    let (limits, counters) = state_of(page.iter().copied());
    let seen = store.read_state(&limits, &counters, None).await?;
    let slots = slots_of(page.iter().copied());
    let running = store.read_running(&slots, Some(seen.now)).await?;
    Ok(Usage {
        now: rfc3339(seen.now),
        store: crate::store::name(store),
        total: matching.len(),
        scopes: usage_of(page.iter().copied(), &seen, Some(&running)),
        next_cursor: (end < matching.len()).then(|| end.to_string()),
    })
}

/// The body of `POST /admin/reset`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResetRequest {
    /// The kind (`key`, `team`, ...).
    pub scope: String,
    /// The id.
    pub id: String,
    /// Whether the current period's budget spend is cleared too.
    #[serde(default)]
    pub budgets: bool,
}

/// What `POST /admin/reset` cleared: each tenant's entry of the scope, with what its limits
/// and (with `budgets`) its budgets held just before.
#[derive(Debug, Serialize)]
pub struct Reset {
    /// The instant of the reset (RFC 3339, UTC).
    pub now: String,
    /// What was cleared, as a usage page shows it, before the reset.
    pub cleared: Vec<ScopeUsage>,
}

/// `POST /admin/reset`: clears the windows (and, with `budgets`, the current period's spend) of
/// every tenant's entry of one scope.
pub async fn reset(
    catalogue: &Catalogue,
    store: &GatewayStore,
    request: &ResetRequest,
) -> Result<Reset, ApiError> {
    let kind = parse_kind(&request.scope)?;
    let found: Vec<&Scope> = catalogue.find(kind, &request.id).collect();
    if found.is_empty() {
        return Err(ApiError::NoScope {
            kind,
            id: request.id.clone(),
        });
    }
    let (limits, mut counters) = state_of(found.iter().copied());
    if !request.budgets {
        counters.clear();
    }
    let seen = store.clear_state(&limits, &counters, None).await?;
    // A reset clears windows and spend, never the slots of requests still running: those are
    // shown as they are.
    let slots = slots_of(found.iter().copied());
    // Read after the clear has landed: a read that fails then must not answer the reset as
    // failed (it was made, and is logged as made); the slots are shown as unknown (`null`).
    let running = store.read_running(&slots, Some(seen.now)).await.ok();
    // Without `budgets` no counter was read: each scope's budgets list is empty.
    Ok(Reset {
        now: rfc3339(seen.now),
        cleared: usage_of(found.iter().copied(), &seen, running.as_deref()),
    })
}

/// The query of `GET /admin/alerts`: with neither, every alert, as `GET /alerts` answers.
#[derive(Debug, Default)]
pub struct AlertsQuery {
    /// Alerts per page: [`DEFAULT_PAGE`] by default, at most [`MAX_PAGE`].
    pub limit: Option<usize>,
    /// Where the page starts: the `next_cursor` of the page before.
    pub cursor: Option<String>,
}

/// A page of `GET /admin/alerts`.
#[derive(Debug, Serialize)]
pub struct AlertsPage {
    /// This page's alerts, in the order of the whole list (newest day first, then most
    /// refusals first).
    pub alerts: Vec<Alert>,
    /// Alerts over every page.
    pub total: usize,
    /// The `cursor` of the next page; `null` on the last.
    pub next_cursor: Option<String>,
    /// The refusals of each subject of this page over the last [`CHART_DAYS`] days.
    pub chart: Chart,
}

/// The refusals of some subjects, day by day.
#[derive(Debug, Serialize)]
pub struct Chart {
    /// The [`CHART_DAYS`] days up to the newest day with an alert (of any page), oldest first;
    /// empty when there is no alert.
    pub days: Vec<String>,
    /// Each subject (`gateway`, `key:<id>`): its refusals on each of `days`.
    pub subjects: BTreeMap<String, Vec<u64>>,
}

/// `GET /admin/alerts`: the refusal tally's `rate_limit` alerts. Without `query`, all of them,
/// as `GET /alerts` answers them; with it, one page and its subjects' charts.
pub async fn alerts(process: &Process, query: Option<AlertsQuery>) -> Response {
    let all = match process.tally.alerts().await {
        Ok(all) => all,
        Err(e) => return ApiError::Unavailable(e).into_response(),
    };
    let Some(query) = query else {
        return Json(json!({ "alerts": all })).into_response();
    };
    match alerts_page(all, &query) {
        Ok(page) => Json(page).into_response(),
        Err(e) => e.into_response(),
    }
}

/// One page of `all` (as [`crate::tally::Tally::alerts`] orders them) and its chart.
fn alerts_page(mut all: Vec<Alert>, query: &AlertsQuery) -> Result<AlertsPage, ApiError> {
    let total = all.len();
    let range = page_of(total, query.limit, query.cursor.as_deref())?;
    let next_cursor = (range.end < total).then(|| range.end.to_string());
    let chart = chart(&all, &all[range.clone()]);
    let alerts = all.drain(range).collect();
    Ok(AlertsPage {
        alerts,
        total,
        next_cursor,
        chart,
    })
}

/// The chart of `page`'s subjects, read from `all` in one pass, whatever the
/// number of subjects (with 10 000 keys refused, a rescan per alert would be 10^8 steps).
fn chart(all: &[Alert], page: &[Alert]) -> Chart {
    let newest = all
        .first()
        .and_then(|a| a.day.parse::<chrono::NaiveDate>().ok());
    let days: Vec<String> = newest
        .map(|last| {
            (0..CHART_DAYS as u64)
                .rev()
                .filter_map(|back| last.checked_sub_days(chrono::Days::new(back)))
                .map(|d| d.to_string())
                .collect()
        })
        .unwrap_or_default();
    let day_at: HashMap<&str, usize> = days
        .iter()
        .enumerate()
        .map(|(i, d)| (d.as_str(), i))
        .collect();
    let mut series: HashMap<(&str, Option<&str>), Vec<u64>> = page
        .iter()
        .map(|a| ((a.subject, a.key.as_deref()), vec![0; days.len()]))
        .collect();
    for a in all {
        if let (Some(&at), Some(counts)) = (
            day_at.get(a.day.as_str()),
            series.get_mut(&(a.subject, a.key.as_deref())),
        ) {
            counts[at] = a.count;
        }
    }
    let subjects = series
        .into_iter()
        .map(|((subject, key), counts)| match key {
            Some(id) => (format!("{subject}:{id}"), counts),
            None => (subject.to_owned(), counts),
        })
        .collect();
    Chart { days, subjects }
}

/// `GET /admin/config`: the config in force as `floodgate check-config` prints it (no secret).
pub fn config(process: &Process) -> Response {
    let running: Arc<crate::config::Config> = process.running();
    let mut text = Vec::new();
    match crate::report::write(&mut text, &running.path, &running) {
        Ok(()) => ([(CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response(),
        Err(e) => ApiError::Unavailable(e.to_string()).into_response(),
    }
}
