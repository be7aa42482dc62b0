//! The thread backend: the ranks of a group are threads of one process.
//!
//! For CPU training on one machine and for every test. Collectives are zero-copy and
//! rootless: each rank posts the addresses of its buffers, then reduces its `1/N` share
//! reading the peers' buffers in place and writes the result into every rank's buffer
//! (a reduce-scatter and an all-gather fused into one pass, with no staging copies and
//! no allocation per operation). Elements are reduced in rank order, so every rank gets
//! bit-identical results. Half-precision buffers are accumulated in `f32` and rounded
//! once.
//!
//! Each rank's operations run in order on the rank's own progress thread, which also
//! runs the continuations of its work handles.
//!
//! With the `cuda` feature, the trait's `all_reduce_device` and `broadcast_device` take
//! cudarc device buffers, staged through host memory by the trait's defaults (the one
//! staging path of the workspace, `collectives::device::staged`), so several ranks can
//! share one GPU in tests, where NCCL refuses more than one rank per device.

mod mailbox;
mod reduce;
mod rounding;
mod world;

use crate::buffer::unreducible;
use crate::p2p::check_peer;
use crate::sync::Arc;
use crate::{Buffer, DType, Error, ProcessGroup, ReduceOp, Result, Work, DEFAULT_TIMEOUT};
use mailbox::Side;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;
use world::{addr_of, share, Addr, Desc, Kind, MustLeak, World};

type Job = Box<dyn FnOnce() + Send>;

/// One rank of a group of threads. Create the ranks with [`ThreadGroup::create`], or run
/// a closure on each with [`run_local`].
pub struct ThreadGroup {
    rank: usize,
    world: Arc<World>,
    jobs: Option<mpsc::Sender<Job>>,
    worker: Option<JoinHandle<()>>,
    new_group_calls: AtomicUsize,
}

impl std::fmt::Debug for ThreadGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ThreadGroup {{ rank: {}, size: {} }}",
            self.rank, self.world.size
        )
    }
}

impl ThreadGroup {
    /// The `world_size` ranks of a new group with the given timeout (use
    /// [`DEFAULT_TIMEOUT`] for PyTorch's 30 minutes). Hand one to each thread.
    pub fn create(world_size: usize, timeout: Duration) -> Result<Vec<ThreadGroup>> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "a group needs at least one rank".into(),
            ));
        }
        if timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the timeout must be positive".into(),
            ));
        }
        let world = World::new(world_size, timeout);
        (0..world_size)
            .map(|rank| ThreadGroup::join(world.clone(), rank))
            .collect()
    }

    fn join(world: Arc<World>, rank: usize) -> Result<ThreadGroup> {
        let (tx, rx) = mpsc::channel::<Job>();
        world.mailbox.register(rank, tx.clone());
        let shared = world.clone();
        let worker = std::thread::Builder::new()
            .name(format!("collectives-rank-{rank}"))
            .spawn(move || {
                for job in rx {
                    // A panicking job or continuation fails the group at once, as a
                    // panicking rank does (peers would otherwise wait out the timeout),
                    // and the thread lives on to fail this rank's later operations.
                    if let Err(panic) = catch_unwind(AssertUnwindSafe(job)) {
                        shared.fail(Error::PeerLost {
                            rank,
                            why: format!(
                                "a job or continuation on its progress thread panicked: {}",
                                panic_message(&panic)
                            ),
                        });
                    }
                }
            })
            .map_err(|e| Error::io("starting a rank's progress thread", e))?;
        Ok(ThreadGroup {
            rank,
            world,
            jobs: Some(tx),
            worker: Some(worker),
            new_group_calls: AtomicUsize::new(0),
        })
    }

    /// Queues `f` on this rank's progress thread; its result completes the returned work.
    fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&World, usize) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        // Only the worker completes it: a continuation on the worker that waits for it
        // fails at once rather than waiting for itself.
        let owner = self.worker.as_ref().map(|w| w.thread().id());
        let (work, completer) = Work::pending_on(owner);
        let (world, rank) = (self.world.clone(), self.rank);
        let job: Job = Box::new(move || completer.complete(f(&world, rank)));
        match &self.jobs {
            // A send fails only if the worker is gone; the completer, dropped with the
            // job, then fails the work.
            Some(tx) => drop(tx.send(job)),
            None => drop(job),
        }
        work
    }

    /// Posts a send or receive in the group's mailbox, from the calling thread: the
    /// operation posted second copies the data and completes both (see `mailbox`).
    fn point_to_point(&self, side: Side, buf: Buffer, peer: usize, tag: u32) -> Work<Buffer> {
        let what = match side {
            Side::Send => "send",
            Side::Recv => "recv",
        };
        if let Err(e) = check_peer(what, peer, tag, self.size()) {
            return Work::ready(Err(e));
        }
        let (work, done) = Work::pending();
        self.world
            .mailbox
            .post(side, self.rank, peer, tag, buf, done);
        work
    }

    /// Fails a collective whose arguments this rank rejects (`e`), in its place in the
    /// order of operations: it meets its peers with nothing to exchange, so those that
    /// called a real collective there fail at once with a mismatch naming the reason
    /// (and the group, as after any mismatch), rather than waiting out the timeout.
    /// Where every rank rejects its arguments, each gets its own error and the group
    /// stays usable.
    fn reject<T: Send + 'static>(&self, e: Error) -> Work<T> {
        self.submit(move |world, rank| rejected(world, rank, e))
    }
}

