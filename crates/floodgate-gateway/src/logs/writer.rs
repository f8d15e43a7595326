//! The log's writer: lines gathered in memory and written to their destination (stderr) by a
//! thread of their own, many at a time (docs/design.md §8).
//!
//! Written by the worker that logs them, each request line would cost its worker a `write`
//! system call (2 to 4 µs on this project's machines, a tenth of a request's whole cost), and a
//! destination that stops reading (a full pipe to a stalled log collector) would stop every
//! worker at its next line: every request of the process waiting on the log. Here a line is
//! copied into a buffer under a lock; the writer thread takes the whole buffer every
//! [`FLUSH_EVERY`], or sooner once it holds [`WAKE_AT`], and writes it in one call. A
//! destination that does not keep up makes the buffer grow to [`MAX_HELD`]; the lines that do
//! not fit are dropped and counted, and the count written as a line of its own when the writer
//! can write again. A buffer that fills while the writer is blocked is set aside whole and a new
//! one started, never grown by copying what it holds under the lock. What is buffered when the
//! guard is dropped (the process's end) is written before the drop returns; a line logged after
//! that is written at once, by the thread that logs it.

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing_subscriber::fmt::MakeWriter;

/// How long a line may wait in the buffer.
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// A buffer this large is written at once.
pub const WAKE_AT: usize = 64 * 1024;
/// The most the buffer holds; lines past it are dropped.
pub const MAX_HELD: usize = 8 * 1024 * 1024;

#[derive(Debug, Default)]
struct Pending {
    /// The lines, in the buffer being filled.
    lines: Vec<u8>,
    /// Earlier buffers that filled while the writer was blocked, oldest first: written before
    /// `lines`.
    full: Vec<Vec<u8>>,
    /// The bytes `full` holds.
    full_len: usize,
    /// Lines dropped since the last write, the buffer full.
    dropped: u64,
    /// The writer is writing a batch it took (outside the lock).
    writing: bool,
    /// Someone waits for what is buffered to be written ([`flush`]).
    urgent: bool,
    /// No more lines: the writer writes what is left and ends.
    closed: bool,
    /// The writer has written everything and ended.
    done: bool,
}

impl Pending {
    /// Whether everything buffered so far is written.
    fn written(&self) -> bool {
        self.lines.is_empty() && self.full.is_empty() && self.dropped == 0 && !self.writing
    }

    /// The bytes held, not yet taken by the writer.
    fn held(&self) -> usize {
        self.full_len + self.lines.len()
    }
}

