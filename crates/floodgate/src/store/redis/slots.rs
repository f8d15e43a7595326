//! Concurrency slots on Redis: admissions that take slots (`admit_holding.lua`), their release
//! (`release.lua`) and the renewal of the leases this process holds (`renew.lua`).
//!
//! A slot is a member of a sorted set, scored by its expiry. The member is the store's random
//! process tag and the lease number, so that two replicas never share one. Every lease this
//! store admitted and has not released is listed in [`Held`]; a task renews them all every
//! third of [`RedisConfig::lease`](super::RedisConfig::lease), one script call per
//! [`RENEW_CHUNK`] slots, so that a request that runs longer than the lease keeps its slot while
//! its process lives.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::cluster_routing::Slot;

use super::conn::{Failure, bad_reply};
use super::scripts::{ADMIT_HOLDING, RENEW, RUNNING};
use super::stats::bump;
use super::{Inner, RedisStore, kind_arg, ttl_millis};
use crate::chain::{ChainLimit, Costs};
use crate::clock::Timestamp;
use crate::in_flight::{InFlightLimit, Lease};
use crate::store::Observation;
use crate::window::Snapshot;

/// The most slots one renewal call carries.
const RENEW_CHUNK: usize = 1024;

/// The leases this store holds, with the Redis keys of their slot sets.
#[derive(Debug, Default)]
pub(super) struct Held {
    leases: HashMap<u64, Box<[String]>>,
}

/// A random tag for this store's lease members: the OS-seeded keys of std's `RandomState`,
/// mixed with the process id and the time.
pub(super) fn process_tag() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u64(Timestamp::now().as_micros());
    h.finish()
}

impl RedisStore {
    /// A lease's member in a slot set.
    pub(super) fn member(&self, lease: Lease) -> String {
        format!("{:016x}-{}", self.inner.tag, lease.id())
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        lock_held(&self.inner)
    }

