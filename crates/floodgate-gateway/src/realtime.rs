//! Realtime API sessions once upgraded (docs/design.md §6): the two connections spliced, the
//! upstream's frames metered as they pass, the tokens and spend charged as the session runs,
//! and the process's cap on live sessions. The handshake and its admission are the pipeline's
//! (`http::realtime`), run through the same admission as any request.
//!
//! Bytes are copied both ways unchanged, as they arrive, until the upstream closes its
//! connection (a WebSocket server does so after the closing handshake; the caller's connection
//! is then closed too), or the caller closes its own and the upstream follows (within 10 s), or
//! either side fails. When the caller's side fails, the upstream is told as by a half-close and
//! read on (its bytes dropped) until it closes, within 10 s, so that a turn under way is
//! metered. When a write to the upstream fails, what the upstream sent before it failed is still
//! read and passed to the caller (its last `response.done`, metered), until its connection ends,
//! or for `[server] header_timeout_sec` if it stays open.
//!
//! **Metering.** For a chain with token limits or budgets the frames from the upstream are read
//! as they pass ([`FrameReader`]): each text message whose JSON `type` is `response.done` adds
//! its `response.usage` to the session's meter, which charges the chain's token limits (and
//! spends against its budgets) every `[realtime] flush_sec` and once more when the session ends.
//! Spend is priced by the model the upstream says it runs, `session.model` in its latest
//! `session.created` or `session.updated` event, and before the first by the URL's `?model=`.
//! Only messages whose first bytes may be those events are held. Metering reads a copy of each
//! piece as it is read, before it is forwarded: it never changes or closes a session, and a
//! full token window only refuses later requests and upgrades. (In a metered session the
//! gateway's `rate_limits.updated` follows a turn's `response.done` once the store has answered
//! the read of the limits; the turn's end goes out before that read, not after it.)
//!
//! **Shutdown.** A draining worker lets its live sessions go on for `[realtime] drain_sec`, then
//! closes them: a close frame with status 1001 (going away) to each side where it fits between
//! frames, both connections closed, their tokens charged.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use floodgate::{Budgets, Chain};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use crate::access_log::latency_ms;
use crate::charge::Charger;
use crate::config::RealtimeConfig;
use crate::openai::frames::{self, FrameReader, GOING_AWAY, MAX_METERED_MESSAGE, Message};
use crate::openai::realtime::session_model;
use crate::openai::usage::response_done_usage;
use crate::pricing::Prices;
use crate::send_timed::SendTimed;
use crate::slots::Slots;
use crate::store::GatewayStore;

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
    pub(crate) fn take(&self, max: usize) -> Option<Slot> {
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
pub(crate) struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The realtime sessions of one worker (one `AppState`): the process's count, the settings,
/// and the signal that closes them at the end of a drain.
#[derive(Debug)]
pub(crate) struct Sessions {
    live: LiveSessions,
    max: usize,
    flush: Duration,
    drain: Duration,
    /// How long a write to the upstream may wait with nothing taken (`[server]
    /// header_timeout_sec`, as for the caller's socket).
    stall: Duration,
    /// `true` once the worker closes its sessions. Each session holds a receiver until it has
    /// ended and charged its tokens: no receiver left means no session left.
    close: watch::Sender<bool>,
}

impl Sessions {
    pub(crate) fn new(config: &RealtimeConfig, stall: Duration, live: LiveSessions) -> Sessions {
        Sessions {
            live,
            max: config.max_connections,
            flush: config.flush,
            drain: config.drain,
            stall,
            close: watch::Sender::new(false),
        }
    }

    /// The process's live sessions.
    pub(crate) fn live(&self) -> &LiveSessions {
        &self.live
    }

    /// `[realtime] max_connections`.
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// A slot of the process's cap, if one is free: taken before the session is admitted, so
    /// that a refusal for a full process charges nothing.
    pub(crate) fn take_slot(&self) -> Option<Slot> {
        self.live.take(self.max)
    }

    /// Runs the session whose handshake both sides have answered, in a task of its own: `key`'s
    /// session, holding `slot` (its place under `[realtime] max_connections`) until it has ended
    /// and charged what it metered, and its chain's concurrency `slots` until it has ended
    /// (given back before its caller's connection is shut).
    pub(crate) fn spawn(
        &self,
        (slot, slots): (Slot, Option<Slots>),
        key: Arc<str>,
        SessionMeter {
            charger,
            chain,
            spend,
            rates,
        }: SessionMeter,
        (caller, upstream): (OnUpgrade, OnUpgrade),
    ) {
        let session = Session {
            key,
            charger,
            chain,
            spend,
            rates,
            flush: self.flush,
            stall: self.stall,
            close: self.close.subscribe(),
            _slot: slot,
            slots,
        };
        tokio::spawn(session.run(caller, upstream));
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

/// One live session: what it needs once both connections are upgraded.
struct Session {
    key: Arc<str>,
    charger: Charger,
    /// The chain to charge tokens to; `None`: the chain has no token limit.
    chain: Option<Arc<Chain>>,
    /// What the session spends against; `None`: the chain has no budget.
    spend: Option<SessionSpend>,
    /// The chain whose state a metered session's caller is told after each turn; `None`: an
    /// unmetered session (its frames pass unchanged).
    rates: Option<Arc<Chain>>,
    flush: Duration,
    /// How long a write to the upstream may wait with nothing taken.
    stall: Duration,
    close: watch::Receiver<bool>,
    /// Held until the session has ended.
    _slot: Slot,
    /// The chain's concurrency slots: the session holds them for its whole life, and gives them
    /// back before its caller's connection is shut ([`Direction::slots`]).
    slots: Option<Slots>,
}

/// What a session is charged to and tells its caller of.
pub(crate) struct SessionMeter {
    /// Charges what the session meters.
    pub(crate) charger: Charger,
    /// The chain to charge tokens to; `None`: the chain has no token limit.
    pub(crate) chain: Option<Arc<Chain>>,
    /// What the session spends against; `None`: the chain has no budget.
    pub(crate) spend: Option<SessionSpend>,
    /// The chain a metered session's caller is told the limits of after each turn; `None`:
    /// an unmetered session.
    pub(crate) rates: Option<Arc<Chain>>,
}

/// A session's budgets, the price table and the model its URL names.
pub(crate) struct SessionSpend {
    /// The chain's budgets.
    pub(crate) budgets: Arc<Budgets>,
    /// The price table.
    pub(crate) prices: Arc<Prices>,
    /// Prices the session's turns until the upstream's session events name its model.
    pub(crate) model: Option<String>,
}

/// Why a session ended.
#[derive(Debug)]
enum End {
    /// The upstream closed its connection.
    UpstreamClosed,
    /// The caller closed its connection, or started the closing handshake, and the upstream
    /// followed.
    CallerClosed,
    /// The caller closed its connection, the upstream did not follow within
    /// [`HALF_CLOSED_LINGER`].
    HalfClosed,
    /// Reading or writing one side failed (a reset): whose, and how.
    Failed(Side, std::io::Error),
    /// The worker closed it at the end of its drain.
    Shutdown,
}

/// A side of a session.
#[derive(Clone, Copy, Debug)]
enum Side {
    Caller,
    Upstream,
}

impl Side {
    fn as_str(self) -> &'static str {
        match self {
            Side::Caller => "caller",
            Side::Upstream => "upstream",
        }
    }
}

impl End {
    fn as_str(&self) -> &'static str {
        match self {
            End::UpstreamClosed => "upstream_closed",
            End::CallerClosed => "caller_closed",
            End::HalfClosed => "half_closed",
            End::Failed(..) => "connection_error",
            End::Shutdown => "shutdown",
        }
    }
}

impl Session {
    async fn run(self, caller: OnUpgrade, upstream: OnUpgrade) {
        let start = Instant::now();
        let (caller, upstream) = match tokio::try_join!(caller, upstream) {
            Ok(both) => both,
            Err(e) => {
                tracing::warn!(key = %self.key, error = %e, "realtime session could not start");
                // Its request line (101) is written: its end line is too.
                tracing::info!(
                    key = %self.key,
                    duration_ms = latency_ms(start),
                    end = "not_started",
                    error = %e,
                    "realtime session ended"
                );
                return;
            }
        };
        self.splice(TokioIo::new(caller), TokioIo::new(upstream), start)
            .await;
    }

    /// The session once both connections are upgraded, from its start at `start`: see the
    /// module docs.
    async fn splice<C, U>(mut self, caller: C, upstream: U, start: Instant)
    where
        C: AsyncRead + AsyncWrite + Unpin,
        U: AsyncRead + AsyncWrite + Unpin,
    {
        let (mut caller_in, mut caller_out) = tokio::io::split(caller);
        // An upstream that takes nothing (hung) would hold the session, and its slots, for good:
        // the caller's frames would wait for it, and the gateway would read no more of the
        // caller, not even its leaving. Its writes are timed as the caller's socket's are.
        let upstream = SendTimed::saying(
            upstream,
            self.stall,
            "the upstream took nothing for header_timeout_sec",
        );
        let (mut upstream_in, mut upstream_out) = tokio::io::split(upstream);
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
            charger: &self.charger,
            done: 0,
        }));
        // Given back before the caller sees its connection end (docs/design.md §10).
        to_caller.slots = self.slots.take();
        // A metered session's caller hears of its own limits, not the upstream key's.
        to_caller.relay = self
            .rates
            .as_ref()
            .map(|chain| Relay::new(Arc::clone(chain), self.charger.store().clone()));
        let mut caller_done = false;
        // Set when the caller's side failed: the upstream is read until then.
        let mut upstream_until = None;
        // Set when a write to the upstream failed: what the upstream sent before it failed is
        // still read and passed to the caller (a last `response.done`, metered), until its
        // connection ends or, for one still open but taking nothing (hung), for
        // `header_timeout_sec` more; then the session ends as failed by it.
        let mut upstream_write_failed = None;
        let end = {
            let mut up = pin!(pump(&mut caller_in, &mut upstream_out, &mut to_upstream));
            let mut down = pin!(pump(&mut upstream_in, &mut caller_out, &mut to_caller));
            let mut flusher = pin!(flush_every(
                self.flush,
                (&pending, &pending_spend),
                &self.charger,
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
                            break End::Failed(Side::Caller, e);
                        }
                        Err(Failure::Write(e)) => {
                            // The caller is no longer read; the upstream is, for a while.
                            caller_done = true;
                            upstream_write_failed = Some(e);
                            linger.as_mut().reset(tokio::time::Instant::now() + self.stall);
                        }
                    },
                    // Everything the upstream sent has gone to the caller, then a half-close.
                    r = &mut down => match (r, upstream_write_failed.take()) {
                        // The upstream's failed write ends it, however its read ended.
                        (_, Some(e)) => break End::Failed(Side::Upstream, e),
                        (Ok(()), None) if caller_done => break End::CallerClosed,
                        (Ok(()), None) => break End::UpstreamClosed,
                        (Err(Failure::Write(e)), None) => {
                            upstream_until = Some(if caller_done {
                                linger.deadline()
                            } else {
                                tokio::time::Instant::now() + HALF_CLOSED_LINGER
                            });
                            break End::Failed(Side::Caller, e);
                        }
                        (Err(Failure::Read(e)), None) => break End::Failed(Side::Upstream, e),
                    },
                    () = &mut flusher => {}
                    () = &mut closing => break End::Shutdown,
                    () = &mut linger, if caller_done => match upstream_write_failed.take() {
                        Some(e) => break End::Failed(Side::Upstream, e),
                        None => break End::HalfClosed,
                    },
                }
            }
        };
        // A caller's close frame, answered by the upstream, which then closes its connection (as
        // a WebSocket server does): the caller ended the session, not the upstream.
        let end = match end {
            End::UpstreamClosed if caller_closed_first(&to_upstream, &to_caller) => {
                End::CallerClosed
            }
            end => end,
        };
        // The session is over (unless the upstream ended it, its caller's connection is still
        // open): its slots go back now, before the gateway's close frame, the connection's close
        // or a failed caller's upstream read on.
        if let Some(slots) = to_caller.slots.take() {
            slots.give_back().await;
        }
        // Only a metered session has a reason to read on: an unmetered one frees its slot now.
        if let Some(until) = upstream_until.filter(|_| metered) {
            // The caller is gone, the upstream may be amid a turn: it is told as by a
            // half-close, and what it still sends (that turn's `response.done`) is metered and
            // dropped, until it closes or its time is up. Nobody is told of the limits' state
            // after a turn any more: no store read for it.
            to_caller.relay = None;
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
        // Both connections are closed before the last tokens are charged (each socket closes
        // when both of its halves are gone).
        drop((caller_in, caller_out, upstream_in, upstream_out));
        let tokens = to_caller.meter.as_ref().map(|m| m.total);
        if let Some(chain) = &self.chain {
            let tokens = pending.swap(0, Ordering::SeqCst);
            // A session reserved nothing: its tokens are charged as they come (reactive).
            self.charger.tokens_now(chain, tokens, None).await;
        }
        if let Some(spend) = &self.spend {
            let micro_usd = pending_spend.swap(0, Ordering::SeqCst);
            if !spend.budgets.is_empty() {
                self.charger.count_spend(micro_usd);
            }
            self.charger.spend_now(&spend.budgets, micro_usd).await;
        }
        let (failed, error) = match &end {
            End::Failed(side, e) => (Some(side.as_str()), Some(e.to_string())),
            _ => (None, None),
        };
        tracing::info!(
            key = %self.key,
            duration_ms = latency_ms(start),
            tokens,
            end = end.as_str(),
            failed,
            error,
            "realtime session ended"
        );
    }
}

