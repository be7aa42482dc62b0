//! Every primitive checked against a naive `f64` reference, written once over `Backend`:
//! on every CPU instruction set with 1 and 2 threads, and (with the `cuda` feature, where
//! a GPU is present) on CUDA.

use lowrank::{bf16, f16, Backend, CpuBackend, Dims, Element, Error, Isa, NormalRng, MAX_RANK};

/// Shapes (batch, n, m, r) covering the edges: empty batch, n = 1, n < r, m < r, sizes
/// that are not multiples of the vector width, every tile width of the rank.
const SHAPES: &[(usize, usize, usize, usize)] = &[
    (0, 5, 7, 2),
    (1, 1, 1, 1),
    (1, 1, 37, 3),
    (3, 17, 1, 1),
    (2, 3, 40, 5),
    (2, 40, 3, 5),
    (1, 33, 65, 8),
    (4, 19, 23, 4),
    (1, 70, 129, 13),
    (2, 64, 64, 64),
    (1, 300, 257, 2),
    (1, 9, 1000, 7),
    (1, 600, 1100, 6),
    (3, 257, 511, 1),
    // Wide enough for several column panels of `Mᵀ P`.
    (1, 5, 5000, 8),
    (2, 3, 2100, 16),
];

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

/// Runs `op` on the backend with device copies of `inputs`, returns the mutable operands.
fn on<B: Backend>(be: &B, host: &[f32]) -> B::Buffer<f32> {
    be.upload(host).expect("upload")
}

fn back<B: Backend>(be: &B, buf: &B::Buffer<f32>) -> Vec<f32> {
    let mut out = vec![0.0; B::buffer_len(buf)];
    be.download(B::view(buf, ..).unwrap(), &mut out)
        .expect("download");
    out
}

fn v<B: Backend>(b: &B::Buffer<f32>) -> B::View<'_, f32> {
    B::view(b, ..).unwrap()
}

fn vm<B: Backend>(b: &mut B::Buffer<f32>) -> B::ViewMut<'_, f32> {
    B::view_mut(b, ..).unwrap()
}

// Naive references in f64. Factors are column-major: P[k * n + i], Q[k * m + j].
fn ref_mq(d: Dims, m: &[f32], q: &[f32]) -> Vec<f64> {
    let mut p = vec![0.0; d.p_len()];
    for b in 0..d.batch() {
        for k in 0..d.r() {
            for i in 0..d.n() {
                p[b * d.n() * d.r() + k * d.n() + i] = (0..d.m())
                    .map(|j| {
                        m[b * d.n() * d.m() + i * d.m() + j] as f64
                            * q[b * d.m() * d.r() + k * d.m() + j] as f64
                    })
                    .sum();
            }
        }
    }
    p
}

fn ref_mtp(d: Dims, m: &[f32], p: &[f32]) -> Vec<f64> {
    let mut q = vec![0.0; d.q_len()];
    for b in 0..d.batch() {
        for k in 0..d.r() {
            for j in 0..d.m() {
                q[b * d.m() * d.r() + k * d.m() + j] = (0..d.n())
                    .map(|i| {
                        m[b * d.n() * d.m() + i * d.m() + j] as f64
                            * p[b * d.n() * d.r() + k * d.n() + i] as f64
                    })
                    .sum();
            }
        }
    }
    q
}

fn ref_pqt(d: Dims, p: &[f32], q: &[f32]) -> Vec<f64> {
    let mut m = vec![0.0; d.m_len()];
    for b in 0..d.batch() {
        for i in 0..d.n() {
            for j in 0..d.m() {
                m[b * d.n() * d.m() + i * d.m() + j] = (0..d.r())
                    .map(|k| {
                        p[b * d.n() * d.r() + k * d.n() + i] as f64
                            * q[b * d.m() * d.r() + k * d.m() + j] as f64
                    })
                    .sum();
            }
        }
    }
    m
}

/// Norm-wise relative error `‖got - want‖ / ‖want‖` must be within
/// `1e-5 · sqrt(inner)`; an all-zero reference needs an all-zero result.
fn assert_close(what: &str, got: &[f32], want: &[f64], inner: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite output"
    );
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = want.iter().map(|w| w * w).sum::<f64>().sqrt();
    let tol = 1e-5 * (inner.max(1) as f64).sqrt();
    assert!(
        diff <= tol * norm,
        "{what}: relative error {} > {tol}",
        diff / norm
    );
}

/// The edge shapes above plus 40 random ones (a fixed seed, so a failure reproduces).
fn shapes() -> Vec<(usize, usize, usize, usize)> {
    let mut g = NormalRng::new(2024);
    let mut pick = |lo: u64, hi: u64| (lo + g.next_u64() % (hi - lo + 1)) as usize;
    let mut v = SHAPES.to_vec();
    for _ in 0..40 {
        v.push((pick(0, 3), pick(1, 90), pick(1, 90), pick(1, 12)));
    }
    v
}

