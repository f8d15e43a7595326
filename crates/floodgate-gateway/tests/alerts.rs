//! The refusal tally: every 429 is counted against the key it throttled, or against the gateway
//! when a gateway-wide limit refused, and `GET /alerts` shows the counts as `rate_limit`
//! alerts to the bearer of the `[alerts]` secret.

mod common;

use common::*;
use serde_json::{Value, json};

const CONFIG: &str = r#"
[upstream]
base_url = "{upstream}"

[gateway]
rate_limit = { requests = 3, window_sec = 60 }

[alerts]
secret = "sk-admin"

[[keys]]
id = "alice"
secret = "sk-alice"
rate_limit = { requests = 1, window_sec = 60 }

[[keys]]
id = "bob"
secret = "sk-bob"
"#;

async fn alerts(gw: &Gateway, token: Option<&str>) -> Reply {
    gw.send(gw.request("GET", "/alerts", token, "")).await
}

fn today() -> String {
    chrono::Local::now().date_naive().to_string()
}

#[tokio::test]
async fn refusals_are_tallied_per_key_and_for_the_gateway() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let statuses = [
        gw.chat("sk-alice", CHAT).await.status,  // gateway 1/3
        gw.chat("sk-alice", CHAT).await.status,  // alice's own limit
        gw.chat("sk-bob", CHAT).await.status,    // gateway 2/3
        gw.chat("sk-bob", CHAT).await.status,    // gateway 3/3
        gw.chat("sk-bob", CHAT).await.status,    // the gateway's limit
        gw.chat("sk-alice", CHAT).await.status,  // alice's first, in chain order
        gw.chat("sk-nobody", CHAT).await.status, // 401: not a refusal
    ];
    assert_eq!(
        statuses.map(|s| s.as_u16()),
        [200, 429, 200, 200, 429, 429, 401]
    );

    let reply = alerts(&gw, Some("sk-admin")).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.header("content-type"),
        Some("application/json"),
        "{}",
        reply.text()
    );
    let day = today();
    assert_eq!(
        reply.json(),
        json!({"alerts": [
            {
                "type": "rate_limit", "day": day, "subject": "key", "key": "alice", "count": 2,
                "message": format!("key `alice` was refused 2 requests (429) on {day}"),
            },
            {
                "type": "rate_limit", "day": day, "subject": "gateway", "count": 1,
                "message": format!("gateway-wide limits refused 1 request (429) on {day}"),
            },
        ]})
    );
}

#[tokio::test]
async fn alerts_are_for_the_alerts_secret_only() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    for token in [None, Some("sk-alice"), Some("sk-admin-not")] {
        let reply = alerts(&gw, token).await;
        assert_eq!(reply.status, 401, "{token:?}");
        assert_eq!(
            reply.json()["error"]["code"],
            "invalid_api_key",
            "{token:?}"
        );
    }
    let post = gw
        .send(gw.request("POST", "/alerts", Some("sk-admin"), ""))
        .await;
    assert_eq!(post.status, 405);
    // Nothing was charged or counted by any of it.
    assert_eq!(
        alerts(&gw, Some("sk-admin")).await.json(),
        json!({"alerts": []})
    );
    assert_eq!(gw.chat("sk-alice", CHAT).await.status, 200);
}

#[tokio::test]
async fn without_a_secret_there_is_no_alerts_route() {
    let up = fake_upstream().await;
    let gw = gateway(
        &CONFIG.replace("[alerts]\nsecret = \"sk-admin\"", ""),
        &up.url(),
    )
    .await;
    let reply = alerts(&gw, Some("sk-admin")).await;
    assert_eq!(reply.status, 404);
    let _: Value = reply.json();
}

/// A spent budget's 429 is a refusal like any other: counted against the key (or the gateway,
/// for a gateway budget).
#[tokio::test]
async fn budget_refusals_are_tallied_too() {
    let up = fake_upstream().await;
    let gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[alerts]
secret = "sk-admin"
[[keys]]
id = "alice"
secret = "sk-alice"
[[prices]]
model = "*"
input_per_million = 1000
output_per_million = 1000
[[budgets]]
scope = "key"
id = "alice"
period = "day"
usd = 0.000001
"#,
        &up.url(),
    )
    .await;
    assert_eq!(gw.chat("sk-alice", CHAT).await.status, 200);
    gw.settled().await;
    let refused = gw.chat("sk-alice", CHAT).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.json()["error"]["type"], "insufficient_quota");
    let alerts = alerts(&gw, Some("sk-admin")).await.json();
    assert_eq!(alerts["alerts"][0]["key"], "alice", "{alerts}");
    assert_eq!(alerts["alerts"][0]["count"], 1, "{alerts}");
}
