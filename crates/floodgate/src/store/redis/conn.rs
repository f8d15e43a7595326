//! Calls to Redis and what happens when they fail: the connection and its settings (one
//! server's, or a Redis Cluster's), one deadline per call, the classification of errors
//! (replayed, an outage, or an answer), and the circuit breaker with the probe that closes it.
//! The state all this keeps lives in the store's [`Inner`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterClientBuilder};
use ::redis::cluster_async::ClusterConnection;
use ::redis::io::tcp::TcpSettings;
use ::redis::{
    Client, Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture, ServerErrorKind,
    Value,
};

use super::Inner;
use super::config::RedisConfig;
use super::scripts::{Op, Replay, evalsha};
use super::stats::bump;
use crate::Error;

/// How connections are made: to one server, or to a cluster from its seed nodes.
#[derive(Clone)]
pub(super) enum Maker {
    Single(Client, ConnectionManagerConfig),
    Cluster(ClusterClient),
}

/// The connection calls go through. Cheap to clone: clones share it.
#[derive(Clone)]
pub(super) enum Connection {
    /// One server's multiplexed, reconnecting connection.
    Single(ConnectionManager),
    /// A cluster's connection (slots discovered and refreshed by the redis crate), or none yet:
    /// no seed answered. Calls then fail as unreachable and the breaker's probe connects.
    Cluster(Option<ClusterConnection>),
}

/// What a call on a cluster that has no connection yet gets: an unreachable server.
fn not_connected() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "no Redis Cluster node answered yet",
    ))
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(Some(c)) => Box::pin(cluster_command(c, cmd)),
            Connection::Cluster(None) => Box::pin(async { Err(not_connected()) }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(Some(c)) => c.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(None) => Box::pin(async { Err(not_connected()) }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(_) => 0,
        }
    }
}

/// How many redirections and waits one command follows on a cluster before its error is
/// returned (within the call's deadline in any case: 30 waits are 150 ms).
const MAX_REDIRECTS: u32 = 30;
/// How long a command waits before it is sent again after `TRYAGAIN` (a multi-key script in a
/// slot being migrated) or before a node's connection exists.
const REDIRECT_WAIT: Duration = Duration::from_millis(5);

/// `cmd` on a cluster, following `MOVED` and `ASK` and waiting out `TRYAGAIN`. The cluster
/// client is built without retries of its own ([`client`]): a retry after a dropped connection
/// would replay what may already have run, which a charge must never be (docs/redis.md). Every
/// error followed here is one the node answered without running the command, so sending it
/// again runs it at most once; a dropped connection is returned to [`Inner::run`], which replays
/// by the operation's own policy, as on one server.
async fn cluster_command(conn: &mut ClusterConnection, cmd: &Cmd) -> Result<Value, RedisError> {
    use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
    let mut answer = conn.req_packed_command(cmd).await;
    let mut moved = 0;
    for _ in 0..MAX_REDIRECTS {
        let err = match answer {
            Ok(value) => return Ok(value),
            Err(e) => e,
        };
        let to = |node: &str| {
            let (host, port) = node.rsplit_once(':')?;
            Some(SingleNodeRoutingInfo::ByAddress {
                host: host.to_owned(),
                port: port.parse().ok()?,
            })
        };
        answer = match err.kind() {
            // The slot has moved (a reshard, a failover): the first time, straight to the node
            // named; after that (a node the connection does not know yet sends it back), by
            // slot again once the slot map the MOVED set refreshing has caught up.
            ErrorKind::Server(ServerErrorKind::Moved) if moved == 0 => {
                moved += 1;
                let Some(route) = err.redirect_node().and_then(|(node, _)| to(node)) else {
                    return Err(err);
                };
                conn.route_command(cmd.clone(), RoutingInfo::SingleNode(route))
                    .await
            }
            ErrorKind::Server(ServerErrorKind::Ask) => {
                let Some(route) = err.redirect_node().and_then(|(node, _)| to(node)) else {
                    return Err(err);
                };
                // ASKING and the command on one connection, one after the other.
                let mut asking = ::redis::pipe();
                asking.cmd("ASKING").ignore().add_command(cmd.clone());
                conn.route_pipeline(asking, 1, 1, route)
                    .await
                    .and_then(|mut values| values.pop().ok_or_else(err_reply))
            }
            ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::TryAgain)
            | ErrorKind::ClusterConnectionNotFound => {
                tokio::time::sleep(REDIRECT_WAIT).await;
                conn.req_packed_command(cmd).await
            }
            _ => return Err(err),
        };
    }
    answer
}

