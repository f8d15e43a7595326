//! Budgets: spend priced per model from JSON and SSE usage fills a daily cap, then requests are
//! refused with 429 `insufficient_quota` until the UTC day ends, charging no rate limit; an org's
//! budget refuses every key of the org; prices match exactly, by `-` prefix, or by `*`; an
//! unpriced model spends nothing; the store failing open or closed; a stream in flight is never
//! cut off by a budget spent meanwhile.
//!
//! The gateway runs on a memory store with a fake clock pinned 100 s before a UTC midnight.

mod common;

use std::time::Duration;

use common::*;
use floodgate::clock::FakeClock;
use floodgate::store::{AnyStore, MemoryStore};
use floodgate::{Chain, Timestamp};
use serde_json::Value;

/// 2026-12-01T23:58:20Z: 100 s before midnight UTC.
const BEFORE_MIDNIGHT: Timestamp = Timestamp::from_secs(1_796_083_200 + 86_400 - 100);

const PRICES: &str = r#"
[[prices]]
model = "gpt-4o-mini"
input_per_million = 0.15
output_per_million = 0.60
[[prices]]
model = "gpt-4o"
input_per_million = 2.5
output_per_million = 10.0
"#;

/// A key with 10 requests a minute and a daily budget of 100 µUSD.
fn tiny_budget() -> String {
    format!(
        r#"
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "k"
secret = "sk-k"
org = "acme"
rate_limit = {{ requests = 10 }}
{PRICES}
[[budgets]]
scope = "key"
id = "k"
period = "day"
usd = 0.0001
"#
    )
}

/// A gateway on a memory store whose clock is `clock`.
async fn pinned_gateway(text: &str, upstream: &str, clock: &FakeClock) -> Gateway {
    let c = config(text, upstream);
    let store = AnyStore::Memory(MemoryStore::with_clock(clock.clone()));
    gateway_on(&c, store).await
}

/// `POST /v1/chat/completions` whose response names `model` and uses `tokens` (half input,
/// half output).
async fn chat_as(gw: &Gateway, key: &str, body: &str, model: &str, tokens: u64) -> Reply {
    let mut req = gw.request("POST", "/v1/chat/completions", Some(key), body);
    req.headers_mut()
        .insert("x-test-model", model.parse().unwrap());
    req.headers_mut()
        .insert("x-test-tokens", tokens.to_string().parse().unwrap());
    let r = gw.send(req).await;
    // Spend (and tokens) are recorded in the background once the body is done.
    gw.settled().await;
    r
}

/// The current spend of each budget of `secret`'s chain (customer `customer`).
async fn spent(gw: &Gateway, secret: &str, customer: Option<&str>) -> Vec<u64> {
    let live = gw.state.live();
    let key = live.keys.lookup(secret).unwrap();
    let budgets = live.keys.chain_for(key, customer).budgets.unwrap();
    let d = budgets.check(gw.state.store()).await.unwrap();
    d.spent
}

/// The request slots left on the first limit of `secret`'s chain, read without charging.
async fn requests_left(gw: &Gateway, secret: &str) -> u64 {
    let live = gw.state.live();
    let chain: &Chain = live.keys.lookup(secret).unwrap().chain();
    let d = chain.admit(gw.state.store(), 0).await.unwrap();
    d.statuses[0].remaining
}

