//! Unknown or missing keys get 401 and charge nothing.

mod common;

use common::*;

#[tokio::test]
async fn unknown_and_missing_keys_get_401_and_charge_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[gateway]
rate_limit = { requests = 1 }
[[keys]]
id = "k"
secret_sha256 = "2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"
rate_limit = { requests = 1 }
"#,
        &up.url(),
    )
    .await;
    for key in [Some("sk-wrong"), Some(""), None] {
        let r = gw
            .send(gw.request("POST", "/v1/chat/completions", key, CHAT))
            .await;
        assert_eq!(r.status, 401, "{key:?}");
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        assert!(r.header("x-ratelimit-limit").is_none());
    }
    let mut basic = gw.request("POST", "/v1/chat/completions", None, CHAT);
    basic
        .headers_mut()
        .insert("authorization", "Basic c2VjcmV0".parse().unwrap());
    assert_eq!(gw.send(basic).await.status, 401);
    assert_eq!(up.seen.hits(), 0);

    // sha256("secret"): the one allowed request of both the key and the gateway is still there.
    let r = gw.chat("secret", CHAT).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(gw.chat("secret", CHAT).await.status, 429);
}

#[tokio::test]
async fn probes_and_unknown_paths() {
    let up = fake_upstream().await;
    let gw = gateway("[upstream]\nbase_url = \"{upstream}\"\n", &up.url()).await;
    assert_eq!(
        gw.send(gw.request("GET", "/healthz", None, ""))
            .await
            .status,
        200
    );
    assert_eq!(
        gw.send(gw.request("GET", "/readyz", None, "")).await.status,
        200
    );
    let r = gw.send(gw.request("GET", "/nope", None, "")).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "not_found");
}

/// One key, 5 requests a minute: what a refused request would have taken shows.
const FIVE_A_MINUTE: &str = "[upstream]\nbase_url = \"{upstream}\"\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\nrate_limit = { requests = 5 }\n";

#[tokio::test]
async fn a_path_with_dot_segments_is_refused_and_charges_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(FIVE_A_MINUTE, &up.url()).await;
    // An upstream that resolves dot segments would serve `/metrics` outside `/v1/`.
    for path in [
        "/v1/../metrics",
        "/v1/%2e%2e/metrics",
        "/v1/chat/completions/.",
    ] {
        let r = gw.send(gw.request("GET", path, Some("sk-k"), "")).await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        // Every response carries the chain's state (docs/design.md §6), read without charging; no
        // Retry-After, since waiting does not mend the request.
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("5"));
        assert_eq!(r.header("ratelimit-policy"), Some("\"key\";q=5;w=60"));
        assert!(r.header("retry-after").is_none());
    }
    let r = gw
        .send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-remaining-requests"),
        Some("4"),
        "the refused paths took nothing"
    );
}

/// hyper takes the chunked framing off `gzip, chunked` and leaves the gzip; forwarded without
/// the (hop-by-hop) header, the upstream would read compressed bytes as the body.
#[tokio::test]
async fn a_body_with_another_transfer_coding_is_refused_and_charges_nothing() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = fake_upstream().await;
    let gw = gateway(FIVE_A_MINUTE, &up.url()).await;
    let mut conn = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    conn.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\
          transfer-encoding: gzip, chunked\r\nconnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await
    .unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 501"), "{answer}");
    assert!(answer.contains("transfer_coding_not_supported"), "{answer}");
    let r = gw
        .send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
        .await;
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
    assert_eq!(
        up.seen.hits(),
        0,
        "nothing reached the upstream's completions"
    );
}

#[tokio::test]
async fn a_websocket_upgrade_off_the_realtime_path_is_refused_plainly_and_charges_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(FIVE_A_MINUTE, &up.url()).await;
    // (`/v1/realtime` is proxied: tests/realtime.rs.)
    let mut req = gw.request("GET", "/v1/responses", Some("sk-k"), "");
    let h = req.headers_mut();
    h.insert("connection", "Upgrade".parse().unwrap());
    h.insert("upgrade", "websocket".parse().unwrap());
    h.insert("sec-websocket-version", "13".parse().unwrap());
    h.insert(
        "sec-websocket-key",
        "dGhlIHNhbXBsZSBub25jZQ==".parse().unwrap(),
    );
    let r = gw.send(req).await;
    assert_eq!(r.status, 501, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upgrade_not_supported");
    // An h2c offer (Java's HttpClient and `curl --http2` send one on http:// URLs) is optional
    // to take: served over HTTP/1.1, and charged as any request.
    let mut req = gw.request("GET", "/v1/models", Some("sk-k"), "");
    let h = req.headers_mut();
    h.insert("connection", "Upgrade, HTTP2-Settings".parse().unwrap());
    h.insert("upgrade", "h2c".parse().unwrap());
    h.insert(
        "http2-settings",
        "AAMAAABkAARAAAAAAAIAAAAA".parse().unwrap(),
    );
    let r = gw.send(req).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("4"));
    let r = gw
        .send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
        .await;
    assert_eq!(
        r.header("x-ratelimit-remaining-requests"),
        Some("3"),
        "the WebSocket upgrade took nothing"
    );
}
