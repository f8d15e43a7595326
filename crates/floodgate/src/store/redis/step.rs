//! One call for a batch of a slot's admissions, budget reads and charges (group commit,
//! `group.rs`): while one call is in flight, all three queue together, in the order they came,
//! and the next call (`admit.lua`) carries them all: the budget reads see the counters as they
//! were before the call, the admissions are decided in order, then the charges are added in
//! order. An org's token window, which an admission checks and a charge adds to, and its budget,
//! which a read checks and a charge adds to, are thus read and written once for all of them, and
//! a busy store sends one script call where it sent three (docs/redis.md, "Batching").
//!
//! Replays: admissions and reads may run twice after a dropped connection (`Replay::Once`);
//! charges never may. A call that carries charges is never replayed: if its connection drops
//! under it, its charges fail, as each alone would have, and its admissions and reads go back to
//! the front of the queue for the next call, once.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use ::redis::Cmd;
use ::redis::cluster_routing::Slot;

use super::batch::{self, Group, PendingAdmit};
use super::charges::{self, PendingCharge};
use super::conn::{Failure, bad_reply};
use super::doubles::{self, Doubles};
use super::group::{self, Answer, Bounds, Counters, Queue, Queued, Windows};
use super::reads::{self, PendingRead};
use super::scripts::{ADMIT, ADMIT_CHARGING};
use super::stats::bump;
use super::{RedisStore, period_code, ttl_millis};

/// A slot's queue of calls for the next step.
pub(super) type StepQueue = Queue<Pending>;

/// One queued call: an admission, a budget read or a charge.
pub(super) enum Pending {
    Admit(PendingAdmit),
    Read(PendingRead),
    Charge(PendingCharge),
}

impl Queued for Pending {
    fn time(&self) -> Option<u64> {
        match self {
            Pending::Admit(p) => p.time,
            Pending::Read(p) => p.time,
            Pending::Charge(p) => p.time,
        }
    }
    fn keys(&self) -> usize {
        match self {
            Pending::Admit(p) => p.keys(),
            Pending::Read(p) => p.counters.len(),
            Pending::Charge(p) => p.keys(),
        }
    }
    fn fail(self, failure: &Failure) {
        match self {
            Pending::Admit(p) => {
                let _ = p.reply.send(Err(failure.again()));
            }
            Pending::Read(p) => {
                let _ = p.reply.send(Err(failure.again()));
            }
            Pending::Charge(p) => p.fail(failure),
        }
    }
    fn lingers(&self) -> bool {
        // A charge's caller awaits nothing but its landing: it can wait for the next admission's
        // call (`group::serve`). Not a reservation, which the admission waits for.
        matches!(self, Pending::Charge(p) if !p.urgent)
    }
    fn abandoned(&self) -> bool {
        // A charge is never left out: the response it charges for was served. A reservation
        // whose caller has gone is: nothing would hold it.
        match self {
            Pending::Admit(p) => p.reply.is_closed(),
            Pending::Read(p) => p.reply.is_closed(),
            Pending::Charge(p) => p.abandoned(),
        }
    }
}

/// The most one call carries: its calls, and the keys of all of them past its first (the script
/// unpacks its keys onto Lua's stack for MGET, at most about 8 000 values).
const BOUNDS: Bounds = Bounds {
    calls: 512,
    keys: 4096,
};

