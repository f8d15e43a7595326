//! Shared test harness: a fake OpenAI-compatible upstream and the gateway, both on 127.0.0.1:0.
#![allow(dead_code, missing_docs)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use floodgate_gateway::store::GatewayStore;
use floodgate_gateway::{AppState, Config};
use futures_util::StreamExt;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// What the fake upstream saw.
#[derive(Clone, Default)]
pub struct Seen {
    pub hits: Arc<AtomicUsize>,
    pub last_body: Arc<Mutex<Option<Value>>>,
    pub last_headers: Arc<Mutex<Option<HeaderMap>>>,
    /// The last Responses API body, as its bytes came.
    pub last_raw_body: Arc<Mutex<Option<Bytes>>>,
    /// TLS handshakes completed (`fake_upstream_tls` only).
    pub tls_handshakes: Arc<AtomicUsize>,
}

impl Seen {
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
    pub fn last_body(&self) -> Value {
        self.last_body
            .lock()
            .unwrap()
            .clone()
            .unwrap_or(Value::Null)
    }
    pub fn tls_handshakes(&self) -> usize {
        self.tls_handshakes.load(Ordering::SeqCst)
    }
    pub fn last_headers(&self) -> HeaderMap {
        self.last_headers
            .lock()
            .unwrap()
            .clone()
            .unwrap_or_default()
    }
}

pub struct FakeUpstream {
    pub addr: SocketAddr,
    pub seen: Seen,
}

impl FakeUpstream {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// The https URL by host name (the test certificate's `localhost`).
    pub fn https_url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }
}

