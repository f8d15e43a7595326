//! `floodgate rls`: Envoy's rate limit service (`envoy.service.ratelimit.v3.RateLimitService`
//! over gRPC), reading envoyproxy/ratelimit's YAML and deciding each `ShouldRateLimit` call as
//! one atomic chain admission on the memory or Redis store. docs/envoy.md is the operator's
//! guide.
//!
//! - [`config`]: the YAML, validated with file, line and field, and descriptor matching;
//! - [`service`]: the decision and its answer;
//! - [`metrics`]: Prometheus metrics and the admin listener;
//! - [`reload`]: SIGHUP and changes of the files, whole or nothing;
//! - [`serve`] (the process) and [`run`] (the gRPC server on a listener, for embedding and
//!   tests).

pub mod config;
pub mod metrics;
pub mod reload;
pub mod service;
mod yaml;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use floodgate::store::redis::{OnError, RedisConfig, RedisStore};
use floodgate::store::{AnyStore, MemoryStore, SweeperGuard};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::server::{Signals, hangups};
pub use config::{RlsConfig, RlsConfigError};
pub use service::Rls;

/// envoyproxy/ratelimit's gRPC port, on loopback.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8081";

/// How often the memory store sweeps expired counters.
const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// What `floodgate rls` was started with.
#[derive(Debug, Clone)]
pub struct RlsOptions {
    /// The YAML file, or a directory of them.
    pub config: PathBuf,
    /// The gRPC listener.
    pub listen: SocketAddr,
    /// Redis, when set; else the memory store.
    pub redis_url: Option<String>,
    /// The Redis keys' prefix (the store's default when `None`).
    pub redis_prefix: Option<String>,
    /// With the store unreachable: `Open` answers `OK` unchecked, `Closed` answers a gRPC
    /// `UNAVAILABLE`, so that Envoy's `failure_mode_deny` decides.
    pub on_error: OnError,
    /// The admin listener (`GET /metrics`); none when `None`.
    pub admin_listen: Option<SocketAddr>,
    /// Global shadow mode ([`Rls::with_global_shadow`]).
    pub shadow: bool,
}

/// Why the service could not start, or stopped badly.
#[derive(Debug)]
pub enum RlsError {
    /// The config is invalid.
    Config(RlsConfigError),
    /// The store could not be opened (a malformed URL).
    Store(floodgate::Error),
    /// An address could not be listened on.
    Listen(SocketAddr, std::io::Error),
    /// The runtime, signals or the server failed.
    Server(String),
}

impl std::fmt::Display for RlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RlsError::Config(e) => write!(f, "{e}"),
            RlsError::Store(e) => write!(f, "store: {e}"),
            RlsError::Listen(addr, e) => write!(f, "cannot listen on {addr}: {e}"),
            RlsError::Server(e) => f.write_str(e),
        }
    }
}

impl std::error::Error for RlsError {}

/// Opens the store `options` name; the memory store's sweeper runs while the guard lives.
/// Redis unreachable at start is no error: the store applies `on_error` until it answers.
pub async fn open_store(
    options: &RlsOptions,
) -> Result<(AnyStore, Option<SweeperGuard>), floodgate::Error> {
    match &options.redis_url {
        None => {
            let store = MemoryStore::new();
            let sweeper = store.spawn_sweeper(SWEEP_INTERVAL);
            Ok((AnyStore::Memory(store), Some(sweeper)))
        }
        Some(url) => {
            let mut config = RedisConfig::new(url.clone());
            config.on_error = options.on_error;
            if let Some(prefix) = &options.redis_prefix {
                config.prefix = prefix.clone();
            }
            Ok((AnyStore::Redis(RedisStore::connect(config).await?), None))
        }
    }
}

