//! Shared test vectors: one table of operations at pinned times and the decisions they must
//! give. The pure math, the memory store and the Redis store all run this same table.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use floodgate::store::Store;
use floodgate::{
    Admission, Budget, Budgets, Chain, ChainLimit, Charge, InFlightLimit, Period, PeriodCounter,
    Rate, ScopeKind, Timestamp, TokenBucket, WindowLimit,
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
    /// the retry time (µs), the most restrictive request limit's remaining units (`None`: no
    /// enforced request limit), and the shadow limits that were over.
    Admit {
        chain: usize,
        ms: u64,
        admitted: bool,
        refused_by: Option<usize>,
        retry_us: Option<u64>,
        remaining: Option<u64>,
        shadow_over: &'static [usize],
    },
    /// Read chain `chain` at `ms` with an admission of cost 0, which charges nothing; expect
    /// each limit's count in its current bucket.
    Counts {
        chain: usize,
        ms: u64,
        cur: &'static [u64],
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
    /// Admit one request on chain `chain` at `ms` costing each limit its own units; expect
    /// admission, the refusing index, the retry time (µs) and the most restrictive token
    /// limit's remaining units.
    AdmitCosts {
        chain: usize,
        ms: u64,
        costs: &'static [u64],
        admitted: bool,
        refused_by: Option<usize>,
        retry_us: Option<u64>,
        tokens_left: Option<u64>,
    },
    /// Reconcile, at `ms`, the reservation chain `chain` made at `reserved_ms`: `delta` is the
    /// actual usage minus the reservation.
    Reconcile {
        chain: usize,
        reserved_ms: u64,
        ms: u64,
        delta: i64,
    },
    /// Read chain `chain` at `ms` (an admission of cost 0); expect each limit's `(cur, prev)`.
    Seen {
        chain: usize,
        ms: u64,
        counts: &'static [(u64, u64)],
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
        // 4: a key limited to 5 a minute, decided by two clocks 2 ms apart.
        Chain::new(vec![limit(Key, "skew", Admission, 5)]),
        // 5: a shadow key limit of 1 a minute under an enforced org limit of 10.
        Chain::new(vec![
            limit(Key, "sh", Admission, 1).shadow(),
            limit(Org, "sh", Admission, 10),
        ]),
        // 6: an enforced key limit of 2 under a shadow org limit of 1.
        Chain::new(vec![
            limit(Key, "e", Admission, 2),
            limit(Org, "sh1", Admission, 1).shadow(),
        ]),
        // 7: only a shadow limit no request fits.
        Chain::new(vec![limit(Key, "z", Admission, 0).shadow()]),
        // 8: a key with 10 requests and 100 reserved tokens a minute.
        Chain::new(vec![
            limit(Key, "rv", Admission, 10),
            limit(Key, "rv", Reserved, 100),
        ]),
        // 9: requests and reactive tokens on the key, reserved tokens on the org.
        Chain::new(vec![
            limit(Key, "mx", Admission, 10),
            limit(Key, "mx", Reactive, 100),
            limit(Org, "mx", Reserved, 100),
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
        shadow_over: &[],
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
        shadow_over: &[],
    }
}

fn reserve(chain: usize, ms: u64, costs: &'static [u64], tokens_left: u64) -> Op {
    Op::AdmitCosts {
        chain,
        ms,
        costs,
        admitted: true,
        refused_by: None,
        retry_us: None,
        tokens_left: Some(tokens_left),
    }
}

fn reconcile(chain: usize, reserved_ms: u64, ms: u64, delta: i64) -> Op {
    Op::Reconcile {
        chain,
        reserved_ms,
        ms,
        delta,
    }
}

fn seen(chain: usize, ms: u64, counts: &'static [(u64, u64)]) -> Op {
    Op::Seen { chain, ms, counts }
}

fn with_remaining(mut op: Op, left: Option<u64>) -> Op {
    if let Op::Admit { remaining, .. } = &mut op {
        *remaining = left;
    }
    op
}

fn with_shadow_over(mut op: Op, over: &'static [usize]) -> Op {
    if let Op::Admit { shadow_over, .. } = &mut op {
        *shadow_over = over;
    }
    op
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
        with_remaining(refuse(3, 2_000, 1, 58 * S + 20 * S + 1), Some(9)),
        // At e = 20 s exactly, 150 * 40/60 = 100, not < 100: one microsecond more.
        with_remaining(refuse(3, 80_000, 1, 1), Some(9)),
        // The refusals took no request slot: prev = 1 at weight 39/60, cur 0.
        admit(3, 81_000, 8),
        // --- chain 4: a clock 2 ms behind the one that wrote the state ---
        admit(4, 58_000, 4),
        admit(4, 58_000, 3),
        admit(4, 58_000, 2),
        // The next bucket, 1 ms in: cur 1, prev 3 at 59.999/60: 5 - 1 - 2.99995 -> 1 left.
        admit(4, 60_001, 1),
        // 2 ms behind, the state "1 1 3" is from a later bucket. It must not read as empty
        // (the behind clock would admit 5 more: a burst of 2N across the edge); it reads as
        // the current bucket holding all its units: cur 4, prev 0 -> the 5th passes.
        admit(4, 59_999, 0),
        // cur 5: full. Next bucket in 1 ms, where prev = 5 weighs <= 4 at e'' = 12 s.
        refuse(4, 59_999, 0, 1_000 + 12 * S),
        // The clock ahead again: "0 5 0" rolls over, prev 5 at e = 2 ms: 12 s - 2 ms.
        refuse(4, 60_002, 0, 12 * S - 2_000),
        // --- chain 5: a shadow key of 1 a minute, the org's 10 enforced ---
        // The first fits the key; the next nine are over it, and admitted all the same.
        admit(5, 0, 9),
        with_shadow_over(admit(5, 1_000, 8), &[0]),
        with_shadow_over(admit(5, 2_000, 7), &[0]),
        with_shadow_over(admit(5, 3_000, 6), &[0]),
        with_shadow_over(admit(5, 4_000, 5), &[0]),
        with_shadow_over(admit(5, 5_000, 4), &[0]),
        with_shadow_over(admit(5, 6_000, 3), &[0]),
        with_shadow_over(admit(5, 7_000, 2), &[0]),
        with_shadow_over(admit(5, 8_000, 1), &[0]),
        with_shadow_over(admit(5, 9_000, 0), &[0]),
        // The shadow key was charged every one of them.
        Op::Counts {
            chain: 5,
            ms: 9_000,
            cur: &[10, 10],
        },
        // The org refuses: next bucket in 50 s, then e'' = 60 - 9 * 60 / 10 = 6 s. The shadow
        // key would wait 110 s (its 10 must weigh nothing): not the chain's wait.
        with_shadow_over(refuse(5, 10_000, 1, 56 * S), &[0]),
        // Refused, so charged to nothing, the shadow key included.
        Op::Counts {
            chain: 5,
            ms: 10_000,
            cur: &[10, 10],
        },
        // At e = 6 s the org's 10 weigh 9: one more fits it (9 + 1 = 10); the key's still over.
        with_shadow_over(admit(5, 66_000, 0), &[0]),
        Op::Counts {
            chain: 5,
            ms: 66_000,
            cur: &[1, 1],
        },
        // --- chain 6: the key's 2 enforced, a shadow org of 1 ---
        admit(6, 0, 1),
        with_shadow_over(admit(6, 0, 0), &[1]),
        // The key refuses: 60 s, then e'' = 60 - 1 * 60 / 2 = 30 s; the shadow org would wait
        // 120 s, which does not count.
        with_shadow_over(refuse(6, 0, 0, 90 * S), &[1]),
        Op::Counts {
            chain: 6,
            ms: 0,
            cur: &[2, 2],
        },
        // --- chain 7: a shadow limit of 0 makes no request impossible ---
        with_remaining(with_shadow_over(admit(7, 0, 0), &[0]), None),
        Op::Counts {
            chain: 7,
            ms: 0,
            cur: &[1],
        },
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
        // A clock 1 s behind the one that emptied the bucket refills nothing and must not move
        // the state's time back: else the clock ahead would refill that second again (at 11 s
        // it would find a whole token where half of one has come back since 10 s).
        Op::Acquire {
            bucket: 0,
            name: "skew",
            ms: 10_000,
            cost: 3,
            expect: ok(0),
        },
        Op::Acquire {
            bucket: 0,
            name: "skew",
            ms: 9_000,
            cost: 1,
            expect: denied_ms(2_000),
        },
        Op::Acquire {
            bucket: 0,
            name: "skew",
            ms: 11_000,
            cost: 1,
            expect: denied_ms(1_000),
        },
        Op::Acquire {
            bucket: 0,
            name: "skew",
            ms: 12_000,
            cost: 1,
            expect: ok(0),
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
        // --- chain 8: 10 requests, 100 reserved tokens a minute; costs [1, estimate] ---
        // An estimate of 60 fits (0 + 60 <= 100): 40 tokens left.
        reserve(8, 0, &[1, 60], 40),
        // 60 + 60 > 100: refused by the token limit, charged nothing anywhere. The wait is for
        // the next bucket (59 s), then until 60 carried weighs 40: 60 * (1 - 40/60) = 20 s.
        Op::AdmitCosts {
            chain: 8,
            ms: 1_000,
            costs: &[1, 60],
            admitted: false,
            refused_by: Some(1),
            retry_us: Some(79 * S),
            tokens_left: Some(0),
        },
        seen(8, 1_000, &[(1, 0), (60, 0)]),
        // It used 30 of its 60: 30 go back into its bucket.
        reconcile(8, 0, 2_000, 30 - 60),
        seen(8, 2_000, &[(1, 0), (30, 0)]),
        reserve(8, 3_000, &[1, 60], 10),
        seen(8, 3_000, &[(2, 0), (90, 0)]),
        // Across the bucket boundary: the second used 80 of its 60, and the 20 owed go into the
        // bucket it reserved in, now the previous one.
        reconcile(8, 3_000, 61_000, 80 - 60),
        seen(8, 61_000, &[(0, 2), (0, 110)]),
        // A refund whose bucket is gone (two buckets on) is dropped; units owed go into the
        // current bucket, towards stricter.
        reserve(8, 120_500, &[1, 10], 90),
        reconcile(8, 3_000, 121_000, -50),
        seen(8, 121_000, &[(1, 0), (10, 0)]),
        reconcile(8, 3_000, 121_500, 5),
        seen(8, 121_500, &[(1, 0), (15, 0)]),
        // Never below zero: a refund of 100 from a bucket holding 15.
        reconcile(8, 120_500, 122_000, -100),
        seen(8, 122_000, &[(1, 0), (0, 0)]),
        // An upstream 500 (no usage): the reservation is kept, a difference of 0 changes nothing.
        reserve(8, 123_000, &[1, 10], 90),
        reconcile(8, 123_000, 123_500, 0),
        seen(8, 123_500, &[(2, 0), (10, 0)]),
        // A cut stream whose chunks counted 25 against a reservation of 10: 15 more.
        reconcile(8, 123_000, 124_000, 25 - 10),
        seen(8, 124_000, &[(2, 0), (25, 0)]),
        // A refund into the previous bucket: 25 - 20 = 5 left there.
        reconcile(8, 123_000, 181_000, -20),
        seen(8, 181_000, &[(0, 2), (0, 5)]),
        // An estimate above the limit can never pass: no retry time, nothing read or charged.
        Op::AdmitCosts {
            chain: 8,
            ms: 182_000,
            costs: &[1, 101],
            admitted: false,
            refused_by: Some(1),
            retry_us: None,
            tokens_left: Some(0),
        },
        seen(8, 182_000, &[(0, 2), (0, 5)]),
        // --- chain 9: a reactive key token limit ignores its cost; the org reserves ---
        reserve(9, 0, &[1, 999, 60], 40),
        seen(9, 0, &[(1, 0), (0, 0), (60, 0)]),
        // Recording charges the reactive limit only, reconciling the reserved one only.
        Op::Record {
            chain: 9,
            ms: 1_000,
            units: 30,
        },
        reconcile(9, 0, 1_000, 30 - 60),
        seen(9, 1_000, &[(1, 0), (30, 0), (30, 0)]),
    ]
}

/// `chains` with every scope under a tenant of its own (its kind and id, so that chains sharing
/// a scope still share its state): on a Redis Cluster each scope then lies in a slot of its own
/// (as a customer's and the gateway's limits do), so that a chain is decided slot by slot, with
/// refunds. Every store must decide these exactly as it decides `chains`.
pub fn spread(chains: Vec<Chain>) -> Vec<Chain> {
    chains
        .into_iter()
        .map(|c| {
            let limits = c
                .limits()
                .iter()
                .map(|l| {
                    let tenant = format!("{}:{}", l.scope(), l.id());
                    ChainLimit::new(&tenant, l.scope(), l.id(), l.charge(), l.limit())
                        .with_shadow(l.is_shadow())
                })
                .collect();
            let slots = c
                .in_flight()
                .iter()
                .map(|s| {
                    let tenant = format!("{}:{}", s.scope(), s.id());
                    InFlightLimit::new(&tenant, s.scope(), s.id(), s.max())
                        .with_shadow(s.is_shadow())
                })
                .collect();
            Chain::new(limits).with_in_flight(slots)
        })
        .collect()
}

/// Runs every vector against `store`, which must be empty (or under a fresh prefix).
pub async fn run_vectors<S: Store>(store: &S) {
    run_vectors_on(store, chains()).await;
}

/// Runs every vector against `store` with `chains` in place of [`chains`] (the same chains,
/// laid out otherwise: [`spread`]).
pub async fn run_vectors_on<S: Store>(store: &S, chains: Vec<Chain>) {
    // Every admission goes through a refusal cache (docs/design.md §11). Each refusal it
    // answers without the store must be exactly the store's: the expected figures below are
    // the store's, and the store, asked again at the same instant, must give the same decision.
    let cached: Vec<Chain> = chains.iter().cloned().map(Chain::cache_refusals).collect();
    let mut from_cache = 0;
    for (i, op) in vectors().into_iter().enumerate() {
        match op {
            Op::Admit {
                chain,
                ms,
                admitted,
                refused_by,
                retry_us,
                remaining,
                shadow_over,
            } => {
                let remembered = cached[chain].cached_refusal(store, 1, Some(at(ms)));
                let d = cached[chain]
                    .admit_at(store, 1, at(ms))
                    .await
                    .unwrap_or_else(|e| panic!("vector {i}: {e}"));
                if let Some(r) = remembered {
                    from_cache += 1;
                    assert_eq!(d, r, "vector {i}: the cache answered");
                    let asked = chains[chain]
                        .admit_at(store, 1, at(ms))
                        .await
                        .unwrap_or_else(|e| panic!("vector {i}: {e}"));
                    assert_eq!(asked, d, "vector {i}: a cached refusal is the store's");
                }
                assert_eq!(d.admitted, admitted, "vector {i}: admitted");
                assert_eq!(d.refused_by, refused_by, "vector {i}: refused_by");
                assert_eq!(
                    d.retry_after,
                    retry_us.map(Duration::from_micros),
                    "vector {i}: retry"
                );
                let most = d.most_restrictive(Charge::Admission).map(|s| s.remaining);
                assert_eq!(most, remaining, "vector {i}: remaining");
                let over: Vec<usize> = d.shadow_over().collect();
                assert_eq!(over, shadow_over, "vector {i}: shadow limits over");
            }
            Op::Counts { chain, ms, cur } => {
                assert_eq!(
                    counts(store, &chains[chain], ms).await,
                    cur,
                    "vector {i}: counts"
                );
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
            Op::AdmitCosts {
                chain,
                ms,
                costs,
                admitted,
                refused_by,
                retry_us,
                tokens_left,
            } => {
                let d = chains[chain]
                    .admit_costs_at(store, costs, at(ms))
                    .await
                    .unwrap_or_else(|e| panic!("vector {i}: {e}"));
                assert_eq!(d.admitted, admitted, "vector {i}: admitted");
                assert_eq!(d.refused_by, refused_by, "vector {i}: refused_by");
                assert_eq!(
                    d.retry_after,
                    retry_us.map(Duration::from_micros),
                    "vector {i}: retry"
                );
                let left = d.most_restrictive(Charge::Reserved).map(|s| s.remaining);
                assert_eq!(left, tokens_left, "vector {i}: tokens left");
            }
            Op::Reconcile {
                chain,
                reserved_ms,
                ms,
                delta,
            } => chains[chain]
                .reconcile_at(store, at(reserved_ms), delta, at(ms))
                .await
                .unwrap_or_else(|e| panic!("vector {i}: {e}")),
            Op::Seen { chain, ms, counts } => {
                let seen = store
                    .admit(chains[chain].limits(), 0.into(), Some(at(ms)))
                    .await
                    .unwrap_or_else(|e| panic!("vector {i}: {e}"));
                let got: Vec<(u64, u64)> = seen.snapshots.iter().map(|s| (s.cur, s.prev)).collect();
                assert_eq!(got, counts, "vector {i}: counts");
            }
        }
    }
    assert!(from_cache > 0, "the cache answered no refusal");
}

/// Steady retriers on chains of every kind (one limit, two keys under one org limit, a token
/// limit charged after each admission, a shadow key limit) asking every 737 ms for two and a
/// half windows, one to three times an instant, through refusal caches (docs/design.md §11):
/// every refusal a cache answers is exactly the store's own at that instant, asked again (where
/// other traffic shares a limit, the store refuses too, its retry no sooner), and none is
/// answered once the store would admit.
pub async fn run_refusal_cache_sweep<S: Store>(store: &S) {
    use Charge::*;
    use ScopeKind::*;
    let l = |scope, id, charge, max| {
        ChainLimit::new("org:rc", scope, id, charge, WindowLimit::per_minute(max))
    };
    let plain = [
        Chain::new(vec![l(Key, "a", Admission, 5)]),
        Chain::new(vec![l(Key, "b", Admission, 4), l(Org, "rc", Admission, 7)]),
        Chain::new(vec![l(Key, "c", Admission, 9), l(Org, "rc", Admission, 7)]),
        Chain::new(vec![l(Key, "t", Admission, 50), l(Key, "t", Reactive, 100)]),
        Chain::new(vec![
            l(Key, "s", Admission, 2).shadow(),
            l(Org, "rs", Admission, 3),
        ]),
    ];
    // Chains 1 and 2 share their org limit: each is the other's other traffic.
    let shared = |c: usize| c == 1 || c == 2;
    let cached: Vec<Chain> = plain.iter().cloned().map(Chain::cache_refusals).collect();
    let (mut hits, mut admitted) = (0, 0);
    for step in 0..204u64 {
        let ms = step * 737;
        for (c, chain) in cached.iter().enumerate() {
            for _ in 0..=step % 3 {
                let remembered = chain.cached_refusal(store, 1, Some(at(ms)));
                let d = chain
                    .admit_at(store, 1, at(ms))
                    .await
                    .unwrap_or_else(|e| panic!("{ms} ms, chain {c}: {e}"));
                if let Some(r) = remembered {
                    hits += 1;
                    assert_eq!(d, r, "{ms} ms, chain {c}: the cache answered");
                    let asked = plain[c]
                        .admit_at(store, 1, at(ms))
                        .await
                        .unwrap_or_else(|e| panic!("{ms} ms, chain {c}: {e}"));
                    if shared(c) {
                        // Another caller charged the org since the refusal was remembered:
                        // the store refuses too, and its counts can only be higher.
                        assert!(!asked.admitted, "{ms} ms, chain {c}: the store admits");
                        assert!(asked.retry_after >= d.retry_after, "{ms} ms, chain {c}");
                    } else {
                        assert_eq!(
                            asked, d,
                            "{ms} ms, chain {c}: a cached refusal is the store's"
                        );
                    }
                } else if d.admitted {
                    admitted += 1;
                    chain
                        .record_at(store, 30, at(ms))
                        .await
                        .unwrap_or_else(|e| panic!("{ms} ms, chain {c}: {e}"));
                }
            }
        }
    }
    assert!(hits > 300, "{hits} refusals from the caches");
    assert!(admitted > 30, "{admitted} admitted");
}

/// Each limit's count in its current bucket at `ms`, read by an admission of cost 0, which
/// charges nothing.
pub async fn counts<S: Store>(store: &S, chain: &Chain, ms: u64) -> Vec<u64> {
    let seen = store.admit(chain.limits(), 0.into(), Some(at(ms))).await;
    let seen = seen.unwrap_or_else(|e| panic!("counts: {e}"));
    seen.snapshots.iter().map(|s| s.cur).collect()
}

/// Races 64 requests at one instant on the vectors' chain 5, a shadow key limit of 1 under an
/// enforced org limit of 10: exactly 10 are admitted, each charged to the shadow key too, and
/// every admitted one but the first saw the key over; the refused ones are charged nowhere.
pub async fn race_past_a_shadow_limit<S: Store + Clone + 'static>(store: S) {
    let chain = Arc::new(chains().swap_remove(5));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let (store, chain) = (store.clone(), chain.clone());
        tasks.spawn(async move { chain.admit_at(&store, 1, at(0)).await.unwrap() });
    }
    let decisions = tasks.join_all().await;
    let (admitted, refused): (Vec<_>, Vec<_>) = decisions.iter().partition(|d| d.admitted);
    assert_eq!(admitted.len(), 10);
    let over = admitted.iter().filter(|d| d.shadow_over().eq([0])).count();
    assert_eq!(over, 9, "all but the first admitted past the shadow limit");
    assert!(refused.iter().all(|d| d.refused_by == Some(1)));
    assert_eq!(counts(&store, &chain, 0).await, [10, 10]);
}

/// The value of the test server variable `var` (a URL, or a cluster's seeds), or `None` with a
/// note on stderr when it is unset: a skip, which [`redis_required`] turns into a failure.
pub fn server_from_env(var: &str, test: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(value) if !value.is_empty() => Some(value),
        _ => {
            assert!(
                !redis_required(),
                "{test}: FLOODGATE_REQUIRE_REDIS=1 but {var} is unset"
            );
            eprintln!("{test}: skipped, {var} is unset");
            None
        }
    }
}

/// Whether the Redis tests must run (CI sets this): a skip is then a failure.
pub fn redis_required() -> bool {
    std::env::var("FLOODGATE_REQUIRE_REDIS").is_ok_and(|v| v == "1")
}

/// The period counters the period vectors use: a day and a month counter of one org, and a
/// counter to saturate.
pub fn period_counters() -> Vec<PeriodCounter> {
    vec![
        PeriodCounter::new("{org:acme}:org:acme:budget:day", Period::Day),
        PeriodCounter::new("{org:acme}:org:acme:budget:month", Period::Month),
        PeriodCounter::new("{org:acme}:key:big:budget:day", Period::Day),
    ]
}

/// One operation on period counters and the totals it must give.
pub enum PeriodOp {
    /// Read counters `counters` at `ms`; expect `totals`.
    Read {
        counters: &'static [usize],
        ms: u64,
        totals: &'static [u64],
    },
    /// Add `amount` to counters `counters` at `ms`; expect their totals after it.
    Add {
        counters: &'static [usize],
        ms: u64,
        amount: u64,
        totals: &'static [u64],
    },
}

/// `T0` is 2023-11-14T22:14:00Z: midnight UTC is 6 360 s later, December 1 1 388 760 s later.
pub const MIDNIGHT_MS: u64 = 6_360_000;
/// December 1, 00:00 UTC, in ms after `T0`.
pub const DECEMBER_MS: u64 = 1_388_760_000;

/// The period counter table: reads change nothing, adds accumulate within a period, a new
/// period starts from zero (the day at midnight while the month goes on; the month on the 1st).
pub fn period_vectors() -> Vec<PeriodOp> {
    use PeriodOp::*;
    vec![
        // Never written: zero.
        Read {
            counters: &[0, 1],
            ms: 0,
            totals: &[0, 0],
        },
        Add {
            counters: &[0, 1],
            ms: 0,
            amount: 250,
            totals: &[250, 250],
        },
        Read {
            counters: &[0, 1],
            ms: 0,
            totals: &[250, 250],
        },
        Add {
            counters: &[0],
            ms: 1_000,
            amount: 100,
            totals: &[350],
        },
        // The last millisecond of the day still counts it.
        Read {
            counters: &[1, 0],
            ms: MIDNIGHT_MS - 1,
            totals: &[250, 350],
        },
        // Midnight: the day starts again, the month goes on.
        Read {
            counters: &[0, 1],
            ms: MIDNIGHT_MS,
            totals: &[0, 250],
        },
        Add {
            counters: &[0, 1],
            ms: MIDNIGHT_MS,
            amount: 5,
            totals: &[5, 255],
        },
        Read {
            counters: &[1],
            ms: DECEMBER_MS - 1,
            totals: &[255],
        },
        // December 1: the month starts again.
        Read {
            counters: &[0, 1],
            ms: DECEMBER_MS,
            totals: &[0, 0],
        },
        Add {
            counters: &[1],
            ms: DECEMBER_MS,
            amount: 1,
            totals: &[1],
        },
        // Totals saturate at 2^53.
        Add {
            counters: &[2],
            ms: 0,
            amount: u64::MAX,
            totals: &[1 << 53],
        },
        Add {
            counters: &[2],
            ms: 1,
            amount: 7,
            totals: &[1 << 53],
        },
        // Zero adds nothing but is still an add.
        Add {
            counters: &[0],
            ms: DECEMBER_MS,
            amount: 0,
            totals: &[0],
        },
    ]
}

/// Runs the period counter table against `store` (empty, or under a fresh prefix), then a
/// budget through [`Budgets`]: the same answers on every store.
pub async fn run_period_vectors<S: Store>(store: &S) {
    let all = period_counters();
    for (i, op) in period_vectors().into_iter().enumerate() {
        let (picked, ms, amount, totals) = match op {
            PeriodOp::Read {
                counters,
                ms,
                totals,
            } => (counters, ms, None, totals),
            PeriodOp::Add {
                counters,
                ms,
                amount,
                totals,
            } => (counters, ms, Some(amount), totals),
        };
        let counters: Vec<PeriodCounter> = picked.iter().map(|&c| all[c].clone()).collect();
        let seen = match amount {
            None => store.read_periods(&counters, Some(at(ms))).await,
            Some(a) => store.add_periods(&counters, a, Some(at(ms))).await,
        }
        .unwrap_or_else(|e| panic!("period vector {i}: {e}"));
        assert!(seen.enforced, "period vector {i}: enforced");
        assert_eq!(seen.now, at(ms), "period vector {i}: now");
        assert_eq!(seen.totals, totals, "period vector {i}: totals");
    }

    // A day budget of 300 for a key: allowed below the cap, refused at it until midnight.
    let budgets = Budgets::new(vec![
        Budget::new("org:acme", ScopeKind::Key, "b", Period::Day, 300),
        Budget::new("org:acme", ScopeKind::Org, "acme", Period::Month, 1_000),
    ]);
    let d = budgets.check_at(store, at(0)).await.unwrap();
    assert!(d.allowed() && d.enforced);
    assert_eq!(d.spent, [0, 0]);
    budgets.spend_at(store, 299, at(1_000)).await.unwrap();
    let d = budgets.check_at(store, at(2_000)).await.unwrap();
    assert!(d.allowed());
    assert_eq!(d.spent, [299, 299]);
    budgets.spend_at(store, 1, at(3_000)).await.unwrap();
    let d = budgets.check_at(store, at(4_000)).await.unwrap();
    assert_eq!(
        (d.exceeded_by, d.spent.as_slice()),
        (Some(0), &[300, 300][..])
    );
    assert_eq!(
        d.retry_after,
        Some(Duration::from_millis(MIDNIGHT_MS - 4_000)),
        "until midnight UTC"
    );
    // The next day the key's budget is whole again; the org's month still counts.
    let d = budgets.check_at(store, at(MIDNIGHT_MS)).await.unwrap();
    assert!(d.allowed());
    assert_eq!(d.spent, [0, 300]);
    budgets.spend_at(store, 700, at(MIDNIGHT_MS)).await.unwrap();
    let d = budgets.check_at(store, at(MIDNIGHT_MS + 1)).await.unwrap();
    // Both are spent: the key's named (the narrowest), the wait the org's (the longest).
    assert_eq!(d.exceeded_by, Some(0));
    assert_eq!(d.spent, [700, 1_000]);
    assert_eq!(
        d.retry_after,
        Some(Duration::from_millis(DECEMBER_MS - MIDNIGHT_MS - 1))
    );
}

/// A concurrency limit in org `acme`'s chain.
pub fn slots(scope: ScopeKind, id: &str, max: u64) -> InFlightLimit {
    InFlightLimit::new("org:acme", scope, id, max)
}

/// The chains the concurrency vectors use.
pub fn in_flight_chains() -> Vec<Chain> {
    use Charge::*;
    use ScopeKind::*;
    vec![
        // 0: key "c", 5 a minute and 2 at once, in org "cc", 3 at once.
        Chain::new(vec![limit(Key, "c", Admission, 5)])
            .with_in_flight(vec![slots(Key, "c", 2), slots(Org, "cc", 3)]),
        // 1: key "d", 100 a minute and 5 at once, in the same org.
        Chain::new(vec![limit(Key, "d", Admission, 100)])
            .with_in_flight(vec![slots(Key, "d", 5), slots(Org, "cc", 3)]),
        // 2: key "r", 1 a minute and 5 at once.
        Chain::new(vec![limit(Key, "r", Admission, 1)]).with_in_flight(vec![slots(Key, "r", 5)]),
        // 3: key "s", a shadow concurrency limit of 1.
        Chain::new(vec![limit(Key, "s", Admission, 100)])
            .with_in_flight(vec![slots(Key, "s", 1).shadow()]),
    ]
}

/// Each concurrency limit's running requests and whether it was over, as a decision saw them.
fn running(d: &floodgate::ChainDecision) -> Vec<(u64, bool)> {
    d.in_flight.iter().map(|s| (s.running, s.over)).collect()
}

/// The concurrency vectors: the same sequence at pinned times gives the same decisions on every
/// store. `store` must be empty (or under a fresh prefix).
pub async fn run_in_flight_vectors<S: Store>(store: &S) {
    run_in_flight_vectors_on(store, in_flight_chains()).await;
}

/// [`run_in_flight_vectors`] with `c` in place of [`in_flight_chains`] ([`spread`]).
pub async fn run_in_flight_vectors_on<S: Store>(store: &S, c: Vec<Chain>) {
    let admit = |i: usize, ms: u64| {
        let chain = &c[i];
        async move { chain.admit_at(store, 1, at(ms)).await.unwrap() }
    };
    // Two of key "c" run; the third finds the key full: refused by its concurrency limit, not a
    // rate limit, with no retry time, and charged nowhere.
    let a1 = admit(0, 0).await;
    assert!(a1.admitted && a1.lease.is_some());
    assert_eq!(running(&a1), [(1, false), (1, false)]);
    let a2 = admit(0, 10).await;
    assert_eq!(running(&a2), [(2, false), (2, false)]);
    let refused = admit(0, 20).await;
    assert!(!refused.admitted && refused.lease.is_none());
    assert_eq!((refused.refused_by, refused.retry_after), (None, None));
    assert_eq!(running(&refused), [(2, true), (2, false)]);
    let by = refused.refused_in_flight().map(|s| (s.scope, s.max));
    assert_eq!(by, Some((ScopeKind::Key, 2)));
    assert_eq!(
        counts(store, &c[0], 30).await,
        [2],
        "the refusal charged nothing"
    );
    // Key "d" takes the org's last slot; its next request finds the org full.
    let d1 = admit(1, 40).await;
    assert_eq!(running(&d1), [(1, false), (3, false)]);
    let refused = admit(1, 50).await;
    assert_eq!(running(&refused), [(1, false), (3, true)]);
    let by = refused.refused_in_flight().map(|s| s.scope);
    assert_eq!(by, Some(ScopeKind::Org));
    assert_eq!(
        refused.most_restrictive_in_flight().map(|s| s.remaining()),
        Some(0)
    );
    // A release gives both slots back at once, and a second release of it changes nothing.
    c[0].release(store, a1.lease).await.unwrap();
    c[0].release(store, a1.lease).await.unwrap();
    let a3 = admit(0, 60).await;
    assert_eq!(running(&a3), [(2, false), (3, false)]);
    assert!(!admit(1, 70).await.admitted, "the org is full again");
    for d in [&a2, &a3] {
        c[0].release(store, d.lease).await.unwrap();
    }
    let d2 = admit(1, 80).await;
    assert_eq!(running(&d2), [(2, false), (2, false)]);
    // A rate refusal takes no slot: key "r" allows one a minute.
    let r1 = admit(2, 0).await;
    assert!(r1.admitted);
    let r2 = admit(2, 100).await;
    assert_eq!(r2.refused_by, Some(0));
    assert!(r2.retry_after.is_some() && r2.refused_in_flight().is_none());
    assert_eq!(running(&r2), [(1, false)]);
    c[2].release(store, r1.lease).await.unwrap();
    // A shadow concurrency limit takes slots past its max, and reports it.
    let s1 = admit(3, 0).await;
    let s2 = admit(3, 10).await;
    assert!(s1.admitted && s2.admitted);
    assert_eq!(running(&s2), [(2, true)]);
    assert_eq!(s2.refused_in_flight(), None);
    assert_eq!(
        s2.most_restrictive_in_flight(),
        None,
        "it restricts nothing"
    );
    // The same lease admitted twice (a replayed call) holds one slot and is not counted
    // against itself.
    let chain = &c[0];
    let lease = store.lease();
    for _ in 0..2 {
        let seen = store
            .admit_holding(
                chain.limits(),
                chain.in_flight(),
                1.into(),
                lease,
                Some(at(200)),
            )
            .await
            .unwrap();
        assert!(seen.admitted);
        assert_eq!(seen.running, [0, 2]);
    }
    // Key "c" holds the one lease; the org holds it beside key "d"'s two: full.
    let next = admit(0, 210).await;
    assert_eq!(running(&next), [(1, false), (3, true)]);
    // An operator's read sees the same, and changes nothing.
    for _ in 0..2 {
        let read = store.read_running(chain.in_flight(), Some(at(220))).await;
        assert_eq!(read.unwrap(), [1, 3]);
    }
}

/// Races 64 requests for the slots of vectors' chain 0 (2 at once): exactly 2 are admitted and
/// charged, the refused ones are charged nowhere, and once both are released two more pass.
pub async fn race_for_slots<S: Store + Clone + 'static>(store: S) {
    let chain = Arc::new(in_flight_chains().swap_remove(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let (store, chain) = (store.clone(), chain.clone());
        tasks.spawn(async move { chain.admit_at(&store, 1, at(0)).await.unwrap() });
    }
    let decisions = tasks.join_all().await;
    let admitted: Vec<_> = decisions.iter().filter(|d| d.admitted).collect();
    assert_eq!(admitted.len(), 2);
    assert!(decisions.iter().filter(|d| !d.admitted).all(|d| {
        d.refused_in_flight()
            .is_some_and(|s| s.scope == ScopeKind::Key)
    }));
    assert_eq!(counts(&store, &chain, 0).await, [2]);
    for d in admitted {
        chain.release(&store, d.lease).await.unwrap();
    }
    for _ in 0..2 {
        assert!(chain.admit_at(&store, 1, at(1)).await.unwrap().admitted);
    }
}

/// An operator's read and reset on `store`, at pinned times: a read sees what admissions,
/// records and adds left, rolled to its instant, and writes nothing (a never-written window
/// stays absent, so a cleared one reads 0 after); a clear answers what it took and leaves
/// nothing; the next admission starts from empty. Then the same over more keys than one Redis
/// script takes (1 000), in one answer.
pub async fn run_state_read_and_clear<S: Store>(store: &S) {
    use floodgate::window::Snapshot;
    let key = limit(ScopeKind::Key, "st", Charge::Admission, 3);
    let tokens = limit(ScopeKind::Key, "st", Charge::Reactive, 100);
    let idle = limit(ScopeKind::Org, "idle", Charge::Admission, 9);
    let chain = Chain::new(vec![key.clone(), tokens.clone()]);
    let budget = Budget::new("org:acme", ScopeKind::Key, "st", Period::Day, 500);
    let budgets = Budgets::new(vec![budget.clone()]);
    for ms in [0, 1_000] {
        assert!(chain.admit_at(store, 1, at(ms)).await.unwrap().admitted);
    }
    chain.record_at(store, 40, at(2_000)).await.unwrap();
    budgets.spend_at(store, 120, at(2_000)).await.unwrap();
    let limits = [key.clone(), tokens.clone(), idle.clone()];
    let counters = [budget.counter().clone()];
    // 30 s in: the bucket of T0 holds them all.
    let seen = store
        .read_state(&limits, &counters, Some(at(30_000)))
        .await
        .unwrap();
    let snap = |cur, prev| Snapshot {
        bucket: (T0 + 30_000_000) / 60_000_000,
        cur,
        prev,
        elapsed: 30_000_000,
    };
    assert_eq!(seen.now, at(30_000));
    assert_eq!(seen.snapshots, [snap(2, 0), snap(40, 0), snap(0, 0)]);
    assert_eq!(seen.totals, [120]);
    // A minute later they have rolled into the previous bucket, and the read changed nothing.
    let later = store
        .read_state(&limits, &counters, Some(at(90_000)))
        .await
        .unwrap();
    assert_eq!(
        (later.snapshots[0].cur, later.snapshots[0].prev),
        (0, 2),
        "{later:?}"
    );
    // The clear answers what it took: the same as a read at that instant.
    let cleared = store
        .clear_state(&limits, &counters, Some(at(30_000)))
        .await
        .unwrap();
    assert_eq!(cleared, seen);
    let after = store
        .read_state(&limits, &counters, Some(at(30_000)))
        .await
        .unwrap();
    assert_eq!(after.snapshots, [snap(0, 0); 3]);
    assert_eq!(after.totals, [0]);
    // Three more requests pass where one would have been refused.
    for ms in [31_000, 32_000, 33_000] {
        assert!(chain.admit_at(store, 1, at(ms)).await.unwrap().admitted);
    }
    assert!(!chain.admit_at(store, 1, at(34_000)).await.unwrap().admitted);

    // More keys than one script takes: every one read, in order, at one instant.
    let many: Vec<ChainLimit> = (0..1_200)
        .map(|i| limit(ScopeKind::Key, &format!("many{i}"), Charge::Admission, 10))
        .collect();
    let last = Chain::new(vec![many[1_100].clone()]);
    assert!(last.admit_at(store, 1, at(40_000)).await.unwrap().admitted);
    let seen = store
        .read_state(&many, &counters, Some(at(41_000)))
        .await
        .unwrap();
    assert_eq!(seen.snapshots.len(), 1_200);
    let charged: Vec<usize> = (0..1_200).filter(|&i| seen.snapshots[i].cur > 0).collect();
    assert_eq!(charged, [1_100]);
    assert_eq!(seen.totals, [0]);
    assert!(seen.snapshots.iter().all(|s| s.elapsed == 41_000_000));
}

/// 20 concurrent requests, each reserving 100 tokens, against a reserved limit of 1000 tokens a
/// minute beside a request limit: exactly 10 are admitted (the reservations fill the window
/// exactly), the others charged nowhere; half of them come with a request-only chain sharing the
/// request limit, so a batch mixes groups of one cost with groups of per-limit costs.
pub async fn race_reserved_tokens<S: Store + Clone + 'static>(store: S) {
    let both = Arc::new(Chain::new(vec![
        limit(ScopeKind::Org, "race", Charge::Admission, 1000),
        limit(ScopeKind::Org, "race", Charge::Reserved, 1000),
    ]));
    let requests = Arc::new(Chain::new(vec![limit(
        ScopeKind::Org,
        "race",
        Charge::Admission,
        1000,
    )]));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..40 {
        let (store, both, requests) = (store.clone(), Arc::clone(&both), Arc::clone(&requests));
        tasks.spawn(async move {
            if i % 2 == 0 {
                let d = both.admit_costs_at(&store, &[1, 100], at(0)).await.unwrap();
                (true, d.admitted)
            } else {
                let d = requests.admit_at(&store, 1, at(0)).await.unwrap();
                (false, d.admitted)
            }
        });
    }
    let decisions = tasks.join_all().await;
    let reserved = decisions.iter().filter(|&&(r, a)| r && a).count();
    let plain = decisions.iter().filter(|&&(r, a)| !r && a).count();
    assert_eq!((reserved, plain), (10, 20));
    assert_eq!(counts(&store, &both, 1).await, [30, 1000]);
}

