//! `cargo xtask sanitize` and `cargo xtask loom`: the proofs behind the `SAFETY:`
//! comments of the thread backend and the CPU kernels.
//!
//! - `sanitize`: the `collectives`, `lowrank` and `pipe` tests (the latter for its AVX-512
//!   matrix kernel) under AddressSanitizer, which needs
//!   the nightly toolchain (`-Zsanitizer=address`). Where nightly is not installed it says
//!   so and skips; `.ci/run` runs it where nightly is present.
//! - `loom`: the loom models of the thread backend's rendezvous and of work handles
//!   (`--cfg loom`, stable toolchain, a separate target directory so the normal build is
//!   not invalidated).

use crate::{cargo, run_status, workspace_root, Failure};
use std::process::Command;

/// Whether `rustup` has a nightly toolchain.
fn nightly_installed() -> bool {
    Command::new("rustup")
        .args(["run", "nightly", "rustc", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// The host target triple, from `rustc -vV`.
fn host_triple() -> Result<String, Failure> {
    let out = Command::new("rustc")
        .arg("-vV")
        .output()
        .map_err(|e| Failure(format!("could not run rustc -vV: {e}")))?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .ok_or_else(|| Failure("rustc -vV printed no host triple".into()))
}

pub fn sanitize(args: &[String]) -> Result<(), Failure> {
    if let Some(a) = args.first() {
        return Err(Failure(format!("`sanitize` takes no arguments, got `{a}`")));
    }
    if !nightly_installed() {
        println!(
            "skipped: AddressSanitizer run (needs the nightly toolchain: rustup toolchain install nightly)"
        );
        return Ok(());
    }
    let target = host_triple()?;
    let target_dir = workspace_root().join("target").join("asan");
    // An explicit --target keeps build scripts and proc macros uninstrumented.
    let mut cmd = Command::new("rustup");
    cmd.args([
        "run",
        "nightly",
        "cargo",
        "test",
        "-p",
        "collectives",
        "-p",
        "lowrank",
        "-p",
        "pipe",
        "--lib",
        "--tests",
        "--target",
        &target,
    ])
    .arg("--target-dir")
    .arg(&target_dir)
    .current_dir(workspace_root())
    .env("RUSTFLAGS", "-Zsanitizer=address")
    .env("RUSTDOCFLAGS", "-Zsanitizer=address")
    .env("ASAN_OPTIONS", "detect_leaks=0");
    run_status(cmd)?;
    println!("xtask sanitize: collectives, lowrank and pipe tests clean under AddressSanitizer");
    Ok(())
}

pub fn loom(args: &[String]) -> Result<(), Failure> {
    if let Some(a) = args.first() {
        return Err(Failure(format!("`loom` takes no arguments, got `{a}`")));
    }
    let target_dir = workspace_root().join("target").join("loom");
    let mut cmd = cargo(&[
        "test",
        "-p",
        "collectives",
        "--lib",
        "--release",
        "--target-dir",
    ]);
    cmd.arg(&target_dir)
        .args(["--", "loom_model"])
        .env("RUSTFLAGS", "--cfg loom")
        .env("LOOM_MAX_PREEMPTIONS", "3");
    run_status(cmd)?;
    println!("xtask loom: the rendezvous and work-handle models passed");
    Ok(())
}
