//! PowerSGD against exact references on 2 and 4 thread ranks: the exact mean where the
//! algorithm must be exact, the best rank-r approximation where it must converge to it,
//! the error-feedback identity, rank agreement, resumption and every validation error.

use collectives::{run_local, ProcessGroup};
use ddp_hooks::{CommHook, CompressionStats, Error, GradBucket, Layout, PowerSgd, PowerSgdConfig};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;

fn config(rank: usize, start: u64) -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: rank,
        start_powersgd_iter: start,
        ..PowerSgdConfig::default()
    }
}

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

/// Runs `steps` synchronised steps of a one-bucket model on `ranks` thread ranks;
/// returns every rank's output of every step, and each rank's hook afterwards.
fn run(
    ranks: usize,
    steps: usize,
    cfg: &PowerSgdConfig,
    layout: &Arc<Layout>,
    grad: impl Fn(usize, usize) -> Vec<f32> + Sync,
) -> Vec<(Vec<Vec<f32>>, ddp_hooks::PowerSgdState)> {
    run_local(ranks, |g| {
        let rank = g.rank();
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let mut hook = PowerSgd::new(be, Arc::new(g), cfg.clone()).unwrap();
        let outs = (0..steps)
            .map(|s| {
                let bucket = GradBucket::new(0, 1, grad(rank, s), layout.clone()).unwrap();
                hook.run(bucket).wait().unwrap()
            })
            .collect();
        (outs, hook.save().unwrap())
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

fn mean_of(ranks: usize, step: usize, grad: &impl Fn(usize, usize) -> Vec<f32>) -> Vec<f64> {
    let gs: Vec<Vec<f32>> = (0..ranks).map(|r| grad(r, step)).collect();
    (0..gs[0].len())
        .map(|i| gs.iter().map(|g| g[i] as f64).sum::<f64>() / ranks as f64)
        .collect()
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let d: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let n: f64 = want.iter().map(|w| w * w).sum();
    (d / n.max(1e-300)).sqrt()
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// A layout with a compressible matrix, a bias and a small matrix that fails the test.
fn mixed_layout() -> Arc<Layout> {
    Arc::new(Layout::packed(&[vec![32, 48], vec![32], vec![3, 2]]).unwrap())
}

#[test]
fn vanilla_phase_is_the_exact_mean() {
    let layout = mixed_layout();
    for ranks in [2, 4] {
        let grad = |r: usize, s: usize| random(layout.len(), (r * 100 + s) as u64);
        let out = run(ranks, 5, &config(2, 5), &layout, grad);
        for s in 0..5 {
            let want = mean_of(ranks, s, &grad);
            for (outs, _) in &out {
                assert!(rel_err(&outs[s], &want) < 1e-6, "step {s}");
            }
        }
        assert_eq!(out[0].1.iter, 5);
        assert_eq!(
            out[0].1.total_before, 0,
            "no compression stats in the vanilla phase"
        );
    }
}

#[test]
fn uncompressed_tensors_are_exact_and_ranks_agree_bit_for_bit() {
    let layout = mixed_layout();
    let (mat, bias, small) = (32 * 48, 32, 6);
    for ranks in [2, 4] {
        let grad = |r: usize, s: usize| random(layout.len(), (r * 100 + s) as u64 + 7);
        let out = run(ranks, 6, &config(1, 2), &layout, grad);
        for s in 2..6 {
            let want = mean_of(ranks, s, &grad);
            let unc = mat..mat + bias + small;
            for (outs, _) in &out {
                assert_eq!(outs[s], out[0].0[s], "ranks must agree bit for bit");
                assert!(rel_err(&outs[s][unc.clone()], &want[unc.clone()]) < 1e-6);
                assert!(outs[s].iter().all(|x| x.is_finite()));
            }
        }
    }
}

#[test]
fn rank_one_inputs_with_enough_rank_give_the_exact_mean() {
    let (n, m) = (40, 56);
    let layout = Arc::new(Layout::packed(&[vec![n, m]]).unwrap());
    for ranks in [2, 4] {
        // Each rank's gradient is u_r v_rᵀ, so the mean has rank <= ranks.
        let grad = |r: usize, s: usize| {
            let (u, v) = (
                random(n, (r * 10 + s) as u64),
                random(m, (r * 10 + s + 1000) as u64),
            );
            (0..n * m)
                .map(|i| u[i / m] * v[i % m])
                .collect::<Vec<f32>>()
        };
        let cfg = PowerSgdConfig {
            use_error_feedback: false,
            warm_start: false,
            ..config(ranks, 0)
        };
        let out = run(ranks, 3, &cfg, &layout, grad);
        for s in 0..3 {
            let want = mean_of(ranks, s, &grad);
            for (outs, _) in &out {
                let e = rel_err(&outs[s], &want);
                assert!(e < 1e-4, "{ranks} ranks step {s}: relative error {e}");
            }
        }
    }
}

/// Orthonormal columns (f64 Gram-Schmidt, twice for accuracy).
fn orthonormal(rows: usize, cols: usize, seed: u64) -> Vec<Vec<f64>> {
    let raw = random(rows * cols, seed);
    let mut q: Vec<Vec<f64>> = (0..cols)
        .map(|c| (0..rows).map(|i| raw[c * rows + i] as f64).collect())
        .collect();
    for _ in 0..2 {
        for c in 0..cols {
            for k in 0..c {
                let d: f64 = (0..rows).map(|i| q[c][i] * q[k][i]).sum();
                let qk = q[k].clone();
                q[c].iter_mut().zip(&qk).for_each(|(x, y)| *x -= d * y);
            }
            let nrm = norm(&q[c]);
            q[c].iter_mut().for_each(|x| *x /= nrm);
        }
    }
    q
}

#[test]
fn warm_start_converges_to_the_best_rank_r_approximation() {
    // M = U diag(2^-k) Vᵀ with orthonormal U, V: its singular values are 2^-k exactly, so
    // the best rank-r error is sqrt(Σ_{k>=r} 4^-k) (Eckart-Young) — a decaying spectrum,
    // so an algorithm that does not converge fails this test.
    let (n, m, k) = (48, 40, 12);
    let (u, v) = (orthonormal(n, k, 1), orthonormal(m, k, 2));
    let mut mat = vec![0.0f64; n * m];
    for (s, (uc, vc)) in u.iter().zip(&v).enumerate() {
        let sigma = 0.5f64.powi(s as i32);
        for i in 0..n {
            for j in 0..m {
                mat[i * m + j] += sigma * uc[i] * vc[j];
            }
        }
    }
    let m32: Vec<f32> = mat.iter().map(|&x| x as f32).collect();
    let layout = Arc::new(Layout::packed(&[vec![n, m]]).unwrap());
    for r in [1, 2, 4] {
        let best: f64 = (r..k).map(|s| 0.25f64.powi(s as i32)).sum::<f64>().sqrt();
        let cfg = PowerSgdConfig {
            use_error_feedback: false,
            ..config(r, 2)
        };
        for ranks in [2, 4] {
            let out = run(ranks, 22, &cfg, &layout, |_, _| m32.clone());
            let last = &out[0].0[21];
            let err: f64 = last
                .iter()
                .zip(&mat)
                .map(|(&a, &b)| (a as f64 - b).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(
                err <= 1.01 * best,
                "rank {r}, {ranks} ranks: {err} > 1.01 x {best}"
            );
        }
    }
}

#[test]
fn error_feedback_loses_nothing() {
    // Σ_t output_t + mean_i(final error_i) = Σ_t mean_i(g_i,t) on the compressed tensor.
    let layout = Arc::new(Layout::packed(&[vec![24, 30]]).unwrap());
    for ranks in [2, 4] {
        let grad = |r: usize, s: usize| random(layout.len(), (r * 1000 + s) as u64 + 3);
        let steps = 12;
        let out = run(ranks, steps, &config(1, 2), &layout, grad);
        let mut lhs = vec![0.0f64; layout.len()];
        for s in 0..steps {
            for (i, x) in out[0].0[s].iter().enumerate() {
                lhs[i] += *x as f64;
            }
        }
        for (_, state) in &out {
            for (i, e) in state.buckets[&0].error.iter().enumerate() {
                lhs[i] += *e as f64 / ranks as f64;
            }
        }
        let mut rhs = vec![0.0f64; layout.len()];
        for s in 0..steps {
            for (i, x) in mean_of(ranks, s, &grad).iter().enumerate() {
                rhs[i] += x;
            }
        }
        let diff: Vec<f64> = lhs.iter().zip(&rhs).map(|(a, b)| a - b).collect();
        assert!(
            norm(&diff) <= 1e-4 * norm(&rhs),
            "{ranks} ranks: {} vs {}",
            norm(&diff),
            norm(&rhs)
        );
    }
}

#[test]
fn zero_gradients_give_zeros_never_nan() {
    let layout = mixed_layout();
    let out = run(2, 4, &config(2, 2), &layout, |_, _| vec![0.0; layout.len()]);
    for (outs, _) in out {
        for o in outs {
            assert!(o.iter().all(|&x| x == 0.0), "zero in, zero out");
        }
    }
}

#[test]
fn compression_stats_follow_the_formula() {
    // [32 x 48] compressed at rank 2: 32*48 before, (32+48)*2 after; the bias (32) and
    // the 3 x 2 matrix ((3+2)*2*2 = 20 >= 6) are sent whole.
    let layout = mixed_layout();
    let steps = 5u64;
    let start = 2u64;
    let out = run_local(2, |g| {
        let be = Arc::new(CpuBackend::new());
        let mut hook = PowerSgd::new(be, Arc::new(g), config(2, start)).unwrap();
        assert_eq!(hook.compression_stats(), CompressionStats::default());
        for s in 0..steps {
            let b = GradBucket::new(0, 1, random(layout.len(), s), layout.clone()).unwrap();
            hook.run(b).wait().unwrap();
        }
        hook.compression_stats()
    })
    .unwrap();
    let compressed_steps = steps - start;
    let before = compressed_steps * (32 * 48 + 32 + 6);
    let after = compressed_steps * ((32 + 48) * 2 + 32 + 6);
    for r in out {
        assert_eq!(
            r.unwrap(),
            CompressionStats {
                before,
                after,
                ratio: before as f64 / after as f64,
                nonfinite_steps: 0,
            }
        );
    }
}

#[test]
fn save_load_continues_exactly() {
    let layout = mixed_layout();
    let grad = |r: usize, s: usize| random(layout.len(), (r * 77 + s) as u64);
    let cfg = config(2, 3);
    let full = run(2, 10, &cfg, &layout, grad);
    // Run 6 steps, save (through JSON), load into fresh hooks on a fresh group, run 4.
    let saved: Vec<String> = run(2, 6, &cfg, &layout, grad)
        .into_iter()
        .map(|(_, st)| serde_json::to_string(&st).unwrap())
        .collect();
    let resumed = run_local(2, |g| {
        let rank = g.rank();
        let state = serde_json::from_str(&saved[rank]).unwrap();
        let mut hook = PowerSgd::load(
            Arc::new(CpuBackend::new().with_threads(1).unwrap()),
            Arc::new(g),
            state,
        )
        .unwrap();
        (6..10)
            .map(|s| {
                hook.run(GradBucket::new(0, 1, grad(rank, s), layout.clone()).unwrap())
                    .wait()
                    .unwrap()
            })
            .collect::<Vec<_>>()
    })
    .unwrap();
    for (rank, r) in resumed.into_iter().enumerate() {
        assert_eq!(
            r.unwrap(),
            full[rank].0[6..10].to_vec(),
            "rank {rank} diverged after resuming"
        );
    }
}

#[test]
fn validation_errors_name_the_bad_value() {
    let bad = [
        (
            PowerSgdConfig {
                matrix_approximation_rank: 0,
                ..Default::default()
            },
            "matrix_approximation_rank = 0",
        ),
        (
            PowerSgdConfig {
                matrix_approximation_rank: 65,
                ..Default::default()
            },
            "matrix_approximation_rank = 65",
        ),
        (
            PowerSgdConfig {
                min_compression_rate: 0.0,
                ..Default::default()
            },
            "min_compression_rate = 0",
        ),
        (
            PowerSgdConfig {
                min_compression_rate: f64::NAN,
                ..Default::default()
            },
            "min_compression_rate = NaN",
        ),
        (
            PowerSgdConfig {
                orthogonalization_epsilon: -1e-8,
                ..Default::default()
            },
            "orthogonalization_epsilon",
        ),
        (
            PowerSgdConfig {
                compression_stats_logging_frequency: 0,
                ..Default::default()
            },
            "compression_stats_logging_frequency = 0",
        ),
    ];
    for (cfg, msg) in bad {
        let e = cfg.validate().unwrap_err();
        assert!(matches!(&e, Error::Config(m) if m.contains(msg)), "{e}");
    }
    // PyTorch's rule and message, for every combination it rejects.
    for start in [0, 1] {
        for (ef, ws) in [(true, true), (true, false), (false, true)] {
            let cfg = PowerSgdConfig {
                start_powersgd_iter: start,
                use_error_feedback: ef,
                warm_start: ws,
                ..Default::default()
            };
            let e = cfg.validate().unwrap_err();
            assert!(e.to_string().contains("Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is enabled"), "{e}");
        }
        let ok = PowerSgdConfig {
            start_powersgd_iter: start,
            use_error_feedback: false,
            warm_start: false,
            ..Default::default()
        };
        assert!(ok.validate().is_ok());
    }
    assert!(PowerSgdConfig::default().validate().is_ok());
}

#[test]
fn a_bucket_whose_length_changes_is_an_error() {
    let out = run_local(2, |g| {
        let mut hook =
            PowerSgd::new(Arc::new(CpuBackend::new()), Arc::new(g), config(1, 2)).unwrap();
        let l1 = Arc::new(Layout::packed(&[vec![16, 16]]).unwrap());
        let l2 = Arc::new(Layout::packed(&[vec![16, 17]]).unwrap());
        for s in 0..3 {
            hook.run(GradBucket::new(0, 1, random(256, s), l1.clone()).unwrap())
                .wait()
                .unwrap();
        }
        hook.run(GradBucket::new(0, 1, random(272, 9), l2).unwrap())
            .wait()
    })
    .unwrap();
    for r in out {
        let e = r.unwrap().unwrap_err();
        assert!(
            e.to_string().contains("bucket 0") && e.to_string().contains("changed"),
            "{e}"
        );
    }
}

#[test]
fn batched_powersgd_compresses_a_non_square_bucket_and_loses_nothing() {
    use ddp_hooks::BatchedPowerSgd;
    let layout = Arc::new(Layout::packed(&[vec![20, 50]]).unwrap()); // 1000 elements: side 32
    let grad = |r: usize, s: usize| random(1000, (r * 31 + s) as u64);
    let steps = 8;
    for ranks in [2, 4] {
        let out = run_local(ranks, |g| {
            let rank = g.rank();
            let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
            let mut hook = BatchedPowerSgd::new(be, Arc::new(g), config(1, 2)).unwrap();
            let outs: Vec<Vec<f32>> = (0..steps)
                .map(|s| {
                    hook.run(GradBucket::new(0, 1, grad(rank, s), layout.clone()).unwrap())
                        .wait()
                        .unwrap()
                })
                .collect();
            (outs, hook.save().unwrap(), hook.compression_stats())
        })
        .unwrap();
        let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
        // Stats as PyTorch counts them: 1000 before, 2 * 32 * 1 after, per compressed step.
        assert_eq!(out[0].2, CompressionStats::new(6000, 384));
        assert_eq!(out[0].2.ratio, 1000.0 / 64.0);
        let mut lhs = vec![0.0f64; 1000];
        for s in 0..steps {
            for (r, (outs, _, _)) in out.iter().enumerate() {
                assert_eq!(outs[s], out[0].0[s], "rank {r} differs at step {s}");
            }
            for (i, x) in out[0].0[s].iter().enumerate() {
                lhs[i] += *x as f64;
            }
        }
        for (_, state, _) in &out {
            assert_eq!(
                state.buckets[&0].error.len(),
                32 * 32,
                "the error covers the padded matrix"
            );
            for (i, e) in state.buckets[&0].error[..1000].iter().enumerate() {
                lhs[i] += *e as f64 / ranks as f64;
            }
        }
        let mut rhs = vec![0.0f64; 1000];
        for s in 0..steps {
            for (i, x) in mean_of(ranks, s, &grad).iter().enumerate() {
                rhs[i] += x;
            }
        }
        let diff: Vec<f64> = lhs.iter().zip(&rhs).map(|(a, b)| a - b).collect();
        assert!(
            norm(&diff) <= 1e-4 * norm(&rhs),
            "{ranks} ranks: {} vs {}",
            norm(&diff),
            norm(&rhs)
        );
        // Compressed steps are approximations, not the mean.
        assert!(rel_err(&out[0].0[5], &mean_of(ranks, 5, &grad)) > 0.1);
    }
}
