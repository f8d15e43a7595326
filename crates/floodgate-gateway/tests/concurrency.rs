//! Concurrency limits (`max_in_flight`, docs/design.md §10): a request holds a slot in each of
//! its chain's concurrency limits from its admission to the end of its answer; a refusal takes
//! none anywhere; across replicas on Redis the slots are leases that a live replica renews and a
//! dead one's lapse.
//!
//! The upstream here holds every request at a gate until the test opens it, and counts how
//! many it holds at once: tests wait for those events, not for time (except where time passing
//! is the point: a lease outliving its lease time, a dead replica's lapsing).

mod common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::*;
use futures_util::StreamExt;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};

/// An upstream that holds each request until [`Gate::open`] lets one through.
#[derive(Clone)]
struct Gate {
    inner: Arc<GateInner>,
}

struct GateInner {
    /// Requests held now, and the most ever held at once.
    held: AtomicUsize,
    most: AtomicUsize,
    /// Requests that arrived.
    arrived: AtomicUsize,
    changed: Notify,
    permits: Semaphore,
}

impl Gate {
    async fn serve() -> (Gate, String) {
        let gate = Gate {
            inner: Arc::new(GateInner {
                held: AtomicUsize::new(0),
                most: AtomicUsize::new(0),
                arrived: AtomicUsize::new(0),
                changed: Notify::new(),
                permits: Semaphore::new(0),
            }),
        };
        let app = Router::new()
            .route("/v1/chat/completions", post(held))
            // Answered at once: a probe of whether a request is admitted, never held.
            .route(
                "/v1/models",
                get(|| async { axum::Json(serde_json::json!({"object": "list", "data": []})) }),
            )
            .route("/v1/realtime", get(declined))
            .with_state(gate.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (gate, url)
    }

    /// Lets `n` held requests (or the next ones to come) answer.
    fn open(&self, n: usize) {
        self.inner.permits.add_permits(n);
    }

    fn most(&self) -> usize {
        self.inner.most.load(Ordering::SeqCst)
    }

    /// Requests held now (a body held mid-way counts until it is sent or dropped).
    fn held(&self) -> usize {
        self.inner.held.load(Ordering::SeqCst)
    }

    /// Waits until `n` requests have arrived in all (bounded, so a test fails, not hangs).
    async fn arrived(&self, n: usize) {
        let wait = async {
            loop {
                let changed = self.inner.changed.notified();
                if self.inner.arrived.load(Ordering::SeqCst) >= n {
                    return;
                }
                changed.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("{n} requests never arrived upstream"));
    }
}

/// Holds a request at the gate: before its answer, or, for a stream (and for a JSON answer
/// with `x-test-mid-body`), in the middle of its body: the first part goes at once, the rest
/// once the gate lets it through.
async fn held(State(gate): State<Gate>, headers: HeaderMap, body: Bytes) -> Response {
    let g = &gate.inner;
    let now = g.held.fetch_add(1, Ordering::SeqCst) + 1;
    g.most.fetch_max(now, Ordering::SeqCst);
    g.arrived.fetch_add(1, Ordering::SeqCst);
    g.changed.notify_waiters();
    // Dropped with the request (a caller gone, a body cut), the counter still comes down.
    let leaving = Leaving(Arc::clone(&gate.inner));
    let usage = serde_json::json!({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2});
    let completion = serde_json::json!({
        "id": "x", "object": "chat.completion", "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": usage,
    });
    let stream = serde_json::from_slice::<serde_json::Value>(&body)
        .is_ok_and(|v| v["stream"] == serde_json::json!(true));
    let (first, rest, ctype) = if stream {
        let chunk = |content: &str, finish: serde_json::Value| {
            let c = serde_json::json!({"id": "x", "object": "chat.completion.chunk", "model": "fake",
                "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]});
            format!("data: {c}\n\n")
        };
        let last = serde_json::json!({"id": "x", "object": "chat.completion.chunk", "model": "fake",
            "choices": [], "usage": usage});
        let rest = format!(
            "{}data: {last}\n\ndata: [DONE]\n\n",
            chunk("lo", serde_json::json!("stop"))
        );
        (
            chunk("Hel", serde_json::Value::Null),
            rest,
            "text/event-stream",
        )
    } else if headers.contains_key("x-test-mid-body") {
        // The usage is in the rest.
        let whole = completion.to_string();
        let at = whole.find("\"usage\"").unwrap();
        (
            whole[..at].to_owned(),
            whole[at..].to_owned(),
            "application/json",
        )
    } else {
        g.permits.acquire().await.unwrap().forget();
        drop(leaving);
        return axum::Json(completion).into_response();
    };
    let after_the_gate = futures_util::stream::once(async move {
        let leaving = leaving;
        leaving.0.permits.acquire().await.unwrap().forget();
        Ok::<_, Infallible>(Bytes::from(rest))
    });
    let parts = futures_util::stream::iter([Ok(Bytes::from(first))]).chain(after_the_gate);
    Response::builder()
        .header("content-type", ctype)
        .body(Body::from_stream(parts))
        .unwrap()
}

/// Declines a realtime upgrade with a 400 whose body is held at the gate: its first part goes
/// at once, the rest once the gate lets it through.
async fn declined(State(gate): State<Gate>) -> Response {
    let g = &gate.inner;
    g.held.fetch_add(1, Ordering::SeqCst);
    g.arrived.fetch_add(1, Ordering::SeqCst);
    g.changed.notify_waiters();
    let leaving = Leaving(Arc::clone(&gate.inner));
    let after_the_gate = futures_util::stream::once(async move {
        let leaving = leaving;
        leaving.0.permits.acquire().await.unwrap().forget();
        Ok::<_, Infallible>(Bytes::from_static(b"model\"}}"))
    });
    let first = Ok(Bytes::from_static(b"{\"error\":{\"message\":\"unknown "));
    let parts = futures_util::stream::iter([first]).chain(after_the_gate);
    Response::builder()
        .status(400)
        .header("content-type", "application/json")
        .body(Body::from_stream(parts))
        .unwrap()
}

/// Counts a held request out when dropped.
struct Leaving(Arc<GateInner>);

impl Drop for Leaving {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::SeqCst);
    }
}

const BODY: &str = r#"{"model":"m","messages":[]}"#;

fn two_at_once(store: &str) -> String {
    format!(
        r#"
[upstream]
base_url = "{{upstream}}"
{store}
[[keys]]
id = "alice"
secret = "sk-alice"
org = "acme"
rate_limit = {{ requests = 100, max_in_flight = 2 }}
[[keys]]
id = "bob"
secret = "sk-bob"
org = "acme"
[[rate_limits]]
scope = "org"
id = "acme"
tpm = 100000
"#
    )
}

type Sent = tokio::task::JoinHandle<Reply>;

fn send(gw: &Arc<Gateway>, key: &'static str) -> Sent {
    let gw = Arc::clone(gw);
    tokio::spawn(async move { gw.chat(key, BODY).await })
}

/// Splits `sends` once `running` of them are held upstream: the answered ones (refusals come
/// back without waiting for the gate) and those still running.
async fn split(sends: Vec<Sent>, running: usize) -> (Vec<Reply>, Vec<Sent>) {
    let mut answered = Vec::new();
    let mut pending = sends;
    while pending.len() > running {
        let (done, _, rest) = futures_util::future::select_all(pending).await;
        answered.push(done.unwrap());
        pending = rest;
    }
    (answered, pending)
}

/// The first of `running` to finish, once the gate lets one through.
async fn first_done(running: Vec<Sent>) -> (Reply, Vec<Sent>) {
    let (done, _, rest) = futures_util::future::select_all(running).await;
    (done.unwrap(), rest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_runs_at_most_its_slots_and_a_refusal_takes_none() {
    let (gate, url) = Gate::serve().await;
    let gw = Arc::new(gateway(&two_at_once(""), &url).await);
    let sends: Vec<Sent> = (0..5).map(|_| send(&gw, "sk-alice")).collect();
    // Two run; three are refused while they do.
    gate.arrived(2).await;
    let (refused, running) = split(sends, 2).await;
    assert_eq!(gate.most(), 2);
    for r in &refused {
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "concurrency_limit_exceeded");
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains("for key"), "{message}");
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(r.header("retry-after-ms"), Some("1000"));
        assert_eq!(r.header("x-floodgate-in-flight-limit"), Some("2"));
        assert_eq!(r.header("x-floodgate-in-flight-remaining"), Some("0"));
        assert_eq!(r.header("x-floodgate-in-flight-scope"), Some("key"));
        // The rate limits as now: two requests charged, none of the refused.
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("98"));
    }
    // Counted by scope: three concurrency refusals of the key.
    let metrics = gw.state.metrics().encode();
    let over = r#"floodgate_limit_decisions_total{scope="key",kind="in_flight",outcome="over"} 3"#;
    assert!(metrics.contains(over), "{metrics}");
    // Another key of the org is not held back: it reaches the upstream beside them.
    let bob = send(&gw, "sk-bob");
    gate.arrived(3).await;
    // One finishes: its slot comes back once its body is sent, and the next one runs.
    gate.open(1);
    let (done, running) = first_done(running).await;
    assert_eq!(done.status, 200);
    assert_eq!(done.header("x-floodgate-in-flight-limit"), Some("2"));
    // As its admission left it: the first admitted saw one slot left, the second none.
    let left = done.header("x-floodgate-in-flight-remaining");
    assert!(matches!(left, Some("0" | "1")), "{left:?}");
    gw.settled().await;
    let next = send(&gw, "sk-alice");
    gate.arrived(4).await;
    gate.open(3);
    let next = next.await.unwrap();
    assert_eq!(next.status, 200, "{}", next.text());
    assert_eq!(next.header("x-ratelimit-remaining-requests"), Some("97"));
    for s in running {
        assert_eq!(s.await.unwrap().status, 200);
    }
    let bob = bob.await.unwrap();
    assert_eq!(bob.status, 200);
    assert_eq!(
        bob.header("x-floodgate-in-flight-limit"),
        None,
        "bob has none"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_leaves_gives_its_slot_back() {
    let (gate, url) = Gate::serve().await;
    let text = two_at_once("").replace("max_in_flight = 2", "max_in_flight = 1");
    let gw = Arc::new(gateway(&text, &url).await);
    let leaving = {
        let gw = Arc::clone(&gw);
        tokio::spawn(async move { gw.chat("sk-alice", BODY).await })
    };
    gate.arrived(1).await;
    assert_eq!(gw.chat("sk-alice", BODY).await.status, 429);
    leaving.abort();
    // The caller gone, the gateway drops the request and gives the slot back.
    gw.settled().await;
    let start = Instant::now();
    loop {
        let again = send(&gw, "sk-alice");
        gate.open(2);
        let r = again.await.unwrap();
        if r.status == 200 {
            break;
        }
        // The abort reaches the gateway when the connection closes: a moment after.
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the slot never came back"
        );
        gw.settled().await;
    }
}

/// One key, `sk-k` (the key of the raw-connection helpers), with one slot and a token limit:
/// its answers are metered, so that the paths where the gateway reads on without its caller
/// are the ones tested.
fn one_at_once(store: &str) -> String {
    format!(
        r#"
[upstream]
base_url = "{{upstream}}"
{store}
[[keys]]
id = "k"
secret = "sk-k"
rate_limit = {{ requests = 100, max_in_flight = 1 }}
[[rate_limits]]
scope = "key"
id = "k"
tpm = 100000
"#
    )
}

/// The stores to run a test on: memory, and Redis when a test server is set (a fresh prefix).
fn stores(test: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    if let Some(url) = test_redis_url(test) {
        out.push(format!(
            "[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"{}\"\n",
            fresh_prefix()
        ));
    }
    out
}

/// `GET /v1/models` for `sk-k`: the gate answers it at once, so it shows whether a request is
/// admitted without holding a slot for long.
async fn probe(gw: &Gateway) -> Reply {
    gw.send(gw.request("GET", "/v1/models", Some("sk-k"), ""))
        .await
}

fn refused_for_slots(r: &Reply) -> bool {
    r.status == 429 && r.json()["error"]["code"] == "concurrency_limit_exceeded"
}

/// Sends until a request is admitted (any answer but a concurrency refusal), and returns that
/// answer: a slot whose caller left (its answer dropped) is given back in a task of its own, a
/// moment later, so the first tries may still find it taken. (An answer read to its end has its
/// slot back by then: `an_answer_ends_for_its_caller_only_once_its_slot_is_back`.) Fails if it
/// is not back within `within`.
async fn until_admitted(within: Duration, mut send: impl AsyncFnMut() -> Reply) -> Reply {
    let deadline = Instant::now() + within;
    loop {
        let r = send().await;
        if !refused_for_slots(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "the slot never came back");
        // The interval of the polling, not a wait standing for the release.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Probes until the probe is admitted, within [`BACK`].
async fn probe_until_admitted(gw: &Gateway) {
    let next = until_admitted(BACK, async || probe(gw).await).await;
    assert_eq!(next.status, 200, "{}", next.text());
}

/// Within this a slot given back is seen back (well under the 5 s a metered body may be read
/// on after its caller left, which must not hold the slot).
const BACK: Duration = Duration::from_secs(3);

/// The end of a chunked body.
const END_OF_BODY: &str = "0\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_holds_its_slot_until_it_ends_then_gives_it_back() {
    let (gate, url) = Gate::serve().await;
    for store in stores("a_stream_holds_its_slot_until_it_ends_then_gives_it_back") {
        let gw = gateway(&one_at_once(&store), &url).await;
        let (mut conn, mut seen) = send_and_read_until(gw.addr, CHAT_STREAM, "", "Hel").await;
        // Mid-stream, the slot is held.
        assert!(refused_for_slots(&probe(&gw).await));
        gate.open(1);
        read_until(&mut conn, &mut seen, END_OF_BODY).await;
        let text = String::from_utf8_lossy(&seen).into_owned();
        assert!(text.contains("[DONE]"), "{text}");
        probe_until_admitted(&gw).await;
        gw.settled().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_realtime_upgrade_the_upstream_declines_holds_its_slot_until_the_answer_ends() {
    let (gate, url) = Gate::serve().await;
    let test = "a_realtime_upgrade_the_upstream_declines_holds_its_slot_until_the_answer_ends";
    for store in stores(test) {
        let gw = gateway(&one_at_once(&store), &url).await;
        let mut conn = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        let head = "GET /v1/realtime?model=m HTTP/1.1\r\nhost: x\r\n\
                    authorization: Bearer sk-k\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\
                    sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";
        tokio::io::AsyncWriteExt::write_all(&mut conn, head.as_bytes())
            .await
            .unwrap();
        let mut seen = Vec::new();
        read_until(&mut conn, &mut seen, "unknown").await;
        assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 400"));
        // Mid-answer, the slot is held, as for any answer (before, it went back at once).
        assert!(refused_for_slots(&probe(&gw).await));
        gate.open(1);
        read_until(&mut conn, &mut seen, END_OF_BODY).await;
        probe_until_admitted(&gw).await;
        gw.settled().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_its_caller_cuts_gives_its_slot_back() {
    let (gate, url) = Gate::serve().await;
    for store in stores("a_stream_its_caller_cuts_gives_its_slot_back") {
        let gw = gateway(&one_at_once(&store), &url).await;
        let (conn, _) = send_and_read_until(gw.addr, CHAT_STREAM, "", "Hel").await;
        assert!(refused_for_slots(&probe(&gw).await));
        // The caller hangs up mid-answer: the stream is cut (the upstream too) and the slot
        // given back, the gate never opened.
        drop(conn);
        probe_until_admitted(&gw).await;
        assert_eq!(gate.held(), 0, "the upstream's stream was cut");
        gw.settled().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_gone_mid_body_gives_its_slot_back_while_the_rest_is_read_on() {
    let (gate, url) = Gate::serve().await;
    for store in stores("a_caller_gone_mid_body_gives_its_slot_back_while_the_rest_is_read_on") {
        let gw = gateway(&one_at_once(&store), &url).await;
        // The completion's first part arrives; its usage is in the rest, held upstream.
        let (conn, _) =
            send_and_read_until(gw.addr, CHAT, "x-test-mid-body: 1\r\n", "\"choices\"").await;
        assert!(refused_for_slots(&probe(&gw).await));
        drop(conn);
        // The gateway reads the rest on, for its usage, without the caller: the slot is back
        // before that ends (the upstream still holds the rest).
        probe_until_admitted(&gw).await;
        assert_eq!(gate.held(), 1, "the rest is still being read");
        gate.open(1);
        gw.settled().await;
    }
}

/// An upstream that reads a request and closes the connection without an answer.
async fn broken_upstream() -> String {
    use tokio::io::AsyncReadExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = tcp.read(&mut buf).await;
            });
        }
    });
    url
}

/// An upstream that answers every completion with a 500 and an error body.
async fn failing_upstream() -> String {
    let app = Router::new().route(
        "/v1/chat/completions",
        post(|| async {
            let error = serde_json::json!({"error": {"message": "boom", "type": "server_error"}});
            (
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(error),
            )
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_fails_gives_the_slot_back() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let upstreams = [
        (dead, 502),
        (broken_upstream().await, 502),
        (failing_upstream().await, 500),
    ];
    for store in stores("an_upstream_that_fails_gives_the_slot_back") {
        for (url, status) in &upstreams {
            let gw = gateway(&one_at_once(&store), url).await;
            // With one slot, each request after the first is admitted only if the one before
            // gave its slot back.
            for _ in 0..3 {
                let r = until_admitted(BACK, async || gw.chat("sk-k", CHAT).await).await;
                assert_eq!(r.status, *status, "{url}: {}", r.text());
                if *status == 502 {
                    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
                }
            }
            gw.settled().await;
        }
    }
}

/// Three replicas (three stores on one Redis, as three processes would have).
async fn replicas(text: &str, url: &str, n: usize) -> Vec<Arc<Gateway>> {
    let c = config(text, url);
    let mut out = Vec::new();
    for _ in 0..n {
        let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
        out.push(Arc::new(gateway_on(&c, store).await));
    }
    out
}

fn on_redis(url: &str, max: u64, lease_sec: u64) -> String {
    format!(
        r#"
[upstream]
base_url = "{{upstream}}"
[store]
backend = "redis"
url = "{url}"
prefix = "{prefix}"
lease_sec = {lease_sec}
[[keys]]
id = "alice"
secret = "sk-alice"
org = "acme"
rate_limit = {{ requests = 1000, max_in_flight = {max} }}
"#,
        prefix = fresh_prefix()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_redis_run_at_most_the_slots_between_them() {
    let Some(redis) = test_redis_url("three_replicas_on_redis_run_at_most_the_slots_between_them")
    else {
        return;
    };
    let (gate, url) = Gate::serve().await;
    let gws = replicas(&on_redis(&redis, 3, 15), &url, 3).await;
    let sends: Vec<_> = (0..20)
        .map(|i| {
            let gw = Arc::clone(&gws[i % 3]);
            tokio::spawn(async move { gw.chat("sk-alice", BODY).await })
        })
        .collect();
    gate.arrived(3).await;
    // Every other request is refused while three run.
    let (refused, mut running) = split(sends, 3).await;
    assert_eq!(refused.len(), 17);
    for r in &refused {
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.json()["error"]["code"], "concurrency_limit_exceeded");
    }
    assert_eq!(gate.most(), 3);
    // As each finishes, the next can start, on any replica.
    for round in 0..6 {
        gate.open(1);
        let (done, rest) = first_done(running).await;
        running = rest;
        assert_eq!(done.status, 200);
        for gw in &gws {
            gw.settled().await;
        }
        running.push(send(&gws[round % 3], "sk-alice"));
        gate.arrived(4 + round).await;
        assert_eq!(gate.most(), 3, "never more than three at once");
    }
    gate.open(3);
    for s in running {
        let r = s.await.unwrap();
        assert_eq!(r.status, 200);
        // The refused requests took no slot and charged no rate limit: 3 + 6 ran.
        assert!(r.header("x-ratelimit-remaining-requests").is_some());
    }
    for gw in &gws {
        gw.settled().await;
    }
    let last = send(&gws[0], "sk-alice");
    gate.open(1);
    let last = last.await.unwrap();
    assert_eq!(last.header("x-ratelimit-remaining-requests"), Some("990"));
    assert_eq!(last.header("x-floodgate-in-flight-remaining"), Some("2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_slots_lapse_within_the_lease_and_a_live_one_keeps_its_own() {
    let Some(redis) = test_redis_url(
        "a_killed_replicas_slots_lapse_within_the_lease_and_a_live_one_keeps_its_own",
    ) else {
        return;
    };
    let (gate, url) = Gate::serve().await;
    let lease = Duration::from_secs(3);
    let text = on_redis(&redis, 1, lease.as_secs());
    let port = free_port();
    let file = std::env::temp_dir().join(format!("fg-lease-{port}.toml"));
    let binary_text =
        format!("[server]\nlisten = \"127.0.0.1:{port}\"\n{text}").replace("{upstream}", &url);
    std::fs::write(&file, &binary_text).unwrap();
    let mut child = serve_binary(&file);
    let live = replicas(&text, &url, 1).await.remove(0);
    // The binary's replica takes the one slot with a request the upstream holds.
    let addr = format!("127.0.0.1:{port}");
    let held = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match tokio::net::TcpStream::connect(&addr).await {
                Ok(mut tcp) => {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let req = format!(
                        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-alice\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{BODY}",
                        BODY.len()
                    );
                    tcp.write_all(req.as_bytes()).await.unwrap();
                    let mut buf = Vec::new();
                    let _ = tcp.read_to_end(&mut buf).await;
                    return buf;
                }
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("the binary never listened: {e}"),
            }
        }
    });
    gate.arrived(1).await;
    // Longer than the lease: the binary renews its slot, and the other replica is refused
    // throughout. (Time passing is what this checks.)
    let start = Instant::now();
    while start.elapsed() < lease + lease / 2 {
        let r = live.chat("sk-alice", BODY).await;
        assert_eq!(
            r.status,
            429,
            "the slot stays held at {:?}",
            start.elapsed()
        );
        assert_eq!(r.json()["error"]["code"], "concurrency_limit_exceeded");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // kill -9: nothing gives the slot back; its lease lapses.
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    let _ = held.await;
    loop {
        let attempt = send(&live, "sk-alice");
        // Let an admitted one answer (two: the killed replica's request may still wait at the
        // gate); a refused one never reaches it.
        gate.open(2);
        let r = attempt.await.unwrap();
        if r.status == 200 {
            break;
        }
        assert!(
            killed.elapsed() < lease + Duration::from_secs(2),
            "the dead replica's slot never lapsed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Within the lease, seen by a loop that looks every 100 ms on a machine that may be busy
    // with other tests: a second's slack for the looking, not for the lapse.
    assert!(killed.elapsed() <= lease + Duration::from_secs(1));
    let _ = std::fs::remove_file(&file);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_shows_each_scopes_requests_in_flight() {
    use floodgate_gateway::admin::{self, Admin};
    use floodgate_gateway::tally::Tally;
    use floodgate_gateway::{AppState, Process};
    use http_body_util::BodyExt;

    let (gate, url) = Gate::serve().await;
    let text = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\nsecret = \"sk-ops\"\n{}",
        two_at_once("").replace("tpm = 100000", "tpm = 100000\nmax_in_flight = 5")
    );
    let c = config(&text, &url);
    let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
    let process = Process::new(&c, Arc::new(Tally::in_memory(&c)));
    let state = AppState::for_worker(&c, store.clone(), &process).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_at = listener.local_addr().unwrap();
    let admin = Admin::new(c.admin.clone().unwrap(), process, store).unwrap();
    tokio::spawn(admin::run(
        listener,
        admin,
        c.header_timeout,
        std::future::pending(),
    ));
    let gw = Arc::new(gateway_with(state).await);
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<axum::body::Body>();
    let usage = async |scope: &str, id: &str| {
        let req = axum::http::Request::get(format!(
            "http://{admin_at}/admin/usage?scope={scope}&id={id}"
        ))
        .header("authorization", "Bearer sk-ops")
        .body(axum::body::Body::empty())
        .unwrap();
        let body = client.request(req).await.unwrap().into_body();
        let v: serde_json::Value =
            serde_json::from_slice(&body.collect().await.unwrap().to_bytes()).unwrap();
        v["scopes"][0]["in_flight"].clone()
    };
    let running: Vec<Sent> = vec![send(&gw, "sk-alice"), send(&gw, "sk-bob")];
    gate.arrived(2).await;
    assert_eq!(
        usage("key", "alice").await,
        serde_json::json!({"current": 1, "max": 2})
    );
    assert_eq!(
        usage("org", "acme").await,
        serde_json::json!({"current": 2, "max": 5})
    );
    assert_eq!(usage("key", "bob").await, serde_json::Value::Null, "no cap");
    gate.open(2);
    for s in running {
        assert_eq!(s.await.unwrap().status, 200);
    }
    gw.settled().await;
    assert_eq!(
        usage("org", "acme").await,
        serde_json::json!({"current": 0, "max": 5})
    );
}

/// A proxy in front of the test's Redis server that holds back the gateway's next slot release:
/// armed, it stops at the first `EVALSHA` of `release.lua` that the gateway sends, says so, and
/// forwards that call (with everything after it, in order) only once the test lets it go. A
/// release then lands exactly as late as the test says, however the tasks are scheduled.
struct ReleaseHolder {
    inner: Arc<HolderInner>,
}

struct HolderInner {
    armed: std::sync::atomic::AtomicBool,
    holding: std::sync::atomic::AtomicBool,
    changed: Notify,
    go: Semaphore,
}

/// `release.lua`'s hash, as the gateway calls it: `clock.lua` then the script's own file (the
/// store's `scripts.rs`).
fn release_sha() -> String {
    let script = concat!(
        include_str!("../../floodgate/src/store/redis/clock.lua"),
        include_str!("../../floodgate/src/store/redis/release.lua"),
    );
    sha1_smol::Sha1::from(script).digest().to_string()
}

impl ReleaseHolder {
    /// Listens on a loopback port, forwarding to the server `redis_url` names; returns the URL
    /// to give the gateway instead (`None`, with a note: not a `redis://` URL, which a plain TCP
    /// proxy cannot stand in front of).
    async fn serve(redis_url: &str) -> Option<(ReleaseHolder, String)> {
        let Some(rest) = redis_url.strip_prefix("redis://") else {
            eprintln!("a release holder needs a redis:// URL: skipped on {redis_url}");
            return None;
        };
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (user, server) = match authority.rsplit_once('@') {
            Some((user, server)) => (format!("{user}@"), server.to_owned()),
            None => (String::new(), authority.to_owned()),
        };
        let holder = ReleaseHolder {
            inner: Arc::new(HolderInner {
                armed: std::sync::atomic::AtomicBool::new(false),
                holding: std::sync::atomic::AtomicBool::new(false),
                changed: Notify::new(),
                go: Semaphore::new(0),
            }),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{user}{}{path}", listener.local_addr().unwrap());
        let sha = release_sha();
        let inner = Arc::clone(&holder.inner);
        tokio::spawn(async move {
            loop {
                let (gateway, _) = listener.accept().await.unwrap();
                let redis = tokio::net::TcpStream::connect(&server).await.unwrap();
                tokio::spawn(relay(gateway, redis, sha.clone(), Arc::clone(&inner)));
            }
        });
        Some((holder, url))
    }

    /// Holds the next release the gateway sends.
    fn arm(&self) {
        self.inner.armed.store(true, Ordering::SeqCst);
    }

    /// Waits until a release is held (bounded, so that a test fails, not hangs).
    async fn holding(&self) {
        let wait = async {
            loop {
                let changed = self.inner.changed.notified();
                if self.inner.holding.load(Ordering::SeqCst) {
                    return;
                }
                changed.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .expect("the gateway never sent the release");
    }

    /// Lets the release held go on to Redis.
    fn let_go(&self) {
        self.inner.go.add_permits(1);
    }
}

/// Copies Redis's answers to the gateway as they come, and the gateway's calls to Redis one by
/// one, holding back an armed holder's release.
async fn relay(
    gateway: tokio::net::TcpStream,
    redis: tokio::net::TcpStream,
    sha: String,
    holder: Arc<HolderInner>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut from_gateway, mut to_gateway) = gateway.into_split();
    let (mut from_redis, mut to_redis) = redis.into_split();
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_redis, &mut to_gateway).await;
    });
    let release = format!("$40\r\n{sha}\r\n").into_bytes();
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match from_gateway.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
        }
        while let Some(len) = command_len(&pending) {
            let call: Vec<u8> = pending.drain(..len).collect();
            let releases = call.windows(release.len()).any(|w| w == release);
            if releases && holder.armed.swap(false, Ordering::SeqCst) {
                holder.holding.store(true, Ordering::SeqCst);
                holder.changed.notify_waiters();
                holder.go.acquire().await.unwrap().forget();
                holder.holding.store(false, Ordering::SeqCst);
            }
            if to_redis.write_all(&call).await.is_err() {
                return;
            }
        }
    }
}

/// The length of the call at the start of `buf` (a RESP array of bulk strings) once it is whole.
fn command_len(buf: &[u8]) -> Option<usize> {
    let (n, mut at) = resp_line(buf, b'*')?;
    for _ in 0..n {
        let (len, line) = resp_line(&buf[at..], b'$')?;
        at += line + len + 2;
        if buf.len() < at {
            return None;
        }
    }
    Some(at)
}

/// The number on the line `<kind><number>\r\n` at the start of `buf`, and the line's length.
fn resp_line(buf: &[u8], kind: u8) -> Option<(usize, usize)> {
    let end = buf.windows(2).position(|w| w == b"\r\n")?;
    assert_eq!(buf[0], kind, "not a call: {}", String::from_utf8_lossy(buf));
    let n = std::str::from_utf8(&buf[1..end]).unwrap().parse().unwrap();
    Some((n, end + 2))
}

/// A gateway on `text` with the store its test runs on: memory, or Redis through a release
/// holder (its call timeout long enough that a release held stays under way: the test lets it
/// go, never a timeout).
async fn gateway_holding_releases(
    text: &str,
    upstream: &str,
    redis_url: Option<&str>,
) -> Option<(Gateway, Option<ReleaseHolder>)> {
    let Some(redis_url) = redis_url else {
        return Some((gateway(text, upstream).await, None));
    };
    let (holder, url) = ReleaseHolder::serve(redis_url).await?;
    let prefix = fresh_prefix();
    let store_section =
        format!("[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"{prefix}\"\n");
    let c = config(
        &text.replace("[upstream]", &format!("{store_section}[upstream]")),
        upstream,
    );
    let mut redis = floodgate::store::redis::RedisConfig::new(url);
    redis.prefix = prefix;
    redis.timeout = Duration::from_secs(30);
    let store = floodgate::store::redis::RedisStore::connect(redis)
        .await
        .unwrap();
    let gw = gateway_on(&c, floodgate::store::AnyStore::Redis(store)).await;
    Some((gw, Some(holder)))
}

/// What has arrived on `conn` so far, without waiting for more, and whether it has closed.
fn arrived_so_far(conn: &tokio::net::TcpStream, seen: &mut Vec<u8>) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match conn.try_read(&mut buf) {
            Ok(0) => return true,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) => panic!("reading the answer: {e}"),
        }
    }
}

/// Whether `seen` holds a whole answer of known length: its head, and as many bytes after it as
/// its `Content-Length` says.
fn whole(seen: &str) -> bool {
    let Some((head, body)) = seen.split_once("\r\n\r\n") else {
        return false;
    };
    let length = head
        .lines()
        .find_map(|l| {
            l.to_lowercase()
                .strip_prefix("content-length: ")?
                .parse()
                .ok()
        })
        .expect("an answer of known length");
    body.len() >= length
}

/// Whether `seen` holds a whole chunked answer.
fn chunked_whole(seen: &str) -> bool {
    seen.contains(END_OF_BODY)
}

/// With the release held back on Redis (none on memory: it gives the slot back at once),
/// checks that the caller has not seen its answer end (`ended`), then lets the release go; then
/// reads the answer to its end. The slot is then back: the caller's next request is admitted at
/// the first try.
async fn ends_once_the_slot_is_back(
    gw: &Gateway,
    holder: Option<&ReleaseHolder>,
    conn: &mut tokio::net::TcpStream,
    seen: &mut Vec<u8>,
    ended: fn(&str) -> bool,
) {
    if let Some(holder) = holder {
        holder.holding().await;
        // Written before the release was sent, the end would be here now.
        arrived_so_far(conn, seen);
        let text = String::from_utf8_lossy(seen).into_owned();
        assert!(
            !ended(&text),
            "the caller saw its answer end while its slot was still taken: {text}"
        );
        holder.let_go();
    }
    read_until_it(conn, seen, ended).await;
    let next = probe(gw).await;
    assert!(!refused_for_slots(&next), "refused for its own slot");
}

/// Sends `head` (a whole request) on a new connection to `gw`.
async fn send_raw(gw: &Gateway, head: &str) -> tokio::net::TcpStream {
    let mut conn = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut conn, head.as_bytes())
        .await
        .unwrap();
    conn
}

/// A caller that sends its next request as soon as it has read an answer whole finds its slot
/// free (docs/design.md §10): the answer's end reaches it only once its slot has been given
/// back. On Redis the release goes out after the body's last byte has been read from upstream,
/// and a holder keeps it from landing until the test has looked: the caller has not seen the end
/// meanwhile. For an answer of known length (its last byte is its end), for a stream (its end
/// is the chunked body's last chunk), for an answer with no body (to a `HEAD`: its head is its
/// end), and for the gateway's own 502 when the upstream cannot be reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_ends_for_its_caller_only_once_its_slot_is_back() {
    let (gate, url) = Gate::serve().await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let test = "an_answer_ends_for_its_caller_only_once_its_slot_is_back";
    let redis = test_redis_url(test);
    let models = "GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\r\n";
    for redis in [None, redis.as_deref()] {
        let Some((gw, holder)) = gateway_holding_releases(&one_at_once(""), &url, redis).await
        else {
            continue;
        };
        let holder = holder.as_ref();
        for _ in 0..3 {
            // The model list, answered at once with a Content-Length.
            if let Some(holder) = holder {
                holder.arm();
            }
            let mut conn = send_raw(&gw, models).await;
            let mut seen = Vec::new();
            ends_once_the_slot_is_back(&gw, holder, &mut conn, &mut seen, whole).await;
            assert!(String::from_utf8_lossy(&seen).contains("\"list\""));
            // A stream, held mid-way at the gate, then let through.
            let (mut conn, mut seen) = send_and_read_until(gw.addr, CHAT_STREAM, "", "Hel").await;
            if let Some(holder) = holder {
                holder.arm();
            }
            gate.open(1);
            ends_once_the_slot_is_back(&gw, holder, &mut conn, &mut seen, chunked_whole).await;
            assert!(String::from_utf8_lossy(&seen).contains("[DONE]"));
            // An answer with no body to send (to a HEAD): hyper never asks for its body, so
            // its head alone must wait for the slot.
            if let Some(holder) = holder {
                holder.arm();
            }
            let mut conn = send_raw(&gw, &models.replacen("GET", "HEAD", 1)).await;
            let mut seen = Vec::new();
            let head_only = |s: &str| s.contains("\r\n\r\n");
            ends_once_the_slot_is_back(&gw, holder, &mut conn, &mut seen, head_only).await;
            assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
        }
        gw.settled().await;
        // The upstream unreachable: the gateway's own answer.
        let Some((gw, holder)) = gateway_holding_releases(&one_at_once(""), &dead, redis).await
        else {
            continue;
        };
        for _ in 0..3 {
            if let Some(holder) = &holder {
                holder.arm();
            }
            let mut conn = send_raw(&gw, models).await;
            let mut seen = Vec::new();
            ends_once_the_slot_is_back(&gw, holder.as_ref(), &mut conn, &mut seen, whole).await;
            let text = String::from_utf8_lossy(&seen);
            assert!(text.starts_with("HTTP/1.1 502"), "{text}");
        }
        gw.settled().await;
    }
}

/// An upstream that accepts every realtime upgrade, then ends the session at once: a close
/// frame (1000), and its connection closed. Anything else gets an empty model list.
async fn closing_ws_upstream() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut tcp, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tcp.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if !head.starts_with(b"GET /v1/realtime") {
                    // The model list (a probe of whether a request is admitted).
                    let list = r#"{"object":"list","data":[]}"#;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{list}",
                        list.len()
                    );
                    let _ = tcp.write_all(answer.as_bytes()).await;
                    return;
                }
                let answer = "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\n\
                              upgrade: websocket\r\n\
                              sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n";
                let close = [0x88, 0x02, 0x03, 0xe8];
                let _ = tcp.write_all(answer.as_bytes()).await;
                let _ = tcp.write_all(&close).await;
                let _ = tcp.shutdown().await;
            });
        }
    });
    url
}

