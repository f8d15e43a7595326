//! An operator's reads and resets of windows and period counters ([`Store::read_state`],
//! [`Store::clear_state`]): a script per [`CHUNK`] keys, never a call per limit.
//!
//! [`Store::read_state`]: crate::store::Store::read_state
//! [`Store::clear_state`]: crate::store::Store::clear_state

use super::RedisStore;
use super::conn::{bad_reply, int};
use super::scripts::Op;
use crate::Error;
use crate::chain::ChainLimit;
use crate::clock::Timestamp;
use crate::period::{Period, PeriodCounter};
use crate::store::StateObservation;
use crate::window::Snapshot;

/// The most keys one script is given: large enough that a page of the gateway's usage is one
/// call, small enough that a script holds Redis for a moment only (and `unpack` stays far
/// below Lua's limit on results).
const CHUNK: usize = 1000;

impl RedisStore {
    /// Runs `op` (`state_read` or `state_clear`) over `limits` then `counters`, [`CHUNK`] keys
    /// per script. The first script's instant is every later one's: one `now` for the whole
    /// answer, as the trait says.
    pub(super) async fn state_call(
        &self,
        op: &'static Op,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<StateObservation, Error> {
        if !self.is_cluster() {
            return self.state_call_in_slot(op, limits, counters, now).await;
        }
        // On a cluster, one slot at a time, the answers put back in order, every slot read at
        // the first one's instant.
        let mut seen = StateObservation {
            now: now.unwrap_or_else(Timestamp::now),
            snapshots: limits
                .iter()
                .map(|l| Snapshot::at(None, now.unwrap_or_else(Timestamp::now), l.limit()))
                .collect(),
            totals: vec![0; counters.len()],
        };
        let windows = self.by_slot(limits, |l| l.key());
        let periods = self.by_slot(counters, |c| c.key());
        let mut pinned = now;
        for (slot, w) in &windows {
            let p: &[usize] = periods
                .iter()
                .find(|(s, _)| s == slot)
                .map_or(&[], |(_, p)| p.as_slice());
            let ls: Vec<ChainLimit> = w.iter().map(|&i| limits[i].clone()).collect();
            let cs: Vec<PeriodCounter> = p.iter().map(|&i| counters[i].clone()).collect();
            let part = self.state_call_in_slot(op, &ls, &cs, pinned).await?;
            pinned.get_or_insert(part.now);
            seen.now = pinned.unwrap_or(part.now);
            for (&i, snapshot) in w.iter().zip(part.snapshots) {
                seen.snapshots[i] = snapshot;
            }
            for (&i, total) in p.iter().zip(part.totals) {
                seen.totals[i] = total;
            }
        }
        for (slot, p) in &periods {
            if windows.iter().any(|(s, _)| s == slot) {
                continue;
            }
            let cs: Vec<PeriodCounter> = p.iter().map(|&i| counters[i].clone()).collect();
            let part = self.state_call_in_slot(op, &[], &cs, pinned).await?;
            pinned.get_or_insert(part.now);
            seen.now = pinned.unwrap_or(part.now);
            for (&i, total) in p.iter().zip(part.totals) {
                seen.totals[i] = total;
            }
        }
        Ok(seen)
    }

    /// [`state_call`](Self::state_call) for keys that all lie in one slot (or on one server).
    async fn state_call_in_slot(
        &self,
        op: &'static Op,
        limits: &[ChainLimit],
        counters: &[PeriodCounter],
        now: Option<Timestamp>,
    ) -> Result<StateObservation, Error> {
        let total = limits.len() + counters.len();
        let mut seen = StateObservation {
            now: now.unwrap_or_else(Timestamp::now),
            snapshots: Vec::with_capacity(limits.len()),
            totals: Vec::with_capacity(counters.len()),
        };
        let mut pinned = now;
        let mut start = 0;
        while start < total {
            let end = (start + CHUNK).min(total);
            let windows = &limits[start.min(limits.len())..end.min(limits.len())];
            let periods =
                &counters[start.saturating_sub(limits.len())..end.saturating_sub(limits.len())];
            let mut cmd = self.evalsha(op, end - start, 2 + end - start);
            for l in windows {
                self.key_arg(&mut cmd, &[l.key()]);
            }
            for c in periods {
                self.key_arg(&mut cmd, &[c.key()]);
            }
            self.time_arg(&mut cmd, pinned);
            cmd.arg(windows.len());
            for l in windows {
                cmd.arg(l.limit().window_micros());
            }
            for c in periods {
                cmd.arg(match c.period() {
                    Period::Day => "day",
                    Period::Month => "month",
                });
            }
            let reply = self
                .inner
                .run::<Vec<::redis::Value>>(op, &cmd)
                .await
                .map_err(|f| {
                    super::stats::bump(&self.inner.counters.errors);
                    Error::from(f)
                })?;
            let (at, rest) = reply.split_first().ok_or_else(bad_reply)?;
            if rest.len() != 2 * windows.len() + periods.len() {
                return Err(bad_reply().into());
            }
            let at = Timestamp::from_micros(int(at)?);
            seen.now = at;
            pinned = Some(at);
            let (counts, totals) = rest.split_at(2 * windows.len());
            for (l, pair) in windows.iter().zip(counts.chunks_exact(2)) {
                let w = l.limit().window_micros();
                let bucket = at.as_micros() / w;
                seen.snapshots.push(Snapshot {
                    bucket,
                    cur: int(&pair[0])?,
                    prev: int(&pair[1])?,
                    elapsed: at.as_micros() - bucket * w,
                });
            }
            for t in totals {
                seen.totals.push(int(t)?);
            }
            start = end;
        }
        Ok(seen)
    }
}
