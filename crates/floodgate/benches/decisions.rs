//! Nanoseconds per decision on the memory store, beside governor's keyed limiter in the same
//! run: one token bucket, and a 4-limit chain; on one thread and on two.
//!
//! `cargo bench -p floodgate --bench decisions`

// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

use std::future::Future;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use floodgate::store::MemoryStore;
use floodgate::{Chain, ChainLimit, Charge, Rate, ScopeKind, Timestamp, TokenBucket, WindowLimit};
use governor::{Quota, RateLimiter};

/// Distinct names the loops cycle through, as a keyed limiter in a service would see.
const NAMES: u64 = 1_024;

const BUCKET: TokenBucket<u64> = TokenBucket::new("bench", 1_000_000, Rate::per_second(1_000_000));

fn ready<F: Future>(f: F) -> F::Output {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("memory-store futures are ready at once"),
    }
}

fn chains() -> Vec<Chain> {
    let big = WindowLimit::per_minute(u64::MAX / 4);
    (0..NAMES)
        .map(|i| {
            let org = format!("org{}", i % 16);
            let tenant = format!("org:{org}");
            Chain::new(vec![
                ChainLimit::new(
                    &tenant,
                    ScopeKind::Key,
                    &format!("k{i}"),
                    Charge::Admission,
                    big,
                ),
                ChainLimit::new(
                    &tenant,
                    ScopeKind::Team,
                    &format!("t{}", i % 64),
                    Charge::Admission,
                    big,
                ),
                ChainLimit::new(&tenant, ScopeKind::Org, &org, Charge::Admission, big),
                ChainLimit::new("gateway", ScopeKind::Gateway, "all", Charge::Admission, big),
            ])
        })
        .collect()
}

/// Runs `op(i)` `iters` times split over `threads` threads; returns the wall time.
fn parallel(threads: u64, iters: u64, op: Arc<dyn Fn(u64) + Send + Sync>) -> Duration {
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let op = op.clone();
            thread::spawn(move || {
                for i in 0..iters / threads {
                    op(i.wrapping_mul(threads) + t);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("bench thread");
    }
    start.elapsed()
}

fn token_bucket(c: &mut Criterion) {
    let mut group = c.benchmark_group("token_bucket");
    for threads in [1u64, 2] {
        let quota = Quota::per_second(NonZeroU32::new(1_000_000).expect("non-zero"));
        let governor = Arc::new(RateLimiter::<u64, _, _>::keyed(quota));
        group.bench_function(format!("governor_keyed/{threads}t"), |b| {
            b.iter_custom(|iters| {
                let g = governor.clone();
                parallel(
                    threads,
                    iters,
                    Arc::new(move |i| {
                        let _ = black_box(g.check_key(&(i % NAMES)));
                    }),
                )
            })
        });
        let store = MemoryStore::new();
        group.bench_function(format!("floodgate_memory/{threads}t"), |b| {
            b.iter_custom(|iters| {
                let s = store.clone();
                parallel(
                    threads,
                    iters,
                    Arc::new(move |i| {
                        let _ = black_box(ready(BUCKET.acquire(&s, &(i % NAMES), 1)));
                    }),
                )
            })
        });
        let store = MemoryStore::new();
        let now = Timestamp::now();
        group.bench_function(format!("floodgate_memory_pinned_clock/{threads}t"), |b| {
            b.iter_custom(|iters| {
                let s = store.clone();
                parallel(
                    threads,
                    iters,
                    Arc::new(move |i| {
                        let _ = black_box(ready(BUCKET.acquire_at(&s, &(i % NAMES), 1, now)));
                    }),
                )
            })
        });
    }
    group.finish();
}

fn chain(c: &mut Criterion) {
    let mut group = c.benchmark_group("chain_4_limits");
    let chains = Arc::new(chains());
    for threads in [1u64, 2] {
        let store = MemoryStore::new();
        group.bench_function(format!("floodgate_memory/{threads}t"), |b| {
            b.iter_custom(|iters| {
                let (s, chains) = (store.clone(), chains.clone());
                parallel(
                    threads,
                    iters,
                    Arc::new(move |i| {
                        let chain = &chains[(i % NAMES) as usize];
                        let _ = black_box(ready(chain.admit(&s, 1)));
                    }),
                )
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = token_bucket, chain
}
criterion_main!(benches);
