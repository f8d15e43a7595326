//! Admissions in a batch (group commit, `step.rs`): while one call is in flight, admissions
//! queue, and the next call carries them all, decided in the order they came; each caller then
//! gets back what the script saw for it. This file packs a batch's admissions into the call
//! (`admit.lua`'s groups) and replays each one's view from the reply.

use super::conn::Failure;
use super::doubles::Doubles;
use super::group::{Counters, Windows};
use super::kind_code;
use crate::chain::{ChainLimit, Costs};
use crate::period::PeriodCounter;
use crate::window::{Charge, MAX_COUNT, WindowLimit};

/// One queued admission: its chain, its costs, its time argument and where its answer goes.
pub(super) struct PendingAdmit {
    pub(super) limits: Vec<ChainLimit>,
    cost: GroupCost,
    /// Period counters and their caps: the admission goes ahead only if every one is under its
    /// cap when the call is made (a budget check in the same call: `Store::admit_within`).
    gate: Vec<(PeriodCounter, u64)>,
    /// A pinned time (µs); `None`: the store's clock, read when the batch goes out.
    pub(super) time: Option<u64>,
    /// Whether it already went out in a call whose connection dropped under it (an admission is
    /// replayed once: `Replay::Once`).
    pub(super) replayed: bool,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<Decided, Failure>>,
}

/// One admission's answer within a batch: the batch's instant, whether it was admitted, each
/// limit's `(cur, prev)` as it saw them, and its gate's counters' totals.
pub(super) type Decided = (u64, bool, Vec<(u64, u64)>, Vec<u64>);

impl PendingAdmit {
    /// The keys it puts in a call: its limits' windows and its gate's counters (each call's
    /// keys go on Lua's stack at once: `step.rs` BOUNDS).
    pub(super) fn keys(&self) -> usize {
        self.limits.len() + self.gate.len()
    }

    /// An admission of `limits` at `costs`, gated by `gate` (counters and their caps; empty:
    /// none), at the pinned time `time` (µs; `None`: the store's clock when the call goes out).
    pub(super) fn new(
        limits: &[ChainLimit],
        costs: Costs<'_>,
        gate: Vec<(PeriodCounter, u64)>,
        time: Option<u64>,
        reply: tokio::sync::oneshot::Sender<Result<Decided, Failure>>,
    ) -> PendingAdmit {
        PendingAdmit {
            limits: limits.to_vec(),
            cost: GroupCost::from_costs(costs),
            gate,
            time,
            replayed: false,
            reply,
        }
    }
}

/// Groups `batch`'s admissions as the script decides them, their keys interned into `windows`:
/// each run of requests of one cost on one chain is one group (see admit.lua).
///
/// The script takes one window, max, kind and shadow flag per key, so a request that names a
/// key the batch already holds with another limit (a chain rebuilt with a new max, or with the
/// limit turned shadow, while the old one is still in use) ends the batch: it and those after it
/// go in the next call, and the number of requests packed is returned with the groups.
pub(super) fn group<'a>(
    windows: &mut Windows<'a>,
    counters: &mut Counters<'a>,
    batch: &'a [PendingAdmit],
) -> (Vec<Group>, usize) {
    let mut groups: Vec<Group> = Vec::new();
    for (r, p) in batch.iter().enumerate() {
        let known = windows.list.len();
        let mut conflict = false;
        let chain: Vec<usize> = p
            .limits
            .iter()
            .map(|l| {
                let j = windows.intern(l);
                conflict |= j < known && decided_alike(windows.list[j]) != decided_alike(l);
                j + 1
            })
            .collect();
        if conflict {
            windows.truncate(known);
            return (groups, r);
        }
        let gate: Vec<(usize, u64)> = p
            .gate
            .iter()
            .map(|(c, cap)| (counters.intern(c), *cap))
            .collect();
        match groups.last_mut() {
            Some(g) if g.cost == p.cost && g.chain == chain && g.gate == gate => g.members.push(r),
            _ => groups.push(Group {
                cost: p.cost.clone(),
                chain,
                gate,
                members: vec![r],
            }),
        }
    }
    (groups, batch.len())
}

