//! Tokens charged after the response, from JSON bodies and from event streams; the usage chunk
//! the gateway asked for is hidden from callers that did not ask for it.

mod common;

use common::*;
use serde_json::Value;

const CONFIG: &str = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
org = "acme"
[[rate_limits]]
scope = "org"
id = "acme"
tpm = 100
"#;

/// `CONFIG` with a request limit on the key too: what a refused body would have taken shows.
const LIMITED: &str = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
org = "acme"
rate_limit = { requests = 5 }
[[rate_limits]]
scope = "org"
id = "acme"
tpm = 100
"#;

#[tokio::test]
async fn tokens_from_json_bodies_fill_the_window() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    // 60 tokens each: the first two pass (the window is below 100 when they start), then full.
    for expected_left in ["100", "40"] {
        let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT);
        req.headers_mut()
            .insert("x-test-tokens", "60".parse().unwrap());
        let r = gw.send(req).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("x-ratelimit-remaining-tokens"),
            Some(expected_left)
        );
        assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("100"));
        gw.settled().await;
    }
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT);
    req.headers_mut()
        .insert("x-test-tokens", "60".parse().unwrap());
    let r = gw.send(req).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("0"));
    assert!(r.header("retry-after").is_some());
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("for org") && message.contains("tokens"),
        "{message}"
    );
    assert_eq!(up.seen.hits(), 2);
}

#[tokio::test]
async fn tokens_from_streams_fill_the_window_and_the_usage_chunk_is_hidden() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT_STREAM);
    req.headers_mut()
        .insert("x-test-tokens", "70".parse().unwrap());
    let r = gw.send(req).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        up.seen.last_body()["stream_options"]["include_usage"],
        Value::Bool(true),
        "the gateway asks the upstream for usage"
    );
    let events = events(&r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(events.len(), 4, "3 content chunks and [DONE]: {events:?}");
    assert!(
        events.iter().all(|e| !e.contains("usage")),
        "usage was not asked for: {events:?}"
    );
    gw.settled().await;
    // 70 of 100: one more stream starts, then the window is full.
    let r = gw.chat("sk-k", CHAT_STREAM).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("30"));
    gw.settled().await;
    let r = gw.chat("sk-k", CHAT_STREAM).await;
    assert_eq!(r.status, 429);
}

#[tokio::test]
async fn an_answer_is_metered_whatever_the_case_of_its_media_type() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    // Media types are case-blind: an upstream that writes them otherwise is metered as one
    // that writes them in lower case (before, such an answer went uncharged).
    for (body, content_type, left) in [
        (CHAT, "Application/JSON; charset=UTF-8", "100"),
        (CHAT_STREAM, "Text/Event-Stream;charset=utf-8", "80"),
    ] {
        let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), body);
        req.headers_mut()
            .insert("x-test-tokens", "20".parse().unwrap());
        req.headers_mut()
            .insert("x-test-content-type", content_type.parse().unwrap());
        let r = gw.send(req).await;
        assert_eq!(r.status, 200, "{content_type}");
        assert_eq!(
            r.header("x-ratelimit-remaining-tokens"),
            Some(left),
            "{content_type}"
        );
        if body == CHAT_STREAM {
            assert!(
                events(&r.body).iter().all(|e| !e.contains("usage")),
                "the usage chunk the caller did not ask for is hidden"
            );
        }
        gw.settled().await;
    }
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("60"));
}

#[tokio::test]
async fn the_usage_chunk_is_kept_when_the_caller_asked_for_it() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let r = gw.chat("sk-k", CHAT_STREAM_USAGE).await;
    assert_eq!(r.status, 200);
    let events = events(&r.body);
    assert_eq!(events.len(), 5, "{events:?}");
    assert!(
        events[..3].iter().all(|e| e.contains("\"usage\":null")),
        "{events:?}"
    );
    let usage: Value = serde_json::from_str(&events[3]).unwrap();
    assert_eq!(usage["usage"]["total_tokens"], 50);
    assert_eq!(usage["choices"], Value::Array(vec![]));
    gw.settled().await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("50"));
}

