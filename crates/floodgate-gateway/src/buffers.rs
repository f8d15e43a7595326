//! The process's bound on request bodies held before admission (`[server] max_buffered_mib`,
//! docs/design.md §7): a metered completion's body is read whole before it is admitted, and
//! without a bound on their sum one caller's concurrent uploads could take the process's memory,
//! and every other tenant with it.
//!
//! A body takes room for its bytes before they are read: all of it at once when its length is
//! announced, frame by frame (twice over, for the copy that joins its frames) when it is
//! chunked. Room is taken in the key's own share first, at most half of the total, so that one
//! tenant cannot starve the rest, then in the total. A key's share is made when it first takes
//! room, by its index (its tally slot, which a key keeps across reloads and no other key takes):
//! a key a reload adds has its share as the keys of the start do. A body waits for room until its read's
//! deadline (`[server] header_timeout_sec` from the request's start), then is refused with 503
//! `server_busy`, charged nothing. The room is given back when the body has been forwarded (or
//! dropped).

use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Room for bodies: the process's total and each key's share of it. Every worker of a process
/// shares one (a cheap clone).
#[derive(Clone, Debug)]
pub struct Buffers(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    total: Arc<Semaphore>,
    /// One share a key, by the key's index; grown as keys take room. A std lock: held only to
    /// clone a share out, never across an `.await`.
    per_key: RwLock<Vec<Arc<Semaphore>>>,
    /// How many bytes the total holds.
    total_bytes: usize,
}

/// Room taken for one body; given back when dropped. Each take is merged into one pair of
/// permits (the key's share's and the total's), so a body of many small frames costs the same
/// bookkeeping as one of a single frame.
#[derive(Debug)]
pub struct Room {
    permits: Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)>,
    bytes: usize,
}

/// No room came before the deadline.
#[derive(Debug, PartialEq, Eq)]
pub struct Busy;

impl Buffers {
    /// Room for `total_bytes` of bodies at once, each key holding at most half of it.
    pub fn new(total_bytes: usize) -> Buffers {
        Buffers(Arc::new(Inner {
            total: Arc::new(Semaphore::new(total_bytes.min(Semaphore::MAX_PERMITS))),
            per_key: RwLock::new(Vec::new()),
            total_bytes,
        }))
    }

    /// The share of the key of index `key`, made if it has none yet.
    fn share_of(&self, key: usize) -> Arc<Semaphore> {
        let shares = self
            .0
            .per_key
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = shares.get(key) {
            return Arc::clone(s);
        }
        drop(shares);
        let mut shares = self
            .0
            .per_key
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let room = self.share().clamp(1, Semaphore::MAX_PERMITS);
        while shares.len() <= key {
            shares.push(Arc::new(Semaphore::new(room)));
        }
        Arc::clone(&shares[key])
    }

    /// The most one body can ever take: a key's share.
    pub fn share(&self) -> usize {
        self.0.total_bytes / 2
    }

    /// Bytes not taken now, of the total.
    pub fn available(&self) -> usize {
        self.0.total.available_permits()
    }

    /// Room for no bytes yet, to grow with [`Buffers::take`].
    pub fn room(&self) -> Room {
        Room {
            permits: None,
            bytes: 0,
        }
    }

    /// Takes room for `bytes` more in `room` for the key of index `key`, waiting until
    /// `deadline` at most.
    pub async fn take(
        &self,
        room: &mut Room,
        key: usize,
        bytes: usize,
        deadline: Instant,
    ) -> Result<(), Busy> {
        if bytes == 0 {
            return Ok(());
        }
        // Never more than a key's share in all: that much could never fit (the config keeps
        // `max_body_mib` within a share, so only a chunked body's frames come here with more).
        if room.bytes() + bytes > self.share() {
            return Err(Busy);
        }
        let n = u32::try_from(bytes).map_err(|_| Busy)?;
        let share = self.share_of(key);
        let both = async {
            let mine = share.acquire_many_owned(n).await.map_err(|_| Busy)?;
            let all = Arc::clone(&self.0.total)
                .acquire_many_owned(n)
                .await
                .map_err(|_| Busy)?;
            Ok::<_, Busy>((mine, all))
        };
        let taken = tokio::time::timeout_at(deadline, both)
            .await
            .map_err(|_| Busy)??;
        match &mut room.permits {
            Some((mine, all)) => {
                mine.merge(taken.0);
                all.merge(taken.1);
            }
            None => room.permits = Some(taken),
        }
        room.bytes += bytes;
        Ok(())
    }
}

