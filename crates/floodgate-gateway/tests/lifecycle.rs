//! Graceful shutdown: requests in flight (streams included) finish; new ones are not accepted.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::*;

#[tokio::test]
async fn shutdown_drains_a_stream_in_flight() {
    let up = fake_upstream().await;
    let mut gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
[[rate_limits]]
scope = "key"
id = "k"
tpm = 1000
"#,
        &up.url(),
    )
    .await;
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT_STREAM);
    req.headers_mut()
        .insert("x-test-last-delay-ms", "600".parse().unwrap());
    let stream = gw.frames(req);
    let stop = async {
        // Once the stream is under way (its last chunk comes 600 ms after its first).
        wait_until("the stream reached the upstream", || up.seen.hits() >= 1).await;
        gw.shutdown();
    };
    let ((status, _, frames), ()) = tokio::join!(stream, stop);
    assert_eq!(status, 200);
    let body: Vec<u8> = frames.iter().flat_map(|(_, b)| b.to_vec()).collect();
    assert_eq!(
        events(&body).last().map(String::as_str),
        Some("[DONE]"),
        "the stream ran to its end"
    );
    let server = gw.server.take().unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stops once drained")
        .unwrap()
        .unwrap();
    assert!(tokio::net::TcpStream::connect(gw.addr).await.is_err());
}

/// The `floodgate` binary serving a config of its own (written to a temporary file); killed,
/// and its file removed, when dropped.
struct Binary {
    child: Child,
    path: PathBuf,
}

impl Binary {
    /// Starts `floodgate serve` on `config`; its stderr is kept for `stderr()` if `keep_stderr`.
    fn start(name: &str, config: &str, keep_stderr: bool) -> Binary {
        Binary::start_logging(name, config, keep_stderr, "info")
    }

