//! The one place routes and layers meet: [`app`] builds the router, [`run`] serves it until
//! shutdown, draining requests in flight.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::serve::ListenerExt;
use floodgate::{ChainDecision, Error as StoreError};
use tokio::net::TcpListener;

use crate::auth::{CUSTOMER_HEADER, Keys, ResolvedChain};
use crate::config::Config;
use crate::error::AppError;
use crate::headers::{self, ChainHeaders};
use crate::metering::{self, Meter, MeteredBody, RequestLog};
use crate::proxy::Upstream;
use crate::store::GatewayStore;

/// Largest completion request body read to inspect it (`stream`); larger ones are refused
/// with 400 before anything is charged.
const MAX_INSPECTED_BODY: usize = 32 * 1024 * 1024;

/// Everything a request needs; cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    keys: Keys,
    store: GatewayStore,
    upstream: Upstream,
}

impl AppState {
    /// State for `config` on `store`. Fails if the upstream's API key is missing.
    pub fn new(config: &Config, store: GatewayStore) -> Result<AppState, String> {
        Ok(AppState {
            inner: Arc::new(Inner {
                keys: Keys::from_config(config),
                store,
                upstream: Upstream::from_config(&config.upstream)?,
            }),
        })
    }

    /// The store.
    pub fn store(&self) -> &GatewayStore {
        &self.inner.store
    }

    /// The keys and their chains.
    pub fn keys(&self) -> &Keys {
        &self.inner.keys
    }

    /// The upstream.
    pub fn upstream(&self) -> &Upstream {
        &self.inner.upstream
    }
}

/// The gateway's router: `/v1/*` is proxied under the rate limits, `/healthz` and `/readyz`
/// answer probes, everything else is 404.
pub fn app(state: AppState) -> Router {
    // `/v1/...` is told apart by its prefix in the fallback rather than by a `/v1/{*rest}`
    // route: a wildcard route stores the rest of the path as a parameter (two strings and a
    // map entry) on every request, for a value the proxy never reads.
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(proxy_or_not_found)
        .with_state(state)
}

async fn proxy_or_not_found(state: State<AppState>, req: Request) -> Response {
    match req.uri().path().strip_prefix("/v1/") {
        Some(rest) if !rest.is_empty() => proxy(state, req).await,
        _ => not_found().await,
    }
}

/// Serves `app(state)` on `listener` until `shutdown` completes, then stops accepting and waits
/// for the requests in flight (streams included) to finish.
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = listener.tap_io(|tcp| {
        // Small request/response writes must not wait for Nagle.
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app(state))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<AppState>) -> Response {
    match crate::store::ping(state.store()).await {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "not ready: the store does not answer");
            (StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n").into_response()
        }
    }
}

async fn not_found() -> Response {
    AppError::NotFound.into_response()
}

/// Logs a request answered by the gateway itself.
fn log_local(key: Option<&str>, req: &Request, start: Instant, status: StatusCode, decision: &str) {
    tracing::info!(
        key = %key.unwrap_or("-"),
        method = %req.method(),
        path = req.uri().path(),
        status = status.as_u16(),
        latency_ms = start.elapsed().as_secs_f64() * 1e3,
        decision,
        "request"
    );
}