/// A chain with a concurrency limit reserving tokens: the admission that takes a slot charges
/// each limit its own cost, and a refusal takes nothing, slot or tokens.
pub async fn run_reserved_holding<S: Store>(store: &S) {
    let chain = Chain::new(vec![
        limit(ScopeKind::Key, "rh", Charge::Admission, 10),
        limit(ScopeKind::Key, "rh", Charge::Reserved, 100),
    ])
    .with_in_flight(vec![slots(ScopeKind::Key, "rh", 5)]);
    let first = chain.admit_costs_at(store, &[1, 60], at(0)).await.unwrap();
    assert!(first.admitted && first.lease.is_some());
    assert_eq!(counts(store, &chain, 1).await, [1, 60]);
    let refused = chain.admit_costs_at(store, &[1, 60], at(2)).await.unwrap();
    assert_eq!((refused.admitted, refused.refused_by), (false, Some(1)));
    assert!(refused.lease.is_none());
    assert_eq!(counts(store, &chain, 3).await, [1, 60]);
    assert_eq!(
        store
            .read_running(chain.in_flight(), Some(at(3)))
            .await
            .unwrap(),
        [1]
    );
    chain.release(store, first.lease).await.unwrap();
}

/// 20 concurrent reservations of 100 against a budget of 1000: exactly 10 admitted, the refused
/// ones taken back; reconciled at 30 each, the budget holds 300; a refund for a period that has
/// ended is dropped, and an amount owed to it goes into the current one.
pub async fn race_reserved_budget<S: Store + Clone + 'static>(store: S, tenant: &str) {
    let budgets = Arc::new(Budgets::new(vec![Budget::new(
        tenant,
        ScopeKind::Org,
        "race",
        Period::Day,
        1000,
    )]));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let (store, budgets) = (store.clone(), Arc::clone(&budgets));
        tasks.spawn(async move { budgets.reserve(&store, 100).await.unwrap() });
    }
    let decisions = tasks.join_all().await;
    let admitted: Vec<_> = decisions.iter().filter(|d| d.allowed()).collect();
    assert_eq!(admitted.len(), 10);
    assert!(
        decisions
            .iter()
            .filter(|d| !d.allowed())
            .all(|d| d.retry_after.is_some())
    );
    assert_eq!(budgets.check(&store).await.unwrap().spent, [1000]);
    // A reservation above the cap fits in no period: refused with no time to wait, nothing
    // added (before, it waited for the period's end, and one whose add saturated took back
    // more than it had added).
    for amount in [1001, 1 << 53, u64::MAX] {
        let d = budgets.reserve(&store, amount).await.unwrap();
        assert_eq!((d.exceeded_by, d.retry_after), (Some(0), None), "{amount}");
        assert_eq!(d.spent, [1000], "{amount}");
    }
    assert_eq!(budgets.check(&store).await.unwrap().spent, [1000]);
    // A reservation of 0 (a free model's) on the spent budget is refused, as a check is, and
    // waits for the period's end; nothing is added.
    let d = budgets.reserve(&store, 0).await.unwrap();
    assert!(!d.allowed() && d.retry_after.is_some(), "{d:?}");
    assert_eq!(d.spent, [1000]);
    // A budget with a cap of 0 refuses every reservation, 0 included, and no period's end lets
    // one through: no time to wait.
    let zero = Budgets::new(vec![Budget::new(
        tenant,
        ScopeKind::Key,
        "race-zero",
        Period::Day,
        0,
    )]);
    for amount in [0, 1] {
        let d = zero.reserve(&store, amount).await.unwrap();
        assert_eq!((d.exceeded_by, d.retry_after), (Some(0), None), "{amount}");
        let d = zero.check(&store).await.unwrap();
        assert_eq!((d.exceeded_by, d.retry_after), (Some(0), None), "{amount}");
    }
    assert_eq!(zero.check(&store).await.unwrap().spent, [0]);
    for d in &admitted {
        budgets.reconcile(&store, d.now, 30 - 100).await.unwrap();
    }
    assert_eq!(budgets.check(&store).await.unwrap().spent, [300]);
    // Reserved yesterday: a refund is dropped, an amount owed lands today.
    let yesterday = Timestamp::from_micros(Timestamp::now().as_micros() - 86_400_000_000);
    budgets.reconcile(&store, yesterday, -50).await.unwrap();
    assert_eq!(budgets.check(&store).await.unwrap().spent, [300]);
    budgets.reconcile(&store, yesterday, 5).await.unwrap();
    assert_eq!(budgets.check(&store).await.unwrap().spent, [305]);
    // Never below zero.
    budgets
        .reconcile(&store, Timestamp::now(), -1000)
        .await
        .unwrap();
    assert_eq!(budgets.check(&store).await.unwrap().spent, [0]);
}

