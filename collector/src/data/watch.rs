//! The watch: every `--data-interval`, on a thread of its own at low priority, each data path is
//! scanned again and compared with the scan before. Whatever changed — files vanished, appeared
//! or changed, the path went away or came back, the mount's flags moved — is tagged on the run
//! at once (`mlscope/data/<name>/changed`, one line with when, the run's latest step and what),
//! with the fingerprint, counts and a new dataset input. Sampling never waits for it.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use super::mount::{MountTable, MountView};
use super::scan::{scan, FileList};
use super::{cut, run_tag, DataConfig, DataPath, Diff, Scan, ScanBudget, Stopped};
use super::{HISTORY_LINES, LINE_CHARS};
use crate::outbox::{DatasetInput, Outbox, Payload, RunClient, RunLookup};
use crate::sources::gauges::Gauges;

/// A long scan logs how far it got this often.
const PROGRESS: Duration = Duration::from_secs(10);

/// The `history` tag holds at most this many characters.
const HISTORY_CHARS: usize = 5000;

/// What the last look at a path found.
#[derive(Debug)]
enum State {
    /// Not looked at yet.
    Unknown,
    Present(Scan),
    /// Gone, or its top cannot be read: why.
    Missing(String),
}

#[derive(Debug)]
struct Watched {
    data: DataPath,
    state: State,
    /// The last mount seen while the path was there.
    mount: Option<MountView>,
    history: VecDeque<String>,
    digest_sent: Option<[u8; 32]>,
}

/// The watch's state: owned by its thread while it runs, handed back when it stops.
#[derive(Debug)]
pub struct Watcher {
    paths: Vec<Watched>,
    rank: u32,
    budget: ScanBudget,
    outbox: Arc<Outbox>,
    run: Option<RunClient>,
    gauges: Arc<Gauges>,
    cancel: Arc<AtomicBool>,
}

/// The `data_<name>_files` gauges, in the order of `settings.paths`.
pub fn gauge_names(settings: &DataConfig) -> Vec<String> {
    settings
        .paths
        .iter()
        .map(|d| {
            mlscope_scopes::data_metric_name(&d.name, "files")
                .expect("validated: the scope table accepts the name")
        })
        .collect()
}