#[tokio::test]
async fn keys_without_token_limits_are_forwarded_untouched() {
    let up = fake_upstream().await;
    let gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 10 }
"#,
        &up.url(),
    )
    .await;
    let r = gw.chat("sk-k", CHAT_STREAM).await;
    assert_eq!(r.status, 200);
    assert!(up.seen.last_body().get("stream_options").is_none());
    assert_eq!(events(&r.body).len(), 4);
}

#[tokio::test]
async fn a_body_naming_stream_twice_is_refused_and_charges_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(LIMITED, &up.url()).await;
    // Python and most parsers take the last `stream`, serde the first or neither: the gateway
    // cannot know whether the upstream will stream, so it does not guess.
    let r = gw
        .chat(
            "sk-k",
            r#"{"model":"m","stream":false,"stream":true,"messages":[]}"#,
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("more than one `stream`"), "{}", r.text());
    assert_eq!(up.seen.hits(), 0);
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-remaining-requests"),
        Some("4"),
        "the refused body took no request"
    );
}

#[tokio::test]
async fn metered_requests_ask_the_upstream_for_an_uncompressed_answer() {
    // Usage is read from the response as it passes: a gzip body would be charged nothing.
    let up = fake_upstream().await;
    let gw = gateway(
        &format!(
            "{CONFIG}[[keys]]\nid = \"plain\"\nsecret = \"sk-plain\"\nrate_limit = {{ requests = 10 }}\n"
        ),
        &up.url(),
    )
    .await;
    // A request without `Accept-Encoding` accepts any coding (RFC 9110 §12.5.3): a metered
    // one says `identity`, whatever the caller sent or left out.
    for (key, sent, upstream) in [
        ("sk-k", Some("gzip, br"), "identity"),
        ("sk-k", None, "identity"),
        ("sk-plain", Some("gzip, br"), "gzip, br"),
    ] {
        let mut req = gw.request("POST", "/v1/chat/completions", Some(key), CHAT);
        if let Some(sent) = sent {
            req.headers_mut()
                .insert("accept-encoding", sent.parse().unwrap());
        }
        assert_eq!(gw.send(req).await.status, 200);
        let headers = up.seen.last_headers();
        let seen: Vec<_> = headers.get_all("accept-encoding").iter().collect();
        assert_eq!(
            seen,
            [upstream],
            "{key}, {sent:?}: only a key without token limits passes Accept-Encoding on"
        );
    }
}

#[tokio::test]
async fn a_stream_flag_an_upstream_might_read_either_way_is_refused_and_charges_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(LIMITED, &up.url()).await;
    // Lenient servers stream for `"stream": 1` or `"true"`, and read a body with a NaN in it;
    // without the usage the gateway asks for, such a stream would never be charged.
    for body in [
        r#"{"model":"m","stream":1,"messages":[]}"#,
        r#"{"model":"m","stream":"true","messages":[]}"#,
        r#"{"model":"m","stream":true,"temperature":NaN,"messages":[]}"#,
        // A server in Go matches field names ignoring case.
        r#"{"model":"m","Stream":true,"messages":[]}"#,
    ] {
        let r = gw.chat("sk-k", body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(
            r.json()["error"]["type"],
            "invalid_request_error",
            "{}",
            r.text()
        );
    }
    // The same holds on a path a lenient router takes for the completions endpoint.
    let r = gw
        .send(gw.request(
            "POST",
            "/v1/chat/Completions/",
            Some("sk-k"),
            r#"{"model":"m","stream":1,"messages":[]}"#,
        ))
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(up.seen.hits(), 0);
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-remaining-requests"),
        Some("4"),
        "the refused bodies took no request"
    );
}

