//! A byte-level server-sent event filter: a stream split into whole events as it comes, the
//! last usage and the model read, the usage-only chunk dropped on demand.

use std::sync::LazyLock;

use bytes::{Bytes, BytesMut};
use memchr::memmem::Finder;

use super::json::{skip_space, string_end};
use super::usage::{self, Tail, TokenUsage};

/// Most bytes of one event held back to inspect it whole. A larger event (an image in base64,
/// say) is forwarded as it arrives, uninspected, and filtering resumes with the next event.
const MAX_SSE_EVENT: usize = 8 * 1024 * 1024;

/// Splits an event stream into whole events, reads usage, drops the usage-only chunk on demand.
pub(crate) struct SseFilter {
    /// The start of an event not yet complete. (While `oversized`: only the last few bytes, to
    /// find the event's end if it straddles two frames.)
    pub(crate) pending: BytesMut,
    /// How much of `pending` holds no event end: a later search starts near there, so each byte
    /// is searched about once however the stream is split.
    searched: usize,
    /// Forwarding an event too large to hold until its end.
    oversized: bool,
    /// The last bytes of that event, where its usage would be (a Responses API stream's
    /// completion echoes the whole output before it).
    oversized_tail: Tail,
    pub(crate) strip_usage: bool,
    pub(crate) tokens: Option<u64>,
    /// The last usage read, in detail (what budgets price).
    pub(crate) usage: Option<TokenUsage>,
    /// Whether to look for the model that answered (budgets price by it).
    pub(crate) want_model: bool,
    /// The model named by the stream's chunks: the usage chunk's, else the first named.
    pub(crate) model: Option<String>,
    /// What tells that the answer is complete ([`AnswerEnd`]).
    pub(crate) ends: AnswerEnd,
    /// Whether an event has told that the answer is complete ([`AnswerEnd`]), so that only
    /// its usage (and the stream's end) may follow. Asked only while no usage has been read:
    /// a chat stream's frames are not searched for it once one has.
    pub(crate) answered: bool,
    /// Data events seen, `[DONE]` aside: what a stream cut before its usage is charged, as
    /// tokens (a chunk carries about one).
    pub(crate) events: u64,
    /// Whether the stream's first event has been seen (only it may start with a byte-order
    /// mark).
    started: bool,
}

/// What tells, in a stream, that its answer is complete and only its usage is still to come: a
/// caller that leaves after it has the rest read on for the usage (docs/design.md §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AnswerEnd {
    /// A chat or text completion's stream: a chunk that gives a choice its `finish_reason` (a
    /// string, not `null`); the usage chunk follows.
    FinishReason,
    /// Any other stream (the Responses API's, the Assistants API's): an event that closes an
    /// output item or a message (`response.output_item.done`, `thread.message.completed`, in
    /// its `event:` line or its data); the usage comes with the response's or the run's
    /// completion event. (An answer of several items reads on after its first: bounded, as
    /// any reading on is.)
    DoneEvent,
}

/// The UTF-8 byte-order mark, which may start an event stream.
const BOM: &[u8] = b"\xef\xbb\xbf";

