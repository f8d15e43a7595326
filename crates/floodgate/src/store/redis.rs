//! The Redis store: many replicas, one shared truth.
//!
//! Each decision is one Lua script (`store/*.lua`, hashed and loaded by [`redis::Script`], run
//! with EVALSHA, and loaded again and retried, up to three times, on NOSCRIPT, as after a restart). Redis runs a script to completion before any other command,
//! so a chain's reads, decision and increments cannot interleave with another request's: no two
//! requests, on one replica or many, take the same free slot. The scripts mirror
//! [`window`](crate::window) and [`bucket`](crate::bucket) operation for operation, so the same
//! operations with the same clock give bit-identical decisions on this store and on the
//! [`MemoryStore`](super::MemoryStore).
//!
//! Connections, failures and time:
//!
//! - one multiplexed, auto-reconnecting connection per store (a [`ConnectionManager`]), a timeout
//!   on every call, connected lazily so that a process can start while Redis is down;
//! - an operation that is safe to run twice (admission, acquire, reset, reading period counters)
//!   is replayed once when its connection dropped under it; an increment (recording tokens,
//!   adding spend to period counters) never is (each script declares its replay policy beside
//!   its source);
//! - when Redis is unreachable, admissions fail open (or closed, by [`OnError`]), a circuit
//!   breaker answers at once instead of waiting for a timeout on every request, and a background
//!   task probes Redis until it answers. One warning per outage, one info line when it ends;
//! - the scripts read the server's `TIME` ([`RedisClock::Server`]) unless the caller pins the
//!   time or the store sends its own ([`RedisClock::Client`]).
//!
//! ```no_run
//! use floodgate::{Chain, ChainLimit, Charge, ScopeKind, WindowLimit};
//! use floodgate::store::redis::{RedisConfig, RedisStore};
//!
//! # async fn demo() -> Result<(), floodgate::Error> {
//! let store = RedisStore::connect(RedisConfig::new("redis://127.0.0.1:6379")).await?;
//! let chain = Chain::new(vec![ChainLimit::new(
//!     "org:acme", ScopeKind::Key, "alice", Charge::Admission, WindowLimit::per_minute(5),
//! )]);
//! let decision = chain.admit(&store, 1).await?;
//! println!("admitted: {}, enforced: {}", decision.admitted, decision.enforced);
//! # Ok(()) }
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::io::tcp::TcpSettings;
use ::redis::{
    Client, Cmd, ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError, RedisWrite, Script,
    ServerErrorKind,
};

use super::{BucketKey, BucketObservation, NameRef, Observation, PeriodObservation, Store};
use crate::Error;
use crate::bucket::BucketLimit;
use crate::chain::{ChainLimit, ScopeKind};
use crate::clock::Timestamp;
use crate::period::{Period, PeriodCounter};
use crate::window::{Charge, MAX_COUNT, Snapshot, WindowLimit};

/// What a decision does when Redis cannot be reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnError {
    /// Admit unchecked (`enforced: false`): an outage of the limiter is not an outage of the
    /// service. The default.
    #[default]
    Open,
    /// Refuse with [`Error::Unavailable`].
    Closed,
}

/// Which clock decides when a call does not pin the time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RedisClock {
    /// The Redis server's `TIME`, read inside each script: one clock for every replica, so skew
    /// between them cannot split a bucket or distort a rate. The default.
    #[default]
    Server,
    /// The calling process's wall clock, sent with each call, for managed services that refuse
    /// `TIME` inside scripts. Replicas' clocks must then agree.
    Client,
}

/// How to reach Redis and how to behave when it cannot be reached.
#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://[:password@]host:port[/db]`, or `rediss://` with the `tls` feature.
    pub url: String,
    /// Prepended to every key; default `fg:`.
    pub prefix: String,
    /// Fail open (default) or closed when Redis is unreachable.
    pub on_error: OnError,
    /// The clock that decides when a call does not pin the time.
    pub clock: RedisClock,
    /// The longest one call may take, replay included; default 200 ms.
    pub timeout: Duration,
    /// The longest one connection attempt may take; default 1 s.
    pub connect_timeout: Duration,
    /// How often the circuit breaker probes Redis during an outage; default 250 ms.
    pub probe_interval: Duration,
}

impl RedisConfig {
    /// The defaults, for the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            prefix: "fg:".into(),
            on_error: OnError::Open,
            clock: RedisClock::Server,
            timeout: Duration::from_millis(200),
            connect_timeout: Duration::from_secs(1),
            probe_interval: Duration::from_millis(250),
        }
    }

    /// Whether [`RedisStore::connect`] would take this URL, without connecting: for config
    /// checks. The error never shows the URL's password.
    pub fn check_url(&self) -> Result<(), Error> {
        self.connection_info().map(drop)
    }

    /// The URL parsed, or an error that names it with its password hidden.
    fn connection_info(&self) -> Result<::redis::ConnectionInfo, Error> {
        self.url
            .as_str()
            .into_connection_info()
            .map_err(|e| self.invalid(e))
    }

    fn invalid(&self, e: RedisError) -> Error {
        Error::Backend(format!("invalid Redis URL {}: {e}", redacted(&self.url)))
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL may carry a password: never print it.
        f.debug_struct("RedisConfig")
            .field("url", &redacted(&self.url))
            .field("prefix", &self.prefix)
            .field("on_error", &self.on_error)
            .field("clock", &self.clock)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("probe_interval", &self.probe_interval)
            .finish()
    }
}

/// `url` with its credentials replaced: those between `://` and `@`, and a `pass` or `password`
/// query parameter (how a `unix://` URL carries its password).
fn redacted(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let mut out = match (base.find("://"), base.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &base[..s], &base[at + 1..]),
        _ => base.to_owned(),
    };
    if let Some(query) = query {
        out.push('?');
        for (i, param) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            match param.split_once('=') {
                Some((name @ ("pass" | "password"), _)) => {
                    out.push_str(name);
                    out.push_str("=***");
                }
                _ => out.push_str(param),
            }
        }
    }
    out
}