    /// One admission holding slots: one script call (not batched: a chain with concurrency
    /// limits is decided alone).
    pub(super) async fn admit_holding_inner(
        &self,
        limits: &[ChainLimit],
        slots: &[InFlightLimit],
        costs: Costs<'_>,
        lease: Lease,
        now: Option<Timestamp>,
    ) -> Result<Observation, Failure> {
        let (n, m) = (limits.len(), slots.len());
        let mut cmd = self.evalsha(&ADMIT_HOLDING, n + m, 4 + 5 * n + 2 * m);
        for l in limits {
            self.key_arg(&mut cmd, &[l.key()]);
        }
        let keys: Box<[String]> = slots.iter().map(|s| self.redis_key(s.key())).collect();
        for k in &keys {
            cmd.arg(k.as_str());
        }
        self.time_arg(&mut cmd, now);
        let lease_us = self.inner.config.lease.as_micros().max(1) as u64;
        cmd.arg(n).arg(self.member(lease)).arg(lease_us);
        for (i, l) in limits.iter().enumerate() {
            let w = l.limit().window_micros();
            cmd.arg(w)
                .arg(l.limit().max())
                .arg(kind_arg(l))
                .arg(ttl_millis(w));
            cmd.arg(costs.of(i));
        }
        for s in slots {
            cmd.arg(s.max()).arg(if s.is_shadow() { "cs" } else { "c" });
        }
        let reply: Vec<u64> = self.inner.run(&ADMIT_HOLDING, &cmd).await?;
        if reply.len() != 2 + 2 * n + m {
            return Err(bad_reply());
        }
        let t = reply[0];
        let snapshots = limits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let w = l.limit().window_micros();
                Snapshot {
                    bucket: t / w,
                    elapsed: t % w,
                    cur: reply[1 + 2 * i],
                    prev: reply[2 + 2 * i],
                }
            })
            .collect();
        let running = reply[1 + 2 * n..1 + 2 * n + m].to_vec();
        let admitted = reply[1 + 2 * n + m] == 1;
        if admitted {
            // On a cluster one lease may hold slots in several slots' steps (`cluster.rs`).
            let mut held = self.held();
            match held.leases.get_mut(&lease.id()) {
                Some(had) => *had = had.iter().chain(keys.iter()).cloned().collect(),
                None => {
                    held.leases.insert(lease.id(), keys);
                }
            }
        }
        self.count(admitted);
        Ok(Observation {
            now: Timestamp::from_micros(t),
            admitted,
            enforced: true,
            snapshots,
            running,
            at: Vec::new(),
        })
    }

    /// Stops renewing `lease`'s slots (a cross-slot admission refused after taking some).
    pub(super) fn forget_lease(&self, lease: Lease) {
        self.held().leases.remove(&lease.id());
    }

    /// Gives back `lease`'s slots and stops renewing them.
    pub(super) async fn release_inner(
        &self,
        slots: &[InFlightLimit],
        lease: Lease,
        // A release reads no clock.
        _now: Option<Timestamp>,
    ) -> Result<(), Failure> {
        self.held().leases.remove(&lease.id());
        if slots.is_empty() {
            return Ok(());
        }
        self.release_batched(slots, self.member(lease)).await
    }

    /// Each slot set's live members at `now`, [`RENEW_CHUNK`] sets per script, changing
    /// nothing.
    pub(super) async fn read_running_inner(
        &self,
        slots: &[InFlightLimit],
        now: Option<Timestamp>,
    ) -> Result<Vec<u64>, Failure> {
        if self.is_cluster() {
            // One slot at a time, the counts put back in order.
            let mut out = vec![0; slots.len()];
            for (_, part) in self.by_slot(slots, |s| s.key()) {
                let sets: Vec<InFlightLimit> = part.iter().map(|&i| slots[i].clone()).collect();
                let counts = self.read_running_in_slot(&sets, now).await?;
                for (&i, n) in part.iter().zip(counts) {
                    out[i] = n;
                }
            }
            return Ok(out);
        }
        self.read_running_in_slot(slots, now).await
    }

    /// [`read_running_inner`](Self::read_running_inner) of sets that lie in one slot.
    async fn read_running_in_slot(
        &self,
        slots: &[InFlightLimit],
        now: Option<Timestamp>,
    ) -> Result<Vec<u64>, Failure> {
        let mut out = Vec::with_capacity(slots.len());
        for chunk in slots.chunks(RENEW_CHUNK) {
            let mut cmd = self.evalsha(&RUNNING, chunk.len(), 1);
            for s in chunk {
                self.key_arg(&mut cmd, &[s.key()]);
            }
            self.time_arg(&mut cmd, now);
            let counts: Vec<u64> = self.inner.run(&RUNNING, &cmd).await?;
            if counts.len() != chunk.len() {
                return Err(bad_reply());
            }
            out.extend(counts);
        }
        Ok(out)
    }

    /// Renews every lease held, [`RENEW_CHUNK`] slots per call. A failed call is left to the
    /// next round (the lease time allows two to fail in a row).
    async fn renew_all(&self) {
        let pairs: Vec<(String, String)> = {
            let held = self.held();
            held.leases
                .iter()
                .flat_map(|(&id, keys)| {
                    let member = self.member(Lease::from_id(id));
                    keys.iter().map(move |k| (k.clone(), member.clone()))
                })
                .collect()
        };
        let lease_us = self.inner.config.lease.as_micros().max(1) as u64;
        // A renewal's keys lie in one slot: on a cluster the pairs go by slot, chunked per slot.
        let mut runs: Vec<Vec<(String, String)>> = Vec::new();
        if self.is_cluster() {
            let mut by_slot: HashMap<Slot, Vec<(String, String)>> = HashMap::new();
            for pair in pairs {
                by_slot
                    .entry(Slot::for_key(&pair.0))
                    .or_default()
                    .push(pair);
            }
            runs.extend(by_slot.into_values());
        } else {
            runs.push(pairs);
        }
        let chunks = runs.iter().flat_map(|run| run.chunks(RENEW_CHUNK));
        for chunk in chunks {
            let mut cmd = self.evalsha(&RENEW, chunk.len(), 2 + chunk.len());
            for (key, _) in chunk {
                cmd.arg(key.as_str());
            }
            self.time_arg(&mut cmd, None);
            cmd.arg(lease_us);
            for (_, member) in chunk {
                cmd.arg(member.as_str());
            }
            if let Err(Failure::Unavailable(why) | Failure::Backend(why)) =
                self.inner.run::<u64>(&RENEW, &cmd).await
            {
                bump(&self.inner.counters.errors);
                tracing::debug!(error = why, "floodgate: lease renewal failed");
            }
        }
    }

    /// How many leases this store holds now.
    pub fn leases_held(&self) -> usize {
        self.held().leases.len()
    }
}

fn lock_held(inner: &Inner) -> std::sync::MutexGuard<'_, Held> {
    // Inserts and removes cannot leave the map half-changed.
    inner
        .held
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Renews the store's leases every third of the lease time until the store is dropped.
pub(super) async fn renew_leases(inner: Weak<Inner>, lease: Duration) {
    let every = (lease / 3).max(Duration::from_millis(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: nothing is held yet.
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        if inner.open.load(Ordering::Acquire) || lock_held(&inner).leases.is_empty() {
            continue;
        }
        RedisStore {
            inner: Arc::clone(&inner),
        }
        .renew_all()
        .await;
    }
}
