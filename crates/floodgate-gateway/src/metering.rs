//! Token metering: usage read from responses as they stream past, charged to the chain's token
//! limits once the body is done.
//!
//! - A JSON response's `usage` (`total_tokens`, else `prompt_tokens + completion_tokens`, or the
//!   Responses API's `input_tokens + output_tokens`) is read when the body ends. The body is
//!   forwarded frame by frame as it arrives; the frames are only kept (as cheap `Bytes` clones)
//!   to be parsed at the end.
//! - A server-sent event stream is forwarded event by event as soon as each event is complete;
//!   the last event carrying a `usage` gives the tokens. For a streaming request the gateway
//!   asks the upstream for that usage (`stream_options.include_usage = true`) and, if the caller
//!   did not ask for it, drops the usage-only chunk (`"choices": []`) so that the caller sees
//!   the stream it asked for.
//!
//! Tokens are recorded in a spawned task when the body is dropped (finished, or abandoned by the
//! caller), exactly once; so is the response's spend, for a chain with budgets (priced from the
//! input and output tokens and the model the response names, else the one the request named).
//! Metering never delays or cuts a response: a full token window only refuses later requests.
//!
//! A caller that leaves once its answer is complete but before the usage has passed (a stream
//! whose choice has its `finish_reason`, the usage chunk still to come; a JSON body not all
//! read) leaves the gateway reading the rest from the upstream for up to [`LINGER`] and
//! [`LINGER_BYTES`], so that the usage is still charged; a stream abandoned mid-answer is cut at
//! once, so the upstream stops generating.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Instant;

use axum::body::Body;
use axum::http::{Method, StatusCode, Uri};
use bytes::{Bytes, BytesMut};
use floodgate::{Budgets, Chain};
use http_body::{Frame, SizeHint};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use crate::budgets::{Prices, spend_later};
use crate::store::GatewayStore;

/// Most bytes of a JSON response kept to read its `usage`; past this the response is forwarded
/// unmetered (and a warning logged).
const MAX_JSON_METERED: usize = 16 * 1024 * 1024;

/// How long the gateway goes on reading a finished answer's rest, for its usage, after the
/// caller left.
pub const LINGER: std::time::Duration = std::time::Duration::from_secs(5);

/// How many bytes it reads then, at most.
pub const LINGER_BYTES: usize = 1024 * 1024;

/// The bodies of one worker still being read after their callers left (see [`LINGER`]): a
/// draining worker waits for them ([`Lingering::idle`]), so that what they read is charged
/// before its event loop stops.
#[derive(Clone, Debug, Default)]
pub struct Lingering(Arc<LingeringCount>);

#[derive(Debug, Default)]
struct LingeringCount {
    live: AtomicUsize,
    idle: tokio::sync::Notify,
}

/// One lingering body, counted while it lives.
struct LingerGuard(Lingering);

impl Lingering {
    fn start(&self) -> LingerGuard {
        self.0.live.fetch_add(1, Ordering::SeqCst);
        LingerGuard(self.clone())
    }

    /// Resolves once no body lingers.
    pub async fn idle(&self) {
        loop {
            let idle = self.0.idle.notified();
            if self.0.live.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }
}

impl Drop for LingerGuard {
    fn drop(&mut self) {
        if self.0.0.live.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.0.idle.notify_waiters();
        }
    }
}

#[derive(Deserialize)]
struct Usage {
    total_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

/// A response's token usage as metering read it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenUsage {
    /// Input tokens (`prompt_tokens` or `input_tokens`), if given.
    pub input: Option<u64>,
    /// Output tokens (`completion_tokens` or `output_tokens`), if given.
    pub output: Option<u64>,
    /// All tokens: what token limits are charged.
    pub total: u64,
}

impl Usage {
    fn detail(&self) -> TokenUsage {
        TokenUsage {
            input: self.input(),
            output: self.output(),
            total: self.total(),
        }
    }

    fn input(&self) -> Option<u64> {
        self.prompt_tokens.or(self.input_tokens)
    }

    fn output(&self) -> Option<u64> {
        self.completion_tokens.or(self.output_tokens)
    }

    fn total(&self) -> u64 {
        // The upstream's numbers: saturating (the store caps counts anyway). Without a total,
        // input plus output, each read once: an upstream that names both spellings
        // (`prompt_tokens` and `input_tokens`) is not charged twice.
        self.total_tokens.unwrap_or_else(|| {
            let (input, output) = (self.input().unwrap_or(0), self.output().unwrap_or(0));
            input.saturating_add(output)
        })
    }
}

/// The parts of a response body or stream chunk that metering reads; the rest is skipped.
#[derive(Deserialize)]
struct UsageCarrier {
    usage: Option<Usage>,
    /// Chat completion chunks: the usage-only chunk has no choices.
    choices: Option<Vec<IgnoredAny>>,
    /// Responses API events carry usage on the nested response.
    response: Option<Box<NestedResponse>>,
    /// The model that answered (what budgets price).
    model: Option<String>,
    /// What the body or event is: a run step's usage (`thread.run.step`) is a part of its run's,
    /// which the run's own completion event carries whole.
    object: Option<String>,
}

#[derive(Deserialize)]
struct NestedResponse {
    usage: Option<Usage>,
    model: Option<String>,
}

impl UsageCarrier {
    fn usage(&self) -> Option<TokenUsage> {
        if self.object.as_deref() == Some("thread.run.step") {
            // Charged with its run: a step's usage read too would count it twice (a stream
            // that ends at `requires_action` after a step, then the run's total at its end).
            return None;
        }
        self.usage
            .as_ref()
            .or_else(|| self.response.as_ref().and_then(|r| r.usage.as_ref()))
            .map(Usage::detail)
    }

    fn tokens(&self) -> Option<u64> {
        self.usage().map(|u| u.total)
    }

    fn into_model(self) -> Option<String> {
        self.model.or_else(|| self.response.and_then(|r| r.model))
    }
}

/// The tokens in a JSON response body's `usage`, if it has one.
pub fn usage_from_json(body: &[u8]) -> Option<u64> {
    serde_json::from_slice::<UsageCarrier>(body).ok()?.tokens()
}

/// A JSON response body's usage and the model it names, if any.
pub fn usage_and_model_from_json(body: &[u8]) -> (Option<TokenUsage>, Option<String>) {
    match serde_json::from_slice::<UsageCarrier>(body) {
        Ok(c) => (c.usage(), c.into_model()),
        Err(_) => (None, None),
    }
}

/// A streaming completion request, as the gateway forwards it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamRequest {
    /// Whether the caller itself asked for the usage chunk.
    pub caller_wants_usage: bool,
}

