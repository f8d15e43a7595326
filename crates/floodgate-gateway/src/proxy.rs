//! Forwarding to the upstream: a pool of kept-alive HTTP/1 connections per worker, bodies
//! streamed both ways; over TLS (rustls) for an `https://` upstream.
//!
//! The caller's `Authorization` (the gateway key) and `X-Floodgate-Customer` never leave the
//! gateway; the upstream's own key, if configured, is sent instead. Hop-by-hop headers are
//! dropped in both directions. Connect failures (TLS handshakes included) answer 502; no response
//! headers within `[upstream] timeout_sec` answer 504.

use std::net::IpAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::header::{self, HeaderName};
use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, Version};
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;
use tower::{Service, ServiceExt};

use crate::auth::CUSTOMER_HEADER;
use crate::config::{UpstreamConfig, UpstreamTarget};
use crate::error::AppError;

/// How long to wait for a TCP connection to the upstream, and then for its TLS handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled upstream connection is reused: less than the 5 s after which common
/// upstream servers (uvicorn, Node) close an idle keep-alive connection. A connection the
/// upstream closes just as it is reused fails the request it carried with 502, unless that
/// request may safely be sent again (see `Pool::send`).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// How long a request waits for a pooled connection that is not ready yet (its driver has not
/// run since its last response) before taking another: a connection still sending an earlier
/// request's body is not kept waited on.
const REUSE_READY_WAIT: Duration = Duration::from_millis(50);

/// Headers that describe one connection, not the message: never forwarded. (A `static`: a
/// `const` array would be built anew at each use.)
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Where admitted requests go.
#[derive(Clone, Debug)]
pub struct Upstream {
    target: Target,
    timeout: Duration,
}

// One per process: the size difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Target {
    Http {
        pool: Arc<Pool>,
        base: String,
        /// The `Host` header for the upstream's authority, built once.
        host: HeaderValue,
        /// The path prefix of `base` (may be empty), split off once at load.
        prefix: String,
        auth: Option<HeaderValue>,
    },
    Demo(Router),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Http { base, auth, .. } => f
                .debug_struct("Http")
                .field("base", base)
                .field("auth", &auth.as_ref().map(|_| "<redacted>"))
                .finish(),
            Target::Demo(_) => f.write_str("Demo"),
        }
    }
}

