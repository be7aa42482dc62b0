//! [`BatchNorm`], per micro-batch or deferred.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;

use super::super::device::GpuStream;
use super::super::tensor::CudaTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;
use cudarc::driver::CudaSlice;

use super::{f64_zeros, input, per_feature, shape_error, weight_and_bias, weight_and_bias_mut};

/// The sums a deferred batch norm accumulates over one mini-batch (on the device).
struct Deferred {
    step: Option<u64>,
    seen: Vec<bool>,
    sum: CudaSlice<f64>,
    sum_sq: CudaSlice<f64>,
    count: usize,
    tracked: usize,
}

/// [`cpu::BatchNorm`](crate::cpu::BatchNorm) on the device: `[batch, features, ...]`, statistics per feature in
/// f64 (a fixed-order reduction per feature), the same momentum, epsilon, unbiased
/// running variance, and the same deferred mode (torchgpipe's `DeferredBatchNorm`, with
/// the bookkeeping of the CPU layer: a micro-batch is counted once, a recomputation or a
/// profiling pass not at all, and a pass that never reaches its last micro-batch is
/// dropped).
pub struct BatchNorm {
    stream: Arc<GpuStream>,
    momentum: f32,
    eps: f32,
    weight: CudaTensor,
    bias: CudaTensor,
    weight_grad: CudaTensor,
    bias_grad: CudaTensor,
    running_mean: CudaTensor,
    running_var: CudaTensor,
    defer: bool,
    deferred: Option<Deferred>,
    fault: Option<Error>,
}

impl std::fmt::Debug for BatchNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchNorm")
            .field("features", &self.features())
            .field("deferred", &self.defer)
            .finish_non_exhaustive()
    }
}

impl BatchNorm {
    /// Batch norm with PyTorch's defaults (momentum 0.1, eps 1e-5) on `stream`.
    pub fn new(features: usize, stream: &Arc<GpuStream>) -> Result<Self, Error> {
        BatchNorm::with(features, 0.1, 1e-5, stream)
    }

    /// Batch norm with a momentum and an epsilon of your own.
    pub fn with(
        features: usize,
        momentum: f32,
        eps: f32,
        stream: &Arc<GpuStream>,
    ) -> Result<Self, Error> {
        let shape = [features];
        let ones = vec![1.0f32; features];
        Ok(BatchNorm {
            stream: stream.clone(),
            momentum,
            eps,
            weight: CudaTensor::from_host(stream, &shape, &ones)?,
            bias: CudaTensor::zeros(stream, &shape)?,
            weight_grad: CudaTensor::zeros(stream, &shape)?,
            bias_grad: CudaTensor::zeros(stream, &shape)?,
            running_mean: CudaTensor::zeros(stream, &shape)?,
            running_var: CudaTensor::from_host(stream, &shape, &ones)?,
            defer: false,
            deferred: None,
            fault: None,
        })
    }

    /// Deferred running statistics (see [`cpu::BatchNorm`](crate::cpu::BatchNorm)).
    pub fn deferred(features: usize, stream: &Arc<GpuStream>) -> Result<Self, Error> {
        let mut bn = BatchNorm::new(features, stream)?;
        bn.defer = true;
        Ok(bn)
    }

    /// The running mean.
    pub fn running_mean(&self) -> &CudaTensor {
        &self.running_mean
    }

    /// The running variance.
    pub fn running_var(&self) -> &CudaTensor {
        &self.running_var
    }

    /// Brings the parameters, gradients and running statistics to the layer's stream (a
    /// caller may have put tensors of another stream in through `parameters_mut`).
    fn settle(&mut self) -> Result<(), Error> {
        let s = self.stream.clone();
        for t in [
            &mut self.weight,
            &mut self.bias,
            &mut self.weight_grad,
            &mut self.bias_grad,
            &mut self.running_mean,
            &mut self.running_var,
        ] {
            t.bring(&s)?;
        }
        Ok(())
    }

    fn features(&self) -> usize {
        self.weight.shape()[0]
    }

    fn layout(&self, t: &CudaTensor, op: &'static str) -> Result<(usize, usize, usize), Error> {
        let shape = t.shape();
        if shape.len() < 2 || shape[1] != self.features() {
            return Err(shape_error(op, vec![0, self.features()], shape));
        }
        Ok((shape[0], shape[1], shape[2..].iter().product()))
    }

