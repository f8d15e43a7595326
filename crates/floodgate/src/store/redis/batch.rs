//! Admission batching (group commit): while one admission call is in flight, admissions queue,
//! and the next call carries them all, decided in the order they came; each caller then gets
//! back what the script saw for it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use ::redis::Cmd;

use super::conn::{Failure, bad_reply, int};
use super::scripts::ADMIT;
use super::stats::bump;
use super::{RedisStore, kind_arg, ttl_millis};
use crate::chain::{ChainLimit, Costs};
use crate::clock::Timestamp;
use crate::store::Observation;
use crate::window::{Charge, MAX_COUNT, Snapshot, WindowLimit};

/// One slot's admission queue (a single server has one).
type Lane = Arc<Mutex<AdmitQueue>>;

fn lock(lane: &Lane) -> MutexGuard<'_, AdmitQueue> {
    // Pushes and drains cannot leave the queue half-changed.
    lane.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Admissions queued for the next batch, and whether a task is sending batches.
#[derive(Default)]
pub(super) struct AdmitQueue {
    pending: Vec<PendingAdmit>,
    sending: bool,
}

/// One queued admission: its chain, its costs, its time argument and where its answer goes.
struct PendingAdmit {
    limits: Vec<ChainLimit>,
    cost: GroupCost,
    /// A pinned time (µs); `None`: the store's clock, read when the batch goes out.
    time: Option<u64>,
    reply: tokio::sync::oneshot::Sender<Result<Decided, Failure>>,
}

/// One admission's answer within a batch: the batch's instant, whether it was admitted, and each
/// limit's `(cur, prev)` as it saw them.
type Decided = (u64, bool, Vec<(u64, u64)>);

/// The most requests one batch carries.
const MAX_BATCH: usize = 256;
/// The most limits (over all its requests) one batch carries, past its first request: the
/// script unpacks its keys onto Lua's stack for MGET (at most about 8 000 values).
const MAX_BATCH_LIMITS: usize = 4096;

