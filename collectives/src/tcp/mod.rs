//! The TCP backend: a [`ProcessGroup`] over plain TCP sockets between processes, the
//! role gloo plays in PyTorch: CPU jobs under `launch` (or any launcher that sets the
//! `env://` variables) without MPI.
//!
//! ```no_run
//! use collectives::tcp::TcpGroup;
//! use collectives::{Buffer, ProcessGroup, ReduceOp, DEFAULT_TIMEOUT};
//! # fn main() -> collectives::Result<()> {
//! // Run as `launch -n 2 -- ./program`: one process per rank.
//! let world = TcpGroup::from_env(DEFAULT_TIMEOUT)?;
//! let sum = world.all_reduce(Buffer::F32(vec![world.rank() as f32]), ReduceOp::Sum).wait()?;
//! assert_eq!(sum, Buffer::F32(vec![(0..world.size()).sum::<usize>() as f32]));
//! # Ok(())
//! # }
//! ```
//!
//! # Rendezvous
//! [`TcpGroup::new`] takes the job's [`TcpStore`]: each rank binds a listener (on the
//! interface through which it reaches the store, or [`TcpOptions::listen_addr`]; port
//! 0), publishes `host:port` under `{prefix}/{n}/addr/{rank}` (`prefix` is
//! [`TcpOptions::prefix`], `n` counts the groups this rank has made on this store), and
//! the ranks build a full mesh: rank `i` connects to every `j < i` and accepts every
//! `j > i`. The connecting side's hello carries its rank, the world size and a random
//! value rank 0 put in the store for this group; the listener refuses (with a reason,
//! and keeps waiting for the real rank) any connection whose hello is missing, malformed
//! or wrong, so a stray connection or a rank of another job or group never joins. A
//! rank refused this way fails with [`Error::Rendezvous`]. Sockets have `TCP_NODELAY`.
//! Every step is bounded by the timeout, and a timeout names the ranks that never came
//! (`Error::Timeout::missing`). The ranks end the setup at a store barrier, so the store
//! may be dropped once `new` returns ([`TcpGroup::from_env`] keeps it anyway).
//!
//! # Threads
//! Per peer socket, a reader thread reads frames into typed buffers and files them by
//! (group, source, collective number, phase) or, for point-to-point messages, matches
//! them against posted receives; a sender thread writes point-to-point messages and
//! acks. Each group (the world and every subgroup) has a progress thread that runs its
//! collectives one at a time, in the order issued, writing its frames itself (a peer's
//! reader always drains them, so writes never wait for a peer's progress), and runs the
//! continuations of its works. A watchdog thread bounds point-to-point waits.
//!
//! # Guarantees
//! - **Same bits as the thread backend.** `all_reduce`, `all_reduce_coalesced` (and
//!   through it the trait's `all_reduce_wire`) and `reduce_scatter` combine each element
//!   in rank order (`acc = rank 0's value`, then rank 1's, ...; `Avg` divides once;
//!   `f16`/`bf16` accumulate in `f32` and round once), as [`ThreadGroup`] does, for every
//!   type, operation and group size; every rank gets the same bits. Buffers over 32 KiB
//!   are reduce-scattered (rank `r` reduces chunk `r`) and all-gathered: what a ring
//!   sends, over a full mesh; smaller ones take one round (every rank reduces all).
//! - **Operations do not mix.** Collective frames carry the group's id and the
//!   collective's number; point-to-point messages match by (group, source, tag) in
//!   the order posted, independent of collectives, as [`crate::p2p`] describes.
//! - **Mismatches fail everyone.** Every collective frame carries the description of
//!   the call (kind, op or root, each buffer's type and length), every rank compares
//!   its own with every peer's, and any difference fails every rank with
//!   [`Error::Mismatch`]. A rank that rejects its own arguments (a bad root, a length
//!   that does not divide, a `U8` reduction) gets [`Error::InvalidArgument`] and its
//!   peers a mismatch naming the reason; a point-to-point receive of another type or
//!   length fails on both sides with [`Error::Mismatch`].
//! - **Failure spreads, bounded.** A peer whose socket ends (it dropped its group, or
//!   its process died) fails every pending and later operation that waits for it, on
//!   every rank, with [`Error::PeerLost`] naming it (point-to-point traffic between
//!   other ranks goes on). Every wait is bounded by the group's timeout
//!   ([`Error::Timeout`]), writes included (`SO_SNDTIMEO`).
//!
//! # Compared with gloo
//! Gloo runs ring or halving-doubling algorithms whose order of additions depends on
//! the algorithm and group size; here the order is fixed (bit-identical to the thread
//! and, by default, MPI backends), at the price of a full mesh (`n - 1` sockets per
//! rank, fine for the tens of ranks CPU jobs have). Like gloo it has no fault tolerance
//! beyond failing fast: a group with a lost peer stays failed. Frames that arrive before
//! their collective or receive is posted are held in memory without a bound, as gloo's
//! unbound buffers are. No authentication beyond the job check value, and no encryption:
//! keep the job on a trusted network (the store's token guards the check value).
//!
//! [`new_group`](ProcessGroup::new_group) reuses the parent's connections (frames carry
//! the subgroup's id), which close when the world group and every subgroup made from it
//! are dropped (a peer sees that as this rank leaving); every rank of the parent must call it, in the same order, with
//! the same list (checked: a difference fails every rank with a mismatch). It waits for
//! the parent's progress thread, so it must not be called from a continuation.

