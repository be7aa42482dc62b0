//! Regression tests for issue 8's defects in this crate (items 6 to 9): bad input to the
//! reducer, the registry and the PowerSGD state is a typed error, never an abort, a
//! panic, a wrapped-around count or a silent divergence between ranks. Each test names
//! the bug it guards.

use accum::GradSync;
use collectives::{run_local_with_timeout, ProcessGroup};
use ddp_hooks::{
    AllReduce, BatchedPowerSgd, CommHook, Error, GradBucket, HookSpec, Layout, Noop, PowerSgd,
    PowerSgdConfig, PowerSgdState, Reducer, ReducerConfig,
};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;
use std::time::Duration;

/// Long enough for any step here; short enough that a rank left waiting by a bug fails
/// the test quickly instead of after the default 30 minutes.
const TIMEOUT: Duration = Duration::from_secs(20);

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

fn noop_reducer(shapes: &[Vec<usize>]) -> ddp_hooks::Result<Reducer<CpuBackend, Noop<CpuBackend>>> {
    Reducer::new(
        Arc::new(CpuBackend::new()),
        shapes,
        Noop::new(),
        ReducerConfig::default(),
    )
}

// ---- Item 6: shape products and allocations ----

/// Bug: `Layout::packed` and `Reducer::new` multiplied shapes with wrapping arithmetic,
/// so `[2^32, 2^32]` was accepted as a parameter of 0 elements (and a sum of shapes
/// could wrap the same way).
#[test]
fn shape_products_that_overflow_are_errors() {
    let wraps = vec![1usize << 32, 1 << 32];
    let e = Layout::packed(std::slice::from_ref(&wraps)).unwrap_err();
    assert!(
        matches!(&e, Error::Overflow(m) if m.contains("parameter 0")),
        "{e}"
    );
    assert!(e.to_string().contains("[4294967296, 4294967296]"), "{e}");
    // Each shape fits, their sum does not.
    let e =
        Layout::packed(&[vec![1 << 62], vec![1 << 62], vec![1 << 62], vec![1 << 62]]).unwrap_err();
    assert!(matches!(e, Error::Overflow(_)), "{e}");
    // The reducer refuses the same shape, and so a bucket that would hold 0 elements.
    let e = noop_reducer(&[vec![3, 4], wraps]).err().unwrap();
    assert!(
        matches!(&e, Error::Overflow(m) if m.contains("parameter 1")),
        "{e}"
    );
    // Shapes that fit still pack as before.
    let layout = Layout::packed(&[vec![2, 3], vec![], vec![0, 7], vec![4]]).unwrap();
    assert_eq!(layout.len(), 6 + 1 + 4);
    assert_eq!(layout.params()[3].offset, 7);
}

/// Bug: the reducer allocated bucket storage with an infallible allocation, so a shape
/// too large for memory aborted the process (`[2^60]`: the allocator refuses 4 EiB) or
/// panicked (`[2^62]`: more bytes than `isize::MAX`). Both are errors now, returned
/// before anything is allocated, so this test allocates nothing large.
#[test]
fn shapes_too_large_for_memory_are_errors_not_aborts() {
    // 2^60 f32 = 2^62 bytes: a valid size that no allocator can give (it exceeds every
    // x86-64 and AArch64 address space), so this reaches the allocator and is refused.
    let e = noop_reducer(&[vec![1 << 60]]).err().unwrap();
    assert_eq!(
        e,
        Error::Alloc {
            elements: 1 << 60,
            element_bytes: 4
        }
    );
    // 2^62 f32 = 2^64 bytes: caught by the size check, as is the same count split over
    // dimensions, and next to ordinary parameters.
    for shapes in [
        vec![vec![1usize << 62]],
        vec![vec![1 << 31, 1 << 31]],
        vec![vec![10, 10], vec![1 << 40, 1 << 22], vec![10]],
    ] {
        let e = noop_reducer(&shapes).err().unwrap();
        assert!(matches!(e, Error::Overflow(_)), "{shapes:?}: {e}");
    }
}

// ---- Item 7: switching synchronisation in the middle of a step ----

