//! The scope chain: a request refused by a narrow scope costs the wider ones nothing; customer
//! and gateway scopes join the chain.

mod common;

use common::*;

const CONFIG: &str = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "alice"
secret = "sk-alice"
org = "acme"
team = "ml"
rate_limit = { requests = 2 }
[[keys]]
id = "bob"
secret = "sk-bob"
org = "acme"
team = "ml"
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 3
[[rate_limits]]
scope = "customer"
id = "cust-1"
rpm = 1
"#;

#[tokio::test]
async fn a_request_refused_by_the_key_costs_the_org_nothing() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..5 {
            v.push(gw.chat("sk-alice", CHAT).await.status.as_u16());
        }
        v
    };
    assert_eq!(statuses, [200, 200, 429, 429, 429]);
    let r = gw.chat("sk-alice", CHAT).await;
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("for key")
    );

    // The org (3 a minute) has seen only alice's 2 admitted requests: bob gets the third.
    let bob = gw.chat("sk-bob", CHAT).await;
    assert_eq!(bob.status, 200);
    assert_eq!(bob.header("ratelimit-policy"), Some("\"org\";q=3;w=60"));
    assert_eq!(bob.header("x-ratelimit-remaining"), Some("0"));
    let bob = gw.chat("sk-bob", CHAT).await;
    assert_eq!(bob.status, 429);
    let message = bob.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("for org"), "{message}");
    assert!(!message.contains("acme"), "{message}");
    assert_eq!(up.seen.hits(), 3);
}

#[tokio::test]
async fn the_customer_header_adds_the_customer_scope() {
    let up = fake_upstream().await;
    let gw = gateway(CONFIG, &up.url()).await;
    let with = |customer: &str| {
        let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-bob"), CHAT);
        req.headers_mut()
            .insert("x-floodgate-customer", customer.parse().unwrap());
        req
    };
    assert_eq!(gw.send(with("cust-1")).await.status, 200);
    assert!(
        up.seen.last_headers().get("x-floodgate-customer").is_none(),
        "the customer header is not forwarded"
    );
    assert!(
        up.seen.last_headers().get("authorization").is_none(),
        "the gateway key is not forwarded"
    );
    let refused = gw.send(with("cust-1")).await;
    assert_eq!(refused.status, 429);
    let message = refused.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("for customer") && !message.contains("cust-1"),
        "{message}"
    );
    // Another customer, with no limit of its own, only meets the org's.
    assert_eq!(gw.send(with("cust-2")).await.status, 200);
}

#[tokio::test]
async fn the_gateway_scope_limits_all_traffic() {
    let up = fake_upstream().await;
    let gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[gateway]
rate_limit = { requests = 2 }
[[keys]]
id = "a"
secret = "sk-a"
[[keys]]
id = "b"
secret = "sk-b"
"#,
        &up.url(),
    )
    .await;
    assert_eq!(gw.chat("sk-a", CHAT).await.status, 200);
    assert_eq!(gw.chat("sk-b", CHAT).await.status, 200);
    let r = gw.chat("sk-a", CHAT).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), Some("\"gateway\";q=2;w=60"));
}
