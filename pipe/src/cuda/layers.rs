//! The CPU layers on the device: [`Linear`] (cuBLAS), [`ReLU`], [`Dropout`] (the same
//! counter-based mask) and [`BatchNorm`] (per-micro-batch or deferred statistics).
//!
//! Each layer is made for one [`GpuStream`] (its partition's) and enqueues all its work
//! there; an input from another stream is moved to it first ([`CudaTensor::on`]).

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::device::{driver, GpuStream, REDUCE_THREADS};
use super::tensor::CudaTensor;
use crate::cpu;
use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;

/// The single tensor of a batch, at home on `stream`.
fn input(batch: Batch<CudaTensor>, stream: &Arc<GpuStream>) -> Result<CudaTensor, Error> {
    batch.into_single()?.on(stream)
}

fn shape_error(op: &'static str, expected: Vec<usize>, got: &[usize]) -> Error {
    Error::Shape {
        op,
        expected,
        got: got.to_vec(),
    }
}

fn int(v: usize) -> Result<i32, Error> {
    i32::try_from(v).map_err(|_| Error::Cuda(format!("{v} exceeds cuBLAS's 32-bit dimensions")))
}

/// A weight and a bias with their gradients, in the order every layer here lists them.
fn weight_and_bias<'a>(
    (weight, weight_grad): (&'a CudaTensor, &'a CudaTensor),
    (bias, bias_grad): (&'a CudaTensor, &'a CudaTensor),
) -> Vec<Param<'a, CudaTensor>> {
    vec![
        Param {
            name: "weight",
            value: weight,
            grad: weight_grad,
        },
        Param {
            name: "bias",
            value: bias,
            grad: bias_grad,
        },
    ]
}

/// [`weight_and_bias`], mutably.
fn weight_and_bias_mut<'a>(
    (weight, weight_grad): (&'a mut CudaTensor, &'a mut CudaTensor),
    (bias, bias_grad): (&'a mut CudaTensor, &'a mut CudaTensor),
) -> Vec<ParamMut<'a, CudaTensor>> {
    vec![
        ParamMut {
            name: "weight",
            value: weight,
            grad: weight_grad,
        },
        ParamMut {
            name: "bias",
            value: bias,
            grad: bias_grad,
        },
    ]
}

/// `C = alpha op(A) op(B) + beta C` (column-major, cuBLAS's terms); every dimension > 0.
#[allow(clippy::too_many_arguments)]
fn gemm(
    stream: &GpuStream,
    (transa, transb): (cublasOperation_t, cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    a: &CudaSlice<f32>,
    lda: usize,
    b: &CudaSlice<f32>,
    ldb: usize,
    beta: f32,
    c: &mut CudaSlice<f32>,
    ldc: usize,
) -> Result<(), Error> {
    let cfg = GemmConfig {
        transa,
        transb,
        m: int(m)?,
        n: int(n)?,
        k: int(k)?,
        alpha: 1.0f32,
        lda: int(lda)?,
        ldb: int(ldb)?,
        beta,
        ldc: int(ldc)?,
    };
    stream
        .blas(|blas| {
            // SAFETY: the callers pass buffers holding at least the elements the
            // configuration addresses (checked shapes), all at home on `stream`, whose
            // handle this is; `c` is unique and not aliased by `a` or `b`.
            unsafe { blas.gemm(cfg, a, b, c) }
        })?
        .map_err(|e| Error::Cuda(format!("cuBLAS SGEMM: {e:?}")))
}

/// Launches an element-wise kernel over `len` elements on `stream`.
macro_rules! launch {
    ($stream:expr, $kernel:ident, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let stream: &GpuStream = $stream;
        let mut l = stream.cuda_stream().launch_builder(&stream.gpu().kernels().$kernel);
        $( l.arg($arg); )*
        // SAFETY: each call site passes the kernel's parameters in its order and types
        // (see kernels.cu), with buffers at home on `stream` sized for the launch's
        // element counts, written ones unique.
        unsafe { l.launch($cfg) }.map(drop).map_err(driver)
    }};
}

fn per_feature(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.max(1) as u32, 1, 1),
        block_dim: (REDUCE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn f64_zeros(stream: &GpuStream, len: usize) -> Result<CudaSlice<f64>, Error> {
    stream
        .cuda_stream()
        .alloc_zeros::<f64>(len.max(1))
        .map_err(driver)
}

/// `y = x W + b` on `[batch, inputs]`, `W` stored `[inputs, outputs]`: the products are
/// cuBLAS SGEMMs in full f32 (pedantic math: no TF32), on the layer's stream with its own
/// handle. Saves its input for backward. Weight gradients are never deferred.
pub struct Linear {
    stream: Arc<GpuStream>,
    weight: CudaTensor,
    bias: CudaTensor,
    weight_grad: CudaTensor,
    bias_grad: CudaTensor,
    fault: Option<Error>,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear")
            .field("weight", &self.weight.shape())
            .finish_non_exhaustive()
    }
}

impl Linear {
    /// The layer [`cpu::Linear::try_new`] makes from the same arguments, on `stream`.
    pub fn new(
        inputs: usize,
        outputs: usize,
        seed: u64,
        stream: &Arc<GpuStream>,
    ) -> Result<Self, Error> {
        Linear::from_cpu(&cpu::Linear::try_new(inputs, outputs, seed)?, stream)
    }

