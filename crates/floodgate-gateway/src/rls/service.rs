//! `ShouldRateLimit`: a request's descriptors, matched against the running config, decided as
//! one chain admission on the store (docs/envoy.md).
//!
//! - Each descriptor's rule is Envoy's `limit` override when it carries one, else its most
//!   specific match ([`RlsConfig::lookup`]); `replaces` drops the rules named by any matched
//!   rule (an `unlimited` one included), as envoyproxy/ratelimit does.
//! - Every limited descriptor becomes a limit of one [`Chain`], admitted in one atomic step:
//!   the request passes only if every enforced limit passes, and a refused request is charged to
//!   none of them (envoyproxy/ratelimit adds the hits to every counter, refused or not).
//! - The cost is `hits_addend`: a descriptor's own when set (0 checks without charging), else
//!   the request's, with 0 meaning 1. Descriptors of different costs are one admission with a
//!   cost per limit, so a call is decided in one atomic step whatever its costs
//!   (docs/envoy.md).
//! - Counters are named by the request's entries, as envoyproxy/ratelimit's cache keys are, in
//!   the domain's hash tag: `{rls:DOMAIN}:gateway:KEY=VALUE.KEY=VALUE:req:WINDOWus` (no
//!   `:WINDOWus` for a minute, as [`ChainLimit::new`] names keys), never a key
//!   of the gateway's (whose tags are `org:...` or a scope).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use floodgate::http;
use floodgate::store::AnyStore;
use floodgate::{Chain, ChainLimit, Charge, LimitStatus, ScopeKind};
use tonic::{Request, Response, Status};

use super::config::{RlsConfig, Rule, Unit};
use super::metrics::{Answer, DescriptorOutcome, RlsMetrics};

/// The most descriptors one call may carry: far past what Envoy sends (one per entry of a
/// route's `rate_limits`), and within what one atomic admission holds on every store (one Redis
/// script unpacks its keys onto Lua's stack, about 8 000 at most) and what one call may make the
/// process allocate. A call with more is an `INVALID_ARGUMENT`, decided on no store.
pub const MAX_DESCRIPTORS: usize = 1024;

/// The rate limit service: the running config, the store, the metrics.
#[derive(Debug)]
pub struct Rls {
    config: RwLock<Arc<RlsConfig>>,
    store: AnyStore,
    metrics: RlsMetrics,
    /// Global shadow mode: every `OVER_LIMIT` answered `OK`.
    shadow: bool,
}

/// What one descriptor of a request comes to.
enum Slot<'a> {
    /// No rule, a refund (`is_negative_hits`, not applied), or a replaced rule.
    Free(DescriptorOutcome),
    /// `unlimited`.
    Unlimited,
    /// A limit of the call's admission, at index `at` of its chain.
    Limited { rule: &'a Rule, at: usize },
}

impl Rls {
    /// A service deciding on `store` with `config`.
    pub fn new(config: RlsConfig, store: AnyStore, metrics: RlsMetrics) -> Rls {
        Rls {
            config: RwLock::new(Arc::new(config)),
            store,
            metrics,
            shadow: false,
        }
    }

    /// This service in global shadow mode, or not: envoyproxy/ratelimit's `SHADOW_MODE`. Calls
    /// are decided as usual (a call that would be refused is charged to none of its limits, as
    /// enforcing would), but one that would be refused is answered `OK` (its descriptors'
    /// statuses still say `OVER_LIMIT`, as envoyproxy/ratelimit leaves them, and no
    /// `retry-after` is sent) and counted as `shadow_over_limit`.
    pub fn with_global_shadow(self, shadow: bool) -> Rls {
        Rls { shadow, ..self }
    }

