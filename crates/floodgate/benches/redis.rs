//! Decisions per second on the Redis store, beside the server's own ceiling for the same
//! script.
//!
//! `FLOODGATE_TEST_REDIS_URL=redis://127.0.0.1:6379/0 cargo bench -p floodgate --bench redis`
//!
//! For a token bucket and for a 4-limit chain, many tasks keep decisions in flight on the
//! store's one multiplexed connection, over a keyspace of random names. In the same run,
//! `redis-benchmark` sends EVALSHA of the very script the store loads, with the same keys,
//! arguments and concurrency: the ceiling, where only Redis works. Two shapes of it: as many
//! connections as requests in flight (`-c N`), and one connection with N pipelined (`-c 1 -P N`),
//! which is how the store's multiplexed connection sends. The chain's script takes its numbers
//! packed as doubles, which `redis-benchmark` cannot send (a NUL byte ends an argument): its
//! ceiling is the same calls, made ready beforehand, sent in the same two shapes from plain
//! redis-rs connections (`raw_ceiling`), a lower bound. Skips (exit 0) when the URL is unset.
//!
//! Knobs: `FLOODGATE_BENCH_REQUESTS` (default 200000 per run), `FLOODGATE_BENCH_CONCURRENCY`
//! (128), `FLOODGATE_BENCH_THREADS` (Tokio workers; 0, the default, for a current-thread
//! runtime), `FLOODGATE_BENCH_KEYS` (1000 names), `FLOODGATE_BENCH_REPEATS` (3; medians are
//! reported).
#![allow(missing_docs)]

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use floodgate::store::redis::{RedisConfig, RedisStore, script_source};
use floodgate::{Chain, ChainLimit, Charge, Rate, ScopeKind, TokenBucket, WindowLimit};

const PREFIX: &str = "fgbench:";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `redis-benchmark` wants host, port and password apart: `redis://[:pw@]host[:port][/db]`.
struct Target {
    host: String,
    port: u16,
    password: Option<String>,
}

fn target(url: &str) -> Option<Target> {
    let rest = url.strip_prefix("redis://")?;
    let (auth, rest) = match rest.rsplit_once('@') {
        Some((auth, rest)) => (Some(auth), rest),
        None => (None, rest),
    };
    let hostport = rest.split('/').next()?;
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().ok()?),
        None => (hostport, 6379),
    };
    let password = auth.map(|a| a.rsplit_once(':').map_or(a, |(_, p)| p).to_owned());
    Some(Target {
        host: host.to_owned(),
        port,
        password,
    })
}

/// The bucket names and the chains' key ids: 12 digits, as redis-benchmark's `__rand_int__`.
fn name(i: u64) -> String {
    format!("{i:012}")
}

const BUCKET: TokenBucket<str> =
    TokenBucket::new("bench", 1_000_000_000, Rate::per_second(1_000_000_000));

/// A chain of four request limits (key, team, org, gateway) large enough to admit everything,
/// so that every decision also writes all four.
fn chain(key: &str) -> Chain {
    let l = |tenant: &str, scope, id: &str| {
        ChainLimit::new(
            tenant,
            scope,
            id,
            Charge::Admission,
            WindowLimit::per_minute(1_000_000_000_000),
        )
    };
    Chain::new(vec![
        l("org:bench", ScopeKind::Key, key),
        l("org:bench", ScopeKind::Team, "t"),
        l("org:bench", ScopeKind::Org, "bench"),
        l("gw", ScopeKind::Gateway, "all"),
    ])
}

#[derive(Clone, Copy)]
struct Knobs {
    requests: u64,
    concurrency: u64,
    keys: u64,
}

/// Runs `requests` decisions with `concurrency` in flight; decisions per second.
async fn ours<F, Fut>(knobs: Knobs, decide: F) -> f64
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    let decide = Arc::new(decide);
    let left = Arc::new(AtomicU64::new(knobs.requests));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..knobs.concurrency {
        let (decide, left, keys) = (decide.clone(), left.clone(), knobs.keys);
        tasks.spawn(async move {
            let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ (t + 1).wrapping_mul(0xff51_afd7_ed55_8ccd);
            let mut enforced = 0u64;
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
            {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                enforced += u64::from(decide(rng % keys).await);
            }
            enforced
        });
    }
    let enforced: u64 = tasks.join_all().await.into_iter().sum();
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(enforced, knobs.requests, "every decision must be Redis's");
    knobs.requests as f64 / secs
}

