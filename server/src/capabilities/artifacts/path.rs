//! Artifact paths: MLflow's safety rules, and which MLflow object owns a path.

use std::borrow::Cow;
use std::fmt;

use percent_encoding::percent_decode_str;

/// Why a path was refused; shown to the user as MLflow shows it ("Invalid path").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPath;

/// Decodes `raw` (as taken from the URL, still percent-encoded) the way MLflow does — repeatedly,
/// until it stops changing — and applies MLflow's rules: no `#`, no `..` segment, not absolute
/// (POSIX or Windows, drive letters and UNC names included). Stricter than MLflow on Linux in
/// what it also refuses: control characters, `..` between backslashes, `file:` URIs and text
/// that is not UTF-8 once decoded. Returns the decoded path.
pub fn validate(raw: &str) -> Result<String, InvalidPath> {
    let mut path: Cow<'_, str> = Cow::Borrowed(raw);
    let mut stable = false;
    for _ in 0..10 {
        let decoded = percent_decode_str(&path)
            .decode_utf8()
            .map_err(|_| InvalidPath)?;
        if decoded == path {
            stable = true;
            break;
        }
        path = Cow::Owned(decoded.into_owned());
    }
    if !stable {
        return Err(InvalidPath);
    }
    let path = path.into_owned();
    let windows_absolute = {
        let b = path.as_bytes();
        path.starts_with('\\') || (b.len() >= 2 && b[0].is_ascii_alphabetic() && b[1] == b':')
    };
    // MLflow turns a `file:` URI into a local path first (`file:/etc` is absolute and refused);
    // the gateway refuses every `file:` path rather than guess which object it names.
    let file_uri = path
        .get(..5)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("file:"));
    if path.contains('#')
        || file_uri
        || path.chars().any(char::is_control)
        || path.starts_with('/')
        || windows_absolute
        // `..` climbs out of the root; `.` names no object (MLflow 3.17 answers it with a 500,
        // the store with an error): both are the client's mistake.
        || path
            .split(['/', '\\'])
            .any(|segment| segment == ".." || segment == ".")
    {
        return Err(InvalidPath);
    }
    Ok(path)
}

/// The MLflow object whose artifact root holds a path.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Owner {
    /// `<experiment>/<run>/artifacts/...`
    Run { experiment: String, run: String },
    /// `<experiment>/models/<model>/artifacts/...`
    Model { experiment: String, model: String },
    /// `<experiment>/traces/<trace>/artifacts/...`
    Trace { experiment: String, trace: String },
}

impl Owner {
    /// The owner of `path` (relative to the artifacts destination) when it lies under an
    /// MLflow-owned root with at least one name below it.
    pub fn of(path: &str) -> Option<Owner> {
        let segments: Vec<&str> = path.split('/').collect();
        let nonempty = |s: &&str| !s.is_empty();
        match segments.as_slice() {
            [experiment, kind @ ("models" | "traces"), id, "artifacts", rest @ ..]
                if !rest.is_empty()
                    && rest.iter().all(nonempty)
                    && !experiment.is_empty()
                    && !id.is_empty() =>
            {
                let (experiment, id) = (experiment.to_string(), id.to_string());
                Some(if *kind == "models" {
                    Owner::Model {
                        experiment,
                        model: id,
                    }
                } else {
                    Owner::Trace {
                        experiment,
                        trace: id,
                    }
                })
            }
            [experiment, run, "artifacts", rest @ ..]
                if !rest.is_empty()
                    && rest.iter().all(nonempty)
                    && !experiment.is_empty()
                    && !run.is_empty() =>
            {
                Some(Owner::Run {
                    experiment: experiment.to_string(),
                    run: run.to_string(),
                })
            }
            _ => None,
        }
    }

    /// The owner whose artifact root is `path` or holds it: what a delete of `path` may remove
    /// at most. `None` for anything above an artifact root.
    pub fn of_tree(path: &str) -> Option<Owner> {
        let trimmed = path.trim_end_matches('/');
        Owner::of(trimmed)
            .or_else(|| Owner::of(&format!("{trimmed}/_")).filter(|owner| owner.root() == trimmed))
    }

    pub fn experiment(&self) -> &str {
        match self {
            Owner::Run { experiment, .. }
            | Owner::Model { experiment, .. }
            | Owner::Trace { experiment, .. } => experiment,
        }
    }

    /// The artifact root this owner writes under.
    pub fn root(&self) -> String {
        match self {
            Owner::Run { experiment, run } => format!("{experiment}/{run}/artifacts"),
            Owner::Model { experiment, model } => format!("{experiment}/models/{model}/artifacts"),
            Owner::Trace { experiment, trace } => format!("{experiment}/traces/{trace}/artifacts"),
        }
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::Run { experiment, run } => write!(f, "run {run} of experiment {experiment}"),
            Owner::Model { experiment, model } => {
                write!(f, "logged model {model} of experiment {experiment}")
            }
            Owner::Trace { experiment, trace } => {
                write!(f, "trace {trace} of experiment {experiment}")
            }
        }
    }
}

