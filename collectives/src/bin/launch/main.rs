//! `launch`: start the ranks of a program on this node, like `torchrun`: a one-node job
//! (`torchrun --standalone`) or this node's part of a job across nodes.
//!
//! ```text
//! launch -n P [--port PORT] [--timeout SECS] [--grace SECS] [--] PROGRAM [ARGS...]
//! launch --nnodes N --node-rank K --nproc-per-node P --master-addr HOST --master-port PORT
//!        [--token-file PATH] [--timeout SECS] [--grace SECS] [--] PROGRAM [ARGS...]
//! ```
//!
//! The options have torchrun's names and meanings, and torchrun's underscore spellings
//! (`--nproc_per_node`, `--node_rank`, `--master_addr`, `--master_port`) are accepted
//! too; `-n P` is a one-node job of `P` ranks, and `--port` is `--master-port`. A job of
//! `N` nodes is `N` launches, one per node, each given the same `--nnodes`,
//! `--nproc-per-node`, `--master-addr` (node 0's host, as the other nodes reach it),
//! `--master-port` and token, and its own `--node-rank`. torchrun's elastic options
//! (`--nnodes MIN:MAX`, `--rdzv-*`, restarts) are not supported.
//!
//! Local rank `L` (0 to `P - 1`) of node `K` gets these variables, torchrun's, which
//! `collectives::env::EnvInfo::from_env` reads:
//!
//! | variable           | value                                                     |
//! |--------------------|-----------------------------------------------------------|
//! | `RANK`             | `K * P + L`                                               |
//! | `LOCAL_RANK`       | `L`                                                       |
//! | `WORLD_SIZE`       | `N * P`                                                   |
//! | `LOCAL_WORLD_SIZE` | `P`                                                       |
//! | `GROUP_RANK`       | `K` (torchrun's node index)                               |
//! | `GROUP_WORLD_SIZE` | `N`                                                       |
//! | `ROLE_RANK`        | `RANK` (every rank has torchrun's one role, `default`)    |
//! | `ROLE_WORLD_SIZE`  | `WORLD_SIZE`                                              |
//! | `ROLE_NAME`        | `default`                                                 |
//! | `MASTER_ADDR`      | `--master-addr` (one node: 127.0.0.1 by default)          |
//! | `MASTER_PORT`      | `--master-port` (one node: a free port by default)        |
//! | `LOWRANK_STORE_TOKEN` | the job's token, below                                 |
//!
//! torchrun's `TORCHELASTIC_*` variables are not set: there is no elastic agent (and
//! no agent store) behind `launch`. The ranks' output goes straight through; their
//! standard input is empty.
//!
//! # The token
//! Rank 0 serves the rendezvous store, which refuses every client without the job's
//! token, and serves an address other hosts reach only with a token. A job has one,
//! the same on every node: read from `--token-file PATH` (node 0, finding `PATH`
//! missing, creates it with a fresh token, mode 0600, for the other nodes to read over a
//! shared filesystem; they wait for it, up to `--timeout` or 10 minutes); else
//! `LOWRANK_STORE_TOKEN` in launch's environment; else, for a one-node job, a fresh
//! random one. A job of several nodes without `--token-file` or `LOWRANK_STORE_TOKEN`
//! is a usage error that says how to set one.
//!
//! # Guarantees
//! Each launch supervises the ranks of its own node, and these hold on every node:
//! - Exit status 0 when every rank of the node exits successfully.
//! - Each rank runs in a process group of its own, with whatever it starts. When a rank
//!   exits, what is left of its group is killed; nothing of a rank outlives `launch`
//!   (except what leaves the group on purpose, with `setsid`).
//! - When a rank fails (non-zero exit or a signal), the first failure seen is reported on
//!   stderr with its rank and status, the node's other ranks' groups are killed
//!   (SIGKILL), and the status is 1.
//! - After `--timeout SECS` every rank's group is killed and the status is 124 (also
//!   when the wait for a token file takes that long, before any rank started).
//! - SIGTERM or SIGINT sent to `launch` is forwarded to every rank's group; groups still
//!   there after `--grace SECS` (default 10), or at a second signal, are killed; the
//!   status is 128 + the signal's number (143, 130).
//! - On Linux, a rank does not outlive `launch` even when `launch` cannot act (SIGKILL,
//!   the OOM killer): each rank is started with `PR_SET_PDEATHSIG` = SIGKILL, so the
//!   kernel kills it when `launch` dies, and a rank whose `launch` died while it was
//!   being started exits before running the program. What a rank itself started is
//!   not covered by this (it is by the group kill above whenever `launch` can act).
//! - Usage errors (an unknown option, `--node-rank` not below `--nnodes`, no ranks, no
//!   `--master-addr` or `--master-port` for several nodes, more ranks than the store's
//!   `MAX_WORLD_SIZE`, several nodes without a token) are reported with the usage and
//!   status 2; a program that cannot be started, status 127; no free port, a bad token
//!   or token file, status 1.
//!
//! Across nodes: the launches of a job do not talk to each other. A failure on one node
//! (status 1 there) reaches the other nodes' ranks through the store, whose requests
//! then fail (rank 0's store is gone, or reports the job's failure) or time out at the
//! ranks' own store timeout; their launches then exit 1 as well. Nodes that disagree
//! on `WORLD_SIZE`, or two nodes with one `--node-rank`, fail at the store's
//! rendezvous on every rank, by name. Give every node a `--timeout` to bound the job
//! whatever happens.
//!
//! # Example: 2 nodes × 8 ranks
//! Node 0 is `10.0.0.1`; both nodes share the home directory, where node 0 writes the
//! token for node 1 (`--token-file` can name an existing file, from
//! `openssl rand -hex 16 > ~/.job.token`, as well):
//!
//! ```text
//! node0$ launch --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 \
//!            --master-port 29500 --token-file ~/.job.token -- ./train
//! node1$ launch --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr 10.0.0.1 \
//!            --master-port 29500 --token-file ~/.job.token -- ./train
//! ```
//!
//! Node 0 runs ranks 0 to 7 (`GROUP_RANK=0`), node 1 ranks 8 to 15 (`GROUP_RANK=1`),
//! each with `LOCAL_RANK` 0 to 7, `WORLD_SIZE=16` and `LOCAL_WORLD_SIZE=8`; rank 0's
//! store listens on 10.0.0.1:29500.

