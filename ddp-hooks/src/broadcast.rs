//! DDP's broadcast of rank 0's parameters and buffers at construction
//! (`_sync_module_states`): a set of `f32` slices copied from a root rank to every rank of
//! a process group, coalesced into few broadcasts.
//!
//! ```
//! use collectives::{run_local, ProcessGroup};
//!
//! let ends = run_local(3, |group| -> ddp_hooks::Result<Vec<Vec<f32>>> {
//!     let r = group.rank() as f32;
//!     let (mut weight, mut bias) = (vec![r; 6], vec![-r; 3]); // a different init per rank
//!     ddp_hooks::broadcast_parameters(&group, &mut [&mut weight, &mut bias], 0)?;
//!     Ok(vec![weight, bias])
//! })
//! .unwrap();
//! for end in ends {
//!     assert_eq!(end.unwrap().unwrap(), vec![vec![0.0; 6], vec![-0.0; 3]]); // rank 0's
//! }
//! ```

use crate::{Error, Result};
use collectives::{Buffer, ProcessGroup, ReduceOp};

/// Bytes per broadcast of [`broadcast_parameters`]: 25 MiB, DDP's default bucket cap
/// (`bucket_cap_mb`). (PyTorch's `_sync_module_states` broadcasts in buckets of 250 MiB;
/// smaller ones bound the extra memory to one bucket and cost one collective more per
/// 25 MiB, nothing next to the copy.)
pub const BROADCAST_BUCKET_BYTES: usize = 25 << 20;

/// Copies root's `params` into every rank's `params`, bit for bit: DDP's broadcast of
/// rank 0's parameters and buffers at construction, for any `f32` slices (parameters,
/// buffers, optimizer state) in the same order on every rank.
///
/// Every rank of `group` calls it with the same `root` and slices of the same lengths.
/// The slices are coalesced into broadcasts of at most [`BROADCAST_BUCKET_BYTES`] (a
/// parameter may straddle two), one at a time, each waited for at most the group's
/// timeout ([`ProcessGroup::timeout`]). Before any data moves, the root's parameter
/// count and lengths are broadcast and every rank compares them with its own; if any
/// rank's differ, every rank returns [`Error::Comm`] holding
/// [`collectives::Error::Mismatch`] (which ranks differ, and how), and no slice is
/// written. A root outside the group is [`Error::Config`]; a failed collective is the
/// collective's error ([`Error::Comm`]), after which the slices may hold the root's
/// values up to some bucket and their own after it.
pub fn broadcast_parameters(
    group: &dyn ProcessGroup,
    params: &mut [&mut [f32]],
    root: usize,
) -> Result<()> {
    broadcast_parameters_bucketed(group, params, root, BROADCAST_BUCKET_BYTES)
}

/// [`broadcast_parameters`] with broadcasts of at most `bucket_bytes` bytes (rounded
/// down to whole `f32`s, at least one). The same `bucket_bytes` on every rank.
pub fn broadcast_parameters_bucketed(
    group: &dyn ProcessGroup,
    params: &mut [&mut [f32]],
    root: usize,
    bucket_bytes: usize,
) -> Result<()> {
    let size = group.size();
    if root >= size {
        return Err(Error::Config(format!(
            "broadcast_parameters: root {root} is not a rank of a group of {size}"
        )));
    }
    check_lengths(group, params, root)?;
    let total: usize = params.iter().map(|p| p.len()).sum();
    let cap = (bucket_bytes / std::mem::size_of::<f32>()).max(1);
    let is_root = group.rank() == root;
    let timeout = group.timeout();
    let mut cursor = Cursor::default();
    let mut sent = 0;
    let mut buckets = 0;
    while sent < total {
        let n = cap.min(total - sent);
        let mut chunk = Vec::new();
        chunk
            .try_reserve_exact(n)
            .map_err(|_| Error::buffer(n, std::mem::size_of::<f32>()))?;
        if is_root {
            cursor.read(params, n, &mut chunk);
        } else {
            chunk.resize(n, 0.0);
        }
        let got = group
            .broadcast(Buffer::F32(chunk), root)
            .wait_timeout(timeout)?;
        let Buffer::F32(got) = got else {
            return Err(Error::Comm(collectives::Error::Internal(format!(
                "broadcast of f32 returned {:?}",
                got.dtype()
            ))));
        };
        if got.len() != n {
            return Err(Error::Comm(collectives::Error::Internal(format!(
                "broadcast of {n} elements returned {}",
                got.len()
            ))));
        }
        if is_root {
            cursor.skip(params, n);
        } else {
            cursor.write(params, &got);
        }
        sent += n;
        buckets += 1;
    }
    tracing::debug!(
        root,
        params = params.len(),
        elements = total,
        buckets,
        "broadcast_parameters"
    );
    Ok(())
}

