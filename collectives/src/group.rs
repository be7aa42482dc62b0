//! The process-group trait.

use crate::p2p::P2pOp;
use crate::{Buffer, DType, Error, ReduceOp, Result, Work};
use std::time::Duration;

/// The default timeout of a group's operations: 30 minutes, as PyTorch's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A group of ranks that run collectives together.
///
/// Every rank calls the same collectives in the same order. Each call returns a
/// [`Work`] at once; the operation runs in the background (on the rank's progress thread
/// or device stream) and hands the buffer back through the work. Guarantees, for every
/// backend of this crate:
///
/// - **Bounded waits.** An operation that cannot complete within the group's timeout
///   fails with [`Error::Timeout`](crate::Error::Timeout).
/// - **Failure spreads.** A rank that fails (panics, returns early or drops its group)
///   makes every pending and later operation of the other ranks fail with
///   [`Error::PeerLost`](crate::Error::PeerLost) or a timeout; nothing hangs.
/// - **Mismatches are errors.** Buffers of different lengths or types across ranks, or
///   different collectives issued at the same position, fail on every rank with
///   [`Error::Mismatch`](crate::Error::Mismatch) (backends that cannot see this cheaply
///   check it in a debug mode), never with corrupted data. An argument that one rank can
///   reject alone (a broadcast root out of range, a `reduce_scatter` length that does
///   not divide by the group size, a wire format other than 16 bits) fails on that rank
///   with [`Error::InvalidArgument`](crate::Error::InvalidArgument). The thread backend
///   still takes that rank to the rendezvous, so where the ranks disagree the others
///   fail at once with a mismatch naming the reason (where all reject, the group stays
///   usable); MPI and NCCL see the disagreement in their debug mode, and otherwise at
///   that rank's next operation or by timeout.
pub trait ProcessGroup: Send + Sync {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// The backend's name (`"threads"`, `"nccl"`, `"mpi"`).
    fn backend(&self) -> &'static str;
    /// The timeout that bounds every operation.
    fn timeout(&self) -> Duration;

