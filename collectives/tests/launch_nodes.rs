//! `launch` across nodes, with torchrun's names: two `launch` processes on this host
//! play the two nodes of one job (loopback `MASTER_ADDR`, a token file shared through a
//! temporary directory). The ranks are `launch_demo` (which meets the others at the
//! store) or a shell that prints what it was given.

mod common;

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use collectives::store::MAX_WORLD_SIZE;

/// How long a launch that should end soon may take on a loaded machine.
const SOON: Duration = Duration::from_secs(60);

/// The variables a rank prints in [`PRINT_ENV`], in order.
const PRINT_ENV: &str = "echo env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE \
    $GROUP_RANK $GROUP_WORLD_SIZE $ROLE_RANK $ROLE_WORLD_SIZE $ROLE_NAME \
    $MASTER_ADDR $MASTER_PORT $LOWRANK_STORE_TOKEN";

/// The `launch_demo` example, built once per test binary.
fn demo() -> &'static Path {
    static DEMO: OnceLock<PathBuf> = OnceLock::new();
    DEMO.get_or_init(|| common::example("launch_demo"))
}

/// A directory of its own under the system's temporary one, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("launch_nodes-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("create a temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port of 127.0.0.1 that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A unique value for [`MARK`], set on both launches of a test: every process they
/// start inherits it, so those still alive are found through `/proc`.
fn mark() -> String {
    static COUNT: AtomicUsize = AtomicUsize::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    format!("{}-{n}", std::process::id())
}

const MARK: &str = "LAUNCH_NODES_TEST_MARK";

/// A running `launch`, its output collected.
struct Node {
    child: Child,
    stdout: thread::JoinHandle<String>,
    stderr: thread::JoinHandle<String>,
}

