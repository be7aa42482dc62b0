//! 8-bit quantisation hooks (PyTorch's experimental `quantization_pertensor_hook` and
//! `quantization_perchannel_hook`): each rank quantises its bucket to `u8` with its own
//! MinMax-observer parameters, every rank all-gathers every rank's parameters and bytes,
//! and each rank dequantises all of them and averages them in `f32`.
//!
//! The arithmetic, the error bound and the differences from PyTorch are documented on
//! [`QuantizePerTensor`].

use crate::sequence::Sequencer;
use crate::{CommBackend, CommHook, CompressionStats, Error, GradBucket, HookState, Result};
use collectives::{Buffer, ProcessGroup, Work};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// PyTorch's default row length of the per-channel hook.
pub(crate) const DEFAULT_BUCKET_SIZE: usize = 512;

/// The largest value of a `quint8` (PyTorch's `quant_max`; `quant_min` is 0).
const QMAX: f32 = 255.0;

/// A zeroed-or-filled vector of `len` elements whose allocation failure is an error.
fn try_vec<T: Clone>(len: usize, value: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| Error::buffer(len, size_of::<T>()))?;
    v.resize(len, value);
    Ok(v)
}

/// MinMax-observer parameters `(scale, zero_point)` of `xs` with the range forced to
/// contain 0 (`padded`: as if a zero were among them, which changes nothing since the
/// range contains 0 anyway). `(NaN, 0)` if a value is not finite. An empty `xs` without
/// padding is PyTorch's uninitialised observer: `(1, 0)`.
fn qparams(xs: &[f32], padded: bool) -> (f32, f32) {
    if xs.is_empty() && !padded {
        return (1.0, 0.0);
    }
    // Branch-free passes the compiler vectorises: the range (`min`/`max` skip NaN, and
    // let infinities through), then whether any element is NaN.
    let (lo, hi) = xs
        .iter()
        .fold((0.0f32, 0.0f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let nan = xs.iter().fold(false, |nan, x| nan | x.is_nan());
    if nan || !lo.is_finite() || !hi.is_finite() {
        return (f32::NAN, 0.0);
    }
    let scale = ((hi - lo) / QMAX).max(f32::EPSILON);
    // PyTorch: `quant_min - round(lo / scale).to(int)`, clamped; an integer, so `+0.0`.
    let zp = (-(lo / scale).round_ties_even()).clamp(0.0, QMAX) as i32;
    (scale, zp as f32)
}

/// `clamp(round(x / scale) + zp, 0, 255)` as a byte, rounding half to even.
///
/// The rounding is `(v + 1.5·2²³) − 1.5·2²³`, which in the default rounding mode is
/// `round_ties_even(v)` exactly for `|v| ≤ 2²²` (the sum lands where floats are one apart),
/// in two adds the compiler vectorises (`round_ties_even` is a libm call on a baseline
/// x86-64 target). `v` is clamped to ±2²² first: with `zp` in 0..=255 anything beyond
/// ±512 ends at the same bound of the byte, so the result is unchanged.
fn quantize(x: f32, scale: f32, zp: f32) -> u8 {
    const MAGIC: f32 = 12_582_912.0;
    const LIMIT: f32 = 4_194_304.0;
    let v = (x / scale).clamp(-LIMIT, LIMIT);
    (((v + MAGIC) - MAGIC) + zp).clamp(0.0, QMAX) as u8
}

/// `scale · (q − zp)`.
fn dequantize(q: u8, scale: f32, zp: f32) -> f32 {
    scale * (f32::from(q) - zp)
}

/// The first element of `xs` that is not finite, with its position.
fn first_nonfinite(xs: &[f32]) -> Option<(usize, f32)> {
    xs.iter().copied().enumerate().find(|(_, x)| !x.is_finite())
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

/// Every rank's gathered `f32` parameters, each checked to hold `len` values.
fn gathered_params(bufs: Vec<Buffer>, len: usize, index: usize) -> Result<Vec<Vec<f32>>> {
    bufs.into_iter()
        .enumerate()
        .map(|(r, b)| {
            let v = Vec::<f32>::try_from(b)?;
            if v.len() != len {
                return Err(Error::Bucket {
                    index,
                    why: format!(
                        "rank {r} sent {} quantisation parameters, this rank {len}: the ranks' buckets differ in length",
                        v.len()
                    ),
                });
            }
            Ok(v)
        })
        .collect()
}

/// Every rank's gathered bytes, each checked to hold `len` values.
fn gathered_bytes(bufs: Vec<Buffer>, len: usize, index: usize) -> Result<Vec<Vec<u8>>> {
    bufs.into_iter()
        .enumerate()
        .map(|(r, b)| {
            let v = Vec::<u8>::try_from(b)?;
            if v.len() != len {
                return Err(Error::Bucket {
                    index,
                    why: format!(
                        "rank {r} sent {} quantised bytes, this rank {len}: the ranks' buckets differ in length",
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

/// The error-feedback memories of a hook, per bucket index, and the buckets with a step
/// in flight.
#[derive(Default)]
struct Memories {
    /// `e` per bucket index: the bucket's length, `f32`.
    errors: BTreeMap<usize, Vec<f32>>,
    /// Buckets whose step has started and not yet completed or failed.
    in_flight: BTreeSet<usize>,
}

/// A hook's memories, shared with its steps in flight.
type Shared = Arc<Mutex<Memories>>;

/// Locks the memories. Every update completes before the lock is released, so a lock
/// poisoned by a panicking continuation holds consistent data.
fn lock(m: &Mutex<Memories>) -> MutexGuard<'_, Memories> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The error for a bucket whose previous step has not completed.
fn in_flight(index: usize) -> Error {
    Error::Bucket {
        index,
        why: "the previous step of this bucket has not completed (wait for every hook's work before the next step)".into(),
    }
}

/// One step's hold on its bucket's memory: taken by [`Lease::take`], which adds `e` into
/// the bucket; [`commit`](Lease::commit) stores the new `e` once the step has succeeded.
/// Dropped without committing (any failure), it leaves the memory as before the step.
struct Lease {
    shared: Shared,
    index: usize,
    /// The new `e`, once computed.
    pending: Option<Vec<f32>>,
}

impl Lease {
    /// Marks bucket `index` in flight and adds its memory (none: zeros) into `x`, element
    /// by element (`x + e`). A step already in flight, or a memory of another length, is
    /// [`Error::Bucket`].
    fn take(shared: &Shared, index: usize, x: &mut [f32]) -> Result<Self> {
        let mut m = lock(shared);
        if m.in_flight.contains(&index) {
            return Err(in_flight(index));
        }
        if let Some(e) = m.errors.get(&index) {
            if e.len() != x.len() {
                return Err(Error::Bucket {
                    index,
                    why: format!(
                        "the error-feedback memory holds {} elements, the bucket {}: the bucket changed length (or a state of another model was loaded)",
                        e.len(),
                        x.len()
                    ),
                });
            }
            for (x, e) in x.iter_mut().zip(e) {
                *x += e;
            }
        }
        m.in_flight.insert(index);
        Ok(Lease {
            shared: shared.clone(),
            index,
            pending: None,
        })
    }

    /// Stores the new memory: the step succeeded.
    fn commit(mut self) {
        if let Some(e) = self.pending.take() {
            lock(&self.shared).errors.insert(self.index, e);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        lock(&self.shared).in_flight.remove(&self.index);
    }
}

/// `y − dequant(q)` in place in `y`, element by element with the scale and zero point
/// `params(i)` of element `i`: the quantisation error of this rank's own values.
fn residual(y: &mut [f32], q: &[u8], params: impl Fn(usize) -> (f32, f32)) {
    for (i, (y, &q)) in y.iter_mut().zip(q).enumerate() {
        let (s, z) = params(i);
        *y -= dequantize(q, s, z);
    }
}

/// `save_state` of a quantisation hook named `name`: [`HookState::Stateless`] without
/// error feedback, else its memories. A step in flight is [`Error::Bucket`].
fn save_quantize(name: String, memories: Option<&Shared>) -> Result<HookState> {
    let Some(shared) = memories else {
        return Ok(HookState::Stateless { hook: name });
    };
    let m = lock(shared);
    if let Some(&index) = m.in_flight.first() {
        return Err(in_flight(index));
    }
    Ok(HookState::Quantize {
        hook: name,
        buckets: m.errors.clone(),
    })
}

/// `load_state` of a quantisation hook named `name`: its own stateless state without
/// error feedback; with it, a [`HookState::Quantize`] of the same name (configuration)
/// whose memories are finite and, for every bucket the hook holds a memory of, of that
/// memory's length. Anything else is [`Error::State`], a step in flight
/// [`Error::Bucket`]; either leaves the hook unchanged.
fn load_quantize(name: &str, memories: Option<&Shared>, state: HookState) -> Result<()> {
    let Some(shared) = memories else {
        return load_stateless(name, state);
    };
    let buckets = match state {
        HookState::Quantize { hook, buckets } if hook == name => buckets,
        other => {
            return Err(other.mismatch(&format!("the quantisation hook `{name}`")));
        }
    };
    for (&index, e) in &buckets {
        if let Some(i) = e.iter().position(|v| !v.is_finite()) {
            return Err(Error::State(format!(
                "{name}: bucket {index}: error[{i}] = {} is not finite; the state is corrupt",
                e[i]
            )));
        }
    }
    let mut m = lock(shared);
    if let Some(&index) = m.in_flight.first() {
        return Err(in_flight(index));
    }
    for (&index, e) in &buckets {
        if let Some(own) = m.errors.get(&index) {
            if own.len() != e.len() {
                return Err(Error::State(format!(
                    "{name}: bucket {index} holds {} elements here, {} in the state: the buckets differ",
                    own.len(),
                    e.len()
                )));
            }
        }
    }
    m.errors = buckets;
    Ok(())
}

/// Quantises the whole bucket to `u8` with one scale and zero point per rank and averages
/// the dequantised buckets (PyTorch's `quantization_pertensor_hook`,
/// `DDPCommHookType.QUANTIZE_PER_TENSOR`): a quarter of the bytes plus two `f32`s, within
/// `max_r scale_r / 2` of the mean: the exact arithmetic and the differences from PyTorch
/// below. Stateless.
///
/// **The arithmetic is PyTorch's, in its order**, all in `f32`:
///
/// - `lo = min(min x, 0)`, `hi = max(max x, 0)` (the range always contains 0);
/// - `scale = max((hi − lo) / 255, f32::EPSILON)`;
/// - `zp = clamp(−round(lo / scale), 0, 255)` (an integer, sent as `f32`);
/// - `q = clamp(round(x / scale) + zp, 0, 255)` as `u8`, `round` half to even;
/// - `dequant(q) = scale · (q − zp)`;
/// - output `(0 + dequant_0 + dequant_1 + … + dequant_{W−1}) / W`, ranks in order.
///
/// Each rank quantises with its *gathered* own parameters, as PyTorch does
/// (`all_ranks_s_and_z[rank]`), so every rank dequantises exactly what was quantised.
///
/// **Error bound.** Where `x / scale` does not exceed the byte range (always, up to the
/// last-place rounding of `x / scale` at the range's ends), rank `r`'s dequantised value is
/// within `scale_r / 2` (plus the rounding of the `f32` operations) of its `x`, so the
/// output is within `max_r scale_r / 2` of the exact mean, up to that rounding.
///
/// **Differences from PyTorch.**
///
/// - A NaN or an infinity in any rank's bucket (or values so far apart that
///   `hi − lo` overflows to infinity) gives no finite scale. PyTorch's observer raises on
///   the rank holding a NaN (`min nan should be less than max nan`) while the other ranks
///   wait in the all-gather, and with an infinity it returns NaN gradients silently. Here
///   the parameters are gathered first as always, a rank with no finite scale sends NaN,
///   and then **every** rank's work fails with [`Error::Bucket`] naming that rank (the
///   bytes are never gathered): no rank hangs, none gets corrupt values.
/// - Per channel, only the bucket's own `numel` bytes are gathered, not the zero padding
///   of the last row (`C · bucket_size` bytes in PyTorch), which the output drops: the
///   output bits are the same, the padding's bytes are not sent, and a `bucket_size` far
///   above the bucket's length allocates nothing for it. The parameters are PyTorch's
///   `[2, C]` (`C` scales, then `C` zero points), computed over the padded rows.
/// - PyTorch on CUDA divides a tensor by a Python scalar (the `/ 255` of the observer and
///   the final `/ world_size`) as a multiplication by its `f32` reciprocal; on the CPU
///   it divides. These hooks divide (PyTorch's CPU results); on CUDA, PyTorch's can
///   differ in the last place where `1/W` or `1/255` is inexact.
/// - An empty bucket: PyTorch's per-tensor observer then keeps its initial range and
///   returns scale 1, zero point 0; so does this hook (the output is empty). Per channel
///   it is one row of padding (scale `f32::EPSILON`, zero point 0), as in PyTorch.
///
/// **CUDA buckets** are read to host memory ([`lowrank::Backend::download`], which waits
/// for the bucket's stream), quantised, gathered and dequantised on the host, and the
/// result is uploaded as a new device buffer ([`lowrank::Backend::upload`]); the bytes go
/// through the process group as host buffers. A device kernel is future work. CPU buckets
/// are host memory already (one copy in, one out).
///
/// **Compression statistics** ([`CommHook::compression_stats`]) count, per bucket step,
/// `numel` elements before and, after, the bytes sent counted as `f32`-equivalents
/// (`ceil(bytes / 4)`) plus the parameters: `ceil(numel / 4) + 2` per tensor,
/// `ceil(numel / 4) + 2·C` per channel (`C = numel / bucket_size + 1` rows). A step is
/// counted when it is launched.
///
/// **Error feedback** (beyond PyTorch; [`with_error_feedback`](Self::with_error_feedback),
/// spec `quantize_per_tensor+ef`): per bucket index, the hook keeps `e` (`f32`, the
/// bucket's length, zeros at first), quantises `y = x + e` (added element by element)
/// instead of `x`, and sets `e = y − dequant_own(q)`, this rank's own dequantised values
/// before averaging: the quantisation error is carried to the next step, as PowerSGD
/// carries its own, so that over many steps the rounding's bias cancels. A step that
/// fails (a non-finite bucket on any rank, a failed collective) leaves `e` as it was. A
/// bucket whose memory has another length is [`Error::Bucket`] on this rank, before any
/// collective (ranks that loaded the same state fail alike). Without error feedback the
/// hook is stateless and its results are bit for bit those above.
pub struct QuantizePerTensor<B> {
    backend: Arc<B>,
    group: Arc<dyn ProcessGroup>,
    stats: (u64, u64),
    memories: Option<Shared>,
    /// Each bucket's two all-gathers reach the group after the previous bucket's (the
    /// second is issued from a continuation: see `sequence.rs`).
    sequence: Sequencer,
}

impl<B: CommBackend> QuantizePerTensor<B> {
    /// The hook over `group`, without error feedback (PyTorch's).
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>) -> Self {
        QuantizePerTensor {
            backend,
            group,
            stats: (0, 0),
            memories: None,
            sequence: Sequencer::default(),
        }
    }

    /// The hook over `group` with error feedback on or off (see above).
    pub fn with_error_feedback(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        error_feedback: bool,
    ) -> Self {
        QuantizePerTensor {
            memories: error_feedback.then(Shared::default),
            sequence: Sequencer::default(),
            ..Self::new(backend, group)
        }
    }

    /// Whether the hook keeps error feedback.
    pub fn error_feedback(&self) -> bool {
        self.memories.is_some()
    }
}

impl<B: CommBackend> CommHook<B> for QuantizePerTensor<B> {
    /// `quantize_per_tensor`, `quantize_per_tensor+ef` with error feedback.
    fn name(&self) -> String {
        if self.error_feedback() {
            "quantize_per_tensor+ef".into()
        } else {
            "quantize_per_tensor".into()
        }
    }

    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
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
        count(&mut self.stats, n, n.div_ceil(4).saturating_add(2));
        let (scale, zp) = qparams(&x, false);
        let local = first_nonfinite(&x);
        let (backend, group) = (self.backend.clone(), self.group.clone());
        let (rank, world) = (group.rank(), group.size());
        let hook = self.name();
        let first = self.group.clone();
        self.sequence.next(move |issued| {
            first
                .all_gather(Buffer::F32(vec![scale, zp]))
                .and_then(move |params| {
                    let params = match gathered_params(params, 2, index) {
                        Ok(p) => p,
                        Err(e) => return failed(e),
                    };
                    if let Some(r) = params.iter().position(|p| !p.iter().all(|v| v.is_finite())) {
                        let local = if r == rank { local } else { None };
                        return failed(nonfinite(&hook, index, r, None, params[r][0], local));
                    }
                    let (s, z) = (params[rank][0], params[rank][1]);
                    let mut q = match try_vec(n, 0u8) {
                        Ok(q) => q,
                        Err(e) => return failed(e),
                    };
                    for (q, &v) in q.iter_mut().zip(&x) {
                        *q = quantize(v, s, z);
                    }
                    match lease.as_mut() {
                        Some(l) => {
                            let mut x = x;
                            residual(&mut x, &q, |_| (s, z));
                            l.pending = Some(x);
                        }
                        None => drop(x),
                    }
                    let sent = group.all_gather(Buffer::U8(q));
                    // Both of this bucket's collectives are issued: the next bucket may go.
                    issued.complete(Ok(()));
                    sent.then(move |r| {
                        let qs = gathered_bytes(r?, n, index)?;
                        let mut out = try_vec(n, 0.0f32)?;
                        for (q, p) in qs.iter().zip(&params) {
                            let (s, z) = (p[0], p[1]);
                            for (o, &b) in out.iter_mut().zip(q) {
                                *o += dequantize(b, s, z);
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

    /// [`HookState::Stateless`] without error feedback; with it, [`HookState::Quantize`]
    /// holding every bucket's memory. A step in flight is [`Error::Bucket`].
    fn save_state(&self) -> Result<HookState> {
        save_quantize(self.name(), self.memories.as_ref())
    }

    /// The state [`save_state`](CommHook::save_state) gives, of the same configuration
    /// (the same name); with error feedback, memories that are finite and as long as
    /// those the hook holds for the same buckets. Else [`Error::State`], the hook
    /// unchanged.
    fn load_state(&self, state: HookState) -> Result<()> {
        load_quantize(&self.name(), self.memories.as_ref(), state)
    }

    fn compression_stats(&self) -> Option<CompressionStats> {
        Some(stats_of(self.stats))
    }
}

/// `load_state` of a stateless hook named `name`.
fn load_stateless(name: &str, state: HookState) -> Result<()> {
    match state {
        HookState::Stateless { hook } if hook == name => Ok(()),
        other => Err(other.mismatch(&format!("the stateless hook `{name}`"))),
    }
}

/// Quantises the bucket to `u8` in rows of `bucket_size` elements, each with its own
/// scale and zero point, and averages the dequantised buckets (PyTorch's
/// `quantization_perchannel_hook`, `DDPCommHookType.QUANTIZE_PER_CHANNEL`): the bucket
/// zero-padded by `bucket_size − numel % bucket_size` (a whole row when `bucket_size`
/// divides `numel`) into `C = numel / bucket_size + 1` rows. Finer scales than
/// [`QuantizePerTensor`] for `2·C` `f32`s more. The arithmetic (per row), the error bound
/// (with each row's scales), the CUDA path, the statistics and the differences from
/// PyTorch are [`QuantizePerTensor`]'s, and so is error feedback
/// ([`with_error_feedback`](Self::with_error_feedback), spec
/// `quantize_per_channel+ef[:bucket_size=N]`), with each element's own row's scale and
/// zero point. Stateless without error feedback.
pub struct QuantizePerChannel<B> {
    backend: Arc<B>,
    group: Arc<dyn ProcessGroup>,
    bucket_size: usize,
    stats: (u64, u64),
    memories: Option<Shared>,
    /// Each bucket's two all-gathers reach the group after the previous bucket's (the
    /// second is issued from a continuation: see `sequence.rs`).
    sequence: Sequencer,
}

impl<B: CommBackend> QuantizePerChannel<B> {
    /// PyTorch's default row length.
    pub const DEFAULT_BUCKET_SIZE: usize = DEFAULT_BUCKET_SIZE;

    /// The hook over `group`, in rows of `bucket_size` elements
    /// ([`DEFAULT_BUCKET_SIZE`](Self::DEFAULT_BUCKET_SIZE) in PyTorch). A `bucket_size`
    /// of 0 is [`Error::Config`].
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>, bucket_size: usize) -> Result<Self> {
        if bucket_size == 0 {
            return Err(Error::Config(
                "quantize_per_channel: bucket_size = 0; a row holds at least 1 element".into(),
            ));
        }
        Ok(QuantizePerChannel {
            backend,
            group,
            bucket_size,
            stats: (0, 0),
            memories: None,
            sequence: Sequencer::default(),
        })
    }

    /// The hook of [`new`](Self::new) with error feedback on or off (see
    /// [`QuantizePerTensor`]).
    pub fn with_error_feedback(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        bucket_size: usize,
        error_feedback: bool,
    ) -> Result<Self> {
        Ok(QuantizePerChannel {
            memories: error_feedback.then(Shared::default),
            sequence: Sequencer::default(),
            ..Self::new(backend, group, bucket_size)?
        })
    }

    /// Whether the hook keeps error feedback.
    pub fn error_feedback(&self) -> bool {
        self.memories.is_some()
    }

    /// The row length.
    pub fn bucket_size(&self) -> usize {
        self.bucket_size
    }
}

impl<B: CommBackend> CommHook<B> for QuantizePerChannel<B> {
    /// `quantize_per_channel` (`quantize_per_channel+ef` with error feedback), with
    /// `:bucket_size=N` unless it is the default 512.
    fn name(&self) -> String {
        let ef = if self.error_feedback() { "+ef" } else { "" };
        if self.bucket_size == Self::DEFAULT_BUCKET_SIZE {
            format!("quantize_per_channel{ef}")
        } else {
            format!("quantize_per_channel{ef}:bucket_size={}", self.bucket_size)
        }
    }

    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
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
        let (n, bs) = (x.len(), self.bucket_size);
        // Rows: `numel / bs` full ones and a last one that holds padding (at least 1).
        let rows = n / bs + 1;
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
            let (s, z) = qparams(row, row.len() < bs);
            if !s.is_finite() && local.is_none() {
                local = first_nonfinite(row).map(|(i, v)| (c, (start + i, v)));
            }
            (params[c], params[rows + c]) = (s, z);
        }
        let (backend, group) = (self.backend.clone(), self.group.clone());
        let (rank, world) = (group.rank(), group.size());
        let hook = self.name();
        let first = self.group.clone();
        self.sequence.next(move |issued| {
            first
                .all_gather(Buffer::F32(params))
                .and_then(move |params| {
                    let params = match gathered_params(params, 2 * rows, index) {
                        Ok(p) => p,
                        Err(e) => return failed(e),
                    };
                    for (r, p) in params.iter().enumerate() {
                        if let Some(c) =
                            (0..rows).find(|&c| !p[c].is_finite() || !p[rows + c].is_finite())
                        {
                            let here = local.filter(|_| r == rank).map(|(_, l)| l);
                            let row = local.filter(|_| r == rank).map_or(c, |(c, _)| c);
                            return failed(nonfinite(&hook, index, r, Some(row), p[row], here));
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
                        let qs = gathered_bytes(r?, n, index)?;
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

    /// [`HookState::Stateless`] without error feedback; with it, [`HookState::Quantize`]
    /// holding every bucket's memory. A step in flight is [`Error::Bucket`].
    fn save_state(&self) -> Result<HookState> {
        save_quantize(self.name(), self.memories.as_ref())
    }

    /// The state [`save_state`](CommHook::save_state) gives, of the same configuration
    /// (the same name); with error feedback, memories that are finite and as long as
    /// those the hook holds for the same buckets. Else [`Error::State`], the hook
    /// unchanged.
    fn load_state(&self, state: HookState) -> Result<()> {
        load_quantize(&self.name(), self.memories.as_ref(), state)
    }

    fn compression_stats(&self) -> Option<CompressionStats> {
        Some(stats_of(self.stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameters of simple ranges, against the formulas by hand.
    #[test]
    fn quantize_equals_round_ties_even_everywhere() {
        // PyTorch's formula, with the libm rounding.
        let plain = |x: f32, s: f32, z: f32| ((x / s).round_ties_even() + z).clamp(0.0, QMAX) as u8;
        let mut xs: Vec<f32> = (-2000..2000).map(|k| k as f32 * 0.25).collect();
        xs.extend([
            1e30,
            -1e30,
            4_194_304.5,
            -4_194_304.5,
            8_388_609.0,
            0.5,
            1.5,
            2.5,
            -0.5,
            -2.5,
        ]);
        xs.extend((0..10_000).map(|k| ((k * 7919) % 100_003) as f32 / 37.0 - 1350.0));
        for &s in &[1.0f32, 0.5, 3.0, f32::EPSILON, 1e-3, 1e6] {
            for &z in &[0.0f32, 17.0, 128.0, 255.0] {
                for &x in &xs {
                    assert_eq!(
                        quantize(x, s, z),
                        plain(x, s, z),
                        "x {x}, scale {s}, zp {z}"
                    );
                }
            }
        }
    }

    #[test]
    fn qparams_of_simple_ranges() {
        let ramp: Vec<f32> = (0..=255).map(|v| v as f32).collect();
        assert_eq!(qparams(&ramp, false), (1.0, 0.0));
        assert_eq!(qparams(&[-255.0, -1.0], false), (1.0, 255.0));
        assert_eq!(qparams(&[3.0; 4], false), (3.0 / 255.0, 0.0));
        assert_eq!(qparams(&[0.0; 4], false), (f32::EPSILON, 0.0));
        assert_eq!(qparams(&[], false), (1.0, 0.0));
        assert_eq!(qparams(&[], true), (f32::EPSILON, 0.0));
        assert!(qparams(&[1.0, f32::NAN], false).0.is_nan());
        assert!(qparams(&[f32::INFINITY], false).0.is_nan());
        assert!(qparams(&[f32::MAX, -f32::MAX], false).0.is_infinite());
        // The zero point is +0, never -0 (PyTorch's goes through an integer).
        assert!(qparams(&[1.0], false).1.is_sign_positive());
    }

    /// Ties round to even; values past the range clamp.
    #[test]
    fn quantize_rounds_half_to_even_and_clamps() {
        assert_eq!(quantize(0.5, 1.0, 0.0), 0);
        assert_eq!(quantize(1.5, 1.0, 0.0), 2);
        assert_eq!(quantize(2.5, 1.0, 0.0), 2);
        assert_eq!(quantize(-1.0, 1.0, 0.0), 0);
        assert_eq!(quantize(300.0, 1.0, 0.0), 255);
        assert_eq!(dequantize(3, 0.5, 1.0), 1.0);
    }
}