mod frame;
mod inbox;
mod mesh;
mod ops;
mod p2p;
mod queue;
mod reduce;
mod spec;
mod tables;

use crate::buffer::unreducible;
use crate::p2p::check_peer;
use crate::store::TcpStore;
#[cfg(doc)]
use crate::ThreadGroup;
use crate::{Buffer, Error, ProcessGroup, ReduceOp, Result, Work, DEFAULT_TIMEOUT};
use inbox::{Queue, Shared, Task};
use mesh::Mesh;
use ops::{coll, Run};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

/// How a [`TcpGroup`] is made.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TcpOptions {
    /// Bounds every operation of the group and its setup. Default: [`DEFAULT_TIMEOUT`].
    pub timeout: Duration,
    /// The address to listen on; `None` (the default): the address of the interface
    /// through which this rank reaches the store.
    pub listen_addr: Option<IpAddr>,
    /// The prefix of the group's keys in the store. Default: `"collectives/tcp"`.
    pub prefix: String,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            timeout: DEFAULT_TIMEOUT,
            listen_addr: None,
            prefix: "collectives/tcp".into(),
        }
    }
}

impl TcpOptions {
    /// The defaults, with `timeout`.
    pub fn with_timeout(timeout: Duration) -> Self {
        TcpOptions {
            timeout,
            ..TcpOptions::default()
        }
    }
}

/// What a group's operations need: its id, this rank's place, the mesh.
pub(crate) struct Core {
    /// 0 for the world, a hash of the parent's id and the call for subgroups.
    pub id: u64,
    /// This rank in the group.
    pub rank: usize,
    /// The group's ranks as world ranks.
    pub members: Vec<usize>,
    pub mesh: Arc<Mesh>,
    pub timeout: Duration,
    /// The group was dropped: its waits end.
    pub closed: AtomicBool,
    /// The number of the last collective issued.
    seq: AtomicU64,
}

impl Core {
    pub fn shared(&self) -> &Shared {
        &self.mesh.shared
    }

    /// The group rank of world rank `world` (itself if it is not a member).
    pub fn group_rank_of(&self, world: usize) -> usize {
        self.members
            .iter()
            .position(|&w| w == world)
            .unwrap_or(world)
    }
}

/// One rank of a process group over TCP (see the [module docs](self)).
pub struct TcpGroup {
    core: Arc<Core>,
    jobs: Queue,
    worker: Option<JoinHandle<()>>,
    new_group_calls: AtomicUsize,
    /// Held while a collective is numbered and queued, so that calls from several
    /// threads run in the order of their numbers.
    order: std::sync::Mutex<()>,
    /// The store [`from_env`](TcpGroup::from_env) connected (rank 0 serves it).
    store: Option<TcpStore>,
}

impl std::fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TcpGroup {{ rank: {}, size: {}, id: {:#x} }}",
            self.core.rank,
            self.core.members.len(),
            self.core.id
        )
    }
}

