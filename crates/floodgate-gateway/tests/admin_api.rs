//! The admin API and the console's sign-in on the admin listener: exact usage figures after a
//! known sequence on the memory store and on Redis (when `FLOODGATE_TEST_REDIS_URL` is set;
//! a skip fails with `FLOODGATE_REQUIRE_REDIS=1`), a reset that clears and lets the next
//! request pass, no secret in any answer, 401 without the bearer and for a caller's key, and
//! sessions: a wrong secret answered slowly, the cookie's attributes, CSRF on a reset; and the
//! binary's logs, at every level, with no secret in them.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use floodgate_gateway::admin::{self, Admin, WRONG_SECRET_DELAY};
use floodgate_gateway::tally::Tally;
use floodgate_gateway::{AppState, Process};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use common::*;

/// Alice: 3 requests a minute, in org acme (10 requests and 1 000 tokens a minute, a budget of
/// $5 a day); bob: unlimited, in acme too. Every model: $1 / $2 per million tokens.
const CONFIG: &str = r#"
[admin]
listen = "127.0.0.1:0"
secret = "sk-ops-secret"
[upstream]
base_url = "{upstream}"
{store}
[[keys]]
id = "alice"
secret = "sk-alice-secret"
org = "acme"
rate_limit = { requests = 3 }
[[keys]]
id = "bob"
secret = "sk-bob-secret"
org = "acme"
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 10
tpm = 1000
[[prices]]
model = "*"
input_per_million = 1.0
output_per_million = 2.0
[[budgets]]
scope = "org"
id = "acme"
period = "day"
usd = 5
"#;

const SECRETS: [&str; 3] = ["sk-ops-secret", "sk-alice-secret", "sk-bob-secret"];

struct Setup {
    gw: Gateway,
    admin: SocketAddr,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
}

/// A gateway and its admin listener on `store` (a `[store]` section, or nothing for memory).
async fn setup(store: &str, upstream: &str) -> Setup {
    setup_on(&CONFIG.replace("{store}", store), upstream).await
}

/// A gateway and its admin listener on the config `text`.
async fn setup_on(text: &str, upstream: &str) -> Setup {
    let c = config(text, upstream);
    let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
    let process = Process::new(&c, Arc::new(Tally::in_memory(&c)));
    let state = AppState::for_worker(&c, store.clone(), &process).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let admin = Admin::new(c.admin.clone().unwrap(), process, store).unwrap();
    tokio::spawn(admin::run(
        listener,
        admin,
        c.header_timeout,
        std::future::pending(),
    ));
    Setup {
        gw: gateway_with(state).await,
        admin: addr,
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

impl Setup {
    /// The console's sign-in with the admin secret.
    async fn sign_in(&self) -> Answer {
        let json = [("content-type", "application/json")];
        let secret = r#"{"secret":"sk-ops-secret"}"#;
        self.call("POST", "/console/sign-in", &json, secret).await
    }

    async fn call(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.admin));
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = self
            .client
            .request(b.body(Body::from(body.to_owned())).unwrap())
            .await
            .unwrap();
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        let answer = Answer {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        };
        for secret in SECRETS {
            assert!(
                !answer.body.contains(secret),
                "{path} shows a secret: {}",
                answer.body
            );
        }
        assert_eq!(
            answer.headers["x-content-type-options"], "nosniff",
            "{path}: every answer carries the security headers"
        );
        answer
    }

    async fn get(&self, path: &str) -> Answer {
        self.call(
            "GET",
            path,
            &[("authorization", "Bearer sk-ops-secret")],
            "",
        )
        .await
    }

    async fn reset(&self, body: Value) -> Answer {
        self.call(
            "POST",
            "/admin/reset",
            &[
                ("authorization", "Bearer sk-ops-secret"),
                ("content-type", "application/json"),
            ],
            &body.to_string(),
        )
        .await
    }
}

