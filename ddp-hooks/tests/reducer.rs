//! The reducer's DDP behaviours on 2 and 4 thread ranks: unused parameters (declared,
//! or left unmarked with `find_unused_parameters`) count as zeros in the mean and never
//! leave a rank waiting; without the option the error names every unmarked parameter;
//! buckets are rebuilt once, in rank 0's gradient-ready order, and PowerSGD stays exact
//! across the rebuild.

use accum::{no_sync, GradSync};
use collectives::{run_local_with_timeout, ProcessGroup};
use ddp_hooks::{AllReduce, Error, PowerSgd, PowerSgdConfig, Reducer, ReducerConfig};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;
use std::time::Duration;

/// Every collective gives up after this: a rank left waiting fails the test fast.
const TIMEOUT: Duration = Duration::from_secs(20);

type AllReduceReducer = Reducer<CpuBackend, AllReduce<CpuBackend>>;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

fn len(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// A reducer with the all-reduce hook over `group`, which it also uses for the rebuild.
fn reducer(
    group: Arc<dyn ProcessGroup>,
    shapes: &[Vec<usize>],
    config: ReducerConfig,
) -> AllReduceReducer {
    let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
    let hook = AllReduce::new(be.clone(), group.clone());
    Reducer::new(be, shapes, hook, config)
        .unwrap()
        .with_process_group(group)
}

fn grads(r: &AllReduceReducer, params: usize) -> Vec<Vec<f32>> {
    (0..params).map(|p| r.grad(p).unwrap().to_vec()).collect()
}

/// Mean over ranks, in f64, of `grad(rank, param)` (`None`: zeros).
fn mean(
    ranks: usize,
    shapes: &[Vec<usize>],
    grad: impl Fn(usize, usize) -> Option<Vec<f32>>,
) -> Vec<Vec<f64>> {
    shapes
        .iter()
        .enumerate()
        .map(|(p, s)| {
            let mut m = vec![0.0f64; len(s)];
            for r in 0..ranks {
                if let Some(g) = grad(r, p) {
                    m.iter_mut().zip(&g).for_each(|(a, &b)| *a += b as f64);
                }
            }
            m.iter().map(|x| x / ranks as f64).collect()
        })
        .collect()
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f64>], what: &str) {
    for (p, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len());
        for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{what}: parameter {p}[{i}] = {a}, expected {b}"
            );
        }
    }
}

// ---- Unused parameters ----

/// Six parameters in forward order; with these caps the buckets (launch order) are
/// `[[5, 4], [3, 2], [1, 0]]`.
fn six() -> (Vec<Vec<usize>>, ReducerConfig) {
    let shapes = vec![
        vec![4, 3],
        vec![4],
        vec![5, 4],
        vec![5],
        vec![3, 5],
        vec![3],
    ];
    let config = ReducerConfig {
        // 64 bytes (16 floats) for the first bucket, 96 (24 floats) for the others.
        first_bucket_mb: 64.0 / (1 << 20) as f64,
        bucket_cap_mb: 96.0 / (1 << 20) as f64,
        ..ReducerConfig::default()
    };
    (shapes, config)
}

/// How a rank treats a parameter in one step.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Use {
    Ready,
    /// `mark_unused`.
    Declared,
    /// Left unmarked.
    Unmarked,
}

/// Rank `rank`'s treatment of parameter `p` at step `step`: ranks disagree, and rank 1
/// leaves the whole bucket `[3, 2]` unused in step 0 and bucket `[1, 0]` in step 1.
fn usage(rank: usize, step: usize, p: usize) -> Use {
    match (rank, step, p) {
        (1, 0, 2 | 3) => Use::Unmarked,
        (1, 1, 0) => Use::Declared,
        (1, 1, 1) => Use::Unmarked,
        (2, _, 0 | 5) => Use::Unmarked,
        (3, 0, 2) | (3, 1, 4) => Use::Declared,
        (3, 0, 4) => Use::Unmarked,
        _ => Use::Ready,
    }
}

fn step_grad(rank: usize, step: usize, p: usize, shapes: &[Vec<usize>]) -> Vec<f32> {
    random(len(&shapes[p]), (rank * 1000 + step * 100 + p) as u64)
}

/// Runs two synchronised steps in backward order with [`usage`]; gradients are written
/// over the previous step's results (no `zero_grad`), so an unused parameter's slot
/// holds stale values unless the reducer zeroes it. Returns each rank's gradients and
/// `finish` result per step, and its hook calls.
#[allow(clippy::type_complexity)]
fn unused_steps(
    ranks: usize,
    find_unused: bool,
) -> Vec<(Vec<(Vec<Vec<f32>>, ddp_hooks::Result<()>)>, u64)> {
    let (shapes, config) = six();
    let config = ReducerConfig {
        find_unused_parameters: find_unused,
        ..config
    };
    let out = run_local_with_timeout(ranks, TIMEOUT, |g| {
        let rank = g.rank();
        let mut r = reducer(Arc::new(g), &shapes, config);
        // The rebuild after step 0 keeps this order, so the buckets stay as in `six`.
        assert_eq!(r.bucket_params(), vec![vec![5, 4], vec![3, 2], vec![1, 0]]);
        let mut steps = Vec::new();
        for step in 0..2 {
            for p in (0..shapes.len()).rev() {
                match usage(rank, step, p) {
                    Use::Ready => {
                        r.grad_mut(p)
                            .unwrap()
                            .copy_from_slice(&step_grad(rank, step, p, &shapes));
                        r.mark_ready(p).unwrap();
                    }
                    Use::Declared => r.mark_unused(p).unwrap(),
                    Use::Unmarked => {}
                }
            }
            let finished = r.finish();
            steps.push((grads(&r, shapes.len()), finished));
        }
        assert_eq!(r.bucket_params(), vec![vec![5, 4], vec![3, 2], vec![1, 0]]);
        (steps, r.hook_calls())
    })
    .unwrap();
    out.into_iter().map(|r| r.unwrap()).collect()
}

