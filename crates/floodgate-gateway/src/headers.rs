//! Rate-limit response headers (docs/design.md §6). The rendering is the library's
//! (`floodgate::http`), shared with its tower layer; what is the gateway's own is that a
//! proxied response shows only the gateway's view: the upstream's rate-limit headers go.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use floodgate::ChainDecision;

pub use floodgate::http::{ALL, ChainHeaders, ceil_millis, ceil_secs, openai_duration, primary};

/// Removes upstream rate-limit headers, then writes the decision's. A decision taken without the
/// store (failed open) has no limit state: nothing is written. `fixed` holds the fixed values of
/// the decision's chain ([`ChainHeaders::new`] of that chain).
pub fn apply(headers: &mut HeaderMap, decision: &ChainDecision, fixed: &ChainHeaders) {
    // One pass over the (few) headers present instead of ten hashed lookups: upstreams rarely
    // send rate-limit headers of their own.
    // Every upstream header of the families the gateway speaks goes (`x-ratelimit-*`,
    // `ratelimit*`: also `ratelimit-reset`, `x-ratelimit-used`, ... that the gateway does not
    // write; and the concurrency headers, `x-floodgate-in-flight-*`, which a chain without
    // concurrency limits does not write), so a caller never reads the upstream's limits next to
    // the gateway's, or in place of them. (An upstream's own `Retry-After` on its 429 or 503 is
    // kept: it is still true for the caller.)
    if headers.keys().any(is_limit_header) {
        let names: Vec<HeaderName> = headers
            .keys()
            .filter(|n| is_limit_header(n))
            .cloned()
            .collect();
        for name in names {
            headers.remove(name);
        }
    }
    floodgate::http::apply(headers, decision, fixed);
}

/// `Retry-After` (whole seconds) and `retry-after-ms` for a wait, rounded up: for refusals that
/// no rate decision describes (a spent budget).
pub fn apply_retry_after(headers: &mut HeaderMap, wait: Duration) {
    floodgate::http::apply_retry_after(headers, wait);
}

const IN_FLIGHT_LIMIT: HeaderName = HeaderName::from_static("x-floodgate-in-flight-limit");
const IN_FLIGHT_REMAINING: HeaderName = HeaderName::from_static("x-floodgate-in-flight-remaining");
const IN_FLIGHT_SCOPE: HeaderName = HeaderName::from_static("x-floodgate-in-flight-scope");

/// The concurrency headers (docs/design.md §10): the most restrictive enforced concurrency
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

/// Whether `name` is of the families of [`ALL`] (all of them start with `x-ratelimit-` or
/// `ratelimit`) or a concurrency header ([`apply_in_flight`]).
fn is_limit_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    n.starts_with("x-ratelimit-")
        || n.starts_with("ratelimit")
        || n.starts_with("x-floodgate-in-flight-")
}

#[cfg(test)]
mod tests {
    use super::*;

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
            // Another floodgate's, behind this one, whose chain has concurrency limits.
            ("x-floodgate-in-flight-remaining", "0"),
            ("x-floodgate-in-flight-limit", "4"),
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
}
