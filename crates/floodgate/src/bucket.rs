//! The token bucket: pure math and [`Rate`].
//!
//! Each name has a bucket of up to `capacity` tokens, refilled continuously at
//! `tokens / period`, starting full:
//!
//! ```text
//! tokens = min(capacity, tokens + (now - ts) * rate_tokens / rate_period)
//! if cost > capacity:  Denied { retry_after: None }           never succeeds
//! if tokens >= cost:   tokens -= cost; Allowed { remaining: floor(tokens) }
//! else:                Denied { retry_after: ceil_ms((cost - tokens) * period / tokens) }
//! store tokens, ts = now; expire after (capacity - tokens) * period / tokens (full again)
//! ```
//!
//! Tokens are fractional. The memory store keeps the `f64`; the Redis script stores it with 17
//! significant digits, which round-trips every `f64` exactly, and evaluates the same operations
//! in the same order (`store/redis/acquire.lua`).

use std::time::Duration;

use crate::clock::Timestamp;

/// A refill rate: `tokens` every `period`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    tokens: u64,
    period_us: u64,
}

impl Rate {
    /// `tokens` every `period`, refilled continuously.
    ///
    /// # Panics
    ///
    /// If `tokens` is zero, `period` is zero, or `period` is not a whole number of microseconds.
    /// Being a `const fn`, a `const` limiter with a broken rate fails to compile:
    ///
    /// ```compile_fail
    /// use floodgate::{Rate, TokenBucket};
    /// use std::time::Duration;
    ///
    /// const BROKEN: TokenBucket<str> =
    ///     TokenBucket::new("broken", 10, Rate::new(0, Duration::from_secs(1)));
    /// # let _ = &BROKEN;
    /// ```
    pub const fn new(tokens: u64, period: Duration) -> Self {
        assert!(tokens > 0, "a rate needs at least one token per period");
        let micros = period.as_micros();
        assert!(micros > 0, "a rate's period must not be zero");
        assert!(
            period.subsec_nanos().is_multiple_of(1_000),
            "a rate's period must be whole microseconds"
        );
        assert!(micros <= u64::MAX as u128, "a rate's period is too long");
        Rate {
            tokens,
            period_us: micros as u64,
        }
    }

    /// `n` tokens per second.
    ///
    /// # Panics
    ///
    /// If `n` is zero.
    pub const fn per_second(n: u64) -> Self {
        Self::new(n, Duration::from_secs(1))
    }

    /// Tokens added per period.
    pub const fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The period, in microseconds.
    pub const fn period_micros(&self) -> u64 {
        self.period_us
    }

    /// Tokens refilled over `micros` microseconds.
    #[inline]
    fn refill(&self, micros: f64) -> f64 {
        // Keep in step with store/redis/acquire.lua: multiply first, then divide.
        micros * self.tokens as f64 / self.period_us as f64
    }

    /// Microseconds needed to refill `tokens` tokens.
    #[inline]
    fn time_for(&self, tokens: f64) -> f64 {
        tokens * self.period_us as f64 / self.tokens as f64
    }
}

/// The answer to a token-bucket request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// The tokens were taken; `remaining` whole tokens are left.
    Allowed {
        /// Whole tokens left in the bucket.
        remaining: u64,
    },
    /// Nothing was taken.
    Denied {
        /// How long until the same request would be allowed with no other traffic, rounded up to
        /// the millisecond; `None` if it never can (`cost > capacity`).
        retry_after: Option<Duration>,
    },
}

impl Admission {
    /// Whether the request was allowed.
    pub fn is_allowed(&self) -> bool {
        matches!(self, Admission::Allowed { .. })
    }
}

/// The stored state of one bucket.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketState {
    /// Tokens in the bucket at `ts` (fractional).
    pub tokens: f64,
    /// When the state was written.
    pub ts: Timestamp,
}

/// The longest a bucket's state is kept (2^52 µs, about 142 years): an absurdly slow rate's
/// time to full again is cut to it, so that the expiry still fits the Redis script's integers
/// (Lua's `%d` is an i64, its numbers exact to 2^53) and both stores expire alike.
pub const MAX_TTL_MICROS: u64 = 1 << 52;

/// The parameters of one bucket: capacity and refill rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketLimit {
    /// The most tokens the bucket holds; it starts full.
    pub capacity: u64,
    /// How fast it refills.
    pub rate: Rate,
}

impl BucketLimit {
    /// Tokens in a bucket with stored `state` (none: full) at `now`.
    #[inline]
    pub fn tokens_at(&self, state: Option<BucketState>, now: Timestamp) -> f64 {
        let capacity = self.capacity as f64;
        match state {
            None => capacity,
            Some(s) => {
                let elapsed = now.as_micros().saturating_sub(s.ts.as_micros()) as f64;
                capacity.min(s.tokens + self.rate.refill(elapsed))
            }
        }
    }

    /// When a bucket with stored `state` (none: full) is written back by a decision at `now`:
    /// `now`, or the stored state's own time if that is later. A clock behind the one that
    /// wrote the state refills nothing (`tokens_at` counts no time back), and must not move the
    /// state's time back either: the clock ahead would then refill that interval a second
    /// time, and two clocks taking turns would mint tokens without end (docs/design.md §3).
    #[inline]
    pub fn written_at(state: Option<BucketState>, now: Timestamp) -> Timestamp {
        state.map_or(now, |s| s.ts.max(now))
    }

