//! The result layer over `mpi::ffi`: non-blocking collectives on raw buffers, each
//! returning a [`Request`] or the MPI error as an [`Error`].
//!
//! The `mpi` crate's safe requests tie buffers to a scope and abort the process if a
//! request is dropped unfinished, which cannot express "give up after the timeout". Here a
//! request is a plain handle the progress thread tests; whoever starts one keeps its
//! buffers alive until it completes (or forever, if it never does).

use crate::{Error, Result};
use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};
use std::os::raw::{c_char, c_int, c_void};

/// A started non-blocking operation. Not `Send` (it holds an MPI handle): it lives on the
/// progress thread, the only thread that calls MPI.
pub(super) struct Request(ffi::MPI_Request);

impl Request {
    /// Whether the operation has completed. A completed request is freed by MPI, and
    /// testing it again answers `true`.
    pub(super) fn test(&mut self) -> Result<bool> {
        if self.0 == request_null() {
            return Ok(true);
        }
        let mut flag: c_int = 0;
        // SAFETY: `self.0` is a live request handle (MPI sets it to MPI_REQUEST_NULL when
        // it completes, which the check above catches); the status is ignored.
        let code = unsafe { ffi::MPI_Test(&mut self.0, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        check(code, "MPI_Test")?;
        Ok(flag != 0)
    }
}

fn request_null() -> ffi::MPI_Request {
    // SAFETY: reading an immutable handle constant that MPI defines.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// An MPI count from a length: MPI counts are C `int`s.
pub(super) fn count(len: usize) -> Result<c_int> {
    c_int::try_from(len).map_err(|_| {
        Error::InvalidArgument(format!(
            "MPI counts are 32-bit: {len} elements exceed {}; split the buffer",
            c_int::MAX
        ))
    })
}

/// `Ok` for `MPI_SUCCESS`, else the error with MPI's own message.
pub(super) fn check(code: c_int, what: &str) -> Result<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut text = [0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters, as MPI_Error_string needs.
    let ok = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr(), &mut len) };
    let message = if ok == ffi::MPI_SUCCESS as c_int {
        let bytes: Vec<u8> = text[..len.clamp(0, text.len() as c_int) as usize]
            .iter()
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    } else {
        "unknown error".into()
    };
    Err(Error::Mpi {
        op: what.into(),
        code,
        message,
    })
}

/// Makes MPI report errors on `comm` as return codes instead of aborting the job.
pub(super) fn errors_return(comm: &SimpleCommunicator) -> Result<()> {
    // SAFETY: `comm` is a live communicator and MPI_ERRORS_RETURN a predefined handler.
    let code = unsafe { ffi::MPI_Comm_set_errhandler(comm.as_raw(), ffi::RSMPI_ERRORS_RETURN) };
    check(code, "MPI_Comm_set_errhandler")
}

/// A reduction operator of MPI.
pub(super) fn op_sum() -> ffi::MPI_Op {
    SystemOperation::sum().as_raw()
}

/// `MPI_MAX`.
pub(super) fn op_max() -> ffi::MPI_Op {
    SystemOperation::max().as_raw()
}

/// `MPI_MIN`.
pub(super) fn op_min() -> ffi::MPI_Op {
    SystemOperation::min().as_raw()
}

fn datatype<T: Equivalence>() -> ffi::MPI_Datatype {
    T::equivalent_datatype().as_raw()
}

fn start(what: &str, f: impl FnOnce(*mut ffi::MPI_Request) -> c_int) -> Result<Request> {
    let mut request = request_null();
    check(f(&mut request), what)?;
    Ok(Request(request))
}

/// Starts `MPI_Iallreduce` of `send` into `recv` (equal lengths).
///
/// # Safety
/// Both buffers must stay allocated, `send` unwritten and `recv` untouched, until the
/// request completes.
pub(super) unsafe fn iallreduce<T: Equivalence>(
    comm: &SimpleCommunicator,
    send: &[T],
    recv: &mut [T],
    op: ffi::MPI_Op,
) -> Result<Request> {
    debug_assert_eq!(send.len(), recv.len());
    let n = count(send.len())?;
    start("MPI_Iallreduce", |req| {
        // SAFETY: valid pointers for `n` elements of `T`'s datatype; their lifetime is the
        // caller's promise.
        unsafe {
            ffi::MPI_Iallreduce(
                send.as_ptr().cast::<c_void>(),
                recv.as_mut_ptr().cast::<c_void>(),
                n,
                datatype::<T>(),
                op,
                comm.as_raw(),
                req,
            )
        }
    })
}

/// Starts `MPI_Ibcast` of `buf` from `root`.
///
/// # Safety
/// `buf` must stay allocated and untouched until the request completes.
pub(super) unsafe fn ibcast<T: Equivalence>(
    comm: &SimpleCommunicator,
    buf: &mut [T],
    root: usize,
) -> Result<Request> {
    let n = count(buf.len())?;
    let root = count(root)?;
    start("MPI_Ibcast", |req| {
        // SAFETY: as in `iallreduce`.
        unsafe {
            ffi::MPI_Ibcast(
                buf.as_mut_ptr().cast::<c_void>(),
                n,
                datatype::<T>(),
                root,
                comm.as_raw(),
                req,
            )
        }
    })
}

/// Starts `MPI_Iallgather` of `send` into `recv` (`send.len()` times the group size).
///
/// # Safety
/// As [`iallreduce`].
pub(super) unsafe fn iallgather<T: Equivalence>(
    comm: &SimpleCommunicator,
    send: &[T],
    recv: &mut [T],
) -> Result<Request> {
    let n = count(send.len())?;
    start("MPI_Iallgather", |req| {
        // SAFETY: as in `iallreduce`; `recv` holds `n` elements per rank.
        unsafe {
            ffi::MPI_Iallgather(
                send.as_ptr().cast::<c_void>(),
                n,
                datatype::<T>(),
                recv.as_mut_ptr().cast::<c_void>(),
                n,
                datatype::<T>(),
                comm.as_raw(),
                req,
            )
        }
    })
}

/// Starts `MPI_Ireduce_scatter_block`: `send` holds one block of `recv.len()` elements
/// per rank; this rank's block of the reduction lands in `recv`.
///
/// # Safety
/// As [`iallreduce`].
pub(super) unsafe fn ireduce_scatter_block<T: Equivalence>(
    comm: &SimpleCommunicator,
    send: &[T],
    recv: &mut [T],
    op: ffi::MPI_Op,
) -> Result<Request> {
    let n = count(recv.len())?;
    start("MPI_Ireduce_scatter_block", |req| {
        // SAFETY: as in `iallreduce`; `send` holds `n` elements per rank.
        unsafe {
            ffi::MPI_Ireduce_scatter_block(
                send.as_ptr().cast::<c_void>(),
                recv.as_mut_ptr().cast::<c_void>(),
                n,
                datatype::<T>(),
                op,
                comm.as_raw(),
                req,
            )
        }
    })
}

/// Checks that `counts[k]` elements from `displs[k]` fit in a buffer of `len`, for every
/// rank `k` of a group of `size`: the variable-count collectives read and write exactly
/// there, so this is what makes them safe to start on these buffers.
fn check_layout(counts: &[c_int], displs: &[c_int], size: usize, len: usize) -> Result<()> {
    let fits = counts.len() == size
        && displs.len() == size
        && counts.iter().zip(displs).all(|(&c, &d)| {
            let (Ok(c), Ok(d)) = (usize::try_from(c), usize::try_from(d)) else {
                return false;
            };
            d.checked_add(c).is_some_and(|end| end <= len)
        });
    if fits {
        Ok(())
    } else {
        Err(Error::Internal(format!(
            "a layout of {} counts and {} displacements does not fit {size} ranks \
             and a buffer of {len} elements",
            counts.len(),
            displs.len()
        )))
    }
}

/// Starts `MPI_Ialltoallv`: `scounts[k]` elements of `send` from `sdispls[k]` go to rank
/// `k`; rank `k`'s `rcounts[k]` elements land in `recv` at `rdispls[k]`. Every layout is
/// checked against its buffer and the communicator's size first.
///
/// # Safety
/// As [`iallreduce`], and the four count and displacement arrays must stay allocated and
/// unchanged until the request completes too (MPI reads them while it runs).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn ialltoallv<T: Equivalence>(
    comm: &SimpleCommunicator,
    send: &[T],
    scounts: &[c_int],
    sdispls: &[c_int],
    recv: &mut [T],
    rcounts: &[c_int],
    rdispls: &[c_int],
) -> Result<Request> {
    let size = comm_size(comm);
    check_layout(scounts, sdispls, size, send.len())?;
    check_layout(rcounts, rdispls, size, recv.len())?;
    start("MPI_Ialltoallv", |req| {
        // SAFETY: every rank's block lies inside its buffer (checked above); the buffers'
        // and arrays' lifetimes are the caller's promise.
        unsafe {
            ffi::MPI_Ialltoallv(
                send.as_ptr().cast::<c_void>(),
                scounts.as_ptr(),
                sdispls.as_ptr(),
                datatype::<T>(),
                recv.as_mut_ptr().cast::<c_void>(),
                rcounts.as_ptr(),
                rdispls.as_ptr(),
                datatype::<T>(),
                comm.as_raw(),
                req,
            )
        }
    })
}