/// Whether an event carries data other than the stream's `[DONE]` (a comment or a bare
/// `event:` line does not).
fn is_data_event(event: &[u8]) -> bool {
    // The common event, one line of JSON: told by its first bytes, no line searched for.
    if let Some(data) = event.strip_prefix(b"data:")
        && data.trim_ascii_start().first() == Some(&b'{')
    {
        return true;
    }
    lines(event)
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
        let line_end = i + memchr::memchr2(b'\n', b'\r', &buf[i..])?;
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
    pub(crate) fn new(strip_usage: bool) -> SseFilter {
        SseFilter {
            pending: BytesMut::new(),
            searched: 0,
            oversized: false,
            oversized_tail: Tail::default(),
            strip_usage,
            tokens: None,
            usage: None,
            want_model: false,
            model: None,
            ends: AnswerEnd::FinishReason,
            answered: false,
            events: 0,
            started: false,
        }
    }

    /// Takes the next bytes of the stream; returns what to forward now: the complete events
    /// among them (possibly none), filtered.
    pub(crate) fn push(&mut self, data: Bytes) -> Bytes {
        if self.oversized {
            return self.push_oversized(data);
        }
        if self.pending.is_empty() {
            // Each event's end is found once, as it is filtered; what follows the last whole
            // one waits for the next frame.
            let (out, end) = self.filter(data.clone(), false);
            self.pending.extend_from_slice(&data[end..]);
            self.searched = self.pending.len();
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
        let (out, _) = self.filter(complete, true);
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
        self.started = true;
        let held = self.pending.split().freeze();
        let mut joined = BytesMut::with_capacity(out.len() + held.len());
        joined.extend_from_slice(&out);
        joined.extend_from_slice(&held);
        self.keep_tail(&held);
        self.oversized_tail.push(&held);
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
                self.oversized_tail.push(&data);
                data
            }
            Some(e) => {
                // The tail alone held no event end (at most an undecided one ending with it).
                let split = e.saturating_sub(tail);
                self.oversized_tail.push(&data[..split]);
                self.oversized_ended();
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

    /// An event too large to hold has ended: its usage, if its last bytes state one, is the
    /// stream's so far, as an event read whole would have it (it went out as it came: a
    /// usage-only chunk is never that large).
    fn oversized_ended(&mut self) {
        if let Some(usage) = self.oversized_tail.usage() {
            self.tokens = Some(usage.total);
            self.usage = Some(usage);
        }
    }

    /// What is left when the stream ends (an event without its final blank line).
    pub(crate) fn flush(&mut self) -> Bytes {
        if self.oversized {
            // Its bytes went out already; `pending` only held a copy of the tail.
            self.pending.clear();
            self.oversized_ended();
            return Bytes::new();
        }
        let rest = self.pending.split().freeze();
        self.filter(rest, true).0
    }

    /// Forwards whole events, inspecting those that mention `usage`: every event of `events`
    /// up to the first that does not end in it (with `rest_is_event`, that one too, as it is).
    /// Returns what to forward and how much of `events` it came from.
    fn filter(&mut self, events: Bytes, rest_is_event: bool) -> (Bytes, usize) {
        let mut out = Cuts::default();
        let mut start = 0;
        // The keys are searched for once over all the events, not event by event: a frame
        // usually carries many small events, and each search pays its setup once.
        let mut usage_keys = Hits::new(&USAGE_KEY, &events);
        // One list for the run's events, refilled for each: a chunk with a `"usage": null` (every
        // chunk of a stream asked for usage) then costs no allocation of its own.
        let mut usage: Vec<UsageField> = Vec::new();
        while start < events.len() {
            let end = match event_end(&events[start..]) {
                Some(e) => start + e,
                None if rest_is_event => events.len(),
                None => break,
            };
            let event = &events[start..end];
            // A finish reason is looked for once over the run, after it (below).
            let finished =
                self.ends == AnswerEnd::DoneEvent && !self.answered && closes_answer(event);
            usage.clear();
            usage.extend(
                usage_keys
                    .fields_in(&events, start, end)
                    .filter(|&(_, value)| value < event.len())
                    .map(|(key, value)| UsageField { key, value }),
            );
            let action = self.inspect(event, finished, &usage);
            match action {
                Action::Keep => {}
                Action::Drop => out.cut(&events, start, end),
                Action::StripNullUsage => {
                    for (from, to) in null_usage_cuts(event, &usage) {
                        out.cut(&events, start + from, start + to);
                    }
                }
            }
            start = end;
        }
        let out = out.forwarded(&events, start);
        // Whether the answer is complete is asked only while its usage has not come
        // (`MeteredBody`'s drop): a run that gave the usage (a stream whose tail, or whole,
        // came in one frame) is not searched for it.
        if self.ends == AnswerEnd::FinishReason && !self.answered && self.usage.is_none() {
            self.answered = gives_finish_reason(&events[..start]);
        }
        (out, start)
    }

    /// Reads an event's usage; says what to forward. `finished`: the event tells that the
    /// answer is complete ([`AnswerEnd`]). `fields`: its `"usage"` fields, each followed by a
    /// value.
    fn inspect(&mut self, event: &[u8], finished: bool, fields: &[UsageField]) -> Action {
        // A byte-order mark may start the stream (the format's decoder drops it): the first
        // event's fields are read past it. (Its bytes go on as they came.)
        let lines_of = if self.started {
            event
        } else {
            self.started = true;
            event.strip_prefix(BOM).unwrap_or(event)
        };
        if is_data_event(lines_of) {
            self.events += 1;
        }
        self.answered |= finished;
        if self.want_model && self.model.is_none() {
            // Until one chunk names it: the first chunk usually does, so this is one search.
            self.model = model_in(event);
        }
        if fields.is_empty() {
            return Action::Keep;
        }
        // With include_usage, every chunk carries `"usage": null`; a caller that did not ask
        // for usage would not have seen that field. (JSON may put spaces around the colon.) A
        // value seen as anything else is parsed: in data over several `data:` lines, what
        // follows a key that ends its line is the next line's prefix, not the usage object.
        if self.strip_usage && fields.iter().all(|f| f.is_null(event)) {
            return Action::StripNullUsage;
        }
        let mut data: Vec<u8> = Vec::new();
        for line in lines(lines_of) {
            if let Some(payload) = line.strip_prefix(b"data:") {
                if !data.is_empty() {
                    data.push(b'\n');
                }
                data.extend_from_slice(payload.strip_prefix(b" ").unwrap_or(payload));
            }
        }
        let chunk = usage::read(&data);
        let Some(usage) = chunk.usage else {
            return Action::Keep;
        };
        self.tokens = Some(usage.total);
        self.usage = Some(usage);
        if self.want_model
            && let Some(model) = chunk.model
        {
            // The usage chunk's model wins: it is the one the usage is of.
            self.model = Some(model);
        }
        if self.strip_usage && chunk.usage_only {
            Action::Drop
        } else {
            Action::Keep
        }
    }
}

/// The bytes a run forwards, built once a cut is made in it: only what lies between two cuts is
/// copied, in one piece, not event by event (a stream asked for usage has a cut in every chunk).
#[derive(Default)]
struct Cuts {
    /// The bytes kept so far; `None` while nothing is cut.
    out: Option<BytesMut>,
    /// How much of the run is accounted for: in `out`, or cut.
    copied: usize,
}

impl Cuts {
    /// Leaves `events[from..to]` out, unless it overlaps the cut before (two fields sharing a
    /// comma: that one took it).
    fn cut(&mut self, events: &Bytes, from: usize, to: usize) {
        if from < self.copied {
            return;
        }
        let out = self
            .out
            .get_or_insert_with(|| BytesMut::with_capacity(events.len()));
        out.extend_from_slice(&events[self.copied..from]);
        self.copied = to;
    }

    /// What to forward of `events[..end]`: the run itself (a cheap slice) if nothing was cut.
    fn forwarded(self, events: &Bytes, end: usize) -> Bytes {
        match self.out {
            None => events.slice(..end),
            Some(mut out) => {
                out.extend_from_slice(&events[self.copied..end]);
                out.freeze()
            }
        }
    }
}

/// What to do with one event.
enum Action {
    Keep,
    Drop,
    /// Drop the event's `"usage": null` fields (among those `inspect` was given: not searched
    /// again).
    StripNullUsage,
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

/// A searcher for a field's key (built once: every event of every stream is searched).
type Key = LazyLock<Finder<'static>>;

static USAGE_KEY: Key = LazyLock::new(|| Finder::new(b"\"usage\""));
static FINISH_REASON_KEY: Key = LazyLock::new(|| Finder::new(b"\"finish_reason\""));
static MODEL_KEY: Key = LazyLock::new(|| Finder::new(b"\"model\""));
static TYPE_KEY: Key = LazyLock::new(|| Finder::new(b"\"type\""));
/// The events that close an output item or a message ([`AnswerEnd::DoneEvent`]).
const DONE_EVENTS: [&[u8]; 2] = [b"response.output_item.done", b"thread.message.completed"];

/// Whether an event of `events` (whole events) gives a choice its `finish_reason`: a string,
/// not `null`, as the field's value within the key's own event (no blank line between them).
fn gives_finish_reason(events: &[u8]) -> bool {
    fields(events, &FINISH_REASON_KEY).any(|(key, value)| {
        events.get(value) == Some(&b'"') && event_end(&events[key..=value]).is_none()
    })
}

/// Whether `event` closes an output item or a message: its `event:` line names one of
/// [`DONE_EVENTS`], or a `"type"` field of its data has one as its value. Only there: model
/// text that spells such a name sits inside a string value, where it is neither a line of its
/// own nor a field (its quotes escaped).
fn closes_answer(event: &[u8]) -> bool {
    let is_done = |name: &[u8]| DONE_EVENTS.contains(&name);
    lines(event)
        .filter_map(|line| line.strip_prefix(b"event:"))
        .any(|name| is_done(name.trim_ascii()))
        || fields(event, &TYPE_KEY).any(|(_, value)| {
            event.get(value) == Some(&b'"')
                && event[value + 1..]
                    .iter()
                    .position(|&b| b == b'"')
                    .is_some_and(|len| is_done(&event[value + 1..value + 1 + len]))
        })
}

/// Each `key` in `event` that a colon follows (any spacing, any nesting), as the positions of
/// the key and of its value (`event.len()` if the event ends there). (A key inside a string
/// value has its quotes escaped, so it is not found.)
fn fields<'a>(
    event: &'a [u8],
    key: &'a Finder<'static>,
) -> impl Iterator<Item = (usize, usize)> + 'a {
    let mut from = 0;
    std::iter::from_fn(move || {
        while let Some(p) = key.find(&event[from..]) {
            let at = from + p;
            from = at + key.needle().len();
            let colon = skip_space(event, from);
            if event.get(colon) == Some(&b':') {
                return Some((at, skip_space(event, colon + 1)));
            }
        }
        None
    })
}

/// The string value of the first `"model"` field in `event` (any nesting, any spacing), if any.
/// (A `"model"` inside a string value has its quotes escaped, so it is not found.)
pub(super) fn model_in(event: &[u8]) -> Option<String> {
    let (_, value) = fields(event, &MODEL_KEY).next()?;
    if event.get(value) != Some(&b'"') {
        return None;
    }
    let (end, _) = string_end(event, value)?;
    serde_json::from_slice(&event[value..end]).ok()
}

/// A key's fields (as [`fields`] finds them) in a run of events, searched for once over the run
/// and handed out event by event, in order. (A key never spans two events: it holds no line
/// terminator.)
struct Hits<'a> {
    found: memchr::memmem::FindIter<'a, 'static>,
    /// The next occurrence not handed out yet.
    next: Option<usize>,
    /// The key's length.
    len: usize,
}

