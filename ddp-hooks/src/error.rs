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