/// Whether the caller sent a close frame (`to_upstream`) before the upstream sent one
/// (`to_caller`), if it did.
fn caller_closed_first(to_upstream: &Direction<'_>, to_caller: &Direction<'_>) -> bool {
    match (to_upstream.frames.closed_at(), to_caller.frames.closed_at()) {
        (Some(caller), Some(upstream)) => caller <= upstream,
        (caller, _) => caller.is_some(),
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
    charger: &Charger,
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
        let tokens = pending.swap(0, Ordering::SeqCst);
        let micro_usd = pending_spend.swap(0, Ordering::SeqCst);
        charger.later((chain, None), tokens, (budgets, None), micro_usd, None);
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
            // The session's slots go back before its caller sees its connection end.
            if let Some(slots) = dir.slots.take() {
                slots.give_back().await;
            }
            // The other side may still be sending (its close frame): only this direction ends.
            let _ = to.shutdown().await;
            return Ok(());
        }
        dir.passed(&buf[..n]);
        let done = dir.meter.as_ref().map_or(0, |m| m.done);
        let Some(relay) = &mut dir.relay else {
            send(to, &mut dir.writing, &buf[..n]).await?;
            continue;
        };
        let mut out = Vec::with_capacity(n);
        relay.feed(&buf[..n], &mut out);
        // The piece goes out first, then the gateway's limits event after it, once the store
        // has answered its read: the turn's end never waits for the store, and a drain that
        // cancels the read loses the event alone, never a byte of the upstream's.
        send(to, &mut dir.writing, &out).await?;
        out.clear();
        // Not after the upstream's close frame: a data frame after it breaks the protocol.
        if let Some(relay) = &mut dir.relay
            && !dir.frames.closed()
        {
            relay.tell_after(done, &mut out).await;
        }
        send(to, &mut dir.writing, &out).await?;
    }
}

