//! The file as written: the serde types a config is first read into, before validation.
//!
//! Every value that validation may refuse is `Spanned`, so that its error can name the line.

use serde::Deserialize;
use toml::Spanned;

use super::types::{Backend, OnError};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a TOML document of tables")]
pub(super) struct RawConfig {
    pub(super) server: Option<RawServer>,
    pub(super) store: Option<RawStore>,
    pub(super) upstream: Spanned<RawUpstream>,
    pub(super) gateway: Option<RawGateway>,
    pub(super) realtime: Option<RawRealtime>,
    #[serde(default)]
    pub(super) keys: Vec<Spanned<RawKey>>,
    #[serde(default)]
    pub(super) rate_limits: Vec<Spanned<RawRateLimit>>,
    pub(super) alerts: Option<RawAlerts>,
    pub(super) admin: Option<RawAdmin>,
    #[serde(default)]
    pub(super) prices: Vec<Spanned<RawPrice>>,
    #[serde(default)]
    pub(super) budgets: Vec<Spanned<RawBudget>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an [admin] table (listen, secret or secret_sha256, metrics_auth, hosts)"
)]
pub(super) struct RawAdmin {
    pub(super) listen: Option<Spanned<String>>,
    pub(super) secret: Option<Spanned<String>>,
    pub(super) secret_sha256: Option<Spanned<String>>,
    pub(super) metrics_auth: Option<Spanned<bool>>,
    pub(super) hosts: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [[prices]] entry (model, input_per_million, output_per_million)"
)]
pub(super) struct RawPrice {
    pub(super) model: Spanned<String>,
    pub(super) input_per_million: Spanned<f64>,
    pub(super) output_per_million: Spanned<f64>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [[budgets]] entry (scope, id, period, usd, shadow)"
)]
pub(super) struct RawBudget {
    pub(super) scope: Spanned<String>,
    pub(super) id: Option<Spanned<String>>,
    pub(super) period: Spanned<String>,
    pub(super) usd: Spanned<f64>,
    pub(super) shadow: Option<bool>,
}

#[derive(Default, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [server] table (listen, workers, header_timeout_sec, max_body_mib, max_buffered_mib, max_connections)"
)]
pub(super) struct RawServer {
    pub(super) listen: Option<Spanned<String>>,
    pub(super) workers: Option<Spanned<usize>>,
    pub(super) header_timeout_sec: Option<Spanned<u64>>,
    pub(super) max_body_mib: Option<Spanned<u64>>,
    pub(super) max_buffered_mib: Option<Spanned<u64>>,
    pub(super) max_connections: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an [alerts] table (path, flush_sec, retention_days, secret or secret_sha256)"
)]
pub(super) struct RawAlerts {
    pub(super) path: Option<Spanned<String>>,
    pub(super) flush_sec: Option<Spanned<u64>>,
    pub(super) retention_days: Option<Spanned<u32>>,
    pub(super) secret: Option<Spanned<String>>,
    pub(super) secret_sha256: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [store] table (backend, url, urls, on_error, prefix, lease_sec)"
)]
pub(super) struct RawStore {
    pub(super) backend: Option<Spanned<Backend>>,
    pub(super) url: Option<Spanned<String>>,
    pub(super) urls: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) on_error: Option<RawOnError>,
    pub(super) prefix: Option<String>,
    pub(super) lease_sec: Option<Spanned<u64>>,
}

/// `on_error`: one mode for everything, or one per kind of limit.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "\"open\", \"closed\", or a table of them by kind (requests, tokens, budgets)"
)]
pub(super) enum RawOnError {
    Plain(OnError),
    ByKind(RawOnErrorKinds),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOnErrorKinds {
    pub(super) requests: Option<OnError>,
    pub(super) tokens: Option<OnError>,
    pub(super) budgets: Option<OnError>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an [upstream] table (base_url or demo, api_key_env, timeout_sec, ca_file)"
)]
pub(super) struct RawUpstream {
    pub(super) base_url: Option<Spanned<String>>,
    pub(super) api_key_env: Option<Spanned<String>>,
    pub(super) demo: Option<Spanned<bool>>,
    pub(super) timeout_sec: Option<Spanned<u64>>,
    pub(super) ca_file: Option<Spanned<String>>,
}

/// Signed, so that a negative value gets the validator's own message rather than a type error.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [realtime] table (max_connections, flush_sec, drain_sec)"
)]
pub(super) struct RawRealtime {
    pub(super) max_connections: Option<Spanned<i64>>,
    pub(super) flush_sec: Option<Spanned<i64>>,
    pub(super) drain_sec: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [gateway] table (rate_limit, shadow, tokens, default_max_output_tokens)"
)]
pub(super) struct RawGateway {
    pub(super) rate_limit: Option<Spanned<RawWindow>>,
    pub(super) shadow: Option<bool>,
    pub(super) tokens: Option<Spanned<String>>,
    pub(super) default_max_output_tokens: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table like { requests = 100, window_sec = 60, max_in_flight = 10 }"
)]
pub(super) struct RawWindow {
    pub(super) requests: Option<u64>,
    pub(super) window_sec: Option<Spanned<u64>>,
    pub(super) max_in_flight: Option<Spanned<u64>>,
    pub(super) shadow: Option<bool>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [[keys]] entry (id, secret or secret_sha256, org, team, project, business_unit, rate_limit)"
)]
pub(super) struct RawKey {
    pub(super) id: Spanned<String>,
    pub(super) secret: Option<Spanned<String>>,
    pub(super) secret_sha256: Option<Spanned<String>>,
    pub(super) org: Option<Spanned<String>>,
    pub(super) team: Option<Spanned<String>>,
    pub(super) project: Option<Spanned<String>>,
    pub(super) business_unit: Option<Spanned<String>>,
    pub(super) rate_limit: Option<Spanned<RawWindow>>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a [[rate_limits]] entry (scope, id, rpm, tpm, tokens, max_in_flight, shadow)"
)]
pub(super) struct RawRateLimit {
    pub(super) scope: Spanned<String>,
    pub(super) id: Option<Spanned<String>>,
    pub(super) rpm: Option<u64>,
    pub(super) tpm: Option<u64>,
    pub(super) tokens: Option<Spanned<String>>,
    pub(super) max_in_flight: Option<Spanned<u64>>,
    pub(super) shadow: Option<bool>,
}
