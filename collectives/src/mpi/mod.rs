//! The MPI backend (feature `mpi`): a [`ProcessGroup`] over Open MPI, through the `mpi`
//! crate, so the same training code runs across CPU machines under `mpirun`.
//!
//! ```no_run
//! use collectives::mpi::MpiGroup;
//! use collectives::{Buffer, ProcessGroup, ReduceOp, DEFAULT_TIMEOUT};
//! # fn main() -> collectives::Result<()> {
//! // Run as `mpirun -np 2 ./program`: one process per rank.
//! let world = MpiGroup::init(DEFAULT_TIMEOUT)?;
//! let sum = world.all_reduce(Buffer::F32(vec![world.rank() as f32]), ReduceOp::Sum).wait()?;
//! assert_eq!(sum, Buffer::F32(vec![(0..world.size()).sum::<usize>() as f32]));
//! # Ok(())
//! # }
//! ```
//!
//! Building needs Open MPI's headers and libclang (the `mpi` crate generates its bindings
//! with bindgen): on Debian, `libopenmpi-dev openmpi-bin libclang-dev`.
//!
//! # One progress thread per process
//! [`MpiGroup::init`] starts a thread that initialises MPI (asking for
//! `MPI_THREAD_SERIALIZED`; `FUNNELED` suffices, since that thread is MPI's main thread)
//! and is from then on the only thread that calls MPI. Every group of the process (the
//! world and its subgroups) queues its operations there. The thread starts each as a
//! non-blocking MPI collective in the order it was issued, tests the requests in flight,
//! and completes the [`Work`] handles, so continuations run on that thread. Several
//! operations can be in flight at once (a DDP reducer's buckets overlap), and subgroups
//! never wait on each other's operations.
//!
//! MPI can be initialised once per process: create one group with [`MpiGroup::init`]
//! and keep it (or subgroups made from it) for the whole run; a second `init` fails with
//! [`Error::Unsupported`]. Dropping the last handle lets the operations already issued
//! finish, then finalises MPI on the progress thread (`MPI_Finalize` waits for the other
//! processes to finalise too). Drop the groups before the process exits:
//! `std::process::exit` skips destructors, and `mpirun` then reports a process that
//! exited without finalising MPI.
//!
//! [`new_group`](ProcessGroup::new_group) waits for the progress thread, so it must not
//! be called from a continuation (which runs on that thread): it would time out.
//!
//! # Bounded waits
//! An operation that does not complete within the group's timeout fails with
//! [`Error::Timeout`]: the progress thread tests non-blocking requests against a deadline
//! instead of blocking in MPI. MPI cannot cancel a collective, so the abandoned one stays
//! in flight: its buffers are kept until it completes (freed then, or never), and its
//! communicator is unusable from then on (every later operation on it fails at once with
//! [`Error::Unusable`]; other communicators are unaffected). If abandoned operations are
//! still pending when the last handle is dropped, MPI is not finalised, since finalising
//! would wait for peers that may never come; `mpirun` then reports the process.
//!
//! # No fault tolerance
//! Open MPI 4 has no fault tolerance: when a process dies, `mpirun` aborts the whole
//! job, so the other ranks see no [`Error::PeerLost`] — they are killed. A rank that is
//! alive but never issues an operation makes the others' operation time out.
//!
//! # Mismatches and the debug mode
//! MPI does not check that ranks issue matching collectives: different lengths, types or
//! operations at the same position are undefined behaviour (a truncation error, wrong data
//! or a hang until the timeout). In the debug mode ([`MpiGroup::with_debug`], or
//! `COLLECTIVES_DEBUG=1` in the environment, like PyTorch's
//! `TORCH_DISTRIBUTED_DEBUG=DETAIL`) every operation first all-gathers a small descriptor
//! (the operation, reduction, root, type, length and the operation's number) on a
//! duplicate of the communicator; if any rank's differs, every rank fails with
//! [`Error::Mismatch`] naming both operations, skips it, and the group stays usable. This
//! costs one small collective per operation. The debug mode must be the same on every rank.
//! [`new_group`](ProcessGroup::new_group) always compares the rank lists this way.
//!
//! # Deterministic reductions (the default)
//! `all_reduce`, `all_reduce_coalesced` (and through it `all_reduce_wire`) and
//! `reduce_scatter` give results bit-identical to the thread backend's, for every type,
//! operation and group size, and the same on every rank: each element is combined in rank
//! order (`acc = rank 0's value`, then `acc += rank 1's`, ...; `Avg` divides that sum by the
//! group size), as [`ThreadGroup`](crate::ThreadGroup) combines it. So a run moves from
//! threads to processes without changing a bit of its result, which PyTorch's backends do
//! not offer (Gloo, NCCL and MPI each pick their own order). Each rank reduces one chunk
//! of every buffer: an `MPI_Ialltoallv` brings it chunk `rank` of every rank, it reduces
//! that locally, and an `MPI_Iallgatherv` hands every reduced chunk to every rank. That
//! sends what a ring all-reduce sends (`(n-1)/n` of the buffer, twice), and moves halves
//! as 16 bits. A buffer of at most 32 KiB (PowerSGD's factors) takes one round instead of
//! two: an `MPI_Iallgather` of the whole buffer, and every rank reduces every element, in
//! the same order. On two processes of a 2-core AVX-512 Xeon (Open MPI 4.1, shared
//! memory; `tests/mpi.rs --timing`, with other builds sharing the cores) both paths
//! measured about as fast as `MPI_Iallreduce`: 16 MiB at a median of 0.99 times its time
//! over fourteen runs (single runs 0.83 to 2.45, as the load came and went; 6 to 9 ms
//! either way in the quieter ones), 4 KiB in 10 to 11 us against 12 to 13 us.
//!
//! This is the default because `MPI_Iallreduce` adds in an order of Open MPI's choosing
//! (by message and group size): with three or more ranks its sums differ from the thread
//! backend's in the last bits, and PowerSGD, which carries its error from step to step,
//! turns those bits into a visible drift (3.3e-4 relative in the final loss after 200
//! steps on four ranks). [`MpiGroup::with_deterministic`]`(false)`, or
//! `COLLECTIVES_MPI_DETERMINISTIC=0` in the environment, uses `MPI_Iallreduce` and
//! `MPI_Ireduce_scatter_block` instead, whose tuned algorithms (and, for halves, widened
//! `f32` values) may be faster on a real network. The choice must be the same on every
//! rank; the debug mode checks it.
//!
//! # Types
//! Reductions run in `f32` for `f32`, `f16` and `bf16` buffers (MPI has no half types: the
//! halves are widened, reduced and rounded once, as the thread backend accumulates them)
//! and in `f64` for `f64`; `Avg` is the sum divided by the group size. Broadcast and
//! all-gather move halves as their 16-bit patterns, and raw bytes ([`DType::U8`]) as
//! `MPI_UINT8_T`; a reduction of a `U8` buffer (`all_reduce`, `all_reduce_coalesced`,
//! `reduce_scatter`, `reduce`) fails with [`Error::InvalidArgument`] before communicating.
//! MPI counts are 32-bit, so a buffer holds at most `i32::MAX` elements: a longer one
//! fails with [`Error::InvalidArgument`] before communicating (split it, or reduce it with
//! `all_reduce_coalesced` in pieces).
//!
//! # Point-to-point operations
//! [`send`](ProcessGroup::send) and [`recv`](ProcessGroup::recv) are `MPI_Isend` and
//! `MPI_Irecv` on two duplicates of the group's communicator, tested by the progress thread
//! against the group's timeout like the collectives, but outside their order (and outside
//! the debug mode's checks: they match by source, destination and tag). Each message is
//! preceded by a header (its type and length); the receive compares it with its buffer,
//! receives the payload only if they match, and answers the sender with a verdict, so a
//! send completes (with its buffer) once the receive has taken it, and a receive of another
//! type or length fails on both ranks with [`Error::Mismatch`], the data never truncated.
//! Messages of one tag between two ranks arrive in the order sent; sends never wait for
//! receives, so [`batch_isend_irecv`](ProcessGroup::batch_isend_irecv) (which posts its
//! operations in order) cannot deadlock. A receive that times out before its message came
//! is cancelled, and a message sent later goes to the next receive. `gather`, `scatter`,
//! `all_to_all`, `all_to_all_split` and `reduce` are the trait's defaults (over these
//! operations and `all_reduce`), which detect mismatched buffers on every run, where
//! `MPI_Igather` and its kin would need the debug mode to.

