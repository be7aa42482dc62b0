//! `ddp_hooks::burn::BurnDdp` on thread ranks: burn gradients (`GradientsParams`) reduced
//! by the registry's hooks, handed back for burn's optimizer; unused parameters, typed
//! errors (foreign gradients, wrong shapes, shapes differing across ranks), `no_sync`
//! through `accum::Accumulator`, parameter broadcast, and save/load resume bit for bit.

use std::sync::Arc;

use burn_core as burn;
use burn_core::module::{Module, Param, ParamId};
use burn_core::tensor::backend::Backend;
use burn_core::tensor::{Tensor, TensorData};
use burn_ndarray::NdArray;
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collectives::{run_local, ProcessGroup};
use ddp_hooks::burn::{BurnDdp, BurnError, CpuAutodiff, Problem};
use ddp_hooks::{Error, HookSpec, ReducerConfig};

type Ad = CpuAutodiff;

/// Three parameters of different ranks; `width` sets the matrix's columns.
#[derive(Module, Debug)]
struct Net<B: Backend> {
    w: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 1>>,
    s: Param<Tensor<B, 1>>,
}

fn net(width: usize, salt: f32) -> Net<Ad> {
    let d = Default::default();
    let v = |n: usize, k: f32| {
        (0..n)
            .map(|i| salt + k + i as f32 * 0.25)
            .collect::<Vec<f32>>()
    };
    Net {
        w: Param::from_tensor(Tensor::from_data(
            TensorData::new(v(3 * width, 0.0), [3, width]),
            &d,
        )),
        b: Param::from_tensor(Tensor::from_data(
            TensorData::new(v(width, 1.0), [width]),
            &d,
        )),
        s: Param::from_tensor(Tensor::from_data(TensorData::new(v(1, 2.0), [1]), &d)),
    }
}

/// Rank `rank`'s gradient of parameter `p` (0 w, 1 b, 2 s) is `c(p, rank)` everywhere:
/// the loss is `sum_p c(p, rank) · sum(p)` over the parameters in `used`.
fn c(p: usize, rank: usize) -> f32 {
    (p as f32 + 1.0) * (rank as f32 + 1.0)
}

fn grads(m: &Net<Ad>, used: &[usize], rank: usize) -> GradientsParams {
    let mut loss: Option<Tensor<Ad, 1>> = None;
    for &p in used {
        let t = match p {
            0 => m.w.val().sum(),
            1 => m.b.val().sum(),
            _ => m.s.val().sum(),
        }
        .mul_scalar(c(p, rank));
        loss = Some(match loss {
            Some(l) => l + t,
            None => t,
        });
    }
    GradientsParams::from_grads::<Ad, _>(loss.expect("a used parameter").backward(), m)
}

fn ids(m: &Net<Ad>) -> [ParamId; 3] {
    [m.w.id, m.b.id, m.s.id]
}

/// Parameter `p`'s gradient in `g`, flattened (`None`: absent).
fn grad_of(g: &GradientsParams, m: &Net<Ad>, p: usize) -> Option<Vec<f32>> {
    let id = ids(m)[p];
    let data = match p {
        0 => g.get::<NdArray<f32>, 2>(id).map(|t| t.into_data()),
        _ => g.get::<NdArray<f32>, 1>(id).map(|t| t.into_data()),
    };
    data.map(|d| d.to_vec::<f32>().unwrap())
}

fn len(p: usize, width: usize) -> usize {
    [3 * width, width, 1][p]
}

fn values(m: &Net<Ad>) -> Vec<Vec<f32>> {
    vec![
        m.w.val().into_data().to_vec().unwrap(),
        m.b.val().into_data().to_vec().unwrap(),
        m.s.val().into_data().to_vec().unwrap(),
    ]
}

fn allreduce() -> HookSpec {
    HookSpec::AllReduce
}

fn ddp(m: &Net<Ad>, spec: &HookSpec, group: impl ProcessGroup + 'static) -> BurnDdp<Ad> {
    BurnDdp::<Ad>::from_spec(m, spec, Arc::new(group)).unwrap()
}

