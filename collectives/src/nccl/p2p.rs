//! Point-to-point operations on NCCL: `ncclSend` / `ncclRecv` on the group's stream, every
//! call of one [`send`](crate::ProcessGroup::send), [`recv`](crate::ProcessGroup::recv)
//! or [`batch_isend_irecv`](crate::ProcessGroup::batch_isend_irecv) inside one
//! `ncclGroupStart` / `ncclGroupEnd`, so that two ranks exchanging both ways in one batch
//! do not deadlock (each send waits for its receive on the device, and the group lets
//! NCCL progress all of them together).
//!
//! What NCCL gives of the guarantees of [`crate::p2p`]:
//!
//! - **Tags.** NCCL has no tags. They are accepted and checked (at most
//!   [`MAX_TAG`](crate::p2p::MAX_TAG)), but messages match by **posting order per peer
//!   and direction**: the `k`-th send from rank A to rank B meets B's `k`-th receive from
//!   A, whatever their tags. This gives the FIFO guarantee per (source, destination, tag)
//!   as long as both sides post their messages with each other in the same order; a
//!   program that receives messages of different tags in another order than they were
//!   sent (which the thread and MPI backends allow) gets them swapped on NCCL. Debug mode
//!   reports such a tag disagreement as [`Error::Mismatch`].
//! - **Mismatches.** In debug mode ([`NcclGroup::with_debug`], `COLLECTIVES_DEBUG=1`)
//!   each batch first exchanges, with each of its peers, how many sends and receives it
//!   posts with that peer and then the type, length and tag of each; a difference fails
//!   the batch on both ranks with [`Error::Mismatch`], before any data moves, and the
//!   group stays usable. Debug mode needs the two sides of an exchange to post it in
//!   matching batches (one batch's sends to a peer meeting one batch of receives there,
//!   a single `send` meeting a single `recv`); a batch with several peers that disagrees
//!   with one fails as a whole, and a third rank whose part of it matched then waits for
//!   its data until its timeout. **Outside debug mode NCCL cannot see a length or type
//!   mismatch**: a receive longer than the send (or a different type of the same byte
//!   length) waits for data that never comes and fails by timeout, or silently takes a
//!   message meant for a later receive; a shorter one is truncated or corrupted. Check
//!   with debug mode first.
//! - **One at a time.** The group's operations run one at a time in posting order on its
//!   progress thread, each after the previous one has completed on the device; a send or
//!   receive holds the queue until its peer matches it. Two ranks that each `send` before
//!   they `recv` from each other may therefore deadlock (NCCL buffers small messages, but
//!   not all): exchange in one [`batch_isend_irecv`](crate::ProcessGroup::batch_isend_irecv)
//!   (as with torch's NCCL backend). Likewise a send to this rank itself needs its
//!   receive in the same batch.
//! - **Timeouts and failure.** Every operation is bounded by the group's timeout, polled
//!   with NCCL's asynchronous error: a receive whose send never comes fails with
//!   [`Error::Timeout`], which (as every fault) aborts the communicator, so every pending
//!   and later operation of this group fails too. A peer's abort reaches this rank as an
//!   NCCL error where the transport notices, otherwise as a timeout.
//! - **Empty buffers** issue no NCCL call: both sides of a matching pair skip alike. A
//!   receive that meets an empty send (the composed `scatter` sends empty `U8` messages
//!   when the root rejects its chunks) is therefore a mismatch in debug mode and a
//!   timeout outside it.
//! - **Invalid arguments** (a peer or tag out of range, a device buffer on another
//!   device) fail every work of the batch with [`Error::InvalidArgument`] on this rank
//!   alone, and nothing is queued; an empty batch returns no works.

use super::comm::Watch;
use super::debug::{self, Desc, Leg};
use super::engine::{driver, Engine};
use super::ops::{dst, nccl_type, src};
use super::NcclGroup;
use crate::p2p::{check_peer, P2pOp};
use crate::{Buffer, Completer, DeviceBuffer, Error, ProcessGroup, Result, Work};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudarc::nccl::{result, sys};
use std::ffi::c_int;

