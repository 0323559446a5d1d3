//! Wrapper mode: the training command runs as the collector's child. The collector forwards
//! signals to it, waits for it, exits with its status and records on the run how the rank
//! ended — including an OOM kill, which a SIGKILLed process can never record itself
//! (field-notes §3: such runs otherwise stay `RUNNING` forever with no hint why).

use std::ffi::OsString;
use std::io;
use std::process::{Child, Command};

use nix::errno::Errno;
use nix::sys::signal::{self, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// The variable MLflow's own monitor reads for its owner segment.
pub const NODE_ID_VARIABLE: &str = "MLFLOW_SYSTEM_METRICS_NODE_ID";

/// How the child ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    Exited(i32),
    Signaled(Signal),
}

/// How the child ended and what the container's OOM kill counter did meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChildOutcome {
    pub ended: Ended,
    /// The cgroup's `oom_kill` counter before the child started and after it ended, when the
    /// cgroup has one.
    pub oom_kills_before: Option<u64>,
    pub oom_kills_after: Option<u64>,
}

impl ChildOutcome {
    /// OOM kills in the container while the child ran.
    pub fn new_oom_kills(&self) -> Option<u64> {
        Some(self.oom_kills_after?.saturating_sub(self.oom_kills_before?))
    }

    /// Killed with SIGKILL while the container's OOM kill counter rose.
    pub fn oom_killed(&self) -> bool {
        self.ended == Ended::Signaled(Signal::SIGKILL) && self.new_oom_kills().unwrap_or(0) > 0
    }

    /// The child's exit status, 128 + signal number when it was killed (as shells report it).
    pub fn exit_code(&self) -> u8 {
        match self.ended {
            Ended::Exited(code) => (code & 0xff) as u8,
            Ended::Signaled(signal) => 128u8.wrapping_add(signal as i32 as u8),
        }
    }

    /// `exited`, `killed` or `oom_killed`.
    pub fn outcome(&self) -> &'static str {
        match self.ended {
            _ if self.oom_killed() => "oom_killed",
            Ended::Exited(_) => "exited",
            Ended::Signaled(_) => "killed",
        }
    }

    /// Run tags that say how rank `rank` on `node` ended, under `mlscope/rank-<r>/`.
    pub fn tags(&self, node: &str, rank: u32) -> Vec<(String, String)> {
        let key = |name: &str| format!("mlscope/rank-{rank}/{name}");
        let mut tags = vec![
            (key("outcome"), self.outcome().to_owned()),
            (key("exit_code"), self.exit_code().to_string()),
            (key("node"), node.to_owned()),
        ];
        if let Ended::Signaled(signal) = self.ended {
            tags.push((key("signal"), signal.as_str().to_owned()));
        }
        if let Some(kills) = self.new_oom_kills() {
            tags.push((key("oom_kills"), kills.to_string()));
        }
        tags
    }
}

/// Starts `command` with the collector's stdio and environment, plus
/// `MLFLOW_SYSTEM_METRICS_NODE_ID=<node_id>` unless `already_set`, with no signal blocked and
/// the default actions (see [`crate::signals::restore_in_child`]).
pub fn spawn(command: &[OsString], node_id: &str, already_set: bool) -> io::Result<Child> {
    let (program, args) = command
        .split_first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no command"))?;
    let mut child = Command::new(program);
    child.args(args);
    if !already_set {
        child.env(NODE_ID_VARIABLE, node_id);
    }
    // The collector blocks the signals it reads from a signalfd; the command must not inherit
    // that, or a forwarded SIGTERM stays pending in it.
    crate::signals::restore_in_child(&mut child);
    child.spawn()
}

/// The exit status a shell gives a command that could not start.
pub fn spawn_failure_code(error: &io::Error) -> u8 {
    match error.kind() {
        io::ErrorKind::NotFound => 127,
        _ => 126,
    }
}