#[tokio::test]
async fn a_spent_daily_budget_refuses_until_midnight_utc_and_charges_no_rate_limit() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let gw = pinned_gateway(&tiny_budget(), &up.url(), &clock).await;
    // Priced as gpt-4o-mini (the longest priced prefix at a `-`): 50 input tokens at 0.15 and
    // 50 output tokens at 0.60 USD per million = 37.5 µUSD, rounded up to 38.
    let model = "gpt-4o-mini-2024-07-18";
    let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
    assert_eq!(r.status, 200);
    assert_eq!(spent(&gw, "sk-k", None).await, [38], "from a JSON usage");
    // A stream: the gateway asks for its usage (budgets meter even without a token limit)
    // and prices it by the model its chunks name.
    let r = chat_as(&gw, "sk-k", CHAT_STREAM, model, 100).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        up.seen.last_body()["stream_options"]["include_usage"],
        Value::Bool(true)
    );
    assert_eq!(up.seen.last_headers()["accept-encoding"], "identity");
    let events = events(&r.body);
    assert!(
        events.iter().all(|e| !e.contains("usage")),
        "the usage the caller did not ask for is hidden: {events:?}"
    );
    assert_eq!(spent(&gw, "sk-k", None).await, [76], "from an SSE stream");
    let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
    assert_eq!(r.status, 200, "76 < 100: still under the cap");
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("7"));
    assert_eq!(spent(&gw, "sk-k", None).await, [114]);

    // 114 >= 100: refused until midnight UTC, 100 s away.
    for _ in 0..2 {
        let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
        assert_eq!(r.status, 429, "{}", r.text());
        let error = &r.json()["error"];
        assert_eq!(error["type"], "insufficient_quota");
        assert_eq!(error["code"], "budget_exceeded");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains("for key") && message.contains("daily"),
            "{message}"
        );
        assert!(
            !message.contains("sk-k") && !message.contains("acme"),
            "{message}"
        );
        assert_eq!(r.header("retry-after"), Some("100"));
        assert_eq!(r.header("retry-after-ms"), Some("100000"));
        // The chain's rate-limit state, read without charging (docs/design.md §6: every response
        // carries it): the 7 requests left after the last admitted one.
        assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("7"));
        assert!(r.header("x-ratelimit-limit").is_some());
    }
    assert_eq!(
        up.seen.hits(),
        3,
        "refused requests never reach the upstream"
    );
    assert_eq!(
        requests_left(&gw, "sk-k").await,
        7,
        "the refused requests took no request slot"
    );
    assert_eq!(spent(&gw, "sk-k", None).await, [114], "and spent nothing");

    // Midnight: a new day, a whole budget.
    clock.advance(Duration::from_secs(100));
    let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(spent(&gw, "sk-k", None).await, [38]);
}

#[tokio::test]
async fn a_budget_refusal_waits_for_the_rate_limit_too_when_it_frees_later() {
    // One request a day (a sliding window of a day) and a daily budget the first answer spends
    // (38 µUSD against 30), 100 s before midnight UTC.
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let text = tiny_budget()
        .replace(
            "rate_limit = { requests = 10 }",
            "rate_limit = { requests = 1, window_sec = 86400 }",
        )
        .replace("usd = 0.0001", "usd = 0.00003");
    let gw = pinned_gateway(&text, &up.url(), &clock).await;
    let model = "gpt-4o-mini";
    assert_eq!(chat_as(&gw, "sk-k", CHAT, model, 100).await.status, 200);
    // The budget frees at midnight, in 100 s; the day's request weighs on the window until the
    // end of the next day, 86 500 s away: the request passes then, and not before.
    let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "budget_exceeded");
    assert_eq!(r.header("retry-after"), Some("86500"));
    assert_eq!(r.header("retry-after-ms"), Some("86500000"));
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("retry after 86500s"), "{message}");
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    // Midnight: the budget is whole again, the window still full, as the wait said.
    clock.advance(Duration::from_secs(100));
    let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("86400"));
    assert_eq!(up.seen.hits(), 1);
}

#[tokio::test]
async fn a_budget_refusal_waits_for_a_token_limit_the_answer_overdrew() {
    // 10 tokens a minute and a daily budget; the first answer uses 1000 tokens (375 µUSD against
    // 100), 30 s before midnight UTC: the token limit is over its max, not merely full.
    let up = fake_upstream().await;
    let clock = FakeClock::new(Timestamp::from_secs(1_796_083_200 + 86_400 - 30));
    let text = format!(
        "{}\n[[rate_limits]]\nscope = \"key\"\nid = \"k\"\ntpm = 10\n",
        tiny_budget()
    );
    let gw = pinned_gateway(&text, &up.url(), &clock).await;
    let model = "gpt-4o-mini";
    assert_eq!(chat_as(&gw, "sk-k", CHAT, model, 1000).await.status, 200);
    // The budget frees at midnight, in 30 s. The 1000 tokens fill this minute's bucket, 30 s
    // into it; a request passes a token limit whose window is not full, once they weigh less
    // than 10 in the next bucket's sliding window: 1000 * (60 - e) / 60 < 10, e > 59.4 s into
    // it, 89.4 s (and a microsecond) from now.
    let r = chat_as(&gw, "sk-k", CHAT, model, 1000).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "budget_exceeded");
    assert_eq!(r.header("retry-after"), Some("90"));
    assert_eq!(r.header("retry-after-ms"), Some("89401"));
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("0"));
    // At midnight the budget is whole again and the tokens still weigh: refused by the limit,
    // with what is left of the same wait.
    clock.advance(Duration::from_secs(30));
    let r = chat_as(&gw, "sk-k", CHAT, model, 1000).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    assert_eq!(r.header("retry-after-ms"), Some("59401"));
    assert_eq!(up.seen.hits(), 1);
}

