//! Resuming PowerSGD from a saved state (issue 14): the batched hook's `load` (it had
//! `save` but no `load` nor `config`), the state of a hook built from a registry string
//! saved and loaded through `CommHook`, and the states that must be refused.

use collectives::{run_local, ProcessGroup};
use ddp_hooks::{
    BatchedPowerSgd, CommHook, Error, GradBucket, HookSpec, HookState, Layout, PowerSgd,
    PowerSgdConfig,
};
use lowrank::{CpuBackend, NormalRng};
use std::sync::{Arc, Barrier};

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new().with_threads(1).unwrap())
}

fn config(rank: usize, start: u64) -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: rank,
        start_powersgd_iter: start,
        ..PowerSgdConfig::default()
    }
}

/// A layout with two compressible matrices, a bias and a matrix too small to compress.
fn layout() -> Arc<Layout> {
    Arc::new(Layout::packed(&[vec![32, 48], vec![32], vec![20, 24], vec![3, 2]]).unwrap())
}

fn grad(rank: usize, step: usize) -> Vec<f32> {
    random(layout().len(), (rank * 1000 + step) as u64)
}

/// Runs `steps` (0-based, in order) of `hook` on one bucket, the step number choosing the
/// gradient; returns the outputs.
fn steps(
    hook: &mut dyn CommHook<CpuBackend>,
    rank: usize,
    steps: std::ops::Range<usize>,
) -> Vec<Vec<f32>> {
    let layout = layout();
    steps
        .map(|s| {
            let b = GradBucket::new(0, 1, grad(rank, s), layout.clone()).unwrap();
            hook.run(b).wait().unwrap()
        })
        .collect()
}

/// The batched hook resumes bit-identically: 10 uninterrupted steps against 6 steps, a
/// save through JSON, `BatchedPowerSgd::load` on a fresh group, and 4 more steps. Its
/// `config` is the configuration it was built with.
#[test]
fn the_batched_hook_resumes_bit_identically() {
    for cfg in [
        config(1, 3),
        config(2, 3),
        PowerSgdConfig {
            warm_start: false,
            use_error_feedback: true,
            ..config(2, 3)
        },
    ] {
        let full = run_local(2, |g| {
            let rank = g.rank();
            let mut hook = BatchedPowerSgd::new(backend(), Arc::new(g), cfg.clone()).unwrap();
            assert_eq!(hook.config(), cfg);
            steps(&mut hook, rank, 0..10)
        })
        .unwrap();
        let saved = run_local(2, |g| {
            let rank = g.rank();
            let mut hook = BatchedPowerSgd::new(backend(), Arc::new(g), cfg.clone()).unwrap();
            steps(&mut hook, rank, 0..6);
            serde_json::to_string(&hook.save().unwrap()).unwrap()
        })
        .unwrap();
        let resumed = run_local(2, |g| {
            let rank = g.rank();
            let state = serde_json::from_str(saved[rank].as_ref().unwrap()).unwrap();
            let mut hook = BatchedPowerSgd::load(backend(), Arc::new(g), state).unwrap();
            assert_eq!(hook.config(), cfg);
            assert_eq!(hook.iteration(), 6);
            steps(&mut hook, rank, 6..10)
        })
        .unwrap();
        for (rank, (full, resumed)) in full.into_iter().zip(resumed).enumerate() {
            assert_eq!(
                resumed.unwrap(),
                full.unwrap()[6..10].to_vec(),
                "{cfg:?}: rank {rank} diverged after resuming"
            );
        }
    }
}

/// Issue 14's acceptance test: a hook built from `"powersgd:rank=2,start_iter=10"`,
/// saved after step 5 (through `CommHook::save_state` and JSON) and loaded into a new
/// hook built from the same string, gives steps 6 to 10 bit-identical to an uninterrupted
/// run, and so on into the compressed steps (11 to 15); its iteration and statistics
/// follow.
#[test]
fn a_hook_built_from_a_string_saves_after_step_5_and_resumes_exactly() {
    let spec: HookSpec = "powersgd:rank=2,start_iter=10".parse().unwrap();
    // Steps are numbered from 1: step s uses gradient s.
    let full = run_local(2, |g| {
        let rank = g.rank();
        let mut hook = spec.build(backend(), Arc::new(g)).unwrap();
        let outs = steps(&mut *hook, rank, 1..16);
        (outs, (*hook).iteration(), (*hook).compression_stats())
    })
    .unwrap();
    let saved = run_local(2, |g| {
        let rank = g.rank();
        let mut hook = spec.build(backend(), Arc::new(g)).unwrap();
        steps(&mut *hook, rank, 1..6);
        serde_json::to_string(&(*hook).save_state().unwrap()).unwrap()
    })
    .unwrap();
    let resumed = run_local(2, |g| {
        let rank = g.rank();
        let mut hook = spec.build(backend(), Arc::new(g)).unwrap();
        let state: HookState = serde_json::from_str(saved[rank].as_ref().unwrap()).unwrap();
        (*hook).load_state(state).unwrap();
        assert_eq!((*hook).iteration(), Some(5));
        let outs = steps(&mut *hook, rank, 6..16);
        (outs, (*hook).iteration(), (*hook).compression_stats())
    })
    .unwrap();
    for (rank, (full, resumed)) in full.into_iter().zip(resumed).enumerate() {
        let (full, resumed) = (full.unwrap(), resumed.unwrap());
        assert_eq!(resumed.0[..5], full.0[5..10], "rank {rank}: steps 6 to 10");
        assert_eq!(resumed.0[5..], full.0[10..], "rank {rank}: steps 11 to 15");
        assert_eq!((resumed.1, resumed.2), (full.1, full.2), "rank {rank}");
        assert_eq!(resumed.1, Some(15));
        assert!(resumed.2.unwrap().ratio > 1.0, "steps 11 to 15 compress");
    }
}

