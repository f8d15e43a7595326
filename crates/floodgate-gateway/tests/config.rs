//! Bad configs are refused with the file, the line and the field: one fixture per mistake in
//! `tests/bad-configs/`, each listed here with where its error must point.

use std::path::{Path, PathBuf};
use std::process::Command;

use floodgate_gateway::Config;

/// `(fixture, line, field)`.
const CASES: &[(&str, usize, &str)] = &[
    ("alerts-path-in-missing-directory.toml", 5, "alerts.path"),
    ("alerts-path-on-redis.toml", 9, "alerts.path"),
    ("alerts-secret-of-a-key.toml", 9, "alerts.secret"),
    ("alerts-zero-flush.toml", 5, "alerts.flush_sec"),
    ("admin-secret-of-a-key.toml", 9, "admin.secret"),
    ("admin-secret-of-the-alerts.toml", 8, "admin.secret"),
    ("api-key-env-not-a-name.toml", 3, "upstream.api_key_env"),
    ("bad-backend.toml", 2, "backend"),
    ("tokens-unknown-mode.toml", 5, "gateway.tokens"),
    (
        "default-max-output-tokens-zero.toml",
        5,
        "gateway.default_max_output_tokens",
    ),
    ("tokens-without-tpm.toml", 8, "rate_limits[0].tokens"),
    (
        "rate-limit-tokens-unknown-mode.toml",
        8,
        "rate_limits[0].tokens",
    ),
    ("bad-listen.toml", 2, "server.listen"),
    ("bad-secret-sha256.toml", 6, "keys[0].secret_sha256"),
    ("ca-file-missing.toml", 4, "upstream.ca_file"),
    ("ca-file-with-demo.toml", 3, "upstream.ca_file"),
    ("ca-file-with-http.toml", 4, "upstream.ca_file"),
    ("ca-file-without-certificates.toml", 4, "upstream.ca_file"),
    ("duplicate-key-id.toml", 9, "keys[1].id"),
    ("duplicate-rate-limit.toml", 10, "rate_limits[1].scope"),
    ("ftp-upstream.toml", 2, "upstream.base_url"),
    ("credentials-in-upstream-url.toml", 3, "upstream.base_url"),
    ("upstream-bad-port.toml", 2, "upstream.base_url"),
    ("upstream-port-not-a-number.toml", 2, "upstream.base_url"),
    ("upstream-url-with-query.toml", 2, "upstream.base_url"),
    ("upstream-timeout-too-long.toml", 4, "upstream.timeout_sec"),
    ("secret-not-a-string.toml", 6, "secret"),
    ("secret-quoted-not-a-string.toml", 6, "secret"),
    ("admin-secret-dotted-not-a-string.toml", 1, "admin.secret"),
    ("redis-urls-not-a-list.toml", 6, "urls"),
    ("admin-host-with-port.toml", 5, "admin.hosts"),
    ("admin-listen-on-the-gateways-port.toml", 8, "admin.listen"),
    ("admin-host-not-a-string-over-lines.toml", 7, "hosts"),
    ("customer-id-not-ascii.toml", 6, "rate_limits[0].id"),
    ("redis-url-bad-port.toml", 3, "store.url"),
    ("redis-url-with-memory.toml", 2, "store.url"),
    ("missing-upstream.toml", 1, "upstream"),
    ("negative-requests.toml", 7, "requests"),
    ("neither-rpm-nor-tpm.toml", 4, "rate_limits[0].rpm"),
    ("no-secret.toml", 4, "keys[0].secret"),
    ("no-upstream-target.toml", 1, "upstream.base_url"),
    ("rate-limit-for-unknown-key.toml", 10, "rate_limits[0].id"),
    ("rate-limit-not-a-table.toml", 6, "rate_limit"),
    ("redis-without-url.toml", 2, "store.url"),
    (
        "realtime-zero-max-connections.toml",
        5,
        "realtime.max_connections",
    ),
    (
        "realtime-negative-max-connections.toml",
        6,
        "realtime.max_connections",
    ),
    ("realtime-drain-too-long.toml", 2, "realtime.drain_sec"),
    ("realtime-unknown-field.toml", 5, "max_sessions"),
    ("rpm-wrong-type.toml", 7, "rpm"),
    ("secret-and-hash.toml", 6, "keys[0].secret"),
    ("secret-with-a-space.toml", 6, "keys[0].secret"),
    ("shared-secret.toml", 10, "keys[1].secret"),
    ("shared-secret-by-hash.toml", 11, "keys[1].secret_sha256"),
    ("team-without-org.toml", 7, "keys[0].org"),
    ("unknown-field.toml", 3, "port"),
    ("unknown-rate-limit-field.toml", 5, "burst"),
    ("unknown-scope.toml", 5, "rate_limits[0].scope"),
    ("unterminated-string.toml", 5, "id"),
    ("zero-header-timeout.toml", 2, "server.header_timeout_sec"),
    (
        "max-buffered-below-four-bodies.toml",
        3,
        "server.max_buffered_mib",
    ),
    ("max-connections-zero.toml", 2, "server.max_connections"),
    (
        "max-in-flight-zero.toml",
        7,
        "keys[0].rate_limit.max_in_flight",
    ),
    (
        "max-in-flight-zero-rate-limits.toml",
        6,
        "rate_limits[0].max_in_flight",
    ),
    ("lease-too-short.toml", 2, "store.lease_sec"),
    ("max-body-too-large.toml", 3, "server.max_body_mib"),
    ("zero-window.toml", 7, "keys[0].rate_limit.window_sec"),
    ("budget-negative-usd.toml", 8, "budgets[0].usd"),
    ("budget-usd-below-a-micro-dollar.toml", 8, "budgets[0].usd"),
    ("budget-usd-not-finite.toml", 7, "budgets[0].usd"),
    ("budget-unknown-period.toml", 7, "budgets[0].period"),
    ("budget-unknown-scope.toml", 5, "budgets[0].scope"),
    ("duplicate-budget.toml", 13, "budgets[1].period"),
    ("budget-for-unknown-key.toml", 10, "budgets[0].id"),
    ("duplicate-price.toml", 10, "prices[1].model"),
    ("negative-price.toml", 7, "prices[0].output_per_million"),
    (
        "price-below-the-precision.toml",
        6,
        "prices[0].input_per_million",
    ),
    ("price-not-a-number.toml", 6, "prices[0].input_per_million"),
    ("unknown-budget-field.toml", 9, "eur"),
    ("table-written-twice.toml", 7, "server"),
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/bad-configs")
}

