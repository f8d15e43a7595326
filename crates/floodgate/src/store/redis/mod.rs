//! The Redis store: many replicas, one shared truth.
//!
//! Each decision is one Lua script (`store/redis/*.lua`, hashed and loaded by
//! [`redis::Script`], run with EVALSHA, and loaded again and retried, up to three times, on
//! NOSCRIPT, as after a restart). Redis runs a script to completion before any other command,
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
//!
//! The module, one file per concern: this one holds the store and its [`Store`] operations;
//! `config.rs` the configuration and its URL; `scripts.rs` the scripts (the `*.lua` files beside
//! it), their replay policies and how they are run; `conn.rs` the connection, the errors and the
//! circuit breaker; `group.rs` group commit, shared by the batched calls; `calls.rs` the
//! batched operations (admissions, budget reads, charges), queued for `step.rs`, the one call
//! that carries a batch of them, whose parts `batch.rs` (admissions), `reads.rs` (budget reads)
//! and `charges.rs` (tokens recorded, spend added) pack and answer; `slots.rs` concurrency slots, their
//! leases and renewal; `state.rs` an operator's reads and resets; `stats.rs` the counters.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use ::redis::cluster_routing::Slot;
use ::redis::{Cmd, RedisWrite};

mod batch;
mod calls;
mod charges;
mod cluster;
mod config;
mod conn;
mod doubles;
mod group;
mod reads;
mod releases;
mod scripts;
mod slots;
mod state;
mod stats;
mod step;

pub use config::{DEFAULT_LEASE, OnError, RedisClock, RedisConfig};
pub use scripts::script_source;
pub use stats::RedisStats;

use conn::{Failure, bad_reply};
use group::Lanes;
use releases::ReleaseQueue;
use scripts::{ACQUIRE, Op, PERIODS_RECONCILE, RESET, STATE_CLEAR, STATE_READ};
use stats::{Counters, bump};
use step::StepQueue;

use super::{
    BucketKey, BucketObservation, NameRef, Observation, PeriodObservation, Spent, StateObservation,
    Store,
};
use crate::Error;
use crate::bucket::BucketLimit;
use crate::chain::{ChainLimit, Costs, ScopeKind};
use crate::clock::Timestamp;
use crate::in_flight::{InFlightLimit, Lease};
use crate::period::{Period, PeriodCounter};
use crate::window::{Charge, MAX_COUNT, WindowLimit};

/// The Redis store. Cheap to clone: clones share the connection, the breaker and the counters.
///
/// See the [module documentation](self) for how it decides and fails.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

