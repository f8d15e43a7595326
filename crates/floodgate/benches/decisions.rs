//! Nanoseconds per decision on the memory store, beside governor's keyed limiter in the same
//! run: one token bucket, and a 4-limit chain; on one thread and on two.
//!
//! `cargo bench -p floodgate --bench decisions`

// criterion's macros generate undocumented public items.
#![allow(missing_docs)]

mod shared;

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use floodgate::Timestamp;
use floodgate::store::MemoryStore;
use governor::{Quota, RateLimiter};
use shared::{BUCKET, NAMES, chains, parallel, ready};

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
