//! [`ProcessGroup`] for [`NcclGroup`]: host buffers through the progress thread's staged
//! copies, device buffers in place on the group's stream.

use super::debug::{Desc, Kind};
use super::NcclGroup;
use crate::{Buffer, DeviceBuffer, ProcessGroup, ReduceOp, Result, Work};
use cudarc::driver::CudaSlice;
use std::time::Duration;

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn all_reduce(&self, mut buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        let desc = Desc::new(Kind::AllReduce(op), [(buf.dtype(), buf.len())]);
        self.submit(desc, move |e, w| {
            e.all_reduce_host(std::slice::from_mut(&mut buf), op, w)?;
            Ok(buf)
        })
    }

    fn all_reduce_coalesced(&self, mut bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>> {
        let desc = Desc::new(
            Kind::Coalesced(op),
            bufs.iter().map(|b| (b.dtype(), b.len())),
        );
        self.submit(desc, move |e, w| {
            e.all_reduce_host(&mut bufs, op, w)?;
            Ok(bufs)
        })
    }

    fn broadcast(&self, mut buf: Buffer, root: usize) -> Work<Buffer> {
        if let Err(e) = self.check_root(root) {
            return Work::ready(Err(e));
        }
        let desc = Desc::new(Kind::Broadcast(root), [(buf.dtype(), buf.len())]);
        self.submit(desc, move |e, w| {
            e.broadcast_host(&mut buf, root, w)?;
            Ok(buf)
        })
    }

    fn all_gather(&self, buf: Buffer) -> Work<Vec<Buffer>> {
        let desc = Desc::new(Kind::AllGather, [(buf.dtype(), buf.len())]);
        self.submit(desc, move |e, w| e.all_gather_host(&buf, w))
    }

    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        if let Err(e) = self.check_divisible(buf.len()) {
            return Work::ready(Err(e));
        }
        let desc = Desc::new(Kind::ReduceScatter(op), [(buf.dtype(), buf.len())]);
        self.submit(desc, move |e, w| e.reduce_scatter_host(&buf, op, w))
    }

    fn barrier(&self) -> Work<()> {
        self.submit(Desc::new(Kind::Barrier, []), |e, w| e.barrier(w))
    }

    /// In place on the device, on the group's stream after the buffer's: no host copy.
    fn all_reduce_device(&self, buf: DeviceBuffer, op: ReduceOp) -> Work<DeviceBuffer> {
        match buf {
            DeviceBuffer::F32(b) => NcclGroup::all_reduce_device(self, b, op).then(wrap),
            DeviceBuffer::F64(b) => NcclGroup::all_reduce_device(self, b, op).then(wrap),
            DeviceBuffer::F16(b) => NcclGroup::all_reduce_device(self, b, op).then(wrap),
            DeviceBuffer::BF16(b) => NcclGroup::all_reduce_device(self, b, op).then(wrap),
        }
    }

    /// In place on the device, like [`ProcessGroup::all_reduce_device`].
    fn broadcast_device(&self, buf: DeviceBuffer, root: usize) -> Work<DeviceBuffer> {
        match buf {
            DeviceBuffer::F32(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
            DeviceBuffer::F64(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
            DeviceBuffer::F16(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
            DeviceBuffer::BF16(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
        }
    }

    fn device_native(&self) -> bool {
        true
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        Ok(self
            .split(ranks)?
            .map(|g| Box::new(g) as Box<dyn ProcessGroup>))
    }
}

/// A typed device result as a [`DeviceBuffer`].
fn wrap<T>(r: Result<CudaSlice<T>>) -> Result<DeviceBuffer>
where
    DeviceBuffer: From<CudaSlice<T>>,
{
    r.map(DeviceBuffer::from)
}
