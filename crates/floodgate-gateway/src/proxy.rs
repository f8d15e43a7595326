//! Forwarding to the upstream: one pooled HTTP/1 client, bodies streamed both ways.
//!
//! The caller's `Authorization` (the gateway key) and `X-Floodgate-Customer` never leave the
//! gateway; the upstream's own key, if configured, is sent instead. Hop-by-hop headers are
//! dropped in both directions. Connect failures answer 502; no response headers within
//! `[upstream] timeout_sec` answer 504.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::header::{self, HeaderName};
use axum::http::uri::{Authority, Parts, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderValue, Request, Response, Uri, Version};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tower::ServiceExt;

use crate::auth::CUSTOMER_HEADER;
use crate::config::{UpstreamConfig, UpstreamTarget};
use crate::error::AppError;

/// How long to wait for a TCP connection to the upstream.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled upstream connection is kept.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

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
        client: Client<HttpConnector, Body>,
        base: String,
        /// `base` split once at load: scheme and authority, and the path prefix (may be empty).
        authority: Authority,
        /// The `Host` header for the authority, built once (the client would format it anew
        /// on every request).
        host: HeaderValue,
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
            } => {
                let auth = match api_key_env {
                    None => None,
                    Some(var) => {
                        let key = std::env::var(var).map_err(|_| {
                            format!(
                                "upstream.api_key_env: the environment variable {var} is not set"
                            )
                        })?;
                        let mut v = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                            format!("upstream.api_key_env: {var} holds characters not allowed in a header")
                        })?;
                        v.set_sensitive(true);
                        Some(v)
                    }
                };
                let mut connector = HttpConnector::new();
                connector.set_nodelay(true);
                connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
                connector.enforce_http(true);
                let client = Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                    .build(connector);
                let rest = base_url.strip_prefix("http://").unwrap_or(base_url);
                let (host, prefix) = match rest.find('/') {
                    Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
                    None => (rest, ""),
                };
                let authority = host
                    .parse::<Authority>()
                    .map_err(|e| format!("upstream.base_url: bad host `{host}`: {e}"))?;
                let host = HeaderValue::from_str(authority.as_str())
                    .map_err(|e| format!("upstream.base_url: bad host `{host}`: {e}"))?;
                Target::Http {
                    client,
                    base: base_url.clone(),
                    authority,
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

    /// Whether this is the built-in demo.
    pub fn is_demo(&self) -> bool {
        matches!(self.target, Target::Demo(_))
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
                client,
                authority,
                host,
                prefix,
                auth,
                ..
            } => {
                headers.insert(header::HOST, host.clone());
                if let Some(auth) = auth {
                    headers.insert(header::AUTHORIZATION, auth.clone());
                }
                let path_and_query = match (prefix.is_empty(), req.uri().path_and_query()) {
                    // The common case: no prefix; the request's path is reused as is.
                    (true, Some(pq)) => pq.clone(),
                    (_, pq) => {
                        let pq = pq.map_or("/", PathAndQuery::as_str);
                        format!("{prefix}{pq}")
                            .parse::<PathAndQuery>()
                            .map_err(|e| {
                                AppError::BadRequest(format!("cannot forward this path: {e}"))
                            })?
                    }
                };
                let mut uri = Parts::default();
                uri.scheme = Some(Scheme::HTTP);
                uri.authority = Some(authority.clone());
                uri.path_and_query = Some(path_and_query);
                *req.uri_mut() = Uri::from_parts(uri)
                    .map_err(|e| AppError::Internal(format!("upstream URI: {e}")))?;
                *req.version_mut() = Version::HTTP_11;
                let resp = match tokio::time::timeout(self.timeout, client.request(req)).await {
                    Err(_) => return Err(AppError::UpstreamTimeout),
                    Ok(Err(e)) => {
                        let cause = match std::error::Error::source(&e) {
                            Some(s) => format!("{e}: {s}"),
                            None => e.to_string(),
                        };
                        return Err(AppError::UpstreamUnavailable(cause));
                    }
                    Ok(Ok(resp)) => resp,
                };
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Ok(Response::from_parts(parts, Body::new(body)))
            }
        }
    }
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the few headers present decides: most requests carry none, and most
    // responses only `Connection: keep-alive`. Nine hashed removals per message cost more than
    // the rest of the header handling.
    if !headers.keys().any(|n| HOP_BY_HOP.contains(n)) {
        return;
    }
    // Headers named in `Connection` are hop-by-hop too.
    let connection: Vec<HeaderValue> = headers
        .get_all(header::CONNECTION)
        .iter()
        .cloned()
        .collect();
    for name in connection
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
    {
        headers.remove(name);
    }
    while let Some(name) = headers.keys().find(|n| HOP_BY_HOP.contains(n)).cloned() {
        headers.remove(name);
    }
}
