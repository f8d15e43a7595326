//! A request body that goes to the upstream as the caller sends it, timed as nginx times one
//! (`client_body_timeout`, `proxy_read_timeout`): the caller must hand over each piece within
//! `[server] header_timeout_sec` of the last, and the upstream's `[upstream] timeout_sec` to
//! answer counts from the upload's last progress, not from its start, since an upstream cannot
//! answer a request before it has it (docs/gateway.md, "Choices made where the design is silent").

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::time::Instant;

use crate::stall::Stall;

/// When an upload last made progress (its last piece handed to the connection, or its end),
/// and whether the connection waits for the caller's next piece now. Shared by the body (which
/// the connection polls) and the wait for the answer.
#[derive(Debug)]
pub(super) struct Progress {
    start: Instant,
    /// Nanoseconds from `start` to the last progress.
    last: AtomicU64,
    /// Whether the connection is waiting for the caller's next piece: the caller's time, which
    /// the upload's own timer bounds, not the upstream's.
    waiting: AtomicBool,
}

impl Progress {
    /// Progress as of now.
    pub(super) fn new() -> Progress {
        Progress {
            start: Instant::now(),
            last: AtomicU64::new(0),
            waiting: AtomicBool::new(false),
        }
    }

    fn mark(&self) {
        let nanos = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last.fetch_max(nanos, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_nanos(self.last.load(Ordering::Relaxed))
    }
}

/// The error an upload fails with when its caller sent nothing for `idle`.
#[derive(Debug)]
pub(super) struct Stalled;

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the caller stopped sending the request body")
    }
}

impl std::error::Error for Stalled {}

/// Whether `e`, or an error it was caused by, is [`Stalled`].
pub(super) fn stalled(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<Stalled>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// A caller's body on its way upstream: fails with [`Stalled`] when the caller sends nothing
/// for `idle` while the connection waits for it, and marks [`Progress`] at each piece.
pub(super) struct Upload {
    inner: Body,
    progress: Arc<Progress>,
    /// Times the connection's waits for the caller's next piece.
    stall: Stall,
}

impl Upload {
    pub(super) fn new(inner: Body, idle: Duration, progress: Arc<Progress>) -> Upload {
        Upload {
            inner,
            progress,
            stall: Stall::new(idle),
        }
    }
}

impl http_body::Body for Upload {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.stall.over();
                this.progress.waiting.store(false, Ordering::Relaxed);
                this.progress.mark();
                Poll::Ready(frame)
            }
            Poll::Pending => {
                this.progress.waiting.store(true, Ordering::Relaxed);
                match this.stall.waits(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(axum::Error::new(Stalled)))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// `send`'s output, or `None` once `timeout` has passed since the upload's last progress with
/// no answer. A wait for the caller's next piece is not the upstream's: the upload's own timer
/// ends it (a caller pausing mid-upload for less than `header_timeout_sec` is no upstream
/// timeout, however short `timeout_sec` is).
pub(super) async fn answered_within<F: Future>(
    send: F,
    timeout: Duration,
    progress: &Progress,
) -> Option<F::Output> {
    let mut send = pin!(send);
    let mut deadline = progress.last() + timeout;
    loop {
        if let Ok(out) = tokio::time::timeout_at(deadline, &mut send).await {
            return Some(out);
        }
        let now = Instant::now();
        if progress.waiting.load(Ordering::Relaxed) {
            deadline = now + timeout;
        } else if progress.last() + timeout <= now {
            return None;
        } else {
            deadline = progress.last() + timeout;
        }
    }
}
