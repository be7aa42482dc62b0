//! The CPU kernels, written once over [`Simd`](super::simd::Simd) and instantiated per
//! instruction set.
//!
//! Skinny products stream `M` from memory once and keep everything else (the thin
//! factors, the accumulators) in registers or in L1/L2, so their speed is the memory
//! read bandwidth. Rows are processed in blocks so that each load of a factor vector is
//! shared by several rows; loads run a fixed distance behind software prefetches.
//!
//! All functions here are `unsafe`: they take raw pointers that the safe layer
//! (`mod.rs`) has checked against the shape, and they are only reached through the entry
//! points below, after runtime detection of the instruction set.
//!
//! One module per kernel family: [`mq`] (`P = M Q`), [`mtp`] (`Q = Mᵀ P`), [`pqt`]
//! (`M = P Qᵀ`), [`gram_schmidt`](mod@gram_schmidt) (with its [`vector`] helpers); [`pack`] packs `Q` for
//! the first three.

/// For the kernels' tests: `(name, value)` for every instruction set the machine has,
/// `$portable` always, `$avx2` and `$avx512` (named only on x86_64, where their
/// functions exist) where `is_x86_feature_detected!` finds them; each value has type `$t`.
#[cfg(test)]
macro_rules! supported_isas {
    ($t:ty; $portable:expr, $avx2:expr, $avx512:expr) => {{
        let portable: $t = $portable;
        #[allow(unused_mut)]
        let mut isas: Vec<(&'static str, $t)> = vec![("portable", portable)];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                let avx2: $t = $avx2;
                isas.push(("avx2", avx2));
            }
            if is_x86_feature_detected!("avx512f") {
                let avx512: $t = $avx512;
                isas.push(("avx512", avx512));
            }
        }
        isas
    }};
}

/// For the kernels' tests: values whose sums and products round differently in another
/// order (element `i` of series `s`, in -0.5..0.5).
#[cfg(test)]
fn test_value(i: usize, s: u32) -> f32 {
    ((i as u32).wrapping_mul(2654435761).wrapping_add(s) >> 8) as f32 / (1u32 << 24) as f32 - 0.5
}

mod gram_schmidt;
mod mq;
mod mtp;
mod pack;
mod pqt;
mod vector;

use gram_schmidt::gram_schmidt;
use mq::mq_rows;
use mtp::mtp_cols;
use pqt::pqt_rows;
use std::ops::Range;

/// Floats between two software prefetches of a stream swept ahead into L2 (`mq`, `pqt+e`,
/// `mtp`): one a 64-byte line. Cold, n = m = 4096, AMD Zen 4 (AVX-512), one prefetch a
/// 128-byte pair of lines read less of the read bandwidth where the kernel is nearest
/// its in-core limit (`mq` r = 8 0.42-0.50 against 0.62-0.66, `mtp` r = 4 0.71-0.74
/// against 0.90-0.93, one thread).
const SWEEP_STRIDE: usize = 16;
/// Bytes of `M` a call (one thread's rows or columns) must stream for the kernels to
/// sweep ahead with software prefetches: below that `M` is likely in cache, where they
/// only take load slots (with `M` in L2, `mq` at r = 1 read 0.78 of its in-core limit
/// without them against 0.58), or its rows too few for a sweep blocks ahead to run ahead
/// of the loads.
/// On cores whose prefetchers keep up alone, calls at low rank never sweep
/// ([`sweep_min_bytes`]).
const SWEEP_MIN_BYTES: usize = 1 << 20;
/// Floats ahead of each row's loads at which a call from memory that leaves the rows to
/// the hardware prefetchers prefetches them into L1 (`prefetcht0`) on AMD Zen 5 and
/// later: 2 KiB (`mq`'s near prefetch, `Ahead::Near`, and `mtp`'s 16-lane row stream at
/// r = 2).
/// On that core the hardware prefetchers alone leave a stream with multiply-adds to do
/// about serial (`bench lowrank --roofline`'s `plain` column: a plain loop of a rank-8
/// row's multiply-adds read 0.43-0.51 of the read bandwidth, under `serial`), and a
/// prefetch a little ahead of the loads overlaps it (`+pf`, 4 KiB ahead: 0.98-1.03).
/// AMD EPYC (Zen 5, KVM), AVX-512, `mq` 4096 x 4096 from memory, a probe alternating the
/// distances on the same buffers (each call after a 512 MiB write, median GB/s of 11
/// calls; the probe's switch cost every step a load, so only the distances compare),
/// one thread, r = 1 / 2 / 4: 256 floats 26.9 / 25.6 / 22.1, 384 31.0 / 27.8 / 24.2,
/// 512 34.0 / 29.8 / 26.0, 1024 29.2 / 26.4 / 23.4, 2048 (r = 2 / 4) 22.4 / 23.5 (the
/// read sum 25-29); two threads 256 36.1 / 34.5 / 30.6, 512 32.8 / 34.1 / 30.9, 1024
/// 32.6 / 33.7 / 30.6.
const NEAR_FLOATS: usize = 512;

