//! Bit-for-bit checks of `mtp`'s walks against each other: the row streams against the
//! strips, and `Q` through the scratch against `Q` in place.

use super::scratch::{q_near_m, Q_NEAR_M_BYTES};
use super::*;
use crate::cpu::simd::Portable;

/// `M`'s rows at `off` floats into a buffer, the matrix behind [`Mat`].
struct Case {
    m: Vec<f32>,
    p: Vec<f32>,
    n: usize,
    cols: usize,
    r: usize,
    off: usize,
}

impl Case {
    fn new(n: usize, cols: usize, r: usize, off: usize) -> Case {
        let val = crate::cpu::kernels::test_value;
        Case {
            m: (0..n * cols + off).map(|i| val(i, 1)).collect(),
            p: (0..n * r).map(|i| val(i, 7)).collect(),
            n,
            cols,
            r,
            off,
        }
    }

    /// `Q` from `kernel` over all columns.
    fn run(&mut self, kernel: Kernel) -> Vec<f32> {
        self.run_on(kernel, 0..self.cols)
    }

    /// The case's matrix with `Q` in `q`.
    fn mat(&mut self, q: &mut [f32]) -> Mat {
        assert_eq!(q.len(), self.r * self.cols);
        Mat {
            m: self.m[self.off..].as_mut_ptr(),
            e: std::ptr::null_mut(),
            p: self.p.as_mut_ptr(),
            q: q.as_mut_ptr(),
            n: self.n,
            cols: self.cols,
            r: self.r,
        }
    }

    /// `Q` from `kernel` over the columns `cols` (NaN elsewhere).
    fn run_on(&mut self, kernel: Kernel, cols: Range<usize>) -> Vec<f32> {
        let mut q = vec![f32::NAN; self.r * self.cols];
        let a = self.mat(&mut q);
        // SAFETY: `a` points at buffers of its shape, alive and not shared; `cols`
        // lies inside its columns.
        unsafe { kernel(&a, cols) };
        q
    }

    /// [`Case::run_on`] with `kernel` writing a [`QScratch`], copied out.
    fn run_through_scratch(&mut self, kernel: Kernel, cols: Range<usize>) -> Vec<f32> {
        let mut q = vec![f32::NAN; self.r * self.cols];
        let a = self.mat(&mut q);
        let far = QScratch::new(&a).expect("a small allocation");
        // SAFETY: as in `run_on`; the scratch holds every index `a` names in `Q`.
        unsafe {
            kernel(&far.mat, cols.clone());
            far.copy_to(&a, cols);
        }
        q
    }
}

/// A kernel over the columns of a matrix.
type Kernel = unsafe fn(&Mat, Range<usize>);

unsafe fn stream_portable(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded.
    unsafe { mtp_stream::<Portable>(a, cols) }
}

