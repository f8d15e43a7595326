//! Forwarding: base URL prefixes and query strings; upstream failures: 502 when it cannot be
//! reached, 504 when it is too slow; each counts once.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONFIG: &str = r#"
[upstream]
base_url = "{upstream}"
timeout_sec = 1
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 3 }
"#;

#[tokio::test]
async fn a_dead_upstream_is_502_and_counts_once() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let gw = gateway(CONFIG, &format!("http://{dead}")).await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
    assert!(
        !r.text().contains("127.0.0.1"),
        "no internals echoed: {}",
        r.text()
    );
    assert_eq!(r.header("x-ratelimit-remaining"), Some("2"));
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        Some("1"),
        "charged once per request"
    );
}

#[tokio::test]
async fn a_slow_upstream_is_504() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let r = gw
        .send(gw.request("GET", "/v1/slow", Some("sk-k"), ""))
        .await;
    assert_eq!(r.status, 504);
    assert_eq!(r.json()["error"]["code"], "upstream_timeout");
    assert_eq!(r.header("x-ratelimit-remaining"), Some("2"));
}

#[tokio::test]
async fn base_url_prefix_and_query_are_kept() {
    let up = fake_upstream().await;
    let gw = gateway(
        "[upstream]\nbase_url = \"{upstream}/api/\"\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n",
        &up.url(),
    )
    .await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(up.seen.hits(), 1);
    let r = gw
        .send(gw.request("GET", "/v1/models?limit=2&after=x", Some("sk-k"), ""))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["query"], "limit=2&after=x");
}

#[tokio::test]
async fn a_path_too_long_to_forward_behind_the_prefix_is_refused_uncharged() {
    let up = fake_upstream().await;
    let gw = gateway(
        "[upstream]\nbase_url = \"{upstream}/api/\"\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\nrate_limit = { requests = 1 }\n",
        &up.url(),
    )
    .await;
    // As long as a URI may be (65 534 bytes): the prefix would push it past that.
    let path = "/v1/models?x=";
    let long = format!("{path}{}", "a".repeat(65_534 - path.len()));
    // Sent raw: a client's absolute URI of that path would be too long for `http` itself.
    let mut conn = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = format!(
        "GET {long} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer sk-k\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(up.seen.hits(), 0);
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200, "the refusal charged nothing: {}", r.text());
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
}

#[tokio::test]
async fn an_upstream_retry_after_is_kept() {
    use axum::http::StatusCode;
    use axum::routing::post;
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(|| async {
            (
                StatusCode::TOO_MANY_REQUESTS,
                [
                    ("retry-after", "7"),
                    ("x-ratelimit-remaining-requests", "0"),
                ],
                "{\"error\":{}}",
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let gw = gateway(CONFIG, &format!("http://{addr}")).await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 429);
    assert_eq!(
        r.header("retry-after"),
        Some("7"),
        "the upstream's own wait"
    );
    assert_eq!(
        r.header("x-ratelimit-remaining-requests"),
        Some("2"),
        "the gateway's view"
    );
}

/// An upstream that answers the first request on each connection and, on the second, reads it
/// and closes the connection without an answer (the race of a kept-alive connection that the
/// upstream closes just as the gateway reuses it), or with `garbage`, answers what no HTTP
/// parser accepts. Counts the connections and requests it read.
async fn closes_reused_connections(garbage: bool) -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (conns, reqs) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (c, r) = (conns.clone(), reqs.clone());
    tokio::spawn(async move {
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            c.fetch_add(1, Ordering::SeqCst);
            let r = r.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                for n in 0.. {
                    // One whole request: the head, then as many bytes as it announces.
                    let mut chunk = [0u8; 4096];
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match tcp.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    while buf.len() < head_end + len {
                        match tcp.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => buf.extend_from_slice(&chunk[..k]),
                        }
                    }
                    buf.drain(..head_end + len);
                    r.fetch_add(1, Ordering::SeqCst);
                    if n > 0 {
                        if garbage {
                            let _ = tcp
                                .write_all(b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n")
                                .await;
                        }
                        return; // closes the connection
                    }
                    let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                    tcp.write_all(answer.as_bytes()).await.unwrap();
                }
            });
        }
    });
    (url, conns, reqs)
}

#[tokio::test]
async fn a_get_lost_on_a_reused_connection_is_sent_again_on_a_new_one() {
    let (url, conns, reqs) = closes_reused_connections(false).await;
    let gw = gateway(CONFIG, &url).await;
    for _ in 0..2 {
        let r = gw
            .send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(
        conns.load(Ordering::SeqCst),
        2,
        "the second GET reused the first connection"
    );
    assert_eq!(
        reqs.load(Ordering::SeqCst),
        3,
        "the lost GET was sent once more"
    );
    let r = gw
        .send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
        .await;
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        Some("0"),
        "each GET charged once"
    );
}

