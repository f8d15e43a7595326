//! A Realtime API upgrade (`GET /v1/realtime`, docs/design.md §6), taken in this order; only the
//! last step charges anything:
//!
//! 1. authenticated like any request (`Authorization: Bearer`, or the subprotocol entry
//!    `openai-insecure-api-key.<secret>` that browsers send, see
//!    [`Keys::authenticate_websocket`](crate::auth::Keys::authenticate_websocket)), and checked
//!    to be a well-formed WebSocket handshake over HTTP/1.1 whose query names `model` at most
//!    once, by that very name (400 otherwise);
//! 2. the process-local `[realtime] max_connections` cap (429 `too_many_connections`);
//! 3. the same admission as any request (`admission`): the chain's budgets, then one request on
//!    the key's chain;
//! 4. forwarded on an upstream connection of its own. The upstream's 101 is answered with a 101
//!    that carries its handshake headers and the rate-limit headers, and the session is handed
//!    to [`crate::realtime`]; any other answer is passed through like a proxied response.
//!
//! The upgrade request is forwarded without `Sec-WebSocket-Extensions` for a metered session, so
//! that no frame arrives compressed.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::header::{
    CONNECTION, CONTENT_LENGTH, SEC_WEBSOCKET_EXTENSIONS, SEC_WEBSOCKET_KEY,
    SEC_WEBSOCKET_PROTOCOL, SEC_WEBSOCKET_VERSION, TRANSFER_ENCODING, UPGRADE,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Version};
use axum::response::Response;
use floodgate::ScopeKind;

use super::admission::Ctx;
use crate::access_log::Decision;
use crate::auth::PROTOCOL_KEY_PREFIX;
use crate::error::AppError;
use crate::openai::realtime::{ambiguous_model, query_model};
use crate::openai::request::Estimate;
use crate::realtime::{FULL_RETRY_AFTER, SessionMeter, SessionSpend};
use crate::slots::{self, held_until_sent};

/// Why a WebSocket upgrade request cannot be forwarded as one, if it cannot: the upstream would
/// refuse it, the session could never start, or the gateway could price it by another model than
/// the upstream runs; and it would have been charged.
fn malformed<B>(req: &Request<B>) -> Option<&'static str> {
    if req.method() != Method::GET {
        return Some("A WebSocket upgrade is a GET request.");
    }
    // hyper upgrades HTTP/1.1 connections only: an HTTP/1.0 one would be answered 101 and then
    // carry nothing.
    if req.version() != Version::HTTP_11 {
        return Some("A WebSocket upgrade is an HTTP/1.1 request.");
    }
    let headers = req.headers();
    let version = headers
        .get(SEC_WEBSOCKET_VERSION)
        .map(|v| v.as_bytes().trim_ascii());
    if version != Some(b"13".as_slice()) {
        return Some("A WebSocket upgrade needs `Sec-WebSocket-Version: 13`.");
    }
    // The handshake is a GET without content (RFC 6455, 4.1): one announcing a body would be
    // forwarded without it (an upgrade's connection carries frames after its head), and the
    // upstream could wait for it until the gateway's timeout, a 504 charged to the caller.
    let announces_body = headers.contains_key(TRANSFER_ENCODING)
        || headers
            .get_all(CONTENT_LENGTH)
            .iter()
            .any(|v| v.as_bytes().trim_ascii() != b"0");
    if announces_body {
        return Some("A WebSocket upgrade carries no body.");
    }
    // 16 random bytes in base64 (RFC 6455, 4.1).
    let key_ok = headers.get(SEC_WEBSOCKET_KEY).is_some_and(|k| {
        let k = k.as_bytes().trim_ascii();
        k.len() == 24
            && k.ends_with(b"==")
            && k[..22]
                .iter()
                .all(|&b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
    });
    if !key_ok {
        return Some("A WebSocket upgrade needs a `Sec-WebSocket-Key` (16 bytes in base64).");
    }
    if ambiguous_model(req.uri()) {
        return Some(
            "The query names `model` more than once, or with a percent-encoded name: \
             name it once, as `model=`.",
        );
    }
    None
}

/// Prepares the caller's handshake headers for the upstream: the subprotocol entries that carry
/// a gateway key are removed (the upstream gets its own key as a bearer token), and for a
/// metered session so is `Sec-WebSocket-Extensions`, so that frames come uncompressed.
fn forwardable(headers: &mut HeaderMap, metered: bool) {
    if metered {
        headers.remove(SEC_WEBSOCKET_EXTENSIONS);
    }
    if !headers.contains_key(SEC_WEBSOCKET_PROTOCOL) {
        return;
    }
    let kept: Vec<String> = headers
        .get_all(SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with(PROTOCOL_KEY_PREFIX))
        .map(str::to_owned)
        .collect();
    headers.remove(SEC_WEBSOCKET_PROTOCOL);
    if kept.is_empty() {
        return;
    }
    if let Ok(v) = HeaderValue::from_str(&kept.join(", ")) {
        headers.insert(SEC_WEBSOCKET_PROTOCOL, v);
    }
}

