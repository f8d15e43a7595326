//! Scopes, limits and the chain decision: pure.
//!
//! A request carries a chain of limits ordered from the narrowest scope to the widest. Admission
//! is one atomic step over the whole chain (the store supplies the atomicity): every limit is
//! read at one instant, the request passes only if every limit passes, the first refusal in chain
//! order is the one reported, and only an admitted request is charged, to every limit charged at
//! admission.
//!
//! A limit may be a *shadow* one ([`ChainLimit::shadow`]): read, decided and charged like any
//! other, but never refusing. A shadow limit that would have refused is reported
//! ([`ChainDecision::shadow_over`]), so that a limit can be watched against real traffic before
//! it is enforced.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use foldhash::fast::RandomState;

use crate::cell::CellCache;
use crate::clock::Timestamp;
use crate::in_flight::{InFlightStatus, Lease};
use crate::window::{Charge, Snapshot, WindowLimit};

/// The kind of scope a limit belongs to, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScopeKind {
    /// One API key.
    Key,
    /// A project.
    Project,
    /// A team.
    Team,
    /// A business unit.
    BusinessUnit,
    /// An organisation: the tenant.
    Org,
    /// An end customer the caller names per request.
    Customer,
    /// All traffic through the gateway.
    Gateway,
}

impl ScopeKind {
    /// Every kind, in chain order.
    pub const ALL: [ScopeKind; 7] = [
        ScopeKind::Key,
        ScopeKind::Project,
        ScopeKind::Team,
        ScopeKind::BusinessUnit,
        ScopeKind::Org,
        ScopeKind::Customer,
        ScopeKind::Gateway,
    ];

    /// The name used in configs, storage keys and headers: `key`, `business_unit`, ...
    pub const fn as_str(self) -> &'static str {
        match self {
            ScopeKind::Key => "key",
            ScopeKind::Project => "project",
            ScopeKind::Team => "team",
            ScopeKind::BusinessUnit => "business_unit",
            ScopeKind::Org => "org",
            ScopeKind::Customer => "customer",
            ScopeKind::Gateway => "gateway",
        }
    }

    /// The kind named `name`, as [`as_str`](Self::as_str) spells it.
    pub fn parse(name: &str) -> Option<ScopeKind> {
        ScopeKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl fmt::Display for ScopeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The hasher of storage keys: one for the process, seeded at random when first used, so that no
/// caller can pick names that collide. A limit hashes its key with it once, where it is built, and
/// the memory store hashes with it too: a decision hashes no key text (docs/design.md §2).
pub(crate) static KEY_HASHER: LazyLock<RandomState> = LazyLock::new(RandomState::default);

/// One limit of a chain: a scope, what it counts, the limit, where its state lives, and whether
/// it is enforced or only observed ([`shadow`](Self::shadow)).
#[derive(Clone)]
pub struct ChainLimit {
    scope: ScopeKind,
    id: Arc<str>,
    charge: Charge,
    limit: WindowLimit,
    key: Arc<str>,
    /// `key` hashed by [`KEY_HASHER`].
    hash: u64,
    shadow: bool,
    /// The memory store's cell for this window, once a memory store has looked it up: not part
    /// of what the limit is (equality and hashing pass it over).
    cell: CellCache,
}

impl ChainLimit {
    /// What the limit is: everything but where a store keeps its state.
    fn parts(&self) -> (ScopeKind, &str, Charge, WindowLimit, &str, bool) {
        (
            self.scope,
            &self.id,
            self.charge,
            self.limit,
            &self.key,
            self.shadow,
        )
    }
}

impl PartialEq for ChainLimit {
    fn eq(&self, other: &ChainLimit) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for ChainLimit {}

impl std::hash::Hash for ChainLimit {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.parts().hash(state);
    }
}

impl fmt::Debug for ChainLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChainLimit")
            .field("scope", &self.scope)
            .field("id", &self.id)
            .field("charge", &self.charge)
            .field("limit", &self.limit)
            .field("key", &self.key)
            .field("shadow", &self.shadow)
            .finish()
    }
}