#[tokio::test]
async fn a_post_lost_on_a_reused_connection_is_not_sent_twice() {
    let (url, conns, reqs) = closes_reused_connections(false).await;
    let gw = gateway(CONFIG, &url).await;
    assert_eq!(gw.chat("sk-k", CHAT).await.status, 200);
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
    assert_eq!(conns.load(Ordering::SeqCst), 1);
    assert_eq!(
        reqs.load(Ordering::SeqCst),
        2,
        "the upstream saw the POST once"
    );
}

#[tokio::test]
async fn a_get_whose_answer_cannot_be_parsed_is_not_sent_again() {
    let (url, conns, reqs) = closes_reused_connections(true).await;
    let gw = gateway(CONFIG, &url).await;
    let get = || gw.request("GET", "/v1/models", Some("sk-k"), "");
    assert_eq!(gw.send(get()).await.status, 200);
    let r = gw.send(get()).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(conns.load(Ordering::SeqCst), 1);
    assert_eq!(
        reqs.load(Ordering::SeqCst),
        2,
        "the upstream answered: no second try"
    );
}

/// An upstream that records each request's headers and answers with OpenAI's account headers;
/// `/v1/refused` (or a request with `x-refuse`) answers 401 with a body naming part of the key,
/// as OpenAI's does.
async fn account_upstream() -> (String, Arc<std::sync::Mutex<Vec<axum::http::HeaderMap>>>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let record = Arc::clone(&record);
        async move {
            record.lock().unwrap().push(req.headers().clone());
            let refused =
                req.uri().path() == "/v1/refused" || req.headers().contains_key("x-refuse");
            let status = if refused { 401 } else { 200 };
            axum::http::Response::builder()
                .status(status)
                .header("openai-organization", "org-owner")
                .header("openai-project", "proj-owner")
                .header("content-type", "application/json")
                .body(axum::body::Body::from(
                    r#"{"error":{"message":"Incorrect API key provided: flood****eway."}}"#,
                ))
                .unwrap()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), seen)
}

/// With the gateway's own upstream key (`api_key_env`; here a variable Cargo sets), the account
/// it bills is the gateway's to choose: a caller's `OpenAI-Organization` and `OpenAI-Project`
/// do not go up, and the upstream's do not come back. A 401 refuses the gateway's key, not the
/// caller's: a 502, its body (part of the key, in OpenAI's) not shown.
#[tokio::test]
async fn with_the_gateways_own_key_the_account_is_the_gateways() {
    let (url, seen) = account_upstream().await;
    let own = CONFIG.replace(
        "timeout_sec = 1",
        "timeout_sec = 1\napi_key_env = \"CARGO_PKG_NAME\"",
    );
    let gw = gateway(&own, &url).await;
    let mut req = gw.request("GET", "/v1/models", Some("sk-k"), "");
    req.headers_mut()
        .insert("openai-organization", "org-other".parse().unwrap());
    req.headers_mut()
        .insert("openai-project", "proj-other".parse().unwrap());
    let r = gw.send(req).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("openai-organization"), None);
    assert_eq!(r.header("openai-project"), None);
    let sent = seen.lock().unwrap().pop().unwrap();
    assert_eq!(sent["authorization"], "Bearer floodgate-gateway");
    assert!(sent.get("openai-organization").is_none() && sent.get("openai-project").is_none());
    let r = gw
        .send(gw.request("GET", "/v1/refused", Some("sk-k"), ""))
        .await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
    assert!(!r.text().contains("flood"), "{}", r.text());

    // A caller's own upstream account (no `api_key_env`: the gateway sends no key of its own)
    // is the caller's business: its headers pass both ways, and its 401 is its answer.
    let gw = gateway(CONFIG, &url).await;
    let mut req = gw.request("GET", "/v1/models", Some("sk-k"), "");
    req.headers_mut()
        .insert("openai-organization", "org-other".parse().unwrap());
    let r = gw.send(req).await;
    assert_eq!(r.header("openai-organization"), Some("org-owner"));
    let sent = seen.lock().unwrap().pop().unwrap();
    assert_eq!(sent["openai-organization"], "org-other");
    let r = gw
        .send(gw.request("GET", "/v1/refused", Some("sk-k"), ""))
        .await;
    assert_eq!(r.status, 401);
}

/// A realtime handshake the upstream refuses with a 401 under the gateway's own key is the
/// gateway's key refused, as for any request: a 502, the upstream's body (part of the key)
/// not shown.
#[tokio::test]
async fn a_realtime_handshake_refusing_the_gateways_key_is_a_502() {
    let (url, _) = account_upstream().await;
    let own = CONFIG.replace(
        "timeout_sec = 1",
        "timeout_sec = 1\napi_key_env = \"CARGO_PKG_NAME\"",
    );
    let gw = gateway(&own, &url).await;
    let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = "GET /v1/realtime?model=m HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\
                connection: Upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n\
                sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nx-refuse: 1\r\n\r\n";
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut got = vec![0u8; 4096];
    let n = tcp.read(&mut got).await.unwrap();
    let text = String::from_utf8_lossy(&got[..n]).into_owned();
    assert!(text.starts_with("HTTP/1.1 502"), "{text}");
    assert!(!text.contains("flood"), "{text}");
}
