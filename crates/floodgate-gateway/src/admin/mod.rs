//! The admin listener (`[admin]`): a second listener, loopback by default, apart from the
//! callers' port (docs/design.md §9). It serves
//!
//! - `GET /metrics` (Prometheus, [`crate::metrics`]);
//! - the admin API under `/admin/` (`api.rs`): usage, reset, alerts, config (usage and alerts
//!   by pages, with `limit` and `cursor`);
//! - the console at `/` (`console.rs`): a page and its assets, embedded in the binary, that
//!   signs in with the secret once and then reads the admin API with a session cookie.
//!
//! Everything but the console's page, its assets and its sign-in asks for the bearer `[admin]
//! secret` (compared by digest, never a key's secret) or a console session (`session.rs`); a
//! state-changing call made with a session also needs its CSRF token. Every answer carries
//! the headers of [`secure`]. Without an `[admin]` section there is no admin listener.

mod api;
mod console;
mod scopes;
mod session;
mod wire;

pub use api::{
    AlertsPage, BudgetUsage, CHART_DAYS, Chart, InFlight, LimitUsage, Reset, ScopeUsage, Usage,
};
pub use scopes::{Catalogue, Scope};
pub use session::{
    COOKIE, MAX_WAITING, MAX_WAITING_ALL, SESSION_TTL, Sessions, Source, WRONG_SECRET_DELAY,
};

use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use axum::Json;
use axum::body::Body;
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::config::{AdminConfig, Config};
use crate::error::AppError;
use crate::http::Process;
use crate::metrics::CONTENT_TYPE as METRICS_CONTENT_TYPE;
use crate::send_timed::SendTimed;
use crate::store::GatewayStore;
use session::{Session, Verdict};
use wire::{BodyWait, Peer, Refusal, json_body, unix_now};

/// What the admin listener serves: the process's shared state and store, under `[admin]`'s
/// rules. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Admin {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: AdminConfig,
    process: Process,
    store: GatewayStore,
    sessions: Sessions,
    /// The scopes of the config in force, built again only when a reload replaced it.
    catalogue: Mutex<Option<(Arc<Config>, Arc<Catalogue>)>>,
}

/// Who made an authorized admin call.
#[derive(Clone, Copy, Debug)]
enum Caller {
    /// The bearer secret.
    Bearer,
    /// A console session.
    Console(Session),
}

impl Admin {
    /// The admin listener of `process`, as `config` sets it, reading and resetting state on
    /// `store` (the one the workers decide on, or another connection to the same Redis). Fails
    /// only without a system random source for the console's session key.
    pub fn new(
        config: AdminConfig,
        process: Process,
        store: GatewayStore,
    ) -> Result<Admin, String> {
        Ok(Admin {
            inner: Arc::new(Inner {
                config,
                process,
                store,
                sessions: Sessions::new()?,
                catalogue: Mutex::new(None),
            }),
        })
    }

    /// Answers one request, with the headers of [`secure`].
    pub async fn answer(&self, req: Request<Body>) -> Response {
        let mut response = self.route(req).await;
        secure(response.headers_mut());
        response
    }

    async fn route(&self, req: Request<Body>) -> Response {
        if !self.host_allowed(req.headers()) {
            let why = "this admin listener answers its loopback names and [admin] hosts only";
            return (StatusCode::MISDIRECTED_REQUEST, why).into_response();
        }
        let path = req.uri().path().to_owned();
        match path.as_str() {
            "/metrics" => {
                self.metrics(req.method(), req.headers(), peer_ip(&req))
                    .await
            }
            "/admin" => AppError::NotFound.into_response(),
            p if p.starts_with("/admin/") => self.api(req).await,
            p => match console::route(
                &self.inner.sessions,
                self.inner.config.secret_sha256.as_ref(),
                p,
                req,
            )
            .await
            {
                Some(response) => response,
                None => AppError::NotFound.into_response(),
            },
        }
    }

