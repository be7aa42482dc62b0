//! The step both quantisation hooks share ([`Core::run`]) and its helpers: the bucket to
//! host memory, the gathered parameters and bytes checked, the errors, the average.

use super::arith::{dequantize, first_nonfinite, qparams, quantize, residual};
use super::memory::{load_quantize, save_quantize, Lease, Shared};
use crate::sequence::Sequencer;
use crate::{CommBackend, CompressionStats, Error, GradBucket, HookState, Result};
use collectives::{Buffer, ProcessGroup, Work};
use std::sync::Arc;

/// A zeroed-or-filled vector of `len` elements whose allocation failure is an error.
fn try_vec<T: Clone>(len: usize, value: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| Error::buffer(len, size_of::<T>()))?;
    v.resize(len, value);
    Ok(v)
}

/// The bucket's values in host memory (a copy; for a device backend, a download that
/// waits for the bucket's stream).
fn to_host<B: CommBackend>(backend: &B, bucket: &GradBucket<B>) -> Result<Vec<f32>> {
    let len = B::buffer_len(bucket.buffer());
    let mut host = try_vec(len, 0.0f32)?;
    backend.download(B::view(bucket.buffer(), ..)?, &mut host)?;
    Ok(host)
}

/// Adds a step's element counts to `stats`, saturating.
fn count(stats: &mut (u64, u64), before: usize, after: usize) {
    let wide = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    stats.0 = stats.0.saturating_add(wide(before));
    stats.1 = stats.1.saturating_add(wide(after));
}

/// The statistics of the counts `(before, after)`.
fn stats_of(stats: (u64, u64)) -> CompressionStats {
    CompressionStats::new(stats.0, stats.1)
}

/// Every rank's gathered values (`what` they are, for the error), each checked to hold
/// `len` of them.
fn gathered<T>(bufs: Vec<Buffer>, len: usize, index: usize, what: &str) -> Result<Vec<Vec<T>>>
where
    Vec<T>: TryFrom<Buffer, Error = collectives::Error>,
{
    bufs.into_iter()
        .enumerate()
        .map(|(r, b)| {
            let v = Vec::<T>::try_from(b)?;
            if v.len() != len {
                return Err(Error::Bucket {
                    index,
                    why: format!(
                        "rank {r} sent {} {what}, this rank {len}: the ranks' buckets differ in length",
                        v.len()
                    ),
                });
            }
            Ok(v)
        })
        .collect()
}

/// The error of every rank when rank `r`'s parameters are not finite (`local`: this
/// rank's first non-finite element, when `r` is this rank).
fn nonfinite(
    hook: &str,
    index: usize,
    r: usize,
    row: Option<usize>,
    scale: f32,
    local: Option<(usize, f32)>,
) -> Error {
    let row = row.map(|c| format!(" (row {c})")).unwrap_or_default();
    let what = match local {
        Some((i, v)) => format!("holds {v} at element {i}"),
        None => "holds a NaN or an infinity, or values whose range overflows f32".into(),
    };
    Error::Bucket {
        index,
        why: format!(
            "{hook}: rank {r}'s bucket {what}: its quantisation scale{row} is {scale}, not finite; \
             no rank quantised the bucket (every rank reports this)"
        ),
    }
}

/// A work that has failed with `e`.
fn failed<T: Send + 'static>(e: Error) -> Work<T> {
    Work::ready(Err(e.into()))
}

/// `out / world` element by element, then uploaded as the backend's buffer.
fn finish<B: CommBackend>(
    backend: &B,
    mut out: Vec<f32>,
    world: usize,
) -> collectives::Result<B::Buffer<f32>> {
    let w = world as f32;
    for o in &mut out {
        *o /= w;
    }
    backend
        .upload(&out)
        .map_err(|e| collectives::Error::from(Error::from(e)))
}

/// How a hook cuts its bucket into rows, each quantised with its own scale and zero
/// point.
#[derive(Clone, Copy)]
pub(super) enum Layout {
    /// One row, the whole bucket, never padded.
    PerTensor,
    /// Rows of this many elements, the last one zero-padded (at least 1 element of it).
    PerChannel(usize),
}

/// What both quantisation hooks hold, and the step they share: the parameters gathered
/// first, then the bytes, then every rank's values dequantised and averaged.
pub(super) struct Core<B> {
    backend: Arc<B>,
    group: Arc<dyn ProcessGroup>,
    stats: (u64, u64),
    memories: Option<Shared>,
    /// Each bucket's two all-gathers reach the group after the previous bucket's (the
    /// second is issued from a continuation: see `sequence.rs`).
    sequence: Sequencer,
}

