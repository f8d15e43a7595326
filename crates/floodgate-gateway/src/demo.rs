//! The built-in demo upstream (`[upstream] demo = true`): answers `POST /v1/chat/completions`
//! with a fixed reply and a real `usage`, as JSON or as a server-sent event stream, and
//! `GET /v1/models`, so that the quick start needs no outside service. It is not a model: it
//! says so in its reply and the gateway says so in its logs.
//!
//! Token counts follow the usual rule of thumb of four characters per token for the prompt, and
//! one token per word of the reply.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

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
        "The floodgate demo upstream only answers POST /v1/chat/completions and GET /v1/models.",
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
