//! The Redis store against a real Redis.
//!
//! Every test reads `FLOODGATE_TEST_REDIS_URL` and returns early with a note when it is unset,
//! unless `FLOODGATE_REQUIRE_REDIS=1` (CI), when a skip is a failure. Each test works under its
//! own random key prefix, so tests run in parallel on one server. Tests that disturb a server
//! (killing its clients, stopping it) start their own `redis-server` from `PATH` on a free port
//! and stop it when done.
#![cfg(feature = "redis")]

mod common;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::bucket::BucketLimit;
use floodgate::store::redis::{OnError, RedisClock, RedisConfig, RedisStore};
use floodgate::store::{AnyStore, BucketKey, MemoryStore, NameRef, Store};
use floodgate::{
    Admission, Budget, Budgets, Chain, ChainLimit, Charge, Error, InFlightLimit, Period, Rate,
    ScopeKind, Timestamp, TokenBucket, WindowLimit,
};
use redis::AsyncCommands;
use tokio::task::JoinSet;

/// The test server's URL, or `None` (with a note) when Redis tests are not enabled.
fn redis_url(test: &str) -> Option<String> {
    common::server_from_env("FLOODGATE_TEST_REDIS_URL", test)
}

fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    h.finish()
}

/// A key prefix no other test (or run) uses.
fn fresh_prefix() -> String {
    format!("fgtest:{:016x}:", random_u64())
}

fn config(url: &str) -> RedisConfig {
    RedisConfig {
        prefix: fresh_prefix(),
        ..RedisConfig::new(url)
    }
}

async fn store(url: &str) -> RedisStore {
    RedisStore::connect(config(url)).await.unwrap()
}

/// Cuts every normal client's connection to `server` (the store's among them), as a
/// `CLIENT KILL` by an operator or a proxy's idle timeout would, and lets the store see it.
async fn kill_clients(server: &Server) {
    let killed: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal"])
        .query_async(&mut raw(&server.url()).await)
        .await
        .unwrap();
    assert!(killed >= 1);
}

/// A separate plain connection, to read and disturb what the store wrote.
async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The `cur` count stored for a window key: state is "bucket cur prev".
async fn stored_cur(url: &str, store: &RedisStore, key: &str) -> u64 {
    let v: Option<String> = raw(url).await.get(store.redis_key(key)).await.unwrap();
    let v = v.unwrap_or_else(|| panic!("no state at {key}"));
    v.split(' ').nth(1).unwrap().parse().unwrap()
}

