//! Low-rank linear algebra for gradient compression, on the CPU and on CUDA.
//!
//! PowerSGD compresses a gradient matrix `M` (`n x m`) into thin factors `P` (`n x r`)
//! and `Q` (`m x r`). Its work is a handful of primitives, which this crate provides on
//! every backend behind one trait, [`Backend`]:
//!
//! - batched skinny products `P = M Q`, `Q = Mᵀ P`, `M = P Qᵀ` for `batch` same-shape
//!   matrices and rank `r` in `1..=`[`MAX_RANK`];
//! - batched modified Gram-Schmidt with a zero-column rule that never produces NaN;
//! - fused passes that save a sweep over memory: error feedback with the first product
//!   ([`Backend::add_mq`]), decompression with the error update ([`Backend::pqt_error`]);
//! - element-wise add, scale, copy, zero and `f32 <-> f16/bf16` casts;
//! - a seeded, serialisable standard-normal generator ([`NormalRng`]) drawn on the host, so
//!   every backend starts from the same random `Q`.
//!
//! Backends: [`CpuBackend`] (AVX-512, AVX2+FMA or portable kernels chosen at run time,
//! multi-threaded) and [`CudaBackend`] (cuBLAS and NVRTC kernels through `cudarc`, with the
//! `cuda` feature; without it the type exists and its constructor returns
//! [`Error::CudaNotCompiled`]).
//!
//! ```
//! use lowrank::{Backend, CpuBackend, Dims, NormalRng};
//! # fn main() -> lowrank::Result<()> {
//! let cpu = CpuBackend::new();
//! let dims = Dims::new(1, 64, 32, 4)?; // one 64 x 32 matrix, rank 4
//! let mut m = vec![0.0f32; dims.m_len()];
//! NormalRng::new(1).fill(&mut m);
//! let (mut p, mut q) = (vec![0.0; dims.p_len()], vec![0.0; dims.q_len()]);
//! cpu.fill_normal(&mut NormalRng::new(2), &mut q)?;
//! cpu.mq(dims, &m, &q, &mut p)?; // P = M Q
//! cpu.orthogonalize(1, 64, 4, &mut p, 0.0)?; // P has orthonormal columns
//! cpu.mtp(dims, &m, &p, &mut q)?; // Q = Mᵀ P
//! cpu.pqt(dims, &p, &q, &mut m)?; // M ≈ P Qᵀ, the rank-4 approximation
//! # Ok(()) }
//! ```
//!
//! The kernels are memory-bound: `cargo xtask bench lowrank` reports each product's read
//! bandwidth as a fraction of a plain SIMD sum over the same matrix.
#![deny(missing_docs)]

mod backend;
mod cpu;
mod cuda;
mod dims;
mod element;
mod error;
mod rng;

pub use backend::{Backend, ViewLen};
pub use cpu::{CpuBackend, Isa};
pub use cuda::CudaBackend;
pub use dims::Dims;
pub use element::{DeviceElement, Element};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use rng::{refill_value, NormalRng, REFILL_ATTEMPTS};

/// The largest rank of the thin factors that the backends support.
pub const MAX_RANK: usize = 64;