/// A state is loaded only into a hook of its own kind and configuration; a refused state
/// leaves the hook as it was.
#[test]
fn a_state_of_another_hook_or_configuration_is_refused() {
    let out = run_local(1, |g| {
        let g: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut per_layer = PowerSgd::new(backend(), g.clone(), config(2, 2)).unwrap();
        let mut batched = BatchedPowerSgd::new(backend(), g.clone(), config(2, 2)).unwrap();
        steps(&mut per_layer, 0, 0..3);
        steps(&mut batched, 0, 0..3);
        let rank1 = PowerSgd::new(backend(), g.clone(), config(1, 2)).unwrap();
        let allreduce = "allreduce"
            .parse::<HookSpec>()
            .unwrap()
            .build(backend(), g.clone())
            .unwrap();
        let fp16 = "fp16"
            .parse::<HookSpec>()
            .unwrap()
            .build(backend(), g.clone())
            .unwrap();
        let mut errors = vec![
            // PowerSGD into batched, and back.
            batched.load_state(per_layer.save_state().unwrap()),
            per_layer.load_state(batched.save_state().unwrap()),
            // Another rank.
            rank1.load_state(per_layer.save_state().unwrap()),
            // A stateless hook's state into PowerSGD, and PowerSGD's into a stateless hook.
            per_layer.load_state((*allreduce).save_state().unwrap()),
            (*allreduce).load_state(per_layer.save_state().unwrap()),
            // Another stateless hook.
            (*fp16).load_state((*allreduce).save_state().unwrap()),
        ];
        // A batched state whose memories do not fit the bucket's padded matrix.
        let mut bad = batched.save().unwrap();
        bad.buckets.get_mut(&0).unwrap().q.pop();
        errors.push(batched.load_state(HookState::BatchedPowerSgd(Box::new(bad.clone()))));
        errors.push(BatchedPowerSgd::load(backend(), g.clone(), bad).map(|_| ()));
        // A bucket length no buffer could hold (a corrupt or hostile checkpoint).
        let mut huge = batched.save().unwrap();
        huge.buckets.get_mut(&0).unwrap().len = usize::MAX;
        errors.push(BatchedPowerSgd::load(backend(), g.clone(), huge).map(|_| ()));
        // The hooks are unchanged: their iteration, and their next step.
        assert_eq!(
            (
                per_layer.iteration(),
                batched.iteration(),
                rank1.iteration()
            ),
            (3, 3, 0)
        );
        (*allreduce)
            .load_state((*allreduce).save_state().unwrap())
            .unwrap();
        errors
    })
    .unwrap()
    .remove(0)
    .unwrap();
    for (i, e) in out.into_iter().enumerate() {
        assert!(matches!(e, Err(Error::State(_))), "case {i}: {e:?}");
    }
}

/// Saving or loading while a step is in flight is a typed error naming the bucket, for
/// both hooks; the step then completes normally.
#[test]
fn saving_or_loading_during_a_step_is_refused() {
    let barrier = Barrier::new(2);
    let out = run_local(2, |g| {
        let rank = g.rank();
        let g: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut per_layer = PowerSgd::new(backend(), g.clone(), config(2, 2)).unwrap();
        let mut batched = BatchedPowerSgd::new(backend(), g, config(2, 2)).unwrap();
        let mut errors = Vec::new();
        for hook in [
            &mut per_layer as &mut dyn CommHook<CpuBackend>,
            &mut batched,
        ] {
            steps(hook, rank, 0..2);
            let state = hook.save_state().unwrap();
            let work = hook.run(GradBucket::new(0, 1, grad(rank, 2), layout()).unwrap());
            if rank == 0 {
                // Rank 1 has not started the step, so rank 0's P all-reduce is pending.
                errors.push(hook.save_state().map(|_| ()));
                errors.push(hook.load_state(state));
            }
            barrier.wait();
            work.wait().unwrap();
            assert_eq!(hook.iteration(), Some(3));
            hook.save_state().unwrap();
        }
        errors
    })
    .unwrap();
    let errors = out.into_iter().next().unwrap().unwrap();
    assert_eq!(errors.len(), 4);
    for e in errors {
        assert!(
            matches!(&e, Err(Error::Bucket { index: 0, why }) if why.contains("not completed")),
            "{e:?}"
        );
    }
}
