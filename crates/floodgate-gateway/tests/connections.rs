//! Client connections: a caller that trickles its request head, or keeps a connection idle, is
//! cut off after `[server] header_timeout_sec`; a prompt caller is served; a caller trickling an
//! upload holds up no other caller's request, and the upstream connection it used is reused once
//! the upload is done.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CONFIG: &str = "[server]\nheader_timeout_sec = 1\n[upstream]\nbase_url = \"{upstream}\"\n";

/// Reads until the gateway closes the connection; returns what it sent and when it closed.
async fn read_until_closed(conn: &mut TcpStream, start: Instant) -> (String, Duration) {
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut got)).await;
    assert!(
        read.is_ok(),
        "the gateway kept the connection open for 10 s"
    );
    (String::from_utf8_lossy(&got).into_owned(), start.elapsed())
}

#[tokio::test]
async fn a_request_head_sent_too_slowly_is_cut_off() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let mut conn = TcpStream::connect(gw.addr).await.unwrap();
    let start = Instant::now();
    conn.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let (got, after) = read_until_closed(&mut conn, start).await;
    assert!(
        !got.contains("200 OK"),
        "an incomplete head was answered: {got}"
    );
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(5),
        "closed after {after:?}"
    );
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_and_a_prompt_one_is_served() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let mut conn = TcpStream::connect(gw.addr).await.unwrap();
    conn.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = conn.read(&mut buf).await.unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let start = Instant::now();
    let (more, after) = read_until_closed(&mut conn, start).await;
    assert!(!more.contains("HTTP/1.1 200"), "{more}");
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(5),
        "closed after {after:?}"
    );
}

#[test]
fn header_timeout_defaults_to_sixty_seconds() {
    let c = config("[upstream]\ndemo = true\n", "");
    assert_eq!(c.header_timeout, Duration::from_secs(60));
}

#[tokio::test]
async fn a_request_body_read_before_admission_and_sent_too_slowly_is_refused_uncharged() {
    let up = fake_upstream().await;
    // Token-limited: the gateway reads a completion's body before admission.
    let gw = gateway(
        r#"
[server]
header_timeout_sec = 1
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 5 }
[[rate_limits]]
scope = "key"
id = "k"
tpm = 1000
"#,
        &up.url(),
    )
    .await;
    let mut conn = TcpStream::connect(gw.addr).await.unwrap();
    let start = Instant::now();
    conn.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\
          content-type: application/json\r\ncontent-length: 100\r\n\r\n{",
    )
    .await
    .unwrap();
    let (got, after) = read_until_closed(&mut conn, start).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(5),
        "answered after {after:?}"
    );
    assert_eq!(up.seen.hits(), 0);
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
}

/// An upstream that answers its first connection's first request with a 401 as soon as the head
/// is in, and then reads nothing more from it (as a server refusing a large upload may); on
/// every later connection it answers each request head with a 200.
async fn early_answering_upstream() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            let refuse = std::mem::replace(&mut first, false);
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let n = conn.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    while let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        got.drain(..end + 4);
                        if refuse {
                            let _ = conn
                                .write_all(
                                    b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n",
                                )
                                .await;
                            // Hold the connection, reading nothing more.
                            tokio::time::sleep(Duration::from_secs(30)).await;
                            return;
                        }
                        let _ = conn
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                            .await;
                    }
                }
            });
        }
    });
    addr
}

/// A gateway on one worker (so that every request shares one upstream pool) in front of `up`.
async fn one_worker_gateway(up: std::net::SocketAddr) -> Gateway {
    gateway(
        "[server]\nworkers = 1\n[upstream]\nbase_url = \"{upstream}\"\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n",
        &format!("http://{up}"),
    )
    .await
}

/// Starts an upload of `length` bytes (sending 1 000 of them) that the upstream answers with a
/// 401 at once; returns the caller's connection, its body still to finish.
async fn refused_upload(gw: &Gateway, length: usize) -> TcpStream {
    let mut a = TcpStream::connect(gw.addr).await.unwrap();
    let head = format!(
        "POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\ncontent-length: {length}\r\n\r\n"
    );
    a.write_all(head.as_bytes()).await.unwrap();
    a.write_all(&[b'x'; 1000]).await.unwrap();
    let mut answer = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), a.read(&mut answer))
        .await
        .expect("the upload was answered")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 401"),
        "{}",
        String::from_utf8_lossy(&answer[..n])
    );
    a
}