/// Waits (within `within`) until `chain` is enforced on `store` again after an outage: its
/// admissions decided by Redis, not failed open; fails naming `what` and the store's stats.
async fn until_enforced(chain: &Chain, store: &RedisStore, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    loop {
        let d = chain.admit(store, 1).await;
        if matches!(&d, Ok(d) if d.enforced) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {d:?}, {:?}",
            store.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn req(id: &str, scope: ScopeKind, max: u64) -> ChainLimit {
    ChainLimit::new(
        "org:acme",
        scope,
        id,
        Charge::Admission,
        WindowLimit::per_minute(max),
    )
}

fn pinned(secs: u64) -> Timestamp {
    Timestamp::from_micros(common::T0 + secs * 1_000_000)
}

/// A `redis-server` of a test's own, on a free port, stopped (and its files removed) on drop.
struct Server {
    port: u16,
    password: String,
    dir: PathBuf,
    child: Option<Child>,
}

impl Server {
    /// Starts one, or returns `None` (with a note) if `redis-server` is not on `PATH`.
    fn start(test: &str) -> Option<Server> {
        let found = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            assert!(
                !common::redis_required(),
                "{test}: FLOODGATE_REQUIRE_REDIS=1 but redis-server is not on PATH"
            );
            eprintln!("{test}: skipped, redis-server is not on PATH");
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("floodgate-test-{port}-{:x}", random_u64()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Server {
            port,
            password: format!("pw{:x}", random_u64()),
            dir,
            child: None,
        };
        server.restart();
        Some(server)
    }

    /// The URL, password included (the store must accept it).
    fn url(&self) -> String {
        format!("redis://:{}@127.0.0.1:{}/0", self.password, self.port)
    }

    /// Starts the server (again) on the same port and waits until it accepts connections.
    fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(["--requirepass", &self.password])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server as an operator would: `redis-cli shutdown nosave`.
    fn stop(&mut self) {
        let _ = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "-a", &self.password])
            .args(["--no-auth-warning", "shutdown", "nosave"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Two stores of one process on the same keys (a gateway's workers, each with its own
/// connection) share their count of lowerings: a refund through one voids the refusal a chain
/// remembered on the other, which would otherwise refuse a request the store now admits.
#[tokio::test]
async fn a_refund_through_one_store_voids_a_refusal_remembered_on_another_of_the_same_keys() {
    let Some(url) = redis_url(
        "a_refund_through_one_store_voids_a_refusal_remembered_on_another_of_the_same_keys",
    ) else {
        return;
    };
    let config = config(&url);
    let (one, two) = (
        RedisStore::connect(config.clone()).await.unwrap(),
        RedisStore::connect(config).await.unwrap(),
    );
    let reserving = || {
        Chain::new(vec![ChainLimit::new(
            "org:a",
            ScopeKind::Org,
            "a",
            Charge::Reserved,
            WindowLimit::per_hour(1000),
        )])
        .cache_refusals()
    };
    // One chain per worker, as each worker builds its own.
    let (first, second) = (reserving(), reserving());
    let t = Timestamp::from_secs(1_800_000_000);
    let a = first.admit_at(&one, 980, t).await.unwrap();
    assert!(a.admitted);
    assert!(!second.admit_at(&two, 180, t).await.unwrap().admitted);
    assert!(second.cached_refusal(&two, 180u64, Some(t)).is_some());
    // The first request used 20: 960 go back, through the first worker's store.
    first.reconcile_at(&one, a.now, 20 - 980, t).await.unwrap();
    assert!(second.cached_refusal(&two, 180u64, Some(t)).is_none());
    assert!(second.admit_at(&two, 180, t).await.unwrap().admitted);
}

/// A refusal decided at a pinned instant does not answer an unpinned request: on Redis the
/// store decides those at its own clock (`TIME`), which may be anywhere from the pinned
/// instant (docs/design.md §11). Pinned five minutes back, a minute's limit has long emptied.
#[tokio::test]
async fn a_refusal_at_a_pinned_instant_does_not_answer_on_the_stores_clock() {
    let Some(url) = redis_url("a_refusal_at_a_pinned_instant_does_not_answer_on_the_stores_clock")
    else {
        return;
    };
    let store = store(&url).await;
    let chain = Chain::new(vec![ChainLimit::new(
        "org:pin",
        ScopeKind::Key,
        "pin",
        Charge::Admission,
        WindowLimit::per_minute(1),
    )])
    .cache_refusals();
    let past = Timestamp::from_micros(Timestamp::now().as_micros() - 300_000_000);
    assert!(chain.admit_at(&store, 1, past).await.unwrap().admitted);
    assert!(!chain.admit_at(&store, 1, past).await.unwrap().admitted);
    // Remembered, for requests pinned at or after it...
    assert!(chain.cached_refusal(&store, 1u64, Some(past)).is_some());
    // ...but not for one on the store's clock, which the store admits.
    assert!(chain.cached_refusal(&store, 1u64, None).is_none());
    assert!(chain.admit(&store, 1).await.unwrap().admitted);
}

/// Expiries of a whole multiple of 10^8 ms are set: Redis 7.2.0-7.2.4 print such a Lua number
/// as `1e+08`, which `PX` refuses, so every script hands `PX` digits.
#[tokio::test]
async fn expiries_of_a_multiple_of_ten_to_the_eighth_ms_are_set() {
    let Some(url) = redis_url("expiries_of_a_multiple_of_ten_to_the_eighth_ms_are_set") else {
        return;
    };
    let store = store(&url).await;
    let tag = RandomState::new().build_hasher().finish();
    // A bucket of one token refilled in 100 000 s: emptied, it is kept 10^8 ms.
    const SLOW: TokenBucket<str> =
        TokenBucket::new("px-slow", 1, Rate::new(1, Duration::from_secs(100_000)));
    let name = format!("b{tag}");
    let t = Timestamp::from_secs(1_796_156_000);
    assert!(
        SLOW.acquire_at(&store, &name, 1, t)
            .await
            .unwrap()
            .is_allowed()
    );
    assert!(
        !SLOW
            .acquire_at(&store, &name, 1, t)
            .await
            .unwrap()
            .is_allowed()
    );
    // A day counter reconciled at 20:13:20 UTC: it is kept until a day after its day ends,
    // 10^8 ms later.
    let day = floodgate::PeriodCounter::new(format!("{{org:px}}:budget:{tag}"), Period::Day);
    let days = std::slice::from_ref(&day);
    store.add_periods(days, 1, Some(t)).await.unwrap();
    store.reconcile_periods(days, t, 5, Some(t)).await.unwrap();
    let read = store.read_periods(days, Some(t)).await.unwrap();
    assert_eq!(read.totals, [6]);
}

#[tokio::test]
async fn shared_vectors_pass_on_redis() {
    let Some(url) = redis_url("shared_vectors_pass_on_redis") else {
        return;
    };
    common::run_vectors(&store(&url).await).await;
    // And through the run-time choice of backend.
    common::run_vectors(&AnyStore::from(store(&url).await)).await;
}

#[tokio::test]
async fn charges_made_without_a_future_land_once_each_in_a_few_calls() {
    let Some(url) = redis_url("charges_made_without_a_future_land_once_each_in_a_few_calls") else {
        return;
    };
    let redis = store(&url).await;
    let before = redis.stats().charge_batches;
    common::run_charge_then(&AnyStore::from(redis.clone())).await;
    let calls = redis.stats().charge_batches - before;
    assert!(calls < 40, "40 charges in {calls} calls");
}

#[test]
fn a_charge_made_outside_a_runtime_fails_and_leaves_the_queue_working() {
    let Some(url) = redis_url("a_charge_made_outside_a_runtime_fails_and_leaves_the_queue_working")
    else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let redis = runtime.block_on(store(&url));
    // A key of this run's own: the server may keep an earlier run's.
    let limits = [ChainLimit::new(
        "org:nr",
        ScopeKind::Key,
        &format!("nr{}", std::process::id()),
        Charge::Reactive,
        WindowLimit::per_minute(100),
    )];
    // From a thread with no runtime (a drop at shutdown, say): answered at once, as failed.
    let (landed, lands) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            redis.charge_then(common::spent(&limits, 5, &[], 0), move |done| {
                landed.send(done).unwrap()
            })
        });
    });
    assert!(lands.recv().unwrap().is_err());
    // The queue was left as it was: the next charge and admission go.
    runtime.block_on(async {
        let (landed, mut lands) = tokio::sync::mpsc::unbounded_channel();
        redis.charge_then(common::spent(&limits, 5, &[], 0), move |done| {
            landed.send(done).unwrap()
        });
        assert!(lands.recv().await.unwrap().is_ok());
        let seen = redis.read_state(&limits, &[], None).await.unwrap();
        assert_eq!(seen.snapshots[0].cur + seen.snapshots[0].prev, 5);
    });
}

#[tokio::test]
async fn a_cached_refusal_on_redis_is_the_stores_own() {
    let Some(url) = redis_url("a_cached_refusal_on_redis_is_the_stores_own") else {
        return;
    };
    common::run_refusal_cache_sweep(&store(&url).await).await;
}

#[tokio::test]
async fn state_read_and_clear_on_redis() {
    let Some(url) = redis_url("state_read_and_clear_on_redis") else {
        return;
    };
    let store = store(&url).await;
    common::run_state_read_and_clear(&store).await;
    // A read writes nothing: of the 1 200 limits read and the cleared ones, only those admitted
    // since exist.
    let mut raw = raw(&url).await;
    let keys: Vec<String> = raw
        .keys(format!("{}*", store.config().prefix))
        .await
        .unwrap();
    let mut keys: Vec<&str> = keys
        .iter()
        .map(|k| &k[store.config().prefix.len()..])
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        ["{org:acme}:key:many1100:req", "{org:acme}:key:st:req"],
        "{keys:?}"
    );
    // Unreachable: an error, not zeros, even on a store that fails open.
    let mut down = config("redis://127.0.0.1:1");
    down.on_error = OnError::Open;
    let down = RedisStore::connect(down).await.unwrap();
    let limits = [req("x", ScopeKind::Key, 1)];
    assert!(down.read_state(&limits, &[], None).await.is_err());
    assert!(down.clear_state(&limits, &[], None).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_admissions_past_a_shadow_limit_charge_it_in_batches() {
    let Some(url) = redis_url("concurrent_admissions_past_a_shadow_limit_charge_it_in_batches")
    else {
        return;
    };
    let store = store(&url).await;
    common::race_past_a_shadow_limit(store.clone()).await;
    assert!(store.stats().admit_batches < 64, "{:?}", store.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reserves_budgets_exactly() {
    let Some(url) = redis_url("reserves_budgets_exactly") else {
        return;
    };
    let tenant = format!("org:race-{}", std::process::id());
    common::race_reserved_budget(store(&url).await, &tenant).await;
}

#[tokio::test]
async fn reserves_tokens_while_holding_slots() {
    let Some(url) = redis_url("reserves_tokens_while_holding_slots") else {
        return;
    };
    common::run_reserved_holding(&store(&url).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reservations_take_exactly_the_free_tokens_in_batches() {
    let Some(url) = redis_url("concurrent_reservations_take_exactly_the_free_tokens_in_batches")
    else {
        return;
    };
    let store = store(&url).await;
    common::race_reserved_tokens(store.clone()).await;
    assert!(store.stats().admit_batches < 40, "{:?}", store.stats());
}

#[tokio::test]
async fn a_shadow_limit_charged_past_two_to_the_fifty_third_stops_there_on_both_stores() {
    let Some(url) =
        redis_url("a_shadow_limit_charged_past_two_to_the_fifty_third_stops_there_on_both_stores")
    else {
        return;
    };
    // No enforced limit bounds the cost: a shadow limit admits any, and its count stops at 2^53
    // (in the script, and in the client's replay of a batch).
    let memory = MemoryStore::new();
    let redis = store(&url).await;
    let limits = Arc::new(vec![req("huge", ScopeKind::Key, 10).shadow()]);
    let now = Some(pinned(23));
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let (redis, limits) = (redis.clone(), limits.clone());
            tokio::spawn(async move { redis.admit(&limits, u64::MAX.into(), now).await.unwrap() })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let r = task.await.unwrap();
        assert!(r.admitted && r.enforced, "request {i}");
        assert_eq!(
            memory.admit(&limits, u64::MAX.into(), now).await.unwrap(),
            r,
            "request {i}"
        );
    }
    assert_eq!(stored_cur(&url, &redis, limits[0].key()).await, 1 << 53);
}

#[tokio::test]
async fn a_budget_checked_admission_on_redis_is_the_check_then_the_admission_in_one_call() {
    let Some(url) = redis_url(
        "a_budget_checked_admission_on_redis_is_the_check_then_the_admission_in_one_call",
    ) else {
        return;
    };
    let redis = store(&url).await;
    common::run_admit_within(&redis, "org:acme").await;
    // Every budget check rode its admission, one call each, no read call of its own: six
    // budget-checked requests and one state read (admissions), one spend (a charge).
    let stats = redis.stats();
    assert_eq!(
        (
            stats.admit_batches,
            stats.read_batches,
            stats.charge_batches
        ),
        (7, 0, 1),
        "{stats:?}"
    );
    common::run_admit_within(&AnyStore::from(store(&url).await), "org:acme").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_checked_admissions_with_many_counters_are_split_across_calls() {
    let test = "budget_checked_admissions_with_many_counters_are_split_across_calls";
    let Some(url) = redis_url(test) else {
        return;
    };
    let redis = store(&url).await;
    let prefix = fresh_prefix();
    // 512 admissions in flight, each one limit and sixteen budget counters: 8 704 keys, more
    // than one script call can unpack onto Lua's stack. Before, the batch bound counted only
    // the limits, and all of them went in one call that Redis refused.
    let mut tasks = JoinSet::new();
    for i in 0..512 {
        let redis = redis.clone();
        let prefix = prefix.clone();
        tasks.spawn(async move {
            let limits = vec![ChainLimit::new(
                &format!("{prefix}org:{i}"),
                ScopeKind::Key,
                &format!("k{i}"),
                Charge::Admission,
                WindowLimit::per_minute(100),
            )];
            let counters: Vec<floodgate::PeriodCounter> = (0..16)
                .map(|c| {
                    let key = format!("{{{prefix}org:{i}}}:budget:{c}");
                    floodgate::PeriodCounter::new(key, Period::Day)
                })
                .collect();
            let caps = vec![1_000; counters.len()];
            redis
                .admit_within(&counters, &caps, &limits, 1.into(), None)
                .await
        });
    }
    while let Some(done) = tasks.join_next().await {
        let (_, admission) = done
            .unwrap()
            .expect("each budget-checked admission is decided");
        assert!(admission.is_some_and(|a| a.admitted));
    }
}

#[tokio::test]
async fn period_vectors_pass_on_redis() {
    let Some(url) = redis_url("period_vectors_pass_on_redis") else {
        return;
    };
    common::run_period_vectors(&store(&url).await).await;
    common::run_period_vectors(&AnyStore::from(store(&url).await)).await;
    // No counters: nothing to ask (MGET would refuse no keys).
    let s = store(&url).await;
    assert!(s.read_periods(&[], None).await.unwrap().totals.is_empty());
    assert!(s.add_periods(&[], 5, None).await.unwrap().totals.is_empty());
}

/// A small deterministic generator: the differential test's sequence is fixed by its seed.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[tokio::test]
async fn random_operations_decide_identically_on_memory_and_redis() {
    let Some(url) = redis_url("random_operations_decide_identically_on_memory_and_redis") else {
        return;
    };
    use Charge::{Admission as A, Reactive as R};
    use ScopeKind::*;
    let l = |tenant: &str, scope, id: &str, charge, max, secs| {
        ChainLimit::new(
            tenant,
            scope,
            id,
            charge,
            WindowLimit::new(max, Duration::from_secs(secs)),
        )
    };
    // Chains sharing an org, a team and a gateway limit; small limits so refusals are common;
    // windows of 60 s and more, which no test run outlasts in real time (Redis expires keys in
    // real time, the memory store on the pinned clock). Shadow limits, often over and charged
    // past their max, ride along: they change no decision, and their counts must agree too.
    let chains = [
        vec![
            l("org:a", Key, "k1", A, 3, 60),
            l("org:a", Key, "k1", R, 40, 60),
            l("org:a", Team, "t", A, 5, 60),
            l("org:a", Project, "p", A, 1, 60).shadow(),
            l("org:a", Org, "a", A, 7, 3600),
            l("org:a", Org, "a", R, 100, 3600),
        ],
        vec![
            l("org:a", Key, "k2", A, 2, 90),
            l("org:a", Team, "t", A, 5, 60),
            l("org:a", Org, "a", A, 7, 3600),
            l("org:a", Org, "a", R, 100, 3600),
        ],
        vec![
            l("org:b", Key, "k3", R, 25, 60),
            l("org:b", Key, "k3", R, 5, 600).shadow(),
            l("org:b", Org, "b", A, 4, 120),
            l("gw", Gateway, "all", A, 12, 60),
            l("gw", Gateway, "all", A, 1, 3600).shadow(),
        ],
        vec![l("gw", Gateway, "all", A, 12, 60)],
    ];
    // Fractional refill rates (1/30 token per second is not a binary fraction) to test that
    // state round-trips bit for bit.
    let buckets = [
        BucketLimit {
            capacity: 20,
            rate: Rate::new(1, Duration::from_secs(30)),
        },
        BucketLimit {
            capacity: 5,
            rate: Rate::new(7, Duration::from_millis(113_300)),
        },
        BucketLimit {
            capacity: 1,
            rate: Rate::new(3, Duration::from_secs(70)),
        },
        BucketLimit {
            capacity: 0,
            rate: Rate::per_second(1),
        },
    ];
    for seed in [0x9e37_79b9_7f4a_7c15_u64, 0xdead_beef_cafe_f00d, 42] {
        let memory = MemoryStore::new();
        let redis = store(&url).await;
        let mut rng = XorShift(seed);
        let mut t = common::T0 + rng.below(60_000_000);
        let (mut fractional, mut refused) = (0, 0);
        for i in 0..1500 {
            // 40% admissions, 15% records, 40% acquires, 5% resets.
            let op = match rng.below(20) {
                0..=7 => 0,
                8..=10 => 4,
                11..=18 => 6,
                _ => 9,
            };
            // Token-bucket operations always advance the pinned clock by at least 20 ms, far
            // more than an operation takes in real time, so that no key can expire in Redis
            // (real time) while alive in memory (pinned time); chain operations may share an
            // instant. Now and then a long jump lets state expire on the pinned clock.
            let step = match (op, rng.below(200)) {
                (0..=5, 0..=19) => 0,
                (0..=5, 20..=39) => rng.below(50_000),
                (_, 199) => 20_000 + rng.below(200_000_000),
                _ => 20_000 + rng.below(500_000),
            };
            t += step;
            let now = Some(Timestamp::from_micros(t));
            let ctx = format!("seed {seed:#x}, op {i}, t {t}");
            match op {
                0..=3 => {
                    let limits = &chains[rng.below(4) as usize];
                    let cost = 1 + rng.below(2);
                    let m = memory.admit(limits, cost.into(), now).await.unwrap();
                    let r = redis.admit(limits, cost.into(), now).await.unwrap();
                    assert!(r.enforced, "{ctx}");
                    assert_eq!(m, r, "{ctx}: admit");
                    refused += u32::from(!r.admitted);
                }
                4 | 5 => {
                    let limits = &chains[rng.below(4) as usize];
                    let units = rng.below(30);
                    memory.record(limits, units, now).await.unwrap();
                    redis.record(limits, units, now).await.unwrap();
                }
                6 => {
                    let b = rng.below(4) as usize;
                    let name = format!("{}-{b}", rng.below(2));
                    let key = BucketKey {
                        limiter: "diff",
                        name: NameRef::Text(&name),
                    };
                    let limit = buckets[b];
                    let cost = rng.below(limit.capacity + 1).min(1 + rng.below(4));
                    let m = memory.acquire(key, limit, cost, now).await.unwrap();
                    let r = redis.acquire(key, limit, cost, now).await.unwrap();
                    assert!(r.enforced, "{ctx}");
                    assert_eq!(m.tokens.to_bits(), r.tokens.to_bits(), "{ctx}: tokens");
                    assert_eq!(m, r, "{ctx}: acquire");
                    fractional += u32::from(m.tokens.fract() != 0.0);
                }
                _ => {
                    let b = rng.below(4) as usize;
                    let name = format!("{}-{b}", rng.below(2));
                    let key = BucketKey {
                        limiter: "diff",
                        name: NameRef::Text(&name),
                    };
                    let m = memory.reset(key, buckets[b], now).await.unwrap();
                    let r = redis.reset(key, buckets[b], now).await.unwrap();
                    assert_eq!(m, r, "{ctx}: reset");
                }
            }
        }
        let stats = redis.stats();
        assert_eq!(stats.failed_open + stats.errors + stats.replays, 0);
        // The sequence exercises what it must: fractional token state, refusals and admissions.
        eprintln!("seed {seed:#x}: {fractional} fractional buckets, {refused} refusals, {stats:?}");
        assert!(fractional > 100, "only {fractional} fractional buckets");
        assert!(
            refused > 50 && stats.admitted > 300,
            "{refused} refusals, {stats:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_requests_against_one_per_minute_admit_one() {
    let Some(url) = redis_url("sixty_four_concurrent_requests_against_one_per_minute_admit_one")
    else {
        return;
    };
    let store = store(&url).await;
    let chain = Arc::new(Chain::new(vec![req("solo", ScopeKind::Key, 1)]));
    let mut tasks = JoinSet::new();
    for _ in 0..64 {
        let (store, chain) = (store.clone(), chain.clone());
        tasks.spawn(async move { chain.admit(&store, 1).await.unwrap() });
    }
    let decisions = tasks.join_all().await;
    assert!(decisions.iter().all(|d| d.enforced));
    assert_eq!(decisions.iter().filter(|d| d.admitted).count(), 1);
    assert_eq!(store.stats().admitted, 1);
    assert_eq!(store.stats().refused, 63);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_race_ninety_six_requests_against_five_per_minute() {
    let Some(url) = redis_url("three_replicas_race_ninety_six_requests_against_five_per_minute")
    else {
        return;
    };
    // Three stores, three connections: three replicas sharing one Redis.
    let first = store(&url).await;
    let mut replicas = vec![first.clone()];
    for _ in 0..2 {
        let cfg = RedisConfig {
            prefix: first.config().prefix.clone(),
            ..RedisConfig::new(url.clone())
        };
        replicas.push(RedisStore::connect(cfg).await.unwrap());
    }
    let chain = Arc::new(Chain::new(vec![req("race", ScopeKind::Key, 5)]));
    let now = pinned(7);
    let mut tasks = JoinSet::new();
    for i in 0..96 {
        let (store, chain) = (replicas[i % 3].clone(), chain.clone());
        tasks.spawn(async move { chain.admit_at(&store, 1, now).await.unwrap() });
    }
    let decisions = tasks.join_all().await;
    assert!(decisions.iter().all(|d| d.enforced));
    assert_eq!(decisions.iter().filter(|d| d.admitted).count(), 5);
    let key = chain.limits()[0].key();
    assert_eq!(stored_cur(&url, &first, key).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn org_is_charged_only_what_its_keys_admitted() {
    let Some(url) = redis_url("org_is_charged_only_what_its_keys_admitted") else {
        return;
    };
    let store = store(&url).await;
    let now = pinned(3);
    // A roomy org: each key's cap wins, and the org counts exactly what the keys admitted.
    let org = req("acme", ScopeKind::Org, 100);
    let k1 = Arc::new(Chain::new(vec![req("k1", ScopeKind::Key, 3), org.clone()]));
    let k2 = Arc::new(Chain::new(vec![req("k2", ScopeKind::Key, 4), org.clone()]));
    let mut tasks = JoinSet::new();
    for i in 0..60 {
        let chain = if i % 2 == 0 { k1.clone() } else { k2.clone() };
        let store = store.clone();
        tasks.spawn(async move { (i % 2, chain.admit_at(&store, 1, now).await.unwrap()) });
    }
    let decisions = tasks.join_all().await;
    let admitted = |k| {
        decisions
            .iter()
            .filter(|(i, d)| *i == k && d.admitted)
            .count()
    };
    assert_eq!((admitted(0), admitted(1)), (3, 4));
    for (_, d) in &decisions {
        assert!(d.enforced);
        if !d.admitted {
            assert_eq!(
                d.refused_by,
                Some(0),
                "the key's cap refuses, not the org's"
            );
        }
    }
    assert_eq!(stored_cur(&url, &store, org.key()).await, 7);

    // A tight org: it admits 5 in all; each key and the org count only admitted requests.
    let org = req("tight", ScopeKind::Org, 5);
    let k3 = Arc::new(Chain::new(vec![req("k3", ScopeKind::Key, 3), org.clone()]));
    let k4 = Arc::new(Chain::new(vec![req("k4", ScopeKind::Key, 4), org.clone()]));
    let mut tasks = JoinSet::new();
    for i in 0..60 {
        let chain = if i % 2 == 0 { k3.clone() } else { k4.clone() };
        let store = store.clone();
        tasks.spawn(async move { (i % 2, chain.admit_at(&store, 1, now).await.unwrap()) });
    }
    let decisions = tasks.join_all().await;
    let (a3, a4) = (
        decisions
            .iter()
            .filter(|(i, d)| *i == 0 && d.admitted)
            .count() as u64,
        decisions
            .iter()
            .filter(|(i, d)| *i == 1 && d.admitted)
            .count() as u64,
    );
    assert_eq!(a3 + a4, 5);
    assert_eq!(stored_cur(&url, &store, org.key()).await, 5);
    if a3 > 0 {
        assert_eq!(stored_cur(&url, &store, k3.limits()[0].key()).await, a3);
    }
    if a4 > 0 {
        assert_eq!(stored_cur(&url, &store, k4.limits()[0].key()).await, a4);
    }
}

#[tokio::test]
async fn window_boundaries_weigh_the_previous_bucket_in_full_then_half() {
    let Some(url) = redis_url("window_boundaries_weigh_the_previous_bucket_in_full_then_half")
    else {
        return;
    };
    let redis = store(&url).await;
    let memory = MemoryStore::new();
    let chain = Chain::new(vec![req("edge", ScopeKind::Key, 10)]);
    // T0 is a minute boundary: fill the bucket [T0, T0 + 60 s).
    for i in 0..10 {
        let d = chain.admit_at(&redis, 1, pinned(1)).await.unwrap();
        assert!(d.admitted, "request {i}");
    }
    assert!(
        !chain
            .admit_at(&redis, 1, pinned(59))
            .await
            .unwrap()
            .admitted
    );
    // On the boundary the previous bucket weighs in full: nothing passes.
    let d = chain.admit_at(&redis, 1, pinned(60)).await.unwrap();
    assert!(!d.admitted);
    assert_eq!(d.statuses[0].remaining, 0);
    assert_eq!(d.retry_after, Some(Duration::from_secs(6)));
    // Half way through, it weighs half: exactly 5 more pass.
    let admitted = {
        let mut n = 0;
        for _ in 0..10 {
            n += u32::from(
                chain
                    .admit_at(&redis, 1, pinned(90))
                    .await
                    .unwrap()
                    .admitted,
            );
        }
        n
    };
    assert_eq!(admitted, 5);
    // The memory store agrees on every step.
    for _ in 0..10 {
        chain.admit_at(&memory, 1, pinned(1)).await.unwrap();
    }
    let m = chain.admit_at(&memory, 1, pinned(60)).await.unwrap();
    assert_eq!(m, d);
}

#[tokio::test]
async fn full_token_window_refuses_and_charges_no_request_slot() {
    let Some(url) = redis_url("full_token_window_refuses_and_charges_no_request_slot") else {
        return;
    };
    let store = store(&url).await;
    let requests = req("t", ScopeKind::Key, 10);
    let tokens = ChainLimit::new(
        "org:acme",
        ScopeKind::Key,
        "t",
        Charge::Reactive,
        WindowLimit::per_minute(100),
    );
    let chain = Chain::new(vec![requests.clone(), tokens]);
    assert!(chain.admit_at(&store, 1, pinned(1)).await.unwrap().admitted);
    chain.record_at(&store, 100, pinned(2)).await.unwrap();
    for _ in 0..3 {
        let d = chain.admit_at(&store, 1, pinned(3)).await.unwrap();
        assert!(!d.admitted);
        assert_eq!(d.refused_by, Some(1));
        assert_eq!(d.statuses[0].remaining, 9, "no request slot was taken");
    }
    assert_eq!(stored_cur(&url, &store, requests.key()).await, 1);
}

#[tokio::test]
async fn a_refusal_names_the_first_refusal_with_the_chains_wait_on_both_stores() {
    let Some(url) =
        redis_url("a_refusal_names_the_first_refusal_with_the_chains_wait_on_both_stores")
    else {
        return;
    };
    let redis = store(&url).await;
    let memory = MemoryStore::new();
    // The key frees its slot within seconds, the org only after a minute: the key, first in
    // the chain, is the refusal to name, with the org's wait (when the request would pass).
    let key = ChainLimit::new(
        "org:acme",
        ScopeKind::Key,
        "quick",
        Charge::Admission,
        WindowLimit::per_second(1),
    );
    let chain = Chain::new(vec![key, req("slow", ScopeKind::Org, 1)]);
    assert!(
        chain
            .admit_at(&redis, 1, pinned(30))
            .await
            .unwrap()
            .admitted
    );
    assert!(
        chain
            .admit_at(&memory, 1, pinned(30))
            .await
            .unwrap()
            .admitted
    );
    let r = chain.admit_at(&redis, 1, pinned(30)).await.unwrap();
    let m = chain.admit_at(&memory, 1, pinned(30)).await.unwrap();
    assert_eq!(r, m, "both stores decide alike");
    assert!(!r.admitted);
    assert_eq!(r.refused_by, Some(0), "the first refusal in chain order");
    assert!(
        r.retry_after > Some(Duration::from_secs(10)),
        "the org's wait decides: {:?}",
        r.retry_after
    );
    assert_eq!(r.refusing().map(|s| s.reset), r.retry_after);
    assert_eq!(
        Some(r.statuses[1].reset),
        r.retry_after,
        "the org's own wait"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_check_after_client_kill_is_enforced_through_the_replay() {
    let test = "first_check_after_client_kill_is_enforced_through_the_replay";
    // A server of its own: CLIENT KILL TYPE normal would cut every other test's connections.
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let store = store(&server.url()).await;
    let chain = Chain::new(vec![req("kill", ScopeKind::Key, 2)]);
    assert!(chain.admit(&store, 1).await.unwrap().enforced);
    kill_clients(&server).await;
    let d = chain.admit(&store, 1).await.unwrap();
    assert!(d.enforced, "the first check after the drop is enforced");
    assert!(d.admitted);
    assert_eq!(store.stats().replays, 1);
    assert_eq!(store.stats().outages, 0);
    let d = chain.admit(&store, 1).await.unwrap();
    assert!(d.enforced && !d.admitted, "the replay charged once");
}

/// A key's chain of `requests` a minute and a reactive limit of 100 tokens a minute.
fn requests_and_tokens(id: &str, requests: u64) -> Chain {
    let tokens = ChainLimit::new(
        "org:acme",
        ScopeKind::Key,
        id,
        Charge::Reactive,
        WindowLimit::per_minute(100),
    );
    Chain::new(vec![req(id, ScopeKind::Key, requests), tokens])
}

#[tokio::test]
async fn an_admission_riding_a_lost_charge_is_replayed_once_and_the_charge_never() {
    let test = "an_admission_riding_a_lost_charge_is_replayed_once_and_the_charge_never";
    // A server of its own: CLIENT KILL TYPE normal would cut every other test's connections.
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let store = store(&server.url()).await;
    let chain = requests_and_tokens("ride", 3);
    assert!(chain.admit(&store, 1).await.unwrap().admitted);
    kill_clients(&server).await;
    // On this one-thread runtime both are queued before the step's sender first runs, so they
    // go out in one call (docs/redis.md, "Batching"), which carries a charge and so is never
    // replayed: the charge is lost with the connection, the admission goes again, once.
    let (recorded, admitted) = tokio::join!(chain.record(&store, 100), chain.admit(&store, 1));
    assert!(recorded.is_err(), "the charge is never replayed");
    let d = admitted.unwrap();
    assert!(
        d.enforced && d.admitted,
        "the admission is enforced through its replay"
    );
    let stats = store.stats();
    assert_eq!(
        (stats.replays, stats.outages, stats.charge_batches),
        (1, 0, 1)
    );
    // Calls that carried admissions: the first, the lost one with the charge, its replay (an
    // admission replayed alone within its call would count two).
    assert_eq!(stats.admit_batches, 3);
    // The 100 tokens did not land (they would fill the token limit and refuse this one), and
    // the replayed admission was charged once: the third request is the last.
    let d = chain.admit(&store, 1).await.unwrap();
    assert!(d.enforced && d.admitted, "the lost tokens were not applied");
    let d = chain.admit(&store, 1).await.unwrap();
    assert!(d.enforced && !d.admitted, "the key's 3 requests are spent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_cut_off_by_a_dropped_connection_opens_no_breaker() {
    let test = "a_record_cut_off_by_a_dropped_connection_opens_no_breaker";
    // A server of its own: CLIENT KILL TYPE normal would cut every other test's connections.
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let store = store(&server.url()).await;
    let chain = requests_and_tokens("cut", 2);
    assert!(chain.admit(&store, 1).await.unwrap().enforced);
    kill_clients(&server).await;
    // Recording never replays, so the units are lost with the connection; Redis itself is fine.
    assert!(chain.record(&store, 10).await.is_err());
    assert_eq!(
        store.stats().outages,
        0,
        "a dropped connection is not an outage"
    );
    let d = chain.admit(&store, 1).await.unwrap();
    assert!(
        d.enforced,
        "the next admission is checked, not waved through"
    );
    assert!(d.admitted);
    let d = chain.admit(&store, 1).await.unwrap();
    assert!(d.enforced && !d.admitted, "the key's 2 requests are spent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_finds_redis_gone_opens_the_breaker() {
    let test = "a_record_that_finds_redis_gone_opens_the_breaker";
    let Some(_) = redis_url(test) else { return };
    let Some(mut server) = Server::start(test) else {
        return;
    };
    let store = store(&server.url()).await;
    let tokens = ChainLimit::new(
        "org:acme",
        ScopeKind::Key,
        "gone",
        Charge::Reactive,
        WindowLimit::per_minute(100),
    );
    let chain = Chain::new(vec![tokens]);
    assert!(chain.admit(&store, 1).await.unwrap().enforced);
    server.stop();
    // Not an admission: a record alone finds the outage (its connection dropped, and nothing
    // answers on a new one), so the calls after it answer at once instead of each waiting.
    assert!(chain.record(&store, 10).await.is_err());
    let stats = store.stats();
    assert_eq!((stats.outages, stats.breaker_open), (1, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_abandoned_while_queued_is_never_charged() {
    let test = "an_admission_abandoned_while_queued_is_never_charged";
    // A server of its own: the pause below holds every client of the server.
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let url = server.url();
    let store = RedisStore::connect(RedisConfig {
        timeout: Duration::from_secs(5),
        ..config(&url)
    })
    .await
    .unwrap();
    let chain = Chain::new(vec![req("queued", ScopeKind::Key, 10)]);
    assert!(chain.admit(&store, 1).await.unwrap().admitted);
    // Redis holds every write, scripts included, while its clients are paused: A's call goes out
    // and waits there, in flight, until the pause is lifted below.
    let mut admin = raw(&url).await;
    let client = |verb: &str| {
        let mut cmd = redis::cmd("CLIENT");
        cmd.arg(verb);
        cmd
    };
    let _: () = client("PAUSE")
        .arg(60_000)
        .arg("WRITE")
        .query_async(&mut admin)
        .await
        .unwrap();
    let sent = store.stats().admit_batches;
    let a = tokio::spawn({
        let (chain, store) = (chain.clone(), store.clone());
        async move { chain.admit(&store, 1).await }
    });
    // A's call is in flight once the store counts it.
    let counted = async {
        while store.stats().admit_batches == sent {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), counted)
        .await
        .expect("A's call never went out");
    // B: queued behind A's call, and given up on (as a caller that disconnects) before that call
    // returns.
    let b = tokio::time::timeout(Duration::from_millis(50), chain.admit(&store, 1)).await;
    assert!(b.is_err(), "B was still waiting");
    let _: () = client("UNPAUSE").query_async(&mut admin).await.unwrap();
    let a = a.await.unwrap().unwrap();
    // Decided by Redis, not failed open (its call outliving the store's 5 s timeout).
    assert!(a.enforced && a.admitted, "{a:?}");
    assert_eq!(
        stored_cur(&url, &store, chain.limits()[0].key()).await,
        2,
        "the first admission and A; B never went out"
    );
    let d = chain.admit(&store, 1).await.unwrap();
    assert!(d.enforced && d.admitted);
    assert_eq!(d.statuses[0].remaining, 7, "D is the third charged");
}

#[tokio::test]
async fn decisions_work_after_script_flush() {
    let Some(url) = redis_url("decisions_work_after_script_flush") else {
        return;
    };
    let store = store(&url).await;
    let chain = Chain::new(vec![req("flush", ScopeKind::Key, 1)]);
    let bucket: TokenBucket<str> = TokenBucket::new("flush", 1, Rate::per_second(1));
    assert!(chain.admit_at(&store, 1, pinned(1)).await.unwrap().admitted);
    assert!(bucket.acquire(&store, "x", 1).await.unwrap().is_allowed());
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw(&url).await)
        .await
        .unwrap();
    let d = chain.admit_at(&store, 1, pinned(2)).await.unwrap();
    assert!(d.enforced && !d.admitted);
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut raw(&url).await)
        .await
        .unwrap();
    let a = bucket.acquire(&store, "x", 1).await.unwrap();
    assert!(matches!(a, Admission::Denied { .. }));
}

/// Counts the store's log lines by level: warnings and infos from `floodgate`, logged on the
/// thread of the test that counts them ([`LogCount::install`]).
#[derive(Clone, Default)]
struct LogCount(Arc<[std::sync::atomic::AtomicUsize; 2]>);

thread_local! {
    /// The counter of the test running on this thread, if it counts.
    static COUNTING: std::cell::RefCell<Option<LogCount>> = const { std::cell::RefCell::new(None) };
}

/// Stops counting this thread's log lines when dropped.
struct Counting;

impl Drop for Counting {
    fn drop(&mut self) {
        COUNTING.with(|c| *c.borrow_mut() = None);
    }
}

impl LogCount {
    /// Counts the log lines of this thread until the guard is dropped. Through one global
    /// subscriber, not a subscriber set for this thread alone: tracing decides once per log line
    /// whether anyone wants it, and with a single subscriber registered it asks only the thread
    /// that logs the line first. A line first logged by a test that counts nothing (another
    /// store's outage ending, in parallel) would then be dropped for good, here too.
    fn install(&self) -> Counting {
        static GLOBAL: std::sync::Once = std::sync::Once::new();
        GLOBAL.call_once(|| {
            tracing::subscriber::set_global_default(ThreadLogs)
                .expect("no other global subscriber in this test binary");
        });
        COUNTING.with(|c| *c.borrow_mut() = Some(self.clone()));
        Counting
    }

    fn warns(&self) -> usize {
        self.0[0].load(std::sync::atomic::Ordering::SeqCst)
    }

    fn infos(&self) -> usize {
        self.0[1].load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The global subscriber: `floodgate`'s warnings and infos, to the counter of the thread that
/// logs them, if any.
struct ThreadLogs;

impl ThreadLogs {
    fn slot(meta: &tracing::Metadata<'_>) -> Option<usize> {
        if !meta.target().starts_with("floodgate") {
            return None;
        }
        match *meta.level() {
            tracing::Level::WARN => Some(0),
            tracing::Level::INFO => Some(1),
            _ => None,
        }
    }
}

impl tracing::Subscriber for ThreadLogs {
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        ThreadLogs::slot(meta).is_some()
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let Some(slot) = ThreadLogs::slot(event.metadata()) else {
            return;
        };
        COUNTING.with(|c| {
            if let Some(logs) = &*c.borrow() {
                logs.0[slot].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

// A current-thread runtime: the log counter is installed for this thread, where the stores'
// probe tasks run too.
#[tokio::test]
async fn outage_fails_open_or_closed_at_once_and_enforcement_resumes() {
    let test = "outage_fails_open_or_closed_at_once_and_enforcement_resumes";
    let Some(_) = redis_url(test) else { return };
    let Some(mut server) = Server::start(test) else {
        return;
    };
    let logs = LogCount::default();
    let _logging = logs.install();
    let timeout = Duration::from_millis(500);
    let url = server.url();
    let cfg = |on_error| RedisConfig {
        on_error,
        timeout,
        probe_interval: Duration::from_millis(50),
        ..config(&url)
    };
    let open = RedisStore::connect(cfg(OnError::Open)).await.unwrap();
    let closed = RedisStore::connect(cfg(OnError::Closed)).await.unwrap();
    open.ping().await.unwrap();
    let chain = Chain::new(vec![req("down", ScopeKind::Key, 1000)]);
    let bucket: TokenBucket<str> = TokenBucket::new("down", 3, Rate::per_second(1));
    assert!(chain.admit(&open, 1).await.unwrap().enforced);
    assert!(chain.admit(&closed, 1).await.unwrap().enforced);

    server.stop();
    let d = chain.admit(&open, 1).await.unwrap();
    assert!(d.admitted && !d.enforced, "fails open");
    let e = chain.admit(&closed, 1).await.unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "fails closed: {e}");
    for _ in 0..20 {
        let started = Instant::now();
        let d = chain.admit(&open, 1).await.unwrap();
        assert!(d.admitted && !d.enforced);
        let e = chain.admit(&closed, 1).await.unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)));
        assert_eq!(
            bucket.acquire(&open, "x", 1).await.unwrap(),
            Admission::Allowed { remaining: 3 }
        );
        assert!(bucket.acquire(&closed, "x", 1).await.is_err());
        assert!(chain.record(&open, 1).await.is_ok(), "no reactive limit");
        assert!(open.ping().await.is_err());
        assert!(
            started.elapsed() < timeout / 4,
            "the breaker answers at once: {:?}",
            started.elapsed()
        );
    }
    let stats = open.stats();
    assert!(stats.breaker_open);
    assert_eq!(stats.outages, 1);
    assert_eq!(stats.failed_open, 41);
    assert_eq!(closed.stats().failed_closed, 41);

    // A process starting during the outage still gets a store, which fails open.
    let late = RedisStore::connect(cfg(OnError::Open)).await.unwrap();
    assert!(!chain.admit(&late, 1).await.unwrap().enforced);

    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    for store in [&open, &closed, &late] {
        loop {
            if let Ok(d) = chain.admit(store, 1).await
                && d.enforced
            {
                break;
            }
            assert!(Instant::now() < deadline, "enforcement did not resume");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!store.stats().breaker_open);
    }
    // Enforcing again (the restarted server is empty): a fresh limit of 2 admits 2.
    let two = Chain::new(vec![req("back", ScopeKind::Key, 2)]);
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(two.admit(&open, 1).await.unwrap().admitted);
    }
    assert_eq!(got, [true, true, false]);
    assert_eq!(open.stats().outages, 1);
    // One warning per store's outage (three stores), one info line each when it ended; never
    // one per request.
    assert_eq!((logs.warns(), logs.infos()), (3, 3));
}

#[tokio::test]
async fn a_server_that_answers_ping_but_not_scripts_is_one_outage() {
    let test = "a_server_that_answers_ping_but_not_scripts_is_one_outage";
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let logs = LogCount::default();
    let _logging = logs.install();
    let url = server.url();
    let store = RedisStore::connect(RedisConfig {
        probe_interval: Duration::from_millis(50),
        ..config(&url)
    })
    .await
    .unwrap();
    let chain = Chain::new(vec![req("replica", ScopeKind::Key, 1000)]);
    assert!(chain.admit(&store, 1).await.unwrap().enforced);
    // A replica of a master that is gone: PING answers, every write is READONLY.
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut admin = raw(&url).await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(dead)
        .query_async(&mut admin)
        .await
        .unwrap();
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        assert!(
            !chain.admit(&store, 1).await.unwrap().enforced,
            "fails open"
        );
        // Readiness follows the calls, not PING, whatever the breaker's phase.
        assert!(store.ready().await.is_err(), "not ready while scripts fail");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(store.stats().outages, 1, "probes answered, calls did not");
    let mut answered = false;
    for _ in 0..20 {
        // (PING's own 200 ms timeout may lapse once on a loaded machine.)
        answered = store.ping().await.is_ok();
        if answered {
            break;
        }
    }
    assert!(answered, "PING answers while the scripts fail");
    assert_eq!((logs.warns(), logs.infos()), (1, 0), "logged once");
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut admin)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !chain.admit(&store, 1).await.unwrap().enforced {
        assert!(Instant::now() < deadline, "enforcement did not resume");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(store.stats().outages, 1);
    assert_eq!((logs.warns(), logs.infos()), (1, 1), "and its end once");
    assert!(store.ready().await.is_ok());
}

#[tokio::test]
async fn state_expires_after_two_windows_and_full_buckets_leave_nothing() {
    let Some(url) = redis_url("state_expires_after_two_windows_and_full_buckets_leave_nothing")
    else {
        return;
    };
    let store = store(&url).await;
    let mut conn = raw(&url).await;
    let second = WindowLimit::new(5, Duration::from_secs(1));
    let limits = vec![
        ChainLimit::new("org:x", ScopeKind::Key, "e", Charge::Admission, second),
        ChainLimit::new("org:x", ScopeKind::Key, "e", Charge::Reactive, second),
    ];
    let chain = Chain::new(limits.clone());
    assert!(chain.admit(&store, 1).await.unwrap().admitted);
    chain.record(&store, 3).await.unwrap();
    for l in &limits {
        let ttl: i64 = conn.pttl(store.redis_key(l.key())).await.unwrap();
        assert!(ttl > 1_000 && ttl <= 2_000, "ttl {ttl} ms for {}", l.key());
    }
    let bucket: TokenBucket<str> =
        TokenBucket::new("exp", 2, Rate::new(1, Duration::from_millis(300)));
    let bkey = store.redis_key(&bucket.key("x"));
    assert!(bucket.acquire(&store, "x", 1).await.unwrap().is_allowed());
    let ttl: i64 = conn.pttl(&bkey).await.unwrap();
    assert!(ttl > 0 && ttl <= 300, "bucket ttl {ttl} ms");
    // Refilled to full on the pinned clock: the state is deleted at once.
    let t = Timestamp::now();
    assert!(
        bucket
            .acquire_at(&store, "y", 1, t)
            .await
            .unwrap()
            .is_allowed()
    );
    let ykey = store.redis_key(&bucket.key("y"));
    assert!(conn.exists::<_, bool>(&ykey).await.unwrap());
    let later = t.saturating_add(Duration::from_secs(1));
    assert_eq!(
        bucket.acquire_at(&store, "y", 0, later).await.unwrap(),
        Admission::Allowed { remaining: 2 }
    );
    assert!(!conn.exists::<_, bool>(&ykey).await.unwrap());

    tokio::time::sleep(Duration::from_millis(2_100)).await;
    for l in &limits {
        let exists: bool = conn.exists(store.redis_key(l.key())).await.unwrap();
        assert!(!exists, "{} outlived 2W", l.key());
    }
    assert!(!conn.exists::<_, bool>(&bkey).await.unwrap());
}

#[tokio::test]
async fn token_bucket_cases() {
    let Some(url) = redis_url("token_bucket_cases") else {
        return;
    };
    let store = store(&url).await;
    const LOGIN: TokenBucket<str> =
        TokenBucket::new("login", 20, Rate::new(1, Duration::from_secs(3)));
    let t = pinned(5);
    for left in (0..20).rev() {
        assert_eq!(
            LOGIN.acquire_at(&store, "alice", 1, t).await.unwrap(),
            Admission::Allowed { remaining: left }
        );
    }
    assert_eq!(
        LOGIN.acquire_at(&store, "alice", 1, t).await.unwrap(),
        Admission::Denied {
            retry_after: Some(Duration::from_secs(3))
        }
    );
    // Half a token later: 1.5 s to go.
    assert_eq!(
        LOGIN
            .acquire_at(
                &store,
                "alice",
                1,
                t.saturating_add(Duration::from_millis(1500))
            )
            .await
            .unwrap(),
        Admission::Denied {
            retry_after: Some(Duration::from_millis(1500))
        }
    );
    assert_eq!(
        LOGIN.acquire_at(&store, "bob", 21, t).await.unwrap(),
        Admission::Denied { retry_after: None }
    );
    // Capacity 0 admits only zero-cost requests.
    const NONE: TokenBucket<str> = TokenBucket::new("none", 0, Rate::per_second(1));
    assert_eq!(
        NONE.acquire_at(&store, "x", 0, t).await.unwrap(),
        Admission::Allowed { remaining: 0 }
    );
    assert_eq!(
        NONE.acquire_at(&store, "x", 1, t).await.unwrap(),
        Admission::Denied { retry_after: None }
    );
    // Reset: used once, then not.
    assert!(LOGIN.reset_at(&store, "alice", t).await.unwrap());
    assert!(!LOGIN.reset_at(&store, "alice", t).await.unwrap());
    assert!(!LOGIN.reset_at(&store, "carol", t).await.unwrap());
    assert_eq!(
        LOGIN.acquire_at(&store, "alice", 1, t).await.unwrap(),
        Admission::Allowed { remaining: 19 }
    );
    // Typed names.
    const USERS: TokenBucket<u64> = TokenBucket::new("users", 1, Rate::per_second(1));
    assert!(USERS.acquire(&store, &7, 1).await.unwrap().is_allowed());
    assert!(!USERS.acquire(&store, &7, 1).await.unwrap().is_allowed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_acquires_against_capacity_twenty_admit_twenty() {
    let Some(url) =
        redis_url("two_hundred_concurrent_acquires_against_capacity_twenty_admit_twenty")
    else {
        return;
    };
    let store = store(&url).await;
    const SLOW: TokenBucket<str> =
        TokenBucket::new("slow", 20, Rate::new(1, Duration::from_secs(3600)));
    let mut tasks = JoinSet::new();
    for _ in 0..200 {
        let store = store.clone();
        tasks.spawn(async move { SLOW.acquire(&store, "shared", 1).await.unwrap() });
    }
    let results = tasks.join_all().await;
    assert_eq!(results.iter().filter(|a| a.is_allowed()).count(), 20);
    assert_eq!(store.stats().admitted, 20);
    assert_eq!(store.stats().refused, 180);
}

#[tokio::test]
async fn an_absurdly_slow_bucket_keeps_working_on_both_stores() {
    let Some(url) = redis_url("an_absurdly_slow_bucket_keeps_working_on_both_stores") else {
        return;
    };
    let redis = store(&url).await;
    let memory = MemoryStore::new();
    // One token per 2^64 µs: the time to full again is past what an i64 (Lua's `%d`) holds.
    const ABSURD: TokenBucket<str> =
        TokenBucket::new("absurd", 2, Rate::new(1, Duration::from_micros(u64::MAX)));
    for (i, at) in [1, 2, 3].into_iter().enumerate() {
        let r = ABSURD.acquire_at(&redis, "x", 1, pinned(at)).await.unwrap();
        let m = ABSURD
            .acquire_at(&memory, "x", 1, pinned(at))
            .await
            .unwrap();
        assert_eq!(r, m, "acquire {i}");
        assert_eq!(r.is_allowed(), i < 2, "acquire {i}: {r:?}");
    }
    assert!(
        ABSURD.reset(&redis, "x").await.unwrap(),
        "the state is readable"
    );
}

#[tokio::test]
async fn both_clocks_decide_at_about_now() {
    let Some(url) = redis_url("both_clocks_decide_at_about_now") else {
        return;
    };
    for clock in [RedisClock::Server, RedisClock::Client] {
        let store = RedisStore::connect(RedisConfig {
            clock,
            ..config(&url)
        })
        .await
        .unwrap();
        let chain = Chain::new(vec![req("clock", ScopeKind::Key, 1)]);
        let d = chain.admit(&store, 1).await.unwrap();
        assert!(d.enforced && d.admitted, "{clock:?}");
        let skew = Timestamp::now().as_micros().abs_diff(d.now.as_micros());
        assert!(skew < 5_000_000, "{clock:?}: {skew} µs off");
        assert!(!chain.admit(&store, 1).await.unwrap().admitted, "{clock:?}");
    }
}

#[tokio::test]
async fn bad_urls_are_refused_and_passwords_never_printed() {
    let err = RedisStore::connect(RedisConfig::new("nonsense://x"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)));
    let cfg = RedisConfig::new("redis://:hunter2@127.0.0.1:1/0");
    assert!(!format!("{cfg:?}").contains("hunter2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_admissions_of_mixed_costs_each_see_the_slots_before_their_own() {
    let Some(url) =
        redis_url("batched_admissions_of_mixed_costs_each_see_the_slots_before_their_own")
    else {
        return;
    };
    let store = store(&url).await;
    let now = pinned(13);
    // 240 concurrent requests of cost 1, 2 or 3 on one chain: a key of 50 units, an org of 1000.
    // They come in runs of 8 of one cost, so a batch holds runs of several costs (each sent as
    // one group, its requests decided one after another).
    let chain = Arc::new(Chain::new(vec![
        req("mixed", ScopeKind::Key, 50),
        req("mixed-org", ScopeKind::Org, 1000),
    ]));
    let mut tasks = JoinSet::new();
    for i in 0..240u64 {
        let (store, chain) = (store.clone(), chain.clone());
        let cost = (i / 8) % 3 + 1;
        tasks.spawn(async move { (cost, chain.admit_at(&store, cost, now).await.unwrap()) });
    }
    let decisions = tasks.join_all().await;
    // 80 requests of cost 1 cannot all fit, and one is refused only when the key is full.
    let used = stored_cur(&url, &store, chain.limits()[0].key()).await;
    assert_eq!(used, 50, "the key filled up");
    assert_eq!(
        stored_cur(&url, &store, chain.limits()[1].key()).await,
        used
    );
    // What each admitted request saw of the key before its own charge: ordered, each starts
    // where the one before it ended, from 0 to what the key holds now. No two took a slot twice
    // and none saw a slot taken that was not.
    let mut runs: Vec<(u64, u64)> = decisions
        .iter()
        .filter(|(_, d)| d.admitted)
        .map(|&(cost, ref d)| (50 - d.statuses[0].remaining - cost, cost))
        .collect();
    runs.sort_unstable();
    let mut next = 0;
    for (before, cost) in runs {
        assert_eq!(
            before, next,
            "a request saw {before} used where {next} were"
        );
        next += cost;
    }
    assert_eq!(next, used);
    for (_, d) in decisions.iter().filter(|(_, d)| !d.admitted) {
        assert_eq!(
            d.refused_by,
            Some(0),
            "the key refuses, never the roomy org"
        );
    }
    assert!(store.stats().admit_batches < 240, "nothing was batched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_admissions_are_batched_and_decide_as_if_one_by_one() {
    let Some(url) = redis_url("concurrent_admissions_are_batched_and_decide_as_if_one_by_one")
    else {
        return;
    };
    let store = store(&url).await;
    let memory = MemoryStore::new();
    let now = pinned(11);
    // 300 requests over 30 keys of one org: each key allows 7, the org 150, so some are
    // refused by their key, the rest by the org once it is full.
    let org = req("acme", ScopeKind::Org, 150);
    let chains: Vec<Arc<Chain>> = (0..30)
        .map(|k| {
            Arc::new(Chain::new(vec![
                req(&format!("k{k}"), ScopeKind::Key, 7),
                org.clone(),
            ]))
        })
        .collect();
    let mut tasks = JoinSet::new();
    for i in 0..300 {
        let (store, chain) = (store.clone(), chains[i % 30].clone());
        tasks.spawn(async move { (i % 30, chain.admit_at(&store, 1, now).await.unwrap()) });
    }
    let (of_key, decisions): (Vec<usize>, Vec<_>) = tasks.join_all().await.into_iter().unzip();
    assert!(decisions.iter().all(|d| d.enforced));
    assert_eq!(decisions.iter().filter(|d| d.admitted).count(), 150);
    assert_eq!(stored_cur(&url, &store, org.key()).await, 150);
    // Each admitted request saw the org as the requests decided before it left it: the 150
    // admissions leave 149, 148, ..., 0, each exactly once, and every refusal by the org sees it
    // full. (What a request saw is replayed from the batch's reply, not sent for each.)
    let mut left: Vec<u64> = decisions
        .iter()
        .filter(|d| d.admitted)
        .map(|d| d.statuses[1].remaining)
        .collect();
    left.sort_unstable();
    assert_eq!(left, (0..150).collect::<Vec<u64>>());
    for d in decisions.iter().filter(|d| d.refused_by == Some(1)) {
        assert_eq!(d.statuses[1].remaining, 0);
    }
    let stats = store.stats();
    assert!(
        stats.admit_batches < 300,
        "300 concurrent admissions took {} script calls: none were batched",
        stats.admit_batches
    );
    // Every key's own count is what it admitted, and matches the memory store's given the same
    // admissions in the order Redis decided them (one instant: the order within a key is all
    // that differs, and each key is capped at 7 either way).
    for (k, chain) in chains.iter().enumerate() {
        let key = chain.limits()[0].key();
        let cur = stored_cur(&url, &store, key).await;
        assert!(cur <= 7, "{key}: {cur}");
        // A key's requests are decided one after another, so what they saw of their key is
        // 6, 5, ... down to what is left, each exactly once.
        let mut seen: Vec<u64> = decisions
            .iter()
            .zip(&of_key)
            .filter(|&(d, &of)| of == k && d.admitted)
            .map(|(d, _)| d.statuses[0].remaining)
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (7 - cur..7).collect::<Vec<u64>>(), "{key}");
        for _ in 0..cur {
            assert!(chain.admit_at(&memory, 1, now).await.unwrap().admitted);
        }
    }
    let more = chains[0].admit_at(&memory, 1, now).await.unwrap();
    assert!(!more.admitted, "the memory store's org is full at 150 too");
}

#[tokio::test]
async fn runs_of_like_requests_decide_as_one_by_one_at_every_boundary() {
    let Some(url) = redis_url("runs_of_like_requests_decide_as_one_by_one_at_every_boundary")
    else {
        return;
    };
    use Charge::{Admission as A, Reactive as R};
    // The script decides a batch's run of like requests (one chain, one cost) per key, from a
    // real-valued bound corrected by the exact check, not request by request. Each round here
    // sends runs on two chains that share their team and org as one batch (spawned on this one
    // thread, so all of them queue before the batch is taken), and the memory store decides the
    // same requests one by one in the same order: each request must see and decide exactly the
    // same. Small rounds: limits of a few units, a previous bucket carried in a random fraction,
    // costs 0 to 3, now and then a reactive team limit. Large rounds: limits of up to 10^13 per
    // day, whose products with the window (in µs) are far past 2^53, so the bound is rounded and
    // the exact check must correct it; costs chosen so that a run ends within its requests.
    let memory = MemoryStore::new();
    let redis = store(&url).await;
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let (mut runs, mut cut, mut large_cut) = (0, 0, 0);
    for round in 0..200u64 {
        let large = round % 2 == 1;
        let secs = if large {
            86_400
        } else {
            [60, 90, 120][rng.below(3) as usize]
        };
        let w = secs * 1_000_000;
        let mut max = |small: u64| {
            if large {
                1_000_000_000 + rng.below(10_000_000_000_000)
            } else {
                small + rng.below(small * 3)
            }
        };
        let (k1, k2, team_max, org_max) = (max(1), max(1), max(5), max(10));
        let team = if !large && rng.below(3) == 0 { R } else { A };
        let limit = |scope, id: &str, charge, max| {
            ChainLimit::new(
                "org:g",
                scope,
                &format!("{id}{round}"),
                charge,
                WindowLimit::new(max, Duration::from_secs(secs)),
            )
        };
        let shared = [
            limit(ScopeKind::Team, "t", team, team_max),
            limit(ScopeKind::Org, "o", A, org_max),
        ];
        let chains = [("k", k1), ("j", k2)].map(|(id, m)| {
            let mut chain = vec![limit(ScopeKind::Key, id, A, m)];
            chain.extend(shared.iter().cloned());
            Arc::new(chain)
        });
        // Rounds a day apart: bucket-aligned for every window here.
        let base = common::T0 + round * 86_400_000_000;
        let before = Some(Timestamp::from_micros(base + rng.below(w)));
        let elapsed = rng.below(w);
        let now = Some(Timestamp::from_micros(base + w + elapsed));
        // History on both stores: the previous bucket, then a little of this one.
        let mut prev = 0;
        for (at, n) in [(before, 1 + rng.below(15)), (now, rng.below(3))] {
            for _ in 0..n {
                let chain = &chains[rng.below(2) as usize];
                let cost = if large { rng.below(k1.min(k2) / 8) } else { 1 };
                let m = memory.admit(chain, cost.into(), at).await.unwrap();
                assert_eq!(
                    m,
                    redis.admit(chain, cost.into(), at).await.unwrap(),
                    "round {round}"
                );
                if at == before && m.admitted {
                    prev += cost;
                }
            }
            let units = rng.below(20);
            memory.record(&chains[0], units, at).await.unwrap();
            redis.record(&chains[0], units, at).await.unwrap();
        }
        // Runs: chain 0, chain 1, chain 0 again, each of one cost.
        let mut requests = Vec::new();
        for chain in [0, 1, 0] {
            let cost = if large {
                // About the room the fullest key has left, split over 1 to 20 requests.
                let room = k1.min(k2) as f64 - prev as f64 * (w - elapsed) as f64 / w as f64;
                ((room / (1 + rng.below(20)) as f64) as u64).max(1)
            } else {
                [0, 1, 1, 2, 3][rng.below(5) as usize]
            };
            for _ in 0..1 + rng.below(16) {
                requests.push((chain, cost));
            }
        }
        let batches = redis.stats().admit_batches;
        let tasks: Vec<_> = requests
            .iter()
            .map(|&(chain, cost)| {
                let (redis, limits) = (redis.clone(), chains[chain].clone());
                tokio::spawn(async move { redis.admit(&limits, cost.into(), now).await })
            })
            .collect();
        let mut grouped = Vec::new();
        for t in tasks {
            grouped.push(t.await.unwrap().unwrap());
        }
        assert_eq!(
            redis.stats().admit_batches,
            batches + 1,
            "round {round}: one batch"
        );
        for (i, (&(chain, cost), r)) in requests.iter().zip(&grouped).enumerate() {
            let m = memory
                .admit(&chains[chain], cost.into(), now)
                .await
                .unwrap();
            assert_eq!(
                &m, r,
                "round {round}, request {i}: chain {chain}, cost {cost}"
            );
        }
        // And the runs leave the same state behind: the next request sees it.
        for chain in &chains {
            let m = memory.admit(chain, 1.into(), now).await.unwrap();
            assert_eq!(
                m,
                redis.admit(chain, 1.into(), now).await.unwrap(),
                "round {round}: after"
            );
        }
        // How often a run was admitted in part (its end inside it), per kind of round.
        let mut start = 0;
        for run in requests.chunk_by(|a, b| a == b) {
            let admitted = grouped[start..start + run.len()]
                .iter()
                .filter(|o| o.admitted)
                .count();
            let part = admitted > 0 && admitted < run.len();
            runs += 1;
            cut += u32::from(part && !large);
            large_cut += u32::from(part && large);
            start += run.len();
        }
    }
    // The rounds end runs inside them often, not just all or nothing, in both kinds of rounds.
    eprintln!("of {runs} runs, {cut} small and {large_cut} large were admitted in part");
    assert!(
        cut > 20 && large_cut > 20,
        "of {runs} runs, {cut} small and {large_cut} large were admitted in part"
    );
}

#[tokio::test]
async fn the_admission_script_corrects_its_first_guess_to_the_exact_check() {
    let Some(url) = redis_url("the_admission_script_corrects_its_first_guess_to_the_exact_check")
    else {
        return;
    };
    use floodgate::window::Snapshot;
    // The script decides how many requests of a run a key lets through from a real-valued bound
    // (max - carried / W - cur) / cost, then corrects it with the exact check, which rounds
    // differently once its products pass 2^53 (a large limit over a long window in µs). Here the
    // script runs alone on a crafted state, one key, one run of 24 requests, with the run's end
    // put right at the bound: next to a whole number of requests, or (the previous bucket half
    // carried, an even count) exactly on one. Its answer must be what Snapshot::admits gives one
    // request after another, and the cases must include guesses off in both directions, so that
    // both corrections are what made the answers right.
    let script = redis::Script::new(floodgate::store::redis::script_source("admit").unwrap());
    let mut con = raw(&url).await;
    let key = format!("{}run", fresh_prefix());
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let (mut low, mut high) = (0, 0);
    for case in 0..4000u64 {
        let w = [3_600, 86_400, 604_800][rng.below(3) as usize] * 1_000_000;
        let max = 1_000_000_000 + rng.below(1_000_000_000_000_000);
        let scale = [100, 100_000_000][rng.below(2) as usize];
        let cost = 1 + rng.below(scale);
        let k = rng.below(20);
        let tie = case % 2 == 0;
        let (prev, elapsed) = if tie {
            (2 * (1 + rng.below(max / 2 - 1)), w / 2)
        } else {
            (1 + rng.below(max - 1), rng.below(w))
        };
        let (wf, carried) = (w as f64, prev as f64 * (w - elapsed) as f64);
        let room = max as f64 - carried / wf;
        let cur = if tie {
            (max - prev / 2).checked_sub((k + 1) * cost)
        } else {
            (room as u64 + rng.below(3)).checked_sub((k + 1) * cost + 1)
        };
        let Some(cur) = cur else { continue };
        let count = 24;
        let limit = WindowLimit::new(max, Duration::from_micros(w));
        let bucket = common::T0 / w + case;
        let seen = |n: u64| Snapshot {
            bucket,
            cur: cur + n * cost,
            prev,
            elapsed,
        };
        let mut exact = 0;
        while exact < count && seen(exact).admits(limit, Charge::Admission, cost) {
            exact += 1;
        }
        let guess = ((room - cur as f64) / cost as f64)
            .floor()
            .clamp(0.0, count as f64) as u64;
        low += u32::from(guess < exact);
        high += u32::from(guess > exact);
        let _: () = con
            .set(&key, format!("{bucket} {cur} {prev}"))
            .await
            .unwrap();
        // The script's numbers go as one string of little-endian doubles, and its reply comes
        // as one (admit.lua): no period counters; the key's window (charged at admission: kind
        // 1); one group of `count` requests of `cost` on the key, no gate; then the window's TTL.
        let numbers: Vec<u8> = [0, w, max, 1, 1, cost, count, 1, 0, 1]
            .iter()
            .flat_map(|&n| (n as f64).to_le_bytes())
            .collect();
        let reply: Vec<u8> = script
            .key(&key)
            .arg(bucket * w + elapsed)
            .arg(numbers)
            .arg(2 * w / 1000)
            .invoke_async(&mut con)
            .await
            .unwrap();
        let admitted = f64::from_le_bytes(reply[24..32].try_into().unwrap());
        assert_eq!(
            admitted as u64, exact,
            "case {case}: W {w}, max {max}, cost {cost}, state {cur} {prev} at {elapsed}"
        );
    }
    eprintln!("first guesses too low: {low}, too high: {high}");
    assert!(low >= 3 && high >= 8, "too low {low}, too high {high}");
}

#[tokio::test]
async fn a_call_of_more_numbers_than_one_unpack_takes_is_read_whole() {
    let Some(url) = redis_url("a_call_of_more_numbers_than_one_unpack_takes_is_read_whole") else {
        return;
    };
    // The script unpacks its numbers 200 at a time past 200 (admit.lua): 80 keys, each with its
    // own run of 3 requests, send 642. Key i holds i % 10 of its 10: each run is admitted as far
    // as its key has room, the reply and the stored counts say so for every key.
    let script = redis::Script::new(floodgate::store::redis::script_source("admit").unwrap());
    let mut con = raw(&url).await;
    let prefix = fresh_prefix();
    let (w, max, keys) = (60_000_000u64, 10u64, 80u64);
    let bucket = common::T0 / w;
    let key = |i: u64| format!("{prefix}wide{i}");
    for i in 0..keys {
        let _: () = con
            .set(key(i), format!("{bucket} {} 0", i % 10))
            .await
            .unwrap();
    }
    let mut numbers = vec![0];
    for _ in 0..keys {
        numbers.extend([w, max, 1]);
    }
    numbers.push(keys);
    for i in 0..keys {
        // Cost 1, 3 requests, a chain of one key (its 1-based index), no gate.
        numbers.extend([1, 3, 1, 0, i + 1]);
    }
    assert_eq!(numbers.len(), 642);
    let packed: Vec<u8> = numbers
        .iter()
        .flat_map(|&n| (n as f64).to_le_bytes())
        .collect();
    let mut call = script.prepare_invoke();
    for i in 0..keys {
        call.key(key(i));
    }
    call.arg(bucket * w).arg(packed);
    for _ in 0..keys {
        call.arg(2 * w / 1000);
    }
    let reply: Vec<u8> = call.invoke_async(&mut con).await.unwrap();
    let reply: Vec<u64> = reply
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as u64)
        .collect();
    assert_eq!(reply.len(), (1 + 2 * keys + keys) as usize);
    for i in 0..keys {
        let held = i % 10;
        let admitted = 3.min(max - held);
        assert_eq!(reply[1 + 2 * i as usize], held, "key {i}'s count before");
        assert_eq!(
            reply[(1 + 2 * keys + i) as usize],
            admitted,
            "key {i}'s run"
        );
        let stored: String = con.get(key(i)).await.unwrap();
        assert_eq!(stored, format!("{bucket} {} 0", held + admitted), "key {i}");
    }
}

#[tokio::test]
async fn a_huge_token_count_saturates_and_the_key_keeps_working() {
    let Some(url) = redis_url("a_huge_token_count_saturates_and_the_key_keeps_working") else {
        return;
    };
    // An upstream may report any usage. Counts stop at 2^53 on both stores; before, Redis wrote
    // a count past 2^63 as a negative number and every later call on the key failed.
    let memory = MemoryStore::new();
    let redis = store(&url).await;
    let limits = vec![
        ChainLimit::new(
            "org:big",
            ScopeKind::Key,
            "k",
            Charge::Reactive,
            WindowLimit::per_minute(1_000),
        ),
        req("big-org", ScopeKind::Org, 10),
    ];
    let now = Some(pinned(17));
    for _ in 0..2 {
        memory.record(&limits, u64::MAX, now).await.unwrap();
        redis.record(&limits, u64::MAX, now).await.unwrap();
    }
    let m = memory.admit(&limits, 1.into(), now).await.unwrap();
    let r = redis.admit(&limits, 1.into(), now).await.unwrap();
    assert!(!r.admitted && r.enforced, "{r:?}");
    assert_eq!(m, r);
    assert_eq!(r.snapshots[0].cur, floodgate::window::MAX_COUNT);
    let retry = Chain::new(limits)
        .admit_at(&redis, 1, pinned(17))
        .await
        .unwrap();
    assert!(retry.retry_after.is_some(), "{retry:?}");
}

/// A store whose connection lives on a runtime of its own (returned, to keep it alive): for
/// tests of one store shared by several runtimes.
fn store_on_own_runtime(url: &str) -> (tokio::runtime::Runtime, RedisStore) {
    let home = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = home.block_on(store(url));
    (home, store)
}

fn current_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn admissions_go_on_after_the_runtime_of_a_batch_in_flight_shuts_down() {
    let Some(server) =
        Server::start("admissions_go_on_after_the_runtime_of_a_batch_in_flight_shuts_down")
    else {
        return;
    };
    let (home, store) = store_on_own_runtime(&server.url());
    let limits = vec![req("k", ScopeKind::Key, 100)];
    home.block_on(store.admit(&limits, 1.into(), None)).unwrap();
    // Redis holds every client's commands for a second, so the next batch is surely in flight
    // when its runtime ends.
    let mut pause = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    use std::io::Write;
    let auth = format!(
        "*2\r\n$4\r\nAUTH\r\n${}\r\n{}\r\n",
        server.password.len(),
        server.password
    );
    pause.write_all(auth.as_bytes()).unwrap();
    pause
        .write_all(b"*3\r\n$6\r\nCLIENT\r\n$5\r\nPAUSE\r\n$4\r\n1000\r\n")
        .unwrap();
    let mut ok = [0u8; 10];
    std::io::Read::read_exact(&mut pause, &mut ok).unwrap();
    assert_eq!(&ok, b"+OK\r\n+OK\r\n", "AUTH and CLIENT PAUSE");
    let gone = current_runtime();
    let (s, l) = (store.clone(), limits.clone());
    gone.spawn(async move {
        let _ = s.admit(&l, 1.into(), None).await;
    });
    // Drive it until its batch has gone out (Redis is asleep, so it waits there).
    gone.block_on(async {
        while store.stats().admit_batches < 2 {
            tokio::task::yield_now().await;
        }
    });
    drop(gone);
    let later = current_runtime();
    let started = Instant::now();
    let answer = later.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), store.admit(&limits, 1.into(), None)).await
    });
    assert!(
        answer.is_ok(),
        "an admission waited {:?} for a sender whose runtime had ended",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpinned_admissions_are_batched_under_either_clock() {
    let Some(url) = redis_url("unpinned_admissions_are_batched_under_either_clock") else {
        return;
    };
    // Under the client clock each admission used to carry its own microsecond, and a batch
    // only takes admissions of one time: batches of about one. The clock is now read when a
    // batch goes out.
    for clock in [RedisClock::Server, RedisClock::Client] {
        let store = RedisStore::connect(RedisConfig {
            clock,
            ..config(&url)
        })
        .await
        .unwrap();
        let chain = Arc::new(Chain::new(vec![req("many", ScopeKind::Key, 1_000)]));
        let mut tasks = JoinSet::new();
        for _ in 0..400 {
            let (store, chain) = (store.clone(), chain.clone());
            tasks.spawn(async move { chain.admit(&store, 1).await.unwrap() });
        }
        let decisions = tasks.join_all().await;
        assert!(
            decisions.iter().all(|d| d.admitted && d.enforced),
            "{clock:?}"
        );
        let calls = store.stats().admit_batches;
        assert!(calls < 100, "{clock:?}: 400 admissions took {calls} calls");
    }
}

#[tokio::test]
async fn one_key_under_two_limits_in_a_batch_is_decided_with_each_requests_own() {
    let Some(url) =
        redis_url("one_key_under_two_limits_in_a_batch_is_decided_with_each_requests_own")
    else {
        return;
    };
    // One storage key, two limits: two maxes (a chain rebuilt with a new limit while the old one
    // is still in use), or one limit enforced and the same turned shadow (the shadow requests are
    // admitted past the max, the enforced one refused). The script takes one limit per key: the
    // batch is cut where the limit changes, so each request is decided with its own, as the
    // memory store does.
    let old = req("plan", ScopeKind::Key, 1);
    for new in [req("plan", ScopeKind::Key, 100), old.clone().shadow()] {
        let memory = MemoryStore::new();
        let redis = store(&url).await;
        let (old, new) = (Arc::new(vec![old.clone()]), Arc::new(vec![new]));
        let now = Some(pinned(19));
        let order = [&old, &new, &new, &old, &new];
        let batches = redis.stats().admit_batches;
        let tasks: Vec<_> = order
            .iter()
            .map(|limits| {
                let (redis, limits) = (redis.clone(), Arc::clone(limits));
                tokio::spawn(async move { redis.admit(&limits, 1.into(), now).await.unwrap() })
            })
            .collect();
        let mut admitted = Vec::new();
        for (i, (limits, task)) in order.iter().zip(tasks).enumerate() {
            let r = task.await.unwrap();
            let m = memory.admit(limits, 1.into(), now).await.unwrap();
            assert_eq!(m, r, "{new:?}: request {i}");
            admitted.push(r.admitted);
        }
        assert_eq!(admitted, [true, true, true, false, true], "{new:?}");
        assert_eq!(
            redis.stats().admit_batches,
            batches + 4,
            "{new:?}: cut where the limit changes"
        );
    }
}

/// A batch cut where a key's limit changes puts back the admission that did not fit and every
/// call queued after it, charges and reads too: none of them overtakes it. Here a charge of 100
/// tokens queued after the cut admission must land after it is decided, as on the memory store,
/// so its token window is still empty when it is.
#[tokio::test]
async fn a_charge_queued_after_an_admission_put_back_lands_after_it() {
    let Some(url) = redis_url("a_charge_queued_after_an_admission_put_back_lands_after_it") else {
        return;
    };
    let tokens = ChainLimit::new(
        "org:acme",
        ScopeKind::Key,
        "cut",
        Charge::Reactive,
        WindowLimit::per_minute(50),
    );
    // One storage key under two maxes (a chain rebuilt while the old one is in use).
    let old = Arc::new(vec![req("cut", ScopeKind::Key, 1)]);
    let new = Arc::new(vec![req("cut", ScopeKind::Key, 100), tokens]);
    let now = Some(pinned(23));
    let memory = MemoryStore::new();
    assert!(memory.admit(&old, 1.into(), now).await.unwrap().admitted);
    let expected = memory.admit(&new, 1.into(), now).await.unwrap();
    memory.record(&new, 100, now).await.unwrap();
    assert!(
        expected.admitted,
        "the token window is empty when it is decided"
    );
    let redis = store(&url).await;
    // Queued in this order before the sender first runs: one batch, cut after the first.
    let first = tokio::spawn({
        let (redis, old) = (redis.clone(), Arc::clone(&old));
        async move { redis.admit(&old, 1.into(), now).await.unwrap() }
    });
    let second = tokio::spawn({
        let (redis, new) = (redis.clone(), Arc::clone(&new));
        async move { redis.admit(&new, 1.into(), now).await.unwrap() }
    });
    let charge = tokio::spawn({
        let (redis, new) = (redis.clone(), Arc::clone(&new));
        async move { redis.record(&new, 100, now).await.unwrap() }
    });
    assert!(first.await.unwrap().admitted);
    assert_eq!(second.await.unwrap(), expected);
    charge.await.unwrap();
    // And the charge did land: the window is full for the next request.
    let after = redis.admit(&new, 1.into(), now).await.unwrap();
    assert_eq!(after, memory.admit(&new, 1.into(), now).await.unwrap());
    assert!(!after.admitted);
}

#[test]
fn the_breaker_closes_again_after_the_runtime_of_its_probe_shuts_down() {
    let Some(mut server) =
        Server::start("the_breaker_closes_again_after_the_runtime_of_its_probe_shuts_down")
    else {
        return;
    };
    let (home, store) = store_on_own_runtime(&server.url());
    let limits = vec![req("k", ScopeKind::Key, 100)];
    assert!(
        home.block_on(store.admit(&limits, 1.into(), None))
            .unwrap()
            .enforced
    );
    // Redis goes away; an admission on a runtime of its own trips the breaker, whose probe
    // starts there; then that runtime ends.
    server.stop();
    let gone = current_runtime();
    let failed = gone.block_on(store.admit(&limits, 1.into(), None)).unwrap();
    assert!(!failed.enforced, "failed open while Redis is down");
    drop(gone);
    server.restart();
    // Another runtime: enforcement resumes (before, the breaker stayed open for good).
    enforced_again_within_10_s(&store, &limits);
}

/// Admits `limits` on a runtime of its own until the store enforces again (its breaker closed
/// by a probe), failing if it still fails open 10 s on. Polls every 100 ms: the probe's own
/// interval is what is waited for, and there is no event to await from outside the store.
fn enforced_again_within_10_s(store: &RedisStore, limits: &[ChainLimit]) {
    let later = current_runtime();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let d = later.block_on(store.admit(limits, 1.into(), None)).unwrap();
        if d.enforced {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still failing open 10 s after Redis came back: the breaker stayed open"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_charge_queued_as_its_runtime_ends_is_answered_and_later_calls_are_served() {
    let test = "a_charge_queued_as_its_runtime_ends_is_answered_and_later_calls_are_served";
    let Some(server) = Server::start(test) else {
        return;
    };
    // No call before the charge: a sender of an earlier call, still running on the store's
    // runtime, could take the charge along and land it.
    let (_home, store) = store_on_own_runtime(&server.url());
    let limits = vec![req("k", ScopeKind::Key, 100)];
    // A response's charge made by the last task of a runtime that then ends: the queue's
    // sender is spawned there and never runs.
    let tokens = vec![ChainLimit::new(
        "org:acme",
        ScopeKind::Key,
        "tok",
        Charge::Reactive,
        WindowLimit::per_minute(1_000),
    )];
    let (landed, answer) = std::sync::mpsc::channel();
    let gone = current_runtime();
    gone.block_on(async {
        let spent = floodgate::store::Spent {
            limits: &tokens,
            units: 5,
            counters: &[],
            amount: 0,
        };
        store.charge_then(spent, move |result| {
            let _ = landed.send(result.is_ok());
        });
    });
    drop(gone);
    // Before, the charge was never answered, and the queue stayed marked as served by a sender
    // that would never run: every later call on it waited until the queue filled.
    assert_eq!(
        answer.recv_timeout(Duration::from_secs(5)),
        Ok(false),
        "the charge is answered, failed with the sender that could not send it"
    );
    let later = current_runtime();
    let answered = later.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), store.admit(&limits, 1.into(), None)).await
    });
    assert!(
        answered.is_ok_and(|d| d.is_ok_and(|d| d.enforced)),
        "a later admission is sent by a new sender"
    );
}

#[test]
fn the_breaker_closes_again_when_its_runtime_ends_before_its_probe_first_runs() {
    let test = "the_breaker_closes_again_when_its_runtime_ends_before_its_probe_first_runs";
    let Some(mut server) = Server::start(test) else {
        return;
    };
    server.stop();
    // The store connects while Redis is down: the breaker trips and its probe is spawned on a
    // runtime that ends before the probe first runs.
    let boot = current_runtime();
    let store = boot.block_on(store(&server.url()));
    drop(boot);
    server.restart();
    enforced_again_within_10_s(&store, &[req("k", ScopeKind::Key, 100)]);
}

fn day_budget(id: &str, cap: u64) -> Budgets {
    Budgets::new(vec![Budget::new(
        "org:acme",
        ScopeKind::Key,
        id,
        Period::Day,
        cap,
    )])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spend_cut_off_by_a_dropped_connection_is_never_replayed_but_a_read_is() {
    let test = "a_spend_cut_off_by_a_dropped_connection_is_never_replayed_but_a_read_is";
    // A server of its own: CLIENT KILL TYPE normal would cut every other test's connections.
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let store = store(&server.url()).await;
    let budgets = day_budget("cut", 1_000);
    budgets.spend(&store, 100).await.unwrap();
    kill_clients(&server).await;
    // Adding spend never replays: the add is lost with its connection, not risked twice.
    assert!(budgets.spend(&store, 10).await.is_err());
    assert_eq!(store.stats().replays, 0);
    assert_eq!(
        store.stats().outages,
        0,
        "a dropped connection is no outage"
    );
    let d = budgets.check(&store).await.unwrap();
    assert!(d.enforced);
    assert_eq!(d.spent, [100], "the lost add was not applied");
    // A read is replayed: the first check after a drop is still enforced.
    kill_clients(&server).await;
    let d = budgets.check(&store).await.unwrap();
    assert!(d.enforced);
    assert_eq!(d.spent, [100]);
    assert_eq!(store.stats().replays, 1);
}

#[tokio::test]
async fn period_counters_expire_a_day_after_their_period_ends() {
    let Some(url) = redis_url("period_counters_expire_a_day_after_their_period_ends") else {
        return;
    };
    let store = store(&url).await;
    let mut conn = raw(&url).await;
    let counters = common::period_counters();
    // Pinned at T0 (2023-11-14T22:14:00Z): the TTL is counted on the pinned clock, to the end
    // of the period plus a day.
    store
        .add_periods(&counters[..2], 5, Some(common::at(0)))
        .await
        .unwrap();
    let day: i64 = conn.pttl(store.redis_key(counters[0].key())).await.unwrap();
    let expected = (common::MIDNIGHT_MS + 86_400_000) as i64;
    assert!(
        day <= expected && day > expected - 5_000,
        "day ttl {day} ms"
    );
    let month: i64 = conn.pttl(store.redis_key(counters[1].key())).await.unwrap();
    let expected = (common::DECEMBER_MS + 86_400_000) as i64;
    assert!(
        month <= expected && month > expected - 5_000,
        "month ttl {month} ms"
    );
    // The key is the counter's; the period and total are its value.
    let v: String = conn.get(store.redis_key(counters[1].key())).await.unwrap();
    assert_eq!(v, "2023-11 5");
    assert!(
        store
            .redis_key(counters[0].key())
            .ends_with("{org:acme}:org:acme:budget:day")
    );
}

#[tokio::test]
async fn a_budget_read_fails_open_or_closed_and_a_spend_fails() {
    let test = "a_budget_read_fails_open_or_closed_and_a_spend_fails";
    let Some(_) = redis_url(test) else { return };
    let Some(mut server) = Server::start(test) else {
        return;
    };
    let url = server.url();
    let cfg = |on_error| RedisConfig {
        on_error,
        timeout: Duration::from_millis(500),
        ..config(&url)
    };
    let open = RedisStore::connect(cfg(OnError::Open)).await.unwrap();
    let closed = RedisStore::connect(cfg(OnError::Closed)).await.unwrap();
    let budgets = day_budget("down", 1);
    budgets.spend(&open, 1).await.unwrap();
    assert!(!budgets.check(&open).await.unwrap().allowed());
    server.stop();
    let d = budgets.check(&open).await.unwrap();
    assert!(!d.enforced && d.allowed(), "fails open: {d:?}");
    let e = budgets.check(&closed).await.unwrap_err();
    assert!(matches!(e, Error::Unavailable(_)), "fails closed: {e}");
    assert!(budgets.spend(&open, 1).await.is_err());
    assert!(open.stats().breaker_open);
}

/// A TCP relay in front of a real Redis whose held connections can go silent, as a network
/// path that drops packets without a reset does (a failed-over primary's old address, a NAT or
/// firewall that lost its entry): what the client writes vanishes, and no reply, reset or
/// close ever comes. Connections made after [`Relay::go_silent`] relay normally. It also stands
/// for a name that a failover moves ([`Relay::retarget`]): connections made after that go to the
/// new server, those held stay with the old one.
struct Relay {
    addr: std::net::SocketAddr,
    silenced: tokio::sync::watch::Sender<u64>,
    /// Connections that have gone silent.
    silent: Arc<std::sync::atomic::AtomicUsize>,
    /// The port new connections are relayed to.
    target: Arc<std::sync::atomic::AtomicU16>,
}

impl Relay {
    async fn start(target: u16) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (silenced, watch) = tokio::sync::watch::channel(0u64);
        let silent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&silent);
        let target = Arc::new(std::sync::atomic::AtomicU16::new(target));
        let to = Arc::clone(&target);
        tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let mut watch = watch.clone();
                let counted = Arc::clone(&counted);
                let target = to.load(std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut up = tokio::net::TcpStream::connect(("127.0.0.1", target))
                        .await
                        .unwrap();
                    let born = *watch.borrow();
                    let silent = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => false,
                        _ = watch.wait_for(|&g| g != born) => true,
                    };
                    if silent {
                        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        // Both sockets stay open and unread for as long as the test runs.
                        std::future::pending::<()>().await;
                    }
                });
            }
        });
        Relay {
            addr,
            silenced,
            silent,
            target,
        }
    }

    /// Relays the connections made from now on to `port`.
    fn retarget(&self, port: u16) {
        self.target.store(port, std::sync::atomic::Ordering::SeqCst);
    }

    /// Silences the connections held now, and returns once one of them has stopped relaying
    /// (the store holds one): nothing written after it gets through.
    async fn go_silent(&self) {
        let before = self.silent.load(std::sync::atomic::Ordering::SeqCst);
        self.silenced.send_modify(|g| *g += 1);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.silent.load(std::sync::atomic::Ordering::SeqCst) == before {
            assert!(Instant::now() < deadline, "the relay did not go silent");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A connection whose path goes silent yields no error, only timeouts, until TCP gives up on
/// it many minutes later: the store must not keep probing over it with Redis healthy. The call
/// that timed out trips the breaker and the store reconnects, so enforcement resumes within a
/// few probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_gone_silent_is_replaced_and_enforcement_resumes() {
    let test = "a_connection_gone_silent_is_replaced_and_enforcement_resumes";
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let relay = Relay::start(server.port).await;
    let cfg = RedisConfig {
        timeout: Duration::from_millis(200),
        connect_timeout: Duration::from_millis(300),
        probe_interval: Duration::from_millis(50),
        ..config(&format!("redis://:{}@{}/0", server.password, relay.addr))
    };
    let store = RedisStore::connect(cfg).await.unwrap();
    let chain = Chain::new(vec![req("silent", ScopeKind::Key, 1000)]);
    assert!(chain.admit(&store, 1).await.unwrap().enforced);

    relay.go_silent().await;
    let d = chain.admit(&store, 1).await.unwrap();
    assert!(d.admitted && !d.enforced, "the timed-out call fails open");
    let what = "enforcement did not resume over a new connection";
    until_enforced(&chain, &store, Duration::from_secs(5), what).await;
    assert!(!store.stats().breaker_open);
    assert_eq!(store.stats().outages, 1);
}

#[tokio::test]
async fn concurrency_vectors_pass_on_redis() {
    let Some(url) = redis_url("concurrency_vectors_pass_on_redis") else {
        return;
    };
    common::run_in_flight_vectors(&store(&url).await).await;
    common::run_in_flight_vectors(&AnyStore::from(store(&url).await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_get_exactly_the_free_slots_on_redis() {
    let Some(url) = redis_url("concurrent_requests_get_exactly_the_free_slots_on_redis") else {
        return;
    };
    common::race_for_slots(store(&url).await).await;
}

/// A chain of one key allowed one request at once.
fn one_at_a_time() -> Chain {
    Chain::new(vec![req("solo", ScopeKind::Key, 1000)]).with_in_flight(vec![InFlightLimit::new(
        "org:acme",
        ScopeKind::Key,
        "solo",
        1,
    )])
}

#[tokio::test]
async fn a_slot_not_renewed_lapses_at_its_lease_time_and_is_free_again() {
    let Some(url) = redis_url("a_slot_not_renewed_lapses_at_its_lease_time_and_is_free_again")
    else {
        return;
    };
    // Pinned times: the slot taken at 0 with a 15 s lease is held at 14.999 s and free at
    // 15 s, whoever asks (a process that died never renews it).
    let config = config(&url);
    let (holder, other) = (
        RedisStore::connect(config.clone()).await.unwrap(),
        RedisStore::connect(config).await.unwrap(),
    );
    assert_eq!(holder.config().lease, Duration::from_secs(15));
    let chain = one_at_a_time();
    assert!(
        chain
            .admit_at(&holder, 1, common::at(0))
            .await
            .unwrap()
            .admitted
    );
    assert_eq!(holder.leases_held(), 1);
    let d = chain.admit_at(&other, 1, common::at(14_999)).await.unwrap();
    assert!(d.refused_in_flight().is_some());
    let d = chain.admit_at(&other, 1, common::at(15_000)).await.unwrap();
    assert!(d.admitted, "the lapsed slot is free");
    assert_eq!(d.in_flight[0].running, 1, "and counted no more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_lease_is_renewed_past_its_lease_time_and_a_dropped_one_lapses() {
    let Some(url) =
        redis_url("a_live_lease_is_renewed_past_its_lease_time_and_a_dropped_one_lapses")
    else {
        return;
    };
    let lease = Duration::from_millis(600);
    let config = RedisConfig {
        lease,
        ..config(&url)
    };
    let holder = RedisStore::connect(config.clone()).await.unwrap();
    let other = RedisStore::connect(config).await.unwrap();
    let chain = one_at_a_time();
    let held = chain.admit(&holder, 1).await.unwrap();
    assert!(held.admitted);
    // Four lease times: the holder renews every 200 ms, so the slot is never free. (This test
    // is about time passing: it checks throughout.)
    let start = Instant::now();
    while start.elapsed() < 4 * lease {
        let d = chain.admit(&other, 1).await.unwrap();
        assert!(
            d.refused_in_flight().is_some(),
            "the slot stays held at {:?}",
            start.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The holder gone (as a killed process): its slot lapses within the lease time.
    drop(holder);
    let gone = Instant::now();
    let passed = loop {
        let d = chain.admit(&other, 1).await.unwrap();
        if d.admitted {
            break d;
        }
        assert!(gone.elapsed() < lease * 2, "the slot never lapsed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Within the lease, seen by a loop that looks every 20 ms on a machine that may be busy
    // with other tests: a second's slack for the looking, not for the lapse.
    assert!(gone.elapsed() <= lease + Duration::from_secs(1));
    chain.release(&other, passed.lease).await.unwrap();
    assert_eq!(other.leases_held(), 0);
    assert!(
        chain.admit(&other, 1).await.unwrap().admitted,
        "released at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_charges_go_out_in_batches_and_each_lands_once() {
    let Some(url) = redis_url("concurrent_charges_go_out_in_batches_and_each_lands_once") else {
        return;
    };
    let store = Arc::new(store(&url).await);
    // Tokens to one org's token window under two keys' windows, spend to a day and a month.
    let org = ChainLimit::new(
        "org:cb",
        ScopeKind::Org,
        "cb",
        Charge::Reactive,
        WindowLimit::per_minute(1_000_000),
    );
    let chains: Vec<Chain> = ["k1", "k2"]
        .iter()
        .map(|k| {
            Chain::new(vec![
                ChainLimit::new(
                    "org:cb",
                    ScopeKind::Key,
                    k,
                    Charge::Admission,
                    WindowLimit::per_minute(10),
                ),
                ChainLimit::new(
                    "org:cb",
                    ScopeKind::Key,
                    k,
                    Charge::Reactive,
                    WindowLimit::per_minute(1_000_000),
                ),
                org.clone(),
            ])
        })
        .collect();
    let counters = [
        floodgate::PeriodCounter::new("{org:cb}:org:cb:budget:day", Period::Day),
        floodgate::PeriodCounter::new("{org:cb}:org:cb:budget:month", Period::Month),
    ];
    let t = Timestamp::from_secs(1_700_000_040);
    let before = store.stats().charge_batches;
    let mut tasks = JoinSet::new();
    for i in 0..200u64 {
        let (store, chain, counters) = (
            store.clone(),
            chains[(i % 2) as usize].clone(),
            counters.clone(),
        );
        tasks.spawn(async move {
            chain.record_at(&*store, 3, t).await.unwrap();
            store
                .add_periods(&counters, 7, Some(t))
                .await
                .unwrap()
                .totals
        });
    }
    let mut totals: Vec<Vec<u64>> = tasks.join_all().await;
    let batches = store.stats().charge_batches - before;
    eprintln!("{batches} script calls for 400 charges");
    assert!(batches <= 200, "{batches} script calls for 400 charges");
    // Each add saw the totals after itself: 7, 14, ..., 1400, each exactly once.
    totals.sort();
    let expected: Vec<Vec<u64>> = (1..=200).map(|n| vec![7 * n, 7 * n]).collect();
    assert_eq!(totals, expected);
    // And every token landed once: 300 to each key, 600 to the org.
    let seen = store
        .admit(chains[0].limits(), 0.into(), Some(t))
        .await
        .unwrap();
    let cur: Vec<u64> = seen.snapshots.iter().map(|s| s.cur).collect();
    assert_eq!(cur, [0, 300, 600]);
    let read = store.read_periods(&counters, Some(t)).await.unwrap();
    assert_eq!(read.totals, [1400, 1400]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_budget_reads_go_out_in_batches_each_with_its_own_totals() {
    let Some(url) = redis_url("concurrent_budget_reads_go_out_in_batches_each_with_its_own_totals")
    else {
        return;
    };
    let store = Arc::new(store(&url).await);
    let counter = |id: &str, period| {
        floodgate::PeriodCounter::new(format!("{{org:rb}}:key:{id}:budget"), period)
    };
    // Ten keys, each spent its own amount, under one org's month.
    let month = floodgate::PeriodCounter::new("{org:rb}:org:rb:budget", Period::Month);
    let t = Timestamp::from_secs(1_700_000_040);
    for k in 0..10u64 {
        let key = counter(&format!("k{k}"), Period::Day);
        store
            .add_periods(&[key, month.clone()], k + 1, Some(t))
            .await
            .unwrap();
    }
    let before = store.stats().read_batches;
    let mut tasks = JoinSet::new();
    for i in 0..200u64 {
        let store = store.clone();
        let (key, month) = (counter(&format!("k{}", i % 10), Period::Day), month.clone());
        tasks.spawn(async move {
            let seen = store.read_periods(&[key, month], Some(t)).await.unwrap();
            (i % 10, seen.totals)
        });
    }
    for (k, totals) in tasks.join_all().await {
        assert_eq!(totals, [k + 1, 55], "key k{k}");
    }
    let batches = store.stats().read_batches - before;
    assert!(batches <= 100, "{batches} script calls for 200 reads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_releases_in_batches_give_back_every_slot_once() {
    let Some(url) = redis_url("concurrent_releases_in_batches_give_back_every_slot_once") else {
        return;
    };
    let store = Arc::new(store(&url).await);
    let chain = Arc::new(
        Chain::new(vec![ChainLimit::new(
            "org:rl",
            ScopeKind::Key,
            "rl",
            Charge::Admission,
            WindowLimit::per_minute(1_000),
        )])
        .with_in_flight(vec![
            InFlightLimit::new("org:rl", ScopeKind::Key, "rl", 100),
            InFlightLimit::new("org:rl", ScopeKind::Org, "rl", 150),
        ]),
    );
    for round in 0..2 {
        let mut tasks = JoinSet::new();
        for _ in 0..100 {
            let (store, chain) = (store.clone(), chain.clone());
            tasks.spawn(async move { chain.admit(&*store, 1).await.unwrap() });
        }
        let decisions = tasks.join_all().await;
        assert!(
            decisions.iter().all(|d| d.admitted),
            "round {round}: all 100 fit"
        );
        assert!(
            !chain.admit(&*store, 1).await.unwrap().admitted,
            "the 101st is refused"
        );
        let running = store.read_running(chain.in_flight(), None).await.unwrap();
        assert_eq!(running, [100, 100]);
        // Every lease given back at once: the releases share batches, each slot freed once.
        let mut tasks = JoinSet::new();
        for d in decisions {
            let (store, chain) = (store.clone(), chain.clone());
            tasks.spawn(async move { chain.release(&*store, d.lease).await.unwrap() });
        }
        tasks.join_all().await;
        let running = store.read_running(chain.in_flight(), None).await.unwrap();
        assert_eq!(running, [0, 0], "round {round}");
    }
}

/// A slot admission whose reply was lost with its connection is replayed (`Replay::Once`): the
/// very same call again, which finds its own lease in the slot set. It answers as the first
/// did, admitted, and charges nothing twice. Before, it counted its own first charge against
/// itself: a window of 1 answered refused, so no one held (or would release) the slot it had
/// taken, which stayed taken for the whole lease.
#[tokio::test]
async fn a_replayed_slot_admission_answers_as_the_first_and_charges_once() {
    let Some(url) = redis_url("a_replayed_slot_admission_answers_as_the_first_and_charges_once")
    else {
        return;
    };
    let script =
        redis::Script::new(floodgate::store::redis::script_source("admit_holding").unwrap());
    let mut con = raw(&url).await;
    let p = fresh_prefix();
    let (window, slots) = (format!("{p}{{t}}:w"), format!("{p}{{t}}:s"));
    // admit_holding.lua's arguments: the time, one window (a minute, max 1, charged at
    // admission, its TTL, cost 1), the lease's member and time, then one slot set of 5.
    let call = || {
        let mut inv = script.key(&window);
        inv.key(&slots)
            .arg(common::T0)
            .arg(1)
            .arg("tag-1")
            .arg(15_000_000u64)
            .arg(60_000_000u64)
            .arg(1)
            .arg("a")
            .arg(120_000)
            .arg(1)
            .arg(5)
            .arg("c");
        inv
    };
    let first: Vec<u64> = call().invoke_async(&mut con).await.unwrap();
    let replay: Vec<u64> = call().invoke_async(&mut con).await.unwrap();
    assert_eq!(
        first,
        [common::T0, 0, 0, 0, 1],
        "admitted, nothing before it"
    );
    assert_eq!(replay, first, "the replay answers as the first did");
    let held: Vec<String> = con.zrange(&slots, 0, -1).await.unwrap();
    assert_eq!(held, ["tag-1"]);
    let state: String = con.get(&window).await.unwrap();
    assert_eq!(
        state,
        format!("{} 1 0", common::T0 / 60_000_000),
        "charged once"
    );
}

/// Replicas whose leases differ (a rolling change of `[store] lease_sec`) share slot sets: one
/// with a shorter lease taking a slot must not shorten the set's life below another's live
/// member, or the set expires under it and its request runs without a slot (its renewals,
/// `ZADD XX`, do nothing on a missing key).
#[tokio::test]
async fn a_shorter_lease_elsewhere_does_not_shorten_a_live_slots_life() {
    let Some(url) = redis_url("a_shorter_lease_elsewhere_does_not_shorten_a_live_slots_life")
    else {
        return;
    };
    let base = config(&url);
    let lease = |secs| RedisConfig {
        lease: Duration::from_secs(secs),
        ..base.clone()
    };
    let a = RedisStore::connect(lease(15)).await.unwrap();
    let b = RedisStore::connect(lease(1)).await.unwrap();
    let chain = Chain::new(vec![req("two", ScopeKind::Key, 1000)]).with_in_flight(vec![
        InFlightLimit::new("org:acme", ScopeKind::Key, "two", 2),
    ]);
    let held = chain.admit(&a, 1).await.unwrap();
    assert!(held.admitted);
    let other = chain.admit(&b, 1).await.unwrap();
    assert!(other.admitted);
    chain.release(&b, other.lease).await.unwrap();
    let set = a.redis_key(chain.in_flight()[0].key());
    let ttl: i64 = raw(&url).await.pttl(&set).await.unwrap();
    assert!(
        ttl > 10_000,
        "A's slot, leased for 15 s, lives as long: {ttl} ms left"
    );
    assert_eq!(a.read_running(chain.in_flight(), None).await.unwrap(), [1]);
    chain.release(&a, held.lease).await.unwrap();
}

/// How many connections the server has accepted since it started.
async fn connections_received(admin: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(admin)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("INFO stats counts connections")
}

/// Cuts the store's connection to `url` while the server refuses the handshake of a new one
/// (`refuse`, sent on `admin`): the reconnect is refused with an answer, not an I/O error, and
/// the connection manager keeps that answer for every later call. The store must count it as
/// an outage (`on_error` decides) and, once `allow` has undone the refusal, connect anew and
/// enforce again.
async fn a_refused_reconnect_is_an_outage_that_ends(
    url: &str,
    admin: &mut redis::aio::MultiplexedConnection,
    refuse: &[&str],
    allow: &[&str],
) {
    let store = RedisStore::connect(RedisConfig {
        probe_interval: Duration::from_millis(50),
        ..config(url)
    })
    .await
    .unwrap();
    let chain = Chain::new(vec![req("refused", ScopeKind::Key, 1000)]);
    assert!(chain.admit(&store, 1).await.unwrap().enforced);
    let _: () = redis::cmd(refuse[0])
        .arg(&refuse[1..])
        .query_async(admin)
        .await
        .unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query_async(admin)
        .await
        .unwrap();
    assert!(killed >= 1);
    let during = chain.admit(&store, 1).await;
    assert!(
        matches!(&during, Ok(d) if d.admitted && !d.enforced),
        "{url}: a refused reconnect fails open: {during:?}, {:?}",
        store.stats()
    );
    assert!(store.stats().breaker_open);
    // The refusal must outlast a probe: each probe refused connects anew, which the server
    // counts (each new connection is tried twice by the connection manager, so past two more,
    // a second probe has connected), rather than keep asking over the refused one.
    let seen = connections_received(admin).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while connections_received(admin).await < seen + 3 {
        assert!(
            Instant::now() < deadline,
            "{url}: the probe did not connect anew: {:?}",
            store.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _: () = redis::cmd(allow[0])
        .arg(&allow[1..])
        .query_async(admin)
        .await
        .unwrap();
    let what = format!("{url}: enforcement did not resume");
    until_enforced(&chain, &store, Duration::from_secs(5), &what).await;
    assert_eq!(store.stats().outages, 1);
}

/// A password rotated away and back (a rollout rolled back): while the server refuses the URL's
/// password, a reconnect's `AUTH` (RESP3: `HELLO ... AUTH`) is refused, and the store must not
/// keep that refusal once the password is back.
#[tokio::test]
async fn a_reconnect_refused_at_auth_recovers_once_the_password_is_back() {
    let test = "a_reconnect_refused_at_auth_recovers_once_the_password_is_back";
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let mut admin = raw(&server.url()).await;
    for url in [server.url(), format!("{}?protocol=resp3", server.url())] {
        a_refused_reconnect_is_an_outage_that_ends(
            &url,
            &mut admin,
            &["CONFIG", "SET", "requirepass", "rotated"],
            &["CONFIG", "SET", "requirepass", &server.password],
        )
        .await;
    }
}

/// A URL naming a database other than 0: while the server refuses `SELECT` (here an ACL), a
/// reconnect's handshake is refused after its `AUTH` passed, and the store must connect again
/// once `SELECT` is allowed.
#[tokio::test]
async fn a_reconnect_refused_at_select_recovers_once_select_is_allowed() {
    let test = "a_reconnect_refused_at_select_recovers_once_select_is_allowed";
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let url = format!("redis://:{}@127.0.0.1:{}/1", server.password, server.port);
    let mut admin = raw(&url).await;
    a_refused_reconnect_is_an_outage_that_ends(
        &url,
        &mut admin,
        &["ACL", "SETUSER", "default", "-select"],
        &["ACL", "SETUSER", "default", "+select"],
    )
    .await;
}

/// A window's key holding something floodgate never writes (a value set under the prefix by
/// someone else, or by hand) reads as never written: it must not fail the call that reads it,
/// and with it every other request of the batch, any tenant's.
#[tokio::test]
async fn a_window_holding_garbage_reads_as_never_written_and_fails_no_batch() {
    let Some(url) = redis_url("a_window_holding_garbage_reads_as_never_written_and_fails_no_batch")
    else {
        return;
    };
    let store = store(&url).await;
    let poisoned = Arc::new(Chain::new(vec![ChainLimit::new(
        "org:other",
        ScopeKind::Key,
        "poisoned",
        Charge::Admission,
        WindowLimit::per_minute(1000),
    )]));
    let clean = Arc::new(Chain::new(vec![req("clean", ScopeKind::Key, 1000)]));
    let key = poisoned.limits()[0].key().to_owned();
    let _: () = raw(&url)
        .await
        .set(store.redis_key(&key), "not a window")
        .await
        .unwrap();
    let now = pinned(5);
    let mut tasks = JoinSet::new();
    for i in 0..200 {
        let store = store.clone();
        let chain = if i % 20 == 0 { &poisoned } else { &clean }.clone();
        tasks.spawn(async move { (i % 20 == 0, chain.admit_at(&store, 1, now).await) });
    }
    let results = tasks.join_all().await;
    let failed: Vec<_> = results.iter().filter(|(_, r)| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} of 200 admissions failed (the poisoned key's are 10), first {:?}, {:?}",
        failed.len(),
        failed.first(),
        store.stats()
    );
    let admitted = results
        .iter()
        .filter(|(_, r)| matches!(r, Ok(d) if d.admitted && d.enforced));
    assert_eq!(admitted.count(), 200);
    // The garbage went as a never-written key's state would: replaced by the charges.
    assert_eq!(stored_cur(&url, &store, &key).await, 10);
}

/// Sets every key of `keys` to `value`.
async fn set_all(conn: &mut redis::aio::MultiplexedConnection, keys: &[String], value: &str) {
    for key in keys {
        let _: () = conn.set(key, value).await.unwrap();
    }
}

/// Every script that reads stored state (windows, period counters, token buckets) reads a value
/// floodgate never writes as never written, rather than failing: each operation on keys holding
/// one answers as the memory store does on keys it never saw. A reset or a clear removes it.
#[tokio::test]
async fn every_script_reads_state_it_cannot_parse_as_never_written() {
    let Some(url) = redis_url("every_script_reads_state_it_cannot_parse_as_never_written") else {
        return;
    };
    let redis = store(&url).await;
    let mut conn = raw(&url).await;
    let now = pinned(5);
    let at = Some(now);
    let window = |id, charge| {
        ChainLimit::new(
            "org:bad",
            ScopeKind::Key,
            id,
            charge,
            WindowLimit::per_minute(10),
        )
    };
    let limits = [
        window("req", Charge::Admission),
        window("out", Charge::Reactive),
        window("tok", Charge::Reserved),
    ];
    let counters = [floodgate::PeriodCounter::new(
        "{org:bad}:org:bad:budget:day",
        Period::Day,
    )];
    let slots = [InFlightLimit::new("org:bad", ScopeKind::Key, "slots", 2)];
    let bucket = BucketKey {
        limiter: "bad",
        name: NameRef::Text("b"),
    };
    let bucket_limit = BucketLimit {
        capacity: 5,
        rate: Rate::per_second(1),
    };
    let keys: Vec<String> = limits
        .iter()
        .map(|l| l.key())
        .chain(counters.iter().map(|c| c.key()))
        .map(|k| redis.redis_key(k))
        .chain([redis.redis_key(&bucket.to_string())])
        .collect();
    // Not in any stored form, or in one with a number floodgate never writes: a count or total
    // past 2^53 (in the current minute; on the current day), tokens that are not a number from 0
    // up, a time past 2^53.
    let (t, minute) = (now.as_micros(), now.as_micros() / 60_000_000);
    let big = "99999999999999999999";
    let bad = [
        "garbage".to_owned(),
        String::new(),
        "1 2".to_owned(),
        "7 8 9 10".to_owned(),
        "x 1 2".to_owned(),
        "-1 2 3".to_owned(),
        format!("{minute} {big} 0"),
        format!("{minute} 0 {big}"),
        format!("2023-11-14 {big}"),
        format!("x {t} {big}"),
        format!("nan {t} {big}"),
        format!("inf {t} {big}"),
        format!("-1 {t} {big}"),
        format!("1 {big} {big}"),
    ];
    for bad in &bad {
        // Each operation on keys that all hold `bad`, beside a memory store that never saw them.
        macro_rules! fresh {
            () => {{
                set_all(&mut conn, &keys, bad).await;
                MemoryStore::new()
            }};
        }
        macro_rules! done {
            ($op:expr, $call:expr) => {
                $call
                    .await
                    .unwrap_or_else(|e| panic!("{} on {bad:?}: {e}", $op))
            };
        }
        macro_rules! same {
            ($op:expr, $redis:expr, $memory:expr) => {
                assert_eq!(
                    done!($op, $redis),
                    $memory.await.unwrap(),
                    "{} on {bad:?}",
                    $op
                )
            };
        }
        let m = fresh!();
        same!(
            "admit",
            redis.admit(&limits, 1.into(), at),
            m.admit(&limits, 1.into(), at)
        );

        let m = fresh!();
        let lease = redis.lease();
        same!(
            "admit_holding",
            redis.admit_holding(&limits, &slots, 1.into(), lease, at),
            m.admit_holding(&limits, &slots, 1.into(), m.lease(), at)
        );
        done!("release", redis.release(&slots, lease, at));

        let m = fresh!();
        same!(
            "admit_within",
            redis.admit_within(&counters, &[100], &limits, 1.into(), at),
            m.admit_within(&counters, &[100], &limits, 1.into(), at)
        );

        let m = fresh!();
        same!(
            "read_state",
            redis.read_state(&limits, &counters, at),
            m.read_state(&limits, &counters, at)
        );

        let m = fresh!();
        done!("record", redis.record(&limits, 5, at));
        m.record(&limits, 5, at).await.unwrap();
        same!(
            "record",
            redis.read_state(&limits, &counters, at),
            m.read_state(&limits, &counters, at)
        );

        for delta in [3, -3] {
            let m = fresh!();
            done!("reconcile", redis.reconcile(&limits, now, delta, at));
            m.reconcile(&limits, now, delta, at).await.unwrap();
            same!(
                format!("reconcile {delta}"),
                redis.read_state(&limits, &counters, at),
                m.read_state(&limits, &counters, at)
            );
        }

        let m = fresh!();
        same!(
            "clear_state",
            redis.clear_state(&limits, &counters, at),
            m.clear_state(&limits, &counters, at)
        );
        let left: u64 = conn.exists(&keys[..4]).await.unwrap();
        assert_eq!(left, 0, "clear_state removes {bad:?}");

        let m = fresh!();
        same!(
            "read_periods",
            redis.read_periods(&counters, at),
            m.read_periods(&counters, at)
        );
        let m = fresh!();
        same!(
            "add_periods",
            redis.add_periods(&counters, 5, at),
            m.add_periods(&counters, 5, at)
        );

        for delta in [2, -2] {
            let m = fresh!();
            let op = format!("reconcile_periods {delta}");
            done!(op, redis.reconcile_periods(&counters, now, delta, at));
            m.reconcile_periods(&counters, now, delta, at)
                .await
                .unwrap();
            same!(
                op,
                redis.read_periods(&counters, at),
                m.read_periods(&counters, at)
            );
        }

        let m = fresh!();
        let r = done!("acquire", redis.acquire(bucket, bucket_limit, 1, at));
        let w = m.acquire(bucket, bucket_limit, 1, at).await.unwrap();
        assert_eq!(r.tokens.to_bits(), w.tokens.to_bits(), "acquire on {bad:?}");
        assert_eq!(r, w, "acquire on {bad:?}");

        let m = fresh!();
        same!(
            "reset",
            redis.reset(bucket, bucket_limit, at),
            m.reset(bucket, bucket_limit, at)
        );
        let left: u64 = conn.exists(&keys[4]).await.unwrap();
        assert_eq!(left, 0, "reset removes {bad:?}");
    }
    let stats = redis.stats();
    assert_eq!(
        stats.errors + stats.failed_open + stats.outages,
        0,
        "{stats:?}"
    );
}

/// A server running another client's long script answers every other call `BUSY` once the
/// script has run past `busy-reply-threshold`: it cannot decide, as while it loads, so
/// `on_error` decides until the script ends, and enforcement resumes then.
#[tokio::test]
async fn a_server_busy_with_a_script_is_an_outage_until_it_ends() {
    let test = "a_server_busy_with_a_script_is_an_outage_until_it_ends";
    let Some(_) = redis_url(test) else { return };
    let Some(server) = Server::start(test) else {
        return;
    };
    let url = server.url();
    let cfg = |on_error| RedisConfig {
        on_error,
        probe_interval: Duration::from_millis(50),
        ..config(&url)
    };
    let open = RedisStore::connect(cfg(OnError::Open)).await.unwrap();
    let closed = RedisStore::connect(cfg(OnError::Closed)).await.unwrap();
    let chain = Chain::new(vec![req("busy", ScopeKind::Key, 1000)]);
    assert!(chain.admit(&open, 1).await.unwrap().enforced);
    assert!(chain.admit(&closed, 1).await.unwrap().enforced);
    let mut admin = raw(&url).await;
    // (`busy-reply-threshold` since Redis 7; this name, its alias, works before.)
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "lua-time-limit", "50"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let mut looping = raw(&url).await;
    let spin = tokio::spawn(async move {
        let _: redis::RedisResult<()> = redis::cmd("EVAL")
            .arg(&["while true do end", "0"])
            .query_async(&mut looping)
            .await;
    });
    let mut watch = raw(&url).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pong: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut watch).await;
        if matches!(&pong, Err(e) if e.code() == Some("BUSY")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server never got busy: {pong:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let during = chain.admit(&open, 1).await;
    let refused = chain.admit(&closed, 1).await;
    let _: () = redis::cmd("SCRIPT")
        .arg("KILL")
        .query_async(&mut admin)
        .await
        .unwrap();
    spin.await.unwrap();
    assert!(
        matches!(&during, Ok(d) if d.admitted && !d.enforced),
        "a busy server fails open: {during:?}, {:?}",
        open.stats()
    );
    assert!(
        matches!(&refused, Err(Error::Unavailable(_))),
        "a busy server fails closed: {refused:?}"
    );
    assert!(open.stats().breaker_open);
    until_enforced(
        &chain,
        &open,
        Duration::from_secs(5),
        "enforcement did not resume",
    )
    .await;
    assert_eq!(open.stats().outages, 1);
}

/// A failover behind a name (here a relay whose new connections go to the new primary): the
/// store's connection still goes to the old primary, now a replica, which answers PING but
/// refuses every write (`READONLY`). The store must connect anew, and so follow the name to the
/// new primary, rather than probe the old one and fail on it for good.
#[tokio::test]
async fn a_failover_behind_a_name_is_followed_to_the_new_primary() {
    let test = "a_failover_behind_a_name_is_followed_to_the_new_primary";
    let Some(_) = redis_url(test) else { return };
    let (Some(old), Some(new)) = (Server::start(test), Server::start(test)) else {
        return;
    };
    // One password for both, as a failover keeps it.
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "requirepass", &old.password])
        .query_async(&mut raw(&new.url()).await)
        .await
        .unwrap();
    let relay = Relay::start(old.port).await;
    let store = RedisStore::connect(RedisConfig {
        probe_interval: Duration::from_millis(50),
        ..config(&format!("redis://:{}@{}/0", old.password, relay.addr))
    })
    .await
    .unwrap();
    let chain = Chain::new(vec![req("failover", ScopeKind::Key, 1000)]);
    assert!(chain.admit(&store, 1).await.unwrap().enforced);

    relay.retarget(new.port);
    let mut demoted = raw(&old.url()).await;
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "masterauth", &old.password])
        .query_async(&mut demoted)
        .await
        .unwrap();
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new.port)
        .query_async(&mut demoted)
        .await
        .unwrap();
    let during = chain.admit(&store, 1).await;
    assert!(
        matches!(&during, Ok(d) if d.admitted && !d.enforced),
        "a read-only server fails open: {during:?}"
    );
    let what = "never reached the new primary";
    until_enforced(&chain, &store, Duration::from_secs(5), what).await;
    assert_eq!(store.stats().outages, 1);
    // The decision was the new primary's.
    let on_new: bool = raw(&format!(
        "redis://:{}@127.0.0.1:{}/0",
        old.password, new.port
    ))
    .await
    .exists(store.redis_key(chain.limits()[0].key()))
    .await
    .unwrap();
    assert!(on_new);
}
