//! https upstreams: TLS to the upstream with the system's CAs plus `ca_file`; an untrusted or
//! silent upstream is a 502 charged once; `ca_file` mistakes are config errors.
//!
//! The upstream is the fake one of `common`, served over rustls with the test-only certificates
//! of `tests/tls/`.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use floodgate_gateway::Config;
use floodgate_gateway::config::{UpstreamConfig, UpstreamTarget};
use floodgate_gateway::upstream::Upstream;

/// `{ca}` is replaced by the test CA's path.
const CONFIG: &str = r#"
[upstream]
base_url = "{upstream}"
ca_file = "{ca}"
[[keys]]
id = "k"
secret = "sk-k"
org = "acme"
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 10
tpm = 100
"#;

fn with_ca() -> String {
    CONFIG.replace("{ca}", &tls_fixture("ca.pem").display().to_string())
}

async fn tls_upstream() -> FakeUpstream {
    fake_upstream_tls(&tls_fixture("server.pem"), &tls_fixture("server.key")).await
}

#[tokio::test]
async fn a_trusted_https_upstream_answers_and_tokens_are_metered() {
    let up = tls_upstream().await;
    let gw = gateway(&with_ca(), &up.https_url()).await;
    // 60 tokens each: the second request starts below the limit, the third finds it full.
    for expected_left in ["100", "40"] {
        let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT);
        req.headers_mut()
            .insert("x-test-tokens", "60".parse().unwrap());
        let r = gw.send(req).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["choices"][0]["message"]["content"], "hi");
        assert_eq!(r.json()["usage"]["total_tokens"], 60);
        assert_eq!(r.header("x-ratelimit-limit-requests"), Some("10"));
        assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("100"));
        assert_eq!(
            r.header("x-ratelimit-remaining-tokens"),
            Some(expected_left)
        );
        gw.settled().await;
    }
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(up.seen.hits(), 2);
    assert_eq!(
        up.seen.last_headers()["host"],
        format!("localhost:{}", up.addr.port()).as_str(),
        "the Host header is the base URL's authority"
    );
    assert_eq!(
        up.seen.tls_handshakes(),
        1,
        "the second request reuses the pooled TLS connection"
    );
}

#[tokio::test]
async fn a_stream_over_https_passes_through_and_is_metered() {
    let up = tls_upstream().await;
    let gw = gateway(&with_ca(), &up.https_url()).await;
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT_STREAM);
    req.headers_mut()
        .insert("x-test-tokens", "70".parse().unwrap());
    let r = gw.send(req).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = events(&r.body);
    assert_eq!(events.len(), 4, "3 content chunks and [DONE]: {events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    gw.settled().await;
    let r = gw.chat("sk-k", CHAT_STREAM).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("30"));
}

#[tokio::test]
async fn an_ip_address_base_url_is_checked_against_the_certificates_ip() {
    let up = tls_upstream().await;
    let gw = gateway(&with_ca(), &format!("https://{}", up.addr)).await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(up.seen.tls_handshakes(), 1);
}

#[tokio::test]
async fn an_untrusted_certificate_is_502_and_counts_once() {
    let up = tls_upstream().await;
    // No ca_file: the test CA is not among the system's.
    let config = CONFIG.replace("ca_file = \"{ca}\"\n", "");
    let gw = gateway(&config, &up.https_url()).await;
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
    assert!(
        !r.text().contains("certificate") && !r.text().contains("localhost"),
        "no internals echoed: {}",
        r.text()
    );
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("9"));
    let r = gw.chat("sk-k", CHAT).await;
    assert_eq!(r.status, 502);
    assert_eq!(
        r.header("x-ratelimit-remaining-requests"),
        Some("8"),
        "charged once per request"
    );
    assert_eq!(up.seen.hits(), 0);
    assert_eq!(up.seen.tls_handshakes(), 0);
}

#[tokio::test]
async fn a_silent_upstream_times_out_the_tls_handshake_with_502() {
    // Connections are accepted by the kernel, and nothing ever answers the ClientHello.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let config = with_ca().replace("[[keys]]", "timeout_sec = 30\n[[keys]]");
    let gw = gateway(&config, &format!("https://localhost:{port}")).await;
    let start = Instant::now();
    let r = gw.chat("sk-k", CHAT).await;
    let took = start.elapsed();
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(15),
        "the handshake's own timeout (5 s), well before timeout_sec: {took:?}"
    );
    drop(silent);
}

fn parse(text: &str) -> Result<Config, floodgate_gateway::ConfigError> {
    Config::parse_with_env("test.toml", text, None)
}

