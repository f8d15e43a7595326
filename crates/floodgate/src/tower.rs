//! A tower layer: floodgate's limits in front of any `tower` HTTP service (axum, tonic, hyper).
//!
//! [`RateLimitLayer::new`] takes a store, a limiter and a function that names each request:
//!
//! - a [`TokenBucket`]: the function returns the bucket's name (`Option<String>` for a
//!   `TokenBucket<str>`, `Option<u64>` for a `TokenBucket<u64>`);
//! - a [`ChainBuilder`]: the scopes and limits of a chain, whose ids the function returns, one per
//!   scope (`Option<[String; 2]>` for a key and an IP). The chain is admitted in one atomic step:
//!   a request that one limit refuses is charged to none of them, which two stacked layers
//!   cannot promise.
//!
//! A request costs 1 unless [`RateLimitLayer::cost`] says otherwise. An admitted request goes on
//! to the inner service and its response gets the rate-limit headers; a refused one is answered
//! at once with `429 Too Many Requests` and the same headers, `Retry-After` and
//! `retry-after-ms` included ([`crate::http`]: the gateway's own implementation). A gRPC request
//! (`content-type: application/grpc...`) is refused the way gRPC answers an error: a
//! "Trailers-Only" response, HTTP `200` with `content-type: application/grpc`, `grpc-status: 8`
//! (`RESOURCE_EXHAUSTED`), a percent-encoded `grpc-message` and the same rate-limit headers
//! (which a gRPC client reads as the status's metadata), as tonic's `Status::into_http` makes
//! it. gRPC clients read a status only from an HTTP 200: grpc-go, for one, maps a 429 to
//! `UNAVAILABLE` and ignores its `grpc-status`.
//!
//! Two settings decide the rest: a request the function cannot name ([`Unnamed`]: passed
//! through, the default, or refused with a status), and a store that fails ([`OnError`]: the
//! request passed through unchecked, the default, or refused with 503).
//!
//! The answers the layer makes itself have an empty body: the inner service's body type, which
//! must implement [`Default`] (axum's `Body`, tonic's `Body`, `http_body_util::Empty` and
//! `Full` do). Their status and headers say everything a client acts on.
//!
//! ```no_run
//! use axum::{Router, extract::Request, routing::get};
//! use floodgate::store::MemoryStore;
//! use floodgate::tower::{ChainBuilder, RateLimitLayer};
//! use floodgate::{ScopeKind, WindowLimit};
//!
//! fn api_key(req: &Request) -> Option<String> {
//!     Some(req.headers().get("x-api-key")?.to_str().ok()?.to_owned())
//! }
//!
//! let limits = ChainBuilder::new("api").limit(ScopeKind::Key, WindowLimit::per_minute(600));
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .layer(RateLimitLayer::new(MemoryStore::new(), limits, |req: &Request| Some([api_key(req)?])));
//! ```
//!
//! The store's own failure setting comes first: a
//! [`RedisStore`](crate::store::redis::RedisStore) configured to fail open (its default) admits
//! through an outage without an error, so the layer's [`OnError`] only sees what the store could
//! not answer (an error Redis replied with, or an outage on a store configured to fail closed).

use std::borrow::Borrow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use ::http::header::CONTENT_TYPE;
use ::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

use crate::Error;
use crate::bucket::{Admission, BucketLimit};
use crate::chain::{ChainDecision, ChainLimit, ScopeKind};
use crate::http::{ChainHeaders, apply, apply_bucket};
use crate::limiter::{BucketName, Chain, TokenBucket};
use crate::store::Store;
use crate::window::{Charge, WindowLimit};

/// What the layer does with a request its naming function returns `None` for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Unnamed {
    /// Pass it on, unlimited and without rate-limit headers. The default: the function decides
    /// what is limited (a health check need not be). A function that fails by mistake (a header
    /// read under the wrong name, axum's `ConnectInfo` not installed) then limits nothing, so
    /// test that it names what it should, or refuse instead.
    #[default]
    Pass,
    /// Answer with this status (401 for a missing API key, say), without calling the service.
    Refuse(StatusCode),
}

