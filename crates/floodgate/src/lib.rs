//! floodgate: rate limits that hold across every replica of a service.
//!
//! Two limiters, each decided in one atomic step on a [`Store`](store::Store):
//!
//! - a [`Chain`] of sliding-window limits over scopes (key, project, team, business unit, org,
//!   customer, gateway): a request passes only if every limit passes, is charged to all or none,
//!   and a refusal carries the exact time at which the same request would pass;
//! - a [`TokenBucket`] per name, with a [`Rate`] checked at compile time;
//! - [`InFlightLimit`]s in a chain: how many requests of a scope run at once, slots taken in the
//!   chain's atomic step and given back when the request is done ([`in_flight`]);
//! - [`Budgets`]: caps on what a scope spends per calendar day or month ([`period`]), read
//!   before a request and charged after it.
//!
//! Stores: the embedded [`MemoryStore`](store::MemoryStore) (one process, the default) and, with
//! the `redis` feature, [`RedisStore`](store::redis::RedisStore), where many replicas share one
//! truth. The math lives in pure functions ([`window`], [`bucket`], [`chain`]) that both stores
//! apply identically.
//!
//! For HTTP services: with the `http` feature, `floodgate::http` writes a decision as
//! response headers (`X-RateLimit-*`, the IETF `RateLimit` fields, OpenAI's
//! `x-ratelimit-*`, `Retry-After`), as the floodgate gateway sends them; with the `tower`
//! feature, `floodgate::tower::RateLimitLayer` limits any tower service
//! (axum, tonic, hyper) per name or per chain of names, and answers refusals with 429 (a gRPC
//! call's with `RESOURCE_EXHAUSTED`).
//!
//! ```
//! use floodgate::{Admission, Rate, TokenBucket};
//! use floodgate::store::MemoryStore;
//!
//! const API: TokenBucket<u64> = TokenBucket::new("api", 2, Rate::per_second(1));
//!
//! # async fn demo() -> Result<(), floodgate::Error> {
//! let store = MemoryStore::new();
//! let user = 42;
//! assert!(API.acquire(&store, &user, 1).await?.is_allowed());
//! assert!(API.acquire(&store, &user, 1).await?.is_allowed());
//! assert!(matches!(API.acquire(&store, &user, 1).await?, Admission::Denied { .. }));
//! # Ok(()) }
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
//! ```
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod bucket;
pub mod budget;
mod cell;
pub mod chain;
pub mod clock;
mod error;
#[cfg(feature = "http")]
pub mod http;
pub mod in_flight;
mod limiter;
pub mod period;
mod refusals;
mod spare;
pub mod store;
#[cfg(feature = "tower")]
pub mod tower;
pub mod window;

pub use bucket::{Admission, Rate};
pub use budget::{Budget, BudgetDecision, Budgets};
pub use chain::{ChainDecision, ChainLimit, LimitStatus, ScopeKind};
pub use clock::Timestamp;
pub use error::Error;
pub use in_flight::{InFlightLimit, InFlightStatus, Lease};
pub use limiter::{BucketName, Chain, TokenBucket};
pub use period::{Period, PeriodCounter};
pub use window::{Charge, WindowLimit};

/// The README's examples, compiled (and the library's run) as doctests: with every feature they
/// use (`cargo test --all-features`, as scripts/test runs them).
#[doc = include_str!("../../../README.md")]
#[cfg(all(doctest, feature = "tower", feature = "redis"))]
pub struct ReadmeDoctests;