impl<B: CommBackend> Core<B> {
    /// A hook's state over `group`, with error feedback on or off.
    pub(super) fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>, error_feedback: bool) -> Self {
        Core {
            backend,
            group,
            stats: (0, 0),
            memories: error_feedback.then(Shared::default),
            sequence: Sequencer::default(),
        }
    }

    /// Whether the hook keeps error feedback.
    pub(super) fn error_feedback(&self) -> bool {
        self.memories.is_some()
    }

    /// One bucket's step of the hook named `hook`, its rows cut as `layout` says.
    pub(super) fn run(
        &mut self,
        bucket: GradBucket<B>,
        layout: Layout,
        hook: String,
    ) -> Work<B::Buffer<f32>> {
        let index = bucket.index();
        let mut x = match to_host(&*self.backend, &bucket) {
            Ok(x) => x,
            Err(e) => return failed(e),
        };
        drop(bucket);
        let mut lease = match self
            .memories
            .as_ref()
            .map(|m| Lease::take(m, index, &mut x))
        {
            Some(Err(e)) => return failed(e),
            Some(Ok(l)) => Some(l),
            None => None,
        };
        let n = x.len();
        // Per channel: `numel / bs` full rows and a last one that holds padding (at least
        // 1). Per tensor: one row of the whole bucket (`max(1)`: chunks of 0 elements
        // cannot be cut; an empty bucket has no chunk either way).
        let (bs, rows, per_channel) = match layout {
            Layout::PerTensor => (n.max(1), 1, false),
            Layout::PerChannel(bs) => (bs, n / bs + 1, true),
        };
        count(
            &mut self.stats,
            n,
            n.div_ceil(4).saturating_add(rows.saturating_mul(2)),
        );
        let mut params = match try_vec(rows.saturating_mul(2), 0.0f32) {
            Ok(p) => p,
            Err(e) => return failed(e),
        };
        let mut local = None;
        for c in 0..rows {
            let start = c * bs;
            let row = &x[start..start.saturating_add(bs).min(n)];
            let (s, z) = qparams(row, per_channel && row.len() < bs);
            if !s.is_finite() && local.is_none() {
                local = first_nonfinite(row).map(|(i, v)| (c, (start + i, v)));
            }
            (params[c], params[rows + c]) = (s, z);
        }
        let (backend, group) = (self.backend.clone(), self.group.clone());
        let (rank, world) = (group.rank(), group.size());
        let first = self.group.clone();
        self.sequence.next(move |issued| {
            first
                .all_gather(Buffer::F32(params))
                .and_then(move |params| {
                    let params =
                        match gathered::<f32>(params, 2 * rows, index, "quantisation parameters") {
                            Ok(p) => p,
                            Err(e) => return failed(e),
                        };
                    for (r, p) in params.iter().enumerate() {
                        if let Some(c) =
                            (0..rows).find(|&c| !p[c].is_finite() || !p[rows + c].is_finite())
                        {
                            let here = local.filter(|_| r == rank).map(|(_, l)| l);
                            let row = local.filter(|_| r == rank).map_or(c, |(c, _)| c);
                            let named = per_channel.then_some(row);
                            return failed(nonfinite(&hook, index, r, named, p[row], here));
                        }
                    }
                    let own = &params[rank];
                    let mut q = match try_vec(n, 0u8) {
                        Ok(q) => q,
                        Err(e) => return failed(e),
                    };
                    for (c, (q, x)) in q.chunks_mut(bs).zip(x.chunks(bs)).enumerate() {
                        let (s, z) = (own[c], own[rows + c]);
                        for (q, &v) in q.iter_mut().zip(x) {
                            *q = quantize(v, s, z);
                        }
                    }
                    match lease.as_mut() {
                        Some(l) => {
                            let mut x = x;
                            residual(&mut x, &q, |i| (own[i / bs], own[rows + i / bs]));
                            l.pending = Some(x);
                        }
                        None => drop(x),
                    }
                    let sent = group.all_gather(Buffer::U8(q));
                    // Both of this bucket's collectives are issued: the next bucket may go.
                    issued.complete(Ok(()));
                    sent.then(move |r| {
                        let qs = gathered::<u8>(r?, n, index, "quantised bytes")?;
                        let mut out = try_vec(n, 0.0f32)?;
                        for (q, p) in qs.iter().zip(&params) {
                            for (c, (o, q)) in out.chunks_mut(bs).zip(q.chunks(bs)).enumerate() {
                                let (s, z) = (p[c], p[rows + c]);
                                for (o, &b) in o.iter_mut().zip(q) {
                                    *o += dequantize(b, s, z);
                                }
                            }
                        }
                        let out = finish(&*backend, out, world)?;
                        if let Some(l) = lease {
                            l.commit();
                        }
                        Ok(out)
                    })
                })
        })
    }

    /// `save_state` of the hook named `name`.
    pub(super) fn save_state(&self, name: String) -> Result<HookState> {
        save_quantize(name, self.memories.as_ref())
    }

    /// `load_state` of the hook named `name`.
    pub(super) fn load_state(&self, name: &str, state: HookState) -> Result<()> {
        load_quantize(name, self.memories.as_ref(), state)
    }

    /// The statistics of every step so far.
    pub(super) fn compression_stats(&self) -> CompressionStats {
        stats_of(self.stats)
    }
}
