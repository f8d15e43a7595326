//! Callers: the bearer secret a request presents -> its key -> its scope chain.
//!
//! Chains are built once at load, so the hot path is one SHA-256 of the presented token and one
//! hash-map lookup. Secrets are kept only as SHA-256 digests: the map is keyed by the digest, so
//! the plain secret is never stored, compared byte by byte, or logged.

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::header::{AUTHORIZATION, SEC_WEBSOCKET_PROTOCOL};
use axum::http::{HeaderMap, HeaderName};
use floodgate::{Budget, Budgets, Chain, ChainLimit, InFlightLimit, ScopeKind};
use sha2::{Digest, Sha256};

use crate::config::{BudgetConfig, Config, GATEWAY_ID, ScopeLimit};
use crate::headers::ChainHeaders;

/// The header naming the end customer of a request, which adds the `customer` scope. (A name,
/// not text: a lookup by text parses and hashes it at every request.)
pub const CUSTOMER_HEADER: HeaderName = HeaderName::from_static("x-floodgate-customer");

/// The admin console's session cookie. A browser signed in to the console sends it to the
/// gateway's own port too (cookies are not told apart by port): it is taken off every request
/// before the upstream sees it.
pub const SESSION_COOKIE: &str = "floodgate_session";

/// The prefix of the `Sec-WebSocket-Protocol` entry in which a browser, which cannot set an
/// `Authorization` header on a WebSocket, sends its key: `openai-insecure-api-key.<secret>`.
pub const PROTOCOL_KEY_PREFIX: &str = "openai-insecure-api-key.";

/// One caller key with its precomputed chain.
#[derive(Debug)]
pub struct KeyEntry {
    /// The key's public id (for logs; never the secret).
    pub id: Arc<str>,
    /// Its slot in the refusal tally (at start, its position in the config's `[[keys]]`): a key
    /// keeps it across reloads, and its share of `[server] max_buffered_mib` goes by it.
    pub index: usize,
    /// The key's limits without customer and gateway: key, project, team, business unit, org.
    own: Vec<ChainLimit>,
    /// The key's budgets without customer and gateway, in the same order, each with whether
    /// it is a shadow one.
    own_budgets: Vec<(Budget, bool)>,
    /// The key's concurrency limits without customer and gateway, in the same order.
    own_in_flight: Vec<InFlightLimit>,
    /// The full chain for requests that name no customer (own limits, then the gateway's).
    chain: ResolvedChain,
}

/// A request's chain, with the header values that are the same on every response it decides.
#[derive(Clone, Debug)]
pub struct ResolvedChain {
    /// The limits, narrowest first.
    pub chain: Arc<Chain>,
    /// Their fixed header values.
    pub headers: Arc<ChainHeaders>,
    /// The budgets that apply, narrowest first; `None` when there are none, so that a chain
    /// without budgets costs nothing more per request.
    pub budgets: Option<Arc<Budgets>>,
    /// The shadow budgets: read like the others, never refusing; `None` when there are none.
    pub shadow_budgets: Option<Arc<Budgets>>,
    /// Every budget, shadow ones included: what a response's spend is added to.
    pub spend_budgets: Option<Arc<Budgets>>,
    /// The chain with its reserving token limits as reactive ones
    /// ([`Chain::reserving_as_reactive`]): what a request that reserves nothing (a realtime
    /// session, a request whose body is not read) is admitted and charged on. Built with a
    /// key's chain, which lives as long as the config; `None` for a chain without reserving
    /// limits, and for a customer's chain, built per request (its view is built only by a
    /// request that needs it).
    pub reactive: Option<Arc<Chain>>,
}

impl ResolvedChain {
    /// `chain`, with `budgets` (each with whether it is a shadow one).
    fn new(chain: Chain, budgets: Vec<(Budget, bool)>) -> ResolvedChain {
        let of = |shadow: Option<bool>| {
            let picked: Vec<Budget> = budgets
                .iter()
                .filter(|(_, s)| shadow.is_none_or(|want| *s == want))
                .map(|(b, _)| b.clone())
                .collect();
            (!picked.is_empty()).then(|| Arc::new(Budgets::new(picked)))
        };
        let shadow_budgets = of(Some(true));
        ResolvedChain {
            headers: Arc::new(ChainHeaders::new(&chain)),
            reactive: None,
            chain: Arc::new(chain),
            budgets: of(Some(false)),
            // Spend goes to every budget; only a chain with shadow ones needs a second set.
            spend_budgets: match shadow_budgets {
                Some(_) => of(None),
                None => of(Some(false)),
            },
            shadow_budgets,
        }
    }

