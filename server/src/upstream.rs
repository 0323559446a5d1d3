//! What the proxy knows of the MLflow behind it: its version, learned from MLflow itself
//! (`GET /version`, asked at start and every 30 s until it answers), never from a flag. The
//! capabilities that must behave as the server behind them does read it here: the coalescer
//! (one batch per run before 3.16), the artifact gateway (the shape of an upload's answer) and
//! the proxy's own error JSON (MLflow's error classification since 3.12).

use std::time::Duration;

use http::{HeaderMap, Method};
use tokio::sync::watch;

use crate::proxy::Forwarder;

/// The first MLflow whose errors carry `sqlstate` and `error_class`.
const CLASSIFIED_ERRORS: MlflowVersion = MlflowVersion::new(3, 12, 0);

/// An MLflow release, `major.minor.patch`; ordered as releases are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct MlflowVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl MlflowVersion {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// `3.17.2`, `2.22.5`, `3.18.0rc0`, `3.16.1.dev0` (pre-release and local parts are ignored);
    /// `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.trim().split('.');
        let number = |part: Option<&str>| -> Option<u32> {
            let digits: String = part?.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        };
        let major = number(parts.next())?;
        let minor = number(parts.next())?;
        let patch = number(parts.next()).unwrap_or(0);
        Some(Self::new(major, minor, patch))
    }
}

impl std::fmt::Display for MlflowVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The upstream MLflow's version once it has answered; cheap to clone, shared by every part of
/// the proxy that adapts to it.
#[derive(Clone)]
pub struct UpstreamVersion(watch::Sender<Option<MlflowVersion>>);

impl Default for UpstreamVersion {
    fn default() -> Self {
        Self(watch::Sender::new(None))
    }
}

impl UpstreamVersion {
    /// `None` until MLflow has answered `/version` with a version.
    pub fn get(&self) -> Option<MlflowVersion> {
        *self.0.borrow()
    }

    pub fn set(&self, version: MlflowVersion) {
        self.0.send_replace(Some(version));
    }

    /// Waits until the version is known.
    pub async fn learned(&self) -> MlflowVersion {
        let mut receiver = self.0.subscribe();
        let known = receiver.wait_for(Option::is_some).await;
        // The sender lives in `self`: the channel cannot close while this waits.
        known
            .ok()
            .and_then(|v| *v)
            .unwrap_or(MlflowVersion::new(0, 0, 0))
    }

    /// Asks MLflow's `/version` until it answers with a version: at once, then every 30 s.
    pub fn spawn_learner(&self, forwarder: Forwarder) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                let answer = forwarder
                    .call(Method::GET, "/version", &HeaderMap::new(), None)
                    .await;
                if let Ok((status, body)) = answer {
                    let text = String::from_utf8_lossy(&body);
                    match MlflowVersion::parse(&text) {
                        Some(version) if status.is_success() => {
                            tracing::info!(%version, "MLflow's version learned from its /version");
                            crate::error::classify_like_mlflow(version >= CLASSIFIED_ERRORS);
                            this.set(version);
                            return;
                        }
                        _ => {
                            tracing::debug!(%status, "MLflow's /version gave no version; asking again in 30 s")
                        }
                    }
                }
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_order_as_releases() {
        let v = |s| MlflowVersion::parse(s).unwrap();
        assert_eq!(v("3.17.2"), MlflowVersion::new(3, 17, 2));
        assert_eq!(v(" 2.22.5\n"), MlflowVersion::new(2, 22, 5));
        assert_eq!(v("3.18.0rc0"), MlflowVersion::new(3, 18, 0));
        assert_eq!(v("3.16.1.dev0"), MlflowVersion::new(3, 16, 1));
        assert_eq!(v("4.0"), MlflowVersion::new(4, 0, 0));
        assert!(v("3.9.0") < v("3.10.0"));
        assert!(v("2.22.5") < v("3.5.1"));
        for garbage in ["", "garbage", "3", "<html>", "v3.17.2"] {
            assert_eq!(MlflowVersion::parse(garbage), None, "{garbage:?}");
        }
    }

    #[tokio::test]
    async fn the_version_is_unknown_until_set_and_waiters_wake() {
        let version = UpstreamVersion::default();
        assert_eq!(version.get(), None);
        let waiter = tokio::spawn({
            let version = version.clone();
            async move { version.learned().await }
        });
        version.set(MlflowVersion::new(3, 5, 1));
        assert_eq!(waiter.await.unwrap(), MlflowVersion::new(3, 5, 1));
        assert_eq!(version.get(), Some(MlflowVersion::new(3, 5, 1)));
    }
}