fn expected(ranks: usize, step: usize) -> Vec<Vec<f64>> {
    let (shapes, _) = six();
    mean(ranks, &shapes, |r, p| {
        (usage(r, step, p) == Use::Ready).then(|| step_grad(r, step, p, &shapes))
    })
}

#[test]
fn unused_parameters_count_as_zeros_in_the_exact_mean() {
    for ranks in [2, 4] {
        let out = unused_steps(ranks, true);
        for (rank, (steps, hook_calls)) in out.iter().enumerate() {
            for (step, (got, finished)) in steps.iter().enumerate() {
                finished
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{ranks} ranks, rank {rank}, step {step}: {e}"));
                assert_close(
                    got,
                    &expected(ranks, step),
                    &format!("{ranks} ranks, rank {rank}, step {step}"),
                );
                assert_eq!(got, &out[0].0[step].0, "ranks disagree");
            }
            // Every bucket launched on every rank in both steps, including the bucket
            // that rank 1 left wholly unused.
            assert_eq!(*hook_calls, 6, "{ranks} ranks, rank {rank}");
        }
    }
}

#[test]
fn without_the_option_the_error_names_every_unmarked_parameter_and_no_rank_waits() {
    for ranks in [2, 4] {
        let out = unused_steps(ranks, false);
        for (rank, (steps, hook_calls)) in out.iter().enumerate() {
            for (step, (got, finished)) in steps.iter().enumerate() {
                let what = format!("{ranks} ranks, rank {rank}, step {step}");
                let unmarked: Vec<usize> = (0..6)
                    .filter(|&p| usage(rank, step, p) == Use::Unmarked)
                    .collect();
                match finished {
                    Ok(()) => assert!(unmarked.is_empty(), "{what}: no error"),
                    Err(e) => {
                        assert_eq!(
                            e,
                            &Error::UnmarkedParameters {
                                params: unmarked.clone(),
                                total: 6,
                                rank: Some(rank),
                            },
                            "{what}"
                        );
                        let msg = e.to_string();
                        assert!(msg.contains("find_unused_parameters"), "{msg}");
                        assert!(msg.contains(&format!("on rank {rank}")), "{msg}");
                    }
                }
                // The step was reduced all the same, identically on every rank.
                assert_close(got, &expected(ranks, step), &what);
                assert_eq!(got, &out[0].0[step].0, "{what}: ranks disagree");
            }
            assert_eq!(*hook_calls, 6, "{ranks} ranks, rank {rank}");
        }
    }
}

#[test]
fn the_error_names_every_unmarked_parameter_in_ranges() {
    let e = Error::UnmarkedParameters {
        params: vec![0, 2, 3, 4, 9, 11, 12],
        total: 13,
        rank: None,
    };
    let msg = e.to_string();
    let head = "7 of 13 parameters were not marked ready before finish() \
                in a synchronised step: 0, 2..=4, 9, 11..=12.";
    assert!(msg.starts_with(head), "{msg}");
    assert!(
        msg.contains("`ReducerConfig::find_unused_parameters = true`"),
        "{msg}"
    );
    assert!(msg.contains("`Reducer::mark_unused`"), "{msg}");
    assert!(!msg.contains("on rank"), "{msg}");
}

