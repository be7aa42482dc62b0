//! 8-bit quantisation hooks (PyTorch's experimental `quantization_pertensor_hook` and
//! `quantization_perchannel_hook`): each rank quantises its bucket to `u8` with its own
//! MinMax-observer parameters, every rank all-gathers every rank's parameters and bytes,
//! and each rank dequantises all of them and averages them in `f32`.
//!
//! The arithmetic, the error bound and the differences from PyTorch are documented on
//! [`QuantizePerTensor`].

/// The [`CommHook`](crate::CommHook) methods both hooks delegate to their `core`
/// ([`step::Core`]): `save_state`, `load_state` and `compression_stats`.
macro_rules! state_methods {
    () => {
        /// [`HookState::Stateless`] without error feedback; with it, [`HookState::Quantize`]
        /// holding every bucket's memory. A step in flight is [`Error::Bucket`].
        fn save_state(&self) -> Result<HookState> {
            self.core.save_state(self.name())
        }

        /// The state [`save_state`](CommHook::save_state) gives, of the same configuration
        /// (the same name); with error feedback, memories that are finite and as long as
        /// those the hook holds for the same buckets. Else [`Error::State`], the hook
        /// unchanged.
        fn load_state(&self, state: HookState) -> Result<()> {
            self.core.load_state(&self.name(), state)
        }

        fn compression_stats(&self) -> Option<CompressionStats> {
            Some(self.core.compression_stats())
        }
    };
}

mod arith;
mod memory;
mod per_channel;
mod per_tensor;
mod step;

pub use per_channel::QuantizePerChannel;
pub use per_tensor::QuantizePerTensor;

/// PyTorch's default row length of the per-channel hook.
pub(crate) const DEFAULT_BUCKET_SIZE: usize = 512;