impl Watcher {
    /// `gauges` must have been built from [`gauge_names`] of the same settings.
    pub fn new(
        settings: &DataConfig,
        rank: u32,
        outbox: Arc<Outbox>,
        run: Option<RunClient>,
        gauges: Arc<Gauges>,
    ) -> Self {
        Watcher {
            paths: settings
                .paths
                .iter()
                .map(|data| Watched {
                    data: data.clone(),
                    state: State::Unknown,
                    mount: None,
                    history: VecDeque::new(),
                    digest_sent: None,
                })
                .collect(),
            rank,
            budget: settings.budget,
            outbox,
            run,
            gauges,
            cancel: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Scans every path once and reports what changed since the last round.
    pub fn round(&mut self) {
        let table = MountTable::read().unwrap_or_default();
        for index in 0..self.paths.len() {
            let watched = &self.paths[index];
            let result = scan(
                &watched.data.path,
                self.budget,
                &self.cancel,
                PROGRESS,
                &watched.data.name,
            );
            let new = match result {
                Ok(scan) if scan.stopped == Some(Stopped::Cancelled) => return,
                Ok(scan) => {
                    if let Some(stopped) = scan.stopped {
                        tracing::info!(data = %watched.data.name, files = scan.files, ?stopped, "the scan stopped at its budget: the fingerprint covers the files before");
                    }
                    State::Present(scan)
                }
                Err(error) if error.kind() == io::ErrorKind::NotFound => {
                    State::Missing("path gone".to_owned())
                }
                Err(error) => State::Missing(format!("path not readable ({error})")),
            };
            let mount = matches!(new, State::Present(_))
                .then(|| MountView::of(&table, &watched.data.path))
                .flatten();
            self.observe(index, new, mount);
        }
    }

    /// Without scanning: whether each path is still there and mounted as before (the last look
    /// when the command failed between two rounds).
    pub fn quick_check(&mut self) {
        let table = MountTable::read().unwrap_or_default();
        for index in 0..self.paths.len() {
            let watched = &self.paths[index];
            if !matches!(watched.state, State::Present(_)) {
                continue;
            }
            if !watched.data.path.exists() {
                self.observe(index, State::Missing("path gone".to_owned()), None);
                continue;
            }
            let mount = MountView::of(&table, &watched.data.path);
            let watched = &mut self.paths[index];
            if let Some(what) = mount_change(watched.mount.as_ref(), mount.as_ref()) {
                watched.mount = mount;
                self.record_change(index, what, false);
            }
        }
    }

    /// `<name>: <the last change line>` for each path that changed, for the outcome tag
    /// `mlscope/rank-<r>/data_changed_before_exit`; `None` when nothing changed.
    pub fn changed_before_exit(&self) -> Option<String> {
        let lines: Vec<String> = self
            .paths
            .iter()
            .filter_map(|w| Some(format!("{}: {}", w.data.name, w.history.front()?)))
            .collect();
        (!lines.is_empty()).then(|| cut(&lines.join(" | "), LINE_CHARS))
    }

    fn observe(&mut self, index: usize, new: State, mount: Option<MountView>) {
        let watched = &mut self.paths[index];
        let mut parts = Vec::new();
        let mut pin = false;
        match (&watched.state, &new) {
            (State::Unknown, State::Present(_)) => pin = true,
            (State::Present(old), State::Missing(why)) => {
                let diff = Diff::between(
                    &old.list,
                    old.stopped.is_some(),
                    &FileList::default(),
                    false,
                );
                parts.push(format!("{why}: {}", diff.describe()));
            }
            (State::Missing(_), State::Present(scan)) => {
                // Back if a scan ever saw it, else there for the first time.
                let word = if watched.digest_sent.is_some() {
                    "back"
                } else {
                    "appeared"
                };
                parts.push(format!("path {word}: {} files", scan.files));
                pin = true;
            }
            (State::Present(old), State::Present(scan)) => {
                let diff = Diff::between(
                    &old.list,
                    old.stopped.is_some(),
                    &scan.list,
                    scan.stopped.is_some(),
                );
                if !diff.is_empty() {
                    parts.push(diff.describe());
                    pin = true;
                }
            }
            _ => {}
        }
        if mount.is_some() {
            if let Some(what) = mount_change(watched.mount.as_ref(), mount.as_ref()) {
                parts.push(what);
            }
            watched.mount = mount;
        }
        let files = match &new {
            State::Present(scan) => scan.files as f64,
            _ => 0.0,
        };
        self.gauges.set(index, files);
        watched.state = new;
        if !parts.is_empty() {
            self.record_change(index, parts.join("; "), pin);
        } else if pin {
            self.pin(index, Vec::new());
        }
    }

    /// Tags the change at once: `changed`, `history`, and with `pin` the new fingerprint.
    fn record_change(&mut self, index: usize, what: String, pin: bool) {
        let step = match self.run.as_ref().map(RunClient::get) {
            Some(RunLookup::Found(info)) => info.latest_step,
            _ => None,
        };
        let watched = &mut self.paths[index];
        let mut line = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
        if let Some(step) = step {
            line.push_str(&format!(", step {step}"));
        }
        line.push_str(&format!(", rank {}: {what}", self.rank));
        let line = cut(&line, LINE_CHARS);
        tracing::warn!(data = %watched.data.name, path = %watched.data.path.display(), change = %line, "the data path changed");
        watched.history.push_front(line.clone());
        watched.history.truncate(HISTORY_LINES);
        let history: Vec<&str> = watched.history.iter().map(String::as_str).collect();
        let name = &watched.data.name;
        let tags = vec![
            (run_tag(name, "changed"), line),
            (
                run_tag(name, "history"),
                cut(&history.join("\n"), HISTORY_CHARS),
            ),
        ];
        if pin {
            self.pin(index, tags);
        } else {
            self.outbox.push(Payload::Tags(tags));
        }
    }

    /// Sends `tags` with the path's fingerprint, file count and bytes, and a dataset input when
    /// the digest is new.
    fn pin(&mut self, index: usize, mut tags: Vec<(String, String)>) {
        let watched = &mut self.paths[index];
        let State::Present(scan) = &watched.state else {
            return;
        };
        let name = &watched.data.name;
        tags.push((
            run_tag(name, "fingerprint"),
            scan.fingerprint_tag(self.budget),
        ));
        tags.push((run_tag(name, "files"), scan.files.to_string()));
        tags.push((run_tag(name, "bytes"), scan.bytes.to_string()));
        self.outbox.push(Payload::Tags(tags));
        if watched.digest_sent != Some(scan.digest) {
            watched.digest_sent = Some(scan.digest);
            let profile = serde_json::json!({
                "files": scan.files,
                "bytes": scan.bytes,
                "partial": scan.stopped.is_some(),
            });
            self.outbox.push(Payload::Dataset(DatasetInput {
                name: name.clone(),
                digest: scan.fingerprint(),
                source_type: "local".to_owned(),
                source: serde_json::json!({"uri": watched.data.path.to_string_lossy()}).to_string(),
                profile: Some(profile.to_string()),
                context: name.clone(),
            }));
        }
        tracing::info!(data = %name, fingerprint = %scan.fingerprint(), files = scan.files, bytes = scan.bytes, seconds = scan.took.as_secs_f64(), "data path fingerprint");
    }
}

/// What changed between two views of a path's mount, if anything.
fn mount_change(old: Option<&MountView>, new: Option<&MountView>) -> Option<String> {
    let (old, new) = (old?, new?);
    if old.same_as(new) {
        return None;
    }
    let word = |ro: bool| if ro { "ro" } else { "rw" };
    if (old.read_only(), old.flags()) != (new.read_only(), new.flags()) {
        Some(format!(
            "mount flags changed: {} → {} (now {})",
            word(old.read_only()),
            word(new.read_only()),
            new.flags()
        ))
    } else {
        Some(format!("mount changed: now {}", new.describe()))
    }
}

// === impl DataWatch ===

/// The running watch.
#[derive(Debug)]
pub struct DataWatch {
    stop: Sender<()>,
    cancel: Arc<AtomicBool>,
    thread: JoinHandle<Watcher>,
}

impl DataWatch {
    /// Starts the watch: a first round at once (the fingerprint), then one every `interval`.
    pub fn spawn(watcher: Watcher, interval: Duration) -> io::Result<DataWatch> {
        let (stop, stopped) = mpsc::channel();
        let cancel = watcher.cancel.clone();
        let thread = std::thread::Builder::new()
            .name("mlscope-data".into())
            .spawn(move || watch(watcher, &stopped, interval))?;
        Ok(DataWatch {
            stop,
            cancel,
            thread,
        })
    }

    /// Stops the watch (a scan in progress ends within 1024 files) and hands back its state.
    pub fn stop(self) -> Option<Watcher> {
        self.cancel.store(true, Ordering::Relaxed);
        let _ = self.stop.send(());
        let watcher = self.thread.join().ok()?;
        watcher.cancel.store(false, Ordering::Relaxed);
        Some(watcher)
    }
}

fn watch(mut watcher: Watcher, stopped: &Receiver<()>, interval: Duration) -> Watcher {
    lower_priority();
    let mut next = Instant::now();
    loop {
        watcher.round();
        next += interval;
        let now = Instant::now();
        if next <= now {
            // The scan took longer than the interval: the next one starts after a full one.
            next = now + interval;
        }
        match stopped.recv_timeout(next - now) {
            Err(RecvTimeoutError::Timeout) => continue,
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return watcher,
        }
    }
}

/// Nice 10 for the watch's thread, so that scanning yields to the training and to sampling.
#[allow(unsafe_code)]
fn lower_priority() {
    let tid = nix::unistd::gettid().as_raw();
    // SAFETY: setpriority(2) takes three integers and touches no memory of this process; on
    // Linux a thread id names that thread alone.
    let result =
        unsafe { nix::libc::setpriority(nix::libc::PRIO_PROCESS, tid as nix::libc::id_t, 10) };
    if result != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), "cannot lower the data watch's priority");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::mount::Mount;
    use std::path::PathBuf;

    fn view(mount_ro: bool, statvfs_ro: bool) -> MountView {
        MountView {
            resolved: PathBuf::from("/data"),
            mount: Mount {
                id: 1,
                parent: 0,
                point: PathBuf::from("/data"),
                mount_ro,
                fstype: "nfs4".into(),
                source: "10.0.0.1:/share".into(),
                super_ro: false,
            },
            statvfs_ro: Some(statvfs_ro),
            below: Vec::new(),
        }
    }

    #[test]
    fn a_mount_change_says_which_way_the_flags_went() {
        assert_eq!(
            mount_change(Some(&view(false, false)), Some(&view(false, false))),
            None
        );
        assert_eq!(
            mount_change(Some(&view(false, false)), Some(&view(true, true))).as_deref(),
            Some("mount flags changed: rw → ro (now mount ro, superblock rw, statvfs ro)")
        );
        let mut moved = view(false, false);
        moved.mount.source = "10.0.0.2:/share".into();
        assert!(mount_change(Some(&view(false, false)), Some(&moved))
            .unwrap()
            .starts_with("mount changed: now writable: "));
        assert_eq!(mount_change(None, Some(&moved)), None);
    }
}