impl<'a> Hits<'a> {
    fn new(key: &'static Key, events: &'a [u8]) -> Hits<'a> {
        let finder: &'static Finder<'static> = key;
        let mut found = finder.find_iter(events);
        let next = found.next();
        Hits {
            found,
            next,
            len: finder.needle().len(),
        }
    }

    /// The fields of the event `events[start..end]`, as positions in it of the key and of its
    /// value (the event's length if it ends there). Occurrences before `start` (in an event
    /// whose fields were not all asked for) are passed over.
    fn fields_in<'s>(
        &'s mut self,
        events: &'s [u8],
        start: usize,
        end: usize,
    ) -> impl Iterator<Item = (usize, usize)> + 's {
        let event = &events[start..end];
        std::iter::from_fn(move || {
            while let Some(at) = self.next.filter(|&at| at < end) {
                self.next = self.found.next();
                let Some(key) = at.checked_sub(start) else {
                    continue;
                };
                let colon = skip_space(event, key + self.len);
                if event.get(colon) == Some(&b':') {
                    return Some((key, skip_space(event, colon + 1)));
                }
            }
            None
        })
    }
}

/// The lines of `event`, split at each CR or LF (a CRLF gives an empty line between: no line
/// the callers look for is empty).
fn lines(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(event);
    std::iter::from_fn(move || {
        let buf = rest?;
        match memchr::memchr2(b'\n', b'\r', buf) {
            Some(i) => {
                rest = Some(&buf[i + 1..]);
                Some(&buf[..i])
            }
            None => {
                rest = None;
                Some(buf)
            }
        }
    })
}