fn check_products<B: Backend>(be: &B) {
    for (s, &(batch, n, m, r)) in shapes().iter().enumerate() {
        let d = Dims::new(batch, n, m, r).unwrap();
        let name = |op: &str| format!("{} {op} on {d}", be.name());
        let seed = 100 * s as u64;
        let (hm, hq, hp) = (
            random(d.m_len(), seed),
            random(d.q_len(), seed + 1),
            random(d.p_len(), seed + 2),
        );
        let (bm, bq, bp) = (on(be, &hm), on(be, &hq), on(be, &hp));

        let mut out = be.alloc::<f32>(d.p_len()).unwrap();
        be.mq(d, v::<B>(&bm), v::<B>(&bq), vm::<B>(&mut out))
            .unwrap();
        assert_close(&name("M Q"), &back(be, &out), &ref_mq(d, &hm, &hq), m);

        let mut out = be.alloc::<f32>(d.q_len()).unwrap();
        be.mtp(d, v::<B>(&bm), v::<B>(&bp), vm::<B>(&mut out))
            .unwrap();
        assert_close(&name("Mᵀ P"), &back(be, &out), &ref_mtp(d, &hm, &hp), n);

        let mut out = on(be, &random(d.m_len(), seed + 3)); // overwritten, not accumulated
        be.pqt(d, v::<B>(&bp), v::<B>(&bq), vm::<B>(&mut out))
            .unwrap();
        assert_close(&name("P Qᵀ"), &back(be, &out), &ref_pqt(d, &hp, &hq), r);

        // x = g + e; P = x Q.
        let he = random(d.m_len(), seed + 4);
        let (mut g, e) = (on(be, &hm), on(be, &he));
        let mut p = be.alloc::<f32>(d.p_len()).unwrap();
        be.add_mq(d, vm::<B>(&mut g), v::<B>(&e), v::<B>(&bq), vm::<B>(&mut p))
            .unwrap();
        let x: Vec<f32> = hm.iter().zip(&he).map(|(a, b)| a + b).collect();
        assert_eq!(back(be, &g), x, "{}: x = g + e", name("add_mq"));
        assert_close(&name("add_mq P"), &back(be, &p), &ref_mq(d, &x, &hq), m);

        // M̂ = P Qᵀ written over x; e = x - M̂.
        let mut xm = on(be, &x);
        let mut e = on(be, &random(d.m_len(), seed + 5));
        be.pqt_error(
            d,
            v::<B>(&bp),
            v::<B>(&bq),
            vm::<B>(&mut xm),
            vm::<B>(&mut e),
        )
        .unwrap();
        let want = ref_pqt(d, &hp, &hq);
        assert_close(&name("pqt_error M̂"), &back(be, &xm), &want, r);
        let want_e: Vec<f64> = x.iter().zip(&want).map(|(&x, &w)| x as f64 - w).collect();
        let tol_e: Vec<f64> = want_e.clone();
        let got_e = back(be, &e);
        // The error is x - M̂ with M̂ computed in f32: compare with the f64 error using the
        // magnitude of x, not of the (possibly cancelled) error, as the scale.
        let scale: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        let diff: f64 = got_e
            .iter()
            .zip(&tol_e)
            .map(|(&g, &w)| (g as f64 - w).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(
            diff <= 1e-5 * (r as f64).sqrt() * scale.max(1e-30),
            "{}: error update off by {diff}",
            name("pqt_error")
        );
    }
}

/// Columns of a column-major `n x r` factor.
fn columns(x: &[f32], n: usize) -> Vec<&[f32]> {
    x.chunks(n.max(1)).collect()
}

fn gram(x: &[f32], n: usize, r: usize) -> Vec<Vec<f64>> {
    let c = columns(x, n);
    (0..r)
        .map(|a| {
            (0..r)
                .map(|b| {
                    c[a].iter()
                        .zip(c[b])
                        .map(|(&u, &v)| u as f64 * v as f64)
                        .sum()
                })
                .collect()
        })
        .collect()
}

fn orth<B: Backend>(be: &B, batch: usize, n: usize, r: usize, x: &[f32], eps: f32) -> Vec<f32> {
    let mut buf = on(be, x);
    be.orthogonalize(batch, n, r, vm::<B>(&mut buf), eps)
        .unwrap();
    back(be, &buf)
}

/// Orthonormal columns in f64: Gram-Schmidt twice on `r` random columns of `n`.
fn orthonormal_f64(n: usize, r: usize, seed: u64) -> Vec<Vec<f64>> {
    let x = random(n * r, seed);
    let mut cols: Vec<Vec<f64>> = columns(&x, n)
        .iter()
        .map(|c| c.iter().map(|&v| v as f64).collect())
        .collect();
    for _pass in 0..2 {
        for i in 0..r {
            for j in 0..i {
                let d: f64 = cols[i].iter().zip(&cols[j]).map(|(a, b)| a * b).sum();
                let cj = cols[j].clone();
                cols[i].iter_mut().zip(&cj).for_each(|(a, b)| *a -= d * b);
            }
            let norm = cols[i].iter().map(|a| a * a).sum::<f64>().sqrt();
            cols[i].iter_mut().for_each(|a| *a /= norm);
        }
    }
    cols
}

/// A column-major `n x r` f32 matrix `U diag(s) Vᵀ` with singular values from 1 down to
/// `1 / cond` (geometric): a full-rank input of condition number `cond`.
fn conditioned(n: usize, r: usize, cond: f64, seed: u64) -> Vec<f32> {
    let u = orthonormal_f64(n, r, seed);
    let v = orthonormal_f64(r, r, seed + 1);
    let s: Vec<f64> = (0..r)
        .map(|k| cond.powf(-(k as f64) / (r.max(2) - 1) as f64))
        .collect();
    let mut x = vec![0.0f32; n * r];
    for j in 0..r {
        for i in 0..n {
            let val: f64 = (0..r).map(|k| u[k][i] * s[k] * v[k][j]).sum();
            x[j * n + i] = val as f32;
        }
    }
    x
}

/// max |PᵀP − I|, evaluated in f64.
fn orthogonality_error(p: &[f32], n: usize, r: usize) -> f64 {
    let g = gram(p, n, r);
    let mut worst = 0.0f64;
    for (a, row) in g.iter().enumerate() {
        for (c, &val) in row.iter().enumerate() {
            worst = worst.max((val - if a == c { 1.0 } else { 0.0 }).abs());
        }
    }
    worst
}

/// Regression (issue 8 item 10, issue 14): orthogonality to f32 precision for ill-
/// conditioned full-rank input (one modified Gram-Schmidt pass gave 3.7e-5 at condition
/// 1.8e3 and 2.2e-4 at 6.5e3); norms that neither overflow nor underflow; non-finite
/// input propagates as NaN instead of being zeroed.
fn check_orthogonalize_precision<B: Backend>(be: &B) {
    for &(n, r, cond) in &[
        (64, 64, 1.8e3),
        (64, 64, 6.5e3),
        (64, 64, 1e5),
        (1000, 8, 1e5),
        (4096, 4, 1e5),
        (4096, 16, 1e5),
    ] {
        let x = conditioned(n, r, cond, n as u64 + r as u64);
        let y = orth(be, 1, n, r, &x, 0.0);
        let err = orthogonality_error(&y, n, r);
        assert!(
            err <= 2e-6,
            "{}: max |PᵀP - I| = {err:e} for n={n} r={r} cond={cond:e}",
            be.name()
        );
    }
    // Finite columns near the top of f32's range: a naive sum of squares overflows and
    // the column was zeroed. The result equals that of the same column scaled down.
    let n = 300;
    let base = random(n * 3, 21);
    let huge: Vec<f32> = base.iter().map(|v| v * 2e19).collect();
    let tiny: Vec<f32> = base.iter().map(|v| v * 1e-30).collect();
    let want = orth(be, 1, n, 3, &base, 0.0);
    for (what, x) in [("huge", &huge), ("tiny", &tiny)] {
        let got = orth(be, 1, n, 3, x, 0.0);
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff < 1e-5,
            "{}: {what} columns differ from unit-scale ones by {diff}",
            be.name()
        );
    }
    // Epsilon is scaled with a rescaled column: `c / (‖c‖ + eps)` as for the original.
    let got = orth(be, 1, n, 1, &tiny[..n], 1e-8);
    let norm = tiny[..n]
        .iter()
        .map(|&v| (v as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let want_len = norm / (norm + 1e-8);
    let got_len = got.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
    assert!(
        (got_len - want_len).abs() < 1e-6 * want_len.max(1e-30) + 1e-30,
        "{}: eps on a tiny column: length {got_len:e}, want {want_len:e}",
        be.name()
    );
    // Non-finite input: every column of that matrix is NaN; other matrices unaffected.
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let (n, r) = (40, 3);
        let mut x = random(2 * n * r, 5);
        x[n * r + n + 7] = bad; // matrix 1, column 1
        let y = orth(be, 2, n, r, &x, 0.0);
        assert!(
            y[n * r..].iter().all(|v| v.is_nan()),
            "{}: {bad} in the input must make the whole matrix NaN",
            be.name()
        );
        assert!(
            y[..n * r].iter().all(|v| v.is_finite()),
            "{}: a NaN in one matrix leaked into another",
            be.name()
        );
    }
}

fn check_orthogonalize<B: Backend>(be: &B) {
    // Well-conditioned (random) input: PᵀP = I within 1e-5.
    for &(batch, n, r) in &[
        (1, 1, 1),
        (3, 50, 4),
        (2, 1000, 8),
        (1, 4096, 2),
        (1, 200, 64),
    ] {
        let x = orth(be, batch, n, r, &random(batch * n * r, n as u64), 0.0);
        for b in 0..batch {
            let g = gram(&x[b * n * r..(b + 1) * n * r], n, r);
            for (a, row) in g.iter().enumerate() {
                for (c, &val) in row.iter().enumerate() {
                    let want = if a == c { 1.0 } else { 0.0 };
                    assert!(
                        (val - want).abs() < 1e-5,
                        "{}: PᵀP[{a}][{c}] = {val} for n={n} r={r}",
                        be.name()
                    );
                }
            }
        }
    }
    // The same random input gives the same columns as the CPU backend (modified
    // Gram-Schmidt has no sign freedom), within rounding.
    let (batch, n, r) = (3, 300, 6);
    let x = random(batch * n * r, 77);
    let got = orth(be, batch, n, r, &x, 1e-8);
    let want = orth(&CpuBackend::new(), batch, n, r, &x, 1e-8);
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        diff < 1e-5,
        "{}: differs from the CPU backend by {diff}",
        be.name()
    );
    // Zero input gives zeros, never NaN, with and without epsilon.
    for eps in [0.0, 1e-8] {
        let x = orth(be, 2, 33, 3, &vec![0.0; 2 * 33 * 3], eps);
        assert!(
            x.iter().all(|&v| v == 0.0),
            "{}: zero input must stay zero",
            be.name()
        );
    }
    // Rank-deficient: column 2 = 2 * column 0 + column 1 becomes exactly zero; a zero
    // column in the middle stays zero and does not disturb the others.
    let n = 77;
    let mut x = random(n * 4, 9);
    let (c0, c1) = (x[..n].to_vec(), x[n..2 * n].to_vec());
    for i in 0..n {
        x[2 * n + i] = 2.0 * c0[i] + c1[i];
    }
    let y = orth(be, 1, n, 4, &x, 0.0);
    assert!(
        y[2 * n..3 * n].iter().all(|&v| v == 0.0),
        "{}: dependent column must be zero",
        be.name()
    );
    let g = gram(&y, n, 4);
    for a in [0, 1, 3] {
        assert!((g[a][a] - 1.0).abs() < 1e-5);
        for c in [0, 1, 3] {
            if a != c {
                assert!(g[a][c].abs() < 1e-5);
            }
        }
    }
    // r > n: the first n columns span the space, the rest become zero.
    let (n, r) = (3, 6);
    let y = orth(be, 1, n, r, &random(n * r, 11), 0.0);
    assert!(
        y[n * n..].iter().all(|&v| v == 0.0),
        "{}: surplus columns must be zero",
        be.name()
    );
    let g = gram(&y, n, n);
    for (a, row) in g.iter().enumerate() {
        assert!((row[a] - 1.0).abs() < 1e-5);
    }
    // Regression: the uncapped threshold 8·n·ε reaches 1 at n ≈ 10^6 and zeroed every
    // column of such a factor; long independent columns must survive.
    let n = (1 << 20) + 5;
    let y = orth(be, 1, n, 2, &random(2 * n, 13), 0.0);
    let g = gram(&y, n, 2);
    assert!(
        (g[0][0] - 1.0).abs() < 1e-4 && (g[1][1] - 1.0).abs() < 1e-4 && g[0][1].abs() < 1e-4,
        "{}: long columns: {g:?}",
        be.name()
    );
    // Epsilon as PyTorch: c / (‖c‖ + eps).
    let x = vec![3.0, 4.0];
    let y = orth(be, 1, 2, 1, &x, 1.0);
    assert!((y[0] - 0.5).abs() < 1e-6 && (y[1] - 4.0 / 6.0).abs() < 1e-6);
}

