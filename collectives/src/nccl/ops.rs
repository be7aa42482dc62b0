//! The collectives, as the progress thread runs them: host buffers staged through device
//! buffers on the group's stream, and callers' device buffers used in place.
//!
//! Every operation issues its NCCL calls, then waits for the stream with
//! [`Engine::finish`] (bounded, polling NCCL's asynchronous error) before copying results
//! back, so a host buffer is never written by a copy still queued behind a collective.
//! Empty buffers issue no NCCL call (every rank has the same lengths, so every rank skips
//! alike; debug mode still compares descriptors).

use super::comm::Watch;
use super::engine::{driver, Engine};
use crate::{Buffer, DType, Error, ReduceOp, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{result, sys};
use half::{bf16, f16};

/// An element type of [`Buffer`] that NCCL moves natively: `f32`, `f64`, `f16` and
/// `bf16`, which it also reduces, and `u8` (raw bytes, [`DType::U8`]), which it only
/// moves: a reduction of `u8` buffers is [`Error::InvalidArgument`], before anything is
/// queued. Sealed.
pub trait NcclElement:
    DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + 'static + sealed::Sealed
{
    /// The matching [`DType`].
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! elements {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl NcclElement for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

elements!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, u8 => U8);

/// NCCL's name for a type (`U8` travels as `ncclUint8`; the reductions reject it before
/// they get here).
pub(super) fn nccl_type(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::U8 => sys::ncclDataType_t::ncclUint8,
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
    }
}

/// NCCL's reduction; `Avg` is NCCL's own `ncclAvg` (sum, then divide by the rank count).
fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// Device addresses as NCCL takes them.
pub(super) fn src(ptr: u64) -> *const std::ffi::c_void {
    ptr as *const std::ffi::c_void
}

pub(super) fn dst(ptr: u64) -> *mut std::ffi::c_void {
    ptr as *mut std::ffi::c_void
}

impl Engine {
    /// A device copy of `bytes` (not empty) on the group's stream.
    pub(super) fn upload(&self, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        self.stream
            .clone_htod(bytes)
            .map_err(driver("copying a buffer to the device"))
    }

    /// Copies `src` (as long as `dst`) back to the host, and waits for the copy.
    pub(super) fn download(
        &self,
        src: &CudaSlice<u8>,
        dst: &mut [u8],
        watch: &Watch<'_>,
    ) -> Result<()> {
        self.stream
            .memcpy_dtoh(src, dst)
            .map_err(driver("copying a result to the host"))?;
        self.finish(watch)
    }

    /// In-place all-reduce of equal-typed device buffers `(address, elements, type)`,
    /// grouped into one NCCL launch when there are several.
    fn all_reduce_raw(
        &self,
        parts: &[(u64, usize, DType)],
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<()> {
        let issue_all = |engine: &Engine| {
            for &(ptr, count, dtype) in parts {
                engine.issue(watch, "ncclAllReduce", |comm, stream| {
                    // SAFETY: `ptr` is a device allocation of `count` elements of `dtype`,
                    // kept alive by the caller until the stream has finished with it; NCCL
                    // allows the in-place form (send = receive buffer).
                    unsafe {
                        result::all_reduce(
                            src(ptr),
                            dst(ptr),
                            count,
                            nccl_type(dtype),
                            nccl_op(op),
                            comm,
                            stream,
                        )
                    }
                })?;
            }
            Ok(())
        };
        match parts.len() {
            0 => Ok(()),
            1 => issue_all(self),
            _ => self.grouped(watch, issue_all),
        }
    }

    /// All-reduces host buffers (several: one grouped NCCL launch), in place.
    pub fn all_reduce_host(
        &self,
        bufs: &mut [Buffer],
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<()> {
        let mut staged: Vec<(usize, CudaSlice<u8>)> = Vec::with_capacity(bufs.len());
        for (i, buf) in bufs.iter().enumerate().filter(|(_, b)| !b.is_empty()) {
            staged.push((i, self.upload(buf.as_bytes())?));
        }
        {
            let mut guards = Vec::with_capacity(staged.len());
            let mut parts = Vec::with_capacity(staged.len());
            for (i, dev) in staged.iter_mut() {
                let (ptr, guard) = dev.device_ptr_mut(&self.stream);
                parts.push((ptr, bufs[*i].len(), bufs[*i].dtype()));
                guards.push(guard);
            }
            self.all_reduce_raw(&parts, op, watch)?;
        }
        self.finish(watch)?;
        for (i, dev) in &staged {
            self.download(dev, bufs[*i].as_bytes_mut(), watch)?;
        }
        Ok(())
    }

    /// Broadcasts a host buffer from `root`, in place.
    pub fn broadcast_host(&self, buf: &mut Buffer, root: usize, watch: &Watch<'_>) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self.upload(buf.as_bytes())?;
        self.broadcast_raw(&mut dev, buf.len(), buf.dtype(), root, watch)?;
        self.finish(watch)?;
        self.download(&dev, buf.as_bytes_mut(), watch)
    }

    fn broadcast_raw<T>(
        &self,
        dev: &mut CudaSlice<T>,
        count: usize,
        dtype: DType,
        root: usize,
        watch: &Watch<'_>,
    ) -> Result<()> {
        let root = i32::try_from(root).map_err(|_| {
            crate::Error::InvalidArgument(format!("broadcast root {root} is too large"))
        })?;
        let (ptr, _write) = dev.device_ptr_mut(&self.stream);
        self.issue(watch, "ncclBroadcast", |comm, stream| {
            // SAFETY: `ptr` is a live device allocation of `count` elements of `dtype`
            // (kept alive by the caller until the stream has finished with it); the
            // in-place form is allowed.
            unsafe {
                result::broadcast(
                    src(ptr),
                    dst(ptr),
                    count,
                    nccl_type(dtype),
                    root,
                    comm,
                    stream,
                )
            }
        })
    }

    /// Every rank's copy of a host buffer, in rank order (this rank's included).
    pub fn all_gather_host(&self, buf: &Buffer, watch: &Watch<'_>) -> Result<Vec<Buffer>> {
        let size = self.shared.size;
        if buf.is_empty() {
            return Ok(vec![Buffer::zeros(buf.dtype(), 0); size]);
        }
        let bytes = buf.as_bytes().len();
        let total = bytes.checked_mul(size).ok_or(Error::Alloc {
            elements: buf.len().saturating_mul(size),
            element_bytes: buf.dtype().size(),
        })?;
        let send = self.upload(buf.as_bytes())?;
        let mut recv = self
            .stream
            .alloc_zeros::<u8>(total)
            .map_err(driver("allocating the all_gather result"))?;
        self.all_gather_raw(&send, &mut recv, buf.len(), buf.dtype(), watch)?;
        self.finish(watch)?;
        let mut all = crate::buffer::try_zeroed_vec::<u8>(total)?;
        self.download(&recv, &mut all, watch)?;
        all.chunks_exact(bytes)
            .map(|chunk| {
                let mut out = Buffer::try_zeros(buf.dtype(), buf.len())?;
                out.as_bytes_mut().copy_from_slice(chunk);
                Ok(out)
            })
            .collect()
    }

    fn all_gather_raw<T>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        count: usize,
        dtype: DType,
        watch: &Watch<'_>,
    ) -> Result<()> {
        let (from, _read) = send.device_ptr(&self.stream);
        let (to, _write) = recv.device_ptr_mut(&self.stream);
        self.issue(watch, "ncclAllGather", |comm, stream| {
            // SAFETY: `from` holds `count` elements of `dtype` and `to` `count * size`,
            // both live device allocations kept until the stream has finished with them.
            unsafe { result::all_gather(src(from), dst(to), count, nccl_type(dtype), comm, stream) }
        })
    }

    /// This rank's reduced chunk of a host buffer of `size` equal chunks.
    pub fn reduce_scatter_host(
        &self,
        buf: &Buffer,
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<Buffer> {
        let chunk = buf.len() / self.shared.size;
        let mut out = Buffer::try_zeros(buf.dtype(), chunk)?;
        if chunk == 0 {
            return Ok(out);
        }
        let send = self.upload(buf.as_bytes())?;
        let mut recv = self
            .stream
            .alloc_zeros::<u8>(out.as_bytes().len())
            .map_err(driver("allocating the reduce_scatter result"))?;
        self.reduce_scatter_raw(&send, &mut recv, chunk, buf.dtype(), op, watch)?;
        self.finish(watch)?;
        self.download(&recv, out.as_bytes_mut(), watch)?;
        Ok(out)
    }

    fn reduce_scatter_raw<T>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        chunk: usize,
        dtype: DType,
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<()> {
        let (from, _read) = send.device_ptr(&self.stream);
        let (to, _write) = recv.device_ptr_mut(&self.stream);
        self.issue(watch, "ncclReduceScatter", |comm, stream| {
            // SAFETY: `from` holds `chunk * size` elements of `dtype` and `to` `chunk`,
            // both live device allocations kept until the stream has finished with them.
            unsafe {
                result::reduce_scatter(
                    src(from),
                    dst(to),
                    chunk,
                    nccl_type(dtype),
                    nccl_op(op),
                    comm,
                    stream,
                )
            }
        })
    }

    /// Completes once every rank has called it: an all-reduce of one element.
    pub fn barrier(&self, watch: &Watch<'_>) -> Result<()> {
        let mut one = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(driver("allocating the barrier's element"))?;
        {
            let (ptr, _write) = one.device_ptr_mut(&self.stream);
            self.all_reduce_raw(&[(ptr, 1, DType::F32)], ReduceOp::Sum, watch)?;
        }
        self.finish(watch)
    }

    /// All-reduces callers' device buffers in place (several: one grouped launch).
    pub fn all_reduce_device<T: NcclElement>(
        &self,
        bufs: &mut [CudaSlice<T>],
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<()> {
        for buf in bufs.iter() {
            self.follow(buf.stream())?;
        }
        {
            let mut guards = Vec::with_capacity(bufs.len());
            let mut parts = Vec::with_capacity(bufs.len());
            for buf in bufs.iter_mut().filter(|b| !b.is_empty()) {
                let len = buf.len();
                let (ptr, guard) = buf.device_ptr_mut(&self.stream);
                parts.push((ptr, len, T::DTYPE));
                guards.push(guard);
            }
            self.all_reduce_raw(&parts, op, watch)?;
        }
        self.finish(watch)
    }

    /// Broadcasts a caller's device buffer from `root`, in place.
    pub fn broadcast_device<T: NcclElement>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
        watch: &Watch<'_>,
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        self.follow(buf.stream())?;
        let len = buf.len();
        self.broadcast_raw(buf, len, T::DTYPE, root, watch)?;
        self.finish(watch)
    }

    /// Every rank's copy of a device buffer, concatenated in rank order, in a new buffer
    /// on the group's stream. An empty buffer comes back as it is.
    pub fn all_gather_device<T: NcclElement>(
        &self,
        buf: CudaSlice<T>,
        watch: &Watch<'_>,
    ) -> Result<CudaSlice<T>> {
        if buf.is_empty() {
            return Ok(buf);
        }
        self.follow(buf.stream())?;
        let held = Held::new(self, buf);
        let mut out = self
            .stream
            .alloc_zeros::<T>(held.len() * self.shared.size)
            .map_err(driver("allocating the all_gather result"))?;
        self.all_gather_raw(&held, &mut out, held.len(), T::DTYPE, watch)?;
        self.finish(watch)?;
        held.done();
        Ok(out)
    }

    /// This rank's reduced chunk of a device buffer of `size` equal chunks, in a new
    /// buffer on the group's stream. An empty buffer comes back as it is.
    pub fn reduce_scatter_device<T: NcclElement>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
        watch: &Watch<'_>,
    ) -> Result<CudaSlice<T>> {
        let chunk = buf.len() / self.shared.size;
        if chunk == 0 {
            return Ok(buf);
        }
        self.follow(buf.stream())?;
        let held = Held::new(self, buf);
        let mut out = self
            .stream
            .alloc_zeros::<T>(chunk)
            .map_err(driver("allocating the reduce_scatter result"))?;
        self.reduce_scatter_raw(&held, &mut out, chunk, T::DTYPE, op, watch)?;
        self.finish(watch)?;
        held.done();
        Ok(out)
    }
}

/// An input buffer that an operation consumes, held while NCCL may use it: dropped at
/// once by [`done`](Held::done) after a success (the stream has finished with it), and
/// on every other way out, an error or a panic unwinding through the operation,
/// released in stream order ([`Engine::release`]), so its memory is never freed under a
/// kernel that may still read it.
struct Held<'a, T> {
    engine: &'a Engine,
    buf: Option<CudaSlice<T>>,
}

impl<'a, T> Held<'a, T> {
    fn new(engine: &'a Engine, buf: CudaSlice<T>) -> Self {
        Held {
            engine,
            buf: Some(buf),
        }
    }

    /// The operation completed on the device: the buffer may be freed at once.
    fn done(mut self) {
        drop(self.buf.take());
    }
}

impl<T> std::ops::Deref for Held<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        self.buf.as_ref().expect("held until done or dropped")
    }
}

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.engine.release(buf);
        }
    }
}
