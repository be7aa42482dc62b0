//! CUDA device buffers on the thread backend (feature `cuda`), staged through host memory:
//! so multi-rank code over device buffers (hooks on CUDA buckets) runs with every rank
//! on one GPU, where NCCL refuses more than one rank per device.

use super::ThreadGroup;
use crate::{Buffer, Error, ProcessGroup, ReduceOp, Result, Work};
use cudarc::driver::{CudaSlice, DeviceRepr, DriverError};

fn cuda(what: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Backend(format!("CUDA error while {what}: {e:?}"))
}

/// Copies a device buffer to the host, waiting for its stream.
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

/// Copies `host` into `buf` on its stream and waits.
fn upload<T: DeviceRepr>(host: &[T], buf: &mut CudaSlice<T>) -> Result<()> {
    let stream = buf.stream().clone();
    stream
        .memcpy_htod(host, buf)
        .map_err(cuda("copying a result back to the device"))?;
    stream
        .synchronize()
        .map_err(cuda("waiting for a host-to-device copy"))
}

/// Downloads `buf`, runs `op` on the host copy, and uploads the result into `buf`.
fn staged<T>(buf: CudaSlice<T>, op: impl FnOnce(Buffer) -> Work<Buffer>) -> Work<CudaSlice<T>>
where
    T: DeviceRepr + Send + 'static,
    Vec<T>: Into<Buffer> + TryFrom<Buffer, Error = Error>,
{
    let host = match download(&buf) {
        Ok(h) => h,
        Err(e) => return Work::ready(Err(e)),
    };
    op(host.into()).then(move |r| {
        let host = Vec::<T>::try_from(r?)?;
        let mut buf = buf;
        upload(&host, &mut buf)?;
        Ok(buf)
    })
}

impl ThreadGroup {
    /// [`all_reduce`](ProcessGroup::all_reduce) of a device buffer: downloaded (waiting
    /// for its stream), reduced like a host buffer, and uploaded into the same buffer.
    pub fn all_reduce_device<T>(&self, buf: CudaSlice<T>, op: ReduceOp) -> Work<CudaSlice<T>>
    where
        T: DeviceRepr + Send + 'static,
        Vec<T>: Into<Buffer> + TryFrom<Buffer, Error = Error>,
    {
        staged(buf, |b| self.all_reduce(b, op))
    }

    /// [`broadcast`](ProcessGroup::broadcast) of a device buffer, staged the same way.
    pub fn broadcast_device<T>(&self, buf: CudaSlice<T>, root: usize) -> Work<CudaSlice<T>>
    where
        T: DeviceRepr + Send + 'static,
        Vec<T>: Into<Buffer> + TryFrom<Buffer, Error = Error>,
    {
        staged(buf, |b| self.broadcast(b, root))
    }
}
