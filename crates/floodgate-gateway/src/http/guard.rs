//! Checks before admission: what a request must be for the gateway to forward it as sent and
//! meter its answer. A request that fails one is refused with nothing charged; a metered
//! completion's body is read (under the body cap and the header timeout) and rewritten here,
//! before admission, so that a body that cannot be read costs nothing.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::header::{
    ACCEPT_ENCODING, CONNECTION, CONTENT_ENCODING, CONTENT_LENGTH, TRANSFER_ENCODING, UPGRADE,
};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method};

use crate::access_log::Decision;
use crate::error::AppError;
use crate::openai::paths::{
    has_dot_segment, is_completion_path, is_generating_request, is_responses_path,
};
use crate::openai::request::{StreamRequest, check_responses_request, prepare_request};

/// What the checks need to know of the chain and the server.
pub(super) struct Rules {
    /// The chain meters its answers (a token limit or a budget).
    pub(super) metered: bool,
    /// The chain has budgets: the request's model is read to price a response that names none.
    pub(super) want_model: bool,
    /// `[server] max_body_mib`.
    pub(super) max_body_mib: u64,
    /// `[server] header_timeout_sec`: a body read before admission must arrive within it.
    pub(super) body_timeout: Duration,
}

/// A request that passed the checks, ready to be admitted and forwarded.
pub(super) struct Checked {
    /// Its head, as it will be forwarded.
    pub(super) parts: Parts,
    /// Its body, as it will be forwarded.
    pub(super) body: Body,
    /// For a streaming completion, what its caller asked for.
    pub(super) stream: Option<StreamRequest>,
    /// The model the request names (read only for a chain with budgets).
    pub(super) model: Option<String>,
    /// Its answer is charged its usage: a metered request that makes the upstream generate.
    pub(super) generating: bool,
}

/// A refusal: the error to answer and how the log line names it.
pub(super) type Refusal = (AppError, Decision);

/// Whether `req` asks to switch to a WebSocket: proxied on `/v1/realtime` (the Realtime API),
/// refused elsewhere. Other `Upgrade` offers (`h2c`) are optional for a server to take (RFC 9110,
/// 7.8): the header is dropped as hop-by-hop and the request served over HTTP/1.1.
pub(super) fn asks_for_websocket(req: &Request) -> bool {
    if !req.headers().contains_key(UPGRADE) {
        return false;
    }
    let lists = |name, token: &str| {
        req.headers().get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    lists(UPGRADE, "websocket") && lists(CONNECTION, "upgrade")
}

/// Checks `req` (not a WebSocket upgrade) under `rules`, and for a metered completion or
/// Responses create reads its body: a streaming completion is rewritten to ask the upstream for
/// its usage.
pub(super) async fn check(req: Request, rules: &Rules) -> Result<Checked, Refusal> {
    if req
        .headers()
        .get_all(TRANSFER_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked"))
    {
        // hyper takes the chunked framing off `gzip, chunked` and leaves the gzip: forwarded
        // without the header (hop-by-hop), the upstream would read compressed bytes as JSON.
        return Err((
            AppError::TransferCodingUnsupported,
            Decision::TransferCodingUnsupported,
        ));
    }
    if has_dot_segment(req.uri().path()) {
        // `/v1/../admin` leaves `/v1/` at an upstream (or a proxy before it) that resolves dot
        // segments, and `/v1/chat/completions/.` is a completion path that metering would miss.
        let err = AppError::BadRequest("The request path has a `.` or `..` segment.".into());
        return Err((err, Decision::BadRequest));
    }
    let metered = rules.metered;
    // Only the answer to a request that made the upstream generate is charged its usage.
    let generating = metered && is_generating_request(req.method(), req.uri().path());
    let (mut parts, body) = req.into_parts();
    if metered {
        // Usage is read from the response as it passes: it must come uncompressed.
        parts.headers.remove(ACCEPT_ENCODING);
    }
    // Read only for a metered POST: every other request passes without looking at its path.
    let read = metered && parts.method == Method::POST;
    let completion = read && is_completion_path(parts.uri.path());
    // A Responses API create is read to refuse a background response, which cannot be metered.
    let responses = read && !completion && is_responses_path(parts.uri.path());
    let mut checked = Checked {
        parts,
        body: Body::empty(),
        stream: None,
        model: None,
        generating,
    };
    if !(completion || responses) {
        checked.body = body;
        return Ok(checked);
    }
    let bytes = read_body(&checked.parts, body, rules).await?;
    if responses {
        check_responses_request(&bytes).map_err(bad_request)?;
        checked.body = Body::from(bytes);
        return Ok(checked);
    }
    let prepared = prepare_request(bytes, rules.want_model).map_err(bad_request)?;
    checked.stream = prepared.stream;
    checked.model = prepared.model;
    checked
        .parts
        .headers
        .insert(CONTENT_LENGTH, HeaderValue::from(prepared.body.len()));
    checked.body = Body::from(prepared.body);
    Ok(checked)
}

fn bad_request(why: String) -> Refusal {
    (AppError::BadRequest(why), Decision::BadRequest)
}

/// Reads a body that must be read before admission: uncompressed, at most `[server]
/// max_body_mib` (a body announced larger is refused before a byte of it is read), within the
/// header timeout.
async fn read_body(parts: &Parts, body: Body, rules: &Rules) -> Result<bytes::Bytes, Refusal> {
    if parts
        .headers
        .get(CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))
    {
        // Forwarded unread, it could ask for a stream or a background response that goes
        // uncharged.
        return Err((
            AppError::BodyEncodingUnsupported,
            Decision::BodyEncodingUnsupported,
        ));
    }
    let max_mib = rules.max_body_mib;
    let too_large = || (AppError::BodyTooLarge { max_mib }, Decision::BodyTooLarge);
    let max = usize::try_from(max_mib << 20).unwrap_or(usize::MAX);
    let announced = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max_mib << 20) {
        return Err(too_large());
    }
    // Read under the header timeout too: a caller trickling its body would otherwise hold the
    // connection (and up to `max` of memory) for as long as it likes.
    let read = axum::body::to_bytes(body, max);
    match tokio::time::timeout(rules.body_timeout, read).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e))
            if std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>()) =>
        {
            Err(too_large())
        }
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "request body unreadable");
            Err(bad_request("The request body could not be read.".into()))
        }
        Err(_) => Err((AppError::BodyTimeout, Decision::BodyTimeout)),
    }
}