impl ChainLimit {
    /// A limit on scope `scope` named `id`, counting requests ([`Charge::Admission`]) or tokens
    /// ([`Charge::Reactive`], or [`Charge::Reserved`]: an estimate charged at admission, as the
    /// limit's own cost of [`Costs::PerLimit`], reconciled after). A reserved and a reactive token
    /// limit of one scope share their state.
    ///
    /// `tenant` names the hash tag its state is stored under: the org for an org's chain, so
    /// that one chain lies in one Redis Cluster slot; state shared by every tenant (the gateway
    /// scope) names itself. The storage key is `{tenant}:scope:id:req` (or `:tok`), with the
    /// window appended when it is not one minute, e.g. `{org:acme}:team:ml:req`.
    pub fn new(
        tenant: &str,
        scope: ScopeKind,
        id: &str,
        charge: Charge,
        limit: WindowLimit,
    ) -> Self {
        let units = if charge.counts_tokens() { "tok" } else { "req" };
        let mut key = format!("{{{tenant}}}:{scope}:{id}:{units}");
        if limit.window_micros() != 60_000_000 {
            key.push_str(&format!(":{}us", limit.window_micros()));
        }
        ChainLimit {
            scope,
            id: id.into(),
            charge,
            limit,
            hash: KEY_HASHER.hash_one(key.as_str()),
            key: key.into(),
            shadow: false,
            cell: CellCache::default(),
        }
    }

    /// This limit as a shadow limit: decided and charged exactly as usual, but it never refuses.
    /// A request it would have refused is admitted (if the chain's other limits admit it) and
    /// reported ([`ChainDecision::shadow_over`]). The storage key is the same: a limit observed
    /// instead of enforced keeps the counts it had, and keeps them when enforced again.
    pub fn shadow(self) -> Self {
        self.with_shadow(true)
    }

    /// This limit charged another way, on the same state: a token limit's storage key names
    /// its units, not how they are charged, so a reserved and a reactive one share it. (Only
    /// for a charge that counts the same units: requests and tokens have keys of their own.)
    pub(crate) fn with_charge(self, charge: Charge) -> Self {
        debug_assert_eq!(charge.counts_tokens(), self.charge.counts_tokens());
        ChainLimit { charge, ..self }
    }

    /// This limit, a shadow one or not ([`shadow`](Self::shadow)): for a flag read from a config.
    pub fn with_shadow(self, shadow: bool) -> Self {
        ChainLimit { shadow, ..self }
    }

    /// Whether this is a shadow limit: observed, never refusing.
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

    /// How the limit is charged.
    pub fn charge(&self) -> Charge {
        self.charge
    }

    /// The limit itself.
    pub fn limit(&self) -> WindowLimit {
        self.limit
    }

    /// The storage key, without a store's prefix.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The storage key as shared text: a store that keeps this very text knows the key again by
    /// its address, without comparing the text.
    pub(crate) fn shared_key(&self) -> &Arc<str> {
        &self.key
    }

    /// The storage key hashed by the process's key hasher, computed when the limit was built.
    pub(crate) fn key_hash(&self) -> u64 {
        self.hash
    }

    /// Where this limit remembers its memory store cell.
    pub(crate) fn cell(&self) -> &CellCache {
        &self.cell
    }

    /// Whether a request of `cost` can ever pass this limit. A shadow limit passes every request
    /// (it never refuses), so it never makes one impossible. A token limit of 0, reactive or
    /// reserving, passes none, a request that reserves nothing (cost 0) included: it blocks
    /// the scope's token use whichever way its tokens are charged.
    pub fn fits(&self, cost: u64) -> bool {
        let max = self.limit.max();
        self.shadow
            || match self.charge {
                Charge::Reactive => max > 0,
                Charge::Reserved => max > 0 && cost <= max,
                Charge::Admission => cost <= max,
            }
    }

    /// Whether this limit refuses a request of `cost` seeing `snapshot`: its test fails and it is
    /// enforced. (A shadow limit whose test fails is over, and admits.)
    pub fn refuses(&self, snapshot: &Snapshot, cost: u64) -> bool {
        !self.shadow && !snapshot.admits(self.limit, self.charge, cost)
    }

    /// The units this limit is charged when a request of `cost` is admitted.
    pub fn charged(&self, cost: u64) -> u64 {
        if self.charge.at_admission() { cost } else { 0 }
    }
}

