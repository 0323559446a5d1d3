//! MLflow workspaces (MLflow's multi-tenancy, `mlflow server --enable-workspaces`, since 3.10):
//! which workspace a request is in, whether the MLflow behind the proxy has them on, and where a
//! workspace's artifacts live, exactly as MLflow places them.
//!
//! A client names its workspace in the `X-MLFLOW-WORKSPACE` header (no header: the default
//! workspace). With workspaces on, MLflow's artifact API keeps a workspace's files under
//! `workspaces/<name>/` of the artifacts destination: a path the client sends without that prefix
//! is placed under it, a path with it must name the request's own workspace, and the default
//! workspace keeps the layout from before workspaces (no prefix).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use http::{HeaderMap, StatusCode};

use crate::plumbing::mlflow::{MlflowError, ServerInfo};

/// The header a client names its workspace in (HTTP header names are case-insensitive).
pub(crate) const HEADER: &str = crate::plumbing::mlflow::WORKSPACE_HEADER;
/// The workspace of a request without the header.
pub(crate) const DEFAULT: &str = "default";
/// Where a workspace's artifacts live under the artifacts destination.
pub(crate) const ARTIFACT_DIR: &str = "workspaces";

/// A workspace header MLflow refuses before it authenticates (400 "Workspace name ... must match
/// the pattern"): the request is MLflow's to answer, and nothing of it may reach an object key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InvalidName;

/// The workspace a request names, trimmed as MLflow trims it; `Ok(None)` without the header or
/// with a blank one (the default workspace). `Err` for a header MLflow would refuse: one that is
/// not text, sent twice (MLflow reads the values joined), or not a name MLflow's validator takes
/// ([`is_valid_name`]; `default` is the default workspace's own name).
pub(crate) fn of_request(headers: &HeaderMap) -> Result<Option<&str>, InvalidName> {
    let mut values = headers.get_all(HEADER).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(InvalidName);
    }
    let name = value.to_str().map_err(|_| InvalidName)?.trim();
    if name.is_empty() {
        return Ok(None);
    }
    if name == DEFAULT || is_valid_name(name) {
        Ok(Some(name))
    } else {
        Err(InvalidName)
    }
}

/// Whether MLflow's `WorkspaceNameValidator` takes `name`: 2 to 63 characters of lowercase ASCII
/// letters, digits and inner hyphens (a Kubernetes name), and none of its reserved names. No `/`,
/// `.` or `%` can pass, so a valid name is one path segment of an object key and nothing more.
pub(crate) fn is_valid_name(name: &str) -> bool {
    const RESERVED: [&str; 4] = ["workspaces", "api", "ajax-api", "static-files"];
    let bytes = name.as_bytes();
    let inner = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-';
    let edge = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    (2..=63).contains(&bytes.len())
        && bytes.iter().all(inner)
        && bytes.first().is_some_and(edge)
        && bytes.last().is_some_and(edge)
        && !RESERVED.contains(&name)
}

/// Whether the MLflow behind the proxy has workspaces on, as its `server-info` says (the
/// authorizer asks at start and with every authentication probe). Cheap to clone.
#[derive(Clone, Default)]
pub struct Support(Arc<AtomicU8>);

// 0: not known yet.
const OFF: u8 = 1;
const ON: u8 = 2;

impl Support {
    /// `None` until MLflow has answered.
    pub fn enabled(&self) -> Option<bool> {
        match self.0.load(Ordering::Relaxed) {
            OFF => Some(false),
            ON => Some(true),
            _ => None,
        }
    }

    pub fn set(&self, enabled: bool) {
        let new = if enabled { ON } else { OFF };
        if self.0.swap(new, Ordering::Relaxed) != new {
            tracing::info!(
                enabled,
                "MLflow's workspaces setting learned from its server-info; the artifact gateway places paths as MLflow does"
            );
        }
    }

