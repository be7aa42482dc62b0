//! Single-threaded `f32` matrix products for [`Linear`](crate::Linear) on
//! [`CpuTensor`](crate::CpuTensor): `C (+)= A · B` on strided operands.
//!
//! Why not `ndarray`'s `dot` alone: a pipeline splits a batch into micro-batches of a few
//! dozen rows, and a general kernel tuned for large products loses much of its speed there
//! (matrixmultiply ran 32-row products of a 1024 × 1024 weight at about two thirds of its
//! 256-row speed on the bench machine, the `gemm` crate at about half), which eats the
//! pipeline's speedup. This kernel lets the large operand (the weight) stream through
//! broadcasts and packs only the small one, so that a 32-row product runs nearly as fast
//! per row as a 256-row one. Each element of `C` is one chain of fused multiply-adds over
//! `k` in order, so a row's result does not depend on the other rows of the product.
//!
//! With AVX-512F (detected at run time) the kernel below runs; elsewhere `ndarray`'s
//! `general_mat_mul`.

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2, ShapeBuilder};

/// A read-only strided matrix: element `(i, j)` at `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

/// A writable strided matrix, row-major (`cs == 1`) or column-major (`rs == 1`).
#[derive(Debug)]
pub(crate) struct ViewMut<'a> {
    pub data: &'a mut [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// A row-major `rows × cols` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        View {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose, without moving anything.
    pub fn t(self) -> Self {
        View {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    fn in_bounds(&self) -> bool {
        in_bounds(self.data.len(), self.rows, self.cols, self.rs, self.cs)
    }
}

impl<'a> ViewMut<'a> {
    /// A row-major `rows × cols` matrix.
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        ViewMut {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose, without moving anything.
    pub fn t(self) -> Self {
        ViewMut {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// Whether every element of a `rows × cols` matrix with strides `rs`, `cs` lies inside a
/// slice of `len` elements.
fn in_bounds(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    if rows == 0 || cols == 0 {
        return true;
    }
    let last = (rows - 1)
        .checked_mul(rs)
        .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)));
    last.is_some_and(|l| l < len)
}

/// `C = A · B`, or `C += A · B` with `accumulate`. Panics if the shapes do not agree, an
/// operand does not fit its slice, or `C` is neither row- nor column-major: callers
/// check shapes first and report them as errors.
pub(crate) fn gemm(a: View<'_>, b: View<'_>, c: ViewMut<'_>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(
        b.rows == k && c.rows == m && c.cols == n,
        "gemm: shapes do not agree"
    );
    assert!(
        a.in_bounds() && b.in_bounds(),
        "gemm: operand outside its slice"
    );
    assert!(
        in_bounds(c.data.len(), m, n, c.rs, c.cs) && (c.cs == 1 || c.rs == 1),
        "gemm: output outside its slice, or neither row- nor column-major"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    c.data[i * c.rs + j * c.cs] = 0.0;
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if avx512::available() {
            // SAFETY: AVX-512F is present (checked at run time); every element of A, B
            // and C the kernel touches (rows 0..m, columns 0..k of A; 0..k, 0..n of B;
            // 0..m, 0..n of C) lies inside its slice (checked above); C is row- or
            // column-major (checked above) and does not alias A or B (`c.data` is
            // borrowed mutably, `a.data` and `b.data` shared).
            unsafe { avx512::gemm(a, b, c, accumulate) };
            return;
        }
    }
    fallback(a, b, c, accumulate);
}

/// Whether [`gemm`] runs this module's kernel (AVX-512F), whose results do not depend on
/// how `k` is split: `C += A₁·B₁` then `C += A₂·B₂` gives bit for bit what one product over
/// the stacked operands gives (each element of `C` is one chain of multiply-adds over `k`
/// in order, stored and reloaded exactly in between). The fallback promises no such thing.
pub(crate) fn splits_exactly() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Writes the transpose of the row-major `rows × cols` matrix `src` into `dst` as a
/// row-major `cols × rows` matrix whose rows are `ld` apart (`dst[j·ld + i] = src[i·cols + j]`),
/// in square blocks so that both sides stay in cache. Panics if a slice is too short or
/// `ld < rows`.
pub(crate) fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut [f32], ld: usize) {
    const BLOCK: usize = 32;
    assert!(
        ld >= rows,
        "transpose: leading dimension below the row count"
    );
    if rows == 0 || cols == 0 {
        return;
    }
    let src = &src[..rows * cols];
    let dst = &mut dst[..(cols - 1) * ld + rows];
    for i0 in (0..rows).step_by(BLOCK) {
        for j0 in (0..cols).step_by(BLOCK) {
            for i in i0..rows.min(i0 + BLOCK) {
                let row = &src[i * cols..(i + 1) * cols];
                for j in j0..cols.min(j0 + BLOCK) {
                    dst[j * ld + i] = row[j];
                }
            }
        }
    }
}