/// Starts `MPI_Iallgatherv`: this rank's `send` goes to every rank, rank `k`'s lands in
/// `recv` at `displs[k]` (`counts[k]` elements; `counts[rank]` must be `send.len()`).
///
/// # Safety
/// As [`ialltoallv`].
pub(super) unsafe fn iallgatherv<T: Equivalence>(
    comm: &SimpleCommunicator,
    send: &[T],
    recv: &mut [T],
    counts: &[c_int],
    displs: &[c_int],
) -> Result<Request> {
    let size = comm_size(comm);
    check_layout(counts, displs, size, recv.len())?;
    let n = count(send.len())?;
    if counts.get(comm_rank(comm)) != Some(&n) {
        return Err(Error::Internal(format!(
            "MPI_Iallgatherv of {n} elements where the layout expects {:?}",
            counts.get(comm_rank(comm))
        )));
    }
    start("MPI_Iallgatherv", |req| {
        // SAFETY: as in `ialltoallv`.
        unsafe {
            ffi::MPI_Iallgatherv(
                send.as_ptr().cast::<c_void>(),
                n,
                datatype::<T>(),
                recv.as_mut_ptr().cast::<c_void>(),
                counts.as_ptr(),
                displs.as_ptr(),
                datatype::<T>(),
                comm.as_raw(),
                req,
            )
        }
    })
}

