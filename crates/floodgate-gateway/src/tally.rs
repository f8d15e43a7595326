//! The refusal tally (docs/design.md §6): how many requests the gateway refused with 429, per
//! local calendar day and per throttled subject (the gateway, or the caller's key), shown as
//! `rate_limit` alerts.
//!
//! - Every 429 the gateway answers bumps a counter of the worker that answered it: one relaxed
//!   atomic add on that worker's own slots, no lock and no allocation on the hot path.
//! - One flusher, on a timer (`[alerts] flush_sec`, default 60 s) and once more after the workers
//!   have drained at shutdown, moves the counters into the aggregate, under the local day of the
//!   flush (it also flushes just before each local midnight, so a day's refusals stay on that
//!   day). On the Redis store the aggregate is one hash per day in Redis, added to by every
//!   replica; on the memory store with `[alerts] path` it is that JSON file, which each flush
//!   adds its counts to under a lock (read, add, a new file renamed over the old one), so that
//!   every process naming it (a restarted gateway beside the one still draining) adds to one
//!   tally: a restart loses nothing that was flushed, and a graceful stop loses nothing at all.
//!   Counts a flush could not save stay for the next one.
//! - `GET /alerts` (only with an `[alerts]` secret) answers the aggregate plus what is counted
//!   but not yet flushed, newest day first.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{Local, NaiveDate};
use serde::{Deserialize, Serialize};

use crate::config::{Backend, Config};

/// The subject of the gateway scope in the aggregate.
const GATEWAY_SUBJECT: &str = "gateway";

/// The version of the tally file's format.
const FILE_VERSION: u32 = 1;

/// Who a refusal throttled: the whole gateway (a gateway-wide limit refused: the gateway scope's
/// rate limit or budget, or the realtime session cap), or one caller's key (any other scope of
/// its chain refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subject {
    /// The gateway scope refused.
    Gateway,
    /// A scope of this key's chain refused: the key's index in the config's `[[keys]]`.
    Key(usize),
}

/// One worker's refusal counters, one slot per subject: the gateway, then each key in config
/// order.
#[derive(Debug)]
pub struct Counters {
    slots: Box<[AtomicU64]>,
}

