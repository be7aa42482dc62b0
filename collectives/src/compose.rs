//! The default `reduce`, `gather`, `scatter` and `all_to_all` of every
//! [`ProcessGroup`]: composed of the group's own `all_reduce` and point-to-point
//! operations, so that a backend gets torch.distributed's whole set from the operations
//! it implements natively (and may override any of them).
//!
//! The point-to-point messages of these defaults use [`COLLECTIVE_TAG`]
//! ([`MAX_TAG`](crate::p2p::MAX_TAG), which user messages leave to them), so they do not
//! mix with a user's messages; since every rank calls collectives in the same order and
//! messages with one tag arrive in order, successive calls do not mix either.

use crate::p2p::P2pOp;
use crate::{Buffer, Error, ProcessGroup, ReduceOp, Result, Work};

/// The tag of the messages of the composed collectives (see the module docs).
pub(crate) const COLLECTIVE_TAG: u32 = crate::p2p::MAX_TAG;

fn bad_root(what: &str, root: usize, size: usize) -> Option<Error> {
    (root >= size).then(|| {
        Error::InvalidArgument(format!(
            "{what} root {root} is not a rank of a group of {size}"
        ))
    })
}

/// Waits for every work of `works` in the order given (each is bounded by its group's
/// timeout) inside one work: the results in order, or the first error.
fn all<T: Send + 'static>(works: Vec<Work<T>>) -> Work<Vec<T>> {
    let mut acc: Work<Vec<T>> = Work::ready(Ok(Vec::with_capacity(works.len())));
    for w in works {
        acc = acc.zip(w).then(|r| {
            let (mut v, x) = r?;
            v.push(x);
            Ok(v)
        });
    }
    acc
}

/// `reduce`: an all-reduce whose result the root keeps; every rank takes part even when
/// one rejects the root, so nobody waits for a rank that did not come.
pub(crate) fn reduce<G: ProcessGroup + ?Sized>(
    g: &G,
    buf: Buffer,
    root: usize,
    op: ReduceOp,
) -> Work<Buffer> {
    let bad = bad_root("reduce", root, g.size());
    g.all_reduce(buf, op).then(move |r| match bad {
        Some(e) => Err(e),
        None => r,
    })
}

/// `gather`: every rank sends its buffer to the root, which receives them in rank order
/// (its own is moved, not copied); the other ranks get an empty list.
pub(crate) fn gather<G: ProcessGroup + ?Sized>(
    g: &G,
    buf: Buffer,
    root: usize,
) -> Work<Vec<Buffer>> {
    let (rank, size) = (g.rank(), g.size());
    if let Some(e) = bad_root("gather", root, size) {
        return Work::ready(Err(e));
    }
    if rank != root {
        return g
            .send(buf, root, COLLECTIVE_TAG)
            .then(|r| r.map(|_| Vec::new()));
    }
    let mut ops = Vec::with_capacity(size.saturating_sub(1));
    for peer in (0..size).filter(|&p| p != root) {
        match Buffer::try_zeros(buf.dtype(), buf.len()) {
            Ok(b) => ops.push(P2pOp::recv(b, peer, COLLECTIVE_TAG)),
            Err(e) => return Work::ready(Err(e)),
        }
    }
    all(g.batch_isend_irecv(ops)).then(move |r| {
        let mut got = r?.into_iter();
        let mut own = Some(buf);
        Ok((0..size)
            .filter_map(|p| if p == root { own.take() } else { got.next() })
            .collect())
    })
}

