//! The collector's life: sample on a fixed schedule on the main thread, hand samples to the
//! sender thread through the bounded outbox, and on SIGTERM (sidecar) or the command's exit
//! (wrapper) take one final sample, flush within the deadline and exit — with 0, or with the
//! wrapped command's status; never with an error because of the network. In wrapper mode,
//! what the command left running is listed, tagged and ended before the collector exits.
//! Data paths are checked before the command starts and watched on their own thread.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mlscope_scopes::Identity;
use nix::sys::signal::Signal;

use crate::config::Config;
use crate::data::{self, DataWatch, PreflightMode, Watcher};
use crate::leftovers::{self, Leftover, Scope};
use crate::outbox::{
    spawn_sender, Backoff, HttpConfig, MlflowTransport, Outbox, Payload, RunClient, SenderStats,
};
use crate::placement::{BasisTag, Placement};
use crate::signals::{self, Received, SignalMask};
use crate::sources::cgroup::{discover, DiscoveryRoots};
use crate::sources::disk::WatchedVolume;
use crate::sources::gauges::Gauges;
use crate::sources::{Sampler, SourceConfig};
use crate::wrapper::{self, ChildOutcome, Ended};

/// The first retry comes this soon after a failure.
const INITIAL_BACKOFF: Duration = Duration::from_millis(500);

/// What ends the sampling loop.
#[derive(Debug)]
enum Event {
    /// SIGTERM or SIGINT in sidecar mode.
    Stop,
    /// The wrapped command ended.
    ChildExited(Ended),
}

/// Runs until stopped and returns the process exit code. `signals` must have been blocked
/// before any thread was spawned.
pub fn run(config: Config, signals: SignalMask) -> u8 {
    tracing::info!(node = %config.node, node_from = %config.node_source, rank = config.rank, rank_from = %config.rank_source, interval = ?config.interval, "mlscope-collector starting");
    if config.command.is_empty() {
        sidecar(&config, signals)
    } else {
        wrapped(&config, signals)
    }
}

fn sidecar(config: &Config, signals: SignalMask) -> u8 {
    let http = config
        .http
        .as_ref()
        .expect("validated: sidecar mode has MLflow settings");
    let (events, received) = mpsc::channel();
    let listener = signals::spawn_listener(signals, move |Received { signal, .. }| {
        if matches!(signal, Signal::SIGTERM | Signal::SIGINT) {
            let _ = events.send(Event::Stop);
        }
    });
    if let Err(error) = listener {
        tracing::warn!(%error, "cannot listen for signals; stop the collector with SIGKILL");
    }
    let mut agent = Agent::start(config, http);
    let run = RunClient::new(http);
    let checks = data::preflight(&config.data, config.rank, Some((&run, &http.run_id)));
    if config.data.preflight == PreflightMode::Enforce && !checks.failures.is_empty() {
        tracing::warn!("--preflight enforce keeps a wrapped command from starting; in sidecar mode failed checks are tagged and logged only");
    }
    agent.push_tags(checks.tags);
    let watch = agent.watch(config, http);
    agent.sample_until_event(&received);
    drop(watch.and_then(DataWatch::stop));
    agent.finish(config.flush_timeout, None);
    0
}

