use super::*;

fn naive(a: View<'_>, b: View<'_>, c: &mut ViewMut<'_>, accumulate: bool) {
    for i in 0..a.rows {
        for j in 0..b.cols {
            let mut s = 0.0f64;
            for k in 0..a.cols {
                s +=
                    f64::from(a.data[i * a.rs + k * a.cs]) * f64::from(b.data[k * b.rs + j * b.cs]);
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
                    let case =
                        format!("({m}, {k}, {n}) layout {layout} accumulate {accumulate} at {idx}");
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
