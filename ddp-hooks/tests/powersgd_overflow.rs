//! Overflow steps (issue 29, item 1): a compressed step whose gradient holds a NaN or an
//! infinity (an overflow step of mixed-precision training) must not poison PowerSGD.
//! The step's output is non-finite, so a loss scaler sees the overflow and skips the
//! optimizer step; the hook's memories (error feedback, `P`, `Q`) stay exactly as before
//! the step, so the run goes on as if the step had never happened.
//!
//! Before the fix the error memory took the NaN (`E = X - M̂`), every later output was
//! NaN (while `run` returned `Ok`), and `save` refused the state.

mod common;

use collectives::{run_local_with_timeout, ProcessGroup};
use ddp_hooks::{
    BatchedPowerSgd, CommHook, GradBucket, HookSpec, Layout, PowerSgd, PowerSgdConfig, Reducer,
    ReducerConfig,
};
use lowrank::{Backend, CpuBackend, NormalRng};
use std::sync::Arc;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(60);
const RANKS: usize = 2;
const STEPS: usize = 20;
/// The overflow step (PowerSGD compresses from step 2).
const OVERFLOW: usize = 11;

/// Where the stand-in overflow puts its infinity.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Overflow {
    /// None: the reference run, which skips the overflow step altogether.
    Skipped,
    /// Every parameter's gradient on rank 1 (an overflowed loss reaches them all).
    Everywhere,
}

/// Trains a least-squares model, `loss_r = ½ Σ_p ‖w_p - t_{r,p}‖²` plus per-step
/// noise, on `RANKS` thread ranks for `STEPS` steps through the reducer with `spec`,
/// SGD with momentum; a loss scaler stand-in skips the optimizer step whenever a reduced
/// gradient is not finite. Returns every rank's final parameters and the hook's count of
/// held bucket steps.
fn train(spec: &str, overflow: Overflow) -> Vec<(Vec<Vec<f32>>, u64, usize)> {
    let spec: HookSpec = spec.parse().unwrap();
    run_local_with_timeout(RANKS, TIMEOUT, move |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = Arc::new(CpuBackend::new());
        let hook = spec.build(be.clone(), group.clone()).unwrap();
        let config = ReducerConfig::default();
        // Matrices PowerSGD compresses and vectors it does not (tests/common).
        let shapes = common::shapes();
        let mut reducer = Reducer::new(be.clone(), &shapes, hook, config)
            .unwrap()
            .with_process_group(group);
        // Two buckets, whatever the caps: each holds one step of the overflow.
        reducer
            .set_bucket_params(vec![vec![5, 4, 3], vec![2, 1, 0]])
            .unwrap();
        assert_eq!(reducer.bucket_count(), 2);
        let fill = |len: usize, seed: u64| {
            let mut v = vec![0.0f32; len];
            NormalRng::new(seed).fill(&mut v);
            v
        };
        let n = shapes.len();
        let mut params: Vec<Vec<f32>> = (0..n)
            .map(|p| fill(shapes[p].iter().product(), 7 + p as u64))
            .collect();
        let targets: Vec<Vec<f32>> = (0..n)
            .map(|p| fill(params[p].len(), (1000 * (rank + 1) + p) as u64))
            .collect();
        let mut velocity: Vec<Vec<f32>> = params.iter().map(|w| vec![0.0; w.len()]).collect();
        let (lr, momentum) = (0.1f32, 0.9f32);
        let mut skipped = 0;
        for step in 0..STEPS {
            if step == OVERFLOW && overflow == Overflow::Skipped {
                continue;
            }
            for p in (0..n).rev() {
                let noise = fill(params[p].len(), (rank * 100_000 + step * 100 + p) as u64);
                let mut grad: Vec<f32> = params[p]
                    .iter()
                    .zip(&targets[p])
                    .zip(&noise)
                    .map(|((w, t), e)| w - t + 0.1 * e)
                    .collect();
                if step == OVERFLOW && overflow == Overflow::Everywhere && rank == 1 {
                    let at = grad.len() / 3;
                    grad[at] = f32::INFINITY;
                }
                reducer.grad_mut(p).unwrap().copy_from_slice(&grad);
                reducer.mark_ready(p).unwrap();
            }
            reducer.finish().unwrap();
            let grads: Vec<Vec<f32>> = (0..n).map(|p| reducer.grad(p).unwrap().to_vec()).collect();
            reducer.zero_grad().unwrap();
            // The loss scaler: an overflow step updates nothing.
            if grads.iter().flatten().any(|x| !x.is_finite()) {
                skipped += 1;
                continue;
            }
            for p in 0..n {
                for ((w, v), g) in params[p].iter_mut().zip(&mut velocity[p]).zip(&grads[p]) {
                    *v = momentum * *v + g;
                    *w -= lr * *v;
                }
            }
        }
        let held = reducer.hook().compression_stats().unwrap().nonfinite_steps;
        (params, held, skipped)
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// The test: one overflow step in 20, skipped by the loss scaler, and the run
/// ends finite and within 1e-6 (relative) of the run that never had that step; every
/// rank agrees; each of the two buckets counts one held step.
#[test]
fn an_overflow_step_is_as_if_it_never_happened() {
    for spec in [
        "powersgd:rank=2,start_iter=2",
        "powersgd:rank=4,start_iter=2,batch_same_shape=true",
        "batched_powersgd:rank=2,start_iter=2",
    ] {
        let with = train(spec, Overflow::Everywhere);
        let without = train(spec, Overflow::Skipped);
        for (rank, ((w, held, skipped), (r, _, _))) in with.iter().zip(&without).enumerate() {
            assert_eq!(*skipped, 1, "{spec}: rank {rank} skipped {skipped} steps");
            assert_eq!(*held, 2, "{spec}: rank {rank}: held bucket steps");
            let (mut diff, mut norm) = (0.0f64, 0.0f64);
            for (a, b) in w.iter().flatten().zip(r.iter().flatten()) {
                assert!(a.is_finite(), "{spec}: rank {rank} ended non-finite");
                diff = diff.max(f64::from((a - b).abs()));
                norm = norm.max(f64::from(b.abs()));
            }
            assert!(
                diff <= 1e-6 * norm,
                "{spec}: rank {rank} ends {diff:e} away from the run without the step (max |w| {norm:e})"
            );
        }
        assert_eq!(with[0].0, with[1].0, "{spec}: the ranks disagree");
    }
}

fn layout() -> Arc<Layout> {
    Arc::new(Layout::packed(&[vec![16, 12], vec![16], vec![12, 20]]).unwrap())
}

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

fn config() -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: 2,
        start_powersgd_iter: 2,
        ..PowerSgdConfig::default()
    }
}