impl RedisStore {
    /// Queues the call `make` builds around its reply channel for `slot`'s next step (`None`: a
    /// single server's), starting the slot's sender if none runs.
    pub(super) fn step<R>(
        &self,
        slot: Option<Slot>,
        make: impl FnOnce(tokio::sync::oneshot::Sender<Result<R, Failure>>) -> Pending,
    ) -> Result<Answer<R>, Failure> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        match self.queue_step(slot, make(reply)) {
            Ok(()) => Ok(answer),
            Err(_) => Err(Failure::Unavailable("circuit breaker open".into())),
        }
    }

    /// Queues `call`, which answers itself, for `slot`'s next step, as [`step`](Self::step)
    /// queues one it builds around a reply channel.
    /// While the breaker is open the call is handed back, unsent: the breaker answers at once,
    /// and the probe task closes it when Redis is back.
    pub(super) fn queue_step(&self, slot: Option<Slot>, call: Pending) -> Result<(), Pending> {
        if self.inner.open.load(Ordering::Acquire) {
            return Err(call);
        }
        let lane = self.inner.steps.lane(slot);
        group::enqueue(
            &(self.clone(), Arc::clone(&lane)),
            lane,
            BOUNDS,
            call,
            |(store, lane): (RedisStore, Arc<Mutex<StepQueue>>), batch| async move {
                store.send_step(&lane, batch).await
            },
        );
        Ok(())
    }

    /// Sends one step: `batch`'s admissions, reads and charges in one call, each answered from
    /// its reply.
    async fn send_step(&self, lane: &Mutex<StepQueue>, batch: Vec<Pending>) {
        // One call shares one time argument (`group::serve` batched them so).
        let time = batch.first().and_then(Queued::time);
        let (mut admits, mut reads, mut charges) = (Vec::new(), Vec::new(), Vec::new());
        // How many admissions came before each read and charge in the queue, for those put back
        // (below): nothing more is kept for a batch of admissions alone, the common one.
        let (mut read_after, mut charge_after) = (Vec::new(), Vec::new());
        for p in batch {
            match p {
                // A caller that gave up while it waited (a client that disconnected) is left
                // out: nothing is charged for a request never served, nobody reads a read. A
                // charge still goes: the response it charges for was served. A reservation
                // does not: its request was never admitted.
                Pending::Admit(p) if p.reply.is_closed() => {}
                Pending::Read(p) if p.reply.is_closed() => {}
                Pending::Charge(p) if p.abandoned() => {}
                Pending::Admit(p) => admits.push(p),
                Pending::Read(p) => {
                    read_after.push(admits.len());
                    reads.push(p);
                }
                Pending::Charge(p) => {
                    charge_after.push(admits.len());
                    charges.push(p);
                }
            }
        }
        if admits.is_empty() && reads.is_empty() && charges.is_empty() {
            // Every queued call was left out.
            return;
        }
        let mut windows = Windows::default();
        let mut counters = Counters::default();
        let (groups, taken) = batch::group(&mut windows, &mut counters, &admits);
        // An admission that does not fit waits for the next call, and so does every call queued
        // after it: a charge or a read never overtakes an admission that came before it.
        // (One with more than `taken` admissions before it came after the first put back.)
        let mut later: Vec<(usize, Pending)> = Vec::new();
        if taken < admits.len() {
            let r = read_after.partition_point(|&n| n <= taken);
            let c = charge_after.partition_point(|&n| n <= taken);
            let reads_after = read_after[r..].iter().copied().zip(reads.split_off(r));
            let charges_after = charge_after[c..].iter().copied().zip(charges.split_off(c));
            later.extend(reads_after.map(|(n, p)| (n, Pending::Read(p))));
            later.extend(charges_after.map(|(n, p)| (n, Pending::Charge(p))));
        }
        // The windows the admissions charge, before the charges add theirs.
        let charged: Vec<bool> = windows
            .list
            .iter()
            .map(|l| l.charge().at_admission())
            .collect();
        let read_at = reads::intern(&mut counters, &reads);
        let packed = charges::pack(&mut windows, &mut counters, &charges);
        let nw = windows.list.len();
        let nc = counters.list.len();
        // A call is replayed by the connection (once) only if it carries no charge and no
        // admission or read sent before: one put back after a charging call was lost has had
        // its one replay, and must not be sent a third time (docs/design.md §5).
        let op = if charges.is_empty()
            && !admits.iter().any(|a| a.replayed)
            && !reads.iter().any(|r| r.replayed)
        {
            &ADMIT
        } else {
            &ADMIT_CHARGING
        };
        let mut args =
            Doubles::with_capacity(1 + 3 * nw + nc + batch::group_args(&groups) + packed.args());
        args.push_len(nc);
        for l in &windows.list {
            batch::write_window(&mut args, l);
        }
        for c in &counters.list {
            args.push(period_code(c.period()));
        }
        batch::write_groups(&mut args, &groups, nw);
        packed.write(&mut args, nw);
        let mut cmd: Cmd = self.evalsha(op, nw + nc, 2 + nw);
        for l in &windows.list {
            self.key_arg(&mut cmd, &[l.key()]);
        }
        for c in &counters.list {
            self.key_arg(&mut cmd, &[c.key()]);
        }
        match time.or_else(|| self.time_of(None)) {
            Some(t) => cmd.arg(t),
            None => cmd.arg(""),
        };
        cmd.arg(args.bytes());
        for l in &windows.list {
            cmd.arg(ttl_millis(l.limit().window_micros()));
        }
        drop((windows, counters));
        // Admissions that did not fit go first in the next call: they came before anything
        // queued since.
        let admits = self.put_back_rest(lane, admits, taken, later);
        if !groups.is_empty() {
            bump(&self.inner.counters.admit_batches);
        }
        if !reads.is_empty() {
            bump(&self.inner.counters.read_batches);
        }
        if !charges.is_empty() {
            bump(&self.inner.counters.charge_batches);
        }
        let answer = self
            .inner
            .attempt::<::redis::Value>(op, &cmd)
            .await
            .and_then(|reply| {
                let values = doubles::read(&reply).map_err(|f| (f, false))?;
                step_reply(&values, nw, nc, &groups).map_err(|f| (f, false))
            });
        let StepReply {
            now,
            mut counts,
            totals,
            admitted,
        } = match answer {
            Ok(answer) => answer,
            Err((failure, lost)) => {
                for c in charges {
                    c.fail(&failure);
                }
                if lost {
                    // Never replayed for its charges' sake; its admissions and reads are, once.
                    return self.replay_once(lane, admits, reads, &failure);
                }
                for p in admits {
                    Pending::Admit(p).fail(&failure);
                }
                for r in reads {
                    Pending::Read(r).fail(&failure);
                }
                return;
            }
        };
        batch::answer(
            admits,
            &groups,
            &admitted,
            &mut counts,
            &charged,
            &totals,
            now,
        );
        reads::answer(reads, &read_at, &totals, now);
        charges::answer(charges, &packed, totals, now);
    }

    /// Puts admissions `admits[taken..]` back at the front of `lane`'s queue, with `later` (the
    /// reads and charges queued after the first of them, each with how many admissions came
    /// before it), all in the order they were queued; returns the rest.
    fn put_back_rest(
        &self,
        lane: &Mutex<StepQueue>,
        mut admits: Vec<PendingAdmit>,
        taken: usize,
        later: Vec<(usize, Pending)>,
    ) -> Vec<PendingAdmit> {
        if taken < admits.len() {
            let rest = admits.split_off(taken);
            // Admission `i` goes after what had `i` admissions before it, and before the rest.
            let mut back: Vec<((usize, bool), Pending)> =
                later.into_iter().map(|(n, p)| ((n, false), p)).collect();
            back.extend(
                (taken..)
                    .zip(rest)
                    .map(|(i, p)| ((i, true), Pending::Admit(p))),
            );
            back.sort_by_key(|&(at, _)| at);
            group::put_back(lane, back.into_iter().map(|(_, p)| p).collect());
        }
        admits
    }

    /// After a call that charged was lost with its connection: its admissions and reads go
    /// back to the front of the queue if this was their first call, and fail if it was their
    /// second.
    fn replay_once(
        &self,
        lane: &Mutex<StepQueue>,
        admits: Vec<PendingAdmit>,
        reads: Vec<PendingRead>,
        failure: &Failure,
    ) {
        let mut again = Vec::new();
        for mut p in admits {
            if std::mem::replace(&mut p.replayed, true) {
                Pending::Admit(p).fail(failure);
            } else {
                again.push(Pending::Admit(p));
            }
        }
        for mut r in reads {
            if std::mem::replace(&mut r.replayed, true) {
                Pending::Read(r).fail(failure);
            } else {
                again.push(Pending::Read(r));
            }
        }
        if !again.is_empty() {
            bump(&self.inner.counters.replays);
            group::put_back(lane, again);
        }
    }
}

