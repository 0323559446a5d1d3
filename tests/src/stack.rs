//! The real-stack harness: child processes on free loopback ports, each started through a watchdog
//! so that none of them can outlive the process that started it.
//!
//! Everything here is blocking std code on purpose: it is called from `#[tokio::test]` functions
//! (where `reqwest::blocking` would panic) as well as from plain synchronous code.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// How long SeaweedFS may take until its S3 gateway stores objects.
const S3_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// MLflow needs 15–25 s on a 2-core machine before `/health` answers; leave room for a busy one.
const MLFLOW_READY_TIMEOUT: Duration = Duration::from_secs(180);
/// The `admin` password of an MLflow started with [`MlflowServer::start_with_basic_auth`].
pub const MLFLOW_ADMIN_PASSWORD: &str = "mlscope-admin-password";
/// How long the proxy and nginx may take until they answer.
const PROXY_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a process may take to exit after SIGTERM before its group gets SIGKILL.
const TERMINATE_GRACE: Duration = Duration::from_secs(30);
/// The same, when a handle is dropped: tests should not wait long for their teardown.
const DROP_GRACE: Duration = Duration::from_secs(5);

// === paths ===

/// The repository root: `MLSCOPE_ROOT`; else the workspace this crate was built in, while it is
/// still there; else the current directory or the nearest of its parents that holds the
/// repository (`scripts/setup` and `deploy/`), so binaries keep working when the checkout moved.
pub fn repo_root() -> PathBuf {
    if let Some(root) = std::env::var_os("MLSCOPE_ROOT") {
        return PathBuf::from(root);
    }
    let is_repo = |dir: &Path| dir.join("scripts/setup").is_file() && dir.join("deploy").is_dir();
    let built_in = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives one level below the repository root")
        .to_path_buf();
    if is_repo(&built_in) {
        return built_in;
    }
    std::env::current_dir()
        .ok()
        .and_then(|cwd| {
            cwd.ancestors()
                .find(|dir| is_repo(dir))
                .map(Path::to_path_buf)
        })
        .unwrap_or(built_in)
}

/// The Python virtual environment with MLflow, SeaweedFS (`bin/weed`) and boto3:
/// `MLSCOPE_VENV`, or `<repo>/.venv`.
pub fn venv() -> PathBuf {
    find_venv().unwrap_or_else(|e| panic!("{e}"))
}

/// As [`venv`], with an error instead of a panic when it is missing.
pub fn find_venv() -> Result<PathBuf> {
    let venv = std::env::var_os("MLSCOPE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv"));
    for tool in ["python", "mlflow", "weed"] {
        if !venv.join("bin").join(tool).exists() {
            bail!(
                "{} has no bin/{tool}: run scripts/setup first (it installs MLflow, SeaweedFS and \
                 boto3 there; set MLSCOPE_VENV to use another environment)",
                venv.display()
            );
        }
    }
    Ok(venv)
}

/// What a tool that starts the stack needs before it starts anything, as one error that says
/// what to run: the virtual environment, the mlscope-proxy binary, and nginx when `nginx`.
pub fn preflight(nginx: bool) -> Result<()> {
    find_venv()?;
    workspace_binary("mlscope-proxy", "MLSCOPE_PROXY_BIN")?;
    if nginx && !Path::new("/usr/sbin/nginx").is_file() {
        bail!("/usr/sbin/nginx is missing: run scripts/setup first (it installs Debian's nginx)");
    }
    Ok(())
}

/// The virtual environment of the support matrix's MLflow `minor` (e.g. `2.22`): [`venv`] with
/// the suffix `-mlflow-<minor>`, made by scripts/setup (`test`: 2.22 and 3.15; `matrix`: all).
pub fn matrix_venv(minor: &str) -> PathBuf {
    let mut path = venv().into_os_string();
    path.push(format!("-mlflow-{minor}"));
    let venv = PathBuf::from(path);
    if !venv.join("bin/mlflow").exists() {
        panic!(
            "{} has no bin/mlflow: run scripts/setup test (MLflow 2.22) or scripts/setup matrix",
            venv.display()
        );
    }
    venv
}

/// The virtual environment with MLflow 3.15.2, the last release that lists zero-byte `key/`
/// directory markers as files: [`venv`] with the suffix `-mlflow-3.15`, made by scripts/setup.
pub fn legacy_venv() -> PathBuf {
    let mut path = venv().into_os_string();
    path.push("-mlflow-3.15");
    let venv = PathBuf::from(path);
    for tool in ["python", "mlflow"] {
        if !venv.join("bin").join(tool).exists() {
            panic!(
                "{} has no bin/{tool}: run scripts/setup first (it installs MLflow 3.15.2 there)",
                venv.display()
            );
        }
    }
    venv
}

/// The `mlscope-proxy` binary: `MLSCOPE_PROXY_BIN`; else the one beside the running executable
/// (a test binary lives in `target/<profile>/deps`, a binary in `target/<profile>`), so tests use
/// the proxy of their own profile; else `<CARGO_TARGET_DIR or repo/target>/{debug,release}`.
pub fn proxy_binary() -> PathBuf {
    workspace_binary("mlscope-proxy", "MLSCOPE_PROXY_BIN").unwrap_or_else(|e| panic!("{e}"))
}

/// The `mlscope-collector` binary: `MLSCOPE_COLLECTOR_BIN`, else found as [`proxy_binary`] is.
pub fn collector_binary() -> PathBuf {
    find_collector_binary().unwrap_or_else(|e| panic!("{e}"))
}

/// As [`collector_binary`], with an error instead of a panic when there is none.
pub fn find_collector_binary() -> Result<PathBuf> {
    workspace_binary("mlscope-collector", "MLSCOPE_COLLECTOR_BIN")
}

fn workspace_binary(name: &str, variable: &str) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(variable) {
        return Ok(PathBuf::from(path));
    }
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        candidates.extend(exe.ancestors().skip(1).take(2).map(|dir| dir.join(name)));
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    candidates.extend(["debug", "release"].map(|profile| target.join(profile).join(name)));
    match candidates.iter().find(|path| path.is_file()) {
        Some(path) => Ok(path.clone()),
        None => bail!(
            "no {name} binary found (looked at {candidates:?}): run `cargo build --bins` first, \
             or set {variable}"
        ),
    }
}

