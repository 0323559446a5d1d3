//! What the proxy knows of the MLflow behind it: its version, learned from MLflow itself
//! (`GET /version`, asked at start and every 30 s until it answers), never from a flag. The
//! capabilities that must behave as the server behind them does read it here: the coalescer
//! (one batch per run before 3.16), the artifact gateway (the shape of an upload's answer) and
//! the proxy's own error JSON (MLflow's error classification since 3.12).

use std::time::Duration;

use tokio::sync::watch;

use crate::plumbing::mlflow::{MlflowClient, MlflowError, MlflowVersion};
use crate::plumbing::proxy::Forwarder;

/// The first MLflow whose errors carry `sqlstate` and `error_class`.
const CLASSIFIED_ERRORS: MlflowVersion = MlflowVersion::new(3, 12, 0);

/// The version of the MLflow behind the proxy once it has answered; cheap to clone, shared by every part of
/// the proxy that adapts to it.
#[derive(Clone)]
pub struct LearnedVersion(watch::Sender<Option<MlflowVersion>>);

impl Default for LearnedVersion {
    fn default() -> Self {
        Self(watch::Sender::new(None))
    }
}

impl LearnedVersion {
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
        let url = forwarder.upstream().url().to_string();
        let mlflow = MlflowClient::new(forwarder);
        tokio::spawn(async move {
            // Attempts without an answer: the first is said at once (a wrong `--upstream` is
            // otherwise seen only as clients' 502s), then every ten (five minutes).
            let mut unanswered = 0u32;
            loop {
                match mlflow.version().await {
                    Ok(version) => {
                        if unanswered > 0 {
                            tracing::info!(upstream = %url, "MLflow answers now");
                        }
                        tracing::info!(%version, "MLflow's version learned from its /version");
                        crate::plumbing::error::classify_like_mlflow(version >= CLASSIFIED_ERRORS);
                        this.set(version);
                        return;
                    }
                    Err(MlflowError::Unanswered(error)) => {
                        if unanswered % 10 == 0 {
                            tracing::warn!(
                                upstream = %url,
                                %error,
                                "MLflow does not answer at the upstream URL: clients get 502 Bad Gateway until it does; check --upstream (MLSCOPE_UPSTREAM) if it should be up"
                            );
                        }
                        unanswered += 1;
                    }
                    Err(error) => {
                        tracing::debug!(%error, "MLflow's /version gave no version; asking again in 30 s")
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

    #[tokio::test]
    async fn the_version_is_unknown_until_set_and_waiters_wake() {
        let version = LearnedVersion::default();
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