fn orth_refill<B: Backend>(
    be: &B,
    (batch, n, r): (usize, usize, usize),
    x: &[f32],
    key: u64,
) -> Vec<f32> {
    let mut buf = on(be, x);
    be.orthogonalize_refill(batch, n, r, vm::<B>(&mut buf), 0.0, key)
        .unwrap();
    back(be, &buf)
}

/// `orthogonalize_refill`: a zero matrix and a rank-1 matrix come back with `min(n, r)`
/// orthonormal columns (the refilled ones from `refill_value`, the same bits everywhere),
/// a full-rank matrix exactly as `orthogonalize` leaves it; the key decides the refill.
fn check_orthogonalize_refill<B: Backend>(be: &B) {
    // Serial (n < 8) and block paths, r > n included.
    for &(n, r) in &[(5, 2), (3, 5), (300, 4), (1000, 8), (64, 64)] {
        let batch = 3;
        let per = n * r;
        let mut x = vec![0.0f32; batch * per];
        // Matrix 1: every column a multiple of one vector (rank 1).
        let u = random(n, 5);
        for k in 0..r {
            for i in 0..n {
                x[per + k * n + i] = u[i] * (k as f32 + 1.0);
            }
        }
        // Matrix 2: random, full rank.
        x[2 * per..].copy_from_slice(&random(per, 6));
        let got = orth_refill(be, (batch, n, r), &x, 11);
        let plain = orth(be, batch, n, r, &x, 0.0);
        let full = n.min(r);
        for b in 0..batch {
            let m = &got[b * per..(b + 1) * per];
            let cols = columns(m, n);
            let nonzero: Vec<usize> = (0..r)
                .filter(|&k| cols[k].iter().any(|&v| v != 0.0))
                .collect();
            assert_eq!(
                nonzero.len(),
                full,
                "{}: matrix {b} of {n}x{r} has {} non-zero columns after the refill",
                be.name(),
                nonzero.len()
            );
            let g = gram(m, n, r);
            for &a in &nonzero {
                for &c in &nonzero {
                    let want = if a == c { 1.0 } else { 0.0 };
                    assert!(
                        (g[a][c] - want).abs() < 1e-5,
                        "{}: matrix {b} of {n}x{r}: PᵀP[{a}][{c}] = {}",
                        be.name(),
                        g[a][c]
                    );
                }
            }
        }
        // Full rank: untouched by the refill, bit for bit.
        assert_eq!(
            &got[2 * per..],
            &plain[2 * per..],
            "{}: full-rank matrix changed",
            be.name()
        );
        // The zero matrix: the orthogonalised refill values of attempt 0, within rounding
        // (a backend may launch differently for one matrix than for three).
        let filled: Vec<f32> = (0..per)
            .map(|i| lowrank::refill_value(11, 0, i as u64))
            .collect();
        let want = orth(be, 1, n, r, &filled, 0.0);
        let diff = got[..per]
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff < 1e-5,
            "{}: refilled zero matrix differs by {diff}",
            be.name()
        );
        // Same key, same bits; another key, another refill.
        assert_eq!(orth_refill(be, (batch, n, r), &x, 11), got);
        assert_ne!(orth_refill(be, (batch, n, r), &x, 12)[..per], got[..per]);
        // Against the CPU backend, within rounding.
        let cpu = orth_refill(&CpuBackend::new(), (batch, n, r), &x, 11);
        let diff = got
            .iter()
            .zip(&cpu)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff < 1e-4,
            "{}: differs from the CPU backend by {diff}",
            be.name()
        );
    }
    // NaN in, NaN out: no refill of a NaN matrix.
    let mut x = vec![0.0f32; 40];
    x[3] = f32::NAN;
    assert!(orth_refill(be, (1, 10, 4), &x, 1)
        .iter()
        .all(|v| v.is_nan()));
}