#[test]
fn every_bad_config_names_file_line_and_field() {
    for (file, line, field) in CASES {
        let path = fixtures().join(file);
        let err = Config::parse_with_env(&path, &std::fs::read_to_string(&path).unwrap(), None)
            .expect_err(file);
        assert_eq!(
            (err.line, err.field.as_str()),
            (*line, *field),
            "{file}: {err}"
        );
        let shown = err.to_string();
        assert!(
            shown.starts_with(&format!("{}:{line}:", path.display())),
            "{file}: {shown}"
        );
        assert!(shown.contains(&format!("field `{field}`")), "{shown}");
    }
}

#[test]
fn a_file_that_is_not_utf8_is_refused_where_it_stops_being_text() {
    let path = std::env::temp_dir().join(format!("floodgate-latin1-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        b"[upstream]\ndemo = true\n[[keys]]\nid = \"caf\xe9\"\nsecret = \"sk-k\"\n",
    )
    .unwrap();
    let err = Config::load(&path).expect_err("a byte that is not UTF-8");
    std::fs::remove_file(&path).unwrap();
    assert_eq!((err.line, err.column), (4, 10), "{err}");
    assert!(err.to_string().contains("not UTF-8"), "{err}");
}

#[test]
fn a_key_toml_cannot_read_says_so_and_a_url_in_a_field_of_choices_is_not_echoed() {
    let err = Config::parse_with_env("key.toml", "[upstream]\ndemo = true\né = 5\n", None)
        .expect_err("a key with a character TOML does not take unquoted")
        .to_string();
    assert!(err.contains("unquoted key"), "toml's own words: {err}");
    assert!(
        !err.contains("not shown"),
        "nothing of a value to hide: {err}"
    );
    let text = "[store]\nbackend = \"redis://:hunter2@db:6379/0\"\n[upstream]\ndemo = true\n";
    let err = Config::parse_with_env("backend.toml", text, None)
        .expect_err("a URL is not a backend")
        .to_string();
    assert!(!err.contains("hunter2"), "{err}");
    assert!(err.contains("memory"), "the choices are still named: {err}");
    // A misspelt choice is still shown.
    let text = "[store]\nbackend = \"memroy\"\n[upstream]\ndemo = true\n";
    let err = Config::parse_with_env("typo.toml", text, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("memroy"), "{err}");
}

#[test]
fn the_config_reference_in_the_docs_is_a_valid_config() {
    // docs/gateway.md's reference, every field at once, is what operators copy from.
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/gateway.md");
    let docs = std::fs::read_to_string(docs).unwrap();
    let block = docs
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the reference's toml block");
    let file = std::env::temp_dir().join("floodgate-reference.toml");
    let config = Config::parse_with_env(&file, block, None);
    assert!(config.is_ok(), "{}", config.unwrap_err());
}

#[test]
fn errors_never_echo_what_may_be_a_secret() {
    let path = fixtures().join("api-key-env-not-a-name.toml");
    let err = Config::parse_with_env(&path, &std::fs::read_to_string(&path).unwrap(), None)
        .unwrap_err()
        .to_string();
    assert!(!err.contains("sk-proj-abc123"), "{err}");
    let path = fixtures().join("shared-secret.toml");
    let err = Config::parse_with_env(&path, &std::fs::read_to_string(&path).unwrap(), None)
        .unwrap_err()
        .to_string();
    assert!(!err.contains("sk-1"), "{err}");
    assert!(err.contains("also keys[0]"), "{err}");
    for (file, secret) in [
        ("secret-not-a-string.toml", "8675309"),
        ("secret-quoted-not-a-string.toml", "8675309"),
        ("admin-secret-dotted-not-a-string.toml", "8675309"),
        ("redis-urls-not-a-list.toml", "hunter2"),
        ("upstream-url-with-query.toml", "sk-live-123"),
        ("admin-secret-of-a-key.toml", "sk-alice"),
        ("admin-secret-of-the-alerts.toml", "sk-ops"),
        ("alerts-secret-of-a-key.toml", "sk-alice"),
    ] {
        let path = fixtures().join(file);
        let err = Config::parse_with_env(&path, &std::fs::read_to_string(&path).unwrap(), None)
            .unwrap_err()
            .to_string();
        assert!(!err.contains(secret), "{file}: {err}");
    }
}

#[test]
fn a_redis_url_in_the_environment_on_the_memory_store_is_warned_about() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(root.join("examples/quickstart.toml"))
        .env("FLOODGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("warning: FLOODGATE_REDIS_URL is set, but the store is memory"),
        "{stdout}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(root.join("examples/quickstart.toml"))
        .env_remove("FLOODGATE_REDIS_URL")
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("warning: FLOODGATE_REDIS_URL"));
}

