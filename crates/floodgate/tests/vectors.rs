//! The shared test vectors on the memory store (tests/redis.rs runs them on Redis).

mod common;

use floodgate::store::MemoryStore;

#[tokio::test]
async fn memory_store_passes_the_shared_vectors() {
    common::run_vectors(&MemoryStore::new()).await;
}

#[tokio::test]
async fn memory_store_passes_the_period_vectors() {
    common::run_period_vectors(&MemoryStore::new()).await;
}