/// DDP's used-parameter map spans `no_sync` iterations: a parameter that got gradients
/// in an accumulation step and none in the synchronised step contributes the
/// accumulated gradients, not zeros.
#[test]
fn a_parameter_unused_only_in_the_synchronised_step_keeps_its_accumulated_gradients() {
    let shapes = vec![vec![3, 2], vec![3]];
    let config = ReducerConfig {
        find_unused_parameters: true,
        ..ReducerConfig::default()
    };
    let g = |rank: usize, step: usize, p: usize| {
        random(len(&shapes[p]), (rank * 10 + step * 2 + p) as u64)
    };
    let out = run_local_with_timeout(2, TIMEOUT, |group| {
        let rank = group.rank();
        let mut r = reducer(Arc::new(group), &shapes, config);
        {
            let mut r = no_sync(&mut r);
            for p in [1, 0] {
                r.grad_mut(p).unwrap().copy_from_slice(&g(rank, 0, p));
                r.mark_ready(p).unwrap();
            }
            r.finish().unwrap();
        }
        // Synchronised step: rank 0 leaves parameter 0 unmarked, rank 1 declares it.
        r.grad_mut(1)
            .unwrap()
            .iter_mut()
            .zip(g(rank, 1, 1))
            .for_each(|(a, b)| *a += b);
        r.mark_ready(1).unwrap();
        if rank == 1 {
            r.mark_unused(0).unwrap();
        }
        r.finish().unwrap();
        // Unused in the step, yet its accumulated gradients make it used.
        assert_eq!(r.globally_unused(), Some(&[][..]));
        let after = grads(&r, 2);
        // The next synchronised step: parameter 0 unused again, now with nothing
        // accumulated, so its stale slot counts as zeros.
        r.grad_mut(1).unwrap().copy_from_slice(&g(rank, 2, 1));
        r.mark_ready(1).unwrap();
        r.finish().unwrap();
        assert_eq!(r.globally_unused(), Some(&[0][..]));
        (after, grads(&r, 2))
    })
    .unwrap();
    let want = mean(2, &shapes, |rank, p| {
        Some(match p {
            0 => g(rank, 0, 0),
            _ => g(rank, 0, 1)
                .iter()
                .zip(g(rank, 1, 1))
                .map(|(a, b)| a + b)
                .collect(),
        })
    });
    let next = mean(2, &shapes, |rank, p| (p == 1).then(|| g(rank, 2, 1)));
    for r in out {
        let (after, then) = r.unwrap();
        assert_close(&after, &want, "accumulated");
        assert_close(&then, &next, "the step after");
    }
}

