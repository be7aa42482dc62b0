//! A candle MLP trained data-parallel on 2 thread ranks, its gradients averaged by a
//! `ddp-hooks` hook through the candle adapter (`ddp_hooks::candle::CandleDdp`), checked
//! against the same model trained by candle alone on the concatenated batch.
//!
//! ```sh
//! cargo run --release -p ddp-hooks --features candle --example candle_ddp
//! ```
//!
//! Teacher-student regression: an MLP 16 -> 64 -> 64 -> 8 (tanh) learns a fixed random
//! teacher of the same shape from 4096 noisy samples; each rank takes 32 samples a step,
//! plain SGD, 2000 steps; candle's kernels run on one thread per rank (`RAYON_NUM_THREADS=1`).
//! Checks (the exit status is non-zero if one fails): with `allreduce` the final parameters
//! equal candle alone's within 1e-5 (max |a - b| / max |b|); with
//! `powersgd:rank=2,start_iter=10` the final loss is within 1% of candle alone's; and with
//! DiLoCo (`ddp_hooks::DiLoCo`, 20 local steps between outer Nesterov steps on the
//! all-reduced pseudo-gradient, 20x fewer synchronisations) every rank ends with the same
//! parameters bit for bit and the final loss is at most 10% above candle alone's.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Module, Result, Tensor, Var};
use collectives::{run_local, ProcessGroup};
use ddp_hooks::candle::CandleDdp;
use ddp_hooks::{DiLoCo, DiLoCoConfig, HookSpec};
use lowrank::NormalRng;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const WIDTHS: [usize; 4] = [16, 64, 64, 8];
const SAMPLES: usize = 4096;
const RANKS: usize = 2;
const BATCH: usize = 32; // per rank
const STEPS: usize = 2000;
const LR: f64 = 0.1;
const REPORT: usize = 250;

/// An MLP as candle ops; its vars in forward order (w1, b1, w2, b2, w3, b3).
struct Mlp {
    vars: Vec<Var>,
}

impl Mlp {
    /// Weights N(0, 1/fan_in), biases N(0, 0.01), from a seeded generator (candle's CPU
    /// generator cannot be seeded), so every rank and the reference start alike.
    fn new(seed: u64) -> Result<Mlp> {
        let mut rng = NormalRng::new(seed);
        let mut vars = Vec::new();
        for w in WIDTHS.windows(2) {
            let (fan_in, fan_out) = (w[0], w[1]);
            let mut weight = vec![0f32; fan_out * fan_in];
            rng.fill(&mut weight);
            weight.iter_mut().for_each(|v| *v /= (fan_in as f32).sqrt());
            let mut bias = vec![0f32; fan_out];
            rng.fill(&mut bias);
            bias.iter_mut().for_each(|v| *v *= 0.1);
            vars.push(Var::from_vec(weight, (fan_out, fan_in), &Device::Cpu)?);
            vars.push(Var::from_vec(bias, fan_out, &Device::Cpu)?);
        }
        Ok(Mlp { vars })
    }

    /// Mean squared error on a batch.
    fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        self.forward(x)?.sub(y)?.sqr()?.mean_all()
    }

    /// Plain SGD on the gradients in `grads`.
    fn sgd(&self, grads: &candle_core::backprop::GradStore) -> Result<()> {
        for var in &self.vars {
            if let Some(g) = grads.get(var) {
                var.set(&var.sub(&g.affine(LR, 0.0)?)?)?;
            }
        }
        Ok(())
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let layers = self.vars.len() / 2;
        let mut h = x.clone();
        for l in 0..layers {
            let (w, b) = (&self.vars[2 * l], &self.vars[2 * l + 1]);
            h = h.matmul(&w.t()?)?.broadcast_add(b)?;
            if l + 1 < layers {
                h = h.tanh()?;
            }
        }
        Ok(h)
    }
}

/// Inputs N(0, I), targets the teacher's outputs plus N(0, 0.1²) noise.
fn dataset() -> Result<(Tensor, Tensor)> {
    let teacher = Mlp::new(7)?;
    let mut rng = NormalRng::new(11);
    let mut x = vec![0f32; SAMPLES * WIDTHS[0]];
    rng.fill(&mut x);
    let x = Tensor::from_vec(x, (SAMPLES, WIDTHS[0]), &Device::Cpu)?;
    let mut noise = vec![0f32; SAMPLES * WIDTHS[3]];
    rng.fill(&mut noise);
    let noise = Tensor::from_vec(noise, (SAMPLES, WIDTHS[3]), &Device::Cpu)?.affine(0.1, 0.0)?;
    // Detached: the teacher's graph (its vars) must not be part of every step's backward.
    let y = teacher.forward(&x)?.add(&noise)?.detach();
    Ok((x, y))
}

