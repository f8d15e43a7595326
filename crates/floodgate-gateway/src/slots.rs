//! The concurrency slots an admitted request holds (docs/design.md §10): taken by its chain's
//! admission, given back when its answer is done — its body sent or dropped (the caller gone, a
//! stream cut), the upstream failed, its realtime session closed.
//!
//! A [`Slots`] guard gives them back when dropped, in a task of its own (a drop cannot wait),
//! tracked by the [`Charger`] from the drop to the store's answer, so that a draining worker and
//! a test can await the release like a charge. [`Slots::give_back`] gives them back where the
//! end must wait for it: [`HoldingBody`] keeps a guard for as long as a response body is being
//! sent, and holds the body's end back until the release has landed, so that a caller never
//! sees its answer end while its slots are still taken (a realtime session likewise, before its
//! caller's connection is shut).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use axum::body::Body;
use axum::http::{Method, StatusCode};
use bytes::Bytes;
use floodgate::{Chain, Lease};
use http_body::{Body as _, Frame, SizeHint};

use crate::charge::{Charger, Held, now_or_in_a_task};
use crate::store::GatewayStore;

/// An admitted request's slots: given back once, by [`give_back`](Self::give_back) or when
/// dropped.
#[derive(Debug)]
pub struct Slots {
    release: Option<Release>,
}

#[derive(Debug)]
struct Release {
    charger: Charger,
    chain: Arc<Chain>,
    lease: Lease,
}

impl Slots {
    /// The slots `lease` holds in `chain`'s concurrency limits, given back on `charger`'s store.
    pub fn new(charger: &Charger, chain: Arc<Chain>, lease: Lease) -> Slots {
        Slots {
            release: Some(Release {
                charger: charger.clone(),
                chain,
                lease,
            }),
        }
    }

    /// Gives the slots back: resolves once the store has answered (at its first poll on the
    /// memory store, which gives them back at once). Dropped before, the release goes on in a
    /// task of its own, as a dropped guard's does.
    pub fn give_back(mut self) -> Releasing {
        Releasing(self.release.take().map(Release::start))
    }
}

impl Release {
    /// The store call that gives the slots back, tracked from now until it returns (not while
    /// the request runs).
    fn start(self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let held: Held = self.charger.hold();
        Box::pin(async move {
            let store: &GatewayStore = self.charger.store();
            if let Err(e) = self.chain.release(store, Some(self.lease)).await {
                // On Redis the slots lapse at the lease's end instead.
                tracing::debug!(error = %e, "giving back concurrency slots failed");
            }
            drop(held);
        })
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        // Nothing waits for it: it goes on in a task.
        drop(Releasing(self.release.take().map(Release::start)));
    }
}

/// Slots being given back ([`Slots::give_back`]): resolves once the store has answered.
pub struct Releasing(Option<Pin<Box<dyn Future<Output = ()> + Send>>>);

impl Future for Releasing {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(release) = &mut self.0 {
            ready!(release.as_mut().poll(cx));
            self.0 = None;
        }
        Poll::Ready(())
    }
}

impl Drop for Releasing {
    fn drop(&mut self) {
        if let Some(release) = self.0.take() {
            // Outside a runtime (the process is ending) the slots are not given back: on Redis
            // they lapse at their lease's end; the memory store ends with the process.
            now_or_in_a_task(release);
        }
    }
}

/// Whether an answer of `status` to a request of `method`, with `body`, has no body to send:
/// hyper then drops the body without polling it (`HEAD`, 1xx, 204, 304, a length of 0), so its
/// end cannot wait for the slots ([`HoldingBody`]).
pub fn bodiless(method: &Method, status: StatusCode, body: &Body) -> bool {
    method == Method::HEAD
        || status.is_informational()
        || matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED)
        || body.is_end_stream()
        || body.size_hint().exact() == Some(0)
}

/// `body`, holding `slots` until its caller has it ([`HoldingBody`]); an answer with nothing to
/// send ([`bodiless`]) gives them back first, so that it too reaches its caller only once they
/// are free.
pub async fn held_until_sent(body: Body, slots: Option<Slots>, bodiless: bool) -> Body {
    match slots {
        None => body,
        Some(slots) if bodiless => {
            slots.give_back().await;
            body
        }
        Some(slots) => Body::new(HoldingBody::new(body, slots)),
    }
}

/// A response body that holds its request's slots until it has been sent whole, or dropped.
///
/// Its last frame (the last data frame, the trailers, an error, or the end itself) is held back
/// until the slots have been given back, and [`is_end_stream`](http_body::Body::is_end_stream)
/// says `false` while they are held: the caller sees its answer end only once its slots are
/// free, so that its next request finds them free (docs/design.md §10). On Redis that is one
/// store round trip on the tail of the answer; on the memory store, none.
pub struct HoldingBody {
    inner: Body,
    slots: Option<Slots>,
    /// The slots being given back, and the last frame to yield once they are.
    ending: Option<(Releasing, Polled)>,
}