impl Upstream {
    /// The upstream `config` names; reads the API key from its environment variable.
    pub fn from_config(config: &UpstreamConfig) -> Result<Upstream, String> {
        let target = match &config.target {
            UpstreamTarget::Demo => Target::Demo(crate::demo::router()),
            UpstreamTarget::Http {
                base_url,
                api_key_env,
                ca_file,
            } => {
                let auth = match api_key_env {
                    None => None,
                    Some(var) => {
                        let key = std::env::var(var).map_err(|_| {
                            format!(
                                "upstream.api_key_env: the environment variable {var} is not set"
                            )
                        })?;
                        // Set but empty (or blank): every request would go out with
                        // `Authorization: Bearer ` and be charged for the upstream's 401.
                        let key = key.trim();
                        if key.is_empty() {
                            return Err(format!(
                                "upstream.api_key_env: the environment variable {var} is empty"
                            ));
                        }
                        let mut v = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                            format!("upstream.api_key_env: {var} holds characters not allowed in a header")
                        })?;
                        v.set_sensitive(true);
                        Some(v)
                    }
                };
                let (scheme, rest) = match base_url.strip_prefix("https://") {
                    Some(rest) => (Scheme::HTTPS, rest),
                    None => (
                        Scheme::HTTP,
                        base_url.strip_prefix("http://").unwrap_or(base_url),
                    ),
                };
                let (host, prefix) = match rest.find('/') {
                    Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
                    None => (rest, ""),
                };
                let authority = host
                    .parse::<Authority>()
                    .map_err(|e| format!("upstream.base_url: bad host `{host}`: {e}"))?;
                let host = HeaderValue::from_str(authority.as_str())
                    .map_err(|e| format!("upstream.base_url: bad host `{host}`: {e}"))?;
                let tls = if scheme == Scheme::HTTPS {
                    Some(Tls::new(&authority, ca_file.as_deref())?)
                } else {
                    None
                };
                let mut connector = HttpConnector::new();
                connector.set_nodelay(true);
                connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
                // The connector only opens the TCP connection (to port 443 when an https URL
                // names none); TLS is layered on top in `Pool::connect`.
                connector.enforce_http(tls.is_none());
                let connect_uri = Uri::builder()
                    .scheme(scheme)
                    .authority(authority.clone())
                    .path_and_query("/")
                    .build()
                    .map_err(|e| format!("upstream.base_url: {e}"))?;
                Target::Http {
                    pool: Arc::new(Pool {
                        connector,
                        connect_uri,
                        tls,
                        idle: Mutex::new(Vec::new()),
                    }),
                    base: base_url.clone(),
                    host,
                    prefix: prefix.to_owned(),
                    auth,
                }
            }
        };
        Ok(Upstream {
            target,
            timeout: config.timeout,
        })
    }

    /// Forwards `req` and returns the upstream's response head with its body still streaming.
    pub async fn send(&self, mut req: Request<Body>) -> Result<Response<Body>, AppError> {
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        headers.remove(header::AUTHORIZATION);
        headers.remove(CUSTOMER_HEADER);
        match &self.target {
            Target::Demo(router) => {
                let resp = router
                    .clone()
                    .oneshot(req)
                    .await
                    .map_err(|e| AppError::Internal(format!("demo upstream: {e}")))?;
                Ok(resp)
            }
            Target::Http {
                pool,
                host,
                prefix,
                auth,
                ..
            } => {
                headers.insert(header::HOST, host.clone());
                if let Some(auth) = auth {
                    headers.insert(header::AUTHORIZATION, auth.clone());
                }
                to_origin_form(&mut req, prefix)?;
                let resp = match tokio::time::timeout(self.timeout, pool.send(req)).await {
                    Err(_) => return Err(AppError::UpstreamTimeout),
                    Ok(Err(cause)) => return Err(AppError::UpstreamUnavailable(cause)),
                    Ok(Ok(resp)) => resp,
                };
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Ok(Response::from_parts(parts, body))
            }
        }
    }
}

impl Upstream {
    /// Forwards a WebSocket upgrade request (`GET` with `Upgrade: websocket`) on a new
    /// connection of its own, which an upgrade consumes and no pool could reuse (for the demo
    /// upstream, an in-process pipe to [`crate::demo::serve_realtime`]). Headers are treated as
    /// in [`Upstream::send`], then `Connection: upgrade` and `Upgrade: websocket` are set again.
    /// Returns the upstream's answer, whose hop-by-hop headers are dropped: on a 101,
    /// [`hyper::upgrade::on`] gives the upgraded connection.
    pub async fn upgrade(&self, mut req: Request<Body>) -> Result<Response<Incoming>, AppError> {
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        headers.remove(header::AUTHORIZATION);
        headers.remove(CUSTOMER_HEADER);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        let pool = match &self.target {
            Target::Demo(_) => None,
            Target::Http {
                pool,
                host,
                prefix,
                auth,
                ..
            } => {
                let headers = req.headers_mut();
                headers.insert(header::HOST, host.clone());
                if let Some(auth) = auth {
                    headers.insert(header::AUTHORIZATION, auth.clone());
                }
                to_origin_form(&mut req, prefix)?;
                Some(pool)
            }
        };
        let send = async {
            let mut conn = match pool {
                Some(pool) => pool.connect(true).await?,
                None => {
                    // A pipe as wide as a socket's buffer: the demo's frames are small.
                    let (ours, theirs) = tokio::io::duplex(64 * 1024);
                    tokio::spawn(crate::demo::serve_realtime(TokioIo::new(theirs)));
                    handshake(TokioIo::new(ours), true).await?
                }
            };
            conn.ready()
                .await
                .map_err(|_| "the upstream closed a new connection".to_owned())?;
            conn.send_request(req).await.map_err(|e| cause(&e))
        };
        let mut resp = match tokio::time::timeout(self.timeout, send).await {
            Err(_) => return Err(AppError::UpstreamTimeout),
            Ok(Err(cause)) => return Err(AppError::UpstreamUnavailable(cause)),
            Ok(Ok(resp)) => resp,
        };
        strip_hop_by_hop(resp.headers_mut());
        Ok(resp)
    }
}