/// This rank's part of a collective it rejects (`e`), on its progress thread: see
/// [`ThreadGroup::reject`]. Also for a collective whose output this rank cannot allocate
/// ([`Error::Alloc`]), found before it posts anything.
fn rejected<T>(world: &World, rank: usize, e: Error) -> Result<T> {
    let desc = Desc {
        kind: Kind::Rejected(e.to_string()),
        parts: Vec::new(),
    };
    match collective(world, rank, &desc, Vec::new(), |_| ()) {
        // Nothing was posted, so nothing can leak; a mismatch or a timeout on the way
        // still reports this rank's own error.
        Ok(Err(Error::Mismatch(_) | Error::InvalidArgument(_))) | Ok(Ok(())) => Err(e),
        Ok(Err(other)) => Err(other),
        Err(MustLeak(other)) => Err(other),
    }
}

/// The buffers `all_gather` copies its peers' buffers into: one of `len` elements per
/// peer, an empty one in this rank's place (its own buffer goes there).
fn gather_outputs(dtype: DType, len: usize, size: usize, rank: usize) -> Result<Vec<Buffer>> {
    let mut out = Vec::new();
    out.try_reserve_exact(size).map_err(|_| Error::Alloc {
        elements: size,
        element_bytes: size_of::<Buffer>(),
    })?;
    for peer in 0..size {
        out.push(Buffer::try_zeros(
            dtype,
            if peer == rank { 0 } else { len },
        )?);
    }
    Ok(out)
}

/// Runs this rank's part of one collective: posts `addrs`, meets every rank, runs `body`
/// on every rank's addresses (unless the ranks' collectives mismatch) and leaves.
///
/// - `Ok(Ok(r))`: done, and no failure was recorded meanwhile;
/// - `Ok(Err(e))`: failed, and every rank has left: the buffers may be dropped;
/// - `Err(MustLeak(e))`: a peer may still be inside the operation after the timeout: the
///   caller must leak (forget) every buffer whose address it posted.
///
/// A panic in `body` fails the group and is contained here, so that it cannot unwind
/// through (and free) the caller's buffers while peers still use them.
fn collective<R>(
    world: &World,
    rank: usize,
    desc: &Desc,
    addrs: Vec<Addr>,
    body: impl FnOnce(&[Vec<Addr>]) -> R,
) -> std::result::Result<Result<R>, MustLeak> {
    let entered = match world.meet(rank, desc, addrs) {
        Ok(entered) => entered,
        // Not released: no peer has this rank's addresses.
        Err(e) => return Ok(Err(e)),
    };
    let result = match entered.mismatch {
        Some(e) => Err(e),
        None => catch_unwind(AssertUnwindSafe(|| body(&entered.addrs))).map_err(|panic| {
            let e = Error::PeerLost {
                rank,
                why: format!("panicked inside {desc}: {}", panic_message(&panic)),
            };
            world.fail(e.clone());
            e
        }),
    };
    let failed_inside = world.leave(rank, entered.generation, desc)?;
    // A peer that failed while inside (a panic in its share) left its part undone.
    Ok(match (result, failed_inside) {
        (Ok(_), Some(e)) => Err(e),
        (result, _) => result,
    })
}

