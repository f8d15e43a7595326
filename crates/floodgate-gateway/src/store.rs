//! The store the gateway decides on, selected at start from `[store] backend`: the library's
//! [`AnyStore`], so that the rest of the gateway is not generic over the store.

use std::time::Duration;

use floodgate::Error;
use floodgate::store::redis::{OnError as RedisOnError, RedisConfig, RedisStore};
use floodgate::store::{AnyStore, MemoryStore, SweeperGuard};

use crate::config::{Backend, OnError, StoreConfig};

/// The gateway's store: cheap to clone (clones share state).
pub type GatewayStore = AnyStore;

/// How often the memory store sweeps expired state.
const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// Keeps a store's background work (the memory store's sweeper) alive; drop it on shutdown.
#[derive(Debug)]
pub struct StoreGuard {
    _sweeper: Option<SweeperGuard>,
}

/// Opens the store `config` names.
///
/// The memory store gets a sweeper that runs while the returned guard lives. A Redis store
/// that cannot be reached yet is not an error: it starts with its circuit breaker open, applies
/// `on_error`, and connects as soon as Redis answers (`/readyz` says when); only a malformed URL
/// fails here.
pub async fn open(config: &StoreConfig) -> Result<(GatewayStore, StoreGuard), Error> {
    match config.backend {
        Backend::Memory => {
            let store = MemoryStore::new();
            let sweeper = store.spawn_sweeper(SWEEP_INTERVAL);
            let guard = StoreGuard {
                _sweeper: Some(sweeper),
            };
            Ok((AnyStore::Memory(store), guard))
        }
        Backend::Redis | Backend::RedisCluster => {
            let mut redis = if config.backend == Backend::RedisCluster {
                RedisConfig::cluster(config.urls.iter().cloned())
            } else {
                let url = config
                    .url
                    .clone()
                    .ok_or_else(|| Error::Backend("the redis backend needs a URL".into()))?;
                RedisConfig::new(url)
            };
            redis.on_error = match config.on_error {
                OnError::Open => RedisOnError::Open,
                OnError::Closed => RedisOnError::Closed,
            };
            if let Some(prefix) = &config.prefix {
                redis.prefix = prefix.clone();
            }
            redis.lease = config.lease;
            let store = RedisStore::connect(redis).await?;
            Ok((AnyStore::Redis(store), StoreGuard { _sweeper: None }))
        }
    }
}

/// Whether the store can decide now (always, in memory): for `/readyz`.
pub async fn ping(store: &GatewayStore) -> Result<(), Error> {
    match store {
        AnyStore::Memory(_) => Ok(()),
        AnyStore::Redis(r) => r.ready().await,
    }
}

/// A short name for logs.
pub fn name(store: &GatewayStore) -> &'static str {
    match store {
        AnyStore::Memory(_) => "memory",
        AnyStore::Redis(r) if r.is_cluster() => "redis-cluster",
        AnyStore::Redis(_) => "redis",
    }
}

/// The short name of a configured backend, for logs.
pub fn backend_name(backend: Backend) -> &'static str {
    backend.name()
}