fn header_u64(h: &HeaderMap, name: &str, default: u64) -> u64 {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Chat completions with `usage` (total `x-test-tokens`, default 50), as JSON or SSE, naming the
/// model `x-test-model` (default `fake`; `-`: no model at all); for SSE
/// the last content chunk comes `x-test-last-delay-ms` (default 0) after the first ones, and with
/// `x-test-usage-delay-ms` that last chunk carries `"finish_reason": "stop"` and the usage chunk
/// comes that long after it (with `x-test-break-after-finish` the upstream breaks off then
/// instead: no usage chunk, no `[DONE]`, the body ends in an error); a JSON
/// body ends (its last, empty chunk) `x-test-end-delay-ms` (default 0) after it was sent whole,
/// its message's content `x-test-content-bytes` (default 2) long.
async fn chat(State(seen): State<Seen>, headers: HeaderMap, body: Bytes) -> Response {
    seen.hits.fetch_add(1, Ordering::SeqCst);
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    *seen.last_body.lock().unwrap() = Some(req.clone());
    *seen.last_headers.lock().unwrap() = Some(headers.clone());
    let total = header_u64(&headers, "x-test-tokens", 50);
    let usage = json!({"prompt_tokens": total / 2, "completion_tokens": total - total / 2, "total_tokens": total});
    let model = headers
        .get("x-test-model")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("fake")
        .to_owned();
    let with_model = move |mut v: Value| {
        if model == "-" {
            v.as_object_mut().unwrap().remove("model");
        } else {
            v["model"] = Value::String(model.clone());
        }
        v
    };
    if req["stream"] != json!(true) {
        let completion = with_model(json!({
            "id": "x", "object": "chat.completion", "model": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": usage,
        }));
        let content_bytes = header_u64(&headers, "x-test-content-bytes", 2);
        let mut completion = completion;
        if content_bytes != 2 {
            let content = "A".repeat(usize::try_from(content_bytes).unwrap());
            completion["choices"][0]["message"]["content"] = Value::String(content);
        }
        let end = Duration::from_millis(header_u64(&headers, "x-test-end-delay-ms", 0));
        if let Some(content_type) = headers.get("x-test-content-type") {
            return Response::builder()
                .header("content-type", content_type)
                .body(Body::from(completion.to_string()))
                .unwrap();
        }
        if end.is_zero() {
            return axum::Json(completion).into_response();
        }
        let parts = [
            (Duration::ZERO, completion.to_string()),
            (end, String::new()),
        ];
        let stream = futures_util::stream::unfold(parts.into_iter(), |mut it| async move {
            let (wait, part) = it.next()?;
            tokio::time::sleep(wait).await;
            Some((Ok::<_, Infallible>(Bytes::from(part)), it))
        });
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    // `x-test-ignore-include-usage`: an upstream that does not implement `include_usage`.
    let include_usage = req["stream_options"]["include_usage"] == json!(true)
        && !headers.contains_key("x-test-ignore-include-usage");
    let delay = Duration::from_millis(header_u64(&headers, "x-test-last-delay-ms", 0));
    let usage_delay = headers
        .contains_key("x-test-usage-delay-ms")
        .then(|| Duration::from_millis(header_u64(&headers, "x-test-usage-delay-ms", 0)));
    let chunk = |content: &str| {
        let finish = match (content, usage_delay) {
            ("!", Some(_)) => json!("stop"),
            _ => Value::Null,
        };
        let mut c = with_model(
            json!({"id": "x", "object": "chat.completion.chunk", "model": "fake",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}),
        );
        if include_usage {
            c["usage"] = Value::Null;
        }
        format!("data: {c}\n\n")
    };
    let mut events: Vec<(Duration, String)> = vec![
        (Duration::ZERO, chunk("Hel")),
        (Duration::from_millis(5), chunk("lo")),
        (delay, chunk("!")),
    ];
    if include_usage {
        let u = with_model(
            json!({"id": "x", "object": "chat.completion.chunk", "model": "fake", "choices": [], "usage": usage}),
        );
        events.push((usage_delay.unwrap_or_default(), format!("data: {u}\n\n")));
    }
    events.push((Duration::ZERO, "data: [DONE]\n\n".into()));
    let broken = headers.contains_key("x-test-break-after-finish");
    if broken {
        events.truncate(3);
    }
    let stream = futures_util::stream::unfold(events.into_iter(), |mut it| async move {
        let (wait, e) = it.next()?;
        tokio::time::sleep(wait).await;
        Some((Ok::<_, std::io::Error>(Bytes::from(e)), it))
    })
    .chain(
        futures_util::stream::iter(broken.then_some(())).then(move |()| async move {
            // When the usage chunk would have come.
            tokio::time::sleep(usage_delay.unwrap_or_default()).await;
            Err(std::io::Error::other("the upstream broke off"))
        }),
    );
    let content_type = headers
        .get("x-test-content-type")
        .cloned()
        .unwrap_or(HeaderValue::from_static("text/event-stream"));
    Response::builder()
        .header("content-type", content_type)
        // An upstream's own rate-limit headers must not reach the caller.
        .header("x-ratelimit-limit-requests", "999999")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn slow() -> &'static str {
    tokio::time::sleep(Duration::from_secs(5)).await;
    "late"
}

/// A Responses API response object with its usage (total `x-test-tokens`, default 50); for a
/// body with `"stream": true`, its event stream, the usage in `response.completed`, which comes
/// `x-test-usage-delay-ms` after the output is done.
async fn response_object(State(seen): State<Seen>, headers: HeaderMap, body: Bytes) -> Response {
    let streams = serde_json::from_slice::<Value>(&body).is_ok_and(|b| b["stream"] == json!(true));
    *seen.last_raw_body.lock().unwrap() = Some(body);
    let total = header_u64(&headers, "x-test-tokens", 50);
    let response = json!({
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "model": "fake",
        "usage": {"input_tokens": total / 2, "output_tokens": total - total / 2, "total_tokens": total}
    });
    if !streams {
        return axum::Json(response).into_response();
    }
    let usage_delay = Duration::from_millis(header_u64(&headers, "x-test-usage-delay-ms", 0));
    let event = |kind: &str, data: Value| format!("event: {kind}\ndata: {data}\n\n");
    let output = [
        ("response.created", json!({"type": "response.created"})),
        (
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "delta": "Hello"}),
        ),
        (
            "response.output_text.done",
            json!({"type": "response.output_text.done", "text": "Hello"}),
        ),
        (
            "response.output_item.done",
            json!({"type": "response.output_item.done", "item": {"type": "message"}}),
        ),
    ]
    .map(|(kind, data)| event(kind, data))
    .concat();
    let completed = event(
        "response.completed",
        json!({"type": "response.completed", "response": response}),
    );
    let parts = [(Duration::ZERO, output), (usage_delay, completed)];
    let stream = futures_util::stream::unfold(parts.into_iter(), |mut it| async move {
        let (wait, part) = it.next()?;
        tokio::time::sleep(wait).await;
        Some((Ok::<_, Infallible>(Bytes::from(part)), it))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// The fake upstream's API, recording into `seen`.
fn fake_app(seen: &Seen) -> Router {
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/slow", get(slow))
        // The Responses API: a new response, and a stored one fetched or cancelled, each with
        // its usage (total `x-test-tokens`, default 50).
        .route("/v1/responses", post(response_object))
        .route("/v1/responses/{id}", get(response_object))
        .route("/v1/responses/{id}/cancel", post(response_object))
        // An Anthropic-style messages endpoint, as LiteLLM or vLLM upstreams serve it.
        .route("/v1/messages", post(response_object))
        // A response without a body.
        .route(
            "/v1/empty",
            axum::routing::delete(|| async { StatusCode::NO_CONTENT }),
        )
        .route(
            "/v1/models",
            get(|uri: axum::http::Uri| async move {
                axum::Json(json!({"object": "list", "data": [], "query": uri.query()}))
            }),
        );
    // The same API under a path prefix, for base URLs like http://host/api.
    routes.clone().nest("/api", routes).with_state(seen.clone())
}

pub async fn fake_upstream() -> FakeUpstream {
    let seen = Seen::default();
    let app = fake_app(&seen);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    FakeUpstream { addr, seen }
}

/// The test-only certificates of `tests/tls/` (see `generate.sh` there).
pub fn tls_fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/tls")
        .join(name)
}

/// The fake upstream over TLS (HTTP/1.1) with the certificate chain `cert` and the key `key`
/// (PEM files). `seen.tls_handshakes` counts the handshakes that succeeded.
pub async fn fake_upstream_tls(cert: &std::path::Path, key: &std::path::Path) -> FakeUpstream {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let certs = CertificateDer::pem_file_iter(cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(key).unwrap();
    let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

    let seen = Seen::default();
    let app = fake_app(&seen);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handshakes = seen.tls_handshakes.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let (acceptor, app, handshakes) = (acceptor.clone(), app.clone(), handshakes.clone());
            tokio::spawn(async move {
                // A client that refuses the certificate ends here.
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                handshakes.fetch_add(1, Ordering::SeqCst);
                let service = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    FakeUpstream { addr, seen }
}

/// A running gateway.
pub struct Gateway {
    pub addr: SocketAddr,
    pub state: AppState,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    pub server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    client: Client<HttpConnector, Body>,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Config text with `{upstream}` replaced.
pub fn config(text: &str, upstream: &str) -> Config {
    Config::parse_with_env("test.toml", &text.replace("{upstream}", upstream), None)
        .unwrap_or_else(|e| panic!("bad test config: {e}"))
}

pub async fn gateway(text: &str, upstream: &str) -> Gateway {
    let c = config(text, upstream);
    let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
    gateway_on(&c, store).await
}

pub async fn gateway_on(c: &Config, store: GatewayStore) -> Gateway {
    gateway_with(AppState::new(c, store).unwrap()).await
}

/// A process for `running`, on the store it names, with a refusal tally in memory, and the state
/// of its one worker: what a `Reloader` reloads.
pub async fn process_and_worker(running: &Config) -> (floodgate_gateway::Process, AppState) {
    let store = floodgate_gateway::store::open(&running.store)
        .await
        .unwrap()
        .0;
    let tally = floodgate_gateway::tally::Tally::in_memory(running);
    let process = floodgate_gateway::Process::new(running, Arc::new(tally));
    let state = AppState::for_worker(running, store, &process).unwrap();
    (process, state)
}

pub async fn gateway_with(state: AppState) -> Gateway {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(floodgate_gateway::run(
        listener,
        state.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    Gateway {
        addr,
        state,
        stop: Mutex::new(Some(stop)),
        server: Some(server),
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Gateway {
    /// Resolves once every charge the gateway's answers so far caused has landed (a metered
    /// body is tracked from its start, so an answer already received counts). Bounded, so that
    /// a charge that never lands fails the test instead of hanging it.
    pub async fn settled(&self) {
        tokio::time::timeout(Duration::from_secs(15), self.state.charges().settled())
            .await
            .expect("the gateway's charges landed");
    }

    /// Stops accepting; the server task then drains.
    pub fn shutdown(&self) {
        if let Some(s) = self.stop.lock().unwrap().take() {
            let _ = s.send(());
        }
    }

    pub fn request(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> Request<Body> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("http://{}{}", self.addr, path))
            .header("content-type", "application/json");
        if let Some(k) = key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        b.body(Body::from(body.to_owned())).unwrap()
    }

    pub async fn send(&self, req: Request<Body>) -> Reply {
        let resp = self.client.request(req).await.unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// Sends `req` and reads its body to the end; says whether it ended in an error (the
    /// gateway broke it off) rather than whole.
    pub async fn send_and_see_it_break(&self, req: Request<Body>) -> bool {
        let resp = self.client.request(req).await.unwrap();
        resp.into_body().collect().await.is_err()
    }

    /// `POST /v1/chat/completions` with `key`.
    pub async fn chat(&self, key: &str, body: &str) -> Reply {
        self.send(self.request("POST", "/v1/chat/completions", Some(key), body))
            .await
    }

    /// Sends `req` and returns the status, each body frame with its arrival time, and the start.
    pub async fn frames(
        &self,
        req: Request<Body>,
    ) -> (StatusCode, HeaderMap, Vec<(Duration, Bytes)>) {
        let start = Instant::now();
        let resp = self.client.request(req).await.unwrap();
        let (parts, mut body) = resp.into_parts();
        let mut frames = Vec::new();
        while let Some(f) = body.frame().await {
            if let Ok(data) = f.unwrap().into_data() {
                frames.push((start.elapsed(), data));
            }
        }
        (parts.status, parts.headers, frames)
    }
}

pub const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
pub const CHAT_STREAM: &str =
    r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
pub const CHAT_STREAM_USAGE: &str = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#;

/// The `data:` payloads of an event stream.
pub fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: ").map(str::to_owned))
        .collect()
}

/// Sends a chat completion `body` (60 tokens) for key `sk-k` to the gateway at `addr` over a raw
/// connection, with `extra` headers, reads until `until` has arrived, and hangs up.
pub async fn send_and_leave_at(
    addr: impl tokio::net::ToSocketAddrs,
    body: &str,
    extra: &str,
    until: &str,
) {
    drop(send_and_read_until(addr, body, extra, until).await);
}

/// As [`send_and_leave_at`], but keeps the connection open: returns it and what was read.
pub async fn send_and_read_until(
    addr: impl tokio::net::ToSocketAddrs,
    body: &str,
    extra: &str,
    until: &str,
) -> (tokio::net::TcpStream, Vec<u8>) {
    send_to_and_read_until(addr, "/v1/chat/completions", body, extra, until).await
}

/// As [`send_and_read_until`], to `path`.
pub async fn send_to_and_read_until(
    addr: impl tokio::net::ToSocketAddrs,
    path: &str,
    body: &str,
    extra: &str,
    until: &str,
) -> (tokio::net::TcpStream, Vec<u8>) {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\
         x-test-tokens: 60\r\n{extra}content-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, head.as_bytes())
        .await
        .unwrap();
    let mut seen = Vec::new();
    read_until(&mut conn, &mut seen, until).await;
    (conn, seen)
}

/// Reads from `conn` into `seen` until `seen` holds `until` (within 5 s of each read).
pub async fn read_until(conn: &mut tokio::net::TcpStream, seen: &mut Vec<u8>, until: &str) {
    read_until_it(conn, seen, |s| s.contains(until)).await;
}

/// Reads from `conn` into `seen` until `done` says `seen` is enough (within 5 s of each read).
pub async fn read_until_it(
    conn: &mut tokio::net::TcpStream,
    seen: &mut Vec<u8>,
    done: impl Fn(&str) -> bool,
) {
    let mut buf = [0u8; 4096];
    while !done(&String::from_utf8_lossy(seen)) {
        let n = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::io::AsyncReadExt::read(conn, &mut buf),
        )
        .await
        .expect("the answer went on")
        .unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(seen));
        seen.extend_from_slice(&buf[..n]);
    }
}

/// A loopback port nothing listens on now.
///
/// Taken from 30000-32767, and never the same twice in one test process: a port the kernel
/// handed out for `127.0.0.1:0` and that was let go could be handed out again, to a listener of
/// another test running at the same time, before the process this port is for binds it (and a
/// test would then talk to the other test's server). The kernel hands out ports from 32768 up
/// (`ip_local_port_range`), and `scripts/redis-cluster` takes its nodes and their bus ports
/// from 10000-29999.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 30_000;
    const COUNT: u32 = 2_768;
    // Test binaries run one after another; spread by pid all the same, so that a port a
    // process left in TIME_WAIT is not the next one's first.
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(97) % COUNT,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..COUNT {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::SeqCst) % COUNT) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {FIRST}-{}", FIRST + COUNT - 1)
}

/// A config file for the binary, in `<target>/tmp/<name>/floodgate.toml`: the callers' and the
/// admin listener on free ports, one worker, then `admin_and_rest` (what follows `[admin]`'s
/// `listen`: its secret, then any other section).
pub struct BinaryConfig {
    pub dir: std::path::PathBuf,
    pub file: std::path::PathBuf,
    pub port: u16,
    pub admin_port: u16,
}

pub fn binary_config(name: &str, admin_and_rest: &str) -> BinaryConfig {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let file = dir.join("floodgate.toml");
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n\
         [admin]\nlisten = \"127.0.0.1:{admin_port}\"\n"
    );
    std::fs::write(&file, head + admin_and_rest).unwrap();
    BinaryConfig {
        dir,
        file,
        port,
        admin_port,
    }
}

/// Waits until something accepts connections on `port` (the binary is up), for at most 30 s.
pub fn wait_for_port(port: u16, child: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "floodgate exited before listening"
        );
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `floodgate serve --config file`: the store the file names (never the environment's Redis
/// URL), logging warnings only, its output dropped.
pub fn serve_binary(file: &std::path::Path) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(file)
        .env_remove("FLOODGATE_REDIS_URL")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// The Redis server tests use (`FLOODGATE_TEST_REDIS_URL`), or `None` with a note (the test
/// skips) — unless `FLOODGATE_REQUIRE_REDIS=1` (CI), when a skip is a failure.
pub fn test_redis_url(test: &str) -> Option<String> {
    test_server("FLOODGATE_TEST_REDIS_URL", test)
}

/// The test server (or cluster seeds) that `var` names, or `None` with a note (the test skips),
/// unless `FLOODGATE_REQUIRE_REDIS=1` (CI), when a skip is a failure.
pub fn test_server(var: &str, test: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("FLOODGATE_REQUIRE_REDIS").as_deref() != Ok("1"),
                "{test}: FLOODGATE_REQUIRE_REDIS=1 but {var} is not set"
            );
            eprintln!("{test}: skipped, {var} is not set");
            None
        }
    }
}

/// A key prefix no other test (or run) uses.
pub fn fresh_prefix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("fgtest:{}-{nanos}:", std::process::id())
}

