//! The multi-process CPU suite of `cargo xtask test`: the TCP process group under our
//! `launch` and, where PyTorch is importable, under real `torchrun`, training the MLP of
//! the `train` example and ending bit-identical to the same run on thread ranks; then an
//! elastic restart: `torchrun --max-restarts 3` with one worker killed by SIGKILL partway,
//! whose restarted run must end with the model of an uninterrupted one.
//!
//! Every run is a test build (shared with `cargo test`) and takes a few seconds.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::{target_dir, workspace_root, Failure};

/// The hook of every run: PowerSGD, so hook state crosses the restart.
const HOOK: &str = "powersgd:rank=2,start_iter=10";
/// Steps of every run.
const STEPS: usize = 60;

/// Whether `python3 -c "import torch"` works, so that `torchrun` can run.
pub fn torch_importable() -> bool {
    Command::new("python3")
        .args(["-c", "import torch.distributed.run"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs the suite; the `torchrun` runs only where PyTorch is importable (the caller says
/// what was skipped).
pub fn suite(with_torchrun: bool) -> Result<(), Failure> {
    let launch = crate::built_target(&["build", "-p", "collectives", "--bin", "launch"], "launch")?;
    let threads =
        crate::built_target(&["build", "-p", "ddp-hooks", "--example", "train"], "train")?;
    let dist = crate::built_target(
        &["build", "-p", "ddp-hooks", "--example", "train_dist"],
        "train_dist",
    )?;
    own_loop(&launch)?;
    for ranks in [2, 3] {
        let reference = digest_of_threads(&threads, ranks, &[])?;
        let mut cmd = Command::new(&launch);
        cmd.args(["-n", &ranks.to_string(), "--timeout", "120", "--"])
            .arg(&dist)
            .args(train_args(&[]));
        let got = digest_of(cmd, ranks)?;
        verdict(&format!("launch -n {ranks} over TCP"), &reference, &got)?;
    }
    if !with_torchrun {
        return Ok(());
    }
    for ranks in [2, 4] {
        let reference = digest_of_threads(&threads, ranks, &[])?;
        let got = digest_of(torchrun(ranks, 0, &dist, &[]), ranks)?;
        verdict(
            &format!("torchrun --nproc-per-node {ranks}"),
            &reference,
            &got,
        )?;
    }
    // Two torchrun agents on this host playing two nodes, meeting through torchrun's c10d
    // rendezvous (as `--nnodes 2 --rdzv-backend c10d` across hosts), 2 workers each.
    let reference = digest_of_threads(&threads, 4, &[])?;
    let got = two_nodes(&dist)?;
    verdict(
        "torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d (two agents)",
        &reference,
        &got,
    )?;
    // The restart: rank 1 dies at step 25 of 60 on the first attempt; the agent restarts
    // the group, which resumes from step 20 (saved every 10) and ends as the
    // uninterrupted run does.
    let dir = scratch("torchrun-elastic")?;
    let elastic = [
        "--elastic",
        dir.to_str().ok_or("a non-UTF-8 target folder")?,
        "--save-every",
        "10",
        "--die-at",
        "25:1",
    ];
    let reference = digest_of_threads(&threads, 2, &[])?;
    let out = output(torchrun(2, 3, &dist, &elastic))?;
    let starts = started_at(&out);
    if !starts.contains(&20) {
        return Err(Failure(format!(
            "the restarted ranks did not resume from step 20 (starts seen: {starts:?}):\n{out}"
        )));
    }
    let got = digests(&out, 2)?;
    verdict(
        "torchrun --max-restarts 3, rank 1 killed (SIGKILL) at step 25",
        &reference,
        &got,
    )?;
    Ok(())
}

/// The user's guide's example (`own_loop --backend cpu`) on two processes of `launch`:
/// it trains (it fails itself otherwise), both ranks end with one model, and a run resumed
/// from its step-30 checkpoint ends with the same model as the run that saved it.
fn own_loop(launch: &Path) -> Result<(), Failure> {
    let exe = crate::built_target(
        &["build", "-p", "ddp-hooks", "--example", "own_loop"],
        "own_loop",
    )?;
    let dir = scratch("own-loop")?;
    let dir_arg = dir.to_str().ok_or("a non-UTF-8 target folder")?;
    let run = |extra: &[&str]| {
        let mut cmd = Command::new(launch);
        cmd.args(["-n", "2", "--timeout", "120", "--"])
            .arg(&exe)
            .args(["--backend", "cpu", "--steps", "60", "--checkpoint", dir_arg])
            .args(extra);
        output(cmd)
    };
    let whole = own_loop_digests(&run(&["--save-every", "30"])?)?;
    let resumed = own_loop_digests(&run(&["--resume"])?)?;
    if whole[0] != whole[1] || resumed != whole {
        return Err(Failure(format!(
            "own_loop: digests {whole:?} uninterrupted, {resumed:?} resumed from step 30"
        )));
    }
    println!(
        "torchrun suite: own_loop on launch -n 2, resumed from step 30: model digest {} on both ranks, as uninterrupted",
        whole[0]
    );
    Ok(())
}

/// The digests of `own_loop: rank R on ...: ..., digest D` lines, by rank (two ranks).
fn own_loop_digests(out: &str) -> Result<Vec<String>, Failure> {
    let mut by_rank = vec![None, None];
    for line in out
        .lines()
        .filter_map(|l| l.strip_prefix("own_loop: rank "))
    {
        let rank: Option<usize> = line.split_whitespace().next().and_then(|r| r.parse().ok());
        let digest = line
            .rsplit_once("digest ")
            .map(|(_, d)| d.trim().to_string());
        if let (Some(slot), Some(d)) = (rank.and_then(|r| by_rank.get_mut(r)), digest) {
            *slot = Some(d);
        }
    }
    by_rank
        .into_iter()
        .enumerate()
        .map(|(r, d)| {
            d.ok_or_else(|| Failure(format!("own_loop: rank {r} printed no digest:\n{out}")))
        })
        .collect()
}

/// Two `torchrun --nnodes 2 --rdzv-backend c10d` agents on loopback, 2 workers each: the
/// four ranks' digests.
fn two_nodes(exe: &Path) -> Result<Vec<String>, Failure> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let endpoint = format!("127.0.0.1:{port}");
    let agent = || {
        let mut cmd = Command::new("python3");
        cmd.args([
            "-m",
            "torch.distributed.run",
            "--no-python",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "xtask-two-nodes",
            "--monitor-interval",
            "0.5",
        ])
        .arg(exe)
        .args(train_args(&[]));
        cmd
    };
    let mut first = agent();
    first
        .current_dir(workspace_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    eprintln!("xtask: running {first:?} (node A, in the background)");
    let mut node_a = first.spawn()?;
    let node_b = output(agent());
    // Node A ends with node B (or within a minute of it); never waited for unbounded.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while node_a.try_wait()?.is_none() {
        if std::time::Instant::now() > deadline {
            let _ = node_a.kill();
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let a = node_a.wait_with_output()?;
    let a_text = format!(
        "{}{}",
        String::from_utf8_lossy(&a.stdout),
        String::from_utf8_lossy(&a.stderr)
    );
    let b_text = node_b?;
    if !a.status.success() {
        return Err(Failure(format!(
            "node A failed with {}:\n{a_text}",
            a.status
        )));
    }
    digests(&format!("{a_text}\n{b_text}"), 4)
}

/// `torchrun --no-python --standalone` with `ranks` workers running `exe`.
fn torchrun(ranks: usize, restarts: usize, exe: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "torch.distributed.run",
        "--no-python",
        "--standalone",
        "--nproc-per-node",
        &ranks.to_string(),
        "--max-restarts",
        &restarts.to_string(),
        "--monitor-interval",
        "0.5",
    ])
    .arg(exe)
    .args(train_args(extra));
    cmd
}

/// The example's arguments: the suite's run, then `extra`.
fn train_args(extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["--steps", &STEPS.to_string(), "--hook", HOOK]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// The digest of the same run on `ranks` thread ranks of one process.
fn digest_of_threads(exe: &Path, ranks: usize, extra: &[&str]) -> Result<String, Failure> {
    let mut cmd = Command::new(exe);
    cmd.args(train_args(extra))
        .args(["--ranks", &ranks.to_string(), "--json"]);
    let out = output(cmd)?;
    out.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find_map(|v| v["digest"].as_str().map(str::to_string))
        .ok_or_else(|| Failure(format!("the thread run printed no digest:\n{out}")))
}

/// Runs a multi-process training command and returns every rank's digest.
fn digest_of(cmd: Command, ranks: usize) -> Result<Vec<String>, Failure> {
    let out = output(cmd)?;
    digests(&out, ranks)
}

/// The digests in the `train_dist: rank R started at step S digest D` lines of the last
/// attempt, by rank; every rank must have printed one.
fn digests(out: &str, ranks: usize) -> Result<Vec<String>, Failure> {
    let mut by_rank = vec![None; ranks];
    for (rank, _, digest) in rank_lines(out) {
        if let Some(slot) = by_rank.get_mut(rank) {
            *slot = Some(digest);
        }
    }
    by_rank
        .into_iter()
        .enumerate()
        .map(|(r, d)| d.ok_or_else(|| Failure(format!("rank {r} printed no digest:\n{out}"))))
        .collect()
}

/// The steps the ranks of the successful attempt started from.
fn started_at(out: &str) -> Vec<usize> {
    rank_lines(out).map(|(_, start, _)| start).collect()
}

/// `(rank, start step, digest)` of each `train_dist: rank ...` line (torchrun may prefix
/// its workers' lines).
fn rank_lines(out: &str) -> impl Iterator<Item = (usize, usize, String)> + '_ {
    out.lines().filter_map(|line| {
        let rest = &line[line.find("train_dist: rank ")? + "train_dist: rank ".len()..];
        let words: Vec<&str> = rest.split_whitespace().collect();
        match words.as_slice() {
            [rank, "started", "at", "step", start, "digest", digest, ..] => {
                Some((rank.parse().ok()?, start.parse().ok()?, digest.to_string()))
            }
            _ => None,
        }
    })
}

/// Every rank's digest equal to the thread run's, or a failure naming the run.
fn verdict(run: &str, reference: &str, got: &[String]) -> Result<(), Failure> {
    if got.iter().all(|d| d == reference) {
        println!(
            "torchrun suite: {run}: {} ranks, model digest {reference}: bit-identical to thread ranks",
            got.len()
        );
        Ok(())
    } else {
        Err(Failure(format!(
            "{run}: digests {got:?}, thread ranks {reference}: the models differ"
        )))
    }
}

/// Runs `cmd` to completion in the workspace root, bounded by `timeout(1)`; its standard
/// output and error together, or a failure with both.
fn output(mut cmd: Command) -> Result<String, Failure> {
    cmd.current_dir(workspace_root());
    let shown = format!("{cmd:?}");
    eprintln!("xtask: running {shown}");
    let mut bounded = Command::new("timeout");
    bounded
        .args(["--kill-after=10", "300"])
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .current_dir(workspace_root());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => bounded.env(k, v),
            None => bounded.env_remove(k),
        };
    }
    let out = bounded
        .output()
        .map_err(|e| Failure(format!("could not start {shown}: {e}")))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(Failure(format!(
            "{shown} failed with {}:\n{text}",
            out.status
        )))
    }
}

/// A fresh, empty folder under the target folder.
fn scratch(name: &str) -> Result<PathBuf, Failure> {
    let dir = target_dir().join("tmp").join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_lines_are_read_with_or_without_torchrun_prefixes() {
        let out = "noise\n[default0]:train_dist: rank 0 started at step 20 digest 00ab\n\
                   train_dist: rank 1 started at step 0 digest 00cd\ntrain_dist: rank x";
        let lines: Vec<_> = rank_lines(out).collect();
        assert_eq!(
            lines,
            vec![(0, 20, "00ab".to_string()), (1, 0, "00cd".to_string())]
        );
        assert_eq!(digests(out, 2).unwrap(), vec!["00ab", "00cd"]);
        assert!(digests(out, 3).is_err(), "a silent rank is a failure");
        assert_eq!(started_at(out), vec![20, 0]);
    }

    #[test]
    fn a_different_digest_fails_the_verdict() {
        assert!(verdict("r", "a", &["a".into(), "a".into()]).is_ok());
        assert!(verdict("r", "a", &["a".into(), "b".into()]).is_err());
    }
}