impl RedisStore {
    /// Admits through a batch. While one batch is in flight, admissions queue; the next batch
    /// takes them all (group commit), so a busy store sends one script call, one MGET and one
    /// SET per distinct key for many requests, while an idle one sends each admission at once,
    /// alone. The sending runs in a task of its own, so a caller that gives up (a client that
    /// disconnects) never strands the others.
    pub(super) async fn admit_inner(
        &self,
        limits: &[ChainLimit],
        costs: Costs<'_>,
        now: Option<Timestamp>,
    ) -> Result<Observation, Failure> {
        if self.inner.open.load(Ordering::Acquire) {
            // The breaker answers at once; the probe task closes it when Redis is back.
            return Err(Failure::Unavailable("circuit breaker open".into()));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let pending = PendingAdmit {
            limits: limits.to_vec(),
            cost: GroupCost::from_costs(costs),
            // Only a pinned time is fixed now: the client's clock is read when the batch goes
            // out, so that unpinned admissions share a batch under either clock.
            time: now.map(Timestamp::as_micros),
            reply: tx,
        };
        // On a cluster, the chain's slot (all its keys lie in one: `RedisStore::admit_across`).
        let lane = self
            .inner
            .admissions
            .lane(limits.first().and_then(|l| self.slot(l.key())));
        let start = {
            let mut q = lock(&lane);
            q.pending.push(pending);
            !std::mem::replace(&mut q.sending, true)
        };
        if start {
            tokio::spawn(self.clone().send_batches(lane));
        }
        let (t, admitted, counts) = rx
            .await
            .map_err(|_| Failure::Unavailable("admission batch abandoned".into()))??;
        let snapshots = limits
            .iter()
            .zip(counts)
            .map(|(l, (cur, prev))| {
                let w = l.limit().window_micros();
                Snapshot {
                    bucket: t / w,
                    elapsed: t % w,
                    cur,
                    prev,
                }
            })
            .collect();
        self.count(admitted);
        Ok(Observation {
            now: Timestamp::from_micros(t),
            admitted,
            enforced: true,
            snapshots,
            running: Vec::new(),
            at: Vec::new(),
        })
    }

    /// Sends batches until `lane`'s queue is empty. One batch shares one time argument:
    /// admissions with another (a pinned clock) wait for a later batch.
    async fn send_batches(self, lane: Lane) {
        // If sending stops early (it panicked, or its runtime shut down and dropped it), the
        // queue must not stay marked as served, or every later admission would wait for a
        // sender that is gone: the queued ones are answered as unavailable (their failure
        // policy applies) and the next admission starts a sender again. The batch in hand fails
        // over the same way, its answers dropped.
        struct Unmark<'a> {
            lane: &'a Lane,
            done: bool,
        }
        impl Drop for Unmark<'_> {
            fn drop(&mut self) {
                if !self.done {
                    let queued = {
                        let mut q = lock(self.lane);
                        q.sending = false;
                        std::mem::take(&mut q.pending)
                    };
                    let why = Failure::Unavailable("the admission sender stopped".into());
                    answer_all(queued, &why);
                }
            }
        }
        let mut unmark = Unmark {
            lane: &lane,
            done: false,
        };
        loop {
            let batch: Vec<PendingAdmit> = {
                let mut q = lock(&lane);
                let mut batch = Vec::new();
                let mut rest = Vec::new();
                let mut limits = 0;
                // The batch's time: its first admission's.
                let mut time = None;
                // Once one does not fit, none after it goes either: a smaller one after it must
                // not be decided before it.
                let mut full = false;
                for p in q.pending.drain(..) {
                    if p.reply.is_closed() {
                        // Its caller gave up while it waited (a client that disconnected): it
                        // goes nowhere, so nothing is charged for a request never served.
                        continue;
                    }
                    if *time.get_or_insert(p.time) == p.time && !full {
                        let fits = batch.is_empty()
                            || (batch.len() < MAX_BATCH
                                && limits + p.limits.len() <= MAX_BATCH_LIMITS);
                        if fits {
                            limits += p.limits.len();
                            batch.push(p);
                            continue;
                        }
                        full = true;
                    }
                    rest.push(p);
                }
                q.pending = rest;
                if batch.is_empty() {
                    // Nothing open was queued (the first open admission always fits), so
                    // nothing is left either.
                    q.sending = false;
                    unmark.done = true;
                    return;
                }
                batch
            };
            self.send_batch(&lane, batch).await;
        }
    }

    async fn send_batch(&self, lane: &Lane, mut batch: Vec<PendingAdmit>) {
        let (
            Packed {
                cmd,
                groups,
                charged,
            },
            taken,
        ) = self.pack(&batch);
        if taken < batch.len() {
            // Back to the front of the queue: they came before anything queued since.
            let rest = batch.split_off(taken);
            let mut q = lock(lane);
            let later = std::mem::replace(&mut q.pending, rest);
            q.pending.extend(later);
        }
        bump(&self.inner.counters.admit_batches);
        let answer = self
            .inner
            .run::<Vec<::redis::Value>>(&ADMIT, &cmd)
            .await
            .and_then(|reply| admit_reply(reply, &groups, charged.len()));
        let AdmitReply {
            now,
            admitted,
            mut counts,
        } = match answer {
            Ok(answer) => answer,
            Err(failure) => return answer_all(batch, &failure),
        };
        let mut replies: Vec<_> = batch.into_iter().map(|p| Some(p.reply)).collect();
        replay(
            &groups,
            &admitted,
            &mut counts,
            &charged,
            |r, admitted, seen| {
                if let Some(reply) = replies[r].take() {
                    let _ = reply.send(Ok((now, admitted, seen)));
                }
            },
        );
    }

    /// The admission script's call for `batch`: its distinct keys, and its requests in the order
    /// they came, each run of requests of one cost on one chain as one group (see admit.lua).
    ///
    /// The script takes one window, max, kind and shadow flag per key, so a request that names a
    /// key the batch already holds with another limit (a chain rebuilt with a new max, or with
    /// the limit turned shadow, while the old one is still in use) ends the batch: it and those
    /// after it go in the next call, and the number of requests packed is returned with the
    /// call.
    fn pack(&self, batch: &[PendingAdmit]) -> (Packed, usize) {
        let mut keys: Vec<&ChainLimit> = Vec::new();
        let mut index: HashMap<&str, usize, foldhash::fast::RandomState> = HashMap::default();
        let mut groups: Vec<Group> = Vec::new();
        let mut taken = batch.len();
        for (r, p) in batch.iter().enumerate() {
            let known = keys.len();
            let mut conflict = false;
            let chain: Vec<usize> = p
                .limits
                .iter()
                .map(|l| {
                    let j = *index.entry(l.key()).or_insert_with(|| {
                        keys.push(l);
                        keys.len()
                    });
                    let held = keys[j - 1];
                    conflict |= j <= known && decided_alike(held) != decided_alike(l);
                    j
                })
                .collect();
            if conflict {
                for l in keys.drain(known..) {
                    index.remove(l.key());
                }
                taken = r;
                break;
            }
            match groups.last_mut() {
                Some(g) if g.cost == p.cost && g.chain == chain => g.members.push(r),
                _ => groups.push(Group {
                    cost: p.cost.clone(),
                    chain,
                    members: vec![r],
                }),
            }
        }
        let group_args = |g: &Group| match g.cost {
            GroupCost::Each(_) => 3 + g.chain.len(),
            GroupCost::PerLimit(_) => 3 + 2 * g.chain.len(),
        };
        let argc = 1 + 4 * keys.len() + groups.iter().map(group_args).sum::<usize>();
        let mut cmd = self.evalsha(&ADMIT, keys.len(), argc);
        for l in &keys {
            self.key_arg(&mut cmd, &[l.key()]);
        }
        match batch[0].time.or_else(|| self.time_of(None)) {
            Some(t) => cmd.arg(t),
            None => cmd.arg(""),
        };
        for l in &keys {
            let w = l.limit().window_micros();
            cmd.arg(w).arg(l.limit().max()).arg(kind_arg(l));
            cmd.arg(ttl_millis(w));
        }
        for g in &groups {
            match &g.cost {
                GroupCost::Each(cost) => cmd.arg(*cost),
                GroupCost::PerLimit(_) => cmd.arg(-1),
            };
            cmd.arg(g.members.len()).arg(g.chain.len());
            for j in &g.chain {
                cmd.arg(*j);
            }
            if let GroupCost::PerLimit(costs) = &g.cost {
                for c in costs.iter() {
                    cmd.arg(*c);
                }
            }
        }
        let charged = keys.iter().map(|l| l.charge().at_admission()).collect();
        (
            Packed {
                cmd,
                groups,
                charged,
            },
            taken,
        )
    }
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

