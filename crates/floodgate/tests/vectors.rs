//! The shared test vectors on the memory store (tests/redis.rs runs them on Redis).

mod common;

use floodgate::store::MemoryStore;

#[tokio::test]
async fn memory_store_passes_the_shared_vectors() {
    common::run_vectors(&MemoryStore::new()).await;
}

#[tokio::test]
async fn charges_made_without_a_future_land_once_each_on_memory() {
    common::run_charge_then(&MemoryStore::new().into()).await;
}

#[tokio::test]
async fn a_cached_refusal_on_memory_is_the_stores_own() {
    common::run_refusal_cache_sweep(&MemoryStore::new()).await;
}

#[tokio::test]
async fn a_budget_checked_admission_on_memory_is_the_check_then_the_admission() {
    common::run_admit_within(&MemoryStore::new(), "org:acme").await;
}

#[tokio::test]
async fn memory_store_passes_the_period_vectors() {
    common::run_period_vectors(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_races_past_a_shadow_limit_and_charges_it() {
    common::race_past_a_shadow_limit(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_gives_concurrent_reservations_exactly_the_free_tokens() {
    common::race_reserved_tokens(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_reserves_budgets_exactly() {
    common::race_reserved_budget(MemoryStore::new(), "org:race").await;
}

#[tokio::test]
async fn memory_store_reserves_tokens_while_holding_slots() {
    common::run_reserved_holding(&MemoryStore::new()).await;
}

#[tokio::test]
async fn memory_store_passes_the_concurrency_vectors() {
    common::run_in_flight_vectors(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_gives_concurrent_requests_exactly_the_free_slots() {
    common::race_for_slots(MemoryStore::new()).await;
}

#[tokio::test]
async fn state_read_and_clear_on_memory() {
    let store = MemoryStore::new();
    common::run_state_read_and_clear(&store).await;
    // Reads wrote nothing: the store holds the two windows admitted since the clear, and the
    // token window the clear emptied, whose cell its limit remembers (docs/design.md §2).
    assert_eq!(store.len(), 3);
}
