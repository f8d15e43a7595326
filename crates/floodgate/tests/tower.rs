//! The tower layer, driven with `tower::ServiceExt::oneshot`: headers on admitted and refused
//! requests, chains and buckets, cost, unnamed requests, store failures, gRPC refusals, axum's
//! `Router::layer`, and exactly N of M concurrent requests admitted, on the memory store and,
//! when `FLOODGATE_TEST_REDIS_URL` is set, on Redis (a skip is a failure with
//! `FLOODGATE_REQUIRE_REDIS=1`). And tonic's server with the layer on a loopback port, called by
//! tonic's client.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use floodgate::clock::FakeClock;
use floodgate::store::{MemoryStore, Store};
use floodgate::tower::{ChainBuilder, OnError, RateLimitLayer, Unnamed};
use floodgate::{Rate, ScopeKind, Timestamp, TokenBucket, WindowLimit};
use tower::{Layer, Service, ServiceExt, service_fn};

/// The service behind the layer: 200, and a header to show it was called.
fn app() -> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    service_fn(|_req: Request<Body>| async {
        let mut resp = Response::new(Body::from("hello"));
        resp.headers_mut().insert("x-served", "1".parse().unwrap());
        Ok::<_, Infallible>(resp)
    })
}

/// A request from API key `key` (none: no header) and client `ip`.
fn req(key: Option<&str>, ip: &str) -> Request<Body> {
    let mut b = Request::builder().uri("/").header("x-ip", ip);
    if let Some(key) = key {
        b = b.header("x-api-key", key);
    }
    b.body(Body::empty()).unwrap()
}

fn header(name: &str) -> impl Fn(&Request<Body>) -> Option<String> + Clone + use<> {
    let name = name.to_owned();
    move |req: &Request<Body>| Some(req.headers().get(&name)?.to_str().ok()?.to_owned())
}

/// The key and the IP of a request, for a key-then-IP chain.
fn key_and_ip(req: &Request<Body>) -> Option<[String; 2]> {
    Some([header("x-api-key")(req)?, header("x-ip")(req)?])
}

fn h<'a>(resp: &'a Response<Body>, name: &str) -> Option<&'a str> {
    resp.headers().get(name).map(|v| v.to_str().unwrap())
}

/// One request through `$layer` wrapped around a fresh [`app`].
macro_rules! call {
    ($layer:expr, $req:expr) => {
        $layer.layer(app()).oneshot($req).await.unwrap()
    };
}

#[tokio::test]
async fn a_chain_sends_the_gateways_headers_on_200_and_429() {
    // As the gateway's own header test: 30 s into a minute bucket, after 5 requests the 6th
    // passes in (60 - 30) + 60 * (1 - 4/5) = 42 s.
    let clock = FakeClock::new(Timestamp::from_secs(6000 + 30));
    let store = MemoryStore::with_clock(clock);
    let limits = ChainBuilder::new("api").limit(ScopeKind::Key, WindowLimit::per_minute(5));
    let layer = RateLimitLayer::new(store, limits, |r: &Request<Body>| {
        Some([header("x-api-key")(r)?])
    });

    let first = call!(layer, req(Some("alice"), "192.0.2.1"));
    assert_eq!(first.status(), 200);
    assert_eq!(h(&first, "x-served"), Some("1"));
    assert_eq!(h(&first, "x-ratelimit-limit"), Some("5"));
    assert_eq!(h(&first, "x-ratelimit-remaining"), Some("4"));
    assert_eq!(h(&first, "ratelimit-policy"), Some("\"key\";q=5;w=60"));
    assert_eq!(h(&first, "ratelimit"), Some("\"key\";r=4;t=90"));
    assert_eq!(h(&first, "x-ratelimit-limit-requests"), Some("5"));
    assert_eq!(h(&first, "x-ratelimit-remaining-requests"), Some("4"));
    assert_eq!(h(&first, "x-ratelimit-reset-requests"), Some("1m30s"));
    assert_eq!(h(&first, "retry-after"), None);
    for _ in 0..4 {
        assert_eq!(call!(layer, req(Some("alice"), "192.0.2.1")).status(), 200);
    }

    let refused = call!(layer, req(Some("alice"), "192.0.2.1"));
    assert_eq!(refused.status(), 429);
    assert_eq!(h(&refused, "x-served"), None, "the service is not called");
    assert_eq!(h(&refused, "x-ratelimit-remaining"), Some("0"));
    assert_eq!(h(&refused, "ratelimit"), Some("\"key\";r=0;t=42"));
    assert_eq!(h(&refused, "x-ratelimit-reset-requests"), Some("42s"));
    assert_eq!(h(&refused, "retry-after"), Some("42"));
    assert_eq!(h(&refused, "retry-after-ms"), Some("42000"));
    assert_eq!(h(&refused, "grpc-status"), None);

    // Another key has its own count.
    assert_eq!(call!(layer, req(Some("bob"), "192.0.2.1")).status(), 200);
}

