//! [`QuantizePerTensor`]: one scale and zero point per rank.

use super::step::{Core, Layout};
#[cfg(doc)]
use crate::Error;
use crate::{CommBackend, CommHook, CompressionStats, GradBucket, HookState, Result};
use collectives::{ProcessGroup, Work};
use std::sync::Arc;

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
    core: Core<B>,
}

impl<B: CommBackend> QuantizePerTensor<B> {
    /// The hook over `group`, without error feedback (PyTorch's).
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>) -> Self {
        Self::with_error_feedback(backend, group, false)
    }

    /// The hook over `group` with error feedback on or off (see above).
    pub fn with_error_feedback(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        error_feedback: bool,
    ) -> Self {
        QuantizePerTensor {
            core: Core::new(backend, group, error_feedback),
        }
    }

    /// Whether the hook keeps error feedback.
    pub fn error_feedback(&self) -> bool {
        self.core.error_feedback()
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
        let hook = self.name();
        self.core.run(bucket, Layout::PerTensor, hook)
    }

    state_methods!();
}
