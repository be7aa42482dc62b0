//! [`BatchNorm`]: normalisation with per-micro-batch statistics, and its deferred mode
//! (torchgpipe's `DeferredBatchNorm`): running statistics accumulated over a whole
//! mini-batch and committed once.

use super::same_shape;
use crate::cpu::CpuTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;
use crate::storage;
use crate::tensor::Tensor;

/// Batch normalisation over `[batch, features, ...]`, one mean and variance per feature,
/// reduced over the batch and any trailing dimensions, with a learned scale and shift.
///
/// In training it normalises each micro-batch with that micro-batch's statistics (so, like
/// torchgpipe's plain batch norm, it is *not* transparent to chunking) and folds them into
/// running statistics with `momentum`: the running variance uses the unbiased estimate, as
/// PyTorch's does. A recomputation (checkpointing) and a profiling pass leave the running
/// statistics alone ([`Context::updates_running_stats`]). In evaluation it normalises with
/// the running statistics. Statistics are reduced in `f64`.
///
/// # Deferred running statistics
///
/// [`BatchNorm::deferred`] (or [`Layer::defer_batch_norm`], which a pipe built with
/// [`deferred_batch_norm(true)`](crate::PipeBuilder::deferred_batch_norm) calls) is
/// torchgpipe's `DeferredBatchNorm`: each micro-batch's sums of `x` and `x²` are
/// accumulated, and once the last micro-batch of the mini-batch has been seen
/// ([`Context::micro_batches`], the actual count) the running statistics are updated
/// once, with the mean and unbiased variance of the whole mini-batch. They then equal
/// those of plain batch norm run on the whole batch. (torchgpipe commits the biased
/// variance, which differs from `nn.BatchNorm`'s by `N / (N - 1)`; this one matches plain
/// batch norm.)
///
/// Only a micro-batch's first forward pass is counted: a recomputation (checkpointing)
/// adds nothing. Accumulation restarts when the step number changes, and when a
/// micro-batch already counted comes again at the same step (a new pass over the
/// mini-batch, as when a step number is reused): a micro-batch is never counted twice, and
/// the sums of a pass that did not reach its last micro-batch are dropped, never committed.
/// A [`Pipe`](crate::Pipe) gives a training run that fails a step number of its own (see
/// [`Pipe::step_number`](crate::Pipe::step_number)), so the partial sums of a failed step
/// never reach the running statistics, whatever order the retry's schedule runs the
/// micro-batches in.
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
    deferred: Option<Deferred>,
}

