//! envoyproxy/ratelimit's YAML, read as it is: `domain` and nested `descriptors` (`key`,
//! `value`, `rate_limit {unit, requests_per_unit, unlimited, name, replaces}`, `shadow_mode`,
//! `detailed_metric`, `value_to_metric`, `descriptors`), one file or every `*.yaml`/`*.yml` of a
//! directory. Anything else is refused with its file, line and field, as is anything that
//! envoyproxy/ratelimit refuses (an empty key, a duplicate descriptor, a unit with `unlimited`).
//!
//! Matching ([`RlsConfig::lookup`]) is envoyproxy/ratelimit's: per entry of a request's
//! descriptor, `key_value` first, then the first wildcard value (`*` for any run of characters)
//! of that level in file order, then `key` alone (any value); a rule applies only at the level
//! of the descriptor's last entry.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use floodgate::WindowLimit;

use super::yaml::{self, Node, Value};

/// A config error: where, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RlsConfigError {
    /// The file.
    pub file: PathBuf,
    /// The line (1-based), when the error has one.
    pub line: Option<usize>,
    /// The field's path (`descriptors[0].rate_limit.unit`), when the error is about one.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for RlsConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ": {field}")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for RlsConfigError {}

/// The unit of a limit: the sliding window's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// One second.
    Second,
    /// One minute.
    Minute,
    /// One hour.
    Hour,
    /// One day.
    Day,
}

impl Unit {
    /// The window's length.
    pub fn window(self) -> Duration {
        Duration::from_secs(match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3600,
            Unit::Day => 86_400,
        })
    }

    /// The unit as the RLS protocol numbers it (`RateLimitResponse.RateLimit.Unit`).
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
        }
    }

    /// The unit Envoy numbers `proto` (`envoy.type.v3.RateLimitUnit`, in a descriptor's `limit`
    /// override): `None` for `UNKNOWN`, and for `MONTH` and `YEAR`, which floodgate does not
    /// apply (as the config refuses them).
    pub fn from_proto(proto: i32) -> Option<Unit> {
        match proto {
            1 => Some(Unit::Second),
            2 => Some(Unit::Minute),
            3 => Some(Unit::Hour),
            4 => Some(Unit::Day),
            _ => None,
        }
    }

    fn parse(text: &str) -> Option<Unit> {
        match text.to_ascii_lowercase().as_str() {
            "second" => Some(Unit::Second),
            "minute" => Some(Unit::Minute),
            "hour" => Some(Unit::Hour),
            "day" => Some(Unit::Day),
            _ => None,
        }
    }
}

/// A descriptor's rule: a limit, or `unlimited`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The limit; `None` for `unlimited: true`.
    pub limit: Option<(u32, Unit)>,
    /// `shadow_mode`: decided and charged, never refusing.
    pub shadow: bool,
    /// `rate_limit.name` (empty when unnamed).
    pub name: String,
    /// The names of the rules this one replaces.
    pub replaces: Vec<String>,
    /// The keys from the domain down to this rule, `.`-separated (never values): the policy
    /// name in response headers when the rule has no name.
    pub keys: String,
}

impl Rule {
    /// The rule of a descriptor that carries Envoy's `limit` override: that limit, enforced
    /// (never shadow, as envoyproxy/ratelimit applies an override), unnamed (so no `replaces`
    /// can drop it) and replacing nothing. `keys` are the descriptor's keys, `.`-separated.
    pub fn overriding(requests_per_unit: u32, unit: Unit, keys: String) -> Rule {
        Rule {
            limit: Some((requests_per_unit, unit)),
            shadow: false,
            name: String::new(),
            replaces: Vec::new(),
            keys,
        }
    }

    /// The sliding-window limit.
    pub fn window_limit(&self) -> Option<WindowLimit> {
        self.limit
            .map(|(n, unit)| WindowLimit::new(u64::from(n), unit.window()))
    }
}

/// One level of a domain's descriptor tree.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Level {
    /// By `key` or `key_value`.
    children: HashMap<String, Descriptor>,
    /// The `key_value` patterns with a `*`, in file order, split at each `*`.
    wildcards: Vec<(String, Vec<String>)>,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Descriptor {
    rule: Option<Rule>,
    level: Level,
}

