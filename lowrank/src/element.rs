//! The element types buffers may hold.

use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// What a device buffer element must be: with the `cuda` feature, a type cudarc can copy to
/// and zero on the device; without it, nothing more.
#[cfg(feature = "cuda")]
pub trait DeviceElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
#[cfg(feature = "cuda")]
impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> DeviceElement for T {}
/// What a device buffer element must be: with the `cuda` feature, a type cudarc can copy to
/// and zero on the device; without it, nothing more.
#[cfg(not(feature = "cuda"))]
pub trait DeviceElement {}
#[cfg(not(feature = "cuda"))]
impl<T> DeviceElement for T {}

/// An element type of a buffer: `f32` for everything, `f16` and `bf16` for compressed
/// transfers (casts). Sealed: the kernels exist for these three only.
pub trait Element:
    sealed::Sealed
    + bytemuck::Pod
    + Default
    + PartialEq
    + std::fmt::Debug
    + Send
    + Sync
    + DeviceElement
    + 'static
{
    /// The name used in kernels and messages (`"f32"`, `"f16"`, `"bf16"`).
    const NAME: &'static str;
    /// Converts from `f32` with round-to-nearest-even.
    fn from_f32(x: f32) -> Self;
    /// Converts to `f32` (exact for every type here).
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for f16 {
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Element for bf16 {
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
