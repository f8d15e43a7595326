//! The `/v1/...` handler: authenticate -> guard -> admit -> forward -> meter, each phase once.

use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};

use super::admission::Ctx;
use super::guard::{self, Checked, Rules};
use super::state::AppState;
use crate::access_log::{self, Decision};
use crate::error::AppError;
use crate::metering::{Meter, MeteredBody, Spend};
use crate::openai::realtime::is_realtime;
use crate::openai::sse::AnswerEnd;
use crate::openai::usage::TokenUsage;
use crate::slots::{self, held_until_sent};

/// Answers a request for `/v1/...`.
pub(super) async fn proxy(state: AppState, req: Request) -> Response {
    let start = Instant::now();
    let websocket = guard::asks_for_websocket(&req);
    let realtime = websocket && is_realtime(req.uri().path());
    // The config in force now: this request keeps it to its end, whatever a reload swaps in.
    let live = state.live();
    let key = if realtime {
        live.keys.authenticate_websocket(req.headers())
    } else {
        live.keys.authenticate(req.headers())
    };
    let Some(key) = key.cloned() else {
        let (method, path) = (req.method(), req.uri().path());
        let status = StatusCode::UNAUTHORIZED;
        access_log::write(
            None,
            method,
            path,
            status,
            start,
            Decision::Unauthenticated,
            None,
        );
        super::admission::count(&state, Decision::Unauthenticated);
        return AppError::Unauthorized.into_response();
    };
    let mut ctx = Ctx::new(
        state,
        live,
        key,
        (req.method(), req.uri(), req.headers()),
        start,
    );
    if let Err(err) = ctx.live.upstream.forwardable(req.uri()) {
        // Refused before admission: a request that cannot be sent is charged nothing.
        return ctx.reject(err, Decision::BadRequest).await;
    }
    if realtime {
        return super::realtime::open(ctx, req).await;
    }
    if websocket {
        // Stripped as hop-by-hop, the upgrade would reach the upstream as a plain request that
        // can only fail, and be charged for it: refused plainly instead, uncharged.
        let err = AppError::UpgradeUnsupported;
        return ctx.reject(err, Decision::UpgradeUnsupported).await;
    }
    // Budgets are charged from usage too: a chain with budgets is metered like one with a
    // token limit.
    let rules = Rules {
        metered: ctx.spend_budgets.is_some()
            || ctx.chain.has_reactive()
            || ctx.chain.has_reserved(),
        want_model: ctx.spend_budgets.is_some(),
        max_body_mib: ctx.state.max_body_mib(),
        body_timeout: ctx.state.header_timeout(),
        buffers: ctx.state.buffers(),
        key: ctx.key.index,
        default_output: ctx.live.default_output,
    };
    let Checked {
        parts,
        body,
        stream,
        model,
        generating,
        estimate,
        streamed,
    } = match guard::check(req, &rules).await {
        Ok(checked) => checked,
        Err((err, decision)) => return ctx.reject(err, decision).await,
    };
    // Budgets reserve the estimate's price (`[gateway] tokens = "reserve"`), as the model the
    // request names prices it.
    let price = (ctx.live.reserve_budgets && ctx.budgets.is_some()).then(|| {
        let usage = TokenUsage {
            input: Some(estimate.prompt),
            output: Some(estimate.output),
            total: estimate.total(),
        };
        ctx.live.prices.spend(None, model.as_deref(), &usage)
    });
    if estimate.total() == 0 {
        // A body not read (not a completion or a Responses create): nothing to reserve.
        ctx.reserves_nothing();
    }
    let mut admitted = match ctx.admit(estimate, price).await {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };

    let gone = ctx.caller_gone(&admitted);
    let asked = Instant::now();
    let upload_idle = streamed.then(|| ctx.state.header_timeout());
    let method = parts.method.clone();
    let sent = ctx
        .live
        .upstream
        .send(Request::from_parts(parts, body), upload_idle)
        .await;
    gone.disarm();
    // A body the caller broke or stopped sending is not the upstream's failure.
    if !matches!(sent, Err(AppError::BadRequest(_) | AppError::BodyTimeout)) {
        let status = sent.as_ref().ok().map(|r| r.status().as_u16());
        ctx.state.metrics().upstream(status, asked.elapsed());
    }
    let resp = match sent {
        Ok(r) => r,
        Err(err) => return ctx.upstream_failed(&mut admitted, err),
    };

    let (mut head, body) = resp.into_parts();
    admitted.apply_headers(&mut head.headers, &ctx);
    let meter = if !generating || !head.status.is_success() {
        Meter::None
    } else if head
        .headers
        .get(CONTENT_ENCODING)
        .is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"))
    {
        tracing::warn!(key = %ctx.key.id, "compressed response (unasked for): its tokens are not metered");
        Meter::None
    } else {
        let ctype = head
            .headers
            .get(CONTENT_TYPE)
            .map(|v| media_type(v.as_bytes()))
            .unwrap_or_default();
        if ctype.eq_ignore_ascii_case(b"text/event-stream") {
            let strip_usage = stream.is_some_and(|s| !s.caller_wants_usage);
            if strip_usage {
                head.headers.remove(CONTENT_LENGTH);
            }
            // A completion's stream (asked for usage) ends its answer with a finish_reason;
            // another (the Responses API's) with an event that closes its output.
            let ends = if stream.is_some() {
                AnswerEnd::FinishReason
            } else {
                AnswerEnd::DoneEvent
            };
            Meter::Sse { strip_usage, ends }
        } else if ctype.eq_ignore_ascii_case(b"application/json") {
            Meter::Json
        } else {
            Meter::None
        }
    };
    // The request holds its concurrency slots until its body is sent whole or dropped (the
    // caller gone); a metered body read on after its caller left holds none.
    let slots = admitted.take_slots();
    let bodiless = slots.is_some() && slots::bodiless(&method, head.status, &body);
    if matches!(meter, Meter::None) && !access_log::enabled() {
        // Nothing to read and no line to write when the body ends (the request log is off):
        // the upstream body goes out as it is, without a wrapper.
        return Response::from_parts(head, held_until_sent(body, slots, bodiless).await);
    }
    let line = ctx.pending_line(head.status, &admitted);
    // With the enforced budgets reserved on, the spend reconciles them, and is added as usual
    // only to the shadow ones.
    let reserved = admitted.budget_reservation.take();
    let spend = ctx.spend_budgets.map(|all| Spend {
        budgets: match &reserved {
            Some(_) => ctx.shadow_budgets.clone().unwrap_or_default(),
            None => all,
        },
        prices: std::sync::Arc::clone(&ctx.live.prices),
        request_model: model,
        reserved,
    });
    let charge = (ctx.state.charges(), ctx.chain, admitted.reservation);
    let body = MeteredBody::new(body, meter, charge, spend, line);
    Response::from_parts(
        head,
        held_until_sent(Body::new(body), slots, bodiless).await,
    )
}

/// A `Content-Type` value's media type, without its parameters (`; charset=...`) and the
/// spaces around it: compared without regard to case, as media types are (RFC 9110 §8.3.1).
fn media_type(value: &[u8]) -> &[u8] {
    let end = value.iter().position(|&b| b == b';').unwrap_or(value.len());
    value[..end].trim_ascii()
}
