//! The CUDA backend, or its stand-in when the `cuda` feature is off.

#[cfg(not(feature = "cuda"))]
mod stand_in {
    use crate::{Error, Result};

    /// The CUDA backend. This build has no CUDA support (the `cuda` feature is off), so
    /// [`CudaBackend::new`] always returns [`Error::CudaNotCompiled`].
    #[derive(Debug)]
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
