//! The candle adapter (feature `candle`): gradients out of a candle `GradStore`, reduced by a
//! hook on thread ranks, and back.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use collectives::{run_local, ProcessGroup, ThreadGroup};
use ddp_hooks::candle::{CandleDdp, CandleError, Problem};
use ddp_hooks::{AllReduce, HookSpec, ReducerConfig};
use lowrank::CpuBackend;
use std::sync::Arc;

const SHAPES: [&[usize]; 3] = [&[3, 4], &[4], &[2, 2, 2]];

/// The same vars on every rank (their values do not matter here).
fn vars() -> Vec<Var> {
    SHAPES
        .iter()
        .map(|s| Var::zeros(*s, DType::F32, &Device::Cpu).unwrap())
        .collect()
}

/// Rank `rank`'s gradient of var `v`: element `i` is `(i + 1 + v) · (rank + 1)`, so the mean
/// over two ranks, `1.5 · (i + 1 + v)`, is exact in f32.
fn gradient(v: usize, rank: usize) -> Tensor {
    let n: usize = SHAPES[v].iter().product();
    let values: Vec<f32> = (0..n).map(|i| ((i + 1 + v) * (rank + 1)) as f32).collect();
    Tensor::from_vec(values, SHAPES[v], &Device::Cpu).unwrap()
}

fn mean(v: usize) -> Vec<f32> {
    let n: usize = SHAPES[v].iter().product();
    (0..n).map(|i| 1.5 * (i + 1 + v) as f32).collect()
}

/// Candle's own backward of `sum_v sum(var_v · gradient(v, rank))` over the vars in `used`:
/// a `GradStore` holding exactly those gradients.
fn backward(vars: &[Var], used: &[usize], rank: usize) -> GradStore {
    let mut loss = Tensor::new(0f32, &Device::Cpu).unwrap();
    for &v in used {
        let term = vars[v].mul(&gradient(v, rank)).unwrap().sum_all().unwrap();
        loss = loss.add(&term).unwrap();
    }
    loss.backward().unwrap()
}

fn values(grads: &GradStore, var: &Var) -> Option<Vec<f32>> {
    grads.get(var).map(|g| {
        g.flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    })
}

fn allreduce(
    vars: &[Var],
    group: ThreadGroup,
    config: ReducerConfig,
) -> CandleDdp<AllReduce<CpuBackend>> {
    let backend = Arc::new(CpuBackend::new());
    let group: Arc<dyn ProcessGroup> = Arc::new(group);
    let hook = AllReduce::new(backend.clone(), group.clone());
    CandleDdp::new(vars, backend, hook, config)
        .unwrap()
        .with_process_group(group)
}

