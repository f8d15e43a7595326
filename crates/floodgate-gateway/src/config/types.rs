//! The resolved config: what the gateway runs on, every field checked.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use floodgate::{Period, ScopeKind};
use serde::Deserialize;

use floodgate::{Charge, WindowLimit};

use super::money::usd;

/// Where the gateway listens when `[server] listen` is absent.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// `[server] max_connections` when absent.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// `[server] max_body_mib` when absent: room for a few base64 images in a chat completion.
pub const DEFAULT_MAX_BODY_MIB: u64 = 32;

/// `[server] header_timeout_sec` when absent: nginx's `client_header_timeout`.
pub const DEFAULT_HEADER_TIMEOUT_SEC: u64 = 60;

/// How long the gateway waits for the upstream's response headers when `timeout_sec` is absent.
pub const DEFAULT_UPSTREAM_TIMEOUT_SEC: u64 = 300;
/// The largest `[upstream] timeout_sec`: a day, far past any answer's wait, and well within
/// what the clock can add to now.
pub const MAX_UPSTREAM_TIMEOUT_SEC: u64 = 86_400;
/// `[realtime] max_connections` when absent: live realtime sessions per gateway process.
pub const DEFAULT_REALTIME_MAX_CONNECTIONS: usize = 1000;
/// `[realtime] flush_sec` when absent: how often a session's metered tokens are charged.
pub const DEFAULT_REALTIME_FLUSH_SEC: u64 = 5;
/// `[realtime] drain_sec` when absent, and its largest value: how long a graceful shutdown lets
/// live realtime sessions go on before closing them. Below the process's 30 s drain deadline
/// ([`crate::server::DRAIN_TIMEOUT`]), so that closed sessions still have their tokens charged.
pub const MAX_REALTIME_DRAIN_SEC: u64 = 25;
/// The environment variable that overrides `[store] url`.
pub const REDIS_URL_ENV: &str = "FLOODGATE_REDIS_URL";

/// `[gateway] default_max_output_tokens` when absent: the output estimate of a request that
/// names no cap, under `tokens = "reserve"`.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 4096;
/// The largest `default_max_output_tokens` taken (far past any model's output).
pub const MAX_OUTPUT_TOKENS: u64 = 10_000_000;

/// How token limits (and budgets) are charged: `tokens = "reactive"` or `"reserve"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TokenMode {
    /// Charged the usage after the response; a full window refuses (the seeds' behaviour).
    #[default]
    Reactive,
    /// Charged the request's estimate at admission, in the same atomic step as its request
    /// limits, and reconciled with its usage after.
    Reserve,
}

impl TokenMode {
    /// The mode named `name` in a config: `reactive` or `reserve`.
    pub fn parse(name: &str) -> Option<TokenMode> {
        match name {
            "reactive" => Some(TokenMode::Reactive),
            "reserve" => Some(TokenMode::Reserve),
            _ => None,
        }
    }
}

/// A config that could not be loaded: where, which field, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The config file.
    pub file: PathBuf,
    /// 1-based line of the offending value (0 when the file could not be read).
    pub line: usize,
    /// 1-based column of the offending value (0 when unknown).
    pub column: usize,
    /// The field at fault, as a dotted path where known (`keys[2].rate_limit.requests`), or the
    /// key as written in the file.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: field `{}`: {}",
            self.file.display(),
            self.line,
            self.column,
            self.field,
            self.message
        )
    }
}

impl std::error::Error for ConfigError {}

/// Which store holds the limits' state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// The embedded in-memory store: one process.
    Memory,
    /// Redis: many gateway replicas share one truth.
    Redis,
    /// A Redis Cluster (`urls`, its seed nodes): the same, across many Redis primaries.
    RedisCluster,
}

impl Backend {
    /// Whether the state is in Redis (one server or a cluster).
    pub fn is_redis(self) -> bool {
        matches!(self, Backend::Redis | Backend::RedisCluster)
    }

    /// The backend's name, as the config writes it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis-cluster",
        }
    }
}

/// What admission does when the store cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Let requests through unchecked (the default).
    Open,
    /// Refuse requests with 503.
    Closed,
}