/// DDP's `local_used_map`: with `find_unused_parameters`, the parameters no rank used
/// in a synchronised step are found (one all-reduce of the used map) and their slots are
/// zero, even under PowerSGD, whose error feedback gives a matrix that was all zeros on
/// every rank a nonzero approximation. A parameter used on one rank only is used. Without
/// the option, or in a step without synchronisation, nothing is found.
#[test]
fn parameters_no_rank_used_are_found_and_left_zero_under_powersgd() {
    let (shapes, config) = six();
    let run = |find_unused: bool| {
        let config = ReducerConfig {
            find_unused_parameters: find_unused,
            ..config
        };
        run_local_with_timeout(2, TIMEOUT, |g| {
            let rank = g.rank();
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
            let cfg = PowerSgdConfig {
                matrix_approximation_rank: 1,
                start_powersgd_iter: 2,
                ..PowerSgdConfig::default()
            };
            let hook = PowerSgd::new(be.clone(), group.clone(), cfg).unwrap();
            let mut r = Reducer::new(be, &shapes, hook, config)
                .unwrap()
                .with_process_group(group);
            let mut found = Vec::new();
            for step in 0..5 {
                // Step 1 accumulates without synchronising, which finds nothing.
                r.set_sync(step != 1);
                for p in (0..shapes.len()).rev() {
                    // Step 4: parameter 2 left unmarked and 4 declared unused on both
                    // ranks; parameter 0 used on rank 0 only.
                    let unused = step == 4 && (p == 2 || p == 4 || (p == 0 && rank == 1));
                    if unused {
                        if p == 4 {
                            r.mark_unused(p).unwrap();
                        }
                        continue;
                    }
                    r.grad_mut(p)
                        .unwrap()
                        .copy_from_slice(&step_grad(rank, step, p, &shapes));
                    r.mark_ready(p).unwrap();
                }
                let finished = r.finish();
                if find_unused || step < 4 {
                    finished.unwrap();
                } else {
                    assert!(matches!(finished, Err(Error::UnmarkedParameters { .. })));
                }
                found.push(r.globally_unused().map(<[usize]>::to_vec));
            }
            let last: Vec<Vec<f32>> = (0..shapes.len())
                .map(|p| r.grad(p).unwrap().to_vec())
                .collect();
            (found, last)
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    for (found, last) in run(true) {
        let none: Vec<usize> = Vec::new();
        assert_eq!(
            found,
            vec![
                Some(none.clone()),
                None,
                Some(none.clone()),
                Some(none),
                Some(vec![2, 4])
            ]
        );
        assert!(
            last[2].iter().chain(&last[4]).all(|&x| x == 0.0),
            "{last:?}"
        );
        assert!(last[0].iter().any(|&x| x != 0.0));
    }
    // Without the option nothing is found, and PowerSGD's error feedback does put values
    // in the slots of the parameters no rank used: what the option zeroes.
    for (found, last) in run(false) {
        assert!(found.iter().all(Option::is_none));
        assert!(
            last[2].iter().chain(&last[4]).any(|&x| x != 0.0),
            "{last:?}"
        );
    }
}

/// Accelerate's `sync_each_batch`: every micro-step of a group synchronises while the
/// gradients keep accumulating, so a parameter unused in a later micro-step keeps what
/// the group gave it (DDP reduces any gradient a parameter holds) instead of counting as
/// zero. Parameter 0 is used in micro-step 1 on rank 0 only; parameter 2 in micro-step 0
/// only. The next group starts from `zero_grad`, and its unused parameters are zeros.
#[test]
fn with_sync_each_batch_a_parameter_unused_later_in_the_group_keeps_its_gradients() {
    let shapes = vec![vec![4], vec![3, 2], vec![5]];
    let config = ReducerConfig {
        find_unused_parameters: true,
        ..ReducerConfig::default()
    };
    let g = |rank: usize, step: usize, p: usize| {
        random(len(&shapes[p]), (100 + rank * 10 + step * 3 + p) as u64)
    };
    let used = |rank: usize, step: usize, p: usize| match (step, p) {
        (0, _) | (1, 1) => true,
        (1, 0) => rank == 0,
        (2, 1) => true,
        _ => false,
    };
    let out = run_local_with_timeout(2, TIMEOUT, |group| {
        let rank = group.rank();
        let mut r = reducer(Arc::new(group), &shapes, config);
        let mut acc = accum::Accumulator::with_config(accum::Config {
            num_steps: 2,
            sync_each_batch: true,
            sync_at_end_of_data: true,
        })
        .unwrap();
        let mut after = Vec::new();
        for (step, _) in acc.epoch(0..3) {
            {
                let mut r = step.apply(&mut r);
                assert!(
                    r.sync_enabled(),
                    "sync_each_batch synchronises every micro-step"
                );
                for p in (0..shapes.len()).rev() {
                    if used(rank, after.len(), p) {
                        r.grad_mut(p)
                            .unwrap()
                            .iter_mut()
                            .zip(g(rank, after.len(), p))
                            .for_each(|(a, b)| *a += b);
                        r.mark_ready(p).unwrap();
                    }
                }
                r.finish().unwrap();
            }
            after.push(grads(&r, shapes.len()));
            step.zero_grad(|| r.zero_grad().unwrap());
        }
        after
    })
    .unwrap();
    // Micro-step 1, as DDP reduces it: each rank's slot holds the micro-step 0 mean plus
    // its own micro-step 1 gradient where it used the parameter.
    let first = mean(2, &shapes, |rank, p| Some(g(rank, 0, p)));
    let second: Vec<Vec<f64>> = first
        .iter()
        .enumerate()
        .map(|(p, m0)| {
            let extra = mean(2, &shapes, |rank, q| {
                (q == p && used(rank, 1, q)).then(|| g(rank, 1, q))
            });
            m0.iter().zip(&extra[p]).map(|(a, b)| a + b).collect()
        })
        .collect();
    // The next group (the epoch's last micro-step, alone): parameters 0 and 2 unused on
    // every rank after `zero_grad`, so zeros.
    let third = mean(2, &shapes, |rank, p| {
        used(rank, 2, p).then(|| g(rank, 2, p))
    });
    for steps in out {
        let steps = steps.unwrap();
        assert_close(&steps[0], &first, "micro-step 0");
        assert_close(&steps[1], &second, "micro-step 1");
        assert_close(&steps[2], &third, "the next group");
    }
}

/// A step abandoned inside `no_sync` (an early return after a mark) is ended by
/// `finish`, which reports it; the next step then runs normally and reduces what the
/// slots hold.
#[test]
fn finish_ends_a_step_abandoned_inside_no_sync() {
    let shapes = vec![vec![4], vec![3]];
    let out = run_local_with_timeout(2, TIMEOUT, |group| {
        let rank = group.rank();
        let mut r = reducer(Arc::new(group), &shapes, ReducerConfig::default());
        let abandoned = |r: &mut AllReduceReducer| -> ddp_hooks::Result<()> {
            let mut r = no_sync(r);
            r.grad_mut(1).unwrap().fill(1.0);
            r.mark_ready(1)?;
            Err(Error::Bucket {
                index: 0,
                why: "the caller gave up".into(),
            })
        };
        assert!(abandoned(&mut r).is_err());
        assert!(r.mark_ready(1).is_err(), "the abandoned step's mark stands");
        assert!(matches!(r.finish(), Err(Error::SyncChanged { .. })));
        // The next step: synchronised, every parameter written.
        r.grad_mut(0).unwrap().fill(rank as f32);
        r.grad_mut(1)
            .unwrap()
            .iter_mut()
            .for_each(|x| *x += rank as f32);
        r.mark_ready(1).unwrap();
        r.mark_ready(0).unwrap();
        r.finish().unwrap();
        grads(&r, 2)
    })
    .unwrap();
    for got in out {
        let got = got.unwrap();
        assert_eq!(got[0], vec![0.5; 4]);
        // 1 from the abandoned step plus the rank, averaged over ranks 0 and 1.
        assert_eq!(got[1], vec![1.5; 3]);
    }
}

/// A hook that panics fails its bucket's step like a hook error: `finish` reports it,
/// the reducer stays usable, and the next step reduces normally.
#[test]
fn a_panicking_hook_fails_its_step_and_the_reducer_stays_usable() {
    struct PanicsOnce<H> {
        inner: H,
        calls: usize,
    }
    impl<H: ddp_hooks::CommHook<CpuBackend>> ddp_hooks::CommHook<CpuBackend> for PanicsOnce<H> {
        fn name(&self) -> String {
            "panics-once".into()
        }
        fn run(
            &mut self,
            bucket: ddp_hooks::GradBucket<CpuBackend>,
        ) -> collectives::Work<Vec<f32>> {
            self.calls += 1;
            if self.calls == 1 {
                panic!("a hook bug");
            }
            self.inner.run(bucket)
        }
    }
    let shapes = vec![vec![4], vec![4]];
    let out = run_local_with_timeout(1, TIMEOUT, |group| {
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let hook = PanicsOnce {
            inner: AllReduce::new(be.clone(), group.clone()),
            calls: 0,
        };
        let config = ReducerConfig {
            bucket_cap_mb: 1e-6,
            first_bucket_mb: 1e-6,
            ..ReducerConfig::default()
        };
        let mut r = Reducer::new(be, &shapes, hook, config).unwrap();
        let step = |r: &mut Reducer<CpuBackend, PanicsOnce<AllReduce<CpuBackend>>>, v: f32| {
            for p in [1, 0] {
                r.grad_mut(p).unwrap().fill(v);
                r.mark_ready(p).unwrap();
            }
            r.finish()
        };
        let first = step(&mut r, 1.0);
        assert!(
            matches!(&first, Err(Error::Bucket { why, .. }) if why.contains("panicked")),
            "{first:?}"
        );
        step(&mut r, 2.0).unwrap();
        (r.grad(0).unwrap().to_vec(), r.grad(1).unwrap().to_vec())
    })
    .unwrap();
    let (g0, g1) = out.into_iter().next().unwrap().unwrap();
    assert_eq!(g0, vec![2.0; 4]);
    assert_eq!(g1, vec![2.0; 4]);
}

#[test]
fn marking_errors_are_values() {
    let out = run_local_with_timeout(1, TIMEOUT, |g| {
        let mut r = reducer(Arc::new(g), &[vec![2], vec![3]], ReducerConfig::default());
        assert!(matches!(r.mark_unused(2), Err(Error::Config(_))));
        r.mark_ready(1).unwrap();
        assert!(
            matches!(r.mark_unused(1), Err(Error::Config(_))),
            "unused after ready"
        );
        r.mark_unused(0).unwrap();
        assert!(
            matches!(r.mark_ready(0), Err(Error::Config(_))),
            "ready after unused"
        );
        r.finish().unwrap();
        // A step in which nothing is marked reduces zeros and names every parameter.
        let e = r.finish().unwrap_err();
        assert!(
            matches!(&e, Error::UnmarkedParameters { params, .. } if params == &[0, 1]),
            "{e}"
        );
        assert_eq!(grads(&r, 2), vec![vec![0.0; 2], vec![0.0; 3]]);
    })
    .unwrap();
    out.into_iter().for_each(|r| r.unwrap());
}

// ---- Bucket rebuild ----

/// Eight parameters (f32 bytes 64, 16, 96, 24, 64, 32, 36, 12) and caps of 64 bytes for
/// the first bucket, 128 for the others.
fn eight() -> (Vec<Vec<usize>>, ReducerConfig) {
    let shapes = vec![
        vec![4, 4],
        vec![4],
        vec![6, 4],
        vec![6],
        vec![2, 8],
        vec![8],
        vec![3, 3],
        vec![3],
    ];
    let config = ReducerConfig {
        first_bucket_mb: 64.0 / (1 << 20) as f64,
        bucket_cap_mb: 128.0 / (1 << 20) as f64,
        ..ReducerConfig::default()
    };
    (shapes, config)
}

/// Reverse order 7, 6, 5 | 4, 3, 2 | 1, 0: 12+36+32 = 80 ≥ 64 closes the first bucket;
/// 64+24+96 = 184 ≥ 128 the second; 16+64 remain.
const INITIAL: [&[usize]; 3] = [&[7, 6, 5], &[4, 3, 2], &[1, 0]];
/// Rank 0's ready order in the first synchronised step.
const SCRAMBLED: [usize; 8] = [3, 0, 7, 1, 5, 2, 6, 4];
/// By hand: 24+64 = 88 ≥ 64 closes [3, 0]; 12+16+32+96 = 156 ≥ 128 closes
/// [7, 1, 5, 2]; 36+64 = 100 remain in [6, 4].
const REBUILT: [&[usize]; 3] = [&[3, 0], &[7, 1, 5, 2], &[6, 4]];

fn buckets(b: &[&[usize]]) -> Vec<Vec<usize>> {
    b.iter().map(|b| b.to_vec()).collect()
}

/// Each rank's ready order at `step`: rank 0 scrambled, the others different orders
/// (reverse, forward, rotated), and rank 0 again different after the rebuild.
fn order(rank: usize, step: usize) -> Vec<usize> {
    match (rank, step) {
        (0, 1) => SCRAMBLED.to_vec(),
        (0, _) | (1, _) => (0..8).rev().collect(),
        (2, _) => (0..8).collect(),
        _ => (0..8).map(|p| (p + 3 * step + 1) % 8).collect(),
    }
}

#[test]
fn buckets_are_rebuilt_once_in_rank_0s_ready_order_after_the_first_synchronised_step() {
    let (shapes, config) = eight();
    let g = |rank: usize, step: usize, p: usize| {
        random(len(&shapes[p]), (rank * 1000 + step * 100 + p) as u64)
    };
    for ranks in [2, 4] {
        let out = run_local_with_timeout(ranks, TIMEOUT, |group| {
            let rank = group.rank();
            let mut r = reducer(Arc::new(group), &shapes, config);
            let mut layouts = vec![r.bucket_params()];
            let mut step1 = Vec::new();
            for step in 0..4 {
                // Step 0 accumulates under no_sync: it is not the first synchronised
                // step, and its order counts for nothing.
                let sync = step != 0;
                r.set_sync(sync);
                for p in order(rank, step) {
                    let add = g(rank, step, p);
                    r.grad_mut(p)
                        .unwrap()
                        .iter_mut()
                        .zip(add)
                        .for_each(|(a, b)| *a += b);
                    r.mark_ready(p).unwrap();
                }
                r.finish().unwrap();
                layouts.push(r.bucket_params());
                if step == 1 {
                    step1 = grads(&r, 8);
                }
                if sync {
                    r.zero_grad().unwrap();
                }
            }
            (layouts, step1, r.hook_calls())
        })
        .unwrap();
        let want = mean(ranks, &shapes, |rank, p| {
            Some(
                g(rank, 0, p)
                    .iter()
                    .zip(g(rank, 1, p))
                    .map(|(a, b)| a + b)
                    .collect(),
            )
        });
        for (rank, r) in out.into_iter().enumerate() {
            let what = format!("{ranks} ranks, rank {rank}");
            let (layouts, step1, calls) = r.unwrap();
            assert_eq!(layouts[0], buckets(&INITIAL), "{what}: initial buckets");
            assert_eq!(
                layouts[1],
                buckets(&INITIAL),
                "{what}: rebuilt after a no_sync step"
            );
            assert_eq!(
                layouts[2],
                buckets(&REBUILT),
                "{what}: rank 0's order must win"
            );
            assert_eq!(layouts[3], buckets(&REBUILT), "{what}: rebuilt twice");
            assert_eq!(layouts[4], buckets(&REBUILT), "{what}: rebuilt twice");
            // The step's reduced gradients moved with their parameters.
            assert_close(
                &step1,
                &want,
                &format!("{what}: step 1, read after the rebuild"),
            );
            assert_eq!(calls, 3 * 3, "3 synchronised steps of 3 buckets");
        }
    }
}

#[test]
fn without_a_process_group_the_buckets_never_change() {
    let (shapes, config) = eight();
    let out = run_local_with_timeout(2, TIMEOUT, |group| {
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let hook = AllReduce::new(be.clone(), Arc::new(group));
        let mut r = Reducer::new(be, &shapes, hook, config).unwrap();
        for _ in 0..2 {
            for p in SCRAMBLED {
                r.mark_ready(p).unwrap();
            }
            r.finish().unwrap();
        }
        r.bucket_params()
    })
    .unwrap();
    for r in out {
        assert_eq!(r.unwrap(), buckets(&INITIAL));
    }
}

#[test]
fn set_bucket_params_restores_an_assignment_and_cancels_the_rebuild() {
    let (shapes, config) = eight();
    let out = run_local_with_timeout(2, TIMEOUT, |group| {
        let rank = group.rank();
        let mut r = reducer(Arc::new(group), &shapes, config);
        for p in 0..8 {
            r.grad_mut(p).unwrap().fill((rank * 10 + p) as f32);
        }
        let before = grads(&r, 8);
        let bad = [
            vec![vec![0, 1, 2, 3], vec![4, 5, 6]],
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7, 7]],
            vec![vec![0, 1, 2, 3, 4, 5, 6, 7, 8]],
            vec![vec![0, 1, 2, 3, 4, 5, 6, 7], vec![]],
        ];
        for b in bad {
            let e = r.set_bucket_params(b.clone()).unwrap_err();
            assert!(matches!(e, Error::Config(_)), "{b:?}: {e}");
        }
        assert_eq!(
            r.bucket_params(),
            buckets(&INITIAL),
            "a refused call changed the buckets"
        );
        r.set_bucket_params(buckets(&REBUILT)).unwrap();
        assert_eq!(grads(&r, 8), before, "gradients move with their parameters");
        r.mark_ready(0).unwrap();
        let during = r.set_bucket_params(buckets(&INITIAL));
        assert!(matches!(during, Err(Error::Config(_))), "during a step");
        for p in 1..8 {
            r.mark_ready(p).unwrap();
        }
        r.finish().unwrap();
        // Rank 0 marks in another order in the first synchronised step: no rebuild.
        r.bucket_params()
    })
    .unwrap();
    for r in out {
        assert_eq!(r.unwrap(), buckets(&REBUILT));
    }
}

/// W0 (24 x 16), b0, W1 (16 x 20), b1, W2 (20 x 12), b2, and caps that split them
/// differently in reverse order and in [`PSGD_ORDER`].
fn mlp() -> (Vec<Vec<usize>>, ReducerConfig) {
    let shapes = vec![
        vec![24, 16],
        vec![24],
        vec![16, 20],
        vec![16],
        vec![20, 12],
        vec![12],
    ];
    let config = ReducerConfig {
        // f32 bytes: W0 1536, b0 96, W1 1280, b1 64, W2 960, b2 48.
        first_bucket_mb: 200.0 / (1 << 20) as f64,
        bucket_cap_mb: 1400.0 / (1 << 20) as f64,
        ..ReducerConfig::default()
    };
    (shapes, config)
}

/// Rank 0's ready order: biases first, then weights, from the input side.
const PSGD_ORDER: [usize; 6] = [1, 3, 5, 0, 2, 4];

/// Matrices `u vᵀ` (a mean over W ranks has rank <= W), biases any values.
fn rank_one_grad(shapes: &[Vec<usize>], rank: usize, step: usize, p: usize) -> Vec<f32> {
    let seed = (rank * 1000 + step * 100 + p) as u64;
    match shapes[p][..] {
        [n, m] => {
            let (u, v) = (random(n, seed), random(m, seed + 50_000));
            (0..n * m).map(|i| u[i / m] * v[i % m]).collect()
        }
        _ => random(len(&shapes[p]), seed),
    }
}

/// Runs `steps` of a synchronised PowerSGD step on `r` from step `from`, rank 0 marking
/// in [`PSGD_ORDER`], the others in reverse order; returns each step's gradients or
/// the step's error.
fn psgd_steps(
    r: &mut Reducer<CpuBackend, PowerSgd<CpuBackend>>,
    shapes: &[Vec<usize>],
    rank: usize,
    steps: std::ops::Range<usize>,
) -> ddp_hooks::Result<Vec<Vec<Vec<f32>>>> {
    let mut outs = Vec::new();
    for step in steps {
        let mine: Vec<usize> = if rank == 0 {
            PSGD_ORDER.to_vec()
        } else {
            (0..6).rev().collect()
        };
        for p in mine {
            r.grad_mut(p)?
                .copy_from_slice(&rank_one_grad(shapes, rank, step, p));
            r.mark_ready(p)?;
        }
        r.finish()?;
        outs.push(
            (0..6)
                .map(|p| Ok(r.grad(p)?.to_vec()))
                .collect::<ddp_hooks::Result<_>>()?,
        );
    }
    Ok(outs)
}

fn psgd_reducer(
    group: Arc<dyn ProcessGroup>,
    hook: PowerSgd<CpuBackend>,
) -> Reducer<CpuBackend, PowerSgd<CpuBackend>> {
    let (shapes, config) = mlp();
    let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
    Reducer::new(be, &shapes, hook, config)
        .unwrap()
        .with_process_group(group)
}

fn psgd_config(rank: usize) -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: rank,
        start_powersgd_iter: 2,
        ..PowerSgdConfig::default()
    }
}

