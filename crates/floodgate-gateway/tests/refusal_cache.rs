//! The refusal cache (docs/design.md §11): once a key's chain is refused, its next requests are
//! refused from what that refusal saw, without a store call, with the headers the store's answer
//! would carry, until the store would admit again; an admin reset (admin_api.rs) empties it.
//! On the memory store and on Redis (when `FLOODGATE_TEST_REDIS_URL` is set; a skip fails with
//! `FLOODGATE_REQUIRE_REDIS=1`).

mod common;

use common::*;

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

/// Alice may send 2 requests a day under an org of 100 a day.
fn config_text(store: &str) -> String {
    format!(
        r#"
[upstream]
base_url = "{{upstream}}"
{store}
[[keys]]
id = "alice"
secret = "sk-alice"
org = "acme"
rate_limit = {{ requests = 2, window_sec = 86400 }}
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 100
"#
    )
}

/// How many admissions the gateway has asked its store for (`/metrics`).
fn admissions(gw: &Gateway) -> u64 {
    let text = gw.state.metrics().encode();
    text.lines()
        .find(|l| l.starts_with("floodgate_store_duration_seconds_count{op=\"admit\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no admission count in:\n{text}"))
}

async fn a_flood_is_refused_without_the_store(store: &str) {
    let up = fake_upstream().await;
    let gw = gateway(&config_text(store), &up.url()).await;
    for _ in 0..2 {
        assert_eq!(gw.chat("sk-alice", CHAT).await.status, 200);
    }
    let first = gw.chat("sk-alice", CHAT).await;
    assert_eq!(first.status, 429, "{}", first.text());
    let asked = admissions(&gw);
    let mut last_wait = first
        .header("retry-after-ms")
        .unwrap()
        .parse::<u64>()
        .unwrap();
    for _ in 0..50 {
        let again = gw.chat("sk-alice", CHAT).await;
        assert_eq!(again.status, 429);
        let (error, was) = (&again.json()["error"], &first.json()["error"]);
        assert_eq!(error["code"], was["code"], "the same refusal");
        assert!(
            error["message"]
                .as_str()
                .unwrap()
                .starts_with("Rate limit exceeded for key: limit 2 requests per 86400s."),
            "{error}"
        );
        for name in [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-scope",
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "ratelimit-policy",
        ] {
            assert_eq!(again.header(name), first.header(name), "{name}");
        }
        // The wait counts down from the store's, never up.
        let wait = again
            .header("retry-after-ms")
            .unwrap()
            .parse::<u64>()
            .unwrap();
        assert!(
            wait <= last_wait && wait + 60_000 > last_wait,
            "{wait} after {last_wait}"
        );
        last_wait = wait;
    }
    assert_eq!(
        admissions(&gw),
        asked,
        "no store call for the cached refusals"
    );
    assert_eq!(up.seen.hits(), 2, "the upstream saw only what was admitted");
    // They are counted as refusals all the same.
    let text = gw.state.metrics().encode();
    assert!(
        text.contains(r#"floodgate_requests_total{decision="refused",scope="key"} 51"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_flood_on_memory_is_refused_without_the_store() {
    a_flood_is_refused_without_the_store("").await;
}

#[tokio::test]
async fn a_flood_on_redis_is_refused_without_the_store() {
    let Some(url) = test_redis_url("a_flood_on_redis_is_refused_without_the_store") else {
        return;
    };
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"{}\"",
        fresh_prefix()
    );
    a_flood_is_refused_without_the_store(&store).await;
}
