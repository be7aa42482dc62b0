//! Partitions on CUDA devices (feature `cuda`): [`CudaTensor`] and the CPU layers on the
//! device ([`Linear`] on cuBLAS, [`ReLU`], [`Dropout`], [`BatchNorm`]), each on the stream
//! of its partition.
//!
//! # Devices, streams, ordering
//!
//! [`Gpu::new`] opens a device once per process: one shared CUDA context, the kernels
//! compiled by NVRTC, and cudarc's per-slice event tracking turned off. Each partition
//! gets its own [`GpuStream`] ([`Gpu::stream`]: non-blocking, with its own cuBLAS handle),
//! and its layers are made for that stream; two partitions on one GPU then run their
//! kernels concurrently instead of serialising on the legacy default stream. The ordering
//! rules are on [`CudaTensor`]: a tensor is used on one stream; moving it to another
//! ([`CudaTensor::on`]) waits on the event recorded when the producer handed it over and
//! records the new stream as a reader; memory read by other streams is freed only after
//! an event on every reader has completed; writes to shared memory copy first. What the
//! pipe does automatically: the sending partition marks a tensor ready as it hands it over
//! ([`Tensor::to_device`](crate::Tensor::to_device) on the same ordinal; between ordinals
//! it is a peer copy), and the receiving layer moves it to its own stream before the first
//! kernel reads it ([`CudaTensor::on`], called by every layer here). What is yours: a
//! layer of your own calls `on` for its inputs and enqueues only on its stream.
//!
//! The libraries are loaded at run time (cudarc's dynamic loading): without a driver,
//! [`Gpu::new`] returns [`Error::CudaUnavailable`](crate::Error::CudaUnavailable).
//!
//! ```no_run
//! use pipe::cuda::{CudaTensor, Gpu, Linear, ReLU};
//! use pipe::{Batch, Device, Layer, Pipe};
//! # fn main() -> Result<(), pipe::Error> {
//! let gpu = Gpu::new(0)?;
//! let (s0, s1) = (gpu.stream()?, gpu.stream()?); // one stream per partition
//! let layers: Vec<Box<dyn Layer<CudaTensor>>> = vec![
//!     Box::new(Linear::new(64, 64, 1, &s0)?),
//!     Box::new(ReLU::new(&s0)),
//!     Box::new(Linear::new(64, 64, 2, &s1)?),
//! ];
//! let mut pipe = Pipe::builder(layers, &[2, 1])
//!     .devices(vec![Device::Cuda(0), Device::Cuda(0)])
//!     .chunks(4)
//!     .build()?;
//! let x = CudaTensor::from_host(&s0, &[32, 64], &vec![0.5; 32 * 64])?;
//! let y = pipe.forward(Batch::single(x))?.into_single()?;
//! assert_eq!(y.to_host()?.len(), 32 * 64);
//! # Ok(()) }
//! ```

mod device;
mod layers;
mod tensor;

pub use device::{Gpu, GpuStream};
pub use layers::{BatchNorm, Dropout, Linear, ReLU};
pub use tensor::CudaTensor;
