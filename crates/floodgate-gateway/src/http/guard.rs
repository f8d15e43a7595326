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
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;

use crate::access_log::Decision;
use crate::buffers::{Buffers, HeldBody, Room};
use crate::error::AppError;
use crate::openai::paths::{
    defers_generation, has_dot_segment, is_completion_path, is_generating_request,
    is_responses_path,
};
use crate::openai::request::{
    Estimate, StreamRequest, check_responses_request, estimate, prepare_request,
};

/// The `Retry-After` of a body refused for want of room: bodies are read in seconds, and a short
/// wait spreads the retries of a crowd of callers.
pub(super) const BUSY_RETRY_AFTER: Duration = Duration::from_secs(5);

/// What the checks need to know of the chain and the server.
pub(super) struct Rules<'a> {
    /// The chain meters its answers (a token limit or a budget).
    pub(super) metered: bool,
    /// The chain has budgets: the request's model is read to price a response that names none.
    pub(super) want_model: bool,
    /// `[server] max_body_mib`.
    pub(super) max_body_mib: u64,
    /// `[server] header_timeout_sec`: a body read before admission must arrive within it.
    pub(super) body_timeout: Duration,
    /// The process's room for bodies read before admission.
    pub(super) buffers: &'a Buffers,
    /// The key's index, for its share of that room.
    pub(super) key: usize,
    /// `[gateway] default_max_output_tokens`: the output estimate of a request naming no cap.
    pub(super) default_output: u64,
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
    /// The tokens it is estimated to use at most, for a chain that reserves them: its body's
    /// length plus its output cap ([`estimate`](crate::openai::request::estimate)); 0 for a
    /// request whose body is not read (not a completion or Responses create).
    pub(super) estimate: Estimate,
    /// Its body goes on as the caller sends it (it was not read before admission).
    pub(super) streamed: bool,
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
pub(super) async fn check(req: Request, rules: &Rules<'_>) -> Result<Checked, Refusal> {
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
    if metered && req.method() == Method::POST && defers_generation(req.uri().path()) {
        // Its answer comes at once and carries no usage: the work (and its tokens) comes later,
        // where the gateway never sees it. As a background response is, it is refused to a key
        // whose tokens or spend are limited.
        let err = AppError::BadRequest(DEFERRED.into());
        return Err((err, Decision::BadRequest));
    }
    // Only the answer to a request that made the upstream generate is charged its usage.
    let generating = metered && is_generating_request(req.method(), req.uri().path());
    let (mut parts, body) = req.into_parts();
    if metered {
        // Usage is read from the response as it passes: it must come uncompressed. Said, not
        // just left unsaid: a request without `Accept-Encoding` accepts any coding (RFC 9110
        // §12.5.3).
        parts
            .headers
            .insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
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
        estimate: Estimate::default(),
        streamed: false,
    };
    if !(completion || responses) {
        checked.body = body;
        checked.streamed = true;
        return Ok(checked);
    }
    let (bytes, room) = read_body(&checked.parts, body, rules).await?;
    let want_model = rules.want_model;
    if responses {
        let (checked_body, bytes) = off_the_loop(bytes, move |b| {
            let verdict = check_responses_request(&b, want_model);
            (verdict, b)
        })
        .await;
        let (output, model) = checked_body.map_err(bad_request)?;
        checked.estimate = estimate(bytes.len(), output, rules.default_output);
        checked.model = model;
        checked.body = Body::new(HeldBody::new(bytes, room));
        return Ok(checked);
    }
    let sent_len = bytes.len();
    let prepared = off_the_loop(bytes, move |b| prepare_request(b, want_model))
        .await
        .map_err(bad_request)?;
    checked.estimate = estimate(sent_len, prepared.output, rules.default_output);
    checked.stream = prepared.stream;
    checked.model = prepared.model;
    // A body forwarded as it came keeps the one `Content-Length` it came with (hyper read
    // exactly that many bytes); a rewritten one, one that came chunked or with the length
    // repeated, is framed by one header of its length.
    let headers = &mut checked.parts.headers;
    let mut lengths = headers.get_all(CONTENT_LENGTH).iter();
    let framed_as_sent = prepared.body.len() == sent_len
        && lengths.next().is_some()
        && lengths.next().is_none()
        && !headers.contains_key(TRANSFER_ENCODING);
    if !framed_as_sent {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(prepared.body.len()));
    }
    checked.body = Body::new(HeldBody::new(prepared.body, room));
    Ok(checked)
}

