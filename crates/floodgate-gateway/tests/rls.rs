//! `floodgate rls`: the generated tonic client against the service, in process on the memory
//! store, as three processes on one Redis and as a process whose Redis is down (failing open and
//! closed); envoyproxy/ratelimit's README examples as fixtures (`tests/rls-configs/`) and one bad
//! config per refusal (`tests/rls-bad-configs/`, each naming its expected error on its first
//! line).
#![cfg(feature = "rls")]
#![allow(missing_docs)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::UInt64Value;
use floodgate::Timestamp;
use floodgate::clock::FakeClock;
use floodgate::store::{AnyStore, MemoryStore};
use floodgate_gateway::rls::metrics::RlsMetrics;
use floodgate_gateway::rls::reload::Reloader;
use floodgate_gateway::rls::{Rls, RlsConfig};
use tonic::transport::Channel;

mod common;
use common::free_port;

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rls-configs")
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

fn request(domain: &str, descriptors: &[&[(&str, &str)]]) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: descriptors.iter().map(|d| descriptor(d)).collect(),
        hits_addend: 0,
    }
}

struct Service {
    client: RateLimitServiceClient<Channel>,
    rls: Arc<Rls>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Service {
    async fn call(&mut self, req: RateLimitRequest) -> RateLimitResponse {
        self.client
            .should_rate_limit(req)
            .await
            .unwrap()
            .into_inner()
    }

    /// The overall codes of `n` calls of `req`.
    async fn codes(&mut self, req: &RateLimitRequest, n: usize) -> Vec<i32> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(self.call(req.clone()).await.overall_code);
        }
        out
    }
}

/// The service in process, on the memory store, with every file of `files` in a directory.
async fn service(files: &[&str]) -> (Service, tempdir::Dir) {
    let dir = tempdir::Dir::new();
    for f in files {
        std::fs::copy(fixtures().join(f), dir.path().join(f)).unwrap();
    }
    let config = RlsConfig::load(dir.path()).unwrap();
    (start(config).await, dir)
}

async fn start(config: RlsConfig) -> Service {
    start_with(Rls::new(config, frozen_store(), RlsMetrics::new())).await
}

/// A memory store whose clock stands still, a quarter of a second into a second: every call
/// of a test falls in one bucket of every window (per second ones too), wherever the wall
/// clock is.
fn frozen_store() -> AnyStore {
    let clock = FakeClock::new(Timestamp::from_millis(1_700_000_000_250));
    AnyStore::Memory(MemoryStore::with_clock(clock))
}

async fn start_with(rls: Rls) -> Service {
    let rls = Arc::new(rls);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(floodgate_gateway::rls::run(
        listener,
        Arc::clone(&rls),
        async {
            let _ = stopped.await;
        },
    ));
    let client = RateLimitServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    Service {
        client,
        rls,
        _stop: stop,
    }
}

/// A throwaway directory, removed on drop.
mod tempdir {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> Dir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "floodgate-rls-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::SeqCst)
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn every_readme_example_loads_and_share_threshold_is_refused() {
    for entry in std::fs::read_dir(fixtures()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let loaded = RlsConfig::load(&path);
        if name.starts_with("readme-example11") {
            let e = loaded.unwrap_err().to_string();
            assert!(
                e.contains("share_threshold is not supported"),
                "{name}: {e}"
            );
        } else {
            assert!(loaded.is_ok(), "{name}: {loaded:?}");
        }
    }
}

#[test]
fn the_shipped_examples_load() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    for f in ["rls.yaml", "rls-bench.yaml"] {
        let c = RlsConfig::load(&examples.join(f)).unwrap();
        assert_eq!(c.domains().len(), 1, "{f}");
    }
}

#[test]
fn bad_configs_name_file_line_and_field() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rls-bad-configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let want = text
            .lines()
            .next()
            .unwrap()
            .strip_prefix("# error: ")
            .unwrap();
        let e = RlsConfig::load(&path).unwrap_err().to_string();
        let expected = format!("{}{want}", path.display());
        assert!(e.starts_with(&expected), "{e}\nwanted {expected}");
        seen += 1;
    }
    assert!(seen >= 10);
}

#[test]
fn empty_fields_are_read_as_envoyproxy_ratelimit_reads_them() {
    // yaml.v2 reads an empty `rate_limit:` as no rule, an empty `replaces:` as none and an
    // empty `unit:` as no unit: envoyproxy/ratelimit loads these files, and so must floodgate.
    let c = RlsConfig::parse(
        Path::new("d.yaml"),
        "domain: d\ndescriptors:\n  - key: placeholder\n    rate_limit:\n      # unit: second\n      # requests_per_unit: 10\n  - key: free\n    rate_limit:\n      unlimited: true\n      unit:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: 5\n      replaces:\n",
    )
    .unwrap();
    assert_eq!(c.lookup("d", [("placeholder", "x")]), None);
    let free = c.lookup("d", [("free", "x")]).unwrap();
    assert_eq!(free.limit, None);
    let k = c.lookup("d", [("k", "x")]).unwrap();
    assert!(k.limit.is_some() && k.replaces.is_empty(), "{k:?}");
}

