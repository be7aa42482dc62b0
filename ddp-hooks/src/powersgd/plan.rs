//! Which tensors of a bucket are compressed, and where their factors live.

use crate::bucket::Layout;

/// One compressed tensor: its place in the bucket and in the factor memories.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mat {
    pub offset: usize,
    pub n: usize,
    pub m: usize,
    pub r: usize,
    pub p_off: usize,
    pub q_off: usize,
    pub e_off: usize,
    /// The validated shape of this matrix's products.
    pub dims: lowrank::Dims,
}

impl Mat {
    pub fn dims(&self) -> lowrank::Dims {
        self.dims
    }
}

/// The compression plan of a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub len: usize,
    pub compressed: Vec<Mat>,
    /// `(offset in the bucket, length)` of each uncompressed tensor.
    pub uncompressed: Vec<(usize, usize)>,
    pub p_len: usize,
    pub q_len: usize,
    pub e_len: usize,
    pub u_len: usize,
    /// Elements before and after compression, for the statistics.
    pub before: u64,
    pub after: u64,
}

impl Plan {
    /// PyTorch's test: compress iff `(n + m) · r · rate < n · m`, `r = min(n, m, rank)`.
    pub fn new(layout: &Layout, rank: usize, rate: f64) -> lowrank::Result<Plan> {
        let mut plan = Plan {
            len: layout.len(),
            compressed: Vec::new(),
            uncompressed: Vec::new(),
            p_len: 0,
            q_len: 0,
            e_len: 0,
            u_len: 0,
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
                    dims,
                    offset: slot.offset,
                    n,
                    m,
                    r,
                    p_off: plan.p_len,
                    q_off: plan.q_len,
                    e_off: plan.e_len,
                });
                plan.p_len = add(plan.p_len, dims.p_len())?;
                plan.q_len = add(plan.q_len, dims.q_len())?;
                plan.e_len = add(plan.e_len, nm)?;
                plan.after = plan.after.saturating_add(thin as u64);
            } else {
                plan.uncompressed.push((slot.offset, slot.len));
                plan.u_len = add(plan.u_len, slot.len)?;
                plan.after = plan.after.saturating_add(slot.len as u64);
            }
        }
        Ok(plan)
    }
}
