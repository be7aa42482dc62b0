//! The bridge between `lowrank` buffers and `collectives` process groups.

use crate::{Error, Result};
#[cfg(feature = "cuda")]
use collectives::DType;
use collectives::{Buffer, ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};
use lowrank::{Backend, CpuBackend, Element};

/// An element type that travels through a process group.
pub trait CommElement: Element {
    /// Wraps a host vector for a collective.
    fn wrap(v: Vec<Self>) -> Buffer;
    /// Unwraps a collective's result.
    fn unwrap(b: Buffer) -> collectives::Result<Vec<Self>>;
    /// Wraps a device buffer for a collective.
    #[cfg(feature = "cuda")]
    fn into_device(b: cudarc::driver::CudaSlice<Self>) -> collectives::DeviceBuffer;
    /// Unwraps a collective's device result.
    #[cfg(feature = "cuda")]
    fn from_device(
        b: collectives::DeviceBuffer,
    ) -> collectives::Result<cudarc::driver::CudaSlice<Self>>;
}

macro_rules! comm_element {
    ($($t:ty),*) => {$(
        impl CommElement for $t {
            fn wrap(v: Vec<Self>) -> Buffer {
                Buffer::from(v)
            }
            fn unwrap(b: Buffer) -> collectives::Result<Vec<Self>> {
                Vec::<$t>::try_from(b)
            }
            #[cfg(feature = "cuda")]
            fn into_device(b: cudarc::driver::CudaSlice<Self>) -> collectives::DeviceBuffer {
                b.into()
            }
            #[cfg(feature = "cuda")]
            fn from_device(
                b: collectives::DeviceBuffer,
            ) -> collectives::Result<cudarc::driver::CudaSlice<Self>> {
                b.try_into()
            }
        }
    )*};
}
comm_element!(f32, f16, bf16);

/// A backend whose buffers can be reduced through a [`ProcessGroup`]. The CPU backend
/// moves its vectors in and out without copying.
pub trait CommBackend: Backend + 'static {
    /// All-reduces `buf` over `pg`; the work gives the buffer back.
    fn all_reduce<T: CommElement>(
        &self,
        pg: &dyn ProcessGroup,
        buf: Self::Buffer<T>,
        op: ReduceOp,
    ) -> Work<Self::Buffer<T>>;

    /// A zeroed buffer of `len` elements whose allocation failure is an error, never an
    /// abort: [`Error::Overflow`] if `len` elements exceed `isize::MAX` bytes,
    /// [`Error::Alloc`] if the allocator refuses them. The default checks the size before
    /// calling [`Backend::alloc`] (a device allocator is never asked for more bytes than
    /// can exist) and maps its allocation error (`lowrank::Error::Alloc`) to those two.
    fn try_alloc<T: Element>(&self, len: usize) -> Result<Self::Buffer<T>> {
        check_bytes::<T>(len)?;
        Ok(self.alloc(len)?)
    }
}

/// Errors unless `len` elements of `T` fit in one allocation (`isize::MAX` bytes).
fn check_bytes<T>(len: usize) -> Result<()> {
    match len.checked_mul(size_of::<T>()) {
        Some(b) if b <= isize::MAX as usize => Ok(()),
        _ => Err(Error::buffer(len, size_of::<T>())),
    }
}

impl CommBackend for CpuBackend {
    fn all_reduce<T: CommElement>(
        &self,
        pg: &dyn ProcessGroup,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        pg.all_reduce(T::wrap(buf), op).then(|r| T::unwrap(r?))
    }

    /// As the default (the CPU backend's `alloc` is fallible), with the zeros written now:
    /// a bucket's storage is often read before it is written (gradients accumulated into
    /// it), and a lazily mapped page read first is the shared zero page, whose copy on the
    /// first write then costs a TLB flush of every core per page (see PowerSGD's error
    /// memory). One pass of writes maps every page writable at once.
    fn try_alloc<T: Element>(&self, len: usize) -> Result<Vec<T>> {
        let mut v = self.alloc(len)?;
        v.fill(T::default());
        Ok(v)
    }
}

