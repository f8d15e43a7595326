//! The console in a real browser: `floodgate serve` with an admin listener, and
//! `tests/console/browser.py` driving headless Chromium through Playwright against it (sign
//! in, a usage bar moving, an alert with its count, a reset and the next request passing).
//! Screenshots of each page land in `<target>/tmp/console-screenshots/`.
//!
//! Needs `python3` with the `playwright` package and Debian's `chromium` (`scripts/test`
//! installs them). Without them the test says so and passes, unless
//! `FLOODGATE_REQUIRE_BROWSER=1` (CI), when it fails.

mod common;

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{free_port, serve_binary};

/// The exit status of browser.py when it cannot run at all.
const CANNOT_RUN: i32 = 77;

fn required() -> bool {
    std::env::var("FLOODGATE_REQUIRE_BROWSER").is_ok_and(|v| v == "1")
}

/// Waits until something accepts connections on `port` (the binary is up), for at most 30 s.
fn wait_for_port(port: u16, child: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "floodgate exited before listening"
        );
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_console_in_headless_chromium() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-browser");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let file = dir.join("floodgate.toml");
    std::fs::write(
        &file,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
workers = 1
[admin]
listen = "127.0.0.1:{admin_port}"
secret = "sk-ops-browser"
[upstream]
demo = true
[[keys]]
id = "alice"
secret = "sk-alice-browser"
org = "acme"
rate_limit = {{ requests = 3 }}
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
        ),
    )
    .unwrap();
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
    for page in ["signin.png", "usage.png", "notifications.png"] {
        assert!(out.join(page).is_file(), "no screenshot {page}");
    }
}
