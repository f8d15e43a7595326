//! The Redis store on a real Redis Cluster (three primaries with a replica each, started by
//! `scripts/test` through `scripts/redis-cluster`).
//!
//! Every test reads `FLOODGATE_TEST_REDIS_CLUSTER_URLS` (the seeds, comma-separated) and returns
//! early with a note when it is unset, unless `FLOODGATE_REQUIRE_REDIS=1` (CI), when a skip is a
//! failure. Each test works under its own random key prefix.
#![cfg(feature = "redis")]

mod common;

use std::sync::Arc;

use floodgate::store::redis::{RedisConfig, RedisStore};
use floodgate::store::{MemoryStore, Store};
use floodgate::{Chain, ChainLimit, Charge, ScopeKind, Timestamp, WindowLimit};
use tokio::task::JoinSet;

/// The cluster's seeds, or `None` (with a note) when cluster tests are not enabled.
fn seeds(test: &str) -> Option<Vec<String>> {
    let seeds = common::server_from_env("FLOODGATE_TEST_REDIS_CLUSTER_URLS", test)?;
    Some(seeds.split(',').map(str::to_owned).collect())
}

fn prefix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("fgcluster:{nanos:x}-{}:", std::process::id())
}

async fn store_with(seeds: &[String], prefix: &str) -> RedisStore {
    let config = RedisConfig {
        prefix: prefix.to_owned(),
        ..RedisConfig::cluster(seeds.iter().cloned())
    };
    let store = RedisStore::connect(config).await.unwrap();
    assert!(store.is_cluster());
    store.ready().await.expect("the cluster is ready");
    store
}

async fn store(seeds: &[String]) -> RedisStore {
    store_with(seeds, &prefix()).await
}

fn pinned(s: u64) -> Timestamp {
    Timestamp::from_micros(1_700_000_000_000_000 + s * 1_000_000)
}

/// A request limit of `max` a minute on `scope`/`id`, under `tenant`'s hash tag.
fn req(tenant: &str, scope: ScopeKind, id: &str, max: u64) -> ChainLimit {
    ChainLimit::new(
        tenant,
        scope,
        id,
        Charge::Admission,
        WindowLimit::per_minute(max),
    )
}

/// What `chain`'s limits count now (an admission of cost 0 charges nothing).
async fn counts(store: &RedisStore, chain: &Chain, now: Timestamp) -> Vec<u64> {
    let seen = store
        .read_state(chain.limits(), &[], Some(now))
        .await
        .unwrap();
    seen.snapshots.iter().map(|s| s.cur).collect()
}

#[tokio::test]
async fn shared_vectors_pass_on_the_cluster_in_one_slot_and_across_slots() {
    let Some(seeds) = seeds("shared_vectors_pass_on_the_cluster_in_one_slot_and_across_slots")
    else {
        return;
    };
    // The chains as they are (one tenant: one slot), then with every scope in a slot of its own:
    // decided slot by slot, with refunds, and still exactly as the memory store decides.
    common::run_vectors(&store(&seeds).await).await;
    common::run_vectors_on(&store(&seeds).await, common::spread(common::chains())).await;
    common::run_vectors_on(&MemoryStore::new(), common::spread(common::chains())).await;
    common::run_period_vectors(&store(&seeds).await).await;
    common::run_admit_within(&store(&seeds).await, "org:acme").await;
    common::run_refusal_cache_sweep(&store(&seeds).await).await;
    common::run_charge_then(&store(&seeds).await.into()).await;
}

#[tokio::test]
async fn concurrency_vectors_pass_on_the_cluster_in_one_slot_and_across_slots() {
    let Some(seeds) = seeds("concurrency_vectors_pass_on_the_cluster_in_one_slot_and_across_slots")
    else {
        return;
    };
    let spread = || common::spread(common::in_flight_chains());
    common::run_in_flight_vectors(&store(&seeds).await).await;
    common::run_in_flight_vectors_on(&store(&seeds).await, spread()).await;
    common::run_in_flight_vectors_on(&MemoryStore::new(), spread()).await;
    common::run_reserved_holding(&store(&seeds).await).await;
    let s = store(&seeds).await;
    common::run_state_read_and_clear(&s).await;
    assert_eq!(s.leases_held(), 0, "every lease given back or never taken");
}

