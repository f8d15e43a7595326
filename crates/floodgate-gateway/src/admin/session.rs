//! Who may use the admin listener: the bearer `[admin] secret`, or a console session signed in
//! with it (docs/design.md §9).
//!
//! - A session is a cookie `floodgate_session=<expires>.<nonce>.<tag>`: the Unix second it
//!   expires, 16 random bytes, and an HMAC-SHA256 over both under a key drawn at random when
//!   the process starts. Nothing is stored per session but sign-outs; a restart draws a new key
//!   and so signs everyone out.
//! - Its CSRF token is the HMAC of its nonce under the same key: derived, not stored, and of no
//!   use without the cookie (which only the console's own pages get: `SameSite=Strict`).
//! - Every check of a presented secret (a sign-in or a bearer) takes one process-wide turn: a
//!   wrong secret keeps the turn for [`WRONG_SECRET_DELAY`], so that at most one guess a
//!   second is checked however many are sent at once, and the answer to a guess is known only
//!   once its turn came. Past [`MAX_WAITING`] waiting, an attempt is refused at once (429)
//!   without being checked. A session's cookie is checked without a turn (an HMAC cannot be
//!   guessed), so the console stays usable while someone guesses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::http::header::COOKIE as COOKIE_HEADER;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};

/// The session cookie's name.
pub const COOKIE: &str = "floodgate_session";
/// How long a session lasts after its sign-in.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// How long a wrong secret keeps the turn: one guess a second, process-wide.
pub const WRONG_SECRET_DELAY: Duration = Duration::from_secs(1);
/// How many secret checks may wait for their turn; more are refused unchecked.
pub const MAX_WAITING: usize = 32;

/// A verified session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Session {
    nonce: [u8; 16],
    /// When it expires, in Unix seconds.
    pub expires: u64,
}

impl Session {
    /// The first bytes of its nonce, naming it in logs (never the cookie).
    pub fn short_id(&self) -> String {
        hex(&self.nonce[..4])
    }
}

/// What a secret check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The admin secret.
    Right,
    /// Not it (answered after its turn's delay).
    Wrong,
    /// Too many checks waiting: not checked.
    Busy,
}

/// The process's session key, its sign-outs and the turn secret checks take.
#[derive(Debug)]
pub struct Sessions {
    key: hmac::Key,
    rng: SystemRandom,
    /// Sessions signed out before they expire: nonce -> expiry.
    revoked: Mutex<HashMap<[u8; 16], u64>>,
    turn: tokio::sync::Mutex<()>,
    waiting: AtomicUsize,
}