/// Points `req` at the upstream: its path and query after the base URL's `prefix`, in origin
/// form (`/v1/...`: the connection already names the upstream), over HTTP/1.1.
fn to_origin_form<B>(req: &mut Request<B>, prefix: &str) -> Result<(), AppError> {
    let path_and_query = match (prefix.is_empty(), req.uri().path_and_query()) {
        // The common case: no prefix; the request's path is reused as is.
        (true, Some(pq)) => pq.clone(),
        (_, pq) => {
            let pq = pq.map_or("/", PathAndQuery::as_str);
            format!("{prefix}{pq}")
                .parse::<PathAndQuery>()
                .map_err(|e| AppError::BadRequest(format!("cannot forward this path: {e}")))?
        }
    };
    *req.uri_mut() = Uri::from(path_and_query);
    *req.version_mut() = Version::HTTP_11;
    Ok(())
}

/// The upstream connections of one worker: HTTP/1 connections kept alive and reused, most
/// recently used first.
///
/// In place of hyper-util's pooling client, which on every request hashed a pool key, raced a
/// checkout against a lazily built connect future, formatted a `Host` header and spawned a task
/// to put the connection back once the response body was done. Here a connection goes back into
/// the idle list when its response body ends, from the body itself. A worker's requests all run
/// on its one thread, so the lock is never contended.
struct Pool {
    connector: HttpConnector,
    /// What the connector connects to: the upstream's scheme and authority.
    connect_uri: Uri,
    /// For an https upstream: the TLS client to wrap each new connection in.
    tls: Option<Tls>,
    idle: Mutex<Vec<Idle>>,
}

/// TLS to an https upstream, set up once: every connection shares the config (and with it the
/// session cache, so reconnections resume sessions).
struct Tls {
    connector: TlsConnector,
    /// The name the upstream's certificate must be valid for, sent as SNI: the base URL's host
    /// name, or its IP address.
    server_name: ServerName<'static>,
}

impl Tls {
    fn new(authority: &Authority, ca_file: Option<&Path>) -> Result<Tls, String> {
        // `[::1]` in a URL: the brackets are not part of the address.
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let server_name = match host.parse::<IpAddr>() {
            Ok(ip) => ServerName::from(ip),
            Err(_) => ServerName::try_from(host.to_owned())
                .map_err(|e| format!("upstream.base_url: bad TLS server name `{host}`: {e}"))?,
        };
        let config = crate::tls::client_config(ca_file).map_err(|e| match ca_file {
            Some(_) => format!("upstream.ca_file: {e}"),
            None => format!("upstream.base_url: {e}"),
        })?;
        Ok(Tls {
            connector: TlsConnector::from(config),
            server_name,
        })
    }
}

struct Idle {
    conn: SendRequest<Body>,
    since: Instant,
}

