//! PowerSGD on CUDA buckets through NCCL, the device path against the staged path and the
//! HBM traffic bound (issue 17). Built by `cargo xtask gpu-check`, run on a GPU machine by
//! `gpu-check/run.sh` next to PyTorch's `powerSGD_hook` on the same shapes.
//!
//! On GPU 0, per preset (4 x Linear(1024, 1024), BERT-base, GPT-2 small) and PowerSGD rank
//! (1, 2, 4), through the [`Reducer`] with DDP's bucket sizes (1 MiB first, then 25 MiB):
//!
//! - a **step** is: copy each parameter's precomputed device gradient into its bucket view
//!   and mark it ready, in reverse order (as a backward pass produces them), then
//!   `finish` (which waits for the device). The **hook time** is the median step with
//!   PowerSGD minus the median step with the [`Noop`] hook (which leaves the copies and
//!   the reducer's own work);
//! - **paths**: `device`, an NCCL group of one rank that reduces device buffers in place
//!   (`device_native`); `staged`, the same group behind a wrapper that keeps the trait's
//!   default device methods, so every collective goes device → host → NCCL → host →
//!   device; both with the CUDA defaults ([`PowerSgdConfig::default_for`]: same-shape
//!   tensors batched). `device-by-shape` is the device path with the buckets laid out by
//!   shape (`BucketLayout::ByShape`: every batch read in place, no stacking copies);
//!   `device-unbatched` is the device path with batching off (PyTorch's default), for
//!   reference;
//! - the **bound**: 28 bytes of device memory traffic per compressed element (the fused
//!   algorithm's 7 passes of 4 bytes, `measure::BOUND_PASSES`) at the device copy
//!   bandwidth measured first (a 1 GiB device-to-device copy, read plus write).
//!   `bound_ratio` is the hook time over it.
//!
//! Output: a table, then one JSON object per row on stdout (`device`, the GPU's name;
//! `hook`, always `powersgd`; `preset`, `rank`, `path`, `hook_ms`, `bound_ms`,
//! `bound_ratio`, and `step_ms`, `noop_ms`, `compressed_elements`, `copy_gbps`), also
//! written to `$OUT/cuda_hooks.jsonl` when `OUT` is set (`gpu-check/run.sh` sets it to
//! `gpu-check/out`): the file `cargo xtask bench --gpu-report FILE` merges into the
//! compression report (`xtask/src/bench/gpu.rs`). Without a CUDA driver or NCCL it prints one `skipped: ...` line and exits 0.
//!
//! For a profiler (`ncu`), `CUDA_HOOKS_ONLY=preset:rank:path` (each part may be empty
//! for all, e.g. `bert-base:1:device`) measures only the matching rows, and
//! `CUDA_HOOKS_STEPS=n` times `n` steps a row instead of 20.
//!
//! At world size 1, NCCL's all-reduce moves no data between GPUs: the hook time is the
//! compression's device work and the host's part (launches, waits, staging), which is
//! what the device path removes.

#[path = "measure/mod.rs"]
mod measure;
#[path = "models/mod.rs"]
mod models;

use collectives::nccl::{NcclGroup, NcclId};
use collectives::{ProcessGroup, ReduceOp, Work};
use cudarc::driver::CudaSlice;
use ddp_hooks::{
    BucketLayout, CommHook, Layout, Noop, PowerSgd, PowerSgdConfig, Reducer, ReducerConfig,
};
use lowrank::{Backend, CudaBackend};
use serde_json::json;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// PowerSGD ranks measured.
const RANKS: [usize; 3] = [1, 2, 4];
/// Steps before timing: PowerSGD starts at step 2 (`START_ITER`) and its first
/// compressed step allocates its memory.
const WARMUP: usize = 5;
/// PowerSGD's `start_powersgd_iter`: the smallest that error feedback allows.
const START_ITER: u64 = 2;
/// Timed steps per configuration (`CUDA_HOOKS_STEPS` overrides it).
const STEPS: usize = 20;