    /// Whether a request naming `headers`' `Host` may be answered: any name on a listener bound
    /// elsewhere than loopback; on loopback, loopback's own names and `[admin] hosts` (a page
    /// an attacker's name re-resolved to 127.0.0.1, DNS rebinding, names the attacker's). A
    /// request without a `Host` (HTTP/1.0) is answered.
    fn host_allowed(&self, headers: &HeaderMap) -> bool {
        if !self.inner.config.listen.ip().is_loopback() {
            return true;
        }
        let Some(host) = headers.get(axum::http::header::HOST) else {
            return true;
        };
        let Ok(host) = host.to_str() else {
            return false;
        };
        host_is_allowed(host, &self.inner.config.hosts)
    }

    async fn metrics(
        &self,
        method: &Method,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Response {
        if method != Method::GET && method != Method::HEAD {
            return StatusCode::METHOD_NOT_ALLOWED.into_response();
        }
        if self.inner.config.metrics_auth
            && let Err(refused) = self.caller(headers, peer).await
        {
            return refused.into_response();
        }
        let metrics = &self.inner.process.metrics;
        metrics.realtime_sessions(self.inner.process.live_sessions.count());
        ([(CONTENT_TYPE, METRICS_CONTENT_TYPE)], metrics.encode()).into_response()
    }

    /// The admin API: the caller is checked first (so an unknown path tells a stranger
    /// nothing), then a session's CSRF token for a call that changes state.
    async fn api(&self, req: Request<Body>) -> Response {
        let caller = match self.caller(req.headers(), peer_ip(&req)).await {
            Ok(c) => c,
            Err(refused) => return refused.into_response(),
        };
        let method = req.method().clone();
        let path = req.uri().path().to_owned();
        let wrong_method = |allow: &'static str| {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                [(axum::http::header::ALLOW, allow)],
            )
                .into_response()
        };
        match path.as_str() {
            "/admin/usage" if method == Method::GET => {
                let query = match parse_query(req.uri().query()) {
                    Ok(q) => q,
                    Err(e) => return e.into_response(),
                };
                let catalogue = self.catalogue();
                match api::usage(&catalogue, &self.inner.store, query).await {
                    Ok(usage) => Json(usage).into_response(),
                    Err(e) => e.into_response(),
                }
            }
            "/admin/reset" if method == Method::POST => {
                if let Err(refused) = self.csrf(&caller, req.headers()) {
                    return refused.into_response();
                }
                let peer = req.extensions().get::<Peer>().map(|p| p.0);
                let request: api::ResetRequest = match json_body(req).await {
                    Ok(r) => r,
                    Err(e) => return e.into_response(),
                };
                let catalogue = self.catalogue();
                match api::reset(&catalogue, &self.inner.store, &request).await {
                    Ok(reset) => {
                        // Counts went down: no worker may refuse from what it remembered.
                        self.inner.process.reset_done();
                        tracing::info!(
                            by = %caller.describe(),
                            peer = ?peer,
                            scope = %request.scope,
                            id = %request.id,
                            budgets = request.budgets,
                            limits = reset.cleared.iter().map(|s| s.limits.len()).sum::<usize>(),
                            "admin reset"
                        );
                        Json(reset).into_response()
                    }
                    Err(e) => e.into_response(),
                }
            }
            "/admin/alerts" if method == Method::GET => match parse_alerts_query(req.uri().query())
            {
                Ok(query) => api::alerts(&self.inner.process, query).await,
                Err(e) => e.into_response(),
            },
            "/admin/config" if method == Method::GET => api::config(&self.inner.process),
            "/admin/usage" | "/admin/alerts" | "/admin/config" => wrong_method("GET"),
            "/admin/reset" => wrong_method("POST"),
            _ => AppError::NotFound.into_response(),
        }
    }

    /// The scopes of the config in force.
    fn catalogue(&self) -> Arc<Catalogue> {
        let running = self.inner.process.running();
        let mut cached = self
            .inner
            .catalogue
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match &*cached {
            Some((config, catalogue)) if Arc::ptr_eq(config, &running) => Arc::clone(catalogue),
            _ => {
                let catalogue = Arc::new(Catalogue::new(&running));
                *cached = Some((running, Arc::clone(&catalogue)));
                catalogue
            }
        }
    }

    /// Who a request with `headers` from a peer at `peer` comes from: the bearer secret
    /// (checked in its peer's turn: see `session.rs`), else a console session's cookie. A refusal is the answer to send.
    async fn caller(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<Caller, Refusal> {
        if let Some(token) = bearer(headers) {
            return match self.check_secret(token, peer).await {
                Verdict::Right => Ok(Caller::Bearer),
                Verdict::Wrong => Err(Refusal::Unauthorized),
                Verdict::Busy => Err(Refusal::Busy),
            };
        }
        self.session(headers)
            .map(Caller::Console)
            .ok_or(Refusal::Unauthorized)
    }

    /// Checks a secret presented by a peer at `peer` against `[admin] secret` in its turn.
    async fn check_secret(&self, presented: &str, peer: Option<IpAddr>) -> Verdict {
        let want = self.inner.config.secret_sha256.as_ref();
        self.inner.sessions.check(presented, want, peer).await
    }

    /// The console session of a request's cookie, if valid.
    fn session(&self, headers: &HeaderMap) -> Option<Session> {
        self.inner.sessions.from_headers(headers, unix_now())
    }

    /// A call that changes state: with a session it needs the session's CSRF token (403
    /// otherwise); with the bearer, nothing more.
    fn csrf(&self, caller: &Caller, headers: &HeaderMap) -> Result<(), Refusal> {
        match caller {
            Caller::Console(session) => wire::csrf(&self.inner.sessions, session, headers),
            Caller::Bearer => Ok(()),
        }
    }
}

