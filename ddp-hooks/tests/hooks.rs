//! The simple hooks against the exact mean, on 2 and 4 thread ranks.

use collectives::{run_local, ProcessGroup};
use ddp_hooks::{AllReduce, CommHook, Compress, GradBucket, Layout, Noop};
use half::{bf16, f16};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;

fn grad(rank: usize, len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(rank as u64 + 1).fill(&mut v);
    v
}

fn mean(ranks: usize, len: usize) -> Vec<f64> {
    let gs: Vec<Vec<f32>> = (0..ranks).map(|r| grad(r, len)).collect();
    (0..len)
        .map(|i| gs.iter().map(|g| g[i] as f64).sum::<f64>() / ranks as f64)
        .collect()
}

/// Runs `make`'s hook once on every rank; returns the outputs.
fn each_rank<H: CommHook<CpuBackend>>(
    ranks: usize,
    layout: &Arc<Layout>,
    make: impl Fn(Arc<CpuBackend>, Arc<dyn ProcessGroup>) -> H + Sync,
) -> Vec<Vec<f32>> {
    run_local(ranks, |g| {
        let rank = g.rank();
        let mut hook = make(Arc::new(CpuBackend::new()), Arc::new(g));
        let bucket = GradBucket::new(0, 1, grad(rank, layout.len()), layout.clone()).unwrap();
        hook.run(bucket).wait().unwrap()
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn allreduce_is_the_exact_mean_and_half_formats_are_within_precision() {
    let layout = Arc::new(Layout::packed(&[vec![64, 33], vec![33], vec![7]]).unwrap());
    for ranks in [2, 4] {
        let want = mean(ranks, layout.len());
        for out in each_rank(ranks, &layout, AllReduce::new) {
            for (g, w) in out.iter().zip(&want) {
                assert!((*g as f64 - w).abs() <= 1e-6 * w.abs().max(1.0));
            }
        }
        // Inputs rounded to the format (half a unit in the last place of each input),
        // summed in f32, the mean rounded once: within one unit of the largest input's
        // last place plus half of the mean's (2^-10 relative for f16, 2^-7 for bf16).
        let gs: Vec<Vec<f32>> = (0..ranks).map(|r| grad(r, layout.len())).collect();
        let big: Vec<f64> = (0..layout.len())
            .map(|i| gs.iter().map(|g| g[i].abs() as f64).fold(0.0, f64::max))
            .collect();
        for (outs, ulp) in [
            (
                each_rank(ranks, &layout, Compress::<CpuBackend, f16>::new),
                2f64.powi(-10),
            ),
            (
                each_rank(ranks, &layout, Compress::<CpuBackend, bf16>::new),
                2f64.powi(-7),
            ),
        ] {
            for out in outs {
                for ((g, w), b) in out.iter().zip(&want).zip(&big) {
                    assert!(
                        (*g as f64 - w).abs() <= ulp * (b + 0.5 * w.abs()) + 1e-7,
                        "{g} vs {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn noop_returns_the_input() {
    let layout = Arc::new(Layout::packed(&[vec![10, 10]]).unwrap());
    let outs = each_rank(2, &layout, |_, _| Noop::new());
    for (rank, out) in outs.into_iter().enumerate() {
        assert_eq!(out, grad(rank, 100));
    }
}

#[test]
fn a_bucket_must_match_its_layout() {
    let layout = Arc::new(Layout::packed(&[vec![2, 2]]).unwrap());
    assert!(GradBucket::<CpuBackend>::new(0, 1, vec![0.0; 5], layout.clone()).is_err());
    assert!(GradBucket::<CpuBackend>::new(1, 1, vec![0.0; 4], layout).is_err());
}

#[test]
fn half_wire_wrappers_send_16_bits_and_stay_close() {
    use collectives::link::{Charge, Link, LinkOp, Linked};
    use ddp_hooks::HookSpec;
    use std::time::Duration;
    let layout = Arc::new(Layout::packed(&[vec![64, 48]]).unwrap());
    let gs: Vec<Vec<f32>> = (0..2).map(|r| grad(r, layout.len())).collect();
    let big: Vec<f64> = (0..layout.len())
        .map(|i| gs.iter().map(|g| g[i].abs() as f64).fold(0.0, f64::max))
        .collect();
    for (spec, bytes, ulp) in [
        ("fp16+allreduce", 2, 2f64.powi(-10)),
        ("bf16+allreduce", 2, 2f64.powi(-7)),
        ("allreduce", 4, 1e-6),
    ] {
        let spec: HookSpec = spec.parse().unwrap();
        let out = run_local(2, |g| {
            let rank = g.rank();
            let linked = Linked::new(g, Link::gbit(1.0, Duration::ZERO).unwrap(), Charge::Account);
            let log = linked.log_handle();
            let mut hook = spec
                .build(Arc::new(CpuBackend::new()), Arc::new(linked))
                .unwrap();
            let b = GradBucket::new(0, 1, grad(rank, layout.len()), layout.clone()).unwrap();
            let out = hook.run(b).wait().unwrap();
            let ops = log.lock().unwrap().clone();
            (out, ops)
        })
        .unwrap();
        let want = mean(2, layout.len());
        for r in out {
            let (o, ops) = r.unwrap();
            assert_eq!(
                ops,
                vec![LinkOp::AllReduce(bytes * layout.len())],
                "{spec:?}"
            );
            for ((g, w), b) in o.iter().zip(&want).zip(&big) {
                assert!(
                    (*g as f64 - w).abs() <= ulp * (b + 0.5 * w.abs()) + 1e-7,
                    "{spec:?}: {g} vs {w}"
                );
            }
        }
    }
    // PowerSGD under the wrapper: its P and Q travel as f16.
    let spec: HookSpec = "fp16+powersgd:rank=1,start_iter=2".parse().unwrap();
    let out = run_local(2, |g| {
        let rank = g.rank();
        let linked = Linked::new(g, Link::gbit(1.0, Duration::ZERO).unwrap(), Charge::Account);
        let log = linked.log_handle();
        let mut hook = spec
            .build(Arc::new(CpuBackend::new()), Arc::new(linked))
            .unwrap();
        for s in 0..3 {
            let b = GradBucket::new(0, 1, grad(rank + s, layout.len()), layout.clone()).unwrap();
            hook.run(b).wait().unwrap();
        }
        let ops = log.lock().unwrap().clone();
        ops
    })
    .unwrap();
    let ops = out.into_iter().next().unwrap().unwrap();
    // Two vanilla steps of the whole bucket in f16, then P (64 x 1) and Q (48 x 1).
    assert_eq!(
        &ops[2..],
        &[LinkOp::AllReduce(2 * 64), LinkOp::AllReduce(2 * 48)],
        "{ops:?}"
    );
}