fn check_elementwise<B: Backend>(be: &B) {
    for len in [0, 1, 15, 1000, 300_001] {
        let (a, b) = (random(len, 1), random(len, 2));
        let mut y = on(be, &a);
        be.add(vm::<B>(&mut y), v::<B>(&on(be, &b))).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_eq!(back(be, &y), want, "{}: add", be.name());

        be.scale(vm::<B>(&mut y), -0.5).unwrap();
        let want: Vec<f32> = want.iter().map(|x| x * -0.5).collect();
        assert_eq!(back(be, &y), want, "{}: scale", be.name());

        let mut c = be.alloc::<f32>(len).unwrap();
        be.copy(v::<B>(&y), vm::<B>(&mut c)).unwrap();
        assert_eq!(back(be, &c), want, "{}: copy", be.name());
        be.zero(vm::<B>(&mut c)).unwrap();
        assert!(back(be, &c).iter().all(|&x| x == 0.0));

        check_cast::<B, f16>(be, &a);
        check_cast::<B, bf16>(be, &a);
    }
    // Values that test rounding and the special cases of the half formats.
    let special = [
        0.0,
        -0.0,
        1.0,
        65504.0,
        65520.0,
        1e-8,
        6e-8,
        -3.1e-5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        3.4e38,
    ];
    check_cast::<B, f16>(be, &special);
    check_cast::<B, bf16>(be, &special);
    // NaN stays NaN.
    let mut h = be.alloc::<f16>(1).unwrap();
    be.cast::<f32, f16>(
        v::<B>(&on(be, &[f32::NAN])),
        B::view_mut(&mut h, ..).unwrap(),
    )
    .unwrap();
    let mut out = [f16::ZERO];
    be.download(B::view(&h, ..).unwrap(), &mut out).unwrap();
    assert!(out[0].is_nan());
}