/// One send or receive on device memory, as NCCL takes it.
struct Raw {
    send: bool,
    /// Device address of `count` elements of `dtype`.
    ptr: u64,
    count: usize,
    dtype: sys::ncclDataType_t,
    peer: c_int,
}

/// A peer rank as NCCL takes it (a group has at most `i32::MAX` ranks, and peers were
/// checked against its size).
fn peer_int(peer: usize) -> Result<c_int> {
    c_int::try_from(peer)
        .map_err(|_| Error::InvalidArgument(format!("peer {peer} is too large for NCCL")))
}

/// The device address of a caller's buffer, read (a send) or written (a receive) on
/// `stream`, and cudarc's guard that records the access when dropped.
fn address<'a>(
    buf: &'a mut DeviceBuffer,
    send: bool,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
    macro_rules! arms {
        ($($v:ident),*) => {
            match buf {
                $(DeviceBuffer::$v(b) => {
                    if send {
                        b.device_ptr(stream)
                    } else {
                        b.device_ptr_mut(stream)
                    }
                })*
            }
        };
    }
    arms!(F32, F64, F16, BF16, U8)
}

impl Engine {
    /// Issues `legs` (empty ones skipped) as one NCCL group on the group's stream. The
    /// caller keeps every buffer alive until the stream has finished with it.
    fn p2p_raw(&self, legs: &[Raw], watch: &Watch<'_>) -> Result<()> {
        if legs.iter().all(|l| l.count == 0) {
            return Ok(());
        }
        self.grouped(watch, |e| {
            for l in legs.iter().filter(|l| l.count > 0) {
                if l.send {
                    e.issue(watch, "ncclSend", |comm, stream| {
                        // SAFETY: `l.ptr` is a live device allocation of at least
                        // `l.count` elements of `l.dtype` on this communicator's device
                        // (the callers build each `Raw` from a buffer's own length and
                        // type, or from offsets inside one). Every caller keeps the
                        // allocation alive, with nothing else queued on it, until the
                        // stream has finished with it (`finish`); on every other way out
                        // (an error here, in `ncclGroupEnd` or in `finish`) it is freed in
                        // the group's stream order: cudarc frees the callers' own staged
                        // copies on the group's stream, and a caller's device buffer is
                        // released after the group's stream (`release_device`). The
                        // communicator and stream are live (`issue` checks the former).
                        unsafe { result::send(src(l.ptr), l.count, l.dtype, l.peer, comm, stream) }
                    })?;
                } else {
                    e.issue(watch, "ncclRecv", |comm, stream| {
                        // SAFETY: as for the send: `l.ptr` is a live device allocation of
                        // at least `l.count` elements of `l.dtype`, held (or freed in
                        // stream order) as described there, so NCCL's writes never land
                        // in freed memory, and nothing else reads or writes it in between.
                        unsafe { result::recv(dst(l.ptr), l.count, l.dtype, l.peer, comm, stream) }
                    })?;
                }
            }
            Ok(())
        })
    }

    /// Sends and receives host buffers `(send, peer, buffer)`, staged through device
    /// copies on the group's stream: receives come back holding the data.
    pub(super) fn p2p_host(
        &self,
        ops: &mut [(bool, usize, Buffer)],
        watch: &Watch<'_>,
    ) -> Result<()> {
        let mut staged: Vec<Option<CudaSlice<u8>>> = Vec::with_capacity(ops.len());
        for (send, _, buf) in ops.iter() {
            staged.push(match (buf.is_empty(), *send) {
                (true, _) => None,
                (false, true) => Some(self.upload(buf.as_bytes())?),
                (false, false) => Some(
                    self.stream
                        .alloc_zeros::<u8>(buf.as_bytes().len())
                        .map_err(driver("allocating a receive buffer"))?,
                ),
            });
        }
        {
            // The staged copies live (owned here) until `finish` below, or on an early
            // return are freed by cudarc in the group's stream order.
            let mut guards = Vec::with_capacity(staged.len());
            let mut raws = Vec::with_capacity(staged.len());
            for ((send, peer, buf), dev) in ops.iter().zip(staged.iter_mut()) {
                let Some(dev) = dev else { continue };
                let (ptr, guard) = dev.device_ptr_mut(&self.stream);
                raws.push(Raw {
                    send: *send,
                    ptr,
                    count: buf.len(),
                    dtype: nccl_type(buf.dtype()),
                    peer: peer_int(*peer)?,
                });
                guards.push(guard);
            }
            self.p2p_raw(&raws, watch)?;
        }
        self.finish(watch)?;
        for ((send, _, buf), dev) in ops.iter_mut().zip(&staged) {
            if let (false, Some(dev)) = (*send, dev) {
                self.download(dev, buf.as_bytes_mut(), watch)?;
            }
        }
        Ok(())
    }

