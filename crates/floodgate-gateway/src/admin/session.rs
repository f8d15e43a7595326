//! Who may use the admin listener: the bearer `[admin] secret`, or a console session signed in
//! with it (docs/design.md §9).
//!
//! - A session is a cookie `floodgate_session=<expires>.<nonce>.<tag>`: the Unix second it
//!   expires, 16 random bytes, and an HMAC-SHA256 over both under a key drawn at random when
//!   the process starts. Nothing is stored per session but sign-outs; a restart draws a new key
//!   and so signs everyone out.
//! - Its CSRF token is the HMAC of its nonce under the same key: derived, not stored, and of no
//!   use without the cookie (which only the console's own pages get: `SameSite=Strict`).
//! - Every check of a presented secret (a sign-in or a bearer) takes the turn of where it comes
//!   from (its peer's IPv4 address, or IPv6 /64: a [`Source`]): a wrong secret keeps the turn
//!   for [`WRONG_SECRET_DELAY`], so that at most one guess a second per source is checked
//!   however many are sent at once, and the answer to a guess is known only once its turn
//!   came. Past [`MAX_WAITING`] attempts of one source, or [`MAX_WAITING_ALL`] of all, an
//!   attempt is refused at once (429) without being checked.
//! - Why a turn per source and not one for the process: with one, a guesser makes everyone
//!   else's right secret (a script, the `/metrics` scraper) wait up to [`MAX_WAITING`] seconds
//!   or be refused. Why not "a right secret passes at once, a wrong one waits": the answer to a
//!   guess would then come the moment it is checked (fast: right), so sending many at once
//!   would check them all at once, and the delay would bound nothing. A turn per source keeps
//!   the bound per source and tells a guesser nothing new: its own attempts are answered as
//!   before, and others' answers it never sees. What it does not bound is a guesser with many
//!   sources (docs/design.md §9): the secret's length is what makes guessing useless then.
//! - A session's cookie is checked without a turn (an HMAC cannot be guessed), so the console
//!   stays usable while someone guesses.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::http::header::COOKIE as COOKIE_HEADER;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};

/// The session cookie's name.
pub const COOKIE: &str = crate::auth::SESSION_COOKIE;
/// How long a session lasts after its sign-in.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// How long a wrong secret keeps its source's turn: one guess a second per source.
pub const WRONG_SECRET_DELAY: Duration = Duration::from_secs(1);
/// How many secret checks of one source may be waiting or checked at once; more are refused
/// unchecked.
pub const MAX_WAITING: usize = 32;
/// How many secret checks of all sources may be waiting or checked at once: what bounds the
/// memory many sources can hold.
pub const MAX_WAITING_ALL: usize = 256;

/// The most `floodgate_session` cookies of one request checked: a request can carry thousands,
/// each an HMAC to compute before any sign-in.
const MAX_SESSION_COOKIES: usize = 4;

/// Where a secret check comes from: its peer's IPv4 address, or its IPv6 address's /64 (a
/// host's addresses share it, one host holds as many of them as it likes), or an unknown
/// peer. An IPv4-mapped IPv6 address is its IPv4 one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// An IPv4 address.
    V4([u8; 4]),
    /// The first 64 bits of an IPv6 address.
    V6([u8; 8]),
    /// No peer known (a request answered without a listener).
    Unknown,
}

impl Source {
    /// The source of a peer at `ip`.
    pub fn of(ip: Option<IpAddr>) -> Source {
        match ip.map(|ip| ip.to_canonical()) {
            Some(IpAddr::V4(v4)) => Source::V4(v4.octets()),
            Some(IpAddr::V6(v6)) => {
                let mut prefix = [0u8; 8];
                prefix.copy_from_slice(&v6.octets()[..8]);
                Source::V6(prefix)
            }
            None => Source::Unknown,
        }
    }
}

/// The turns of the sources with a check waiting or under way.
#[derive(Debug, Default)]
struct Turns {
    /// Each source's turn and how many of its checks hold a place.
    by_source: HashMap<Source, (Arc<tokio::sync::Mutex<()>>, usize)>,
    /// Places held over every source.
    all: usize,
}

