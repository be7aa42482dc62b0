//! A candle model run through a 2-partition pipe (`pipe::candle::CandleLayer` stages,
//! candle's autograd for their backward passes), trained with SGD and checked against the
//! same model trained by candle alone on the whole batch.
//!
//! ```sh
//! cargo run --release -p pipe --features candle --example candle_pipe
//! ```
//!
//! Three candle modules (linear + tanh, linear + tanh, linear; 16 -> 64 -> 64 -> 4) on
//! partitions `[2, 1]`, 8 micro-batches of a 64-sample batch, 1F1B, checkpointing all but
//! the last micro-batch. Each partition's worker runs candle's kernels on one thread
//! (`RAYON_NUM_THREADS=1`, set before candle is first used). The exit status is non-zero
//! unless the final parameters equal candle alone's within 1e-5 (max |a - b| / max |b|).

use candle_core::{Device, Module, Tensor, Var};
use pipe::candle::CandleLayer;
use pipe::{Batch, Checkpoint, Layer, Pipe, ScheduleKind};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const WIDTHS: [usize; 4] = [16, 64, 64, 4];
const BATCH: usize = 64;
const STEPS: usize = 200;
const LR: f64 = 0.05;

/// `y = x wᵀ + b`, then tanh unless it is the last layer.
struct Linear {
    w: Var,
    b: Var,
    tanh: bool,
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.matmul(&self.w.t()?)?.broadcast_add(&self.b)?;
        if self.tanh {
            y.tanh()
        } else {
            Ok(y)
        }
    }
}

/// Deterministic values in about [-1, 1) (candle's CPU generator cannot be seeded).
fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|k| {
            let h = (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((salt as u64) << 32);
            (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The model, built the same way every time.
fn model() -> Res<Vec<Linear>> {
    let layers = WIDTHS.len() - 1;
    (0..layers)
        .map(|l| {
            let (fan_in, fan_out) = (WIDTHS[l], WIDTHS[l + 1]);
            let scale = 1.0 / (fan_in as f32).sqrt();
            let w: Vec<f32> = values(fan_out * fan_in, 2 * l)
                .iter()
                .map(|v| v * scale)
                .collect();
            let b: Vec<f32> = values(fan_out, 2 * l + 1).iter().map(|v| 0.1 * v).collect();
            Ok(Linear {
                w: Var::from_vec(w, (fan_out, fan_in), &Device::Cpu)?,
                b: Var::from_vec(b, fan_out, &Device::Cpu)?,
                tanh: l + 1 < layers,
            })
        })
        .collect()
}

/// Half the squared error, averaged over the batch: loss and gradient with respect to `out`.
fn mse(out: &Tensor, target: &Tensor) -> candle_core::Result<(f32, Tensor)> {
    let diff = out.sub(target)?;
    let loss = diff.sqr()?.sum_all()?.to_scalar::<f32>()? * 0.5 / BATCH as f32;
    Ok((loss, diff.affine(1.0 / BATCH as f64, 0.0)?))
}

/// `max |a - b| / max |b|` over every parameter.
fn rel_diff(a: &[Tensor], b: &[Tensor]) -> Res<f32> {
    let (mut diff, mut scale) = (0f32, f32::MIN_POSITIVE);
    for (a, b) in a.iter().zip(b) {
        diff = diff.max(a.sub(b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
        scale = scale.max(b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
    }
    Ok(diff / scale)
}

fn main() -> Res<()> {
    // One thread per partition for candle's kernels; set before candle starts its pool.
    std::env::set_var("RAYON_NUM_THREADS", "1");

    let x = Tensor::from_vec(
        values(BATCH * WIDTHS[0], 100),
        (BATCH, WIDTHS[0]),
        &Device::Cpu,
    )?;
    // A target the model can learn: a fixed nonlinear mix of the inputs.
    let target = x
        .narrow(1, 0, WIDTHS[3])?
        .sin()?
        .add(&x.narrow(1, 4, WIDTHS[3])?.affine(0.5, 0.0)?)?;

    // The pipe: each candle module in a CandleLayer with its vars, partitions [2, 1].
    let stages: Vec<Box<dyn Layer<Tensor>>> = model()?
        .into_iter()
        .map(|m| -> Res<Box<dyn Layer<Tensor>>> {
            let vars = vec![m.w.clone(), m.b.clone()];
            Ok(Box::new(CandleLayer::new(m, vars)?))
        })
        .collect::<Res<_>>()?;
    let mut pipe = Pipe::builder(stages, &[2, 1])
        .chunks(8)
        .checkpoint(Checkpoint::ExceptLast)
        .schedule(ScheduleKind::OneFOneB)
        .build()?;

    // candle alone: the same modules, the whole batch, the same loss.
    let reference = model()?;
    let reference_vars: Vec<Var> = reference
        .iter()
        .flat_map(|m| [m.w.clone(), m.b.clone()])
        .collect();

    println!("candle model {WIDTHS:?} on a 2-partition pipe [2, 1], 8 micro-batches, 1F1B, checkpoint except_last; SGD lr {LR}");
    for step in 0..STEPS {
        let out = pipe.step(Batch::single(x.clone()), |mb, out| {
            let rows = target
                .narrow(0, mb.offset, mb.len)
                .map_err(pipe::Error::custom)?;
            let (loss, grad) = mse(out.tensor(0)?, &rows).map_err(pipe::Error::custom)?;
            Ok((loss, Batch::single(grad)))
        })?;
        // SGD through the generic parameter interface: the new values reach the vars.
        for layer in pipe.partitions_mut().iter_mut().flatten() {
            for p in layer.parameters_mut() {
                *p.value = p.value.sub(&p.grad.affine(LR, 0.0)?)?;
            }
        }
        pipe.zero_grad();

        let mut h = x.clone();
        for m in &reference {
            h = m.forward(&h)?;
        }
        let (ref_loss, _) = mse(&h, &target)?;
        let grads = h
            .sub(&target)?
            .sqr()?
            .sum_all()?
            .affine(0.5 / BATCH as f64, 0.0)?
            .backward()?;
        for var in &reference_vars {
            if let Some(g) = grads.get(var) {
                var.set(&var.sub(&g.affine(LR, 0.0)?)?)?;
            }
        }

        if step % 25 == 0 || step + 1 == STEPS {
            let loss: f32 = out.losses.iter().sum();
            println!("step {step:>3}: pipe loss {loss:.6}   candle alone {ref_loss:.6}");
        }
    }

    let params: Vec<Tensor> = pipe
        .partitions()
        .iter()
        .flatten()
        .flat_map(|l| l.parameters().into_iter().map(|p| p.value.clone()))
        .collect();
    let reference_params: Vec<Tensor> = reference_vars
        .iter()
        .map(|v| v.as_tensor().clone())
        .collect();
    let diff = rel_diff(&params, &reference_params)?;
    let ok = diff <= 1e-5;
    println!(
        "check: final parameters vs candle alone: max|a-b|/max|b| = {diff:.2e} (<= 1e-5: {})",
        if ok { "ok" } else { "FAILED" }
    );
    if !ok {
        return Err("the pipelined model drifted from candle alone".into());
    }
    Ok(())
}
