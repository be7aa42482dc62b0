//! [`Memory`]: the bytes a partition holds between its forward and backward passes.

/// Bytes a partition holds between forward and backward passes: saved states, the inputs
/// of checkpointed micro-batches, and skip values and gradients waiting in its trackers.
/// Counted through [`Tensor::size_bytes`](crate::Tensor::size_bytes) at action boundaries and
/// when a skip arrives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// Held now (skips included).
    pub held: usize,
    /// The most held at once since the pending forward began (or the last step began).
    pub peak: usize,
    /// Of `held`, the bytes of skip values and gradients in the partition's trackers:
    /// a value waits there from its arrival until it is popped (under checkpointing, until
    /// the recomputation pops it again), a gradient until it is sent back or taken.
    pub skips: usize,
    /// Of `held`, the bytes the partition's layers keep for deferred weight gradients
    /// ([`Layer::deferred_bytes`](crate::Layer::deferred_bytes)) from a backward action until
    /// the partition's last one of the run ([`PipeBuilder::defer_weight_grads`](crate::PipeBuilder::defer_weight_grads)).
    pub deferred: usize,
}

impl Memory {
    /// Adjusts the skip bytes from `old` to `new`, and the totals with them.
    pub(crate) fn set_skips(&mut self, old: usize, new: usize) {
        self.held = (self.held + new).saturating_sub(old);
        self.skips = (self.skips + new).saturating_sub(old);
        self.peak = self.peak.max(self.held);
    }

    /// Adjusts the deferred bytes to `now`, and the totals with them.
    pub(crate) fn set_deferred(&mut self, now: usize) {
        self.held = (self.held + now).saturating_sub(self.deferred);
        self.deferred = now;
        self.peak = self.peak.max(self.held);
    }
}
