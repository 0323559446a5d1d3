//! Route classes: a small, fixed label set for metrics and logs (never the raw path, whose ids
//! would make the label set unbounded).

use std::fmt;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum RouteClass {
    LogBatch,
    LogMetric,
    Tracking,
    Artifacts,
    Graphql,
    Health,
    Ui,
    Other,
}

/// Tracking API prefixes: the UI uses `/ajax-api`, newer endpoints also live under `/api/3.0`
/// (and `/ajax-api/3.0`).
pub(crate) const TRACKING_PREFIXES: [&str; 4] = [
    "/api/2.0/mlflow/",
    "/ajax-api/2.0/mlflow/",
    "/api/3.0/mlflow/",
    "/ajax-api/3.0/mlflow/",
];
const ARTIFACT_PREFIXES: [&str; 3] = [
    "/api/2.0/mlflow-artifacts/",
    "/ajax-api/2.0/mlflow-artifacts/",
    "/get-artifact",
];

impl RouteClass {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteClass::LogBatch => "log_batch",
            RouteClass::LogMetric => "log_metric",
            RouteClass::Tracking => "tracking",
            RouteClass::Artifacts => "artifacts",
            RouteClass::Graphql => "graphql",
            RouteClass::Health => "health",
            RouteClass::Ui => "ui",
            RouteClass::Other => "other",
        }
    }

    pub fn of(path: &str) -> Self {
        if let Some(rest) = TRACKING_PREFIXES.iter().find_map(|p| path.strip_prefix(p)) {
            return match rest {
                "runs/log-batch" => RouteClass::LogBatch,
                "runs/log-metric" => RouteClass::LogMetric,
                _ => RouteClass::Tracking,
            };
        }
        if ARTIFACT_PREFIXES.iter().any(|p| path.starts_with(p)) || path.contains("/get-artifact") {
            return RouteClass::Artifacts;
        }
        match path {
            "/graphql" | "/ajax-api/graphql" => RouteClass::Graphql,
            "/health" | "/version" => RouteClass::Health,
            "/" => RouteClass::Ui,
            p if p.starts_with("/static-files/") => RouteClass::Ui,
            _ => RouteClass::Other,
        }
    }
}

/// Whether a request changes what MLflow (or the artifact store) holds. A read is `GET`, `HEAD`,
/// `OPTIONS`, GraphQL (the UI's queries) or one of the tracking API's `POST` reads: searches
/// (`runs/search`, `logged-models/search`, `traces/search`, ...) and gets (`batch-get`).
pub(crate) fn is_write(method: &http::Method, path: &str) -> bool {
    if matches!(
        *method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    ) {
        return false;
    }
    match RouteClass::of(path) {
        RouteClass::Graphql | RouteClass::Health | RouteClass::Ui => false,
        RouteClass::Tracking => {
            let operation = path.rsplit('/').next().unwrap_or(path);
            !(operation.starts_with("search")
                || operation.starts_with("get")
                || operation.starts_with("batch-get"))
        }
        _ => true,
    }
}

/// The tracking API's writes that set a value rather than create something: sent twice, they
/// leave MLflow as sent once (a sample logged again with the same key, value, timestamp and step
/// is stored once; a param with the same value is skipped; tags and updates overwrite).
const REPEATABLE_WRITES: [&str; 22] = [
    "runs/log-batch",
    "runs/log-metric",
    "runs/log-parameter",
    "runs/set-tag",
    "runs/delete-tag",
    "runs/update",
    "runs/delete",
    "runs/restore",
    "experiments/update",
    "experiments/delete",
    "experiments/restore",
    "experiments/set-experiment-tag",
    "experiments/delete-experiment-tag",
    "registered-models/update",
    "registered-models/delete",
    "registered-models/set-tag",
    "registered-models/delete-tag",
    "registered-models/alias",
    "model-versions/update",
    "model-versions/delete",
    "model-versions/set-tag",
    "model-versions/delete-tag",
];

/// Whether a request may be sent twice with the effect of once, so that a client may repeat it
/// when its outcome is unknown: reads, `PUT` and `DELETE`, and the tracking writes of
/// [`REPEATABLE_WRITES`]. Every other write (`runs/create`, `experiments/create`, ...) is a
/// create: repeated, it creates twice.
pub(crate) fn repeats_safely(method: &http::Method, path: &str) -> bool {
    if !is_write(method, path) || matches!(*method, http::Method::PUT | http::Method::DELETE) {
        return true;
    }
    TRACKING_PREFIXES
        .iter()
        .find_map(|p| path.strip_prefix(p))
        .is_some_and(|operation| REPEATABLE_WRITES.contains(&operation))
}

