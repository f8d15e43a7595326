//! Charges in a batch (group commit, `step.rs`): tokens recorded to reactive limits and spend
//! added to period counters ride the next step's call, applied after its admissions in the
//! order they came. A charge whose caller gave up still goes: the response it charges for was
//! served. Never replayed: a call carrying charges whose connection dropped fails them, as each
//! of them alone would have.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use super::conn::Failure;
use super::doubles::Doubles;
use super::group::{Counters, Windows};
use crate::chain::ChainLimit;
use crate::period::{MAX_TOTAL, PeriodCounter};

/// What one charge adds: units to reactive limits (tokens), an amount to counters (spend), or
/// both (a response's tokens and spend, charged together).
#[derive(Default)]
pub(super) struct Work {
    /// `units` to each reactive limit.
    pub(super) record: Option<(Vec<ChainLimit>, u64)>,
    /// `amount` to each counter.
    pub(super) periods: Option<(Vec<PeriodCounter>, u64)>,
}

impl Work {
    /// `units` to each of `limits`.
    pub(super) fn record(limits: Vec<ChainLimit>, units: u64) -> Work {
        Work {
            record: Some((limits, units)),
            periods: None,
        }
    }

    /// `amount` to each of `counters`.
    pub(super) fn periods(counters: Vec<PeriodCounter>, amount: u64) -> Work {
        Work {
            record: None,
            periods: Some((counters, amount)),
        }
    }
}

/// Where a charge's answer goes: to a caller awaiting it, or to a function called with it
/// where the call lands (on the batch's sender: it must be quick).
pub(super) enum Reply {
    Waiting(tokio::sync::oneshot::Sender<Result<Charged, Failure>>),
    Then(Landing),
}

impl Reply {
    /// A reply to `landed`.
    pub(super) fn then(landed: impl FnOnce(Result<Charged, Failure>) + Send + 'static) -> Reply {
        Reply::Then(Landing(Some(Box::new(landed))))
    }

    /// Answers the charge.
    pub(super) fn send(self, answer: Result<Charged, Failure>) {
        match self {
            // A caller that went away wants no answer: the charge went anyway.
            Reply::Waiting(reply) => drop(reply.send(answer)),
            Reply::Then(mut landing) => landing.call(answer),
        }
    }
}

/// A function to call with a charge's answer, called exactly once: dropped unanswered (its
/// call abandoned by a sender that stopped mid-call: a runtime shutting down, a panic), it is
/// called with that failure, as an awaiting caller would have been told.
pub(super) struct Landing(Option<Landed>);

/// What a [`Landing`] calls.
type Landed = Box<dyn FnOnce(Result<Charged, Failure>) + Send>;

impl Landing {
    fn call(&mut self, answer: Result<Charged, Failure>) {
        if let Some(landed) = self.0.take() {
            landed(answer);
        }
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        self.call(Err(Failure::Unavailable("charge batch abandoned".into())));
    }
}

/// One queued charge: what it adds, its time argument and where its answer goes.
pub(super) struct PendingCharge {
    pub(super) work: Work,
    /// A pinned time (µs); `None`: the store's clock, read when the batch goes out.
    pub(super) time: Option<u64>,
    pub(super) reply: Reply,
    /// A reservation, which its caller awaits before it admits: it does not linger for the
    /// next admission's call, and is left out if its caller has gone before it goes (nothing
    /// would hold it, nor give it back).
    pub(super) urgent: bool,
}

impl PendingCharge {
    /// How many keys it names.
    pub(super) fn keys(&self) -> usize {
        let record = self.work.record.as_ref().map_or(0, |(l, _)| l.len());
        record + self.work.periods.as_ref().map_or(0, |(c, _)| c.len())
    }

    /// Answers it with `failure`.
    pub(super) fn fail(self, failure: &Failure) {
        self.reply.send(Err(failure.again()));
    }

    /// Whether it is urgent and its caller stopped waiting for it: it can be left out.
    pub(super) fn abandoned(&self) -> bool {
        self.urgent && matches!(&self.reply, Reply::Waiting(reply) if reply.is_closed())
    }
}

/// One charge's answer: the batch's instant and, for counters, their totals after it.
pub(super) type Charged = (u64, Vec<u64>);

/// A call's charges, packed: what the script is sent (charges of one kind to the same keys
/// merged into one, their units summed) and, for the counters of every period charge in order,
/// the index of each among the counters (to answer each charge as if sent alone).
pub(super) struct Packed {
    charges: Vec<(bool, u64, Vec<usize>)>,
    order: Vec<usize>,
}

/// Interns `batch`'s keys into the call's `windows` and `counters`.
///
/// Charges only add, and all of a call's are applied after its admissions, so two charges of
/// one kind to the same keys are one charge of their units' sum: the counts it leaves are the
/// same (a count's cap at 2^53 included: `min(min(c + a, cap) + b, cap) = min(c + a + b, cap)`),
/// and a busy key's charges (every response of one org's token limit and its budget) cost the
/// script four arguments a call instead of four each (docs/redis.md, "Batching").
pub(super) fn pack<'a>(
    windows: &mut Windows<'a>,
    counters: &mut Counters<'a>,
    batch: &'a [PendingCharge],
) -> Packed {
    let mut charges: Vec<(bool, u64, Vec<usize>)> = Vec::with_capacity(batch.len());
    let mut order = Vec::new();
    // Where each distinct (kind, keys) went in `charges`; few are distinct in a call, but a
    // call of many distinct chains must not cost a scan of all per charge.
    let mut merged: HashMap<(bool, Vec<usize>), usize, foldhash::fast::RandomState> =
        HashMap::default();
    let parts = batch.iter().flat_map(|p| {
        let record = p.work.record.as_ref().map(|(l, u)| (Some(l), None, *u));
        let periods = p.work.periods.as_ref().map(|(c, a)| (None, Some(c), *a));
        record.into_iter().chain(periods)
    });
    for (limits, list, units) in parts {
        let (window, keys) = match (limits, list) {
            (Some(limits), _) => (true, limits.iter().map(|l| windows.intern(l)).collect()),
            (None, Some(list)) => {
                let keys: Vec<usize> = list.iter().map(|c| counters.intern(c)).collect();
                order.extend(&keys);
                (false, keys)
            }
            (None, None) => continue,
        };
        match merged.entry((window, keys)) {
            Entry::Occupied(at) => {
                let sum = &mut charges[*at.get()].1;
                *sum = sum.saturating_add(units);
            }
            Entry::Vacant(at) => {
                charges.push((window, units, at.key().1.clone()));
                at.insert(charges.len() - 1);
            }
        }
    }
    Packed { charges, order }
}

