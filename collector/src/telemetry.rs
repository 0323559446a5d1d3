//! Logging: `tracing` events on stderr, compact text or JSON lines. Logs never carry the
//! `Authorization` header or MLflow credentials.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber. Called once by `main`.
pub fn init_logging(format: LogFormat, filter: &str) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal: in wrapper mode stderr is usually the pod's log.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
        LogFormat::Pretty => builder.compact().init(),
    }
}
