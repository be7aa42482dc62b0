//! [`ReLU`] and [`Dropout`].

use ndarray::Zip;

use super::same_shape;
use crate::cpu::CpuTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Saved};
use crate::microbatch::Batch;
use crate::tensor::Tensor;

/// `y = max(x, 0)`, any shape. Saves its output for backward.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReLU;

impl ReLU {
    /// A ReLU.
    pub fn new() -> Self {
        ReLU
    }
}

impl Layer<CpuTensor> for ReLU {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let mut y = input.into_single()?;
        y.array_mut().mapv_inplace(|v| v.max(0.0));
        Ok((Batch::single(y.clone()), Saved::new(vec![y])))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CpuTensor>,
        saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        let mut dy = grad_output.into_single()?;
        let y = saved.tensors().first().ok_or(Error::Arity {
            expected: 1,
            got: 0,
        })?;
        same_shape("ReLU::backward", y.shape(), dy.shape())?;
        Zip::from(dy.array_mut()).and(y.array()).for_each(|g, &y| {
            if y <= 0.0 {
                *g = 0.0;
            }
        });
        Ok(Batch::single(dy))
    }
}

/// Zeroes each element with probability `p` in training and scales the rest by
/// `1 / (1 - p)`; the identity in evaluation. Any shape; the first dimension is the sample.
///
/// The mask of element `e` of sample `s` is drawn from [`Context::sample_rng`], keyed by
/// (seed, step, layer, `s`, `e`), so it does not depend on the chunking, and backward draws
/// it again instead of saving it: dropout holds no memory between forward and backward.
#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    p: f32,
}

impl Dropout {
    /// Dropout with probability `p` in `[0, 1)`.
    pub fn new(p: f32) -> Result<Self, Error> {
        if (0.0..1.0).contains(&p) {
            Ok(Dropout { p })
        } else {
            Err(Error::Probability(p))
        }
    }

    /// The probability.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// Multiplies `t` by the mask of this context, scaled.
    fn apply_mask(&self, t: &mut CpuTensor, ctx: &Context) {
        let rows = t.batch_len().max(1);
        let per_row = t.array().len() / rows;
        let scale = 1.0 / (1.0 - self.p);
        let mut stream = ctx.sample_rng(0);
        for (k, v) in t.array_mut().iter_mut().enumerate() {
            let (row, element) = (k / per_row.max(1), k % per_row.max(1));
            if element == 0 {
                stream = ctx.sample_rng(row);
            }
            *v = if stream.uniform(element as u64) < self.p {
                0.0
            } else {
                *v * scale
            };
        }
    }
}

impl Layer<CpuTensor> for Dropout {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let mut x = input.into_single()?;
        if ctx.is_training() && self.p > 0.0 {
            self.apply_mask(&mut x, ctx);
        }
        Ok((Batch::single(x), Saved::none()))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        let mut dy = grad_output.into_single()?;
        if ctx.is_training() && self.p > 0.0 {
            self.apply_mask(&mut dy, ctx);
        }
        Ok(Batch::single(dy))
    }
}
