//! The floodgate gateway: an OpenAI-compatible reverse proxy that authenticates callers by key,
//! resolves each key to its scope chain, and enforces request and token limits on the whole chain
//! through the [`floodgate`] library.
//!
//! - [`config`]: the TOML config, validated with file/line/field errors;
//! - [`auth`]: bearer secret -> key -> precomputed chain;
//! - [`app`]: the router and the server loop;
//! - [`server`]: the process: worker threads, store, signals, draining;
//! - [`proxy`]: forwarding, streaming both ways;
//! - [`metering`]: tokens from JSON bodies and event streams, charged after the response;
//! - [`headers`]: rate-limit response headers;
//! - [`demo`]: the built-in demo upstream;
//! - [`error`]: OpenAI-style errors;
//! - [`store`]: the store selected by the config.
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod app;
pub mod auth;
pub mod config;
pub mod demo;
pub mod error;
pub mod headers;
pub mod metering;
pub mod proxy;
pub mod server;
pub mod store;

pub use app::{AppState, app, run};
pub use config::{Config, ConfigError};
