//! The `floodgate` binary.
fn main() {}
