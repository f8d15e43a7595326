//! The accept loop: [`run`] serves the pipeline's [`route`] on a listener over HTTP/1.1 until
//! shutdown, then drains.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::http::{AppState, route};
use crate::send_timed::SendTimed;

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
    let _heartbeat = Heartbeat::start(state.header_timeout());
    let send_timeout = state.header_timeout();
    let connections = state.connections();
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
        // At `[server] max_connections` open connections (across the process's workers) the
        // connection just accepted waits for one to close, and the loop with it: later callers
        // wait in the listen backlog, as with nginx's worker_connections. Accepted first, then
        // counted: a worker that took a slot and then waited in `accept` on its own socket
        // (empty, while the kernel gave new connections to another worker's) would hold a slot
        // no connection used, and callers of the other worker would wait with slots free.
        let slot = tokio::select! {
            slot = Arc::clone(connections).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
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
        // A caller must take its answer: a write that waits `header_timeout` closes it.
        let io = SendTimed::new(tcp, send_timeout);
        let conn = http.serve_connection(TokioIo::new(io), service);
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
            drop(slot);
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

/// A timer that is always due before any request head's deadline, so that the runtime's time
/// driver never sleeps without a deadline while requests come and go.
///
/// hyper arms a new header timer for every request head and drops it when the head is read. When
/// a runtime thread parks on the time driver with no timer due (every connection busy at that
/// instant), the next timer armed must wake it to recompute its deadline: a write to the
/// runtime's eventfd, a system call for about every third request under load (counted with
/// `perf stat -e syscalls:sys_enter_write`: 0.31 per request without this timer, none with it).
/// Ticking at half the header timeout keeps one timer always earlier than any head's deadline;
/// it costs one wake-up per half timeout. docs/benchmarks.md has what it bought.
struct Heartbeat(tokio::task::JoinHandle<()>);

impl Heartbeat {
    fn start(header_timeout: Duration) -> Heartbeat {
        let period = (header_timeout / 2).max(Duration::from_millis(1));
        Heartbeat(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(period);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
            }
        }))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
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
