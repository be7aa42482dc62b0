//! Owned buffers that collectives operate on, and the reduction operators.

use crate::{Error, Result};
use half::{bf16, f16};
use std::alloc::Layout;

/// A reduction operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks (sum, then divide by the group size).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// Element type of a [`Buffer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// `f64`.
    F64,
    /// Raw bytes: moved by point-to-point operations, broadcasts, gathers, scatters and
    /// all-to-all, never reduced (a reduction of a `U8` buffer is
    /// [`Error::InvalidArgument`]).
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F64 => 8,
            DType::U8 => 1,
        }
    }

    /// Whether reductions work on this type (every type but [`DType::U8`]).
    pub fn reducible(self) -> bool {
        self != DType::U8
    }
}

/// The error of a reduction (`what`) asked to reduce a buffer of a type that does not
/// reduce, or `None` when every buffer of `dtypes` reduces.
pub(crate) fn unreducible(what: &str, mut dtypes: impl Iterator<Item = DType>) -> Option<Error> {
    dtypes.find(|d| !d.reducible()).map(|d| {
        Error::InvalidArgument(format!(
            "{what} reduces elements, and {d:?} buffers hold raw bytes that do not reduce"
        ))
    })
}

/// An owned host buffer. Collectives take it by value and give it back through their
/// work handle, so no borrowed slice outlives a call that returned.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    /// `f32` elements.
    F32(Vec<f32>),
    /// `f16` elements.
    F16(Vec<f16>),
    /// `bf16` elements.
    BF16(Vec<bf16>),
    /// `f64` elements.
    F64(Vec<f64>),
    /// Raw bytes (see [`DType::U8`]).
    U8(Vec<u8>),
}

impl Buffer {
    /// This buffer's values in `dtype` (round to nearest even, as the `half` crate
    /// converts); a copy even when `dtype` is its own.
    ///
    /// # Panics
    /// If the copy cannot be allocated; [`try_narrowed`](Buffer::try_narrowed) returns
    /// that as an error.
    pub fn narrowed(&self, dtype: DType) -> Buffer {
        self.try_narrowed(dtype)
            .unwrap_or_else(|e| panic!("Buffer::narrowed: {e}"))
    }

    /// [`narrowed`](Buffer::narrowed), with an allocation failure [`Error::Alloc`].
    pub fn try_narrowed(&self, dtype: DType) -> Result<Buffer> {
        use half::slice::HalfFloatSliceExt;
        // An f32 buffer (the wire path's only input) converts straight from its values.
        let owned;
        let wide: &[f32] = match self {
            Buffer::F32(v) => v,
            other => {
                owned = other.try_to_f32_vec()?;
                &owned
            }
        };
        Ok(match dtype {
            DType::U8 => {
                return Err(Error::InvalidArgument(
                    "a buffer narrows to F32, F64, F16 or BF16, not to raw bytes (U8)".into(),
                ))
            }
            DType::F32 => Buffer::F32(try_copy(wide)?),
            DType::F64 => Buffer::F64(try_map(wide, |&v| v as f64)?),
            DType::F16 => {
                let mut v = try_zeroed_vec::<f16>(wide.len())?;
                v.convert_from_f32_slice(wide);
                Buffer::F16(v)
            }
            DType::BF16 => {
                let mut v = try_zeroed_vec::<bf16>(wide.len())?;
                v.convert_from_f32_slice(wide);
                Buffer::BF16(v)
            }
        })
    }

    /// This buffer's values as an `F32` buffer (exact for the 16-bit formats).
    ///
    /// # Panics
    /// If the `f32` copy cannot be allocated; [`try_widened`](Buffer::try_widened)
    /// returns that as an error.
    pub fn widened(self) -> Buffer {
        self.try_widened()
            .unwrap_or_else(|e| panic!("Buffer::widened: {e}"))
    }

