//! [`BatchNorm`]: normalisation with per-micro-batch statistics.

use super::same_shape;
use crate::cpu::CpuTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;
use crate::tensor::Tensor;

/// Batch normalisation over `[batch, features, ...]`, one mean and variance per feature,
/// reduced over the batch and any trailing dimensions, with a learned scale and shift.
///
/// In training it normalises each micro-batch with that micro-batch's statistics (so, like
/// torchgpipe's plain batch norm, it is *not* transparent to chunking) and folds them into
/// running statistics with `momentum`: the running variance uses the unbiased estimate, as
/// PyTorch's does. A recomputation (checkpointing) leaves the running statistics alone. In
/// evaluation it normalises with the running statistics.
#[derive(Debug, Clone)]
pub struct BatchNorm {
    momentum: f32,
    eps: f32,
    weight: CpuTensor,
    bias: CpuTensor,
    weight_grad: CpuTensor,
    bias_grad: CpuTensor,
    running_mean: CpuTensor,
    running_var: CpuTensor,
}

/// A `[batch, features, rest]` layout of a tensor, as row-major data.
struct Layout {
    n: usize,
    c: usize,
    l: usize,
}

impl Layout {
    fn of(t: &CpuTensor, features: usize, op: &'static str) -> Result<Self, Error> {
        let shape = t.shape();
        if shape.len() < 2 || shape[1] != features {
            return Err(Error::Shape {
                op,
                expected: vec![0, features],
                got: shape.to_vec(),
            });
        }
        let (n, c) = (shape[0], shape[1]);
        Ok(Layout {
            n,
            c,
            l: shape[2..].iter().product(),
        })
    }

    /// Visits every element as (feature, flat index).
    fn each(&self, mut f: impl FnMut(usize, usize)) {
        for i in 0..self.n {
            for ch in 0..self.c {
                let base = (i * self.c + ch) * self.l;
                for k in base..base + self.l {
                    f(ch, k);
                }
            }
        }
    }

    fn count(&self) -> usize {
        self.n * self.l
    }
}

fn row_major(t: &CpuTensor) -> Vec<f32> {
    t.array().iter().copied().collect()
}

fn tensor(shape: &[usize], data: Vec<f32>) -> Result<CpuTensor, Error> {
    CpuTensor::from_shape_vec(shape, data)
}

impl BatchNorm {
    /// Batch norm over `features` features with PyTorch's defaults: momentum 0.1,
    /// eps 1e-5, scale 1, shift 0, running mean 0 and variance 1.
    pub fn new(features: usize) -> Self {
        BatchNorm::with(features, 0.1, 1e-5)
    }

    /// Batch norm with a momentum and an epsilon of your own.
    pub fn with(features: usize, momentum: f32, eps: f32) -> Self {
        BatchNorm {
            momentum,
            eps,
            weight: CpuTensor::ones(&[features]),
            bias: CpuTensor::zeros(&[features]),
            weight_grad: CpuTensor::zeros(&[features]),
            bias_grad: CpuTensor::zeros(&[features]),
            running_mean: CpuTensor::zeros(&[features]),
            running_var: CpuTensor::ones(&[features]),
        }
    }

    /// The running mean.
    pub fn running_mean(&self) -> &CpuTensor {
        &self.running_mean
    }

    /// The running variance.
    pub fn running_var(&self) -> &CpuTensor {
        &self.running_var
    }

    fn features(&self) -> usize {
        self.weight.shape()[0]
    }
}

