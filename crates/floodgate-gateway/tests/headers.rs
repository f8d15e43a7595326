//! Rate-limit headers on 200 and 429, exact for a 5-requests-a-minute key on a pinned clock.

mod common;

use common::*;
use floodgate::Timestamp;
use floodgate::clock::FakeClock;
use floodgate::store::MemoryStore;
use floodgate_gateway::store::GatewayStore;

const CONFIG: &str = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "alice"
secret = "sk-alice"
org = "acme"
rate_limit = { requests = 5, window_sec = 60 }
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 600
"#;

#[tokio::test]
async fn exact_headers_on_200_and_429() {
    let up = fake_upstream().await;
    // 30 s into a minute bucket: after 5 requests the 6th passes in (60 - 30) + 60 * (1 - 4/5) = 42 s.
    let clock = FakeClock::new(Timestamp::from_secs(6000 + 30));
    let store = GatewayStore::Memory(MemoryStore::with_clock(clock));
    let gw = gateway_on(&config(CONFIG, &up.url()), store).await;

    let first = gw.chat("sk-alice", CHAT).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-ratelimit-limit"), Some("5"));
    assert_eq!(first.header("x-ratelimit-remaining"), Some("4"));
    assert_eq!(first.header("ratelimit-policy"), Some("\"key\";q=5;w=60"));
    // Whole again (with no other traffic) at the end of the next bucket: 90 s.
    assert_eq!(first.header("ratelimit"), Some("\"key\";r=4;t=90"));
    assert_eq!(first.header("x-ratelimit-limit-requests"), Some("5"));
    assert_eq!(first.header("x-ratelimit-remaining-requests"), Some("4"));
    assert_eq!(first.header("x-ratelimit-reset-requests"), Some("1m30s"));
    assert_eq!(
        first.header("x-ratelimit-limit-tokens"),
        None,
        "no token limit applies"
    );
    assert_eq!(first.header("retry-after"), None);

    for left in (0..4).rev() {
        let r = gw.chat("sk-alice", CHAT).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some(left.to_string().as_str())
        );
    }

    let refused = gw.chat("sk-alice", CHAT).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("x-ratelimit-limit"), Some("5"));
    assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(refused.header("ratelimit-policy"), Some("\"key\";q=5;w=60"));
    assert_eq!(refused.header("ratelimit"), Some("\"key\";r=0;t=42"));
    assert_eq!(refused.header("x-ratelimit-limit-requests"), Some("5"));
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(refused.header("x-ratelimit-reset-requests"), Some("42s"));
    assert_eq!(refused.header("retry-after"), Some("42"));
    assert_eq!(refused.header("retry-after-ms"), Some("42000"));
    let body = refused.json();
    assert_eq!(body["error"]["type"], "rate_limit_exceeded");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("for key"), "{message}");
    assert!(
        !message.contains("alice") && !message.contains("acme"),
        "no ids: {message}"
    );
    assert_eq!(
        up.seen.hits(),
        5,
        "the refused request never reached the upstream"
    );
}

#[tokio::test]
async fn token_headers_when_a_token_limit_applies_and_upstream_headers_replaced() {
    let up = fake_upstream().await;
    let gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
[[rate_limits]]
scope = "key"
id = "k"
rpm = 10
tpm = 1000
"#,
        &up.url(),
    )
    .await;
    let r = gw.chat("sk-k", CHAT_STREAM).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-limit-requests"),
        Some("10"),
        "the upstream's own value is replaced"
    );
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("9"));
    assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("1000"));
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("1000"));
    assert_eq!(r.header("x-ratelimit-reset-tokens"), Some("0s"));
    gw.settled().await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        Some("950"),
        "50 tokens of the stream"
    );
}

/// The generic headers describe the limit with the fewest whole units left (docs/design.md §6),
/// a token limit too: a client pacing on `X-RateLimit-Remaining` learns that the org's token
/// window is nearly spent, not that 998 requests are left.
#[tokio::test]
async fn the_generic_headers_describe_a_token_limit_with_fewer_units_left() {
    let up = fake_upstream().await;
    let gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
org = "acme"
rate_limit = { requests = 1000, window_sec = 60 }
[[rate_limits]]
scope = "org"
id = "acme"
tpm = 120
"#,
        &up.url(),
    )
    .await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200);
    gw.settled().await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-limit"), Some("120"));
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        Some("70"),
        "50 tokens used"
    );
    assert_eq!(r.header("ratelimit-policy"), Some("\"org\";q=120;w=60"));
    // The OpenAI-style trios still describe each kind on its own.
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("998"));
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("70"));
}

