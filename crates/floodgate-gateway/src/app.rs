//! The one place routes meet: [`route`] answers a request, [`run`] serves it over HTTP/1.1 until
//! shutdown, draining requests in flight, and [`app`] wraps it in an axum router for embedding.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{
    ACCEPT_ENCODING, AUTHORIZATION, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE,
    TRANSFER_ENCODING, UPGRADE,
};
use axum::http::{HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use floodgate::{BudgetDecision, Budgets, ChainDecision, Error as StoreError};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::{KeyEntry, Keys, ResolvedChain};
use crate::budgets::Prices;
use crate::config::Config;
use crate::error::AppError;
use crate::headers::{self, ChainHeaders};
use crate::metering::{self, Lingering, Meter, MeteredBody, RequestLog, Spend};
use crate::proxy::Upstream;
use crate::realtime::{self, LiveSessions, Sessions};
use crate::store::GatewayStore;
use crate::tally::{Counters, Subject, Tally};

/// Everything a request needs; cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    keys: Keys,
    prices: Arc<Prices>,
    store: GatewayStore,
    upstream: Upstream,
    header_timeout: Duration,
    /// `[server] max_body_mib`.
    max_body_mib: u64,
    /// The process's refusal tally (for `/alerts`) and this state's own counters in it.
    tally: Arc<Tally>,
    refusals: Arc<Counters>,
    /// The SHA-256 of the secret `/alerts` asks for; `None`: no `/alerts`.
    alerts_secret: Option<[u8; 32]>,
    sessions: Sessions,
    lingering: Lingering,
}

impl AppState {
    /// State for `config` on `store`, with a refusal tally of its own kept in memory and its
    /// realtime sessions counted alone. Fails if the upstream's API key is missing.
    pub fn new(config: &Config, store: GatewayStore) -> Result<AppState, String> {
        AppState::for_worker(
            config,
            store,
            &Arc::new(Tally::in_memory(config)),
            LiveSessions::new(),
        )
    }

    /// State for `config` on `store` that counts its refusals in `tally` (one state per worker,
    /// one tally per process). Fails if the upstream's API key is missing.
    pub fn with_tally(
        config: &Config,
        store: GatewayStore,
        tally: &Arc<Tally>,
    ) -> Result<AppState, String> {
        AppState::for_worker(config, store, tally, LiveSessions::new())
    }

    /// State for `config` on `store` whose realtime sessions count against `[realtime]
    /// max_connections` together with every other state given the same `live` (the workers of
    /// one process).
    pub fn with_live_sessions(
        config: &Config,
        store: GatewayStore,
        live: LiveSessions,
    ) -> Result<AppState, String> {
        AppState::for_worker(config, store, &Arc::new(Tally::in_memory(config)), live)
    }

    /// One worker's state: its refusals counted in the process's `tally`, its realtime sessions
    /// in the process's `live`. Fails if the upstream's API key is missing.
    pub fn for_worker(
        config: &Config,
        store: GatewayStore,
        tally: &Arc<Tally>,
        live: LiveSessions,
    ) -> Result<AppState, String> {
        Ok(AppState {
            inner: Arc::new(Inner {
                keys: Keys::from_config(config),
                prices: Arc::new(Prices::new(&config.prices)),
                store,
                upstream: Upstream::from_config(&config.upstream)?,
                header_timeout: config.header_timeout,
                max_body_mib: config.max_body_mib,
                refusals: tally.worker(),
                tally: Arc::clone(tally),
                alerts_secret: config.alerts.secret_sha256,
                sessions: Sessions::new(&config.realtime, live),
                lingering: Lingering::default(),
            }),
        })
    }

    /// The live realtime sessions counted against `[realtime] max_connections`.
    pub fn live_sessions(&self) -> &LiveSessions {
        self.inner.sessions.live()
    }

    pub(crate) fn sessions(&self) -> &Sessions {
        &self.inner.sessions
    }

    /// The response bodies still read after their callers left, which a draining worker waits
    /// for.
    pub fn lingering(&self) -> &Lingering {
        &self.inner.lingering
    }

