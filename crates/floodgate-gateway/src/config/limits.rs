//! Limits: the two seed shapes, `rate_limit = { requests, window_sec, max_in_flight }` on
//! `[gateway]` and on a key, and `[[rate_limits]]` entries, resolved into each scope's
//! [`ScopeLimit`]s and concurrency limit, and merged.

use std::collections::HashMap;
use std::time::Duration;

use floodgate::{Charge, ScopeKind, WindowLimit};
use toml::Spanned;

use super::raw::{RawGateway, RawRateLimit, RawWindow};
use super::types::{
    ConfigError, DEFAULT_MAX_OUTPUT_TOKENS, DEFAULT_REQUESTS, DEFAULT_WINDOW_SEC, GATEWAY_ID,
    InFlightConfig, Limits, MAX_OUTPUT_TOKENS, ScopeLimit, TokenMode,
};
use super::validate::Validator;

impl Validator<'_> {
    /// `[gateway] tokens` and `default_max_output_tokens`: how token limits are charged where a
    /// limit does not say, and the output estimate of a request that names no cap.
    pub(super) fn token_mode(
        &self,
        raw: Option<&RawGateway>,
    ) -> Result<(TokenMode, u64), ConfigError> {
        let mode = match raw.and_then(|g| g.tokens.as_ref()) {
            Some(t) => self.mode(t, "gateway.tokens")?,
            None => TokenMode::default(),
        };
        let out = match raw.and_then(|g| g.default_max_output_tokens.as_ref()) {
            Some(n) => match u64::try_from(*n.get_ref()) {
                Ok(n) if (1..=MAX_OUTPUT_TOKENS).contains(&n) => n,
                _ => {
                    return Err(self.error(
                        n.span(),
                        "gateway.default_max_output_tokens",
                        format!("must be between 1 and {MAX_OUTPUT_TOKENS}"),
                    ));
                }
            },
            None => DEFAULT_MAX_OUTPUT_TOKENS,
        };
        Ok((mode, out))
    }

    /// A `tokens = "reactive" | "reserve"` value at `field`.
    fn mode(&self, t: &Spanned<String>, field: &str) -> Result<TokenMode, ConfigError> {
        TokenMode::parse(t.get_ref()).ok_or_else(|| {
            self.error(
                t.span(),
                field,
                format!(
                    "unknown token mode `{}`: expected \"reactive\" (charged after the \
                     response) or \"reserve\" (an estimate charged at admission)",
                    t.get_ref().escape_debug()
                ),
            )
        })
    }

    /// `[gateway] rate_limit`, if any: the gateway scope's request limit.
    pub(super) fn gateway_limit(
        &self,
        raw: Option<RawGateway>,
        limits: &mut Limits,
    ) -> Result<(), ConfigError> {
        if let Some(w) = raw.and_then(|g| g.rate_limit) {
            self.seed_limit(
                &w,
                "gateway.rate_limit",
                (ScopeKind::Gateway, GATEWAY_ID.into()),
                limits,
            )?;
        }
        Ok(())
    }

    /// A seed-shape `rate_limit` object at `field`, merged into `scope`'s limits as a request
    /// limit.
    pub(super) fn seed_limit(
        &self,
        w: &Spanned<RawWindow>,
        field: &str,
        scope: (ScopeKind, String),
        limits: &mut Limits,
    ) -> Result<(), ConfigError> {
        let limit = self.window(w, field)?;
        let shadow = w.get_ref().shadow.unwrap_or(false);
        if let Some(max) = &w.get_ref().max_in_flight {
            let field = format!("{field}.max_in_flight");
            self.in_flight(max, &field, scope.clone(), shadow, limits)?;
        }
        merge(
            limits,
            scope,
            ScopeLimit {
                charge: Charge::Admission,
                limit,
                shadow,
            },
        );
        Ok(())
    }

    /// A `max_in_flight` at `field` for `scope`, merged into its concurrency limit (the smaller
    /// max is kept).
    fn in_flight(
        &self,
        max: &Spanned<u64>,
        field: &str,
        scope: (ScopeKind, String),
        shadow: bool,
        limits: &mut Limits,
    ) -> Result<(), ConfigError> {
        let n = *max.get_ref();
        if n == 0 {
            return Err(self.error(
                max.span(),
                field,
                "must be at least 1 (a scope that may run nothing would refuse every request)",
            ));
        }
        let new = InFlightConfig { max: n, shadow };
        limits
            .in_flight
            .entry(scope)
            .and_modify(|old| {
                if replaces((shadow, n), (old.shadow, old.max)) {
                    *old = new;
                }
            })
            .or_insert(new);
        Ok(())
    }

    /// `[[rate_limits]]`, in the order written: at most one entry per scope, each with `rpm`,
    /// `tpm` or both (60 s windows), merged into `limits`. `keys` maps key ids to their index.
    pub(super) fn rate_limits(
        &self,
        raw: Vec<Spanned<RawRateLimit>>,
        keys: &HashMap<String, usize>,
        tokens: TokenMode,
        limits: &mut Limits,
    ) -> Result<(), ConfigError> {
        let mut seen: HashMap<(ScopeKind, String), usize> = HashMap::new();
        for (i, r) in raw.into_iter().enumerate() {
            let span = r.span();
            let r = r.into_inner();
            let field = |f: &str| format!("rate_limits[{i}].{f}");
            let (kind, id) = self.scope_target(
                &r.scope,
                r.id,
                span.clone(),
                &format!("rate_limits[{i}]."),
                "rate limit needs the id of the {kind} it limits",
                keys,
            )?;
            if r.rpm.is_none() && r.tpm.is_none() && r.max_in_flight.is_none() {
                return Err(self.error(
                    span,
                    field("rpm"),
                    "set `rpm`, `tpm`, `max_in_flight` or several",
                ));
            }
            // A limit's own `tokens` wins over `[gateway] tokens`; it applies to `tpm` only.
            let mode = match &r.tokens {
                Some(t) if r.tpm.is_none() => {
                    return Err(self.error(
                        t.span(),
                        field("tokens"),
                        "`tokens` says how `tpm` is charged: set `tpm`, or remove `tokens`",
                    ));
                }
                Some(t) => self.mode(t, &field("tokens"))?,
                None => tokens,
            };
            if let Some(first) = seen.insert((kind, id.clone()), i) {
                return Err(self.error(
                    r.scope.span(),
                    field("scope"),
                    format!("rate_limits[{first}] already limits this {kind}: merge the two"),
                ));
            }
            if let Some(max) = &r.max_in_flight {
                let shadow = r.shadow.unwrap_or(false);
                let f = field("max_in_flight");
                self.in_flight(max, &f, (kind, id.clone()), shadow, limits)?;
            }
            if let Some(rpm) = r.rpm {
                merge(
                    limits,
                    (kind, id.clone()),
                    ScopeLimit {
                        charge: Charge::Admission,
                        limit: WindowLimit::per_minute(rpm),
                        shadow: r.shadow.unwrap_or(false),
                    },
                );
            }
            if let Some(tpm) = r.tpm {
                merge(
                    limits,
                    (kind, id),
                    ScopeLimit {
                        charge: match mode {
                            TokenMode::Reactive => Charge::Reactive,
                            TokenMode::Reserve => Charge::Reserved,
                        },
                        limit: WindowLimit::per_minute(tpm),
                        shadow: r.shadow.unwrap_or(false),
                    },
                );
            }
        }
        Ok(())
    }

    /// A seed-shape `rate_limit` object: missing fields fall back to 100 / 60.
    fn window(&self, w: &Spanned<RawWindow>, field: &str) -> Result<WindowLimit, ConfigError> {
        let raw = w.get_ref();
        let requests = raw.requests.unwrap_or(DEFAULT_REQUESTS);
        let secs = match &raw.window_sec {
            Some(s) if *s.get_ref() == 0 => {
                return Err(self.error(
                    s.span(),
                    format!("{field}.window_sec"),
                    "must be at least 1",
                ));
            }
            Some(s) if *s.get_ref() > 366 * 86_400 => {
                return Err(self.error(
                    s.span(),
                    format!("{field}.window_sec"),
                    "must be at most a year",
                ));
            }
            Some(s) => *s.get_ref(),
            None => DEFAULT_WINDOW_SEC,
        };
        Ok(WindowLimit::new(requests, Duration::from_secs(secs)))
    }
}