impl Sessions {
    /// A fresh key from the system's random source; an error if there is none.
    pub fn new() -> Result<Sessions, String> {
        let rng = SystemRandom::new();
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &rng)
            .map_err(|_| "no system random source for the console's session key".to_owned())?;
        Ok(Sessions {
            key,
            rng,
            revoked: Mutex::new(HashMap::new()),
            turn: tokio::sync::Mutex::new(()),
            waiting: AtomicUsize::new(0),
        })
    }

    /// Checks `presented` against the digest `want` in its turn (see the module's doc); with
    /// no secret set (`None`), nothing is right, and the turn is taken all the same.
    pub async fn check(&self, presented: &str, want: Option<&[u8; 32]>) -> Verdict {
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= MAX_WAITING {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Verdict::Busy;
        }
        let _turn = self.turn.lock().await;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        // Digests compared: equal length always, and a digest's bytes tell nothing of the
        // secret's.
        let digest = <[u8; 32]>::from(Sha256::digest(presented.as_bytes()));
        if want.is_some_and(|want| digest == *want) {
            return Verdict::Right;
        }
        tokio::time::sleep(WRONG_SECRET_DELAY).await;
        Verdict::Wrong
    }

    /// A new session expiring [`SESSION_TTL`] after `now` (Unix seconds): its cookie value.
    pub fn issue(&self, now: u64) -> Result<(String, Session), String> {
        let mut nonce = [0u8; 16];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| "no system random source for a session".to_owned())?;
        let session = Session {
            nonce,
            expires: now + SESSION_TTL.as_secs(),
        };
        let body = format!("{}.{}", session.expires, hex(&nonce));
        let tag = hmac::sign(&self.key, body.as_bytes());
        Ok((format!("{body}.{}", hex(tag.as_ref())), session))
    }

    /// The session of cookie value `value` at `now` (Unix seconds): signed by this process,
    /// not expired, not signed out.
    pub fn verify(&self, value: &str, now: u64) -> Option<Session> {
        let (body, tag) = value.rsplit_once('.')?;
        hmac::verify(&self.key, body.as_bytes(), &unhex(tag)?).ok()?;
        let (expires, nonce) = body.split_once('.')?;
        let expires: u64 = expires.parse().ok()?;
        let nonce: [u8; 16] = unhex(nonce)?.try_into().ok()?;
        if expires <= now || self.lock_revoked().contains_key(&nonce) {
            return None;
        }
        Some(Session { nonce, expires })
    }

    /// The session of a request's `floodgate_session` cookie at `now`, if one is valid.
    pub fn from_headers(&self, headers: &HeaderMap, now: u64) -> Option<Session> {
        headers
            .get_all(COOKIE_HEADER)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
            .find_map(|value| self.verify(value, now))
    }

    /// The CSRF token of `session`.
    pub fn csrf(&self, session: &Session) -> String {
        hex(hmac::sign(&self.key, &csrf_message(session)).as_ref())
    }

    /// Whether `token` is `session`'s CSRF token (compared in constant time).
    pub fn csrf_ok(&self, session: &Session, token: &str) -> bool {
        unhex(token)
            .is_some_and(|tag| hmac::verify(&self.key, &csrf_message(session), &tag).is_ok())
    }

    /// Signs `session` out; sign-outs are kept until they would have expired anyway.
    pub fn revoke(&self, session: &Session, now: u64) {
        let mut revoked = self.lock_revoked();
        revoked.retain(|_, expires| *expires > now);
        revoked.insert(session.nonce, session.expires);
    }

    fn lock_revoked(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 16], u64>> {
        // Each change is one insert or retain: a panic cannot leave the map half-changed.
        self.revoked.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn csrf_message(session: &Session) -> Vec<u8> {
    let mut m = b"csrf.".to_vec();
    m.extend_from_slice(&session.nonce);
    m
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_verifies_until_it_expires_or_signs_out_and_only_here() {
        let sessions = Sessions::new().unwrap();
        let (cookie, session) = sessions.issue(1_000).unwrap();
        assert_eq!(sessions.verify(&cookie, 1_001), Some(session));
        assert_eq!(
            sessions.verify(&cookie, 1_000 + SESSION_TTL.as_secs()),
            None
        );
        // Another process (another key) does not take it; nor a changed expiry.
        assert_eq!(Sessions::new().unwrap().verify(&cookie, 1_001), None);
        let (expires, rest) = cookie.split_once('.').unwrap();
        let forged = format!("{}{}.{rest}", expires, 9);
        assert_eq!(sessions.verify(&forged, 1_001), None);
        assert_eq!(sessions.verify("garbage", 1_001), None);
        let csrf = sessions.csrf(&session);
        assert!(sessions.csrf_ok(&session, &csrf));
        assert!(!sessions.csrf_ok(&session, &csrf[2..]));
        let (_, other) = sessions.issue(1_000).unwrap();
        assert!(!sessions.csrf_ok(&other, &csrf));
        sessions.revoke(&session, 1_002);
        assert_eq!(sessions.verify(&cookie, 1_003), None);
    }

    #[tokio::test]
    async fn wrong_secrets_take_their_turn_one_a_second() {
        let sessions = std::sync::Arc::new(Sessions::new().unwrap());
        let want: [u8; 32] = Sha256::digest(b"right").into();
        let start = tokio::time::Instant::now();
        let guesses: Vec<_> = (0..3)
            .map(|i| {
                let s = sessions.clone();
                tokio::spawn(async move { s.check(&format!("guess{i}"), Some(&want)).await })
            })
            .collect();
        for g in guesses {
            assert_eq!(g.await.unwrap(), Verdict::Wrong);
        }
        assert!(start.elapsed() >= 3 * WRONG_SECRET_DELAY, "one at a time");
        assert_eq!(sessions.check("right", Some(&want)).await, Verdict::Right);
        assert_eq!(sessions.check("right", None).await, Verdict::Wrong);
    }
}