mod debug;
mod job;
mod ops;
mod ordered;
mod progress;
mod pt2pt;
mod raw;
mod shared;

use crate::buffer::unreducible;
use crate::p2p::check_peer;
use crate::{
    Buffer, Completer, DType, Error, ProcessGroup, ReduceOp, Result, Work, DEFAULT_TIMEOUT,
};
use debug::{Desc, Kind};
use job::{Action, CommId, Job, Op, Start, WORLD};
use progress::Runtime;
use std::sync::Arc;
use std::time::Duration;

/// The environment variable that turns the debug mode on (`1`) or off (`0`).
pub const DEBUG_ENV: &str = "COLLECTIVES_DEBUG";

/// The environment variable that picks the reductions: `1` (the default) for the
/// deterministic ones, `0` for MPI's native `MPI_Iallreduce` (see the module docs).
pub const DETERMINISTIC_ENV: &str = "COLLECTIVES_MPI_DETERMINISTIC";

/// How much longer than the timeout `new_group` waits for the progress thread: the
/// agreement before the split is bounded by the timeout; the split itself then follows at
/// once on every rank.
const SPLIT_SLACK: Duration = Duration::from_secs(10);

/// A group of MPI processes: the world ([`MpiGroup::init`]) or a subgroup
/// ([`MpiGroup::subgroup`], [`ProcessGroup::new_group`]).
pub struct MpiGroup {
    runtime: Arc<Runtime>,
    comm: CommId,
    rank: usize,
    size: usize,
    timeout: Duration,
    debug: bool,
    deterministic: bool,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("timeout", &self.timeout)
            .field("debug", &self.debug)
            .field("deterministic", &self.deterministic)
            .finish()
    }
}

