//! Arguments of `mlscope-proxy inject` (the webhook lives in [`crate::shell::inject`]); here so
//! that the command line is declared in one module and the webhook depends on it.

use std::path::PathBuf;

use crate::plumbing::listen::ListenAddr;

/// Arguments of `inject`: a Kubernetes mutating admission webhook that puts mlscope-collector
/// into the pods that ask for it with the annotation `mlscope.io/inject`.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example: mlscope-proxy inject --tls-cert /tls/tls.crt --tls-key /tls/tls.key \
--collector-image registry.example.internal/mlscope/mlscope-collector:0.1.0\n\n\
A pod annotated mlscope.io/inject: \"true\" gets the collector as the wrapper of its first \
container's command (\"wrapper\"), or as a native sidecar when that container has no command \
(\"sidecar\"); mlscope.io/container names another container. deploy/kubernetes/inject/ has the \
manifests; docs/collector.md says more."
)]
pub struct InjectArgs {
    /// Where the webhook listens (HTTPS; the API server calls it through a Service).
    #[arg(
        long,
        env = "MLSCOPE_INJECT_LISTEN",
        value_name = "HOST:PORT",
        default_value = "0.0.0.0:8443"
    )]
    pub listen: ListenAddr,
    /// The serving certificate, PEM (e.g. from cert-manager); read again when the file changes.
    #[arg(long, env = "MLSCOPE_INJECT_TLS_CERT", value_name = "FILE")]
    pub tls_cert: PathBuf,
    /// The certificate's private key, PEM.
    #[arg(long, env = "MLSCOPE_INJECT_TLS_KEY", value_name = "FILE")]
    pub tls_key: PathBuf,
    /// The collector's image, e.g. registry.example.internal/mlscope/mlscope-collector:0.1.0.
    #[arg(long, env = "MLSCOPE_COLLECTOR_IMAGE", value_name = "IMAGE")]
    pub collector_image: String,
    /// An argument for every injected collector (e.g. --collector-arg=--interval
    /// --collector-arg=10); repeat for several.
    #[arg(long = "collector-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub collector_args: Vec<String>,
    /// Check the arguments and exit: 0 when they are accepted (the certificate files are read
    /// only when serving).
    #[arg(long)]
    pub check_config: bool,
}
