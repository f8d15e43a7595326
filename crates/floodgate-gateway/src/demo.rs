//! The built-in demo upstream (`[upstream] demo = true`): answers `POST /v1/chat/completions`
//! with a fixed reply and a real `usage`, as JSON or as a server-sent event stream,
//! `GET /v1/models`, and Realtime API sessions on `/v1/realtime` ([`serve_realtime`]), so that
//! the quick start needs no outside service. It is not a model: it says so in its reply and the
//! gateway says so in its logs.
//!
//! Token counts follow the usual rule of thumb of four characters per token for the prompt, and
//! one token per word of the reply.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::openai::frames::frame;
use crate::openai::realtime::query_model;

/// The demo's reply to every chat completion.
pub const REPLY: &str =
    "Hello from the floodgate demo upstream! This is a fixed reply, not a model.";
/// The model name the demo reports when the request names none.
pub const MODEL: &str = "floodgate-demo";
/// Pause between two chunks of a streamed reply.
const CHUNK_INTERVAL: Duration = Duration::from_millis(20);

/// The demo upstream's routes.
pub fn router() -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .fallback(not_found)
}

#[derive(Deserialize)]
struct ChatRequest {
    model: Option<String>,
    #[serde(default)]
    messages: Vec<Value>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}});
    (status, Json(body)).into_response()
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "The floodgate demo upstream only answers POST /v1/chat/completions, GET /v1/models and \
         WebSocket sessions on GET /v1/realtime.",
    )
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "floodgate-demo"}
    ]}))
}

fn prompt_tokens(messages: &[Value]) -> u64 {
    let chars: usize = messages
        .iter()
        .map(|m| match m.get("content") {
            Some(Value::String(s)) => s.chars().count(),
            Some(other) => other.to_string().len(),
            None => 0,
        })
        .sum();
    // ~4 characters a token, plus a few tokens of framing per message.
    (chars as u64).div_ceil(4) + 3 * messages.len() as u64 + 3
}

async fn chat(body: Bytes) -> Response {
    let Ok(req) = serde_json::from_slice::<ChatRequest>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "The request body is not a chat completion request (JSON with `messages`).",
        );
    };
    let model = req.model.unwrap_or_else(|| MODEL.to_owned());
    let prompt = prompt_tokens(&req.messages);
    let words: Vec<&'static str> = REPLY.split_inclusive(' ').collect();
    let completion = words.len() as u64;
    let usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    });
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let id = format!("chatcmpl-demo-{created}");
    if !req.stream {
        return Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": REPLY},
                "finish_reason": "stop",
            }],
            "usage": usage,
        }))
        .into_response();
    }
    let include_usage = req.stream_options.and_then(|o| o.include_usage) == Some(true);
    let chunk = move |delta: Value, finish: Value, usage: Value| {
        let mut c = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        });
        if include_usage {
            c["usage"] = usage;
        }
        c
    };
    let mut events: Vec<String> = Vec::with_capacity(words.len() + 4);
    events.push(sse(&chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
        Value::Null,
    )));
    for w in &words {
        events.push(sse(&chunk(json!({"content": w}), Value::Null, Value::Null)));
    }
    events.push(sse(&chunk(json!({}), json!("stop"), Value::Null)));
    if include_usage {
        let mut last = chunk(json!({}), Value::Null, usage);
        last["choices"] = json!([]);
        events.push(sse(&last));
    }
    events.push("data: [DONE]\n\n".to_owned());
    let stream =
        futures_util::stream::unfold(events.into_iter().enumerate(), |mut it| async move {
            let (i, event) = it.next()?;
            if i > 0 {
                tokio::time::sleep(CHUNK_INTERVAL).await;
            }
            Some((Ok::<_, std::convert::Infallible>(Bytes::from(event)), it))
        });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

// ---------------------------------------------------------------------------------------------
// The Realtime API.

/// Largest client message the demo reads; a larger one ends the session (close 1009).
const MAX_REALTIME_MESSAGE: usize = 1024 * 1024;