#[tokio::test]
async fn a_refusal_by_one_scope_charges_no_other() {
    let limits = ChainBuilder::new("api")
        .limit(ScopeKind::Key, WindowLimit::per_minute(3))
        .limit(ScopeKind::Customer, WindowLimit::per_minute(2));
    // On a minute's edge: a limit spent now is whole again in 2 windows.
    let store = MemoryStore::with_clock(FakeClock::new(Timestamp::from_secs(6000)));
    let layer = RateLimitLayer::new(store, limits, key_and_ip);
    for _ in 0..2 {
        assert_eq!(call!(layer, req(Some("alice"), "192.0.2.1")).status(), 200);
    }
    // The IP is spent; the key, with one left, must not be charged for this refusal.
    let refused = call!(layer, req(Some("alice"), "192.0.2.1"));
    assert_eq!(refused.status(), 429);
    assert_eq!(
        h(&refused, "ratelimit-policy"),
        Some("\"customer\";q=2;w=60")
    );
    let other_ip = call!(layer, req(Some("alice"), "192.0.2.2"));
    assert_eq!(other_ip.status(), 200, "the key still had one request");
    assert_eq!(h(&other_ip, "ratelimit"), Some("\"key\";r=0;t=120"));
    let spent = call!(layer, req(Some("alice"), "192.0.2.3"));
    assert_eq!(spent.status(), 429);
    assert_eq!(h(&spent, "ratelimit-policy"), Some("\"key\";q=3;w=60"));
}

#[tokio::test]
async fn a_bucket_per_name_with_a_cost() {
    const API: TokenBucket<str> = TokenBucket::new("api", 5, Rate::per_second(1));
    let layer = RateLimitLayer::new(MemoryStore::new(), API, header("x-api-key"))
        .cost(|_: &Request<Body>| 2);
    let first = call!(layer, req(Some("alice"), "192.0.2.1"));
    assert_eq!(first.status(), 200);
    assert_eq!(h(&first, "x-ratelimit-remaining"), Some("3"));
    assert_eq!(h(&first, "ratelimit-policy"), Some("\"api\";q=5;w=5"));
    assert_eq!(call!(layer, req(Some("alice"), "192.0.2.1")).status(), 200);
    let refused = call!(layer, req(Some("alice"), "192.0.2.1"));
    assert_eq!(refused.status(), 429);
    assert_eq!(h(&refused, "x-ratelimit-remaining"), Some("0"));
    let ms: u64 = h(&refused, "retry-after-ms").unwrap().parse().unwrap();
    assert!(ms > 0 && ms <= 1000, "one token short: {ms} ms");
    assert_eq!(h(&refused, "retry-after"), Some("1"));
    // bob's bucket is his own.
    assert_eq!(call!(layer, req(Some("bob"), "192.0.2.1")).status(), 200);

    // A cost above the capacity can never pass: refused, with no time to wait.
    let layer = RateLimitLayer::new(MemoryStore::new(), API, header("x-api-key"))
        .cost(|_: &Request<Body>| 6);
    let never = call!(layer, req(Some("alice"), "192.0.2.1"));
    assert_eq!(never.status(), 429);
    assert_eq!(h(&never, "retry-after"), None);
    assert_eq!(h(&never, "ratelimit"), Some("\"api\";r=0"));
}