    /// Sends and receives callers' device buffers in place (`dirs`: whether each is a
    /// send, and its peer), ordered after the work queued on their streams.
    pub(super) fn p2p_device(
        &self,
        bufs: &mut [DeviceBuffer],
        dirs: &[(bool, usize)],
        watch: &Watch<'_>,
    ) -> Result<()> {
        for buf in bufs.iter() {
            self.follow(buf.stream())?;
        }
        {
            let mut guards = Vec::with_capacity(bufs.len());
            let mut raws = Vec::with_capacity(bufs.len());
            for (buf, &(send, peer)) in bufs.iter_mut().zip(dirs) {
                if buf.is_empty() {
                    continue;
                }
                let (count, dtype) = (buf.len(), nccl_type(buf.dtype()));
                let peer = peer_int(peer)?;
                let (ptr, guard) = address(buf, send, &self.stream);
                raws.push(Raw {
                    send,
                    ptr,
                    count,
                    dtype,
                    peer,
                });
                guards.push(guard);
            }
            self.p2p_raw(&raws, watch)?;
        }
        self.finish(watch)
    }

    /// Drops a caller's device buffer after a failed operation, in the group's stream
    /// order ([`Engine::release`]).
    pub(super) fn release_device(&self, buf: DeviceBuffer) {
        match buf {
            DeviceBuffer::F32(b) => self.release(b),
            DeviceBuffer::F64(b) => self.release(b),
            DeviceBuffer::F16(b) => self.release(b),
            DeviceBuffer::BF16(b) => self.release(b),
            DeviceBuffer::U8(b) => self.release(b),
        }
    }

