//! Which tensors of a bucket are compressed, how they are batched, and where their
//! factors and errors live.
//!
//! **Two orders.** The *saved order* is the compressed tensors' order in the bucket: a
//! [`SavedBucket`](super::SavedBucket) always holds its memories in it, whatever the
//! configuration. The *plan's order* is the order of the hook's own memories, the saved
//! order unless `batch_tensors_with_same_shape` is on: then it is PyTorch's, grouped by
//! shape (the shapes in order of first appearance, each group in bucket order), so the
//! factors and errors of a batch lie one after another as `lowrank`'s batched kernels
//! take them. [`Plan::ours_to_saved`] and [`Plan::saved_to_ours`] move memories
//! between the two.
//!
//! **Batches without copies where possible.** A batch reads its matrices `M` in place
//! when they lie one after another in the bucket (same-shape tensors with nothing
//! between, or a group of one); otherwise they are stacked by copy into a buffer of
//! [`Plan::stack_len`] elements (PyTorch's `torch.stack`), and copied back once
//! decompressed.

use crate::bucket::{shape_str, Layout};
use std::collections::HashMap;
use std::ops::Range;

/// One compressed tensor: its place in the bucket and in the memories.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mat {
    /// First element in the bucket.
    pub offset: usize,
    pub n: usize,
    pub m: usize,
    pub r: usize,
    /// Offsets of its factors and error in the hook's memories (the plan's order).
    pub p_off: usize,
    pub q_off: usize,
    pub e_off: usize,
    /// The same offsets in the saved order.
    pub saved: [usize; 3],
}

/// Where a batch reads and writes its matrices `M`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// In place in the bucket, from this offset (the matrices lie one after another).
    Bucket(usize),
    /// Stacked by copy into the stack buffer, from this offset.
    Stack(usize),
}

/// One batch: same-shape compressed tensors that go through each kernel in one call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Group {
    /// The batch's shape (`batch` = `members.len()`).
    pub dims: lowrank::Dims,
    /// Indices into [`Plan::compressed`], in bucket order.
    pub members: Vec<usize>,
    pub p_off: usize,
    pub q_off: usize,
    pub e_off: usize,
    pub x: Source,
}

impl Group {
    /// The batch's factors `P` in the `P` memory.
    pub fn p_range(&self) -> Range<usize> {
        self.p_off..self.p_off + self.dims.p_len()
    }

    /// The batch's factors `Q` in the `Q` memory.
    pub fn q_range(&self) -> Range<usize> {
        self.q_off..self.q_off + self.dims.q_len()
    }

    /// The batch's errors in the error memory.
    pub fn e_range(&self) -> Range<usize> {
        self.e_off..self.e_off + self.dims.m_len()
    }

    /// The batch's matrices in the bucket or the stack (see [`Group::x`]).
    pub fn x_range(&self) -> Range<usize> {
        let at = match self.x {
            Source::Bucket(at) | Source::Stack(at) => at,
        };
        at..at + self.dims.m_len()
    }

    /// Whether the batch is stacked by copy.
    #[cfg(test)]
    pub fn stacked(&self) -> bool {
        matches!(self.x, Source::Stack(_))
    }
}

/// One of a bucket's memories.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Memory {
    /// The factors `P` (`n x r` each).
    P = 0,
    /// The factors `Q` (`m x r` each).
    Q = 1,
    /// The errors (`n x m` each).
    Error = 2,
}

/// The compression plan of a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub len: usize,
    /// The compressed tensors, in bucket order.
    pub compressed: Vec<Mat>,
    /// The batches, in the plan's order; one per compressed tensor without batching.
    pub groups: Vec<Group>,
    /// `(offset in the bucket, length)` of each run of uncompressed tensors that lie
    /// one after another (one run under [`crate::BucketLayout::ByShape`], whose 1-D
    /// tensors come last), in bucket order: one copy each way per run.
    pub uncompressed: Vec<(usize, usize)>,
    pub p_len: usize,
    pub q_len: usize,
    pub e_len: usize,
    pub u_len: usize,
    /// Elements of the stacking buffer (0 when every batch reads the bucket in place).
    pub stack_len: usize,
    /// Elements before and after compression, for the statistics.
    pub before: u64,
    pub after: u64,
}