/// The org's tokens left once the charges of every answer so far (that of the caller of
/// [`send_and_leave_at`] included, however long it is read on) have landed.
async fn tokens_left(gw: &Gateway) -> Option<String> {
    gw.settled().await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200);
    r.header("x-ratelimit-remaining-tokens").map(str::to_owned)
}

#[tokio::test]
async fn a_json_answer_read_whole_is_charged_when_the_caller_leaves_before_its_end() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    // The upstream sends the whole completion at once and its end of body 5 s later; the caller
    // reads the completion and hangs up.
    send_and_leave_at(
        gw.addr,
        CHAT,
        "x-test-end-delay-ms: 5000\r\n",
        "total_tokens",
    )
    .await;
    // Its usage was all there: charged, as a caller that stays would be (well before the
    // upstream's end of body, 5 s on).
    let left = tokens_left(&gw).await;
    assert_eq!(left.as_deref(), Some("40"));
}

#[tokio::test]
async fn a_stream_left_after_its_answer_is_charged_its_usage_that_came_later() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    // The answer's last chunk has its finish_reason; the usage chunk comes 300 ms later, after
    // the caller has gone (as a client that stops reading at finish_reason does).
    let finished = "\"finish_reason\":\"stop\"";
    send_and_leave_at(
        gw.addr,
        CHAT_STREAM,
        "x-test-usage-delay-ms: 300\r\n",
        finished,
    )
    .await;
    let left = tokens_left(&gw).await;
    assert_eq!(left.as_deref(), Some("40"));
}

#[tokio::test]
async fn a_responses_stream_left_after_its_output_is_charged_its_usage_that_came_later() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    // The Responses API ends its output with `response.output_item.done`; the usage comes with
    // `response.completed`, here 300 ms later, after the caller has gone. Before, only a
    // finish_reason told an answer complete, so such a stream was cut there and charged a
    // token an event (4), its input tokens never.
    let body = r#"{"model":"m","stream":true,"input":"hi"}"#;
    let delay = "x-test-usage-delay-ms: 300\r\n";
    let (conn, _) =
        send_to_and_read_until(gw.addr, "/v1/responses", body, delay, "output_item.done").await;
    drop(conn);
    let left = tokens_left(&gw).await;
    assert_eq!(left.as_deref(), Some("40"));
}

/// An upstream that answers every request (kept alive) with a chunked event stream whose
/// usage event lacks its final blank line, followed by trailers.
async fn trailing_upstream() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    // A request: its head, then as many body bytes as it announces.
                    let head_end = loop {
                        if let Some(at) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            break at + 4;
                        }
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&seen[..head_end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while seen.len() < head_end + length {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    seen.drain(..head_end + length);
                    let chunk = |text: &str| format!("{:x}\r\n{text}\r\n", text.len());
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                         transfer-encoding: chunked\r\ntrailer: x-done\r\n\r\n{}{}0\r\nx-done: 1\r\n\r\n",
                        chunk(
                            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\n"
                        ),
                        chunk(
                            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":5,\"total_tokens\":9}}"
                        ),
                    );
                    if conn.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

#[tokio::test]
async fn a_last_event_cut_short_by_trailers_is_read_and_passed_on() {
    let gw = gateway(CONFIG, &trailing_upstream().await).await;
    // The usage event has no final blank line, and trailers follow it. Before, the trailers
    // went out while the event was still held, hyper sent nothing of the body after them, and
    // the stream was charged as one cut short (a token an event), its usage never read.
    let r = gw.chat("sk-k", CHAT_STREAM_USAGE).await;
    assert_eq!(r.status, 200);
    let events = events(&r.body);
    assert!(
        events
            .last()
            .is_some_and(|e| e.contains("\"total_tokens\":9")),
        "the last event reaches the caller: {events:?}"
    );
    gw.settled().await;
    let r = gw.chat("sk-k", CHAT_STREAM_USAGE).await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("91"));
}

