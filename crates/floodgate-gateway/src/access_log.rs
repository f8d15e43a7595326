//! The request log: one `info` line per request, written here and nowhere else
//! (docs/design.md §8). Every answer the gateway gives names its [`Decision`]; a proxied one
//! writes its line when its body is done, with the tokens it was charged.
//!
//! A line carries the key's id (never its secret), the method, the path (never the query's
//! values beyond the path, never a header), the status, the latency in milliseconds and the
//! decision; a metered answer adds `tokens`.

use std::sync::Arc;
use std::time::Instant;

use axum::http::{Method, StatusCode, Uri};
use floodgate::ScopeKind;

/// The target of the request line (`crate::logs` writes it).
pub(crate) const TARGET: &str = module_path!();

/// What the gateway decided for a request, as its log line names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No key, or one the gateway does not know (401).
    Unauthenticated,
    /// Admitted by every limit and budget; charged.
    Admitted,
    /// Let through unchecked: the store could not decide and fails open.
    Unenforced,
    /// Refused by a rate limit of this scope (429).
    Refused(ScopeKind),
    /// Refused by a full concurrency limit (`max_in_flight`) of this scope (429).
    InFlight(ScopeKind),
    /// Refused without a refusing limit to name (an internal inconsistency; 500).
    RefusedUnnamed,
    /// Refused by a spent budget of this scope (429 `insufficient_quota`).
    Budget(ScopeKind),
    /// A request the gateway cannot read or forward as sent (400).
    BadRequest,
    /// A WebSocket upgrade of a path other than the Realtime API's (501).
    UpgradeUnsupported,
    /// A transfer coding other than `chunked` (501).
    TransferCodingUnsupported,
    /// A compressed body that must be read before admission (415).
    BodyEncodingUnsupported,
    /// A body over `[server] max_body_mib` (413).
    BodyTooLarge,
    /// A body that did not arrive within `[server] header_timeout_sec` (408).
    BodyTimeout,
    /// The process has `[realtime] max_connections` live sessions (429).
    TooManyConnections,
    /// The store could not decide and fails closed (503), or failed otherwise (500).
    StoreError,
    /// No room for the body among those the process holds before admission (503).
    ServerBusy,
}

impl Decision {
    /// The name the log line gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Unauthenticated => "unauthenticated",
            Decision::Admitted => "admitted",
            Decision::Unenforced => "unenforced",
            Decision::Refused(scope) => match scope {
                ScopeKind::Key => "refused:key",
                ScopeKind::Project => "refused:project",
                ScopeKind::Team => "refused:team",
                ScopeKind::BusinessUnit => "refused:business_unit",
                ScopeKind::Org => "refused:org",
                ScopeKind::Customer => "refused:customer",
                ScopeKind::Gateway => "refused:gateway",
            },
            Decision::InFlight(scope) => match scope {
                ScopeKind::Key => "in_flight:key",
                ScopeKind::Project => "in_flight:project",
                ScopeKind::Team => "in_flight:team",
                ScopeKind::BusinessUnit => "in_flight:business_unit",
                ScopeKind::Org => "in_flight:org",
                ScopeKind::Customer => "in_flight:customer",
                ScopeKind::Gateway => "in_flight:gateway",
            },
            Decision::RefusedUnnamed => "refused",
            Decision::Budget(scope) => match scope {
                ScopeKind::Key => "budget:key",
                ScopeKind::Project => "budget:project",
                ScopeKind::Team => "budget:team",
                ScopeKind::BusinessUnit => "budget:business_unit",
                ScopeKind::Org => "budget:org",
                ScopeKind::Customer => "budget:customer",
                ScopeKind::Gateway => "budget:gateway",
            },
            Decision::BadRequest => "bad_request",
            Decision::UpgradeUnsupported => "upgrade_unsupported",
            Decision::TransferCodingUnsupported => "transfer_coding_unsupported",
            Decision::BodyEncodingUnsupported => "body_encoding_unsupported",
            Decision::BodyTooLarge => "body_too_large",
            Decision::BodyTimeout => "body_timeout",
            Decision::TooManyConnections => "too_many_connections",
            Decision::StoreError => "store_error",
            Decision::ServerBusy => "server_busy",
        }
    }
}