/// What an admission charges each limit of its chain: one cost for every limit, or one per
/// limit.
///
/// A chain of request limits costs 1 each ([`Costs::Each`]). A request that reserves tokens
/// costs 1 on its request limits and its token estimate on its reserving token limits
/// ([`Charge::Reserved`]), decided in the same atomic step ([`Costs::PerLimit`]); so would a
/// descriptor's own hits in Envoy's rate limit service. A reactive limit ignores its cost.
///
/// ```
/// use floodgate::chain::Costs;
///
/// let costs = [1, 1, 4096];
/// assert_eq!(Costs::PerLimit(&costs).of(2), 4096);
/// assert_eq!(Costs::from(1).of(2), 1);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Costs<'a> {
    /// Every limit the same cost.
    Each(u64),
    /// One cost per limit, in chain order (as many as the chain has limits).
    PerLimit(&'a [u64]),
}

impl Costs<'_> {
    /// The cost of limit `index` (0 past the end of a short list).
    #[inline]
    pub fn of(&self, index: usize) -> u64 {
        match self {
            Costs::Each(cost) => *cost,
            Costs::PerLimit(costs) => costs.get(index).copied().unwrap_or(0),
        }
    }

    /// Whether every limit costs 0: an admission that only reads.
    pub fn is_zero(&self) -> bool {
        match self {
            Costs::Each(cost) => *cost == 0,
            Costs::PerLimit(costs) => costs.iter().all(|&c| c == 0),
        }
    }

    /// The index of the first limit of `limits` this request can never pass (its cost above an
    /// enforced charged limit's max, or an enforced token limit of zero).
    pub fn never_fits(&self, limits: &[ChainLimit]) -> Option<usize> {
        limits
            .iter()
            .enumerate()
            .position(|(i, l)| !l.fits(self.of(i)))
    }
}

impl From<u64> for Costs<'static> {
    fn from(cost: u64) -> Self {
        Costs::Each(cost)
    }
}

/// The index of the first limit of the chain that refuses a request of `costs`, reading each
/// limit's counts from `snapshots` (one per limit, same order); `None` if all admit. Shadow
/// limits never refuse ([`ChainLimit::refuses`]), so they are passed over: a chain whose only
/// failing tests are shadow ones admits.
#[inline]
pub fn first_refusal(
    limits: &[ChainLimit],
    snapshots: &[Snapshot],
    costs: Costs<'_>,
) -> Option<usize> {
    match costs {
        // The common case, a cost for the whole chain, without a lookup per limit.
        Costs::Each(cost) => limits
            .iter()
            .zip(snapshots)
            .position(|(l, s)| l.refuses(s, cost)),
        Costs::PerLimit(_) => limits
            .iter()
            .zip(snapshots)
            .enumerate()
            .position(|(i, (l, s))| l.refuses(s, costs.of(i))),
    }
}

/// One limit's state after a decision, for response headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitStatus {
    /// The scope kind (never its id: headers go to callers).
    pub scope: ScopeKind,
    /// Requests or tokens.
    pub charge: Charge,
    /// The limit.
    pub limit: WindowLimit,
    /// Whole units left after this request's charge (0 on the refusing limit, and on any limit
    /// already past its max, as a shadow one can be).
    pub remaining: u64,
    /// For a limit that refused, the exact wait until the request would pass (the chain's
    /// `retry_after`, which a later limit may decide); otherwise, shadow limits included, the
    /// time until the limit is whole again with no other traffic.
    pub reset: Duration,
    /// Whether the limit is a shadow one ([`ChainLimit::shadow`]): it never refuses, so it is
    /// never `refused_by`, never decides `retry_after` and is not a header's most restrictive
    /// limit; `remaining` and `reset` are its own state after the request, its charge included.
    pub shadow: bool,
    /// Whether the limit's test failed for this request: it refused it, or, for a shadow limit,
    /// would have. (A request that can never pass is decided without reading the store: then
    /// only the limit it can never fit is over.)
    pub over: bool,
}

