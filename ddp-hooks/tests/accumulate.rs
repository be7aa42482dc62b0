//! The reducer with `accum`'s guards and real thread ranks: accumulation under
//! `no_sync` equals one step on the concatenated batch, hooks run only on synchronised
//! steps, and PowerSGD counts only those.

use accum::{no_sync, Accumulator, GradSync};
use collectives::{run_local, ProcessGroup, Work};
use ddp_hooks::{
    AllReduce, CommHook, GradBucket, PowerSgd, PowerSgdConfig, Reducer, ReducerConfig,
};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;

const OUT: usize = 6;
const IN: usize = 5;
/// Parameters in forward order: W (6 x 5), b (6).
fn shapes() -> Vec<Vec<usize>> {
    vec![vec![OUT, IN], vec![OUT]]
}

/// Every parameter in its own bucket (tiny capacities), so there are two buckets.
fn tiny_buckets() -> ReducerConfig {
    ReducerConfig {
        bucket_cap_mb: 1e-6,
        first_bucket_mb: 1e-6,
        ..ReducerConfig::default()
    }
}

fn weights() -> (Vec<f32>, Vec<f32>) {
    let (mut w, mut b) = (vec![0.0; OUT * IN], vec![0.0; OUT]);
    NormalRng::new(99).fill(&mut w);
    NormalRng::new(98).fill(&mut b);
    (w, b)
}

/// `samples` (x, y) pairs of rank `rank`'s micro-batch `j`.
fn batch(rank: usize, j: usize, samples: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    let mut g = NormalRng::new((rank * 1000 + j) as u64);
    (0..samples)
        .map(|_| {
            let (mut x, mut y) = (vec![0.0; IN], vec![0.0; OUT]);
            g.fill(&mut x);
            g.fill(&mut y);
            (x, y)
        })
        .collect()
}

/// Gradient of the mean over `data` of ½‖W x + b − y‖², scaled by `scale`, added into
/// (dW, db).
fn add_grad(data: &[(Vec<f32>, Vec<f32>)], scale: f32, dw: &mut [f32], db: &mut [f32]) {
    let (w, b) = weights();
    let s = scale / data.len() as f32;
    for (x, y) in data {
        for o in 0..OUT {
            let r = (0..IN).map(|i| w[o * IN + i] * x[i]).sum::<f32>() + b[o] - y[o];
            for i in 0..IN {
                dw[o * IN + i] += s * r * x[i];
            }
            db[o] += s * r;
        }
    }
}

/// Counts its calls; delegates to the real all-reduce hook.
struct Counting<H> {
    inner: H,
    calls: Arc<std::sync::atomic::AtomicUsize>,
}

impl<H: CommHook<CpuBackend>> CommHook<CpuBackend> for Counting<H> {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn run(&mut self, bucket: GradBucket<CpuBackend>) -> Work<Vec<f32>> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.run(bucket)
    }
}

#[test]
fn no_sync_accumulation_equals_the_concatenated_batch() {
    for ranks in [2, 4] {
        let k = 3;
        let per_micro = 4;
        let out = run_local(ranks, |g| {
            let rank = g.rank();
            let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
            let hook = AllReduce::new(be.clone(), Arc::new(g) as Arc<dyn ProcessGroup>);
            let mut reducer = Reducer::new(be, &shapes(), hook, tiny_buckets()).unwrap();
            let mut acc = Accumulator::new(k).unwrap();
            for (step, j) in acc.epoch(0..k) {
                let mut model = step.apply(&mut reducer);
                let (mut dw, mut db) = (vec![0.0; OUT * IN], vec![0.0; OUT]);
                add_grad(
                    &batch(rank, j, per_micro),
                    step.loss_scale(),
                    &mut dw,
                    &mut db,
                );
                // Backward: bias first (last layer), accumulating into the buckets.
                for (p, g) in [(1, &db), (0, &dw)] {
                    model
                        .grad_mut(p)
                        .unwrap()
                        .iter_mut()
                        .zip(g.iter())
                        .for_each(|(a, b)| *a += b);
                    model.mark_ready(p).unwrap();
                }
                model.finish().unwrap();
            }
            (
                reducer.grad(0).unwrap().to_vec(),
                reducer.grad(1).unwrap().to_vec(),
                reducer.hook_calls(),
            )
        })
        .unwrap();
        // Reference: each rank's k micro-batches as one batch, then the mean over ranks.
        let (mut dw, mut db) = (vec![0.0; OUT * IN], vec![0.0; OUT]);
        for r in 0..ranks {
            let all: Vec<_> = (0..k).flat_map(|j| batch(r, j, per_micro)).collect();
            add_grad(&all, 1.0 / ranks as f32, &mut dw, &mut db);
        }
        for r in out {
            let (gw, gb, calls) = r.unwrap();
            for (a, b) in gw.iter().zip(&dw).chain(gb.iter().zip(&db)) {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "{ranks} ranks: {a} vs {b}"
                );
            }
            assert_eq!(
                calls, 2,
                "one hook call per bucket, only on the synchronised step"
            );
        }
    }
}