#[test]
fn a_value_of_the_wrong_shape_says_what_was_expected() {
    let path = fixtures().join("rate-limit-not-a-table.toml");
    let err = Config::parse_with_env(&path, &std::fs::read_to_string(&path).unwrap(), None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "expected a table like { requests = 100, window_sec = 60, max_in_flight = 10 }"
        ),
        "{err}"
    );
    assert!(!err.contains("Raw"), "no internal names: {err}");
}

#[test]
fn every_fixture_has_a_case() {
    for entry in std::fs::read_dir(fixtures()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert!(
            CASES.iter().any(|(f, ..)| *f == name),
            "{name} has no expected line and field in CASES"
        );
    }
}

#[test]
fn check_config_exits_non_zero_and_says_where() {
    let path = fixtures().join("zero-window.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}:7:", path.display()))
            && stderr.contains("keys[0].rate_limit.window_sec"),
        "{stderr}"
    );
}

#[test]
fn check_config_into_a_closed_pipe_ends_quietly() {
    // `check-config FILE | head` closes the pipe early: the report stops there, without a panic.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(root.join("examples/quickstart.toml"))
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn check_config_prints_chains_but_never_secrets() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut examples: Vec<PathBuf> = std::fs::read_dir(root.join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    examples.sort();
    assert!(!examples.is_empty());
    for path in examples {
        let text = std::fs::read_to_string(&path).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .arg("check-config")
            .arg(&path)
            .env("FLOODGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("OK"), "{stdout}");
        for line in text.lines() {
            if let Some(secret) = line.trim().strip_prefix("secret = ") {
                let secret = secret.trim_matches('"');
                assert!(
                    !stdout.contains(secret),
                    "{} leaks {secret}",
                    path.display()
                );
            }
        }
    }
    let quickstart = root.join("examples/quickstart.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(&quickstart)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("key alice"), "{stdout}");
    assert!(stdout.contains("5 requests / 60s"), "{stdout}");
}

#[test]
fn scope_ids_are_trimmed_like_key_ids() {
    // A stray space must not make a second org whose limits no key shares.
    let text = r#"
[upstream]
demo = true
[[keys]]
id = " alice "
secret = "sk-a"
org = "acme "
team = " ml"
[[rate_limits]]
scope = "org"
id = " acme"
rpm = 10
[[rate_limits]]
scope = "key"
id = "alice "
rpm = 5
"#;
    let c = Config::parse_with_env("inline.toml", text, None).unwrap();
    let k = &c.keys[0];
    assert_eq!(
        (k.id.as_str(), k.org.as_deref(), k.team.as_deref()),
        ("alice", Some("acme"), Some("ml"))
    );
    let ids: Vec<&str> = c.limits.keys().map(|(_, id)| id.as_str()).collect();
    assert!(ids.contains(&"acme") && ids.contains(&"alice"), "{ids:?}");
}

#[test]
fn a_bad_redis_url_is_a_config_error_wherever_it_comes_from() {
    let text = "[store]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:6379/0\"\n[upstream]\ndemo = true\n";
    assert!(Config::parse_with_env("ok.toml", text, None).is_ok());
    let err = Config::parse_with_env("env.toml", text, Some("http://127.0.0.1:6379".into()))
        .expect_err("FLOODGATE_REDIS_URL=http://... is refused");
    assert_eq!(err.field, "store.url");
    assert!(err.to_string().contains("FLOODGATE_REDIS_URL"), "{err}");
    let shown = Config::parse_with_env(
        "pw.toml",
        &text.replace(
            "redis://127.0.0.1:6379/0",
            "redis://:hunter2@127.0.0.1:nope/0",
        ),
        None,
    )
    .expect_err("a bad port is refused")
    .to_string();
    assert!(!shown.contains("hunter2"), "{shown}");
    // A password with a `?` in it, unencoded, in the file, the environment or a cluster's seeds.
    let bad = "redis://:hunter?2@127.0.0.1:nope/0";
    let cluster = text.replace(
        "url = \"redis://127.0.0.1:6379/0\"",
        &format!("urls = [\"{bad}\"]"),
    );
    for shown in [
        Config::parse_with_env(
            "q.toml",
            &text.replace("redis://127.0.0.1:6379/0", bad),
            None,
        ),
        Config::parse_with_env("qenv.toml", text, Some(bad.into())),
        Config::parse_with_env("qcluster.toml", &cluster, None),
    ] {
        let shown = shown.expect_err("a bad port is refused").to_string();
        assert!(!shown.contains("hunter"), "{shown}");
    }
    // A Unix socket's URL carries its password as a query parameter.
    let shown = Config::parse_with_env(
        "unix.toml",
        &text.replace(
            "redis://127.0.0.1:6379/0",
            "unix:///run/redis.sock?db=one&pass=hunter2",
        ),
        None,
    )
    .expect_err("a bad database number is refused")
    .to_string();
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("pass=***"), "{shown}");
}

#[test]
fn a_limit_on_a_team_no_key_belongs_to_is_warned_about() {
    let path = std::env::temp_dir().join(format!("floodgate-nobody-{}.toml", std::process::id()));
    let text = "[upstream]\ndemo = true\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\norg = \"acme\"\nteam = \"ml\"\n[[rate_limits]]\nscope = \"team\"\nid = \"{team}\"\nrpm = 5\n";
    let check = |team: &str| {
        std::fs::write(&path, text.replace("{team}", team)).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .arg("check-config")
            .arg(&path)
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let typo = check("ml-typo");
    let fine = check("ml");
    let _ = std::fs::remove_file(&path);
    assert!(
        typo.contains("warning: no key belongs to team `ml-typo`: its limits apply to nobody"),
        "{typo}"
    );
    assert!(!fine.contains("warning"), "{fine}");
}

#[test]
fn an_upstream_key_variable_that_is_set_but_empty_stops_serve() {
    let path =
        std::env::temp_dir().join(format!("floodgate-empty-key-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[server]\nlisten = \"127.0.0.1:0\"\n[upstream]\nbase_url = \"http://127.0.0.1:9\"\napi_key_env = \"FLOODGATE_TEST_EMPTY_KEY\"\n",
    )
    .unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(&path)
        .env("FLOODGATE_TEST_EMPTY_KEY", " ")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(
        stdout.contains("$FLOODGATE_TEST_EMPTY_KEY (REFUSED") && stdout.contains("is empty"),
        "{stdout}"
    );
    let mut serve = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("FLOODGATE_TEST_EMPTY_KEY", " ")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A gateway that started anyway would serve until killed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            serve.kill().unwrap();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    std::fs::remove_file(&path).unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut serve.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        status.is_some_and(|s| !s.success()),
        "serve started: {stderr}"
    );
    assert!(
        stderr.contains("the environment variable FLOODGATE_TEST_EMPTY_KEY is empty"),
        "{stderr}"
    );
}

#[test]
fn check_config_prints_prices_and_each_keys_budgets() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(root.join("examples/upstream.toml"))
        .env("UPSTREAM_API_KEY", "x")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in [
        "gpt-4o-mini                    0.15 / 0.6",
        "*                              2.5 / 10",
        "project       batch            budget $25.00 per day",
        "org           acme             budget $2000.00 per month",
    ] {
        assert!(stdout.contains(line), "{line:?} in {stdout}");
    }
    // Its one warning: budgets on the memory store start from zero at a restart.
    let warnings: Vec<&str> = stdout.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(
        warnings,
        [
            "warning: budgets are kept on the memory store: their spend starts from zero at every restart; use the redis store to keep it across restarts"
        ],
        "{stdout}"
    );
    // Without a `*` price, budgets miss every model the table does not name: warned about.
    let path = std::env::temp_dir().join(format!("floodgate-nostar-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[upstream]\ndemo = true\n[[prices]]\nmodel = \"gpt-4o\"\ninput_per_million = 1\noutput_per_million = 2\n[[budgets]]\nscope = \"gateway\"\nperiod = \"day\"\nusd = 5\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("gateway budget: $5.00 per day"), "{stdout}");
    assert!(
        stdout.contains("warning: budgets are set but no `[[prices]]` entry has model = \"*\""),
        "{stdout}"
    );
}

/// `check-config` judges the upstream key as `serve` does: a key `serve` would refuse (a control
/// character, bytes that are not UTF-8, blank, unset) is reported so, never as set, and never
/// shown.
#[test]
#[cfg(unix)]
fn check_config_refuses_the_upstream_keys_serve_refuses() {
    use std::os::unix::ffi::OsStrExt;
    let path = std::env::temp_dir().join(format!("floodgate-upk-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[upstream]\nbase_url = \"http://127.0.0.1:9\"\napi_key_env = \"FG_TEST_UPK\"\n",
    )
    .unwrap();
    let report = |value: Option<&std::ffi::OsStr>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_floodgate"));
        cmd.arg("check-config").arg(&path);
        match value {
            Some(v) => cmd.env("FG_TEST_UPK", v),
            None => cmd.env_remove("FG_TEST_UPK"),
        };
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        stdout
            .lines()
            .find(|l| l.starts_with("upstream:"))
            .unwrap()
            .to_owned()
    };
    let os = |b: &'static [u8]| Some(std::ffi::OsStr::from_bytes(b));
    assert!(report(os(b"sk-good")).contains("(set)"));
    for (value, why) in [
        (os(b"sk-abc\x01def"), "not allowed in a header"),
        (os(b"sk-\xff"), "not UTF-8"),
        (os(b"  "), "is empty"),
        (None, "is not set"),
    ] {
        let line = report(value);
        assert!(line.contains("REFUSED") && line.contains(why), "{line}");
        assert!(!line.contains("sk-"), "{line}");
    }
    std::fs::remove_file(&path).unwrap();
}
