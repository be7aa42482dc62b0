//! Device buffers in process groups (feature `cuda`).
//!
//! A [`DeviceBuffer`] is a `cudarc` [`CudaSlice`] of one of the element types of
//! [`Buffer`]. Every [`ProcessGroup`](crate::ProcessGroup) takes it through
//! [`all_reduce_device`](crate::ProcessGroup::all_reduce_device),
//! [`broadcast_device`](crate::ProcessGroup::broadcast_device) and the point-to-point
//! [`send_device`](crate::ProcessGroup::send_device),
//! [`recv_device`](crate::ProcessGroup::recv_device) and
//! [`batch_isend_irecv_device`](crate::ProcessGroup::batch_isend_irecv_device); **the
//! group decides** how:
//!
//! - NCCL ([`NcclGroup`](crate::nccl::NcclGroup)) reduces it in place on the device, on
//!   its stream after the work already queued on the buffer's stream (cudarc's events),
//!   with no host copy, and never blocks the caller
//!   ([`device_native`](crate::ProcessGroup::device_native) is `true`);
//! - every other backend (threads, MPI) stages it through host memory here, in
//!   [`staged`]: download (waiting for the buffer's stream), the host collective, upload
//!   into the same buffer. This is the only place in the workspace that stages.
//!
//! A caller (the `ddp-hooks` CUDA bridge) hands device buffers to the group whatever the
//! backend, so hooks are written once; whether bytes cross the bus is the group's business
//! and is visible through `device_native`.

use crate::{Buffer, DType, Error, Result, Work};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError};
use half::{bf16, f16};
use std::sync::Arc;

/// A device buffer of one of [`Buffer`]'s element types, owned, on any stream of any
/// device (a backend may require its own device: NCCL does).
#[derive(Debug)]
pub enum DeviceBuffer {
    /// 32-bit floats.
    F32(CudaSlice<f32>),
    /// 64-bit floats.
    F64(CudaSlice<f64>),
    /// IEEE half precision.
    F16(CudaSlice<f16>),
    /// bfloat16.
    BF16(CudaSlice<bf16>),
    /// Raw bytes ([`DType::U8`]): moved by point-to-point operations and broadcasts,
    /// never reduced (a reduction of one is [`Error::InvalidArgument`]).
    U8(CudaSlice<u8>),
}

impl DeviceBuffer {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            DeviceBuffer::F32(_) => DType::F32,
            DeviceBuffer::F64(_) => DType::F64,
            DeviceBuffer::F16(_) => DType::F16,
            DeviceBuffer::BF16(_) => DType::BF16,
            DeviceBuffer::U8(_) => DType::U8,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            DeviceBuffer::F32(b) => b.len(),
            DeviceBuffer::F64(b) => b.len(),
            DeviceBuffer::F16(b) => b.len(),
            DeviceBuffer::BF16(b) => b.len(),
            DeviceBuffer::U8(b) => b.len(),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The stream the buffer was allocated on (its work is ordered there).
    pub fn stream(&self) -> &Arc<CudaStream> {
        match self {
            DeviceBuffer::F32(b) => b.stream(),
            DeviceBuffer::F64(b) => b.stream(),
            DeviceBuffer::F16(b) => b.stream(),
            DeviceBuffer::BF16(b) => b.stream(),
            DeviceBuffer::U8(b) => b.stream(),
        }
    }
}

macro_rules! conversions {
    ($($t:ty => $v:ident),*) => {$(
        impl From<CudaSlice<$t>> for DeviceBuffer {
            fn from(b: CudaSlice<$t>) -> Self {
                DeviceBuffer::$v(b)
            }
        }

        impl TryFrom<DeviceBuffer> for CudaSlice<$t> {
            type Error = Error;
            /// The slice, or [`Error::InvalidArgument`] for a buffer of another type.
            fn try_from(b: DeviceBuffer) -> Result<Self> {
                match b {
                    DeviceBuffer::$v(s) => Ok(s),
                    other => Err(Error::InvalidArgument(format!(
                        "expected a {:?} device buffer, got {:?}",
                        DType::$v,
                        other.dtype()
                    ))),
                }
            }
        }
    )*};
}

conversions!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, u8 => U8);

fn cuda(what: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        op: what.into(),
        message: format!("{e:?}"),
    }
}

/// Copies a device slice to the host, waiting for its stream.
fn download<T: DeviceRepr>(buf: &CudaSlice<T>) -> Result<Vec<T>> {
    let stream = buf.stream();
    let host = stream
        .clone_dtoh(buf)
        .map_err(cuda("copying a device buffer to the host"))?;
    stream
        .synchronize()
        .map_err(cuda("waiting for a device-to-host copy"))?;
    Ok(host)
}

/// Copies `host` into `buf` on its stream and waits (the host vector is freed on return,
/// so the copy must have finished reading it).
fn upload<T: DeviceRepr>(host: &[T], buf: &mut CudaSlice<T>) -> Result<()> {
    let stream = buf.stream().clone();
    stream
        .memcpy_htod(host, buf)
        .map_err(cuda("copying a result back to the device"))?;
    stream
        .synchronize()
        .map_err(cuda("waiting for a host-to-device copy"))
}

fn stage_typed<T>(buf: CudaSlice<T>, op: impl FnOnce(Buffer) -> Work<Buffer>) -> Work<DeviceBuffer>
where
    T: DeviceRepr + Send + 'static,
    Vec<T>: Into<Buffer> + TryFrom<Buffer, Error = Error>,
    DeviceBuffer: From<CudaSlice<T>>,
{
    let host = match download(&buf) {
        Ok(h) => h,
        Err(e) => return Work::ready(Err(e)),
    };
    let len = host.len();
    op(host.into()).then(move |r| {
        let host = Vec::<T>::try_from(r?)?;
        if host.len() != len {
            return Err(Error::Mismatch(format!(
                "a staged collective gave {} elements back for {len}",
                host.len()
            )));
        }
        let mut buf = buf;
        upload(&host, &mut buf)?;
        Ok(DeviceBuffer::from(buf))
    })
}

/// Runs the host collective `op` on a device buffer: downloads it (waiting for its
/// stream), runs `op` on the host copy, and uploads the result into the same device
/// buffer, which the work gives back. What the default
/// [`ProcessGroup::all_reduce_device`](crate::ProcessGroup::all_reduce_device) and
/// [`broadcast_device`](crate::ProcessGroup::broadcast_device) do; `op` must give back a
/// buffer of the same type and length (else [`Error::Mismatch`]).
///
/// Costs two copies over the bus and two host waits; a backend that can work on device
/// memory overrides the trait methods instead.
pub fn staged(buf: DeviceBuffer, op: impl FnOnce(Buffer) -> Work<Buffer>) -> Work<DeviceBuffer> {
    match buf {
        DeviceBuffer::F32(b) => stage_typed(b, op),
        DeviceBuffer::F64(b) => stage_typed(b, op),
        DeviceBuffer::F16(b) => stage_typed(b, op),
        DeviceBuffer::BF16(b) => stage_typed(b, op),
        DeviceBuffer::U8(b) => stage_typed(b, op),
    }
}
