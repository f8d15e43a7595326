//! Calendar periods and the counters kept per period: pure.
//!
//! A [`PeriodCounter`] adds amounts (a budget's spend, in whatever integer unit the caller
//! chooses) within the current calendar [`Period`] in UTC, a day or a month, and starts again from
//! zero when the next period begins. Unlike a sliding window it has no memory of the period
//! before: a day's spend is the day's, and at midnight UTC it is zero again.
//!
//! Dates are computed from Unix time by hand (Howard Hinnant's `days_from_civil` and
//! `civil_from_days`), with no calendar crate: the Redis scripts compute the same in Lua, and the
//! shared test vectors check that both agree across day and month boundaries.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Timestamp;

/// Microseconds in a day.
pub const DAY_MICROS: u64 = 86_400_000_000;

/// The largest total a period counter holds: 2^53, exact in a double (the Redis scripts' Lua
/// numbers) and printable by `%d`. Adds past it saturate. In micro-USD, about 9 billion USD.
pub const MAX_TOTAL: u64 = 1 << 53;

/// How long a counter's state outlives the end of its period: a day, so that the period just
/// ended can still be inspected by an operator, then it goes.
pub const GRACE: Duration = Duration::from_secs(86_400);

/// A calendar period in UTC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Period {
    /// A calendar day, from midnight UTC.
    Day,
    /// A calendar month, from the first day's midnight UTC.
    Month,
}

impl Period {
    /// Every period.
    pub const ALL: [Period; 2] = [Period::Day, Period::Month];