#[tokio::test]
async fn a_stream_left_mid_answer_is_cut_and_charges_the_chunks_it_passed() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    // The answer's last chunk comes 1 s after its first two, then the usage; the caller leaves
    // after the first chunk. The gateway does not read on (the upstream would generate the whole
    // answer for nobody), and no usage reaches it: it charges a token a chunk it passed (one,
    // or two if the second came before it saw the caller go), not the 60 of the usage, and
    // not nothing, which a caller could have by hanging up just before the end.
    let delays = "x-test-last-delay-ms: 1000\r\nx-test-usage-delay-ms: 0\r\n";
    send_and_leave_at(gw.addr, CHAT_STREAM, delays, "Hel").await;
    let left = tokens_left(&gw).await;
    assert!(matches!(left.as_deref(), Some("99" | "98")), "{left:?}");
}

#[tokio::test]
async fn a_stream_the_upstream_breaks_off_before_its_usage_charges_the_chunks_it_passed() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    // The answer's three chunks come, the last with `"finish_reason": "stop"`, then, 200 ms
    // later (when the usage chunk would come), the upstream breaks off. The answer was complete, so the gateway would
    // wait for the usage after a caller left; but the upstream is gone: no usage will come, and
    // the stream is charged as any cut one is, a token a chunk it passed.
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT_STREAM);
    for (name, value) in [
        ("x-test-usage-delay-ms", "200"),
        ("x-test-break-after-finish", "1"),
    ] {
        req.headers_mut().insert(name, value.parse().unwrap());
    }
    assert!(
        gw.send_and_see_it_break(req).await,
        "the caller sees the break"
    );
    let left = tokens_left(&gw).await;
    assert_eq!(left.as_deref(), Some("97"));
}

#[tokio::test]
async fn a_stream_that_ends_without_usage_charges_the_chunks_it_passed() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    // An upstream that ignores `include_usage`: three chunks and `[DONE]`, no usage. Charged
    // nothing, every stream of such an upstream would pass its token limit; charged a token a
    // chunk, as a stream cut before its usage is.
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT_STREAM);
    req.headers_mut()
        .insert("x-test-ignore-include-usage", "1".parse().unwrap());
    let r = gw.send(req).await;
    assert_eq!(r.status, 200);
    assert_eq!(events(&r.body).len(), 4, "3 chunks and [DONE]");
    let left = tokens_left(&gw).await;
    assert_eq!(left.as_deref(), Some("97"));
}

/// Only the answer to a request that made the upstream generate is charged: a stored response
/// fetched or cancelled carries the usage of work done (and charged) before, and charging it
/// at every fetch would fill the window with tokens used once.
#[tokio::test]
async fn fetching_a_stored_response_charges_nothing_creating_one_charges_its_usage() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    for (method, path) in [
        ("GET", "/v1/responses/resp_1"),
        ("POST", "/v1/responses/resp_1/cancel"),
        ("GET", "/v1/responses/resp_1"),
    ] {
        let r = gw.send(gw.request(method, path, Some("sk-k"), "")).await;
        assert_eq!(r.status, 200, "{method} {path}");
        assert_eq!(
            r.json()["usage"]["total_tokens"],
            50,
            "the body is untouched"
        );
        gw.settled().await;
    }
    let r = gw
        .send(gw.request("POST", "/v1/responses", Some("sk-k"), CHAT))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        Some("100"),
        "the fetches charged nothing"
    );
    assert_eq!(tokens_left(&gw).await.as_deref(), Some("50"));
}

/// A JSON answer too large to hold whole (over 16 MiB: the output before its usage) is charged
/// the usage at its end, read from its last bytes.
#[tokio::test]
async fn a_json_answer_too_large_to_hold_is_charged_the_usage_at_its_end() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT);
    let headers = req.headers_mut();
    headers.insert("x-test-tokens", "30".parse().unwrap());
    headers.insert("x-test-content-bytes", (17u64 << 20).into());
    let r = gw.send(req).await;
    assert_eq!(r.status, 200);
    assert!(r.text().len() > 17 << 20, "forwarded whole");
    let left = tokens_left(&gw).await;
    assert_eq!(left.as_deref(), Some("70"));
}