/// What the layer does when the store fails to decide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnError {
    /// Pass the request on unchecked, without rate-limit headers: an outage of the limiter is not
    /// an outage of the service. The default, as the store's.
    #[default]
    Open,
    /// Answer `503 Service Unavailable` without calling the service.
    Closed,
}

/// What a request costs: 1, or what a function of the request says ([`RateLimitLayer::cost`]).
pub trait Cost<B> {
    /// The units `req` is charged (requests for a chain, tokens for a bucket).
    fn cost(&self, req: &Request<B>) -> u64;
}

/// Every request costs 1: the layer's default [`Cost`].
#[derive(Clone, Copy, Debug, Default)]
pub struct One;

impl<B> Cost<B> for One {
    fn cost(&self, _: &Request<B>) -> u64 {
        1
    }
}

impl<B, F> Cost<B> for F
where
    F: Fn(&Request<B>) -> u64,
{
    fn cost(&self, req: &Request<B>) -> u64 {
        self(req)
    }
}

/// A limiter the layer can run for a request named `K`: a [`TokenBucket`] (named by its bucket
/// name: a `TokenBucket<str>` by a `String`) or a [`ChainBuilder`] (named by one id per scope,
/// an array or a `Vec` of them). Only this crate can make a [`Verdict`], so these are the
/// limiters there are.
pub trait Limiter<K>: Send + Sync + 'static {
    /// Decides a request named `name` of `cost` units on `store`, in one atomic step.
    fn decide<S: Store>(
        &self,
        store: &S,
        name: &K,
        cost: u64,
    ) -> impl Future<Output = Result<Verdict, Error>> + Send;
}

/// A decision the layer acts on: admitted or not, and the headers that say so.
#[derive(Debug)]
pub struct Verdict {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Chain {
        decision: ChainDecision,
        fixed: Arc<ChainHeaders>,
    },
    Bucket {
        admission: Admission,
        name: &'static str,
        limit: BucketLimit,
    },
}

impl Verdict {
    /// Whether the request was admitted (and charged).
    pub fn admitted(&self) -> bool {
        match &self.kind {
            Kind::Chain { decision, .. } => decision.admitted,
            Kind::Bucket { admission, .. } => admission.is_allowed(),
        }
    }

    /// Writes the rate-limit headers of this decision ([`crate::http`]).
    pub fn apply(&self, headers: &mut HeaderMap) {
        match &self.kind {
            Kind::Chain { decision, fixed } => apply(headers, decision, fixed),
            Kind::Bucket {
                admission,
                name,
                limit,
            } => {
                let bucket: TokenBucket<str> = TokenBucket::new(name, limit.capacity, limit.rate);
                apply_bucket(headers, &bucket, admission);
            }
        }
    }
}

impl<N, K> Limiter<K> for TokenBucket<N>
where
    N: ?Sized + BucketName + Sync + 'static,
    K: Borrow<N> + Sync,
{
    async fn decide<S: Store>(&self, store: &S, name: &K, cost: u64) -> Result<Verdict, Error> {
        let admission = self.acquire(store, name.borrow(), cost).await?;
        Ok(Verdict {
            kind: Kind::Bucket {
                admission,
                name: self.name(),
                limit: self.limit(),
            },
        })
    }
}

/// The shape of a chain whose ids each request names: scopes, narrowest first, each with one or
/// more limits of requests (or of the units [`RateLimitLayer::cost`] counts) per window.
///
/// A request names one id per scope, in the order the scopes were first given: with
/// `.limit(Key, ..).limit(Key, ..).limit(Customer, ..)` it names `[key, ip]`. Each limit's state
/// is stored under `{name:id}:scope:id:req`, so two layers of different names never share a
/// count, and a limit's count follows its id across every route and replica that uses the
/// same name.
///
/// ```
/// use floodgate::tower::ChainBuilder;
/// use floodgate::{ScopeKind, WindowLimit};
///
/// let limits = ChainBuilder::new("api")
///     .limit(ScopeKind::Key, WindowLimit::per_minute(600)) // each API key
///     .limit(ScopeKind::Key, WindowLimit::per_hour(10_000))
///     .limit(ScopeKind::Customer, WindowLimit::per_minute(60)); // each client IP
/// let chain = limits.build(&["alice", "192.0.2.7"]);
/// assert_eq!(chain.limits().len(), 3);
/// assert_eq!(chain.limits()[2].key(), "{api:192.0.2.7}:customer:192.0.2.7:req");
/// ```
#[derive(Clone)]
pub struct ChainBuilder {
    name: Arc<str>,
    scopes: Vec<ScopeKind>,
    /// Each limit: the index of its scope in `scopes`, the scope and the limit.
    limits: Vec<(usize, ScopeKind, WindowLimit)>,
    fixed: Arc<ChainHeaders>,
}

