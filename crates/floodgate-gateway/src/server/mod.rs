//! The process: worker threads, each a single-threaded event loop with its own listening socket
//! (`SO_REUSEPORT`, so the kernel spreads connections), its own upstream connection pool and, on
//! Redis, its own Redis connection; and a background runtime for the signal handler and the
//! memory store's shared state.
//!
//! Why not one multi-threaded runtime: a proxied request hops between the caller's connection,
//! the upstream connection (a task of its own) and back; on a work-stealing runtime those hops
//! wake other threads. A worker keeps a request's whole life on one thread, as nginx's workers
//! do. Measured on a loaded 2-core machine against nginx as a plain proxy hop: 77-80% of its
//! throughput with two workers, 50-85% (erratic) with one work-stealing runtime.
//!
//! Each worker serves the pipeline with [`run`] (the accept loop, `accept.rs`); once it has
//! drained, it waits for the charges its responses caused to land ([`Charger::settled`]), then
//! stops.
//!
//! [`Charger::settled`]: crate::charge::Charger::settled

mod accept;

pub use accept::run;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use tokio::net::TcpSocket;
use tokio::sync::{mpsc as tmpsc, watch};

use crate::admin::Admin;
use crate::config::{Backend, Config, UpstreamTarget, default_workers};
use crate::http::{AppState, Process};
use crate::metering::LINGER;
use crate::reload::{self, Reloader};
use crate::startup::StartError;
use crate::store::{self, GatewayStore};
use crate::tally::Tally;

/// How long a graceful shutdown waits for requests in flight before exiting anyway.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the tally's flush at exit keeps trying to save (Redis restarting, the file's lock
/// held by another process's flush) before it gives the counts up, logged.
const FINAL_FLUSH_WITHIN: Duration = Duration::from_secs(5);

/// When the process was told to stop (a signal, or a worker that could not start): the drain
/// deadline counts from then, not from when the drain loop starts waiting.
#[derive(Clone, Debug, Default)]
struct StopClock(Arc<std::sync::OnceLock<tokio::time::Instant>>);

impl StopClock {
    /// Notes now as the stop's instant (the first call only).
    fn mark(&self) {
        let _ = self.0.set(tokio::time::Instant::now());
    }

    /// When the drain must be over: `DRAIN_TIMEOUT` after the stop (after now if none came).
    fn deadline(&self) -> tokio::time::Instant {
        self.0
            .get()
            .copied()
            .unwrap_or_else(tokio::time::Instant::now)
            + DRAIN_TIMEOUT
    }
}

