//! `batch_tensors_with_same_shape` (issue 16): same-shape tensors of a bucket go through
//! one batched product and one batched orthogonalisation, with the unbatched hook's
//! results (PyTorch's flag, PR #75157). Before, the flag did nothing.
//!
//! Every case runs both settings on 2 thread ranks, two buckets per step, through the
//! compressed steps with error feedback and warm start, and compares: the outputs (within
//! `1e-5` relative, and bit for bit on the CPU, whose batched kernels compute each matrix
//! as the unbatched ones), the saved states (one format whatever the flag), resuming
//! (bit-identical, also across settings) and the registry key `batch_same_shape`.

use collectives::{run_local, ProcessGroup};
use ddp_hooks::{CommHook, GradBucket, HookSpec, Layout, PowerSgd, PowerSgdConfig, PowerSgdState};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;

const RANKS: usize = 2;

/// Bucket 0: a small transformer layer (four same-shape projections, each followed by
/// its bias, so their batch is stacked by copy; two MLP matrices of other shapes; layer
/// norms). Bucket 1: three same-shape matrices one after another (batched in place), a
/// matrix of another shape, a matrix too small to compress, and a bias.
fn layouts() -> [Arc<Layout>; 2] {
    let h = 24;
    let mut layer = Vec::new();
    for _ in 0..4 {
        layer.push(vec![h, h]);
        layer.push(vec![h]);
    }
    layer.extend([
        vec![h],
        vec![h],
        vec![4 * h, h],
        vec![4 * h],
        vec![h, 4 * h],
    ]);
    layer.extend([vec![h], vec![h], vec![h]]);
    let other = vec![
        vec![40, 12],
        vec![40, 12],
        vec![40, 12],
        vec![12, 40],
        vec![3, 2],
        vec![40],
    ];
    [
        Arc::new(Layout::packed(&layer).unwrap()),
        Arc::new(Layout::packed(&other).unwrap()),
    ]
}

/// Rank `rank`'s gradient of bucket `bucket` at `step`. At step 4 the first projection
/// of bucket 0 is zero on every rank (its `Q` gets zero columns that are redrawn).
fn grad(rank: usize, step: usize, bucket: usize) -> Vec<f32> {
    let len = layouts()[bucket].len();
    let mut v = vec![0.0; len];
    NormalRng::new((rank * 1000 + step * 10 + bucket) as u64).fill(&mut v);
    if bucket == 0 && step == 4 {
        v[..24 * 24].fill(0.0);
    }
    v
}

fn config(rank: usize, batch: bool) -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: rank,
        start_powersgd_iter: 2,
        batch_tensors_with_same_shape: Some(batch),
        ..PowerSgdConfig::default()
    }
}

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new().with_threads(2).unwrap())
}

/// Runs `steps` of both buckets on `hook`; returns each step's outputs (bucket 0, then 1).
fn steps(
    hook: &mut dyn CommHook<CpuBackend>,
    rank: usize,
    steps: std::ops::Range<usize>,
) -> Vec<Vec<Vec<f32>>> {
    let layouts = layouts();
    steps
        .map(|s| {
            let works: Vec<_> = (0..2)
                .map(|b| {
                    let bucket =
                        GradBucket::new(b, 2, grad(rank, s, b), layouts[b].clone()).unwrap();
                    hook.run(bucket)
                })
                .collect();
            works.into_iter().map(|w| w.wait().unwrap()).collect()
        })
        .collect()
}

/// One run: every rank's outputs per step and its state at the end.
type Run = Vec<(Vec<Vec<Vec<f32>>>, PowerSgdState)>;

