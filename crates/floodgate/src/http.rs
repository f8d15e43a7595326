//! Rate-limit response headers: the most restrictive limit's state, in the three dialects that
//! clients read (classic `X-RateLimit-*`, IETF `RateLimit-Policy`/`RateLimit`, OpenAI
//! `x-ratelimit-*-{requests,tokens}`), plus `Retry-After`/`retry-after-ms` on a refusal
//! (docs/design.md §6). The gateway and the [tower layer](crate::tower) write them alike.
//!
//! A chain's decision is written by [`apply`], with the chain's fixed values formatted once
//! ([`ChainHeaders`]); a token bucket's answer by [`apply_bucket`]; one limit's state under a
//! policy name of the caller's (the rate limit service's rules) by [`apply_named`]. All only
//! insert: a caller that must not pass on another limiter's headers (a proxy's upstream) removes
//! those first.
//!
//! ```
//! use floodgate::http::{ChainHeaders, apply};
//! use floodgate::store::MemoryStore;
//! use floodgate::{Chain, ChainLimit, Charge, ScopeKind, WindowLimit};
//!
//! # async fn demo() -> Result<(), floodgate::Error> {
//! let chain = Chain::new(vec![ChainLimit::new(
//!     "org:acme", ScopeKind::Key, "alice", Charge::Admission, WindowLimit::per_minute(5),
//! )]);
//! let fixed = ChainHeaders::new(&chain); // once per chain
//! let decision = chain.admit(&MemoryStore::new(), 1).await?;
//! let mut headers = ::http::HeaderMap::new();
//! apply(&mut headers, &decision, &fixed);
//! assert_eq!(headers["x-ratelimit-remaining"], "4");
//! assert_eq!(headers["ratelimit-policy"], "\"key\";q=5;w=60");
//! # Ok(()) }
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(demo()).unwrap();
//! ```

use std::time::Duration;

use ::http::{HeaderMap, HeaderName, HeaderValue};

use crate::bucket::{Admission, BucketLimit};
use crate::chain::{ChainDecision, LimitStatus, ScopeKind};
use crate::limiter::{BucketName, Chain, TokenBucket};
use crate::window::{Charge, WindowLimit};

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

/// The rate-limit state headers this module writes (besides `Retry-After` and `retry-after-ms`):
/// all of them start with `x-ratelimit-` or `ratelimit`.
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

    /// The fixed header values of a chain with these limits (scope and limit of each, in chain
    /// order): for chains built per request from a fixed shape, whose ids never show in headers.
    pub fn of_limits(limits: impl IntoIterator<Item = (ScopeKind, WindowLimit)>) -> ChainHeaders {
        let limits = limits
            .into_iter()
            .map(|(scope, limit)| LimitHeaders::of(scope, limit))
            .collect();
        ChainHeaders { limits }
    }

    fn from_statuses(statuses: &[LimitStatus]) -> ChainHeaders {
        Self::of_limits(statuses.iter().map(|s| (s.scope, s.limit)))
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
    // Token limits, reactive or reserved, are described together by the `-tokens` headers.
    let tokens = charge.counts_tokens();
    let statuses = &decision.statuses;
    if let Some(r) = decision.refused_by
        && statuses
            .get(r)
            .is_some_and(|s| s.charge.counts_tokens() == tokens)
    {
        return Some(r);
    }
    statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.charge.counts_tokens() == tokens && !s.shadow)
        .min_by_key(|(_, s)| s.remaining)
        .map(|(i, _)| i)
}

