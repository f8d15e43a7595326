//! The gateway on a Redis Cluster: three gateway processes hold one limit between them; a key's
//! chain and a customer's (and the gateway's) limits, in slots of their own, refuse with nothing
//! charged; a gateway-wide limit across orgs is exact; the refusal tally is shared; a primary
//! killed mid-load fails over with requests flowing and limits holding after it; a slot moved
//! under load (`redis-cli --cluster reshard`) shows callers no error.
//!
//! Needs `FLOODGATE_TEST_REDIS_CLUSTER_URLS` (the seeds; scripts/test starts a cluster); without
//! it the tests skip with a note, unless `FLOODGATE_REQUIRE_REDIS=1`, when they fail. The fault
//! tests start a cluster of their own (scripts/redis-cluster), which they damage.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;

/// The shared cluster's seeds, or `None` (with a note) when cluster tests are not enabled.
fn seeds(test: &str) -> Option<String> {
    test_server("FLOODGATE_TEST_REDIS_CLUSTER_URLS", test)
}

/// A `[store]` section on the cluster of `seeds` (comma-separated), under a fresh prefix.
fn store_section(seeds: &str) -> String {
    let urls: Vec<String> = seeds.split(',').map(|u| format!("\"{u}\"")).collect();
    format!(
        "[store]\nbackend = \"redis-cluster\"\nurls = [{}]\nprefix = \"{}\"\n",
        urls.join(", "),
        fresh_prefix()
    )
}

/// A `floodgate serve` process, killed (and its config removed) on drop.
struct Replica {
    child: Child,
    addr: SocketAddr,
    file: PathBuf,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.file);
    }
}

async fn replica(text: &str, n: usize) -> Replica {
    let port = free_port();
    let file = std::env::temp_dir().join(format!(
        "floodgate-cluster-{}-{n}-{port}.toml",
        std::process::id()
    ));
    std::fs::write(
        &file,
        format!("[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 2\n{text}"),
    )
    .unwrap();
    let child = serve_binary(&file);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(Instant::now() < deadline, "the gateway did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Replica { child, addr, file }
}

/// One request: `POST /v1/chat/completions` with `key` (and a customer header if given), on a
/// connection of its own; its status.
async fn chat(addr: SocketAddr, key: &str, customer: Option<&str>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let extra = customer.map_or(String::new(), |c| format!("x-floodgate-customer: {c}\r\n"));
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n{extra}\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{CHAT}",
        CHAT.len()
    );
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer)
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_gateways_on_a_cluster_hold_one_limit_with_a_gateway_wide_one() {
    let Some(seeds) = seeds("three_gateways_on_a_cluster_hold_one_limit") else {
        return;
    };
    let up = fake_upstream().await;
    let text = format!(
        "{}[upstream]\nbase_url = \"{}\"\n\
         [[keys]]\nid = \"shared\"\nsecret = \"sk-shared\"\norg = \"acme\"\n\
         rate_limit = {{ requests = 5, window_sec = 60 }}\n\
         [[rate_limits]]\nscope = \"gateway\"\nrpm = 1000\n",
        store_section(&seeds),
        up.url()
    );
    let replicas = [
        replica(&text, 0).await,
        replica(&text, 1).await,
        replica(&text, 2).await,
    ];
    let mut tasks = Vec::new();
    for i in 0..96 {
        let addr = replicas[i % 3].addr;
        tasks.push(tokio::spawn(
            async move { chat(addr, "sk-shared", None).await },
        ));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    let refused = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!((ok, refused), (5, 91), "{statuses:?}");
    assert_eq!(up.seen.hits(), 5, "exactly 5 reached the upstream");
}

/// The key's limits (org acme's slot), a customer's (its own) and the gateway's (its own):
/// a request the customer refuses is charged to none, and the gateway-wide limit counts every
/// org's requests exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chains_across_slots_refuse_with_nothing_charged_and_the_gateway_limit_is_exact() {
    let Some(seeds) = seeds("chains_across_slots_refuse_with_nothing_charged") else {
        return;
    };
    let up = fake_upstream().await;
    let mut keys = String::new();
    for o in 0..6 {
        keys.push_str(&format!(
            "[[keys]]\nid = \"k{o}\"\nsecret = \"sk-{o}\"\norg = \"org{o}\"\n\
             rate_limit = {{ requests = 10 }}\n"
        ));
    }
    let text = format!(
        "{}[upstream]\nbase_url = \"{{upstream}}\"\n{keys}\
         [[rate_limits]]\nscope = \"customer\"\nid = \"big\"\nrpm = 2\n\
         [[rate_limits]]\nscope = \"gateway\"\nrpm = 20\n",
        store_section(&seeds)
    );
    let gw = gateway(&text, &up.url()).await;
    // The customer admits 2; the third is refused by it, after the key's step charged and
    // refunded: the key counts 2, the gateway 2.
    let with = |key: &str, customer: Option<&str>| {
        let mut req = gw.request("POST", "/v1/chat/completions", Some(key), CHAT);
        if let Some(c) = customer {
            req.headers_mut()
                .insert("x-floodgate-customer", c.parse().unwrap());
        }
        gw.send(req)
    };
    for _ in 0..2 {
        assert_eq!(with("sk-0", Some("big")).await.status, 200);
    }
    let refused = with("sk-0", Some("big")).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert!(refused.text().contains("customer"), "{}", refused.text());
    let after = with("sk-0", None).await;
    assert_eq!(after.status, 200);
    assert_eq!(
        after.header("x-ratelimit-remaining-requests"),
        Some("7"),
        "the key (10 a minute) counts its 3 admitted requests, not the refused one"
    );
    // 3 of the gateway's 20 taken (none by the refusal); 40 more from six orgs at once (57
    // between their keys): exactly 17 more admitted.
    let mut tasks = Vec::new();
    let gw = Arc::new(gw);
    for i in 0..40 {
        let gw = gw.clone();
        tasks.push(tokio::spawn(async move {
            gw.chat(&format!("sk-{}", i % 6), CHAT)
                .await
                .status
                .as_u16()
        }));
    }
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            200 => ok += 1,
            429 => {}
            other => panic!("status {other}"),
        }
    }
    assert_eq!(ok, 17, "the gateway-wide limit across orgs");
}

