//! The embedded store: atomicity under concurrency, window edges, token buckets, expiry.

mod common;

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::task::{Context, Poll, Waker};
use std::thread;
use std::time::Duration;

use common::{T0, at, limit};
use floodgate::clock::FakeClock;
use floodgate::store::MemoryStore;
use floodgate::{
    Admission, Chain, ChainLimit, Charge, Period, PeriodCounter, Rate, ScopeKind, Timestamp,
    TokenBucket, WindowLimit,
};

/// Runs a memory-store future, which is always ready at once.
fn ready<F: Future>(f: F) -> F::Output {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("memory-store futures are ready at once"),
    }
}

/// Runs `f(i)` on `n` threads released together; returns how many returned true. A thread that
/// has not finished a minute after the one before it fails the test, rather than hanging it (two
/// decisions waiting on each other's cells).
fn race(n: usize, f: impl Fn(usize) -> bool + Send + Sync + 'static) -> u64 {
    let f = Arc::new(f);
    let start = Arc::new(Barrier::new(n));
    let wins = Arc::new(AtomicU64::new(0));
    let (done, finished) = mpsc::channel();
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (f, start, wins, done) = (f.clone(), start.clone(), wins.clone(), done.clone());
            thread::spawn(move || {
                start.wait();
                if f(i) {
                    wins.fetch_add(1, Ordering::SeqCst);
                }
                let _ = done.send(());
            })
        })
        .collect();
    // The threads hold the only senders now: one that panics ends the wait at once.
    drop(done);
    for _ in 0..n {
        finished
            .recv_timeout(Duration::from_secs(60))
            .expect("every racing thread finishes: none panicked, none stuck on a lock");
    }
    for t in threads {
        t.join().expect("thread");
    }
    wins.load(Ordering::SeqCst)
}

#[test]
fn sixty_four_concurrent_requests_against_rpm_1_admit_exactly_one() {
    let store = MemoryStore::new();
    let chain = Chain::new(vec![limit(ScopeKind::Key, "one", Charge::Admission, 1)]);
    let admitted = race(64, move |_| {
        ready(chain.admit(&store, 1))
            .expect("memory store")
            .admitted
    });
    assert_eq!(admitted, 1);
}

#[test]
fn key_cap_wins_and_the_org_is_charged_only_what_the_key_admitted() {
    let store = MemoryStore::with_clock(FakeClock::new(at(0)));
    let org = limit(ScopeKind::Org, "acme", Charge::Admission, 100);
    let capped = Chain::new(vec![
        limit(ScopeKind::Key, "capped", Charge::Admission, 5),
        org.clone(),
    ]);
    let (s, c) = (store.clone(), capped.clone());
    let admitted = race(64, move |_| ready(c.admit(&s, 1)).expect("memory").admitted);
    assert_eq!(admitted, 5, "the key's cap wins");
    // The org saw exactly 5: another key of the org gets exactly the other 95.
    let other = Chain::new(vec![
        limit(ScopeKind::Key, "big", Charge::Admission, 1_000),
        org,
    ]);
    let mut more = 0;
    while ready(other.admit(&store, 1)).expect("memory").admitted {
        more += 1;
    }
    assert_eq!(more, 95);
}

#[test]
fn chains_over_many_shards_in_opposite_orders_do_not_deadlock() {
    let store = MemoryStore::new();
    let limits: Vec<_> = (0..16)
        .map(|i| {
            limit(
                ScopeKind::Team,
                &format!("t{i}"),
                Charge::Admission,
                1_000_000,
            )
        })
        .collect();
    let forward = Chain::new(limits.clone());
    let backward = Chain::new(limits.into_iter().rev().collect());
    let admitted = race(8, move |i| {
        let chain = if i % 2 == 0 { &forward } else { &backward };
        (0..2_000).all(|_| ready(chain.admit(&store, 1)).expect("memory").admitted)
    });
    assert_eq!(admitted, 8);
}

