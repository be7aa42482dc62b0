//! The CUDA backend, or its stand-in when the `cuda` feature is off.
//!
//! With the feature: `device.rs` (the type, construction, launch helpers), `ops.rs` (the
//! [`crate::Backend`] implementation), `blas.rs` (the products on cuBLAS) and `kernels.rs`
//! (the CUDA C source, `kernels.cu`, compiled by NVRTC, and the kernel handles).

#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod ops;

#[cfg(feature = "cuda")]
pub use device::CudaBackend;

#[cfg(not(feature = "cuda"))]
mod stand_in {
    use crate::{Error, Result};

    /// The CUDA backend. This build has no CUDA support (the `cuda` feature is off), so
    /// [`CudaBackend::new`] always returns [`Error::CudaNotCompiled`].
    #[derive(Clone, Debug)]
    pub struct CudaBackend {
        _never: std::convert::Infallible,
    }

    impl CudaBackend {
        /// Always [`Error::CudaNotCompiled`] in this build.
        pub fn new(_ordinal: usize) -> Result<Self> {
            Err(Error::CudaNotCompiled)
        }
    }
}

#[cfg(not(feature = "cuda"))]
pub use stand_in::CudaBackend;