fn wrapped(config: &Config, signals: SignalMask) -> u8 {
    let node_id = format!("{}/rank-{}", config.node, config.rank);
    let already_set = std::env::var_os(wrapper::NODE_ID_VARIABLE).is_some();
    let mut agent = match &config.http {
        Some(http) => Some(Agent::start(config, http)),
        None => {
            tracing::warn!(
                "{}: running the command without measuring it",
                config
                    .unmeasured_because
                    .as_deref()
                    .unwrap_or("MLflow's variables are not set")
            );
            None
        }
    };
    let run = config
        .http
        .as_ref()
        .map(|http| (RunClient::new(http), http));
    let checks = data::preflight(
        &config.data,
        config.rank,
        run.as_ref()
            .map(|(client, http)| (client, http.run_id.as_str())),
    );
    if let Some(agent) = &agent {
        // At once, before the command starts: a finding is on the run before the first write.
        agent.push_tags(checks.tags.clone());
    }
    if config.data.preflight == PreflightMode::Enforce && !checks.failures.is_empty() {
        return refuse_to_start(config, agent, &checks);
    }
    let watch = match (&agent, &config.http) {
        (Some(agent), Some(http)) => agent.watch(config, http),
        _ => None,
    };
    let oom_kills_before = agent.as_ref().and_then(Agent::oom_kills);
    // Before the command starts, so that none of its processes can be orphaned to PID 1.
    if let Err(error) = wrapper::become_subreaper() {
        tracing::warn!(%error, "cannot become the child subreaper: processes the command leaves running are re-parented to PID 1 and not found");
    }
    let child = match wrapper::spawn(&config.command, &node_id, already_set) {
        Ok(child) => child,
        Err(error) => {
            tracing::error!(%error, command = ?config.command, "cannot start the command");
            let code = wrapper::spawn_failure_code(&error);
            if let Some(agent) = agent {
                let tags = vec![
                    (
                        format!("mlscope/rank-{}/outcome", config.rank),
                        "not_started".to_owned(),
                    ),
                    (
                        format!("mlscope/rank-{}/exit_code", config.rank),
                        code.to_string(),
                    ),
                ];
                agent.finish(config.flush_timeout, Some(tags));
            }
            return code;
        }
    };
    let pid = child.id();
    // Cleared once the child is reaped, so that a late signal is not sent to a reused pid.
    let running = Arc::new(AtomicBool::new(true));
    let forwarding = running.clone();
    let listener = signals::spawn_listener(
        signals,
        move |Received {
                  signal,
                  from_terminal,
              }| {
            // A terminal delivers its signals to the whole foreground group, the command included.
            if !from_terminal && forwarding.load(Ordering::SeqCst) {
                wrapper::forward(pid, signal);
            }
        },
    );
    if let Err(error) = listener {
        tracing::warn!(%error, "cannot listen for signals; they will not be forwarded to the command");
    }
    let (events, received) = mpsc::channel();
    let reaped = running.clone();
    let waiter = std::thread::Builder::new()
        .name("mlscope-wait".into())
        .spawn(move || {
            let ended = wrapper::wait(pid);
            reaped.store(false, Ordering::SeqCst);
            let _ = events.send(Event::ChildExited(ended));
            ended
        });
    let ended = match (&mut agent, waiter) {
        (Some(agent), Ok(_)) => match agent.sample_until_event(&received) {
            Event::ChildExited(ended) => ended,
            Event::Stop => unreachable!("wrapper mode forwards signals instead of stopping"),
        },
        (None, Ok(waiter)) => waiter.join().unwrap_or(Ended::Exited(255)),
        (_, Err(error)) => {
            tracing::warn!(%error, "cannot start the waiting thread; waiting without sampling");
            let ended = wrapper::wait(pid);
            running.store(false, Ordering::SeqCst);
            ended
        }
    };
    drop(child);
    let watcher = watch.and_then(DataWatch::stop);
    let Some(mut agent) = agent else {
        let code = ChildOutcome {
            ended,
            oom_kills_before: None,
            oom_kills_after: None,
        }
        .exit_code();
        let (scope, found) = find_leftovers(config);
        end_leftovers(config, &scope, &found);
        return code;
    };
    let outcome = ChildOutcome {
        ended,
        oom_kills_before,
        oom_kills_after: agent.oom_kills_after(ended),
    };
    tracing::info!(outcome = outcome.outcome(), exit_code = outcome.exit_code(), oom_kills = ?outcome.new_oom_kills(), "the command ended");
    let (scope, found) = find_leftovers(config);
    let mut tags = outcome.tags(&config.node, config.rank);
    if let Some(mut watcher) = watcher.filter(|_| outcome.exit_code() != 0) {
        // A path that went away since the last round is the likeliest cause: look once more.
        watcher.quick_check();
        if let Some(changed) = watcher.changed_before_exit() {
            tags.push((
                data::rank_tag(config.rank, "data_changed_before_exit"),
                changed,
            ));
        }
    }
    tags.extend(leftovers::listing_tags(config.rank, &found));
    // Sent while the leftovers get their grace: a collector killed meanwhile has said how the
    // rank ended and what it left.
    agent.push_last(tags);
    let mut after = end_leftovers(config, &scope, &found);
    if let Some(gpus) = agent.sampler.gpu_memory() {
        let left = leftovers::gpu_memory_left(gpus, leftovers::GPU_MEMORY_SETTLE);
        for (gpu, bytes) in &left {
            tracing::warn!(
                gpu,
                megabytes = *bytes as f64 / 1e6,
                "GPU memory is still allocated after the command and what it left are gone"
            );
        }
        after.extend(leftovers::gpu_memory_left_tags(config.rank, &left));
    }
    agent.close(config.flush_timeout, after);
    outcome.exit_code()
}

