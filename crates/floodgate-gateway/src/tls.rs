//! TLS to an `https://` upstream: one rustls client config per upstream, trusting the system's
//! CA certificates plus those of `[upstream] ca_file`.
//!
//! rustls with the `ring` provider, passed to the config rather than installed process-wide: the
//! gateway then works whatever provider (if any) the rest of the process chose.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::{self, PemObject};
use rustls::{ClientConfig, RootCertStore};

/// The one application protocol offered: the pool speaks HTTP/1.1 only.
const ALPN_HTTP11: &[u8] = b"http/1.1";

/// The CA certificates of the PEM file at `path`, as trust anchors. Fails when the file cannot
/// be read, is not PEM, holds no certificate, or holds a certificate that cannot be a trust
/// anchor. Messages name the file but not the config field.
pub(crate) fn ca_file_roots(path: &Path) -> Result<RootCertStore, String> {
    let shown = path.display();
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| match e {
            pem::Error::Io(e) => format!("cannot read {shown}: {e}"),
            e => format!("{shown} is not a valid PEM file: {e}"),
        })?;
    if certs.is_empty() {
        return Err(format!(
            "{shown} holds no certificate (expected PEM blocks starting with -----BEGIN CERTIFICATE-----)"
        ));
    }
    let mut roots = RootCertStore::empty();
    for (i, cert) in certs.into_iter().enumerate() {
        roots.add(cert).map_err(|e| {
            // rustls words these for a peer's certificate; this one is from a file.
            let why = match e {
                rustls::Error::InvalidCertificate(e) => e.to_string(),
                e => e.to_string(),
            };
            format!(
                "{shown}: certificate {} is not a usable CA certificate: {why}",
                i + 1
            )
        })?;
    }
    Ok(roots)
}

/// The client config for an https upstream: TLS 1.2 or 1.3 over `ring`, ALPN `http/1.1`, server
/// certificates checked against the system's CAs and those of `ca_file`. Errors are messages
/// for the operator, without a field name.
pub(crate) fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, String> {
    let mut roots = system_roots().clone();
    if let Some(path) = ca_file {
        roots.extend(ca_file_roots(path)?.roots);
    }
    if roots.is_empty() {
        // Without this check every request would fail its handshake with an unknown issuer.
        return Err(
            "no trusted CA certificate: the system's trust store is empty or unreadable (see \
             SSL_CERT_FILE / SSL_CERT_DIR) and no `upstream.ca_file` is set"
                .into(),
        );
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(Arc::new(config))
}

/// The system's CA certificates (or those of `SSL_CERT_FILE` / `SSL_CERT_DIR`), read once per
/// process: each worker builds its own upstream, and the store does not change while the
/// gateway runs. Unreadable or unusable entries are logged once and skipped.
fn system_roots() -> &'static RootCertStore {
    static ROOTS: OnceLock<RootCertStore> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "upstream TLS: cannot load system CA certificates");
        }
        let mut roots = RootCertStore::empty();
        let (added, ignored) = roots.add_parsable_certificates(found.certs);
        tracing::debug!(
            added,
            ignored,
            "upstream TLS: system CA certificates loaded"
        );
        roots
    })
}