/// How many arguments [`write_groups`] appends for `groups`.
pub(super) fn group_args(groups: &[Group]) -> usize {
    1 + groups
        .iter()
        .map(|g| {
            let costs = match g.cost {
                GroupCost::Each(_) => 0,
                GroupCost::PerLimit(_) => g.chain.len(),
            };
            4 + g.chain.len() + costs + 2 * g.gate.len()
        })
        .sum::<usize>()
}

/// Appends the groups as admit.lua takes them: how many, then each one's cost, count, chain
/// length, gate length, chain, (per-limit costs) its costs, and its gate's counters (1-based
/// `KEYS` indices, after the call's `nw` windows) and caps.
pub(super) fn write_groups(args: &mut Doubles, groups: &[Group], nw: usize) {
    args.push_len(groups.len());
    for g in groups {
        match &g.cost {
            GroupCost::Each(cost) => args.push(*cost),
            GroupCost::PerLimit(_) => args.push_signed(-1),
        };
        args.push_len(g.members.len())
            .push_len(g.chain.len())
            .push_len(g.gate.len());
        for j in &g.chain {
            args.push_len(*j);
        }
        if let GroupCost::PerLimit(costs) = &g.cost {
            for c in costs.iter() {
                args.push(*c);
            }
        }
        for (k, cap) in &g.gate {
            args.push_len(1 + nw + k).push(*cap);
        }
    }
}

/// Appends a window's numbers as admit.lua takes them: window, max, kind (its TTL goes as an
/// argument of its own: `step.rs`).
pub(super) fn write_window(args: &mut Doubles, l: &ChainLimit) {
    args.push(l.limit().window_micros())
        .push(l.limit().max())
        .push(kind_code(l));
}

/// Answers each admission of `batch` (grouped as `groups`) with what the script saw for it:
/// `admitted` per group, `counts` each window's `[cur, prev]` before the batch (in `KEYS`
/// order), `charged` whether an admission charges each window, `totals` each counter's total
/// before the call (its gate's, as the script read them: nothing in the call adds to a counter
/// before its charges, which come after every admission).
pub(super) fn answer(
    batch: Vec<PendingAdmit>,
    groups: &[Group],
    admitted: &[usize],
    counts: &mut [[u64; 2]],
    charged: &[bool],
    totals: &[u64],
    now: u64,
) {
    let mut gates: Vec<Vec<u64>> = vec![Vec::new(); batch.len()];
    for g in groups.iter().filter(|g| !g.gate.is_empty()) {
        let gate: Vec<u64> = g.gate.iter().map(|&(k, _)| totals[k]).collect();
        for &r in &g.members {
            gates[r].clone_from(&gate);
        }
    }
    let mut replies: Vec<_> = batch.into_iter().map(|p| Some(p.reply)).collect();
    replay(groups, admitted, counts, charged, |r, admitted, seen| {
        if let Some(reply) = replies[r].take() {
            let gate = std::mem::take(&mut gates[r]);
            let _ = reply.send(Ok((now, admitted, seen, gate)));
        }
    });
}

/// What the script takes per key to decide it: two limits on one key that differ in any of these
/// cannot share a batch.
fn decided_alike(l: &ChainLimit) -> (WindowLimit, Charge, bool) {
    (l.limit(), l.charge(), l.is_shadow())
}

/// Replays what each request of a batch saw, exactly as the script decided: group after group,
/// within a group its first `admitted` requests admitted, each seeing its keys' counts plus the
/// costs of the admitted requests before it that charge them. Calls `each(request, admitted,
/// (cur, prev) of each of its limits)` in that order. `counts` (1-based `KEYS` order, as the
/// groups' indices) ends as the script left them.
fn replay(
    groups: &[Group],
    admitted: &[usize],
    counts: &mut [[u64; 2]],
    charged: &[bool],
    mut each: impl FnMut(usize, bool, Vec<(u64, u64)>),
) {
    for (group, &admitted) in groups.iter().zip(admitted) {
        for (m, &r) in group.members.iter().enumerate() {
            let seen = group
                .chain
                .iter()
                .map(|&j| {
                    let [cur, prev] = counts[j - 1];
                    (cur, prev)
                })
                .collect();
            let admitted = m < admitted;
            if admitted {
                for (i, &j) in group.chain.iter().enumerate() {
                    if charged[j - 1] {
                        // Counts stop at 2^53, as in the script (only a shadow limit, never
                        // refusing, can be charged that far).
                        let cur = &mut counts[j - 1][0];
                        *cur = cur.saturating_add(group.cost.of(i)).min(MAX_COUNT);
                    }
                }
            }
            each(r, admitted, seen);
        }
    }
}

