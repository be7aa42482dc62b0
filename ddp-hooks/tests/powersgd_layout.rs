//! A PowerSGD memory belongs to the bucket layout it was built for (reference, "Our
//! choices" 9 and 10). Bug: the hooks compared only the bucket length and the memory
//! sizes, so a state saved for `[64x32, 32x64]` and applied to `[32x64, 64x32]` (same
//! length, same error, `P` and `Q` sizes) was accepted, the first matrix's row-major
//! error added onto the second's slot and `Q` split at the wrong offsets; the batched
//! hook, whose memory is positional over the bucket, likewise. Now each bucket's memory
//! records its parameter shapes (`SavedBucket::layout`, absent from older states, which
//! still load) and a step with other shapes is `Error::Bucket` naming both layouts.
//!
//! Also: the batched hook counted the statistics of a step it then refused (a changed
//! length); it now counts them only once the step's checks have passed.

use collectives::{run_local, ProcessGroup};
use ddp_hooks::{
    BatchedPowerSgd, CompressionStats, Error, GradBucket, Layout, PowerSgd, PowerSgdConfig,
    PowerSgdState,
};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;

const RANKS: usize = 2;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new().with_threads(1).unwrap())
}

fn config() -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: 2,
        start_powersgd_iter: 2,
        use_error_feedback: true,
        warm_start: true,
        ..PowerSgdConfig::default()
    }
}

/// The layout the memory is built for, and the same two matrices the other way round:
/// 4096 elements either way, and the same error, `P` and `Q` sizes at any rank.
fn saved_shapes() -> Vec<Vec<usize>> {
    vec![vec![64, 32], vec![32, 64]]
}

fn swapped_shapes() -> Vec<Vec<usize>> {
    vec![vec![32, 64], vec![64, 32]]
}

fn layout(shapes: &[Vec<usize>]) -> Arc<Layout> {
    Arc::new(Layout::packed(shapes).unwrap())
}

/// One step of bucket 0 (of 1) with rank `rank`'s gradient for step `step`.
fn step<H: ddp_hooks::CommHook<CpuBackend>>(
    hook: &mut H,
    layout: &Arc<Layout>,
    rank: usize,
    step: u64,
) -> Result<Vec<f32>, Error> {
    let g = random(layout.len(), step * 100 + rank as u64);
    let bucket = GradBucket::new(0, 1, g, layout.clone()).unwrap();
    hook.run(bucket).wait().map_err(Error::from)
}

