//! A process group that carries `f32` buffers as 16-bit values: [`HalfWire`], over any
//! group (PyTorch's `fp16_compress_wrapper` and `bf16_compress_wrapper` are `ddp-hooks`'
//! hooks over it, and its `fp16`/`bf16` hooks are its `AllReduce`).
//!
//! An `f32` all-reduce through it is the inner group's
//! [`all_reduce_wire`](ProcessGroup::all_reduce_wire) (the thread backend fuses the
//! rounding into its reduction pass); its other collectives narrow into a 16-bit copy,
//! run on the inner group and widen the result into the original buffer. A caller
//! holding `f32` device buffers asks [`ProcessGroup::narrowed`] and casts them on the
//! device itself (`ddp-hooks`' CUDA bridge): this crate has no device kernels.

use crate::{Buffer, DType, ProcessGroup, ReduceOp, Result, Work};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::marker::PhantomData;
use std::sync::Arc;

/// A 16-bit format `f32` buffers travel in ([`struct@f16`], [`bf16`]): its element type, its
/// name, and the narrowing to its `Buffer` and back.
pub trait WireFormat: Send + Sync + 'static {
    /// The name of the format and of `ddp-hooks`' hook that sends it (`"fp16"`, `"bf16"`).
    const HOOK: &'static str;
    /// The format as a buffer element type ([`DType::F16`], [`DType::BF16`]).
    const DTYPE: DType;
    /// `f32` values rounded to this format; a copy that cannot be allocated is
    /// [`crate::Error::Alloc`].
    fn narrow(v: &[f32]) -> Result<Buffer>;
    /// The values of a buffer of this format, widened into `out`.
    fn widen(b: &Buffer, out: &mut [f32]) -> Result<()>;
}

impl WireFormat for f16 {
    const HOOK: &'static str = "fp16";
    const DTYPE: DType = DType::F16;
    fn narrow(v: &[f32]) -> Result<Buffer> {
        let mut h = Vec::<f16>::try_from(Buffer::try_zeros(DType::F16, v.len())?)?;
        h.convert_from_f32_slice(v);
        Ok(Buffer::F16(h))
    }
    fn widen(b: &Buffer, out: &mut [f32]) -> Result<()> {
        match b {
            Buffer::F16(h) if h.len() == out.len() => {
                h.convert_to_f32_slice(out);
                Ok(())
            }
            other => Err(crate::Error::Internal(format!(
                "expected {} f16 values, got {:?}",
                out.len(),
                other.dtype()
            ))),
        }
    }
}

impl WireFormat for bf16 {
    const HOOK: &'static str = "bf16";
    const DTYPE: DType = DType::BF16;
    fn narrow(v: &[f32]) -> Result<Buffer> {
        let mut h = Vec::<bf16>::try_from(Buffer::try_zeros(DType::BF16, v.len())?)?;
        h.convert_from_f32_slice(v);
        Ok(Buffer::BF16(h))
    }
    fn widen(b: &Buffer, out: &mut [f32]) -> Result<()> {
        match b {
            Buffer::BF16(h) if h.len() == out.len() => {
                h.convert_to_f32_slice(out);
                Ok(())
            }
            other => Err(crate::Error::Internal(format!(
                "expected {} bf16 values, got {:?}",
                out.len(),
                other.dtype()
            ))),
        }
    }
}

/// `len` zeros to widen a result into, or [`crate::Error::Alloc`].
fn zeros_f32(len: usize) -> Result<Vec<f32>> {
    Vec::try_from(Buffer::try_zeros(DType::F32, len)?)
}

/// A process group that sends `f32` buffers as 16-bit values (other types unchanged).
pub struct HalfWire<H> {
    inner: Arc<dyn ProcessGroup>,
    _format: PhantomData<fn() -> H>,
}

impl<H: WireFormat> HalfWire<H> {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn ProcessGroup>) -> Self {
        HalfWire {
            inner,
            _format: PhantomData,
        }
    }

    /// Narrows an `f32` buffer for the wire; returns it with the original to widen into.
    fn narrow(buf: Buffer) -> Result<(Buffer, Option<Vec<f32>>)> {
        Ok(match buf {
            Buffer::F32(v) => (H::narrow(&v)?, Some(v)),
            other => (other, None),
        })
    }

    fn widen(result: Result<Buffer>, original: Option<Vec<f32>>) -> Result<Buffer> {
        let b = result?;
        match original {
            Some(mut v) => {
                H::widen(&b, &mut v)?;
                Ok(Buffer::F32(v))
            }
            None => Ok(b),
        }
    }
}

