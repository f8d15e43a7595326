//! The gateway on Redis: three gateway processes sharing one Redis hold one limit between them;
//! a Redis outage fails open; once Redis is back, limits hold again; `rediss://` works.
//!
//! Needs `FLOODGATE_TEST_REDIS_URL` (scripts/test sets it); without it the tests skip with a
//! note, unless `FLOODGATE_REQUIRE_REDIS=1`, when they fail. The outage test starts its own
//! `redis-server` (it kills and restarts it). The TLS test needs `FLOODGATE_TEST_REDIS_TLS_URL`
//! and the server's CA in `SSL_CERT_FILE` (scripts/test sets both) and skips the same way.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;

fn redis_url() -> Option<String> {
    match std::env::var("FLOODGATE_TEST_REDIS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("FLOODGATE_REQUIRE_REDIS").as_deref() != Ok("1"),
                "FLOODGATE_REQUIRE_REDIS=1 but FLOODGATE_TEST_REDIS_URL is not set"
            );
            eprintln!(
                "note: FLOODGATE_TEST_REDIS_URL is not set: skipping the gateway's Redis tests"
            );
            None
        }
    }
}

fn redis_tls_url() -> Option<String> {
    match std::env::var("FLOODGATE_TEST_REDIS_TLS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("FLOODGATE_REQUIRE_REDIS").as_deref() != Ok("1"),
                "FLOODGATE_REQUIRE_REDIS=1 but FLOODGATE_TEST_REDIS_TLS_URL is not set"
            );
            eprintln!(
                "note: FLOODGATE_TEST_REDIS_TLS_URL is not set: skipping the gateway's rediss:// test"
            );
            None
        }
    }
}

fn unique() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{}-{nanos}", std::process::id())
}

/// A `floodgate serve` process, killed on drop.
struct Process {
    child: Child,
    addr: SocketAddr,
    _config: TempFile,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn spawn_gateway(redis: &str, prefix: &str, upstream: &str) -> Process {
    let port = free_port();
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
[store]
backend = "redis"
url = "{redis}"
prefix = "{prefix}"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "shared"
secret = "sk-shared"
org = "acme"
rate_limit = {{ requests = 5, window_sec = 60 }}
"#
    );
    let path = std::env::temp_dir().join(format!("floodgate-gw-{}.toml", unique()));
    std::fs::write(&path, text).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("RUST_LOG", "warn")
        .env_remove("FLOODGATE_REDIS_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(Instant::now() < deadline, "the gateway did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Process {
        child,
        addr,
        _config: TempFile(path),
    }
}

async fn post(client: &reqwest_lite::Client, addr: SocketAddr) -> u16 {
    client.chat(addr, "sk-shared").await
}

/// A tiny HTTP client over hyper, enough for these tests.
mod reqwest_lite {
    use std::net::SocketAddr;

    use axum::body::Body;
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::Client as Inner;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;

    #[derive(Clone)]
    pub struct Client(Inner<HttpConnector, Body>);