/// Writes `bytes` to `to` and flushes them, with `writing` set while they go (a close frame
/// must not be put in the middle of them).
async fn send<W: AsyncWrite + Unpin>(
    to: &mut W,
    writing: &mut bool,
    bytes: &[u8],
) -> Result<(), Failure> {
    if bytes.is_empty() {
        return Ok(());
    }
    *writing = true;
    to.write_all(bytes).await.map_err(Failure::Write)?;
    to.flush().await.map_err(Failure::Write)?;
    *writing = false;
    Ok(())
}

/// Most bytes of a single-frame text message held to read its `type`: the events replaced are
/// small; a larger frame passes as it comes.
const INSPECT_AT_MOST: u64 = 64 * 1024;

/// The upstream's frames on their way to a metered session's caller, rewritten: the
/// upstream's `rate_limits.updated` events (which describe the gateway's own upstream key)
/// are dropped, and after each `response.done` the caller gets one that describes its own
/// chain, as OpenAI shapes it. Whole frames only: a frame is held until it can be told apart
/// (a small single-frame text message) or passed as it comes (anything else).
struct Relay {
    chain: Arc<Chain>,
    store: GatewayStore,
    /// The start of a frame not yet passed or dropped.
    pending: Vec<u8>,
    /// Payload bytes of a frame being passed as it comes, still to come.
    passing: u64,
    /// Within a fragmented message: its frames pass as they come.
    fragmented: bool,
    /// The `response.done` count the caller has been told after.
    told: u64,
    /// Events sent, for their ids.
    sent: u64,
}

