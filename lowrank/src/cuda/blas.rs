//! The three batched products as cuBLAS strided-batched SGEMMs, one call per operation
//! for the whole batch.
//!
//! cuBLAS is column-major. A row-major `n x m` matrix `M` is, read column-major with
//! leading dimension `m`, the `m x n` matrix `A = Mᵀ`. The factors are already
//! column-major (`P`: `n x r`, leading dimension `n`; `Q`: `m x r`, leading dimension `m`):
//!
//! - `P = M Q`: `C(n x r) = Aᵀ Q`: `gemm(T, N, n, r, k = m, A = M (lda m), B = Q (ldb m), C = P (ldc n))`;
//! - `Q = Mᵀ P`: `C(m x r) = A P`: `gemm(N, N, m, r, k = n, A = M (lda m), B = P (ldb n), C = Q (ldc m))`;
//! - `M = P Qᵀ`: row-major `M` is column-major `Mᵀ = Q Pᵀ` (`m x n`):
//!   `gemm(N, T, m, n, k = r, A = Q (lda m), B = P (ldb n), C = M (ldc m))`.
//!
//! Batch strides are `n·m` for `M`, `n·r` for `P` and `m·r` for `Q`. `alpha = 1`,
//! `beta = 0` (so the output's old contents are never read, NaN included). Empty shapes
//! never reach cuBLAS (a leading dimension of 0 is invalid there): an empty output is left
//! alone, and an empty inner dimension (`m = 0` for `M Q`, `n = 0` for `Mᵀ P`) zeroes the
//! output, as the empty sum.

use super::device::CudaBackend;
use super::kernels::driver_error;
use crate::{Dims, Error, Result};
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaView, CudaViewMut};

/// A shape's sizes as cuBLAS takes them (`int` dimensions, `long long` strides).
struct BlasDims {
    batch: i32,
    n: i32,
    m: i32,
    r: i32,
    m_stride: i64,
    p_stride: i64,
    q_stride: i64,
}

impl BlasDims {
    /// Converts, or [`Error::Overflow`] when the batch or a dimension exceeds `i32::MAX`.
    fn new(d: &Dims) -> Result<Self> {
        let overflow = || {
            Error::Overflow(format!(
                "{d} (cuBLAS takes the batch and each dimension as a 32-bit int)"
            ))
        };
        let int = |v: usize| i32::try_from(v).map_err(|_| overflow());
        let long = |v: usize| i64::try_from(v).map_err(|_| overflow());
        Ok(BlasDims {
            batch: int(d.batch())?,
            n: int(d.n())?,
            m: int(d.m())?,
            r: int(d.r())?,
            m_stride: long(d.n() * d.m())?,
            p_stride: long(d.n() * d.r())?,
            q_stride: long(d.m() * d.r())?,
        })
    }
}

/// `C = op(A) op(B)` with `alpha = 1`, `beta = 0`, strided over a batch.
fn config(
    ops: (cublasOperation_t, cublasOperation_t),
    (m, n, k): (i32, i32, i32),
    (lda, ldb, ldc): (i32, i32, i32),
    (stride_a, stride_b, stride_c): (i64, i64, i64),
    batch: i32,
) -> StridedBatchedConfig<f32> {
    StridedBatchedConfig {
        gemm: GemmConfig {
            transa: ops.0,
            transb: ops.1,
            m,
            n,
            k,
            alpha: 1.0,
            lda,
            ldb,
            beta: 0.0,
            ldc,
        },
        batch_size: batch,
        stride_a,
        stride_b,
        stride_c,
    }
}

impl CudaBackend {
    /// `P = M Q` for the batch. Lengths must have been checked against `d`.
    pub(super) fn gemm_mq(
        &self,
        d: &Dims,
        m: &CudaView<'_, f32>,
        q: &CudaView<'_, f32>,
        p: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        if d.p_len() == 0 {
            return Ok(());
        }
        if d.m() == 0 {
            return self.zero_f32(p);
        }
        let b = BlasDims::new(d)?;
        let cfg = config(
            (CUBLAS_OP_T, CUBLAS_OP_N),
            (b.n, b.r, b.m),
            (b.m, b.m, b.n),
            (b.m_stride, b.q_stride, b.p_stride),
            b.batch,
        );
        self.run_gemm(cfg, m, q, p)
    }

    /// `Q = Mᵀ P` for the batch. Lengths must have been checked against `d`.
    pub(super) fn gemm_mtp(
        &self,
        d: &Dims,
        m: &CudaView<'_, f32>,
        p: &CudaView<'_, f32>,
        q: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        if d.q_len() == 0 {
            return Ok(());
        }
        if d.n() == 0 {
            return self.zero_f32(q);
        }
        let b = BlasDims::new(d)?;
        let cfg = config(
            (CUBLAS_OP_N, CUBLAS_OP_N),
            (b.m, b.r, b.n),
            (b.m, b.n, b.m),
            (b.m_stride, b.p_stride, b.q_stride),
            b.batch,
        );
        self.run_gemm(cfg, m, p, q)
    }

    /// `M = P Qᵀ` for the batch. Lengths must have been checked against `d`.
    pub(super) fn gemm_pqt(
        &self,
        d: &Dims,
        p: &CudaView<'_, f32>,
        q: &CudaView<'_, f32>,
        m: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        if d.m_len() == 0 {
            return Ok(());
        }
        let b = BlasDims::new(d)?;
        let cfg = config(
            (CUBLAS_OP_N, CUBLAS_OP_T),
            (b.m, b.n, b.r),
            (b.m, b.n, b.m),
            (b.q_stride, b.p_stride, b.m_stride),
            b.batch,
        );
        self.run_gemm(cfg, q, p, m)
    }

    /// Issues one strided-batched SGEMM on the backend's stream.
    fn run_gemm(
        &self,
        cfg: StridedBatchedConfig<f32>,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        c: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        // cuBLAS works in the calling thread's current context, which cudarc's cuBLAS
        // wrapper does not set.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error)?;
        // SAFETY: the callers checked every buffer length against the shape, so `a`, `b`
        // and `c` hold `batch` matrices at their strides, each with the rows, columns and
        // leading dimensions of `cfg` (derived above from the same shape); all dimensions
        // are non-zero, so the leading dimensions are valid; `beta = 0`, so `c`'s old
        // contents are not read. The views keep their buffers alive for the call, and
        // cudarc orders the call after pending writes through their events.
        unsafe { self.blas.gemm_strided_batched(cfg, a, b, c) }
            .map_err(|e| Error::Cublas(format!("{e:?}")))
    }

    /// Sets an `f32` view to zero on the stream.
    pub(super) fn zero_f32(&self, x: &mut CudaViewMut<'_, f32>) -> Result<()> {
        if x.is_empty() {
            return Ok(());
        }
        self.stream.memset_zeros(x).map_err(driver_error)
    }
}