/// `promtool check metrics` on `text`, where promtool is installed; CI requires it
/// (`FLOODGATE_REQUIRE_PROMTOOL=1`).
pub fn promtool_accepts(text: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let spawned = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            assert!(
                std::env::var_os("FLOODGATE_REQUIRE_PROMTOOL").is_none(),
                "promtool is required here: {e}"
            );
            eprintln!("promtool not installed: the exposition is not checked by it ({e})");
            return;
        }
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Returns once the wall clock's minute has at least 20 s left, waiting for the next minute if
/// not: a test that reads exact counts of a minute window on a clock it cannot pin (the
/// gateway's own, Redis's) must not see the window roll over (the previous minute's count then
/// fades out of the estimate). It waits for the clock itself, the one thing such a test
/// depends on.
pub async fn early_in_a_minute() {
    early_in_a_window(Duration::from_secs(60), Duration::from_secs(20)).await;
}

/// Returns once the wall clock's current window of `window` (windows start at multiples of it
/// since the epoch, as the stores' do) has at least `room` left, waiting for the next window if
/// not: [`early_in_a_minute`] for any window.
pub async fn early_in_a_window(window: Duration, room: Duration) {
    let window = window.as_micros();
    let into = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros()
        % window;
    if into + room.as_micros() > window {
        let left = u64::try_from(window - into).unwrap();
        tokio::time::sleep(Duration::from_micros(left + 1_000)).await;
    }
}

/// Returns once `done` holds, checking every few milliseconds for up to 10 s (then fails,
/// naming `what`): waits for an event, not for a time.
pub async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What this thread's tests log, captured by [`capture_logs`].
#[derive(Clone, Default)]
pub struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures what this thread logs at INFO and above, until the guard is dropped. (tracing's
/// global level hint is shared: one such test a test binary, or they race.)
pub fn capture_logs() -> (Logs, tracing::subscriber::DefaultGuard) {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}
