//! Forwarding: base URL prefixes and query strings; upstream failures: 502 when it cannot be
//! reached, 504 when it is too slow; each counts once.

mod common;

use common::*;

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