/// `scatter`: the root sends chunk `j` to rank `j` and moves its own into `out`; the
/// others receive into `out`. A root that rejects its chunks sends each peer an empty
/// `U8` message instead, which their receive reports as a mismatch at once.
pub(crate) fn scatter<G: ProcessGroup + ?Sized>(
    g: &G,
    chunks: Vec<Buffer>,
    out: Buffer,
    root: usize,
) -> Work<Buffer> {
    let (rank, size) = (g.rank(), g.size());
    if let Some(e) = bad_root("scatter", root, size) {
        return Work::ready(Err(e));
    }
    if rank != root {
        if !chunks.is_empty() {
            return Work::ready(Err(Error::InvalidArgument(format!(
                "scatter: rank {rank} is not the root ({root}) and passes no chunks, got {}",
                chunks.len()
            ))));
        }
        return g.recv(out, root, COLLECTIVE_TAG);
    }
    let shape = (out.dtype(), out.len());
    let rejected = if chunks.len() != size {
        Some(format!(
            "scatter: the root passes one chunk per rank ({size}), got {}",
            chunks.len()
        ))
    } else {
        chunks
            .iter()
            .position(|c| (c.dtype(), c.len()) != shape)
            .map(|j| {
                format!(
                    "scatter: chunk {j} is {:?} x {}, the output {:?} x {}",
                    chunks[j].dtype(),
                    chunks[j].len(),
                    shape.0,
                    shape.1
                )
            })
    };
    if let Some(why) = rejected {
        let ops = (0..size)
            .filter(|&p| p != root)
            .map(|p| P2pOp::send(Buffer::U8(Vec::new()), p, COLLECTIVE_TAG))
            .collect();
        return all(g.batch_isend_irecv(ops)).then(move |_| Err(Error::InvalidArgument(why)));
    }
    let mut own = None;
    let mut ops = Vec::with_capacity(size - 1);
    for (j, c) in chunks.into_iter().enumerate() {
        if j == root {
            own = Some(c);
        } else {
            ops.push(P2pOp::send(c, j, COLLECTIVE_TAG));
        }
    }
    all(g.batch_isend_irecv(ops)).then(move |r| {
        r?;
        own.ok_or_else(|| Error::Internal("scatter lost the root's chunk".into()))
    })
}

/// `all_to_all` with equal splits: `buf` holds `size` equal chunks; chunk `j` goes to
/// rank `j`, and the result holds, in rank order, the chunk each rank sent here.
pub(crate) fn all_to_all<G: ProcessGroup + ?Sized>(g: &G, buf: Buffer) -> Work<Buffer> {
    let size = g.size();
    if !buf.len().is_multiple_of(size) {
        return Work::ready(Err(Error::InvalidArgument(format!(
            "all_to_all needs a length divisible by the group size {size}, got {}",
            buf.len()
        ))));
    }
    let counts = vec![buf.len() / size; size];
    all_to_all_split(g, buf, counts.clone(), counts)
}

/// `all_to_all` with given splits (torch's `all_to_all_single` with split sizes):
/// `send_counts[j]` elements of `buf` go to rank `j`, in order, and `recv_counts[j]`
/// come from it; the result holds them in rank order. The counts must match the peers'
/// (a difference is a mismatch on both sides of that pair).
pub(crate) fn all_to_all_split<G: ProcessGroup + ?Sized>(
    g: &G,
    buf: Buffer,
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
) -> Work<Buffer> {
    let (rank, size) = (g.rank(), g.size());
    let checked = (|| -> Result<()> {
        if send_counts.len() != size || recv_counts.len() != size {
            return Err(Error::InvalidArgument(format!(
                "all_to_all takes {size} send and {size} receive counts, got {} and {}",
                send_counts.len(),
                recv_counts.len()
            )));
        }
        let total: usize = send_counts.iter().sum();
        if total != buf.len() {
            return Err(Error::InvalidArgument(format!(
                "all_to_all: the send counts add up to {total}, the buffer holds {}",
                buf.len()
            )));
        }
        if send_counts[rank] != recv_counts[rank] {
            return Err(Error::InvalidArgument(format!(
                "all_to_all: rank {rank} sends itself {} elements but expects {}",
                send_counts[rank], recv_counts[rank]
            )));
        }
        Ok(())
    })();
    if let Err(e) = checked {
        return Work::ready(Err(e));
    }
    let dtype = buf.dtype();
    let mut ops = Vec::with_capacity(2 * size);
    let mut own = None;
    let mut at = 0;
    for (j, &n) in send_counts.iter().enumerate() {
        let chunk = match buf.try_slice(at..at + n) {
            Ok(c) => c,
            Err(e) => return Work::ready(Err(e)),
        };
        at += n;
        if j == rank {
            own = Some(chunk);
        } else {
            ops.push(P2pOp::send(chunk, j, COLLECTIVE_TAG));
        }
    }
    for (j, &n) in recv_counts.iter().enumerate() {
        if j != rank {
            match Buffer::try_zeros(dtype, n) {
                Ok(b) => ops.push(P2pOp::recv(b, j, COLLECTIVE_TAG)),
                Err(e) => return Work::ready(Err(e)),
            }
        }
    }
    drop(buf);
    let sends = size - 1;
    all(g.batch_isend_irecv(ops)).then(move |r| {
        let mut got = r?.into_iter().skip(sends);
        let mut own = own;
        let parts: Vec<Buffer> = (0..size)
            .filter_map(|j| if j == rank { own.take() } else { got.next() })
            .collect();
        if parts.len() != size {
            return Err(Error::Internal("all_to_all lost a chunk".into()));
        }
        Buffer::try_concat(&parts)
    })
}
