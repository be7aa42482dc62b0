//! `cargo xtask gpu-check`: builds what a GPU machine runs, into one folder.
//!
//! The GPU machines here have the CUDA libraries but no Rust toolchain, so the CUDA test
//! binaries and benchmarks are built here (release, `--features cuda`, stripped so the
//! folder stays well under the 64 MiB that may travel), next to `run.sh`, which there:
//! checks that a binary built here starts, finds the driver, cuBLAS, NVRTC and NCCL
//! (system folders and the Python packages' `nvidia/*/lib`), runs everything and prints a
//! summary, a line per check (`pipe::cuda`'s suite, example and bench among them). The
//! folder also carries `torch_hooks.py` (PyTorch's `powerSGD_hook` on the
//! shapes of the `cuda_hooks` bench: the reference the GPU figures are compared with)
//! and the CPU compression report (`ddp-hooks/benches/report.rs`, run with `--quick`;
//! its JSON lines go to `$OUT/report.jsonl`, where `cargo xtask bench` would draw them). `run.sh` takes its
//! options from the environment: `GPU_CHECK_LIMIT` (seconds a step may run),
//! `GPU_CHECK_SANITIZE=1` (the CUDA tests again under compute-sanitizer's memcheck),
//! `GPU_CHECK_PROFILE=preset:rank:path` (an `ncu` time of every kernel of that
//! `cuda_hooks` row), `GPU_CHECK_REPORT=0` (no CPU report).

use crate::{cargo, on_path, workspace_root, Failure};
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// Binaries to ship: (cargo target kind, target name, file name in the folder).
const WANTED: &[(&str, &str, &str)] = &[
    ("test", "primitives", "lowrank-primitives-test"),
    ("bench", "cuda", "lowrank-cuda-bench"),
    ("test", "cuda", "ddp-hooks-cuda-test"),
    ("test", "nccl", "collectives-nccl-test"),
    ("test", "threads_cuda", "collectives-threads-cuda-test"),
    ("bench", "cuda_hooks", "ddp-hooks-cuda-hooks-bench"),
    ("bench", "report", "ddp-hooks-report-bench"),
    ("test", "cuda_pipe", "pipe-cuda-test"),
    ("bench", "cuda_pipe", "pipe-cuda-bench"),
    ("example", "cuda_two_streams", "pipe-cuda-example"),
];

const RUN_SH: &str = include_str!("gpu_check_run.sh");

/// PyTorch's hook on the same shapes, run by `run.sh` with the machine's Python.
const TORCH_PY: &str = include_str!("gpu_check_torch.py");

pub fn run(args: &[String]) -> Result<(), Failure> {
    if let Some(a) = args.first() {
        return Err(Failure(format!(
            "`gpu-check` takes no arguments, got `{a}`"
        )));
    }
    let out_dir = workspace_root().join("gpu-check");
    let built = build()?;
    if out_dir.exists() {
        std::fs::remove_dir_all(&out_dir)?;
    }
    std::fs::create_dir_all(&out_dir)?;
    let mut total = 0u64;
    for (kind, name, file) in WANTED {
        let src = built
            .iter()
            .find(|(k, n, _)| k == kind && n == name)
            .map(|(_, _, p)| p)
            .ok_or_else(|| Failure(format!("cargo built no {kind} target `{name}`")))?;
        let dst = out_dir.join(file);
        std::fs::copy(src, &dst)?;
        strip(&dst);
        total += std::fs::metadata(&dst)?.len();
    }
    for (file, text) in [("run.sh", RUN_SH), ("torch_hooks.py", TORCH_PY)] {
        let script = out_dir.join(file);
        std::fs::write(&script, text)?;
        set_executable(&script)?;
        total += text.len() as u64;
    }
    println!(
        "gpu-check: {} ({:.1} MiB in all)",
        out_dir.display(),
        total as f64 / (1 << 20) as f64
    );
    println!("on a GPU machine, from the repository root: bash gpu-check/run.sh");
    if total > 60 << 20 {
        return Err(Failure(
            "the folder is over 60 MiB; it may not travel".into(),
        ));
    }
    Ok(())
}

/// Builds the CUDA tests and benchmarks; returns (kind, name, executable) of each.
fn build() -> Result<Vec<(String, String, PathBuf)>, Failure> {
    let output = cargo(&[
        "build",
        "--release",
        "-p",
        "lowrank",
        "-p",
        "ddp-hooks",
        "-p",
        "collectives",
        "-p",
        "pipe",
        "--features",
        "lowrank/cuda,ddp-hooks/cuda,collectives/cuda,pipe/cuda",
        "--test",
        "nccl",
        "--test",
        "threads_cuda",
        "--test",
        "primitives",
        "--test",
        "cuda",
        "--bench",
        "cuda",
        "--bench",
        "cuda_hooks",
        "--bench",
        "report",
        "--test",
        "cuda_pipe",
        "--bench",
        "cuda_pipe",
        "--example",
        "cuda_two_streams",
        "--message-format=json-render-diagnostics",
    ])
    .stderr(Stdio::inherit())
    .output()?;
    if !output.status.success() {
        return Err(Failure("the CUDA build failed".into()));
    }
    let mut built = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        for kind in msg["target"]["kind"].as_array().into_iter().flatten() {
            built.push((
                kind.as_str().unwrap_or_default().to_string(),
                name.to_string(),
                PathBuf::from(exe),
            ));
        }
    }
    Ok(built)
}

/// Strips symbols when `strip` is installed (binutils); otherwise keeps the file whole.
fn strip(path: &Path) {
    if on_path("strip") {
        let _ = std::process::Command::new("strip").arg(path).status();
    }
}

#[cfg(unix)]
fn set_executable(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}

#[cfg(not(unix))]
fn set_executable(_: &Path) -> std::io::Result<()> {
    Ok(())
}
