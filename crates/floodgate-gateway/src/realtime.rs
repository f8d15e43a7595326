//! Realtime API sessions: `GET /v1/realtime` upgraded to a WebSocket and spliced to one opened
//! with the upstream.
//!
//! An upgrade is taken in this order, and only the last step charges anything:
//!
//! 1. authenticated like any request (`Authorization: Bearer`, or the subprotocol entry
//!    `openai-insecure-api-key.<secret>` that browsers send, see
//!    [`Keys::authenticate_websocket`](crate::auth::Keys::authenticate_websocket)), and checked
//!    to be a well-formed WebSocket handshake over HTTP/1.1 whose query names `model` at most
//!    once, by that very name (400 otherwise);
//! 2. the process-local `[realtime] max_connections` cap (429 `too_many_connections`);
//! 3. the chain's budgets, if any, read as for any request (429 `insufficient_quota`);
//! 4. the same admission as any request: one request on the key's chain (429 with the
//!    rate-limit headers when refused);
//! 5. forwarded on an upstream connection of its own (with the demo upstream, an in-process
//!    pipe to [`crate::demo::serve_realtime`]). The upstream's 101 is answered with a 101
//!    that carries its handshake headers and the rate-limit headers; any other answer is passed
//!    through like a proxied response.
//!
//! Then bytes are copied both ways unchanged, as they arrive, until the upstream closes its
//! connection (a WebSocket server does so after the closing handshake; the caller's connection
//! is then closed too), or the caller closes its own and the upstream follows (within 10 s), or
//! either side fails. When the caller's side fails, the upstream is told as by a half-close and
//! read on (its bytes dropped) until it closes, within 10 s, so that a turn under way is
//! metered.
//!
//! **Metering.** For a chain with token limits or budgets the frames from the upstream are read
//! as they pass ([`FrameReader`]): each text message whose JSON `type` is `response.done` adds
//! its `response.usage` to the session's meter, which charges the chain's token limits (and
//! spends against its budgets) every `[realtime] flush_sec` and once more when the session ends.
//! Spend is priced by the model the upstream says it runs, `session.model` in its latest
//! `session.created` or `session.updated` event, and before the first by the URL's `?model=`.
//! Only messages whose first bytes may be those events are held. The upgrade request is
//! forwarded without `Sec-WebSocket-Extensions`, so that no frame arrives compressed. Metering
//! reads a copy of each piece as it is read, before it is forwarded: it never delays, changes or
//! closes a session, and a full token window only refuses later requests and upgrades.
//!
//! **Shutdown.** A draining worker lets its live sessions go on for `[realtime] drain_sec`, then
//! closes them: a close frame with status 1001 (going away) to each side where it fits between
//! frames, both connections closed, their tokens charged.

use std::borrow::Cow;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::http::header::{
    CONNECTION, SEC_WEBSOCKET_EXTENSIONS, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL,
    SEC_WEBSOCKET_VERSION, UPGRADE,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, Version};
use axum::response::{IntoResponse, Response};
use floodgate::{Budgets, Chain, Error as StoreError};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use crate::app::{AppState, CallerGone, Early, count_refusal, latency_ms, log_local, refuse};
use crate::auth::{KeyEntry, PROTOCOL_KEY_PREFIX, ResolvedChain};
use crate::budgets::{Prices, spend_later, spend_now};
use crate::config::RealtimeConfig;
use crate::error::AppError;
use crate::headers;
use crate::metering;
use crate::store::GatewayStore;

/// The path of the Realtime API's WebSocket.
pub const PATH: &str = "/v1/realtime";

/// Largest text message held to read its `type` and usage. A larger one (a `response.done`
/// carrying a very long output) passes unmetered, with a warning. Audio travels in messages of
/// a few tens of KiB; a turn's whole text output rarely approaches this. Messages that are not
/// metered events are never held, whatever their length.
pub const MAX_METERED_MESSAGE: usize = 1024 * 1024;

/// The buffer each direction of a session copies through.
const COPY_BUFFER: usize = 16 * 1024;

/// Once the caller has closed its connection, how long the upstream may take to close its own
/// (it is told by a half-close, and may still have frames to send) before the session is ended.
const HALF_CLOSED_LINGER: Duration = Duration::from_secs(10);

/// The `Retry-After` of a refusal for too many live sessions: sessions last minutes, and when
/// one ends is unknown; a short wait spreads the retries of a crowd of callers.
pub const FULL_RETRY_AFTER: Duration = Duration::from_secs(5);

/// The live realtime sessions of one gateway process, counted against `[realtime]
/// max_connections`; every worker of the process shares one (a cheap clone).
#[derive(Clone, Debug, Default)]
pub struct LiveSessions(Arc<AtomicUsize>);

impl LiveSessions {
    /// A count of zero, for one process.
    pub fn new() -> LiveSessions {
        LiveSessions::default()
    }

    /// Sessions live now, handshakes in progress included.
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// A slot, if fewer than `max` are taken: checked and taken in one step, so that
    /// concurrent upgrades on several workers never overshoot the cap.
    fn take(&self, max: usize) -> Option<Slot> {
        self.0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(Arc::clone(&self.0)))
    }
}

/// One taken slot of [`LiveSessions`], given back when dropped (the session ended, its handshake
/// failed, or its caller left).
#[derive(Debug)]
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The realtime sessions of one worker (one [`AppState`]): the process's count, the settings,
/// and the signal that closes them at the end of a drain.
#[derive(Debug)]
pub(crate) struct Sessions {
    live: LiveSessions,
    max: usize,
    flush: Duration,
    drain: Duration,
    /// `true` once the worker closes its sessions. Each session holds a receiver until it has
    /// ended and charged its tokens: no receiver left means no session left.
    close: watch::Sender<bool>,
}

impl Sessions {
    pub(crate) fn new(config: &RealtimeConfig, live: LiveSessions) -> Sessions {
        Sessions {
            live,
            max: config.max_connections,
            flush: config.flush,
            drain: config.drain,
            close: watch::Sender::new(false),
        }
    }

    /// The process's live sessions.
    pub(crate) fn live(&self) -> &LiveSessions {
        &self.live
    }

    /// `[realtime] drain_sec`.
    pub(crate) fn drain_time(&self) -> Duration {
        self.drain
    }

    /// Closes every live session of this worker, and any that starts from now on.
    pub(crate) fn close_all(&self) {
        self.close.send_replace(true);
    }

    /// Waits for this worker's sessions to end until `close_at`, then closes those still live
    /// and waits for them to have charged their tokens.
    pub(crate) async fn finish(&self, close_at: tokio::time::Instant) {
        tokio::select! {
            () = self.close.closed() => return,
            () = tokio::time::sleep_until(close_at) => {}
        }
        let live = self.close.receiver_count();
        if live > 0 {
            tracing::info!(sessions = live, "closing realtime sessions still live");
        }
        self.close_all();
        self.close.closed().await;
    }
}

