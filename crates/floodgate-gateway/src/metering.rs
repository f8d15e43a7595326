//! Token metering: usage read from responses as they stream past (docs/design.md §6), and
//! charged once the body is done.
//!
//! - A JSON response's `usage` (`total_tokens`, else `prompt_tokens + completion_tokens`, or the
//!   Responses API's `input_tokens + output_tokens`) is read when the body ends. The body is
//!   forwarded frame by frame as it arrives; the frames are only kept (the first as a cheap
//!   `Bytes` clone, the rest copied into one buffer) to be parsed at the end.
//! - A server-sent event stream is forwarded event by event as soon as each event is complete;
//!   the last event carrying a `usage` gives the tokens. For a streaming request the gateway
//!   asks the upstream for that usage (`stream_options.include_usage = true`) and, if the caller
//!   did not ask for it, drops the usage-only chunk (`"choices": []`) so that the caller sees
//!   the stream it asked for.
//!
//! Tokens are charged by the [`Charger`] when the body is dropped (finished, or abandoned by
//! the caller), exactly once; so is the response's spend, for a chain with budgets (priced from
//! the input and output tokens and the model the response names, else the one the request
//! named). The body holds the charger's [`Held`] from the start, so that shutdown and tests can
//! wait for the charge. Metering never delays or cuts a response: a full token window only
//! refuses later requests.
//!
//! A caller that leaves once its answer is complete but before the usage has passed (a stream
//! whose choice has its `finish_reason`, the usage chunk still to come; a JSON body not all
//! read) leaves the gateway reading the rest from the upstream for up to [`LINGER`] and
//! [`LINGER_BYTES`], so that the usage is still charged; a stream abandoned mid-answer is cut at
//! once, so the upstream stops generating.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use floodgate::{Budgets, Chain};
use http_body::{Frame, SizeHint};

use crate::access_log::PendingLine;
use crate::charge::{BudgetReservation, Charger, Held, Reservation};
use crate::openai::sse::{AnswerEnd, SseFilter};
use crate::openai::usage::{Tail, TokenUsage, usage_and_model_from_json};
use crate::pricing::Prices;

/// Most bytes of a JSON response kept to read its `usage`; past this the response is forwarded
/// unmetered (and a warning logged).
const MAX_JSON_METERED: usize = 16 * 1024 * 1024;

/// How long the gateway goes on reading a finished answer's rest, for its usage, after the
/// caller left.
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(5);

/// How many bytes it reads then, at most.
pub const LINGER_BYTES: usize = 1024 * 1024;

/// How a response body is metered.
#[derive(Debug)]
pub enum Meter {
    /// Not metered: forwarded untouched.
    None,
    /// A JSON body: `usage` read at the end.
    Json,
    /// An event stream; `strip_usage` drops the usage-only chunk the caller did not ask for.
    Sse {
        /// Whether to drop the usage-only chunk.
        strip_usage: bool,
        /// What tells that its answer is complete, only its usage still to come.
        ends: AnswerEnd,
    },
}

/// What a response spends against: the chain's budgets, the price table, and the model the
/// request named (for a response that names none).
pub struct Spend {
    /// The chain's budgets.
    pub budgets: Arc<Budgets>,
    /// The price table.
    pub prices: Arc<Prices>,
    /// The request's `model`.
    pub request_model: Option<String>,
    /// What the request reserved on its enforced budgets, reconciled with the spend (then
    /// `budgets` holds only the shadow ones, charged the spend as usual).
    pub reserved: Option<BudgetReservation>,
}

/// A response body forwarded frame by frame while its usage is read; records the tokens (and
/// the spend, with budgets) and logs the request when dropped.
pub struct MeteredBody {
    inner: Body,
    mode: Mode,
    finished: bool,
    /// The rest of a body read on after its caller left (see [`LINGER`]); dropped, it charges
    /// what it read.
    caller_gone: bool,
    tokens: Option<u64>,
    usage: Option<TokenUsage>,
    model: Option<String>,
    charger: Charger,
    /// The chain to charge tokens to; `None` once handed on (to a rest read after the caller
    /// left) or charged.
    chain: Option<Arc<Chain>>,
    /// What the request reserved on the chain's reserving token limits, reconciled with the
    /// usage; kept whole if no usage comes.
    reservation: Option<Reservation>,
    /// Whether `tokens` is a count of a stream's chunks (it gave no usage) rather than its usage.
    counted: bool,
    /// Whether the upstream's body ended in an error: whatever it says after (hyper's body
    /// reads as ended once its sender is gone), it was cut, and no usage will come.
    broken: bool,
    spend: Option<Spend>,
    line: PendingLine,
    /// Tracks the charge still to come, from the body's start to the charge landing.
    held: Option<Held>,
    /// The upstream's trailers, held back while what the body read before them goes out.
    trailers: Option<Frame<Bytes>>,
}