    /// The running config.
    pub fn config(&self) -> Arc<RlsConfig> {
        // A std lock, held only to clone an Arc: never across an await.
        Arc::clone(&self.config.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Puts `config` in force: calls that start after this see it. Counters are kept: they are
    /// named by the request's entries and the window, not the size of the limit.
    pub fn replace_config(&self, config: RlsConfig) {
        *self.config.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(config);
    }

    /// The metrics.
    pub fn metrics(&self) -> &RlsMetrics {
        &self.metrics
    }

    /// Answers one `ShouldRateLimit` call.
    pub async fn decide(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let answer = self.decide_inner(req).await;
        self.metrics.answer(match &answer {
            Err(_) => Answer::Error,
            Ok((_, a)) => *a,
        });
        answer.map(|(r, _)| r)
    }

    /// The answer, and how it is counted.
    async fn decide_inner(
        &self,
        req: &RateLimitRequest,
    ) -> Result<(RateLimitResponse, Answer), Status> {
        if req.domain.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit domain must not be empty",
            ));
        }
        if req.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        if req.descriptors.len() > MAX_DESCRIPTORS {
            return Err(Status::invalid_argument(format!(
                "descriptors: {} in one call, at most {MAX_DESCRIPTORS}",
                req.descriptors.len()
            )));
        }
        let config = self.config();
        let rules = req
            .descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| rule_for(&config, &req.domain, i, d))
            .collect::<Result<Vec<_>, Status>>()?;
        let replaced: HashSet<&str> = rules
            .iter()
            .flatten()
            .flat_map(|r| r.replaces.iter().map(String::as_str))
            .collect();
        let tenant = format!("rls:{}", escape(&req.domain));
        // The call's one admission: its limits, each with its cost, and each descriptor's place.
        let mut limits: Vec<ChainLimit> = Vec::new();
        let mut costs: Vec<u64> = Vec::new();
        // Each limit's place in `limits`, by its storage key.
        let mut places: HashMap<String, usize> = HashMap::new();
        let mut slots = Vec::with_capacity(rules.len());
        for (d, rule) in req.descriptors.iter().zip(&rules) {
            let slot = match rule.as_deref() {
                _ if d.is_negative_hits => Slot::Free(DescriptorOutcome::Unmatched),
                None => Slot::Free(DescriptorOutcome::Unmatched),
                // Unlimited before replaced, as envoyproxy/ratelimit decides: a replaced rule
                // that is unlimited still answers unlimited.
                Some(r) if r.window_limit().is_none() => Slot::Unlimited,
                Some(r) if !r.name.is_empty() && replaced.contains(r.name.as_str()) => {
                    Slot::Free(DescriptorOutcome::Replaced)
                }
                Some(r) => match r.window_limit() {
                    None => Slot::Unlimited,
                    Some(window) => {
                        let cost = cost(req, d);
                        let limit = ChainLimit::new(
                            &tenant,
                            ScopeKind::Gateway,
                            &counter_id(d),
                            Charge::Admission,
                            window,
                        )
                        .with_shadow(r.shadow);
                        // The same counter twice in one request (the same descriptor sent
                        // twice) is one limit of the chain: a chain's keys are distinct. With
                        // overrides of one unit but different sizes on it, the stricter decides;
                        // sent twice with equal costs it is charged once, with different costs
                        // the larger.
                        // Found by key in a map, not by a search of the list: a call may carry
                        // up to MAX_DESCRIPTORS.
                        let at = match places.get(limit.key()).copied() {
                            Some(at) => {
                                if stricter(&limit, &limits[at]) {
                                    limits[at] = limit;
                                }
                                costs[at] = costs[at].max(cost);
                                at
                            }
                            None => {
                                places.insert(limit.key().to_owned(), limits.len());
                                limits.push(limit);
                                costs.push(cost);
                                limits.len() - 1
                            }
                        };
                        Slot::Limited { rule: r, at }
                    }
                },
            };
            slots.push(slot);
        }
        // One atomic step over every limited descriptor, each at its own cost.
        let decision = if limits.is_empty() {
            None
        } else {
            let chain = Chain::new(limits);
            let started = Instant::now();
            let decided = match costs.split_first() {
                Some((&first, rest)) if rest.iter().all(|&c| c == first) => {
                    chain.admit(&self.store, first).await
                }
                _ => chain.admit_costs(&self.store, &costs).await,
            };
            let failed = !decided.as_ref().is_ok_and(|d| d.enforced);
            self.metrics.store_call(started.elapsed(), failed);
            // A descriptor that can never pass is refused without the store: the others' states
            // were not read. Read them (an admission of cost 0 charges nothing), so that each
            // answers its own remaining and reset rather than a full limit.
            let decided = match decided {
                Ok(mut d) if !d.admitted && d.enforced && d.retry_after.is_none() => {
                    // The library names the first limit the call can never fit; every other one
                    // it can never fit refuses it too (two blocked values, a cost above two
                    // limits), and says so.
                    for ((st, limit), &cost) in
                        d.statuses.iter_mut().zip(chain.limits()).zip(&costs)
                    {
                        if !limit.fits(cost) {
                            (st.over, st.remaining) = (true, 0);
                        }
                    }
                    let started = Instant::now();
                    let read = chain.admit(&self.store, 0).await;
                    let failed = !read.as_ref().is_ok_and(|r| r.enforced);
                    self.metrics.store_call(started.elapsed(), failed);
                    // A read that fails leaves the states unknown, as before: the refusal stands.
                    if let Some(read) = read.ok().filter(|r| r.enforced) {
                        for (st, seen) in d.statuses.iter_mut().zip(&read.statuses) {
                            if !st.over {
                                (st.remaining, st.reset) = (seen.remaining, seen.reset);
                            }
                        }
                    }
                    Ok(d)
                }
                other => other,
            };
            Some(decided.map_err(|e| {
                tracing::warn!(error = %e, "store unavailable: failing closed");
                Status::unavailable("the rate limit store is unavailable")
            })?)
        };
        let enforced = decision.as_ref().is_none_or(|d| d.enforced);
        let mut response = RateLimitResponse {
            overall_code: Code::Ok as i32,
            ..RateLimitResponse::default()
        };
        // The limit the headers describe: the first refusing one, else the one with the fewest
        // units left (the first of equals); never a shadow one.
        let mut primary: Option<(&Rule, &LimitStatus, bool)> = None;
        let mut retry_after = None;
        // The primary limit refuses and no wait cures it: no time to announce.
        let mut never = false;
        for slot in &slots {
            let status = match slot {
                Slot::Free(outcome) => {
                    self.metrics.descriptor(*outcome);
                    DescriptorStatus {
                        code: Code::Ok as i32,
                        ..DescriptorStatus::default()
                    }
                }
                Slot::Unlimited => {
                    self.metrics.descriptor(DescriptorOutcome::Unlimited);
                    DescriptorStatus {
                        code: Code::Ok as i32,
                        limit_remaining: u32::MAX,
                        ..DescriptorStatus::default()
                    }
                }
                Slot::Limited { rule, at } => {
                    let decided = decision
                        .as_ref()
                        .and_then(|d| Some((d, d.statuses.get(*at)?)));
                    let current_limit = rule.limit.map(|(n, unit)| RateLimit {
                        name: rule.name.clone(),
                        requests_per_unit: n,
                        unit: unit.proto(),
                    });
                    match decided {
                        // Not decided: the store failed open.
                        None => DescriptorStatus {
                            code: Code::Ok as i32,
                            current_limit,
                            ..DescriptorStatus::default()
                        },
                        Some((decision, st)) => {
                            let refusing = !decision.admitted && st.over && !st.shadow;
                            self.metrics.descriptor(match outcome(st, refusing) {
                                DescriptorOutcome::Over if self.shadow => {
                                    DescriptorOutcome::ShadowOver
                                }
                                o => o,
                            });
                            if refusing {
                                response.overall_code = Code::OverLimit as i32;
                            }
                            let better = match primary {
                                None => true,
                                Some((_, p, p_refusing)) => {
                                    !p_refusing && (refusing || st.remaining < p.remaining)
                                }
                            };
                            if !st.shadow && better {
                                primary = Some((rule, st, refusing));
                                never = refusing && decision.retry_after.is_none();
                                if refusing {
                                    retry_after = decision.retry_after;
                                }
                            }
                            // A refusal no wait cures (the cost above the limit): full again
                            // after a window, and still refused.
                            let reset = if refusing && decision.retry_after.is_none() {
                                st.limit.window()
                            } else {
                                st.reset
                            };
                            DescriptorStatus {
                                code: if refusing { Code::OverLimit } else { Code::Ok } as i32,
                                current_limit,
                                limit_remaining: u32::try_from(st.remaining).unwrap_or(u32::MAX),
                                duration_until_reset: Some(proto_duration(reset)),
                                ..DescriptorStatus::default()
                            }
                        }
                    }
                }
            };
            response.statuses.push(status);
        }
        let answer = match () {
            _ if !enforced => Answer::Unenforced,
            _ if response.overall_code == Code::Ok as i32 => Answer::Ok,
            _ if self.shadow => {
                // Global shadow mode: the call passes, so nothing tells Envoy to wait.
                response.overall_code = Code::Ok as i32;
                retry_after = None;
                Answer::ShadowOverLimit
            }
            _ => Answer::OverLimit,
        };
        if let Some((rule, st, _)) = primary {
            response.response_headers_to_add = headers(rule, st, never, retry_after);
        }
        Ok((response, answer))
    }
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.decide(request.get_ref()).await.map(Response::new)
    }
}