    /// What MLflow's answer to `server-info` says: MLflow from before the route (404) has no
    /// workspaces, nor has one whose answer is no JSON object; another answer says nothing
    /// (`None`).
    pub(crate) fn from_server_info(answer: &Result<ServerInfo, MlflowError>) -> Option<bool> {
        match answer {
            Ok(info) => Some(info.workspaces_enabled()),
            Err(error) if error.status() == Some(StatusCode::NOT_FOUND) => Some(false),
            Err(MlflowError::Unreadable { .. }) => Some(false),
            Err(_) => None,
        }
    }

    /// Whether workspaces apply to a request that names `workspace`: MLflow's answer once known;
    /// before that, a client that names a workspace is taken at its word.
    pub fn apply(&self, workspace: Option<&str>) -> bool {
        self.enabled().unwrap_or(workspace.is_some())
    }
}

/// The artifact path MLflow's artifact API uses for `path` (validated, relative) in a request
/// that names `workspace`, when workspaces are on; the error is MLflow's message for a path that
/// names another workspace than the request's. With workspaces off, `path` as it is.
pub(crate) fn artifact_path(
    path: &str,
    workspace: Option<&str>,
    enabled: bool,
) -> Result<String, String> {
    if !enabled {
        return Ok(path.to_owned());
    }
    let workspace = workspace.unwrap_or(DEFAULT);
    let relative = path.trim_start_matches('/');
    let mut segments = relative.splitn(3, '/');
    if segments.next() == Some(ARTIFACT_DIR) {
        return match segments.next() {
            None | Some("") => Err(format!(
                "Artifact paths prefixed with '{ARTIFACT_DIR}/' must include a workspace name."
            )),
            Some(named) if named != workspace => Err(format!(
                "Artifact path targets workspace '{named}' but the workspace specified in the request is '{workspace}'."
            )),
            Some(_) => Ok(relative.to_owned()),
        };
    }
    if workspace == DEFAULT {
        // The default workspace keeps the layout from before workspaces, root included.
        return Ok(path.to_owned());
    }
    Ok(if relative.is_empty() {
        format!("{ARTIFACT_DIR}/{workspace}")
    } else {
        format!("{ARTIFACT_DIR}/{workspace}/{relative}")
    })
}