impl fmt::Debug for ChainBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChainBuilder")
            .field("name", &self.name)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl ChainBuilder {
    /// An empty chain shape; `name` is part of every storage key.
    pub fn new(name: &str) -> Self {
        ChainBuilder {
            name: name.into(),
            scopes: Vec::new(),
            limits: Vec::new(),
            fixed: Arc::new(ChainHeaders::of_limits([])),
        }
    }

    /// Adds a limit on `scope`, charged at admission. Limits are checked in the order given
    /// (give the narrowest scope first: the first refusal is the one the headers name). A
    /// second limit on a scope over a window it already has is one count, not two (they would
    /// share a storage key): the stricter of the two is kept, in the first one's place.
    pub fn limit(mut self, scope: ScopeKind, limit: WindowLimit) -> Self {
        let slot = match self.scopes.iter().position(|&s| s == scope) {
            Some(i) => i,
            None => {
                self.scopes.push(scope);
                self.scopes.len() - 1
            }
        };
        let same = self
            .limits
            .iter_mut()
            .find(|(_, s, l)| *s == scope && l.window() == limit.window());
        match same {
            Some((_, _, kept)) => {
                if limit.max() < kept.max() {
                    *kept = limit;
                }
            }
            None => self.limits.push((slot, scope, limit)),
        }
        self.fixed = Arc::new(ChainHeaders::of_limits(
            self.limits.iter().map(|&(_, scope, limit)| (scope, limit)),
        ));
        self
    }

    /// The scopes a request names ids for, in order.
    pub fn scopes(&self) -> &[ScopeKind] {
        &self.scopes
    }

    /// The chain of a request naming `ids`, one per [scope](Self::scopes). A scope without an
    /// id (`ids` too short) is not limited; ids past the last scope are ignored.
    pub fn build<I: AsRef<str>>(&self, ids: &[I]) -> Chain {
        let limits = self
            .limits
            .iter()
            .filter_map(|&(slot, scope, limit)| {
                let id = ids.get(slot)?.as_ref();
                let tenant = format!("{}:{id}", self.name);
                Some(ChainLimit::new(
                    &tenant,
                    scope,
                    id,
                    Charge::Admission,
                    limit,
                ))
            })
            .collect();
        Chain::new(limits)
    }

    async fn decide_ids<S: Store, I: AsRef<str> + Sync>(
        &self,
        store: &S,
        ids: &[I],
        cost: u64,
    ) -> Result<Verdict, Error> {
        let chain = self.build(ids);
        let decision = chain.admit(store, cost).await?;
        Ok(Verdict {
            kind: Kind::Chain {
                decision,
                fixed: Arc::clone(&self.fixed),
            },
        })
    }
}

impl<I: AsRef<str> + Sync, const N: usize> Limiter<[I; N]> for ChainBuilder {
    fn decide<S: Store>(
        &self,
        store: &S,
        name: &[I; N],
        cost: u64,
    ) -> impl Future<Output = Result<Verdict, Error>> + Send {
        self.decide_ids(store, name, cost)
    }
}

impl<I: AsRef<str> + Sync> Limiter<Vec<I>> for ChainBuilder {
    fn decide<S: Store>(
        &self,
        store: &S,
        name: &Vec<I>,
        cost: u64,
    ) -> impl Future<Output = Result<Verdict, Error>> + Send {
        self.decide_ids(store, name, cost)
    }
}

/// A [`Layer`] that limits every request of the services it wraps ([module docs](self)).
///
/// `St` is the store, `L` the limiter, `F` the function that names a request
/// (`Fn(&Request<B>) -> Option<K>`), `C` its [`Cost`].
#[derive(Clone)]
pub struct RateLimitLayer<St, L, F, C = One> {
    shared: Shared<St, L, F, C>,
}

