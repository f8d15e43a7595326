//! When the store cannot be reached: fail open (the default) lets requests through without
//! rate-limit headers; fail closed answers 503 and charges nothing; a key with no limit at all
//! does not depend on the store. Uses a Redis URL nothing listens on, so it needs no Redis.

mod common;

use common::*;

fn config(on_error: &str, port: u16) -> String {
    format!(
        r#"
[store]
backend = "redis"
url = "redis://127.0.0.1:{port}/0"
on_error = "{on_error}"
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = {{ requests = 1 }}
"#
    )
}

fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test]
async fn fail_open_lets_traffic_through_without_headers() {
    let up = fake_upstream().await;
    let gw = gateway(&config("open", dead_port()), &up.url()).await;
    for _ in 0..3 {
        let r = gw.chat("sk-k", CHAT).await;
        assert_eq!(r.status, 200);
        assert!(
            r.header("x-ratelimit-limit").is_none(),
            "no state, no headers"
        );
    }
    assert_eq!(up.seen.hits(), 3);
    let ready = gw.send(gw.request("GET", "/readyz", None, "")).await;
    assert_eq!(ready.status, 503);
    let health = gw.send(gw.request("GET", "/healthz", None, "")).await;
    assert_eq!(health.status, 200);
}

#[tokio::test]
async fn fail_closed_is_503_and_reaches_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(&config("closed", dead_port()), &up.url()).await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "rate_limiter_unavailable");
    assert!(
        !r.text().contains("127.0.0.1"),
        "no internals: {}",
        r.text()
    );
    assert_eq!(up.seen.hits(), 0);
}

#[tokio::test]
async fn an_unlimited_key_is_served_even_when_failing_closed() {
    let up = fake_upstream().await;
    let text = config("closed", dead_port()).replace("rate_limit = { requests = 1 }\n", "");
    assert!(!text.contains("rate_limit"), "{text}");
    let gw = gateway(&text, &up.url()).await;
    for _ in 0..3 {
        let r = gw.chat("sk-k", CHAT).await;
        assert_eq!(r.status, 200, "nothing to decide, so no store to wait for");
        assert!(
            r.header("x-ratelimit-limit").is_none(),
            "no limit, no headers"
        );
    }
    assert_eq!(up.seen.hits(), 3);
}

/// Shadow limits never refuse, the store down included: with every limit in shadow
/// (`[gateway] shadow = true`, as when rolling limits out), failing closed refuses nothing, as
/// for a key with no limit; an enforced limit beside them still fails closed.
#[tokio::test]
async fn a_chain_of_shadow_limits_is_served_when_failing_closed() {
    let up = fake_upstream().await;
    let shadow =
        config("closed", dead_port()).replace("[upstream]", "[gateway]\nshadow = true\n[upstream]");
    let gw = gateway(&shadow, &up.url()).await;
    for _ in 0..3 {
        let r = gw.chat("sk-k", CHAT).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(
            r.header("x-ratelimit-limit").is_none(),
            "no state, no headers"
        );
    }
    assert_eq!(up.seen.hits(), 3);
    let one = config("closed", dead_port()).replace(
        "rate_limit = { requests = 1 }",
        "rate_limit = { requests = 1, shadow = true }\n[[rate_limits]]\nscope = \"org\"\nid = \"o\"\nrpm = 5",
    ).replace("secret = \"sk-k\"", "secret = \"sk-k\"\norg = \"o\"");
    let gw = gateway(&one, &up.url()).await;
    assert_eq!(gw.chat("sk-k", CHAT).await.status, 503);
    assert_eq!(up.seen.hits(), 3);
}
