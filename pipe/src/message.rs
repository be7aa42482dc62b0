//! [`Msg`]: what one worker sends another (in one process over a channel, to another
//! rank as a frame). Imports only the batch type.

use crate::microbatch::Batch;

/// A message between workers.
pub(crate) enum Msg<T> {
    /// A stage's input for a micro-batch, from the previous stage.
    Activation {
        stage: usize,
        mb: usize,
        batch: Batch<T>,
    },
    /// A stage's output gradient for a micro-batch, from the next stage.
    Gradient {
        stage: usize,
        mb: usize,
        batch: Batch<T>,
    },
    /// A skip value (or the stash of nothing) for micro-batch `mb`, straight from the
    /// stashing stage to the popping `stage`, along `skips.routes[route]`.
    Skip {
        stage: usize,
        mb: usize,
        route: usize,
        value: Option<T>,
    },
    /// A skip's gradient (or none), back from the popping stage to the stashing `stage`.
    SkipGrad {
        stage: usize,
        mb: usize,
        route: usize,
        grad: Option<T>,
    },
    /// Stop: another worker failed.
    Abort,
}