    /// The store.
    pub fn store(&self) -> &GatewayStore {
        &self.inner.store
    }

    /// The keys and their chains.
    pub fn keys(&self) -> &Keys {
        &self.inner.keys
    }

    /// The price table budgets are charged from.
    pub fn prices(&self) -> &Arc<Prices> {
        &self.inner.prices
    }

    /// The upstream.
    pub fn upstream(&self) -> &Upstream {
        &self.inner.upstream
    }

    /// `[server] header_timeout_sec`.
    pub fn header_timeout(&self) -> Duration {
        self.inner.header_timeout
    }
}

/// The gateway's routes as an axum [`Router`], for embedding the gateway in an axum application:
/// `/v1/*` is proxied under the rate limits, `/healthz` and `/readyz` answer probes, `/alerts`
/// shows the refusal tally (with an `[alerts]` secret), everything else is 404. [`run`] serves the same routes ([`route`]) without the router.
pub fn app(state: AppState) -> Router {
    Router::new()
        .fallback(|State(state): State<AppState>, req: Request| route(state, req))
        .with_state(state)
}

/// Answers one request: the routing of [`app`] and [`run`].
///
/// `/v1/...` is told apart by its prefix rather than by a router: a router's lookup, its boxed
/// handler future and its extractors were a tenth of the gateway's instructions per request.
pub async fn route(state: AppState, req: Request) -> Response {
    let path = req.uri().path();
    match path.strip_prefix("/v1/") {
        Some(rest) if !rest.is_empty() => return proxy(state, req).await,
        _ => {}
    }
    let local = match path {
        "/healthz" => Local::Health,
        "/readyz" => Local::Ready,
        "/alerts" if state.inner.alerts_secret.is_some() => Local::Alerts,
        _ => return not_found(),
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return (
            StatusCode::METHOD_NOT_ALLOWED,
            [(axum::http::header::ALLOW, "GET,HEAD")],
        )
            .into_response();
    }
    match local {
        Local::Health => healthz(),
        Local::Ready => readyz(&state).await,
        Local::Alerts if alerts_authorized(&state, &req) => alerts(&state).await,
        Local::Alerts => AppError::Unauthorized.into_response(),
    }
}

/// The routes the gateway answers itself.
enum Local {
    Health,
    Ready,
    Alerts,
}

/// Serves [`route`] on `listener` over HTTP/1.1 until `shutdown` completes, then stops accepting
/// and waits for the requests in flight (streams included) to finish; idle kept-alive
/// connections are closed. Live realtime sessions are waited for up to `[realtime] drain_sec`
/// after `shutdown`, then closed; `run` returns once their tokens are charged. (A state whose
/// `run` has drained closes any later session at once: give a new `run` a new [`AppState`].)
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // In place of hyper-util's `GracefulShutdown`, which cannot watch a connection that may be
    // upgraded (a realtime WebSocket): each connection holds a receiver and, told to stop,
    // finishes its request in flight; no receiver left means no connection left.
    let (draining, drain_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut http = http1::Builder::new();
    // A caller that trickles its request head (slowloris) is cut off after `header_timeout`; so
    // is a kept-alive connection that sends no next request for as long (hyper times the wait
    // for a head from the end of the previous response).
    http.timer(TokioTimer::new())
        .header_read_timeout(state.header_timeout());
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    let Some(pause) = accept_backoff(&e) else {
                        continue;
                    };
                    // A shutdown during the pause still stops the loop at once.
                    tokio::select! {
                        () = tokio::time::sleep(pause) => continue,
                        () = &mut shutdown => break,
                    }
                }
            },
            () = &mut shutdown => break,
        };
        // Small request/response writes must not wait for Nagle.
        let _ = tcp.set_nodelay(true);
        let state = state.clone();
        let service = service_fn(move |req: hyper::Request<Incoming>| {
            let state = state.clone();
            async move { Ok::<_, Infallible>(route(state, req.map(Body::new)).await) }
        });
        let conn = http.serve_connection(TokioIo::new(tcp), service);
        let mut drain = drain_rx.clone();
        tokio::spawn(async move {
            let mut conn = std::pin::pin!(conn.with_upgrades());
            let ended = tokio::select! {
                ended = conn.as_mut() => ended,
                () = told_to_drain(&mut drain) => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "client connection ended");
            }
            // Held to here: the drain waits for this connection.
            drop(drain);
        });
    }
    drop(listener);
    drop(drain_rx);
    let sessions = state.sessions();
    let close_at = tokio::time::Instant::now() + sessions.drain_time();
    draining.send_replace(true);
    let mut connections = std::pin::pin!(draining.closed());
    // Requests in flight get the whole drain; live sessions `drain_sec` of it.
    tokio::select! {
        () = connections.as_mut() => {}
        () = tokio::time::sleep_until(close_at) => {
            sessions.close_all();
            connections.await;
        }
    }
    // No connection left to start a session: those live are all there will be.
    sessions.finish(close_at).await;
    Ok(())
}