    /// This chain with its reactive view built, if it has reserving limits.
    fn with_reactive_view(self) -> ResolvedChain {
        ResolvedChain {
            reactive: self
                .chain
                .has_reserved()
                .then(|| Arc::new(self.chain.reserving_as_reactive())),
            ..self
        }
    }
}

impl KeyEntry {
    /// The chain for requests naming no customer.
    pub fn chain(&self) -> &Arc<Chain> {
        &self.chain.chain
    }
}

/// Every key, by the SHA-256 of its secret, plus the customer and gateway limits and budgets.
#[derive(Debug, Default)]
pub struct Keys {
    by_hash: HashMap<[u8; 32], Arc<KeyEntry>>,
    customers: HashMap<Box<str>, Customer>,
    gateway: Vec<ChainLimit>,
    gateway_budgets: Vec<(Budget, bool)>,
    gateway_in_flight: Option<InFlightLimit>,
}

/// A customer's limits and budgets, added to a chain by the customer header.
#[derive(Debug, Default)]
struct Customer {
    limits: Vec<ChainLimit>,
    budgets: Vec<(Budget, bool)>,
    in_flight: Option<InFlightLimit>,
}

/// The limits of scope `(kind, id)` stored under `tenant`'s hash tag, as every chain holds
/// them (the admin listener reads and resets the very same state).
pub(crate) fn limits_of(
    config: &Config,
    tenant: &str,
    kind: ScopeKind,
    id: &str,
) -> Vec<ChainLimit> {
    config
        .scope_limits(kind, id)
        .iter()
        .map(|l: &ScopeLimit| {
            ChainLimit::new(tenant, kind, id, l.charge, l.limit).with_shadow(l.shadow)
        })
        .collect()
}

/// A scope's concurrency limit, if it has one.
pub(crate) fn in_flight_of(
    config: &Config,
    tenant: &str,
    kind: ScopeKind,
    id: &str,
) -> Option<InFlightLimit> {
    let l = config.in_flight.get(&(kind, id.to_owned()))?;
    Some(InFlightLimit::new(tenant, kind, id, l.max).with_shadow(l.shadow))
}

/// A scope's budgets, each with whether it is a shadow one.
pub(crate) fn budgets_of(
    config: &Config,
    tenant: &str,
    kind: ScopeKind,
    id: &str,
) -> Vec<(Budget, bool)> {
    config
        .scope_budgets(kind, id)
        .iter()
        .map(|b: &BudgetConfig| {
            let budget = Budget::new(tenant, kind, id, b.period, b.micro_usd);
            (budget, b.shadow)
        })
        .collect()
}

impl Keys {
    /// Builds every key's chain from `config`, each key's index its position in the config.
    pub fn from_config(config: &Config) -> Keys {
        let slots: Vec<usize> = (0..config.keys.len()).collect();
        Keys::with_slots(config, &slots)
    }

