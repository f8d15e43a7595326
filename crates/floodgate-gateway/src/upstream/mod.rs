//! Forwarding to the upstream: a pool of kept-alive HTTP/1 connections per worker, bodies
//! streamed both ways; over TLS (rustls) for an `https://` upstream.
//!
//! The caller's `Authorization` (the gateway key) and `X-Floodgate-Customer` never leave the
//! gateway; the upstream's own key, if configured, is sent instead. Hop-by-hop headers are
//! dropped in both directions. Connect failures (TLS handshakes included) answer 502; no response
//! headers within `[upstream] timeout_sec` of the request body's last piece answer 504
//! ([`upload`]: a caller's body streamed on is timed as it comes).
//!
//! An in-process target ([`InProcess`]) stands in for a remote upstream: the demo plugs into
//! it, so that this client knows nothing of what serves it.

mod pool;
mod upload;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::header::{self, HeaderName};
use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::io::DuplexStream;
use tower::ServiceExt;

use crate::auth::{CUSTOMER_HEADER, SESSION_COOKIE};
use crate::config::{UpstreamConfig, UpstreamTarget};
use crate::error::AppError;
use crate::startup::StartError;

use pool::{CONNECT_TIMEOUT, Failed, Pool, Tls, cause, handshake};
use upload::{Progress, Upload, answered_within};

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

/// Where a prepared request goes.
enum Addressed<'a> {
    /// An http upstream's connections.
    Pool(&'a Arc<Pool>),
    /// The in-process target.
    InProcess(&'a InProcess),
}

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
    InProcess(InProcess),
}

/// An upstream served in this process (the built-in demo): a router for plain requests, and a
/// server for the in-process pipe that a realtime upgrade opens.
#[derive(Clone)]
pub struct InProcess {
    /// Answers plain requests.
    pub router: Router,
    /// Serves HTTP/1.1 (and the WebSocket upgrade) on one end of a pipe.
    pub realtime: fn(DuplexStream) -> Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Http { base, auth, .. } => f
                .debug_struct("Http")
                .field("base", base)
                .field("auth", &auth.as_ref().map(|_| "<redacted>"))
                .finish(),
            Target::InProcess(_) => f.write_str("InProcess"),
        }
    }
}

impl Upstream {
    /// The upstream `config` names; reads the API key from its environment variable. The demo
    /// target is served by `in_process`.
    pub fn from_config(
        config: &UpstreamConfig,
        in_process: Option<InProcess>,
    ) -> Result<Upstream, StartError> {
        Upstream::build(config, in_process).map_err(StartError::Upstream)
    }

