//! Group commit, shared by the batched operations (a step's admissions, reads and charges,
//! releases): while one call of an
//! operation is in flight, its callers queue, and the next call carries them all, in the order
//! they came. An idle store sends each at once, alone, so batching adds no wait; after a call, the
//! sender lets the requests that arrived during it queue before it takes the next batch
//! ([`gather`]). The sending runs in a task of its own, so a caller that gives up never strands
//! the others.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use ::redis::cluster_routing::Slot;

use super::conn::Failure;
use crate::chain::ChainLimit;
use crate::period::PeriodCounter;

/// One queue per Redis Cluster slot, or the one queue of a single server (`None`): a script's
/// keys must lie in one slot, so a cluster's calls batch by slot, each slot with a sender of its
/// own (docs/redis.md, "Redis Cluster"). A slot's queue, once made, stays: at most one per slot.
pub(super) struct Lanes<Q> {
    single: Arc<Mutex<Q>>,
    slots: Mutex<HashMap<Slot, Arc<Mutex<Q>>, foldhash::fast::RandomState>>,
}

impl<Q: Default> Default for Lanes<Q> {
    fn default() -> Self {
        Lanes {
            single: Arc::default(),
            slots: Mutex::default(),
        }
    }
}

impl<Q: Default> Lanes<Q> {
    /// The queue of `slot` (`None`: a single server's).
    pub(super) fn lane(&self, slot: Option<Slot>) -> Arc<Mutex<Q>> {
        match slot {
            None => Arc::clone(&self.single),
            Some(slot) => {
                let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
                Arc::clone(slots.entry(slot).or_default())
            }
        }
    }
}

/// One queued call of a batched operation.
pub(super) trait Queued: Send + 'static {
    /// Its time argument: a pinned time (µs), or `None` for the store's clock. One batch shares
    /// one time argument.
    fn time(&self) -> Option<u64>;
    /// How many keys it names.
    fn keys(&self) -> usize;
    /// Answers it with `failure`.
    fn fail(self, failure: &Failure);
    /// Whether it may wait for a call that cannot (a charge for the next
    /// admission): see [`serve`].
    fn lingers(&self) -> bool {
        false
    }
    /// Whether its caller has stopped waiting for it (dropped its answer): it can be left out.
    fn abandoned(&self) -> bool {
        false
    }
}

/// The most calls a queue holds. Past it the queue first drops the calls whose callers gave up
/// (clients that disconnected while Redis was slow, which would otherwise pile up at no cost to
/// them), then fails a new call at once as an outage (`on_error` decides), rather than growing
/// without bound while Redis answers slower than calls come. About 6 s of a slow Redis's full
/// batches (512 calls a 100 ms round trip), and a few MiB.
const MAX_PENDING: usize = 32_768;

/// The longest a queue holding only calls that linger waits for one that does not, before
/// it sends them alone ([`serve`]).
const LINGER: std::time::Duration = std::time::Duration::from_millis(1);

/// The most rounds of the runtime's ready tasks a sender lets run before taking its next batch,
/// while each round adds calls to a queue that holds less than a full batch ([`gather`]).
const GATHER_ROUNDS: usize = 4;

/// Calls waiting for the next batch, whether a task is sending batches, and whether that task
/// is lingering for a call that does not linger ([`serve`]), which wakes it.
pub(super) struct Queue<T> {
    pending: Vec<T>,
    sending: bool,
    lingering: bool,
    wake: Arc<tokio::sync::Notify>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            pending: Vec::new(),
            sending: false,
            lingering: false,
            wake: Arc::default(),
        }
    }
}

/// What one batch may carry: its calls, and the keys of all its calls past its first.
#[derive(Clone, Copy)]
pub(super) struct Bounds {
    pub(super) calls: usize,
    pub(super) keys: usize,
}

fn lock<T>(queue: &Mutex<Queue<T>>) -> MutexGuard<'_, Queue<T>> {
    // Pushes and drains cannot leave the queue half-changed.
    queue.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where a queued call's answer comes.
pub(super) type Answer<R> = tokio::sync::oneshot::Receiver<Result<R, Failure>>;