fn run(cfg: &PowerSgdConfig, n: usize) -> Run {
    run_local(RANKS, |g| {
        let rank = g.rank();
        let mut hook = PowerSgd::new(backend(), Arc::new(g), cfg.clone()).unwrap();
        let outs = steps(&mut hook, rank, 0..n);
        (outs, hook.save().unwrap())
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// `max |a - b| / max |b|` over a step's buckets.
fn rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        diff = diff.max((*x as f64 - *y as f64).abs());
        scale = scale.max((*y as f64).abs());
    }
    diff / scale.max(f64::MIN_POSITIVE)
}

/// The state with the flag set as in `batch`: what a state must equal when only the
/// flag differs.
fn with_flag(state: &PowerSgdState, batch: bool) -> PowerSgdState {
    let mut s = state.clone();
    s.config.batch_tensors_with_same_shape = Some(batch);
    s
}

/// Batched and unbatched hooks give the same outputs and the same saved state, at every
/// rank, with error feedback and warm start on or off; the ranks agree bit for bit.
#[test]
fn batched_equals_unbatched() {
    for r in [1, 2, 4] {
        for (ef, warm) in [(true, true), (false, true), (true, false)] {
            let cfg = |batch| PowerSgdConfig {
                use_error_feedback: ef,
                warm_start: warm,
                ..config(r, batch)
            };
            let what = format!("rank {r}, error feedback {ef}, warm start {warm}");
            let (plain, batched) = (run(&cfg(false), 7), run(&cfg(true), 7));
            for rank in 0..RANKS {
                for (s, (a, b)) in batched[rank].0.iter().zip(&plain[rank].0).enumerate() {
                    let d = rel_diff(a, b);
                    assert!(d <= 1e-5, "{what}: rank {rank} step {s} differs by {d:e}");
                    assert_eq!(a, b, "{what}: rank {rank} step {s}: not bit-identical");
                    assert!(a.iter().flatten().all(|x| x.is_finite()), "{what}");
                }
                assert_eq!(
                    with_flag(&batched[rank].1, false),
                    plain[rank].1,
                    "{what}: rank {rank}: the saved states differ"
                );
            }
            assert_eq!(batched[0].0, batched[1].0, "{what}: ranks disagree");
            // Compression happened: the outputs are not the mean of the inputs.
            let (g0, g1) = (grad(0, 6, 0), grad(1, 6, 0));
            let mean: Vec<f32> = g0.iter().zip(&g1).map(|(a, b)| (a + b) / 2.0).collect();
            assert_ne!(batched[0].0[6][0], mean, "{what}");
        }
    }
}

/// Resuming is bit-identical in both settings, and across them: a state saved with the
/// flag on continues with it off (`load_state` into a hook built with it off, which
/// keeps its own setting) and the other way round (`PowerSgd::load` through JSON, which
/// takes the state's setting).
#[test]
fn resuming_is_bit_identical_in_and_across_settings() {
    for r in [1, 2] {
        let full = run(&config(r, false), 8);
        for (saved_with, loaded_with) in [(true, true), (true, false), (false, true)] {
            let saved: Vec<String> = run(&config(r, saved_with), 5)
                .into_iter()
                .map(|(_, st)| serde_json::to_string(&st).unwrap())
                .collect();
            let resumed = run_local(RANKS, |g| {
                let rank = g.rank();
                let state: PowerSgdState = serde_json::from_str(&saved[rank]).unwrap();
                let group: Arc<dyn ProcessGroup> = Arc::new(g);
                let mut hook = if loaded_with == saved_with {
                    PowerSgd::load(backend(), group, state).unwrap()
                } else {
                    let hook = PowerSgd::new(backend(), group, config(r, loaded_with)).unwrap();
                    let state = ddp_hooks::HookState::PowerSgd(Box::new(state));
                    hook.load_state(state).unwrap();
                    hook
                };
                assert_eq!(hook.config(), config(r, loaded_with));
                let outs = steps(&mut hook, rank, 5..8);
                (outs, hook.save().unwrap())
            })
            .unwrap();
            for (rank, res) in resumed.into_iter().enumerate() {
                let (outs, state) = res.unwrap();
                let what = format!(
                    "rank {r}: saved with {saved_with}, loaded with {loaded_with}, rank {rank}"
                );
                assert_eq!(outs, full[rank].0[5..8].to_vec(), "{what}: diverged");
                assert_eq!(
                    with_flag(&state, false),
                    full[rank].1,
                    "{what}: final state"
                );
            }
        }
    }
}

/// Saving right after loading (before any step) gives the loaded state back: the
/// memories are converted to the plan's order only when a bucket next runs.
#[test]
fn a_loaded_state_saves_back_unchanged() {
    let state = run(&config(2, true), 4).remove(0).1;
    let out = run_local(1, |g| {
        let hook = PowerSgd::load(backend(), Arc::new(g), state.clone()).unwrap();
        hook.save().unwrap()
    })
    .unwrap();
    assert_eq!(out.into_iter().next().unwrap().unwrap(), state);
}

/// The registry key builds a batching hook, which behaves like the unbatched one.
#[test]
fn the_registry_key_batch_same_shape_works() {
    let run_spec = |spec: &str| {
        let spec: HookSpec = spec.parse().unwrap();
        run_local(RANKS, |g| {
            let rank = g.rank();
            let mut hook = spec.build(backend(), Arc::new(g)).unwrap();
            steps(&mut *hook, rank, 0..4)
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let HookSpec::PowerSgd(c) = "powersgd:rank=2,batch_same_shape=true".parse().unwrap() else {
        panic!("not PowerSGD");
    };
    assert_eq!(c.batch_tensors_with_same_shape, Some(true));
    assert_eq!(
        run_spec("powersgd:rank=2,start_iter=2,batch_same_shape=true"),
        run_spec("powersgd:rank=2,start_iter=2,batch_same_shape=false")
    );
    let e = "powersgd:batch_same_shape=yes"
        .parse::<HookSpec>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("true or false"), "{e}");
}

/// The default is PyTorch's (off: `PowerSgdConfig::default()`, a registry spec without
/// `batch_same_shape`), and the CPU backend's own choice is off too (batching saves
/// nothing there): unset (`None`, `batch_same_shape=auto`), a hook on the CPU does not
/// batch; `Some(true)` makes it batch, `Some(false)` not.
#[test]
fn the_cpu_default_is_off() {
    let cpu = CpuBackend::new();
    assert!(!PowerSgdConfig::batches_on(&cpu));
    assert_eq!(
        PowerSgdConfig::default().batch_tensors_with_same_shape,
        Some(false)
    );
    assert_eq!(
        PowerSgdConfig::default_for(&cpu),
        PowerSgdConfig {
            batch_tensors_with_same_shape: Some(false),
            ..PowerSgdConfig::default()
        }
    );
    let built = |batch: Option<bool>| {
        let cfg = PowerSgdConfig {
            batch_tensors_with_same_shape: batch,
            ..config(2, false)
        };
        let out = run_local(1, |g| {
            let hook = PowerSgd::new(backend(), Arc::new(g), cfg.clone()).unwrap();
            // The configuration is reported as given, the resolution apart.
            assert_eq!(hook.config(), cfg);
            hook.batches_same_shape()
        })
        .unwrap();
        out.into_iter().next().unwrap().unwrap()
    };
    assert!(!built(None), "unset must not batch on the CPU");
    assert!(built(Some(true)), "Some(true) must batch on the CPU");
    assert!(!built(Some(false)));
    // Through the registry: absent is PyTorch's off; `auto` is unset, off on the CPU.
    let by_spec = |spec: &str| {
        let spec: HookSpec = spec.parse().unwrap();
        let HookSpec::PowerSgd(cfg) = spec else {
            panic!("not PowerSGD")
        };
        let out = run_local(1, |g| {
            PowerSgd::new(backend(), Arc::new(g), cfg.clone())
                .unwrap()
                .batches_same_shape()
        })
        .unwrap();
        out.into_iter().next().unwrap().unwrap()
    };
    assert!(!by_spec("powersgd:rank=2"));
    assert!(!by_spec("powersgd:rank=2,batch_same_shape=auto"));
    assert!(by_spec("powersgd:rank=2,batch_same_shape=true"));
}

/// A state saved when `batch_tensors_with_same_shape` was a plain `bool` (JSON `true` or
/// `false`) still loads, as `Some`; `null` or a missing field load as unset. Through
/// `PowerSgd::load` the hook takes the state's setting (unset: the CPU's default, off);
/// through `load_state` it keeps its own. Either way it continues bit for bit.
#[test]
fn states_saved_with_a_plain_bool_still_load() {
    let full = run(&config(2, false), 8);
    let saved = run(&config(2, true), 5);
    for (field, loaded) in [
        (Some(serde_json::json!(true)), Some(true)),
        (Some(serde_json::json!(false)), Some(false)),
        (Some(serde_json::Value::Null), None),
        (None, None),
    ] {
        let json: Vec<String> = saved
            .iter()
            .map(|(_, st)| {
                let mut v = serde_json::to_value(st).unwrap();
                let config = v["config"].as_object_mut().unwrap();
                match &field {
                    Some(x) => config.insert("batch_tensors_with_same_shape".into(), x.clone()),
                    None => config.remove("batch_tensors_with_same_shape"),
                };
                v.to_string()
            })
            .collect();
        let what = format!("field {field:?}");
        let resumed = run_local(RANKS, |g| {
            let rank = g.rank();
            let state: PowerSgdState = serde_json::from_str(&json[rank]).unwrap();
            assert_eq!(state.config.batch_tensors_with_same_shape, loaded);
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            // Through `load`: the state's setting, resolved on the CPU.
            let mut hook = PowerSgd::load(backend(), group.clone(), state.clone()).unwrap();
            assert_eq!(hook.config().batch_tensors_with_same_shape, loaded);
            assert_eq!(hook.batches_same_shape(), loaded == Some(true));
            let outs = steps(&mut hook, rank, 5..8);
            // Through `load_state` into a hook built with the flag forced on: it keeps it.
            let other = PowerSgd::new(backend(), group, config(2, true)).unwrap();
            other
                .load_state(ddp_hooks::HookState::PowerSgd(Box::new(state)))
                .unwrap();
            assert!(other.batches_same_shape());
            assert_eq!(other.config(), config(2, true));
            outs
        })
        .unwrap();
        for (rank, outs) in resumed.into_iter().enumerate() {
            assert_eq!(
                outs.unwrap(),
                full[rank].0[5..8].to_vec(),
                "{what}: rank {rank} diverged"
            );
        }
    }
}

/// On CUDA batching is the default, and gives the unbatched results up to rounding.
/// Without a GPU it prints one `skipped:` line.
#[cfg(feature = "cuda")]
#[test]
fn cuda_batches_by_default_with_the_same_results() {
    use lowrank::{Backend, CudaBackend};
    let gpu = match CudaBackend::new(0) {
        Ok(b) => Arc::new(b),
        Err(lowrank::Error::CudaUnavailable(why)) => {
            println!("skipped: no CUDA driver ({why})");
            return;
        }
        Err(e) => panic!("CUDA present but failed to start: {e}"),
    };
    assert!(PowerSgdConfig::batches_on(&*gpu));
    assert_eq!(
        PowerSgdConfig::default_for(&*gpu).batch_tensors_with_same_shape,
        Some(true)
    );
    let layouts = layouts();
    let go = |batch: bool| {
        run_local(RANKS, |g| {
            let rank = g.rank();
            let cfg = config(2, batch);
            let mut hook = PowerSgd::new(gpu.clone(), Arc::new(g), cfg).unwrap();
            (0..6)
                .map(|s| {
                    let works: Vec<_> = (0..2)
                        .map(|b| {
                            let buf = gpu.upload(&grad(rank, s, b)).unwrap();
                            let bucket = GradBucket::new(b, 2, buf, layouts[b].clone()).unwrap();
                            hook.run(bucket)
                        })
                        .collect();
                    works
                        .into_iter()
                        .map(|w| {
                            let out = w.wait().unwrap();
                            let mut host = vec![0.0; CudaBackend::buffer_len(&out)];
                            gpu.download(CudaBackend::view(&out, ..).unwrap(), &mut host)
                                .unwrap();
                            host
                        })
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    let (plain, batched) = (go(false), go(true));
    for (rank, (a, b)) in batched.iter().zip(&plain).enumerate() {
        for (s, (a, b)) in a.iter().zip(b).enumerate() {
            let d = rel_diff(a, b);
            assert!(
                d <= 1e-5,
                "CUDA rank {rank} step {s}: batched differs by {d:e}"
            );
        }
    }
    println!("cuda batched powersgd: ok");
}
