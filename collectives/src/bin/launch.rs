//! `launch`: start N local ranks of a program, like `torchrun --standalone`.
//!
//! ```text
//! launch -n N [--port P] [--timeout SECS] [--] PROGRAM [ARGS...]
//! ```
//!
//! Each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR=127.0.0.1` and `MASTER_PORT` (the given port, or a free one), which
//! `collectives::env::EnvInfo::from_env` reads. The ranks' output goes straight through.
//!
//! # Guarantees
//! - Exit status 0 when every rank exits successfully.
//! - When a rank fails (non-zero exit or a signal), the first failure seen is reported on
//!   stderr with its rank and status, the other ranks are killed, and the status is 1.
//! - After `--timeout SECS` every rank still running is killed and the status is 124.
//! - Usage errors are reported with the usage and status 2; a program that cannot be
//!   started, status 127; no free port, status 1.
//! - Killing is SIGKILL (std has no other signal); ranks get no chance to clean up.

use std::ffi::OsString;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, ExitCode};
use std::thread;
use std::time::{Duration, Instant};

const USAGE: &str = "\
usage: launch -n N [--port P] [--timeout SECS] [--] PROGRAM [ARGS...]

Starts N local processes of PROGRAM with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1 and MASTER_PORT set, and waits for them.

options:
  -n, --nproc N      number of ranks (at least 1)
      --port P       MASTER_PORT (default, or 0: a free port)
      --timeout SECS kill every rank after SECS seconds (default: no limit)
  -h, --help         print this help";

/// How often running ranks are polled: std offers no wait on any of several children.
const POLL: Duration = Duration::from_millis(10);

/// What to launch.
#[derive(Debug)]
struct Options {
    nproc: usize,
    port: Option<u16>,
    timeout: Option<Duration>,
    program: OsString,
    args: Vec<OsString>,
}

/// How a launch ended, when not with every rank succeeding.
#[derive(Debug)]
enum Failure {
    /// A rank exited unsuccessfully (its status, printed); the others were killed.
    Rank { rank: usize, status: String },
    /// The timeout passed; these ranks were still running and were killed.
    TimedOut {
        after: Duration,
        running: Vec<usize>,
    },
    /// A rank could not be started.
    Spawn { rank: usize, error: String },
    /// No free port could be found.
    Port(String),
}

fn main() -> ExitCode {
    let options = match parse_args(std::env::args_os().skip(1)) {
        Ok(Some(options)) => options,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("launch: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match launch(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            let code = match &failure {
                Failure::Rank { rank, status } => {
                    eprintln!("launch: rank {rank} failed ({status}); killed the other ranks");
                    1
                }
                Failure::TimedOut { after, running } => {
                    eprintln!("launch: timed out after {after:?}; killed ranks {running:?}");
                    124
                }
                Failure::Spawn { rank, error } => {
                    eprintln!("launch: cannot start rank {rank}: {error}");
                    127
                }
                Failure::Port(error) => {
                    eprintln!("launch: cannot find a free port: {error}");
                    1
                }
            };
            ExitCode::from(code)
        }
    }
}

/// The options, `Ok(None)` for `--help`, or a usage error.
fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Option<Options>, String> {
    let mut args = args.into_iter();
    let (mut nproc, mut port, mut timeout) = (None, None, None);
    let program = loop {
        let Some(arg) = args.next() else {
            return Err("no program to launch".into());
        };
        let Some(text) = arg.to_str() else {
            break arg;
        };
        // `--name=value` is accepted for the long options.
        let (name, inline) = match text.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value.to_owned())),
            _ => (text, None),
        };
        let mut value = |what: &str| -> Result<String, String> {
            match inline.clone() {
                Some(value) => Ok(value),
                None => args
                    .next()
                    .and_then(|v| v.into_string().ok())
                    .ok_or_else(|| format!("{name} needs {what}")),
            }
        };
        match name {
            "--" => break args.next().ok_or("no program after --")?,
            "-h" | "--help" => return Ok(None),
            "-n" | "--nproc" => {
                let v = value("a number of ranks")?;
                match v.parse::<usize>() {
                    Ok(n) if n >= 1 => nproc = Some(n),
                    _ => return Err(format!("{name} {v:?}: not a number of ranks (1 or more)")),
                }
            }
            "--port" => {
                let v = value("a port")?;
                port = Some(
                    v.parse::<u16>()
                        .map_err(|_| format!("--port {v:?}: not a port"))?,
                );
            }
            "--timeout" => {
                let v = value("a number of seconds")?;
                match v.parse::<f64>().ok().map(Duration::try_from_secs_f64) {
                    Some(Ok(t)) if !t.is_zero() => timeout = Some(t),
                    _ => return Err(format!("--timeout {v:?}: not a positive number of seconds")),
                }
            }
            _ if name.starts_with('-') => return Err(format!("unknown option {name}")),
            _ => break arg,
        }
    };
    let nproc = nproc.ok_or("-n N is required")?;
    Ok(Some(Options {
        nproc,
        port: port.filter(|&p| p != 0),
        timeout,
        program,
        args: args.collect(),
    }))
}

/// Starts the ranks and waits for them; kills the rest on the first failure or timeout.
fn launch(options: &Options) -> Result<(), Failure> {
    let port = match options.port {
        Some(port) => port,
        None => free_port().map_err(|e| Failure::Port(e.to_string()))?,
    };
    let start = Instant::now();
    let mut running: Vec<(usize, Child)> = Vec::with_capacity(options.nproc);
    for rank in 0..options.nproc {
        let spawned = Command::new(&options.program)
            .args(&options.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", options.nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", options.nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match spawned {
            Ok(child) => running.push((rank, child)),
            Err(e) => {
                kill_all(&mut running);
                let error = format!("{}: {e}", options.program.to_string_lossy());
                return Err(Failure::Spawn { rank, error });
            }
        }
    }
    loop {
        let mut failed = None;
        let mut index = 0;
        while index < running.len() {
            let (rank, child) = &mut running[index];
            let rank = *rank;
            let status = match child.try_wait() {
                Ok(None) => {
                    index += 1;
                    continue;
                }
                Ok(Some(status)) if status.success() => None,
                Ok(Some(status)) => Some(status.to_string()),
                Err(e) => Some(format!("cannot wait for it: {e}")),
            };
            running.swap_remove(index);
            // Of the failures seen in one poll, the lowest rank is reported.
            if let Some(status) = status {
                if failed.as_ref().is_none_or(|(r, _)| rank < *r) {
                    failed = Some((rank, status));
                }
            }
        }
        if let Some((rank, status)) = failed {
            kill_all(&mut running);
            return Err(Failure::Rank { rank, status });
        }
        if running.is_empty() {
            return Ok(());
        }
        if let Some(timeout) = options.timeout {
            if start.elapsed() >= timeout {
                let mut ranks: Vec<usize> = running.iter().map(|(rank, _)| *rank).collect();
                ranks.sort_unstable();
                kill_all(&mut running);
                return Err(Failure::TimedOut {
                    after: timeout,
                    running: ranks,
                });
            }
        }
        thread::sleep(POLL);
    }
}

/// A port that was free a moment ago; rank 0 binds it soon after.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// Kills (SIGKILL) and reaps every child still running.
fn kill_all(running: &mut Vec<(usize, Child)>) {
    for (_, child) in running.iter_mut() {
        // An error means it has exited already; `wait` reaps it either way.
        let _ = child.kill();
    }
    for (_, mut child) in running.drain(..) {
        let _ = child.wait();
    }
}
