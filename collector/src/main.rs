use std::process::ExitCode;

use mlscope_collector::config::{Config, ConfigError};

/// EX_USAGE from sysexits.h: the configuration was refused.
const EXIT_CONFIG: u8 = 64;

fn main() -> ExitCode {
    // Before any thread exists, so that no thread ever takes these signals the default way.
    let signals = match mlscope_collector::signals::block() {
        Ok(mask) => mask,
        Err(error) => {
            eprintln!("mlscope-collector: cannot block signals: {error}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let config = match Config::from_env_and_args() {
        Ok(config) => config,
        Err(ConfigError::Cli(e)) if !e.use_stderr() => {
            // --help / --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(ConfigError::Cli(e)) => {
            // clap's rendering: the error, its tips ("a similar argument exists: '--interval'"),
            // then usage, which is left to --help.
            let text = e.to_string();
            let mut lines = text.lines();
            let line = lines
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ");
            eprintln!("mlscope-collector: invalid configuration: {line} (see --help)");
            for tip in lines.filter(|l| l.trim_start().starts_with("tip:")) {
                eprintln!("{tip}");
            }
            return ExitCode::from(EXIT_CONFIG);
        }
        Err(e) => {
            eprintln!("mlscope-collector: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if let Some(dir) = &config.install_to {
        return match mlscope_collector::install(dir) {
            Ok(path) => {
                println!("mlscope-collector: installed {}", path.display());
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!(
                    "mlscope-collector: cannot install into {}: {error}",
                    dir.display()
                );
                ExitCode::FAILURE
            }
        };
    }
    if config.check_only {
        let data = match config.data.paths.len() {
            0 => String::new(),
            n => format!(
                ", {n} data path{}, pre-flight {}",
                if n == 1 { "" } else { "s" },
                match config.data.preflight {
                    mlscope_collector::data::PreflightMode::Warn => "warn",
                    mlscope_collector::data::PreflightMode::Enforce => "enforce",
                }
            ),
        };
        println!(
            "mlscope-collector: configuration ok (node {}, rank {}, pod {}, {}{data}{})",
            config.node,
            config.rank,
            config.pod,
            if config.command.is_empty() {
                "sidecar mode"
            } else {
                "wrapper mode"
            },
            match &config.unmeasured_because {
                None => String::new(),
                Some(why) => format!("; {why}: the command would run unmeasured"),
            }
        );
        return ExitCode::SUCCESS;
    }
    mlscope_collector::telemetry::init_logging(config.log_format, &config.log_level);
    ExitCode::from(mlscope_collector::run(config, signals))
}