    /// [`start`](Self::start) with `RUST_LOG` set to `filter`.
    fn start_logging(name: &str, config: &str, keep_stderr: bool, filter: &str) -> Binary {
        let path =
            std::env::temp_dir().join(format!("floodgate-{name}-{}.toml", std::process::id()));
        std::fs::write(&path, config).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .args(["serve", "--config"])
            .arg(&path)
            // The config's store is the test's, and the log at its default level, whatever the
            // environment says.
            .env_remove("FLOODGATE_REDIS_URL")
            .env("RUST_LOG", filter)
            .stdout(Stdio::null())
            .stderr(if keep_stderr {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn()
            .unwrap();
        Binary { child, path }
    }

    /// Waits until `addr` accepts connections.
    async fn listening(&self, addr: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(Instant::now() < deadline, "the gateway did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn sigterm(&self) {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
    }

    /// The exit status, if the process ends within `within`.
    async fn exited(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the gateway with SIGTERM, checks that it exits cleanly, and returns its (first)
    /// per-request log line.
    async fn request_line_at_exit(&mut self) -> String {
        self.sigterm();
        let status = self.exited(Duration::from_secs(10)).await;
        assert!(status.expect("the gateway did not exit").success());
        let err = self.stderr();
        err.lines()
            .find(|l| l.contains(" request ") || l.ends_with("request"))
            .unwrap_or_else(|| panic!("no request line: {err}"))
            .to_owned()
    }

    /// The first line of the log that contains `needle`, read as it is written (the log must be
    /// kept); fails if the log ends without one.
    async fn line_with(&mut self, needle: &str) -> String {
        let err = self.child.stderr.take().expect("the log is kept");
        let needle = needle.to_owned();
        tokio::task::spawn_blocking(move || {
            let mut seen = String::new();
            let mut lines = std::io::BufRead::lines(std::io::BufReader::new(err));
            while let Some(line) = lines.next() {
                let line = line.unwrap();
                if line.contains(&needle) {
                    // The rest is read on to the end: a log no one reads would fail its writes.
                    std::thread::spawn(move || lines.for_each(drop));
                    return line;
                }
                seen.push_str(&line);
                seen.push('\n');
            }
            panic!("no line with {needle}: {seen}");
        })
        .await
        .unwrap()
    }

    fn stderr(&mut self) -> String {
        let mut err = String::new();
        std::io::Read::read_to_string(&mut self.child.stderr.take().unwrap(), &mut err).unwrap();
        err
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Sends `GET /v1/models` for key `sk-k` to the gateway at `addr` and waits until its upstream,
/// `silent` (a listener that never answers), has accepted the proxied request (accept polled,
/// so a mistake fails instead of hanging). Returns the caller's connection and the upstream's.
async fn held_by_upstream(
    addr: &str,
    silent: &std::net::TcpListener,
) -> (tokio::net::TcpStream, std::net::TcpStream) {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut conn,
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\r\n",
    )
    .await
    .unwrap();
    silent.set_nonblocking(true).unwrap();
    let accepted = Instant::now() + Duration::from_secs(10);
    loop {
        match silent.accept() {
            Ok((held, _)) => return (conn, held),
            Err(_) if Instant::now() < accepted => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("the request never reached the upstream: {e}"),
        }
    }
}

#[cfg(unix)]
#[tokio::test]
async fn sigterm_drains_and_exits_cleanly() {
    let port = free_port();
    let mut gw = Binary::start(
        "sigterm",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[upstream]\ndemo = true\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n"
        ),
        false,
    );
    let addr = format!("127.0.0.1:{port}");
    gw.listening(&addr).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<axum::body::Body>();
    let req = axum::http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", "Bearer sk-k")
        .body(axum::body::Body::from(CHAT_STREAM))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    gw.sigterm();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(events(&body).last().map(String::as_str), Some("[DONE]"));
    let status = gw.exited(Duration::from_secs(10)).await;
    let status = status.expect("the gateway did not exit");
    assert!(status.success(), "{status:?}");
}

#[cfg(unix)]
#[tokio::test]
async fn a_second_sigterm_during_the_drain_exits_at_once_and_says_so() {
    // An upstream that accepts and never answers: the request stays in flight, so the drain
    // would wait its full 30 s.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = silent.local_addr().unwrap();
    let port = free_port();
    let mut gw = Binary::start(
        "sigterm2",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[upstream]\nbase_url = \"http://{upstream}\"\ntimeout_sec = 60\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n"
        ),
        true,
    );
    let addr = format!("127.0.0.1:{port}");
    gw.listening(&addr).await;
    let (_conn, _held) = held_by_upstream(&addr, &silent).await;
    gw.sigterm();
    assert!(
        gw.exited(Duration::from_millis(500)).await.is_none(),
        "the first SIGTERM drains"
    );
    gw.sigterm();
    let status = gw.exited(Duration::from_secs(10)).await;
    let status = status.expect("a second SIGTERM did not end the drain");
    assert!(
        !status.success(),
        "requests were cut: not a clean exit ({status:?})"
    );
    // The log's buffered lines are written before the exit.
    let err = gw.stderr();
    assert!(
        err.contains("second signal: exiting without waiting for the drain"),
        "{err}"
    );
}

/// A log that nobody reads (a full pipe to a stalled collector) holds no request up: its lines
/// wait in the log writer's buffer, and are all written once the pipe is read.
#[cfg(unix)]
#[tokio::test]
async fn a_log_nobody_reads_holds_no_request_up() {
    let port = free_port();
    let mut gw = Binary::start(
        "unread-log",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n[upstream]\ndemo = true\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n"
        ),
        true,
    );
    let addr = format!("127.0.0.1:{port}");
    gw.listening(&addr).await;
    // About 200 bytes a request line: ten times what a pipe holds (64 KiB) before its writer
    // blocks.
    let n = 3_000;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<axum::body::Body>();
    let answered = async {
        for _ in 0..n {
            let req = axum::http::Request::post(format!("http://{addr}/v1/chat/completions"))
                .header("authorization", "Bearer sk-k")
                .body(axum::body::Body::from(CHAT))
                .unwrap();
            let resp = client.request(req).await.unwrap();
            assert_eq!(resp.status(), 200);
            http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap();
        }
    };
    // Bounded far past what the requests take: a gateway stalled on its log never finishes.
    tokio::time::timeout(Duration::from_secs(120), answered)
        .await
        .expect("requests stalled while nobody read the log");
    gw.sigterm();
    let err = tokio::task::spawn_blocking(move || {
        let err = gw.stderr();
        (gw, err)
    });
    let (mut gw, err) = err.await.unwrap();
    assert!(
        gw.exited(Duration::from_secs(10))
            .await
            .is_some_and(|s| s.success())
    );
    let lines = err
        .lines()
        .filter(|l| l.contains("access_log: request"))
        .count();
    assert_eq!(lines, n, "every request line written once read");
}

#[cfg(unix)]
#[tokio::test]
async fn a_sigterm_while_workers_start_stops_the_start_and_exits_cleanly() {
    // A Redis that accepts connections and never answers: each of the four workers waits the
    // store's connect timeout (1 s) before the next one starts, so the start takes 4 s.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let redis = silent.local_addr().unwrap();
    let port = free_port();
    let mut gw = Binary::start(
        "starting",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 4\n[store]\nbackend = \"redis\"\nurl = \"redis://{redis}/0\"\n[upstream]\ndemo = true\n"
        ),
        true,
    );
    // The first worker listens before its store has answered: the start is under way.
    gw.listening(&format!("127.0.0.1:{port}")).await;
    gw.sigterm();
    let status = gw.exited(Duration::from_secs(10)).await;
    let status = status.expect("the gateway did not exit");
    assert!(
        status.success(),
        "a clean stop, not killed by the signal: {status:?}"
    );
    let err = gw.stderr();
    assert!(err.contains("stopped while starting"), "{err}");
    assert!(!err.contains("floodgate gateway listening"), "{err}");
}

#[tokio::test]
async fn a_port_another_gateway_listens_on_is_refused() {
    // Another gateway's workers hold the port with SO_REUSEPORT, which would let a second one
    // bind too and split the traffic (and every limit) between them.
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.set_reuseport(true).unwrap();
    other.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = other.local_addr().unwrap().port();
    let _listening = other.listen(16).unwrap();
    let config =
        format!("[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 2\n[upstream]\ndemo = true\n");
    // Said whatever the log level lets through: with the log off too.
    for filter in ["info", "off"] {
        let mut gw = Binary::start_logging("taken", &config, true, filter);
        let status = gw.exited(Duration::from_secs(10)).await;
        let status = status.expect("a second gateway started on a taken port");
        assert!(!status.success());
        let err = gw.stderr();
        assert!(err.contains("cannot listen on"), "RUST_LOG={filter}: {err}");
    }
}

#[cfg(unix)]
#[tokio::test]
async fn a_redis_outage_is_logged_once_not_once_per_request() {
    for (on_error, status) in [("open", 200), ("closed", 503)] {
        let dead = free_port();
        let port = free_port();
        let mut gw = Binary::start(
            "outage-log",
            &format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:{dead}/0\"\non_error = \"{on_error}\"\n[upstream]\ndemo = true\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n[[rate_limits]]\nscope = \"key\"\nid = \"k\"\ntpm = 100000\n"
            ),
            true,
        );
        let addr = format!("127.0.0.1:{port}");
        gw.listening(&addr).await;
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<axum::body::Body>();
        for _ in 0..10 {
            let req = axum::http::Request::post(format!("http://{addr}/v1/chat/completions"))
                .header("authorization", "Bearer sk-k")
                .body(axum::body::Body::from(CHAT))
                .unwrap();
            let resp = client.request(req).await.unwrap();
            assert_eq!(resp.status(), status, "fail {on_error}");
            http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap();
        }
        // The token records run in the background after each response; the shutdown waits for
        // them.
        gw.sigterm();
        assert!(gw.exited(Duration::from_secs(10)).await.is_some());
        let err = gw.stderr();
        let unreachable = err.matches("Redis unreachable").count();
        assert!((1..=2).contains(&unreachable), "the outage, once: {err}");
        // Failing open, each of the ten answers' token records was lost: said once, at the
        // end, with the count; failing closed, nothing was admitted to charge.
        let lost: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("charges lost this run"))
            .collect();
        if on_error == "open" {
            assert_eq!(lost.len(), 1, "{err}");
            assert!(lost[0].contains("lost=10"), "{}", lost[0]);
        } else {
            assert!(lost.is_empty(), "{err}");
        }
        // Nothing else at warn or above, per response or otherwise (but the demo's notice).
        let loud = err
            .lines()
            .filter(|l| (l.contains(" WARN ") || l.contains(" ERROR ")) && !l.contains("DEMO"));
        assert_eq!(
            loud.count(),
            unreachable + lost.len(),
            "fail {on_error}: {err}"
        );
    }
}

