//! Every error the proxy itself answers with, turned into an HTTP response in exactly one place.
//!
//! [`Error`] is the one type: each kind names what went wrong and so its status and MLflow
//! `error_code`; [`ProxyError`] is the forwarder's own (the upstream could not be reached or the
//! client's body failed). Bodies use MLflow's error JSON so the MLflow client shows the message
//! to the user, and the statuses follow the side that failed: a client's mistake is a 4xx it
//! must not retry; work the proxy refused without forwarding it (its limits, its shares) is 429
//! with `Retry-After`, which MLflow's client retries for every request (3.18 retries a write that
//! is not known to be safe, such as `runs/create`, only after a connection error, 408 or 429, since
//! MLflow's own server may answer 503 after it committed a write); upstream trouble is 502/504.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};

/// Why a request did not get an upstream answer.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    Connect,
    ConnectTimeout,
    ResponseTimeout,
    Reset,
    BodyIdle,
}

impl EncodeLabelValue for UpstreamErrorKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        let name = match self {
            UpstreamErrorKind::Connect => "connect",
            UpstreamErrorKind::ConnectTimeout => "connect_timeout",
            UpstreamErrorKind::ResponseTimeout => "response_timeout",
            UpstreamErrorKind::Reset => "reset",
            UpstreamErrorKind::BodyIdle => "body_idle",
        };
        std::fmt::Write::write_str(encoder, name)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("mlscope-proxy could not connect to the MLflow server at {upstream}: {reason}. Check that MLflow is running and that --upstream points at it.")]
    UpstreamConnect { upstream: String, reason: String },
    #[error(
        "mlscope-proxy timed out after {after:?} connecting to the MLflow server at {upstream}."
    )]
    UpstreamConnectTimeout { upstream: String, after: Duration },
    #[error("the MLflow server at {upstream} sent no response headers within {after:?}; the request may still complete there. Raise --response-timeout for slow operations.")]
    UpstreamResponseTimeout { upstream: String, after: Duration },
    #[error("the MLflow server at {upstream} closed the connection before answering ({reason}).")]
    UpstreamReset { upstream: String, reason: String },
    #[error("the request body stalled for more than {after:?}; the upload was aborted. Retry it.")]
    ClientBodyIdle { after: Duration },
    #[error("the request body could not be read: {reason}")]
    ClientBody { reason: String },
    #[error(
        "mlscope-proxy is handling its limit of {limit} concurrent requests and did not forward this one; retry with backoff."
    )]
    Overloaded { limit: usize },
    #[error("mlscope-proxy could not build the upstream request: {reason}")]
    Internal { reason: String },
    /// A write that is not safe to send twice (a create) reached MLflow, which gave no answer:
    /// it may have been applied. Answered 409 `ABORTED`, a status MLflow's clients do not retry
    /// (they retry 408, 429, 500, 502, 503 and 504), so that nothing is created twice.
    #[error("{cause} MLflow may have applied {operation}, so mlscope-proxy did not answer with a status your client retries: check whether it took effect (for example, search for the run or experiment) before sending it again.")]
    OutcomeUnknown {
        operation: String,
        cause: Box<ProxyError>,
    },
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::UpstreamConnect { .. } | ProxyError::UpstreamReset { .. } => {
                StatusCode::BAD_GATEWAY
            }
            ProxyError::UpstreamConnectTimeout { .. }
            | ProxyError::UpstreamResponseTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::ClientBodyIdle { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::ClientBody { .. } => StatusCode::BAD_REQUEST,
            ProxyError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::OutcomeUnknown { .. } => StatusCode::CONFLICT,
        }
    }

    /// MLflow's `error_code` for this failure.
    pub fn error_code(&self) -> &'static str {
        match self {
            ProxyError::ClientBodyIdle { .. } | ProxyError::ClientBody { .. } => "BAD_REQUEST",
            ProxyError::Internal { .. } => "INTERNAL_ERROR",
            ProxyError::Overloaded { .. } => "REQUEST_LIMIT_EXCEEDED",
            ProxyError::OutcomeUnknown { .. } => "ABORTED",
            _ => "TEMPORARILY_UNAVAILABLE",
        }
    }

    /// The upstream-error counter this failure increments, if any.
    pub fn kind(&self) -> Option<UpstreamErrorKind> {
        Some(match self {
            ProxyError::UpstreamConnect { .. } => UpstreamErrorKind::Connect,
            ProxyError::UpstreamConnectTimeout { .. } => UpstreamErrorKind::ConnectTimeout,
            ProxyError::UpstreamResponseTimeout { .. } => UpstreamErrorKind::ResponseTimeout,
            ProxyError::UpstreamReset { .. } => UpstreamErrorKind::Reset,
            ProxyError::ClientBodyIdle { .. } => UpstreamErrorKind::BodyIdle,
            ProxyError::OutcomeUnknown { cause, .. } => return cause.kind(),
            // The proxy's own refusal: MLflow was never asked (counted by the limit itself).
            ProxyError::Overloaded { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::Internal { .. } => return None,
        })
    }
}