/// Whether `path` is the Realtime API's (a WebSocket upgrade of any other path is refused).
pub(crate) fn is_realtime(path: &str) -> bool {
    path == PATH
}

/// Why a WebSocket upgrade request cannot be forwarded as one, if it cannot: the upstream would
/// refuse it, the session could never start, or the gateway could price it by another model than
/// the upstream runs; and it would have been charged.
fn malformed<B>(req: &Request<B>) -> Option<&'static str> {
    if req.method() != Method::GET {
        return Some("A WebSocket upgrade is a GET request.");
    }
    // hyper upgrades HTTP/1.1 connections only: an HTTP/1.0 one would be answered 101 and then
    // carry nothing.
    if req.version() != Version::HTTP_11 {
        return Some("A WebSocket upgrade is an HTTP/1.1 request.");
    }
    let headers = req.headers();
    let version = headers
        .get(SEC_WEBSOCKET_VERSION)
        .map(|v| v.as_bytes().trim_ascii());
    if version != Some(b"13".as_slice()) {
        return Some("A WebSocket upgrade needs `Sec-WebSocket-Version: 13`.");
    }
    // 16 random bytes in base64 (RFC 6455, 4.1).
    let key_ok = headers.get(SEC_WEBSOCKET_KEY).is_some_and(|k| {
        let k = k.as_bytes().trim_ascii();
        k.len() == 24
            && k.ends_with(b"==")
            && k[..22]
                .iter()
                .all(|&b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
    });
    if !key_ok {
        return Some("A WebSocket upgrade needs a `Sec-WebSocket-Key` (16 bytes in base64).");
    }
    if ambiguous_model(req.uri()) {
        return Some(
            "The query names `model` more than once, or with a percent-encoded name: \
             name it once, as `model=`.",
        );
    }
    None
}

/// The `name=value` pairs of a query, the name as written (`value` is empty without a `=`).
fn query_pairs(uri: &Uri) -> impl Iterator<Item = (&str, &str)> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
}

/// Whether a realtime URL's query names its model in a way that the gateway and the upstream
/// could read differently: `model` twice (first or last wins?), or a name that decodes to
/// `model` (`mod%65l`: decoded or not?). Until the upstream's session events name the model,
/// the query's prices the session.
fn ambiguous_model(uri: &Uri) -> bool {
    let mut named = 0;
    for (name, _) in query_pairs(uri) {
        if name == "model" {
            named += 1;
        } else if *metering::percent_decoded(name.as_bytes()) == *b"model" {
            return true;
        }
    }
    named > 1
}

/// The `model` a realtime URL names in its query, percent-decoded (the first, for a query that
/// [`malformed`] has not refused).
pub(crate) fn query_model(uri: &Uri) -> Option<String> {
    let value = query_pairs(uri).find_map(|(name, value)| (name == "model").then_some(value))?;
    String::from_utf8(metering::percent_decoded(value.as_bytes()).into_owned())
        .ok()
        .filter(|m| !m.is_empty())
}

/// Prepares the caller's handshake headers for the upstream: the subprotocol entries that carry
/// a gateway key are removed (the upstream gets its own key as a bearer token), and for a
/// metered session so is `Sec-WebSocket-Extensions`, so that frames come uncompressed.
fn forwardable(headers: &mut HeaderMap, metered: bool) {
    if metered {
        headers.remove(SEC_WEBSOCKET_EXTENSIONS);
    }
    if !headers.contains_key(SEC_WEBSOCKET_PROTOCOL) {
        return;
    }
    let kept: Vec<String> = headers
        .get_all(SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with(PROTOCOL_KEY_PREFIX))
        .map(str::to_owned)
        .collect();
    headers.remove(SEC_WEBSOCKET_PROTOCOL);
    if kept.is_empty() {
        return;
    }
    if let Ok(v) = HeaderValue::from_str(&kept.join(", ")) {
        headers.insert(SEC_WEBSOCKET_PROTOCOL, v);
    }
}

/// Answers a WebSocket upgrade of `/v1/realtime` by `key` (authenticated): see the module docs.
pub(crate) async fn open(
    state: AppState,
    key: Arc<KeyEntry>,
    mut req: Request,
    start: Instant,
) -> Response {
    let ResolvedChain {
        chain,
        headers: fixed,
        budgets,
    } = state.keys().chain_for_request(&key, req.headers());
    let early = Early {
        state: &state,
        key: &key,
        chain: &chain,
        fixed: &fixed,
        start,
    };
    if let Some(why) = malformed(&req) {
        let err = AppError::BadRequest(why.into());
        let (method, path) = (req.method(), req.uri().path());
        return early.refuse(method, path, err, "bad_request").await;
    }
    let sessions = state.sessions();
    // The cap first: a refusal for a full process charges nothing.
    let Some(slot) = sessions.live().take(sessions.max) else {
        // The process's own cap refused: a refusal of the gateway in the tally.
        count_refusal(&state, &key, floodgate::ScopeKind::Gateway);
        let err = AppError::TooManyConnections {
            max: sessions.max,
            retry_after: FULL_RETRY_AFTER,
        };
        log_local(
            Some(&key.id),
            &req,
            start,
            err.status(),
            "too_many_connections",
        );
        return err.into_response();
    };
    let store_error = |req: &Request, e: StoreError| {
        let err = match e {
            StoreError::Unavailable(why) => AppError::StoreUnavailable(why),
            other => AppError::Internal(other.to_string()),
        };
        log_local(Some(&key.id), req, start, err.status(), "store_error");
        err.into_response()
    };
    // Then the budgets, as for any request: read, charging nothing.
    if let Some(budgets) = &budgets {
        match budgets.check(state.store()).await {
            Ok(d) if d.allowed() => {}
            Ok(d) => {
                let at = (req.method(), req.uri().path());
                return early.refuse_budget(at, budgets, &d).await;
            }
            Err(e) => return store_error(&req, e),
        }
    }
    let decision = match chain.admit(state.store(), 1).await {
        Ok(d) => d,
        Err(e) => return store_error(&req, e),
    };
    if !decision.admitted {
        return refuse(&state, &key, req, start, &decision, &fixed);
    }
    let decision_name = if decision.enforced {
        "admitted"
    } else {
        "unenforced"
    };
    // The session's spend: priced by the model the upstream's session events name, and until
    // one does, by the model its URL names (`?model=`, unambiguous: see `malformed`).
    let spend = budgets.map(|budgets| SessionSpend {
        budgets,
        prices: Arc::clone(state.prices()),
        model: query_model(req.uri()),
    });
    let metered = chain.has_reactive() || spend.is_some();

    let caller_upgrade = hyper::upgrade::on(&mut req);
    // A GET upgrade has no body to forward.
    let (mut parts, _) = req.into_parts();
    forwardable(&mut parts.headers, metered);
    let method = parts.method.clone();
    let uri = parts.uri.clone();
    let gone = CallerGone::new(&key.id, &method, &uri, start, decision_name);
    let sent = state
        .upstream()
        .upgrade(Request::from_parts(parts, Body::empty()))
        .await;
    gone.disarm();
    let log = |status: StatusCode| {
        tracing::info!(
            key = %key.id,
            method = %method,
            path = uri.path(),
            status = status.as_u16(),
            latency_ms = latency_ms(start),
            decision = decision_name,
            "request"
        );
    };
    let mut resp = match sent {
        Ok(r) => r,
        Err(err) => {
            log(err.status());
            let mut resp = err.into_response();
            headers::apply(resp.headers_mut(), &decision, &fixed);
            return resp;
        }
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        // The upstream declined (a 401 for its key, a 400 for an unknown model): its answer,
        // like any proxied response's; the request was admitted and stays charged.
        log(resp.status());
        let (mut head, body) = resp.into_parts();
        headers::apply(&mut head.headers, &decision, &fixed);
        return Response::from_parts(head, Body::new(body));
    }
    let upstream_upgrade = hyper::upgrade::on(&mut resp);
    let (mut head, _) = resp.into_parts();
    head.headers
        .insert(CONNECTION, HeaderValue::from_static("upgrade"));
    head.headers
        .insert(UPGRADE, HeaderValue::from_static("websocket"));
    headers::apply(&mut head.headers, &decision, &fixed);
    log(StatusCode::SWITCHING_PROTOCOLS);
    let session = Session {
        key: Arc::clone(&key.id),
        store: state.store().clone(),
        chain: chain.has_reactive().then_some(chain),
        spend,
        flush: sessions.flush,
        close: sessions.close.subscribe(),
        _slot: slot,
    };
    tokio::spawn(session.run(caller_upgrade, upstream_upgrade));
    Response::from_parts(head, Body::empty())
}