#[tokio::test]
async fn an_unnamed_request_passes_or_is_refused_by_the_setting() {
    const ONE: TokenBucket<str> = TokenBucket::new("one", 1, Rate::per_second(1));
    let layer = RateLimitLayer::new(MemoryStore::new(), ONE, header("x-api-key"));
    for _ in 0..3 {
        let passed = call!(layer, req(None, "192.0.2.1"));
        assert_eq!(passed.status(), 200);
        assert_eq!(h(&passed, "x-served"), Some("1"));
        assert_eq!(
            h(&passed, "x-ratelimit-limit"),
            None,
            "unlimited: no headers"
        );
    }
    let layer = layer.unnamed(Unnamed::Refuse(StatusCode::UNAUTHORIZED));
    let refused = call!(layer, req(None, "192.0.2.1"));
    assert_eq!(refused.status(), 401);
    assert_eq!(h(&refused, "x-served"), None);
    assert_eq!(call!(layer, req(Some("alice"), "192.0.2.1")).status(), 200);
}

#[tokio::test]
async fn a_grpc_call_is_refused_with_resource_exhausted() {
    const ONE: TokenBucket<str> = TokenBucket::new("one", 1, Rate::per_second(1));
    let layer = RateLimitLayer::new(MemoryStore::new(), ONE, header("x-api-key"));
    let grpc = || {
        let mut r = req(Some("alice"), "192.0.2.1");
        r.headers_mut()
            .insert("content-type", "application/grpc+proto".parse().unwrap());
        r
    };
    assert_eq!(call!(layer, grpc()).status(), 200);
    // gRPC's "Trailers-Only" answer: HTTP 200 (a client reads grpc-status from nothing else),
    // the status in the headers, no body.
    let refused = call!(layer, grpc());
    assert_eq!(refused.status(), 200);
    assert_eq!(h(&refused, "x-served"), None);
    assert_eq!(h(&refused, "content-type"), Some("application/grpc"));
    assert_eq!(h(&refused, "grpc-status"), Some("8"));
    let wait = h(&refused, "retry-after-ms").unwrap().to_owned();
    assert_eq!(
        h(&refused, "grpc-message"),
        Some(format!("rate%20limited,%20retry%20after%20{wait}%20ms").as_str())
    );
    assert_eq!(h(&refused, "x-ratelimit-remaining"), Some("0"));
    let body = axum::body::to_bytes(refused.into_body(), 1024)
        .await
        .unwrap();
    assert!(body.is_empty());
}

#[tokio::test]
async fn axum_routers_take_the_layer() {
    use axum::Router;
    use axum::extract::Request as AxumRequest;
    use axum::routing::get;

    let limits = ChainBuilder::new("api").limit(ScopeKind::Key, WindowLimit::per_minute(1));
    let router = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(RateLimitLayer::new(
            MemoryStore::new(),
            limits,
            |r: &AxumRequest| Some(vec![header("x-api-key")(r)?]),
        ));
    let first = router
        .clone()
        .oneshot(req(Some("alice"), "192.0.2.1"))
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(h(&first, "x-ratelimit-remaining"), Some("0"));
    let second = router
        .oneshot(req(Some("alice"), "192.0.2.1"))
        .await
        .unwrap();
    assert_eq!(second.status(), 429);
}

/// A gRPC service of one method, `/floodgate.Test/Ping`, taking and answering an empty
/// message, written as tonic's generated servers are.
mod ping {
    use std::convert::Infallible;
    use std::future::{Ready, ready};
    use std::task::{Context, Poll};

    use axum::http::{Request, Response};
    use tonic::body::Body;
    use tonic::server::{Grpc, NamedService, UnaryService};
    use tonic_prost::ProstCodec;

    pub const PATH: &str = "/floodgate.Test/Ping";

    #[derive(Clone)]
    pub struct Ping;

    impl NamedService for Ping {
        const NAME: &'static str = "floodgate.Test";
    }

    struct Unary;

    impl UnaryService<()> for Unary {
        type Response = ();
        type Future = Ready<Result<tonic::Response<()>, tonic::Status>>;

        fn call(&mut self, _: tonic::Request<()>) -> Self::Future {
            ready(Ok(tonic::Response::new(())))
        }
    }