/// The non-finite flag and the operations it guards: `flag_nonfinite` raises it for a
/// NaN or an infinity anywhere (any length, any position: the GPU's grid-stride loop and
/// the CPU's chunks), never for finite values, and never lowers it; `copy_unflagged` and
/// `pqt_error_unflagged` write `dst` and the error only while it is down, and the
/// approximation always (bit for bit `pqt_error`'s).
fn check_flags<B: Backend>(be: &B) {
    let flag_of = |x: &[f32]| {
        let mut f = on(be, &[0.0]);
        be.flag_nonfinite(v::<B>(&on(be, x)), vm::<B>(&mut f))
            .unwrap();
        back(be, &f)[0]
    };
    for len in [1, 17, 1000, 300_001] {
        let mut x = random(len, 9);
        x[len / 2] = f32::MAX;
        x[0] = -f32::MIN_POSITIVE / 4.0; // subnormal
        assert_eq!(
            flag_of(&x),
            0.0,
            "{}: finite values raised the flag",
            be.name()
        );
        for (at, bad) in [
            (0, f32::NAN),
            (len - 1, f32::INFINITY),
            (len / 3, f32::NEG_INFINITY),
        ] {
            let mut y = x.clone();
            y[at] = bad;
            assert_eq!(flag_of(&y), 1.0, "{}: {bad} at {at} of {len}", be.name());
        }
    }
    // Never lowered.
    let mut f = on(be, &[1.0]);
    be.flag_nonfinite(v::<B>(&on(be, &[0.0; 8])), vm::<B>(&mut f))
        .unwrap();
    assert_eq!(back(be, &f), [1.0]);
    let (up, down) = (on(be, &[1.0]), on(be, &[0.0]));
    let src = random(1000, 4);
    let mut dst = on(be, &[7.0; 1000]);
    be.copy_unflagged(v::<B>(&on(be, &src)), vm::<B>(&mut dst), v::<B>(&up))
        .unwrap();
    assert_eq!(
        back(be, &dst),
        [7.0; 1000],
        "{}: copied under a raised flag",
        be.name()
    );
    be.copy_unflagged(v::<B>(&on(be, &src)), vm::<B>(&mut dst), v::<B>(&down))
        .unwrap();
    assert_eq!(
        back(be, &dst),
        src,
        "{}: not copied under a lowered flag",
        be.name()
    );
    // pqt_error under either flag, against pqt_error itself.
    let d = Dims::new(2, 70, 130, 3).unwrap();
    let (p, q, m) = (
        random(d.p_len(), 1),
        random(d.q_len(), 2),
        random(d.m_len(), 3),
    );
    let e0 = random(d.m_len(), 5);
    let (mut m_ref, mut e_ref) = (on(be, &m), on(be, &e0));
    let (pb, qb) = (on(be, &p), on(be, &q));
    be.pqt_error(
        d,
        v::<B>(&pb),
        v::<B>(&qb),
        vm::<B>(&mut m_ref),
        vm::<B>(&mut e_ref),
    )
    .unwrap();
    for (flag, want_e) in [(&down, back(be, &e_ref)), (&up, e0.clone())] {
        let (mut mm, mut ee) = (on(be, &m), on(be, &e0));
        be.pqt_error_unflagged(
            d,
            v::<B>(&pb),
            v::<B>(&qb),
            vm::<B>(&mut mm),
            vm::<B>(&mut ee),
            v::<B>(flag),
        )
        .unwrap();
        assert_eq!(
            back(be, &mm),
            back(be, &m_ref),
            "{}: approximation",
            be.name()
        );
        assert_eq!(
            back(be, &ee),
            want_e,
            "{}: error under flag {:?}",
            be.name(),
            back(be, flag)
        );
    }
    // A flag is one element.
    let mut two = on(be, &[0.0, 0.0]);
    assert!(be
        .flag_nonfinite(v::<B>(&on(be, &[1.0])), vm::<B>(&mut two))
        .is_err());
    let mut one = on(be, &[0.0]);
    assert!(be
        .copy_unflagged(v::<B>(&on(be, &[1.0])), vm::<B>(&mut one), v::<B>(&two))
        .is_err());
}

/// `f32 -> T -> f32` matches the `half` crate's round-to-nearest-even conversions.
fn check_cast<B: Backend, T: Element>(be: &B, a: &[f32]) {
    let mut h = be.alloc::<T>(a.len()).unwrap();
    be.cast::<f32, T>(v::<B>(&on(be, a)), B::view_mut(&mut h, ..).unwrap())
        .unwrap();
    let mut hh = vec![T::default(); a.len()];
    be.download(B::view(&h, ..).unwrap(), &mut hh).unwrap();
    let want: Vec<T> = a.iter().map(|&x| T::from_f32(x)).collect();
    assert_eq!(hh, want, "{}: f32 -> {}", be.name(), T::NAME);
    let mut back32 = be.alloc::<f32>(a.len()).unwrap();
    be.cast::<T, f32>(B::view(&h, ..).unwrap(), vm::<B>(&mut back32))
        .unwrap();
    let want: Vec<f32> = want.iter().map(|x| x.to_f32()).collect();
    assert_eq!(back(be, &back32), want, "{}: {} -> f32", be.name(), T::NAME);
}

fn check_fill_normal<B: Backend>(be: &B) {
    let mut buf = be.alloc::<f32>(1001).unwrap();
    be.fill_normal(&mut NormalRng::new(5), vm::<B>(&mut buf))
        .unwrap();
    let mut want = vec![0.0; 1001];
    NormalRng::new(5).fill(&mut want);
    assert_eq!(
        back(be, &buf),
        want,
        "{}: fill_normal must draw on the host",
        be.name()
    );
}