/// Makes the collector the child subreaper (`PR_SET_CHILD_SUBREAPER`): a process of the command
/// whose parent ends is re-parented to the collector instead of to PID 1, so the collector can
/// reap it and, when the command ends, find it ([`crate::leftovers`]). As a container's PID 1
/// it gets them anyway.
pub fn become_subreaper() -> nix::Result<()> {
    nix::sys::prctl::set_child_subreaper(true)
}

/// Waits for `pid`, reaping every other child on the way (orphans re-parented to the
/// subreaper, which must not pile up as zombies). Blocks in `waitpid(-1)`, so reaping costs
/// nothing while the command runs; only `pid`'s own status is returned.
pub fn wait(pid: u32) -> Ended {
    let pid = Pid::from_raw(pid as i32);
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(p, code)) if p == pid => return Ended::Exited(code),
            Ok(WaitStatus::Signaled(p, signal, _)) if p == pid => return Ended::Signaled(signal),
            Ok(_) | Err(Errno::EINTR) => continue,
            // ECHILD: someone else reaped it; nothing more can be known.
            Err(error) => {
                tracing::warn!(%error, "waiting for the command failed");
                return Ended::Exited(255);
            }
        }
    }
}

/// Reaps every child that has already ended, without waiting; returns how many.
pub fn reap_exited() -> usize {
    let mut reaped = 0;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return reaped,
            Ok(_) => reaped += 1,
            Err(Errno::EINTR) => continue,
            Err(error) => {
                tracing::debug!(%error, "reaping ended processes failed");
                return reaped;
            }
        }
    }
}

/// Sends `signal` to the child.
pub fn forward(pid: u32, signal: Signal) {
    if let Err(error) = signal::kill(Pid::from_raw(pid as i32), signal) {
        tracing::debug!(%error, signal = signal.as_str(), "forwarding a signal to the command failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(ended: Ended, before: Option<u64>, after: Option<u64>) -> ChildOutcome {
        ChildOutcome {
            ended,
            oom_kills_before: before,
            oom_kills_after: after,
        }
    }

    #[test]
    fn a_sigkill_with_a_new_oom_kill_is_an_oom_kill() {
        let oom = outcome(Ended::Signaled(Signal::SIGKILL), Some(2), Some(3));
        assert!(oom.oom_killed());
        assert_eq!(oom.exit_code(), 137);
        let tags = oom.tags("node-a", 3);
        assert!(
            tags.contains(&("mlscope/rank-3/outcome".into(), "oom_killed".into())),
            "{tags:?}"
        );
        assert!(tags.contains(&("mlscope/rank-3/exit_code".into(), "137".into())));
        assert!(tags.contains(&("mlscope/rank-3/signal".into(), "SIGKILL".into())));
        assert!(tags.contains(&("mlscope/rank-3/oom_kills".into(), "1".into())));
    }

    #[test]
    fn a_sigkill_without_an_oom_kill_is_just_killed() {
        let killed = outcome(Ended::Signaled(Signal::SIGKILL), Some(2), Some(2));
        assert_eq!((killed.outcome(), killed.exit_code()), ("killed", 137));
        assert_eq!(
            outcome(Ended::Signaled(Signal::SIGKILL), None, None).outcome(),
            "killed"
        );
        assert_eq!(
            outcome(Ended::Signaled(Signal::SIGTERM), Some(0), Some(1)).outcome(),
            "killed"
        );
    }

    #[test]
    fn exit_codes_pass_through() {
        let failed = outcome(Ended::Exited(3), Some(0), Some(0));
        assert_eq!((failed.outcome(), failed.exit_code()), ("exited", 3));
        assert_eq!(
            outcome(Ended::Signaled(Signal::SIGTERM), None, None).exit_code(),
            143
        );
        assert!(!failed
            .tags("n", 0)
            .iter()
            .any(|(k, _)| k.ends_with("/signal")));
    }

    #[test]
    fn every_tag_key_is_a_valid_mlflow_key() {
        for (key, _) in
            outcome(Ended::Signaled(Signal::SIGKILL), Some(0), Some(1)).tags("n.1", 4095)
        {
            assert!(mlscope_scopes::is_valid_mlflow_key(&key), "{key}");
        }
    }
}