#[tokio::test]
async fn an_upload_still_in_flight_does_not_hold_up_the_next_request() {
    let up = early_answering_upstream().await;
    let gw = one_worker_gateway(up).await;
    // A: a large upload, trickled; the upstream refuses it at once.
    let a = refused_upload(&gw, 50_000_000).await;
    // B, on the same worker, while A's body is still being sent upstream.
    let started = Instant::now();
    let b = tokio::time::timeout(Duration::from_secs(5), async {
        let r = gw
            .send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
            .await;
        r.status
    })
    .await
    .expect("B waited for A's upload");
    assert_eq!(b, 200);
    // Well under the upstream timeout (300 s) that waiting behind the upload would take.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    drop(a);
}

/// An upstream that answers the first request on its first connection with `answer` as it is
/// written, then holds the connection open (the answer, not a close, is what the gateway reads).
async fn answering_once(answer: &'static [u8]) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf).await;
        conn.write_all(answer).await.unwrap();
        let _ = conn.read(&mut buf).await;
    });
    up
}

#[tokio::test]
async fn an_upstream_length_beside_chunked_framing_does_not_cut_the_answer() {
    // Both framings at once: hyper reads the chunked body (18 bytes); a forwarded
    // `Content-Length: 5` would cut it to 5.
    let up = answering_once(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\
          content-length: 5\r\n\r\n12\r\n{\"object\":\"list\"} \r\n0\r\n\r\n",
    )
    .await;
    let gw = gateway(
        "[upstream]\nbase_url = \"{upstream}\"\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n",
        &format!("http://{up}"),
    )
    .await;
    let r = gw
        .send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "{\"object\":\"list\"} ", "the whole body");
}

/// An upstream that answers an upload (`POST`) with a 401 as soon as its head is in and then
/// reads its body to the end, and every other request with a 200 after 100 ms; counts the
/// connections it accepted and the uploads it read to their end.
async fn refusing_uploads_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let uploaded = Arc::new(AtomicUsize::new(0));
    let (counted, read_whole) = (Arc::clone(&accepted), Arc::clone(&uploaded));
    tokio::spawn(async move {
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            counted.fetch_add(1, Ordering::SeqCst);
            let read_whole = Arc::clone(&read_whole);
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 8192];
                // Body bytes of the current upload still to read.
                let mut body_left = 0;
                loop {
                    let n = conn.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    loop {
                        if body_left > 0 {
                            let take = body_left.min(got.len());
                            got.drain(..take);
                            body_left -= take;
                            if body_left > 0 {
                                break;
                            }
                            read_whole.fetch_add(1, Ordering::SeqCst);
                        }
                        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                            break;
                        };
                        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                        got.drain(..end + 4);
                        if head.starts_with("post") {
                            body_left = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                            let refusal = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n";
                            let _ = conn.write_all(refusal).await;
                        } else {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            let _ = conn.write_all(ok).await;
                        }
                    }
                }
            });
        }
    });
    (addr, accepted, uploaded)
}

#[tokio::test]
async fn a_connection_left_to_finish_an_upload_is_reused_after_it() {
    let (up, accepted, uploaded) = refusing_uploads_upstream().await;
    let gw = one_worker_gateway(up).await;
    // A: an upload, trickled; the upstream refuses it at once and reads on.
    let mut a = refused_upload(&gw, 200_000).await;
    // B, while A's body is still going: A's connection is busy, B takes a new one.
    let models = || gw.request("GET", "/v1/models", Some("sk-k"), "");
    assert_eq!(gw.send(models()).await.status, 200);
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    // A's upload ends: its connection can carry requests again.
    a.write_all(&[b'x'; 199_000]).await.unwrap();
    // The upstream has read it whole: the gateway sent its last byte, and the connection,
    // ready again, went back into the pool as that send finished.
    wait_until("the upstream read A's upload whole", || {
        uploaded.load(Ordering::SeqCst) == 1
    })
    .await;
    // C and D at once (each answered after 100 ms): both go on the two kept connections.
    let (c, d) = tokio::join!(gw.send(models()), gw.send(models()));
    assert_eq!((c.status.as_u16(), d.status.as_u16()), (200, 200));
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        2,
        "A's connection was closed after its upload, not reused"
    );
}

