//! Single-threaded `f32` matrix products for [`Linear`](crate::cpu::Linear) on
//! [`CpuTensor`](crate::cpu::CpuTensor): `C (+)= A · B` on strided operands.
//!
//! Why not a library: a pipeline splits a batch into micro-batches of a few dozen rows,
//! and a general kernel tuned for large products loses much of its speed there. This
//! kernel lets the large operand (the weight) stream through broadcasts and packs only the
//! small one, so that a 32-row product runs nearly as fast per row as a 256-row one. Each
//! element of `C` is one chain of fused multiply-adds over `k` in order, so a row's result
//! does not depend on the other rows of the product, and a product split over `k` gives
//! bit for bit the unsplit one (`splits_exactly`). The bench's GEMM rows (`cargo bench
//! -p pipe --bench pipe`) measure it against `matrixmultiply` and the `gemm` crate on
//! Linear(1024, 1024) at 32 and 256 rows; on the AVX-512 bench machine (medians of 11
//! runs, GFLOP/s, ours / matrixmultiply / gemm): forward 91 / 62 / 89 and 92 / 77 / 91,
//! input gradient 89 / 33 / 18 and 100 / 73 / 65, weight gradient 80 / 63 / 80 and
//! 91 / 87 / 95. The input gradient is the kernel's clear win. The forward pass and the
//! weight gradient only tie with `gemm`; they stay here because with the forward on `gemm`
//! the pipelined step ran slower (presumably two workers each packing the whole weight per
//! micro-batch), and because the weight gradient's exact split is what lets a deferred
//! flush run as one product over every kept row, bit-identical to one product per
//! micro-batch, which `gemm` does not promise.
//!
//! With AVX-512F (detected at run time) the kernel below runs; elsewhere `ndarray`'s
//! `general_mat_mul`. The module is public (hidden from the docs) only for the bench,
//! which sets the kernel against `matrixmultiply` and the `gemm` crate, on either path
//! ([`force_portable`]).

use std::sync::atomic::{AtomicBool, Ordering};

use ndarray::linalg::general_mat_mul;
use ndarray::{ArrayView2, ArrayViewMut2, ShapeBuilder};

/// A read-only strided matrix: element `(i, j)` at `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

/// A writable strided matrix, row-major (`cs == 1`) or column-major (`rs == 1`).
#[derive(Debug)]
pub struct ViewMut<'a> {
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
pub fn gemm(a: View<'_>, b: View<'_>, c: ViewMut<'_>, accumulate: bool) {
    let Some(c) = check(a, b, c, accumulate) else {
        return;
    };
    #[cfg(target_arch = "x86_64")]
    {
        if kernel() {
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

/// [`gemm`]'s checks: panics on shapes that do not agree or operands outside their
/// slices; does the empty products (no rows or columns: nothing;
/// `k == 0`: `C = 0` unless accumulating) and returns `None` for them, else `C` back.
fn check<'c>(a: View<'_>, b: View<'_>, c: ViewMut<'c>, accumulate: bool) -> Option<ViewMut<'c>> {
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
        return None;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    c.data[i * c.rs + j * c.cs] = 0.0;
                }
            }
        }
        return None;
    }
    Some(c)
}

/// Whether [`gemm`] runs this module's kernel (AVX-512F), whose results do not depend on
/// how `k` is split: `C += A₁·B₁` then `C += A₂·B₂` gives bit for bit what one product over
/// the stacked operands gives (each element of `C` is one chain of multiply-adds over `k`
/// in order, stored and reloaded exactly in between). The fallback promises no such thing.
pub(crate) fn splits_exactly() -> bool {
    kernel()
}

/// Whether [`gemm`] runs this module's kernel (AVX-512F, not [`force_portable`]d): the
/// transposed forms `Linear` picks for few rows pay off only there.
pub fn has_kernel() -> bool {
    kernel()
}

/// Set by [`force_portable`].
static PORTABLE: AtomicBool = AtomicBool::new(false);

/// Runs the fallback from now on even where AVX-512F is present (`false`: detect again):
/// for the bench's `--isa avx2`, before any product runs (a deferred flush must see the
/// path its backward passes saw).
pub fn force_portable(on: bool) {
    PORTABLE.store(on, Ordering::Relaxed);
}

/// Whether [`gemm`] runs this module's AVX-512F kernel.
fn kernel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        !PORTABLE.load(Ordering::Relaxed) && avx512::available()
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
mod avx512;

#[cfg(test)]
mod tests;