#[test]
fn a_directory_with_one_domain_twice_is_refused() {
    let dir = tempdir::Dir::new();
    for f in ["readme-example09-12.yaml", "readme-example09-13.yaml"] {
        std::fs::copy(fixtures().join(f), dir.path().join(f)).unwrap();
    }
    let e = RlsConfig::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("duplicate domain 'example9'"), "{e}");
}

#[tokio::test]
async fn the_most_specific_match_decides() {
    // Example 1 and 3: key and value before key alone; a value the config lists with 0 refuses.
    let (mut s, _dir) = service(&["readme-example01-3.yaml", "readme-example03-5.yaml"]).await;
    let any = request("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.1")]]);
    let codes = s.codes(&any, 11).await;
    assert_eq!(codes[..10], [OK; 10]);
    assert_eq!(codes[10], OVER, "10 a second");
    let other = request("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.2")]]);
    assert_eq!(s.call(other).await.overall_code, OK, "each address its own");
    let blocked = request("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.5")]]);
    let r = s.call(blocked).await;
    assert_eq!(r.overall_code, OVER);
    let st = &r.statuses[0];
    assert_eq!(st.current_limit.as_ref().unwrap().requests_per_unit, 0);
    // Unknown value of a key listed only with values: no rule, not limited.
    let unlisted = request("mongo_cps", &[&[("database", "orders")]]);
    let r = s.call(unlisted).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].current_limit.clone()),
        (OK, None)
    );
    let unknown = request("nowhere", &[&[("database", "users")]]);
    assert_eq!(s.call(unknown).await.overall_code, OK);
}

#[tokio::test]
async fn nested_descriptors_are_decided_together_and_a_refusal_charges_none() {
    // Example 2: 5 marketing messages a day to a number, 100 messages a day to it.
    let (mut s, _dir) = service(&["readme-example02-4.yaml"]).await;
    let both = request(
        "messaging",
        &[
            &[("message_type", "marketing"), ("to_number", "2061111111")],
            &[("to_number", "2061111111")],
        ],
    );
    for i in 0..5 {
        let r = s.call(both.clone()).await;
        assert_eq!(r.overall_code, OK, "call {i}");
        assert_eq!(r.statuses[0].limit_remaining, 4 - i);
        assert_eq!(r.statuses[1].limit_remaining, 99 - i);
    }
    let r = s.call(both.clone()).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(r.statuses[0].code, OVER);
    assert_eq!(r.statuses[1].code, OK);
    assert_eq!(
        r.statuses[1].limit_remaining, 95,
        "the refused call charged nothing"
    );
    // The refusal's wait is the sliding window's (docs/design.md §1): the
    // five calls, weighed as the previous day's, must leave room for one, so
    // it runs past the next day's start by up to a fifth of a day: at most
    // `(W - e) + W * (1 - 4/5)`, whatever the wall clock reads.
    let wait = r.statuses[0].duration_until_reset.unwrap();
    assert!(
        wait.seconds > 0 && wait.seconds <= 86_400 * 6 / 5,
        "{wait:?}"
    );
    let header = |name: &str| {
        r.response_headers_to_add
            .iter()
            .find(|h| h.key == name)
            .map(|h| h.value.clone())
    };
    assert_eq!(header("x-ratelimit-limit").as_deref(), Some("5"));
    assert_eq!(header("x-ratelimit-remaining").as_deref(), Some("0"));
    assert_eq!(
        header("ratelimit-policy").as_deref(),
        Some("\"message_type.to_number\";q=5;w=86400")
    );
    assert!(header("retry-after").is_some() && header("retry-after-ms").is_some());
    // The other number's counters are its own.
    let single = request("messaging", &[&[("to_number", "2062222222")]]);
    let r = s.call(single).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 99));
    // Example 4: a rule applies at its own depth only.
    let (mut s, _dir) = service(&["readme-example04-6.yaml"]).await;
    let deeper = request("example4", &[&[("key", "value"), ("subkey", "subvalue")]]);
    let r = s.call(deeper).await;
    assert_eq!(r.statuses[0].current_limit, None);
}

#[tokio::test]
async fn unlimited_shadow_mode_and_wildcards() {
    let (mut s, _dir) = service(&[
        "readme-example05-8.yaml",
        "readme-example06-9.yaml",
        "readme-example09-13.yaml",
    ])
    .await;
    let ldap = s.call(request("internal", &[&[("ldap", "x")]])).await;
    assert_eq!(
        (ldap.overall_code, ldap.statuses[0].limit_remaining),
        (OK, u32::MAX)
    );
    // Example 6: user-a's 10 a second is a shadow limit; user-b's 20 is enforced.
    let a = request("example6", &[&[("service", "auth"), ("user", "user-a")]]);
    let codes = s.codes(&a, 15).await;
    assert_eq!(codes, [OK; 15], "shadow mode never refuses");
    let b = request("example6", &[&[("service", "auth"), ("user", "user-b")]]);
    let codes = s.codes(&b, 21).await;
    assert_eq!(codes.iter().filter(|&&c| c == OVER).count(), 1);
    // Example 9: `/api/*/action`.
    let hit = request("example9", &[&[("path", "/api/12/action")]]);
    assert_eq!(
        s.call(hit).await.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(20)
    );
    let miss = request("example9", &[&[("path", "/api/12/other")]]);
    assert_eq!(s.call(miss).await.statuses[0].current_limit, None);
}