/// Serves the demo's Realtime API over `io`, one end of an in-process pipe whose other end the
/// gateway's upstream client holds: HTTP/1.1 whose `GET /v1/realtime` WebSocket upgrade starts a
/// session. In it, `session.update`, `conversation.item.create` and `response.create` are
/// answered as the Realtime API does (the reply is [`REPLY`], a word per
/// `response.output_text.delta`, then `response.done` with a real `usage`); anything else gets an
/// `error` event.
pub async fn serve_realtime<I>(io: I)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service =
        hyper::service::service_fn(|req| async move { Ok::<_, Infallible>(realtime_upgrade(req)) });
    if let Err(e) = hyper::server::conn::http1::Builder::new()
        .serve_connection(io, service)
        .with_upgrades()
        .await
    {
        tracing::debug!(error = %e, "demo realtime connection ended");
    }
}

fn realtime_upgrade(mut req: hyper::Request<Incoming>) -> Response {
    if req.uri().path() != "/v1/realtime" {
        return error(
            StatusCode::NOT_FOUND,
            "The floodgate demo upstream answers WebSocket upgrades on /v1/realtime only.",
        );
    }
    let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY) else {
        return error(StatusCode::BAD_REQUEST, "No Sec-WebSocket-Key.");
    };
    let accept = websocket_accept(key.as_bytes());
    // Read as the gateway reads it (it refuses a query that could be read two ways).
    let model = query_model(req.uri()).unwrap_or_else(|| MODEL.to_owned());
    // Offered by OpenAI's browser clients: taken, as the Realtime API does.
    let realtime_protocol = req
        .headers()
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == "realtime");
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        match upgrade.await {
            Ok(io) => realtime_session(TokioIo::new(io), model).await,
            Err(e) => tracing::debug!(error = %e, "demo realtime upgrade failed"),
        }
    });
    let mut resp = Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept);
    if realtime_protocol {
        resp = resp.header(header::SEC_WEBSOCKET_PROTOCOL, "realtime");
    }
    resp.body(Body::empty())
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "bad handshake"))
}