#[test]
fn the_exact_mean_is_handed_back_under_the_same_ids_and_steps_burns_optimizer() {
    let results = run_local(2, |group| {
        let rank = group.rank();
        let mut m = net(4, 0.0);
        let mut ddp = ddp(&m, &allreduce(), group);
        let mut optim = SgdConfig::new().init::<Ad, Net<Ad>>();
        // Three steps: the second and third run on the rebuilt buckets.
        for _ in 0..3 {
            let before = values(&m);
            let mut g = grads(&m, &[0, 1, 2], rank);
            assert!(ddp.sync(&mut g).unwrap());
            assert_eq!(g.len(), 3);
            for p in 0..3 {
                let mean = (c(p, 0) + c(p, 1)) / 2.0;
                assert_eq!(
                    grad_of(&g, &m, p),
                    Some(vec![mean; len(p, 4)]),
                    "rank {rank}"
                );
            }
            m = optim.step(0.5, m, g);
            for (p, (after, before)) in values(&m).iter().zip(&before).enumerate() {
                let mean = (c(p, 0) + c(p, 1)) / 2.0;
                for (a, b) in after.iter().zip(before) {
                    assert_eq!(*a, b - 0.5 * mean, "the optimizer stepped with the mean");
                }
            }
        }
        ddp.reducer().hook_calls()
    })
    .unwrap();
    for calls in results {
        assert!(calls.unwrap() >= 3);
    }
}

#[test]
fn a_parameter_without_a_gradient_is_named_by_default_zero_with_find_unused_and_absent_if_no_rank_has_one(
) {
    // Default config: rank 1 leaves parameter 1 out; its error names it, rank 0 completes.
    let results = run_local(2, |group| {
        let rank = group.rank();
        let m = net(2, 0.0);
        let mut ddp = ddp(&m, &allreduce(), group);
        let used: &[usize] = if rank == 1 { &[0, 2] } else { &[0, 1, 2] };
        let mut g = grads(&m, used, rank);
        let before: Vec<_> = (0..3).map(|p| grad_of(&g, &m, p)).collect();
        let err = match ddp.sync(&mut g) {
            Ok(_) => None,
            Err(BurnError::Reducer(Error::UnmarkedParameters { params, .. })) => Some(params),
            Err(e) => panic!("rank {rank}: {e}"),
        };
        let after: Vec<_> = (0..3).map(|p| grad_of(&g, &m, p)).collect();
        (rank, err, before == after)
    })
    .unwrap();
    for r in results {
        let (rank, err, unchanged) = r.unwrap();
        if rank == 1 {
            assert!(unchanged, "grads unchanged on error");
            assert_eq!(err, Some(vec![1]), "parameter 1 named");
        } else {
            assert!(err.is_none(), "rank 0 completes: {err:?}");
        }
    }
    // find_unused_parameters: zero on the rank without it; absent when no rank has one.
    let results = run_local(2, |group| {
        let rank = group.rank();
        let m = net(2, 0.0);
        let config = ReducerConfig {
            find_unused_parameters: true,
            ..ReducerConfig::default()
        };
        let mut ddp =
            BurnDdp::<Ad>::from_spec_with(&m, &allreduce(), Arc::new(group), config).unwrap();
        let used: &[usize] = if rank == 1 { &[0] } else { &[0, 1] };
        let mut g = grads(&m, used, rank);
        assert!(ddp.sync(&mut g).unwrap());
        (0..3).map(|p| grad_of(&g, &m, p)).collect::<Vec<_>>()
    })
    .unwrap();
    for r in results {
        let g = r.unwrap();
        assert_eq!(g[0], Some(vec![(c(0, 0) + c(0, 1)) / 2.0; 6]));
        assert_eq!(g[1], Some(vec![c(1, 0) / 2.0; 2]), "rank 1 counted as zero");
        assert_eq!(g[2], None, "no rank has a gradient for it");
    }
}