/// Any other POST is charged the usage its answer carries, whatever the API: an
/// Anthropic-style `/v1/messages` on a LiteLLM or vLLM upstream.
#[tokio::test]
async fn a_post_to_another_api_is_charged_its_usage() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let mut req = gw.request("POST", "/v1/messages", Some("sk-k"), CHAT);
    req.headers_mut()
        .insert("x-test-tokens", "30".parse().unwrap());
    assert_eq!(gw.send(req).await.status, 200);
    let left = tokens_left(&gw).await;
    assert_eq!(left.as_deref(), Some("70"));
}

/// A background response is answered at once without usage, and its usage only ever comes in
/// fetches of the stored response, which are not charged: refused, uncharged, with a message
/// that says why; so are the forms an upstream might read either way.
#[tokio::test]
async fn a_background_response_is_refused_and_charges_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(LIMITED, &up.url()).await;
    for body in [
        r#"{"model":"m","input":"hi","background":true}"#,
        r#"{"model":"m","input":"hi","background":1}"#,
        r#"{"model":"m","input":"hi","background":false,"background":true}"#,
        r#"{"model":"m","input":"hi","background":true"#,
    ] {
        let r = gw
            .send(gw.request("POST", "/v1/responses", Some("sk-k"), body))
            .await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
    }
    // Spacing and field order an upstream may care about: forwarded byte for byte.
    let body = r#"{ "model":"m",  "input":"hi","background" : false }"#;
    let r = gw
        .send(gw.request("POST", "/v1/responses", Some("sk-k"), body))
        .await;
    assert_eq!(r.status, 200);
    let raw = up.seen.last_raw_body.lock().unwrap().clone();
    assert_eq!(raw.as_deref(), Some(body.as_bytes()));
    assert_eq!(
        r.header("x-ratelimit-remaining-requests"),
        Some("4"),
        "the refused bodies took no request"
    );
}

/// Work whose tokens come later, where the gateway never sees them, is refused to a key with a
/// token limit, uncharged: an ephemeral Realtime key or a WebRTC call (the session runs at the
/// upstream, outside the gateway), a batch, a fine-tuning job, an eval run. A key without token
/// limits passes them on.
#[tokio::test]
async fn work_metered_nowhere_is_refused_to_a_key_with_a_token_limit() {
    let up = fake_upstream().await;
    let config = format!(
        "{LIMITED}[[keys]]\nid = \"plain\"\nsecret = \"sk-plain\"\nrate_limit = {{ requests = 100 }}\n"
    );
    let gw = gateway(&config, &up.url()).await;
    let paths = [
        "/v1/realtime/client_secrets",
        "/v1/realtime/sessions",
        "/v1/realtime/transcription_sessions",
        "/v1/realtime/calls",
        "/v1/realtime?model=gpt-realtime",
        "/v1/batches",
        "/v1/fine_tuning/jobs",
        "/v1/evals/eval_1/runs",
        "/v1/Realtime/Client_Secrets/",
        "/v1/batche%73",
    ];
    for path in paths {
        let r = gw
            .send(gw.request("POST", path, Some("sk-k"), r#"{"model":"m"}"#))
            .await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        assert!(
            r.text().contains("tokens come later"),
            "{path}: {}",
            r.text()
        );
    }
    assert_eq!(up.seen.hits(), 0, "nothing went upstream");
    // Nothing was charged: the key's five requests are all there.
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
    // Fetching, cancelling or listing them is not refused; nor is anything for a key without
    // token limits.
    for (key, method, path) in [
        ("sk-k", "GET", "/v1/batches/batch_1"),
        ("sk-k", "POST", "/v1/batches/batch_1/cancel"),
        ("sk-plain", "POST", "/v1/batches"),
        ("sk-plain", "POST", "/v1/realtime/client_secrets"),
    ] {
        let r = gw
            .send(gw.request(method, path, Some(key), r#"{"model":"m"}"#))
            .await;
        assert_ne!(r.status, 400, "{key} {method} {path}: {}", r.text());
    }
}

/// A completion body over `[server] max_body_mib` is refused with 413 and charges nothing,
/// whether its length is announced (refused unread) or it comes chunked.
#[tokio::test]
async fn a_body_over_the_limit_is_refused_with_413_and_charges_nothing() {
    let up = fake_upstream().await;
    let config = LIMITED.replace("[upstream]", "[server]\nmax_body_mib = 1\n[upstream]");
    let gw = gateway(&config, &up.url()).await;
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(1 << 20)
    );
    let r = gw
        .send(gw.request("POST", "/v1/chat/completions", Some("sk-k"), &big))
        .await;
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("5"));
    // Chunked: no length announced, the limit stops the read.
    let chunks = futures_chunks(big.into_bytes());
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), "");
    *req.body_mut() = chunks;
    req.headers_mut().remove("content-length");
    let r = gw.send(req).await;
    assert_eq!(r.status, 413, "{}", r.text());
    // A body within the limit passes, and is the first request charged.
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
    assert_eq!(up.seen.hits(), 1);
}

