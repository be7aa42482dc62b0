//! A small tanh MLP with a hand-written backward pass, and the teacher-student regression
//! task that PyTorch's PowerSGD was measured on here. Shared by the `train` and
//! `train_mpi` examples and the convergence test (included with `#[path]`).
//!
//! - `trainer`: one rank's training loop over any process group (accumulation, link
//!   accounting, checkpoints), and the thread-rank driver;
//! - `checkpoint`: the per-rank checkpoint file;
//! - `cli`: the examples' shared arguments.

#![allow(dead_code)]

pub mod args;
pub mod checkpoint;
pub mod cli;
pub mod elastic;
pub mod trainer;

use ddp_hooks::HookSpec;
use lowrank::NormalRng;

/// Layer widths: 64 -> 128 -> 128 -> 32.
pub const WIDTHS: [usize; 4] = [64, 128, 128, 32];

/// Parameter shapes in forward order: W1, b1, W2, b2, W3, b3 (weights `out x in`).
pub fn shapes(widths: &[usize]) -> Vec<Vec<usize>> {
    widths
        .windows(2)
        .flat_map(|w| [vec![w[1], w[0]], vec![w[1]]])
        .collect()
}

/// Parameters, one vector per shape.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub widths: Vec<usize>,
    pub params: Vec<Vec<f32>>,
}

impl Mlp {
    /// Weights N(0, 1/fan_in), biases N(0, 0.01).
    pub fn random(widths: &[usize], seed: u64) -> Mlp {
        let mut g = NormalRng::new(seed);
        let params = shapes(widths)
            .iter()
            .map(|s| {
                let mut v = vec![0.0; s.iter().product()];
                g.fill(&mut v);
                let scale = if s.len() == 2 {
                    1.0 / (s[1] as f32).sqrt()
                } else {
                    0.1
                };
                v.iter_mut().for_each(|x| *x *= scale);
                v
            })
            .collect();
        Mlp {
            widths: widths.to_vec(),
            params,
        }
    }

    fn layers(&self) -> usize {
        self.widths.len() - 1
    }

    /// Activations of every layer for a batch (row-major, `batch x width`); tanh on all
    /// layers but the last.
    pub fn forward(&self, x: &[f32], batch: usize) -> Vec<Vec<f32>> {
        let mut acts = vec![x.to_vec()];
        for l in 0..self.layers() {
            let (din, dout) = (self.widths[l], self.widths[l + 1]);
            let (w, b) = (&self.params[2 * l], &self.params[2 * l + 1]);
            let input = &acts[l];
            let mut out = vec![0.0f32; batch * dout];
            for s in 0..batch {
                let xi = &input[s * din..(s + 1) * din];
                for o in 0..dout {
                    let row = &w[o * din..(o + 1) * din];
                    let z = row.iter().zip(xi).map(|(a, b)| a * b).sum::<f32>() + b[o];
                    out[s * dout + o] = if l + 1 < self.layers() { z.tanh() } else { z };
                }
            }
            acts.push(out);
        }
        acts
    }