/// Queues the call `make` builds around its reply channel in `lane`, and starts a task that
/// sends `lane`'s batches with `send` (given a clone of `ctx`, the store) if none does: the
/// sending runs in a task of its own, so a caller that gives up never strands the others.
pub(super) fn submit<T, R, S, F, Fut>(
    ctx: &S,
    lane: Arc<Mutex<Queue<T>>>,
    bounds: Bounds,
    make: impl FnOnce(tokio::sync::oneshot::Sender<Result<R, Failure>>) -> T,
    send: F,
) -> Answer<R>
where
    T: Queued,
    S: Clone + Send + Sync + 'static,
    F: Fn(S, Vec<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    enqueue(ctx, lane, bounds, make(tx), send);
    rx
}

/// Queues `call`, which answers itself (a charge calling back where it lands), as [`submit`]
/// queues one it builds around a reply channel.
pub(super) fn enqueue<T, S, F, Fut>(
    ctx: &S,
    lane: Arc<Mutex<Queue<T>>>,
    bounds: Bounds,
    call: T,
    send: F,
) where
    T: Queued,
    S: Clone + Send + Sync + 'static,
    F: Fn(S, Vec<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    // The sender is a task: outside a runtime (a charge made from a drop at shutdown, say) the
    // call fails at once rather than wait in a queue no sender would ever serve.
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        call.fail(&Failure::Unavailable(
            "no runtime to send the call on".into(),
        ));
        return;
    };
    if push(&lane, call) {
        let ctx = ctx.clone();
        // Held before the task is spawned: a task dropped before it first runs (its runtime
        // shutting down) still lets the queue go.
        let serving = Serving::new(lane);
        drop(runtime.spawn(async move {
            serve(serving, bounds, |batch| send(ctx.clone(), batch)).await;
        }));
    }
}

/// A queue's sender's hold on it, taken when [`push`] marks the queue as served. If sending stops
/// before the queue is empty (a panic, a runtime shutting down, a task dropped before it first
/// ran), the queue must not stay marked: the queued calls fail and the next call starts a sender
/// again.
pub(super) struct Serving<T: Queued> {
    queue: Arc<Mutex<Queue<T>>>,
    done: bool,
}

impl<T: Queued> Serving<T> {
    pub(super) fn new(queue: Arc<Mutex<Queue<T>>>) -> Serving<T> {
        Serving { queue, done: false }
    }
}

impl<T: Queued> Drop for Serving<T> {
    fn drop(&mut self) {
        if !self.done {
            let queued = {
                let mut q = lock(&self.queue);
                q.sending = false;
                q.lingering = false;
                std::mem::take(&mut q.pending)
            };
            let why = Failure::Unavailable("the batch sender stopped".into());
            for call in queued {
                call.fail(&why);
            }
        }
    }
}

/// The answer of a call queued with [`submit`]; `what` names its batch if the sender dropped it.
pub(super) async fn answer<R>(answer: Answer<R>, what: &str) -> Result<R, Failure> {
    answer
        .await
        .map_err(|_| Failure::Unavailable(format!("{what} batch abandoned")))?
}

/// Puts `calls` back at the front of `queue`, in their order, before everything queued since
/// they were taken: they came first. The queue's sender, which took them, sends them next.
pub(super) fn put_back<T>(queue: &Mutex<Queue<T>>, mut calls: Vec<T>) {
    let mut q = lock(queue);
    let later = std::mem::take(&mut q.pending);
    calls.extend(later);
    q.pending = calls;
}

/// Queues `call`; says whether the caller must start a sender ([`serve`]). A call that does not
/// linger wakes a sender lingering for it.
fn push<T: Queued>(queue: &Mutex<Queue<T>>, call: T) -> bool {
    let refused = {
        let mut q = lock(queue);
        if q.pending.len() >= MAX_PENDING {
            q.pending.retain(|c| !c.abandoned());
        }
        if q.pending.len() < MAX_PENDING {
            if q.lingering && !call.lingers() {
                q.lingering = false;
                q.wake.notify_one();
            }
            q.pending.push(call);
            return !std::mem::replace(&mut q.sending, true);
        }
        call
    };
    // Failed with the queue let go: a charge's callback runs here, and may queue a call.
    refused.fail(&Failure::Unavailable(format!(
        "{MAX_PENDING} calls already wait for Redis"
    )));
    false
}