#[tokio::test]
async fn replicas_on_a_cluster_share_one_refusal_tally() {
    let Some(seeds) = seeds("replicas_on_a_cluster_share_one_refusal_tally") else {
        return;
    };
    let up = fake_upstream().await;
    let text = format!(
        "{}[upstream]\nbase_url = \"{{upstream}}\"\n[alerts]\nsecret = \"sk-admin\"\n\
         [[keys]]\nid = \"k\"\nsecret = \"sk-k\"\nrate_limit = {{ requests = 1 }}\n",
        store_section(&seeds)
    );
    let c = config(&text, &up.url());
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
        let tally = Arc::new(floodgate_gateway::tally::Tally::open(&c).unwrap());
        let state = floodgate_gateway::AppState::with_tally(&c, store, &tally).unwrap();
        replicas.push((gateway_with(state).await, tally));
    }
    let (a, b) = (&replicas[0], &replicas[1]);
    let statuses = [
        a.0.chat("sk-k", CHAT).await.status.as_u16(),
        a.0.chat("sk-k", CHAT).await.status.as_u16(),
        b.0.chat("sk-k", CHAT).await.status.as_u16(),
    ];
    assert_eq!(statuses, [200, 429, 429]);
    a.1.flush().await;
    b.1.flush().await;
    let reply =
        b.0.send(b.0.request("GET", "/alerts", Some("sk-admin"), ""))
            .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["alerts"][0]["count"], 2);
    // The readiness of a gateway on the cluster.
    let ready = a.0.send(a.0.request("GET", "/readyz", None, "")).await;
    assert_eq!(ready.status, 200, "{}", ready.text());
}

/// A cluster of this test's own (it is damaged), stopped on drop.
struct OwnCluster {
    dir: PathBuf,
    seeds: String,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/redis-cluster")
}