#[test]
fn short_chains_in_any_order_lock_alike_and_count_every_admission() {
    // A short chain takes the step with its lists on the stack, which keeps the chain's order
    // when its scopes come ranked narrowest first: chains in that order, the reverse one, and
    // with two limits of one rank race here over the same cells.
    let store = MemoryStore::new();
    let limits: Vec<_> = [
        (ScopeKind::Key, "k"),
        (ScopeKind::Team, "t1"),
        (ScopeKind::Team, "t2"),
        (ScopeKind::Org, "o"),
        (ScopeKind::Gateway, "g"),
    ]
    .into_iter()
    .map(|(scope, id)| limit(scope, id, Charge::Admission, 1_000_000))
    .collect();
    let chains = Arc::new([
        Chain::new(limits[..2].iter().chain(&limits[3..]).cloned().collect()),
        Chain::new(limits.iter().rev().cloned().collect()),
        Chain::new(limits[1..].to_vec()),
        Chain::new(vec![
            limits[2].clone(),
            limits[0].clone(),
            limits[1].clone(),
        ]),
    ]);
    let racing = Arc::clone(&chains);
    let s = store.clone();
    let admitted = race(8, move |i| {
        let chain = &racing[i % 4];
        (0..2_000).all(|_| {
            ready(chain.admit_at(&s, 1, at(0)))
                .expect("memory")
                .admitted
        })
    });
    assert_eq!(admitted, 8);
    // Each cell counted once for each admission of each chain it is in (two threads a chain).
    let read = store.read_state_sync(&limits, &[], Some(at(0)));
    let counts: Vec<u64> = read.snapshots.iter().map(|s| s.cur).collect();
    assert_eq!(counts, [12_000, 16_000, 12_000, 12_000, 12_000]);
}

#[test]
fn chains_built_per_request_or_shared_between_stores_count_in_each_store() {
    // A short chain whose limits do not remember their cells in the store deciding (built for
    // one request, or remembering another store's) looks them up first: each store keeps its
    // own counts, and a chain built anew each time counts into the same windows.
    let limits = || {
        vec![
            limit(ScopeKind::Key, "k", Charge::Admission, 100),
            limit(ScopeKind::Org, "o", Charge::Admission, 100),
        ]
    };
    let (first, second) = (MemoryStore::new(), MemoryStore::new());
    let shared = Chain::new(limits());
    for _ in 0..3 {
        assert!(
            ready(shared.admit_at(&first, 1, at(0)))
                .expect("memory")
                .admitted
        );
    }
    for _ in 0..5 {
        assert!(
            ready(shared.admit_at(&second, 2, at(0)))
                .expect("memory")
                .admitted
        );
        let fresh = Chain::new(limits());
        assert!(
            ready(fresh.admit_at(&second, 1, at(0)))
                .expect("memory")
                .admitted
        );
    }
    let counts = |store: &MemoryStore| -> Vec<u64> {
        let read = store.read_state_sync(&limits(), &[], Some(at(0)));
        read.snapshots.iter().map(|s| s.cur).collect()
    };
    assert_eq!(counts(&first), [3, 3]);
    assert_eq!(counts(&second), [15, 15]);
}

#[test]
fn a_limit_built_apart_shares_the_window_of_its_key_as_the_table_grows() {
    // A window is found by its limit's key text, whichever limit wrote it: the same limit
    // (known by the text's address), or one built apart with the same key (known by the text).
    // One decision that writes windows it found and inserts new ones, enough to grow the
    // tables, charges each once.
    let key = |i| {
        let limit = WindowLimit::per_minute(10);
        ChainLimit::new(
            "org:a",
            ScopeKind::Key,
            &format!("k{i}"),
            Charge::Admission,
            limit,
        )
    };
    let store = MemoryStore::new();
    let first: Vec<ChainLimit> = (0..2_000).map(key).collect();
    assert!(store.admit_sync(&first, 3.into(), Some(at(0))).admitted);
    let again: Vec<ChainLimit> = (0..6_000).map(key).collect();
    let seen = store.admit_sync(&again, 2.into(), Some(at(0)));
    assert!(seen.admitted);
    assert!(seen.snapshots[..2_000].iter().all(|s| s.cur == 3));
    assert!(seen.snapshots[2_000..].iter().all(|s| s.cur == 0));
    let read = store.read_state_sync(&again, &[], Some(at(0)));
    assert!(read.snapshots[..2_000].iter().all(|s| s.cur == 5));
    assert!(read.snapshots[2_000..].iter().all(|s| s.cur == 2));
    assert_eq!(store.read_state_sync(&first, &[], Some(at(0))), {
        let mut mine = read.clone();
        mine.snapshots.truncate(2_000);
        mine
    });
}