/// The workspace whose artifact directory holds `path`, and the rest of the path below it:
/// `workspaces/team-a/2/r/artifacts/x` is `(Some("team-a"), "2/r/artifacts/x")`.
pub(crate) fn split_artifact_path(path: &str) -> (Option<&str>, &str) {
    let mut segments = path.splitn(3, '/');
    match (segments.next(), segments.next(), segments.next()) {
        (Some(ARTIFACT_DIR), Some(workspace), rest) if !workspace.is_empty() => {
            (Some(workspace), rest.unwrap_or(""))
        }
        _ => (None, path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_workspaces_a_path_is_left_as_it_is() {
        assert_eq!(
            artifact_path("workspaces/a/1/r/artifacts/x", Some("b"), false),
            Ok("workspaces/a/1/r/artifacts/x".into())
        );
        assert_eq!(
            artifact_path("1/r/artifacts/x", Some("b"), false),
            Ok("1/r/artifacts/x".into())
        );
    }

    #[test]
    fn a_workspace_s_paths_go_under_its_directory_as_mlflow_places_them() {
        assert_eq!(
            artifact_path("1/r/artifacts/x", Some("team-a"), true),
            Ok("workspaces/team-a/1/r/artifacts/x".into())
        );
        assert_eq!(
            artifact_path("workspaces/team-a/1/r/artifacts/x", Some("team-a"), true),
            Ok("workspaces/team-a/1/r/artifacts/x".into())
        );
        assert_eq!(
            artifact_path("", Some("team-a"), true),
            Ok("workspaces/team-a".into())
        );
        // The default workspace: the layout from before workspaces.
        assert_eq!(
            artifact_path("1/r/artifacts/x", None, true),
            Ok("1/r/artifacts/x".into())
        );
        assert_eq!(artifact_path("", Some("default"), true), Ok("".into()));
        assert_eq!(
            artifact_path("workspaces/default/1/r", None, true),
            Ok("workspaces/default/1/r".into())
        );
    }

    #[test]
    fn a_path_naming_another_workspace_is_refused_with_mlflow_s_message() {
        let refused = artifact_path("workspaces/team-b/1/r/artifacts/x", Some("team-a"), true);
        assert_eq!(
            refused,
            Err("Artifact path targets workspace 'team-b' but the workspace specified in the request is 'team-a'.".into())
        );
        assert!(artifact_path("workspaces/x", None, true).is_err());
        assert!(artifact_path("workspaces/", Some("a"), true).is_err());
    }

    #[test]
    fn server_info_says_whether_workspaces_are_on() {
        let said = |status: StatusCode, body: &[u8]| {
            Support::from_server_info(&crate::plumbing::mlflow::answer(
                status,
                "/server-info",
                body,
            ))
        };
        let info = |body: &str| said(StatusCode::OK, body.as_bytes());
        assert_eq!(info(r#"{"workspaces_enabled": true}"#), Some(true));
        assert_eq!(info(r#"{"workspaces_enabled": false}"#), Some(false));
        assert_eq!(info(r#"{"store_type": "SqlStore"}"#), Some(false));
        // MLflow from before server-info has no workspaces; a 503 or a 401 says nothing.
        assert_eq!(said(StatusCode::NOT_FOUND, b""), Some(false));
        assert_eq!(said(StatusCode::SERVICE_UNAVAILABLE, b""), None);
        assert_eq!(said(StatusCode::UNAUTHORIZED, b""), None);
    }

    #[test]
    fn split_finds_the_workspace_directory() {
        assert_eq!(
            split_artifact_path("workspaces/team-a/2/r/artifacts/x"),
            (Some("team-a"), "2/r/artifacts/x")
        );
        assert_eq!(
            split_artifact_path("2/r/artifacts/x"),
            (None, "2/r/artifacts/x")
        );
        assert_eq!(
            split_artifact_path("workspaces//2"),
            (None, "workspaces//2")
        );
        assert_eq!(split_artifact_path("workspaces/a"), (Some("a"), ""));
    }

    #[test]
    fn the_request_s_workspace_is_the_trimmed_header() {
        let mut headers = HeaderMap::new();
        assert_eq!(of_request(&headers), Ok(None));
        headers.insert("X-MLflow-Workspace", " team-a ".parse().unwrap());
        assert_eq!(of_request(&headers), Ok(Some("team-a")));
        headers.insert("x-mlflow-workspace", "".parse().unwrap());
        assert_eq!(of_request(&headers), Ok(None));
        headers.insert("x-mlflow-workspace", "default".parse().unwrap());
        assert_eq!(of_request(&headers), Ok(Some("default")));
    }

    #[test]
    fn a_header_mlflow_refuses_is_no_workspace_at_all() {
        // What a hostile client put in the header to reach other workspaces' objects, and names
        // MLflow's validator refuses.
        for value in [
            "team-a/1/0123456789abcdef0123456789abcdef/artifacts",
            "default/1/r/artifacts",
            "team-a/1",
            "../team-a",
            "team-a/..",
            "team.a",
            "team_a",
            "Team-A",
            "t",
            "-team",
            "team-",
            "workspaces",
            "api",
            &"a".repeat(64),
            "team%2Da",
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(HEADER, value.parse().unwrap());
            assert_eq!(of_request(&headers), Err(InvalidName), "{value:?}");
        }
        let mut headers = HeaderMap::new();
        headers.insert(HEADER, http::HeaderValue::from_bytes(b"team-\xe4").unwrap());
        assert_eq!(of_request(&headers), Err(InvalidName), "not text");
        let mut twice = HeaderMap::new();
        twice.append(HEADER, "team-a".parse().unwrap());
        twice.append(HEADER, "team-b".parse().unwrap());
        assert_eq!(of_request(&twice), Err(InvalidName), "sent twice");
        for value in ["team-a", "ab", "123", "a1-b2", &"a".repeat(63)] {
            assert!(is_valid_name(value), "{value}");
        }
    }
}