fn err_reply() -> RedisError {
    RedisError::from((ErrorKind::Client, "no reply to a redirected command"))
}

/// How connections to `config`'s server or cluster are made (see
/// [`RedisStore::connect`](super::RedisStore::connect)): fails only on a configuration that can
/// never work.
pub(super) fn client(config: &RedisConfig) -> Result<Maker, Error> {
    #[cfg(feature = "tls")]
    if config.url.starts_with("rediss://")
        || config.cluster.iter().any(|u| u.starts_with("rediss://"))
    {
        install_crypto_provider();
    }
    // TCP_NODELAY (the redis crate leaves Nagle on): a call written while another is in
    // flight (a token record beside an admission batch) must not wait for the first's ACK.
    let tcp = TcpSettings::default().set_nodelay(true);
    if !config.cluster.is_empty() {
        let seeds = config.cluster_infos()?;
        let client = ClusterClientBuilder::new(seeds)
            .tcp_settings(tcp)
            .connection_timeout(config.connect_timeout)
            // A node that goes silent answers with a timeout (and is reconnected) rather than
            // holding the calls routed to it for TCP's minutes; every call has its own,
            // shorter, deadline besides (see `Inner::run`).
            .response_timeout(config.connect_timeout.max(config.timeout))
            // No retries inside the client: `cluster_command` follows redirections, and a call
            // is replayed only by its operation's policy.
            .retries(0)
            .build()
            .map_err(|e| config.invalid(e))?;
        return Ok(Maker::Cluster(client));
    }
    let info = config.connection_info()?.set_tcp_settings(tcp);
    let client = Client::open(info).map_err(|e| config.invalid(e))?;
    let manager = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        // No per-request timer inside the connection: every call already runs under one
        // deadline of its own (see `Inner::run`), which also covers connecting.
        .set_response_timeout(None)
        // Reconnection is driven by calls and by the breaker's probe, not by a long
        // backoff inside the connection manager that requests would queue behind.
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(20))
        .set_max_delay(Duration::from_millis(200));
    Ok(Maker::Single(client, manager))
}

impl Maker {
    /// A new connection. One server's connects lazily (it cannot fail here but on a config
    /// that never works); a cluster's is made by the probe ([`Inner::connect_cluster`]).
    pub(super) fn lazy(&self) -> Result<Connection, Error> {
        match self {
            Maker::Single(client, manager) => {
                ConnectionManager::new_lazy_with_config(client.clone(), manager.clone())
                    .map(Connection::Single)
                    .map_err(|e| Error::Backend(format!("Redis client: {e}")))
            }
            Maker::Cluster(_) => Ok(Connection::Cluster(None)),
        }
    }
}

#[cfg(feature = "tls")]
fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Fails only if the process already chose a provider, which then serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Why a call failed.
pub(super) enum Failure {
    /// Redis could not be reached in time: the failure policy applies.
    Unavailable(String),
    /// Redis answered with an error: a bug or a misconfiguration, not an outage.
    Backend(String),
}

impl Failure {
    /// The same failure, for another request of the same batch.
    pub(super) fn again(&self) -> Failure {
        match self {
            Failure::Unavailable(why) => Failure::Unavailable(why.clone()),
            Failure::Backend(why) => Failure::Backend(why.clone()),
        }
    }
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Error {
        match f {
            Failure::Unavailable(why) => Error::Unavailable(why),
            Failure::Backend(why) => Error::Backend(why),
        }
    }
}

/// Reads a script's reply as an integer.
pub(super) fn int(v: &::redis::Value) -> Result<u64, Failure> {
    match v {
        ::redis::Value::Int(i) => u64::try_from(*i).map_err(|_| bad_reply()),
        _ => Err(bad_reply()),
    }
}

