//! Where the proxy's log lines go: standard error, written in batches.
//!
//! Writing a line costs a system call and, behind a file or a container runtime's pipe, work for
//! whoever reads it; with one line per request that is one per request on the serving threads.
//! Lines at `INFO` and below are appended to a buffer that a thread of its own writes out once
//! per flush interval (as nginx's `access_log … buffer= flush=` does), so a serving thread only
//! copies its line. A `WARN` or `ERROR` line is written at once, after everything buffered before
//! it: the order of lines is kept and a problem is in the log when it happens.
//!
//! The buffer is bounded ([`MAX_BUFFERED`]): the line that fills it writes it out, as an
//! unbuffered line would. What is buffered is written when [`LogFlush`] is dropped (the end of
//! `main`) and by the panic hook; a process killed outright loses at most one interval of lines.
//! A zero interval writes every line at once.

use std::io::{self, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// Bytes of log lines held at most before they are written out (about a hundred request lines
/// per KiB and thread at 500 requests/s take a twentieth of it in an interval of 100 ms).
pub(crate) const MAX_BUFFERED: usize = 256 * 1024;

/// A `MakeWriter` for the subscriber: buffered or at-once lines, see the module.
#[derive(Clone)]
pub(crate) struct LogWriter {
    shared: Arc<Shared>,
}

struct Shared {
    /// Lines not yet written.
    pending: Mutex<Vec<u8>>,
    /// Signalled when `pending` stops being empty.
    ready: Condvar,
    /// Held while writing: batches and at-once lines reach the sink in the order they were made.
    out: Mutex<Out>,
    buffered: bool,
}

struct Out {
    sink: Box<dyn Write + Send>,
    /// The previous batch's allocation, swapped with `pending` to take the next.
    spare: Vec<u8>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while a lock was held leaves bytes, not broken invariants: go on logging.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LogWriter {
    /// Lines to standard error, buffered for `flush_interval` (none: at once).
    pub(crate) fn stderr(flush_interval: Duration) -> Self {
        Self::to(Box::new(io::stderr()), flush_interval)
    }

    /// Lines to `sink`; with a non-zero interval, starts the thread that writes them out.
    pub(crate) fn to(sink: Box<dyn Write + Send>, flush_interval: Duration) -> Self {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Vec::new()),
            ready: Condvar::new(),
            out: Mutex::new(Out {
                sink,
                spare: Vec::new(),
            }),
            buffered: !flush_interval.is_zero(),
        });
        if shared.buffered {
            let flusher = shared.clone();
            // Without the thread lines would still go out, each time the buffer fills.
            let started = std::thread::Builder::new()
                .name("mlscope-log".into())
                .spawn(move || flusher.flush_every(flush_interval));
            if let Err(e) = started {
                eprintln!(
                    "mlscope-proxy: log lines are written at once: no thread to batch them ({e})"
                );
                return Self::to(lock(&shared.out).sink_take(), Duration::ZERO);
            }
        }
        Self { shared }
    }

    /// Writes out what is buffered now.
    pub(crate) fn flush(&self) -> io::Result<()> {
        self.shared.write_out(&[])
    }

    /// For the panic hook: as [`Self::flush`], unless a write is under way on this thread or
    /// another (the panic may have struck inside it).
    fn flush_if_free(&self) {
        if let Ok(mut out) = self.shared.out.try_lock() {
            self.shared.write_locked(&mut out, &[]).ok();
        }
    }
}

impl Out {
    fn sink_take(&mut self) -> Box<dyn Write + Send> {
        std::mem::replace(&mut self.sink, Box::new(io::sink()))
    }
}

impl Shared {
    fn flush_every(&self, interval: Duration) {
        loop {
            {
                let mut pending = lock(&self.pending);
                while pending.is_empty() {
                    pending = self
                        .ready
                        .wait(pending)
                        .unwrap_or_else(PoisonError::into_inner);
                }
            }
            // The first line of a batch waits at most this long.
            std::thread::sleep(interval);
            // Nowhere to report a failed write but the log itself.
            self.write_out(&[]).ok();
        }
    }

    fn buffer(&self, line: &[u8]) -> io::Result<()> {
        let mut pending = lock(&self.pending);
        let was_empty = pending.is_empty();
        pending.extend_from_slice(line);
        let full = pending.len() >= MAX_BUFFERED;
        drop(pending);
        if full {
            self.write_out(&[])
        } else {
            if was_empty {
                self.ready.notify_one();
            }
            Ok(())
        }
    }

    /// What is pending, then `line`, in one write.
    fn write_out(&self, line: &[u8]) -> io::Result<()> {
        let mut out = lock(&self.out);
        self.write_locked(&mut out, line)
    }

    fn write_locked(&self, out: &mut Out, line: &[u8]) -> io::Result<()> {
        std::mem::swap(&mut *lock(&self.pending), &mut out.spare);
        out.spare.extend_from_slice(line);
        let written = if out.spare.is_empty() {
            Ok(())
        } else {
            let Out { sink, spare } = out;
            sink.write_all(spare).and_then(|()| sink.flush())
        };
        out.spare.clear();
        // A burst's allocation is not kept for good.
        out.spare.shrink_to(MAX_BUFFERED);
        written
    }
}

/// One log line's writer: `tracing-subscriber` formats a line and writes it with one `write_all`.
pub(crate) struct Line<'a> {
    shared: &'a Shared,
    at_once: bool,
}

