//! Shared test vectors: one table of operations at pinned times and the decisions they must
//! give. The pure math, the memory store and the Redis store all run this same table.
#![allow(dead_code)]

use std::time::Duration;

use floodgate::store::Store;
use floodgate::{
    Admission, Chain, ChainLimit, Charge, Rate, ScopeKind, Timestamp, TokenBucket, WindowLimit,
};

/// A minute boundary: bucket-aligned for every window that divides an hour.
pub const T0: u64 = 1_700_000_040_000_000;

/// `T0` plus `ms` milliseconds.
pub fn at(ms: u64) -> Timestamp {
    Timestamp::from_micros(T0 + ms * 1_000)
}

/// A limit in org `acme`'s chain.
pub fn limit(scope: ScopeKind, id: &str, charge: Charge, max: u64) -> ChainLimit {
    ChainLimit::new("org:acme", scope, id, charge, WindowLimit::per_minute(max))
}

/// One operation of a vector and what it must give.
pub enum Op {
    /// Admit one request on chain `chain` at `ms`; expect admission, the refusing index and
    /// the retry time (µs), and the most restrictive request limit's remaining units.
    Admit {
        chain: usize,
        ms: u64,
        admitted: bool,
        refused_by: Option<usize>,
        retry_us: Option<u64>,
        remaining: Option<u64>,
    },
    /// Record `units` on chain `chain` at `ms`.
    Record { chain: usize, ms: u64, units: u64 },
    /// Acquire `cost` from bucket `bucket` for `name` at `ms`.
    Acquire {
        bucket: usize,
        name: &'static str,
        ms: u64,
        cost: u64,
        expect: Admission,
    },
    /// Reset bucket `bucket` for `name` at `ms`.
    Reset {
        bucket: usize,
        name: &'static str,
        ms: u64,
        used: bool,
    },
}

/// The chains the vectors use.
pub fn chains() -> Vec<Chain> {
    use Charge::*;
    use ScopeKind::*;
    vec![
        // 0: a key limited to 5 requests a minute.
        Chain::new(vec![limit(Key, "a", Admission, 5)]),
        // 1, 2: two keys of one org; the org allows 3 a minute.
        Chain::new(vec![
            limit(Key, "k", Admission, 2),
            limit(Org, "acme", Admission, 3),
        ]),
        Chain::new(vec![
            limit(Key, "k2", Admission, 10),
            limit(Org, "acme", Admission, 3),
        ]),
        // 3: a key with 10 requests and 100 tokens a minute.
        Chain::new(vec![
            limit(Key, "t", Admission, 10),
            limit(Key, "t", Reactive, 100),
        ]),
    ]
}

/// The token buckets the vectors use.
pub const BUCKETS: [TokenBucket<str>; 3] = [
    TokenBucket::new("v3", 3, Rate::new(1, Duration::from_secs(2))),
    TokenBucket::new("v0", 0, Rate::per_second(1)),
    TokenBucket::new("v10", 10, Rate::per_second(3)),
];

fn ok(remaining: u64) -> Admission {
    Admission::Allowed { remaining }
}

fn denied_ms(ms: u64) -> Admission {
    Admission::Denied {
        retry_after: Some(Duration::from_millis(ms)),
    }
}

fn admit(chain: usize, ms: u64, remaining: u64) -> Op {
    Op::Admit {
        chain,
        ms,
        admitted: true,
        refused_by: None,
        retry_us: None,
        remaining: Some(remaining),
    }
}

fn refuse(chain: usize, ms: u64, by: usize, retry_us: u64) -> Op {
    Op::Admit {
        chain,
        ms,
        admitted: false,
        refused_by: Some(by),
        retry_us: Some(retry_us),
        remaining: Some(0),
    }
}

fn with_remaining(op: Op, left: u64) -> Op {
    match op {
        Op::Admit {
            chain,
            ms,
            admitted,
            refused_by,
            retry_us,
            ..
        } => Op::Admit {
            chain,
            ms,
            admitted,
            refused_by,
            retry_us,
            remaining: Some(left),
        },
        other => other,
    }
}

