//! Ending leftovers as a container runtime ends a container: SIGTERM (with SIGCONT, so that a
//! stopped process can act on it), a grace to save and exit, then SIGKILL for what remains.
//! A process is signalled only while `/proc` still shows it with the start time it was listed
//! with, so a pid reused meanwhile is never hit; the collector's own children (everything
//! re-parented to it) are reaped as they go, so they cannot linger as zombies.

use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::{Leftover, Scope};

/// How long SIGKILLed processes get to be gone. One that is still there afterwards is in
/// uninterruptible sleep (stuck in a file system or a driver) and is reported, not waited for.
const AFTER_SIGKILL: Duration = Duration::from_secs(5);

const POLL: Duration = Duration::from_millis(20);

/// What ending the leftovers did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ending {
    /// Gone within the grace after SIGTERM.
    pub by_sigterm: usize,
    /// Still there after the grace (or started during it), gone after SIGKILL.
    pub by_sigkill: usize,
    /// Gone by themselves between being listed and being signalled.
    pub gone_before: usize,
    /// Still there after SIGKILL, or not the collector's to signal (EPERM).
    pub survived: Vec<i32>,
}

impl Ending {
    /// `2 by SIGTERM, 1 by SIGKILL`, plus what ended by itself or could not be ended.
    pub fn summary(&self) -> String {
        let mut summary = format!(
            "{} by SIGTERM, {} by SIGKILL",
            self.by_sigterm, self.by_sigkill
        );
        if self.gone_before > 0 {
            summary.push_str(&format!(", {} ended by themselves", self.gone_before));
        }
        if !self.survived.is_empty() {
            let pids: Vec<String> = self.survived.iter().map(i32::to_string).collect();
            summary.push_str(&format!(
                ", {} still running: {}",
                self.survived.len(),
                pids.join(" ")
            ));
        }
        summary
    }
}

/// One process: its pid and the start time that tells it from a later one with the same pid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Target {
    pid: i32,
    start_time: u64,
}

enum Signalled {
    Delivered,
    Gone,
    Refused(Errno),
}

/// Ends `leftovers`: SIGTERM, up to `grace` for them to go, then SIGKILL for those left and for
/// any process of the scope started meanwhile. Blocks until done (at most `grace` plus a few
/// seconds).
pub fn end(scope: &Scope, leftovers: &[Leftover], grace: Duration) -> Ending {
    let mut ending = Ending::default();
    let mut terminated = Vec::new();
    for leftover in leftovers {
        let target = Target {
            pid: leftover.pid,
            start_time: leftover.start_time,
        };
        match send(scope, target, Signal::SIGTERM) {
            Signalled::Delivered => {
                let _ = send(scope, target, Signal::SIGCONT);
                tracing::info!(
                    pid = leftover.pid,
                    command = %leftover.command,
                    "sent SIGTERM to a process the command left behind"
                );
                terminated.push(target);
            }
            Signalled::Gone => ending.gone_before += 1,
            Signalled::Refused(error) => {
                tracing::warn!(pid = leftover.pid, command = %leftover.command, %error, "cannot signal a process the command left behind");
                ending.survived.push(leftover.pid);
            }
        }
    }
    let sent = terminated.len();
    let mut remaining = terminated.clone();
    wait_until_gone(scope, &mut remaining, Instant::now() + grace);
    ending.by_sigterm = sent - remaining.len();
    for target in terminated.iter().filter(|t| !remaining.contains(t)) {
        tracing::info!(pid = target.pid, "a leftover process ended after SIGTERM");
    }
    // Whatever started during the grace (a supervisor restarting a worker) gets no grace.
    for (stat, _) in scope.processes() {
        let target = Target {
            pid: stat.pid,
            start_time: stat.start_time,
        };
        if !remaining.contains(&target) && !ending.survived.contains(&stat.pid) {
            remaining.push(target);
        }
    }
    let mut killed = Vec::new();
    for target in remaining {
        match send(scope, target, Signal::SIGKILL) {
            Signalled::Delivered => {
                tracing::warn!(
                    pid = target.pid,
                    grace = %humantime::format_duration(grace),
                    "sent SIGKILL to a leftover process still running after the grace"
                );
                killed.push(target);
            }
            Signalled::Gone if terminated.contains(&target) => ending.by_sigterm += 1,
            Signalled::Gone => {}
            Signalled::Refused(error) => {
                tracing::warn!(pid = target.pid, %error, "cannot SIGKILL a leftover process");
                ending.survived.push(target.pid);
            }
        }
    }
    let sent = killed.len();
    wait_until_gone(scope, &mut killed, Instant::now() + AFTER_SIGKILL);
    ending.by_sigkill = sent - killed.len();
    for target in killed {
        tracing::warn!(
            pid = target.pid,
            "a leftover process is still there after SIGKILL (uninterruptible sleep?)"
        );
        ending.survived.push(target.pid);
    }
    ending
}

/// Signals `target` if it is still the process that was listed.
fn send(scope: &Scope, target: Target, signal: Signal) -> Signalled {
    if is_gone(scope, target) {
        return Signalled::Gone;
    }
    match kill(Pid::from_raw(target.pid), signal) {
        Ok(()) => Signalled::Delivered,
        Err(Errno::ESRCH) => Signalled::Gone,
        Err(error) => Signalled::Refused(error),
    }
}

/// Polls until every target is gone or `deadline` passes; `targets` keeps those still there.
fn wait_until_gone(scope: &Scope, targets: &mut Vec<Target>, deadline: Instant) {
    loop {
        targets.retain(|&t| !is_gone(scope, t));
        if targets.is_empty() || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(POLL.min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// Gone: reaped here (the collector's own child), or no longer in `/proc` with its start time
/// as a live process (a zombie of another parent has ended too).
fn is_gone(scope: &Scope, target: Target) -> bool {
    match waitpid(Pid::from_raw(target.pid), Some(WaitPidFlag::WNOHANG)) {
        Ok(WaitStatus::StillAlive) => false,
        Ok(_) => true,
        // ECHILD: not the collector's child; `/proc` tells.
        Err(_) => scope
            .proc
            .stat(target.pid)
            .is_none_or(|s| s.start_time != target.start_time || s.has_ended()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_how_each_ended() {
        let ending = Ending {
            by_sigterm: 2,
            by_sigkill: 1,
            gone_before: 0,
            survived: vec![],
        };
        assert_eq!(ending.summary(), "2 by SIGTERM, 1 by SIGKILL");
        let stuck = Ending {
            by_sigterm: 0,
            by_sigkill: 0,
            gone_before: 1,
            survived: vec![77, 78],
        };
        assert_eq!(
            stuck.summary(),
            "0 by SIGTERM, 0 by SIGKILL, 1 ended by themselves, 2 still running: 77 78"
        );
    }
}