#[test]
fn previous_bucket_counts_in_full_on_the_boundary_and_half_at_mid_window() {
    let store = MemoryStore::new();
    let chain = Chain::new(vec![limit(ScopeKind::Key, "edge", Charge::Admission, 10)]);
    let admit = |ms| {
        ready(chain.admit_at(&store, 1, at(ms)))
            .expect("memory")
            .admitted
    };
    // N just before the edge...
    assert_eq!((0..20).filter(|_| admit(59_900)).count(), 10);
    // ...and nothing just after it: a fixed window would let N more through here.
    assert_eq!((0..20).filter(|_| admit(60_000)).count(), 0);
    assert_eq!((0..20).filter(|_| admit(60_100)).count(), 0);
    // Half way through, the previous bucket weighs half: 5 fit.
    assert_eq!((0..20).filter(|_| admit(90_000)).count(), 5);
}

#[test]
fn a_full_token_window_refuses_and_charges_no_request_slot() {
    let store = MemoryStore::new();
    let chain = Chain::new(vec![
        limit(ScopeKind::Key, "tok", Charge::Admission, 3),
        limit(ScopeKind::Key, "tok", Charge::Reactive, 100),
    ]);
    let first = ready(chain.admit_at(&store, 1, at(0))).expect("memory");
    assert!(first.admitted);
    ready(chain.record_at(&store, 100, at(1_000))).expect("memory");
    for i in 0..10 {
        let d = ready(chain.admit_at(&store, 1, at(2_000 + i))).expect("memory");
        assert!(!d.admitted);
        assert_eq!(d.refused_by, Some(1), "the token limit refuses");
        assert_eq!(d.statuses[0].remaining, 2, "no request slot was taken");
    }
    // Once the tokens drain, the request limit still has its two slots this window.
    let later = ready(chain.admit_at(&store, 1, at(60_000 + 59_999))).expect("memory");
    assert!(later.admitted);
}

const LOGIN: TokenBucket<str> = TokenBucket::new("login", 20, Rate::new(1, Duration::from_secs(3)));

#[test]
fn token_bucket_admits_its_capacity_then_waits_for_refill() {
    let clock = FakeClock::new(at(0));
    let store = MemoryStore::with_clock(clock.clone());
    for i in 0..20 {
        let got = ready(LOGIN.acquire(&store, "alice", 1)).expect("memory");
        assert_eq!(got, Admission::Allowed { remaining: 19 - i });
    }
    assert_eq!(
        ready(LOGIN.acquire(&store, "alice", 1)).expect("memory"),
        Admission::Denied {
            retry_after: Some(Duration::from_secs(3))
        }
    );
    // After 60 s idle the bucket is full again and its state is gone.
    clock.advance(Duration::from_secs(60));
    store.sweep();
    assert!(store.is_empty(), "a full bucket leaves nothing behind");
    assert_eq!(
        ready(LOGIN.acquire(&store, "alice", 20)).expect("memory"),
        Admission::Allowed { remaining: 0 }
    );
}

#[test]
fn token_bucket_edges() {
    let store = MemoryStore::new();
    assert_eq!(
        ready(LOGIN.acquire(&store, "bob", 21)).expect("memory"),
        Admission::Denied { retry_after: None },
        "cost above capacity can never succeed"
    );
    assert!(store.is_empty(), "an impossible request touches nothing");
    const EMPTY: TokenBucket<u64> = TokenBucket::new("empty", 0, Rate::per_second(1));
    assert!(
        ready(EMPTY.acquire(&store, &7, 0))
            .expect("memory")
            .is_allowed()
    );
    assert_eq!(
        ready(EMPTY.acquire(&store, &7, 1)).expect("memory"),
        Admission::Denied { retry_after: None }
    );
    assert!(
        !ready(LOGIN.reset(&store, "carol")).expect("memory"),
        "never used"
    );
    ready(LOGIN.acquire(&store, "carol", 1)).expect("memory");
    assert!(ready(LOGIN.reset(&store, "carol")).expect("memory"), "used");
    assert_eq!(
        ready(LOGIN.acquire(&store, "carol", 1)).expect("memory"),
        Admission::Allowed { remaining: 19 },
        "reset refills"
    );
}