/// Two parameters, each in its own bucket: bucket 0 holds parameter 1, bucket 1
/// parameter 0.
fn two_bucket_reducer(group: Arc<dyn ProcessGroup>) -> Reducer<CpuBackend, AllReduce<CpuBackend>> {
    let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
    let hook = AllReduce::new(be.clone(), group);
    let tiny = ReducerConfig {
        bucket_cap_mb: 1e-6,
        first_bucket_mb: 1e-6,
        ..ReducerConfig::default()
    };
    let r = Reducer::new(be, &[vec![4, 3], vec![4]], hook, tiny).unwrap();
    assert_eq!(r.bucket_params(), vec![vec![1], vec![0]]);
    r
}

fn fill(r: &mut Reducer<CpuBackend, AllReduce<CpuBackend>>, rank: usize, step: usize) {
    for p in 0..2 {
        r.grad_mut(p)
            .unwrap()
            .copy_from_slice(&random([12, 4][p], (rank * 100 + step * 10 + p) as u64));
    }
}

fn grads(r: &Reducer<CpuBackend, AllReduce<CpuBackend>>) -> Vec<f32> {
    (0..2).flat_map(|p| r.grad(p).unwrap().to_vec()).collect()
}

/// Bug: switching sync off between `mark_ready` and `finish` left the launched bucket
/// in flight (its gradient unreadable, never waited for) and stopped this rank from
/// launching the rest, so its peers waited for collectives that never came: ranks
/// ended the step with different gradients. Now the step stays synchronised (ranks
/// agree), `finish` waits for every bucket and says what happened.
#[test]
fn switching_sync_off_mid_step_keeps_ranks_in_step_and_is_an_error() {
    let out = run_local_with_timeout(2, TIMEOUT, |g| {
        let rank = g.rank();
        let mut r = two_bucket_reducer(Arc::new(g));
        fill(&mut r, rank, 0);
        r.mark_ready(1).unwrap(); // launches bucket 0
        if rank == 0 {
            assert!(r.set_sync(false));
        }
        r.mark_ready(0).unwrap();
        let finished = r.finish();
        let after = grads(&r); // readable: nothing is left in flight
                               // Rank 0 switches back between steps (no error): both ranks synchronise the
                               // next step, in step.
        if rank == 0 {
            r.set_sync(true);
        }
        fill(&mut r, rank, 1);
        r.mark_ready(1).unwrap();
        r.mark_ready(0).unwrap();
        r.finish().unwrap();
        (finished, after, grads(&r))
    })
    .unwrap();
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    let e = out[0].0.clone().unwrap_err();
    assert_eq!(
        e,
        Error::SyncChanged {
            on: false,
            marked: 1,
            params: 2,
            launched: 2,
            buckets: 2
        }
    );
    assert!(e.to_string().contains("switched off"), "{e}");
    assert!(e.to_string().contains("2 of 2 buckets were reduced"), "{e}");
    out[1].0.clone().unwrap();
    assert_eq!(out[0].1, out[1].1, "ranks disagree after the switched step");
    assert_eq!(out[0].2, out[1].2, "ranks disagree on the next step");
}

/// Bug: switching sync on after every bucket was marked in an unsynchronised step made
/// `finish` report success although nothing was reduced; switching it off after every
/// bucket was launched made `finish` return without waiting for them.
#[test]
fn switching_sync_after_the_last_mark_ready_is_an_error_and_waits() {
    let out = run_local_with_timeout(1, TIMEOUT, |g| {
        let mut r = two_bucket_reducer(Arc::new(g));
        // Unsynchronised step, switched on before finish.
        r.set_sync(false);
        fill(&mut r, 0, 0);
        let local = grads(&r);
        r.mark_ready(1).unwrap();
        r.mark_ready(0).unwrap();
        r.set_sync(true);
        let e = r.finish().unwrap_err();
        assert!(matches!(e, Error::SyncChanged { on: true, .. }), "{e}");
        assert!(e.to_string().contains("not reduced"), "{e}");
        assert_eq!(grads(&r), local, "the step was not synchronised");
        // Synchronised step with every bucket launched, switched off before finish.
        r.mark_ready(1).unwrap();
        r.mark_ready(0).unwrap();
        r.set_sync(false);
        let e = r.finish().unwrap_err();
        assert!(
            matches!(
                e,
                Error::SyncChanged {
                    on: false,
                    launched: 2,
                    ..
                }
            ),
            "{e}"
        );
        // Waited for: every gradient is readable and writable again.
        r.grad_mut(0).unwrap()[0] = 1.0;
        grads(&r);
        // A change between steps is no error.
        r.set_sync(true);
        r.mark_ready(0).unwrap();
        r.mark_ready(1).unwrap();
        r.finish().unwrap();
        r.hook_calls()
    })
    .unwrap();
    assert_eq!(out[0].clone().unwrap(), 4);
}

