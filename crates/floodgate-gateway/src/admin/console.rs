//! The console: one page with its style and script, embedded in the binary (no CDN: it works
//! with no internet), and its sign-in. The page reads only the admin API.
//!
//! - `GET /` the page; `GET /console.css`, `GET /console.js` its assets;
//! - `POST /console/sign-in` `{"secret": "..."}`: the admin secret, checked in its turn
//!   (`session.rs`), answered with a session cookie (`HttpOnly; SameSite=Strict; Path=/`,
//!   `Secure` when the request came through TLS, which a proxy in front says with
//!   `X-Forwarded-Proto: https`) and the session's CSRF token;
//! - `GET /console/session`: the CSRF token of the session the cookie carries (a reloaded page
//!   stays signed in), 401 without one;
//! - `POST /console/sign-out`: ends the session (with its CSRF token).

use axum::Json;
use axum::body::Body;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, SET_COOKIE};
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::session::{COOKIE, SESSION_TTL, Session, Sessions, Verdict};
use super::wire::{Peer, busy, csrf, json_body, unix_now};

const PAGE: &str = include_str!("console/index.html");
const STYLE: &str = include_str!("console/console.css");
const SCRIPT: &str = include_str!("console/console.js");

/// The body of a sign-in.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignIn {
    secret: String,
}

/// The console's answer to `path`, or `None` for a path that is not the console's. `secret` is
/// the digest of `[admin] secret` (`None`: no sign-in succeeds).
pub(super) async fn route(
    sessions: &Sessions,
    secret: Option<&[u8; 32]>,
    path: &str,
    req: Request<Body>,
) -> Option<Response> {
    let method = req.method().clone();
    let get = method == Method::GET || method == Method::HEAD;
    let asset = |content_type: &'static str, body: &'static str| {
        if !get {
            return StatusCode::METHOD_NOT_ALLOWED.into_response();
        }
        (
            [
                (CONTENT_TYPE, content_type),
                // The binary is the version: no stale script after an upgrade.
                (CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response()
    };
    Some(match path {
        "/" | "/index.html" => asset("text/html; charset=utf-8", PAGE),
        "/console.css" => asset("text/css; charset=utf-8", STYLE),
        "/console.js" => asset("text/javascript; charset=utf-8", SCRIPT),
        "/console/session" if get => match sessions.from_headers(req.headers(), unix_now()) {
            Some(session) => signed_in(sessions, &session),
            None => not_signed_in(),
        },
        "/console/sign-in" if method == Method::POST => sign_in(sessions, secret, req).await,
        "/console/sign-out" if method == Method::POST => sign_out(sessions, req.headers()),
        "/console/session" | "/console/sign-in" | "/console/sign-out" => {
            StatusCode::METHOD_NOT_ALLOWED.into_response()
        }
        _ => return None,
    })
}

fn signed_in(sessions: &Sessions, session: &Session) -> Response {
    Json(json!({
        "csrf": sessions.csrf(session),
        "expires": session.expires,
    }))
    .into_response()
}

fn not_signed_in() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        Json(json!({ "error": { "message": "not signed in" } })),
    )
        .into_response()
}

async fn sign_in(sessions: &Sessions, secret: Option<&[u8; 32]>, req: Request<Body>) -> Response {
    let peer = req.extensions().get::<Peer>().map(|p| p.0);
    let secure = over_tls(req.headers());
    let body: SignIn = match json_body(req).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match sessions
        .check(&body.secret, secret, peer.map(|p| p.ip()))
        .await
    {
        Verdict::Right => {}
        Verdict::Wrong => {
            // The attempt is logged, never what was typed.
            tracing::warn!(peer = ?peer, "console sign-in refused: not the admin secret");
            return (
                StatusCode::UNAUTHORIZED,
                Json(json!({ "error": { "message": "that is not the admin secret" } })),
            )
                .into_response();
        }
        Verdict::Busy => return busy(),
    }
    let (cookie, session) = match sessions.issue(unix_now()) {
        Ok(issued) => issued,
        Err(e) => {
            tracing::error!(error = %e, "console sign-in: cannot make a session");
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        }
    };
    tracing::info!(peer = ?peer, session = %session.short_id(), "console sign-in");
    let mut response = signed_in(sessions, &session);
    let attributes = format!(
        "{COOKIE}={cookie}; Path=/; Max-Age={}; HttpOnly; SameSite=Strict{}",
        SESSION_TTL.as_secs(),
        if secure { "; Secure" } else { "" }
    );
    set_cookie(&mut response, &attributes);
    response
}

fn sign_out(sessions: &Sessions, headers: &HeaderMap) -> Response {
    let Some(session) = sessions.from_headers(headers, unix_now()) else {
        return not_signed_in();
    };
    if let Err(refused) = csrf(sessions, &session, headers) {
        return refused.into_response();
    }
    sessions.revoke(&session, unix_now());
    tracing::info!(session = %session.short_id(), "console sign-out");
    let mut response = StatusCode::NO_CONTENT.into_response();
    let secure = if over_tls(headers) { "; Secure" } else { "" };
    set_cookie(
        &mut response,
        &format!("{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict{secure}"),
    );
    response
}

fn set_cookie(response: &mut Response, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        response.headers_mut().insert(SET_COOKIE, v);
    }
}

/// Whether the request came over TLS: the admin listener speaks plain HTTP, so only through
/// a proxy in front that says so. Believing the header can only add `Secure`, which is never
/// less safe.
fn over_tls(headers: &HeaderMap) -> bool {
    headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|p| p.trim().eq_ignore_ascii_case("https"))
}
