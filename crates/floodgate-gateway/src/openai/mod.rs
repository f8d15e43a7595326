//! The OpenAI-compatible protocol, as far as the gateway reads it: request paths, request
//! rewriting, usage in bodies, streams and Realtime events, the event-stream filter and
//! WebSocket frames.
//!
//! A leaf: nothing here imports the rest of the crate, nothing is async, and every function is
//! unit-tested beside it. The pipeline (`http`), metering and realtime call into it.

pub mod frames;
mod json;
pub mod paths;
pub mod realtime;
pub mod request;
#[cfg(test)]
mod rng;
pub mod sse;
pub mod usage;
