//! Concurrency limits: how many requests of a scope may run at once (docs/design.md §10).
//!
//! A rate limit counts requests that *start* in a window; an [`InFlightLimit`] counts requests
//! that are *running*. A request takes a slot in every concurrency limit of its chain in the
//! same atomic step as its rate limits ([`Chain::admit`](crate::Chain::admit)), under a
//! [`Lease`], and gives the slots back when it is done ([`Chain::release`](crate::Chain::release)).
//! A refusal, by any limit, takes no slot anywhere.
//!
//! On the memory store a slot is held until it is released. On Redis a slot is a member of a
//! sorted set scored by its expiry: the process that holds it renews it while the request runs,
//! so a process that dies (`kill -9`) frees its slots within the lease time
//! ([`RedisConfig::lease`](crate::store::redis::RedisConfig::lease)), and a request that runs
//! longer than the lease keeps its slot. A lease the process holds is renewed until it is
//! released, on either store: release from a guard dropped when the request ends
//! (docs/library.md, "Concurrency limits").

use std::sync::Arc;

use crate::chain::ScopeKind;

/// A cap on the requests of one scope running at once.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InFlightLimit {
    scope: ScopeKind,
    id: Arc<str>,
    max: u64,
    key: Arc<str>,
    shadow: bool,
}

impl InFlightLimit {
    /// At most `max` requests of scope `scope` named `id` at once. `tenant` names the hash tag
    /// its state is stored under, as for [`ChainLimit::new`](crate::ChainLimit::new): the
    /// storage key is `{tenant}:scope:id:inflight`.
    pub fn new(tenant: &str, scope: ScopeKind, id: &str, max: u64) -> Self {
        InFlightLimit {
            scope,
            id: id.into(),
            max,
            key: format!("{{{tenant}}}:{scope}:{id}:inflight").into(),
            shadow: false,
        }
    }

    /// This limit as a shadow one: it takes and gives back slots as usual but never refuses;
    /// a request it would have refused is reported ([`InFlightStatus::over`]).
    pub fn shadow(self) -> Self {
        self.with_shadow(true)
    }

    /// This limit, a shadow one or not ([`shadow`](Self::shadow)).
    pub fn with_shadow(self, shadow: bool) -> Self {
        InFlightLimit { shadow, ..self }
    }

    /// Whether this is a shadow limit.
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// The scope kind.
    pub fn scope(&self) -> ScopeKind {
        self.scope
    }

    /// The scope's id (tenant data: never show it to another tenant).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The most requests running at once.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The storage key, without a store's prefix.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether this limit refuses a request that finds `running` requests holding its slots.
    pub fn refuses(&self, running: u64) -> bool {
        !self.shadow && running >= self.max
    }
}

/// A request's hold on its slots, unique within its store: what
/// [`Chain::release`](crate::Chain::release) gives back. Release it exactly once, when the
/// request is done (a release of a lease already given back changes nothing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lease(u64);

impl Lease {
    /// The lease numbered `id` (stores hand out fresh numbers: [`Store::lease`](crate::store::Store::lease)).
    pub const fn from_id(id: u64) -> Lease {
        Lease(id)
    }

    /// Its number.
    pub const fn id(self) -> u64 {
        self.0
    }
}

/// One concurrency limit's state after a decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlightStatus {
    /// The scope kind (never its id: headers go to callers).
    pub scope: ScopeKind,
    /// The limit.
    pub max: u64,
    /// Requests running, this one included when it was admitted.
    pub running: u64,
    /// Whether the limit is a shadow one.
    pub shadow: bool,
    /// Whether the limit was full for this request: it refused it, or, for a shadow limit,
    /// would have.
    pub over: bool,
}

impl InFlightStatus {
    /// The status of `limit` for a request that found `running` requests before it and was
    /// `admitted` (and so took a slot) or not.
    pub fn of(limit: &InFlightLimit, running: u64, admitted: bool) -> InFlightStatus {
        InFlightStatus {
            scope: limit.scope,
            max: limit.max,
            running: running.saturating_add(u64::from(admitted)),
            shadow: limit.shadow,
            over: running >= limit.max,
        }
    }

    /// Slots left for other requests.
    pub fn remaining(&self) -> u64 {
        self.max.saturating_sub(self.running)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_the_tenant_tag_and_shadow_keeps_them() {
        let l = InFlightLimit::new("org:acme", ScopeKind::Key, "alice", 2);
        assert_eq!(l.key(), "{org:acme}:key:alice:inflight");
        let s = l.clone().shadow();
        assert!(s.is_shadow() && !l.is_shadow());
        assert_eq!(s.key(), l.key());
        assert!(l.refuses(2) && !l.refuses(1) && !s.refuses(5));
    }

    #[test]
    fn a_status_counts_the_request_only_when_admitted() {
        let l = InFlightLimit::new("org:acme", ScopeKind::Org, "acme", 3);
        let st = InFlightStatus::of(&l, 2, true);
        assert_eq!((st.running, st.remaining(), st.over), (3, 0, false));
        let st = InFlightStatus::of(&l, 3, false);
        assert_eq!((st.running, st.remaining(), st.over), (3, 0, true));
    }
}
