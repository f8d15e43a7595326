//! An axum service limited per API key and per client IP, on Redis: every replica that runs it
//! against the same Redis shares the same counts.
//!
//! ```sh
//! FLOODGATE_REDIS_URL=redis://127.0.0.1:6379 cargo run -p floodgate --example axum --features tower
//! curl -i http://127.0.0.1:3000/ -H 'x-api-key: alice'
//! ```
//!
//! Each key may make 600 requests a minute, each IP 60; a request is charged to both or, when
//! either refuses it, to neither (one atomic step). A request without a key is refused with 401.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::{ConnectInfo, Request};
use axum::http::StatusCode;
use axum::routing::get;
use floodgate::store::redis::{RedisConfig, RedisStore};
use floodgate::tower::{ChainBuilder, RateLimitLayer, Unnamed};
use floodgate::{ScopeKind, WindowLimit};

/// The caller's API key, from `x-api-key`.
fn api_key(req: &Request) -> Option<String> {
    Some(req.headers().get("x-api-key")?.to_str().ok()?.to_owned())
}

/// The peer's IP (behind a proxy, read the header it sets instead).
fn client_ip(req: &Request) -> Option<String> {
    let ConnectInfo(addr) = req.extensions().get::<ConnectInfo<SocketAddr>>()?;
    Some(addr.ip().to_string())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("FLOODGATE_REDIS_URL").unwrap_or("redis://127.0.0.1:6379".into());
    let store = RedisStore::connect(RedisConfig::new(url)).await?;
    let limits = ChainBuilder::new("api")
        .limit(ScopeKind::Key, WindowLimit::per_minute(600)) // each API key
        .limit(ScopeKind::Customer, WindowLimit::per_minute(60)); // each client IP
    let layer = RateLimitLayer::new(store, limits, |req: &Request| {
        Some([api_key(req)?, client_ip(req)?])
    })
    .unnamed(Unnamed::Refuse(StatusCode::UNAUTHORIZED));
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(layer);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    // `ConnectInfo` (the peer's address) is what `client_ip` reads.
    let service = app.into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, service).await?;
    Ok(())
}
