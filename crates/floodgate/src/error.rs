//! Errors: for backends failing, never for being refused.

use std::fmt;

/// What can go wrong talking to a store. Being refused is not an error: it is a decision.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The store could not be reached, timed out, or is behind an open circuit breaker, and the
    /// store is configured to fail closed (or the operation has no fail-open answer).
    Unavailable(String),
    /// The store answered with an error or something this version cannot read.
    Backend(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Unavailable(why) => write!(f, "rate-limit store unavailable: {why}"),
            Error::Backend(why) => write!(f, "rate-limit store error: {why}"),
        }
    }
}

impl std::error::Error for Error {}
