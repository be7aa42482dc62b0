//! A burn MLP trained data-parallel on 2 thread ranks, its gradients averaged by a
//! `ddp-hooks` hook through the burn adapter (`ddp_hooks::burn::BurnDdp`), checked
//! against the same model trained by burn alone on the concatenated batch.
//!
//! ```sh
//! cargo run --release -p ddp-hooks --features burn --example burn_ddp
//! ```
//!
//! Teacher-student regression: a burn module (`#[derive(Module)]`, 16 -> 32 -> 8, tanh)
//! learns a fixed teacher of the same shape from 2048 samples; each rank takes 32 samples
//! a step, burn's own SGD (`burn_optim::SgdConfig`), 300 steps, on burn's `NdArray`
//! backend under `Autodiff`. Rank 1 starts from other weights, and
//! `BurnDdp::broadcast_parameters` gives it rank 0's. Checks (the exit status is non-zero
//! if one fails): with `allreduce` the final parameters equal burn alone's within 1e-6
//! (max |a - b| / max |b|); with `powersgd:rank=2,start_iter=10` the final loss is within
//! 1% of allreduce's.

use std::sync::Arc;
use std::time::Instant;

use burn_core as burn;
use burn_core::module::{Module, Param};
use burn_core::tensor::backend::Backend;
use burn_core::tensor::{Tensor, TensorData};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collectives::{run_local, ProcessGroup};
use ddp_hooks::burn::{BurnDdp, CpuAutodiff};
use ddp_hooks::HookSpec;

type Res<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;
type Ad = CpuAutodiff;

const IN: usize = 16;
const HIDDEN: usize = 32;
const OUT: usize = 8;
const SAMPLES: usize = 2048;
const RANKS: usize = 2;
const BATCH: usize = 32; // per rank
const STEPS: usize = 300;
const LR: f64 = 0.1;

/// `y = tanh(x w1 + b1) w2 + b2`.
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    w1: Param<Tensor<B, 2>>,
    b1: Param<Tensor<B, 1>>,
    w2: Param<Tensor<B, 2>>,
    b2: Param<Tensor<B, 1>>,
}