    impl Client {
        pub fn new() -> Self {
            Client(Inner::builder(TokioExecutor::new()).build_http())
        }
        pub async fn chat(&self, addr: SocketAddr, key: &str) -> u16 {
            self.chat_enforced(addr, key).await.0
        }
        /// The status, and whether the answer carried rate-limit state (a store decided).
        pub async fn chat_enforced(&self, addr: SocketAddr, key: &str) -> (u16, bool) {
            let req = axum::http::Request::post(format!("http://{addr}/v1/chat/completions"))
                .header("authorization", format!("Bearer {key}"))
                .header("content-type", "application/json")
                .body(Body::from(super::CHAT))
                .unwrap();
            let resp = self.0.request(req).await.unwrap();
            let status = resp.status().as_u16();
            let enforced = resp.headers().contains_key("x-ratelimit-limit");
            let _ = resp.into_body().collect().await;
            (status, enforced)
        }
        pub async fn get(&self, url: String) -> u16 {
            let req = axum::http::Request::get(url).body(Body::empty()).unwrap();
            match self.0.request(req).await {
                Ok(r) => r.status().as_u16(),
                Err(_) => 0,
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_share_one_limit() {
    let Some(redis) = redis_url() else { return };
    let up = fake_upstream().await;
    let prefix = format!("fgtest:{}:", unique());
    let gateways = [
        spawn_gateway(&redis, &prefix, &up.url()).await,
        spawn_gateway(&redis, &prefix, &up.url()).await,
        spawn_gateway(&redis, &prefix, &up.url()).await,
    ];
    let client = reqwest_lite::Client::new();
    for g in &gateways {
        let deadline = Instant::now() + Duration::from_secs(10);
        while client.get(format!("http://{}/readyz", g.addr)).await != 200 {
            assert!(Instant::now() < deadline, "gateway not ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut tasks = Vec::new();
    for i in 0..96 {
        let client = client.clone();
        let addr = gateways[i % 3].addr;
        tasks.push(tokio::spawn(async move { post(&client, addr).await }));
    }
    let mut ok = 0;
    let mut refused = 0;
    for t in tasks {
        match t.await.unwrap() {
            200 => ok += 1,
            429 => refused += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((ok, refused), (5, 91));
    assert_eq!(up.seen.hits(), 5, "exactly 5 reached the upstream");
}

/// Starts `redis-server` on `port`; killed on drop.
struct RedisServer(Child);

impl RedisServer {
    async fn start(port: u16) -> RedisServer {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed for this test (scripts/test installs it)");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        RedisServer(child)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_outage_fails_open_and_limits_return_with_redis() {
    if redis_url().is_none() {
        return;
    }
    let up = fake_upstream().await;
    let port = free_port();
    let server = RedisServer::start(port).await;
    let url = format!("redis://127.0.0.1:{port}/0");
    let gw = spawn_gateway(&url, "fg:", &up.url()).await;
    let client = reqwest_lite::Client::new();
    let statuses = |n: usize| {
        let client = client.clone();
        let addr = gw.addr;
        async move {
            let mut v = Vec::new();
            for _ in 0..n {
                v.push(client.chat(addr, "sk-shared").await);
            }
            v
        }
    };
    // The key's limit of 5, spent but not refused: a refusal would be remembered by the worker
    // that gave it, and refused again from that memory during the outage (docs/design.md §11).
    assert_eq!(statuses(5).await, [200; 5]);

    drop(server);
    // Redis is gone: admission fails open, traffic keeps flowing.
    assert_eq!(statuses(10).await, [200; 10]);
    assert_eq!(client.get(format!("http://{}/readyz", gw.addr)).await, 503);

    let _server = RedisServer::start(port).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.get(format!("http://{}/readyz", gw.addr)).await != 200 {
        assert!(
            Instant::now() < deadline,
            "the gateway did not see Redis come back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The breaker closes within its probe interval; the restarted Redis is empty, so 5 requests
    // are admitted under its limit, then the limit holds again.
    let mut enforced_ok = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < deadline, "limits never came back");
        match client.chat_enforced(gw.addr, "sk-shared").await {
            (200, true) => enforced_ok += 1,
            (200, false) => tokio::time::sleep(Duration::from_millis(50)).await,
            (429, true) => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(enforced_ok, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_keeps_its_limits_on_redis_over_tls() {
    let Some(redis) = redis_tls_url() else { return };
    let up = fake_upstream().await;
    let prefix = format!("fgtest-tls:{}:", unique());
    // The `floodgate` binary itself, so that its build has the library's `tls` feature.
    let gw = spawn_gateway(&redis, &prefix, &up.url()).await;
    let client = reqwest_lite::Client::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while client.get(format!("http://{}/readyz", gw.addr)).await != 200 {
        assert!(
            Instant::now() < deadline,
            "the gateway never reached Redis over TLS"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut answers = Vec::new();
    for _ in 0..6 {
        answers.push(client.chat_enforced(gw.addr, "sk-shared").await);
    }
    assert_eq!(
        answers,
        [
            (200, true),
            (200, true),
            (200, true),
            (200, true),
            (200, true),
            (429, true)
        ],
        "decided by Redis (rate-limit headers on every answer), not failed open"
    );
}

/// A chat answered by gpt-4o-mini with 50 input and 50 output tokens: 38 µUSD.
async fn budget_chat(gw: &Gateway) -> Reply {
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-shared"), CHAT);
    req.headers_mut()
        .insert("x-test-model", "gpt-4o-mini".parse().unwrap());
    req.headers_mut()
        .insert("x-test-tokens", "100".parse().unwrap());
    gw.send(req).await
}

/// On Redis, a budget refusal's `Retry-After` is read from the windows when a rate limit frees
/// after the budget: a day's window of one request, used, outlasts the day's budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_refusal_on_redis_waits_for_a_day_window() {
    let Some(redis) = redis_url() else { return };
    // The budget is per UTC day on Redis's clock: a run across midnight would see it reset.
    early_in_a_window(Duration::from_secs(86_400), Duration::from_secs(30)).await;
    let up = fake_upstream().await;
    let prefix = format!("fgtest:{}:", unique());
    // 30 µUSD a day; the one answer spends 38.
    let text = format!(
        r#"
[store]
backend = "redis"
url = "{redis}"
prefix = "{prefix}"
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "shared"
secret = "sk-shared"
org = "acme"
rate_limit = {{ requests = 1, window_sec = 86400 }}
[[prices]]
model = "gpt-4o-mini"
input_per_million = 0.15
output_per_million = 0.60
[[budgets]]
scope = "org"
id = "acme"
period = "day"
usd = 0.00003
"#
    );
    let gw = gateway(&text, &up.url()).await;
    assert_eq!(budget_chat(&gw).await.status, 200);
    gw.settled().await;
    let r = budget_chat(&gw).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "budget_exceeded");
    // The budget frees at midnight, at most a day away; the day's request weighs on the
    // window until the end of the next day, more than a day away.
    let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!(wait > 86_400, "{wait}");
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(up.seen.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_share_one_budget() {
    let Some(redis) = redis_url() else { return };
    // The budget is per UTC day on Redis's clock: a run across midnight would see it reset.
    early_in_a_window(Duration::from_secs(86_400), Duration::from_secs(30)).await;
    let up = fake_upstream().await;
    let prefix = format!("fgtest:{}:", unique());
    // 100 µUSD a day; each answer below spends 38 (50 + 50 tokens of gpt-4o-mini).
    let text = format!(
        r#"
[store]
backend = "redis"
url = "{redis}"
prefix = "{prefix}"
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "shared"
secret = "sk-shared"
org = "acme"
[[prices]]
model = "gpt-4o-mini"
input_per_million = 0.15
output_per_million = 0.60
[[budgets]]
scope = "org"
id = "acme"
period = "day"
usd = 0.0001
"#
    );
    // Two gateways, each with its own Redis connection: two replicas.
    let a = gateway(&text, &up.url()).await;
    let b = gateway(&text, &up.url()).await;
    let mut statuses = Vec::new();
    for gw in [&a, &b, &a, &b, &a] {
        statuses.push(budget_chat(gw).await.status.as_u16());
        gw.settled().await;
    }
    // 38, 76, 114: the third answer passes the cap (admitted at 76); then both refuse.
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let r = budget_chat(&b).await;
    assert_eq!(r.json()["error"]["code"], "budget_exceeded");
    assert_eq!(up.seen.hits(), 3);
    // The spend lives once in Redis, under the store's prefix, hash-tagged on the org: both
    // replicas read the same 114 µUSD.
    for gw in [&a, &b] {
        let live = gw.state.live();
        let key = live.keys.lookup("sk-shared").unwrap();
        let budgets = live.keys.chain_for(key, None).budgets.unwrap();
        let d = budgets.check(gw.state.store()).await.unwrap();
        assert!(d.enforced);
        assert_eq!(d.spent, [114]);
        let floodgate::store::AnyStore::Redis(store) = gw.state.store() else {
            panic!("a Redis store");
        };
        assert_eq!(
            store.redis_key(budgets.budgets()[0].counter().key()),
            format!("{prefix}{{org:acme}}:org:acme:budget:day")
        );
    }
}

/// A gateway on the Redis at `url`, under a prefix of its own, with the `/alerts` secret
/// `sk-admin` and one key `k` (`sk-k`), its `[[keys]]` entry last.
fn tally_config(url: &str) -> String {
    format!(
        r#"
[store]
backend = "redis"
url = "{url}"
prefix = "fg-tally-{}:"
[upstream]
base_url = "{{upstream}}"
[alerts]
secret = "sk-admin"
[[keys]]
id = "k"
secret = "sk-k"
"#,
        unique()
    )
}

/// Two replicas on one Redis keep one refusal tally: each flushes its own counts into the day's
/// hash, and either one's `/alerts` shows the sum.
#[tokio::test]
async fn replicas_on_one_redis_share_one_refusal_tally() {
    let Some(url) = redis_url() else { return };
    let up = fake_upstream().await;
    let text = tally_config(&url) + "rate_limit = { requests = 1, window_sec = 60 }\n";
    let c = config(&text, &up.url());
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
        let tally = std::sync::Arc::new(floodgate_gateway::tally::Tally::open(&c).unwrap());
        let state = floodgate_gateway::AppState::with_tally(&c, store, &tally).unwrap();
        replicas.push((gateway_with(state).await, tally));
    }
    let (a, b) = (&replicas[0], &replicas[1]);
    let statuses = [
        a.0.chat("sk-k", CHAT).await.status.as_u16(),
        a.0.chat("sk-k", CHAT).await.status.as_u16(),
        b.0.chat("sk-k", CHAT).await.status.as_u16(),
        b.0.chat("sk-k", CHAT).await.status.as_u16(),
    ];
    assert_eq!(statuses, [200, 429, 429, 429]);
    async fn count(gw: &Gateway) -> serde_json::Value {
        let reply = gw
            .send(gw.request("GET", "/alerts", Some("sk-admin"), ""))
            .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        reply.json()["alerts"][0]["count"].clone()
    }
    // Before any flush each replica sees its own counts only.
    assert_eq!(count(&a.0).await, 1);
    a.1.flush().await;
    b.1.flush().await;
    assert_eq!(count(&a.0).await, 3);
    assert_eq!(count(&b.0).await, 3);
    // A flush with nothing new adds nothing.
    a.1.flush().await;
    assert_eq!(count(&b.0).await, 3);
}

/// The shutdown's flush runs on the background runtime after every worker has stopped. A
/// `/alerts` read on a worker used to open the tally's one Redis connection there, its driver
/// on that worker's event loop: once the worker stopped, the final flush timed out on the dead
/// connection and the refusals counted since the last flush were lost.
#[test]
fn the_final_flush_reaches_redis_after_the_worker_that_read_the_alerts_stopped() {
    use floodgate_gateway::tally::{Subject, Tally};
    let Some(url) = redis_url() else { return };
    let c = config(&tally_config(&url), "http://127.0.0.1:1");
    let tally = Tally::open(&c).unwrap();
    let counters = tally.worker();
    let worker = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    assert!(worker.block_on(tally.alerts()).unwrap().is_empty());
    counters.refused(Subject::Key(0));
    drop(worker);
    let background = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    background.block_on(tally.flush());
    // Another replica's tally reads what reached Redis.
    let alerts = background
        .block_on(Tally::open(&c).unwrap().alerts())
        .unwrap();
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!((alerts[0].key.as_deref(), alerts[0].count), (Some("k"), 1));
}

/// Redis restarting just as a gateway stops: the flush at exit, the last chance for the counts
/// since the previous flush, tries again until Redis is back instead of giving them up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flush_at_exit_waits_for_a_redis_that_is_restarting() {
    use floodgate_gateway::tally::{Subject, Tally};
    if redis_url().is_none() {
        return;
    }
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}/0");
    let c = config(&tally_config(&url), "http://127.0.0.1:1");
    let tally = Tally::open(&c).unwrap();
    tally.worker().refused(Subject::Key(0));
    // Redis is down when the flush starts and back a second and a half later.
    let restarted = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        RedisServer::start(port).await
    });
    tally.flush_final(Duration::from_secs(10)).await;
    let _server = restarted.await.unwrap();
    let alerts = Tally::open(&c).unwrap().alerts().await.unwrap();
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!((alerts[0].key.as_deref(), alerts[0].count), (Some("k"), 1));
}
