//! The sliding-window counter: pure functions of (stored state, now, limit).
//!
//! A window of `W` microseconds is split into fixed buckets aligned to the epoch. With `cur` the
//! count in the current bucket, `prev` the count in the one before and `e` the time elapsed in
//! the current bucket, the estimate of the units in the last `W` is
//!
//! ```text
//! estimate = cur + prev * (W - e) / W
//! ```
//!
//! A limit charged at admission admits a request of `cost` units iff `estimate + cost <= max`; a
//! reactive limit (tokens, known only after the response) admits iff `estimate < max`.
//!
//! # Exactness and the Redis scripts
//!
//! The admission test is evaluated as `(cur + cost - max) * W + prev * (W - e) <= 0` in `f64`:
//! the same four IEEE operations in the same order as `store/redis/admit.lua`, so both stores
//! reach the same decision bit for bit. Every term is an integer, so the test is exact while the
//! products stay below 2^53 (a minute window up to 150 million units; a day window up to
//! 100 thousand per microsecond of precision lost, which rounds toward neither side in
//! particular but identically on both stores). Retry times are computed exactly in integers and
//! then checked against that same test, so "refused one microsecond before, admitted at" holds.

use std::time::Duration;

use crate::clock::Timestamp;

/// The largest count a window holds, and the largest `max` and window (in microseconds) a
/// limit takes: 2^53, up to which every integer is exact in the f64 arithmetic that both stores
/// decide with (about 285 years of microseconds; no real limit comes near it).
pub const MAX_COUNT: u64 = 1 << 53;

/// A sliding-window limit: at most `max` units in any `window`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WindowLimit {
    max: u64,
    window_us: u64,
}

impl WindowLimit {
    /// At most `max` units per `window`. A `max` above [`MAX_COUNT`] is taken as `MAX_COUNT`
    /// (both mean "never refuses in practice", and counts stop there).
    ///
    /// # Panics
    ///
    /// If `window` is shorter than a microsecond or longer than [`MAX_COUNT`] microseconds.
    /// Being a `const fn`, a broken limit in a `const` fails to compile.
    pub const fn new(max: u64, window: Duration) -> Self {
        let micros = window.as_micros();
        assert!(micros > 0, "a window must last at least one microsecond");
        assert!(
            micros <= MAX_COUNT as u128,
            "window too long (at most 2^53 microseconds)"
        );
        WindowLimit {
            max: if max > MAX_COUNT { MAX_COUNT } else { max },
            window_us: micros as u64,
        }
    }

    /// At most `max` units per second.
    pub const fn per_second(max: u64) -> Self {
        Self::new(max, Duration::from_secs(1))
    }

    /// At most `max` units per minute (`rpm`, `tpm`).
    pub const fn per_minute(max: u64) -> Self {
        Self::new(max, Duration::from_secs(60))
    }

    /// At most `max` units per hour.
    pub const fn per_hour(max: u64) -> Self {
        Self::new(max, Duration::from_secs(3600))
    }

    /// At most `max` units per day.
    pub const fn per_day(max: u64) -> Self {
        Self::new(max, Duration::from_secs(86_400))
    }

    /// The most units a window may hold.
    pub const fn max(&self) -> u64 {
        self.max
    }

    /// The window length.
    pub const fn window(&self) -> Duration {
        Duration::from_micros(self.window_us)
    }

    /// The window length in microseconds.
    pub const fn window_micros(&self) -> u64 {
        self.window_us
    }

    /// How long stored state must outlive its last write: two windows, after which the state
    /// could only read as empty.
    pub const fn ttl(&self) -> Duration {
        Duration::from_micros(self.window_us.saturating_mul(2))
    }
}

/// How a limit is charged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Charge {
    /// Charged when the request is admitted (requests; any unit known up front): admits iff
    /// `estimate + cost <= max`.
    Admission,
    /// Charged afterwards with `record` (tokens of a finished response): admits iff
    /// `estimate < max`.
    Reactive,
    /// Tokens reserved: charged an estimate at admission, decided as [`Admission`](Self::Admission)
    /// is with that estimate as the limit's cost (`estimate + cost <= max`), and reconciled once
    /// the usage is known ([`Snapshot::reconciled`]: the difference charged, or refunded, into
    /// the bucket the reservation went to). Stored where a reactive token limit of the same
    /// scope is, so switching a limit between the two keeps its counts.
    Reserved,
}

impl Charge {
    /// Whether the limit counts tokens (reactive or reserved) rather than requests.
    pub const fn counts_tokens(self) -> bool {
        matches!(self, Charge::Reactive | Charge::Reserved)
    }

