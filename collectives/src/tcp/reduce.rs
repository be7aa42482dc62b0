//! The element loops of the TCP backend: one rank's chunk reduced from every rank's
//! contribution in rank order, exactly as the thread backend reduces it (`acc = rank 0's
//! value`, then each next rank's combined in, `Avg` divided by the group size once, the
//! 16-bit formats accumulated in `f32` and rounded once), so the results are the same
//! bits.

use crate::buffer::Reducible;
use crate::{Buffer, Error, ReduceOp, Result};
use half::{bf16, f16};
use std::ops::Range;

/// Elements reduced at a time: the accumulator stays in L1.
const CHUNK: usize = 1024;

/// An element type a buffer holds and reductions work on.
pub(crate) trait Elem: Reducible + bytemuck::Pod
where
    Self::Acc: Default + std::ops::Div<Output = Self::Acc>,
{
    fn slice(b: &Buffer) -> Option<&[Self]>;
    fn slice_mut(b: &mut Buffer) -> Option<&mut [Self]>;
}

macro_rules! elem {
    ($($t:ty => $v:ident),*) => {$(
        impl Elem for $t {
            fn slice(b: &Buffer) -> Option<&[Self]> {
                match b { Buffer::$v(v) => Some(v), _ => None }
            }
            fn slice_mut(b: &mut Buffer) -> Option<&mut [Self]> {
                match b { Buffer::$v(v) => Some(v), _ => None }
            }
        }
    )*};
}

elem!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16);

/// Reduces in `dst` the contributions of `others.len() + 1` ranks, in rank order:
/// rank `me`'s is `dst` as it is, and `others` holds the rest in rank order (skipping
/// `me`), each the length of `dst`.
pub(crate) fn combine<T: Elem>(dst: &mut [T], me: usize, others: &[&[T]], op: ReduceOp)
where
    T::Acc: Default + std::ops::Div<Output = T::Acc>,
{
    let n = others.len() + 1;
    let scale = T::acc_from_usize(n);
    let mut acc = [T::Acc::default(); CHUNK];
    let mut start = 0;
    while start < dst.len() {
        let len = CHUNK.min(dst.len() - start);
        let acc = &mut acc[..len];
        for r in 0..n {
            let src: &[T] = if r == me {
                &dst[start..start + len]
            } else {
                &others[if r < me { r } else { r - 1 }][start..start + len]
            };
            if r == 0 {
                T::widen_slice(src, acc);
            } else {
                T::accumulate(acc, src, op);
            }
        }
        if op == ReduceOp::Avg {
            acc.iter_mut().for_each(|a| *a = *a / scale);
        }
        T::narrow_slice(acc, &mut dst[start..start + len]);
        start += len;
    }
}

/// [`combine`] on buffers: `range` of `dst` (this rank's, rank `me`) with the
/// `others`' payloads (each of `range`'s length, in rank order skipping `me`).
pub(crate) fn combine_buffers(
    dst: &mut Buffer,
    range: Range<usize>,
    me: usize,
    others: &[&Buffer],
    op: ReduceOp,
) -> Result<()> {
    fn typed<T: Elem>(
        dst: &mut Buffer,
        range: Range<usize>,
        me: usize,
        others: &[&Buffer],
        op: ReduceOp,
    ) -> Result<()>
    where
        T::Acc: Default + std::ops::Div<Output = T::Acc>,
    {
        let wrong = || Error::Internal("a TCP frame of the wrong type reached a reduction".into());
        let mut views = Vec::with_capacity(others.len());
        for b in others {
            let s = T::slice(b).ok_or_else(wrong)?;
            if s.len() != range.len() {
                return Err(Error::Protocol(format!(
                    "a TCP frame holds {} elements where {} were due",
                    s.len(),
                    range.len()
                )));
            }
            views.push(s);
        }
        let d = T::slice_mut(dst).ok_or_else(wrong)?;
        let d = d
            .get_mut(range)
            .ok_or_else(|| Error::Internal("a chunk outside its buffer".into()))?;
        combine(d, me, &views, op);
        Ok(())
    }
    match dst {
        Buffer::F32(_) => typed::<f32>(dst, range, me, others, op),
        Buffer::F64(_) => typed::<f64>(dst, range, me, others, op),
        Buffer::F16(_) => typed::<f16>(dst, range, me, others, op),
        Buffer::BF16(_) => typed::<bf16>(dst, range, me, others, op),
        Buffer::U8(_) => Err(Error::InvalidArgument(
            "U8 buffers hold raw bytes that do not reduce".into(),
        )),
    }
}