/// Hands `bufs` back, or leaks them when a peer may still access them.
fn settle<T, B>(bufs: B, outcome: std::result::Result<Result<T>, MustLeak>) -> Result<(T, B)> {
    match outcome {
        Ok(Ok(v)) => Ok((v, bufs)),
        Ok(Err(e)) => Err(e),
        Err(MustLeak(e)) => {
            std::mem::forget(bufs);
            Err(e)
        }
    }
}

/// Reduces each buffer of `bufs` over all ranks, in place, in one rendezvous.
fn all_reduce_in_place(
    world: &World,
    rank: usize,
    kind: Kind,
    mut bufs: Vec<Buffer>,
    op: ReduceOp,
) -> Result<Vec<Buffer>> {
    let desc = Desc {
        kind,
        parts: bufs.iter().map(|b| (b.dtype(), b.len())).collect(),
    };
    let addrs = bufs.iter_mut().map(addr_of).collect();
    let outcome = collective(world, rank, &desc, addrs, |all| {
        for (t, &(dtype, len)) in desc.parts.iter().enumerate() {
            let peers: Vec<usize> = all.iter().map(|a| a[t]).collect();
            // SAFETY: `meet` checked that every rank posted a buffer of this type and
            // length. Each stays alive and untouched by its owner until every rank has
            // left (`World::leave` waits for all, even after a failure, and leaks the
            // buffers rather than freeing them if that wait times out), and ranks reduce
            // disjoint shares.
            unsafe { reduce::reduce(dtype, &peers, share(len, world.size, rank), op, None) };
        }
    });
    settle(bufs, outcome).map(|((), bufs)| bufs)
}

