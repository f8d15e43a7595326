//! The Realtime API's handshake URL and session events: the path, the `model` its query names,
//! the model a session event names.

use std::borrow::Cow;

use axum::http::Uri;
use serde::Deserialize;

use super::paths::percent_decoded;

/// The path of the Realtime API's WebSocket.
pub const PATH: &str = "/v1/realtime";

/// Whether `path` is the Realtime API's (a WebSocket upgrade of any other path is refused).
pub fn is_realtime(path: &str) -> bool {
    path == PATH
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
pub fn ambiguous_model(uri: &Uri) -> bool {
    let mut named = 0;
    for (name, _) in query_pairs(uri) {
        if name == "model" {
            named += 1;
        } else if *percent_decoded(name.as_bytes()) == *b"model" {
            return true;
        }
    }
    named > 1
}

/// The `model` a realtime URL names in its query, percent-decoded (the first, for a query that
/// [`malformed`] has not refused).
pub fn query_model(uri: &Uri) -> Option<String> {
    let value = query_pairs(uri).find_map(|(name, value)| (name == "model").then_some(value))?;
    String::from_utf8(percent_decoded(value.as_bytes()).into_owned())
        .ok()
        .filter(|m| !m.is_empty())
}

/// The model a `session.created` or `session.updated` server event names (`session.model`), if
/// `message` is one and names it.
pub fn session_model(message: &[u8]) -> Option<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const DONE: &str = r#"{"type":"response.done","response":{}}"#;
    const CREATED: &str = r#"{ "type" : "session.created", "session": {"model": "m"} }"#;

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
}