// ---- Item 8: hook specs ----

/// Bug: the parser recursed once per `fp16+` wrapper, so 50,000 of them overflowed the
/// stack (abort), and 5,000 followed by a bad name took 116 s and built a 62 MB
/// message. One wrapper level is allowed; errors quote at most 100 characters of the
/// spec.
#[test]
fn hook_specs_with_many_wrappers_are_short_errors() {
    for spec in [
        format!("{}powersgd", "fp16+".repeat(50_000)),
        format!("{}bogus", "fp16+".repeat(5_000)),
        "fp16+fp16+powersgd".into(),
        "bf16+fp16+allreduce".into(),
    ] {
        let e = spec.parse::<HookSpec>().unwrap_err();
        let Error::Spec { spec: quoted, why } = &e else {
            panic!("not a spec error: {e}")
        };
        assert!(why.contains("one wrapper at most"), "{e}");
        assert!(quoted.chars().count() <= 101, "{} characters", quoted.len());
        assert!(e.to_string().len() < 400, "{} bytes", e.to_string().len());
    }
    // One wrapper is still fine.
    assert_eq!(
        "fp16+allreduce".parse::<HookSpec>().unwrap(),
        HookSpec::Fp16Wrapped(Box::new(HookSpec::AllReduce))
    );
    let HookSpec::Bf16Wrapped(inner) = " BF16 + powersgd:rank=2 ".parse().unwrap() else {
        panic!("not a bf16 wrapper")
    };
    assert!(matches!(*inner, HookSpec::PowerSgd(ref c) if c.matrix_approximation_rank == 2));
}

/// Bug: a repeated PowerSGD option silently kept the last value (`rank=2,rank=3` was
/// rank 3).
#[test]
fn repeated_powersgd_options_are_errors() {
    for (spec, key) in [
        ("powersgd:rank=2,rank=3", "rank"),
        ("batched_powersgd:seed=1,warm_start=false,seed=1", "seed"),
    ] {
        let e = spec.parse::<HookSpec>().unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("option `{key}` is given twice")),
            "{spec}: {e}"
        );
    }
}

/// Bug: errors quoted the whole spec (and the bad part again), however long. They
/// quote at most 100 characters of it, cut on a character boundary.
#[test]
fn spec_errors_quote_at_most_100_characters() {
    let long_name = "x".repeat(1_000_000);
    let multibyte = "é".repeat(300); // 2 bytes each: a cut by bytes could split one
    let long_option = format!("powersgd:rank=2,{}=1", "k".repeat(10_000));
    let long_value = format!("powersgd:rank={}", "9".repeat(10_000));
    for spec in [&long_name, &multibyte, &long_option, &long_value] {
        let e = spec.parse::<HookSpec>().unwrap_err();
        let Error::Spec { spec: quoted, .. } = &e else {
            panic!("not a spec error: {e}")
        };
        let prefix: String = spec.chars().take(100).collect();
        assert_eq!(*quoted, format!("{prefix}…"));
        assert!(e.to_string().chars().count() < 400, "{e}");
    }
    // A short spec is quoted whole.
    let e = "allreduse".parse::<HookSpec>().unwrap_err();
    assert!(
        matches!(&e, Error::Spec { spec, .. } if spec == "allreduse"),
        "{e}"
    );
}

// ---- Item 9: the PowerSGD state ----

