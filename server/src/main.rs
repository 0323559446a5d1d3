use std::process::ExitCode;

use mlscope_proxy::shell::config::{Config, ConfigError, Invocation};
use tokio::signal::unix::{signal, SignalKind};

/// EX_USAGE from sysexits.h: the configuration was refused.
const EXIT_CONFIG: u8 = 64;

fn main() -> ExitCode {
    let invocation = match Config::invocation(std::env::args_os()) {
        Ok(invocation) => invocation,
        Err(ConfigError::Cli(e)) if !e.use_stderr() => {
            // --help / --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(ConfigError::Cli(e)) => {
            // clap's rendering: the error, its tips ("a similar argument exists: '--listen'"),
            // then usage; the usage is left to --help.
            let rendered = e.to_string();
            let mut lines = rendered.lines();
            let line = lines
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ");
            // The valid values of an enumerated flag go on the same line.
            let mut possible = String::new();
            let mut tips = Vec::new();
            for l in lines {
                let l = l.trim_start();
                if l.starts_with("[possible values:") {
                    possible = format!(" {l}");
                } else if l.starts_with("tip:") {
                    tips.push(l);
                }
            }
            eprintln!("mlscope-proxy: invalid configuration: {line}{possible} (see --help)");
            for tip in tips {
                eprintln!("  {tip}");
            }
            return ExitCode::from(EXIT_CONFIG);
        }
        Err(e) => {
            eprintln!("mlscope-proxy: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let config = match invocation {
        Invocation::Serve(config) => config,
        Invocation::Check(config) => {
            println!(
                "mlscope-proxy: configuration ok (listen {}, admin {}, upstream {}, state store {})",
                config.serve.listen,
                config.serve.admin_listen,
                config.forwarder.upstream.url(),
                config.store.database_url.split(':').next().unwrap_or_default()
            );
            return ExitCode::SUCCESS;
        }
        Invocation::Inject(args) if args.check_config => {
            println!(
                "mlscope-proxy inject: configuration ok (listen {}, collector image {})",
                args.listen, args.collector_image
            );
            return ExitCode::SUCCESS;
        }
        Invocation::Inject(args) => {
            let _log = mlscope_proxy::plumbing::telemetry::init_logging(
                mlscope_proxy::plumbing::telemetry::LogFormat::Json,
                "info",
                std::time::Duration::ZERO,
            );
            return match runtime
                .block_on(mlscope_proxy::shell::inject::run(&args, shutdown_signal()))
            {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("mlscope-proxy inject: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
        Invocation::Relocate(config, args) => {
            let _log = mlscope_proxy::plumbing::telemetry::init_logging(
                config.log.format,
                "warn",
                std::time::Duration::ZERO,
            );
            return match runtime.block_on(mlscope_proxy::shell::relocate::run(&config, &args)) {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("mlscope-proxy relocate: {e:#}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    let _log = mlscope_proxy::plumbing::telemetry::init_logging(
        config.log.format,
        &config.log.level,
        config.log.flush_interval,
    );
    match runtime.block_on(serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "mlscope-proxy stopped");
            ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> anyhow::Result<()> {
    use anyhow::Context;
    let listener = config
        .serve
        .listen
        .bind()
        .await
        .with_context(|| format!("binding --listen {}", config.serve.listen))?;
    let admin = config
        .serve
        .admin_listen
        .bind()
        .await
        .with_context(|| format!("binding --admin-listen {}", config.serve.admin_listen))?;
    mlscope_proxy::shell::app::run(config, listener, admin, shutdown_signal()).await
}

/// Resolves on the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
