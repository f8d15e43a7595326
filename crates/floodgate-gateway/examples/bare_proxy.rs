//! A bare HTTP/1 proxy on the gateway's own stack, doing nothing but proxy: the ceiling any
//! gateway built on it can reach, measured by `scripts/bench-gateway` with `BARE=1` (target
//! `hyper_bare`) beside nginx as a plain hop.
//!
//! It has the gateway's shape (docs/design.md §9): worker threads, each a single-threaded tokio
//! runtime with its own `SO_REUSEPORT` listener and its own kept-alive upstream connections
//! (hyper's HTTP/1 client, each connection driven by a task of its own, as the gateway's pool
//! drives them), the response body streamed back as it comes. No keys, limits, headers,
//! metering or logs.
//!
//! `cargo run --release -p floodgate-gateway --example bare_proxy -- LISTEN UPSTREAM WORKERS`,
//! say `127.0.0.1:48009 127.0.0.1:48001 2`.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpSocket, TcpStream};

type Idle = Rc<RefCell<Vec<SendRequest<Incoming>>>>;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args.next().ok_or("LISTEN missing")?.parse()?;
    let upstream: SocketAddr = args.next().ok_or("UPSTREAM missing")?.parse()?;
    let workers: usize = args.next().map_or(Ok(2), |w| w.parse())?;
    let threads: Vec<_> = (0..workers)
        .map(|_| std::thread::spawn(move || worker(listen, upstream)))
        .collect();
    for t in threads {
        t.join().map_err(|_| "a worker panicked")??;
    }
    Ok(())
}

fn worker(listen: SocketAddr, upstream: SocketAddr) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let socket = TcpSocket::new_v4().map_err(|e| e.to_string())?;
        socket.set_reuseport(true).map_err(|e| e.to_string())?;
        socket.bind(listen).map_err(|e| e.to_string())?;
        let listener = socket.listen(1024).map_err(|e| e.to_string())?;
        let idle: Idle = Rc::default();
        loop {
            let (stream, _) = listener.accept().await.map_err(|e| e.to_string())?;
            let _ = stream.set_nodelay(true);
            let idle = Rc::clone(&idle);
            tokio::task::spawn_local(async move {
                let service = service_fn(move |req| proxy(req, upstream, Rc::clone(&idle)));
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}

async fn proxy(
    req: Request<Incoming>,
    upstream: SocketAddr,
    idle: Idle,
) -> Result<Response<Returning>, String> {
    let popped = idle.borrow_mut().pop();
    let mut conn = match popped {
        Some(c) => c,
        None => connect(upstream).await?,
    };
    conn.ready().await.map_err(|e| e.to_string())?;
    let response = conn.send_request(req).await.map_err(|e| e.to_string())?;
    // Back in the list when the response body is done with (the gateway's pool does the same).
    Ok(response.map(|body| Returning {
        body,
        conn: Some(conn),
        idle,
    }))
}

/// A response body that puts its connection back in the idle list when dropped.
struct Returning {
    body: Incoming,
    conn: Option<SendRequest<Incoming>>,
    idle: Idle,
}

impl hyper::body::Body for Returning {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.idle.borrow_mut().push(conn);
        }
    }
}

async fn connect(upstream: SocketAddr) -> Result<SendRequest<Incoming>, String> {
    let tcp = TcpStream::connect(upstream)
        .await
        .map_err(|e| e.to_string())?;
    let _ = tcp.set_nodelay(true);
    let (conn, driver) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| e.to_string())?;
    tokio::task::spawn_local(driver);
    Ok(conn)
}