/// A JSON object's top-level fields in the order they came, each value kept as its raw text: a
/// request is rewritten without building a tree of its (possibly large) values.
struct TopLevel(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for TopLevel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = TopLevel;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<TopLevel, A::Error> {
                let mut fields = Vec::new();
                while let Some(field) = map.next_entry::<String, Box<RawValue>>()? {
                    fields.push(field);
                }
                Ok(TopLevel(fields))
            }
        }
        d.deserialize_map(Fields)
    }
}

/// A metered completion request, prepared for the upstream.
#[derive(Debug)]
pub struct Prepared {
    /// The body to forward.
    pub body: Bytes,
    /// For a streaming request, what the caller asked for.
    pub stream: Option<StreamRequest>,
    /// The `model` the request names (a string), which prices its spend when the response
    /// names none.
    pub model: Option<String>,
}

/// Prepares a metered completion request body: a streaming request (`"stream": true`) is
/// rewritten to ask the upstream for usage. Returns the body to forward, what a streaming
/// request's caller asked for, and (with `want_model`: for a chain with budgets) the model named.
///
/// Refused (the caller gets 400, nothing is charged) where the gateway cannot tell for sure
/// whether the upstream will stream, since a stream it did not ask usage for would go
/// uncharged: a body that is not a strict JSON object (a lenient upstream may still read one
/// with a byte-order mark or a `NaN` in it), a `stream` that is not `true`, `false` or `null`
/// (some servers take `1` or `"true"` for true), and a body that names `stream` or
/// `stream_options` twice (servers differ on which one counts).
pub fn prepare_request(body: Bytes, want_model: bool) -> Result<Prepared, String> {
    let Ok(TopLevel(fields)) = serde_json::from_slice::<TopLevel>(&body) else {
        return Err("The request body is not a JSON object.".into());
    };
    let field = |name: &str| unique_field(&fields, name);
    let stream = field("stream")?;
    let options = field("stream_options")?;
    // Read only to price a response that names no model: a duplicate or a non-string is no
    // model rather than an error.
    let model = if want_model {
        field("model")
            .ok()
            .flatten()
            .and_then(|m| serde_json::from_str::<String>(m.get()).ok())
    } else {
        None
    };
    match stream.map(RawValue::get) {
        Some("true") => {}
        None | Some("false" | "null") => {
            return Ok(Prepared {
                body,
                stream: None,
                model,
            });
        }
        Some(_) => return Err("`stream` must be true or false.".into()),
    }
    // The caller's options, with include_usage set; each field once (a duplicate
    // include_usage would leave the choice to the upstream's parser).
    let mut opts: serde_json::Map<String, serde_json::Value> = options
        .and_then(|o| serde_json::from_str(o.get()).ok())
        .unwrap_or_default();
    let asked = StreamRequest {
        caller_wants_usage: opts.get("include_usage") == Some(&serde_json::Value::Bool(true)),
    };
    opts.insert("include_usage".into(), serde_json::Value::Bool(true));
    let opts = serde_json::to_string(&opts).map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(body.len() + 32);
    out.push(b'{');
    for (k, v) in &fields {
        if k == "stream_options" {
            continue;
        }
        if out.len() > 1 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, k).map_err(|e| e.to_string())?;
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
    }
    if out.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(b"\"stream_options\":");
    out.extend_from_slice(opts.as_bytes());
    out.push(b'}');
    Ok(Prepared {
        body: Bytes::from(out),
        stream: Some(asked),
        model,
    })
}

/// The top-level field `name` of a request body, if present; an error (for a 400) if it is
/// named twice, since servers differ on which one counts.
fn unique_field<'a>(
    fields: &'a [(String, Box<RawValue>)],
    name: &str,
) -> Result<Option<&'a RawValue>, String> {
    let mut found = fields.iter().filter(|(k, _)| k == name);
    let first = found.next().map(|(_, v)| &**v);
    match found.next() {
        Some(_) => Err(format!(
            "The request body has more than one `{name}` field."
        )),
        None => Ok(first),
    }
}

/// Checks a metered Responses API create body. Refused (the caller gets 400, nothing is
/// charged): a background response (`"background": true`), which is answered at once without
/// usage and finishes later, its usage then only in fetches of the stored response, which are
/// never charged (see [`is_generating_request`]): the gateway could not charge it at all. Also
/// refused, as for completions, where the upstream's reading is not certain: a body that is not
/// a strict JSON object, a `background` other than `true`, `false` or `null`, or one named
/// twice. The body is forwarded as sent.
pub fn check_responses_request(body: &[u8]) -> Result<(), String> {
    let Ok(TopLevel(fields)) = serde_json::from_slice::<TopLevel>(body) else {
        return Err("The request body is not a JSON object.".into());
    };
    match unique_field(&fields, "background")?.map(RawValue::get) {
        None | Some("false" | "null") => Ok(()),
        Some("true") => Err(
            "Background responses are not available through this gateway: their tokens could \
             not be counted against your limits. Send the request without `background`."
                .into(),
        ),
        Some(_) => Err("`background` must be true or false.".into()),
    }
}

/// Whether a request path names a completion endpoint (`.../completions`), as a lenient
/// upstream may read it: percent-escapes decoded (`/v1/chat/completion%73`), in any case
/// (`/v1/chat/Completions`), with trailing slashes (`/v1/chat/completions/`) or empty segments,
/// with backslashes for slashes (as the dot-segment check takes them), and with path
/// parameters (`/v1/chat/completions;v=1`: servlet containers and some routers drop a
/// segment's `;...`). A path taken for a completion that is not one only has its body
/// checked.
pub fn is_completion_path(path: &str) -> bool {
    with_segments(path, |s| {
        s.next_back()
            .is_some_and(|l| l.eq_ignore_ascii_case(b"completions"))
    })
}

/// Whether a request path names the Responses API's create endpoint (`.../responses`), read as
/// [`is_completion_path`] reads a path.
pub fn is_responses_path(path: &str) -> bool {
    with_segments(path, |s| {
        s.next_back()
            .is_some_and(|l| l.eq_ignore_ascii_case(b"responses"))
    })
}