/// `[store] on_error` per kind of limit: request limits, token limits and budgets each fail
/// open or closed on their own (rate limits open and budgets closed, say, so that an outage
/// never lets spend through while traffic keeps flowing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnErrorKinds {
    /// Request limits.
    pub requests: OnError,
    /// Token limits.
    pub tokens: OnError,
    /// Budgets.
    pub budgets: OnError,
}

impl OnErrorKinds {
    /// `mode` for every kind.
    pub fn all(mode: OnError) -> OnErrorKinds {
        OnErrorKinds {
            requests: mode,
            tokens: mode,
            budgets: mode,
        }
    }

    /// The one mode of every kind, if they agree.
    pub fn uniform(&self) -> Option<OnError> {
        (self.requests == self.tokens && self.tokens == self.budgets).then_some(self.requests)
    }
}

/// A validated config.
#[derive(Clone, Debug)]
pub struct Config {
    /// The file it was read from.
    pub path: PathBuf,
    /// A digest of the text it was read from, so that the reload watcher can tell whether the
    /// file still holds what runs (docs/design.md §7).
    pub text_digest: u64,
    /// A digest of the upstream's CA file (`upstream.ca_file`) as it was when the config was
    /// read, so that the watcher reloads when the file is replaced (a rotated CA) while the
    /// config stays (docs/design.md §7). `None` without a CA file.
    pub ca_file_digest: Option<u64>,
    /// Where to listen.
    pub listen: SocketAddr,
    /// Worker threads, each with its own event loop and listening socket (`None`: the default,
    /// see [`default_workers`]).
    pub workers: Option<usize>,
    /// How long a caller may take to send a request's head, and how long a kept-alive
    /// connection may sit idle between requests; then the connection is closed.
    pub header_timeout: Duration,
    /// The largest request body the gateway reads before admission (a completion of a metered
    /// key), in MiB: a larger one is refused with 413, uncharged.
    pub max_body_mib: u64,
    /// The most the process holds of request bodies read before admission, all callers
    /// together, in MiB (`[server] max_buffered_mib`); one key holds at most half of it.
    pub max_buffered_mib: u64,
    /// Whether the file writes `max_buffered_mib` (else it is the machine's default, read at
    /// load: a reload that leaves it out asks for no change, whatever the memory reads then).
    pub max_buffered_mib_written: bool,
    /// The most client connections the process keeps open at once (`[server]
    /// max_connections`); past it, new ones wait in the listen backlog.
    pub max_connections: usize,
    /// Where limit state lives.
    pub store: StoreConfig,
    /// Where admitted requests go.
    pub upstream: UpstreamConfig,
    /// Realtime (WebSocket) sessions.
    pub realtime: RealtimeConfig,
    /// The callers.
    pub keys: Vec<KeyConfig>,
    /// Limits per scope, from both config shapes, merged: `(scope, id) -> limits`. The gateway
    /// scope's id is `gateway`.
    pub limits: BTreeMap<(ScopeKind, String), Vec<ScopeLimit>>,
    /// Concurrency limits per scope (`max_in_flight`): `(scope, id) -> limit`.
    pub in_flight: BTreeMap<(ScopeKind, String), InFlightConfig>,
    /// The refusal tally and `/alerts`.
    pub alerts: AlertsConfig,
    /// `[admin]`: the admin listener; `None`: none.
    pub admin: Option<AdminConfig>,
    /// `[[prices]]`, in the order written.
    pub prices: Vec<PriceConfig>,
    /// `[[budgets]]` per scope: `(scope, id) -> budgets` (at most one per period). The gateway
    /// scope's id is `gateway`.
    pub budgets: BTreeMap<(ScopeKind, String), Vec<BudgetConfig>>,
    /// `[gateway] tokens`: how token limits are charged where a limit does not say.
    pub tokens: TokenMode,
    /// `[gateway] default_max_output_tokens`: the output estimate of a request naming no cap.
    pub default_max_output_tokens: u64,
}

/// One `[[prices]]` entry: what a model's tokens cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PriceConfig {
    /// The model name, or `*` for every model the table does not price.
    pub model: String,
    /// Pico-USD per input token (= USD per million tokens × 10^6, rounded).
    pub input_pico: u64,
    /// Pico-USD per output token.
    pub output_pico: u64,
}