impl Room {
    /// The bytes this room holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// The most of a held body handed to the connection at once. hyper asks for the next piece
/// only once it has written most of the last: the room is given back when the last piece has
/// gone, not when the whole body was handed over (and still sits in a write queue).
const PIECE: usize = 64 * 1024;

/// A body read before admission, forwarded with its room, in pieces of [`PIECE`] (slices of one
/// buffer, not copies): the room is given back when the body has been sent (or dropped).
pub struct HeldBody {
    data: Bytes,
    _room: Room,
}

impl HeldBody {
    /// `data`, holding `room` until it is sent.
    pub fn new(data: Bytes, room: Room) -> HeldBody {
        HeldBody { data, _room: room }
    }
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let data = &mut self.get_mut().data;
        if data.is_empty() {
            return Poll::Ready(None);
        }
        let piece = data.split_to(data.len().min(PIECE));
        Poll::Ready(Some(Ok(Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(50)
    }

    #[tokio::test]
    async fn a_key_holds_at_most_half_and_the_rest_is_left_to_others() {
        let buffers = Buffers::new(1000);
        let mut a = buffers.room();
        buffers.take(&mut a, 0, 500, soon()).await.unwrap();
        let mut more = buffers.room();
        assert_eq!(buffers.take(&mut more, 0, 1, soon()).await, Err(Busy));
        let mut b = buffers.room();
        buffers.take(&mut b, 1, 500, soon()).await.unwrap();
        assert_eq!(buffers.available(), 0);
        drop(a);
        assert_eq!(buffers.available(), 500);
        buffers.take(&mut more, 0, 500, soon()).await.unwrap();
        assert_eq!(more.bytes(), 500);
    }

    #[tokio::test]
    async fn a_body_of_many_frames_is_one_room_given_back_whole() {
        let buffers = Buffers::new(1_000_000);
        let mut room = buffers.room();
        for _ in 0..100_000 {
            buffers.take(&mut room, 0, 2, soon()).await.unwrap();
        }
        assert_eq!(room.bytes(), 200_000);
        assert_eq!(buffers.available(), 800_000);
        drop(room);
        assert_eq!(buffers.available(), 1_000_000);
    }

    #[tokio::test]
    async fn a_key_new_to_the_process_holds_at_most_half_too() {
        // Index 7: a key no body has come from yet (one a reload added, say).
        let buffers = Buffers::new(1000);
        let mut a = buffers.room();
        buffers.take(&mut a, 7, 500, soon()).await.unwrap();
        let mut more = buffers.room();
        assert_eq!(buffers.take(&mut more, 7, 1, soon()).await, Err(Busy));
        // Its share is its own: the keys below it in index have theirs whole.
        let mut b = buffers.room();
        buffers.take(&mut b, 3, 500, soon()).await.unwrap();
        drop((a, b));
        buffers.take(&mut more, 7, 500, soon()).await.unwrap();
    }

    #[tokio::test]
    async fn a_body_waits_for_room_until_its_deadline() {
        let buffers = Buffers::new(100);
        let mut a = buffers.room();
        let mut b = buffers.room();
        buffers.take(&mut a, 0, 50, soon()).await.unwrap();
        buffers.take(&mut b, 1, 50, soon()).await.unwrap();
        let waiting = {
            let buffers = buffers.clone();
            tokio::spawn(async move {
                let mut c = buffers.room();
                let far = Instant::now() + Duration::from_secs(10);
                buffers.take(&mut c, 2, 40, far).await.map(|()| c)
            })
        };
        tokio::task::yield_now().await;
        drop(a);
        let c = waiting.await.unwrap().unwrap();
        assert_eq!(c.bytes(), 40);
        let mut d = buffers.room();
        assert_eq!(buffers.take(&mut d, 0, 20, soon()).await, Err(Busy));
    }

    #[tokio::test]
    async fn a_held_body_gives_its_room_back_when_sent() {
        use http_body_util::BodyExt;
        let buffers = Buffers::new(100);
        let mut room = buffers.room();
        buffers.take(&mut room, 0, 10, soon()).await.unwrap();
        let body = HeldBody::new(Bytes::from_static(b"0123456789"), room);
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(10));
        assert_eq!(buffers.available(), 90);
        let sent = body.collect().await.unwrap().to_bytes();
        assert_eq!(&sent[..], b"0123456789");
        assert_eq!(buffers.available(), 100);
    }
}