/// Highest rank at which an `mq` call (plain or fused) does not sweep, on a core whose
/// hardware prefetchers keep up alone ([`zen5_or_later`]), with 16 lanes and with
/// 8 ([`OwnRank`]). AMD Zen 5 (EPYC, family 0x1A, AVX-512, KVM, 32-38 GB/s read by one
/// thread), `bench lowrank --roofline` with and without the sweep, median ratio of six
/// alternated pairs, from memory / from the LLC: `mq` r = 1 1.10-1.18 / 1.20-1.24,
/// r = 2 1.15-1.16 / 1.08-1.21; `mq+e` r = 1 1.07-1.12 / 1.18-1.48, r = 2 1.16-1.17 /
/// 1.11-1.34 (two sets); r = 4 `mq` 0.94-1.05 / 1.10-1.26 and `mq+e` 1.00-1.02 /
/// 1.07-1.22 (four sets, four to six pairs each). At r = 8 the sweep is worth 1.1-1.2
/// from memory, so it keeps it. `--quick` (4096 x 4096, four or five pairs): one thread
/// `mq` r = 1 / 2 / 4 1.16 / 1.08 / 1.04-1.07, two threads 1.05 / 0.99 / 1.13-1.14.
/// With AVX2 (`--isa avx2`, four pairs; unchanged rows read 0.90-1.00 in the same
/// runs): `mq` r = 1 1.19 / 1.34 and
/// `mq+e` r = 1 1.17 / 1.35, but r = 2 0.83 / 1.35 and 0.97 / 1.41, so with 8 lanes only
/// r = 1 goes without.
const MQ_OWN_PREFETCH_RANK: OwnRank = OwnRank { wide: 4, narrow: 1 };
/// [`MQ_OWN_PREFETCH_RANK`] for `mtp`: without the sweep, as there, r = 1 / 2 / 4 from
/// memory 0.96-1.10 / 1.10-1.16 / 1.10-1.17, from the LLC 1.24-1.30 / 1.10-1.16 /
/// 0.98-1.15; `--quick` one thread 0.99 / 1.08 / 1.08, two 1.01 / 0.98 / 0.96. With
/// AVX2 from memory 0.85 / 0.89 / 0.88 (its strips and stream want the sweep): none.
const MTP_OWN_PREFETCH_RANK: OwnRank = OwnRank { wide: 4, narrow: 0 };
/// [`MQ_OWN_PREFETCH_RANK`] for `pqt` and `pqt_error`: without the sweep, as there,
/// `pqt+e` r = 1 read 1.15 from memory and 1.14-1.22 from the LLC; r = 2 1.04-1.08 from
/// memory but 0.82-0.91 from the LLC, so it keeps the sweep. With AVX2 r = 1 1.05 / 1.14.
const PQT_OWN_PREFETCH_RANK: OwnRank = OwnRank { wide: 1, narrow: 1 };

/// The highest rank at which a kernel leaves the rows to the hardware prefetchers, with
/// 16 lanes (`wide`) and with 8 (`narrow`), on [`zen5_or_later`] cores.
#[derive(Clone, Copy)]
struct OwnRank {
    wide: usize,
    narrow: usize,
}