impl Relay {
    fn new(chain: Arc<Chain>, store: GatewayStore) -> Relay {
        Relay {
            chain,
            store,
            pending: Vec::new(),
            passing: 0,
            fragmented: false,
            told: 0,
            sent: 0,
        }
    }

    /// Whether what went out so far ends with a whole frame.
    fn between_frames(&self) -> bool {
        self.pending.is_empty() && self.passing == 0
    }

    /// Takes `data` read from the upstream; appends to `out` what may go to the caller now.
    fn feed(&mut self, mut data: &[u8], out: &mut Vec<u8>) {
        if self.passing > 0 {
            let n = data
                .len()
                .min(usize::try_from(self.passing).unwrap_or(usize::MAX));
            out.extend_from_slice(&data[..n]);
            self.passing -= n as u64;
            data = &data[n..];
        }
        self.pending.extend_from_slice(data);
        while self.passing == 0 {
            let Some((header, len, fin, opcode, masked)) = frame_header(&self.pending) else {
                return;
            };
            let inspect =
                fin && opcode == 1 && !masked && !self.fragmented && len <= INSPECT_AT_MOST;
            if inspect {
                let total = header + len as usize;
                if self.pending.len() < total {
                    return;
                }
                if !is_rate_limits_event(&self.pending[header..total]) {
                    out.extend_from_slice(&self.pending[..total]);
                }
                self.pending.drain(..total);
                continue;
            }
            match opcode {
                1 | 2 if !fin => self.fragmented = true,
                0 if fin => self.fragmented = false,
                _ => {}
            }
            let have =
                (self.pending.len() - header).min(usize::try_from(len).unwrap_or(usize::MAX));
            out.extend_from_slice(&self.pending[..header + have]);
            self.passing = len - have as u64;
            self.pending.drain(..header + have);
        }
    }