/// Resolves once `run` drains its connections (or is gone).
async fn told_to_drain(drain: &mut watch::Receiver<bool>) {
    let _ = drain.wait_for(|d| *d).await;
}

/// How long to pause after a failed `accept`: not at all for a connection that failed before it
/// was accepted (the client's business); anything else (out of file descriptors) is logged and
/// waited out for a second, as axum does, rather than retried in a busy loop.
fn accept_backoff(e: &std::io::Error) -> Option<Duration> {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return None;
    }
    tracing::error!(error = %e, "accept failed; retrying in 1 s");
    Some(Duration::from_secs(1))
}

fn healthz() -> Response {
    "ok\n".into_response()
}

async fn readyz(state: &AppState) -> Response {
    match crate::store::ping(state.store()).await {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "not ready: the store cannot decide");
            (StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n").into_response()
        }
    }
}

/// Whether `req` carries the `[alerts] secret` as its bearer token.
fn alerts_authorized(state: &AppState, req: &Request) -> bool {
    let presented = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| <[u8; 32]>::from(Sha256::digest(token.trim().as_bytes())));
    presented.is_some() && presented == state.inner.alerts_secret
}

/// `GET /alerts`: the refusal tally as `rate_limit` alerts.
async fn alerts(state: &AppState) -> Response {
    match state.inner.tally.alerts().await {
        Ok(alerts) => axum::Json(serde_json::json!({ "alerts": alerts })).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "GET /alerts: the tally cannot be read");
            AppError::TallyUnavailable.into_response()
        }
    }
}

fn not_found() -> Response {
    AppError::NotFound.into_response()
}

/// Whether `path` has a `.` or `..` segment, percent-encoded or not (`/v1/%2e%2e/admin`).
fn has_dot_segment(path: &str) -> bool {
    let raw = path.as_bytes();
    if !raw.contains(&b'.') && !raw.contains(&b'%') {
        return false;
    }
    // Decoded twice (`%252e`), split on either slash (`..%2f`, `..\`), each segment cut at a
    // path parameter (`..;/`): the ways servers and proxies in front of them have resolved
    // dot segments that a plain check would not see.
    let once = metering::percent_decoded(raw);
    let twice = metering::percent_decoded(&once);
    twice.split(|&b| b == b'/' || b == b'\\').any(|segment| {
        let segment = segment.split(|&b| b == b';').next().unwrap_or_default();
        segment == b"." || segment == b".."
    })
}