impl ProcessGroup for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.world.size
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn timeout(&self) -> Duration {
        self.world.timeout
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        if let Some(e) = unreducible("all_reduce", [buf.dtype()].into_iter()) {
            return self.reject(e);
        }
        self.submit(move |world, rank| {
            let mut bufs = all_reduce_in_place(world, rank, Kind::AllReduce(op), vec![buf], op)?;
            bufs.pop()
                .ok_or_else(|| Error::Internal("all_reduce lost its buffer".into()))
        })
    }

    fn all_reduce_wire(&self, mut buf: Buffer, wire: DType, op: ReduceOp) -> Work<Buffer> {
        if let Err(e) = crate::group::check_wire(&buf, wire) {
            return self.reject(e);
        }
        if wire == DType::F32 {
            return self.all_reduce(buf, op);
        }
        self.submit(move |world, rank| {
            let desc = Desc {
                kind: Kind::AllReduceWire(op, wire),
                parts: vec![(buf.dtype(), buf.len())],
            };
            let len = buf.len();
            let addrs = vec![addr_of(&mut buf)];
            let outcome = collective(world, rank, &desc, addrs, |all| {
                let peers: Vec<usize> = all.iter().map(|a| a[0]).collect();
                // SAFETY: as in all_reduce: `meet` checked every rank posted an f32 buffer
                // of this length; each stays alive and untouched by its owner until every
                // rank has left; ranks reduce disjoint shares.
                unsafe { reduce::reduce_wire(wire, &peers, share(len, world.size, rank), op) };
            });
            settle(buf, outcome).map(|((), buf)| buf)
        })
    }

    fn all_reduce_coalesced(&self, bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>> {
        if let Some(e) = unreducible("all_reduce_coalesced", bufs.iter().map(Buffer::dtype)) {
            return self.reject(e);
        }
        self.submit(move |world, rank| {
            all_reduce_in_place(world, rank, Kind::Coalesced(op), bufs, op)
        })
    }

    fn broadcast(&self, mut buf: Buffer, root: usize) -> Work<Buffer> {
        if root >= self.size() {
            return self.reject(Error::InvalidArgument(format!(
                "broadcast root {root} is not a rank of a group of {}",
                self.size()
            )));
        }
        self.submit(move |world, rank| {
            let desc = Desc {
                kind: Kind::Broadcast(root),
                parts: vec![(buf.dtype(), buf.len())],
            };
            // The length first: a borrow of `buf` after its address is posted would
            // invalidate that address under the aliasing model.
            let len = buf.len() * buf.dtype().size();
            let addrs = vec![addr_of(&mut buf)];
            let dst = addrs[0];
            let outcome = collective(world, rank, &desc, addrs, |all| {
                if rank != root {
                    // SAFETY: the root's buffer has the same byte length (checked by
                    // `meet`) and stays alive and unwritten until every rank has left;
                    // `dst` is this rank's own buffer, which nobody else writes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            all[root][0] as *const u8,
                            dst as *mut u8,
                            len,
                        )
                    };
                }
            });
            settle(buf, outcome).map(|((), buf)| buf)
        })
    }

    fn all_gather(&self, mut buf: Buffer) -> Work<Vec<Buffer>> {
        self.submit(move |world, rank| {
            let desc = Desc {
                kind: Kind::AllGather,
                parts: vec![(buf.dtype(), buf.len())],
            };
            // The copies are allocated before this rank posts anything: if they cannot
            // be, it rejects the collective and its peers fail at once.
            let mut out = match gather_outputs(buf.dtype(), buf.len(), world.size, rank) {
                Ok(out) => out,
                Err(e) => return rejected(world, rank, e),
            };
            let addrs = vec![addr_of(&mut buf)];
            let outcome = collective(world, rank, &desc, addrs, |all| {
                for (peer, addrs) in all.iter().enumerate() {
                    if peer == rank {
                        continue;
                    }
                    let bytes = out[peer].as_bytes_mut();
                    // SAFETY: the peer's buffer has this byte length (checked by `meet`:
                    // same dtype and length as this rank's, which `out[peer]` has) and
                    // stays alive and unwritten until every rank has left.
                    bytes.copy_from_slice(unsafe {
                        std::slice::from_raw_parts(addrs[0] as *const u8, bytes.len())
                    });
                }
                out
            });
            let (mut out, buf) = settle(buf, outcome)?;
            out[rank] = buf;
            Ok(out)
        })
    }

    fn reduce_scatter(&self, mut buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        if let Some(e) = unreducible("reduce_scatter", [buf.dtype()].into_iter()) {
            return self.reject(e);
        }
        let size = self.size();
        if !buf.len().is_multiple_of(size) {
            return self.reject(Error::InvalidArgument(format!(
                "reduce_scatter needs a length divisible by the group size {size}, got {}",
                buf.len()
            )));
        }
        self.submit(move |world, rank| {
            let desc = Desc {
                kind: Kind::ReduceScatter(op),
                parts: vec![(buf.dtype(), buf.len())],
            };
            let (dtype, chunk) = (buf.dtype(), buf.len() / world.size);
            // As in all_gather: the output exists before anything is posted.
            let mut out = match Buffer::try_zeros(dtype, chunk) {
                Ok(out) => out,
                Err(e) => return rejected(world, rank, e),
            };
            let addrs = vec![addr_of(&mut buf)];
            let outcome = collective(world, rank, &desc, addrs, |all| {
                let peers: Vec<usize> = all.iter().map(|a| a[0]).collect();
                // SAFETY: as in all_reduce; the results go to this rank's own `out`, and
                // the peers' buffers are only read.
                unsafe {
                    reduce::reduce(
                        dtype,
                        &peers,
                        rank * chunk..(rank + 1) * chunk,
                        op,
                        Some(addr_of(&mut out)),
                    );
                }
                out
            });
            settle(buf, outcome).map(|(out, _buf)| out)
        })
    }

    fn send(&self, buf: Buffer, dst: usize, tag: u32) -> Work<Buffer> {
        self.point_to_point(Side::Send, buf, dst, tag)
    }

    fn recv(&self, buf: Buffer, src: usize, tag: u32) -> Work<Buffer> {
        self.point_to_point(Side::Recv, buf, src, tag)
    }

    fn barrier(&self) -> Work<()> {
        self.submit(|world, rank| {
            let desc = Desc {
                kind: Kind::Barrier,
                parts: Vec::new(),
            };
            settle((), collective(world, rank, &desc, Vec::new(), |_| ())).map(drop)
        })
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        let size = self.size();
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if ranks.is_empty() || sorted.len() != ranks.len() || sorted.iter().any(|&r| r >= size) {
            return Err(Error::InvalidArgument(format!(
                "new_group needs distinct ranks below {size}, got {ranks:?}"
            )));
        }
        let call = self.new_group_calls.fetch_add(1, Ordering::Relaxed);
        let sub = {
            let mut subs = self
                .world
                .subgroups
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let (members, world) = subs
                .entry(call)
                .or_insert_with(|| (ranks.to_vec(), World::new(ranks.len(), self.world.timeout)));
            if members != ranks {
                let e = Error::Mismatch(format!(
                    "new_group call {call}: rank {} asked for {ranks:?}, another rank for {members:?}",
                    self.rank
                ));
                // The ranks that got the subgroup first learn it at their next operation
                // on it, at once, rather than by its timeout.
                world.fail(e.clone());
                return Err(e);
            }
            world.clone()
        };
        match ranks.iter().position(|&r| r == self.rank) {
            Some(index) => Ok(Some(Box::new(ThreadGroup::join(sub, index)?))),
            None => Ok(None),
        }
    }
}

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        let why = if std::thread::panicking() {
            "its thread panicked"
        } else {
            "it dropped its process group"
        };
        self.world.fail(Error::PeerLost {
            rank: self.rank,
            why: why.into(),
        });
        self.world.mailbox.unregister(self.rank);
        drop(self.jobs.take());
        if let Some(worker) = self.worker.take() {
            if worker.thread().id() == std::thread::current().id() {
                // Dropped by a continuation on the worker itself (the last handle moved
                // into it): the worker ends on its own once its queue is empty; joining
                // here would be joining itself.
                return;
            }
            // The worker's pending operations fail fast on the poisoned group; a panic
            // inside one has already failed its work.
            let _ = worker.join();
        }
    }
}

/// Runs `f` on `world_size` threads, each with its rank of a new [`ThreadGroup`]
/// (timeout [`DEFAULT_TIMEOUT`]), and returns each rank's result in rank order. A rank
/// that panics yields [`Error::PeerLost`] with the panic message, and its group fails the
/// others' operations instead of leaving them waiting.
pub fn run_local<R: Send>(
    world_size: usize,
    f: impl Fn(ThreadGroup) -> R + Sync,
) -> Result<Vec<Result<R>>> {
    run_local_with_timeout(world_size, DEFAULT_TIMEOUT, f)
}

/// [`run_local`] with a timeout for every operation of the group.
pub fn run_local_with_timeout<R: Send>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(ThreadGroup) -> R + Sync,
) -> Result<Vec<Result<R>>> {
    let groups = ThreadGroup::create(world_size, timeout)?;
    let f = &f;
    Ok(std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let rank = g.rank;
                (rank, s.spawn(move || f(g)))
            })
            .collect();
        handles
            .into_iter()
            .map(|(rank, h)| {
                h.join().map_err(|panic| Error::PeerLost {
                    rank,
                    why: format!("panicked: {}", panic_message(&panic)),
                })
            })
            .collect()
    }))
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}