    /// After a `response.done` (`done` counts them) and at a frame boundary, appends the
    /// chain's `rate_limits.updated` to `out`: read at a cost of 0, charging nothing. Nothing
    /// when the store cannot say.
    async fn tell_after(&mut self, done: u64, out: &mut Vec<u8>) {
        // The event is a message of its own: not inside a fragmented one either (RFC 6455
        // §5.4), where only control frames may come between fragments. It waits for the next
        // read then, as it does for a frame still passing.
        if done <= self.told || !self.between_frames() || self.fragmented {
            return;
        }
        self.told = done;
        // A limit no request can pass reads as "never" at a cost of 1, as an admission would.
        let never = self.chain.limits().iter().any(|l| !l.fits(1));
        let Ok(decision) = self.chain.admit(&self.store, u64::from(never)).await else {
            return;
        };
        if !decision.enforced {
            return;
        }
        /// One entry of the event, in OpenAI's field order.
        #[derive(serde::Serialize)]
        struct Limit {
            name: &'static str,
            limit: u64,
            remaining: u64,
            reset_seconds: f64,
        }
        let limit = |name: &'static str, s: &floodgate::LimitStatus| Limit {
            name,
            limit: s.limit.max(),
            remaining: s.remaining,
            // Whole milliseconds, rounded up: the caller never retries early.
            reset_seconds: (s.reset.as_secs_f64() * 1000.0).ceil() / 1000.0,
        };
        let mut limits = Vec::new();
        if let Some(s) = decision.most_restrictive(floodgate::Charge::Admission) {
            limits.push(limit("requests", s));
        }
        if let Some(s) = decision.most_restrictive(floodgate::Charge::Reactive) {
            limits.push(limit("tokens", s));
        }
        if limits.is_empty() {
            return;
        }
        let Ok(limits) = serde_json::to_string(&limits) else {
            return;
        };
        self.sent += 1;
        // `type` first, as the Realtime API sends its events.
        let event = format!(
            r#"{{"type":"rate_limits.updated","event_id":"event_floodgate_{}","rate_limits":{limits}}}"#,
            self.sent
        );
        out.extend_from_slice(&frames::frame(true, 1, event.as_bytes(), None));
    }
}

/// A frame's header at the start of `buf`: its length, the payload's length, FIN, the opcode
/// and whether it is masked; `None` until the header is whole.
fn frame_header(buf: &[u8]) -> Option<(usize, u64, bool, u8, bool)> {
    let (b0, b1) = (*buf.first()?, *buf.get(1)?);
    let masked = b1 & 0x80 != 0;
    let (len, mut header) = match b1 & 0x7f {
        126 => (
            u64::from(u16::from_be_bytes([*buf.get(2)?, *buf.get(3)?])),
            4,
        ),
        127 => {
            let b: [u8; 8] = buf.get(2..10)?.try_into().ok()?;
            (u64::from_be_bytes(b), 10)
        }
        n => (u64::from(n), 2),
    };
    if masked {
        header += 4;
    }
    (buf.len() >= header).then_some((header, len, b0 & 0x80 != 0, b0 & 0x0f, masked))
}