/// One live session: what it needs once both connections are upgraded.
struct Session {
    key: Arc<str>,
    store: GatewayStore,
    /// The chain to charge tokens to; `None`: the chain has no token limit.
    chain: Option<Arc<Chain>>,
    /// What the session spends against; `None`: the chain has no budget.
    spend: Option<SessionSpend>,
    flush: Duration,
    close: watch::Receiver<bool>,
    /// Held until the session has ended.
    _slot: Slot,
}

/// A session's budgets, the price table and the model its URL names.
struct SessionSpend {
    budgets: Arc<Budgets>,
    prices: Arc<Prices>,
    /// Prices the session's turns until the upstream's session events name its model.
    model: Option<String>,
}

/// Why a session ended.
#[derive(Debug)]
enum End {
    /// The upstream closed its connection.
    UpstreamClosed,
    /// The caller closed its connection, and the upstream followed.
    CallerClosed,
    /// The caller closed its connection, the upstream did not follow within
    /// [`HALF_CLOSED_LINGER`].
    HalfClosed,
    /// Reading or writing one side failed (a reset).
    Failed(std::io::Error),
    /// The worker closed it at the end of its drain.
    Shutdown,
}

impl End {
    fn as_str(&self) -> &'static str {
        match self {
            End::UpstreamClosed => "upstream_closed",
            End::CallerClosed => "caller_closed",
            End::HalfClosed => "half_closed",
            End::Failed(_) => "connection_error",
            End::Shutdown => "shutdown",
        }
    }
}

impl Session {
    async fn run(mut self, caller: OnUpgrade, upstream: OnUpgrade) {
        let start = Instant::now();
        let (caller, upstream) = match tokio::try_join!(caller, upstream) {
            Ok(both) => both,
            Err(e) => {
                tracing::warn!(key = %self.key, error = %e, "realtime session could not start");
                return;
            }
        };
        let (mut caller_in, mut caller_out) = tokio::io::split(TokioIo::new(caller));
        let (mut upstream_in, mut upstream_out) = tokio::io::split(TokioIo::new(upstream));
        let pending = AtomicU64::new(0);
        let pending_spend = AtomicU64::new(0);
        // The caller's frames are only followed, never held; the upstream's are read for
        // their tokens when metered.
        let mut to_upstream = Direction::new(None);
        let metered = self.chain.is_some() || self.spend.is_some();
        let mut to_caller = Direction::new(metered.then(|| Meter {
            pending: &pending,
            pending_spend: &pending_spend,
            prices: self.spend.as_ref().map(|s| s.prices.as_ref()),
            model: self.spend.as_ref().and_then(|s| s.model.clone()),
            total: 0,
            key: &self.key,
            warned_unknown: false,
        }));
        let mut caller_done = false;
        // Set when the caller's side failed: the upstream is read until then.
        let mut upstream_until = None;
        let end = {
            let mut up = pin!(pump(&mut caller_in, &mut upstream_out, &mut to_upstream));
            let mut down = pin!(pump(&mut upstream_in, &mut caller_out, &mut to_caller));
            let mut flusher = pin!(flush_every(
                self.flush,
                (&pending, &pending_spend),
                &self.store,
                self.chain.as_ref(),
                self.spend.as_ref().map(|s| &s.budgets),
            ));
            let mut closing = pin!(closing(&mut self.close));
            let mut linger = pin!(tokio::time::sleep(HALF_CLOSED_LINGER));
            loop {
                tokio::select! {
                    r = &mut up, if !caller_done => match r {
                        Ok(()) => {
                            // The upstream has been told (half-close); its time starts now.
                            caller_done = true;
                            linger
                                .as_mut()
                                .reset(tokio::time::Instant::now() + HALF_CLOSED_LINGER);
                        }
                        Err(Failure::Read(e)) => {
                            upstream_until =
                                Some(tokio::time::Instant::now() + HALF_CLOSED_LINGER);
                            break End::Failed(e);
                        }
                        Err(Failure::Write(e)) => break End::Failed(e),
                    },
                    // Everything the upstream sent has gone to the caller, then a half-close.
                    r = &mut down => match r {
                        Ok(()) if caller_done => break End::CallerClosed,
                        Ok(()) => break End::UpstreamClosed,
                        Err(Failure::Write(e)) => {
                            upstream_until = Some(if caller_done {
                                linger.deadline()
                            } else {
                                tokio::time::Instant::now() + HALF_CLOSED_LINGER
                            });
                            break End::Failed(e);
                        }
                        Err(Failure::Read(e)) => break End::Failed(e),
                    },
                    () = &mut flusher => {}
                    () = &mut closing => break End::Shutdown,
                    () = &mut linger, if caller_done => break End::HalfClosed,
                }
            }
        };
        // Only a metered session has a reason to read on: an unmetered one frees its slot now.
        if let Some(until) = upstream_until.filter(|_| metered) {
            // The caller is gone, the upstream may be amid a turn: it is told as by a
            // half-close, and what it still sends (that turn's `response.done`) is metered and
            // dropped, until it closes or its time is up.
            let drain = async {
                if !caller_done {
                    let _ =
                        tokio::time::timeout(Duration::from_secs(1), upstream_out.shutdown()).await;
                }
                let _ = pump(&mut upstream_in, &mut tokio::io::sink(), &mut to_caller).await;
            };
            tokio::select! {
                () = drain => {}
                () = tokio::time::sleep_until(until) => {}
                () = closing(&mut self.close) => {}
            }
        }
        if let End::Shutdown = end {
            // A close frame each way (1001, going away) where it can go between frames: the
            // caller can tell a drain from a failure, and the upstream ends its session.
            going_away(&mut caller_out, &to_caller, false).await;
            going_away(&mut upstream_out, &to_upstream, true).await;
        }
        // Both connections are closed before the last tokens are charged.
        drop((caller_out, upstream_out));
        let tokens = to_caller.meter.as_ref().map(|m| m.total);
        if let Some(chain) = &self.chain {
            metering::record_now(&self.store, chain, pending.swap(0, Ordering::SeqCst)).await;
        }
        if let Some(spend) = &self.spend {
            let micro_usd = pending_spend.swap(0, Ordering::SeqCst);
            spend_now(&self.store, &spend.budgets, micro_usd).await;
        }
        let error = match &end {
            End::Failed(e) => Some(e.to_string()),
            _ => None,
        };
        tracing::info!(
            key = %self.key,
            duration_ms = latency_ms(start),
            tokens,
            end = end.as_str(),
            error,
            "realtime session ended"
        );
    }
}