/// Whether the usage in the answer to this request is charged: a `POST`, except one that acts
/// on a stored object. Such answers carry the usage of work done, and charged, before: a stored
/// response, chat completion, run or batch fetched (`GET /v1/responses/{id}`, also as a resumed
/// stream), cancelled (`POST /v1/responses/{id}/cancel`, any `.../cancel`) or updated
/// (`POST /v1/chat/completions/{id}`, `POST /v1/threads/{t}/runs/{r}`: a segment after
/// `completions`, `responses`, `runs` or `batches` names a stored one). Charging those would
/// charge the same tokens at every fetch. Every other `POST` is charged the usage its answer
/// carries (chat completions, responses, embeddings, audio, images, streamed runs and their
/// `submit_tool_outputs`, a response's `compact`, other APIs an upstream serves).
pub fn is_generating_request(method: &Method, path: &str) -> bool {
    const STORED: [&[u8]; 4] = [b"completions", b"responses", b"runs", b"batches"];
    // The creates themselves, however the path starts (read as `is_completion_path` reads it,
    // so a body rewritten to ask for usage always has its answer read), and the actions on a
    // stored one that make the upstream generate: a run's tool outputs, a response's
    // compaction.
    const GENERATE: [&[u8]; 4] = [
        b"completions",
        b"responses",
        b"submit_tool_outputs",
        b"compact",
    ];
    let named =
        |segment: &[u8], names: &[&[u8]]| names.iter().any(|n| segment.eq_ignore_ascii_case(n));
    method == Method::POST
        && with_segments(path, |s| {
            let Some(last) = s.next_back() else {
                return true;
            };
            if named(last, &GENERATE) {
                return true;
            }
            if named(last, &[b"cancel"]) {
                return false;
            }
            // A segment after a stored collection's name names a stored one.
            for segment in &mut *s {
                if named(segment, &STORED) {
                    return false;
                }
            }
            true
        })
}

/// `f` of the path's non-empty segments, read as a lenient upstream may read them (see
/// [`is_completion_path`]): percent-escapes decoded, `\\` taken for `/`, each segment's `;`
/// parameters dropped. `false` for a path that does not start with `/`. Nothing is allocated
/// for a path without percent-escapes.
fn with_segments(
    path: &str,
    f: impl FnOnce(&mut dyn DoubleEndedIterator<Item = &[u8]>) -> bool,
) -> bool {
    let decoded = percent_decoded(path.as_bytes());
    let mut segments = decoded
        .split(|&b| b == b'/' || b == b'\\')
        .map(|segment| segment.split(|&b| b == b';').next().unwrap_or_default())
        .filter(|segment| !segment.is_empty());
    decoded.starts_with(b"/") && f(&mut segments)
}

/// `raw` with its percent-escapes decoded (once; a `%` not followed by two hex digits is kept);
/// borrowed when it has none.
pub(crate) fn percent_decoded(raw: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if !raw.contains(&b'%') {
        return std::borrow::Cow::Borrowed(raw);
    }
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            raw[i],
            raw.get(i + 1).copied().and_then(hex),
            raw.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                decoded.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, ..) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    std::borrow::Cow::Owned(decoded)
}

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
    },
}

/// What is logged when a request's response is done.
#[derive(Clone, Debug)]
pub struct RequestLog {
    /// The key's id.
    pub key: Arc<str>,
    /// The request method.
    pub method: Method,
    /// The request URI (path and query; never headers).
    pub uri: Uri,
    /// The response status.
    pub status: StatusCode,
    /// When the request arrived.
    pub start: Instant,
    /// `admitted`, `unenforced` (store failed open), ...
    pub decision: &'static str,
}

/// Whether [`RequestLog::emit`]'s line would be written (`RUST_LOG` lets `info` of this module
/// through). Asked in this module so that a per-module filter sees the same target.
pub fn request_log_enabled() -> bool {
    tracing::enabled!(tracing::Level::INFO)
}

impl RequestLog {
    /// Logs the request's one line.
    pub fn emit(&self, tokens: Option<u64>) {
        tracing::info!(
            key = %self.key,
            method = %self.method,
            path = self.uri.path(),
            status = self.status.as_u16(),
            latency_ms = crate::app::latency_ms(self.start),
            decision = self.decision,
            tokens,
            "request"
        );
    }
}

/// Charges `tokens` to `chain`'s token limits, in the background, once.
pub fn record_later(store: &GatewayStore, chain: &Arc<Chain>, tokens: u64) {
    if tokens == 0 || !chain.has_reactive() {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(tokens, "no runtime to record tokens on: dropped");
        return;
    };
    let store = store.clone();
    let chain = Arc::clone(chain);
    rt.spawn(async move { record_now(&store, &chain, tokens).await });
}

/// Charges `tokens` to `chain`'s token limits now, once; a failure is logged, not returned
/// (the response or session it came from is over, or must not be held up by it).
pub async fn record_now(store: &GatewayStore, chain: &Chain, tokens: u64) {
    if tokens == 0 || !chain.has_reactive() {
        return;
    }
    match chain.record(store, tokens).await {
        Ok(()) => {}
        // The store logs an outage (or a dropped connection) once; a line for every
        // metered response would flood the log for as long as it lasts.
        Err(e @ floodgate::Error::Unavailable(_)) => {
            tracing::debug!(error = %e, tokens, "could not record tokens");
        }
        Err(e) => tracing::warn!(error = %e, tokens, "could not record tokens"),
    }
}

/// A Realtime API server event, as far as metering reads it.
#[derive(Deserialize)]
struct RealtimeEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
    response: Option<NestedResponse>,
}

/// The tokens of a Realtime API `response.done` event (a text message of the session):
/// `response.usage`, as `total_tokens`, else `input_tokens + output_tokens`. `None` for any other
/// event, and for one that is not JSON.
pub fn response_done_tokens(message: &[u8]) -> Option<u64> {
    response_done_usage(message).map(|u| u.total)
}

/// The usage of a Realtime API `response.done` event (input, output and total tokens), if
/// `message` is one and carries it.
pub fn response_done_usage(message: &[u8]) -> Option<TokenUsage> {
    let event: RealtimeEvent<'_> = serde_json::from_slice(message).ok()?;
    if event.kind != "response.done" {
        return None;
    }
    event.response?.usage.as_ref().map(Usage::detail)
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
    charge: Option<(GatewayStore, Arc<Chain>)>,
    spend: Option<Spend>,
    log: RequestLog,
    /// Where a lingering rest of this body is counted.
    linger_count: Lingering,
}

enum Mode {
    Pass,
    Json { chunks: Vec<Bytes>, size: usize },
    Sse(SseFilter),
}

