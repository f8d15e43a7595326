//! The embedded store: the same decisions as Redis, under its own locks, in one process.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use foldhash::fast::{FixedState, RandomState};
use hashbrown::HashTable;
use smallvec::SmallVec;

use super::{
    BucketKey, BucketObservation, NameRef, Observation, PeriodObservation, Spent, StateObservation,
    Store,
};
use crate::Error;
use crate::bucket::{BucketLimit, BucketState};
use crate::cell::{CellGuard, CellState, StoreId, WindowCell};
use crate::chain::{ChainLimit, Costs, KEY_HASHER, first_refusal};
use crate::clock::{Clock, FastClock, Timestamp};
use crate::in_flight::{InFlightLimit, Lease};
use crate::period::{PeriodCounter, PeriodState};
use crate::spare;
use crate::window::{Charge, Snapshot};

/// A list of one decision's items (cells, shards, locks), inline up to a chain of eight.
type Inline<T> = SmallVec<[T; SMALL]>;
/// The most limits a chain has for its step to keep its lists in arrays (`admit_small`).
const SMALL: usize = 8;
/// What fills the places of `admit_small`'s array of cells past its chain's: never locked.
static UNUSED: WindowCell = WindowCell::new(0);

/// Shards per core: enough that cores rarely meet on one lock, few enough that the shards' locks
/// and tables stay in cache (each shard is a few more cache lines to touch).
const SHARDS_PER_CORE: usize = 8;
/// A shard is swept of expired state when it grows past twice its size after the last sweep
/// (and past this floor), which bounds memory at about twice the live state at O(1) amortised
/// cost per insert.
const MIN_SWEEP: usize = 1024;

/// The embedded in-memory store: thread-safe, cheap to clone (clones share state).
///
/// State is split over shards (eight per core, rounded up to a power of two, 8 to 1024), each a
/// few hash tables (windows, buckets, period counters, concurrency slots) behind a
/// `std::sync::Mutex`. A window's state lives in a cell with a lock of its own, which a limit
/// remembers once it is looked up (docs/design.md §2): a chain locks its limits' cells in one
/// order all chains follow (so two chains can never deadlock), reads, decides and writes, then
/// unlocks: the decision is atomic, with no torn reads. No lock is ever held across an `.await`:
/// every critical section is a few lookups and arithmetic, which is also why a cell's lock spins
/// rather than sleeps.
///
/// Idle state is removed once it can no longer matter (a window `2W` after its last write, a
/// token bucket once full again): lookups ignore expired entries, and a shard sweeps itself as it
/// grows, so memory stays bounded under millions of distinct names. (A window's cell that a live
/// limit remembers stays, emptied, until no limit does.)
/// [`spawn_sweeper`](MemoryStore::spawn_sweeper) adds a periodic sweep for long-lived processes.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Which store this is, to the limits that remember their cells in it.
    id: StoreId,
    shards: Box<[Padded]>,
    /// The process's key hasher ([`KEY_HASHER`]), by which a chain's limits come hashed.
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    /// The next lease number.
    leases: AtomicU64,
    /// Refunds and resets made through the store ([`Store::lowered`]).
    lowered: super::Lowerings,
}

/// A shard's lock on cache lines of its own: two cores working in neighbouring shards must not
/// invalidate each other's lines (false sharing).
#[derive(Debug)]
#[repr(align(128))]
struct Padded(Mutex<Shard>);

#[derive(Debug)]
struct Shard {
    /// Keyed by the store-wide hash of the key, computed once per operation (it also picks the
    /// shard). Windows and buckets live apart so that each slot stays small: a bucket slot is
    /// one cache line.
    windows: HashTable<(Arc<str>, Arc<WindowCell>)>,
    buckets: HashTable<BucketSlot>,
    /// Period counters (budgets' spend), apart from the windows so that the admission path's
    /// table keeps its own slots and size.
    periods: HashTable<PeriodSlot>,
    /// Concurrency limits' held slots: never expire (a process's slots die with it), removed
    /// when the last is given back.
    slots: HashTable<HeldSlots>,
    sweep_at_len: usize,
}

/// The leases holding slots of one concurrency limit.
#[derive(Debug)]
struct HeldSlots {
    key: Box<str>,
    leases: hashbrown::HashSet<u64, FixedState>,
}

#[derive(Debug)]
struct PeriodSlot {
    key: Box<str>,
    state: PeriodState,
    expires: Timestamp,
}

