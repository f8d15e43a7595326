//! The routes the gateway answers itself: `/healthz`, `/readyz`, `/alerts`; 404 for the rest.

use axum::extract::Request;
use axum::http::header::{ALLOW, AUTHORIZATION};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::state::AppState;
use crate::error::AppError;

/// The routes the gateway answers itself.
enum Local {
    Health,
    Ready,
    Alerts,
}

/// Answers a request for anything but `/v1/...`.
pub(super) async fn answer(state: &AppState, req: Request) -> Response {
    let local = match req.uri().path() {
        "/healthz" => Local::Health,
        "/readyz" => Local::Ready,
        "/alerts" if state.live().alerts_secret.is_some() => Local::Alerts,
        _ => return AppError::NotFound.into_response(),
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return (StatusCode::METHOD_NOT_ALLOWED, [(ALLOW, "GET,HEAD")]).into_response();
    }
    match local {
        Local::Health => "ok\n".into_response(),
        Local::Ready => readyz(state).await,
        Local::Alerts if alerts_authorized(state, &req) => alerts(state).await,
        Local::Alerts => AppError::Unauthorized.into_response(),
    }
}

async fn readyz(state: &AppState) -> Response {
    let start = std::time::Instant::now();
    let pinged = crate::store::ping(state.store()).await;
    let metrics = state.metrics();
    metrics.store_call(
        crate::metrics::StoreOp::Ping,
        start.elapsed(),
        pinged.is_err(),
    );
    state.note_breaker(pinged.is_err());
    match pinged {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "not ready: the store cannot decide");
            (StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n").into_response()
        }
    }
}

/// Whether `req` carries the `[alerts] secret` as its bearer token, compared by digest.
fn alerts_authorized(state: &AppState, req: &Request) -> bool {
    let presented = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| <[u8; 32]>::from(Sha256::digest(token.trim().as_bytes())));
    match (presented, state.live().alerts_secret) {
        (Some(presented), Some(secret)) => crate::auth::same_digest(&presented, &secret),
        _ => false,
    }
}

/// `GET /alerts`: the refusal tally as `rate_limit` alerts.
async fn alerts(state: &AppState) -> Response {
    match state.tally().alerts().await {
        Ok(alerts) => axum::Json(serde_json::json!({ "alerts": alerts })).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "GET /alerts: the tally cannot be read");
            AppError::TallyUnavailable.into_response()
        }
    }
}