impl MpiGroup {
    /// Initialises MPI (once per process) and returns the world group, whose operations
    /// are bounded by `timeout`. The debug mode is on if `COLLECTIVES_DEBUG=1`; the
    /// reductions are deterministic unless `COLLECTIVES_MPI_DETERMINISTIC=0`.
    ///
    /// Errors: [`Error::InvalidArgument`] for a zero timeout, [`Error::InvalidEnv`] for a
    /// `COLLECTIVES_DEBUG` or `COLLECTIVES_MPI_DETERMINISTIC` other than `0` or `1`,
    /// [`Error::Unsupported`] if MPI was initialised before in this process,
    /// [`Error::Timeout`] if initialising takes longer than `timeout`.
    pub fn init(timeout: Duration) -> Result<MpiGroup> {
        check_timeout(timeout)?;
        let debug = flag_from_env(DEBUG_ENV, false)?;
        let deterministic = flag_from_env(DETERMINISTIC_ENV, true)?;
        let runtime = Runtime::start(timeout)?;
        Ok(MpiGroup {
            rank: runtime.rank,
            size: runtime.size,
            runtime: Arc::new(runtime),
            comm: WORLD,
            timeout,
            debug,
            deterministic,
        })
    }

    /// [`init`](Self::init) with [`DEFAULT_TIMEOUT`] (30 minutes, as PyTorch's).
    pub fn world() -> Result<MpiGroup> {
        MpiGroup::init(DEFAULT_TIMEOUT)
    }

    /// Turns the debug mode on or off for this handle's later operations (every rank must
    /// do the same). Subgroups inherit it.
    pub fn with_debug(mut self, on: bool) -> MpiGroup {
        self.debug = on;
        self
    }

    /// Whether the debug mode is on.
    pub fn debug(&self) -> bool {
        self.debug
    }

    /// Chooses the reductions of this handle's later operations (every rank must choose
    /// alike): `true` (the default) for results bit-identical to the thread backend's,
    /// `false` for MPI's own `MPI_Iallreduce` and `MPI_Ireduce_scatter_block` (see the
    /// module docs). Subgroups inherit it.
    pub fn with_deterministic(mut self, on: bool) -> MpiGroup {
        self.deterministic = on;
        self
    }