/// Whether the proxy's own errors carry MLflow's classification of the error code (`sqlstate`,
/// `error_class`), which MLflow adds to every error since 3.12: on until MLflow's version says
/// otherwise (see [`classify_like_mlflow`]).
static CLASSIFIED: AtomicBool = AtomicBool::new(true);

/// Makes the proxy's own errors carry MLflow's error classification, or not, as the MLflow
/// behind it does (set once its version is known).
pub(crate) fn classify_like_mlflow(on: bool) {
    CLASSIFIED.store(on, Ordering::Relaxed);
}

/// MLflow's classification of an error code, `(sqlstate, error_class)`, as its server derives
/// it for an error raised with that code alone (MLflow's client-side table, 3.12 to 3.17).
fn classification(error_code: &str) -> Option<(&'static str, &'static str)> {
    Some(match error_code {
        "BAD_REQUEST" => ("KAM00", "INVALID_PARAMETER_VALUE"),
        "CUSTOMER_UNAUTHORIZED" | "PERMISSION_DENIED" => ("KAM00", "PERMISSION_DENIED"),
        "ENDPOINT_NOT_FOUND" | "NOT_FOUND" | "RESOURCE_DOES_NOT_EXIST" => {
            ("KAM00", "RESOURCE_NOT_FOUND")
        }
        "FEATURE_DISABLED" => ("KAM00", "FEATURE_DISABLED"),
        "INVALID_PARAMETER_VALUE" => ("KAM00", "INVALID_PARAMETER_VALUE"),
        "RESOURCE_ALREADY_EXISTS" => ("KAM00", "RESOURCE_ALREADY_EXISTS"),
        "INTERNAL_ERROR" | "INVALID_STATE" | "TEMPORARILY_UNAVAILABLE" => {
            ("XXM00", "CLIENT_INTERNAL_ERROR")
        }
        _ => return None,
    })
}

/// MLflow's error JSON: `{"error_code", "message"}`, plus `sqlstate` and `error_class` when
/// `classified` and MLflow classifies the code.
pub(crate) fn error_body(error_code: &str, message: &str, classified: bool) -> serde_json::Value {
    let mut body = serde_json::json!({ "error_code": error_code, "message": message });
    if let Some((sqlstate, error_class)) = classified.then(|| classification(error_code)).flatten()
    {
        body["sqlstate"] = sqlstate.into();
        body["error_class"] = error_class.into();
    }
    body
}

/// An MLflow error response in the shape of the MLflow behind the proxy (see [`error_body`]),
/// with `Retry-After` when the client should come back.
fn respond(
    status: StatusCode,
    error_code: &str,
    message: &str,
    retry_after: Option<u64>,
) -> Response {
    let body = error_body(error_code, message, CLASSIFIED.load(Ordering::Relaxed));
    let mut response = (status, axum::Json(body)).into_response();
    if let Some(seconds) = retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
    }
    response
}

/// Every error the proxy answers itself. The kind decides the status and MLflow's
/// `error_code`; the message is for the person reading it and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A value MLflow refuses too (or would, were it asked): 400 `INVALID_PARAMETER_VALUE`.
    #[error("{0}")]
    InvalidParameter(String),
    /// A request the proxy cannot read or will not pass on: 400 `BAD_REQUEST`.
    #[error("{0}")]
    BadRequest(String),
    /// A request framing the proxy does not implement: 501 `BAD_REQUEST`.
    #[error("{0}")]
    Unsupported(String),
    /// Something the request names does not exist: 404 `RESOURCE_DOES_NOT_EXIST`.
    #[error("{0}")]
    NotFound(String),
    /// A write the proxy's own policy refuses: 403 `PERMISSION_DENIED`.
    #[error("{0}")]
    PermissionDenied(String),
    /// A body over a stated bound: 413 `REQUEST_LIMIT_EXCEEDED`.
    #[error("{0}")]
    TooLarge(String),
    /// A body that did not arrive in time: 408 `BAD_REQUEST`; nothing of it was kept.
    #[error("{0}")]
    TooSlow(String),
    /// This client is over its share: 429 `REQUEST_LIMIT_EXCEEDED`, come back after
    /// `retry_after` seconds.
    #[error("{message}")]
    OverShare { message: String, retry_after: u64 },
    /// The proxy is at one of its own limits and did not forward this request: 429
    /// `REQUEST_LIMIT_EXCEEDED` with `Retry-After: 1` (not 503, which MLflow's client does not
    /// retry for writes that are not known to be safe).
    #[error("{0}")]
    Overloaded(String),
    /// The proxy (or a store it needs) cannot take this now: 503 `TEMPORARILY_UNAVAILABLE`
    /// with `Retry-After: 1`.
    #[error("{0}")]
    Unavailable(String),
    /// A store the proxy needs failed, in a way a retry now would not mend: 502
    /// `TEMPORARILY_UNAVAILABLE` (as when MLflow cannot be reached).
    #[error("{0}")]
    StoreFailed(String),
    /// The proxy's own fault: 500 `INTERNAL_ERROR`.
    #[error("{0}")]
    Internal(String),
    /// MLflow's own answer to the same request, or the `error_code` MLflow gives the same
    /// mistake, reproduced where its status and code are not those of a kind above (e.g. a 404
    /// carrying `INVALID_PARAMETER_VALUE`, a body that is not JSON: 400 `MALFORMED_REQUEST`): a
    /// client gets what MLflow alone would have sent it.
    #[error("{message}")]
    AsMlflow {
        status: StatusCode,
        error_code: &'static str,
        message: String,
    },
    /// The forwarder's own failure.
    #[error(transparent)]
    Proxy(#[from] ProxyError),
}

