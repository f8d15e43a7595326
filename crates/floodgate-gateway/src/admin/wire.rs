//! What the admin listener's answers share: the peer of a request, the refusals before an
//! answer, JSON bodies, the CSRF check and the clock.

use std::net::SocketAddr;

use axum::Json;
use axum::body::Body;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};

use super::api;
use super::session::{Session, Sessions};
use crate::error::AppError;

/// The largest body an admin call reads (a reset, a sign-in).
pub(super) const MAX_BODY: usize = 64 * 1024;
/// The header a console call that changes state carries its CSRF token in.
pub(super) const CSRF_HEADER: &str = "x-csrf-token";

/// Why a call is refused before it is answered.
#[derive(Clone, Copy, Debug)]
pub(super) enum Refusal {
    /// No credential, or a wrong one (401).
    Unauthorized,
    /// Too many secret checks waiting (429).
    Busy,
    /// A console call that changes state without its CSRF token (403).
    NoCsrf,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Unauthorized => AppError::Unauthorized.into_response(),
            Refusal::Busy => busy(),
            Refusal::NoCsrf => (
                StatusCode::FORBIDDEN,
                Json(serde_json::json!({
                    "error": { "message": format!("a console call that changes state needs its `{CSRF_HEADER}` header") }
                })),
            )
                .into_response(),
        }
    }
}

/// The peer of an admin connection, put in each request's extensions by [`run`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Peer(pub(super) SocketAddr);

/// How long a request's body may take to arrive (`[server] header_timeout_sec`), put in each
/// request's extensions by [`run`]; [`BODY_WAIT`] without it.
#[derive(Clone, Copy, Debug)]
pub(super) struct BodyWait(pub(super) std::time::Duration);

/// 429: too many secret checks waiting; this one was not checked.
pub(super) fn busy() -> Response {
    (
        StatusCode::TOO_MANY_REQUESTS,
        [(axum::http::header::RETRY_AFTER, "1")],
        Json(serde_json::json!({
            "error": { "message": "too many sign-in attempts at once: try again in a second" }
        })),
    )
        .into_response()
}

/// Now, in Unix seconds.
pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// How long a JSON body of the admin API may take to arrive when the request says nothing.
const BODY_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// A JSON body of at most [`MAX_BODY`] bytes, sent as `application/json`, within the request's
/// [`BodyWait`].
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
    req: Request<Body>,
) -> Result<T, api::ApiError> {
    let is_json = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"));
    if !is_json {
        return Err(api::ApiError::BadRequest(
            "send the body as `content-type: application/json`".into(),
        ));
    }
    // A body trickled in holds its connection no longer than a request head may take.
    let wait = req
        .extensions()
        .get::<BodyWait>()
        .map_or(BODY_WAIT, |w| w.0);
    let read = tokio::time::timeout(wait, axum::body::to_bytes(req.into_body(), MAX_BODY));
    let bytes = read
        .await
        .map_err(|_| api::ApiError::BadRequest("the body did not arrive in time".into()))?
        .map_err(|_| api::ApiError::BadRequest(format!("a body of at most {MAX_BODY} bytes")))?;
    serde_json::from_slice(&bytes).map_err(|e| api::ApiError::BadRequest(format!("the body: {e}")))
}

/// A console call that changes state: it needs `session`'s CSRF token.
pub(super) fn csrf(
    sessions: &Sessions,
    session: &Session,
    headers: &HeaderMap,
) -> Result<(), Refusal> {
    let token = headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok());
    if token.is_some_and(|t| sessions.csrf_ok(session, t)) {
        Ok(())
    } else {
        Err(Refusal::NoCsrf)
    }
}