/// The wildcard model of `[[prices]]`: the price of every model the table does not name.
pub const ANY_MODEL: &str = "*";

/// One `[[budgets]]` entry of a scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetConfig {
    /// The calendar period (UTC).
    pub period: Period,
    /// The cap, in micro-USD.
    pub micro_usd: u64,
    /// Decided and charged as usual, but never refusing (`shadow = true`).
    pub shadow: bool,
}

impl fmt::Display for BudgetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} per {}", usd(self.micro_usd), self.period)?;
        if self.shadow {
            f.write_str(" (shadow)")?;
        }
        Ok(())
    }
}

impl Config {
    /// A warning for each limit on a team, project, business unit or org that no key belongs
    /// to: its limits apply to nobody (a typo in an id, most likely).
    pub fn unused_limit_warnings(&self) -> Vec<String> {
        // A group (team, project, business unit, org) that no key names.
        let unused = |(kind, id): &&(ScopeKind, String)| match kind {
            ScopeKind::Gateway | ScopeKind::Customer | ScopeKind::Key => false,
            _ => !self
                .keys
                .iter()
                .any(|k| k.scopes().contains(&(*kind, id.as_str()))),
        };
        self.limits
            .keys()
            .chain(
                self.in_flight
                    .keys()
                    .filter(|s| !self.limits.contains_key(s)),
            )
            .filter(unused)
            .map(|(kind, id)| {
                format!("no key belongs to {kind} `{id}`: its limits apply to nobody")
            })
            .chain(self.budgets.keys().filter(unused).map(|(kind, id)| {
                format!("no key belongs to {kind} `{id}`: its budgets apply to nobody")
            }))
            .chain(self.budget_price_warning())
            .chain(self.memory_budget_warning())
            .collect()
    }

    /// A warning when budgets are kept on the memory store: its spend lives in the process and
    /// starts from zero at every restart, so a day's or a month's cap can be spent again after
    /// each deploy.
    pub fn memory_budget_warning(&self) -> Option<String> {
        (!self.budgets.is_empty() && self.store.backend == Backend::Memory).then(|| {
            "budgets are kept on the memory store: their spend starts from zero at every \
             restart; use the redis store to keep it across restarts"
                .to_owned()
        })
    }

    /// A warning when budgets exist but no `*` price does: responses of models the table does
    /// not price spend nothing against them.
    pub fn budget_price_warning(&self) -> Option<String> {
        (!self.budgets.is_empty() && !self.prices.iter().any(|p| p.model == ANY_MODEL)).then(|| {
            "budgets are set but no `[[prices]]` entry has model = \"*\": responses of models \
             the table does not price spend nothing against them"
                .to_owned()
        })
    }

    /// The budgets of scope `(kind, id)`, if any.
    pub fn scope_budgets(&self, kind: ScopeKind, id: &str) -> &[BudgetConfig] {
        self.budgets
            .get(&(kind, id.to_owned()))
            .map_or(&[], Vec::as_slice)
    }
}

/// `[admin] listen` when absent: loopback, apart from the callers' port.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";

/// `[admin]`, resolved: a second listener for `/metrics` and `/admin/*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdminConfig {
    /// Where the admin listener binds.
    pub listen: SocketAddr,
    /// The SHA-256 of the bearer secret `/admin/*` asks for (never a key's); `None`: `/admin/*`
    /// answers 401 to everyone.
    pub secret_sha256: Option<[u8; 32]>,
    /// Whether `/metrics` asks for the bearer too.
    pub metrics_auth: bool,
    /// The host names (lowercase, no port) a request to a listener bound to loopback may name
    /// in its `Host` besides loopback's own (`localhost`, `127.0.0.1`, `::1`): a browser page
    /// whose name an attacker re-resolved to 127.0.0.1 (DNS rebinding) names its own, and is
    /// refused. A listener bound elsewhere takes any `Host`.
    pub hosts: Vec<String>,
}