/// Bytes of `M` a call at rank `r` must stream to sweep ([`SWEEP_MIN_BYTES`]), or
/// `usize::MAX` (never) where this core's prefetchers do better alone: at ranks up to
/// `own` (the kernel's: [`MQ_OWN_PREFETCH_RANK`], [`MTP_OWN_PREFETCH_RANK`],
/// [`PQT_OWN_PREFETCH_RANK`]) for `lanes` on [`zen5_or_later`] cores. Calls that
/// do not sweep also take the in-cache choices (row blocks, walks); every choice gives
/// the same bits.
fn sweep_min_bytes(r: usize, lanes: usize, own: OwnRank) -> usize {
    sweep_min_bytes_on(r, lanes, own, zen5_or_later())
}

/// [`sweep_min_bytes`] on a core whose prefetchers keep up alone at low rank (`keeps_up`:
/// [`zen5_or_later`]) or not.
fn sweep_min_bytes_on(r: usize, lanes: usize, own: OwnRank, keeps_up: bool) -> usize {
    let own_rank = if lanes >= 16 { own.wide } else { own.narrow };
    if r <= own_rank && keeps_up {
        usize::MAX
    } else {
        SWEEP_MIN_BYTES
    }
}

/// Whether the kernels read a group's rows far apart rather than next to each other
/// (where the rows' order does not change a bit: `mq`'s groups of rows over whole rows
/// in cache). On AMD Zen 5 ([`zen5_or_later`]) a few rows read side by side stream from
/// L2 at about half the rate of one row when they lie near each other, at the full rate
/// when they lie 64 KiB or more apart. C loops (AMD EPYC, KVM, `M` of 128 x 1024 in L2,
/// best of 15 rounds): two accumulators a row over 4 adjacent rows 120-160 GB/s, over 4
/// rows 32 rows (128 KiB) apart 200-235, one row at a time 215-235; a plain read of 2
/// streams 4 KiB apart 115-130 against 175-220 at 64-128 KiB and 200-230 for one. Not a
/// set conflict (rows 64 bytes longer than 4 KiB read the same) and not a prefetch
/// distance (software prefetches into L1 did not help).
fn spaces_rows() -> bool {
    zen5_or_later()
}

/// Whether the processor is AMD's family 0x1A (Zen 5) or later. Its hardware prefetchers
/// stream a kernel's rows from memory at low rank better without the software sweep on
/// top ([`sweep_min_bytes`]), and it streams one row at a time, or rows far apart
/// ([`spaces_rows`]), better than rows next to each other side by side ([`mtp`]'s
/// choices of the row stream with 8 lanes, of its strips' width and of one row at a time
/// at r = 1 in cache, `mq`'s groups of rows far apart and its whole rows with `Q` in L2,
/// and `pqt`'s two rows at r = 4); in cache its stores keep up without `pqt_error`'s L1
/// prefetch, and `pqt_error` at r = 1 goes one vector at a time there. With its
/// multiply-add units busy it streams from memory
/// well only while its loads leave L1 room (`mq`'s 3-row groups at r = 8), and its
/// 48 KiB L1 takes `mtp`'s sweep (`mtp`'s `sweep_prefetch`). On Zen 4 (family 0x19) the
/// sweep took `mtp` r = 1 from 0.22-0.27 of the read bandwidth to 0.80-0.91
/// ([`mtp::mtp_cols`]'s doc), and on the Intel Xeons it is worth 1.1-1.2 from memory at
/// r = 1-2 (earlier sessions' README).
fn zen5_or_later() -> bool {
    cpu_is_amd() && cpu_family() >= 0x1A
}

/// The processor's family from `cpuid` leaf 1 (base family, plus the extended family
/// when the base is 0xF), read once.
fn cpu_family() -> u32 {
    static FAMILY: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *FAMILY.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            #[allow(unused_unsafe)]
            // SAFETY: `cpuid` exists on every x86-64 processor, and leaf 1 on every one.
            let eax = unsafe { core::arch::x86_64::__cpuid(1) }.eax;
            let base = (eax >> 8) & 0xf;
            if base == 0xf {
                base + ((eax >> 20) & 0xff)
            } else {
                base
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        0
    })
}

/// Whether this core's own prefetchers fall behind a strip walking down rows in L2, so
/// that `mtp`'s one-column tiles prefetch each row's next into L1 themselves: AMD cores.
/// With `M` in L2 (128 x 1024, r = 1, one thread, alternated runs), on AMD Zen 4
/// (AVX-512) the prefetch took the kernel from 0.74-0.75 to 0.81-0.82 of its in-core
/// limit; on an Intel Xeon (Emerald Rapids class, AVX-512) it cost it a sixth: 0.74-0.76
/// without against 0.62-0.63 (a plain strip loop: 105 GB/s without, 87 with).
fn strips_prefetch_next_row() -> bool {
    cpu_is_amd()
}