/// Whether a text message is a `rate_limits.updated` event.
fn is_rate_limits_event(payload: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Event<'a> {
        #[serde(rename = "type", borrow)]
        kind: std::borrow::Cow<'a, str>,
    }
    serde_json::from_slice::<Event<'_>>(payload).is_ok_and(|e| e.kind == "rate_limits.updated")
}

/// Sends a close frame with status 1001 (going away) on `to`, if `dir` (what went there) ended
/// between two frames and held no close frame, masked as a client's when `masked`; within 1 s,
/// or not at all.
async fn going_away<W: AsyncWrite + Unpin>(to: &mut W, dir: &Direction<'_>, masked: bool) {
    // A close frame has gone that way already: a second one has nothing to say.
    if !dir.between_frames() || dir.frames.closed() {
        return;
    }
    // A client's frames are masked (RFC 6455, 5.3); the key needs no secrecy here: the payload
    // is the gateway's own.
    let mask = masked.then(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x5a17_c39e, |d| d.subsec_nanos())
            .to_be_bytes()
    });
    let frame = frames::frame(true, 0x8, &GOING_AWAY, mask);
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
    /// Rewrites the frames on their way (the upstream's to a metered session's caller).
    relay: Option<Relay>,
    /// The session's concurrency slots, on the caller's direction: given back (and the store's
    /// answer awaited) before the caller's connection is shut, so that a caller that reconnects
    /// once its connection has closed finds them free (docs/design.md §10).
    slots: Option<Slots>,
}

impl<'a> Direction<'a> {
    fn new(meter: Option<Meter<'a>>) -> Direction<'a> {
        Direction {
            // Text messages are only held to be metered.
            frames: FrameReader::new(meter.is_none()),
            writing: false,
            meter,
            relay: None,
            slots: None,
        }
    }

    /// Whether everything sent so far ends with a whole frame.
    fn between_frames(&self) -> bool {
        let relayed = self.relay.as_ref().is_none_or(Relay::between_frames);
        !self.writing && relayed && self.frames.between_frames()
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
    /// Counts each turn's usage in the metrics.
    charger: &'a Charger,
    /// `response.done` events read: each is followed by the caller's `rate_limits.updated`.
    done: u64,
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
            charger,
            done,
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
                } else if let Some(usage) = response_done_usage(text) {
                    *done += 1;
                    *total = total.saturating_add(usage.total);
                    add(pending, usage.total);
                    charger.count_usage(&usage);
                    if let Some(prices) = prices {
                        add(pending_spend, prices.spend(model.as_deref(), None, &usage));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::frames::frame;

    /// A meter of key `k` on these counters and charger, no prices.
    fn meter<'a>(
        pending: &'a AtomicU64,
        pending_spend: &'a AtomicU64,
        charger: &'a Charger,
    ) -> Meter<'a> {
        Meter {
            pending,
            pending_spend,
            prices: None,
            model: None,
            total: 0,
            key: "k",
            warned_unknown: false,
            charger,
            done: 0,
        }
    }

    /// `poll_flush` and `poll_shutdown` of a test writer that holds nothing back.
    macro_rules! nothing_to_flush {
        () => {
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
        };
    }

    /// A writer that keeps each write apart, or whose peer is gone (every write fails).
    #[derive(Default)]
    struct Writes {
        gone: bool,
        each: Vec<Vec<u8>>,
    }

    impl AsyncWrite for Writes {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            bytes: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            if self.gone {
                return std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
            }
            self.each.push(bytes.to_vec());
            std::task::Poll::Ready(Ok(bytes.len()))
        }
        nothing_to_flush!();
    }

    #[tokio::test]
    async fn tokens_read_are_metered_though_the_write_fails() {
        let (pending, pending_spend) = (AtomicU64::new(0), AtomicU64::new(0));
        let store = floodgate::store::AnyStore::Memory(floodgate::store::MemoryStore::new());
        let charger = Charger::new(store, crate::metrics::Metrics::new());
        let mut dir = Direction::new(Some(meter(&pending, &pending_spend, &charger)));
        let done = br#"{"type":"response.done","response":{"usage":{"total_tokens":9}}}"#;
        let stream = frame(true, 1, done, None);
        let mut gone = Writes {
            gone: true,
            each: Vec::new(),
        };
        let r = pump(&mut stream.as_slice(), &mut gone, &mut dir).await;
        assert!(matches!(r, Err(Failure::Write(_))), "{r:?}");
        assert_eq!(pending.load(Ordering::SeqCst), 9);
        assert!(!dir.between_frames(), "the caller may have part of a frame");
    }

