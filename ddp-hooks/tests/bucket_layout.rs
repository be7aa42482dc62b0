//! `ReducerConfig::layout` (issue 33): `BucketLayout::ByShape` lays each bucket out for
//! PowerSGD (same-shape matrices adjacent, 1-D tensors last) so that
//! `batch_tensors_with_same_shape` reads its batches in place. Checked here:
//! - `BucketLayout::arrange` is a stable permutation with those properties, and applying
//!   it twice changes nothing (on random shape lists);
//! - a reducer under it keeps every parameter's gradient where `grad`/`grad_mut` say,
//!   and `set_bucket_params(bucket_params())` round-trips;
//! - every hook gives the exact mean where it should: all-reduce equal bit for bit to the
//!   launch layout's, PowerSGD exact (against the f64 mean) on gradients whose mean is
//!   within its rank, batched bit-identical to unbatched;
//! - a PowerSGD state saved under one layout is refused under the other.

use collectives::{run_local_with_timeout, ProcessGroup};
use ddp_hooks::{
    AllReduce, BucketLayout, CommHook, Error, PowerSgd, PowerSgdConfig, Reducer, ReducerConfig,
};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;
use std::time::Duration;

const RANKS: usize = 2;
const TIMEOUT: Duration = Duration::from_secs(30);

/// A small transformer layer twice, in forward order: four same-shape projections each
/// with its bias (so that under the launch layout their batch is not contiguous), norms,
/// two MLP matrices, a conv-like 3-D weight with the matrix view of a projection, and a
/// scalar.
fn shapes() -> Vec<Vec<usize>> {
    let h = 24;
    let mut s = Vec::new();
    for _ in 0..2 {
        for _ in 0..4 {
            s.push(vec![h, h]);
            s.push(vec![h]);
        }
        s.extend([
            vec![h],
            vec![h],
            vec![4 * h, h],
            vec![4 * h],
            vec![h, 4 * h],
            vec![h],
        ]);
    }
    s.push(vec![h, 4, 6]);
    s.push(vec![]);
    s
}

fn config(layout: BucketLayout) -> ReducerConfig {
    ReducerConfig {
        // Several buckets (about 16 KiB each), the first smaller.
        bucket_cap_mb: 0.016,
        first_bucket_mb: 0.008,
        layout,
        ..ReducerConfig::default()
    }
}

fn matrix_view(s: &[usize]) -> Option<(usize, usize)> {
    match s.split_first() {
        Some((&n, tail)) if !tail.is_empty() && n > 0 && tail.iter().product::<usize>() > 0 => {
            Some((n, tail.iter().product()))
        }
        _ => None,
    }
}

/// The properties of `ByShape` on one list of shapes.
fn check_arrangement(shapes: &[Vec<usize>]) {
    let order = BucketLayout::ByShape.arrange(shapes);
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (0..shapes.len()).collect::<Vec<_>>(),
        "{shapes:?}: not a permutation"
    );
    let views: Vec<Option<(usize, usize)>> =
        order.iter().map(|&i| matrix_view(&shapes[i])).collect();
    // Matrices first, then the rest.
    if let Some(first_rest) = views.iter().position(Option::is_none) {
        assert!(
            views[first_rest..].iter().all(Option::is_none),
            "{shapes:?}: {order:?}"
        );
    }
    // Each view's matrices adjacent, views in order of first appearance.
    let mut seen: Vec<(usize, usize)> = Vec::new();
    for v in views.iter().flatten() {
        if seen.last() != Some(v) {
            assert!(!seen.contains(v), "{shapes:?}: view {v:?} split: {order:?}");
            seen.push(*v);
        }
    }
    let first_seen: Vec<(usize, usize)> = {
        let mut f = Vec::new();
        for s in shapes {
            if let Some(v) = matrix_view(s) {
                if !f.contains(&v) {
                    f.push(v);
                }
            }
        }
        f
    };
    assert_eq!(seen, first_seen, "{shapes:?}: views out of order");
    // Stable: within a view, and among the rest, launch order.
    for w in order.windows(2) {
        let (a, b) = (matrix_view(&shapes[w[0]]), matrix_view(&shapes[w[1]]));
        if a == b {
            assert!(w[0] < w[1], "{shapes:?}: not stable: {order:?}");
        }
    }
    // Idempotent.
    let arranged: Vec<Vec<usize>> = order.iter().map(|&i| shapes[i].clone()).collect();
    assert_eq!(
        BucketLayout::ByShape.arrange(&arranged),
        (0..shapes.len()).collect::<Vec<_>>(),
        "{shapes:?}: arranging twice moved something"
    );
    assert_eq!(
        BucketLayout::Launch.arrange(shapes),
        (0..shapes.len()).collect::<Vec<_>>()
    );
}