impl Packed {
    /// How many arguments [`write`](Self::write) appends.
    pub(super) fn args(&self) -> usize {
        self.charges.iter().map(|(_, _, k)| 3 + k.len()).sum()
    }

    /// Appends the charges as admit.lua takes them: each one's kind, units, how many keys, and
    /// their 1-based indices into `KEYS` (the counters after the call's `nw` windows).
    pub(super) fn write(&self, args: &mut Doubles, nw: usize) {
        for (window, units, keys) in &self.charges {
            args.push(if *window { 1 } else { 2 })
                .push(*units)
                .push_len(keys.len());
            let offset = if *window { 1 } else { 1 + nw };
            for k in keys {
                args.push_len(k + offset);
            }
        }
    }
}

/// Answers each charge of `batch` (packed as `packed`): a period charge gets its counters'
/// totals after it, the adds replayed in order on `totals` (each counter's before the call), as
/// the script applied them.
pub(super) fn answer(batch: Vec<PendingCharge>, packed: &Packed, mut totals: Vec<u64>, now: u64) {
    let mut counters = packed.order.iter();
    for p in batch {
        let seen = match &p.work.periods {
            None => Vec::new(),
            Some((list, amount)) => {
                let mut seen = Vec::with_capacity(list.len());
                for &k in counters.by_ref().take(list.len()) {
                    let total = &mut totals[k];
                    *total = total.saturating_add(*amount).min(MAX_TOTAL);
                    seen.push(*total);
                }
                seen
            }
        };
        p.reply.send(Ok((now, seen)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::period::Period;
    use crate::{Charge, ScopeKind, WindowLimit};

    fn charge(work: Work) -> PendingCharge {
        PendingCharge {
            work,
            time: None,
            reply: Reply::Waiting(tokio::sync::oneshot::channel().0),
            urgent: false,
        }
    }

    #[test]
    fn a_landing_is_called_once_and_dropped_unanswered_it_says_abandoned() {
        use std::sync::{Arc, Mutex};
        let calls = Arc::new(Mutex::new(Vec::new()));
        let record = |calls: &Arc<Mutex<Vec<bool>>>| {
            let calls = Arc::clone(calls);
            Reply::then(move |answer| calls.lock().unwrap().push(answer.is_ok()))
        };
        record(&calls).send(Ok((1, Vec::new())));
        drop(record(&calls));
        assert_eq!(*calls.lock().unwrap(), [true, false]);
    }

    #[test]
    fn like_charges_go_as_one_and_each_is_answered_as_if_alone() {
        let tokens = ChainLimit::new(
            "org:m",
            ScopeKind::Org,
            "m",
            Charge::Reactive,
            WindowLimit::per_minute(1_000),
        );
        let key = ChainLimit::new(
            "org:m",
            ScopeKind::Key,
            "k",
            Charge::Reactive,
            WindowLimit::per_minute(1_000),
        );
        let day = PeriodCounter::new("{org:m}:budget:day", Period::Day);
        let batch = vec![
            charge(Work::record(vec![tokens.clone()], 3)),
            charge(Work::periods(vec![day.clone()], 7)),
            charge(Work::record(vec![tokens.clone()], 4)),
            charge(Work::record(vec![key, tokens.clone()], 5)),
            charge(Work::periods(vec![day.clone()], 8)),
        ];
        let (mut windows, mut counters) = (Windows::default(), Counters::default());
        let packed = pack(&mut windows, &mut counters, &batch);
        // Three distinct charges: tokens (3 + 4), the day's spend (7 + 8), the key and tokens.
        assert_eq!(
            packed.charges,
            [
                (true, 7, vec![0]),
                (false, 15, vec![0]),
                (true, 5, vec![1, 0])
            ]
        );
        assert_eq!(packed.args(), 4 + 4 + 5);
        // Each period charge still sees the totals after itself, in order.
        let (replies, answers): (Vec<_>, Vec<_>) = (0..batch.len())
            .map(|_| tokio::sync::oneshot::channel())
            .unzip();
        let batch = batch
            .into_iter()
            .zip(replies)
            .map(|(p, reply)| PendingCharge {
                reply: Reply::Waiting(reply),
                ..p
            })
            .collect();
        answer(batch, &packed, vec![100], 9);
        let seen: Vec<Charged> = answers
            .into_iter()
            .map(|mut a| a.try_recv().expect("answered").ok().expect("charged"))
            .collect();
        assert_eq!(
            seen,
            [
                (9, vec![]),
                (9, vec![107]),
                (9, vec![]),
                (9, vec![]),
                (9, vec![115])
            ]
        );
    }
}