impl Layer<CpuTensor> for BatchNorm {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let x = input.into_single()?;
        let layout = Layout::of(&x, self.features(), "BatchNorm::forward")?;
        let data = row_major(&x);
        let (w, b) = (self.weight.to_vec(), self.bias.to_vec());
        let cnt = layout.count().max(1) as f32;
        if !ctx.is_training() {
            let (rm, rv) = (self.running_mean.to_vec(), self.running_var.to_vec());
            let mut y = vec![0.0; data.len()];
            layout.each(|ch, k| {
                y[k] = w[ch] * (data[k] - rm[ch]) / (rv[ch] + self.eps).sqrt() + b[ch];
            });
            return Ok((Batch::single(tensor(x.shape(), y)?), Saved::none()));
        }
        let mut mean = vec![0.0f32; layout.c];
        layout.each(|ch, k| mean[ch] += data[k]);
        mean.iter_mut().for_each(|m| *m /= cnt);
        let mut var = vec![0.0f32; layout.c];
        layout.each(|ch, k| var[ch] += (data[k] - mean[ch]).powi(2));
        var.iter_mut().for_each(|v| *v /= cnt);
        let inv_std: Vec<f32> = var.iter().map(|v| 1.0 / (v + self.eps).sqrt()).collect();
        if !ctx.is_recomputing() {
            let unbiased = if cnt > 1.0 { cnt / (cnt - 1.0) } else { 1.0 };
            let m = self.momentum;
            let rm = self.running_mean.array_mut();
            rm.iter_mut()
                .zip(&mean)
                .for_each(|(r, &v)| *r = (1.0 - m) * *r + m * v);
            let rv = self.running_var.array_mut();
            rv.iter_mut()
                .zip(&var)
                .for_each(|(r, &v)| *r = (1.0 - m) * *r + m * v * unbiased);
        }
        let mut x_hat = vec![0.0; data.len()];
        let mut y = vec![0.0; data.len()];
        layout.each(|ch, k| {
            x_hat[k] = (data[k] - mean[ch]) * inv_std[ch];
            y[k] = w[ch] * x_hat[k] + b[ch];
        });
        let saved = Saved::new(vec![
            tensor(x.shape(), x_hat)?,
            tensor(&[layout.c], inv_std)?,
        ]);
        Ok((Batch::single(tensor(x.shape(), y)?), saved))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CpuTensor>,
        saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        let dy = grad_output.into_single()?;
        let [x_hat, inv_std] =
            <[CpuTensor; 2]>::try_from(saved.into_tensors()).map_err(|v| Error::Arity {
                expected: 2,
                got: v.len(),
            })?;
        same_shape("BatchNorm::backward", x_hat.shape(), dy.shape())?;
        let layout = Layout::of(&dy, self.features(), "BatchNorm::backward")?;
        let (g, xh, inv, w) = (
            row_major(&dy),
            row_major(&x_hat),
            inv_std.to_vec(),
            self.weight.to_vec(),
        );
        let cnt = layout.count().max(1) as f32;
        let mut sum_dy = vec![0.0f32; layout.c];
        let mut sum_dy_xhat = vec![0.0f32; layout.c];
        layout.each(|ch, k| {
            sum_dy[ch] += g[k];
            sum_dy_xhat[ch] += g[k] * xh[k];
        });
        let mut dx = vec![0.0; g.len()];
        layout.each(|ch, k| {
            dx[k] = w[ch] * inv[ch] / cnt * (cnt * g[k] - sum_dy[ch] - xh[k] * sum_dy_xhat[ch]);
        });
        self.weight_grad
            .accumulate(&tensor(&[layout.c], sum_dy_xhat)?)?;
        self.bias_grad.accumulate(&tensor(&[layout.c], sum_dy)?)?;
        Ok(Batch::single(tensor(dy.shape(), dx)?))
    }

    fn parameters(&self) -> Vec<Param<'_, CpuTensor>> {
        vec![
            Param {
                name: "weight",
                value: &self.weight,
                grad: &self.weight_grad,
            },
            Param {
                name: "bias",
                value: &self.bias,
                grad: &self.bias_grad,
            },
        ]
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, CpuTensor>> {
        vec![
            ParamMut {
                name: "weight",
                value: &mut self.weight,
                grad: &mut self.weight_grad,
            },
            ParamMut {
                name: "bias",
                value: &mut self.bias,
                grad: &mut self.bias_grad,
            },
        ]
    }

    fn zero_grad(&mut self) {
        self.weight_grad.array_mut().fill(0.0);
        self.bias_grad.array_mut().fill(0.0);
    }
}
