//! Bit-for-bit checks of the `P Qᵀ` passes' walks against each other: stores around
//! the caches against stores through them, the one-vector walk against the tiles,
//! column chunks against whole rows; and the rules that choose them.

use super::*;
use crate::cpu::simd::Portable;

/// The fused pass at rank 1 over every row of `a`, one vector at a time
/// ([`pqt_row`], `one`) or through the one-row tile ([`pqt_block`]), as
/// [`pqt_rows_rc`] walks them in cache.
unsafe fn walk<S: Simd>(a: &Mat, one: bool) {
    let lead = vector_start::<S>(a);
    let nvec = (a.cols - lead) / S::LANES;
    let mut pack = QPack::take(nvec * S::LANES + 16);
    let qpack = pack.aligned();
    // SAFETY: the pack holds `nvec` vectors; the rows lie inside `a` (the caller).
    unsafe {
        pack_q_from::<S>(a, lead, nvec, qpack);
        for i in 0..a.n {
            if one {
                pqt_row::<S, 1, true, false>(a, i, qpack, lead);
            } else {
                let span = Span::whole(lead, nvec, S::LANES);
                pqt_block::<S, 1, 8, 1, true, false>(a, i, qpack, lead, false, span);
            }
        }
    }
}

/// [`walk`] on an instruction set.
type Walk = unsafe fn(&Mat, bool);