/// `--preflight enforce` with a failed check: the command never starts. One line per failed
/// check on stderr; with MLflow, the outcome `preflight_failed` and a `RUNNING` run ended
/// `FAILED`.
fn refuse_to_start(config: &Config, agent: Option<Agent>, checks: &data::Preflight) -> u8 {
    for failure in &checks.failures {
        eprintln!("mlscope-collector: pre-flight failed: {failure}");
    }
    tracing::error!(
        failed = checks.failures.len(),
        "--preflight enforce: not starting the command"
    );
    let code = data::EXIT_PREFLIGHT;
    if let (Some(agent), Some(http)) = (agent, &config.http) {
        let tags = vec![
            (
                data::rank_tag(config.rank, "outcome"),
                data::OUTCOME_PREFLIGHT_FAILED.to_owned(),
            ),
            (data::rank_tag(config.rank, "exit_code"), code.to_string()),
        ];
        agent.finish(config.flush_timeout, Some(tags));
        if checks.run_running {
            match RunClient::new(http).end("FAILED") {
                Ok(()) => {
                    tracing::info!(run_id = %http.run_id, "ended the run FAILED: its pre-flight failed")
                }
                Err(error) => tracing::warn!(%error, "cannot end the run FAILED"),
            }
        }
    }
    code
}

/// What the command left running, logged (reaping the collector's ended children first, so
/// they are not counted).
fn find_leftovers(config: &Config) -> (Scope, Vec<Leftover>) {
    wrapper::reap_exited();
    let scope = Scope::of_this_process(&config.leftovers.device_prefix);
    let found = scope.find();
    for leftover in &found {
        tracing::warn!(
            pid = leftover.pid,
            command = %leftover.command,
            rss_megabytes = leftover.rss_bytes.map(|b| (b as f64 / 1e6).round()),
            gpu_devices = %leftover.devices.join(" "),
            found_as = ?leftover.found_as,
            "the command left this process running"
        );
    }
    if !found.is_empty() {
        tracing::warn!(
            count = found.len(),
            ending = !config.leftovers.leave,
            "the command left processes running"
        );
    }
    (scope, found)
}

/// Ends the leftovers unless `--leave-leftovers`; the `leftover_processes_ended` tag when there
/// were any.
fn end_leftovers(config: &Config, scope: &Scope, found: &[Leftover]) -> Vec<(String, String)> {
    if found.is_empty() {
        return Vec::new();
    }
    let ending =
        (!config.leftovers.leave).then(|| leftovers::end(scope, found, config.leftovers.grace));
    wrapper::reap_exited();
    if let Some(ending) = &ending {
        tracing::info!(
            by_sigterm = ending.by_sigterm,
            by_sigkill = ending.by_sigkill,
            gone_before = ending.gone_before,
            still_running = ending.survived.len(),
            "ended the processes the command left running"
        );
    }
    leftovers::ended_tags(config.rank, ending.as_ref())
}

