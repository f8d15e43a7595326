//! Prometheus metrics (`GET /metrics` on the admin listener), one registry per process.
//!
//! Cheap on the hot path: every series of every family is created at start, for every value
//! its labels can take (scope kinds, decisions, store operations: all bounded enums, never a
//! key's or a tenant's id), and kept in arrays; a request then costs atomic increments, no lock
//! and no allocation. The histograms are this module's own ([`Histogram`]), lock-free too: the
//! client's histogram takes a lock for each observation.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use floodgate::ScopeKind;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// How a decided request ended, as `floodgate_requests_total` labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Admitted by every limit and budget.
    Admitted,
    /// Refused by a rate limit (or a concurrency cap) of a scope.
    Refused(ScopeKind),
    /// Refused by a spent budget of a scope.
    Budget(ScopeKind),
    /// Let through unchecked: the store could not decide and fails open.
    Unenforced,
    /// Rejected before a limit decided (unauthenticated, a bad request, a body refused, a store
    /// failing closed).
    Rejected,
}

/// A limit's state after a decided chain, as `floodgate_limit_decisions_total` labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitOutcome {
    /// Under 80% used.
    Within,
    /// 80% used or more, and not over.
    Near,
    /// It refused the request.
    Over,
    /// A shadow limit that would have refused it.
    ShadowOver,
}

/// A store call, as `floodgate_store_duration_seconds` and `floodgate_store_errors_total` label
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreOp {
    /// A chain admission (rate-limit state read at a cost of 0 included).
    Admit,
    /// Tokens charged to a chain's token limits.
    Record,
    /// A token reservation reconciled with the usage (docs/design.md, "Token reservation").
    Reconcile,
    /// Budgets read.
    ReadBudgets,
    /// Spend added to budgets.
    Spend,
    /// A readiness probe.
    Ping,
}

const STORE_OPS: [StoreOp; 6] = [
    StoreOp::Admit,
    StoreOp::Record,
    StoreOp::Reconcile,
    StoreOp::ReadBudgets,
    StoreOp::Spend,
    StoreOp::Ping,
];

impl StoreOp {
    fn name(self) -> &'static str {
        match self {
            StoreOp::Admit => "admit",
            StoreOp::Record => "record",
            StoreOp::Reconcile => "reconcile",
            StoreOp::ReadBudgets => "read_budgets",
            StoreOp::Spend => "spend",
            StoreOp::Ping => "ping",
        }
    }
}

const OUTCOMES: [&str; 5] = ["admitted", "refused", "budget", "unenforced", "rejected"];
const LIMIT_OUTCOMES: [&str; 4] = ["within", "near", "over", "shadow_over"];
const KINDS: [&str; 3] = ["requests", "tokens", "in_flight"];
const STATUS_CLASSES: [&str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "error"];

/// Store calls: 50 µs to 1 s.
pub(crate) const STORE_BUCKETS: [f64; 14] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];
/// Upstream answers to their headers: 1 ms to 60 s (a reasoning model's first byte).
const UPSTREAM_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 60.0,
];

fn scope_index(scope: ScopeKind) -> usize {
    ScopeKind::ALL.iter().position(|&s| s == scope).unwrap_or(0)
}

/// The process's metrics: a cheap clone; every clone counts into the same series.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