#[test]
fn allreduce_round_trip_leaves_the_exact_mean_in_the_grad_store() {
    let results = run_local(2, |group| {
        let rank = group.rank();
        let vars = vars();
        let mut ddp = allreduce(&vars, group, ReducerConfig::default());
        // Three steps: the second runs on the rebuilt buckets; in the third, var 0's
        // gradient is a non-contiguous view (a transpose's transpose), copied in order.
        for step in 0..3 {
            let mut grads = backward(&vars, &[0, 1, 2], rank);
            if step == 2 {
                let strided = gradient(0, rank)
                    .t()
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .t()
                    .unwrap();
                assert!(!strided.is_contiguous());
                grads.insert(&vars[0], strided);
            }
            ddp.sync(&mut grads).unwrap();
            for (v, var) in vars.iter().enumerate() {
                assert_eq!(values(&grads, var), Some(mean(v)), "rank {rank}, var {v}");
                assert_eq!(grads.get(var).unwrap().dtype(), DType::F32);
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
fn the_hook_spec_builds_the_same_reduction() {
    let results = run_local(2, |group| {
        let rank = group.rank();
        let vars = vars();
        let mut ddp = CandleDdp::from_spec(
            &vars,
            &"allreduce".parse::<HookSpec>().unwrap(),
            Arc::new(group),
        )
        .unwrap();
        let mut grads = backward(&vars, &[0, 1, 2], rank);
        ddp.sync(&mut grads).unwrap();
        (0..3).all(|v| values(&grads, &vars[v]) == Some(mean(v)))
    })
    .unwrap();
    assert!(results.into_iter().all(|r| r.unwrap()));
}

#[test]
fn a_var_without_a_gradient_is_named_by_default_zero_with_find_unused_and_absent_if_no_rank_has_one(
) {
    // Rank 0 leaves var 1 out of its loss; rank 1 uses every var.
    let used = |rank: usize| if rank == 0 { vec![0, 2] } else { vec![0, 1, 2] };

    let results = run_local(2, |group| {
        let rank = group.rank();
        let vars = vars();
        let mut ddp = allreduce(&vars, group, ReducerConfig::default());
        let mut grads = backward(&vars, &used(rank), rank);
        let before: Vec<_> = vars.iter().map(|v| values(&grads, v)).collect();
        let result = ddp.sync(&mut grads);
        let after: Vec<_> = vars.iter().map(|v| values(&grads, v)).collect();
        if result.is_err() {
            assert_eq!(
                before, after,
                "rank {rank}: the store must be unchanged on an error"
            );
        }
        result
    })
    .unwrap();
    match results[0].as_ref().unwrap() {
        Err(CandleError::Reducer(ddp_hooks::Error::UnmarkedParameters {
            params, total, ..
        })) => {
            assert_eq!((params.as_slice(), *total), (&[1][..], 3));
        }
        other => panic!("rank 0: expected UnmarkedParameters, got {other:?}"),
    }
    assert!(
        results[1].as_ref().unwrap().is_ok(),
        "rank 1 completes its step"
    );

    let config = ReducerConfig {
        find_unused_parameters: true,
        ..ReducerConfig::default()
    };
    let results = run_local(2, |group| {
        let rank = group.rank();
        let vars = vars();
        let mut ddp = allreduce(&vars, group, config);
        let mut grads = backward(&vars, &used(rank), rank);
        ddp.sync(&mut grads).unwrap();
        vars.iter().map(|v| values(&grads, v)).collect::<Vec<_>>()
    })
    .unwrap();
    // Var 1: rank 0 counts zero, rank 1 has 2 · (i + 2): the mean is i + 2.
    let var1: Vec<f32> = (0..4).map(|i| (i + 2) as f32).collect();
    for r in results {
        let got = r.unwrap();
        assert_eq!(got, vec![Some(mean(0)), Some(var1.clone()), Some(mean(2))]);
    }

    // No rank uses var 1: it stays out of the store (DDP leaves its `.grad` untouched),
    // so an optimizer skips it; the others get their means.
    let results = run_local(2, |group| {
        let rank = group.rank();
        let vars = vars();
        let mut ddp = allreduce(&vars, group, config);
        let mut grads = backward(&vars, &[0, 2], rank);
        ddp.sync(&mut grads).unwrap();
        assert_eq!(ddp.reducer().globally_unused(), Some(&[1][..]));
        vars.iter().map(|v| values(&grads, v)).collect::<Vec<_>>()
    })
    .unwrap();
    for r in results {
        assert_eq!(r.unwrap(), vec![Some(mean(0)), None, Some(mean(2))]);
    }
}

#[test]
fn wrong_dtypes_and_shapes_are_typed_errors_and_the_peers_complete() {
    let f64_var = Var::zeros(4, DType::F64, &Device::Cpu).unwrap();
    let backend = Arc::new(CpuBackend::new());
    let hook = ddp_hooks::Noop::<CpuBackend>::new();
    match CandleDdp::new(
        &[vars()[0].clone(), f64_var],
        backend,
        hook,
        ReducerConfig::default(),
    ) {
        Err(CandleError::Var {
            var: 1,
            problem: Problem::DType(DType::F64),
        }) => {}
        other => panic!("expected a dtype error for var 1, got {other:?}"),
    }

    let results = run_local(2, |group| {
        let rank = group.rank();
        let vars = vars();
        let mut ddp = allreduce(&vars, group, ReducerConfig::default());
        let mut grads = backward(&vars, &[0, 1, 2], rank);
        if rank == 0 {
            grads.insert(&vars[1], gradient(1, 0).to_dtype(DType::F64).unwrap());
            grads.insert(
                &vars[2],
                Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
            );
        }
        let result = ddp.sync(&mut grads);
        (
            result,
            vars.iter().map(|v| values(&grads, v)).collect::<Vec<_>>(),
        )
    })
    .unwrap();
    let (rank0, _) = results[0].as_ref().unwrap();
    match rank0 {
        Err(e @ CandleError::Gradients(problems)) => {
            assert_eq!(
                problems,
                &vec![
                    (1, Problem::DType(DType::F64)),
                    (
                        2,
                        Problem::Shape {
                            expected: vec![2, 2, 2],
                            got: vec![3]
                        }
                    ),
                ]
            );
            let message = e.to_string();
            assert!(message.contains("gradient of var 1 is f64"), "{message}");
        }
        other => panic!("rank 0: expected gradient errors, got {other:?}"),
    }
    // Rank 1 completed the step, rank 0's bad gradients counting as zeros.
    let (rank1, got) = results[1].as_ref().unwrap();
    assert!(rank1.is_ok());
    let half = |v: usize| {
        gradient(v, 1)
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|g| g / 2.0)
            .collect::<Vec<f32>>()
    };
    assert_eq!(got, &vec![Some(mean(0)), Some(half(1)), Some(half(2))]);
}
