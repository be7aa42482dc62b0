//! The crate's one error type.

/// Everything that can go wrong in `lowrank`. Bad input is always reported here, never by
/// a panic.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The rank of the thin factors is outside `1..=MAX_RANK`.
    #[error("rank r = {0} is out of range: it must be in 1..={max}", max = crate::MAX_RANK)]
    InvalidRank(usize),
    /// A buffer does not have the number of elements its role in the shape requires.
    #[error("buffer `{name}` has {actual} elements, but {dims} needs exactly {expected}")]
    BufferSize {
        /// The buffer's role (`"m"`, `"p"`, `"q"`, ...).
        name: &'static str,
        /// What the shape requires.
        expected: usize,
        /// What was passed.
        actual: usize,
        /// The shape, printed.
        dims: String,
    },
    /// Two buffers of an element-wise operation differ in length.
    #[error("length mismatch: `{a}` has {len_a} elements, `{b}` has {len_b}")]
    LengthMismatch {
        /// Name of the first buffer.
        a: &'static str,
        /// Its length.
        len_a: usize,
        /// Name of the second buffer.
        b: &'static str,
        /// Its length.
        len_b: usize,
    },
    /// A shape whose element count does not fit in `usize`.
    #[error("shape {0} overflows the address space")]
    Overflow(String),
    /// A buffer that cannot be allocated: `elements` of `element_bytes` bytes each exceed
    /// `isize::MAX` bytes (no allocation can hold them), or the allocator refused them
    /// (out of memory, or an address-space limit).
    #[error(
        "cannot allocate a buffer of {elements} elements of {element_bytes} bytes each: {}",
        alloc_reason(*.elements, *.element_bytes)
    )]
    Alloc {
        /// Elements requested.
        elements: usize,
        /// Bytes per element.
        element_bytes: usize,
    },
    /// A sub-range of a buffer is out of bounds.
    #[error("range {start}..{end} is out of bounds for a buffer of {len} elements")]
    OutOfBounds {
        /// First index.
        start: usize,
        /// One past the last index.
        end: usize,
        /// The buffer's length.
        len: usize,
    },
    /// A thread count of zero.
    #[error("the thread count must be at least 1")]
    InvalidThreads,
    /// Epsilon must be finite and non-negative.
    #[error("orthogonalisation epsilon must be finite and >= 0, got {0}")]
    InvalidEpsilon(f32),
    /// A scale factor that is not finite.
    #[error("scale factor must be finite, got {0}")]
    InvalidScale(f32),
    /// An instruction set was requested that this CPU does not have.
    #[error("this CPU does not support the {0} instruction set")]
    UnsupportedIsa(&'static str),
    /// The crate was built without the `cuda` feature.
    #[error("lowrank was compiled without CUDA support: enable its `cuda` feature")]
    CudaNotCompiled,
    /// A CUDA library (driver, cuBLAS, NVRTC) could not be loaded, or no device exists.
    #[error("CUDA is unavailable: {0}")]
    CudaUnavailable(String),
    /// An error reported by the CUDA driver.
    #[error("CUDA driver error: {0}")]
    Cuda(String),
    /// An error reported by cuBLAS.
    #[error("cuBLAS error: {0}")]
    Cublas(String),
    /// NVRTC failed to compile the crate's kernels.
    #[error("NVRTC failed to compile the kernels: {0}")]
    Nvrtc(String),
}

/// Why `elements` of `element_bytes` bytes could not be allocated, for [`Error::Alloc`].
fn alloc_reason(elements: usize, element_bytes: usize) -> &'static str {
    match elements.checked_mul(element_bytes) {
        Some(bytes) if bytes <= isize::MAX as usize => "out of memory",
        _ => "more than isize::MAX bytes, larger than any allocation",
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
