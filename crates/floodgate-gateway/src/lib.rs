//! The floodgate gateway: an OpenAI-compatible reverse proxy that authenticates callers by key,
//! resolves each key to its scope chain, and enforces request and token limits on the whole chain
//! through the [`floodgate`] library. How it is built, and the flow of one request, is
//! docs/design.md §8.
//!
//! What an embedder (and `floodgate serve`) uses:
//!
//! - [`Config`]: the TOML config, validated with file/line/field errors ([`config`]);
//! - [`store::open`]: the store the config selects;
//! - [`AppState`]: one worker's state; [`app`] (an axum router) or [`run`] (an accept loop)
//!   serve it;
//! - [`server::serve`]: the whole process, with worker threads, signals and draining;
//! - [`tally`]: the refusal tally and its alerts.
//!
//! Embedding the gateway (what `floodgate serve` does, minus worker threads and signals):
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use floodgate_gateway::{AppState, Config};
//!
//! let config = Config::parse_with_env("inline.toml", "[upstream]\ndemo = true\n", None)?;
//! let (store, _sweeper) = floodgate_gateway::store::open(&config.store).await?;
//! let state = AppState::new(&config, store)?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! floodgate_gateway::run(listener, state, std::future::pending()).await?;
//! # Ok(()) }
//! ```
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

// The request pipeline and what it calls, arrows pointing one way (docs/design.md §8):
// server -> http -> (realtime, metering, charge, upstream, ...) -> openai.
mod access_log;
pub mod admin;
pub mod auth;
pub mod buffers;
mod charge;
pub mod config;
pub mod demo;
pub mod error;
pub mod headers;
pub mod http;
pub mod logs;
mod metering;
pub mod metrics;
mod openai;
pub mod pricing;
pub mod realtime;
pub mod reload;
pub mod report;
#[cfg(feature = "rls")]
pub mod rls;
mod send_timed;
pub mod server;
mod slots;
mod stall;
pub mod startup;
pub mod store;
pub mod tally;
mod tls;
pub mod upstream;

pub use charge::Charger;
pub use config::{Config, ConfigError};
pub use http::{AppState, Process, app, route};
pub use server::run;
pub use startup::StartError;