/// Writes a request's line: `key` is `None` for a caller not authenticated.
pub fn write(
    key: Option<&str>,
    method: &Method,
    path: &str,
    status: StatusCode,
    start: Instant,
    decision: Decision,
    tokens: Option<u64>,
) {
    tracing::info!(
        key = %key.unwrap_or("-"),
        method = %method,
        path,
        status = status.as_u16(),
        latency_ms = latency_ms(start),
        decision = decision.as_str(),
        tokens,
        "request"
    );
}

/// Whether a line would be written (`RUST_LOG` lets `info` of this module through): with the
/// log off, an unmetered body goes out without a wrapper to write it.
pub fn enabled() -> bool {
    tracing::enabled!(tracing::Level::INFO)
}

/// Milliseconds since `start` for the log line, in whole microseconds: `0.024`, not
/// `0.024173999999999998`.
pub fn latency_ms(start: Instant) -> f64 {
    start.elapsed().as_micros() as f64 / 1e3
}

/// The line of a request whose answer is still streaming, written when its body is done.
#[derive(Clone, Debug)]
pub struct PendingLine {
    /// The key's id.
    pub key: Arc<str>,
    /// The request method.
    pub method: Method,
    /// The request URI (only its path is logged).
    pub uri: Uri,
    /// The response status.
    pub status: StatusCode,
    /// When the request arrived.
    pub start: Instant,
    /// What was decided.
    pub decision: Decision,
}

impl PendingLine {
    /// Writes the line, with the tokens charged.
    pub fn write(&self, tokens: Option<u64>) {
        write(
            Some(&self.key),
            &self.method,
            self.uri.path(),
            self.status,
            self.start,
            self.decision,
            tokens,
        );
    }
}

/// Writes the line of a caller that went away while its request waited for the upstream
/// (hyper then drops the handler): status 499, nginx's "client closed request". The request was
/// admitted and charged; no response (and no token usage) follows.
pub struct CallerGone<'a> {
    key: &'a str,
    method: &'a Method,
    uri: &'a Uri,
    start: Instant,
    decision: Decision,
    armed: bool,
}

impl<'a> CallerGone<'a> {
    /// Armed: writes a 499 line if dropped before [`CallerGone::disarm`].
    pub fn new(
        key: &'a str,
        method: &'a Method,
        uri: &'a Uri,
        start: Instant,
        decision: Decision,
    ) -> CallerGone<'a> {
        CallerGone {
            key,
            method,
            uri,
            start,
            decision,
            armed: true,
        }
    }

    /// The upstream answered (or failed) with the caller still there: no line from here.
    pub fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CallerGone<'_> {
    fn drop(&mut self) {
        if self.armed {
            let status = StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST);
            write(
                Some(self.key),
                self.method,
                self.uri.path(),
                status,
                self.start,
                self.decision,
                None,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn latency_is_logged_in_whole_microseconds() {
        let start = Instant::now()
            .checked_sub(Duration::from_micros(1_500))
            .unwrap();
        let ms = latency_ms(start);
        assert!(ms >= 1.5, "{ms}");
        let shown = ms.to_string();
        let decimals = shown.split_once('.').map_or(0, |(_, d)| d.len());
        assert!(decimals <= 3, "{shown}");
    }

    #[test]
    fn every_decision_has_its_own_name() {
        let mut all = vec![
            Decision::Unauthenticated,
            Decision::Admitted,
            Decision::Unenforced,
            Decision::RefusedUnnamed,
            Decision::BadRequest,
            Decision::UpgradeUnsupported,
            Decision::TransferCodingUnsupported,
            Decision::BodyEncodingUnsupported,
            Decision::BodyTooLarge,
            Decision::BodyTimeout,
            Decision::TooManyConnections,
            Decision::StoreError,
            Decision::ServerBusy,
        ];
        for scope in ScopeKind::ALL {
            all.push(Decision::Refused(scope));
            all.push(Decision::Budget(scope));
        }
        let names: std::collections::HashSet<_> = all.iter().map(|d| d.as_str()).collect();
        assert_eq!(names.len(), all.len());
    }
}
