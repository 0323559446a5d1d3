//! Path validation, differential against MLflow's own `validate_path_is_safe` (MLflow 3.17.2 from
//! the project's virtual environment) on a corpus of encoded traversal attempts: the gateway never
//! accepts a path MLflow refuses, and where both accept, both name the same object.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

use mlscope_proxy::capabilities::artifacts::path;
use mlscope_tests::venv;
use serde_json::Value;

/// Reads a JSON list of raw paths on stdin; prints, for each, the canonical path MLflow's
/// validation returns, or null when it refuses (or fails to decode).
const MLFLOW_VALIDATE: &str = r#"
import json, sys
from mlflow.utils.uri import validate_path_is_safe
out = []
for raw in json.load(sys.stdin):
    try:
        out.append(validate_path_is_safe(raw))
    except Exception:
        out.append(None)
json.dump(out, sys.stdout)
"#;

/// Path pieces that traversal attempts are made of, raw and percent-encoded up to three times.
const TOKENS: [&str; 24] = [
    "a",
    "..",
    ".",
    "%2e%2e",
    "%252e%252e",
    "%25252e%25252e",
    "%2E.",
    "..\\",
    "\\..",
    "a\\..\\b",
    "%5c..",
    "#",
    "%23",
    "C:",
    "c:\\x",
    "%2f",
    "%252f..",
    "file:",
    "x%00",
    "%0a",
    "%e9",
    "%c3%a9",
    "~",
    "models",
];

fn corpus() -> Vec<String> {
    let mut paths: Vec<String> = TOKENS.iter().map(|t| t.to_string()).collect();
    for a in TOKENS {
        for b in TOKENS {
            for join in ["/", "%2f"] {
                paths.push(format!("{a}{join}{b}"));
                paths.push(format!("/{a}{join}{b}"));
                for c in ["..", "%2e%2e", "x", "%252e%252e"] {
                    paths.push(format!("{a}{join}{b}/{c}"));
                }
            }
        }
    }
    paths
}

/// Why the gateway may refuse what MLflow on Linux accepts, each documented in docs/artifacts.md:
/// judged on the raw path decoded until it stops changing.
fn stricter_on_purpose(raw: &str) -> Option<&'static str> {
    let mut bytes = raw.as_bytes().to_vec();
    for _ in 0..10 {
        let next: Vec<u8> = percent_encoding::percent_decode(&bytes).collect();
        if next == bytes {
            break;
        }
        bytes = next;
    }
    let Ok(decoded) = String::from_utf8(bytes) else {
        return Some("not UTF-8 once decoded");
    };
    if decoded.chars().any(char::is_control) {
        return Some("control characters (MLflow escapes or drops them)");
    }
    if decoded.contains('#') {
        return Some("`#` (MLflow's URL parsing drops an empty fragment)");
    }
    if decoded
        .get(..5)
        .is_some_and(|s| s.eq_ignore_ascii_case("file:"))
    {
        return Some("`file:` URIs");
    }
    if decoded.split(['/', '\\']).any(|s| s == "..") {
        return Some("`..` between backslashes");
    }
    if decoded.split(['/', '\\']).any(|s| s == ".") {
        return Some("`.` segments (MLflow 3.17's handlers answer them 500, stores refuse them)");
    }
    if decoded.starts_with(['/', '\\']) || decoded.as_bytes().get(1) == Some(&b':') {
        return Some("absolute (MLflow's URL parsing drops leading slashes)");
    }
    None
}

#[test]
fn the_gateway_never_accepts_a_path_mlflow_refuses_and_names_the_same_object_when_both_accept() {
    let corpus = corpus();
    let mut python = Command::new(venv().join("bin/python"))
        .args(["-c", MLFLOW_VALIDATE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting MLflow's Python");
    python
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(&corpus).unwrap().as_bytes())
        .unwrap();
    let output = python.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mlflow: Vec<Value> = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(mlflow.len(), corpus.len());

    let mut refused_by_mlflow = 0;
    let mut stricter: BTreeMap<&str, usize> = BTreeMap::new();
    let mut problems = Vec::new();
    for (raw, theirs) in corpus.iter().zip(&mlflow) {
        let ours = path::validate(raw).ok();
        match (theirs.as_str(), ours) {
            (None, Some(ours)) => problems.push(format!("{raw:?}: MLflow refuses, the gateway accepts as {ours:?}")),
            (None, None) => refused_by_mlflow += 1,
            (Some(theirs), Some(ours)) if theirs != ours => problems.push(format!("{raw:?}: MLflow names {theirs:?}, the gateway {ours:?}")),
            (Some(_), Some(_)) => {}
            (Some(theirs), None) => match stricter_on_purpose(raw) {
                Some(reason) => *stricter.entry(reason).or_default() += 1,
                None => problems.push(format!("{raw:?}: MLflow accepts as {theirs:?}, the gateway refuses it for no documented reason")),
            },
        }
    }
    eprintln!(
        "{} paths: MLflow refused {refused_by_mlflow}; the gateway refused besides: {stricter:?}",
        corpus.len()
    );
    assert!(
        refused_by_mlflow > 1000,
        "the corpus exercises refusals ({refused_by_mlflow})"
    );
    assert!(
        problems.is_empty(),
        "{} of {} paths differ:\n{}",
        problems.len(),
        corpus.len(),
        problems
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
