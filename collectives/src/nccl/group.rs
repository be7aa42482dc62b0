//! [`ProcessGroup`] for [`NcclGroup`]: host buffers through the progress thread's staged
//! copies, device buffers in place on the group's stream. Point-to-point operations are
//! native (`ncclSend` / `ncclRecv`, see [`super::p2p`]); `reduce`, `gather`, `scatter`
//! and `all_to_all` are the trait's defaults, composed of them and of `all_reduce`.
//! Reductions of [`U8`](crate::DType::U8) buffers fail with
//! [`InvalidArgument`](crate::Error::InvalidArgument) before anything is queued.

use super::debug::{Desc, Kind};
use super::p2p::single;
use super::NcclGroup;
use crate::buffer::unreducible;
use crate::p2p::P2pOp;
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
        if let Some(e) = unreducible("all_reduce", std::iter::once(buf.dtype())) {
            return Work::ready(Err(e));
        }
        let desc = Desc::new(Kind::AllReduce(op), [(buf.dtype(), buf.len())]);
        self.submit(desc, move |e, w| {
            e.all_reduce_host(std::slice::from_mut(&mut buf), op, w)?;
            Ok(buf)
        })
    }

    fn all_reduce_coalesced(&self, mut bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>> {
        if let Some(e) = unreducible("all_reduce_coalesced", bufs.iter().map(Buffer::dtype)) {
            return Work::ready(Err(e));
        }
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
        if let Some(e) = unreducible("reduce_scatter", std::iter::once(buf.dtype())) {
            return Work::ready(Err(e));
        }
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
            DeviceBuffer::U8(b) => NcclGroup::all_reduce_device(self, b, op).then(wrap),
        }
    }

    /// In place on the device, like [`ProcessGroup::all_reduce_device`].
    fn broadcast_device(&self, buf: DeviceBuffer, root: usize) -> Work<DeviceBuffer> {
        match buf {
            DeviceBuffer::F32(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
            DeviceBuffer::F64(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
            DeviceBuffer::F16(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
            DeviceBuffer::BF16(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
            DeviceBuffer::U8(b) => NcclGroup::broadcast_device(self, b, root).then(wrap),
        }
    }

    fn device_native(&self) -> bool {
        true
    }

    /// `ncclSend` from a staged device copy, in one NCCL group; NCCL matches by posting
    /// order per peer, not by tag (see [`super::p2p`]).
    fn send(&self, buf: Buffer, dst: usize, tag: u32) -> Work<Buffer> {
        single(self.p2p_host_batch("send", vec![P2pOp::send(buf, dst, tag)]))
    }

    /// `ncclRecv` into a staged device buffer, copied back into `buf`; a length or type
    /// that differs from the send's is a [`Mismatch`](crate::Error::Mismatch) in debug
    /// mode only (see [`super::p2p`]).
    fn recv(&self, buf: Buffer, src: usize, tag: u32) -> Work<Buffer> {
        single(self.p2p_host_batch("recv", vec![P2pOp::recv(buf, src, tag)]))
    }

    /// Every send and receive in one `ncclGroupStart` / `ncclGroupEnd`, staged through
    /// device copies; one job on the progress thread.
    fn batch_isend_irecv(&self, ops: Vec<P2pOp>) -> Vec<Work<Buffer>> {
        self.p2p_host_batch("batch_isend_irecv", ops)
    }

    /// `ncclSend` from the device buffer itself, on the group's stream after the
    /// buffer's: no host copy.
    fn send_device(&self, buf: DeviceBuffer, dst: usize, tag: u32) -> Work<DeviceBuffer> {
        single(self.p2p_device_batch("send_device", vec![P2pOp::send(buf, dst, tag)]))
    }

    /// `ncclRecv` into the device buffer itself, like
    /// [`send_device`](ProcessGroup::send_device).
    fn recv_device(&self, buf: DeviceBuffer, src: usize, tag: u32) -> Work<DeviceBuffer> {
        single(self.p2p_device_batch("recv_device", vec![P2pOp::recv(buf, src, tag)]))
    }

    /// Every send and receive on device memory in one `ncclGroupStart` /
    /// `ncclGroupEnd`: two ranks exchanging both ways in one batch do not deadlock.
    fn batch_isend_irecv_device(&self, ops: Vec<P2pOp<DeviceBuffer>>) -> Vec<Work<DeviceBuffer>> {
        self.p2p_device_batch("batch_isend_irecv_device", ops)
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
