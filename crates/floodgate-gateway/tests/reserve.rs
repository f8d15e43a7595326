//! Token reservation (`tokens = "reserve"`): each request's estimate charged at admission in the
//! same atomic step as its request limits, reconciled with its usage after; against reactive
//! token limits, which admit every request while the window is below its limit.

mod common;

use std::sync::Arc;

use common::*;

/// A short chat completion capped at 100 output tokens: its estimate is its length in bytes
/// plus 100.
const ASK: &str = r#"{"model":"m","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}"#;

fn estimate() -> u64 {
    ASK.len() as u64 + 100
}

fn on(store: &str, mode: &str) -> String {
    format!(
        r#"
[upstream]
base_url = "{{upstream}}"
{store}
[gateway]
tokens = "{mode}"
[[keys]]
id = "k"
secret = "sk-k"
org = "acme"
[[rate_limits]]
scope = "org"
id = "acme"
tpm = 1000
"#
    )
}

fn redis_store(url: &str) -> String {
    format!(
        "[store]\nbackend = \"redis\"\nurl = \"{url}\"\nprefix = \"{}\"",
        fresh_prefix()
    )
}

async fn replicas(text: &str, upstream: &str, n: usize) -> Vec<Arc<Gateway>> {
    let c = config(text, upstream);
    let mut out = Vec::new();
    for _ in 0..n {
        let store = floodgate_gateway::store::open(&c.store).await.unwrap().0;
        out.push(Arc::new(gateway_on(&c, store).await));
    }
    out
}

/// Sends `n` requests at once, spread over `gws`, each using `tokens`; answers their statuses.
async fn burst(gws: &[Arc<Gateway>], n: usize, tokens: u64) -> Vec<u16> {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let gw = Arc::clone(&gws[i % gws.len()]);
        tasks.spawn(async move {
            let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), ASK);
            req.headers_mut()
                .insert("x-test-tokens", tokens.to_string().parse().unwrap());
            // Every body ends (and is reconciled) only after all have been decided: concurrent.
            req.headers_mut()
                .insert("x-test-end-delay-ms", "400".parse().unwrap());
            gw.send(req).await.status.as_u16()
        });
    }
    tasks.join_all().await
}

async fn settle(gws: &[Arc<Gateway>]) {
    for gw in gws {
        gw.settled().await;
    }
}

/// The tokens left in the org's window, read from a request's headers (its own estimate taken
/// off, for a reserving limit), and that request's status.
async fn next(gw: &Gateway) -> (u16, Option<u64>) {
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), ASK);
    req.headers_mut()
        .insert("x-test-tokens", "30".parse().unwrap());
    let r = gw.send(req).await;
    let left = r
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok());
    (r.status.as_u16(), left)
}