#[tokio::test]
async fn a_star_matches_any_run_in_a_value_and_only_itself_in_a_key() {
    let (mut s, _dir) = service(&["star-in-a-key.yaml"]).await;
    let limit = |r: &RateLimitResponse| {
        r.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit)
    };
    // Before, a key `a*` matched any key starting with `a`.
    let r = s.call(request("stars", &[&[("abc", "x")]])).await;
    assert_eq!(limit(&r), None);
    let r = s.call(request("stars", &[&[("a*", "x")]])).await;
    assert_eq!(limit(&r), Some(1));
    let r = s.call(request("stars", &[&[("b", "xyz")]])).await;
    assert_eq!(limit(&r), Some(2));
    let r = s.call(request("stars", &[&[("b", "y")]])).await;
    assert_eq!(limit(&r), None);
}

#[tokio::test]
async fn replaces_drops_the_named_rule_and_leaves_its_counter_alone() {
    // Example 7.
    let (mut s, _dir) = service(&["readme-example07-10.yaml"]).await;
    let both = request(
        "example7",
        &[
            &[("key_1", "value_1"), ("user", "bkthomps")],
            &[("key_2", "value_2"), ("user", "bkthomps")],
        ],
    );
    let codes = s.codes(&both, 11).await;
    assert_eq!(codes[..10], [OK; 10], "10 a second, not 5");
    assert_eq!(codes[10], OVER);
    let r = s.call(both).await;
    assert_eq!(r.statuses[0].current_limit, None, "replaced");
    let specific = request("example7", &[&[("key_1", "value_1"), ("user", "bkthomps")]]);
    let r = s.call(specific).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (OK, 4),
        "its 5 a second untouched"
    );
}

#[tokio::test]
async fn hits_addend_is_the_cost() {
    let (mut s, _dir) = service(&["readme-example03-5.yaml"]).await;
    let mut req = request("edge_proxy_per_ip", &[&[("remote_address", "10.0.0.1")]]);
    req.hits_addend = 4;
    assert_eq!(
        s.codes(&req, 3).await,
        [OK, OK, OVER],
        "4 + 4 fit 10, 12 do not"
    );
    // A descriptor's own hits_addend wins; 0 checks without charging.
    let mut check = req.clone();
    check.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    let r = s.call(check).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 2));
    let mut two = req.clone();
    two.descriptors[0].hits_addend = Some(UInt64Value { value: 2 });
    assert_eq!(s.codes(&two, 2).await, [OK, OVER]);
    // A cost above the limit can never pass.
    let mut huge = request("edge_proxy_per_ip", &[&[("remote_address", "10.0.0.2")]]);
    huge.hits_addend = 11;
    assert_eq!(s.call(huge).await.overall_code, OVER);
    // The request's 0 means 1.
    let zero = request("edge_proxy_per_ip", &[&[("remote_address", "10.0.0.3")]]);
    let r = s.call(zero).await;
    assert_eq!(r.statuses[0].limit_remaining, 9);
}