fn check_bad_input<B: Backend>(be: &B) {
    let d = Dims::new(2, 4, 3, 2).unwrap();
    let (m, q, p) = (on(be, &[0.0; 24]), on(be, &[0.0; 12]), on(be, &[0.0; 16]));
    let mut short = be.alloc::<f32>(15).unwrap();
    let err = be
        .mq(d, v::<B>(&m), v::<B>(&q), vm::<B>(&mut short))
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BufferSize {
                name: "p",
                expected: 16,
                actual: 15,
                ..
            }
        ),
        "{err}"
    );
    let err = be
        .mtp(d, v::<B>(&p), v::<B>(&p), vm::<B>(&mut short))
        .unwrap_err();
    assert!(matches!(err, Error::BufferSize { name: "m", .. }), "{err}");
    let mut mm = on(be, &[0.0; 24]);
    let err = be
        .pqt(d, v::<B>(&p), v::<B>(&m), vm::<B>(&mut mm))
        .unwrap_err();
    assert!(matches!(err, Error::BufferSize { name: "q", .. }), "{err}");
    assert!(matches!(Dims::new(1, 4, 4, 0), Err(Error::InvalidRank(0))));
    assert!(matches!(
        Dims::new(1, 4, 4, MAX_RANK + 1),
        Err(Error::InvalidRank(65))
    ));
    assert!(matches!(
        Dims::new(usize::MAX, 2, 2, 1),
        Err(Error::Overflow(_))
    ));
    let mut x = on(be, &[1.0; 8]);
    assert!(matches!(
        be.orthogonalize(1, 4, 2, vm::<B>(&mut x), -1.0),
        Err(Error::InvalidEpsilon(_))
    ));
    assert!(matches!(
        be.orthogonalize(1, 4, 2, vm::<B>(&mut x), f32::NAN),
        Err(Error::InvalidEpsilon(_))
    ));
    assert!(matches!(
        be.orthogonalize(1, 4, 3, vm::<B>(&mut x), 0.0),
        Err(Error::BufferSize { .. })
    ));
    assert!(matches!(
        be.orthogonalize(1, 4, 0, vm::<B>(&mut x), 0.0),
        Err(Error::InvalidRank(0))
    ));
    assert!(matches!(
        be.scale(vm::<B>(&mut x), f32::INFINITY),
        Err(Error::InvalidScale(_))
    ));
    assert!(matches!(
        be.add(vm::<B>(&mut x), v::<B>(&q)),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        B::view(&x, 4..9),
        Err(Error::OutOfBounds {
            start: 4,
            end: 9,
            len: 8
        })
    ));
    let mut host = [0.0f32; 3];
    assert!(matches!(
        be.download(v::<B>(&x), &mut host),
        Err(Error::LengthMismatch { .. })
    ));
}

/// Sub-views address the right elements (what the hooks use to carve P and Q memory).
fn check_views<B: Backend>(be: &B) {
    let d = Dims::new(1, 3, 4, 1).unwrap();
    let host: Vec<f32> = (0..20).map(|x| x as f32).collect();
    let buf = on(be, &host);
    let mut p = on(be, &[0.0; 10]);
    // M = host[2..14], Q = host[14..18], P written into p[5..8].
    be.mq(
        d,
        B::view(&buf, 2..14).unwrap(),
        B::view(&buf, 14..18).unwrap(),
        B::view_mut(&mut p, 5..8).unwrap(),
    )
    .unwrap();
    let want = ref_mq(d, &host[2..14], &host[14..18]);
    let got = back(be, &p);
    assert_eq!(&got[..5], &[0.0; 5]);
    assert_close("view", &got[5..8], &want, 4);
    assert_eq!(&got[8..], &[0.0; 2]);
    // pqt_error on views that start off 16-byte alignment with m % 4 == 0 (the CUDA
    // kernel's element-by-element path): M = buf2[2..14] (rows of 4), E = e[1..13].
    let mut m2 = on(be, &host);
    let mut e = on(be, &[0.0; 14]);
    be.pqt_error(
        d,
        B::view(&buf, 14..17).unwrap(),
        B::view(&buf, 16..20).unwrap(),
        B::view_mut(&mut m2, 2..14).unwrap(),
        B::view_mut(&mut e, 1..13).unwrap(),
    )
    .unwrap();
    let want = ref_pqt(d, &host[14..17], &host[16..20]);
    let (got_m, got_e) = (back(be, &m2), back(be, &e));
    assert_close("pqt_error view M", &got_m[2..14], &want, 1);
    let want_e: Vec<f64> = host[2..14]
        .iter()
        .zip(&want)
        .map(|(&x, &w)| x as f64 - w)
        .collect();
    assert_close("pqt_error view E", &got_e[1..13], &want_e, 1);
    assert_eq!((&got_m[..2], &got_m[14..]), (&host[..2], &host[14..]));
    assert_eq!((got_e[0], got_e[13]), (0.0, 0.0));
}

fn cpu_backends() -> Vec<CpuBackend> {
    Isa::supported()
        .into_iter()
        .flat_map(|isa| [1, 2].map(|t| cpu_with(isa, t)))
        .collect()
}

macro_rules! cpu_tests {
    ($($check:ident),* $(,)?) => {
        mod cpu {
            $(
                #[test]
                fn $check() {
                    for be in super::cpu_backends() {
                        super::$check(&be);
                    }
                }
            )*
        }

        /// Every check on CUDA, in one test so that a machine without a GPU prints one line.
        #[cfg(feature = "cuda")]
        #[test]
        fn cuda_all_primitives() {
            let be = match lowrank::CudaBackend::new(0) {
                Ok(be) => be,
                Err(Error::CudaUnavailable(why)) => {
                    println!("skipped: no CUDA driver ({why})");
                    return;
                }
                Err(e) => panic!("CUDA present but failed to start: {e}"),
            };
            $(
                $check(&be);
                println!("cuda {}: ok", stringify!($check));
            )*
        }
    };
}

cpu_tests!(
    check_products,
    check_orthogonalize,
    check_orthogonalize_precision,
    check_orthogonalize_refill,
    check_elementwise,
    check_flags,
    check_fill_normal,
    check_bad_input,
    check_views,
);

/// The CPU backend with the kernels of `isa` on `threads` threads.
fn cpu_with(isa: Isa, threads: usize) -> CpuBackend {
    CpuBackend::new()
        .with_isa(isa)
        .unwrap()
        .with_threads(threads)
        .unwrap()
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let d = Dims::new(1, 1024, 1536, 3).unwrap();
    let (m, q, p) = (
        random(d.m_len(), 1),
        random(d.q_len(), 2),
        random(d.p_len(), 3),
    );
    for isa in Isa::supported() {
        let run = |threads: usize| {
            let be = cpu_with(isa, threads);
            let (mut po, mut qo, mut mo) = (
                vec![0.0; d.p_len()],
                vec![0.0; d.q_len()],
                vec![0.0; d.m_len()],
            );
            be.mq(d, &m, &q, &mut po).unwrap();
            be.mtp(d, &m, &p, &mut qo).unwrap();
            be.pqt(d, &p, &q, &mut mo).unwrap();
            (po, qo, mo)
        };
        let one = run(1);
        assert!(
            one == run(2) && one == run(3),
            "{isa:?}: results changed with the thread count"
        );
    }
}

