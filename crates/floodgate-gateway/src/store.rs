//! The store the gateway decides on, selected at start from `[store] backend`.
//!
//! A small enum over the library's stores, so that the rest of the gateway is not generic: one
//! `match` per call is cheaper than it reads, and far simpler than threading a type parameter
//! through every handler.

use floodgate::bucket::BucketLimit;
use floodgate::chain::ChainLimit;
use floodgate::store::{BucketObservation, MemoryStore, Observation, Store, SweeperGuard};
use floodgate::{Error, Timestamp};
use std::time::Duration;

use crate::config::{Backend, StoreConfig};

/// The gateway's store: cheap to clone (clones share state).
#[derive(Clone, Debug)]
pub enum GatewayStore {
    /// The embedded store.
    Memory(MemoryStore),
}

/// Keeps a store's background work (the memory store's sweeper) alive; drop it on shutdown.
#[derive(Debug)]
pub struct StoreGuard {
    _sweeper: Option<SweeperGuard>,
}

impl GatewayStore {
    /// Opens the store `config` names. The memory store gets a sweeper that runs while the
    /// returned guard lives.
    pub async fn open(config: &StoreConfig) -> Result<(GatewayStore, StoreGuard), Error> {
        match config.backend {
            Backend::Memory => {
                let store = MemoryStore::new();
                let sweeper = store.spawn_sweeper(Duration::from_secs(30));
                Ok((
                    GatewayStore::Memory(store),
                    StoreGuard {
                        _sweeper: Some(sweeper),
                    },
                ))
            }
            Backend::Redis => Err(Error::Unavailable(
                "this build of the gateway has no Redis store yet".into(),
            )),
        }
    }

    /// Whether the store answers (always, in memory).
    pub async fn ping(&self) -> Result<(), Error> {
        match self {
            GatewayStore::Memory(_) => Ok(()),
        }
    }

    /// A short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            GatewayStore::Memory(_) => "memory",
        }
    }
}

impl Store for GatewayStore {
    async fn admit(
        &self,
        limits: &[ChainLimit],
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<Observation, Error> {
        match self {
            GatewayStore::Memory(s) => s.admit(limits, cost, now).await,
        }
    }

    async fn record(
        &self,
        limits: &[ChainLimit],
        units: u64,
        now: Option<Timestamp>,
    ) -> Result<(), Error> {
        match self {
            GatewayStore::Memory(s) => s.record(limits, units, now).await,
        }
    }

    async fn acquire(
        &self,
        key: &str,
        limit: BucketLimit,
        cost: u64,
        now: Option<Timestamp>,
    ) -> Result<BucketObservation, Error> {
        match self {
            GatewayStore::Memory(s) => s.acquire(key, limit, cost, now).await,
        }
    }

    async fn reset(
        &self,
        key: &str,
        limit: BucketLimit,
        now: Option<Timestamp>,
    ) -> Result<bool, Error> {
        match self {
            GatewayStore::Memory(s) => s.reset(key, limit, now).await,
        }
    }
}