#[tokio::test]
async fn the_headers_name_the_policy_as_a_structured_string_and_a_call_no_wait_cures_no_time() {
    // The library's rendering (floodgate::http), as the gateway's and the tower layer's.
    let config = RlsConfig::parse(
        Path::new("d.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      name: 'per \"k\"'\n      unit: minute\n      requests_per_unit: 2\n",
    )
    .unwrap();
    let mut s = start(config).await;
    let header = |r: &RateLimitResponse, name: &str| {
        r.response_headers_to_add
            .iter()
            .find(|h| h.key == name)
            .map(|h| h.value.clone())
    };
    let r = s.call(request("d", &[&[("k", "a")]])).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(
        header(&r, "ratelimit-policy").as_deref(),
        Some(r#""per \"k\"";q=2;w=60"#)
    );
    let state = header(&r, "ratelimit").unwrap();
    assert!(state.starts_with(r#""per \"k\"";r=1;t="#), "{state}");
    // A cost above the limit: refused, and no wait cures it, so no time to retry at.
    let mut huge = request("d", &[&[("k", "a")]]);
    huge.hits_addend = 3;
    let r = s.call(huge).await;
    assert_eq!(r.overall_code, OVER);
    let state = header(&r, "ratelimit").unwrap();
    assert!(
        state.starts_with(r#""per \"k\"";r="#) && !state.contains(";t="),
        "{state}"
    );
    assert_eq!(header(&r, "retry-after"), None);
    assert_eq!(header(&r, "retry-after-ms"), None);
    assert_eq!(header(&r, "x-ratelimit-limit").as_deref(), Some("2"));
}

#[tokio::test]
async fn descriptors_of_different_costs_are_one_atomic_decision() {
    let (mut s, _dir) = service(&["readme-example05-8.yaml"]).await;
    // Two counters of 100 a minute (`azure` matches any value), each descriptor its own cost.
    let call = |a: u64, b: u64| {
        let mut req = request("internal", &[&[("azure", "a")], &[("azure", "b")]]);
        req.descriptors[0].hits_addend = Some(UInt64Value { value: a });
        req.descriptors[1].hits_addend = Some(UInt64Value { value: b });
        req
    };
    let r = s.call(call(1, 90)).await;
    assert_eq!(r.overall_code, OK);
    let left: Vec<u32> = r.statuses.iter().map(|st| st.limit_remaining).collect();
    assert_eq!(left, [99, 10]);
    // b cannot take 20 more: the call is refused, and a is charged nothing either.
    let r = s.call(call(1, 20)).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!((r.statuses[0].code, r.statuses[1].code), (OK, OVER));
    let r = s.call(call(0, 0)).await;
    let left: Vec<u32> = r.statuses.iter().map(|st| st.limit_remaining).collect();
    assert_eq!(left, [99, 10], "the refused call charged neither counter");
    // Both fit: both charged, each its own cost.
    let r = s.call(call(2, 10)).await;
    assert_eq!(r.overall_code, OK);
    let left: Vec<u32> = r.statuses.iter().map(|st| st.limit_remaining).collect();
    assert_eq!(left, [97, 0]);
}

/// `descriptor` with Envoy's `limit` override.
fn overridden(entries: &[(&str, &str)], n: u32, unit: RateLimitUnit) -> RateLimitDescriptor {
    RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit: n,
            unit: unit as i32,
        }),
        ..descriptor(entries)
    }
}

fn call_of(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

const OVERRIDES: &str = "domain: d
descriptors:
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: watched
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: base
    rate_limit: {unit: hour, requests_per_unit: 100, name: base}
  - key: special
    rate_limit: {unit: hour, requests_per_unit: 50, replaces: [{name: base}]}
";

#[tokio::test]
async fn a_limit_override_replaces_the_rule_for_that_call() {
    let mut s = start(RlsConfig::parse(Path::new("d.yaml"), OVERRIDES).unwrap()).await;
    let three = call_of("d", vec![overridden(&[("k", "a")], 3, RateLimitUnit::Hour)]);
    let r = s.call(three.clone()).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 2));
    let limit = r.statuses[0].current_limit.clone().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit, limit.name.as_str()),
        (3, 3, "")
    );
    let header = |r: &RateLimitResponse, name: &str| {
        r.response_headers_to_add
            .iter()
            .find(|h| h.key == name)
            .map(|h| h.value.clone())
    };
    assert_eq!(header(&r, "x-ratelimit-limit").as_deref(), Some("3"));
    assert_eq!(
        header(&r, "ratelimit-policy").as_deref(),
        Some("\"k\";q=3;w=3600")
    );
    assert_eq!(s.codes(&three, 3).await, [OK, OK, OVER]);
    // The counter is the rule's of that unit (the entries and the window), as
    // envoyproxy/ratelimit's cache key: the config's 10 an hour sees the 3 taken.
    let plain = request("d", &[&[("k", "a")]]);
    assert_eq!(s.call(plain).await.statuses[0].limit_remaining, 10 - 3 - 1);
    // Another unit is another counter.
    let per_minute = call_of(
        "d",
        vec![overridden(&[("k", "a")], 5, RateLimitUnit::Minute)],
    );
    let r = s.call(per_minute).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 4));
}

#[tokio::test]
async fn a_limit_override_applies_without_a_rule_and_is_never_shadow_or_replacing() {
    let mut s = start(RlsConfig::parse(Path::new("d.yaml"), OVERRIDES).unwrap()).await;
    // No rule matches ("nothing"): the override limits it, as envoyproxy/ratelimit does.
    let unmatched = call_of(
        "d",
        vec![overridden(&[("nothing", "x")], 1, RateLimitUnit::Hour)],
    );
    assert_eq!(s.codes(&unmatched, 2).await, [OK, OVER]);
    // An unknown domain limits nothing, override or not.
    let elsewhere = call_of(
        "nowhere",
        vec![overridden(&[("k", "a")], 0, RateLimitUnit::Hour)],
    );
    let r = s.call(elsewhere).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].current_limit.clone()),
        (OK, None)
    );
    // The shadow rule's descriptor, overridden, is enforced.
    let watched = call_of(
        "d",
        vec![overridden(&[("watched", "x")], 1, RateLimitUnit::Hour)],
    );
    assert_eq!(s.codes(&watched, 2).await, [OK, OVER]);
    // The rule that an override stands in for replaces nothing: `base` stays in force.
    let both = |over: bool| {
        let special = if over {
            overridden(&[("special", "x")], 5, RateLimitUnit::Hour)
        } else {
            descriptor(&[("special", "x")])
        };
        call_of("d", vec![special, descriptor(&[("base", "y")])])
    };
    let r = s.call(both(false)).await;
    assert_eq!(
        r.statuses[1].current_limit, None,
        "replaced by special's rule"
    );
    let r = s.call(both(true)).await;
    let base = r.statuses[1]
        .current_limit
        .clone()
        .map(|l| l.requests_per_unit);
    assert_eq!((base, r.statuses[1].limit_remaining), (Some(100), 99));
    // Two overrides of one counter in one call: the stricter decides.
    let twice = call_of(
        "d",
        vec![
            overridden(&[("k", "b")], 10, RateLimitUnit::Hour),
            overridden(&[("k", "b")], 1, RateLimitUnit::Hour),
        ],
    );
    assert_eq!(s.codes(&twice, 2).await, [OK, OVER]);
}

