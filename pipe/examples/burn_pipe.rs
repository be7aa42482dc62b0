//! A burn model run through a 2-partition pipe (`pipe::burn::BurnLayer` stages, burn's
//! autodiff for their backward passes), trained with SGD and checked against the same
//! model trained by burn alone on the whole batch.
//!
//! ```sh
//! cargo run --release -p pipe --features burn --example burn_pipe
//! ```
//!
//! Three burn modules (`#[derive(Module)]` linear layers, tanh after the first two;
//! 16 -> 64 -> 64 -> 4) on partitions `[2, 1]`, 8 micro-batches of a 64-sample batch, 1F1B,
//! checkpointing all but the last micro-batch, on burn's `NdArray` backend under
//! `Autodiff`. The exit status is non-zero unless the final parameters equal burn alone's
//! within 1e-6 (max |a - b| / max |b|).

use burn_core as burn;
use burn_core::module::{Module, Param};
use burn_tensor::backend::Backend;
use burn_tensor::{Tensor, TensorData};
use pipe::burn::{BurnLayer, BurnTensor, CpuAutodiff};
use pipe::{Batch, Checkpoint, Layer, Pipe, ScheduleKind};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
type Ad = CpuAutodiff;

const WIDTHS: [usize; 4] = [16, 64, 64, 4];
const BATCH: usize = 64;
const STEPS: usize = 100;
const LR: f32 = 0.05;

/// `y = x w + b`.
#[derive(Module, Debug)]
struct Linear<B: Backend> {
    w: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 1>>,
}

impl<B: Backend> Linear<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        x.matmul(self.w.val()) + self.b.val().unsqueeze::<2>()
    }
}

