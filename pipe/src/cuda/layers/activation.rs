//! [`ReLU`] and [`Dropout`].

use std::sync::Arc;

use cudarc::driver::PushKernelArg;

use super::super::device::GpuStream;
use super::super::tensor::CudaTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Saved};
use crate::microbatch::Batch;

use super::{input, shape_error};
use crate::cpu;

/// `y = max(x, 0)`; saves its output for backward.
#[derive(Debug, Clone)]
pub struct ReLU {
    stream: Arc<GpuStream>,
}

impl ReLU {
    /// A ReLU on `stream`.
    pub fn new(stream: &Arc<GpuStream>) -> Self {
        ReLU {
            stream: stream.clone(),
        }
    }
}

impl Layer<CudaTensor> for ReLU {
    fn forward(
        &mut self,
        batch: Batch<CudaTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CudaTensor>, Saved<CudaTensor>), Error> {
        let s = &self.stream;
        let mut y = input(batch, s)?;
        let n = y.len() as u64;
        if n > 0 {
            let cfg = s.gpu().elementwise(y.len());
            launch!(s, relu, cfg, [y.slice_mut()?, &n])?;
        }
        Ok((Batch::single(y.clone()), Saved::new(vec![y])))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CudaTensor>,
        saved: Saved<CudaTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CudaTensor>, Error> {
        let s = &self.stream;
        let mut dy = input(grad_output, s)?;
        let y = saved.tensors().first().ok_or(Error::Arity {
            expected: 1,
            got: 0,
        })?;
        if y.shape() != dy.shape() {
            return Err(shape_error(
                "ReLU::backward",
                y.shape().to_vec(),
                dy.shape(),
            ));
        }
        let y = y.clone().on(s)?;
        let n = dy.len() as u64;
        if n > 0 {
            let cfg = s.gpu().elementwise(dy.len());
            launch!(s, relu_backward, cfg, [dy.slice_mut()?, y.slice(), &n])?;
        }
        Ok(Batch::single(dy))
    }
}

/// Dropout with the CPU layer's mask: element `e` of sample `s` is dropped when
/// [`Context::sample_rng`]`(s).uniform(e) < p`, computed in the kernel from the same
/// counter-based stream, so the GPU and CPU masks are identical, under any chunking and
/// under recomputation; backward draws it again.
#[derive(Debug, Clone)]
pub struct Dropout {
    p: f32,
    stream: Arc<GpuStream>,
}

impl Dropout {
    /// Dropout with probability `p` in `[0, 1)` on `stream`.
    pub fn new(p: f32, stream: &Arc<GpuStream>) -> Result<Self, Error> {
        cpu::Dropout::new(p)?;
        Ok(Dropout {
            p,
            stream: stream.clone(),
        })
    }

    fn apply(&self, mut t: CudaTensor, ctx: &Context) -> Result<CudaTensor, Error> {
        if !ctx.is_training() || self.p <= 0.0 || t.is_empty() {
            return Ok(t);
        }
        let rows = t.shape().first().copied().unwrap_or(1).max(1);
        let per_row = (t.len() / rows) as u64;
        let (rows64, key) = (rows as u64, ctx.rng().key());
        let offset = ctx.micro_batch().offset as u64;
        let scale = 1.0 / (1.0 - self.p);
        let s = &self.stream;
        let cfg = s.gpu().elementwise(t.len());
        launch!(
            s,
            dropout,
            cfg,
            [
                t.slice_mut()?,
                &rows64,
                &per_row,
                &key,
                &offset,
                &self.p,
                &scale
            ]
        )?;
        Ok(t)
    }
}

impl Layer<CudaTensor> for Dropout {
    fn forward(
        &mut self,
        batch: Batch<CudaTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CudaTensor>, Saved<CudaTensor>), Error> {
        let x = input(batch, &self.stream)?;
        Ok((Batch::single(self.apply(x, ctx)?), Saved::none()))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CudaTensor>,
        _saved: Saved<CudaTensor>,
        ctx: &mut Context,
    ) -> Result<Batch<CudaTensor>, Error> {
        let dy = input(grad_output, &self.stream)?;
        Ok(Batch::single(self.apply(dy, ctx)?))
    }
}