/// `Mᵀ P` (8 lanes) and `M = P Qᵀ` (with and without the error) read and write `M` in
/// whole lines from its rows' first 64-byte boundary on, `M Q` and `M += E; M Q` in whole
/// vectors from its rows' first vector boundary: the same matrix at every offset
/// from a boundary (0..16 floats) gives the same bits as at the first, on every ISA and
/// thread count, with panels, row blocks, ragged columns and rows that are not whole
/// lines apart.
#[test]
fn products_do_not_depend_on_where_m_lies() {
    for &(batch, n, m, r) in &[
        (1, 70, 1024, 4),
        (1, 9, 4608, 8),
        (2, 33, 528, 5),
        (1, 40, 48, 3),
        (1, 21, 1000, 8),
        (1, 5, 16, 1),
        (1, 300, 1024, 2),
        (1, 150, 1024, 1),
    ] {
        let d = Dims::new(batch, n, m, r).unwrap();
        let (x, p, q) = (
            random(d.m_len(), 41),
            random(d.p_len(), 42),
            random(d.q_len(), 43),
        );
        let mhat = ref_pqt(d, &p, &q);
        let err = random(d.m_len(), 44);
        let mut buf = vec![0.0f32; d.m_len() + 32];
        let mut ebuf = vec![0.0f32; d.m_len() + 32];
        let mut gbuf = vec![0.0f32; d.m_len() + 32];
        let mut g_e = vec![0.0f32; d.m_len() + 32];
        let mut x_plus_e = x.clone();
        for (g, e) in x_plus_e.iter_mut().zip(&err) {
            *g += e;
        }
        for isa in Isa::supported() {
            for threads in [1, 2] {
                let be = cpu_with(isa, threads);
                let mut first = None;
                for off in 0..16 {
                    let span = off..off + d.m_len();
                    buf[span.clone()].copy_from_slice(&x);
                    let mut qo = vec![0.0; d.q_len()];
                    be.mtp(d, &buf[span.clone()], &p, &mut qo).unwrap();
                    // `M Q` and `M += E; M Q`, with `E` at another offset than `M`.
                    let (mut po, mut po_fused) = (vec![0.0; d.p_len()], vec![0.0; d.p_len()]);
                    be.mq(d, &buf[span.clone()], &q, &mut po).unwrap();
                    let espan = (15 - off)..(15 - off) + d.m_len();
                    gbuf[span.clone()].copy_from_slice(&x);
                    g_e[espan.clone()].copy_from_slice(&err);
                    be.add_mq(d, &mut gbuf[span.clone()], &g_e[espan], &q, &mut po_fused)
                        .unwrap();
                    be.pqt_error(d, &p, &q, &mut buf[span.clone()], &mut ebuf[span.clone()])
                        .unwrap();
                    let (fused, e) = (buf[span.clone()].to_vec(), ebuf[span.clone()].to_vec());
                    be.pqt(d, &p, &q, &mut buf[span.clone()]).unwrap();
                    let got = (
                        qo,
                        fused,
                        e,
                        buf[span.clone()].to_vec(),
                        po,
                        po_fused,
                        gbuf[span].to_vec(),
                    );
                    match &first {
                        None => {
                            let what = |k: &str| format!("{isa:?} {k} on {d}");
                            assert_close(&what("mtp"), &got.0, &ref_mtp(d, &x, &p), n);
                            assert_close(&what("pqt_error"), &got.1, &mhat, r);
                            assert_close(&what("pqt"), &got.3, &mhat, r);
                            assert_close(&what("mq"), &got.4, &ref_mq(d, &x, &q), m);
                            assert_close(&what("add_mq"), &got.5, &ref_mq(d, &x_plus_e, &q), m);
                            assert!(got.6 == x_plus_e, "{isa:?} add_mq on {d}: M + E");
                            first = Some(got);
                        }
                        Some(f) => assert!(
                            f == &got,
                            "{isa:?} {threads} threads {d}: results changed with M {off} floats further"
                        ),
                    }
                }
            }
        }
    }
}

/// `M Q` where every product underflows: with fused multiply-adds (AVX2, AVX-512) each
/// sum is -0, and stays so wherever `M` lies (the lanes of a vector that fall outside a
/// row must not be accumulated, even as zeros: -0 + +0 is +0); the portable kernels'
/// separate multiply and add give +0 everywhere.
#[test]
fn mq_keeps_the_sign_of_a_zero_sum_wherever_m_lies() {
    for &(n, m, r) in &[(6, 64, 1), (6, 64, 2), (5, 48, 8), (3, 1024, 4)] {
        let d = Dims::new(1, n, m, r).unwrap();
        let q = vec![1e-30f32; d.q_len()];
        let mut buf = vec![0.0f32; d.m_len() + 16];
        for isa in Isa::supported() {
            let be = cpu_with(isa, 1);
            let zero = if isa == Isa::Portable { 0.0f32 } else { -0.0 };
            for off in 0..16 {
                buf[off..off + d.m_len()].fill(-1e-30);
                let mut p = vec![1.0f32; d.p_len()];
                be.mq(d, &buf[off..off + d.m_len()], &q, &mut p).unwrap();
                assert!(
                    p.iter().all(|x| x.to_bits() == zero.to_bits()),
                    "{isa:?} {d} at offset {off}: {:?}, want {zero:?}",
                    &p[..p.len().min(4)]
                );
            }
        }
    }
}

