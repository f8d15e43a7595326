//! The Redis store over `rediss://` (TLS via rustls and ring).
//!
//! Needs the `tls` feature and a TLS-enabled server named by `FLOODGATE_TEST_REDIS_TLS_URL`;
//! certificates are verified against the system roots, or the file `SSL_CERT_FILE` names (a
//! test server's self-signed certificate):
//!
//! ```text
//! SSL_CERT_FILE=cert.pem FLOODGATE_TEST_REDIS_TLS_URL=rediss://127.0.0.1:6380/0 \
//!     cargo test -p floodgate --features tls --test redis_tls
//! ```
//!
//! `scripts/test` does exactly that against a throwaway TLS server and CA it makes with openssl;
//! without the URL the test skips, unless `FLOODGATE_REQUIRE_REDIS=1` (CI), where it fails. Built
//! without `tls`, the file checks that `rediss://` is refused at once.
#![cfg(feature = "redis")]

use floodgate::store::redis::{RedisConfig, RedisStore};

#[cfg(not(feature = "tls"))]
#[tokio::test]
async fn rediss_without_the_tls_feature_is_a_configuration_error() {
    use floodgate::Error;
    let err = RedisStore::connect(RedisConfig::new("rediss://:secret@127.0.0.1:1/0"))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Backend(_)), "{err}");
    assert!(!err.to_string().contains("secret"), "{err}");
}

#[cfg(feature = "tls")]
#[tokio::test]
async fn decisions_over_tls() {
    use floodgate::{Chain, ChainLimit, Charge, Rate, ScopeKind, TokenBucket, WindowLimit};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    let Ok(url) = std::env::var("FLOODGATE_TEST_REDIS_TLS_URL") else {
        assert!(
            std::env::var("FLOODGATE_REQUIRE_REDIS").as_deref() != Ok("1"),
            "FLOODGATE_REQUIRE_REDIS=1 but FLOODGATE_TEST_REDIS_TLS_URL is unset"
        );
        eprintln!("decisions_over_tls: skipped, FLOODGATE_TEST_REDIS_TLS_URL is unset");
        return;
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let store = RedisStore::connect(RedisConfig {
        prefix: format!("fgtls:{nanos:x}:"),
        timeout: Duration::from_secs(2),
        ..RedisConfig::new(url)
    })
    .await
    .unwrap();
    store.ping().await.unwrap();
    let chain = Chain::new(vec![ChainLimit::new(
        "org:tls",
        ScopeKind::Key,
        "k",
        Charge::Admission,
        WindowLimit::per_minute(1),
    )]);
    let first = chain.admit(&store, 1).await.unwrap();
    assert!(first.enforced && first.admitted);
    let second = chain.admit(&store, 1).await.unwrap();
    assert!(second.enforced && !second.admitted);
    const B: TokenBucket<str> = TokenBucket::new("tls", 1, Rate::per_second(1));
    assert!(B.acquire(&store, "x", 1).await.unwrap().is_allowed());
    assert!(!B.acquire(&store, "x", 1).await.unwrap().is_allowed());
    assert_eq!(store.stats().failed_open, 0);
}
