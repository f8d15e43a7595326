//! A gateway out of file descriptors: `accept` fails, the accept loop pauses, and a shutdown
//! during the pause still stops it at once. (In a file of its own: it lowers this process's
//! descriptor limit.)
#![cfg(target_os = "linux")]

use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use floodgate_gateway::{AppState, Config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_not_held_up_by_the_pause_after_a_failed_accept() {
    let config = Config::parse_with_env(
        "test.toml",
        "[upstream]\ndemo = true\n[[keys]]\nid = \"k\"\nsecret = \"sk-k\"\n",
        None,
    )
    .unwrap();
    let store = floodgate_gateway::store::open(&config.store)
        .await
        .unwrap()
        .0;
    let state = AppState::new(&config, store).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(floodgate_gateway::run(listener, state, async move {
        let _ = stopped.await;
    }));
    // The client's socket exists before the limit; connecting it takes no new descriptor.
    let socket = TcpSocket::new_v4().unwrap();

    // From here on no new descriptor can be opened: the soft limit becomes the lowest free one.
    let lowest_free = std::fs::File::open("/dev/null").unwrap().as_raw_fd();
    let lowered = Command::new("prlimit")
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg(format!("--nofile={lowest_free}:"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(lowered.success());

    // The kernel completes the handshake; the gateway's accept fails (EMFILE) and it pauses.
    let mut client = socket.connect(addr).await.unwrap();
    client
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let answered = tokio::time::timeout(Duration::from_millis(300), client.read(&mut buf)).await;
    assert!(
        answered.is_err(),
        "the connection was accepted: the descriptor limit did not bite"
    );

    // Well inside the one-second pause: the loop must stop now, not when the pause ends.
    let asked = Instant::now();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("the server stopped")
        .unwrap()
        .unwrap();
    let took = asked.elapsed();
    assert!(
        took < Duration::from_millis(400),
        "shutdown waited {took:?} for the accept pause"
    );
}