    /// Reduces `buf` element-wise over all ranks; every rank gets the result.
    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer>;
    /// Reduces the `f32` buffer `buf` as if it travelled in the `wire` format (`F16`,
    /// `BF16` or `F32`): every rank gets `widen(all_reduce(narrow(buf)))`, the result of
    /// PyTorch's `fp16_compress_hook`, as `f32`.
    ///
    /// The default narrows into a `wire` buffer, reduces that and widens the result, so
    /// a real network carries 16 bits an element. A backend whose "wire" is shared
    /// memory (the thread backend) fuses the rounding into its reduction pass, with
    /// bit-identical results and no extra passes over memory.
    fn all_reduce_wire(&self, buf: Buffer, wire: DType, op: ReduceOp) -> Work<Buffer> {
        match check_wire(&buf, wire) {
            Ok(()) if wire == DType::F32 => self.all_reduce(buf, op),
            // A narrowed copy that cannot be allocated fails here, as bad arguments do.
            Ok(()) => match buf.try_narrowed(wire) {
                Ok(narrow) => self.all_reduce(narrow, op).then(|r| r?.try_widened()),
                Err(e) => Work::ready(Err(e)),
            },
            Err(e) => Work::ready(Err(e)),
        }
    }
    /// Reduces a device buffer element-wise over all ranks, in place; the work gives it
    /// back holding the result. The group decides how (see [`crate::device`]): NCCL
    /// reduces it on the device, ordered after the work queued on the buffer's stream,
    /// without a host copy or a host wait; the default stages it through host memory
    /// ([`crate::device::staged`]) and runs [`all_reduce`](ProcessGroup::all_reduce).
    #[cfg(feature = "cuda")]
    fn all_reduce_device(
        &self,
        buf: crate::device::DeviceBuffer,
        op: ReduceOp,
    ) -> Work<crate::device::DeviceBuffer> {
        crate::device::staged(buf, |b| self.all_reduce(b, op))
    }
    /// Every rank gets `root`'s device buffer, in place; staged through host memory by
    /// default, like [`all_reduce_device`](ProcessGroup::all_reduce_device).
    #[cfg(feature = "cuda")]
    fn broadcast_device(
        &self,
        buf: crate::device::DeviceBuffer,
        root: usize,
    ) -> Work<crate::device::DeviceBuffer> {
        crate::device::staged(buf, |b| self.broadcast(b, root))
    }
    /// Whether `all_reduce_device` and `broadcast_device` (feature `cuda`) work on device
    /// memory without staging it through the host (NCCL: `true`; the default: `false`).
    /// Wrappers answer for the group they wrap.
    fn device_native(&self) -> bool {
        false
    }
    /// For a group that carries `f32` buffers narrowed to a 16-bit format over another
    /// group ([`HalfWire`](crate::HalfWire)): the format and that inner group, so a caller
    /// holding device buffers can narrow and widen them on the device and hand the inner
    /// group 16-bit device buffers (this crate has no device kernels to cast with; the
    /// CUDA bridge of `ddp-hooks` has). `None` (the default) for every other group; a
    /// wrapper that charges or records operations ([`Linked`](crate::link::Linked))
    /// answers `None` too, so that nothing bypasses it.
    fn narrowed(&self) -> Option<Narrowed<'_>> {
        None
    }
    /// Reduces several buffers in one operation (PowerSGD's "allreduce the Ps as a
    /// group"): cheaper than one call per buffer. Buffers may differ in length and type.
    fn all_reduce_coalesced(&self, bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>>;
    /// Every rank gets `root`'s buffer (in place of its own, which must match in length
    /// and type).
    fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer>;
    /// Every rank gets every rank's buffer, in rank order.
    fn all_gather(&self, buf: Buffer) -> Work<Vec<Buffer>>;
    /// `buf` holds `size()` equal chunks; rank `i` gets the reduction of chunk `i` over
    /// all ranks.
    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer>;
    /// Completes once every rank has called it.
    fn barrier(&self) -> Work<()>;

    /// Sends `buf` to rank `dst` with `tag` (at most [`MAX_TAG`](crate::p2p::MAX_TAG));
    /// the work completes, giving the buffer back unchanged, once the matching
    /// [`recv`](ProcessGroup::recv) on `dst` has taken the data. Point-to-point operations
    /// do not take part in the order of collectives: they match by source, destination and
    /// tag, in the order posted (see [`crate::p2p`] for the guarantees). The default, for
    /// groups outside this crate, is [`Error::Unsupported`].
    fn send(&self, buf: Buffer, dst: usize, tag: u32) -> Work<Buffer> {
        let _ = (buf, dst, tag);
        Work::ready(Err(Error::Unsupported(format!(
            "the {} group has no point-to-point operations",
            self.backend()
        ))))
    }
    /// Receives into `buf` the message rank `src` sent with `tag`; the work gives the
    /// buffer back holding it. A send of another type or length fails on both ranks with
    /// [`Error::Mismatch`]. The default is [`Error::Unsupported`], as for
    /// [`send`](ProcessGroup::send).
    fn recv(&self, buf: Buffer, src: usize, tag: u32) -> Work<Buffer> {
        let _ = (buf, src, tag);
        Work::ready(Err(Error::Unsupported(format!(
            "the {} group has no point-to-point operations",
            self.backend()
        ))))
    }
    /// Posts several sends and receives at once (torch's `batch_isend_irecv`) and returns
    /// their works in the same order. Two ranks that exchange in both directions in one
    /// batch never deadlock, on any backend (NCCL groups them in one
    /// `ncclGroupStart`/`ncclGroupEnd`). The default posts each in order, which is enough
    /// for a backend whose operations never block the caller.
    fn batch_isend_irecv(&self, ops: Vec<P2pOp>) -> Vec<Work<Buffer>> {
        ops.into_iter()
            .map(|op| match op {
                P2pOp::Send { buf, peer, tag } => self.send(buf, peer, tag),
                P2pOp::Recv { buf, peer, tag } => self.recv(buf, peer, tag),
            })
            .collect()
    }
    /// [`send`](ProcessGroup::send) of a device buffer: NCCL sends from device memory; the
    /// default stages it through host memory ([`crate::device::staged`]).
    #[cfg(feature = "cuda")]
    fn send_device(
        &self,
        buf: crate::device::DeviceBuffer,
        dst: usize,
        tag: u32,
    ) -> Work<crate::device::DeviceBuffer> {
        crate::device::staged(buf, |b| self.send(b, dst, tag))
    }
    /// [`recv`](ProcessGroup::recv) into a device buffer, staged by default like
    /// [`send_device`](ProcessGroup::send_device).
    #[cfg(feature = "cuda")]
    fn recv_device(
        &self,
        buf: crate::device::DeviceBuffer,
        src: usize,
        tag: u32,
    ) -> Work<crate::device::DeviceBuffer> {
        crate::device::staged(buf, |b| self.recv(b, src, tag))
    }
    /// [`batch_isend_irecv`](ProcessGroup::batch_isend_irecv) of device buffers: NCCL posts
    /// them in one group; the default posts each through
    /// [`send_device`](ProcessGroup::send_device) and
    /// [`recv_device`](ProcessGroup::recv_device).
    #[cfg(feature = "cuda")]
    fn batch_isend_irecv_device(
        &self,
        ops: Vec<P2pOp<crate::device::DeviceBuffer>>,
    ) -> Vec<Work<crate::device::DeviceBuffer>> {
        ops.into_iter()
            .map(|op| match op {
                P2pOp::Send { buf, peer, tag } => self.send_device(buf, peer, tag),
                P2pOp::Recv { buf, peer, tag } => self.recv_device(buf, peer, tag),
            })
            .collect()
    }
    /// Reduces `buf` over all ranks into the root's buffer (torch's `reduce`): the root's
    /// work gives the result; on the other ranks the buffer comes back with unspecified
    /// contents (the default is an all-reduce, so it holds the result too).
    fn reduce(&self, buf: Buffer, root: usize, op: ReduceOp) -> Work<Buffer> {
        crate::compose::reduce(self, buf, root, op)
    }
    /// The root gets every rank's buffer, in rank order (its own moved, not copied); the
    /// other ranks get an empty list once the root has theirs. Buffers must match the
    /// root's in type and length ([`Error::Mismatch`] otherwise). The default sends over
    /// [`send`](ProcessGroup::send) and [`recv`](ProcessGroup::recv).
    fn gather(&self, buf: Buffer, root: usize) -> Work<Vec<Buffer>> {
        crate::compose::gather(self, buf, root)
    }
    /// The root passes one chunk per rank (the others an empty list) and rank `j` gets
    /// chunk `j` in `out`, whose type and length every chunk must have. A root that
    /// rejects its chunks fails, and so do the receives of the others (at once, as a
    /// mismatch). The default sends over point-to-point operations.
    fn scatter(&self, chunks: Vec<Buffer>, out: Buffer, root: usize) -> Work<Buffer> {
        crate::compose::scatter(self, chunks, out, root)
    }
    /// `buf` holds `size()` equal chunks; chunk `j` goes to rank `j`, and the result holds,
    /// in rank order, the chunk each rank sent to this one (torch's `all_to_all_single`).
    /// The default exchanges the chunks over
    /// [`batch_isend_irecv`](ProcessGroup::batch_isend_irecv).
    fn all_to_all(&self, buf: Buffer) -> Work<Buffer> {
        crate::compose::all_to_all(self, buf)
    }
    /// [`all_to_all`](ProcessGroup::all_to_all) with split sizes: the first
    /// `send_counts[0]` elements go to rank 0, the next `send_counts[1]` to rank 1, and so
    /// on; `recv_counts[j]` elements come from rank `j` (its `send_counts` for this rank),
    /// and the result holds them in rank order.
    fn all_to_all_split(
        &self,
        buf: Buffer,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    ) -> Work<Buffer> {
        crate::compose::all_to_all_split(self, buf, send_counts, recv_counts)
    }

    /// A subgroup of the given ranks (of this group), as `torch.distributed.new_group`,
    /// except for the order: rank `i` of the subgroup is `ranks[i]`, where torch sorts
    /// the list first (pass a sorted list for torch's numbering). Every rank of this
    /// group must call it, with the same list, in the same order of `new_group` calls;
    /// ranks outside the list get `None`.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>>;
}