impl<St, L, F> RateLimitLayer<St, L, F> {
    /// Limits each request with `limiter` on `store`, under the name `name` gives it (see
    /// [`Limiter`] for what each limiter is named by); a request costs 1.
    pub fn new(store: St, limiter: L, name: F) -> Self {
        RateLimitLayer {
            shared: Shared {
                store,
                limiter,
                name,
                cost: One,
                unnamed: Unnamed::default(),
                on_error: OnError::default(),
            },
        }
    }
}

impl<St, L, F, C> RateLimitLayer<St, L, F, C> {
    /// Charges each request what `cost` says (`Fn(&Request<B>) -> u64`) instead of 1: a batch
    /// endpoint's items, a bucket's tokens. A cost above a limit's maximum is refused with 429
    /// and no `Retry-After`: it can never pass.
    pub fn cost<C2>(self, cost: C2) -> RateLimitLayer<St, L, F, C2> {
        let s = self.shared;
        RateLimitLayer {
            shared: Shared {
                store: s.store,
                limiter: s.limiter,
                name: s.name,
                cost,
                unnamed: s.unnamed,
                on_error: s.on_error,
            },
        }
    }

    /// What to do with a request the naming function returns `None` for (default: pass it on).
    pub fn unnamed(mut self, unnamed: Unnamed) -> Self {
        self.shared.unnamed = unnamed;
        self
    }

    /// What to do when the store fails (default: pass the request on, unchecked).
    pub fn on_error(mut self, on_error: OnError) -> Self {
        self.shared.on_error = on_error;
        self
    }
}

impl<St, L, F, C> fmt::Debug for RateLimitLayer<St, L, F, C>
where
    St: fmt::Debug,
    L: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("store", &self.shared.store)
            .field("limiter", &self.shared.limiter)
            .field("unnamed", &self.shared.unnamed)
            .field("on_error", &self.shared.on_error)
            .finish_non_exhaustive()
    }
}

impl<S, St, L, F, C> Layer<S> for RateLimitLayer<St, L, F, C>
where
    St: Clone,
    L: Clone,
    F: Clone,
    C: Clone,
{
    type Service = RateLimit<S, St, L, F, C>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            shared: Arc::new(self.shared.clone()),
        }
    }
}

/// The layer's settings; what every clone of one [`RateLimit`] service shares.
#[derive(Clone)]
struct Shared<St, L, F, C> {
    store: St,
    limiter: L,
    name: F,
    cost: C,
    unnamed: Unnamed,
    on_error: OnError,
}

/// The service [`RateLimitLayer`] makes: limits each request, then calls `S`. Cheap to clone.
pub struct RateLimit<S, St, L, F, C = One> {
    inner: S,
    shared: Arc<Shared<St, L, F, C>>,
}

