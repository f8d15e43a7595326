//! The floodgate gateway: an OpenAI-compatible reverse proxy that authenticates callers by key,
//! resolves each key to its scope chain, and enforces request and token limits on the whole chain
//! through the [`floodgate`] library.
//!
//! - [`config`]: the TOML config, validated with file/line/field errors;
//! - [`auth`]: bearer secret -> key -> precomputed chain;
//! - [`app`](mod@app): the router and the server loop;
//! - [`server`]: the process: worker threads, store, signals, draining;
//! - [`proxy`]: forwarding, streaming both ways, over TLS to `https://` upstreams;
//! - [`metering`]: tokens from JSON bodies and event streams, charged after the response;
//! - [`budgets`]: spend caps per scope per day or month, priced per model;
//! - [`realtime`]: Realtime API WebSocket sessions, their cap and their token meter;
//! - [`headers`]: rate-limit response headers;
//! - [`demo`]: the built-in demo upstream;
//! - [`error`]: OpenAI-style errors;
//! - [`store`]: the store selected by the config;
//! - [`tally`]: the refusal tally and `/alerts`.
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

pub mod app;
pub mod auth;
pub mod budgets;
pub mod config;
pub mod demo;
pub mod error;
pub mod headers;
pub mod metering;
pub mod proxy;
pub mod realtime;
pub mod server;
pub mod store;
pub mod tally;
mod tls;

pub use app::{AppState, app, run};
pub use config::{Config, ConfigError};