/// `[alerts]`, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlertsConfig {
    /// Where the aggregate is kept (`None`: in memory only, lost on restart).
    pub path: Option<PathBuf>,
    /// How often the counters are flushed into the aggregate.
    pub flush_every: Duration,
    /// How many local days the aggregate keeps (today included).
    pub retention_days: u32,
    /// The SHA-256 of the bearer secret `GET /alerts` asks for (`None`: no `/alerts`).
    pub secret_sha256: Option<[u8; 32]>,
}

impl Default for AlertsConfig {
    fn default() -> AlertsConfig {
        AlertsConfig {
            path: None,
            flush_every: Duration::from_secs(60),
            retention_days: 90,
            secret_sha256: None,
        }
    }
}

/// `[store]`.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Memory or Redis.
    pub backend: Backend,
    /// The Redis URL (after `FLOODGATE_REDIS_URL`), if any.
    pub url: Option<String>,
    /// A Redis Cluster's seed nodes (`urls`), on the `redis-cluster` backend.
    pub urls: Vec<String>,
    /// Fail open or closed when the store is unreachable: the store's own mode, the one of
    /// every kind when they agree, else `Closed` (the gateway then applies each kind's).
    pub on_error: OnError,
    /// What a store failure does to each kind of limit.
    pub on_error_by_kind: OnErrorKinds,
    /// The Redis key prefix (the library's default `fg:` when `None`).
    pub prefix: Option<String>,
    /// How long a concurrency slot lives on Redis without renewal (`lease_sec`, default 15).
    pub lease: Duration,
}

impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL may carry a password: never printed, not even by `{:?}` of a whole config.
        f.debug_struct("StoreConfig")
            .field("backend", &self.backend)
            .field("url", &self.url.as_ref().map(|_| "<set>"))
            .field("urls", &self.urls.len())
            .field("on_error", &self.on_error_by_kind)
            .field("prefix", &self.prefix)
            .field("lease", &self.lease)
            .finish()
    }
}

impl StoreConfig {
    /// A warning for a Redis URL that the memory store ignores: one set in `FLOODGATE_REDIS_URL`
    /// (one in the file is refused at load), likely meant for a Redis backend the file does not
    /// choose. Each replica then counts alone.
    pub fn ignored_url_warning(&self) -> Option<String> {
        (self.backend == Backend::Memory && self.url.is_some()).then(|| {
            format!(
                "{REDIS_URL_ENV} is set, but the store is memory (set `backend = \"redis\"` to use it): each gateway process counts its limits alone"
            )
        })
    }
}

/// `[upstream]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// The real upstream, or the built-in demo.
    pub target: UpstreamTarget,
    /// How long to wait for the upstream's response headers (then 504).
    pub timeout: Duration,
}

/// `[realtime]`: WebSocket sessions on `/v1/realtime`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RealtimeConfig {
    /// Most live sessions in this gateway process, all workers together (a session counts from
    /// its upgrade request to its end). Not shared between replicas.
    pub max_connections: usize,
    /// How often a live session's metered tokens are charged to the token limits (and once
    /// more when it ends).
    pub flush: Duration,
    /// On a graceful shutdown, how long live sessions may go on before the gateway closes
    /// them (their tokens are then charged).
    pub drain: Duration,
}

impl Default for RealtimeConfig {
    fn default() -> RealtimeConfig {
        RealtimeConfig {
            max_connections: DEFAULT_REALTIME_MAX_CONNECTIONS,
            flush: Duration::from_secs(DEFAULT_REALTIME_FLUSH_SEC),
            drain: Duration::from_secs(MAX_REALTIME_DRAIN_SEC),
        }
    }
}

/// Where requests are forwarded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpstreamTarget {
    /// The built-in demo upstream: fixed replies with a real `usage`, no outside service.
    Demo,
    /// An OpenAI-compatible HTTP server, over TLS for an `https://` base URL.
    Http {
        /// `http://host[:port][/prefix]` or `https://host[:port][/prefix]`, without a trailing
        /// slash; the request path is appended.
        base_url: String,
        /// The environment variable holding the upstream's API key, if any.
        api_key_env: Option<String>,
        /// A PEM file of CA certificates trusted for an https upstream besides the system's,
        /// relative paths resolved against the config file's directory. Checked at load: it
        /// could be read and holds at least one usable certificate.
        ca_file: Option<PathBuf>,
    },
}

