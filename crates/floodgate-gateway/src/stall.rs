//! The timer of a wait that must end within a time of its start: a write its client takes
//! nothing of ([`crate::send_timed`]), a piece of a request body that does not come
//! (`upstream::upload`).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// A stall timer: armed when a wait begins, stood down when it ends, made once (on the first
/// wait) and reset after, so that a stream of short waits makes no timer each.
pub(crate) struct Stall {
    timeout: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    /// Whether `timer` times the wait under way now.
    armed: bool,
}

impl Stall {
    /// A timer for waits of at most `timeout`.
    pub(crate) fn new(timeout: Duration) -> Stall {
        Stall {
            timeout,
            timer: None,
            armed: false,
        }
    }

    /// The wait is over (what it waited for came): the next one is timed afresh.
    pub(crate) fn over(&mut self) {
        self.armed = false;
    }

    /// Still waiting: ready once `timeout` has passed since the wait began (the first call
    /// since [`over`](Self::over)), else pending, `cx` woken then.
    pub(crate) fn waits(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.armed {
            let deadline = Instant::now() + self.timeout;
            match &mut self.timer {
                Some(timer) => timer.as_mut().reset(deadline),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
            self.armed = true;
        }
        match &mut self.timer {
            Some(timer) => timer.as_mut().poll(cx),
            None => Poll::Pending,
        }
    }
}