    /// Debug mode for a point-to-point batch: exchanges headers, then the lists of
    /// operations, with every peer (see [`Leg`]). The outer error is a fault of the
    /// communicator, the inner one a mismatch (the communicator stays usable).
    pub(super) fn check_p2p(&self, legs: &[Leg], watch: &Watch<'_>) -> Result<Result<()>> {
        let me = self.shared.rank;
        let peers = debug::peers(legs);
        if peers.is_empty() {
            return Ok(Ok(()));
        }
        let headers: Vec<Vec<u64>> = peers
            .iter()
            .map(|&p| debug::header(legs, p).to_vec())
            .collect();
        let theirs = self.exchange(
            &peers,
            &headers,
            &vec![debug::HEADER_WORDS; peers.len()],
            watch,
        )?;
        let mut first = None;
        // Round two only with the peers whose header matched: both sides of a pair agree
        // on that (they compared the same two headers), so no list is left unreceived.
        let mut matched = Vec::with_capacity(peers.len());
        for ((&p, mine), theirs) in peers.iter().zip(&headers).zip(&theirs) {
            match debug::check_header(me, p, mine, theirs) {
                Ok(()) => matched.push(p),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        if !matched.is_empty() {
            let lists: Vec<Vec<u64>> = matched.iter().map(|&p| debug::list(legs, p)).collect();
            // The headers matched: the peer's list is as long as this rank's.
            let lens: Vec<usize> = lists.iter().map(Vec::len).collect();
            let theirs = self.exchange(&matched, &lists, &lens, watch)?;
            for (&p, theirs) in matched.iter().zip(&theirs) {
                if let Err(e) = debug::check_list(me, p, legs, theirs) {
                    first.get_or_insert(e);
                }
            }
        }
        Ok(first.map_or(Ok(()), Err))
    }

    /// Sends `mine[i]` to `peers[i]` and receives `lens[i]` words from it, all in one NCCL
    /// group, and waits for them.
    fn exchange(
        &self,
        peers: &[usize],
        mine: &[Vec<u64>],
        lens: &[usize],
        watch: &Watch<'_>,
    ) -> Result<Vec<Vec<u64>>> {
        let flat: Vec<u64> = mine.concat();
        let total: usize = lens.iter().sum();
        if flat.is_empty() || total == 0 {
            return Err(Error::Internal(
                "debug mode: an empty point-to-point descriptor".into(),
            ));
        }
        let send = self
            .stream
            .clone_htod(&flat[..])
            .map_err(driver("uploading the debug descriptors"))?;
        let mut recv = self
            .stream
            .alloc_zeros::<u64>(total)
            .map_err(driver("allocating the debug descriptors"))?;
        {
            // Both allocations live until the end of this function, after `finish`; an
            // early return frees them in the group's stream order.
            let (from, _read) = send.device_ptr(&self.stream);
            let (to, _write) = recv.device_ptr_mut(&self.stream);
            let word = std::mem::size_of::<u64>() as u64;
            let mut raws = Vec::with_capacity(2 * peers.len());
            let (mut sent, mut got) = (0u64, 0u64);
            for ((&p, m), &n) in peers.iter().zip(mine).zip(lens) {
                let peer = peer_int(p)?;
                raws.push(Raw {
                    send: true,
                    ptr: from + sent * word,
                    count: m.len(),
                    dtype: sys::ncclDataType_t::ncclUint64,
                    peer,
                });
                raws.push(Raw {
                    send: false,
                    ptr: to + got * word,
                    count: n,
                    dtype: sys::ncclDataType_t::ncclUint64,
                    peer,
                });
                sent += m.len() as u64;
                got += n as u64;
            }
            self.p2p_raw(&raws, watch)?;
        }
        self.finish(watch)?;
        let mut all = vec![0u64; total];
        self.stream
            .memcpy_dtoh(&recv, &mut all[..])
            .map_err(driver("downloading the debug descriptors"))?;
        self.finish(watch)?;
        let mut rest = &all[..];
        Ok(lens
            .iter()
            .map(|&n| {
                let (head, tail) = rest.split_at(n);
                rest = tail;
                head.to_vec()
            })
            .collect())
    }
}

/// Completes each of `completers` with its value of `result`, or all with its error.
fn complete_all<T: Send + 'static>(completers: Vec<Completer<T>>, result: Result<Vec<T>>) {
    match result {
        Ok(values) => {
            // As many values as completers; a shortfall fails the rest (by dropping them).
            for (c, v) in completers.into_iter().zip(values) {
                c.complete(Ok(v));
            }
        }
        Err(e) => {
            for c in completers {
                c.complete(Err(e.clone()));
            }
        }
    }
}

/// `n` works failed with `e`.
fn failed<T: Send + 'static>(n: usize, e: &Error) -> Vec<Work<T>> {
    (0..n).map(|_| Work::ready(Err(e.clone()))).collect()
}

/// The debug-mode leg of an operation on a buffer of `dtype` and `len`.
fn leg(send: bool, peer: usize, tag: u32, dtype: crate::DType, len: usize) -> Leg {
    Leg {
        send,
        peer,
        tag,
        dtype,
        len,
    }
}

