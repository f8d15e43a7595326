//! Hot reload (docs/design.md §7): `SIGHUP`, or a change of the config file, reloads the config
//! without a restart.
//!
//! A reload is whole or nothing. The file is read and validated; a config that fails keeps the
//! running one (the error, with file, line and field, is logged). What cannot change without a
//! restart (`[server]`, `[store]`, `[admin]`, `[realtime]`, and `[alerts]` but its secret) is
//! compared with the running config: a change there refuses the whole reload, with a message
//! naming it. Then every worker's new state is built (the keys and their chains, the price
//! table, the upstream); if one fails, none is swapped in. Then each worker's is swapped:
//! requests that start after the swap see it, requests in flight finish under the old one, and
//! live realtime sessions go on.
//!
//! Counters are kept: a limit's state lives in the store under a key made of its scope, id,
//! kind and window, not its size, so a limit that stays is the same counter, and one whose size
//! changes applies its new size to the state it has.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::config::{Config, UpstreamTarget, default_workers, text_digest};
use crate::http::{AppState, Process};

/// How often the config file is looked at for a change.
pub const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Why a reload changed nothing.
#[derive(Debug)]
pub enum ReloadError {
    /// The file could not be read or is not a valid config.
    Invalid(crate::config::ConfigError),
    /// It changes what only a restart can: these sections or fields.
    NeedsRestart(Vec<&'static str>),
    /// A worker's new state could not be built (the upstream's API key variable, say).
    Build(crate::startup::StartError),
}

impl std::fmt::Display for ReloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReloadError::Invalid(e) => write!(f, "{e}"),
            ReloadError::NeedsRestart(what) => write!(
                f,
                "{} cannot change without a restart: nothing of this reload applied",
                what.join(", ")
            ),
            ReloadError::Build(e) => write!(f, "{e}"),
        }
    }
}

/// Reloads one process's config into its workers.
#[derive(Debug)]
pub struct Reloader {
    path: PathBuf,
    running: Mutex<Config>,
    states: Vec<AppState>,
    process: Process,
}

impl Reloader {
    /// Reloads `running`'s file into `states`, the workers of `process`.
    pub fn new(running: Config, states: Vec<AppState>, process: Process) -> Reloader {
        Reloader {
            path: running.path.clone(),
            running: Mutex::new(running),
            states,
            process,
        }
    }

    /// The file reloaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The digest of the text the running config was read from.
    fn running_digest(&self) -> u64 {
        self.running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .text_digest
    }

    /// The running config's upstream CA file, if it has one, and the digest of what it held
    /// when that config was read.
    fn running_ca_file(&self) -> Option<(PathBuf, Option<u64>)> {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        match &running.upstream.target {
            UpstreamTarget::Http {
                ca_file: Some(path),
                ..
            } => Some((path.clone(), running.ca_file_digest)),
            _ => None,
        }
    }

    /// [`Reloader::reload`] from a task: on a multi-threaded runtime, its other tasks (the
    /// admin listener, the tally's flushes) move to another thread while the file is read and
    /// every worker's state built, which for a large config takes a while.
    pub fn reload_in_place(&self) -> Result<(), ReloadError> {
        use tokio::runtime::{Handle, RuntimeFlavor};
        // `block_in_place` is for a multi-threaded runtime; on another (or none), in place.
        match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(|| self.reload()),
            _ => self.reload(),
        }
    }

    /// Reads the file again and, if it is valid and changes only what can change, puts it in
    /// force in every worker. Counted in the metrics, logged either way.
    pub fn reload(&self) -> Result<(), ReloadError> {
        let result = self.try_reload();
        let metrics = &self.process.metrics;
        metrics.reload(result.is_ok());
        match &result {
            Ok(()) => tracing::info!(config = %self.path.display(), "config reloaded"),
            Err(e) => tracing::error!(
                error = %e,
                config = %self.path.display(),
                "config reload refused: the running config stays"
            ),
        }
        result
    }

    fn try_reload(&self) -> Result<(), ReloadError> {
        let new = Config::load(&self.path).map_err(ReloadError::Invalid)?;
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let fixed = needs_restart(&running, &new);
        if !fixed.is_empty() {
            return Err(ReloadError::NeedsRestart(fixed));
        }
        // Everything that can fail, for every worker, before anything changes.
        let prepared = self
            .states
            .iter()
            .map(|s| s.prepare(&new, &self.process))
            .collect::<Result<Vec<_>, _>>()
            .map_err(ReloadError::Build)?;
        for (state, live) in self.states.iter().zip(prepared) {
            state.swap(live);
        }
        for warning in new.unused_limit_warnings() {
            tracing::warn!("{warning}");
        }
        for key in moved_keys(&running, &new) {
            tracing::warn!(
                key,
                "the key's org changed: its own limits, budgets and slots, and its project's, \
                 team's and business unit's, start anew under its new org"
            );
        }
        self.process.set_running(new.clone());
        *running = new;
        Ok(())
    }
}

