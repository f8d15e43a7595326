//! The embedded store: the same decisions as Redis, under its own locks, in one process.

use std::collections::HashMap;
use std::future::{Future, ready};
use std::hash::BuildHasher;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use foldhash::fast::RandomState;

use super::{BucketObservation, Observation, Store};
use crate::Error;
use crate::bucket::{BucketLimit, BucketState};
use crate::chain::{ChainLimit, first_refusal};
use crate::clock::{Clock, SystemClock, Timestamp};
use crate::window::{Charge, Snapshot, WindowState};

/// Shards of the key space; a power of two. Enough that two cores rarely meet on one lock.
const SHARDS: usize = 64;
/// A shard is swept of expired state when it grows past twice its size after the last sweep
/// (and past this floor), which bounds memory at about twice the live state at O(1) amortised
/// cost per insert.
const MIN_SWEEP: usize = 1024;

/// The embedded in-memory store: thread-safe, cheap to clone (clones share state).
///
/// State is split over 64 shards, each a `HashMap` behind a `std::sync::Mutex`. A chain whose
/// limits live in several shards locks them all in ascending shard order (so two chains can
/// never deadlock), reads, decides and writes, then unlocks: the decision is atomic, with no
/// torn reads. The locks are std ones because they are never held across an `.await`: every
/// critical section is a few hash lookups and arithmetic.
///
/// Idle state is removed once it can no longer matter (a window `2W` after its last write, a
/// token bucket once full again): lookups ignore expired entries, and a shard sweeps itself as it
/// grows, so memory stays bounded under millions of distinct names. [`spawn_sweeper`]
/// (MemoryStore::spawn_sweeper) adds a periodic sweep for long-lived processes.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
}

#[derive(Debug)]
struct Shard {
    map: HashMap<Box<str>, Entry, RandomState>,
    sweep_at_len: usize,
}

#[derive(Clone, Copy, Debug)]
enum Entry {
    Window {
        state: WindowState,
        expires: Timestamp,
    },
    Bucket {
        state: BucketState,
        expires: Timestamp,
    },
}

impl Entry {
    fn expires(&self) -> Timestamp {
        match self {
            Entry::Window { expires, .. } | Entry::Bucket { expires, .. } => *expires,
        }
    }
}

impl Shard {
    fn window(&self, key: &str, now: Timestamp) -> Option<WindowState> {
        match self.map.get(key) {
            Some(Entry::Window { state, expires }) if *expires > now => Some(*state),
            _ => None,
        }
    }

    fn bucket(&self, key: &str, now: Timestamp) -> Option<BucketState> {
        match self.map.get(key) {
            Some(Entry::Bucket { state, expires }) if *expires > now => Some(*state),
            _ => None,
        }
    }

    fn put(&mut self, key: &str, entry: Entry, now: Timestamp) {
        if let Some(slot) = self.map.get_mut(key) {
            *slot = entry;
            return;
        }
        if self.map.len() >= self.sweep_at_len {
            self.sweep(now);
        }
        self.map.insert(key.into(), entry);
    }

    fn sweep(&mut self, now: Timestamp) {
        self.map.retain(|_, e| e.expires() > now);
        self.sweep_at_len = (self.map.len() * 2).max(MIN_SWEEP);
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }

    /// An empty store reading `clock` when a call does not pin the time.
    pub fn with_clock(clock: impl Clock) -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    map: HashMap::with_hasher(RandomState::default()),
                    sweep_at_len: MIN_SWEEP,
                })
            })
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                hasher: RandomState::default(),
                clock: Arc::new(clock),
            }),
        }
    }

    /// The store's clock reading.
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// How many entries the store holds, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        (0..SHARDS).map(|i| self.lock(i).map.len()).sum()
    }

    /// Whether the store holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every entry expired at the store clock's now.
    pub fn sweep(&self) {
        self.sweep_at(self.now());
    }

    /// Removes every entry expired at `now`.
    pub fn sweep_at(&self, now: Timestamp) {
        for i in 0..SHARDS {
            self.lock(i).sweep(now);
        }
    }

    /// Sweeps expired state every `interval` on a background thread until the guard is dropped.
    pub fn spawn_sweeper(&self, interval: Duration) -> SweeperGuard {
        let (stop, stopped) = mpsc::channel::<()>();
        let store = self.clone();
        let thread = thread::Builder::new()
            .name("floodgate-sweeper".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    store.sweep();
                }
            })
            .ok();
        SweeperGuard {
            stop: Some(stop),
            thread,
        }
    }

    fn shard_of(&self, key: &str) -> usize {
        // High bits: the shard's HashMap uses the low ones of its own hash.
        (self.inner.hasher.hash_one(key) >> 58) as usize % SHARDS
    }

    fn lock(&self, shard: usize) -> MutexGuard<'_, Shard> {
        // A panic cannot leave a shard half-written (each write is one assignment), so a
        // poisoned lock's state is still sound.
        self.inner.shards[shard]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// [`Store::admit`], without the future.
    pub fn admit_sync(
        &self,
        limits: &[ChainLimit],
        cost: u64,
        now: Option<Timestamp>,
    ) -> Observation {
        let now = now.unwrap_or_else(|| self.now());
        let shard_ids: Vec<usize> = limits.iter().map(|l| self.shard_of(l.key())).collect();
        let mut order = shard_ids.clone();
        order.sort_unstable();
        order.dedup();
        // Ascending order: two chains sharing shards take them in the same order, so they
        // cannot deadlock.
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.lock(i))).collect();
        let snapshots: Vec<Snapshot> = limits
            .iter()
            .zip(&shard_ids)
            .map(|(l, &s)| {
                let state = locked(&mut guards, s).window(l.key(), now);
                Snapshot::at(state, now, l.limit())
            })
            .collect();
        let admitted = first_refusal(limits, &snapshots, cost).is_none();
        if admitted {
            for ((l, s), &shard) in limits.iter().zip(&snapshots).zip(&shard_ids) {
                if l.charge() == Charge::Admission {
                    let entry = Entry::Window {
                        state: s.charged(cost),
                        expires: now.saturating_add(l.limit().ttl()),
                    };
                    locked(&mut guards, shard).put(l.key(), entry, now);
                }
            }
        }
        Observation {
            now,
            admitted,
            enforced: true,
            snapshots,
        }
    }

    /// [`Store::record`], without the future.
    pub fn record_sync(&self, limits: &[ChainLimit], units: u64, now: Option<Timestamp>) {
        let now = now.unwrap_or_else(|| self.now());
        // Each limit's write is atomic on its own; recording has no decision to keep whole.
        for l in limits.iter().filter(|l| l.charge() == Charge::Reactive) {
            let mut shard = self.lock(self.shard_of(l.key()));
            let snapshot = Snapshot::at(shard.window(l.key(), now), now, l.limit());
            let entry = Entry::Window {
                state: snapshot.charged(units),
                expires: now.saturating_add(l.limit().ttl()),
            };
            shard.put(l.key(), entry, now);
        }
    }

    /// [`Store::acquire`], without the future.
    pub fn acquire_sync(
        &self,
        key: &str,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> BucketObservation {
        let now = now.unwrap_or_else(|| self.now());
        let mut shard = self.lock(self.shard_of(key));
        let tokens = limit.tokens_at(shard.bucket(key, now), now);
        let (allowed, tokens) = limit.take(tokens, cost);
        let ttl = limit.ttl_micros(tokens);
        if ttl == 0 {
            // Full: a missing bucket reads as full, so nothing needs keeping.
            shard.map.remove(key);
        } else {
            let entry = Entry::Bucket {
                state: BucketState { tokens, ts: now },
                expires: Timestamp::from_micros(now.as_micros().saturating_add(ttl)),
            };
            shard.put(key, entry, now);
        }
        BucketObservation {
            now,
            allowed,
            tokens,
            enforced: true,
        }
    }

    /// [`Store::reset`], without the future.
    pub fn reset_sync(&self, key: &str, limit: BucketLimit, now: Option<Timestamp>) -> bool {
        let now = now.unwrap_or_else(|| self.now());
        let mut shard = self.lock(self.shard_of(key));
        let used = shard
            .bucket(key, now)
            .is_some_and(|s| limit.tokens_at(Some(s), now) < limit.capacity as f64);
        shard.map.remove(key);
        used
    }
}

/// The locked shard `shard` among `guards` (which hold every shard a chain touches).
fn locked<'a>(guards: &'a mut [(usize, MutexGuard<'_, Shard>)], shard: usize) -> &'a mut Shard {
    let at = guards.iter().position(|(i, _)| *i == shard).unwrap_or(0);
    &mut guards[at].1
}

impl Store for MemoryStore {
    fn admit(
        &self,
        limits: &[ChainLimit],
        cost: u64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<Observation, Error>> + Send {
        ready(Ok(self.admit_sync(limits, cost, now)))
    }

    fn record(
        &self,
        limits: &[ChainLimit],
        units: u64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.record_sync(limits, units, now);
        ready(Ok(()))
    }

    fn acquire(
        &self,
        key: &str,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<BucketObservation, Error>> + Send {
        ready(Ok(self.acquire_sync(key, limit, cost, now)))
    }

    fn reset(
        &self,
        key: &str,
        limit: BucketLimit,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<bool, Error>> + Send {
        ready(Ok(self.reset_sync(key, limit, now)))
    }
}

/// Owns a [`MemoryStore`]'s background sweeper; dropping it stops the sweeper.
#[derive(Debug)]
pub struct SweeperGuard {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Drop for SweeperGuard {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