impl<S: Clone, St, L, F, C> Clone for RateLimit<S, St, L, F, C> {
    fn clone(&self) -> Self {
        RateLimit {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, St, L, F, C> fmt::Debug for RateLimit<S, St, L, F, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("unnamed", &self.shared.unnamed)
            .field("on_error", &self.shared.on_error)
            .finish_non_exhaustive()
    }
}

/// The future of a [`RateLimit`] call.
pub type ResponseFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");
/// gRPC's `RESOURCE_EXHAUSTED`, as `grpc-status` writes it.
const RESOURCE_EXHAUSTED: &str = "8";

impl<S, St, L, F, C, K, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, St, L, F, C>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    St: Store + 'static,
    L: Limiter<K>,
    F: Fn(&Request<ReqBody>) -> Option<K> + Send + Sync + 'static,
    C: Cost<ReqBody> + Send + Sync + 'static,
    K: Send + Sync + 'static,
    ReqBody: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The clone that was driven to readiness serves this request; the fresh clone waits for
        // the next `poll_ready` (tower's usual pattern for a service called from a future).
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let shared = Arc::clone(&self.shared);
        let name = (shared.name)(&req);
        let cost = shared.cost.cost(&req);
        let grpc = is_grpc(&req);
        Box::pin(async move {
            let Some(name) = name else {
                return match shared.unnamed {
                    Unnamed::Pass => inner.call(req).await,
                    Unnamed::Refuse(status) => Ok(answer(status)),
                };
            };
            let verdict = match shared.limiter.decide(&shared.store, &name, cost).await {
                Ok(verdict) => verdict,
                Err(e) => {
                    // An outage is logged once by the store itself; an error the store answered
                    // with is worth a line per request.
                    match e {
                        Error::Unavailable(_) => {
                            tracing::debug!(error = %e, "rate limit unchecked")
                        }
                        _ => tracing::warn!(error = %e, "rate limit unchecked"),
                    }
                    return match shared.on_error {
                        OnError::Open => inner.call(req).await,
                        OnError::Closed => Ok(answer(StatusCode::SERVICE_UNAVAILABLE)),
                    };
                }
            };
            if !verdict.admitted() {
                if grpc {
                    // gRPC's own answer: HTTP 200, the status in the headers, no messages.
                    let mut resp = answer(StatusCode::OK);
                    verdict.apply(resp.headers_mut());
                    let message = match resp.headers().get(RETRY_AFTER_MS) {
                        Some(ms) => format!(
                            "rate limited, retry after {} ms",
                            ms.to_str().unwrap_or("?")
                        ),
                        None => "rate limited".to_owned(),
                    };
                    let h = resp.headers_mut();
                    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
                    h.insert(GRPC_STATUS, HeaderValue::from_static(RESOURCE_EXHAUSTED));
                    h.insert(GRPC_MESSAGE, grpc_message(&message));
                    return Ok(resp);
                }
                let mut resp = answer(StatusCode::TOO_MANY_REQUESTS);
                verdict.apply(resp.headers_mut());
                return Ok(resp);
            }
            let mut resp = inner.call(req).await?;
            verdict.apply(resp.headers_mut());
            Ok(resp)
        })
    }
}

/// An answer of the layer's own: `status`, an empty body.
fn answer<B: Default>(status: StatusCode) -> Response<B> {
    let mut resp = Response::new(B::default());
    *resp.status_mut() = status;
    resp
}

/// Whether `req` is a gRPC call: its refusal then carries a gRPC status too.
fn is_grpc<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// `message` as a `grpc-message` value: percent-encoded as gRPC requires (every byte outside
/// printable ASCII, and `%`), plus the bytes tonic also encodes (space, `"`, `#`, `<`, `>`, `` ` ``,
/// `?`, `{`, `}`), so that it reads back the same in every client.
fn grpc_message(message: &str) -> HeaderValue {
    let mut out = String::with_capacity(message.len());
    for &b in message.as_bytes() {
        match b {
            b' ' | b'"' | b'#' | b'%' | b'<' | b'>' | b'`' | b'?' | b'{' | b'}' => {
                out.push_str(&format!("%{b:02X}"))
            }
            0x21..=0x7e => out.push(char::from(b)),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    // Only printable ASCII is left.
    HeaderValue::try_from(out).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::{ChainBuilder, grpc_message};
    use crate::{ScopeKind, WindowLimit};

    #[test]
    fn two_limits_of_one_scope_and_window_are_one_count_the_stricter() {
        let chain = ChainBuilder::new("a")
            .limit(ScopeKind::Key, WindowLimit::per_minute(20))
            .limit(ScopeKind::Customer, WindowLimit::per_minute(60))
            .limit(ScopeKind::Key, WindowLimit::per_minute(10))
            .limit(ScopeKind::Key, WindowLimit::per_minute(30))
            .limit(ScopeKind::Key, WindowLimit::per_hour(100))
            .build(&["k", "ip"]);
        let limits: Vec<(ScopeKind, WindowLimit)> = chain
            .limits()
            .iter()
            .map(|l| (l.scope(), l.limit()))
            .collect();
        assert_eq!(
            limits,
            [
                (ScopeKind::Key, WindowLimit::per_minute(10)),
                (ScopeKind::Customer, WindowLimit::per_minute(60)),
                (ScopeKind::Key, WindowLimit::per_hour(100)),
            ]
        );
    }

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(
            grpc_message("rate limited, retry after 12 ms"),
            "rate%20limited,%20retry%20after%2012%20ms"
        );
        assert_eq!(
            grpc_message("100% {x}?\n\u{e9}"),
            "100%25%20%7Bx%7D%3F%0A%C3%A9"
        );
    }
}
