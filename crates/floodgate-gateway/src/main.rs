//! The `floodgate` binary: `floodgate serve --config FILE`, `floodgate check-config FILE` and,
//! with the `rls` feature, `floodgate rls --config PATH` (Envoy's rate limit service).

use std::io;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use floodgate_gateway::config::Config;
use floodgate_gateway::logs::writer::Buffered;
use tracing_subscriber::EnvFilter;

/// mimalloc instead of the system allocator: a proxied request makes some 30 small, short-lived
/// allocations (hyper's messages and channels, header values, the decision). Under load (callgrind,
/// memory store) glibc's malloc and free took 12% of the gateway's user-space instructions;
/// with mimalloc a request costs 6% fewer instructions in all.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// floodgate: an OpenAI-compatible gateway that rate-limits every scope of a caller's chain.
#[derive(Parser)]
#[command(name = "floodgate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// The TOML config file.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a config and print what it resolves to (keys, chains, limits; never secrets).
    CheckConfig {
        /// The TOML config file.
        file: PathBuf,
    },
    /// Serve Envoy's rate limit service (gRPC) from envoyproxy/ratelimit's YAML.
    #[cfg(feature = "rls")]
    Rls(RlsArgs),
}

/// `floodgate rls`: docs/envoy.md.
#[cfg(feature = "rls")]
#[derive(clap::Args)]
struct RlsArgs {
    /// A YAML file, or a directory of them (every *.yaml and *.yml, one domain each).
    #[arg(long, short)]
    config: PathBuf,
    /// The gRPC listener.
    #[arg(long, default_value = floodgate_gateway::rls::DEFAULT_LISTEN)]
    listen: std::net::SocketAddr,
    /// Decide on Redis (else in memory); FLOODGATE_REDIS_URL when not given.
    #[arg(long)]
    redis_url: Option<String>,
    /// The Redis keys' prefix.
    #[arg(long)]
    redis_prefix: Option<String>,
    /// With the store unreachable: `open` answers OK unchecked; `closed` answers UNAVAILABLE,
    /// so that Envoy's failure_mode_deny decides.
    #[arg(long, default_value = "open", value_parser = ["open", "closed"])]
    on_store_error: String,
    /// Serve GET /metrics (Prometheus) on this address; no admin listener without it.
    #[arg(long)]
    admin_listen: Option<std::net::SocketAddr>,
    /// Global shadow mode: decide as usual, answer every OVER_LIMIT with OK (counted as
    /// shadow_over_limit); SHADOW_MODE=true (envoyproxy/ratelimit's setting) when not given.
    #[arg(long)]
    shadow: bool,
    /// Validate the config, print its domains and exit.
    #[arg(long)]
    check: bool,
}

/// envoyproxy/ratelimit's `SHADOW_MODE`, read as it reads it (Go's `strconv.ParseBool`); unset
/// or empty is off.
#[cfg(feature = "rls")]
fn shadow_mode_env() -> Result<bool, String> {
    let Ok(value) = std::env::var("SHADOW_MODE") else {
        return Ok(false);
    };
    match value.trim() {
        "" | "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        other => Err(format!(
            "SHADOW_MODE: '{other}' is not a boolean (true or false)"
        )),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => check_config(&file),
        Command::Serve { config } => serve(&config),
        #[cfg(feature = "rls")]
        Command::Rls(args) => rls(args),
    }
}

#[cfg(feature = "rls")]
fn rls(args: RlsArgs) -> ExitCode {
    use floodgate::store::redis::OnError as RedisOnError;
    use floodgate_gateway::rls::{RlsConfig, RlsOptions};
    if args.check {
        return match RlsConfig::load(&args.config) {
            Ok(c) => {
                println!("{}: OK", args.config.display());
                for d in c.domains() {
                    println!("domain: {d}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let shadow = match shadow_mode_env() {
        Ok(env) => args.shadow || env,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let logs = init_logs();
    let redis_url = args.redis_url.or_else(|| {
        std::env::var("FLOODGATE_REDIS_URL")
            .ok()
            .filter(|u| !u.trim().is_empty())
    });
    let options = RlsOptions {
        config: args.config,
        listen: args.listen,
        redis_url,
        redis_prefix: args.redis_prefix,
        on_error: if args.on_store_error == "closed" {
            RedisOnError::Closed
        } else {
            RedisOnError::Open
        },
        admin_listen: args.admin_listen,
        shadow,
    };
    let served = floodgate_gateway::rls::serve(&options);
    drop(logs);
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Printed, not logged: a start that fails says why whatever `RUST_LOG` lets through.
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Sets up the log: `RUST_LOG`'s level (default `info`) to stderr, through a writer thread
/// (`logs::writer`). The guard writes what is buffered when dropped: hold it until the end,
/// and drop it before printing anything to stderr after the log, to keep the order.
fn init_logs() -> Option<Buffered> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let format = floodgate_gateway::logs::Lines::default();
    match Buffered::start_for_process(floodgate_gateway::logs::writer::stderr()) {
        Ok((guard, lines)) => {
            tracing_subscriber::fmt()
                .with_writer(lines)
                .with_ansi(ansi)
                .event_format(format)
                .with_env_filter(filter)
                .init();
            // A panic's message, printed straight to stderr, comes after the lines before it.
            let report = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                floodgate_gateway::logs::writer::flush();
                report(info);
            }));
            Some(guard)
        }
        // No thread to spare: each line written by the thread that logs it.
        Err(e) => {
            tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_ansi(ansi)
                .event_format(format)
                .with_env_filter(filter)
                .init();
            tracing::warn!(error = %e, "no log writer thread: lines are written as they come");
            None
        }
    }
}

fn check_config(file: &PathBuf) -> ExitCode {
    let config = match Config::load(file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match floodgate_gateway::report::write(&mut std::io::stdout().lock(), file, &config) {
        Ok(()) => ExitCode::SUCCESS,
        // A reader that stopped early (`check-config FILE | head`) is not an error.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: writing the report: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(path: &PathBuf) -> ExitCode {
    let logs = init_logs();
    let config = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            drop(logs);
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let served = floodgate_gateway::server::serve(&config);
    drop(logs);
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Printed, not logged, as a config error is: a start that fails says why whatever
            // `RUST_LOG` lets through (`floodgate_gateway=warn` filters the binary's own target).
            eprintln!("error: {}: {e}", path.display());
            ExitCode::FAILURE
        }
    }
}