impl OwnCluster {
    fn start(name: &str) -> OwnCluster {
        let dir = std::env::temp_dir().join(format!(
            "floodgate-own-cluster-{name}-{}",
            std::process::id()
        ));
        let out = Command::new(script())
            .arg("start")
            .arg(&dir)
            .output()
            .expect("scripts/redis-cluster runs (redis-server and redis-cli installed)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let seeds = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        OwnCluster { dir, seeds }
    }

    fn ports(&self) -> Vec<u16> {
        std::fs::read_to_string(self.dir.join("ports"))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect()
    }

    fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .arg("-p")
            .arg(port.to_string())
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The port of the primary serving `tag`'s slot, and its id, by a live node's view.
    fn primary_of(&self, tag: &str, via: u16) -> (u16, String) {
        self.serving(tag, via)
            .unwrap_or_else(|| panic!("no primary serves {tag}'s slot"))
    }

    /// The live primary serving `tag`'s slot, if one does (none mid-failover).
    fn serving(&self, tag: &str, via: u16) -> Option<(u16, String)> {
        let slot: u16 = self
            .cli(via, &["cluster", "keyslot", &format!("{{{tag}}}")])
            .trim()
            .parse()
            .unwrap();
        for line in self.cli(via, &["cluster", "nodes"]).lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let serves = f[8..].iter().any(|range| match range.split_once('-') {
                Some((a, b)) => {
                    (a.parse::<u16>().unwrap_or(u16::MAX)..=b.parse().unwrap_or(0)).contains(&slot)
                }
                None => range.parse::<u16>() == Ok(slot),
            });
            if serves {
                let port = f[1].split(['@', ':']).nth(1)?.parse().ok()?;
                return Some((port, f[0].to_owned()));
            }
        }
        None
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("stop").arg(&self.dir).status();
    }
}

