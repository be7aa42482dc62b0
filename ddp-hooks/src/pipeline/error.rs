//! [`PipelineError`]: what can go wrong in a pipelined data-parallel step, and the
//! [`Fault`]s (each with its [`Problem`]) of gradients that could not be handed over.

use std::fmt;

/// Why a parameter's gradient could not be handed to the reducer or written back.
#[derive(Debug)]
#[non_exhaustive]
pub enum Problem {
    /// Its shape differs from the one the parameter had when the
    /// [`DistributedPipe`](super::DistributedPipe) was built.
    Shape {
        /// The shape at construction.
        expected: Vec<usize>,
        /// The gradient's shape now.
        got: Vec<usize>,
    },
    /// The partition's layers report another number of parameters than at construction.
    Params {
        /// Parameters at construction.
        expected: usize,
        /// Parameters now.
        got: usize,
    },
    /// The tensor type's copy failed.
    Tensor(pipe::Error),
    /// The reducer refused the gradient's slot or its mark.
    Reducer(crate::Error),
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Shape { expected, got } => {
                write!(
                    f,
                    "gradient of shape {got:?}, the parameter was {expected:?}"
                )
            }
            Problem::Params { expected, got } => {
                write!(f, "{got} parameters, {expected} when the pipe was wrapped")
            }
            Problem::Tensor(e) => write!(f, "copy failed: {e}"),
            Problem::Reducer(e) => write!(f, "reducer: {e}"),
        }
    }
}

/// A gradient that could not be handed over or written back, and where it lives.
#[derive(Debug)]
pub struct Fault {
    /// The partition.
    pub partition: usize,
    /// The layer's global index and the parameter's name, where one parameter is at
    /// fault (not for [`Problem::Params`]).
    pub param: Option<(usize, &'static str)>,
    /// What went wrong.
    pub problem: Problem,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "partition {}", self.partition)?;
        if let Some((layer, name)) = self.param {
            write!(f, ", layer {layer}, `{name}`")?;
        }
        write!(f, ": {}", self.problem)
    }
}

/// What can go wrong in a pipelined data-parallel step. A type of its own (not a variant
/// of [`crate::Error`]) because `pipe`'s error is neither `Clone` nor `PartialEq`, which
/// the crate's error is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// The pipe's error (construction, a layer, the loss, a timeout).
    #[error(transparent)]
    Pipe(#[from] pipe::Error),
    /// The reducer's or a hook's error.
    #[error(transparent)]
    Reducer(#[from] crate::Error),
    /// Gradients that could not be handed to the reducer (they were reduced as zeros on
    /// this rank, so no peer waited) or written back.
    #[error("{}", faults(.0))]
    Gradients(Vec<Fault>),
    /// A [`Mesh`](super::Mesh) that does not fit the world group, or its groups could not
    /// be made.
    #[error(transparent)]
    Mesh(#[from] super::MeshError),
    /// On a mesh: this rank's step went through, but the step failed on these world
    /// ranks (each returns its own error), so this rank's gradients were not written
    /// back (they are this rank's own, as the pipe left them).
    #[error("the step failed on world ranks {ranks:?}; the gradients here were not written back")]
    PeersFailed {
        /// The world ranks whose step failed, ascending.
        ranks: Vec<usize>,
    },
}

fn faults(list: &[Fault]) -> String {
    let parts: Vec<String> = list.iter().map(Fault::to_string).collect();
    format!(
        "{}; the step was reduced with zeros in their place, so no rank waited",
        parts.join("; ")
    )
}

/// This module's result.
pub type Result<T, E = PipelineError> = std::result::Result<T, E>;
