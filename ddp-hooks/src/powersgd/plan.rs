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
}

impl Mat {
    pub fn dims(&self) -> lowrank::Dims {
        // `r <= MAX_RANK` and the sizes come from a buffer that exists.
        lowrank::Dims {
            batch: 1,
            n: self.n,
            m: self.m,
            r: self.r,
        }
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
    pub fn new(layout: &Layout, rank: usize, rate: f64) -> Plan {
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
        for slot in layout.params() {
            let (n, m) = slot.matrix();
            let r = n.min(m).min(rank);
            plan.before += (n * m) as u64;
            if r > 0 && ((n + m) * r) as f64 * rate < (n * m) as f64 {
                plan.compressed.push(Mat {
                    offset: slot.offset,
                    n,
                    m,
                    r,
                    p_off: plan.p_len,
                    q_off: plan.q_len,
                    e_off: plan.e_len,
                });
                plan.p_len += n * r;
                plan.q_len += m * r;
                plan.e_len += n * m;
                plan.after += ((n + m) * r) as u64;
            } else {
                plan.uncompressed.push((slot.offset, slot.len));
                plan.u_len += slot.len;
                plan.after += slot.len as u64;
            }
        }
        plan
    }
}