/// Requests from `key` in a loop on `gw` until `stop`, counting statuses (200, 429, other) and
/// every answer in `answered`.
fn load(
    gw: Arc<Gateway>,
    key: &'static str,
    (stop, answered): (Arc<AtomicBool>, Arc<AtomicUsize>),
) -> tokio::task::JoinHandle<[usize; 3]> {
    tokio::spawn(async move {
        let mut seen = [0; 3];
        while !stop.load(Ordering::Relaxed) {
            let reply = gw.chat(key, CHAT).await;
            answered.fetch_add(1, Ordering::Relaxed);
            let status = reply.status.as_u16();
            if status != 200 && status != 429 && seen[2] < 3 {
                eprintln!("an error answer: {status} {}", reply.text());
            }
            seen[match status {
                200 => 0,
                429 => 1,
                _ => 2,
            }] += 1;
        }
        seen
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_primary_killed_mid_load_fails_over_and_limits_hold_after() {
    let Some(_) = seeds("a_primary_killed_mid_load_fails_over") else {
        return;
    };
    let cluster = OwnCluster::start("failover");
    let up = fake_upstream().await;
    let text = format!(
        "{}[upstream]\nbase_url = \"{{upstream}}\"\n\
         [[keys]]\nid = \"busy\"\nsecret = \"sk-busy\"\norg = \"acme\"\n\
         rate_limit = {{ requests = 1000000 }}\n\
         [[keys]]\nid = \"after\"\nsecret = \"sk-after\"\norg = \"acme\"\n\
         rate_limit = {{ requests = 5, window_sec = 3600 }}\n",
        store_section(&cluster.seeds)
    );
    let gw = Arc::new(gateway(&text, &up.url()).await);
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let loads: Vec<_> = (0..4)
        .map(|_| load(gw.clone(), "sk-busy", (stop.clone(), answered.clone())))
        .collect();
    // Load flows; then the primary of acme's slot dies (kill -9).
    wait_until("load flows", || up.seen.hits() >= 50).await;
    let ports = cluster.ports();
    let (victim, _) = cluster.primary_of("org:acme", ports[0]);
    let pid =
        std::fs::read_to_string(cluster.dir.join(victim.to_string()).join("redis.pid")).unwrap();
    assert!(
        Command::new("kill")
            .args(["-9", pid.trim()])
            .status()
            .unwrap()
            .success()
    );
    let survivor = *ports.iter().find(|&&p| p != victim).unwrap();
    // Until a replica serves the slot: the cluster reports itself ok again from a survivor.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = cluster.cli(survivor, &["cluster", "info"]);
        let moved = cluster
            .serving("org:acme", survivor)
            .is_some_and(|(port, _)| port != victim);
        if info.contains("cluster_state:ok") && moved {
            break;
        }
        assert!(Instant::now() < deadline, "no failover: {info}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Requests go on (fail open meanwhile); once the gateway's breaker closes, a fresh key's
    // limit holds exactly again.
    let hits_at_failover = up.seen.hits();
    let deadline = Instant::now() + Duration::from_secs(30);
    while up.seen.hits() < hits_at_failover + 50 {
        assert!(
            Instant::now() < deadline,
            "requests stopped flowing after the failover"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = gw.chat("sk-after", CHAT).await;
        if r.header("x-ratelimit-limit-requests").is_some() {
            // The first enforced decision: one of the 5 taken.
            assert_eq!(r.status, 200);
            break;
        }
        assert!(Instant::now() < deadline, "limits never enforced again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let statuses: Vec<u16> = {
        let mut s = Vec::new();
        for _ in 0..6 {
            s.push(gw.chat("sk-after", CHAT).await.status.as_u16());
        }
        s
    };
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429]);
    stop.store(true, Ordering::Relaxed);
    let mut seen = [0; 3];
    for l in loads {
        let s = l.await.unwrap();
        for i in 0..3 {
            seen[i] += s[i];
        }
    }
    assert_eq!(seen[2], 0, "no caller saw an error: {seen:?}");
    assert_eq!(
        seen[1], 0,
        "the busy key was never over its limit: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_moved_under_load_shows_callers_no_error_and_the_limit_holds() {
    let Some(_) = seeds("a_slot_moved_under_load") else {
        return;
    };
    let cluster = OwnCluster::start("reshard");
    // The count read at the end is exact only within one hour's window: the move and its waits
    // take well under two minutes.
    early_in_a_window(Duration::from_secs(3600), Duration::from_secs(120)).await;
    let up = fake_upstream().await;
    let text = format!(
        "{}[upstream]\nbase_url = \"{{upstream}}\"\n\
         [[keys]]\nid = \"mover\"\nsecret = \"sk-mover\"\norg = \"acme\"\n\
         rate_limit = {{ requests = 100000, window_sec = 3600 }}\n",
        store_section(&cluster.seeds)
    );
    let gw = Arc::new(gateway(&text, &up.url()).await);
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let loads: Vec<_> = (0..4)
        .map(|_| load(gw.clone(), "sk-mover", (stop.clone(), answered.clone())))
        .collect();
    // Answers flowing (a limit no load reaches: every request is decided by the store, none
    // from the refusal cache, all through the move).
    let flowing = |n: usize| {
        let answered = answered.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            let from = answered.load(Ordering::Relaxed);
            while answered.load(Ordering::Relaxed) < from + n {
                assert!(Instant::now() < deadline, "answers stopped");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    flowing(20).await;
    // acme's slot, from its primary to another, by `redis-cli --cluster reshard` (slot by slot,
    // key by key with MIGRATE: the ASK window) while requests flow. It moves the source's
    // lowest slots first: as many as reach acme's.
    let ports = cluster.ports();
    let (from, from_id) = cluster.primary_of("org:acme", ports[0]);
    let slot: u16 = cluster
        .cli(from, &["cluster", "keyslot", "{org:acme}"])
        .trim()
        .parse()
        .unwrap();
    let nodes = cluster.cli(from, &["cluster", "nodes"]);
    let source = nodes.lines().find(|l| l.starts_with(&from_id)).unwrap();
    let first: u16 = source
        .split_whitespace()
        .skip(8)
        .filter_map(|r| r.split('-').next()?.parse().ok())
        .filter(|&start| start <= slot)
        .max()
        .unwrap();
    let to_id = nodes
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f[2].contains("master") && f[0] != from_id)
        .map(|f| f[0].to_owned())
        .unwrap();
    let count = (slot - first + 1).to_string();
    let moved = tokio::task::spawn_blocking(move || {
        Command::new("redis-cli")
            .args(["--cluster", "reshard", &format!("127.0.0.1:{from}")])
            .args(["--cluster-from", &from_id, "--cluster-to", &to_id])
            .args(["--cluster-slots", &count, "--cluster-yes"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        moved.status.success(),
        "{}",
        String::from_utf8_lossy(&moved.stdout)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.primary_of("org:acme", ports[0]).0 == from {
        assert!(Instant::now() < deadline, "the slot never moved");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    flowing(20).await;
    stop.store(true, Ordering::Relaxed);
    let mut seen = [0; 3];
    for l in loads {
        let s = l.await.unwrap();
        for i in 0..3 {
            seen[i] += s[i];
        }
    }
    assert_eq!(seen[2], 0, "no caller saw an error: {seen:?}");
    // Every answer was a decision: the window (an hour, so that none rolls over here) counts
    // exactly what was admitted across the move, none lost, none twice.
    let admitted = seen[0];
    assert_eq!(seen[1], 0, "{seen:?}");
    let r = gw.chat("sk-mover", CHAT).await;
    let left: usize = r
        .header("x-ratelimit-remaining-requests")
        .expect("enforced after the move")
        .parse()
        .unwrap();
    let after = usize::from(r.status == 200);
    assert_eq!(
        admitted + after + left,
        100_000,
        "the window counts exactly what was admitted across the move: {seen:?}, {left} left"
    );
}