/// Where step `step`'s global batch (`RANKS · BATCH` samples) starts.
fn offset(step: usize) -> usize {
    (step * RANKS * BATCH) % SAMPLES
}

/// What a run ends with: the loss on the whole data set every `REPORT` steps, and the final
/// parameters.
struct Run {
    curve: Vec<(usize, f32)>,
    params: Vec<Tensor>,
}

fn full_loss(model: &Mlp, x: &Tensor, y: &Tensor) -> Result<f32> {
    model.loss(x, y)?.to_scalar::<f32>()
}

/// The same model trained by candle alone, each step on the concatenation of the ranks'
/// batches.
fn alone(x: &Tensor, y: &Tensor) -> Result<Run> {
    let model = Mlp::new(1)?;
    let mut curve = Vec::new();
    for step in 0..STEPS {
        if step % REPORT == 0 {
            curve.push((step, full_loss(&model, x, y)?));
        }
        let s = offset(step);
        let (xb, yb) = (
            x.narrow(0, s, RANKS * BATCH)?,
            y.narrow(0, s, RANKS * BATCH)?,
        );
        let grads = model.loss(&xb, &yb)?.backward()?;
        model.sgd(&grads)?;
    }
    curve.push((STEPS, full_loss(&model, x, y)?));
    let params = model
        .vars
        .iter()
        .map(|v| v.as_tensor().copy())
        .collect::<Result<_>>()?;
    Ok(Run { curve, params })
}

/// Data parallel on thread ranks, gradients averaged by `spec`; rank 0's run.
fn ddp(spec: &HookSpec, x: &Tensor, y: &Tensor) -> Res<Run> {
    let runs = run_local(RANKS, |group| -> Res<Run> {
        let rank = group.rank();
        let model = Mlp::new(1)?;
        // The adapter: the model's vars (the same order on every rank) and the hook.
        let mut ddp = CandleDdp::from_spec(&model.vars, spec, Arc::new(group))?;
        let mut curve = Vec::new();
        for step in 0..STEPS {
            if step % REPORT == 0 && rank == 0 {
                curve.push((step, full_loss(&model, x, y)?));
            }
            let s = offset(step) + rank * BATCH;
            let (xb, yb) = (x.narrow(0, s, BATCH)?, y.narrow(0, s, BATCH)?);
            let mut grads = model.loss(&xb, &yb)?.backward()?;
            ddp.sync(&mut grads)?; // now the mean over the ranks
            model.sgd(&grads)?;
        }
        curve.push((STEPS, full_loss(&model, x, y)?));
        let params = model
            .vars
            .iter()
            .map(|v| v.as_tensor().copy())
            .collect::<Result<_>>()?;
        Ok(Run { curve, params })
    })?;
    runs.into_iter().next().ok_or("no rank ran")??
}

/// DiLoCo on thread ranks: each rank takes plain SGD steps on its own batches, and every
/// `inner` steps `DiLoCo` averages the pseudo-gradient (through an all-reduce hook) and
/// takes the outer Nesterov step. Candle's vars cross as flat `f32` slices. Every rank's
/// run (the curves are rank 0's).
fn diloco(inner: u64, x: &Tensor, y: &Tensor) -> Res<Vec<Run>> {
    let runs = run_local(RANKS, |group| -> Res<Run> {
        let rank = group.rank();
        let model = Mlp::new(1)?;
        let shapes: Vec<Vec<usize>> = model.vars.iter().map(|v| v.dims().to_vec()).collect();
        let read = |model: &Mlp| -> Result<Vec<Vec<f32>>> {
            model
                .vars
                .iter()
                .map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>())
                .collect()
        };
        let start = read(&model)?;
        let views: Vec<&[f32]> = start.iter().map(Vec::as_slice).collect();
        let backend = Arc::new(lowrank::CpuBackend::new());
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let hook = HookSpec::AllReduce.build(backend.clone(), group.clone())?;
        let config = DiLoCoConfig {
            inner_steps: inner,
            timeout: group.timeout(),
            ..DiLoCoConfig::default()
        };
        let mut outer = DiLoCo::with_shapes(config, hook, backend, &views, &shapes)?;
        let mut curve = Vec::new();
        for step in 0..STEPS {
            if step % REPORT == 0 && rank == 0 {
                curve.push((step, full_loss(&model, x, y)?));
            }
            let s = offset(step) + rank * BATCH;
            let (xb, yb) = (x.narrow(0, s, BATCH)?, y.narrow(0, s, BATCH)?);
            model.sgd(&model.loss(&xb, &yb)?.backward()?)?;
            let mut params = read(&model)?;
            let mut slices: Vec<&mut [f32]> = params.iter_mut().map(Vec::as_mut_slice).collect();
            if outer.step(&mut slices)? {
                // The outer step replaced the parameters: back into candle's vars.
                for ((var, p), shape) in model.vars.iter().zip(params).zip(&shapes) {
                    var.set(&Tensor::from_vec(p, shape.as_slice(), &Device::Cpu)?)?;
                }
            }
        }
        curve.push((STEPS, full_loss(&model, x, y)?));
        let params = model
            .vars
            .iter()
            .map(|v| v.as_tensor().copy())
            .collect::<Result<_>>()?;
        Ok(Run { curve, params })
    })?;
    // Per rank: the thread's outcome (a panic), then the run's.
    runs.into_iter().map(|r| r?).collect()
}