/// Writes the decision's headers (inserting: a header of the same name is replaced). A decision
/// taken without the store (failed open) has no limit state: nothing is written. `fixed` holds
/// the fixed values of the decision's chain ([`ChainHeaders::new`] of that chain); for another
/// chain the values are formatted here instead.
pub fn apply(headers: &mut HeaderMap, decision: &ChainDecision, fixed: &ChainHeaders) {
    if !decision.enforced {
        return;
    }
    // A decision on another chain than `fixed` (never in the gateway; in the tower layer when a
    // request names fewer scopes than the builder has) gets its values formatted here rather
    // than wrong ones.
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
    // immediate retry, forever), and the other limits' states are unknown. (A concurrency
    // refusal has no retry time either, but every limit was read: its state is written.)
    let never = !decision.admitted
        && decision.retry_after.is_none()
        && decision.refused_in_flight().is_none();
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
            let (limit, remaining) = if decision.statuses[i].charge.counts_tokens() {
                (LIMIT_TOK, REMAINING_TOK)
            } else {
                (LIMIT_REQ, REMAINING_REQ)
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

/// Writes a token bucket's answer for one name, in the same dialects as a chain's: the bucket is
/// the one limit, its policy named by the limiter's name (`TokenBucket::new`'s first argument),
/// `q` its capacity and `w` the seconds it takes to fill from empty; the OpenAI trio is the
/// `-requests` one. An allowed request's reset is the time until the bucket is full again,
/// counted from the whole tokens left (an upper bound: the bucket also holds a fraction); a
/// denied one's is its exact wait, also sent as `Retry-After` and `retry-after-ms`. A request
/// that can never pass (`cost` above the capacity) announces no time.
///
/// ```
/// use floodgate::http::apply_bucket;
/// use floodgate::{Admission, Rate, TokenBucket};
/// use std::time::Duration;
///
/// const API: TokenBucket<str> = TokenBucket::new("api", 10, Rate::per_second(2));
/// let mut headers = ::http::HeaderMap::new();
/// let denied = Admission::Denied { retry_after: Some(Duration::from_millis(500)) };
/// apply_bucket(&mut headers, &API, &denied);
/// assert_eq!(headers["ratelimit-policy"], "\"api\";q=10;w=5");
/// assert_eq!(headers["ratelimit"], "\"api\";r=0;t=1");
/// assert_eq!(headers["retry-after-ms"], "500");
/// ```
pub fn apply_bucket<N: ?Sized + BucketName>(
    headers: &mut HeaderMap,
    bucket: &TokenBucket<N>,
    admission: &Admission,
) {
    let limit = bucket.limit();
    let (remaining, reset) = match *admission {
        Admission::Allowed { remaining } => (remaining, Some(time_to_full(limit, remaining))),
        Admission::Denied { retry_after } => (0, retry_after),
    };
    let _ = headers.try_reserve(ALL.len() + 2);
    let full = time_to_full(limit, 0);
    named(
        headers,
        bucket.name(),
        limit.capacity,
        full,
        remaining,
        reset,
    );
    headers.insert(LIMIT_REQ, limit.capacity.into());
    headers.insert(REMAINING_REQ, remaining.into());
    let Some(reset) = reset else { return };
    let mut b = Buf::new();
    b.openai_duration(reset);
    b.insert(headers, RESET_REQ);
    if !admission.is_allowed() {
        apply_retry_after(headers, reset);
    }
}

/// Writes one limit's state in the classic (`X-RateLimit-Limit`, `X-RateLimit-Remaining`) and
/// IETF (`RateLimit-Policy`, `RateLimit`) dialects, the policy named `name` (quoted and escaped
/// as a structured-field string, as a bucket's) rather than by a scope: for limits that a
/// config of the caller's names (the gateway's rate limit service names each by its rule).
/// `remaining` is the whole units left; `reset` the time until the limit is whole again, or the
/// exact wait on a refusal, and `None` for a refusal that no wait cures (`RateLimit` then
/// announces no time, as [`apply`] does). `Retry-After` is [`apply_retry_after`]'s to write.
///
/// ```
/// use floodgate::http::apply_named;
/// use floodgate::WindowLimit;
/// use std::time::Duration;
///
/// let mut headers = ::http::HeaderMap::new();
/// let limit = WindowLimit::per_second(10);
/// apply_named(&mut headers, "per \"ip\"", limit, 0, Some(Duration::from_millis(640)));
/// assert_eq!(headers["ratelimit-policy"], r#""per \"ip\"";q=10;w=1"#);
/// assert_eq!(headers["ratelimit"], r#""per \"ip\"";r=0;t=1"#);
/// apply_named(&mut headers, "ip", limit, 0, None);
/// assert_eq!(headers["ratelimit"], r#""ip";r=0"#);
/// ```
pub fn apply_named(
    headers: &mut HeaderMap,
    name: &str,
    limit: WindowLimit,
    remaining: u64,
    reset: Option<Duration>,
) {
    named(headers, name, limit.max(), limit.window(), remaining, reset);
}

/// [`apply_named`]'s four headers, for a limit of `max` units that is whole again after
/// `window`.
fn named(
    headers: &mut HeaderMap,
    name: &str,
    max: u64,
    window: Duration,
    remaining: u64,
    reset: Option<Duration>,
) {
    let name = sf_string(name);
    let policy = format!("{name};q={max};w={}", ceil_secs(window));
    let state = match reset {
        Some(t) => format!("{name};r={remaining};t={}", ceil_secs(t)),
        None => format!("{name};r={remaining}"),
    };
    headers.insert(X_LIMIT, max.into());
    headers.insert(X_REMAINING, remaining.into());
    insert_text(headers, POLICY, policy);
    insert_text(headers, RATELIMIT, state);
}

/// The time a bucket holding `tokens` whole tokens takes to be full.
fn time_to_full(limit: BucketLimit, tokens: u64) -> Duration {
    Duration::from_micros(limit.ttl_micros(tokens as f64))
}

/// `s` as a structured-field string (RFC 8941): quoted, with `"` and `\` escaped.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Inserts a formatted value; one that is no valid header value (a limiter named with control
/// characters) is left out rather than sent broken.
fn insert_text(headers: &mut HeaderMap, name: HeaderName, value: String) {
    if let Ok(v) = HeaderValue::try_from(value) {
        headers.insert(name, v);
    }
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
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
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
    use crate::Rate;

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
    fn rounding_up() {
        assert_eq!(ceil_secs(Duration::from_millis(41_001)), 42);
        assert_eq!(ceil_secs(Duration::from_secs(42)), 42);
        assert_eq!(ceil_millis(Duration::from_micros(1_001)), 2);
        assert_eq!(ceil_millis(Duration::from_millis(7)), 7);
    }

    fn texts(h: &HeaderMap) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = h
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("?").to_owned()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_bucket_speaks_every_dialect() {
        // 6 tokens, 1 every 10 s: full from empty in 60 s.
        const B: TokenBucket<str> =
            TokenBucket::new("login", 6, Rate::new(1, Duration::from_secs(10)));
        let mut h = HeaderMap::new();
        apply_bucket(&mut h, &B, &Admission::Allowed { remaining: 4 });
        let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            let mut v: Vec<_> = v
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            texts(&h),
            pairs(&[
                ("x-ratelimit-limit", "6"),
                ("x-ratelimit-remaining", "4"),
                ("ratelimit-policy", "\"login\";q=6;w=60"),
                ("ratelimit", "\"login\";r=4;t=20"),
                ("x-ratelimit-limit-requests", "6"),
                ("x-ratelimit-remaining-requests", "4"),
                ("x-ratelimit-reset-requests", "20s"),
            ])
        );
        let mut h = HeaderMap::new();
        let wait = Duration::from_millis(7_250);
        apply_bucket(
            &mut h,
            &B,
            &Admission::Denied {
                retry_after: Some(wait),
            },
        );
        assert_eq!(h["ratelimit"], "\"login\";r=0;t=8");
        assert_eq!(h["x-ratelimit-reset-requests"], "8s");
        assert_eq!(
            (&h["retry-after"], &h["retry-after-ms"]),
            (
                &"8".parse::<HeaderValue>().unwrap(),
                &"7250".parse::<HeaderValue>().unwrap()
            )
        );
        // Never: no time to announce.
        let mut h = HeaderMap::new();
        apply_bucket(&mut h, &B, &Admission::Denied { retry_after: None });
        assert_eq!(h["ratelimit"], "\"login\";r=0");
        assert!(h.get("retry-after").is_none() && h.get("x-ratelimit-reset-requests").is_none());
    }

    #[test]
    fn a_limiter_name_is_an_escaped_string() {
        assert_eq!(sf_string(r#"a"b\c"#), r#""a\"b\\c""#);
    }
}