impl Counters {
    fn new(subjects: usize) -> Counters {
        Counters {
            slots: (0..subjects).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Counts one refusal of `subject`.
    pub fn refused(&self, subject: Subject) {
        let slot = match subject {
            Subject::Gateway => 0,
            Subject::Key(i) => i + 1,
        };
        if let Some(s) = self.slots.get(slot) {
            s.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Day (`YYYY-MM-DD`) -> subject (`gateway`, `key:<id>`) -> refusals.
type Days = BTreeMap<String, BTreeMap<String, u64>>;

/// The tally file.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TallyFile {
    version: u32,
    days: Days,
}

/// One `rate_limit` alert: a subject's refusals on one local day.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Alert {
    /// Always `rate_limit`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The local calendar day, `YYYY-MM-DD`.
    pub day: String,
    /// `gateway` or `key`.
    pub subject: &'static str,
    /// The key's id (for a key subject).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Requests refused with 429 that day.
    pub count: u64,
    /// The alert as a sentence.
    pub message: String,
}

/// The process's refusal tally: every worker's counters and the persisted aggregate.
#[derive(Debug)]
pub struct Tally {
    /// Subject names by slot: `gateway`, then `key:<id>` per key, in config order, then each key
    /// a reload added. Append-only: a slot means the same subject for the process's life, so
    /// counters made before a reload still count to the right one.
    subjects: Mutex<Vec<String>>,
    workers: Mutex<Vec<Arc<Counters>>>,
    /// In memory: the whole aggregate. In a file or Redis: the counts not written there yet.
    aggregate: Mutex<Days>,
    keep: Keep,
    /// One flush at a time (the timer's and the shutdown's may meet): a Redis write in flight
    /// must not be written twice.
    flushing: tokio::sync::Mutex<()>,
    flush_every: Duration,
    retention_days: u32,
}

/// Where the aggregate is kept.
#[derive(Debug)]
enum Keep {
    /// In memory only: a restart loses it.
    Memory,
    /// In a JSON file that each flush adds to, under an exclusive lock on `<path>.lock`.
    File(PathBuf),
    /// In Redis, one hash per day shared by every replica on that Redis.
    Redis(Box<RedisTally>),
}

/// The tally's own Redis client (not the store's connection: its admission batches stay as
/// they are).
#[derive(Debug)]
struct RedisTally {
    client: TallyClient,
    /// The key of a day's hash, without the day: `{prefix}{floodgate}:tally:`.
    key: String,
}

/// The tally's client: one server's, or a cluster's (the tally's keys share one hash tag, so
/// one slot: a flush is one transaction there too).
#[derive(Debug)]
// Built once per process and kept boxed (`Keep::Redis`): the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum TallyClient {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
}

/// How long a tally call to Redis may take, connecting included.
const REDIS_TIMEOUT: Duration = Duration::from_secs(2);

impl RedisTally {
    /// Runs `pipe` on a connection of its own. A connection's driver runs on the runtime that
    /// opened it: one kept between calls would be dead once that runtime stops (a worker's, after
    /// `/alerts` opened it there), and the final flush at shutdown, on another runtime, would
    /// time out and lose what it carried. A flush a minute and an admin's reads are few: each
    /// opens its own.
    async fn call<T: redis::FromRedisValue>(&self, pipe: &redis::Pipeline) -> Result<T, String> {
        // No response timeout of the client's own (its default is 0.5 s): a write that Redis
        // applied but answered late would be taken for a failure and sent again at the next
        // flush, counted twice. REDIS_TIMEOUT bounds the whole call instead.
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(REDIS_TIMEOUT))
            .set_response_timeout(None);
        let attempt = async {
            match &self.client {
                TallyClient::Single(client) => {
                    let mut conn = client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await
                        .map_err(|e| e.to_string())?;
                    pipe.query_async(&mut conn).await.map_err(|e| e.to_string())
                }
                TallyClient::Cluster(client) => {
                    let mut conn = client
                        .get_async_connection()
                        .await
                        .map_err(|e| e.to_string())?;
                    pipe.query_async(&mut conn).await.map_err(|e| e.to_string())
                }
            }
        };
        tokio::time::timeout(REDIS_TIMEOUT, attempt)
            .await
            .unwrap_or_else(|_| Err(format!("timed out after {REDIS_TIMEOUT:?}")))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every change under these locks leaves them whole.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Tally {
    /// The tally for `config`'s keys, kept where the config says: in Redis on the Redis store
    /// (one aggregate for every replica), else in `[alerts] path` if set, else in memory. A
    /// file that cannot be read or is not a tally, or a lock file that cannot be created beside
    /// it, is an error that names it: the gateway does not start rather than lose its counts.
    pub fn open(config: &Config) -> Result<Tally, String> {
        let keep = match (
            &config.store.backend,
            &config.store.url,
            &config.alerts.path,
        ) {
            (Backend::Redis, Some(url), _) => {
                let client = redis::Client::open(url.as_str())
                    .map_err(|e| format!("the refusal tally's Redis client: {e}"))?;
                let prefix = config.store.prefix.as_deref().unwrap_or("fg:");
                Keep::Redis(Box::new(RedisTally {
                    client: TallyClient::Single(client),
                    key: format!("{prefix}{{floodgate}}:tally:"),
                }))
            }
            (Backend::RedisCluster, _, _) => {
                // No retries inside the client: a flush sent again after a dropped connection
                // could count twice; one that fails is kept for the next flush instead.
                let client = redis::cluster::ClusterClientBuilder::new(config.store.urls.clone())
                    .connection_timeout(REDIS_TIMEOUT)
                    .response_timeout(REDIS_TIMEOUT)
                    .retries(0)
                    .build()
                    .map_err(|e| format!("the refusal tally's Redis Cluster client: {e}"))?;
                let prefix = config.store.prefix.as_deref().unwrap_or("fg:");
                Keep::Redis(Box::new(RedisTally {
                    client: TallyClient::Cluster(client),
                    key: format!("{prefix}{{floodgate}}:tally:"),
                }))
            }
            (_, _, Some(path)) => {
                // Read now, under its lock (which proves the directory writable too), so that a
                // file that is not a tally stops the start, not the first flush.
                let _lock = take_file_lock(path, OPEN_LOCK_WAIT)?;
                read_file(path)?;
                Keep::File(path.clone())
            }
            _ => {
                // Said at start: an operator who expects the alerts to outlive a restart learns
                // where to keep them before they are lost (the quick start's config sets one).
                tracing::warn!(
                    "the refusal tally is kept in memory only: a restart loses it; set \
                     [alerts] path to keep it in a file"
                );
                Keep::Memory
            }
        };
        Ok(Tally::with(config, keep))
    }

    /// A tally in memory only, for `config`'s keys.
    pub fn in_memory(config: &Config) -> Tally {
        Tally::with(config, Keep::Memory)
    }

    fn with(config: &Config, keep: Keep) -> Tally {
        Tally {
            subjects: Mutex::new(
                std::iter::once(GATEWAY_SUBJECT.to_owned())
                    .chain(config.keys.iter().map(|k| format!("key:{}", k.id)))
                    .collect(),
            ),
            workers: Mutex::new(Vec::new()),
            aggregate: Mutex::new(Days::new()),
            keep,
            flushing: tokio::sync::Mutex::new(()),
            flush_every: config.alerts.flush_every,
            retention_days: config.alerts.retention_days,
        }
    }

    /// New counters for one worker, flushed with the others from now on.
    pub fn worker(&self) -> Arc<Counters> {
        let counters = Arc::new(Counters::new(lock(&self.subjects).len()));
        lock(&self.workers).push(Arc::clone(&counters));
        counters
    }

    /// The tally slot of each of `config`'s keys, in config order (what [`Subject::Key`]
    /// takes): a key keeps the slot its id had, a key new to the process gets the next one.
    /// Counters made before a new key's slot have no room for it: a reload makes each worker
    /// new ones ([`Tally::worker`]).
    pub fn key_slots(&self, config: &Config) -> Vec<usize> {
        let mut subjects = lock(&self.subjects);
        config
            .keys
            .iter()
            .map(|k| {
                let name = format!("key:{}", k.id);
                let slot = match subjects.iter().position(|s| *s == name) {
                    Some(slot) => slot,
                    None => {
                        subjects.push(name);
                        subjects.len() - 1
                    }
                };
                slot - 1
            })
            .collect()
    }

    /// Moves every worker's counts into the aggregate under today's local date and saves it
    /// (file or Redis). A failed save is logged and retried at the next flush: the counts stay
    /// in memory until then.
    pub async fn flush(&self) {
        self.flush_as(today()).await;
    }

    /// [`flush`](Self::flush), counting what is collected as `day`'s: at midnight, the day that
    /// has just ended.
    async fn flush_as(&self, day: NaiveDate) {
        let _one = self.flushing.lock().await;
        self.collect(day);
        self.save().await;
    }

    /// The flush at exit, after the workers have drained: a save that fails (Redis down or
    /// restarting, the file's lock held by another process) is tried again every
    /// [`FINAL_RETRY_EVERY`] for up to `within`, since no later flush will take the counts.
    /// Counts still not saved then are lost, and logged with their number.
    pub async fn flush_final(&self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            // The lock is held for one attempt at a time: a second signal's flush (one attempt,
            // then exit) gets its turn between them rather than after every retry.
            let saved = {
                let _one = self.flushing.lock().await;
                self.collect(today());
                self.save().await
            };
            if saved {
                return;
            }
            if tokio::time::Instant::now() + FINAL_RETRY_EVERY > deadline {
                tracing::error!(
                    refusals = self.pending(),
                    "exiting with refusals the tally could not save: they are lost"
                );
                return;
            }
            tokio::time::sleep(FINAL_RETRY_EVERY).await;
        }
    }

    /// How many refusals are collected but not saved yet.
    fn pending(&self) -> u64 {
        total(&lock(&self.aggregate))
    }

    /// Moves every worker's counts into the aggregate (in memory: dropping the days past the
    /// retention) or the counts to write (a file or Redis) under `day`.
    fn collect(&self, day: NaiveDate) {
        let mut days = lock(&self.aggregate);
        let subjects = lock(&self.subjects);
        lock(&self.workers).retain_mut(|w| {
            // Counters no worker holds any more (each reload, even a refused one, gives every
            // worker new ones) take no more counts: emptied now, they go, or every reload would
            // leave a set behind for good. Told before their counts are taken (`get_mut`
            // synchronizes with the last holder's drop, so its last counts are seen).
            let orphaned = Arc::get_mut(w).is_some();
            for (slot, counter) in w.slots.iter().enumerate() {
                let n = counter.swap(0, Ordering::Relaxed);
                if n > 0 {
                    let count = days
                        .entry(day.to_string())
                        .or_default()
                        .entry(subjects[slot].clone())
                        .or_default();
                    *count = count.saturating_add(n);
                }
            }
            !orphaned
        });
        if matches!(self.keep, Keep::Memory) {
            let oldest = oldest_kept(day, self.retention_days);
            days.retain(|d, _| *d >= oldest);
        }
    }

    /// Saves what is collected; whether all of it is saved (in memory: always).
    async fn save(&self) -> bool {
        match &self.keep {
            Keep::Memory => true,
            Keep::File(path) => {
                let pending = lock(&self.aggregate).clone();
                if pending.is_empty() {
                    return true;
                }
                // Written without the counts' lock held (`alerts` on a worker never waits for
                // the disk), then put in place with it held: `alerts` finds the counts in the
                // file or still pending, never in both or neither. Only a flush adds to
                // `pending`, and flushes take turns: all of it is written now.
                let oldest = oldest_kept(today(), self.retention_days);
                // Through a symbolic link (to a volume, say), the file it names is replaced,
                // not the link.
                let file = linked(path);
                let added = add_to_file(path, &file, &pending, &oldest).and_then(|(_lock, tmp)| {
                    let mut pending = lock(&self.aggregate);
                    std::fs::rename(&tmp, &file)
                        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
                    pending.clear();
                    Ok(())
                });
                match added {
                    Ok(()) => {
                        sync_dir(&file);
                        true
                    }
                    Err(e) => {
                        tracing::error!(
                            path = %path.display(),
                            error = %e,
                            refusals = total(&pending),
                            "cannot add to the refusal tally; retrying at the next flush"
                        );
                        false
                    }
                }
            }
            Keep::Redis(r) => {
                let pending = lock(&self.aggregate).clone();
                if pending.is_empty() {
                    return true;
                }
                let ttl = (u64::from(self.retention_days) + 1) * 86_400;
                let mut pipe = redis::pipe();
                pipe.atomic();
                for (day, subjects) in &pending {
                    let key = format!("{}{day}", r.key);
                    for (subject, n) in subjects {
                        pipe.hincr(&key, subject, *n).ignore();
                    }
                    pipe.expire(&key, ttl as i64).ignore();
                }
                let written = r.call::<()>(&pipe).await;
                match written {
                    // Only a flush adds to `pending`, and flushes take turns: all of it is
                    // written now.
                    Ok(()) => {
                        lock(&self.aggregate).clear();
                        true
                    }
                    Err(e) => {
                        tracing::warn!(
                            error = %e,
                            refusals = total(&pending),
                            "cannot add to the refusal tally in Redis; retrying at the next flush"
                        );
                        false
                    }
                }
            }
        }
    }

    /// Flushes every `[alerts] flush_sec`, and at each local midnight, until `stop` resolves;
    /// the final flush is the caller's, after the workers have drained. The flush at midnight
    /// counts what it collects as the day that has just ended: the refusals of its last moments
    /// stay on it (those of the few milliseconds the timer wakes late go with them).
    pub async fn flush_until(self: Arc<Self>, stop: impl std::future::Future<Output = ()>) {
        let mut stop = std::pin::pin!(stop);
        loop {
            let (wait, ending) = next_flush(Local::now().naive_local(), self.flush_every);
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = &mut stop => return,
            }
            self.flush_as(ending.unwrap_or_else(today)).await;
        }
    }

    /// The alerts: one per day and subject with refusals, the counts not yet flushed added to
    /// today's, newest day first, then most refusals first. In a file or on Redis, every
    /// process's; an error if the file or Redis cannot be read.
    pub async fn alerts(&self) -> Result<Vec<Alert>, String> {
        let now = today();
        let mut days = match &self.keep {
            Keep::Redis(r) => {
                let listed: Vec<String> = (0..self.retention_days)
                    .filter_map(|back| now.checked_sub_days(chrono::Days::new(back.into())))
                    .map(|d| d.to_string())
                    .collect();
                let mut pipe = redis::pipe();
                for day in &listed {
                    pipe.hgetall(format!("{}{day}", r.key));
                }
                let stored: Vec<BTreeMap<String, u64>> = r
                    .call(&pipe)
                    .await
                    .map_err(|e| format!("cannot read the refusal tally from Redis: {e}"))?;
                listed.into_iter().zip(stored).collect()
            }
            _ => Days::new(),
        };
        // The file (Redis is read above), what is pending and the workers' counters, as of one
        // instant: a flush moves counts between them only with this lock held.
        let pending = lock(&self.aggregate);
        if let Keep::File(path) = &self.keep {
            let mut stored = read_file(path)?;
            let oldest = oldest_kept(now, self.retention_days);
            stored.retain(|d, _| *d >= oldest);
            add(&mut days, &stored);
        }
        add(&mut days, &pending);
        let today = now.to_string();
        let subjects = lock(&self.subjects);
        for w in lock(&self.workers).iter() {
            for (slot, counter) in w.slots.iter().enumerate() {
                let n = counter.load(Ordering::Relaxed);
                if n > 0 {
                    let count = days
                        .entry(today.clone())
                        .or_default()
                        .entry(subjects[slot].clone())
                        .or_default();
                    *count = count.saturating_add(n);
                }
            }
        }
        drop(pending);
        let mut alerts: Vec<Alert> = days
            .into_iter()
            .flat_map(|(day, subjects)| {
                subjects
                    .into_iter()
                    .filter(|(_, count)| *count > 0)
                    .map(move |(subject, count)| alert(&day, &subject, count))
            })
            .collect();
        alerts.sort_by(|a, b| b.day.cmp(&a.day).then(b.count.cmp(&a.count)));
        Ok(alerts)
    }
}

/// The refusals counted in `days`, over every day and subject.
fn total(days: &Days) -> u64 {
    days.values().flat_map(BTreeMap::values).sum()
}

/// Adds `more` into `days`.
fn add(days: &mut Days, more: &Days) {
    for (day, subjects) in more {
        let into = days.entry(day.clone()).or_default();
        for (subject, n) in subjects {
            let count = into.entry(subject.clone()).or_default();
            *count = count.saturating_add(*n);
        }
    }
}

/// The oldest day a retention of `retention_days` keeps on `day`, as `YYYY-MM-DD`.
fn oldest_kept(day: NaiveDate, retention_days: u32) -> String {
    day.checked_sub_days(chrono::Days::new(u64::from(retention_days.max(1)) - 1))
        .unwrap_or(NaiveDate::MIN)
        .to_string()
}

fn alert(day: &str, subject: &str, count: u64) -> Alert {
    let requests = if count == 1 { "request" } else { "requests" };
    match subject.strip_prefix("key:") {
        Some(id) => Alert {
            kind: "rate_limit",
            day: day.to_owned(),
            subject: "key",
            key: Some(id.to_owned()),
            count,
            message: format!("key `{id}` was refused {count} {requests} (429) on {day}"),
        },
        None => Alert {
            kind: "rate_limit",
            day: day.to_owned(),
            subject: "gateway",
            key: None,
            count,
            message: format!("gateway-wide limits refused {count} {requests} (429) on {day}"),
        },
    }
}

fn today() -> NaiveDate {
    Local::now().date_naive()
}

/// When the flusher next flushes, from local time `now`, flushing `every`: after `every`, or at
/// the next midnight if that comes first, then with the day that ends there.
fn next_flush(now: chrono::NaiveDateTime, every: Duration) -> (Duration, Option<NaiveDate>) {
    let midnight = now
        .date()
        .succ_opt()
        .map(|d| d.and_time(chrono::NaiveTime::MIN));
    let left = midnight
        .and_then(|m| (m - now).to_std().ok())
        .unwrap_or(Duration::MAX);
    if left <= every {
        (left, Some(now.date()))
    } else {
        (every, None)
    }
}

fn read_file(path: &Path) -> Result<Days, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Days::new()),
        Err(e) => {
            return Err(format!(
                "cannot read the refusal tally {}: {e}",
                path.display()
            ));
        }
    };
    let file: TallyFile = serde_json::from_str(&text).map_err(|e| {
        format!(
            "the refusal tally {} is not a floodgate tally ({e}): fix or remove it",
            path.display()
        )
    })?;
    if file.version != FILE_VERSION {
        return Err(format!(
            "the refusal tally {} has version {}; this gateway reads version {FILE_VERSION}",
            path.display(),
            file.version
        ));
    }
    // Written as this gateway writes it (`2026-01-05`, not `2026-1-5`): days are compared as
    // text, for retention and for the chart.
    let canonical = |d: &str| d.parse::<NaiveDate>().is_ok_and(|p| p.to_string() == d);
    if let Some(day) = file.days.keys().find(|d| !canonical(d)) {
        return Err(format!(
            "the refusal tally {} has `{day}`, which is not a date (YYYY-MM-DD): fix or remove it",
            path.display()
        ));
    }
    Ok(file.days)
}

