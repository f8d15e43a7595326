//! A small deterministic generator for the property tests of this module's readers (xorshift64):
//! the same cases on every run, so a failure reproduces.

/// xorshift64 from a non-zero seed.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    /// The next value.
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value below `n`.
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// One of `of`.
    pub(super) fn pick<'a>(&mut self, of: &[&'a str]) -> &'a str {
        of[self.below(of.len())]
    }
}