/// What a `launch` did.
#[derive(Debug)]
struct Ended {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// Starts `launch args`, with `env` set and `LOWRANK_STORE_TOKEN` removed unless `env`
/// sets it.
fn start(args: &[&str], env: &[(&str, &str)]) -> Node {
    let mut command = Command::new(env!("CARGO_BIN_EXE_launch"));
    command
        .args(args)
        .env_remove("LOWRANK_STORE_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().expect("start launch");
    let reader = |mut pipe: Box<dyn Read + Send>| {
        thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = reader(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = reader(Box::new(child.stderr.take().expect("piped stderr")));
    Node {
        child,
        stdout,
        stderr,
    }
}

impl Node {
    /// Waits for `launch` to exit, up to [`SOON`] (then kills it and fails).
    fn wait(mut self) -> Ended {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for launch") {
                return Ended {
                    status,
                    stdout: self.stdout.join().expect("stdout reader"),
                    stderr: self.stderr.join().expect("stderr reader"),
                    took: started.elapsed(),
                };
            }
            if started.elapsed() >= SOON {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("launch did not exit within {SOON:?}");
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Runs `launch args` to its end.
fn run(args: &[&str], env: &[(&str, &str)]) -> Ended {
    start(args, env).wait()
}

/// The arguments of node `rank` of a job of `nnodes` nodes × `nproc` ranks at
/// 127.0.0.1:`port`, in torchrun's dashed spellings, then `rest`.
fn node_args(nnodes: usize, rank: usize, nproc: usize, port: u16, rest: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--nnodes",
        &nnodes.to_string(),
        "--node-rank",
        &rank.to_string(),
        "--nproc-per-node",
        &nproc.to_string(),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(rest.iter().map(|s| s.to_string()));
    args
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// The live processes (not zombies) whose environment holds `MARK=mark`.
fn marked_processes(mark: &str) -> Vec<i32> {
    let needle = format!("{MARK}={mark}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned));
            if matches!(state.as_deref(), None | Some("Z" | "X")) {
                return false;
            }
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|environ| {
                environ
                    .split(|&b| b == 0)
                    .any(|var| var == needle.as_bytes())
            })
        })
        .collect()
}

/// Asserts that no process started under `mark` is alive, within [`SOON`].
fn assert_none_left(mark: &str) {
    let deadline = Instant::now() + SOON;
    loop {
        let left = marked_processes(mark);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "still running: {left:?}");
        thread::sleep(Duration::from_millis(50));
    }
}

/// `(rank, world size, local rank)` of every "rank R of W (local rank L) passed the
/// barrier" line of `stdout`.
fn passed(stdout: &str) -> Vec<(usize, usize, usize)> {
    stdout
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("rank ")?;
            let (rank, rest) = rest.split_once(" of ")?;
            let (world, rest) = rest.split_once(" (local rank ")?;
            let local = rest.strip_suffix(") passed the barrier")?;
            Some((rank.parse().ok()?, world.parse().ok()?, local.parse().ok()?))
        })
        .collect()
}

#[test]
fn two_nodes_of_two_ranks_run_one_job_with_a_token_node_0_writes() {
    let dir = TempDir::new();
    let token_file = dir.0.join("job.token");
    let token_arg = token_file.to_str().expect("a UTF-8 path");
    let port = free_port();
    let demo = demo().to_str().expect("a UTF-8 path");
    // Node 1 first: it waits for node 0 to write the token file.
    let rest = ["--token-file", token_arg, "--timeout", "50", "--", demo];
    let node1 = start(&strs(&node_args(2, 1, 2, port, &rest)), &[]);
    thread::sleep(Duration::from_millis(300));
    let node0 = start(&strs(&node_args(2, 0, 2, port, &rest)), &[]);
    let (ended0, ended1) = (node0.wait(), node1.wait());
    assert!(ended0.status.success(), "node 0: {ended0:?}");
    assert!(ended1.status.success(), "node 1: {ended1:?}");
    assert!(
        ended0.stderr.contains("wrote a fresh store token"),
        "{ended0:?}"
    );
    // Each node ran its own two ranks: K*P + L, of a world of 4.
    let mut on0 = passed(&ended0.stdout);
    let mut on1 = passed(&ended1.stdout);
    on0.sort_unstable();
    on1.sort_unstable();
    assert_eq!(on0, [(0, 4, 0), (1, 4, 1)], "{ended0:?}");
    assert_eq!(on1, [(2, 4, 0), (3, 4, 1)], "{ended1:?}");
    // The token file node 0 made: only its owner may read it; one valid token.
    let meta = std::fs::metadata(&token_file).expect("the token file exists");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let token = std::fs::read_to_string(&token_file).expect("read the token");
    let token = token.trim();
    assert!(
        token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()),
        "{token:?}"
    );
}

/// Runs two nodes of 3 ranks that print their variables (node 1 with torchrun's
/// underscore spellings) with `extra` arguments and `env`; the sorted lines.
fn printed_env(port: u16, extra: &[&str], env: &[(&str, &str)]) -> Vec<String> {
    let mut rest: Vec<&str> = extra.to_vec();
    rest.extend(["--", "sh", "-c", PRINT_ENV]);
    let node0 = start(&strs(&node_args(2, 0, 3, port, &rest)), env);
    let mut underscores = vec![
        "--nnodes=2".to_owned(),
        "--node_rank".to_owned(),
        "1".to_owned(),
        "--nproc_per_node=3".to_owned(),
        "--master_addr".to_owned(),
        "127.0.0.1".to_owned(),
        format!("--master_port={port}"),
    ];
    underscores.extend(rest.iter().map(|s| s.to_string()));
    let node1 = start(&strs(&underscores), env);
    let mut lines = Vec::new();
    for (k, node) in [node0, node1].into_iter().enumerate() {
        let ended = node.wait();
        assert!(ended.status.success(), "node {k}: {ended:?}");
        lines.extend(
            ended
                .stdout
                .lines()
                .filter(|l| l.starts_with("env "))
                .map(str::to_owned),
        );
    }
    lines.sort_unstable();
    lines
}

/// torchrun's variables for 2 nodes × 3 ranks (RANK, LOCAL_RANK, WORLD_SIZE,
/// LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE,
/// ROLE_NAME), then MASTER_ADDR, MASTER_PORT and the token.
fn torchrun_env(port: u16, token: &str) -> Vec<String> {
    [
        "0 0 6 3 0 2 0 6 default",
        "1 1 6 3 0 2 1 6 default",
        "2 2 6 3 0 2 2 6 default",
        "3 0 6 3 1 2 3 6 default",
        "4 1 6 3 1 2 4 6 default",
        "5 2 6 3 1 2 5 6 default",
    ]
    .iter()
    .map(|vars| format!("env {vars} 127.0.0.1 {port} {token}"))
    .collect()
}

#[test]
fn every_rank_sees_torchruns_variables_and_the_jobs_token() {
    // From a token file that exists already (written as `openssl rand -hex 16 > f`).
    let dir = TempDir::new();
    let token_file = dir.0.join("job.token");
    let token = "0123456789abcdef0123456789abcdef";
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&token_file)
        .expect("create the token file");
    std::io::Write::write_all(&mut file, format!("{token}\n").as_bytes()).expect("write");
    drop(file);
    let port = free_port();
    let path = token_file.to_str().expect("a UTF-8 path");
    let lines = printed_env(port, &["--token-file", path], &[]);
    assert_eq!(lines, torchrun_env(port, token));
    // From LOWRANK_STORE_TOKEN in every node's environment.
    let port = free_port();
    let mine = "my-shared-token-0123456789";
    let lines = printed_env(port, &[], &[("LOWRANK_STORE_TOKEN", mine)]);
    assert_eq!(lines, torchrun_env(port, mine));
}

