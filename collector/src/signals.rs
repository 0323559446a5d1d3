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
pub fn block() -> nix::Result<SignalMask> {
    let mut set = SigSet::empty();
    for signal in HANDLED {
        set.add(signal);
    }
    set.thread_block()?;
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
