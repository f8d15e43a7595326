//! What the decision benchmarks share: the names cycled through, the bucket and the chains, and
//! a loop split over threads.

#![allow(dead_code)]

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::thread;
use std::time::{Duration, Instant};

use floodgate::{Chain, ChainLimit, Charge, Rate, ScopeKind, TokenBucket, WindowLimit};

/// Distinct names the loops cycle through, as a keyed limiter in a service would see.
pub const NAMES: u64 = 1_024;

pub const BUCKET: TokenBucket<u64> =
    TokenBucket::new("bench", 1_000_000, Rate::per_second(1_000_000));

pub fn ready<F: Future>(f: F) -> F::Output {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("memory-store futures are ready at once"),
    }
}

pub fn chains() -> Vec<Chain> {
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
pub fn parallel(threads: u64, iters: u64, op: Arc<dyn Fn(u64) + Send + Sync>) -> Duration {
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