/// The sums a deferred batch norm accumulates over one mini-batch's micro-batches.
#[derive(Debug, Clone, Default)]
struct Deferred {
    /// The step the sums belong to.
    step: Option<u64>,
    /// Per micro-batch of the mini-batch, whether it is counted.
    seen: Vec<bool>,
    sum: Vec<f64>,
    sum_squares: Vec<f64>,
    /// Elements reduced per feature.
    count: usize,
    /// Micro-batches seen.
    tracked: usize,
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

fn row_major(t: &CpuTensor, op: &'static str) -> Result<Vec<f32>, Error> {
    storage::collect(op, t.array().len(), t.array().iter().copied())
}

/// `len` copies of `value`, allocated fallibly.
fn filled<T: Clone>(op: &'static str, len: usize, value: T) -> Result<Vec<T>, Error> {
    let mut v = storage::with_capacity(op, len)?;
    v.resize(len, value);
    Ok(v)
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

    /// Batch norm with a momentum and an epsilon of your own. PyTorch's `momentum=None`
    /// (the cumulative average over the batches seen, with `num_batches_tracked`) has no
    /// equivalent here.
    ///
    /// # Panics
    /// If the parameters of `features` features cannot be allocated;
    /// [`try_with`](BatchNorm::try_with) returns that as an error.
    pub fn with(features: usize, momentum: f32, eps: f32) -> Self {
        BatchNorm::try_with(features, momentum, eps).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`with`](BatchNorm::with), or [`Error::Alloc`] if the parameters and statistics of
    /// `features` features exceed `isize::MAX` bytes or the allocator refuses them.
    pub fn try_with(features: usize, momentum: f32, eps: f32) -> Result<Self, Error> {
        let shape = [features];
        Ok(BatchNorm {
            momentum,
            eps,
            weight: CpuTensor::try_ones(&shape)?,
            bias: CpuTensor::try_zeros(&shape)?,
            weight_grad: CpuTensor::try_zeros(&shape)?,
            bias_grad: CpuTensor::try_zeros(&shape)?,
            running_mean: CpuTensor::try_zeros(&shape)?,
            running_var: CpuTensor::try_ones(&shape)?,
            deferred: None,
        })
    }

    /// Batch norm with PyTorch's defaults and deferred running statistics (torchgpipe's
    /// `DeferredBatchNorm`; see the [type docs](BatchNorm#deferred-running-statistics)).
    pub fn deferred(features: usize) -> Self {
        let mut bn = BatchNorm::new(features);
        bn.defer();
        bn
    }

    /// Switches to deferred running statistics (nothing changes if already deferred).
    pub fn defer(&mut self) {
        self.deferred.get_or_insert_with(Deferred::default);
    }

    /// Whether the running statistics are deferred.
    pub fn is_deferred(&self) -> bool {
        self.deferred.is_some()
    }

    /// Folds a mini-batch's mean and biased variance over `count` elements per feature
    /// into the running statistics.
    fn update_running(&mut self, mean: &[f64], var: &[f64], count: usize) {
        let unbiased = if count > 1 {
            count as f64 / (count - 1) as f64
        } else {
            1.0
        };
        let m = f64::from(self.momentum);
        let rm = self.running_mean.array_mut();
        rm.iter_mut()
            .zip(mean)
            .for_each(|(r, &v)| *r = ((1.0 - m) * f64::from(*r) + m * v) as f32);
        let rv = self.running_var.array_mut();
        rv.iter_mut()
            .zip(var)
            .for_each(|(r, &v)| *r = ((1.0 - m) * f64::from(*r) + m * v * unbiased) as f32);
    }

    /// Deferred mode: adds one micro-batch's sums, and commits once the mini-batch's last
    /// micro-batch is in.
    /// Fails (changing nothing) only if a new mini-batch's sums cannot be allocated.
    fn track(&mut self, data: &[f32], layout: &Layout, ctx: &Context) -> Result<(), Error> {
        const OP: &str = "BatchNorm::forward";
        let Some(acc) = &self.deferred else {
            return Ok(());
        };
        let index = ctx.micro_batch().index;
        let fresh = if acc.step != Some(ctx.step())
            || acc.sum.len() != layout.c
            || acc.seen.len() != ctx.micro_batches()
            || acc.seen.get(index).copied().unwrap_or(false)
        {
            Some(Deferred {
                step: Some(ctx.step()),
                seen: filled(OP, ctx.micro_batches(), false)?,
                sum: filled(OP, layout.c, 0.0)?,
                sum_squares: filled(OP, layout.c, 0.0)?,
                count: 0,
                tracked: 0,
            })
        } else {
            None
        };
        let Some(mut acc) = fresh.or_else(|| self.deferred.take()) else {
            return Ok(());
        };
        layout.each(|ch, k| {
            let v = f64::from(data[k]);
            acc.sum[ch] += v;
            acc.sum_squares[ch] += v * v;
        });
        if let Some(seen) = acc.seen.get_mut(index) {
            *seen = true;
        }
        acc.count += layout.count();
        acc.tracked += 1;
        if acc.tracked >= ctx.micro_batches() {
            let cnt = acc.count.max(1) as f64;
            let mean: Vec<f64> = acc.sum.iter().map(|s| s / cnt).collect();
            let var: Vec<f64> = (acc.sum_squares.iter().zip(&mean))
                .map(|(sq, m)| (sq / cnt - m * m).max(0.0))
                .collect();
            self.update_running(&mean, &var, acc.count);
            acc = Deferred::default();
        }
        self.deferred = Some(acc);
        Ok(())
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
        const OP: &str = "BatchNorm::forward";
        let data = row_major(&x, OP)?;
        let (w, b) = (self.weight.to_vec(), self.bias.to_vec());
        let cnt = layout.count().max(1) as f32;
        if !ctx.is_training() {
            let (rm, rv) = (self.running_mean.to_vec(), self.running_var.to_vec());
            let mut y = storage::zeros(OP, data.len())?;
            layout.each(|ch, k| {
                y[k] = w[ch] * (data[k] - rm[ch]) / (rv[ch] + self.eps).sqrt() + b[ch];
            });
            return Ok((Batch::single(tensor(x.shape(), y)?), Saved::none()));
        }
        let mut sum = vec![0.0f64; layout.c];
        layout.each(|ch, k| sum[ch] += f64::from(data[k]));
        let mean64: Vec<f64> = sum.iter().map(|s| s / f64::from(cnt)).collect();
        let mut sq = vec![0.0f64; layout.c];
        layout.each(|ch, k| sq[ch] += (f64::from(data[k]) - mean64[ch]).powi(2));
        let var: Vec<f64> = sq.iter().map(|s| s / f64::from(cnt)).collect();
        let inv_std: Vec<f32> = var
            .iter()
            .map(|v| (1.0 / (v + f64::from(self.eps)).sqrt()) as f32)
            .collect();
        let mean: Vec<f32> = mean64.iter().map(|&m| m as f32).collect();
        // The outputs exist before the running statistics change: a failed forward
        // leaves them as they were.
        let mut x_hat = storage::zeros(OP, data.len())?;
        let mut y = storage::zeros(OP, data.len())?;
        if ctx.updates_running_stats() {
            if self.deferred.is_some() {
                self.track(&data, &layout, ctx)?;
            } else {
                self.update_running(&mean64, &var, layout.count());
            }
        }
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
        const OP: &str = "BatchNorm::backward";
        let (g, xh, inv, w) = (
            row_major(&dy, OP)?,
            row_major(&x_hat, OP)?,
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
        let mut dx = storage::zeros(OP, g.len())?;
        layout.each(|ch, k| {
            dx[k] = w[ch] * inv[ch] / cnt * (cnt * g[k] - sum_dy[ch] - xh[k] * sum_dy_xhat[ch]);
        });
        self.weight_grad
            .accumulate(&tensor(&[layout.c], sum_dy_xhat)?)?;
        self.bias_grad.accumulate(&tensor(&[layout.c], sum_dy)?)?;
        Ok(Batch::single(tensor(dy.shape(), dx)?))
    }

    fn parameters(&self) -> Vec<Param<'_, CpuTensor>> {
        super::weight_and_bias(
            (&self.weight, &self.weight_grad),
            (&self.bias, &self.bias_grad),
        )
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, CpuTensor>> {
        super::weight_and_bias_mut(
            (&mut self.weight, &mut self.weight_grad),
            (&mut self.bias, &mut self.bias_grad),
        )
    }

    fn zero_grad(&mut self) {
        self.weight_grad.array_mut().fill(0.0);
        self.bias_grad.array_mut().fill(0.0);
    }

    fn defer_batch_norm(&mut self) -> bool {
        self.defer();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::microbatch::MicroBatch;
    use crate::vocab::Phase;

    /// Micro-batch `index` (of 2, 3 rows each) at step 5.
    fn ctx(index: usize, phase: Phase) -> Context {
        Context::new(true, 0, 5, 3)
            .with_micro_batches(2)
            .with_micro_batch(MicroBatch {
                index,
                offset: 3 * index,
                len: 3,
            })
            .with_phase(phase)
    }

    fn rows(salt: f32) -> Batch<CpuTensor> {
        let data = (0..6).map(|k| salt + k as f32 * k as f32 / 7.0).collect();
        Batch::single(tensor(&[3, 2], data).unwrap())
    }

    fn run(bn: &mut BatchNorm, x: Batch<CpuTensor>, index: usize, phase: Phase) {
        bn.forward(x, &mut ctx(index, phase)).unwrap();
    }

    /// A pass that stopped after micro-batch 0, then a full pass at the same step: the
    /// first pass's sums are dropped, and the recomputation counts nothing.
    #[test]
    fn a_micro_batch_seen_again_at_the_same_step_starts_over() {
        let mut want = BatchNorm::deferred(2);
        run(&mut want, rows(1.0), 0, Phase::Forward);
        run(&mut want, rows(2.0), 1, Phase::Forward);

        let mut bn = BatchNorm::deferred(2);
        run(&mut bn, rows(-4.0), 0, Phase::Forward);
        run(&mut bn, rows(1.0), 0, Phase::Forward);
        run(&mut bn, rows(1.0), 0, Phase::Recompute);
        assert_eq!(
            bn.running_mean().to_vec(),
            vec![0.0; 2],
            "nothing committed yet"
        );
        run(&mut bn, rows(2.0), 1, Phase::Forward);
        assert_ne!(want.running_mean().to_vec(), vec![0.0; 2]);
        assert_eq!(bn.running_mean().to_vec(), want.running_mean().to_vec());
        assert_eq!(bn.running_var().to_vec(), want.running_var().to_vec());
    }
}
