//! `launch`'s command line: the options under torchrun's names (and its underscore
//! spellings), and the checks that make a bad command line a usage error (status 2)
//! before anything is started.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use collectives::store::MAX_WORLD_SIZE;

/// `launch --help`.
pub(crate) const USAGE: &str = "\
usage: launch -n P [--port PORT] [--timeout SECS] [--grace SECS] [--] PROGRAM [ARGS...]
       launch --nnodes N --node-rank K --nproc-per-node P --master-addr HOST
              --master-port PORT [--token-file PATH] [--timeout SECS] [--grace SECS]
              [--] PROGRAM [ARGS...]

Starts P local processes of PROGRAM, ranks K*P to K*P+P-1 of a job of N*P ranks on N
nodes (one launch per node, as torchrun), and waits for them. Each rank gets RANK,
LOCAL_RANK, WORLD_SIZE (N*P), LOCAL_WORLD_SIZE (P), GROUP_RANK (K), GROUP_WORLD_SIZE
(N), ROLE_RANK (= RANK), ROLE_WORLD_SIZE (= WORLD_SIZE), ROLE_NAME=default,
MASTER_ADDR, MASTER_PORT and LOWRANK_STORE_TOKEN.

options (torchrun's names; --nproc_per_node, --node_rank, --master_addr, --master_port
and every other underscore spelling are accepted too, and --flag=VALUE):
  -n, --nproc-per-node P  ranks on this node (at least 1); -n P alone is a one-node job
      --nnodes N          nodes in the job (default 1); the same on every node
      --node-rank K       this node's index, 0 to N-1 (default 0); node 0 runs rank 0,
                          which serves the rendezvous store
      --master-addr HOST  rank 0's host, as every node reaches it; required when N > 1
                          (default 127.0.0.1)
      --master-port PORT  the store's port on HOST; required when N > 1 (default, or 0,
                          for one node: a free port); --port PORT is the same
      --token-file PATH   the job's store token, read from PATH; node 0 creates PATH
                          (mode 0600, a fresh token) when it is missing, and the other
                          nodes wait for it to appear (shared filesystem)
      --standalone        a one-node job (torchrun's flag; the default)
      --timeout SECS      kill every rank of this node after SECS seconds (default: no
                          limit); counts the wait for the token file too
      --grace SECS        after forwarding SIGTERM or SIGINT, wait SECS for the ranks to
                          exit before killing them (default 10)
  -h, --help              print this help

token:
  Rank 0 serves the rendezvous store; it refuses every client that does not present
  the token in LOWRANK_STORE_TOKEN, before reading any key. A job gets one token, the
  same on every rank of every node: the one read from --token-file PATH; else the
  LOWRANK_STORE_TOKEN of launch's environment (16 to 1024 printable ASCII characters,
  no spaces); else, for a one-node job only, a fresh random one (128 bits) for this
  job alone. A job of several nodes needs --token-file or LOWRANK_STORE_TOKEN (e.g.
  `export LOWRANK_STORE_TOKEN=$(openssl rand -hex 16)` on every node): without a
  token, rank 0's store refuses to serve an address other hosts reach. Rank 0's store
  binds only the address MASTER_ADDR names. The token travels in the clear: it keeps
  out other users of the hosts and network, not someone who reads the traffic.