/// A budget-checked admission (`Chain::admit_within`) gives what the budget check and then the
/// admission give, whether the store sends them as one call (Redis) or two: a request under
/// its budgets is decided by its chain, one over a budget is refused by it and charges nothing,
/// and the budget's decision names it with the wait until its period ends.
pub async fn run_admit_within<S: Store>(store: &S, tenant: &str) {
    let key = ChainLimit::new(
        tenant,
        ScopeKind::Key,
        "within",
        Charge::Admission,
        WindowLimit::per_minute(2),
    );
    let org = ChainLimit::new(
        tenant,
        ScopeKind::Org,
        "within",
        Charge::Admission,
        WindowLimit::per_minute(10),
    );
    let chain = Chain::new(vec![key, org]);
    let budgets = Budgets::new(vec![
        Budget::new(tenant, ScopeKind::Key, "within", Period::Day, 1_000),
        Budget::new(tenant, ScopeKind::Org, "within", Period::Month, 100),
    ]);
    let admit = |ms| chain.admit_within_at(store, &budgets, 1, at(ms));
    // Under both budgets: the chain decides, two requests a minute on the key.
    for ms in [0, 1] {
        let (b, c) = admit(ms).await.unwrap();
        assert!(b.enforced && b.allowed(), "at {ms} ms: {b:?}");
        assert_eq!(b.spent, [0, 0]);
        assert!(c.expect("the chain was asked").admitted, "at {ms} ms");
    }
    let (b, c) = admit(2).await.unwrap();
    assert!(b.allowed());
    let c = c.expect("the chain was asked");
    assert!(!c.admitted);
    assert_eq!(c.refused_by, Some(0), "the key's limit refuses");
    assert_eq!(c.retry_after, Some(Duration::from_millis(89_998)));
    // The org's month is spent: refused by the budget, the chain not charged.
    budgets.spend_at(store, 100, at(3)).await.unwrap();
    for ms in [4, 60_000, 60_001] {
        let (b, c) = admit(ms).await.unwrap();
        assert!(b.enforced && !b.allowed(), "at {ms} ms");
        assert_eq!(b.spent, [100, 100]);
        assert_eq!(b.exceeded_by, Some(1));
        assert_eq!(b.waits_for, Some(1));
        assert_eq!(
            b.retry_after,
            Some(Duration::from_millis(DECEMBER_MS - ms)),
            "until December, at {ms} ms"
        );
        assert!(c.is_none(), "at {ms} ms: a spent budget asks no limit");
    }
    // Nothing was charged past the two admitted requests: the next minute holds the key's whole
    // two requests' weight of the last minute still, and the org's count is 2.
    let seen = chain.admit_at(store, 0, at(60_002)).await.unwrap();
    let org = &seen.statuses[1];
    assert_eq!(
        org.remaining, 8,
        "the org's 10 less the 2 admitted, still carried"
    );
}

