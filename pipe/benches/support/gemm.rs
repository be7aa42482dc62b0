//! The GEMM rows: Linear(1024, 1024)'s three products (forward `y = x·W`, input gradient
//! `dx = dy·Wᵀ`, weight gradient `dW += xᵀ·dy`) at 32 and 256 rows, on `pipe`'s own kernel
//! (in the forms `Linear` calls it), on `matrixmultiply` (what ndarray's `dot` uses) and on
//! the `gemm` crate (`Parallelism::None`), one thread each, as GFLOP/s and as the ratio of
//! the library's rate to ours.
//!
//! The three run in turn, round after round, each timed over enough calls to take a few
//! milliseconds; a rate is the median over the rounds, so that the noise of a shared
//! machine falls on all three alike.

use std::hint::black_box;
use std::time::Instant;

use pipe::cpu::matmul::{gemm, has_kernel, View, ViewMut};

/// One of Linear's products.
#[derive(Clone, Copy)]
pub enum Product {
    Forward,
    InputGrad,
    WeightGrad,
}

impl Product {
    pub const ALL: [Product; 3] = [Product::Forward, Product::InputGrad, Product::WeightGrad];

    pub fn name(self) -> &'static str {
        match self {
            Product::Forward => "forward",
            Product::InputGrad => "input gradient",
            Product::WeightGrad => "weight gradient",
        }
    }
}

/// A measured row: GFLOP/s of ours, matrixmultiply's and gemm's.
pub struct Row {
    pub product: Product,
    pub rows: usize,
    pub ours: f64,
    pub matrixmultiply: f64,
    pub gemm: f64,
}

/// The operands of one product: `x` (`rows × WIDTH`), `W` and its transpose (`WIDTH ×
/// WIDTH`, stored `[inputs, outputs]` as `Linear` keeps it), `dy` and the output.
struct Operands {
    rows: usize,
    width: usize,
    x: Vec<f32>,
    w: Vec<f32>,
    wt: Vec<f32>,
    dy: Vec<f32>,
    out: Vec<f32>,
}

impl Operands {
    fn new(rows: usize, width: usize) -> Self {
        let fill = |n: usize, seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 7 + seed * 13) % 101) as f32 / 101.0 - 0.5)
                .collect()
        };
        let w = fill(width * width, 2);
        let mut wt = vec![0.0; width * width];
        for i in 0..width {
            for j in 0..width {
                wt[j * width + i] = w[i * width + j];
            }
        }
        Operands {
            rows,
            width,
            x: fill(rows * width, 1),
            w,
            wt,
            dy: fill(rows * width, 3),
            out: vec![0.0; width * width.max(rows)],
        }
    }

    /// Ours, as `Linear` calls it (its `TRANSPOSED_*_ROWS` thresholds are 512 rows, above
    /// both sizes here; without the AVX-512 kernel its forward pass takes `y = x W`).
    fn ours(&mut self, p: Product) {
        let (r, n) = (self.rows, self.width);
        match p {
            Product::Forward if !has_kernel() => {
                let y = ViewMut::row_major(&mut self.out[..r * n], r, n);
                let x = View::row_major(&self.x, r, n);
                gemm(x, View::row_major(&self.w, n, n), y, true);
            }
            Product::Forward => {
                let y = ViewMut::row_major(&mut self.out[..r * n], r, n);
                let x = View::row_major(&self.x, r, n);
                gemm(View::row_major(&self.wt, n, n), x.t(), y.t(), true);
            }
            Product::InputGrad => {
                let dx = ViewMut::row_major(&mut self.out[..r * n], r, n);
                let dy = View::row_major(&self.dy, r, n);
                gemm(View::row_major(&self.w, n, n), dy.t(), dx.t(), false);
            }
            Product::WeightGrad => {
                let dw = ViewMut::row_major(&mut self.out[..n * n], n, n);
                let xt = View::row_major(&self.x, r, n).t();
                gemm(xt, View::row_major(&self.dy, r, n), dw, true);
            }
        }
    }

    /// `(m, k, n, a, (rsa, csa), b, (rsb, csb), accumulate)` of the product, every
    /// output row-major.
    #[allow(clippy::type_complexity)]
    fn operands(
        &self,
        p: Product,
    ) -> (
        usize,
        usize,
        usize,
        &[f32],
        (isize, isize),
        &[f32],
        (isize, isize),
        bool,
    ) {
        let (r, n) = (self.rows, self.width as isize);
        let w = self.width;
        match p {
            Product::Forward => (r, w, w, &self.x, (n, 1), &self.w, (n, 1), true),
            Product::InputGrad => (r, w, w, &self.dy, (n, 1), &self.w, (1, n), false),
            Product::WeightGrad => (w, r, w, &self.x, (1, n), &self.dy, (n, 1), true),
        }
    }

    fn matrixmultiply(&mut self, p: Product) {
        let (m, k, n, a, (rsa, csa), b, (rsb, csb), acc) = self.operands(p);
        let (a, b) = (a.as_ptr(), b.as_ptr());
        let c = self.out[..m * n].as_mut_ptr();
        // SAFETY: `a` is `m × k` and `b` `k × n` at the strides given, inside their
        // vectors (`x`, `dy`: `rows × width`, `w`: `width × width`); `c` is `m × n`
        // row-major inside `out`, which aliases neither.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a,
                rsa,
                csa,
                b,
                rsb,
                csb,
                if acc { 1.0 } else { 0.0 },
                c,
                n as isize,
                1,
            );
        }
    }

    fn gemm_crate(&mut self, p: Product) {
        let (m, k, n, a, (rsa, csa), b, (rsb, csb), acc) = self.operands(p);
        let (a, b) = (a.as_ptr(), b.as_ptr());
        let c = self.out[..m * n].as_mut_ptr();
        // SAFETY: as in `matrixmultiply` above; gemm takes column strides first.
        unsafe {
            ::gemm::gemm(
                m,
                n,
                k,
                c,
                1,
                n as isize,
                acc,
                a,
                csa,
                rsa,
                b,
                csb,
                rsb,
                1.0,
                1.0,
                false,
                false,
                false,
                ::gemm::Parallelism::None,
            );
        }
    }
}

/// Median of `v`.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Every row, `rounds` rounds each.
pub fn rows(width: usize, rounds: usize) -> Vec<Row> {
    let mut out = Vec::new();
    for rows in [32, 256] {
        let mut ops = Operands::new(rows, width);
        let flop = 2.0 * (rows * width * width) as f64;
        // About 5 ms per timing at 100 GFLOP/s.
        let calls = (5e8 / flop).ceil().max(1.0) as usize;
        for p in Product::ALL {
            let mut rates: [Vec<f64>; 3] = Default::default();
            for round in 0..rounds + 1 {
                for turn in 0..3 {
                    let which = (turn + round) % 3;
                    let start = Instant::now();
                    for _ in 0..calls {
                        match which {
                            0 => ops.ours(p),
                            1 => ops.matrixmultiply(p),
                            _ => ops.gemm_crate(p),
                        }
                    }
                    black_box(&ops.out);
                    let rate = flop * calls as f64 / start.elapsed().as_secs_f64().max(1e-9) / 1e9;
                    // Round 0 warms up.
                    if round > 0 {
                        rates[which].push(rate);
                    }
                }
            }
            let [ours, mm, gm] = rates.map(median);
            out.push(Row {
                product: p,
                rows,
                ours,
                matrixmultiply: mm,
                gemm: gm,
            });
        }
    }
    out
}
