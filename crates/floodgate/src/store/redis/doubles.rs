//! The step script's numbers, sent as one argument of little-endian doubles and replied as one
//! string of them (admit.lua): an argument as a string costs Redis an object and the script a
//! `tonumber`, and redis-rs parses a reply of integers at about 1 500 instructions each; a string
//! of doubles costs either side a few instructions a number (docs/redis.md, "Batching").

use super::conn::{Failure, bad_reply};
use crate::window::MAX_COUNT;

/// Numbers packed for the script, in the order it reads them.
#[derive(Debug, Default)]
pub(super) struct Doubles(Vec<u8>);

impl Doubles {
    /// Room for `n` numbers.
    pub(super) fn with_capacity(n: usize) -> Doubles {
        Doubles(Vec::with_capacity(8 * n))
    }

    /// Appends `n`: exact up to 2^53, as every count, index and duration sent is; a larger one
    /// (a cap, a charge's units) rounds to the nearest double, as the script's `tonumber` of its
    /// digits did, and compares and saturates alike.
    pub(super) fn push(&mut self, n: u64) -> &mut Doubles {
        // `as` rounds to the nearest double.
        self.0.extend_from_slice(&(n as f64).to_le_bytes());
        self
    }

    /// Appends a length or an index.
    pub(super) fn push_len(&mut self, n: usize) -> &mut Doubles {
        self.push(u64::try_from(n).unwrap_or(u64::MAX))
    }

    /// Appends a number that is not a count (the marker -1).
    pub(super) fn push_signed(&mut self, n: i64) -> &mut Doubles {
        self.0.extend_from_slice(&(n as f64).to_le_bytes());
        self
    }

    /// How many numbers it holds.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.0.len() / 8
    }

    /// The packed bytes: the script's `ARGV[2]`.
    pub(super) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The values of a script's reply packed as doubles, each a whole number from 0 to 2^53 (counts
/// stop there: window.rs `MAX_COUNT`), as integers.
pub(super) fn read(reply: &::redis::Value) -> Result<Vec<u64>, Failure> {
    let ::redis::Value::BulkString(bytes) = reply else {
        return Err(bad_reply());
    };
    if bytes.len() % 8 != 0 {
        return Err(bad_reply());
    }
    bytes
        .chunks_exact(8)
        .map(|b| {
            let v = f64::from_le_bytes(b.try_into().map_err(|_| bad_reply())?);
            // `as` is exact for a whole number in this range; anything else is no count.
            if (0.0..=MAX_COUNT as f64).contains(&v) && v.fract() == 0.0 {
                Ok(v as u64)
            } else {
                Err(bad_reply())
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_go_out_as_doubles_and_come_back_exact() {
        let mut d = Doubles::default();
        d.push(0).push(MAX_COUNT).push(1_796_405_056_585_544);
        d.push_signed(-1);
        assert_eq!(d.len(), 4);
        let back: Vec<f64> = d
            .bytes()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(back, [0.0, MAX_COUNT as f64, 1_796_405_056_585_544.0, -1.0]);
        // What the script replies, read back.
        let mut reply = Doubles::default();
        reply.push(7).push(MAX_COUNT);
        let got = read(&::redis::Value::BulkString(reply.bytes().to_vec()));
        assert_eq!(got.ok(), Some(vec![7, MAX_COUNT]));
        // u64::MAX goes out as tonumber("18446744073709551615") reads it.
        let mut big = Doubles::default();
        big.push(u64::MAX);
        assert_eq!(big.bytes(), 18_446_744_073_709_551_615_f64.to_le_bytes());
    }
}
