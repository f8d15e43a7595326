//! Admissions per second on one Redis or a Redis Cluster, with the Redis CPU each costs: how the
//! store scales with primaries. `scripts/bench-cluster` runs it against one server and clusters
//! of one, two and three primaries in one run, and prints the ratios.
//!
//! `FLOODGATE_BENCH_STORE` is `redis://host:port` (one server) or `cluster:` and the seeds,
//! comma-separated. `FLOODGATE_BENCH_REDIS_PIDS` (space-separated) are the Redis processes whose
//! CPU is counted (in all, and the busiest one's). Each decision is a 4-limit chain (key, project, team, org) of one of 256 orgs,
//! so a cluster spreads them over its slots; the `+ gateway` line adds a gateway-wide limit, one
//! hot slot that every decision also visits (two steps on a cluster). Knobs:
//! `FLOODGATE_BENCH_REQUESTS` (default 100000), `FLOODGATE_BENCH_CONCURRENCY` (256).
#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::store::redis::{RedisConfig, RedisStore};
use floodgate::{Chain, ChainLimit, Charge, ScopeKind, WindowLimit};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// User plus system CPU seconds of `pids` (all their threads), from /proc.
fn cpu_of(pids: &[u32]) -> f64 {
    let hz = 100.0; // USER_HZ on Linux
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .filter_map(|stat| {
            let rest = stat.rsplit_once(") ")?.1.to_owned();
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / hz)
        })
        .sum()
}

fn own_cpu() -> f64 {
    cpu_of(&[std::process::id()])
}

fn limit(tenant: &str, scope: ScopeKind, id: &str) -> ChainLimit {
    // Never refusing: every decision is an admission and a charge.
    let max = WindowLimit::per_minute(1 << 40);
    ChainLimit::new(tenant, scope, id, Charge::Admission, max)
}

fn chains(gateway: bool) -> Vec<Chain> {
    (0..256)
        .map(|o| {
            let tenant = format!("org:o{o}");
            let mut limits = vec![
                limit(&tenant, ScopeKind::Key, &format!("k{o}")),
                limit(&tenant, ScopeKind::Project, &format!("p{o}")),
                limit(&tenant, ScopeKind::Team, &format!("t{o}")),
                limit(&tenant, ScopeKind::Org, &format!("o{o}")),
            ];
            if gateway {
                limits.push(limit("gateway", ScopeKind::Gateway, "gateway"));
            }
            Chain::new(limits)
        })
        .collect()
}

async fn run(store: &RedisStore, chains: Arc<Vec<Chain>>, requests: u64, concurrency: u64) {
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (store, chains, next) = (store.clone(), chains.clone(), next.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= requests {
                    return;
                }
                let chain = &chains[(i % chains.len() as u64) as usize];
                let d = chain.admit(&store, 1).await.expect("admit");
                assert!(
                    d.enforced && d.admitted,
                    "every decision decided and admitted"
                );
            }
        });
    }
    tasks.join_all().await;
}

fn main() {
    let Ok(target) = std::env::var("FLOODGATE_BENCH_STORE") else {
        eprintln!("bench redis_scale: skipped, FLOODGATE_BENCH_STORE is unset");
        return;
    };
    let pids: Vec<u32> = std::env::var("FLOODGATE_BENCH_REDIS_PIDS")
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    let requests = env_or("FLOODGATE_BENCH_REQUESTS", 100_000);
    let concurrency = env_or("FLOODGATE_BENCH_CONCURRENCY", 256);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut config = match target.strip_prefix("cluster:") {
            Some(seeds) => RedisConfig::cluster(seeds.split(',')),
            None => RedisConfig::new(target.clone()),
        };
        config.prefix = format!("fgscale:{}:", std::process::id());
        config.timeout = Duration::from_secs(2);
        let store = RedisStore::connect(config).await.expect("connect");
        store.ready().await.expect("the store is ready");
        for (name, gateway) in [("4-limit chain", false), ("+ gateway limit", true)] {
            let chains = Arc::new(chains(gateway));
            run(&store, chains.clone(), requests / 10, concurrency).await;
            let each = |pids: &[u32]| pids.iter().map(|p| cpu_of(&[*p])).collect::<Vec<_>>();
            let (nodes0, own0, start) = (each(&pids), own_cpu(), Instant::now());
            run(&store, chains, requests, concurrency).await;
            let elapsed = start.elapsed().as_secs_f64();
            let nodes: Vec<f64> = each(&pids).iter().zip(&nodes0).map(|(a, b)| a - b).collect();
            let (redis, own) = (nodes.iter().sum::<f64>(), own_cpu() - own0);
            // With each primary on a machine of its own, the busiest one bounds the decisions a
            // second: one core of it serves 1e6 / (its CPU per decision) of them.
            let busiest = nodes.iter().copied().fold(0.0, f64::max);
            let per = |cpu: f64| cpu * 1e6 / requests as f64;
            println!(
                "{name}: {:.0} decisions/s, Redis CPU {:.1} us/decision, client CPU {:.1} us/decision, busiest node {:.1} us/decision",
                requests as f64 / elapsed,
                per(redis),
                per(own),
                per(busiest)
            );
        }
    });
}
