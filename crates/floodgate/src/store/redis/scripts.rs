//! The Lua scripts: each operation's source (the `*.lua` files beside this one, put together
//! with `include_str!`), its hash, its replay policy, and how it is run (`EVALSHA`, loaded again
//! on NOSCRIPT).

use std::sync::LazyLock;

use ::redis::{Cmd, ErrorKind, FromRedisValue, RedisError, Script, ServerErrorKind};

/// Whether an operation may run again after its connection dropped under it, not knowing
/// whether the first attempt reached Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Replay {
    /// Replayed once. Admission: the first request after a drop is still enforced; if the first
    /// attempt did run and only its reply was lost, the request is charged twice, which errs by
    /// one toward stricter for one window. Acquire: the same, with tokens. Reset: a delete,
    /// idempotent. Reading period counters: a read, harmless twice.
    Once,
    /// Never replayed: an increment applied twice would count units (tokens, spend) that were
    /// never used, and nothing would ever take them back. Charges (tokens recorded, spend
    /// added to period counters) and reconciling a reservation.
    Never,
}

/// One script and its replay policy: the policy belongs to the operation, not to a call site.
pub(super) struct Op {
    pub(super) name: &'static str,
    pub(super) script: Script,
    pub(super) replay: Replay,
}

/// Each script is `clock.lua`, which sets `now`, followed by the operation's own file; the window
/// scripts also get `window.lua` (`window_at`, the rolled state of a window).
macro_rules! lua {
    ($file:literal) => {
        concat!(include_str!("clock.lua"), include_str!($file))
    };
    // The window scripts also share `window_at` (window.lua).
    (window $file:literal) => {
        concat!(
            include_str!("clock.lua"),
            include_str!("window.lua"),
            include_str!($file)
        )
    };
    // The period counter scripts share `period_at` and `total_in` (period.lua).
    (period $file:literal) => {
        concat!(
            include_str!("clock.lua"),
            include_str!("period.lua"),
            include_str!($file)
        )
    };
    // The admission script also reads and adds to counters.
    (window period $file:literal) => {
        concat!(
            include_str!("clock.lua"),
            include_str!("window.lua"),
            include_str!("period.lua"),
            include_str!($file)
        )
    };
    // The state scripts read windows and counters alike (state.lua).
    (state $file:literal) => {
        concat!(
            include_str!("clock.lua"),
            include_str!("window.lua"),
            include_str!("period.lua"),
            include_str!("state.lua"),
            include_str!($file)
        )
    };
}

const ADMIT_LUA: &str = lua!(window period "admit.lua");
const RECONCILE_LUA: &str = lua!(window "reconcile.lua");
const ACQUIRE_LUA: &str = lua!("acquire.lua");
const RESET_LUA: &str = lua!("reset.lua");
const PERIODS_RECONCILE_LUA: &str = lua!(period "periods_reconcile.lua");
const ADMIT_HOLDING_LUA: &str = lua!(window "admit_holding.lua");
const RELEASE_LUA: &str = lua!("release.lua");
const RENEW_LUA: &str = lua!("renew.lua");
const RUNNING_LUA: &str = lua!("running.lua");
const STATE_READ_LUA: &str = lua!(state "state_read.lua");
const STATE_CLEAR_LUA: &str = lua!(state "state_clear.lua");

fn op(name: &'static str, source: &str, replay: Replay) -> Op {
    Op {
        name,
        script: Script::new(source),
        replay,
    }
}

// Hashed once, on first use.
// A step: admissions and budget reads, replayed once; with charges, never (`step.rs` sends a
// lost call's admissions and reads again itself, once).
pub(super) static ADMIT: LazyLock<Op> = LazyLock::new(|| op("admit", ADMIT_LUA, Replay::Once));
pub(super) static ADMIT_CHARGING: LazyLock<Op> =
    LazyLock::new(|| op("admit", ADMIT_LUA, Replay::Never));
// A reservation's difference, added once: twice would charge (or refund) it twice.
pub(super) static RECONCILE: LazyLock<Op> =
    LazyLock::new(|| op("reconcile", RECONCILE_LUA, Replay::Never));
pub(super) static ACQUIRE: LazyLock<Op> =
    LazyLock::new(|| op("acquire", ACQUIRE_LUA, Replay::Once));
pub(super) static RESET: LazyLock<Op> = LazyLock::new(|| op("reset", RESET_LUA, Replay::Once));
pub(super) static PERIODS_RECONCILE: LazyLock<Op> =
    LazyLock::new(|| op("periods_reconcile", PERIODS_RECONCILE_LUA, Replay::Never));
// Taking a slot twice under one lease takes it once (the script finds its own member); the
// window charge replays as `admit`'s does.
pub(super) static ADMIT_HOLDING: LazyLock<Op> =
    LazyLock::new(|| op("admit_holding", ADMIT_HOLDING_LUA, Replay::Once));