/// Every domain's descriptors.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RlsConfig {
    domains: HashMap<String, Level>,
    /// The files read.
    pub files: Vec<PathBuf>,
}

impl RlsConfig {
    /// Reads `path`: a YAML file, or a directory whose `*.yaml` and `*.yml` files (not hidden,
    /// as Kubernetes' `..data`) are each one domain.
    pub fn load(path: &Path) -> Result<RlsConfig, RlsConfigError> {
        let mut config = RlsConfig::default();
        let mut domain_files: HashMap<String, PathBuf> = HashMap::new();
        for file in config_files(path)? {
            let text = std::fs::read_to_string(&file).map_err(|e| RlsConfigError {
                file: file.clone(),
                line: None,
                field: None,
                message: format!("cannot read: {e}"),
            })?;
            let (domain, level) = parse_file(&file, &text)?;
            if let Some(other) = domain_files.get(&domain) {
                return Err(RlsConfigError {
                    file: file.clone(),
                    line: None,
                    field: Some("domain".into()),
                    message: format!("duplicate domain '{domain}' (also in {})", other.display()),
                });
            }
            domain_files.insert(domain.clone(), file.clone());
            config.domains.insert(domain, level);
            config.files.push(file);
        }
        Ok(config)
    }

    /// One file's text, named `file` in errors: what tests and `load` use.
    pub fn parse(file: &Path, text: &str) -> Result<RlsConfig, RlsConfigError> {
        let (domain, level) = parse_file(file, text)?;
        Ok(RlsConfig {
            domains: HashMap::from([(domain, level)]),
            files: vec![file.to_owned()],
        })
    }

    /// The domains, sorted.
    pub fn domains(&self) -> Vec<&str> {
        let mut d: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        d.sort_unstable();
        d
    }

    /// Whether the config has `domain`.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The rule for one descriptor of a request in `domain` (its entries as `(key, value)`), as
    /// envoyproxy/ratelimit matches it. `None`: no rule (the descriptor is not limited).
    pub fn lookup<'a, I>(&self, domain: &str, entries: I) -> Option<&Rule>
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
        I::IntoIter: ExactSizeIterator,
    {
        let mut level = self.domains.get(domain)?;
        let entries = entries.into_iter();
        let last = entries.len().checked_sub(1)?;
        let mut found = None;
        for (i, (key, value)) in entries.enumerate() {
            let full = format!("{key}_{value}");
            let next = level
                .children
                .get(&full)
                .or_else(|| {
                    level
                        .wildcards
                        .iter()
                        .find(|(_, parts)| wildcard_match(parts, &full))
                        .and_then(|(k, _)| level.children.get(k))
                })
                .or_else(|| level.children.get(key))?;
            if i == last {
                found = next.rule.as_ref();
            }
            if next.level.children.is_empty() {
                break;
            }
            level = &next.level;
        }
        found
    }
}

/// Whether `value` matches the pattern split at its `*`s (each matching any run, empty too).
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str())
    {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

fn config_files(path: &Path) -> Result<Vec<PathBuf>, RlsConfigError> {
    let error = |message: String| RlsConfigError {
        file: path.to_owned(),
        line: None,
        field: None,
        message,
    };
    let meta = std::fs::metadata(path).map_err(|e| error(format!("cannot read: {e}")))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| error(format!("cannot read: {e}")))? {
        let entry = entry.map_err(|e| error(format!("cannot read: {e}")))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let yaml = name.ends_with(".yaml") || name.ends_with(".yml");
        if yaml && !name.starts_with('.') && entry.path().is_file() {
            files.push(entry.path());
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(error("no *.yaml or *.yml file in this directory".into()));
    }
    Ok(files)
}

/// Fields envoyproxy/ratelimit knows that floodgate does not apply: refused rather than
/// silently ignored, since each changes what is decided or answered.
const UNSUPPORTED: [(&str, &str); 3] = [
    (
        "quota_mode",
        "quota_mode is not supported (every limit is enforced, or shadow)",
    ),
    (
        "share_threshold",
        "share_threshold is not supported (each matching value has its own counter)",
    ),
    (
        "metadata",
        "metadata is not supported (no dynamic metadata is returned)",
    ),
];

struct Ctx<'a> {
    file: &'a Path,
}

