//! Why the gateway could not start (or could not stop cleanly): one typed error for the
//! process, its workers and the state each worker builds. `floodgate serve` prints it and exits
//! non-zero.

use std::net::SocketAddr;
use std::time::Duration;

/// What stopped the gateway from starting, or made its stop unclean.
#[derive(Debug)]
pub enum StartError {
    /// A runtime (the background one, or a worker's event loop) could not be built.
    Runtime(std::io::Error),
    /// The signal handlers could not be installed.
    Signals(std::io::Error),
    /// A worker thread could not be spawned, or died before it said whether it listens.
    Worker(String),
    /// The listen address could not be bound.
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The store could not be opened.
    Store(floodgate::Error),
    /// The upstream could not be set up (its API key's variable, its address, its TLS).
    Upstream(String),
    /// The refusal tally's file or Redis client could not be opened.
    Tally(String),
    /// A worker's server loop failed.
    Server(std::io::Error),
    /// The drain did not finish in time: requests in flight were cut.
    DrainTimedOut(Duration),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Runtime(e) => write!(f, "cannot start the runtime: {e}"),
            StartError::Signals(e) => write!(f, "cannot install the signal handlers: {e}"),
            StartError::Worker(why) => f.write_str(why),
            StartError::Listen { addr, source } => write!(f, "cannot listen on {addr}: {source}"),
            StartError::Store(e) => write!(f, "cannot open the store: {e}"),
            StartError::Upstream(why) | StartError::Tally(why) => f.write_str(why),
            StartError::Server(e) => write!(f, "server failed: {e}"),
            StartError::DrainTimedOut(t) => write!(
                f,
                "drain timed out after {} s: exiting with requests still in flight",
                t.as_secs()
            ),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StartError::Runtime(e)
            | StartError::Signals(e)
            | StartError::Server(e)
            | StartError::Listen { source: e, .. } => Some(e),
            StartError::Store(e) => Some(e),
            _ => None,
        }
    }
}