    /// Whether the reductions are deterministic (bit-identical to the thread backend's).
    pub fn deterministic(&self) -> bool {
        self.deterministic
    }

    /// Sets the timeout of this handle's later operations. Subgroups inherit it.
    pub fn with_timeout(mut self, timeout: Duration) -> Result<MpiGroup> {
        check_timeout(timeout)?;
        self.timeout = timeout;
        Ok(self)
    }

    /// A subgroup of the given ranks of this group: rank `ranks[i]` becomes rank `i` of
    /// the subgroup. Every rank of this group must call it with the same list (checked:
    /// different lists fail with [`Error::Mismatch`] on every rank); ranks outside the
    /// list get `None`. A new MPI communicator, split from this group's.
    pub fn subgroup(&self, ranks: &[usize]) -> Result<Option<MpiGroup>> {
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if ranks.is_empty() || sorted.len() != ranks.len() || sorted.iter().any(|&r| r >= self.size)
        {
            return Err(Error::InvalidArgument(format!(
                "new_group needs distinct ranks below {}, got {ranks:?}",
                self.size
            )));
        }
        let (work, done) = Work::pending();
        self.runtime.submit(Job::Op(Op {
            comm: self.comm,
            desc: Desc::new_group(ranks),
            check: true,
            timeout: self.timeout,
            action: Action::Split {
                ranks: ranks.to_vec(),
                done,
            },
        }));
        let joined = work.wait_timeout(self.timeout.saturating_add(SPLIT_SLACK))?;
        Ok(joined.map(|j| MpiGroup {
            runtime: self.runtime.clone(),
            comm: j.comm,
            rank: j.rank,
            size: j.size,
            timeout: self.timeout,
            debug: self.debug,
            deterministic: self.deterministic,
        }))
    }

    /// Queues the operation that `start` builds around the work's completer.
    fn submit<T: Send + 'static>(
        &self,
        desc: Desc,
        start: impl FnOnce(Completer<T>) -> Start,
    ) -> Work<T> {
        let (work, done) = Work::pending();
        self.runtime.submit(Job::Op(Op {
            comm: self.comm,
            desc,
            check: self.debug,
            timeout: self.timeout,
            action: Action::Collective(start(done)),
        }));
        work
    }
}

impl MpiGroup {
    /// Queues a send or receive (see `pt2pt.rs` for the protocol), after checking what
    /// this rank can check alone.
    fn point_to_point(
        &self,
        what: &str,
        buf: Buffer,
        peer: usize,
        tag: u32,
        send: bool,
    ) -> Work<Buffer> {
        if let Err(e) = check_peer(what, peer, tag, self.size).and_then(|()| check_len(buf.len())) {
            return Work::ready(Err(e));
        }
        let (work, done) = Work::pending();
        self.runtime.submit(Job::P2p(pt2pt::P2pJob {
            comm: self.comm,
            rank: self.rank,
            peer,
            tag,
            send,
            buf,
            timeout: self.timeout,
            done,
        }));
        work
    }
}

fn check_timeout(timeout: Duration) -> Result<()> {
    if timeout.is_zero() {
        return Err(Error::InvalidArgument(
            "the timeout must be positive".into(),
        ));
    }
    Ok(())
}

/// A `0`/`1` switch from the environment; `default` when unset or empty.
fn flag_from_env(name: &str, default: bool) -> Result<bool> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => parse_flag(name, &v, default),
    }
}

fn parse_flag(name: &str, value: &str, default: bool) -> Result<bool> {
    match value.trim() {
        "" => Ok(default),
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(Error::InvalidEnv {
            name: name.into(),
            value: value.into(),
            why: "expected 0 or 1".into(),
        }),
    }
}

/// An error for a buffer longer than MPI's 32-bit counts, before communicating.
fn check_len(len: usize) -> Result<()> {
    raw::count(len).map(drop)
}