mod args;
mod signals;
mod token;

use std::io;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitCode, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use collectives::store::TOKEN_ENV;

use args::{parse_args, Options, USAGE};

/// How often running ranks are polled: std offers no wait on any of several children.
const POLL: Duration = Duration::from_millis(10);

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
    /// `launch` caught this signal and forwarded it; these ranks had to be killed.
    Signal { signal: i32, killed: Vec<usize> },
    /// A rank could not be started.
    Spawn { rank: usize, error: String },
    /// No token appeared in the token file within `after` (`--timeout`, when
    /// `timed_out`).
    TokenWait {
        path: String,
        after: Duration,
        timed_out: bool,
    },
    /// `launch` caught this signal before it started any rank (waiting for the token).
    Interrupted { signal: i32 },
    /// The command line asks for a job that cannot run as asked (status 2).
    Usage(String),
    /// Something the launch needs is missing: a free port, a token, signal handlers.
    Setup(String),
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
        Err(failure) => ExitCode::from(report(&failure)),
    }
}

/// Reports `failure` on stderr; the exit status it calls for.
fn report(failure: &Failure) -> u8 {
    match failure {
        Failure::Rank { rank, status } => {
            eprintln!("launch: rank {rank} failed ({status}); killed the other ranks");
            1
        }
        Failure::TimedOut { after, running } => {
            eprintln!("launch: timed out after {after:?}; killed ranks {running:?}");
            124
        }
        Failure::Signal { signal, killed } => {
            let name = signals::name(*signal);
            if killed.is_empty() {
                eprintln!("launch: {name}: forwarded to every rank; all have exited");
            } else {
                eprintln!("launch: {name}: forwarded to every rank; killed ranks {killed:?}");
            }
            u8::try_from(128 + signal).unwrap_or(1)
        }
        Failure::Interrupted { signal } => {
            let name = signals::name(*signal);
            eprintln!("launch: {name} before any rank was started");
            u8::try_from(128 + signal).unwrap_or(1)
        }
        Failure::Spawn { rank, error } => {
            eprintln!("launch: cannot start rank {rank}: {error}");
            127
        }
        Failure::TokenWait {
            path,
            after,
            timed_out,
        } => {
            eprintln!(
                "launch: timed out after {after:?} waiting for the store token in {path}: \
                 node 0's launch writes it there (is it started, with the same --token-file, \
                 on a filesystem this node shares?); no rank was started"
            );
            if *timed_out {
                124
            } else {
                1
            }
        }
        Failure::Usage(message) => {
            eprintln!("launch: {message}\n{USAGE}");
            2
        }
        Failure::Setup(error) => {
            eprintln!("launch: {error}");
            1
        }
    }
}

