//! What `floodgate check-config` prints and `GET /admin/config` answers: what a valid config
//! resolves to (store, upstream, every key's chain, limits and budgets), never a secret (a
//! Redis URL is "set", an upstream API key's variable "set" or not, never its value).

use std::io::{self, Write};
use std::path::Path;

use floodgate::ScopeKind;

use crate::auth::Keys;
use crate::config::{Config, GATEWAY_ID, OnError, UpstreamTarget, per_million};
use crate::pricing::Prices;

/// Writes what a valid config resolves to: store, upstream, every key's chain and budgets
/// (never a secret).
pub fn write(out: &mut impl Write, file: &Path, config: &Config) -> io::Result<()> {
    writeln!(out, "{}: OK", file.display())?;
    writeln!(out, "listen: {}", config.listen)?;
    writeln!(out, "header timeout: {}s", config.header_timeout.as_secs())?;
    writeln!(
        out,
        "max body read before admission: {} MiB",
        config.max_body_mib
    )?;
    writeln!(
        out,
        "max bodies held before admission: {} MiB (a key at most half)",
        config.max_buffered_mib
    )?;
    writeln!(out, "max open connections: {}", config.max_connections)?;
    let mode = |m: OnError| match m {
        OnError::Open => "open",
        OnError::Closed => "closed",
    };
    let kinds = config.store.on_error_by_kind;
    let on_error = match kinds.uniform() {
        Some(m) => mode(m).to_owned(),
        None => format!(
            "{{ requests = {}, tokens = {}, budgets = {} }}",
            mode(kinds.requests),
            mode(kinds.tokens),
            mode(kinds.budgets)
        ),
    };
    let backend = config.store.backend.name();
    match (&config.store.url, config.store.urls.len()) {
        (Some(_), _) => writeln!(out, "store: {backend} (url set, on_error = {on_error})")?,
        (None, 0) => writeln!(out, "store: {backend} (on_error = {on_error})")?,
        (None, seeds) => writeln!(
            out,
            "store: {backend} ({seeds} seed nodes, on_error = {on_error})"
        )?,
    }
    if let Some(warning) = config.store.ignored_url_warning() {
        writeln!(out, "warning: {warning}")?;
    }
    match &config.upstream.target {
        UpstreamTarget::Demo => {
            writeln!(out, "upstream: built-in DEMO (fixed replies, not a model)")?
        }
        UpstreamTarget::Http {
            base_url,
            api_key_env,
            ca_file,
        } => {
            let key = match api_key_env {
                None => "no API key".to_owned(),
                // The check `serve` makes: what passes here is what it sends.
                Some(var) => match crate::upstream::api_key(var) {
                    Ok(_) => format!("API key from ${var} (set)"),
                    Err(e) => format!("API key from ${var} (REFUSED: {e}; serve will not start)"),
                },
            };
            writeln!(
                out,
                "upstream: {base_url} ({key}, timeout {}s)",
                config.upstream.timeout.as_secs()
            )?;
            if let Some(path) = ca_file {
                writeln!(
                    out,
                    "upstream CA file: {} (trusted besides the system's CAs)",
                    path.display()
                )?;
            }
        }
    }
    writeln!(
        out,
        "realtime: at most {} live sessions in this process, tokens charged every {}s, {}s to finish on shutdown",
        config.realtime.max_connections,
        config.realtime.flush.as_secs(),
        config.realtime.drain.as_secs()
    )?;
    let gateway = config.scope_limits(ScopeKind::Gateway, GATEWAY_ID);
    let gateway_in_flight = config.scope_in_flight(ScopeKind::Gateway, GATEWAY_ID);
    let mut list: Vec<String> = gateway.iter().map(ToString::to_string).collect();
    list.extend(gateway_in_flight.map(ToString::to_string));
    if list.is_empty() {
        writeln!(out, "gateway: unlimited")?;
    } else {
        writeln!(out, "gateway: {}", list.join(", "))?;
    }
    let gateway_budgets = config.scope_budgets(ScopeKind::Gateway, GATEWAY_ID);
    for b in gateway_budgets {
        writeln!(out, "gateway budget: {b}")?;
    }
    let prices = Prices::new(&config.prices);
    if !config.prices.is_empty() {
        writeln!(out, "prices (USD per million tokens, input / output):")?;
        for (model, p) in prices.list() {
            writeln!(
                out,
                "    {model:<30} {} / {}",
                per_million(p.input_pico),
                per_million(p.output_pico)
            )?;
        }
    }
    let keys = Keys::from_config(config);
    writeln!(out, "keys: {}", config.keys.len())?;
    for k in &config.keys {
        let mut attrs = Vec::new();
        for (name, v) in [
            ("org", &k.org),
            ("business_unit", &k.business_unit),
            ("team", &k.team),
            ("project", &k.project),
        ] {
            if let Some(v) = v {
                attrs.push(format!("{name}={v}"));
            }
        }
        writeln!(out, "  key {} [{}]", k.id, attrs.join(" "))?;
        let mut any = false;
        for (kind, id) in k.scopes() {
            for l in config.scope_limits(kind, id) {
                writeln!(out, "    {:<13} {id:<16} {l}", kind.as_str())?;
                any = true;
            }
            if let Some(l) = config.scope_in_flight(kind, id) {
                writeln!(out, "    {:<13} {id:<16} {l}", kind.as_str())?;
                any = true;
            }
        }
        for l in gateway {
            writeln!(out, "    {:<13} {:<16} {l}", "gateway", "-")?;
            any = true;
        }
        if let Some(l) = gateway_in_flight {
            writeln!(out, "    {:<13} {:<16} {l}", "gateway", "-")?;
            any = true;
        }
        let budgeted = !gateway_budgets.is_empty()
            || k.scopes()
                .into_iter()
                .any(|(kind, id)| !config.scope_budgets(kind, id).is_empty());
        if !any {
            writeln!(
                out,
                "    {}",
                if budgeted {
                    "(no rate limits)"
                } else {
                    "(unlimited)"
                }
            )?;
        }
        for (kind, id) in k.scopes() {
            for b in config.scope_budgets(kind, id) {
                writeln!(out, "    {:<13} {id:<16} budget {b}", kind.as_str())?;
            }
        }
        for b in gateway_budgets {
            writeln!(out, "    {:<13} {:<16} budget {b}", "gateway", "-")?;
        }
    }
    let mut customers: Vec<_> = keys.customers().collect();
    customers.sort_by_key(|(c, _)| *c);
    if !customers.is_empty() {
        writeln!(
            out,
            "customers (added to a chain by the X-Floodgate-Customer header):"
        )?;
        for (c, _) in customers {
            for l in config.scope_limits(ScopeKind::Customer, c) {
                writeln!(out, "    {:<13} {c:<16} {l}", "customer")?;
            }
            if let Some(l) = config.scope_in_flight(ScopeKind::Customer, c) {
                writeln!(out, "    {:<13} {c:<16} {l}", "customer")?;
            }
            for b in config.scope_budgets(ScopeKind::Customer, c) {
                writeln!(out, "    {:<13} {c:<16} budget {b}", "customer")?;
            }
        }
    }
    let alerts = &config.alerts;
    let kept = match &alerts.path {
        Some(p) => format!("kept in {}", p.display()),
        None => "in memory only (no path)".to_owned(),
    };
    let route = if alerts.secret_sha256.is_some() {
        "GET /alerts with its secret"
    } else {
        "no /alerts (no secret)"
    };
    writeln!(
        out,
        "refusal tally: {kept}, flushed every {}s, {} days kept, {route}",
        alerts.flush_every.as_secs(),
        alerts.retention_days
    )?;
    for warning in config.unused_limit_warnings() {
        writeln!(out, "warning: {warning}")?;
    }
    out.flush()
}