/// A realtime session holds its key's slot for its whole life and gives it back before its
/// caller's connection is closed (docs/design.md §10): a caller that opens its next session as
/// soon as its connection has closed is admitted. On Redis a holder keeps the release from
/// landing until the test has looked: the caller's connection has not closed meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_realtime_session_closes_for_its_caller_only_once_its_slot_is_back() {
    let upstream = closing_ws_upstream().await;
    let test = "a_realtime_session_closes_for_its_caller_only_once_its_slot_is_back";
    let redis = test_redis_url(test);
    // Unmetered: the session's frames pass as they come, and its end charges nothing.
    let text = one_at_once("").replace("tpm = 100000", "rpm = 1000");
    for redis in [None, redis.as_deref()] {
        let Some((gw, holder)) = gateway_holding_releases(&text, &upstream, redis).await else {
            continue;
        };
        for _ in 0..3 {
            if let Some(holder) = &holder {
                holder.arm();
            }
            let head = "GET /v1/realtime?model=m HTTP/1.1\r\nhost: x\r\n\
                        authorization: Bearer sk-k\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\
                        sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";
            let mut conn = send_raw(&gw, head).await;
            let mut seen = Vec::new();
            if let Some(holder) = &holder {
                holder.holding().await;
                // Closed before the release was sent, the connection would show it now.
                let closed = arrived_so_far(&conn, &mut seen);
                assert!(
                    !closed,
                    "the caller's connection closed while its slot was still taken: {}",
                    String::from_utf8_lossy(&seen)
                );
                holder.let_go();
            }
            let mut buf = [0u8; 4096];
            loop {
                let n = tokio::time::timeout(
                    Duration::from_secs(5),
                    tokio::io::AsyncReadExt::read(&mut conn, &mut buf),
                )
                .await
                .expect("the session ended")
                .unwrap();
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buf[..n]);
            }
            let text = String::from_utf8_lossy(&seen);
            assert!(text.starts_with("HTTP/1.1 101"), "{text}");
            // The caller's next request, at once: the slot is free.
            let next = probe(&gw).await;
            assert_eq!(next.status, 200, "{}", next.text());
        }
        gw.settled().await;
    }
}

