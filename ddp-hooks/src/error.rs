//! The crate's one error type.

/// Everything that can go wrong in a hook, its state or the reducer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An invalid hyperparameter, named with its value.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A bucket whose layout does not fit its buffer, or changed while the hook holds
    /// state for it.
    #[error("bucket {index}: {why}")]
    Bucket {
        /// The bucket's index.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// A hook name or option that the registry does not know.
    #[error("unknown hook spec `{spec}`: {why}")]
    Spec {
        /// The string that was parsed: its first 100 characters, then `…` if it is longer.
        spec: String,
        /// What is wrong with it.
        why: String,
    },
    /// A saved state that does not fit the hook it is loaded into.
    #[error("cannot load state: {0}")]
    State(String),
    /// A PowerSGD state holding a NaN or an infinity, refused by `save` and `load`: such
    /// a state is corrupt, and error feedback would carry the value into every later step.
    #[error("PowerSGD state of bucket {bucket}: {buffer}[{index}] = {value} is not finite; the state is corrupt")]
    NonFinite {
        /// The bucket's index.
        bucket: usize,
        /// Which memory: `"error"`, `"p"` or `"q"`.
        buffer: &'static str,
        /// The element's position in that memory.
        index: usize,
        /// The value.
        value: f32,
    },
    /// A parameter shape, or a bucket of them, whose element count does not fit in
    /// `usize`, or whose `f32` buffer would exceed `isize::MAX` bytes.
    #[error("{0}: too many elements for one buffer")]
    Overflow(String),
    /// A buffer that could not be allocated (the allocator refused it).
    #[error("cannot allocate {elements} elements of {element_bytes} bytes each: out of memory")]
    Alloc {
        /// Elements requested.
        elements: usize,
        /// Bytes per element.
        element_bytes: usize,
    },
    /// Synchronisation was switched on or off (`accum::GradSync::set_sync`) between a
    /// step's first `mark_ready` and its `finish`. The step keeps the setting it began
    /// with, so every rank issues the same collectives; the new setting applies from the
    /// next step, and that step's `finish` returns this error.
    #[error(
        "synchronisation was switched {} in the middle of a step (after {marked} of {params} parameters were marked ready); {}; the new setting applies from the next step",
        if *on { "on" } else { "off" },
        if *on {
            "the step stayed unsynchronised: its gradients were accumulated locally, not reduced".to_string()
        } else {
            format!("the step stayed synchronised: {launched} of {buckets} buckets were reduced and waited for")
        }
    )]
    SyncChanged {
        /// The new setting (`true`: switched on during an unsynchronised step).
        on: bool,
        /// Parameters marked ready in the step when the setting was first switched.
        marked: usize,
        /// Parameters in all.
        params: usize,
        /// Buckets whose hook was launched (and waited for) in the step.
        launched: usize,
        /// Buckets in all.
        buckets: usize,
    },
    /// An error of the communication layer.
    #[error(transparent)]
    Comm(#[from] collectives::Error),
    /// An error of the kernel layer.
    #[error("lowrank: {0}")]
    Kernel(String),
    /// Parameters neither marked ready nor declared unused before `finish()` in a
    /// synchronised step, with `ReducerConfig::find_unused_parameters` off (DDP's
    /// "Expected to have finished reduction in the prior iteration"). The step was still
    /// reduced, these parameters counting as unused on this rank, so no rank was left
    /// waiting for this one's buckets.
    #[error(
        "{} of {total} parameters were not marked ready before finish() in a synchronised step{}: {}. This indicates that your model has parameters that were not used in producing the loss. You can enable unused parameter detection with `ReducerConfig::find_unused_parameters = true` (DDP's `find_unused_parameters=True`) or declare them with `Reducer::mark_unused`, and by making sure all `forward` function outputs participate in calculating loss. The step was still reduced, with these parameters as unused (zero) on this rank, so no rank was left waiting",
        params.len(),
        rank.map(|r| format!(" on rank {r}")).unwrap_or_default(),
        index_ranges(params)
    )]
    UnmarkedParameters {
        /// Every unmarked parameter (index in forward order), ascending.
        params: Vec<usize>,
        /// Parameters in all.
        total: usize,
        /// This rank, where the reducer knows its process group.
        rank: Option<usize>,
    },
}

/// Ascending indices with runs collapsed (`0, 3..=7, 9`): every index is named, in
/// little space.
fn index_ranges(indices: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < indices.len() {
        let start = indices[i];
        let mut end = start;
        while i + 1 < indices.len() && indices[i + 1] == end.wrapping_add(1) {
            i += 1;
            end = indices[i];
        }
        parts.push(if end == start {
            start.to_string()
        } else {
            format!("{start}..={end}")
        });
        i += 1;
    }
    parts.join(", ")
}

impl From<lowrank::Error> for Error {
    fn from(e: lowrank::Error) -> Self {
        Error::Kernel(e.to_string())
    }
}

impl From<Error> for collectives::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Comm(c) => c,
            other => collectives::Error::Backend(other.to_string()),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