/// 20 concurrent requests of `max_tokens = 100` that use 30 each, against `tpm = 1000`, spread
/// over `gws`; then one more through `probe`.
///
/// The probe must be a replica whose cached refusals the burst's refunds voided: the burst's
/// own replica when it is the only one, else one that took no part in it. A refund on one
/// replica does not reach another's refusal cache, which refuses until the retry time it gave
/// (docs/design.md §11, "Across replicas").
async fn twenty_against_a_thousand(gws: &[Arc<Gateway>], probe: &Gateway, reserve: bool) {
    let statuses = burst(gws, 20, 30).await;
    let admitted = statuses.iter().filter(|&&s| s == 200).count() as u64;
    let refused = statuses.iter().filter(|&&s| s == 429).count() as u64;
    assert_eq!(admitted + refused, 20, "{statuses:?}");
    settle(gws).await;
    if !reserve {
        assert_eq!(
            admitted, 20,
            "reactive: the window is below its limit for every one"
        );
        return;
    }
    // Reserved: exactly as many as the estimates fit, and at most 10 (the issue's bound for a
    // perfect estimate of 100).
    assert_eq!(admitted, 1000 / estimate(), "{statuses:?}");
    assert!(admitted <= 10);
    // Reconciled: the window holds the actual usage, 30 each, and the next request passes
    // with its own estimate reserved.
    let (status, left) = next(probe).await;
    assert_eq!(status, 200);
    assert_eq!(left, Some(1000 - 30 * admitted - estimate()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reactive_admits_all_twenty_and_reserve_what_the_estimates_fit() {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let reactive = replicas(&on("", "reactive"), &up.url(), 1).await;
    twenty_against_a_thousand(&reactive, &reactive[0], false).await;
    let reserve = replicas(&on("", "reserve"), &up.url(), 1).await;
    twenty_against_a_thousand(&reserve, &reserve[0], true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_redis_reserve_exactly_as_one() {
    early_in_a_minute().await;
    let Some(url) = test_redis_url("three_replicas_on_redis_reserve_exactly_as_one") else {
        return;
    };
    let up = fake_upstream().await;
    // Three replicas take the burst; a fourth, which refused nothing, probes the store's truth.
    let reactive = replicas(&on(&redis_store(&url), "reactive"), &up.url(), 4).await;
    twenty_against_a_thousand(&reactive[..3], &reactive[3], false).await;
    let reserve = replicas(&on(&redis_store(&url), "reserve"), &up.url(), 4).await;
    twenty_against_a_thousand(&reserve[..3], &reserve[3], true).await;
}

#[tokio::test]
async fn headers_count_the_reservation_in_flight_and_a_refund_follows_the_usage() {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let gws = replicas(&on("", "reserve"), &up.url(), 1).await;
    let (status, left) = next(&gws[0]).await;
    // Remaining after this request's own reservation, not its usage.
    assert_eq!((status, left), (200, Some(1000 - estimate())));
    settle(&gws).await;
    let (_, left) = next(&gws[0]).await;
    assert_eq!(left, Some(1000 - 30 - estimate()));
}

#[tokio::test]
async fn an_estimate_above_the_limit_is_a_400_naming_the_cap_charged_nothing() {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let gw = gateway(&on("", "reserve"), &up.url()).await;
    let big = r#"{"model":"m","max_tokens":5000,"messages":[{"role":"user","content":"hi"}]}"#;
    let r = gw.chat("sk-k", big).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("max_tokens"), "{message}");
    assert!(message.contains("org token limit of 1000"), "{message}");
    // Answered with the chain's state, as every answer after the key is known, and no wait.
    assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("1000"));
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("1000"));
    assert_eq!(r.header("retry-after"), None);
    assert_eq!(up.seen.hits(), 0, "never forwarded");
    // Charged nothing: the next request finds the whole window.
    let gws = [Arc::new(gw)];
    let (status, left) = next(&gws[0]).await;
    assert_eq!((status, left), (200, Some(1000 - estimate())));
    // A request naming no cap is told the default is assumed.
    let gw = gateway(
        &on("", "reserve").replace("[gateway]", "[gateway]\ndefault_max_output_tokens = 2000"),
        &up.url(),
    )
    .await;
    let r = gw
        .chat(
            "sk-k",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("default of 2000"), "{}", r.text());
}

#[tokio::test]
async fn an_estimate_above_the_limit_for_its_choices_is_a_400_dividing_the_cap_by_n() {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let gw = gateway(&on("", "reserve"), &up.url()).await;
    // 400 fits the limit once; reserved for each of 3 choices, it does not.
    let three =
        r#"{"model":"m","max_tokens":400,"n":3,"messages":[{"role":"user","content":"hi"}]}"#;
    let r = gw.chat("sk-k", three).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    let fits = (1000 - three.len() as u64) / 3;
    assert!(
        message.contains(&format!("to at most {fits}, or lower `n`")),
        "{message}"
    );
    assert!(
        message.contains("400 for each of its 3 choices"),
        "{message}"
    );
    // No cap named: the default is assumed for each choice, not the default times n.
    let gw = gateway(
        &on("", "reserve").replace("[gateway]", "[gateway]\ndefault_max_output_tokens = 2000"),
        &up.url(),
    )
    .await;
    let two = r#"{"model":"m","n":2,"messages":[{"role":"user","content":"hi"}]}"#;
    let r = gw.chat("sk-k", two).await;
    assert_eq!(r.status, 400);
    assert!(
        r.text()
            .contains("default of 2000 is assumed for each choice"),
        "{}",
        r.text()
    );
    assert_eq!(up.seen.hits(), 0, "never forwarded");
    // Charged nothing.
    let gws = [Arc::new(gw)];
    let (status, left) = next(&gws[0]).await;
    assert_eq!((status, left), (200, Some(1000 - estimate())));
}

#[tokio::test]
async fn a_limit_can_reserve_beside_a_reactive_one() {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let text = on("", "reactive").replace(
        "tpm = 1000",
        "tpm = 1000\ntokens = \"reserve\"\n[[rate_limits]]\nscope = \"key\"\nid = \"k\"\ntpm = 500",
    );
    let gws = replicas(&text, &up.url(), 1).await;
    let (status, _) = next(&gws[0]).await;
    assert_eq!(status, 200);
    settle(&gws).await;
    // The key's reactive limit holds the usage (30 of 500); the org's reserving one, the
    // usage plus this request's reservation.
    let (_, left) = next(&gws[0]).await;
    assert_eq!(left, Some(470), "the key's, the most restrictive");
    settle(&gws).await;
    let c = config(&text, &up.url());
    let org = c
        .limits
        .get(&(floodgate::ScopeKind::Org, "acme".into()))
        .unwrap();
    assert_eq!(org[0].charge, floodgate::Charge::Reserved);
}

/// A stream the caller cuts before its usage came keeps its reservation: its per-chunk count
/// (a token for each of the one or two chunks it passed) is less, and the error is towards
/// stricter.
#[tokio::test]
async fn a_stream_cut_before_its_usage_keeps_its_reservation() {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let gw = gateway(&on("", "reserve"), &up.url()).await;
    let stream = ASK.replace("\"max_tokens\"", "\"stream\":true,\"max_tokens\"");
    // Its last content chunk and then the usage come 1 s after the first; the caller leaves
    // after the first.
    let delays = "x-test-last-delay-ms: 1000\r\nx-test-usage-delay-ms: 0\r\n";
    send_and_leave_at(gw.addr, &stream, delays, "Hel").await;
    gw.settled().await;
    let gws = [Arc::new(gw)];
    let (status, left) = next(&gws[0]).await;
    assert_eq!(status, 200);
    let reserved = stream.len() as u64 + 100;
    assert_eq!(left, Some(1000 - reserved - estimate()));
}

/// An answer that failed upstream (500, no usage) keeps its reservation: the gateway cannot
/// tell what the upstream used, and the error is towards stricter.
#[tokio::test]
async fn an_upstream_500_keeps_its_reservation() {
    early_in_a_minute().await;
    use axum::http::StatusCode;
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(|| async {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                [("content-type", "application/json")],
                r#"{"error":{"message":"boom"}}"#,
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let gws = replicas(&on("", "reserve"), &format!("http://{addr}"), 1).await;
    let (status, left) = next(&gws[0]).await;
    assert_eq!((status, left), (500, Some(1000 - estimate())));
    settle(&gws).await;
    // Kept: the next request finds the first's estimate still charged beside its own.
    let (status, left) = next(&gws[0]).await;
    assert_eq!((status, left), (500, Some(1000 - 2 * estimate())));
}

/// The issue's load: 20 concurrent requests of `max_tokens = 4000` against `tpm = 10000`, each
/// using `usage` tokens; answers how many were admitted and the tokens then left in the window
/// (none, once past the limit: the window then holds `admitted * usage`).
async fn overshoot(mode: &str, usage: u64) -> (u64, u64) {
    let up = fake_upstream().await;
    let text = on("", mode)
        .replace("tpm = 1000", "tpm = 10000")
        .replace("[gateway]", "[gateway]\ndefault_max_output_tokens = 4000");
    let gws = replicas(&text, &up.url(), 1).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let gw = Arc::clone(&gws[0]);
        tasks.spawn(async move {
            let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
            let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), body);
            let h = req.headers_mut();
            h.insert("x-test-tokens", usage.to_string().parse().unwrap());
            h.insert("x-test-end-delay-ms", "400".parse().unwrap());
            gw.send(req).await.status.as_u16()
        });
    }
    let admitted = tasks.join_all().await.iter().filter(|&&s| s == 200).count() as u64;
    settle(&gws).await;
    let read = gws[0]
        .send(gws[0].request("GET", "/v1/models", Some("sk-k"), ""))
        .await;
    let left: u64 = read
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap();
    (admitted, left)
}

/// The table in docs/gateway.md ("Token reservation"): reactive lets the whole burst through and
/// the window overshoots by 7 windows' worth; reserve admits what the estimates fit, never over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_long_completions_overshoots_reactive_and_not_reserve() {
    early_in_a_minute().await;
    // Reactive: all 20 pass, 80 000 tokens used against 10 000.
    assert_eq!(overshoot("reactive", 4000).await, (20, 0));
    // Reserve: each reserves 4000 and its body's bytes; two fit, 8 000 used.
    assert_eq!(overshoot("reserve", 4000).await, (2, 2_000));
    // Over-estimated (each uses 30): reserve still admits 2, and refunds the rest.
    assert_eq!(overshoot("reserve", 30).await, (2, 10_000 - 60));
    assert_eq!(overshoot("reactive", 30).await, (20, 10_000 - 600));
}