/// A script's reply that is not what the script returns.
pub(super) fn bad_reply() -> Failure {
    Failure::Backend("unexpected script reply".into())
}

/// How a Redis error counts.
enum Class {
    /// The connection was lost under the call: a replayable operation may run again.
    Dropped,
    /// Redis is unreachable, too slow, or not serving (loading, failing over).
    Unavailable,
    /// The server no longer takes writes: a replica (`READONLY`), or one whose primary is gone
    /// (`MASTERDOWN`). Behind a name or a proxy that a failover moved to the new primary, the
    /// connection still goes to the old one, which answers PING; only a new connection
    /// (resolving the name anew) finds the new primary.
    Demoted,
    /// The server refused the connection's handshake (the URL's password no longer accepted, its
    /// database refused): Redis is unavailable as configured. The connection manager keeps the
    /// refusal (it reconnects after an I/O error only) and answers every later call with it, so
    /// only a new connection asks the server again.
    Refused,
    /// Redis answered with an error.
    Answered,
}

fn classify(e: &RedisError) -> Class {
    // redis-rs classifies its own errors; never match on message text.
    if e.is_timeout() {
        // The server may be slow rather than gone: another attempt would double the wait.
        Class::Unavailable
    } else if e.is_connection_dropped() || e.is_connection_refusal() || e.is_io_error() {
        Class::Dropped
    } else if matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::MasterDown | ServerErrorKind::ReadOnly)
    ) {
        Class::Demoted
    } else if e.code() == Some("BUSY") {
        // Another client's script has run past `busy-reply-threshold`: nothing else runs until
        // it ends or is killed. Not an answer to this call, which did not run.
        Class::Unavailable
    } else if matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                // A cluster mid-change that `cluster_command` could not follow in time (the
                // slot map not yet refreshed after a failover): not run, and not an answer.
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ) | ErrorKind::ClusterConnectionNotFound
    ) {
        Class::Unavailable
    } else if refused(e) {
        Class::Refused
    } else {
        Class::Answered
    }
}

/// Whether `e` is the server refusing the connection's handshake rather than answering a
/// command: the `AUTH` (or RESP3's `HELLO ... AUTH`) or `SELECT` that redis-rs sends before the
/// connection's first command.
fn refused(e: &RedisError) -> bool {
    match e.kind() {
        ErrorKind::AuthenticationFailed => true,
        // The one server error redis-rs builds itself rather than passing on what the server
        // sent: its verdict on a handshake reply (`SELECT` refused). A command's error answer
        // always carries the server's own error.
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            e.clone().into_server_errors().is_none()
        }
        // The server's word that this connection is not (or no longer) authenticated, as RESP3's
        // `HELLO` refusing the password comes back.
        _ => matches!(e.code(), Some("WRONGPASS" | "NOAUTH")),
    }
}