/// Broadcasts root's parameter count, total length and a fingerprint of its lengths;
/// every rank compares them with its own and the ranks agree (one all-reduce) on which
/// differ, so that every rank fails if any does.
fn check_lengths(group: &dyn ProcessGroup, params: &[&mut [f32]], root: usize) -> Result<()> {
    let mine = Header::of(params);
    let got = group
        .broadcast(Buffer::U8(mine.to_bytes()), root)
        .wait_timeout(group.timeout())?;
    let theirs = match got {
        Buffer::U8(b) => Header::from_bytes(&b),
        _ => None,
    }
    .ok_or_else(|| {
        Error::Comm(collectives::Error::Internal(
            "broadcast_parameters: the root's header came back malformed".into(),
        ))
    })?;
    let mut flags = vec![0.0f32; group.size()];
    flags[group.rank()] = if theirs == mine { 0.0 } else { 1.0 };
    let flags = group
        .all_reduce(Buffer::F32(flags), ReduceOp::Max)
        .wait_timeout(group.timeout())?;
    let differ: Vec<usize> = match &flags {
        Buffer::F32(f) => f
            .iter()
            .enumerate()
            .filter(|(_, &x)| x != 0.0)
            .map(|(r, _)| r)
            .collect(),
        other => {
            return Err(Error::Comm(collectives::Error::Internal(format!(
                "all-reduce of f32 returned {:?}",
                other.dtype()
            ))))
        }
    };
    if differ.is_empty() {
        return Ok(());
    }
    let ranks = differ
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let here = if theirs == mine {
        String::new()
    } else {
        let how = if (mine.count, mine.total) == (theirs.count, theirs.total) {
            " (the same count and total, but different lengths)"
        } else {
            ""
        };
        format!(
            "; this rank ({}) holds {} parameters of {} elements in all{how}",
            group.rank(),
            mine.count,
            mine.total
        )
    };
    Err(Error::Comm(collectives::Error::Mismatch(format!(
        "broadcast_parameters from rank {root}: the parameters of rank(s) {ranks} differ in \
         length from the root's ({} parameters of {} elements in all){here}; every rank \
         must pass slices of the same lengths in the same order; nothing was copied",
        theirs.count, theirs.total
    ))))
}

/// What ranks compare before the data moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    count: u64,
    total: u64,
    /// FNV-1a over the lengths, in order.
    fingerprint: u64,
}

impl Header {
    fn of(params: &[&mut [f32]]) -> Header {
        let mut fingerprint: u64 = 0xcbf2_9ce4_8422_2325;
        for p in params {
            for b in (p.len() as u64).to_le_bytes() {
                fingerprint = (fingerprint ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        Header {
            count: params.len() as u64,
            total: params.iter().map(|p| p.len() as u64).sum(),
            fingerprint,
        }
    }

    fn to_bytes(self) -> Vec<u8> {
        [self.count, self.total, self.fingerprint]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect()
    }

    fn from_bytes(b: &[u8]) -> Option<Header> {
        let word = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                b.get(8 * i..8 * i + 8)?.try_into().ok()?,
            ))
        };
        (b.len() == 24).then_some(())?;
        Some(Header {
            count: word(0)?,
            total: word(1)?,
            fingerprint: word(2)?,
        })
    }
}

/// A position in the concatenation of the parameters: parameter `param`, element `at`.
#[derive(Clone, Copy, Debug, Default)]
struct Cursor {
    param: usize,
    at: usize,
}

impl Cursor {
    /// Walks `n` elements from here, calling `f(param, range)` per piece, and moves on.
    fn walk(
        &mut self,
        params: &[&mut [f32]],
        mut n: usize,
        mut f: impl FnMut(usize, std::ops::Range<usize>),
    ) {
        while n > 0 {
            let len = params[self.param].len();
            if self.at == len {
                self.param += 1;
                self.at = 0;
                continue;
            }
            let take = n.min(len - self.at);
            f(self.param, self.at..self.at + take);
            self.at += take;
            n -= take;
        }
    }

    /// Appends the next `n` elements to `out`.
    fn read(mut self, params: &[&mut [f32]], n: usize, out: &mut Vec<f32>) {
        self.walk(params, n, |p, r| out.extend_from_slice(&params[p][r]));
    }

    /// Moves past the next `n` elements.
    fn skip(&mut self, params: &[&mut [f32]], n: usize) {
        self.walk(params, n, |_, _| {});
    }

    /// Overwrites the next `data.len()` elements with `data`.
    fn write(&mut self, params: &mut [&mut [f32]], data: &[f32]) {
        let mut pieces = Vec::new();
        self.walk(params, data.len(), |p, r| pieces.push((p, r)));
        let mut from = 0;
        for (p, r) in pieces {
            let len = r.len();
            params[p][r].copy_from_slice(&data[from..from + len]);
            from += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_tell_lengths_apart() {
        let (mut a, mut b) = (vec![0.0; 3], vec![0.0; 2]);
        let h = Header::of(&[&mut a, &mut b]);
        assert_eq!(Header::from_bytes(&h.to_bytes()), Some(h));
        assert_eq!(Header::from_bytes(&h.to_bytes()[..23]), None);
        let h2 = Header::of(&[&mut b, &mut a]);
        assert_eq!((h.count, h.total), (h2.count, h2.total));
        assert_ne!(h.fingerprint, h2.fingerprint);
    }

    #[test]
    fn the_cursor_splits_parameters_across_buckets() {
        let (mut a, mut b, mut c) = (vec![1.0, 2.0, 3.0], vec![], vec![4.0, 5.0]);
        let params: Vec<&mut [f32]> = vec![&mut a, &mut b, &mut c];
        let mut cur = Cursor::default();
        let mut out = Vec::new();
        for n in [2, 2, 1] {
            cur.read(&params, n, &mut out);
            cur.skip(&params, n);
        }
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0, 5.0]);
        let (mut x, mut y) = (vec![0.0; 3], vec![0.0; 2]);
        let mut params: Vec<&mut [f32]> = vec![&mut x, &mut y];
        let mut cur = Cursor::default();
        cur.write(&mut params, &[9.0, 8.0]);
        cur.write(&mut params, &[7.0, 6.0, 5.0]);
        assert_eq!((x, y), (vec![9.0, 8.0, 7.0], vec![6.0, 5.0]));
    }
}
