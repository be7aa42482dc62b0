//! GPipe pipeline parallelism without autograd: layers with explicit backward passes, split
//! into partitions that each run on a worker thread, mini-batches split into micro-batches,
//! schedules as data (GPipe and 1F1B), and checkpointing with exact recomputation.
//!
//! - [`Tensor`]: what the pipeline needs from a tensor (split, concatenate, size, add,
//!   move). [`cpu::CpuTensor`] implements it on `ndarray`.
//! - [`Layer`]: `forward` returns the output and what `backward` needs ([`Saved`]);
//!   `backward` returns the input gradient and accumulates parameter gradients; a layer
//!   declares the skips it stashes and pops ([`Layer::skips`], the [`skip`] crate). Layers
//!   for tests and examples, in [`cpu`]: [`Linear`](cpu::Linear), [`ReLU`](cpu::ReLU),
//!   [`Dropout`](cpu::Dropout), [`BatchNorm`](cpu::BatchNorm) (plain or
//!   deferred), and the residual block through skips ([`StashInput`], [`AddSkip`],
//!   [`residual`]).
//! - [`Context`]: per call, train/eval, the step, the layer's global index, the micro-batch
//!   and a counter-based random [`Stream`] keyed by (seed, step, layer, sample): dropout
//!   masks do not depend on the chunking, and recomputation reproduces them bit for bit. A
//!   layer with skips reaches them through it ([`Context::skips`],
//!   [`Context::skip_grads`]).
//! - [`Schedule`]: per worker, an ordered list of [`Action`]s, validated before it runs;
//!   [`Schedule::gpipe`] and [`Schedule::one_f_one_b`] generate them.
//! - [`Pipe`]: the partitions, the micro-batching, the checkpoint mode, deferred batch
//!   norm, deferred weight gradients ([`PipeBuilder::defer_weight_grads`]: input gradients
//!   first, each partition's weight gradients in one product per layer after its last
//!   backward action, off the critical path); `forward` / `backward`, or `step` with a
//!   per-micro-batch loss. Skips that cross partitions move straight from the stashing
//!   partition to the popping one.
//! - [`balance`]: balances by time or size, with torchgpipe's block partition.
//!
//! A two-partition pipe, checked against the same layers run as one model:
//!
//! ```
//! use pipe::cpu::{CpuTensor, Linear, ReLU};
//! use pipe::{Batch, Layer, Pipe, ScheduleKind};
//!
//! # fn main() -> Result<(), pipe::Error> {
//! let model = || -> Vec<Box<dyn Layer<CpuTensor>>> {
//!     vec![Box::new(Linear::new(4, 8, 1)), Box::new(ReLU), Box::new(Linear::new(8, 2, 2))]
//! };
//! let mut pipe = Pipe::builder(model(), &[2, 1]) // partition 0: Linear, ReLU; 1: Linear
//!     .chunks(4)
//!     .schedule(ScheduleKind::OneFOneB)
//!     .build()?;
//! let x = CpuTensor::from_shape_vec(&[8, 4], (0..32).map(|v| v as f32 / 32.0).collect())?;
//! // Loss: the sum of the outputs, so each output gradient is all ones.
//! let step = pipe.step(Batch::single(x.clone()), |_mb, out| {
//!     let y = out.tensor(0)?;
//!     Ok((y.array().sum(), Batch::single(CpuTensor::ones(y.shape()))))
//! })?;
//! assert_eq!(step.losses.len(), 4); // one per micro-batch
//!
//! // The same layers as one unpipelined model on the whole batch.
//! let mut whole = Pipe::builder(model(), &[3]).build()?;
//! let y = whole.forward(Batch::single(x))?.into_single()?;
//! let diff = step.output.into_single()?.max_abs_diff(&y).unwrap_or(f32::MAX);
//! assert!(diff <= 1e-6 * y.max_abs());
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! Each is a test in `pipe/tests/`:
//!
//! - **Transparency** (`transparency.rs`): for every balance, chunk count, checkpoint mode
//!   and schedule, outputs and every gradient are bit-identical to the same layers run
//!   unpipelined over the same micro-batches, gradients accumulated in the schedule's
//!   backward order, with weight gradients deferred or not (deferred ones are the same
//!   sums in the same order); without batch norm they match the whole-batch model within
//!   1e-5.
//! - **Randomness independent of chunking** (`checkpoint.rs`, `transparency.rs`): dropout
//!   masks are the same whatever the chunks, balance or schedule, and recomputation
//!   replays them exactly.
//! - **Micro-batches** (`microbatch.rs`): `min(chunks, N)` of them, sizes differing by at
//!   most one; the checkpoint stop counts the actual ones.
//! - **Memory** (`memory.rs`): between forward and backward `always` holds only the
//!   micro-batch inputs, `never` every saved activation; 1F1B holds at most `n - j`
//!   micro-batches on partition `j`. Deferred weight gradients (`deferred_grads.rs`) are
//!   counted as held from the backward that defers them to the partition's flush, complete
//!   before [`Pipe::on_gradients_final`]'s callback, and flushed after a failed run.
//! - **Failures** (`failure.rs`, `threads.rs`): a layer's error or panic stops every
//!   worker (none starts an action after seeing the stop), the error names the partition,
//!   the layer and the micro-batch, every wait between workers is bounded by the timeout,
//!   no worker thread outlives the call, and a panic poisons the pipe.
//! - **Dataflow** (`dataflow.rs`): a worker waits only for the data its next action needs.
//! - **Skips** (`skips.rs`): declarations are verified when the pipe is built (every
//!   mismatch at once); a skip crossing partitions moves once per micro-batch each way,
//!   straight between the two partitions, and recomputation moves nothing again
//!   ([`Pipe::skip_moves`]); results are bit-identical to the model with its residual adds
//!   written out; no skip value or gradient is held after a step ([`Memory::skips`]).
//! - **Deferred batch norm** (`deferred_batch_norm.rs`): running statistics after a step
//!   equal plain batch norm's over the whole batch within 1e-6, whatever the chunks.
//! - **Balance** (`balance.rs`): torchgpipe's block partitions and errors exactly;
//!   profiling works on layers with skips and leaves the layers as it found them.
//!
//! Why explicit backward passes: Rust has no autograd to hook checkpointing and
//! cross-partition ordering into, so torchgpipe's fork/join tricks become data: a schedule
//! says which backward runs when, a checkpointed micro-batch keeps its input and re-runs
//! `forward` with the same [`Context`], and a skip's gradient travels back through the same
//! trackers that carried its value (torchgpipe's portals).
#![deny(missing_docs)]