#[cfg(unix)]
#[tokio::test]
async fn a_caller_that_leaves_before_the_upstream_answers_is_logged() {
    // An upstream that accepts and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = silent.local_addr().unwrap();
    let port = free_port();
    let mut gw = Binary::start(
        "gone",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n[upstream]\nbase_url = \"http://{upstream}\"\ntimeout_sec = 60\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\nrate_limit = {{ requests = 5 }}\n"
        ),
        true,
    );
    let addr = format!("127.0.0.1:{port}");
    gw.listening(&addr).await;
    let (conn, _held) = held_by_upstream(&addr, &silent).await;
    // The caller hangs up while its request waits for the upstream.
    drop(conn);
    let line = gw.line_with("status=499").await;
    gw.sigterm();
    assert!(
        gw.exited(Duration::from_secs(10))
            .await
            .is_some_and(|s| s.success())
    );
    assert!(
        line.contains("status=499")
            && line.contains("key=k")
            && line.contains("decision=\"admitted\""),
        "{line}"
    );
}

/// `POST /v1/chat/completions` with `Bearer sk-k`, or `GET /alerts` with `Bearer sk-admin`, to
/// the binary at `addr`: the status and body.
async fn call(addr: &str, alerts: bool) -> (u16, serde_json::Value) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<axum::body::Body>();
    let req = if alerts {
        axum::http::Request::get(format!("http://{addr}/alerts"))
            .header("authorization", "Bearer sk-admin")
            .body(axum::body::Body::empty())
    } else {
        axum::http::Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("authorization", "Bearer sk-k")
            .body(axum::body::Body::from(CHAT))
    };
    let resp = client.request(req.unwrap()).await.unwrap();
    let status = resp.status().as_u16();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, serde_json::from_slice(&body).unwrap())
}