/// The timed steps a row: [`STEPS`], or `CUDA_HOOKS_STEPS` when set to a positive count.
fn steps() -> usize {
    std::env::var("CUDA_HOOKS_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(STEPS)
}

/// Whether `CUDA_HOOKS_ONLY` (`preset:rank:path`, empty parts match all) lets a row run.
fn selected(preset: &str, rank: Option<usize>, path: Option<&str>) -> bool {
    let Ok(only) = std::env::var("CUDA_HOOKS_ONLY") else {
        return true;
    };
    let mut parts = only.split(':');
    let part = |p: Option<&str>| p.filter(|s| !s.is_empty()).map(str::to_string);
    let (want_preset, want_rank, want_path) =
        (part(parts.next()), part(parts.next()), part(parts.next()));
    want_preset.is_none_or(|w| w == preset)
        && rank.zip(want_rank).is_none_or(|(r, w)| w == r.to_string())
        && path.zip(want_path).is_none_or(|(p, w)| w == p)
}
/// Bytes of the bandwidth probe's source (and destination).
const COPY_BYTES: usize = 1 << 30;
/// A preset's parameter shapes, in forward order.
type Shapes = fn() -> Vec<Vec<usize>>;
/// The presets, by the names the report uses.
const PRESETS: [(&str, Shapes); 3] = [
    ("linear4x1024", models::linear4),
    ("bert-base", models::bert_base),
    ("gpt2-small", models::gpt2_small),
];

/// What can stop the bench (other than a missing GPU or NCCL, which skip it).
#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("CUDA backend: {0}")]
    Cuda(#[from] lowrank::Error),
    #[error("reducer or hook: {0}")]
    Hooks(#[from] ddp_hooks::Error),
    #[error("NCCL group: {0}")]
    Group(#[from] collectives::Error),
    #[error("preset {0} has {1} parameters, not the published count")]
    Preset(&'static str, usize),
}

/// The NCCL group with the trait's default device methods: every device collective is
/// staged through host memory (`collectives::device::staged`), as on a backend that
/// cannot take device buffers. Everything else is forwarded.
struct Staged(Arc<NcclGroup>);

collectives::forward_group! {
    impl ProcessGroup for Staged {
        inner: |s| &*s.0;
        fn backend(&self) -> &'static str {
            "nccl-staged"
        }
        fn device_native(&self) -> bool {
            false
        }
        // Staged through host memory, as the trait's defaults do: not NCCL's device path.
        fn all_reduce_device(
            &self,
            buf: collectives::device::DeviceBuffer,
            op: ReduceOp,
        ) -> Work<collectives::device::DeviceBuffer> {
            collectives::device::staged(buf, |b| self.0.all_reduce(b, op))
        }
        fn broadcast_device(
            &self,
            buf: collectives::device::DeviceBuffer,
            root: usize,
        ) -> Work<collectives::device::DeviceBuffer> {
            collectives::device::staged(buf, |b| self.0.broadcast(b, root))
        }
    }
}

/// Device-to-device copy bandwidth (bytes/s, read plus write): the median of 10 copies of
/// [`COPY_BYTES`].
fn copy_bandwidth(be: &CudaBackend) -> Result<f64, BenchError> {
    let src = be.alloc::<f32>(COPY_BYTES / 4)?;
    let mut dst = be.alloc::<f32>(COPY_BYTES / 4)?;
    let mut times = Vec::new();
    for i in 0..11 {
        be.synchronize()?;
        let t = Instant::now();
        be.copy(
            CudaBackend::view(&src, ..)?,
            CudaBackend::view_mut(&mut dst, ..)?,
        )?;
        be.synchronize()?;
        // The first copy warms up (context, pages) and is not counted.
        if i > 0 {
            times.push(t.elapsed());
        }
    }
    Ok(2.0 * COPY_BYTES as f64 / measure::median(times).as_secs_f64())
}

/// Elements of the tensors PowerSGD compresses at `rank`: the hook's own test on each
/// tensor's matrix view ([`ddp_hooks::ParamSlot::matrix`]), compress iff
/// `(n + m) · min(n, m, rank) · min_compression_rate < n · m`.
fn compressed_elements(shapes: &[Vec<usize>], rank: usize, rate: f64) -> Result<usize, BenchError> {
    let layout = Layout::packed(shapes)?;
    Ok(layout
        .params()
        .iter()
        .filter(|slot| {
            let (n, m) = slot.matrix();
            let r = n.min(m).min(rank);
            r > 0 && ((n + m) * r) as f64 * rate < (n * m) as f64
        })
        .map(|slot| slot.len)
        .sum())
}

/// The timed steps (after [`WARMUP`]) of `hook` through a reducer with DDP's buckets,
/// laid out as `layout`.
fn step_times(
    be: &Arc<CudaBackend>,
    shapes: &[Vec<usize>],
    grads: &[CudaSlice<f32>],
    hook: Box<dyn CommHook<CudaBackend>>,
    layout: BucketLayout,
) -> Result<Vec<Duration>, BenchError> {
    let config = ReducerConfig {
        layout,
        ..ReducerConfig::default()
    };
    let mut reducer = Reducer::new(be.clone(), shapes, hook, config)?;
    let steps = steps();
    let mut times = Vec::with_capacity(WARMUP + steps);
    for _ in 0..WARMUP + steps {
        be.synchronize()?;
        let t = Instant::now();
        for p in (0..shapes.len()).rev() {
            be.copy(CudaBackend::view(&grads[p], ..)?, reducer.grad_mut(p)?)?;
            reducer.mark_ready(p)?;
        }
        // `finish` waits for every bucket and then for the device.
        reducer.finish()?;
        times.push(t.elapsed());
    }
    Ok(times.split_off(WARMUP))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn round(x: f64, digits: i32) -> f64 {
    let s = 10f64.powi(digits);
    (x * s).round() / s
}

/// Where the rows go: `$OUT/cuda_hooks.jsonl` as each is measured (so a run that fails
/// later keeps them), and stdout after the table.
struct Rows {
    lines: Vec<String>,
    file: Option<(std::path::PathBuf, std::fs::File)>,
}

impl Rows {
    fn new() -> Rows {
        let file = std::env::var_os("OUT")
            .filter(|d| !d.is_empty())
            .map(|d| std::path::Path::new(&d).join("cuda_hooks.jsonl"))
            .and_then(|path| match std::fs::File::create(&path) {
                Ok(f) => Some((path, f)),
                Err(e) => {
                    eprintln!("cuda_hooks: cannot write {}: {e}", path.display());
                    None
                }
            });
        Rows {
            lines: Vec::new(),
            file,
        }
    }

    fn push(&mut self, row: serde_json::Value) {
        let line = row.to_string();
        if let Some((path, f)) = &mut self.file {
            if let Err(e) = writeln!(f, "{line}").and_then(|_| f.flush()) {
                eprintln!("cuda_hooks: cannot write {}: {e}", path.display());
            }
        }
        self.lines.push(line);
    }

    fn print(&self) {
        for l in &self.lines {
            println!("{l}");
        }
        if let Some((path, _)) = &self.file {
            println!("wrote {} ({} rows)", path.display(), self.lines.len());
        }
    }
}

/// A measured configuration: its name, its group, whether same-shape tensors are
/// batched, and the reducer's bucket layout.
type Path = (&'static str, Arc<dyn ProcessGroup>, bool, BucketLayout);

/// One preset: its gradients on the device, the noop baseline, then every rank and path.
/// A configuration that fails is reported and the others still run; returns the number
/// that failed.
fn preset(
    be: &Arc<CudaBackend>,
    paths: &[Path],
    base: &PowerSgdConfig,
    bw: f64,
    (name, shapes): (&'static str, Vec<Vec<usize>>),
    rows: &mut Rows,
) -> Result<usize, BenchError> {
    if !selected(name, None, None) {
        return Ok(0);
    }
    let count = models::params(&shapes);
    if !models::PUBLISHED.contains(&(name, count)) {
        return Err(BenchError::Preset(name, count));
    }
    let grads = measure::synthetic(&shapes, 0)
        .iter()
        .map(|g| be.upload(g))
        .collect::<Result<Vec<_>, _>>()?;
    let noop = measure::median(step_times(
        be,
        &shapes,
        &grads,
        Box::new(Noop::new()),
        BucketLayout::Launch,
    )?);
    let mut failed = 0;
    for rank in RANKS {
        let elements = compressed_elements(&shapes, rank, base.min_compression_rate)?;
        let bound_ms = measure::BOUND_PASSES * 4.0 * elements as f64 / bw * 1e3;
        for (path, pg, batch, layout) in paths {
            if !selected(name, Some(rank), Some(path)) {
                continue;
            }
            let config = PowerSgdConfig {
                matrix_approximation_rank: rank,
                start_powersgd_iter: START_ITER,
                batch_tensors_with_same_shape: Some(*batch),
                ..base.clone()
            };
            let step = PowerSgd::new(be.clone(), pg.clone(), config)
                .map_err(BenchError::from)
                .and_then(|hook| step_times(be, &shapes, &grads, Box::new(hook), *layout));
            let step = match step {
                Ok(times) => measure::median(times),
                Err(e) => {
                    eprintln!("cuda_hooks: {name} r{rank} {path}: {e}");
                    failed += 1;
                    continue;
                }
            };
            let hook_ms = ms(step) - ms(noop);
            println!(
                "{name:<14} {rank:>2} {path:<17} {:>9.3} {:>9.3} {hook_ms:>9.3} {bound_ms:>9.3} {:>7.2}",
                ms(step),
                ms(noop),
                hook_ms / bound_ms
            );
            rows.push(json!({
                "device": be.name(),
                "hook": "powersgd",
                "preset": name,
                "rank": rank,
                "path": path,
                "hook_ms": round(hook_ms, 4),
                "bound_ms": round(bound_ms, 4),
                "bound_ratio": round(hook_ms / bound_ms, 3),
                "step_ms": round(ms(step), 4),
                "noop_ms": round(ms(noop), 4),
                "compressed_elements": elements,
                "copy_gbps": round(bw / 1e9, 1),
            }));
        }
    }
    Ok(failed)
}

/// Every preset; returns whether all of them measured every configuration.
fn run(be: Arc<CudaBackend>, group: Arc<NcclGroup>, rows: &mut Rows) -> bool {
    let started = Instant::now();
    println!("device: {}", be.name());
    let bw = match copy_bandwidth(&be) {
        Ok(bw) => bw,
        Err(e) => {
            eprintln!("cuda_hooks: the copy bandwidth: {e}");
            return false;
        }
    };
    println!(
        "device copy bandwidth: {:.0} GB/s (1 GiB device-to-device, read + write)",
        bw / 1e9
    );
    println!(
        "{:<14} {:>2} {:<17} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "preset", "r", "path", "step ms", "noop ms", "hook ms", "bound ms", "ratio"
    );
    let base = PowerSgdConfig::default_for(&*be);
    let batch = base.batches_with(&*be);
    let paths: [Path; 4] = [
        ("device", group.clone(), batch, BucketLayout::Launch),
        (
            "staged",
            Arc::new(Staged(group.clone())),
            batch,
            BucketLayout::Launch,
        ),
        (
            "device-by-shape",
            group.clone(),
            batch,
            BucketLayout::ByShape,
        ),
        ("device-unbatched", group, false, BucketLayout::Launch),
    ];
    let mut ok = true;
    for (name, shapes) in PRESETS {
        match preset(&be, &paths, &base, bw, (name, shapes()), rows) {
            Ok(0) => {}
            Ok(_) => ok = false,
            Err(e) => {
                eprintln!("cuda_hooks: {name}: {e}");
                ok = false;
            }
        }
    }
    println!(
        "cuda_hooks: {} steps per row after {WARMUP} warm-up, medians; {:.0} s in all",
        steps(),
        started.elapsed().as_secs_f64()
    );
    ok
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken.
    if let Some(a) = std::env::args().skip(1).find(|a| a != "--bench") {
        eprintln!("cuda_hooks: unknown argument `{a}` (it takes none)");
        std::process::exit(2);
    }
    let be = match CudaBackend::new(0) {
        Ok(be) => Arc::new(be),
        Err(lowrank::Error::CudaUnavailable(why)) => {
            println!("skipped: no CUDA driver ({why})");
            return;
        }
        Err(e) => {
            eprintln!("cuda_hooks: CUDA present but failed to start: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = collectives::nccl::check_libraries() {
        println!("skipped: NCCL unavailable ({e})");
        return;
    }
    let group =
        match NcclId::new().and_then(|id| NcclGroup::new(0, 1, 0, id, Duration::from_secs(120))) {
            Ok(g) => Arc::new(g),
            Err(e) => {
                eprintln!("cuda_hooks: NCCL present but the group failed: {e}");
                std::process::exit(1);
            }
        };
    let mut rows = Rows::new();
    let ok = run(be, group, &mut rows);
    rows.print();
    if !ok {
        std::process::exit(1);
    }
}