    /// The name used in configs and storage keys: `day` or `month`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Month => "month",
        }
    }

    /// The period named `name`, as [`as_str`](Self::as_str) spells it.
    pub fn parse(name: &str) -> Option<Period> {
        Period::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// The period containing `now`: its start (inclusive) and end (exclusive).
    ///
    /// ```
    /// use floodgate::Timestamp;
    /// use floodgate::period::Period;
    ///
    /// // 2023-11-14T22:14:00Z
    /// let now = Timestamp::from_secs(1_700_000_040);
    /// let (start, end) = Period::Month.bounds(now);
    /// assert_eq!(start, Timestamp::from_secs(1_698_796_800)); // 2023-11-01
    /// assert_eq!(end, Timestamp::from_secs(1_701_388_800)); // 2023-12-01
    /// ```
    pub fn bounds(self, now: Timestamp) -> (Timestamp, Timestamp) {
        let days = now.as_micros() / DAY_MICROS;
        // Past the last whole day a u64 of microseconds holds, the end stops there.
        let at = |days: u64| Timestamp::from_micros(days.saturating_mul(DAY_MICROS));
        match self {
            Period::Day => (at(days), at(days.saturating_add(1))),
            Period::Month => {
                let (y, m, _) = civil_from_days(days);
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                (at(days_from_civil(y, m, 1)), at(days_from_civil(ny, nm, 1)))
            }
        }
    }

    /// The time from `now` to the end of its period.
    pub fn remaining(self, now: Timestamp) -> Duration {
        self.bounds(now).1.saturating_since(now)
    }

    /// The period's name as stored beside its total: `2026-12-01` for a day, `2026-12` for a
    /// month.
    pub fn label(self, now: Timestamp) -> String {
        let (y, m, d) = civil_from_days(now.as_micros() / DAY_MICROS);
        match self {
            Period::Day => format!("{y:04}-{m:02}-{d:02}"),
            Period::Month => format!("{y:04}-{m:02}"),
        }
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Days since 1970-01-01 of the date `y-m-d` (proleptic Gregorian), for dates from 1970 on.
pub fn days_from_civil(y: u64, m: u64, d: u64) -> u64 {
    // Hinnant's algorithm with the year starting in March, so that the leap day ends it.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date `(year, month, day)` of `days` since 1970-01-01 (proleptic Gregorian).
pub fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

/// A counter of amounts per calendar period, at a storage key.
///
/// The key names the counter, not the period: the state holds the current period's label beside
/// its total, and an add in a new period starts from zero. So the store's clock decides which
/// period an amount falls in (the Redis server's `TIME` by default, as for every decision), and
/// the key a script touches is known before it runs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeriodCounter {
    key: Arc<str>,
    period: Period,
}

impl PeriodCounter {
    /// A counter per `period` at `key` (without a store's prefix).
    pub fn new(key: impl Into<Arc<str>>, period: Period) -> Self {
        PeriodCounter {
            key: key.into(),
            period,
        }
    }

    /// The storage key, without a store's prefix.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The period.
    pub fn period(&self) -> Period {
        self.period
    }

    /// When state written at `now` may go: [`GRACE`] after its period ends.
    pub fn expires(&self, now: Timestamp) -> Timestamp {
        self.period.bounds(now).1.saturating_add(GRACE)
    }
}

/// A counter's stored state: the start of the period it counts, and the total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeriodState {
    /// The start of the period `total` belongs to.
    pub start: Timestamp,
    /// The amounts added in that period.
    pub total: u64,
}

impl PeriodState {
    /// The total in `period` at `now`: the stored one if it is of the same period, else 0.
    pub fn total_at(state: Option<PeriodState>, period: Period, now: Timestamp) -> u64 {
        match state {
            Some(s) if s.start == period.bounds(now).0 => s.total,
            _ => 0,
        }
    }

    /// The state after reconciling, at `now`, an amount reserved at `reserved_at`: `delta`
    /// (actual minus reserved, signed) added to the total of the reservation's period, never
    /// below zero. `None` when nothing is to be written. If that period has ended, a refund is
    /// dropped (its total no longer counts) and an amount still owed goes into the current
    /// period, as spend is charged, towards stricter.
    pub fn reconciled(
        state: Option<PeriodState>,
        period: Period,
        now: Timestamp,
        reserved_at: Timestamp,
        delta: i64,
    ) -> Option<Self> {
        let start = period.bounds(now).0;
        if delta == 0 || delta < 0 && period.bounds(reserved_at).0 != start {
            return None;
        }
        let total = Self::total_at(state, period, now);
        let adjusted = total.saturating_add_signed(delta).min(MAX_TOTAL);
        (adjusted != total).then_some(PeriodState {
            start,
            total: adjusted,
        })
    }

    /// The state after adding `amount` at `now` (saturating at [`MAX_TOTAL`]).
    pub fn added(state: Option<PeriodState>, period: Period, now: Timestamp, amount: u64) -> Self {
        let total = Self::total_at(state, period, now)
            .saturating_add(amount)
            .min(MAX_TOTAL);
        PeriodState {
            start: period.bounds(now).0,
            total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_those_of_the_calendar() {
        // Day by day from the epoch, against a count of the calendar's own rules.
        let (mut y, mut m, mut d) = (1970, 1, 1);
        for days in 0..200 * 366 {
            assert_eq!(civil_from_days(days), (y, m, d), "day {days}");
            let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
            let len = match m {
                2 if leap => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            d += 1;
            if d > len {
                d = 1;
                m += 1;
                if m > 12 {
                    m = 1;
                    y += 1;
                }
            }
        }
    }

    fn secs(s: u64) -> Timestamp {
        Timestamp::from_secs(s)
    }

    #[test]
    fn dates_round_trip_and_match_known_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        // 2000-02-29 (a leap day of a century year divisible by 400): day 11_016.
        assert_eq!(days_from_civil(2000, 2, 29), 11_016);
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        // 2100 is not a leap year.
        assert_eq!(
            civil_from_days(days_from_civil(2100, 2, 28) + 1),
            (2100, 3, 1)
        );
        // 2026-12-01 is 1_796_083_200 s after the epoch.
        assert_eq!(days_from_civil(2026, 12, 1) * 86_400, 1_796_083_200);
        for days in (0..200_000).step_by(7) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
    }

    #[test]
    fn bounds_of_days_and_months() {
        // 2023-11-14T22:14:00Z.
        let now = secs(1_700_000_040);
        assert_eq!(
            Period::Day.bounds(now),
            (secs(1_699_920_000), secs(1_700_006_400))
        );
        assert_eq!(Period::Day.label(now), "2023-11-14");
        assert_eq!(Period::Month.label(now), "2023-11");
        // Midnight belongs to the day it starts.
        assert_eq!(
            Period::Day.bounds(secs(1_700_006_400)).0,
            secs(1_700_006_400)
        );
        assert_eq!(
            Period::Day.remaining(secs(1_700_006_399)),
            Duration::from_secs(1)
        );
        // December rolls into the next year; February 2024 has 29 days.
        let dec = secs(days_from_civil(2023, 12, 31) * 86_400);
        assert_eq!(
            Period::Month.bounds(dec).1,
            secs(days_from_civil(2024, 1, 1) * 86_400)
        );
        let feb = secs(days_from_civil(2024, 2, 10) * 86_400);
        let (start, end) = Period::Month.bounds(feb);
        assert_eq!(
            end.saturating_since(start),
            Duration::from_secs(29 * 86_400)
        );
    }

    #[test]
    fn totals_roll_over_with_the_period_and_saturate() {
        let now = secs(1_700_000_040);
        let s = PeriodState::added(None, Period::Day, now, 5);
        let s = PeriodState::added(Some(s), Period::Day, now, 7);
        assert_eq!(PeriodState::total_at(Some(s), Period::Day, now), 12);
        let tomorrow = secs(1_700_006_400);
        assert_eq!(PeriodState::total_at(Some(s), Period::Day, tomorrow), 0);
        let s = PeriodState::added(Some(s), Period::Day, tomorrow, u64::MAX);
        assert_eq!(s.total, MAX_TOTAL);
        let c = PeriodCounter::new("k", Period::Day);
        assert_eq!(c.expires(now), secs(1_700_006_400 + 86_400));
    }
}
