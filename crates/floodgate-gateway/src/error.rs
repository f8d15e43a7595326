//! One error type for the HTTP surface: every failure becomes an OpenAI-style JSON error.
//!
//! Client mistakes keep their status and say what was wrong; internal failures (the store, the
//! upstream) become a generic 5xx whose cause is logged, never echoed to the caller.

use std::time::Duration;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use floodgate::{Charge, Period, ScopeKind, WindowLimit};
use serde_json::json;

/// The `Retry-After` of a concurrency refusal (docs/design.md §10). No retry time is known: a
/// slot frees when a running request ends, which can be at any moment. One second is the
/// shortest wait `Retry-After` can say; sooner, a client would mostly poll a limit still full.
pub const CONCURRENCY_RETRY: Duration = Duration::from_secs(1);

/// What went wrong with a request.
#[derive(Debug)]
pub enum AppError {
    /// No key, or a key the gateway does not know (401; nothing charged).
    Unauthorized,
    /// A limit of the chain refused the request (429).
    RateLimited {
        /// The kind of scope that refused (never its id).
        scope: ScopeKind,
        /// Requests or tokens.
        charge: Charge,
        /// The refusing limit.
        limit: WindowLimit,
        /// The exact wait; `None` if the request can never pass.
        retry_after: Option<Duration>,
    },
    /// A concurrency limit of the chain is full (429 `concurrency_limit_exceeded`; nothing
    /// charged).
    ConcurrencyLimited {
        /// The kind of scope that refused (never its id).
        scope: ScopeKind,
        /// Its `max_in_flight`.
        max: u64,
    },
    /// A budget of the chain has reached its cap for the current period (429
    /// `insufficient_quota`; nothing charged).
    BudgetExceeded {
        /// The kind of scope whose budget is spent (never its id).
        scope: ScopeKind,
        /// The budget's period.
        period: Period,
        /// Another exceeded budget whose period ends later (it sets the wait): its scope's kind
        /// and its period.
        later: Option<(ScopeKind, Period)>,
        /// The wait until every exceeded budget's period ends and the chain's rate limits have
        /// room, or why no wait lets the request through.
        retry_after: Result<Duration, NoWait>,
    },
    /// The request body could not be read, or was too large to inspect (nothing charged).
    BadRequest(String),
    /// A request body the gateway reads before admission came compressed (`Content-Encoding`),
    /// which it cannot read (415, with `Accept-Encoding: identity` as RFC 7694 has it; nothing
    /// charged).
    BodyEncodingUnsupported,
    /// A request body the gateway reads before admission is over `[server] max_body_mib` (413;
    /// nothing charged).
    BodyTooLarge {
        /// The limit, in MiB.
        max_mib: u64,
    },
    /// A request body the gateway reads before admission did not arrive within
    /// `[server] header_timeout_sec` (408; nothing charged).
    BodyTimeout,
    /// A WebSocket upgrade of a path other than `/v1/realtime`, which the gateway does not
    /// proxy (501; nothing charged).
    UpgradeUnsupported,
    /// A request body with a transfer coding other than `chunked` (`gzip, chunked`), which the
    /// gateway cannot pass on as sent (501; nothing charged).
    TransferCodingUnsupported,
    /// The process already has `[realtime] max_connections` live realtime sessions (429
    /// `too_many_connections`; nothing charged).
    TooManyConnections {
        /// The cap.
        max: usize,
        /// The `Retry-After` to send.
        retry_after: Duration,
    },
    /// The process holds `[server] max_buffered_mib` of request bodies read before admission
    /// (or the key holds half of it), and this request's body found no room in time (503
    /// `server_busy`; nothing charged).
    ServerBusy {
        /// The `Retry-After` to send.
        retry_after: Duration,
    },
    /// No such route (404).
    NotFound,
    /// The rate-limit store is unavailable and configured to fail closed (503; nothing charged).
    StoreUnavailable(String),
    /// `GET /alerts` could not read the refusal tally from Redis or its file (503).
    TallyUnavailable,
    /// The upstream could not be reached or broke the connection (502).
    UpstreamUnavailable(String),
    /// The upstream did not answer in time (504).
    UpstreamTimeout,
    /// Anything else (500); the cause is logged.
    Internal(String),
}

