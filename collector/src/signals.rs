//! Signals arrive through a signalfd read by one thread: they are blocked in every thread
//! (so [`block`] must run before any thread is spawned), and the child of wrapper mode starts
//! with an empty mask again (std resets it on spawn).

use std::io;
use std::thread::{self, JoinHandle};

use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::SignalFd;

/// The signals the collector handles: SIGTERM and SIGINT stop it (or are forwarded to the
/// child), the others are only forwarded.
pub const HANDLED: [Signal; 5] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
];

/// The blocked set, to be read by [`spawn_listener`].
#[derive(Debug)]
pub struct SignalMask(SigSet);

/// Blocks [`HANDLED`] in the calling thread and every thread it spawns from now on.
///
/// A signal ignored when the collector starts (a shell starts background jobs with SIGINT and
/// SIGQUIT ignored) would never reach the signalfd, and a wrapped command would inherit the
/// ignore and could not even trap it: each handled signal is first set back to its default
/// action, so the collector receives it and the command starts with the default, as it would as
/// a container's first process.
#[allow(unsafe_code)]
pub fn block() -> nix::Result<SignalMask> {
    let mut set = SigSet::empty();
    for signal in HANDLED {
        set.add(signal);
    }
    set.thread_block()?;
    for signal in HANDLED {
        // SAFETY: setting the default action installs no handler; the signal is blocked, so
        // nothing is delivered between this and the signalfd read.
        unsafe { nix::sys::signal::signal(signal, nix::sys::signal::SigHandler::SigDfl) }?;
    }
    Ok(SignalMask(set))
}

/// One received signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub signal: Signal,
    /// Sent by the kernel on behalf of a terminal (Ctrl-C, hang-up): the terminal's foreground
    /// process group, the wrapped command included, got it too.
    pub from_terminal: bool,
}

/// Calls `on_signal` for every handled signal, on a thread of its own.
pub fn spawn_listener(
    mask: SignalMask,
    mut on_signal: impl FnMut(Received) + Send + 'static,
) -> io::Result<JoinHandle<()>> {
    let fd = SignalFd::new(&mask.0).map_err(io::Error::from)?;
    thread::Builder::new()
        .name("mlscope-signals".into())
        .spawn(move || loop {
            match fd.read_signal() {
                Ok(Some(info)) => {
                    let Ok(signal) = Signal::try_from(info.ssi_signo as i32) else {
                        continue;
                    };
                    on_signal(Received {
                        signal,
                        from_terminal: info.ssi_code == nix::libc::SI_KERNEL,
                    });
                }
                Ok(None) | Err(Errno::EINTR) => continue,
                Err(error) => {
                    tracing::warn!(%error, "reading signals failed; signals are no longer handled");
                    return;
                }
            }
        })
}
