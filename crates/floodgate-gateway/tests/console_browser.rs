//! The console in a real browser: `floodgate serve` with an admin listener, and
//! `tests/console/browser.py` driving headless Chromium through Playwright against it (sign
//! in, a usage bar moving, an alert with its count, the alerts of more keys than a page holds
//! read a page at a time, a reset and the next request passing).
//! Screenshots of each page land in `<target>/tmp/console-screenshots/`.
//!
//! Needs `python3` with the `playwright` package and Debian's `chromium` (`scripts/test`
//! installs them). Without them the test says so and passes, unless
//! `FLOODGATE_REQUIRE_BROWSER=1` (CI), when it fails.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{BinaryConfig, binary_config, serve_binary, wait_for_port};

/// The exit status of browser.py when it cannot run at all.
const CANNOT_RUN: i32 = 77;
/// Keys refused beside alice: more than the console's page of 50 alerts.
const MANY: usize = 60;

fn required() -> bool {
    std::env::var("FLOODGATE_REQUIRE_BROWSER").is_ok_and(|v| v == "1")
}

#[test]
fn the_console_in_headless_chromium() {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    let many: String = (0..MANY)
        .map(|i| {
            format!(
                "[[keys]]\nid = \"many-{i:02}\"\nsecret = \"sk-many-{i:02}-browser\"\n\
                 rate_limit = {{ requests = 1 }}\n"
            )
        })
        .collect();
    let BinaryConfig {
        file,
        port,
        admin_port,
        ..
    } = binary_config(
        "console-browser",
        &(r#"
secret = "sk-ops-browser"
[upstream]
demo = true
[[keys]]
id = "alice"
secret = "sk-alice-browser"
org = "acme"
rate_limit = { requests = 3, window_sec = 86400 }
[[keys]]
id = "bob"
secret = "sk-bob-browser"
org = "acme"
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 100
tpm = 100000
"#
        .to_owned()
            + &many),
    );
    let mut gateway = serve_binary(&file);
    wait_for_port(port, &mut gateway);
    wait_for_port(admin_port, &mut gateway);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/console/browser.py");
    let ran = Command::new("python3")
        .arg(&script)
        .args(["--admin", &format!("http://127.0.0.1:{admin_port}")])
        .args(["--gateway", &format!("http://127.0.0.1:{port}")])
        .args(["--secret", "sk-ops-browser"])
        .args(["--key", "sk-alice-browser", "--key-id", "alice"])
        .args(["--many", &MANY.to_string()])
        .arg("--out")
        .arg(&out)
        .status();
    let _ = gateway.kill();
    let _ = gateway.wait();
    let status = match ran {
        Ok(s) => s,
        Err(e) => {
            assert!(
                !required(),
                "FLOODGATE_REQUIRE_BROWSER=1 but no python3: {e}"
            );
            eprintln!("the_console_in_headless_chromium: skipped, no python3 ({e})");
            return;
        }
    };
    if status.code() == Some(CANNOT_RUN) {
        assert!(
            !required(),
            "FLOODGATE_REQUIRE_BROWSER=1 but the browser test cannot run (see above)"
        );
        eprintln!("the_console_in_headless_chromium: skipped, no Playwright or Chromium");
        return;
    }
    assert!(status.success(), "the browser test failed: {status}");
    for page in [
        "signin.png",
        "usage.png",
        "notifications.png",
        "notifications-page-2.png",
    ] {
        assert!(out.join(page).is_file(), "no screenshot {page}");
    }
}