impl Ctx<'_> {
    fn err(&self, line: usize, field: &str, message: impl Into<String>) -> RlsConfigError {
        RlsConfigError {
            file: self.file.to_owned(),
            line: Some(line),
            field: (!field.is_empty()).then(|| field.to_owned()),
            message: message.into(),
        }
    }

    fn map<'n>(
        &self,
        node: &'n Node,
        field: &str,
    ) -> Result<&'n [(String, usize, Node)], RlsConfigError> {
        match &node.value {
            Value::Map(entries) => Ok(entries),
            _ => Err(self.err(node.line, field, "expected a mapping")),
        }
    }

    fn string(&self, node: &Node, field: &str) -> Result<String, RlsConfigError> {
        match &node.value {
            _ if node.is_null() => Ok(String::new()),
            Value::Scalar { text, .. } => Ok(text.clone()),
            _ => Err(self.err(node.line, field, "expected a string")),
        }
    }

    fn bool(&self, node: &Node, field: &str) -> Result<bool, RlsConfigError> {
        // YAML 1.1's booleans too: envoyproxy/ratelimit reads its files with yaml.v2.
        if let Value::Scalar { text, plain: true } = &node.value {
            match text.as_str() {
                "true" | "True" | "TRUE" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" => {
                    return Ok(true);
                }
                "false" | "False" | "FALSE" | "no" | "No" | "NO" | "off" | "Off" | "OFF" => {
                    return Ok(false);
                }
                _ => {}
            }
        }
        if node.is_null() {
            return Ok(false);
        }
        Err(self.err(node.line, field, "expected true or false"))
    }
}

fn parse_file(file: &Path, text: &str) -> Result<(String, Level), RlsConfigError> {
    let ctx = Ctx { file };
    let root = yaml::parse(text).map_err(|(line, message)| ctx.err(line, "", message))?;
    let entries = ctx.map(&root, "")?;
    let mut domain = None;
    let mut level = Level::default();
    for (key, line, node) in entries {
        match key.as_str() {
            "domain" => domain = Some(ctx.string(node, "domain")?),
            "descriptors" => level = descriptors(&ctx, node, "descriptors", "")?,
            other => {
                return Err(ctx.err(*line, other, format!("unknown field '{other}'")));
            }
        }
    }
    match domain {
        Some(d) if !d.is_empty() => Ok((d, level)),
        _ => Err(ctx.err(root.line, "domain", "config file cannot have empty domain")),
    }
}

