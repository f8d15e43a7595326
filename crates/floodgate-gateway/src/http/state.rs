//! [`AppState`]: everything a request needs, one per worker, behind a cheap clone.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;

use crate::auth::Keys;
use crate::buffers::Buffers;
use crate::charge::Charger;
use crate::config::{Config, OnError, OnErrorKinds, UpstreamTarget};
use crate::metrics::Metrics;
use crate::pricing::Prices;
use crate::realtime::{LiveSessions, Sessions};
use crate::startup::StartError;
use crate::store::GatewayStore;
use crate::tally::{Counters, Tally};
use crate::upstream::{InProcess, Upstream};

/// Everything a request needs; cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// What a reload replaces. A request takes the one current when it starts and keeps it:
    /// requests in flight finish under the config they started with.
    live: RwLock<Arc<Live>>,
    charger: Charger,
    header_timeout: Duration,
    /// `[server] max_body_mib`.
    max_body_mib: u64,
    /// The process's refusal tally (for `/alerts`).
    tally: Arc<Tally>,
    sessions: Sessions,
    /// The process's room for request bodies read before admission.
    buffers: Buffers,
    /// The process's open client connections.
    connections: Arc<Semaphore>,
    metrics: Metrics,
    /// Whether this worker last saw its store's breaker open.
    breaker_seen_open: AtomicBool,
    /// The process's reset count ([`Process::reset_done`]).
    resets: Arc<AtomicU64>,
    /// `[store] on_error`, per kind of limit.
    on_error: OnErrorKinds,
}

/// The part of a worker's state that a config reload replaces, whole: the keys and their
/// chains (limits, budgets, shadow flags), the price table, the upstream and the alerts secret.
#[derive(Debug)]
pub struct Live {
    /// The keys and their chains.
    pub keys: Keys,
    /// The price table budgets are charged from.
    pub prices: Arc<Prices>,
    /// The upstream.
    pub upstream: Upstream,
    /// The SHA-256 of the secret `/alerts` asks for; `None`: no `/alerts`.
    pub alerts_secret: Option<[u8; 32]>,
    /// This worker's counters in the refusal tally (with a slot for each of these keys).
    pub refusals: Arc<Counters>,
    /// The process's reset count when these keys' refusal caches were last emptied: an admin
    /// reset bumps [`Process::resets`], and the next admission on this worker empties them
    /// (docs/design.md §11).
    resets_seen: AtomicU64,
    /// `[gateway] default_max_output_tokens`: the output estimate of a request naming no cap.
    pub default_output: u64,
    /// `[gateway] tokens = "reserve"`: budgets reserve each request's estimated price.
    pub reserve_budgets: bool,
}

impl Live {
    /// What `config` sets, the keys in the tally slots `process.tally` gives them. Fails if the
    /// upstream cannot be set up (its API key's variable missing, say).
    fn build(config: &Config, process: &Process) -> Result<Live, StartError> {
        // The demo upstream plugs into the upstream client as an in-process target: the client
        // knows nothing of the demo.
        let in_process = (config.upstream.target == UpstreamTarget::Demo).then(|| InProcess {
            router: crate::demo::router(),
            realtime: |io| Box::pin(crate::demo::serve_realtime(TokioIo::new(io))),
        });
        let slots = process.tally.key_slots(config);
        Ok(Live {
            keys: Keys::with_slots(config, &slots),
            prices: Arc::new(Prices::new(&config.prices)),
            upstream: Upstream::from_config(&config.upstream, in_process)?,
            alerts_secret: config.alerts.secret_sha256,
            refusals: process.tally.worker(),
            // Fresh chains remember nothing: every reset so far is behind them.
            resets_seen: AtomicU64::new(process.resets.load(Ordering::Acquire)),
            default_output: config.default_max_output_tokens,
            reserve_budgets: config.tokens == crate::config::TokenMode::Reserve,
        })
    }
}

/// A kind of limit, as `[store] on_error` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LimitKind {
    /// Request limits.
    Requests,
    /// Token limits.
    Tokens,
    /// Budgets.
    Budgets,
}