    /// The deferred sums to add this micro-batch to, fresh where the CPU layer starts
    /// afresh (a new step, another micro-batch count, a micro-batch seen twice).
    fn tracking(&mut self, ctx: &Context, c: usize) -> Result<&mut Deferred, Error> {
        let index = ctx.micro_batch().index;
        let stale = match &self.deferred {
            Some(d) => {
                d.step != Some(ctx.step())
                    || d.seen.len() != ctx.micro_batches()
                    || d.seen.get(index).copied().unwrap_or(false)
            }
            None => true,
        };
        if stale {
            self.deferred = Some(Deferred {
                step: Some(ctx.step()),
                seen: vec![false; ctx.micro_batches()],
                sum: f64_zeros(&self.stream, c)?,
                sum_sq: f64_zeros(&self.stream, c)?,
                count: 0,
                tracked: 0,
            });
        }
        Ok(self.deferred.as_mut().expect("just made"))
    }

    /// Updates the running statistics from `mean` and `var` (or from sums over `count`).
    fn update_running(
        &mut self,
        mean: &CudaSlice<f64>,
        var: &CudaSlice<f64>,
        count: usize,
        from_sums: bool,
    ) -> Result<(), Error> {
        let s = self.stream.clone();
        let c = self.features();
        let unbiased = if count > 1 {
            count as f64 / (count - 1) as f64
        } else {
            1.0
        };
        let (m, cnt, fs, c64) = (
            f64::from(self.momentum),
            count.max(1) as f64,
            i32::from(from_sums),
            c as u64,
        );
        let cfg = s.gpu().elementwise(c);
        let rm = self.running_mean.slice_mut()?;
        let rv = self.running_var.slice_mut()?;
        launch!(
            &s,
            bn_running,
            cfg,
            [rm, rv, mean, var, &m, &unbiased, &cnt, &fs, &c64]
        )
    }
}