impl Plan {
    /// PyTorch's test: compress iff `(n + m) · r · rate < n · m`, `r = min(n, m, rank)`;
    /// with `batch`, same-shape tensors form one batch.
    pub fn new(layout: &Layout, rank: usize, rate: f64, batch: bool) -> lowrank::Result<Plan> {
        let mut plan = Plan {
            len: layout.len(),
            compressed: Vec::new(),
            groups: Vec::new(),
            uncompressed: Vec::new(),
            p_len: 0,
            q_len: 0,
            e_len: 0,
            u_len: 0,
            stack_len: 0,
            before: 0,
            after: 0,
        };
        // A layout's slots fit in `usize` (`Layout::packed` checks), so `n · m <= len`
        // cannot overflow; the factor sizes and sums are checked all the same.
        let overflow = || {
            lowrank::Error::Overflow(format!(
                "the PowerSGD plan of a bucket of {} elements",
                layout.len()
            ))
        };
        let add = |a: usize, b: usize| a.checked_add(b).ok_or_else(overflow);
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(overflow);
        for slot in layout.params() {
            let (n, m) = slot.matrix();
            let r = n.min(m).min(rank);
            let nm = mul(n, m)?;
            let thin = mul(add(n, m)?, r)?;
            plan.before = plan.before.saturating_add(nm as u64);
            if r > 0 && thin as f64 * rate < nm as f64 {
                let dims = lowrank::Dims::new(1, n, m, r)?;
                plan.compressed.push(Mat {
                    offset: slot.offset,
                    n,
                    m,
                    r,
                    p_off: 0,
                    q_off: 0,
                    e_off: 0,
                    saved: [plan.p_len, plan.q_len, plan.e_len],
                });
                plan.p_len = add(plan.p_len, dims.p_len())?;
                plan.q_len = add(plan.q_len, dims.q_len())?;
                plan.e_len = add(plan.e_len, nm)?;
                plan.after = plan.after.saturating_add(thin as u64);
            } else {
                match plan.uncompressed.last_mut() {
                    Some((off, len)) if *off + *len == slot.offset => *len += slot.len,
                    _ => plan.uncompressed.push((slot.offset, slot.len)),
                }
                plan.u_len = add(plan.u_len, slot.len)?;
                plan.after = plan.after.saturating_add(slot.len as u64);
            }
        }
        // The batches: by shape in order of first appearance, or one per tensor.
        let mut members: Vec<Vec<usize>> = Vec::new();
        if batch {
            let mut by_shape: HashMap<(usize, usize), usize> = HashMap::new();
            for (k, mat) in plan.compressed.iter().enumerate() {
                let next = members.len();
                let g = *by_shape.entry((mat.n, mat.m)).or_insert(next);
                if g == next {
                    members.push(Vec::new());
                }
                members[g].push(k);
            }
        } else {
            members = (0..plan.compressed.len()).map(|k| vec![k]).collect();
        }
        // Memory offsets in the plan's order; a batch whose matrices do not lie one
        // after another in the bucket gets a place in the stack.
        let (mut p_at, mut q_at, mut e_at) = (0, 0, 0);
        for ks in members {
            let first = &plan.compressed[ks[0]];
            let (n, m, r) = (first.n, first.m, first.r);
            let dims = lowrank::Dims::new(ks.len(), n, m, r)?;
            let in_place = ks
                .windows(2)
                .all(|w| plan.compressed[w[1]].offset == plan.compressed[w[0]].offset + n * m);
            let x = if in_place {
                Source::Bucket(first.offset)
            } else {
                let at = plan.stack_len;
                plan.stack_len = add(plan.stack_len, dims.m_len())?;
                Source::Stack(at)
            };
            plan.groups.push(Group {
                dims,
                members: ks.clone(),
                p_off: p_at,
                q_off: q_at,
                e_off: e_at,
                x,
            });
            for &k in &ks {
                let mat = &mut plan.compressed[k];
                (mat.p_off, mat.q_off, mat.e_off) = (p_at, q_at, e_at);
                p_at += n * r;
                q_at += m * r;
                e_at += n * m;
            }
        }
        Ok(plan)
    }