/// Adds `limit` to `scope`'s limits; of two with the same charge and window one is kept
/// (storage keys of one chain must be distinct), as [`replaces`] picks.
fn merge(limits: &mut Limits, scope: (ScopeKind, String), limit: ScopeLimit) {
    let list = limits.windows.entry(scope).or_default();
    match list
        .iter_mut()
        .find(|l| l.charge == limit.charge && l.limit.window() == limit.limit.window())
    {
        Some(existing)
            if replaces(
                (limit.shadow, limit.limit.max()),
                (existing.shadow, existing.limit.max()),
            ) =>
        {
            *existing = limit;
        }
        Some(_) => {}
        None => list.push(limit),
    }
}

/// Whether a limit `(shadow, max)` replaces the one already kept for its scope, charge and
/// window: an enforced limit wins over a shadow one whatever their maxes (a stricter limit
/// added in shadow to watch it must not switch off the enforced one), and of two alike the
/// smaller max, the one that would refuse first, wins.
fn replaces(new: (bool, u64), old: (bool, u64)) -> bool {
    match (new.0, old.0) {
        (false, true) => true,
        (true, false) => false,
        _ => new.1 < old.1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn a_stricter_shadow_limit_does_not_switch_off_the_enforced_one() {
        let c = Config::parse_with_env(
            "test.toml",
            r#"
[upstream]
demo = true
[[keys]]
id = "a"
secret = "s"
rate_limit = { requests = 5, max_in_flight = 4 }
[[rate_limits]]
scope = "key"
id = "a"
rpm = 3
max_in_flight = 1
shadow = true
"#,
            None,
        )
        .unwrap();
        let key = c.scope_limits(ScopeKind::Key, "a");
        assert_eq!(key.len(), 1);
        assert!(!key[0].shadow);
        assert_eq!(key[0].limit, WindowLimit::per_minute(5));
        let slots = c
            .scope_in_flight(ScopeKind::Key, "a")
            .expect("a concurrency limit");
        assert_eq!((slots.max, slots.shadow), (4, false));
    }

    #[test]
    fn fallbacks_and_merging() {
        let c = Config::parse_with_env(
            "test.toml",
            r#"
[upstream]
demo = true
[gateway]
rate_limit = {}
[[keys]]
id = "a"
secret = "s"
rate_limit = { requests = 5 }
[[rate_limits]]
scope = "key"
id = "a"
rpm = 3
tpm = 10
"#,
            None,
        )
        .unwrap();
        assert_eq!(
            c.scope_limits(ScopeKind::Gateway, GATEWAY_ID)[0].limit,
            WindowLimit::per_minute(100)
        );
        let key = c.scope_limits(ScopeKind::Key, "a");
        assert_eq!(key.len(), 2);
        assert_eq!(key[0].limit, WindowLimit::per_minute(3));
        assert_eq!(key[1].charge, Charge::Reactive);
    }
}