/// A budget of 1000 µUSD, tokens priced at 1 µUSD each (in or out), no token limit.
fn budget_config(mode: &str) -> String {
    budget_config_on("", mode)
}

fn budget_config_on(store: &str, mode: &str) -> String {
    format!(
        r#"
[upstream]
base_url = "{{upstream}}"
{store}
[gateway]
tokens = "{mode}"
[[keys]]
id = "k"
secret = "sk-k"
org = "acme"
[[prices]]
model = "*"
input_per_million = 1.0
output_per_million = 1.0
[[budgets]]
scope = "org"
id = "acme"
period = "day"
usd = 0.001
"#
    )
}

/// Concurrent requests never overrun a reserving budget by more than the estimate error: here
/// the estimate is exact (each uses what it reserves), so never; reactive lets the burst
/// through and overruns it 3.5 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_never_overrun_a_reserving_budget() {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let e = estimate();
    for (mode, admitted_expected) in [("reactive", 20), ("reserve", 1000 / e)] {
        let gws = replicas(&budget_config(mode), &up.url(), 1).await;
        let statuses = burst(&gws, 20, e).await;
        let admitted = statuses.iter().filter(|&&s| s == 200).count() as u64;
        assert_eq!(admitted, admitted_expected, "{mode}: {statuses:?}");
        settle(&gws).await;
        assert!(
            mode == "reactive" || admitted * e <= 1000,
            "reserve never spends past the cap"
        );
        // Spent: 20 x 176 (reactive), 5 x 176 = 880 (reserve): the next one is refused either way.
        let (status, _) = next(&gws[0]).await;
        assert_eq!(status, 429, "{mode}");
    }
    // Over-estimated (each uses 30): the refunds let the next requests through.
    let gws = replicas(&budget_config("reserve"), &up.url(), 1).await;
    let statuses = burst(&gws, 20, 30).await;
    let admitted = statuses.iter().filter(|&&s| s == 200).count() as u64;
    assert_eq!(admitted, 1000 / e);
    settle(&gws).await;
    let (status, _) = next(&gws[0]).await;
    assert_eq!(
        status,
        200,
        "spent {} of 1000 after the refunds",
        30 * admitted
    );
}

