//! The CUDA C source of the backend's kernels (`kernels.cu`), compiled once per backend
//! by NVRTC, and the handles of the compiled functions.
//!
//! The source includes no header at all, so NVRTC needs no include path: the half and
//! bfloat16 conversions are written on the raw bit patterns (`unsigned short`) and are
//! bit-for-bit the ones of the `half` crate that the CPU backend uses (round to nearest,
//! ties to even; infinities, subnormals and overflow to infinity handled exactly; a NaN
//! stays a NaN with its payload truncated and its quiet bit set). Only NVRTC built-ins are
//! used (`__shfl_down_sync`, `__syncthreads`, `__float_as_uint`, `sqrtf`, `fmaf`, the
//! `__f*_rn` intrinsics, `float4`). The source compiles with NVRTC 12.9 and 13.x, for
//! `compute_90` and for NVRTC's default architecture.
//!
//! Compilation pins IEEE behaviour: no flush-to-zero, correctly rounded division and
//! square root, so `1 / (norm + eps)` and `sqrt` match the CPU's `f32` operations.
//! `orthogonalize` for `n < 8` repeats the CPU's scalar operations one thread per matrix,
//! unfused and in the CPU's order, so its results there are bit-identical to the CPU's
//! (this is where the zero-column rule is most sensitive to rounding, e.g. `r > n`).

use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, DriverError};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};
use std::sync::Arc;

/// Threads per block of the element-wise kernels.
pub(super) const ELEMENTWISE_THREADS: u32 = 256;
/// Threads per block of `lr_pqt_error` (fixed by its tiling: `PE_THREADS`, checked
/// against the source below).
pub(super) const PQT_ERROR_THREADS: u32 = 256;
/// Rows of `M` in one `lr_pqt_error` tile.
pub(super) const PQT_ERROR_ROWS: usize = 32;
/// Columns of `M` in one `lr_pqt_error` tile.
pub(super) const PQT_ERROR_COLS: usize = 128;
/// Most threads per block of `lr_orthogonalize` (its shared arrays hold 32 warps).
pub(super) const ORTHO_MAX_THREADS: usize = 1024;
/// Below this `n`, `lr_orthogonalize` runs one thread per matrix (`OG_SERIAL_N`).
pub(super) const ORTHO_SERIAL_N: usize = 8;

/// The kernels. Every index is 64-bit; every loop is grid-stride, so any grid size works.
/// (In `kernels.cu`, loaded with `include_str!`.)
pub(super) const SOURCE: &str = include_str!("kernels.cu");

/// The `(source, destination)` element names of the cast kernels, `lr_cast_{src}_{dst}`.
const CASTS: [(&str, &str); 6] = [
    ("f32", "f16"),
    ("f32", "bf16"),
    ("f16", "f32"),
    ("bf16", "f32"),
    ("f16", "bf16"),
    ("bf16", "f16"),
];

/// Handles of the compiled kernels (each keeps the module loaded).
#[derive(Debug)]
pub(super) struct Kernels {
    /// `lr_add(float* y, const float* x, u64 n)`.
    pub(super) add: CudaFunction,
    /// `lr_scale(float* x, float alpha, u64 n)`.
    pub(super) scale: CudaFunction,
    /// `lr_pqt_error(const float* p, const float* q, float* m, float* e, u64 batch, u64 n,
    /// u64 m, u32 r, const float* flag)` (`flag` may be null).
    pub(super) pqt_error: CudaFunction,
    /// `lr_flag_nonfinite(const float* x, float* flag, u64 n)`.
    pub(super) flag_nonfinite: CudaFunction,
    /// `lr_copy_unflagged(const float* src, float* dst, const float* flag, u64 n)`.
    pub(super) copy_unflagged: CudaFunction,
    /// `lr_orthogonalize(float* x, u64 batch, u64 n, u32 r, float eps, float tol, u64 key,
    /// u32 refill)`.
    pub(super) orthogonalize: CudaFunction,
    /// `lr_orthogonalize_serial`, the same arguments: one thread a matrix, for
    /// `n < ORTHO_SERIAL_N`.
    pub(super) orthogonalize_serial: CudaFunction,
    /// `lr_cast_{src}_{dst}(const S* src, D* dst, u64 n)` for the pairs of [`CASTS`].
    casts: Vec<((&'static str, &'static str), CudaFunction)>,
}