#[tokio::test]
async fn a_limit_override_in_an_unsupported_unit_is_an_invalid_argument_and_charges_nothing() {
    let mut s = start(RlsConfig::parse(Path::new("d.yaml"), OVERRIDES).unwrap()).await;
    for (unit, name) in [
        (RateLimitUnit::Month, "MONTH"),
        (RateLimitUnit::Unknown, "UNKNOWN"),
    ] {
        let bad = call_of(
            "d",
            vec![
                descriptor(&[("k", "c")]),
                overridden(&[("k", "d")], 3, unit),
            ],
        );
        let e = s.client.should_rate_limit(bad).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            e.message(),
            format!(
                "descriptors[1].limit.unit: {name} is not supported (SECOND, MINUTE, HOUR or DAY)"
            )
        );
    }
    let r = s.call(request("d", &[&[("k", "c")]])).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 9,
        "the refused calls charged nothing"
    );
}

#[tokio::test]
async fn global_shadow_mode_answers_ok_decides_as_usual_and_counts() {
    let config = RlsConfig::parse(
        Path::new("d.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: route\n    rate_limit: {unit: hour, requests_per_unit: 100}\n",
    )
    .unwrap();
    let rls = Rls::new(config, frozen_store(), RlsMetrics::new()).with_global_shadow(true);
    let mut s = start_with(rls).await;
    let both = request("d", &[&[("k", "a")], &[("route", "/r")]]);
    assert_eq!(s.codes(&both, 2).await, [OK, OK]);
    let r = s.call(both.clone()).await;
    assert_eq!(r.overall_code, OK, "would be refused: answered OK");
    // The statuses say what was decided, as envoyproxy/ratelimit leaves them.
    assert_eq!(
        (r.statuses[0].code, r.statuses[0].limit_remaining),
        (OVER, 0)
    );
    assert_eq!(r.statuses[1].code, OK);
    let keys: Vec<&str> = r
        .response_headers_to_add
        .iter()
        .map(|h| h.key.as_str())
        .collect();
    assert!(keys.contains(&"x-ratelimit-remaining"), "{keys:?}");
    assert!(
        !keys.contains(&"retry-after") && !keys.contains(&"retry-after-ms"),
        "the call passes: no wait to tell, {keys:?}"
    );
    // Decided as enforcing would: the call it would refuse charged nothing.
    let route = s.call(request("d", &[&[("route", "/r")]])).await;
    assert_eq!(route.statuses[0].limit_remaining, 100 - 3);
    let text = s.rls.metrics().encode();
    for series in [
        "floodgate_rls_requests_total{code=\"shadow_over_limit\"} 1",
        "floodgate_rls_requests_total{code=\"over_limit\"} 0",
        "floodgate_rls_descriptors_total{outcome=\"shadow_over\"} 1",
        "floodgate_rls_descriptors_total{outcome=\"over\"} 0",
    ] {
        assert!(text.lines().any(|l| l == series), "no {series} in:\n{text}");
    }
}

#[tokio::test]
async fn a_replaced_rule_that_is_unlimited_answers_unlimited_as_envoy_does() {
    let config = RlsConfig::parse(
        Path::new("d.yaml"),
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, name: u}\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 5, replaces: [{name: u}]}\n",
    )
    .unwrap();
    let mut s = start(config).await;
    let r = s.call(request("d", &[&[("a", "x")], &[("b", "y")]])).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
    assert_eq!(r.statuses[1].limit_remaining, 4);
}

#[tokio::test]
async fn beside_a_descriptor_that_never_passes_the_others_report_their_own_state() {
    let config = RlsConfig::parse(
        Path::new("d.yaml"),
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 0}\n",
    )
    .unwrap();
    let mut s = start(config).await;
    let a = request("d", &[&[("a", "x")]]);
    assert_eq!(s.codes(&a, 2).await, [OK, OK]);
    let r = s.call(request("d", &[&[("a", "x")], &[("b", "y")]])).await;
    assert_eq!((r.overall_code, r.statuses[1].code), (OVER, OVER));
    // `a` was not charged (the call was refused), and is spent: what it says, not a full limit.
    let st = &r.statuses[0];
    assert_eq!((st.code, st.limit_remaining), (OK, 0));
    assert_ne!(st.duration_until_reset.as_ref().map(|d| d.seconds), Some(0));
}