/// Resolves once the worker closes its sessions (never if the worker is gone without saying so).
async fn closing(close: &mut watch::Receiver<bool>) {
    if close.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Charges the tokens (to `chain`) and the spend (to `budgets`) metered so far every
/// `interval`, in the background (never holding up the session's bytes). Never resolves.
async fn flush_every(
    interval: Duration,
    (pending, pending_spend): (&AtomicU64, &AtomicU64),
    store: &GatewayStore,
    chain: Option<&Arc<Chain>>,
    budgets: Option<&Arc<Budgets>>,
) {
    if chain.is_none() && budgets.is_none() {
        return std::future::pending().await;
    }
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Taken in one step: tokens metered meanwhile wait for the next flush, none twice.
        if let Some(chain) = chain {
            metering::record_later(store, chain, pending.swap(0, Ordering::SeqCst));
        }
        if let Some(budgets) = budgets {
            spend_later(store, budgets, pending_spend.swap(0, Ordering::SeqCst));
        }
    }
}

/// Which side of a copy failed.
#[derive(Debug)]
enum Failure {
    /// Reading the side copied from.
    Read(std::io::Error),
    /// Writing the side copied to.
    Write(std::io::Error),
}

/// Copies `from` to `to` until `from` ends (then `to` is shut down for writing); `dir` reads
/// each piece as it was read, before it is written: tokens read are metered even if `to` fails.
async fn pump<R, W>(from: &mut R, to: &mut W, dir: &mut Direction<'_>) -> Result<(), Failure>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; COPY_BUFFER];
    loop {
        let n = from.read(&mut buf).await.map_err(Failure::Read)?;
        if n == 0 {
            // The other side may still be sending (its close frame): only this direction ends.
            let _ = to.shutdown().await;
            return Ok(());
        }
        dir.passed(&buf[..n]);
        dir.writing = true;
        let sent = async {
            to.write_all(&buf[..n]).await?;
            to.flush().await
        };
        sent.await.map_err(Failure::Write)?;
        dir.writing = false;
    }
}

/// A close frame with status 1001 (going away), as a server sends it.
const GOING_AWAY: [u8; 4] = [0x88, 0x02, 0x03, 0xe9];

/// Sends a close frame with status 1001 (going away) on `to`, if `dir` (what went there) ended
/// between two frames, masked as a client's when `masked`; within 1 s, or not at all.
async fn going_away<W: AsyncWrite + Unpin>(to: &mut W, dir: &Direction<'_>, masked: bool) {
    if !dir.between_frames() {
        return;
    }
    let frame = if masked {
        // A client's frames are masked (RFC 6455, 5.3); the key needs no secrecy here: the
        // payload is the gateway's own.
        let k = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x5a17_c39e, |d| d.subsec_nanos())
            .to_be_bytes();
        vec![
            GOING_AWAY[0],
            0x80 | GOING_AWAY[1],
            k[0],
            k[1],
            k[2],
            k[3],
            GOING_AWAY[2] ^ k[0],
            GOING_AWAY[3] ^ k[1],
        ]
    } else {
        GOING_AWAY.to_vec()
    };
    let send = async {
        to.write_all(&frame).await?;
        to.flush().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), send).await;
}

/// One direction of a session: its frames followed as they pass (so that the gateway knows
/// where a frame of its own may go), and for the upstream's of a metered session, the meter.
struct Direction<'a> {
    frames: FrameReader,
    /// A write under way when the session ended: the peer may have part of a frame.
    writing: bool,
    meter: Option<Meter<'a>>,
}

impl<'a> Direction<'a> {
    fn new(meter: Option<Meter<'a>>) -> Direction<'a> {
        Direction {
            // Text messages are only held to be metered.
            frames: FrameReader {
                skip_text: meter.is_none(),
                ..FrameReader::default()
            },
            writing: false,
            meter,
        }
    }

    /// Whether everything sent so far ends with a whole frame.
    fn between_frames(&self) -> bool {
        !self.writing && self.frames.between_frames()
    }

    /// `data` was read, to go through.
    fn passed(&mut self, data: &[u8]) {
        match &mut self.meter {
            Some(meter) => meter.read(&mut self.frames, data),
            None => self.frames.push(data, |_| {}),
        }
    }
}

/// A session's token meter: the tokens not yet charged, and the spend not yet added.
struct Meter<'a> {
    pending: &'a AtomicU64,
    pending_spend: &'a AtomicU64,
    /// The price table, with budgets.
    prices: Option<&'a Prices>,
    /// The model that prices the next turns: the upstream's `session.model` once a session
    /// event has named it (the upstream's word on what it runs), until then the URL's.
    model: Option<String>,
    /// Every token metered in the session, for its log line.
    total: u64,
    key: &'a str,
    /// Whether a message too large to meter, whose type could not be told, has been warned
    /// about: once a session is enough.
    warned_unknown: bool,
}

