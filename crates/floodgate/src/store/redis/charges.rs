//! Charges in a batch (group commit, `step.rs`): tokens recorded to reactive limits and spend
//! added to period counters ride the next step's call, applied after its admissions in the
//! order they came. A charge whose caller gave up still goes: the response it charges for was
//! served. Never replayed: a call carrying charges whose connection dropped fails them, as each
//! of them alone would have.

use ::redis::Cmd;

use super::conn::Failure;
use super::group::{Counters, Windows};
use crate::chain::ChainLimit;
use crate::period::{MAX_TOTAL, PeriodCounter};

/// What one charge adds.
pub(super) enum Work {
    /// `units` to each reactive limit.
    Record(Vec<ChainLimit>, u64),
    /// `amount` to each counter.
    Periods(Vec<PeriodCounter>, u64),
}

/// One queued charge: what it adds, its time argument and where its answer goes.
pub(super) struct PendingCharge {
    pub(super) work: Work,
    /// A pinned time (µs); `None`: the store's clock, read when the batch goes out.
    pub(super) time: Option<u64>,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<Charged, Failure>>,
}

impl PendingCharge {
    /// How many keys it names.
    pub(super) fn keys(&self) -> usize {
        match &self.work {
            Work::Record(limits, _) => limits.len(),
            Work::Periods(counters, _) => counters.len(),
        }
    }

    /// Answers it with `failure`.
    pub(super) fn fail(self, failure: &Failure) {
        let _ = self.reply.send(Err(failure.again()));
    }
}

/// One charge's answer: the batch's instant and, for counters, their totals after it.
pub(super) type Charged = (u64, Vec<u64>);

/// A call's charges, packed: each one's kind, units and key indices (windows 0-based among the
/// windows, counters 0-based among the counters), and, for the counters of every period charge
/// in order, the index of each among the counters.
pub(super) struct Packed {
    charges: Vec<(bool, u64, Vec<usize>)>,
    order: Vec<usize>,
}

/// Interns `batch`'s keys into the call's `windows` and `counters`.
pub(super) fn pack<'a>(
    windows: &mut Windows<'a>,
    counters: &mut Counters<'a>,
    batch: &'a [PendingCharge],
) -> Packed {
    let mut charges = Vec::with_capacity(batch.len());
    let mut order = Vec::new();
    for p in batch {
        match &p.work {
            Work::Record(limits, units) => {
                let keys = limits.iter().map(|l| windows.intern(l)).collect();
                charges.push((true, *units, keys));
            }
            Work::Periods(list, amount) => {
                let keys: Vec<usize> = list.iter().map(|c| counters.intern(c)).collect();
                order.extend(&keys);
                charges.push((false, *amount, keys));
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
    pub(super) fn write(&self, cmd: &mut Cmd, nw: usize) {
        for (window, units, keys) in &self.charges {
            cmd.arg(if *window { "r" } else { "p" })
                .arg(*units)
                .arg(keys.len());
            let offset = if *window { 1 } else { 1 + nw };
            for k in keys {
                cmd.arg(k + offset);
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
        let seen = match &p.work {
            Work::Record(..) => Vec::new(),
            Work::Periods(list, amount) => {
                let mut seen = Vec::with_capacity(list.len());
                for &k in counters.by_ref().take(list.len()) {
                    let total = &mut totals[k];
                    *total = total.saturating_add(*amount).min(MAX_TOTAL);
                    seen.push(*total);
                }
                seen
            }
        };
        let _ = p.reply.send(Ok((now, seen)));
    }
}