/// `ndarray`'s product, for machines without AVX-512F.
fn fallback(a: View<'_>, b: View<'_>, c: ViewMut<'_>, accumulate: bool) {
    fn view(v: View<'_>) -> ArrayView2<'_, f32> {
        ArrayView2::from_shape((v.rows, v.cols).strides((v.rs, v.cs)), v.data)
            .expect("checked in bounds")
    }
    let len = (c.rows - 1) * c.rs + (c.cols - 1) * c.cs + 1;
    let mut out =
        ArrayViewMut2::from_shape((c.rows, c.cols).strides((c.rs, c.cs)), &mut c.data[..len])
            .expect("checked in bounds");
    let beta = if accumulate { 1.0 } else { 0.0 };
    general_mat_mul(1.0, &view(a), &view(b), beta, &mut out);
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The AVX-512F kernel. `C` is computed in panels of `16·NV` columns; for each panel
    //! and each block of `KC` rows of `B`, the block is packed (zero-padded, transposed
    //! 16 × 16 at a time when `B` is stored by columns) into an aligned buffer, and a
    //! register tile of `R` rows × `NV` vectors of `C` runs over it, broadcasting `A`'s
    //! elements straight from `A`. A column-major `C` is loaded and stored through
    //! 16 × 16 transposes. Edges use masked loads and stores. With a single block of
    //! `k` every panel is packed first and `C` is swept row block by row block, in its
    //! own memory order (the weight gradient, read and written once per product, is then
    //! streamed instead of revisited panel by panel).

    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    use super::{View, ViewMut};

    /// Rows of `B` per packed block: at most `KC × 64` floats (256 KiB) stay in L2 while
    /// every row tile of `C` passes over them. A `k` of up to 1024 (a `Linear(1024, ·)`)
    /// is one block: with 256 the 32-row products ran at 100–105 GFLOP/s on the bench
    /// machine, with 1024 at 125–138 (fewer passes over `C`, each through transposes
    /// when `C` is stored by columns, and longer runs along `A`'s rows).
    const KC: usize = 1024;
    /// Up to this `k` (a weight gradient's, the rows of a batch) `C` is swept row block by
    /// row block in its own memory order.
    const SWEEP_MAX_K: usize = 256;
    /// Rows of `B` per block when `C` is swept row block by row block (a short `k`).
    const SWEEP_KC: usize = 128;
    /// How many steps of `k` ahead the kernel prefetches `A` when its `k` stride is long.
    const PREFETCH: usize = 16;

    pub(super) fn available() -> bool {
        static AVX512: OnceLock<bool> = OnceLock::new();
        *AVX512.get_or_init(|| is_x86_feature_detected!("avx512f"))
    }

    /// A 64-byte aligned vector of packed `B`.
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Lane([f32; 16]);

    thread_local! {
        /// Each thread's pack buffer, kept between products: a fresh one per product
        /// cost page faults (zeroing new pages) every time the allocator had returned
        /// the memory to the system.
        static PACK: std::cell::Cell<Vec<Lane>> = const { std::cell::Cell::new(Vec::new()) };
    }

    /// A thread's pack buffer, taken for one product and given back when dropped.
    struct PackBuffer(Vec<Lane>);

    impl PackBuffer {
        /// At least `lanes` lanes. Every pack row is written in full (padding included)
        /// before it is read, so old contents never show.
        fn take(lanes: usize) -> Self {
            let mut buffer = PACK.with(|p| p.take());
            if buffer.len() < lanes {
                buffer = vec![Lane([0.0; 16]); lanes];
            }
            PackBuffer(buffer)
        }

        fn as_mut_ptr(&mut self) -> *mut f32 {
            self.0.as_mut_ptr().cast()
        }
    }

    impl Drop for PackBuffer {
        fn drop(&mut self) {
            let buffer = std::mem::take(&mut self.0);
            PACK.with(|p| p.set(buffer));
        }
    }

    fn mask(lanes: usize) -> u16 {
        ((1u32 << lanes.min(16)) - 1) as u16
    }

    /// # Safety
    ///
    /// AVX-512F is available; every element of `a`, `b` and `c` lies inside its slice;
    /// `c` is row-major (`cs == 1`) or column-major (`rs == 1`); the shapes agree and
    /// are positive.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gemm(a: View<'_>, b: View<'_>, c: ViewMut<'_>, accumulate: bool) {
        if b.cols <= 16 {
            // One vector per row of the tile: a 32-wide tile would leave half its lanes
            // masked (16-row micro-batches ran at about 72 GFLOP/s that way).
            // SAFETY: the caller's contract, passed on unchanged.
            unsafe { panels::<16, 1>(a, b, c, accumulate) }
        } else if b.cols <= 32 {
            // SAFETY: the caller's contract, passed on unchanged.
            unsafe { panels::<12, 2>(a, b, c, accumulate) }
        } else {
            // SAFETY: the caller's contract, passed on unchanged.
            unsafe { panels::<6, 4>(a, b, c, accumulate) }
        }
    }

    /// # Safety
    ///
    /// As [`gemm`]; `R <= 16` and `NV <= 4`.
    #[target_feature(enable = "avx512f")]
    unsafe fn panels<const R: usize, const NV: usize>(
        a: View<'_>,
        b: View<'_>,
        c: ViewMut<'_>,
        accumulate: bool,
    ) {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let width = 16 * NV;
        let column_major = c.cs != 1;
        let (c_rs, c_cs) = (c.rs, c.cs);
        let c_ptr = c.data.as_mut_ptr();
        let at = |i: usize, j: usize| c_ptr.wrapping_add(i * c_rs + j * c_cs);
        let masks_of = |j0: usize| {
            let nw = width.min(n - j0);
            let mut masks = [0u16; 4];
            for (v, m) in masks.iter_mut().enumerate().take(NV) {
                *m = mask(nw.saturating_sub(16 * v));
            }
            (nw, masks)
        };
        let row_blocks = (0..m).step_by(R).map(|i0| (i0, R.min(m - i0)));
        if k <= SWEEP_MAX_K {
            // A short k (a weight gradient's is the micro-batch's rows): for each block of
            // at most SWEEP_KC rows of B, pack every panel first (it stays in L2), then
            // sweep C row block by row block, so that C streams through in its own order
            // (the weight gradient, read and written once per block, is the largest
            // operand) instead of being revisited panel by panel.
            let panels = n.div_ceil(width);
            let block = SWEEP_KC.min(k);
            let mut buffer = PackBuffer::take(panels * block * NV);
            let pack = buffer.as_mut_ptr();
            for k0 in (0..k).step_by(block) {
                let kc = block.min(k - k0);
                for p in 0..panels {
                    let (nw, _) = masks_of(p * width);
                    // SAFETY: rows k0..k0 + kc and columns p·width..p·width + nw of B are
                    // inside its slice; panel p of the pack holds kc aligned rows of
                    // `width` floats.
                    unsafe { pack_block::<NV>(b, k0, kc, p * width, nw, pack.add(p * kc * width)) };
                }
                for (i0, rows) in row_blocks.clone() {
                    for p in 0..panels {
                        let j0 = p * width;
                        let tile = Tile {
                            kc,
                            a: a.data.as_ptr().wrapping_add(i0 * a.rs + k0 * a.cs),
                            a_rs: a.rs,
                            a_cs: a.cs,
                            b: pack.wrapping_add(p * kc * width).cast_const(),
                            c: at(i0, j0),
                            c_rs,
                            c_cs,
                            load: accumulate || k0 > 0,
                            masks: masks_of(j0).1,
                        };
                        // SAFETY: the tile's rows of A over its kc steps are inside A's
                        // slice; the same rows of C, in the lanes the masks allow, are
                        // inside C; its pack holds kc rows of `width` floats;
                        // rows <= R <= 16.
                        unsafe { tile.run_any::<R, NV>(rows, column_major) };
                    }
                }
            }
            return;
        }
        // Several blocks of k: panel by panel, block by block, each block packed once
        // and used by every row block of C.
        let mut buffer = PackBuffer::take(KC * NV);
        let pack = buffer.as_mut_ptr();
        for j0 in (0..n).step_by(width) {
            let (nw, masks) = masks_of(j0);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                // SAFETY: rows k0..k0 + kc and columns j0..j0 + nw of B are inside its
                // slice (kc and nw are clamped to k and n); the pack holds KC >= kc
                // aligned rows of `width` floats.
                unsafe { pack_block::<NV>(b, k0, kc, j0, nw, pack) };
                let load = accumulate || k0 > 0;
                for (i0, rows) in row_blocks.clone() {
                    let tile = Tile {
                        kc,
                        a: a.data.as_ptr().wrapping_add(i0 * a.rs + k0 * a.cs),
                        a_rs: a.rs,
                        a_cs: a.cs,
                        b: pack.cast_const(),
                        c: at(i0, j0),
                        c_rs,
                        c_cs,
                        load,
                        masks,
                    };
                    // SAFETY: the tile's rows of A over its kc steps are inside A's slice; the
                    // same rows of C, in the lanes the masks allow, are inside C; its pack
                    // holds kc rows of `width` floats; rows <= R <= 16.
                    unsafe { tile.run_any::<R, NV>(rows, column_major) };
                }
            }
        }
    }

    /// Copies rows `k0..k0 + kc`, columns `j0..j0 + nw` of `b` into `pack` (row stride
    /// `16·NV`), zero-padding the columns past `nw`.
    ///
    /// # Safety
    ///
    /// AVX-512F is available; those elements of `b` are inside its slice; `pack` holds
    /// `kc` aligned rows of `16·NV` floats.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_block<const NV: usize>(
        b: View<'_>,
        k0: usize,
        kc: usize,
        j0: usize,
        nw: usize,
        pack: *mut f32,
    ) {
        let width = 16 * NV;
        let base = b.data.as_ptr();
        if b.cs == 1 {
            for kk in 0..kc {
                let row = base.wrapping_add((k0 + kk) * b.rs + j0);
                for v in 0..NV {
                    // SAFETY: the masked load reads only columns below nw of row
                    // k0 + kk, inside B; the store is to an aligned lane of pack row kk.
                    unsafe {
                        let x =
                            _mm512_maskz_loadu_ps(mask(nw.saturating_sub(16 * v)), row.add(16 * v));
                        _mm512_store_ps(pack.add(kk * width + 16 * v), x);
                    }
                }
            }
        } else if b.rs == 1 {
            // B is stored by columns: column j0 + jj holds rows k0.. contiguously. Read
            // 16 columns × 16 rows, transpose, store 16 pack rows.
            for kb in (0..kc).step_by(16) {
                let rows = mask(kc - kb);
                for v in 0..NV {
                    let mut block = [_mm512_setzero_ps(); 16];
                    for (jj, x) in block.iter_mut().enumerate() {
                        let j = 16 * v + jj;
                        if j < nw {
                            let col = base.wrapping_add((j0 + j) * b.cs + k0 + kb);
                            // SAFETY: rows k0 + kb .. k0 + kb + 16 (masked to below
                            // k0 + kc) of column j0 + j < n, inside B.
                            *x = unsafe { _mm512_maskz_loadu_ps(rows, col) };
                        }
                    }
                    transpose16(&mut block);
                    for (kk, x) in block.iter().enumerate().take(kc - kb) {
                        // SAFETY: pack row kb + kk < kc, aligned lane v.
                        unsafe { _mm512_store_ps(pack.add((kb + kk) * width + 16 * v), *x) };
                    }
                }
            }
        } else {
            for kk in 0..kc {
                for jj in 0..width {
                    let value = if jj < nw {
                        b.data[(k0 + kk) * b.rs + (j0 + jj) * b.cs]
                    } else {
                        0.0
                    };
                    // SAFETY: jj < width, inside pack row kk < kc.
                    unsafe { *pack.add(kk * width + jj) = value };
                }
            }
        }
    }

    /// Transposes a 16 × 16 block held as 16 rows.
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: &mut [__m512; 16]) {
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for i in 0..4 {
            let b = 4 * i;
            u[b] = _mm512_shuffle_ps::<0x44>(t[b], t[b + 2]);
            u[b + 1] = _mm512_shuffle_ps::<0xEE>(t[b], t[b + 2]);
            u[b + 2] = _mm512_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
            u[b + 3] = _mm512_shuffle_ps::<0xEE>(t[b + 1], t[b + 3]);
        }
        let mut v = [_mm512_setzero_ps(); 16];
        for h in 0..2 {
            let b = 8 * h;
            for i in 0..4 {
                v[b + i] = _mm512_shuffle_f32x4::<0x88>(u[b + i], u[b + 4 + i]);
                v[b + 4 + i] = _mm512_shuffle_f32x4::<0xDD>(u[b + i], u[b + 4 + i]);
            }
        }
        for i in 0..8 {
            r[i] = _mm512_shuffle_f32x4::<0x88>(v[i], v[8 + i]);
            r[8 + i] = _mm512_shuffle_f32x4::<0xDD>(v[i], v[8 + i]);
        }
    }

    /// The multiply-adds of a tile: `acc[r][v] += A[r][k] · pack[k][v]` for every `k`.
    ///
    /// Safety, for the caller: AVX-512F is available; rows `0..ROWS` of the tile's `a`
    /// (stride `a_rs`) over `kc` steps (stride `a_cs`) are readable; its `b` holds `kc`
    /// aligned rows of `16·NV` floats.
    macro_rules! multiply_add {
        ($tile:expr, $acc:ident, $rows:expr, $nv:expr) => {{
            let t = $tile;
            let width = 16 * $nv;
            let prefetch_a = t.a_rs == 1 && t.a_cs > 16;
            for k in 0..t.kc {
                let mut bv = [_mm512_setzero_ps(); $nv];
                for (v, x) in bv.iter_mut().enumerate() {
                    // SAFETY: row k < kc of the pack, aligned, `width` floats long.
                    *x = unsafe { _mm512_load_ps(t.b.add(k * width + 16 * v)) };
                }
                let ak = t.a.wrapping_add(k * t.a_cs);
                // A prefetch is a hint: it never faults, and its address is computed with
                // wrapping arithmetic, so it may point past A's slice.
                if prefetch_a {
                    let ahead = ak.wrapping_add(PREFETCH * t.a_cs);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add($rows - 1).cast());
                }
                for (r, row) in $acc.iter_mut().enumerate() {
                    // SAFETY: element (r, k) of the tile's A, inside A's slice.
                    let x = unsafe { *ak.wrapping_add(r * t.a_rs) };
                    let av = _mm512_set1_ps(x);
                    for (v, y) in row.iter_mut().enumerate() {
                        *y = _mm512_fmadd_ps(av, bv[v], *y);
                    }
                }
            }
        }};
    }

    /// One register tile of `C`: rows from `c` over `kc` steps of `k`, `16·NV` columns.
    struct Tile {
        kc: usize,
        a: *const f32,
        a_rs: usize,
        a_cs: usize,
        b: *const f32,
        c: *mut f32,
        c_rs: usize,
        c_cs: usize,
        load: bool,
        masks: [u16; 4],
    }

    impl Tile {
        /// [`multiply_add!`] out of line, for the column-major tile: on its own the
        /// accumulators stay in registers for the whole loop, where inlined next to the
        /// tile's transposes they were spilled and every multiply-add went through memory
        /// (half the speed). The row-major tile, short of registers only in the loop,
        /// keeps the loop inline and saves the copies in and out.
        ///
        /// # Safety
        ///
        /// As [`multiply_add!`].
        #[target_feature(enable = "avx512f")]
        #[inline(never)]
        unsafe fn multiply_add<const ROWS: usize, const NV: usize>(
            &self,
            acc: &mut [[__m512; NV]; ROWS],
        ) {
            let mut regs = *acc;
            multiply_add!(self, regs, ROWS, NV);
            *acc = regs;
        }

        /// A tile of `rows` rows (`1..=16`; `R`, the full tile, comes first).
        ///
        /// # Safety
        ///
        /// AVX-512F is available; rows `0..rows` of the tile's `a` (stride `a_rs`) over
        /// `kc` steps (stride `a_cs`) are readable; its `b` holds `kc` aligned rows of
        /// `16·NV` floats; rows `0..rows` of `c` are writable in the lanes the masks
        /// allow; `rows <= 16`.
        #[target_feature(enable = "avx512f")]
        unsafe fn run_any<const R: usize, const NV: usize>(&self, rows: usize, column_major: bool) {
            if rows == R {
                // SAFETY: the caller's contract with ROWS == R.
                unsafe {
                    if column_major {
                        self.run_columns::<R, NV>()
                    } else {
                        self.run_rows::<R, NV>()
                    }
                }
                return;
            }
            macro_rules! go {
                ($($r:literal)*) => {
                    match rows {
                        $($r => {
                            // SAFETY: the caller's contract with ROWS == rows.
                            unsafe {
                                if column_major {
                                    self.run_columns::<$r, NV>()
                                } else {
                                    self.run_rows::<$r, NV>()
                                }
                            }
                        })*
                        _ => {}
                    }
                };
            }
            go!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        }

        /// The tile on a row-major `C`.
        ///
        /// # Safety
        ///
        /// As [`run_any`](Tile::run_any).
        #[target_feature(enable = "avx512f")]
        unsafe fn run_rows<const ROWS: usize, const NV: usize>(&self) {
            let mut acc = [[_mm512_setzero_ps(); NV]; ROWS];
            if self.load {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (v, x) in row.iter_mut().enumerate() {
                        let p = self.c.wrapping_add(r * self.c_rs + 16 * v);
                        // SAFETY: the lanes the mask allows are inside row r of C.
                        *x = unsafe { _mm512_maskz_loadu_ps(self.masks[v], p) };
                    }
                }
            }
            multiply_add!(self, acc, ROWS, NV);
            for (r, row) in acc.iter().enumerate() {
                for (v, x) in row.iter().enumerate() {
                    let p = self.c.wrapping_add(r * self.c_rs + 16 * v);
                    // SAFETY: as for the loads.
                    unsafe { _mm512_mask_storeu_ps(p, self.masks[v], *x) };
                }
            }
        }

        /// The tile on a column-major `C`: each 16-column vector of the tile's rows is
        /// transposed to and from 16 columns of at most 16 contiguous rows.
        ///
        /// # Safety
        ///
        /// As [`run_any`](Tile::run_any); `ROWS <= 16`.
        #[target_feature(enable = "avx512f")]
        unsafe fn run_columns<const ROWS: usize, const NV: usize>(&self) {
            let rows = mask(ROWS);
            let mut acc = [[_mm512_setzero_ps(); NV]; ROWS];
            if self.load {
                for v in 0..NV {
                    let mut block = [_mm512_setzero_ps(); 16];
                    for (l, x) in block.iter_mut().enumerate() {
                        if self.masks[v] & (1 << l) != 0 {
                            let p = self.c.wrapping_add((16 * v + l) * self.c_cs);
                            // SAFETY: column 16v + l of the tile is a valid column, and
                            // its rows 0..ROWS are inside C.
                            *x = unsafe { _mm512_maskz_loadu_ps(rows, p) };
                        }
                    }
                    transpose16(&mut block);
                    for (r, row) in acc.iter_mut().enumerate() {
                        row[v] = block[r];
                    }
                }
            }
            // SAFETY: the caller's contract.
            unsafe { self.multiply_add::<ROWS, NV>(&mut acc) };
            for v in 0..NV {
                let mut block = [_mm512_setzero_ps(); 16];
                for (r, row) in acc.iter().enumerate() {
                    block[r] = row[v];
                }
                transpose16(&mut block);
                for (l, x) in block.iter().enumerate() {
                    if self.masks[v] & (1 << l) != 0 {
                        let p = self.c.wrapping_add((16 * v + l) * self.c_cs);
                        // SAFETY: as for the loads.
                        unsafe { _mm512_mask_storeu_ps(p, rows, *x) };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: View<'_>, b: View<'_>, c: &mut ViewMut<'_>, accumulate: bool) {
        for i in 0..a.rows {
            for j in 0..b.cols {
                let mut s = 0.0f64;
                for k in 0..a.cols {
                    s += f64::from(a.data[i * a.rs + k * a.cs])
                        * f64::from(b.data[k * b.rs + j * b.cs]);
                }
                let out = &mut c.data[i * c.rs + j * c.cs];
                *out = if accumulate {
                    *out + s as f32
                } else {
                    s as f32
                };
            }
        }
    }

    fn values(len: usize, salt: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7 + salt * 13) % 17) as f32 / 8.0 - 1.0)
            .collect()
    }

    type Product = fn(View<'_>, View<'_>, ViewMut<'_>, bool);

    /// Every combination of operand layouts and accumulation, against a naive product;
    /// elements of C outside the product (padding) must be left alone.
    fn check(product: Product, shapes: &[(usize, usize, usize)]) {
        for &(m, k, n) in shapes {
            for layout in 0..8 {
                let (ta, tb, tc) = (layout & 1 != 0, layout & 2 != 0, layout & 4 != 0);
                for accumulate in [false, true] {
                    let (ad, bd) = (values(m * k, 1), values(k * n, 2));
                    let a = if ta {
                        View::row_major(&ad, k, m).t()
                    } else {
                        View::row_major(&ad, m, k)
                    };
                    let b = if tb {
                        View::row_major(&bd, n, k).t()
                    } else {
                        View::row_major(&bd, k, n)
                    };
                    // C with a padded leading dimension.
                    let (outer, inner) = if tc { (n, m + 3) } else { (m, n + 3) };
                    let start = values(outer * inner, 3);
                    let (mut got, mut want) = (start.clone(), start.clone());
                    let (rs, cs) = if tc { (1, inner) } else { (inner, 1) };
                    let c = |data| ViewMut {
                        data,
                        rows: m,
                        cols: n,
                        rs,
                        cs,
                    };
                    product(a, b, c(&mut got), accumulate);
                    naive(a, b, &mut c(&mut want), accumulate);
                    for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
                        let case = format!(
                            "({m}, {k}, {n}) layout {layout} accumulate {accumulate} at {idx}"
                        );
                        if idx % inner >= if tc { m } else { n } {
                            assert_eq!(g, w, "padding touched, {case}");
                        } else {
                            assert!(
                                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                                "{g} vs {w}, {case}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_shape_layout_and_edge_matches_a_naive_product() {
        check(
            gemm,
            &[
                (1, 1, 1),
                (3, 5, 7),
                (12, 16, 32),
                (13, 17, 33),
                (32, 40, 64),
                (7, 300, 65),
                (25, 257, 100),
                (6, 3, 130),
                (17, 33, 16),
                // One-vector tiles (n <= 16) with full and partial 16-row blocks, and a
                // k past one packed block (KC) on each tile width.
                (40, 20, 9),
                (35, 1030, 16),
                (13, 1100, 30),
                (7, 1025, 70),
            ],
        );
    }

    /// The path for machines without AVX-512F, run here whatever the machine.
    #[test]
    fn the_fallback_matches_a_naive_product() {
        check(fallback, &[(1, 1, 1), (9, 20, 13), (4, 3, 40)]);
    }

    #[test]
    fn a_row_does_not_depend_on_the_other_rows() {
        let (m, k, n) = (37, 130, 70);
        let (ad, bd) = (values(m * k, 4), values(k * n, 5));
        let b = View::row_major(&bd, k, n);
        let mut whole = vec![0.0; m * n];
        gemm(
            View::row_major(&ad, m, k),
            b,
            ViewMut::row_major(&mut whole, m, n),
            false,
        );
        for (start, rows) in [(0, 5), (5, 12), (17, 20)] {
            let mut part = vec![0.0; rows * n];
            let a = View::row_major(&ad[start * k..(start + rows) * k], rows, k);
            gemm(a, b, ViewMut::row_major(&mut part, rows, n), false);
            assert_eq!(part, whole[start * n..(start + rows) * n], "rows {start}..");
        }
    }

    #[test]
    fn transpose_moves_every_element() {
        for (rows, cols) in [(1, 1), (3, 70), (33, 32), (64, 5)] {
            let src = values(rows * cols, 6);
            let ld = rows + 3;
            let mut dst = vec![-7.0; cols * ld];
            transpose(&src, rows, cols, &mut dst, ld);
            for j in 0..cols {
                for i in 0..ld {
                    let want = if i < rows { src[i * cols + j] } else { -7.0 };
                    assert_eq!(dst[j * ld + i], want, "{rows} x {cols} at ({j}, {i})");
                }
            }
        }
    }

    /// What deferred weight gradients rely on: with the AVX-512 kernel, products over
    /// consecutive blocks of `k` accumulated one after another equal one product over all
    /// of `k`, bit for bit.
    #[test]
    fn split_k_accumulates_exactly() {
        if !splits_exactly() {
            return;
        }
        let (m, n) = (40, 70);
        for ks in [&[32usize, 32, 32][..], &[7, 130, 1], &[256, 200]] {
            let k: usize = ks.iter().sum();
            let (ad, bd) = (values(k * m, 7), values(k * n, 8));
            // A = Xᵀ for a row-major X of k rows, as a weight gradient's.
            let start = values(m * n, 9);
            let mut whole = start.clone();
            gemm(
                View::row_major(&ad, k, m).t(),
                View::row_major(&bd, k, n),
                ViewMut::row_major(&mut whole, m, n),
                true,
            );
            let mut parts = start;
            let mut k0 = 0;
            for &kk in ks {
                gemm(
                    View::row_major(&ad[k0 * m..(k0 + kk) * m], kk, m).t(),
                    View::row_major(&bd[k0 * n..(k0 + kk) * n], kk, n),
                    ViewMut::row_major(&mut parts, m, n),
                    true,
                );
                k0 += kk;
            }
            assert_eq!(whole, parts, "k split as {ks:?}");
        }
    }

    #[test]
    fn no_inner_dimension_zeroes_or_keeps() {
        let mut c = vec![5.0; 6];
        let (a, b) = (View::row_major(&[], 2, 0), View::row_major(&[], 0, 3));
        gemm(a, b, ViewMut::row_major(&mut c, 2, 3), true);
        assert_eq!(c, vec![5.0; 6]);
        gemm(a, b, ViewMut::row_major(&mut c, 2, 3), false);
        assert_eq!(c, vec![0.0; 6]);
    }
}
