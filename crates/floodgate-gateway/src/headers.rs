//! Rate-limit response headers: the most restrictive limit's state, in the three dialects that
//! clients read (classic `X-RateLimit-*`, IETF `RateLimit-Policy`/`RateLimit`, OpenAI
//! `x-ratelimit-*-{requests,tokens}`), plus `Retry-After`/`retry-after-ms` on a refusal.

use std::fmt::Write as _;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use floodgate::{ChainDecision, Charge, LimitStatus};

const X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const LIMIT_REQ: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
const REMAINING_REQ: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");
const RESET_REQ: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
const LIMIT_TOK: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
const REMAINING_TOK: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
const RESET_TOK: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
const RETRY_AFTER: HeaderName = HeaderName::from_static("retry-after");
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// The rate-limit state headers this module writes: upstream copies of them are removed from
/// proxied responses so that a caller only ever sees the gateway's view. (An upstream's own
/// `Retry-After` on its 429 or 503 is kept: it is still true for the caller.)
pub const ALL: [HeaderName; 10] = [
    X_LIMIT,
    X_REMAINING,
    POLICY,
    RATELIMIT,
    LIMIT_REQ,
    REMAINING_REQ,
    RESET_REQ,
    LIMIT_TOK,
    REMAINING_TOK,
    RESET_TOK,
];

/// The limit the generic headers describe: the refusing one on a refusal, else the most
/// restrictive request limit, else the most restrictive token limit.
pub fn primary(decision: &ChainDecision) -> Option<&LimitStatus> {
    decision
        .refusing()
        .or_else(|| decision.most_restrictive(Charge::Admission))
        .or_else(|| decision.most_restrictive(Charge::Reactive))
}

/// Removes upstream rate-limit headers, then writes the decision's. A decision taken without the
/// store (failed open) has no limit state: nothing is written.
pub fn apply(headers: &mut HeaderMap, decision: &ChainDecision) {
    for name in &ALL {
        headers.remove(name);
    }
    if !decision.enforced {
        return;
    }
    if let Some(p) = primary(decision) {
        let reset = ceil_secs(p.reset);
        headers.insert(X_LIMIT, p.limit.max().into());
        headers.insert(X_REMAINING, p.remaining.into());
        let scope = p.scope.as_str();
        let window = ceil_secs(p.limit.window());
        let mut s = String::with_capacity(48);
        let _ = write!(s, "\"{scope}\";q={};w={window}", p.limit.max());
        insert_str(headers, POLICY, &s);
        s.clear();
        let _ = write!(s, "\"{scope}\";r={};t={reset}", p.remaining);
        insert_str(headers, RATELIMIT, &s);
    }
    if let Some(r) = decision.most_restrictive(Charge::Admission) {
        headers.insert(LIMIT_REQ, r.limit.max().into());
        headers.insert(REMAINING_REQ, r.remaining.into());
        insert_str(headers, RESET_REQ, &openai_duration(r.reset));
    }
    if let Some(t) = decision.most_restrictive(Charge::Reactive) {
        headers.insert(LIMIT_TOK, t.limit.max().into());
        headers.insert(REMAINING_TOK, t.remaining.into());
        insert_str(headers, RESET_TOK, &openai_duration(t.reset));
    }
    if let (false, Some(wait)) = (decision.admitted, decision.retry_after) {
        headers.insert(RETRY_AFTER, ceil_secs(wait).into());
        headers.insert(RETRY_AFTER_MS, ceil_millis(wait).into());
    }
}

fn insert_str(headers: &mut HeaderMap, name: HeaderName, value: &str) {
    // Only digits, letters, quotes and `;=`: always a valid header value.
    if let Ok(v) = HeaderValue::from_str(value) {
        headers.insert(name, v);
    }
}

/// Whole seconds, rounded up.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Whole milliseconds, rounded up.
pub fn ceil_millis(d: Duration) -> u64 {
    let ms = d.as_millis();
    let rounded = ms + u128::from(!d.as_nanos().is_multiple_of(1_000_000));
    u64::try_from(rounded).unwrap_or(u64::MAX)
}

/// A duration as OpenAI writes its resets: `12ms` below a second (rounded up), else whole
/// seconds rounded up as `1s`, `6m0s`, `1h2m3s`; zero is `0s`.
pub fn openai_duration(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    if d < Duration::from_secs(1) {
        return format!("{}ms", ceil_millis(d));
    }
    let total = ceil_secs(d);
    let (h, m, s) = (total / 3600, total / 60 % 60, total % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_durations() {
        assert_eq!(openai_duration(Duration::ZERO), "0s");
        assert_eq!(openai_duration(Duration::from_micros(11_200)), "12ms");
        assert_eq!(openai_duration(Duration::from_millis(1000)), "1s");
        assert_eq!(openai_duration(Duration::from_millis(41_001)), "42s");
        assert_eq!(openai_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(openai_duration(Duration::from_secs(3723)), "1h2m3s");
    }

    #[test]
    fn rounding_up() {
        assert_eq!(ceil_secs(Duration::from_millis(41_001)), 42);
        assert_eq!(ceil_secs(Duration::from_secs(42)), 42);
        assert_eq!(ceil_millis(Duration::from_micros(1_001)), 2);
        assert_eq!(ceil_millis(Duration::from_millis(7)), 7);
    }
}