#[test]
fn foreign_and_misshapen_gradients_are_typed_errors_and_the_peers_complete() {
    let results = run_local(2, |group| {
        let rank = group.rank();
        let m = net(2, 0.0);
        let mut ddp = ddp(&m, &allreduce(), group);
        let mut out = Vec::new();
        // Step 1: rank 0 adds a gradient for a parameter of another module.
        let mut g = grads(&m, &[0, 1, 2], rank);
        if rank == 0 {
            let other = Tensor::<NdArray<f32>, 1>::from_floats([1.0, 2.0], &Default::default());
            g.register::<NdArray<f32>, 1>(ParamId::new(), other);
        }
        let before: Vec<_> = (0..3).map(|p| grad_of(&g, &m, p)).collect();
        let r = ddp.sync(&mut g);
        let after: Vec<_> = (0..3).map(|p| grad_of(&g, &m, p)).collect();
        out.push((r.map_err(|e| format!("{e:?}")), before == after));
        // Step 2: rank 1's gradient of b has the wrong shape.
        let mut g = grads(&m, &[0, 1, 2], rank);
        if rank == 1 {
            let bad = Tensor::<NdArray<f32>, 1>::from_floats([1.0, 2.0, 3.0], &Default::default());
            g.register::<NdArray<f32>, 1>(m.b.id, bad);
        }
        let before: Vec<_> = (0..3).map(|p| grad_of(&g, &m, p)).collect();
        let r = ddp.sync(&mut g);
        let after: Vec<_> = (0..3).map(|p| grad_of(&g, &m, p)).collect();
        out.push((r.map_err(|e| format!("{e:?}")), before == after));
        // Step 3: all well again, the exact mean.
        let mut g = grads(&m, &[0, 1, 2], rank);
        ddp.sync(&mut g).unwrap();
        let mean_s = grad_of(&g, &m, 2);
        (rank, out, mean_s)
    })
    .unwrap();
    for r in results {
        let (rank, out, mean_s) = r.unwrap();
        let (first, second) = (&out[0], &out[1]);
        if rank == 0 {
            assert!(first
                .0
                .as_ref()
                .unwrap_err()
                .contains("UnknownGradients { count: 1 }"));
            assert!(first.1, "grads unchanged on error");
            assert_eq!(second.0, Ok(true), "rank 0 completes step 2");
        } else {
            assert_eq!(first.0, Ok(true), "rank 1 completes step 1");
            let e = second.0.as_ref().unwrap_err();
            assert!(
                e.contains("Gradients([(1, Shape { expected: [2], got: [3] })])"),
                "{e}"
            );
            assert!(second.1, "grads unchanged on error");
        }
        assert_eq!(mean_s, Some(vec![(c(2, 0) + c(2, 1)) / 2.0]));
    }
    // The variant itself, for matching.
    let e = BurnError::Gradients(vec![(1, Problem::Backend)]);
    assert!(e.to_string().contains("parameter 1"));
}