impl ProcessGroup for MpiGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        if let Some(e) = unreducible("all_reduce", std::iter::once(buf.dtype())) {
            return Work::ready(Err(e));
        }
        if let Err(e) = check_len(buf.len()) {
            return Work::ready(Err(e));
        }
        let (rank, size) = (self.rank, self.size);
        let desc = Desc::one(Kind::AllReduce, Some(op), None, &buf).native(!self.deterministic);
        if self.deterministic {
            self.submit(desc, |done| ordered::all_reduce(buf, op, rank, size, done))
        } else {
            self.submit(desc, |done| ops::all_reduce(buf, op, size, done))
        }
    }

    fn all_reduce_coalesced(&self, bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>> {
        // Elements per flat buffer: one per type (deterministic), or `f32` for the 32-
        // and 16-bit types and `f64` (native).
        if let Some(e) = unreducible("all_reduce_coalesced", bufs.iter().map(Buffer::dtype)) {
            return Work::ready(Err(e));
        }
        let mut per_type = [0usize; 4];
        for b in &bufs {
            let i = match b.dtype() {
                DType::F32 => 0,
                DType::F16 => 1,
                DType::BF16 => 2,
                DType::F64 => 3,
                // Rejected above.
                DType::U8 => continue,
            };
            per_type[i] = per_type[i].saturating_add(b.len());
        }
        let [f32s, f16s, bf16s, f64s] = per_type;
        let checked = if self.deterministic {
            per_type.iter().try_for_each(|&n| check_len(n))
        } else {
            check_len(f32s.saturating_add(f16s).saturating_add(bf16s)).and(check_len(f64s))
        };
        if let Err(e) = checked {
            return Work::ready(Err(e));
        }
        let (rank, size) = (self.rank, self.size);
        let desc = Desc::coalesced(op, &bufs).native(!self.deterministic);
        if self.deterministic {
            self.submit(desc, |done| {
                ordered::all_reduce_coalesced(bufs, op, rank, size, done)
            })
        } else {
            self.submit(desc, |done| ops::all_reduce_coalesced(bufs, op, size, done))
        }
    }

    fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
        if root >= self.size {
            return Work::ready(Err(Error::InvalidArgument(format!(
                "broadcast root {root} is not a rank of a group of {}",
                self.size
            ))));
        }
        if let Err(e) = check_len(buf.len()) {
            return Work::ready(Err(e));
        }
        let desc = Desc::one(Kind::Broadcast, None, Some(root), &buf);
        self.submit(desc, |done| ops::broadcast(buf, root, done))
    }

    fn all_gather(&self, buf: Buffer) -> Work<Vec<Buffer>> {
        if let Err(e) = check_len(buf.len()) {
            return Work::ready(Err(e));
        }
        let (rank, size) = (self.rank, self.size);
        let desc = Desc::one(Kind::AllGather, None, None, &buf);
        self.submit(desc, |done| ops::all_gather(buf, rank, size, done))
    }

    fn reduce_scatter(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
        if let Some(e) = unreducible("reduce_scatter", std::iter::once(buf.dtype())) {
            return Work::ready(Err(e));
        }
        let size = self.size;
        if !buf.len().is_multiple_of(size) {
            return Work::ready(Err(Error::InvalidArgument(format!(
                "reduce_scatter needs a length divisible by the group size {size}, got {}",
                buf.len()
            ))));
        }
        if let Err(e) = check_len(buf.len()) {
            return Work::ready(Err(e));
        }
        let rank = self.rank;
        let desc = Desc::one(Kind::ReduceScatter, Some(op), None, &buf).native(!self.deterministic);
        if self.deterministic {
            self.submit(desc, |done| {
                ordered::reduce_scatter(buf, op, rank, size, done)
            })
        } else {
            self.submit(desc, |done| ops::reduce_scatter(buf, op, size, done))
        }
    }

    fn barrier(&self) -> Work<()> {
        self.submit(Desc::barrier(), ops::barrier)
    }

    fn send(&self, buf: Buffer, dst: usize, tag: u32) -> Work<Buffer> {
        self.point_to_point("send", buf, dst, tag, true)
    }

    fn recv(&self, buf: Buffer, src: usize, tag: u32) -> Work<Buffer> {
        self.point_to_point("recv", buf, src, tag, false)
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        Ok(self
            .subgroup(ranks)?
            .map(|g| Box::new(g) as Box<dyn ProcessGroup>))
    }
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        // Queued behind this handle's operations, so they all start first.
        self.runtime.submit(Job::Free(self.comm));
    }
}