fn descriptors(
    ctx: &Ctx<'_>,
    node: &Node,
    field: &str,
    keys: &str,
) -> Result<Level, RlsConfigError> {
    let mut level = Level::default();
    if node.is_null() {
        return Ok(level);
    }
    let Value::Seq(items) = &node.value else {
        return Err(ctx.err(node.line, field, "expected a list of descriptors"));
    };
    for (i, item) in items.iter().enumerate() {
        let field = format!("{field}[{i}]");
        let entries = ctx.map(item, &field)?;
        let (mut key, mut value) = (String::new(), String::new());
        let (mut shadow, mut rate_limit, mut children) = (false, None, None);
        for (name, line, v) in entries {
            let f = format!("{field}.{name}");
            match name.as_str() {
                "key" => key = ctx.string(v, &f)?,
                "value" => value = ctx.string(v, &f)?,
                "shadow_mode" => shadow = ctx.bool(v, &f)?,
                // Metrics-only in envoyproxy/ratelimit; floodgate's metrics carry no descriptor.
                "detailed_metric" | "value_to_metric" => {
                    ctx.bool(v, &f)?;
                }
                // Empty, it is no rule: yaml.v2 leaves envoyproxy/ratelimit's pointer nil.
                "rate_limit" => rate_limit = (!v.is_null()).then_some((v, f)),
                "descriptors" => children = Some((v, f)),
                other => {
                    let message = UNSUPPORTED.iter().find(|(n, _)| *n == other).map_or_else(
                        || format!("unknown field '{other}'"),
                        |(_, m)| (*m).to_owned(),
                    );
                    return Err(ctx.err(*line, &f, message));
                }
            }
        }
        if key.is_empty() {
            return Err(ctx.err(
                item.line,
                &format!("{field}.key"),
                "descriptor has empty key",
            ));
        }
        let full = if value.is_empty() {
            key.clone()
        } else {
            format!("{key}_{value}")
        };
        if level.children.contains_key(&full) {
            return Err(ctx.err(
                item.line,
                &field,
                format!("duplicate descriptor composite key '{full}'"),
            ));
        }
        let keys = if keys.is_empty() {
            key.clone()
        } else {
            format!("{keys}.{key}")
        };
        let rule = match rate_limit {
            Some((v, f)) => Some(rule(ctx, v, &f, shadow, &keys)?),
            None => None,
        };
        let child_level = match children {
            Some((v, f)) => descriptors(ctx, v, &f, &keys)?,
            None => Level::default(),
        };
        // A `*` in the value matches any run of characters; one in the key is the key's own
        // character (docs/envoy.md), matched as written.
        if value.contains('*') {
            let mut parts: Vec<String> = value.split('*').map(str::to_owned).collect();
            parts[0] = format!("{key}_{}", parts[0]);
            level.wildcards.push((full.clone(), parts));
        }
        level.children.insert(
            full,
            Descriptor {
                rule,
                level: child_level,
            },
        );
    }
    Ok(level)
}