/// Why a budget refusal announces no wait: nothing lets the request through, ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoWait {
    /// A budget of this scope kind and period has a cap of 0.
    ZeroCap(ScopeKind, Period),
    /// A rate limit of the chain can never pass the request (a limit of 0, an estimate above a
    /// reserving limit's max).
    RateLimit,
}

impl AppError {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            AppError::Unauthorized => StatusCode::UNAUTHORIZED,
            AppError::RateLimited { .. }
            | AppError::ConcurrencyLimited { .. }
            | AppError::BudgetExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            AppError::BadRequest(_) => StatusCode::BAD_REQUEST,
            AppError::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            AppError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            AppError::BodyEncodingUnsupported => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            AppError::UpgradeUnsupported | AppError::TransferCodingUnsupported => {
                StatusCode::NOT_IMPLEMENTED
            }
            AppError::TooManyConnections { .. } => StatusCode::TOO_MANY_REQUESTS,
            AppError::NotFound => StatusCode::NOT_FOUND,
            AppError::StoreUnavailable(_)
            | AppError::TallyUnavailable
            | AppError::ServerBusy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            AppError::UpstreamUnavailable(_) => StatusCode::BAD_GATEWAY,
            AppError::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            AppError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The wait an answer of its own says to keep (`Retry-After`), for an error that waiting
    /// mends that is no limit's refusal (those carry the limit's wait in its headers).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            AppError::TooManyConnections { retry_after, .. }
            | AppError::ServerBusy { retry_after } => Some(*retry_after),
            AppError::ConcurrencyLimited { .. } => Some(CONCURRENCY_RETRY),
            _ => None,
        }
    }

    /// `(message, type, code)` of the OpenAI-style body.
    fn parts(&self) -> (String, &'static str, &'static str) {
        match self {
            AppError::Unauthorized => (
                "Incorrect or missing API key. Send `Authorization: Bearer <your key>`.".into(),
                "invalid_request_error",
                "invalid_api_key",
            ),
            AppError::RateLimited {
                scope,
                charge,
                limit,
                retry_after,
            } => {
                let unit = if charge.counts_tokens() {
                    "tokens"
                } else {
                    "requests"
                };
                let window = limit.window().as_secs();
                let mut message = format!(
                    "Rate limit exceeded for {scope}: limit {} {unit} per {window}s.",
                    limit.max()
                );
                match retry_after {
                    Some(w) => message.push_str(&format!(
                        " Please retry after {}s.",
                        crate::headers::ceil_secs(*w)
                    )),
                    None => message.push_str(" This request can never fit this limit."),
                }
                (message, "rate_limit_exceeded", "rate_limit_exceeded")
            }
            AppError::ConcurrencyLimited { scope, max } => (
                format!(
                    "Concurrency limit exceeded for {scope}: at most {max} requests at once. Please retry after {}s.",
                    crate::headers::ceil_secs(CONCURRENCY_RETRY)
                ),
                "rate_limit_exceeded",
                "concurrency_limit_exceeded",
            ),
            AppError::BudgetExceeded {
                scope,
                period,
                later,
                retry_after,
            } => {
                let too = match later {
                    Some((kind, period)) => {
                        format!(", and so is the {kind}'s {} cap", adjective(*period))
                    }
                    None => String::new(),
                };
                let spent = adjective(*period);
                let message = match retry_after {
                    Ok(wait) => format!(
                        "Budget exceeded for {scope}: its {spent} spend cap (UTC) is reached{too}. Please retry after {}s.",
                        crate::headers::ceil_secs(*wait)
                    ),
                    Err(NoWait::ZeroCap(kind, p)) if (*kind, *p) == (*scope, *period) => format!(
                        "Budget exceeded for {scope}: its {spent} spend cap is 0, so no request passes."
                    ),
                    Err(NoWait::ZeroCap(kind, p)) => format!(
                        "Budget exceeded for {scope}: its {spent} spend cap (UTC) is reached, and the {kind}'s {} cap is 0, so no request passes.",
                        adjective(*p)
                    ),
                    Err(NoWait::RateLimit) => format!(
                        "Budget exceeded for {scope}: its {spent} spend cap (UTC) is reached{too}, and this request can never pass a rate limit of its chain."
                    ),
                };
                (message, "insufficient_quota", "budget_exceeded")
            }
            AppError::BadRequest(why) => (why.clone(), "invalid_request_error", "invalid_request"),
            AppError::BodyEncodingUnsupported => (
                "This gateway reads this request's body before forwarding it and cannot read a compressed one: send it without Content-Encoding.".into(),
                "invalid_request_error",
                "unsupported_content_encoding",
            ),
            AppError::BodyTooLarge { max_mib } => (
                format!("The request body is over this gateway's limit of {max_mib} MiB."),
                "invalid_request_error",
                "request_too_large",
            ),
            AppError::BodyTimeout => (
                "The request body did not arrive in time.".into(),
                "invalid_request_error",
                "request_timeout",
            ),
            AppError::TransferCodingUnsupported => (
                "This gateway accepts request bodies sent as is or chunked, with no other transfer coding.".into(),
                "invalid_request_error",
                "transfer_coding_not_supported",
            ),
            AppError::UpgradeUnsupported => (
                "This gateway proxies WebSocket upgrades on /v1/realtime only.".into(),
                "invalid_request_error",
                "upgrade_not_supported",
            ),
            AppError::TooManyConnections { max, retry_after } => (
                format!(
                    "Too many realtime sessions on this gateway (at most {max} at once). Please retry after {}s.",
                    crate::headers::ceil_secs(*retry_after)
                ),
                "rate_limit_exceeded",
                "too_many_connections",
            ),
            AppError::ServerBusy { retry_after } => (
                format!(
                    "The gateway is holding as many request bodies as it may. Please retry after {}s.",
                    crate::headers::ceil_secs(*retry_after)
                ),
                "api_error",
                "server_busy",
            ),
            AppError::NotFound => (
                "Unknown path: the gateway serves /v1/..., /healthz and /readyz.".into(),
                "invalid_request_error",
                "not_found",
            ),
            AppError::StoreUnavailable(_) => (
                "The rate limiter is unavailable. Please retry shortly.".into(),
                "api_error",
                "rate_limiter_unavailable",
            ),
            AppError::TallyUnavailable => (
                "The refusal tally cannot be read now. Please retry shortly.".into(),
                "api_error",
                "tally_unavailable",
            ),
            AppError::UpstreamUnavailable(_) => (
                "The upstream API could not be reached.".into(),
                "api_error",
                "upstream_unavailable",
            ),
            AppError::UpstreamTimeout => (
                "The upstream API did not answer in time.".into(),
                "api_error",
                "upstream_timeout",
            ),
            AppError::Internal(_) => (
                "Internal error in the gateway.".into(),
                "api_error",
                "internal_error",
            ),
        }
    }
}

