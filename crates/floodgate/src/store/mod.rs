//! Stores supply atomicity; the algorithm supplies the math.
//!
//! A [`Store`] runs each decision as one atomic step against its state: the embedded
//! [`MemoryStore`] under its own locks, the Redis store as one Lua script. Both read state,
//! apply the pure functions of [`window`](crate::window) and [`bucket`](crate::bucket) (the
//! scripts mirror them operation for operation) and write the result, so the same operation
//! sequence with the same clock gives the same decisions on both: `tests/vectors.rs` holds the
//! shared cases. Period counters (budgets' spend per calendar day or month) are kept the same
//! way, with their own read and add.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use crate::Error;
use crate::bucket::BucketLimit;
use crate::chain::{ChainLimit, Costs};
use crate::clock::Timestamp;
use crate::in_flight::{InFlightLimit, Lease};
use crate::period::PeriodCounter;
use crate::window::Snapshot;

#[cfg(feature = "redis")]
mod any;
mod memory;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "redis")]
pub use any::AnyStore;

pub use memory::{MemoryStore, SweeperGuard};

/// What a store saw and did for one chain admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation {
    /// The instant the decision was taken at.
    pub now: Timestamp,
    /// Whether the request was admitted and charged.
    pub admitted: bool,
    /// Whether a store decided; `false` when it failed open (then `snapshots` is empty).
    pub enforced: bool,
    /// Each limit's counts at `now`, before any charge, in chain order.
    pub snapshots: Vec<Snapshot>,
    /// For an admission that holds slots ([`Store::admit_holding`]): each concurrency limit's
    /// running requests at `now`, before this one, in order (empty otherwise).
    pub running: Vec<u64>,
    /// For an admission decided in steps at instants of their own (a chain across slots of a
    /// Redis Cluster), each limit's step's instant, in chain order: the bucket its charge went
    /// into. Empty when every limit was decided at `now`.
    pub at: Vec<Timestamp>,
}

/// What a served request cost after the fact, to charge in one go (`charge_then` on
/// [`AnyStore`](crate::store::AnyStore), [`MemoryStore`] and the Redis store): `units` to every
/// reactive limit of `limits` (tokens), `amount` to every counter of `counters` (a budget's
/// spend: [`Budgets::counters`](crate::Budgets::counters)).
#[derive(Clone, Copy, Debug)]
pub struct Spent<'a> {
    /// The limits the units go to (only the reactive ones are charged).
    pub limits: &'a [ChainLimit],
    /// The units (tokens).
    pub units: u64,
    /// The period counters the amount goes to.
    pub counters: &'a [PeriodCounter],
    /// The amount (micro-USD).
    pub amount: u64,
}

impl Spent<'_> {
    /// Whether it charges units: some, and a reactive limit to take them.
    pub fn records(&self) -> bool {
        self.units > 0
            && self
                .limits
                .iter()
                .any(|l| l.charge() == crate::window::Charge::Reactive)
    }

    /// Whether it adds an amount: some, and a counter to take it.
    pub fn adds(&self) -> bool {
        self.amount > 0 && !self.counters.is_empty()
    }
}

/// What a store saw and did for one token-bucket request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketObservation {
    /// The instant the decision was taken at.
    pub now: Timestamp,
    /// Whether the tokens were taken.
    pub allowed: bool,
    /// Tokens left in the bucket after the request.
    pub tokens: f64,
    /// Whether a store decided; `false` when it failed open.
    pub enforced: bool,
}

/// What a store saw for a read of, or an add to, period counters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeriodObservation {
    /// The instant of the operation: which period each counter was in.
    pub now: Timestamp,
    /// Whether a store answered; `false` when a read failed open (then `totals` are all 0).
    pub enforced: bool,
    /// Each counter's total in its current period (after the add, for an add), in order.
    pub totals: Vec<u64>,
}

/// What a store held for windows and period counters at one instant: an operator's read
/// ([`Store::read_state`]) or what a reset took away ([`Store::clear_state`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateObservation {
    /// The instant of the read: each window's bucket and each counter's period.
    pub now: Timestamp,
    /// Each window limit's counts at `now`, in order (what an admission of cost 0 sees).
    pub snapshots: Vec<Snapshot>,
    /// Each counter's total in its period at `now`, in order.
    pub totals: Vec<u64>,
}