/// Counters since the store was created, for metrics. Decisions count chain admissions and
/// token-bucket acquires alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RedisStats {
    /// Decisions Redis took that admitted.
    pub admitted: u64,
    /// Decisions Redis took that refused.
    pub refused: u64,
    /// Decisions admitted unchecked because Redis was unreachable.
    pub failed_open: u64,
    /// Decisions refused with [`Error::Unavailable`] because Redis was unreachable.
    pub failed_closed: u64,
    /// Other failed calls: recording and resets while unreachable, and errors Redis answered.
    pub errors: u64,
    /// Operations replayed after a dropped connection.
    pub replays: u64,
    /// Outages: times the circuit breaker opened.
    pub outages: u64,
    /// Script calls that carried admissions: fewer than admissions when they were batched.
    pub admit_batches: u64,
    /// Whether the circuit breaker is open now (Redis is being probed).
    pub breaker_open: bool,
}

#[derive(Debug, Default)]
struct Counters {
    admitted: AtomicU64,
    refused: AtomicU64,
    failed_open: AtomicU64,
    failed_closed: AtomicU64,
    errors: AtomicU64,
    replays: AtomicU64,
    outages: AtomicU64,
    admit_batches: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Whether an operation may run again after its connection dropped under it, not knowing
/// whether the first attempt reached Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replay {
    /// Replayed once. Admission: the first request after a drop is still enforced; if the first
    /// attempt did run and only its reply was lost, the request is charged twice, which errs by
    /// one toward stricter for one window. Acquire: the same, with tokens. Reset: a delete,
    /// idempotent. Reading period counters: a read, harmless twice.
    Once,
    /// Never replayed: an increment applied twice would count units (tokens, spend) that were
    /// never used, and nothing would ever take them back. Recording and adding to period
    /// counters (budgets' spend).
    Never,
}

/// One script and its replay policy: the policy belongs to the operation, not to a call site.
struct Op {
    name: &'static str,
    script: Script,
    replay: Replay,
}

/// Each script is `clock.lua`, which sets `now`, followed by the operation's own file; the window
/// scripts also get `window.lua` (`window_at`, the rolled state of a window).
macro_rules! lua {
    ($file:literal) => {
        concat!(include_str!("clock.lua"), include_str!($file))
    };
    // The window scripts also share `window_at` (window.lua).
    (window $file:literal) => {
        concat!(
            include_str!("clock.lua"),
            include_str!("window.lua"),
            include_str!($file)
        )
    };
    // The period counter scripts share `period_at` and `total_in` (period.lua).
    (period $file:literal) => {
        concat!(
            include_str!("clock.lua"),
            include_str!("period.lua"),
            include_str!($file)
        )
    };
}

const ADMIT_LUA: &str = lua!(window "admit.lua");
const RECORD_LUA: &str = lua!(window "record.lua");
const ACQUIRE_LUA: &str = lua!("acquire.lua");
const RESET_LUA: &str = lua!("reset.lua");
const PERIODS_READ_LUA: &str = lua!(period "periods_read.lua");
const PERIODS_ADD_LUA: &str = lua!(period "periods_add.lua");

fn op(name: &'static str, source: &str, replay: Replay) -> Op {
    Op {
        name,
        script: Script::new(source),
        replay,
    }
}

// Hashed once, on first use.
static ADMIT: LazyLock<Op> = LazyLock::new(|| op("admit", ADMIT_LUA, Replay::Once));
static RECORD: LazyLock<Op> = LazyLock::new(|| op("record", RECORD_LUA, Replay::Never));
static ACQUIRE: LazyLock<Op> = LazyLock::new(|| op("acquire", ACQUIRE_LUA, Replay::Once));
static RESET: LazyLock<Op> = LazyLock::new(|| op("reset", RESET_LUA, Replay::Once));
static PERIODS_READ: LazyLock<Op> =
    LazyLock::new(|| op("periods_read", PERIODS_READ_LUA, Replay::Once));
static PERIODS_ADD: LazyLock<Op> =
    LazyLock::new(|| op("periods_add", PERIODS_ADD_LUA, Replay::Never));

/// The Lua source of each script as the store loads it (`clock.lua` prepended), by operation
/// name: `admit`, `record`, `acquire`, `reset`, `periods_read`, `periods_add`. For benchmarks and operators who preload scripts
/// (`SCRIPT LOAD`); the store loads them itself on first use.
///
/// ```
/// let admit = floodgate::store::redis::script_source("admit").unwrap();
/// assert!(admit.contains("redis.call('MGET'"));
/// ```
pub fn script_source(op: &str) -> Option<&'static str> {
    Some(match op {
        "admit" => ADMIT_LUA,
        "record" => RECORD_LUA,
        "acquire" => ACQUIRE_LUA,
        "reset" => RESET_LUA,
        "periods_read" => PERIODS_READ_LUA,
        "periods_add" => PERIODS_ADD_LUA,
        _ => return None,
    })
}

/// Why a call failed.
enum Failure {
    /// Redis could not be reached in time: the failure policy applies.
    Unavailable(String),
    /// Redis answered with an error: a bug or a misconfiguration, not an outage.
    Backend(String),
}

impl Failure {
    /// The same failure, for another request of the same batch.
    fn again(&self) -> Failure {
        match self {
            Failure::Unavailable(why) => Failure::Unavailable(why.clone()),
            Failure::Backend(why) => Failure::Backend(why.clone()),
        }
    }
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Error {
        match f {
            Failure::Unavailable(why) => Error::Unavailable(why),
            Failure::Backend(why) => Error::Backend(why),
        }
    }
}

/// How a Redis error counts.
enum Class {
    /// The connection was lost under the call: a replayable operation may run again.
    Dropped,
    /// Redis is unreachable, too slow, or not serving (loading, failing over).
    Unavailable,
    /// Redis answered with an error.
    Answered,
}

fn classify(e: &RedisError) -> Class {
    // redis-rs classifies its own errors; never match on message text.
    if e.is_timeout() {
        // The server may be slow rather than gone: another attempt would double the wait.
        Class::Unavailable
    } else if e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error() {
        Class::Dropped
    } else if matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
        )
    ) {
        Class::Unavailable
    } else {
        Class::Answered
    }
}

/// The Redis store. Cheap to clone: clones share the connection, the breaker and the counters.
///
/// See the [module documentation](self) for how it decides and fails.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// The connection calls go through, with its generation: replaced by
    /// [`Inner::fresh_connection`] when a call or a probe times out on it.
    conn: std::sync::RwLock<(u64, ConnectionManager)>,
    /// How a fresh connection is made.
    client: Client,
    manager: ConnectionManagerConfig,
    config: RedisConfig,
    /// Admissions waiting for the next batch (see [`RedisStore::admit_inner`]).
    admissions: std::sync::Mutex<AdmitQueue>,
    /// The circuit breaker: open while Redis is unreachable; a probe task closes it.
    open: AtomicBool,
    /// Set when a probe closed the breaker, cleared by the first call that succeeds after it:
    /// until then a failure is the same outage (a server that answers `PING` but not scripts,
    /// such as a read-only replica, would otherwise log an outage at every probe).
    unconfirmed: AtomicBool,
    /// When the outage being logged began.
    outage_since: std::sync::Mutex<Option<Instant>>,
    counters: Counters,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.inner.config)
            .field("breaker_open", &self.inner.open.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "tls")]
fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Fails only if the process already chose a provider, which then serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl RedisStore {
    /// A store for the server `config.url` names.
    ///
    /// Fails only on a configuration that can never work (a malformed URL, `rediss://` without
    /// the `tls` feature). An unreachable server is not an error: the store starts with its
    /// circuit breaker open, applies [`OnError`] and connects as soon as Redis answers, so a
    /// service can start before its Redis. Must be called within a Tokio runtime.
    pub async fn connect(config: RedisConfig) -> Result<RedisStore, Error> {
        #[cfg(feature = "tls")]
        if config.url.starts_with("rediss://") {
            install_crypto_provider();
        }
        // TCP_NODELAY (the redis crate leaves Nagle on): a call written while another is in
        // flight (a token record beside an admission batch) must not wait for the first's ACK.
        let info = config
            .connection_info()?
            .set_tcp_settings(TcpSettings::default().set_nodelay(true));
        let client = Client::open(info).map_err(|e| config.invalid(e))?;
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            // No per-request timer inside the connection: every call already runs under one
            // deadline of its own (see `Inner::run`), which also covers connecting.
            .set_response_timeout(None)
            // Reconnection is driven by calls and by the breaker's probe, not by a long
            // backoff inside the connection manager that requests would queue behind.
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(200));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), manager.clone())
            .map_err(|e| Error::Backend(format!("Redis client: {e}")))?;
        let store = RedisStore {
            inner: Arc::new(Inner {
                conn: std::sync::RwLock::new((0, conn)),
                client,
                manager,
                config,
                admissions: std::sync::Mutex::new(AdmitQueue::default()),
                open: AtomicBool::new(false),
                unconfirmed: AtomicBool::new(false),
                outage_since: std::sync::Mutex::new(None),
                counters: Counters::default(),
            }),
        };
        let first = tokio::time::timeout(store.inner.config.connect_timeout, store.inner.ping());
        match first.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => store.inner.trip(&e),
            Err(_) => {
                store.inner.fresh_connection(0);
                store.inner.trip("connection timed out");
            }
        }
        Ok(store)
    }

    /// Readiness: whether the store can decide now. One admission, on a limit of its own that
    /// never refuses (`{floodgate}:gateway:readiness:req:1000000us`, after the prefix), goes the
    /// way every decision goes: while the breaker is open it fails at once, and a Redis that
    /// answers `PING` but cannot run or write a script (a read-only replica, `MASTERDOWN`, no
    /// scripting) is not ready. A success after an outage ends it (see the breaker). It counts
    /// in [`RedisStats`] as an admission.
    pub async fn ready(&self) -> Result<(), Error> {
        static PROBE: LazyLock<[ChainLimit; 1]> = LazyLock::new(|| {
            [ChainLimit::new(
                "floodgate",
                ScopeKind::Gateway,
                "readiness",
                Charge::Admission,
                WindowLimit::per_second(MAX_COUNT),
            )]
        });
        self.admit_inner(&*PROBE, 1, None)
            .await
            .map(|_| ())
            .map_err(Error::from)
    }

    /// Whether Redis answers `PING` within the timeout now (it may still fail every script: see
    /// [`ready`](Self::ready)).
    pub async fn ping(&self) -> Result<(), Error> {
        match tokio::time::timeout(self.inner.config.timeout, self.inner.ping()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::Unavailable(e)),
            Err(_) => Err(Error::Unavailable("PING timed out".into())),
        }
    }

    /// The counters since the store was created.
    pub fn stats(&self) -> RedisStats {
        let c = &self.inner.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RedisStats {
            admitted: load(&c.admitted),
            refused: load(&c.refused),
            failed_open: load(&c.failed_open),
            failed_closed: load(&c.failed_closed),
            errors: load(&c.errors),
            replays: load(&c.replays),
            outages: load(&c.outages),
            admit_batches: load(&c.admit_batches),
            breaker_open: self.inner.open.load(Ordering::Acquire),
        }
    }

    /// The store's configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The full Redis key for a storage key: the prefix prepended.
    pub fn redis_key(&self, key: &str) -> String {
        let prefix = &self.inner.config.prefix;
        let mut k = String::with_capacity(prefix.len() + key.len());
        k.push_str(prefix);
        k.push_str(key);
        k
    }

    /// The time to send: pinned, the client's clock, or none for the server's `TIME`.
    fn time_of(&self, now: Option<Timestamp>) -> Option<u64> {
        match (now, self.inner.config.clock) {
            (Some(t), _) => Some(t.as_micros()),
            (None, RedisClock::Client) => Some(Timestamp::now().as_micros()),
            (None, RedisClock::Server) => None,
        }
    }

    /// `EVALSHA sha numkeys`: keys and arguments follow, written straight into the command's one
    /// buffer (a [`ScriptInvocation`](::redis::ScriptInvocation) would hold each in a `Vec` of
    /// its own and copy them all again into a command on every call).
    fn evalsha(&self, op: &Op, keys: usize, args: usize) -> Cmd {
        let mut cmd = Cmd::with_capacity(3 + keys + args, 64 + 48 * (keys + args));
        cmd.arg("EVALSHA").arg(op.script.get_hash()).arg(keys);
        cmd
    }

    /// Appends a key: the prefix and `parts`, as one argument.
    fn key_arg(&self, cmd: &mut Cmd, parts: &[&str]) {
        let mut w = cmd.writer_for_next_arg();
        let mut put = |b: &str| {
            // Writing into a Vec cannot fail.
            let _ = std::io::Write::write_all(&mut w, b.as_bytes());
        };
        put(&self.inner.config.prefix);
        for part in parts {
            put(part);
        }
    }

    /// Appends `ARGV[1]`: the pinned time, the client's clock, or empty for the server's `TIME`.
    fn time_arg(&self, cmd: &mut Cmd, now: Option<Timestamp>) {
        match self.time_of(now) {
            Some(t) => cmd.arg(t),
            None => cmd.arg(""),
        };
    }

    /// Appends a token bucket's key, `{tb:limiter:name}` after the prefix.
    fn bucket_key_arg(&self, cmd: &mut Cmd, key: BucketKey<'_>) {
        let name = match key.name {
            NameRef::Text(text) => Cow::Borrowed(text),
            number => Cow::Owned(number.to_string()),
        };
        self.key_arg(cmd, &["{tb:", key.limiter, ":", &name, "}"]);
    }

    /// The decision a failed admission or acquire gets: unchecked, or an error.
    fn fail(&self, failure: Failure) -> Result<(), Error> {
        let c = &self.inner.counters;
        match failure {
            Failure::Unavailable(_) if self.inner.config.on_error == OnError::Open => {
                bump(&c.failed_open);
                Ok(())
            }
            Failure::Unavailable(why) => {
                bump(&c.failed_closed);
                Err(Error::Unavailable(why))
            }
            Failure::Backend(why) => {
                bump(&c.errors);
                Err(Error::Backend(why))
            }
        }
    }

    fn count(&self, admitted: bool) {
        let c = &self.inner.counters;
        bump(if admitted { &c.admitted } else { &c.refused });
    }
}

