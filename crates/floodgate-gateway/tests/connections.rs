//! Client connections: a caller that trickles its request head, or keeps a connection idle, is
//! cut off after `[server] header_timeout_sec`; a prompt caller is served.

mod common;

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