    /// Builds every key's chain from `config`, each key's index (its slot in the refusal tally)
    /// from `slots`, one per key in config order: a key keeps its slot across reloads.
    pub fn with_slots(config: &Config, slots: &[usize]) -> Keys {
        let gateway = limits_of(config, "gateway", ScopeKind::Gateway, GATEWAY_ID);
        let gateway_budgets = budgets_of(config, "gateway", ScopeKind::Gateway, GATEWAY_ID);
        let gateway_in_flight = in_flight_of(config, "gateway", ScopeKind::Gateway, GATEWAY_ID);
        let customers = config
            .limits
            .keys()
            .chain(config.budgets.keys())
            .chain(config.in_flight.keys())
            .filter(|(kind, _)| *kind == ScopeKind::Customer)
            .map(|(_, id)| {
                let tenant = format!("customer:{id}");
                let customer = Customer {
                    limits: limits_of(config, &tenant, ScopeKind::Customer, id),
                    budgets: budgets_of(config, &tenant, ScopeKind::Customer, id),
                    in_flight: in_flight_of(config, &tenant, ScopeKind::Customer, id),
                };
                (Box::from(id.as_str()), customer)
            })
            .collect();
        let by_hash = config
            .keys
            .iter()
            .enumerate()
            .map(|(position, k)| {
                let index = slots.get(position).copied().unwrap_or(position);
                let tenant = k.tenant();
                let own: Vec<ChainLimit> = k
                    .scopes()
                    .into_iter()
                    .flat_map(|(kind, id)| limits_of(config, &tenant, kind, id))
                    .collect();
                let own_budgets: Vec<(Budget, bool)> = k
                    .scopes()
                    .into_iter()
                    .flat_map(|(kind, id)| budgets_of(config, &tenant, kind, id))
                    .collect();
                let own_in_flight: Vec<InFlightLimit> = k
                    .scopes()
                    .into_iter()
                    .filter_map(|(kind, id)| in_flight_of(config, &tenant, kind, id))
                    .collect();
                // A key's chain lives as long as the config: its refusals are remembered
                // (docs/design.md §11). A customer's chain is built per request, so has none.
                let chain = Chain::new(own.iter().chain(&gateway).cloned().collect())
                    .cache_refusals()
                    .with_in_flight(
                        own_in_flight
                            .iter()
                            .chain(&gateway_in_flight)
                            .cloned()
                            .collect(),
                    );
                let budgets = own_budgets
                    .iter()
                    .chain(&gateway_budgets)
                    .cloned()
                    .collect();
                let entry = KeyEntry {
                    id: Arc::from(k.id.as_str()),
                    index,
                    own,
                    own_budgets,
                    own_in_flight,
                    chain: ResolvedChain::new(chain, budgets).with_reactive_view(),
                };
                (k.secret_sha256, Arc::new(entry))
            })
            .collect();
        Keys {
            by_hash,
            customers,
            gateway,
            gateway_budgets,
            gateway_in_flight,
        }
    }

    /// Empties every key chain's refusal cache: after a reset lowered counts.
    pub fn forget_refusals(&self) {
        for entry in self.by_hash.values() {
            entry.chain.chain.forget_refusals();
            if let Some(reactive) = &entry.chain.reactive {
                reactive.forget_refusals();
            }
        }
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether there are no keys (every request is then refused with 401).
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The key whose secret `token` is, if any.
    pub fn lookup(&self, token: &str) -> Option<&Arc<KeyEntry>> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        self.by_hash.get(&digest)
    }

    /// The key presented as `Authorization: Bearer <secret>` in `headers`.
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<&Arc<KeyEntry>> {
        let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
        let (scheme, token) = value.trim().split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        self.lookup(token.trim())
    }

    /// The key of a WebSocket upgrade: as [`Keys::authenticate`] when the request has an
    /// `Authorization` header; otherwise the first `Sec-WebSocket-Protocol` entry
    /// `openai-insecure-api-key.<secret>` (what OpenAI's browser clients send). The gateway
    /// never forwards that entry, and never logs it.
    pub fn authenticate_websocket(&self, headers: &HeaderMap) -> Option<&Arc<KeyEntry>> {
        if headers.contains_key(AUTHORIZATION) {
            return self.authenticate(headers);
        }
        let secret = headers
            .get_all(SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .find_map(|p| p.trim().strip_prefix(PROTOCOL_KEY_PREFIX))?;
        self.lookup(secret)
    }

    /// The chain of a request by `key` with `headers`: for the end customer its
    /// `X-Floodgate-Customer` header names, if any (see [`Keys::chain_for`]).
    pub fn chain_for_request(&self, key: &KeyEntry, headers: &HeaderMap) -> ResolvedChain {
        let customer = headers
            .get(CUSTOMER_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|c| !c.is_empty());
        self.chain_for(key, customer)
    }

    /// The chain of a request by `key` for end customer `customer`: the key's chain, with the
    /// customer's limits and budgets (if the config has any for it) between the org's and the
    /// gateway's.
    pub fn chain_for(&self, key: &KeyEntry, customer: Option<&str>) -> ResolvedChain {
        let Some(extra) = customer.and_then(|c| self.customers.get(c)) else {
            return key.chain.clone();
        };
        let limits = key
            .own
            .iter()
            .chain(&extra.limits)
            .chain(&self.gateway)
            .cloned()
            .collect();
        let budgets = key
            .own_budgets
            .iter()
            .chain(&extra.budgets)
            .chain(&self.gateway_budgets)
            .cloned()
            .collect();
        let in_flight = key
            .own_in_flight
            .iter()
            .chain(&extra.in_flight)
            .chain(&self.gateway_in_flight)
            .cloned()
            .collect();
        ResolvedChain::new(Chain::new(limits).with_in_flight(in_flight), budgets)
    }

    /// The customers that have limits or budgets, with their limits (for `check-config`).
    pub fn customers(&self) -> impl Iterator<Item = (&str, &[ChainLimit])> {
        self.customers
            .iter()
            .map(|(c, l)| (&**c, l.limits.as_slice()))
    }
}

/// Whether two secrets' digests are equal, compared in constant time: for a single secret
/// checked against one presented (the admin's, the alerts'). (Keys are found by their
/// digest in a table: what a lookup's time tells is about a digest, never a secret.)
pub(crate) fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_told_equal_by_every_byte() {
        let a = [7u8; 32];
        assert!(same_digest(&a, &a));
        for i in 0..32 {
            let mut b = a;
            b[i] ^= 1;
            assert!(!same_digest(&a, &b), "byte {i}");
        }
    }
    use crate::config::Config;