#[tokio::test]
async fn the_demo_upstream_works_through_the_gateway() {
    let gw = gateway(
        r#"
[upstream]
demo = true
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 2 }
[[rate_limits]]
scope = "key"
id = "k"
tpm = 1000
"#,
        "",
    )
    .await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200);
    let total = r.json()["usage"]["total_tokens"].as_u64().unwrap();
    assert!(total > 0);
    gw.settled().await;
    let r = gw.chat("sk-k", CHAT_STREAM).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-remaining-tokens"),
        Some((1000 - total).to_string().as_str())
    );
    assert!(r.text().contains("data: [DONE]"));
    assert!(
        !r.text().contains("\"usage\":{"),
        "usage chunk not asked for: {}",
        r.text()
    );
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 429);
}

#[tokio::test]
async fn a_limit_of_zero_refuses_without_retry_after() {
    let up = fake_upstream().await;
    let gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 0 }
[[rate_limits]]
scope = "key"
id = "k"
tpm = 1000
"#,
        &up.url(),
    )
    .await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), None, "it can never pass");
    assert_eq!(r.header("retry-after-ms"), None);
    assert_eq!(r.header("x-ratelimit-limit"), Some("0"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    // No reset to announce: a `t=0` or `0s` would invite an immediate retry, forever.
    assert_eq!(r.header("ratelimit"), Some("\"key\";r=0"));
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("0"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(r.header("x-ratelimit-reset-requests"), None);
    // The token limit was not read: its state is not made up.
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), None);
    assert_eq!(r.header("x-ratelimit-reset-tokens"), None);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("never"), "{message}");
    assert_eq!(up.seen.hits(), 0);
    // A request refused before admission says the same, not "free, retry now".
    let r = gw
        .send(gw.request("GET", "/v1/./models", Some("sk-k"), ""))
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.header("ratelimit"), Some("\"key\";r=0"));
    assert_eq!(r.header("x-ratelimit-reset-requests"), None);
    assert_eq!(r.header("retry-after"), None);
}

#[tokio::test]
async fn when_two_limits_refuse_the_first_is_named_with_the_wait_of_the_chain() {
    let up = fake_upstream().await;
    // Two requests fill both the key (2 per 10 s) and its org (2 per minute); the key, first in
    // the chain, is named, and the org's longer wait is when the next request passes.
    let clock = FakeClock::new(Timestamp::from_secs(6000 + 30));
    let store = GatewayStore::Memory(MemoryStore::with_clock(clock));
    let text = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "alice"
secret = "sk-alice"
org = "acme"
rate_limit = { requests = 2, window_sec = 10 }
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 2
"#;
    let gw = gateway_on(&config(text, &up.url()), store).await;
    for _ in 0..2 {
        assert_eq!(gw.chat("sk-alice", CHAT).await.status, 200);
    }
    let refused = gw.chat("sk-alice", CHAT).await;
    assert_eq!(refused.status, 429);
    let wait = refused.header("retry-after").unwrap().to_owned();
    assert!(wait.parse::<u64>().unwrap() > 20, "the org's wait: {wait}");
    assert_eq!(
        refused.header("ratelimit"),
        Some(format!("\"key\";r=0;t={wait}").as_str()),
        "the first refusal (docs/design.md §2), with the wait a client must keep"
    );
    assert_eq!(refused.header("ratelimit-policy"), Some("\"key\";q=2;w=10"));
    assert_eq!(refused.header("x-ratelimit-limit-requests"), Some("2"));
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), Some("0"));
    let ms: u64 = refused.header("retry-after-ms").unwrap().parse().unwrap();
    let reset = refused.header("x-ratelimit-reset-requests").unwrap();
    let (m, s) = reset
        .trim_end_matches('s')
        .split_once('m')
        .unwrap_or(("0", reset.trim_end_matches('s')));
    let reset_ms = (m.parse::<f64>().unwrap() * 60.0 + s.parse::<f64>().unwrap()) * 1000.0;
    assert!(
        (reset_ms - ms as f64).abs() < 1.0,
        "{reset} against {ms} ms"
    );
    let body = refused.text();
    assert!(body.contains("key") && !body.contains("org"), "{body}");
}
