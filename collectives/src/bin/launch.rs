//! `launch`: start N local ranks of a program, like `torchrun --standalone`.
//!
//! ```text
//! launch -n N [--port P] [--timeout SECS] [--grace SECS] [--] PROGRAM [ARGS...]
//! ```
//!
//! Each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR=127.0.0.1`, `MASTER_PORT` (the given port, or a free one) and
//! `LOWRANK_STORE_TOKEN` (the one in launch's environment, or a fresh random one), which
//! `collectives::env::EnvInfo::from_env` reads. The ranks' output goes straight through;
//! their standard input is empty.
//!
//! # Guarantees
//! - Exit status 0 when every rank exits successfully.
//! - Each rank runs in a process group of its own, with whatever it starts. When a rank
//!   exits, what is left of its group is killed; nothing of a rank outlives `launch`
//!   (except what leaves the group on purpose, with `setsid`).
//! - When a rank fails (non-zero exit or a signal), the first failure seen is reported on
//!   stderr with its rank and status, the other ranks' groups are killed (SIGKILL), and
//!   the status is 1.
//! - After `--timeout SECS` every rank's group is killed and the status is 124.
//! - SIGTERM or SIGINT sent to `launch` is forwarded to every rank's group; groups still
//!   there after `--grace SECS` (default 10), or at a second signal, are killed; the
//!   status is 128 + the signal's number (143, 130).
//! - On Linux, a rank does not outlive `launch` even when `launch` cannot act (SIGKILL,
//!   the OOM killer): each rank is started with `PR_SET_PDEATHSIG` = SIGKILL, so the
//!   kernel kills it when `launch` dies, and a rank whose `launch` died while it was
//!   being started exits before running the program. What a rank itself started is
//!   not covered by this (it is by the group kill above whenever `launch` can act).
//! - Usage errors are reported with the usage and status 2; a program that cannot be
//!   started, status 127; no free port or no token, status 1.

use std::ffi::OsString;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitCode, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use collectives::store::{StoreToken, TOKEN_ENV};

mod signals {
    //! The signals `launch` forwards, caught into a flag that the supervising loop polls.

    use std::io;
    use std::sync::atomic::{AtomicI32, Ordering};

    /// The last signal caught and not yet taken, or 0.
    static CAUGHT: AtomicI32 = AtomicI32::new(0);

    /// Only stores into a lock-free atomic: async-signal-safe.
    extern "C" fn on_signal(signal: libc::c_int) {
        CAUGHT.store(signal, Ordering::SeqCst);
    }

    /// Catches SIGTERM and SIGINT from now on.
    pub(crate) fn catch() -> io::Result<()> {
        for signal in [libc::SIGTERM, libc::SIGINT] {
            // SAFETY: an all-zero `sigaction` is a valid value of the plain C struct
            // (no handler, empty flags); the fields that matter are set below.
            let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            // SAFETY: `action.sa_mask` is a valid, exclusively borrowed `sigset_t`.
            unsafe { libc::sigemptyset(&mut action.sa_mask) };
            // SAFETY: `action` is initialised and outlives the call; the old action is
            // not asked for (null). The handler only stores into an atomic, which is
            // async-signal-safe, and runs on whatever thread takes the signal.
            if unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// The signal caught since the last call, if any.
    pub(crate) fn take() -> Option<i32> {
        match CAUGHT.swap(0, Ordering::SeqCst) {
            0 => None,
            signal => Some(signal),
        }
    }

    /// The signal's name, for messages.
    pub(crate) fn name(signal: i32) -> String {
        match signal {
            libc::SIGTERM => "SIGTERM".into(),
            libc::SIGINT => "SIGINT".into(),
            libc::SIGKILL => "SIGKILL".into(),
            other => format!("signal {other}"),
        }
    }
}

const USAGE: &str = "\
usage: launch -n N [--port P] [--timeout SECS] [--grace SECS] [--] PROGRAM [ARGS...]

Starts N local processes of PROGRAM with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT and LOWRANK_STORE_TOKEN set, and waits for them.

options:
  -n, --nproc N      number of ranks (at least 1)
      --port P       MASTER_PORT (default, or 0: a free port)
      --timeout SECS kill every rank after SECS seconds (default: no limit)
      --grace SECS   after forwarding SIGTERM or SIGINT, wait SECS for the ranks to
                     exit before killing them (default 10)
  -h, --help         print this help

token:
  Rank 0 serves the rendezvous store; it refuses every client that does not present
  the token in LOWRANK_STORE_TOKEN, before reading any key. launch passes each rank
  the LOWRANK_STORE_TOKEN of its own environment if set (16 to 1024 printable ASCII
  characters, no spaces), and otherwise a fresh random one (128 bits) for this job
  alone. For a job across hosts, started otherwise, set the same LOWRANK_STORE_TOKEN
  on every rank (e.g. from `openssl rand -hex 16`) and a MASTER_ADDR the other hosts
  reach; rank 0's store binds only that address. The token travels in the clear: it
  keeps out other users of the hosts and network, not someone who reads the traffic.

processes and signals:
  Each rank runs in its own process group, with what it starts; what is left of a
  group when its rank exits is killed. On a failed rank or the timeout, every group
  is killed. SIGTERM and SIGINT are forwarded to every group, which is killed after
  --grace SECS or a second signal; launch then exits with 128 + the signal number.";

/// How often running ranks are polled: std offers no wait on any of several children.
const POLL: Duration = Duration::from_millis(10);

/// What to launch.
#[derive(Debug)]
struct Options {
    nproc: usize,
    port: Option<u16>,
    timeout: Option<Duration>,
    grace: Duration,
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
    /// `launch` caught this signal and forwarded it; these ranks had to be killed.
    Signal { signal: i32, killed: Vec<usize> },
    /// A rank could not be started.
    Spawn { rank: usize, error: String },
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
                Failure::Signal { signal, killed } => {
                    let name = signals::name(*signal);
                    if killed.is_empty() {
                        eprintln!("launch: {name}: forwarded to every rank; all have exited");
                    } else {
                        eprintln!(
                            "launch: {name}: forwarded to every rank; killed ranks {killed:?}"
                        );
                    }
                    u8::try_from(128 + signal).unwrap_or(1)
                }
                Failure::Spawn { rank, error } => {
                    eprintln!("launch: cannot start rank {rank}: {error}");
                    127
                }
                Failure::Setup(error) => {
                    eprintln!("launch: {error}");
                    1
                }
            };
            ExitCode::from(code)
        }
    }
}