#[test]
fn idle_windows_expire_and_memory_stays_bounded() {
    let clock = FakeClock::new(at(0));
    let store = MemoryStore::with_clock(clock.clone());
    let per_second = WindowLimit::per_second(10);
    let mut peak = 0;
    for second in 0..10u64 {
        for n in 0..50_000u64 {
            let name = format!("user-{second}-{n}");
            let chain = Chain::new(vec![floodgate::ChainLimit::new(
                "t",
                ScopeKind::Customer,
                &name,
                Charge::Admission,
                per_second,
            )]);
            assert!(ready(chain.admit(&store, 1)).expect("memory").admitted);
        }
        peak = peak.max(store.len());
        clock.advance(Duration::from_secs(1));
    }
    // 500,000 names went through; a window lives 2 s, so about 100,000 are live at once. The
    // self-sweeping shards keep at most about twice the live state.
    assert!(peak < 250_000, "peak {peak} entries");
    clock.advance(Duration::from_secs(2));
    store.sweep();
    assert!(store.is_empty());
}

#[test]
fn the_sweeper_thread_stops_with_its_guard() {
    let clock = FakeClock::new(Timestamp::from_micros(T0));
    let store = MemoryStore::with_clock(clock.clone());
    let chain = Chain::new(vec![limit(ScopeKind::Key, "s", Charge::Admission, 1)]);
    assert!(ready(chain.admit(&store, 1)).expect("memory").admitted);
    // A live limit keeps its window's cell (see below); this one is gone.
    drop(chain);
    let guard = store.spawn_sweeper(Duration::from_millis(5));
    clock.advance(Duration::from_secs(120));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !store.is_empty() && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    assert!(store.is_empty(), "the sweeper removed the expired window");
    drop(guard);
}

#[test]
fn a_window_a_live_limit_remembers_is_kept_empty_and_swept_once_the_limit_is_gone() {
    let clock = FakeClock::new(at(0));
    let store = MemoryStore::with_clock(clock.clone());
    let chain = Chain::new(vec![limit(ScopeKind::Key, "kept", Charge::Admission, 1)]);
    assert!(ready(chain.admit(&store, 1)).expect("memory").admitted);
    assert!(!ready(chain.admit(&store, 1)).expect("memory").admitted);
    // Expired: the limit still holds the cell, which reads as empty.
    clock.advance(Duration::from_secs(120));
    store.sweep();
    assert_eq!(store.len(), 1, "the cell the chain remembers stays");
    // A limit with the same key built apart finds the same cell, not a second one.
    let apart = Chain::new(vec![limit(ScopeKind::Key, "kept", Charge::Admission, 1)]);
    assert!(ready(apart.admit(&store, 1)).expect("memory").admitted);
    assert!(!ready(chain.admit(&store, 1)).expect("memory").admitted);
    assert_eq!(store.len(), 1);
    clock.advance(Duration::from_secs(120));
    drop((chain, apart));
    store.sweep();
    assert!(store.is_empty(), "no limit remembers it: swept");
}

#[test]
fn a_decision_happens_when_awaited_not_when_asked_for() {
    let store = MemoryStore::new();
    let chain = Chain::new(vec![limit(ScopeKind::Key, "lazy", Charge::Admission, 1)]);
    drop(chain.admit(&store, 1));
    drop(LOGIN.acquire(&store, "lazy", 20));
    drop(LOGIN.reset(&store, "lazy"));
    assert!(store.is_empty(), "futures dropped unpolled changed nothing");
    assert!(ready(chain.admit(&store, 1)).expect("memory").admitted);
}

#[test]
fn a_call_pinned_in_the_future_never_sweeps_state_live_now() {
    let clock = FakeClock::new(at(0));
    let store = MemoryStore::with_clock(clock);
    let live = limit(ScopeKind::Key, "live", Charge::Admission, 5);
    assert!(
        store
            .admit_sync(std::slice::from_ref(&live), 1.into(), None)
            .admitted
    );
    // Enough new keys, a day ahead, for every shard to pass its sweep threshold (1 024 entries;
    // the store has up to 8 shards per CPU, in a power of two, at most 1 024).
    let cores = thread::available_parallelism().map_or(4, |n| n.get());
    let shards = (cores * 8).next_power_of_two().clamp(8, 1024);
    let later = at(86_400_000);
    for i in 0..shards * 2048 {
        let l = limit(ScopeKind::Key, &format!("later-{i}"), Charge::Admission, 5);
        store.admit_sync(std::slice::from_ref(&l), 1.into(), Some(later));
    }
    // Now, the live key still holds its request: 4 of 5 left.
    let d = store.admit_sync(std::slice::from_ref(&live), 1.into(), None);
    assert!(d.admitted);
    assert_eq!(d.snapshots[0].cur, 1, "the first request was kept");
}

