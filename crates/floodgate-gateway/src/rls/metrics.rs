//! The rate limit service's Prometheus metrics, and the admin listener that serves them
//! (`--admin-listen`, `GET /metrics`). The store and reload families have the gateway's names
//! and labels ([`crate::metrics`]); the decisions have their own (`floodgate_rls_*`), labelled
//! by bounded values only, never a domain, key or value of a descriptor.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::body::Body;
use axum::http::header::CONTENT_TYPE;
use axum::http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::metrics::{CONTENT_TYPE as METRICS_CONTENT_TYPE, Histogram, STORE_BUCKETS};
use crate::send_timed::SendTimed;

/// How a `ShouldRateLimit` call was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// `OK`, decided.
    Ok,
    /// `OVER_LIMIT`.
    OverLimit,
    /// `OK` without a decision: the store failed and fails open.
    Unenforced,
    /// A gRPC error: a bad request, or the store failing closed.
    Error,
    /// `OK` in global shadow mode, for a call decided `OVER_LIMIT`.
    ShadowOverLimit,
}

const ANSWERS: [&str; 5] = [
    "ok",
    "over_limit",
    "unenforced",
    "error",
    "shadow_over_limit",
];

/// What became of one descriptor of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DescriptorOutcome {
    /// No rule matched it.
    Unmatched,
    /// Its rule is `unlimited`.
    Unlimited,
    /// Its rule was replaced by another descriptor's (`replaces`).
    Replaced,
    /// Under 80% used after the request.
    Within,
    /// 80% used or more, and not over.
    Near,
    /// It refused the request.
    Over,
    /// A shadow rule (or any rule, in global shadow mode) that would have refused it.
    ShadowOver,
}

const OUTCOMES: [&str; 7] = [
    "unmatched",
    "unlimited",
    "replaced",
    "within",
    "near",
    "over",
    "shadow_over",
];

/// The service's metrics: a cheap clone, every clone counting into the same series.
#[derive(Clone)]
pub struct RlsMetrics(Arc<Inner>);

struct Inner {
    registry: Registry,
    answers: Vec<Counter>,
    descriptors: Vec<Counter>,
    store_duration: Histogram,
    store_errors: Counter,
    reloads_ok: Counter,
    reloads_error: Counter,
    last_reload: Gauge<f64, AtomicU64>,
}

impl fmt::Debug for RlsMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RlsMetrics")
    }
}

impl Default for RlsMetrics {
    fn default() -> Self {
        RlsMetrics::new()
    }
}

impl RlsMetrics {
    /// Every series at zero; the config counts as loaded now.
    pub fn new() -> RlsMetrics {
        let mut registry = Registry::default();
        let answers_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let answers = ANSWERS
            .iter()
            .map(|&a| answers_family.get_or_create(&[("code", a)]).clone())
            .collect();
        registry.register(
            "floodgate_rls_requests",
            "ShouldRateLimit calls answered, by overall code (unenforced: the store failed open; shadow_over_limit: OK in global shadow mode)",
            answers_family,
        );
        let descriptors_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let descriptors = OUTCOMES
            .iter()
            .map(|&o| descriptors_family.get_or_create(&[("outcome", o)]).clone())
            .collect();
        registry.register(
            "floodgate_rls_descriptors",
            "Descriptors of ShouldRateLimit calls, by what their rule made of them",
            descriptors_family,
        );
        let duration_family = Family::<
            [(&'static str, &'static str); 1],
            Histogram,
            fn() -> Histogram,
        >::new_with_constructor(|| Histogram::new(&STORE_BUCKETS));
        let store_duration = duration_family.get_or_create(&[("op", "admit")]).clone();
        registry.register(
            "floodgate_store_duration_seconds",
            "Store calls, by operation",
            duration_family,
        );
        let errors_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let store_errors = errors_family.get_or_create(&[("op", "admit")]).clone();
        registry.register(
            "floodgate_store_errors",
            "Store calls that failed (or were let through unchecked), by operation",
            errors_family,
        );
        let reloads_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let reloads_ok = reloads_family.get_or_create(&[("result", "ok")]).clone();
        let reloads_error = reloads_family.get_or_create(&[("result", "error")]).clone();
        registry.register(
            "floodgate_config_reloads",
            "Config reloads tried, by result",
            reloads_family,
        );
        let last_reload = Gauge::<f64, AtomicU64>::default();
        last_reload.set(crate::metrics::unix_now());
        registry.register(
            "floodgate_config_last_reload_success_timestamp_seconds",
            "When the running config was loaded, in seconds since the Unix epoch",
            last_reload.clone(),
        );
        RlsMetrics(Arc::new(Inner {
            registry,
            answers,
            descriptors,
            store_duration,
            store_errors,
            reloads_ok,
            reloads_error,
            last_reload,
        }))
    }