impl Meter<'_> {
    /// Reads `data` with `frames`: each session event names the model, each `response.done`
    /// is metered.
    fn read(&mut self, frames: &mut FrameReader, data: &[u8]) {
        let Meter {
            pending,
            pending_spend,
            prices,
            model,
            total,
            key,
            warned_unknown,
        } = self;
        let add = |to: &AtomicU64, n: u64| {
            let _ = to.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |p| {
                Some(p.saturating_add(n))
            });
        };
        frames.push(data, |message| match message {
            Message::Text(text) => {
                if let Some(named) = session_model(text) {
                    *model = Some(named);
                } else if let Some(usage) = metering::response_done_usage(text) {
                    *total = total.saturating_add(usage.total);
                    add(pending, usage.total);
                    if let Some(prices) = prices {
                        add(pending_spend, prices.spend(model.as_deref(), &usage));
                    }
                }
            }
            // A message whose type could not be told may be anything: one warning a session.
            Message::TooLarge { metered }
                if metered || !std::mem::replace(warned_unknown, true) =>
            {
                tracing::warn!(
                    key = %key,
                    max_bytes = MAX_METERED_MESSAGE,
                    "realtime message too large to meter: its tokens, if any, are not charged"
                );
            }
            Message::TooLarge { .. } => {}
            Message::Compressed => tracing::warn!(
                key = %key,
                "compressed realtime message (unasked for): its tokens, if any, are not charged"
            ),
        });
    }
}

/// The model a `session.created` or `session.updated` server event names (`session.model`), if
/// `message` is one and names it.
fn session_model(message: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct SessionEvent<'a> {
        #[serde(rename = "type", borrow)]
        kind: Cow<'a, str>,
        session: Option<SessionFields>,
    }
    #[derive(Deserialize)]
    struct SessionFields {
        model: Option<String>,
    }
    let event: SessionEvent<'_> = serde_json::from_slice(message).ok()?;
    if !matches!(&*event.kind, "session.created" | "session.updated") {
        return None;
    }
    event.session?.model.filter(|m| !m.is_empty())
}

/// What [`FrameReader`] reports.
#[derive(Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// A whole text message (its fragments joined, unmasked).
    Text(&'a [u8]),
    /// A text message that may be metered, longer than [`MAX_METERED_MESSAGE`]: not held, not
    /// reported.
    TooLarge {
        /// `true`: its `type` is one the meter reads; `false`: its type could not be told from
        /// its first bytes.
        metered: bool,
    },
    /// A text message compressed by an extension (`RSV1` set): it cannot be read.
    Compressed,
}

/// Reads the WebSocket frames (RFC 6455, 5) of one direction of a session from the bytes as they
/// come, in pieces of any size, and reports each text message that may be a metered server event
/// (`response.done`, `session.created`, `session.updated`, told by its first bytes; one whose
/// type they cannot tell is reported too). Fragmented messages are joined, control frames
/// between their fragments skipped, 16- and 64-bit lengths read and masked frames unmasked;
/// other text messages, binary messages and control frames are skipped without being held. At
/// most [`MAX_METERED_MESSAGE`] bytes of a message are held.
#[derive(Debug, Default)]
pub struct FrameReader {
    /// Follows frames without holding any message (`false`: text messages are reported).
    pub skip_text: bool,
    /// The frame header read so far (at most 14 bytes).
    head: [u8; 14],
    head_len: usize,
    /// Within a frame's payload: the bytes still to come.
    payload_left: u64,
    in_payload: bool,
    /// Position in the payload (for the mask).
    payload_pos: u64,
    mask: Option<[u8; 4]>,
    fin: bool,
    control: bool,
    state: MessageState,
    /// What the held message's first bytes say of its type.
    kind: Kind,
    text: Vec<u8>,
}

#[derive(Debug, Default, PartialEq, Eq)]
enum MessageState {
    /// Between messages.
    #[default]
    Idle,
    /// A text message being held.
    Collect,
    /// A message not held (binary, too large, compressed, or a stray continuation).
    Skip,
}

/// How many bytes of a text message are read to tell its `type`: room for it after short
/// members such as `event_id`. A message that has not told by then is held whole and parsed.
const TYPE_WITHIN: usize = 256;

/// The server events the meter reads, by their `type`.
const METERED_TYPES: [&[u8]; 3] = [b"response.done", b"session.created", b"session.updated"];

/// What the first bytes of a text message say about its `type`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    /// More bytes are needed.
    #[default]
    Undecided,
    /// A JSON object whose `type` is one the meter reads.
    Metered(&'static [u8]),
    /// Anything else: an object of another type, or not a JSON object at all.
    Other,
    /// Cannot be told from the first bytes (`type` after a nested value, or escaped).
    Unknown,
}

/// What `prefix`, the first bytes of a text message, says of its JSON `type`. Server events come
/// with `type` first (OpenAI's do); members before it with a string, number or literal value,
/// and whitespace anywhere, are passed over.
fn kind_of(prefix: &[u8]) -> Kind {
    let p = prefix;
    let skip_ws = |i: usize| {
        i + p[i..]
            .iter()
            .take_while(|b| b.is_ascii_whitespace())
            .count()
    };
    let mut i = skip_ws(0);
    match p.get(i) {
        None => return Kind::Undecided,
        Some(b'{') => i += 1,
        Some(_) => return Kind::Other,
    }
    loop {
        i = skip_ws(i);
        match p.get(i) {
            None => return Kind::Undecided,
            Some(b'"') => {}
            // `}`: an object without a `type`; anything else is not JSON.
            Some(_) => return Kind::Other,
        }
        let Some((name, escaped, end)) = json_string(p, i) else {
            return Kind::Undecided;
        };
        if escaped {
            return Kind::Unknown;
        }
        i = skip_ws(end);
        match p.get(i) {
            None => return Kind::Undecided,
            Some(b':') => i = skip_ws(i + 1),
            Some(_) => return Kind::Other,
        }
        if name == b"type" {
            if p.get(i).is_some_and(|&b| b != b'"') {
                return Kind::Other;
            }
            return match json_string(p, i) {
                Some((_, true, _)) => Kind::Unknown,
                Some((value, false, _)) => METERED_TYPES
                    .into_iter()
                    .find(|&t| t == value)
                    .map_or(Kind::Other, Kind::Metered),
                // A type cut short: another type if no metered one starts so.
                None => {
                    let partial = p.get(i + 1..).unwrap_or_default();
                    let may_be = partial.contains(&b'\\')
                        || METERED_TYPES.iter().any(|t| t.starts_with(partial));
                    if may_be { Kind::Undecided } else { Kind::Other }
                }
            };
        }
        // Another member: its value passed over, if it is no object or array.
        match p.get(i) {
            None => return Kind::Undecided,
            Some(b'{' | b'[') => return Kind::Unknown,
            Some(b'"') => match json_string(p, i) {
                Some((_, _, end)) => i = end,
                None => return Kind::Undecided,
            },
            Some(_) => {
                i += p[i..]
                    .iter()
                    .take_while(|&&b| b != b',' && b != b'}' && !b.is_ascii_whitespace())
                    .count();
            }
        }
        i = skip_ws(i);
        match p.get(i) {
            None => return Kind::Undecided,
            Some(b',') => i += 1,
            Some(_) => return Kind::Other,
        }
    }
}