/// PowerSGD needs `start_powersgd_iter` > 1 because of the rebuild: with 2 it holds no
/// per-bucket memory until the buckets have their final indices, and its compressed
/// steps on the rebuilt buckets are exact where they must be (rank-1 gradients with an
/// approximation rank of at least the number of ranks, uncompressed biases).
#[test]
fn powersgd_with_start_iter_2_is_exact_after_the_rebuild() {
    let (shapes, _) = mlp();
    for ranks in [2, 4] {
        let out = run_local_with_timeout(ranks, TIMEOUT, |group| {
            let rank = group.rank();
            let group: Arc<dyn ProcessGroup> = Arc::new(group);
            let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
            let hook = PowerSgd::new(be, group.clone(), psgd_config(ranks)).unwrap();
            let mut r = psgd_reducer(group, hook);
            let initial = r.bucket_params();
            let mut outs = Vec::new();
            let mut layouts = Vec::new();
            for step in 0..6 {
                outs.extend(psgd_steps(&mut r, &shapes, rank, step..step + 1).unwrap());
                layouts.push(r.bucket_params());
            }
            let state = r.hook().save().unwrap();
            (initial, layouts, outs, state.iter, state.total_before)
        })
        .unwrap();
        let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
        for (rank, (initial, layouts, outs, iter, compressed)) in out.iter().enumerate() {
            // Reverse order: 48+960 ≥ 200 | 64+1280+96 ≥ 1400 | 1536.
            assert_eq!(initial, &vec![vec![5, 4], vec![3, 2, 1], vec![0]]);
            // Rank 0's order: 96+64+48 ≥ 200 | 1536 ≥ 1400 | 1280+960.
            assert_eq!(
                layouts[0],
                vec![vec![1, 3, 5], vec![0], vec![2, 4]],
                "rank {rank}"
            );
            assert!(layouts.iter().all(|l| l == &layouts[0]), "one rebuild");
            assert_eq!(*iter, 6);
            assert!(*compressed > 0, "steps 2..6 were compressed");
            for (step, got) in outs.iter().enumerate() {
                let want = mean(ranks, &shapes, |r, p| {
                    Some(rank_one_grad(&shapes, r, step, p))
                });
                for (p, (g, w)) in got.iter().zip(&want).enumerate() {
                    let err = g
                        .iter()
                        .zip(w)
                        .map(|(&a, &b)| (a as f64 - b).powi(2))
                        .sum::<f64>()
                        .sqrt()
                        / w.iter().map(|b| b * b).sum::<f64>().sqrt();
                    let what = format!("{ranks} ranks, rank {rank}, step {step}, parameter {p}");
                    assert!(err < 1e-4, "{what}: relative error {err}");
                }
                assert_eq!(got, &out[0].2[step], "ranks disagree");
            }
        }
    }
}