    fn build(config: &UpstreamConfig, in_process: Option<InProcess>) -> Result<Upstream, String> {
        let target = match &config.target {
            UpstreamTarget::Demo => Target::InProcess(
                in_process.ok_or("upstream: the demo upstream needs its in-process server")?,
            ),
            UpstreamTarget::Http {
                base_url,
                api_key_env,
                ca_file,
            } => {
                let auth = match api_key_env {
                    None => None,
                    Some(var) => Some(api_key(var)?),
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
                    pool: Arc::new(Pool::new(connector, connect_uri, tls)),
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
    ///
    /// With `upload_idle`, the body is the caller's, sent on as it comes: it must keep coming,
    /// a piece at least every `upload_idle` (else 408), and the upstream's `timeout_sec` counts
    /// from its last piece. A body that fails on its way (malformed, cut off) is a 400: the
    /// caller's doing, not the upstream's.
    pub async fn send(
        &self,
        mut req: Request<Body>,
        upload_idle: Option<Duration>,
    ) -> Result<Response<Body>, AppError> {
        match self.address(&mut req)? {
            Addressed::InProcess(target) => {
                let resp = target
                    .router
                    .clone()
                    .oneshot(req)
                    .await
                    .map_err(|e| AppError::Internal(format!("demo upstream: {e}")))?;
                Ok(resp)
            }
            Addressed::Pool(pool) => {
                let sent = match upload_idle {
                    Some(idle) if !http_body::Body::is_end_stream(req.body()) => {
                        let progress = Arc::new(Progress::new());
                        let upload = Arc::clone(&progress);
                        let req = req.map(|body| Body::new(Upload::new(body, idle, upload)));
                        answered_within(pool.send(req), self.timeout, &progress).await
                    }
                    _ => tokio::time::timeout(self.timeout, pool.send(req))
                        .await
                        .ok(),
                };
                let resp = match sent {
                    None => return Err(AppError::UpstreamTimeout),
                    Some(Err(Failed::Upstream(cause))) => {
                        return Err(AppError::UpstreamUnavailable(cause));
                    }
                    Some(Err(Failed::Body { stalled: true })) => return Err(AppError::BodyTimeout),
                    Some(Err(Failed::Body { stalled: false })) => {
                        return Err(AppError::BadRequest(
                            "The request body could not be read.".into(),
                        ));
                    }
                    Some(Ok(resp)) => resp,
                };
                let (mut parts, body) = resp.into_parts();
                if !chunked_at_most(&parts.headers) {
                    // hyper takes off the chunked framing and leaves the rest (`gzip, chunked`):
                    // passed on without the header (hop-by-hop), the caller would read coded
                    // bytes as the answer, and metering would find no usage in them.
                    return Err(AppError::UpstreamUnavailable(
                        "the upstream answered with a transfer coding other than chunked".into(),
                    ));
                }
                strip_hop_by_hop(&mut parts.headers);
                self.own_account(parts.status, &mut parts.headers)?;
                Ok(Response::from_parts(parts, body))
            }
        }
    }

    /// An answer to a request sent with the gateway's own upstream key (`api_key_env`), a
    /// realtime handshake's included: the account's names taken off, and a 401 (the gateway's
    /// key refused, not the caller's: the caller can do nothing about it, and the upstream's
    /// answer may show part of the key) an error. Other answers pass as they are.
    fn own_account(&self, status: StatusCode, headers: &mut HeaderMap) -> Result<(), AppError> {
        if !matches!(&self.target, Target::Http { auth: Some(_), .. }) {
            return Ok(());
        }
        if status == StatusCode::UNAUTHORIZED {
            return Err(AppError::UpstreamUnavailable(
                "the upstream refused the gateway's API key (401)".into(),
            ));
        }
        strip_account(headers);
        Ok(())
    }

    /// Whether a request for `uri` can be forwarded: its path and query behind the base URL's
    /// path prefix must still fit a URI (`http` takes at most [`MAX_PATH_AND_QUERY`] bytes; a
    /// prefix and a valid path and query joined are valid but for their length). Asked before
    /// admission, so that a request that cannot be sent is refused uncharged.
    pub fn forwardable(&self, uri: &Uri) -> Result<(), AppError> {
        let Target::Http { prefix, .. } = &self.target else {
            return Ok(());
        };
        let len = uri.path_and_query().map_or(1, |pq| pq.as_str().len());
        if !prefix.is_empty() && prefix.len() + len > MAX_PATH_AND_QUERY {
            return Err(AppError::BadRequest(format!(
                "The request's path and query are too long to forward behind the upstream's \
                 path prefix (at most {} bytes).",
                MAX_PATH_AND_QUERY - prefix.len()
            )));
        }
        Ok(())
    }

    /// Prepares `req` for the upstream: hop-by-hop headers, the gateway key and the customer
    /// header removed; for an http upstream, its `Host`, its own key and the path in origin
    /// form. Says where it goes.
    fn address(&self, req: &mut Request<Body>) -> Result<Addressed<'_>, AppError> {
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        headers.remove(header::AUTHORIZATION);
        headers.remove(CUSTOMER_HEADER);
        strip_session_cookie(headers);
        match &self.target {
            Target::InProcess(target) => Ok(Addressed::InProcess(target)),
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
                    // Sent with the gateway's own key, a request's organization and project
                    // are the gateway's to choose, not a caller's: a caller naming another
                    // organization of the key's would bill it (docs/gateway.md).
                    for name in &UPSTREAM_ACCOUNT {
                        headers.remove(name);
                    }
                }
                to_origin_form(req, prefix)?;
                Ok(Addressed::Pool(pool))
            }
        }
    }
}

impl Upstream {
    /// Forwards a WebSocket upgrade request (`GET` with `Upgrade: websocket`) on a new
    /// connection of its own, which an upgrade consumes and no pool could reuse (for the demo
    /// upstream, an in-process pipe to its server). Headers are treated as
    /// in [`Upstream::send`], then `Connection: upgrade` and `Upgrade: websocket` are set again.
    /// Returns the upstream's answer, whose hop-by-hop headers are dropped: on a 101,
    /// [`hyper::upgrade::on`] gives the upgraded connection.
    pub async fn upgrade(&self, mut req: Request<Body>) -> Result<Response<Incoming>, AppError> {
        let pool = self.address(&mut req)?;
        let headers = req.headers_mut();
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        let pool = match pool {
            Addressed::Pool(pool) => Ok(pool),
            Addressed::InProcess(target) => Err(target.realtime),
        };
        let send = async {
            let mut conn = match pool {
                Ok(pool) => pool.connect(true).await?,
                Err(serve) => {
                    // A pipe as wide as a socket's buffer: the demo's frames are small.
                    let (ours, theirs) = tokio::io::duplex(64 * 1024);
                    tokio::spawn(serve(theirs));
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
        self.own_account(resp.status(), resp.headers_mut())?;
        Ok(resp)
    }
}

/// The request headers that pick which of an upstream key's organizations and projects a
/// request is billed to (OpenAI's), which the upstream also answers with.
static UPSTREAM_ACCOUNT: [HeaderName; 2] = [
    HeaderName::from_static("openai-organization"),
    HeaderName::from_static("openai-project"),
];

/// Removes the upstream account's names from an answer sent with the gateway's own key: they
/// are the gateway's, not the caller's business.
fn strip_account(headers: &mut HeaderMap) {
    for name in &UPSTREAM_ACCOUNT {
        headers.remove(name);
    }
}

/// The `Authorization` value for the upstream key in the environment variable `var`, or why it
/// cannot be sent (`check-config` reports the same). Never echoes the key.
pub fn api_key(var: &str) -> Result<HeaderValue, String> {
    let key = std::env::var(var).map_err(|e| match e {
        std::env::VarError::NotPresent => {
            format!("upstream.api_key_env: the environment variable {var} is not set")
        }
        std::env::VarError::NotUnicode(_) => {
            format!("upstream.api_key_env: {var} holds bytes that are not UTF-8")
        }
    })?;
    // Set but empty (or blank): every request would go out with `Authorization: Bearer ` and be
    // charged for the upstream's 401.
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
    Ok(v)
}

/// The longest path and query `http` parses (`u16::MAX - 1` bytes).
const MAX_PATH_AND_QUERY: usize = u16::MAX as usize - 1;

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

/// Takes the admin console's session cookie ([`SESSION_COOKIE`]) out of the request's cookies;
/// the others go on as they came. A request without it is not touched. Read as bytes: a
/// browser sends one `Cookie` line for every cookie of the host, whatever port set it, and
/// another app's cookie with a byte that is not text in it must not hide the session's.
fn strip_session_cookie(headers: &mut HeaderMap) {
    let is_session = |c: &[u8]| {
        c.trim_ascii()
            .strip_prefix(SESSION_COOKIE.as_bytes())
            .is_some_and(|rest| rest.trim_ascii_start().starts_with(b"="))
    };
    let carries = headers
        .get_all(header::COOKIE)
        .iter()
        .any(|v| v.as_bytes().split(|&b| b == b';').any(is_session));
    if !carries {
        return;
    }
    let kept: Vec<HeaderValue> = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| {
            let rest: Vec<&[u8]> = v
                .as_bytes()
                .split(|&b| b == b';')
                .filter(|c| !is_session(c))
                .map(<[u8]>::trim_ascii)
                .collect();
            HeaderValue::from_bytes(&rest.join(&b"; "[..])).ok()
        })
        .filter(|v| !v.is_empty())
        .collect();
    headers.remove(header::COOKIE);
    for v in kept {
        headers.append(header::COOKIE, v);
    }
}

/// Whether `headers` frame a message with no transfer coding, or with `chunked` alone (which
/// hyper takes off): the only framings the gateway can pass on, re-framed, as they came. The
/// gateway never offers others (it sends no `TE`), so another is the upstream's mistake.
fn chunked_at_most(headers: &HeaderMap) -> bool {
    !headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .all(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"))
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
    // Read as bytes: a value with one byte that is not text (obs-text, which hyper accepts)
    // still names the others.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.eq_ignore_ascii_case(b"close") && !t.eq_ignore_ascii_case(b"keep-alive"))
        .filter_map(|n| HeaderName::from_bytes(n).ok())
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

    #[test]
    fn the_console_session_cookie_never_reaches_the_upstream() {
        let mut h = HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; floodgate_session=123.n.t; b=2"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("floodgate_session=x"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("floodgate_sessionx=keep"),
        );
        strip_session_cookie(&mut h);
        let left: Vec<&str> = h
            .get_all(header::COOKIE)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(left, ["a=1; b=2", "floodgate_sessionx=keep"]);
        let mut none = HeaderMap::new();
        none.append(header::COOKIE, HeaderValue::from_static("a=1"));
        strip_session_cookie(&mut none);
        assert_eq!(none.get(header::COOKIE).unwrap(), "a=1");
        // Another app's cookie on the same line, with bytes that are not text: the session's
        // still goes (before, the whole line went on as it came), the other stays as it was.
        let mut mixed = HeaderMap::new();
        mixed.append(
            header::COOKIE,
            HeaderValue::from_bytes(b"pref=caf\xc3\xa9; floodgate_session=123.n.t").unwrap(),
        );
        strip_session_cookie(&mut mixed);
        assert_eq!(
            mixed.get(header::COOKIE).unwrap().as_bytes(),
            b"pref=caf\xc3\xa9"
        );
    }

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
    fn a_connection_value_with_a_byte_that_is_not_text_still_names_its_headers() {
        let mut h = HeaderMap::new();
        h.append(
            header::CONNECTION,
            HeaderValue::from_bytes(b"x-trace, \xe9").unwrap(),
        );
        h.append("x-trace", HeaderValue::from_static("1"));
        h.append("x-kept", HeaderValue::from_static("2"));
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["x-kept"]);
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
