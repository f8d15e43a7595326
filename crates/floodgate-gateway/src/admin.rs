//! The admin listener (`[admin]`): a second listener, loopback by default, apart from the
//! callers' port. It serves `GET /metrics` (Prometheus, [`crate::metrics`]) and `/admin/*`,
//! which asks for the bearer `[admin] secret` (compared by digest, never a key's secret).
//! Without an `[admin]` section there is no admin listener.

use std::convert::Infallible;
use std::future::Future;

use axum::body::Body;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;

use crate::config::AdminConfig;
use crate::error::AppError;
use crate::http::Process;
use crate::metrics::CONTENT_TYPE as METRICS_CONTENT_TYPE;

/// What the admin listener serves: the process's shared state, under `[admin]`'s rules.
#[derive(Clone, Debug)]
pub struct Admin {
    config: AdminConfig,
    process: Process,
}

impl Admin {
    /// The admin listener of `process`, as `config` sets it.
    pub fn new(config: AdminConfig, process: Process) -> Admin {
        Admin { config, process }
    }

    /// Answers one request.
    pub async fn answer<B>(&self, req: Request<B>) -> Response {
        let path = req.uri().path();
        if path == "/metrics" {
            if req.method() != Method::GET && req.method() != Method::HEAD {
                return StatusCode::METHOD_NOT_ALLOWED.into_response();
            }
            if self.config.metrics_auth && !self.authorized(&req) {
                return AppError::Unauthorized.into_response();
            }
            let metrics = &self.process.metrics;
            metrics.realtime_sessions(self.process.live_sessions.count());
            return ([(CONTENT_TYPE, METRICS_CONTENT_TYPE)], metrics.encode()).into_response();
        }
        if path == "/admin" || path.starts_with("/admin/") {
            if !self.authorized(&req) {
                return AppError::Unauthorized.into_response();
            }
            return AppError::NotFound.into_response();
        }
        AppError::NotFound.into_response()
    }

    /// Whether `req` carries the admin secret as its bearer token.
    fn authorized<B>(&self, req: &Request<B>) -> bool {
        let Some(want) = &self.config.secret_sha256 else {
            return false;
        };
        req.headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .is_some_and(|(_, token)| {
                <[u8; 32]>::from(Sha256::digest(token.trim().as_bytes())) == *want
            })
    }
}

/// Serves `admin` on `listener` until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    admin: Admin,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
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
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let admin = admin.clone();
                async move { Ok::<_, Infallible>(admin.answer(req.map(Body::new)).await) }
            });
            let served = http1::Builder::new().serve_connection(TokioIo::new(tcp), service);
            if let Err(e) = served.await {
                tracing::debug!(error = %e, "admin connection ended");
            }
        });
    }
}