/// Runs the gateway for `config` until SIGTERM or Ctrl-C, then drains. Blocks the calling
/// thread. Errors are for a gateway that could not start (store, listen address, upstream key).
pub fn serve(config: &Config) -> Result<(), StartError> {
    let background = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("floodgate-bg")
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_clock = StopClock::default();
    // Read before anything listens: a tally file that cannot be read stops the start.
    let tally = Arc::new(Tally::open(config).map_err(StartError::Tally)?);
    // SIGTERM and Ctrl-C are taken over before anything starts: workers start one at a time
    // (each opening its store: up to the Redis store's 1 s connect timeout with Redis slow to
    // answer), and a signal in that window must stop the start and drain what has started, not
    // kill the process under a worker that already listens.
    let mut signals = {
        let _runtime = background.enter();
        Signals::new().map_err(StartError::Signals)?
    };
    // SIGHUP reloads the config; taken over now too, as its default action ends the process.
    // Hangups before the workers are up wait in the channel for the reloader.
    let mut hangups = {
        let _runtime = background.enter();
        hangups().map_err(StartError::Signals)?
    };
    background.spawn({
        let stop_tx = stop_tx.clone();
        let tally = Arc::clone(&tally);
        let stop_clock = stop_clock.clone();
        async move {
            signals.recv().await;
            tracing::info!("shutting down: draining requests in flight");
            stop_clock.mark();
            let _ = stop_tx.send(true);
            // A second signal during the drain: the operator wants out now.
            signals.recv().await;
            tracing::warn!("second signal: exiting without waiting for the drain");
            tally.flush().await;
            crate::logs::writer::close();
            std::process::exit(1);
        }
    });
    for warning in config
        .store
        .ignored_url_warning()
        .into_iter()
        .chain(config.unused_limit_warnings())
    {
        tracing::warn!("{warning}");
    }
    background.spawn(Arc::clone(&tally).flush_until({
        let mut stopping = stop_rx.clone();
        async move {
            let _ = stopping.wait_for(|s| *s).await;
        }
    }));
    // The memory store is one state that every worker shares. A Redis store is opened by each
    // worker on its own event loop instead (see `Worker::run`): its connection's driver task
    // then runs on the thread of the requests that use it.
    let (shared, _store_guard) = match config.store.backend {
        Backend::Memory => {
            let (store, guard) = background
                .block_on(store::open(&config.store))
                .map_err(StartError::Store)?;
            (Some(store), Some(guard))
        }
        Backend::Redis | Backend::RedisCluster => (None, None),
    };
    let workers = if cfg!(unix) {
        config.workers.unwrap_or_else(default_workers)
    } else {
        1
    };

    // The workers share the port with SO_REUSEPORT, which would also let a second gateway (of
    // the same user) bind it and take half the traffic, each with its own limits. A plain bind
    // first fails if anything listens there already.
    if workers > 1 && config.listen.port() != 0 {
        std::net::TcpListener::bind(config.listen).map_err(|source| StartError::Listen {
            addr: config.listen,
            source,
        })?;
    }
    // `[realtime] max_connections` holds for the process: every worker counts on this one.
    // `[realtime] max_connections` and `[server] max_buffered_mib` hold for the process: every
    // worker counts on these.
    let process = Process::new(config, Arc::clone(&tally));
    // The admin listener, on the background runtime: bound before the workers, so that an
    // address already taken stops the start.
    let mut _admin_store_guard = None;
    if let Some(admin) = &config.admin {
        let addr = admin.listen;
        let listener = background
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(|source| StartError::Listen { addr, source })?;
        // The admin API reads and resets the workers' state: the memory store they share, or
        // a Redis connection of its own, whose driver runs here on the background runtime.
        let admin_store = match &shared {
            Some(store) => store.clone(),
            None => {
                let (store, guard) = background
                    .block_on(store::open(&config.store))
                    .map_err(StartError::Store)?;
                _admin_store_guard = Some(guard);
                store
            }
        };
        let admin =
            Admin::new(admin.clone(), process.clone(), admin_store).map_err(StartError::Worker)?;
        tracing::info!(%addr, "admin listener: the console at /, /admin/*, /metrics");
        let mut stopping = stop_rx.clone();
        let timeout = config.header_timeout;
        background.spawn(crate::admin::run(listener, admin, timeout, async move {
            let _ = stopping.wait_for(|s| *s).await;
        }));
    }
    // Each worker's state, for reloads.
    let mut states = Vec::with_capacity(workers);
    let (done_tx, mut done_rx) = tmpsc::unbounded_channel::<std::io::Result<()>>();
    let mut addr = config.listen;
    let mut started = 0;
    // A worker that cannot start stops the start; those already listening drain first.
    let mut start_failure = None;
    for i in 0..workers {
        if *stop_rx.borrow() {
            break;
        }
        // A channel of the worker's own, whose only sender it holds: if it dies before it says
        // whether it listens, the wait below ends (a sender kept here would wait for good).
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(SocketAddr, AppState), StartError>>();
        let worker = Worker {
            bind: addr,
            reuse_port: workers > 1,
            config: config.clone(),
            store: shared.clone(),
            process: process.clone(),
            stop: stop_rx.clone(),
            stop_clock: stop_clock.clone(),
            ready: ready_tx,
            done: done_tx.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name(format!("floodgate-{i}"))
            .spawn(move || worker.run());
        let ready = match spawned {
            Ok(_) => ready_rx.recv(),
            Err(e) => Ok(Err(StartError::Worker(format!(
                "cannot start a worker thread: {e}"
            )))),
        };
        match ready {
            // With `listen = "...:0"` the first worker's port is everyone's.
            Ok(Ok((bound, state))) => {
                addr = bound;
                started += 1;
                states.push(state);
            }
            Ok(Err(e)) => {
                start_failure = Some(e);
                break;
            }
            Err(_) => {
                start_failure = Some(StartError::Worker(
                    "a worker thread died at start".to_owned(),
                ));
                break;
            }
        }
    }
    drop(done_tx);

    if let Some(e) = &start_failure {
        stop_clock.mark();
        let _ = stop_tx.send(true);
        if started > 0 {
            tracing::error!(error = %e, started, "a worker could not start: draining those that did");
        }
    } else if *stop_rx.borrow() {
        tracing::info!(started, workers, "stopped while starting");
    } else {
        // The workers built their upstreams (and any TLS config) already; this only reads the
        // config.
        if config.upstream.target == UpstreamTarget::Demo {
            tracing::warn!(
                "upstream: the built-in DEMO upstream answers /v1/chat/completions with a fixed reply; no model is called"
            );
        }
        tracing::info!(
            %addr,
            workers,
            store = store::backend_name(config.store.backend),
            keys = config.keys.len(),
            config = %config.path.display(),
            "floodgate gateway listening"
        );
        // Reloads, from SIGHUP and from changes of the file, one at a time, each off the
        // background runtime's one thread while it runs (the admin listener stays served).
        let reloader = Reloader::new(config.clone(), states, process.clone());
        let mut stopping = stop_rx.clone();
        background.spawn(async move {
            let watching = reload::watch(&reloader);
            tokio::pin!(watching);
            loop {
                tokio::select! {
                    hup = hangups.recv() => match hup {
                        Some(()) => {
                            let _ = reloader.reload_in_place();
                        }
                        None => std::future::pending::<()>().await,
                    },
                    () = &mut watching => {}
                    () = async { let _ = stopping.wait_for(|s| *s).await; } => return,
                }
            }
        });
    }

    let result = background.block_on(async move {
        let mut stopping = stop_rx.clone();
        // From the signal, not from here: one that came while workers started counts too.
        let deadline = async move {
            let _ = stopping.wait_for(|s| *s).await;
            tokio::time::sleep_until(stop_clock.deadline()).await;
        };
        tokio::pin!(deadline);
        let mut failure = None;
        loop {
            tokio::select! {
                done = done_rx.recv() => match done {
                    Some(Ok(())) => {}
                    Some(Err(e)) => failure = Some(StartError::Server(e)),
                    None => break,
                },
                () = &mut deadline => {
                    // Not a clean stop: requests in flight were cut (no log line, no tokens
                    // recorded for them), which a supervisor should see in the exit status.
                    failure = Some(StartError::DrainTimedOut(DRAIN_TIMEOUT));
                    break;
                }
            }
        }
        start_failure.or(failure)
    });
    // Every worker has drained (or the drain timed out): what they counted goes in the tally,
    // retried for a while if the tally's Redis or file is not there to take it.
    background.block_on(tally.flush_final(FINAL_FLUSH_WITHIN));
    match result {
        Some(e) => Err(e),
        None => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

struct Worker {
    bind: SocketAddr,
    reuse_port: bool,
    config: Config,
    /// The shared store; `None`: the worker opens its own (Redis).
    store: Option<GatewayStore>,
    /// What the workers share: the refusal tally (the worker counts into counters of its own),
    /// the live realtime sessions, the room for bodies.
    process: Process,
    stop: watch::Receiver<bool>,
    /// When the stop came: the drain deadline counts from it.
    stop_clock: StopClock,
    ready: mpsc::Sender<Result<(SocketAddr, AppState), StartError>>,
    done: tmpsc::UnboundedSender<std::io::Result<()>>,
}

impl Worker {
    fn run(self) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = self.ready.send(Err(StartError::Runtime(e)));
                return;
            }
        };
        let Worker {
            bind,
            reuse_port,
            config,
            store,
            process,
            mut stop,
            stop_clock,
            ready,
            done,
        } = self;
        let result = runtime.block_on(async move {
            let listener = match listen(bind, reuse_port) {
                Ok(l) => l,
                Err(e) => {
                    let _ = ready.send(Err(StartError::Listen {
                        addr: bind,
                        source: e,
                    }));
                    return Ok(());
                }
            };
            // A Redis store per worker: one multiplexed connection whose driver task lives on
            // this event loop, so a decision never waits for another thread to wake up, and
            // the decisions of one loop turn leave in one write (Redis reads them in one read).
            // Measured on 2 cores: one connection shared from a background thread cost a
            // cross-thread wakeup per call and about twice the Redis CPU per decision.
            let (store, _store_guard) = match store {
                Some(s) => (s, None),
                None => match store::open(&config.store).await {
                    Ok((s, guard)) => (s, Some(guard)),
                    Err(e) => {
                        let _ = ready.send(Err(StartError::Store(e)));
                        return Ok(());
                    }
                },
            };
            // Each worker has its own upstream client (and connection pool): no cross-thread
            // hand-offs on the hot path.
            let state = match AppState::for_worker(&config, store, &process) {
                Ok(s) => s,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return Ok(());
                }
            };
            let bound = listener.local_addr().map_err(StartError::Server);
            let _ = ready.send(bound.map(|addr| (addr, state.clone())));
            let shutdown = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            let charges = state.charges().clone();
            let result = run(listener, state, shutdown).await;
            // Bodies read on after their callers left end within LINGER, and the charges they
            // and every other response caused are tracked: the worker waits until they have
            // landed, within the process's drain deadline (with a second to spare), so that a
            // clean drain never overruns it.
            let left = stop_clock
                .deadline()
                .saturating_duration_since(tokio::time::Instant::now())
                .saturating_sub(Duration::from_secs(1));
            let charge_wait = LINGER + Duration::from_secs(2);
            if tokio::time::timeout(left.min(charge_wait), charges.settled())
                .await
                .is_err()
            {
                tracing::warn!("exiting with charges still in flight");
            }
            // Each was logged at `debug` only, beside the store's one line for its outage.
            let lost = charges.lost();
            if lost > 0 {
                tracing::warn!(
                    lost,
                    "charges lost this run to the store being unavailable: their tokens and spend were not counted"
                );
            }
            result
        });
        let _ = done.send(result);
    }
}

