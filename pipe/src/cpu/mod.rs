//! The CPU reference: [`CpuTensor`] on `ndarray`, the single-threaded `f32` product behind
//! [`Linear`] (`matmul`), and the layers on it for tests, examples and benches: [`Linear`],
//! [`ReLU`], [`Dropout`], [`BatchNorm`].
//!
//! The engine (schedules, executor, workers, checkpointing, skips) is generic over
//! [`Tensor`](crate::Tensor) and imports nothing from here.

mod layers;
#[doc(hidden)]
pub mod matmul;
mod tensor;

pub use layers::{BatchNorm, Dropout, Linear, ReLU};
pub use tensor::CpuTensor;
