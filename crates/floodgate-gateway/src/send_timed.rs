//! A client connection whose writes must make progress: a caller that stops reading (a stream
//! it no longer consumes, a receive window left full) is cut off once a write has waited
//! `[server] header_timeout_sec` with nothing taken, as nginx's `send_timeout` does
//! (docs/gateway.md, "Choices made where the design is silent"). Without it such a caller
//! would hold its connection, its upstream connection and its concurrency slots for good, and
//! a graceful shutdown for its whole drain.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// `inner` with a deadline on each write that waits: `timeout` from when it first could not go.
pub(crate) struct SendTimed<T> {
    inner: T,
    timeout: Duration,
    /// The stall timer, made on the first write that waits.
    timer: Option<Pin<Box<Sleep>>>,
    /// Whether `timer` times the write waiting now.
    armed: bool,
}

impl<T> SendTimed<T> {
    pub(crate) fn new(inner: T, timeout: Duration) -> SendTimed<T> {
        SendTimed {
            inner,
            timeout,
            timer: None,
            armed: false,
        }
    }

    /// What a write that went (or failed) gives: the timer stands down.
    fn went<R>(&mut self, done: io::Result<R>) -> Poll<io::Result<R>> {
        self.armed = false;
        Poll::Ready(done)
    }

    /// A write that waits: pending until the socket takes it or, `timeout` after it first
    /// waited, failed.
    fn waits<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        let deadline = Instant::now() + self.timeout;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !self.armed {
            timer.as_mut().reset(deadline);
            self.armed = true;
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the caller took nothing of the answer for header_timeout_sec",
            ))),
            Poll::Pending => Poll::Pending,
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
            Poll::Ready(done) => self.went(done),
            Poll::Pending => self.waits(cx),
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