processes and signals (on every node, for that node's ranks):
  Each rank runs in its own process group, with what it starts; what is left of a
  group when its rank exits is killed. On a failed rank or the timeout, every group
  is killed. SIGTERM and SIGINT are forwarded to every group, which is killed after
  --grace SECS or a second signal; launch then exits with 128 + the signal number.
  The launches of a job do not talk to each other: the other nodes' ranks learn of a
  failure through the store (their requests fail, or time out), so give every node a
  --timeout to bound the job whatever happens.

example, 2 nodes x 8 ranks (node 0 at 10.0.0.1, a home directory both nodes share):
  node0$ launch --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 \\
             --master-port 29500 --token-file ~/.job.token -- ./train
  node1$ launch --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr 10.0.0.1 \\
             --master-port 29500 --token-file ~/.job.token -- ./train";

/// What to launch on this node, checked: `node_rank < nnodes`, `nproc >= 1`,
/// `nnodes * nproc <= MAX_WORLD_SIZE`, and for a job of several nodes an address and a
/// port.
#[derive(Debug)]
pub(crate) struct Options {
    /// `--nnodes`: the nodes (launches) of the job, at least 1.
    pub(crate) nnodes: usize,
    /// `--node-rank`: this node's index, below `nnodes`.
    pub(crate) node_rank: usize,
    /// `--nproc-per-node` or `-n`: the ranks this node starts, at least 1.
    pub(crate) nproc: usize,
    /// `--master-addr`: the host of rank 0's store (127.0.0.1 by default on one node).
    pub(crate) master_addr: String,
    /// `--master-port` or `--port`; `None` on one node without one: a free port.
    pub(crate) master_port: Option<u16>,
    /// `--token-file`: where the job's token is (or, on node 0, is to be written).
    pub(crate) token_file: Option<PathBuf>,
    /// `--timeout`: how long this node's part of the job may take.
    pub(crate) timeout: Option<Duration>,
    /// `--grace`: how long ranks have to exit after a forwarded signal.
    pub(crate) grace: Duration,
    /// The program every rank runs, and its arguments.
    pub(crate) program: OsString,
    pub(crate) args: Vec<OsString>,
}

impl Options {
    /// The job's number of ranks, `WORLD_SIZE` (no overflow: checked at parsing).
    pub(crate) fn world_size(&self) -> usize {
        self.nnodes * self.nproc
    }

    /// The global rank, `RANK`, of this node's local rank `local`.
    pub(crate) fn rank_of(&self, local: usize) -> usize {
        self.node_rank * self.nproc + local
    }
}

/// Parses `SECS` of `--name SECS`: a positive number of seconds.
fn seconds(name: &str, v: &str) -> Result<Duration, String> {
    match v.parse::<f64>().ok().map(Duration::try_from_secs_f64) {
        Some(Ok(t)) if !t.is_zero() => Ok(t),
        _ => Err(format!("{name} {v:?}: not a positive number of seconds")),
    }
}

/// A value as given, with the flag as written (for messages).
#[derive(Debug)]
struct Given<T> {
    value: T,
    flag: String,
}

/// The options, `Ok(None)` for `--help`, or a usage error naming the flag (lexopt, as
/// every argument parser of the workspace): the options, then the program and its
/// arguments as given. A flag given twice takes its last value, as torchrun's.
pub(crate) fn parse_args(
    args: impl IntoIterator<Item = OsString>,
) -> Result<Option<Options>, String> {
    use lexopt::Arg::{Long, Short, Value};
    let args: Vec<OsString> = args.into_iter().collect();
    // lexopt takes `--` itself: a missing program after it is told apart by the last word.
    let ends_in_separator = args.last().is_some_and(|a| a == "--");
    let mut p = lexopt::Parser::from_args(args);
    let mut nproc: Option<Given<usize>> = None;
    let mut nnodes: Option<Given<usize>> = None;
    let mut node_rank: Option<Given<usize>> = None;
    let mut master_addr: Option<Given<String>> = None;
    let mut master_port: Option<Given<u16>> = None;
    let mut standalone: Option<String> = None;
    let (mut token_file, mut timeout) = (None, None);
    let mut grace = Duration::from_secs(10);
    let program = loop {
        // The flag as written (for messages) and its name, torchrun's underscores read
        // as dashes; owned, as the next value is read from the parser below.
        let (flag, name) = match p.next().map_err(|e| e.to_string())? {
            None if ends_in_separator => return Err("no program after --".into()),
            None => return Err("no program to launch".into()),
            Some(Value(program)) => break program,
            Some(Long(name)) => (format!("--{name}"), name.replace('_', "-")),
            Some(Short(c)) => (format!("-{c}"), c.to_string()),
        };
        let long = flag.starts_with("--");
        let mut raw = |what: &str| -> Result<OsString, String> {
            p.value().map_err(|_| format!("{flag} needs {what}"))
        };
        let utf8 = |v: OsString| -> Result<String, String> {
            v.into_string()
                .map_err(|v| format!("{flag} {v:?}: not valid UTF-8"))
        };
        let mut value = |what: &str| utf8(raw(what)?);
        let given = |value: usize| Given {
            value,
            flag: flag.clone(),
        };
        match (long, name.as_str()) {
            (_, "h" | "help") => return Ok(None),
            (false, "n") | (true, "nproc" | "nproc-per-node") => {
                let v = value("a number of ranks")?;
                match v.parse::<usize>() {
                    Ok(n) if n >= 1 => nproc = Some(given(n)),
                    _ => return Err(format!("{flag} {v:?}: not a number of ranks (1 or more)")),
                }
            }
            (true, "nnodes") => {
                let v = value("a number of nodes")?;
                match v.parse::<usize>() {
                    Ok(n) if n >= 1 => nnodes = Some(given(n)),
                    _ if v.contains(':') => {
                        return Err(format!(
                            "{flag} {v:?}: elastic ranges (MIN:MAX) are not supported; \
                             give the number of nodes"
                        ))
                    }
                    _ => return Err(format!("{flag} {v:?}: not a number of nodes (1 or more)")),
                }
            }
            (true, "node-rank") => {
                let v = value("a node rank")?;
                let k = v
                    .parse::<usize>()
                    .map_err(|_| format!("{flag} {v:?}: not a node rank (0 or more)"))?;
                node_rank = Some(given(k));
            }
            (true, "master-addr") => {
                let v = value("a host")?;
                if v.trim().is_empty() {
                    return Err(format!("{flag} {v:?}: an empty host"));
                }
                master_addr = Some(Given {
                    value: v.trim().to_owned(),
                    flag: flag.clone(),
                });
            }
            (true, "master-port" | "port") => {
                let v = value("a port")?;
                let port = v
                    .parse::<u16>()
                    .map_err(|_| format!("{flag} {v:?}: not a port (0 to 65535)"))?;
                master_port = Some(Given {
                    value: port,
                    flag: flag.clone(),
                });
            }
            (true, "token-file") => token_file = Some(PathBuf::from(raw("a path")?)),
            (true, "standalone") => standalone = Some(flag.clone()),
            (true, "timeout") => timeout = Some(seconds(&flag, &value("a number of seconds")?)?),
            (true, "grace") => grace = seconds(&flag, &value("a number of seconds")?)?,
            (true, rdzv) if rdzv.starts_with("rdzv") => {
                return Err(format!(
                    "{flag}: torchrun's rendezvous options are not supported; give every \
                     node --master-addr and --master-port (rank 0's store is the rendezvous)"
                ))
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    };
    let nproc = nproc.ok_or("-n P (--nproc-per-node P) is required")?;
    let nnodes = nnodes.unwrap_or(Given {
        value: 1,
        flag: "--nnodes".into(),
    });
    if let (Some(flag), true) = (&standalone, nnodes.value > 1) {
        return Err(format!(
            "{flag} is a one-node job, but {} {} asks for several",
            nnodes.flag, nnodes.value
        ));
    }
    let node_rank = match node_rank {
        Some(k) if k.value >= nnodes.value => {
            return Err(format!(
                "{} {}: not below {} {} (node ranks are 0 to {})",
                k.flag,
                k.value,
                nnodes.flag,
                nnodes.value,
                nnodes.value - 1
            ))
        }
        Some(k) => k.value,
        None => 0,
    };
    let world_size = nnodes
        .value
        .checked_mul(nproc.value)
        .filter(|&w| w <= MAX_WORLD_SIZE);
    if world_size.is_none() {
        return Err(format!(
            "{} {} x {} {}: more than the {MAX_WORLD_SIZE} ranks a job may have",
            nnodes.flag, nnodes.value, nproc.flag, nproc.value
        ));
    }
    let several = nnodes.value > 1;
    let master_addr = match master_addr {
        Some(addr) => addr.value,
        None if several => {
            return Err(format!(
                "{} {} needs --master-addr HOST: rank 0's host (node 0's), as every node \
                 reaches it",
                nnodes.flag, nnodes.value
            ))
        }
        None => "127.0.0.1".to_owned(),
    };
    let master_port = match master_port {
        Some(port) if port.value != 0 => Some(port.value),
        Some(port) if several => {
            return Err(format!(
                "{} 0: a job of several nodes needs a port they all know (1 to 65535)",
                port.flag
            ))
        }
        None if several => {
            return Err(format!(
                "{} {} needs --master-port PORT: the port of rank 0's store, the same on \
                 every node",
                nnodes.flag, nnodes.value
            ))
        }
        // One node: 0 or none is a free port.
        _ => None,
    };
    Ok(Some(Options {
        nnodes: nnodes.value,
        node_rank,
        nproc: nproc.value,
        master_addr,
        master_port,
        token_file,
        timeout,
        grace,
        program,
        args: p.raw_args().map_err(|e| e.to_string())?.collect(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &str) -> Result<Option<Options>, String> {
        parse_args(args.split_whitespace().map(OsString::from))
    }

    fn error(args: &str) -> String {
        parse(args).expect_err(args)
    }

    #[test]
    fn torchrun_spellings_mean_the_same() {
        let dashes =
            "--nnodes 3 --node-rank 2 --nproc-per-node 4 --master-addr h --master-port 7 p";
        let unders =
            "--nnodes=3 --node_rank=2 --nproc_per_node 4 --master_addr h --master_port=7 p";
        for args in [dashes, unders] {
            let o = parse(args).expect(args).expect("not help");
            assert_eq!((o.nnodes, o.node_rank, o.nproc), (3, 2, 4), "{args}");
            assert_eq!(
                (o.master_addr.as_str(), o.master_port),
                ("h", Some(7)),
                "{args}"
            );
            assert_eq!((o.world_size(), o.rank_of(1)), (12, 9), "{args}");
        }
    }

    #[test]
    fn one_node_keeps_its_defaults_and_short_form() {
        let o = parse("-n 2 --port 0 -- prog -x")
            .expect("valid")
            .expect("not help");
        assert_eq!(
            (o.nnodes, o.node_rank, o.nproc, o.master_port),
            (1, 0, 2, None)
        );
        assert_eq!(o.master_addr, "127.0.0.1");
        assert_eq!((o.program.as_os_str(), o.args.len()), ("prog".as_ref(), 1));
        let o = parse("--standalone --nproc_per_node 3 --port 9 prog").expect("valid");
        assert_eq!(o.map(|o| (o.nproc, o.master_port)), Some((3, Some(9))));
    }

    #[test]
    fn bad_command_lines_name_the_flag() {
        let cases = [
            (
                "--nnodes 2 --node-rank 2 -n 1 --master-addr h --master-port 1 p",
                "--node-rank 2",
            ),
            ("--node_rank 1 -n 1 p", "--node_rank 1"),
            ("--nproc-per-node 0 p", "--nproc-per-node \"0\""),
            ("--nnodes 2 -n 1 --master-port 1 p", "--master-addr"),
            ("--nnodes 2 -n 1 --master-addr h p", "--master-port"),
            (
                "--nnodes 2 -n 1 --master-addr h --master-port 0 p",
                "--master-port 0",
            ),
            (
                "--nnodes 2 --nproc-per-node 1048576 --master-addr h --master-port 1 p",
                "1048576 ranks",
            ),
            ("--nnodes 1:2 -n 1 p", "elastic"),
            ("--rdzv-endpoint h:1 -n 1 p", "--rdzv-endpoint"),
            ("--bogus -n 1 p", "unknown option --bogus"),
            ("-n 1 --nnodes 2 --standalone p", "--standalone"),
            ("-n 1 --", "no program after --"),
            ("--nnodes 2 p", "-n P"),
        ];
        for (args, named) in cases {
            let message = error(args);
            assert!(message.contains(named), "{args}: {message}");
        }
    }
}