/// What [`ProcessGroup::narrowed`] returns: `f32` buffers given to the group travel as
/// `wire` values through `inner`.
#[derive(Clone, Copy)]
pub struct Narrowed<'a> {
    /// The format on the wire: [`DType::F16`] or [`DType::BF16`].
    pub wire: DType,
    /// The group that carries the narrowed buffers.
    pub inner: &'a dyn ProcessGroup,
}

impl std::fmt::Debug for Narrowed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Narrowed")
            .field("wire", &self.wire)
            .field("inner", &self.inner.backend())
            .finish()
    }
}

/// The instant `timeout` from now, saturating: a timeout too long for the clock
/// (`Duration::MAX` as "no timeout") gives a deadline a century away instead of a panic.
#[cfg_attr(loom, allow(dead_code))]
pub(crate) fn deadline_after(timeout: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| {
        now.checked_add(std::time::Duration::from_secs(100 * 365 * 24 * 3600))
            .unwrap_or(now)
    })
}

/// Checks the arguments of [`ProcessGroup::all_reduce_wire`].
pub(crate) fn check_wire(buf: &Buffer, wire: DType) -> Result<()> {
    if buf.dtype() != DType::F32 {
        return Err(Error::InvalidArgument(format!(
            "all_reduce_wire takes an F32 buffer, got {:?}",
            buf.dtype()
        )));
    }
    if !matches!(wire, DType::F32 | DType::F16 | DType::BF16) {
        return Err(Error::InvalidArgument(format!(
            "all_reduce_wire sends F32, F16 or BF16, not {wire:?}"
        )));
    }
    Ok(())
}
