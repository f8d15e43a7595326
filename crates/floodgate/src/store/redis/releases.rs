//! Release batching: slots given back when requests end go out in batches (group commit,
//! `group.rs`): one `release.lua` call removes the members of every queued release. A release is
//! idempotent (removing a member twice removes it once), so a batch whose connection dropped is
//! replayed once.

use std::collections::HashMap;

use ::redis::cluster_routing::Slot;

use super::RedisStore;
use super::conn::Failure;
use super::group::{self, Answer, Bounds, Queue, Queued, intern};
use super::scripts::RELEASE;
use crate::in_flight::InFlightLimit;

/// Releases queued for the next batch.
pub(super) type ReleaseQueue = Queue<PendingRelease>;

/// One queued release: its slot sets, its lease's member and where its answer goes.
pub(super) struct PendingRelease {
    slots: Vec<InFlightLimit>,
    member: String,
    reply: tokio::sync::oneshot::Sender<Result<(), Failure>>,
}

impl Queued for PendingRelease {
    fn time(&self) -> Option<u64> {
        // A release reads no clock: every release shares a batch.
        None
    }
    fn keys(&self) -> usize {
        self.slots.len()
    }
    fn fail(self, failure: &Failure) {
        let _ = self.reply.send(Err(failure.again()));
    }
}

/// The answer of a queued release.
async fn released(answer: Answer<()>) -> Result<(), Failure> {
    group::answer(answer, "release").await
}

/// The most one batch carries: releases, and slot sets over all of them past its first.
const BOUNDS: Bounds = Bounds {
    calls: 256,
    keys: 4096,
};

impl RedisStore {
    /// Removes `member` from each set of `slots` (not empty), through a release batch (on a
    /// cluster, one per slot the sets lie in).
    pub(super) async fn release_batched(
        &self,
        slots: &[InFlightLimit],
        member: String,
    ) -> Result<(), Failure> {
        if !self.is_cluster() {
            return released(self.queue_release(None, slots.to_vec(), member)?).await;
        }
        let mut waits = Vec::new();
        for (slot, part) in self.by_slot(slots, |s| s.key()) {
            let sets = part.iter().map(|&i| slots[i].clone()).collect();
            waits.push(self.queue_release(slot, sets, member.clone())?);
        }
        for wait in waits {
            released(wait).await?;
        }
        Ok(())
    }

    /// Queues a release of `member` from `slots` (all in cluster slot `slot`).
    fn queue_release(
        &self,
        slot: Option<Slot>,
        slots: Vec<InFlightLimit>,
        member: String,
    ) -> Result<Answer<()>, Failure> {
        if self.inner.open.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Failure::Unavailable("circuit breaker open".into()));
        }
        Ok(group::submit(
            self,
            self.inner.releases.lane(slot),
            BOUNDS,
            |reply| PendingRelease {
                slots,
                member,
                reply,
            },
            |store: RedisStore, batch| async move { store.send_release_batch(batch).await },
        ))
    }

    async fn send_release_batch(&self, batch: Vec<PendingRelease>) {
        let mut index: HashMap<&str, usize, foldhash::fast::RandomState> = HashMap::default();
        let mut distinct: Vec<&InFlightLimit> = Vec::new();
        let groups: Vec<Vec<usize>> = batch
            .iter()
            .map(|r| {
                r.slots
                    .iter()
                    // 1-based, as Lua's KEYS.
                    .map(|s| 1 + intern(&mut index, &mut distinct, s.key(), s))
                    .collect()
            })
            .collect();
        let argc = 1 + groups.iter().map(|g| 2 + g.len()).sum::<usize>();
        let mut cmd = self.evalsha(&RELEASE, distinct.len(), argc);
        for s in &distinct {
            self.key_arg(&mut cmd, &[s.key()]);
        }
        // The script reads no clock; ARGV[1] is the time every script takes (clock.lua).
        self.time_arg(&mut cmd, None);
        for (r, keys) in batch.iter().zip(&groups) {
            cmd.arg(&r.member).arg(keys.len());
            for j in keys {
                cmd.arg(*j);
            }
        }
        let answer = self.inner.run::<u64>(&RELEASE, &cmd).await;
        for r in batch {
            match &answer {
                Ok(_) => {
                    let _ = r.reply.send(Ok(()));
                }
                Err(failure) => r.fail(failure),
            }
        }
    }
}