#[test]
fn shapes_differing_across_ranks_fail_on_every_rank() {
    // Rank 1's model is wider. Its first synchronised step fails on both ranks.
    let results = run_local(2, |group| {
        let rank = group.rank();
        let m = net(2 + rank, 0.0);
        let mut ddp = ddp(&m, &allreduce(), group);
        let mut g = grads(&m, &[0, 1, 2], rank);
        ddp.sync(&mut g).map(|_| ()).map_err(|e| e.to_string())
    })
    .unwrap();
    for r in results {
        let sync = r.unwrap();
        assert!(sync.is_err(), "sync: {sync:?}");
    }
    // So does the broadcast of rank 0's parameters.
    let results = run_local(2, |group| {
        let rank = group.rank();
        let m = net(2 + rank, 0.0);
        let ddp = ddp(&m, &allreduce(), group);
        ddp.broadcast_parameters(m)
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .unwrap();
    for r in results {
        let broadcast = r.unwrap();
        assert!(broadcast.is_err(), "broadcast: {broadcast:?}");
    }
}

#[test]
fn broadcast_gives_every_rank_rank_0s_parameters_bit_for_bit_and_keeps_ids() {
    let results = run_local(2, |group| {
        let rank = group.rank();
        let m = net(3, rank as f32 * 10.0 + 0.1);
        let before = ids(&m);
        let ddp = ddp(&m, &allreduce(), group);
        let m = ddp.broadcast_parameters(m).unwrap();
        assert_eq!(ids(&m), before);
        assert!(m.w.val().is_require_grad());
        // A module of another shape is refused before any communication.
        let other = net(5, 0.0);
        assert!(matches!(
            ddp.broadcast_parameters(other),
            Err(BurnError::Module(_))
        ));
        values(&m)
    })
    .unwrap();
    let want = values(&net(3, 0.1));
    for r in results {
        assert_eq!(r.unwrap(), want);
    }
}

#[test]
fn no_sync_through_the_accumulator_reduces_the_groups_sum_once() {
    let results = run_local(2, |group| {
        let rank = group.rank();
        let m = net(2, 0.0);
        let mut ddp = ddp(&m, &allreduce(), group);
        let mut acc = accum::Accumulator::new(2).unwrap();
        acc.start_unbounded();
        let mut seen = Vec::new();
        for _group in 0..2 {
            for micro in 0..2 {
                let step = acc.next_step().unwrap();
                let mut guard = step.apply(&mut ddp);
                // Micro-step `micro` scales rank r's gradient by micro + 1.
                let mut g = GradientsParams::from_grads::<Ad, _>(
                    (m.w.val()
                        .sum()
                        .mul_scalar(c(0, rank) * (micro as f32 + 1.0))
                        + m.b
                            .val()
                            .sum()
                            .mul_scalar(c(1, rank) * (micro as f32 + 1.0))
                        + m.s
                            .val()
                            .sum()
                            .mul_scalar(c(2, rank) * (micro as f32 + 1.0)))
                    .backward(),
                    &m,
                );
                let synced = guard.sync(&mut g).unwrap();
                seen.push((synced, grad_of(&g, &m, 2)));
            }
        }
        (seen, ddp.reducer().hook_calls())
    })
    .unwrap();
    for r in results {
        let (seen, _calls) = r.unwrap();
        for (i, (synced, s)) in seen.into_iter().enumerate() {
            if i % 2 == 0 {
                assert!(!synced, "micro-step {i} does not synchronise");
            } else {
                assert!(synced, "micro-step {i} closes its group");
                // mean over ranks of (1 + 2) · c(2, r), the same in both groups.
                let want = 3.0 * (c(2, 0) + c(2, 1)) / 2.0;
                assert_eq!(s, Some(vec![want]), "micro-step {i}");
            }
        }
    }
}

/// Trains `net` with PowerSGD for `steps` steps from `state` (or from scratch), returns
/// the parameters and the state to resume from.
type Saved = (Vec<Vec<f32>>, ddp_hooks::HookState, Vec<Vec<usize>>);

fn train(group: collectives::ThreadGroup, steps: usize, from: Option<Saved>) -> Saved {
    let rank = group.rank();
    let spec: HookSpec = "powersgd:rank=1,start_iter=2".parse().unwrap();
    let mut m = net(32, 0.0);
    let mut ddp = ddp(&m, &spec, group);
    let start = from.as_ref().map_or(0, |_| 5);
    if let Some((params, state, buckets)) = from {
        let d = Default::default();
        m = Net {
            w: Param::initialized(
                m.w.id,
                Tensor::from_data(TensorData::new(params[0].clone(), [3, 32]), &d).require_grad(),
            ),
            b: Param::initialized(
                m.b.id,
                Tensor::from_data(TensorData::new(params[1].clone(), [32]), &d).require_grad(),
            ),
            s: Param::initialized(
                m.s.id,
                Tensor::from_data(TensorData::new(params[2].clone(), [1]), &d).require_grad(),
            ),
        };
        ddp.reducer_mut().set_bucket_params(buckets).unwrap();
        ddp.load_state(state).unwrap();
    }
    let mut optim = SgdConfig::new().init::<Ad, Net<Ad>>();
    for step in start..start + steps {
        // A loss whose gradient is not rank 1, so compression is lossy.
        let k = (step * 2 + rank) as f32 * 0.1 + 1.0;
        let loss = (m.w.val().powi_scalar(2).mul_scalar(k).sum()
            + m.b.val().sin().sum()
            + m.s.val().mul_scalar(k).sum())
        .mul_scalar(0.05);
        let mut g = GradientsParams::from_grads::<Ad, _>(loss.backward(), &m);
        assert!(ddp.sync(&mut g).unwrap());
        m = optim.step(0.1, m, g);
    }
    (
        values(&m),
        ddp.save_state().unwrap(),
        ddp.reducer().bucket_params(),
    )
}

#[test]
fn save_and_load_resume_powersgd_bit_for_bit() {
    let straight = run_local(2, |group| train(group, 10, None).0).unwrap();
    let first = run_local(2, |group| train(group, 5, None)).unwrap();
    let first: Vec<Saved> = first.into_iter().map(|r| r.unwrap()).collect();
    let again = first.clone();
    let resumed = run_local(2, move |group| {
        let saved = first[group.rank()].clone();
        // Round-trip the state through JSON, as a checkpoint on disk would.
        let json = serde_json::to_string(&saved.1).unwrap();
        let state = serde_json::from_str(&json).unwrap();
        train(group, 5, Some((saved.0, state, saved.2))).0
    })
    .unwrap();
    for (a, b) in straight.iter().zip(resumed) {
        let (a, b) = (a.as_ref().unwrap(), b.unwrap());
        assert_eq!(a, &b, "resumed run equals the straight run bit for bit");
    }
    // Resuming the parameters with a fresh hook's state instead (PowerSGD's error feedback
    // and bases lost) does not: the state is what makes the resume exact.
    let without = run_local(2, move |group| {
        let saved = again[group.rank()].clone();
        // A hook that has seen no step: built over a one-rank group of its own.
        let fresh_state = run_local(1, |g| {
            let spec: HookSpec = "powersgd:rank=1,start_iter=2".parse().unwrap();
            ddp(&net(32, 0.0), &spec, g).save_state().unwrap()
        })
        .unwrap()
        .remove(0)
        .unwrap();
        train(group, 5, Some((saved.0, fresh_state, saved.2))).0
    })
    .unwrap();
    assert_ne!(
        without[0].as_ref().unwrap(),
        straight[0].as_ref().unwrap(),
        "the hook state matters"
    );
}

#[test]
fn a_module_without_parameters_or_a_missing_group_is_a_typed_error() {
    #[derive(Module, Debug)]
    struct Empty<B: Backend> {
        _b: core::marker::PhantomData<B>,
    }
    let results = run_local(1, |group| {
        let e = BurnDdp::<Ad>::from_spec(
            &Empty::<Ad> {
                _b: core::marker::PhantomData,
            },
            &allreduce(),
            Arc::new(group),
        );
        matches!(e, Err(BurnError::Module(_)))
    })
    .unwrap();
    assert!(results.into_iter().all(|r| r.unwrap()));
    // Without a process group, the broadcast is the reducer's Config error.
    let m = net(2, 0.0);
    let backend = Arc::new(lowrank::CpuBackend::new());
    let hook = ddp_hooks::Noop::<lowrank::CpuBackend>::new();
    let ddp = BurnDdp::<Ad, _>::new(&m, backend, hook, ReducerConfig::default()).unwrap();
    assert!(matches!(
        ddp.broadcast_parameters(m),
        Err(BurnError::Reducer(Error::Config(_)))
    ));
}

#[test]
fn a_gradient_of_another_backend_type_is_a_typed_error_not_a_panic() {
    let results = run_local(1, |group| {
        let m = net(2, 0.0);
        let mut ddp = ddp(&m, &allreduce(), group);
        let mut g = grads(&m, &[0, 1, 2], 0);
        // The autodiff backend's tensor where the inner backend's belongs.
        let wrong = Tensor::<Ad, 1>::from_floats([1.0, 2.0], &Default::default());
        g.register::<Ad, 1>(m.b.id, wrong);
        match ddp.sync(&mut g) {
            Err(BurnError::Gradients(problems)) => problems,
            other => panic!("{other:?}"),
        }
    })
    .unwrap();
    for r in results {
        assert_eq!(r.unwrap(), vec![(1, Problem::Backend)]);
    }
}