    /// Counts an answered call.
    pub fn answer(&self, answer: Answer) {
        let i = match answer {
            Answer::Ok => 0,
            Answer::OverLimit => 1,
            Answer::Unenforced => 2,
            Answer::Error => 3,
            Answer::ShadowOverLimit => 4,
        };
        self.0.answers[i].inc();
    }

    /// Counts one descriptor.
    pub fn descriptor(&self, outcome: DescriptorOutcome) {
        let i = match outcome {
            DescriptorOutcome::Unmatched => 0,
            DescriptorOutcome::Unlimited => 1,
            DescriptorOutcome::Replaced => 2,
            DescriptorOutcome::Within => 3,
            DescriptorOutcome::Near => 4,
            DescriptorOutcome::Over => 5,
            DescriptorOutcome::ShadowOver => 6,
        };
        self.0.descriptors[i].inc();
    }

    /// Times an admission; `failed` if it failed or was let through unchecked.
    pub fn store_call(&self, took: Duration, failed: bool) {
        self.0.store_duration.observe(took);
        if failed {
            self.0.store_errors.inc();
        }
    }

    /// Counts a reload: `ok`, or refused with the running config kept.
    pub fn reload(&self, ok: bool) {
        if ok {
            self.0.reloads_ok.inc();
            self.0.last_reload.set(crate::metrics::unix_now());
        } else {
            self.0.reloads_error.inc();
        }
    }

    /// The exposition in Prometheus's text format, as the gateway's `/metrics`.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.0.registry);
        crate::metrics::to_prometheus_text(&text)
    }
}

/// How long the metrics listener waits for a request head, and for a write its client takes
/// nothing of: nginx's `client_header_timeout` and `send_timeout`.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(60);

/// The most connections the metrics listener holds open at once; more wait in the backlog.
const ADMIN_CONNECTIONS: usize = 64;

/// Serves `GET /metrics` on `listener` until `shutdown` completes, timed and capped as the
/// gateway's admin listener is ([`ADMIN_TIMEOUT`], [`ADMIN_CONNECTIONS`]): a slow client cannot
/// hold its connections, nor the process's files, for good.
pub async fn serve_admin(
    listener: TcpListener,
    metrics: RlsMetrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let open = Arc::new(tokio::sync::Semaphore::new(ADMIN_CONNECTIONS));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(ADMIN_TIMEOUT);
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&open).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
            () = &mut shutdown => return,
        };
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors, say: waited out, not retried in a busy loop.
                    tracing::debug!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let metrics = metrics.clone();
        let service = service_fn(move |req: Request<Incoming>| {
            let metrics = metrics.clone();
            async move { Ok::<_, Infallible>(answer(&req, &metrics)) }
        });
        let io = TokioIo::new(SendTimed::new(tcp, ADMIN_TIMEOUT));
        let served = http.serve_connection(io, service);
        tokio::spawn(async move {
            if let Err(e) = served.await {
                tracing::debug!(error = %e, "admin connection ended");
            }
            drop(slot);
        });
    }
}

fn answer<B>(req: &Request<B>, metrics: &RlsMetrics) -> Response<Body> {
    let status = if req.uri().path() != "/metrics" {
        StatusCode::NOT_FOUND
    } else if req.method() != Method::GET && req.method() != Method::HEAD {
        StatusCode::METHOD_NOT_ALLOWED
    } else {
        let mut response = Response::new(Body::from(metrics.encode()));
        response.headers_mut().insert(
            CONTENT_TYPE,
            axum::http::HeaderValue::from_static(METRICS_CONTENT_TYPE),
        );
        return response;
    };
    let mut response = Response::new(Body::empty());
    *response.status_mut() = status;
    response
}