/// Three steps (two exact, one compressed) of the per-layer hook on `[64x32, 32x64]`,
/// saved through JSON, one string per rank.
fn saved_per_layer() -> Vec<String> {
    run_local(RANKS, |g| {
        let rank = g.rank();
        let mut hook = PowerSgd::new(backend(), Arc::new(g), config()).unwrap();
        let l = layout(&saved_shapes());
        for s in 0..3 {
            step(&mut hook, &l, rank, s).unwrap();
        }
        serde_json::to_string(&hook.save().unwrap()).unwrap()
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

/// The typed error of a refused layout: bucket 0, both layouts named.
fn assert_layout_refused(e: &Error) {
    match e {
        Error::Bucket { index: 0, why } => {
            assert!(why.contains("layout changed"), "{why}");
            assert!(why.contains("[[64, 32], [32, 64]]"), "{why}");
            assert!(why.contains("[[32, 64], [64, 32]]"), "{why}");
            assert!(
                why.contains("parameter 0 was [64, 32], is now [32, 64]"),
                "{why}"
            );
        }
        other => panic!("expected a bucket error, got {other:?}"),
    }
}

/// The bug's example: a state saved for `[64x32, 32x64]` loaded into a hook whose bucket
/// is `[32x64, 64x32]`. Its step is refused on every rank (on the old code it ran,
/// misapplying the memory), and the refusal changes nothing: the right layout then
/// continues exactly as a hook that never saw it.
#[test]
fn a_state_loaded_into_another_layout_of_the_same_size_is_refused() {
    let saved = saved_per_layer();
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let state: PowerSgdState = serde_json::from_str(&saved[rank]).unwrap();
        let bucket = &state.buckets[&0];
        assert_eq!(bucket.layout, Some(saved_shapes()));
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut hook = PowerSgd::load(backend(), group.clone(), state.clone()).unwrap();
        let refused = step(&mut hook, &layout(&swapped_shapes()), rank, 3).unwrap_err();
        // The same through `load_state` into a fresh hook.
        let mut other = PowerSgd::new(backend(), group.clone(), config()).unwrap();
        ddp_hooks::CommHook::load_state(
            &other,
            ddp_hooks::HookState::PowerSgd(Box::new(state.clone())),
        )
        .unwrap();
        let refused_too = step(&mut other, &layout(&swapped_shapes()), rank, 3).unwrap_err();
        // The refused step changed nothing.
        let after = step(&mut hook, &layout(&saved_shapes()), rank, 3).unwrap();
        let mut fresh = PowerSgd::load(backend(), group, state).unwrap();
        let want = step(&mut fresh, &layout(&saved_shapes()), rank, 3).unwrap();
        (refused, refused_too, after, want)
    })
    .unwrap();
    for r in out {
        let (refused, refused_too, after, want) = r.unwrap();
        assert_layout_refused(&refused);
        assert_layout_refused(&refused_too);
        assert_eq!(after, want);
    }
}

/// A live hook whose bucket is rebuilt into another layout of the same size (as
/// `Reducer::set_bucket_params` may do) refuses the step instead of misapplying its
/// memory. Without memory (no error feedback, no warm start) the layout may change.
#[test]
fn a_live_hook_refuses_a_reordered_bucket() {
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut hook = PowerSgd::new(backend(), group.clone(), config()).unwrap();
        let before = layout(&saved_shapes());
        for s in 0..3 {
            step(&mut hook, &before, rank, s).unwrap();
        }
        let refused = step(&mut hook, &layout(&swapped_shapes()), rank, 3).unwrap_err();
        let memoryless = PowerSgdConfig {
            use_error_feedback: false,
            warm_start: false,
            ..config()
        };
        let mut free = PowerSgd::new(backend(), group, memoryless).unwrap();
        for s in 0..3 {
            step(&mut free, &before, rank, s).unwrap();
        }
        let free_ok = step(&mut free, &layout(&swapped_shapes()), rank, 3);
        (refused, free_ok.is_ok())
    })
    .unwrap();
    for r in out {
        let (refused, free_ok) = r.unwrap();
        assert_layout_refused(&refused);
        assert!(free_ok, "a hook without memory has nothing to misapply");
    }
}

/// A state saved before layouts were recorded (the fresh save's JSON without the new
/// field) still loads and runs, bit-identically to the fresh save; its step records the
/// layout it meets, so a later change of layout is refused.
#[test]
fn a_state_saved_without_layouts_still_loads() {
    let saved = saved_per_layer();
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let mut json: serde_json::Value = serde_json::from_str(&saved[rank]).unwrap();
        let buckets = json["buckets"].as_object_mut().unwrap();
        assert!(!buckets.is_empty());
        for bucket in buckets.values_mut() {
            let removed = bucket.as_object_mut().unwrap().remove("layout");
            assert!(removed.is_some(), "the fresh save records the layout");
        }
        let old: PowerSgdState = serde_json::from_value(json).unwrap();
        assert!(old.buckets.values().all(|b| b.layout.is_none()));
        let new: PowerSgdState = serde_json::from_str(&saved[rank]).unwrap();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let l = layout(&saved_shapes());
        let mut from_old = PowerSgd::load(backend(), group.clone(), old).unwrap();
        let mut from_new = PowerSgd::load(backend(), group, new).unwrap();
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for s in 3..5 {
            got.push(step(&mut from_old, &l, rank, s).unwrap());
            want.push(step(&mut from_new, &l, rank, s).unwrap());
        }
        let recorded = from_old.save().unwrap().buckets[&0].layout.clone();
        let refused = step(&mut from_old, &layout(&swapped_shapes()), rank, 5).unwrap_err();
        (got, want, recorded, refused)
    })
    .unwrap();
    for r in out {
        let (got, want, recorded, refused) = r.unwrap();
        assert_eq!(got, want);
        assert_eq!(recorded, Some(saved_shapes()));
        assert_layout_refused(&refused);
    }
}