#[test]
fn by_shape_is_a_stable_idempotent_grouping() {
    check_arrangement(&shapes());
    check_arrangement(&[]);
    check_arrangement(&[vec![0, 5], vec![5, 0], vec![3], vec![3, 1], vec![3, 1, 1]]);
    // Random lists over a few shapes, so that views repeat.
    let pool: Vec<Vec<usize>> = vec![
        vec![4, 4],
        vec![4],
        vec![4, 2, 2],
        vec![8, 2],
        vec![2, 8],
        vec![],
        vec![1],
        vec![4, 16],
        vec![0],
    ];
    let mut rng = NormalRng::new(7);
    for _ in 0..200 {
        let mut draw = vec![0.0f32; 12];
        rng.fill(&mut draw);
        let shapes: Vec<Vec<usize>> = draw
            .iter()
            .map(|x| pool[(x.abs() * 1000.0) as usize % pool.len()].clone())
            .collect();
        check_arrangement(&shapes);
    }
}

/// Rank `rank`'s gradient of parameter `p` at `step`: for matrices, `a(rank) u vᵀ` with
/// `u`, `v` fixed per parameter, so the mean over ranks is rank 1 and PowerSGD at rank
/// 1 reproduces it exactly (its error memory stays in the same span); random otherwise.
fn grad(rank: usize, p: usize, step: usize) -> Vec<f32> {
    let s = &shapes()[p];
    let len: usize = s.iter().product();
    match matrix_view(s) {
        Some((n, m)) => {
            let seed = p as u64 * 100;
            let (mut u, mut v) = (vec![0.0f32; n], vec![0.0f32; m]);
            NormalRng::new(seed).fill(&mut u);
            NormalRng::new(seed + 50_000).fill(&mut v);
            let a = 1.0 + rank as f32 * 0.75 + step as f32 * 0.25;
            (0..n * m).map(|k| a * u[k / m] * v[k % m]).collect()
        }
        None => {
            let seed = (p * 100 + step) as u64;
            let mut g = vec![0.0f32; len];
            NormalRng::new(seed + 1000 * rank as u64 + 7).fill(&mut g);
            g
        }
    }
}

fn exact_mean(p: usize, step: usize) -> Vec<f64> {
    let mut m = vec![0.0f64; shapes()[p].iter().product()];
    for r in 0..RANKS {
        for (a, &b) in m.iter_mut().zip(&grad(r, p, step)) {
            *a += b as f64 / RANKS as f64;
        }
    }
    m
}

/// Steps of `hook` through a reducer laid out as `layout`: each step's reduced
/// gradients, per parameter.
fn train<H: CommHook<CpuBackend>>(
    be: Arc<CpuBackend>,
    group: Arc<dyn ProcessGroup>,
    hook: H,
    layout: BucketLayout,
    rank: usize,
    steps: usize,
) -> (Vec<Vec<Vec<f32>>>, Reducer<CpuBackend, H>) {
    let shapes = shapes();
    let mut reducer = Reducer::new(be, &shapes, hook, config(layout))
        .unwrap()
        .with_process_group(group);
    let outs = (0..steps)
        .map(|step| {
            for p in (0..shapes.len()).rev() {
                reducer
                    .grad_mut(p)
                    .unwrap()
                    .copy_from_slice(&grad(rank, p, step));
                reducer.mark_ready(p).unwrap();
            }
            reducer.finish().unwrap();
            (0..shapes.len())
                .map(|p| reducer.grad(p).unwrap().to_vec())
                .collect()
        })
        .collect();
    (outs, reducer)
}

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new().with_threads(1).unwrap())
}

#[test]
fn by_shape_buckets_are_grouped_and_round_trip() {
    let out = run_local_with_timeout(RANKS, TIMEOUT, |g| {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = backend();
        let hook = AllReduce::new(be.clone(), group.clone());
        let (outs, mut reducer) = train(be, group, hook, BucketLayout::ByShape, 0, 2);
        let shapes = shapes();
        let buckets = reducer.bucket_params();
        assert!(buckets.len() >= 3, "{} buckets", buckets.len());
        for b in &buckets {
            let in_bucket: Vec<Vec<usize>> = b.iter().map(|&p| shapes[p].clone()).collect();
            assert_eq!(
                BucketLayout::ByShape.arrange(&in_bucket),
                (0..b.len()).collect::<Vec<_>>(),
                "bucket {b:?} is not laid out by shape"
            );
        }
        // Round trip: the same buckets, nothing moves, the gradients stay readable.
        reducer.set_bucket_params(buckets.clone()).unwrap();
        assert_eq!(reducer.bucket_params(), buckets);
        for (p, want) in outs[1].iter().enumerate() {
            assert_eq!(&reducer.grad(p).unwrap().to_vec(), want, "param {p}");
        }
        // Given in launch order, a bucket is arranged the same way.
        let reversed: Vec<Vec<usize>> = buckets
            .iter()
            .map(|b| {
                let mut v = b.clone();
                v.sort_unstable_by(|a, b| b.cmp(a));
                v
            })
            .collect();
        reducer.set_bucket_params(reversed).unwrap();
        for (b, params) in reducer.bucket_params().iter().enumerate() {
            let mut got = params.clone();
            got.sort_unstable();
            let mut want = buckets[b].clone();
            want.sort_unstable();
            assert_eq!(got, want);
        }
        for (p, want) in outs[1].iter().enumerate() {
            assert_eq!(
                &reducer.grad(p).unwrap().to_vec(),
                want,
                "param {p} after a move"
            );
        }
        outs
    })
    .unwrap();
    for o in out {
        o.unwrap();
    }
}