/// A key with a request limit only: its bodies go on to the upstream as they come, unread.
const STREAMING: &str = r#"
[server]
header_timeout_sec = 1
[upstream]
base_url = "{upstream}"
timeout_sec = 1
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 100 }
"#;

/// `POST /v1/chat/completions` head for key `k`, with `framing` (`content-length: N` or
/// `transfer-encoding: chunked`).
fn upload_head(framing: &str) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\
         content-type: application/json\r\n{framing}\r\n\r\n"
    )
}

/// The gateway's count of upstream calls that failed (`status_class="error"`).
fn upstream_errors(gw: &Gateway) -> String {
    let text = gw.state.metrics().encode();
    let series = r#"floodgate_upstream_duration_seconds_count{status_class="error"}"#;
    text.lines()
        .find(|l| l.starts_with(series))
        .map_or_else(|| "0".to_owned(), |l| l[series.len()..].trim().to_owned())
}

/// A caller's own broken upload (malformed chunked framing, or cut short by its half-close) is
/// its doing: 400, not a 502 that blames the upstream in the answer, the log and the metrics.
#[tokio::test]
async fn a_streamed_body_the_caller_breaks_is_a_400_not_an_upstream_failure() {
    let up = fake_upstream().await;
    let gw = gateway(STREAMING, &up.url()).await;
    let broken: [(&str, &[u8]); 2] = [
        ("transfer-encoding: chunked", b"1\r\n{\r\nzz\r\n"),
        ("content-length: 1000", b"{\"model\":"),
    ];
    for (framing, body) in broken {
        let mut conn = TcpStream::connect(gw.addr).await.unwrap();
        conn.write_all(upload_head(framing).as_bytes())
            .await
            .unwrap();
        conn.write_all(body).await.unwrap();
        // The caller is done sending: its body ends short of its length.
        conn.shutdown().await.unwrap();
        let (got, _) = read_until_closed(&mut conn, Instant::now()).await;
        assert!(got.starts_with("HTTP/1.1 400"), "{framing}: {got}");
        assert!(got.contains("could not be read"), "{framing}: {got}");
    }
    assert_eq!(upstream_errors(&gw), "0");
}

/// An upload that keeps coming (a byte every 100 ms, for 2.7 s) is not cut off by the
/// upstream's `timeout_sec` (1 s): that counts from the body's last piece, since the upstream
/// cannot answer before it has the request.
#[tokio::test]
async fn an_upload_that_keeps_coming_outlasts_the_upstreams_timeout() {
    let up = fake_upstream().await;
    let gw = gateway(STREAMING, &up.url()).await;
    let body = CHAT.as_bytes();
    let mut conn = TcpStream::connect(gw.addr).await.unwrap();
    let framing = format!("content-length: {}", body.len());
    conn.write_all(upload_head(&framing).as_bytes())
        .await
        .unwrap();
    let start = Instant::now();
    for chunk in body.chunks((body.len() / 27).max(1)) {
        // The caller's pace, not a wait for the gateway.
        tokio::time::sleep(Duration::from_millis(100)).await;
        conn.write_all(chunk).await.unwrap();
    }
    let mut got = vec![0u8; 4096];
    let n = conn.read(&mut got).await.unwrap();
    let got = String::from_utf8_lossy(&got[..n]).into_owned();
    assert!(start.elapsed() > Duration::from_secs(2));
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(up.seen.hits(), 1);
}

/// An upload that stops coming is cut off after `header_timeout_sec` of silence (1 s here):
/// 408, charged the request it was admitted as, and no upstream failure.
#[tokio::test]
async fn an_upload_that_stops_coming_is_a_408() {
    let up = fake_upstream().await;
    let gw = gateway(
        &STREAMING.replace("\ntimeout_sec = 1\n", "\ntimeout_sec = 60\n"),
        &up.url(),
    )
    .await;
    let mut conn = TcpStream::connect(gw.addr).await.unwrap();
    conn.write_all(upload_head("content-length: 1000").as_bytes())
        .await
        .unwrap();
    let start = Instant::now();
    conn.write_all(b"{\"model\":").await.unwrap();
    let (got, after) = read_until_closed(&mut conn, start).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(5),
        "answered after {after:?}"
    );
    assert!(got.contains("x-ratelimit-remaining: 99"), "{got}");
    assert_eq!(upstream_errors(&gw), "0");
}