impl MeteredBody {
    /// Wraps `inner`; tokens go to `chain` on `store` when metered, and spend to `spend`'s
    /// budgets. A rest read after the caller left is counted in `lingering`.
    pub fn new(
        inner: Body,
        meter: Meter,
        (store, chain): (GatewayStore, Arc<Chain>),
        spend: Option<Spend>,
        log: RequestLog,
        lingering: &Lingering,
    ) -> MeteredBody {
        let mode = match meter {
            Meter::None => Mode::Pass,
            Meter::Json => Mode::Json {
                chunks: Vec::new(),
                size: 0,
            },
            Meter::Sse { strip_usage } => {
                let mut f = SseFilter::new(strip_usage);
                f.want_model = spend.is_some();
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
            charge: Some((store, chain)),
            spend,
            log,
            linger_count: lingering.clone(),
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
        if let Mode::Json { chunks, .. } = &mut self.mode {
            let (usage, model) = match chunks.len() {
                0 => (None, None),
                1 => usage_and_model_from_json(&chunks[0]),
                _ => usage_and_model_from_json(&chunks.concat()),
            };
            chunks.clear();
            self.tokens = usage.map(|u| u.total);
            self.usage = usage;
            self.model = model;
        }
    }

    /// Whether a body dropped now, before its end, has its usage still to come after an answer
    /// that is complete: a stream whose choice has finished, with no usage read yet; a JSON
    /// body of which only a part has passed (the upstream generated it whole already).
    fn usage_still_to_come(&self) -> bool {
        if self.finished || self.caller_gone || self.charge.is_none() {
            return false;
        }
        match &self.mode {
            Mode::Pass => false,
            Mode::Json { chunks, .. } => {
                !chunks.is_empty() && usage_and_model_from_json(&chunks.concat()).0.is_none()
            }
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
            charge: self.charge.take(),
            spend: self.spend.take(),
            log: self.log.clone(),
            linger_count: self.linger_count.clone(),
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
            let counted = self.linger_count.start();
            let rest = self.take_rest();
            runtime.spawn(async move {
                linger(rest).await;
                drop(counted);
            });
            return;
        }
        // Cut before the upstream's end (the caller left mid-answer, the linger's bounds ran
        // out, the upstream broke off).
        let cut = !self.finished && !http_body::Body::is_end_stream(&self.inner);
        // A caller that leaves early is charged the usage seen so far: a JSON body read whole
        // (only its end still to come) parses; one cut short does not, and charges nothing.
        self.finish();
        if let Mode::Sse(f) = &mut self.mode {
            self.tokens = f.tokens.or(self.tokens);
            self.usage = f.usage.or(self.usage);
            self.model = f.model.take().or(self.model.take());
            if cut && self.tokens.is_none() && f.events > 0 {
                // A stream cut before its usage: charged a token a chunk seen (about what the
                // upstream generated; the prompt, which it bills too, is not known), rather
                // than nothing, which a caller could have by hanging up just before the end.
                self.tokens = Some(f.events);
                self.usage = Some(TokenUsage {
                    input: None,
                    output: Some(f.events),
                    total: f.events,
                });
            }
        }
        if let (Some((store, chain)), Some(t)) = (self.charge.take(), self.tokens) {
            if let (Some(spend), Some(usage)) = (self.spend.take(), self.usage) {
                let model = self.model.as_deref().or(spend.request_model.as_deref());
                let micro_usd = spend.prices.spend(model, &usage);
                spend_later(&store, &spend.budgets, micro_usd);
            }
            record_later(&store, &chain, t);
        }
        self.log.emit(self.tokens);
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
            if this.finished {
                return Poll::Ready(None);
            }
            let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
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
                Err(trailers) => return Poll::Ready(Some(Ok(trailers))),
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
                        tracing::warn!(key = %this.log.key, "JSON response too large to meter");
                        this.mode = Mode::Pass;
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

/// Most bytes of one event held back to inspect it whole. A larger event (an image in base64,
/// say) is forwarded as it arrives, uninspected, and filtering resumes with the next event.
const MAX_SSE_EVENT: usize = 8 * 1024 * 1024;

/// Splits an event stream into whole events, reads usage, drops the usage-only chunk on demand.
struct SseFilter {
    /// The start of an event not yet complete. (While `oversized`: only the last few bytes, to
    /// find the event's end if it straddles two frames.)
    pending: BytesMut,
    /// How much of `pending` holds no event end: a later search starts near there, so each byte
    /// is searched about once however the stream is split.
    searched: usize,
    /// Forwarding an event too large to hold until its end.
    oversized: bool,
    strip_usage: bool,
    tokens: Option<u64>,
    /// The last usage read, in detail (what budgets price).
    usage: Option<TokenUsage>,
    /// Whether to look for the model that answered (budgets price by it).
    want_model: bool,
    /// The model named by the stream's chunks: the usage chunk's, else the first named.
    model: Option<String>,
    /// Whether a chunk has given a choice its `finish_reason`: the answer is complete, and only
    /// the usage chunk (and `[DONE]`) may follow.
    answered: bool,
    /// Data events seen, `[DONE]` aside: what a stream cut before its usage is charged, as
    /// tokens (a chunk carries about one).
    events: u64,
}

/// Whether an event carries data other than the stream's `[DONE]` (a comment or a bare
/// `event:` line does not).
fn is_data_event(event: &[u8]) -> bool {
    event
        .split(|&b| b == b'\n' || b == b'\r')
        .filter_map(|line| line.strip_prefix(b"data:"))
        .any(|data| data.trim_ascii() != b"[DONE]")
}

/// The length of the line terminator at `buf[i]`: CRLF, LF or CR (the event stream format allows
/// all three); `Some(0)` if none starts there; `None` if it cannot be told yet (the buffer ends
/// there, or ends after a CR that a LF may follow).
fn terminator(buf: &[u8], i: usize) -> Option<usize> {
    match buf.get(i)? {
        b'\n' => Some(1),
        b'\r' => match buf.get(i + 1)? {
            b'\n' => Some(2),
            _ => Some(1),
        },
        _ => Some(0),
    }
}

/// The end (exclusive) of the first complete event in `buf`: the index after the blank line
/// (two line terminators in a row) that ends it.
fn event_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    loop {
        let line_end = i + buf[i..].iter().position(|&b| b == b'\n' || b == b'\r')?;
        let next = line_end + terminator(buf, line_end)?;
        match terminator(buf, next)? {
            0 => i = next,
            blank => return Some(next + blank),
        }
    }
}

/// The end of the last complete event in `buf[from..]`, as an index into `buf` (0 if none).
fn last_event_end(buf: &[u8], from: usize) -> usize {
    let (mut end, mut at) = (0, from);
    while let Some(e) = event_end(&buf[at..]) {
        end = at + e;
        at = end;
    }
    end
}

/// How far back a search resumes: a blank line's terminators, split by a frame boundary.
const TERMINATOR_LOOKBACK: usize = 3;

impl SseFilter {
    fn new(strip_usage: bool) -> SseFilter {
        SseFilter {
            pending: BytesMut::new(),
            searched: 0,
            oversized: false,
            strip_usage,
            tokens: None,
            usage: None,
            want_model: false,
            model: None,
            answered: false,
            events: 0,
        }
    }

    /// Takes the next bytes of the stream; returns what to forward now: the complete events
    /// among them (possibly none), filtered.
    fn push(&mut self, data: Bytes) -> Bytes {
        if self.oversized {
            return self.push_oversized(data);
        }
        if self.pending.is_empty() {
            let end = last_event_end(&data, 0);
            self.pending.extend_from_slice(&data[end..]);
            self.searched = self.pending.len();
            let out = self.filter(data.slice(..end));
            if self.pending.len() > MAX_SSE_EVENT {
                return self.overflow(out);
            }
            return out;
        }
        self.pending.extend_from_slice(&data);
        let end = last_event_end(
            &self.pending,
            self.searched.saturating_sub(TERMINATOR_LOOKBACK),
        );
        let complete = self.pending.split_to(end).freeze();
        self.searched = self.pending.len();
        let out = self.filter(complete);
        if self.pending.len() > MAX_SSE_EVENT {
            return self.overflow(out);
        }
        out
    }

    /// The event in `pending` is too large to hold: forwards it (after `out`) as it is and what
    /// follows of it as it comes, keeping only a tail to find its end.
    fn overflow(&mut self, out: Bytes) -> Bytes {
        tracing::warn!(
            max_bytes = MAX_SSE_EVENT,
            "event stream: an event too large to inspect is forwarded as it comes"
        );
        self.oversized = true;
        let held = self.pending.split().freeze();
        let mut joined = BytesMut::with_capacity(out.len() + held.len());
        joined.extend_from_slice(&out);
        joined.extend_from_slice(&held);
        self.keep_tail(&held);
        joined.freeze()
    }

    fn keep_tail(&mut self, forwarded: &[u8]) {
        let tail = &forwarded[forwarded.len().saturating_sub(TERMINATOR_LOOKBACK)..];
        self.pending.clear();
        self.pending.extend_from_slice(tail);
    }

    /// Forwards the rest of an oversized event as it comes; once it ends, filtering resumes.
    fn push_oversized(&mut self, data: Bytes) -> Bytes {
        // The tail of what was forwarded, then the new bytes: where does the event end?
        let tail = self.pending.len();
        let mut window = BytesMut::with_capacity(tail + data.len());
        window.extend_from_slice(&self.pending);
        window.extend_from_slice(&data);
        match event_end(&window) {
            None => {
                self.keep_tail(&window);
                data
            }
            Some(e) => {
                // The tail alone held no event end (at most an undecided one ending with it).
                let split = e.saturating_sub(tail);
                self.oversized = false;
                self.pending.clear();
                self.searched = 0;
                let rest = self.push(data.slice(split..));
                let mut out = BytesMut::with_capacity(split + rest.len());
                out.extend_from_slice(&data[..split]);
                out.extend_from_slice(&rest);
                out.freeze()
            }
        }
    }

    /// What is left when the stream ends (an event without its final blank line).
    fn flush(&mut self) -> Bytes {
        if self.oversized {
            // Its bytes went out already; `pending` only held a copy of the tail.
            self.pending.clear();
            return Bytes::new();
        }
        let rest = self.pending.split().freeze();
        self.filter(rest)
    }

    /// Forwards whole events, inspecting those that mention `usage`.
    fn filter(&mut self, events: Bytes) -> Bytes {
        let mut out: Option<BytesMut> = None;
        let mut start = 0;
        while start < events.len() {
            let end = event_end(&events[start..]).map_or(events.len(), |e| start + e);
            let event = &events[start..end];
            let action = self.inspect(event);
            if out.is_none() && !matches!(action, Action::Keep) {
                // The first change: copy what came before, then build the rest.
                let mut b = BytesMut::with_capacity(events.len());
                b.extend_from_slice(&events[..start]);
                out = Some(b);
            }
            if let Some(b) = &mut out {
                match action {
                    Action::Keep => b.extend_from_slice(event),
                    Action::Drop => {}
                    Action::StripNullUsage(fields) => strip_null_usage(event, &fields, b),
                }
            }
            start = end;
        }
        out.map_or(events, BytesMut::freeze)
    }

    /// Reads an event's usage; says what to forward.
    fn inspect(&mut self, event: &[u8]) -> Action {
        if is_data_event(event) {
            self.events += 1;
        }
        if !self.answered {
            self.answered = has_finish_reason(event);
        }
        if self.want_model && self.model.is_none() {
            // Until one chunk names it: the first chunk usually does, so this is one search.
            self.model = model_in(event);
        }
        let fields = usage_fields(event);
        if fields.is_empty() {
            return Action::Keep;
        }
        // With include_usage, every chunk carries `"usage": null`; a caller that did not ask
        // for usage would not have seen that field. (JSON may put spaces around the colon.)
        if self.strip_usage && !fields.iter().any(|f| event[f.value] == b'{') {
            return if fields.iter().any(|f| f.is_null(event)) {
                Action::StripNullUsage(fields)
            } else {
                Action::Keep
            };
        }
        let mut data: Vec<u8> = Vec::new();
        for line in event.split(|&b| b == b'\n' || b == b'\r') {
            if let Some(payload) = line.strip_prefix(b"data:") {
                if !data.is_empty() {
                    data.push(b'\n');
                }
                data.extend_from_slice(payload.strip_prefix(b" ").unwrap_or(payload));
            }
        }
        let Ok(chunk) = serde_json::from_slice::<UsageCarrier>(&data) else {
            return Action::Keep;
        };
        let Some(usage) = chunk.usage() else {
            return Action::Keep;
        };
        self.tokens = Some(usage.total);
        self.usage = Some(usage);
        let usage_only = chunk.choices.as_ref().is_none_or(Vec::is_empty) && chunk.usage.is_some();
        if self.want_model
            && let Some(model) = chunk.into_model()
        {
            // The usage chunk's model wins: it is the one the usage is of.
            self.model = Some(model);
        }
        if self.strip_usage && usage_only {
            Action::Drop
        } else {
            Action::Keep
        }
    }
}

/// What to do with one event.
enum Action {
    Keep,
    Drop,
    /// Drop the `"usage": null` fields among these (found by `inspect`, not searched again).
    StripNullUsage(Vec<UsageField>),
}

/// A `"usage": value` field found in an event's bytes.
struct UsageField {
    /// Where the `"usage"` key starts.
    key: usize,
    /// Where its value starts.
    value: usize,
}

impl UsageField {
    fn is_null(&self, event: &[u8]) -> bool {
        event[self.value..].starts_with(b"null")
    }
}

const USAGE_KEY: &[u8] = b"\"usage\"";
const FINISH_REASON_KEY: &[u8] = b"\"finish_reason\"";

/// Whether `event` has a `"finish_reason"` whose value is a string (not `null`): a choice of the
/// answer is complete.
fn has_finish_reason(event: &[u8]) -> bool {
    fields(event, FINISH_REASON_KEY).any(|(_, value)| event.get(value) == Some(&b'"'))
}

/// Each `key` in `event` that a colon follows (any spacing, any nesting), as the positions of
/// the key and of its value (`event.len()` if the event ends there). (A key inside a string
/// value has its quotes escaped, so it is not found.)
fn fields<'a>(event: &'a [u8], key: &'a [u8]) -> impl Iterator<Item = (usize, usize)> + 'a {
    let mut from = 0;
    std::iter::from_fn(move || {
        while let Some(p) = find(&event[from..], key) {
            let at = from + p;
            from = at + key.len();
            let colon = skip_space(event, from);
            if event.get(colon) == Some(&b':') {
                return Some((at, skip_space(event, colon + 1)));
            }
        }
        None
    })
}
const MODEL_KEY: &[u8] = b"\"model\"";

/// The string value of the first `"model"` field in `event` (any nesting, any spacing), if any.
/// (A `"model"` inside a string value has its quotes escaped, so it is not found.)
fn model_in(event: &[u8]) -> Option<String> {
    let (_, value) = fields(event, MODEL_KEY).next()?;
    if event.get(value) != Some(&b'"') {
        return None;
    }
    // The closing quote: the first one not escaped.
    let mut i = value + 1;
    while i < event.len() {
        match event[i] {
            b'\\' => i += 2,
            b'"' => return serde_json::from_slice(&event[value..=i]).ok(),
            _ => i += 1,
        }
    }
    None
}

fn skip_space(buf: &[u8], mut i: usize) -> usize {
    while buf
        .get(i)
        .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
    {
        i += 1;
    }
    i
}

/// Every `"usage"` followed by a colon in `event`: a field, with any spacing JSON allows. (A
/// `"usage"` inside a string value has its quotes escaped, so it is not found.)
fn usage_fields(event: &[u8]) -> Vec<UsageField> {
    fields(event, USAGE_KEY)
        .filter(|&(_, value)| value < event.len())
        .map(|(key, value)| UsageField { key, value })
        .collect()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Appends `event` to `out` without its `"usage": null` fields among `fields` (and the comma
/// that joined each to its neighbour).
fn strip_null_usage(event: &[u8], fields: &[UsageField], out: &mut BytesMut) {
    let mut kept = 0;
    for f in fields.iter().filter(|f| f.is_null(event)) {
        let end = f.value + b"null".len();
        // `, "usage": null`: from the comma before it; `{"usage": null, ...`: to the comma after.
        let before = event[..f.key].iter().rposition(|b| !b" \t\r\n".contains(b));
        let (from, to) = match before {
            Some(c) if event[c] == b',' => (c, end),
            _ => {
                let after = skip_space(event, end);
                match event.get(after) {
                    Some(b',') => (f.key, skip_space(event, after + 1)),
                    _ => (f.key, end),
                }
            }
        };
        if from < kept {
            continue;
        }
        out.extend_from_slice(&event[kept..from]);
        kept = to;
    }
    out.extend_from_slice(&event[kept..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_choice_is_found_at_any_spacing_and_null_is_not_one() {
        assert!(has_finish_reason(
            br#"data: {"choices":[{"delta":{},"finish_reason":"stop"}]}"#
        ));
        assert!(has_finish_reason(br#"data: {"finish_reason" : "length"}"#));
        assert!(!has_finish_reason(br#"data: {"finish_reason":null}"#));
        assert!(!has_finish_reason(
            br#"data: {"delta":{"content":"say \"finish_reason\":\"stop\""},"finish_reason":null}"#
        ));
    }

    #[test]
    fn usage_from_bodies() {
        assert_eq!(usage_from_json(br#"{"usage":{"total_tokens":7}}"#), Some(7));
        assert_eq!(
            usage_from_json(br#"{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":4}}"#),
            Some(7)
        );
        assert_eq!(usage_from_json(br#"{"error":{}}"#), None);
        let huge = format!(
            r#"{{"usage":{{"prompt_tokens":{},"completion_tokens":9}}}}"#,
            u64::MAX
        );
        assert_eq!(usage_from_json(huge.as_bytes()), Some(u64::MAX));
        assert_eq!(usage_from_json(b"not json"), None);
        // Both spellings of one count, without a total: each count once, as budgets price it.
        let both = br#"{"usage":{"prompt_tokens":10,"completion_tokens":5,"input_tokens":10,"output_tokens":5}}"#;
        assert_eq!(usage_from_json(both), Some(15));
        let (usage, _) = usage_and_model_from_json(both);
        assert_eq!(
            usage,
            Some(TokenUsage {
                input: Some(10),
                output: Some(5),
                total: 15
            })
        );
        assert_eq!(
            usage_from_json(br#"{"usage":{"input_tokens":2,"output_tokens":3}}"#),
            Some(5)
        );
        // A run step's usage is part of its run's, charged when the run completes.
        let step = br#"{"object":"thread.run.step","usage":{"total_tokens":9}}"#;
        assert_eq!(usage_from_json(step), None);
        let run = br#"{"object":"thread.run","usage":{"total_tokens":9}}"#;
        assert_eq!(usage_from_json(run), Some(9));
    }

    #[test]
    fn usage_in_detail_and_the_model_from_bodies_and_requests() {
        let (usage, model) = usage_and_model_from_json(
            br#"{"model":"gpt-4o-mini-2024-07-18","usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
        );
        assert_eq!(
            usage,
            Some(TokenUsage {
                input: Some(3),
                output: Some(4),
                total: 7
            })
        );
        assert_eq!(model.as_deref(), Some("gpt-4o-mini-2024-07-18"));
        // The Responses API: usage and model on the nested response.
        let (usage, model) = usage_and_model_from_json(
            br#"{"type":"response.completed","response":{"model":"o3","usage":{"input_tokens":1,"output_tokens":2,"total_tokens":3}}}"#,
        );
        assert_eq!(usage.map(|u| (u.input, u.output)), Some((Some(1), Some(2))));
        assert_eq!(model.as_deref(), Some("o3"));
        let (usage, model) = usage_and_model_from_json(br#"{"usage":{"total_tokens":9}}"#);
        assert_eq!(
            usage,
            Some(TokenUsage {
                input: None,
                output: None,
                total: 9
            })
        );
        assert_eq!(model, None);
        let body = Bytes::from_static(br#"{"model":"gpt-4o","stream":true}"#);
        let p = prepare_request(body.clone(), true).unwrap();
        assert_eq!(p.model.as_deref(), Some("gpt-4o"));
        assert_eq!(
            prepare_request(body, false).unwrap().model,
            None,
            "not asked for"
        );
        let p = prepare_request(Bytes::from_static(br#"{"model":7}"#), true).unwrap();
        assert_eq!(p.model, None);
        // A model in a stream: any chunk's, with any spacing; not one inside a string.
        assert_eq!(
            model_in(br#"data: {"id":"x", "model" : "gpt-4o-mini"}"#).as_deref(),
            Some("gpt-4o-mini")
        );
        assert_eq!(model_in(br#"data: {"content":"\"model\": \"x\""}"#), None);
        assert_eq!(
            model_in(br#"data: {"model":"a\"b"}"#).as_deref(),
            Some("a\"b")
        );
    }

    #[test]
    fn usage_from_realtime_events() {
        let done = br#"{"event_id":"e1","type":"response.done","response":{"id":"r","output":[{"type":"message"}],"usage":{"total_tokens":42,"input_tokens":30,"output_tokens":12}}}"#;
        assert_eq!(response_done_tokens(done), Some(42));
        let parts =
            br#"{"type":"response.done","response":{"usage":{"input_tokens":5,"output_tokens":6}}}"#;
        assert_eq!(response_done_tokens(parts), Some(11));
        // Escaped, still the same type.
        let escaped = br#"{"type":"response\u002edone","response":{"usage":{"total_tokens":3}}}"#;
        assert_eq!(response_done_tokens(escaped), Some(3));
        // Other events carry usage-like fields too; only a finished response counts.
        let other = br#"{"type":"response.created","response":{"usage":{"total_tokens":9}}}"#;
        assert_eq!(response_done_tokens(other), None);
        let no_usage = br#"{"type":"response.done","response":{"usage":null}}"#;
        assert_eq!(response_done_tokens(no_usage), None);
        assert_eq!(response_done_tokens(b"response.done"), None);
        assert_eq!(response_done_tokens(br#"{"type":7}"#), None);
    }

    #[test]
    fn stream_requests_ask_for_usage() {
        let ask = |body: &'static [u8]| {
            prepare_request(Bytes::from_static(body), false).map(|p| (p.body, p.stream))
        };
        let (b, s) = ask(br#"{"stream":true,"model":"m"}"#).unwrap();
        assert_eq!(
            s,
            Some(StreamRequest {
                caller_wants_usage: false
            })
        );
        assert_eq!(
            &b[..],
            br#"{"stream":true,"model":"m","stream_options":{"include_usage":true}}"#
        );
        let (b, s) =
            ask(br#"{"stream": true, "stream_options": {"include_usage": true}}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(
            s,
            Some(StreamRequest {
                caller_wants_usage: true
            })
        );
        // Other options stay; a non-object is replaced.
        let (b, _) =
            ask(br#"{"stream_options":{"x":1,"include_usage":false},"stream":true}"#).unwrap();
        assert_eq!(
            &b[..],
            br#"{"stream":true,"stream_options":{"include_usage":true,"x":1}}"#
        );
        let (b, _) = ask(br#"{"stream":true,"stream_options":3}"#).unwrap();
        assert_eq!(
            &b[..],
            br#"{"stream":true,"stream_options":{"include_usage":true}}"#
        );
        // Not streaming: forwarded as it came.
        for body in [
            &br#"{"model":"m"}"#[..],
            b"{\"stream\":false}",
            b"{\"stream\" : null}",
        ] {
            let p = prepare_request(Bytes::copy_from_slice(body), false).unwrap();
            let (b, s) = (p.body, p.stream);
            assert_eq!((&b[..], s), (body, None));
        }
        // Whether the upstream streams would be its guess: refused.
        for body in [
            &b"[1]"[..],
            b"not json",
            b"\xef\xbb\xbf{\"stream\":true}",
            b"{\"stream\":true,\"x\":NaN}",
            b"",
            b"{\"stream\":1}",
            b"{\"stream\":\"true\"}",
        ] {
            assert!(prepare_request(Bytes::copy_from_slice(body), false).is_err());
        }
        // Which `stream` counts depends on the server's parser: refused.
        assert!(ask(br#"{"stream":false,"stream":true}"#).is_err());
        assert!(ask(br#"{"stream":true,"stream_options":{},"stream_options":{}}"#).is_err());
    }

    #[test]
    fn data_events_are_told_from_comments_and_the_end() {
        assert!(is_data_event(b"data: {\"choices\":[]}\n\n"));
        assert!(is_data_event(
            b"event: response.output_text.delta\r\ndata: {}\r\n\r\n"
        ));
        assert!(!is_data_event(b"data: [DONE]\n\n"));
        assert!(!is_data_event(b": keep-alive\n\n"));
        assert!(!is_data_event(b"event: ping\n\n"));
    }

    #[test]
    fn only_creating_posts_are_charged_their_usage() {
        let post = |p| is_generating_request(&Method::POST, p);
        for path in [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/Responses/",
            "/v1/embeddings",
            "/v1/audio/transcriptions",
            "/v1/audio/speech",
            "/v1/images/generations",
            "/v1/respons%65s",
            "/v1/threads/runs",
            "/v1/threads/t/runs",
            "/v1/threads/t/runs/r/submit_tool_outputs",
            "/v1/responses/compact",
            "/v1/messages",
            "/v1/batches",
            // A path whose last segment is a create is one, whatever comes before it.
            "/v1/runs/chat/completions",
        ] {
            assert!(post(path), "{path}");
        }
        for path in [
            "/v1/responses/resp_1",
            "/v1/responses/resp_1/cancel",
            "/v1/responses%2Fresp_1",
            "/v1/chat/completions/chatcmpl-1",
            "/v1/threads/t/runs/r",
            "/v1/threads/t/runs/r/cancel",
            "/v1/batches/b/cancel",
            "/v1/fine_tuning/jobs/j/cancel",
        ] {
            assert!(!post(path), "{path}");
        }
        assert!(!is_generating_request(&Method::GET, "/v1/responses"));
        assert!(!is_generating_request(&Method::GET, "/v1/chat/completions"));
    }

    #[test]
    fn completion_paths_are_matched_as_a_lenient_upstream_reads_them() {
        assert!(is_completion_path("/v1/chat/completions"));
        assert!(is_completion_path("/v1/completions"));
        assert!(is_completion_path("/v1/chat/completion%73"));
        assert!(is_completion_path("/v1/chat%2Fcompletions"));
        assert!(is_completion_path("/v1/chat/Completions"));
        assert!(is_completion_path("/v1/chat/completions/"));
        assert!(is_completion_path("/v1/chat/COMPLETION%53//"));
        assert!(is_completion_path("/v1/chat/completions;v=1"));
        assert!(is_completion_path("/v1/chat/completions%3Bx/"));
        assert!(is_completion_path("/v1/chat/completions/;x"));
        assert!(is_completion_path("/v1//completions"));
        assert!(is_completion_path("/v1/chat%5Ccompletions"));
        assert!(is_completion_path("/v1/chat\\completions"));
        assert!(is_completion_path("/completions"));
        assert!(!is_completion_path("/v1/completions-like"));
        assert!(!is_completion_path("/v1/embeddings"));
        assert!(!is_completion_path("/"));
        assert!(!is_completion_path("completions"));
        assert!(!is_completion_path("/v1/chat/completions%2"));
        assert!(!is_completion_path("/v1/models%"));
    }

    #[test]
    fn sse_split_across_frames_and_usage_stripped() {
        let mut f = SseFilter::new(true);
        let a = f.push(Bytes::from_static(
            b"data: {\"choices\":[{}],\"usage\":null}\n\ndata: {\"cho",
        ));
        assert_eq!(
            &a[..],
            b"data: {\"choices\":[{}]}\n\n",
            "usage: null not asked for"
        );
        let b = f.push(Bytes::from_static(
            b"ices\":[],\"usage\":{\"total_tokens\":9}}\n\ndata: [DONE]\n\n",
        ));
        assert_eq!(&b[..], b"data: [DONE]\n\n");
        assert_eq!(f.tokens, Some(9));
        assert!(f.flush().is_empty());

        // Python's json.dumps (and others) put a space after each colon and comma.
        let mut spaced = SseFilter::new(true);
        let out = spaced.push(Bytes::from_static(
            b"data: {\"choices\": [{}], \"usage\": null}\n\n\
              data: {\"usage\" : null , \"choices\": [{}]}\n\n\
              data: {\"choices\": [], \"usage\": {\"total_tokens\": 11}}\n\n\
              data: [DONE]\n\n",
        ));
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            "data: {\"choices\": [{}]}\n\ndata: {\"choices\": [{}]}\n\ndata: [DONE]\n\n"
        );
        assert_eq!(spaced.tokens, Some(11));
        // A "usage" in the text is not a field.
        let mut text = SseFilter::new(true);
        let said = Bytes::from_static(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"\\\"usage\\\": null\"}}]}\n\n",
        );
        assert_eq!(text.push(said.clone()), said);
        assert_eq!(text.tokens, None);

        let mut keep = SseFilter::new(false);
        let input =
            Bytes::from_static(b"data: {\"choices\":[],\"usage\":{\"total_tokens\":2}}\r\n\r\n");
        let c = keep.push(input.clone());
        assert_eq!(c, input);
        assert_eq!(keep.tokens, Some(2));
    }

    /// Feeds `stream` to a filter in pieces of the sizes `sizes` (cycled), then ends it;
    /// returns what was forwarded and the tokens read.
    fn feed(stream: &[u8], sizes: &[usize], strip_usage: bool) -> (Vec<u8>, Option<u64>) {
        let mut f = SseFilter::new(strip_usage);
        let mut out = Vec::new();
        let mut at = 0;
        for &n in sizes.iter().cycle() {
            if at >= stream.len() {
                break;
            }
            let end = (at + n).min(stream.len());
            out.extend_from_slice(&f.push(Bytes::copy_from_slice(&stream[at..end])));
            at = end;
        }
        out.extend_from_slice(&f.flush());
        (out, f.tokens)
    }

    #[test]
    fn every_line_ending_and_every_split_gives_the_same_stream() {
        // LF, CRLF and bare CR line endings (all three are valid event stream syntax).
        for nl in ["\n", "\r\n", "\r"] {
            let event = |data: &str| format!("data: {data}{nl}{nl}");
            let chunk = event(r#"{"choices":[{"delta":{"content":"hi"}}],"usage":null}"#);
            let usage = event(r#"{"choices":[],"usage":{"total_tokens":13}}"#);
            let done = event("[DONE]");
            let stream = format!("{chunk}{chunk}{usage}{done}");
            let kept = event(r#"{"choices":[{"delta":{"content":"hi"}}]}"#);
            let expected = format!("{kept}{kept}{done}");
            for sizes in [&[usize::MAX][..], &[1], &[2], &[3, 7], &[5, 1, 64]] {
                let (out, tokens) = feed(stream.as_bytes(), sizes, true);
                assert_eq!(
                    String::from_utf8(out).unwrap(),
                    expected,
                    "line ending {nl:?}, pieces {sizes:?}"
                );
                assert_eq!(tokens, Some(13), "line ending {nl:?}, pieces {sizes:?}");
                let (out, _) = feed(stream.as_bytes(), sizes, false);
                assert_eq!(out, stream.as_bytes(), "kept whole: {nl:?}, {sizes:?}");
            }
        }
    }

    #[test]
    fn an_event_too_large_to_hold_goes_out_as_it_comes_and_filtering_resumes() {
        let big = format!(
            "data: {{\"image\":\"{}\"}}\n\n",
            "A".repeat(MAX_SSE_EVENT + 1000)
        );
        let usage = "data: {\"choices\":[],\"usage\":{\"total_tokens\":21}}\n\n";
        let stream = format!("data: {{\"choices\":[{{}}]}}\n\n{big}{usage}data: [DONE]\n\n");
        let mut f = SseFilter::new(true);
        let mut out = Vec::new();
        let (mut fed, mut held_back) = (0, 0);
        for piece in stream.as_bytes().chunks(64 * 1024) {
            fed += piece.len();
            out.extend_from_slice(&f.push(Bytes::copy_from_slice(piece)));
            held_back = held_back.max(fed - out.len());
        }
        out.extend_from_slice(&f.flush());
        let expected = format!("data: {{\"choices\":[{{}}]}}\n\n{big}data: [DONE]\n\n");
        assert!(
            out == expected.as_bytes(),
            "the stream changed beyond the usage chunk"
        );
        assert_eq!(
            f.tokens,
            Some(21),
            "usage after the large event is still read"
        );
        assert!(
            held_back <= MAX_SSE_EVENT + 64 * 1024,
            "held back {held_back} bytes"
        );
    }
}