/// The known sequence and its exact figures, on whichever store `store` names.
async fn known_sequence(store: &str) {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let s = setup(store, &up.url()).await;
    // Two of alice's requests, 50 tokens each (25 in at $1, 25 out at $2 per million).
    for _ in 0..2 {
        assert_eq!(s.gw.chat("sk-alice-secret", CHAT).await.status, 200);
    }
    s.gw.settled().await;

    let alice = s.get("/admin/usage?scope=key&id=alice").await;
    assert_eq!(alice.status, 200, "{}", alice.body);
    let alice = alice.json();
    assert_eq!(alice["total"], 1);
    let scope = &alice["scopes"][0];
    assert_eq!(
        (&scope["scope"], &scope["id"]),
        (&json!("key"), &json!("alice"))
    );
    assert_eq!(scope["tenant"], "org:acme");
    assert_eq!(scope["in_flight"], Value::Null);
    let limit = &scope["limits"][0];
    assert_eq!(limit["kind"], "requests");
    assert_eq!(limit["limit"], 3);
    assert_eq!(limit["window_sec"], 60);
    assert_eq!(limit["used"], 2.0);
    assert_eq!(limit["remaining"], 1);
    let reset_sec = limit["reset_sec"].as_u64().unwrap();
    assert!((61..=120).contains(&reset_sec), "{reset_sec}");

    let org = s.get("/admin/usage?scope=org&id=acme").await.json();
    let org = &org["scopes"][0];
    let figures = |l: &Value| (l["kind"].clone(), l["used"].clone(), l["remaining"].clone());
    assert_eq!(
        figures(&org["limits"][0]),
        (json!("requests"), json!(2.0), json!(8))
    );
    assert_eq!(
        figures(&org["limits"][1]),
        (json!("tokens"), json!(100.0), json!(900))
    );
    let budget = &org["budgets"][0];
    assert_eq!(budget["period"], "day");
    assert_eq!(budget["cap_usd"], 5.0);
    // 2 × (25 × $1 + 25 × $2) per million tokens.
    assert_eq!(budget["spent_usd"], 0.00015);
    assert_eq!(budget["remaining_usd"], 4.99985);
    assert!(
        budget["period_end"]
            .as_str()
            .unwrap()
            .ends_with("T00:00:00.000Z")
    );

    // Every scope of the config, in order; a page and its cursor.
    let all = s.get("/admin/usage").await.json();
    let listed: Vec<String> = all["scopes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            format!(
                "{} {}",
                s["scope"].as_str().unwrap(),
                s["id"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        listed,
        ["key alice", "key bob", "org acme", "gateway gateway"]
    );
    let page = s.get("/admin/usage?limit=2").await.json();
    assert_eq!(
        (page["total"].clone(), page["next_cursor"].clone()),
        (json!(4), json!("2"))
    );
    let next = s.get("/admin/usage?limit=2&cursor=2").await.json();
    assert_eq!(next["scopes"][0]["id"], "acme");
    assert_eq!(next["next_cursor"], Value::Null);
    assert_eq!(
        s.get("/admin/usage?q=LIC").await.json()["scopes"][0]["id"],
        "alice"
    );
    assert_eq!(s.get("/admin/usage?scope=team&id=x").await.status, 404);
    assert_eq!(s.get("/admin/usage?scope=planet").await.status, 400);
    // Reading charged nothing: the figures are the same.
    let again = s.get("/admin/usage?scope=key&id=alice").await.json();
    assert_eq!(again["scopes"][0]["limits"][0]["used"], 2.0);

    // The third passes, the fourth is refused; the alert counts it.
    assert_eq!(s.gw.chat("sk-alice-secret", CHAT).await.status, 200);
    assert_eq!(s.gw.chat("sk-alice-secret", CHAT).await.status, 429);
    s.gw.settled().await;
    let alerts = s.get("/admin/alerts").await.json();
    assert_eq!(alerts["alerts"][0]["key"], "alice");
    assert_eq!(alerts["alerts"][0]["count"], 1);
    assert_eq!(alerts["alerts"][0]["type"], "rate_limit");

    // A reset answers what it cleared, and the next request passes.
    let reset = s.reset(json!({"scope": "key", "id": "alice"})).await;
    assert_eq!(reset.status, 200, "{}", reset.body);
    let cleared = &reset.json()["cleared"][0];
    assert_eq!(cleared["limits"][0]["used"], 3.0);
    assert_eq!(cleared["budgets"], json!([]));
    let after = s.get("/admin/usage?scope=key&id=alice").await.json();
    assert_eq!(after["scopes"][0]["limits"][0]["used"], 0.0);
    assert_eq!(s.gw.chat("sk-alice-secret", CHAT).await.status, 200);
    s.gw.settled().await;
    // The org's spend stays until a reset asks for budgets too.
    let org_reset = s
        .reset(json!({"scope": "org", "id": "acme", "budgets": true}))
        .await
        .json();
    let cleared = &org_reset["cleared"][0];
    assert_eq!(cleared["limits"][0]["used"], 4.0);
    assert_eq!(cleared["limits"][1]["used"], 200.0);
    assert_eq!(cleared["budgets"][0]["spent_usd"], 0.0003);
    let org = s.get("/admin/usage?scope=org&id=acme").await.json();
    assert_eq!(org["scopes"][0]["budgets"][0]["spent_usd"], 0.0);
    assert_eq!(
        s.reset(json!({"scope": "key", "id": "carol"})).await.status,
        404
    );
    assert_eq!(s.reset(json!({"scope": "key"})).await.status, 400);

    // The config as check-config prints it, without a secret (checked by `call`).
    let config = s.get("/admin/config").await;
    assert_eq!(config.status, 200);
    assert!(
        config.body.contains("key alice [org=acme]"),
        "{}",
        config.body
    );
}

/// A listener on loopback answers loopback's names only (and `[admin] hosts`): a page whose
/// name an attacker re-resolved to 127.0.0.1 (DNS rebinding) names its own, and is refused.
#[tokio::test]
async fn a_request_naming_another_host_is_refused_on_loopback() {
    let up = fake_upstream().await;
    let s = setup("", &up.url()).await;
    let evil = s
        .call("GET", "/metrics", &[("host", "evil.example:9090")], "")
        .await;
    assert_eq!(evil.status, StatusCode::MISDIRECTED_REQUEST);
    for host in ["localhost:9090", "127.0.0.1", "[::1]:9090"] {
        let ok = s.call("GET", "/metrics", &[("host", host)], "").await;
        assert_eq!(ok.status, StatusCode::OK, "{host}");
    }
}

#[tokio::test]
async fn the_admin_api_on_the_memory_store() {
    known_sequence("").await;
}

#[tokio::test]
async fn the_admin_api_on_redis() {
    let Some(url) = std::env::var("FLOODGATE_TEST_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        assert!(
            std::env::var("FLOODGATE_REQUIRE_REDIS").as_deref() != Ok("1"),
            "FLOODGATE_REQUIRE_REDIS=1 but FLOODGATE_TEST_REDIS_URL is unset"
        );
        eprintln!("the_admin_api_on_redis: skipped, FLOODGATE_TEST_REDIS_URL is unset");
        return;
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let store =
        format!("[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"fgadmin:{nanos}:\"");
    known_sequence(&store).await;
}

#[tokio::test]
async fn the_admin_api_on_a_redis_cluster() {
    let Some(seeds) = test_server(
        "FLOODGATE_TEST_REDIS_CLUSTER_URLS",
        "the_admin_api_on_a_redis_cluster",
    ) else {
        return;
    };
    let urls: Vec<String> = seeds.split(',').map(|u| format!("\"{u}\"")).collect();
    let store = format!(
        "[store]\nbackend = \"redis-cluster\"\nurls = [{}]\nprefix = \"{}\"",
        urls.join(", "),
        fresh_prefix()
    );
    known_sequence(&store).await;
}

#[tokio::test]
async fn only_the_admin_secret_or_a_session_opens_the_admin_api() {
    let up = fake_upstream().await;
    let s = setup("", &up.url()).await;
    assert_eq!(s.call("GET", "/admin/usage", &[], "").await.status, 401);
    // A caller's key is not the admin's: refused, and only after the wrong secret's delay.
    let start = Instant::now();
    let key = [("authorization", "Bearer sk-alice-secret")];
    assert_eq!(s.call("GET", "/admin/usage", &key, "").await.status, 401);
    assert!(start.elapsed() >= WRONG_SECRET_DELAY);
    let reset = [
        ("authorization", "Bearer sk-alice-secret"),
        ("content-type", "application/json"),
    ];
    let body = r#"{"scope":"key","id":"alice"}"#;
    assert_eq!(
        s.call("POST", "/admin/reset", &reset, body).await.status,
        401
    );

    // The console: its page without signing in, with the security headers.
    let page = s.call("GET", "/", &[], "").await;
    assert_eq!(page.status, 200);
    assert!(page.body.contains("/console.js"));
    let csp = page.headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"));
    assert_eq!(s.call("GET", "/console.js", &[], "").await.status, 200);
    assert_eq!(s.call("GET", "/console/session", &[], "").await.status, 401);
    let json = [("content-type", "application/json")];
    let start = Instant::now();
    let wrong = s
        .call("POST", "/console/sign-in", &json, r#"{"secret":"guess"}"#)
        .await;
    assert_eq!(wrong.status, 401);
    assert!(start.elapsed() >= WRONG_SECRET_DELAY);
    assert!(!wrong.headers.contains_key("set-cookie"));
    let right = s.sign_in().await;
    assert_eq!(right.status, 200);
    let cookie = right.headers["set-cookie"].to_str().unwrap().to_owned();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: {cookie}");
    let csrf = right.json()["csrf"].as_str().unwrap().to_owned();
    let session = cookie.split(';').next().unwrap().to_owned();
    let with_cookie = [("cookie", session.as_str())];
    assert_eq!(
        s.call("GET", "/admin/usage", &with_cookie, "").await.status,
        200
    );
    let again = s.call("GET", "/console/session", &with_cookie, "").await;
    assert_eq!(again.json()["csrf"], csrf.as_str());
    // A reset with the cookie needs the CSRF token.
    let no_csrf = [
        ("cookie", session.as_str()),
        ("content-type", "application/json"),
    ];
    assert_eq!(
        s.call("POST", "/admin/reset", &no_csrf, body).await.status,
        403
    );
    let bad_csrf = [
        ("cookie", session.as_str()),
        ("content-type", "application/json"),
        ("x-csrf-token", "00"),
    ];
    assert_eq!(
        s.call("POST", "/admin/reset", &bad_csrf, body).await.status,
        403
    );
    let with_csrf = [
        ("cookie", session.as_str()),
        ("content-type", "application/json"),
        ("x-csrf-token", csrf.as_str()),
    ];
    assert_eq!(
        s.call("POST", "/admin/reset", &with_csrf, body)
            .await
            .status,
        200
    );
    // Behind a TLS proxy the cookie is Secure.
    let tls = [
        ("content-type", "application/json"),
        ("x-forwarded-proto", "https"),
    ];
    let over_tls = s
        .call(
            "POST",
            "/console/sign-in",
            &tls,
            r#"{"secret":"sk-ops-secret"}"#,
        )
        .await;
    assert!(
        over_tls.headers["set-cookie"]
            .to_str()
            .unwrap()
            .contains("; Secure")
    );
    // Signed out, the cookie opens nothing.
    let out = [
        ("cookie", session.as_str()),
        ("x-csrf-token", csrf.as_str()),
    ];
    assert_eq!(
        s.call("POST", "/console/sign-out", &out, "").await.status,
        204
    );
    assert_eq!(
        s.call("GET", "/admin/usage", &with_cookie, "").await.status,
        401
    );
    // A forged cookie neither.
    let forged = [("cookie", "floodgate_session=99999999999.00.00")];
    assert_eq!(s.call("GET", "/admin/usage", &forged, "").await.status, 401);
}

#[tokio::test]
async fn a_session_shares_its_cookie_line_with_another_apps_cookie_that_is_not_text() {
    let up = fake_upstream().await;
    let s = setup("", &up.url()).await;
    let signed_in = s.sign_in().await;
    assert_eq!(signed_in.status, 200);
    let cookie = signed_in.headers["set-cookie"].to_str().unwrap();
    let session = cookie.split(';').next().unwrap();
    // A browser sends every cookie of the host on one line, whatever port set it: here another
    // local app's, in UTF-8, beside the session's.
    let line =
        HeaderValue::from_bytes(&[b"pref=caf\xc3\xa9; ", session.as_bytes()].concat()).unwrap();
    let req = Request::builder()
        .uri(format!("http://{}/admin/usage", s.admin))
        .header("cookie", line.clone())
        .body(Body::empty())
        .unwrap();
    let status = s.client.request(req).await.unwrap().status();
    assert_eq!(status, StatusCode::OK, "the session is read from the line");
    let mut req = s.gw.request(
        "POST",
        "/v1/chat/completions",
        Some("sk-alice-secret"),
        CHAT,
    );
    req.headers_mut().insert("cookie", line);
    assert_eq!(s.gw.send(req).await.status, 200);
    let forwarded = up.seen.last_headers();
    let forwarded = forwarded.get("cookie").map(HeaderValue::as_bytes);
    assert_eq!(
        forwarded,
        Some(&b"pref=caf\xc3\xa9"[..]),
        "the session's cookie never reaches the upstream"
    );
}

/// One call over a fresh connection from `client`: its status and body.
async fn send(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, String) {
    let mut b = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = client
        .request(b.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn no_secret_reaches_the_logs() {
    let BinaryConfig {
        dir,
        file,
        port,
        admin_port,
    } = binary_config(
        "admin-logs",
        r#"
secret = "sk-ops-logged-never"
metrics_auth = true
[upstream]
demo = true
[[keys]]
id = "alice"
secret = "sk-alice-logged-never"
rate_limit = { requests = 1 }
"#,
    );
    let (stdout, stderr) = (dir.join("stdout.log"), dir.join("stderr.log"));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(&file)
        .env_remove("FLOODGATE_REDIS_URL")
        // Every level of every crate: whatever a dependency traces is read too.
        .env("RUST_LOG", "trace")
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    wait_for_port(port, &mut child);
    wait_for_port(admin_port, &mut child);
    let client = Client::builder(TokioExecutor::new()).build_http();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let gateway = format!("http://127.0.0.1:{port}");
    let json = ("content-type", "application/json");
    let form = |secret: &str| json!({ "secret": secret }).to_string();
    let sign_in = format!("{admin}/console/sign-in");
    // The form: a wrong secret (a near miss of the right one), then the right one.
    for (secret, status) in [("sk-ops-logged-nevex", 401), ("sk-ops-logged-never", 200)] {
        let (got, _) = send(&client, "POST", &sign_in, &[json], &form(secret)).await;
        assert_eq!(got, status);
    }
    // The bearer: the key's secret (not the admin's), then the admin's, on the API and /metrics.
    let usage = format!("{admin}/admin/usage");
    let as_key = [("authorization", "Bearer sk-alice-logged-never")];
    assert_eq!(send(&client, "GET", &usage, &as_key, "").await.0, 401);
    let as_admin = [("authorization", "Bearer sk-ops-logged-never")];
    assert_eq!(send(&client, "GET", &usage, &as_admin, "").await.0, 200);
    let metrics = format!("{admin}/metrics");
    assert_eq!(send(&client, "GET", &metrics, &as_admin, "").await.0, 200);
    // A caller with its key: passed, then refused; and the admin secret sent as a key.
    let chat = format!("{gateway}/v1/chat/completions");
    let key = [("authorization", "Bearer sk-alice-logged-never"), json];
    assert_eq!(send(&client, "POST", &chat, &key, CHAT).await.0, 200);
    assert_eq!(send(&client, "POST", &chat, &key, CHAT).await.0, 429);
    let admin_as_key = [("authorization", "Bearer sk-ops-logged-never"), json];
    assert_eq!(
        send(&client, "POST", &chat, &admin_as_key, CHAT).await.0,
        401
    );

    // Stopped gracefully, so that every line is written.
    let pid = child.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "floodgate did not stop");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
    let logs =
        std::fs::read_to_string(&stdout).unwrap() + &std::fs::read_to_string(&stderr).unwrap();
    // The logs were on: the refused sign-in, the sign-in and the caller's requests are there.
    for line in ["console sign-in refused", "console sign-in", "alice"] {
        assert!(logs.contains(line), "no `{line}` in the logs:\n{logs}");
    }
    for secret in [
        "sk-ops-logged-never",
        "sk-ops-logged-nevex",
        "sk-alice-logged-never",
    ] {
        assert!(!logs.contains(secret), "the logs show {secret}:\n{logs}");
    }
    // Nor the part of a secret a log might cut it to.
    assert!(!logs.contains("logged-nev"), "{logs}");
}

#[tokio::test]
async fn alerts_by_pages_at_ten_thousand_keys() {
    const KEYS: usize = 10_000;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("admin-alert-pages");
    std::fs::create_dir_all(&dir).unwrap();
    let tally = dir.join("tally.json");
    let _ = std::fs::remove_file(&tally);
    let id = |i: usize| format!("k{i:05}");
    let today = chrono::Local::now().date_naive();
    let day = |back: u64| (today - chrono::Days::new(back)).to_string();
    // Refused yesterday (in the tally file): a key in four and the gateway; twenty days ago (on
    // no chart): a key in a thousand; today (counted, not flushed): a key in three.
    let mut want: std::collections::BTreeMap<(String, String), u64> = Default::default();
    for i in (0..KEYS).step_by(4) {
        want.insert((day(1), format!("key:{}", id(i))), 1 + (i % 7) as u64);
    }
    want.insert((day(1), "gateway".into()), 7);
    for i in (0..KEYS).step_by(1000) {
        want.insert((day(20), format!("key:{}", id(i))), 3);
    }
    let mut days = serde_json::Map::new();
    for ((d, subject), n) in &want {
        let on = days.entry(d.clone()).or_insert_with(|| json!({}));
        on[subject] = json!(n);
    }
    std::fs::write(&tally, json!({ "version": 1, "days": days }).to_string()).unwrap();
    let mut text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\nsecret = \"sk-ops-secret\"\n[upstream]\ndemo = true\n\
         [alerts]\npath = \"{}\"\n",
        tally.display()
    );
    for i in 0..KEYS {
        text += &format!("[[keys]]\nid = \"{}\"\nsecret = \"sk-{}\"\n", id(i), id(i));
    }
    let c = config(&text, "");
    let tally = Arc::new(Tally::open(&c).unwrap());
    let counters = tally.worker();
    for i in (0..KEYS).step_by(3) {
        let n = 1 + i % 5;
        for _ in 0..n {
            counters.refused(floodgate_gateway::tally::Subject::Key(i));
        }
        want.insert((day(0), format!("key:{}", id(i))), n as u64);
    }
    let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = listener.local_addr().unwrap();
    let process = Process::new(&c, tally);
    let admin_listener = Admin::new(c.admin.clone().unwrap(), process, store).unwrap();
    tokio::spawn(admin::run(
        listener,
        admin_listener,
        c.header_timeout,
        std::future::pending(),
    ));
    let client = Client::builder(TokioExecutor::new()).build_http();
    let bearer = [("authorization", "Bearer sk-ops-secret")];
    let get = |path: String| {
        let client = &client;
        async move {
            let url = format!("http://{admin}{path}");
            let (status, body) = send(client, "GET", &url, &bearer, "").await;
            assert_eq!(status, 200, "{path}: {body}");
            serde_json::from_str::<Value>(&body).unwrap()
        }
    };

    // Page by page, with the cursor: every alert once, in the order of the whole list.
    let whole = get("/admin/alerts".into()).await;
    assert_eq!(
        whole.as_object().unwrap().len(),
        1,
        "without a page, as /alerts answers"
    );
    let whole = whole["alerts"].as_array().unwrap().clone();
    assert_eq!(whole.len(), want.len());
    let mut walked = Vec::new();
    let mut cursor = None::<String>;
    let chart_days: Vec<String> = (0..14).rev().map(day).collect();
    loop {
        let path = match &cursor {
            Some(c) => format!("/admin/alerts?limit=500&cursor={c}"),
            None => "/admin/alerts?limit=500".into(),
        };
        let page = get(path).await;
        assert_eq!(page["total"], want.len());
        assert_eq!(page["chart"]["days"], json!(chart_days));
        let alerts = page["alerts"].as_array().unwrap();
        assert!(!alerts.is_empty() && alerts.len() <= 500);
        // Each subject of the page charted, from every day of the list.
        let charted = page["chart"]["subjects"].as_object().unwrap();
        for a in alerts {
            let subject = match a["key"].as_str() {
                Some(k) => format!("key:{k}"),
                None => "gateway".into(),
            };
            let series: Vec<u64> = chart_days
                .iter()
                .map(|d| *want.get(&(d.clone(), subject.clone())).unwrap_or(&0))
                .collect();
            assert_eq!(charted[&subject], json!(series), "{subject}");
        }
        walked.extend(alerts.iter().cloned());
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(walked, whole);
    let mut seen = std::collections::BTreeMap::new();
    for a in &walked {
        let subject = match a["key"].as_str() {
            Some(k) => format!("key:{k}"),
            None => "gateway".into(),
        };
        let day = a["day"].as_str().unwrap().to_owned();
        assert!(
            seen.insert((day, subject), a["count"].as_u64().unwrap())
                .is_none(),
            "listed twice: {a}"
        );
    }
    assert_eq!(seen, want, "every alert, with its count");
    // Newest day first.
    let days_listed: Vec<&str> = walked.iter().map(|a| a["day"].as_str().unwrap()).collect();
    assert!(days_listed.windows(2).all(|w| w[0] >= w[1]));
    let bad = |q: &'static str| {
        let url = format!("http://{admin}/admin/alerts?{q}");
        let client = &client;
        async move { send(client, "GET", &url, &bearer, "").await.0 }
    };
    for q in ["limit=0", "limit=1001", "limit=x", "cursor=99999", "page=2"] {
        assert_eq!(bad(q).await, 400, "{q}");
    }
}

#[tokio::test]
async fn a_right_bearer_is_answered_at_once_while_another_peer_guesses() {
    let up = fake_upstream().await;
    let s = setup("", &up.url()).await;
    let from = |ip: [u8; 4]| {
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.set_local_address(Some(std::net::IpAddr::from(ip)));
        Client::builder(TokioExecutor::new()).build::<_, Body>(connector)
    };
    let (guesser, scraper) = (from([127, 0, 0, 2]), from([127, 0, 0, 1]));
    let usage = format!("http://{}/admin/usage", s.admin);
    // More guesses at once than one peer may have waiting: the first refused unchecked (429)
    // says the guesser's turn is taken and its queue full.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..admin::MAX_WAITING + 8 {
        let (guesser, usage, tx) = (guesser.clone(), usage.clone(), tx.clone());
        tokio::spawn(async move {
            let bearer = format!("Bearer guess-{i}");
            let got = send(&guesser, "GET", &usage, &[("authorization", &bearer)], "").await;
            let _ = tx.send(got.0);
        });
    }
    loop {
        let status = rx.recv().await.unwrap();
        if status == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        assert_eq!(status, 401);
    }
    let right = [("authorization", "Bearer sk-ops-secret")];
    let start = Instant::now();
    let (status, body) = send(&scraper, "GET", &usage, &right, "").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        start.elapsed() < WRONG_SECRET_DELAY,
        "waited {:?} behind another peer's guesses",
        start.elapsed()
    );
    // From the guesser's own address, the right secret is one more attempt in its queue.
    let (status, _) = send(&guesser, "GET", &usage, &right, "").await;
    assert_eq!(status, 429);
}

/// The admin listener is timed as the callers' port is: a request head that never comes is cut
/// off after `[server] header_timeout_sec` (1 s here), so that a client, with no credentials,
/// cannot hold its connections (and the process's files) for good.
#[tokio::test]
async fn a_slow_head_is_cut_off_on_the_admin_listener_too() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let text = CONFIG
        .replace("{store}", "")
        .replace("[admin]", "[server]\nheader_timeout_sec = 1\n[admin]");
    let addr = setup_on(&text, "http://127.0.0.1:9").await.admin;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while conn.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    })
    .await;
    assert!(
        closed.is_ok(),
        "the admin listener held a head that never came for 10 s"
    );
    assert!(start.elapsed() >= std::time::Duration::from_millis(900));
    // A sign-in's body that never all comes is answered within as long.
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(
        b"POST /console/sign-in HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"secret\":",
    )
    .await
    .unwrap();
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), conn.read(&mut buf))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("did not arrive in time"), "{answer}");
}
