//! `launch` killed with SIGKILL (the OOM killer's signal, which it cannot catch or
//! forward) takes its ranks with it: each rank asks the kernel, before it runs the
//! program, to be killed when `launch` dies (`PR_SET_PDEATHSIG`). Processes are found
//! and watched through `/proc`.
#![cfg(target_os = "linux")]

use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// How long starting the ranks may take on a loaded machine.
const SOON: Duration = Duration::from_secs(20);

/// How soon after `launch` dies every rank must be gone.
const GONE_WITHIN: Duration = Duration::from_secs(1);

/// What `/proc/<pid>/stat` says of a process: its command name, state, parent and
/// start time (which, with the pid, names one process even if the pid is reused).
#[derive(Debug, Clone, PartialEq)]
struct Stat {
    comm: String,
    state: char,
    ppid: i32,
    start: u64,
}

fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    // utime stime cutime cstime priority nice threads itrealvalue starttime ...`;
    // `comm` may hold spaces and parentheses.
    let (head, rest) = text.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat {
        comm,
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
    })
}

/// The children of `parent`, found by scanning `/proc`.
fn children(parent: i32) -> Vec<(i32, Stat)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, stat(pid)?)))
        .filter(|(_, stat)| stat.ppid == parent)
        .collect()
}

/// Whether the process `pid` that started at `start` still runs: a zombie (or a pid
/// now naming another process) is dead.
fn alive(pid: i32, start: u64) -> bool {
    stat(pid).is_some_and(|s| s.start == start && s.state != 'Z' && s.state != 'X')
}

/// Kills `launch` and every rank recorded, whatever the test's outcome.
struct Cleanup {
    launch: Child,
    ranks: Vec<(i32, u64)>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = self.launch.kill();
        let _ = self.launch.wait();
        for &(pid, start) in &self.ranks {
            if alive(pid, start) {
                // SAFETY: `kill` takes no pointers; `pid` was checked just now to name the
                // rank this test started (same start time).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

#[test]
fn sigkill_to_launch_leaves_no_rank_running() {
    // Regression: SIGTERM and SIGINT were forwarded, but after SIGKILL to launch (which
    // it cannot catch) every rank ran on, orphaned.
    let launch = Command::new(env!("CARGO_BIN_EXE_launch"))
        .args(["-n", "2", "--", "sleep", "30"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start launch");
    let launch_pid = i32::try_from(launch.id()).expect("a pid");
    let mut cleanup = Cleanup {
        launch,
        ranks: Vec::new(),
    };
    // Both ranks run `sleep`: past `exec`, so past whatever ran before it.
    let deadline = Instant::now() + SOON;
    let ranks = loop {
        let ranks: Vec<(i32, Stat)> = children(launch_pid)
            .into_iter()
            .filter(|(_, stat)| stat.comm == "sleep")
            .collect();
        cleanup.ranks = ranks.iter().map(|(pid, stat)| (*pid, stat.start)).collect();
        if ranks.len() == 2 {
            break ranks;
        }
        assert!(
            Instant::now() < deadline,
            "the ranks did not start: {ranks:?}"
        );
        thread::sleep(Duration::from_millis(10));
    };
    // SAFETY: `kill` takes no pointers; `launch_pid` is our unreaped child.
    let rc = unsafe { libc::kill(launch_pid, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    let status = cleanup.launch.wait().expect("reap launch");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    let killed_at = Instant::now();
    loop {
        let running: Vec<i32> = ranks
            .iter()
            .filter(|(pid, stat)| alive(*pid, stat.start))
            .map(|(pid, _)| *pid)
            .collect();
        if running.is_empty() {
            break;
        }
        assert!(
            killed_at.elapsed() < GONE_WITHIN,
            "ranks {running:?} still run {GONE_WITHIN:?} after launch was killed"
        );
        thread::sleep(Duration::from_millis(10));
    }
}