/// A descriptor's rule, as envoyproxy/ratelimit picks it: Envoy's `limit` override when the
/// descriptor carries one, in place of any rule of the config (whose shadow mode, name and
/// `replaces` then play no part) and whether or not one matches; else the config's most
/// specific match. An unknown domain limits nothing, override or not. The override is counted
/// on the counter the config's rule of that unit would use (the entries and the window), as
/// envoyproxy/ratelimit's cache key is.
fn rule_for<'c>(
    config: &'c RlsConfig,
    domain: &str,
    at: usize,
    d: &RateLimitDescriptor,
) -> Result<Option<Cow<'c, Rule>>, Status> {
    let Some(over) = &d.limit else {
        let entries = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
        return Ok(config.lookup(domain, entries).map(Cow::Borrowed));
    };
    if !config.has_domain(domain) || d.entries.is_empty() {
        return Ok(None);
    }
    let unit = Unit::from_proto(over.unit).ok_or_else(|| {
        let name = RateLimitUnit::try_from(over.unit)
            .map_or_else(|_| over.unit.to_string(), |u| u.as_str_name().to_owned());
        Status::invalid_argument(format!(
            "descriptors[{at}].limit.unit: {name} is not supported (SECOND, MINUTE, HOUR or DAY)"
        ))
    })?;
    let keys: Vec<&str> = d.entries.iter().map(|e| e.key.as_str()).collect();
    Ok(Some(Cow::Owned(Rule::overriding(
        over.requests_per_unit,
        unit,
        keys.join("."),
    ))))
}