/// Where `event` loses its `"usage": null` fields among `fields` (and the comma that joined each
/// to its neighbour): each cut's range in `event`, in order (one may overlap the one before: two
/// fields sharing a comma; [`Cuts::cut`] passes it over). Only spaces and tabs are passed over
/// around a field: in data written over several `data:` lines, a comma on another line is not
/// this field's to take (the line's `data:` prefix stands between), and such a field stays, the
/// JSON whole.
fn null_usage_cuts<'a>(
    event: &'a [u8],
    fields: &'a [UsageField],
) -> impl Iterator<Item = (usize, usize)> + 'a {
    let skip_blank = |mut i: usize| {
        while event.get(i).is_some_and(|b| matches!(b, b' ' | b'\t')) {
            i += 1;
        }
        i
    };
    fields
        .iter()
        .filter(|f| f.is_null(event))
        .filter_map(move |f| {
            let end = f.value + b"null".len();
            // `, "usage": null`: from the comma before it; `{"usage": null, ...`: to the comma
            // after; `{"usage": null}`: the field alone.
            let before = event[..f.key]
                .iter()
                .rposition(|b| !b" \t".contains(b))
                .map(|c| (c, event[c]));
            let after = skip_blank(end);
            match (before, event.get(after)) {
                (Some((c, b',')), _) => Some((c, end)),
                (_, Some(b',')) => Some((f.key, skip_blank(after + 1))),
                (Some((_, b'{')), Some(b'}')) => Some((f.key, end)),
                _ => None,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a stream of `events` (each ended here) has given a choice its `finish_reason`.
    fn has_finish_reason(events: &[&[u8]]) -> bool {
        let mut f = SseFilter::new(false);
        let stream: Vec<u8> = events.iter().flat_map(|e| [*e, b"\n\n"].concat()).collect();
        f.push(Bytes::from(stream));
        f.answered
    }

    #[test]
    fn a_finished_choice_is_found_at_any_spacing_and_null_is_not_one() {
        assert!(has_finish_reason(&[
            br#"data: {"choices":[{"delta":{},"finish_reason":"stop"}]}"#
        ]));
        assert!(has_finish_reason(&[
            br#"data: {"finish_reason" : "length"}"#
        ]));
        assert!(!has_finish_reason(&[br#"data: {"finish_reason":null}"#]));
        assert!(!has_finish_reason(&[
            br#"data: {"delta":{"content":"say \"finish_reason\":\"stop\""},"finish_reason":null}"#
        ]));
        // Searched for once over a frame of many events: each event's own fields are read, a
        // key whose colon is in the next event is none.
        assert!(!has_finish_reason(&[
            br#"data: {"finish_reason":null}"#,
            br#"data: {"x":"finish_reason"}"#,
            br#"data: {"y":["finish_reason"]}"#,
        ]));
        assert!(has_finish_reason(&[
            br#"data: {"finish_reason":null}"#,
            br#": "finish_reason""#,
            br#"data: {"choices":[{"finish_reason":null},{"finish_reason":"stop"}]}"#,
        ]));
        // With several choices, the first finished one counts, even when another's chunk
        // follows it in the same frame.
        assert!(has_finish_reason(&[
            br#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            br#"data: {"choices":[{"index":1,"delta":{"content":"x"},"finish_reason":null}]}"#,
        ]));
        // A value in the next event is not the key's.
        assert!(!has_finish_reason(&[
            br#"data: {"finish_reason":"#,
            br#""stop"}"#
        ]));
        assert!(!has_finish_reason(&[
            br#"data: {"finish_reason""#,
            br#":"stop"}"#
        ]));
        assert!(!has_finish_reason(&[
            b"data: {\"finish_reason\":\r\n",
            br#""stop"}"#
        ]));
        // Within its event, a value may follow on the next line.
        assert!(has_finish_reason(&[
            b"data: {\"finish_reason\":\n\"stop\"}"
        ]));
    }

    /// Whether a stream of `events` that ends its answers by [`AnswerEnd::DoneEvent`] has told
    /// that its answer is complete.
    fn has_done_event(events: &[&[u8]]) -> bool {
        let mut f = SseFilter::new(false);
        f.ends = AnswerEnd::DoneEvent;
        let stream: Vec<u8> = events.iter().flat_map(|e| [*e, b"\n\n"].concat()).collect();
        f.push(Bytes::from(stream));
        f.answered
    }

    #[test]
    fn a_responses_or_assistants_answer_is_complete_at_its_closing_event() {
        let responses: [&[u8]; 4] = [
            b"event: response.created\ndata: {\"type\":\"response.created\"}",
            b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\"}",
            b"event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\"}",
            b"event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\"}",
        ];
        assert!(!has_done_event(&responses[..3]));
        assert!(has_done_event(&responses));
        // Told by its data alone too (an upstream that sends no `event:` lines).
        assert!(has_done_event(&[
            br#"data: {"type":"response.output_item.done","item":{}}"#
        ]));
        assert!(has_done_event(&[
            b"event: thread.message.completed\ndata: {\"object\":\"thread.message\"}"
        ]));
        assert!(!has_done_event(&[
            b"event: thread.message.delta\ndata: {\"object\":\"thread.message.delta\"}"
        ]));
        // Model text that spells a closing event's name closes nothing: it is a string's
        // content, neither an `event:` line nor a `"type"` field.
        assert!(!has_done_event(&[
            br#"event: response.output_text.delta
data: {"type":"response.output_text.delta","delta":"response.output_item.done"}"#
        ]));
        assert!(!has_done_event(&[
            br#"data: {"type":"response.output_text.delta","delta":"{\"type\":\"response.output_item.done\"}\nevent: thread.message.completed"}"#
        ]));
        assert!(!has_done_event(&[
            b"event: thread.message.delta\ndata: {\"delta\":\"event: thread.message.completed\"}"
        ]));
        // Spaced as some servers write it.
        assert!(has_done_event(&[
            br#"data: {"type" : "response.output_item.done"}"#
        ]));
        // A chat completion's finish_reason is not how these streams end, and the other way
        // round.
        assert!(!has_done_event(&[
            br#"data: {"choices":[{"delta":{},"finish_reason":"stop"}]}"#
        ]));
        assert!(!has_finish_reason(&[
            br#"data: {"type":"response.output_item.done"}"#
        ]));
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

    #[test]
    fn the_usage_of_an_event_too_large_to_hold_is_read_from_its_end() {
        // A Responses API completion that echoes its output (images in base64) before its usage,
        // split anywhere, and the same event cut at the stream's end without its blank line.
        let big = format!(
            "event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"output\":[{{\"result\":\"{}\",\"note\":\"a \\\"usage\\\":{{\\\"total_tokens\\\":1}}\"}}],\"usage\":{{\"input_tokens\":7,\"output_tokens\":30,\"total_tokens\":37}},\"metadata\":{{\"usage\":\"n/a\"}}}}}}\n\n",
            "A".repeat(MAX_SSE_EVENT + 1000)
        );
        for terminated in [true, false] {
            let stream = if terminated {
                big.clone()
            } else {
                big.trim_end().to_owned()
            };
            for piece in [64 * 1024, 1_000_003] {
                let mut f = SseFilter::new(false);
                f.ends = AnswerEnd::DoneEvent;
                let mut out = Vec::new();
                for p in stream.as_bytes().chunks(piece) {
                    out.extend_from_slice(&f.push(Bytes::copy_from_slice(p)));
                }
                out.extend_from_slice(&f.flush());
                assert!(out == stream.as_bytes(), "forwarded as it came");
                let usage = f.usage.expect("the usage at the event's end");
                assert_eq!(
                    (usage.input, usage.output, usage.total),
                    (Some(7), Some(30), 37),
                    "terminated {terminated}, pieces of {piece}"
                );
            }
        }
        // A large event without a usage leaves the stream's as it was.
        let mut f = SseFilter::new(false);
        let usage = "data: {\"choices\":[],\"usage\":{\"total_tokens\":21}}\n\n";
        f.push(Bytes::from_static(usage.as_bytes()));
        let big = format!(
            "data: {{\"image\":\"{}\"}}\n\n",
            "A".repeat(MAX_SSE_EVENT + 1)
        );
        f.push(Bytes::from(big));
        f.flush();
        assert_eq!(f.tokens, Some(21));
    }

    /// What a caller reads as the JSON of each event of `stream`: its `data:` lines joined.
    fn data_of_events(stream: &str) -> Vec<String> {
        stream
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                e.lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .collect()
    }

    #[test]
    fn a_null_usage_in_multi_line_data_never_breaks_the_json() {
        // An upstream that writes its JSON over several `data:` lines (pretty-printed, as an
        // event source library splits multi-line data): the usage field is on a line of its
        // own, its comma on the line before or after. Where its comma is on its line, it goes;
        // where not, it stays.
        for (chunk, hidden) in [
            (
                "data: {\ndata:   \"choices\": [{}],\ndata:   \"usage\": null\ndata: }\n\n",
                false,
            ),
            (
                "data: {\ndata:   \"usage\": null,\ndata:   \"choices\": [{}]\ndata: }\n\n",
                true,
            ),
            ("data: {\"choices\":[{}],\ndata: \"usage\":null}\n\n", false),
            ("data: {\"usage\":null,\ndata: \"choices\":[{}]}\n\n", true),
        ] {
            let mut f = SseFilter::new(true);
            let mut out = f.push(Bytes::from_static(chunk.as_bytes())).to_vec();
            out.extend_from_slice(&f.flush());
            let out = String::from_utf8(out).unwrap();
            let data = data_of_events(&out);
            assert_eq!(data.len(), 1, "{out:?}");
            let v: serde_json::Value = serde_json::from_str(&data[0])
                .unwrap_or_else(|e| panic!("{chunk:?} became {out:?}: {e}"));
            assert_eq!(v["choices"], serde_json::json!([{}]), "{out:?}");
            assert_eq!(v.get("usage").is_none(), hidden, "{out:?}");
            assert!(
                out.lines().all(|l| l.is_empty() || l.starts_with("data:")),
                "lines kept apart: {out:?}"
            );
        }
        // On one line, the field goes as before.
        let mut f = SseFilter::new(true);
        let out = f.push(Bytes::from_static(
            b"data: {\"usage\" : null ,\t\"choices\":[{}]}\n\ndata: {\"choices\":[{}], \"usage\":null}\n\n",
        ));
        assert_eq!(
            &out[..],
            b"data: {\"choices\":[{}]}\n\ndata: {\"choices\":[{}]}\n\n"
        );
    }

    #[test]
    fn two_null_usage_fields_in_one_chunk_leave_whole_json() {
        // Each with a comma before it: both go.
        let mut f = SseFilter::new(true);
        let out = f.push(Bytes::from_static(
            b"data: {\"a\":1,\"usage\":null,\"usage\":null}\n\ndata: {\"b\":2}\n\n",
        ));
        assert_eq!(&out[..], b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\n");
        // Sharing the one comma between them: the first takes it, the second (whose cut would
        // start at that comma) stays, so that the object stays whole.
        let mut f = SseFilter::new(true);
        let out = f.push(Bytes::from_static(
            b"data: {\"usage\":null,\"usage\":null}\n\ndata: {\"b\":2}\n\n",
        ));
        assert_eq!(&out[..], b"data: {\"usage\":null}\n\ndata: {\"b\":2}\n\n");
    }

    #[test]
    fn a_usage_whose_value_starts_on_the_next_data_line_is_read_and_hidden() {
        // `"usage":` ends a `data:` line, its object on the next: the value the key search sees
        // is the next line's `data:` prefix, neither `{` nor `null`.
        let chunk = "data: {\"choices\":[],\"usage\":\ndata: {\"total_tokens\":5}}\n\n";
        for strip in [true, false] {
            let mut f = SseFilter::new(strip);
            let out = f.push(Bytes::from_static(chunk.as_bytes()));
            assert_eq!(f.tokens, Some(5), "strip {strip}");
            let want: &[u8] = if strip { b"" } else { chunk.as_bytes() };
            assert_eq!(&out[..], want, "strip {strip}");
        }
    }

    #[test]
    fn a_byte_order_mark_before_the_first_event_does_not_hide_it() {
        // The event stream format allows a UTF-8 byte-order mark at the stream's start (a
        // decoder drops it): the first event is still a data event, and its usage is read.
        let usage = "\u{feff}data: {\"choices\":[],\"usage\":{\"total_tokens\":5}}\n\n";
        for strip in [true, false] {
            let mut f = SseFilter::new(strip);
            let out = f.push(Bytes::from_static(usage.as_bytes()));
            assert_eq!((f.tokens, f.events), (Some(5), 1), "strip {strip}");
            assert_eq!(out.is_empty(), strip, "strip {strip}");
        }
        // A chunk, counted for a stream cut before its usage; a mark later on is no mark.
        let mut f = SseFilter::new(true);
        let stream = "\u{feff}data: {\"choices\":[{}]}\n\n\u{feff}data: {\"choices\":[{}]}\n\n";
        let out = f.push(Bytes::from_static(stream.as_bytes()));
        assert_eq!(&out[..], stream.as_bytes());
        assert_eq!(f.events, 1);
    }
}

#[cfg(test)]
mod split_props {
    use super::*;

    use super::super::rng::Rng;

    /// A generated stream: its bytes, what a filter must forward, the tokens it must read.
    fn gen_stream(rng: &mut Rng, strip: bool) -> (Vec<u8>, Vec<u8>, Option<u64>) {
        let (mut s, mut want, mut tokens) = (Vec::new(), Vec::new(), None);
        let n = 1 + rng.below(6);
        for i in 0..n {
            let nl = ["\n", "\r\n", "\r"][rng.below(3)];
            let sp = [" ", ""][rng.below(2)];
            let text = ["hi", "say \\\"usage\\\": {}", "caf\u{e9} \\u0041", "a\\\\"][rng.below(4)];
            let (ev, kept): (String, String) = match rng.below(7) {
                0 => (format!(": keep-alive{nl}"), format!(": keep-alive{nl}")),
                1 => {
                    let c = format!(r#"{{"choices":[{{"delta":{{"content":"{text}"}}}}]"#);
                    (
                        format!("event: x{nl}id: {i}{nl}data:{sp}{c},\"usage\":{sp}null}}{nl}"),
                        format!("event: x{nl}id: {i}{nl}data:{sp}{c}}}{nl}"),
                    )
                }
                2 => {
                    let t = rng.below(1000) as u64;
                    tokens = Some(t);
                    let e = format!(
                        "data:{sp}{{\"choices\":[],{sp}\"usage\":{sp}{{\"prompt_tokens\":1,\"total_tokens\":{t}}}}}{nl}"
                    );
                    (e.clone(), if strip { String::new() } else { e })
                }
                3 => {
                    let e = format!(
                        "data: {{\"choices\":[{{\"delta\":{{}},{nl}data: \"finish_reason\":\"stop\"}}]}}{nl}"
                    );
                    (e.clone(), e)
                }
                4 => (format!("data: [DONE]{nl}"), format!("data: [DONE]{nl}")),
                _ => {
                    let c = format!(
                        r#"{{"choices":[{{"index":{i},"delta":{{"content":"{text}"}},"finish_reason":null}}]"#
                    );
                    (
                        format!("data: {c},{sp}\"usage\":{sp}null}}{nl}"),
                        format!("data: {c}}}{nl}"),
                    )
                }
            };
            let kept = if strip { kept } else { ev.clone() };
            // The last event may end without its blank line, or without any terminator.
            let shape = if i + 1 == n { rng.below(3) } else { 0 };
            let end = if shape == 0 { nl } else { "" };
            let (ev, kept) = if shape == 2 {
                let strip_nl = |x: String| x.strip_suffix(nl).map(str::to_owned).unwrap_or(x);
                (strip_nl(ev), strip_nl(kept))
            } else {
                (ev, kept)
            };
            s.extend_from_slice(ev.as_bytes());
            s.extend_from_slice(end.as_bytes());
            if !kept.is_empty() {
                want.extend_from_slice(kept.as_bytes());
                want.extend_from_slice(end.as_bytes());
            }
        }
        (s, want, tokens)
    }

    fn run(stream: &[u8], cuts: &[usize], strip: bool) -> (Vec<u8>, Option<u64>, u64) {
        let mut f = SseFilter::new(strip);
        let mut out = Vec::new();
        let mut at = 0;
        for &c in cuts.iter().chain(std::iter::once(&stream.len())) {
            out.extend_from_slice(&f.push(Bytes::copy_from_slice(&stream[at..c])));
            at = c;
        }
        out.extend_from_slice(&f.flush());
        (out, f.tokens, f.events)
    }

    #[test]
    fn any_stream_split_anywhere_gives_the_same_stream_and_usage() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..600 {
            let strip = round % 2 == 0;
            let (s, want, tokens) = gen_stream(&mut rng, strip);
            let (whole, t, events) = run(&s, &[], strip);
            let show = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            assert_eq!(
                show(&whole),
                show(&want),
                "whole, strip {strip}: {:?}",
                show(&s)
            );
            assert_eq!(t, tokens, "{:?}", show(&s));
            for cut in 0..=s.len() {
                let got = run(&s, &[cut], strip);
                assert_eq!(
                    (show(&got.0), got.1, got.2),
                    (show(&want), tokens, events),
                    "cut at {cut}: {:?}",
                    show(&s)
                );
            }
            let mut cuts: Vec<usize> = (0..1 + rng.below(8))
                .map(|_| rng.below(s.len() + 1))
                .collect();
            cuts.sort_unstable();
            let got = run(&s, &cuts, strip);
            assert_eq!(
                (show(&got.0), got.1, got.2),
                (show(&want), tokens, events),
                "cuts {cuts:?}: {:?}",
                show(&s)
            );
            let ones: Vec<usize> = (1..s.len()).collect();
            let got = run(&s, &ones, strip);
            assert_eq!(
                (show(&got.0), got.1, got.2),
                (show(&want), tokens, events),
                "bytes: {:?}",
                show(&s)
            );
        }
    }
}