fn comm_size(comm: &SimpleCommunicator) -> usize {
    usize::try_from(comm.size()).unwrap_or(0)
}

fn comm_rank(comm: &SimpleCommunicator) -> usize {
    usize::try_from(comm.rank()).unwrap_or(usize::MAX)
}

/// Starts `MPI_Ibarrier`.
pub(super) fn ibarrier(comm: &SimpleCommunicator) -> Result<Request> {
    start("MPI_Ibarrier", |req| {
        // SAFETY: `comm` is live and `req` points to a request slot; no buffers.
        unsafe { ffi::MPI_Ibarrier(comm.as_raw(), req) }
    })
}

/// Starts `MPI_Isend` of `buf` to rank `dst` with `tag`.
///
/// # Safety
/// `buf` must stay allocated and unwritten until the request completes.
pub(super) unsafe fn isend<T: Equivalence>(
    comm: &SimpleCommunicator,
    buf: &[T],
    dst: usize,
    tag: u32,
) -> Result<Request> {
    let n = count(buf.len())?;
    let (dst, tag) = (count(dst)?, count(tag as usize)?);
    start("MPI_Isend", |req| {
        // SAFETY: a valid pointer for `n` elements of `T`'s datatype; its lifetime is the
        // caller's promise.
        unsafe {
            ffi::MPI_Isend(
                buf.as_ptr().cast::<c_void>(),
                n,
                datatype::<T>(),
                dst,
                tag,
                comm.as_raw(),
                req,
            )
        }
    })
}

/// Starts `MPI_Irecv` into `buf` (at most `buf.len()` elements) from rank `src` with
/// `tag`.
///
/// # Safety
/// `buf` must stay allocated and untouched until the request completes.
pub(super) unsafe fn irecv<T: Equivalence>(
    comm: &SimpleCommunicator,
    buf: &mut [T],
    src: usize,
    tag: u32,
) -> Result<Request> {
    let n = count(buf.len())?;
    let (src, tag) = (count(src)?, count(tag as usize)?);
    start("MPI_Irecv", |req| {
        // SAFETY: as in `isend`; MPI writes at most `n` elements.
        unsafe {
            ffi::MPI_Irecv(
                buf.as_mut_ptr().cast::<c_void>(),
                n,
                datatype::<T>(),
                src,
                tag,
                comm.as_raw(),
                req,
            )
        }
    })
}

impl Request {
    /// Asks MPI to cancel the operation (`MPI_Cancel`): it still has to be tested to
    /// completion, and may complete normally if it matched a message first. Only for
    /// receives: a cancelled send is deprecated in MPI 4.
    pub(super) fn cancel(&mut self) -> Result<()> {
        if self.0 == request_null() {
            return Ok(());
        }
        // SAFETY: `self.0` is a live request handle (checked above); cancelling does not
        // free it, so the request is still tested (and its buffers kept) as before.
        let code = unsafe { ffi::MPI_Cancel(&mut self.0) };
        check(code, "MPI_Cancel")
    }
}
