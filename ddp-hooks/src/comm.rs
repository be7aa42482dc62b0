//! The bridge between `lowrank` buffers and `collectives` process groups.

use crate::{Error, Result};
use collectives::{Buffer, DType, ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};
use lowrank::{Backend, CpuBackend, Element};

/// An element type that travels through a process group.
pub trait CommElement: Element {
    /// Wraps a host vector for a collective.
    fn wrap(v: Vec<Self>) -> Buffer;
    /// Unwraps a collective's result.
    fn unwrap(b: Buffer) -> collectives::Result<Vec<Self>>;
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

    /// All-reduces the `f32` buffer `buf` as if sent in the `wire` format, through
    /// [`ProcessGroup::all_reduce_wire`], when this backend's buffers can go to the group
    /// as they are; otherwise hands `buf` back (`Err`), and the caller casts it itself
    /// (the default: a device buffer is better cast on the device, so that only 16 bits
    /// cross the bus).
    fn all_reduce_wire(
        &self,
        pg: &dyn ProcessGroup,
        buf: Self::Buffer<f32>,
        wire: DType,
        op: ReduceOp,
    ) -> std::result::Result<Work<Self::Buffer<f32>>, Self::Buffer<f32>> {
        let _ = (pg, wire, op);
        Err(buf)
    }

    /// A zeroed buffer of `len` elements whose allocation failure is an error, never an
    /// abort: [`Error::Overflow`] if `len` elements exceed `isize::MAX` bytes,
    /// [`Error::Alloc`] if the allocator refuses them. The default relies on
    /// [`Backend::alloc`] failing with an error (true of device allocators); the CPU
    /// backend overrides it, because its `alloc` aborts on failure like `vec!`.
    fn try_alloc<T: Element>(&self, len: usize) -> Result<Self::Buffer<T>> {
        check_bytes::<T>(len)?;
        Ok(self.alloc(len)?)
    }
}

/// Errors unless `len` elements of `T` fit in one allocation (`isize::MAX` bytes).
fn check_bytes<T>(len: usize) -> Result<()> {
    match len.checked_mul(size_of::<T>()) {
        Some(b) if b <= isize::MAX as usize => Ok(()),
        _ => Err(Error::Overflow(format!(
            "a buffer of {len} elements of {} bytes",
            size_of::<T>()
        ))),
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

    fn all_reduce_wire(
        &self,
        pg: &dyn ProcessGroup,
        buf: Vec<f32>,
        wire: DType,
        op: ReduceOp,
    ) -> std::result::Result<Work<Vec<f32>>, Vec<f32>> {
        Ok(pg
            .all_reduce_wire(Buffer::F32(buf), wire, op)
            .then(|r| f32::unwrap(r?)))
    }

    fn try_alloc<T: Element>(&self, len: usize) -> Result<Vec<T>> {
        check_bytes::<T>(len)?;
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| Error::Alloc {
            elements: len,
            element_bytes: size_of::<T>(),
        })?;
        v.resize(len, T::default());
        Ok(v)
    }
}

#[cfg(feature = "cuda")]
impl CommBackend for lowrank::CudaBackend {
    /// Stages the device buffer through host memory: download, reduce over the group,
    /// upload into the same device buffer on its stream.
    fn all_reduce<T: CommElement>(
        &self,
        pg: &dyn ProcessGroup,
        buf: cudarc::driver::CudaSlice<T>,
        op: ReduceOp,
    ) -> Work<cudarc::driver::CudaSlice<T>> {
        let backend =
            |e: cudarc::driver::DriverError| collectives::Error::Backend(format!("CUDA: {e:?}"));
        let stream = buf.stream().clone();
        let host = match stream
            .clone_dtoh(&buf)
            .and_then(|h| stream.synchronize().map(|_| h))
        {
            Ok(h) => h,
            Err(e) => return Work::ready(Err(backend(e))),
        };
        pg.all_reduce(T::wrap(host), op).then(move |r| {
            let host = T::unwrap(r?)?;
            let mut buf = buf;
            stream.memcpy_htod(&host, &mut buf).map_err(backend)?;
            stream.synchronize().map_err(backend)?;
            Ok(buf)
        })
    }
}