/// A hook restored from a checkpoint holds memory keyed by the rebuilt bucket indices:
/// restoring the saved buckets with `set_bucket_params` continues exactly as the
/// uninterrupted run; a fresh reducer's initial buckets do not fit the memory.
#[test]
fn a_resumed_powersgd_run_continues_exactly_once_its_buckets_are_restored() {
    let (shapes, _) = mlp();
    let out = run_local_with_timeout(2, TIMEOUT, |group| {
        let rank = group.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let hook = PowerSgd::new(be.clone(), group.clone(), psgd_config(1)).unwrap();
        let mut r = psgd_reducer(group.clone(), hook);
        let whole = psgd_steps(&mut r, &shapes, rank, 0..6).unwrap();

        let hook = PowerSgd::new(be.clone(), group.clone(), psgd_config(1)).unwrap();
        let mut r = psgd_reducer(group.clone(), hook);
        psgd_steps(&mut r, &shapes, rank, 0..4).unwrap();
        let (state, saved) = (r.hook().save().unwrap(), r.bucket_params());

        let hook = PowerSgd::load(be.clone(), group.clone(), state.clone()).unwrap();
        let mut resumed = psgd_reducer(group.clone(), hook);
        resumed.set_bucket_params(saved).unwrap();
        let rest = psgd_steps(&mut resumed, &shapes, rank, 4..6).unwrap();

        let hook = PowerSgd::load(be, group.clone(), state).unwrap();
        let mut unrestored = psgd_reducer(group, hook);
        let wrong = psgd_steps(&mut unrestored, &shapes, rank, 4..5);
        (whole, rest, wrong.is_err())
    })
    .unwrap();
    for r in out {
        let (whole, rest, wrong) = r.unwrap();
        assert_eq!(rest, whole[4..], "resumed run differs");
        assert!(wrong, "the initial buckets fit the saved memory");
    }
}