impl Inner {
    /// The connection calls go through now, and its generation.
    fn connection(&self) -> (u64, Connection) {
        self.conn
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the connection after a call or a probe timed out on it. The connection manager
    /// reconnects only on an error, and a connection whose path went silent (a failed-over
    /// primary's old address, a NAT or firewall that dropped its entry: no reset, no reply)
    /// yields none until TCP gives up on it, many minutes later; every probe on it would time
    /// out meanwhile and the breaker would stay open with Redis healthy. So too after a refused
    /// handshake ([`Class::Refused`]), a server that no longer takes writes ([`Class::Demoted`])
    /// and any failed probe: a connection that cannot recover by itself (docs/redis.md,
    /// "Connections, replay and failures"). Calls still in flight on the old connection end with
    /// their own deadlines. Only the connection of generation `stale` is replaced: the other
    /// calls that failed on it with the first find it replaced already.
    pub(super) fn fresh_connection(&self, stale: u64) {
        let mut current = self
            .conn
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.0 != stale {
            return;
        }
        match self.maker.lazy() {
            Ok(conn) => *current = (stale + 1, conn),
            // Not reached with a client that made the first connection; the old one stays.
            Err(e) => tracing::debug!(error = %e, "floodgate: cannot make a new Redis connection"),
        }
    }

    /// On a cluster without a connection, makes one from the seeds (each tried in turn, within
    /// the connect timeout); it then discovers the rest of the cluster. Nothing on one server,
    /// or once connected.
    pub(super) async fn connect_cluster(&self) -> Result<(), String> {
        let Maker::Cluster(client) = &self.maker else {
            return Ok(());
        };
        if !matches!(self.connection().1, Connection::Cluster(None)) {
            return Ok(());
        }
        let made = tokio::time::timeout(self.config.connect_timeout, client.get_async_connection())
            .await
            .map_err(|_| "connecting to the Redis Cluster timed out".to_owned())?
            .map_err(|e| e.to_string())?;
        let mut current = self
            .conn
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if matches!(current.1, Connection::Cluster(None)) {
            current.1 = Connection::Cluster(Some(made));
        }
        Ok(())
    }

    pub(super) async fn ping(&self) -> Result<(), String> {
        self.connect_cluster().await?;
        ping(&mut self.connection().1).await
    }

    /// Opens the breaker and starts the probe; the first failure of an outage logs it.
    pub(super) fn trip(self: &Arc<Self>, why: &str) {
        if self.open.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.unconfirmed.swap(false, Ordering::AcqRel) {
            // A probe's PING answered, but no call has since: the outage goes on.
            tracing::debug!(error = why, "floodgate: Redis answers PING but not calls");
        } else {
            bump(&self.counters.outages);
            *self.since() = Some(Instant::now());
            tracing::warn!(
                error = why,
                on_error = ?self.config.on_error,
                "floodgate: Redis unreachable; deciding without it until it answers again"
            );
        }
        // The probe's hold is taken before its task is spawned: a task dropped before it first
        // runs closes the breaker too ([`Unprobed`]).
        tokio::spawn(probe(Unprobed(Arc::downgrade(self))));
    }

    /// Closes the breaker after a probe: calls go to Redis again; the first that succeeds logs
    /// the end of the outage, and a failure before that continues it (see `trip`).
    fn reopen(&self) {
        self.unconfirmed.store(true, Ordering::Release);
        self.open.store(false, Ordering::Release);
    }

    /// A call succeeded: the first after a probe ends the outage.
    fn confirm(&self) {
        if self.unconfirmed.load(Ordering::Relaxed)
            && self.unconfirmed.swap(false, Ordering::AcqRel)
        {
            let outage = self.since().take().map(|t| t.elapsed());
            tracing::info!(?outage, "floodgate: Redis answers again; enforcing limits");
        }
    }

    fn since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.outage_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `op` (the command `cmd`) once, or twice if its connection dropped and its policy
    /// allows a replay.
    pub(super) async fn run<T: FromRedisValue>(
        self: &Arc<Self>,
        op: &'static Op,
        cmd: &Cmd,
    ) -> Result<T, Failure> {
        self.attempt(op, cmd).await.map_err(|(failure, _)| failure)
    }

    /// [`run`](Self::run), its failure told apart: `true` beside it if the connection dropped
    /// under a call that is never replayed, which may or may not have run (the caller may send
    /// again what in it may run twice).
    pub(super) async fn attempt<T: FromRedisValue>(
        self: &Arc<Self>,
        op: &'static Op,
        cmd: &Cmd,
    ) -> Result<T, (Failure, bool)> {
        if self.open.load(Ordering::Acquire) {
            // The breaker answers at once; the probe task closes it when Redis is back.
            return Err((Failure::Unavailable("circuit breaker open".into()), false));
        }
        // One deadline for the whole call, replay included.
        // (A timeout past any instant, `Duration::MAX` meant as none, stops a year on.)
        let now = tokio::time::Instant::now();
        let deadline = now
            .checked_add(self.config.timeout)
            .unwrap_or_else(|| now + std::time::Duration::from_secs(365 * 86_400));
        let mut replays = match op.replay {
            Replay::Once => 1,
            Replay::Never => 0,
        };
        loop {
            let (generation, mut conn) = self.connection();
            let attempt = tokio::time::timeout_at(deadline, evalsha(op, cmd, &mut conn));
            let err = match attempt.await {
                Ok(Ok(value)) => {
                    self.confirm();
                    return Ok(value);
                }
                Ok(Err(e)) => e,
                Err(_) => {
                    let why = format!("{} timed out after {:?}", op.name, self.config.timeout);
                    self.fresh_connection(generation);
                    self.trip(&why);
                    return Err((Failure::Unavailable(why), false));
                }
            };
            match classify(&err) {
                Class::Dropped if replays > 0 => {
                    // The connection manager is already reconnecting; the replay waits for
                    // the new connection (within the same deadline).
                    replays -= 1;
                    bump(&self.counters.replays);
                }
                Class::Dropped if op.replay == Replay::Never => {
                    // A call that may not run twice fails. Whether Redis is gone or only the
                    // connection was cut (a CLIENT KILL, an idle timeout), a PING on the
                    // reconnected connection says, within the same deadline: only an outage
                    // opens the breaker, which would let admissions through unchecked.
                    let why = format!("{}: {err}", op.name);
                    let answers = tokio::time::timeout_at(deadline, self.ping()).await;
                    if matches!(answers, Ok(Ok(()))) {
                        tracing::debug!(
                            error = why,
                            "floodgate: a call that is never replayed was lost with its connection"
                        );
                    } else {
                        self.trip(&why);
                    }
                    return Err((Failure::Unavailable(why), true));
                }
                Class::Dropped | Class::Unavailable => {
                    let why = format!("{}: {err}", op.name);
                    self.trip(&why);
                    return Err((Failure::Unavailable(why), false));
                }
                Class::Demoted => {
                    // On one server, the probe asks over a new connection. A cluster's client
                    // refreshes its slot map after a READONLY itself.
                    let why = format!("{}: {err}", op.name);
                    if matches!(self.maker, Maker::Single(..)) {
                        self.fresh_connection(generation);
                    }
                    self.trip(&why);
                    return Err((Failure::Unavailable(why), false));
                }
                Class::Refused => {
                    // The probe asks over a new connection, whose handshake is tried again.
                    let why = format!("{}: {err}", op.name);
                    self.fresh_connection(generation);
                    self.trip(&why);
                    return Err((Failure::Unavailable(why), false));
                }
                Class::Answered => {
                    return Err((Failure::Backend(format!("{}: {err}", op.name)), false));
                }
            }
        }
    }
}

/// `PING` on `conn` (on a cluster, on every node).
async fn ping(conn: &mut Connection) -> Result<(), String> {
    ::redis::cmd("PING")
        .query_async::<()>(conn)
        .await
        .map_err(|e| e.to_string())
}

/// A probe's hold on the breaker it was started for. A probe dropped before Redis answered (its
/// runtime shut down, with a store shared across runtimes, even before the probe first ran)
/// would leave the breaker open for good: dropping this closes it instead, so the next call
/// tries Redis and, if Redis is still down, trips it again with a new probe.
struct Unprobed(Weak<Inner>);

impl Drop for Unprobed {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.reopen();
        }
    }
}

/// Probes Redis until it answers, then closes the breaker. Ends early if the store is dropped.
async fn probe(close: Unprobed) {
    let inner = close.0.clone();
    loop {
        let Some(interval) = inner.upgrade().map(|i| i.config.probe_interval) else {
            return;
        };
        tokio::time::sleep(interval).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        // The connection pinged is the one replaced if the ping times out (a cluster without
        // one connects first).
        let generation = inner.connection().0;
        let answered = tokio::time::timeout(inner.config.connect_timeout, inner.ping()).await;
        match answered {
            Ok(Ok(())) => {
                inner.reopen();
                tracing::debug!("floodgate: Redis answers PING; trying calls again");
                return;
            }
            // The next probe goes over a new connection (see `fresh_connection`).
            Err(_) => inner.fresh_connection(generation),
            // So it does after any other failure. On one server, the connection manager keeps
            // a refused handshake (`Class::Refused`) and answers every PING with it: only a new
            // connection asks again. On a cluster, from the seeds again: a node that died (a
            // primary failed over) may be all the old connection knows for its slots, and only
            // a new one asks the cluster who serves them now.
            Ok(Err(_)) => inner.fresh_connection(generation),
        }
    }
}
