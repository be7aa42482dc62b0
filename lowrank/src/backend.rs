//! The backend abstraction: the primitives PowerSGD needs, written once as a trait.
//!
//! An algorithm written against [`Backend`] runs unchanged on the CPU and on CUDA; the
//! backends differ in how they compute the primitives, never in what they compute.

use crate::{Dims, Element, NormalRng, Result};
use std::ops::RangeBounds;

/// A borrowed run of elements on some backend: `&[T]`, `&mut [T]`, or a cudarc view.
pub trait ViewLen {
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> ViewLen for &[T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
}

impl<T> ViewLen for &mut [T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
}

/// The primitives of low-rank gradient compression on one device.
///
/// Shapes follow [`Dims`]: `M` is `batch` row-major `n x m` matrices; `P` and `Q` are the
/// column-major thin factors (`n x r` and `m x r` per matrix). Every operation checks
/// every buffer's length against the shape and returns [`crate::Error`] on a mismatch;
/// none panics on bad input. Operations may run asynchronously on devices with streams;
/// [`Backend::download`] and [`Backend::synchronize`] wait for them.
pub trait Backend: Send + Sync {
    /// An owned buffer on this backend.
    type Buffer<T: Element>: Send + 'static;
    /// A shared view of (part of) a buffer.
    type View<'a, T: Element>: ViewLen;
    /// A mutable view of (part of) a buffer.
    type ViewMut<'a, T: Element>: ViewLen;

    /// Whether buffers live in host memory, so that reading a few elements back
    /// ([`Backend::download`]) costs a copy and no wait for a device: `true` for the CPU
    /// backend. Callers use it to learn at once what a device backend leaves on the
    /// device until later (such as a raised [`flag_nonfinite`](Backend::flag_nonfinite)).
    const HOST_RESIDENT: bool = false;

    /// A short description (`"cpu avx512 x2"`, `"cuda:0 NVIDIA H200"`).
    fn name(&self) -> String;

    /// A zeroed buffer of `len` elements. More than `isize::MAX` bytes, or memory the
    /// allocator refuses, is [`crate::Error::Alloc`] (or the device's error), never a panic
    /// or an abort.
    fn alloc<T: Element>(&self, len: usize) -> Result<Self::Buffer<T>>;
    /// A buffer holding a copy of `host`.
    fn upload<T: Element>(&self, host: &[T]) -> Result<Self::Buffer<T>>;
    /// Copies `src` into `dst` (which must have the same length), waiting for pending work.
    fn download<T: Element>(&self, src: Self::View<'_, T>, dst: &mut [T]) -> Result<()>;
    /// Number of elements of a buffer.
    fn buffer_len<T: Element>(buf: &Self::Buffer<T>) -> usize;
    /// A shared view of `range` of `buf`.
    fn view<'a, T: Element>(
        buf: &'a Self::Buffer<T>,
        range: impl RangeBounds<usize>,
    ) -> Result<Self::View<'a, T>>;
    /// A mutable view of `range` of `buf`.
    fn view_mut<'a, T: Element>(
        buf: &'a mut Self::Buffer<T>,
        range: impl RangeBounds<usize>,
    ) -> Result<Self::ViewMut<'a, T>>;
    /// Waits until all work issued on this backend has finished.
    fn synchronize(&self) -> Result<()>;

    /// `P = M Q` for each matrix of the batch.
    fn mq(
        &self,
        dims: Dims,
        m: Self::View<'_, f32>,
        q: Self::View<'_, f32>,
        p: Self::ViewMut<'_, f32>,
    ) -> Result<()>;

    /// `Q = Mᵀ P` for each matrix of the batch.
    fn mtp(
        &self,
        dims: Dims,
        m: Self::View<'_, f32>,
        p: Self::View<'_, f32>,
        q: Self::ViewMut<'_, f32>,
    ) -> Result<()>;

    /// `M = P Qᵀ` for each matrix of the batch, written into `m`.
    fn pqt(
        &self,
        dims: Dims,
        p: Self::View<'_, f32>,
        q: Self::View<'_, f32>,
        m: Self::ViewMut<'_, f32>,
    ) -> Result<()>;

    /// Error feedback fused with the first product: `x = g + e` written in place of `g`,
    /// then `P = x Q`. One pass over `g` and `e` instead of two.
    fn add_mq(
        &self,
        dims: Dims,
        g: Self::ViewMut<'_, f32>,
        e: Self::View<'_, f32>,
        q: Self::View<'_, f32>,
        p: Self::ViewMut<'_, f32>,
    ) -> Result<()>;

    /// Decompression fused with the error update: reads `x` from `m`, writes the
    /// approximation `M̂ = P Qᵀ` in its place and the new error `e = x - M̂` into `e`.
    fn pqt_error(
        &self,
        dims: Dims,
        p: Self::View<'_, f32>,
        q: Self::View<'_, f32>,
        m: Self::ViewMut<'_, f32>,
        e: Self::ViewMut<'_, f32>,
    ) -> Result<()>;