    /// Whether an admitted request is charged its cost at admission (requests, reserved
    /// tokens).
    pub const fn at_admission(self) -> bool {
        matches!(self, Charge::Admission | Charge::Reserved)
    }
}

/// The stored state of one window: the bucket last written and its two counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowState {
    /// Index of the bucket `cur` counts: `floor(t / W)` at the last write.
    pub bucket: u64,
    /// Units in that bucket.
    pub cur: u64,
    /// Units in the bucket before it.
    pub prev: u64,
}

/// A window's counts as seen at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Index of the current bucket.
    pub bucket: u64,
    /// Units in the current bucket.
    pub cur: u64,
    /// Units in the previous bucket.
    pub prev: u64,
    /// Microseconds elapsed in the current bucket (`0 <= elapsed < W`).
    pub elapsed: u64,
}

impl Snapshot {
    /// The counts of `state` (none for a window never written or expired) seen at `now`.
    ///
    /// A state written in the previous bucket rolls over (`cur` becomes `prev`); one written
    /// earlier reads as empty. One written in a later bucket (by a clock ahead of `now`'s:
    /// skewed replicas on the client clock, a Redis `TIME` that stepped back at a failover)
    /// reads as the current bucket holding all its units (`cur + prev`, `prev` 0): as strict as
    /// that state seen at its own bucket's start, where `prev` weighs in full. Read as empty, it
    /// would let the behind clock admit a whole window's worth again.
    pub fn at(state: Option<WindowState>, now: Timestamp, limit: WindowLimit) -> Snapshot {
        let w = limit.window_us;
        let t = now.as_micros();
        let bucket = t / w;
        Self::in_bucket(state, bucket, t - bucket * w)
    }

    /// [`at`](Self::at) an instant that lies `elapsed` microseconds into bucket `bucket` of the
    /// limit's window: for limits of one window decided at one instant, which share the
    /// division.
    #[inline]
    pub(crate) fn in_bucket(state: Option<WindowState>, bucket: u64, elapsed: u64) -> Snapshot {
        let (cur, prev) = match state {
            Some(s) if s.bucket == bucket => (s.cur, s.prev),
            Some(s) if s.bucket.wrapping_add(1) == bucket => (0, s.cur),
            Some(s) if s.bucket > bucket => (s.cur.saturating_add(s.prev).min(MAX_COUNT), 0),
            _ => (0, 0),
        };
        Snapshot {
            bucket,
            cur,
            prev,
            elapsed,
        }
    }

    /// The state to store after adding `units` to the current bucket (counts stop at
    /// [`MAX_COUNT`], as in the Redis scripts).
    pub fn charged(&self, units: u64) -> WindowState {
        WindowState {
            bucket: self.bucket,
            cur: self.cur.saturating_add(units).min(MAX_COUNT),
            prev: self.prev,
        }
    }

    /// The state to store after reconciling a reservation charged into bucket `reserved`: the
    /// difference `delta` (actual minus reserved units) added to that bucket, a negative one
    /// taken from it but never below zero. `None` when nothing is to be written.
    ///
    /// The reservation's bucket is this snapshot's current one (`cur`) or the one before it
    /// (`prev`). A bucket older than that no longer counts: a refund into it is dropped (it has
    /// nothing left to lower), and units still owed go into the current bucket, as a reactive
    /// record would put them, so that usage is never lost (the error is towards stricter). A
    /// bucket ahead of this one (a reservation decided by a clock ahead) is taken as the current
    /// one, as [`Snapshot::at`] takes state written ahead.
    pub fn reconciled(&self, reserved: u64, delta: i64) -> Option<WindowState> {
        let add = |count: u64| count.saturating_add_signed(delta).min(MAX_COUNT);
        let mut state = WindowState {
            bucket: self.bucket,
            cur: self.cur,
            prev: self.prev,
        };
        if delta == 0 {
            return None;
        } else if reserved >= self.bucket {
            state.cur = add(self.cur);
        } else if reserved + 1 == self.bucket {
            state.prev = add(self.prev);
        } else if delta > 0 {
            state.cur = add(self.cur);
        } else {
            return None;
        }
        (state.cur != self.cur || state.prev != self.prev).then_some(state)
    }

    /// The estimate `cur + prev * (W - e) / W`, for display and metrics.
    pub fn estimate(&self, limit: WindowLimit) -> f64 {
        let w = limit.window_us as f64;
        self.cur as f64 + self.prev as f64 * (w - self.elapsed as f64) / w
    }