/// The all-reduce hook is layout-blind: both layouts give the same bits, the exact mean
/// up to rounding.
#[test]
fn all_reduce_is_the_same_under_both_layouts() {
    let runs: Vec<Vec<Vec<Vec<Vec<f32>>>>> = [BucketLayout::Launch, BucketLayout::ByShape]
        .map(|layout| {
            run_local_with_timeout(RANKS, TIMEOUT, move |g| {
                let rank = g.rank();
                let group: Arc<dyn ProcessGroup> = Arc::new(g);
                let be = backend();
                let hook = AllReduce::new(be.clone(), group.clone());
                train(be, group, hook, layout, rank, 3).0
            })
            .unwrap()
            .into_iter()
            .map(|r| r.unwrap())
            .collect()
        })
        .into_iter()
        .collect();
    assert_eq!(runs[0], runs[1]);
    for (step, out) in runs[1][0].iter().enumerate() {
        for (p, g) in out.iter().enumerate() {
            let want = exact_mean(p, step);
            for (a, b) in g.iter().zip(&want) {
                assert!((*a as f64 - b).abs() <= 1e-6 * (1.0 + b.abs()), "param {p}");
            }
        }
    }
}

fn powersgd(batch: bool) -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: 1,
        start_powersgd_iter: 2,
        batch_tensors_with_same_shape: Some(batch),
        ..PowerSgdConfig::default()
    }
}

type Outs = Vec<Vec<Vec<f32>>>;

fn run_powersgd(layout: BucketLayout, batch: bool, steps: usize) -> Vec<Outs> {
    run_local_with_timeout(RANKS, TIMEOUT, move |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = backend();
        let hook = PowerSgd::new(be.clone(), group.clone(), powersgd(batch)).unwrap();
        train(be, group, hook, layout, rank, steps).0
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// PowerSGD under `ByShape`, batched (every batch in place) and not: exact on
/// gradients whose mean is rank 1, the same bits either way and on every rank.
#[test]
fn powersgd_is_exact_and_batches_in_place_under_by_shape() {
    let steps = 5;
    for layout in [BucketLayout::Launch, BucketLayout::ByShape] {
        let (plain, batched) = (
            run_powersgd(layout, false, steps),
            run_powersgd(layout, true, steps),
        );
        assert_eq!(plain, batched, "{layout:?}: batched differs from unbatched");
        assert_eq!(batched[0], batched[1], "{layout:?}: ranks disagree");
        for (step, out) in batched[0].iter().enumerate() {
            for (p, g) in out.iter().enumerate() {
                let want = exact_mean(p, step);
                let scale = want.iter().fold(0.0f64, |s, x| s.max(x.abs()));
                let err = g
                    .iter()
                    .zip(&want)
                    .fold(0.0f64, |e, (a, b)| e.max((*a as f64 - b).abs()));
                assert!(
                    err <= 1e-4 * scale.max(1e-30),
                    "{layout:?} step {step} param {p} {:?}: error {err:e} of {scale:e}",
                    shapes()[p]
                );
            }
        }
    }
}

/// A state saved under one layout names the other's shapes: refused, naming both.
#[test]
fn a_state_saved_under_one_layout_is_refused_under_the_other() {
    let saved: Vec<String> = run_local_with_timeout(RANKS, TIMEOUT, |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = backend();
        let hook = PowerSgd::new(be.clone(), group.clone(), powersgd(true)).unwrap();
        let (_, reducer) = train(be, group, hook, BucketLayout::ByShape, rank, 4);
        serde_json::to_string(&reducer.hook().save().unwrap()).unwrap()
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    let errors = run_local_with_timeout(RANKS, TIMEOUT, move |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = backend();
        let state = serde_json::from_str(&saved[rank]).unwrap();
        let hook = PowerSgd::load(be.clone(), group.clone(), state).unwrap();
        let shapes = shapes();
        let mut reducer = Reducer::new(be, &shapes, hook, config(BucketLayout::Launch)).unwrap();
        for p in (0..shapes.len()).rev() {
            reducer
                .grad_mut(p)
                .unwrap()
                .copy_from_slice(&grad(rank, p, 4));
            // A refused bucket fails its launch or the step's finish.
            if let Err(e) = reducer.mark_ready(p) {
                return e;
            }
        }
        reducer.finish().unwrap_err()
    })
    .unwrap();
    for e in errors {
        let e = e.unwrap();
        let text = e.to_string();
        assert!(
            matches!(e, Error::Bucket { .. }) || text.contains("layout") || text.contains("shape"),
            "{e:?}"
        );
        assert!(
            text.contains("layout changed") && text.contains("[24, 4, 6]"),
            "the error says the layout changed and names the shapes: {text}"
        );
    }
}