impl TcpGroup {
    /// Rank `rank` of a group of `world_size` processes that meet through `store` (see
    /// the module docs for the rendezvous). Every rank calls it with the same world size
    /// and options' prefix. Errors: [`Error::InvalidArgument`] for a rank not below the
    /// world size or a zero timeout; [`Error::Timeout`] naming the ranks that never
    /// connected; [`Error::Rendezvous`] when a peer refuses this rank; the store's errors.
    pub fn new(
        store: &TcpStore,
        rank: usize,
        world_size: usize,
        options: TcpOptions,
    ) -> Result<TcpGroup> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "a TCP group needs a rank below its world size, got rank {rank} of {world_size}"
            )));
        }
        if world_size > crate::store::MAX_WORLD_SIZE {
            return Err(Error::InvalidArgument(format!(
                "a TCP group of {world_size} ranks is above {}",
                crate::store::MAX_WORLD_SIZE
            )));
        }
        if options.timeout.is_zero() {
            return Err(Error::InvalidArgument(
                "the timeout must be positive".into(),
            ));
        }
        let mesh = if world_size == 1 {
            Mesh::alone(options.timeout)?
        } else {
            Mesh::connect(store, rank, world_size, &options)?
        };
        TcpGroup::start(Core {
            id: 0,
            rank,
            members: (0..world_size).collect(),
            mesh: Arc::new(mesh),
            timeout: options.timeout,
            closed: AtomicBool::new(false),
            seq: AtomicU64::new(0),
        })
    }

    /// The group of the job this process belongs to, from the launcher's variables
    /// ([`EnvInfo::from_env`](crate::env::EnvInfo::from_env) and
    /// [`connect_store`](crate::env::EnvInfo::connect_store)), with `timeout` for the
    /// rendezvous and every operation. The group keeps the store.
    pub fn from_env(timeout: Duration) -> Result<TcpGroup> {
        let info = crate::env::EnvInfo::from_env()?;
        let store = info.connect_store(timeout)?;
        let mut group = TcpGroup::new(
            &store,
            info.rank,
            info.world_size,
            TcpOptions::with_timeout(timeout),
        )?;
        group.store = Some(store);
        Ok(group)
    }

    /// The store [`from_env`](Self::from_env) connected, if this group was made so.
    pub fn store(&self) -> Option<&TcpStore> {
        self.store.as_ref()
    }

    fn start(core: Core) -> Result<TcpGroup> {
        let (tx, rx) = mpsc::channel::<Task>();
        let name = format!("tcp-group-{}-{:x}", core.rank, core.id);
        let worker = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for task in rx {
                    match task {
                        Task::Run(job) => {
                            // A panicking job has dropped its completer, which fails its
                            // work; the thread lives on for the later operations.
                            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err()
                            {
                                tracing::debug!("a TCP group job or continuation panicked");
                            }
                        }
                        Task::Stop => break,
                    }
                }
            })
            .map_err(|e| Error::io("starting a TCP group's progress thread", e))?;
        Ok(TcpGroup {
            core: Arc::new(core),
            jobs: tx,
            worker: Some(worker),
            new_group_calls: AtomicUsize::new(0),
            order: std::sync::Mutex::new(()),
            store: None,
        })
    }

    /// Queues collective `f` (numbered now, in the order of calls) on the progress thread.
    fn submit<T: Send + 'static>(
        &self,
        name: &'static str,
        f: impl FnOnce(&Run<'_>) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        let seq = self.core.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let owner = self.worker.as_ref().map(|w| w.thread().id());
        let (work, completer) = Work::pending_on(owner);
        let core = self.core.clone();
        let job = Box::new(move || {
            let result = if core.closed.load(Ordering::Acquire) {
                Err(Error::Gone {
                    what: format!("{name}: the TCP group was dropped"),
                })
            } else {
                let run = Run::new(&core, seq, name);
                tracing::debug!(
                    rank = core.rank,
                    group = core.id,
                    seq,
                    name,
                    "TCP collective"
                );
                f(&run)
            };
            core.shared().finish_coll(core.id, seq);
            completer.complete(result);
        });
        // A send fails only when the worker is gone: the dropped job fails the work.
        drop(self.jobs.send(Task::Run(job)));
        drop(order);
        work
    }

    /// Takes this rank's place in a collective whose arguments it rejects.
    fn reject<T: Send + 'static>(&self, name: &'static str, e: Error) -> Work<T> {
        self.submit(name, move |run| ops::rejected(run, e))
    }

    fn poster(&self) -> p2p::Poster<'_> {
        p2p::Poster {
            group: self.core.id,
            me: self.core.rank,
            queue: &self.jobs,
        }
    }
}

impl ProcessGroup for TcpGroup {
    fn rank(&self) -> usize {
        self.core.rank
    }

