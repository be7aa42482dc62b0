//! [`QuantizePerChannel`]: a scale and zero point per row of the bucket.

use super::step::{Core, Layout};
#[cfg(doc)]
use super::QuantizePerTensor;
use super::DEFAULT_BUCKET_SIZE;
use crate::{CommBackend, CommHook, CompressionStats, Error, GradBucket, HookState, Result};
use collectives::{ProcessGroup, Work};
use std::sync::Arc;

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
    core: Core<B>,
    bucket_size: usize,
}

impl<B: CommBackend> QuantizePerChannel<B> {
    /// PyTorch's default row length.
    pub const DEFAULT_BUCKET_SIZE: usize = DEFAULT_BUCKET_SIZE;

    /// The hook over `group`, in rows of `bucket_size` elements
    /// ([`DEFAULT_BUCKET_SIZE`](Self::DEFAULT_BUCKET_SIZE) in PyTorch). A `bucket_size`
    /// of 0 is [`Error::Config`].
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>, bucket_size: usize) -> Result<Self> {
        Self::with_error_feedback(backend, group, bucket_size, false)
    }

    /// The hook of [`new`](Self::new) with error feedback on or off (see
    /// [`QuantizePerTensor`]).
    pub fn with_error_feedback(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        bucket_size: usize,
        error_feedback: bool,
    ) -> Result<Self> {
        if bucket_size == 0 {
            return Err(Error::Config(
                "quantize_per_channel: bucket_size = 0; a row holds at least 1 element".into(),
            ));
        }
        Ok(QuantizePerChannel {
            core: Core::new(backend, group, error_feedback),
            bucket_size,
        })
    }

    /// Whether the hook keeps error feedback.
    pub fn error_feedback(&self) -> bool {
        self.core.error_feedback()
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
        let hook = self.name();
        self.core
            .run(bucket, Layout::PerChannel(self.bucket_size), hook)
    }

    state_methods!();
}