impl Caller {
    /// Who, for the log: never a secret, a session by the first bytes of its nonce.
    fn describe(&self) -> String {
        match self {
            Caller::Bearer => "bearer".to_owned(),
            Caller::Console(s) => format!("console session {}", s.short_id()),
        }
    }
}

/// The address of `req`'s peer, if [`run`] put it there.
fn peer_ip(req: &Request<Body>) -> Option<IpAddr> {
    req.extensions().get::<Peer>().map(|p| p.0.ip())
}

/// The bearer token of `headers`, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
}

fn parse_query(query: Option<&str>) -> Result<api::UsageQuery, api::ApiError> {
    let pairs = form_urlencoded(query.unwrap_or(""));
    let mut q = api::UsageQuery::default();
    for (name, value) in pairs {
        match name.as_str() {
            "scope" => q.scope = Some(value),
            "id" => q.id = Some(value),
            "q" => q.q = Some(value).filter(|v| !v.is_empty()),
            "limit" => q.limit = Some(parse_limit(&value)?),
            "cursor" => q.cursor = Some(value),
            other => {
                return Err(api::ApiError::BadRequest(format!(
                    "unknown parameter `{other}`: scope, id, q, limit, cursor"
                )));
            }
        }
    }
    Ok(q)
}

/// The query of `GET /admin/alerts`: `None` without `limit` or `cursor` (every alert).
fn parse_alerts_query(query: Option<&str>) -> Result<Option<api::AlertsQuery>, api::ApiError> {
    let pairs = form_urlencoded(query.unwrap_or(""));
    if pairs.is_empty() {
        return Ok(None);
    }
    let mut q = api::AlertsQuery::default();
    for (name, value) in pairs {
        match name.as_str() {
            "limit" => q.limit = Some(parse_limit(&value)?),
            "cursor" => q.cursor = Some(value),
            other => {
                return Err(api::ApiError::BadRequest(format!(
                    "unknown parameter `{other}`: limit, cursor"
                )));
            }
        }
    }
    Ok(Some(q))
}