#[derive(Default)]
struct Shared {
    pending: Mutex<Pending>,
    /// The destination, once the writer has ended: a line logged after is written to it at
    /// once.
    after: Mutex<Option<Box<dyn Write + Send>>>,
    /// Wakes the writer: the buffer reached [`WAKE_AT`], someone flushes, or the log closes.
    wake: Condvar,
    /// Wakes those waiting for a batch to be written, or for the writer's end.
    wrote: Condvar,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits on `pending` until `until` holds or `within` has passed; whether it holds.
    fn wait_until(
        &self,
        mut pending: MutexGuard<'_, Pending>,
        within: Duration,
        until: impl Fn(&Pending) -> bool,
    ) -> bool {
        let deadline = Instant::now() + within;
        while !until(&pending) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            pending = self
                .wrote
                .wait_timeout(pending, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Has the writer write what is buffered now, and waits for it, for at most
    /// [`FLUSH_WITHIN`]; nothing if this thread holds the buffer.
    fn flush(&self) {
        let mut pending = match self.pending.try_lock() {
            Ok(pending) => pending,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        pending.urgent = true;
        self.wake.notify_one();
        self.wait_until(pending, FLUSH_WITHIN, |p| p.written() || p.done);
    }

    /// Closes the log and waits until what it buffered is written, for at most
    /// [`CLOSE_WITHIN`] (a destination that never reads must not hold the process's exit).
    /// Whether it was.
    fn close(&self) -> bool {
        let mut pending = self.lock();
        pending.closed = true;
        self.wake.notify_one();
        self.wait_until(pending, CLOSE_WITHIN, |p| p.done)
    }
}

/// How long closing the log waits for its lines to be written.
pub const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// The process's log writer, for [`close`].
static PROCESS_LOG: OnceLock<Arc<Shared>> = OnceLock::new();

/// Writes what the process's log has buffered and closes it (lines logged after are dropped):
/// for a process about to exit without unwinding to its [`Buffered`] guard
/// (`std::process::exit`). Waits at most [`CLOSE_WITHIN`]. Does nothing if no log writer was
/// started.
pub fn close() {
    if let Some(shared) = PROCESS_LOG.get() {
        shared.close();
    }
}

/// How long [`flush`] waits.
pub const FLUSH_WITHIN: Duration = Duration::from_secs(1);

/// Writes what the process's log has buffered now, waiting at most [`FLUSH_WITHIN`]: for a
/// panic's message, printed straight to stderr, to come after the lines that led to it. Does
/// nothing on the writer's own thread, on a thread that holds the buffer (a panic in the middle
/// of logging), or if no log writer was started.
pub fn flush() {
    let Some(shared) = PROCESS_LOG.get() else {
        return;
    };
    if std::thread::current().name() == Some(THREAD_NAME) {
        return;
    }
    shared.flush();
}

/// The writer thread's name.
const THREAD_NAME: &str = "floodgate-log";

/// The process's stderr as a file of its own (a duplicate of its descriptor), so that the
/// writer thread, blocked on a destination that does not read, does not hold the standard
/// library's lock on stderr: a message printed with `eprintln!` (a start that fails, a panic)
/// is not held up by it. Where the descriptor cannot be duplicated, stderr itself.
pub fn stderr() -> Box<dyn Write + Send> {
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        if let Ok(fd) = io::stderr().as_fd().try_clone_to_owned() {
            return Box::new(std::fs::File::from(fd));
        }
    }
    Box::new(io::stderr())
}

/// Where `tracing`'s lines go ([`MakeWriter`]): into the buffer of a [`Buffered`].
#[derive(Clone, Debug)]
pub struct Lines {
    shared: Arc<Shared>,
}

/// The writer thread; dropping it writes what is buffered and ends the thread.
#[derive(Debug)]
pub struct Buffered {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Buffered {
    /// Starts the process's writer thread, writing to `out` ([`close`] closes it); its
    /// [`Lines`] take the lines.
    pub fn start_for_process<W: Write + Send + 'static>(out: W) -> io::Result<(Buffered, Lines)> {
        let (buffered, lines) = Buffered::start(out)?;
        let _ = PROCESS_LOG.set(Arc::clone(&buffered.shared));
        Ok((buffered, lines))
    }

    /// Starts a writer thread writing to `out`; its [`Lines`] take the lines.
    pub fn start<W: Write + Send + 'static>(out: W) -> io::Result<(Buffered, Lines)> {
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name(THREAD_NAME.to_owned())
            .spawn({
                let shared = Arc::clone(&shared);
                move || write_until_closed(&shared, out)
            })?;
        let lines = Lines {
            shared: Arc::clone(&shared),
        };
        Ok((
            Buffered {
                shared,
                thread: Some(thread),
            },
            lines,
        ))
    }
}

impl Drop for Buffered {
    fn drop(&mut self) {
        // A writer still blocked on its destination is left to the process's exit.
        if self.shared.close()
            && let Some(thread) = self.thread.take()
        {
            let _ = thread.join();
        }
    }
}

/// The writer thread's loop: takes the buffer whole and writes it, until closed and empty.
fn write_until_closed<W: Write + Send + 'static>(shared: &Shared, mut out: W) {
    let mut spare = Vec::new();
    let mut pending = shared.lock();
    loop {
        if pending.held() < WAKE_AT && !pending.closed && !pending.urgent {
            pending = shared
                .wake
                .wait_timeout(pending, FLUSH_EVERY)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        std::mem::swap(&mut pending.lines, &mut spare);
        let full = std::mem::take(&mut pending.full);
        pending.full_len = 0;
        let dropped = std::mem::take(&mut pending.dropped);
        pending.urgent = false;
        pending.writing = true;
        drop(pending);
        // Failures are not reported: the log is where they would go.
        for lines in full.iter().chain([&spare]).filter(|l| !l.is_empty()) {
            let _ = out.write_all(lines);
        }
        drop(full);
        if dropped > 0 {
            let _ = writeln!(
                out,
                "floodgate: {dropped} log lines dropped: the log's destination did not keep up"
            );
        }
        let _ = out.flush();
        // Kept for the next turn, unless a burst made it large.
        spare.clear();
        if spare.capacity() > WAKE_AT * 4 {
            spare = Vec::new();
        }
        pending = shared.lock();
        pending.writing = false;
        if pending.closed && pending.written() {
            // Lines logged from here are written by their threads (under `pending`'s lock
            // until `done` is seen, so none of them comes before what was buffered).
            *shared.after.lock().unwrap_or_else(PoisonError::into_inner) = Some(Box::new(out));
            pending.done = true;
            shared.wrote.notify_all();
            return;
        }
        shared.wrote.notify_all();
    }
}

/// One line's writer: `tracing` writes each formatted line with one `write_all`.
#[derive(Debug)]
pub struct Line<'a> {
    shared: &'a Shared,
}

