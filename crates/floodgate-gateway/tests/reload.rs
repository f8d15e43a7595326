//! Hot reload, on the binary: an edit of the config file (a rename over it, as editors do) or a
//! SIGHUP puts the new keys and limits in force without a restart; a broken edit, or one that
//! only a restart can apply, changes nothing and is reported; a limit that stays keeps its
//! counter; a stream in flight finishes. On the memory store, and on Redis with three replicas
//! each reloading on its own.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use common::*;

/// A `floodgate serve` on its own config file; killed, and the file removed, when dropped.
struct Replica {
    child: Child,
    file: PathBuf,
    addr: String,
    admin: String,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.file);
        let _ = std::fs::remove_file(self.file.with_extension("log"));
    }
}

/// The config of a replica on `port` (admin on `admin`), with `store` and `keys` (TOML).
fn config(port: u16, admin: u16, store: &str, upstream: &str, rest: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 2\n{store}\n[admin]\nlisten = \"127.0.0.1:{admin}\"\n[upstream]\nbase_url = \"{upstream}\"\n{rest}"
    )
}

/// Writes `text` beside `file` and renames it over `file`: what editors and ConfigMaps do.
fn replace(file: &Path, text: &str) {
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, file).unwrap();
}

async fn start(name: &str, text: String, port: u16, admin: u16) -> Replica {
    let file = std::env::temp_dir().join(format!(
        "floodgate-reload-{name}-{}.toml",
        std::process::id()
    ));
    std::fs::write(&file, &text).unwrap();
    // Its log kept beside the file, to say why, should it not start.
    let log = file.with_extension("log");
    let child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(&file)
        .env_remove("FLOODGATE_REDIS_URL")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut r = Replica {
        child,
        file,
        addr: format!("127.0.0.1:{port}"),
        admin: format!("127.0.0.1:{admin}"),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(&r.addr).await.is_err() || TcpStream::connect(&r.admin).await.is_err()
    {
        let exited = r.child.try_wait().unwrap();
        if exited.is_some() || Instant::now() >= deadline {
            panic!(
                "the gateway did not start ({}): {}",
                exited.map_or("still running".to_owned(), |s| s.to_string()),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    r
}

/// Sends `head` and `body` on a new connection; the whole answer.
async fn exchange(addr: &str, head: &str) -> String {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// A chat completion by `key`: its status and its `x-ratelimit-remaining-requests`.
async fn chat(r: &Replica, key: &str, extra: &str, body: &str) -> (u16, Option<u64>, String) {
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n{extra}\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = exchange(&r.addr, &head).await;
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let remaining = answer
        .lines()
        .find_map(|l| l.strip_prefix("x-ratelimit-remaining-requests: "))
        .and_then(|v| v.trim().parse().ok());
    (status, remaining, answer)
}

/// The count of reloads with `result` on `r`'s metrics.
async fn reloads(r: &Replica, result: &str) -> u64 {
    let answer = exchange(
        &r.admin,
        "GET /metrics HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n",
    )
    .await;
    let series = format!("floodgate_config_reloads_total{{result=\"{result}\"}} ");
    answer
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Waits until `r` has counted `n` reloads with `result` (bounded at 30 s, far past the
/// watcher's 250 ms poll, so that only a reload that never comes fails, not a loaded machine).
async fn reloaded(r: &Replica, result: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while reloads(r, result).await < n {
        assert!(Instant::now() < deadline, "no {result} reload counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const ALICE: &str =
    "[[keys]]\nid = \"alice\"\nsecret = \"sk-alice\"\nrate_limit = { requests = 3 }\n";
const BOB: &str = "[[keys]]\nid = \"bob\"\nsecret = \"sk-bob\"\n";

async fn reload_on(store: &str) {
    let up = fake_upstream().await;
    let (port, admin) = (free_port(), free_port());
    let text = |keys: &str| config(port, admin, store, &up.url(), keys);
    // A file of its own per store: the two run at once, in one process.
    let name = if store.contains("redis") {
        "one-redis"
    } else {
        "one-memory"
    };
    let r = start(name, text(ALICE), port, admin).await;
    assert_eq!(chat(&r, "sk-alice", "", CHAT).await.0, 200);
    assert_eq!(chat(&r, "sk-alice", "", CHAT).await.1, Some(1));
    assert_eq!(chat(&r, "sk-bob", "", CHAT).await.0, 401);

    // A key added, a limit grown: in force after the edit (the watcher looks every 250 ms; the
    // bound is for a loaded machine, not a speed to assert), no restart; the limit keeps its
    // counter (2 of alice's 3 taken, so 2 of the new 5 left after this one).
    let grown = ALICE.replace("requests = 3", "requests = 5");
    let edited = Instant::now();
    replace(&r.file, &text(&format!("{grown}{BOB}")));
    while chat(&r, "sk-bob", "", CHAT).await.0 != 200 {
        assert!(
            edited.elapsed() < Duration::from_secs(30),
            "bob never works after the edit"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    reloaded(&r, "ok", 1).await;
    assert_eq!(
        chat(&r, "sk-alice", "", CHAT).await.1,
        Some(2),
        "2 of 5 taken before, 3 now"
    );

    // A broken edit changes nothing and is counted.
    replace(
        &r.file,
        &format!(
            "{}\n[[keys]]\nid = \"carol\"\nsecrets = \"sk-carol\"\n",
            text(&format!("{grown}{BOB}"))
        ),
    );
    reloaded(&r, "error", 1).await;
    assert_eq!(chat(&r, "sk-bob", "", CHAT).await.0, 200);
    assert_eq!(chat(&r, "sk-carol", "", CHAT).await.0, 401);

    // What only a restart can change refuses the whole reload: carol is not added either.
    let restart = config(port, admin, store, &up.url(), &format!("{grown}{BOB}"))
        .replace("workers = 2", "workers = 1");
    replace(
        &r.file,
        &format!("{restart}[[keys]]\nid = \"carol\"\nsecret = \"sk-carol\"\n"),
    );
    reloaded(&r, "error", 2).await;
    assert_eq!(chat(&r, "sk-carol", "", CHAT).await.0, 401);

    // SIGHUP reloads too, the file as it is: the valid one again, which the watcher does not
    // reload on its own since it is what runs.
    replace(&r.file, &text(&format!("{grown}{BOB}")));
    let pid = r.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success()
    );
    reloaded(&r, "ok", 2).await;
    assert_eq!(chat(&r, "sk-bob", "", CHAT).await.0, 200);
}

#[tokio::test]
async fn an_edit_reloads_the_memory_store_gateway() {
    reload_on("[store]\nbackend = \"memory\"").await;
}

#[tokio::test]
async fn an_edit_reloads_a_redis_gateway() {
    let Some(url) = redis_url() else {
        return;
    };
    reload_on(&format!(
        "[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"reload-{}:\"",
        std::process::id()
    ))
    .await;
}

#[tokio::test]
async fn a_stream_in_flight_finishes_across_a_reload() {
    let up = fake_upstream().await;
    let (port, admin) = (free_port(), free_port());
    let keys = "[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n[[rate_limits]]\nscope = \"key\"\nid = \"k\"\ntpm = 100000\n";
    let text = config(port, admin, "", &up.url(), keys);
    let r = start("stream", text.clone(), port, admin).await;
    let stream = {
        let addr = r.addr.clone();
        tokio::spawn(async move {
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\
                 x-test-last-delay-ms: 1500\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{}",
                CHAT_STREAM.len(),
                CHAT_STREAM
            );
            exchange(&addr, &head).await
        })
    };
    // Once the upstream has the request, the config changes under it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while up.seen.hits() == 0 {
        assert!(Instant::now() < deadline, "the stream reached the upstream");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    replace(
        &r.file,
        &format!("{text}[[keys]]\nid = \"new\"\nsecret = \"sk-new\"\n"),
    );
    reloaded(&r, "ok", 1).await;
    let answer = stream.await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("[DONE]"),
        "the stream ran to its end: {answer}"
    );
}

/// An edit made after the gateway read its config and before its watcher's first look is put
/// in force: the watcher starts from the text that runs, not from the file as it first finds it.
#[tokio::test]
async fn an_edit_before_the_watchers_first_look_is_not_missed() {
    use floodgate_gateway::config::Config;
    use floodgate_gateway::reload::{Reloader, watch};

    let up = fake_upstream().await;
    let file = std::env::temp_dir().join(format!(
        "floodgate-reload-first-look-{}.toml",
        std::process::id()
    ));
    let (port, admin) = (free_port(), free_port());
    let text = |keys: &str| config(port, admin, "", &up.url(), keys);
    std::fs::write(&file, text(ALICE)).unwrap();
    let running = Config::load(&file).unwrap();
    replace(&file, &text(&format!("{ALICE}{BOB}")));
    let (process, state) = process_and_worker(&running).await;
    let reloader = Reloader::new(running, vec![state], process.clone());
    let watching = tokio::spawn(async move { watch(&reloader).await });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !process.running().keys.iter().any(|k| k.id == "bob") {
        assert!(Instant::now() < deadline, "the edit was missed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    watching.abort();
    let _ = std::fs::remove_file(&file);
}

#[tokio::test]
async fn a_reload_switches_token_limits_to_reserving() {
    let up = fake_upstream().await;
    let (port, admin) = (free_port(), free_port());
    let keys = "[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n[[rate_limits]]\nscope = \"key\"\nid = \"k\"\ntpm = 1000\n";
    let text = config(port, admin, "", &up.url(), keys);
    let r = start("reserve", text.clone(), port, admin).await;
    // An output cap above the limit: reactive admits it (the window is empty), reserve can
    // never fit it.
    let body = r#"{"model":"m","max_tokens":5000,"messages":[]}"#;
    let ask = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\
         x-test-tokens: 1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = exchange(&r.addr, &ask).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    replace(&r.file, &format!("[gateway]\ntokens = \"reserve\"\n{text}"));
    reloaded(&r, "ok", 1).await;
    let answer = exchange(&r.addr, &ask).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("max_tokens"), "{answer}");
}

/// The Redis URL the tests use, if any; a skip is a failure with FLOODGATE_REQUIRE_REDIS.
fn redis_url() -> Option<String> {
    match std::env::var("FLOODGATE_TEST_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty())
    {
        Some(url) => Some(url),
        None => {
            assert!(
                std::env::var_os("FLOODGATE_REQUIRE_REDIS").is_none(),
                "FLOODGATE_TEST_REDIS_URL is required"
            );
            eprintln!("skipped: no FLOODGATE_TEST_REDIS_URL");
            None
        }
    }
}

#[tokio::test]
async fn three_replicas_on_one_redis_each_reload_on_their_own() {
    let Some(url) = redis_url() else {
        return;
    };
    let up = fake_upstream().await;
    let store = format!(
        "[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"reload3-{}:\"",
        std::process::id()
    );
    let mut replicas = Vec::new();
    for i in 0..3 {
        let (port, admin) = (free_port(), free_port());
        let text = config(port, admin, &store, &up.url(), ALICE);
        replicas.push((
            start(&format!("r{i}"), text, port, admin).await,
            port,
            admin,
        ));
    }
    // Two of alice's 3, taken on two replicas: one counter in Redis.
    assert_eq!(chat(&replicas[0].0, "sk-alice", "", CHAT).await.1, Some(2));
    assert_eq!(chat(&replicas[1].0, "sk-alice", "", CHAT).await.1, Some(1));
    let grown = ALICE.replace("requests = 3", "requests = 5");
    for (r, port, admin) in &replicas {
        replace(
            &r.file,
            &config(*port, *admin, &store, &up.url(), &format!("{grown}{BOB}")),
        );
    }
    for (r, _, _) in &replicas {
        reloaded(r, "ok", 1).await;
        assert_eq!(chat(r, "sk-bob", "", CHAT).await.0, 200);
    }
    // The grown limit on the same counter: 2 taken before, then one a replica.
    let left: Vec<_> = {
        let mut v = Vec::new();
        for (r, _, _) in &replicas {
            v.push(chat(r, "sk-alice", "", CHAT).await.1);
        }
        v
    };
    assert_eq!(left, [Some(2), Some(1), Some(0)]);
}

/// A CA file replaced under a running gateway (a rotated CA: a new file renamed over the old,
/// as a Kubernetes secret's mount does) is put in force with the config unchanged; a broken
/// one is refused and changes nothing.
#[tokio::test]
async fn a_rotated_upstream_ca_file_reloads_without_a_config_edit() {
    let up = fake_upstream_tls(&tls_fixture("server.pem"), &tls_fixture("server.key")).await;
    let (port, admin) = (free_port(), free_port());
    let ca = std::env::temp_dir().join(format!("floodgate-reload-ca-{}.pem", std::process::id()));
    // Trusting the server's own certificate, not the CA that signed it: the upstream is
    // untrusted.
    std::fs::copy(tls_fixture("server.pem"), &ca).unwrap();
    let text = config(
        port,
        admin,
        "",
        &up.https_url(),
        &format!("ca_file = \"{}\"\n{ALICE}", ca.display()),
    );
    let r = start("ca-file", text, port, admin).await;
    assert_eq!(chat(&r, "sk-alice", "", CHAT).await.0, 502);

    replace(
        &ca,
        &std::fs::read_to_string(tls_fixture("ca.pem")).unwrap(),
    );
    reloaded(&r, "ok", 1).await;
    assert_eq!(chat(&r, "sk-alice", "", CHAT).await.0, 200);
    assert_eq!(up.seen.hits(), 1);

    // Not a certificate: the reload is refused, the CA in force stays.
    replace(&ca, "not a certificate\n");
    reloaded(&r, "error", 1).await;
    assert_eq!(chat(&r, "sk-alice", "", CHAT).await.0, 200);
    let _ = std::fs::remove_file(&ca);
}