/// A loopback port that was free a moment ago and that this process has not handed out before,
/// so parallel tests in one process never pick the same one.
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("binding 127.0.0.1:0")
            .port();
        if HANDED_OUT
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(port)
        {
            return port;
        }
    }
}

// === impl Process ===

/// Runs the real command in the foreground (`exec`, so it keeps the pid and leads the process
/// group) and, in the background, waits for EOF on the stdin pipe that only the harness holds.
/// EOF comes when the `Process` is dropped or when the harness dies in any way, even SIGKILL;
/// the watchdog then terminates the whole group, and kills it 5 s later.
const WATCHDOG: &str = r#"exec 3<&0 </dev/null
{ trap '' TERM; cat >/dev/null; kill -TERM 0; sleep 5; kill -KILL 0; } <&3 &
exec "$@" 3<&-"#;

/// A spawned child in its own process group that never outlives the harness process: dropping
/// it terminates the group (SIGTERM, then SIGKILL after 5 s), and so does the watchdog when the
/// harness process exits without dropping it.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
    /// The watchdog's lifeline: the only write end of its stdin pipe.
    lifeline: Option<ChildStdin>,
    log_path: PathBuf,
    stopped: bool,
}

impl Process {
    /// Spawns `command` with stdout and stderr appended to `log_path`. `name` names the process
    /// in error messages.
    pub fn spawn(name: &str, command: &Command, log_path: &Path) -> Result<Process> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let mut watched = Command::new("sh");
        watched
            .arg("-c")
            .arg(WATCHDOG)
            .arg("sh")
            .arg(command.get_program())
            .args(command.get_args())
            .stdin(Stdio::piped())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        for (key, value) in command.get_envs() {
            match value {
                Some(value) => watched.env(key, value),
                None => watched.env_remove(key),
            };
        }
        if let Some(dir) = command.get_current_dir() {
            watched.current_dir(dir);
        }
        let mut child = watched
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", command.get_program()))?;
        Ok(Process {
            name: name.to_owned(),
            lifeline: child.stdin.take(),
            child,
            log_path: log_path.to_owned(),
            stopped: false,
        })
    }

    /// The pid of the real command (it replaced the watchdog shell) and so its process group id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Where the process's stdout and stderr go.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Sends SIGTERM to the process group and waits for the process to exit (SIGKILL after 30 s).
    pub fn terminate(&mut self) -> ExitStatus {
        self.stop(TERMINATE_GRACE)
    }

    /// Kills the process group at once (SIGKILL), as a crash or an OOM kill would, and waits
    /// for the process to be gone.
    pub fn kill(&mut self) -> ExitStatus {
        self.signal_group("KILL");
        self.stop(Duration::ZERO)
    }

    /// The exit status if the process has exited.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last lines of the log, for error messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log_path, 40)
    }

    fn stop(&mut self, grace: Duration) -> ExitStatus {
        if self.try_status().is_none() {
            self.signal_group("TERM");
            let deadline = Instant::now() + grace;
            while self.try_status().is_none() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(50));
            }
        }
        // Also ends the watchdog and whatever the process left behind in its group.
        self.signal_group("KILL");
        self.lifeline = None;
        self.stopped = true;
        self.child.wait().expect("waiting for a child process")
    }

    fn signal_group(&self, signal: &str) {
        // Failure means the group is already gone, which is what we want.
        let _ = Command::new("kill")
            .args([&format!("-{signal}"), "--", &format!("-{}", self.pid())])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }

    /// Polls `ready` until it holds, failing early when the process exits and with the tail of
    /// its log when `timeout` passes.
    fn wait_until(
        &mut self,
        what: &str,
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(status) = self.try_status() {
                bail!(
                    "{} exited ({status}) before {what}; last lines of {}:\n{}",
                    self.name,
                    self.log_path.display(),
                    self.log_tail()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not get to {what} within {timeout:?}; last lines of {}:\n{}",
                    self.name,
                    self.log_path.display(),
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if !self.stopped {
            self.stop(DROP_GRACE);
        }
    }
}

fn log_tail(path: &Path, lines: usize) -> String {
    const MAX_BYTES: u64 = 16 * 1024;
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(MAX_BYTES)));
        let mut bytes = Vec::new();
        let _ = file.read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// === raw HTTP for readiness checks ===

/// `host:port` of an `http://host:port[/...]` URL.
fn authority(url: &str) -> Result<&str> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("{url:?} is not an http:// URL"))?;
    Ok(rest.split('/').next().unwrap_or(rest))
}

/// Sends one HTTP/1.1 request on a fresh connection and returns the response status code.
fn http_status(addr: &str, method: &str, path: &str, body: &[u8]) -> io::Result<u16> {
    let socket: SocketAddr = addr
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: {e}")))?;
    let mut stream = TcpStream::connect_timeout(&socket, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let head = String::from_utf8_lossy(&response[..response.len().min(64)]).into_owned();
    head.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("no HTTP status line in {head:?}"),
            )
        })
}

fn answers_200(addr: &str, path: &str) -> bool {
    matches!(http_status(addr, "GET", path, b""), Ok(200))
}

fn accepts_connections(addr: &str) -> bool {
    addr.parse()
        .is_ok_and(|socket| TcpStream::connect_timeout(&socket, Duration::from_secs(1)).is_ok())
}

// === impl S3Store ===

/// A SeaweedFS `weed server` (master, volume server, filer and S3 gateway in one process) with
/// one bucket, answering unsigned requests (no S3 identities are configured).
#[derive(Debug)]
pub struct S3Store {
    /// The S3 endpoint, `http://127.0.0.1:<port>`.
    pub url: String,
    pub bucket: String,
    pub process: Process,
    /// Where it was started (`dir/<name>`), to start it again on other ports.
    dir: PathBuf,
    name: String,
    /// The log's length when this process started: what it wrote begins there.
    log_start: usize,
}