    /// Whether `cost` tokens can ever be taken at once.
    pub fn fits(&self, cost: u64) -> bool {
        cost <= self.capacity
    }

    /// Takes `cost` tokens from a bucket holding `tokens` if there are enough. Returns whether
    /// they were taken and the tokens left. The caller has checked [`fits`](Self::fits).
    #[inline]
    pub fn take(&self, tokens: f64, cost: u64) -> (bool, f64) {
        let cost = cost as f64;
        if tokens >= cost {
            (true, tokens - cost)
        } else {
            (false, tokens)
        }
    }

    /// The answer for a request of `cost` tokens that found `before` and left `after` tokens.
    pub fn admission(&self, allowed: bool, after: f64, cost: u64) -> Admission {
        if allowed {
            // `after` is never negative, so truncation is floor, without a libm call.
            return Admission::Allowed {
                remaining: after as u64,
            };
        }
        if !self.fits(cost) {
            return Admission::Denied { retry_after: None };
        }
        let needed = cost as f64 - after;
        let mut millis = (self.rate.time_for(needed) / 1_000.0).ceil().max(0.0) as u64;
        // Rounding may leave the refill a hair short of `cost` at the rounded time; the answer
        // must be a time at which the request does pass.
        // (Bounded: a wait past u64::MAX µs, from an absurdly slow rate, stops there.)
        while millis < u64::MAX / 1_000
            && after + self.rate.refill((millis * 1_000) as f64) < cost as f64
        {
            millis += 1;
        }
        Admission::Denied {
            retry_after: Some(Duration::from_millis(millis)),
        }
    }

    /// How long a bucket left with `tokens` takes to be full again: its state may be dropped
    /// then, since a missing bucket reads as full. At most [`MAX_TTL_MICROS`] (an absurdly slow
    /// rate's time to full would not fit the scripts' integers).
    #[inline]
    pub fn ttl_micros(&self, tokens: f64) -> u64 {
        let missing = self.capacity as f64 - tokens;
        if missing <= 0.0 {
            return 0;
        }
        // Ceiling of a positive value by truncation: no libm call on the hot path.
        let micros = self.rate.time_for(missing);
        if micros >= MAX_TTL_MICROS as f64 {
            return MAX_TTL_MICROS;
        }
        let whole = micros as u64;
        if (whole as f64) < micros {
            whole + 1
        } else {
            whole
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGIN: BucketLimit = BucketLimit {
        capacity: 20,
        rate: Rate::new(1, Duration::from_secs(3)),
    };

    #[test]
    fn an_absurdly_slow_rate_answers_a_wait_instead_of_spinning() {
        let slow = BucketLimit {
            capacity: 1,
            rate: Rate::new(1, Duration::from_micros(u64::MAX)),
        };
        let (ok, left) = slow.take(0.0, 1);
        assert!(!ok);
        let Admission::Denied {
            retry_after: Some(wait),
        } = slow.admission(ok, left, 1)
        else {
            panic!("a request that fits the capacity gets a wait");
        };
        assert!(wait >= Duration::from_secs(1 << 40), "{wait:?}");
    }

    #[test]
    fn refill_is_continuous_and_capped() {
        let s = Some(BucketState {
            tokens: 0.0,
            ts: Timestamp::from_secs(100),
        });
        assert_eq!(LOGIN.tokens_at(s, Timestamp::from_secs(103)), 1.0);
        assert_eq!(LOGIN.tokens_at(s, Timestamp::from_millis(101_500)), 0.5);
        assert_eq!(LOGIN.tokens_at(s, Timestamp::from_secs(1_000)), 20.0);
        assert_eq!(LOGIN.tokens_at(None, Timestamp::from_secs(1)), 20.0);
    }

    #[test]
    fn denial_waits_for_the_missing_tokens() {
        let (ok, left) = LOGIN.take(0.5, 1);
        assert!(!ok);
        assert_eq!(
            LOGIN.admission(ok, left, 1),
            Admission::Denied {
                retry_after: Some(Duration::from_millis(1500))
            }
        );
        assert_eq!(
            LOGIN.admission(false, 20.0, 21),
            Admission::Denied { retry_after: None }
        );
    }

    #[test]
    fn ttl_is_the_time_to_full() {
        assert_eq!(LOGIN.ttl_micros(0.0), 60_000_000);
        assert_eq!(LOGIN.ttl_micros(20.0), 0);
        let absurd = BucketLimit {
            capacity: 2,
            rate: Rate::new(1, Duration::from_micros(u64::MAX)),
        };
        // 2^65 µs to full: kept for the longest a state is kept, not wrapped to nothing.
        assert_eq!(absurd.ttl_micros(0.0), MAX_TTL_MICROS);
    }

    #[test]
    fn per_second() {
        assert_eq!(Rate::per_second(7).tokens(), 7);
        assert_eq!(Rate::per_second(7).period_micros(), 1_000_000);
    }
}
