//! The `mlscope-proxy` binary as an operator meets it: what it accepts on its command line, what
//! it says when it refuses something, and what its logs look like in a file.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The exit status of a refused configuration (EX_USAGE).
const EXIT_CONFIG: i32 = 64;

/// The binary with none of the caller's `MLSCOPE_*` settings or `NO_COLOR`, so that only what a
/// test passes applies.
fn proxy_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_mlscope-proxy"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("MLSCOPE_") {
            command.env_remove(name);
        }
    }
    command.env_remove("NO_COLOR").stdin(Stdio::null());
    command
}

/// Runs the binary to its end (it is expected to refuse its arguments at once).
fn refused(args: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let output = proxy_command()
        .args(args)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(EXIT_CONFIG),
        "{args:?}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "{args:?}: a refused configuration left files behind"
    );
    output
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running proxy, killed and waited for when dropped (also when an assertion fails), with its
/// state store and log in a directory removed after it.
struct RunningProxy {
    child: Child,
    log_path: PathBuf,
    // Dropped after `drop` below has stopped the process.
    _dir: tempfile::TempDir,
}

impl RunningProxy {
    /// Starts the proxy on `listen` and `admin_listen`, in front of an MLflow that is not there,
    /// with its stderr (the logs) redirected to a file.
    fn start(listen: &str, admin_listen: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log_path = dir.path().join("proxy.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let database_url = format!("sqlite://{}", dir.path().join("state.db").display());
        let upstream = format!("http://127.0.0.1:{}", free_port());
        let child = proxy_command()
            .args(["--listen", listen, "--admin-listen", admin_listen])
            .args(["--upstream", &upstream, "--database-url", &database_url])
            .args(["--log-format", "pretty", "--log-level", "info"])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Self {
            child,
            log_path,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap()
    }

    /// Waits until `GET path` on `address` answers, failing if the proxy exits first.
    fn wait_for(&mut self, address: (&str, u16), path: &str) -> (u16, String) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the proxy exited with {status}:\n{}", self.log());
            }
            if let Ok(answer) = get(address, path) {
                return answer;
            }
            assert!(
                Instant::now() < deadline,
                "{path} never answered:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until a log line holds all of `parts`.
    fn wait_for_log_line(&self, parts: &[&str]) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let log = self.log();
            if let Some(line) = log.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
                return line.to_owned();
            }
            assert!(Instant::now() < deadline, "no line with {parts:?}:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for RunningProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET path` over HTTP/1.1 on a fresh connection to a name (every address it resolves to is
/// tried); the status and the body.
fn get((host, port): (&str, u16), path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect((host, port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {answer:?}")))?;
    let body = answer
        .split_once("\r\n\r\n")
        .map_or("", |(_, body)| body)
        .to_owned();
    Ok((status, body))
}

#[test]
fn listen_addresses_may_be_host_names() {
    let (port, admin_port) = (free_port(), free_port());
    let mut proxy = RunningProxy::start(
        &format!("localhost:{port}"),
        &format!("localhost:{admin_port}"),
    );
    let (status, body) = proxy.wait_for(("localhost", admin_port), "/healthz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""status":"ok""#), "{body}");
    // The MLflow-facing listener is up too; MLflow is not, which the proxy answers itself.
    let (status, _) = proxy.wait_for(("localhost", port), "/api/2.0/mlflow/experiments/list");
    assert_eq!(status, 502);
}

#[test]
fn a_502_for_an_unreachable_mlflow_is_logged_as_answered_by_the_proxy() {
    let port = free_port();
    let mut proxy = RunningProxy::start(
        &format!("127.0.0.1:{port}"),
        &format!("127.0.0.1:{}", free_port()),
    );
    let (status, body) = proxy.wait_for(("127.0.0.1", port), "/api/2.0/mlflow/experiments/list");
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("TEMPORARILY_UNAVAILABLE"), "{body}");
    let line = proxy.wait_for_log_line(&["answered", "status=502"]);
    assert!(line.contains(r#"answered_by="proxy""#), "{line}");
}

#[test]
fn logs_written_to_a_file_have_no_colour_codes() {
    let port = free_port();
    let mut proxy = RunningProxy::start(
        &format!("127.0.0.1:{port}"),
        &format!("127.0.0.1:{}", free_port()),
    );
    proxy.wait_for(("127.0.0.1", port), "/api/2.0/mlflow/experiments/list");
    // Lines of several levels (INFO, WARN) have been written: each level has its colour.
    proxy.wait_for_log_line(&["WARN", "request failed"]);
    let log = proxy.log();
    assert!(log.contains("INFO"), "{log}");
    assert!(!log.contains("\x1b["), "{log:?}");
}

#[test]
fn a_listen_value_that_is_not_host_and_port_is_refused_in_one_line() {
    for (args, flag) in [
        (["--listen", "localhost"], "--listen"),
        (["--listen", "localhost:70000"], "--listen"),
        (["--admin-listen", "0.0.0.0"], "--admin-listen"),
    ] {
        let output = refused(&args);
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert!(
            stderr.contains("expected HOST:PORT, e.g. 127.0.0.1:5001 or localhost:5001"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn a_misspelled_flag_is_answered_with_the_flag_meant() {
    let output = refused(&["--listn", "localhost:5001"]);
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("'--listn'"), "{stderr}");
    assert!(
        stderr.contains("tip: a similar argument exists: '--listen'"),
        "{stderr}"
    );
}