#[tokio::test]
async fn an_org_budget_refuses_every_key_of_the_org() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let text = format!(
        r#"
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "a"
secret = "sk-a"
org = "acme"
team = "ml"
[[keys]]
id = "b"
secret = "sk-b"
org = "acme"
[[keys]]
id = "c"
secret = "sk-c"
org = "other"
{PRICES}
[[budgets]]
scope = "org"
id = "acme"
period = "month"
usd = 0.00005
"#
    );
    let gw = pinned_gateway(&text, &up.url(), &clock).await;
    let model = "gpt-4o-mini";
    assert_eq!(chat_as(&gw, "sk-a", CHAT, model, 100).await.status, 200);
    assert_eq!(chat_as(&gw, "sk-b", CHAT, model, 100).await.status, 200);
    assert_eq!(spent(&gw, "sk-a", None).await, [76]);
    for key in ["sk-a", "sk-b"] {
        let r = chat_as(&gw, key, CHAT, model, 100).await;
        assert_eq!(r.status, 429, "{key}");
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            message.contains("for org") && message.contains("monthly"),
            "{message}"
        );
        assert!(!message.contains("acme"), "never a tenant id: {message}");
        // The month ends with the day: 2026-12-31 is not this day, so the wait is the month's.
        let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
        assert_eq!(wait, 100 + 30 * 86_400, "until January 1, 00:00 UTC");
    }
    // Another org's key is not touched.
    assert_eq!(chat_as(&gw, "sk-c", CHAT, model, 100).await.status, 200);
    assert_eq!(up.seen.hits(), 3);
}

#[tokio::test]
async fn a_refusal_names_the_later_cap_that_sets_its_wait() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let text = format!(
        r#"{}
[[budgets]]
scope = "org"
id = "acme"
period = "month"
usd = 0.00011
"#,
        tiny_budget()
    );
    let gw = pinned_gateway(&text, &up.url(), &clock).await;
    let model = "gpt-4o-mini";
    for _ in 0..3 {
        assert_eq!(chat_as(&gw, "sk-k", CHAT, model, 100).await.status, 200);
    }
    // Both the key's daily cap (first in the chain: named) and the org's monthly one are spent;
    // the wait is the month's, and the message says why.
    let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
    assert_eq!(r.status, 429);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert_eq!(
        message,
        format!(
            "Budget exceeded for key: its daily spend cap (UTC) is reached, and so is the org's monthly cap. Please retry after {}s.",
            100 + 30 * 86_400
        )
    );
    assert_eq!(r.header("retry-after"), Some("2592100"));
}

