//! The element loops of the thread backend: each rank reduces its share of every buffer,
//! reading the peers' buffers in place and writing the result into all of them.

use super::world::Addr;
use crate::buffer::Reducible;
use crate::{DType, ReduceOp};
use half::{bf16, f16};
use std::ops::Range;

/// Elements reduced at a time: the accumulator stays in L1.
const CHUNK: usize = 1024;

/// Reduces `range` of the `dtype` buffers at `addrs` (one per rank) with `op`; writes the
/// result into every buffer (`out = None`) or into `out` (reduce-scatter).
///
/// # Safety
/// Every address must point to a live buffer of `dtype` covering `range`; no other thread
/// may access `range` of any of them during the call.
pub(crate) unsafe fn reduce(
    dtype: DType,
    addrs: &[Addr],
    range: Range<usize>,
    op: ReduceOp,
    out: Option<Addr>,
) {
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match dtype {
            DType::F32 => reduce_typed::<f32>(addrs, range, op, out),
            DType::F16 => reduce_typed::<f16>(addrs, range, op, out),
            DType::BF16 => reduce_typed::<bf16>(addrs, range, op, out),
            DType::F64 => reduce_typed::<f64>(addrs, range, op, out),
        }
    }
}

unsafe fn reduce_typed<T: Reducible>(
    addrs: &[Addr],
    range: Range<usize>,
    op: ReduceOp,
    out: Option<Addr>,
) where
    T::Acc: Default + std::ops::Div<Output = T::Acc>,
{
    let n = T::acc_from_usize(addrs.len());
    let mut acc = [T::Acc::default(); CHUNK];
    let mut start = range.start;
    while start < range.end {
        let len = CHUNK.min(range.end - start);
        let acc = &mut acc[..len];
        // SAFETY: the caller guarantees each address covers `range` and that nobody else
        // touches it, so these shared and (at the end) exclusive slices do not alias any
        // live reference.
        unsafe {
            let src = |a: Addr| std::slice::from_raw_parts((a as *const T).add(start), len);
            T::widen_slice(src(addrs[0]), acc);
            for &peer in &addrs[1..] {
                T::accumulate(acc, src(peer), op);
            }
            if op == ReduceOp::Avg {
                acc.iter_mut().for_each(|a| *a = *a / n);
            }
            let write = |a: *mut T| T::narrow_slice(acc, std::slice::from_raw_parts_mut(a, len));
            match out {
                Some(o) => write((o as *mut T).add(start - range.start)),
                None => addrs.iter().for_each(|&a| write((a as *mut T).add(start))),
            }
        }
        start += len;
    }
}
