//! Where and how the forwarder reaches MLflow: the upstream's address, the `Host` policy and the
//! timeouts around every exchange.

use std::time::Duration;

use serde::Deserialize;

/// How the proxy sets the `Host` header on upstream requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum HostHeader {
    /// Forward the client's `Host` unchanged (MLflow 3 checks it against `--allowed-hosts`).
    Preserve,
    /// Replace it with the upstream's authority.
    Upstream,
}

/// The MLflow server requests are forwarded to, split once at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    /// `host:port` as written in the URL.
    pub authority: http::uri::Authority,
    /// Path prefix without a trailing slash (`""` for a server at the root).
    pub base_path: String,
}

impl Upstream {
    /// Splits `url`; a URL the proxy cannot forward to is refused with the reason.
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("upstream {url:?} is not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(format!(
                    "upstream {url:?}: scheme {other:?} is not supported; use http:// (terminate TLS in the gateway)"
                ))
            }
            None => {
                return Err(format!(
                    "upstream {url:?} needs a scheme, e.g. http://127.0.0.1:5000"
                ))
            }
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("upstream {url:?} has no host"))?;
        if uri.query().is_some() {
            return Err(format!("upstream {url:?} must not carry a query string"));
        }
        let base_path = uri.path().trim_end_matches('/').to_owned();
        Ok(Self {
            authority,
            base_path,
        })
    }

    /// The upstream URI for a client request's path and query, kept byte for byte.
    pub fn uri_for(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        http::Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.base_path, path_and_query))
            .build()
    }

    pub fn url(&self) -> String {
        format!("http://{}{}", self.authority, self.base_path)
    }
}

/// Timeouts around the upstream exchange. None of them limits the total length of a transfer:
/// a slow upload that is still moving is never cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP connect to the upstream.
    pub connect: Duration,
    /// From the request being sent until the upstream's response headers arrive.
    pub response_headers: Duration,
    /// Longest pause between two chunks of a request or response body.
    pub body_idle: Duration,
}

/// What a [`super::Forwarder`] is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwarderSettings {
    pub upstream: Upstream,
    pub host_header: HostHeader,
    pub timeouts: Timeouts,
    /// Idle keep-alive connections kept to the upstream.
    pub max_idle: usize,
}

impl Default for ForwarderSettings {
    fn default() -> Self {
        Self {
            upstream: Upstream::parse("http://127.0.0.1:5000").expect("default upstream parses"),
            host_header: HostHeader::Preserve,
            timeouts: Timeouts {
                connect: Duration::from_secs(5),
                response_headers: Duration::from_secs(120),
                body_idle: Duration::from_secs(120),
            },
            max_idle: 64,
        }
    }
}
