//! The concurrency slots an admitted request holds (docs/design.md §10): taken by its chain's
//! admission, given back when its answer is done — its body sent or dropped (the caller gone, a
//! stream cut), the upstream failed, its realtime session closed.
//!
//! A [`Slots`] guard gives them back when dropped, in a task of its own (a drop cannot wait),
//! tracked by the [`Charger`] from the drop to the store's answer, so that a draining worker and
//! a test can await the release like a charge. [`HoldingBody`] keeps a guard for as long as a response body is being sent.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use floodgate::{Chain, Lease};
use http_body::{Frame, SizeHint};

use crate::charge::{Charger, Held, now_or_in_a_task};
use crate::store::GatewayStore;

/// An admitted request's slots: given back once, when dropped.
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
}

impl Drop for Slots {
    fn drop(&mut self) {
        let Some(r) = self.release.take() else {
            return;
        };
        // Tracked from now until the store call returns (not while the request runs).
        let held: Held = r.charger.hold();
        // Outside a runtime (the process is ending) the slots are not given back: on Redis
        // they lapse at their lease's end; the memory store ends with the process.
        now_or_in_a_task(Box::pin(async move {
            let store: &GatewayStore = r.charger.store();
            if let Err(e) = r.chain.release(store, Some(r.lease)).await {
                // On Redis the slots lapse at the lease's end instead.
                tracing::debug!(error = %e, "giving back concurrency slots failed");
            }
            drop(held);
        }));
    }
}

/// A response body that holds its request's slots until it has been sent whole, or dropped.
pub struct HoldingBody {
    inner: Body,
    slots: Option<Slots>,
}

impl HoldingBody {
    /// `inner`, holding `slots` until it ends.
    pub fn new(inner: Body, slots: Slots) -> HoldingBody {
        HoldingBody {
            inner,
            slots: Some(slots),
        }
    }
}

impl http_body::Body for HoldingBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = polled {
            // Sent whole (or broken off): the request is done now, not when hyper drops it.
            this.slots = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