    /// Whether a request of `cost` units passes this limit now.
    ///
    /// A reactive limit ignores `cost` (its units come later) and needs `estimate < max`.
    #[inline]
    pub fn admits(&self, limit: WindowLimit, charge: Charge, cost: u64) -> bool {
        // Keep in step with store/redis/admit.lua: the same operations in the same order.
        let w = limit.window_us as f64;
        let carried = self.prev as f64 * (w - self.elapsed as f64);
        match charge {
            Charge::Admission | Charge::Reserved => {
                (self.cur as f64 + cost as f64 - limit.max as f64) * w + carried <= 0.0
            }
            Charge::Reactive => (self.cur as f64 - limit.max as f64) * w + carried < 0.0,
        }
    }

    /// Whole units left after this request: `floor(max - estimate - charged)`, at least 0.
    pub fn remaining(&self, limit: WindowLimit, charged: u64) -> u64 {
        // The units the current bucket leaves, less the previous bucket's weight
        // `prev * (W - e) / W` rounded up: `floor(max * W - used) / W` exactly, with one
        // division of the weight alone, in 64 bits whenever it fits (a 128-bit division shows
        // on the memory store's admission).
        let w = limit.window_us;
        let Some(left) = limit.max.checked_sub(self.cur.saturating_add(charged)) else {
            return 0;
        };
        if self.prev == 0 || left == 0 {
            // Nothing carried from the previous bucket, or nothing left to carry it from.
            return left;
        }
        let weight = u128::from(self.prev) * u128::from(w - self.elapsed);
        let carried = match u64::try_from(weight) {
            Ok(weight) => weight.div_ceil(w),
            Err(_) => u64::try_from(weight.div_ceil(u128::from(w))).unwrap_or(u64::MAX),
        };
        left.saturating_sub(carried)
    }

    /// Time until the limit is whole again (the estimate drains to zero) after charging
    /// `charged` units now, with no other traffic.
    pub fn until_empty(&self, limit: WindowLimit, charged: u64) -> Duration {
        let w = limit.window_us;
        let micros = if self.cur.saturating_add(charged) > 0 {
            2 * w - self.elapsed
        } else if self.prev > 0 {
            w - self.elapsed
        } else {
            0
        };
        Duration::from_micros(micros)
    }

    /// The exact wait until a refused request of `cost` units would pass this limit with no
    /// other traffic, or `None` if it never can (`cost > max`, or a reactive limit of 0).
    ///
    /// Returns `Some(ZERO)` if the request passes now.
    pub fn retry_after(&self, limit: WindowLimit, charge: Charge, cost: u64) -> Option<Duration> {
        if self.admits(limit, charge, cost) {
            return Some(Duration::ZERO);
        }
        let w = u128::from(limit.window_us);
        let max = u128::from(limit.max);
        let e = u128::from(self.elapsed);
        let (cur, prev) = (u128::from(self.cur), u128::from(self.prev));
        // The earliest instant, as microseconds from the start of the current bucket. (The
        // divisors are never zero while counts stay within MAX_COUNT, where the f64 test agrees
        // with these integer ones; `max(1)` only keeps a bad state from panicking.)
        let target = match charge {
            Charge::Admission | Charge::Reserved => {
                let cost = u128::from(cost);
                if cost > max {
                    return None;
                }
                if cur + cost <= max {
                    // The previous bucket is the obstacle: wait until its weight has fallen to
                    // (max - cost - cur) / prev, i.e. e' = W - floor((max - cost - cur) * W / prev).
                    w - ((max - cost - cur) * w) / prev.max(1)
                } else {
                    // Wait for the next bucket, where cur becomes prev.
                    w + w - ((max - cost) * w) / cur.max(1)
                }
            }
            Charge::Reactive => {
                if max == 0 {
                    return None;
                }
                // Strictly below: e' = W - ceil(q) + 1 with q the rational bound. (Where the f64
                // test rounds a sum that is exactly below to 0, a window past 2^52 µs, the bound
                // can pass W + 1: the wait is then 0 before settling, never negative.)
                if cur < max {
                    (w + 1).saturating_sub(((max - cur) * w).div_ceil(prev.max(1)))
                } else {
                    (w + w + 1).saturating_sub((max * w).div_ceil(cur.max(1)))
                }
            }
        };
        let wait = u64::try_from(target.saturating_sub(e)).unwrap_or(u64::MAX);
        Some(self.settle(limit, charge, cost, wait))
    }