/// A price above the budget's cap itself can never fit, whatever the period's end: a 400 that
/// names the budget and what to lower, charged nothing and not counted as a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_price_above_a_reserving_budget_is_a_400_charged_nothing() {
    early_in_a_minute().await;
    let up = fake_upstream().await;
    let gws = replicas(&budget_config("reserve"), &up.url(), 1).await;
    let big = r#"{"model":"m","max_tokens":2000,"messages":[{"role":"user","content":"hi"}]}"#;
    let r = gws[0].chat("sk-k", big).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("retry-after"), None);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("org's daily budget of $0.001000"),
        "{message}"
    );
    assert!(message.contains("lower `max_tokens`"), "{message}");
    assert!(
        !message.contains("acme"),
        "never the budget's id: {message}"
    );
    assert_eq!(up.seen.hits(), 0, "never forwarded");
    let metrics = gws[0].state.metrics().encode();
    let budget = r#"floodgate_requests_total{decision="budget",scope="org"} 0"#;
    assert!(metrics.contains(budget), "{metrics}");
    // Charged nothing: a burst then fits as many as on a fresh budget.
    let e = estimate();
    let statuses = burst(&gws, 20, e).await;
    let admitted = statuses.iter().filter(|&&s| s == 200).count() as u64;
    assert_eq!(admitted, 1000 / e, "{statuses:?}");
    settle(&gws).await;
    // Answered with the chain's state, as every answer after the key is known.
    let limited = budget_config("reserve").replace(
        "org = \"acme\"",
        "org = \"acme\"\nrate_limit = { requests = 100 }",
    );
    let gws = replicas(&limited, &up.url(), 1).await;
    let r = gws[0].chat("sk-k", big).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("100"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("100"));
    // Reactive budgets cannot tell at admission: the same request is admitted.
    let gws = replicas(&budget_config("reactive"), &up.url(), 1).await;
    assert_eq!(gws[0].chat("sk-k", big).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_redis_never_overrun_a_reserving_budget() {
    early_in_a_minute().await;
    let Some(url) = test_redis_url("three_replicas_on_redis_never_overrun_a_reserving_budget")
    else {
        return;
    };
    let up = fake_upstream().await;
    let e = estimate();
    let gws = replicas(
        &budget_config_on(&redis_store(&url), "reserve"),
        &up.url(),
        3,
    )
    .await;
    let statuses = burst(&gws, 20, e).await;
    let admitted = statuses.iter().filter(|&&s| s == 200).count() as u64;
    assert_eq!(admitted, 1000 / e, "{statuses:?}");
    settle(&gws).await;
    assert_eq!(next(&gws[1]).await.0, 429);
}

/// A token limit of 0 blocks the scope's token use whichever way its tokens are charged: a
/// reserving one refuses the requests the gateway does not read (their estimate is 0) as a
/// reactive one does, with no time to wait, and is no estimate's fault (not a 400).
#[tokio::test]
async fn a_reserving_token_limit_of_zero_refuses_every_request() {
    let up = fake_upstream().await;
    for mode in ["reactive", "reserve"] {
        let gw = gateway(&on("", mode).replace("tpm = 1000", "tpm = 0"), &up.url()).await;
        for (path, body) in [
            ("/v1/embeddings", r#"{"model":"m","input":"hi"}"#),
            ("/v1/chat/completions", ASK),
        ] {
            let r = gw.send(gw.request("POST", path, Some("sk-k"), body)).await;
            assert_eq!(r.status, 429, "{mode} {path}: {}", r.text());
            assert_eq!(r.header("retry-after"), None, "{mode} {path}");
            assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
        }
    }
    assert_eq!(up.seen.hits(), 0);
}

/// A request that reserves nothing (an embeddings request: its body is not read) needs room in a
/// reserving window, as in a reactive one: a window exactly full refuses it. (Before, it was
/// admitted with a reservation of 0, which fits a full window exactly.) On both stores, for a
/// key's chain and for a chain built per request for a customer.
#[tokio::test]
async fn a_full_reserving_window_refuses_a_request_that_reserves_nothing() {
    let up = fake_upstream().await;
    let url = test_redis_url("a_full_reserving_window_refuses_a_request_that_reserves_nothing");
    for redis in std::iter::once(None).chain(url.as_deref().map(Some)) {
        for (mode, customer) in [
            ("reactive", None),
            ("reserve", None),
            ("reserve", Some("c1")),
        ] {
            // Each its own state: on Redis, a prefix of its own.
            let store = match redis {
                Some(url) => redis_store(url),
                None => String::new(),
            };
            early_in_a_minute().await;
            let config = on(&store, mode)
                + "[[rate_limits]]\nscope = \"customer\"\nid = \"c1\"\nrpm = 1000\n";
            let gw = gateway(&config, &up.url()).await;
            let request = |path: &str, body: &str| {
                let mut req = gw.request("POST", path, Some("sk-k"), body);
                if let Some(c) = customer {
                    req.headers_mut()
                        .insert("x-floodgate-customer", c.parse().unwrap());
                }
                req
            };
            // One completion that uses the whole window: 1000 of 1000 tokens.
            let mut req = request("/v1/chat/completions", ASK);
            req.headers_mut()
                .insert("x-test-tokens", "1000".parse().unwrap());
            assert_eq!(gw.send(req).await.status, 200, "{mode}");
            gw.settled().await;
            let hits = up.seen.hits();
            let body = r#"{"model":"m","input":"hi"}"#;
            let r = gw.send(request("/v1/embeddings", body)).await;
            assert_eq!(r.status, 429, "{mode} {customer:?} {store}: {}", r.text());
            assert_eq!(
                r.header("x-ratelimit-remaining-tokens"),
                Some("0"),
                "{mode}"
            );
            assert!(
                r.header("retry-after").is_some(),
                "{mode}: a wait that cures it"
            );
            assert_eq!(up.seen.hits(), hits, "{mode}: not forwarded");
        }
    }
}

/// A Responses API create reserves the price of its estimate by the model its body names, as a
/// completion does: here `m`, the only priced model, at 1 µUSD a token, so that 2000 output
/// tokens can never fit the budget of 1000 µUSD (before, the model was not read from a
/// Responses body: its estimate was priced as a request naming no model, here at nothing, and
/// it was admitted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_create_reserves_the_price_of_the_model_it_names() {
    let up = fake_upstream().await;
    let text = budget_config("reserve").replace("model = \"*\"", "model = \"m\"");
    let gws = replicas(&text, &up.url(), 1).await;
    let big = r#"{"model":"m","max_output_tokens":2000,"input":"hi"}"#;
    let r = gws[0]
        .send(gws[0].request("POST", "/v1/responses", Some("sk-k"), big))
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("org's daily budget of $0.001000"),
        "{message}"
    );
    assert_eq!(up.seen.hits(), 0, "never forwarded");
    // A completion naming the same model is priced alike.
    let chat = r#"{"model":"m","max_tokens":2000,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(gws[0].chat("sk-k", chat).await.status, 400);
}