/// The file `path` names: `path` itself, or the one a symbolic link there points to (which
/// need not exist yet).
fn linked(path: &Path) -> PathBuf {
    match std::fs::read_link(path) {
        Ok(to) if to.is_relative() => path.parent().map_or(to.clone(), |dir| dir.join(&to)),
        Ok(to) => to,
        Err(_) => path.to_path_buf(),
    }
}

/// `path` with `suffix` added to its file name.
fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The lock file of the tally in `path`: `<path>.lock`.
fn lock_path(path: &Path) -> PathBuf {
    beside(path, ".lock")
}

/// Opens (creating it if missing) the lock file of the tally in `path`.
fn open_lock(path: &Path) -> Result<std::fs::File, String> {
    let lock_path = lock_path(path);
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| {
            format!(
                "cannot create the refusal tally's lock {}: {e}",
                lock_path.display()
            )
        })
}

/// How long a start waits for another process's lock on the tally file (taken only for a
/// flush's read and write: held longer, that process is stuck).
const OPEN_LOCK_WAIT: Duration = Duration::from_secs(10);

/// How long a flush waits for it: the flusher shares its thread with the signal handler, and a
/// flush that cannot take the lock keeps its counts for the next one.
const FLUSH_LOCK_WAIT: Duration = Duration::from_secs(2);

