//! Realtime API sessions: `GET /v1/realtime` upgraded to a WebSocket through the gateway to a
//! fake upstream (hyper with upgrades, frames written and read by hand below): bytes both ways
//! unchanged, the `max_connections` cap, admission, tokens from `response.done`, the drain.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use common::*;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// RFC 6455's sample handshake: this key is answered with this accept.
const WS_KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
const WS_ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";

const TEXT: u8 = 1;
const BINARY: u8 = 2;
const CLOSE: u8 = 8;
const PING: u8 = 9;
const PONG: u8 = 10;

// ---------------------------------------------------------------------------------------------
// Frames.

#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    fin: bool,
    opcode: u8,
    payload: Vec<u8>,
}

/// One side of a WebSocket: a client masks what it sends (RFC 6455, 5.3), a server does not.
struct Ws<S> {
    io: S,
    masked: bool,
    /// The gateway's own `rate_limits.updated` events, taken out of the messages as they came.
    rate_limits: Vec<String>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Ws<S> {
    async fn send_frame(&mut self, fin: bool, opcode: u8, payload: &[u8]) {
        let mut out = vec![(u8::from(fin) << 7) | opcode];
        let m = if self.masked { 0x80 } else { 0 };
        match payload.len() {
            n if n < 126 => out.push(m | n as u8),
            n if n <= 0xffff => {
                out.push(m | 126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                out.push(m | 127);
                out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        if self.masked {
            let key = [0x37, 0xfa, 0x21, 0x3d];
            out.extend_from_slice(&key);
            out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
        } else {
            out.extend_from_slice(payload);
        }
        self.io.write_all(&out).await.unwrap();
        self.io.flush().await.unwrap();
    }

    async fn send(&mut self, opcode: u8, payload: &[u8]) {
        self.send_frame(true, opcode, payload).await;
    }

    /// The next frame; `None` when the connection ends.
    async fn frame(&mut self) -> Option<Frame> {
        let mut head = [0u8; 2];
        self.io.read_exact(&mut head).await.ok()?;
        let len = match head[1] & 0x7f {
            126 => u64::from(self.io.read_u16().await.ok()?),
            127 => self.io.read_u64().await.ok()?,
            n => u64::from(n),
        };
        let mask = if head[1] & 0x80 != 0 {
            let mut k = [0u8; 4];
            self.io.read_exact(&mut k).await.ok()?;
            Some(k)
        } else {
            None
        };
        let mut payload = vec![0u8; len as usize];
        self.io.read_exact(&mut payload).await.ok()?;
        if let Some(k) = mask {
            for (i, b) in payload.iter_mut().enumerate() {
                *b ^= k[i % 4];
            }
        }
        Some(Frame {
            fin: head[0] & 0x80 != 0,
            opcode: head[0] & 0x0f,
            payload,
        })
    }

    /// The next data message, fragments joined, with the frames it came in (control frames
    /// between them included); a close frame is returned as a message of its own. The
    /// gateway's own `rate_limits.updated` events (after each turn of a metered session) are
    /// kept in `rate_limits` instead.
    async fn message(&mut self) -> Option<(u8, Vec<u8>, Vec<Frame>)> {
        loop {
            let m = self.any_message().await?;
            let text = String::from_utf8_lossy(&m.1);
            if m.0 == TEXT && text.contains("\"event_id\":\"event_floodgate_") {
                self.rate_limits.push(text.into_owned());
                continue;
            }
            return Some(m);
        }
    }

    /// The next data message, whatever it is.
    async fn any_message(&mut self) -> Option<(u8, Vec<u8>, Vec<Frame>)> {
        let mut frames = Vec::new();
        let mut opcode = None;
        let mut data = Vec::new();
        loop {
            let f = self.frame().await?;
            frames.push(f.clone());
            match f.opcode {
                CLOSE if opcode.is_none() => return Some((CLOSE, f.payload, frames)),
                PING | PONG | CLOSE => continue,
                0 => {}
                op => opcode = Some(op),
            }
            data.extend_from_slice(&f.payload);
            if f.fin {
                return Some((opcode.unwrap_or(0), data, frames));
            }
        }
    }

    /// Whether the peer closes the connection within `within` (frames before that are skipped).
    async fn closed_within(&mut self, within: Duration) -> bool {
        tokio::time::timeout(within, async { while self.frame().await.is_some() {} })
            .await
            .is_ok()
    }
}

// ---------------------------------------------------------------------------------------------
// The fake upstream.

/// A `response.done` server event with `total_tokens`; `pad` bytes of output text make it large.
fn response_done(tokens: u64, pad: usize) -> String {
    json!({
        "type": "response.done",
        "event_id": "event_1",
        "response": {
            "object": "realtime.response",
            "status": "completed",
            "output": [{"type": "message", "content": [{"type": "text", "text": "x".repeat(pad)}]}],
            "usage": {"total_tokens": tokens, "input_tokens": tokens / 2, "output_tokens": tokens - tokens / 2},
        },
    })
    .to_string()
}

/// What the fake upstream saw: each request's URI and headers, the payload of each close frame
/// it got, and how many other messages.
#[derive(Clone, Default)]
struct Seen(
    Arc<Mutex<Vec<(String, HeaderMap)>>>,
    Arc<Mutex<Vec<Vec<u8>>>>,
    Arc<std::sync::atomic::AtomicUsize>,
);

impl Seen {
    fn messages(&self) -> usize {
        self.2.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn closes(&self) -> Vec<Vec<u8>> {
        self.1.lock().unwrap().clone()
    }
    fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn last(&self) -> (String, HeaderMap) {
        self.0.lock().unwrap().last().cloned().unwrap()
    }
}

struct WsUpstream {
    addr: SocketAddr,
    seen: Seen,
}

impl WsUpstream {
    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// The https URL by host name (the test certificate's `localhost`).
    fn https_url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }
}

/// A Realtime-like upstream: answers a WebSocket upgrade with 101 (or, for `?model=refuse`,
/// 403), then per text message from the client: `usage:N` sends a `response.done` with `N`
/// tokens in one frame, `usage-fragmented:N` the same in three fragments with a ping between
/// them, `usage-big:N` one over the gateway's metering bound, `usage-later:N` one after 300 ms,
/// `session:M` a `session.updated` naming the model `M`, `hold` nothing for 5 s (not even a
/// read), `bye` a close frame and the end, `usage-bye:N` a `response.done` and a close frame in
/// one write (then the end, once the client's close has come);
/// anything else (text or binary) is echoed. A close frame is answered with one and the end.
/// Plain requests get `200 {"object": "list"}`.
async fn ws_upstream() -> WsUpstream {
    ws_upstream_on(None).await
}

/// The same over TLS, with the test-only certificate of `tests/tls/` (for `localhost`).
async fn ws_upstream_tls() -> WsUpstream {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let certs = CertificateDer::pem_file_iter(tls_fixture("server.pem"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(tls_fixture("server.key")).unwrap();
    let tls = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    ws_upstream_on(Some(tokio_rustls::TlsAcceptor::from(Arc::new(tls)))).await
}

async fn ws_upstream_on(tls: Option<tokio_rustls::TlsAcceptor>) -> WsUpstream {
    let seen = Seen::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let recorded = seen.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let (seen, tls) = (recorded.clone(), tls.clone());
            tokio::spawn(async move {
                match tls {
                    None => serve_upstream(TokioIo::new(tcp), seen).await,
                    Some(acceptor) => {
                        if let Ok(stream) = acceptor.accept(tcp).await {
                            serve_upstream(TokioIo::new(stream), seen).await;
                        }
                    }
                }
            });
        }
    });
    WsUpstream { addr, seen }
}

async fn serve_upstream<I>(io: I, seen: Seen)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let seen = seen.clone();
        async move { Ok::<_, Infallible>(upstream_answer(seen, req)) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(io, service)
        .with_upgrades()
        .await;
}

fn upstream_answer(seen: Seen, mut req: Request<Incoming>) -> Response<Body> {
    seen.0
        .lock()
        .unwrap()
        .push((req.uri().to_string(), req.headers().clone()));
    if !req.headers().contains_key("upgrade") {
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(
                json!({"object": "list", "data": []}).to_string(),
            ))
            .unwrap();
    }
    if req
        .uri()
        .query()
        .is_some_and(|q| q.contains("model=refuse"))
    {
        return Response::builder()
            .status(StatusCode::FORBIDDEN)
            .header("content-type", "application/json")
            .header("x-ratelimit-remaining-requests", "999")
            .body(Body::from(r#"{"error":{"code":"model_not_found"}}"#))
            .unwrap();
    }
    let protocol_offered = req
        .headers()
        .get("sec-websocket-protocol")
        .is_some_and(|p| p.to_str().unwrap().contains("realtime"));
    let resets = req.uri().query().is_some_and(|q| q.contains("model=reset"));
    let on_upgrade = hyper::upgrade::on(&mut req);
    if resets {
        tokio::spawn(async move {
            let upgraded = on_upgrade.await.unwrap();
            let parts = upgraded.downcast::<TokioIo<TcpStream>>().unwrap();
            assert!(parts.read_buf.is_empty());
            resetting_session(parts.io.into_inner(), seen).await;
        });
    } else {
        spawn_session(on_upgrade, seen);
    }
    let mut resp = Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header("connection", "upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-accept", WS_ACCEPT)
        .header("x-upstream-session", "sess_1");
    if protocol_offered {
        resp = resp.header("sec-websocket-protocol", "realtime");
    }
    resp.body(Body::empty()).unwrap()
}

/// A session on the upstream: [`upstream_session`].
fn spawn_session(on_upgrade: hyper::upgrade::OnUpgrade, seen: Seen) {
    tokio::spawn(async move {
        let io = TokioIo::new(on_upgrade.await.unwrap());
        upstream_session(
            Ws {
                io,
                masked: false,
                rate_limits: Vec::new(),
            },
            seen,
        )
        .await;
    });
}

/// The session of `?model=reset`: at its first message `done-and-reset:N` it sends a
/// `response.done` of `N` tokens and resets its connection (a zero linger), reading nothing more.
async fn resetting_session(tcp: TcpStream, seen: Seen) {
    let mut ws = Ws {
        io: tcp,
        masked: false,
        rate_limits: Vec::new(),
    };
    let Some((_, data, _)) = ws.message().await else {
        return;
    };
    seen.2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let text = String::from_utf8_lossy(&data).into_owned();
    let n: u64 = text
        .strip_prefix("done-and-reset:")
        .and_then(|n| n.parse().ok())
        .expect("done-and-reset:N");
    ws.send(TEXT, response_done(n, 0).as_bytes()).await;
    ws.io.set_zero_linger().unwrap();
}

async fn upstream_session<S: AsyncRead + AsyncWrite + Unpin>(mut ws: Ws<S>, seen: Seen) {
    while let Some((opcode, data, _)) = ws.message().await {
        if opcode == CLOSE {
            seen.1.lock().unwrap().push(data.clone());
            ws.send(CLOSE, &data).await;
            return;
        }
        seen.2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let text = String::from_utf8_lossy(&data).into_owned();
        let arg = |prefix: &str| {
            text.strip_prefix(prefix)
                .and_then(|n| n.parse::<u64>().ok())
        };
        if let Some(n) = arg("usage:") {
            ws.send(TEXT, response_done(n, 0).as_bytes()).await;
        } else if let Some(n) = arg("usage-rl:") {
            // As OpenAI's Realtime API does: its own limits after the turn, for its key.
            ws.send(TEXT, response_done(n, 0).as_bytes()).await;
            let upstream_limits = r#"{"type":"rate_limits.updated","event_id":"event_up_1","rate_limits":[{"name":"requests","limit":99999,"remaining":99998,"reset_seconds":0.01},{"name":"tokens","limit":8888888,"remaining":8888000,"reset_seconds":0.1}]}"#;
            ws.send(TEXT, upstream_limits.as_bytes()).await;
            ws.send(TEXT, b"after the limits").await;
        } else if let Some(n) = arg("usage-fragmented:") {
            let done = response_done(n, 300);
            let (a, rest) = done.as_bytes().split_at(10);
            let (b, c) = rest.split_at(200);
            ws.send_frame(false, TEXT, a).await;
            ws.send(PING, b"are you there").await;
            ws.send_frame(false, 0, b).await;
            ws.send_frame(true, 0, c).await;
        } else if let Some(n) = arg("usage-later:") {
            tokio::time::sleep(Duration::from_millis(300)).await;
            ws.send(TEXT, response_done(n, 0).as_bytes()).await;
        } else if let Some(model) = text.strip_prefix("session:") {
            let updated = json!({"type": "session.updated", "session": {"model": model}});
            ws.send(TEXT, updated.to_string().as_bytes()).await;
        } else if let Some(n) = arg("usage-big:") {
            let done = response_done(n, 1024 * 1024 + 10);
            ws.send(TEXT, done.as_bytes()).await;
        } else if text == "bye" {
            ws.send(CLOSE, &1000u16.to_be_bytes()).await;
            return;
        } else if let Some(n) = arg("usage-bye:") {
            // One write: the gateway reads the turn's end and the close frame in one piece.
            let mut both = Vec::new();
            for (opcode, payload) in [
                (TEXT, response_done(n, 0).into_bytes()),
                (CLOSE, 1000u16.to_be_bytes().to_vec()),
            ] {
                both.push(0x80 | opcode);
                both.push(126);
                both.extend_from_slice(&(payload.len() as u16).to_be_bytes());
                both.extend_from_slice(&payload);
            }
            ws.io.write_all(&both).await.unwrap();
            ws.io.flush().await.unwrap();
            let _ = ws.message().await;
            return;
        } else if text == "hold" {
            tokio::time::sleep(Duration::from_secs(5)).await;
        } else {
            ws.send(opcode, &data).await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The caller.

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
    ws: Option<Ws<TokioIo<hyper::upgrade::Upgraded>>>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
    fn code(&self) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap();
        v["error"]["code"].as_str().unwrap_or_default().to_owned()
    }
    fn ws(&mut self) -> &mut Ws<TokioIo<hyper::upgrade::Upgraded>> {
        self.ws.as_mut().expect("upgraded")
    }
}

/// Opens `/v1/realtime?model=gpt-realtime` on `gw` with `Authorization: Bearer <key>` (if any)
/// and the extra `headers`.
async fn open(gw: &Gateway, key: Option<&str>, headers: &[(&str, &str)]) -> Answer {
    open_path(gw, "/v1/realtime?model=gpt-realtime", key, headers).await
}

async fn open_path(
    gw: &Gateway,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
) -> Answer {
    open_at(gw.addr, path, key, headers).await
}

async fn open_at(
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
) -> Answer {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn.with_upgrades());
    let mut req = Request::builder()
        .method("GET")
        .uri(path)
        .header("host", addr.to_string())
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", WS_KEY);
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let mut req = req.body(Body::empty()).unwrap();
    for (n, v) in headers {
        let name = axum::http::HeaderName::from_bytes(n.as_bytes()).unwrap();
        req.headers_mut().insert(name, v.parse().unwrap());
    }
    let mut resp = sender.send_request(req).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    if status == StatusCode::SWITCHING_PROTOCOLS {
        let upgraded = hyper::upgrade::on(&mut resp).await.unwrap();
        return Answer {
            status,
            headers,
            body: String::new(),
            ws: Some(Ws {
                io: TokioIo::new(upgraded),
                masked: true,
                rate_limits: Vec::new(),
            }),
        };
    }
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
        ws: None,
    }
}

/// A plain request by `key`: what its rate-limit headers say.
async fn models(gw: &Gateway, key: &str) -> Reply {
    gw.send(gw.request("GET", "/v1/models", Some(key), ""))
        .await
}

/// Waits (up to 5 s) for the next flush to have charged a session's tokens: until `sk-k`'s
/// tokens left read `left`; that answer.
async fn tokens_left_become(gw: &Gateway, left: &str) -> Reply {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        gw.settled().await;
        let r = models(gw, "sk-k").await;
        if r.header("x-ratelimit-remaining-tokens") == Some(left) {
            return r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tokens left never {left}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Opens a session, sends `message` and, once the upstream `up` has it, resets the connection
/// (a reset, not a close: the gateway's read of the caller fails).
async fn send_and_reset(gw: &Gateway, up: &WsUpstream, message: &[u8]) {
    let before = up.seen.messages();
    let (tcp, head) = raw_request(gw.addr, &raw_upgrade(1)).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let mut ws = Ws {
        io: tcp,
        masked: true,
        rate_limits: Vec::new(),
    };
    ws.send(TEXT, message).await;
    wait_until("the upstream has the message", || {
        up.seen.messages() > before
    })
    .await;
    ws.io.set_zero_linger().unwrap();
    drop(ws);
}

/// Waits (up to 10 s) for the gateway's live session count to be `n`.
async fn live_sessions_reach(gw: &Gateway, n: usize) {
    let start = Instant::now();
    while gw.state.live_sessions().count() != n {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "live sessions: {} (waiting for {n})",
            gw.state.live_sessions().count()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Tests.

/// `CARGO_PKG_NAME` is set by cargo in every test process: an upstream key variable that is
/// always there, whose value the test knows.
const PLAIN: &str = r#"
[upstream]
base_url = "{upstream}"
api_key_env = "CARGO_PKG_NAME"
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 5 }
"#;

#[tokio::test]
async fn a_session_carries_text_and_binary_both_ways_unchanged_and_closes() {
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    let mut a = open(
        &gw,
        Some("sk-k"),
        &[
            ("sec-websocket-protocol", "realtime"),
            ("sec-websocket-extensions", "permessage-deflate"),
            ("openai-beta", "realtime=v1"),
            ("x-floodgate-customer", "c1"),
        ],
    )
    .await;
    assert_eq!(a.status, 101, "{}", a.body);
    // The upstream's handshake answer, and the gateway's rate-limit headers.
    assert_eq!(a.header("sec-websocket-accept"), Some(WS_ACCEPT));
    assert_eq!(a.header("sec-websocket-protocol"), Some("realtime"));
    assert_eq!(a.header("x-upstream-session"), Some("sess_1"));
    assert_eq!(a.header("upgrade"), Some("websocket"));
    assert_eq!(a.header("x-ratelimit-remaining-requests"), Some("4"));
    assert_eq!(a.header("x-ratelimit-limit-requests"), Some("5"));

    // What the upstream got: the path and query, its own key, the handshake; nothing of the
    // gateway's key or customer header. (No token limit: extensions are left to negotiate.)
    let (uri, h) = up.seen.last();
    assert_eq!(uri, "/v1/realtime?model=gpt-realtime");
    assert_eq!(h["authorization"], "Bearer floodgate-gateway");
    assert_eq!(h["upgrade"], "websocket");
    assert_eq!(h["sec-websocket-key"], WS_KEY);
    assert_eq!(h["sec-websocket-version"], "13");
    assert_eq!(h["openai-beta"], "realtime=v1");
    assert_eq!(h["sec-websocket-extensions"], "permessage-deflate");
    assert!(!h.contains_key("x-floodgate-customer"));
    assert_eq!(h["host"], up.addr.to_string());

    let ws = a.ws();
    ws.send(TEXT, b"hello \xe2\x9c\x93").await;
    let (op, data, _) = ws.message().await.unwrap();
    assert_eq!(
        (op, data.as_slice()),
        (TEXT, b"hello \xe2\x9c\x93".as_slice())
    );
    let binary: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    ws.send(BINARY, &binary).await;
    let (op, data, _) = ws.message().await.unwrap();
    assert_eq!(op, BINARY);
    assert!(data == binary, "70 000 binary bytes come back unchanged");
    // A message the upstream sends in fragments reaches the caller in the same frames.
    ws.send(TEXT, b"usage-fragmented:7").await;
    let (op, data, frames) = ws.message().await.unwrap();
    assert_eq!(op, TEXT);
    assert_eq!(String::from_utf8(data).unwrap(), response_done(7, 300));
    let kinds: Vec<(bool, u8)> = frames.iter().map(|f| (f.fin, f.opcode)).collect();
    assert_eq!(kinds, [(false, TEXT), (true, PING), (false, 0), (true, 0)]);
    assert_eq!(gw.state.live_sessions().count(), 1);

    // The caller closes: the upstream answers the close, and the connection ends.
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    let (op, data, _) = ws.message().await.unwrap();
    assert_eq!((op, data), (CLOSE, 1000u16.to_be_bytes().to_vec()));
    assert!(ws.closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    // The session took one request, no more.
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("3"));
}

#[tokio::test]
async fn either_side_closing_ends_the_session() {
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    let ws = a.ws();
    ws.send(TEXT, b"bye").await;
    let (op, _, _) = ws.message().await.unwrap();
    assert_eq!(op, CLOSE);
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(ws.closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;

    // A caller that just goes away (no close frame): the upstream is told, and the session ends.
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    a.ws().send(TEXT, b"hi").await;
    a.ws().message().await.unwrap();
    assert_eq!(gw.state.live_sessions().count(), 1);
    drop(a);
    live_sessions_reach(&gw, 0).await;
}

/// The session's end line names the side that ended it: a caller's close frame, which the
/// upstream answers and then closes its connection (as a WebSocket server does), is the
/// caller's end, not the upstream's; a failed connection is named too. (One test captures the logs: tracing's global level hint
/// is not to be raced by several.)
#[tokio::test]
async fn the_end_line_names_the_side_that_ended_the_session() {
    let (logs, _logging) = capture_logs();
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    let ends = || {
        let logged = logs.text();
        logged
            .lines()
            .filter(|l| l.contains("realtime session ended"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // The caller closes.
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    a.ws().send(CLOSE, &1000u16.to_be_bytes()).await;
    assert_eq!(a.ws().message().await.unwrap().0, CLOSE);
    assert!(a.ws().closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    // The upstream closes.
    let mut b = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(b.status, 101);
    b.ws().send(TEXT, b"bye").await;
    assert_eq!(b.ws().message().await.unwrap().0, CLOSE);
    b.ws().send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(b.ws().closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    // A session broken by a failed connection: whose, the caller's (a client that vanished) or
    // the upstream's. The caller's connection is reset.
    send_and_reset(&gw, &up, b"hi").await;
    live_sessions_reach(&gw, 0).await;
    // The upstream's connection is reset, once the caller's first frame has reached it.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.unwrap();
        accept_upgrade(&mut tcp).await;
        let _ = tcp.read_u8().await;
        tcp.set_zero_linger().unwrap();
    });
    let resets = gateway(PLAIN, &format!("http://{addr}")).await;
    let mut c = open(&resets, Some("sk-k"), &[]).await;
    assert_eq!(c.status, 101);
    c.ws().send(TEXT, b"hi").await;
    assert!(c.ws().closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&resets, 0).await;
    let ends = ends();
    assert_eq!(ends.len(), 4, "{ends:?}");
    assert!(ends[0].contains("end=\"caller_closed\""), "{}", ends[0]);
    assert!(ends[1].contains("end=\"upstream_closed\""), "{}", ends[1]);
    for (line, side) in ends[2..].iter().zip(["caller", "upstream"]) {
        assert!(line.contains("end=\"connection_error\""), "{line}");
        assert!(line.contains(&format!("failed=\"{side}\"")), "{line}");
    }
}

#[tokio::test]
async fn an_unknown_key_is_401_and_a_browser_key_in_a_subprotocol_is_taken() {
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    for key in [None, Some("sk-nobody")] {
        let a = open(&gw, key, &[]).await;
        assert_eq!(a.status, 401, "{}", a.body);
        assert_eq!(a.code(), "invalid_api_key");
    }
    let a = open(
        &gw,
        None,
        &[(
            "sec-websocket-protocol",
            "openai-insecure-api-key.sk-nobody",
        )],
    )
    .await;
    assert_eq!(a.status, 401);
    assert_eq!(up.seen.count(), 0, "nothing reached the upstream");
    assert_eq!(gw.state.live_sessions().count(), 0);

    // What OpenAI's browser clients send: the key as a subprotocol entry, which the upstream
    // never sees.
    let mut a = open(
        &gw,
        None,
        &[(
            "sec-websocket-protocol",
            "realtime, openai-insecure-api-key.sk-k, openai-beta.realtime-v1",
        )],
    )
    .await;
    assert_eq!(a.status, 101, "{}", a.body);
    assert_eq!(a.header("sec-websocket-protocol"), Some("realtime"));
    // Nothing was charged before: this is the key's first request.
    assert_eq!(a.header("x-ratelimit-remaining-requests"), Some("4"));
    let (_, h) = up.seen.last();
    assert_eq!(
        h["sec-websocket-protocol"],
        "realtime, openai-beta.realtime-v1"
    );
    assert_eq!(h["authorization"], "Bearer floodgate-gateway");
    a.ws().send(TEXT, b"ping?").await;
    assert_eq!(a.ws().message().await.unwrap().1, b"ping?");
}

#[tokio::test]
async fn over_max_connections_is_refused_uncharged_and_a_slot_frees_when_a_session_ends() {
    let up = ws_upstream().await;
    let config = format!("{PLAIN}\n[realtime]\nmax_connections = 1\n");
    let gw = gateway(&config, &up.url()).await;
    let mut first = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(first.status, 101);
    assert_eq!(first.header("x-ratelimit-remaining-requests"), Some("4"));

    let refused = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.code(), "too_many_connections");
    assert_eq!(refused.header("retry-after"), Some("5"));
    assert_eq!(refused.header("retry-after-ms"), Some("5000"));
    assert_eq!(
        up.seen.count(),
        1,
        "the refused upgrade never reached the upstream"
    );
    // Plain requests are not sessions: still served.
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-remaining-requests"),
        Some("3"),
        "the refused upgrade charged nothing"
    );

    first.ws().send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(first.ws().closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    let mut again = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(again.status, 101, "{}", again.body);
    assert_eq!(again.header("x-ratelimit-remaining-requests"), Some("2"));
    again.ws().send(TEXT, b"still here").await;
    assert_eq!(again.ws().message().await.unwrap().1, b"still here");
}

#[tokio::test]
async fn a_session_is_one_request_and_admission_refuses_the_next_upgrade() {
    let up = ws_upstream().await;
    let config = PLAIN.replace("requests = 5", "requests = 1");
    let gw = gateway(&config, &up.url()).await;
    let mut first = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(first.status, 101);
    assert_eq!(first.header("x-ratelimit-remaining-requests"), Some("0"));
    let second = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(second.status, 429, "{}", second.body);
    assert_eq!(second.code(), "rate_limit_exceeded");
    assert_eq!(second.header("x-ratelimit-limit-requests"), Some("1"));
    assert_eq!(second.header("x-ratelimit-remaining-requests"), Some("0"));
    assert!(second.header("retry-after").is_some());
    assert_eq!(up.seen.count(), 1);
    // The refusal frees its slot at once, and the live session is untouched.
    assert_eq!(gw.state.live_sessions().count(), 1);
    first.ws().send(TEXT, b"on").await;
    assert_eq!(first.ws().message().await.unwrap().1, b"on");
}

/// A key with a token limit; the session meter flushes every second.
const METERED: &str = r#"
[upstream]
base_url = "{upstream}"
[realtime]
flush_sec = 1
[[keys]]
id = "k"
secret = "sk-k"
[[rate_limits]]
scope = "key"
id = "k"
tpm = 100
"#;

#[tokio::test]
async fn after_a_turn_the_caller_hears_its_own_limits_not_the_upstreams() {
    let up = ws_upstream().await;
    // A flush far off: the event describes the window before the turn's tokens are charged.
    let config = METERED
        .replace("flush_sec = 1", "flush_sec = 3600")
        .replace("tpm = 100", "rpm = 7\ntpm = 1000");
    let gw = gateway(&config, &up.url()).await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    let ws = a.ws();
    ws.send(TEXT, b"usage-rl:30").await;
    assert_eq!(
        String::from_utf8(ws.message().await.unwrap().1).unwrap(),
        response_done(30, 0)
    );
    // The upstream's own `rate_limits.updated` (its key's limits) never reaches the caller:
    // what it sent after it does.
    assert_eq!(ws.message().await.unwrap().1, b"after the limits");
    assert_eq!(ws.rate_limits.len(), 1, "{:?}", ws.rate_limits);
    let event: Value = serde_json::from_str(&ws.rate_limits[0]).unwrap();
    assert!(ws.rate_limits[0].starts_with(r#"{"type":"rate_limits.updated""#));
    let limits = event["rate_limits"].as_array().unwrap();
    assert_eq!(limits.len(), 2, "{event}");
    // The session took one of the key's 7 requests; its 30 tokens are not charged yet.
    assert_eq!(limits[0]["name"], "requests");
    assert_eq!(limits[0]["limit"], 7);
    assert_eq!(limits[0]["remaining"], 6);
    assert!(limits[0]["reset_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(limits[1]["name"], "tokens");
    assert_eq!(limits[1]["limit"], 1000);
    assert_eq!(limits[1]["remaining"], 1000);
    assert!(!ws.rate_limits[0].contains("99999"), "not the upstream's");
    // Each turn gets its own.
    ws.send(TEXT, b"usage:5").await;
    ws.message().await.unwrap();
    ws.send(TEXT, b"no usage").await;
    assert_eq!(ws.message().await.unwrap().1, b"no usage");
    assert_eq!(ws.rate_limits.len(), 2);
    assert!(ws.rate_limits[1].contains("event_floodgate_2"));
}

/// A turn's end that comes with the upstream's close frame: the gateway's limits event would be a
/// data frame after a close frame (RFC 6455, 5.5.1), which a client may take as a protocol
/// error; it is not sent.
#[tokio::test]
async fn no_limits_event_follows_the_upstreams_close_frame() {
    let up = ws_upstream().await;
    let config = METERED.replace("flush_sec = 1", "flush_sec = 3600");
    let gw = gateway(&config, &up.url()).await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    let ws = a.ws();
    ws.send(TEXT, b"usage-bye:5").await;
    let done = ws.frame().await.unwrap();
    assert_eq!(
        (done.opcode, done.payload),
        (TEXT, response_done(5, 0).into_bytes())
    );
    let close = ws.frame().await.unwrap();
    assert_eq!(close.opcode, CLOSE);
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    // Nothing after the close frame: the connection ends.
    if let Some(f) = ws.frame().await {
        let text = String::from_utf8_lossy(&f.payload);
        panic!("a frame after the close frame: opcode {}, {text}", f.opcode);
    }
    live_sessions_reach(&gw, 0).await;
}

#[tokio::test]
async fn response_done_tokens_are_charged_at_the_flush_and_a_full_window_keeps_the_session() {
    early_in_a_minute().await;
    let up = ws_upstream().await;
    let gw = gateway(&METERED.replace("tpm = 100", "tpm = 110"), &up.url()).await;
    let mut a = open(
        &gw,
        Some("sk-k"),
        &[("sec-websocket-extensions", "permessage-deflate")],
    )
    .await;
    assert_eq!(a.status, 101);
    let (_, h) = up.seen.last();
    assert!(
        !h.contains_key("sec-websocket-extensions"),
        "metered frames must come uncompressed"
    );
    let ws = a.ws();
    ws.send(TEXT, b"usage:30").await;
    assert_eq!(
        String::from_utf8(ws.message().await.unwrap().1).unwrap(),
        response_done(30, 0)
    );
    ws.send(TEXT, b"usage-fragmented:40").await;
    assert_eq!(
        String::from_utf8(ws.message().await.unwrap().1).unwrap(),
        response_done(40, 300)
    );
    // Not yet flushed: the window is untouched.
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("110"));
    let r = tokens_left_become(&gw, "40").await;
    assert_eq!(r.status, 200);
    // A later flush charges only what came since: 10 more leave 30, where a flush that charged
    // the 70 again would leave none.
    ws.send(TEXT, b"usage:10").await;
    ws.message().await.unwrap();
    tokens_left_become(&gw, "30").await;

    // 35 more: the window is full; a normal request is refused, the session goes on.
    ws.send(TEXT, b"usage:35").await;
    ws.message().await.unwrap();
    let r = tokens_left_become(&gw, "0").await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("0"));
    ws.send(TEXT, b"usage:5").await;
    assert_eq!(
        String::from_utf8(ws.message().await.unwrap().1).unwrap(),
        response_done(5, 0)
    );
    ws.send(BINARY, b"\x01\x02").await;
    assert_eq!(ws.message().await.unwrap().1, b"\x01\x02");
    assert_eq!(gw.state.live_sessions().count(), 1);
}

/// A session reserves nothing, so a full token window refuses the next upgrade whether its limit
/// reserves or not. (Before, a reserving limit admitted it: a reservation of 0 fits a full
/// window exactly.) The first session's tokens reach the reserving limit too.
#[tokio::test]
async fn a_full_token_window_refuses_the_next_upgrade_reserving_or_not() {
    let up = ws_upstream().await;
    for mode in ["reactive", "reserve"] {
        early_in_a_minute().await;
        let config = METERED.replace("tpm = 100", &format!("tpm = 100\ntokens = \"{mode}\""));
        let gw = gateway(&config, &up.url()).await;
        let mut first = open(&gw, Some("sk-k"), &[]).await;
        assert_eq!(first.status, 101, "{mode}");
        first.ws().send(TEXT, b"usage:100").await;
        first.ws().message().await.unwrap();
        tokens_left_become(&gw, "0").await;
        let second = open(&gw, Some("sk-k"), &[]).await;
        assert_eq!(second.status, 429, "{mode}: {}", second.body);
        assert_eq!(second.header("x-ratelimit-remaining-tokens"), Some("0"));
        assert!(second.header("retry-after").is_some(), "{mode}");
        assert_eq!(gw.state.live_sessions().count(), 1, "{mode}");
    }
}

/// The upstream sends a turn's `response.done` and resets its connection while the caller is
/// sending: however the gateway learns of the reset first (its read of the upstream, or its
/// write of the caller's next frame failing), the turn reaches the caller and is charged, and
/// the session ends as failed by the upstream. (The order in which the gateway learns of it is
/// the kernel's: the unit test `a_turn_unread_when_a_write_to_the_upstream_fails_...` in
/// `src/realtime.rs` fixes the order in which a failed write comes first.)
#[tokio::test]
async fn a_turn_the_upstream_sent_before_it_reset_is_passed_on_and_charged() {
    const ROUNDS: u64 = 12;
    early_in_a_minute().await;
    let up = ws_upstream().await;
    let config = METERED.replace("tpm = 100", "tpm = 100000");
    let gw = gateway(&config, &up.url()).await;
    for round in 0..ROUNDS {
        let mut a = open_path(&gw, "/v1/realtime?model=reset", Some("sk-k"), &[]).await;
        assert_eq!(a.status, 101);
        let ws = a.ws();
        ws.send(TEXT, b"done-and-reset:10").await;
        // Frames the upstream never reads, sent while it resets: the gateway's write of one
        // of them may fail before its read of the upstream sees the reset.
        for _ in 0..64 {
            ws.send(BINARY, &[0u8; 1024]).await;
        }
        let (_, text, _) = ws.message().await.expect("the turn's end, passed on");
        assert_eq!(
            String::from_utf8(text).unwrap(),
            response_done(10, 0),
            "round {round}"
        );
        assert!(ws.message().await.is_none(), "round {round}: then the end");
        live_sessions_reach(&gw, 0).await;
        let left = (100000 - 10 * (round + 1)).to_string();
        tokens_left_become(&gw, &left).await;
    }
}

#[tokio::test]
async fn tokens_left_at_the_end_are_charged_once_and_large_messages_pass_unmetered() {
    early_in_a_minute().await;
    let up = ws_upstream().await;
    // A flush interval longer than the test: only the session's end charges.
    let config = METERED
        .replace("flush_sec = 1", "flush_sec = 3600")
        .replace("tpm = 100", "tpm = 1000");
    let gw = gateway(&config, &up.url()).await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    let ws = a.ws();
    ws.send(TEXT, b"usage:60").await;
    ws.message().await.unwrap();
    // Over the metering bound: forwarded whole, its tokens not counted.
    ws.send(TEXT, b"usage-big:500").await;
    let (op, data, _) = ws.message().await.unwrap();
    assert_eq!(
        (op, data.len()),
        (TEXT, response_done(500, 1024 * 1024 + 10).len())
    );
    ws.send(TEXT, b"usage:50").await;
    ws.message().await.unwrap();
    gw.settled().await;
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("1000"));
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(ws.closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    gw.settled().await;
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("890"));
    gw.settled().await;
    let r = models(&gw, "sk-k").await;
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        Some("890"),
        "charged once"
    );
}

#[tokio::test]
async fn a_session_to_an_https_upstream_goes_over_tls_and_is_metered() {
    let up = ws_upstream_tls().await;
    // The test CA trusted through `ca_file`, in `[upstream]` (just before `[realtime]`).
    let ca = format!(
        "ca_file = \"{}\"\n[realtime]",
        tls_fixture("ca.pem").display()
    );
    let config = METERED
        .replace("[realtime]", &ca)
        .replace("tpm = 100", "tpm = 1000");
    let gw = gateway(&config, &up.https_url()).await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101, "{}", a.body);
    let (_, h) = up.seen.last();
    assert_eq!(h["host"], format!("localhost:{}", up.addr.port()));
    let ws = a.ws();
    ws.send(TEXT, b"over tls").await;
    assert_eq!(ws.message().await.unwrap().1, b"over tls");
    ws.send(TEXT, b"usage:25").await;
    ws.message().await.unwrap();
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(ws.closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    gw.settled().await;
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("975"));
}

#[tokio::test]
async fn an_upstream_refusal_passes_through_charged_and_a_dead_upstream_is_502() {
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    let a = open_path(&gw, "/v1/realtime?model=refuse", Some("sk-k"), &[]).await;
    assert_eq!(a.status, 403, "{}", a.body);
    assert_eq!(a.body, r#"{"error":{"code":"model_not_found"}}"#);
    assert_eq!(a.header("x-ratelimit-remaining-requests"), Some("4"));
    live_sessions_reach(&gw, 0).await;

    let dead = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let gw = gateway(PLAIN, &url).await;
    let a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 502, "{}", a.body);
    assert_eq!(a.code(), "upstream_unavailable");
    assert_eq!(a.header("x-ratelimit-remaining-requests"), Some("4"));
    assert_eq!(gw.state.live_sessions().count(), 0);
}

#[tokio::test]
async fn malformed_upgrades_charge_nothing() {
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    let a = open(&gw, Some("sk-k"), &[("sec-websocket-version", "8")]).await;
    assert_eq!(a.status, 400, "{}", a.body);
    assert_eq!(a.code(), "invalid_request");
    // A handshake that announces a body: forwarded, its upstream could wait for the body.
    let b = open(&gw, Some("sk-k"), &[("content-length", "4")]).await;
    assert_eq!(b.status, 400, "{}", b.body);
    assert_eq!(b.code(), "invalid_request");
    let chunked = raw_upgrade(1).replace("\r\n\r\n", "\r\nTransfer-Encoding: chunked\r\n\r\n");
    let (_tcp, head) = raw_request(gw.addr, &chunked).await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = sender
        .send_request(
            Request::builder()
                .uri("/v1/realtime")
                .header("host", "x")
                .header("connection", "upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-version", "13")
                .header("authorization", "Bearer sk-k")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 400, "no Sec-WebSocket-Key");
    // With the chain's state, read without charging.
    let left = resp.headers().get("x-ratelimit-remaining-requests");
    assert_eq!(left.and_then(|v| v.to_str().ok()), Some("5"));
    assert_eq!(up.seen.count(), 0);
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
}

#[tokio::test]
async fn the_demo_upstream_answers_a_realtime_session_and_its_tokens_are_charged() {
    let demo = r#"
[upstream]
demo = true
[[keys]]
id = "k"
secret = "sk-k"
[[rate_limits]]
scope = "key"
id = "k"
tpm = 1000
"#;
    let gw = gateway(demo, "").await;
    let mut a = open(&gw, Some("sk-k"), &[("sec-websocket-protocol", "realtime")]).await;
    assert_eq!(a.status, 101, "{}", a.body);
    // The demo's handshake is a real one: RFC 6455's sample key gets its sample accept.
    assert_eq!(a.header("sec-websocket-accept"), Some(WS_ACCEPT));
    assert_eq!(a.header("sec-websocket-protocol"), Some("realtime"));
    let ws = a.ws();
    let event = |data: Vec<u8>| -> serde_json::Value { serde_json::from_slice(&data).unwrap() };
    let created = event(ws.message().await.unwrap().1);
    assert_eq!(created["type"], "session.created");
    assert_eq!(created["session"]["model"], "gpt-realtime");
    let item = json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Hello, demo!"}]}});
    ws.send(TEXT, item.to_string().as_bytes()).await;
    assert_eq!(
        event(ws.message().await.unwrap().1)["type"],
        "conversation.item.created"
    );
    ws.send(TEXT, br#"{"type":"response.create"}"#).await;
    let mut text = String::new();
    let usage = loop {
        let e = event(ws.message().await.unwrap().1);
        match e["type"].as_str().unwrap() {
            "response.created" | "response.output_text.done" => {}
            "response.output_text.delta" => text.push_str(e["delta"].as_str().unwrap()),
            "response.done" => break e["response"]["usage"].clone(),
            other => panic!("unexpected {other}: {e}"),
        }
    };
    assert_eq!(text, floodgate_gateway::demo::REPLY);
    let total = usage["total_tokens"].as_u64().unwrap();
    assert_eq!(
        total,
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap()
    );
    ws.send(TEXT, b"not json").await;
    assert_eq!(event(ws.message().await.unwrap().1)["type"], "error");
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    assert_eq!(ws.message().await.unwrap().0, CLOSE);
    assert!(ws.closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    gw.settled().await;
    let r = models(&gw, "sk-k").await;
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        Some((1000 - total).to_string().as_str())
    );
}

#[tokio::test]
async fn a_drain_waits_for_a_live_session() {
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    let mut gw = gw;
    gw.shutdown();
    // The drain has begun once the listener is closed.
    let start = Instant::now();
    while tokio::net::TcpStream::connect(gw.addr).await.is_ok() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the listener stays open"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let server = gw.server.take().unwrap();
    assert!(!server.is_finished(), "the drain waits for the session");
    let ws = a.ws();
    ws.send(TEXT, b"during the drain").await;
    assert_eq!(ws.message().await.unwrap().1, b"during the drain");
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(ws.closed_within(Duration::from_secs(2)).await);
    tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .expect("the drain ends with the session")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn at_the_end_of_drain_sec_live_sessions_are_closed_and_their_tokens_charged() {
    early_in_a_minute().await;
    let up = ws_upstream().await;
    let config = METERED
        .replace("flush_sec = 1", "flush_sec = 3600\ndrain_sec = 1")
        .replace("tpm = 100", "tpm = 1000");
    let c = config_for(&config, &up.url());
    let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
    let mut gw = gateway_on(&c, store.clone()).await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    a.ws().send(TEXT, b"usage:70").await;
    a.ws().message().await.unwrap();
    // The turn's `rate_limits.updated` follows it at once.
    let told = a.ws().any_message().await.unwrap();
    assert!(String::from_utf8_lossy(&told.1).contains("event_floodgate_1"));
    let start = Instant::now();
    gw.shutdown();
    let server = gw.server.take().unwrap();
    // A close frame, 1001 (going away), then the end of the connection.
    let close = tokio::time::timeout(Duration::from_secs(3), a.ws().frame())
        .await
        .expect("closed by the drain")
        .expect("a close frame first");
    assert_eq!(
        (close.opcode, close.payload),
        (CLOSE, 1001u16.to_be_bytes().to_vec())
    );
    assert!(a.ws().closed_within(Duration::from_secs(1)).await);
    let closed_after = start.elapsed();
    assert!(
        closed_after >= Duration::from_millis(900),
        "{closed_after:?}: sessions get drain_sec"
    );
    tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .expect("the drain ends once the sessions are closed")
        .unwrap()
        .unwrap();
    // The upstream was told too (masked, as a client's frames are).
    let told = Instant::now();
    while up.seen.closes().is_empty() && told.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(up.seen.closes(), [1001u16.to_be_bytes().to_vec()]);
    // The session's tokens were charged before `run` returned.
    let after = gateway_on(&c, store).await;
    let r = models(&after, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("930"));
}

fn config_for(text: &str, upstream: &str) -> floodgate_gateway::Config {
    common::config(text, upstream)
}

/// The `floodgate` binary on a config of its own, its stderr kept; killed when dropped.
struct Binary {
    child: std::process::Child,
    path: std::path::PathBuf,
}

impl Binary {
    fn start(config: &str) -> Binary {
        let path =
            std::env::temp_dir().join(format!("floodgate-realtime-{}.toml", std::process::id()));
        std::fs::write(&path, config).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .args(["serve", "--config"])
            .arg(&path)
            .env_remove("FLOODGATE_REDIS_URL")
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        Binary { child, path }
    }

    async fn exited(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    fn stderr(&mut self) -> String {
        let mut err = String::new();
        std::io::Read::read_to_string(&mut self.child.stderr.take().unwrap(), &mut err).unwrap();
        err
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The binary with two workers: the cap holds across them, SIGTERM closes the live session at
/// `drain_sec` and exits 0, and the log has the session's request line and end line, never the
/// key sent as a subprotocol.
#[cfg(unix)]
#[tokio::test]
async fn the_binary_caps_sessions_across_workers_logs_them_and_closes_them_on_sigterm() {
    let up = ws_upstream().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut bin = Binary::start(&format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 2\n[upstream]\nbase_url = \"{}\"\n\
         [realtime]\nmax_connections = 1\ndrain_sec = 1\n\
         [[keys]]\nid = \"k\"\nsecret = \"sk-secret-k\"\n[[rate_limits]]\nscope = \"key\"\nid = \"k\"\ntpm = 1000\n",
        up.url()
    ));
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(addr).await.is_err() {
        assert!(Instant::now() < deadline, "the gateway did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let browser_key = [(
        "sec-websocket-protocol",
        "realtime, openai-insecure-api-key.sk-secret-k",
    )];
    let mut a = open_at(addr, "/v1/realtime?model=m", None, &browser_key).await;
    assert_eq!(a.status, 101, "{}", a.body);
    a.ws().send(TEXT, b"usage:25").await;
    a.ws().message().await.unwrap();
    // New connections land on either worker: every one is refused while the session lives.
    for _ in 0..6 {
        let b = open_at(addr, "/v1/realtime?model=m", Some("sk-secret-k"), &[]).await;
        assert_eq!(b.status, 429, "{}", b.body);
        assert_eq!(b.code(), "too_many_connections");
    }
    let pid = bin.child.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    assert!(
        a.ws().closed_within(Duration::from_secs(5)).await,
        "the drain closes the session"
    );
    let status = bin.exited(Duration::from_secs(10)).await.expect("exits");
    assert!(status.success(), "{status:?}");
    let log = bin.stderr();
    assert!(!log.contains("sk-secret-k"), "{log}");
    let upgrade = log
        .lines()
        .find(|l| l.contains("status=101"))
        .unwrap_or_else(|| panic!("no request line for the upgrade: {log}"));
    assert!(
        upgrade.contains("key=k") && upgrade.contains("admitted"),
        "{upgrade}"
    );
    let ended = log
        .lines()
        .find(|l| l.contains("realtime session ended"))
        .unwrap_or_else(|| panic!("no end line: {log}"));
    assert!(
        ended.contains("key=k") && ended.contains("tokens=25") && ended.contains("shutdown"),
        "{ended}"
    );
    assert_eq!(
        log.matches("too_many_connections").count(),
        6,
        "one line per refusal: {log}"
    );
}

/// Budgets hold for sessions too: a session's `response.done` usage is priced by the model its
/// URL names and spent against the key's budget; a spent budget refuses the next upgrade
/// (`insufficient_quota`). Both kinds of 429 a session can get are counted in the refusal
/// tally: the process's cap against the gateway, the budget against the key.
#[tokio::test]
async fn sessions_spend_against_budgets_and_their_refusals_are_tallied() {
    let up = ws_upstream().await;
    let gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[realtime]
max_connections = 1
[alerts]
secret = "sk-admin"
[[keys]]
id = "k"
secret = "sk-k"
[[prices]]
model = "gpt-realtime"
input_per_million = 1000000
output_per_million = 1000000
[[budgets]]
scope = "key"
id = "k"
period = "day"
usd = 10
"#,
        &up.url(),
    )
    .await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    let full = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(
        (full.status.as_u16(), full.code()),
        (429, "too_many_connections".into())
    );
    // 20 tokens of gpt-realtime at $1 a token: twice the day's $10.
    let ws = a.ws();
    ws.send(TEXT, b"usage:20").await;
    ws.message().await.unwrap();
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(ws.closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    let spent = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(
        (spent.status.as_u16(), spent.code()),
        (429, "budget_exceeded".into()),
        "{}",
        spent.body
    );
    let alerts = gw
        .send(gw.request("GET", "/alerts", Some("sk-admin"), ""))
        .await
        .json();
    let counts: Vec<(String, u64)> = alerts["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["subject"].as_str().unwrap().to_owned(),
                a["count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        counts,
        [("gateway".into(), 1), ("key".into(), 1)],
        "{alerts}"
    );
}

/// A key with a $10 daily budget, gpt-realtime at $1 a token and `cheap` at $1 a million.
const PRICED: &str = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 5 }
[[prices]]
model = "gpt-realtime"
input_per_million = 1000000
output_per_million = 1000000
[[prices]]
model = "cheap"
input_per_million = 1
output_per_million = 1
[[budgets]]
scope = "key"
id = "k"
period = "day"
usd = 10
"#;

/// The URL names a cheap model, the upstream's session event another: the session's turns are
/// priced by the upstream's word from that event on (the URL's model before it).
#[tokio::test]
async fn spend_is_priced_by_the_model_the_upstreams_session_events_name() {
    let up = ws_upstream().await;
    let gw = gateway(PRICED, &up.url()).await;
    let mut a = open_path(&gw, "/v1/realtime?model=cheap", Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101, "{}", a.body);
    let ws = a.ws();
    // Before any session event: the URL's model, 20 tokens of `cheap`.
    ws.send(TEXT, b"usage:20").await;
    ws.message().await.unwrap();
    ws.send(TEXT, b"session:gpt-realtime-2025-08-28").await;
    ws.message().await.unwrap();
    // 20 tokens of what the upstream runs: $20, twice the day's $10.
    ws.send(TEXT, b"usage:20").await;
    ws.message().await.unwrap();
    ws.send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(ws.closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&gw, 0).await;
    gw.settled().await;
    let spent = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(
        (spent.status.as_u16(), spent.code()),
        (429, "budget_exceeded".into()),
        "{}",
        spent.body
    );
}

/// A query that names `model` twice, or by a percent-encoded name, could be read one way by the
/// gateway and another by the upstream: refused before anything is charged or sent.
#[tokio::test]
async fn an_ambiguous_model_in_the_query_is_refused_uncharged() {
    let up = ws_upstream().await;
    let gw = gateway(PRICED, &up.url()).await;
    for path in [
        "/v1/realtime?model=cheap&model=gpt-realtime",
        "/v1/realtime?mod%65l=gpt-realtime",
        "/v1/realtime?model=cheap&%6Dodel=gpt-realtime",
    ] {
        let a = open_path(&gw, path, Some("sk-k"), &[]).await;
        assert_eq!(a.status, 400, "{path}: {}", a.body);
        assert_eq!(a.code(), "invalid_request", "{path}");
    }
    assert_eq!(up.seen.count(), 0, "nothing reached the upstream");
    assert_eq!(gw.state.live_sessions().count(), 0);
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
    // An encoded value is no ambiguity.
    let a = open_path(&gw, "/v1/realtime?model=gpt%2Drealtime", Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101, "{}", a.body);
}

/// A raw TCP connection to `addr` that has sent `request` and read the answer's head (status
/// line and headers, nothing after).
async fn raw_request(addr: SocketAddr, request: &str) -> (TcpStream, String) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let b = tokio::time::timeout(Duration::from_secs(5), tcp.read_u8())
            .await
            .expect("an answer")
            .expect("an answer's head");
        head.push(b);
    }
    (tcp, String::from_utf8(head).unwrap())
}

/// An upgrade request for `/v1/realtime` over HTTP/1.`minor`, by key `sk-k`.
fn raw_upgrade(minor: u8) -> String {
    format!(
        "GET /v1/realtime?model=gpt-realtime HTTP/1.{minor}\r\nHost: x\r\nConnection: Upgrade\r\n\
         Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {WS_KEY}\r\n\
         Authorization: Bearer sk-k\r\n\r\n"
    )
}

/// hyper upgrades HTTP/1.1 connections only: an HTTP/1.0 upgrade could never start a session.
#[tokio::test]
async fn an_http_1_0_upgrade_is_refused_uncharged() {
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    let (_tcp, head) = raw_request(gw.addr, &raw_upgrade(0)).await;
    assert!(
        head.starts_with("HTTP/1.0 400") || head.starts_with("HTTP/1.1 400"),
        "{head}"
    );
    assert_eq!(up.seen.count(), 0, "nothing reached the upstream");
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
}

/// A caller whose connection is reset amid a turn: the upstream is read on for a while, and the
/// turn's tokens are charged.
#[tokio::test]
async fn a_turn_under_way_when_the_caller_fails_is_charged() {
    early_in_a_minute().await;
    let up = ws_upstream().await;
    let config = METERED
        .replace("flush_sec = 1", "flush_sec = 3600")
        .replace("tpm = 100", "tpm = 1000");
    let gw = gateway(&config, &up.url()).await;
    send_and_reset(&gw, &up, b"usage-later:33").await;
    live_sessions_reach(&gw, 0).await;
    gw.settled().await;
    let r = models(&gw, "sk-k").await;
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("967"));
}

/// An upstream that takes the handshake and then reads nothing more, as a hung one: a caller's
/// frames would wait for it for good, the caller's leaving unseen (the gateway reads no more of
/// it), and the session with its slots would live on. Its writes are timed as the caller's are:
/// `header_timeout_sec` with nothing taken ends the session.
#[tokio::test]
async fn a_session_whose_upstream_takes_nothing_ends() {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(8).unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.unwrap();
        accept_upgrade(&mut tcp).await;
        // Held open, never read again.
        std::future::pending::<()>().await;
        drop(tcp);
    });
    let config = format!("[server]\nheader_timeout_sec = 1\n{PLAIN}");
    let gw = gateway(&config, &format!("http://{addr}")).await;
    let mut a = open(&gw, Some("sk-k"), &[]).await;
    assert_eq!(a.status, 101);
    let mut ws = a.ws.take().unwrap();
    // Audio, as fast as it goes: the writes stall once the buffers on the way are full.
    tokio::spawn(async move {
        let mut frame = vec![0x82, 127];
        frame.extend_from_slice(&(64u64 * 1024).to_be_bytes());
        frame.extend_from_slice(&[0, 0, 0, 0]);
        frame.extend(std::iter::repeat_n(b'a', 64 * 1024));
        while ws.io.write_all(&frame).await.is_ok() {}
    });
    live_sessions_reach(&gw, 0).await;
}

#[tokio::test]
async fn an_unmetered_session_whose_caller_fails_frees_its_slot_at_once() {
    // Nothing to meter: the upstream (busy for 5 s) is not read on after the caller's reset.
    let up = ws_upstream().await;
    let gw = gateway(PLAIN, &up.url()).await;
    send_and_reset(&gw, &up, b"hold").await;
    live_sessions_reach(&gw, 0).await;
}

/// A key's `max_in_flight` caps its sessions: a session holds its slot for its whole life, on
/// every one of `n` replicas sharing the store `store` names, and gives it back when it closes.
async fn sessions_hold_their_slots(store: &str, n: usize) {
    let up = ws_upstream().await;
    let text = format!(
        "{}\n{store}\n",
        PLAIN.replace("requests = 5", "requests = 50, max_in_flight = 1")
    );
    let c = config_for(&text, &up.url());
    let mut replicas = Vec::new();
    for _ in 0..n {
        let s = floodgate_gateway::store::open(&c.store).await.unwrap().0;
        replicas.push(gateway_on(&c, s).await);
    }
    let mut first = open(&replicas[0], Some("sk-k"), &[]).await;
    assert_eq!(first.status, 101, "{}", first.body);
    assert_eq!(first.header("x-floodgate-in-flight-remaining"), Some("0"));
    // On every replica: one session at a time.
    for gw in &replicas {
        let refused = open(gw, Some("sk-k"), &[]).await;
        assert_eq!(refused.status, 429, "{}", refused.body);
        assert_eq!(refused.code(), "concurrency_limit_exceeded");
        assert_eq!(refused.header("retry-after"), Some("1"));
    }
    assert_eq!(
        up.seen.count(),
        1,
        "the refused upgrades never reached the upstream"
    );
    first.ws().send(TEXT, b"still mine").await;
    assert_eq!(first.ws().message().await.unwrap().1, b"still mine");
    first.ws().send(CLOSE, &1000u16.to_be_bytes()).await;
    assert!(first.ws().closed_within(Duration::from_secs(2)).await);
    live_sessions_reach(&replicas[0], 0).await;
    replicas[0].settled().await;
    let mut next = open(&replicas[n - 1], Some("sk-k"), &[]).await;
    assert_eq!(next.status, 101, "{}", next.body);
    next.ws().send(TEXT, b"mine now").await;
    assert_eq!(next.ws().message().await.unwrap().1, b"mine now");
}

#[tokio::test]
async fn a_session_holds_its_keys_slot_until_it_closes() {
    // Gateways on memory stores count alone: one replica.
    sessions_hold_their_slots("", 1).await;
}

#[tokio::test]
async fn a_session_holds_its_keys_slot_on_every_replica_on_redis() {
    let Some(url) = test_redis_url("a_session_holds_its_keys_slot_on_every_replica_on_redis")
    else {
        return;
    };
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"{}\"",
        fresh_prefix()
    );
    sessions_hold_their_slots(&store, 2).await;
}

/// For a raw upstream: reads the upgrade request's head from `tcp` and answers it 101.
async fn accept_upgrade(tcp: &mut TcpStream) {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        head.push(tcp.read_u8().await.unwrap());
    }
    let answer = format!(
        "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\
         sec-websocket-accept: {WS_ACCEPT}\r\n\r\n"
    );
    tcp.write_all(answer.as_bytes()).await.unwrap();
}