unsafe fn strips_portable(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded.
    unsafe { strips_as_portable(a, cols, sweeps_in_memory_order(a)) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn stream_avx2(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_stream::<crate::cpu::simd::Avx2>(a, cols) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn strips_avx2(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { strips_as_avx2(a, cols, sweeps_in_memory_order(a)) }
}

unsafe fn one_row_portable(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded.
    unsafe { mtp_stream_one_row::<Portable>(a, cols) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn one_row_avx2(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_stream_one_row::<crate::cpu::simd::Avx2>(a, cols) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn one_row_avx512(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_stream_one_row::<crate::cpu::simd::Avx512>(a, cols) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn stream_avx512(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_stream::<crate::cpu::simd::Avx512>(a, cols) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn stream_near_avx512(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_stream_as::<crate::cpu::simd::Avx512>(a, cols, true) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn strips_avx512(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { strips_as_avx512(a, cols, sweeps_in_memory_order(a)) }
}

/// The strips ([`mtp_strips_as`]) with the sweep in memory order or by rows: one copy a
/// instruction set (each is the whole walk), which the kernels below share.
#[inline(never)]
unsafe fn strips_as_portable(a: &Mat, cols: Range<usize>, linear: bool) {
    // SAFETY: forwarded.
    unsafe { mtp_strips_as::<Portable>(a, cols, linear) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn strips_as_avx2(a: &Mat, cols: Range<usize>, linear: bool) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_strips_as::<crate::cpu::simd::Avx2>(a, cols, linear) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn strips_as_avx512(a: &Mat, cols: Range<usize>, linear: bool) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_strips_as::<crate::cpu::simd::Avx512>(a, cols, linear) }
}

unsafe fn strips_rows_portable(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded.
    unsafe { strips_as_portable(a, cols, false) }
}

unsafe fn strips_linear_portable(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded.
    unsafe { strips_as_portable(a, cols, true) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn strips_rows_avx2(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { strips_as_avx2(a, cols, false) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn strips_linear_avx2(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { strips_as_avx2(a, cols, true) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn strips_rows_avx512(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { strips_as_avx512(a, cols, false) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn strips_linear_avx512(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { strips_as_avx512(a, cols, true) }
}

/// The sweep in memory order and by rows ([`Sweep`]) give the bits of the row stream, on
/// every instruction set the machine has, in calls that sweep (1 MiB or more of `M`;
/// the stream, which sweeps its own way, the reference): ranks of one tile and of
/// several (where only the first sweeps), part vectors at every offset class, ragged
/// columns, and a thread's share of the columns (a panel narrower than the rows, which
/// memory order walks row by row). In debug builds the memory-order addresses' arithmetic
/// is checked for overflow on every prefetch.
#[test]
fn the_sweep_in_memory_order_gives_the_bits_of_the_stream() {
    let mut kernels: Vec<(&str, Kernel, Kernel, Kernel)> = vec![(
        "portable",
        stream_portable,
        strips_rows_portable,
        strips_linear_portable,
    )];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        kernels.push(("avx2", stream_avx2, strips_rows_avx2, strips_linear_avx2));
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
        kernels.push((
            "avx512",
            stream_avx512,
            strips_rows_avx512,
            strips_linear_avx512,
        ));
    }
    for (n, cols, r, share) in [
        (72, 4111, 8, 0..4111),
        (48, 8200, 6, 1000..7013),
        (64, 4111, 4, 0..4111),
        (300, 1000, 1, 0..1000),
    ] {
        for off in [0, 4, 13] {
            let mut case = Case::new(n, cols, r, off);
            for &(isa, stream, rows, linear) in &kernels {
                let want = case.run_on(stream, share.clone());
                for (walk, kernel) in [("by rows", rows), ("in memory order", linear)] {
                    let got = case.run_on(kernel, share.clone());
                    assert!(
                        want.iter()
                            .zip(&got)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{isa} {n} x {cols}, r = {r}, columns {share:?}, offset {off}: the \
                         sweep {walk} differs from the stream"
                    );
                }
            }
        }
    }
}

/// The one-row stream at rank 1 ([`mtp_stream_one_row`], which
/// [`takes_one_row_stream`] takes on some cores) gives the bits of the strips, on
/// every instruction set the machine has: with and without edges (every offset class
/// from a vector boundary), ragged columns, rows shorter than a vector, column ranges
/// that start inside a row (as a thread's do), blocks in cache and sweeping.
#[test]
fn the_one_row_stream_gives_the_bits_of_the_strips() {
    let kernels = supported_isas!(
        (Kernel, Kernel);
        (one_row_portable, strips_portable),
        (one_row_avx2, strips_avx2),
        (one_row_avx512, strips_avx512)
    );
    for (n, cols) in [
        (70, 1024),
        (9, 4111),
        (13, 48),
        (6, 7),
        (300, 1024),
        (40, 1000),
    ] {
        for off in [0, 1, 3, 4, 8, 12, 15] {
            let mut case = Case::new(n, cols, 1, off);
            for &(isa, (one, strips)) in &kernels {
                for range in [0..cols, cols / 3..cols] {
                    let (a, b) = (
                        case.run_on(one, range.clone()),
                        case.run_on(strips, range.clone()),
                    );
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{isa} {n} x {cols}, offset {off}, columns {range:?}: the one-row \
                         stream and the strips differ"
                    );
                }
            }
        }
    }
}

unsafe fn cols_in_portable(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded.
    unsafe { mtp_cols_in::<Portable>(a, cols) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn cols_in_avx2(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_cols_in::<crate::cpu::simd::Avx2>(a, cols) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn cols_in_avx512(a: &Mat, cols: Range<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { mtp_cols_in::<crate::cpu::simd::Avx512>(a, cols) }
}

/// `Q` written through the scratch ([`QScratch`], which [`mtp_cols`] takes on some
/// cores where `Q` lies near `M`) holds the bits of `Q` written in place, and only
/// the call's columns: on every instruction set the machine has, for whichever
/// walk this core takes (strips, stream), over all columns and over a thread's
/// share (whose part vectors load columns outside it), with row blocks in cache and
/// sweeping, at several offsets of `M` from a line.
#[test]
fn q_through_the_scratch_gives_the_bits_of_q_in_place() {
    let kernels = supported_isas!(
        Kernel;
        cols_in_portable,
        cols_in_avx2,
        cols_in_avx512
    );
    for (n, cols, r) in [(300, 1024, 8), (520, 1024, 4), (70, 1000, 8), (9, 4111, 5)] {
        for off in [0, 3, 4] {
            let mut case = Case::new(n, cols, r, off);
            for &(isa, kernel) in &kernels {
                for range in [0..cols, cols / 3..cols - 5] {
                    let in_place = case.run_on(kernel, range.clone());
                    let through = case.run_through_scratch(kernel, range.clone());
                    assert!(
                        in_place
                            .iter()
                            .zip(&through)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{isa} {n} x {cols}, r = {r}, offset {off}, columns {range:?}: \
                         the scratch and Q in place differ"
                    );
                }
            }
        }
    }
}

/// The scratch lies 2 KiB from `M` modulo 4 KiB, and [`q_near_m`] calls `Q` near
/// within [`Q_NEAR_M_BYTES`] either way and only there.
#[test]
fn the_scratch_lies_away_from_m() {
    let mut case = Case::new(64, 1024, 4, 3);
    let mut q = vec![0.0f32; 4 * 1024];
    let a = case.mat(&mut q);
    let far = QScratch::new(&a).expect("a small allocation");
    let apart = (far.mat.q as usize).wrapping_sub(a.m as usize) % 4096;
    assert_eq!(apart, 2048);
    assert!(!q_near_m(a.m, far.mat.q));
    let m = a.m.cast_const();
    for (bytes, near) in [
        (0, true),
        (16, true),
        (Q_NEAR_M_BYTES - 4, true),
        (Q_NEAR_M_BYTES, false),
        (2048, false),
        (4096 - Q_NEAR_M_BYTES, false),
        (4096 - Q_NEAR_M_BYTES + 4, true),
        (4096 - 16, true),
        (4096 + 16, true),
        (8192 + 1024, false),
    ] {
        let q = m.wrapping_byte_add(bytes);
        assert_eq!(q_near_m(m, q), near, "Q {bytes} bytes past M");
    }
}

/// The row stream and the strips, which [`mtp_cols`] chooses between by L1, rank,
/// width and whether the call streams from memory, give the same bits: on every
/// machine, whichever it takes, over row blocks (in cache and sweeping), part
/// vectors, leftover strips and ragged columns, at every offset of `M` from a line;
/// and so does the 16-lane stream that prefetches each row near ([`mtp_stream_as`],
/// what AMD Zen 5 takes from memory at r = 2), at any size.
#[test]
fn the_stream_and_the_strips_give_the_same_bits() {
    let mut kernels: Vec<(&str, Kernel, Kernel)> =
        vec![("portable", stream_portable, strips_portable)];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        kernels.push(("avx2", stream_avx2, strips_avx2));
    }
    // Sixteen lanes take the stream on some cores ([`takes_wide_stream`]).
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma") {
        kernels.push(("avx512", stream_avx512, strips_avx512));
        kernels.push(("avx512 near", stream_near_avx512, strips_avx512));
    }
    for (n, cols, r) in [
        (70, 1024, 1),
        (150, 1024, 2),
        (67, 528, 3),
        (9, 4111, 5),
        (20, 1000, 8),
        (80, 4096, 4),
        (33, 96, 2),
        (300, 1024, 2),
    ] {
        for off in [0, 3, 4, 8, 12, 15] {
            let mut case = Case::new(n, cols, r, off);
            for &(isa, stream, strips) in &kernels {
                let (a, b) = (case.run(stream), case.run(strips));
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{isa} {n} x {cols}, r = {r}, offset {off}: the stream and the strips differ"
                );
            }
        }
    }
}

/// With 16 lanes at r = 4, a call from memory sweeps on AMD Zen 5 only where `M` is
/// larger than the last-level cache ([`MTP_ZEN5_SWEEP_RANK`], where the strips sweep in
/// memory order); there a call from an `M` the LLC holds leaves the rows to the hardware
/// prefetchers, and other cores sweep both.
#[test]
#[cfg(target_arch = "x86_64")]
fn rank_four_sweeps_on_zen5_only_past_the_llc() {
    use crate::cpu::simd::Avx512;
    let llc = llc_bytes();
    if llc > 1 << 40 {
        println!("skipped: cpuid names no last-level cache");
        return;
    }
    let cols = 4096;
    let shape = |n: usize| Mat {
        m: std::ptr::null_mut(),
        e: std::ptr::null_mut(),
        p: std::ptr::null_mut(),
        q: std::ptr::null_mut(),
        n,
        cols,
        r: MTP_ZEN5_SWEEP_RANK,
    };
    // 1 MiB or more, within the LLC; and past it.
    let held = shape((super::super::SWEEP_MIN_BYTES / (cols * 4)).max(llc / (cols * 4) / 2));
    let past = shape(llc / (cols * 4) + 64);
    assert!(held.n * cols * 4 <= llc && held.n * cols * 4 >= super::super::SWEEP_MIN_BYTES);
    let zen5 = zen5_or_later();
    assert_eq!(mtp_sweeps::<Avx512>(&held, &(0..cols)), !zen5);
    assert!(mtp_sweeps::<Avx512>(&past, &(0..cols)));
    // Ranks 1-3 have no tile that sweeps in memory order: on Zen 5 they do not sweep.
    let low = Mat { r: 3, ..past };
    assert_eq!(mtp_sweeps::<Avx512>(&low, &(0..cols)), !zen5);
}
