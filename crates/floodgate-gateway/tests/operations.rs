//! What an operator runs the gateway with: `/metrics` on the admin listener (exact counts after a
//! known sequence; `promtool check metrics` when it is installed, required in CI), shadow
//! limits (decided and charged, never refusing, never in a caller's headers), and `on_error`
//! per kind of limit. The outages use a Redis URL nothing listens on: no Redis needed.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use floodgate_gateway::admin::{self, Admin};
use floodgate_gateway::tally::Tally;
use floodgate_gateway::{AppState, Process};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::*;

/// A gateway on `text`, with its admin listener; both on loopback ports of their own.
async fn with_admin(text: &str, upstream: &str) -> (Gateway, SocketAddr) {
    let c = config(text, upstream);
    let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
    let process = Process::new(&c, Arc::new(Tally::in_memory(&c)));
    let state = AppState::for_worker(&c, store.clone(), &process).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let admin = Admin::new(c.admin.clone().expect("an [admin] section"), process, store).unwrap();
    tokio::spawn(admin::run(
        listener,
        admin,
        c.header_timeout,
        std::future::pending(),
    ));
    (gateway_with(state).await, addr)
}

/// `GET path` on the admin listener with `bearer`: the status and the body.
async fn admin_get(addr: SocketAddr, path: &str, bearer: Option<&str>) -> (u16, String) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let auth = bearer.map_or(String::new(), |b| format!("authorization: Bearer {b}\r\n"));
    let head = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\n{auth}connection: close\r\n\r\n");
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tcp.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned());
    (status, body)
}

/// The value of the series `series` (name and labels, as exposed) in `text`.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
}

const METERED: &str = r#"
[admin]
listen = "127.0.0.1:0"
secret = "sk-ops"
metrics_auth = true
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = { requests = 3 }
[[keys]]
id = "s"
secret = "sk-s"
rate_limit = { requests = 1, shadow = true }
[[rate_limits]]
scope = "key"
id = "k"
tpm = 100000
"#;

