//! Shared by the collector's integration tests: a scripted MLflow stand-in on loopback, the
//! collector binary with a clean environment, bounded waits, and child memory cgroups.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde_json::Value;

// === MockMlflow ===

/// One request the stand-in received, and what it answered.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    /// Header names in lower case.
    pub headers: HashMap<String, String>,
    pub body: Value,
    pub status: u16,
}

impl Received {
    pub fn step(&self) -> Option<i64> {
        self.body["metrics"].get(0)?["step"].as_i64()
    }

    pub fn metric_keys(&self) -> Vec<String> {
        self.body["metrics"]
            .as_array()
            .map(|m| {
                m.iter()
                    .map(|m| m["key"].as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn metric(&self, key: &str) -> Option<f64> {
        self.body["metrics"]
            .as_array()?
            .iter()
            .find(|m| m["key"] == key)?["value"]
            .as_f64()
    }

    pub fn tags(&self) -> HashMap<String, String> {
        self.body["tags"]
            .as_array()
            .map(|t| {
                t.iter()
                    .map(|t| {
                        (
                            t["key"].as_str().unwrap_or_default().to_owned(),
                            t["value"].as_str().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

type Responder = Box<dyn FnMut(usize) -> (u16, String) + Send>;

/// An HTTP/1.1 server on 127.0.0.1 that records every request and answers from `responder`
/// (called with the request's index), keep-alive included, as MLflow would be reached.
pub struct MockMlflow {
    pub url: String,
    received: Arc<Mutex<Vec<Received>>>,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

impl MockMlflow {
    pub fn ok() -> Self {
        Self::start(|_| (200, "{}".to_owned()))
    }

    pub fn start(responder: impl FnMut(usize) -> (u16, String) + Send + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let responder: Arc<Mutex<Responder>> = Arc::new(Mutex::new(Box::new(responder)));
        let acceptor = {
            let (received, stop) = (received.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            let (received, responder, stop) =
                                (received.clone(), responder.clone(), stop.clone());
                            thread::spawn(move || serve(stream, &received, &responder, &stop));
                        }
                        Err(_) => thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        MockMlflow {
            url,
            received,
            stop,
            acceptor: Some(acceptor),
        }
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Requests answered with 2xx.
    pub fn accepted(&self) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| (200..300).contains(&r.status))
            .collect()
    }

    /// Accepted batches that carry metrics.
    pub fn samples(&self) -> Vec<Received> {
        self.accepted()
            .into_iter()
            .filter(|r| r.body.get("metrics").is_some())
            .collect()
    }

    /// Tags of accepted batches, merged.
    pub fn tags(&self) -> HashMap<String, String> {
        self.accepted().iter().flat_map(Received::tags).collect()
    }
}

impl Drop for MockMlflow {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn serve(
    stream: TcpStream,
    received: &Mutex<Vec<Received>>,
    responder: &Mutex<Responder>,
    stop: &AtomicBool,
) {
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    // Each round is one request; an idle connection is closed after 60 s.
    let mut idle_since = Instant::now();
    while !stop.load(Ordering::Relaxed) && idle_since.elapsed() < Duration::from_secs(60) {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return,
        }
        let path = line
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        let mut headers = HashMap::new();
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
            }
        }
        let length: usize = headers
            .get("content-length")
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let mut received = received.lock().unwrap();
        let (status, answer) = (responder.lock().unwrap())(received.len());
        received.push(Received {
            path,
            headers,
            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
            status,
        });
        drop(received);
        let response = format!("HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{answer}", answer.len());
        if writer.write_all(response.as_bytes()).is_err() {
            return;
        }
        idle_since = Instant::now();
    }
}

// === the collector binary ===

pub fn collector_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mlscope-collector"))
}

/// The collector with an environment of PATH only: no MLflow, launcher or node variables leak
/// in from the test process.
pub fn collector(url: &str, args: &[&str]) -> Command {
    let mut command = Command::new(collector_binary());
    command.args(args);
    with_clean_environment(&mut command, url);
    command
}

/// [`collector`], exec'd by a shell that first ignores `signals` (as a shell starts a
/// background job with SIGINT ignored): the collector starts with them ignored.
pub fn collector_ignoring(signals: &str, url: &str, args: &[&str]) -> Command {
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!("trap '' {signals}; exec \"$0\" \"$@\""))
        .arg(collector_binary())
        .args(args);
    with_clean_environment(&mut command, url);
    command
}

pub fn with_clean_environment(command: &mut Command, url: &str) {
    command
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("MLFLOW_TRACKING_URI", url)
        .env("MLFLOW_RUN_ID", "run-1")
        .env("MLSCOPE_LOG_FORMAT", "json");
    // Kept through the cleared environment: scripts/test finds what a run left running by it.
    for kept in ["MLSCOPE_TEST_RUN", "TMPDIR"] {
        if let Some(value) = std::env::var_os(kept) {
            command.env(kept, value);
        }
    }
}

/// Starts a command with stdout and stderr captured.
pub fn spawn(command: &mut Command) -> Child {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the collector")
}

pub fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Reads a pipe to its end on a thread of its own.
fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Waits for the child, at most `timeout`; kills it and fails after that. Its stdout and stderr
/// are read meanwhile, so that a verbose child never blocks on a full pipe.
pub fn finish(mut child: Child, timeout: Duration) -> (ExitStatus, String, String) {
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the collector did not exit within {timeout:?}; stderr:\n{}",
                stderr.join().unwrap_or_default()
            );
        }
        thread::sleep(Duration::from_millis(20));
    };
    (
        status,
        stdout.join().unwrap_or_default(),
        stderr.join().unwrap_or_default(),
    )
}

/// Polls `ready` every 20 ms until it holds; fails with `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ready() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

// === Python with psutil ===

/// The project's virtual environment's Python (MLSCOPE_VENV or <repo>/.venv), which has psutil
/// and MLflow (scripts/setup installs them).
pub fn venv_python() -> PathBuf {
    let venv = std::env::var_os("MLSCOPE_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv"));
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/setup (or set MLSCOPE_VENV)",
        python.display()
    );
    python
}