/// One `[[keys]]` entry, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyConfig {
    /// The key's public id.
    pub id: String,
    /// SHA-256 of the secret (the secret itself is never kept).
    pub secret_sha256: [u8; 32],
    /// The org, if any.
    pub org: Option<String>,
    /// The team, if any.
    pub team: Option<String>,
    /// The project, if any.
    pub project: Option<String>,
    /// The business unit, if any.
    pub business_unit: Option<String>,
}

impl KeyConfig {
    /// The hash tag under which this key's chain is stored: its org, else the key itself.
    pub fn tenant(&self) -> String {
        match &self.org {
            Some(org) => format!("org:{org}"),
            None => format!("key:{}", self.id),
        }
    }

    /// The key's scopes, narrowest first (key, project, team, business unit, org), with ids.
    pub fn scopes(&self) -> Vec<(ScopeKind, &str)> {
        let mut out = vec![(ScopeKind::Key, self.id.as_str())];
        for (kind, id) in [
            (ScopeKind::Project, &self.project),
            (ScopeKind::Team, &self.team),
            (ScopeKind::BusinessUnit, &self.business_unit),
            (ScopeKind::Org, &self.org),
        ] {
            if let Some(id) = id {
                out.push((kind, id.as_str()));
            }
        }
        out
    }
}

/// `[server] max_buffered_mib` when absent: a quarter of the machine's memory, at most 4096 MiB
/// (and 4096 where the memory cannot be read).
pub fn default_max_buffered_mib() -> u64 {
    let total_mib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib / 1024)
        });
    total_mib.map_or(4096, |mib| (mib / 4).clamp(1, 4096))
}

/// Worker threads when `[server] workers` is absent: one per CPU.
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The shortest `[store] lease_sec`: renewed every third of it, a shorter lease would spend its
/// margin on one slow round trip.
pub const MIN_LEASE_SEC: u64 = 3;
/// The longest `[store] lease_sec`: a dead replica's slots stay taken this long.
pub const MAX_LEASE_SEC: u64 = 300;

/// The id under which gateway-wide limits are kept.
pub const GATEWAY_ID: &str = "gateway";

/// Requests allowed by a `rate_limit` object that omits `requests`.
pub const DEFAULT_REQUESTS: u64 = 100;
/// Window of a `rate_limit` object that omits `window_sec`, in seconds.
pub const DEFAULT_WINDOW_SEC: u64 = 60;

/// One limit of a scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScopeLimit {
    /// Requests (at admission) or tokens (reactive).
    pub charge: Charge,
    /// The limit.
    pub limit: WindowLimit,
    /// Decided and charged as usual, but never refusing (`shadow = true`).
    pub shadow: bool,
}

impl fmt::Display for ScopeLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.charge {
            Charge::Admission => "requests",
            Charge::Reactive => "tokens",
            Charge::Reserved => "tokens (reserved)",
        };
        write!(
            f,
            "{} {unit} / {}s",
            self.limit.max(),
            self.limit.window().as_secs()
        )?;
        if self.shadow {
            f.write_str(" (shadow)")?;
        }
        Ok(())
    }
}

/// A scope's concurrency limit (`max_in_flight`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlightConfig {
    /// The most requests and realtime sessions of the scope running at once (at least 1).
    pub max: u64,
    /// Slots taken and given back as usual, but never refusing.
    pub shadow: bool,
}

impl fmt::Display for InFlightConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} in flight", self.max)?;
        if self.shadow {
            f.write_str(" (shadow)")?;
        }
        Ok(())
    }
}

/// Limits per scope, as the config resolves them: `(scope, id) -> limits` ([`Config::limits`])
/// and `(scope, id) -> concurrency limit` ([`Config::in_flight`]).
#[derive(Debug, Default)]
pub(crate) struct Limits {
    pub(crate) windows: BTreeMap<(ScopeKind, String), Vec<ScopeLimit>>,
    pub(crate) in_flight: BTreeMap<(ScopeKind, String), InFlightConfig>,
}