unsafe fn walk_portable(a: &Mat, one: bool) {
    // SAFETY: forwarded.
    unsafe { walk::<Portable>(a, one) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn walk_avx2(a: &Mat, one: bool) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { walk::<crate::cpu::simd::Avx2>(a, one) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn walk_avx512(a: &Mat, one: bool) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { walk::<crate::cpu::simd::Avx512>(a, one) }
}

/// [`pqt_rows_with`] at ranks 1, 2, 4, 8 and 5 (its tiles: one row of eight vectors,
/// two of four, four of two where it sweeps on a wide L1, the one-vector walk), the
/// fused pass (`fuse`) or the plain one.
unsafe fn passes<S: Simd>(a: &Mat, fuse: bool, nt: bool, chunk: Option<usize>) {
    macro_rules! walk {
        ($rc:literal) => {
            match (fuse, nt) {
                (true, false) => pqt_rows_with::<S, $rc, true, false>(a, 0..a.n, chunk),
                (true, true) => pqt_rows_with::<S, $rc, true, true>(a, 0..a.n, chunk),
                (false, false) => pqt_rows_with::<S, $rc, false, false>(a, 0..a.n, chunk),
                (false, true) => pqt_rows_with::<S, $rc, false, true>(a, 0..a.n, chunk),
            }
        };
    }
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match a.r {
            1 => walk!(1),
            2 => walk!(2),
            4 => walk!(4),
            8 => walk!(8),
            _ => walk!(0),
        }
    }
}

/// [`passes`] on an instruction set.
type Passes = unsafe fn(&Mat, bool, bool, Option<usize>);

unsafe fn passes_portable(a: &Mat, fuse: bool, nt: bool, chunk: Option<usize>) {
    // SAFETY: forwarded.
    unsafe { passes::<Portable>(a, fuse, nt, chunk) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn passes_avx2(a: &Mat, fuse: bool, nt: bool, chunk: Option<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { passes::<crate::cpu::simd::Avx2>(a, fuse, nt, chunk) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn passes_avx512(a: &Mat, fuse: bool, nt: bool, chunk: Option<usize>) {
    // SAFETY: forwarded; the caller checked the instruction set.
    unsafe { passes::<crate::cpu::simd::Avx512>(a, fuse, nt, chunk) }
}

/// The bits of `M` and `E` after one pass of `walk` (fused or not, around the caches
/// or not, in chunks of `chunk` vectors) over an `n x cols` matrix at rank `r` whose
/// `M` and `E` start `off` floats past a line (`E` then NaN everywhere the pass does
/// not write).
#[allow(clippy::too_many_arguments)]
fn pass_bits(
    walk: Passes,
    n: usize,
    cols: usize,
    r: usize,
    off: usize,
    fuse: bool,
    nt: bool,
    chunk: Option<usize>,
) -> (Vec<u32>, Vec<u32>) {
    let val = crate::cpu::kernels::test_value;
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut mbuf = vec![0.0f32; n * cols + 32];
    let mut ebuf = vec![f32::NAN; n * cols + 32];
    let line = |b: &Vec<f32>| b.as_ptr().align_offset(64);
    let (mo, eo) = (line(&mbuf) + off, line(&ebuf) + off);
    for (i, x) in mbuf[mo..mo + n * cols].iter_mut().enumerate() {
        *x = val(i, 1);
    }
    let mut p: Vec<f32> = (0..n * r).map(|i| val(i, 5)).collect();
    let mut q: Vec<f32> = (0..cols * r).map(|i| val(i, 7)).collect();
    let a = Mat {
        m: mbuf[mo..].as_mut_ptr(),
        e: if fuse {
            ebuf[eo..].as_mut_ptr()
        } else {
            std::ptr::null_mut()
        },
        p: p.as_mut_ptr(),
        q: q.as_mut_ptr(),
        n,
        cols,
        r,
    };
    // SAFETY: `a` points at buffers of its shape, alive and not shared; `E` lies as
    // `M` does modulo a line, so the vectors of either from the walk's start lie on
    // vector boundaries; `walk` is supported here (`supported_isas!`).
    unsafe { walk(&a, fuse, nt, chunk) };
    (
        bits(&mbuf[mo..mo + n * cols]),
        bits(&ebuf[eo..eo + n * cols]),
    )
}

/// The stream written whole around the caches ([`writes_around_caches`]: `E` in the
/// fused pass, `M` in the plain one) holds the bits it holds written through them,
/// and the other stream the same, on every instruction set the machine has: every
/// tile of the walk, in cache and sweeping (1 MiB or more), `M` and `E` on a line or
/// 16 bytes past one (alike, as the stores around the caches need), edges before the
/// first line boundary and ragged columns past the last whole vector (plain stores
/// either way). Where the stores go around the caches they must be aligned, which
/// the vector types' stores check in debug builds.
#[test]
fn stores_around_the_caches_give_the_bits_of_stores_through_them() {
    let walks = supported_isas!(Passes; passes_portable, passes_avx2, passes_avx512);
    for (n, cols, r) in [
        (9, 1024, 1),
        (7, 1040, 2),
        (70, 4096, 4),
        (11, 1024, 8),
        (6, 528, 5),
    ] {
        for off in [0, 4] {
            for &(isa, walk) in &walks {
                for fuse in [true, false] {
                    assert!(
                        pass_bits(walk, n, cols, r, off, fuse, true, None)
                            == pass_bits(walk, n, cols, r, off, fuse, false, None),
                        "{isa} {n} x {cols}, r = {r}, offset {off}, fused {fuse}: the \
                         stores around the caches differ"
                    );
                }
            }
        }
    }
}

/// Column chunks of any size ([`pqt_chunk_vectors`] takes them on some cores) write
/// the bits of whole rows into `M` and `E`, fused or not, around the caches or not,
/// on every instruction set the machine has: every tile's rank, rows at every offset
/// class from a line (edges in the first and the last chunk), ragged columns, a last
/// chunk shorter than the others, rows shorter than a chunk or a vector.
#[test]
fn column_chunks_give_the_bits_of_whole_rows() {
    let walks = supported_isas!(Passes; passes_portable, passes_avx2, passes_avx512);
    for (n, cols, r) in [
        (9, 1024, 8),
        (7, 1000, 4),
        (5, 2061, 3),
        (6, 528, 5),
        (4, 777, 1),
        (3, 640, 2),
        (5, 40, 8),
        (3, 7, 4),
    ] {
        for off in [0, 3, 4, 12] {
            for &(isa, walk) in &walks {
                for (fuse, nt) in [(true, false), (false, false), (true, true)] {
                    // Stores around the caches ask for `M` on a vector boundary.
                    if nt && (off % 16 != 0 || cols % 16 != 0) {
                        continue;
                    }
                    let whole = pass_bits(walk, n, cols, r, off, fuse, nt, Some(usize::MAX));
                    for chunk in [1, 8, 16, 24] {
                        assert!(
                            pass_bits(walk, n, cols, r, off, fuse, nt, Some(chunk)) == whole,
                            "{isa} {n} x {cols}, r = {r}, offset {off}, fused {fuse}, \
                             around the caches {nt}: chunks of {chunk} vectors differ \
                             from whole rows"
                        );
                    }
                }
            }
        }
    }
}

/// [`pqt_chunk_vectors`] chunks only where measured: on Zen 5 and later, from rank 3,
/// where packed `Q` is larger than [`PQT_CHUNK_MIN_BYTES`], in cache or from the LLC
/// (not AVX2 calls that sweep above rank 4); the chunks hold [`PQT_CHUNK_BYTES`] of
/// `Q`.
#[test]
fn column_chunks_only_where_measured() {
    // (r, lanes, nvec, sweep, fits_llc, zen5), vectors a chunk, why.
    let cases = [
        ((8, 16, 64, false, true, true), 32, "r = 8 at 1024 columns"),
        ((8, 16, 64, false, true, false), 64, "only where measured"),
        ((4, 16, 64, false, true, true), 64, "16 KiB of Q fits L1"),
        ((4, 16, 128, false, true, true), 64, "r = 4 at 2048 columns"),
        ((2, 16, 512, false, true, true), 512, "rank 2 whole"),
        ((1, 16, 1024, false, true, true), 1024, "rank 1 whole"),
        ((8, 16, 256, true, true, true), 32, "AVX-512 from the LLC"),
        ((8, 16, 256, true, false, true), 256, "from memory"),
        (
            (8, 8, 512, true, true, true),
            512,
            "AVX2 r = 8 from the LLC",
        ),
        (
            (4, 8, 512, true, true, true),
            128,
            "AVX2 r = 4 from the LLC",
        ),
        ((3, 16, 128, false, true, true), 128, "24 KiB stays whole"),
        ((8, 16, 0, false, true, true), 1, "no whole vector"),
    ];
    for ((r, lanes, nvec, sweep, fits_llc, zen5), want, why) in cases {
        assert_eq!(
            pqt_chunk_vectors(r, lanes, nvec, sweep, fits_llc, zen5),
            want,
            "{why}"
        );
    }
}

/// [`writes_around_caches`] asks for the stream on vector boundaries where the walk
/// stores, whole-vector rows, 1 MiB or more, and the core.
#[test]
fn stores_go_around_the_caches_only_where_they_may() {
    let mut buf = vec![0.0f32; 300 * 1024 + 32];
    let start = buf.as_ptr().align_offset(64);
    let at = buf[start..].as_mut_ptr();
    let mat = |n: usize, cols: usize| Mat {
        m: std::ptr::null_mut(),
        e: std::ptr::null_mut(),
        p: std::ptr::null_mut(),
        q: std::ptr::null_mut(),
        n,
        cols,
        r: 4,
    };
    let yes = |a: &Mat, off: usize, lead: usize, zen5: bool| {
        writes_around_caches::<Portable>(a, at.wrapping_add(off), &(0..a.n), lead, zen5)
    };
    let big = mat(300, 1024);
    assert!(yes(&big, 0, 0, true));
    assert!(!yes(&big, 0, 0, false), "only where measured");
    assert!(!yes(&mat(100, 1024), 0, 0, true), "in cache");
    assert!(!yes(&big, 4, 0, true), "off its vectors");
    assert!(yes(&big, 4, 4, true), "from the walk's start");
    assert!(!yes(&mat(300, 1020), 0, 0, true), "rows not whole vectors");
}

/// The one-vector walk at rank 1 ([`pqt_row`], which [`pqt_one_vector_walk`] takes on
/// some cores) writes the bits of the tile walk into `M` and `E`, on every instruction
/// set the machine has: rows at every offset class from a line, ragged columns, rows
/// shorter than a vector, and `E` at another offset than `M`.
#[test]
fn the_one_vector_walk_gives_the_bits_of_the_tiles() {
    let walks = supported_isas!(Walk; walk_portable, walk_avx2, walk_avx512);
    let val = crate::cpu::kernels::test_value;
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for (n, cols) in [(9, 1024), (13, 1000), (5, 4111), (6, 40), (4, 16), (3, 7)] {
        for off in [0, 1, 3, 4, 8, 12, 15] {
            let run = |walk: Walk, one: bool| {
                let mut m: Vec<f32> = (0..n * cols + off).map(|i| val(i, 1)).collect();
                let mut e = vec![f32::NAN; n * cols + 16];
                let mut p: Vec<f32> = (0..n).map(|i| val(i, 5)).collect();
                let mut q: Vec<f32> = (0..cols).map(|i| val(i, 7)).collect();
                let a = Mat {
                    m: m[off..].as_mut_ptr(),
                    e: e[(15 - off)..].as_mut_ptr(),
                    p: p.as_mut_ptr(),
                    q: q.as_mut_ptr(),
                    n,
                    cols,
                    r: 1,
                };
                // SAFETY: `a` points at buffers of its shape, alive and not shared.
                unsafe { walk(&a, one) };
                (bits(&m), bits(&e))
            };
            for &(isa, walk) in &walks {
                assert!(
                    run(walk, true) == run(walk, false),
                    "{isa} {n} x {cols}, offset {off}: the one-vector walk and the tiles differ"
                );
            }
        }
    }
}