pub(super) static RELEASE: LazyLock<Op> =
    LazyLock::new(|| op("release", RELEASE_LUA, Replay::Once));
pub(super) static RENEW: LazyLock<Op> = LazyLock::new(|| op("renew", RENEW_LUA, Replay::Once));
pub(super) static RUNNING: LazyLock<Op> =
    LazyLock::new(|| op("running", RUNNING_LUA, Replay::Once));

// An operator's read, and a reset (a delete: idempotent).
pub(super) static STATE_READ: LazyLock<Op> =
    LazyLock::new(|| op("state_read", STATE_READ_LUA, Replay::Once));
pub(super) static STATE_CLEAR: LazyLock<Op> =
    LazyLock::new(|| op("state_clear", STATE_CLEAR_LUA, Replay::Once));

/// The Lua source of each script as the store loads it (`clock.lua` prepended), by operation
/// name: `admit` (a step: admissions, budget reads and charges), `reconcile`, `acquire`, `reset`,
/// `periods_reconcile`, `state_read`, `state_clear`, `admit_holding`, `release`, `renew`,
/// `running`. For benchmarks
/// and operators who preload scripts (`SCRIPT LOAD`); the store loads them itself on first use.
///
/// ```
/// let admit = floodgate::store::redis::script_source("admit").unwrap();
/// assert!(admit.contains("redis.call('MGET'"));
/// ```
pub fn script_source(op: &str) -> Option<&'static str> {
    Some(match op {
        "admit" => ADMIT_LUA,
        "reconcile" => RECONCILE_LUA,
        "acquire" => ACQUIRE_LUA,
        "reset" => RESET_LUA,
        "periods_reconcile" => PERIODS_RECONCILE_LUA,
        "admit_holding" => ADMIT_HOLDING_LUA,
        "release" => RELEASE_LUA,
        "renew" => RENEW_LUA,
        "running" => RUNNING_LUA,
        "state_read" => STATE_READ_LUA,
        "state_clear" => STATE_CLEAR_LUA,
        _ => return None,
    })
}

/// How many times one call reloads its script on NOSCRIPT before giving up.
const MAX_RELOADS: u32 = 3;

/// `EVALSHA`, and on NOSCRIPT (a restarted or flushed server) `SCRIPT LOAD` and again: what
/// [`ScriptInvocation::invoke_async`](::redis::ScriptInvocation::invoke_async) does, for a
/// command built in one buffer. A NOSCRIPT means the script did not run, so calling again is
/// safe for every operation. Another flush can land between the load and the call (seen when
/// the test suite flushes scripts beside other tests), hence a few rounds rather than one.
pub(super) async fn evalsha<T: FromRedisValue>(
    op: &Op,
    cmd: &Cmd,
    conn: &mut super::conn::Connection,
) -> Result<T, RedisError> {
    let mut reloads = 0;
    loop {
        match cmd.query_async(conn).await {
            Err(e)
                if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
                    && reloads < MAX_RELOADS =>
            {
                reloads += 1;
                op.script.load_async(conn).await?;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_script_caps_the_time_to_full_as_bucket_rs_does() {
        let source = script_source("acquire").unwrap();
        let cap = crate::bucket::MAX_TTL_MICROS.to_string();
        assert!(source.contains(&format!(
            "math.min(math.ceil(missing * period / rate), {cap})"
        )));
    }

    #[test]
    fn every_operation_has_a_script_and_only_charges_never_replay() {
        for (op, name) in [
            (&ADMIT, "admit"),
            (&ADMIT_CHARGING, "admit"),
            (&ACQUIRE, "acquire"),
            (&ADMIT_HOLDING, "admit_holding"),
            (&RELEASE, "release"),
            (&RENEW, "renew"),
        ] {
            assert_eq!(op.name, name);
            assert!(script_source(name).is_some());
        }
        assert_eq!(ADMIT_CHARGING.replay, Replay::Never);
        assert_eq!(ADMIT_CHARGING.script.get_hash(), ADMIT.script.get_hash());
        assert_eq!(RECONCILE.replay, Replay::Never);
        assert!(script_source("reconcile").is_some());
        assert_eq!(PERIODS_RECONCILE.replay, Replay::Never);
        assert_eq!(ADMIT.replay, Replay::Once);
        assert_eq!(ACQUIRE.replay, Replay::Once);
        assert_eq!(RESET.replay, Replay::Once);
        for op in [&ADMIT_HOLDING, &RELEASE, &RENEW, &RUNNING] {
            assert_eq!(op.replay, Replay::Once);
        }
        assert_eq!(STATE_READ.replay, Replay::Once);
        assert_eq!(STATE_CLEAR.replay, Replay::Once);
        assert!(script_source("state_clear").is_some_and(|s| s.contains("'DEL'")));
    }
}