// === impl Agent ===

/// The sampler with its outbox and sender thread.
struct Agent {
    sampler: Sampler,
    outbox: Arc<Outbox>,
    sender: JoinHandle<SenderStats>,
    interval: Duration,
    /// Where this rank runs, sent as run tags with the first sample; `None` once sent.
    placement: Option<Placement>,
    basis: BasisTag,
    /// The data watch's `data_<name>_files`, sampled with everything else.
    gauges: Arc<Gauges>,
}

impl Agent {
    fn start(config: &Config, http: &HttpConfig) -> Agent {
        let cgroup = match discover(&DiscoveryRoots::default(), config.cgroup_path.as_deref()) {
            Ok(layout) => {
                tracing::info!(cgroup = %layout.describe(), "measuring the container's cgroup");
                Some(layout)
            }
            Err(error) => {
                tracing::warn!(%error, "no container series");
                None
            }
        };
        let volumes = config
            .volumes
            .iter()
            .filter_map(|(name, path)| WatchedVolume::new(name, path.clone()))
            .collect();
        let gauges = Arc::new(Gauges::new(data::watch::gauge_names(&config.data)));
        let settings = SourceConfig {
            proc_root: PathBuf::from("/proc"),
            rootfs: PathBuf::from("/"),
            volumes,
            cgroup,
            gpus: true,
            gpu_idle_below: config.gpu_idle_below,
            gauges: Some(gauges.clone()),
        };
        let identity = Identity {
            node: Some(config.node.clone()),
            rank: Some(config.rank),
        };
        let sampler = Sampler::new(settings, identity);
        let outbox = Arc::new(Outbox::new(config.buffer_samples));
        let backoff = Backoff::new(INITIAL_BACKOFF, config.max_backoff, Backoff::seed());
        let sender = spawn_sender(outbox.clone(), MlflowTransport::new(http), backoff);
        tracing::info!(tracking_uri = %without_userinfo(&http.tracking_uri), run_id = %http.run_id, buffer_samples = config.buffer_samples, "posting samples to MLflow");
        Agent {
            sampler,
            outbox,
            sender,
            interval: config.interval,
            placement: Some(Placement {
                node: config.node.clone(),
                rank: config.rank,
                pod: config.pod.clone(),
            }),
            basis: BasisTag {
                rank: config.rank,
                sent: None,
            },
            gauges,
        }
    }

    /// Queues run tags (the pre-flight's), never dropped.
    fn push_tags(&self, tags: Vec<(String, String)>) {
        if !tags.is_empty() {
            self.outbox.push(Payload::Tags(tags));
        }
    }

    /// Starts the data watch when there are data paths.
    fn watch(&self, config: &Config, http: &HttpConfig) -> Option<DataWatch> {
        if config.data.paths.is_empty() {
            return None;
        }
        let watcher = Watcher::new(
            &config.data,
            config.rank,
            self.outbox.clone(),
            Some(RunClient::new(http)),
            self.gauges.clone(),
        );
        match DataWatch::spawn(watcher, config.data.interval) {
            Ok(watch) => {
                tracing::info!(paths = config.data.paths.len(), interval = ?config.data.interval, "watching the data paths");
                Some(watch)
            }
            Err(error) => {
                tracing::warn!(%error, "cannot start the data watch; data paths are not watched");
                None
            }
        }
    }

    fn oom_kills(&self) -> Option<u64> {
        self.sampler.container()?.oom_kills()
    }