/// What a store's clones share: the connection and the circuit breaker's state (kept by
/// `conn.rs`), the admission queue (`batch.rs`) and the counters (`stats.rs`).
struct Inner {
    /// The connection calls go through, with its generation: replaced by
    /// [`Inner::fresh_connection`] when a call or a probe times out on it.
    conn: std::sync::RwLock<(u64, conn::Connection)>,
    /// How a fresh connection is made.
    maker: conn::Maker,
    config: RedisConfig,
    /// Admissions, budget reads and charges waiting for the next step, per cluster slot
    /// (`step.rs`).
    steps: Lanes<StepQueue>,
    /// Slot releases waiting for the next release batch (`releases.rs`).
    releases: Lanes<ReleaseQueue>,
    /// The circuit breaker: open while Redis is unreachable; a probe task closes it.
    open: AtomicBool,
    /// Set when a probe closed the breaker, cleared by the first call that succeeds after it:
    /// until then a failure is the same outage (a server that answers `PING` but not scripts,
    /// such as a read-only replica, would otherwise log an outage at every probe).
    unconfirmed: AtomicBool,
    /// When the outage being logged began.
    outage_since: std::sync::Mutex<Option<Instant>>,
    counters: Counters,
    /// This store's random tag in lease members (`slots.rs`), and the next lease number.
    tag: u64,
    leases: AtomicU64,
    /// The leases held, renewed by a task of their own (`slots.rs`).
    held: std::sync::Mutex<slots::Held>,
    /// Refunds and resets made through this store, in this process ([`Store::lowered`]).
    lowered: super::Lowerings,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.inner.config)
            .field("breaker_open", &self.inner.open.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A digest of the data `config` decides on: the server's URL (or the cluster's seeds, in any
/// order) and the keys' prefix.
fn data_identity(config: &RedisConfig) -> u64 {
    use std::hash::BuildHasher;
    let mut seeds = config.cluster.clone();
    seeds.sort_unstable();
    std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
        .hash_one((&config.url, &seeds, &config.prefix))
}

impl RedisStore {
    /// [`Store::add_periods`] (`whole`: [`Store::reserve_periods`]): nothing to do for no
    /// counters; a failure is counted.
    async fn add_periods_counted(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
        whole: bool,
    ) -> Result<PeriodObservation, Error> {
        if counters.is_empty() {
            return Ok(no_periods(now));
        }
        self.add_periods_inner(counters, amount, now, whole)
            .await
            .map_err(|f| {
                bump(&self.inner.counters.errors);
                f.into()
            })
    }

    /// A store for the server `config.url` names, or for the Redis Cluster of
    /// [`RedisConfig::cluster`]'s seeds.
    ///
    /// Fails only on a configuration that can never work (a malformed URL, `rediss://` without
    /// the `tls` feature). An unreachable server is not an error: the store starts with its
    /// circuit breaker open, applies [`OnError`] and connects as soon as Redis answers, so a
    /// service can start before its Redis. Must be called within a Tokio runtime.
    pub async fn connect(config: RedisConfig) -> Result<RedisStore, Error> {
        let maker = conn::client(&config)?;
        let conn = maker.lazy()?;
        // Stores of one process on the same keys (a gateway opens one per worker) share their
        // count of lowerings, so that a refund through one voids what the others' refusal
        // caches remember (docs/design.md §11).
        let lowered = super::Lowerings::of_data(data_identity(&config));
        let store = RedisStore {
            inner: Arc::new(Inner {
                conn: std::sync::RwLock::new((0, conn)),
                maker,
                config,
                steps: Lanes::default(),
                releases: Lanes::default(),
                open: AtomicBool::new(false),
                unconfirmed: AtomicBool::new(false),
                outage_since: std::sync::Mutex::new(None),
                counters: Counters::default(),
                tag: slots::process_tag(),
                leases: AtomicU64::new(1),
                held: std::sync::Mutex::new(slots::Held::default()),
                lowered,
            }),
        };
        let lease = store.inner.config.lease;
        tokio::spawn(slots::renew_leases(Arc::downgrade(&store.inner), lease));
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
    /// in [`RedisStats`] as an admission. On a cluster every node must also answer `PING`.
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
        self.admit_inner(&*PROBE, 1.into(), None)
            .await
            .map(|_| ())
            .map_err(Error::from)?;
        // On a cluster the probe's slot is one primary's: every node must answer too.
        if self.is_cluster() {
            self.ping().await?;
        }
        Ok(())
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

    /// The store's configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// Charges what a served request cost after the fact ([`Spent`]), without a future, each
    /// part once, never replayed, and calls `landed` with the outcome once Redis has them. On one
    /// server the two ride the next call of the step queue as one charge (docs/redis.md,
    /// "Batching"), and `landed` is called on the call's sender, so it must be quick; on a
    /// cluster they are made slot by slot in a task. The same as a `record` and an
    /// `add_periods` awaited together, without a task or a reply channel per charge: what a
    /// metered response costs the gateway.
    pub fn charge_then<F>(&self, spent: Spent<'_>, landed: F)
    where
        F: FnOnce(Result<(), Error>) + Send + 'static,
    {
        // A failure counts as one error for each part that failed, as a `record` and an
        // `add_periods` made apart would.
        let parts = u64::from(spent.records()) + u64::from(spent.adds());
        let inner = Arc::clone(&self.inner);
        self.charge_then_inner(spent, move |done| {
            landed(done.map_err(|f| {
                for _ in 0..parts {
                    bump(&inner.counters.errors);
                }
                f.into()
            }));
        });
    }

    /// Whether this store is on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.config.is_cluster()
    }

    /// The cluster slot of storage key `key`, or `None` on one server. A prefix without braces
    /// leaves the key's own hash tag in force; one with braces is hashed as Redis does.
    fn slot(&self, key: &str) -> Option<Slot> {
        if !self.is_cluster() {
            return None;
        }
        let prefix = &self.inner.config.prefix;
        Some(if prefix.contains(['{', '}']) {
            Slot::for_key(self.redis_key(key))
        } else {
            Slot::for_key(key)
        })
    }

    /// The positions of `items` grouped by the slot of each one's key, the groups in the order
    /// of their first item, each in order. One group, of everything, on one server.
    fn by_slot<T>(&self, items: &[T], key: impl Fn(&T) -> &str) -> Vec<(Option<Slot>, Vec<usize>)> {
        let mut groups: Vec<(Option<Slot>, Vec<usize>)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let slot = self.slot(key(item));
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, members)) => members.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        groups
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

/// How admit_holding.lua takes a limit: `a` charged at admission (requests, and reserved
/// tokens, decided and charged alike at admission), `r` reactive, `s` appended for a shadow one.
fn kind_arg(l: &ChainLimit) -> &'static str {
    match (l.charge().at_admission(), l.is_shadow()) {
        (true, false) => "a",
        (false, false) => "r",
        (true, true) => "as",
        (false, true) => "rs",
    }
}

/// How admit.lua takes a limit, as a number (its arguments are numbers: `doubles.rs`): 1 charged
/// at admission, 2 reactive, 3 and 4 the same for a shadow one.
fn kind_code(l: &ChainLimit) -> u64 {
    match (l.charge().at_admission(), l.is_shadow()) {
        (true, false) => 1,
        (false, false) => 2,
        (true, true) => 3,
        (false, true) => 4,
    }
}

impl Store for RedisStore {
    async fn admit(
        &self,
        limits: &[ChainLimit],
        cost: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Result<Observation, Error> {
        let decided = if self.is_cluster() {
            self.admit_across(limits, &[], cost, None, now).await
        } else {
            self.admit_inner(limits, cost, now).await
        };
        match decided {
            Ok(seen) => Ok(seen),
            Err(failure) => {
                self.fail(failure)?;
                Ok(unchecked(now))
            }
        }
    }

    fn lowered(&self) -> u128 {
        self.inner.lowered.get()
    }

    async fn admit_within(
        &self,
        counters: &[PeriodCounter],
        caps: &[u64],
        limits: &[ChainLimit],
        cost: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Result<(PeriodObservation, Option<Observation>), Error> {
        if self.is_cluster() || counters.is_empty() || limits.is_empty() {
            // A chain and its budgets may lie in different slots: two calls, as the default.
            return super::read_then_admit(self, counters, caps, limits, cost, now).await;
        }
        match self.admit_gated(limits, cost, counters, caps, now).await {
            Ok((seen, totals)) => {
                let read = PeriodObservation {
                    now: seen.now,
                    enforced: true,
                    totals,
                };
                let admitted = !super::at_cap(&read, caps);
                Ok((read, admitted.then_some(seen)))
            }
            Err(failure) => {
                // Unreachable: as the read and then the admission would each have answered,
                // unchecked (open) or an error (closed).
                self.fail(failure)?;
                let read = PeriodObservation {
                    now: now.unwrap_or_else(Timestamp::now),
                    enforced: false,
                    totals: vec![0; counters.len()],
                };
                Ok((read, Some(unchecked(now))))
            }
        }
    }

    fn lease(&self) -> Lease {
        Lease::from_id(self.inner.leases.fetch_add(1, Ordering::Relaxed))
    }

    async fn admit_holding(
        &self,
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        cost: Costs<'_>,
        lease: Lease,
        now: Option<Timestamp>,
    ) -> Result<Observation, Error> {
        let decided = if self.is_cluster() {
            self.admit_across(limits, slots, cost, Some(lease), now)
                .await
        } else {
            self.admit_holding_inner(limits, slots, cost, lease, now)
                .await
        };
        match decided {
            Ok(seen) => Ok(seen),
            Err(failure) => {
                self.fail(failure)?;
                Ok(unchecked(now))
            }
        }
    }

    async fn release(
        &self,
        slots: &[InFlightLimit],
        lease: Lease,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        self.release_inner(slots, lease, now).await.map_err(|f| {
            bump(&self.inner.counters.errors);
            f.into()
        })
    }

    async fn read_running(
        &self,
        slots: &[InFlightLimit],
        now: Option<Timestamp>,
    ) -> Result<Vec<u64>, Error> {
        self.read_running_inner(slots, now).await.map_err(|f| {
            bump(&self.inner.counters.errors);
            f.into()
        })
    }

    async fn record(
        &self,
        limits: &[ChainLimit],
        units: u64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        self.record_inner(limits, units, now).await.map_err(|f| {
            bump(&self.inner.counters.errors);
            f.into()
        })
    }

    async fn reconcile(
        &self,
        limits: &[ChainLimit],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        if delta == 0 {
            return Ok(());
        }
        let reserved: Vec<&ChainLimit> = limits
            .iter()
            .filter(|l| l.charge() == Charge::Reserved)
            .collect();
        if reserved.is_empty() {
            return Ok(());
        }
        // A refund lowers a count: this process's refusal caches on this store stop answering
        // from what they saw before it, before it goes out and again once it has landed
        // (docs/design.md §11). Other processes' caches are not told.
        let refund = delta < 0;
        if refund {
            self.inner.lowered.bump();
        }
        let done = self
            .add_to_buckets(&reserved, reserved_at, delta, now)
            .await;
        if refund {
            self.inner.lowered.bump();
        }
        done.map_err(|f| {
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
        match self.read_periods_inner(counters, now).await {
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
        self.add_periods_counted(counters, amount, now, false).await
    }

    async fn reserve_periods(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Error> {
        self.add_periods_counted(counters, amount, now, true).await
    }

    async fn reconcile_periods(
        &self,
        counters: &[PeriodCounter],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        if counters.is_empty() || delta == 0 {
            return Ok(());
        }
        // One call per slot on a cluster (a counter is its own add: nothing spans them). A slot
        // that fails keeps its part; the others are still sent (a refused request's refund left
        // out of every slot after the failed one would stay charged there for the period).
        let mut failed = None;
        for (_, part) in self.by_slot(counters, |c| c.key()) {
            let n = part.len();
            let mut cmd = self.evalsha(&PERIODS_RECONCILE, n, 3 + n);
            for &i in &part {
                self.key_arg(&mut cmd, &[counters[i].key()]);
            }
            self.time_arg(&mut cmd, now);
            cmd.arg(delta).arg(reserved_at.as_micros());
            for &i in &part {
                cmd.arg(counters[i].period().as_str());
            }
            let op = &PERIODS_RECONCILE;
            if let Err(f) = self.inner.run::<()>(op, &cmd).await {
                bump(&self.inner.counters.errors);
                failed.get_or_insert(Error::from(f));
            }
        }
        failed.map_or(Ok(()), Err)
    }

    async fn read_state(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<StateObservation, Error> {
        self.state_call(&STATE_READ, limits, counters, now).await
    }

    async fn clear_state(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<StateObservation, Error> {
        // A reset lowers counts, as a refund does (docs/design.md §11).
        self.inner.lowered.bump();
        let cleared = self.state_call(&STATE_CLEAR, limits, counters, now).await;
        self.inner.lowered.bump();
        cleared
    }
}

/// How admit.lua takes a counter's period: 1 for a day, 2 for a month.
fn period_code(period: Period) -> u64 {
    match period {
        Period::Day => 1,
        Period::Month => 2,
    }
}

/// The observation of an admission the store could not check and let through (fail open).
fn unchecked(now: Option<Timestamp>) -> Observation {
    Observation {
        now: now.unwrap_or_else(Timestamp::now),
        admitted: true,
        enforced: false,
        snapshots: Vec::new(),
        running: Vec::new(),
        at: Vec::new(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_ttl_is_two_windows_in_whole_ms() {
        assert_eq!(ttl_millis(60_000_000), 120_000);
        assert_eq!(ttl_millis(1), 1);
    }
}
