//! Where the strips' software prefetches go ([`Sweep`]) for a call that sweeps `M`
//! ahead: into the rows a few blocks further down, strip by strip, or through the same
//! block read in memory order.

use super::super::Mat;
use std::ops::Range;

/// The prefetches of one row block's strips ([`mtp_strip`](super::strips::mtp_strip)): none
/// ([`Sweep::NONE`]), or for every row `i` of a strip the block `ahead_rows` rows
/// further down, in one of two orders:
/// - by rows (`linear` false): row `i + ahead_rows` at the strip's own columns, so a
///   block's strips prefetch its rows side by side, as they read them;
/// - in memory order (`linear` true, AMD Zen 5 and later): the strips' prefetches, taken
///   in the order the strips run (strip by strip, row by row down each), walk the later
///   block row after row along the panel, one line each, as one run. The block's strips
///   partition its columns, so each line of the later block's panel is prefetched once
///   (the ragged columns past the last whole vector, which no strip takes, excepted).
///
/// Why memory order: a strip walks a block's rows side by side (8 rows of 16 KiB at
/// r = 8 and 4096 columns), and its prefetches, one line of each row in turn, are as
/// many streams as the block has rows; AMD Zen 5 fetches from memory far faster in one
/// run. AMD EPYC (Zen 5, KVM), a probe of one thread alternating both orders on the same
/// buffers (4096 x 4096, each call after a 512 MiB write, median GB/s): AVX-512 r = 8
/// 12.1-13.9 -> 17.1-18.7 (three sets), r = 6 13.5 -> 14.5-16.1; AVX2 r = 8 8.3 -> 12.5,
/// r = 4 12.7 -> 18.2, r = 1 18.6 -> 20.3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Sweep {
    /// Rows between a row and the row its prefetch goes to (0: no sweep).
    ahead_rows: usize,
    /// Memory order (see [`Sweep`]).
    linear: bool,
    /// The block's first row and its rows.
    row0: usize,
    rows: usize,
    /// The panel's first column and its width.
    col0: usize,
    width: usize,
    /// `ceil(2^32 / width)`: `t / width` as `(t * inv) >> 32`, exact while
    /// `t * width < 2^32` ([`Sweep::new`] checks it for every `t` of the block).
    inv: u64,
}

impl Sweep {
    /// No prefetches.
    pub(super) const NONE: Sweep = Sweep {
        ahead_rows: 0,
        linear: false,
        row0: 0,
        rows: 0,
        col0: 0,
        width: 1,
        inv: 0,
    };

    /// The sweep of the block `rows` of the panel `panel`, `ahead_rows` rows ahead (0:
    /// none), in memory order with `linear` (by rows where the block's size would make
    /// the exact division of [`Sweep::at`] overflow, which the kernels' blocks never do).
    pub(super) fn new(
        ahead_rows: usize,
        linear: bool,
        rows: &Range<usize>,
        panel: &Range<usize>,
    ) -> Sweep {
        if ahead_rows == 0 {
            return Sweep::NONE;
        }
        let width = panel.len().max(1);
        let fits = rows
            .len()
            .checked_mul(width)
            .and_then(|t| t.checked_mul(width))
            .is_some_and(|x| x < 1 << 32);
        Sweep {
            ahead_rows,
            linear: linear && fits,
            row0: rows.start,
            rows: rows.len(),
            col0: panel.start,
            width,
            inv: (1u64 << 32).div_ceil(width as u64),
        }
    }

    /// This sweep by rows (the same when off): with `linear` a constant false, code
    /// inlined with it keeps only the row offset across a strip's loop. With the other
    /// order's fields live there (whether it swept or not), the AVX-512 6 x 4 tile read
    /// 0.87 of its rate with `M` in L2 (eight alternated pairs).
    #[inline(always)]
    pub(super) fn by_rows(self) -> Sweep {
        Sweep {
            linear: false,
            ..self
        }
    }

    /// Whether the strips' column tile `kt` wide on `lanes` lanes is compiled with the
    /// sweep in memory order: the tiles that lead a call's columns at the ranks that
    /// sweep from the strips on AMD Zen 5 (16 lanes from r = 5: 8 and 4 wide; 8 lanes at
    /// r = 1 and from r = 4 but 5, the others taking the row stream: 4 and 1 wide). The
    /// others fall back to the rows' order (the same bits), which keeps the crate's
    /// build time: each combination is a copy of the whole block walk.
    pub(super) const fn takes_linear(lanes: usize, kt: usize) -> bool {
        if lanes >= 16 {
            kt == 8 || kt == 4
        } else {
            kt == 4 || kt == 1
        }
    }