const S: u64 = 1_000_000;

/// The table. Times are milliseconds after `T0`; each case's arithmetic is in its comment.
pub fn vectors() -> Vec<Op> {
    vec![
        // --- chain 0: 5 a minute ---
        admit(0, 0, 4),
        admit(0, 1_000, 3),
        admit(0, 2_000, 2),
        admit(0, 3_000, 1),
        admit(0, 4_000, 0),
        // Full at e = 10 s: the next bucket in 50 s, where prev = 5 must weigh <= 4:
        // e'' = 60 - 4 * 60 / 5 = 12 s. Wait 62 s.
        refuse(0, 10_000, 0, 62 * S),
        // On the boundary the previous bucket counts in full: estimate 5. e' = 12 s.
        refuse(0, 60_000, 0, 12 * S),
        // At e = 12 s: 5 * 48/60 = 4, plus 1 = 5 <= 5.
        admit(0, 72_000, 0),
        // cur 1, prev 5 at e = 12: e' = 60 - (5 - 1 - 1) * 60 / 5 = 24 s. Wait 12 s.
        refuse(0, 72_000, 0, 12 * S),
        // Mid-window the previous bucket counts half: 1 + 2.5 = 3.5, plus 1 = 4.5 <= 5.
        admit(0, 90_000, 0),
        // 2 + 2.5 + 1 = 5.5 > 5: e' = 60 - (5 - 1 - 2) * 60 / 5 = 36 s. Wait 6 s.
        refuse(0, 90_000, 0, 6 * S),
        // --- chains 1 and 2: key 2/min and org 3/min ---
        admit(1, 0, 1),
        admit(1, 0, 0),
        // The key refuses: next bucket in 60 s, then e'' = 60 - 1 * 60 / 2 = 30 s. The org
        // is not charged for it.
        refuse(1, 0, 0, 90 * S),
        // The org has exactly one slot left.
        admit(2, 0, 0),
        // The org refuses: 60 s + (60 - 2 * 60 / 3) = 80 s.
        refuse(2, 0, 1, 80 * S),
        // --- chain 3: 10 requests and 100 tokens a minute ---
        admit(3, 0, 9),
        Op::Record {
            chain: 3,
            ms: 1_000,
            units: 150,
        },
        // Tokens over: reactive wait is strict, e'' = 60 s - ceil(100 * 60 s / 150) + 1 µs.
        // The request limit still shows its 9 free slots.
        with_remaining(refuse(3, 2_000, 1, 58 * S + 20 * S + 1), 9),
        // At e = 20 s exactly, 150 * 40/60 = 100, not < 100: one microsecond more.
        with_remaining(refuse(3, 80_000, 1, 1), 9),
        // The refusals took no request slot: prev = 1 at weight 39/60, cur 0.
        admit(3, 81_000, 8),
        // --- bucket 0: capacity 3, one token per 2 s ---
        Op::Acquire {
            bucket: 0,
            name: "u",
            ms: 0,
            cost: 1,
            expect: ok(2),
        },
        Op::Acquire {
            bucket: 0,
            name: "u",
            ms: 0,
            cost: 1,
            expect: ok(1),
        },
        Op::Acquire {
            bucket: 0,
            name: "u",
            ms: 0,
            cost: 1,
            expect: ok(0),
        },
        Op::Acquire {
            bucket: 0,
            name: "u",
            ms: 0,
            cost: 1,
            expect: denied_ms(2_000),
        },
        Op::Acquire {
            bucket: 0,
            name: "u",
            ms: 1_000,
            cost: 1,
            expect: denied_ms(1_000),
        },
        // The denial at 1 s stored 0.5 tokens; 1 s later there is exactly one.
        Op::Acquire {
            bucket: 0,
            name: "u",
            ms: 2_000,
            cost: 1,
            expect: ok(0),
        },
        Op::Acquire {
            bucket: 0,
            name: "u",
            ms: 2_000,
            cost: 4,
            expect: Admission::Denied { retry_after: None },
        },
        Op::Reset {
            bucket: 0,
            name: "u",
            ms: 3_000,
            used: true,
        },
        Op::Reset {
            bucket: 0,
            name: "u",
            ms: 3_000,
            used: false,
        },
        Op::Acquire {
            bucket: 0,
            name: "u",
            ms: 3_000,
            cost: 0,
            expect: ok(3),
        },
        Op::Acquire {
            bucket: 0,
            name: "w",
            ms: 3_000,
            cost: 3,
            expect: ok(0),
        },
        // Idle long enough to be full again: not used any more.
        Op::Reset {
            bucket: 0,
            name: "w",
            ms: 100_000,
            used: false,
        },
        // --- bucket 1: capacity 0 admits only cost 0 ---
        Op::Acquire {
            bucket: 1,
            name: "z",
            ms: 0,
            cost: 0,
            expect: ok(0),
        },
        Op::Acquire {
            bucket: 1,
            name: "z",
            ms: 0,
            cost: 1,
            expect: Admission::Denied { retry_after: None },
        },
        // --- bucket 2: fractional refill, 3 a second ---
        Op::Acquire {
            bucket: 2,
            name: "f",
            ms: 0,
            cost: 10,
            expect: ok(0),
        },
        // 0.3 tokens after 100 ms; 0.7 more take 233.3 ms: 234 ms rounded up.
        Op::Acquire {
            bucket: 2,
            name: "f",
            ms: 100,
            cost: 1,
            expect: denied_ms(234),
        },
        Op::Acquire {
            bucket: 2,
            name: "f",
            ms: 334,
            cost: 1,
            expect: ok(0),
        },
    ]
}