/// One bucket step of `hook` on this rank.
fn step(hook: &mut impl CommHook<CpuBackend>, grad: Vec<f32>) -> Vec<f32> {
    let bucket = GradBucket::new(0, 1, grad, layout()).unwrap();
    hook.run(bucket).wait_timeout(TIMEOUT).unwrap()
}

/// Where a step's non-finite value is: in a compressed matrix (NaN or ±∞), or in an
/// uncompressed bias (the exact all-reduce carries it; the step is held all the same).
const POISONS: [(usize, f32); 4] = [
    (5, f32::NAN),
    (100, f32::INFINITY),
    (192 + 3, f32::NEG_INFINITY),
    (208 + 17, f32::NAN),
];

/// The step that meets the value on one rank: every rank's output is non-finite, every
/// rank's saved state is bit for bit the state before the step (but for the counters),
/// and the next step's output is finite and equal to that of a hook that never saw the
/// held step. Both hooks, with and without warm start and error feedback.
#[test]
fn a_held_step_leaves_the_memories_as_they_were() {
    let len = layout().len();
    let configs = [
        config(),
        PowerSgdConfig {
            warm_start: false,
            ..config()
        },
        PowerSgdConfig {
            use_error_feedback: false,
            ..config()
        },
        PowerSgdConfig {
            batch_tensors_with_same_shape: Some(true),
            ..config()
        },
    ];
    for (at, value) in POISONS {
        for (c, cfg) in configs.iter().enumerate() {
            for batched in [false, true] {
                let cfg = cfg.clone();
                let out = run_local_with_timeout(RANKS, TIMEOUT, move |g| {
                    let rank = g.rank();
                    let g: Arc<dyn ProcessGroup> = Arc::new(g);
                    let be = Arc::new(CpuBackend::new());
                    let mut hooks: [Box<dyn CommHook<CpuBackend>>; 2] = if batched {
                        [
                            Box::new(BatchedPowerSgd::new(be.clone(), g.clone(), cfg.clone())?),
                            Box::new(BatchedPowerSgd::new(be, g, cfg.clone())?),
                        ]
                    } else {
                        [
                            Box::new(PowerSgd::new(be.clone(), g.clone(), cfg.clone())?),
                            Box::new(PowerSgd::new(be, g, cfg.clone())?),
                        ]
                    };
                    let grad = |s: usize| random(len, (rank * 100 + s) as u64);
                    // Both hooks take the same first 4 steps; the first then meets the
                    // poisoned step.
                    for s in 0..4 {
                        for h in hooks.iter_mut() {
                            step(h, grad(s));
                        }
                    }
                    let before = hooks[0].save_state()?;
                    let mut poisoned = grad(4);
                    if rank == 1 {
                        poisoned[at] = value;
                    }
                    let held = step(&mut hooks[0], poisoned);
                    let after = hooks[0].save_state()?;
                    let stats = hooks[0].compression_stats().unwrap();
                    let next: Vec<Vec<f32>> = hooks.iter_mut().map(|h| step(h, grad(5))).collect();
                    Ok::<_, ddp_hooks::Error>((held, before, after, stats, next))
                })
                .unwrap();
                let what = format!("{value} at {at}, config {c}, batched {batched}");
                for r in out {
                    let (held, before, after, stats, next) = r.unwrap().unwrap();
                    assert!(
                        held.iter().any(|x| !x.is_finite()),
                        "{what}: the held step's output is finite"
                    );
                    assert_eq!(stats.nonfinite_steps, 1, "{what}");
                    let (mut before, mut after) = (state(before), state(after));
                    assert_eq!(after.nonfinite_steps, 1, "{what}");
                    // What the held step still counts: the iteration, the statistics,
                    // (without warm start) the draw of Q.
                    assert_eq!(after.iter, before.iter + 1, "{what}");
                    after.nonfinite_steps = 0;
                    after.iter = before.iter;
                    after.total_before = before.total_before;
                    after.total_after = before.total_after;
                    after.next_stats_report = before.next_stats_report;
                    if !before.config.warm_start {
                        after.rng = before.rng.clone();
                        for b in before
                            .buckets
                            .values_mut()
                            .chain(after.buckets.values_mut())
                        {
                            if batched {
                                // The batched hook keeps its last drawn Q in the memory.
                                b.q.clear();
                                b.p.clear();
                            }
                        }
                    }
                    assert_eq!(after, before, "{what}: the memories changed");
                    assert!(
                        next[0].iter().all(|x| x.is_finite()),
                        "{what}: the step after the held one is not finite"
                    );
                    if before.config.warm_start {
                        // Nothing the next step reads differs (the refill key depends on
                        // the step, but no column is zero here).
                        assert_eq!(next[0], next[1], "{what}: the next step differs");
                    }
                }
            }
        }
    }
}

