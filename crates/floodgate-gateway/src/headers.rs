//! Rate-limit response headers: the most restrictive limit's state, in the three dialects that
//! clients read (classic `X-RateLimit-*`, IETF `RateLimit-Policy`/`RateLimit`, OpenAI
//! `x-ratelimit-*-{requests,tokens}`), plus `Retry-After`/`retry-after-ms` on a refusal.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use floodgate::{Chain, ChainDecision, Charge, LimitStatus, ScopeKind, WindowLimit};

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

/// The rate-limit state headers this module writes. An upstream's headers of these families
/// (`x-ratelimit-*`, `ratelimit*`) are removed from proxied responses so that a caller only ever
/// sees the gateway's view. (An upstream's own `Retry-After` on its 429 or 503 is kept: it is
/// still true for the caller.)
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

/// The parts of a chain's headers that never change: each limit's maximum and its
/// `RateLimit-Policy`, formatted once per chain (at config load for every key's chain) instead of
/// on every response.
#[derive(Debug)]
pub struct ChainHeaders {
    limits: Box<[LimitHeaders]>,
}

#[derive(Debug)]
struct LimitHeaders {
    max: HeaderValue,
    policy: HeaderValue,
}

impl ChainHeaders {
    /// The fixed header values of `chain`'s limits, in chain order.
    pub fn new(chain: &Chain) -> ChainHeaders {
        let limits = chain
            .limits()
            .iter()
            .map(|l| LimitHeaders::of(l.scope(), l.limit()))
            .collect();
        ChainHeaders { limits }
    }

    fn from_statuses(statuses: &[LimitStatus]) -> ChainHeaders {
        let limits = statuses
            .iter()
            .map(|s| LimitHeaders::of(s.scope, s.limit))
            .collect();
        ChainHeaders { limits }
    }
}

impl LimitHeaders {
    fn of(scope: ScopeKind, limit: WindowLimit) -> LimitHeaders {
        let mut b = Buf::new();
        b.quoted(scope.as_str());
        b.push(b";q=");
        b.u64(limit.max());
        b.push(b";w=");
        b.u64(ceil_secs(limit.window()));
        LimitHeaders {
            max: limit.max().into(),
            policy: b.value().unwrap_or_else(|| HeaderValue::from_static("")),
        }
    }
}

/// The limit the generic headers describe (docs/design.md §6): the refusing one on a refusal,
/// else the one with the fewest whole units left after this request's charge, request or token
/// limit alike (a token window all but spent refuses the next request however many requests
/// are left); ties go to the narrowest scope.
pub fn primary(decision: &ChainDecision) -> Option<&LimitStatus> {
    primary_index(decision).map(|i| &decision.statuses[i])
}

/// [`primary`], as an index into the chain.
fn primary_index(decision: &ChainDecision) -> Option<usize> {
    decision
        .refused_by
        .filter(|&i| i < decision.statuses.len())
        .or_else(|| {
            // The chain runs narrowest first, and `min_by_key` keeps the first of equals. A
            // shadow limit never shows in a caller's headers.
            decision
                .statuses
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.shadow)
                .min_by_key(|(_, s)| s.remaining)
                .map(|(i, _)| i)
        })
}

/// [`ChainDecision::most_restrictive`], as an index into the chain: the refusing limit if it
/// counts `charge`, else the first of those with the fewest units left (the narrowest scope).
fn most_restrictive_index(decision: &ChainDecision, charge: Charge) -> Option<usize> {
    let statuses = &decision.statuses;
    if let Some(r) = decision.refused_by
        && statuses.get(r).is_some_and(|s| s.charge == charge)
    {
        return Some(r);
    }
    statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.charge == charge && !s.shadow)
        .min_by_key(|(_, s)| s.remaining)
        .map(|(i, _)| i)
}