/// Extensions (or whole names) MLflow serves as `text/plain` so the UI can preview them;
/// matched case-sensitively, as MLflow does.
const TEXT_EXTENSIONS: &[&str] = &[
    "txt",
    "log",
    "err",
    "cfg",
    "conf",
    "cnf",
    "cf",
    "ini",
    "properties",
    "prop",
    "hocon",
    "toml",
    "yaml",
    "yml",
    "xml",
    "json",
    "js",
    "py",
    "py3",
    "csv",
    "tsv",
    "md",
    "rst",
    "ipynb",
    "MLmodel",
    "MLproject",
];

/// The MIME type MLflow's server answers downloads with, guessed from the file name: its
/// text list first, then the usual extension table, then `application/octet-stream`.
pub fn content_type(path: &str) -> &'static str {
    let name = path.rsplit('/').next().unwrap_or(path);
    let ext = name.rsplit_once('.').map_or(name, |(_, ext)| ext);
    if TEXT_EXTENSIONS.contains(&ext) {
        return "text/plain";
    }
    mime_guess::from_path(name)
        .first_raw()
        .unwrap_or("application/octet-stream")
}

/// `Content-Disposition: attachment` for a download, written as MLflow writes it: a bare token
/// when the name allows, a quoted string otherwise, and `filename*` for non-ASCII names.
pub fn content_disposition(path: &str) -> String {
    let name = path.rsplit('/').next().unwrap_or(path);
    let is_token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    let quoted = |s: &str| format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
    if name.is_ascii() {
        if !name.is_empty() && name.chars().all(is_token) {
            format!("attachment; filename={name}")
        } else {
            format!("attachment; filename={}", quoted(name))
        }
    } else {
        let fallback: String = name.chars().filter(char::is_ascii).collect();
        let fallback = if fallback.trim().is_empty() {
            "download".to_owned()
        } else {
            fallback
        };
        const SAFE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
            .remove(b'!')
            .remove(b'#')
            .remove(b'$')
            .remove(b'&')
            .remove(b'+')
            .remove(b'-')
            .remove(b'.')
            .remove(b'^')
            .remove(b'_')
            .remove(b'`')
            .remove(b'|')
            .remove(b'~');
        format!(
            "attachment; filename={}; filename*=UTF-8''{}",
            quoted(&fallback),
            percent_encoding::utf8_percent_encode(name, SAFE)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traversal_in_any_encoding_is_refused_like_mlflow() {
        for bad in [
            "../etc/passwd",
            "a/../../b",
            "%2e%2e/secret",
            "%252e%252e/secret",
            "a/%2E%2E/b",
            "/abs/path",
            "%2Fabs",
            "C:/windows",
            "\\\\server\\share",
            "a\\..\\b",
            "file#frag",
            "a%23b",
            "1/r/artifacts/./x",
            "1/r/artifacts/%2e/x",
            ".",
        ] {
            assert_eq!(validate(bad), Err(InvalidPath), "{bad}");
        }
        assert_eq!(
            validate("1/abc/artifacts/model%20v1.pt").unwrap(),
            "1/abc/artifacts/model v1.pt"
        );
        assert_eq!(
            validate("1/abc/artifacts/a..b/c.txt").unwrap(),
            "1/abc/artifacts/a..b/c.txt"
        );
        assert_eq!(validate("").unwrap(), "");
    }

    #[test]
    fn owners_are_recognised_only_below_an_mlflow_root() {
        assert_eq!(
            Owner::of("1/0123abcd/artifacts/ckpt/epoch_3.pt"),
            Some(Owner::Run {
                experiment: "1".into(),
                run: "0123abcd".into()
            })
        );
        assert_eq!(
            Owner::of("7/models/m-42/artifacts/MLmodel"),
            Some(Owner::Model {
                experiment: "7".into(),
                model: "m-42".into()
            })
        );
        assert_eq!(
            Owner::of("7/traces/tr-1/artifacts/traces.json"),
            Some(Owner::Trace {
                experiment: "7".into(),
                trace: "tr-1".into()
            })
        );
        for stray in [
            "checkpoints/my-exp/epoch_3.pt",
            "1/run/artifacts",
            "1/run/artifacts/",
            "1/run/other/x",
            "1//artifacts/x",
            "x",
        ] {
            assert_eq!(Owner::of(stray), None, "{stray}");
        }
        assert_eq!(
            Owner::of("1/r/artifacts/a").unwrap().root(),
            "1/r/artifacts"
        );
    }

    #[test]
    fn content_types_follow_the_file_name() {
        assert_eq!(content_type("1/r/artifacts/metrics.json"), "text/plain");
        assert_eq!(content_type("1/r/artifacts/plot.png"), "image/png");
        assert_eq!(content_type("1/r/artifacts/model/MLmodel"), "text/plain");
        assert_eq!(
            content_type("1/r/artifacts/weights"),
            "application/octet-stream"
        );
        assert_eq!(content_type("1/r/artifacts/notes.ipynb"), "text/plain");
        assert_eq!(
            content_disposition("a/model.pt"),
            "attachment; filename=model.pt"
        );
        assert_eq!(
            content_disposition("a/my file.txt"),
            "attachment; filename=\"my file.txt\""
        );
        assert_eq!(
            content_disposition("a/sp ace é.txt"),
            "attachment; filename=\"sp ace .txt\"; filename*=UTF-8''sp%20ace%20%C3%A9.txt"
        );
    }
}