#[test]
fn period_counters_expire_a_day_after_their_period_ends() {
    // At T0 (2023-11-14T22:14:00Z) the day ends 6 360 s later; the state lives a day more.
    let store = MemoryStore::with_clock(FakeClock::new(at(0)));
    let day = [PeriodCounter::new("{org:x}:key:e:budget:day", Period::Day)];
    let seen = store.add_periods_sync(&day, 3, Some(at(0)));
    assert_eq!(seen.totals, [3]);
    let gone = common::MIDNIGHT_MS + 86_400_000;
    store.sweep_at(at(gone - 1));
    assert_eq!(store.len(), 1);
    store.sweep_at(at(gone));
    assert!(store.is_empty());
}

#[test]
fn a_refusal_on_the_stores_clock_is_remembered_until_forgotten() {
    // One request a day: the second is refused, and its refusal is then answered from the
    // cache at the store's clock (docs/design.md §11).
    let chain = Chain::new(vec![ChainLimit::new(
        "org:rc",
        ScopeKind::Key,
        "clock",
        Charge::Admission,
        WindowLimit::new(1, Duration::from_secs(86_400)),
    )])
    .cache_refusals();
    let store = MemoryStore::new();
    assert!(ready(chain.admit(&store, 1)).unwrap().admitted);
    let refused = ready(chain.admit(&store, 1)).unwrap();
    assert!(!refused.admitted);
    let cached = chain.cached_refusal(&store, 1, None).expect("remembered");
    assert!(cached.now >= refused.now);
    assert!(cached.retry_after <= refused.retry_after);
    assert_eq!(cached.refused_by, refused.refused_by);
    // An admission of cost 0 is a read: the store answers it, never the cache.
    assert!(chain.cached_refusal(&store, 0, None).is_none());
    // A pinned instant before the refusal is not answered: the counts then may have been lower.
    assert!(
        chain
            .cached_refusal(&store, 1, Some(Timestamp::ZERO))
            .is_none()
    );
    // Forgotten (after a reset), the store is asked again.
    chain.forget_refusals();
    assert!(chain.cached_refusal(&store, 1, None).is_none());
    // A chain without a cache never answers from one.
    let plain = Chain::new(chain.limits().to_vec());
    assert!(ready(plain.admit(&store, 1)).unwrap().refused_by.is_some());
    assert!(plain.cached_refusal(&store, 1, None).is_none());
}

#[test]
fn a_chain_with_concurrency_limits_is_not_answered_from_the_cache() {
    // One request a minute, two at a time. A refusal reports the slots in use, which a request
    // ending frees at any moment: a remembered one would repeat a stale count in the
    // `x-floodgate-in-flight-*` headers (docs/design.md §11). So the store answers every time.
    let chain = Chain::new(vec![ChainLimit::new(
        "org:if",
        ScopeKind::Key,
        "if",
        Charge::Admission,
        WindowLimit::per_minute(1),
    )])
    .with_in_flight(vec![floodgate::InFlightLimit::new(
        "org:if",
        ScopeKind::Key,
        "if",
        2,
    )])
    .cache_refusals();
    let store = MemoryStore::new();
    let t = at(1_000);
    let held = ready(chain.admit_at(&store, 1, t)).unwrap();
    assert!(held.admitted);
    let refused = ready(chain.admit_at(&store, 1, t)).unwrap();
    assert_eq!(refused.refused_by, Some(0));
    assert_eq!(refused.in_flight[0].remaining(), 1, "one slot held");
    assert!(chain.cached_refusal(&store, 1, Some(t)).is_none());
    // The held request ends: the store's next refusal reports both slots free.
    ready(chain.release(&store, held.lease)).unwrap();
    let again = ready(chain.admit_at(&store, 1, t)).unwrap();
    assert_eq!(again.refused_by, Some(0));
    assert_eq!(again.in_flight[0].remaining(), 2);
}