    impl tower::Service<Request<Body>> for Ping {
        type Response = Response<Body>;
        type Error = Infallible;
        type Future = std::pin::Pin<
            Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send + 'static>,
        >;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: Request<Body>) -> Self::Future {
            Box::pin(async move {
                if req.uri().path() != PATH {
                    return Ok(tonic::Status::unimplemented("no such method").into_http());
                }
                let mut grpc = Grpc::new(ProstCodec::<(), ()>::default());
                Ok(grpc.unary(Unary, req).await)
            })
        }
    }
}

#[tokio::test]
async fn tonics_server_takes_the_layer_and_its_client_reads_resource_exhausted() {
    use axum::http::uri::PathAndQuery;
    use tonic::body::Body as GrpcBody;
    use tonic::transport::{Channel, Server};
    use tonic_prost::ProstCodec;

    const ONE: TokenBucket<str> = TokenBucket::new("grpc", 1, Rate::per_second(1));
    let key = |r: &Request<GrpcBody>| Some(r.headers().get("x-api-key")?.to_str().ok()?.to_owned());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .layer(RateLimitLayer::new(MemoryStore::new(), ONE, key))
            .add_service(ping::Ping)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async {
                    let _ = stopped.await;
                },
            ),
    );

    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // The client's channel, noting each answer's HTTP status: tonic's client would read a
    // grpc-status under any of them, grpc-go only under a 200.
    let statuses = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = std::sync::Arc::clone(&statuses);
    let channel = channel.map_response(move |resp: Response<GrpcBody>| {
        seen.lock().unwrap().push(resp.status());
        resp
    });
    let mut client = tonic::client::Grpc::new(channel);
    let mut ping = async |api_key: &str| {
        let mut req = tonic::Request::new(());
        req.metadata_mut()
            .insert("x-api-key", api_key.parse().unwrap());
        client.ready().await.unwrap();
        client
            .unary(
                req,
                PathAndQuery::from_static(ping::PATH),
                ProstCodec::<(), ()>::default(),
            )
            .await
    };
    let first = ping("alice").await.unwrap();
    assert_eq!(first.metadata().get("x-ratelimit-remaining").unwrap(), "0");
    let refused = ping("alice").await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    let wait = refused
        .metadata()
        .get("retry-after-ms")
        .unwrap()
        .to_str()
        .unwrap();
    assert_eq!(
        refused.message(),
        format!("rate limited, retry after {wait} ms")
    );
    assert_eq!(
        refused.metadata().get("ratelimit-policy").unwrap(),
        "\"grpc\";q=1;w=1"
    );
    // Another key has its own bucket.
    ping("bob").await.unwrap();
    assert_eq!(*statuses.lock().unwrap(), [StatusCode::OK; 3]);
    drop(stop);
    server.await.unwrap().unwrap();
}

