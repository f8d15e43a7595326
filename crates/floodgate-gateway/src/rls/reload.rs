//! Hot reload of the rate limit service's YAML, as the gateway's config (`crate::reload`):
//! `SIGHUP`, or a change of the file or of a file of the directory, reads everything again. A
//! reload is whole or nothing: one invalid file keeps the running config (the error, with file,
//! line and field, is logged and counted). Counters are kept: they are named by the request's
//! entries and the window, so a limit whose size changes applies it to the counts it has.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::config::{RlsConfig, RlsConfigError};
use super::service::Rls;

/// How often the files are looked at for a change.
pub const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Reloads one path into a running service.
#[derive(Debug)]
pub struct Reloader {
    path: PathBuf,
    rls: Arc<Rls>,
    loaded: Option<Seen>,
}

impl Reloader {
    /// Reloads `path` (a file or a directory) into `rls`, whose running config was read from
    /// the files as `loaded` (a [`snapshot`] taken before that read) found them: a change made
    /// since is seen at the watcher's first look.
    pub fn new(path: PathBuf, rls: Arc<Rls>, loaded: Option<Seen>) -> Reloader {
        Reloader { path, rls, loaded }
    }

    /// Reads the config again and, if it is valid, puts it in force. Logged and counted.
    pub fn reload(&self) -> Result<(), RlsConfigError> {
        let result = RlsConfig::load(&self.path);
        self.rls.metrics().reload(result.is_ok());
        match result {
            Ok(config) => {
                let domains = config.domains().len();
                self.rls.replace_config(config);
                tracing::info!(config = %self.path.display(), domains, "config reloaded");
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "config reload refused: the running config stays");
                Err(e)
            }
        }
    }
}

/// What identifies the files' content: each one's name, time, length and inode (a rename over
/// a file, as editors and Kubernetes ConfigMaps do, changes the inode).
pub type Seen = Vec<(PathBuf, Option<SystemTime>, u64, u64)>;

/// What the files at `path` look like now; taken before the config is read, for
/// [`Reloader::new`].
pub fn snapshot(path: &Path) -> Option<Seen> {
    let meta = std::fs::metadata(path).ok()?;
    let mut files = vec![path.to_owned()];
    if meta.is_dir() {
        files = std::fs::read_dir(path)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        files.sort();
    }
    Some(
        files
            .into_iter()
            .filter_map(|f| {
                let m = std::fs::metadata(&f).ok()?;
                #[cfg(unix)]
                let inode = std::os::unix::fs::MetadataExt::ino(&m);
                #[cfg(not(unix))]
                let inode = 0;
                Some((f, m.modified().ok(), m.len(), inode))
            })
            .collect(),
    )
}

/// Watches the reloader's path and reloads when it changes, forever. A path gone for a moment
/// (mid-rename) is waited for, not reloaded.
pub async fn watch(reloader: &Reloader) {
    let mut last = reloader.loaded.clone();
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = snapshot(&reloader.path);
        if now.is_none() || now == last {
            continue;
        }
        last = now;
        let _ = reloader.reload();
    }
}