/// `max |a - b| / max |b|` over every parameter.
fn rel_diff(a: &[Tensor], b: &[Tensor]) -> Result<f32> {
    let (mut diff, mut scale) = (0f32, f32::MIN_POSITIVE);
    for (a, b) in a.iter().zip(b) {
        diff = diff.max(a.sub(b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
        scale = scale.max(b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
    }
    Ok(diff / scale)
}

fn print_curve(name: &str, run: &Run, took: std::time::Duration) {
    let points: Vec<String> = run
        .curve
        .iter()
        .map(|(step, loss)| format!("{step}: {loss:.5}"))
        .collect();
    println!(
        "{name:<30} loss {} [{:.1}s]",
        points.join("  "),
        took.as_secs_f64()
    );
}

fn main() -> Res<()> {
    // Each rank is a thread busy with candle's kernels: one thread each for those kernels
    // (rayon's pool reads this when it starts, so set it before candle is first used).
    std::env::set_var("RAYON_NUM_THREADS", "1");
    let (x, y) = dataset()?;
    println!(
        "MLP {WIDTHS:?}, {SAMPLES} samples, {RANKS} ranks x batch {BATCH}, {STEPS} steps, SGD lr {LR}"
    );
    let t = Instant::now();
    let reference = alone(&x, &y)?;
    print_curve("candle alone (batch 64)", &reference, t.elapsed());
    let final_loss = |run: &Run| run.curve.last().map_or(f32::NAN, |(_, l)| *l);
    let mut failed = false;

    let t = Instant::now();
    let allreduce = ddp(&HookSpec::AllReduce, &x, &y)?;
    print_curve("allreduce", &allreduce, t.elapsed());
    let diff = rel_diff(&allreduce.params, &reference.params)?;
    let ok = diff <= 1e-5;
    failed |= !ok;
    println!(
        "check allreduce: final parameters vs candle alone: max|a-b|/max|b| = {diff:.2e} (<= 1e-5: {})",
        if ok { "ok" } else { "FAILED" }
    );

    let spec: HookSpec = "powersgd:rank=2,start_iter=10".parse()?;
    let t = Instant::now();
    let powersgd = ddp(&spec, &x, &y)?;
    print_curve("powersgd:rank=2,start_iter=10", &powersgd, t.elapsed());
    let (got, want) = (final_loss(&powersgd), final_loss(&reference));
    let ok = (got / want - 1.0).abs() <= 0.01;
    failed |= !ok;
    // Lossy compression: the parameters differ from the exact mean's, the loss does not.
    let drift = rel_diff(&powersgd.params, &reference.params)?;
    println!(
        "check powersgd: final loss {got:.5} vs candle alone {want:.5}: {:+.2}% (within 1%: {}); parameters differ by {drift:.2e}",
        100.0 * (got / want - 1.0),
        if ok { "ok" } else { "FAILED" }
    );

    let inner = 20;
    let t = Instant::now();
    let runs = diloco(inner, &x, &y)?;
    print_curve(
        &format!("diloco:H={inner} (allreduce)"),
        &runs[0],
        t.elapsed(),
    );
    let same = runs[1..]
        .iter()
        .all(|r| rel_diff(&r.params, &runs[0].params).is_ok_and(|d| d == 0.0));
    let (got, want) = (final_loss(&runs[0]), final_loss(&reference));
    let ok = same && got <= 1.1 * want;
    failed |= !ok;
    println!(
        "check diloco: every rank's final parameters equal: {same}; final loss {got:.5} vs candle alone {want:.5}: {:+.2}% (at most 10% above: {}); {}x fewer synchronisations",
        100.0 * (got / want - 1.0),
        if ok { "ok" } else { "FAILED" },
        inner
    );
    if failed {
        return Err("a check failed".into());
    }
    Ok(())
}