impl Kernels {
    /// Compiles the source for the device of `ctx` and loads every kernel.
    pub(super) fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx.compute_capability().map_err(driver_error)?;
        let ptx = compile(major, minor)?;
        let module = ctx.load_module(ptx).map_err(load_error)?;
        let function = |name: &str| {
            module.load_function(name).map_err(|e| {
                Error::Cuda(format!(
                    "kernel `{name}` not found in the compiled module: {e:?}"
                ))
            })
        };
        let mut casts = Vec::with_capacity(CASTS.len());
        for (src, dst) in CASTS {
            casts.push(((src, dst), function(&format!("lr_cast_{src}_{dst}"))?));
        }
        Ok(Kernels {
            add: function("lr_add")?,
            scale: function("lr_scale")?,
            pqt_error: function("lr_pqt_error")?,
            flag_nonfinite: function("lr_flag_nonfinite")?,
            copy_unflagged: function("lr_copy_unflagged")?,
            orthogonalize: function("lr_orthogonalize")?,
            orthogonalize_serial: function("lr_orthogonalize_serial")?,
            casts,
        })
    }

    /// The kernel converting elements named `src` into elements named `dst`.
    pub(super) fn cast(&self, src: &str, dst: &str) -> Result<&CudaFunction> {
        self.casts
            .iter()
            .find(|((s, d), _)| *s == src && *d == dst)
            .map(|(_, f)| f)
            .ok_or_else(|| Error::Cuda(format!("no cast kernel from {src} to {dst}")))
    }
}

/// Compiles [`SOURCE`] to PTX for `compute_{major}{minor}`; if NVRTC rejects that
/// architecture (an NVRTC older than the device), compiles for NVRTC's default virtual
/// architecture instead, which the driver JIT-compiles for the device. Returns the first
/// error when both fail.
fn compile(major: i32, minor: i32) -> Result<Ptx> {
    let options = |arch: Option<String>| CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        options: arch.into_iter().collect(),
        name: Some("lowrank_kernels.cu".into()),
        ..Default::default()
    };
    let arch = format!("--gpu-architecture=compute_{major}{minor}");
    match compile_ptx_with_opts(SOURCE, options(Some(arch))) {
        Ok(ptx) => Ok(ptx),
        Err(first) => compile_ptx_with_opts(SOURCE, options(None)).map_err(|_| nvrtc_error(first)),
    }
}

/// An NVRTC failure with its log, readable.
fn nvrtc_error(e: CompileError) -> Error {
    match e {
        CompileError::CompileError {
            nvrtc,
            options,
            log,
        } => Error::Nvrtc(format!(
            "{nvrtc:?} with options {options:?}:\n{}",
            log.to_string_lossy()
        )),
        other => Error::Nvrtc(format!("{other:?}")),
    }
}

/// A driver error, as [`Error::Cuda`] with its Debug text (name and description).
pub(super) fn driver_error(e: DriverError) -> Error {
    Error::Cuda(format!("{e:?}"))
}

/// A failure to load the compiled PTX, with a hint for the usual cause.
fn load_error(e: DriverError) -> Error {
    use cudarc::driver::sys::CUresult;
    let hint = match e.0 {
        CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            " (the NVRTC library is newer than the CUDA driver: update the driver or put an \
             NVRTC of the driver's CUDA version first on LD_LIBRARY_PATH)"
        }
        _ => "",
    };
    Error::Cuda(format!("loading the compiled kernels failed: {e:?}{hint}"))
}

#[cfg(test)]
mod tests {
    /// The kernel source compiles for Hopper (`compute_90`) and for NVRTC's default
    /// architecture. NVRTC needs no GPU, so this runs wherever `libnvrtc` is present (the
    /// CUDA toolkit, or the `nvidia-cuda-nvrtc` wheel on `LD_LIBRARY_PATH`): a syntax error
    /// in the CUDA C is caught on machines without a GPU too.
    /// The Rust side's copies of the source's `#define`s (launch sizes, tile shape, the
    /// serial-path bound, the rank limit, the refill attempts) agree with it: a kernel
    /// launched with another block size than its tiling assumes would leave rows unwritten.
    #[test]
    fn constants_match_the_source() {
        let define = |name: &str| -> u64 {
            let line = super::SOURCE
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("no #define {name}"));
            let value = line.split_whitespace().nth(2).unwrap();
            value.trim_end_matches("ull").parse().unwrap()
        };
        assert_eq!(define("PE_THREADS"), u64::from(super::PQT_ERROR_THREADS));
        assert_eq!(define("PE_ROWS"), super::PQT_ERROR_ROWS as u64);
        assert_eq!(define("PE_COLS"), super::PQT_ERROR_COLS as u64);
        assert_eq!(define("OG_SERIAL_N"), super::ORTHO_SERIAL_N as u64);
        assert_eq!(define("OG_MAX_WARPS") * 32, super::ORTHO_MAX_THREADS as u64);
        assert_eq!(define("LR_MAX_RANK"), crate::MAX_RANK as u64);
        assert_eq!(define("LR_REFILL_ATTEMPTS"), crate::REFILL_ATTEMPTS);
    }

    #[test]
    fn source_compiles_with_nvrtc() {
        // SAFETY: `is_culib_present` only tries to open each candidate library name.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            println!("skipped: libnvrtc not found");
            return;
        }
        for (major, minor) in [(9, 0), (8, 0)] {
            if let Err(e) = super::compile(major, minor) {
                panic!("NVRTC rejected the kernels for compute_{major}{minor}: {e}");
            }
        }
    }
}