    /// A copy of a CPU layer's parameters on `stream` (gradients zero).
    pub fn from_cpu(layer: &cpu::Linear, stream: &Arc<GpuStream>) -> Result<Self, Error> {
        let (w, b) = (layer.weight(), layer.bias());
        Ok(Linear {
            stream: stream.clone(),
            weight: CudaTensor::from_cpu(w, stream)?,
            bias: CudaTensor::from_cpu(b, stream)?,
            weight_grad: CudaTensor::zeros(stream, w.shape())?,
            bias_grad: CudaTensor::zeros(stream, b.shape())?,
            fault: None,
        })
    }

    /// The weight, `[inputs, outputs]`.
    pub fn weight(&self) -> &CudaTensor {
        &self.weight
    }

    /// The bias, `[1, outputs]`.
    pub fn bias(&self) -> &CudaTensor {
        &self.bias
    }

    /// Brings the parameters and gradients to the layer's stream (a caller may have put
    /// tensors of another stream in through `parameters_mut`).
    fn settle(&mut self) -> Result<(), Error> {
        let s = self.stream.clone();
        for t in [
            &mut self.weight,
            &mut self.bias,
            &mut self.weight_grad,
            &mut self.bias_grad,
        ] {
            t.bring(&s)?;
        }
        Ok(())
    }

    fn dims(&self) -> (usize, usize) {
        (self.weight.shape()[0], self.weight.shape()[1])
    }
}

impl Layer<CudaTensor> for Linear {
    fn forward(
        &mut self,
        input_batch: Batch<CudaTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CudaTensor>, Saved<CudaTensor>), Error> {
        if let Some(e) = self.fault.take() {
            return Err(e);
        }
        self.settle()?;
        let s = &self.stream;
        let x = input(input_batch, s)?;
        let (inputs, outputs) = self.dims();
        if x.shape().len() != 2 || x.shape()[1] != inputs {
            return Err(shape_error("Linear::forward", vec![0, inputs], x.shape()));
        }
        let rows = x.shape()[0];
        let mut y = CudaTensor::uninit(s, &[rows, outputs])?;
        if rows * outputs > 0 {
            let (r, o) = (rows as u64, outputs as u64);
            let cfg = s.gpu().elementwise(rows * outputs);
            launch!(
                s,
                fill_rows,
                cfg,
                [y.slice_mut()?, self.bias.slice(), &r, &o]
            )?;
            if inputs > 0 {
                // Row-major y = x W is column-major yᵀ = Wᵀ xᵀ.
                let (w, xs) = (self.weight.slice(), x.slice());
                gemm(
                    s,
                    (CUBLAS_OP_N, CUBLAS_OP_N),
                    (outputs, rows, inputs),
                    w,
                    outputs,
                    xs,
                    inputs,
                    1.0,
                    y.slice_mut()?,
                    outputs,
                )?;
            }
        }
        Ok((Batch::single(y), Saved::new(vec![x])))
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
        let x = saved
            .into_tensors()
            .into_iter()
            .next()
            .ok_or(Error::Arity {
                expected: 1,
                got: 0,
            })?
            .on(&s)?;
        let (inputs, outputs) = self.dims();
        let rows = x.shape()[0];
        if dy.shape() != [rows, outputs] {
            return Err(shape_error(
                "Linear::backward",
                vec![rows, outputs],
                dy.shape(),
            ));
        }
        let mut dx = CudaTensor::zeros(&s, &[rows, inputs])?;
        if rows * inputs * outputs > 0 {
            // dx = dy Wᵀ: column-major dxᵀ = W dyᵀ.
            gemm(
                &s,
                (CUBLAS_OP_T, CUBLAS_OP_N),
                (inputs, rows, outputs),
                self.weight.slice(),
                outputs,
                dy.slice(),
                outputs,
                0.0,
                dx.slice_mut()?,
                inputs,
            )?;
            // dW += xᵀ dy: column-major dWᵀ += dyᵀ x.
            gemm(
                &s,
                (CUBLAS_OP_N, CUBLAS_OP_T),
                (outputs, inputs, rows),
                dy.slice(),
                outputs,
                x.slice(),
                inputs,
                1.0,
                self.weight_grad.slice_mut()?,
                outputs,
            )?;
        }
        if outputs > 0 {
            let (r, o, acc) = (rows as u64, outputs as u64, 1i32);
            let cfg = s.gpu().elementwise(outputs);
            launch!(
                &s,
                col_sum,
                cfg,
                [self.bias_grad.slice_mut()?, dy.slice(), &r, &o, &acc]
            )?;
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
        let zeroed = CudaTensor::zeros(&self.stream, self.weight.shape())
            .and_then(|w| Ok((w, CudaTensor::zeros(&self.stream, self.bias.shape())?)));
        match zeroed {
            Ok((w, b)) => (self.weight_grad, self.bias_grad) = (w, b),
            // The trait gives no error path: the next call reports it.
            Err(e) => self.fault = Some(e),
        }
    }
}

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

/// The sums a deferred batch norm accumulates over one mini-batch (on the device).
struct Deferred {
    step: Option<u64>,
    seen: Vec<bool>,
    sum: CudaSlice<f64>,
    sum_sq: CudaSlice<f64>,
    count: usize,
    tracked: usize,
}

/// [`cpu::BatchNorm`] on the device: `[batch, features, ...]`, statistics per feature in
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

    /// Deferred running statistics (see [`cpu::BatchNorm`]).
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