impl fmt::Display for RouteClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl EncodeLabelValue for RouteClass {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> fmt::Result {
        fmt::Write::write_str(encoder, self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::RouteClass::*;
    use super::*;

    #[test]
    fn paths_map_to_their_route_class() {
        for (path, class) in [
            ("/api/2.0/mlflow/runs/log-batch", LogBatch),
            ("/ajax-api/2.0/mlflow/runs/log-batch", LogBatch),
            ("/api/2.0/mlflow/runs/log-metric", LogMetric),
            ("/api/2.0/mlflow/runs/get", Tracking),
            ("/api/3.0/mlflow/traces/search", Tracking),
            (
                "/api/2.0/mlflow-artifacts/artifacts/0/r/artifacts/a.txt",
                Artifacts,
            ),
            ("/get-artifact", Artifacts),
            ("/graphql", Graphql),
            ("/health", Health),
            ("/", Ui),
            ("/static-files/static/js/main.js", Ui),
            ("/something/else", Other),
        ] {
            assert_eq!(RouteClass::of(path), class, "{path}");
        }
    }

    #[test]
    fn creates_are_the_writes_that_do_not_repeat_safely() {
        use http::Method;
        for (method, path, safe) in [
            (Method::POST, "/api/2.0/mlflow/runs/create", false),
            (
                Method::POST,
                "/ajax-api/2.0/mlflow/experiments/create",
                false,
            ),
            (
                Method::POST,
                "/api/2.0/mlflow/registered-models/create",
                false,
            ),
            (Method::POST, "/api/2.0/mlflow/logged-models", false),
            (Method::POST, "/v1/traces", false),
            (Method::POST, "/api/2.0/mlflow/runs/log-batch", true),
            (Method::POST, "/api/2.0/mlflow/runs/log-metric", true),
            (Method::POST, "/api/2.0/mlflow/runs/set-tag", true),
            (Method::POST, "/api/3.0/mlflow/runs/update", true),
            (
                Method::PATCH,
                "/api/2.0/mlflow/registered-models/update",
                true,
            ),
            (Method::POST, "/api/2.0/mlflow/runs/search", true),
            (Method::GET, "/api/2.0/mlflow/runs/get", true),
            (
                Method::PUT,
                "/api/2.0/mlflow-artifacts/artifacts/0/r/artifacts/a",
                true,
            ),
        ] {
            assert_eq!(repeats_safely(&method, path), safe, "{method} {path}");
        }
    }

    #[test]
    fn searches_and_gets_are_reads_even_when_posted() {
        use http::Method;
        for (method, path, write) in [
            (Method::POST, "/api/2.0/mlflow/runs/log-batch", true),
            (Method::POST, "/api/2.0/mlflow/runs/create", true),
            (Method::POST, "/api/2.0/mlflow/runs/set-tag", true),
            (Method::POST, "/v1/traces", true),
            (
                Method::PUT,
                "/api/2.0/mlflow-artifacts/artifacts/0/r/artifacts/a",
                true,
            ),
            (Method::POST, "/ajax-api/2.0/mlflow/runs/search", false),
            (Method::POST, "/api/2.0/mlflow/experiments/search", false),
            (Method::POST, "/api/3.0/mlflow/traces/search", false),
            (
                Method::POST,
                "/ajax-api/3.0/mlflow/logged-models/search",
                false,
            ),
            (
                Method::POST,
                "/ajax-api/2.0/mlflow/experiments/search-datasets",
                false,
            ),
            (
                Method::POST,
                "/api/2.0/mlflow/logged-models/batch-get",
                false,
            ),
            (Method::POST, "/graphql", false),
            (Method::GET, "/api/2.0/mlflow/runs/get", false),
            (
                Method::DELETE,
                "/api/2.0/mlflow-artifacts/artifacts/0/r/artifacts/a",
                true,
            ),
        ] {
            assert_eq!(is_write(&method, path), write, "{method} {path}");
        }
    }
}