/// `redis-benchmark` running EVALSHA of `op`'s script: requests per second.
///
/// `pipelined`: one connection with `concurrency` requests pipelined on it (`-c 1 -P N`), the
/// shape of the store's own traffic; otherwise `concurrency` connections with one request in
/// flight each (`-c N`).
fn ceiling(
    target: &Target,
    knobs: &Knobs,
    pipelined: bool,
    sha: &str,
    keys: &[String],
    args: &[String],
) -> Option<f64> {
    let mut cmd = Command::new("redis-benchmark");
    cmd.args(["-h", &target.host, "-p", &target.port.to_string()]);
    if let Some(pw) = &target.password {
        cmd.args(["-a", pw]);
    }
    let n = knobs.concurrency.to_string();
    if pipelined {
        cmd.args(["-c", "1", "-P", &n]);
    } else {
        cmd.args(["-c", &n]);
    }
    cmd.args(["-n", &knobs.requests.to_string()])
        .args(["-r", &knobs.keys.to_string(), "-q"])
        .args(["EVALSHA", sha, &keys.len().to_string()])
        .args(keys)
        .args(args);
    let out = cmd.output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .split(['\r', '\n'])
        .rfind(|l| l.contains("requests per second"))?;
    let before = line.split(" requests per second").next()?;
    before.rsplit(' ').next()?.parse().ok()
}

/// The chain's ceiling without `redis-benchmark`, whose arguments cannot hold the admit script's
/// packed numbers (a NUL byte ends one): `calls` (one ready for each key name) sent from plain
/// redis-rs connections in the shapes `redis-benchmark` sends, `concurrency` connections with
/// one call in flight each, or one connection with `concurrency` calls a pipeline (`pipelined`).
/// Requests per second; a lower bound on Redis's own, since this client is not C.
async fn raw_ceiling(
    url: &str,
    knobs: &Knobs,
    pipelined: bool,
    calls: &Arc<Vec<redis::Cmd>>,
) -> Option<f64> {
    let client = redis::Client::open(url).ok()?;
    // A xorshift step: the index of the next call.
    let next = |rng: &mut u64| {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        (*rng % calls.len() as u64) as usize
    };
    let started;
    if pipelined {
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let (mut rng, mut left) = (0x9e37_79b9_7f4a_7c15_u64, knobs.requests);
        started = Instant::now();
        while left > 0 {
            let n = left.min(knobs.concurrency.max(1));
            let mut pipe = redis::pipe();
            for _ in 0..n {
                pipe.add_command(calls[next(&mut rng)].clone());
            }
            let _: Vec<redis::Value> = pipe.query_async(&mut conn).await.ok()?;
            left -= n;
        }
    } else {
        // Each connection with its calls, drawn from the shared ones as the pipelined shape
        // draws them, before the clock starts.
        let mut conns = Vec::new();
        for t in 0..knobs.concurrency {
            let conn = client.get_multiplexed_async_connection().await.ok()?;
            let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ (t + 1).wrapping_mul(0xff51_afd7_ed55_8ccd);
            let mine: Vec<redis::Cmd> = (0..64).map(|_| calls[next(&mut rng)].clone()).collect();
            conns.push((conn, mine));
        }
        let left = Arc::new(AtomicU64::new(knobs.requests));
        started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for (mut conn, mine) in conns {
            let left = left.clone();
            tasks.spawn(async move {
                for call in mine.iter().cycle() {
                    if left
                        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                        .is_err()
                    {
                        break;
                    }
                    if call.query_async::<redis::Value>(&mut conn).await.is_err() {
                        return false;
                    }
                }
                true
            });
        }
        if !tasks.join_all().await.into_iter().all(|ok| ok) {
            return None;
        }
    }
    Some(knobs.requests as f64 / started.elapsed().as_secs_f64())
}

