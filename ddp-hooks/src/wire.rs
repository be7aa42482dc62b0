//! Half-precision transfer for any hook: PyTorch's `fp16_compress_wrapper` and
//! `bf16_compress_wrapper`.
//!
//! PyTorch's wrappers run the inner hook entirely in 16-bit (for PowerSGD: its products,
//! Gram-Schmidt, error and factors). Here the wrapper is a process group instead:
//! [`HalfWire`] (from `collectives`, re-exported) sends every `f32` buffer of the inner
//! hook as `f16`/`bf16` and widens the result, so the inner hook computes in `f32` and
//! only the transfer is narrowed: the same bytes on the wire, without 16-bit rounding in
//! the compression arithmetic. The `fp16`/`bf16` hooks ([`Compress`](crate::Compress))
//! are `AllReduce` over a `HalfWire` group.

pub use collectives::narrow::{HalfWire, WireFormat};
