//! The vocabulary every other module speaks: where a partition runs ([`Device`]), what a
//! schedule asks for ([`Action`], its [`Pass`]), which pass a layer call belongs to
//! ([`Phase`]) and what a worker was doing when a run failed ([`Task`]). A leaf: it
//! imports nothing from the crate.
//!
//! The three enums nest: a [`Pass`] is what a schedule orders (a backward action
//! recomputes first when the micro-batch was checkpointed), a [`Phase`] is what a layer
//! call runs (the pass, or the recomputation before a backward pass), and a [`Task`] is a
//! phase or one of the callbacks around the layers. `From` converts each into the next.

use std::fmt;

/// Where a partition's layers run.
///
/// Each partition gets one worker thread. [`Device::CpuCore`] pins that thread to a core
/// (on Linux; elsewhere it runs unpinned); [`Device::Cuda`] is for tensor types that live
/// on a GPU (the crate's [`CpuTensor`](crate::cpu::CpuTensor) refuses it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Device {
    /// Host memory, worker thread unpinned.
    #[default]
    Cpu,
    /// Host memory, worker thread pinned to this core.
    CpuCore(usize),
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// One pinned CPU device per core `0..n`: a worker per partition, each on its own core.
    pub fn cores(n: usize) -> Vec<Device> {
        (0..n).map(Device::CpuCore).collect()
    }

    /// Whether the memory is the host's.
    pub fn is_host(&self) -> bool {
        matches!(self, Device::Cpu | Device::CpuCore(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::CpuCore(core) => write!(f, "cpu core {core}"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// The pass of an [`Action`]: forward, backward, or one of the two halves of a backward
/// that zero-bubble schedules place apart (PyTorch's `I` and `W`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pass {
    /// Run the stage's layers forward on the micro-batch (PyTorch's `F`).
    Forward,
    /// Run them backward (recomputing first if the micro-batch was checkpointed): the
    /// input gradient and the weight gradients (`B`).
    Backward,
    /// The input-gradient half of a backward (`I`): the input gradient goes on to the
    /// previous stage at once, and each layer keeps what its weight gradient needs
    /// ([`Layer::flush_first_grad`](crate::Layer::flush_first_grad)). A layer that cannot
    /// split computes both here.
    InputGrad,
    /// The weight-gradient half (`W`) of the stage's oldest input-gradient action not yet
    /// completed by one: the weight gradients, added in the order of the `I` actions.
    WeightGrad,
}

impl Pass {
    /// Whether this pass computes an input gradient that the previous stage waits for
    /// (a backward, or its input-gradient half).
    pub fn sends_gradient(self) -> bool {
        matches!(self, Pass::Backward | Pass::InputGrad)
    }

    /// PyTorch's letter for it: `F`, `B`, `I` or `W`.
    pub fn letter(self) -> char {
        match self {
            Pass::Forward => 'F',
            Pass::Backward => 'B',
            Pass::InputGrad => 'I',
            Pass::WeightGrad => 'W',
        }
    }
}

/// One unit of a schedule: `pass` for `micro_batch` on `stage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    /// The stage (partition) index.
    pub stage: usize,
    /// The micro-batch index.
    pub micro_batch: usize,
    /// Forward or backward.
    pub pass: Pass,
}

impl Action {
    /// A forward action.
    pub fn forward(stage: usize, micro_batch: usize) -> Self {
        Action {
            stage,
            micro_batch,
            pass: Pass::Forward,
        }
    }

    /// A backward action.
    pub fn backward(stage: usize, micro_batch: usize) -> Self {
        Action {
            stage,
            micro_batch,
            pass: Pass::Backward,
        }
    }

    /// An input-gradient action (`I`).
    pub fn input_grad(stage: usize, micro_batch: usize) -> Self {
        Action {
            stage,
            micro_batch,
            pass: Pass::InputGrad,
        }
    }

    /// A weight-gradient action (`W`).
    pub fn weight_grad(stage: usize, micro_batch: usize) -> Self {
        Action {
            stage,
            micro_batch,
            pass: Pass::WeightGrad,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let work = match self.pass {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
            Pass::InputGrad => "input-gradient backward",
            Pass::WeightGrad => "weight-gradient backward",
        };
        write!(
            f,
            "{work} (stage {}, micro-batch {})",
            self.stage, self.micro_batch
        )
    }
}

/// Which pass a layer call belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The first forward pass of a micro-batch.
    Forward,
    /// A checkpointed micro-batch's forward pass, re-run just before its backward pass.
    /// Draws the same random numbers as the first; must not update running statistics.
    Recompute,
    /// The backward pass.
    Backward,
}

impl From<Pass> for Phase {
    fn from(pass: Pass) -> Self {
        match pass {
            Pass::Forward => Phase::Forward,
            Pass::Backward | Pass::InputGrad | Pass::WeightGrad => Phase::Backward,
        }
    }
}

/// What a worker was doing when a run failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Task {
    /// A layer's forward pass.
    Forward,
    /// A checkpointed micro-batch's forward pass, re-run before its backward pass.
    Recompute,
    /// A layer's backward pass.
    Backward,
    /// The loss function given to [`Pipe::step`](crate::Pipe::step).
    Loss,
    /// The callback given to [`Pipe::on_gradients_final`](crate::Pipe::on_gradients_final).
    GradientsFinal,
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Task::Forward => "forward",
            Task::Recompute => "recompute",
            Task::Backward => "backward",
            Task::Loss => "loss",
            Task::GradientsFinal => "gradients-final callback",
        })
    }
}

impl From<Phase> for Task {
    fn from(phase: Phase) -> Self {
        match phase {
            Phase::Forward => Task::Forward,
            Phase::Recompute => Task::Recompute,
            Phase::Backward => Task::Backward,
        }
    }
}

impl From<Pass> for Task {
    fn from(pass: Pass) -> Self {
        Phase::from(pass).into()
    }
}