    /// An upstream whose connection was reset with a turn's end unread: nothing to read until
    /// a write has failed, then `unread`, then the reset.
    struct Reset {
        unread: Option<Vec<u8>>,
        write_failed: bool,
        reader: Option<std::task::Waker>,
    }

    impl AsyncRead for Reset {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            if !self.write_failed {
                self.reader = Some(cx.waker().clone());
                return std::task::Poll::Pending;
            }
            match self.unread.take() {
                Some(bytes) => {
                    buf.put_slice(&bytes);
                    std::task::Poll::Ready(Ok(()))
                }
                None => std::task::Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into())),
            }
        }
    }

    impl AsyncWrite for Reset {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            _: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.write_failed = true;
            if let Some(reader) = self.reader.take() {
                reader.wake();
            }
            std::task::Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into()))
        }
        nothing_to_flush!();
    }

    /// A write to the upstream fails before the gateway has read the turn's end the upstream
    /// sent: the turn still reaches the caller and is charged. (Before, the failed write ended
    /// the session at once, and the turn went unread and uncharged.)
    #[tokio::test]
    async fn a_turn_unread_when_a_write_to_the_upstream_fails_is_passed_on_and_charged() {
        use floodgate::{ChainLimit, Charge, ScopeKind, WindowLimit};
        use tokio::io::AsyncReadExt;

        let store = floodgate::store::AnyStore::Memory(floodgate::store::MemoryStore::new());
        let charger = Charger::new(store.clone(), crate::metrics::Metrics::new());
        let tpm = WindowLimit::per_minute(100);
        let chain = Arc::new(Chain::new(vec![ChainLimit::new(
            "k",
            ScopeKind::Key,
            "k",
            Charge::Reactive,
            tpm,
        )]));
        let live = LiveSessions::new();
        let (_close, close) = watch::channel(false);
        let session = Session {
            key: "k".into(),
            charger: charger.clone(),
            chain: Some(Arc::clone(&chain)),
            spend: None,
            rates: None,
            flush: Duration::from_secs(3600),
            stall: Duration::from_secs(3600),
            close,
            _slot: live.take(1).unwrap(),
            slots: None,
        };
        let done = br#"{"type":"response.done","response":{"usage":{"total_tokens":9}}}"#;
        let turn = frame(true, 1, done, None);
        let upstream = Reset {
            unread: Some(turn.clone()),
            write_failed: false,
            reader: None,
        };
        let (gateway_side, mut caller) = tokio::io::duplex(64 * 1024);
        caller
            .write_all(&frame(true, 1, b"hi", Some([1, 2, 3, 4])))
            .await
            .unwrap();
        session.splice(gateway_side, upstream, Instant::now()).await;
        let mut got = Vec::new();
        caller.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, turn, "the turn's end passed on, then the end");
        charger.settled().await;
        let read = chain.admit(&store, 0).await.unwrap();
        assert_eq!(read.statuses[0].remaining, 100 - 9, "the turn charged");
        assert_eq!(live.count(), 0);
    }

    #[tokio::test]
    async fn no_close_frame_of_the_gateways_follows_one_that_passed() {
        let mut out = Vec::new();
        let mut dir = Direction::new(None);
        dir.passed(&frame(true, 0x8, &1000u16.to_be_bytes(), None));
        going_away(&mut out, &dir, false).await;
        assert!(out.is_empty(), "{out:?}");
        let mut dir = Direction::new(None);
        dir.passed(&frame(true, 1, b"x", None));
        going_away(&mut out, &dir, false).await;
        assert_eq!(out, frame(true, 0x8, &GOING_AWAY, None));
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

    /// A server stream's frames, as (fin, opcode, payload).
    fn frames_of(mut s: &[u8]) -> Vec<(bool, u8, Vec<u8>)> {
        let mut frames = Vec::new();
        while !s.is_empty() {
            let (header, len, fin, opcode, _) = frame_header(s).unwrap();
            let end = header + len as usize;
            frames.push((fin, opcode, s[header..end].to_vec()));
            s = &s[end..];
        }
        frames
    }

    #[tokio::test]
    async fn the_gateways_limits_event_waits_for_a_fragmented_message_to_end() {
        let (pending, pending_spend) = (AtomicU64::new(0), AtomicU64::new(0));
        let store = floodgate::store::AnyStore::Memory(floodgate::store::MemoryStore::new());
        let charger = Charger::new(store.clone(), crate::metrics::Metrics::new());
        let limit = |charge| {
            floodgate::ChainLimit::new(
                "key:k",
                floodgate::ScopeKind::Key,
                "k",
                charge,
                floodgate::WindowLimit::per_minute(100),
            )
        };
        let chain = Chain::new(vec![
            limit(floodgate::Charge::Admission),
            limit(floodgate::Charge::Reactive),
        ]);
        let mut dir = Direction::new(Some(meter(&pending, &pending_spend, &charger)));
        dir.relay = Some(Relay::new(Arc::new(chain), store));
        // One read: a turn's end, then the first fragment of the next message; the next read:
        // its last fragment.
        let done = br#"{"type":"response.done","response":{"usage":{"total_tokens":9}}}"#;
        let mut first = frame(true, 1, done, None);
        first.extend(frame(false, 1, br#"{"type":"response.out"#, None));
        let second = frame(true, 0, br#"put_text.delta"}"#, None);
        let mut from = first.as_slice().chain(second.as_slice());
        let mut out = Vec::new();
        assert!(pump(&mut from, &mut out, &mut dir).await.is_ok());
        let kinds: Vec<(bool, u8)> = frames_of(&out).iter().map(|f| (f.0, f.1)).collect();
        // Before, the event came between the two fragments: (true, 1) in the middle.
        assert_eq!(kinds, [(true, 1), (false, 1), (true, 0), (true, 1)]);
        let told = frames_of(&out).pop().unwrap().2;
        assert!(String::from_utf8_lossy(&told).contains("rate_limits.updated"));
    }

    #[tokio::test]
    async fn a_turns_end_goes_out_before_the_store_is_read_for_the_limits_event() {
        let (pending, pending_spend) = (AtomicU64::new(0), AtomicU64::new(0));
        let store = floodgate::store::AnyStore::Memory(floodgate::store::MemoryStore::new());
        let charger = Charger::new(store.clone(), crate::metrics::Metrics::new());
        let chain = Chain::new(vec![floodgate::ChainLimit::new(
            "key:k",
            floodgate::ScopeKind::Key,
            "k",
            floodgate::Charge::Reactive,
            floodgate::WindowLimit::per_minute(100),
        )]);
        let mut dir = Direction::new(Some(meter(&pending, &pending_spend, &charger)));
        dir.relay = Some(Relay::new(Arc::new(chain), store));
        let done = br#"{"type":"response.done","response":{"usage":{"total_tokens":9}}}"#;
        let piece = frame(true, 1, done, None);
        let mut writes = Writes::default();
        assert!(
            pump(&mut piece.as_slice(), &mut writes, &mut dir)
                .await
                .is_ok()
        );
        // Two writes: the upstream's piece whole (before, it waited for the store's read and
        // went out in one write with the event), then the gateway's event.
        assert_eq!(writes.each.len(), 2, "{}", writes.each.len());
        assert_eq!(writes.each[0], piece);
        assert!(String::from_utf8_lossy(&writes.each[1]).contains("rate_limits.updated"));
    }

    #[test]
    fn the_relay_drops_the_upstreams_limits_and_passes_the_rest_whatever_the_pieces() {
        let limits = br#"{"type":"rate_limits.updated","rate_limits":[]}"#;
        let big = vec![b'x'; 100_000];
        let parts = [
            frame(true, 1, br#"{"type":"response.done"}"#, None),
            frame(true, 1, limits, None),
            frame(true, 2, &big, None),
            // A fragmented text message passes as it comes, a `rate_limits.updated` or not.
            frame(false, 1, br#"{"type":"rate_l"#, None),
            frame(true, 9, b"ping", None),
            frame(true, 0, br#"imits.updated"}"#, None),
            frame(true, 1, b"last", None),
        ];
        let stream: Vec<u8> = parts.concat();
        let want: Vec<u8> = parts
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 1)
            .flat_map(|(_, p)| p.clone())
            .collect();
        for piece in [1, 2, 3, 7, 100, 4096, 70_000, stream.len()] {
            let store = floodgate::store::AnyStore::Memory(floodgate::store::MemoryStore::new());
            let mut relay = Relay::new(Arc::new(Chain::new(Vec::new())), store);
            let mut out = Vec::new();
            for chunk in stream.chunks(piece) {
                relay.feed(chunk, &mut out);
            }
            assert!(relay.between_frames(), "piece {piece}");
            assert_eq!(out.len(), want.len(), "piece {piece}");
            assert!(out == want, "piece {piece}");
        }
    }
}