impl<B: Backend> Mlp<B> {
    fn new(salt: usize, device: &B::Device) -> Self {
        let p2 = |rows: usize, cols: usize, s: usize| {
            let scale = 1.0 / (rows as f32).sqrt();
            let v = values(rows * cols, s).iter().map(|x| x * scale).collect();
            Param::from_tensor(Tensor::from_data(TensorData::new(v, [rows, cols]), device))
        };
        let p1 = |n: usize, s: usize| {
            let v = values(n, s).iter().map(|x| 0.1 * x).collect();
            Param::from_tensor(Tensor::from_data(TensorData::new(v, [n]), device))
        };
        Mlp {
            w1: p2(IN, HIDDEN, salt),
            b1: p1(HIDDEN, salt + 1),
            w2: p2(HIDDEN, OUT, salt + 2),
            b2: p1(OUT, salt + 3),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = (x.matmul(self.w1.val()) + self.b1.val().unsqueeze::<2>()).tanh();
        h.matmul(self.w2.val()) + self.b2.val().unsqueeze::<2>()
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        (self.forward(x) - y).powi_scalar(2).mean()
    }
}

/// Deterministic values in about [-1, 1).
fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|k| {
            let h = (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((salt as u64) << 32);
            let h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Inputs and the teacher's outputs, `SAMPLES` rows each.
fn dataset() -> (Vec<f32>, Vec<f32>) {
    let device = Default::default();
    let teacher = Mlp::<burn_ndarray::NdArray<f32>>::new(1000, &device);
    let x = values(SAMPLES * IN, 7);
    let xt = Tensor::from_data(TensorData::new(x.clone(), [SAMPLES, IN]), &device);
    let y = teacher
        .forward(xt)
        .into_data()
        .to_vec::<f32>()
        .expect("f32");
    (x, y)
}

/// Rows `start..start + n` of `data` (`width` columns) as a tensor.
fn rows(data: &[f32], width: usize, start: usize, n: usize) -> Tensor<Ad, 2> {
    let v = data[start * width..(start + n) * width].to_vec();
    Tensor::from_data(TensorData::new(v, [n, width]), &Default::default())
}

/// The samples of step `step` for all ranks together (rank r takes the r-th `BATCH`).
fn step_start(step: usize) -> usize {
    (step * RANKS * BATCH) % SAMPLES
}

/// Every parameter, flattened, in visitor order.
fn params(m: &Mlp<Ad>) -> Vec<f32> {
    [
        m.w1.val().into_data(),
        m.b1.val().into_data(),
        m.w2.val().into_data(),
        m.b2.val().into_data(),
    ]
    .into_iter()
    .flat_map(|d| d.to_vec::<f32>().expect("f32"))
    .collect()
}

/// The mean loss over the whole dataset.
fn full_loss(m: &Mlp<Ad>, x: &[f32], y: &[f32]) -> f32 {
    m.loss(rows(x, IN, 0, SAMPLES), rows(y, OUT, 0, SAMPLES))
        .detach()
        .into_scalar()
}

struct Run {
    params: Vec<f32>,
    loss: f32,
}

/// Burn alone on the concatenated batch (`RANKS * BATCH` samples a step).
fn alone(x: &[f32], y: &[f32]) -> Res<Run> {
    let mut model = Mlp::<Ad>::new(0, &Default::default());
    let mut optim = SgdConfig::new().init::<Ad, Mlp<Ad>>();
    for step in 0..STEPS {
        let s = step_start(step);
        let loss = model.loss(
            rows(x, IN, s, RANKS * BATCH),
            rows(y, OUT, s, RANKS * BATCH),
        );
        let grads = GradientsParams::from_grads::<Ad, _>(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    Ok(Run {
        params: params(&model),
        loss: full_loss(&model, x, y),
    })
}

/// `RANKS` thread ranks, each on its `BATCH` of the step's samples, gradients through
/// `BurnDdp` with `spec`.
fn ddp(spec: &HookSpec, x: &[f32], y: &[f32]) -> Res<Vec<Run>> {
    let runs = run_local(RANKS, |group| -> Res<Run> {
        let rank = group.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        // Rank 1 starts elsewhere: the broadcast gives it rank 0's weights.
        let model = Mlp::<Ad>::new(rank * 100, &Default::default());
        let mut ddp = BurnDdp::<Ad>::from_spec(&model, spec, group)?;
        let mut model = ddp.broadcast_parameters(model)?;
        let mut optim = SgdConfig::new().init::<Ad, Mlp<Ad>>();
        for step in 0..STEPS {
            let s = step_start(step) + rank * BATCH;
            let loss = model.loss(rows(x, IN, s, BATCH), rows(y, OUT, s, BATCH));
            let mut grads = GradientsParams::from_grads::<Ad, _>(loss.backward(), &model);
            if !ddp.sync(&mut grads)? {
                return Err("a synchronised step did not synchronise".into());
            }
            model = optim.step(LR, model, grads);
        }
        Ok(Run {
            params: params(&model),
            loss: full_loss(&model, x, y),
        })
    })?;
    runs.into_iter()
        .map(|r| r.map_err(|e| e.to_string().into()).and_then(|r| r))
        .collect()
}

/// max |a - b| / max |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let num = a
        .iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let den = b.iter().map(|b| b.abs()).fold(0.0f32, f32::max);
    num / den
}

fn main() -> Res<()> {
    let (x, y) = dataset();
    println!(
        "burn MLP [{IN}, {HIDDEN}, {OUT}], {SAMPLES} samples, {RANKS} ranks x batch {BATCH}, {STEPS} steps, SGD lr {LR}"
    );
    let mut failed = false;
    let t = Instant::now();
    let reference = alone(&x, &y)?;
    println!(
        "burn alone (batch {}): final loss {:.6} ({:.2?})",
        RANKS * BATCH,
        reference.loss,
        t.elapsed()
    );

    let t = Instant::now();
    let allreduce = ddp(&HookSpec::AllReduce, &x, &y)?;
    println!(
        "allreduce: final loss {:.6} ({:.2?})",
        allreduce[0].loss,
        t.elapsed()
    );
    let same = allreduce[1..]
        .iter()
        .all(|r| r.params == allreduce[0].params);
    let diff = rel_diff(&allreduce[0].params, &reference.params);
    let ok = same && diff <= 1e-6;
    failed |= !ok;
    println!(
        "check allreduce: ranks equal: {same}; final parameters vs burn alone: max|a-b|/max|b| = {diff:.2e} (<= 1e-6: {})",
        if ok { "ok" } else { "FAILED" }
    );

    let spec: HookSpec = "powersgd:rank=2,start_iter=10".parse()?;
    let t = Instant::now();
    let powersgd = ddp(&spec, &x, &y)?;
    println!(
        "powersgd:rank=2,start_iter=10: final loss {:.6} ({:.2?})",
        powersgd[0].loss,
        t.elapsed()
    );
    let (got, want) = (powersgd[0].loss, allreduce[0].loss);
    let ok = (got / want - 1.0).abs() <= 0.01;
    failed |= !ok;
    println!(
        "check powersgd: final loss {got:.6} vs allreduce {want:.6}: {:+.2}% (within 1%: {}); parameters differ by {:.2e}",
        100.0 * (got / want - 1.0),
        if ok { "ok" } else { "FAILED" },
        rel_diff(&powersgd[0].params, &allreduce[0].params)
    );
    if failed {
        return Err("a check failed".into());
    }
    Ok(())
}
