//! The request pipeline (docs/design.md §8): every request passes through named phases, each in
//! one module and visited once.
//!
//! - [`route`] tells `/v1/...` (proxied) from the routes the gateway answers itself
//!   (`local`);
//! - `proxy` runs a proxied request: authenticate, `guard` (checks before admission), the
//!   one `admission` step, forward, meter;
//! - `realtime` runs a Realtime API upgrade through the handshake checks of its own, the same
//!   admission, then hands the session to [`crate::realtime`];
//! - every answer writes its one line through [`crate::access_log`].

mod admission;
mod guard;
mod local;
mod proxy;
mod realtime;
mod state;

use axum::Router;
use axum::extract::{Request, State};
use axum::response::Response;

pub use state::{AppState, Process};

/// The gateway's routes as an axum [`Router`], for embedding the gateway in an axum application:
/// `/v1/*` is proxied under the rate limits, `/healthz` and `/readyz` answer probes, `/alerts`
/// shows the refusal tally (with an `[alerts]` secret), everything else is 404. `run` serves the
/// same routes ([`route`]) without the router.
pub fn app(state: AppState) -> Router {
    Router::new()
        .fallback(|State(state): State<AppState>, req: Request| route(state, req))
        .with_state(state)
}

/// Answers one request: the routing of [`app`] and `run`.
///
/// `/v1/...` is told apart by its prefix rather than by a router: a router's lookup, its boxed
/// handler future and its extractors were a tenth of the gateway's instructions per request.
pub async fn route(state: AppState, req: Request) -> Response {
    match req.uri().path().strip_prefix("/v1/") {
        Some(rest) if !rest.is_empty() => proxy::proxy(state, req).await,
        _ => local::answer(&state, req).await,
    }
}
