//! The CPU layers on the device: [`Linear`] (cuBLAS), [`ReLU`], [`Dropout`] (the same
//! counter-based mask) and [`BatchNorm`] (per-micro-batch or deferred statistics).
//!
//! Each layer is made for one [`GpuStream`] (its partition's) and enqueues all its work
//! there; an input from another stream is moved to it first ([`CudaTensor::on`]).
use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::device::{driver, GpuStream, REDUCE_THREADS};
use super::tensor::CudaTensor;
use crate::error::Error;
use crate::layer::{Param, ParamMut};
use crate::microbatch::Batch;

/// The single tensor of a batch, brought to `stream` ([`CudaTensor::on`]).
pub(super) fn input(
    batch: Batch<CudaTensor>,
    stream: &Arc<GpuStream>,
) -> Result<CudaTensor, Error> {
    batch.into_single()?.on(stream)
}

pub(super) fn shape_error(op: &'static str, expected: Vec<usize>, got: &[usize]) -> Error {
    Error::Shape {
        op,
        expected,
        got: got.to_vec(),
    }
}

pub(super) fn int(v: usize) -> Result<i32, Error> {
    i32::try_from(v).map_err(|_| Error::Cuda(format!("{v} exceeds cuBLAS's 32-bit dimensions")))
}

/// A weight and a bias with their gradients, in the order every layer here lists them.
pub(super) fn weight_and_bias<'a>(
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
pub(super) fn weight_and_bias_mut<'a>(
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
pub(super) fn gemm(
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
        let stream: &$crate::cuda::GpuStream = $stream;
        let mut l = stream.cuda_stream().launch_builder(&stream.gpu().kernels().$kernel);
        $( l.arg($arg); )*
        // SAFETY: each call site passes the kernel's parameters in its order and types
        // (see kernels.cu), with buffers sized for the launch's element counts and
        // ordered on `stream`: read ones brought there by `CudaTensor::on` or `bring`
        // (the stream waited for their writes and is a recorded reader, so they are not
        // freed before the kernel ran, even if the caller then fails or unwinds), written
        // ones from `slice_mut` (unique, at home on `stream`) or scratch made there.
        unsafe { l.launch($cfg) }.map(drop).map_err($crate::cuda::device::driver)
    }};
}

pub(super) fn per_feature(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.max(1) as u32, 1, 1),
        block_dim: (REDUCE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn f64_zeros(stream: &GpuStream, len: usize) -> Result<CudaSlice<f64>, Error> {
    stream
        .cuda_stream()
        .alloc_zeros::<f64>(len.max(1))
        .map_err(driver)
}

mod activation;
mod batchnorm;
mod linear;

pub use activation::{Dropout, ReLU};
pub use batchnorm::BatchNorm;
pub use linear::Linear;
