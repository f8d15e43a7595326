//! The gateway's TOML config: serde types, then validation into a [`Config`] whose every error
//! names the file, the line and the field.
//!
//! Two seed shapes of limits are accepted and apply together:
//!
//! - `rate_limit = { requests = N, window_sec = W }` on `[gateway]` and on a `[[keys]]` entry: a
//!   missing field falls back to 100 requests / 60 s, an absent object means unlimited;
//! - `[[rate_limits]]` entries with `scope`, `id`, `rpm` and/or `tpm` (60 s windows; tokens are
//!   charged after the response).
//!
//! Spend is capped by `[[budgets]]` entries (`scope`, `id`, `period` = `day` or `month`, `usd`),
//! priced from a `[[prices]]` table (`model`, `input_per_million`, `output_per_million` in USD
//! per million tokens; `model = "*"` prices every model the table does not name).
//!
//! When one scope gets two request limits with the same window (one from each shape), the
//! stricter one is kept: a chain's limits need distinct storage keys, and the stricter limit is
//! the one that would refuse first anyway. An enforced one is kept over a shadow one, whatever
//! their maxes: a shadow limit never refuses, so it cannot stand in for an enforced one.
//!
//! The parts, each importing only those after it: `validate` resolves the file as written
//! (`raw`, its serde types) into the resolved types (`types`, re-exported here), step by step,
//! and makes the errors; `limits` resolves the two shapes of limits into [`ScopeLimit`]s;
//! `money` prints amounts of USD.

use std::path::Path;

use floodgate::ScopeKind;

mod limits;
mod money;
mod raw;
mod types;
mod validate;

pub use money::{MAX_BUDGET_USD, MAX_PRICE_PER_MILLION, per_million, usd};
pub use types::*;
pub use validate::text_digest;

impl Config {
    /// Reads and validates the config at `path`.
    pub fn load(path: impl AsRef<Path>) -> Result<Config, ConfigError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| ConfigError {
            file: path.to_path_buf(),
            line: 0,
            column: 0,
            field: "-".into(),
            message: format!("cannot read the file: {e}"),
        })?;
        let text = String::from_utf8(bytes).map_err(|e| {
            // Read, but not text: where the first byte that is not UTF-8 is.
            let before = &e.as_bytes()[..e.utf8_error().valid_up_to()];
            let line_start = before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            ConfigError {
                file: path.to_path_buf(),
                line: before.iter().filter(|&&b| b == b'\n').count() + 1,
                column: before.len() - line_start + 1,
                field: "-".into(),
                message: "is not UTF-8 text, as a TOML file must be".into(),
            }
        })?;
        Config::parse(path, &text)
    }

    /// Validates `text`, read from `path` (used in error messages and to resolve a relative
    /// `upstream.ca_file`, which is read), with `FLOODGATE_REDIS_URL` from the environment.
    pub fn parse(path: impl AsRef<Path>, text: &str) -> Result<Config, ConfigError> {
        let env_url = std::env::var(REDIS_URL_ENV).ok().filter(|u| !u.is_empty());
        Config::parse_with_env(path, text, env_url)
    }

    /// Validates `text` with an explicit Redis URL override.
    pub fn parse_with_env(
        path: impl AsRef<Path>,
        text: &str,
        redis_url_env: Option<String>,
    ) -> Result<Config, ConfigError> {
        let v = validate::Validator {
            file: path.as_ref(),
            text,
        };
        let raw: raw::RawConfig = toml::from_str(text).map_err(|e| v.toml_error(&e))?;
        v.resolve(raw, redis_url_env)
    }

    /// The concurrency limit of scope `(kind, id)`, if any.
    pub fn scope_in_flight(&self, kind: ScopeKind, id: &str) -> Option<&InFlightConfig> {
        self.in_flight.get(&(kind, id.to_owned()))
    }

    /// The limits of scope `(kind, id)`, if any.
    pub fn scope_limits(&self, kind: ScopeKind, id: &str) -> &[ScopeLimit] {
        self.limits
            .get(&(kind, id.to_owned()))
            .map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_printed_with_debug_shows_no_redis_password() {
        let text = "[store]\nbackend = \"redis\"\nurl = \"redis://:hunter2@db:6379/0\"\n[upstream]\ndemo = true\n";
        let config = Config::parse_with_env("t.toml", text, None).unwrap();
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("url: Some(\"<set>\")"), "{shown}");
    }

    #[test]
    fn minimal_demo_config() {
        let c = Config::parse_with_env("test.toml", "[upstream]\ndemo = true\n", None).unwrap();
        assert_eq!(c.upstream.target, UpstreamTarget::Demo);
        assert_eq!(c.store.backend, Backend::Memory);
        assert!(c.limits.is_empty());
    }
}