fn parse_limit(value: &str) -> Result<usize, api::ApiError> {
    value
        .parse()
        .map_err(|_| api::ApiError::BadRequest(format!("`limit` {value} is not a number")))
}

/// `a=1&b=x%20y` as pairs, `+` and `%XX` decoded.
fn form_urlencoded(text: &str) -> Vec<(String, String)> {
    text.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((n, v)) => (percent_decode(n), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

/// `x+y%21` as `x y!`; a `%` not followed by two hex digits stays as it is.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'+', _) => out.push(b' '),
            (b'%', Some(b)) => {
                out.push(b);
                i += 2;
            }
            (b, _) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The headers every admin answer carries: no framing, no sniffing, no referrer, no caching,
/// and a content security policy that lets the console load only its own script and style
/// and talk only to this listener.
pub fn secure(headers: &mut HeaderMap) {
    for (name, value) in [
        (
            "content-security-policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
        ("x-content-type-options", "nosniff"),
        ("x-frame-options", "DENY"),
        ("referrer-policy", "no-referrer"),
        ("cross-origin-opener-policy", "same-origin"),
        ("cross-origin-resource-policy", "same-origin"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    headers
        .entry(CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
}

/// The most connections the admin listener holds open at once; more wait in the listen
/// backlog, holding no file of the process.
const MAX_CONNECTIONS: usize = 64;

/// Serves `admin` on `listener` until `shutdown` completes, timed as the callers' port is
/// (`timeout`: `[server] header_timeout_sec`): a request head must arrive within it, an idle
/// kept-alive connection is closed after it, and a write its client takes nothing of fails
/// after it, and so does a request body that has not all come within it; at most
/// [`MAX_CONNECTIONS`] connections are open at once. A slow client cannot
/// hold the listener's connections, nor the process's files, for good.
pub async fn run(
    listener: TcpListener,
    admin: Admin,
    timeout: std::time::Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut shutdown = std::pin::pin!(shutdown);
    let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(timeout);
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&open).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return Ok(()),
            },
            () = &mut shutdown => return Ok(()),
        };
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: waited out, not retried in a busy loop.
                    tracing::debug!(error = %e, "admin accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => return Ok(()),
        };
        let admin = admin.clone();
        let service = service_fn(move |req: Request<Incoming>| {
            let admin = admin.clone();
            let mut req = req.map(Body::new);
            req.extensions_mut().insert(Peer(peer));
            req.extensions_mut().insert(BodyWait(timeout));
            async move { Ok::<_, Infallible>(admin.answer(req).await) }
        });
        let served = http.serve_connection(TokioIo::new(SendTimed::new(tcp, timeout)), service);
        tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::debug!(error = %e, "admin connection ended");
            }
            drop(slot);
        });
    }
}

/// Whether `host` (a `Host` header: a name or an address, maybe with a port) is one of
/// loopback's names or of `allowed` (lowercase names).
fn host_is_allowed(host: &str, allowed: &[String]) -> bool {
    let host = host.trim();
    // `[::1]:9090`, `[::1]`, `localhost:9090`, `127.0.0.1`.
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost"
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
        || allowed.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::host_is_allowed;

    #[test]
    fn loopback_names_and_the_configured_hosts_are_allowed() {
        let allowed = ["admin.example.com".to_owned()];
        for host in [
            "localhost",
            "LOCALHOST:9090",
            "127.0.0.1:9090",
            "127.1.2.3",
            "[::1]:9090",
            "[::1]",
            "admin.example.com:443",
            "admin.example.com.",
        ] {
            assert!(host_is_allowed(host, &allowed), "{host}");
        }
        for host in [
            "evil.example",
            "10.0.0.1:9090",
            "[::2]:9090",
            "",
            "localhost.evil",
        ] {
            assert!(!host_is_allowed(host, &allowed), "{host}");
        }
    }
}