/// An answer that never ends: 64 KiB pieces for as long as it is read; `dropped` is told when
/// it is dropped (its reader gone).
struct Endless {
    dropped: Option<tokio::sync::oneshot::Sender<()>>,
}

impl http_body::Body for Endless {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        let piece = bytes::Bytes::from(vec![b'x'; 64 * 1024]);
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(piece))))
    }
}

impl Drop for Endless {
    fn drop(&mut self) {
        if let Some(tx) = self.dropped.take() {
            let _ = tx.send(());
        }
    }
}

/// A caller that stops reading its answer is cut off once the gateway's writes to it have
/// waited `header_timeout_sec` (1 s here), as nginx's `send_timeout` does: its connection
/// closes and the upstream's answer is let go, rather than held, with the caller's slots, for as
/// long as the caller stays.
#[tokio::test]
async fn a_caller_that_stops_reading_is_cut_off() {
    let (tx, dropped) = tokio::sync::oneshot::channel();
    let tx = Arc::new(std::sync::Mutex::new(Some(tx)));
    let app = axum::Router::new().route(
        "/v1/endless",
        axum::routing::get(move || {
            let dropped = tx.lock().unwrap().take();
            async move { axum::body::Body::new(Endless { dropped }) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let gw = gateway(STREAMING, &format!("http://{up}")).await;
    // A small receive window, so that the gateway's writes wait soon.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut conn = socket.connect(gw.addr).await.unwrap();
    conn.write_all(b"GET /v1/endless HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\r\n")
        .await
        .unwrap();
    // Nothing is read from here on.
    let let_go = tokio::time::timeout(Duration::from_secs(20), dropped).await;
    assert!(
        let_go.is_ok(),
        "the upstream's answer was still being sent 20 s after the caller stopped reading"
    );
    drop(conn);
}

/// An answer with a transfer coding besides `chunked` (`gzip, chunked`, which the gateway never
/// offers): hyper takes off the chunks and leaves the gzip, which, the header being hop-by-hop,
/// would reach the caller unmarked (and unmetered). A 502 instead, charged as any.
#[tokio::test]
async fn an_upstream_answer_with_another_transfer_coding_is_a_502() {
    let up = answering_once(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
          transfer-encoding: gzip, chunked\r\n\r\n3\r\n\x1f\x8b\x08\r\n0\r\n\r\n",
    )
    .await;
    let gw = gateway(STREAMING, &format!("http://{up}")).await;
    let r = gw
        .send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
        .await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
    assert_eq!(r.header("x-ratelimit-remaining"), Some("99"));
}

/// A caller pausing mid-upload (1.5 s, within `header_timeout_sec` of 3 s) is no upstream
/// timeout, however short `timeout_sec` (1 s) is: the upstream cannot answer before it has the
/// request, and the wait is the caller's, which the upload's own timer bounds.
#[tokio::test]
async fn a_pause_mid_upload_is_no_upstream_timeout() {
    let up = fake_upstream().await;
    let config = STREAMING.replace("header_timeout_sec = 1", "header_timeout_sec = 3");
    let gw = gateway(&config, &up.url()).await;
    let body = CHAT.as_bytes();
    let mut conn = TcpStream::connect(gw.addr).await.unwrap();
    let framing = format!("content-length: {}", body.len());
    conn.write_all(upload_head(&framing).as_bytes())
        .await
        .unwrap();
    let (first, rest) = body.split_at(body.len() / 2);
    conn.write_all(first).await.unwrap();
    // The caller's pace, not a wait for the gateway.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    conn.write_all(rest).await.unwrap();
    let mut got = vec![0u8; 4096];
    let n = conn.read(&mut got).await.unwrap();
    let got = String::from_utf8_lossy(&got[..n]).into_owned();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert_eq!(upstream_errors(&gw), "0");
}
