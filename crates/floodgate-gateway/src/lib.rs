//! The floodgate gateway.