/// The JSON string that starts (with its quote) at `at` of `p`: its raw contents, whether they
/// hold an escape, and where it ends; `None` if `p` ends first.
fn json_string(p: &[u8], at: usize) -> Option<(&[u8], bool, usize)> {
    let mut escaped = false;
    let mut i = at + 1;
    while i < p.len() {
        match p[i] {
            b'\\' => {
                escaped = true;
                i += 2;
            }
            b'"' => return Some((&p[at + 1..i], escaped, i + 1)),
            _ => i += 1,
        }
    }
    None
}

/// The length of a frame header that starts with `head` (at least 2 bytes).
fn header_len(head: &[u8]) -> usize {
    let ext = match head[1] & 0x7f {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    let mask = if head[1] & 0x80 != 0 { 4 } else { 0 };
    2 + ext + mask
}

impl FrameReader {
    /// Reads `data`, the next bytes of the stream, calling `on_message` for each message it
    /// completes.
    pub fn push(&mut self, mut data: &[u8], mut on_message: impl FnMut(Message<'_>)) {
        while !data.is_empty() {
            if !self.in_payload {
                let need = if self.head_len < 2 {
                    2
                } else {
                    header_len(&self.head[..self.head_len])
                };
                let take = (need - self.head_len).min(data.len());
                self.head[self.head_len..self.head_len + take].copy_from_slice(&data[..take]);
                self.head_len += take;
                data = &data[take..];
                if self.head_len < need {
                    continue;
                }
                if need == 2 && header_len(&self.head[..2]) > 2 {
                    continue; // An extended length or a mask follows.
                }
                self.start_frame(&mut on_message);
                if self.payload_left == 0 {
                    self.end_frame(&mut on_message);
                }
                continue;
            }
            let n = usize::try_from(self.payload_left)
                .unwrap_or(usize::MAX)
                .min(data.len());
            let (chunk, rest) = data.split_at(n);
            if !self.control && self.state == MessageState::Collect {
                self.collect(chunk, &mut on_message);
            }
            self.payload_pos += n as u64;
            self.payload_left -= n as u64;
            data = rest;
            if self.payload_left == 0 {
                self.end_frame(&mut on_message);
            }
        }
    }

    /// Whether the bytes read so far end with a whole frame.
    pub fn between_frames(&self) -> bool {
        !self.in_payload && self.head_len == 0
    }

    /// The header is complete: reads it and starts the frame's payload.
    fn start_frame(&mut self, on_message: &mut impl FnMut(Message<'_>)) {
        let head = &self.head[..self.head_len];
        let fin = head[0] & 0x80 != 0;
        let compressed = head[0] & 0x40 != 0;
        let opcode = head[0] & 0x0f;
        let (len, at) = match head[1] & 0x7f {
            126 => (u64::from(u16::from_be_bytes([head[2], head[3]])), 4),
            127 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&head[2..10]);
                (u64::from_be_bytes(b), 10)
            }
            n => (u64::from(n), 2),
        };
        self.mask =
            (head[1] & 0x80 != 0).then(|| [head[at], head[at + 1], head[at + 2], head[at + 3]]);
        self.head_len = 0;
        self.in_payload = true;
        self.payload_left = len;
        self.payload_pos = 0;
        self.fin = fin;
        self.control = opcode & 0x08 != 0;
        match opcode {
            // Control frames (close, ping, pong) may come between a message's fragments: they
            // leave the message as it is.
            _ if self.control => {}
            // A continuation: the message goes on as it was (a stray one is skipped).
            0 => {
                if self.state == MessageState::Idle {
                    self.state = MessageState::Skip;
                }
            }
            1 if compressed => {
                self.text.clear();
                self.state = MessageState::Skip;
                on_message(Message::Compressed);
            }
            1 if !self.skip_text => {
                self.text.clear();
                self.state = MessageState::Collect;
                self.kind = Kind::Undecided;
            }
            _ => {
                self.text.clear();
                self.state = MessageState::Skip;
            }
        }
    }

    /// Holds `chunk`, the next payload bytes of the text message being read, as long as the
    /// message may be one the meter reads: its first bytes tell ([`kind_of`]), and a message of
    /// another type is dropped then, whatever its length.
    fn collect(&mut self, chunk: &[u8], on_message: &mut impl FnMut(Message<'_>)) {
        let mut rest = chunk;
        let mut pos = self.payload_pos;
        if self.kind == Kind::Undecided {
            let first = rest.len().min(TYPE_WITHIN.saturating_sub(self.text.len()));
            let (head, tail) = rest.split_at(first);
            self.hold(head, pos);
            (rest, pos) = (tail, pos + first as u64);
            self.kind = match kind_of(&self.text) {
                Kind::Undecided if self.text.len() >= TYPE_WITHIN => Kind::Unknown,
                kind => kind,
            };
            match self.kind {
                Kind::Other => {
                    self.state = MessageState::Skip;
                    self.text.clear();
                    return;
                }
                // All of `chunk` is held: the next bytes may tell.
                Kind::Undecided => return,
                Kind::Metered(_) | Kind::Unknown => {}
            }
        }
        if self.text.len() + rest.len() > MAX_METERED_MESSAGE {
            self.state = MessageState::Skip;
            self.text = Vec::new();
            on_message(Message::TooLarge {
                metered: matches!(self.kind, Kind::Metered(_)),
            });
            return;
        }
        self.hold(rest, pos);
    }

    /// Appends `bytes`, payload bytes from position `pos` of the frame, to the message, unmasked.
    fn hold(&mut self, bytes: &[u8], pos: u64) {
        let start = self.text.len();
        self.text.extend_from_slice(bytes);
        if let Some(mask) = self.mask {
            for (i, b) in self.text[start..].iter_mut().enumerate() {
                // Only the position modulo 4 matters.
                let at = (pos as usize).wrapping_add(i);
                *b ^= mask[at % 4];
            }
        }
    }

    /// The frame's payload is complete: a final data frame completes its message.
    fn end_frame(&mut self, on_message: &mut impl FnMut(Message<'_>)) {
        self.in_payload = false;
        if self.control || !self.fin {
            return;
        }
        if self.state == MessageState::Collect {
            on_message(Message::Text(&self.text));
        }
        self.state = MessageState::Idle;
        self.text.clear();
        // A session lives for minutes: the room a large message took is not kept.
        if self.text.capacity() > 64 * 1024 {
            self.text = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame as a server sends it (unmasked) or, with `mask`, as a client does.
    fn frame(fin: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
        let mut out = vec![(u8::from(fin) << 7) | opcode];
        let m = if mask.is_some() { 0x80 } else { 0 };
        match payload.len() {
            n if n < 126 => out.push(m | n as u8),
            n if n <= 0xffff => {
                out.push(m | 126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                out.push(m | 127);
                out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        match mask {
            None => out.extend_from_slice(payload),
            Some(k) => {
                out.extend_from_slice(&k);
                out.extend(payload.iter().enumerate().map(|(i, b)| b ^ k[i % 4]));
            }
        }
        out
    }

    /// What a reader reports for `stream` fed in pieces of `piece` bytes.
    fn read(stream: &[u8], piece: usize) -> Vec<String> {
        let mut r = FrameReader::default();
        let mut out = Vec::new();
        for chunk in stream.chunks(piece.max(1)) {
            r.push(chunk, |m| {
                out.push(match m {
                    Message::Text(t) => String::from_utf8_lossy(t).into_owned(),
                    Message::TooLarge { metered: true } => "<too large>".into(),
                    Message::TooLarge { metered: false } => "<too large, type unknown>".into(),
                    Message::Compressed => "<compressed>".into(),
                })
            });
        }
        out
    }

    const DONE: &str = r#"{"type":"response.done","response":{}}"#;
    const CREATED: &str = r#"{ "type" : "session.created", "session": {"model": "m"} }"#;

    #[test]
    fn text_messages_are_read_whatever_the_pieces() {
        let mut s = frame(true, 1, DONE.as_bytes(), None);
        s.extend(frame(true, 2, b"\x00\x01binary", None));
        s.extend(frame(true, 9, b"ping", None));
        s.extend(frame(true, 1, b"", None));
        s.extend(frame(true, 1, b"not json", None));
        s.extend(frame(true, 1, br#"{"type":"response.created"}"#, None));
        s.extend(frame(true, 1, CREATED.as_bytes(), None));
        for piece in [1, 2, 3, 7, 1000] {
            assert_eq!(read(&s, piece), [DONE, "", CREATED], "pieces of {piece}");
        }
    }

    #[test]
    fn the_first_bytes_tell_a_metered_type() {
        let metered = Kind::Metered(b"response.done");
        for (prefix, kind) in [
            (r#"{"type":"response.done""#, metered),
            ("\n { \"type\"\t:\r\n \"response.done\"", metered),
            (
                r#"{"event_id":"e_1","n":-1.5e3,"ok":true,"type":"response.done""#,
                metered,
            ),
            (
                r#"{"type":"session.updated""#,
                Kind::Metered(b"session.updated"),
            ),
            (r#"{"type":"response.done.x""#, Kind::Other),
            (r#"{"type":"conversation.item.cre"#, Kind::Other),
            (r#"{"type":"response.do"#, Kind::Undecided),
            (r#"{"event_id":"e_\"1"#, Kind::Undecided),
            (r#"{"type""#, Kind::Undecided),
            ("", Kind::Undecided),
            ("hello", Kind::Other),
            ("{}", Kind::Other),
            (r#"{"type":7}"#, Kind::Other),
            (
                r#"{"event_id":"e_1","response":{},"type":"response.done"}"#,
                Kind::Unknown,
            ),
            (r#"{"ty\u0070e":"response.done"}"#, Kind::Unknown),
            (r#"{"type":"response\u002edone"}"#, Kind::Unknown),
        ] {
            assert_eq!(kind_of(prefix.as_bytes()), kind, "{prefix}");
        }
    }

    #[test]
    fn a_large_message_of_another_type_is_dropped_at_once_and_never_warned_about() {
        // What a caller can make the upstream echo: over the bound, and not a metered event.
        let echo = format!(
            r#"{{"type":"conversation.item.created","item":{{"text":"{}"}}}}"#,
            "x".repeat(MAX_METERED_MESSAGE)
        );
        let mut r = FrameReader::default();
        let mut seen = Vec::new();
        let f = frame(true, 1, echo.as_bytes(), None);
        for chunk in f.chunks(COPY_BUFFER) {
            r.push(chunk, |m| seen.push(format!("{m:?}")));
            assert!(r.text.len() <= TYPE_WITHIN, "held: {}", r.text.len());
        }
        assert!(seen.is_empty(), "{seen:?}");
        // A metered one as large is warned about; one whose type comes late, once per session.
        let big_done = format!(
            r#"{{"type":"response.done","pad":"{}"}}"#,
            "x".repeat(MAX_METERED_MESSAGE)
        );
        assert_eq!(
            read(&frame(true, 1, big_done.as_bytes(), None), COPY_BUFFER),
            ["<too large>"]
        );
        let late = format!(
            r#"{{"pad":{{"x":"{}"}},"type":"response.done"}}"#,
            "x".repeat(MAX_METERED_MESSAGE)
        );
        assert_eq!(
            read(&frame(true, 1, late.as_bytes(), None), COPY_BUFFER),
            ["<too large, type unknown>"]
        );
    }

    #[test]
    fn fragments_are_joined_around_control_frames() {
        let mut s = frame(false, 1, b"{\"type\":", None);
        s.extend(frame(true, 9, b"ping", None));
        s.extend(frame(false, 0, b"\"response", None));
        s.extend(frame(true, 10, b"", None));
        s.extend(frame(true, 0, b".done\"}", None));
        s.extend(frame(false, 2, b"bin", None));
        s.extend(frame(true, 0, b"ary", None));
        s.extend(frame(true, 1, DONE.as_bytes(), None));
        for piece in [1, 5, 1000] {
            assert_eq!(read(&s, piece), ["{\"type\":\"response.done\"}", DONE]);
        }
    }

    #[test]
    fn long_lengths_and_masks() {
        let padded =
            |c: &str, n: usize| format!(r#"{{"type":"response.done","x":"{}"}}"#, c.repeat(n));
        let (medium, long) = (padded("m", 300), padded("l", 70_000));
        let mut s = frame(true, 1, medium.as_bytes(), None);
        s.extend(frame(true, 1, long.as_bytes(), None));
        // Masked, and the type told across two fragments with their own masks.
        s.extend(frame(false, 1, br#"{"type":"sess"#, Some([1, 2, 3, 4])));
        s.extend(frame(true, 0, br#"ion.created"}"#, Some([9, 8, 7, 6])));
        for piece in [3, 4096, 1 << 20] {
            assert_eq!(
                read(&s, piece),
                [
                    medium.clone(),
                    long.clone(),
                    r#"{"type":"session.created"}"#.into()
                ]
            );
        }
    }

    #[test]
    fn a_message_too_large_is_skipped_and_the_next_is_read() {
        let sized = |len: usize| {
            let head = r#"{"type":"response.done","x":""#;
            format!("{head}{}\"}}", "x".repeat(len - head.len() - 2))
        };
        let big = sized(MAX_METERED_MESSAGE + 1);
        let mut s = frame(false, 1, &big.as_bytes()[..10], None);
        s.extend(frame(true, 0, &big.as_bytes()[10..], None));
        s.extend(frame(true, 1, DONE.as_bytes(), None));
        assert_eq!(read(&s, 64 * 1024), ["<too large>", DONE]);
        let exact = sized(MAX_METERED_MESSAGE);
        assert_eq!(
            read(&frame(true, 1, exact.as_bytes(), None), 1 << 16).len(),
            1
        );
    }

    #[test]
    fn frames_are_followed_without_holding_text() {
        let mut r = FrameReader {
            skip_text: true,
            ..FrameReader::default()
        };
        assert!(r.between_frames());
        let f = frame(true, 1, &[b'x'; 300], Some([1, 2, 3, 4]));
        let mut seen = 0;
        r.push(&f[..1], |_| seen += 1);
        assert!(!r.between_frames(), "within a header");
        r.push(&f[1..100], |_| seen += 1);
        assert!(!r.between_frames(), "within a payload");
        r.push(&f[100..], |_| seen += 1);
        assert!(r.between_frames());
        assert_eq!((seen, r.text.capacity()), (0, 0));
    }

    #[test]
    fn compressed_and_stray_frames_are_not_read() {
        let mut s = frame(true, 1 | 0x40, b"deflated", None);
        s.extend(frame(true, 0, b"stray", None));
        s.extend(frame(true, 1, DONE.as_bytes(), None));
        assert_eq!(read(&s, 2), ["<compressed>", DONE]);
    }

    #[test]
    fn only_the_key_protocol_entries_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(
            SEC_WEBSOCKET_PROTOCOL,
            "realtime, openai-insecure-api-key.sk-secret, openai-beta.realtime-v1"
                .parse()
                .unwrap(),
        );
        h.insert(
            SEC_WEBSOCKET_EXTENSIONS,
            "permessage-deflate".parse().unwrap(),
        );
        forwardable(&mut h, false);
        assert_eq!(
            h[SEC_WEBSOCKET_PROTOCOL],
            "realtime, openai-beta.realtime-v1"
        );
        assert!(h.contains_key(SEC_WEBSOCKET_EXTENSIONS));
        forwardable(&mut h, true);
        assert!(!h.contains_key(SEC_WEBSOCKET_EXTENSIONS));
        let mut h = HeaderMap::new();
        h.insert(
            SEC_WEBSOCKET_PROTOCOL,
            "openai-insecure-api-key.sk-secret".parse().unwrap(),
        );
        forwardable(&mut h, true);
        assert!(!h.contains_key(SEC_WEBSOCKET_PROTOCOL));
    }

    #[test]
    fn malformed_handshakes_are_told_apart() {
        let upgrade = |method: Method, version: Version, uri: &str, ws_version, key| {
            Request::builder()
                .method(method)
                .version(version)
                .uri(uri)
                .header(SEC_WEBSOCKET_VERSION, ws_version)
                .header(SEC_WEBSOCKET_KEY, key)
                .body(())
                .unwrap()
        };
        let (get, http11, uri, key) = (
            Method::GET,
            Version::HTTP_11,
            "/v1/realtime?model=m",
            "dGhlIHNhbXBsZSBub25jZQ==",
        );
        assert_eq!(
            malformed(&upgrade(get.clone(), http11, uri, "13", key)),
            None
        );
        assert!(malformed(&upgrade(Method::POST, http11, uri, "13", key)).is_some());
        assert!(malformed(&upgrade(get.clone(), Version::HTTP_10, uri, "13", key)).is_some());
        assert!(malformed(&upgrade(get.clone(), http11, uri, "13", "short")).is_some());
        assert!(malformed(&upgrade(get.clone(), http11, uri, "8", key)).is_some());
        assert!(
            malformed(&upgrade(
                get,
                http11,
                "/v1/realtime?model=a&model=b",
                "13",
                key
            ))
            .is_some()
        );
    }

    #[test]
    fn a_model_named_twice_or_by_an_encoded_name_is_ambiguous() {
        let uri = |q: &str| format!("/v1/realtime{q}").parse::<Uri>().unwrap();
        for q in [
            "",
            "?model=gpt-realtime",
            "?model=gpt%2Drealtime&x=1",
            "?models=a&model=b",
            "?mode=a",
        ] {
            assert!(!ambiguous_model(&uri(q)), "{q}");
        }
        for q in [
            "?model=a&model=b",
            "?mod%65l=gpt-realtime",
            "?model=a&%6Dodel=b",
            "?model&model=b",
        ] {
            assert!(ambiguous_model(&uri(q)), "{q}");
        }
        assert_eq!(
            query_model(&uri("?x=1&model=gpt%2Drealtime")).as_deref(),
            Some("gpt-realtime")
        );
        assert_eq!(query_model(&uri("?models=a")), None);
        assert_eq!(query_model(&uri("?model=")), None);
    }

    #[test]
    fn session_events_name_the_model() {
        let model = |m: &str| session_model(m.as_bytes());
        assert_eq!(model(CREATED).as_deref(), Some("m"));
        assert_eq!(
            model(r#"{"type":"session.updated","session":{"model":"gpt-realtime-2025-08-28"}}"#)
                .as_deref(),
            Some("gpt-realtime-2025-08-28")
        );
        assert_eq!(model(r#"{"type":"session.updated","session":{}}"#), None);
        assert_eq!(
            model(r#"{"type":"response.done","session":{"model":"x"}}"#),
            None
        );
        assert_eq!(model(DONE), None);
    }

    /// A writer whose peer is gone.
    struct Gone;

    impl AsyncWrite for Gone {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            _: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn tokens_read_are_metered_though_the_write_fails() {
        let (pending, pending_spend) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut dir = Direction::new(Some(Meter {
            pending: &pending,
            pending_spend: &pending_spend,
            prices: None,
            model: None,
            total: 0,
            key: "k",
            warned_unknown: false,
        }));
        let done = br#"{"type":"response.done","response":{"usage":{"total_tokens":9}}}"#;
        let stream = frame(true, 1, done, None);
        let r = pump(&mut stream.as_slice(), &mut Gone, &mut dir).await;
        assert!(matches!(r, Err(Failure::Write(_))), "{r:?}");
        assert_eq!(pending.load(Ordering::SeqCst), 9);
        assert!(!dir.between_frames(), "the caller may have part of a frame");
    }

    #[test]
    fn the_cap_is_taken_and_given_back() {
        let live = LiveSessions::new();
        let a = live.take(2).unwrap();
        let _b = live.take(2).unwrap();
        assert!(live.take(2).is_none());
        assert_eq!(live.count(), 2);
        drop(a);
        assert_eq!(live.count(), 1);
        assert!(live.take(2).is_some());
    }
}