    /// Each compressed tensor's `(offset in the plan's order, offset in the saved order,
    /// length)` in `memory`.
    fn slots(&self, memory: Memory) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.compressed.iter().map(move |mat| match memory {
            Memory::P => (mat.p_off, mat.saved[0], mat.n * mat.r),
            Memory::Q => (mat.q_off, mat.saved[1], mat.m * mat.r),
            Memory::Error => (mat.e_off, mat.saved[2], mat.n * mat.m),
        })
    }

    /// Elements of `memory`.
    pub fn memory_len(&self, memory: Memory) -> usize {
        match memory {
            Memory::P => self.p_len,
            Memory::Q => self.q_len,
            Memory::Error => self.e_len,
        }
    }

    /// Whether the plan's order is the saved order (always so without batching).
    pub fn in_saved_order(&self) -> bool {
        self.compressed
            .iter()
            .all(|mat| [mat.p_off, mat.q_off, mat.e_off] == mat.saved)
    }

    /// Whether two plans lay their memories out alike.
    pub fn same_order(&self, other: &Plan) -> bool {
        let offsets = |p: &Plan| -> Vec<[usize; 6]> {
            p.compressed
                .iter()
                .map(|m| {
                    let [a, b, c] = m.saved;
                    [m.p_off, m.q_off, m.e_off, a, b, c]
                })
                .collect()
        };
        offsets(self) == offsets(other)
    }

    /// `memory` in the plan's order, from the saved order.
    pub fn saved_to_ours(&self, memory: Memory, saved: &[f32]) -> lowrank::Result<Vec<f32>> {
        self.permute(memory, saved, |(plan, saved, len)| (saved, plan, len))
    }

    /// `memory` in the saved order, from the plan's order.
    pub fn ours_to_saved(&self, memory: Memory, ours: &[f32]) -> lowrank::Result<Vec<f32>> {
        self.permute(memory, ours, |slot| slot)
    }

    /// Copies each tensor's slice from its `(source, destination, length)` slot.
    fn permute(
        &self,
        memory: Memory,
        src: &[f32],
        slot: impl Fn((usize, usize, usize)) -> (usize, usize, usize),
    ) -> lowrank::Result<Vec<f32>> {
        let len = self.memory_len(memory);
        if src.len() != len {
            return Err(lowrank::Error::LengthMismatch {
                a: "memory",
                len_a: src.len(),
                b: "plan",
                len_b: len,
            });
        }
        let mut dst = vec![0.0; len];
        for (from, to, n) in self.slots(memory).map(slot) {
            dst[to..to + n].copy_from_slice(&src[from..from + n]);
        }
        Ok(dst)
    }
}

impl Plan {
    /// The compressed matrices, in bucket order: what the memories' layout depends on.
    pub fn matrices(&self) -> Vec<(usize, usize, usize)> {
        self.compressed.iter().map(|m| (m.n, m.m, m.r)).collect()
    }

    /// The compressed matrices for an error message (at most 8 shown).
    pub fn matrices_str(&self) -> String {
        let mut parts: Vec<String> = self
            .compressed
            .iter()
            .take(8)
            .map(|m| format!("{}x{} (rank {})", m.n, m.m, m.r))
            .collect();
        if self.compressed.len() > 8 {
            parts.push("…".into());
        }
        format!("[{}]", parts.join(", "))
    }
}

