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
                    let x = _mm512_maskz_loadu_ps(mask(nw.saturating_sub(16 * v)), row.add(16 * v));
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
                // SAFETY: a prefetch reads nothing and cannot fault, whatever its address.
                // (`_mm_prefetch` is safe in AVX-512 code on current toolchains but unsafe
                // on the MSRV, 1.89: the block is for the MSRV.)
                #[allow(unused_unsafe)]
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add($rows - 1).cast());
                }
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