#[tokio::test]
async fn prices_match_exactly_by_dash_prefix_and_by_star_and_the_request_names_the_model() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let text = format!(
        r#"
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "k"
secret = "sk-k"
{PRICES}
[[prices]]
model = "*"
input_per_million = 1
output_per_million = 2
[[budgets]]
scope = "key"
id = "k"
period = "day"
usd = 1000
[[budgets]]
scope = "customer"
id = "cust"
period = "day"
usd = 1000
"#
    );
    let gw = pinned_gateway(&text, &up.url(), &clock).await;
    let mut total = 0;
    // (model the response names, µUSD for 50 input + 50 output tokens)
    for (model, cost) in [
        ("gpt-4o-mini", 38),            // 7.5 + 30, rounded up
        ("gpt-4o-2024-08-06", 625),     // 125 + 500: gpt-4o, not gpt-4o-mini
        ("gpt-4o-mini-2024-07-18", 38), // the longest prefix wins
        ("gpt-4omni", 150),             // not at a `-`: the `*` price, 50 + 100
        ("llama-3", 150),
    ] {
        let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
        assert_eq!(r.status, 200);
        total += cost;
        assert_eq!(spent(&gw, "sk-k", None).await, [total], "{model}");
    }
    // A response that names no model is priced by the request's `model`.
    let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(chat_as(&gw, "sk-k", body, "-", 100).await.status, 200);
    total += 625;
    assert_eq!(spent(&gw, "sk-k", None).await, [total]);
    // A customer's budget joins the chain through the header, after the key's.
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT);
    req.headers_mut()
        .insert("x-floodgate-customer", "cust".parse().unwrap());
    req.headers_mut()
        .insert("x-test-model", "gpt-4o".parse().unwrap());
    req.headers_mut()
        .insert("x-test-tokens", "100".parse().unwrap());
    assert_eq!(gw.send(req).await.status, 200);
    gw.settled().await;
    assert_eq!(spent(&gw, "sk-k", Some("cust")).await, [total + 625, 625]);
}

#[tokio::test]
async fn an_unpriced_model_spends_nothing() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let gw = pinned_gateway(&tiny_budget(), &up.url(), &clock).await;
    for _ in 0..5 {
        let r = chat_as(&gw, "sk-k", CHAT, "mystery-model", 100_000).await;
        assert_eq!(r.status, 200);
    }
    assert_eq!(spent(&gw, "sk-k", None).await, [0], "no price, no spend");
    // A priced one still counts.
    chat_as(&gw, "sk-k", CHAT, "gpt-4o", 100).await;
    assert_eq!(spent(&gw, "sk-k", None).await, [625]);
}

#[tokio::test]
async fn a_failed_response_spends_nothing() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let gw = pinned_gateway(&tiny_budget(), &up.url(), &clock).await;
    // The fake upstream has no such route: 404, no usage.
    let r = gw
        .send(gw.request("POST", "/v1/nothing/completions", Some("sk-k"), CHAT))
        .await;
    assert_eq!(r.status, 404);
    gw.settled().await;
    assert_eq!(spent(&gw, "sk-k", None).await, [0]);
}

fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test]
async fn with_the_store_down_a_budget_fails_open_or_closed() {
    let up = fake_upstream().await;
    // A key with a budget and no rate limit: the budget read is its only store call.
    let text = |on_error: &str| {
        format!(
            r#"
[store]
backend = "redis"
url = "redis://127.0.0.1:{}/0"
on_error = "{on_error}"
[upstream]
base_url = "{{upstream}}"
[[keys]]
id = "k"
secret = "sk-k"
{PRICES}
[[budgets]]
scope = "key"
id = "k"
period = "day"
usd = 1
"#,
            dead_port()
        )
    };
    let open = gateway(&text("open"), &up.url()).await;
    let r = open.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200, "fails open: {}", r.text());
    let closed = gateway(&text("closed"), &up.url()).await;
    let r = closed.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "rate_limiter_unavailable");
    assert_eq!(up.seen.hits(), 1);
}

#[tokio::test]
async fn a_budget_spent_while_a_stream_is_in_flight_does_not_cut_it() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let gw = std::sync::Arc::new(pinned_gateway(&tiny_budget(), &up.url(), &clock).await);
    // A stream whose last chunk comes 500 ms after the first.
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT_STREAM);
    req.headers_mut()
        .insert("x-test-last-delay-ms", "500".parse().unwrap());
    req.headers_mut()
        .insert("x-test-model", "gpt-4o".parse().unwrap());
    let streaming = tokio::spawn({
        let gw = gw.clone();
        async move { gw.send(req).await }
    });
    wait_until("the stream is admitted and under way", || {
        up.seen.hits() >= 1
    })
    .await;
    // Meanwhile another answer spends the whole budget (625 µUSD of gpt-4o > 100).
    assert_eq!(chat_as(&gw, "sk-k", CHAT, "gpt-4o", 100).await.status, 200);
    assert_eq!(chat_as(&gw, "sk-k", CHAT, "gpt-4o", 100).await.status, 429);
    let r = streaming.await.unwrap();
    assert_eq!(r.status, 200);
    let events = events(&r.body);
    assert_eq!(events.len(), 4, "the stream ran to its end: {events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    gw.settled().await;
    // And its own spend (25 + 25 tokens of gpt-4o: 312.5, so 313) was still recorded.
    assert_eq!(spent(&gw, "sk-k", None).await, [625 + 313]);
}