/// Runs every vector against `store`, which must be empty (or under a fresh prefix).
pub async fn run_vectors<S: Store>(store: &S) {
    let chains = chains();
    for (i, op) in vectors().into_iter().enumerate() {
        match op {
            Op::Admit {
                chain,
                ms,
                admitted,
                refused_by,
                retry_us,
                remaining,
            } => {
                let d = chains[chain]
                    .admit_at(store, 1, at(ms))
                    .await
                    .unwrap_or_else(|e| panic!("vector {i}: {e}"));
                assert_eq!(d.admitted, admitted, "vector {i}: admitted");
                assert_eq!(d.refused_by, refused_by, "vector {i}: refused_by");
                assert_eq!(
                    d.retry_after,
                    retry_us.map(Duration::from_micros),
                    "vector {i}: retry"
                );
                if let Some(r) = remaining {
                    let most = d.most_restrictive(Charge::Admission).map(|s| s.remaining);
                    assert_eq!(most, Some(r), "vector {i}: remaining");
                }
            }
            Op::Record { chain, ms, units } => chains[chain]
                .record_at(store, units, at(ms))
                .await
                .unwrap_or_else(|e| panic!("vector {i}: {e}")),
            Op::Acquire {
                bucket,
                name,
                ms,
                cost,
                expect,
            } => {
                let got = BUCKETS[bucket]
                    .acquire_at(store, name, cost, at(ms))
                    .await
                    .unwrap_or_else(|e| panic!("vector {i}: {e}"));
                assert_eq!(got, expect, "vector {i}: acquire");
            }
            Op::Reset {
                bucket,
                name,
                ms,
                used,
            } => {
                let got = BUCKETS[bucket]
                    .reset_at(store, name, at(ms))
                    .await
                    .unwrap_or_else(|e| panic!("vector {i}: {e}"));
                assert_eq!(got, used, "vector {i}: reset");
            }
        }
    }
}

/// Whether the Redis tests must run (CI sets this): a skip is then a failure.
pub fn redis_required() -> bool {
    std::env::var("FLOODGATE_REQUIRE_REDIS").is_ok_and(|v| v == "1")
}