/// A bucket with memory whose length changed, or whose layout no longer fits its memory,
/// is [`Error::Bucket`] (PyTorch fails with an opaque shape error, or, at the same
/// sizes, none at all): a changed length names both lengths; memory sizes that differ
/// name the memory and both sizes; and at the same sizes, parameter shapes that differ
/// from those the memory was built for (`recorded`, [`SavedBucket::layout`]) name both
/// layouts and the first parameter that differs. Same-shape parameters that trade places
/// are not detected; a bucket loaded without a recorded layout is checked for its sizes
/// only (its step then records the layout).
///
/// `sizes` holds each memory's name, its length if the bucket has it, and the length the
/// plan needs; `len` is the bucket length the memories were made for. A bucket without
/// any of them takes any plan.
///
/// [`SavedBucket::layout`]: super::SavedBucket::layout
pub(crate) fn check_memory(
    index: usize,
    len: usize,
    sizes: &[(&str, Option<usize>, usize)],
    recorded: Option<&[Vec<usize>]>,
    plan: &Plan,
    layout: &Layout,
) -> crate::Result<()> {
    let error = |why: String| {
        Err(crate::Error::Bucket {
            index,
            why: format!("{why}: the PowerSGD state cannot be applied"),
        })
    };
    if sizes.iter().all(|(_, has, _)| has.is_none()) {
        return Ok(());
    }
    if len != plan.len {
        return error(format!(
            "the bucket length changed (was {len} elements, now {})",
            plan.len
        ));
    }
    for &(what, has, needs) in sizes {
        if let Some(has) = has.filter(|&h| h != needs) {
            return error(format!(
                "the layout changed at the same length ({} elements): the {what} holds {has} elements, the new layout needs {needs}",
                plan.len
            ));
        }
    }
    if let Some(shapes) = recorded {
        if !same_layout(shapes, layout) {
            return error(layout_mismatch(shapes, layout));
        }
    }
    Ok(())
}

/// Whether `layout`'s parameters have the shapes `shapes`, in order.
pub(crate) fn same_layout(shapes: &[Vec<usize>], layout: &Layout) -> bool {
    shapes.len() == layout.params().len()
        && shapes
            .iter()
            .zip(layout.params())
            .all(|(s, p)| *s == p.shape)
}

/// The parameter shapes of `layout`, as [`SavedBucket::layout`] records them.
pub(crate) fn shapes_of(layout: &Layout) -> Vec<Vec<usize>> {
    layout.params().iter().map(|p| p.shape.clone()).collect()
}