impl S3Store {
    pub const BUCKET: &'static str = "mlflow";
    /// Where MLflow keeps artifacts in the bucket (its `--artifacts-destination` prefix).
    pub const PREFIX: &'static str = "artifacts";

    /// `s3://<bucket>/<prefix>`: MLflow's `--artifacts-destination`, and the gateway's.
    pub fn destination(&self) -> String {
        format!("s3://{}/{}", self.bucket, Self::PREFIX)
    }

    /// Proxy arguments that make it serve the artifact API from this store at `endpoint`
    /// (this store's own URL, or a shim in front of it), under MLflow's destination.
    pub fn gateway_args(&self, endpoint: &str) -> Vec<String> {
        vec![
            "--artifacts-destination".into(),
            self.destination(),
            "--s3-endpoint-url".into(),
            endpoint.to_owned(),
            "--s3-quirks".into(),
            "seaweedfs".into(),
        ]
    }

    /// Starts SeaweedFS with its data under `dir` and waits until the bucket stores objects.
    pub fn start(dir: &Path) -> Result<S3Store> {
        Self::start_on(dir, free_port())
    }

    /// As [`S3Store::start`], with the S3 gateway on `s3_port`.
    pub fn start_on(dir: &Path, s3_port: u16) -> Result<S3Store> {
        let mut store = Self::spawn(dir, s3_port)?;
        store.wait_ready_or_restart()?;
        Ok(store)
    }

    fn spawn(dir: &Path, s3_port: u16) -> Result<S3Store> {
        Self::spawn_named(dir, &format!("seaweedfs-{s3_port}"), s3_port)
    }

    /// As [`S3Store::spawn`], with the data in `dir/<name>` and the log in `dir/<name>.log`.
    fn spawn_named(dir: &Path, name: &str, s3_port: u16) -> Result<S3Store> {
        let data = dir.join(name);
        fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
        // Every port is explicit: the gRPC ports default to port + 10000, which overflows for
        // high random ports, and defaults would collide between parallel instances.
        let ports = [
            ("master.port", free_port()),
            ("master.port.grpc", free_port()),
            ("volume.port", free_port()),
            ("volume.port.grpc", free_port()),
            ("filer.port", free_port()),
            ("filer.port.grpc", free_port()),
            ("s3.port", s3_port),
            ("s3.port.grpc", free_port()),
            ("s3.port.iceberg", 0),
            ("s3.port.lance", 0),
        ];
        let mut command = Command::new(venv().join("bin/weed"));
        // weed's own log files go into the temporary directory unless told otherwise, where
        // nothing removes them.
        command.arg(format!("-logdir={}", data.display()));
        command.args([
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-filer",
            "-s3",
            // No network: do not try to send usage statistics.
            "-master.telemetry=false",
            // Small volumes; a test stack stores megabytes, not the default 30 GiB per volume.
            "-master.volumeSizeLimitMB=256",
            "-volume.max=0",
            // Exit at once on SIGTERM instead of the 10 s default drain.
            "-volume.preStopSeconds=0",
        ]);
        command.arg(format!("-dir={}", data.display()));
        command.args(ports.iter().map(|(flag, port)| format!("-{flag}={port}")));
        for socket in ["filer", "s3"] {
            command.arg(format!(
                "-{socket}.localSocket={}",
                data.join(format!("{socket}.sock")).display()
            ));
        }
        let log = dir.join(format!("{name}.log"));
        let log_start = fs::metadata(&log).map_or(0, |m| m.len() as usize);
        let process = Process::spawn("SeaweedFS", &command, &log)?;
        Ok(S3Store {
            url: format!("http://127.0.0.1:{s3_port}"),
            bucket: Self::BUCKET.to_owned(),
            process,
            dir: dir.to_owned(),
            name: name.to_owned(),
            log_start,
        })
    }