#[test]
fn a_failed_rank_fails_its_node_and_the_other_nodes_ranks_at_the_store() {
    let mark = mark();
    let env = [(MARK, mark.as_str())];
    let dir = TempDir::new();
    let token_file = dir.0.join("job.token");
    let token_arg = token_file.to_str().expect("a UTF-8 path");
    let port = free_port();
    let demo = demo().to_str().expect("a UTF-8 path");
    // Node 0's rank 1 fails once the others had time to reach the store; its rank 0,
    // which serves the store, goes with it.
    let fail_rank_1 = "if [ \"$LOCAL_RANK\" = 1 ]; then sleep 2; exit 3; fi; exec \"$0\"";
    let bound = ["--token-file", token_arg, "--timeout", "20", "--"];
    let mut rest0 = bound.to_vec();
    rest0.extend(["sh", "-c", fail_rank_1, demo]);
    let mut rest1 = bound.to_vec();
    rest1.push(demo);
    let node0 = start(&strs(&node_args(2, 0, 2, port, &rest0)), &env);
    let node1 = start(&strs(&node_args(2, 1, 2, port, &rest1)), &env);
    let (ended0, ended1) = (node0.wait(), node1.wait());
    assert_eq!(ended0.status.code(), Some(1), "node 0: {ended0:?}");
    assert!(
        ended0.stderr.contains("rank 1 failed (exit status: 3)"),
        "{ended0:?}"
    );
    // Node 1's ranks fail at the store (rank 0 and its store are gone): a failed rank
    // (1), or, had they not reached it yet, node 1's timeout (124).
    match ended1.status.code() {
        Some(1) => assert!(
            ended1.stderr.contains("rank 2 failed") || ended1.stderr.contains("rank 3 failed"),
            "{ended1:?}"
        ),
        Some(124) => assert!(ended1.stderr.contains("timed out"), "{ended1:?}"),
        _ => panic!("node 1 should fail: {ended1:?}"),
    }
    // Nobody passed the barrier, and nothing of either node is left.
    assert_eq!(passed(&ended0.stdout), []);
    assert_eq!(passed(&ended1.stdout), []);
    assert_none_left(&mark);
}

