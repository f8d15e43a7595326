//! Graceful shutdown: requests in flight (streams included) finish; new ones are not accepted.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

#[tokio::test]
async fn shutdown_drains_a_stream_in_flight() {
    let up = fake_upstream().await;
    let mut gw = gateway(
        r#"
[upstream]
base_url = "{upstream}"
[[keys]]
id = "k"
secret = "sk-k"
[[rate_limits]]
scope = "key"
id = "k"
tpm = 1000
"#,
        &up.url(),
    )
    .await;
    let mut req = gw.request("POST", "/v1/chat/completions", Some("sk-k"), CHAT_STREAM);
    req.headers_mut()
        .insert("x-test-last-delay-ms", "600".parse().unwrap());
    let stream = gw.frames(req);
    let stop = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        gw.shutdown();
    };
    let ((status, _, frames), ()) = tokio::join!(stream, stop);
    assert_eq!(status, 200);
    let body: Vec<u8> = frames.iter().flat_map(|(_, b)| b.to_vec()).collect();
    assert_eq!(
        events(&body).last().map(String::as_str),
        Some("[DONE]"),
        "the stream ran to its end"
    );
    let server = gw.server.take().unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stops once drained")
        .unwrap()
        .unwrap();
    assert!(tokio::net::TcpStream::connect(gw.addr).await.is_err());
}

#[cfg(unix)]
#[tokio::test]
async fn sigterm_drains_and_exits_cleanly() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let path = std::env::temp_dir().join(format!("floodgate-sigterm-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[upstream]\ndemo = true\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(&addr).await.is_err() {
        assert!(Instant::now() < deadline, "the gateway did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<axum::body::Body>();
    let req = axum::http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", "Bearer sk-k")
        .body(axum::body::Body::from(CHAT_STREAM))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(events(&body).last().map(String::as_str), Some("[DONE]"));
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the gateway did not exit");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = std::fs::remove_file(&path);
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn a_second_sigterm_during_the_drain_exits_at_once_and_says_so() {
    // An upstream that accepts and never answers: the request stays in flight, so the drain
    // would wait its full 30 s.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = silent.local_addr().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let path = std::env::temp_dir().join(format!("floodgate-sigterm2-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[upstream]\nbase_url = \"http://{upstream}\"\ntimeout_sec = 60\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n"
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(&addr).await.is_err() {
        assert!(Instant::now() < deadline, "the gateway did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut conn,
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-k\r\n\r\n",
    )
    .await
    .unwrap();
    // The request reached the upstream (accept polled, so a mistake fails instead of hanging).
    silent.set_nonblocking(true).unwrap();
    let accepted = Instant::now() + Duration::from_secs(10);
    let _held = loop {
        match silent.accept() {
            Ok((held, _)) => break held,
            Err(_) if Instant::now() < accepted => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("the request never reached the upstream: {e}"),
        }
    };
    let pid = child.id().to_string();
    let term = || {
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        )
    };
    term();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        child.try_wait().unwrap().is_none(),
        "the first SIGTERM drains"
    );
    term();
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "a second SIGTERM did not end the drain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = std::fs::remove_file(&path);
    assert!(
        !status.success(),
        "requests were cut: not a clean exit ({status:?})"
    );
}

#[tokio::test]
async fn a_port_another_gateway_listens_on_is_refused() {
    // Another gateway's workers hold the port with SO_REUSEPORT, which would let a second one
    // bind too and split the traffic (and every limit) between them.
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.set_reuseport(true).unwrap();
    other.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = other.local_addr().unwrap().port();
    let _listening = other.listen(16).unwrap();
    let path = std::env::temp_dir().join(format!("floodgate-taken-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!("[server]\nlisten = \"127.0.0.1:{port}\"\nworkers = 2\n[upstream]\ndemo = true\n"),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a second gateway started on a taken port");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = std::fs::remove_file(&path);
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("cannot listen on"), "{err}");
}
