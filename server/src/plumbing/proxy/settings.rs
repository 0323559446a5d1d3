//! Where and how the forwarder reaches MLflow: the upstream's address, the `Host` policy and the
//! timeouts around every exchange, and the flags and file keys that set them.

use std::time::Duration;

use serde::Deserialize;

use crate::plumbing::settings::parse_duration;

/// How the proxy sets the `Host` header on upstream requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum HostHeader {
    /// Forward the client's `Host` unchanged (MLflow 3 checks it against `--allowed-hosts`).
    Preserve,
    /// Replace it with the upstream's host, and its port where it is not 80 (the client's goes
    /// on as `X-Forwarded-Host`).
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

    /// The request target sent to the upstream for a client request's path and query (origin
    /// form: the upstream's base path, then the client's path and query byte for byte).
    pub fn uri_for(&self, path_and_query: &str) -> Result<http::Uri, http::Error> {
        let target = if self.base_path.is_empty() {
            http::uri::PathAndQuery::try_from(path_and_query)?
        } else {
            http::uri::PathAndQuery::try_from(format!("{}{}", self.base_path, path_and_query))?
        };
        Ok(http::Uri::from(target))
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
pub struct ForwarderConfig {
    pub upstream: Upstream,
    pub host_header: HostHeader,
    pub timeouts: Timeouts,
    /// Idle keep-alive connections kept to the upstream.
    pub max_idle: usize,
}

impl Default for ForwarderConfig {
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

impl ForwarderConfig {
    /// Refuses timeouts that would fail every exchange.
    pub fn validate(&self) -> Result<(), String> {
        for (name, d) in [
            ("connect-timeout", self.timeouts.connect),
            ("response-timeout", self.timeouts.response_headers),
            ("body-idle-timeout", self.timeouts.body_idle),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be longer than 0"));
            }
        }
        Ok(())
    }
}

/// The forwarder's settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
pub struct ForwarderOptions {
    /// URL of the MLflow tracking server [default: http://127.0.0.1:5000].
    #[arg(long, global = true, env = "MLSCOPE_UPSTREAM", value_name = "URL")]
    pub upstream: Option<String>,
    /// `preserve` forwards the client's Host header; `upstream` sends the upstream's [default: preserve].
    #[arg(long, env = "MLSCOPE_HOST_HEADER", value_enum)]
    pub host_header: Option<HostHeader>,
    /// Upstream TCP connect timeout [default: 5s].
    #[arg(long, env = "MLSCOPE_CONNECT_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub connect_timeout: Option<Duration>,
    /// Time the upstream may take to send response headers [default: 120s].
    #[arg(long, env = "MLSCOPE_RESPONSE_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub response_timeout: Option<Duration>,
    /// Longest pause inside a request or response body before it is aborted [default: 120s].
    #[arg(long, env = "MLSCOPE_BODY_IDLE_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub body_idle_timeout: Option<Duration>,
    /// Idle keep-alive connections kept to the upstream [default: 64].
    #[arg(long, env = "MLSCOPE_UPSTREAM_MAX_IDLE", value_name = "N")]
    pub upstream_max_idle: Option<usize>,
}

impl ForwarderOptions {
    /// The given values over the defaults; an upstream URL the forwarder cannot use is refused.
    pub fn resolve(self) -> Result<ForwarderConfig, String> {
        let mut settings = ForwarderConfig::default();
        if let Some(url) = self.upstream {
            settings.upstream = Upstream::parse(&url)?;
        }
        let timeouts = &mut settings.timeouts;
        timeouts.connect = self.connect_timeout.unwrap_or(timeouts.connect);
        timeouts.response_headers = self.response_timeout.unwrap_or(timeouts.response_headers);
        timeouts.body_idle = self.body_idle_timeout.unwrap_or(timeouts.body_idle);
        settings.host_header = self.host_header.unwrap_or(settings.host_header);
        settings.max_idle = self.upstream_max_idle.unwrap_or(settings.max_idle);
        Ok(settings)
    }
}