/// Whether `req` asks to switch to a WebSocket: proxied on `/v1/realtime` (the Realtime API),
/// refused elsewhere. Other `Upgrade` offers (`h2c`) are optional for a server to take (RFC 9110,
/// 7.8): the header is dropped as hop-by-hop and the request served over HTTP/1.1.
fn asks_for_websocket(req: &Request) -> bool {
    let lists = |name, token: &str| {
        req.headers().get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    lists(UPGRADE, "websocket") && lists(axum::http::header::CONNECTION, "upgrade")
}

/// Logs a request answered by the gateway itself.
pub(crate) fn log_local(
    key: Option<&str>,
    req: &Request,
    start: Instant,
    status: StatusCode,
    decision: &str,
) {
    log_line(key, req.method(), req.uri().path(), start, status, decision);
}

/// What an answer refused before admission needs: the request's key and chain.
pub(crate) struct Early<'a> {
    pub(crate) state: &'a AppState,
    pub(crate) key: &'a KeyEntry,
    pub(crate) chain: &'a floodgate::Chain,
    pub(crate) fixed: &'a ChainHeaders,
    pub(crate) start: Instant,
}

impl Early<'_> {
    /// The answer `err` to a request refused before admission (nothing charged), logged, with
    /// the chain's rate-limit state read by an admission of cost 0 (DESIGN 6: every response
    /// carries it). No `Retry-After`: waiting does not mend the request.
    pub(crate) async fn refuse(
        &self,
        method: &Method,
        path: &str,
        err: AppError,
        decision: &str,
    ) -> Response {
        log_line(
            Some(&self.key.id),
            method,
            path,
            self.start,
            err.status(),
            decision,
        );
        let mut resp = err.into_response();
        if let Some(rates) = self.rates().await {
            let h = resp.headers_mut();
            headers::apply(h, &rates, self.fixed);
            h.remove(axum::http::header::RETRY_AFTER);
            h.remove("retry-after-ms");
        }
        resp
    }

    /// The chain's rate-limit state, read by an admission of cost 0 (nothing charged);
    /// `None` when the store cannot say.
    async fn rates(&self) -> Option<ChainDecision> {
        // A limit that no request can pass (`requests = 0`) passes a cost of 0 and would read
        // as free with a reset of 0, an invitation to retry forever: asked at cost 1 instead,
        // the chain answers "never" without reading (or charging) the store, as an admission
        // would.
        let never = self.chain.limits().iter().any(|l| !l.fits(1));
        let cost = u64::from(never);
        self.chain.admit(self.state.store(), cost).await.ok()
    }

    /// The 429 for a request refused by a spent budget: `insufficient_quota`, with
    /// `Retry-After` until the budget's period ends and the chain's rate-limit state when it
    /// could be read. Counted in the refusal tally like a rate-limit refusal.
    pub(crate) async fn refuse_budget(
        &self,
        (method, path): (&Method, &str),
        budgets: &Budgets,
        decision: &BudgetDecision,
    ) -> Response {
        let (state, key, start) = (self.state, self.key, self.start);
        let exceeded = decision.exceeded_by.and_then(|i| budgets.budgets().get(i));
        let (Some(b), Some(wait)) = (exceeded, decision.retry_after) else {
            let err = AppError::Internal("refused without an exceeded budget".into());
            log_line(Some(&key.id), method, path, start, err.status(), "refused");
            return err.into_response();
        };
        let name = match b.scope() {
            floodgate::ScopeKind::Key => "budget:key",
            floodgate::ScopeKind::Project => "budget:project",
            floodgate::ScopeKind::Team => "budget:team",
            floodgate::ScopeKind::BusinessUnit => "budget:business_unit",
            floodgate::ScopeKind::Org => "budget:org",
            floodgate::ScopeKind::Customer => "budget:customer",
            floodgate::ScopeKind::Gateway => "budget:gateway",
        };
        // The wait is until every exceeded budget's period ends: when another one's ends after
        // the named one's, the message says which kind it is, or "retry after 23 days" under a
        // "daily cap" would read as a mistake.
        let later = decision
            .waits_for
            .filter(|&i| Some(i) != decision.exceeded_by)
            .and_then(|i| budgets.budgets().get(i))
            .map(|other| (other.scope(), other.period()));
        let err = AppError::BudgetExceeded {
            scope: b.scope(),
            period: b.period(),
            later,
            retry_after: wait,
        };
        count_refusal(state, key, b.scope());
        log_line(Some(&key.id), method, path, start, err.status(), name);
        let mut resp = err.into_response();
        if let Some(rates) = self.rates().await {
            // The state only: `Retry-After` is the budget's (a read of cost 0 says what is
            // left, not when a request of cost 1 would pass; the rate-limit resets say that).
            headers::apply(resp.headers_mut(), &rates, self.fixed);
        }
        headers::apply_retry_after(resp.headers_mut(), wait);
        resp
    }
}