/// A recorded layout that does not describe the saved memories is a corrupt state:
/// refused at load with `Error::State`, by both hooks.
#[test]
fn a_recorded_layout_that_does_not_fit_the_memories_is_refused_at_load() {
    let saved = saved_per_layer();
    let out = run_local(1, |g| {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let state: PowerSgdState = serde_json::from_str(&saved[0]).unwrap();
        let mut errors = Vec::new();
        // Same length, nothing compressed: the layout needs no error memory.
        for shapes in [vec![vec![4096]], vec![vec![64, 32]]] {
            let mut bad = state.clone();
            bad.buckets.get_mut(&0).unwrap().layout = Some(shapes);
            errors.push(PowerSgd::load(backend(), group.clone(), bad).err());
        }
        let batched = batched_saved(group.clone());
        let mut bad = batched;
        bad.buckets.get_mut(&0).unwrap().layout = Some(vec![vec![16, 17]]);
        errors.push(BatchedPowerSgd::load(backend(), group, bad).err());
        errors
    })
    .unwrap();
    for e in out.into_iter().next().unwrap().unwrap() {
        assert!(matches!(e, Some(Error::State(_))), "{e:?}");
    }
}

/// Three batched steps of a one-rank hook on `[16x8, 8x16]`, saved.
fn batched_saved(group: Arc<dyn ProcessGroup>) -> PowerSgdState {
    let mut hook = BatchedPowerSgd::new(backend(), group, config()).unwrap();
    let l = layout(&[vec![16, 8], vec![8, 16]]);
    for s in 0..3 {
        step(&mut hook, &l, 0, s).unwrap();
    }
    hook.save().unwrap()
}

/// The batched hook's memory is positional (element `i`'s error belongs to the
/// parameter at `i`): a bucket reordered at the same length is refused as well, live or
/// after loading (but not without error feedback and warm start, which keep nothing
/// that depends on it).
#[test]
fn the_batched_hook_refuses_a_reordered_bucket() {
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut hook = BatchedPowerSgd::new(backend(), group.clone(), config()).unwrap();
        let l = layout(&saved_shapes());
        for s in 0..3 {
            step(&mut hook, &l, rank, s).unwrap();
        }
        let live = step(&mut hook, &layout(&swapped_shapes()), rank, 3).unwrap_err();
        let state = hook.save().unwrap();
        assert_eq!(state.buckets[&0].layout, Some(saved_shapes()));
        let mut loaded = BatchedPowerSgd::load(backend(), group.clone(), state).unwrap();
        let after_load = step(&mut loaded, &layout(&swapped_shapes()), rank, 3).unwrap_err();
        let mut ok = step(&mut loaded, &l, rank, 3).is_ok();
        // Without error feedback and warm start nothing kept depends on the layout.
        let memoryless = PowerSgdConfig {
            use_error_feedback: false,
            warm_start: false,
            ..config()
        };
        let mut free = BatchedPowerSgd::new(backend(), group, memoryless).unwrap();
        for s in 0..3 {
            ok &= step(&mut free, &l, rank, s).is_ok();
        }
        ok &= step(&mut free, &layout(&swapped_shapes()), rank, 3).is_ok();
        (live, after_load, ok)
    })
    .unwrap();
    for r in out {
        let (live, after_load, ok) = r.unwrap();
        assert_layout_refused(&live);
        assert_layout_refused(&after_load);
        assert!(
            ok,
            "the recorded layout still steps, and a hook without memory takes any"
        );
    }
}

/// The batched hook counts a step's statistics only once it has passed its checks: a
/// step refused for a changed length (272 elements after three of 256) counts nothing.
/// On the old code the refused step added its 272 elements.
#[test]
fn the_batched_hook_does_not_count_a_refused_step() {
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let mut hook = BatchedPowerSgd::new(backend(), Arc::new(g), config()).unwrap();
        let l256 = layout(&[vec![16, 16]]);
        for s in 0..3 {
            step(&mut hook, &l256, rank, s).unwrap();
        }
        let counted = hook.compression_stats();
        let refused = step(&mut hook, &layout(&[vec![16, 17]]), rank, 3).unwrap_err();
        (counted, refused, hook.compression_stats(), hook.iteration())
    })
    .unwrap();
    for r in out {
        let (counted, refused, stats, iter) = r.unwrap();
        assert!(
            matches!(&refused, Error::Bucket { index: 0, why } if why.contains("length changed")),
            "{refused:?}"
        );
        // One compressed step (the third): 256 elements before, 2 · 16 · 2 after.
        assert_eq!(counted, CompressionStats::new(256, 64));
        assert_eq!(stats, counted, "the refused step was counted");
        assert_eq!(iter, 3);
    }
}