impl NcclGroup {
    /// `n` pending works that this group's progress thread completes.
    fn pending<T: Send + 'static>(&self, n: usize) -> (Vec<Work<T>>, Vec<Completer<T>>) {
        (0..n)
            .map(|_| Work::pending_on(self.progress_thread()))
            .unzip()
    }

    /// Checks the peers and tags of a batch for `what`.
    fn check_batch<B>(&self, what: &str, ops: &[P2pOp<B>]) -> Result<()> {
        ops.iter()
            .try_for_each(|op| check_peer(what, op.peer(), op.tag(), self.size()))
    }

    /// [`ProcessGroup::send`], [`recv`](ProcessGroup::recv) and
    /// [`batch_isend_irecv`](ProcessGroup::batch_isend_irecv) of host buffers: one job,
    /// one NCCL group (see the [module docs](self)).
    pub(super) fn p2p_host_batch(&self, what: &str, ops: Vec<P2pOp>) -> Vec<Work<Buffer>> {
        if ops.is_empty() {
            return Vec::new();
        }
        if let Err(e) = self.check_batch(what, &ops) {
            return failed(ops.len(), &e);
        }
        let legs = ops
            .iter()
            .map(|op| match op {
                P2pOp::Send { buf, peer, tag } => leg(true, *peer, *tag, buf.dtype(), buf.len()),
                P2pOp::Recv { buf, peer, tag } => leg(false, *peer, *tag, buf.dtype(), buf.len()),
            })
            .collect();
        let desc = Desc::p2p(legs);
        let mut items: Vec<(bool, usize, Buffer)> = ops
            .into_iter()
            .map(|op| match op {
                P2pOp::Send { buf, peer, .. } => (true, peer, buf),
                P2pOp::Recv { buf, peer, .. } => (false, peer, buf),
            })
            .collect();
        let (works, completers) = self.pending(items.len());
        let debug = self.debug();
        self.post(Box::new(move |engine| {
            let outcome = engine.run(&desc, debug, |e, w| e.p2p_host(&mut items, w));
            complete_all(
                completers,
                outcome.map(|()| items.into_iter().map(|(_, _, b)| b).collect()),
            );
        }));
        works
    }

    /// The device-buffer form of [`p2p_host_batch`](Self::p2p_host_batch): in place on
    /// the group's stream, after the work queued on each buffer's stream. The buffers come
    /// back through the works, or on failure are released in the group's stream order.
    pub(super) fn p2p_device_batch(
        &self,
        what: &str,
        ops: Vec<P2pOp<DeviceBuffer>>,
    ) -> Vec<Work<DeviceBuffer>> {
        if ops.is_empty() {
            return Vec::new();
        }
        let checked = self.check_batch(what, &ops).and_then(|()| {
            ops.iter().try_for_each(|op| {
                let (P2pOp::Send { buf, .. } | P2pOp::Recv { buf, .. }) = op;
                self.same_device_any(buf)
            })
        });
        if let Err(e) = checked {
            // Never seen by the group's stream: dropped as they are.
            return failed(ops.len(), &e);
        }
        let mut legs = Vec::with_capacity(ops.len());
        let mut dirs = Vec::with_capacity(ops.len());
        let mut bufs = Vec::with_capacity(ops.len());
        for op in ops {
            let (send, buf, peer, tag) = match op {
                P2pOp::Send { buf, peer, tag } => (true, buf, peer, tag),
                P2pOp::Recv { buf, peer, tag } => (false, buf, peer, tag),
            };
            legs.push(leg(send, peer, tag, buf.dtype(), buf.len()));
            dirs.push((send, peer));
            bufs.push(buf);
        }
        let desc = Desc::p2p(legs);
        let (works, completers) = self.pending(bufs.len());
        let debug = self.debug();
        self.post(Box::new(move |engine| {
            let mut bufs = bufs;
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                engine.run(&desc, debug, |e, w| e.p2p_device(&mut bufs, &dirs, w))
            }));
            // A panic after the NCCL calls were issued: the buffers are released in stream
            // order before the unwind goes on (it fails the group; the dropped completers
            // fail the works), never freed under a kernel that may still use them.
            let outcome = match outcome {
                Ok(outcome) => outcome,
                Err(panic) => {
                    bufs.into_iter().for_each(|b| engine.release_device(b));
                    std::panic::resume_unwind(panic)
                }
            };
            match outcome {
                Ok(()) => complete_all(completers, Ok(bufs)),
                Err(err) => {
                    bufs.into_iter().for_each(|b| engine.release_device(b));
                    complete_all(completers, Err(err));
                }
            }
        }));
        works
    }

    /// Errors unless a device buffer lives on this group's device.
    fn same_device_any(&self, buf: &DeviceBuffer) -> Result<()> {
        let ctx = buf.stream().context();
        if **ctx == **self.stream.context() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "a device buffer on CUDA device {} given to the NCCL group of device {}",
                ctx.ordinal(),
                self.ordinal
            )))
        }
    }
}

/// The one work of a batch of one.
pub(super) fn single<T: Send + 'static>(works: Vec<Work<T>>) -> Work<T> {
    works.into_iter().next().unwrap_or_else(|| {
        Work::ready(Err(Error::Internal(
            "a point-to-point batch of one gave no work".into(),
        )))
    })
}