fn state(s: ddp_hooks::HookState) -> ddp_hooks::PowerSgdState {
    match s {
        ddp_hooks::HookState::PowerSgd(s) | ddp_hooks::HookState::BatchedPowerSgd(s) => *s,
        other => panic!("not a PowerSGD state: {other:?}"),
    }
}

/// The flag primitives themselves, on the CPU backend (the CUDA backend runs the same
/// checks in `lowrank`'s CUDA tests where a GPU exists).
#[test]
fn flag_primitives() {
    let be = CpuBackend::new();
    let mut flag = vec![0.0f32];
    be.flag_nonfinite(&[1.0, -3.0, f32::MAX, f32::MIN_POSITIVE / 2.0], &mut flag)
        .unwrap();
    assert_eq!(flag, [0.0], "finite values raised the flag");
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
        let mut flag = vec![0.0f32];
        let mut x = vec![1.0f32; 3000];
        x[2999] = bad;
        be.flag_nonfinite(&x, &mut flag).unwrap();
        assert_eq!(flag, [1.0], "{bad} did not raise the flag");
        // Never lowered.
        be.flag_nonfinite(&[0.0], &mut flag).unwrap();
        assert_eq!(flag, [1.0]);
    }
    let mut dst = vec![5.0f32; 4];
    be.copy_unflagged(&[1.0; 4], &mut dst, &[1.0]).unwrap();
    assert_eq!(dst, [5.0; 4]);
    be.copy_unflagged(&[1.0; 4], &mut dst, &[0.0]).unwrap();
    assert_eq!(dst, [1.0; 4]);
    assert!(be.flag_nonfinite(&[0.0], &mut [0.0, 0.0]).is_err());
    assert!(be.copy_unflagged(&[0.0], &mut [0.0], &[]).is_err());
}