impl Error {
    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::InvalidParameter(_) | Error::BadRequest(_) => StatusCode::BAD_REQUEST,
            Error::Unsupported(_) => StatusCode::NOT_IMPLEMENTED,
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::PermissionDenied(_) => StatusCode::FORBIDDEN,
            Error::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Error::TooSlow(_) => StatusCode::REQUEST_TIMEOUT,
            Error::OverShare { .. } | Error::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            Error::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::StoreFailed(_) => StatusCode::BAD_GATEWAY,
            Error::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Error::AsMlflow { status, .. } => *status,
            Error::Proxy(e) => e.status(),
        }
    }

    /// MLflow's `error_code` for this error.
    pub fn error_code(&self) -> &'static str {
        match self {
            Error::InvalidParameter(_) => "INVALID_PARAMETER_VALUE",
            Error::BadRequest(_) | Error::Unsupported(_) | Error::TooSlow(_) => "BAD_REQUEST",
            Error::NotFound(_) => "RESOURCE_DOES_NOT_EXIST",
            Error::PermissionDenied(_) => "PERMISSION_DENIED",
            Error::TooLarge(_) | Error::OverShare { .. } | Error::Overloaded(_) => {
                "REQUEST_LIMIT_EXCEEDED"
            }
            Error::Unavailable(_) | Error::StoreFailed(_) => "TEMPORARILY_UNAVAILABLE",
            Error::Internal(_) => "INTERNAL_ERROR",
            Error::AsMlflow { error_code, .. } => error_code,
            Error::Proxy(e) => e.error_code(),
        }
    }

    /// Seconds the client should wait before retrying, when it should.
    fn retry_after(&self) -> Option<u64> {
        match self {
            Error::OverShare { retry_after, .. } => Some(*retry_after),
            Error::Overloaded(_) | Error::Proxy(ProxyError::Overloaded { .. }) => Some(1),
            _ if self.status() == StatusCode::SERVICE_UNAVAILABLE => Some(1),
            _ => None,
        }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        respond(
            self.status(),
            self.error_code(),
            &self.to_string(),
            self.retry_after(),
        )
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        Error::Proxy(self).into_response()
    }
}

/// The most of a refused request's body read before answering.
const DRAIN_BYTES: u64 = 1 << 20;
/// How long a refused request's body may take to arrive before the answer goes out anyway.
const DRAIN_FOR: Duration = Duration::from_secs(2);