/// Why the memory of a bucket built for parameters of `then` shapes cannot be applied to
/// `now`'s: both layouts (at most 8 shapes each) and the first parameter that differs.
pub(crate) fn layout_mismatch(then: &[Vec<usize>], now: &Layout) -> String {
    let now = shapes_of(now);
    let list = |shapes: &[Vec<usize>]| {
        let mut parts: Vec<String> = shapes.iter().take(8).map(|s| shape_str(s)).collect();
        if shapes.len() > 8 {
            parts.push("…".into());
        }
        format!("{} parameters [{}]", shapes.len(), parts.join(", "))
    };
    let first = then
        .iter()
        .zip(&now)
        .position(|(a, b)| a != b)
        .map(|k| {
            format!(
                "; parameter {k} was {}, is now {}",
                shape_str(&then[k]),
                shape_str(&now[k])
            )
        })
        .unwrap_or_default();
    format!(
        "the bucket layout changed at the same length: its PowerSGD memory was built for {}, the bucket now has {}{first}",
        list(then),
        list(&now)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(shapes: &[Vec<usize>], rank: usize, batch: bool) -> Plan {
        Plan::new(&Layout::packed(shapes).unwrap(), rank, 2.0, batch).unwrap()
    }

    /// Without batching the plan is the per-tensor one, in bucket order, nothing stacked.
    #[test]
    fn unbatched_plans_keep_bucket_order() {
        let p = plan(&[vec![8, 16], vec![8], vec![8, 16], vec![16, 8]], 2, false);
        assert_eq!(p.groups.len(), 3);
        assert!(p.groups.iter().all(|g| g.dims.batch() == 1 && !g.stacked()));
        assert!(p.in_saved_order());
        assert_eq!(p.stack_len, 0);
    }

    /// Same-shape tensors with a bias between them are stacked (their matrices are not
    /// contiguous); the memories are grouped by shape, and the orders convert both ways.
    #[test]
    fn interleaved_same_shapes_are_stacked_and_grouped_by_shape() {
        let shapes = [vec![8, 16], vec![8], vec![16, 8], vec![8, 16], vec![16, 8]];
        let p = plan(&shapes, 2, true);
        assert_eq!(p.groups.len(), 2);
        assert_eq!(p.groups[0].members, vec![0, 2]);
        assert_eq!(p.groups[1].members, vec![1, 3]);
        assert_eq!(p.groups[0].x, Source::Stack(0));
        // The second group's matrices (tensors 2 and 4) are separated by tensor 3.
        assert_eq!(p.groups[1].x, Source::Stack(2 * 128));
        assert_eq!(p.stack_len, 4 * 128);
        assert!(!p.in_saved_order());
        // Tensor 2 (16 x 8, second in the bucket) comes third in the plan's order.
        assert_eq!(p.compressed[1].q_off, 2 * 16 * 2);
        for memory in [Memory::P, Memory::Q, Memory::Error] {
            let saved: Vec<f32> = (0..p.memory_len(memory)).map(|i| i as f32).collect();
            let ours = p.saved_to_ours(memory, &saved).unwrap();
            assert_ne!(ours, saved, "{memory:?}");
            assert_eq!(p.ours_to_saved(memory, &ours).unwrap(), saved, "{memory:?}");
        }
        assert!(p.saved_to_ours(Memory::Q, &[0.0; 3]).is_err());
    }

    /// Same-shape tensors that lie one after another (no bias between, as in a
    /// bias-free transformer's projections) are batched in place: nothing is copied.
    #[test]
    fn adjacent_same_shapes_are_batched_in_place() {
        let shapes = [vec![8], vec![8, 16], vec![8, 16], vec![8, 16], vec![8]];
        let p = plan(&shapes, 1, true);
        assert_eq!(p.groups.len(), 1);
        assert_eq!(p.groups[0].dims.batch(), 3);
        assert_eq!(p.groups[0].x, Source::Bucket(8));
        assert_eq!(p.groups[0].x_range(), 8..8 + 3 * 128);
        assert_eq!(p.stack_len, 0);
        assert!(p.in_saved_order());
        assert!(p.same_order(&plan(&shapes, 1, false)));
    }

    /// A BERT-like bucket (two layers, each four projections with their biases, norms
    /// and the MLP) arranged by `BucketLayout::ByShape`: every batch is read in place
    /// and the uncompressed tensors are one run at the end; in launch order the same
    /// bucket needs the stack and one copy per tensor.
    #[test]
    fn by_shape_buckets_need_no_stack_and_one_gather() {
        let h = 16;
        let mut launch = Vec::new();
        for _ in 0..2 {
            for _ in 0..4 {
                launch.extend([vec![h, h], vec![h]]);
            }
            launch.extend([
                vec![h],
                vec![h],
                vec![4 * h, h],
                vec![4 * h],
                vec![h, 4 * h],
            ]);
            launch.extend([vec![h], vec![h], vec![h]]);
        }
        let order = crate::BucketLayout::ByShape.arrange(&launch);
        let arranged: Vec<Vec<usize>> = order.iter().map(|&i| launch[i].clone()).collect();
        let (before, after) = (plan(&launch, 2, true), plan(&arranged, 2, true));
        assert!(before.stack_len > 0);
        assert!(before.uncompressed.len() > 1);
        assert_eq!(after.stack_len, 0);
        assert_eq!(after.groups.len(), 3);
        assert!(after
            .groups
            .iter()
            .all(|g| matches!(g.x, Source::Bucket(_))));
        assert_eq!(after.groups[0].dims.batch(), 8);
        let tail: usize = launch.iter().filter(|s| s.len() == 1).map(|s| s[0]).sum();
        assert_eq!(after.uncompressed, vec![(after.len - tail, tail)]);
        assert_eq!(after.u_len, before.u_len);
        assert_eq!((after.before, after.after), (before.before, before.after));
    }

    /// Adjacent uncompressed tensors are one run; a compressed tensor between splits it.
    #[test]
    fn uncompressed_runs_are_coalesced() {
        let p = plan(
            &[vec![3], vec![4], vec![8, 16], vec![5], vec![2, 2]],
            1,
            false,
        );
        // [2, 2] at rank 1: (2 + 2) · 1 · 2 = 8 is not below 4, so it stays uncompressed.
        assert_eq!(p.uncompressed, vec![(0, 7), (7 + 128, 5 + 4)]);
        assert_eq!(p.u_len, 16);
    }
}