    /// The counts this window would show `wait` microseconds later with no traffic.
    fn later(&self, limit: WindowLimit, wait: u64) -> Snapshot {
        let w = limit.window_us;
        let t = (self.bucket * w + self.elapsed).saturating_add(wait);
        let state = WindowState {
            bucket: self.bucket,
            cur: self.cur,
            prev: self.prev,
        };
        Snapshot::at(Some(state), Timestamp::from_micros(t), limit)
    }

    /// Nudges an exact wait onto the floating-point admission test, so that the request is
    /// refused one microsecond before the wait and admitted at it. Only huge counts, where the
    /// test is no longer exact, ever move.
    fn settle(&self, limit: WindowLimit, charge: Charge, cost: u64, mut wait: u64) -> Duration {
        const MAX_NUDGE: u32 = 4096;
        let passes = |wait: u64| self.later(limit, wait).admits(limit, charge, cost);
        let mut nudges = 0;
        while !passes(wait) && nudges < MAX_NUDGE {
            wait += 1;
            nudges += 1;
        }
        while wait > 0 && passes(wait - 1) && nudges < MAX_NUDGE {
            wait -= 1;
            nudges += 1;
        }
        Duration::from_micros(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RPM5: WindowLimit = WindowLimit::per_minute(5);

    #[test]
    fn limits_and_counts_stop_at_two_to_the_fifty_third() {
        assert_eq!(WindowLimit::per_minute(u64::MAX).max(), MAX_COUNT);
        assert_eq!(snap(MAX_COUNT - 1, 0, 1.0).charged(u64::MAX).cur, MAX_COUNT);
        // Past 2^53 the f64 test and the integer retry math disagreed; now they cannot, and a
        // full window still gives a wait.
        let full = snap(MAX_COUNT, 0, 1.0);
        let limit = WindowLimit::per_minute(u64::MAX);
        assert!(!full.admits(limit, Charge::Reactive, 1));
        assert!(full.retry_after(limit, Charge::Reactive, 1).is_some());
    }

    #[test]
    #[should_panic(expected = "window too long")]
    fn a_window_past_two_to_the_fifty_third_microseconds_is_refused() {
        let _ = WindowLimit::new(5, Duration::from_micros(u64::MAX));
    }

    fn snap(cur: u64, prev: u64, elapsed_secs: f64) -> Snapshot {
        Snapshot {
            bucket: 1000,
            cur,
            prev,
            elapsed: (elapsed_secs * 1e6) as u64,
        }
    }

    #[test]
    fn previous_bucket_counts_in_full_on_the_boundary_and_half_at_mid_window() {
        assert_eq!(snap(0, 10, 0.0).estimate(RPM5), 10.0);
        assert_eq!(snap(0, 10, 30.0).estimate(RPM5), 5.0);
        assert_eq!(snap(2, 10, 45.0).estimate(RPM5), 4.5);
    }

    #[test]
    fn admission_is_estimate_plus_cost_at_most_max() {
        // estimate 4.5: one more fits (5.5 > 5? no: 4.5 + 1 = 5.5 > 5) -> refused.
        assert!(!snap(2, 10, 45.0).admits(RPM5, Charge::Admission, 1));
        // estimate 4.0 at e = 48: 4 + 1 = 5 <= 5 -> admitted.
        assert!(snap(2, 10, 48.0).admits(RPM5, Charge::Admission, 1));
        // reactive: estimate 4.0 < 5 admits; estimate 5 does not.
        assert!(snap(2, 10, 48.0).admits(RPM5, Charge::Reactive, 1));
        assert!(!snap(5, 0, 1.0).admits(RPM5, Charge::Reactive, 0));
    }

    #[test]
    fn retry_when_previous_bucket_is_the_obstacle() {
        // cur 2, prev 10, e = 45 s: need prev*(W-e')/W <= 2 -> e' = 48 s: wait 3 s.
        let s = snap(2, 10, 45.0);
        assert_eq!(
            s.retry_after(RPM5, Charge::Admission, 1),
            Some(Duration::from_secs(3))
        );
    }

    #[test]
    fn retry_when_current_bucket_is_the_obstacle() {
        // cur 5 (full), e = 18 s: next bucket in 42 s, where prev = 5 must weigh <= 4:
        // e'' = 60 - 4*60/5 = 12 s. Wait 42 + 12 = 54 s.
        let s = snap(5, 0, 18.0);
        assert_eq!(
            s.retry_after(RPM5, Charge::Admission, 1),
            Some(Duration::from_secs(54))
        );
    }

    #[test]
    fn impossible_requests_have_no_retry() {
        assert_eq!(
            snap(0, 0, 0.0).retry_after(RPM5, Charge::Admission, 6),
            None
        );
        let zero = WindowLimit::per_minute(0);
        assert_eq!(snap(0, 0, 0.0).retry_after(zero, Charge::Reactive, 0), None);
    }

    #[test]
    fn a_reactive_refusal_the_f64_test_rounds_into_waits_a_microsecond() {
        // A window past 2^52 µs: the two products round to the same double, so the strict test
        // refuses a count exactly below the max, and the integer bound passes W + 1.
        let w = 6_755_399_441_055_744;
        let l = WindowLimit::new(1 << 53, Duration::from_micros(w));
        let s = Snapshot {
            bucket: 1,
            cur: 2_251_799_813_685_250,
            prev: 6_755_399_441_055_741,
            elapsed: 0,
        };
        assert!(!s.admits(l, Charge::Reactive, 0));
        assert_eq!(
            s.retry_after(l, Charge::Reactive, 0),
            Some(Duration::from_micros(1))
        );
    }

    #[test]
    fn a_full_counter_charged_more_still_reports_its_reset() {
        let s = snap(1, 0, 20.0);
        assert_eq!(s.until_empty(RPM5, u64::MAX), Duration::from_secs(100));
    }

    #[test]
    fn remaining_and_reset() {
        let s = snap(2, 10, 45.0); // estimate 4.5
        assert_eq!(s.remaining(RPM5, 0), 0);
        let s = snap(1, 4, 30.0); // estimate 3
        assert_eq!(s.remaining(RPM5, 1), 1);
        assert_eq!(s.until_empty(RPM5, 1), Duration::from_secs(90));
        assert_eq!(
            snap(0, 4, 30.0).until_empty(RPM5, 0),
            Duration::from_secs(30)
        );
        assert_eq!(snap(0, 0, 30.0).until_empty(RPM5, 0), Duration::ZERO);
    }

    #[test]
    fn remaining_is_the_floor_of_what_is_left() {
        // What it computes, as one 128-bit quotient.
        let floor = |s: &Snapshot, l: WindowLimit, charged: u64| {
            let w = u128::from(l.window_micros());
            let used = (u128::from(s.cur) + u128::from(charged)) * w
                + u128::from(s.prev) * (w - u128::from(s.elapsed));
            let left = (u128::from(l.max()) * w).saturating_sub(used) / w;
            u64::try_from(left).unwrap_or(u64::MAX)
        };
        let counts = [0, 1, 2, 5, 7, 1_000, MAX_COUNT - 1, MAX_COUNT];
        let limits = [
            RPM5,
            WindowLimit::per_second(3),
            WindowLimit::per_day(MAX_COUNT),
            WindowLimit::new(MAX_COUNT, Duration::from_micros(MAX_COUNT)),
        ];
        for limit in limits {
            let w = limit.window_micros();
            for (cur, prev) in counts.into_iter().flat_map(|c| counts.map(|p| (c, p))) {
                for (charged, elapsed) in [0, 1, 3, MAX_COUNT]
                    .into_iter()
                    .flat_map(|c| [0, 1, w / 3, w - 1].map(|e| (c, e)))
                {
                    let s = Snapshot {
                        bucket: 1,
                        cur,
                        prev,
                        elapsed,
                    };
                    let want = floor(&s, limit, charged);
                    assert_eq!(
                        s.remaining(limit, charged),
                        want,
                        "{s:?} {limit:?} {charged}"
                    );
                }
            }
        }
    }

    #[test]
    fn rollover() {
        let limit = RPM5;
        let state = WindowState {
            bucket: 10,
            cur: 3,
            prev: 7,
        };
        let at = |secs: u64| Snapshot::at(Some(state), Timestamp::from_secs(secs), limit);
        assert_eq!((at(600).cur, at(600).prev), (3, 7));
        assert_eq!((at(660).cur, at(660).prev), (0, 3));
        assert_eq!((at(720).cur, at(720).prev), (0, 0));
        // Written by a clock ahead: every unit counts in the current bucket.
        assert_eq!((at(599).cur, at(599).prev, at(599).bucket), (10, 0, 9));
        assert_eq!((at(0).cur, at(0).prev), (10, 0));
        let huge = WindowState {
            bucket: 10,
            cur: MAX_COUNT,
            prev: MAX_COUNT,
        };
        assert_eq!(
            Snapshot::at(Some(huge), Timestamp::from_secs(599), limit).cur,
            MAX_COUNT
        );
    }
}