/// A run of requests of one cost on one chain that came one after another, decided one after
/// another: a batch of like requests (many callers of one key) sends its chain once. Only runs
/// are grouped, so requests are still decided in the order they came (grouping all of a key's
/// requests would let a busy key's later requests go before another key's earlier ones).
pub(super) struct Group {
    pub(super) cost: GroupCost,
    /// The chain's keys, as 1-based indices into `KEYS`, in chain order.
    pub(super) chain: Vec<usize>,
    /// Its gate: period counters (0-based among the call's counters) and their caps.
    pub(super) gate: Vec<(usize, u64)>,
    /// The batch's requests in the group, in the order they are decided.
    pub(super) members: Vec<usize>,
}

/// What a queued admission costs its chain's limits, owned: one cost for every limit, or one
/// per limit (sent as a cost of -1 and the costs after the key indices: admit.lua).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum GroupCost {
    Each(u64),
    PerLimit(Box<[u64]>),
}

impl GroupCost {
    /// `costs`, owned; per-limit costs that are all one are sent as that one.
    fn from_costs(costs: Costs<'_>) -> GroupCost {
        match costs {
            Costs::Each(cost) => GroupCost::Each(cost),
            Costs::PerLimit(c) => match c.split_first() {
                Some((&first, rest)) if rest.iter().any(|&x| x != first) => {
                    GroupCost::PerLimit(c.into())
                }
                first => GroupCost::Each(first.map_or(0, |(&f, _)| f)),
            },
        }
    }

    /// The cost of limit `i` of the chain.
    fn of(&self, i: usize) -> u64 {
        match self {
            GroupCost::Each(cost) => *cost,
            GroupCost::PerLimit(costs) => costs.get(i).copied().unwrap_or(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(cost: u64, chain: &[usize], members: &[usize]) -> Group {
        Group {
            cost: GroupCost::Each(cost),
            chain: chain.to_vec(),
            gate: Vec::new(),
            members: members.to_vec(),
        }
    }

    #[test]
    fn the_replay_gives_each_request_what_the_script_saw() {
        // Keys 1 and 2 charged at admission, key 3 reactive (checked, never charged).
        let groups = [
            group(2, &[1, 2], &[0, 1, 2]),
            group(0, &[2, 3], &[3]),
            group(1, &[1], &[4, 5]),
        ];
        let mut counts = [[1, 0], [5, 9], [7, 7]];
        let mut seen = Vec::new();
        replay(
            &groups,
            &[2, 1, 0],
            &mut counts,
            &[true, true, false],
            |r, admitted, view| seen.push((r, admitted, view)),
        );
        assert_eq!(
            seen,
            [
                // The first two of the group of cost 2 are admitted, each after the one before.
                (0, true, vec![(1, 0), (5, 9)]),
                (1, true, vec![(3, 0), (7, 9)]),
                (2, false, vec![(5, 0), (9, 9)]),
                // Cost 0 charges nothing; the reactive key is never charged.
                (3, true, vec![(9, 9), (7, 7)]),
                // A group refused whole: every request sees the same counts.
                (4, false, vec![(5, 0)]),
                (5, false, vec![(5, 0)]),
            ]
        );
        assert_eq!(counts, [[5, 0], [9, 9], [7, 7]]);
    }

    #[test]
    fn the_replay_stops_counts_at_two_to_the_fifty_third_as_the_script_does() {
        // Only a shadow limit, never refusing, is charged that far: a cost no enforced limit
        // bounds.
        let groups = [group(u64::MAX, &[1], &[0, 1, 2])];
        let mut counts = [[5, 0]];
        let mut seen = Vec::new();
        replay(&groups, &[3], &mut counts, &[true], |r, _, view| {
            seen.push((r, view))
        });
        let full = vec![(MAX_COUNT, 0)];
        assert_eq!(seen, [(0, vec![(5, 0)]), (1, full.clone()), (2, full)]);
        assert_eq!(counts, [[MAX_COUNT, 0]]);
    }
}