/// Exactly `n` of `m` concurrent requests for one name are admitted on `store`.
async fn exactly_n_of_m<S: Store + Clone + 'static>(store: S, name: &str) {
    const N: usize = 20;
    const M: usize = 60;
    let limits = ChainBuilder::new(name)
        .limit(ScopeKind::Key, WindowLimit::per_minute(N as u64))
        .limit(ScopeKind::Customer, WindowLimit::per_minute(1_000));
    let service = RateLimitLayer::new(store, limits, key_and_ip).layer(app());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..M {
        let service = service.clone();
        let ip = format!("192.0.2.{}", i % 7);
        tasks.spawn(async move { service.oneshot(req(Some("alice"), &ip)).await.unwrap() });
    }
    let (mut admitted, mut refused) = (0, 0);
    let mut remaining = Vec::new();
    while let Some(resp) = tasks.join_next().await {
        let resp = resp.unwrap();
        match resp.status() {
            StatusCode::OK => {
                admitted += 1;
                remaining.push(h(&resp, "x-ratelimit-remaining").unwrap().to_owned());
            }
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((admitted, refused), (N, M - N));
    // Each admitted request saw its own slot: the remaining counts are 0..N, once each.
    let mut remaining: Vec<usize> = remaining.iter().map(|r| r.parse().unwrap()).collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..N).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_n_of_m_concurrent_on_memory() {
    exactly_n_of_m(MemoryStore::new(), "mem").await;
}

#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use floodgate::store::redis::{OnError as StoreOnError, RedisConfig, RedisStore};

    /// The test server's URL, or `None` (with a note) when Redis tests are not enabled.
    fn redis_url(test: &str) -> Option<String> {
        match std::env::var("FLOODGATE_TEST_REDIS_URL") {
            Ok(url) if !url.is_empty() => Some(url),
            _ => {
                assert!(
                    std::env::var("FLOODGATE_REQUIRE_REDIS").map_or(true, |v| v != "1"),
                    "{test}: FLOODGATE_REQUIRE_REDIS=1 but FLOODGATE_TEST_REDIS_URL is unset"
                );
                eprintln!("{test}: skipped, FLOODGATE_TEST_REDIS_URL is unset");
                None
            }
        }
    }

    /// A store under a key prefix no other test or run uses.
    async fn store(url: &str) -> RedisStore {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let config = RedisConfig {
            prefix: format!("fgtower:{nanos:x}:{:x}:", std::process::id()),
            ..RedisConfig::new(url)
        };
        RedisStore::connect(config).await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn exactly_n_of_m_concurrent_on_redis() {
        let Some(url) = redis_url("exactly_n_of_m_concurrent_on_redis") else {
            return;
        };
        exactly_n_of_m(store(&url).await, "redis").await;
    }

    #[tokio::test]
    async fn a_bucket_on_redis_refuses_with_the_same_headers() {
        let Some(url) = redis_url("a_bucket_on_redis_refuses_with_the_same_headers") else {
            return;
        };
        const API: TokenBucket<str> = TokenBucket::new("api", 2, Rate::per_second(1));
        let layer = RateLimitLayer::new(store(&url).await, API, header("x-api-key"));
        for left in ["1", "0"] {
            let ok = call!(layer, req(Some("alice"), "192.0.2.1"));
            assert_eq!(ok.status(), 200);
            assert_eq!(h(&ok, "x-ratelimit-remaining"), Some(left));
        }
        let refused = call!(layer, req(Some("alice"), "192.0.2.1"));
        assert_eq!(refused.status(), 429);
        assert_eq!(h(&refused, "ratelimit-policy"), Some("\"api\";q=2;w=2"));
        assert_eq!(h(&refused, "retry-after"), Some("1"));
    }

    /// A Redis store that cannot reach its server and is set to fail closed: every decision
    /// is an error, at once (its breaker is open).
    async fn unreachable() -> RedisStore {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = RedisConfig {
            on_error: StoreOnError::Closed,
            connect_timeout: Duration::from_millis(200),
            ..RedisConfig::new(format!("redis://127.0.0.1:{port}"))
        };
        RedisStore::connect(config).await.unwrap()
    }

    #[tokio::test]
    async fn store_errors_fail_open_or_closed_by_the_setting() {
        const ONE: TokenBucket<str> = TokenBucket::new("one", 1, Rate::per_second(1));
        let limits = ChainBuilder::new("api").limit(ScopeKind::Key, WindowLimit::per_minute(1));

        let open = RateLimitLayer::new(unreachable().await, limits.clone(), |r: &Request<Body>| {
            Some([header("x-api-key")(r)?])
        });
        for _ in 0..2 {
            let passed = call!(open, req(Some("alice"), "192.0.2.1"));
            assert_eq!(passed.status(), 200, "fails open by default");
            assert_eq!(h(&passed, "x-served"), Some("1"));
            assert_eq!(h(&passed, "x-ratelimit-limit"), None, "no state to report");
        }
        let closed = open.on_error(OnError::Closed);
        let refused = call!(closed, req(Some("alice"), "192.0.2.1"));
        assert_eq!(refused.status(), 503);
        assert_eq!(h(&refused, "x-served"), None);

        let bucket = RateLimitLayer::new(unreachable().await, ONE, header("x-api-key"))
            .on_error(OnError::Closed);
        assert_eq!(call!(bucket, req(Some("alice"), "192.0.2.1")).status(), 503);
    }
}