#[cfg(unix)]
#[tokio::test]
async fn the_refusal_tally_is_written_at_shutdown_and_read_back_at_start() {
    let dir = std::env::temp_dir().join(format!("floodgate-tally-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tally = dir.join("tally.json");
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    // No timed flush within the test: only the one at shutdown writes the file.
    let config = format!(
        "[server]\nlisten = \"{addr}\"\n[upstream]\ndemo = true\n[alerts]\npath = \"{}\"\nflush_sec = 3600\nsecret = \"sk-admin\"\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\nrate_limit = {{ requests = 1, window_sec = 60 }}\n",
        tally.display()
    );
    let today = chrono::Local::now().date_naive().to_string();

    let mut first = Binary::start("tally-1", &config, false);
    first.listening(&addr).await;
    let statuses = [
        call(&addr, false).await.0,
        call(&addr, false).await.0,
        call(&addr, false).await.0,
    ];
    assert_eq!(statuses, [200, 429, 429]);
    assert!(!tally.exists(), "written before the flush");
    first.sigterm();
    let status = first
        .exited(Duration::from_secs(10))
        .await
        .expect("no exit");
    assert!(status.success(), "{status:?}");
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tally).unwrap()).unwrap();
    assert_eq!(written["days"][&today]["key:k"], 2, "{written}");

    // A new process (and a new memory store): its refusal adds to the two read back.
    let mut second = Binary::start("tally-2", &config, false);
    second.listening(&addr).await;
    assert_eq!(call(&addr, false).await.0, 200);
    assert_eq!(call(&addr, false).await.0, 429);
    let (status, alerts) = call(&addr, true).await;
    assert_eq!(status, 200);
    assert_eq!(alerts["alerts"][0]["count"], 3, "{alerts}");
    assert_eq!(alerts["alerts"][0]["key"], "k", "{alerts}");
    second.sigterm();
    assert!(second.exited(Duration::from_secs(10)).await.is_some());
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tally).unwrap()).unwrap();
    assert_eq!(written["days"][&today]["key:k"], 3, "{written}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_body_read_on_after_its_caller_left_is_charged_before_shutdown_ends() {
    // The caller leaves a stream at its finish_reason; the usage comes 1 s later, while the
    // gateway already drains: the worker waits for the body it reads on, and charges it.
    let up = fake_upstream().await;
    let port = free_port();
    let mut gw = Binary::start(
        "linger",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n[upstream]\nbase_url = \"{}\"\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\nrate_limit = {{ requests = 5 }}\n[[rate_limits]]\nscope = \"key\"\nid = \"k\"\ntpm = 1000\n",
            up.url()
        ),
        true,
    );
    let addr = format!("127.0.0.1:{port}");
    gw.listening(&addr).await;
    let finished = "\"finish_reason\":\"stop\"";
    send_and_leave_at(
        &addr,
        CHAT_STREAM,
        "x-test-usage-delay-ms: 1000\r\n",
        finished,
    )
    .await;
    let line = gw.request_line_at_exit().await;
    assert!(line.contains("tokens=60"), "{line}");
}

/// A completion body refused before admission (here `stream` named twice: upstreams differ on
/// which one counts) still gets its request line, with its status and why.
#[cfg(unix)]
#[tokio::test]
async fn a_body_refused_before_admission_gets_its_request_line() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let port = free_port();
    let mut gw = Binary::start(
        "badbody",
        &format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 1\n[upstream]\ndemo = true\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n[[rate_limits]]\nscope = \"key\"\nid = \"k\"\ntpm = 1000\n"
        ),
        true,
    );
    let addr = format!("127.0.0.1:{port}");
    gw.listening(&addr).await;
    let body = r#"{"model":"m","stream":true,"stream":false,"messages":[]}"#;
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let line = gw.request_line_at_exit().await;
    assert!(
        line.contains("status=400")
            && line.contains("key=k")
            && line.contains("path=\"/v1/chat/completions\"")
            && line.contains("decision=\"bad_request\""),
        "{line}"
    );
}