/// Whether the processor is AMD's ("AuthenticAMD"), read once from `cpuid` leaf 0.
fn cpu_is_amd() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // "AuthenticAMD": leaf 0 returns it in ebx, edx, ecx.
            #[allow(unused_unsafe)]
            // SAFETY: `cpuid` exists on every x86-64 processor, and leaf 0 on every one.
            let id = unsafe { core::arch::x86_64::__cpuid(0) };
            id.ebx == u32::from_le_bytes(*b"Auth")
                && id.edx == u32::from_le_bytes(*b"enti")
                && id.ecx == u32::from_le_bytes(*b"cAMD")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Whether the L1 data cache has 12 ways or more and 48 KiB or more (Intel since Ice
/// Lake, AMD Zen 5) rather than 8 ways and 32 KiB (AMD Zen 4 and older, Intel Skylake).
/// At power-of-two row widths a group's rows of `M` and `E` fall in one L1 set, and how
/// many of them fit beside `Q` sets how many rows `mq`'s fused pass reads side by side;
/// how much of `Q` fits beside the rows sets how wide `mq` reads rows whole. Read once
/// from `cpuid`'s cache leaves (leaf 4, AMD's 0x8000001D); false when they say nothing.
fn l1_is_wide() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| l1d().is_some_and(|(ways, bytes)| ways >= 12 && bytes >= 48 << 10))
}

/// The last-level cache's bytes (the highest level `cpuid`'s cache leaves list, data
/// or unified), read once; `usize::MAX` when they say nothing. A matrix larger than
/// this comes from memory whatever ran before, so a kernel may choose its walk for
/// memory (`mq`'s whole rows at r = 3 and 4).
fn llc_bytes() -> usize {
    static LLC: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LLC.get_or_init(|| {
        (1..=4)
            .rev()
            .find_map(|level| cache(level, &[1, 3]))
            .map_or(usize::MAX, |(_, bytes)| bytes as usize)
    })
}

/// The L1 data cache's ways and bytes, from `cpuid`'s deterministic cache parameters.
fn l1d() -> Option<(u32, u32)> {
    cache(1, &[1])
}

