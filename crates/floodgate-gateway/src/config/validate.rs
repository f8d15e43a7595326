//! Validation: the file as written ([`super::raw`]) resolved into a [`Config`], every error
//! naming the file, the line (and column) and the field.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use floodgate::{Period, ScopeKind};
use sha2::{Digest, Sha256};
use toml::Spanned;

use super::money::{MAX_BUDGET_USD, MAX_PRICE_PER_MILLION};
use super::raw::{
    RawAdmin, RawAlerts, RawBudget, RawConfig, RawKey, RawOnError, RawPrice, RawRealtime,
    RawServer, RawStore, RawUpstream,
};
use super::types::{
    AdminConfig, AlertsConfig, Backend, BudgetConfig, Config, ConfigError, DEFAULT_ADMIN_LISTEN,
    DEFAULT_HEADER_TIMEOUT_SEC, DEFAULT_LISTEN, DEFAULT_MAX_BODY_MIB, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_UPSTREAM_TIMEOUT_SEC, GATEWAY_ID, KeyConfig, Limits, MAX_LEASE_SEC,
    MAX_REALTIME_DRAIN_SEC, MAX_UPSTREAM_TIMEOUT_SEC, MIN_LEASE_SEC, OnError, OnErrorKinds,
    PriceConfig, REDIS_URL_ENV, RealtimeConfig, StoreConfig, UpstreamConfig, UpstreamTarget,
    default_max_buffered_mib,
};

/// The text of one config file being validated: what turns a span into a line and column.
pub(super) struct Validator<'a> {
    /// The file, named in every error (and the directory relative paths start from).
    pub(super) file: &'a Path,
    /// Its text.
    pub(super) text: &'a str,
}

/// `[server]`, resolved: the fields of [`Config`] it sets.
struct ServerSettings {
    listen: SocketAddr,
    /// Where `listen` is written, if it is.
    listen_span: Option<Range<usize>>,
    workers: Option<usize>,
    header_timeout: Duration,
    max_body_mib: u64,
    max_buffered_mib: u64,
    max_buffered_mib_written: bool,
    max_connections: usize,
}

/// `[[keys]]`, resolved, with what the later steps check against.
struct Keys {
    /// The keys, in the order written.
    keys: Vec<KeyConfig>,
    /// Key id -> its index in `[[keys]]`.
    ids: HashMap<String, usize>,
    /// Secret hash -> the index of its key.
    hashes: HashMap<[u8; 32], usize>,
}