    fn size(&self) -> usize {
        self.core.members.len()
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn timeout(&self) -> Duration {
        self.core.timeout
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        if let Some(e) = unreducible("all_reduce", [buf.dtype()].into_iter()) {
            return self.reject("all_reduce", e);
        }
        self.submit("all_reduce", move |run| {
            ops::all_reduce(run, coll::ALL_REDUCE, vec![buf], op)?
                .pop()
                .ok_or_else(|| Error::Internal("all_reduce lost its buffer".into()))
        })
    }

    fn all_reduce_coalesced(&self, bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>> {
        if let Some(e) = unreducible("all_reduce_coalesced", bufs.iter().map(Buffer::dtype)) {
            return self.reject("all_reduce_coalesced", e);
        }
        self.submit("all_reduce_coalesced", move |run| {
            ops::all_reduce(run, coll::COALESCED, bufs, op)
        })
    }

    fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
        if root >= self.size() {
            let e = Error::InvalidArgument(format!(
                "broadcast root {root} is not a rank of a group of {}",
                self.size()
            ));
            return self.reject("broadcast", e);
        }
        self.submit("broadcast", move |run| ops::broadcast(run, buf, root))
    }

    fn all_gather(&self, buf: Buffer) -> Work<Vec<Buffer>> {
        self.submit("all_gather", move |run| ops::all_gather(run, buf))
    }

    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        if let Some(e) = unreducible("reduce_scatter", [buf.dtype()].into_iter()) {
            return self.reject("reduce_scatter", e);
        }
        let size = self.size();
        if !buf.len().is_multiple_of(size) {
            let e = Error::InvalidArgument(format!(
                "reduce_scatter needs a length divisible by the group size {size}, got {}",
                buf.len()
            ));
            return self.reject("reduce_scatter", e);
        }
        self.submit("reduce_scatter", move |run| {
            ops::reduce_scatter(run, buf, op)
        })
    }

    fn barrier(&self) -> Work<()> {
        self.submit("barrier", |run| ops::meet(run, coll::BARRIER, 0))
    }

    fn send(&self, buf: Buffer, dst: usize, tag: u32) -> Work<Buffer> {
        if let Err(e) = check_peer("send", dst, tag, self.size()) {
            return Work::ready(Err(e));
        }
        let (work, done) = Work::pending();
        let world = self.core.members[dst];
        self.core
            .shared()
            .post_send(self.poster(), buf, (world, dst), tag, done);
        work
    }

    fn recv(&self, buf: Buffer, src: usize, tag: u32) -> Work<Buffer> {
        if let Err(e) = check_peer("recv", src, tag, self.size()) {
            return Work::ready(Err(e));
        }
        let (work, done) = Work::pending();
        let world = self.core.members[src];
        self.core
            .shared()
            .post_recv(self.poster(), buf, (world, src), tag, done);
        work
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        let size = self.size();
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if ranks.is_empty() || sorted.len() != ranks.len() || sorted.iter().any(|&r| r >= size) {
            let why = format!("new_group needs distinct ranks below {size}, got {ranks:?}");
            // This rank still takes its place in the call (its number, its collective), so
            // the others' meet fails with the reason and every rank stays in step.
            self.new_group_calls.fetch_add(1, Ordering::Relaxed);
            let _ = self
                .reject::<()>("new_group", Error::InvalidArgument(why.clone()))
                .wait();
            return Err(Error::InvalidArgument(why));
        }
        let call = self.new_group_calls.fetch_add(1, Ordering::Relaxed) as u64;
        let hash = ranks
            .iter()
            .fold(mix(call ^ 0x6e65_775f_6772_6f75), |h, &r| mix(h ^ r as u64));
        self.submit("new_group", move |run| {
            ops::meet(run, coll::NEW_GROUP, hash)
        })
        .wait()?;
        let Some(index) = ranks.iter().position(|&r| r == self.core.rank) else {
            return Ok(None);
        };
        let id = mix(self.core.id ^ mix(call + 1)) | 1;
        tracing::debug!(rank = self.core.rank, ?ranks, id, "TCP subgroup");
        let group = TcpGroup::start(Core {
            id,
            rank: index,
            members: ranks.iter().map(|&r| self.core.members[r]).collect(),
            mesh: self.core.mesh.clone(),
            timeout: self.core.timeout,
            closed: AtomicBool::new(false),
            seq: AtomicU64::new(0),
        })?;
        Ok(Some(Box::new(group)))
    }
}

/// A 64-bit mix (splitmix64's finaliser): subgroup ids and rank-list hashes.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Drop for TcpGroup {
    fn drop(&mut self) {
        self.core.closed.store(true, Ordering::Release);
        self.core.shared().wake();
        self.core.shared().fail_group(
            self.core.id,
            &Error::Gone {
                what: "the TCP group was dropped with this operation pending".into(),
            },
        );
        drop(self.jobs.send(Task::Stop));
        if let Some(worker) = self.worker.take() {
            // Dropped by a continuation on the worker itself: it ends on its own.
            if worker.thread().id() != std::thread::current().id() {
                let _ = worker.join();
            }
        }
    }
}
