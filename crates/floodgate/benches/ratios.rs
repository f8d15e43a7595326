//! The ratios of the decision benchmarks (`decisions.rs`), measured interleaved: governor's
//! keyed check, the memory store's token bucket and its 4-limit chain are timed in turn within
//! every round (odd rounds in that order, even rounds reversed), on one thread and then on two,
//! and each round's ratios are taken within the round. On a shared machine whose speed moves
//! between runs (and within one), a ratio of neighbours is steadier than a ratio of two
//! criterion groups measured a minute apart. Prints each ratio's median and range.
//!
//! `cargo bench -p floodgate --bench ratios [-- ROUNDS]` (21 rounds by default)

#![allow(missing_docs)]

mod shared;

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use floodgate::store::MemoryStore;
use governor::{Quota, RateLimiter};
use shared::{BUCKET, NAMES, chains, parallel, ready};

/// Decisions per timed run: about 20 to 60 ms each on this machine.
const RUN: u64 = 400_000;

type Op = Arc<dyn Fn(u64) + Send + Sync>;

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(21);
    let quota = Quota::per_second(NonZeroU32::new(1_000_000).expect("non-zero"));
    let governor = Arc::new(RateLimiter::<u64, _, _>::keyed(quota));
    let store = MemoryStore::new();
    let chains = Arc::new(chains());
    let ops: [(&str, Op); 3] = [
        ("governor keyed", {
            let g = Arc::clone(&governor);
            Arc::new(move |i| {
                let _ = black_box(g.check_key(&(i % NAMES)));
            })
        }),
        ("token bucket", {
            let s = store.clone();
            Arc::new(move |i| {
                let _ = black_box(ready(BUCKET.acquire(&s, &(i % NAMES), 1)));
            })
        }),
        ("4-limit chain", {
            let (s, chains) = (store.clone(), Arc::clone(&chains));
            Arc::new(move |i| {
                let chain = &chains[(i % NAMES) as usize];
                let _ = black_box(ready(chain.admit(&s, 1)));
            })
        }),
    ];
    for threads in [1u64, 2] {
        // A warm-up run of each, untimed.
        for (_, op) in &ops {
            parallel(threads, RUN, Arc::clone(op));
        }
        let mut ns: Vec<[f64; 3]> = Vec::with_capacity(rounds);
        for round in 0..rounds {
            let mut times = [0.0; 3];
            let order: Vec<usize> = if round % 2 == 0 {
                vec![0, 1, 2]
            } else {
                vec![2, 1, 0]
            };
            for k in order {
                let took: Duration = parallel(threads, RUN, Arc::clone(&ops[k].1));
                times[k] = took.as_nanos() as f64 / RUN as f64;
            }
            ns.push(times);
        }
        println!("{threads} thread(s), {rounds} rounds of {RUN} decisions each:");
        for (k, (name, _)) in ops.iter().enumerate() {
            let (m, lo, hi) = median(ns.iter().map(|t| t[k]).collect());
            print!("  {name:<15} {m:7.1} ns ({lo:.1}-{hi:.1})");
            if k > 0 {
                let (m, lo, hi) = median(ns.iter().map(|t| t[k] / t[0]).collect());
                print!("   {m:.2}x governor's ({lo:.2}-{hi:.2})");
            }
            println!();
        }
    }
}

/// The median, least and greatest of `v`.
fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}
