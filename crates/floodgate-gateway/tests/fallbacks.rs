//! The seed shape's fallbacks: a `rate_limit` missing a field means 100 requests / 60 s; no
//! `rate_limit` at all means unlimited.

mod common;

use common::*;

const CONFIG: &str = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "empty"
secret = "sk-empty"
rate_limit = {}
[[keys]]
id = "requests-only"
secret = "sk-requests"
rate_limit = { requests = 3 }
[[keys]]
id = "window-only"
secret = "sk-window"
rate_limit = { window_sec = 10 }
[[keys]]
id = "unlimited"
secret = "sk-unlimited"
"#;

#[tokio::test]
async fn missing_fields_fall_back_to_100_per_60s() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let r = gw.chat("sk-empty", CHAT).await;
    assert_eq!(r.header("ratelimit-policy"), Some("\"key\";q=100;w=60"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("99"));
    let r = gw.chat("sk-requests", CHAT).await;
    assert_eq!(r.header("ratelimit-policy"), Some("\"key\";q=3;w=60"));
    let r = gw.chat("sk-window", CHAT).await;
    assert_eq!(r.header("ratelimit-policy"), Some("\"key\";q=100;w=10"));
    for _ in 0..99 {
        assert_eq!(gw.chat("sk-empty", CHAT).await.status, 200);
    }
    assert_eq!(gw.chat("sk-empty", CHAT).await.status, 429);
}

#[tokio::test]
async fn no_rate_limit_means_unlimited() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    for _ in 0..150 {
        let r = gw.chat("sk-unlimited", CHAT).await;
        assert_eq!(r.status, 200);
        assert!(
            r.header("x-ratelimit-limit").is_none(),
            "no limit, no headers"
        );
    }
    assert_eq!(up.seen.hits(), 150);
}
