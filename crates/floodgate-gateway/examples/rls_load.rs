//! A load generator for `floodgate rls`: `ShouldRateLimit` calls with two descriptors, from
//! `--connections` HTTP/2 connections with `--concurrency` calls in flight, for `--secs`;
//! prints calls per second, how they were answered and the calls' p50 and p99 latency
//! (docs/envoy.md, the benchmark; `scripts/bench-rls` runs it beside the gateway's load).
//!
//! ```text
//! floodgate rls --config bench.yaml &
//! cargo run --release --features rls --example rls_load -- 127.0.0.1:8081 10 64 4
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

fn descriptor(key: &str, value: String) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: vec![Entry {
            key: key.into(),
            value,
        }],
        ..RateLimitDescriptor::default()
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let addr = arg(0, "127.0.0.1:8081");
    let secs: u64 = arg(1, "10").parse()?;
    let concurrency: usize = arg(2, "64").parse()?;
    let connections: usize = arg(3, "4").parse()?;
    let mut clients = Vec::new();
    for _ in 0..connections {
        clients.push(RateLimitServiceClient::connect(format!("http://{addr}")).await?);
    }
    let (ok, over, failed) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let started = Instant::now();
    let until = started + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for i in 0..concurrency {
        let mut client = clients[i % connections].clone();
        let (ok, over, failed) = (Arc::clone(&ok), Arc::clone(&over), Arc::clone(&failed));
        tasks.push(tokio::spawn(async move {
            let mut n: u64 = 0;
            // Each call's latency, in microseconds.
            let mut took = Vec::new();
            while Instant::now() < until {
                n += 1;
                // 1 024 tenants and 16 routes: many counters, none refusing.
                let req = RateLimitRequest {
                    domain: "bench".into(),
                    descriptors: vec![
                        descriptor("tenant", format!("t{}", (n * 31 + i as u64) % 1024)),
                        descriptor("route", format!("/r{}", n % 16)),
                    ],
                    hits_addend: 1,
                };
                let sent = Instant::now();
                let answer = client.should_rate_limit(req).await;
                took.push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
                match answer {
                    Ok(r) if r.get_ref().overall_code == 1 => ok.fetch_add(1, Ordering::Relaxed),
                    Ok(_) => over.fetch_add(1, Ordering::Relaxed),
                    Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
            took
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await?);
    }
    latencies.sort_unstable();
    let percentile = |p: usize| {
        let at = (latencies.len() * p / 100).min(latencies.len().saturating_sub(1));
        f64::from(latencies.get(at).copied().unwrap_or(0)) / 1000.0
    };
    let took = started.elapsed().as_secs_f64();
    let (ok, over, failed) = (
        ok.load(Ordering::Relaxed),
        over.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
    );
    println!(
        "{:.0} calls/s ({} OK, {} OVER_LIMIT, {} errors in {took:.1} s; {concurrency} in flight on {connections} connections), p50 {:.3} ms, p99 {:.3} ms",
        (ok + over + failed) as f64 / took,
        ok,
        over,
        failed,
        percentile(50),
        percentile(99)
    );
    Ok(())
}