#[test]
fn a_refund_forgets_the_refusal_it_may_have_made_wrong() {
    // A reserved token limit of 100 under a request limit: 80 reserved, the next 80 refused
    // and remembered; the first's usage of 20 refunds 60, so the same request now passes, and
    // the cache must not refuse it (docs/design.md §11, §12).
    let chain = Chain::new(vec![
        ChainLimit::new(
            "org:rf",
            ScopeKind::Key,
            "rf",
            Charge::Admission,
            WindowLimit::per_minute(10),
        ),
        ChainLimit::new(
            "org:rf",
            ScopeKind::Key,
            "rf",
            Charge::Reserved,
            WindowLimit::per_minute(100),
        ),
    ])
    .cache_refusals();
    let store = MemoryStore::new();
    let t = at(1_000);
    let first = ready(chain.admit_costs_at(&store, &[1, 80], t)).unwrap();
    assert!(first.admitted);
    assert!(
        !ready(chain.admit_costs_at(&store, &[1, 80], t))
            .unwrap()
            .admitted
    );
    assert!(
        chain
            .cached_refusal(&store, floodgate::chain::Costs::PerLimit(&[1, 80]), Some(t))
            .is_some()
    );
    ready(chain.reconcile_at(&store, first.now, -60, t)).unwrap();
    assert!(
        chain
            .cached_refusal(&store, floodgate::chain::Costs::PerLimit(&[1, 80]), Some(t))
            .is_none()
    );
    assert!(
        ready(chain.admit_costs_at(&store, &[1, 80], t))
            .unwrap()
            .admitted
    );
}

#[test]
fn a_refund_by_another_chain_sharing_the_limit_voids_a_cached_refusal() {
    // Two keys of one org, the org's token limit of 100 reserving: alice reserves 80, bob's 80
    // is refused and remembered. Alice's usage of 20 refunds 60 through her own chain; bob's
    // cache must not refuse his next request, which the store now admits (docs/design.md §11).
    let org = || {
        ChainLimit::new(
            "org:shared",
            ScopeKind::Org,
            "shared",
            Charge::Reserved,
            WindowLimit::per_minute(100),
        )
    };
    let key = |id: &str| {
        ChainLimit::new(
            &format!("key:{id}"),
            ScopeKind::Key,
            id,
            Charge::Admission,
            WindowLimit::per_minute(10),
        )
    };
    let alice = Chain::new(vec![key("alice"), org()]).cache_refusals();
    let bob = Chain::new(vec![key("bob"), org()]).cache_refusals();
    let store = MemoryStore::new();
    let t = at(1_000);
    let costs = floodgate::chain::Costs::PerLimit(&[1, 80]);
    let first = ready(alice.admit_costs_at(&store, &[1, 80], t)).unwrap();
    assert!(first.admitted);
    assert!(
        !ready(bob.admit_costs_at(&store, &[1, 80], t))
            .unwrap()
            .admitted
    );
    assert!(bob.cached_refusal(&store, costs, Some(t)).is_some());
    ready(alice.reconcile_at(&store, first.now, -60, t)).unwrap();
    assert!(
        bob.cached_refusal(&store, costs, Some(t)).is_none(),
        "a refund through another chain voids the refusal"
    );
    assert!(
        ready(bob.admit_costs_at(&store, &[1, 80], t))
            .unwrap()
            .admitted
    );
    // A reset (clear_state) voids one too.
    assert!(
        !ready(bob.admit_costs_at(&store, &[1, 80], t))
            .unwrap()
            .admitted
    );
    assert!(bob.cached_refusal(&store, costs, Some(t)).is_some());
    store.clear_state_sync(alice.limits(), &[], Some(t));
    assert!(bob.cached_refusal(&store, costs, Some(t)).is_none());
    assert!(
        ready(bob.admit_costs_at(&store, &[1, 80], t))
            .unwrap()
            .admitted
    );
}