/// A place among the checks of `source`, given back when dropped: a check ended, or abandoned
/// while it waited (its caller went away).
struct Place<'a> {
    sessions: &'a Sessions,
    source: Source,
    turn: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut turns = self.sessions.lock_turns();
        turns.all -= 1;
        if let Some((_, held)) = turns.by_source.get_mut(&self.source) {
            *held -= 1;
            if *held == 0 {
                turns.by_source.remove(&self.source);
            }
        }
    }
}

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

/// The process's session key, its sign-outs and the turns secret checks take.
#[derive(Debug)]
pub struct Sessions {
    key: hmac::Key,
    rng: SystemRandom,
    /// Sessions signed out before they expire: nonce -> expiry.
    revoked: Mutex<HashMap<[u8; 16], u64>>,
    /// A std mutex: held only to count places, never across an `.await`.
    turns: Mutex<Turns>,
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
            turns: Mutex::new(Turns::default()),
        })
    }

    /// Checks `presented`, sent by a peer at `peer`, against the digest `want` in the turn of
    /// its [`Source`] (see the module's doc); with no secret set (`None`), nothing is right,
    /// and the turn is taken all the same.
    pub async fn check(
        &self,
        presented: &str,
        want: Option<&[u8; 32]>,
        peer: Option<IpAddr>,
    ) -> Verdict {
        let Some(place) = self.place(Source::of(peer)) else {
            return Verdict::Busy;
        };
        let _turn = place.turn.lock().await;
        // Digests compared, in constant time: equal length always, and a digest's bytes tell
        // nothing of the secret's.
        let digest = <[u8; 32]>::from(Sha256::digest(presented.as_bytes()));
        if want.is_some_and(|want| crate::auth::same_digest(&digest, want)) {
            return Verdict::Right;
        }
        tokio::time::sleep(WRONG_SECRET_DELAY).await;
        Verdict::Wrong
    }

    /// A place among `source`'s checks, if neither it nor all sources have too many.
    fn place(&self, source: Source) -> Option<Place<'_>> {
        let mut turns = self.lock_turns();
        let held = turns.by_source.get(&source).map_or(0, |(_, held)| *held);
        if held >= MAX_WAITING || turns.all >= MAX_WAITING_ALL {
            return None;
        }
        turns.all += 1;
        let (turn, held) = turns.by_source.entry(source).or_default();
        *held += 1;
        Some(Place {
            sessions: self,
            source,
            turn: Arc::clone(turn),
        })
    }

    fn lock_turns(&self) -> std::sync::MutexGuard<'_, Turns> {
        // Each change is a few counts and one insert or remove, never unwinding halfway.
        self.turns.lock().unwrap_or_else(PoisonError::into_inner)
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

    /// The session of a request's `floodgate_session` cookie at `now`, if one is valid (of its
    /// first [`MAX_SESSION_COOKIES`]).
    pub fn from_headers(&self, headers: &HeaderMap, now: u64) -> Option<Session> {
        // Read as bytes: another app's cookie on the same line (a browser sends one line for
        // every cookie of the host, whatever port set it) may hold bytes that are not text.
        headers
            .get_all(COOKIE_HEADER)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b';'))
            .filter_map(|c| {
                c.trim_ascii()
                    .strip_prefix(COOKIE.as_bytes())?
                    .strip_prefix(b"=")
            })
            .filter_map(|value| std::str::from_utf8(value).ok())
            // A browser sends a cookie of one name more than once only when paths or domains
            // differ: a few are checked, not as many as a request can carry (each is an HMAC,
            // before any sign-in).
            .take(MAX_SESSION_COOKIES)
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

    /// Only a request's first few session cookies are checked (each an HMAC before any
    /// sign-in): a valid one among them is taken, one behind a thousand forged ones is not.
    #[test]
    fn only_a_requests_first_session_cookies_are_checked() {
        let sessions = Sessions::new().unwrap();
        let (cookie, session) = sessions.issue(1_000).unwrap();
        let line = |forged: usize| {
            let mut line = format!("{COOKIE}=1.00.00; ").repeat(forged);
            line.push_str(&format!("other=x; {COOKIE}={cookie}"));
            let mut headers = HeaderMap::new();
            headers.insert(COOKIE_HEADER, line.parse().unwrap());
            headers
        };
        assert_eq!(sessions.from_headers(&line(3), 1_001), Some(session));
        assert_eq!(sessions.from_headers(&line(1_000), 1_001), None);
    }

    const GUESSER: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1)));
    const SCRAPER: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2)));

    fn digest(secret: &str) -> [u8; 32] {
        Sha256::digest(secret.as_bytes()).into()
    }

    /// Yields until `source`'s turn is taken (a check of it is under way).
    async fn taken(sessions: &Sessions, source: Source) {
        loop {
            let held = sessions
                .lock_turns()
                .by_source
                .get(&source)
                .is_some_and(|(turn, _)| turn.try_lock().is_err());
            if held {
                return;
            }
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn wrong_secrets_take_their_turn_one_a_second() {
        let sessions = Arc::new(Sessions::new().unwrap());
        let want = digest("right");
        let start = tokio::time::Instant::now();
        let guesses: Vec<_> = (0..3)
            .map(|i| {
                let s = sessions.clone();
                tokio::spawn(
                    async move { s.check(&format!("guess{i}"), Some(&want), GUESSER).await },
                )
            })
            .collect();
        for g in guesses {
            assert_eq!(g.await.unwrap(), Verdict::Wrong);
        }
        assert!(start.elapsed() >= 3 * WRONG_SECRET_DELAY, "one at a time");
        assert_eq!(
            sessions.check("right", Some(&want), GUESSER).await,
            Verdict::Right
        );
        assert_eq!(sessions.check("right", None, GUESSER).await, Verdict::Wrong);
        assert!(sessions.lock_turns().by_source.is_empty(), "no turn kept");
    }

    #[tokio::test]
    async fn a_right_secret_from_elsewhere_waits_for_no_guesser() {
        let sessions = Arc::new(Sessions::new().unwrap());
        let want = digest("right");
        let s = sessions.clone();
        let guess = tokio::spawn(async move { s.check("guess", Some(&want), GUESSER).await });
        taken(&sessions, Source::of(GUESSER)).await;
        let start = tokio::time::Instant::now();
        assert_eq!(
            sessions.check("right", Some(&want), SCRAPER).await,
            Verdict::Right
        );
        assert!(
            start.elapsed() < WRONG_SECRET_DELAY,
            "answered while the guess waits"
        );
        // From the guesser's own source a right secret waits its turn like any other attempt:
        // how long an answer takes tells nothing of the secret.
        assert_eq!(
            sessions.check("right", Some(&want), GUESSER).await,
            Verdict::Right
        );
        assert!(start.elapsed() >= WRONG_SECRET_DELAY);
        assert_eq!(guess.await.unwrap(), Verdict::Wrong);
        // An IPv4-mapped address is its IPv4 source; one /64 is one source.
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(Source::of(Some(mapped)), Source::of(GUESSER));
        let (a, b): (IpAddr, IpAddr) = (
            "2001:db8::1".parse().unwrap(),
            "2001:db8::2:1".parse().unwrap(),
        );
        assert_eq!(Source::of(Some(a)), Source::of(Some(b)));
        let other: IpAddr = "2001:db8:0:1::1".parse().unwrap();
        assert_ne!(Source::of(Some(a)), Source::of(Some(other)));
    }

    #[tokio::test]
    async fn past_the_waiting_cap_a_source_is_refused_unchecked_and_abandoned_checks_leave() {
        let sessions = Arc::new(Sessions::new().unwrap());
        let want = digest("right");
        let waiting: Vec<_> = (0..MAX_WAITING)
            .map(|_| {
                let s = sessions.clone();
                tokio::spawn(async move { s.check("guess", Some(&want), GUESSER).await })
            })
            .collect();
        taken(&sessions, Source::of(GUESSER)).await;
        while sessions.lock_turns().all < MAX_WAITING {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            sessions.check("right", Some(&want), GUESSER).await,
            Verdict::Busy
        );
        assert_eq!(
            sessions.check("right", Some(&want), SCRAPER).await,
            Verdict::Right
        );
        // Callers gone (their connections closed): their places are given back.
        for w in &waiting {
            w.abort();
        }
        for w in waiting {
            assert!(w.await.unwrap_err().is_cancelled());
        }
        assert_eq!(sessions.lock_turns().all, 0);
        assert!(sessions.lock_turns().by_source.is_empty());
        assert_eq!(
            sessions.check("right", Some(&want), GUESSER).await,
            Verdict::Right
        );
    }
}