/// `bytes` as a streamed body of 64 KiB chunks, with no length.
fn futures_chunks(bytes: Vec<u8>) -> axum::body::Body {
    let chunks: Vec<Result<bytes::Bytes, std::io::Error>> = bytes
        .chunks(64 * 1024)
        .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
        .collect();
    axum::body::Body::from_stream(futures_util::stream::iter(chunks))
}

/// A metered key's completion or Responses body is read before it is forwarded; a compressed
/// one cannot be, and forwarded unread it could ask for what goes uncharged: 415, with
/// `Accept-Encoding: identity`, nothing charged.
#[tokio::test]
async fn a_compressed_body_of_a_metered_key_is_refused_with_415_and_charges_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(LIMITED, &up.url()).await;
    for path in ["/v1/chat/completions", "/v1/responses"] {
        let mut req = gw.request("POST", path, Some("sk-k"), "\u{1f}\u{8b}not json");
        req.headers_mut()
            .insert("content-encoding", "gzip".parse().unwrap());
        let r = gw.send(req).await;
        assert_eq!(r.status, 415, "{path}: {}", r.text());
        assert_eq!(r.header("accept-encoding"), Some("identity"));
        assert_eq!(r.json()["error"]["code"], "unsupported_content_encoding");
    }
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
}

/// A metered completion is read before it is forwarded; it reaches the upstream whole, framed by
/// one `Content-Length` of its length, whether it came with its length or chunked.
#[tokio::test]
async fn a_metered_completion_reaches_the_upstream_framed_by_its_length() {
    let up = fake_upstream().await;
    let gw = gateway(LIMITED, &up.url()).await;
    let framing = |up: &FakeUpstream| {
        let h = up.seen.last_headers();
        let lengths: Vec<String> = h
            .get_all("content-length")
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        (lengths, h.contains_key("transfer-encoding"))
    };
    let want: Value = serde_json::from_str(CHAT).unwrap();
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(framing(&up), (vec![CHAT.len().to_string()], false));
    assert_eq!(up.seen.last_body(), want);
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), "");
    *req.body_mut() = futures_chunks(CHAT.as_bytes().to_vec());
    req.headers_mut().remove("content-length");
    let r = gw.send(req).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(framing(&up), (vec![CHAT.len().to_string()], false));
    assert_eq!(up.seen.last_body(), want);
    assert_eq!(up.seen.hits(), 2);
}