#[test]
fn usage_errors_exit_2_name_the_flag_and_start_nothing() {
    let max = MAX_WORLD_SIZE.to_string();
    let cases: [(&[&str], &[&str]); 10] = [
        (
            &[
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "-n",
                "1",
                "--master-addr",
                "127.0.0.1",
            ],
            &["--node-rank 2", "--nnodes 2"],
        ),
        (&["--node_rank", "1", "-n", "1"], &["--node_rank 1"]),
        (&["--nproc-per-node", "0"], &["--nproc-per-node"]),
        (&["--nproc_per_node=0"], &["--nproc_per_node"]),
        (
            &["--nnodes", "2", "-n", "1", "--master-port", "29500"],
            &["--master-addr"],
        ),
        (
            &["--nnodes", "2", "-n", "1", "--master_addr", "127.0.0.1"],
            &["--master-port"],
        ),
        (
            &[
                "--nnodes",
                "2",
                "--nproc-per-node",
                &max,
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "29500",
            ],
            &["--nproc-per-node", &max],
        ),
        (&["--bogus", "-n", "1"], &["unknown option --bogus"]),
        (&["--nnodes", "1:2", "-n", "1"], &["--nnodes", "elastic"]),
        // Several nodes without a token: how to set one.
        (
            &[
                "--nnodes",
                "2",
                "-n",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                "29500",
            ],
            &["--token-file", "LOWRANK_STORE_TOKEN", "openssl rand"],
        ),
    ];
    for (args, named) in cases {
        let mut args = args.to_vec();
        args.extend(["--", "sh", "-c", "echo ran"]);
        let ended = run(&args, &[]);
        assert_eq!(ended.status.code(), Some(2), "{args:?}: {ended:?}");
        for needle in named {
            assert!(
                ended.stderr.contains(needle),
                "{args:?}: no {needle:?} in {ended:?}"
            );
        }
        assert!(ended.stderr.contains("usage:"), "{args:?}: {ended:?}");
        assert!(
            !ended.stdout.contains("ran"),
            "{args:?} started a rank: {ended:?}"
        );
    }
}

#[test]
fn a_node_waits_for_the_token_file_until_its_timeout_and_bad_files_are_named() {
    let dir = TempDir::new();
    let missing = dir.0.join("never.token");
    let path = missing.to_str().expect("a UTF-8 path");
    let port = free_port();
    let rest = [
        "--token-file",
        path,
        "--timeout",
        "1",
        "--",
        "sh",
        "-c",
        "echo ran",
    ];
    let ended = run(&strs(&node_args(2, 1, 2, port, &rest)), &[]);
    assert_eq!(ended.status.code(), Some(124), "{ended:?}");
    assert!(ended.took >= Duration::from_secs(1), "{ended:?}");
    assert!(ended.stderr.contains(path), "{ended:?}");
    assert!(!ended.stdout.contains("ran"), "{ended:?}");
    assert!(!missing.exists(), "only node 0 writes the token file");
    // SIGTERM ends the wait at once (launch catches it, so it must look for it).
    let rest = ["--token-file", path, "--", "sh", "-c", "echo ran"];
    let node = start(&strs(&node_args(2, 1, 2, port, &rest)), &[]);
    thread::sleep(Duration::from_millis(500));
    let pid = libc::pid_t::try_from(node.child.id()).expect("a pid");
    // SAFETY: `kill` takes no pointers. `pid` is our unreaped child, so it names this
    // `launch` and no other process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let ended = node.wait();
    assert_eq!(ended.status.code(), Some(128 + libc::SIGTERM), "{ended:?}");
    assert!(
        ended.stderr.contains("SIGTERM before any rank"),
        "{ended:?}"
    );
    assert!(ended.took < Duration::from_secs(10), "{ended:?}");
    assert!(!ended.stdout.contains("ran"), "{ended:?}");
    // Node 0 finding a file that holds no valid token does not replace it.
    for (name, content) in [("short.token", "too-short\n"), ("empty.token", "")] {
        let file = dir.0.join(name);
        std::fs::write(&file, content).expect("write a token file");
        let path = file.to_str().expect("a UTF-8 path");
        let rest = ["--token-file", path, "--", "sh", "-c", "echo ran"];
        let ended = run(&strs(&node_args(2, 0, 2, port, &rest)), &[]);
        assert_eq!(ended.status.code(), Some(1), "{name}: {ended:?}");
        assert!(ended.stderr.contains(path), "{name}: {ended:?}");
        assert!(!ended.stdout.contains("ran"), "{name}: {ended:?}");
        assert!(
            !ended.stderr.contains("too-short"),
            "the token is not shown"
        );
        assert_eq!(std::fs::read_to_string(&file).expect("read"), content);
    }
}