/// What a served request cost: `units` to `limits`, `amount` to `counters`.
pub fn spent<'a>(
    limits: &'a [ChainLimit],
    units: u64,
    counters: &'a [floodgate::PeriodCounter],
    amount: u64,
) -> floodgate::store::Spent<'a> {
    floodgate::store::Spent {
        limits,
        units,
        counters,
        amount,
    }
}

/// A served request's cost charged without a future (`AnyStore::charge_then`), 40 of them at
/// once: each lands exactly once, the token window and the day's spend count every one, the
/// request window none, and a charge of nothing lands at once. On Redis the charges ride a few
/// calls, not one each.
pub async fn run_charge_then(store: &floodgate::store::AnyStore) {
    // On the store's clock, so on keys of this run's own: a server may keep an earlier run's.
    let id = format!("ct{}", std::process::id());
    let requests = limit(ScopeKind::Key, &id, Charge::Admission, 10);
    let tokens = limit(ScopeKind::Key, &id, Charge::Reactive, 1_000_000);
    let limits = vec![requests, tokens];
    let day = floodgate::PeriodCounter::new(
        format!("{{org:acme}}:key:{id}:budget:day"),
        floodgate::Period::Day,
    );
    let counters = vec![day];
    let (landed, mut lands) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..40 {
        let landed = landed.clone();
        store.charge_then(spent(&limits, 3, &counters, 7), move |done| {
            let _ = landed.send(done);
        });
    }
    for _ in 0..40 {
        assert!(lands.recv().await.expect("every charge lands").is_ok());
    }
    let seen = store.read_state(&limits, &counters, None).await.unwrap();
    assert_eq!(seen.snapshots[0].cur + seen.snapshots[0].prev, 0);
    assert_eq!(seen.snapshots[1].cur + seen.snapshots[1].prev, 120);
    assert_eq!(seen.totals, [280]);
    // Nothing to charge: landed at once, nothing written.
    store.charge_then(spent(&limits, 0, &counters, 0), move |done| {
        let _ = landed.send(done);
    });
    assert!(lands.recv().await.expect("landed").is_ok());
    assert!(lands.recv().await.is_none(), "each charge landed once");
    let again = store.read_state(&limits, &counters, None).await.unwrap();
    assert_eq!(again.totals, [280]);
}