/// Answers a WebSocket upgrade of `/v1/realtime` by an authenticated caller: see the module
/// docs.
pub(super) async fn open(mut ctx: Ctx, mut req: Request) -> Response {
    if let Some(why) = malformed(&req) {
        let err = AppError::BadRequest(why.into());
        return ctx.reject(err, Decision::BadRequest).await;
    }
    // A session has no size up front to reserve.
    ctx.reserves_nothing();
    let sessions = ctx.state.sessions();
    // The cap first: a refusal for a full process charges nothing.
    let Some(slot) = sessions.take_slot() else {
        // The process's own cap refused: a refusal of the gateway in the tally.
        ctx.count_refusal(ScopeKind::Gateway);
        let err = AppError::TooManyConnections {
            max: sessions.max(),
            retry_after: FULL_RETRY_AFTER,
        };
        return ctx.answer(err, Decision::TooManyConnections);
    };
    let mut admitted = match ctx.admit(Estimate::default(), None).await {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };
    // The session's spend: priced by the model the upstream's session events name, and until
    // one does, by the model its URL names (`?model=`, unambiguous: see `malformed`).
    let spend = ctx.spend_budgets.clone().map(|budgets| SessionSpend {
        budgets,
        prices: Arc::clone(&ctx.live.prices),
        model: query_model(req.uri()),
    });
    let counts_tokens = ctx.chain.has_reactive();
    let metered = counts_tokens || spend.is_some();

    let caller_upgrade = hyper::upgrade::on(&mut req);
    // A GET upgrade has no body to forward.
    let (mut parts, _) = req.into_parts();
    forwardable(&mut parts.headers, metered);
    let gone = ctx.caller_gone(&admitted);
    let asked = std::time::Instant::now();
    let sent = ctx
        .live
        .upstream
        .upgrade(Request::from_parts(parts, Body::empty()))
        .await;
    gone.disarm();
    let status = sent.as_ref().ok().map(|r| r.status().as_u16());
    ctx.state.metrics().upstream(status, asked.elapsed());
    let mut resp = match sent {
        Ok(r) => r,
        Err(err) => return ctx.upstream_failed(&mut admitted, err),
    };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        // The upstream declined (a 401 for its key, a 400 for an unknown model): its answer,
        // like any proxied response's; the request was admitted and stays charged.
        // Its concurrency slots are held until that answer is sent whole, as for any answer
        // (docs/design.md §10).
        ctx.log(resp.status(), admitted.log_as);
        let (mut head, body) = resp.into_parts();
        admitted.apply_headers(&mut head.headers, &ctx);
        let body = Body::new(body);
        let slots = admitted.take_slots();
        let bodiless = slots.is_some() && slots::bodiless(&Method::GET, head.status, &body);
        return Response::from_parts(head, held_until_sent(body, slots, bodiless).await);
    }
    let upstream_upgrade = hyper::upgrade::on(&mut resp);
    let (mut head, _) = resp.into_parts();
    head.headers
        .insert(CONNECTION, HeaderValue::from_static("upgrade"));
    head.headers
        .insert(UPGRADE, HeaderValue::from_static("websocket"));
    admitted.apply_headers(&mut head.headers, &ctx);
    ctx.log(StatusCode::SWITCHING_PROTOCOLS, admitted.log_as);
    let chain = counts_tokens.then(|| Arc::clone(&ctx.chain));
    let charger = ctx.state.charges().clone();
    // A metered session's caller is told its own chain's limits after each turn.
    let rates = metered.then(|| Arc::clone(&ctx.chain));
    sessions.spawn(
        (slot, admitted.take_slots()),
        Arc::clone(&ctx.key.id),
        SessionMeter {
            charger,
            chain,
            spend,
            rates,
        },
        (caller_upgrade, upstream_upgrade),
    );
    Response::from_parts(head, Body::empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_key_protocol_entries_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(
            SEC_WEBSOCKET_PROTOCOL,
            "realtime, openai-insecure-api-key.sk-secret, openai-beta.realtime-v1"
                .parse()
                .unwrap(),
        );
        h.insert(
            SEC_WEBSOCKET_EXTENSIONS,
            "permessage-deflate".parse().unwrap(),
        );
        forwardable(&mut h, false);
        assert_eq!(
            h[SEC_WEBSOCKET_PROTOCOL],
            "realtime, openai-beta.realtime-v1"
        );
        assert!(h.contains_key(SEC_WEBSOCKET_EXTENSIONS));
        forwardable(&mut h, true);
        assert!(!h.contains_key(SEC_WEBSOCKET_EXTENSIONS));
        let mut h = HeaderMap::new();
        h.insert(
            SEC_WEBSOCKET_PROTOCOL,
            "openai-insecure-api-key.sk-secret".parse().unwrap(),
        );
        forwardable(&mut h, true);
        assert!(!h.contains_key(SEC_WEBSOCKET_PROTOCOL));
    }

    #[test]
    fn malformed_handshakes_are_told_apart() {
        let upgrade = |method: Method, version: Version, uri: &str, ws_version, key| {
            Request::builder()
                .method(method)
                .version(version)
                .uri(uri)
                .header(SEC_WEBSOCKET_VERSION, ws_version)
                .header(SEC_WEBSOCKET_KEY, key)
                .body(())
                .unwrap()
        };
        let (get, http11, uri, key) = (
            Method::GET,
            Version::HTTP_11,
            "/v1/realtime?model=m",
            "dGhlIHNhbXBsZSBub25jZQ==",
        );
        assert_eq!(
            malformed(&upgrade(get.clone(), http11, uri, "13", key)),
            None
        );
        assert!(malformed(&upgrade(Method::POST, http11, uri, "13", key)).is_some());
        assert!(malformed(&upgrade(get.clone(), Version::HTTP_10, uri, "13", key)).is_some());
        assert!(malformed(&upgrade(get.clone(), http11, uri, "13", "short")).is_some());
        assert!(malformed(&upgrade(get.clone(), http11, uri, "8", key)).is_some());
        assert!(
            malformed(&upgrade(
                get,
                http11,
                "/v1/realtime?model=a&model=b",
                "13",
                key
            ))
            .is_some()
        );
    }
}