/// How often the flush at exit tries a failed save again.
const FINAL_RETRY_EVERY: Duration = Duration::from_millis(500);

/// Takes the exclusive lock on `<path>.lock` (created if missing), waiting up to `wait` for
/// another process to let it go; the lock goes with the returned file.
fn take_file_lock(path: &Path, wait: Duration) -> Result<std::fs::File, String> {
    let file = open_lock(path)?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(format!(
                    "{} stayed locked by another process for {} s (a gateway stuck in a flush?)",
                    lock_path(path).display(),
                    wait.as_secs()
                ));
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(format!("cannot lock {}: {e}", lock_path(path).display()));
            }
        }
    }
}

/// Adds `pending` to the tally in `path` and drops its days before `oldest`, into a new file
/// beside `file` (synced; `path` itself, or the file a link at `path` names), under the
/// exclusive lock on `<path>.lock`: returns the lock and the new file, which the caller renames
/// over `file` before it lets the lock go. Every process that
/// names the file adds to it, none overwrites another's counts.
fn add_to_file(
    path: &Path,
    file: &Path,
    pending: &Days,
    oldest: &str,
) -> Result<(std::fs::File, PathBuf), String> {
    let lock = take_file_lock(path, FLUSH_LOCK_WAIT)?;
    let mut days = read_file(path)?;
    add(&mut days, pending);
    days.retain(|d, _| d.as_str() >= oldest);
    let tmp =
        write_tmp(file, &days).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok((lock, tmp))
}