/// Where a token bucket lives: the limiter's name and the bucket's name within it.
///
/// Its text form, the storage key, is `{tb:limiter:name}`: hash-tagged on the name. The memory
/// store looks buckets up by the parts (an integer name as an integer) without building text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketKey<'a> {
    /// The limiter's name (`TokenBucket::new`'s first argument).
    pub limiter: &'static str,
    /// The bucket's name.
    pub name: NameRef<'a>,
}

/// A bucket's name as a store sees it: text, or an integer kept as one.
///
/// An integer and the text of its digits give the same storage key on Redis but different
/// buckets in memory, so one limiter should keep to one name type (a `TokenBucket<N>` does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NameRef<'a> {
    /// A text name.
    Text(&'a str),
    /// A non-negative integer.
    Unsigned(u64),
    /// A negative integer.
    Negative(i64),
}

impl fmt::Display for NameRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NameRef::Text(s) => f.write_str(s),
            NameRef::Unsigned(n) => write!(f, "{n}"),
            NameRef::Negative(n) => write!(f, "{n}"),
        }
    }
}

impl fmt::Display for BucketKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{{tb:{}:{}}}", self.limiter, self.name)
    }
}

/// [`Store::admit_within`] as two calls: the read, then, unless a counter is at its cap, the
/// admission.
pub(crate) async fn read_then_admit<S: Store + ?Sized>(
    store: &S,
    counters: &[PeriodCounter],
    caps: &[u64],
    limits: &[ChainLimit],
    costs: Costs<'_>,
    now: Option<Timestamp>,
) -> Result<(PeriodObservation, Option<Observation>), Error> {
    let read = store.read_periods(counters, now).await?;
    if at_cap(&read, caps) {
        return Ok((read, None));
    }
    let seen = store.admit(limits, costs, now).await?;
    Ok((read, Some(seen)))
}

/// Whether a counter of `read` has reached its cap (`caps`, in the same order): a budget
/// check's refusal. A read that failed open reads as under every cap.
pub(crate) fn at_cap(read: &PeriodObservation, caps: &[u64]) -> bool {
    read.enforced && read.totals.iter().zip(caps).any(|(t, c)| t >= c)
}

