//! Model averaging and post-local SGD on thread ranks: `PeriodicModelAverager` averages
//! exactly at steps `warmup + k·period`, `HierarchicalModelAverager` in the group of the
//! largest period dividing the step, and `PostLocalSgd` averages globally before its
//! start, then within its subgroup (or not at all), with its iteration saved and resumed.

use collectives::{run_local, ProcessGroup, ThreadGroup};
use ddp_hooks::averaging::{new_subgroups, AveragerState, PostLocalSgdState};
use ddp_hooks::{
    CommHook, Error, GradBucket, HierarchicalModelAverager, HookState, Layout,
    PeriodicModelAverager, PostLocalSgd,
};
use lowrank::CpuBackend;
use std::sync::Arc;

/// Runs `f` on `n` thread ranks and unwraps every rank's result.
fn ranks<R: Send>(n: usize, f: impl Fn(ThreadGroup) -> R + Sync) -> Vec<R> {
    run_local(n, f)
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

/// The parameters of rank `rank`: a weight of 5 and a bias of 2, distinct per rank.
fn init(rank: usize) -> (Vec<f32>, Vec<f32>) {
    let r = rank as f32;
    ((0..5).map(|i| r * 8.0 + i as f32).collect(), vec![-r; 2])
}

/// A local optimizer step: small integers, so every mean of 2 or 4 ranks is exact.
fn local_step(rank: usize, step: u64, w: &mut [f32], b: &mut [f32]) {
    for (i, x) in w.iter_mut().enumerate() {
        *x += ((rank + 1) * (step as usize + 1) + i) as f32;
    }
    for x in b.iter_mut() {
        *x -= (rank + 2) as f32;
    }
}

/// The element-wise mean of `members`' parameters, written back into each of them.
fn mean_into(params: &mut [(Vec<f32>, Vec<f32>)], members: &[usize]) {
    let n = members.len() as f32;
    let mut w = vec![0.0f32; params[0].0.len()];
    let mut b = vec![0.0f32; params[0].1.len()];
    for &m in members {
        for (acc, x) in w.iter_mut().zip(&params[m].0) {
            *acc += x / n;
        }
        for (acc, x) in b.iter_mut().zip(&params[m].1) {
            *acc += x / n;
        }
    }
    for &m in members {
        params[m] = (w.clone(), b.clone());
    }
}

/// Every rank's `(averaged?, weight, bias)` after each of `steps` steps of the periodic
/// averager.
type Trace = Vec<(bool, Vec<f32>, Vec<f32>)>;

fn periodic_trace(world: usize, period: u64, warmup: u64, steps: u64) -> Vec<Trace> {
    ranks(world, |group| {
        let rank = group.rank();
        let mut avg = PeriodicModelAverager::new(period, warmup, Arc::new(group)).unwrap();
        let (mut w, mut b) = init(rank);
        let mut trace = Vec::new();
        for step in 0..steps {
            assert_eq!(avg.step(), step);
            local_step(rank, step, &mut w, &mut b);
            let averaged = avg.average_parameters(&mut [&mut w, &mut b]).unwrap();
            trace.push((averaged, w.clone(), b.clone()));
        }
        assert_eq!(avg.step(), steps);
        trace
    })
}

/// Averages exactly at steps `warmup`, `warmup + period`, ...: the parameters diverge
/// locally in between, and right after an averaging step they are equal on every rank
/// and equal to the mean computed here.
#[test]
fn periodic_averages_at_warmup_plus_multiples_of_the_period() {
    for world in [2, 4] {
        let (period, warmup, steps) = (3, 2, 12);
        let traces = periodic_trace(world, period, warmup, steps);
        let mut model: Vec<_> = (0..world).map(init).collect();
        let all: Vec<usize> = (0..world).collect();
        for step in 0..steps {
            for (rank, (w, b)) in model.iter_mut().enumerate() {
                local_step(rank, step, w, b);
            }
            let due = step >= warmup && (step - warmup) % period == 0;
            if due {
                mean_into(&mut model, &all);
            }
            assert_eq!(
                [2, 5, 8, 11].contains(&step),
                due,
                "the test's own schedule"
            );
            for rank in 0..world {
                let (averaged, w, b) = &traces[rank][step as usize];
                assert_eq!(*averaged, due, "world {world}, rank {rank}, step {step}");
                assert_eq!((w, b), (&model[rank].0, &model[rank].1), "step {step}");
            }
            let first = &traces[0][step as usize];
            let equal = traces.iter().all(|t| t[step as usize] == *first);
            assert_eq!(equal, due, "world {world}, step {step}: equal across ranks");
        }
    }
}

/// Warmup 0 averages from step 0; a period of 1 (warned about) averages every step.
#[test]
fn periodic_from_step_zero_and_every_step() {
    let t = periodic_trace(2, 2, 0, 5);
    let averaged: Vec<bool> = t[0].iter().map(|s| s.0).collect();
    assert_eq!(averaged, [true, false, true, false, true]);
    let t = periodic_trace(2, 1, 0, 3);
    assert!(t[0].iter().all(|s| s.0));
    assert_eq!(t[0], t[1]);
}

/// The step is saved, serialised and resumed: a resumed averager continues exactly as
/// an uninterrupted one.
#[test]
fn periodic_resume_gives_identical_parameters() {
    let out = ranks(4, |group| {
        let rank = group.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let (period, warmup) = (2, 1);
        let mut whole = PeriodicModelAverager::new(period, warmup, group.clone()).unwrap();
        let mut first = PeriodicModelAverager::new(period, warmup, group.clone()).unwrap();
        let (mut w1, mut b1) = init(rank);
        let (mut w2, mut b2) = init(rank);
        let mut saved = None;
        for step in 0..8 {
            local_step(rank, step, &mut w1, &mut b1);
            let a1 = whole.average_parameters(&mut [&mut w1, &mut b1]).unwrap();
            local_step(rank, step, &mut w2, &mut b2);
            let a2 = match (step, &mut saved) {
                (0..=2, _) => first.average_parameters(&mut [&mut w2, &mut b2]).unwrap(),
                (3, saved) => {
                    let json = serde_json::to_string(&first.state()).unwrap();
                    let state: AveragerState = serde_json::from_str(&json).unwrap();
                    assert_eq!(state, AveragerState { step: 3 });
                    let mut resumed =
                        PeriodicModelAverager::new(period, warmup, group.clone()).unwrap();
                    resumed.load_state(state);
                    let a = resumed.average_parameters(&mut [&mut w2, &mut b2]).unwrap();
                    *saved = Some(resumed);
                    a
                }
                (_, Some(resumed)) => resumed.average_parameters(&mut [&mut w2, &mut b2]).unwrap(),
                _ => unreachable!(),
            };
            assert_eq!(a1, a2);
            assert_eq!((&w1, &b1), (&w2, &b2), "rank {rank}, step {step}");
        }
        let mut resumed = saved.unwrap();
        assert_eq!(resumed.step(), 8);
        resumed.set_step(1);
        assert_eq!(resumed.step(), 1);
        assert!(resumed.average_parameters(&mut [&mut w2]).unwrap());
        w1
    });
    assert!(out.iter().all(|w| *w == out[0]));
}

/// Bad configurations are typed errors on every rank alike, before any subgroup is made
/// (so the ranks stay in step and can go on with valid averagers).
#[test]
fn bad_configurations_are_errors() {
    let out = ranks(4, |group| {
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let config = |e: Error| matches!(e, Error::Config(_));
        let mut ok = vec![config(
            PeriodicModelAverager::new(0, 0, group.clone())
                .err()
                .unwrap(),
        )];
        for periods in [
            vec![],               // empty
            vec![(0, 2), (4, 4)], // first period 0
            vec![(2, 2), (4, 2)], // last size is not the group's
            vec![(2, 2), (4, 8)], // last size larger than the group
            vec![(4, 2), (2, 4)], // not ascending
            vec![(2, 2), (2, 4)], // a repeated period
            vec![(2, 3), (4, 4)], // 3 does not divide 4
            vec![(2, 0), (4, 4)], // a group of 0
            vec![(2, 2), (0, 4)], // a later period of 0
        ] {
            let e = HierarchicalModelAverager::new(periods.clone(), 0, group.clone());
            ok.push(config(e.err().unwrap()));
        }
        // A last period of 1 only warns.
        let h = HierarchicalModelAverager::new(vec![(1, 4)], 0, group.clone()).unwrap();
        ok.push(h.periods() == [(1, 4)]);
        assert!(matches!(new_subgroups(&*group, 3), Err(Error::Config(_))));
        assert!(matches!(new_subgroups(&*group, 0), Err(Error::Config(_))));
        // The group still works: a valid averager after the errors.
        let mut avg = PeriodicModelAverager::new(1, 0, group.clone()).unwrap();
        let mut w = vec![group.rank() as f32];
        ok.push(avg.average_parameters(&mut [&mut w]).unwrap());
        ok.push(w == [1.5]);
        ok
    });
    for ok in out {
        assert!(ok.iter().all(|&b| b), "{ok:?}");
    }
}

/// `{2: 2, 4: 4}` on 4 ranks: pairs `{0, 1}`, `{2, 3}` average at steps 2, 6, 10; all four
/// at 0, 4, 8 (`step % period`, as PyTorch). With warmup 3, steps 0 and 2 are skipped and
/// step 3 does not average (it would be `warmup + 0·period` for the periodic averager).
#[test]
fn hierarchical_averages_in_pairs_and_globally() {
    for warmup in [0u64, 3] {
        let steps = 11u64;
        let traces = ranks(4, |group| {
            let rank = group.rank();
            let mut avg =
                HierarchicalModelAverager::new(vec![(2, 2), (4, 4)], warmup, Arc::new(group))
                    .unwrap();
            assert_eq!(avg.periods(), [(2, 2), (4, 4)]);
            let (mut w, mut b) = init(rank);
            let mut trace = Vec::new();
            for step in 0..steps {
                local_step(rank, step, &mut w, &mut b);
                let at = avg.average_parameters(&mut [&mut w, &mut b]).unwrap();
                trace.push((at, w.clone(), b.clone()));
            }
            assert_eq!(avg.step(), steps);
            trace
        });
        let mut model: Vec<_> = (0..4).map(init).collect();
        for step in 0..steps {
            for (rank, (w, b)) in model.iter_mut().enumerate() {
                local_step(rank, step, w, b);
            }
            let expected = match step {
                s if s < warmup => None,
                s if s % 4 == 0 => Some(4),
                s if s % 2 == 0 => Some(2),
                _ => None,
            };
            match expected {
                Some(4) => mean_into(&mut model, &[0, 1, 2, 3]),
                Some(2) => {
                    mean_into(&mut model, &[0, 1]);
                    mean_into(&mut model, &[2, 3]);
                }
                _ => {}
            }
            for rank in 0..4 {
                let (at, w, b) = &traces[rank][step as usize];
                assert_eq!(*at, expected, "warmup {warmup}, rank {rank}, step {step}");
                assert_eq!((w, b), (&model[rank].0, &model[rank].1), "step {step}");
            }
            let s = step as usize;
            let pairs = traces[0][s] == traces[1][s] && traces[2][s] == traces[3][s];
            let global = pairs && traces[0][s] == traces[2][s];
            assert_eq!(pairs, expected.is_some(), "step {step}");
            assert_eq!(global, expected == Some(4), "step {step}");
        }
        let scheduled: Vec<u64> = (0..steps)
            .filter(|&s| traces[0][s as usize].0.is_some())
            .collect();
        if warmup == 0 {
            assert_eq!(scheduled, [0, 2, 4, 6, 8, 10]);
        } else {
            assert_eq!(scheduled, [4, 6, 8, 10]);
        }
    }
}

/// The gradient of element `i` of bucket `bucket` on rank `rank` at step `step`: small
/// integers, so every mean is exact.
fn grad(rank: usize, step: u64, bucket: usize, i: usize) -> f32 {
    (rank * 16 + step as usize * 3 + bucket * 7 + i) as f32
}

/// Two buckets per step: a weight with its bias, then a matrix.
fn layouts() -> Vec<Arc<Layout>> {
    vec![
        Arc::new(Layout::packed(&[vec![2, 3], vec![2]]).unwrap()),
        Arc::new(Layout::packed(&[vec![4, 2]]).unwrap()),
    ]
}

/// Runs `steps` on `hook`: each step's two bucket outputs, and the iteration after each
/// bucket.
fn hook_steps(
    hook: &mut dyn CommHook<CpuBackend>,
    rank: usize,
    steps: std::ops::Range<u64>,
) -> Vec<(Vec<Vec<f32>>, Vec<u64>)> {
    let layouts = layouts();
    steps
        .map(|step| {
            let mut outs = Vec::new();
            let mut iters = Vec::new();
            for (bucket, layout) in layouts.iter().enumerate() {
                let g = (0..layout.len())
                    .map(|i| grad(rank, step, bucket, i))
                    .collect();
                let b = GradBucket::new(bucket, layouts.len(), g, layout.clone()).unwrap();
                outs.push(hook.run(b).wait().unwrap());
                iters.push(hook.iteration().unwrap());
            }
            (outs, iters)
        })
        .collect()
}

/// The mean over `members` of bucket `bucket`'s gradients at `step`.
fn grad_mean(members: &[usize], step: u64, bucket: usize) -> Vec<f32> {
    let len = layouts()[bucket].len();
    (0..len)
        .map(|i| {
            let sum: f32 = members.iter().map(|&r| grad(r, step, bucket, i)).sum();
            sum / members.len() as f32
        })
        .collect()
}

fn post_local_sgd(
    group: ThreadGroup,
    subgroup_size: usize,
    start: u64,
    allreduce: bool,
) -> PostLocalSgd<CpuBackend> {
    let group: Arc<dyn ProcessGroup> = Arc::new(group);
    let sub = new_subgroups(&*group, subgroup_size).unwrap();
    assert_eq!(sub.size(), subgroup_size);
    PostLocalSgd::new(Arc::new(CpuBackend::new()), group, sub, start, allreduce).unwrap()
}

/// Before the start: the exact global mean; after it: the subgroup's mean (blocks of
/// consecutive ranks), or the bucket untouched without `post_local_gradient_allreduce`.
/// The iteration counts steps at their last bucket and freezes at the start.
#[test]
fn post_local_sgd_global_then_subgroup_or_local() {
    for world in [2, 4] {
        let sub = world / 2;
        for allreduce in [true, false] {
            let start = 3;
            let out = ranks(world, |group| {
                let rank = group.rank();
                let mut hook = post_local_sgd(group, sub, start, allreduce);
                assert_eq!(hook.name(), "post_local_sgd");
                assert_eq!(hook.iteration(), Some(0));
                hook_steps(&mut hook, rank, 0..6)
            });
            let all: Vec<usize> = (0..world).collect();
            for (rank, steps) in out.iter().enumerate() {
                let block: Vec<usize> = (rank / sub * sub..(rank / sub + 1) * sub).collect();
                for (step, (outs, iters)) in steps.iter().enumerate() {
                    let step = step as u64;
                    let frozen = step.min(start);
                    let after = (step + 1).min(start);
                    assert_eq!(*iters, [frozen, after], "rank {rank}, step {step}");
                    for (bucket, got) in outs.iter().enumerate() {
                        let want = if step < start {
                            grad_mean(&all, step, bucket)
                        } else if allreduce {
                            grad_mean(&block, step, bucket)
                        } else {
                            grad_mean(&[rank], step, bucket)
                        };
                        assert_eq!(
                            *got, want,
                            "world {world}, allreduce {allreduce}, rank {rank}, step {step}, bucket {bucket}"
                        );
                    }
                }
            }
        }
    }
}

/// A start of 0 is local from the first step.
#[test]
fn post_local_sgd_start_zero_is_local_at_once() {
    let out = ranks(4, |group| {
        let rank = group.rank();
        let mut hook = post_local_sgd(group, 2, 0, true);
        hook_steps(&mut hook, rank, 0..2)
    });
    for (rank, steps) in out.iter().enumerate() {
        let block = if rank < 2 { [0, 1] } else { [2, 3] };
        for (step, (outs, iters)) in steps.iter().enumerate() {
            assert_eq!(*iters, [0, 0]);
            assert_eq!(outs[1], grad_mean(&block, step as u64, 1));
        }
    }
}

/// The state round-trips through serde; a hook resumed from it gives the same outputs
/// as one that ran on; states of another configuration or kind are refused.
#[test]
fn post_local_sgd_save_load_and_resume() {
    let out = ranks(4, |group| {
        let rank = group.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let sub = new_subgroups(&*group, 2).unwrap();
        let backend = Arc::new(CpuBackend::new());
        let make = |start, allreduce| {
            PostLocalSgd::new(
                backend.clone(),
                group.clone(),
                sub.clone(),
                start,
                allreduce,
            )
            .unwrap()
        };
        let mut running = make(4, true);
        let early = hook_steps(&mut running, rank, 0..2);
        let state = running.save_state().unwrap();
        assert_eq!(
            state,
            HookState::PostLocalSgd(PostLocalSgdState {
                start_local_sgd_iter: 4,
                post_local_gradient_allreduce: true,
                iter: 2
            })
        );
        let json = serde_json::to_string(&state).unwrap();
        let state: HookState = serde_json::from_str(&json).unwrap();

        let resumed = make(4, true);
        resumed.load_state(state.clone()).unwrap();
        assert_eq!(CommHook::<CpuBackend>::iteration(&resumed), Some(2));
        let mut resumed = resumed;
        let a = hook_steps(&mut running, rank, 2..7);
        let b = hook_steps(&mut resumed, rank, 2..7);
        assert_eq!(a, b);
        assert_eq!(a.last().unwrap().1, [4, 4]);
        assert_eq!(resumed.state().iter, 4);

        // Refused, leaving the hook as it was.
        let other = make(4, false);
        let refused = [
            other.load_state(state.clone()),
            make(5, true).load_state(state.clone()),
            make(4, true).load_state(HookState::PostLocalSgd(PostLocalSgdState {
                start_local_sgd_iter: 4,
                post_local_gradient_allreduce: true,
                iter: 5,
            })),
            make(4, true).load_state(HookState::Stateless {
                hook: "allreduce".into(),
            }),
        ];
        let all_state_errors = refused.iter().all(|r| matches!(r, Err(Error::State(_))));
        assert_eq!(other.state().iter, 0);
        (early, a, all_state_errors)
    });
    for (rank, (early, a, errors)) in out.iter().enumerate() {
        assert!(errors);
        let all = [0, 1, 2, 3];
        let block = if rank < 2 { [0, 1] } else { [2, 3] };
        assert_eq!(early[0].0[0], grad_mean(&all, 0, 0));
        assert_eq!(a[1].0[1], grad_mean(&all, 3, 1)); // step 3: the last global one
        assert_eq!(a[2].0[1], grad_mean(&block, 4, 1)); // step 4: local
    }
}

/// A subgroup larger than the group is a configuration error.
#[test]
fn post_local_sgd_rejects_a_larger_subgroup() {
    let out = ranks(2, |group| {
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let world = group.clone();
        // A one-rank group as the "group" and the whole group as the "subgroup".
        let one: Arc<dyn ProcessGroup> = match group.new_group(&[0]).unwrap() {
            Some(g) => Arc::from(g),
            None => return true,
        };
        matches!(
            PostLocalSgd::new(Arc::new(CpuBackend::new()), one, world, 0, true),
            Err(Error::Config(_))
        )
    });
    assert!(out.into_iter().all(|ok| ok));
}

/// The registry's `post_local_sgd:start_iter=1,subgroup_size=2` on 4 ranks builds the same
/// hook: the global mean at step 0, the pair's mean from step 1.
#[test]
fn post_local_sgd_from_the_registry() {
    let out = ranks(4, |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let spec: ddp_hooks::HookSpec = "post_local_sgd:start_iter=1,subgroup_size=2"
            .parse()
            .unwrap();
        let mut hook = spec.build(Arc::new(CpuBackend::new()), group).unwrap();
        (rank, hook_steps(&mut *hook, rank, 0..2))
    });
    for (rank, steps) in out {
        let pair = if rank < 2 { [0, 1] } else { [2, 3] };
        for bucket in 0..2 {
            assert_eq!(
                steps[0].0[bucket],
                grad_mean(&[0, 1, 2, 3], 0, bucket),
                "rank {rank}"
            );
            assert_eq!(
                steps[1].0[bucket],
                grad_mean(&pair, 1, bucket),
                "rank {rank}"
            );
        }
    }
}