    /// [`pqt_error`](Backend::pqt_error) under a flag: `M̂ = P Qᵀ` is always written into
    /// `m`, and `e = x - M̂` only while `flag[0] == 0`; a raised flag leaves `e` exactly as
    /// it was. `flag` is a one-element buffer ([`flag_nonfinite`](Backend::flag_nonfinite)
    /// raises it) read where the data is: on a GPU inside the kernel, with no host wait.
    fn pqt_error_unflagged(
        &self,
        dims: Dims,
        p: Self::View<'_, f32>,
        q: Self::View<'_, f32>,
        m: Self::ViewMut<'_, f32>,
        e: Self::ViewMut<'_, f32>,
        flag: Self::View<'_, f32>,
    ) -> Result<()>;

    /// Raises `flag` (a one-element buffer) to `1.0` when any element of `x` is a NaN or
    /// an infinity; never lowers it. On a GPU the flag stays on the device (no host copy
    /// of `x`, no host wait), for [`copy_unflagged`](Backend::copy_unflagged) and
    /// [`pqt_error_unflagged`](Backend::pqt_error_unflagged) to read.
    fn flag_nonfinite(&self, x: Self::View<'_, f32>, flag: Self::ViewMut<'_, f32>) -> Result<()>;

    /// `dst = src` while `flag[0] == 0` (a one-element buffer); a raised flag leaves `dst`
    /// as it was.
    fn copy_unflagged(
        &self,
        src: Self::View<'_, f32>,
        dst: Self::ViewMut<'_, f32>,
        flag: Self::View<'_, f32>,
    ) -> Result<()>;

    /// Gram-Schmidt on the `r` columns of each of `batch` column-major `n x r` factors,
    /// in place, orthogonal to working precision.
    ///
    /// - **Two passes** of modified Gram-Schmidt ("twice is enough"): one pass loses
    ///   orthogonality in proportion to the condition number; two keep `max |PᵀP − I|`
    ///   within a few `ε_f32` for full-rank inputs of condition number up to about `10^5`.
    /// - **Normalisation as PyTorch's `_orthogonalize`:** each column is `c / ‖c‖` when
    ///   `eps == 0`, else `c / (‖c‖ + eps)` (its length shrunk by `‖c‖ / (‖c‖ + eps)`,
    ///   with `‖c‖` its norm after projection).
    /// - **Zero-column rule:** a column whose residual after projection, over both passes,
    ///   is at most `8 · ε_f32` of its norm (it depends on the earlier columns up to
    ///   rounding), or that is zero, is set to zero and stays zero: zero input never gives
    ///   NaN and `r > n` is handled (the surplus columns become zero).
    /// - **No overflow or underflow:** norms are computed on columns rescaled by a power of
    ///   two (exact) when their sum of squares would overflow or underflow, so finite
    ///   columns near `f32::MAX` or near the smallest normal are handled.
    /// - **Non-finite input propagates:** a NaN or infinity anywhere in a matrix makes
    ///   every element of that matrix NaN (so a loss scaler or a NaN check downstream sees
    ///   it); other matrices of the batch are unaffected.
    fn orthogonalize(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        x: Self::ViewMut<'_, f32>,
        eps: f32,
    ) -> Result<()>;

    /// [`orthogonalize`](Backend::orthogonalize), then every matrix left with fewer than
    /// `min(n, r)` non-zero columns (a zero or rank-deficient input) has its zero columns
    /// refilled and is orthogonalised again, up to [`REFILL_ATTEMPTS`](crate::REFILL_ATTEMPTS)
    /// times. Element `i` (column-major) of a refilled column gets
    /// [`refill_value(key, attempt, i)`](crate::refill_value): counter-based values that
    /// every backend computes bit for bit alike, drawn from no random stream and the same
    /// for every matrix of the batch, so equal inputs and keys give every rank the same
    /// result whatever the batching, and a matrix with enough non-zero columns is left
    /// exactly as `orthogonalize` left it.
    ///
    /// PowerSGD calls it on `Q` so that a zero column (from a zero or low-rank gradient)
    /// cannot stay zero forever under warm start. It runs where the data is: on a GPU
    /// inside the orthogonalisation kernel, with no host copy and no host wait.
    fn orthogonalize_refill(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        x: Self::ViewMut<'_, f32>,
        eps: f32,
        key: u64,
    ) -> Result<()>;

    /// `y += x`.
    fn add(&self, y: Self::ViewMut<'_, f32>, x: Self::View<'_, f32>) -> Result<()>;
    /// `x *= alpha`.
    fn scale(&self, x: Self::ViewMut<'_, f32>, alpha: f32) -> Result<()>;
    /// `dst = src`.
    fn copy<T: Element>(&self, src: Self::View<'_, T>, dst: Self::ViewMut<'_, T>) -> Result<()>;
    /// Sets every element to zero.
    fn zero<T: Element>(&self, x: Self::ViewMut<'_, T>) -> Result<()>;
    /// Converts between element types with round-to-nearest-even (`f32 <-> f16/bf16`).
    fn cast<S: Element, D: Element>(
        &self,
        src: Self::View<'_, S>,
        dst: Self::ViewMut<'_, D>,
    ) -> Result<()>;
    /// Fills `x` with standard-normal values drawn on the host from `rng`, so every
    /// backend produces the same values from the same generator state.
    fn fill_normal(&self, rng: &mut NormalRng, x: Self::ViewMut<'_, f32>) -> Result<()>;
}