/// A place where limit state lives and decisions are taken atomically.
///
/// Every method takes `now`: `Some` pins the clock (tests, replays); `None` asks the store for
/// its own clock (the system clock in memory; the Redis server's `TIME`, so that replicas with
/// skewed clocks still share one). Each call is one round trip.
pub trait Store: Send + Sync {
    /// Admits a request of `costs` against `limits` in one atomic step: reads every limit at one
    /// instant, admits only if every enforced limit passes with its own cost (shadow limits never
    /// refuse: see [`first_refusal`](crate::chain::first_refusal)), and charges each limit
    /// charged at admission ([`Charge::at_admission`](crate::Charge::at_admission)) its cost for
    /// an admitted request, shadow ones included, nothing otherwise. The caller has checked that
    /// the request can ever fit, and that the limits have distinct storage keys
    /// ([`Chain::new`](crate::Chain::new) requires it): with a key twice, the stores may decide
    /// differently.
    fn admit(
        &self,
        limits: &[ChainLimit],
        costs: Costs<'_>,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<Observation, Error>> + Send;

    /// Reads `counters` (each one's total in its period, as [`read_periods`](Self::read_periods))
    /// and then, unless one of them has reached its cap (`caps`, in the same order: the budget
    /// check before an admission), admits a request of `costs` against `limits` as
    /// [`admit`](Self::admit) does. `None` beside the totals: a counter was at its cap, and
    /// nothing was admitted or charged. The read comes first, so the answer is the one the read
    /// and then the admission give; a store may send both as one call (Redis does, sparing a
    /// budget-checked request a round trip: docs/redis.md, "Batching"), the default makes the
    /// two calls. A read that failed open (`enforced: false`) lets the admission go on, as a
    /// budget read as unspent. `limits` must not be empty.
    fn admit_within(
        &self,
        counters: &[PeriodCounter],
        caps: &[u64],
        limits: &[ChainLimit],
        costs: Costs<'_>,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<(PeriodObservation, Option<Observation>), Error>> + Send {
        read_then_admit(self, counters, caps, limits, costs, now)
    }

    /// Adds `units` to every reactive limit of `limits` (limits charged at admission are
    /// skipped), in one atomic step.
    fn record(
        &self,
        limits: &[ChainLimit],
        units: u64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Reconciles a reservation made at `reserved_at`: adds `delta` (actual minus reserved) to
    /// every [`Charge::Reserved`](crate::Charge::Reserved) limit of `limits` (others are
    /// skipped), into the bucket `reserved_at` fell in, as
    /// [`Snapshot::reconciled`](crate::window::Snapshot::reconciled) says, in one atomic step.
    /// Never replayed: an adjustment whose connection dropped fails rather than risk counting
    /// twice.
    fn reconcile(
        &self,
        limits: &[ChainLimit],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Takes `cost` tokens from the bucket at `key` if it holds enough. The caller has checked
    /// that `cost` fits the capacity.
    fn acquire(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<BucketObservation, Error>> + Send;

    /// Deletes the bucket at `key`; says whether it had been used (was not full at `now`).
    fn reset(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Reads each counter's total in its period at `now` (0 for a counter last written in an
    /// earlier period, or never), changing nothing. A store that cannot be reached answers as
    /// an admission would: unchecked (`enforced: false`) when it fails open, else an error.
    fn read_periods(
        &self,
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<PeriodObservation, Error>> + Send;

    /// Adds `amount` to each counter's total in its period at `now` (a counter of an earlier
    /// period starts again from 0), in one atomic step, and keeps each counter until
    /// [`GRACE`](crate::period::GRACE) after its period ends. Never replayed: an add whose
    /// connection dropped fails rather than risk counting twice.
    fn add_periods(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<PeriodObservation, Error>> + Send;

    /// [`add_periods`](Self::add_periods) for a reservation (a decision, which
    /// [`Budgets::reserve`](crate::Budgets::reserve) takes back on a refusal): all or nothing as
    /// far as the store can tell. A store that adds slot by slot (a Redis Cluster) takes back the
    /// slots whose adds landed when another's failed, so that a reservation that failed is
    /// charged to nothing. The default is `add_periods`, atomic on a store that adds in one step.
    fn reserve_periods(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<PeriodObservation, Error>> + Send {
        self.add_periods(counters, amount, now)
    }

    /// Reconciles an amount added at `reserved_at` (a budget's reservation): adds `delta`
    /// (actual minus reserved, signed) to each counter's total in the period `reserved_at` fell
    /// in, never below zero, as [`PeriodState::reconciled`](crate::period::PeriodState::reconciled)
    /// says, each counter in one atomic step. Never replayed, as [`add_periods`](Self::add_periods).
    fn reconcile_periods(
        &self,
        counters: &[PeriodCounter],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// The store's identity in this process beside how many times counts of windows have been
    /// lowered through it and its clones (a refund by [`reconcile`](Self::reconcile), a
    /// [`clear_state`](Self::clear_state)): moved before such a change goes out and again once
    /// it has landed. A refusal cache ([`Chain::cache_refusals`](crate::Chain::cache_refusals),
    /// docs/design.md §11) answers only while this is what it was before its refusal was asked
    /// for, so that no refusal decided before a lowering outlives it, whichever chain lowered,
    /// and no store is answered with another's refusal. One atomic load. A store that never
    /// lowers a count can keep the default, always 0, if a chain is never used on it beside
    /// another such store.
    fn lowered(&self) -> u128 {
        0
    }

    /// The instant a call that pins no time would be decided at now, when the store's clock is
    /// in this process and cheap to read (the memory store's); `None` when it is elsewhere
    /// (Redis's `TIME`), the default. The refusal cache decides on it when it can
    /// (docs/design.md §11).
    fn local_now(&self) -> Option<Timestamp> {
        None
    }

    /// A fresh lease number, never handed out before by this store (nor, on Redis, by any
    /// other process: the store's members carry a random process tag).
    fn lease(&self) -> Lease;

    /// [`admit`](Self::admit), and in the same atomic step a slot in every concurrency limit of
    /// `slots` under `lease`: admits only if every enforced rate limit passes and every enforced
    /// concurrency limit has a free slot (a shadow one takes a slot even when full), and then
    /// charges the rate limits and takes the slots; a refusal takes nothing anywhere. A lease
    /// that already holds a slot (a replayed call) is not counted against itself and takes it
    /// once. The observation's `running` has each limit's requests before this one.
    fn admit_holding(
        &self,
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        costs: Costs<'_>,
        lease: Lease,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<Observation, Error>> + Send;

    /// Gives back `lease`'s slot in every limit of `slots` (a slot not held changes nothing),
    /// and stops renewing it.
    fn release(
        &self,
        slots: &[InFlightLimit],
        lease: Lease,
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// Reads the counts of every window of `limits` and the totals of every counter of
    /// `counters` at `now`, changing nothing: what an admission of cost 0 and a budget check
    /// would see, without the admission's write (no state is created, no expiry pushed back).
    /// For operators (the gateway's usage API), so not one atomic step: the memory store reads
    /// each under its own lock, Redis a thousand keys per script (batched, never a call per
    /// limit), all at the one instant `now` the first script decides. A store that
    /// cannot be reached is an error, whatever its failure mode: an operator is told, not
    /// shown zeros.
    fn read_state(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<StateObservation, Error>> + Send;

    /// Deletes the state of every window of `limits` and every counter of `counters` (an
    /// operator's reset) and answers what each held at `now` before it went, as
    /// [`read_state`](Self::read_state) would have, read and deleted in one step per lock (per
    /// script of a thousand keys on Redis). A decision taken before stays taken (its charge goes
    /// with the state), and what is charged after (a response's tokens or spend finishing
    /// later) lands in the fresh state. Idempotent, so replayed once like a read.
    fn clear_state(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<StateObservation, Error>> + Send;

    /// The requests holding slots of each concurrency limit of `slots` at `now` (live leases
    /// only), changing nothing: for operators (the gateway's usage API). A store that cannot be
    /// reached is an error, as for [`read_state`](Self::read_state).
    fn read_running(
        &self,
        slots: &[InFlightLimit],
        now: Option<Timestamp>,
    ) -> impl Future<Output = Result<Vec<u64>, Error>> + Send;
}

/// What a store keeps for [`Store::lowered`]: the identity of the data it decides on, unique in
/// the process, and a count of the lowerings of counts made through it, shared by its clones
/// and by every store of the process on the same data (the Redis stores a gateway opens per
/// worker: a refund made through one must void the refusals the others remembered). The identity
/// keeps a chain used on two stores of different data from answering one with the other's
/// refusal: both counts may stand at the same number.
#[derive(Debug, Clone)]
pub(crate) struct Lowerings(Arc<SharedLowerings>);

#[derive(Debug)]
pub(crate) struct SharedLowerings {
    store: u64,
    count: std::sync::atomic::AtomicU64,
}

/// The next identity: from 1, as 0 is the trait's default, a store that never lowers a count.
fn next_identity() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Default for Lowerings {
    /// A count of its own: a store whose data no other store of the process holds (a memory
    /// store; its clones share it).
    fn default() -> Self {
        Lowerings(Arc::new(SharedLowerings {
            store: next_identity(),
            count: std::sync::atomic::AtomicU64::new(0),
        }))
    }
}

impl Lowerings {
    /// The count of the data named `data` (a digest of where it lives: a Redis server's or
    /// cluster's addresses and the keys' prefix), shared with every store of the process that
    /// names the same data while one of them lives. Two names that collide only share a count:
    /// more refusals voided, never fewer.
    pub(crate) fn of_data(data: u64) -> Lowerings {
        type Registry = std::sync::Mutex<HashMap<u64, std::sync::Weak<SharedLowerings>>>;
        static REGISTRY: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
        let mut registry = REGISTRY
            .get_or_init(Registry::default)
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(shared) = registry.get(&data).and_then(std::sync::Weak::upgrade) {
            return Lowerings(shared);
        }
        registry.retain(|_, w| w.strong_count() > 0);
        let fresh = Lowerings::default();
        registry.insert(data, Arc::downgrade(&fresh.0));
        fresh
    }

    /// The identity and the count, as one number: read before a decision is asked for, so that
    /// a lowering that lands after is seen to have moved it.
    pub(crate) fn get(&self) -> u128 {
        let count = self.0.count.load(std::sync::atomic::Ordering::Acquire);
        (u128::from(self.0.store) << 64) | u128::from(count)
    }

    /// Moves the count: before a lowering goes out and again once it has landed (or failed).
    pub(crate) fn bump(&self) {
        self.0
            .count
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
}