/// `Sec-WebSocket-Accept` for `key` (RFC 6455, 4.2.2): base64 of the SHA-1 of the key and a
/// fixed GUID.
fn websocket_accept(key: &[u8]) -> String {
    let mut sha1 = sha1_smol::Sha1::new();
    sha1.update(key.trim_ascii());
    sha1.update(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    base64(&sha1.digest().bytes())
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let byte = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (byte(0) << 16) | (byte(1) << 8) | byte(2);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A message from the client: opcode and payload, fragments joined.
struct ClientMessage {
    opcode: u8,
    payload: Vec<u8>,
}

/// The next message from the client, or its close frame. A ping, before or between a
/// message's fragments, is answered at once and the message read on; a pong is passed over.
/// `None` when the connection ends, or on a frame that breaks the protocol: a message over
/// [`MAX_REALTIME_MESSAGE`] (after a close 1009), a control frame over 125 bytes (after a close
/// 1002).
async fn read_message<S: AsyncRead + AsyncWrite + Unpin>(io: &mut S) -> Option<ClientMessage> {
    let mut message: Option<ClientMessage> = None;
    loop {
        let mut head = [0u8; 2];
        io.read_exact(&mut head).await.ok()?;
        let len = match head[1] & 0x7f {
            126 => u64::from(io.read_u16().await.ok()?),
            127 => io.read_u64().await.ok()?,
            n => u64::from(n),
        };
        let mut mask = [0u8; 4];
        if head[1] & 0x80 != 0 {
            io.read_exact(&mut mask).await.ok()?;
        }
        let (fin, opcode) = (head[0] & 0x80 != 0, head[0] & 0x0f);
        let control = opcode & 0x08 != 0;
        let held = message.as_ref().map_or(0, |m| m.payload.len());
        // A 64-bit length may be anything: checked, never added blindly.
        let fits = usize::try_from(len).ok().filter(|&l| {
            if control {
                l <= 125
            } else {
                held.checked_add(l)
                    .is_some_and(|total| total <= MAX_REALTIME_MESSAGE)
            }
        });
        let Some(len) = fits else {
            let status: u16 = if control { 1002 } else { 1009 };
            send_frame(io, 0x8, &status.to_be_bytes()).await;
            return None;
        };
        let mut payload = vec![0u8; len];
        io.read_exact(&mut payload).await.ok()?;
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= mask[i % 4];
        }
        match opcode {
            0x8 => return Some(ClientMessage { opcode, payload }),
            // May come between fragments (RFC 6455, 5.4): the message so far is kept.
            0x9 => {
                send_frame(io, 0xA, &payload).await;
                continue;
            }
            _ if control => continue,
            _ => {}
        }
        match &mut message {
            Some(m) => m.payload.extend_from_slice(&payload),
            None => message = Some(ClientMessage { opcode, payload }),
        }
        if fin {
            return message;
        }
    }
}

/// Writes one unmasked (server) frame; a failure ends the session at the next read.
async fn send_frame<S: AsyncWrite + Unpin>(io: &mut S, opcode: u8, payload: &[u8]) {
    let _ = io.write_all(&frame(true, opcode, payload, None)).await;
    let _ = io.flush().await;
}

/// `event` as text with its `type` first, as the Realtime API sends its events (the gateway
/// tells the events it meters by their first bytes).
fn type_first(mut event: Value) -> String {
    let Some(kind) = event.as_object_mut().and_then(|o| o.remove("type")) else {
        return event.to_string();
    };
    // The other members, `{...}`: the type goes in after the brace.
    let rest = event.to_string();
    match rest.as_str() {
        "{}" => format!("{{\"type\":{kind}}}"),
        _ => format!("{{\"type\":{kind},{}", &rest[1..]),
    }
}

/// One demo Realtime session: events answered until the client closes.
async fn realtime_session<S: AsyncRead + AsyncWrite + Unpin>(mut io: S, model: String) {
    let mut events = 0u64;
    let mut send = async |io: &mut S, mut event: Value| {
        events += 1;
        event["event_id"] = json!(format!("event_demo_{events}"));
        send_frame(io, 0x1, type_first(event).as_bytes()).await;
    };
    let session = json!({"id": "sess_demo", "object": "realtime.session", "model": model});
    send(
        &mut io,
        json!({"type": "session.created", "session": session}),
    )
    .await;
    // The conversation so far, for the input tokens of each response (the whole conversation is
    // the model's input every turn).
    let (mut chars, mut items) = (0u64, 0u64);
    let mut responses = 0u64;
    while let Some(m) = read_message(&mut io).await {
        let event: Value = match m.opcode {
            0x8 => {
                send_frame(&mut io, 0x8, &m.payload).await;
                return;
            }
            0x1 => serde_json::from_slice(&m.payload).unwrap_or(Value::Null),
            _ => Value::Null,
        };
        match event["type"].as_str().unwrap_or_default() {
            "session.update" => {
                send(
                    &mut io,
                    json!({"type": "session.updated", "session": session}),
                )
                .await;
            }
            "conversation.item.create" => {
                let item = &event["item"];
                chars += item["content"].as_array().map_or(0, |parts| {
                    parts
                        .iter()
                        .filter_map(|p| p["text"].as_str())
                        .map(|t| t.chars().count())
                        .sum::<usize>()
                }) as u64;
                items += 1;
                send(
                    &mut io,
                    json!({"type": "conversation.item.created", "item": item}),
                )
                .await;
            }
            "response.create" => {
                responses += 1;
                let id = format!("resp_demo_{responses}");
                send(
                    &mut io,
                    json!({"type": "response.created", "response": {"id": id, "object": "realtime.response", "status": "in_progress"}}),
                )
                .await;
                let words: Vec<&str> = REPLY.split_inclusive(' ').collect();
                for w in &words {
                    tokio::time::sleep(CHUNK_INTERVAL).await;
                    send(
                        &mut io,
                        json!({"type": "response.output_text.delta", "response_id": id, "delta": w}),
                    )
                    .await;
                }
                send(
                    &mut io,
                    json!({"type": "response.output_text.done", "response_id": id, "text": REPLY}),
                )
                .await;
                // The demo's rule of thumb, as for chat completions.
                let input = chars.div_ceil(4) + 3 * items + 3;
                let output = words.len() as u64;
                send(
                    &mut io,
                    json!({"type": "response.done", "response": {
                        "id": id,
                        "object": "realtime.response",
                        "status": "completed",
                        "output": [{"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": REPLY}]}],
                        "usage": {"total_tokens": input + output, "input_tokens": input, "output_tokens": output},
                    }}),
                )
                .await;
                // The reply joins the conversation.
                chars += REPLY.chars().count() as u64;
                items += 1;
            }
            _ => {
                send(
                    &mut io,
                    json!({"type": "error", "error": {
                        "type": "invalid_request_error",
                        "message": "The floodgate demo upstream answers session.update, conversation.item.create and response.create (JSON text messages).",
                    }}),
                )
                .await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accept_of_rfc_6455s_sample_key() {
        assert_eq!(
            websocket_accept(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    /// A client's frame (masked) of at most 125 bytes.
    fn client_frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mask = [7, 1, 3, 5];
        let mut out = vec![(u8::from(fin) << 7) | opcode, 0x80 | payload.len() as u8];
        out.extend_from_slice(&mask);
        out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        out
    }

    #[tokio::test]
    async fn a_ping_between_fragments_is_answered_and_the_message_kept() {
        let (mut client, mut server) = tokio::io::duplex(4096);
        let mut sent = client_frame(false, 0x1, br#"{"type":"#);
        sent.extend(client_frame(true, 0x9, b"hi"));
        sent.extend(client_frame(true, 0xA, b""));
        sent.extend(client_frame(true, 0x0, br#""response.create"}"#));
        client.write_all(&sent).await.unwrap();
        let m = read_message(&mut server).await.unwrap();
        assert_eq!(
            (m.opcode, m.payload.as_slice()),
            (0x1, br#"{"type":"response.create"}"#.as_slice())
        );
        let mut pong = [0u8; 4];
        client.read_exact(&mut pong).await.unwrap();
        assert_eq!(pong, [0x8A, 2, b'h', b'i']);
    }

    #[tokio::test]
    async fn a_length_past_any_bound_closes_the_session() {
        let (mut client, mut server) = tokio::io::duplex(4096);
        let mut sent = client_frame(false, 0x1, b"0123456789");
        // A continuation as long as a 64-bit length can say: no room, and no sum, for it.
        sent.extend([0x80, 0x80 | 127]);
        sent.extend(u64::MAX.to_be_bytes());
        sent.extend([0; 4]);
        client.write_all(&sent).await.unwrap();
        assert!(read_message(&mut server).await.is_none());
        let mut close = [0u8; 4];
        client.read_exact(&mut close).await.unwrap();
        assert_eq!(close[..2], [0x88, 2]);
        assert_eq!(u16::from_be_bytes([close[2], close[3]]), 1009);
    }

    #[tokio::test]
    async fn a_path_it_does_not_answer_names_every_one_it_does() {
        use http_body_util::BodyExt;
        use tower::ServiceExt;
        let req = axum::http::Request::get("/v1/embeddings")
            .body(Body::empty())
            .unwrap();
        let answer = router().oneshot(req).await.unwrap();
        assert_eq!(answer.status(), StatusCode::NOT_FOUND);
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&body).unwrap();
        let message = body["error"]["message"].as_str().unwrap();
        for route in [
            "POST /v1/chat/completions",
            "GET /v1/models",
            "GET /v1/realtime",
        ] {
            assert!(message.contains(route), "{route} missing from {message}");
        }
    }

    #[test]
    fn events_are_sent_type_first() {
        let event =
            json!({"type": "session.created", "event_id": "e_1", "session": {"model": "m"}});
        let text = type_first(event.clone());
        assert!(text.starts_with(r#"{"type":"session.created","#), "{text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), event);
        assert_eq!(type_first(json!({"type": "x"})), r#"{"type":"x"}"#);
    }
}