pub mod balance;
#[cfg(feature = "burn")]
pub mod burn;
#[cfg(feature = "candle")]
pub mod candle;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod executor;
mod frame;
#[cfg(feature = "collectives")]
pub mod group_transport;
mod layer;
mod memory;
mod message;
mod microbatch;
mod pin;
mod pipe;
mod portal;
mod protocol;
mod ranks;
mod receiver;
mod record;
mod residual;
mod rng;
mod schedule;
pub mod simulate;
mod stage;
mod storage;
mod tensor;
pub mod trace;
pub mod transport;
mod vocab;
mod wire;
mod worker;

pub use crate::error::{BoxError, Error, Site};
#[cfg(feature = "collectives")]
pub use crate::group_transport::GroupTransport;
pub use crate::layer::{Context, Layer, Param, ParamMut, Saved};
pub use crate::memory::Memory;
pub use crate::microbatch::{Batch, Item, MicroBatch};
pub use crate::pipe::{Pipe, PipeBuilder, StepOutput, DEFAULT_TIMEOUT};
pub use crate::record::{Record, Span, SpanKind};
pub use crate::residual::{residual, AddSkip, StashInput};
pub use crate::rng::{SampleStream, Stream};
pub use crate::schedule::{
    clock_cycles, dual_pipe_v, interleaved_1f1b, interleaved_zero_bubble, loop_placement,
    looped_bfs, v_placement, zb_h1, zbv, Cell, Order, Schedule, ScheduleKind,
};
pub use crate::stage::Checkpoint;
pub use crate::tensor::Tensor;
pub use crate::transport::{LocalTransport, Transport, TransportError};
pub use crate::vocab::{Action, Device, Pass, Phase, Task};
pub use crate::wire::{Wire, WireMeta};
pub use ndarray;
pub use skip;