/// Deterministic values in about [-1, 1).
fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|k| {
            let h = (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((salt as u64) << 32);
            (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The model, built the same way every time (fresh parameter ids each time).
fn model() -> Vec<Linear<Ad>> {
    let device = Default::default();
    (0..WIDTHS.len() - 1)
        .map(|l| {
            let (fan_in, fan_out) = (WIDTHS[l], WIDTHS[l + 1]);
            let scale = 1.0 / (fan_in as f32).sqrt();
            let w: Vec<f32> = values(fan_in * fan_out, 2 * l)
                .iter()
                .map(|v| v * scale)
                .collect();
            let b: Vec<f32> = values(fan_out, 2 * l + 1).iter().map(|v| 0.1 * v).collect();
            Linear {
                w: Param::from_tensor(Tensor::from_data(
                    TensorData::new(w, [fan_in, fan_out]),
                    &device,
                )),
                b: Param::from_tensor(Tensor::from_data(TensorData::new(b, [fan_out]), &device)),
            }
        })
        .collect()
}

fn forward_all(model: &[Linear<Ad>], x: Tensor<Ad, 2>) -> Tensor<Ad, 2> {
    let mut h = x;
    for (l, m) in model.iter().enumerate() {
        h = m.forward(h);
        if l + 2 < WIDTHS.len() {
            h = h.tanh();
        }
    }
    h
}

/// `p - lr · g`, as a tensor of `p`'s shape.
fn sgd(p: &BurnTensor<Ad>, g: &BurnTensor<Ad>) -> Res<BurnTensor<Ad>> {
    // -lr · g, then added into p: the same two float operations as burn alone's update.
    let step = match g.dims().len() {
        2 => BurnTensor::from_tensor(g.to_tensor::<2>()?.mul_scalar(-LR)),
        _ => BurnTensor::from_tensor(g.to_tensor::<1>()?.mul_scalar(-LR)),
    };
    let mut p = p.clone();
    pipe::Tensor::accumulate(&mut p, &step)?;
    Ok(p)
}

/// `max |a - b| / max |b|` over every parameter.
fn rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let (mut diff, mut scale) = (0f32, f32::MIN_POSITIVE);
    for (a, b) in a.iter().zip(b) {
        for (x, y) in a.iter().zip(b) {
            diff = diff.max((x - y).abs());
            scale = scale.max(y.abs());
        }
    }
    diff / scale
}

fn main() -> Res<()> {
    let device = Default::default();
    let x: Tensor<Ad, 2> = Tensor::from_data(
        TensorData::new(values(BATCH * WIDTHS[0], 100), [BATCH, WIDTHS[0]]),
        &device,
    );
    // A target the model can learn: a fixed nonlinear mix of the inputs.
    let target =
        x.clone().narrow(1, 0, WIDTHS[3]).sin() + x.clone().narrow(1, 4, WIDTHS[3]).mul_scalar(0.5);

    // The pipe: each burn module in a BurnLayer with its forward, partitions [2, 1].
    let stages: Vec<Box<dyn Layer<BurnTensor<Ad>>>> = model()
        .into_iter()
        .enumerate()
        .map(|(l, m)| -> Box<dyn Layer<BurnTensor<Ad>>> {
            if l + 2 < WIDTHS.len() {
                Box::new(BurnLayer::new(m, |m: &Linear<Ad>, x| m.forward(x).tanh()))
            } else {
                Box::new(BurnLayer::new(m, |m: &Linear<Ad>, x| m.forward(x)))
            }
        })
        .collect();
    let mut pipe = Pipe::builder(stages, &[2, 1])
        .chunks(8)
        .checkpoint(Checkpoint::ExceptLast)
        .schedule(ScheduleKind::OneFOneB)
        .build()?;

    // burn alone: the same modules, the whole batch, the same loss.
    let mut reference = model();

    println!("burn model {WIDTHS:?} on a 2-partition pipe [2, 1], 8 micro-batches, 1F1B, checkpoint except_last; SGD lr {LR}");
    for step in 0..STEPS {
        let out = pipe.step(
            Batch::single(BurnTensor::from_tensor(x.clone())),
            |mb, out| {
                let out = out.tensor(0)?.to_tensor::<2>()?;
                let rows = target.clone().narrow(0, mb.offset, mb.len);
                let diff = out - rows;
                // Half the squared error, averaged over the whole batch.
                let loss = diff.clone().powi_scalar(2).sum().into_scalar() * 0.5 / BATCH as f32;
                Ok((
                    loss,
                    Batch::single(BurnTensor::from_tensor(diff.div_scalar(BATCH as f32))),
                ))
            },
        )?;
        // SGD through the generic parameter interface: the new values reach the modules.
        for layer in pipe.partitions_mut().iter_mut().flatten() {
            for p in layer.parameters_mut() {
                *p.value = sgd(p.value, p.grad)?;
            }
        }
        pipe.zero_grad();

        let y = forward_all(&reference, x.clone());
        let diff = y - target.clone();
        let loss = diff.powi_scalar(2).sum().mul_scalar(0.5 / BATCH as f32);
        let ref_loss = loss.clone().detach().into_scalar();
        let grads = loss.backward();
        reference = reference
            .into_iter()
            .map(|m| -> Res<Linear<Ad>> {
                let gw = Tensor::<Ad, 2>::from_inner(m.w.val().grad(&grads).ok_or("no grad")?);
                let gb = Tensor::<Ad, 1>::from_inner(m.b.val().grad(&grads).ok_or("no grad")?);
                let w = m.w.val().detach() + gw.mul_scalar(-LR);
                let b = m.b.val().detach() + gb.mul_scalar(-LR);
                Ok(Linear {
                    w: Param::initialized(m.w.id, w.detach().require_grad()),
                    b: Param::initialized(m.b.id, b.detach().require_grad()),
                })
            })
            .collect::<Res<_>>()?;

        if step % 20 == 0 || step + 1 == STEPS {
            let loss: f32 = out.losses.iter().sum();
            println!("step {step:>3}: pipe loss {loss:.6}   burn alone {ref_loss:.6}");
        }
    }

    let params: Vec<Vec<f32>> = pipe
        .partitions()
        .iter()
        .flatten()
        .flat_map(|l| l.parameters().into_iter().map(|p| p.value.to_vec_f32()))
        .collect();
    let reference_params: Vec<Vec<f32>> = reference
        .iter()
        .flat_map(|m| [m.w.val().into_data(), m.b.val().into_data()])
        .map(|d| d.iter::<f32>().collect())
        .collect();
    let diff = rel_diff(&params, &reference_params);
    let ok = params.len() == reference_params.len() && diff <= 1e-6;
    println!(
        "check: final parameters vs burn alone: max|a-b|/max|b| = {diff:.2e} (<= 1e-6: {})",
        if ok { "ok" } else { "FAILED" }
    );
    if !ok {
        return Err("the pipelined model drifted from burn alone".into());
    }
    Ok(())
}