#[tokio::test]
async fn metrics_count_a_known_sequence_exactly() {
    let up = fake_upstream().await;
    let (gw, admin) = with_admin(METERED, &up.url()).await;
    for expected in [200, 200, 200, 429] {
        assert_eq!(gw.chat("sk-k", CHAT).await.status, expected);
    }
    assert_eq!(gw.chat("sk-nobody", CHAT).await.status, 401);
    // A shadow key limit of 1: all 10 admitted, 9 over it, none of it in the headers.
    for _ in 0..10 {
        let r = gw.chat("sk-s", CHAT).await;
        assert_eq!(r.status, 200);
        assert!(r.header("x-ratelimit-limit-requests").is_none());
        assert!(r.header("ratelimit-policy").is_none());
    }
    gw.settled().await;

    assert_eq!(admin_get(admin, "/metrics", None).await.0, 401);
    assert_eq!(admin_get(admin, "/metrics", Some("sk-k")).await.0, 401);
    assert_eq!(
        admin_get(admin, "/admin/anything", Some("sk-k")).await.0,
        401
    );
    let (status, text) = admin_get(admin, "/metrics", Some("sk-ops")).await;
    assert_eq!(status, 200);
    let at = |series: &str| value(&text, series);
    assert_eq!(
        at(r#"floodgate_requests_total{decision="admitted",scope="none"}"#),
        13.0
    );
    assert_eq!(
        at(r#"floodgate_requests_total{decision="refused",scope="key"}"#),
        1.0
    );
    assert_eq!(
        at(r#"floodgate_requests_total{decision="rejected",scope="none"}"#),
        1.0
    );
    assert_eq!(
        at(r#"floodgate_requests_total{decision="unenforced",scope="none"}"#),
        0.0
    );
    let limits = |kind: &str, outcome: &str| {
        at(&format!(
            r#"floodgate_limit_decisions_total{{scope="key",kind="{kind}",outcome="{outcome}"}}"#
        ))
    };
    // k: 3 of 3 (2 within, the third at 0 left near), then over; s: near at its first, then
    // 9 shadow_over.
    assert_eq!(limits("requests", "within"), 2.0);
    assert_eq!(limits("requests", "near"), 2.0);
    assert_eq!(limits("requests", "over"), 1.0);
    assert_eq!(limits("requests", "shadow_over"), 9.0);
    assert_eq!(limits("tokens", "within"), 4.0);
    // The fake upstream's usage: 25 in and 25 out a response, 3 responses metered.
    assert_eq!(at(r#"floodgate_tokens_total{direction="input"}"#), 75.0);
    assert_eq!(at(r#"floodgate_tokens_total{direction="output"}"#), 75.0);
    assert_eq!(
        at(r#"floodgate_store_duration_seconds_count{op="admit"}"#),
        14.0
    );
    assert_eq!(
        at(r#"floodgate_store_duration_seconds_count{op="record"}"#),
        3.0
    );
    assert_eq!(at(r#"floodgate_store_errors_total{op="admit"}"#), 0.0);
    assert_eq!(
        at(r#"floodgate_upstream_duration_seconds_count{status_class="2xx"}"#),
        13.0
    );
    assert_eq!(at("floodgate_store_breaker_open"), 0.0);
    assert_eq!(at("floodgate_realtime_sessions"), 0.0);
    assert!(!text.contains("sk-"), "no secret in the exposition");
    assert!(!text.contains("\"k\""), "no key id as a label");
    common::promtool_accepts(&text);
}

#[tokio::test]
async fn a_shadow_key_limit_never_refuses_but_an_enforced_org_limit_still_does() {
    let up = fake_upstream().await;
    let text = r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "t"
secret = "sk-t"
org = "acme"
rate_limit = { requests = 1, shadow = true }
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 2
"#;
    let gw = gateway(text, &up.url()).await;
    assert_eq!(gw.chat("sk-t", CHAT).await.status, 200);
    let second = gw.chat("sk-t", CHAT).await;
    assert_eq!(second.status, 200, "over the shadow key limit: admitted");
    // The headers describe the enforced org limit, never the shadow one.
    assert_eq!(second.header("ratelimit-policy"), Some(r#""org";q=2;w=60"#));
    let third = gw.chat("sk-t", CHAT).await;
    assert_eq!(third.status, 429);
    let message = third.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("for org"), "{message}");
    assert_eq!(up.seen.hits(), 2);
}

#[tokio::test]
async fn an_outage_shows_in_the_metrics_and_fails_each_kind_its_own_way() {
    let up = fake_upstream().await;
    let text = format!(
        r#"
[admin]
listen = "127.0.0.1:0"
[store]
backend = "redis"
url = "redis://127.0.0.1:{}/0"
on_error = {{ requests = "open", tokens = "open", budgets = "closed" }}
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "a"
secret = "sk-a"
rate_limit = {{ requests = 5 }}
[[keys]]
id = "b"
secret = "sk-b"
[[budgets]]
scope = "key"
id = "b"
period = "day"
usd = 10
"#,
        free_port()
    );
    let (gw, admin) = with_admin(&text, &up.url()).await;
    // Requests fail open, budgets closed: traffic flows, spend does not.
    for _ in 0..3 {
        assert_eq!(gw.chat("sk-a", CHAT).await.status, 200);
    }
    let b = gw.chat("sk-b", CHAT).await;
    assert_eq!(b.status, 503);
    assert_eq!(b.json()["error"]["code"], "rate_limiter_unavailable");
    assert_eq!(up.seen.hits(), 3);

    // `metrics_auth` is off: no bearer needed.
    let (status, text) = admin_get(admin, "/metrics", None).await;
    assert_eq!(status, 200);
    let at = |series: &str| value(&text, series);
    assert_eq!(
        at(r#"floodgate_requests_total{decision="unenforced",scope="none"}"#),
        3.0
    );
    assert_eq!(
        at(r#"floodgate_requests_total{decision="rejected",scope="none"}"#),
        1.0
    );
    assert_eq!(at(r#"floodgate_store_errors_total{op="admit"}"#), 3.0);
    assert_eq!(
        at(r#"floodgate_store_errors_total{op="read_budgets"}"#),
        1.0
    );
    assert_eq!(at("floodgate_store_breaker_open"), 1.0);
    common::promtool_accepts(&text);
}

/// `floodgate_spend_usd_total` counts the spend priced from metered responses whether the
/// enforced budgets are charged after the answer or reserve the estimate's price at admission
/// (`[gateway] tokens = "reserve"`) and are reconciled with it. Before, a reserved spend was
/// never counted.
#[tokio::test]
async fn the_spend_metric_counts_reserved_budgets_spend_too() {
    let budgeted = |mode: &str| {
        format!(
            r#"
[admin]
listen = "127.0.0.1:0"
secret = "sk-ops"
[gateway]
tokens = "{mode}"
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "k"
secret = "sk-k"
[[prices]]
model = "*"
input_per_million = 1000.0
output_per_million = 1000.0
[[budgets]]
scope = "key"
id = "k"
period = "day"
usd = 100.0
"#
        )
    };
    let mut spent = Vec::new();
    for mode in ["reactive", "reserve"] {
        let up = fake_upstream().await;
        let (gw, admin) = with_admin(&budgeted(mode), &up.url()).await;
        assert_eq!(gw.chat("sk-k", CHAT).await.status, 200);
        gw.settled().await;
        let (_, text) = admin_get(admin, "/metrics", None).await;
        spent.push((mode, value(&text, "floodgate_spend_usd_total")));
    }
    // 25 input and 25 output tokens at 1000 USD per million each: 0.05 USD, in either mode.
    assert_eq!(spent, [("reactive", 0.05), ("reserve", 0.05)]);
}
