//! How tensors cross ranks: [`Wire`], a pair of methods that write a tensor's elements as
//! bytes with its shape and read them back, implemented for
//! [`CpuTensor`](crate::cpu::CpuTensor) and (feature `candle`) candle tensors.

use crate::error::Error;
use crate::tensor::Tensor;
use crate::vocab::Device;

/// A tensor's element type (a code of the tensor type's own choosing) and shape, as the
/// frame header carries them; the bytes follow in the frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WireMeta {
    /// The element type, as the implementing tensor type numbers its types.
    pub dtype: u8,
    /// The shape, batch dimension first.
    pub shape: Vec<usize>,
}

/// A tensor that can cross ranks: [`write_wire`](Wire::write_wire) appends its elements
/// to a frame and returns its type and shape; [`read_wire`](Wire::read_wire) builds the
/// tensor back from them on the receiving stage's device. Shapes travel with every
/// message, so micro-batches of different sizes and activations whose shape changes
/// between steps need no declaration.
pub trait Wire: Tensor {
    /// Appends the elements (in the type's canonical order, little-endian) to `out` and
    /// returns the type and shape that [`read_wire`](Wire::read_wire) needs.
    fn write_wire(&self, out: &mut Vec<u8>) -> Result<WireMeta, Error>;

    /// The tensor of `meta` from its `bytes` (exactly the bytes `write_wire` appended),
    /// on `device`. Bytes that do not fit the shape and type are an error, never a
    /// panic.
    fn read_wire(meta: &WireMeta, bytes: &[u8], device: &Device) -> Result<Self, Error>;
}
