//! The collectives as MPI sees them: which buffers each sends and receives, in which MPI
//! type, and how the result becomes the work's value.
//!
//! Reductions run on `f32` (for `f32`, `f16` and `bf16` buffers: MPI has no half types,
//! so halves are widened, reduced, and rounded once at the end, as the thread backend
//! accumulates them) or on `f64`. `Avg` is MPI's sum divided by the group size. Moves
//! (broadcast, all-gather) send halves as their 16-bit patterns, unchanged.

use super::job::{collective, Start};
use super::raw::{self, Request};
use crate::buffer::Reducible;
use crate::{Buffer, Completer, DType, Error, ReduceOp, Result};
use half::{bf16, f16};
use mpi::ffi::MPI_Op;

/// A buffer in the type MPI reduces it in.
enum Wide {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Wide {
    fn of(buf: Buffer) -> Wide {
        match buf {
            Buffer::F32(v) => Wide::F32(v),
            Buffer::F16(v) => Wide::F32(v.into_iter().map(f16::widen).collect()),
            Buffer::BF16(v) => Wide::F32(v.into_iter().map(bf16::widen).collect()),
            Buffer::F64(v) => Wide::F64(v),
            // Never reduced: the group rejects a reduction of raw bytes before it gets
            // here (`buffer::unreducible`); widened only so that this match is total.
            Buffer::U8(v) => Wide::F32(v.into_iter().map(f32::from).collect()),
        }
    }

    fn zeros(dtype: DType, len: usize) -> Wide {
        match dtype {
            DType::F64 => Wide::F64(vec![0.0; len]),
            _ => Wide::F32(vec![0.0; len]),
        }
    }

    /// The finished reduction as a buffer of `dtype`: divided by the group size for `Avg`
    /// (in the wide type, as the thread backend does), then rounded once.
    fn finish(mut self, op: ReduceOp, size: usize, dtype: DType) -> Buffer {
        if op == ReduceOp::Avg {
            match &mut self {
                Wide::F32(v) => v.iter_mut().for_each(|x| *x /= size as f32),
                Wide::F64(v) => v.iter_mut().for_each(|x| *x /= size as f64),
            }
        }
        match self {
            Wide::F32(v) => narrow(v, dtype),
            Wide::F64(v) => Buffer::F64(v),
        }
    }

    /// Starts `MPI_Iallreduce` of `self` into `recv`.
    ///
    /// # Safety
    /// As [`raw::iallreduce`]: both stay alive and untouched until the request completes.
    unsafe fn all_reduce(&self, comm: &Comm, recv: &mut Wide, op: ReduceOp) -> Result<Request> {
        // SAFETY: forwarded caller guarantees.
        unsafe {
            match (self, recv) {
                (Wide::F32(s), Wide::F32(r)) => raw::iallreduce(comm, s, r, mpi_op(op)),
                (Wide::F64(s), Wide::F64(r)) => raw::iallreduce(comm, s, r, mpi_op(op)),
                _ => Err(internal()),
            }
        }
    }

    /// Starts `MPI_Ireduce_scatter_block` of `self` into `recv`.
    ///
    /// # Safety
    /// As [`Wide::all_reduce`].
    unsafe fn reduce_scatter(&self, comm: &Comm, recv: &mut Wide, op: ReduceOp) -> Result<Request> {
        // SAFETY: forwarded caller guarantees.
        unsafe {
            match (self, recv) {
                (Wide::F32(s), Wide::F32(r)) => raw::ireduce_scatter_block(comm, s, r, mpi_op(op)),
                (Wide::F64(s), Wide::F64(r)) => raw::ireduce_scatter_block(comm, s, r, mpi_op(op)),
                _ => Err(internal()),
            }
        }
    }
}

type Comm = mpi::topology::SimpleCommunicator;

/// `f32` values as a buffer of `dtype` (`f32`, `f16` or `bf16`), rounded once.
fn narrow(v: Vec<f32>, dtype: DType) -> Buffer {
    match dtype {
        DType::F16 => Buffer::F16(v.into_iter().map(f16::narrow).collect()),
        DType::BF16 => Buffer::BF16(v.into_iter().map(bf16::narrow).collect()),
        _ => Buffer::F32(v),
    }
}

fn mpi_op(op: ReduceOp) -> MPI_Op {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => raw::op_sum(),
        ReduceOp::Max => raw::op_max(),
        ReduceOp::Min => raw::op_min(),
    }
}

fn internal() -> Error {
    Error::Internal("send and receive buffers of different types".into())
}

/// `all_reduce`: one `MPI_Iallreduce` from the (widened) buffer into a new one.
pub(super) fn all_reduce(buf: Buffer, op: ReduceOp, size: usize, done: Completer<Buffer>) -> Start {
    let (dtype, len) = (buf.dtype(), buf.len());
    let bufs = (Wide::of(buf), Wide::zeros(dtype, len));
    collective(
        done,
        bufs,
        move |comm, (send, recv), requests| {
            // SAFETY: `collective` keeps both buffers alive and untouched until the request
            // completes, or forever if it never does.
            requests.push(unsafe { send.all_reduce(comm, recv, op) }?);
            Ok(())
        },
        move |(_, recv)| Ok(recv.finish(op, size, dtype)),
    )
}