fn rule(
    ctx: &Ctx<'_>,
    node: &Node,
    field: &str,
    shadow: bool,
    keys: &str,
) -> Result<Rule, RlsConfigError> {
    let entries = ctx.map(node, field)?;
    let (mut unit, mut per_unit, mut unlimited) = (None, None, false);
    let (mut name, mut replaces, mut replaces_line) = (String::new(), Vec::new(), node.line);
    for (k, line, v) in entries {
        let f = format!("{field}.{k}");
        match k.as_str() {
            // Empty, it is no unit (beside `unlimited` too), as envoyproxy/ratelimit reads it.
            "unit" => {
                let text = ctx.string(v, &f)?;
                unit = (!text.is_empty()).then_some((text, v.line));
            }
            "requests_per_unit" => {
                let text = ctx.string(v, &f)?;
                // Digits only, without a leading zero: envoyproxy/ratelimit's YAML reads `010`
                // as octal (8) and `+5` as 5, which a plain parse here would read otherwise.
                let plain = text.bytes().all(|b| b.is_ascii_digit())
                    && (text.len() == 1 || !text.starts_with('0'));
                let n = text.parse::<u32>().ok().filter(|_| plain).ok_or_else(|| {
                    ctx.err(
                        v.line,
                        &f,
                        format!(
                            "'{text}' is not a whole number from 0 to 4294967295 written in \
                             decimal without a leading zero"
                        ),
                    )
                })?;
                per_unit = Some(n);
            }
            "unlimited" => unlimited = ctx.bool(v, &f)?,
            "name" => name = ctx.string(v, &f)?,
            // Empty, it replaces nothing.
            "replaces" if v.is_null() => {}
            "replaces" => {
                replaces_line = *line;
                let Value::Seq(items) = &v.value else {
                    return Err(ctx.err(v.line, &f, "expected a list of `- name: ...`"));
                };
                for (i, item) in items.iter().enumerate() {
                    let fi = format!("{f}[{i}]");
                    let mut replaced = String::new();
                    for (rk, rline, rv) in ctx.map(item, &fi)? {
                        match rk.as_str() {
                            "name" => replaced = ctx.string(rv, &format!("{fi}.name"))?,
                            other => {
                                return Err(ctx.err(
                                    *rline,
                                    &format!("{fi}.{other}"),
                                    format!("unknown field '{other}'"),
                                ));
                            }
                        }
                    }
                    if replaced.is_empty() {
                        return Err(ctx.err(
                            item.line,
                            &fi,
                            "should not have an empty replaces entry",
                        ));
                    }
                    replaces.push(replaced);
                }
            }
            other => return Err(ctx.err(*line, &f, format!("unknown field '{other}'"))),
        }
    }
    if !name.is_empty() && replaces.contains(&name) {
        return Err(ctx.err(
            replaces_line,
            &format!("{field}.replaces"),
            "replaces should not contain name of same descriptor",
        ));
    }
    let limit = match (unlimited, unit) {
        (true, Some((_, line))) => {
            return Err(ctx.err(
                line,
                &format!("{field}.unit"),
                "should not specify rate limit unit when unlimited",
            ));
        }
        (true, None) => None,
        (false, None) => {
            return Err(ctx.err(
                node.line,
                &format!("{field}.unit"),
                "missing: one of second, minute, hour, day",
            ));
        }
        (false, Some((text, line))) => {
            let unit = Unit::parse(&text).ok_or_else(|| {
                ctx.err(
                    line,
                    &format!("{field}.unit"),
                    format!("invalid rate limit unit '{text}' (second, minute, hour or day)"),
                )
            })?;
            Some((per_unit.unwrap_or(0), unit))
        }
    };
    Ok(Rule {
        limit,
        shadow,
        name,
        replaces,
        keys: keys.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> RlsConfig {
        RlsConfig::parse(Path::new("t.yaml"), text).unwrap()
    }

    fn limit(c: &RlsConfig, entries: &[(&str, &str)]) -> Option<(u32, Unit)> {
        c.lookup("d", entries.iter().copied())?.limit
    }

    #[test]
    fn most_specific_match_at_the_last_level() {
        let c = config(
            "domain: d\ndescriptors:\n  - key: ip\n    rate_limit: {unit: second, requests_per_unit: 10}\n  - key: ip\n    value: 50.0.0.5\n    rate_limit: {unit: second, requests_per_unit: 0}\n  - key: a\n    value: v\n    descriptors:\n      - key: b\n        rate_limit: {unit: minute, requests_per_unit: 3}\n",
        );
        assert_eq!(limit(&c, &[("ip", "1.2.3.4")]), Some((10, Unit::Second)));
        assert_eq!(limit(&c, &[("ip", "50.0.0.5")]), Some((0, Unit::Second)));
        assert_eq!(limit(&c, &[("a", "v")]), None);
        assert_eq!(
            limit(&c, &[("a", "v"), ("b", "x")]),
            Some((3, Unit::Minute))
        );
        assert_eq!(limit(&c, &[("a", "w"), ("b", "x")]), None);
        assert_eq!(
            limit(&c, &[("ip", "1"), ("b", "x")]),
            None,
            "deeper than the config"
        );
        assert_eq!(c.lookup("other", [("ip", "1")]), None);
    }

    #[test]
    fn wildcards() {
        let parts = |p: &str| p.split('*').map(str::to_owned).collect::<Vec<_>>();
        assert!(wildcard_match(&parts("k_value*"), "k_value1"));
        assert!(wildcard_match(&parts("k_value*"), "k_value"));
        assert!(wildcard_match(
            &parts("p_/api/*/action"),
            "p_/api/12/action"
        ));
        assert!(!wildcard_match(
            &parts("p_/api/*/action"),
            "p_/api/12/other"
        ));
        assert!(wildcard_match(&parts("r_/a/*/b/*/c"), "r_/a/1/b/2/c"));
        assert!(!wildcard_match(&parts("r_ab*ba"), "r_aba"));
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let e = RlsConfig::parse(
            Path::new("x.yaml"),
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n",
        )
        .unwrap_err();
        assert_eq!(e.line, Some(5));
        assert_eq!(e.field.as_deref(), Some("descriptors[0].rate_limit.unit"));
        assert!(
            e.to_string()
                .starts_with("x.yaml:5: descriptors[0].rate_limit.unit: invalid"),
            "{e}"
        );
    }
}