crate::forward_group! {
    impl[H: WireFormat] ProcessGroup for HalfWire<H> {
        inner: |s| &s.inner;
        fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
            // The inner group rounds as the wire would (fused into its pass where it can).
            match buf {
                Buffer::F32(_) => self.inner.all_reduce_wire(buf, H::DTYPE, op),
                other => self.inner.all_reduce(other, op),
            }
        }
        /// A wire as wide as `f32` still travels in this group's format; a 16-bit one is
        /// the inner group's.
        fn all_reduce_wire(&self, buf: Buffer, wire: DType, op: ReduceOp) -> Work<Buffer> {
            if wire == DType::F32 {
                return self.all_reduce(buf, op);
            }
            self.inner.all_reduce_wire(buf, wire, op)
        }
        fn all_reduce_coalesced(&self, bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>> {
            let narrowed = bufs
                .into_iter()
                .map(Self::narrow)
                .collect::<Result<Vec<_>>>();
            let (wire, originals): (Vec<_>, Vec<_>) = match narrowed {
                Ok(n) => n.into_iter().unzip(),
                Err(e) => return Work::ready(Err(e)),
            };
            self.inner.all_reduce_coalesced(wire, op).then(move |r| {
                r?.into_iter()
                    .zip(originals)
                    .map(|(b, o)| Self::widen(Ok(b), o))
                    .collect()
            })
        }
        fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
            let (wire, original) = match Self::narrow(buf) {
                Ok(n) => n,
                Err(e) => return Work::ready(Err(e)),
            };
            self.inner
                .broadcast(wire, root)
                .then(move |r| Self::widen(r, original))
        }
        fn all_gather(&self, buf: Buffer) -> Work<Vec<Buffer>> {
            let (wire, original) = match Self::narrow(buf) {
                Ok(n) => n,
                Err(e) => return Work::ready(Err(e)),
            };
            let len = original.as_ref().map(Vec::len);
            self.inner.all_gather(wire).then(move |r| {
                r?.into_iter()
                    .map(|b| Self::widen(Ok(b), len.map(zeros_f32).transpose()?))
                    .collect()
            })
        }
        fn reduce_scatter(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
            let (wire, original) = match Self::narrow(buf) {
                Ok(n) => n,
                Err(e) => return Work::ready(Err(e)),
            };
            let chunk = original.as_ref().map(|v| v.len() / self.size().max(1));
            // The f32 result is allocated once the collective is done: this rank takes part
            // in it whatever the allocation does afterwards.
            self.inner.reduce_scatter(wire, op).then(move |r| {
                let b = r?;
                Self::widen(Ok(b), chunk.map(zeros_f32).transpose()?)
            })
        }
        /// Buffers other than `f32` go to the inner group as they are. An `f32` device
        /// buffer is staged through host memory and narrowed there: correct, but a copy;
        /// `ddp-hooks`' CUDA bridge never takes this path, it asks
        /// [`narrowed`](ProcessGroup::narrowed) and casts on the device.
        #[cfg(feature = "cuda")]
        fn all_reduce_device(
            &self,
            buf: crate::DeviceBuffer,
            op: ReduceOp,
        ) -> Work<crate::DeviceBuffer> {
            match buf {
                crate::DeviceBuffer::F32(_) => {
                    crate::device::staged(buf, |b| self.all_reduce(b, op))
                }
                other => self.inner.all_reduce_device(other, op),
            }
        }
        /// As [`all_reduce_device`](ProcessGroup::all_reduce_device).
        #[cfg(feature = "cuda")]
        fn broadcast_device(
            &self,
            buf: crate::DeviceBuffer,
            root: usize,
        ) -> Work<crate::DeviceBuffer> {
            match buf {
                crate::DeviceBuffer::F32(_) => {
                    crate::device::staged(buf, |b| self.broadcast(b, root))
                }
                other => self.inner.broadcast_device(other, root),
            }
        }
        /// The format and the inner group: a caller holding `f32` device buffers narrows
        /// and widens them on the device and hands the inner group 16-bit ones.
        /// (`device_native` is the inner group's: device buffers reach it without host
        /// copies when the caller narrows them on the device.)
        fn narrowed(&self) -> Option<crate::Narrowed<'_>> {
            Some(crate::Narrowed {
                wire: H::DTYPE,
                inner: &*self.inner,
            })
        }
        fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
            Ok(self
                .inner
                .new_group(ranks)?
                .map(|g| Box::new(HalfWire::<H>::new(Arc::from(g))) as Box<dyn ProcessGroup>))
        }
    }
}