/// One started rank: the leader of its own process group (its pid is the group's id).
struct Rank {
    rank: usize,
    child: Child,
}

impl Rank {
    /// Sends `signal` to the rank's whole group.
    ///
    /// Called only while the leader is not reaped (its pid, the group's id, cannot be
    /// reused then), so the signal reaches no other process's group.
    fn signal_group(&self, signal: i32) {
        let Ok(group) = libc::pid_t::try_from(self.child.id()) else {
            return;
        };
        // SAFETY: `killpg` takes no pointers; any arguments are memory-safe. An error
        // (ESRCH: the group is empty) needs no handling.
        unsafe { libc::killpg(group, signal) };
    }

    /// The rank's exit status if it has exited, leaving it unreaped; then its group,
    /// still named by the zombie leader, is killed, and the rank reaped.
    fn finish_if_exited(&mut self) -> io::Result<Option<std::process::ExitStatus>> {
        if !exited_unreaped(self.child.id())? {
            return Ok(None);
        }
        // Whatever the rank left running in its group goes with it.
        self.signal_group(libc::SIGKILL);
        self.child.wait().map(Some)
    }
}

/// Whether the child `pid` has exited, without reaping it (`WNOWAIT`).
fn exited_unreaped(pid: u32) -> io::Result<bool> {
    let pid = libc::id_t::from(pid);
    // SAFETY: an all-zero `siginfo_t` is a valid value of the plain C struct.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid, exclusively borrowed `siginfo_t` for the call to fill.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `waitid` succeeded, so `info` holds either zeros (no change) or a
    // child's exit, whose `si_pid` is set.
    Ok(unsafe { info.si_pid() } != 0)
}

