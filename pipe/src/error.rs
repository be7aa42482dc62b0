//! The crate's one error type, and [`Site`]: where in a run a failure happened.

use std::fmt;
use std::time::Duration;

use crate::vocab::{Action, Device, Phase, Task};

/// An error from outside this crate, such as a user layer's own failure type.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Where a run failed: the partition, the layer (when a layer failed), the micro-batch and
/// the task. Displayed as `partition 1, layer 3 (Linear), micro-batch 3, forward`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// The partition (stage) index.
    pub partition: usize,
    /// The layer's global index (its position in the sequence the pipe was built from) and
    /// its [`name`](crate::Layer::name); `None` for the loss and the callbacks.
    pub layer: Option<(usize, String)>,
    /// The micro-batch index; `None` for a callback that covers all micro-batches.
    pub micro_batch: Option<usize>,
    /// What was running.
    pub task: Task,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "partition {}", self.partition)?;
        if let Some((index, name)) = &self.layer {
            write!(f, ", layer {index} ({name})")?;
        }
        if let Some(i) = self.micro_batch {
            write!(f, ", micro-batch {i}")?;
        }
        write!(f, ", {}", self.task)
    }
}

/// Everything that can go wrong building or running a [`Pipe`](crate::Pipe), a
/// [`Schedule`](crate::Schedule), a tensor operation or a layer.
///
/// Construction errors carry torchgpipe's messages (with the bad value appended); run
/// errors name the [`Site`] of the failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The balance does not add up to the number of layers.
    #[error(
        "layers and sum of balance have different length (layers: {layers}, sum of balance: {sum})"
    )]
    BalanceLength {
        /// The number of layers.
        layers: usize,
        /// The sum of the balance.
        sum: usize,
    },
    /// A partition of the balance is empty.
    #[error("all balance numbers must be positive integer (balance: {balance:?})")]
    BalanceNotPositive {
        /// The balance as given.
        balance: Vec<usize>,
    },
    /// Fewer devices than partitions.
    #[error(
        "too few devices to hold given partitions (devices: {devices}, partitions: {partitions})"
    )]
    TooFewDevices {
        /// The number of devices given.
        devices: usize,
        /// The number of partitions.
        partitions: usize,
    },
    /// `chunks` was 0.
    #[error("number of chunks must be positive integer (got {0})")]
    Chunks(usize),
    /// A checkpoint mode string that is none of the three.
    #[error("checkpoint is not one of 'always', 'except_last', or 'never' (got {0:?})")]
    CheckpointMode(String),
    /// A schedule that cannot be made: a name that is none of the generators, a
    /// generator's constraint (the message says which), a malformed schedule CSV cell.
    #[error("schedule: {0}")]
    ScheduleName(String),
    /// The timeout between workers must be positive.
    #[error("the timeout between workers must be positive")]
    ZeroTimeout,
    /// A dropout probability outside `[0, 1)`.
    #[error("dropout probability must be in [0, 1) (got {0})")]
    Probability(f32),

    /// A schedule for no stage or no micro-batch.
    #[error("a schedule needs at least one stage and one micro-batch (stages: {stages}, micro-batches: {micro_batches})")]
    ScheduleEmpty {
        /// Stages asked for.
        stages: usize,
        /// Micro-batches asked for.
        micro_batches: usize,
    },
    /// An action names a stage or micro-batch the schedule does not have.
    #[error("{action} is out of range (stages: {stages}, micro-batches: {micro_batches})")]
    ActionOutOfRange {
        /// The action.
        action: Action,
        /// The schedule's stages.
        stages: usize,
        /// The schedule's micro-batches.
        micro_batches: usize,
    },
    /// A stage's actions are spread over two workers; a stage's layers live on one.
    #[error(
        "stage {stage} has actions on workers {first} and {second}; a stage lives on one worker"
    )]
    StageSplit {
        /// The stage.
        stage: usize,
        /// One worker.
        first: usize,
        /// Another worker.
        second: usize,
    },
    /// An action listed twice.
    #[error("the schedule lists {action} twice")]
    DuplicateAction {
        /// The action.
        action: Action,
    },
    /// An action the schedule must contain but does not.
    #[error("the schedule is missing {action}")]
    MissingAction {
        /// The missing action.
        action: Action,
    },
    /// A backward action listed before the forward action it needs.
    #[error("worker {worker} runs {action} before its forward")]
    BackwardBeforeForward {
        /// The worker.
        worker: usize,
        /// The backward action.
        action: Action,
    },
    /// The workers' lists wait on each other in a cycle: the schedule would hang.
    #[error("the schedule cannot run: these actions wait on each other: {}\n{grid}", list_actions(.waiting))]
    Deadlock {
        /// Each stuck worker with the action at the head of its list.
        waiting: Vec<(usize, Action)>,
        /// Each worker's list around the stuck action (marked `>...<`), in PyTorch's
        /// action notation (`1F3`: stage 1's forward of micro-batch 3).
        grid: String,
    },
    /// A schedule whose shape does not fit the run.
    #[error("the schedule is for {schedule_stages} stages and {schedule_micro_batches} micro-batches, the run has {stages} and {micro_batches} (and needs forward and backward actions)")]
    ScheduleMismatch {
        /// Stages in the schedule.
        schedule_stages: usize,
        /// Micro-batches in the schedule.
        schedule_micro_batches: usize,
        /// Stages of the pipe.
        stages: usize,
        /// Micro-batches of the run.
        micro_batches: usize,
    },

    /// A batch with nothing to split along the batch dimension.
    #[error("inputs do not have any tensors to split along the batch dimension")]
    NoTensor,
    /// A batch of zero samples. torchgpipe would run `chunks` empty micro-batches
    /// through every partition (`torch.chunk` of an empty dimension); here an empty batch
    /// is a mistake reported before any work, as layers need not accept empty inputs.
    #[error("a batch of zero samples cannot be split into micro-batches")]
    EmptyBatch,
    /// Chunked tensors of different lengths along the batch dimension.
    #[error("chunked tensors have different batch lengths ({first} and {second})")]
    BatchLengthMismatch {
        /// The first tensor's length.
        first: usize,
        /// A later tensor's length.
        second: usize,
    },
    /// Micro-batch outputs whose items differ in kind or number.
    #[error(
        "types of micro-batch outputs do not match at position {position}: {first} and {second}"
    )]
    OutputMismatch {
        /// The tuple position.
        position: usize,
        /// The kind in the first micro-batch.
        first: &'static str,
        /// The kind in a later micro-batch.
        second: &'static str,
    },
    /// A batch with the wrong number of items.
    #[error("expected {expected} item(s), got {got}")]
    Arity {
        /// Items expected.
        expected: usize,
        /// Items given.
        got: usize,
    },
    /// A tuple item that is not the kind needed.
    #[error("item {position} is {got}, expected a chunked tensor")]
    NotATensor {
        /// The tuple position.
        position: usize,
        /// What it is.
        got: &'static str,
    },
    /// A tensor whose shape does not fit an operation.
    #[error("{op}: shape {got:?} does not fit {expected:?}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// The shape needed (a 0 stands for any length).
        expected: Vec<usize>,
        /// The shape given.
        got: Vec<usize>,
    },
    /// A shape whose element count (the product of its dimensions) does not fit in
    /// `usize`: no tensor or buffer of it can exist.
    #[error("{op}: shape {shape:?} has more elements than fit in usize")]
    ShapeOverflow {
        /// The operation.
        op: &'static str,
        /// The shape (for a buffer an operation computes, the factors of its length).
        shape: Vec<usize>,
    },
    /// A tensor or buffer that cannot be allocated: `elements` of `element_bytes` bytes
    /// each exceed `isize::MAX` bytes (no allocation can hold them), or the allocator
    /// refused them (out of memory, or an address-space limit).
    #[error(
        "{op}: cannot allocate {elements} elements of {element_bytes} bytes each: {}",
        alloc_reason(*.elements, *.element_bytes)
    )]
    Alloc {
        /// The operation.
        op: &'static str,
        /// Elements requested.
        elements: usize,
        /// Bytes per element.
        element_bytes: usize,
    },
    /// Split sizes that do not add up to the batch length.
    #[error("split sizes {sizes:?} do not add up to the batch length {len}")]
    SplitSizes {
        /// The sizes.
        sizes: Vec<usize>,
        /// The batch length.
        len: usize,
    },
    /// Concatenating nothing.
    #[error("nothing to concatenate")]
    NothingToConcat,
    /// A frame from another rank that does not parse (a bug, or ranks running different
    /// versions of this crate).
    #[error("a malformed frame between ranks: {0}")]
    Frame(String),
    /// The transport between this rank and `peer` failed: the peer is gone, or a wait for
    /// it passed the pipe's timeout.
    #[error("rank {rank}: the transport to rank {peer} failed: {source}")]
    Transport {
        /// This rank.
        rank: usize,
        /// The other rank.
        peer: usize,
        /// What the transport said.
        #[source]
        source: crate::transport::TransportError,
    },
    /// Another rank of the pipe failed: its error, where it happened (the stage, the layer
    /// and the micro-batch, for a failure inside a run), as that rank reported it.
    #[error("rank {rank} failed{}: {message}", at_site(.site))]
    Remote {
        /// The rank that failed first.
        rank: usize,
        /// Where, if inside a layer, the loss or a callback.
        site: Option<Site>,
        /// Its error, printed.
        message: String,
    },
    /// The ranks of a pipe disagree: different settings when built, or different runs
    /// (one calls `step` while another calls `forward`, or their step numbers differ).
    #[error("rank {rank} disagrees with rank {other}: {why}")]
    RankMismatch {
        /// This rank.
        rank: usize,
        /// The rank it disagrees with.
        other: usize,
        /// What differs.
        why: String,
    },
    /// A placement of stages on ranks that cannot work: a rank out of range, a worker's
    /// stages on different ranks, this rank's layers not adding up to its partitions.
    #[error("stages on ranks: {0}")]
    Placement(String),
    /// A tensor arrived from another rank with an element type this tensor type does
    /// not read (the ranks run different tensor types).
    #[error("{tensor} cannot read elements of wire type {dtype}")]
    WireType {
        /// The tensor type.
        tensor: &'static str,
        /// The wire type code that arrived.
        dtype: u8,
    },
    /// A tensor type that cannot live on a device.
    #[error("{tensor} cannot move to {device}")]
    Device {
        /// The tensor type.
        tensor: &'static str,
        /// The device.
        device: Device,
    },
    /// No CUDA device can be used here (feature `cuda`): the driver, cuBLAS or NVRTC
    /// library did not load, the driver found no device, or the ordinal is not one. Tests
    /// take this as "skip".
    #[error("CUDA is unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver, cuBLAS or NVRTC call failed (feature `cuda`); the message names the
    /// call and the status.
    #[error("CUDA: {0}")]
    Cuda(String),

    /// A layer, the loss or a callback returned an error during a run.
    #[error("{site}: {source}")]
    Failed {
        /// Where.
        site: Site,
        /// The error it returned.
        #[source]
        source: Box<Error>,
    },
    /// A layer, the loss or a callback panicked during a run. The pipe is poisoned.
    #[error("{site}: panicked: {message}")]
    Panicked {
        /// Where.
        site: Site,
        /// The panic message.
        message: String,
    },
    /// A schedule that cannot place the pipe's stages: `why` says what does not fit.
    #[error("schedule {schedule}: {why}")]
    ScheduleShape {
        /// The schedule.
        schedule: String,
        /// What does not fit.
        why: String,
    },
    /// A stage's weight-gradient actions (`W`) must complete its input-gradient actions
    /// (`I`) in the order they ran: each takes the oldest `I`'s kept state.
    #[error("worker {worker}: {action} comes where the weight gradient of micro-batch {} is due (a stage's W actions follow the order of its I actions)", expected.map_or("none".to_string(), |m| m.to_string()))]
    WeightGradOrder {
        /// The worker.
        worker: usize,
        /// The weight-gradient action out of order.
        action: Action,
        /// The micro-batch whose W was due, if any.
        expected: Option<usize>,
    },
    /// A worker waited longer than the pipe's timeout for another worker.
    #[error(
        "partition {partition} waited {timeout:?} (the pipe's timeout) for the input of {action}"
    )]
    Timeout {
        /// The waiting partition.
        partition: usize,
        /// The action whose input never came.
        action: Action,
        /// The timeout.
        timeout: Duration,
    },
    /// A worker thread panicked outside any layer: a bug in this crate.
    #[error("worker {worker} panicked outside any layer: {message}")]
    WorkerPanicked {
        /// The worker.
        worker: usize,
        /// The panic message.
        message: String,
    },
    /// A worker thread could not be started.
    #[error("could not start worker {worker}: {source}")]
    Spawn {
        /// The worker.
        worker: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A worker thread could not be pinned to its core.
    #[error("could not pin a worker to cpu core {core}: {source}")]
    Pin {
        /// The core.
        core: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The pipe is poisoned: an earlier run panicked inside a layer, which may have left
    /// that layer half-updated.
    #[error("the pipe is poisoned by a panic{}; its layers may be inconsistent (Pipe::clear_poison to use it anyway)", at_site(.site))]
    Poisoned {
        /// Where the panic happened, if it was inside a layer, the loss or a callback.
        site: Option<Site>,
    },
    /// `backward` without a pending training `forward`.
    #[error("backward needs a pending training forward (none since the last backward, or the pipe is in eval mode)")]
    NoPendingForward,
    /// An output gradient whose batch length differs from the pending forward's.
    #[error("the output gradient has {got} samples, the pending forward produced {expected}")]
    GradientLength {
        /// Samples in the pending forward.
        expected: usize,
        /// Samples in the gradient.
        got: usize,
    },
    /// `step` in eval mode.
    #[error("step trains: call Pipe::train first, or Pipe::forward to evaluate")]
    NotTraining,
    /// A user layer's own error (see [`Error::custom`]).
    #[error(transparent)]
    Custom(BoxError),

    /// Skip connections: the declarations do not pair up (when the pipe is built, with
    /// every problem at once), or a layer broke its declaration at run time (a stash or
    /// pop of an undeclared name, a declared name not stashed or popped).
    #[error(transparent)]
    Skip(#[from] skip::Error),
    /// A layer asked its context for skips, but no tracker is attached: it declares no
    /// skip ([`Layer::skips`](crate::Layer::skips)), or it runs outside a pipe without
    /// [`Context::attach_skips`](crate::Context::attach_skips).
    #[error("layer {layer} asked for its skips, but no skip tracker is attached (does it declare them in Layer::skips?)")]
    NoSkipTracker {
        /// The layer's global index.
        layer: usize,
    },
    /// The attached skip tracker carries another tensor type than the layer asked for.
    #[error("layer {layer} asked for skips of another tensor type than its tracker carries")]
    SkipType {
        /// The layer's global index.
        layer: usize,
    },
    /// Stash and pop belong to forward passes, skip gradients to backward passes.
    #[error("layer {layer} asked for the skip handle of the other pass in its {phase:?} phase (Context::skips in forward, Context::skip_grads in backward)")]
    SkipPhase {
        /// The layer's global index.
        layer: usize,
        /// The phase it was in.
        phase: Phase,
    },
    /// A micro-batch's skip tracker still held values or gradients after its backward pass
    /// on a partition: a layer popped without handing in a gradient it had, or did not
    /// finish its skip handles.
    #[error("partition {partition}, micro-batch {micro_batch}: {held} skip value(s) or gradient(s) left behind after the backward pass")]
    SkipsLeftBehind {
        /// The partition.
        partition: usize,
        /// The micro-batch.
        micro_batch: usize,
        /// Values plus gradients still held.
        held: usize,
    },

    /// Block partition into no partitions.
    #[error("partitions must be a positive integer ({partitions} < 1)")]
    Partitions {
        /// The number asked for.
        partitions: usize,
    },
    /// Block partition of a sequence shorter than the number of partitions.
    #[error("sequence is shorter than intended partitions ({len} < {partitions})")]
    SequenceTooShort {
        /// Length of the sequence.
        len: usize,
        /// The number of partitions.
        partitions: usize,
    },
    /// Profiling for a balance needs repetitions.
    #[error("profiling needs at least one repetition")]
    NoRepetitions,
}

impl Error {
    /// Wraps a user layer's own error.
    pub fn custom(error: impl Into<BoxError>) -> Self {
        Error::Custom(error.into())
    }

    /// Where a run failed, for [`Error::Failed`] and [`Error::Panicked`].
    pub fn site(&self) -> Option<&Site> {
        match self {
            Error::Failed { site, .. } | Error::Panicked { site, .. } => Some(site),
            _ => None,
        }
    }

    /// Whether this error poisons the pipe that returned it (a panic inside a layer, the
    /// loss or a callback, or in a worker).
    pub fn poisons(&self) -> bool {
        matches!(self, Error::Panicked { .. } | Error::WorkerPanicked { .. })
    }
}

/// Why `elements` of `element_bytes` bytes could not be allocated, for [`Error::Alloc`].
fn alloc_reason(elements: usize, element_bytes: usize) -> &'static str {
    match elements.checked_mul(element_bytes) {
        Some(bytes) if bytes <= isize::MAX as usize => "out of memory",
        _ => "more than isize::MAX bytes, larger than any allocation",
    }
}

fn at_site(site: &Option<Site>) -> String {
    site.as_ref()
        .map(|s| format!(" at {s}"))
        .unwrap_or_default()
}

fn list_actions(waiting: &[(usize, Action)]) -> String {
    waiting
        .iter()
        .map(|(w, a)| format!("worker {w} at {a}"))
        .collect::<Vec<_>>()
        .join(", ")
}