impl Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.at_once || !self.shared.buffered {
            self.shared.write_out(buf)?;
        } else {
            self.shared.buffer(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        Line {
            shared: &self.shared,
            at_once: false,
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Self::Writer {
        Line {
            shared: &self.shared,
            // WARN and ERROR (tracing orders levels by verbosity).
            at_once: *meta.level() <= Level::WARN,
        }
    }
}

/// Writes out what is buffered when dropped, and from the panic hook meanwhile: `main` holds it
/// until it returns.
#[must_use = "lines still buffered are written when this is dropped"]
pub struct LogFlush(LogWriter);

impl LogFlush {
    /// Installs a panic hook that writes out the buffer before the default report.
    pub(crate) fn install(writer: LogWriter) -> Self {
        let on_panic = writer.clone();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            on_panic.flush_if_free();
            previous(info);
        }));
        Self(writer)
    }
}

impl Drop for LogFlush {
    fn drop(&mut self) {
        self.0.flush().ok();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plumbing::json_lines::tests::Capture;
    use std::time::Instant;

    fn line(writer: &LogWriter, level: Level, text: &str) {
        let mut w = if level <= Level::WARN {
            Line {
                shared: &writer.shared,
                at_once: true,
            }
        } else {
            writer.make_writer()
        };
        w.write_all(format!("{text}\n").as_bytes()).unwrap();
    }

    fn wait_for(capture: &Capture, what: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = capture.text();
            if what(&text) {
                return text;
            }
            assert!(Instant::now() < deadline, "log never showed it: {text:?}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn info_lines_wait_for_the_flush_and_a_warning_goes_at_once_after_them() {
        let capture = Capture::default();
        // An interval no test outlasts: only the warning and the explicit flush write.
        let writer = LogWriter::to(Box::new(capture.clone()), Duration::from_secs(3600));
        line(&writer, Level::INFO, "one");
        line(&writer, Level::DEBUG, "two");
        assert_eq!(capture.text(), "");
        line(&writer, Level::WARN, "three");
        assert_eq!(capture.text(), "one\ntwo\nthree\n");
        line(&writer, Level::INFO, "four");
        line(&writer, Level::ERROR, "five");
        line(&writer, Level::INFO, "six");
        assert_eq!(capture.text(), "one\ntwo\nthree\nfour\nfive\n");
        drop(LogFlush::install(writer));
        assert_eq!(capture.text(), "one\ntwo\nthree\nfour\nfive\nsix\n");
    }

    #[test]
    fn buffered_lines_are_written_within_the_interval() {
        let capture = Capture::default();
        let writer = LogWriter::to(Box::new(capture.clone()), Duration::from_millis(20));
        for round in 0..3 {
            line(&writer, Level::INFO, &format!("round {round}"));
            wait_for(&capture, |text| text.contains(&format!("round {round}\n")));
        }
    }

    #[test]
    fn a_zero_interval_writes_every_line_at_once() {
        let capture = Capture::default();
        let writer = LogWriter::to(Box::new(capture.clone()), Duration::ZERO);
        line(&writer, Level::INFO, "now");
        assert_eq!(capture.text(), "now\n");
    }

    #[test]
    fn the_buffer_never_holds_more_than_its_bound() {
        let capture = Capture::default();
        let writer = LogWriter::to(Box::new(capture.clone()), Duration::from_secs(3600));
        let text = "x".repeat(999);
        let lines = 3 * MAX_BUFFERED / 1000;
        for _ in 0..lines {
            line(&writer, Level::INFO, &text);
            assert!(lock(&writer.shared.pending).len() < MAX_BUFFERED);
        }
        // Written out each time it filled, without a flush.
        assert!(capture.text().len() >= 2 * MAX_BUFFERED);
        writer.flush().unwrap();
        assert_eq!(capture.text().len(), lines * 1000);
    }

    #[test]
    fn lines_from_many_threads_arrive_whole_and_all_of_them() {
        let capture = Capture::default();
        let writer = LogWriter::to(Box::new(capture.clone()), Duration::from_millis(1));
        std::thread::scope(|scope| {
            for thread in 0..4 {
                let writer = &writer;
                scope.spawn(move || {
                    for n in 0..2000 {
                        let level = if n % 97 == 0 {
                            Level::WARN
                        } else {
                            Level::INFO
                        };
                        line(
                            writer,
                            level,
                            &format!("thread {thread} line {n} {}", "y".repeat(n % 300)),
                        );
                    }
                });
            }
        });
        writer.flush().unwrap();
        let text = capture.text();
        let mut seen = std::collections::HashSet::new();
        for l in text.lines() {
            let words: Vec<&str> = l.split(' ').collect();
            assert_eq!(words.len(), 5, "a line mixed with another: {l:?}");
            let n: usize = words[3].parse().unwrap();
            assert_eq!(words[4], "y".repeat(n % 300), "{l:?}");
            assert!(
                seen.insert((words[1].to_owned(), n)),
                "written twice: {l:?}"
            );
        }
        assert_eq!(seen.len(), 4 * 2000);
        // Each thread's lines in the order it wrote them.
        for thread in 0..4 {
            let ns: Vec<usize> = text
                .lines()
                .filter(|l| l.starts_with(&format!("thread {thread} ")))
                .map(|l| l.split(' ').nth(3).unwrap().parse().unwrap())
                .collect();
            assert!(
                ns.windows(2).all(|w| w[0] < w[1]),
                "thread {thread} out of order"
            );
        }
    }
}
