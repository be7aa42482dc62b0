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
    /// Vectors of `V` the register file holds: 32 with AVX-512, 16 with AVX2, 8 for the
    /// portable eight lanes (two of SSE2's 16 registers each). Register tiles size their
    /// rows by it.
    const REGS: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// Stores `v` at `p` around the caches (a non-temporal store: no read for ownership,
    /// the line written to memory whole), where the instruction set has one; a plain
    /// [`Simd::store`] otherwise. `p` must be aligned to the vector (`LANES * 4` bytes),
    /// and the thread must call [`Simd::fence_nt`] before anything else reads or writes
    /// that memory (the stores are weakly ordered).
    #[inline(always)]
    unsafe fn store_nt(p: *mut f32, v: Self::V) {
        // SAFETY: forwarded caller guarantees.
        unsafe { Self::store(p, v) }
    }
    /// Orders this thread's [`Simd::store_nt`] stores before its later memory operations
    /// (`sfence`); nothing where those are plain stores.
    #[inline(always)]
    unsafe fn fence_nt() {}
    /// `a * b + c`, fused where the hardware can.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// One lane of [`Simd::fma`]: the same rounding, for the columns a kernel takes one
    /// at a time, so that they get the same bits as in a vector.
    fn fma1(a: f32, b: f32, c: f32) -> f32;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// The sum of the lanes by one fixed tree: lanes `i` and `i + LANES / 2` first, then
    /// `i` and `i + LANES / 4` of those sums, and so on. Every level pairs lanes a fixed
    /// distance apart around the vector, so the result does not change when the lanes
    /// are rotated: the `mq` kernel's aligned vectors rely on it (`mq::Edges`).
    unsafe fn reduce(v: Self::V) -> f32;
    /// [`Simd::reduce`] of each of `v` into `out` (the same bits), where the instruction
    /// set can with the shuffles of up to `LANES` vectors shared: their lanes are
    /// transposed level by level (the tree's pairs of lanes of two vectors added in one
    /// vector), 2 shuffles and an add for each pair of vectors at each level.
    #[inline(always)]
    unsafe fn reduce_into(v: &[Self::V], out: &mut [f32]) {
        for (x, o) in v.iter().zip(out) {
            // SAFETY: the caller's instruction set.
            *o = unsafe { Self::reduce(*x) };
        }
    }
    /// Whether the kernels should start their vectors of `M` at a vector boundary
    /// (`LANES * 4` bytes) where its rows do not: true where an unaligned vector load
    /// costs more than an aligned one (x86), false for the portable fallback.
    const ALIGN: bool;
    /// Lanes `lo..hi` of the vector at `p` (the others zero), touching only those lanes'
    /// memory: `p.add(lo)..p.add(hi)` must be readable.
    unsafe fn load_lanes(p: *const f32, lo: usize, hi: usize) -> Self::V;
    /// Stores lanes `lo..hi` of `v` at `p`, touching only those lanes' memory.
    unsafe fn store_lanes(p: *mut f32, v: Self::V, lo: usize, hi: usize);
    /// [`Simd::fma`] in lanes `lo..hi`; the other lanes keep `c`.
    unsafe fn fma_lanes(a: Self::V, b: Self::V, c: Self::V, lo: usize, hi: usize) -> Self::V;
    /// Runs `work` in a function of its own, compiled for this instruction set and not
    /// inlined into the caller, so that a hot loop gets the registers to itself.
    unsafe fn outlined<W: Outlined>(work: W) -> W::Output;
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
    /// A hint to fetch the cache line at `p` for one use (`prefetchnta`: near the core,
    /// marked to leave the caches first); never faults. For streams from memory that are
    /// read once.
    #[inline(always)]
    unsafe fn prefetch_nta(p: *const f32) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetch is a hint that never faults, whatever the address.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_NTA }>(p.cast());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
}