/// A JSON body's frames, kept to read its usage at its end: the first as it came (a body
/// mostly comes in one, so that keeping it allocates nothing), the rest copied into one buffer
/// with it. Kept as they came, the frames of a body sent in many small pieces (a chunked body of
/// one-byte chunks) would each hold a handle and the upstream connection's read buffer it is a
/// slice of: many times the body's bytes (one of 15 MiB in one-byte chunks took 610 MiB), where
/// [`MAX_JSON_METERED`] counts the bytes alone.
#[derive(Default)]
struct Frames {
    first: Option<Bytes>,
    /// Every frame so far, the first included, once a second has come.
    joined: BytesMut,
}

impl Frames {
    fn push(&mut self, frame: Bytes) {
        match &self.first {
            None if self.joined.is_empty() => self.first = Some(frame),
            None => self.joined.extend_from_slice(&frame),
            Some(first) => {
                self.joined.reserve(first.len() + frame.len());
                self.joined.extend_from_slice(first);
                self.joined.extend_from_slice(&frame);
                self.first = None;
            }
        }
    }

    /// Whether no frame has come.
    fn is_empty(&self) -> bool {
        self.first.is_none() && self.joined.is_empty()
    }

    /// The frames so far as one body.
    fn whole(&self) -> &[u8] {
        self.first.as_deref().unwrap_or(&self.joined)
    }
}

enum Mode {
    Pass,
    Json {
        chunks: Frames,
        size: usize,
    },
    /// A JSON body too large to keep whole: its last bytes, where its usage is.
    JsonTail(Tail),
    Sse(SseFilter),
}

impl MeteredBody {
    /// Wraps `inner`; when metered, `charger` charges its tokens to `chain` (reconciling
    /// `reservation`, what the request reserved) and its spend to `spend`'s budgets, and `line`
    /// is written when it is done. The charge is tracked by `charger` from now on.
    pub fn new(
        inner: Body,
        meter: Meter,
        (charger, chain, reservation): (&Charger, Arc<Chain>, Option<Reservation>),
        spend: Option<Spend>,
        line: PendingLine,
    ) -> MeteredBody {
        let mode = match meter {
            Meter::None => Mode::Pass,
            Meter::Json => Mode::Json {
                chunks: Frames::default(),
                size: 0,
            },
            Meter::Sse { strip_usage, ends } => {
                let mut f = SseFilter::new(strip_usage);
                f.want_model = spend.is_some();
                f.ends = ends;
                Mode::Sse(f)
            }
        };
        MeteredBody {
            inner,
            mode,
            finished: false,
            caller_gone: false,
            tokens: None,
            usage: None,
            model: None,
            held: Some(charger.hold()),
            trailers: None,
            charger: charger.clone(),
            chain: Some(chain),
            reservation,
            counted: false,
            broken: false,
            spend,
            line,
        }
    }

    fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.parse_json();
    }

    fn parse_json(&mut self) {
        if let Mode::JsonTail(tail) = &mut self.mode {
            let usage = tail.usage();
            self.tokens = usage.map(|u| u.total);
            self.usage = usage;
            return;
        }
        if let Mode::Json { chunks, .. } = &mut self.mode {
            let (usage, model) = if chunks.is_empty() {
                (None, None)
            } else {
                usage_and_model_from_json(chunks.whole())
            };
            *chunks = Frames::default();
            self.tokens = usage.map(|u| u.total);
            self.usage = usage;
            self.model = model;
        }
    }

    /// Whether a body dropped now, before its end, has its usage still to come after an answer
    /// that is complete: a stream whose choice has finished, with no usage read yet; a JSON
    /// body of which only a part has passed (the upstream generated it whole already).
    fn usage_still_to_come(&self) -> bool {
        if self.finished || self.caller_gone || self.broken || self.chain.is_none() {
            return false;
        }
        match &self.mode {
            Mode::Pass => false,
            Mode::Json { chunks, .. } => {
                !chunks.is_empty() && usage_and_model_from_json(chunks.whole()).0.is_none()
            }
            // Its usage is at its end, still to come.
            Mode::JsonTail(_) => true,
            Mode::Sse(f) => f.answered && f.usage.is_none(),
        }
    }

    /// Hands what is left of this body (the upstream's rest, the meter, the charge, the log
    /// line) to a new one that reads on without a caller.
    fn take_rest(&mut self) -> MeteredBody {
        MeteredBody {
            inner: std::mem::replace(&mut self.inner, Body::empty()),
            mode: std::mem::replace(&mut self.mode, Mode::Pass),
            finished: false,
            caller_gone: true,
            tokens: self.tokens.take(),
            usage: self.usage.take(),
            model: self.model.take(),
            charger: self.charger.clone(),
            chain: self.chain.take(),
            reservation: self.reservation.take(),
            counted: self.counted,
            broken: self.broken,
            spend: self.spend.take(),
            line: self.line.clone(),
            held: self.held.take(),
            trailers: self.trailers.take(),
        }
    }
}

/// Reads `rest` to its end, for at most [`LINGER`] and [`LINGER_BYTES`], and drops it: what it
/// read is charged.
async fn linger(mut rest: MeteredBody) {
    let read_on = async {
        let mut read = 0;
        while let Some(Ok(frame)) =
            std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut rest), cx)).await
        {
            read += frame.data_ref().map_or(0, Bytes::len);
            if read > LINGER_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, read_on).await;
}

impl Drop for MeteredBody {
    fn drop(&mut self) {
        if self.usage_still_to_come()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            // The rest takes the charge's guard along: the charge is still tracked.
            runtime.spawn(linger(self.take_rest()));
            return;
        }
        // A caller that leaves early is charged the usage seen so far: a JSON body read whole
        // (only its end still to come) parses; one cut short does not, and charges nothing.
        self.finish();
        if let Mode::Sse(f) = &mut self.mode {
            self.tokens = f.tokens.or(self.tokens);
            self.usage = f.usage.or(self.usage);
            self.model = f.model.take().or(self.model.take());
            if self.tokens.is_none() && f.events > 0 {
                // A stream without its usage, cut before it or ended without one (an upstream
                // that ignores `include_usage`, an error event mid-answer, an Assistants run
                // stopped at `requires_action`): charged a token a chunk seen (about what the
                // upstream generated; the prompt, which it bills too, is not known), rather
                // than nothing, which a caller could have by hanging up just before the end,
                // and every stream of such an upstream would have.
                self.tokens = Some(f.events);
                self.counted = true;
                self.usage = Some(TokenUsage {
                    input: None,
                    output: Some(f.events),
                    total: f.events,
                });
            }
        }
        if let (Some(chain), Some(t)) = (self.chain.take(), self.tokens) {
            let spend = self.spend.take().zip(self.usage).map(|(spend, usage)| {
                let micro_usd = spend.prices.spend(
                    self.model.as_deref(),
                    spend.request_model.as_deref(),
                    &usage,
                );
                let reserved = spend.reserved.map(|r| {
                    let delta = r.delta(micro_usd, !self.counted);
                    (r, delta)
                });
                (micro_usd, spend.budgets, reserved)
            });
            let (micro_usd, budgets, reserved) =
                spend.map_or((0, None, None), |(m, b, r)| (m, Some(b), r));
            if let Some(usage) = &self.usage {
                self.charger.count_usage(usage);
            }
            // A reservation is reconciled with the usage; with a cut stream's count only if that
            // is more. A response with no usage (an upstream error, a body cut before any
            // chunk) never gets here: its reservation stays whole, towards stricter.
            let reconcile = self.reservation.take().map(|r| {
                let delta = r.delta(t, !self.counted);
                (r, delta)
            });
            self.charger.later(
                (Some(&chain), reconcile),
                t,
                (budgets.as_ref(), reserved),
                micro_usd,
                self.held.take(),
            );
        }
        self.line.write(self.tokens);
    }
}

