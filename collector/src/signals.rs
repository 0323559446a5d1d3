//! Signals arrive through a signalfd read by one thread: they are blocked in every thread
//! (so [`block`] must run before any thread is spawned). A blocked mask survives fork and exec,
//! and std's `Command` does not clear it: the child of wrapper mode gets an empty mask and the
//! default actions back from [`restore_in_child`], between fork and exec, or it would never
//! receive the SIGTERM forwarded to it.

use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::thread::{self, JoinHandle};

use nix::errno::Errno;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, SigmaskHow, Signal};
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

/// The signals whose action the collector's process changes: [`HANDLED`], and SIGPIPE, which
/// the Rust runtime ignores (an ignore, unlike a handler, survives exec).
const CHANGED: [Signal; 6] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGPIPE,
];

/// Makes `command` start with no signal blocked and the default action for every signal the
/// collector changed, as it would as a container's first process: set in the child between
/// fork and exec, before anything can be delivered to the new program.
#[allow(unsafe_code)]
pub fn restore_in_child(command: &mut Command) {
    // Built here, in the parent: the child only makes the two system calls.
    let default = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
    let nothing = SigSet::empty();
    // SAFETY: the closure runs in the forked child, where only async-signal-safe functions may
    // be called: it calls sigaction(2) and sigprocmask(2) (both on POSIX's list) with values
    // built before the fork, allocates nothing, takes no lock and touches no shared state; an
    // error is an errno turned into `io::Error` without allocating. Actions first, mask second:
    // a signal unblocked by the second call meets the default action, never a handler of the
    // collector (and the collector installs none).
    unsafe {
        command.pre_exec(move || {
            for signal in CHANGED {
                nix::sys::signal::sigaction(signal, &default)?;
            }
            nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(&nothing), None)?;
            Ok(())
        });
    }
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