/// The step script's reply (see admit.lua).
struct StepReply {
    /// The call's instant.
    now: u64,
    /// Each window's `[cur, prev]` before the call, in `KEYS` order.
    counts: Vec<[u64; 2]>,
    /// Each counter's total before the call, in `KEYS` order (after the windows).
    totals: Vec<u64>,
    /// How many of each group's requests were admitted (its first ones).
    admitted: Vec<usize>,
}

/// Reads the step script's reply (its numbers: [`doubles::read`]) for a call of `nw` windows, `nc` counters and
/// `groups`.
fn step_reply(reply: &[u64], nw: usize, nc: usize, groups: &[Group]) -> Result<StepReply, Failure> {
    if reply.len() != 1 + 2 * nw + nc + groups.len() {
        return Err(bad_reply());
    }
    let (&now, rest) = reply.split_first().ok_or_else(bad_reply)?;
    let (counts, rest) = rest.split_at(2 * nw);
    let (totals, admitted) = rest.split_at(nc);
    let counts = counts.chunks_exact(2).map(|c| [c[0], c[1]]).collect();
    let admitted = admitted
        .iter()
        .zip(groups)
        .map(|(&a, g)| match usize::try_from(a) {
            Ok(a) if a <= g.members.len() => Ok(a),
            _ => Err(bad_reply()),
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(StepReply {
        now,
        counts,
        totals: totals.to_vec(),
        admitted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::batch::GroupCost;
    use crate::window::MAX_COUNT;

    /// A charge of one unit to a day counter, `urgent` (a reservation) or not, and its answer.
    fn charge(
        urgent: bool,
    ) -> (
        Pending,
        tokio::sync::oneshot::Receiver<Result<charges::Charged, Failure>>,
    ) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let counter = crate::PeriodCounter::new("{org:a}:budget:x", crate::Period::Day);
        let call = Pending::Charge(PendingCharge {
            work: charges::Work::periods(vec![counter], 1),
            time: None,
            reply: charges::Reply::Waiting(tx),
            urgent,
        });
        (call, rx)
    }

    #[test]
    fn a_reservation_goes_at_once_and_not_once_its_caller_has_gone() {
        // A charge waits for the next admission's call; a reservation, which its admission
        // waits for, does not (`group::serve` lingers only while everything queued lingers).
        let (spend, spend_answer) = charge(false);
        let (reservation, reservation_answer) = charge(true);
        assert!(spend.lingers());
        assert!(!reservation.lingers());
        // Its caller gone, a reservation is left out (nothing would hold or give it back); a
        // charge never is: the response it charges for was served.
        drop((spend_answer, reservation_answer));
        assert!(!spend.abandoned());
        assert!(reservation.abandoned());
    }

    /// A reply as admit.lua packs it.
    fn packed(values: &[f64]) -> ::redis::Value {
        ::redis::Value::BulkString(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    #[test]
    fn a_malformed_step_reply_is_an_error() {
        let groups = [Group {
            cost: GroupCost::Each(1),
            chain: vec![1],
            gate: Vec::new(),
            members: vec![0, 1],
        }];
        let reply = |v: ::redis::Value| step_reply(&doubles::read(&v)?, 1, 1, &groups);
        let ok = reply(packed(&[7.0, 3.0, 0.0, 40.0, 2.0]))
            .ok()
            .expect("a well-formed reply");
        assert_eq!(
            (ok.now, ok.counts, ok.totals, ok.admitted),
            (7, vec![[3, 0]], vec![40], vec![2])
        );
        let most = MAX_COUNT as f64;
        let ok = reply(packed(&[1.8e15, most, 0.0, most, 0.0])).ok();
        assert_eq!(ok.map(|r| r.counts), Some(vec![[MAX_COUNT, 0]]));
        // One value short, more admitted than the group holds, a negative count, a fraction, a
        // count past 2^53, not a whole number of doubles, an array of integers.
        for bad in [
            packed(&[7.0, 3.0, 0.0, 40.0]),
            packed(&[7.0, 3.0, 0.0, 40.0, 3.0]),
            packed(&[7.0, -3.0, 0.0, 40.0, 1.0]),
            packed(&[7.0, 3.5, 0.0, 40.0, 1.0]),
            packed(&[7.0, most * 2.0, 0.0, 40.0, 1.0]),
            packed(&[f64::NAN, 3.0, 0.0, 40.0, 1.0]),
            ::redis::Value::BulkString(vec![0; 39]),
            ::redis::Value::Array(vec![::redis::Value::Int(7); 5]),
        ] {
            assert!(reply(bad).is_err());
        }
    }
}