impl http_body::Body for MeteredBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        loop {
            if let Some(trailers) = this.trailers.take() {
                return Poll::Ready(Some(Ok(trailers)));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                Some(Err(e)) => {
                    this.broken = true;
                    return Poll::Ready(Some(Err(e)));
                }
                None => {
                    let rest = match &mut this.mode {
                        Mode::Sse(f) => f.flush(),
                        _ => Bytes::new(),
                    };
                    this.finish();
                    if rest.is_empty() {
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(rest))));
                }
            };
            let data = match frame.into_data() {
                Ok(data) => data,
                Err(trailers) => {
                    // Trailers come last: the body is all here. An event the filter still holds
                    // (its final blank line never came) is read and goes out before them, as at
                    // the body's end: hyper sends nothing of a body after its trailers.
                    let rest = match &mut this.mode {
                        Mode::Sse(f) => f.flush(),
                        _ => Bytes::new(),
                    };
                    this.finish();
                    if rest.is_empty() {
                        return Poll::Ready(Some(Ok(trailers)));
                    }
                    this.trailers = Some(trailers);
                    return Poll::Ready(Some(Ok(Frame::data(rest))));
                }
            };
            match &mut this.mode {
                Mode::Pass => {}
                Mode::Json { chunks, size } => {
                    if *size + data.len() <= MAX_JSON_METERED {
                        *size += data.len();
                        chunks.push(data.clone());
                        // hyper stops polling a body that says it has ended: read the usage now.
                        if this.inner.is_end_stream() {
                            this.finish();
                        }
                    } else {
                        // Its usage is read from its last bytes (the model it names is not: the
                        // request's prices it).
                        tracing::warn!(
                            key = %this.line.key,
                            max_bytes = MAX_JSON_METERED,
                            "JSON response too large to hold: its usage is read from its end"
                        );
                        let mut tail = Tail::default();
                        tail.push(chunks.whole());
                        tail.push(&data);
                        this.mode = Mode::JsonTail(tail);
                        if this.inner.is_end_stream() {
                            this.finish();
                        }
                    }
                }
                Mode::JsonTail(tail) => {
                    tail.push(&data);
                    if this.inner.is_end_stream() {
                        this.finish();
                    }
                }
                Mode::Sse(f) => {
                    let out = f.push(data);
                    if out.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(out))));
                }
            }
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
    }

    fn is_end_stream(&self) -> bool {
        if self.trailers.is_some() {
            return false;
        }
        self.finished
            || match &self.mode {
                Mode::Sse(f) => f.pending.is_empty() && self.inner.is_end_stream(),
                _ => self.inner.is_end_stream(),
            }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.mode {
            // Dropping a chunk changes the length.
            Mode::Sse(_) => SizeHint::default(),
            _ => self.inner.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_of_many_small_frames_is_kept_in_one_buffer_of_its_bytes() {
        // An upstream's frames are slices of its connection's read buffer: a body in one-byte
        // chunks comes as a frame a byte.
        let read_buffer = Bytes::from(vec![b' '; 64 * 1024]);
        let mut frames = Frames::default();
        frames.push(Bytes::from_static(br#"{"usage":{"total_tokens":7}"#));
        for i in 0..10_000 {
            frames.push(read_buffer.slice(i..i + 1));
        }
        frames.push(Bytes::from_static(b"}"));
        // Kept as they came, they would hold the read buffer (and a handle each).
        assert!(
            read_buffer.is_unique(),
            "the frames hold the upstream's buffer"
        );
        assert_eq!(frames.whole().len(), 27 + 10_000 + 1);
        assert_eq!(
            usage_and_model_from_json(frames.whole()).0.unwrap().total,
            7
        );
    }

    #[test]
    fn a_body_of_one_frame_is_kept_as_it_came() {
        let body = Bytes::from_static(br#"{"usage":{"total_tokens":7}}"#);
        let mut frames = Frames::default();
        assert!(frames.is_empty());
        frames.push(body.clone());
        assert!(!frames.is_empty());
        assert_eq!(frames.whole().as_ptr(), body.as_ptr());
    }
}