/// The answer to a chain admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainDecision {
    /// Whether the request was admitted (and charged).
    pub admitted: bool,
    /// Whether the limits were checked. `false` when the store was unreachable and failed open:
    /// the request was admitted unchecked and `statuses` is empty. (A chain without limits is
    /// enforced, trivially, without asking the store.)
    pub enforced: bool,
    /// The instant the decision was taken at: the store's clock, or the caller's pinned time; the
    /// wall clock for a decision taken without the store (no limits, or a request that can never
    /// pass).
    pub now: Timestamp,
    /// Index into the chain of the first limit that refused, in chain order (docs/design.md §2);
    /// for a request that can never pass, the first limit it can never fit. The `reset` of every
    /// refusing limit's status is the chain's [`retry_after`](Self::retry_after): the wait until
    /// this request would pass, which a later limit of the chain may decide. Never a shadow
    /// limit.
    pub refused_by: Option<usize>,
    /// For a refusal, the exact wait until every enforced limit would admit the same request
    /// with no other traffic (the largest wait among refusing limits; shadow limits do not
    /// count); `None` if admitted, or if the request can never pass.
    pub retry_after: Option<Duration>,
    /// Each limit's state, in chain order.
    pub statuses: Vec<LimitStatus>,
    /// Each concurrency limit's state, in the chain's order of them (empty for a chain without
    /// any, or when the store failed open).
    pub in_flight: Vec<InFlightStatus>,
    /// For an admitted request of a chain with concurrency limits, the lease its slots are held
    /// under: give it back with [`Chain::release`](crate::Chain::release) when the request is
    /// done. `None` otherwise (nothing is held).
    pub lease: Option<Lease>,
    /// For an admitted request whose limits were charged at instants of their own (a chain
    /// decided slot by slot on a Redis Cluster: each slot's step on its node's clock), each
    /// limit's instant, in chain order: what a reservation is reconciled into
    /// ([`Chain::reconcile_charged`](crate::Chain::reconcile_charged)). Empty when every limit
    /// was charged at [`now`](Self::now), or nothing was.
    pub charged_at: Vec<Timestamp>,
}

impl ChainDecision {
    /// The decision taken from `snapshots` read at `now`, for a request of `costs` (a plain
    /// cost converts: `1.into()`).
    pub fn from_snapshots(
        limits: &[ChainLimit],
        snapshots: &[Snapshot],
        now: Timestamp,
        costs: Costs<'_>,
        admitted: bool,
    ) -> ChainDecision {
        if admitted {
            Self::admitted_from(limits, snapshots, now, costs)
        } else {
            Self::decided_from(limits, snapshots, now, costs, false)
        }
    }

    /// The decision of either outcome, worked out limit by limit: the path of a refusal, and
    /// what [`admitted_from`](Self::admitted_from) answers for an admission.
    fn decided_from(
        limits: &[ChainLimit],
        snapshots: &[Snapshot],
        now: Timestamp,
        costs: Costs<'_>,
        admitted: bool,
    ) -> ChainDecision {
        // Only a refusal asks which limit the request can never fit.
        let never = if admitted {
            None
        } else {
            costs.never_fits(limits)
        };
        let refused_by = if admitted {
            None
        } else {
            // As `Chain::admit_at` decides it, which never asks the store then.
            never.or_else(|| first_refusal(limits, snapshots, costs))
        };
        let mut retry_after = None;
        let mut statuses = Vec::with_capacity(limits.len());
        for (i, (l, s)) in limits.iter().zip(snapshots).enumerate() {
            let cost = costs.of(i);
            // An admitted request passed every enforced limit's test (the store ran the same
            // one): only a shadow limit can be over then.
            let over = (l.shadow || !admitted) && !s.admits(l.limit, l.charge, cost);
            // An admitted request is charged to every limit charged at admission, shadow ones
            // included; a refused one to none.
            let charged = if admitted { l.charged(cost) } else { 0 };
            // Only a refusing limit waits; a shadow one never refuses, so its status is its own
            // state, as for a limit that admits.
            let wait = if admitted || !l.refuses(s, cost) {
                None
            } else {
                s.retry_after(l.limit, l.charge, cost)
                    .filter(|w| !w.is_zero())
            };
            if let Some(w) = wait {
                retry_after = Some(retry_after.map_or(w, |r: Duration| r.max(w)));
            }
            statuses.push(LimitStatus {
                scope: l.scope,
                charge: l.charge,
                limit: l.limit,
                remaining: if wait.is_some() {
                    0
                } else {
                    s.remaining(l.limit, charged)
                },
                reset: wait.unwrap_or_else(|| s.until_empty(l.limit, charged)),
                shadow: l.shadow,
                over,
            });
        }
        if refused_by.is_some() && never.is_some() {
            // A refusal that no wait can cure (cost > max somewhere) has no retry time.
            retry_after = None;
        }
        // A refusing limit's reset is when the request would pass: with a key that frees in 15 s
        // under an org that frees in 60 s, the key is named (the first refusal) with 60 s, as
        // `Retry-After` says, so that a client pacing on any header is not refused again.
        if let Some(wait) = retry_after {
            for st in statuses.iter_mut().filter(|st| st.over && !st.shadow) {
                st.reset = wait;
            }
        }
        ChainDecision {
            admitted,
            enforced: true,
            now,
            refused_by,
            retry_after,
            statuses,
            in_flight: Vec::new(),
            lease: None,
            charged_at: Vec::new(),
        }
    }

