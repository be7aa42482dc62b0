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
    /// A hook spec the registry cannot parse: an unknown hook or option, or a bad value
    /// (`why` names it as typed and says what to type).
    #[error("invalid hook spec `{spec}`: {why}")]
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
    /// [`Reducer::mark_unused`](crate::Reducer::mark_unused) on a parameter whose
    /// gradient slot was handed out for writing ([`Reducer::grad_mut`](crate::Reducer::grad_mut))
    /// in the same step: marking it unused would zero what was written. Nothing changed;
    /// mark it ready instead.
    #[error("parameter {param} (shape {shape}) cannot be marked unused: its gradient was written in this step (grad_mut); mark it ready instead, or do not write an unused parameter's slot")]
    WrittenUnused {
        /// The parameter's index.
        param: usize,
        /// Its shape, printed.
        shape: String,
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
    /// An error of the communication layer (a collective that failed: `Timeout`,
    /// `PeerLost`, ...). Converting a `collectives::Error` that carries one of this
    /// crate's errors ([`collectives::Error::Hook`]) gives that error back instead (see
    /// [`Error::from_comm`]).
    #[error(transparent)]
    Comm(collectives::Error),
    /// An error of the kernel layer, kept typed (its allocation failures become
    /// [`Error::Overflow`] or [`Error::Alloc`] instead).
    #[error("lowrank: {0}")]
    Lowrank(#[source] lowrank::Error),
    /// A broken invariant of a hook's use of the kernel layer (a PowerSGD step that lost
    /// its bucket memory): a bug, reported rather than a panic.
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
    /// A buffer the kernel layer cannot allocate stays typed: more than `isize::MAX`
    /// bytes is [`Error::Overflow`], memory the allocator refused [`Error::Alloc`]; any
    /// other kernel error is [`Error::Lowrank`], holding it.
    fn from(e: lowrank::Error) -> Self {
        match e {
            lowrank::Error::Alloc {
                elements,
                element_bytes,
            } => Error::buffer(elements, element_bytes),
            other => Error::Lowrank(other),
        }
    }
}

impl Error {
    /// The error for a buffer of `elements` of `element_bytes` bytes that could not be
    /// allocated: [`Error::Overflow`] if it exceeds `isize::MAX` bytes (no allocation can
    /// hold it), else [`Error::Alloc`].
    pub(crate) fn buffer(elements: usize, element_bytes: usize) -> Error {
        match elements.checked_mul(element_bytes) {
            Some(bytes) if bytes <= isize::MAX as usize => Error::Alloc {
                elements,
                element_bytes,
            },
            _ => Error::Overflow(format!(
                "a buffer of {elements} elements of {element_bytes} bytes"
            )),
        }
    }
}

impl Error {
    /// The hook error carried by a work's error, if it is one.
    ///
    /// A hook's work completes with a `collectives::Error`. A failure of the collective
    /// itself stays the collective's variant (`Timeout`, `PeerLost`, ...); an error of
    /// the hook (a bad [`Error::Bucket`], [`Error::Config`], [`Error::State`], ...) is
    /// carried typed in [`collectives::Error::Hook`], and this returns it:
    ///
    /// ```
    /// use collectives::run_local;
    /// use ddp_hooks::{CommHook, Error, GradBucket, Layout, PowerSgd, PowerSgdConfig};
    /// use lowrank::CpuBackend;
    /// use std::sync::Arc;
    ///
    /// let config = PowerSgdConfig { start_powersgd_iter: 2, ..Default::default() };
    /// let errors = run_local(1, |group| {
    ///     let mut hook = PowerSgd::new(Arc::new(CpuBackend::new()), Arc::new(group), config.clone())?;
    ///     // The bucket's length changes while PowerSGD holds memory for it.
    ///     for cols in [16, 16, 16, 17] {
    ///         let layout = Arc::new(Layout::packed(&[vec![16, cols]])?);
    ///         hook.run(GradBucket::new(0, 1, vec![1.0; 16 * cols], layout)?).wait()?;
    ///     }
    ///     Ok::<_, collectives::Error>(())
    /// })
    /// .unwrap();
    /// let e = errors[0].clone().unwrap().unwrap_err(); // what `wait()` returned
    /// assert!(matches!(Error::from_comm(&e), Some(Error::Bucket { index: 0, .. })));
    /// assert!(matches!(Error::from(e), Error::Bucket { index: 0, .. })); // the same, owned
    /// ```
    pub fn from_comm(e: &collectives::Error) -> Option<&Error> {
        match e {
            collectives::Error::Hook(h) => h.downcast_ref::<Error>(),
            _ => None,
        }
    }
}

impl From<collectives::Error> for Error {
    /// A collective's failure becomes [`Error::Comm`]; a hook error carried through a
    /// work ([`collectives::Error::Hook`] holding an [`Error`]) becomes that error again.
    fn from(e: collectives::Error) -> Self {
        match Error::from_comm(&e) {
            Some(hook) => hook.clone(),
            None => Error::Comm(e),
        }
    }
}

impl From<Error> for collectives::Error {
    /// [`Error::Comm`] gives the collective's error back; every other error travels typed
    /// as [`collectives::Error::Hook`], recovered by [`Error::from_comm`] or `From`.
    fn from(e: Error) -> Self {
        match e {
            Error::Comm(c) => c,
            other => collectives::Error::hook(other),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel error stays typed; allocation failures keep their own variants.
    #[test]
    fn kernel_errors_stay_typed() {
        assert_eq!(
            Error::from(lowrank::Error::InvalidRank(0)),
            Error::Lowrank(lowrank::Error::InvalidRank(0))
        );
        assert_eq!(
            Error::from(lowrank::Error::Alloc {
                elements: 4,
                element_bytes: 4
            }),
            Error::Alloc {
                elements: 4,
                element_bytes: 4
            }
        );
        assert!(matches!(
            Error::from(lowrank::Error::Alloc {
                elements: usize::MAX,
                element_bytes: 4
            }),
            Error::Overflow(_)
        ));
        let e = Error::from(lowrank::Error::InvalidThreads);
        assert_eq!(
            e.to_string(),
            "lowrank: the thread count must be at least 1"
        );
        assert!(std::error::Error::source(&e).is_some());
    }
}
