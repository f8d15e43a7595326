//! The bounds on what callers can make the process hold.
//!
//! - `[server] max_buffered_mib`: the bodies a process holds before admission are bounded all
//!   together, one key holds at most half of the bound (a key a reload adds too), and a body
//!   with no room in time is 503 `server_busy`, charged nothing. Measured on the binary: its
//!   resident memory under a flood of large bodies from one key.
//! - `[server] max_connections`: past it, a new connection waits until one closes.

mod common;

use std::convert::Infallible;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::*;

/// An upstream that reads each body whole and answers a completion with a usage of 10.
async fn reading_upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |req: hyper::Request<hyper::body::Incoming>| async move {
                        let _ = req.into_body().collect().await;
                        let body = r#"{"id":"x","object":"chat.completion","model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":5,"total_tokens":10}}"#;
                        Ok::<_, Infallible>(
                            hyper::Response::builder()
                                .header("content-type", "application/json")
                                .body(http_body_util::Full::new(Bytes::from_static(
                                    body.as_bytes(),
                                )))
                                .unwrap(),
                        )
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

/// The gateway binary on `config`, killed when dropped.
struct Binary(Child);

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Its resident memory, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// An answer read off a raw connection.
struct Answer {
    /// Its status (0 if the connection ended without one).
    status: u16,
    /// Its head and body as far as they were read: whole for a refusal, which is read to its
    /// end; the status line only for others.
    text: String,
}

impl Answer {
    /// The value of header `name` (lowercase, as hyper sends it).
    fn header(&self, name: &str) -> Option<&str> {
        let head = self.text.split("\r\n\r\n").next()?;
        head.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    }

    /// Its body as JSON, if it was read whole.
    fn json(&self) -> Option<serde_json::Value> {
        let (_, body) = self.text.split_once("\r\n\r\n")?;
        serde_json::from_str(body).ok()
    }
}

/// Sends `body` as a chat completion for `key` on a connection of its own, reading the answer
/// while it writes.
async fn post(addr: &str, key: &str, body: Bytes) -> Answer {
    let Ok(tcp) = TcpStream::connect(addr).await else {
        return Answer {
            status: 0,
            text: String::new(),
        };
    };
    let (mut rd, mut wr) = tcp.into_split();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let writer = tokio::spawn(async move {
        if wr.write_all(head.as_bytes()).await.is_ok() {
            let _ = wr.write_all(&body).await;
        }
        wr
    });
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let mut status = 0;
    loop {
        match rd.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
        let text = String::from_utf8_lossy(&seen);
        if status == 0 {
            let Some((line, _)) = text.split_once('\n') else {
                continue;
            };
            status = line
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
        }
        // A refusal is read whole (its length announced, as the gateway's error bodies are).
        let whole = status == 200
            || text.split_once("\r\n\r\n").is_some_and(|(head, body)| {
                let answer = Answer {
                    status,
                    text: format!("{head}\r\n\r\n"),
                };
                answer
                    .header("content-length")
                    .and_then(|n| n.parse().ok())
                    .is_some_and(|n: usize| body.len() >= n)
            });
        if whole {
            break;
        }
    }
    writer.abort();
    Answer {
        status,
        text: String::from_utf8_lossy(&seen).into_owned(),
    }
}

/// Taken by the tests that push large bodies, so that they run one at a time: the flood measures
/// how soon another key is served, which a neighbour's uploads on the same cores would slow.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_large_bodies_stays_within_the_bound_and_others_are_served() {
    let _alone = ALONE.lock().await;
    let upstream = reading_upstream().await;
    let port = free_port();
    let config = format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
workers = 2
header_timeout_sec = 2
max_buffered_mib = 512
[upstream]
base_url = "{upstream}"
[[keys]]
id = "big"
secret = "sk-big"
rate_limit = {{ requests = 1000, window_sec = 60 }}
[[keys]]
id = "small"
secret = "sk-small"
[[rate_limits]]
scope = "key"
id = "big"
tpm = 100000000
[[rate_limits]]
scope = "key"
id = "small"
tpm = 100000000
"#
    );
    let path = std::env::temp_dir().join(format!("floodgate-bound-{}.toml", std::process::id()));
    std::fs::write(&path, config).unwrap();
    let child = serve_binary(&path);
    let pid = child.id();
    let _gateway = Binary(child);
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(&addr).await.is_err() {
        assert!(Instant::now() < deadline, "the gateway did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        post(&addr, "sk-small", Bytes::from_static(CHAT.as_bytes()))
            .await
            .status,
        200
    );
    let own = rss(pid);
    assert!(own > 0, "the gateway's memory can be read");

    // Its peak, sampled while the flood lasts.
    let peak = Arc::new(AtomicU64::new(own));
    let sampler = tokio::spawn({
        let peak = Arc::clone(&peak);
        async move {
            loop {
                peak.fetch_max(rss(pid), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    // 100 bodies of 30 MiB at once from one key: 3000 MiB, where the key may hold 256.
    let content = "x".repeat(30 * 1024 * 1024 - 100);
    let large = Bytes::from(format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}]}}"#
    ));
    assert!(large.len() <= 30 * 1024 * 1024);
    let flood: Vec<_> = (0..100)
        .map(|_| tokio::spawn(post_owned(addr.clone(), "sk-big", large.clone())))
        .collect();
    // Meanwhile (once the gateway holds the key's bodies) another key's small request is
    // served: the bound the key reached leaves the others room. (How fast is the benchmarks'
    // to say: a time asserted here would fail on a loaded machine, not on a wrong gateway.)
    let deadline = Instant::now() + Duration::from_secs(10);
    while rss(pid) < own + (128 << 20) {
        assert!(
            Instant::now() < deadline,
            "the flood never reached the gateway"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let small = post(&addr, "sk-small", Bytes::from_static(CHAT.as_bytes()))
        .await
        .status;
    let mut answers = Vec::new();
    for f in flood {
        answers.push(f.await.unwrap());
    }
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    sampler.abort();
    let peak = peak.load(Ordering::SeqCst);

    assert_eq!(small, 200);
    let admitted = statuses.iter().filter(|&&s| s == 200).count();
    let busy = statuses.iter().filter(|&&s| s == 503).count();
    // A body that had room but did not arrive in time after it is a 408, uncharged too.
    let late = statuses.iter().filter(|&&s| s == 408).count();
    assert_eq!(
        admitted + busy + late,
        100,
        "every body is answered: {statuses:?}"
    );
    assert!(busy > 0, "the bound refused some: {statuses:?}");
    // Each refusal says why and when to come back: `server_busy`, with a `Retry-After`.
    let busy_read: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.status == 503 && a.json().is_some())
        .collect();
    assert!(!busy_read.is_empty(), "no refusal was read whole");
    for a in busy_read {
        assert_eq!(
            a.json().unwrap()["error"]["code"],
            "server_busy",
            "{}",
            a.text
        );
        assert_eq!(a.header("retry-after"), Some("5"), "{}", a.text);
        assert_eq!(a.header("retry-after-ms"), Some("5000"), "{}", a.text);
    }
    eprintln!(
        "{admitted} admitted, {busy} busy, {late} late; peak {} MiB over the gateway's own {} MiB",
        (peak - own) >> 20,
        own >> 20
    );
    let bound = 512 * 1024 * 1024;
    assert!(
        peak < own + bound,
        "resident memory peaked at {} MiB over its own {} MiB",
        (peak - own) >> 20,
        own >> 20
    );
    // Nothing was charged for the refused bodies: the key's window holds the admitted ones.
    let reply = remaining_requests(&addr, "sk-big").await;
    assert_eq!(reply, 1000 - admitted as u64 - 1, "{statuses:?}");
    let _ = std::fs::remove_file(path);
}

async fn post_owned(addr: String, key: &'static str, body: Bytes) -> Answer {
    post(&addr, key, body).await
}

/// A small chat completion for `key`; the requests it says are left.
async fn remaining_requests(addr: &str, key: &str) -> u64 {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{CHAT}",
        CHAT.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tcp.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    answer
        .lines()
        .find_map(|l| l.strip_prefix("x-ratelimit-remaining-requests: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no remaining-requests header: {answer}"))
}

/// Sends `GET /healthz` on `tcp` (kept alive) and reads the answer's status line, within `wait`.
async fn health(tcp: &mut TcpStream, wait: Duration) -> Option<String> {
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .ok()?;
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(wait, tcp.read(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    text.lines().next().map(str::to_owned)
}

#[tokio::test]
async fn past_max_connections_a_new_connection_waits_until_one_closes() {
    let up = fake_upstream().await;
    let gw = gateway(
        "[server]\nmax_connections = 2\n[upstream]\nbase_url = \"{upstream}\"\n",
        &up.url(),
    )
    .await;
    let answered = Duration::from_secs(5);
    let mut a = TcpStream::connect(gw.addr).await.unwrap();
    let mut b = TcpStream::connect(gw.addr).await.unwrap();
    assert_eq!(
        health(&mut a, answered).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    assert_eq!(
        health(&mut b, answered).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    // A third waits in the backlog, unanswered, while both stay open...
    let mut c = TcpStream::connect(gw.addr).await.unwrap();
    let third = tokio::spawn(async move { health(&mut c, answered).await });
    assert_eq!(
        health(
            &mut TcpStream::connect(gw.addr).await.unwrap(),
            Duration::from_millis(300)
        )
        .await,
        None,
        "not served past the cap"
    );
    // ...and is served once one closes.
    drop(a);
    assert_eq!(third.await.unwrap().as_deref(), Some("HTTP/1.1 200 OK"));
    assert_eq!(
        health(&mut b, answered).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
}

#[tokio::test]
async fn max_connections_holds_across_workers_without_a_slot_held_idle() {
    // Two workers of one process, as `serve` makes them: one bound, each its own socket (the
    // kernel gives each connection to one of them).
    let up = fake_upstream().await;
    let c = config(
        "[server]\nmax_connections = 1\n[upstream]\nbase_url = \"{upstream}\"\n",
        &up.url(),
    );
    let (process, first) = process_and_worker(&c).await;
    let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
    let second = floodgate_gateway::AppState::for_worker(&c, store, &process).unwrap();
    let mut addrs = Vec::new();
    for state in [first, second] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(listener.local_addr().unwrap());
        tokio::spawn(floodgate_gateway::run(
            listener,
            state,
            std::future::pending(),
        ));
    }
    let answered = Duration::from_secs(5);
    // Nothing open: the second worker serves at once (before, the first worker held the one
    // slot while it waited for a connection of its own, and this one waited with it).
    let mut b = TcpStream::connect(addrs[1]).await.unwrap();
    assert_eq!(
        health(&mut b, answered).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    // One open: a connection to the other worker waits, then is served once it closes.
    let mut a = TcpStream::connect(addrs[0]).await.unwrap();
    let waiting = tokio::spawn(async move { health(&mut a, answered).await });
    assert_eq!(
        health(
            &mut TcpStream::connect(addrs[1]).await.unwrap(),
            Duration::from_millis(300)
        )
        .await,
        None,
        "not served past the cap"
    );
    drop(b);
    assert_eq!(waiting.await.unwrap().as_deref(), Some("HTTP/1.1 200 OK"));
}

/// An upstream that counts the requests that arrive and reads none of their bodies until `gate`
/// gives it a permit for each: the gateway's forwarding of a large body stalls, and the body
/// keeps its room meanwhile. Its connections' receive buffers are small and fixed: what the
/// kernel takes off the gateway's hands is then at most a socket's send buffer (`tcp_wmem`,
/// 4 MiB by default), and a body larger than that is still held. (Left to grow, the buffers on
/// the two sides took a whole 4 MiB body on some machines, and the test read no room held.)
async fn stalling_upstream() -> (String, Arc<AtomicU64>, Arc<tokio::sync::Semaphore>) {
    use axum::extract::{Request, State};
    type Shared = (Arc<AtomicU64>, Arc<tokio::sync::Semaphore>);
    let shared: Shared = (Arc::default(), Arc::new(tokio::sync::Semaphore::new(0)));
    let app = axum::Router::new()
        .route(
            "/v1/chat/completions",
            axum::routing::post(
                |State((arrived, gate)): State<Shared>, req: Request| async move {
                    arrived.fetch_add(1, Ordering::SeqCst);
                    gate.acquire().await.unwrap().forget();
                    let _ = req.into_body().collect().await;
                    axum::Json(serde_json::json!({
                        "id": "x", "object": "chat.completion", "model": "m", "choices": [],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
                    }))
                },
            ),
        )
        .with_state(shared.clone());
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 * 1024).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1024).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, shared.0, shared.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_a_reload_adds_holds_at_most_half_of_the_bound() {
    let _alone = ALONE.lock().await;
    use floodgate_gateway::Config;
    use floodgate_gateway::reload::Reloader;

    let (url, arrived, gate) = stalling_upstream().await;
    // 64 MiB in all, 32 a key: two bodies of 16 MiB fill a key's share (each far larger than
    // what the kernel's buffers take while the upstream reads nothing).
    let text = |keys: &[&str]| {
        let mut t = format!(
            "[server]\nmax_body_mib = 16\nmax_buffered_mib = 64\nheader_timeout_sec = 2\n\
             [upstream]\nbase_url = \"{url}\"\ntimeout_sec = 60\n"
        );
        for k in keys {
            t.push_str(&format!(
                "[[keys]]\nid = \"{k}\"\nsecret = \"sk-{k}\"\n\
                 [[rate_limits]]\nscope = \"key\"\nid = \"{k}\"\ntpm = 100000000\n"
            ));
        }
        t
    };
    let file = std::env::temp_dir().join(format!(
        "floodgate-bound-reload-{}.toml",
        std::process::id()
    ));
    std::fs::write(&file, text(&["old"])).unwrap();
    let running = Config::load(&file).unwrap();
    let (process, state) = process_and_worker(&running).await;
    let gw = gateway_with(state.clone()).await;
    let reloader = Reloader::new(running, vec![state], process.clone());
    std::fs::write(&file, text(&["old", "new"])).unwrap();
    reloader.reload().unwrap();

    let content = "x".repeat(16 * 1024 * 1024 - 100);
    let large = Bytes::from(format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}]}}"#
    ));
    let addr = gw.addr.to_string();
    let send = |key: &'static str| tokio::spawn(post_owned(addr.clone(), key, large.clone()));
    // The new key's two bodies are admitted and held while the upstream does not read them:
    // its share is full.
    let holding = [send("sk-new"), send("sk-new")];
    let deadline = Instant::now() + Duration::from_secs(20);
    while arrived.load(Ordering::SeqCst) < 2 {
        assert!(
            Instant::now() < deadline,
            "the new key's bodies never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let total = 64 << 20;
    assert_eq!(process.buffers.available(), total - 2 * large.len(), "held");
    // A third finds no room in its share, though the total has half left: 503 at its deadline.
    let third = tokio::time::timeout(Duration::from_secs(10), send("sk-new"))
        .await
        .expect("the third body of the new key was refused in time, not let through")
        .unwrap();
    assert_eq!(third.status, 503, "{}", third.text);
    assert_eq!(third.json().unwrap()["error"]["code"], "server_busy");
    // Another key still has room: its body is admitted beside the held ones.
    let old = send("sk-old");
    while arrived.load(Ordering::SeqCst) < 3 {
        assert!(
            Instant::now() < deadline,
            "the old key's body never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gate.add_permits(3);
    for s in holding.into_iter().chain([old]) {
        assert_eq!(s.await.unwrap().status, 200);
    }
    let _ = std::fs::remove_file(file);
}