    const CONFIG: &str = r#"
[upstream]
demo = true
[gateway]
rate_limit = { requests = 1000 }
[[keys]]
id = "alice"
secret = "sk-alice"
org = "acme"
team = "ml"
rate_limit = { requests = 5, window_sec = 60 }
[[rate_limits]]
scope = "org"
id = "acme"
rpm = 600
tpm = 1000
[[rate_limits]]
scope = "customer"
id = "bob"
rpm = 2
"#;

    #[test]
    fn chains_are_narrowest_first() {
        let c = Config::parse_with_env("t.toml", CONFIG, None).unwrap();
        let keys = Keys::from_config(&c);
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, "Bearer sk-alice".parse().unwrap());
        let k = keys.authenticate(&h).unwrap();
        let kinds: Vec<_> = k.chain().limits().iter().map(|l| l.scope()).collect();
        assert_eq!(
            kinds,
            [
                ScopeKind::Key,
                ScopeKind::Org,
                ScopeKind::Org,
                ScopeKind::Gateway
            ]
        );
        assert_eq!(k.chain().limits()[0].key(), "{org:acme}:key:alice:req");
        let with = keys.chain_for(k, Some("bob")).chain;
        assert_eq!(with.limits()[3].scope(), ScopeKind::Customer);
        assert_eq!(with.limits()[3].key(), "{customer:bob}:customer:bob:req");
        assert_eq!(with.limits()[4].scope(), ScopeKind::Gateway);
        assert_eq!(keys.chain_for(k, Some("carol")).chain.limits().len(), 4);
        h.insert(AUTHORIZATION, "Bearer sk-nobody".parse().unwrap());
        assert!(keys.authenticate(&h).is_none());
    }

    #[test]
    fn a_websocket_key_comes_from_the_header_or_else_a_subprotocol() {
        let c = Config::parse_with_env("t.toml", CONFIG, None).unwrap();
        let keys = Keys::from_config(&c);
        let mut h = HeaderMap::new();
        h.insert(
            SEC_WEBSOCKET_PROTOCOL,
            "realtime, openai-insecure-api-key.sk-alice, openai-beta.realtime-v1"
                .parse()
                .unwrap(),
        );
        assert_eq!(&*keys.authenticate_websocket(&h).unwrap().id, "alice");
        assert!(keys.authenticate(&h).is_none(), "only for WebSockets");
        // An Authorization header decides when present, even a wrong one.
        h.insert(AUTHORIZATION, "Bearer sk-nobody".parse().unwrap());
        assert!(keys.authenticate_websocket(&h).is_none());
        let mut h = HeaderMap::new();
        h.insert(
            SEC_WEBSOCKET_PROTOCOL,
            "openai-insecure-api-key.sk-nobody".parse().unwrap(),
        );
        assert!(keys.authenticate_websocket(&h).is_none());
    }
}