/// The ways and bytes of the cache at `level` whose type is one of `kinds` (1 data, 2
/// instruction, 3 unified), from `cpuid`'s deterministic cache parameters (leaf 4,
/// AMD's 0x8000001D).
fn cache(level: u32, kinds: &[u32]) -> Option<(u32, u32)> {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{__cpuid, __cpuid_count};
        #[allow(unused_unsafe)]
        // SAFETY: `cpuid` exists on every x86-64 processor; a leaf above the maximum the
        // processor reports (checked first) is not asked for.
        unsafe {
            let leaf = if cpu_is_amd() {
                if __cpuid(0x8000_0000).eax < 0x8000_001D {
                    return None;
                }
                0x8000_001D
            } else {
                if __cpuid(0).eax < 4 {
                    return None;
                }
                4
            };
            for sub in 0..16 {
                let c = __cpuid_count(leaf, sub);
                let (kind, at) = (c.eax & 0x1f, (c.eax >> 5) & 0x7);
                if kind == 0 {
                    break;
                }
                // Ways, partitions, line bytes and sets, each stored less one.
                if kinds.contains(&kind) && at == level {
                    let ways = (c.ebx >> 22) + 1;
                    let parts = ((c.ebx >> 12) & 0x3ff) + 1;
                    let line = (c.ebx & 0xfff) + 1;
                    let sets = c.ecx.wrapping_add(1);
                    let bytes = [parts, line, sets]
                        .iter()
                        .fold(u64::from(ways), |b, &x| b * u64::from(x));
                    return Some((ways, u32::try_from(bytes).unwrap_or(u32::MAX)));
                }
            }
            None
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Floats from column `c` of `M`'s rows to the next 64-byte boundary, when every row has
/// the same alignment (`cols` a multiple of [`SWEEP_STRIDE`] floats); 0 otherwise or on
/// a boundary. A large `Vec<f32>` from the system allocator starts 16 bytes past one
/// (glibc's chunk header), so loads and stores of whole lines straddle two; `mtp` and
/// `pqt` start their vectors at the boundary and take the columns before it apart, with
/// the same operations, so the bits do not depend on where `M` lies.
fn line_lead(a: &Mat, c: usize) -> usize {
    let at = a.m.wrapping_add(c) as usize;
    if a.cols.is_multiple_of(SWEEP_STRIDE) && at.is_multiple_of(4) {
        (64 - at % 64) % 64 / 4
    } else {
        0
    }
}

/// Floats from column `c` of `M`'s rows to the next vector boundary (`LANES * 4` bytes),
/// when the instruction set wants aligned vectors
/// ([`crate::cpu::simd::Simd::ALIGN`]) and every row lies alike (`cols` whole vectors);
/// 0 otherwise or on a boundary. `mq` reads its rows in
/// aligned vectors from the boundary before them (its `Edges`), and the 8-lane streaming
/// `mtp` its columns (`stream_shift`).
fn vector_lead<S: crate::cpu::simd::Simd>(a: &Mat, c: usize) -> usize {
    let bytes = S::LANES * 4;
    let at = a.m.wrapping_add(c) as usize;
    if S::ALIGN && a.cols.is_multiple_of(S::LANES) && at.is_multiple_of(4) {
        (bytes - at % bytes) % bytes / 4
    } else {
        0
    }
}

/// One matrix of a batch and its factors, as raw pointers checked by the caller.
///
/// `m` is `n x cols` row-major; `e` (optional, may be null) has the same shape; `p` is
/// `r` columns of `n` (column-major `n x r`); `q` is `r` columns of `cols`.
#[derive(Clone, Copy)]
pub(crate) struct Mat {
    pub m: *mut f32,
    pub e: *mut f32,
    pub p: *mut f32,
    pub q: *mut f32,
    pub n: usize,
    pub cols: usize,
    pub r: usize,
}

impl Mat {
    /// The pointers of matrix 0 of a batch of shape `d`.
    pub(crate) fn base(d: &crate::Dims, m: *mut f32, e: *mut f32, p: *mut f32, q: *mut f32) -> Mat {
        Mat {
            m,
            e,
            p,
            q,
            n: d.n(),
            cols: d.m(),
            r: d.r(),
        }
    }

    /// The pointers of matrix `b` (offsets computed with wrapping arithmetic; they are
    /// only dereferenced for `b < batch`).
    pub(crate) fn at(&self, d: &crate::Dims, b: usize) -> Mat {
        let mo = b * d.matrix_len();
        Mat {
            m: self.m.wrapping_add(mo),
            e: if self.e.is_null() {
                self.e
            } else {
                self.e.wrapping_add(mo)
            },
            p: self.p.wrapping_add(b * d.n() * d.r()),
            q: self.q.wrapping_add(b * d.m() * d.r()),
            ..*self
        }
    }
}

// SAFETY: a `Mat` is a bundle of pointers into buffers that the safe layer keeps alive
// and borrowed (shared or exclusive as each operation needs) for the duration of the
// parallel call; tasks write disjoint parts.
unsafe impl Send for Mat {}
// SAFETY: as above.
unsafe impl Sync for Mat {}

// ---------------------------------------------------------------------------------------
// Entry points, one set per instruction set.

macro_rules! isa_entries {
    ($(#[$attr:meta])* $module:ident, $simd:ty) => {
        pub(crate) mod $module {
            use super::*;
            $(#[$attr])*
            pub(crate) unsafe fn mq(a: &Mat, rows: Range<usize>, fuse_add: bool) {
                // SAFETY: forwarded caller guarantees.
                unsafe {
                    if fuse_add {
                        mq_rows::<$simd, true>(a, rows)
                    } else {
                        mq_rows::<$simd, false>(a, rows)
                    }
                }
            }
            $(#[$attr])*
            pub(crate) unsafe fn mtp(a: &Mat, cols: Range<usize>) {
                // SAFETY: forwarded caller guarantees.
                unsafe { mtp_cols::<$simd>(a, cols) }
            }
            $(#[$attr])*
            pub(crate) unsafe fn pqt(a: &Mat, rows: Range<usize>, fuse_error: bool) {
                // SAFETY: forwarded caller guarantees.
                unsafe {
                    if fuse_error {
                        pqt_rows::<$simd, true>(a, rows)
                    } else {
                        pqt_rows::<$simd, false>(a, rows)
                    }
                }
            }
            $(#[$attr])*
            pub(crate) unsafe fn orthogonalize(x: *mut f32, n: usize, r: usize, eps: f32) {
                // SAFETY: forwarded caller guarantees.
                unsafe { gram_schmidt::<$simd>(x, n, r, eps) }
            }
        }
    };
}

isa_entries!(portable, super::super::simd::Portable);
#[cfg(target_arch = "x86_64")]
isa_entries!(
    #[target_feature(enable = "avx2,fma")]
    avx2,
    super::super::simd::Avx2
);
#[cfg(target_arch = "x86_64")]
isa_entries!(
    #[target_feature(enable = "avx512f,avx2,fma")]
    avx512,
    super::super::simd::Avx512
);

/// A raw pointer that may cross threads; the code sharing it guarantees disjoint access.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
// SAFETY: users of `SendPtr` only touch disjoint ranges from different threads.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

#[cfg(test)]
mod tests {
    /// The vendor test reads `cpuid` right: it agrees with the kernel's `vendor_id`.
    #[test]
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn amd_is_read_from_cpuid() {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let vendor = info
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .and_then(|l| l.split(':').nth(1))
            .map(str::trim)
            .expect("a vendor_id line");
        assert_eq!(super::cpu_is_amd(), vendor == "AuthenticAMD", "{vendor}");
    }

    /// The family read from `cpuid` agrees with the kernel's `cpu family`.
    #[test]
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn family_is_read_from_cpuid() {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let family: u32 = info
            .lines()
            .find_map(|l| l.strip_prefix("cpu family"))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|f| f.trim().parse().ok())
            .expect("a cpu family line");
        assert_eq!(super::cpu_family(), family);
        assert_eq!(
            super::zen5_or_later(),
            super::cpu_is_amd() && family >= 0x1A
        );
    }

    /// The caches the kernel lists for cpu 0 (sysfs): `(level, type, ways, bytes)` of
    /// each, or `None` where it lists none.
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn sysfs_caches() -> Option<Vec<(u32, String, u32, usize)>> {
        let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
        let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
        let entries = std::fs::read_dir(dir).ok()?;
        let caches: Vec<_> = entries
            .flatten()
            .filter_map(|e| {
                let p = e.path();
                let level = read(p.join("level"))?.trim().parse().ok()?;
                let kind = read(p.join("type"))?.trim().to_string();
                let ways = read(p.join("ways_of_associativity"))?.trim().parse().ok()?;
                // "48K", "32768K"
                let kib: usize = read(p.join("size"))?
                    .trim()
                    .strip_suffix('K')?
                    .parse()
                    .ok()?;
                Some((level, kind, ways, kib << 10))
            })
            .collect();
        (!caches.is_empty()).then_some(caches)
    }

    /// The L1 data cache's ways and size read from `cpuid` agree with the kernel's
    /// (sysfs), where the kernel says.
    #[test]
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn l1d_is_read_from_cpuid() {
        let l1d = sysfs_caches()
            .into_iter()
            .flatten()
            .find(|(level, kind, ..)| *level == 1 && kind == "Data");
        let Some((_, _, ways, bytes)) = l1d else {
            println!("skipped: sysfs lists no L1 data cache");
            return;
        };
        assert_eq!(super::l1d(), Some((ways, bytes as u32)));
        assert_eq!(super::l1_is_wide(), ways >= 12 && bytes >= 48 << 10);
    }

    /// The last-level cache's size read from `cpuid` agrees with the kernel's (sysfs:
    /// its highest-level data or unified cache), where the kernel says.
    #[test]
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn llc_is_read_from_cpuid() {
        let llc = sysfs_caches()
            .into_iter()
            .flatten()
            .filter(|(_, kind, ..)| kind == "Data" || kind == "Unified")
            .max_by_key(|&(level, ..)| level);
        match llc {
            Some((.., bytes)) => assert_eq!(super::llc_bytes(), bytes),
            None => println!("skipped: sysfs lists no data or unified cache"),
        }
    }
}