/// What every worker of one process shares: the refusal tally, the count of live realtime
/// sessions (`[realtime] max_connections` holds for the process) and the room for request
/// bodies (`[server] max_buffered_mib` does too).
#[derive(Clone, Debug)]
pub struct Process {
    /// The refusal tally; each worker counts into counters of its own in it.
    pub tally: Arc<Tally>,
    /// The live realtime sessions.
    pub live_sessions: LiveSessions,
    /// The room for bodies read before admission.
    pub buffers: Buffers,
    /// The open client connections, counted against `[server] max_connections`.
    pub connections: Arc<Semaphore>,
    /// The metrics `/metrics` shows.
    pub metrics: Metrics,
    /// The config in force, for the admin listener (its usage, reset and config answers): a
    /// reload replaces it once every worker has the new one.
    running: Arc<RwLock<Arc<Config>>>,
    /// How many admin resets have cleared state: each worker empties its chains' refusal
    /// caches when it sees this change ([`Process::reset_done`]).
    resets: Arc<AtomicU64>,
}

/// `mib` MiB in bytes, saturating where `usize` is narrower.
fn mib_to_bytes(mib: u64) -> usize {
    usize::try_from(mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX)
}

impl Process {
    /// What the workers of a process for `config` share, counting refusals in `tally`.
    pub fn new(config: &Config, tally: Arc<Tally>) -> Process {
        Process {
            tally,
            live_sessions: LiveSessions::new(),
            buffers: Buffers::new(mib_to_bytes(config.max_buffered_mib)),
            connections: Arc::new(Semaphore::new(config.max_connections)),
            metrics: Metrics::new(),
            running: Arc::new(RwLock::new(Arc::new(config.clone()))),
            resets: Arc::default(),
        }
    }

    /// Tells every worker that a reset has lowered counts: each empties its chains' refusal
    /// caches before its next admission, so that nothing is refused from a count the reset took
    /// away (docs/design.md §11).
    pub fn reset_done(&self) {
        self.resets.fetch_add(1, Ordering::AcqRel);
    }

    /// The config in force.
    pub fn running(&self) -> Arc<Config> {
        let running = self.running.read().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(&running)
    }

    /// Makes `config` the one in force (a reload, once every worker has it).
    pub fn set_running(&self, config: Config) {
        let mut running = self.running.write().unwrap_or_else(PoisonError::into_inner);
        *running = Arc::new(config);
    }
}

impl AppState {
    /// State for `config` on `store`, with a refusal tally of its own kept in memory and its
    /// realtime sessions counted alone. Fails if the upstream cannot be set up (its API key's
    /// variable missing, say).
    pub fn new(config: &Config, store: GatewayStore) -> Result<AppState, StartError> {
        let process = Process::new(config, Arc::new(Tally::in_memory(config)));
        AppState::for_worker(config, store, &process)
    }

    /// State for `config` on `store` that counts its refusals in `tally` (one state per worker,
    /// one tally per process).
    pub fn with_tally(
        config: &Config,
        store: GatewayStore,
        tally: &Arc<Tally>,
    ) -> Result<AppState, StartError> {
        AppState::for_worker(config, store, &Process::new(config, Arc::clone(tally)))
    }

    /// State for `config` on `store` whose realtime sessions count against `[realtime]
    /// max_connections` together with every other state given the same `live` (the workers of
    /// one process).
    pub fn with_live_sessions(
        config: &Config,
        store: GatewayStore,
        live: LiveSessions,
    ) -> Result<AppState, StartError> {
        let mut process = Process::new(config, Arc::new(Tally::in_memory(config)));
        process.live_sessions = live;
        AppState::for_worker(config, store, &process)
    }