impl Inner {
    /// The connection calls go through now, and its generation.
    fn connection(&self) -> (u64, ConnectionManager) {
        self.conn
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the connection after a call or a probe timed out on it. The connection manager
    /// reconnects only on an error, and a connection whose path went silent (a failed-over
    /// primary's old address, a NAT or firewall that dropped its entry: no reset, no reply)
    /// yields none until TCP gives up on it, many minutes later; every probe on it would time
    /// out meanwhile and the breaker would stay open with Redis healthy. Calls still in flight
    /// on the old connection end with their own deadlines. Only the connection of generation
    /// `timed_out` is replaced: the other calls that timed out on it with the first find it
    /// replaced already.
    fn fresh_connection(&self, timed_out: u64) {
        let mut current = self
            .conn
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.0 != timed_out {
            return;
        }
        match ConnectionManager::new_lazy_with_config(self.client.clone(), self.manager.clone()) {
            Ok(conn) => *current = (timed_out + 1, conn),
            // Not reached with a client that made the first connection; the old one stays.
            Err(e) => tracing::debug!(error = %e, "floodgate: cannot make a new Redis connection"),
        }
    }

    async fn ping(&self) -> Result<(), String> {
        ping(&mut self.connection().1).await
    }

    /// Opens the breaker and starts the probe; the first failure of an outage logs it.
    fn trip(self: &Arc<Self>, why: &str) {
        if self.open.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.unconfirmed.swap(false, Ordering::AcqRel) {
            // A probe's PING answered, but no call has since: the outage goes on.
            tracing::debug!(error = why, "floodgate: Redis answers PING but not calls");
        } else {
            bump(&self.counters.outages);
            *self.since() = Some(Instant::now());
            tracing::warn!(
                error = why,
                on_error = ?self.config.on_error,
                "floodgate: Redis unreachable; deciding without it until it answers again"
            );
        }
        tokio::spawn(probe(Arc::downgrade(self)));
    }

    /// Closes the breaker after a probe: calls go to Redis again; the first that succeeds logs
    /// the end of the outage, and a failure before that continues it (see `trip`).
    fn reopen(&self) {
        self.unconfirmed.store(true, Ordering::Release);
        self.open.store(false, Ordering::Release);
    }

    /// A call succeeded: the first after a probe ends the outage.
    fn confirm(&self) {
        if self.unconfirmed.load(Ordering::Relaxed)
            && self.unconfirmed.swap(false, Ordering::AcqRel)
        {
            let outage = self.since().take().map(|t| t.elapsed());
            tracing::info!(?outage, "floodgate: Redis answers again; enforcing limits");
        }
    }

    fn since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.outage_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `op` (the command `cmd`) once, or twice if its connection dropped and its policy
    /// allows a replay.
    async fn run<T: FromRedisValue>(
        self: &Arc<Self>,
        op: &'static Op,
        cmd: &Cmd,
    ) -> Result<T, Failure> {
        if self.open.load(Ordering::Acquire) {
            // The breaker answers at once; the probe task closes it when Redis is back.
            return Err(Failure::Unavailable("circuit breaker open".into()));
        }
        // One deadline for the whole call, replay included.
        let deadline = tokio::time::Instant::now() + self.config.timeout;
        let mut replays = match op.replay {
            Replay::Once => 1,
            Replay::Never => 0,
        };
        loop {
            let (generation, mut conn) = self.connection();
            let attempt = tokio::time::timeout_at(deadline, evalsha(op, cmd, &mut conn));
            let err = match attempt.await {
                Ok(Ok(value)) => {
                    self.confirm();
                    return Ok(value);
                }
                Ok(Err(e)) => e,
                Err(_) => {
                    let why = format!("{} timed out after {:?}", op.name, self.config.timeout);
                    self.fresh_connection(generation);
                    self.trip(&why);
                    return Err(Failure::Unavailable(why));
                }
            };
            match classify(&err) {
                Class::Dropped if replays > 0 => {
                    // The connection manager is already reconnecting; the replay waits for
                    // the new connection (within the same deadline).
                    replays -= 1;
                    bump(&self.counters.replays);
                }
                Class::Dropped if op.replay == Replay::Never => {
                    // A call that may not run twice fails. Whether Redis is gone or only the
                    // connection was cut (a CLIENT KILL, an idle timeout), a PING on the
                    // reconnected connection says, within the same deadline: only an outage
                    // opens the breaker, which would let admissions through unchecked.
                    let why = format!("{}: {err}", op.name);
                    let answers = tokio::time::timeout_at(deadline, self.ping()).await;
                    if matches!(answers, Ok(Ok(()))) {
                        tracing::debug!(
                            error = why,
                            "floodgate: a call that is never replayed was lost with its connection"
                        );
                    } else {
                        self.trip(&why);
                    }
                    return Err(Failure::Unavailable(why));
                }
                Class::Dropped | Class::Unavailable => {
                    let why = format!("{}: {err}", op.name);
                    self.trip(&why);
                    return Err(Failure::Unavailable(why));
                }
                Class::Answered => return Err(Failure::Backend(format!("{}: {err}", op.name))),
            }
        }
    }
}

/// How many times one call reloads its script on NOSCRIPT before giving up.
const MAX_RELOADS: u32 = 3;

/// `EVALSHA`, and on NOSCRIPT (a restarted or flushed server) `SCRIPT LOAD` and again: what
/// [`ScriptInvocation::invoke_async`](::redis::ScriptInvocation::invoke_async) does, for a
/// command built in one buffer. A NOSCRIPT means the script did not run, so calling again is
/// safe for every operation. Another flush can land between the load and the call (seen when
/// the test suite flushes scripts beside other tests), hence a few rounds rather than one.
async fn evalsha<T: FromRedisValue>(
    op: &Op,
    cmd: &Cmd,
    conn: &mut ConnectionManager,
) -> Result<T, RedisError> {
    let mut reloads = 0;
    loop {
        match cmd.query_async(conn).await {
            Err(e)
                if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
                    && reloads < MAX_RELOADS =>
            {
                reloads += 1;
                op.script.load_async(conn).await?;
            }
            other => return other,
        }
    }
}

/// `PING` on `conn`.
async fn ping(conn: &mut ConnectionManager) -> Result<(), String> {
    ::redis::cmd("PING")
        .query_async::<()>(conn)
        .await
        .map_err(|e| e.to_string())
}

/// Probes Redis until it answers, then closes the breaker. Ends early if the store is dropped.
async fn probe(inner: Weak<Inner>) {
    // Dropped before Redis answered (its runtime shut down, with a store shared across
    // runtimes), the probe would leave the breaker open for good: it closes it instead, so the
    // next call tries Redis and, if Redis is still down, trips it again with a new probe.
    struct Unprobed(Weak<Inner>);
    impl Drop for Unprobed {
        fn drop(&mut self) {
            if let Some(inner) = self.0.upgrade() {
                inner.reopen();
            }
        }
    }
    let _close = Unprobed(inner.clone());
    loop {
        let Some(interval) = inner.upgrade().map(|i| i.config.probe_interval) else {
            return;
        };
        tokio::time::sleep(interval).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        // The connection pinged is the one replaced if the ping times out.
        let (generation, mut conn) = inner.connection();
        let answered = tokio::time::timeout(inner.config.connect_timeout, ping(&mut conn)).await;
        match answered {
            Ok(Ok(())) => {
                inner.reopen();
                tracing::debug!("floodgate: Redis answers PING; trying calls again");
                return;
            }
            // The next probe goes over a new connection (see `fresh_connection`).
            Err(_) => inner.fresh_connection(generation),
            Ok(Err(_)) => {}
        }
    }
}

/// Reads a script's reply as an integer.
fn int(v: &::redis::Value) -> Result<u64, Failure> {
    match v {
        ::redis::Value::Int(i) => u64::try_from(*i).map_err(|_| bad_reply()),
        _ => Err(bad_reply()),
    }
}

fn bad_reply() -> Failure {
    Failure::Backend("unexpected script reply".into())
}

/// Admissions queued for the next batch, and whether a task is sending batches.
#[derive(Default)]
struct AdmitQueue {
    pending: Vec<PendingAdmit>,
    sending: bool,
}

/// One queued admission: its chain, its cost, its time argument and where its answer goes.
struct PendingAdmit {
    limits: Vec<ChainLimit>,
    cost: u64,
    /// A pinned time (µs); `None`: the store's clock, read when the batch goes out.
    time: Option<u64>,
    reply: tokio::sync::oneshot::Sender<Result<Decided, Failure>>,
}

/// One admission's answer within a batch: the batch's instant, whether it was admitted, and each
/// limit's `(cur, prev)` as it saw them.
type Decided = (u64, bool, Vec<(u64, u64)>);

/// The most requests one batch carries.
const MAX_BATCH: usize = 256;
/// The most limits (over all its requests) one batch carries, past its first request: the
/// script unpacks its keys onto Lua's stack for MGET (at most about 8 000 values).
const MAX_BATCH_LIMITS: usize = 4096;

impl RedisStore {
    /// Admits through a batch. While one batch is in flight, admissions queue; the next batch
    /// takes them all (group commit), so a busy store sends one script call, one MGET and one
    /// SET per distinct key for many requests, while an idle one sends each admission at once,
    /// alone. The sending runs in a task of its own, so a caller that gives up (a client that
    /// disconnects) never strands the others.
    async fn admit_inner(
        &self,
        limits: &[ChainLimit],
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<Observation, Failure> {
        if self.inner.open.load(Ordering::Acquire) {
            // The breaker answers at once; the probe task closes it when Redis is back.
            return Err(Failure::Unavailable("circuit breaker open".into()));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let pending = PendingAdmit {
            limits: limits.to_vec(),
            cost,
            // Only a pinned time is fixed now: the client's clock is read when the batch goes
            // out, so that unpinned admissions share a batch under either clock.
            time: now.map(Timestamp::as_micros),
            reply: tx,
        };
        let start = {
            let mut q = self.queue();
            q.pending.push(pending);
            !std::mem::replace(&mut q.sending, true)
        };
        if start {
            tokio::spawn(self.clone().send_batches());
        }
        let (t, admitted, counts) = rx
            .await
            .map_err(|_| Failure::Unavailable("admission batch abandoned".into()))??;
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
        self.count(admitted);
        Ok(Observation {
            now: Timestamp::from_micros(t),
            admitted,
            enforced: true,
            snapshots,
        })
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, AdmitQueue> {
        // Pushes and drains cannot leave the queue half-changed.
        self.inner
            .admissions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends batches until the queue is empty. One batch shares one time argument: admissions
    /// with another (a pinned clock) wait for a later batch.
    async fn send_batches(self) {
        // If sending stops early (it panicked, or its runtime shut down and dropped it), the
        // queue must not stay marked as served, or every later admission would wait for a
        // sender that is gone: the queued ones are answered as unavailable (their failure
        // policy applies) and the next admission starts a sender again. The batch in hand fails
        // over the same way, its answers dropped.
        struct Unmark<'a> {
            store: &'a RedisStore,
            done: bool,
        }
        impl Drop for Unmark<'_> {
            fn drop(&mut self) {
                if !self.done {
                    let queued = {
                        let mut q = self.store.queue();
                        q.sending = false;
                        std::mem::take(&mut q.pending)
                    };
                    let why = Failure::Unavailable("the admission sender stopped".into());
                    answer_all(queued, &why);
                }
            }
        }
        let mut unmark = Unmark {
            store: &self,
            done: false,
        };
        loop {
            let batch: Vec<PendingAdmit> = {
                let mut q = self.queue();
                let mut batch = Vec::new();
                let mut rest = Vec::new();
                let mut limits = 0;
                // The batch's time: its first admission's.
                let mut time = None;
                // Once one does not fit, none after it goes either: a smaller one after it must
                // not be decided before it.
                let mut full = false;
                for p in q.pending.drain(..) {
                    if p.reply.is_closed() {
                        // Its caller gave up while it waited (a client that disconnected): it
                        // goes nowhere, so nothing is charged for a request never served.
                        continue;
                    }
                    if *time.get_or_insert(p.time) == p.time && !full {
                        let fits = batch.is_empty()
                            || (batch.len() < MAX_BATCH
                                && limits + p.limits.len() <= MAX_BATCH_LIMITS);
                        if fits {
                            limits += p.limits.len();
                            batch.push(p);
                            continue;
                        }
                        full = true;
                    }
                    rest.push(p);
                }
                q.pending = rest;
                if batch.is_empty() {
                    // Nothing open was queued (the first open admission always fits), so
                    // nothing is left either.
                    q.sending = false;
                    unmark.done = true;
                    return;
                }
                batch
            };
            self.send_batch(batch).await;
        }
    }

    async fn send_batch(&self, mut batch: Vec<PendingAdmit>) {
        let (
            Packed {
                cmd,
                groups,
                charged,
            },
            taken,
        ) = self.pack(&batch);
        if taken < batch.len() {
            // Back to the front of the queue: they came before anything queued since.
            let rest = batch.split_off(taken);
            let mut q = self.queue();
            let later = std::mem::replace(&mut q.pending, rest);
            q.pending.extend(later);
        }
        bump(&self.inner.counters.admit_batches);
        let answer = self
            .inner
            .run::<Vec<::redis::Value>>(&ADMIT, &cmd)
            .await
            .and_then(|reply| admit_reply(reply, &groups, charged.len()));
        let AdmitReply {
            now,
            admitted,
            mut counts,
        } = match answer {
            Ok(answer) => answer,
            Err(failure) => return answer_all(batch, &failure),
        };
        let mut replies: Vec<_> = batch.into_iter().map(|p| Some(p.reply)).collect();
        replay(
            &groups,
            &admitted,
            &mut counts,
            &charged,
            |r, admitted, seen| {
                if let Some(reply) = replies[r].take() {
                    let _ = reply.send(Ok((now, admitted, seen)));
                }
            },
        );
    }

    /// The admission script's call for `batch`: its distinct keys, and its requests in the order
    /// they came, each run of requests of one cost on one chain as one group (see admit.lua).
    ///
    /// The script takes one window and max per key, so a request that names a key the batch
    /// already holds with another limit (a chain rebuilt with a new max while the old one is
    /// still in use) ends the batch: it and those after it go in the next call, and the number
    /// of requests packed is returned with the call.
    fn pack(&self, batch: &[PendingAdmit]) -> (Packed, usize) {
        let mut keys: Vec<&ChainLimit> = Vec::new();
        let mut index: HashMap<&str, usize, foldhash::fast::RandomState> = HashMap::default();
        let mut groups: Vec<Group> = Vec::new();
        let mut taken = batch.len();
        for (r, p) in batch.iter().enumerate() {
            let known = keys.len();
            let mut conflict = false;
            let chain: Vec<usize> = p
                .limits
                .iter()
                .map(|l| {
                    let j = *index.entry(l.key()).or_insert_with(|| {
                        keys.push(l);
                        keys.len()
                    });
                    let held = keys[j - 1];
                    conflict |=
                        j <= known && (held.limit(), held.charge()) != (l.limit(), l.charge());
                    j
                })
                .collect();
            if conflict {
                for l in keys.drain(known..) {
                    index.remove(l.key());
                }
                taken = r;
                break;
            }
            match groups.last_mut() {
                Some(g) if g.cost == p.cost && g.chain == chain => g.members.push(r),
                _ => groups.push(Group {
                    cost: p.cost,
                    chain,
                    members: vec![r],
                }),
            }
        }
        let argc = 1 + 4 * keys.len() + groups.iter().map(|g| 3 + g.chain.len()).sum::<usize>();
        let mut cmd = self.evalsha(&ADMIT, keys.len(), argc);
        for l in &keys {
            self.key_arg(&mut cmd, &[l.key()]);
        }
        match batch[0].time.or_else(|| self.time_of(None)) {
            Some(t) => cmd.arg(t),
            None => cmd.arg(""),
        };
        for l in &keys {
            let w = l.limit().window_micros();
            cmd.arg(w).arg(l.limit().max());
            cmd.arg(match l.charge() {
                Charge::Admission => "a",
                Charge::Reactive => "r",
            });
            cmd.arg(ttl_millis(w));
        }
        for g in &groups {
            cmd.arg(g.cost).arg(g.members.len()).arg(g.chain.len());
            for j in &g.chain {
                cmd.arg(*j);
            }
        }
        let charged = keys
            .iter()
            .map(|l| l.charge() == Charge::Admission)
            .collect();
        (
            Packed {
                cmd,
                groups,
                charged,
            },
            taken,
        )
    }
}

/// Replays what each request of a batch saw, exactly as the script decided: group after group,
/// within a group its first `admitted` requests admitted, each seeing its keys' counts plus the
/// costs of the admitted requests before it that charge them. Calls `each(request, admitted,
/// (cur, prev) of each of its limits)` in that order. `counts` (1-based `KEYS` order, as the
/// groups' indices) ends as the script left them.
fn replay(
    groups: &[Group],
    admitted: &[usize],
    counts: &mut [[u64; 2]],
    charged: &[bool],
    mut each: impl FnMut(usize, bool, Vec<(u64, u64)>),
) {
    for (group, &admitted) in groups.iter().zip(admitted) {
        for (m, &r) in group.members.iter().enumerate() {
            let seen = group
                .chain
                .iter()
                .map(|&j| {
                    let [cur, prev] = counts[j - 1];
                    (cur, prev)
                })
                .collect();
            let admitted = m < admitted;
            if admitted {
                for &j in &group.chain {
                    if charged[j - 1] {
                        counts[j - 1][0] = counts[j - 1][0].saturating_add(group.cost);
                    }
                }
            }
            each(r, admitted, seen);
        }
    }
}

/// Answers every request of a batch that failed with `failure`.
fn answer_all(batch: Vec<PendingAdmit>, failure: &Failure) {
    for p in batch {
        let _ = p.reply.send(Err(failure.again()));
    }
}

/// A batch's admission call and what reading its reply needs.
struct Packed {
    cmd: Cmd,
    /// The requests grouped as the script decides them.
    groups: Vec<Group>,
    /// Per key, in `KEYS` order: whether an admission charges it.
    charged: Vec<bool>,
}

/// A run of requests of one cost on one chain that came one after another, decided one after
/// another: a batch of like requests (many callers of one key) sends its chain once. Only runs
/// are grouped, so requests are still decided in the order they came (grouping all of a key's
/// requests would let a busy key's later requests go before another key's earlier ones).
struct Group {
    cost: u64,
    /// The chain's keys, as 1-based indices into `KEYS`, in chain order.
    chain: Vec<usize>,
    /// The batch's requests in the group, in the order they are decided.
    members: Vec<usize>,
}

/// The admission script's reply for a batch (see admit.lua).
struct AdmitReply {
    /// The batch's instant.
    now: u64,
    /// How many of each group's requests were admitted (its first ones).
    admitted: Vec<usize>,
    /// Each key's `[cur, prev]` before the batch, in `KEYS` order.
    counts: Vec<[u64; 2]>,
}

/// Reads the admission script's reply for a batch of `groups` over `keys` distinct keys.
fn admit_reply(
    reply: Vec<::redis::Value>,
    groups: &[Group],
    keys: usize,
) -> Result<AdmitReply, Failure> {
    if reply.len() != 1 + 2 * keys + groups.len() {
        return Err(bad_reply());
    }
    let (now, rest) = reply.split_first().ok_or_else(bad_reply)?;
    let (counts, admitted) = rest.split_at(2 * keys);
    let counts = counts
        .chunks_exact(2)
        .map(|c| Ok([int(&c[0])?, int(&c[1])?]))
        .collect::<Result<Vec<_>, Failure>>()?;
    let admitted = admitted
        .iter()
        .zip(groups)
        .map(|(a, g)| match usize::try_from(int(a)?) {
            Ok(a) if a <= g.members.len() => Ok(a),
            _ => Err(bad_reply()),
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(AdmitReply {
        now: int(now)?,
        admitted,
        counts,
    })
}

impl RedisStore {
    async fn acquire_inner(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<BucketObservation, Failure> {
        let mut cmd = self.evalsha(&ACQUIRE, 1, 5);
        self.bucket_key_arg(&mut cmd, key);
        self.time_arg(&mut cmd, now);
        cmd.arg(limit.capacity)
            .arg(limit.rate.tokens())
            .arg(limit.rate.period_micros())
            .arg(cost);
        let (allowed, tokens, t): (u64, String, u64) = self.inner.run(&ACQUIRE, &cmd).await?;
        // 17 significant digits: parses back to the very f64 the script computed.
        let tokens: f64 = tokens.parse().map_err(|_| bad_reply())?;
        let allowed = allowed == 1;
        self.count(allowed);
        Ok(BucketObservation {
            now: Timestamp::from_micros(t),
            allowed,
            tokens,
            enforced: true,
        })
    }
}

/// A window's state lives `2W` after its last write, rounded up to whole milliseconds.
fn ttl_millis(window_us: u64) -> u64 {
    window_us.saturating_mul(2).div_ceil(1000)
}

impl Store for RedisStore {
    async fn admit(
        &self,
        limits: &[ChainLimit],
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<Observation, Error> {
        match self.admit_inner(limits, cost, now).await {
            Ok(seen) => Ok(seen),
            Err(failure) => {
                self.fail(failure)?;
                Ok(Observation {
                    now: now.unwrap_or_else(Timestamp::now),
                    admitted: true,
                    enforced: false,
                    snapshots: Vec::new(),
                })
            }
        }
    }

    async fn record(
        &self,
        limits: &[ChainLimit],
        units: u64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        let reactive = || limits.iter().filter(|l| l.charge() == Charge::Reactive);
        let n = reactive().count();
        if n == 0 {
            return Ok(());
        }
        let mut cmd = self.evalsha(&RECORD, n, 2 + 2 * n);
        for l in reactive() {
            self.key_arg(&mut cmd, &[l.key()]);
        }
        self.time_arg(&mut cmd, now);
        cmd.arg(units);
        for l in reactive() {
            let w = l.limit().window_micros();
            cmd.arg(w).arg(ttl_millis(w));
        }
        self.inner.run::<()>(&RECORD, &cmd).await.map_err(|f| {
            bump(&self.inner.counters.errors);
            f.into()
        })
    }

    async fn acquire(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<BucketObservation, Error> {
        match self.acquire_inner(key, limit, cost, now).await {
            Ok(seen) => Ok(seen),
            Err(failure) => {
                self.fail(failure)?;
                Ok(BucketObservation {
                    now: now.unwrap_or_else(Timestamp::now),
                    allowed: true,
                    tokens: limit.capacity as f64,
                    enforced: false,
                })
            }
        }
    }

    async fn reset(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        now: Option<Timestamp>,
    ) -> Result<bool, Error> {
        let mut cmd = self.evalsha(&RESET, 1, 4);
        self.bucket_key_arg(&mut cmd, key);
        self.time_arg(&mut cmd, now);
        cmd.arg(limit.capacity)
            .arg(limit.rate.tokens())
            .arg(limit.rate.period_micros());
        match self.inner.run::<u64>(&RESET, &cmd).await {
            Ok(used) => Ok(used == 1),
            Err(f) => {
                bump(&self.inner.counters.errors);
                Err(f.into())
            }
        }
    }

    async fn read_periods(
        &self,
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Error> {
        if counters.is_empty() {
            // Nothing to read (and MGET takes at least one key).
            return Ok(no_periods(now));
        }
        let cmd = self.periods_cmd(&PERIODS_READ, counters, None, now);
        let seen = self
            .inner
            .run::<Vec<::redis::Value>>(&PERIODS_READ, &cmd)
            .await
            .and_then(|reply| periods_reply(&reply, counters.len()));
        match seen {
            Ok(seen) => Ok(seen),
            Err(failure) => {
                // Unreachable: as for an admission, unchecked (open) or an error (closed).
                self.fail(failure)?;
                Ok(PeriodObservation {
                    now: now.unwrap_or_else(Timestamp::now),
                    enforced: false,
                    totals: vec![0; counters.len()],
                })
            }
        }
    }

    async fn add_periods(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Error> {
        if counters.is_empty() {
            return Ok(no_periods(now));
        }
        let cmd = self.periods_cmd(&PERIODS_ADD, counters, Some(amount), now);
        self.inner
            .run::<Vec<::redis::Value>>(&PERIODS_ADD, &cmd)
            .await
            .and_then(|reply| periods_reply(&reply, counters.len()))
            .map_err(|f| {
                bump(&self.inner.counters.errors);
                f.into()
            })
    }
}

impl RedisStore {
    /// The call of a period counter script: the counters' keys; the time; the amount, for an
    /// add; each counter's period.
    fn periods_cmd(
        &self,
        op: &Op,
        counters: &[PeriodCounter],
        amount: Option<u64>,
        now: Option<Timestamp>,
    ) -> Cmd {
        let n = counters.len();
        let mut cmd = self.evalsha(op, n, 1 + usize::from(amount.is_some()) + n);
        for c in counters {
            self.key_arg(&mut cmd, &[c.key()]);
        }
        self.time_arg(&mut cmd, now);
        if let Some(amount) = amount {
            cmd.arg(amount);
        }
        for c in counters {
            cmd.arg(match c.period() {
                Period::Day => "day",
                Period::Month => "month",
            });
        }
        cmd
    }
}

/// The observation of an operation on no counters, which needs no call.
fn no_periods(now: Option<Timestamp>) -> PeriodObservation {
    PeriodObservation {
        now: now.unwrap_or_else(Timestamp::now),
        enforced: true,
        totals: Vec::new(),
    }
}

/// Reads a period counter script's reply: `{now, total_1, ..., total_n}`.
fn periods_reply(reply: &[::redis::Value], n: usize) -> Result<PeriodObservation, Failure> {
    let (now, totals) = reply.split_first().ok_or_else(bad_reply)?;
    if totals.len() != n {
        return Err(bad_reply());
    }
    Ok(PeriodObservation {
        now: Timestamp::from_micros(int(now)?),
        enforced: true,
        totals: totals.iter().map(int).collect::<Result<_, _>>()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(cost: u64, chain: &[usize], members: &[usize]) -> Group {
        Group {
            cost,
            chain: chain.to_vec(),
            members: members.to_vec(),
        }
    }

    #[test]
    fn the_replay_gives_each_request_what_the_script_saw() {
        // Keys 1 and 2 charged at admission, key 3 reactive (checked, never charged).
        let groups = [
            group(2, &[1, 2], &[0, 1, 2]),
            group(0, &[2, 3], &[3]),
            group(1, &[1], &[4, 5]),
        ];
        let mut counts = [[1, 0], [5, 9], [7, 7]];
        let mut seen = Vec::new();
        replay(
            &groups,
            &[2, 1, 0],
            &mut counts,
            &[true, true, false],
            |r, admitted, view| seen.push((r, admitted, view)),
        );
        assert_eq!(
            seen,
            [
                // The first two of the group of cost 2 are admitted, each after the one before.
                (0, true, vec![(1, 0), (5, 9)]),
                (1, true, vec![(3, 0), (7, 9)]),
                (2, false, vec![(5, 0), (9, 9)]),
                // Cost 0 charges nothing; the reactive key is never charged.
                (3, true, vec![(9, 9), (7, 7)]),
                // A group refused whole: every request sees the same counts.
                (4, false, vec![(5, 0)]),
                (5, false, vec![(5, 0)]),
            ]
        );
        assert_eq!(counts, [[5, 0], [9, 9], [7, 7]]);
    }

    #[test]
    fn a_malformed_admission_reply_is_an_error() {
        use ::redis::Value::{BulkString, Int};
        let groups = [group(1, &[1], &[0, 1])];
        let reply = |v: Vec<::redis::Value>| admit_reply(v, &groups, 1);
        let ok = reply(vec![Int(7), Int(3), Int(0), Int(2)])
            .ok()
            .expect("a well-formed reply");
        assert_eq!((ok.now, ok.counts, ok.admitted), (7, vec![[3, 0]], vec![2]));
        // One value short, more admitted than the group holds, a negative count, a string.
        assert!(reply(vec![Int(7), Int(3), Int(0)]).is_err());
        assert!(reply(vec![Int(7), Int(3), Int(0), Int(3)]).is_err());
        assert!(reply(vec![Int(7), Int(-3), Int(0), Int(1)]).is_err());
        assert!(reply(vec![Int(7), Int(3), Int(0), BulkString(b"1".to_vec())]).is_err());
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redacted("redis://:hunter2@db:6379/0"),
            "redis://***@db:6379/0"
        );
        assert_eq!(redacted("redis://db:6379"), "redis://db:6379");
        assert_eq!(
            redacted("unix:///run/redis.sock?db=one&pass=hunter2"),
            "unix:///run/redis.sock?db=one&pass=***"
        );
        assert_eq!(
            redacted("redis+unix:///r.sock?password=hunter2&user=u"),
            "redis+unix:///r.sock?password=***&user=u"
        );
        assert_eq!(
            redacted("rediss://u:p@db/0?protocol=resp3"),
            "rediss://***@db/0?protocol=resp3"
        );
    }

    #[test]
    fn window_ttl_is_two_windows_in_whole_ms() {
        assert_eq!(ttl_millis(60_000_000), 120_000);
        assert_eq!(ttl_millis(1), 1);
    }

    #[test]
    fn the_bucket_script_caps_the_time_to_full_as_bucket_rs_does() {
        let source = script_source("acquire").unwrap();
        let cap = crate::bucket::MAX_TTL_MICROS.to_string();
        assert!(source.contains(&format!(
            "math.min(math.ceil(missing * period / rate), {cap})"
        )));
    }

    #[test]
    fn every_operation_has_a_script_and_only_record_never_replays() {
        for (op, name) in [
            (&ADMIT, "admit"),
            (&RECORD, "record"),
            (&ACQUIRE, "acquire"),
        ] {
            assert_eq!(op.name, name);
            assert!(script_source(name).is_some());
        }
        assert_eq!(RECORD.replay, Replay::Never);
        assert_eq!(PERIODS_ADD.replay, Replay::Never);
        assert_eq!(PERIODS_READ.replay, Replay::Once);
        assert!(script_source("periods_read").is_some());
        assert!(script_source("periods_add").is_some());
        assert_eq!(ADMIT.replay, Replay::Once);
        assert_eq!(ACQUIRE.replay, Replay::Once);
        assert_eq!(RESET.replay, Replay::Once);
    }
}