/// Whether the entry keyed `key` is `limit`'s window: the table holds the key text of the limit
/// that made it, shared, so that limit and its clones are known by the text's address.
fn is(key: &Arc<str>, limit: &ChainLimit) -> bool {
    Arc::ptr_eq(key, limit.shared_key()) || **key == *limit.key()
}

/// A bucket, keyed by its parts: an integer name is kept as an integer, so a lookup builds and
/// compares no text for it.
#[derive(Debug)]
struct BucketSlot {
    limiter: &'static str,
    name: StoredName,
    state: BucketState,
    expires: Timestamp,
}

#[derive(Debug)]
enum StoredName {
    Text(Box<str>),
    Unsigned(u64),
    Negative(i64),
}

impl BucketSlot {
    fn is(&self, key: BucketKey<'_>) -> bool {
        let same_name = match (&self.name, key.name) {
            (StoredName::Unsigned(a), NameRef::Unsigned(b)) => *a == b,
            (StoredName::Negative(a), NameRef::Negative(b)) => *a == b,
            (StoredName::Text(a), NameRef::Text(b)) => &**a == b,
            _ => false,
        };
        // A limiter's name is usually the very same static string: compare addresses first.
        same_name && (std::ptr::eq(self.limiter, key.limiter) || self.limiter == key.limiter)
    }

    fn key(&self) -> BucketKey<'_> {
        BucketKey {
            limiter: self.limiter,
            name: match &self.name {
                StoredName::Text(t) => NameRef::Text(t),
                StoredName::Unsigned(n) => NameRef::Unsigned(*n),
                StoredName::Negative(n) => NameRef::Negative(*n),
            },
        }
    }
}

impl Shard {
    fn len(&self) -> usize {
        self.windows.len() + self.buckets.len() + self.periods.len() + self.slots.len()
    }

    /// The requests holding slots at `key`, `lease` not counted.
    fn running(&self, hash: u64, key: &str, lease: u64) -> u64 {
        self.slots.find(hash, |s| &*s.key == key).map_or(0, |s| {
            s.leases.len() as u64 - u64::from(s.leases.contains(&lease))
        })
    }

    /// Takes a slot at `key` for `lease` (once).
    fn hold(&mut self, hasher: &RandomState, hash: u64, key: &str, lease: u64) {
        if let Some(held) = self.slots.find_mut(hash, |s| &*s.key == key) {
            held.leases.insert(lease);
            return;
        }
        let mut leases = hashbrown::HashSet::with_hasher(FixedState::default());
        leases.insert(lease);
        let held = HeldSlots {
            key: key.into(),
            leases,
        };
        self.slots
            .insert_unique(hash, held, |s| hasher.hash_one(&*s.key));
    }

    /// Gives back `lease`'s slot at `key`, if it holds one.
    fn unhold(&mut self, hash: u64, key: &str, lease: u64) {
        if let Ok(mut found) = self.slots.find_entry(hash, |s| &*s.key == key) {
            let leases = &mut found.get_mut().leases;
            leases.remove(&lease);
            if leases.is_empty() {
                found.remove();
            }
        }
    }

    /// The live state of the period counter at `key`.
    fn period(&self, hash: u64, key: &str, now: Timestamp) -> Option<PeriodState> {
        self.periods
            .find(hash, |s| &*s.key == key)
            .filter(|s| s.expires > now)
            .map(|s| s.state)
    }

    /// `limit`'s cell, if the shard has one.
    fn cell(&self, limit: &ChainLimit) -> Option<&Arc<WindowCell>> {
        let (_, cell) = self.windows.find(limit.key_hash(), |(k, _)| is(k, limit))?;
        Some(cell)
    }

    /// Sweeps before an insert once the shard has doubled since its last sweep, of the state
    /// expired at `now` ([`MemoryStore::times`]).
    fn grow(&mut self, now: Timestamp) {
        if self.len() >= self.sweep_at_len {
            self.sweep(now);
        }
    }

