//! A reducer run shared by the backend comparisons (`cuda.rs`: the device path against
//! the CPU; `wire_isa.rs`: one CPU instruction set against another), and the tolerance
//! such comparisons may use.
#![allow(dead_code)] // each test crate uses its part

#[cfg(feature = "pipe")]
pub mod pipeline;

use collectives::ProcessGroup;
use ddp_hooks::{CommBackend, HookSpec, Reducer, ReducerConfig};
use lowrank::NormalRng;
use std::sync::Arc;

/// Parameter shapes in forward order: matrices PowerSGD compresses, vectors it does not,
/// and enough elements for two buckets of 1 MiB.
pub fn shapes() -> Vec<Vec<usize>> {
    vec![
        vec![256, 384],
        vec![384],
        vec![384, 512],
        vec![512],
        vec![128, 64],
        vec![64],
    ]
}

/// Steps of each run; PowerSGD specs start compressing at step 2.
pub const STEPS: usize = 5;

/// Rank `rank`'s gradients at `step`, one vector per parameter.
pub fn grads(rank: usize, step: usize) -> Vec<Vec<f32>> {
    shapes()
        .iter()
        .enumerate()
        .map(|(p, s)| {
            let mut v = vec![0.0; s.iter().product()];
            NormalRng::new((rank * 1000 + step * 10 + p) as u64).fill(&mut v);
            v
        })
        .collect()
}

/// `STEPS` synchronised steps of `spec` through a reducer (1 MiB buckets); each step's
/// reduced gradients, concatenated, on the host.
pub fn train<B: CommBackend>(
    be: Arc<B>,
    group: Arc<dyn ProcessGroup>,
    spec: &str,
    rank: usize,
) -> Vec<Vec<f32>> {
    let hook = spec
        .parse::<HookSpec>()
        .unwrap()
        .build(be.clone(), group.clone())
        .unwrap();
    let config = ReducerConfig {
        bucket_cap_mb: 1.0,
        first_bucket_mb: 1.0,
        ..Default::default()
    };
    let mut reducer = Reducer::new(be.clone(), &shapes(), hook, config)
        .unwrap()
        .with_process_group(group);
    let n = shapes().len();
    (0..STEPS)
        .map(|step| {
            let g = grads(rank, step);
            for p in (0..n).rev() {
                let dev = be.upload(&g[p]).unwrap();
                be.copy(B::view(&dev, ..).unwrap(), reducer.grad_mut(p).unwrap())
                    .unwrap();
                reducer.mark_ready(p).unwrap();
            }
            reducer.finish().unwrap();
            let mut out = Vec::new();
            for (p, grad) in g.iter().enumerate() {
                let mut host = vec![0.0; grad.len()];
                be.download(reducer.grad(p).unwrap(), &mut host).unwrap();
                out.extend(host);
            }
            reducer.zero_grad().unwrap();
            out
        })
        .collect()
}

/// How far two backends' results of `spec` may differ, relative to the norm.
///
/// `1e-5` where both compute the same function in `f32` and differ only in summation
/// order. A compressing hook behind a 16-bit wire (`fp16+powersgd`, `bf16+powersgd`) is
/// not such a function: it rounds `P` and `Q` to 16 bits, so an `f32` difference in the
/// last place moves an element across a rounding boundary now and then, a whole 16-bit
/// step (`2^-11` for f16, `2^-8` for bf16), and error feedback and warm start carry that
/// into later steps. Measured on one CPU between AVX-512 and AVX2 (`wire_isa.rs`):
/// `fp16+` 4.5e-5 at the first compressed step, 5.3e-4 two steps later; `bf16+` 1.4e-3;
/// and on an H200 against the CPU, `fp16+` 2.3e-3 at the first compressed step. Such
/// specs get 16 units of the wire's rounding.
pub fn tolerance(spec: &str) -> f64 {
    let compressing = spec.contains("powersgd");
    match spec.split_once('+') {
        Some(("fp16", _)) if compressing => 16.0 * f64::powi(2.0, -11),
        Some(("bf16", _)) if compressing => 16.0 * f64::powi(2.0, -8),
        _ => 1e-5,
    }
}

/// Asserts that every step of `b` is within [`tolerance`] of `a`, relative to `a`'s norm.
pub fn assert_close(what: &str, spec: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    let tol = tolerance(spec);
    assert_eq!(a.len(), b.len(), "{spec}: step counts");
    for (s, (a, b)) in a.iter().zip(b).enumerate() {
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        assert!(
            diff.is_finite() && diff <= tol * norm,
            "{spec}, step {s}: {what} differs by {diff:e} (norm {norm:e}, tolerance {tol:e} relative)"
        );
    }
}
