//! The tensor trait the pipeline is generic over, and the devices a partition lives on.
//!
//! The pipeline never does arithmetic on activations: it splits batches into micro-batches,
//! concatenates outputs, moves values between partitions' devices, counts the bytes each
//! partition holds and sums the gradients of replicated inputs. Those five operations are
//! all a tensor type has to provide.

use std::fmt;

use crate::error::Error;

/// Where a partition's layers run.
///
/// Each partition gets one worker thread. [`Device::CpuCore`] pins that thread to a core
/// (on Linux; elsewhere it runs unpinned); [`Device::Cuda`] is for tensor types that live
/// on a GPU (the crate's [`CpuTensor`](crate::CpuTensor) refuses it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Device {
    /// Host memory, worker thread unpinned.
    #[default]
    Cpu,
    /// Host memory, worker thread pinned to this core.
    CpuCore(usize),
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// One pinned CPU device per core `0..n`: a worker per partition, each on its own core.
    pub fn cores(n: usize) -> Vec<Device> {
        (0..n).map(Device::CpuCore).collect()
    }

    /// Whether the memory is the host's.
    pub fn is_host(&self) -> bool {
        matches!(self, Device::Cpu | Device::CpuCore(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::CpuCore(core) => write!(f, "cpu core {core}"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

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