async fn proxy(State(state): State<AppState>, req: Request) -> Response {
    let start = Instant::now();
    let Some(key) = state.keys().authenticate(req.headers()).cloned() else {
        log_local(
            None,
            &req,
            start,
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
        );
        return AppError::Unauthorized.into_response();
    };
    let customer = req
        .headers()
        .get(CUSTOMER_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|c| !c.is_empty());
    let ResolvedChain {
        chain,
        headers: fixed,
    } = state.keys().chain_for(&key, customer);
    let metered = chain.has_reactive();

    // A streaming completion is rewritten to ask the upstream for usage; the body is read
    // before admission so that a body that cannot be read costs nothing.
    let (mut parts, body) = req.into_parts();
    let mut stream_req = None;
    let body =
        if metered && parts.method == Method::POST && parts.uri.path().ends_with("/completions") {
            let bytes = match axum::body::to_bytes(body, MAX_INSPECTED_BODY).await {
                Ok(b) => b,
                Err(e) => {
                    tracing::info!(key = %key.id, error = %e, "request body unreadable");
                    return AppError::BadRequest(format!(
                        "The request body could not be read (at most {} MiB).",
                        MAX_INSPECTED_BODY >> 20
                    ))
                    .into_response();
                }
            };
            let (bytes, s) = metering::prepare_request(bytes);
            stream_req = s;
            parts
                .headers
                .insert(CONTENT_LENGTH, HeaderValue::from(bytes.len()));
            Body::from(bytes)
        } else {
            body
        };

    let decision = match chain.admit(state.store(), 1).await {
        Ok(d) => d,
        Err(e) => {
            let req = Request::from_parts(parts, Body::empty());
            let err = match e {
                StoreError::Unavailable(why) => AppError::StoreUnavailable(why),
                other => AppError::Internal(other.to_string()),
            };
            log_local(Some(&key.id), &req, start, err.status(), "store_error");
            return err.into_response();
        }
    };
    if !decision.admitted {
        return refuse(
            &key.id,
            Request::from_parts(parts, Body::empty()),
            start,
            &decision,
            &fixed,
        );
    }
    let decision_name = if decision.enforced {
        "admitted"
    } else {
        "unenforced"
    };

    let method = parts.method.clone();
    let uri = parts.uri.clone();
    let upstream_req = Request::from_parts(parts, body);
    let resp = match state.upstream().send(upstream_req).await {
        Ok(r) => r,
        Err(err) => {
            tracing::info!(
                key = %key.id,
                method = %method,
                path = uri.path(),
                status = err.status().as_u16(),
                latency_ms = start.elapsed().as_secs_f64() * 1e3,
                decision = decision_name,
                "request"
            );
            let mut resp = err.into_response();
            headers::apply(resp.headers_mut(), &decision, &fixed);
            return resp;
        }
    };

    let (mut head, body) = resp.into_parts();
    headers::apply(&mut head.headers, &decision, &fixed);
    let meter = if !metered || !head.status.is_success() {
        Meter::None
    } else {
        let ctype = head
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if ctype.starts_with("text/event-stream") {
            let strip_usage = stream_req.is_some_and(|s| !s.caller_wants_usage);
            if strip_usage {
                head.headers.remove(CONTENT_LENGTH);
            }
            Meter::Sse { strip_usage }
        } else if ctype.starts_with("application/json") {
            Meter::Json
        } else {
            Meter::None
        }
    };
    if matches!(meter, Meter::None) && !metering::request_log_enabled() {
        // Nothing to read and no line to write when the body ends (the request log is off):
        // the upstream body goes out as it is, without a wrapper.
        return Response::from_parts(head, body);
    }
    let log = RequestLog {
        key: Arc::clone(&key.id),
        method,
        uri,
        status: head.status,
        start,
        decision: decision_name,
    };
    let body = MeteredBody::new(body, meter, state.store().clone(), chain, log);
    Response::from_parts(head, Body::new(body))
}

/// The 429 for a refused request, with the refusing limit's headers.
fn refuse(
    key: &str,
    req: Request,
    start: Instant,
    decision: &ChainDecision,
    fixed: &ChainHeaders,
) -> Response {
    let err = match decision.refusing() {
        Some(r) => AppError::RateLimited {
            scope: r.scope,
            charge: r.charge,
            limit: r.limit,
            retry_after: decision.retry_after,
        },
        None => AppError::Internal("refused without a refusing limit".into()),
    };
    let name = decision.refusing().map_or("refused", |r| match r.scope {
        floodgate::ScopeKind::Key => "refused:key",
        floodgate::ScopeKind::Project => "refused:project",
        floodgate::ScopeKind::Team => "refused:team",
        floodgate::ScopeKind::BusinessUnit => "refused:business_unit",
        floodgate::ScopeKind::Org => "refused:org",
        floodgate::ScopeKind::Customer => "refused:customer",
        floodgate::ScopeKind::Gateway => "refused:gateway",
    });
    log_local(Some(key), &req, start, err.status(), name);
    let mut resp = err.into_response();
    headers::apply(resp.headers_mut(), decision, fixed);
    resp
}