async fn load(url: &str, op: &str) -> String {
    let mut conn = redis::Client::open(url)
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(script_source(op).expect("script"))
        .query_async(&mut conn)
        .await
        .expect("SCRIPT LOAD")
}

fn main() {
    let Ok(url) = std::env::var("FLOODGATE_TEST_REDIS_URL") else {
        eprintln!("bench redis: skipped, FLOODGATE_TEST_REDIS_URL is unset");
        return;
    };
    let knobs = Knobs {
        requests: env_or("FLOODGATE_BENCH_REQUESTS", 200_000),
        concurrency: env_or("FLOODGATE_BENCH_CONCURRENCY", 128),
        keys: env_or("FLOODGATE_BENCH_KEYS", 1_000),
    };
    let threads = env_or("FLOODGATE_BENCH_THREADS", 0) as usize;
    let repeats = env_or("FLOODGATE_BENCH_REPEATS", 3).max(1);
    // 0: a current-thread runtime, where the connection's driver task runs after the tasks
    // that queued requests, so it writes them in one batch.
    let rt = match threads {
        0 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    }
    .enable_all()
    .build()
    .expect("runtime");
    let target = target(&url);
    if target.is_none() {
        eprintln!("bench redis: no redis-benchmark ceiling for this URL (TLS or unix socket)");
    }
    rt.block_on(async {
        let store = RedisStore::connect(RedisConfig {
            prefix: PREFIX.into(),
            timeout: Duration::from_secs(2),
            ..RedisConfig::new(url.clone())
        })
        .await
        .expect("connect");
        store.ping().await.expect("Redis must answer");
        println!(
            "redis bench: {} decisions per run, {} in flight on one connection, {} names, \
             runtime: {}, medians of {repeats} runs",
            knobs.requests,
            knobs.concurrency,
            knobs.keys,
            match threads {
                0 => "current-thread".to_owned(),
                n => format!("multi-thread, {n} workers"),
            }
        );
        let c = knobs.concurrency;
        println!(
            "{:<16} {:>12} {:>18} {:>7} {:>18} {:>7}",
            "",
            "floodgate/s",
            format!("ceiling -c {c}/s"),
            "ratio",
            format!("ceiling -P {c}/s"),
            "ratio"
        );

        // Token bucket: the store's acquire script, keys `{tb:bench:NNNNNNNNNNNN}`.
        let names: Arc<Vec<String>> = Arc::new((0..knobs.keys).map(name).collect());
        let bucket_store = store.clone();
        let warm = Knobs {
            requests: knobs.requests / 10,
            ..knobs
        };
        let run_bucket = |k: Knobs| {
            let (store, names) = (bucket_store.clone(), names.clone());
            ours(k, move |i| {
                let (store, names) = (store.clone(), names.clone());
                async move {
                    BUCKET
                        .acquire(&store, &names[i as usize], 1)
                        .await
                        .expect("acquire")
                        .is_allowed()
                }
            })
        };
        run_bucket(warm).await;
        let sha = load(&url, "acquire").await;
        let limit = BUCKET.limit();
        let keys = [format!("{PREFIX}{{tb:bench:__rand_int__}}")];
        let args = [
            String::new(),
            limit.capacity.to_string(),
            limit.rate.tokens().to_string(),
            limit.rate.period_micros().to_string(),
            "1".into(),
        ];
        let raw = |pipelined| {
            target
                .as_ref()
                .and_then(|t| ceiling(t, &knobs, pipelined, &sha, &keys, &args))
        };
        let mut rows = Vec::new();
        for _ in 0..repeats {
            let cpu = cpu_seconds();
            let ours = run_bucket(knobs).await;
            let cpu = cpu_seconds() - cpu;
            rows.push((ours, cpu, raw(false), raw(true)));
        }
        report("token bucket", &knobs, rows);

        // A 4-limit chain: the store's admit script, one random key and three shared scopes.
        let chains: Arc<Vec<Chain>> = Arc::new((0..knobs.keys).map(|i| chain(&name(i))).collect());
        let chain_store = store.clone();
        let run_chain = |k: Knobs| {
            let (store, chains) = (chain_store.clone(), chains.clone());
            ours(k, move |i| {
                let (store, chains) = (store.clone(), chains.clone());
                async move {
                    let d = chains[i as usize].admit(&store, 1).await.expect("admit");
                    d.enforced && d.admitted
                }
            })
        };
        run_chain(warm).await;
        let sha = load(&url, "admit").await;
        let template = chain("__rand_int__");
        let keys: Vec<String> = template
            .limits()
            .iter()
            .map(|l| format!("{PREFIX}{}", l.key()))
            .collect();
        // The admit script's layout (see admit.lua): the time (empty: Redis's clock), the
        // numbers packed as doubles (how many period counters, none; each key's window, max and
        // kind; how many groups; one group of one request: cost, count, the chain's length, the
        // gate's, the chain), then each key's TTL. One call ready for each key name.
        let mut numbers = vec![0u64];
        for l in template.limits() {
            numbers.extend([l.limit().window_micros(), l.limit().max(), 1]);
        }
        let n = template.limits().len() as u64;
        numbers.extend([1, 1, 1, n, 0]);
        numbers.extend(1..=n);
        let packed: Vec<u8> = numbers
            .iter()
            .flat_map(|&v| (v as f64).to_le_bytes())
            .collect();
        let calls: Arc<Vec<redis::Cmd>> = Arc::new(
            (0..knobs.keys)
                .map(|i| {
                    let mut cmd = redis::cmd("EVALSHA");
                    cmd.arg(&sha).arg(keys.len());
                    for k in &keys {
                        cmd.arg(k.replace("__rand_int__", &name(i)));
                    }
                    cmd.arg("").arg(&packed);
                    for l in template.limits() {
                        cmd.arg((2 * l.limit().window_micros()).div_ceil(1000));
                    }
                    cmd
                })
                .collect(),
        );
        let mut rows = Vec::new();
        for _ in 0..repeats {
            let cpu = cpu_seconds();
            let ours = run_chain(knobs).await;
            let cpu = cpu_seconds() - cpu;
            let conns = raw_ceiling(&url, &knobs, false, &calls).await;
            let piped = raw_ceiling(&url, &knobs, true, &calls).await;
            rows.push((ours, cpu, conns, piped));
        }
        report("4-limit chain", &knobs, rows);

        let stats = store.stats();
        assert_eq!(stats.failed_open + stats.errors, 0, "{stats:?}");
    });
}