    /// Whether the block sweeps.
    #[inline(always)]
    pub(super) fn is_on(&self) -> bool {
        self.ahead_rows != 0
    }

    /// The address a strip of `w` columns from column `j0` prefetches for its row `i`,
    /// `off` floats into the row's run (`off < w`; the strips prefetch at every
    /// [`SWEEP_STRIDE`](super::super::SWEEP_STRIDE) floats of it). Formed with
    /// `wrapping_add`: past the matrix for the last blocks, where a prefetch is harmless.
    #[inline(always)]
    pub(super) fn at(&self, a: &Mat, i: usize, j0: usize, w: usize, off: usize) -> *const f32 {
        if self.linear {
            // The strip's place in the block's walk (strips before it take `rows` runs of
            // their width each, its rows before `i` one run of `w` each), then that
            // offset in the later block, row-major along the panel.
            let t = (j0 - self.col0) * self.rows + (i - self.row0) * w + off;
            let q = ((t as u64 * self.inv) >> 32) as usize;
            let c = t - q * self.width;
            a.m.wrapping_add((self.row0 + self.ahead_rows + q) * a.cols + self.col0 + c)
        } else {
            a.m.wrapping_add((i + self.ahead_rows) * a.cols + j0 + off)
        }
    }

    /// Whether `at` takes memory order (see [`Sweep`]).
    #[inline(always)]
    pub(super) fn is_linear(&self) -> bool {
        self.linear
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(n: usize, cols: usize) -> Mat {
        Mat {
            n,
            cols,
            r: 1,
            m: std::ptr::null_mut(),
            q: std::ptr::null_mut(),
            p: std::ptr::null_mut(),
            e: std::ptr::null_mut(),
        }
    }

    /// The division by the panel's width through the reciprocal is exact for every
    /// offset a block can take, at every width up to the panels' (and odd ones).
    #[test]
    fn the_reciprocal_divides_exactly() {
        for width in [1, 3, 8, 16, 100, 1000, 1024, 2047, 2048, 3000, 4095, 4096] {
            let s = Sweep::new(8, true, &(0..64), &(0..width));
            assert!(s.linear, "width {width}");
            for t in (0..64 * width).step_by(7).chain([64 * width - 1]) {
                let q = ((t as u64 * s.inv) >> 32) as usize;
                assert_eq!(q, t / width, "t {t} width {width}");
            }
        }
    }

    /// Memory order: the prefetches of a block's strips, in the order the strips run,
    /// walk the block `ahead_rows` further down line after line along the panel, and
    /// touch each of its lines (a panel narrower than the rows, as a thread's share of
    /// the columns, strips of two widths and a ragged lead).
    #[test]
    fn memory_order_walks_the_later_block_line_by_line() {
        let (n, cols) = (64, 96);
        let a = mat(n, cols);
        let (rows, panel) = (8..14, 20..84);
        let s = Sweep::new(16, true, &rows, &panel);
        // Strips: a part of 12 columns, then 32, 16, 4 wide (floats a row).
        let strips = [(20, 12), (32, 32), (64, 16), (80, 4)];
        let mut seen = Vec::new();
        for &(j0, w) in &strips {
            for i in rows.clone() {
                for off in (0..w).step_by(4) {
                    let at = s.at(&a, i, j0, w, off) as usize / 4;
                    seen.push(at);
                }
            }
        }
        // In order, 4 floats apart, within the panel of rows 24..30.
        let want: Vec<usize> = (24..30)
            .flat_map(|row| {
                (panel.start..panel.end)
                    .step_by(4)
                    .map(move |c| row * cols + c)
            })
            .collect();
        assert_eq!(seen, want);
        // By rows: the strip's own columns 16 rows down.
        let by_rows = Sweep::new(16, false, &rows, &panel);
        assert_eq!(by_rows.at(&a, 9, 32, 32, 4) as usize / 4, 25 * cols + 36);
        assert_eq!(s.by_rows(), by_rows);
        assert!(!Sweep::new(0, true, &rows, &panel).is_on());
    }
}