    /// Waits until the store stores objects. SeaweedFS listens on eight ports, chosen free a
    /// moment before it binds them; when another process took one in between (any outgoing
    /// connection may be given it), SeaweedFS exits, and it is started again on fresh ones.
    fn wait_ready_or_restart(&mut self) -> Result<()> {
        let mut attempts = 0;
        loop {
            match self.wait_ready() {
                Ok(()) => return Ok(()),
                Err(_) if attempts < 3 && self.lost_a_port() => {
                    attempts += 1;
                    eprintln!(
                        "SeaweedFS lost one of its ports to another process; starting it again"
                    );
                    let port: u16 = self
                        .url
                        .rsplit(':')
                        .next()
                        .and_then(|p| p.parse().ok())
                        .context("the store's port")?;
                    *self = Self::spawn_named(&self.dir.clone(), &self.name.clone(), port)?;
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Whether this process exited because a port it was given was taken.
    fn lost_a_port(&mut self) -> bool {
        self.process.try_status().is_some()
            && fs::read(self.process.log_path()).is_ok_and(|log| {
                String::from_utf8_lossy(log.get(self.log_start..).unwrap_or_default())
                    .contains("address already in use")
            })
    }

    /// Creates the bucket and writes an object: the gateway answers before the master has
    /// elected itself and the volume server has registered, and only then do writes succeed.
    fn wait_ready(&mut self) -> Result<()> {
        let addr = authority(&self.url)?.to_owned();
        let bucket = format!("/{}", self.bucket);
        let probe = format!("/{}/.mlscope-ready", self.bucket);
        self.process
            .wait_until("storing objects", S3_READY_TIMEOUT, || {
                matches!(http_status(&addr, "PUT", &bucket, b""), Ok(200 | 409))
                    && matches!(http_status(&addr, "PUT", &probe, b"ok"), Ok(200))
            })?;
        // Keep the bucket as MLflow would find it: empty.
        http_status(&addr, "DELETE", &probe, b"").context("deleting the readiness probe object")?;
        Ok(())
    }
}

// === impl MlflowServer ===

/// An MLflow tracking server (`mlflow server`) that serves artifacts itself from the S3 store.
#[derive(Debug)]
pub struct MlflowServer {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    /// The backend store URI it was started with.
    pub backend_store_uri: String,
    pub process: Process,
}

/// How `mlflow server` serves: its worker processes and its job runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlflowServing {
    /// `--workers N`; `None`: MLflow's default (4).
    pub workers: Option<u32>,
    /// MLflow's job runner (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION`, on by default): extra worker
    /// processes for GenAI jobs.
    pub job_execution: bool,
}

impl MlflowServing {
    /// What the tests run: one worker and no job runner, which start faster and leave a 2-core
    /// machine's CPU to what is tested.
    pub const TESTS: MlflowServing = MlflowServing {
        workers: Some(1),
        job_execution: false,
    };

    /// `mlflow server` as a platform starts it, with no flag: 4 workers and the job runner.
    pub const DEFAULTS: MlflowServing = MlflowServing {
        workers: None,
        job_execution: true,
    };

    /// For reports: "`mlflow server` defaults (4 workers, job runner on)", "`--workers 8`, job
    /// runner on", ...
    pub fn describe(&self) -> String {
        let jobs = if self.job_execution {
            "job runner on"
        } else {
            "job runner off"
        };
        match self.workers {
            None if self.job_execution => format!("`mlflow server` defaults (4 workers, {jobs})"),
            None => format!("4 workers (MLflow's default), {jobs}"),
            Some(n) => format!("`--workers {n}`, {jobs}"),
        }
    }
}

impl MlflowServer {
    /// Starts MLflow on a free port with artifacts under `s3://<bucket>/artifacts` and the given
    /// backend store (default: an SQLite file in `dir`), and waits until `/health` answers.
    pub fn start(
        dir: &Path,
        s3: &S3Store,
        backend_store_uri: Option<&str>,
    ) -> Result<MlflowServer> {
        Self::start_on(dir, s3, backend_store_uri, free_port())
    }

    /// As [`MlflowServer::start`], on `port`.
    pub fn start_on(
        dir: &Path,
        s3: &S3Store,
        backend_store_uri: Option<&str>,
        port: u16,
    ) -> Result<MlflowServer> {
        Self::start_serving(dir, s3, backend_store_uri, port, MlflowServing::TESTS)
    }

    /// As [`MlflowServer::start_on`], serving as `serving` says.
    pub fn start_serving(
        dir: &Path,
        s3: &S3Store,
        backend_store_uri: Option<&str>,
        port: u16,
        serving: MlflowServing,
    ) -> Result<MlflowServer> {
        let mut server = Self::spawn(
            &venv(),
            dir,
            s3,
            backend_store_uri,
            port,
            None,
            &[],
            serving,
        )?;
        server.wait_ready()?;
        Ok(server)
    }

    /// As [`MlflowServer::start`], with MLflow's basic-auth app (`--app-name basic-auth`): every
    /// request needs a user's credentials; `admin` (password [`MLFLOW_ADMIN_PASSWORD`]) may do
    /// everything, other users what their grants allow (no grant: nothing).
    pub fn start_with_basic_auth(dir: &Path, s3: &S3Store) -> Result<MlflowServer> {
        Self::start_with_basic_auth_from(&venv(), dir, s3)
    }

    /// As [`MlflowServer::start_with_basic_auth`], with the MLflow of the virtual environment
    /// `mlflow_venv` (e.g. [`legacy_venv`]).
    pub fn start_with_basic_auth_from(
        mlflow_venv: &Path,
        dir: &Path,
        s3: &S3Store,
    ) -> Result<MlflowServer> {
        Self::start_with_basic_auth_args(mlflow_venv, dir, s3, &[])
    }

    /// As [`MlflowServer::start_with_basic_auth_from`], with extra arguments of `mlflow server`
    /// (e.g. `--enable-workspaces`).
    pub fn start_with_basic_auth_args(
        mlflow_venv: &Path,
        dir: &Path,
        s3: &S3Store,
        extra_args: &[String],
    ) -> Result<MlflowServer> {
        let port = free_port();
        let ini = dir.join(format!("basic-auth-{port}.ini"));
        std::fs::write(
            &ini,
            format!(
                "[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{}\nadmin_username = admin\nadmin_password = {MLFLOW_ADMIN_PASSWORD}\nauthorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
                dir.join(format!("basic-auth-{port}.db")).display()
            ),
        )
        .context("writing the basic-auth config")?;
        let mut server = Self::spawn(
            mlflow_venv,
            dir,
            s3,
            None,
            port,
            Some(&ini),
            extra_args,
            MlflowServing::TESTS,
        )?;
        server.wait_ready()?;
        Ok(server)
    }

    /// Spawns `bin/mlflow` of the virtual environment `venv`.
    #[allow(clippy::too_many_arguments)]
    fn spawn(
        venv: &Path,
        dir: &Path,
        s3: &S3Store,
        backend_store_uri: Option<&str>,
        port: u16,
        basic_auth: Option<&Path>,
        extra_args: &[String],
        serving: MlflowServing,
    ) -> Result<MlflowServer> {
        let backend_store_uri = match backend_store_uri {
            Some(uri) => uri.to_owned(),
            None => format!(
                "sqlite:///{}",
                dir.join(format!("mlflow-{port}.db")).display()
            ),
        };
        let tmp = dir.join(format!("mlflow-{port}-tmp"));
        fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut command = Command::new(venv.join("bin/mlflow"));
        command
            .args(["server", "--host", "127.0.0.1", "--serve-artifacts"])
            .args(["--port", &port.to_string()])
            .args(["--backend-store-uri", &backend_store_uri])
            .args(["--artifacts-destination", &s3.destination()])
            .args(extra_args)
            .env("MLFLOW_S3_ENDPOINT_URL", &s3.url)
            .env("AWS_ACCESS_KEY_ID", "mlscope")
            .env("AWS_SECRET_ACCESS_KEY", "mlscope")
            .env("AWS_DEFAULT_REGION", "us-east-1")
            .env(
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION",
                if serving.job_execution {
                    "true"
                } else {
                    "false"
                },
            )
            // What MLflow puts in the temporary directory goes away with the stack's directory,
            // also when MLflow is killed before it can clean up.
            .env("TMPDIR", &tmp)
            .current_dir(dir);
        if let Some(workers) = serving.workers {
            command.args(["--workers", &workers.to_string()]);
        }
        if let Some(ini) = basic_auth {
            command
                .args(["--app-name", "basic-auth"])
                .env("MLFLOW_AUTH_CONFIG_PATH", ini)
                .env("MLFLOW_FLASK_SERVER_SECRET_KEY", "mlscope-tests");
        }
        let process = Process::spawn("MLflow", &command, &dir.join(format!("mlflow-{port}.log")))?;
        Ok(MlflowServer {
            url: format!("http://127.0.0.1:{port}"),
            backend_store_uri,
            process,
        })
    }

    fn wait_ready(&mut self) -> Result<()> {
        let addr = authority(&self.url)?.to_owned();
        self.process
            .wait_until("answering GET /health", MLFLOW_READY_TIMEOUT, || {
                answers_200(&addr, "/health")
            })
    }
}

// === impl ProxyProcess ===

/// A running `mlscope-proxy`.
#[derive(Debug)]
pub struct ProxyProcess {
    /// The MLflow-facing listener, `http://127.0.0.1:<port>`.
    pub url: String,
    /// The admin listener (`/healthz`, `/readyz`, `/metrics`).
    pub admin_url: String,
    pub process: Process,
    pub log_path: PathBuf,
}

/// Starts `mlscope-proxy` in front of `upstream` on free ports for `--listen` and
/// `--admin-listen`, with JSON logs and an SQLite state file in `dir`, and waits until the admin
/// `/healthz` answers 200. `extra_args` come last; one naming `--listen`, `--admin-listen`,
/// `--upstream`, `--database-url` or `--log-format` replaces the harness's default for it.
pub fn spawn_proxy(upstream: &str, extra_args: &[&str], dir: &Path) -> Result<ProxyProcess> {
    spawn_proxy_on(upstream, extra_args, dir, free_port(), free_port())
}

/// As [`spawn_proxy`], on the given ports.
pub fn spawn_proxy_on(
    upstream: &str,
    extra_args: &[&str],
    dir: &Path,
    port: u16,
    admin_port: u16,
) -> Result<ProxyProcess> {
    let listen = format!("127.0.0.1:{port}");
    let admin_listen = format!("127.0.0.1:{admin_port}");
    let database_url = format!(
        "sqlite://{}",
        dir.join(format!("mlscope-{port}.db")).display()
    );
    let defaults = [
        ("--listen", listen.as_str()),
        ("--admin-listen", admin_listen.as_str()),
        ("--upstream", upstream),
        ("--database-url", database_url.as_str()),
        ("--log-format", "json"),
    ];
    let mut command = Command::new(proxy_binary());
    for (flag, value) in defaults {
        let overridden = extra_args.iter().any(|arg| {
            *arg == flag
                || arg
                    .strip_prefix(flag)
                    .is_some_and(|rest| rest.starts_with('='))
        });
        if !overridden {
            command.args([flag, value]);
        }
    }
    command.args(extra_args).current_dir(dir);
    // Credentials for the artifact gateway's S3 client (SeaweedFS here accepts any), and no
    // instance-metadata probing on a machine that is not a cloud instance.
    for (name, value) in [
        ("AWS_ACCESS_KEY_ID", "mlscope"),
        ("AWS_SECRET_ACCESS_KEY", "mlscope"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ] {
        if std::env::var_os(name).is_none() {
            command.env(name, value);
        }
    }
    let log_path = dir.join(format!("mlscope-proxy-{port}.log"));
    let mut process = Process::spawn("mlscope-proxy", &command, &log_path)?;
    process.wait_until("answering GET /healthz", PROXY_READY_TIMEOUT, || {
        answers_200(&admin_listen, "/healthz")
    })?;
    Ok(ProxyProcess {
        url: format!("http://{listen}"),
        admin_url: format!("http://{admin_listen}"),
        process,
        log_path,
    })
}

// === impl TestStack ===

/// What [`TestStack::start`] starts.
#[derive(Debug, Clone)]
pub struct StackOptions {
    /// Start a proxy in front of MLflow.
    pub proxy: bool,
    /// Extra arguments for the proxy (see [`spawn_proxy`]).
    pub proxy_args: Vec<String>,
    /// MLflow's backend store URI; default: an SQLite file in the stack directory.
    pub mlflow_backend: Option<String>,
    /// Extra arguments of `mlflow server`, e.g. `--enable-workspaces`.
    pub mlflow_args: Vec<String>,
    /// The virtual environment whose MLflow serves (e.g. one of the compatibility matrix's);
    /// default: [`venv`]. SeaweedFS always comes from [`venv`].
    pub mlflow_venv: Option<PathBuf>,
    /// MLflow's workers and job runner; default: [`MlflowServing::TESTS`].
    pub mlflow_serving: MlflowServing,
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            proxy: true,
            proxy_args: Vec::new(),
            mlflow_backend: None,
            mlflow_args: Vec::new(),
            mlflow_venv: None,
            mlflow_serving: MlflowServing::TESTS,
        }
    }
}

/// SeaweedFS, MLflow and (optionally) the proxy, with their data and logs in one directory.
/// Dropping it stops the processes, then removes a temporary directory.
#[derive(Debug)]
pub struct TestStack {
    pub dir: StackDir,
    pub s3: S3Store,
    pub mlflow: MlflowServer,
    pub proxy: Option<ProxyProcess>,
    /// Held only for what happens when it is dropped, or never dropped; none for a kept
    /// directory.
    _remover: Option<DirRemover>,
}

/// Where a stack keeps its data and logs.
#[derive(Debug)]
pub enum StackDir {
    /// The tests' stacks: removed with the stack, or by a [`DirRemover`] when the process dies
    /// without dropping it.
    Temporary(tempfile::TempDir),
    /// The quick-start stack's: kept across restarts, with fixed file names (`mlflow.db`,
    /// `seaweedfs/`, `mlscope-proxy.db`), so a restart on other ports finds the same data.
    Kept(PathBuf),
}

impl StackDir {
    pub fn path(&self) -> &Path {
        match self {
            StackDir::Temporary(dir) => dir.path(),
            StackDir::Kept(path) => path,
        }
    }
}

impl TestStack {
    /// Starts a stack on free ports and waits until every part is ready.
    pub fn start(opts: StackOptions) -> Result<TestStack> {
        let mlflow_venv = opts.mlflow_venv.clone().unwrap_or_else(venv);
        Self::start_with_mlflow_from(opts, &mlflow_venv)
    }

    /// As [`TestStack::start`], with the MLflow server of the virtual environment `mlflow_venv`
    /// (e.g. [`legacy_venv`]); SeaweedFS still comes from [`venv`].
    pub fn start_with_mlflow_from(opts: StackOptions, mlflow_venv: &Path) -> Result<TestStack> {
        let dir = tempfile::Builder::new()
            .prefix("mlscope-stack-")
            .tempdir()
            .context("creating the stack directory")?;
        let ports = StackPorts {
            s3: free_port(),
            mlflow: free_port(),
            proxy: free_port(),
            admin: free_port(),
        };
        Self::launch(StackDir::Temporary(dir), &opts, ports, mlflow_venv)
    }

    /// Starts a stack in `dir` on the given ports.
    pub fn start_in(
        dir: tempfile::TempDir,
        opts: &StackOptions,
        ports: StackPorts,
    ) -> Result<TestStack> {
        let mlflow_venv = opts.mlflow_venv.clone().unwrap_or_else(venv);
        Self::launch(StackDir::Temporary(dir), opts, ports, &mlflow_venv)
    }

    /// Starts a stack whose data stays in `dir` when it stops, and starts again from there.
    pub fn start_kept(dir: &Path, opts: &StackOptions, ports: StackPorts) -> Result<TestStack> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mlflow_venv = opts.mlflow_venv.clone().unwrap_or_else(venv);
        Self::launch(StackDir::Kept(dir.to_owned()), opts, ports, &mlflow_venv)
    }

    fn launch(
        dir: StackDir,
        opts: &StackOptions,
        ports: StackPorts,
        mlflow_venv: &Path,
    ) -> Result<TestStack> {
        let path = dir.path();
        let kept = matches!(dir, StackDir::Kept(_));
        let remover = if kept {
            None
        } else {
            Some(DirRemover::spawn(path)?)
        };
        let kept_mlflow_backend = format!("sqlite:///{}", path.join("mlflow.db").display());
        let mlflow_backend = match &opts.mlflow_backend {
            Some(uri) => Some(uri.as_str()),
            None if kept => Some(kept_mlflow_backend.as_str()),
            None => None,
        };
        // MLflow takes the longest to start and needs no S3 until the first artifact request:
        // start both at once and wait for each afterwards.
        let mut s3 = if kept {
            S3Store::spawn_named(path, "seaweedfs", ports.s3)?
        } else {
            S3Store::spawn(path, ports.s3)?
        };
        let mut mlflow = MlflowServer::spawn(
            mlflow_venv,
            path,
            &s3,
            mlflow_backend,
            ports.mlflow,
            None,
            &opts.mlflow_args,
            opts.mlflow_serving,
        )?;
        s3.wait_ready_or_restart()?;
        mlflow.wait_ready()?;
        let proxy = if opts.proxy {
            let mut args: Vec<String> = opts.proxy_args.clone();
            let named = |flag: &str| {
                args.iter()
                    .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
            };
            if kept && !named("--database-url") {
                let state = format!("sqlite://{}", path.join("mlscope-proxy.db").display());
                args.splice(0..0, ["--database-url".to_owned(), state]);
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            Some(spawn_proxy_on(
                &mlflow.url,
                &args,
                path,
                ports.proxy,
                ports.admin,
            )?)
        } else {
            None
        };
        Ok(TestStack {
            dir,
            s3,
            mlflow,
            proxy,
            _remover: remover,
        })
    }

    /// One stack (proxy included) for the whole test process, started by the first caller.
    /// A static is never dropped: its processes and directory go away when the test process
    /// exits, through the watchdogs and the directory remover.
    pub fn shared() -> &'static TestStack {
        static SHARED: OnceLock<Result<TestStack, String>> = OnceLock::new();
        let stack = SHARED.get_or_init(|| {
            TestStack::start(StackOptions::default()).map_err(|e| format!("{e:#}"))
        });
        match stack {
            Ok(stack) => stack,
            Err(error) => panic!("the shared test stack did not start: {error}"),
        }
    }

    /// The proxy's URL; panics for a stack started without one.
    pub fn proxy_url(&self) -> &str {
        &self
            .proxy
            .as_ref()
            .expect("this stack was started without a proxy")
            .url
    }
}

impl Drop for TestStack {
    fn drop(&mut self) {
        // Stop the processes front to back before `dir` (the first field) is removed.
        self.proxy = None;
        self.mlflow.process.stop(DROP_GRACE);
        self.s3.process.stop(DROP_GRACE);
    }
}

/// Ports for [`TestStack::start_in`].
#[derive(Debug, Clone, Copy)]
pub struct StackPorts {
    pub s3: u16,
    pub mlflow: u16,
    pub proxy: u16,
    pub admin: u16,
}

/// Removes a stack directory if the process that started the stack dies without dropping it
/// (SIGKILL, a test timeout, or the shared stack, which lives in a static and is never dropped).
/// Like the watchdogs, it notices that death by EOF on its stdin; it then waits until the
/// watchdogs have stopped the processes writing into the directory.
#[derive(Debug)]
pub struct DirRemover {
    child: Child,
}

impl DirRemover {
    /// Starts the remover of `dir`; hold it as long as the directory is used.
    pub fn spawn(dir: &Path) -> Result<DirRemover> {
        let child = Command::new("sh")
            .args(["-c", "read -r _; sleep 7; exec rm -rf -- \"$1\"", "sh"])
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Out of the terminal's process group, so that Ctrl-C does not take it along.
            .process_group(0)
            .spawn()
            .context("starting the stack directory remover")?;
        Ok(DirRemover { child })
    }
}

/// A new temporary directory that is removed a few seconds after this process exits, by a
/// [`DirRemover`] left running, not when a test ends. For the state of a server run inside the
/// test process: its tasks (and its database's threads) stop only with the test's runtime, and a
/// directory removed under them can be written again before it is gone.
pub fn dir_removed_at_exit() -> Result<PathBuf> {
    let path = tempfile::tempdir()
        .context("creating a temporary directory")?
        .keep();
    // The remover waits for its standard input to close: with the handle leaked, that is when
    // this process exits, however it exits.
    std::mem::forget(DirRemover::spawn(&path)?);
    Ok(path)
}

impl Drop for DirRemover {
    fn drop(&mut self) {
        // The stack was dropped properly and its directory is gone already.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// === impl Nginx ===

/// nginx as a plain reverse proxy, the reference gateway that the proxy's overhead is compared
/// with. Configured like a production gateway in front of MLflow: upstream keep-alive, no body
/// size limit, and no buffering in either direction.
#[derive(Debug)]
pub struct Nginx {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    pub process: Process,
    /// The instance's own directory: pid, logs and temporary files.
    pub prefix: PathBuf,
}

impl Nginx {
    /// Used when the repository has no `deploy/nginx/mlscope-bench.conf.tmpl`. Placeholders
    /// (also in the template): `@PREFIX@` (a directory for pid, logs and temporary files),
    /// `@LISTEN@` (`127.0.0.1:<port>`) and `@UPSTREAM@` (`host:port`).
    const DEFAULT_CONFIG: &'static str = r#"daemon off;
master_process on;
worker_processes auto;
# Only takes effect when started as root; workers must reach the temporary paths below.
user root root;
pid @PREFIX@/nginx.pid;
error_log @PREFIX@/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path @PREFIX@/client_body;
    proxy_temp_path @PREFIX@/proxy;
    fastcgi_temp_path @PREFIX@/fastcgi;
    uwsgi_temp_path @PREFIX@/uwsgi;
    scgi_temp_path @PREFIX@/scgi;
    upstream mlflow {
        server @UPSTREAM@;
        keepalive 32;
    }
    server {
        listen @LISTEN@;
        client_max_body_size 0;
        location / {
            proxy_pass http://mlflow;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_request_buffering off;
            proxy_buffering off;
            proxy_read_timeout 300s;
            proxy_send_timeout 300s;
        }
    }
}
"#;

    /// Starts `/usr/sbin/nginx` on a free port in front of `upstream` (`http://host:port`).
    pub fn start(upstream: &str, dir: &Path) -> Result<Nginx> {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let prefix = dir.join(format!("nginx-{port}"));
        fs::create_dir_all(&prefix).with_context(|| format!("creating {}", prefix.display()))?;
        let template_path = repo_root().join("deploy/nginx/mlscope-bench.conf.tmpl");
        let template = match fs::read_to_string(&template_path) {
            Ok(template) => template,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Self::DEFAULT_CONFIG.to_owned(),
            Err(e) => {
                return Err(e).with_context(|| format!("reading {}", template_path.display()))
            }
        };
        let config = template
            .replace("@PREFIX@", &prefix.display().to_string())
            .replace("@LISTEN@", &listen)
            .replace("@UPSTREAM@", authority(upstream)?);
        Self::launch(prefix, &listen, &config)
    }

    /// Starts `/usr/sbin/nginx` with the production gateway configuration,
    /// `deploy/nginx/mlscope-gateway.conf`, in front of `upstreams` (proxy replicas): the file as
    /// it ships, with only what ties it to a host replaced (see [`gateway_config`]).
    pub fn start_gateway(upstreams: &[&str], dir: &Path) -> Result<Nginx> {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let prefix = dir.join(format!("nginx-gateway-{port}"));
        fs::create_dir_all(&prefix).with_context(|| format!("creating {}", prefix.display()))?;
        let path = repo_root().join("deploy/nginx/mlscope-gateway.conf");
        let shipped =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let servers = upstreams
            .iter()
            .map(|u| authority(u).map(str::to_owned))
            .collect::<Result<Vec<_>>>()?;
        let config = gateway_config(&shipped, &listen, &prefix, &servers)?;
        Self::launch(prefix, &listen, &config)
    }

    /// Writes `config` into `prefix`, runs nginx with it and waits until it accepts connections
    /// on `listen`.
    fn launch(prefix: PathBuf, listen: &str, config: &str) -> Result<Nginx> {
        let config_path = prefix.join("nginx.conf");
        fs::write(&config_path, config)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let mut command = Command::new("/usr/sbin/nginx");
        command
            .arg("-p")
            .arg(&prefix)
            .arg("-c")
            .arg(&config_path)
            .arg("-e")
            .arg(prefix.join("error.log"));
        // In the foreground, so the harness owns it and stops it with its process group. The
        // shipped gateway config leaves `daemon` to the command line (`-g 'daemon off;'` is how
        // container images run nginx); started as it ships, nginx would detach and outlive the
        // tests. A config that says it already must not get it twice (nginx refuses duplicates).
        if !config
            .lines()
            .any(|line| line.trim_start().starts_with("daemon "))
        {
            command.args(["-g", "daemon off;"]);
        }
        let mut process = Process::spawn("nginx", &command, &prefix.join("stderr.log"))?;
        process.wait_until("accepting connections", PROXY_READY_TIMEOUT, || {
            accepts_connections(listen)
        })?;
        Ok(Nginx {
            url: format!("http://{listen}"),
            process,
            prefix,
        })
    }
}

/// `deploy/nginx/mlscope-gateway.conf` made runnable on this machine, changing only what names
/// the host it was written for: the listen address, the upstream servers, the pid and log paths,
/// and the temporary paths (under `prefix`, so a test can see whether nginx wrote a body there);
/// and `user root root`, since the prefix is private to the test's user. Fails when one of the
/// lines it replaces is no longer in the file, so the test cannot drift from the shipped config.
pub fn gateway_config(
    shipped: &str,
    listen: &str,
    prefix: &Path,
    servers: &[String],
) -> Result<String> {
    let p = prefix.display();
    let mut config = String::new();
    let mut replaced = BTreeSet::new();
    let mut servers_written = false;
    for line in shipped.lines() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let new = if trimmed.starts_with("pid ") {
            replaced.insert("pid");
            format!("user root root;\npid {p}/nginx.pid;")
        } else if trimmed.starts_with("error_log ") {
            replaced.insert("error_log");
            format!("error_log {p}/error.log warn;")
        } else if trimmed.starts_with("access_log /") {
            replaced.insert("access_log");
            format!("{indent}access_log {p}/access.log gateway;")
        } else if trimmed.starts_with("server ") && trimmed.contains("mlscope-proxy-") {
            replaced.insert("upstream servers");
            if servers_written {
                continue;
            }
            servers_written = true;
            servers
                .iter()
                .map(|s| format!("{indent}server {s} max_fails=3 fail_timeout=10s;"))
                .collect::<Vec<_>>()
                .join("\n")
        } else if trimmed.starts_with("listen 80;") {
            replaced.insert("listen");
            format!("{indent}listen {listen};")
        } else if trimmed.starts_with("http {") {
            replaced.insert("http");
            format!(
                "http {{\n    client_body_temp_path {p}/client_body_temp;\n    proxy_temp_path {p}/proxy_temp;\n    fastcgi_temp_path {p}/fastcgi_temp;\n    uwsgi_temp_path {p}/uwsgi_temp;\n    scgi_temp_path {p}/scgi_temp;"
            )
        } else {
            line.to_owned()
        };
        config.push_str(&new);
        config.push('\n');
    }
    for wanted in [
        "pid",
        "error_log",
        "access_log",
        "upstream servers",
        "listen",
        "http",
    ] {
        anyhow::ensure!(
            replaced.contains(wanted),
            "deploy/nginx/mlscope-gateway.conf has no {wanted} line where the test expects one"
        );
    }
    Ok(config)
}

// === impl PostgresDatabase ===

/// An empty database of its own on a running PostgreSQL server, dropped (with its connections)
/// when the guard is dropped.
#[derive(Debug)]
pub struct PostgresDatabase {
    admin: String,
    name: String,
    /// `postgres://user@host:port/<name>`
    pub url: String,
}

impl PostgresDatabase {
    /// Creates `<prefix>_<random>` through `admin_url` (a database URL with the right to create
    /// databases, e.g. `postgres://postgres@127.0.0.1:5432/postgres`) with `psql`.
    pub fn create(admin_url: &str, prefix: &str) -> Result<PostgresDatabase> {
        let name = format!("{prefix}_{}", uuid::Uuid::new_v4().simple());
        let output = Command::new("psql")
            .args([admin_url, "-qc", &format!("CREATE DATABASE {name}")])
            .output()
            .context("running psql (Debian package postgresql-client)")?;
        anyhow::ensure!(
            output.status.success(),
            "creating a database at {admin_url} failed (is PostgreSQL running there?): {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
        let base = admin_url
            .rsplit_once('/')
            .map_or(admin_url, |(base, _)| base);
        Ok(PostgresDatabase {
            admin: admin_url.to_owned(),
            url: format!("{base}/{name}"),
            name,
        })
    }
}

impl Drop for PostgresDatabase {
    fn drop(&mut self) {
        let _ = Command::new("psql")
            .args([
                &self.admin,
                "-qc",
                &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

// === impl PrivatePostgres ===

/// A PostgreSQL server of the tests' own: its own data directory and port, started as the
/// `postgres` user, so it can be killed and restarted without touching the machine's server.
#[derive(Debug)]
pub struct PrivatePostgres {
    /// `postgres://postgres@127.0.0.1:<port>/postgres`
    pub url: String,
    pub port: u16,
    data: PathBuf,
    _dir: tempfile::TempDir,
    process: Option<Process>,
}

impl PrivatePostgres {
    /// Creates a cluster (`initdb`, trust authentication) and starts it on a free port.
    pub fn start() -> Result<PrivatePostgres> {
        let bin = postgres_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("mlscope-pg-")
            .tempdir()
            .context("creating the PostgreSQL directory")?;
        let data = dir.path().join("data");
        // PostgreSQL refuses to run as root; its user needs the directory.
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))?;
        fs::create_dir(&data)?;
        let status = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path())
            .status()?;
        anyhow::ensure!(status.success(), "chown of the PostgreSQL directory failed");
        let output = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .output()
            .context("running initdb")?;
        anyhow::ensure!(
            output.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let port = free_port();
        let mut postgres = PrivatePostgres {
            url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            port,
            data,
            _dir: dir,
            process: None,
        };
        postgres.restart()?;
        Ok(postgres)
    }

    /// Kills the server (SIGKILL to the postmaster and every backend): a crash.
    pub fn kill(&mut self) {
        if let Some(mut process) = self.process.take() {
            process.kill();
        }
    }

    /// Starts the server again on the same port and data (crash recovery runs) and waits until
    /// it accepts connections.
    pub fn restart(&mut self) -> Result<()> {
        let bin = postgres_bin()?;
        let mut command = Command::new("runuser");
        command
            .args(["-u", "postgres", "--"])
            .arg(bin.join("postgres"))
            .arg("-D")
            .arg(&self.data)
            .args([
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
                "-k",
            ])
            .arg(&self.data);
        let log = self
            .data
            .parent()
            .expect("data has a parent")
            .join(format!("postgres-{}.log", self.port));
        let mut process = Process::spawn("PostgreSQL", &command, &log)?;
        let addr = format!("127.0.0.1:{}", self.port);
        process.wait_until("accepting connections", Duration::from_secs(60), || {
            Command::new(bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
                && TcpStream::connect(&addr).is_ok()
        })?;
        self.process = Some(process);
        Ok(())
    }
}

/// The directory of Debian's PostgreSQL server binaries (the newest installed version).
fn postgres_bin() -> Result<PathBuf> {
    let mut versions: Vec<PathBuf> = fs::read_dir("/usr/lib/postgresql")
        .context("PostgreSQL's server binaries (/usr/lib/postgresql) are not installed")?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("postgres").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .ok_or_else(|| anyhow!("no PostgreSQL server under /usr/lib/postgresql"))
}