type Row = (f64, f64, Option<f64>, Option<f64>);

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// One scenario: the median of each column over the repeats, and our share of each ceiling.
fn report(what: &str, knobs: &Knobs, rows: Vec<Row>) {
    for (i, (ours, cpu, conns, piped)) in rows.iter().enumerate() {
        println!(
            "  {what} run {i}: floodgate {ours:.0}/s ({:.1} µs client CPU per decision), \
             ceiling -c {:.0}/s, -P {:.0}/s",
            cpu * 1e6 / knobs.requests as f64,
            conns.unwrap_or(f64::NAN),
            piped.unwrap_or(f64::NAN),
        );
    }
    let ours = median(rows.iter().map(|r| r.0).collect()).unwrap_or(f64::NAN);
    let cell = |raw: Option<f64>| match raw {
        Some(raw) => format!("{raw:>18.0} {:>6.1}%", 100.0 * ours / raw),
        None => format!("{:>18} {:>7}", "n/a", "n/a"),
    };
    println!(
        "{what:<16} {ours:>12.0} {} {}",
        cell(median(rows.iter().filter_map(|r| r.2).collect())),
        cell(median(rows.iter().filter_map(|r| r.3).collect())),
    );
}

/// This process's CPU time (user + system, all threads), from `/proc/self/stat`; 0 elsewhere.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces, inside parentheses).
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name; USER_HZ = 100.
    (ticks(11) + ticks(12)) / 100.0
}