/// How a budget's period reads in a message: "daily", "monthly".
pub fn adjective(period: Period) -> &'static str {
    match period {
        Period::Day => "daily",
        Period::Month => "monthly",
    }
}

/// A store that could not decide: 503 when it fails closed (`Unavailable`), any other failure
/// an internal error (500, its cause logged, never echoed).
impl From<floodgate::Error> for AppError {
    fn from(e: floodgate::Error) -> AppError {
        match e {
            floodgate::Error::Unavailable(why) => AppError::StoreUnavailable(why),
            other => AppError::Internal(other.to_string()),
        }
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        match &self {
            // The store logs the outage once; the request line (status 503, decision
            // `store_error`) says the rest, so this is no warning per request.
            AppError::StoreUnavailable(cause) => {
                tracing::debug!(%cause, "rate-limit store unavailable: failing closed")
            }
            AppError::UpstreamUnavailable(cause) => tracing::warn!(%cause, "upstream unavailable"),
            AppError::UpstreamTimeout => tracing::warn!("upstream timed out"),
            AppError::Internal(cause) => tracing::error!(%cause, "internal error"),
            _ => {}
        }
        let (message, kind, code) = self.parts();
        let body = json!({
            "error": { "message": message, "type": kind, "param": null, "code": code }
        });
        let mut resp = (self.status(), Json(body)).into_response();
        if let AppError::BodyEncodingUnsupported = &self {
            resp.headers_mut().insert(
                axum::http::header::ACCEPT_ENCODING,
                axum::http::HeaderValue::from_static("identity"),
            );
        }
        if let Some(wait) = self.retry_after() {
            crate::headers::apply_retry_after(resp.headers_mut(), wait);
        }
        resp
    }
}