    /// [`widened`](Buffer::widened), with an allocation failure [`Error::Alloc`] (an
    /// `F32` buffer comes back as it is, allocating nothing).
    pub fn try_widened(self) -> Result<Buffer> {
        Ok(match self {
            Buffer::F32(v) => Buffer::F32(v),
            other => Buffer::F32(other.try_to_f32_vec()?),
        })
    }

    fn try_to_f32_vec(&self) -> Result<Vec<f32>> {
        use half::slice::HalfFloatSliceExt;
        Ok(match self {
            Buffer::F32(v) => try_copy(v)?,
            Buffer::F64(v) => try_map(v, |&x| x as f32)?,
            Buffer::U8(v) => try_map(v, |&x| f32::from(x))?,
            Buffer::F16(v) => {
                let mut w = try_zeroed_vec(v.len())?;
                v.convert_to_f32_slice(&mut w);
                w
            }
            Buffer::BF16(v) => {
                let mut w = try_zeroed_vec(v.len())?;
                v.convert_to_f32_slice(&mut w);
                w
            }
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::F16(v) => v.len(),
            Buffer::BF16(v) => v.len(),
            Buffer::F64(v) => v.len(),
            Buffer::U8(v) => v.len(),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::F16(_) => DType::F16,
            Buffer::BF16(_) => DType::BF16,
            Buffer::F64(_) => DType::F64,
            Buffer::U8(_) => DType::U8,
        }
    }

    /// A zeroed buffer of `len` elements of `dtype`.
    ///
    /// # Panics
    /// If `len` elements exceed `isize::MAX` bytes or cannot be allocated;
    /// [`try_zeros`](Buffer::try_zeros) returns that as an error.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        Buffer::try_zeros(dtype, len).unwrap_or_else(|e| panic!("Buffer::zeros: {e}"))
    }

    /// A zeroed buffer of `len` elements of `dtype`, or [`Error::Alloc`] if `len`
    /// elements exceed `isize::MAX` bytes or the allocator refuses them: never a panic
    /// or an abort. The zeros come from the allocator's zeroed allocation (as
    /// `vec![0.0; len]`'s), so a large buffer's pages are mapped lazily by the OS.
    pub fn try_zeros(dtype: DType, len: usize) -> Result<Buffer> {
        Ok(match dtype {
            DType::F32 => Buffer::F32(try_zeroed_vec(len)?),
            DType::F16 => Buffer::F16(try_zeroed_vec(len)?),
            DType::BF16 => Buffer::BF16(try_zeroed_vec(len)?),
            DType::F64 => Buffer::F64(try_zeroed_vec(len)?),
            DType::U8 => Buffer::U8(try_zeroed_vec(len)?),
        })
    }

    /// The buffers `parts` one after another, in one new buffer (or [`Error::Alloc`]);
    /// they must share one type, which an empty list cannot name: both are
    /// [`Error::InvalidArgument`].
    pub fn try_concat(parts: &[Buffer]) -> Result<Buffer> {
        let dtype = parts
            .first()
            .ok_or_else(|| Error::InvalidArgument("nothing to concatenate".into()))?
            .dtype();
        if let Some(other) = parts.iter().find(|p| p.dtype() != dtype) {
            return Err(Error::InvalidArgument(format!(
                "buffers of {dtype:?} and {:?} do not concatenate",
                other.dtype()
            )));
        }
        let mut out = Buffer::try_zeros(dtype, parts.iter().map(Buffer::len).sum())?;
        let mut at = 0;
        let bytes = out.as_bytes_mut();
        for part in parts {
            let b = part.as_bytes();
            bytes[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        Ok(out)
    }

    /// A copy of the elements in `range` (or [`Error::Alloc`]); a range past the end is
    /// [`Error::InvalidArgument`].
    pub fn try_slice(&self, range: std::ops::Range<usize>) -> Result<Buffer> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::InvalidArgument(format!(
                "elements {range:?} of a buffer of {}",
                self.len()
            )));
        }
        let size = self.dtype().size();
        let mut out = Buffer::try_zeros(self.dtype(), range.len())?;
        out.as_bytes_mut()
            .copy_from_slice(&self.as_bytes()[range.start * size..range.end * size]);
        Ok(out)
    }

    /// The elements as bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Buffer::F32(v) => bytemuck::cast_slice(v),
            Buffer::F16(v) => bytemuck::cast_slice(v),
            Buffer::BF16(v) => bytemuck::cast_slice(v),
            Buffer::F64(v) => bytemuck::cast_slice(v),
            Buffer::U8(v) => v,
        }
    }

    /// The elements as mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Buffer::F32(v) => bytemuck::cast_slice_mut(v),
            Buffer::F16(v) => bytemuck::cast_slice_mut(v),
            Buffer::BF16(v) => bytemuck::cast_slice_mut(v),
            Buffer::F64(v) => bytemuck::cast_slice_mut(v),
            Buffer::U8(v) => v,
        }
    }
}