#[cfg(feature = "cuda")]
impl CommBackend for lowrank::CudaBackend {
    /// Hands the device buffer to the group ([`ProcessGroup::all_reduce_device`]), which
    /// decides how to reduce it: NCCL in place on the device with no host copy or host
    /// wait; the thread and MPI backends by staging it through host memory in
    /// `collectives::device`. A group that narrows `f32` to 16 bits on the wire
    /// ([`ProcessGroup::narrowed`]: [`HalfWire`](crate::HalfWire), under the `fp16`/`bf16`
    /// hooks and the `fp16+`/`bf16+` wrappers) gets the buffer cast on the device, so only
    /// 16 bits an element go to its inner group, and the result is widened on the device
    /// (`wire_reduce`).
    fn all_reduce<T: CommElement>(
        &self,
        pg: &dyn ProcessGroup,
        buf: cudarc::driver::CudaSlice<T>,
        op: ReduceOp,
    ) -> Work<cudarc::driver::CudaSlice<T>> {
        match (T::into_device(buf), pg.narrowed()) {
            (collectives::DeviceBuffer::F32(b), Some(n)) => {
                wire_reduce(self, n.inner, b, n.wire, op).then(|r| T::from_device(r?.into()))
            }
            (buf, _) => pg.all_reduce_device(buf, op).then(|r| T::from_device(r?)),
        }
    }
}

/// `buf` reduced over `pg` as if sent in the `wire` format (`F32`, `F16`, `BF16`), cast
/// on the device: the one device-side narrowing path of the CUDA bridge, taken for every
/// narrowing group (the `fp16`/`bf16` hooks and wrappers).
#[cfg(feature = "cuda")]
fn wire_reduce(
    be: &lowrank::CudaBackend,
    pg: &dyn ProcessGroup,
    buf: cudarc::driver::CudaSlice<f32>,
    wire: DType,
    op: ReduceOp,
) -> Work<cudarc::driver::CudaSlice<f32>> {
    match wire {
        DType::F16 => device_wire::<f16>(be, pg, buf, op),
        DType::BF16 => device_wire::<bf16>(be, pg, buf, op),
        DType::F32 => be.all_reduce(pg, buf, op),
        other => Work::ready(Err(collectives::Error::InvalidArgument(format!(
            "all_reduce_wire sends F32, F16 or BF16, not {other:?}"
        )))),
    }
}

/// `f32` device buffer `buf` reduced over `inner` as `H` values: cast on the device,
/// reduced, widened back into `buf` on the device (in the continuation, after the
/// collective).
///
/// The casts run on the backend's stream. A buffer on another stream (not one the
/// backend allocated) is ordered both ways: the backend's stream waits for the buffer's
/// before the narrowing cast reads it, and the buffer's stream waits for the backend's
/// before the buffer is handed back or dropped, on every path.
#[cfg(feature = "cuda")]
fn device_wire<H: CommElement>(
    be: &lowrank::CudaBackend,
    inner: &dyn ProcessGroup,
    mut buf: cudarc::driver::CudaSlice<f32>,
    op: ReduceOp,
) -> Work<cudarc::driver::CudaSlice<f32>> {
    let kernel = |e: lowrank::Error| collectives::Error::Cuda {
        op: "CUDA cast".into(),
        message: e.to_string(),
    };
    let foreign = **buf.stream() != **be.stream();
    if foreign {
        if let Err(e) = be.stream().join(buf.stream()) {
            return Work::ready(Err(collectives::Error::Cuda {
                op: "ordering the cast after the buffer's stream".into(),
                message: format!("{e:?}"),
            }));
        }
    }
    // Back in the buffer's stream order: its later work (and its free) after the casts.
    let rejoin = move |buf: &cudarc::driver::CudaSlice<f32>, be: &lowrank::CudaBackend| {
        if foreign {
            if let Err(e) = buf.stream().join(be.stream()) {
                return Err(collectives::Error::Cuda {
                    op: "ordering the buffer's stream after the cast".into(),
                    message: format!("{e:?}"),
                });
            }
        }
        Ok(())
    };
    let narrow = || -> Result<cudarc::driver::CudaSlice<H>> {
        let mut half = be.alloc::<H>(buf.len())?;
        be.cast(buf.as_view(), half.as_view_mut())?;
        Ok(half)
    };
    let half = match narrow() {
        Ok(h) => h,
        Err(e) => return Work::ready(rejoin(&buf, be).and(Err(collectives::Error::from(e)))),
    };
    let be = be.clone();
    inner
        .all_reduce_device(H::into_device(half), op)
        .then(move |r| {
            let widened = r.and_then(|r| {
                let half = H::from_device(r)?;
                be.cast(half.as_view(), buf.as_view_mut()).map_err(kernel)
            });
            match rejoin(&buf, &be) {
                // The join failed: the buffer cannot be freed in order; leak it.
                Err(e) => {
                    std::mem::forget(buf);
                    Err(e)
                }
                Ok(()) => widened.map(|()| buf),
            }
        })
}
