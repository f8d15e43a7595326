//! How to reach Redis and what to do when it cannot be reached: [`RedisConfig`], its
//! [`OnError`] and [`RedisClock`], and the URL handling that never shows a password.

use std::fmt;
use std::time::Duration;

use ::redis::{IntoConnectionInfo, RedisError};

use crate::Error;

/// What a decision does when Redis cannot be reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnError {
    /// Admit unchecked (`enforced: false`): an outage of the limiter is not an outage of the
    /// service. The default.
    #[default]
    Open,
    /// Refuse with [`Error::Unavailable`].
    Closed,
}

/// Which clock decides when a call does not pin the time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RedisClock {
    /// The Redis server's `TIME`, read inside each script: one clock for every replica, so skew
    /// between them cannot split a bucket or distort a rate. The default.
    #[default]
    Server,
    /// The calling process's wall clock, sent with each call, for managed services that refuse
    /// `TIME` inside scripts. Replicas' clocks must then agree.
    Client,
}

/// [`RedisConfig::lease`]'s default: long enough that two renewals in a row can be lost (a
/// Redis failover, a stalled process) before a running request's slot lapses, short enough that
/// a dead replica's slots come back before its callers' retries give up.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(15);

/// How to reach Redis and how to behave when it cannot be reached.
#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://[:password@]host:port[/db]`, or `rediss://` with the `tls` feature. Unused on a
    /// cluster ([`cluster`](Self::cluster) not empty).
    pub url: String,
    /// A Redis Cluster's seed nodes (`redis://host:port` each; the rest of the cluster is
    /// discovered from them), or empty for the one server at [`url`](Self::url). See
    /// [`RedisConfig::cluster`].
    pub cluster: Vec<String>,
    /// Prepended to every key; default `fg:`.
    pub prefix: String,
    /// Fail open (default) or closed when Redis is unreachable.
    pub on_error: OnError,
    /// The clock that decides when a call does not pin the time.
    pub clock: RedisClock,
    /// The longest one call may take, replay included; default 200 ms.
    pub timeout: Duration,
    /// The longest one connection attempt may take; default 1 s.
    pub connect_timeout: Duration,
    /// How often the circuit breaker probes Redis during an outage; default 250 ms.
    pub probe_interval: Duration,
    /// How long a concurrency slot ([`InFlightLimit`](crate::InFlightLimit)) lives without
    /// renewal; default 15 s, renewed every third of it while its request runs. A process that
    /// dies frees its slots within this time; a Redis unreachable for longer than it lets
    /// running requests lose their slots (the limit then errs towards looser until they end).
    pub lease: Duration,
}

impl RedisConfig {
    /// The defaults, for the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            cluster: Vec::new(),
            prefix: "fg:".into(),
            on_error: OnError::Open,
            clock: RedisClock::Server,
            timeout: Duration::from_millis(200),
            connect_timeout: Duration::from_secs(1),
            probe_interval: Duration::from_millis(250),
            lease: DEFAULT_LEASE,
        }
    }

    /// The defaults, for the Redis Cluster that `seeds` belong to: each decision's keys lie in
    /// one slot (a chain's within one tenant, by their hash tag) and are decided there in one
    /// script; a chain whose scopes lie in several slots (a customer's or the gateway's limits)
    /// is decided slot by slot, with a refund (docs/redis.md, "Redis Cluster").
    pub fn cluster<S: Into<String>>(seeds: impl IntoIterator<Item = S>) -> Self {
        let cluster: Vec<String> = seeds.into_iter().map(Into::into).collect();
        RedisConfig {
            cluster,
            ..RedisConfig::new("")
        }
    }

    /// Whether [`RedisStore::connect`](super::RedisStore::connect) would take this URL (or
    /// these seeds), without connecting: for config checks. The error never shows a password.
    pub fn check_url(&self) -> Result<(), Error> {
        if self.cluster.is_empty() {
            self.connection_info().map(drop)
        } else {
            self.cluster_infos().map(drop)
        }
    }

    /// Whether this is a cluster's config.
    pub fn is_cluster(&self) -> bool {
        !self.cluster.is_empty()
    }

    /// The seeds parsed, or an error that names the first bad one with its password hidden.
    pub(super) fn cluster_infos(&self) -> Result<Vec<::redis::ConnectionInfo>, Error> {
        self.cluster
            .iter()
            .map(|url| {
                url.as_str().into_connection_info().map_err(|e| {
                    Error::Backend(format!("invalid Redis URL {}: {e}", redacted(url)))
                })
            })
            .collect()
    }

    /// The URL parsed, or an error that names it with its password hidden.
    pub(super) fn connection_info(&self) -> Result<::redis::ConnectionInfo, Error> {
        self.url
            .as_str()
            .into_connection_info()
            .map_err(|e| self.invalid(e))
    }

    pub(super) fn invalid(&self, e: RedisError) -> Error {
        Error::Backend(format!("invalid Redis URL {}: {e}", redacted(&self.url)))
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL may carry a password: never print it.
        f.debug_struct("RedisConfig")
            .field("url", &redacted(&self.url))
            .field(
                "cluster",
                &self.cluster.iter().map(|u| redacted(u)).collect::<Vec<_>>(),
            )
            .field("prefix", &self.prefix)
            .field("on_error", &self.on_error)
            .field("clock", &self.clock)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("probe_interval", &self.probe_interval)
            .field("lease", &self.lease)
            .finish()
    }
}

/// `url` with its credentials replaced: those between `://` and the last `@` (a password may
/// hold a `?`, `#` or `/` unencoded, which then does not end it; a query with an `@` in it is
/// redacted too, more than needed, never less), and a `pass` or `password` query parameter (how
/// a `unix://` URL carries its password).
fn redacted(url: &str) -> String {
    let (mut out, rest) = match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => (format!("{}://***@", &url[..s]), &url[at + 1..]),
        _ => (String::new(), url),
    };
    let (base, query) = match rest.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (rest, None),
    };
    out.push_str(base);
    if let Some(query) = query {
        out.push('?');
        for (i, param) in query.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            match param.split_once('=') {
                Some((name @ ("pass" | "password"), _)) => {
                    out.push_str(name);
                    out.push_str("=***");
                }
                _ => out.push_str(param),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redacted("redis://:hunter2@db:6379/0"),
            "redis://***@db:6379/0"
        );
        assert_eq!(redacted("redis://db:6379"), "redis://db:6379");
        assert_eq!(
            redacted("unix:///run/redis.sock?db=one&pass=hunter2"),
            "unix:///run/redis.sock?db=one&pass=***"
        );
        assert_eq!(
            redacted("redis+unix:///r.sock?password=hunter2&user=u"),
            "redis+unix:///r.sock?password=***&user=u"
        );
        assert_eq!(
            redacted("rediss://u:p@db/0?protocol=resp3"),
            "rediss://***@db/0?protocol=resp3"
        );
        // A password with a `?`, `#` or `/` in it, unencoded: all of it goes.
        assert_eq!(
            redacted("redis://:hunter?2@db:6379/0"),
            "redis://***@db:6379/0"
        );
        assert_eq!(
            redacted("redis://user:s3cr?et/x#y@db/0?pass=z"),
            "redis://***@db/0?pass=***"
        );
    }
}
