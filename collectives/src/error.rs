//! The crate's one error type.

use std::time::Duration;

/// Everything that can go wrong in a collective, a rendezvous or a launch. Every rank
/// of a failed collective gets an error; none hangs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operation did not complete within the group's (or the caller's) timeout.
    #[error("{what} timed out after {after:?}{}", missing_suffix(.missing))]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        after: Duration,
        /// Ranks that did not reach what was waited for (a rendezvous or barrier they never
        /// joined, the end of a collective they never left), where known.
        missing: Vec<usize>,
    },
    /// A peer rank failed (panicked, returned early or dropped its group).
    #[error("rank {rank} is gone ({why}); the group is unusable")]
    PeerLost {
        /// The rank that failed.
        rank: usize,
        /// What happened to it.
        why: String,
    },
    /// Ranks called different collectives, or the same one with different buffers.
    #[error("collective mismatch: {0}")]
    Mismatch(String),
    /// Bad arguments (a rank out of range, an empty group, a bad root ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The operation is not supported by this backend or for this buffer.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A required environment variable is missing.
    #[error("environment variable {0} is not set")]
    MissingEnv(String),
    /// An environment variable has a value that cannot be used.
    #[error("environment variable {name}={value:?} is invalid: {why}")]
    InvalidEnv {
        /// The variable.
        name: String,
        /// Its value.
        value: String,
        /// Why it is invalid.
        why: String,
    },
    /// An I/O error (sockets of the rendezvous store, launched processes).
    #[error("I/O error during {context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error, printed.
        message: String,
    },
    /// The rendezvous store's peer broke the protocol.
    #[error("store protocol error: {0}")]
    Protocol(String),
    /// A backend failure with nothing more specific to say: what a process group outside
    /// this crate (a wrapper, a test's injected failure) reports. This crate's own backends
    /// report the typed variants below ([`Error::Nccl`], [`Error::Mpi`], [`Error::Cuda`],
    /// [`Error::Aborted`], ...).
    #[error("{0}")]
    Backend(String),
    /// An NCCL call failed, or NCCL reported an error on a communicator
    /// (`ncclCommGetAsyncError`).
    #[error("{op} failed: {message}")]
    Nccl {
        /// The call, with what it was doing (`"ncclAllReduce"`, `"all_reduce: async error"`).
        op: String,
        /// NCCL's result code (`ncclResult_t`).
        code: i32,
        /// The code's name, NCCL's text for it and NCCL's last error message.
        message: String,
    },
    /// An MPI call failed.
    #[error("{op} failed: MPI error {code}: {message}")]
    Mpi {
        /// The call (`"MPI_Iallreduce"`, ...).
        op: String,
        /// MPI's error code.
        code: i32,
        /// MPI's text for it (`MPI_Error_string`).
        message: String,
    },
    /// A CUDA driver call failed (a copy, an event, a stream, a context).
    #[error("{op}: CUDA error {message}")]
    Cuda {
        /// What was being done.
        op: String,
        /// The driver's error, printed.
        message: String,
    },
    /// A library the backend needs cannot be used: missing (the CUDA driver, NCCL, with
    /// how to provide it), or too old.
    #[error("{0}")]
    Unavailable(String),
    /// The communicator was aborted (`NcclGroup::abort`): this and every later operation
    /// of the group fails.
    #[error("{}the NCCL communicator{} was aborted (NcclGroup::abort)",
        .op.as_ref().map(|o| format!("{o}: ")).unwrap_or_default(),
        .rank.map(|r| format!(" of rank {r}")).unwrap_or_default())]
    Aborted {
        /// The operation that found the abort, where known.
        op: Option<String>,
        /// The aborted rank, where known.
        rank: Option<usize>,
    },
    /// The communicator is unusable after an earlier failure: MPI cannot cancel a
    /// collective, so later ones would pair with the abandoned one.
    #[error(
        "the MPI communicator is unusable after an earlier failure ({cause}); MPI cannot \
         cancel a collective, so later ones would pair with the abandoned one"
    )]
    Unusable {
        /// The failure that broke it.
        cause: Box<Error>,
    },
    /// The backend's progress thread or communicator is gone (stopped, ended before it
    /// was ready), so the operation could not run.
    #[error("{what}")]
    Gone {
        /// What is gone, and where it was found missing.
        what: String,
    },
    /// A panic inside the backend (a job or continuation on a progress thread, a stage
    /// of an MPI collective, a binding), contained and reported.
    #[error("{what} panicked{}", .message.as_ref().map(|m| format!(": {m}")).unwrap_or_default())]
    Panicked {
        /// What panicked, naming the rank where known.
        what: String,
        /// The panic's message, where known.
        message: Option<String>,
    },
    /// The operation's completer was dropped before completing it (its job was dropped
    /// or panicked).
    #[error("the operation was abandoned before completing")]
    Abandoned,
    /// A broken internal invariant of a backend (a buffer of the wrong type, a lost
    /// stage): a bug, reported rather than a panic.
    #[error("internal: {0}")]
    Internal(String),
    /// The rendezvous store has no room for a request or its value: it would pass the
    /// server's limit on the bytes it holds (`StoreLimits::max_bytes`).
    #[error("the store cannot take {needed} more bytes: it holds {held} of its limit of {limit}")]
    StoreQuota {
        /// The bytes the request needed.
        needed: usize,
        /// The bytes the server held then.
        held: usize,
        /// The server's limit.
        limit: usize,
    },
    /// The rendezvous store refused this client's hello (a missing or wrong token), or
    /// this client, holding a token, refused a store that checks none.
    #[error("store authentication failed: {0}")]
    Unauthorized(String),
    /// The ranks' rendezvous failed on a mistake: a rank claimed by two processes, or
    /// ranks that disagree on the world size. Every rank gets this error.
    #[error("rendezvous failed: {why}")]
    Rendezvous {
        /// What went wrong, naming the ranks and values involved.
        why: String,
        /// The ranks involved.
        ranks: Vec<usize>,
    },
    /// A buffer that cannot be allocated: `elements` of `element_bytes` bytes each exceed
    /// `isize::MAX` bytes (no allocation can hold them), or the allocator refused them
    /// (out of memory, or an address-space limit). A collective that cannot allocate its
    /// output fails on this rank with this error before exchanging anything (its peers
    /// fail at once, as after a rejected argument).
    #[error(
        "cannot allocate a buffer of {elements} elements of {element_bytes} bytes each: {}",
        alloc_reason(*.elements, *.element_bytes)
    )]
    Alloc {
        /// Elements requested.
        elements: usize,
        /// Bytes per element.
        element_bytes: usize,
    },
    /// An error raised above the collectives, in a work's continuation (a communication
    /// hook's own error: a bad bucket, a configuration), kept typed instead of flattened
    /// into a string. It prints as the error it holds; [`HookError::downcast_ref`]
    /// recovers it (for `ddp-hooks`: `ddp_hooks::Error::from_comm`). A collective's own
    /// failure inside a hook stays the collective's variant (`Timeout`, `PeerLost`, ...).
    #[error(transparent)]
    Hook(HookError),
}