    fn sweep(&mut self, now: Timestamp) {
        // A cell a limit remembers stays, whatever its state: the limit goes straight to it, so
        // a second cell for its key must never be made (docs/design.md §2). No one else can
        // take a new reference to a cell but through this table, under this lock, so a count of
        // one is the table's alone.
        self.windows.retain(|(_, c)| {
            Arc::strong_count(c) > 1 || c.try_lock().is_none_or(|g| g.state().expires > now)
        });
        self.buckets.retain(|s| s.expires > now);
        self.periods.retain(|s| s.expires > now);
        self.sweep_at_len = (self.len() * 2).max(MIN_SWEEP);
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the wall clock (read as a [`FastClock`]).
    pub fn new() -> Self {
        Self::with_clock(FastClock::new())
    }

    /// An empty store reading `clock` when a call does not pin the time.
    pub fn with_clock(clock: impl Clock) -> Self {
        let cores = thread::available_parallelism().map_or(4, |n| n.get());
        let count = (cores * SHARDS_PER_CORE).next_power_of_two().clamp(8, 1024);
        let shards = (0..count)
            .map(|_| {
                Padded(Mutex::new(Shard {
                    windows: HashTable::new(),
                    buckets: HashTable::new(),
                    periods: HashTable::new(),
                    slots: HashTable::new(),
                    sweep_at_len: MIN_SWEEP,
                }))
            })
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                id: StoreId::next(),
                shards,
                hasher: KEY_HASHER.clone(),
                clock: Arc::new(clock),
                leases: AtomicU64::new(1),
                lowered: super::Lowerings::default(),
            }),
        }
    }

    /// The store's clock reading.
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// An operation's instant (`pinned`, or the clock's) and the instant it may sweep expired
    /// state at: never past the store's own clock, so that a call pinned in the future (a test,
    /// a replay) cannot drop state that is live for every other caller, as Redis, whose expiry
    /// runs on its own clock, would not.
    fn times(&self, pinned: Option<Timestamp>) -> (Timestamp, Timestamp) {
        match pinned {
            Some(t) => (t, t.min(self.now())),
            None => {
                let now = self.now();
                (now, now)
            }
        }
    }

    /// How many entries the store holds, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        (0..self.inner.shards.len())
            .map(|i| self.lock(i).len())
            .sum()
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
        for i in 0..self.inner.shards.len() {
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
        (hash, self.shard_of(hash))
    }

    /// The shard of `limit`'s window, from the hash the limit carries.
    fn shard_of_limit(&self, limit: &ChainLimit) -> usize {
        self.shard_of(limit.key_hash())
    }

    /// [`locate`](Self::locate) for a bucket, hashed by its parts: no key text is built.
    fn locate_bucket(&self, key: BucketKey<'_>) -> (u64, usize) {
        let hash = self.inner.hasher.hash_one(key);
        (hash, self.shard_of(hash))
    }

    /// The shard of a hash: its high bits (the tables use the low ones). The count is a power
    /// of two.
    fn shard_of(&self, hash: u64) -> usize {
        (hash >> 40) as usize & (self.inner.shards.len() - 1)
    }

    fn lock(&self, shard: usize) -> MutexGuard<'_, Shard> {
        // A panic cannot leave a shard half-written (each write is one assignment), so a
        // poisoned lock's state is still sound.
        self.inner.shards[shard]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// [`Store::admit`], without the future (a plain cost converts: `1.into()`).
    pub fn admit_sync(
        &self,
        limits: &[ChainLimit],
        costs: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Observation {
        self.admit_holding_sync(limits, &[], costs, Lease::from_id(0), now)
    }

    /// [`Store::admit_holding`], without the future.
    pub fn admit_holding_sync(
        &self,
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        costs: Costs<'_>,
        lease: Lease,
        now: Option<Timestamp>,
    ) -> Observation {
        let (now, sweep_at) = self.times(now);
        if slots.is_empty()
            && let Some(seen) = self.admit_small(limits, costs, now, sweep_at)
        {
            return seen;
        }
        // The lists of one decision live on the stack (a chain rarely has more than a few
        // limits): the only allocation left is the snapshots the observation returns.
        // (Filled in place, not collected: a collected list is moved, its whole inline buffer
        // copied, which costs more than the few items it holds.)
        let mut cells: Inline<CellRef<'_>> = Inline::new();
        for l in limits {
            cells.push(self.cell(l, sweep_at));
        }
        // Each cell is locked once, in the cells' one lock order: two decisions sharing cells
        // take them in the same order, so they cannot deadlock. (Two limits of one key, which
        // `Chain::new` refuses in debug builds, would share one lock.)
        let mut order: Inline<((u8, usize), usize)> = Inline::new();
        order.extend(cells.iter().enumerate().map(|(i, c)| (c.lock_order(), i)));
        order.sort_unstable();
        let mut guards: Inline<CellGuard<'_>> = Inline::new();
        let mut guard_of: Inline<usize> = Inline::from_elem(0, limits.len());
        let mut last = None;
        for &(place, i) in &order {
            if last != Some(place) {
                guards.push(cells[i].lock());
                last = Some(place);
            }
            guard_of[i] = guards.len() - 1;
        }
        // Concurrency slots live in the shards' tables: their shards are locked after the cells,
        // in ascending order (nothing that holds a shard's lock waits for a cell's).
        let mut slots_at: Inline<(u64, usize)> = Inline::new();
        slots_at.extend(slots.iter().map(|l| self.locate(l.key())));
        let mut shard_order: Inline<usize> = Inline::new();
        shard_order.extend(slots_at.iter().map(|&(_, shard)| shard));
        shard_order.sort_unstable();
        shard_order.dedup();
        let mut shards: Inline<(usize, MutexGuard<'_, Shard>)> = Inline::new();
        shards.extend(shard_order.iter().map(|&i| (i, self.lock(i))));
        let mut snapshots = Vec::with_capacity(limits.len());
        for (l, &g) in limits.iter().zip(&guard_of) {
            snapshots.push(Snapshot::at(guards[g].live(now), now, l.limit()));
        }
        let running: Vec<u64> = slots
            .iter()
            .zip(&slots_at)
            .map(|(l, &(hash, shard))| {
                locked(&mut shards, shard).running(hash, l.key(), lease.id())
            })
            .collect();
        let admitted = first_refusal(limits, &snapshots, costs).is_none()
            && !slots.iter().zip(&running).any(|(l, &n)| l.refuses(n));
        if admitted {
            let charged = limits.iter().zip(&snapshots).zip(&guard_of).enumerate();
            for (i, ((l, s), &g)) in charged.filter(|(_, ((l, _), _))| l.charge().at_admission()) {
                guards[g].set(CellState {
                    window: s.charged(costs.of(i)),
                    expires: now.saturating_add(l.limit().ttl()),
                });
            }
            let hasher = &self.inner.hasher;
            for (l, &(hash, shard)) in slots.iter().zip(&slots_at) {
                locked(&mut shards, shard).hold(hasher, hash, l.key(), lease.id());
            }
        }
        drop(shards);
        // The cells are let go in the reverse of the lock order: the most shared first.
        while guards.pop().is_some() {}
        Observation {
            now,
            admitted,
            enforced: true,
            snapshots,
            running,
            at: Vec::new(),
        }
    }

    /// The step of the common case, a chain of at most [`SMALL`] limits and no concurrency
    /// slots, with its lists in arrays on the stack; `None` for any other chain (or two limits
    /// of one key), which the general step decides.
    fn admit_small(
        &self,
        limits: &[ChainLimit],
        costs: Costs<'_>,
        now: Timestamp,
        sweep_at: Timestamp,
    ) -> Option<Observation> {
        let n = limits.len();
        if n > SMALL {
            return None;
        }
        let id = self.inner.id;
        let mut cells: [&WindowCell; SMALL] = [&UNUSED; SMALL];
        for (l, cell) in limits.iter().zip(&mut cells) {
            match l.cell().get(id) {
                Some(remembered) => *cell = remembered,
                None => return self.admit_small_looked_up(limits, costs, now, sweep_at),
            }
        }
        self.decide_small(limits, &cells, costs, now)
    }

    /// [`admit_small`](Self::admit_small) for a chain with a limit that does not remember its
    /// cell in this store (one built for this request, or remembering another store's cell):
    /// the cells looked up in the tables first (a limit new to any store then remembers its own).
    #[cold]
    fn admit_small_looked_up(
        &self,
        limits: &[ChainLimit],
        costs: Costs<'_>,
        now: Timestamp,
        sweep_at: Timestamp,
    ) -> Option<Observation> {
        let found: Inline<CellRef<'_>> = limits.iter().map(|l| self.cell(l, sweep_at)).collect();
        let mut cells: [&WindowCell; SMALL] = [&UNUSED; SMALL];
        for (cell, found) in cells.iter_mut().zip(&found) {
            *cell = found;
        }
        self.decide_small(limits, &cells, costs, now)
    }

    /// The short step over `cells`, one a limit in their first places: locks, reads, decides,
    /// writes and unlocks.
    #[inline(always)]
    fn decide_small(
        &self,
        limits: &[ChainLimit],
        cells: &[&WindowCell; SMALL],
        costs: Costs<'_>,
        now: Timestamp,
    ) -> Option<Observation> {
        let n = limits.len();
        // Locked in the cells' one lock order, as the general step locks them. A chain's limits
        // mostly come narrowest first, each scope ranked above the last: then the chain's order
        // is the lock order, and no two limits share a cell. Two limits of one key (which
        // `Chain::new` refuses in debug builds) go to the general step.
        let mut order: [usize; SMALL] = std::array::from_fn(|i| i);
        let order = &mut order[..n];
        if !cells[..n].windows(2).all(|w| w[0].rank() < w[1].rank()) {
            order.sort_unstable_by_key(|&i| cells[i].lock_order());
            if order
                .windows(2)
                .any(|w| cells[w[0]].lock_order() == cells[w[1]].lock_order())
            {
                return None;
            }
        }
        let mut guards: [Option<CellGuard<'_>>; SMALL] = Default::default();
        for &i in order.iter() {
            guards[i] = Some(cells[i].lock());
        }
        // The list the last decision on this thread gave back, if any (`spare`; taken after the
        // cells are locked: before them, one thread's decision read 4% slower, and a thread's
        // spare is there, so the cells are held no longer for it).
        let mut snapshots = spare::take(n);
        // Limits of one window share the instant's bucket (a chain's are mostly per minute).
        let mut split = (0, 0, 0);
        for (l, g) in limits.iter().zip(&guards) {
            let state = g.as_ref().and_then(|g| g.live(now));
            let w = l.limit().window_micros();
            if split.0 != w {
                let t = now.as_micros();
                split = (w, t / w, t % w);
            }
            snapshots.push(Snapshot::in_bucket(state, split.1, split.2));
        }
        let admitted = first_refusal(limits, &snapshots, costs).is_none();
        // Written and unlocked in the reverse of the lock order: the cells most shared, locked
        // last, are held the shortest.
        for &i in order.iter().rev() {
            let (l, guard) = (&limits[i], guards[i].take());
            if let Some(mut state) = guard
                && admitted
                && l.charge().at_admission()
            {
                state.set(CellState {
                    window: snapshots[i].charged(costs.of(i)),
                    expires: now.saturating_add(l.limit().ttl()),
                });
            }
        }
        Some(Observation {
            now,
            admitted,
            enforced: true,
            snapshots,
            running: Vec::new(),
            at: Vec::new(),
        })
    }

    /// `limit`'s cell in this store, made (empty) if new: the one the limit remembers, or else
    /// the one its shard's table holds, which the limit then remembers if it remembers none yet
    /// (docs/design.md §2).
    #[inline]
    fn cell<'a>(&self, limit: &'a ChainLimit, sweep_at: Timestamp) -> CellRef<'a> {
        match limit.cell().get(self.inner.id) {
            Some(cell) => CellRef::Remembered(cell),
            None => self.look_up(limit, sweep_at),
        }
    }

    /// [`cell`](Self::cell) through the table.
    #[cold]
    fn look_up<'a>(&self, limit: &'a ChainLimit, sweep_at: Timestamp) -> CellRef<'a> {
        let found = {
            let mut shard = self.lock(self.shard_of_limit(limit));
            match shard.cell(limit) {
                Some(cell) => Arc::clone(cell),
                None => {
                    shard.grow(sweep_at);
                    let cell = Arc::new(WindowCell::new(limit.scope() as u8));
                    // The store's hasher is the limits' key hasher: a moved entry hashes as its
                    // limit does.
                    let hasher = &self.inner.hasher;
                    let entry = (Arc::clone(limit.shared_key()), Arc::clone(&cell));
                    shard
                        .windows
                        .insert_unique(limit.key_hash(), entry, |(k, _)| hasher.hash_one(&**k));
                    cell
                }
            }
        };
        match limit.cell().remember(self.inner.id, &found) {
            Some(cell) => CellRef::Remembered(cell),
            None => CellRef::Found(found),
        }
    }

    /// `limit`'s cell in this store if there is one, made by nothing: for reads and resets.
    fn existing_cell<'a>(&self, limit: &'a ChainLimit) -> Option<CellRef<'a>> {
        if let Some(cell) = limit.cell().get(self.inner.id) {
            return Some(CellRef::Remembered(cell));
        }
        let shard = self.lock(self.shard_of_limit(limit));
        shard.cell(limit).map(|c| CellRef::Found(Arc::clone(c)))
    }

    /// [`Store::release`], without the future.
    pub fn release_sync(&self, slots: &[InFlightLimit], lease: Lease) {
        // Each slot is given back under its own shard's lock: a release decides nothing.
        for l in slots {
            let (hash, shard) = self.locate(l.key());
            self.lock(shard).unhold(hash, l.key(), lease.id());
        }
    }

    /// [`Store::record`], without the future.
    pub fn record_sync(&self, limits: &[ChainLimit], units: u64, now: Option<Timestamp>) {
        let (now, sweep_at) = self.times(now);
        // Each limit's write is atomic on its own; recording has no decision to keep whole.
        for l in limits.iter().filter(|l| l.charge() == Charge::Reactive) {
            let cell = self.cell(l, sweep_at);
            let mut state = cell.lock();
            let snapshot = Snapshot::at(state.live(now), now, l.limit());
            state.set(CellState {
                window: snapshot.charged(units),
                expires: now.saturating_add(l.limit().ttl()),
            });
        }
    }

    /// Charges what a served request cost after the fact ([`Spent`]), now, then calls
    /// `landed`, as the Redis store's `charge_then` does once Redis has it.
    pub fn charge_then<F>(&self, spent: Spent<'_>, landed: F)
    where
        F: FnOnce(Result<(), Error>) + Send + 'static,
    {
        if spent.records() {
            self.record_sync(spent.limits, spent.units, None);
        }
        if spent.adds() {
            // The totals after are not asked for: added without a list to hold them.
            let (now, sweep_at) = self.times(None);
            for c in spent.counters {
                self.add_period(c, spent.amount, now, sweep_at);
            }
        }
        landed(Ok(()));
    }

    /// [`Store::reconcile`], without the future.
    pub fn reconcile_sync(
        &self,
        limits: &[ChainLimit],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) {
        let (now, sweep_at) = self.times(now);
        // A refund lowers a count: the refusal caches of every chain on this store stop
        // answering from what they saw before it (docs/design.md §11).
        let refund = delta < 0;
        if refund {
            self.inner.lowered.bump();
        }
        // Each limit's write is atomic on its own, as a record's: there is no decision to keep
        // whole.
        for l in limits.iter().filter(|l| l.charge() == Charge::Reserved) {
            let cell = self.cell(l, sweep_at);
            let mut state = cell.lock();
            let snapshot = Snapshot::at(state.live(now), now, l.limit());
            let reserved = reserved_at.as_micros() / l.limit().window_micros();
            if let Some(window) = snapshot.reconciled(reserved, delta) {
                state.set(CellState {
                    window,
                    expires: now.saturating_add(l.limit().ttl()),
                });
            }
        }
        if refund {
            self.inner.lowered.bump();
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
        let (now, sweep_at) = self.times(now);
        let (hash, shard) = self.locate_bucket(key);
        let mut shard = self.lock(shard);
        let shard = &mut *shard;
        let slot = shard.buckets.find_mut(hash, |s| s.is(key));
        let stored = slot.as_ref().filter(|s| s.expires > now).map(|s| s.state);
        let (allowed, tokens) = limit.take(limit.tokens_at(stored, now), cost);
        let ttl = limit.ttl_micros(tokens);
        let ts = BucketLimit::written_at(stored, now);
        let state = BucketState { tokens, ts };
        let expires = Timestamp::from_micros(ts.as_micros().saturating_add(ttl));
        match slot {
            // Full: a missing bucket reads as full, so nothing needs keeping.
            Some(_) if ttl == 0 => {
                if let Ok(found) = shard.buckets.find_entry(hash, |s| s.is(key)) {
                    found.remove();
                }
            }
            Some(slot) => {
                slot.state = state;
                slot.expires = expires;
            }
            None if ttl == 0 => {}
            None => {
                shard.grow(sweep_at);
                let name = match key.name {
                    NameRef::Text(t) => StoredName::Text(t.into()),
                    NameRef::Unsigned(n) => StoredName::Unsigned(n),
                    NameRef::Negative(n) => StoredName::Negative(n),
                };
                let slot = BucketSlot {
                    limiter: key.limiter,
                    name,
                    state,
                    expires,
                };
                let hasher = &self.inner.hasher;
                shard
                    .buckets
                    .insert_unique(hash, slot, |s| hasher.hash_one(s.key()));
            }
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
        match self.lock(shard).buckets.find_entry(hash, |s| s.is(key)) {
            Ok(found) => {
                let (slot, _) = found.remove();
                slot.expires > now && limit.tokens_at(Some(slot.state), now) < limit.capacity as f64
            }
            Err(_) => false,
        }
    }
}

impl MemoryStore {
    /// [`Store::read_periods`], without the future.
    pub fn read_periods_sync(
        &self,
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> PeriodObservation {
        let (now, _) = self.times(now);
        // Each counter is read under its shard's lock: a budget check charges nothing, so
        // there is no decision to keep whole across counters.
        let totals = counters
            .iter()
            .map(|c| {
                let (hash, shard) = self.locate(c.key());
                let state = self.lock(shard).period(hash, c.key(), now);
                PeriodState::total_at(state, c.period(), now)
            })
            .collect();
        PeriodObservation {
            now,
            enforced: true,
            totals,
        }
    }

    /// [`Store::reconcile_periods`], without the future.
    pub fn reconcile_periods_sync(
        &self,
        counters: &[PeriodCounter],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) {
        let (now, sweep_at) = self.times(now);
        // Each counter on its own, as an add: a refund lowers a total (docs/design.md §12).
        for c in counters {
            let (hash, shard) = self.locate(c.key());
            let mut shard = self.lock(shard);
            let stored = shard.period(hash, c.key(), now);
            let Some(state) = PeriodState::reconciled(stored, c.period(), now, reserved_at, delta)
            else {
                continue;
            };
            self.put_period(&mut shard, hash, c, state, (now, sweep_at));
        }
    }

    /// [`Store::add_periods`], without the future.
    pub fn add_periods_sync(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> PeriodObservation {
        let (now, sweep_at) = self.times(now);
        // Each counter's add is atomic on its own, as a token record's is: the adds of one
        // response do not depend on each other.
        let totals = counters
            .iter()
            .map(|c| self.add_period(c, amount, now, sweep_at))
            .collect();
        PeriodObservation {
            now,
            enforced: true,
            totals,
        }
    }

    /// Adds `amount` to counter `c` at `now`; returns its total after.
    fn add_period(
        &self,
        c: &PeriodCounter,
        amount: u64,
        now: Timestamp,
        sweep_at: Timestamp,
    ) -> u64 {
        let (hash, shard) = self.locate(c.key());
        let mut shard = self.lock(shard);
        let state = PeriodState::added(shard.period(hash, c.key(), now), c.period(), now, amount);
        self.put_period(&mut shard, hash, c, state, (now, sweep_at));
        state.total
    }

    /// Stores counter `c`'s `state` (its key hashed to `hash`) in its locked `shard`, its
    /// expiry pushed on from `now`; a new slot may sweep the shard first (at `sweep_at`).
    fn put_period(
        &self,
        shard: &mut Shard,
        hash: u64,
        c: &PeriodCounter,
        state: PeriodState,
        (now, sweep_at): (Timestamp, Timestamp),
    ) {
        let expires = c.expires(now);
        if let Some(slot) = shard.periods.find_mut(hash, |s| &*s.key == c.key()) {
            slot.state = state;
            slot.expires = expires;
        } else {
            shard.grow(sweep_at);
            let slot = PeriodSlot {
                key: c.key().into(),
                state,
                expires,
            };
            let hasher = &self.inner.hasher;
            shard
                .periods
                .insert_unique(hash, slot, |s| hasher.hash_one(&*s.key));
        }
    }
}

impl MemoryStore {
    /// [`Store::read_state`], without the future.
    pub fn read_state_sync(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> StateObservation {
        self.state_sync(limits, counters, now, false)
    }

    /// [`Store::clear_state`], without the future.
    pub fn clear_state_sync(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> StateObservation {
        // A reset lowers counts, as a refund does (docs/design.md §11).
        self.inner.lowered.bump();
        let cleared = self.state_sync(limits, counters, now, true);
        self.inner.lowered.bump();
        cleared
    }

    /// Reads each window (under its cell's lock) and counter (under its shard's) at `now`, and
    /// with `clear` empties the window's cell and removes the counter under the same lock: what
    /// is answered is what went.
    fn state_sync(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
        clear: bool,
    ) -> StateObservation {
        let (now, _) = self.times(now);
        let snapshots = limits
            .iter()
            .map(|l| {
                let state = self.existing_cell(l).and_then(|cell| {
                    let mut state = cell.lock();
                    let live = state.live(now);
                    if clear {
                        // Emptied, not removed: a limit may remember the cell, and a key must
                        // never have two. An unremembered empty cell is swept.
                        state.set(CellState::default());
                    }
                    live
                });
                Snapshot::at(state, now, l.limit())
            })
            .collect();
        let totals = counters
            .iter()
            .map(|c| {
                let (hash, shard) = self.locate(c.key());
                let mut shard = self.lock(shard);
                let state = shard.period(hash, c.key(), now);
                if clear && let Ok(found) = shard.periods.find_entry(hash, |s| &*s.key == c.key()) {
                    found.remove();
                }
                PeriodState::total_at(state, c.period(), now)
            })
            .collect();
        StateObservation {
            now,
            snapshots,
            totals,
        }
    }
}

/// A limit's cell, as a decision holds it: remembered by the limit, or found in a table (and
/// kept alive by this reference meanwhile).
enum CellRef<'a> {
    Remembered(&'a WindowCell),
    Found(Arc<WindowCell>),
}

impl std::ops::Deref for CellRef<'_> {
    type Target = WindowCell;

    fn deref(&self) -> &WindowCell {
        match self {
            CellRef::Remembered(cell) => cell,
            CellRef::Found(cell) => cell,
        }
    }
}

/// The locked shard `shard` among `guards` (which hold every shard a chain touches).
fn locked<'a>(guards: &'a mut [(usize, MutexGuard<'_, Shard>)], shard: usize) -> &'a mut Shard {
    let at = guards.iter().position(|(i, _)| *i == shard).unwrap_or(0);
    &mut guards[at].1
}

impl Store for MemoryStore {
    async fn admit(
        &self,
        limits: &[ChainLimit],
        cost: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Result<Observation, Error> {
        // An async fn, so lazy like any future: nothing happens until it is polled.
        Ok(self.admit_sync(limits, cost, now))
    }

    fn lowered(&self) -> u128 {
        self.inner.lowered.get()
    }

    fn local_now(&self) -> Option<Timestamp> {
        Some(self.now())
    }

    fn lease(&self) -> Lease {
        Lease::from_id(self.inner.leases.fetch_add(1, Ordering::Relaxed))
    }

    async fn admit_holding(
        &self,
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        cost: Costs<'_>,
        lease: Lease,
        now: Option<Timestamp>,
    ) -> Result<Observation, Error> {
        Ok(self.admit_holding_sync(limits, slots, cost, lease, now))
    }

    async fn release(
        &self,
        slots: &[InFlightLimit],
        lease: Lease,
        _now: Option<Timestamp>,
    ) -> Result<(), Error> {
        self.release_sync(slots, lease);
        Ok(())
    }

    async fn read_running(
        &self,
        slots: &[InFlightLimit],
        _now: Option<Timestamp>,
    ) -> Result<Vec<u64>, Error> {
        // Lease 0 is never handed out: nothing is left out of the count.
        Ok(slots
            .iter()
            .map(|l| {
                let (hash, shard) = self.locate(l.key());
                self.lock(shard).running(hash, l.key(), 0)
            })
            .collect())
    }

    async fn record(
        &self,
        limits: &[ChainLimit],
        units: u64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        self.record_sync(limits, units, now);
        Ok(())
    }

    async fn reconcile_periods(
        &self,
        counters: &[PeriodCounter],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        self.reconcile_periods_sync(counters, reserved_at, delta, now);
        Ok(())
    }

    async fn reconcile(
        &self,
        limits: &[ChainLimit],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        self.reconcile_sync(limits, reserved_at, delta, now);
        Ok(())
    }

    async fn acquire(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<BucketObservation, Error> {
        Ok(self.acquire_sync(key, limit, cost, now))
    }

    async fn reset(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        now: Option<Timestamp>,
    ) -> Result<bool, Error> {
        Ok(self.reset_sync(key, limit, now))
    }

    async fn read_periods(
        &self,
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Error> {
        Ok(self.read_periods_sync(counters, now))
    }

    async fn add_periods(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Error> {
        Ok(self.add_periods_sync(counters, amount, now))
    }
    async fn read_state(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<StateObservation, Error> {
        Ok(self.read_state_sync(limits, counters, now))
    }

    async fn clear_state(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<StateObservation, Error> {
        Ok(self.clear_state_sync(limits, counters, now))
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
