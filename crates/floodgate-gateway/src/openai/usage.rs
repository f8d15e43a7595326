//! Usage as OpenAI-compatible APIs report it: a JSON body's or a stream chunk's `usage`
//! (`total_tokens`, else input plus output, in either API's spelling), and a Realtime
//! `response.done` event's.

use serde::Deserialize;
use serde::de::IgnoredAny;

#[derive(Deserialize)]
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

/// A JSON response body's usage and the model it names, if any.
pub fn usage_and_model_from_json(body: &[u8]) -> (Option<TokenUsage>, Option<String>) {
    match serde_json::from_slice::<UsageCarrier>(body) {
        Ok(c) => (c.usage(), c.into_model()),
        Err(_) => (None, None),
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