    /// The counter after the child ended. The kernel counts an OOM kill before the victim is
    /// gone, but give it a moment when the child died of SIGKILL and the count did not move.
    fn oom_kills_after(&self, ended: Ended) -> Option<u64> {
        let first = self.oom_kills();
        if ended != Ended::Signaled(Signal::SIGKILL) {
            return first;
        }
        let mut kills = first;
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(20));
            kills = self.oom_kills();
            if kills != first {
                break;
            }
        }
        kills
    }

    fn push_sample(&mut self) {
        self.push_sample_with(Outbox::push);
    }

    /// Takes a sample and queues it (with the placement tags before the first one) through
    /// `push`.
    fn push_sample_with(&mut self, push: fn(&Outbox, Payload)) {
        let sample = self.sampler.sample();
        if let Some(placement) = self.placement.take() {
            let tags = placement.tags(&sample, self.sampler.gpu_inventory());
            push(&self.outbox, Payload::Tags(tags));
        }
        for batch in sample.into_batches() {
            push(&self.outbox, Payload::Sample(batch));
        }
        if let Some(tag) = self.basis.update(self.sampler.gpu_idle_basis()) {
            push(&self.outbox, Payload::Tags(vec![tag]));
        }
    }

    /// Samples every `interval` on a fixed schedule (a late tick does not shift the next ones;
    /// ticks missed entirely are skipped) until an event arrives.
    fn sample_until_event(&mut self, events: &Receiver<Event>) -> Event {
        let mut next = Instant::now() + self.interval;
        loop {
            match events.recv_timeout(next.saturating_duration_since(Instant::now())) {
                Ok(event) => return event,
                Err(RecvTimeoutError::Disconnected) => return Event::Stop,
                Err(RecvTimeoutError::Timeout) => {
                    self.push_sample();
                    next += self.interval;
                    let now = Instant::now();
                    if next <= now {
                        next = now + self.interval;
                    }
                }
            }
        }
    }

    /// One final sample, the tags, then whatever can be sent within `flush_timeout`.
    fn finish(mut self, flush_timeout: Duration, tags: Option<Vec<(String, String)>>) {
        self.push_last(tags.unwrap_or_default());
        self.close(flush_timeout, Vec::new());
    }

    /// The final sample, then `tags` (if any); the sender goes on sending.
    fn push_last(&mut self, tags: Vec<(String, String)>) {
        // The final sample and the outcome never push each other (or the placement) out.
        self.push_sample_with(Outbox::push_final);
        if !tags.is_empty() {
            self.outbox.push_final(Payload::Tags(tags));
        }
    }

    /// Queues `tags` (if any) and sends whatever is queued within `flush_timeout`.
    fn close(self, flush_timeout: Duration, tags: Vec<(String, String)>) {
        if !tags.is_empty() {
            self.outbox.push_final(Payload::Tags(tags));
        }
        self.outbox.close(Instant::now() + flush_timeout);
        match self.sender.join() {
            Ok(stats) if stats.unsent > 0 || stats.dropped > 0 => {
                tracing::warn!(
                    sent = stats.sent,
                    refused = stats.rejected,
                    dropped = stats.dropped,
                    unsent = stats.unsent,
                    "stopped with samples that never reached MLflow"
                );
            }
            Ok(stats) => tracing::info!(
                sent = stats.sent,
                refused = stats.rejected,
                "stopped; everything buffered was sent"
            ),
            Err(_) => tracing::error!("the sender thread panicked"),
        }
    }
}

/// The URI without `user:password@`, for logs.
fn without_userinfo(uri: &str) -> String {
    match uri.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            match rest[..authority_end].rfind('@') {
                Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
                None => uri.to_owned(),
            }
        }
        None => uri.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_the_tracking_uri_are_not_logged() {
        assert_eq!(
            without_userinfo("https://u:secret@mlflow.example/prefix"),
            "https://mlflow.example/prefix"
        );
        assert_eq!(
            without_userinfo("http://127.0.0.1:5001"),
            "http://127.0.0.1:5001"
        );
        assert_eq!(without_userinfo("http://host/a@b"), "http://host/a@b");
    }
}
