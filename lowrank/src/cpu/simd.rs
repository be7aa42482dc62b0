//! A minimal vector abstraction so that each kernel is written once and compiled for
//! AVX-512, AVX2+FMA and a portable fallback.
//!
//! Every method is `#[inline(always)]`: the generic kernels are inlined into a
//! `#[target_feature]` entry point per instruction set (see `kernels/mod.rs`), where the
//! intrinsics are compiled with the features they need.

/// One SIMD register of `f32` lanes and the operations the kernels use.
///
/// # Safety
/// Implementations are only called from code compiled with (or running on a CPU that
/// has) the instruction set they name; pointers must be valid for `LANES` elements.
pub(crate) trait Simd: Copy {
    type V: Copy;
    const LANES: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a * b + c`, fused where the hardware can.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// One lane of [`Simd::fma`]: the same rounding, for the columns a kernel takes one
    /// at a time, so that they get the same bits as in a vector.
    fn fma1(a: f32, b: f32, c: f32) -> f32;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn reduce(v: Self::V) -> f32;
    /// A hint to fetch the cache line at `p` into all levels; never faults.
    #[inline(always)]
    unsafe fn prefetch(p: *const f32) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetch is a hint that never faults, whatever the address.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
    /// A hint to fetch the cache line at `p` into L2 (and L3) but not L1; never faults.
    /// For streams fetched far ahead: brought into L1, they would evict the factors and
    /// the accumulators the kernels keep there (32 KiB of L1d on AMD Zen 4).
    #[inline(always)]
    unsafe fn prefetch_l2(p: *const f32) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetch is a hint that never faults, whatever the address.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T1 }>(p.cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

/// Eight lanes in plain Rust; LLVM vectorises it with whatever the target has (SSE2 on
/// baseline x86-64). No fused multiply-add: `a * b + c` rounds twice.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Simd for Portable {
    type V = [f32; 8];
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self::V {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        // SAFETY: the caller guarantees 8 readable elements at `p`.
        unsafe { p.cast::<[f32; 8]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        // SAFETY: the caller guarantees 8 writable elements at `p`.
        unsafe { p.cast::<[f32; 8]>().write_unaligned(v) }
    }
    #[inline(always)]
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    fn fma1(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    #[inline(always)]
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn reduce(v: Self::V) -> f32 {
        ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]))
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Simd;
    use core::arch::x86_64::*;

    /// AVX2 with FMA: 8 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    // SAFETY (whole impl): only called from `#[target_feature(enable = "avx2,fma")]`
    // entry points, which are only called after runtime detection of those features.
    #[allow(clippy::undocumented_unsafe_blocks)]
    impl Simd for Avx2 {
        type V = __m256;
        const LANES: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn fma1(a: f32, b: f32, c: f32) -> f32 {
            // Inlined into code compiled with `fma`: one `vfmadd`, rounded once.
            a.mul_add(b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn sub(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_sub_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn reduce(v: __m256) -> f32 {
            unsafe {
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
                _mm_cvtss_f32(s)
            }
        }
    }

    /// AVX-512F: 16 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512;

    // SAFETY (whole impl): only called from `#[target_feature(enable = "avx512f,...")]`
    // entry points, which are only called after runtime detection of those features.
    #[allow(clippy::undocumented_unsafe_blocks)]
    impl Simd for Avx512 {
        type V = __m512;
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn fma1(a: f32, b: f32, c: f32) -> f32 {
            // Inlined into code compiled with `fma`: one `vfmadd`, rounded once.
            a.mul_add(b, c)
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn sub(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_sub_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn reduce(v: __m512) -> f32 {
            unsafe { _mm512_reduce_add_ps(v) }
        }
    }
}
