//! `mlscope-proxy inject`: a Kubernetes mutating admission webhook that puts mlscope-collector
//! into training pods, so that no pod template has to be edited by hand. What it does to a pod is
//! [`patch`]; this module serves it over HTTPS (the API server calls webhooks only over TLS) with a
//! certificate it reads again when its files change (cert-manager renews them in place).
//!
//! - `POST /mutate`: an `AdmissionReview` (admission.k8s.io/v1) in, the same kind out. A pod is
//!   always allowed: the webhook only adds, and a pod it cannot inject gets a warning that
//!   `kubectl` shows, never a refusal. Its manifest sets `failurePolicy: Ignore`, so a webhook
//!   that is down never keeps a training job from starting either.
//! - `GET /healthz`: for the Deployment's probes.

pub mod patch;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::Value;

pub use crate::shell::config::InjectArgs;
use patch::InjectConfig;

/// How often the certificate files are looked at for a renewal.
const RELOAD_EVERY: Duration = Duration::from_secs(30);
/// Longest a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest AdmissionReview read (a pod spec is a few KiB; the API server's own limit is 3 MiB).
const MAX_REVIEW_BYTES: usize = 4 << 20;

/// The serving certificate, and when its files last changed.
struct Certificate {
    config: Arc<rustls::ServerConfig>,
    modified: (Option<SystemTime>, Option<SystemTime>),
}

/// Serves the webhook on `args.listen` until `shutdown` resolves.
pub async fn run(args: &InjectArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let certificate = Arc::new(RwLock::new(load(&args.tls_cert, &args.tls_key)?));
    let listener = args
        .listen
        .bind()
        .await
        .with_context(|| format!("binding --listen {}", args.listen))?;
    let config = Arc::new(InjectConfig {
        image: args.collector_image.clone(),
        collector_args: args.collector_args.clone(),
    });
    let router = Router::new()
        .route("/mutate", post(mutate))
        .route("/healthz", get(|| async { "ok\n" }))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(config);
    tracing::info!(
        listen = %listener.local_addr()?,
        image = %args.collector_image,
        "mlscope-proxy inject: the webhook is serving"
    );
    let reload = tokio::spawn(reload(
        certificate.clone(),
        args.tls_cert.clone(),
        args.tls_key.clone(),
    ));
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accepting a connection failed");
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(
            certificate.read().expect("certificate lock").config.clone(),
        );
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            if let Err(error) = builder.serve_connection(TokioIo::new(tls), service).await {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
        });
    }
    reload.abort();
    tracing::info!("mlscope-proxy inject: stopped");
    Ok(())
}

/// Reads the certificate chain and key, and builds the TLS configuration (HTTP/2 and HTTP/1.1).
fn load(cert: &Path, key: &Path) -> anyhow::Result<Certificate> {
    let modified = (modified(cert), modified(key));
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading the certificate {}", cert.display()))?;
    anyhow::ensure!(
        !chain.is_empty(),
        "{} holds no PEM certificate",
        cert.display()
    );
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("reading the private key {}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("the certificate and the key do not go together")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Certificate {
        config: Arc::new(config),
        modified,
    })
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Reads the certificate again whenever one of its files changed; a renewal half written (or
/// broken) keeps the certificate in use and is tried again.
async fn reload(certificate: Arc<RwLock<Certificate>>, cert: PathBuf, key: PathBuf) {
    loop {
        tokio::time::sleep(RELOAD_EVERY).await;
        let now = (modified(&cert), modified(&key));
        if certificate.read().expect("certificate lock").modified == now {
            continue;
        }
        match load(&cert, &key) {
            Ok(renewed) => {
                *certificate.write().expect("certificate lock") = renewed;
                tracing::info!(cert = %cert.display(), "serving certificate read again");
            }
            Err(error) => {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "the renewed certificate could not be read; the previous one is kept"
                )
            }
        }
    }
}

async fn mutate(State(config): State<Arc<InjectConfig>>, Json(review): Json<Value>) -> Response {
    let request = &review["request"];
    let namespace = request["namespace"].as_str().unwrap_or_default();
    let name = request["object"]["metadata"]["name"]
        .as_str()
        .or(request["object"]["metadata"]["generateName"].as_str())
        .unwrap_or_default();
    match patch::review(&review, &config) {
        Ok((answer, mode)) => {
            let warnings = &answer["response"]["warnings"];
            match (mode, warnings.as_array().and_then(|w| w.first())) {
                (Some(mode), _) => {
                    tracing::info!(%namespace, pod = %name, mode = mode.label(), "collector injected")
                }
                (None, Some(warning)) => {
                    tracing::info!(%namespace, pod = %name, %warning, "pod left without the collector")
                }
                (None, None) => {}
            }
            Json(answer).into_response()
        }
        Err(message) => crate::plumbing::error::Error::InvalidParameter(message).into_response(),
    }
}