    /// One worker's state: its refusals counted in the process's tally, its realtime sessions
    /// and its bodies in the process's counts.
    pub fn for_worker(
        config: &Config,
        store: GatewayStore,
        process: &Process,
    ) -> Result<AppState, StartError> {
        Ok(AppState {
            inner: Arc::new(Inner {
                live: RwLock::new(Arc::new(Live::build(config, process)?)),
                charger: Charger::new(store, process.metrics.clone()),
                header_timeout: config.header_timeout,
                max_body_mib: config.max_body_mib,
                tally: Arc::clone(&process.tally),
                sessions: Sessions::new(
                    &config.realtime,
                    config.header_timeout,
                    process.live_sessions.clone(),
                ),
                buffers: process.buffers.clone(),
                connections: Arc::clone(&process.connections),
                metrics: process.metrics.clone(),
                breaker_seen_open: AtomicBool::new(false),
                on_error: config.store.on_error_by_kind,
                resets: Arc::clone(&process.resets),
            }),
        })
    }

    /// The live realtime sessions counted against `[realtime] max_connections`.
    pub fn live_sessions(&self) -> &LiveSessions {
        self.inner.sessions.live()
    }

    pub(crate) fn sessions(&self) -> &Sessions {
        &self.inner.sessions
    }

    /// The charger of this state's responses: [`Charger::settled`] resolves once every charge
    /// they caused has landed, which a draining worker (and a test) waits for.
    pub fn charges(&self) -> &Charger {
        &self.inner.charger
    }

    /// The store.
    pub fn store(&self) -> &GatewayStore {
        self.inner.charger.store()
    }

    /// `[server] header_timeout_sec`.
    pub fn header_timeout(&self) -> Duration {
        self.inner.header_timeout
    }

    /// `[server] max_body_mib`.
    pub(crate) fn max_body_mib(&self) -> u64 {
        self.inner.max_body_mib
    }

    /// Whether a store failure lets a request through unchecked for this kind of limit.
    pub(crate) fn fails_open(&self, kind: LimitKind) -> bool {
        let kinds = &self.inner.on_error;
        let mode = match kind {
            LimitKind::Requests => kinds.requests,
            LimitKind::Tokens => kinds.tokens,
            LimitKind::Budgets => kinds.budgets,
        };
        mode == OnError::Open
    }

    /// Empties `live`'s refusal caches if an admin reset has cleared state since they were
    /// last emptied: one atomic read per admission otherwise.
    pub(crate) fn forget_refusals_after_reset(&self, live: &Live) {
        let resets = self.inner.resets.load(Ordering::Acquire);
        if live.resets_seen.swap(resets, Ordering::AcqRel) != resets {
            live.keys.forget_refusals();
        }
    }

    /// The process's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Updates the breaker gauge after a store call: read from the Redis store when the call
    /// `failed`, or while the gauge says open (so that it closes again), never otherwise.
    pub(crate) fn note_breaker(&self, failed: bool) {
        let was_open = self.inner.breaker_seen_open.load(Ordering::Relaxed);
        if !failed && !was_open {
            return;
        }
        if let floodgate::store::AnyStore::Redis(redis) = self.store() {
            let open = redis.stats().breaker_open;
            if self.inner.breaker_seen_open.swap(open, Ordering::Relaxed) != open {
                self.inner.metrics.breaker_changed(open);
            }
        }
    }

    /// The process's room for request bodies read before admission.
    pub fn buffers(&self) -> &Buffers {
        &self.inner.buffers
    }

    /// The process's open client connections: a permit each, `[server] max_connections` in
    /// all.
    pub fn connections(&self) -> &Arc<Semaphore> {
        &self.inner.connections
    }

    /// The process's refusal tally.
    pub(crate) fn tally(&self) -> &Tally {
        &self.inner.tally
    }

    /// What the config in force sets: the keys, prices, upstream and alerts secret. A request
    /// takes it once and keeps it to its end.
    pub fn live(&self) -> Arc<Live> {
        let live = self
            .inner
            .live
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(&live)
    }

    /// Builds what `config` sets, for [`AppState::swap`]: everything that can fail, before
    /// anything changes.
    pub fn prepare(&self, config: &Config, process: &Process) -> Result<Live, StartError> {
        Live::build(config, process)
    }

    /// Puts `live` in force: requests that start from now on see it; those in flight, and live
    /// realtime sessions, go on with what they had.
    pub fn swap(&self, live: Live) {
        let mut current = self
            .inner
            .live
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        *current = Arc::new(live);
    }
}