impl Validator<'_> {
    fn position(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let column = before.rfind('\n').map_or(offset, |nl| offset - nl - 1) + 1;
        (line, column)
    }

    pub(super) fn error(
        &self,
        span: Range<usize>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> ConfigError {
        let (line, column) = self.position(span.start);
        ConfigError {
            file: self.file.to_path_buf(),
            line,
            column,
            field: field.into(),
            message: message.into(),
        }
    }

    /// A parse or type error from the toml crate: its span gives the line; the field is the key
    /// at that span (an unknown field) or the key assigned the value there.
    pub(super) fn toml_error(&self, e: &toml::de::Error) -> ConfigError {
        let span = e.span().unwrap_or(0..0);
        let message = e.message().trim().to_owned();
        let field = quoted_after(&message, "missing field ")
            .or_else(|| quoted_after(&message, "unknown field "))
            .or_else(|| self.key_at(span.clone()))
            .or_else(|| self.key_holding(span.start))
            .unwrap_or_else(|| "-".into());
        // "invalid type: integer `8675309`, expected a string": never echo a secret's value (a
        // key's or the admin's secret, a Redis URL's password), however the key was written
        // (`admin.secret = ...`, `"secret" = ...`), nor any value whose key is not known. Only
        // these messages echo a value (toml's own, `invalid unquoted key, expected ...`, do
        // not, and read as they are). A URL with credentials pasted into a field of a few
        // choices (`unknown variant`) is not shown either.
        let echoes = message.starts_with("invalid type") || message.starts_with("invalid value");
        let credentials = message.starts_with("unknown variant")
            && message
                .split_once("://")
                .is_some_and(|(_, rest)| rest.contains('@'));
        if ((echoes && self.may_hold_secret(&field, span.clone())) || credentials)
            && (message.contains('`') || message.contains('"'))
        {
            let expected = message
                .split_once(", expected ")
                .map_or(String::new(), |(_, e)| format!("expected {e}"));
            let message = format!("invalid value (not shown: it may be a secret); {expected}");
            return self.error(span, field, message);
        }
        self.error(span, field, message)
    }

    /// Whether the value at `span`, assigned to `field` (as [`key_at`](Self::key_at) found it),
    /// may be a secret: a field named as one (its last dotted part, quotes aside), a field not
    /// known, or a line that names a secret.
    fn may_hold_secret(&self, field: &str, span: Range<usize>) -> bool {
        const SECRETS: [&str; 4] = ["secret", "secret_sha256", "url", "urls"];
        let last = field.rsplit('.').next().unwrap_or(field).trim_matches('"');
        let start = span.start.min(self.text.len());
        let line_start = self.text[..start].rfind('\n').map_or(0, |i| i + 1);
        let line = self.text[line_start..].lines().next().unwrap_or("");
        field == "-" || SECRETS.contains(&last) || line.to_ascii_lowercase().contains("secret")
    }

    /// The innermost key whose value holds `offset`: the one an element of an array written
    /// over several lines belongs to (its own line names no key). Read from the document
    /// parsed again, which only a file that is valid TOML is.
    fn key_holding(&self, offset: usize) -> Option<String> {
        // A table's own span may be its header alone: its values are looked through whatever
        // it says.
        fn within(table: &toml::de::DeTable<'_>, offset: usize) -> Option<String> {
            table.iter().find_map(|(key, value)| match value.get_ref() {
                toml::de::DeValue::Table(t) => within(t, offset),
                v if value.span().contains(&offset) => {
                    Some(inside(v, offset).unwrap_or_else(|| key.get_ref().to_string()))
                }
                _ => None,
            })
        }
        fn inside(value: &toml::de::DeValue<'_>, offset: usize) -> Option<String> {
            match value {
                toml::de::DeValue::Table(t) => within(t, offset),
                toml::de::DeValue::Array(a) => a.iter().find_map(|v| match v.get_ref() {
                    toml::de::DeValue::Table(t) => within(t, offset),
                    other if v.span().contains(&offset) => inside(other, offset),
                    _ => None,
                }),
                _ => None,
            }
        }
        let doc = toml::de::DeTable::parse(self.text).ok()?;
        within(doc.get_ref(), offset)
    }

    /// The key written at `span`, or assigned the value at `span` (`key = <value>`).
    fn key_at(&self, span: Range<usize>) -> Option<String> {
        let is_key = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.';
        let start = span.start.min(self.text.len());
        let at: String = self.text[start..]
            .chars()
            .take_while(|&c| is_key(c))
            .collect();
        let line_start = self.text[..start].rfind('\n').map_or(0, |i| i + 1);
        let before = self.text[line_start..start].trim_end();
        if let Some(before) = before.strip_suffix('=') {
            let before = before.trim_end();
            // A quoted key (`"secret" = ...`): its text, if a plain one.
            if let Some(quoted) = before.strip_suffix('"')
                && let Some((_, key)) = quoted.rsplit_once('"')
                && !key.is_empty()
                && key.chars().all(is_key)
            {
                return Some(key.to_owned());
            }
            let key: String = before
                .chars()
                .rev()
                .take_while(|&c| is_key(c))
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            if !key.is_empty() {
                return Some(key);
            }
        }
        if !at.is_empty() && self.text[start + at.len()..].trim_start().starts_with('=') {
            return Some(at);
        }
        // A table header: `[name]` or `[[name]]`, the span at its start or inside it (a table
        // written twice is reported at its name).
        let header = self.text[line_start..].lines().next().unwrap_or("").trim();
        let name = header.trim_start_matches('[').trim_end_matches(']').trim();
        // (A line of an array written over several lines starts with `[` too: not a header.)
        let names_a_table = name.chars().all(|c| is_key(c) || c == '"' || c == ' ');
        if header.starts_with('[') && !name.is_empty() && names_a_table {
            return Some(name.to_owned());
        }
        // A broken value: the key its line assigns.
        let line = self.text[line_start..].lines().next().unwrap_or("");
        let (key, _) = line.split_once('=')?;
        let key = key.trim();
        (!key.is_empty() && key.chars().all(is_key)).then(|| key.to_owned())
    }

    /// The whole config from the file as written. The steps run in this order and each stops at
    /// its first error, which is the one reported: reordering them changes which of several
    /// errors a file is told about.
    pub(super) fn resolve(
        &self,
        raw: RawConfig,
        redis_url_env: Option<String>,
    ) -> Result<Config, ConfigError> {
        let server = self.server(raw.server)?;
        let store = self.store(raw.store, redis_url_env)?;
        let upstream = self.upstream(raw.upstream)?;
        let realtime = self.realtime(raw.realtime)?;

        let mut limits = Limits::default();
        let (tokens, default_max_output_tokens) = self.token_mode(raw.gateway.as_ref())?;
        // `[gateway] shadow = true`: every limit and budget observed, none enforced.
        let all_shadow = raw.gateway.as_ref().and_then(|g| g.shadow) == Some(true);
        self.gateway_limit(raw.gateway, &mut limits)?;
        let keys = self.keys(raw.keys, &mut limits)?;
        let alerts = self.alerts(raw.alerts, &keys.hashes, store.backend)?;
        let admin = self.admin(raw.admin, &keys.hashes, alerts.secret_sha256, &server)?;
        self.rate_limits(raw.rate_limits, &keys.ids, tokens, &mut limits)?;

        let prices = self.prices(raw.prices)?;
        let mut budgets = self.budgets(raw.budgets, &keys.ids)?;
        if all_shadow {
            limits
                .windows
                .values_mut()
                .flatten()
                .for_each(|l| l.shadow = true);
            limits.in_flight.values_mut().for_each(|l| l.shadow = true);
            budgets.values_mut().flatten().for_each(|b| b.shadow = true);
        }

        // The file was read and checked with the upstream's settings above; what it held is
        // what a later change is told from.
        let ca_file_digest = match &upstream.target {
            UpstreamTarget::Http {
                ca_file: Some(path),
                ..
            } => std::fs::read(path).ok().map(|bytes| text_digest(&bytes)),
            _ => None,
        };
        Ok(Config {
            path: self.file.to_path_buf(),
            text_digest: text_digest(self.text.as_bytes()),
            ca_file_digest,
            listen: server.listen,
            workers: server.workers,
            header_timeout: server.header_timeout,
            max_body_mib: server.max_body_mib,
            max_buffered_mib: server.max_buffered_mib,
            max_buffered_mib_written: server.max_buffered_mib_written,
            max_connections: server.max_connections,
            store,
            upstream,
            realtime,
            keys: keys.keys,
            limits: limits.windows,
            in_flight: limits.in_flight,
            alerts,
            admin,
            prices,
            budgets,
            tokens,
            default_max_output_tokens,
        })
    }

    /// `[server]`: the body cap, the bound on bodies held, the header timeout, the workers and
    /// the listen address, checked in that order.
    fn server(&self, raw: Option<RawServer>) -> Result<ServerSettings, ConfigError> {
        let s = raw.unwrap_or_default();
        let (listen, workers, header_timeout, max_body_mib, max_buffered_mib) = (
            s.listen,
            s.workers,
            s.header_timeout_sec,
            s.max_body_mib,
            s.max_buffered_mib,
        );
        let max_connections = match s.max_connections {
            Some(m) if *m.get_ref() == 0 || *m.get_ref() > 1_000_000 => {
                return Err(self.error(
                    m.span(),
                    "server.max_connections",
                    "must be between 1 and 1000000",
                ));
            }
            m => m.map_or(DEFAULT_MAX_CONNECTIONS, Spanned::into_inner),
        };
        let max_body_mib = match max_body_mib {
            Some(m) if *m.get_ref() == 0 || *m.get_ref() > 1024 => {
                return Err(self.error(
                    m.span(),
                    "server.max_body_mib",
                    "must be between 1 and 1024",
                ));
            }
            m => m.map_or(DEFAULT_MAX_BODY_MIB, Spanned::into_inner),
        };
        // A key holds at most half of the bound, and a chunked body counts twice while it is
        // read: a key's half must hold one largest body twice over.
        let least = 4 * max_body_mib;
        let max_buffered_mib_written = max_buffered_mib.is_some();
        let max_buffered_mib = match max_buffered_mib {
            Some(m) if *m.get_ref() < least || *m.get_ref() > 1 << 20 => {
                return Err(self.error(
                    m.span(),
                    "server.max_buffered_mib",
                    format!("must be between {least} (four times server.max_body_mib) and 1048576"),
                ));
            }
            Some(m) => m.into_inner(),
            None => default_max_buffered_mib().max(least),
        };
        let header_timeout = match header_timeout {
            Some(t) if *t.get_ref() == 0 || *t.get_ref() > 3600 => {
                return Err(self.error(
                    t.span(),
                    "server.header_timeout_sec",
                    "must be between 1 and 3600",
                ));
            }
            t => Duration::from_secs(t.map_or(DEFAULT_HEADER_TIMEOUT_SEC, Spanned::into_inner)),
        };
        let workers = match workers {
            Some(w) if *w.get_ref() == 0 || *w.get_ref() > 1024 => {
                return Err(self.error(w.span(), "server.workers", "must be between 1 and 1024"));
            }
            w => w.map(Spanned::into_inner),
        };
        let listen_span = listen.as_ref().map(Spanned::span);
        let listen = match listen {
            None => DEFAULT_LISTEN
                .parse()
                .map_err(|_| self.error(0..0, "server.listen", "bad built-in default"))?,
            Some(l) => l.get_ref().parse().map_err(|_| {
                self.error(
                    l.span(),
                    "server.listen",
                    format!("`{}` is not an address like 127.0.0.1:8080", l.get_ref()),
                )
            })?,
        };
        Ok(ServerSettings {
            listen,
            listen_span,
            workers,
            header_timeout,
            max_body_mib,
            max_buffered_mib,
            max_buffered_mib_written,
            max_connections,
        })
    }

    /// `[[keys]]`, in the order written: each key's id, secret, groups and `rate_limit` (merged
    /// into `limits`).
    fn keys(&self, raw: Vec<Spanned<RawKey>>, limits: &mut Limits) -> Result<Keys, ConfigError> {
        let mut keys = Vec::with_capacity(raw.len());
        let mut ids: HashMap<String, usize> = HashMap::new();
        let mut hashes: HashMap<[u8; 32], usize> = HashMap::new();
        for (i, k) in raw.into_iter().enumerate() {
            let span = k.span();
            let k = k.into_inner();
            let field = |f: &str| format!("keys[{i}].{f}");
            let id = k.id.get_ref().trim().to_owned();
            if id.is_empty() {
                return Err(self.error(k.id.span(), field("id"), "a key id must not be empty"));
            }
            if let Some(first) = ids.insert(id.clone(), i) {
                return Err(self.error(
                    k.id.span(),
                    field("id"),
                    format!("duplicate key id `{id}` (also keys[{first}])"),
                ));
            }
            let secret_sha256 = self
                .secret(k.secret.as_ref(), k.secret_sha256.as_ref(), &field(""))?
                .ok_or_else(|| {
                    self.error(
                        span.clone(),
                        field("secret"),
                        "a key needs `secret` or `secret_sha256`",
                    )
                })?;
            if let Some(first) = hashes.insert(secret_sha256, i) {
                let (at, name) = match (&k.secret, &k.secret_sha256) {
                    (Some(s), _) => (s.span(), "secret"),
                    (None, Some(h)) => (h.span(), "secret_sha256"),
                    (None, None) => (span.clone(), "secret"),
                };
                return Err(self.error(
                    at,
                    field(name),
                    format!("two keys share one secret (also keys[{first}])"),
                ));
            }
            let attr =
                |name: &str, v: Option<Spanned<String>>| -> Result<Option<String>, ConfigError> {
                    match v {
                        None => Ok(None),
                        Some(v) if v.get_ref().trim().is_empty() => {
                            Err(self.error(v.span(), field(name), "must not be empty"))
                        }
                        // Trimmed like key ids: `org = "acme "` is org acme, not a second org.
                        Some(v) => Ok(Some(v.get_ref().trim().to_owned())),
                    }
                };
            let org = attr("org", k.org)?;
            let team_span = k
                .team
                .as_ref()
                .or(k.project.as_ref())
                .or(k.business_unit.as_ref())
                .map(|s| s.span());
            let team = attr("team", k.team)?;
            let project = attr("project", k.project)?;
            let business_unit = attr("business_unit", k.business_unit)?;
            if let (None, Some(s)) = (&org, team_span) {
                // Team, project and business unit counters are kept per org (the chain's
                // hash tag); without an org they would silently not be shared between keys.
                return Err(self.error(
                    s,
                    field("org"),
                    "a key with a team, project or business_unit must name its org",
                ));
            }
            if let Some(w) = k.rate_limit {
                self.seed_limit(
                    &w,
                    &field("rate_limit"),
                    (ScopeKind::Key, id.clone()),
                    limits,
                )?;
            }
            keys.push(KeyConfig {
                id,
                secret_sha256,
                org,
                team,
                project,
                business_unit,
            });
        }
        Ok(Keys { keys, ids, hashes })
    }

    /// `[alerts]`: where the refusal tally is kept, how often it is flushed, and the secret
    /// `GET /alerts` asks for (which no key may share: a key's holder must not read the alerts).
    fn alerts(
        &self,
        raw: Option<RawAlerts>,
        key_hashes: &HashMap<[u8; 32], usize>,
        backend: Backend,
    ) -> Result<AlertsConfig, ConfigError> {
        let mut alerts = AlertsConfig::default();
        let Some(raw) = raw else {
            return Ok(alerts);
        };
        if let Some(p) = raw.path {
            if backend.is_redis() {
                return Err(self.error(
                    p.span(),
                    "alerts.path",
                    "on the redis store the tally is kept in Redis, one for every replica: remove `path`",
                ));
            }
            if p.get_ref().trim().is_empty() {
                return Err(self.error(p.span(), "alerts.path", "must not be empty"));
            }
            // Relative to the config file, as `upstream.ca_file` is.
            let path = match self.file.parent() {
                Some(dir) => dir.join(p.get_ref()),
                None => PathBuf::from(p.get_ref()),
            };
            let dir = match path.parent() {
                Some(d) if d.as_os_str().is_empty() => Path::new("."),
                Some(d) => d,
                None => Path::new("."),
            };
            if !dir.is_dir() {
                return Err(self.error(
                    p.span(),
                    "alerts.path",
                    format!("the directory {} does not exist", dir.display()),
                ));
            }
            if path.is_dir() {
                return Err(self.error(
                    p.span(),
                    "alerts.path",
                    format!("{} is a directory; name a file", path.display()),
                ));
            }
            alerts.path = Some(path);
        }
        if let Some(f) = raw.flush_sec {
            if !(1..=3600).contains(f.get_ref()) {
                return Err(self.error(f.span(), "alerts.flush_sec", "must be between 1 and 3600"));
            }
            alerts.flush_every = Duration::from_secs(*f.get_ref());
        }
        if let Some(r) = raw.retention_days {
            if !(1..=3660).contains(r.get_ref()) {
                return Err(self.error(
                    r.span(),
                    "alerts.retention_days",
                    "must be between 1 and 3660",
                ));
            }
            alerts.retention_days = *r.get_ref();
        }
        alerts.secret_sha256 =
            self.secret(raw.secret.as_ref(), raw.secret_sha256.as_ref(), "alerts.")?;
        if let Some(i) = alerts.secret_sha256.and_then(|h| key_hashes.get(&h)) {
            let (span, name) = match (&raw.secret, &raw.secret_sha256) {
                (Some(s), _) => (s.span(), "alerts.secret"),
                (None, Some(h)) => (h.span(), "alerts.secret_sha256"),
                (None, None) => (0..0, "alerts.secret"),
            };
            return Err(self.error(
                span,
                name,
                format!("keys[{i}] has the same secret: give the alerts one of their own"),
            ));
        }
        Ok(alerts)
    }

    /// `[admin]`: its listen address (loopback by default), its secret (never a key's, nor the
    /// alerts' `alerts`), and whether `/metrics` asks for it (then it must be set).
    fn admin(
        &self,
        raw: Option<RawAdmin>,
        key_hashes: &HashMap<[u8; 32], usize>,
        alerts: Option<[u8; 32]>,
        server: &ServerSettings,
    ) -> Result<Option<AdminConfig>, ConfigError> {
        let Some(raw) = raw else {
            return Ok(None);
        };
        let listen = match &raw.listen {
            None => DEFAULT_ADMIN_LISTEN
                .parse()
                .map_err(|_| self.error(0..0, "admin.listen", "bad built-in default"))?,
            Some(l) => l.get_ref().parse().map_err(|_| {
                self.error(
                    l.span(),
                    "admin.listen",
                    format!("`{}` is not an address like 127.0.0.1:9090", l.get_ref()),
                )
            })?,
        };
        // Bound before the gateway's own listener, the admin one would take its port: `serve`
        // could never start.
        if overlap(listen, server.listen) {
            let (span, field) = match (&raw.listen, &server.listen_span) {
                (Some(l), _) => (l.span(), "admin.listen"),
                (None, Some(s)) => (s.clone(), "server.listen"),
                (None, None) => (0..0, "admin.listen"),
            };
            return Err(self.error(
                span,
                field,
                format!(
                    "the admin listener ({listen}) and the gateway ({}) cannot listen on one port: give [admin] listen another",
                    server.listen
                ),
            ));
        }
        let secret_sha256 =
            self.secret(raw.secret.as_ref(), raw.secret_sha256.as_ref(), "admin.")?;
        let secret_span = || match (&raw.secret, &raw.secret_sha256) {
            (Some(s), _) => (s.span(), "admin.secret"),
            (None, Some(h)) => (h.span(), "admin.secret_sha256"),
            (None, None) => (0..0, "admin.secret"),
        };
        if let Some(i) = secret_sha256.and_then(|h| key_hashes.get(&h)) {
            let (span, name) = secret_span();
            return Err(self.error(
                span,
                name,
                format!("keys[{i}] has the same secret: give the admin listener one of its own"),
            ));
        }
        if secret_sha256.is_some() && secret_sha256 == alerts {
            // `/alerts` answers on the callers' port, without the admin listener's pause
            // between wrong guesses: the same secret there could be guessed at full speed.
            let (span, name) = secret_span();
            return Err(self.error(
                span,
                name,
                "[alerts] has the same secret: give the admin listener one of its own",
            ));
        }
        let metrics_auth = raw.metrics_auth.as_ref().is_some_and(|m| *m.get_ref());
        if let (true, None, Some(m)) = (metrics_auth, secret_sha256, &raw.metrics_auth) {
            return Err(self.error(
                m.span(),
                "admin.metrics_auth",
                "asks /metrics for the admin secret, but [admin] sets none: add `secret`",
            ));
        }
        let mut hosts = Vec::new();
        for h in raw.hosts.iter().flat_map(|h| h.get_ref()) {
            let name = h.get_ref().trim().to_ascii_lowercase();
            let plain = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-'));
            if !plain {
                return Err(self.error(
                    h.span(),
                    "admin.hosts",
                    format!(
                        "`{}` is not a host name (letters, digits, `.` and `-`; no port)",
                        h.get_ref()
                    ),
                ));
            }
            hosts.push(name);
        }
        Ok(Some(AdminConfig {
            listen,
            hosts,
            secret_sha256,
            metrics_auth,
        }))
    }

    /// The scope and id a `[[rate_limits]]` or `[[budgets]]` entry (at `span`, fields under
    /// `prefix`) names: a known scope kind; an id, trimmed, that the gateway scope may omit and
    /// every other needs (`needs`, with `{kind}` for the kind, says so); a customer id that a
    /// header can carry; a key id that `[[keys]]` has.
    pub(super) fn scope_target(
        &self,
        scope: &Spanned<String>,
        id: Option<Spanned<String>>,
        span: Range<usize>,
        prefix: &str,
        needs: &str,
        keys: &HashMap<String, usize>,
    ) -> Result<(ScopeKind, String), ConfigError> {
        let field = |f: &str| format!("{prefix}{f}");
        let kind = ScopeKind::parse(scope.get_ref().trim()).ok_or_else(|| {
            self.error(
                scope.span(),
                field("scope"),
                format!(
                    "unknown scope `{}`: expected key, project, team, business_unit, org, customer or gateway",
                    scope.get_ref()
                ),
            )
        })?;
        let id_span = id.as_ref().map_or(span.clone(), |id| id.span());
        let id = match (kind, id) {
            (ScopeKind::Gateway, None) => GATEWAY_ID.to_owned(),
            (ScopeKind::Gateway, Some(id)) if id.get_ref() != GATEWAY_ID => {
                return Err(self.error(
                    id.span(),
                    field("id"),
                    "the gateway scope has no id (omit it, or write \"gateway\")",
                ));
            }
            (_, Some(id)) if !id.get_ref().trim().is_empty() => id.get_ref().trim().to_owned(),
            (_, Some(id)) => {
                return Err(self.error(id.span(), field("id"), "must not be empty"));
            }
            (_, None) => {
                let needs = needs.replace("{kind}", kind.as_str());
                return Err(self.error(span, field("id"), format!("a `{kind}` {needs}")));
            }
        };
        // The header that names a customer carries visible ASCII (and spaces) only: an entry
        // on any other id could never apply.
        if kind == ScopeKind::Customer && !id.bytes().all(|b| (b' '..=b'~').contains(&b)) {
            return Err(self.error(
                id_span,
                field("id"),
                format!(
                    "a customer id is visible ASCII (the X-Floodgate-Customer header carries no other): no request could name `{id}`"
                ),
            ));
        }
        if kind == ScopeKind::Key && !keys.contains_key(&id) {
            return Err(self.error(
                id_span,
                field("id"),
                format!("no [[keys]] entry has id `{id}`"),
            ));
        }
        Ok((kind, id))
    }

    /// The SHA-256 of a bearer secret given as `secret` or as `secret_sha256` (`None`: neither);
    /// `prefix` is the fields' path (`keys[0].`).
    fn secret(
        &self,
        secret: Option<&Spanned<String>>,
        secret_sha256: Option<&Spanned<String>>,
        prefix: &str,
    ) -> Result<Option<[u8; 32]>, ConfigError> {
        let field = |f: &str| format!("{prefix}{f}");
        match (secret, secret_sha256) {
            (Some(s), None) => {
                if s.get_ref().is_empty() {
                    return Err(self.error(
                        s.span(),
                        field("secret"),
                        "a secret must not be empty",
                    ));
                }
                // A bearer token is visible ASCII, and the gateway trims the one it reads: any
                // other secret could never authenticate.
                if !s.get_ref().bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(self.error(
                        s.span(),
                        field("secret"),
                        "a secret holds visible ASCII only (no spaces, no other characters): no bearer token could match this one",
                    ));
                }
                Ok(Some(Sha256::digest(s.get_ref().as_bytes()).into()))
            }
            (None, Some(h)) => parse_sha256(h.get_ref()).map(Some).ok_or_else(|| {
                self.error(
                    h.span(),
                    field("secret_sha256"),
                    "expected 64 hex digits (the SHA-256 of the secret)",
                )
            }),
            (Some(s), Some(_)) => Err(self.error(
                s.span(),
                field("secret"),
                "set either `secret` or `secret_sha256`, not both",
            )),
            (None, None) => Ok(None),
        }
    }

    /// A non-negative, finite amount of dollars at most `max`.
    fn dollars(&self, v: &Spanned<f64>, field: String, max: f64) -> Result<f64, ConfigError> {
        let x = *v.get_ref();
        if !x.is_finite() || x < 0.0 {
            return Err(self.error(
                v.span(),
                field,
                format!("must be a finite amount of USD, at least 0 (got {x})"),
            ));
        }
        if x > max {
            return Err(self.error(v.span(), field, format!("must be at most {max}")));
        }
        Ok(x)
    }

    fn prices(&self, raw: Vec<Spanned<RawPrice>>) -> Result<Vec<PriceConfig>, ConfigError> {
        let mut seen: HashMap<String, usize> = HashMap::new();
        let mut prices = Vec::with_capacity(raw.len());
        for (i, p) in raw.into_iter().enumerate() {
            let p = p.into_inner();
            let field = |f: &str| format!("prices[{i}].{f}");
            let model = p.model.get_ref().trim().to_owned();
            if model.is_empty() {
                return Err(self.error(p.model.span(), field("model"), "must not be empty"));
            }
            if let Some(first) = seen.insert(model.clone(), i) {
                return Err(self.error(
                    p.model.span(),
                    field("model"),
                    format!("prices[{first}] already prices `{model}`"),
                ));
            }
            // USD per million tokens is micro-USD per token; kept as pico-USD per token, an
            // integer, so that a cost is exact (0.15 * 100 is not 15 in floating point).
            let pico = |v: &Spanned<f64>, name: &str| -> Result<u64, ConfigError> {
                let x = self.dollars(v, field(name), MAX_PRICE_PER_MILLION)?;
                let pico = (x * 1e6).round() as u64;
                if x > 0.0 && pico == 0 {
                    // It would price as free, which a price above 0 does not say.
                    return Err(self.error(
                        v.span(),
                        field(name),
                        "is below the price table's precision (0.000001 USD per million \
                         tokens): write 0 for free",
                    ));
                }
                Ok(pico)
            };
            prices.push(PriceConfig {
                model,
                input_pico: pico(&p.input_per_million, "input_per_million")?,
                output_pico: pico(&p.output_per_million, "output_per_million")?,
            });
        }
        Ok(prices)
    }

    fn budgets(
        &self,
        raw: Vec<Spanned<RawBudget>>,
        keys: &HashMap<String, usize>,
    ) -> Result<BTreeMap<(ScopeKind, String), Vec<BudgetConfig>>, ConfigError> {
        let mut budgets: BTreeMap<(ScopeKind, String), Vec<BudgetConfig>> = BTreeMap::new();
        let mut seen: HashMap<(ScopeKind, String, Period), usize> = HashMap::new();
        for (i, b) in raw.into_iter().enumerate() {
            let span = b.span();
            let b = b.into_inner();
            let field = |f: &str| format!("budgets[{i}].{f}");
            let (kind, id) = self.scope_target(
                &b.scope,
                b.id,
                span,
                &format!("budgets[{i}]."),
                "budget needs the id of the {kind} it caps",
                keys,
            )?;
            let period = Period::parse(b.period.get_ref().trim()).ok_or_else(|| {
                self.error(
                    b.period.span(),
                    field("period"),
                    format!(
                        "unknown period `{}`: expected \"day\" or \"month\" (calendar periods in UTC)",
                        b.period.get_ref()
                    ),
                )
            })?;
            let usd = self.dollars(&b.usd, field("usd"), MAX_BUDGET_USD)?;
            let micro_usd = (usd * 1e6).round() as u64;
            if usd > 0.0 && micro_usd == 0 {
                // It would cap at 0, refusing everything, which a budget above 0 does not say.
                return Err(self.error(
                    b.usd.span(),
                    field("usd"),
                    "is below a budget's precision (0.000001 USD): write 0 to refuse everything",
                ));
            }
            if let Some(first) = seen.insert((kind, id.clone(), period), i) {
                return Err(self.error(
                    b.period.span(),
                    field("period"),
                    format!("budgets[{first}] already caps this {kind} per {period}"),
                ));
            }
            budgets.entry((kind, id)).or_default().push(BudgetConfig {
                period,
                micro_usd,
                shadow: b.shadow.unwrap_or(false),
            });
        }
        Ok(budgets)
    }

    fn realtime(&self, raw: Option<RawRealtime>) -> Result<RealtimeConfig, ConfigError> {
        let mut out = RealtimeConfig::default();
        let Some(raw) = raw else {
            return Ok(out);
        };
        // Each field: its value within `min..=max`, or an error naming it.
        let ranged = |v: &Spanned<i64>, field: &str, min: i64, max: i64| {
            let n = *v.get_ref();
            if (min..=max).contains(&n) {
                Ok(n.unsigned_abs())
            } else {
                Err(self.error(
                    v.span(),
                    format!("realtime.{field}"),
                    format!("must be between {min} and {max}"),
                ))
            }
        };
        if let Some(v) = &raw.max_connections {
            let n = ranged(v, "max_connections", 1, 1_000_000)?;
            out.max_connections = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(v) = &raw.flush_sec {
            out.flush = Duration::from_secs(ranged(v, "flush_sec", 1, 3600)?);
        }
        if let Some(v) = &raw.drain_sec {
            let max = i64::try_from(MAX_REALTIME_DRAIN_SEC).unwrap_or(i64::MAX);
            out.drain = Duration::from_secs(ranged(v, "drain_sec", 0, max)?);
        }
        Ok(out)
    }

    fn store(
        &self,
        raw: Option<RawStore>,
        env_url: Option<String>,
    ) -> Result<StoreConfig, ConfigError> {
        let (backend, url, urls, on_error, prefix, lease_sec) = match raw {
            None => (None, None, None, None, None, None),
            Some(s) => (s.backend, s.url, s.urls, s.on_error, s.prefix, s.lease_sec),
        };
        let lease = match lease_sec {
            None => floodgate::store::redis::DEFAULT_LEASE,
            Some(s) if (MIN_LEASE_SEC..=MAX_LEASE_SEC).contains(s.get_ref()) => {
                Duration::from_secs(*s.get_ref())
            }
            Some(s) => {
                return Err(self.error(
                    s.span(),
                    "store.lease_sec",
                    format!("must be {MIN_LEASE_SEC} to {MAX_LEASE_SEC} seconds"),
                ));
            }
        };
        let backend_span = backend.as_ref().map(|b| b.span());
        let backend = backend.map_or(Backend::Memory, Spanned::into_inner);
        // A Redis URL on the memory store would be ignored, and each replica would then count
        // alone, letting N times every limit through: almost surely a forgotten `backend`.
        if let (Backend::Memory, Some(u)) = (backend, &url) {
            return Err(self.error(
                u.span(),
                "store.url",
                "a Redis URL, but the store is memory (the default): add `backend = \"redis\"`, or remove `url`",
            ));
        }
        if let Some(u) = &url {
            let ok = u.get_ref().starts_with("redis://")
                || u.get_ref().starts_with("rediss://")
                || u.get_ref().starts_with("unix://");
            if !ok {
                return Err(self.error(
                    u.span(),
                    "store.url",
                    "expected a redis://, rediss:// or unix:// URL",
                ));
            }
        }
        // The URL as `serve` will read it: a bad one is a config error here, not a failure at
        // start. (An environment URL is only checked when the Redis backend will use it.)
        let check = |u: &str| {
            floodgate::store::redis::RedisConfig::new(u)
                .check_url()
                .map_err(|e| e.to_string())
        };
        if let Some(u) = &url
            && let Err(e) = check(u.get_ref())
        {
            return Err(self.error(u.span(), "store.url", e));
        }
        if backend == Backend::Redis
            && let Some(u) = &env_url
            && let Err(e) = check(u)
        {
            return Err(self.error(
                backend_span.clone().unwrap_or(0..0),
                "store.url",
                format!("{REDIS_URL_ENV}: {e}"),
            ));
        }
        let urls =
            self.cluster_urls(backend, backend_span.clone(), url.as_ref(), urls, &env_url)?;
        if backend == Backend::RedisCluster
            && let Some(p) = &prefix
            && p.contains(['{', '}'])
        {
            return Err(self.error(
                backend_span.clone().unwrap_or(0..0),
                "store.prefix",
                "a prefix with `{` or `}` is a hash tag of its own: every key would lie in one cluster slot",
            ));
        }
        let url = match backend {
            Backend::RedisCluster => None,
            _ => env_url.or(url.map(Spanned::into_inner)),
        };
        if backend == Backend::Redis && url.is_none() {
            return Err(self.error(
                backend_span.unwrap_or(0..0),
                "store.url",
                format!("the redis backend needs `url` (or {REDIS_URL_ENV})"),
            ));
        }
        let by_kind = match on_error {
            None => OnErrorKinds::all(OnError::Open),
            Some(RawOnError::Plain(mode)) => OnErrorKinds::all(mode),
            // A kind left out fails open, as the plain form's default.
            Some(RawOnError::ByKind(k)) => OnErrorKinds {
                requests: k.requests.unwrap_or(OnError::Open),
                tokens: k.tokens.unwrap_or(OnError::Open),
                budgets: k.budgets.unwrap_or(OnError::Open),
            },
        };
        Ok(StoreConfig {
            backend,
            url,
            urls,
            on_error: by_kind.uniform().unwrap_or(OnError::Closed),
            on_error_by_kind: by_kind,
            prefix,
            lease,
        })
    }

    /// The seeds of the `redis-cluster` backend: `urls` (or `FLOODGATE_REDIS_URL`, seeds
    /// separated by commas), each a `redis://` or `rediss://` URL; `url` is refused there, and
    /// `urls` anywhere else.
    fn cluster_urls(
        &self,
        backend: Backend,
        backend_span: Option<Range<usize>>,
        url: Option<&Spanned<String>>,
        urls: Option<Spanned<Vec<Spanned<String>>>>,
        env_url: &Option<String>,
    ) -> Result<Vec<String>, ConfigError> {
        if backend != Backend::RedisCluster {
            return match urls {
                Some(u) => Err(self.error(
                    u.span(),
                    "store.urls",
                    "seed nodes are for `backend = \"redis-cluster\"`; one server takes `url`",
                )),
                None => Ok(Vec::new()),
            };
        }
        if let Some(u) = url {
            return Err(self.error(
                u.span(),
                "store.url",
                "the redis-cluster backend takes `urls`, its seed nodes: `urls = [\"redis://host:port\", ...]`",
            ));
        }
        let check = |seeds: &[String]| {
            floodgate::store::redis::RedisConfig::cluster(seeds.iter().cloned())
                .check_url()
                .map_err(|e| e.to_string())
        };
        if let Some(env) = env_url {
            let seeds: Vec<String> = env.split(',').map(|s| s.trim().to_owned()).collect();
            return match check(&seeds) {
                Ok(()) => Ok(seeds),
                Err(e) => Err(self.error(
                    backend_span.unwrap_or(0..0),
                    "store.urls",
                    format!("{REDIS_URL_ENV}: {e}"),
                )),
            };
        }
        let Some(urls) = urls else {
            return Err(self.error(
                backend_span.unwrap_or(0..0),
                "store.urls",
                format!(
                    "the redis-cluster backend needs `urls`, its seed nodes (or {REDIS_URL_ENV})"
                ),
            ));
        };
        if urls.get_ref().is_empty() {
            return Err(self.error(urls.span(), "store.urls", "needs at least one seed node"));
        }
        let mut seeds = Vec::with_capacity(urls.get_ref().len());
        for u in urls.into_inner() {
            let ok = u.get_ref().starts_with("redis://") || u.get_ref().starts_with("rediss://");
            if !ok {
                return Err(self.error(
                    u.span(),
                    "store.urls",
                    "expected a redis:// or rediss:// URL",
                ));
            }
            if let Err(e) = check(std::slice::from_ref(u.get_ref())) {
                return Err(self.error(u.span(), "store.urls", e));
            }
            seeds.push(u.into_inner());
        }
        Ok(seeds)
    }

    fn upstream(&self, raw: Spanned<RawUpstream>) -> Result<UpstreamConfig, ConfigError> {
        let span = raw.span();
        let raw = raw.into_inner();
        let timeout = match raw.timeout_sec {
            // The deadline is now plus this, on a clock that panics past its range: a "for
            // ever" (`u64::MAX`) would bring down every upload streamed to the upstream.
            Some(t) if *t.get_ref() == 0 || *t.get_ref() > MAX_UPSTREAM_TIMEOUT_SEC => {
                return Err(self.error(
                    t.span(),
                    "upstream.timeout_sec",
                    format!("must be between 1 and {MAX_UPSTREAM_TIMEOUT_SEC}"),
                ));
            }
            Some(t) => Duration::from_secs(t.into_inner()),
            None => Duration::from_secs(DEFAULT_UPSTREAM_TIMEOUT_SEC),
        };
        let demo = raw.demo.as_ref().is_some_and(|d| *d.get_ref());
        let target = match (demo, raw.base_url) {
            (true, Some(b)) => {
                return Err(self.error(
                    b.span(),
                    "upstream.base_url",
                    "set either `base_url` or `demo = true`, not both",
                ));
            }
            (true, None) => {
                if let Some(k) = raw.api_key_env {
                    return Err(self.error(
                        k.span(),
                        "upstream.api_key_env",
                        "the demo upstream takes no API key",
                    ));
                }
                if let Some(c) = raw.ca_file {
                    return Err(self.error(
                        c.span(),
                        "upstream.ca_file",
                        "the demo upstream takes no CA file",
                    ));
                }
                UpstreamTarget::Demo
            }
            (false, None) => {
                return Err(self.error(
                    span,
                    "upstream.base_url",
                    "set `base_url` (an http:// or https:// URL) or `demo = true`",
                ));
            }
            (false, Some(b)) => {
                let url = b.get_ref().trim_end_matches('/');
                let (tls, rest) = match (url.strip_prefix("http://"), url.strip_prefix("https://"))
                {
                    (Some(rest), _) => (false, rest),
                    (_, Some(rest)) => (true, rest),
                    (None, None) => {
                        return Err(self.error(
                            b.span(),
                            "upstream.base_url",
                            "expected an http:// or https:// URL",
                        ));
                    }
                };
                let authority = rest.split('/').next().unwrap_or("");
                // `user:password@host` would be sent as the Host header, and printed by
                // check-config: the upstream's credentials belong in `api_key_env`.
                if authority.contains('@') {
                    return Err(self.error(
                        b.span(),
                        "upstream.base_url",
                        "credentials in the URL are not supported: give the upstream's key \
                         with `api_key_env`",
                    ));
                }
                if rest.contains(['?', '#']) {
                    // Not echoed: a query may carry a key (`?key=...`).
                    return Err(self.error(
                        b.span(),
                        "upstream.base_url",
                        "a query or fragment is not allowed (the request's own path and query are appended to the base URL); the URL is not shown: it may carry a key",
                    ));
                }
                // `http::Uri` takes any port, and an unreadable one becomes the scheme's default
                // at connect time: `:90000` or `:abc` would reach port 80 or 443.
                let port = match authority.strip_prefix('[') {
                    Some(v6) => v6
                        .split_once(']')
                        .and_then(|(_, after)| after.strip_prefix(':')),
                    None => authority.rsplit_once(':').map(|(_, p)| p),
                };
                let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0));
                let valid = !authority.is_empty()
                    && port_ok
                    && !rest.contains(' ')
                    && url.parse::<axum::http::Uri>().is_ok();
                if !valid {
                    return Err(self.error(
                        b.span(),
                        "upstream.base_url",
                        format!(
                            "`{}` is not a URL like http://127.0.0.1:9000 or https://api.example.com",
                            b.get_ref()
                        ),
                    ));
                }
                let api_key_env = match raw.api_key_env {
                    Some(k) if k.get_ref().is_empty() => {
                        return Err(self.error(
                            k.span(),
                            "upstream.api_key_env",
                            "must not be empty",
                        ));
                    }
                    // Not echoed: a value that is no variable name may be the key itself,
                    // pasted where its variable's name belongs.
                    Some(k) if !is_env_name(k.get_ref()) => {
                        return Err(self.error(
                            k.span(),
                            "upstream.api_key_env",
                            "expected the name of an environment variable (letters, digits and `_`, such as UPSTREAM_API_KEY), not the key itself",
                        ));
                    }
                    k => k.map(Spanned::into_inner),
                };
                let ca_file = match raw.ca_file {
                    None => None,
                    Some(c) if !tls => {
                        return Err(self.error(
                            c.span(),
                            "upstream.ca_file",
                            "a CA file is for https:// upstreams only",
                        ));
                    }
                    Some(c) if c.get_ref().trim().is_empty() => {
                        return Err(self.error(c.span(), "upstream.ca_file", "must not be empty"));
                    }
                    Some(c) => {
                        // Relative to the config file, so a config and its CA file move together.
                        let path = match self.file.parent() {
                            Some(dir) => dir.join(c.get_ref()),
                            None => PathBuf::from(c.get_ref()),
                        };
                        // Read now so that `check-config` catches a bad file; `serve` reads it
                        // again when it builds the TLS config.
                        crate::tls::ca_file_roots(&path)
                            .map_err(|e| self.error(c.span(), "upstream.ca_file", e))?;
                        Some(path)
                    }
                };
                UpstreamTarget::Http {
                    base_url: url.to_owned(),
                    api_key_env,
                    ca_file,
                }
            }
        };
        Ok(UpstreamConfig { target, timeout })
    }
}