/// Sends batches with `send` until the queue is empty. A batch takes the queued calls in order
/// while they share the first one's time argument and fit `bounds`; once one does not, none after
/// it goes either (calls land in the order they came), and it waits for the next batch.
///
/// Before each batch, if everything queued lingers (charges, which need no answer soon), the
/// sender waits up to [`LINGER`] for a call that does not (the next admission), so that both go
/// in one call: the charges of the responses that ended during a call, or while the queue was
/// idle, ride the next admissions' call instead of one of their own. A call that does not
/// linger never waits: an admission (or a read) goes at once, taking the charges queued before
/// it along. On a quiet store a charge thus lands up to [`LINGER`] late.
///
/// After a batch, before taking the next, the sender lets the requests that arrived during the
/// call reach the queue ([`gather`]); the first batch of an idle queue goes without this.
///
/// `serving` is the sender's hold on the queue ([`Serving`]): let go when the queue is empty, or
/// with the queued calls failed if sending stops early.
pub(super) async fn serve<T, F, Fut>(mut serving: Serving<T>, bounds: Bounds, mut send: F)
where
    T: Queued,
    F: FnMut(Vec<T>) -> Fut,
    Fut: Future<Output = ()>,
{
    let queue = Arc::clone(&serving.queue);
    let queue = &*queue;
    loop {
        let wake = {
            let mut q = lock(queue);
            // A full batch of charges goes at once: waiting would only delay the next.
            let lingers = !q.pending.is_empty()
                && q.pending.len() < bounds.calls
                && q.pending.iter().all(Queued::lingers);
            q.lingering = lingers;
            lingers.then(|| Arc::clone(&q.wake))
        };
        if let Some(wake) = wake {
            let _ = tokio::time::timeout(LINGER, wake.notified()).await;
            lock(queue).lingering = false;
        }
        let batch = {
            let mut q = lock(queue);
            let mut batch = Vec::new();
            let mut rest = Vec::new();
            let mut keys = 0;
            let mut time = None;
            let mut full = false;
            for call in q.pending.drain(..) {
                if !full && *time.get_or_insert(call.time()) == call.time() {
                    let n = call.keys();
                    let fits =
                        batch.is_empty() || (batch.len() < bounds.calls && keys + n <= bounds.keys);
                    if fits {
                        keys += n;
                        batch.push(call);
                        continue;
                    }
                }
                // Past the bounds, or of another time: this call and every one after it wait,
                // so that calls land in the order they came.
                full = true;
                rest.push(call);
            }
            q.pending = rest;
            if batch.is_empty() {
                q.sending = false;
                serving.done = true;
                return;
            }
            batch
        };
        send(batch).await;
        gather(queue, bounds).await;
    }
}

/// Lets the runtime run its ready tasks and poll its I/O, up to [`GATHER_ROUNDS`] times while each
/// round adds calls and the queue holds less than a full batch. When a call returns, the requests
/// whose bytes arrived during it are ready to run but have not yet queued their admissions; taking
/// the next batch at once would send the few queued so far and leave the rest to the call after,
/// one more call for the same requests. `yield_now` defers its wake until the runtime has polled
/// its I/O driver, so one round lets both the ready tasks and the sockets that became readable
/// run. No timer: a round that adds nothing ends the gathering, so a quiet queue waits one round
/// (microseconds), never a fixed time (docs/redis.md, "Batching").
async fn gather<T>(queue: &Mutex<Queue<T>>, bounds: Bounds) {
    let mut queued = lock(queue).pending.len();
    for _ in 0..GATHER_ROUNDS {
        if queued >= bounds.calls {
            return;
        }
        tokio::task::yield_now().await;
        let now = lock(queue).pending.len();
        if now == queued {
            return;
        }
        queued = now;
    }
}

/// The index of `key` in `list` (a batch's distinct keys, 0-based), added (with `item`) if new.
pub(super) fn intern<'a, T>(
    index: &mut HashMap<&'a str, usize, foldhash::fast::RandomState>,
    list: &mut Vec<&'a T>,
    key: &'a str,
    item: &'a T,
) -> usize {
    match index.entry(key) {
        Entry::Occupied(e) => *e.get(),
        Entry::Vacant(e) => {
            list.push(item);
            *e.insert(list.len() - 1)
        }
    }
}

/// A call's distinct keys of one sort, in `KEYS` order, each known by its key.
pub(super) struct Distinct<'a, T> {
    pub(super) list: Vec<&'a T>,
    index: HashMap<&'a str, usize, foldhash::fast::RandomState>,
}

impl<T> Default for Distinct<'_, T> {
    fn default() -> Self {
        Distinct {
            list: Vec::new(),
            index: HashMap::default(),
        }
    }
}

/// A call's distinct windows (limit states).
pub(super) type Windows<'a> = Distinct<'a, ChainLimit>;
/// A call's distinct period counters (after the windows in `KEYS`).
pub(super) type Counters<'a> = Distinct<'a, PeriodCounter>;