/// `all_reduce_coalesced`: the buffers are concatenated into one flat buffer per reduction
/// type (`f32` for `f32`, `f16` and `bf16`; `f64`), so it is at most two
/// `MPI_Iallreduce`s in flight together, whatever the number of buffers.
pub(super) fn all_reduce_coalesced(
    bufs: Vec<Buffer>,
    op: ReduceOp,
    size: usize,
    done: Completer<Vec<Buffer>>,
) -> Start {
    let layout: Vec<(DType, usize)> = bufs.iter().map(|b| (b.dtype(), b.len())).collect();
    let (mut single, mut double) = (Vec::new(), Vec::new());
    for b in bufs {
        match Wide::of(b) {
            Wide::F32(v) => single.extend(v),
            Wide::F64(v) => double.extend(v),
        }
    }
    // (send, receive) per reduction type.
    let (n_single, n_double) = (single.len(), double.len());
    let flat = [
        (Wide::F32(single), Wide::zeros(DType::F32, n_single)),
        (Wide::F64(double), Wide::zeros(DType::F64, n_double)),
    ];
    collective(
        done,
        flat,
        move |comm, flat, requests| {
            for (send, recv) in flat.iter_mut() {
                // SAFETY: as in `all_reduce`.
                requests.push(unsafe { send.all_reduce(comm, recv, op) }?);
            }
            Ok(())
        },
        move |[(_, single), (_, double)]| {
            let (Buffer::F32(single), Buffer::F64(double)) = (
                single.finish(op, size, DType::F32),
                double.finish(op, size, DType::F64),
            ) else {
                return Err(internal());
            };
            let (mut single, mut double) = (single.into_iter(), double.into_iter());
            Ok(layout
                .into_iter()
                .map(|(dtype, len)| match dtype {
                    DType::F64 => Buffer::F64(double.by_ref().take(len).collect()),
                    _ => narrow(single.by_ref().take(len).collect(), dtype),
                })
                .collect())
        },
    )
}

/// `broadcast`: one `MPI_Ibcast` in the buffer's own type (halves as `u16`).
pub(super) fn broadcast(buf: Buffer, root: usize, done: Completer<Buffer>) -> Start {
    collective(
        done,
        buf,
        move |comm, buf, requests| {
            // SAFETY: as in `all_reduce`.
            let request = unsafe {
                match buf {
                    Buffer::F32(v) => raw::ibcast(comm, v, root),
                    Buffer::F64(v) => raw::ibcast(comm, v, root),
                    Buffer::F16(v) => raw::ibcast::<u16>(comm, bytemuck::cast_slice_mut(v), root),
                    Buffer::BF16(v) => raw::ibcast::<u16>(comm, bytemuck::cast_slice_mut(v), root),
                    Buffer::U8(v) => raw::ibcast(comm, v, root),
                }
            };
            requests.push(request?);
            Ok(())
        },
        Ok,
    )
}

/// `all_gather`: one `MPI_Iallgather` into a buffer of `size` times the length, then cut
/// into one buffer per rank (this rank's own is handed back as it was).
pub(super) fn all_gather(
    buf: Buffer,
    rank: usize,
    size: usize,
    done: Completer<Vec<Buffer>>,
) -> Start {
    let all = Buffer::zeros(buf.dtype(), buf.len() * size);
    collective(
        done,
        (buf, all),
        move |comm, (send, recv), requests| {
            // SAFETY: as in `all_reduce`.
            let request = unsafe {
                match (&*send, recv) {
                    (Buffer::F32(s), Buffer::F32(r)) => raw::iallgather(comm, s, r),
                    (Buffer::F64(s), Buffer::F64(r)) => raw::iallgather(comm, s, r),
                    (Buffer::U8(s), Buffer::U8(r)) => raw::iallgather(comm, s, r),
                    (Buffer::F16(s), Buffer::F16(r)) => raw::iallgather::<u16>(
                        comm,
                        bytemuck::cast_slice(s),
                        bytemuck::cast_slice_mut(r),
                    ),
                    (Buffer::BF16(s), Buffer::BF16(r)) => raw::iallgather::<u16>(
                        comm,
                        bytemuck::cast_slice(s),
                        bytemuck::cast_slice_mut(r),
                    ),
                    _ => Err(internal()),
                }
            };
            requests.push(request?);
            Ok(())
        },
        move |(own, all)| {
            let len = own.len();
            let mut out: Vec<Buffer> = (0..size)
                .map(|r| {
                    if r == rank {
                        Buffer::zeros(own.dtype(), 0)
                    } else {
                        slice(&all, r * len, len)
                    }
                })
                .collect();
            out[rank] = own;
            Ok(out)
        },
    )
}

fn slice(buf: &Buffer, start: usize, len: usize) -> Buffer {
    let range = start..start + len;
    match buf {
        Buffer::F32(v) => Buffer::F32(v[range].to_vec()),
        Buffer::F16(v) => Buffer::F16(v[range].to_vec()),
        Buffer::BF16(v) => Buffer::BF16(v[range].to_vec()),
        Buffer::F64(v) => Buffer::F64(v[range].to_vec()),
        Buffer::U8(v) => Buffer::U8(v[range].to_vec()),
    }
}

/// `reduce_scatter`: one `MPI_Ireduce_scatter_block` of the (widened) buffer into this
/// rank's block. The caller has checked that the length divides by the group size.
pub(super) fn reduce_scatter(
    buf: Buffer,
    op: ReduceOp,
    size: usize,
    done: Completer<Buffer>,
) -> Start {
    let (dtype, block) = (buf.dtype(), buf.len() / size);
    collective(
        done,
        (Wide::of(buf), Wide::zeros(dtype, block)),
        move |comm, (send, recv), requests| {
            // SAFETY: as in `all_reduce`.
            requests.push(unsafe { send.reduce_scatter(comm, recv, op) }?);
            Ok(())
        },
        move |(_, recv)| Ok(recv.finish(op, size, dtype)),
    )
}

/// `barrier`: one `MPI_Ibarrier`.
pub(super) fn barrier(done: Completer<()>) -> Start {
    collective(
        done,
        (),
        |comm, (), requests| {
            requests.push(raw::ibarrier(comm)?);
            Ok(())
        },
        Ok,
    )
}