/// The most calls read and decided at once, over every connection. A call's message is read
/// whole before it is decided (up to tonic's 4 MiB), and neither the calls of one connection
/// nor the connections are otherwise bounded: a client holding many calls with their messages
/// half sent made the process hold 4 MiB for each (200 of them on one connection: 900 MiB). A
/// call past this waits for its turn before its message is read (the rest of it then waits in
/// the client, under HTTP/2's flow control): with this, the same 200 held about 300 MiB. Far past what
/// Envoy keeps in flight (a call is decided in microseconds on memory, a round trip on Redis).
pub const MAX_CALLS: usize = 64;

/// How long a call may take once its turn came (reading its message included), unless it asks
/// for less (`grpc-timeout`): a client that never finishes its messages does not keep the
/// turns of [`MAX_CALLS`] from everyone else. Envoy gives up on a call after 20 ms by default.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The most calls one connection may have open at once: hyper's default for an HTTP/2 server,
/// which tonic's leaves unbounded.
const MAX_STREAMS: u32 = 200;

/// Serves `rls` over gRPC on `listener` until `shutdown` completes, then lets calls in flight
/// finish.
pub async fn run(
    listener: TcpListener,
    rls: Arc<Rls>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RlsError> {
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS)
        .timeout(CALL_TIMEOUT)
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(MAX_CALLS))
        .add_service(RateLimitServiceServer::from_arc(rls))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| RlsError::Server(format!("gRPC server: {e}")))
}

/// Runs the service until SIGTERM or Ctrl-C: the config loaded (or the start refused), the
/// store opened, the gRPC and admin listeners bound, reloads on SIGHUP and file changes.
/// Blocks the calling thread.
pub fn serve(options: &RlsOptions) -> Result<(), RlsError> {
    let loaded = reload::snapshot(&options.config);
    let config = RlsConfig::load(&options.config).map_err(RlsError::Config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name("floodgate-rls")
        .enable_all()
        .build()
        .map_err(|e| RlsError::Server(format!("cannot start the runtime: {e}")))?;
    runtime.block_on(async move {
        let mut signals = Signals::new().map_err(|e| RlsError::Server(format!("signals: {e}")))?;
        let mut hups = hangups().map_err(|e| RlsError::Server(format!("signals: {e}")))?;
        let (store, _sweeper) = open_store(options).await.map_err(RlsError::Store)?;
        let metrics = metrics::RlsMetrics::new();
        let domains = config.domains().len();
        let rls =
            Arc::new(Rls::new(config, store, metrics.clone()).with_global_shadow(options.shadow));
        let listener = TcpListener::bind(options.listen)
            .await
            .map_err(|e| RlsError::Listen(options.listen, e))?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let stopped = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        if let Some(addr) = options.admin_listen {
            let admin = TcpListener::bind(addr)
                .await
                .map_err(|e| RlsError::Listen(addr, e))?;
            tracing::info!(%addr, "admin listener: /metrics");
            tokio::spawn(metrics::serve_admin(
                admin,
                metrics,
                stopped(stop_rx.clone()),
            ));
        }
        let reloader = reload::Reloader::new(options.config.clone(), Arc::clone(&rls), loaded);
        let mut stopping = stop_rx.clone();
        tokio::spawn(async move {
            let watching = reload::watch(&reloader);
            tokio::pin!(watching);
            loop {
                tokio::select! {
                    hup = hups.recv() => match hup {
                        Some(()) => { let _ = reloader.reload(); }
                        None => std::future::pending::<()>().await,
                    },
                    () = &mut watching => {}
                    () = async { let _ = stopping.wait_for(|s| *s).await; } => return,
                }
            }
        });
        tokio::spawn(async move {
            signals.recv().await;
            tracing::info!("shutting down: finishing calls in flight");
            let _ = stop_tx.send(true);
            signals.recv().await;
            tracing::warn!("second signal: exiting now");
            crate::logs::writer::close();
            std::process::exit(1);
        });
        tracing::info!(
            addr = %options.listen,
            domains,
            store = if options.redis_url.is_some() { "redis" } else { "memory" },
            config = %options.config.display(),
            shadow = options.shadow,
            "floodgate rate limit service listening"
        );
        run(listener, rls, stopped(stop_rx)).await?;
        tracing::info!("stopped");
        Ok(())
    })
}
