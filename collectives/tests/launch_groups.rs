//! `launch` leaves nothing behind (issue 9, defect 5): each rank runs in a process group
//! of its own, and under SIGTERM or SIGINT, on a failed rank, or when a rank exits with
//! children still running, no process of those groups survives. Processes are counted
//! through `/proc`.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// How long anything that should happen soon may take on a loaded machine.
const SOON: Duration = Duration::from_secs(20);

/// Each rank prints its group (`$$` is the shell, its group's leader) and starts a
/// child that outlives it unless killed.
const PRINT_GROUP: &str = "echo group $$; sleep 1000 &";

/// A started `launch` whose ranks' output arrives line by line.
struct Launched {
    child: Child,
    lines: mpsc::Receiver<String>,
    stderr: thread::JoinHandle<String>,
}

fn launch(args: &[&str]) -> Launched {
    let mut child = Command::new(env!("CARGO_BIN_EXE_launch"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start launch");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let (tx, lines) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let stderr = thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    Launched {
        child,
        lines,
        stderr,
    }
}

impl Launched {
    /// The groups of the first `n` ranks to report theirs.
    fn groups(&self, n: usize) -> BTreeSet<i32> {
        let deadline = Instant::now() + SOON;
        let mut groups = BTreeSet::new();
        while groups.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .expect("a rank reports its group");
            if let Some(group) = line.strip_prefix("group ") {
                groups.insert(group.trim().parse().expect("a process group id"));
            }
        }
        groups
    }

    /// Waits for `launch` to exit; its status and stderr.
    fn wait(mut self) -> (ExitStatus, String) {
        let deadline = Instant::now() + SOON;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for launch") {
                let stderr = self.stderr.join().expect("stderr reader");
                return (status, stderr);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("launch did not exit within {SOON:?}");
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The live processes (not zombies) of `groups`, as `(pid, group)`, from `/proc`.
fn live_members(groups: &BTreeSet<i32>) -> Vec<(i32, i32)> {
    let mut members = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return members;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        // The process may be gone by now.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp ...`; `comm` may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let (Some(&state), Some(group)) = (fields.first(), fields.get(2)) else {
            continue;
        };
        let Ok(group) = group.parse::<i32>() else {
            continue;
        };
        if groups.contains(&group) && state != "Z" && state != "X" {
            members.push((pid, group));
        }
    }
    members
}

/// Asserts that every process of `groups` is gone, within [`SOON`].
fn assert_groups_empty(groups: &BTreeSet<i32>) {
    let deadline = Instant::now() + SOON;
    loop {
        let left = live_members(groups);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still running in groups {groups:?}: {left:?}"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

fn send(launched: &Launched, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(launched.child.id()).expect("a pid");
    // SAFETY: `kill` takes no pointers. `pid` is our unreaped child, so it names `launch`
    // and no other process.
    let rc = unsafe { libc::kill(pid, signal) };
    assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
}

/// Starts two ranks that each leave a child running, waits until both run in groups of
/// their own, then sends `signal` to `launch`; returns the exit status and stderr.
fn signal_case(signal: libc::c_int) -> (ExitStatus, String) {
    let script = format!("{PRINT_GROUP} sleep 1000");
    let launched = launch(&["-n", "2", "--grace", "5", "--", "sh", "-c", &script]);
    let groups = launched.groups(2);
    // Each rank leads a group of its own, apart from launch's, with its children in it.
    let own = {
        let pid = libc::pid_t::try_from(launched.child.id()).expect("a pid");
        // SAFETY: `getpgid` takes no pointers; it only reads the group of `pid`.
        unsafe { libc::getpgid(pid) }
    };
    assert!(!groups.contains(&own), "a rank shares launch's group {own}");
    let deadline = Instant::now() + SOON;
    while live_members(&groups).len() < 4 {
        assert!(Instant::now() < deadline, "{:?}", live_members(&groups));
        thread::sleep(Duration::from_millis(20));
    }
    send(&launched, signal);
    let outcome = launched.wait();
    assert_groups_empty(&groups);
    outcome
}

#[test]
fn sigterm_to_launch_leaves_no_process_of_its_tree_running() {
    // Regression: ranks (and their children) kept running after launch got SIGTERM.
    let (status, stderr) = signal_case(libc::SIGTERM);
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    assert!(
        stderr.contains("SIGTERM: forwarded to every rank"),
        "{stderr}"
    );
}

#[test]
fn sigint_to_launch_leaves_no_process_of_its_tree_running() {
    let (status, stderr) = signal_case(libc::SIGINT);
    assert_eq!(status.code(), Some(128 + libc::SIGINT), "{stderr}");
}

#[test]
fn a_failed_rank_takes_every_group_with_it() {
    // Regression: a rank started through `sh -c` left its children running.
    let script = format!("{PRINT_GROUP} if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 1000");
    let launched = launch(&["-n", "2", "--", "sh", "-c", &script]);
    // Rank 0 may be killed before it reports; rank 1 reports before it fails.
    let first = launched.groups(1);
    let (status, stderr) = launched.wait();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 1 failed (exit status: 3)"),
        "{stderr}"
    );
    assert_groups_empty(&first);
}

#[test]
fn what_a_successful_rank_leaves_running_is_killed() {
    let launched = launch(&["-n", "2", "--", "sh", "-c", PRINT_GROUP]);
    let groups = launched.groups(2);
    let (status, stderr) = launched.wait();
    assert!(status.success(), "{status}: {stderr}");
    assert_groups_empty(&groups);
}

#[test]
fn launch_hands_its_ranks_a_token_and_its_help_says_how() {
    let out = Command::new(env!("CARGO_BIN_EXE_launch"))
        .arg("--help")
        .output()
        .expect("run launch --help");
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for needed in [
        "LOWRANK_STORE_TOKEN",
        "fresh random",
        "every rank",
        "--grace",
    ] {
        assert!(help.contains(needed), "{needed:?} not in the help:\n{help}");
    }
    // A fresh token per launch, the same for every rank; one set by the user is passed.
    let tokens = |env: Option<&str>| -> Vec<String> {
        let mut command = Command::new(env!("CARGO_BIN_EXE_launch"));
        command.args([
            "-n",
            "2",
            "--",
            "sh",
            "-c",
            "echo token $LOWRANK_STORE_TOKEN",
        ]);
        match env {
            Some(token) => command.env("LOWRANK_STORE_TOKEN", token),
            None => command.env_remove("LOWRANK_STORE_TOKEN"),
        };
        let out = command.output().expect("run launch");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("token ").map(str::to_owned))
            .collect()
    };
    let (a, b) = (tokens(None), tokens(None));
    assert_eq!(a.len(), 2);
    assert!(a[0] == a[1] && a[0].len() == 32, "{a:?}");
    assert_ne!(a[0], b[0], "a token is made per launch");
    let mine = "my-own-token-0123456789";
    assert_eq!(tokens(Some(mine)), [mine, mine]);
    let out = Command::new(env!("CARGO_BIN_EXE_launch"))
        .args(["-n", "1", "true"])
        .env("LOWRANK_STORE_TOKEN", "short")
        .output()
        .expect("run launch");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("LOWRANK_STORE_TOKEN"));
}