/// [`log_local`] for a request already taken apart.
fn log_line(
    key: Option<&str>,
    method: &Method,
    path: &str,
    start: Instant,
    status: StatusCode,
    decision: &str,
) {
    tracing::info!(
        key = %key.unwrap_or("-"),
        method = %method,
        path,
        status = status.as_u16(),
        latency_ms = latency_ms(start),
        decision,
        "request"
    );
}

async fn proxy(state: AppState, req: Request) -> Response {
    let start = Instant::now();
    let websocket = req.headers().contains_key(UPGRADE) && asks_for_websocket(&req);
    let realtime = websocket && realtime::is_realtime(req.uri().path());
    let key = if realtime {
        state.keys().authenticate_websocket(req.headers())
    } else {
        state.keys().authenticate(req.headers())
    };
    let Some(key) = key.cloned() else {
        log_local(
            None,
            &req,
            start,
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
        );
        return AppError::Unauthorized.into_response();
    };
    if realtime {
        return realtime::open(state, key, req, start).await;
    }
    let ResolvedChain {
        chain,
        headers: fixed,
        budgets,
    } = state.keys().chain_for_request(&key, req.headers());
    let early = Early {
        state: &state,
        key: &key,
        chain: &chain,
        fixed: &fixed,
        start,
    };
    if websocket {
        // Stripped as hop-by-hop, the upgrade would reach the upstream as a plain request that
        // can only fail, and be charged for it: refused plainly instead, uncharged.
        let err = AppError::UpgradeUnsupported;
        let (method, path) = (req.method(), req.uri().path());
        return early.refuse(method, path, err, "upgrade_unsupported").await;
    }
    if req
        .headers()
        .get_all(TRANSFER_ENCODING)
        .iter()
        .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked"))
    {
        // hyper takes the chunked framing off `gzip, chunked` and leaves the gzip: forwarded
        // without the header (hop-by-hop), the upstream would read compressed bytes as JSON.
        let err = AppError::TransferCodingUnsupported;
        let (method, path) = (req.method(), req.uri().path());
        return early.refuse(method, path, err, "bad_request").await;
    }
    if has_dot_segment(req.uri().path()) {
        // `/v1/../admin` leaves `/v1/` at an upstream (or a proxy before it) that resolves dot
        // segments, and `/v1/chat/completions/.` is a completion path that metering would miss.
        let err = AppError::BadRequest("The request path has a `.` or `..` segment.".into());
        let (method, path) = (req.method(), req.uri().path());
        return early.refuse(method, path, err, "bad_request").await;
    }
    // Budgets are charged from usage too: a chain with budgets is metered like one with a
    // token limit.
    let metered = budgets.is_some() || chain.has_reactive();
    // Only the answer to a request that made the upstream generate is charged its usage.
    let generating = metered && metering::is_generating_request(req.method(), req.uri().path());

    // A streaming completion is rewritten to ask the upstream for usage; the body is read
    // before admission so that a body that cannot be read costs nothing.
    let (mut parts, body) = req.into_parts();
    if metered {
        // Usage is read from the response as it passes: it must come uncompressed.
        parts.headers.remove(ACCEPT_ENCODING);
    }
    let mut stream_req = None;
    let mut request_model = None;
    // Read only for a metered POST: every other request passes without looking at its path.
    let read = metered && parts.method == Method::POST;
    let completion = read && metering::is_completion_path(parts.uri.path());
    // A Responses API create is read to refuse a background response, which cannot be metered.
    let responses = read && !completion && metering::is_responses_path(parts.uri.path());
    let body = if completion || responses {
        if parts
            .headers
            .get(CONTENT_ENCODING)
            .is_some_and(|e| !e.as_bytes().trim_ascii().eq_ignore_ascii_case(b"identity"))
        {
            // Forwarded unread, it could ask for a stream or a background response that goes
            // uncharged.
            let err = AppError::BodyEncodingUnsupported;
            return early
                .refuse(&parts.method, parts.uri.path(), err, "bad_request")
                .await;
        }
        // At most `[server] max_body_mib` is held: a body announced larger is refused before
        // a byte of it is read.
        let max_mib = state.inner.max_body_mib;
        let max = usize::try_from(max_mib << 20).unwrap_or(usize::MAX);
        let announced = parts
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if announced.is_some_and(|n| n > max_mib << 20) {
            let err = AppError::BodyTooLarge { max_mib };
            return early
                .refuse(&parts.method, parts.uri.path(), err, "body_too_large")
                .await;
        }
        // Read under the header timeout too: a caller trickling its body would otherwise hold
        // the connection (and up to `max` of memory) for as long as it likes.
        let read = axum::body::to_bytes(body, max);
        let bytes = match tokio::time::timeout(state.header_timeout(), read).await {
            Ok(Ok(b)) => b,
            Ok(Err(e))
                if std::error::Error::source(&e)
                    .is_some_and(|s| s.is::<http_body_util::LengthLimitError>()) =>
            {
                let err = AppError::BodyTooLarge { max_mib };
                return early
                    .refuse(&parts.method, parts.uri.path(), err, "body_too_large")
                    .await;
            }
            Ok(Err(e)) => {
                tracing::debug!(key = %key.id, error = %e, "request body unreadable");
                let err = AppError::BadRequest("The request body could not be read.".into());
                return early
                    .refuse(&parts.method, parts.uri.path(), err, "bad_request")
                    .await;
            }
            Err(_) => {
                let err = AppError::BodyTimeout;
                return early
                    .refuse(&parts.method, parts.uri.path(), err, "body_timeout")
                    .await;
            }
        };
        if responses {
            if let Err(why) = metering::check_responses_request(&bytes) {
                let err = AppError::BadRequest(why);
                return early
                    .refuse(&parts.method, parts.uri.path(), err, "bad_request")
                    .await;
            }
            Body::from(bytes)
        } else {
            let prepared = match metering::prepare_request(bytes, budgets.is_some()) {
                Ok(prepared) => prepared,
                Err(why) => {
                    let err = AppError::BadRequest(why);
                    return early
                        .refuse(&parts.method, parts.uri.path(), err, "bad_request")
                        .await;
                }
            };
            let bytes = prepared.body;
            stream_req = prepared.stream;
            request_model = prepared.model;
            parts
                .headers
                .insert(CONTENT_LENGTH, HeaderValue::from(bytes.len()));
            Body::from(bytes)
        }
    } else {
        body
    };

    // Budgets first, read without charging anything: a spent budget refuses before any rate
    // limit is charged. The read is not part of the admission's atomic step because a budget
    // is reactive (a response's spend is known only after it), so an atomic check would be no
    // more exact; concurrent requests can overrun a budget by what they spend in flight.
    if let Some(budgets) = &budgets {
        match budgets.check(state.store()).await {
            Ok(d) if d.allowed() => {}
            Ok(d) => {
                let at = (&parts.method, parts.uri.path());
                return early.refuse_budget(at, budgets, &d).await;
            }
            Err(e) => return store_error(&key.id, parts, start, e),
        }
    }
    let decision = match chain.admit(state.store(), 1).await {
        Ok(d) => d,
        Err(e) => return store_error(&key.id, parts, start, e),
    };
    if !decision.admitted {
        return refuse(
            &state,
            &key,
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
    let gone = CallerGone {
        key: &key.id,
        method: &method,
        uri: &uri,
        start,
        decision: decision_name,
        armed: true,
    };
    let sent = state.upstream().send(upstream_req).await;
    gone.disarm();
    let resp = match sent {
        Ok(r) => r,
        Err(err) => {
            tracing::info!(
                key = %key.id,
                method = %method,
                path = uri.path(),
                status = err.status().as_u16(),
                latency_ms = latency_ms(start),
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
    let meter = if !generating || !head.status.is_success() {
        Meter::None
    } else if head
        .headers
        .get(CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"))
    {
        tracing::warn!(key = %key.id, "compressed response (unasked for): its tokens are not metered");
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
    let spend = budgets.map(|budgets| Spend {
        budgets,
        prices: Arc::clone(state.prices()),
        request_model,
    });
    let body = MeteredBody::new(
        body,
        meter,
        (state.store().clone(), chain),
        spend,
        log,
        state.lingering(),
    );
    Response::from_parts(head, Body::new(body))
}

/// The answer when the store could not decide: 503 when it fails closed, else 500.
fn store_error(
    key: &str,
    parts: axum::http::request::Parts,
    start: Instant,
    e: StoreError,
) -> Response {
    let req = Request::from_parts(parts, Body::empty());
    let err = match e {
        StoreError::Unavailable(why) => AppError::StoreUnavailable(why),
        other => AppError::Internal(other.to_string()),
    };
    log_local(Some(key), &req, start, err.status(), "store_error");
    err.into_response()
}

/// Logs the request line of a caller that went away while its request waited for the upstream
/// (hyper then drops the handler): status 499, nginx's "client closed request". The request was
/// admitted and charged; no response (and no token usage) follows.
pub(crate) struct CallerGone<'a> {
    key: &'a str,
    method: &'a Method,
    uri: &'a Uri,
    start: Instant,
    decision: &'static str,
    armed: bool,
}

impl<'a> CallerGone<'a> {
    /// Armed: logs a 499 line if dropped before [`CallerGone::disarm`].
    pub(crate) fn new(
        key: &'a str,
        method: &'a Method,
        uri: &'a Uri,
        start: Instant,
        decision: &'static str,
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
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CallerGone<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(
                key = %self.key,
                method = %self.method,
                path = self.uri.path(),
                status = 499u16,
                latency_ms = latency_ms(self.start),
                decision = self.decision,
                "request"
            );
        }
    }
}

/// Counts a 429 in the refusal tally: against the gateway if its own scope refused, else against
/// the key.
pub(crate) fn count_refusal(state: &AppState, key: &KeyEntry, refused_by: floodgate::ScopeKind) {
    let subject = match refused_by {
        floodgate::ScopeKind::Gateway => Subject::Gateway,
        _ => Subject::Key(key.index),
    };
    state.inner.refusals.refused(subject);
}

/// The 429 for a refused request, with the refusing limit's headers; counted in the refusal
/// tally.
pub(crate) fn refuse(
    state: &AppState,
    key: &KeyEntry,
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
    if let Some(r) = decision.refusing() {
        count_refusal(state, key, r.scope);
    }
    log_local(Some(&key.id), &req, start, err.status(), name);
    let mut resp = err.into_response();
    headers::apply(resp.headers_mut(), decision, fixed);
    resp
}

/// Milliseconds since `start` for the request log line, in whole microseconds: `0.024`, not
/// `0.024173999999999998`.
pub(crate) fn latency_ms(start: Instant) -> f64 {
    start.elapsed().as_micros() as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_are_found_encoded_or_not() {
        for path in [
            "/v1/../metrics",
            "/v1/./models",
            "/v1/chat/completions/.",
            "/v1/chat/completions/..",
            "/v1/%2e%2e/admin",
            "/v1/%2E./admin",
            "/v1/chat/completions/%2e",
            "/v1/..;/admin",
            "/v1/..%2fadmin",
            "/v1/..\\admin",
            "/v1/%252e%252e/admin",
        ] {
            assert!(has_dot_segment(path), "{path}");
        }
        for path in [
            "/v1/models",
            "/v1/models/gpt-4.1",
            "/v1/files/a..b",
            "/v1/x/.well-known",
            "/v1/%2e%2e%2e",
        ] {
            assert!(!has_dot_segment(path), "{path}");
        }
    }

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
}
