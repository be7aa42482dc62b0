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
            DType::F32 if out.is_none() && matches!(op, ReduceOp::Sum | ReduceOp::Avg) => {
                sum_f32(addrs, range, op)
            }
            DType::F32 => reduce_typed::<f32>(addrs, range, op, out),
            DType::F16 => reduce_typed::<f16>(addrs, range, op, out),
            DType::BF16 => reduce_typed::<bf16>(addrs, range, op, out),
            DType::F64 => reduce_typed::<f64>(addrs, range, op, out),
            // The collectives that reduce reject U8 buffers before posting anything
            // (`buffer::unreducible`); were one to get here, the panic is contained by
            // the rendezvous and fails the group, never leaving a buffer unreduced.
            DType::U8 => panic!("a U8 buffer reached a reduction"),
        }
    }
}

/// `f32` sums and means written into every rank's buffer, in one pass over small blocks
/// that stay in registers (the general path stages 4 KiB blocks through an accumulator
/// array in separate passes, which measured 35% slower at 64 MiB on two ranks). Same
/// order of additions, so the same bits.
///
/// # Safety
/// As [`reduce`].
unsafe fn sum_f32(addrs: &[Addr], range: Range<usize>, op: ReduceOp) {
    if let [a, b] = *addrs {
        // SAFETY: forwarded caller guarantees.
        return unsafe { sum_two_f32(a, b, range, op) };
    }
    const W: usize = 64;
    let n = addrs.len() as f32;
    let mut i = range.start;
    while i < range.end {
        let w = W.min(range.end - i);
        let mut acc = [0.0f32; W];
        let acc = &mut acc[..w];
        // SAFETY: the caller guarantees every buffer covers `range` and that nobody else
        // touches it; each slice below lives only for its statement.
        unsafe {
            let at = |a: Addr| (a as *mut f32).add(i);
            acc.copy_from_slice(std::slice::from_raw_parts(at(addrs[0]), w));
            for &peer in &addrs[1..] {
                let xs = std::slice::from_raw_parts(at(peer), w);
                acc.iter_mut().zip(xs).for_each(|(a, x)| *a += x);
            }
            if op == ReduceOp::Avg {
                acc.iter_mut().for_each(|a| *a /= n);
            }
            for &dst in addrs {
                std::slice::from_raw_parts_mut(at(dst), w).copy_from_slice(acc);
            }
        }
        i += w;
    }
}

/// Two ranks (DDP's most common case), one element at a time: `a = b = (a + b) / 2`
/// for a mean (the same bits as dividing).
///
/// # Safety
/// As [`reduce`]; `a` and `b` are distinct buffers.
unsafe fn sum_two_f32(a: Addr, b: Addr, range: Range<usize>, op: ReduceOp) {
    let scale = if op == ReduceOp::Avg { 0.5f32 } else { 1.0 };
    let len = range.len();
    // SAFETY: both buffers cover `range`, nobody else touches it, and they are distinct.
    unsafe {
        let a = std::slice::from_raw_parts_mut((a as *mut f32).add(range.start), len);
        let b = std::slice::from_raw_parts_mut((b as *mut f32).add(range.start), len);
        for (x, y) in a.iter_mut().zip(b.iter_mut()) {
            let v = (*x + *y) * scale;
            *x = v;
            *y = v;
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

/// `f32` buffers reduced as if sent in the 16-bit `wire` format, in one pass: each rank's
/// values are rounded to `wire` and widened, combined in `f32` exactly as [`reduce`] does
/// for `wire` buffers (same order, same operations), rounded to `wire` once more and
/// written, widened, into every buffer. The results are bit-identical to narrowing every
/// buffer, reducing those and widening the result, without the extra passes.
///
/// # Safety
/// As [`reduce`], for `f32` buffers.
pub(crate) unsafe fn reduce_wire(wire: DType, addrs: &[Addr], range: Range<usize>, op: ReduceOp) {
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match wire {
            DType::F16 => reduce_wire_typed::<f16>(addrs, range, op),
            DType::BF16 => reduce_wire_typed::<bf16>(addrs, range, op),
            // F32 wires are plain reductions (checked by the caller); F64 is refused.
            DType::F32 | DType::F64 | DType::U8 => reduce(DType::F32, addrs, range, op, None),
        }
    }
}

/// Elements converted at a time: the temporaries stay in L1.
const WIRE_BLOCK: usize = 512;

unsafe fn reduce_wire_typed<T: Reducible<Acc = f32>>(
    addrs: &[Addr],
    range: Range<usize>,
    op: ReduceOp,
) {
    let round: fn(&mut [f32]) = if T::BITS_BF16 {
        super::rounding::round_to_bf16
    } else {
        super::rounding::round_to_f16
    };
    if let [a, b] = *addrs {
        // SAFETY: both buffers cover `range`, nobody else touches it, and they are
        // distinct (every rank posts its own buffer).
        return unsafe {
            super::rounding::two_ranks(
                T::BITS_BF16,
                (a as *mut f32).add(range.start),
                (b as *mut f32).add(range.start),
                range.len(),
                op,
            )
        };
    }
    let n = T::acc_from_usize(addrs.len());
    let mut acc = [0.0f32; WIRE_BLOCK];
    let mut tmp = [0.0f32; WIRE_BLOCK];
    let mut start = range.start;
    while start < range.end {
        let len = WIRE_BLOCK.min(range.end - start);
        let (acc, tmp) = (&mut acc[..len], &mut tmp[..len]);
        // SAFETY: the caller guarantees every address is an f32 buffer covering `range`
        // that nobody else touches; each slice lives only for its statement.
        unsafe {
            let src = |a: Addr| std::slice::from_raw_parts((a as *const f32).add(start), len);
            // Each rank's values as the wire carries them, combined in f32 as `reduce`
            // combines 16-bit buffers (the rounded values are exactly their widenings).
            acc.copy_from_slice(src(addrs[0]));
            round(acc);
            for &peer in &addrs[1..] {
                tmp.copy_from_slice(src(peer));
                round(tmp);
                f32::accumulate(acc, tmp, op);
            }
            if op == ReduceOp::Avg {
                acc.iter_mut().for_each(|a| *a /= n);
            }
            round(acc);
            for &dst in addrs {
                std::slice::from_raw_parts_mut((dst as *mut f32).add(start), len)
                    .copy_from_slice(acc);
            }
        }
        start += len;
    }
}
