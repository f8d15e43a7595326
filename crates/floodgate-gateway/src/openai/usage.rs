//! Usage as OpenAI-compatible APIs report it: a JSON body's or a stream chunk's `usage`
//! (`total_tokens`, else input plus output, in either API's spelling), and a Realtime
//! `response.done` event's.

use serde::Deserialize;
use serde::de::IgnoredAny;

use super::json;

#[derive(Default, Deserialize)]
pub(super) struct Usage {
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
pub(super) struct UsageCarrier {
    pub(super) usage: Option<Usage>,
    /// Chat completion chunks: the usage-only chunk has no choices.
    pub(super) choices: Option<Vec<IgnoredAny>>,
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
    pub(super) fn usage(&self) -> Option<TokenUsage> {
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

    #[cfg(test)]
    fn tokens(&self) -> Option<u64> {
        self.usage().map(|u| u.total)
    }

    pub(super) fn into_model(self) -> Option<String> {
        self.model.or_else(|| self.response.and_then(|r| r.model))
    }
}

/// The tokens in a JSON response body's `usage`, if it has one.
#[cfg(test)]
pub fn usage_from_json(body: &[u8]) -> Option<u64> {
    serde_json::from_slice::<UsageCarrier>(body).ok()?.tokens()
}

/// What metering reads of a JSON body or a stream chunk.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Read {
    /// Its usage (a top-level `usage`, else the nested `response`'s; none for a run step's).
    pub(super) usage: Option<TokenUsage>,
    /// The model it names (its own, else the nested `response`'s).
    pub(super) model: Option<String>,
    /// Whether it has a top-level `usage` that is not `null`, and no choices (no `choices`, a
    /// `null` or an empty list): a stream's usage-only chunk.
    pub(super) usage_only: bool,
}

impl Read {
    /// What a full parse of `body` into [`UsageCarrier`] gives (nothing if it is not one).
    fn full(body: &[u8]) -> Read {
        match serde_json::from_slice::<UsageCarrier>(body) {
            Ok(c) => Read {
                usage: c.usage(),
                usage_only: c.usage.is_some() && c.choices.as_ref().is_none_or(Vec::is_empty),
                model: c.into_model(),
            },
            Err(_) => Read::default(),
        }
    }
}

/// A JSON response body's or a stream chunk's usage, model and shape ([`Read`]).
///
/// Read by [`quick_read`], which looks only at the members it needs; a body it cannot read that
/// way is parsed whole, with the same result for any well-formed body.
pub(super) fn read(body: &[u8]) -> Read {
    quick_read(body).unwrap_or_else(|| Read::full(body))
}

/// A JSON response body's usage and the model it names, if any ([`read`]).
pub fn usage_and_model_from_json(body: &[u8]) -> (Option<TokenUsage>, Option<String>) {
    let read = read(body);
    (read.usage, read.model)
}

/// What a full parse into [`UsageCarrier`] gives, read from `body`'s top-level `usage`,
/// `response`, `model`, `object` and `choices` alone (the others skipped, not validated:
/// docs/design.md §6; of `choices`, only whether it is a list with anything in it); `None` where
/// this cannot tell what that parse would give (an escaped key, a member read twice, a value not
/// of the plain shape read here): then the caller parses the body whole.
fn quick_read(body: &[u8]) -> Option<Read> {
    let (mut usage, mut response, mut model, mut object, mut choices) =
        (None, None, None, None, None);
    for member in json::members(body) {
        let member = member.ok()?;
        if member.escaped {
            return None;
        }
        let slot = match member.key {
            b"usage" => &mut usage,
            b"response" => &mut response,
            b"model" => &mut model,
            b"object" => &mut object,
            b"choices" => {
                // Read only to tell a usage-only chunk, not as the full parse takes it: named
                // twice, it is not one (and the usage is read, as past any member skipped).
                choices = Some(if choices.is_none() {
                    member.value
                } else {
                    &b"[0]"[..]
                });
                continue;
            }
            _ => continue,
        };
        if slot.replace(member.value).is_some() {
            // A duplicate: the full parse refuses the body.
            return None;
        }
    }
    let no_choices = match choices {
        None | Some(b"null") => true,
        // A list: empty or not (its items are skipped, as other members are). Anything else,
        // which the full parse refuses, has choices: the usage stated is charged, as for a body
        // broken anywhere else this reader skips (docs/design.md §6).
        Some([b'[', rest @ ..]) => rest.get(json::skip_space(rest, 0)) == Some(&b']'),
        Some(_) => false,
    };
    let usage = match usage {
        None => None,
        Some(raw) => quick_usage(raw)?,
    };
    let usage_only = usage.is_some() && no_choices;
    let response = match response {
        None | Some(b"null") => None,
        Some(raw) => Some(serde_json::from_slice::<NestedResponse>(raw).ok()?),
    };
    let model = match model {
        None => None,
        Some(raw) => json::plain_string(raw)?.map(str::to_owned),
    };
    let run_step = match object {
        None => false,
        Some(raw) => json::plain_string(raw)? == Some("thread.run.step"),
    };
    let usage = if run_step {
        // As `UsageCarrier::usage`: a run step's usage is its run's.
        None
    } else {
        usage
            .as_ref()
            .or_else(|| response.as_ref().and_then(|r| r.usage.as_ref()))
            .map(Usage::detail)
    };
    let model = model.or_else(|| response.and_then(|r| r.model));
    Some(Read {
        usage,
        model,
        usage_only,
    })
}

/// How many of a body's or an event's last bytes [`Tail`] keeps: room for the members that
/// follow a response's `usage` (OpenAI's `user` and `metadata`, a few KiB at most) and the
/// usage itself.
pub const TAIL_BYTES: usize = 64 * 1024;

/// The last [`TAIL_BYTES`] of a body or an event too large to hold whole, kept as it goes by:
/// where its usage is, after the output it counts (docs/design.md §6).
#[derive(Default)]
pub struct Tail(Vec<u8>);

impl Tail {
    /// Keeps `bytes` as the tail's end.
    pub fn push(&mut self, bytes: &[u8]) {
        if bytes.len() >= TAIL_BYTES {
            self.0.clear();
            self.0.extend_from_slice(&bytes[bytes.len() - TAIL_BYTES..]);
            return;
        }
        // Trimmed once it holds twice the tail: each byte is moved about once.
        if self.0.len() + bytes.len() > 2 * TAIL_BYTES {
            let keep = TAIL_BYTES - bytes.len();
            self.0.drain(..self.0.len() - keep);
        }
        self.0.extend_from_slice(bytes);
    }