struct Inner {
    registry: Registry,
    /// `[outcome][scope + 1]`: index 0 is `scope="none"`.
    requests: Vec<Vec<Counter>>,
    /// `[scope][kind][outcome]`.
    limits: Vec<Vec<Vec<Counter>>>,
    tokens_input: Counter,
    tokens_output: Counter,
    spend_usd: Counter<f64, AtomicU64>,
    store_duration: Vec<Histogram>,
    store_errors: Vec<Counter>,
    breaker_open: Gauge,
    upstream_duration: Vec<Histogram>,
    realtime_sessions: Gauge,
    reloads_ok: Counter,
    reloads_error: Counter,
    last_reload: Gauge<f64, AtomicU64>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    /// Every series at zero; the config counts as loaded now.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests_family = Family::<[(&'static str, &'static str); 2], Counter>::default();
        let requests = OUTCOMES
            .iter()
            .map(|&decision| {
                std::iter::once("none")
                    .chain(ScopeKind::ALL.iter().map(|s| s.as_str()))
                    .map(|scope| {
                        requests_family
                            .get_or_create(&[("decision", decision), ("scope", scope)])
                            .clone()
                    })
                    .collect()
            })
            .collect();
        registry.register(
            "floodgate_requests",
            "Requests answered, by decision and the refusing scope kind",
            requests_family,
        );
        let limits_family = Family::<[(&'static str, &'static str); 3], Counter>::default();
        let limits = ScopeKind::ALL
            .iter()
            .map(|scope| {
                KINDS
                    .iter()
                    .map(|&kind| {
                        LIMIT_OUTCOMES
                            .iter()
                            .map(|&outcome| {
                                let labels = [
                                    ("scope", scope.as_str()),
                                    ("kind", kind),
                                    ("outcome", outcome),
                                ];
                                limits_family.get_or_create(&labels).clone()
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        registry.register(
            "floodgate_limit_decisions",
            "Limits of decided chains, by scope kind, what they count and how full they were",
            limits_family,
        );
        let tokens_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let tokens_input = tokens_family
            .get_or_create(&[("direction", "input")])
            .clone();
        let tokens_output = tokens_family
            .get_or_create(&[("direction", "output")])
            .clone();
        registry.register(
            "floodgate_tokens",
            "Tokens metered from responses",
            tokens_family,
        );
        let spend_usd = Counter::<f64, AtomicU64>::default();
        registry.register(
            "floodgate_spend_usd",
            "Spend priced from metered responses, in USD",
            spend_usd.clone(),
        );
        let store_duration_family = Family::<
            [(&'static str, &'static str); 1],
            Histogram,
            fn() -> Histogram,
        >::new_with_constructor(|| {
            Histogram::new(&STORE_BUCKETS)
        });
        let store_errors_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let store_duration = STORE_OPS
            .iter()
            .map(|op| {
                store_duration_family
                    .get_or_create(&[("op", op.name())])
                    .clone()
            })
            .collect();
        let store_errors = STORE_OPS
            .iter()
            .map(|op| {
                store_errors_family
                    .get_or_create(&[("op", op.name())])
                    .clone()
            })
            .collect();
        registry.register(
            "floodgate_store_duration_seconds",
            "Store calls, by operation",
            store_duration_family,
        );
        registry.register(
            "floodgate_store_errors",
            "Store calls that failed (or were let through unchecked), by operation",
            store_errors_family,
        );
        let breaker_open = Gauge::default();
        registry.register(
            "floodgate_store_breaker_open",
            "Workers whose store circuit breaker is open (Redis unreachable, being probed)",
            breaker_open.clone(),
        );
        let upstream_family = Family::<
            [(&'static str, &'static str); 1],
            Histogram,
            fn() -> Histogram,
        >::new_with_constructor(|| Histogram::new(&UPSTREAM_BUCKETS));
        let upstream_duration = STATUS_CLASSES
            .iter()
            .map(|&class| {
                upstream_family
                    .get_or_create(&[("status_class", class)])
                    .clone()
            })
            .collect();
        registry.register(
            "floodgate_upstream_duration_seconds",
            "Upstream answers, from the request's forwarding to the answer's headers, by status class",
            upstream_family,
        );
        let realtime_sessions = Gauge::default();
        registry.register(
            "floodgate_realtime_sessions",
            "Live realtime sessions of the process",
            realtime_sessions.clone(),
        );
        let reloads_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let reloads_ok = reloads_family.get_or_create(&[("result", "ok")]).clone();
        let reloads_error = reloads_family.get_or_create(&[("result", "error")]).clone();
        registry.register(
            "floodgate_config_reloads",
            "Config reloads tried, by result",
            reloads_family,
        );
        let last_reload = Gauge::<f64, AtomicU64>::default();
        last_reload.set(unix_now());
        registry.register(
            "floodgate_config_last_reload_success_timestamp_seconds",
            "When the running config was loaded, in seconds since the Unix epoch",
            last_reload.clone(),
        );
        Metrics(Arc::new(Inner {
            registry,
            requests,
            limits,
            tokens_input,
            tokens_output,
            spend_usd,
            store_duration,
            store_errors,
            breaker_open,
            upstream_duration,
            realtime_sessions,
            reloads_ok,
            reloads_error,
            last_reload,
        }))
    }

    /// Counts an answered request.
    pub fn request(&self, outcome: Outcome) {
        let (row, scope) = match outcome {
            Outcome::Admitted => (0, 0),
            Outcome::Refused(s) => (1, scope_index(s) + 1),
            Outcome::Budget(s) => (2, scope_index(s) + 1),
            Outcome::Unenforced => (3, 0),
            Outcome::Rejected => (4, 0),
        };
        self.0.requests[row][scope].inc();
    }

    /// Counts one limit of a decided chain.
    pub fn limit(&self, scope: ScopeKind, tokens: bool, outcome: LimitOutcome) {
        let o = match outcome {
            LimitOutcome::Within => 0,
            LimitOutcome::Near => 1,
            LimitOutcome::Over => 2,
            LimitOutcome::ShadowOver => 3,
        };
        self.0.limits[scope_index(scope)][usize::from(tokens)][o].inc();
    }

    /// Counts one concurrency limit of a decided chain (`kind="in_flight"`).
    pub fn in_flight_limit(&self, scope: ScopeKind, outcome: LimitOutcome) {
        let o = match outcome {
            LimitOutcome::Within => 0,
            LimitOutcome::Near => 1,
            LimitOutcome::Over => 2,
            LimitOutcome::ShadowOver => 3,
        };
        self.0.limits[scope_index(scope)][2][o].inc();
    }

    /// Counts metered tokens.
    pub fn tokens(&self, input: u64, output: u64) {
        self.0.tokens_input.inc_by(input);
        self.0.tokens_output.inc_by(output);
    }

    /// Counts priced spend, in micro-USD.
    pub fn spend(&self, micro_usd: u64) {
        if micro_usd > 0 {
            self.0.spend_usd.inc_by(micro_usd as f64 / 1e6);
        }
    }

    /// Times a store call; `failed` if it failed or was let through unchecked.
    pub fn store_call(&self, op: StoreOp, took: Duration, failed: bool) {
        let i = STORE_OPS.iter().position(|&o| o == op).unwrap_or(0);
        self.0.store_duration[i].observe(took);
        if failed {
            self.0.store_errors[i].inc();
        }
    }

    /// Counts a worker's store circuit breaker opening (`true`) or closing. Each worker has a
    /// breaker of its own (a store connection of its own): the gauge is how many are open, so
    /// that one closing does not hide another still open.
    pub fn breaker_changed(&self, open: bool) {
        if open {
            self.0.breaker_open.inc();
        } else {
            self.0.breaker_open.dec();
        }
    }

    /// Times an upstream answer of `status` (`None`: no answer: a connect failure, a timeout).
    pub fn upstream(&self, status: Option<u16>, took: Duration) {
        let class = match status {
            Some(s @ 100..=599) => usize::from(s / 100 - 1),
            _ => 5,
        };
        self.0.upstream_duration[class].observe(took);
    }

    /// Sets the count of live realtime sessions.
    pub fn realtime_sessions(&self, live: usize) {
        self.0
            .realtime_sessions
            .set(i64::try_from(live).unwrap_or(i64::MAX));
    }

    /// Counts a reload of the config: `ok`, or refused with the running config kept.
    pub fn reload(&self, ok: bool) {
        if ok {
            self.0.reloads_ok.inc();
            self.0.last_reload.set(unix_now());
        } else {
            self.0.reloads_error.inc();
        }
    }

    /// The exposition, in Prometheus's text format (0.0.4), which every scraper and `promtool
    /// check metrics` read.
    pub fn encode(&self) -> String {
        let mut open_metrics = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut open_metrics, &self.0.registry);
        to_prometheus_text(&open_metrics)
    }
}

/// The `Content-Type` of [`Metrics::encode`].
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// OpenMetrics text as Prometheus's text format: a counter family's `HELP` and `TYPE` name its
/// samples (`x_total`, not `x`), and there is no `# EOF` or `# UNIT` line.
pub(crate) fn to_prometheus_text(open_metrics: &str) -> String {
    let counters: Vec<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len() + 16 * counters.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(&name) && !name.ends_with("_total") {
                    out.push_str("_total");
                }
                out.push(' ');
                out.push_str(tail);
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A histogram of durations with fixed buckets, observed with atomic increments only.
#[derive(Clone, Debug)]
pub struct Histogram(Arc<HistogramInner>);

#[derive(Debug)]
struct HistogramInner {
    /// Upper bounds, in seconds, ascending.
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative), and one past the last bound.
    counts: Vec<AtomicU64>,
    /// The sum of observations, in nanoseconds.
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub(crate) fn new(bounds: &'static [f64]) -> Histogram {
        Histogram(Arc::new(HistogramInner {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }))
    }

    /// Counts one observation of `d`.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .0
            .bounds
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(self.0.bounds.len());
        self.0.counts[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.0.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        // Each bucket's own count: the encoder writes them cumulative itself (prometheus-client's
        // text encoder sums them), so that `le="+Inf"` is `_count`.
        let mut count = 0;
        let mut buckets = Vec::with_capacity(self.0.counts.len());
        for (i, c) in self.0.counts.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            count += n;
            let bound = self.0.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            buckets.push((bound, n));
        }
        let sum = self.0.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_exist_at_zero_and_count_what_happens() {
        let m = Metrics::new();
        m.request(Outcome::Admitted);
        m.request(Outcome::Refused(ScopeKind::Key));
        m.limit(ScopeKind::Org, true, LimitOutcome::Near);
        m.tokens(3, 4);
        m.spend(1_500_000);
        m.store_call(StoreOp::Admit, Duration::from_micros(70), false);
        m.upstream(Some(200), Duration::from_millis(3));
        let text = m.encode();
        for line in [
            r#"floodgate_requests_total{decision="admitted",scope="none"} 1"#,
            r#"floodgate_requests_total{decision="refused",scope="key"} 1"#,
            r#"floodgate_requests_total{decision="budget",scope="org"} 0"#,
            r#"floodgate_limit_decisions_total{scope="org",kind="tokens",outcome="near"} 1"#,
            r#"floodgate_tokens_total{direction="output"} 4"#,
            "floodgate_spend_usd_total 1.5",
            r#"floodgate_store_duration_seconds_bucket{le="0.0001",op="admit"} 1"#,
            r#"floodgate_store_duration_seconds_count{op="admit"} 1"#,
            r#"floodgate_upstream_duration_seconds_count{status_class="2xx"} 1"#,
            "floodgate_store_breaker_open 0",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(!text.contains("sk-"), "no secret, no id");
    }

    #[test]
    fn the_breaker_gauge_counts_the_workers_whose_breaker_is_open() {
        let m = Metrics::new();
        let gauge = |m: &Metrics| {
            let text = m.encode();
            let line = text
                .lines()
                .find(|l| l.starts_with("floodgate_store_breaker_open "))
                .map(str::to_owned);
            line.unwrap_or_default()
        };
        m.breaker_changed(true);
        m.breaker_changed(true);
        m.breaker_changed(false);
        assert_eq!(
            gauge(&m),
            "floodgate_store_breaker_open 1",
            "one still open"
        );
        m.breaker_changed(false);
        assert_eq!(gauge(&m), "floodgate_store_breaker_open 0");
    }

    /// Buckets are cumulative once: every bucket from the observation's up holds it, and
    /// `le="+Inf"` equals `_count`, as Prometheus requires (`histogram_quantile` reads them so).
    /// Before, the encoder summed counts that were cumulative already.
    #[test]
    fn histogram_buckets_are_cumulative_once_and_inf_is_the_count() {
        let m = Metrics::new();
        m.store_call(StoreOp::Admit, Duration::from_micros(70), false);
        m.store_call(StoreOp::Admit, Duration::from_millis(3), false);
        m.store_call(StoreOp::Admit, Duration::from_secs(5), false);
        let text = m.encode();
        let series = "floodgate_store_duration_seconds_bucket{le=\"";
        let buckets: Vec<(f64, u64)> = text
            .lines()
            .filter(|l| l.starts_with(series) && l.contains("op=\"admit\""))
            .map(|l| {
                let rest = &l[series.len()..];
                let (le, _) = rest.split_once('"').unwrap();
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (le, l.rsplit(' ').next().unwrap().parse().unwrap())
            })
            .collect();
        assert!(buckets.len() > 3, "{text}");
        for &(le, n) in &buckets {
            let want = [70e-6, 3e-3, 5.0].iter().filter(|&&d| d <= le).count() as u64;
            assert_eq!(n, want, "le={le} in\n{text}");
        }
        assert_eq!(buckets.last().map(|b| b.1), Some(3));
        assert!(text.contains("floodgate_store_duration_seconds_count{op=\"admit\"} 3"));
    }
}