    /// [`from_snapshots`](Self::from_snapshots) for an admitted request, the common case: no
    /// limit waits, every limit charged at admission is charged, and only a shadow limit can be
    /// over. Each status is made in one pass, into a list of the chain's length: no search for
    /// a refusing limit or a wait.
    fn admitted_from(
        limits: &[ChainLimit],
        snapshots: &[Snapshot],
        now: Timestamp,
        costs: Costs<'_>,
    ) -> ChainDecision {
        let statuses = limits
            .iter()
            .zip(snapshots)
            .enumerate()
            .map(|(i, (l, s))| {
                let cost = costs.of(i);
                let charged = l.charged(cost);
                LimitStatus {
                    scope: l.scope,
                    charge: l.charge,
                    limit: l.limit,
                    remaining: s.remaining(l.limit, charged),
                    reset: s.until_empty(l.limit, charged),
                    shadow: l.shadow,
                    over: l.shadow && !s.admits(l.limit, l.charge, cost),
                }
            })
            .collect();
        ChainDecision {
            admitted: true,
            enforced: true,
            now,
            refused_by: None,
            retry_after: None,
            statuses,
            in_flight: Vec::new(),
            lease: None,
            charged_at: Vec::new(),
        }
    }

    /// An admission decided without the store: nothing to check (`enforced`), or nothing
    /// checked (the store failed open).
    fn admitted_without_store(now: Timestamp, enforced: bool) -> ChainDecision {
        ChainDecision {
            admitted: true,
            enforced,
            now,
            refused_by: None,
            retry_after: None,
            statuses: Vec::new(),
            in_flight: Vec::new(),
            lease: None,
            charged_at: Vec::new(),
        }
    }

    /// A refusal decided without the store: the request can never pass limit `index`.
    pub fn impossible(limits: &[ChainLimit], index: usize, now: Timestamp) -> ChainDecision {
        let statuses = limits
            .iter()
            .enumerate()
            .map(|(i, l)| LimitStatus {
                scope: l.scope,
                charge: l.charge,
                limit: l.limit,
                remaining: if i == index { 0 } else { l.limit.max() },
                reset: Duration::ZERO,
                shadow: l.shadow,
                over: i == index,
            })
            .collect();
        ChainDecision {
            admitted: false,
            enforced: true,
            now,
            refused_by: Some(index),
            retry_after: None,
            statuses,
            in_flight: Vec::new(),
            lease: None,
            charged_at: Vec::new(),
        }
    }

    /// The admission of a chain without limits: nothing to check, nothing charged.
    pub fn unlimited(now: Timestamp) -> ChainDecision {
        Self::admitted_without_store(now, true)
    }

    /// An admission the store could not check and let through (fail open).
    pub fn unenforced(now: Timestamp) -> ChainDecision {
        Self::admitted_without_store(now, false)
    }

    /// The status of the limit that refused, if any.
    pub fn refusing(&self) -> Option<&LimitStatus> {
        self.refused_by.and_then(|i| self.statuses.get(i))
    }

    /// The concurrency limit that refused, if no rate limit did: the first enforced one that was
    /// full. (When a rate limit refuses too, the refusal is the rate limit's, which has an exact
    /// retry time: [`refusing`](Self::refusing).)
    pub fn refused_in_flight(&self) -> Option<&InFlightStatus> {
        if self.admitted || self.refused_by.is_some() {
            return None;
        }
        self.in_flight.iter().find(|s| s.over && !s.shadow)
    }