/// The ids of the keys of both configs whose org `new` changes: the state of their own limits
/// (and their project's, team's and business unit's) lives under their org, so it starts anew.
pub fn moved_keys<'a>(old: &Config, new: &'a Config) -> Vec<&'a str> {
    new.keys
        .iter()
        .filter(|k| {
            old.keys
                .iter()
                .any(|o| o.id == k.id && o.tenant() != k.tenant())
        })
        .map(|k| k.id.as_str())
        .collect()
}

/// What `new` changes that only a restart can.
pub fn needs_restart(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    let mut check = |same: bool, what: &'static str| {
        if !same {
            changed.push(what);
        }
    };
    check(old.listen == new.listen, "server.listen");
    // A value written out as what runs by default is no change, nor is the default read again.
    let workers = |c: &Config| c.workers.unwrap_or_else(default_workers);
    check(workers(old) == workers(new), "server.workers");
    check(
        old.header_timeout == new.header_timeout,
        "server.header_timeout_sec",
    );
    check(old.max_body_mib == new.max_body_mib, "server.max_body_mib");
    // Left out of both, it asks for nothing: its default follows the machine's memory, which
    // may read otherwise now than at the start.
    check(
        (!old.max_buffered_mib_written && !new.max_buffered_mib_written)
            || old.max_buffered_mib == new.max_buffered_mib,
        "server.max_buffered_mib",
    );
    check(
        old.max_connections == new.max_connections,
        "server.max_connections",
    );
    check(old.store == new.store, "[store]");
    check(old.admin == new.admin, "[admin]");
    check(old.realtime == new.realtime, "[realtime]");
    let alerts = |c: &Config| {
        (
            c.alerts.path.clone(),
            c.alerts.flush_every,
            c.alerts.retention_days,
        )
    };
    check(
        alerts(old) == alerts(new),
        "alerts.path, alerts.flush_sec, alerts.retention_days",
    );
    changed
}

/// What identifies the file's content on disk: a write in place changes its time or length, a
/// rename over it (as editors and Kubernetes ConfigMaps do) its inode.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    modified: Option<std::time::SystemTime>,
    len: u64,
    #[cfg(unix)]
    inode: (u64, u64),
}

fn seen(path: &Path) -> Option<Seen> {
    let m = std::fs::metadata(path).ok()?;
    Some(Seen {
        modified: m.modified().ok(),
        len: m.len(),
        #[cfg(unix)]
        inode: {
            use std::os::unix::fs::MetadataExt;
            (m.dev(), m.ino())
        },
    })
}

/// Decides, look by look, when the watched file is read: once a change has held still for a
/// whole look. A file written in place (`cp`, `cat > file`, an editor saving through a
/// symlink) is truncated and then written in pieces, and a first part of a TOML file is often
/// valid TOML (a number cut short, the keys after the cut missing): read mid-write, it would be
/// applied until the next look.
#[derive(Debug, Default)]
struct Settle {
    /// The file as it was when last read.
    read: Option<Seen>,
    /// A change seen at the last look, not read yet.
    changed: Option<Seen>,
}

impl Settle {
    /// Whether the file, seen as `now` (`None`: missing, mid-rename), is to be read now: it
    /// differs from what was last read and is as it was at the look before.
    fn look(&mut self, now: Option<&Seen>) -> bool {
        let Some(now) = now else {
            self.changed = None;
            return false;
        };
        if self.read.as_ref() == Some(now) {
            self.changed = None;
            return false;
        }
        if self.changed.as_ref() != Some(now) {
            self.changed = Some(now.clone());
            return false;
        }
        true
    }

    /// The file was read as `seen`.
    fn was_read(&mut self, seen: Seen) {
        self.read = Some(seen);
        self.changed = None;
    }

    /// Looks at the file at `path` and, if [`Settle::look`] says so, reads it: what it holds,
    /// unless it could not be read or changed while it was read (the next looks see it
    /// settle).
    fn read_settled(&mut self, path: &Path) -> Option<Vec<u8>> {
        let now = seen(path);
        if !self.look(now.as_ref()) {
            return None;
        }
        let bytes = std::fs::read(path).ok()?;
        let read = now.filter(|n| seen(path).as_ref() == Some(n))?;
        self.was_read(read);
        Some(bytes)
    }
}