fn listen(addr: SocketAddr, reuse_port: bool) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    #[cfg(unix)]
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    #[cfg(not(unix))]
    let _ = reuse_port;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Each SIGHUP, as a message (none on platforms without it).
pub(crate) fn hangups() -> std::io::Result<tmpsc::UnboundedReceiver<()>> {
    let (tx, rx) = tmpsc::unbounded_channel();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hup = signal(SignalKind::hangup())?;
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                if tx.send(()).is_err() {
                    return;
                }
            }
        });
    }
    #[cfg(not(unix))]
    drop(tx);
    Ok(rx)
}

/// SIGTERM and Ctrl-C, taken over from their default action (ending the process) once built.
pub(crate) struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(windows)]
    ctrl_c: tokio::signal::windows::CtrlC,
}

impl Signals {
    /// Installs the handlers now; needs a runtime with its signal driver (`enable_all`).
    pub(crate) fn new() -> std::io::Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Signals {
                term: signal(SignalKind::terminate())?,
                interrupt: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(windows)]
        {
            Ok(Signals {
                ctrl_c: tokio::signal::windows::ctrl_c()?,
            })
        }
        #[cfg(not(any(unix, windows)))]
        Ok(Signals {})
    }

    /// Resolves on the next SIGTERM or Ctrl-C.
    pub(crate) async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {},
            _ = self.interrupt.recv() => {},
        }
        #[cfg(windows)]
        self.ctrl_c.recv().await;
        #[cfg(not(any(unix, windows)))]
        std::future::pending::<()>().await;
    }
}