/// What the inner body yielded: a frame, an error, or (`None`) its end.
type Polled = Option<Result<Frame<Bytes>, axum::Error>>;

impl HoldingBody {
    /// `inner`, holding `slots` until it ends.
    pub fn new(inner: Body, slots: Slots) -> HoldingBody {
        HoldingBody {
            inner,
            slots: Some(slots),
            ending: None,
        }
    }

    /// Whether `polled`, just yielded by the inner body, is its last: nothing after it goes to
    /// the caller. A data frame is the last once the inner body says it is at its end or has no
    /// byte left (a response of known length ends with its last byte, whether or not its body
    /// is polled again); trailers end a message.
    fn is_last(&self, polled: &Polled) -> bool {
        match polled {
            None | Some(Err(_)) => true,
            Some(Ok(frame)) => {
                frame.is_trailers()
                    || self.inner.is_end_stream()
                    || self.inner.size_hint().exact() == Some(0)
            }
        }
    }
}

impl http_body::Body for HoldingBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Polled> {
        let this = self.get_mut();
        if let Some((releasing, _)) = &mut this.ending {
            ready!(Pin::new(releasing).poll(cx));
            return Poll::Ready(this.ending.take().and_then(|(_, last)| last));
        }
        let polled = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if !this.is_last(&polled) {
            return Poll::Ready(polled);
        }
        let Some(slots) = this.slots.take() else {
            return Poll::Ready(polled);
        };
        // Sent whole (or broken off): the request is done now, not when hyper drops the body;
        // its end waits for the slots to be back.
        let mut releasing = slots.give_back();
        if Pin::new(&mut releasing).poll(cx).is_ready() {
            return Poll::Ready(polled);
        }
        this.ending = Some((releasing, polled));
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.slots.is_none() && self.ending.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.ending {
            // Only the frame held back is left.
            Some((_, Some(Ok(frame)))) => {
                SizeHint::with_exact(frame.data_ref().map_or(0, |d| d.len() as u64))
            }
            Some(_) => SizeHint::with_exact(0),
            None => self.inner.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use floodgate::store::MemoryStore;
    use floodgate::{InFlightLimit, ScopeKind};
    use http_body_util::{BodyExt, StreamBody};

    use super::*;
    use crate::metrics::Metrics;

    /// A chain with one slot on a memory store, and a charger on that store.
    fn one_slot() -> (Arc<Chain>, Charger) {
        let chain = Chain::new(Vec::new()).with_in_flight(vec![InFlightLimit::new(
            "t",
            ScopeKind::Key,
            "k",
            1,
        )]);
        let store: GatewayStore = MemoryStore::new().into();
        (Arc::new(chain), Charger::new(store, Metrics::new()))
    }

    /// The slot, taken.
    async fn take(chain: &Arc<Chain>, charger: &Charger) -> Slots {
        let d = chain.admit(charger.store(), 1).await.unwrap();
        assert!(d.admitted);
        Slots::new(charger, Arc::clone(chain), d.lease.unwrap())
    }

    /// Whether the slot is free now (taken and given back at once to tell).
    async fn free(chain: &Arc<Chain>, charger: &Charger) -> bool {
        let d = chain.admit(charger.store(), 1).await.unwrap();
        chain.release(charger.store(), d.lease).await.unwrap();
        d.admitted
    }

    fn holding(frames: Vec<Result<Frame<Bytes>, axum::Error>>, slots: Slots) -> HoldingBody {
        let inner = Body::new(StreamBody::new(futures_util::stream::iter(frames)));
        HoldingBody::new(inner, slots)
    }

    #[tokio::test]
    async fn the_last_frame_goes_out_with_the_slot_back_trailers_and_errors_too() {
        let (chain, charger) = one_slot();
        let data = || Ok(Frame::data(Bytes::from_static(b"x")));
        let trailers = || Ok(Frame::trailers(axum::http::HeaderMap::new()));
        let broken = || Err(axum::Error::new(std::io::Error::other("cut")));
        for (last, ends) in [(trailers(), false), (broken(), true)] {
            let mut body = holding(vec![data(), last], take(&chain, &charger).await);
            assert!(body.frame().await.unwrap().is_ok());
            assert!(!free(&chain, &charger).await, "held mid-body");
            let last = body.frame().await.unwrap();
            assert_eq!(last.is_err(), ends);
            assert!(free(&chain, &charger).await, "back with the last frame");
        }
        // An empty body is not at its end while it holds its slot; its end gives it back.
        let mut body = HoldingBody::new(Body::empty(), take(&chain, &charger).await);
        assert!(!http_body::Body::is_end_stream(&body));
        assert!(body.frame().await.is_none());
        assert!(http_body::Body::is_end_stream(&body));
        assert!(free(&chain, &charger).await);
        // Dropped before its end (the caller gone): the slot goes back as the body goes.
        let body = holding(vec![data(), data()], take(&chain, &charger).await);
        drop(body);
        assert!(free(&chain, &charger).await);
        charger.settled().await;
    }
}