/// Removes upstream rate-limit headers, then writes the decision's. A decision taken without the
/// store (failed open) has no limit state: nothing is written. `fixed` holds the fixed values of
/// the decision's chain ([`ChainHeaders::new`] of that chain).
pub fn apply(headers: &mut HeaderMap, decision: &ChainDecision, fixed: &ChainHeaders) {
    // One pass over the (few) headers present instead of ten hashed lookups: upstreams rarely
    // send rate-limit headers of their own.
    // Every upstream header of the families the gateway speaks goes (`x-ratelimit-*`,
    // `ratelimit*`: also `ratelimit-reset`, `x-ratelimit-used`, ... that the gateway does not
    // write), so a caller never reads the upstream's limits next to the gateway's.
    if headers.keys().any(is_rate_limit_header) {
        let names: Vec<HeaderName> = headers
            .keys()
            .filter(|n| is_rate_limit_header(n))
            .cloned()
            .collect();
        for name in names {
            headers.remove(name);
        }
    }
    if !decision.enforced {
        return;
    }
    // A decision on another chain than `fixed` (never, in the gateway) gets its values
    // formatted here rather than wrong ones.
    let own;
    let fixed = if fixed.limits.len() == decision.statuses.len() {
        fixed
    } else {
        own = ChainHeaders::from_statuses(&decision.statuses);
        &own
    };
    // Room for the (up to) twelve values at once: the map hyper parsed holds just its own
    // headers, and would otherwise grow (and rehash) twice on the way. A map too large to grow
    // is left to `insert`, which then fails the same way.
    let _ = headers.try_reserve(ALL.len() + 2);
    // A refusal that no wait can cure (a limit of 0, or a cost above a limit's max) is decided
    // without reading the store: it has no time to announce (a reset of 0 would invite an
    // immediate retry, forever), and the other limits' states are unknown.
    let never = !decision.admitted && decision.retry_after.is_none();
    let mut b = Buf::new();
    if let Some(i) = primary_index(decision) {
        let p = &decision.statuses[i];
        headers.insert(X_LIMIT, fixed.limits[i].max.clone());
        headers.insert(X_REMAINING, p.remaining.into());
        headers.insert(POLICY, fixed.limits[i].policy.clone());
        b.quoted(p.scope.as_str());
        b.push(b";r=");
        b.u64(p.remaining);
        if !never {
            b.push(b";t=");
            b.u64(ceil_secs(p.reset));
        }
        b.insert(headers, RATELIMIT);
    }
    if never {
        // Only the refusing limit's own state is known.
        if let Some(i) = decision.refused_by.filter(|&i| i < decision.statuses.len()) {
            let (limit, remaining) = match decision.statuses[i].charge {
                Charge::Admission => (LIMIT_REQ, REMAINING_REQ),
                Charge::Reactive => (LIMIT_TOK, REMAINING_TOK),
            };
            headers.insert(limit, fixed.limits[i].max.clone());
            headers.insert(remaining, decision.statuses[i].remaining.into());
        }
        return;
    }
    if let Some(i) = most_restrictive_index(decision, Charge::Admission) {
        let r = &decision.statuses[i];
        headers.insert(LIMIT_REQ, fixed.limits[i].max.clone());
        headers.insert(REMAINING_REQ, r.remaining.into());
        b.clear();
        b.openai_duration(r.reset);
        b.insert(headers, RESET_REQ);
    }
    if let Some(i) = most_restrictive_index(decision, Charge::Reactive) {
        let t = &decision.statuses[i];
        headers.insert(LIMIT_TOK, fixed.limits[i].max.clone());
        headers.insert(REMAINING_TOK, t.remaining.into());
        b.clear();
        b.openai_duration(t.reset);
        b.insert(headers, RESET_TOK);
    }
    if let (false, Some(wait)) = (decision.admitted, decision.retry_after) {
        headers.insert(RETRY_AFTER, ceil_secs(wait).into());
        headers.insert(RETRY_AFTER_MS, ceil_millis(wait).into());
    }
}

/// `Retry-After` (whole seconds) and `retry-after-ms` for a wait, rounded up: for refusals that
/// no rate decision describes (a spent budget).
pub fn apply_retry_after(headers: &mut HeaderMap, wait: Duration) {
    headers.insert(RETRY_AFTER, ceil_secs(wait).into());
    headers.insert(RETRY_AFTER_MS, ceil_millis(wait).into());
}

const IN_FLIGHT_LIMIT: HeaderName = HeaderName::from_static("x-floodgate-in-flight-limit");
const IN_FLIGHT_REMAINING: HeaderName = HeaderName::from_static("x-floodgate-in-flight-remaining");
const IN_FLIGHT_SCOPE: HeaderName = HeaderName::from_static("x-floodgate-in-flight-scope");

/// The concurrency headers (docs/design.md §9): the most restrictive enforced concurrency
/// limit's `x-floodgate-in-flight-limit` (its max), `-remaining` (slots left for other requests,
/// this one's taken) and `-scope` (its kind, never its id). The refusing limit on a concurrency
/// refusal. Nothing for a chain without concurrency limits. An upstream's headers of these
/// names are replaced.
pub fn apply_in_flight(headers: &mut HeaderMap, decision: &ChainDecision) {
    let Some(s) = decision.most_restrictive_in_flight() else {
        return;
    };
    headers.insert(IN_FLIGHT_LIMIT, s.max.into());
    headers.insert(IN_FLIGHT_REMAINING, s.remaining().into());
    headers.insert(IN_FLIGHT_SCOPE, HeaderValue::from_static(s.scope.as_str()));
}