/// The error for a buffer of `len` elements of `T`.
fn refused<T>(len: usize) -> Error {
    Error::Alloc {
        elements: len,
        element_bytes: size_of::<T>(),
    }
}

/// A vector of `len` zeros, or [`Error::Alloc`]: from the allocator's zeroed allocation
/// (`alloc_zeroed`, `calloc`, as `vec![0.0; len]`), so the pages of a large one are mapped
/// lazily by the OS, not written here. `Layout::array` refuses more than `isize::MAX`
/// bytes before the allocator is asked.
pub(crate) fn try_zeroed_vec<T: bytemuck::Zeroable>(len: usize) -> Result<Vec<T>> {
    let layout = Layout::array::<T>(len).map_err(|_| refused::<T>(len))?;
    if layout.size() == 0 {
        // Nothing to allocate (`len` is 0, or `T` has no size): `Vec` needs no memory.
        let mut v = Vec::new();
        v.resize_with(len, T::zeroed);
        return Ok(v);
    }
    // SAFETY: `layout` has a non-zero size (checked above), as `alloc_zeroed` requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(refused::<T>(len));
    }
    // SAFETY: `ptr` is non-null and was allocated by the global allocator (the one `Vec`
    // uses) with `Layout::array::<T>(len)`: `T`'s alignment and `len * size_of::<T>()`
    // bytes (at most `isize::MAX`), exactly the layout of a `Vec<T>` of capacity `len`.
    // All `len` elements are initialised: the memory is zeroed, and all-zero bytes are a
    // valid `T` (`T: Zeroable`; for the element types here, 0.0). The vector owns the
    // allocation from here; nothing else holds `ptr`.
    Ok(unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, len) })
}

/// An empty vector with room for exactly `len` elements, or [`Error::Alloc`].
fn try_with_capacity<T>(len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| refused::<T>(len))?;
    Ok(v)
}

/// A copy of `s` (one `memcpy`, as `to_vec`), or [`Error::Alloc`].
pub(crate) fn try_copy<T: Copy>(s: &[T]) -> Result<Vec<T>> {
    let mut v = try_with_capacity(s.len())?;
    v.extend_from_slice(s);
    Ok(v)
}

/// `s` mapped element-wise by `f`, or [`Error::Alloc`].
fn try_map<S, D>(s: &[S], f: impl FnMut(&S) -> D) -> Result<Vec<D>> {
    let mut v = try_with_capacity(s.len())?;
    v.extend(s.iter().map(f));
    Ok(v)
}

macro_rules! conversions {
    ($($t:ty => $variant:ident),*) => {$(
        impl From<Vec<$t>> for Buffer {
            fn from(v: Vec<$t>) -> Buffer {
                Buffer::$variant(v)
            }
        }

        impl TryFrom<Buffer> for Vec<$t> {
            type Error = crate::Error;
            fn try_from(b: Buffer) -> crate::Result<Vec<$t>> {
                match b {
                    Buffer::$variant(v) => Ok(v),
                    other => Err(crate::Error::InvalidArgument(format!(
                        "expected a {:?} buffer, got {:?}",
                        DType::$variant,
                        other.dtype()
                    ))),
                }
            }
        }
    )*};
}