impl Write for Line<'_> {
    fn write(&mut self, line: &[u8]) -> io::Result<usize> {
        let mut pending = self.shared.lock();
        if pending.done {
            // The process is ending, its writer gone: written here and now.
            drop(pending);
            let mut after = self
                .shared
                .after
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(out) = after.as_mut() {
                let _ = out.write_all(line);
                let _ = out.flush();
            }
            return Ok(line.len());
        }
        let held = pending.held();
        if held + line.len() > MAX_HELD {
            pending.dropped += 1;
            return Ok(line.len());
        }
        if pending.lines.len() >= WAKE_AT
            && pending.lines.len() + line.len() > pending.lines.capacity()
        {
            // Full while the writer is away: set aside, and a new buffer begun, rather than
            // this one grown (a copy of all it holds, with every worker's next line waiting).
            let next = Vec::with_capacity((2 * pending.lines.len()).min(MAX_HELD / 8));
            let full = std::mem::replace(&mut pending.lines, next);
            pending.full_len += full.len();
            pending.full.push(full);
        }
        let was_below = held < WAKE_AT;
        pending.lines.extend_from_slice(line);
        let wake = was_below && pending.held() >= WAKE_AT;
        drop(pending);
        if wake {
            self.shared.wake.notify_one();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Lines {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Line<'a> {
        Line {
            shared: &self.shared,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    /// A destination that sends each write to the test, and can be held shut.
    struct Out {
        writes: mpsc::Sender<Vec<u8>>,
        gate: Arc<Mutex<()>>,
    }

    impl Write for Out {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let _open = self.gate.lock().unwrap();
            let _ = self.writes.send(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn start() -> (Buffered, Lines, mpsc::Receiver<Vec<u8>>, Arc<Mutex<()>>) {
        let (tx, rx) = mpsc::channel();
        let gate = Arc::new(Mutex::new(()));
        let (buffered, lines) = Buffered::start(Out {
            writes: tx,
            gate: Arc::clone(&gate),
        })
        .unwrap();
        (buffered, lines, rx, gate)
    }

    fn log(lines: &Lines, text: &str) {
        lines.make_writer().write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn lines_are_written_together_in_order_and_all_by_the_end() {
        let (buffered, lines, rx, _gate) = start();
        for i in 0..1_000 {
            log(&lines, &format!("line {i}\n"));
        }
        drop(buffered);
        let written: Vec<u8> = rx.try_iter().flatten().collect();
        let expected: String = (0..1_000).map(|i| format!("line {i}\n")).collect();
        assert_eq!(String::from_utf8(written).unwrap(), expected);
    }

    #[test]
    fn a_line_logged_after_the_end_is_written_at_once() {
        let (buffered, lines, rx, _gate) = start();
        log(&lines, "before\n");
        drop(buffered);
        log(&lines, "after\n");
        let written: Vec<u8> = rx.try_iter().flatten().collect();
        assert_eq!(written, b"before\nafter\n");
    }

    #[test]
    fn a_flush_returns_once_what_was_logged_is_written() {
        let (buffered, lines, rx, _gate) = start();
        for i in 0..10 {
            log(&lines, &format!("line {i}\n"));
            buffered.shared.flush();
            let written: Vec<u8> = rx.try_iter().flatten().collect();
            assert_eq!(written, format!("line {i}\n").into_bytes());
        }
    }

    #[test]
    fn a_line_waits_at_most_a_flush_interval() {
        let (_buffered, lines, rx, _gate) = start();
        log(&lines, "one\n");
        // Bounded far past FLUSH_EVERY: only a line never written fails.
        let got = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(got, b"one\n");
    }

    #[test]
    fn a_buffer_filled_while_the_writer_is_blocked_is_set_aside_not_grown() {
        let (buffered, lines, rx, gate) = start();
        let shut = gate.lock().unwrap();
        // The first line goes to the writer, which blocks on it; 4 MiB more wait.
        log(&lines, "first\n");
        while !buffered.shared.lock().writing {
            buffered.shared.wake.notify_one();
            std::thread::yield_now();
        }
        let n = 4 * 1024 * 1024 / 16;
        for i in 0..n {
            log(&lines, &format!("{i:015}\n"));
        }
        {
            let pending = buffered.shared.lock();
            assert!(pending.full.len() > 1, "{} set aside", pending.full.len());
            assert!(pending.lines.capacity() <= MAX_HELD / 8);
            assert!(pending.full.iter().all(|l| l.capacity() <= MAX_HELD / 8));
        }
        drop(shut);
        drop(buffered);
        let written: Vec<u8> = rx.try_iter().flatten().collect();
        let text = String::from_utf8(written).unwrap();
        let expected: String = std::iter::once("first\n".to_owned())
            .chain((0..n).map(|i| format!("{i:015}\n")))
            .collect();
        assert!(text == expected, "every line written once, in order");
    }

    #[test]
    fn a_destination_that_does_not_read_costs_lines_not_waits() {
        let (buffered, lines, rx, gate) = start();
        let shut = gate.lock().unwrap();
        // The writer takes what is buffered and blocks on the shut destination; everything
        // after fills the buffer to its bound, and the rest is dropped, at once.
        let line = "x".repeat(1023) + "\n";
        let n = 3 * MAX_HELD / line.len();
        for _ in 0..n {
            log(&lines, &line);
        }
        drop(shut);
        drop(buffered);
        let written: Vec<u8> = rx.try_iter().flatten().collect();
        let text = String::from_utf8(written).unwrap();
        let kept = text.matches(&line).count();
        assert!(kept < n, "{kept} of {n} kept");
        assert!(kept * line.len() >= MAX_HELD / 2, "{kept} kept");
        // One report a batch that followed drops (the writer may have taken a batch after
        // the first drops and before the destination shut it out).
        let reported: usize = text
            .lines()
            .filter_map(|l| {
                l.strip_prefix("floodgate: ")?
                    .strip_suffix(" log lines dropped: the log's destination did not keep up")
            })
            .map(|n| n.parse::<usize>().unwrap())
            .sum();
        assert_eq!(reported, n - kept);
    }
}
