//! The scopes a config names, each with the limits and budgets whose state the admin listener
//! reads (`GET /admin/usage`) and clears (`POST /admin/reset`): the very `ChainLimit`s and
//! `Budget`s the keys' chains hold (built by the same functions), so a reset clears what
//! admission counts.
//!
//! A scope's state is stored under its tenant's hash tag (docs/design.md §5): a team shared by
//! keys of two orgs has a window per org, and is listed once per tenant.

use floodgate::{Budget, ChainLimit, InFlightLimit, ScopeKind};

use crate::auth::{budgets_of, in_flight_of, limits_of};
use crate::config::{Config, GATEWAY_ID};

/// One scope under one tenant, with what is stored for it.
#[derive(Debug)]
pub struct Scope {
    /// The kind.
    pub kind: ScopeKind,
    /// The id (the gateway's is `gateway`).
    pub id: String,
    /// The hash tag its state is stored under: `org:acme`, `key:alice`, `customer:c1`,
    /// `gateway`.
    pub tenant: String,
    /// Its limits.
    pub limits: Vec<ChainLimit>,
    /// Its budgets, each with whether it is a shadow one.
    pub budgets: Vec<(Budget, bool)>,
    /// Its concurrency limit (`max_in_flight`), if any.
    pub in_flight: Option<InFlightLimit>,
}

/// Every scope of a config, in a fixed order: by kind (narrowest first), then id, then tenant.
#[derive(Debug, Default)]
pub struct Catalogue {
    scopes: Vec<Scope>,
}

impl Catalogue {
    /// The scopes of `config`: every key, every group a key belongs to (per tenant), every
    /// customer with limits or budgets, and the gateway.
    pub fn new(config: &Config) -> Catalogue {
        let mut seen = std::collections::HashSet::new();
        let mut scopes = Vec::new();
        let mut add = |kind: ScopeKind, id: &str, tenant: String| {
            if seen.insert((kind, id.to_owned(), tenant.clone())) {
                scopes.push(Scope {
                    kind,
                    id: id.to_owned(),
                    limits: limits_of(config, &tenant, kind, id),
                    budgets: budgets_of(config, &tenant, kind, id),
                    in_flight: in_flight_of(config, &tenant, kind, id),
                    tenant,
                });
            }
        };
        for key in &config.keys {
            let tenant = key.tenant();
            for (kind, id) in key.scopes() {
                add(kind, id, tenant.clone());
            }
        }
        let configured = config.limits.keys().chain(config.budgets.keys());
        for (kind, id) in configured.chain(config.in_flight.keys()) {
            if *kind == ScopeKind::Customer {
                add(*kind, id, format!("customer:{id}"));
            }
        }
        add(ScopeKind::Gateway, GATEWAY_ID, "gateway".to_owned());
        scopes.sort_by(|a, b| (a.kind, &a.id, &a.tenant).cmp(&(b.kind, &b.id, &b.tenant)));
        Catalogue { scopes }
    }

    /// The scopes, in order.
    pub fn scopes(&self) -> &[Scope] {
        &self.scopes
    }

    /// Every tenant's entry of scope `(kind, id)`.
    pub fn find(&self, kind: ScopeKind, id: &str) -> impl Iterator<Item = &Scope> {
        self.scopes
            .iter()
            .filter(move |s| s.kind == kind && s.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scope_once_per_tenant_in_order() {
        let c = Config::parse_with_env(
            "t.toml",
            r#"
[upstream]
demo = true
[gateway]
rate_limit = { requests = 100 }
[[keys]]
id = "b"
secret = "sk-b"
org = "acme"
team = "ml"
[[keys]]
id = "a"
secret = "sk-a"
org = "acme"
team = "ml"
[[keys]]
id = "solo"
secret = "sk-s"
org = "other"
team = "ml"
[[rate_limits]]
scope = "team"
id = "ml"
rpm = 10
[[rate_limits]]
scope = "customer"
id = "c1"
rpm = 2
"#,
            None,
        )
        .unwrap();
        let cat = Catalogue::new(&c);
        let listed: Vec<String> = cat
            .scopes()
            .iter()
            .map(|s| format!("{} {} {} {}", s.kind, s.id, s.tenant, s.limits.len()))
            .collect();
        assert_eq!(
            listed,
            [
                "key a org:acme 0",
                "key b org:acme 0",
                "key solo org:other 0",
                "team ml org:acme 1",
                "team ml org:other 1",
                "org acme org:acme 0",
                "org other org:other 0",
                "customer c1 customer:c1 1",
                "gateway gateway gateway 1",
            ]
        );
        // The very storage key the chains use.
        let team: Vec<&str> = cat
            .find(ScopeKind::Team, "ml")
            .map(|s| s.limits[0].key())
            .collect();
        assert_eq!(team, ["{org:acme}:team:ml:req", "{org:other}:team:ml:req"]);
    }
}