/// Starts this node's ranks and waits for them; kills the rest on the first failure,
/// the timeout or a forwarded signal.
fn launch(options: &Options) -> Result<(), Failure> {
    let start = Instant::now();
    signals::catch().map_err(|e| Failure::Setup(format!("cannot catch signals: {e}")))?;
    let token = token::resolve(options, start)?;
    let port = match options.master_port {
        Some(port) => port,
        None => free_port(&options.master_addr)
            .map_err(|e| Failure::Setup(format!("cannot find a free port: {e}")))?,
    };
    let (world_size, nproc) = (options.world_size().to_string(), options.nproc.to_string());
    let (nnodes, node_rank) = (options.nnodes.to_string(), options.node_rank.to_string());
    let mut running: Vec<Rank> = Vec::with_capacity(options.nproc);
    for local in 0..options.nproc {
        let rank = options.rank_of(local);
        let mut command = Command::new(&options.program);
        die_with_launch(&mut command);
        let spawned = command
            .args(&options.args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", &world_size)
            .env("LOCAL_WORLD_SIZE", &nproc)
            .env("GROUP_RANK", &node_rank)
            .env("GROUP_WORLD_SIZE", &nnodes)
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_WORLD_SIZE", &world_size)
            .env("ROLE_NAME", "default")
            .env("MASTER_ADDR", &options.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env(TOKEN_ENV, token.secret())
            // Its own group: killed as one, and out of the terminal's foreground group,
            // so a rank reading the terminal would stop; it reads nothing instead.
            .process_group(0)
            .stdin(Stdio::null())
            .spawn();
        match spawned {
            Ok(child) => running.push(Rank { rank, child }),
            Err(e) => {
                kill_all(&mut running);
                let error = format!("{}: {e}", options.program.to_string_lossy());
                return Err(Failure::Spawn { rank, error });
            }
        }
    }
    loop {
        if let Some(signal) = signals::take() {
            return Err(forward(signal, &mut running, options.grace));
        }
        let mut failed = None;
        let mut index = 0;
        while index < running.len() {
            let status = match running[index].finish_if_exited() {
                Ok(None) => {
                    index += 1;
                    continue;
                }
                Ok(Some(status)) if status.success() => None,
                Ok(Some(status)) => Some(status.to_string()),
                Err(e) => Some(format!("cannot wait for it: {e}")),
            };
            let rank = running.swap_remove(index).rank;
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
                let ranks = kill_all(&mut running);
                return Err(Failure::TimedOut {
                    after: timeout,
                    running: ranks,
                });
            }
        }
        thread::sleep(POLL);
    }
}

/// Makes the child that `command` starts die with `launch` (Linux): the kernel sends it
/// SIGKILL when `launch` dies, however it dies, and a child whose `launch` is gone
/// already when it starts exits at once instead of running the program.
///
/// The death signal is tied to the thread that forks: `launch` starts every rank from
/// its main thread, which lives as long as `launch`.
#[cfg(target_os = "linux")]
fn die_with_launch(command: &mut Command) {
    // Read before the fork: the child compares its parent with it.
    let launcher = std::process::id();
    let hook = move || -> io::Result<()> {
        // SAFETY (of the hook as a whole, which runs in the child between `fork` and
        // `exec`, where only async-signal-safe calls are allowed): it allocates nothing,
        // takes no lock and touches no shared state; it makes three system calls
        // (`prctl`, `getppid`, `_exit`), all async-signal-safe, and builds an
        // `io::Error` from an errno, which holds the code inline without allocating.
        //
        // SAFETY: `prctl(PR_SET_PDEATHSIG, sig)` takes a signal number, no pointers.
        let rc = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // `launch` may have died before the death signal was set: then the child has
        // been handed to another parent already, and no signal will come.
        // SAFETY: `getppid` takes no arguments and cannot fail.
        let parent = unsafe { libc::getppid() };
        if u32::try_from(parent).ok() != Some(launcher) {
            // SAFETY: `_exit` ends the process at once, running no handlers or
            // destructors: safe in a forked child.
            unsafe { libc::_exit(127) };
        }
        Ok(())
    };
    // SAFETY: the hook is async-signal-safe, as its SAFETY comment details.
    unsafe { command.pre_exec(hook) };
}

/// Elsewhere, ranks outlive a `launch` killed with SIGKILL.
#[cfg(not(target_os = "linux"))]
fn die_with_launch(_command: &mut Command) {}

/// Forwards `signal` to every rank's group, waits up to `grace` (or a second signal) for
/// the ranks to exit, and kills the groups of those that did not.
fn forward(signal: i32, running: &mut Vec<Rank>, grace: Duration) -> Failure {
    for rank in running.iter() {
        rank.signal_group(signal);
    }
    let deadline = Instant::now().checked_add(grace);
    while !running.is_empty() && deadline.is_none_or(|d| Instant::now() < d) {
        if signals::take().is_some() {
            break;
        }
        // A rank that cannot be waited for is left to `kill_all`.
        running.retain_mut(|rank| !matches!(rank.finish_if_exited(), Ok(Some(_))));
        thread::sleep(POLL);
    }
    Failure::Signal {
        signal,
        killed: kill_all(running),
    }
}

/// A port of `host` (a one-node job's MASTER_ADDR) that was free a moment ago; rank 0
/// binds it soon after.
fn free_port(host: &str) -> io::Result<u16> {
    Ok(TcpListener::bind((host, 0))?.local_addr()?.port())
}

/// Kills (SIGKILL) the group of every rank still running, then reaps the ranks; returns
/// their numbers, sorted.
fn kill_all(running: &mut Vec<Rank>) -> Vec<usize> {
    // Every group is signalled before any leader is reaped, so each group id still
    // names its group.
    for rank in running.iter() {
        rank.signal_group(libc::SIGKILL);
    }
    let mut ranks: Vec<usize> = running
        .drain(..)
        .map(|mut rank| {
            let _ = rank.child.wait();
            rank.rank
        })
        .collect();
    ranks.sort_unstable();
    ranks
}