impl<'a> Windows<'a> {
    /// The 0-based position of `limit`'s key among the windows, added if new.
    pub(super) fn intern(&mut self, limit: &'a ChainLimit) -> usize {
        intern(&mut self.index, &mut self.list, limit.key(), limit)
    }

    /// Forgets the windows past the first `len`.
    pub(super) fn truncate(&mut self, len: usize) {
        for l in self.list.drain(len..) {
            self.index.remove(l.key());
        }
    }
}

impl<'a> Counters<'a> {
    /// The 0-based position of `counter`'s key among the counters, added if new.
    pub(super) fn intern(&mut self, counter: &'a PeriodCounter) -> usize {
        intern(&mut self.index, &mut self.list, counter.key(), counter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::{Notify, mpsc};

    /// A queued call: an admission, or a charge (which lingers).
    struct Call {
        id: u32,
        lingers: bool,
        time: Option<u64>,
        abandoned: bool,
        failed: Option<Arc<std::sync::atomic::AtomicBool>>,
    }

    impl Queued for Call {
        fn time(&self) -> Option<u64> {
            self.time
        }
        fn keys(&self) -> usize {
            1
        }
        fn fail(self, _: &Failure) {
            if let Some(failed) = self.failed {
                failed.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        fn lingers(&self) -> bool {
            self.lingers
        }
        fn abandoned(&self) -> bool {
            self.abandoned
        }
    }

    const BOUNDS: Bounds = Bounds {
        calls: 16,
        keys: 16,
    };

    /// Starts a sender on `queue` whose every call reports its ids on the returned channel and
    /// returns when `back` is notified.
    fn sender(
        queue: &Arc<Mutex<Queue<Call>>>,
        back: &Arc<Notify>,
    ) -> mpsc::UnboundedReceiver<Vec<u32>> {
        let (sent, calls) = mpsc::unbounded_channel();
        let (queue, back) = (Arc::clone(queue), Arc::clone(back));
        tokio::spawn(async move {
            serve(Serving::new(queue), BOUNDS, |batch: Vec<Call>| {
                let _ = sent.send(batch.iter().map(|c| c.id).collect());
                let back = Arc::clone(&back);
                async move { back.notified().await }
            })
            .await;
        });
        calls
    }

    fn call(id: u32, lingers: bool) -> Call {
        Call {
            id,
            lingers,
            time: None,
            abandoned: false,
            failed: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_behind_a_slow_call_drops_abandoned_calls_then_refuses_new_ones() {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let back = Arc::new(Notify::new());
        push(&queue, call(0, false));
        let mut calls = sender(&queue, &back);
        assert_eq!(calls.recv().await, Some(vec![0]));
        // While that call is out, callers queue and give up, a full queue of them.
        for id in 1..=MAX_PENDING as u32 {
            let mut c = call(id, false);
            c.abandoned = true;
            assert!(!push(&queue, c));
        }
        // A live call finds the queue full: the abandoned ones go, it stays.
        assert!(!push(&queue, call(u32::MAX, false)));
        assert_eq!(lock(&queue).pending.len(), 1);
        // Live calls up to the bound are kept; the next one fails at once.
        for id in 1..MAX_PENDING as u32 {
            assert!(!push(&queue, call(id, false)));
        }
        let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut over = call(0, false);
        over.failed = Some(Arc::clone(&failed));
        assert!(!push(&queue, over));
        assert!(failed.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(lock(&queue).pending.len(), MAX_PENDING);
        back.notify_one();
    }

    #[tokio::test(start_paused = true)]
    async fn calls_of_other_times_keep_their_order() {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let back = Arc::new(Notify::new());
        push(&queue, call(1, false));
        let mut calls = sender(&queue, &back);
        assert_eq!(calls.recv().await, Some(vec![1]));
        // While the call is out: a call pinned at t = 1, one at t = 2, one at t = 1 again. The
        // third must not go before the second, whose time differs from the batch's.
        let timed = |id, t| Call {
            time: Some(t),
            ..call(id, false)
        };
        for c in [timed(2, 1), timed(3, 2), timed(4, 1)] {
            assert!(!push(&queue, c));
        }
        back.notify_one();
        assert_eq!(calls.recv().await, Some(vec![2]));
        back.notify_one();
        assert_eq!(calls.recv().await, Some(vec![3]));
        back.notify_one();
        assert_eq!(calls.recv().await, Some(vec![4]));
        back.notify_one();
    }

    #[tokio::test(start_paused = true)]
    async fn a_charge_queued_during_a_call_rides_the_next_admission() {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let back = Arc::new(Notify::new());
        assert!(
            push(&queue, call(1, false)),
            "an idle queue starts a sender"
        );
        let mut calls = sender(&queue, &back);
        assert_eq!(calls.recv().await, Some(vec![1]));
        // While the first call is out, a response ends: its charge queues.
        assert!(!push(&queue, call(2, true)));
        back.notify_one();
        // The sender waits for company; the next admission comes, and both go in one call.
        tokio::task::yield_now().await;
        assert!(!push(&queue, call(3, false)));
        assert_eq!(calls.recv().await, Some(vec![2, 3]));
        back.notify_one();
    }

    #[tokio::test(start_paused = true)]
    async fn a_charge_with_no_admission_after_it_goes_alone_after_the_linger() {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let back = Arc::new(Notify::new());
        push(&queue, call(1, false));
        let mut calls = sender(&queue, &back);
        assert_eq!(calls.recv().await, Some(vec![1]));
        push(&queue, call(2, true));
        let start = tokio::time::Instant::now();
        back.notify_one();
        assert_eq!(calls.recv().await, Some(vec![2]));
        assert_eq!(start.elapsed(), LINGER, "it waited the linger, no more");
        back.notify_one();
    }

    #[tokio::test(start_paused = true)]
    async fn a_charge_on_an_idle_queue_waits_for_company_then_goes_alone() {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let back = Arc::new(Notify::new());
        assert!(push(&queue, call(1, true)));
        let start = tokio::time::Instant::now();
        let mut calls = sender(&queue, &back);
        assert_eq!(calls.recv().await, Some(vec![1]));
        assert_eq!(start.elapsed(), LINGER, "it waited the linger, no more");
        back.notify_one();
    }

    #[tokio::test(start_paused = true)]
    async fn an_admission_on_an_idle_queue_goes_at_once_with_the_charges_before_it() {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let back = Arc::new(Notify::new());
        assert!(push(&queue, call(1, true)));
        let start = tokio::time::Instant::now();
        let mut calls = sender(&queue, &back);
        // The sender is waiting for company; an admission comes, and both go at once.
        tokio::task::yield_now().await;
        assert!(!push(&queue, call(2, false)));
        assert_eq!(calls.recv().await, Some(vec![1, 2]));
        assert_eq!(start.elapsed(), std::time::Duration::ZERO);
        back.notify_one();
        // The queue empty, the sender stops; an admission alone on the idle queue does not wait
        // either.
        assert_eq!(calls.recv().await, None);
        assert!(
            push(&queue, call(3, false)),
            "an idle queue starts a sender"
        );
        let mut calls = sender(&queue, &back);
        assert_eq!(calls.recv().await, Some(vec![3]));
        assert_eq!(start.elapsed(), std::time::Duration::ZERO);
        back.notify_one();
    }

    #[tokio::test(start_paused = true)]
    async fn requests_ready_when_a_call_returns_join_the_next_batch() {
        let queue = Arc::new(Mutex::new(Queue::default()));
        let back = Arc::new(Notify::new());
        push(&queue, call(1, false));
        let mut calls = sender(&queue, &back);
        assert_eq!(calls.recv().await, Some(vec![1]));
        // While the call is out, one request queues its admission and three more wait for their
        // bytes; the bytes come as the call returns.
        assert!(!push(&queue, call(2, false)));
        let mut bytes = Vec::new();
        let mut parked = Vec::new();
        for id in 3..6 {
            let (arrive, arrival) = tokio::sync::oneshot::channel::<()>();
            let (park, waiting) = tokio::sync::oneshot::channel::<()>();
            let queue = Arc::clone(&queue);
            tokio::spawn(async move {
                let _ = park.send(());
                let _ = arrival.await;
                push(&queue, call(id, false));
            });
            bytes.push(arrive);
            parked.push(waiting);
        }
        for waiting in parked {
            let _ = waiting.await;
        }
        // The sender is woken first, the requests after it: it lets them run before it takes
        // the next batch, so the four go in one call rather than one and then three.
        back.notify_one();
        for arrive in bytes {
            let _ = arrive.send(());
        }
        assert_eq!(calls.recv().await, Some(vec![2, 3, 4, 5]));
        back.notify_one();
        assert_eq!(
            calls.recv().await,
            None,
            "the queue empty, the sender stops"
        );
    }
}