/// A cross-slot admission dropped between its steps (its caller gone) gives back the slot its
/// first step took: else that lease would be renewed for the process's life, and the key's only
/// slot held for good.
#[tokio::test]
async fn an_admission_dropped_between_its_steps_gives_its_slots_back() {
    let Some(seeds) = seeds("an_admission_dropped_between_its_steps_gives_its_slots_back") else {
        return;
    };
    let store = store(&seeds).await;
    // The key's limit and its one slot in org a's slot, decided first; the gateway's in its own.
    let chain = Chain::new(vec![
        req("org:a", ScopeKind::Key, "k", 100),
        req("gateway", ScopeKind::Gateway, "all", 100),
    ])
    .with_in_flight(vec![floodgate::InFlightLimit::new(
        "org:a",
        ScopeKind::Key,
        "k",
        1,
    )]);
    {
        let mut admission = Box::pin(chain.admit(&store, 1));
        // Polled until its first step has taken the slot, then dropped.
        while store.leases_held() == 0 {
            tokio::select! {
                biased;
                _ = &mut admission => panic!("decided whole before it could be dropped mid-way"),
                () = tokio::task::yield_now() => {}
            }
        }
    }
    assert_eq!(
        store.leases_held(),
        0,
        "the dropped lease is no longer renewed"
    );
    // The release went out in a task: the slot frees once it lands, a few calls on at most
    // (each call a round trip; a slot held for good would refuse every one).
    let mut tries = 0;
    loop {
        let d = chain.admit(&store, 1).await.unwrap();
        if d.admitted {
            chain.release(&store, d.lease).await.unwrap();
            break;
        }
        assert!(d.refused_in_flight().is_some(), "{d:?}");
        tries += 1;
        assert!(tries < 1_000, "the dropped admission's slot is still held");
        tokio::task::yield_now().await;
    }
    assert_eq!(store.leases_held(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_race_ninety_six_requests_against_five_and_a_gateway_limit() {
    let Some(seeds) = seeds("three_replicas_race_ninety_six_requests_against_five") else {
        return;
    };
    let prefix = prefix();
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(store_with(&seeds, &prefix).await);
    }
    // The key's limit in its org's slot, a roomy gateway-wide limit in the gateway's.
    let key = req("org:race", ScopeKind::Key, "race", 5);
    let gateway = req("gateway", ScopeKind::Gateway, "gateway", 1000);
    let chain = Arc::new(Chain::new(vec![key, gateway]));
    let now = pinned(7);
    let mut tasks = JoinSet::new();
    for i in 0..96 {
        let (store, chain) = (replicas[i % 3].clone(), chain.clone());
        tasks.spawn(async move { chain.admit_at(&store, 1, now).await.unwrap() });
    }
    let decisions = tasks.join_all().await;
    assert!(decisions.iter().all(|d| d.enforced));
    assert_eq!(decisions.iter().filter(|d| d.admitted).count(), 5);
    // Refused by the key's step, the gateway's was never run: it counts the 5 alone.
    assert_eq!(counts(&replicas[0], &chain, now).await, [5, 5]);
}

#[tokio::test]
async fn a_refusal_by_a_later_slot_is_charged_to_none() {
    let Some(seeds) = seeds("a_refusal_by_a_later_slot_is_charged_to_none") else {
        return;
    };
    let store = store(&seeds).await;
    let now = pinned(11);
    let key = req("org:acme", ScopeKind::Key, "alice", 100);
    let customer = req("customer:big", ScopeKind::Customer, "big", 2);
    let gateway = req("gateway", ScopeKind::Gateway, "gateway", 100);
    let chain = Chain::new(vec![key, customer, gateway]);
    let unlowered = store.lowered();
    for _ in 0..2 {
        assert!(chain.admit_at(&store, 1, now).await.unwrap().admitted);
    }
    assert_eq!(store.lowered(), unlowered, "admissions lower no count");
    let refused = chain.admit_at(&store, 1, now).await.unwrap();
    assert!(!refused.admitted && refused.enforced);
    assert_eq!(refused.refused_by, Some(1), "the customer's limit refuses");
    // The refund lowered the key's count: a refusal this process cached before it (another
    // chain's, sharing the key) no longer answers.
    assert_ne!(
        store.lowered(),
        unlowered,
        "the refund counts as a lowering"
    );
    // The key's step was charged, then refunded; the gateway's was read, not run.
    assert_eq!(counts(&store, &chain, now).await, [2, 2, 2]);
    // Its headers describe every limit as now: the gateway's remaining is read from its slot.
    let gateway_left = refused.statuses[2].remaining;
    assert_eq!(gateway_left, 98);
    // The same decision as the memory store's, where it is one atomic step.
    let memory = MemoryStore::new();
    for _ in 0..2 {
        chain.admit_at(&memory, 1, now).await.unwrap();
    }
    assert_eq!(chain.admit_at(&memory, 1, now).await.unwrap(), refused);
}

/// A chain across slots refused by its first step charged nothing, so it lowers no count: its
/// refusal is remembered and answers the next request without the store, as on one server
/// (the gateway's flood: an over-limit key, its `{gateway}` limits in another slot).
#[tokio::test]
async fn a_refusal_by_the_first_slot_lowers_nothing_and_is_cached() {
    let Some(seeds) = seeds("a_refusal_by_the_first_slot_lowers_nothing_and_is_cached") else {
        return;
    };
    let store = store(&seeds).await;
    let now = pinned(11);
    let key = req("org:acme", ScopeKind::Key, "alice", 2);
    let gateway = req("gateway", ScopeKind::Gateway, "gateway", 100);
    let chain = Chain::new(vec![key, gateway]).cache_refusals();
    for _ in 0..2 {
        assert!(chain.admit_at(&store, 1, now).await.unwrap().admitted);
    }
    let unlowered = store.lowered();
    let refused = chain.admit_at(&store, 1, now).await.unwrap();
    assert_eq!(refused.refused_by, Some(0), "the key's own slot refuses");
    assert_eq!(store.lowered(), unlowered, "nothing was refunded");
    let later = pinned(12);
    let cached = chain
        .cached_refusal(&store, 1, Some(later))
        .expect("the refusal is remembered");
    // Exactly the store's answer at that instant (nothing else ran).
    let plain = Chain::new(chain.limits().to_vec());
    assert_eq!(plain.admit_at(&store, 1, later).await.unwrap(), cached);
    // Only the key's step ran: the gateway limit counts the two admitted requests.
    assert_eq!(counts(&store, &chain, later).await, [2, 2]);
}

/// The bound docs/redis.md states: a request refused by a later slot holds its charge in the
/// earlier slots until its refund, so concurrent requests there can be refused that an atomic
/// decision would admit, at most as many as such requests are in flight, and never the other
/// way; once the refunds land, exactly what was admitted is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refund_in_flight_errs_towards_stricter_by_at_most_what_is_in_flight() {
    let Some(seeds) = seeds("a_refund_in_flight_errs_towards_stricter") else {
        return;
    };
    let store = store(&seeds).await;
    let now = pinned(13);
    let key = req("org:acme", ScopeKind::Key, "shared", 10);
    let full = req("customer:full", ScopeKind::Customer, "full", 1);
    // The customer is full: every request of `refused` charges the key, then is refunded.
    assert!(
        Chain::new(vec![full.clone()])
            .admit_at(&store, 1, now)
            .await
            .unwrap()
            .admitted
    );
    let refused = Arc::new(Chain::new(vec![key.clone(), full]));
    let alone = Arc::new(Chain::new(vec![key.clone()]));
    const IN_FLIGHT: usize = 4;
    let mut tasks = JoinSet::new();
    for i in 0..(20 + IN_FLIGHT) {
        let store = store.clone();
        let chain = if i % 6 == 0 && i / 6 < IN_FLIGHT {
            refused.clone()
        } else {
            alone.clone()
        };
        let crossing = Arc::ptr_eq(&chain, &refused);
        tasks.spawn(async move { (crossing, chain.admit_at(&store, 1, now).await.unwrap()) });
    }
    let decisions = tasks.join_all().await;
    assert_eq!(
        decisions.iter().filter(|(c, _)| *c).count(),
        IN_FLIGHT,
        "the test sends as many crossing requests as it says"
    );
    assert!(
        decisions
            .iter()
            .filter(|(c, _)| *c)
            .all(|(_, d)| !d.admitted),
        "a request the customer refuses is never admitted"
    );
    let admitted = decisions.iter().filter(|(c, d)| !*c && d.admitted).count();
    assert!(
        (10 - IN_FLIGHT..=10).contains(&admitted),
        "an atomic decision admits 10; refunds in flight may refuse at most {IN_FLIGHT} of them: {admitted}"
    );
    // Every refund landed: the key counts what it admitted, and admits exactly the rest.
    assert_eq!(counts(&store, &alone, now).await, [admitted as u64]);
    let mut more = 0;
    while alone.admit_at(&store, 1, now).await.unwrap().admitted {
        more += 1;
    }
    assert_eq!(admitted + more, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_wide_limit_across_orgs_is_exact() {
    let Some(seeds) = seeds("a_gateway_wide_limit_across_orgs_is_exact") else {
        return;
    };
    let store = store(&seeds).await;
    let now = pinned(17);
    let gateway = req("gateway", ScopeKind::Gateway, "gateway", 30);
    // Twelve orgs, in slots of their own, each key roomy: only the gateway's limit binds.
    let chains: Vec<Arc<Chain>> = (0..12)
        .map(|o| {
            let key = req(&format!("org:o{o}"), ScopeKind::Key, &format!("k{o}"), 100);
            Arc::new(Chain::new(vec![key, gateway.clone()]))
        })
        .collect();
    let mut tasks = JoinSet::new();
    for i in 0..120 {
        let (store, chain) = (store.clone(), chains[i % 12].clone());
        tasks.spawn(async move { (i % 12, chain.admit_at(&store, 1, now).await.unwrap()) });
    }
    let decisions = tasks.join_all().await;
    assert_eq!(decisions.iter().filter(|(_, d)| d.admitted).count(), 30);
    // Each org's key counts only its admitted requests: every refusal was refunded.
    let gateway_count = counts(&store, &Chain::new(vec![gateway]), now).await;
    assert_eq!(gateway_count, [30]);
    for (o, chain) in chains.iter().enumerate() {
        let admitted = decisions
            .iter()
            .filter(|(i, d)| *i == o && d.admitted)
            .count();
        assert_eq!(
            counts(&store, chain, now).await[0],
            admitted as u64,
            "org {o}"
        );
    }
}

#[tokio::test]
async fn charges_and_budgets_land_in_every_slot() {
    let Some(seeds) = seeds("charges_and_budgets_land_in_every_slot") else {
        return;
    };
    let store = store(&seeds).await;
    let now = pinned(19);
    let tokens = |tenant: &str, scope, id: &str| {
        ChainLimit::new(
            tenant,
            scope,
            id,
            Charge::Reactive,
            WindowLimit::per_minute(1000),
        )
    };
    let chain = Chain::new(vec![
        tokens("org:acme", ScopeKind::Org, "acme"),
        tokens("customer:c", ScopeKind::Customer, "c"),
        tokens("gateway", ScopeKind::Gateway, "gateway"),
    ]);
    store.record(chain.limits(), 42, Some(now)).await.unwrap();
    assert_eq!(counts(&store, &chain, now).await, [42, 42, 42]);
    let memory = MemoryStore::new();
    memory.record(chain.limits(), 42, Some(now)).await.unwrap();
    let on_memory = memory
        .read_state(chain.limits(), &[], Some(now))
        .await
        .unwrap();
    let on_cluster = store
        .read_state(chain.limits(), &[], Some(now))
        .await
        .unwrap();
    assert_eq!(on_cluster.snapshots, on_memory.snapshots);
}

/// A chain across slots decided on the nodes' clocks: each slot's step decides at its own
/// instant, later than the one before, and a reservation's reconcile goes into each slot's own
/// bucket (`ChainDecision::charged_at`), not the first step's: a later step decided across a
/// bucket boundary, or on a node whose clock is ahead, holds its reservation in a later bucket.
#[tokio::test]
async fn a_reservation_across_slots_is_reconciled_at_each_steps_instant() {
    let Some(seeds) = seeds("a_reservation_across_slots_is_reconciled_at_each_steps_instant")
    else {
        return;
    };
    let store = store(&seeds).await;
    let reserved = |tenant: &str, scope, id: &str| {
        ChainLimit::new(
            tenant,
            scope,
            id,
            Charge::Reserved,
            WindowLimit::per_minute(1000),
        )
    };
    let chain = Chain::new(vec![
        reserved("org:acme", ScopeKind::Org, "acme"),
        reserved("gateway", ScopeKind::Gateway, "gateway"),
    ]);
    let d = chain.admit_costs(&store, &[80, 80]).await.unwrap();
    assert!(d.admitted);
    assert_eq!(d.charged_at.len(), 2, "each slot's own instant");
    assert_eq!(d.charged_at[0], d.now, "the first step's is the decision's");
    assert!(
        d.charged_at[1] > d.charged_at[0],
        "the later step decided later"
    );
    chain
        .reconcile_charged(&store, d.now, &d.charged_at, 30 - 80)
        .await
        .unwrap();
    // Both refunded where their reservations went (read at the later step's instant, in its
    // bucket whichever way the boundary fell).
    let seen = store
        .read_state(chain.limits(), &[], Some(d.charged_at[1]))
        .await
        .unwrap();
    let held: Vec<u64> = seen.snapshots.iter().map(|s| s.cur + s.prev).collect();
    assert_eq!(held, [30, 30]);
    // Pinned, the steps share the instant: one for all, as one step.
    let pinned_d = chain
        .admit_costs_at(&store, &[1, 1], pinned(20))
        .await
        .unwrap();
    assert!(pinned_d.charged_at.is_empty());
}

/// A cluster of the test's own (three primaries, no replicas), whose nodes a test may make
/// refuse writes; stopped on drop.
struct OwnCluster {
    dir: std::path::PathBuf,
    seeds: Vec<String>,
}

impl OwnCluster {
    fn start(name: &str) -> OwnCluster {
        let dir = std::env::temp_dir().join(format!(
            "floodgate-lib-own-cluster-{name}-{}",
            std::process::id()
        ));
        let out = std::process::Command::new(Self::script())
            .arg("start")
            .arg(&dir)
            .args(["3", "0"])
            .output()
            .expect("scripts/redis-cluster runs (redis-server and redis-cli installed)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let seeds = String::from_utf8(out.stdout).unwrap();
        let seeds = seeds.trim().split(',').map(str::to_owned).collect();
        OwnCluster { dir, seeds }
    }

    fn script() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/redis-cluster")
    }

    fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = std::process::Command::new("redis-cli")
            .arg("-p")
            .arg(port.to_string())
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn any_port(&self) -> u16 {
        self.seeds[0].rsplit(':').next().unwrap().parse().unwrap()
    }

    /// The port of the primary serving hash tag `tag`'s slot.
    fn primary_of(&self, tag: &str) -> u16 {
        let via = self.any_port();
        let slot: u16 = self
            .cli(via, &["cluster", "keyslot", &format!("{{{tag}}}")])
            .trim()
            .parse()
            .unwrap();
        for line in self.cli(via, &["cluster", "nodes"]).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") {
                continue;
            }
            let serves = f[8..].iter().any(|range| match range.split_once('-') {
                Some((a, b)) => (a.parse::<u16>().unwrap()..=b.parse().unwrap()).contains(&slot),
                None => range.parse::<u16>() == Ok(slot),
            });
            if serves {
                return f[1].split(['@', ':']).nth(1).unwrap().parse().unwrap();
            }
        }
        panic!("no primary serves {tag}'s slot")
    }

    /// Makes the node on `port` refuse every write (`OOM`), or take them again.
    fn refuse_writes(&self, port: u16, refuse: bool) {
        let max = if refuse { "1" } else { "0" };
        assert_eq!(
            self.cli(port, &["config", "set", "maxmemory", max]).trim(),
            "OK"
        );
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(Self::script())
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}

/// An org's budget and the gateway's, in slots served by two different primaries (the org's
/// and the gateway's), each with a cap nothing here reaches.
fn budgets_on_two_nodes(cluster: &OwnCluster) -> (floodgate::Budgets, u16, u16) {
    use floodgate::{Budget, Budgets, Period};
    let gateway = cluster.primary_of("gateway");
    let org = (0..)
        .map(|i| format!("acme{i}"))
        .find(|o| cluster.primary_of(&format!("org:{o}")) != gateway)
        .unwrap();
    let budgets = Budgets::new(vec![
        Budget::new(
            &format!("org:{org}"),
            ScopeKind::Org,
            &org,
            Period::Day,
            1_000_000,
        ),
        Budget::new(
            "gateway",
            ScopeKind::Gateway,
            "gateway",
            Period::Day,
            1_000_000,
        ),
    ]);
    (budgets, cluster.primary_of(&format!("org:{org}")), gateway)
}

/// A refused request's budget reservation is taken back slot by slot: a slot whose node fails
/// the refund keeps its part (towards stricter, counted as an error), and every other slot is
/// still refunded, not left charged for the rest of the period.
#[tokio::test]
async fn a_reservation_refund_reaches_every_slot_that_answers() {
    if seeds("a_reservation_refund_reaches_every_slot_that_answers").is_none() {
        return;
    }
    let cluster = OwnCluster::start("refund");
    let store = store_with(&cluster.seeds, &prefix()).await;
    let (budgets, org_node, _) = budgets_on_two_nodes(&cluster);
    let reserved = budgets.reserve(&store, 300).await.unwrap();
    assert!(reserved.allowed());
    // The org's slot, refunded first, fails; the gateway's node is fine.
    cluster.refuse_writes(org_node, true);
    let refunded = budgets.reconcile(&store, reserved.now, -300).await;
    cluster.refuse_writes(org_node, false);
    assert!(refunded.is_err(), "the org's part failed");
    let spent = budgets.check(&store).await.unwrap().spent;
    assert_eq!(spent, [300, 0], "the gateway's part was refunded");
}

/// A budget reservation is all or nothing: if one slot's add fails, the slots whose adds
/// landed are taken back, so that the request, answered with the store's error (or admitted
/// unchecked, budgets failing open, and then charged its spend), is not also charged its
/// reservation's price there for the rest of the period.
#[tokio::test]
async fn a_reservation_that_fails_in_one_slot_is_taken_back_from_the_others() {
    if seeds("a_reservation_that_fails_in_one_slot_is_taken_back_from_the_others").is_none() {
        return;
    }
    let cluster = OwnCluster::start("reserve");
    let store = store_with(&cluster.seeds, &prefix()).await;
    let (budgets, _, gateway_node) = budgets_on_two_nodes(&cluster);
    cluster.refuse_writes(gateway_node, true);
    let reserved = budgets.reserve(&store, 300).await;
    cluster.refuse_writes(gateway_node, false);
    assert!(reserved.is_err(), "the gateway's part failed");
    let spent = budgets.check(&store).await.unwrap().spent;
    assert_eq!(spent, [0, 0], "the org's part was taken back");
}