/// Writes `days` to a new file beside `path` and syncs it: renamed over `path`, a crash or a
/// power cut mid-write leaves the old tally whole, and a written one survives.
fn write_tmp(path: &Path, days: &Days) -> std::io::Result<PathBuf> {
    use std::io::Write;
    let file = TallyFile {
        version: FILE_VERSION,
        days: days.clone(),
    };
    let text = serde_json::to_vec_pretty(&file).map_err(std::io::Error::other)?;
    let tmp = beside(path, ".tmp");
    let mut out = std::fs::File::create(&tmp)?;
    // The tally's mode as the operator left it (it names tenants' keys: `chmod 600` stays).
    if let Ok(meta) = std::fs::metadata(path) {
        out.set_permissions(meta.permissions())?;
    }
    out.write_all(&text)?;
    out.sync_all()?;
    Ok(tmp)
}

/// Syncs the directory of `path`: a rename into it is durable once the directory is. (A
/// failure leaves the new tally in place, so it is not one.)
fn sync_dir(path: &Path) {
    // A bare file name's directory is the current one.
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(path: Option<PathBuf>, retention_days: u32) -> Config {
        let mut c = Config::parse(
            "test.toml",
            r#"
            [upstream]
            demo = true
            [[keys]]
            id = "alice"
            secret = "sk-a"
            [[keys]]
            id = "bob"
            secret = "sk-b"
            "#,
        )
        .unwrap();
        c.alerts.path = path;
        c.alerts.retention_days = retention_days;
        c
    }

    fn day(s: &str) -> NaiveDate {
        s.parse().unwrap()
    }

    async fn flush_on(tally: &Tally, day: NaiveDate) {
        tally.collect(day);
        tally.save().await;
    }

    #[tokio::test]
    async fn counts_from_every_worker_land_on_the_flush_day() {
        let tally = Tally::in_memory(&config(None, 90));
        let (a, b) = (tally.worker(), tally.worker());
        a.refused(Subject::Key(1));
        b.refused(Subject::Key(1));
        b.refused(Subject::Gateway);
        flush_on(&tally, day("2026-12-01")).await;
        a.refused(Subject::Key(0));
        flush_on(&tally, day("2026-12-02")).await;
        let days = lock(&tally.aggregate).clone();
        assert_eq!(
            days["2026-12-01"],
            BTreeMap::from([("gateway".into(), 1), ("key:bob".into(), 2)])
        );
        assert_eq!(
            days["2026-12-02"],
            BTreeMap::from([("key:alice".into(), 1)])
        );
    }

    #[tokio::test]
    async fn counters_no_worker_holds_go_at_the_flush_after_their_counts() {
        let tally = Tally::in_memory(&config(None, 90));
        let kept = tally.worker();
        for _ in 0..100 {
            // A reload: every worker gets new counters, and the old ones are dropped.
            let replaced = tally.worker();
            replaced.refused(Subject::Key(0));
            drop(replaced);
        }
        kept.refused(Subject::Gateway);
        assert_eq!(lock(&tally.workers).len(), 101);
        flush_on(&tally, day("2026-12-01")).await;
        assert_eq!(
            lock(&tally.workers).len(),
            1,
            "only the counters still held are kept"
        );
        assert_eq!(
            lock(&tally.aggregate)["2026-12-01"],
            BTreeMap::from([("gateway".into(), 1), ("key:alice".into(), 100)]),
            "the dropped counters' counts are all taken first"
        );
        kept.refused(Subject::Gateway);
        flush_on(&tally, day("2026-12-02")).await;
        assert_eq!(
            lock(&tally.aggregate)["2026-12-02"],
            BTreeMap::from([("gateway".into(), 1)])
        );
    }

    #[tokio::test]
    async fn old_days_are_dropped_past_the_retention() {
        let tally = Tally::in_memory(&config(None, 2));
        let w = tally.worker();
        for d in ["2026-11-29", "2026-11-30", "2026-12-01"] {
            w.refused(Subject::Gateway);
            flush_on(&tally, day(d)).await;
        }
        let days: Vec<String> = lock(&tally.aggregate).keys().cloned().collect();
        assert_eq!(days, ["2026-11-30", "2026-12-01"]);
    }

    #[tokio::test]
    async fn the_file_survives_a_restart_and_a_bad_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("floodgate-tally-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tally.json");
        let _ = std::fs::remove_file(&path);
        let c = config(Some(path.clone()), 90);
        let first = Tally::open(&c).unwrap();
        first.worker().refused(Subject::Key(0));
        flush_on(&first, day("2026-12-01")).await;
        drop(first);
        let second = Tally::open(&c).unwrap();
        second.worker().refused(Subject::Key(0));
        flush_on(&second, day("2026-12-01")).await;
        assert_eq!(read_file(&path).unwrap()["2026-12-01"]["key:alice"], 2);

        drop(second);
        std::fs::write(&path, "{\"version\": 1, \"days\": {\"yesterday\": {}}}").unwrap();
        let e = Tally::open(&c).unwrap_err();
        assert!(e.contains("tally.json") && e.contains("`yesterday`"), "{e}");
        std::fs::write(&path, "not json").unwrap();
        let e = Tally::open(&c).unwrap_err();
        assert!(e.contains("not a floodgate tally"), "{e}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "not json");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn processes_naming_one_tally_file_add_to_it() {
        // A restarted gateway beside the one still draining: neither overwrites the other.
        let dir = std::env::temp_dir().join(format!("floodgate-shared-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tally.json");
        let c = config(Some(path.clone()), 90);
        let (old, new) = (Tally::open(&c).unwrap(), Tally::open(&c).unwrap());
        let (old_worker, new_worker) = (old.worker(), new.worker());
        old_worker.refused(Subject::Key(0));
        new_worker.refused(Subject::Key(0));
        new_worker.refused(Subject::Key(1));
        flush_on(&new, today()).await;
        flush_on(&old, today()).await;
        old_worker.refused(Subject::Key(0));
        flush_on(&old, today()).await;
        let day = today().to_string();
        let days = read_file(&path).unwrap();
        assert_eq!(
            days[&day],
            BTreeMap::from([("key:alice".into(), 3), ("key:bob".into(), 1)])
        );
        // Either one's alerts show both's counts, and their own not yet flushed.
        new_worker.refused(Subject::Gateway);
        let alerts = new.alerts().await.unwrap();
        let counts: Vec<(&str, u64)> = alerts.iter().map(|a| (a.subject, a.count)).collect();
        assert_eq!(
            counts,
            [("key", 3), ("gateway", 1), ("key", 1)],
            "{alerts:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_flush_that_cannot_take_the_file_lock_keeps_its_counts() {
        let dir = std::env::temp_dir().join(format!("floodgate-held-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tally.json");
        let tally = Tally::open(&config(Some(path.clone()), 90)).unwrap();
        // Another process stuck with the lock: the flush gives up (it does not hang the
        // flusher's thread) and keeps its counts.
        let held = open_lock(&path).unwrap();
        held.lock().unwrap();
        let e = take_file_lock(&path, Duration::from_millis(50)).unwrap_err();
        assert!(e.contains("tally.json.lock stayed locked"), "{e}");
        tally.worker().refused(Subject::Key(0));
        flush_on(&tally, today()).await;
        let day = today().to_string();
        assert_eq!(lock(&tally.aggregate)[&day]["key:alice"], 1);
        assert!(read_file(&path).unwrap().is_empty());
        drop(held);
        flush_on(&tally, today()).await;
        assert_eq!(read_file(&path).unwrap()[&day]["key:alice"], 1);
        assert!(lock(&tally.aggregate).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn the_flush_at_exit_waits_out_another_process_holding_the_file_lock() {
        let dir = std::env::temp_dir().join(format!("floodgate-exit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tally.json");
        let tally = Tally::open(&config(Some(path.clone()), 90)).unwrap();
        tally.worker().refused(Subject::Key(1));
        // Another process holds the lock for longer than one flush waits for it.
        let held = open_lock(&path).unwrap();
        held.lock().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(FLUSH_LOCK_WAIT + Duration::from_millis(500));
            drop(held);
        });
        tally.flush_final(Duration::from_secs(10)).await;
        release.join().unwrap();
        assert_eq!(
            read_file(&path).unwrap()[&today().to_string()]["key:bob"],
            1
        );
        assert_eq!(tally.pending(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn alerts_add_what_is_not_flushed_yet() {
        let tally = Tally::in_memory(&config(None, 90));
        let w = tally.worker();
        w.refused(Subject::Key(0));
        w.refused(Subject::Key(0));
        flush_on(&tally, day("2020-01-01")).await;
        w.refused(Subject::Gateway);
        let alerts = tally.alerts().await.unwrap();
        assert_eq!(alerts.len(), 2, "{alerts:?}");
        assert_eq!(alerts[0].day, today().to_string());
        assert_eq!(
            (alerts[0].subject, alerts[0].count, alerts[0].key.as_deref()),
            ("gateway", 1, None)
        );
        assert_eq!(
            (
                alerts[1].day.as_str(),
                alerts[1].key.as_deref(),
                alerts[1].count
            ),
            ("2020-01-01", Some("alice"), 2)
        );
        assert_eq!(
            alerts[1].message,
            "key `alice` was refused 2 requests (429) on 2020-01-01"
        );
    }

    #[tokio::test]
    async fn counts_that_redis_did_not_take_are_kept_for_the_next_flush() {
        let mut c = config(None, 90);
        c.store.backend = Backend::Redis;
        // Nothing listens on port 1.
        c.store.url = Some("redis://127.0.0.1:1/0".into());
        let tally = Tally::open(&c).unwrap();
        let w = tally.worker();
        w.refused(Subject::Key(1));
        tally.flush().await;
        w.refused(Subject::Key(1));
        tally.flush().await;
        assert_eq!(lock(&tally.aggregate)[&today().to_string()]["key:bob"], 2);
        let e = tally.alerts().await.unwrap_err();
        assert!(e.contains("Redis"), "{e}");
    }

    /// The file as the operator set it up stays so across flushes: its mode (`chmod 600`: it
    /// names tenants' keys), and a symbolic link to it (onto a volume, say), whose file is
    /// written, not the link replaced. Before, each flush put a new file in place, with the
    /// default mode, over the link itself.
    #[tokio::test]
    async fn a_flush_keeps_the_files_mode_and_writes_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("floodgate-tally-fs-{}", std::process::id()));
        let volume = dir.join("volume");
        std::fs::create_dir_all(&volume).unwrap();
        let path = dir.join("tally.json");
        // A link to a file not there yet, relative to the link's directory.
        std::os::unix::fs::symlink("volume/tally.json", &path).unwrap();
        let tally = Tally::open(&config(Some(path.clone()), 90)).unwrap();
        let w = tally.worker();
        w.refused(Subject::Key(0));
        flush_on(&tally, today()).await;
        let real = volume.join("tally.json");
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).unwrap();
        w.refused(Subject::Key(0));
        flush_on(&tally, today()).await;
        let link = std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink();
        let mode = std::fs::metadata(&real).unwrap().permissions().mode() & 0o777;
        let days = read_file(&real).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(link, "the link was replaced by a file");
        assert_eq!(mode, 0o600, "the mode was reset: {mode:o}");
        assert_eq!(days[&today().to_string()]["key:alice"], 2);
    }

    /// A day written otherwise than as the gateway writes it (`2026-1-5`) is refused at read,
    /// as a day that is not a date is: days are compared as text, for retention and the chart.
    #[test]
    fn a_day_not_written_yyyy_mm_dd_is_refused() {
        let dir = std::env::temp_dir().join(format!("floodgate-tally-day-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tally.json");
        let text = r#"{"version": 1, "days": {"2026-1-5": {"key:alice": 2}}}"#;
        std::fs::write(&path, text).unwrap();
        let read = read_file(&path);
        std::fs::remove_dir_all(&dir).unwrap();
        let e = read.expect_err("2026-1-5 read as a day");
        assert!(e.contains("`2026-1-5`"), "{e}");
    }

    /// The flusher wakes at midnight, not before, and counts that flush as the day that ended:
    /// the refusals of the day's last second stay on it (before, it flushed a second early and
    /// dated them the next day).
    #[test]
    fn the_flusher_flushes_at_midnight_as_the_day_that_ended() {
        let day = NaiveDate::from_ymd_opt(2026, 12, 1).unwrap();
        let at = |h, m, s, ms| day.and_hms_milli_opt(h, m, s, ms).unwrap();
        let minute = Duration::from_secs(60);
        assert_eq!(next_flush(at(12, 0, 0, 0), minute), (minute, None));
        assert_eq!(
            next_flush(at(23, 59, 0, 0), minute),
            (minute, Some(day)),
            "a flush due at midnight is midnight's"
        );
        assert_eq!(
            next_flush(at(23, 59, 59, 200), minute),
            (Duration::from_millis(800), Some(day))
        );
        assert_eq!(next_flush(at(0, 0, 0, 0), minute), (minute, None));
    }
}