#[test]
fn rebuild_errors_are_values_and_never_hang() {
    // Ranks with different parameter counts: the broadcast fails on every rank (a
    // mismatch or the timeout), and each rank's finish says so.
    let out = run_local_with_timeout(2, Duration::from_secs(5), |group| {
        let rank = group.rank();
        let shapes: Vec<Vec<usize>> = (0..2 + rank).map(|_| vec![3]).collect();
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let hook = ddp_hooks::Noop::new();
        let mut r = Reducer::new(be, &shapes, hook, ReducerConfig::default())
            .unwrap()
            .with_process_group(group);
        for p in 0..shapes.len() {
            r.mark_ready(p).unwrap();
        }
        r.finish()
    })
    .unwrap();
    for r in out {
        assert!(matches!(r.unwrap(), Err(Error::Comm(_))));
    }
}

/// Issue 29, item 5: `mark_unused` on a parameter whose slot was written in this step
/// silently zeroed the gradient. It is now refused with an error naming the parameter,
/// the gradient is kept, and the step goes on (the parameter can still be marked ready).
/// A parameter not written in the step is still zeroed as unused.
#[test]
fn mark_unused_refuses_a_written_gradient() {
    let shapes = vec![vec![3, 4], vec![4]];
    let out = run_local_with_timeout(2, TIMEOUT, |g| {
        let mut r = reducer(Arc::new(g), &shapes, ReducerConfig::default());
        r.grad_mut(0).unwrap().fill(2.0);
        r.grad_mut(1).unwrap().fill(5.0);
        let refused = r.mark_unused(0);
        let kept = r.grad(0).unwrap().to_vec();
        r.mark_ready(0).unwrap();
        r.mark_ready(1).unwrap();
        r.finish().unwrap();
        let first = r.grad(0).unwrap().to_vec();
        r.zero_grad().unwrap();
        // The next step starts afresh: an unwritten parameter may be marked unused.
        r.grad_mut(1).unwrap().fill(1.0);
        r.mark_ready(1).unwrap();
        r.mark_unused(0).unwrap();
        r.finish().unwrap();
        (refused, kept, first, r.grad(0).unwrap().to_vec())
    })
    .unwrap();
    for rank in out {
        let (refused, kept, first, second) = rank.unwrap();
        match refused {
            Err(e @ Error::WrittenUnused { param: 0, .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("parameter 0 (shape [3, 4])"), "{msg}");
            }
            other => panic!("a written gradient was marked unused: {other:?}"),
        }
        assert_eq!(kept, vec![2.0; 12], "the refusal changed the gradient");
        assert_eq!(first, vec![2.0; 12]);
        assert_eq!(second, vec![0.0; 12]);
    }
}