/// Whether sockets bound to `a` and to `b` would take the same port: one port (not 0, which
/// the system picks afresh for each), on one address or on a wildcard that covers the other's
/// (`[::]` covers IPv4 too, as Linux binds it).
fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    let covers =
        |w: SocketAddr, o: SocketAddr| w.ip().is_unspecified() && (w.is_ipv6() || o.is_ipv4());
    a.port() == b.port() && a.port() != 0 && (a.ip() == b.ip() || covers(a, b) || covers(b, a))
}

/// A digest of a config file's text: the reload watcher compares it with the running config's
/// [`Config::text_digest`] (docs/design.md §7).
pub fn text_digest(text: &[u8]) -> u64 {
    let hash = Sha256::digest(text);
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash[..8]);
    u64::from_le_bytes(first)
}

fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    // `from_str_radix` alone would take a sign (`+a` as 0x0a).
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Whether `name` can name an environment variable: letters, digits and `_`, not starting with
/// a digit.
fn is_env_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// The text between backticks right after `prefix` in `message`.
fn quoted_after(message: &str, prefix: &str) -> Option<String> {
    let rest = &message[message.find(prefix)? + prefix.len()..];
    let rest = rest.strip_prefix('`')?;
    Some(rest[..rest.find('`')?].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env("test.toml", text, None)
    }

    #[test]
    fn unknown_field_names_line_and_field() {
        let e = parse("[upstream]\ndemo = true\n\n[server]\nlisten = \"127.0.0.1:1\"\nport = 3\n")
            .unwrap_err();
        assert_eq!(e.line, 6, "{e}");
        assert_eq!(e.field, "port");
    }

    #[test]
    fn type_error_names_the_key() {
        let e = parse("[upstream]\ndemo = true\n[[rate_limits]]\nscope = \"org\"\nid = \"x\"\nrpm = \"ten\"\n")
            .unwrap_err();
        assert_eq!(e.line, 6, "{e}");
        assert_eq!(e.field, "rpm");
    }

    #[test]
    fn redis_url_from_the_environment_wins() {
        let text =
            "[store]\nbackend = \"redis\"\nurl = \"redis://file:6379\"\n[upstream]\ndemo = true\n";
        let c = Config::parse_with_env("t.toml", text, Some("redis://env:6379".into())).unwrap();
        assert_eq!(c.store.url.as_deref(), Some("redis://env:6379"));
        let text = "[store]\nbackend = \"redis\"\n[upstream]\ndemo = true\n";
        let c = Config::parse_with_env("t.toml", text, Some("redis://env:6379".into())).unwrap();
        assert_eq!(c.store.url.as_deref(), Some("redis://env:6379"));
    }

    #[test]
    fn a_redis_cluster_takes_seed_nodes_and_names_each_mistake() {
        let store = |body: &str| {
            format!("[upstream]\ndemo = true\n[store]\nbackend = \"redis-cluster\"\n{body}")
        };
        let c = parse(&store("urls = [\"redis://a:7000\", \"redis://b:7001\"]\n")).unwrap();
        assert_eq!(c.store.backend, Backend::RedisCluster);
        assert_eq!(c.store.urls, ["redis://a:7000", "redis://b:7001"]);
        assert_eq!(c.store.url, None);
        let e = parse(&store("")).unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (4, "store.urls"), "{e}");
        assert!(e.message.contains("seed nodes"), "{e}");
        let e = parse(&store("url = \"redis://a:7000\"\n")).unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (5, "store.url"), "{e}");
        let e = parse(&store("urls = []\n")).unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (5, "store.urls"), "{e}");
        let e = parse(&store(
            "urls = [\"redis://a:7000\",\n  \"http://b:7001\"]\n",
        ))
        .unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (6, "store.urls"), "{e}");
        let e = parse(&store("urls = [\"redis://a:7000\"]\nprefix = \"{app}:\"\n")).unwrap_err();
        assert_eq!(e.field, "store.prefix", "{e}");
        // Seed nodes on one server's backend are refused where they are written.
        let e = parse("[upstream]\ndemo = true\n[store]\nbackend = \"redis\"\nurl = \"redis://a:1\"\nurls = [\"redis://a:7000\"]\n").unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (6, "store.urls"), "{e}");
        // The environment's seeds, comma-separated, win over the file's.
        let text = store("urls = [\"redis://file:7000\"]\n");
        let env = Some("redis://e1:7000, redis://e2:7001".to_owned());
        let c = Config::parse_with_env("t.toml", &text, env).unwrap();
        assert_eq!(c.store.urls, ["redis://e1:7000", "redis://e2:7001"]);
    }

    #[test]
    fn realtime_defaults_and_values() {
        let c = parse("[upstream]\ndemo = true\n").unwrap();
        assert_eq!(c.realtime, RealtimeConfig::default());
        assert_eq!(c.realtime.max_connections, 1000);
        let c = parse(
            "[upstream]\ndemo = true\n[realtime]\nmax_connections = 2\nflush_sec = 1\ndrain_sec = 0\n",
        )
        .unwrap();
        assert_eq!(
            c.realtime,
            RealtimeConfig {
                max_connections: 2,
                flush: Duration::from_secs(1),
                drain: Duration::ZERO,
            }
        );
        let e = parse("[upstream]\ndemo = true\n[realtime]\nflush_sec = 0\n").unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (4, "realtime.flush_sec"), "{e}");
    }

    #[test]
    fn the_admin_listener_may_not_take_the_gateways_port() {
        let addr = |a: &str| a.parse::<SocketAddr>().unwrap();
        for (a, b, taken) in [
            ("127.0.0.1:8080", "127.0.0.1:8080", true),
            ("0.0.0.0:8080", "127.0.0.1:8080", true),
            ("[::]:8080", "127.0.0.1:8080", true),
            ("0.0.0.0:8080", "[::1]:8080", false),
            ("127.0.0.1:8080", "127.0.0.2:8080", false),
            ("127.0.0.1:8080", "127.0.0.1:9090", false),
            ("127.0.0.1:0", "127.0.0.1:0", false),
        ] {
            assert_eq!(overlap(addr(a), addr(b)), taken, "{a} {b}");
            assert_eq!(overlap(addr(b), addr(a)), taken, "{b} {a}");
        }
        // The admin listener's default address, taken by the gateway: said where it is taken.
        let e = parse("[server]\nlisten = \"127.0.0.1:9090\"\n[upstream]\ndemo = true\n[admin]\n")
            .unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (2, "server.listen"), "{e}");
    }

    #[test]
    fn sha256_hex() {
        let h = "ab".repeat(32);
        assert_eq!(parse_sha256(&h), Some([0xab; 32]));
        assert_eq!(parse_sha256("abc"), None);
    }
}
