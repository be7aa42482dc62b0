//! Bit-for-bit checks of `mq`'s walks against each other: groups of rows far apart
//! against adjacent ones, whole rows against column chunks, tall blocks swept chunk by
//! chunk against short ones, rows prefetched near against the sweep.

use super::*;
use crate::cpu::kernels::test_value;
use crate::cpu::simd::Portable;

/// `$name` on instruction set `$simd` (compiled for `$feat`): [`mq_rows_as`], fused
/// or not, with a group's rows far apart or next to each other.
///
/// `spaces` with `fuse` at r <= 2 runs the fused pass in groups of two rows far apart
/// (what [`group_rows`] takes on some cores, in cache) against one row at a time
/// without it (what it takes elsewhere), on every machine.
macro_rules! spacing {
    ($name:ident, $simd:ty $(, $feat:literal)?) => {
        $(#[target_feature(enable = $feat)])?
        unsafe fn $name(a: &Mat, rows: Range<usize>, spaces: bool, fuse: bool) {
            // SAFETY: forwarded; the caller checked the instruction set.
            unsafe {
                let walk = Walk {
                    spaces,
                    tall: false,
                    near: false,
                };
                match (fuse, a.r <= 2, spaces) {
                    (true, true, true) => {
                        mq_rows_rb::<$simd, 2, true>(a, rows, takes_whole_rows(a, 2, <$simd>::LANES), walk)
                    }
                    (true, true, false) => {
                        mq_rows_rb::<$simd, 1, true>(a, rows, takes_whole_rows(a, 1, <$simd>::LANES), walk)
                    }
                    (true, false, _) => mq_rows_as::<$simd, true>(a, rows, walk),
                    (false, ..) => mq_rows_as::<$simd, false>(a, rows, walk),
                }
            }
        }
    };
}
spacing!(spacing_portable, Portable);
#[cfg(target_arch = "x86_64")]
spacing!(spacing_avx2, crate::cpu::simd::Avx2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
spacing!(spacing_avx512, crate::cpu::simd::Avx512, "avx512f,avx2,fma");

/// `P` and `M` after `kernel` on an `n x cols` matrix `off` floats into its buffer at
/// rank `r`, with `E` when `fuse` (then `M += E`); `P` starts as NaN.
fn outputs(
    n: usize,
    cols: usize,
    r: usize,
    off: usize,
    fuse: bool,
    kernel: impl FnOnce(&Mat),
) -> (Vec<f32>, Vec<f32>) {
    let mut m: Vec<f32> = (0..n * cols + off).map(|i| test_value(i, 1)).collect();
    let mut e: Vec<f32> = (0..n * cols).map(|i| test_value(i, 3)).collect();
    let mut q: Vec<f32> = (0..r * cols).map(|i| test_value(i, 7)).collect();
    let mut p = vec![f32::NAN; r * n];
    kernel(&Mat {
        m: m[off..].as_mut_ptr(),
        e: if fuse {
            e.as_mut_ptr()
        } else {
            std::ptr::null_mut()
        },
        p: p.as_mut_ptr(),
        q: q.as_mut_ptr(),
        n,
        cols,
        r,
    });
    (p, m)
}

/// Whether two [`outputs`] agree bit for bit.
fn same_bits(x: &(Vec<f32>, Vec<f32>), y: &(Vec<f32>, Vec<f32>)) -> bool {
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
    same(&x.0, &y.0) && same(&x.1, &y.1)
}

/// Groups whose rows lie far apart ([`spaces_rows`]) give the bits of groups of
/// rows next to each other, in `P` and (fused) in `M`, on every instruction set the
/// machine has: every rank's tiles (r = 1 to 8, one column tile and several), rows
/// with and without edges, ragged columns, row counts that leave single rows, and
/// row ranges that start inside the matrix (a thread's share).
#[test]
fn spaced_groups_give_the_bits_of_adjacent_ones() {
    type Spacing = unsafe fn(&Mat, Range<usize>, bool, bool);
    let isas = supported_isas!(Spacing; spacing_portable, spacing_avx2, spacing_avx512);
    for (n, cols, r) in [
        (64, 1024, 1),
        (64, 1024, 2),
        (37, 1000, 2),
        (40, 1024, 4),
        (33, 512, 8),
        (50, 264, 3),
        (21, 100, 5),
        (9, 16, 2),
        (7, 7, 1),
    ] {
        for off in [0, 3, 8] {
            for rows in [0..n, 5..n - 2] {
                for fuse in [false, true] {
                    for &(isa, kernel) in &isas {
                        let run = |spaces: bool| {
                            // SAFETY: `outputs` gives a `Mat` of buffers of its shape,
                            // alive and not shared; the instruction set was checked.
                            outputs(n, cols, r, off, fuse, |a| unsafe {
                                kernel(a, rows.clone(), spaces, fuse)
                            })
                        };
                        assert!(
                            same_bits(&run(false), &run(true)),
                            "{isa} {n} x {cols} r = {r}, offset {off}, rows {rows:?}, fused {fuse}: spaced groups differ"
                        );
                    }
                }
            }
        }
    }
}

/// `$name` on instruction set `$simd` (compiled for `$feat`): groups of one row
/// (fused or not) and of two, whole or in column chunks.
macro_rules! chunking {
    ($name:ident, $simd:ty $(, $feat:literal)?) => {
        $(#[target_feature(enable = $feat)])?
        unsafe fn $name(a: &Mat, rows: Range<usize>, whole: bool, walk: usize) {
            // SAFETY: forwarded; the caller checked the instruction set.
            unsafe {
                let plain = Walk {
                    spaces: false,
                    tall: false,
                    near: false,
                };
                match walk {
                    0 => mq_rows_rb::<$simd, 1, false>(a, rows, whole, plain),
                    1 => mq_rows_rb::<$simd, 2, false>(a, rows, whole, plain),
                    _ => mq_rows_rb::<$simd, 1, true>(a, rows, whole, plain),
                }
            }
        }
    };
}
chunking!(chunking_portable, Portable);
#[cfg(target_arch = "x86_64")]
chunking!(chunking_avx2, crate::cpu::simd::Avx2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
chunking!(
    chunking_avx512,
    crate::cpu::simd::Avx512,
    "avx512f,avx2,fma"
);

/// Rows read whole (what [`takes_whole_rows`] takes for a `Q` that L1 holds, and on
/// some cores for one that L2 holds) give the bits of rows read in column chunks, in
/// `P` and (fused) in `M`, on every instruction set the machine has: ranks of one
/// column tile and of several, rows with edges, ragged columns.
#[test]
fn whole_rows_give_the_bits_of_chunks() {
    type Chunking = unsafe fn(&Mat, Range<usize>, bool, usize);
    let isas = supported_isas!(Chunking; chunking_portable, chunking_avx2, chunking_avx512);
    for (n, cols, r) in [
        (7, 8000, 2),
        (6, 4000, 4),
        (5, 16390, 1),
        (5, 3000, 8),
        (4, 5000, 3),
    ] {
        for off in [0, 5] {
            for walk in 0..3 {
                for &(isa, kernel) in &isas {
                    let run = |whole: bool| {
                        // SAFETY: `outputs` gives a `Mat` of buffers of its shape, alive
                        // and not shared; the instruction set was checked.
                        outputs(n, cols, r, off, walk == 2, |a| unsafe {
                            kernel(a, 0..n, whole, walk)
                        })
                    };
                    assert!(
                        same_bits(&run(true), &run(false)),
                        "{isa} {n} x {cols} r = {r}, offset {off}, walk {walk}: whole rows and chunks differ"
                    );
                }
            }
        }
    }
}

/// `$name` on instruction set `$simd` (compiled for `$feat`): [`mq_rows_as`], fused or
/// not, by the walks `walk`.
macro_rules! walking {
    ($name:ident, $simd:ty $(, $feat:literal)?) => {
        $(#[target_feature(enable = $feat)])?
        unsafe fn $name(a: &Mat, rows: Range<usize>, walk: Walk, fuse: bool) {
            // SAFETY: forwarded; the caller checked the instruction set.
            unsafe {
                if fuse {
                    mq_rows_as::<$simd, true>(a, rows, walk)
                } else {
                    mq_rows_as::<$simd, false>(a, rows, walk)
                }
            }
        }
    };
}
walking!(walking_portable, Portable);
#[cfg(target_arch = "x86_64")]
walking!(walking_avx2, crate::cpu::simd::Avx2, "avx2,fma");
#[cfg(target_arch = "x86_64")]
walking!(walking_avx512, crate::cpu::simd::Avx512, "avx512f,avx2,fma");

/// Asserts that calls from memory (at least [`SWEEP_MIN_BYTES`] of `M`) over each of
/// `shapes` (`n x cols` at rank `r`) give the same bits in `P` and (fused) in `M` by the
/// walks `walks.0` and `walks.1` (`what` names the difference), on every instruction set
/// the machine has: the whole matrix on a line, and a thread's share of the rows with
/// edges.
fn walks_give_the_same_bits(shapes: &[(usize, usize, usize)], walks: (Walk, Walk), what: &str) {
    type Walking = unsafe fn(&Mat, Range<usize>, Walk, bool);
    let isas = supported_isas!(Walking; walking_portable, walking_avx2, walking_avx512);
    for &(n, cols, r) in shapes {
        for (off, rows) in [(0, 0..n), (3, 2..n - 1)] {
            assert!(
                rows.len() * cols * 4 >= SWEEP_MIN_BYTES,
                "{rows:?} would not stream"
            );
            for fuse in [false, true] {
                for &(isa, kernel) in &isas {
                    let run = |walk: Walk| {
                        // SAFETY: `outputs` gives a `Mat` of buffers of its shape, alive
                        // and not shared; the instruction set was checked.
                        outputs(n, cols, r, off, fuse, |a| unsafe {
                            kernel(a, rows.clone(), walk, fuse)
                        })
                    };
                    assert!(
                        same_bits(&run(walks.0), &run(walks.1)),
                        "{isa} {n} x {cols} r = {r}, offset {off}, rows {rows:?}, fused {fuse}: {what} differ"
                    );
                }
            }
        }
    }
}

/// Calls that sweep (at least [`SWEEP_MIN_BYTES`] of `M`, past the rank at which a
/// core leaves the rows to its own prefetchers) in tall blocks swept chunk by chunk
/// ([`Walk::tall`], what AMD Zen 5 takes from r = 5) give the bits of short blocks swept a block
/// ahead: ranks of one column tile and of several, row counts that leave a short block
/// and single rows, rows with edges (at 4096 columns, where the edge vector joins the
/// last chunk, [`chunk_count`]), ragged columns, and a thread's share of the rows.
#[test]
fn tall_blocks_give_the_bits_of_short_ones() {
    let walk = |tall: bool| Walk {
        spaces: false,
        tall,
        near: false,
    };
    walks_give_the_same_bits(
        &[(101, 2760, 8), (70, 4100, 5), (80, 3500, 6), (72, 4096, 8)],
        (walk(false), walk(true)),
        "tall blocks",
    );
}

/// Whole rows from memory that leave the rows to the hardware prefetchers and prefetch
/// each row's own stream near ([`Ahead::Near`], what AMD Zen 5 takes at low rank) give
/// the bits of the sweep: ranks 1-4 (with 8 lanes only r = 1 goes without the sweep,
/// and the plain pass prefetches near from [`MQ_NEAR_MIN_RANK`]), rows with edges,
/// ragged columns, row counts that leave single rows, and a thread's share. Every shape
/// reads its rows whole on every core (`Q` within 16 KiB).
#[test]
fn near_prefetches_give_the_bits_of_the_sweep() {
    let walk = |near: bool| Walk {
        spaces: near,
        tall: true,
        near,
    };
    walks_give_the_same_bits(
        &[
            (72, 4096, 1),
            (100, 3000, 1),
            (150, 2048, 2),
            (301, 1024, 3),
            (300, 1024, 4),
        ],
        (walk(false), walk(true)),
        "near prefetches",
    );
}

/// A row's column chunks: whole chunks, and what is left a chunk of its own only from
/// `step` floats (less is an edge vector, which joins the last chunk).
#[test]
fn an_edge_vector_joins_the_last_chunk() {
    for (len, chunk, step, chunks) in [
        (4112, 512, 128, 8),
        (4104, 512, 64, 8),
        (4096, 512, 128, 8),
        (4112, 384, 128, 11),
        (640, 512, 128, 2),
        (520, 512, 128, 1),
        (512, 512, 128, 1),
        (100, 512, 128, 1),
    ] {
        assert_eq!(
            chunk_count(len, chunk, step),
            chunks,
            "{len} floats in chunks of {chunk}, steps of {step}"
        );
    }
}