/// Answers every request of a batch that failed with `failure`.
fn answer_all(batch: Vec<PendingAdmit>, failure: &Failure) {
    for p in batch {
        let _ = p.reply.send(Err(failure.again()));
    }
}

/// A batch's admission call and what reading its reply needs.
struct Packed {
    cmd: Cmd,
    /// The requests grouped as the script decides them.
    groups: Vec<Group>,
    /// Per key, in `KEYS` order: whether an admission charges it.
    charged: Vec<bool>,
}

/// A run of requests of one cost on one chain that came one after another, decided one after
/// another: a batch of like requests (many callers of one key) sends its chain once. Only runs
/// are grouped, so requests are still decided in the order they came (grouping all of a key's
/// requests would let a busy key's later requests go before another key's earlier ones).
struct Group {
    cost: GroupCost,
    /// The chain's keys, as 1-based indices into `KEYS`, in chain order.
    chain: Vec<usize>,
    /// The batch's requests in the group, in the order they are decided.
    members: Vec<usize>,
}

/// What a queued admission costs its chain's limits, owned: one cost for every limit, or one
/// per limit (sent as a cost of -1 and the costs after the key indices: admit.lua).
#[derive(Clone, Debug, PartialEq, Eq)]
enum GroupCost {
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

/// The admission script's reply for a batch (see admit.lua).
struct AdmitReply {
    /// The batch's instant.
    now: u64,
    /// How many of each group's requests were admitted (its first ones).
    admitted: Vec<usize>,
    /// Each key's `[cur, prev]` before the batch, in `KEYS` order.
    counts: Vec<[u64; 2]>,
}

/// Reads the admission script's reply for a batch of `groups` over `keys` distinct keys.
fn admit_reply(
    reply: Vec<::redis::Value>,
    groups: &[Group],
    keys: usize,
) -> Result<AdmitReply, Failure> {
    if reply.len() != 1 + 2 * keys + groups.len() {
        return Err(bad_reply());
    }
    let (now, rest) = reply.split_first().ok_or_else(bad_reply)?;
    let (counts, admitted) = rest.split_at(2 * keys);
    let counts = counts
        .chunks_exact(2)
        .map(|c| Ok([int(&c[0])?, int(&c[1])?]))
        .collect::<Result<Vec<_>, Failure>>()?;
    let admitted = admitted
        .iter()
        .zip(groups)
        .map(|(a, g)| match usize::try_from(int(a)?) {
            Ok(a) if a <= g.members.len() => Ok(a),
            _ => Err(bad_reply()),
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(AdmitReply {
        now: int(now)?,
        admitted,
        counts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(cost: u64, chain: &[usize], members: &[usize]) -> Group {
        Group {
            cost: GroupCost::Each(cost),
            chain: chain.to_vec(),
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

    #[test]
    fn a_malformed_admission_reply_is_an_error() {
        use ::redis::Value::{BulkString, Int};
        let groups = [group(1, &[1], &[0, 1])];
        let reply = |v: Vec<::redis::Value>| admit_reply(v, &groups, 1);
        let ok = reply(vec![Int(7), Int(3), Int(0), Int(2)])
            .ok()
            .expect("a well-formed reply");
        assert_eq!((ok.now, ok.counts, ok.admitted), (7, vec![[3, 0]], vec![2]));
        // One value short, more admitted than the group holds, a negative count, a string.
        assert!(reply(vec![Int(7), Int(3), Int(0)]).is_err());
        assert!(reply(vec![Int(7), Int(3), Int(0), Int(3)]).is_err());
        assert!(reply(vec![Int(7), Int(-3), Int(0), Int(1)]).is_err());
        assert!(reply(vec![Int(7), Int(3), Int(0), BulkString(b"1".to_vec())]).is_err());
    }
}