/// Whether `new` should decide a counter in place of `old`: enforced where `old` is shadow, or
/// smaller.
fn stricter(new: &ChainLimit, old: &ChainLimit) -> bool {
    match (new.is_shadow(), old.is_shadow()) {
        (false, true) => true,
        (true, false) => false,
        _ => new.limit().max() < old.limit().max(),
    }
}

/// A descriptor's cost, as envoyproxy/ratelimit counts it.
fn cost(req: &RateLimitRequest, d: &RateLimitDescriptor) -> u64 {
    match &d.hits_addend {
        Some(v) => v.value,
        None => u64::from(req.hits_addend.max(1)),
    }
}

fn outcome(st: &LimitStatus, refusing: bool) -> DescriptorOutcome {
    match () {
        _ if refusing => DescriptorOutcome::Over,
        _ if st.shadow && st.over => DescriptorOutcome::ShadowOver,
        // 80% used or more: fewer than a fifth of the units left.
        _ if st.remaining.saturating_mul(5) <= st.limit.max() => DescriptorOutcome::Near,
        _ => DescriptorOutcome::Within,
    }
}

/// `%`, `.`, `=`, `{` and `}` of a key, value or domain, percent-encoded: the counter's name
/// then reads back to one list of entries, and the hash tag stays the domain.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' | '.' | '=' | '{' | '}' => out.push_str(&format!("%{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// The counter a descriptor is counted under: its entries, `KEY=VALUE` joined by `.`.
fn counter_id(d: &RateLimitDescriptor) -> String {
    let mut id = String::new();
    for (i, e) in d.entries.iter().enumerate() {
        if i > 0 {
            id.push('.');
        }
        id.push_str(&escape(&e.key));
        id.push('=');
        id.push_str(&escape(&e.value));
    }
    id
}

fn proto_duration(d: Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// The headers Envoy adds to its response: the primary limit's state in the IETF draft's
/// `RateLimit-Policy`/`RateLimit` fields and the classic `X-RateLimit-*`, written by the
/// library as the gateway's are ([`floodgate::http::apply_named`]: the policy named by the
/// rule's `name` or its descriptor keys, never a value, as a structured-field string; no `t` for
/// a refusal that no wait cures), and on a refusal `Retry-After` and `retry-after-ms`, exact
/// (docs/design.md §1).
fn headers(
    rule: &Rule,
    st: &LimitStatus,
    never: bool,
    retry_after: Option<Duration>,
) -> Vec<HeaderValue> {
    let policy = if rule.name.is_empty() {
        &rule.keys
    } else {
        &rule.name
    };
    let mut map = HeaderMap::new();
    http::apply_named(
        &mut map,
        policy,
        st.limit,
        st.remaining,
        (!never).then_some(st.reset),
    );
    if let Some(wait) = retry_after {
        http::apply_retry_after(&mut map, wait);
    }
    map.iter()
        .map(|(key, value)| HeaderValue {
            key: key.as_str().to_owned(),
            // Made from text: UTF-8.
            value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
            ..HeaderValue::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

    #[test]
    fn counter_names_cannot_collide() {
        let d = |entries: &[(&str, &str)]| RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..RateLimitDescriptor::default()
        };
        assert_eq!(counter_id(&d(&[("a", "b"), ("c", "d")])), "a=b.c=d");
        assert_ne!(
            counter_id(&d(&[("a", "b.c=d")])),
            counter_id(&d(&[("a", "b"), ("c", "d")]))
        );
        assert_eq!(escape("x{y}"), "x%7By%7D");
    }
}