conversions!(f32 => F32, f16 => F16, bf16 => BF16, f64 => F64, u8 => U8);

/// Whether `v` is NaN (the one value unordered with itself).
#[inline(always)]
pub(crate) fn is_nan<A: PartialOrd>(v: A) -> bool {
    v.partial_cmp(&v).is_none()
}

/// An element type that reductions work on: accumulated in `f32` (`f16`, `bf16`, `f32`)
/// or `f64`.
pub(crate) trait Reducible: Copy + Send + Sync + 'static {
    type Acc: Copy
        + PartialOrd
        + std::ops::Add<Output = Self::Acc>
        + std::ops::Mul<Output = Self::Acc>;
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
    fn acc_from_usize(n: usize) -> Self::Acc;
    /// Whether this is bfloat16 (the thread backend's wire rounding picks on it).
    const BITS_BF16: bool = false;
    /// `dst[i] = src[i].widen()`, vectorised where the format allows.
    fn widen_slice(src: &[Self], dst: &mut [Self::Acc]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.widen());
    }
    /// Combines `src` into `acc` element-wise with `op` (`Avg` sums).
    fn accumulate(acc: &mut [Self::Acc], src: &[Self], op: ReduceOp) {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => acc
                .iter_mut()
                .zip(src)
                .for_each(|(a, x)| *a = *a + x.widen()),
            // NaN propagates, as torch's max and min do, whichever rank holds it.
            ReduceOp::Max => acc.iter_mut().zip(src).for_each(|(a, x)| {
                let v = x.widen();
                if v > *a || is_nan(v) {
                    *a = v
                }
            }),
            ReduceOp::Min => acc.iter_mut().zip(src).for_each(|(a, x)| {
                let v = x.widen();
                if v < *a || is_nan(v) {
                    *a = v
                }
            }),
        }
    }
    /// `dst[i] = narrow(src[i])`, vectorised where the format allows.
    fn narrow_slice(src: &[Self::Acc], dst: &mut [Self]) {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = Self::narrow(*s));
    }
}

impl Reducible for f32 {
    type Acc = f32;
    fn widen(self) -> f32 {
        self
    }
    fn narrow(a: f32) -> f32 {
        a
    }
    fn acc_from_usize(n: usize) -> f32 {
        n as f32
    }
}

impl Reducible for f64 {
    type Acc = f64;
    fn widen(self) -> f64 {
        self
    }
    fn narrow(a: f64) -> f64 {
        a
    }
    fn acc_from_usize(n: usize) -> f64 {
        n as f64
    }
}

/// The 16-bit formats: accumulated in `f32`, converted a block at a time with the SIMD
/// conversions of the `half` crate.
macro_rules! half_reducible {
    ($($t:ty => $is_bf16:expr),*) => {$(
        impl Reducible for $t {
            type Acc = f32;
            const BITS_BF16: bool = $is_bf16;
            fn widen(self) -> f32 {
                self.to_f32()
            }
            fn narrow(a: f32) -> $t {
                <$t>::from_f32(a)
            }
            fn acc_from_usize(n: usize) -> f32 {
                n as f32
            }
            fn widen_slice(src: &[Self], dst: &mut [f32]) {
                use half::slice::HalfFloatSliceExt;
                src.convert_to_f32_slice(dst);
            }
            fn narrow_slice(src: &[f32], dst: &mut [Self]) {
                use half::slice::HalfFloatSliceExt;
                dst.convert_from_f32_slice(src);
            }
            fn accumulate(acc: &mut [f32], src: &[Self], op: ReduceOp) {
                // Widen a block with SIMD conversions, then combine in f32.
                let mut wide = [0.0f32; 256];
                for (a, s) in acc.chunks_mut(256).zip(src.chunks(256)) {
                    let w = &mut wide[..s.len()];
                    Self::widen_slice(s, w);
                    f32::accumulate(a, w, op);
                }
            }
        }
    )*};
}

half_reducible!(f16 => false, bf16 => true);