    /// The usage read from the tail ([`usage_in_tail`]); the tail is emptied.
    pub fn usage(&mut self) -> Option<TokenUsage> {
        let usage = usage_in_tail(&self.0);
        self.0 = Vec::new();
        usage
    }
}

/// The usage a body or an event too large to hold states, read from its last bytes: the last
/// `"usage"` key there whose value is an object that ends within them and reads as a usage. A
/// body's members cannot be told apart by depth from its tail alone; OpenAI's responses put
/// `usage` after everything a caller shapes but `user` and `metadata` (whose values are
/// strings), so the last one is the response's. `None` if there is none.
pub fn usage_in_tail(tail: &[u8]) -> Option<TokenUsage> {
    let finder = memchr::memmem::FinderRev::new(b"\"usage\"");
    for at in finder.rfind_iter(tail) {
        // A quote escaped (an odd run of backslashes before it) is text inside a string; a run
        // that reaches the tail's start cannot be told.
        let run = tail[..at].iter().rev().take_while(|&&b| b == b'\\').count();
        if run % 2 == 1 || run == at {
            continue;
        }
        let colon = json::skip_space(tail, at + b"\"usage\"".len());
        if tail.get(colon) != Some(&b':') {
            continue;
        }
        let open = json::skip_space(tail, colon + 1);
        if tail.get(open) != Some(&b'{') {
            continue;
        }
        let Some(end) = json::value_end(tail, open) else {
            continue;
        };
        let raw = &tail[open..end];
        let usage = match quick_usage(raw) {
            Some(u) => u,
            None => serde_json::from_slice::<Usage>(raw).ok(),
        };
        // An object of that name with no count in it is not a usage.
        if let Some(u) = usage
            .filter(|u| u.total_tokens.is_some() || u.input().is_some() || u.output().is_some())
        {
            return Some(u.detail());
        }
    }
    None
}

/// A `usage` value: `null`, or an object of counts each a plain integer or `null`; `None` for
/// anything else (left to the full parse).
fn quick_usage(raw: &[u8]) -> Option<Option<Usage>> {
    if raw == b"null" {
        return Some(None);
    }
    let mut u = Usage::default();
    let mut seen = [false; 5];
    for member in json::members(raw) {
        let member = member.ok()?;
        if member.escaped {
            return None;
        }
        let (i, slot) = match member.key {
            b"total_tokens" => (0, &mut u.total_tokens),
            b"prompt_tokens" => (1, &mut u.prompt_tokens),
            b"completion_tokens" => (2, &mut u.completion_tokens),
            b"input_tokens" => (3, &mut u.input_tokens),
            b"output_tokens" => (4, &mut u.output_tokens),
            _ => continue,
        };
        if std::mem::replace(&mut seen[i], true) {
            return None;
        }
        *slot = plain_count(member.value)?;
    }
    Some(Some(u))
}

/// A count as JSON writes a `u64`: `null`, `0`, or digits without a leading zero that fit.
fn plain_count(raw: &[u8]) -> Option<Option<u64>> {
    match raw {
        b"null" => Some(None),
        [b'0'] => Some(Some(0)),
        [b'1'..=b'9', ..] => raw
            .iter()
            .try_fold(0u64, |n, &d| {
                let digit = d.is_ascii_digit().then(|| u64::from(d - b'0'))?;
                n.checked_mul(10)?.checked_add(digit)
            })
            .map(Some),
        _ => None,
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
#[cfg(test)]
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

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::super::request::prepare_request;

    #[test]
    fn a_tail_reads_the_last_usage_that_is_a_key() {
        let read = |t: &str| usage_in_tail(t.as_bytes()).map(|u| (u.input, u.output, u.total));
        // The response's, after output that mentions usage in its text (escaped quotes).
        let body = r#"ut":[{"text":"say \"usage\":{\"total_tokens\":1}"}],"usage":{"prompt_tokens":3,"completion_tokens":4},"user":null}"#;
        assert_eq!(read(body), Some((Some(3), Some(4), 7)));
        // The last key whose value is a usage object wins; one with no count is no usage.
        let body = r#"{"usage":{"total_tokens":5}},"tools":[],"usage":{"type":"object"}}"#;
        assert_eq!(read(body), Some((None, None, 5)));
        // A usage cut at the tail's start, or not closed within it, is not read.
        assert_eq!(read(r#"usage":{"total_tokens":5}}"#), None);
        assert_eq!(read(r#"{"usage":{"total_tokens":5"#), None);
        // A quote whose escape may lie before the tail's start cannot be told.
        assert_eq!(read(r#"\"usage":{"total_tokens":5}}"#), None);
        assert_eq!(read(r#"\\"usage":{"total_tokens":5}}"#), None);
        assert_eq!(
            read(r#"x "usage" : { "total_tokens" : 5 } }"#),
            Some((None, None, 5))
        );
    }

    #[test]
    fn a_tail_keeps_the_last_bytes_however_they_come() {
        let body: Vec<u8> = (0..5 * TAIL_BYTES).map(|i| (i % 251) as u8).collect();
        for piece in [1, 7, 4096, TAIL_BYTES - 1, TAIL_BYTES, 3 * TAIL_BYTES] {
            let mut t = Tail::default();
            for p in body.chunks(piece) {
                t.push(p);
                assert!(t.0.len() <= 2 * TAIL_BYTES, "pieces of {piece}");
            }
            assert!(
                t.0.ends_with(&body[body.len() - TAIL_BYTES..]),
                "pieces of {piece}"
            );
        }
    }
    use super::super::sse::model_in;
    use super::*;

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
    fn the_quick_read_gives_what_the_full_parse_does_or_defers_to_it() {
        let bodies: &[&[u8]] = &[
            br#"{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"say \"usage\": {}"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}"#,
            br#"{"usage":{"total_tokens":7}}"#,
            br#"{"usage":null,"model":null}"#,
            br#"{"usage":{"total_tokens":null,"prompt_tokens":3}}"#,
            br#"{"usage":{"prompt_tokens":0,"completion_tokens":18446744073709551615}}"#,
            br#"{"usage":{"prompt_tokens":18446744073709551616}}"#,
            br#"{"usage":{"prompt_tokens":1.5}}"#,
            br#"{"usage":{"prompt_tokens":-1}}"#,
            br#"{"usage":{"prompt_tokens":-0}}"#,
            br#"{"usage":{"prompt_tokens":01}}"#,
            br#"{"usage":{"prompt_tokens":"3"}}"#,
            br#"{"usage":{"prompt_tokens":3,"prompt_tokens":4}}"#,
            br#"{"usage":{"total_tokens":1},"usage":{"total_tokens":2}}"#,
            br#"{"us\u0061ge":{"total_tokens":5}}"#,
            br#"{"usage":{"tot\u0061l_tokens":5}}"#,
            br#"{"usage":{"total_tokens":5,"details":{"cached_tokens":2}}}"#,
            br#"{"usage":[]}"#,
            br#"{"usage":7}"#,
            br#"{"object":"thread.run.step","usage":{"total_tokens":9}}"#,
            br#"{"object":"thread.run\u002estep","usage":{"total_tokens":9}}"#,
            br#"{"object":7,"usage":{"total_tokens":9}}"#,
            br#"{"model":"a\"b","usage":{"total_tokens":1}}"#,
            br#"{"model":7,"usage":{"total_tokens":1}}"#,
            b"{\"model\":\"caf\xc3\xa9\",\"usage\":{\"total_tokens\":1}}",
            b"{\"model\":\"caf\xc3\",\"usage\":{\"total_tokens\":1}}",
            br#"{"type":"response.completed","response":{"model":"o3","usage":{"input_tokens":1,"output_tokens":2}}}"#,
            br#"{"model":"top","response":{"model":"nested","usage":{"total_tokens":4}}}"#,
            br#"{"response":null,"usage":{"total_tokens":4}}"#,
            br#"{"response":{"usage":{"total_tokens":"x"}}}"#,
            br#"{"error":{"message":"bad","type":"invalid_request_error"}}"#,
            b"  {\n \"usage\" :\t{ \"total_tokens\" : 12 } ,\r\n \"model\" : \"m\" }\n",
            b"{}",
            b"[]",
            b"not json",
            b"",
            // Stream chunks: with choices, with none, the usage-only one in its shapes.
            br#"{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}"#,
            br#"{"id":"c","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":20,"total_tokens":29}}"#,
            br#"{"choices":[ ],"usage":{"total_tokens":3}}"#,
            br#"{"choices":null,"usage":{"total_tokens":3}}"#,
            br#"{"usage":{"total_tokens":3}}"#,
            br#"{"choices":[],"usage":null}"#,
            br#"{"choices":[{"index":0}],"usage":{"total_tokens":3}}"#,
            br#"{"choices":[7],"usage":{"total_tokens":3}}"#,
        ];
        for body in bodies {
            let full = Read::full(body);
            assert_eq!(read(body), full, "{}", String::from_utf8_lossy(body));
            if let Some(quick) = quick_read(body) {
                assert_eq!(quick, full, "{}", String::from_utf8_lossy(body));
            }
        }
        // The common shapes are read quickly, not deferred: a body, a chunk, the usage chunk.
        for body in [
            bodies[0],
            bodies[bodies.len() - 8],
            bodies[bodies.len() - 7],
        ] {
            assert!(
                quick_read(body).is_some(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(read(bodies[bodies.len() - 7]).usage_only);
        // Choices the full parse refuses (not a list, or twice) make it charge nothing; this
        // reader charges the usage stated and calls it no usage-only chunk (towards stricter).
        for body in [
            &br#"{"choices":{},"usage":{"total_tokens":3}}"#[..],
            br#"{"choices":"none","usage":{"total_tokens":3}}"#,
            br#"{"choices":[],"choices":[],"usage":{"total_tokens":3}}"#,
        ] {
            assert_eq!(Read::full(body), Read::default());
            let quick = quick_read(body).expect("read quickly");
            assert_eq!(
                (quick.usage.map(|u| u.total), quick.usage_only),
                (Some(3), false)
            );
        }
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
}

#[cfg(test)]
mod quick_props {
    use super::*;

    use super::super::rng::Rng;

    fn ws(r: &mut Rng) -> &'static str {
        r.pick(&["", "", "", " ", "\n", "\t", "\r\n  "])
    }

    fn string(r: &mut Rng) -> String {
        let parts = [
            "a",
            "usage",
            "\\\"",
            "\\\\",
            "\\u0041",
            "\\ud83d\\ude00",
            "\u{e9}",
            "\u{1F600}",
            "}",
            "]",
            "{",
            "[",
            ",",
            ":",
            "\\n",
            "\\/",
            "total_tokens",
            "\\\"usage\\\":{",
            " ",
        ];
        let n = r.below(6) + if r.below(4) == 0 { 30 } else { 0 };
        let mut s = String::from("\"");
        for _ in 0..n {
            s.push_str(r.pick(&parts));
        }
        s.push('"');
        s
    }

    fn value(r: &mut Rng, depth: usize) -> String {
        match r.below(if depth > 3 { 5 } else { 8 }) {
            0 => string(r),
            1 => r
                .pick(&[
                    "0",
                    "-0",
                    "1e3",
                    "1.0",
                    "-12",
                    "3",
                    "1E+2",
                    "18446744073709551616",
                ])
                .into(),
            2 => r.pick(&["true", "false", "null"]).into(),
            3 | 4 => string(r),
            5 => {
                let n = r.below(4);
                let items: Vec<String> = (0..n)
                    .map(|_| format!("{}{}{}", ws(r), value(r, depth + 1), ws(r)))
                    .collect();
                format!("[{}{}]", items.join(","), ws(r))
            }
            _ => object(
                r,
                depth + 1,
                &["a", "usage", "model", "total_tokens", "choices"],
                &mut |r, d| value(r, d),
            ),
        }
    }

    fn object(
        r: &mut Rng,
        depth: usize,
        keys: &[&str],
        val: &mut dyn FnMut(&mut Rng, usize) -> String,
    ) -> String {
        let n = r.below(6);
        let mut members = Vec::new();
        for _ in 0..n {
            let k = r.pick(keys);
            let (a, b, c, d) = (ws(r), ws(r), ws(r), ws(r));
            members.push(format!("{a}\"{k}\"{b}:{c}{}{d}", val(r, depth)));
        }
        format!("{{{}{}}}", members.join(","), ws(r))
    }

    fn count(r: &mut Rng) -> String {
        r.pick(&[
            "0",
            "7",
            "123",
            "null",
            "1e3",
            "-0",
            "1.0",
            "-1",
            "\"3\"",
            "18446744073709551615",
            "18446744073709551616",
            "01",
            "10",
            "0.0",
            "5E0",
        ])
        .into()
    }

    fn usage(r: &mut Rng) -> String {
        match r.below(8) {
            0 => "null".into(),
            1 => value(r, 2),
            _ => object(
                r,
                1,
                &[
                    "total_tokens",
                    "prompt_tokens",
                    "completion_tokens",
                    "input_tokens",
                    "output_tokens",
                    "details",
                    "tot\\u0061l_tokens",
                    "total_tokens ",
                ],
                &mut |r, d| {
                    if r.below(5) == 0 {
                        value(r, d + 1)
                    } else {
                        count(r)
                    }
                },
            ),
        }
    }

    fn top(r: &mut Rng, depth: usize) -> String {
        let _ = depth;
        match r.below(12) {
            0..=2 => usage(r),
            3 => r
                .pick(&["[]", "[ ]", "null", "[{}]", "[1,2]", "{}", "\"x\""])
                .into(),
            4 => r
                .pick(&[
                    "\"thread.run.step\"",
                    "\"thread.run\"",
                    "\"thread.run\\u002estep\"",
                    "null",
                    "7",
                ])
                .into(),
            5 => r
                .pick(&[
                    "\"gpt-4o\"",
                    "\"a\\\"b\"",
                    "\"caf\u{e9}\"",
                    "null",
                    "7",
                    "\"\"",
                ])
                .into(),
            6 => {
                let u = usage(r);
                let m = r.pick(&["\"o3\"", "null", "7"]);
                format!("{{\"model\":{m},{}\"usage\":{u}}}", ws(r))
            }
            _ => value(r, 1),
        }
    }

    #[test]
    fn the_quick_read_agrees_with_the_full_parse_on_generated_bodies() {
        let mut r = Rng(0x2545_f491_4f6c_dd1d);
        let mut quick = 0;
        for _ in 0..50_000 {
            let body = object(
                &mut r,
                0,
                &[
                    "usage",
                    "usage",
                    "choices",
                    "object",
                    "model",
                    "response",
                    "id",
                    "us\\u0061ge",
                    "x",
                ],
                &mut top,
            );
            let body = format!("{}{body}{}", ws(&mut r), ws(&mut r));
            let b = body.as_bytes();
            if serde_json::from_slice::<serde_json::Value>(b).is_err() {
                continue;
            }
            // Documented: choices that the full parse refuses (twice, or not a list) are read
            // towards stricter.
            let choices = body.matches("\"choices\"").count();
            let odd_choices = choices > 1
                || serde_json::from_slice::<serde_json::Value>(b)
                    .ok()
                    .and_then(|v| v.get("choices").cloned())
                    .is_some_and(|c| !c.is_array() && !c.is_null());
            if odd_choices {
                continue;
            }
            let full = Read::full(b);
            if let Some(q) = quick_read(b) {
                quick += 1;
                assert_eq!(q, full, "{body}");
            }
            assert_eq!(read(b), full, "{body}");
        }
        assert!(quick > 1000, "{quick}");
    }
}