#[test]
fn a_chain_used_on_two_stores_answers_each_with_its_own_refusals() {
    let chain = Chain::new(vec![ChainLimit::new(
        "t",
        ScopeKind::Key,
        "k",
        Charge::Admission,
        WindowLimit::per_minute(1),
    )])
    .cache_refusals();
    let (a, b) = (MemoryStore::new(), MemoryStore::new());
    let t = at(1_000);
    assert!(ready(chain.admit_at(&a, 1, t)).unwrap().admitted);
    assert!(!ready(chain.admit_at(&a, 1, t)).unwrap().admitted);
    assert!(chain.cached_refusal(&a, 1u64, Some(t)).is_some());
    // Both stores have lowered nothing: only their identities tell them apart.
    assert!(chain.cached_refusal(&b, 1u64, Some(t)).is_none());
    assert!(ready(chain.admit_at(&b, 1, t)).unwrap().admitted);
}

#[test]
fn a_reservation_charged_at_instants_of_its_own_is_reconciled_into_each_ones_bucket() {
    // A chain decided slot by slot (a Redis Cluster) charges each slot at its step's instant:
    // here the org's at 59.9 s, the gateway's at 60.1 s, across a bucket boundary of their
    // 60 s windows. The refund goes into each one's own bucket: the gateway's into the current
    // one, where its reservation is, not the previous one, the first step's.
    let reserved = |tenant: &str, scope: ScopeKind| {
        ChainLimit::new(
            tenant,
            scope,
            tenant,
            Charge::Reserved,
            WindowLimit::per_minute(100),
        )
    };
    let org = Chain::new(vec![reserved("org:acme", ScopeKind::Org)]);
    let gateway = Chain::new(vec![reserved("gateway", ScopeKind::Gateway)]);
    let both = Chain::new(vec![
        reserved("org:acme", ScopeKind::Org),
        reserved("gateway", ScopeKind::Gateway),
    ]);
    let clock = FakeClock::new(at(0));
    let store = MemoryStore::with_clock(clock.clone());
    let (t0, t1) = (at(59_900), at(60_100));
    assert!(
        ready(org.admit_costs_at(&store, &[80], t0))
            .unwrap()
            .admitted
    );
    assert!(
        ready(gateway.admit_costs_at(&store, &[80], t1))
            .unwrap()
            .admitted
    );
    clock.set(at(60_200));
    ready(both.reconcile_charged(&store, t0, &[t0, t1], 20 - 80)).unwrap();
    let seen = store.read_state_sync(both.limits(), &[], Some(at(60_200)));
    let (o, g) = (seen.snapshots[0], seen.snapshots[1]);
    assert_eq!((o.prev, o.cur), (20, 0), "the org's, in the bucket before");
    assert_eq!(
        (g.prev, g.cur),
        (0, 20),
        "the gateway's, in the current bucket"
    );
    // Without instants of their own, one instant for all: the decision's `now`.
    ready(both.reconcile_charged(&store, at(60_150), &[], -10)).unwrap();
    let seen = store.read_state_sync(both.limits(), &[], Some(at(60_200)));
    assert_eq!((seen.snapshots[0].cur, seen.snapshots[1].cur), (0, 10));
}

/// On the memory store the cache decides at the store's own clock, whichever clock that is: a
/// test's clock stepped past the retry time is admitted by the cache as by the store (before, the
/// cache carried the refusal forward by real time, and refused for the retry time in seconds of
/// the wall). It still refuses, with the store's statuses, while the store would.
#[test]
fn the_refusal_cache_decides_on_the_memory_stores_clock() {
    let clock = FakeClock::new(at(0));
    let store = MemoryStore::with_clock(clock.clone());
    let one = || limit(ScopeKind::Key, "clocked", Charge::Admission, 1);
    let cached = Chain::new(vec![one()]).cache_refusals();
    let plain = Chain::new(vec![one()]);
    assert!(ready(cached.admit(&store, 1)).unwrap().admitted);
    let refused = ready(cached.admit(&store, 1)).unwrap();
    let wait = refused.retry_after.expect("a wait");
    clock.advance(wait / 2);
    let from_cache = cached
        .cached_refusal(&store, 1, None)
        .expect("still refused");
    let from_store = ready(plain.admit_costs(&store, &[0])).unwrap();
    assert_eq!(from_cache.now, from_store.now);
    assert_eq!(from_cache.retry_after, Some(wait - wait / 2));
    clock.advance(wait - wait / 2);
    assert!(cached.cached_refusal(&store, 1, None).is_none());
    assert!(ready(cached.admit(&store, 1)).unwrap().admitted);
}