fn config(start: u64) -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: 2,
        start_powersgd_iter: start,
        ..PowerSgdConfig::default()
    }
}

fn layout() -> Arc<Layout> {
    Arc::new(Layout::packed(&[vec![16, 12], vec![16]]).unwrap())
}

/// Runs one bucket through `hook`, waiting at most `TIMEOUT`.
fn step(hook: &mut impl CommHook<CpuBackend>, grad: Vec<f32>) -> ddp_hooks::Result<Vec<f32>> {
    let bucket = GradBucket::new(0, 1, grad, layout())?;
    Ok(hook.run(bucket).wait_timeout(TIMEOUT)?)
}

/// A state after three steps on one rank, two of them compressed.
fn saved_state() -> PowerSgdState {
    run_local_with_timeout(1, TIMEOUT, |g| {
        let mut hook = PowerSgd::new(Arc::new(CpuBackend::new()), Arc::new(g), config(2))?;
        for s in 0..3 {
            step(&mut hook, random(208, s))?;
        }
        hook.save()
    })
    .unwrap()
    .remove(0)
    .unwrap()
    .unwrap()
}

/// Bug: a state holding NaN or infinity loaded silently, and every later step then
/// produced non-finite gradients (error feedback carries them forever).
#[test]
fn non_finite_states_do_not_load() {
    let good = saved_state();
    let b = &good.buckets[&0];
    assert!(!b.error.is_empty() && !b.p.is_empty() && !b.q.is_empty());
    good.validate().unwrap();
    let mut cases = Vec::new();
    for (buffer, value) in [
        ("error", f32::NAN),
        ("p", f32::INFINITY),
        ("q", f32::NEG_INFINITY),
    ] {
        let mut bad = good.clone();
        let b = bad.buckets.get_mut(&0).unwrap();
        let memory = match buffer {
            "error" => &mut b.error,
            "p" => &mut b.p,
            _ => &mut b.q,
        };
        memory[5] = value;
        cases.push((bad, buffer));
    }
    let out = run_local_with_timeout(1, TIMEOUT, |g| {
        let g: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = Arc::new(CpuBackend::new());
        let refused: Vec<Error> = cases
            .iter()
            .map(|(bad, _)| {
                PowerSgd::load(be.clone(), g.clone(), bad.clone())
                    .err()
                    .unwrap()
            })
            .collect();
        // The good state still loads and steps to finite values.
        let mut hook = PowerSgd::load(be, g, good.clone()).unwrap();
        let out = step(&mut hook, random(208, 9)).unwrap();
        (refused, out)
    })
    .unwrap()
    .remove(0)
    .unwrap();
    for (e, (_, buffer)) in out.0.iter().zip(&cases) {
        assert!(
            matches!(e, Error::NonFinite { bucket: 0, buffer: b, index: 5, .. } if b == buffer),
            "{e}"
        );
    }
    assert!(out.1.iter().all(|x| x.is_finite()));
}

