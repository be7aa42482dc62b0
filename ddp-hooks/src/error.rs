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
        /// The string that was parsed.
        spec: String,
        /// What is wrong with it.
        why: String,
    },
    /// A saved state that does not fit the hook it is loaded into.
    #[error("cannot load state: {0}")]
    State(String),
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