/// Whether `name` is one of [`ALL`]: all of them start with `x-ratelimit-` or `ratelimit`.
fn is_rate_limit_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    n.starts_with("x-ratelimit-") || n.starts_with("ratelimit")
}

/// A header value built on the stack: no `fmt` machinery and no `String` per value.
struct Buf {
    bytes: [u8; 64],
    len: usize,
}

impl Buf {
    fn new() -> Buf {
        Buf {
            bytes: [0; 64],
            len: 0,
        }
    }

    fn clear(&mut self) {
        self.len = 0;
    }

    /// Appends `b`, or as much as fits (never more than 64 bytes: the longest value, a
    /// `"business_unit";q=<20 digits>;w=<20 digits>`, has 59).
    fn push(&mut self, b: &[u8]) {
        let n = b.len().min(self.bytes.len() - self.len);
        self.bytes[self.len..self.len + n].copy_from_slice(&b[..n]);
        self.len += n;
    }

    fn quoted(&mut self, s: &str) {
        self.push(b"\"");
        self.push(s.as_bytes());
        self.push(b"\"");
    }

    fn u64(&mut self, mut n: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }

    /// See [`openai_duration`].
    fn openai_duration(&mut self, d: Duration) {
        if d.is_zero() {
            return self.push(b"0s");
        }
        // Below a second in whole milliseconds, unless rounding up makes it a whole second
        // (999.5 ms is `1s`, not `1000ms`).
        if ceil_millis(d) < 1000 {
            self.u64(ceil_millis(d));
            return self.push(b"ms");
        }
        let total = ceil_secs(d);
        let (h, m, s) = (total / 3600, total / 60 % 60, total % 60);
        if h > 0 {
            self.u64(h);
            self.push(b"h");
        }
        if h > 0 || m > 0 {
            self.u64(m);
            self.push(b"m");
        }
        self.u64(s);
        self.push(b"s");
    }

    fn value(&self) -> Option<HeaderValue> {
        // Only digits, letters, quotes, `_` and `;=`: always a valid header value.
        HeaderValue::from_bytes(&self.bytes[..self.len]).ok()
    }

    fn insert(&self, headers: &mut HeaderMap, name: HeaderName) {
        if let Some(v) = self.value() {
            headers.insert(name, v);
        }
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
    let mut b = Buf::new();
    b.openai_duration(d);
    String::from_utf8_lossy(&b.bytes[..b.len]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_durations() {
        assert_eq!(openai_duration(Duration::ZERO), "0s");
        assert_eq!(openai_duration(Duration::from_micros(11_200)), "12ms");
        assert_eq!(openai_duration(Duration::from_millis(1000)), "1s");
        assert_eq!(openai_duration(Duration::from_micros(999_001)), "1s");
        assert_eq!(openai_duration(Duration::from_micros(998_999)), "999ms");
        assert_eq!(openai_duration(Duration::from_millis(41_001)), "42s");
        assert_eq!(openai_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(openai_duration(Duration::from_secs(3723)), "1h2m3s");
    }

    #[test]
    fn every_upstream_rate_limit_header_is_removed() {
        let mut h = HeaderMap::new();
        for (n, v) in [
            ("ratelimit-limit", "1"),
            ("ratelimit-remaining", "0"),
            ("ratelimit-reset", "999"),
            ("x-ratelimit-reset", "999"),
            ("x-ratelimit-used", "7"),
            ("x-ratelimit-limit-requests", "1"),
            ("content-type", "application/json"),
            ("retry-after", "3"),
        ] {
            h.insert(HeaderName::from_static(n), HeaderValue::from_static(v));
        }
        let decision = ChainDecision::unenforced(floodgate::Timestamp::from_secs(1));
        apply(
            &mut h,
            &decision,
            &ChainHeaders::new(&floodgate::Chain::default()),
        );
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["content-type", "retry-after"]);
    }

    #[test]
    fn rounding_up() {
        assert_eq!(ceil_secs(Duration::from_millis(41_001)), 42);
        assert_eq!(ceil_secs(Duration::from_secs(42)), 42);
        assert_eq!(ceil_millis(Duration::from_micros(1_001)), 2);
        assert_eq!(ceil_millis(Duration::from_millis(7)), 7);
    }
}