/// Answers `refusal` to a request whose `body` the proxy never read. The body is read and dropped
/// first, up to `DRAIN_BYTES` within `DRAIN_FOR`, so that the connection is clean for the client's
/// next request on it (an answer sent over an unread body makes the server close the connection,
/// and the client's next request on it fails); a longer or slower body gets `Connection: close`.
pub(crate) async fn refuse_unread(body: axum::body::Body, refusal: Response) -> Response {
    use http_body::Body as _;
    use http_body_util::BodyExt as _;
    let declared = body.size_hint().upper();
    let drained = if declared.is_some_and(|n| n > DRAIN_BYTES) {
        false
    } else {
        tokio::time::timeout(DRAIN_FOR, async move {
            let mut body = body;
            let mut read = 0u64;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(frame) => {
                        read += frame.data_ref().map_or(0, |d| d.len() as u64);
                        if read > DRAIN_BYTES {
                            return false;
                        }
                    }
                    Err(_) => return false,
                }
            }
            true
        })
        .await
        .unwrap_or(false)
    };
    let mut refusal = refusal;
    if !drained {
        refusal
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    refusal
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn error_bodies_carry_mlflows_classification_when_its_version_does() {
        let classified = error_body("INVALID_PARAMETER_VALUE", "Invalid path", true);
        assert_eq!(
            classified,
            serde_json::json!({"error_code": "INVALID_PARAMETER_VALUE", "message": "Invalid path",
                "sqlstate": "KAM00", "error_class": "INVALID_PARAMETER_VALUE"})
        );
        let denied = error_body("PERMISSION_DENIED", "no", true);
        assert_eq!(
            (denied["sqlstate"].as_str(), denied["error_class"].as_str()),
            (Some("KAM00"), Some("PERMISSION_DENIED"))
        );
        let unavailable = error_body("TEMPORARILY_UNAVAILABLE", "later", true);
        assert_eq!(
            (
                unavailable["sqlstate"].as_str(),
                unavailable["error_class"].as_str()
            ),
            (Some("XXM00"), Some("CLIENT_INTERNAL_ERROR"))
        );
        // MLflow before 3.12, and codes MLflow does not classify: the two fields alone.
        for body in [
            error_body("INVALID_PARAMETER_VALUE", "Invalid path", false),
            error_body("MADE_UP", "x", true),
        ] {
            assert_eq!(body.as_object().unwrap().len(), 2, "{body}");
        }
    }

    #[tokio::test]
    async fn every_kind_answers_with_its_status_code_and_retry_after() {
        let cases = [
            (
                Error::InvalidParameter("m".into()),
                400,
                "INVALID_PARAMETER_VALUE",
                None,
            ),
            (Error::BadRequest("m".into()), 400, "BAD_REQUEST", None),
            (Error::Unsupported("m".into()), 501, "BAD_REQUEST", None),
            (
                Error::NotFound("m".into()),
                404,
                "RESOURCE_DOES_NOT_EXIST",
                None,
            ),
            (
                Error::PermissionDenied("m".into()),
                403,
                "PERMISSION_DENIED",
                None,
            ),
            (
                Error::TooLarge("m".into()),
                413,
                "REQUEST_LIMIT_EXCEEDED",
                None,
            ),
            (Error::TooSlow("m".into()), 408, "BAD_REQUEST", None),
            (
                Error::OverShare {
                    message: "m".into(),
                    retry_after: 7,
                },
                429,
                "REQUEST_LIMIT_EXCEEDED",
                Some("7"),
            ),
            (
                Error::Overloaded("m".into()),
                429,
                "REQUEST_LIMIT_EXCEEDED",
                Some("1"),
            ),
            (
                Error::Unavailable("m".into()),
                503,
                "TEMPORARILY_UNAVAILABLE",
                Some("1"),
            ),
            (
                Error::StoreFailed("m".into()),
                502,
                "TEMPORARILY_UNAVAILABLE",
                None,
            ),
            (Error::Internal("m".into()), 500, "INTERNAL_ERROR", None),
            (
                Error::AsMlflow {
                    status: StatusCode::NOT_FOUND,
                    error_code: "INVALID_PARAMETER_VALUE",
                    message: "m".into(),
                },
                404,
                "INVALID_PARAMETER_VALUE",
                None,
            ),
            (
                Error::Proxy(ProxyError::Overloaded { limit: 1 }),
                429,
                "REQUEST_LIMIT_EXCEEDED",
                Some("1"),
            ),
        ];
        for (error, status, code, retry_after) in cases {
            let what = format!("{error:?}");
            let message = error.to_string();
            let response = error.into_response();
            assert_eq!(response.status().as_u16(), status, "{what}");
            assert_eq!(
                response
                    .headers()
                    .get(header::RETRY_AFTER)
                    .map(|v| v.to_str().unwrap()),
                retry_after,
                "{what}"
            );
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(json["error_code"], code, "{what}");
            assert_eq!(json["message"].as_str(), Some(message.as_str()), "{what}");
        }
    }

    #[tokio::test]
    async fn upstream_failures_become_mlflow_error_json_with_retryable_statuses() {
        let err = ProxyError::UpstreamConnect {
            upstream: "http://127.0.0.1:1".into(),
            reason: "connection refused".into(),
        };
        let response = err.into_response();
        assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["error_code"], "TEMPORARILY_UNAVAILABLE");
        assert!(json["message"]
            .as_str()
            .unwrap()
            .contains("connection refused"));

        let overloaded = ProxyError::Overloaded { limit: 3 }.into_response();
        assert_eq!(overloaded.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(overloaded.headers()[header::RETRY_AFTER], "1");
    }
}