/// Work for [`Simd::outlined`]: its arguments as fields, and `run`, which must be
/// `#[inline(always)]` so that it is compiled into the instruction set's function (a
/// closure is a function of its own, which without LTO may land in another codegen unit,
/// where the intrinsics in it are calls: 40x slower).
pub(crate) trait Outlined {
    /// What `run` returns.
    type Output;
    /// The work.
    ///
    /// # Safety
    /// The implementation's own guarantees, and the instruction set of the
    /// [`Simd::outlined`] that runs it.
    unsafe fn run(self) -> Self::Output;
}

/// Eight lanes in plain Rust; LLVM vectorises it with whatever the target has (SSE2 on
/// baseline x86-64). No fused multiply-add: `a * b + c` rounds twice.
#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl Simd for Portable {
    type V = [f32; 8];
    const LANES: usize = 8;
    const REGS: usize = 8;
    #[inline(never)]
    unsafe fn outlined<W: Outlined>(work: W) -> W::Output {
        // SAFETY: forwarded caller guarantees.
        unsafe { work.run() }
    }
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
        ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
    }
    const ALIGN: bool = false;
    #[inline(always)]
    unsafe fn load_lanes(p: *const f32, lo: usize, hi: usize) -> Self::V {
        std::array::from_fn(|i| {
            if (lo..hi).contains(&i) {
                // SAFETY: the caller guarantees lanes lo..hi readable; only those are read.
                // (`wrapping_add`: `p` itself may lie before the buffer, as for a vector
                // that starts before a row, and `add` from there would be undefined.)
                unsafe { *p.wrapping_add(i) }
            } else {
                0.0
            }
        })
    }
    #[inline(always)]
    unsafe fn store_lanes(p: *mut f32, v: Self::V, lo: usize, hi: usize) {
        for (i, x) in v.iter().enumerate().take(hi).skip(lo) {
            // SAFETY: the caller guarantees lanes lo..hi writable (`wrapping_add` as in
            // `load_lanes`).
            unsafe { *p.wrapping_add(i) = *x };
        }
    }
    #[inline(always)]
    unsafe fn fma_lanes(a: Self::V, b: Self::V, c: Self::V, lo: usize, hi: usize) -> Self::V {
        std::array::from_fn(|i| {
            if (lo..hi).contains(&i) {
                a[i] * b[i] + c[i]
            } else {
                c[i]
            }
        })
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Outlined, Simd};
    use core::arch::x86_64::*;

    /// [`Simd::outlined`] for AVX2.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `work`'s own guarantees.
    #[target_feature(enable = "avx2,fma")]
    #[inline(never)]
    unsafe fn outlined_avx2<W: Outlined>(work: W) -> W::Output {
        // SAFETY: forwarded caller guarantees.
        unsafe { work.run() }
    }

    /// [`Simd::outlined`] for AVX-512.
    ///
    /// # Safety
    /// The CPU has AVX-512F, AVX2 and FMA; `work`'s own guarantees.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline(never)]
    unsafe fn outlined_avx512<W: Outlined>(work: W) -> W::Output {
        // SAFETY: forwarded caller guarantees.
        unsafe { work.run() }
    }

    /// AVX2 with FMA: 8 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    // SAFETY (whole impl): only called from `#[target_feature(enable = "avx2,fma")]`
    // entry points, which are only called after runtime detection of those features.
    #[allow(clippy::undocumented_unsafe_blocks)]
    impl Simd for Avx2 {
        type V = __m256;
        const LANES: usize = 8;
        const REGS: usize = 16;
        #[inline(always)]
        unsafe fn outlined<W: Outlined>(work: W) -> W::Output {
            unsafe { outlined_avx2(work) }
        }
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
        unsafe fn store_nt(p: *mut f32, v: __m256) {
            debug_assert!((p as usize).is_multiple_of(32));
            unsafe { _mm256_stream_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn fence_nt() {
            unsafe { _mm_sfence() }
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
        #[inline(always)]
        unsafe fn reduce_into(v: &[__m256], out: &mut [f32]) {
            // (No closures below: they would not take the caller's target features.)
            unsafe {
                for (vs, os) in v.chunks(8).zip(out.chunks_mut(8)) {
                    if vs.len() < 3 {
                        for (x, o) in vs.iter().zip(os.iter_mut()) {
                            *o = Self::reduce(*x);
                        }
                        continue;
                    }
                    let mut a = [_mm256_setzero_ps(); 8];
                    a[..vs.len()].copy_from_slice(vs);
                    // Lanes i and i + 4 of two vectors into one, the first's sums in the
                    // low half; then i and i + 2, i and i + 1 (within 128-bit lanes).
                    let mut b = [_mm256_setzero_ps(); 4];
                    for k in 0..4 {
                        let (x, y) = (a[2 * k], a[2 * k + 1]);
                        b[k] = _mm256_add_ps(
                            _mm256_permute2f128_ps::<0x20>(x, y),
                            _mm256_permute2f128_ps::<0x31>(x, y),
                        );
                    }
                    let mut c = [_mm256_setzero_ps(); 2];
                    for k in 0..2 {
                        let (x, y) = (b[2 * k], b[2 * k + 1]);
                        c[k] = _mm256_add_ps(
                            _mm256_shuffle_ps::<0b01_00_01_00>(x, y),
                            _mm256_shuffle_ps::<0b11_10_11_10>(x, y),
                        );
                    }
                    let d = _mm256_add_ps(
                        _mm256_shuffle_ps::<0b10_00_10_00>(c[0], c[1]),
                        _mm256_shuffle_ps::<0b11_01_11_01>(c[0], c[1]),
                    );
                    // Lane 4h + m holds the sum of vector 2m + h.
                    let mut lanes = [0.0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), d);
                    for (t, o) in os.iter_mut().enumerate().take(vs.len()) {
                        *o = lanes[4 * (t % 2) + t / 2];
                    }
                }
            }
        }
        const ALIGN: bool = true;
        #[inline(always)]
        unsafe fn load_lanes(p: *const f32, lo: usize, hi: usize) -> __m256 {
            // SAFETY: `vmaskmovps` reads only the lanes whose mask sign bit is set (lo..hi,
            // readable by the caller's guarantee) and suppresses faults on the others.
            unsafe { _mm256_maskload_ps(p, lane_mask(lo, hi)) }
        }
        #[inline(always)]
        unsafe fn store_lanes(p: *mut f32, v: __m256, lo: usize, hi: usize) {
            // SAFETY: `vmaskmovps` writes only the lanes of its mask (lo..hi, writable by
            // the caller's guarantee) and suppresses faults on the others.
            unsafe { _mm256_maskstore_ps(p, lane_mask(lo, hi), v) }
        }
        #[inline(always)]
        unsafe fn fma_lanes(a: __m256, b: __m256, c: __m256, lo: usize, hi: usize) -> __m256 {
            unsafe {
                let f = _mm256_fmadd_ps(a, b, c);
                _mm256_blendv_ps(c, f, _mm256_castsi256_ps(lane_mask(lo, hi)))
            }
        }
    }

    /// All ones in lanes `lo..hi` of 8, zero elsewhere (a `vmaskmovps` or `vblendvps`
    /// mask).
    ///
    /// # Safety
    /// The CPU has AVX2 (the callers are the AVX2 impl's functions).
    #[inline(always)]
    unsafe fn lane_mask(lo: usize, hi: usize) -> __m256i {
        // SAFETY: register-only AVX2 operations, AVX2 present (the caller).
        unsafe {
            let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let above = _mm256_cmpgt_epi32(_mm256_set1_epi32(lo as i32), iota);
            let below = _mm256_cmpgt_epi32(_mm256_set1_epi32(hi as i32), iota);
            _mm256_andnot_si256(above, below)
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
        const REGS: usize = 32;
        #[inline(always)]
        unsafe fn outlined<W: Outlined>(work: W) -> W::Output {
            unsafe { outlined_avx512(work) }
        }
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
        unsafe fn store_nt(p: *mut f32, v: __m512) {
            debug_assert!((p as usize).is_multiple_of(64));
            unsafe { _mm512_stream_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn fence_nt() {
            unsafe { _mm_sfence() }
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
            unsafe {
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                Avx2::reduce(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
            }
        }
        #[inline(always)]
        unsafe fn reduce_into(v: &[__m512], out: &mut [f32]) {
            // (No closures below: they would not take the caller's target features.)
            unsafe {
                for (vs, os) in v.chunks(16).zip(out.chunks_mut(16)) {
                    if vs.len() < 4 {
                        for (x, o) in vs.iter().zip(os.iter_mut()) {
                            *o = Self::reduce(*x);
                        }
                        continue;
                    }
                    let mut a = [_mm512_setzero_ps(); 16];
                    a[..vs.len()].copy_from_slice(vs);
                    // Lanes i and i + 8 of two vectors into one vector, the first's sums
                    // in the low half; then i and i + 4 of each half (128-bit lanes
                    // regrouped), i and i + 2, i and i + 1 (within 128-bit lanes).
                    let mut b = [_mm512_setzero_ps(); 8];
                    for k in 0..8 {
                        let (x, y) = (a[2 * k], a[2 * k + 1]);
                        b[k] = _mm512_add_ps(
                            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
                            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
                        );
                    }
                    let mut c = [_mm512_setzero_ps(); 4];
                    for k in 0..4 {
                        let (x, y) = (b[2 * k], b[2 * k + 1]);
                        c[k] = _mm512_add_ps(
                            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
                        );
                    }
                    let mut d = [_mm512_setzero_ps(); 2];
                    for k in 0..2 {
                        let (x, y) = (c[2 * k], c[2 * k + 1]);
                        d[k] = _mm512_add_ps(
                            _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
                            _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
                        );
                    }
                    let e = _mm512_add_ps(
                        _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]),
                        _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]),
                    );
                    // Lane 4j + m holds the sum of vector 4m + j.
                    let mut lanes = [0.0f32; 16];
                    _mm512_storeu_ps(lanes.as_mut_ptr(), e);
                    for (t, o) in os.iter_mut().enumerate().take(vs.len()) {
                        *o = lanes[4 * (t % 4) + t / 4];
                    }
                }
            }
        }
        const ALIGN: bool = true;
        #[inline(always)]
        unsafe fn load_lanes(p: *const f32, lo: usize, hi: usize) -> __m512 {
            // SAFETY: a masked load reads only the lanes of its mask (lo..hi, readable by
            // the caller's guarantee) and suppresses faults on the others.
            unsafe { _mm512_maskz_loadu_ps(lanes16(lo, hi), p) }
        }
        #[inline(always)]
        unsafe fn store_lanes(p: *mut f32, v: __m512, lo: usize, hi: usize) {
            // SAFETY: a masked store writes only the lanes of its mask (lo..hi, writable
            // by the caller's guarantee) and suppresses faults on the others.
            unsafe { _mm512_mask_storeu_ps(p, lanes16(lo, hi), v) }
        }
        #[inline(always)]
        unsafe fn fma_lanes(a: __m512, b: __m512, c: __m512, lo: usize, hi: usize) -> __m512 {
            unsafe { _mm512_mask3_fmadd_ps(a, b, c, lanes16(lo, hi)) }
        }
    }

    /// The mask of lanes `lo..hi` of 16.
    #[inline(always)]
    fn lanes16(lo: usize, hi: usize) -> __mmask16 {
        let bits = |n: usize| if n >= 16 { u32::MAX } else { (1u32 << n) - 1 };
        (bits(hi) & !bits(lo)) as __mmask16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lanes of very different magnitudes, so that the order of the adds shows in the
    /// bits.
    fn lanes(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let mant = (x % 10_000) as f32 / 997.0 - 5.0;
                mant * [1.0, 1e-4, 3e3, 1e-7][i % 4]
            })
            .collect()
    }

    /// `Simd::reduce` of every rotation of `v` (and `v` itself first).
    ///
    /// # Safety
    /// The CPU has `S`'s instruction set (the caller is compiled with it).
    #[inline(always)]
    unsafe fn rotations<S: Simd>(v: &[f32]) -> Vec<u32> {
        // Loops, not closures: a closure would not take the caller's target features.
        let mut sums = Vec::new();
        for by in 0..S::LANES {
            let mut r = vec![0.0f32; S::LANES];
            for (l, x) in r.iter_mut().enumerate() {
                *x = v[(l + S::LANES - by) % S::LANES];
            }
            // SAFETY: `r` holds LANES floats; the instruction set is the caller's.
            sums.push(unsafe { S::reduce(S::load(r.as_ptr())) }.to_bits());
        }
        sums
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rotations_avx2(v: &[f32]) -> Vec<u32> {
        // SAFETY: compiled with AVX2, called after detection.
        unsafe { rotations::<Avx2>(v) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn rotations_avx512(v: &[f32]) -> Vec<u32> {
        // SAFETY: compiled with AVX-512F, called after detection.
        unsafe { rotations::<Avx512>(v) }
    }

    /// `Simd::reduce_into` of `n` vectors against `Simd::reduce` of each, as bits.
    ///
    /// # Safety
    /// As [`rotations`].
    #[inline(always)]
    unsafe fn reduce_into_matches<S: Simd>(x: &[f32], n: usize) -> bool {
        // SAFETY: `x` holds n * LANES floats; the instruction set is the caller's.
        unsafe {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(S::load(x.as_ptr().add(i * S::LANES)));
            }
            let mut out = vec![f32::NAN; n];
            S::reduce_into(&v, &mut out);
            let mut same = true;
            for (vi, o) in v.iter().zip(&out) {
                same &= S::reduce(*vi).to_bits() == o.to_bits();
            }
            same
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce_into_avx2(x: &[f32], n: usize) -> bool {
        // SAFETY: compiled with AVX2, called after detection.
        unsafe { reduce_into_matches::<Avx2>(x, n) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn reduce_into_avx512(x: &[f32], n: usize) -> bool {
        // SAFETY: compiled with AVX-512F, called after detection.
        unsafe { reduce_into_matches::<Avx512>(x, n) }
    }

    /// The `mq` kernel's finish reduces a tile's accumulators together; every count (the
    /// tiles have 1 to 16, the transposition pads to whole groups) gives each vector's
    /// own sum, bit for bit.
    #[test]
    fn reduce_into_is_reduce_of_each() {
        for n in 1..=40 {
            let x = lanes(16 * n, n as u32);
            // SAFETY: the portable vectors need no instruction set.
            let portable = unsafe { reduce_into_matches::<Portable>(&x, n) };
            assert!(portable, "portable, {n}");
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: AVX2 and FMA detected.
                    assert!(unsafe { reduce_into_avx2(&x, n) }, "avx2, {n} vectors");
                }
                if std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: AVX-512F detected.
                    assert!(unsafe { reduce_into_avx512(&x, n) }, "avx512, {n} vectors");
                }
            }
        }
    }

    /// The `mq` kernel's aligned vectors leave each accumulator's lanes rotated and rely
    /// on `reduce` not seeing it; a tree that does not pair lanes a fixed distance apart
    /// would change the bits with where `M` lies.
    #[test]
    fn reduce_does_not_see_a_rotation() {
        for seed in 1..200 {
            let v = lanes(16, seed);
            // SAFETY: the portable vectors need no instruction set.
            let p = unsafe { rotations::<Portable>(&v[..8]) };
            assert!(p.iter().all(|&b| b == p[0]), "portable: {p:?}");
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: AVX2 and FMA detected.
                    let a = unsafe { rotations_avx2(&v[..8]) };
                    assert!(a.iter().all(|&b| b == a[0]), "avx2: {a:?}");
                    assert_eq!(a[0], p[0], "avx2 and portable trees differ");
                }
                if std::is_x86_feature_detected!("avx512f") {
                    // SAFETY: AVX-512F detected.
                    let a = unsafe { rotations_avx512(&v) };
                    assert!(a.iter().all(|&b| b == a[0]), "avx512: {a:?}");
                }
            }
        }
    }
}