impl Pool {
    /// Sends `req` on an idle connection, or a new one.
    ///
    /// A request that an idle connection refused before sending any of it (the upstream had
    /// just closed it) is sent again on another. A bodyless request of a safe method (`GET`,
    /// `HEAD`, `OPTIONS`) that a reused connection lost after sending it (closed or reset before
    /// any answer: the upstream closed its side as the request arrived) is sent once more on a
    /// new connection: sending it twice changes nothing upstream (RFC 9110, 9.2.2), as nginx's
    /// `proxy_next_upstream` does by default. An answer that cannot be parsed is no reason to
    /// send again. Any other failure is the answer: a request that may have reached the
    /// upstream is never sent twice. Errors are causes for the log.
    async fn send(self: &Arc<Self>, mut req: Request<Body>) -> Result<Response<Body>, String> {
        let mut fresh_only = false;
        // Whether this request has waited out REUSE_READY_WAIT once: it does not wait on a second
        // busy connection, so that several uploads in flight cost it one wait, not one each.
        let mut waited = false;
        loop {
            let reused_conn = if fresh_only { None } else { self.checkout() };
            let (mut conn, reused) = match reused_conn {
                Some(c) => (c, true),
                None => (self.connect(false).await?, false),
            };
            if reused && !conn.is_ready() {
                // A connection goes back into the pool when its response ends, which can be
                // before its request body has all gone out (an upstream that answers a large
                // upload at once, say a 401, and reads no more). It is ready as soon as its
                // driver has run, unless it is still sending that body, for as long as its
                // caller trickles it: then it is left to finish (and goes back into the pool
                // once it has, see `park`), and this request takes another connection.
                if waited {
                    self.park(conn);
                    continue;
                }
                match tokio::time::timeout(REUSE_READY_WAIT, conn.ready()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => continue,
                    Err(_) => {
                        waited = true;
                        self.park(conn);
                        continue;
                    }
                }
            } else if conn.ready().await.is_err() {
                if reused {
                    continue;
                }
                return Err("the upstream closed a new connection".into());
            }
            // Only on a reused connection: a new one that fails is the upstream's answer.
            let again = if reused { resendable(&req) } else { None };
            match conn.try_send_request(req).await {
                Ok(resp) if http_body::Body::is_end_stream(resp.body()) => {
                    // No body (HEAD, 204, `Content-Length: 0`): hyper never polls it, so the
                    // connection goes back now, not when the body ends.
                    self.checkin(conn);
                    return Ok(resp.map(Body::new));
                }
                Ok(resp) => {
                    let (parts, body) = resp.into_parts();
                    let body = PooledBody {
                        inner: body,
                        conn: Some((conn, Arc::downgrade(self))),
                    };
                    return Ok(Response::from_parts(parts, Body::new(body)));
                }
                Err(mut e) => match (e.take_message(), again) {
                    (Some(unsent), _) if reused => req = unsent,
                    (None, Some(copy)) if connection_lost(e.error()) => {
                        tracing::debug!(
                            error = %cause(e.error()),
                            "a reused upstream connection failed; sending the request again on a new one"
                        );
                        req = copy;
                        fresh_only = true;
                    }
                    _ => return Err(cause(e.error())),
                },
            }
        }
    }

    /// Leaves a connection that is still sending an earlier request's body to finish it, and
    /// puts it back into the pool once it can carry another request, rather than close it after
    /// its upload. (A connection that closes instead ends the wait.)
    fn park(self: &Arc<Self>, mut conn: SendRequest<Body>) {
        let pool = Arc::downgrade(self);
        tokio::spawn(async move {
            if conn.ready().await.is_ok()
                && let Some(pool) = pool.upgrade()
            {
                pool.checkin(conn);
            }
        });
    }

    /// The most recently used idle connection that is still open and not idle for too long.
    fn checkout(&self) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(i) = idle.pop() {
            if !i.conn.is_closed() && i.since.elapsed() < POOL_IDLE_TIMEOUT {
                return Some(i.conn);
            }
        }
        None
    }

    fn checkin(&self, conn: SendRequest<Body>) {
        if conn.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        // Connections idle for too long leave from the bottom of the stack.
        let stale = idle
            .iter()
            .take_while(|i| i.since.elapsed() >= POOL_IDLE_TIMEOUT)
            .count();
        idle.drain(..stale);
        idle.push(Idle {
            conn,
            since: Instant::now(),
        });
    }

    /// A new connection; one for a WebSocket `upgrade` hands its connection over to
    /// [`hyper::upgrade::on`] after a 101.
    async fn connect(&self, upgrade: bool) -> Result<SendRequest<Body>, String> {
        let tcp = self
            .connector
            .clone()
            .call(self.connect_uri.clone())
            .await
            .map_err(|e| cause(&e))?;
        let Some(tls) = &self.tls else {
            return handshake(tcp, upgrade).await;
        };
        let connecting = tls
            .connector
            .connect(tls.server_name.clone(), tcp.into_inner());
        match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Err(_) => Err("TLS handshake with the upstream timed out".into()),
            Ok(Err(e)) => Err(format!("TLS handshake with the upstream: {}", cause(&e))),
            Ok(Ok(stream)) => handshake(TokioIo::new(stream), upgrade).await,
        }
    }
}