    /// Mean squared error of a batch and, written into `grads` (one per parameter,
    /// overwritten), its gradient.
    pub fn loss_and_grad(&self, x: &[f32], y: &[f32], batch: usize, grads: &mut [Vec<f32>]) -> f32 {
        let acts = self.forward(x, batch);
        let n_out = *self.widths.last().unwrap_or(&1);
        let out = &acts[self.layers()];
        let scale = 1.0 / (batch * n_out) as f32;
        let mut delta: Vec<f32> = out
            .iter()
            .zip(y)
            .map(|(o, t)| 2.0 * (o - t) * scale)
            .collect();
        let loss = out
            .iter()
            .zip(y)
            .map(|(o, t)| (o - t) * (o - t))
            .sum::<f32>()
            * scale;
        for l in (0..self.layers()).rev() {
            let (din, dout) = (self.widths[l], self.widths[l + 1]);
            let input = &acts[l];
            let (gw, rest) = grads[2 * l..].split_at_mut(1);
            let (gw, gb) = (&mut gw[0], &mut rest[0]);
            gw.iter_mut().for_each(|v| *v = 0.0);
            gb.iter_mut().for_each(|v| *v = 0.0);
            for s in 0..batch {
                let xi = &input[s * din..(s + 1) * din];
                for o in 0..dout {
                    let d = delta[s * dout + o];
                    gb[o] += d;
                    gw[o * din..(o + 1) * din]
                        .iter_mut()
                        .zip(xi)
                        .for_each(|(g, x)| *g += d * x);
                }
            }
            if l > 0 {
                let w = &self.params[2 * l];
                let mut prev = vec![0.0f32; batch * din];
                for s in 0..batch {
                    let p = &mut prev[s * din..(s + 1) * din];
                    for o in 0..dout {
                        let d = delta[s * dout + o];
                        p.iter_mut()
                            .zip(&w[o * din..(o + 1) * din])
                            .for_each(|(a, b)| *a += d * b);
                    }
                    // Through tanh: d tanh(z) = 1 - tanh(z)^2, with tanh(z) = the input.
                    p.iter_mut()
                        .zip(&input[s * din..(s + 1) * din])
                        .for_each(|(a, t)| *a *= 1.0 - t * t);
                }
                delta = prev;
            }
        }
        loss
    }

    /// Mean squared error on a data set.
    pub fn loss(&self, x: &[f32], y: &[f32]) -> f32 {
        let batch = x.len() / self.widths[0];
        let out = self.forward(x, batch);
        let o = &out[self.layers()];
        o.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / o.len() as f32
    }
}

/// `samples` inputs N(0, I) and the teacher's outputs plus N(0, noise²) noise.
pub fn teacher_data(teacher: &Mlp, samples: usize, noise: f32, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut g = NormalRng::new(seed);
    let mut x = vec![0.0; samples * teacher.widths[0]];
    g.fill(&mut x);
    let acts = teacher.forward(&x, samples);
    let mut y = acts[acts.len() - 1].clone();
    let mut eps = vec![0.0; y.len()];
    g.fill(&mut eps);
    y.iter_mut().zip(&eps).for_each(|(t, e)| *t += noise * e);
    (x, y)
}

/// SGD with momentum, as `torch.optim.SGD`: `v = μ v + g; w -= lr v`.
pub struct Sgd {
    pub lr: f32,
    pub momentum: f32,
    /// The momentum buffers, one per parameter (saved in checkpoints).
    pub velocity: Vec<Vec<f32>>,
}

impl Sgd {
    pub fn new(model: &Mlp, lr: f32, momentum: f32) -> Sgd {
        Sgd {
            lr,
            momentum,
            velocity: model.params.iter().map(|p| vec![0.0; p.len()]).collect(),
        }
    }

    pub fn step(&mut self, model: &mut Mlp, p: usize, grad: &[f32]) {
        for ((w, v), g) in model.params[p]
            .iter_mut()
            .zip(&mut self.velocity[p])
            .zip(grad)
        {
            *v = self.momentum * *v + g;
            *w -= self.lr * *v;
        }
    }
}

/// Trains on `ranks` thread ranks for `steps` steps with `hook` (batch 64, 2048 samples
/// per rank, no accumulation); returns the final and the initial held-out loss
/// (identical on every rank).
pub fn train(ranks: usize, steps: usize, hook: &HookSpec) -> (f32, f32) {
    let config = trainer::Config {
        ranks,
        steps,
        hook: hook.clone(),
        ..trainer::Config::default()
    };
    match trainer::run_threads(&config, &trainer::Plan::default(), &|_| {}) {
        Ok(out) => (out.final_loss, out.initial_loss),
        Err(e) => panic!("training failed: {e}"),
    }
}