/// Parses `SECS` of `--name SECS`: a positive number of seconds.
fn seconds(name: &str, v: &str) -> Result<Duration, String> {
    match v.parse::<f64>().ok().map(Duration::try_from_secs_f64) {
        Some(Ok(t)) if !t.is_zero() => Ok(t),
        _ => Err(format!("{name} {v:?}: not a positive number of seconds")),
    }
}

/// The options, `Ok(None)` for `--help`, or a usage error (lexopt, as every argument
/// parser of the workspace): the options, then the program and its arguments as given.
fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Option<Options>, String> {
    use lexopt::Arg::{Long, Short, Value};
    let args: Vec<OsString> = args.into_iter().collect();
    // lexopt takes `--` itself: a missing program after it is told apart by the last word.
    let ends_in_separator = args.last().is_some_and(|a| a == "--");
    let mut p = lexopt::Parser::from_args(args);
    let (mut nproc, mut port, mut timeout) = (None, None, None);
    let mut grace = Duration::from_secs(10);
    let program = loop {
        // The flag as written (for messages) and what it asks, owned: the next value is
        // read from the parser below.
        let (flag, arg) = match p.next().map_err(|e| e.to_string())? {
            None if ends_in_separator => return Err("no program after --".into()),
            None => return Err("no program to launch".into()),
            Some(Value(program)) => break program,
            Some(Long(name)) => (format!("--{name}"), name.to_string()),
            Some(Short(c)) => (format!("-{c}"), c.to_string()),
        };
        let mut value = |what: &str| -> Result<String, String> {
            p.value()
                .map_err(|_| format!("{flag} needs {what}"))?
                .into_string()
                .map_err(|v| format!("{flag} {v:?}: not valid UTF-8"))
        };
        match arg.as_str() {
            "h" | "help" => return Ok(None),
            "n" | "nproc" => {
                let v = value("a number of ranks")?;
                match v.parse::<usize>() {
                    Ok(n) if n >= 1 => nproc = Some(n),
                    _ => return Err(format!("{flag} {v:?}: not a number of ranks (1 or more)")),
                }
            }
            "port" if flag.starts_with("--") => {
                let v = value("a port")?;
                port = Some(
                    v.parse::<u16>()
                        .map_err(|_| format!("--port {v:?}: not a port"))?,
                );
            }
            "timeout" if flag.starts_with("--") => {
                timeout = Some(seconds(&flag, &value("a number of seconds")?)?)
            }
            "grace" if flag.starts_with("--") => {
                grace = seconds(&flag, &value("a number of seconds")?)?
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    };
    let nproc = nproc.ok_or("-n N is required")?;
    Ok(Some(Options {
        nproc,
        port: port.filter(|&p| p != 0),
        timeout,
        grace,
        program,
        args: p.raw_args().map_err(|e| e.to_string())?.collect(),
    }))
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

/// Starts the ranks and waits for them; kills the rest on the first failure, the
/// timeout or a forwarded signal.
fn launch(options: &Options) -> Result<(), Failure> {
    signals::catch().map_err(|e| Failure::Setup(format!("cannot catch signals: {e}")))?;
    let port = match options.port {
        Some(port) => port,
        None => free_port().map_err(|e| Failure::Setup(format!("cannot find a free port: {e}")))?,
    };
    let token = match StoreToken::from_env() {
        Ok(Some(token)) => token,
        Ok(None) => StoreToken::generate()
            .map_err(|e| Failure::Setup(format!("cannot make a store token: {e}")))?,
        Err(e) => return Err(Failure::Setup(e.to_string())),
    };
    let start = Instant::now();
    let mut running: Vec<Rank> = Vec::with_capacity(options.nproc);
    for rank in 0..options.nproc {
        let mut command = Command::new(&options.program);
        die_with_launch(&mut command);
        let spawned = command
            .args(&options.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", options.nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", options.nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
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

/// A port that was free a moment ago; rank 0 binds it soon after.
fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
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