/// `Mᵀ P` over several column panels and row blocks (4096 columns a panel, 128 KiB a
/// block), odd ranks that take several column tiles, and `M̂ = P Qᵀ` with the error update
/// over two-row tiles and a leftover row (and `Mᵀ P` streaming rows with 8 lanes, in
/// tiles of two columns of `Q` and one): each against the f64 reference, and the same
/// bits on every thread count.
#[test]
fn blocked_mtp_and_pqt_match_the_reference_and_every_thread_count() {
    for (batch, n, m, r) in [
        (1, 37, 5000, 8),
        (1, 70, 1100, 3),
        (2, 19, 2053, 16),
        (1, 9, 4111, 5),
        (1, 130, 257, 1),
        (1, 3, 8200, 2),
        // 8 lanes, r <= 2: the row-streaming kernel, blocks of 4 rows and a remainder,
        // ragged columns, and (1 MiB or more a call) the sweep ahead.
        (2, 45, 1031, 2),
        (1, 70, 4100, 1),
        // 1 MiB or more a call on one thread: the fused `P Qᵀ` sweeps M and E ahead,
        // two-row tiles and a leftover row (r = 8), single rows (r = 4, ragged). With 8
        // lanes `Mᵀ P` takes the strips on one thread and the row-streaming kernel on two
        // or three (less than 1 MiB each) at r = 4 to 7, the two must give the same bits;
        // at r <= 3 and r >= 8 the stream on every thread count, sweeping on one. On AMD
        // Zen 5 with AVX-512, `Mᵀ P` at r = 4 takes 512 KiB row blocks on one thread (1
        // MiB or more from memory) and 256 KiB on two.
        (1, 67, 4100, 8),
        (1, 65, 4107, 4),
        (1, 64, 4096, 5),
        (1, 64, 4096, 7),
        (1, 64, 4096, 3),
    ]
    .into_iter()
    // Every rank from 1 to 17, each with rows left over past every row tile: the
    // kernels choose their tiles and walks by rank (`pqt` compiles only the row tiles
    // its constant ranks take), and a rank sent down a walk it lacks fails here.
    .chain((1..=17).map(|r| (1, 7, 70, r)))
    {
        let d = Dims::new(batch, n, m, r).unwrap();
        let (x, p, q) = (
            random(d.m_len(), 17),
            random(d.p_len(), 18),
            random(d.q_len(), 19),
        );
        for isa in Isa::supported() {
            let run = |threads: usize| {
                let be = cpu_with(isa, threads);
                let mut qo = vec![0.0; d.q_len()];
                be.mtp(d, &x, &p, &mut qo).unwrap();
                let (mut mo, mut eo) = (x.clone(), vec![0.0; d.m_len()]);
                be.pqt_error(d, &p, &q, &mut mo, &mut eo).unwrap();
                (qo, mo, eo)
            };
            let one = run(1);
            assert_close(
                &format!("{isa:?} mtp on {d}"),
                &one.0,
                &ref_mtp(d, &x, &p),
                n,
            );
            let mhat = ref_pqt(d, &p, &q);
            assert_close(&format!("{isa:?} pqt on {d}"), &one.1, &mhat, r);
            let err: Vec<f64> = x.iter().zip(&mhat).map(|(&a, &b)| a as f64 - b).collect();
            assert_close(&format!("{isa:?} pqt_error's e on {d}"), &one.2, &err, r);
            assert!(
                one == run(2) && one == run(3),
                "{isa:?} {d}: results changed with the thread count"
            );
        }
    }
}

/// Wide `Q`s (more than 16 KiB) take the chunked `M Q` kernel (columns in chunks that keep `Q` in
/// L1, rows in blocks): shapes with several chunks, ragged columns, row blocks with a
/// remainder, and a rank past one register tile; and two narrower ones read in whole rows. Each must match the f64 reference, the
/// fused `add_mq` must give exactly what `mq` gives on `g + e`, and no result may depend
/// on the thread count.
#[test]
fn chunked_mq_matches_the_reference_the_fused_path_and_every_thread_count() {
    for (batch, n, m, r) in [
        (1, 37, 1100, 8),
        (1, 37, 1100, 4),
        (2, 21, 2053, 4),
        (1, 23, 1500, 2),
        (1, 9, 3001, 12),
        (2, 19, 2053, 16),
        (1, 33, 600, 24),
        (1, 16, 4096, 8),
        (3, 5, 17, 8),
        // Whole rows (Q within 16 KiB), the fused pass's groups of two rows at r = 4 and
        // 5 with AVX-512 and a row left over.
        (2, 13, 1024, 4),
        (1, 7, 1000, 5),
        // Q of 32 KiB: whole rows where L1 has 48 KiB, column chunks where it has 32.
        (1, 11, 1024, 8),
    ]
    .into_iter()
    // Every rank from 1 to 17: each sequence of column tiles, in groups of every row
    // count with rows left over. The kernels compile only the tiles their ranks meet
    // (`tile_occurs`), so a rank whose tiles were left out fails here.
    .chain((1..=17).map(|r| (1, 7, 70, r)))
    {
        let d = Dims::new(batch, n, m, r).unwrap();
        let (g, e, q) = (
            random(d.m_len(), 7),
            random(d.m_len(), 8),
            random(d.q_len(), 9),
        );
        let x: Vec<f32> = g.iter().zip(&e).map(|(a, b)| a + b).collect();
        for isa in Isa::supported() {
            let run = |threads: usize| {
                let be = cpu_with(isa, threads);
                let mut p = vec![0.0; d.p_len()];
                be.mq(d, &x, &q, &mut p).unwrap();
                let (mut gf, mut pf) = (g.clone(), vec![0.0; d.p_len()]);
                be.add_mq(d, &mut gf, &e, &q, &mut pf).unwrap();
                assert_eq!(gf, x, "{isa:?} {d}: add_mq's g + e");
                assert!(
                    pf == p,
                    "{isa:?} {d}: add_mq's P differs from mq's on g + e"
                );
                p
            };
            let one = run(1);
            assert_close(&format!("{isa:?} mq on {d}"), &one, &ref_mq(d, &x, &q), m);
            assert!(
                one == run(2) && one == run(3),
                "{isa:?} {d}: results changed with the thread count"
            );
        }
    }
}

#[test]
fn unsupported_isa_and_zero_threads_are_errors() {
    assert!(matches!(
        CpuBackend::new().with_threads(0),
        Err(Error::InvalidThreads)
    ));
    for isa in [Isa::Avx512, Isa::Avx2] {
        if !isa.is_supported() {
            assert!(matches!(
                CpuBackend::new().with_isa(isa),
                Err(Error::UnsupportedIsa(_))
            ));
        }
    }
}