/// Why a `POST` that starts work metered nowhere ([`defers_generation`]) is refused to a key
/// with a token limit or a budget.
const DEFERRED: &str = "This request starts work whose tokens come later, outside any answer \
    through the gateway (a Realtime session held elsewhere, a batch, a fine-tuning job or an \
    eval run), so they could not be counted: a key with a token limit or a budget cannot make \
    it.";

/// Bodies from this size up are parsed on the blocking pool: a large one (a base64 image, say)
/// would otherwise hold the worker's event loop, and every request on it, for the parse.
const PARSE_OFF_THE_LOOP: usize = 1 << 20;

/// `f(bytes)`, on the blocking pool for a large body, here for a small one.
async fn off_the_loop<T: Send + 'static>(
    bytes: Bytes,
    f: impl FnOnce(Bytes) -> T + Send + 'static,
) -> T {
    if bytes.len() < PARSE_OFF_THE_LOOP {
        return f(bytes);
    }
    match tokio::task::spawn_blocking(move || f(bytes)).await {
        Ok(done) => done,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Cancelled: the runtime is shutting down, and there is no one left to answer.
        Err(_) => std::future::pending().await,
    }
}

fn bad_request(why: String) -> Refusal {
    (AppError::BadRequest(why), Decision::BadRequest)
}

/// Reads a body that must be read before admission: uncompressed, at most `[server]
/// max_body_mib` (a body announced larger is refused before a byte of it is read), within the
/// header timeout, in room taken from the process's [`Buffers`] before its bytes are read (a
/// body with no room by the deadline is 503 `server_busy`). Returns the body and its room.
async fn read_body(parts: &Parts, body: Body, rules: &Rules<'_>) -> Result<(Bytes, Room), Refusal> {
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
    let announced = announced.and_then(|n| usize::try_from(n).ok());
    // A body waits for room up to the header timeout; then it is read under the header timeout
    // too: a caller trickling its body would otherwise hold the connection (and its room) for
    // as long as it likes. A body of unknown length takes room as it comes, within one timeout.
    let mut deadline = tokio::time::Instant::now() + rules.body_timeout;
    let busy = || {
        let retry_after = BUSY_RETRY_AFTER;
        (AppError::ServerBusy { retry_after }, Decision::ServerBusy)
    };
    let (buffers, key) = (rules.buffers, rules.key);
    let mut room = buffers.room();
    if let Some(n) = announced {
        buffers
            .take(&mut room, key, n, deadline)
            .await
            .map_err(|_| busy())?;
        deadline = tokio::time::Instant::now() + rules.body_timeout;
    }
    let read = async {
        let mut body = body;
        let mut data = BytesMut::with_capacity(announced.unwrap_or(0));
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                tracing::debug!(error = %e, "request body unreadable");
                bad_request("The request body could not be read.".into())
            })?;
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            if data.len() + chunk.len() > max {
                return Err(too_large());
            }
            if announced.is_none() {
                // A body of unknown length grows its buffer as it comes, up to twice its
                // length: it takes room for twice what it reads.
                buffers
                    .take(&mut room, key, 2 * chunk.len(), deadline)
                    .await
                    .map_err(|_| busy())?;
            }
            data.extend_from_slice(&chunk);
        }
        Ok(data.freeze())
    };
    match tokio::time::timeout_at(deadline, read).await {
        Ok(Ok(bytes)) => Ok((bytes, room)),
        Ok(Err(refusal)) => Err(refusal),
        Err(_) => Err((AppError::BodyTimeout, Decision::BodyTimeout)),
    }
}
