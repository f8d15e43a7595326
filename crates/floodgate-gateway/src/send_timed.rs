//! A client connection whose writes must make progress: a caller that stops reading (a stream
//! it no longer consumes, a receive window left full) is cut off once a write has waited
//! `[server] header_timeout_sec` with nothing taken, as nginx's `send_timeout` does
//! (docs/gateway.md, "Choices made where the design is silent"). Without it such a caller
//! would hold its connection, its upstream connection and its concurrency slots for good, and
//! a graceful shutdown for its whole drain.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::stall::Stall;

/// `inner` with a deadline on each write that waits: `timeout` from when it first could not go.
pub(crate) struct SendTimed<T> {
    inner: T,
    stall: Stall,
    /// The error of a write that waited too long.
    stalled: &'static str,
}

impl<T> SendTimed<T> {
    pub(crate) fn new(inner: T, timeout: Duration) -> SendTimed<T> {
        SendTimed::saying(
            inner,
            timeout,
            "the caller took nothing of the answer for header_timeout_sec",
        )
    }

    /// [`new`](Self::new), whose stalled write fails with `stalled`.
    pub(crate) fn saying(inner: T, timeout: Duration, stalled: &'static str) -> SendTimed<T> {
        SendTimed {
            inner,
            stall: Stall::new(timeout),
            stalled,
        }
    }

    /// Runs a write: `write`'s result, timed while it waits.
    fn timed<R>(
        &mut self,
        cx: &mut Context<'_>,
        write: impl FnOnce(Pin<&mut T>, &mut Context<'_>) -> Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>>
    where
        T: Unpin,
    {
        match write(Pin::new(&mut self.inner), cx) {
            Poll::Ready(done) => {
                self.stall.over();
                Poll::Ready(done)
            }
            Poll::Pending => match self.stall.waits(cx) {
                Poll::Ready(()) => {
                    Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, self.stalled)))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for SendTimed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for SendTimed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.timed(cx, |io, cx| io.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.timed(cx, |io, cx| io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.timed(cx, |io, cx| io.poll_flush(cx))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.timed(cx, |io, cx| io.poll_shutdown(cx))
    }
}
