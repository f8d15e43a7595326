//! The embedded store: the same decisions as Redis, under its own locks, in one process.

use std::future::{Future, ready};
use std::hash::BuildHasher;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use foldhash::fast::RandomState;
use hashbrown::HashTable;

use super::{BucketKey, BucketObservation, Observation, Store};
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
    /// Keyed by the store-wide hash of the key, computed once per operation (it also picks the
    /// shard).
    table: HashTable<Slot>,
    sweep_at_len: usize,
}

#[derive(Debug)]
struct Slot {
    key: Box<str>,
    hash: u64,
    entry: Entry,
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
    fn slot(&mut self, hash: u64, key: &str) -> Option<&mut Slot> {
        self.table.find_mut(hash, |s| &*s.key == key)
    }

    fn bucket_slot(&mut self, hash: u64, key: BucketKey<'_>) -> Option<&mut Slot> {
        self.table.find_mut(hash, |s| key.is(&s.key))
    }

    /// The live window state at `key`.
    fn window(&mut self, hash: u64, key: &str, now: Timestamp) -> Option<WindowState> {
        match self.slot(hash, key).map(|s| s.entry) {
            Some(Entry::Window { state, expires }) if expires > now => Some(state),
            _ => None,
        }
    }

    /// Writes `entry` at `key`, in place when the key is present.
    fn put(&mut self, hash: u64, key: &str, entry: Entry, now: Timestamp) {
        if let Some(slot) = self.slot(hash, key) {
            slot.entry = entry;
            return;
        }
        self.insert(hash, key.into(), entry, now);
    }

    /// Adds a slot for a key known to be absent.
    fn insert(&mut self, hash: u64, key: Box<str>, entry: Entry, now: Timestamp) {
        if self.table.len() >= self.sweep_at_len {
            self.sweep(now);
        }
        let slot = Slot { key, hash, entry };
        self.table.insert_unique(hash, slot, |s| s.hash);
    }

    fn remove_bucket(&mut self, hash: u64, key: BucketKey<'_>) -> Option<Entry> {
        match self.table.find_entry(hash, |s| key.is(&s.key)) {
            Ok(found) => Some(found.remove().0.entry),
            Err(_) => None,
        }
    }

    fn sweep(&mut self, now: Timestamp) {
        self.table.retain(|s| s.entry.expires() > now);
        self.sweep_at_len = (self.table.len() * 2).max(MIN_SWEEP);
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
                    table: HashTable::new(),
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
        (0..SHARDS).map(|i| self.lock(i).table.len()).sum()
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

    /// The key's hash and its shard: the high bits pick the shard, the table uses the rest.
    fn locate(&self, key: &str) -> (u64, usize) {
        let hash = self.inner.hasher.hash_one(key);
        (hash, (hash >> 58) as usize % SHARDS)
    }

    /// [`locate`](Self::locate) for a bucket, hashed by its parts: no key text is built.
    fn locate_bucket(&self, key: BucketKey<'_>) -> (u64, usize) {
        let hash = self.inner.hasher.hash_one((key.limiter, key.name));
        (hash, (hash >> 58) as usize % SHARDS)
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
        let located: Vec<(u64, usize)> = limits.iter().map(|l| self.locate(l.key())).collect();
        let mut order: Vec<usize> = located.iter().map(|&(_, shard)| shard).collect();
        order.sort_unstable();
        order.dedup();
        // Ascending order: two chains sharing shards take them in the same order, so they
        // cannot deadlock.
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.lock(i))).collect();
        let snapshots: Vec<Snapshot> = limits
            .iter()
            .zip(&located)
            .map(|(l, &(hash, shard))| {
                let state = locked(&mut guards, shard).window(hash, l.key(), now);
                Snapshot::at(state, now, l.limit())
            })
            .collect();
        let admitted = first_refusal(limits, &snapshots, cost).is_none();
        if admitted {
            for ((l, s), &(hash, shard)) in limits.iter().zip(&snapshots).zip(&located) {
                if l.charge() == Charge::Admission {
                    let entry = Entry::Window {
                        state: s.charged(cost),
                        expires: now.saturating_add(l.limit().ttl()),
                    };
                    locked(&mut guards, shard).put(hash, l.key(), entry, now);
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
            let (hash, shard) = self.locate(l.key());
            let mut shard = self.lock(shard);
            let snapshot = Snapshot::at(shard.window(hash, l.key(), now), now, l.limit());
            let entry = Entry::Window {
                state: snapshot.charged(units),
                expires: now.saturating_add(l.limit().ttl()),
            };
            shard.put(hash, l.key(), entry, now);
        }
    }

    /// [`Store::acquire`], without the future.
    pub fn acquire_sync(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> BucketObservation {
        let now = now.unwrap_or_else(|| self.now());
        let (hash, shard) = self.locate_bucket(key);
        let mut shard = self.lock(shard);
        let slot = shard.bucket_slot(hash, key);
        let stored = match slot.as_ref().map(|s| s.entry) {
            Some(Entry::Bucket { state, expires }) if expires > now => Some(state),
            _ => None,
        };
        let (allowed, tokens) = limit.take(limit.tokens_at(stored, now), cost);
        let ttl = limit.ttl_micros(tokens);
        let entry = Entry::Bucket {
            state: BucketState { tokens, ts: now },
            expires: Timestamp::from_micros(now.as_micros().saturating_add(ttl)),
        };
        match slot {
            // Full: a missing bucket reads as full, so nothing needs keeping.
            Some(_) if ttl == 0 => {
                shard.remove_bucket(hash, key);
            }
            Some(slot) => slot.entry = entry,
            None if ttl == 0 => {}
            None => shard.insert(hash, key.to_string().into(), entry, now),
        }
        BucketObservation {
            now,
            allowed,
            tokens,
            enforced: true,
        }
    }

    /// [`Store::reset`], without the future.
    pub fn reset_sync(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        now: Option<Timestamp>,
    ) -> bool {
        let now = now.unwrap_or_else(|| self.now());
        let (hash, shard) = self.locate_bucket(key);
        match self.lock(shard).remove_bucket(hash, key) {
            Some(Entry::Bucket { state, expires }) if expires > now => {
                limit.tokens_at(Some(state), now) < limit.capacity as f64
            }
            _ => false,
        }
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
        key: BucketKey<'_>,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<BucketObservation, Error>> + Send {
        ready(Ok(self.acquire_sync(key, limit, cost, now)))
    }

    fn reset(
        &self,
        key: BucketKey<'_>,
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