/// A budget refusal carries the chain's rate-limit state, read without charging: with the
/// key's one slot taken as well, the caller sees that the rate limit would hold it past the
/// budget's day too.
#[tokio::test]
async fn a_budget_refusal_carries_the_rate_limit_state() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let text = tiny_budget().replace("requests = 10", "requests = 1");
    let gw = pinned_gateway(&text, &up.url(), &clock).await;
    // 4 s before midnight: one request takes the one slot and spends the budget (625 µUSD).
    clock.advance(Duration::from_secs(96));
    let r = chat_as(&gw, "sk-k", CHAT, "gpt-4o", 100).await;
    assert_eq!(r.status, 200);
    let r = chat_as(&gw, "sk-k", CHAT, "gpt-4o", 100).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "budget_exceeded");
    assert_eq!(
        r.header("retry-after"),
        Some("64"),
        "the budget's day ends in 4 s, the request's minute leaves the window in 64 s"
    );
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("1"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    // The slot is whole again once the request's minute has left the window: 64 s.
    assert_eq!(r.header("x-ratelimit-reset-requests"), Some("1m4s"));
    assert_eq!(
        requests_left(&gw, "sk-k").await,
        0,
        "the read charged nothing"
    );
    assert_eq!(up.seen.hits(), 1);
}

#[tokio::test]
async fn a_budget_of_zero_refuses_with_no_time_to_wait_reactive_or_reserving() {
    let up = fake_upstream().await;
    for tokens in ["", "[gateway]\ntokens = \"reserve\"\n"] {
        let clock = FakeClock::new(BEFORE_MIDNIGHT);
        let text = format!(
            "{tokens}{}",
            tiny_budget().replace("usd = 0.0001", "usd = 0")
        );
        let gw = pinned_gateway(&text, &up.url(), &clock).await;
        // An unpriced model too: its price of 0 does not fit a cap of 0.
        for model in ["gpt-4o", "unpriced"] {
            let r = chat_as(&gw, "sk-k", CHAT, model, 100).await;
            assert_eq!(r.status, 429, "{tokens} {model}: {}", r.text());
            assert_eq!(r.json()["error"]["code"], "budget_exceeded");
            let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
            assert!(message.contains("cap is 0"), "{message}");
            // Midnight would not mend it: no `Retry-After` invites a retry that is refused
            // again (as for a limit of 0); the chain's state is there.
            assert_eq!(r.header("retry-after"), None, "{tokens} {model}");
            assert_eq!(r.header("retry-after-ms"), None, "{tokens} {model}");
            assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("10"));
        }
    }
    assert_eq!(up.seen.hits(), 0);
}

/// A spent budget's 429 waits for the budget and the rate limits both: a key that no request
/// can pass (`requests = 0`, a key blocked) is not invited back at midnight, and the cost-0 read
/// of its state leaves no `Retry-After` of its own behind.
#[tokio::test]
async fn a_spent_budget_on_a_key_that_can_never_pass_announces_no_wait() {
    let up = fake_upstream().await;
    let clock = FakeClock::new(BEFORE_MIDNIGHT);
    let text = tiny_budget().replace("requests = 10", "requests = 0");
    let gw = pinned_gateway(&text, &up.url(), &clock).await;
    let live = gw.state.live();
    let key = live.keys.lookup("sk-k").unwrap();
    let budgets = live.keys.chain_for(key, None).budgets.unwrap();
    budgets.spend(gw.state.store(), 100).await.unwrap();
    let r = chat_as(&gw, "sk-k", CHAT, "gpt-4o", 100).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "budget_exceeded");
    assert_eq!(r.header("retry-after"), None, "the key can never pass");
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("can never pass a rate limit"), "{message}");
    assert_eq!(r.header("retry-after-ms"), None);
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("0"));
    assert_eq!(up.seen.hits(), 0);
}