/// Watches `reloader`'s file, and the upstream's CA file the running config names, and reloads
/// when either changes, until the process stops. A file gone for a moment (mid-rename) is waited
/// for, not reloaded; a file being written is read once it has not changed for a whole look
/// ([`Settle`]), and not used if it changed while it was read.
///
/// The first look that finds a file settled, and every one after a change that has settled,
/// reads it and reloads only if what it holds differs from what the running config was read
/// from: an edit made between the start's read and the watcher's first looks is not missed,
/// and a touch that changes nothing reloads nothing. A CA file is told apart by the digest of
/// its bytes, so a rotated CA (a new file renamed over the old, as Kubernetes mounts do) is
/// put in force without an edit of the config; a reload that fails on it keeps what runs, and
/// the file's next change is tried again. A reload runs off the runtime's thread where the
/// runtime has others ([`Reloader::reload_in_place`]).
pub async fn watch(reloader: &Reloader) {
    let mut config = Settle::default();
    let mut ca = Settle::default();
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Some(text) = config.read_settled(reloader.path())
            && text_digest(&text) != reloader.running_digest()
        {
            let _ = reloader.reload_in_place();
            continue;
        }
        // Not while the config itself is changing: the reload would read it half-written.
        if config.changed.is_none()
            && let Some((path, digest)) = reloader.running_ca_file()
            && let Some(bytes) = ca.read_settled(&path)
            && Some(text_digest(&bytes)) != digest
        {
            let _ = reloader.reload_in_place();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(len: u64, inode: u64) -> Seen {
        #[cfg(not(unix))]
        let _ = inode;
        Seen {
            modified: None,
            len,
            #[cfg(unix)]
            inode: (1, inode),
        }
    }

    #[test]
    fn defaults_written_out_or_read_again_are_no_change() {
        let old = config("");
        // `workers` written out as the number that runs by default.
        let n = default_workers();
        let new = config(&format!("[server]\nworkers = {n}\n"));
        assert!(needs_restart(&old, &new).is_empty());
        let new = config(&format!("[server]\nworkers = {}\n", n + 1));
        assert_eq!(needs_restart(&old, &new), ["server.workers"]);
        // `max_buffered_mib` left out of both: its default, read again after the machine's
        // memory changed, asks for nothing. Written out, a change of it does.
        let mut new = config("");
        new.max_buffered_mib = old.max_buffered_mib + 1024;
        assert!(needs_restart(&old, &new).is_empty());
        let new = config(&format!(
            "[server]\nmax_buffered_mib = {}\n",
            old.max_buffered_mib + 1024
        ));
        assert_eq!(needs_restart(&old, &new), ["server.max_buffered_mib"]);
    }

    #[test]
    fn a_file_is_read_once_a_change_has_held_still_for_a_look() {
        let mut settle = Settle::default();
        // The first looks: read once the file looks the same twice.
        assert!(!settle.look(Some(&file(10, 1))));
        assert!(settle.look(Some(&file(10, 1))));
        settle.was_read(file(10, 1));
        assert!(
            !settle.look(Some(&file(10, 1))),
            "unchanged: not read again"
        );
        // Written in place: truncated, then growing look after look. Read when it stops.
        for len in [0, 4, 9, 15] {
            assert!(
                !settle.look(Some(&file(len, 1))),
                "mid-write at {len} bytes"
            );
        }
        assert!(settle.look(Some(&file(15, 1))));
        settle.was_read(file(15, 1));
        // Renamed over (a new inode): the same rule; missing for a look (mid-rename) restarts
        // the wait.
        assert!(!settle.look(Some(&file(15, 2))));
        assert!(!settle.look(None));
        assert!(!settle.look(Some(&file(15, 2))));
        assert!(settle.look(Some(&file(15, 2))));
        // Changed back to what was read before settling: nothing to read.
        settle.was_read(file(15, 2));
        assert!(!settle.look(Some(&file(20, 2))));
        assert!(!settle.look(Some(&file(15, 2))));
        assert!(!settle.look(Some(&file(15, 2))));
    }

    fn config(keys: &str) -> Config {
        let text = format!("[upstream]\ndemo = true\n{keys}");
        Config::parse_with_env("test.toml", &text, None).expect("a valid config")
    }

    #[test]
    fn the_keys_whose_org_a_reload_changes_are_named() {
        let old = config(
            "[[keys]]\nid = \"a\"\nsecret = \"sk-a\"\n\
             [[keys]]\nid = \"b\"\nsecret = \"sk-b\"\norg = \"acme\"\n\
             [[keys]]\nid = \"c\"\nsecret = \"sk-c\"\norg = \"acme\"\n\
             [[keys]]\nid = \"d\"\nsecret = \"sk-d\"\norg = \"acme\"\n",
        );
        let new = config(
            "[[keys]]\nid = \"a\"\nsecret = \"sk-a\"\norg = \"acme\"\n\
             [[keys]]\nid = \"b\"\nsecret = \"sk-b\"\n\
             [[keys]]\nid = \"c\"\nsecret = \"sk-c\"\norg = \"beta\"\n\
             [[keys]]\nid = \"d\"\nsecret = \"sk-d2\"\norg = \"acme\"\n\
             [[keys]]\nid = \"e\"\nsecret = \"sk-e\"\norg = \"beta\"\n",
        );
        // An org given, taken away or renamed; not a key whose org stays (its secret changed),
        // nor one that is new.
        assert_eq!(moved_keys(&old, &new), ["a", "b", "c"]);
        assert!(moved_keys(&new, &new).is_empty());
    }
}