#[test]
fn hooks_run_once_per_bucket_per_synchronised_step_only() {
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let out = run_local(2, |g| {
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let inner = AllReduce::new(be.clone(), Arc::new(g) as Arc<dyn ProcessGroup>);
        let hook = Counting {
            inner,
            calls: calls.clone(),
        };
        let mut reducer = Reducer::new(be, &shapes(), hook, tiny_buckets()).unwrap();
        assert_eq!(reducer.bucket_count(), 2);
        assert_eq!(
            reducer.bucket_params(),
            vec![vec![1], vec![0]],
            "reverse forward order"
        );
        let step = |reducer: &mut Reducer<_, _>| {
            for p in [1, 0] {
                reducer.mark_ready(p).unwrap();
            }
            reducer.finish().unwrap();
        };
        // Two no-sync steps, one synchronised; then a closure-form no_sync step.
        for _ in 0..2 {
            let mut guard = no_sync(&mut reducer);
            step(&mut guard);
        }
        step(&mut reducer);
        accum::with_no_sync(&mut reducer, |r| step(r));
        assert!(reducer.sync_enabled());
        reducer.hook_calls()
    })
    .unwrap();
    for r in out {
        assert_eq!(r.unwrap(), 2);
    }
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        4,
        "2 buckets x 2 ranks x 1 synchronised step"
    );
}

#[test]
fn powersgd_counts_only_synchronised_steps() {
    let out = run_local(2, |g| {
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let cfg = PowerSgdConfig {
            start_powersgd_iter: 2,
            ..PowerSgdConfig::default()
        };
        let hook = PowerSgd::new(be.clone(), Arc::new(g) as Arc<dyn ProcessGroup>, cfg).unwrap();
        let shapes = vec![vec![16, 12], vec![16]];
        let mut reducer = Reducer::new(be, &shapes, hook, ReducerConfig::default()).unwrap();
        let mut acc = Accumulator::new(4).unwrap();
        for _epoch in 0..3 {
            for (step, _) in acc.epoch(0..4) {
                let mut model = step.apply(&mut reducer);
                model
                    .grad_mut(0)
                    .unwrap()
                    .iter_mut()
                    .for_each(|x| *x += 1.0);
                model
                    .grad_mut(1)
                    .unwrap()
                    .iter_mut()
                    .for_each(|x| *x += 1.0);
                model.mark_ready(1).unwrap();
                model.mark_ready(0).unwrap();
                model.finish().unwrap();
                drop(model);
                step.zero_grad(|| reducer.zero_grad().unwrap());
            }
        }
        reducer.hook().iteration()
    })
    .unwrap();
    for r in out {
        assert_eq!(
            r.unwrap(),
            3,
            "12 micro-steps in groups of 4: 3 synchronised steps"
        );
    }
}

#[test]
fn reducer_errors_are_values() {
    let out = run_local(1, |g| {
        let be = Arc::new(CpuBackend::new());
        let hook = AllReduce::new(be.clone(), Arc::new(g) as Arc<dyn ProcessGroup>);
        let mut r = Reducer::new(be, &shapes(), hook, ReducerConfig::default()).unwrap();
        assert!(r.mark_ready(7).is_err());
        r.mark_ready(1).unwrap();
        assert!(r.mark_ready(1).is_err(), "twice in a step");
        let e = r.finish().unwrap_err();
        assert!(
            matches!(&e, ddp_hooks::Error::UnmarkedParameters { params, total: 2, .. } if params == &[0]),
            "{e}"
        );
        // The reducer stays usable.
        r.mark_ready(0).unwrap();
        r.mark_ready(1).unwrap();
        r.finish().unwrap();
    })
    .unwrap();
    out.into_iter().for_each(|r| r.unwrap());
    let bad = ReducerConfig {
        bucket_cap_mb: 0.0,
        first_bucket_mb: 1.0,
        ..ReducerConfig::default()
    };
    let out = run_local(1, |g| {
        let be = Arc::new(CpuBackend::new());
        let hook = AllReduce::new(be.clone(), Arc::new(g) as Arc<dyn ProcessGroup>);
        Reducer::new(be, &shapes(), hook, bad)
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    assert!(out[0]
        .as_ref()
        .unwrap()
        .as_deref()
        .unwrap_or("")
        .contains("bucket_cap_mb = 0"));
}

/// Regression: with several buckets in flight, PowerSGD issued each bucket's `Q`
/// all-reduce from a continuation while the caller started the next bucket, so ranks
/// issued collectives in timing-dependent orders (the thread backend reported
/// `Mismatch`; found by the ResNet-50 benchmark). Every rank must issue them in one
/// order.
#[test]
fn powersgd_with_many_buckets_in_flight_keeps_ranks_in_step() {
    for spec in [
        "powersgd:rank=2,start_iter=2",
        "batched_powersgd:rank=1,start_iter=2",
    ] {
        let out = run_local(4, |g| {
            let rank = g.rank();
            let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
            let hook = spec
                .parse::<ddp_hooks::HookSpec>()
                .unwrap()
                .build(be.clone(), Arc::new(g))
                .unwrap();
            let shapes: Vec<Vec<usize>> = (0..24)
                .map(|i| {
                    if i % 2 == 0 {
                        vec![32, 24 + i]
                    } else {
                        vec![32]
                    }
                })
                .collect();
            let mut reducer = Reducer::new(
                be,
                &shapes,
                hook,
                ReducerConfig {
                    bucket_cap_mb: 0.004,
                    first_bucket_mb: 0.002,
                    ..ReducerConfig::default()
                },
            )
            .unwrap();
            assert!(reducer.bucket_count() >= 8);
            let mut outs = Vec::new();
            for step in 0..8 {
                for p in (0..shapes.len()).rev() {
                    let mut g = NormalRng::new((rank * 100 + step * 10 + p) as u64);
                    g.fill(reducer.grad_mut(p).unwrap());
                    reducer.mark_ready(p).unwrap();
                }
                reducer.finish().unwrap();
                outs.push(
                    (0..shapes.len())
                        .flat_map(|p| reducer.grad(p).unwrap().to_vec())
                        .collect::<Vec<f32>>(),
                );
            }
            outs
        })
        .unwrap();
        let first = out[0].as_ref().unwrap().clone();
        for r in out {
            assert_eq!(r.unwrap(), first, "{spec}: ranks disagree");
        }
    }
}
