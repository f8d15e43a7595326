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
//! can write again. What is buffered when the guard is dropped (the process's end) is written
//! before the drop returns.

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
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
    lines: Vec<u8>,
    /// Lines dropped since the last write, the buffer full.
    dropped: u64,
    /// No more lines: the writer writes what is left and ends.
    closed: bool,
    /// The writer has written everything and ended.
    done: bool,
}

#[derive(Debug, Default)]
struct Shared {
    pending: Mutex<Pending>,
    /// Wakes the writer: the buffer reached [`WAKE_AT`], or the log is closing.
    wake: Condvar,
    /// Wakes those waiting for the writer's end.
    ended: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Closes the log and waits until what it buffered is written, for at most
    /// [`CLOSE_WITHIN`] (a destination that never reads must not hold the process's exit).
    /// Whether it was.
    fn close(&self) -> bool {
        let deadline = Instant::now() + CLOSE_WITHIN;
        let mut pending = self.lock();
        pending.closed = true;
        self.wake.notify_one();
        while !pending.done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            pending = self
                .ended
                .wait_timeout(pending, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
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
            .name("floodgate-log".to_owned())
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
fn write_until_closed(shared: &Shared, mut out: impl Write) {
    let mut spare = Vec::new();
    loop {
        let mut pending = shared.lock();
        if pending.lines.len() < WAKE_AT && !pending.closed {
            pending = shared
                .wake
                .wait_timeout(pending, FLUSH_EVERY)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        std::mem::swap(&mut pending.lines, &mut spare);
        let dropped = std::mem::take(&mut pending.dropped);
        let closed = pending.closed;
        drop(pending);
        // Failures are not reported: the log is where they would go.
        if !spare.is_empty() {
            let _ = out.write_all(&spare);
        }
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
        if closed {
            let mut pending = shared.lock();
            if pending.lines.is_empty() {
                pending.done = true;
                shared.ended.notify_all();
                return;
            }
        }
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
            // The process is ending: no writer left.
            return Ok(line.len());
        }
        if pending.lines.len() + line.len() > MAX_HELD {
            pending.dropped += 1;
            return Ok(line.len());
        }
        let was_below = pending.lines.len() < WAKE_AT;
        pending.lines.extend_from_slice(line);
        let wake = was_below && pending.lines.len() >= WAKE_AT;
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
    fn a_line_waits_at_most_a_flush_interval() {
        let (_buffered, lines, rx, _gate) = start();
        log(&lines, "one\n");
        // Bounded far past FLUSH_EVERY: only a line never written fails.
        let got = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_eq!(got, b"one\n");
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
        let report = text.lines().find(|l| l.contains("dropped")).unwrap();
        assert_eq!(
            report,
            format!(
                "floodgate: {} log lines dropped: the log's destination did not keep up",
                n - kept
            )
        );
    }
}