/// The typed error carried by [`Error::Hook`]: shared (a clone is cheap), equal only to
/// its clones (compared by identity), printed as the error it holds, whose `source` is
/// its own.
#[derive(Clone)]
pub struct HookError(std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>);

impl HookError {
    /// Wraps `error`.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        HookError(std::sync::Arc::new(error))
    }

    /// The error held.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }

    /// The error held, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref::<E>()
    }
}

impl Error {
    /// An [`Error::Hook`] carrying `error`.
    pub fn hook(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Hook(HookError::new(error))
    }
}

impl PartialEq for HookError {
    /// Identity: an error equals its clones. Errors above this crate need not be
    /// comparable, and two failures with the same message are still two failures.
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for HookError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for HookError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for HookError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Why `elements` of `element_bytes` bytes could not be allocated, for [`Error::Alloc`].
fn alloc_reason(elements: usize, element_bytes: usize) -> &'static str {
    match elements.checked_mul(element_bytes) {
        Some(bytes) if bytes <= isize::MAX as usize => "out of memory",
        _ => "more than isize::MAX bytes, larger than any allocation",
    }
}

fn missing_suffix(missing: &[usize]) -> String {
    if missing.is_empty() {
        String::new()
    } else {
        format!(" (ranks that never got there: {missing:?})")
    }
}

impl Error {
    /// An [`Error::Io`] from an `std::io::Error`, with context.
    pub fn io(context: impl Into<String>, e: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            message: e.to_string(),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// The typed backend variants print what the strings they replaced printed.
    #[test]
    fn backend_variants_print_their_context() {
        let aborted = Error::Aborted {
            op: None,
            rank: Some(1),
        };
        assert_eq!(
            aborted.to_string(),
            "the NCCL communicator of rank 1 was aborted (NcclGroup::abort)"
        );
        let in_op = Error::Aborted {
            op: Some("all_reduce".into()),
            rank: None,
        };
        assert_eq!(
            in_op.to_string(),
            "all_reduce: the NCCL communicator was aborted (NcclGroup::abort)"
        );
        let mpi = Error::Mpi {
            op: "MPI_Iallreduce".into(),
            code: 15,
            message: "MPI_ERR_TRUNCATE".into(),
        };
        assert_eq!(
            mpi.to_string(),
            "MPI_Iallreduce failed: MPI error 15: MPI_ERR_TRUNCATE"
        );
        let unusable = Error::Unusable {
            cause: Box::new(Error::Abandoned),
        };
        assert!(unusable.to_string().starts_with(
            "the MPI communicator is unusable after an earlier failure (the operation was abandoned before completing)"
        ));
        let panicked = Error::Panicked {
            what: "a stage of all_reduce".into(),
            message: None,
        };
        assert_eq!(panicked.to_string(), "a stage of all_reduce panicked");
        assert_eq!(
            Error::Internal("a chunk lies outside its buffer".into()).to_string(),
            "internal: a chunk lies outside its buffer"
        );
        assert_eq!(unusable.clone(), unusable);
    }
}