/// Starts HTTP/1 on a new upstream connection, plain or TLS (generic, so neither pays for the
/// other), and spawns its driver; for an `upgrade`, one that gives the connection up after a 101.
async fn handshake<T>(io: T, upgrade: bool) -> Result<SendRequest<Body>, String>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (conn, driver) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| cause(&e))?;
    tokio::spawn(async move {
        let ended = if upgrade {
            driver.with_upgrades().await
        } else {
            driver.await
        };
        if let Err(e) = ended {
            tracing::debug!(error = %e, "upstream connection ended");
        }
    });
    Ok(conn)
}

/// Whether `e` says the connection went away under a request (closed before any answer, reset,
/// a broken pipe), as a stale kept-alive connection does; not an answer hyper could not parse,
/// which a second try would only get again.
fn connection_lost(e: &hyper::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    if e.is_incomplete_message() {
        return true;
    }
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| matches!(io.kind(), BrokenPipe | ConnectionAborted | ConnectionReset))
}

/// A copy of `req` to send again if its connection fails under it: only for a bodyless request
/// of a safe method, the ones an upstream may receive twice without harm.
fn resendable(req: &Request<Body>) -> Option<Request<Body>> {
    let safe = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if !safe || !http_body::Body::is_end_stream(req.body()) {
        return None;
    }
    // Extensions are not copied: the gateway sets none that the upstream request reads.
    let mut copy = Request::new(Body::empty());
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    Some(copy)
}

/// An error and its source, for the log.
fn cause(e: &(dyn std::error::Error + 'static)) -> String {
    match e.source() {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    }
}

/// A response body that puts its connection back into the pool when it has been read to the
/// end. (A body dropped before its end leaves the connection mid-message: it is closed.)
struct PooledBody {
    inner: Incoming,
    conn: Option<(SendRequest<Body>, Weak<Pool>)>,
}

impl PooledBody {
    fn release(&mut self) {
        if let Some((conn, pool)) = self.conn.take()
            && let Some(pool) = pool.upgrade()
        {
            pool.checkin(conn);
        }
    }
}

impl http_body::Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.release(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.release(),
            Poll::Ready(Some(Err(_))) => self.conn = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the few headers present decides: most requests carry none, and most
    // responses only `Connection: keep-alive`. Nine hashed removals per message cost more than
    // the rest of the header handling.
    if !headers.keys().any(|n| HOP_BY_HOP.contains(n)) {
        return;
    }
    // Headers named in `Connection` are hop-by-hop too. Its usual tokens name none to look for:
    // `close`, and `keep-alive` (the header of that name is removed below anyway).
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.eq_ignore_ascii_case("close") && !t.eq_ignore_ascii_case("keep-alive"))
        .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    // A message framed by `Transfer-Encoding` (hyper decoded it so) that also names a
    // `Content-Length`: the length is not the body's and must not frame the next hop's message
    // (RFC 9112, 6.3: a proxy removes it; a sign of request smuggling, too).
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    while let Some(name) = headers.keys().find(|n| HOP_BY_HOP.contains(n)).cloned() {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(n, v)| {
                (
                    HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                )
            })
            .collect()
    }

    fn names(h: &HeaderMap) -> Vec<&str> {
        let mut n: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        n.sort_unstable();
        n
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_dropped() {
        let mut h = headers(&[
            ("content-type", "application/json"),
            ("connection", "keep-alive, X-Trace , close"),
            ("connection", "x-other"),
            ("keep-alive", "timeout=5"),
            ("x-trace", "1"),
            ("x-other", "2"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("te", "trailers"),
            ("x-kept", "3"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["content-type", "x-kept"]);
    }

    #[test]
    fn a_length_beside_a_transfer_encoding_goes_with_it() {
        let mut h = headers(&[
            ("transfer-encoding", "chunked"),
            ("content-length", "5"),
            ("x-kept", "1"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["x-kept"]);
    }

    #[test]
    fn a_message_without_hop_by_hop_headers_is_untouched() {
        let mut h = headers(&[("content-type", "text/event-stream"), ("x-kept", "1")]);
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["content-type", "x-kept"]);
        let mut h = headers(&[("connection", "keep-alive"), ("x-kept", "1")]);
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["x-kept"]);
    }
}
