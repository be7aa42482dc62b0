//! The tensor trait the pipeline is generic over, and the devices a partition lives on.
//!
//! The pipeline never does arithmetic on activations: it splits batches into micro-batches,
//! concatenates outputs, moves values between partitions' devices, counts the bytes each
//! partition holds and sums the gradients of replicated inputs. Those five operations are
//! all a tensor type has to provide.

use crate::error::Error;
use crate::vocab::Device;

/// What the pipeline needs from a tensor: its batch dimension is the first one.
///
/// Every method reports bad input (sizes that do not add up, shapes that do not match, a
/// device the type cannot use) as an [`Error`], never a panic.
pub trait Tensor: Clone + Send + 'static {
    /// Length along the batch dimension (the first one).
    fn batch_len(&self) -> usize;

    /// Splits along the batch dimension into consecutive pieces of the given sizes, which
    /// must add up to [`batch_len`](Tensor::batch_len).
    fn split(&self, sizes: &[usize]) -> Result<Vec<Self>, Error>;

    /// Concatenates along the batch dimension, in order. Fails on no parts or on parts whose
    /// other dimensions differ.
    fn concat(parts: Vec<Self>) -> Result<Self, Error>;

    /// Bytes of storage this tensor holds: what the pipeline counts as memory held.
    fn size_bytes(&self) -> usize;

    /// Adds `other` element-wise into `self` (gradient accumulation). Shapes must match.
    fn accumulate(&mut self, other: &Self) -> Result<(), Error>;

    /// Moves to `device`; a tensor already there comes back unchanged, without a copy.
    fn to_device(self, device: &Device) -> Result<Self, Error>;
}