/// A shadow concurrency limit takes its slot past its max and never refuses; a request it alone
/// would refuse is counted as `shadow_over` and logged, as a shadow rate limit's is.
#[tokio::test]
async fn a_shadow_concurrency_limit_over_admits_and_is_logged() {
    let (logs, _logging) = capture_logs();
    let (gate, url) = Gate::serve().await;
    let config =
        two_at_once("").replace("max_in_flight = 2 }", "max_in_flight = 1, shadow = true }");
    let gw = Arc::new(gateway(&config, &url).await);
    let sends: Vec<Sent> = (0..2).map(|_| send(&gw, "sk-alice")).collect();
    gate.arrived(2).await;
    assert_eq!(gate.most(), 2, "both run: the limit is shadow");
    gate.open(2);
    for s in sends {
        assert_eq!(s.await.unwrap().status, 200);
    }
    let metrics = gw.state.metrics().encode();
    let over =
        r#"floodgate_limit_decisions_total{scope="key",kind="in_flight",outcome="shadow_over"} 1"#;
    assert!(metrics.contains(over), "{metrics}");
    let logged = logs.text();
    let line = logged
        .lines()
        .find(|l| l.contains("a shadow concurrency limit would have refused this request"))
        .unwrap_or_else(|| panic!("not logged: {logged}"));
    assert!(line.contains(r#"shadow_over="key""#), "{line}");
    assert!(line.contains("max_in_flight=1"), "{line}");
}