#[tokio::test]
async fn every_limit_a_call_can_never_pass_refuses_it() {
    let config = RlsConfig::parse(
        Path::new("d.yaml"),
        "domain: d\ndescriptors:\n  - key: ip\n    value: 10.0.0.1\n    rate_limit: {unit: hour, requests_per_unit: 0}\n  - key: agent\n    value: bot\n    rate_limit: {unit: hour, requests_per_unit: 0}\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n",
    )
    .unwrap();
    let mut s = start(config).await;
    let codes = |r: &RateLimitResponse| -> Vec<(i32, u32)> {
        r.statuses
            .iter()
            .map(|st| (st.code, st.limit_remaining))
            .collect()
    };
    // Two blocked values in one call: each refuses it, as each does alone.
    let blocked = request("d", &[&[("ip", "10.0.0.1")], &[("agent", "bot")]]);
    let r = s.call(blocked).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(codes(&r), [(OVER, 0), (OVER, 0)]);
    // A cost above two limits: each refuses it; the third, which it fits, says its state.
    let mut huge = request(
        "d",
        &[&[("k", "x")], &[("agent", "bot")], &[("agent", "ok")]],
    );
    huge.hits_addend = 6;
    let r = s.call(huge).await;
    assert_eq!(codes(&r)[..2], [(OVER, 0), (OVER, 0)]);
    let metrics = s.rls.metrics().encode();
    assert!(
        metrics.contains("floodgate_rls_descriptors_total{outcome=\"over\"} 4"),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_binary_runs_in_global_shadow_mode_by_flag_or_by_shadow_mode() {
    let dir = tempdir::Dir::new();
    let file = dir.path().join("limits.yaml");
    std::fs::write(
        &file,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 0}\n",
    )
    .unwrap();
    let req = request("d", &[&[("k", "a")]]);
    for (flags, env) in [
        (&["--shadow"][..], &[][..]),
        (&[][..], &[("SHADOW_MODE", "true")][..]),
        (&[][..], &[("SHADOW_MODE", "false")][..]),
    ] {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let _process = spawn_rls_env(&file, addr, flags, env);
        let r = connect(addr).await.should_rate_limit(req.clone()).await;
        let r = r.unwrap().into_inner();
        let want = if env == [("SHADOW_MODE", "false")] {
            OVER
        } else {
            OK
        };
        assert_eq!(
            (r.overall_code, r.statuses[0].code),
            (want, OVER),
            "{flags:?} {env:?}"
        );
    }
}

#[test]
fn the_binary_refuses_a_shadow_mode_that_is_not_a_boolean() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["rls", "--listen", "127.0.0.1:0", "--config"])
        .arg(fixtures().join("readme-example02-4.yaml"))
        .env("SHADOW_MODE", "sometimes")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("SHADOW_MODE: 'sometimes' is not a boolean (true or false)"),
        "{err}"
    );
}

#[tokio::test]
async fn a_bad_request_is_an_invalid_argument() {
    let (mut s, _dir) = service(&["readme-example03-5.yaml"]).await;
    let empty = request("edge_proxy_per_ip", &[]);
    let e = s.client.should_rate_limit(empty).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn a_call_of_more_descriptors_than_one_admission_holds_is_an_invalid_argument() {
    // 9 000 counters in one call: past what one Redis script unpacks (about 8 000 keys), so on
    // Redis the admission failed (UNAVAILABLE, or OK unchecked failing open, and counted as a
    // store error) where memory decided it. Refused the same on every store, before any.
    let text = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let config = || RlsConfig::parse(Path::new("d.yaml"), text).unwrap();
    let mut stores = vec![("memory", frozen_store())];
    if let Some(url) = redis_url() {
        let redis = floodgate::store::redis::RedisStore::connect(
            floodgate::store::redis::RedisConfig::new(url),
        )
        .await
        .unwrap();
        stores.push(("redis", AnyStore::Redis(redis)));
    }
    for (name, store) in stores {
        let mut s = start_with(Rls::new(config(), store, RlsMetrics::new())).await;
        let mut many = request("d", &[]);
        for i in 0..9_000 {
            many.descriptors
                .push(descriptor(&[("k", &format!("{name}-{i}"))]));
        }
        let e = match s.client.should_rate_limit(many).await {
            Ok(r) => panic!("{name}: answered {:?}", r.get_ref().overall_code),
            Err(e) => e,
        };
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}: {e:?}");
        assert!(e.message().contains("at most 1024"), "{name}: {e:?}");
        let metrics = s.rls.metrics().encode();
        assert!(
            metrics.contains("floodgate_store_errors_total{op=\"admit\"} 0"),
            "{name}: {metrics}"
        );
        // As many as the bound holds are decided.
        let mut bound = request("d", &[]);
        for i in 0..1024 {
            bound
                .descriptors
                .push(descriptor(&[("k", &format!("{name}-{i}"))]));
        }
        let r = s.call(bound).await;
        assert_eq!((r.overall_code, r.statuses.len()), (OK, 1024), "{name}");
    }
}

/// Polls `f` until it holds, for up to 10 s: waits for an event, not for a time.
async fn eventually(mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(Instant::now() < deadline, "never happened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn reload_is_whole_or_nothing_and_a_changed_file_is_seen() {
    let dir = tempdir::Dir::new();
    let file = dir.path().join("limits.yaml");
    let limits = |n: u32| {
        format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: {n}}}\n"
        )
    };
    std::fs::write(&file, limits(3)).unwrap();
    let loaded = floodgate_gateway::rls::reload::snapshot(dir.path());
    let mut s = start(RlsConfig::load(dir.path()).unwrap()).await;
    let req = request("d", &[&[("k", "v")]]);
    assert_eq!(s.call(req.clone()).await.statuses[0].limit_remaining, 2);
    let reloader = Reloader::new(dir.path().to_owned(), Arc::clone(&s.rls), loaded);
    std::fs::write(dir.path().join("broken.yaml"), "domain: e\nbogus: 1\n").unwrap();
    let e = reloader.reload().unwrap_err().to_string();
    assert!(e.contains("broken.yaml:2: bogus: unknown field"), "{e}");
    assert_eq!(
        s.call(req.clone()).await.statuses[0].limit_remaining,
        1,
        "kept"
    );
    std::fs::remove_file(dir.path().join("broken.yaml")).unwrap();
    // The watcher sees the change; the counter keeps its count under the new size.
    let watching = tokio::spawn(async move {
        floodgate_gateway::rls::reload::watch(&reloader).await;
    });
    // One write, made before the watcher's first look or after it: seen either way, since the
    // watcher starts from how the files were when the running config was read.
    std::fs::write(&file, limits(10)).unwrap();
    eventually(async || {
        s.rls
            .config()
            .lookup("d", [("k", "v")])
            .and_then(|r| r.limit)
            .is_some_and(|(n, _)| n == 10)
    })
    .await;
    assert_eq!(s.call(req).await.statuses[0].limit_remaining, 7);
    watching.abort();
}

