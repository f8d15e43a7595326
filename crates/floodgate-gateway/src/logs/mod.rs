//! The process's log (docs/design.md §8): `tracing`'s lines in its default format, the request
//! line formatted without `core::fmt` ([`format`]), and every line written to stderr by a thread
//! of its own, many at a time, so that no worker waits on the log ([`writer`]).

pub mod format;
pub mod writer;

pub use format::Lines;