    /// The enforced concurrency limit with the fewest free slots (ties: the narrowest scope):
    /// the refusing one on a refusal.
    pub fn most_restrictive_in_flight(&self) -> Option<&InFlightStatus> {
        if let Some(r) = self.refused_in_flight() {
            return Some(r);
        }
        self.in_flight
            .iter()
            .filter(|s| !s.shadow)
            .min_by_key(|s| s.remaining())
    }

    /// The most restrictive limit counting `charge`'s units, requests or tokens (a reactive and a
    /// reserved token limit count the same units): the refusing one if it counts them, else the
    /// enforced one with the fewest whole units left (ties: the narrowest scope). Shadow limits
    /// are passed over: they restrict nothing.
    pub fn most_restrictive(&self, charge: Charge) -> Option<&LimitStatus> {
        let tokens = charge.counts_tokens();
        if let Some(r) = self
            .refusing()
            .filter(|r| r.charge.counts_tokens() == tokens)
        {
            return Some(r);
        }
        self.statuses
            .iter()
            .filter(|s| s.charge.counts_tokens() == tokens && !s.shadow)
            .min_by_key(|s| s.remaining)
    }

    /// The indexes into the chain, in chain order, of the shadow limits that were over: that
    /// would have refused this request had they been enforced. On an admitted request these are
    /// what enforcing them would change; on a refusal an enforced limit turned the request away
    /// anyway (and, as for every refusal, nothing was charged).
    pub fn shadow_over(&self) -> impl Iterator<Item = usize> + '_ {
        self.statuses
            .iter()
            .enumerate()
            .filter(|(_, s)| s.shadow && s.over)
            .map(|(i, _)| i)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The admitted path's statuses are the ones the general path works out.
        #[test]
        fn an_admission_decides_as_the_general_path(
            parts in prop::collection::vec(
                (0u8..3, 0u64..50, any::<bool>(), 0u64..60, 0u64..60, 0u64..60_000_000),
                1..6,
            ),
            cost in 0u64..5,
            per_limit in prop::option::of(prop::collection::vec(0u64..5, 0..6)),
        ) {
            let charges = [Charge::Admission, Charge::Reactive, Charge::Reserved];
            let limits: Vec<ChainLimit> = parts
                .iter()
                .enumerate()
                .map(|(i, &(charge, max, shadow, ..))| {
                    limit(ScopeKind::Key, &format!("k{i}"), charges[usize::from(charge)], max)
                        .with_shadow(shadow)
                })
                .collect();
            let snapshots: Vec<Snapshot> = parts
                .iter()
                .map(|&(_, _, _, cur, prev, elapsed)| Snapshot { bucket: 7, cur, prev, elapsed })
                .collect();
            // One cost for the chain, or one a limit (a short list costs the rest 0).
            let costs = per_limit.as_deref().map_or(Costs::Each(cost), Costs::PerLimit);
            let now = Timestamp::from_secs(420);
            prop_assert_eq!(
                ChainDecision::admitted_from(&limits, &snapshots, now, costs),
                ChainDecision::decided_from(&limits, &snapshots, now, costs, true)
            );
        }
    }

    fn limit(scope: ScopeKind, id: &str, charge: Charge, max: u64) -> ChainLimit {
        ChainLimit::new("org:acme", scope, id, charge, WindowLimit::per_minute(max))
    }

    #[test]
    fn storage_keys_carry_the_tenant_tag() {
        let l = limit(ScopeKind::Team, "ml", Charge::Admission, 5);
        assert_eq!(l.key(), "{org:acme}:team:ml:req");
        let h = ChainLimit::new(
            "org:acme",
            ScopeKind::Org,
            "acme",
            Charge::Reactive,
            WindowLimit::per_hour(5),
        );
        assert_eq!(h.key(), "{org:acme}:org:acme:tok:3600000000us");
    }

    #[test]
    fn first_refusal_in_chain_order_and_largest_retry() {
        let limits = [
            limit(ScopeKind::Key, "k", Charge::Admission, 1),
            limit(ScopeKind::Org, "acme", Charge::Admission, 1),
        ];
        let full = Snapshot {
            bucket: 1,
            cur: 1,
            prev: 0,
            elapsed: 0,
        };
        let fuller = Snapshot {
            bucket: 1,
            cur: 0,
            prev: 1,
            elapsed: 30_000_000,
        };
        let d = ChainDecision::from_snapshots(
            &limits,
            &[full, fuller],
            Timestamp::ZERO,
            1.into(),
            false,
        );
        assert_eq!(d.refused_by, Some(0));
        // key: wait for next bucket (60 s) and its whole weight (60 s) = 120 s; org: 30 s.
        assert_eq!(d.retry_after, Some(Duration::from_secs(120)));
        assert_eq!(
            d.most_restrictive(Charge::Admission).map(|s| s.scope),
            Some(ScopeKind::Key)
        );
    }

    #[test]
    fn the_first_refusal_is_named_with_the_wait_of_the_whole_chain() {
        let limits = [
            limit(ScopeKind::Key, "k", Charge::Admission, 1),
            limit(ScopeKind::Org, "acme", Charge::Admission, 1),
        ];
        // Key: full from the previous bucket, 30 s into this one: 30 s to wait. Org: full in
        // this bucket: 90 s.
        let key = Snapshot {
            bucket: 1,
            cur: 0,
            prev: 1,
            elapsed: 30_000_000,
        };
        let org = Snapshot {
            bucket: 1,
            cur: 1,
            prev: 0,
            elapsed: 30_000_000,
        };
        let d =
            ChainDecision::from_snapshots(&limits, &[key, org], Timestamp::ZERO, 1.into(), false);
        assert_eq!(d.retry_after, Some(Duration::from_secs(90)));
        assert_eq!(
            d.refused_by,
            Some(0),
            "the first refusal in chain order is named"
        );
        assert_eq!(
            d.refusing().map(|s| s.reset),
            d.retry_after,
            "with the wait until the request passes, which the org decides"
        );
        assert_eq!(d.statuses[1].reset, Duration::from_secs(90));
        // Every refusing limit announces that wait, not its own: a team between them that would
        // free in 45 s says 90 s too, as its family's OpenAI reset header may show it.
        let limits = [
            limit(ScopeKind::Key, "k", Charge::Admission, 1),
            limit(ScopeKind::Team, "t", Charge::Admission, 1),
            limit(ScopeKind::Org, "acme", Charge::Admission, 1),
        ];
        let team = Snapshot {
            elapsed: 15_000_000,
            ..key
        };
        let d = ChainDecision::from_snapshots(
            &limits,
            &[key, team, org],
            Timestamp::ZERO,
            1.into(),
            false,
        );
        assert_eq!(d.refused_by, Some(0));
        let resets: Vec<u64> = d.statuses.iter().map(|s| s.reset.as_secs()).collect();
        assert_eq!(resets, [90, 90, 90]);
        // A limit the request can never pass, after one that refuses for a while: the one it
        // can never fit is named, as `Chain::admit_at` (which then never asks the store) names
        // it, and nothing announces a retry.
        let limits = [
            limit(ScopeKind::Key, "k", Charge::Admission, 5),
            limit(ScopeKind::Org, "acme", Charge::Admission, 1),
        ];
        let full = Snapshot { cur: 5, ..org };
        let d =
            ChainDecision::from_snapshots(&limits, &[full, key], Timestamp::ZERO, 2.into(), false);
        assert_eq!((d.refused_by, d.retry_after), (Some(1), None));
    }

    #[test]
    fn a_shadow_limit_is_charged_and_reported_but_never_refuses() {
        let enforced = limit(ScopeKind::Key, "k", Charge::Admission, 2);
        let limits = [
            enforced.clone().shadow(),
            limit(ScopeKind::Org, "acme", Charge::Admission, 10),
        ];
        assert!(limits[0].is_shadow() && !enforced.is_shadow());
        assert_eq!(limits[0].key(), enforced.key(), "observed, the same state");
        assert_eq!(limits[0].clone().with_shadow(false), enforced);
        // 15 s into the bucket: the key holds 4 (over its 2), the org 3 of 10.
        let key = Snapshot {
            bucket: 1,
            cur: 4,
            prev: 0,
            elapsed: 15_000_000,
        };
        let org = Snapshot { cur: 3, ..key };
        assert!(!limits[0].refuses(&key, 1) && enforced.refuses(&key, 1));
        assert_eq!(first_refusal(&limits, &[key, org], 1.into()), None);
        let d =
            ChainDecision::from_snapshots(&limits, &[key, org], Timestamp::ZERO, 1.into(), true);
        assert_eq!(d.shadow_over().collect::<Vec<_>>(), [0]);
        // The shadow key's own state after its charge: nothing left, whole again 2W - e later.
        let st = d.statuses[0];
        assert_eq!((st.shadow, st.over), (true, true));
        assert_eq!((st.remaining, st.reset), (0, Duration::from_secs(105)));
        assert!(!d.statuses[1].shadow && !d.statuses[1].over);
        assert_eq!(d.statuses[1].remaining, 6);
        // It restricts nothing: headers describe the org.
        assert_eq!(
            d.most_restrictive(Charge::Admission).map(|s| s.scope),
            Some(ScopeKind::Org)
        );

        // The org full: it refuses with its own wait (the next bucket in 45 s, then
        // 60 - 9 * 60 / 10 = 6 s), not the shadow key's 45 + 60 - 1 * 60 / 4 = 90 s.
        let full = Snapshot { cur: 10, ..key };
        assert_eq!(first_refusal(&limits, &[key, full], 1.into()), Some(1));
        let d =
            ChainDecision::from_snapshots(&limits, &[key, full], Timestamp::ZERO, 1.into(), false);
        assert_eq!(d.refused_by, Some(1));
        assert_eq!(d.retry_after, Some(Duration::from_secs(51)));
        assert_eq!(d.statuses[1].reset, Duration::from_secs(51));
        // The shadow key, charged nothing, shows its own state, not the chain's wait.
        let st = d.statuses[0];
        assert_eq!((st.over, st.remaining), (true, 0));
        assert_eq!(st.reset, Duration::from_secs(105));
        assert_eq!(d.shadow_over().collect::<Vec<_>>(), [0]);
    }

    #[test]
    fn a_token_limit_of_zero_fits_no_request_reserving_or_not() {
        for charge in [Charge::Reactive, Charge::Reserved] {
            let zero = limit(ScopeKind::Key, "z", charge, 0);
            assert!(!zero.fits(0) && !zero.fits(1), "{charge:?}");
            assert!(zero.shadow().fits(0), "{charge:?}");
        }
        // A reservation of nothing fits a reserving limit above 0; a request limit of 0 is
        // read at cost 0.
        assert!(limit(ScopeKind::Key, "z", Charge::Reserved, 1).fits(0));
        assert!(limit(ScopeKind::Key, "z", Charge::Admission, 0).fits(0));
    }

    #[test]
    fn a_shadow_limit_no_request_fits_makes_no_request_impossible() {
        let zero = |charge| limit(ScopeKind::Key, "z", charge, 0).shadow();
        let limits = [zero(Charge::Admission), zero(Charge::Reactive)];
        assert!(limits.iter().all(|l| l.fits(1)));
        assert!(!limit(ScopeKind::Key, "z", Charge::Admission, 0).fits(1));
        let empty = Snapshot::default();
        assert_eq!(first_refusal(&limits, &[empty, empty], 1.into()), None);
        let d = ChainDecision::from_snapshots(
            &limits,
            &[empty, empty],
            Timestamp::ZERO,
            1.into(),
            true,
        );
        assert_eq!((d.refused_by, d.retry_after), (None, None));
        assert_eq!(d.shadow_over().collect::<Vec<_>>(), [0, 1]);
        assert_eq!(d.most_restrictive(Charge::Admission), None);
        // Beside an enforced limit the request cannot fit, that one is named.
        let limits = [
            limits[0].clone(),
            limit(ScopeKind::Org, "acme", Charge::Admission, 0),
        ];
        let d = ChainDecision::from_snapshots(
            &limits,
            &[empty, empty],
            Timestamp::ZERO,
            1.into(),
            false,
        );
        assert_eq!((d.refused_by, d.retry_after), (Some(1), None));
    }

    #[test]
    fn scope_names_round_trip() {
        for k in ScopeKind::ALL {
            assert_eq!(ScopeKind::parse(k.as_str()), Some(k));
        }
    }
}