fn redis_url() -> Option<String> {
    match std::env::var("FLOODGATE_TEST_REDIS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("FLOODGATE_REQUIRE_REDIS").as_deref() != Ok("1"),
                "FLOODGATE_REQUIRE_REDIS=1 but FLOODGATE_TEST_REDIS_URL is not set"
            );
            eprintln!("note: FLOODGATE_TEST_REDIS_URL is not set: skipping the rls Redis test");
            None
        }
    }
}

/// `floodgate rls` as a process; killed on drop.
struct Process(std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_rls(config: &Path, listen: SocketAddr, extra: &[&str]) -> Process {
    spawn_rls_env(config, listen, extra, &[])
}

fn spawn_rls_env(
    config: &Path,
    listen: SocketAddr,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Process {
    Process(
        std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .arg("rls")
            .arg("--config")
            .arg(config)
            .arg("--listen")
            .arg(listen.to_string())
            .args(extra)
            .env_remove("FLOODGATE_REDIS_URL")
            .env_remove("SHADOW_MODE")
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A client of the service at `addr`, once it answers.
async fn connect(addr: SocketAddr) -> RateLimitServiceClient<Channel> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match RateLimitServiceClient::connect(format!("http://{addr}")).await {
            Ok(c) => return c,
            Err(e) => assert!(Instant::now() < deadline, "{addr} never answered: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_on_one_redis_admit_exactly_the_limit() {
    let Some(url) = redis_url() else { return };
    let dir = tempdir::Dir::new();
    let file = dir.path().join("limits.yaml");
    // A domain of this run only: counters of earlier runs cannot count.
    let domain = format!("concurrency-{}-{}", std::process::id(), free_port());
    std::fs::write(
        &file,
        format!(
            "domain: {domain}\ndescriptors:\n  - key: tenant\n    rate_limit: {{unit: hour, requests_per_unit: 25}}\n  - key: route\n    rate_limit: {{unit: hour, requests_per_unit: 1000}}\n"
        ),
    )
    .unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut processes = Vec::new();
    let mut addrs = Vec::new();
    for i in 0..3 {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let admin_flag = admin.to_string();
        let mut extra = vec!["--redis-url", url.as_str()];
        if i == 0 {
            extra.extend(["--admin-listen", admin_flag.as_str()]);
        }
        processes.push(spawn_rls(&file, addr, &extra));
        addrs.push(addr);
    }
    let mut clients = Vec::new();
    for a in &addrs {
        clients.push(connect(*a).await);
    }
    let req = request(&domain, &[&[("tenant", "acme")], &[("route", "/v1")]]);
    let mut calls = Vec::new();
    for i in 0..90 {
        let mut client = clients[i % 3].clone();
        let req = req.clone();
        calls.push(tokio::spawn(async move {
            client.should_rate_limit(req).await.unwrap().into_inner()
        }));
    }
    let mut admitted = 0;
    for c in calls {
        if c.await.unwrap().overall_code == OK {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 25, "exactly the limit, across three processes");
    // Refusals charged nothing: the route's counter took the 25 admitted only.
    let only_route = request(&domain, &[&[("route", "/v1")]]);
    let r = clients[1]
        .should_rate_limit(only_route)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.statuses[0].limit_remaining, 1000 - 26);
    // The first process's metrics counted its share.
    let body = http_get(admin, "/metrics").await;
    assert!(
        body.contains("floodgate_rls_requests_total{code=\"over_limit\"}"),
        "{body}"
    );
    assert!(body.contains("floodgate_store_duration_seconds_count{op=\"admit\"}"));
    drop(processes);
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    tcp.read_to_string(&mut out).await.unwrap();
    out
}

/// The value of the counter `series` (name and labels) in the Prometheus text at `admin`.
async fn metric(admin: SocketAddr, series: &str) -> f64 {
    let body = http_get(admin, "/metrics").await;
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{body}"))
}

/// Writes `text` over `file` in place (same length, so same inode and size) and puts its
/// modification time back: the file watcher sees nothing, only a SIGHUP reloads it.
fn edit_unseen(file: &Path, text: &str) {
    use std::io::Write;
    let before = std::fs::metadata(file).unwrap();
    assert_eq!(
        before.len(),
        text.len() as u64,
        "an edit of the same length"
    );
    let mut f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.set_modified(before.modified().unwrap()).unwrap();
}

fn sighup(p: &Process) {
    let pid = p.0.id().to_string();
    let status = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(status.success());
}

/// The binary on `store_args` reloads its YAML on SIGHUP: the new limit applies to the counts
/// it had; a broken file on SIGHUP keeps the running limits.
async fn sighup_reloads_the_binary(domain: &str, store_args: &[&str]) {
    let dir = tempdir::Dir::new();
    let file = dir.path().join("limits.yaml");
    let limits = |n: u32, unit: &str| {
        format!(
            "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: {unit}, requests_per_unit: {n}}}\n"
        )
    };
    std::fs::write(&file, limits(3, "hour")).unwrap();
    let (addr, admin): (SocketAddr, SocketAddr) = (
        format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        format!("127.0.0.1:{}", free_port()).parse().unwrap(),
    );
    let admin_flag = admin.to_string();
    let mut args = vec!["--admin-listen", admin_flag.as_str()];
    args.extend(store_args);
    let process = spawn_rls(&file, addr, &args);
    let mut client = connect(addr).await;
    let req = request(domain, &[&[("k", "a")]]);
    let mut remaining = async || {
        let r = client.should_rate_limit(req.clone()).await.unwrap();
        r.into_inner().statuses[0].limit_remaining
    };
    assert_eq!(remaining().await, 2, "3 an hour");

    let ok = "floodgate_config_reloads_total{result=\"ok\"}";
    let error = "floodgate_config_reloads_total{result=\"error\"}";
    edit_unseen(&file, &limits(9, "hour"));
    sighup(&process);
    eventually(async || metric(admin, ok).await == 1.0).await;
    assert_eq!(remaining().await, 9 - 2, "9 an hour, the counter kept");

    // A broken file (a unit floodgate does not know) on SIGHUP: counted, the 9 stay.
    edit_unseen(&file, &limits(9, "hxur"));
    sighup(&process);
    eventually(async || metric(admin, error).await == 1.0).await;
    assert_eq!(remaining().await, 9 - 3, "the running limits stay");
    assert_eq!(metric(admin, ok).await, 1.0, "the watcher saw none of it");
    drop(process);
}

#[tokio::test]
async fn sighup_reloads_the_binary_on_memory() {
    sighup_reloads_the_binary("sighup", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_binary_on_redis() {
    let Some(url) = redis_url() else { return };
    // A domain of this run only: counters of earlier runs cannot count.
    let domain = format!("sighup-{}-{}", std::process::id(), free_port());
    sighup_reloads_the_binary(&domain, &["--redis-url", url.as_str()]).await;
}

/// The binary with its Redis down (a port nothing listens on): `--on-store-error open` answers
/// `OK` unchecked, past the limit, and counts the calls as `unenforced`; `closed` answers a gRPC
/// `UNAVAILABLE`, for Envoy's `failure_mode_deny` to decide. Both count the store's failures.
#[tokio::test]
async fn the_binary_with_its_store_down_fails_open_or_closed_by_the_flag() {
    let dir = tempdir::Dir::new();
    let file = dir.path().join("limits.yaml");
    std::fs::write(
        &file,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
    )
    .unwrap();
    let down = format!("redis://127.0.0.1:{}", free_port());
    let req = request("d", &[&[("k", "a")]]);
    for mode in ["open", "closed"] {
        let (addr, admin): (SocketAddr, SocketAddr) = (
            format!("127.0.0.1:{}", free_port()).parse().unwrap(),
            format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        );
        let admin_flag = admin.to_string();
        let args = [
            "--redis-url",
            down.as_str(),
            "--on-store-error",
            mode,
            "--admin-listen",
            admin_flag.as_str(),
        ];
        let process = spawn_rls(&file, addr, &args);
        let mut client = connect(addr).await;
        // Three calls of a limit of one: none of them decided.
        for _ in 0..3 {
            let answer = client.should_rate_limit(req.clone()).await;
            if mode == "open" {
                let r = answer.unwrap().into_inner();
                assert_eq!((r.overall_code, r.statuses[0].code), (OK, OK));
                let limit = r.statuses[0].current_limit.as_ref().unwrap();
                assert_eq!(limit.requests_per_unit, 1, "the rule is named");
                assert!(
                    r.response_headers_to_add.is_empty(),
                    "no state to report: {:?}",
                    r.response_headers_to_add
                );
            } else {
                let e = answer.unwrap_err();
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                assert_eq!(e.message(), "the rate limit store is unavailable");
            }
        }
        let (unenforced, error) = if mode == "open" {
            (3.0, 0.0)
        } else {
            (0.0, 3.0)
        };
        let requests = |code: &str| format!("floodgate_rls_requests_total{{code=\"{code}\"}}");
        assert_eq!(
            metric(admin, &requests("unenforced")).await,
            unenforced,
            "{mode}"
        );
        assert_eq!(metric(admin, &requests("error")).await, error, "{mode}");
        assert_eq!(metric(admin, &requests("ok")).await, 0.0, "{mode}");
        assert_eq!(
            metric(admin, "floodgate_store_errors_total{op=\"admit\"}").await,
            3.0,
            "{mode}"
        );
        // The exposition is the gateway's format, checked the same way.
        let answer = http_get(admin, "/metrics").await;
        let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
        assert!(!head.to_ascii_lowercase().contains("chunked"), "{head}");
        common::promtool_accepts(body);
        drop(process);
    }
}

#[tokio::test]
async fn the_binary_checks_a_config_and_refuses_a_bad_one() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["rls", "--check", "--config"])
        .arg(fixtures().join("readme-example02-4.yaml"))
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("domain: messaging"));
    let bad = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rls-bad-configs/bad-unit.yaml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["rls", "--config"])
        .arg(&bad)
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad-unit.yaml:7: descriptors[0].rate_limit.unit"),
        "{err}"
    );
}
