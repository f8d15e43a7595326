//! The upstream connections of one worker, kept alive and reused; TLS to an https upstream.

use std::net::IpAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::uri::Authority;
use axum::http::{Method, Request, Response, Uri};
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;
use tower::Service;

/// How long to wait for a TCP connection to the upstream, and then for its TLS handshake.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled upstream connection is reused: less than the 5 s after which common
/// upstream servers (uvicorn, Node) close an idle keep-alive connection. A connection the
/// upstream closes just as it is reused fails the request it carried with 502, unless that
/// request may safely be sent again (see `Pool::send`).
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// How long a request waits for a pooled connection that is not ready yet (its driver has not
/// run since its last response) before taking another: a connection still sending an earlier
/// request's body is not kept waited on.
const REUSE_READY_WAIT: Duration = Duration::from_millis(50);

/// The upstream connections of one worker: HTTP/1 connections kept alive and reused, most
/// recently used first.
///
/// In place of hyper-util's pooling client, which on every request hashed a pool key, raced a
/// checkout against a lazily built connect future, formatted a `Host` header and spawned a task
/// to put the connection back once the response body was done. Here a connection goes back into
/// the idle list when its response body ends, from the body itself. A worker's requests all run
/// on its one thread, so the lock is never contended.
pub(super) struct Pool {
    connector: HttpConnector,
    /// What the connector connects to: the upstream's scheme and authority.
    connect_uri: Uri,
    /// For an https upstream: the TLS client to wrap each new connection in.
    tls: Option<Tls>,
    idle: Mutex<Vec<Idle>>,
}

/// TLS to an https upstream, set up once: every connection shares the config (and with it the
/// session cache, so reconnections resume sessions).
pub(super) struct Tls {
    connector: TlsConnector,
    /// The name the upstream's certificate must be valid for, sent as SNI: the base URL's host
    /// name, or its IP address.
    server_name: ServerName<'static>,
}

impl Tls {
    pub(super) fn new(authority: &Authority, ca_file: Option<&Path>) -> Result<Tls, String> {
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
    /// A pool with no connection yet: `connector` reaches `connect_uri`, and `tls` wraps what it
    /// connects for an https upstream.
    pub(super) fn new(connector: HttpConnector, connect_uri: Uri, tls: Option<Tls>) -> Pool {
        Pool {
            connector,
            connect_uri,
            tls,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Sends `req` on an idle connection, or a new one.
    ///
    /// A request that an idle connection refused before sending any of it (the upstream had
    /// just closed it) is sent again on another. A bodyless request of a safe method (`GET`,
    /// `HEAD`, `OPTIONS`) that a reused connection lost after sending it (closed or reset before
    /// any answer: the upstream closed its side as the request arrived) is sent once more on a
    /// new connection: sending it twice changes nothing upstream (RFC 9110, 9.2.2), as nginx's
    /// `proxy_next_upstream` does by default. An answer that cannot be parsed is no reason to
    /// send again. Any other failure is the answer: a request that may have reached the
    /// upstream is never sent twice. A failure of the request's own body (the caller's broken
    /// or cut upload) is told apart from the upstream's.
    pub(super) async fn send(
        self: &Arc<Self>,
        mut req: Request<Body>,
    ) -> Result<Response<Body>, Failed> {
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
                return Err(Failed::Upstream(
                    "the upstream closed a new connection".into(),
                ));
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
                    _ => return Err(Failed::of(e.error())),
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
    pub(super) async fn connect(&self, upgrade: bool) -> Result<SendRequest<Body>, String> {
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
pub(super) async fn handshake<T>(io: T, upgrade: bool) -> Result<SendRequest<Body>, String>
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

/// Why a request got no answer.
#[derive(Debug)]
pub(super) enum Failed {
    /// The upstream could not be reached or failed; the cause, for the log.
    Upstream(String),
    /// The request's body failed on its way: the caller's upload was malformed or cut off, or
    /// (`stalled`) the caller sent nothing for `header_timeout_sec`.
    Body {
        /// Whether the caller stopped sending ([`super::upload::Stalled`]).
        stalled: bool,
    },
}

impl Failed {
    /// What `e`, hyper's error for a request, says failed. hyper gives a body's own error as
    /// the cause of a user error; its other user errors on a client (the connection's task gone)
    /// have no cause, and are the connection's.
    fn of(e: &hyper::Error) -> Failed {
        match std::error::Error::source(e) {
            Some(body) if e.is_user() => Failed::Body {
                stalled: super::upload::stalled(body),
            },
            _ => Failed::Upstream(cause(e)),
        }
    }
}

impl From<String> for Failed {
    fn from(cause: String) -> Failed {
        Failed::Upstream(cause)
    }
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
pub(super) fn cause(e: &(dyn std::error::Error + 'static)) -> String {
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