impl Layer<CudaTensor> for BatchNorm {
    fn forward(
        &mut self,
        batch: Batch<CudaTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CudaTensor>, Saved<CudaTensor>), Error> {
        if let Some(e) = self.fault.take() {
            return Err(e);
        }
        self.settle()?;
        let s = self.stream.clone();
        let x = input(batch, &s)?;
        let (n, c, l) = self.layout(&x, "BatchNorm::forward")?;
        let (n64, c64, l64) = (n as u64, c as u64, l as u64);
        let mut y = CudaTensor::uninit(&s, x.shape())?;
        let cfg = s.gpu().elementwise(x.len());
        if !ctx.is_training() {
            if !x.is_empty() {
                let (rm, rv) = (self.running_mean.slice(), self.running_var.slice());
                let (w, b) = (self.weight.slice(), self.bias.slice());
                launch!(
                    &s,
                    bn_eval,
                    cfg,
                    [
                        y.slice_mut()?,
                        x.slice(),
                        rm,
                        rv,
                        w,
                        b,
                        &self.eps,
                        &n64,
                        &c64,
                        &l64
                    ]
                )?;
            }
            return Ok((Batch::single(y), Saved::none()));
        }
        let mut mean = f64_zeros(&s, c)?;
        let mut var = f64_zeros(&s, c)?;
        let mut inv_std = CudaTensor::uninit(&s, &[c])?;
        let eps = f64::from(self.eps);
        let track = self.defer && ctx.updates_running_stats();
        if c > 0 {
            let inv = inv_std.slice_mut()?;
            if track {
                let d = self.tracking(ctx, c)?;
                let one = 1i32;
                launch!(
                    &s,
                    bn_stats,
                    per_feature(c),
                    [
                        x.slice(),
                        &mut mean,
                        &mut var,
                        inv,
                        &mut d.sum,
                        &mut d.sum_sq,
                        &eps,
                        &n64,
                        &c64,
                        &l64,
                        &one
                    ]
                )?;
            } else {
                let (mut dummy_a, mut dummy_b) = (f64_zeros(&s, 1)?, f64_zeros(&s, 1)?);
                let zero = 0i32;
                launch!(
                    &s,
                    bn_stats,
                    per_feature(c),
                    [
                        x.slice(),
                        &mut mean,
                        &mut var,
                        inv,
                        &mut dummy_a,
                        &mut dummy_b,
                        &eps,
                        &n64,
                        &c64,
                        &l64,
                        &zero
                    ]
                )?;
            }
        }
        let mut x_hat = CudaTensor::uninit(&s, x.shape())?;
        if !x.is_empty() {
            let (w, b) = (self.weight.slice(), self.bias.slice());
            launch!(
                &s,
                bn_forward,
                cfg,
                [
                    y.slice_mut()?,
                    x_hat.slice_mut()?,
                    x.slice(),
                    &mean,
                    inv_std.slice(),
                    w,
                    b,
                    &n64,
                    &c64,
                    &l64
                ]
            )?;
        }
        if ctx.updates_running_stats() && c > 0 {
            if track {
                let index = ctx.micro_batch().index;
                let micro_batches = ctx.micro_batches();
                let d = self.deferred.as_mut().expect("tracking made it");
                if let Some(seen) = d.seen.get_mut(index) {
                    *seen = true;
                }
                d.count += n * l;
                d.tracked += 1;
                if d.tracked >= micro_batches {
                    let d = self.deferred.take().expect("present");
                    self.update_running(&d.sum, &d.sum_sq, d.count, true)?;
                }
            } else {
                self.update_running(&mean, &var, n * l, false)?;
            }
        }
        Ok((Batch::single(y), Saved::new(vec![x_hat, inv_std])))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CudaTensor>,
        saved: Saved<CudaTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CudaTensor>, Error> {
        if let Some(e) = self.fault.take() {
            return Err(e);
        }
        self.settle()?;
        let s = self.stream.clone();
        let dy = input(grad_output, &s)?;
        let [x_hat, inv_std] =
            <[CudaTensor; 2]>::try_from(saved.into_tensors()).map_err(|v| Error::Arity {
                expected: 2,
                got: v.len(),
            })?;
        let (x_hat, inv_std) = (x_hat.on(&s)?, inv_std.on(&s)?);
        if x_hat.shape() != dy.shape() {
            return Err(shape_error(
                "BatchNorm::backward",
                x_hat.shape().to_vec(),
                dy.shape(),
            ));
        }
        let (n, c, l) = self.layout(&dy, "BatchNorm::backward")?;
        let (n64, c64, l64) = (n as u64, c as u64, l as u64);
        let mut dx = CudaTensor::uninit(&s, dy.shape())?;
        if c > 0 {
            let mut sum_dy = CudaTensor::uninit(&s, &[c])?;
            let mut sum_dy_xhat = CudaTensor::uninit(&s, &[c])?;
            let (sd, sdx) = (sum_dy.slice_mut()?, sum_dy_xhat.slice_mut()?);
            let (bg, wg) = (self.bias_grad.slice_mut()?, self.weight_grad.slice_mut()?);
            launch!(
                &s,
                bn_backward_sums,
                per_feature(c),
                [dy.slice(), x_hat.slice(), sd, sdx, bg, wg, &n64, &c64, &l64]
            )?;
            if !dy.is_empty() {
                let cfg = s.gpu().elementwise(dy.len());
                let w = self.weight.slice();
                launch!(
                    &s,
                    bn_backward_dx,
                    cfg,
                    [
                        dx.slice_mut()?,
                        dy.slice(),
                        x_hat.slice(),
                        inv_std.slice(),
                        w,
                        sum_dy.slice(),
                        sum_dy_xhat.slice(),
                        &n64,
                        &c64,
                        &l64
                    ]
                )?;
            }
        }
        Ok(Batch::single(dx))
    }

    fn parameters(&self) -> Vec<Param<'_, CudaTensor>> {
        weight_and_bias(
            (&self.weight, &self.weight_grad),
            (&self.bias, &self.bias_grad),
        )
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, CudaTensor>> {
        weight_and_bias_mut(
            (&mut self.weight, &mut self.weight_grad),
            (&mut self.bias, &mut self.bias_grad),
        )
    }

    fn zero_grad(&mut self) {
        let shape = [self.features()];
        let zeroed = CudaTensor::zeros(&self.stream, &shape)
            .and_then(|w| Ok((w, CudaTensor::zeros(&self.stream, &shape)?)));
        match zeroed {
            Ok((w, b)) => (self.weight_grad, self.bias_grad) = (w, b),
            Err(e) => self.fault = Some(e),
        }
    }

    fn defer_batch_norm(&mut self) -> bool {
        self.defer = true;
        true
    }
}