/// Bug: a NaN in a hook's memory (from a NaN gradient) was saved, and JSON wrote it as
/// `null`, which cannot be loaded back: a checkpoint that cannot be resumed. No saved
/// state holds a non-finite value: the step that meets the NaN is held (its output is
/// non-finite, for a loss scaler; its memories stay as before it), so the state stays
/// finite and saves (a non-finite state is still refused as corrupt; see
/// `non_finite_states_do_not_load`).
#[test]
fn no_checkpoint_holds_a_non_finite_value() {
    let out = run_local_with_timeout(1, TIMEOUT, |g| {
        let g: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = Arc::new(CpuBackend::new());
        let mut hook = PowerSgd::new(be.clone(), g.clone(), config(2)).unwrap();
        let mut batched = BatchedPowerSgd::new(be, g, config(2)).unwrap();
        let (mut stepped, mut stepped_batched) = (Ok(Vec::new()), Ok(Vec::new()));
        for s in 0..3 {
            let mut grad = random(208, s);
            if s == 2 {
                grad[7] = f32::NAN; // in the compressed 16 x 12 matrix, on a compressed step
            }
            stepped = step(&mut hook, grad.clone());
            stepped_batched = step(&mut batched, grad);
        }
        [(stepped, hook.save()), (stepped_batched, batched.save())]
    })
    .unwrap()
    .remove(0)
    .unwrap();
    for (stepped, saved) in out {
        match (stepped, saved) {
            // The held step passes the NaN on to the loss scaler, and the memory stays
            // finite.
            (Ok(out), saved) => {
                assert!(out.iter().any(|x| !x.is_finite()), "the NaN was hidden");
                let saved = saved.expect("the held step left a finite state");
                assert_eq!(saved.nonfinite_steps, 1);
                // It survives JSON (a NaN would be written as `null` and not read back).
                let json = serde_json::to_string(&saved).unwrap();
                let back = serde_json::from_str::<PowerSgdState>(&json).unwrap();
                back.validate().unwrap();
                assert_eq!(back, saved);
            }
            // Should a step ever refuse the NaN gradient, the memory must stay finite.
            (Err(_), saved) => {
                let json = serde_json::to_string(&saved.unwrap()).unwrap();
                assert!(!json.contains("null"), "a non-finite value was saved");
            }
        }
    }
    // A finite state survives JSON and loads.
    let json = serde_json::to_string(&saved_state()).unwrap();
    serde_json::from_str::<PowerSgdState>(&json)
        .unwrap()
        .validate()
        .unwrap();
}

/// Bug: `iter = u64::MAX` wrapped to 0 on the next step (release builds; debug builds
/// panicked), silently returning to the exact all-reduce; the statistics counters
/// overflowed the same way. The counters saturate: compression continues.
#[test]
fn iteration_counters_saturate_and_compression_continues() {
    let mut state = saved_state();
    state.iter = u64::MAX - 1;
    state.total_before = u64::MAX - 10;
    state.total_after = u64::MAX - 10;
    state.next_stats_report = u64::MAX;
    let out = run_local_with_timeout(1, TIMEOUT, |g| {
        let mut hook = PowerSgd::load(Arc::new(CpuBackend::new()), Arc::new(g), state.clone())?;
        let mut steps = Vec::new();
        for s in 0..3 {
            let grad = random(208, 20 + s);
            let out = step(&mut hook, grad.clone())?;
            steps.push((grad, out, hook.iteration()));
        }
        Ok::<_, Error>((steps, hook.compression_stats()))
    })
    .unwrap()
    .remove(0)
    .unwrap()
    .unwrap();
    let (steps, stats) = out;
    for (s, (grad, reduced, iter)) in steps.iter().enumerate() {
        assert_eq!(*iter, u64::MAX, "step {s}");
        // One rank: the exact all-reduce returns the gradient; PowerSGD approximates it.
        assert_ne!(grad, reduced, "step {s} fell back to the exact all-reduce");
    }
    assert_eq!((stats.before, stats.after), (u64::MAX, u64::MAX));
}

/// Bug: a bucket whose layout changed at the same length was reported as "was 256
/// elements, now 256". The message names the memory and the two lengths that differ.
#[test]
fn a_layout_change_names_the_lengths_that_differ() {
    let out = run_local_with_timeout(1, TIMEOUT, |g| {
        let mut hook = PowerSgd::new(Arc::new(CpuBackend::new()), Arc::new(g), config(2)).unwrap();
        let square = Arc::new(Layout::packed(&[vec![16, 16]]).unwrap());
        for s in 0..3 {
            let b = GradBucket::new(0, 1, random(256, s), square.clone()).unwrap();
            hook.run(b).wait_timeout(TIMEOUT).unwrap();
        }
        // Same 256 elements, as one vector: nothing compressed, no error memory needed.
        let flat = Arc::new(Layout::packed(&[vec![256]]).unwrap());
        let b = GradBucket::new(0, 1, random(256, 9), flat).unwrap();
        hook.run(b).wait_timeout(TIMEOUT).err().unwrap()
    })
    .unwrap()
    .remove(0)
    .unwrap();
    let e = out.to_string();
    assert!(
        e.contains("error-feedback memory holds 256 elements, the new layout needs 0"),
        "{e}"
    );
}