#[test]
fn ca_file_mistakes_are_config_errors_naming_the_field() {
    let ca = tls_fixture("ca.pem").display().to_string();
    let key = tls_fixture("server.key").display().to_string();
    let cases = [
        (
            format!("[upstream]\nbase_url = \"http://localhost:9000\"\nca_file = \"{ca}\"\n"),
            "https:// upstreams only",
        ),
        (
            format!("[upstream]\ndemo = true\nca_file = \"{ca}\"\n"),
            "demo upstream takes no CA file",
        ),
        (
            "[upstream]\nbase_url = \"https://localhost\"\nca_file = \"/no/such/ca.pem\"\n"
                .to_owned(),
            "cannot read /no/such/ca.pem",
        ),
        (
            format!("[upstream]\nbase_url = \"https://localhost\"\nca_file = \"{key}\"\n"),
            "holds no certificate",
        ),
        (
            "[upstream]\nbase_url = \"https://localhost\"\nca_file = \"\"\n".to_owned(),
            "must not be empty",
        ),
    ];
    for (text, message) in cases {
        let e = parse(&text).expect_err(&text);
        assert_eq!(
            (e.line, e.column, e.field.as_str()),
            (3, 11, "upstream.ca_file")
        );
        assert!(e.to_string().contains(message), "{e}");
    }
}

#[test]
fn base_urls_are_http_or_https() {
    let e = parse("[upstream]\nbase_url = \"ftp://localhost\"\n").unwrap_err();
    assert_eq!((e.line, e.field.as_str()), (2, "upstream.base_url"));
    assert!(e.message.contains("http:// or https://"), "{e}");
    let c = parse("[upstream]\nbase_url = \"https://api.example.com/v1/\"\n").unwrap();
    assert_eq!(
        c.upstream.target,
        UpstreamTarget::Http {
            base_url: "https://api.example.com/v1".into(),
            api_key_env: None,
            ca_file: None,
        }
    );
}

#[test]
fn a_relative_ca_file_is_found_beside_the_config() {
    let path = tls_fixture("gateway.toml");
    let text = "[upstream]\nbase_url = \"https://localhost:8443\"\nca_file = \"ca.pem\"\n";
    let c = Config::parse_with_env(&path, text, None).unwrap();
    let UpstreamTarget::Http { ca_file, .. } = c.upstream.target else {
        panic!("not http");
    };
    assert_eq!(ca_file, Some(tls_fixture("ca.pem")));
}

#[test]
fn a_ca_file_gone_by_start_stops_the_gateway() {
    let config = UpstreamConfig {
        target: UpstreamTarget::Http {
            base_url: "https://localhost:8443".into(),
            api_key_env: None,
            ca_file: Some("/no/such/ca.pem".into()),
        },
        timeout: Duration::from_secs(1),
    };
    let e = Upstream::from_config(&config, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("upstream.ca_file: cannot read /no/such/ca.pem"),
        "{e}"
    );
}

#[test]
fn check_config_shows_the_ca_file() {
    let path = std::env::temp_dir().join(format!("floodgate-https-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "[upstream]\nbase_url = \"https://api.example.com\"\nca_file = \"{}\"\n",
            tls_fixture("ca.pem").display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("upstream: https://api.example.com"),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "upstream CA file: {}",
            tls_fixture("ca.pem").display()
        )),
        "{stdout}"
    );
}

#[tokio::test]
async fn a_connection_whose_response_has_no_body_is_reused() {
    // hyper never polls an empty body, so the connection must go back to the pool without it:
    // each 204 used to close its connection (a new TLS handshake, a socket in TIME-WAIT).
    let up = tls_upstream().await;
    let gw = gateway(&with_ca(), &up.https_url()).await;
    for _ in 0..3 {
        let r = gw
            .send(gw.request("DELETE", "/v1/empty", Some("sk-k"), ""))
            .await;
        assert_eq!(r.status, 204, "{}", r.text());
        assert!(r.header("x-ratelimit-remaining-requests").is_some());
    }
    assert_eq!(
        up.seen.tls_handshakes(),
        1,
        "one connection for three requests"
    );
}

#[tokio::test]
async fn a_connection_idle_past_four_seconds_is_not_reused() {
    // Upstreams such as uvicorn and Node close idle connections after 5 s: reusing one at that
    // moment fails the request. The pool reuses a connection for 4 s only.
    let up = tls_upstream().await;
    let gw = gateway(&with_ca(), &up.https_url()).await;
    let models = || gw.request("GET", "/v1/models", Some("sk-k"), "");
    assert_eq!(gw.send(models()).await.status, 200);
    assert_eq!(gw.send(models()).await.status, 200);
    assert_eq!(up.seen.tls_handshakes(), 1, "reused while fresh");
    tokio::time::sleep(Duration::from_millis(4_200)).await;
    assert_eq!(gw.send(models()).await.status, 200);
    assert_eq!(
        up.seen.tls_handshakes(),
        2,
        "a new connection after 4 s idle"
    );
}
