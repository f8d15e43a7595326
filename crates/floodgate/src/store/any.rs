//! A store chosen at run time: the gateway's configuration names the backend.

use super::redis::RedisStore;
use super::{
    BucketKey, BucketObservation, MemoryStore, Observation, PeriodObservation, Spent,
    StateObservation, Store,
};
use crate::Error;
use crate::bucket::BucketLimit;
use crate::chain::{ChainLimit, Costs};
use crate::clock::Timestamp;
use crate::in_flight::{InFlightLimit, Lease};
use crate::period::PeriodCounter;

/// Either store, picked at run time; every call is delegated to the one it holds.
///
/// ```
/// use floodgate::store::{AnyStore, MemoryStore};
///
/// let store: AnyStore = MemoryStore::new().into();
/// assert!(matches!(store, AnyStore::Memory(_)));
/// ```
#[derive(Clone, Debug)]
pub enum AnyStore {
    /// The embedded store: one process.
    Memory(MemoryStore),
    /// The Redis store: every replica shares it.
    Redis(RedisStore),
}

impl From<MemoryStore> for AnyStore {
    fn from(store: MemoryStore) -> Self {
        AnyStore::Memory(store)
    }
}

impl From<RedisStore> for AnyStore {
    fn from(store: RedisStore) -> Self {
        AnyStore::Redis(store)
    }
}

impl AnyStore {
    /// Charges what a served request cost after the fact ([`Spent`]), without a future, each
    /// part once, and calls `landed` with the outcome once the store has them: at once in
    /// memory ([`MemoryStore::charge_then`]), once the next call has answered on Redis
    /// ([`RedisStore::charge_then`], where `landed` must be quick).
    pub fn charge_then<F>(&self, spent: Spent<'_>, landed: F)
    where
        F: FnOnce(Result<(), Error>) + Send + 'static,
    {
        match self {
            AnyStore::Memory(s) => s.charge_then(spent, landed),
            AnyStore::Redis(s) => s.charge_then(spent, landed),
        }
    }
}

impl Store for AnyStore {
    fn lowered(&self) -> u128 {
        match self {
            AnyStore::Memory(s) => s.lowered(),
            AnyStore::Redis(s) => s.lowered(),
        }
    }

    fn local_now(&self) -> Option<Timestamp> {
        match self {
            AnyStore::Memory(s) => s.local_now(),
            AnyStore::Redis(s) => s.local_now(),
        }
    }

    async fn admit(
        &self,
        limits: &[ChainLimit],
        cost: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Result<Observation, Error> {
        match self {
            AnyStore::Memory(s) => s.admit(limits, cost, now).await,
            AnyStore::Redis(s) => s.admit(limits, cost, now).await,
        }
    }

    async fn admit_within(
        &self,
        counters: &[PeriodCounter],
        caps: &[u64],
        limits: &[ChainLimit],
        cost: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Result<(PeriodObservation, Option<Observation>), Error> {
        match self {
            AnyStore::Memory(s) => s.admit_within(counters, caps, limits, cost, now).await,
            AnyStore::Redis(s) => s.admit_within(counters, caps, limits, cost, now).await,
        }
    }

    async fn record(
        &self,
        limits: &[ChainLimit],
        units: u64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        match self {
            AnyStore::Memory(s) => s.record(limits, units, now).await,
            AnyStore::Redis(s) => s.record(limits, units, now).await,
        }
    }

    async fn reconcile_periods(
        &self,
        counters: &[PeriodCounter],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        match self {
            AnyStore::Memory(s) => s.reconcile_periods(counters, reserved_at, delta, now).await,
            AnyStore::Redis(s) => s.reconcile_periods(counters, reserved_at, delta, now).await,
        }
    }

    async fn reconcile(
        &self,
        limits: &[ChainLimit],
        reserved_at: Timestamp,
        delta: i64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        match self {
            AnyStore::Memory(s) => s.reconcile(limits, reserved_at, delta, now).await,
            AnyStore::Redis(s) => s.reconcile(limits, reserved_at, delta, now).await,
        }
    }

    async fn acquire(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<BucketObservation, Error> {
        match self {
            AnyStore::Memory(s) => s.acquire(key, limit, cost, now).await,
            AnyStore::Redis(s) => s.acquire(key, limit, cost, now).await,
        }
    }

    async fn reset(
        &self,
        key: BucketKey<'_>,
        limit: BucketLimit,
        now: Option<Timestamp>,
    ) -> Result<bool, Error> {
        match self {
            AnyStore::Memory(s) => s.reset(key, limit, now).await,
            AnyStore::Redis(s) => s.reset(key, limit, now).await,
        }
    }

    async fn read_periods(
        &self,
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Error> {
        match self {
            AnyStore::Memory(s) => s.read_periods(counters, now).await,
            AnyStore::Redis(s) => s.read_periods(counters, now).await,
        }
    }

    async fn add_periods(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Error> {
        match self {
            AnyStore::Memory(s) => s.add_periods(counters, amount, now).await,
            AnyStore::Redis(s) => s.add_periods(counters, amount, now).await,
        }
    }

    async fn reserve_periods(
        &self,
        counters: &[PeriodCounter],
        amount: u64,
        now: Option<Timestamp>,
    ) -> Result<PeriodObservation, Error> {
        match self {
            AnyStore::Memory(s) => s.reserve_periods(counters, amount, now).await,
            AnyStore::Redis(s) => s.reserve_periods(counters, amount, now).await,
        }
    }

    fn lease(&self) -> Lease {
        match self {
            AnyStore::Memory(s) => s.lease(),
            AnyStore::Redis(s) => s.lease(),
        }
    }

    async fn admit_holding(
        &self,
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        cost: Costs<'_>,
        lease: Lease,
        now: Option<Timestamp>,
    ) -> Result<Observation, Error> {
        match self {
            AnyStore::Memory(s) => s.admit_holding(limits, slots, cost, lease, now).await,
            AnyStore::Redis(s) => s.admit_holding(limits, slots, cost, lease, now).await,
        }
    }

    async fn release(
        &self,
        slots: &[InFlightLimit],
        lease: Lease,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        match self {
            AnyStore::Memory(s) => s.release(slots, lease, now).await,
            AnyStore::Redis(s) => s.release(slots, lease, now).await,
        }
    }

    async fn read_state(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<StateObservation, Error> {
        match self {
            AnyStore::Memory(s) => s.read_state(limits, counters, now).await,
            AnyStore::Redis(s) => s.read_state(limits, counters, now).await,
        }
    }

    async fn clear_state(
        &self,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<StateObservation, Error> {
        match self {
            AnyStore::Memory(s) => s.clear_state(limits, counters, now).await,
            AnyStore::Redis(s) => s.clear_state(limits, counters, now).await,
        }
    }

    async fn read_running(
        &self,
        slots: &[InFlightLimit],
        now: Option<Timestamp>,
    ) -> Result<Vec<u64>, Error> {
        match self {
            AnyStore::Memory(s) => s.read_running(slots, now).await,
            AnyStore::Redis(s) => s.read_running(slots, now).await,
        }
    }
}
