//! Starts a program on every rank of an MLX job (see
//! `mlx_support::distributed::Launch`).
//!
//! ```text
//! mlx-launch [--hosts HOST[,HOST…]] [-n RANKS_PER_HOST] [--timeout SECONDS]
//!            [--starting-port PORT] -- PROGRAM ARGS…
//! ```
//!
//! The hosts default to 127.0.0.1; hosts other than 127.0.0.1 / localhost
//! are reached over `ssh` (same working directory, same program path). The
//! hostfile is MLX's format, so programs written for Python's `mlx.launch`
//! run under it, and ours run under `mlx.launch`. Output comes back with a
//! `[rank N]` prefix; when one rank fails, every other one is ended and the
//! launcher exits with status 1. SIGTERM or SIGINT to the launcher is
//! passed on to every rank; ranks still running 5 s later are killed, and
//! the launcher exits with 128 + the signal's number (143, 130), as a shell
//! reports a process the signal ended.

use std::process::ExitCode;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use mlx_support::distributed::{Launch, LaunchError};

const USAGE: &str = "usage: mlx-launch [--hosts HOST[,HOST…]] [-n RANKS_PER_HOST] \
                     [--timeout SECONDS] [--starting-port PORT] -- PROGRAM ARGS…";

/// How the launch ended, beside success.
enum Failure {
    /// Bad options, or a launcher that cannot start.
    Usage(String),
    Job(LaunchError),
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(message)) => {
            eprintln!("mlx-launch: {message}");
            ExitCode::FAILURE
        }
        Err(Failure::Job(LaunchError::Stopped { signal, .. })) => {
            eprintln!("mlx-launch: stopped by signal {signal}; every rank was ended");
            ExitCode::from(u8::try_from(128 + signal).unwrap_or(1))
        }
        Err(Failure::Job(LaunchError::RankFailed { rank, status, .. })) => {
            eprintln!("mlx-launch: rank {rank} failed ({status}); every other rank was ended");
            ExitCode::FAILURE
        }
        Err(Failure::Job(e)) => {
            eprintln!("mlx-launch: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Failure> {
    let launch = parse().map_err(Failure::Usage)?;
    // Registered before the first rank starts, so that no signal finds a
    // rank the launcher does not yet know of.
    let signal = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register_usize(sig, Arc::clone(&signal), sig as usize)
            .map_err(|e| Failure::Usage(format!("cannot handle signal {sig}: {e}")))?;
    }
    launch
        .stop_when(signal)
        .run()
        .map(drop)
        .map_err(Failure::Job)
}

fn parse() -> Result<Launch, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let split = args.iter().position(|a| a == "--").ok_or(USAGE)?;
    let (options, command) = (&args[..split], &args[split + 1..]);
    let program = command.first().ok_or(USAGE)?;
    let mut hosts = "127.0.0.1".to_owned();
    let mut n = 1usize;
    let mut timeout = None;
    let mut port = None;
    let mut it = options.iter();
    while let Some(option) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{option} needs a value\n{USAGE}"))
        };
        match option.as_str() {
            "--hosts" => hosts = value()?,
            "-n" => {
                n = value()?
                    .parse()
                    .map_err(|_| format!("-n takes a number\n{USAGE}"))?
            }
            "--timeout" => {
                let s: f64 = value()?
                    .parse()
                    .map_err(|_| "--timeout takes seconds".to_owned())?;
                timeout = Some(Duration::from_secs_f64(s));
            }
            "--starting-port" => {
                port = Some(
                    value()?
                        .parse()
                        .map_err(|_| "--starting-port takes a port".to_owned())?,
                );
            }
            other => return Err(format!("unknown option {other}\n{USAGE}")),
        }
    }
    let hosts: Vec<&str> = hosts.split(',').filter(|h| !h.is_empty()).collect();
    let mut launch = Launch::new(&hosts, n, program).args(&command[1..]);
    if let Some(t) = timeout {
        launch = launch.timeout(t);
    }
    if let Some(p) = port {
        launch = launch.starting_port(p);
    }
    Ok(launch)
}
