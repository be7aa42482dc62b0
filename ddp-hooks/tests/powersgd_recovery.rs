//! A PowerSGD bucket survives a failed collective: the failing step returns the error,
//! the next step works (the exact mean, for gradients PowerSGD reproduces exactly), and
//! the state saves and loads. A failed step leaves the bucket's memories (error, `P`,
//! `Q`) as they were before it, so with warm start the steps after it are bit-identical
//! to a run that never saw the failed step.
//!
//! Each rank's group is wrapped so that one all-reduce (the same one on every rank, as a
//! real collective failure is seen by every rank) fails without being issued.

use collectives::{run_local, Buffer, ProcessGroup, ReduceOp, Work};
use ddp_hooks::{
    BatchedPowerSgd, CommHook, GradBucket, HookState, Layout, PowerSgd, PowerSgdConfig,
    PowerSgdState,
};
use lowrank::{CpuBackend, NormalRng};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const RANKS: usize = 2;
const STEPS: usize = 7;
/// The first compressed step.
const START: usize = 2;
const INJECTED: &str = "injected all-reduce failure";

/// A group whose all-reduce number `fail_at` (counted from 0 on this rank) fails at once,
/// without reaching the group it wraps.
struct FailOnce {
    inner: Arc<dyn ProcessGroup>,
    calls: AtomicUsize,
    fail_at: Option<usize>,
}

collectives::forward_group! {
    impl ProcessGroup for FailOnce {
        inner: |s| &s.inner;
        fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            if Some(call) == self.fail_at {
                return Work::ready(Err(collectives::Error::Backend(format!(
                    "{INJECTED} (call {call})"
                ))));
            }
            self.inner.all_reduce(buf, op)
        }
    }
}

/// Which of a compressed step's collectives fails.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Collective {
    /// The uncompressed tensors' all-reduce (per-layer hook only).
    Uncompressed,
    /// `P`'s all-reduce.
    P,
    /// `Q`'s all-reduce.
    Q,
}

/// Which hook, and how it is configured.
#[derive(Clone, Debug)]
enum Kind {
    PerLayer(PowerSgdConfig),
    Batched(PowerSgdConfig),
}

impl Kind {
    fn config(&self) -> &PowerSgdConfig {
        match self {
            Kind::PerLayer(c) | Kind::Batched(c) => c,
        }
    }

    fn build(&self, group: Arc<dyn ProcessGroup>) -> Box<dyn CommHook<CpuBackend>> {
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        match self {
            Kind::PerLayer(c) => Box::new(PowerSgd::new(be, group, c.clone()).unwrap()),
            Kind::Batched(c) => Box::new(BatchedPowerSgd::new(be, group, c.clone()).unwrap()),
        }
    }

    /// Per-layer: two same-shape matrices apart (stacked when batching same shapes), a
    /// bias between them (uncompressed) and a third matrix. Batched: one 16 x 16 matrix,
    /// a bucket that is exactly the batched hook's square (no pad).
    fn layout(&self) -> Arc<Layout> {
        let shapes: &[Vec<usize>] = match self {
            Kind::PerLayer(_) => &[vec![24, 20], vec![24], vec![24, 20], vec![16, 12]],
            Kind::Batched(_) => &[vec![16, 16]],
        };
        Arc::new(Layout::packed(shapes).unwrap())
    }

    /// The all-reduce (counted from 0 on each rank) that is `which` of step `step`.
    fn call_of(&self, step: usize, which: Collective) -> usize {
        // One all-reduce per step before `START`.
        match (self, which) {
            (Kind::PerLayer(_), w) => {
                START
                    + 3 * (step - START)
                    + match w {
                        Collective::Uncompressed => 0,
                        Collective::P => 1,
                        Collective::Q => 2,
                    }
            }
            (Kind::Batched(_), Collective::P) => START + 2 * (step - START),
            (Kind::Batched(_), Collective::Q) => START + 2 * (step - START) + 1,
            (Kind::Batched(_), Collective::Uncompressed) => unreachable!("no such collective"),
        }
    }

    /// Rank `rank`'s gradient at step `step`: every matrix `c · u vᵀ`, with `u` and `v`
    /// fixed for the rank and `c` changing with the step, so the mean of the ranks has
    /// rank 2 in fixed spaces and PowerSGD at rank 2 gives it exactly (error feedback
    /// included); the bias random.
    fn grad(&self, rank: usize, step: usize) -> Vec<f32> {
        let layout = self.layout();
        let mut out = Vec::with_capacity(layout.len());
        for (k, shape) in self.shapes().iter().enumerate() {
            let seed = (rank * 10_000 + k * 2) as u64;
            if let [n, m] = shape[..] {
                let (u, v) = (random(n, seed), random(m, seed + 1));
                let c = 1.0 + 0.5 * (0.7 * step as f32 + rank as f32).sin();
                out.extend((0..n * m).map(|i| c * u[i / m] * v[i % m]));
            } else {
                out.extend(random(shape.iter().product(), seed + 100 * step as u64));
            }
        }
        assert_eq!(out.len(), layout.len());
        out
    }

    fn shapes(&self) -> Vec<Vec<usize>> {
        match self {
            Kind::PerLayer(_) => vec![vec![24, 20], vec![24], vec![24, 20], vec![16, 12]],
            Kind::Batched(_) => vec![vec![16, 16]],
        }
    }
}

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

fn config(warm_start: bool, batch: Option<bool>) -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: 2,
        start_powersgd_iter: START as u64,
        warm_start,
        batch_tensors_with_same_shape: batch,
        ..PowerSgdConfig::default()
    }
}

fn mean(kind: &Kind, step: usize) -> Vec<f64> {
    let gs: Vec<Vec<f32>> = (0..RANKS).map(|r| kind.grad(r, step)).collect();
    (0..gs[0].len())
        .map(|i| gs.iter().map(|g| g[i] as f64).sum::<f64>() / RANKS as f64)
        .collect()
}

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let d: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let n: f64 = want.iter().map(|w| w * w).sum();
    (d / n.max(1e-300)).sqrt()
}

fn state_of(s: &HookState) -> &PowerSgdState {
    match s {
        HookState::PowerSgd(s) | HookState::BatchedPowerSgd(s) => s,
        other => panic!("not a PowerSGD state: {other:?}"),
    }
}

/// What one rank saw in a run where step `failed` had a collective fail.
struct Faulty {
    /// Every step's output; `None` for the failed step.
    outs: Vec<Option<Vec<f32>>>,
    /// The state saved just before the failed step, and just after it.
    before: HookState,
    after: HookState,
    /// Steps after the failed one, by a fresh hook loaded from `after` (through JSON).
    resumed: Vec<Vec<f32>>,
}

/// Runs `STEPS` steps of `kind` on every rank, with collective `which` of step `failed`
/// failing on every rank.
fn faulty_run(kind: &Kind, failed: usize, which: Collective) -> Vec<Faulty> {
    let fail_at = kind.call_of(failed, which);
    run_local(RANKS, |g| {
        let rank = g.rank();
        let layout = kind.layout();
        let group: Arc<dyn ProcessGroup> = Arc::new(FailOnce {
            inner: Arc::new(g),
            calls: AtomicUsize::new(0),
            fail_at: Some(fail_at),
        });
        let mut hook = kind.build(group.clone());
        let (mut outs, mut before, mut after) = (Vec::new(), None, None);
        for s in 0..STEPS {
            if s == failed {
                before = Some(hook.save_state().expect("save before the failing step"));
            }
            let bucket = GradBucket::new(0, 1, kind.grad(rank, s), layout.clone()).unwrap();
            match hook.run(bucket).wait() {
                Ok(out) => {
                    assert_ne!(s, failed, "{kind:?}: step {s} should have failed");
                    outs.push(Some(out));
                }
                Err(e) => {
                    assert_eq!(s, failed, "{kind:?} {which:?}: step {s} failed: {e}");
                    assert!(
                        matches!(&e, collectives::Error::Backend(m) if m.contains(INJECTED)),
                        "{kind:?} {which:?}: the step returns the collective's error, got {e:?}"
                    );
                    outs.push(None);
                    // Right after the failure: the state saves, and loads back into
                    // the hook itself.
                    let state = hook
                        .save_state()
                        .unwrap_or_else(|e| panic!("{kind:?} {which:?}: save failed: {e}"));
                    hook.load_state(state.clone())
                        .unwrap_or_else(|e| panic!("{kind:?} {which:?}: load failed: {e}"));
                    after = Some(state);
                }
            }
        }
        // A fresh hook loaded from the state saved after the failure continues exactly
        // as the hook that failed did.
        let after = after.expect("the failing step returned an error");
        let json = serde_json::to_string(&after).unwrap();
        let fresh = kind.build(group.clone());
        fresh
            .load_state(serde_json::from_str(&json).unwrap())
            .unwrap();
        let mut fresh = fresh;
        let resumed = (failed + 1..STEPS)
            .map(|s| {
                let bucket = GradBucket::new(0, 1, kind.grad(rank, s), layout.clone()).unwrap();
                fresh.run(bucket).wait().unwrap()
            })
            .collect();
        Faulty {
            outs,
            before: before.unwrap(),
            after,
            resumed,
        }
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// The outputs of a run without failures that skips step `skipped`.
fn clean_run(kind: &Kind, skipped: usize) -> Vec<Vec<Vec<f32>>> {
    run_local(RANKS, |g| {
        let rank = g.rank();
        let layout = kind.layout();
        let mut hook = kind.build(Arc::new(g));
        (0..STEPS)
            .filter(|&s| s != skipped)
            .map(|s| {
                let bucket = GradBucket::new(0, 1, kind.grad(rank, s), layout.clone()).unwrap();
                hook.run(bucket).wait().unwrap()
            })
            .collect()
    })
    .unwrap()
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// The checks of one scenario.
fn check(kind: &Kind, failed: usize, which: Collective) {
    let what = format!("{kind:?}, {which:?} of step {failed} failed");
    let faulty = faulty_run(kind, failed, which);
    let warm = kind.config().warm_start;
    let clean = warm.then(|| clean_run(kind, failed));
    for (rank, f) in faulty.iter().enumerate() {
        for (s, out) in f.outs.iter().enumerate() {
            let Some(out) = out else { continue };
            // Every other step is the exact mean (see `Kind::grad`).
            let e = rel_err(out, &mean(kind, s));
            assert!(e < 1e-4, "{what}: rank {rank} step {s}: relative error {e}");
            assert_eq!(
                out,
                faulty[0].outs[s].as_ref().unwrap(),
                "{what}: ranks agree"
            );
        }
        // The fresh hook loaded after the failure continues exactly as the hook did.
        let after: Vec<&Vec<f32>> = f.outs[failed + 1..].iter().flatten().collect();
        assert_eq!(after.len(), STEPS - failed - 1, "{what}: rank {rank}");
        for (k, (resumed, out)) in f.resumed.iter().zip(&after).enumerate() {
            assert_eq!(
                resumed,
                *out,
                "{what}: rank {rank}: resumed step {}",
                failed + 1 + k
            );
        }
        if let Some(clean) = &clean {
            // The failed step left no trace in the memories: the later steps are those of
            // a run that never saw it, bit for bit.
            for (k, out) in after.iter().enumerate() {
                assert_eq!(
                    *out,
                    &clean[rank][failed + k],
                    "{what}: rank {rank}: step {} differs from a run without the failed step",
                    failed + 1 + k
                );
            }
        }
        let (before, after) = (state_of(&f.before), state_of(&f.after));
        assert_eq!(
            after.iter, before.iter,
            "{what}: the failed step is not counted"
        );
        if warm && failed > START {
            // Error, P and Q as before the step, and no random draw.
            assert_eq!(after.buckets, before.buckets, "{what}: rank {rank}");
            assert_eq!(after.rng, before.rng, "{what}: rank {rank}");
        }
        for (index, b) in &after.buckets {
            for (name, v) in [("error", &b.error), ("p", &b.p), ("q", &b.q)] {
                assert!(
                    v.iter().all(|x| x.is_finite()),
                    "{what}: bucket {index}: {name} is not finite"
                );
            }
            if warm || matches!(kind, Kind::Batched(_)) {
                assert!(!b.q.is_empty(), "{what}: Q is kept");
                assert!(b.q.iter().any(|&x| x != 0.0), "{what}: Q is not all zero");
            }
        }
    }
}

#[test]
fn a_failed_collective_of_the_per_layer_hook_fails_only_its_step() {
    for batch in [Some(false), Some(true)] {
        for failed in [START, START + 2] {
            for which in [Collective::Uncompressed, Collective::P, Collective::Q] {
                check(&Kind::PerLayer(config(true, batch)), failed, which);
            }
        }
    }
}

#[test]
fn a_failed_collective_of_the_per_layer_hook_without_warm_start_fails_only_its_step() {
    for which in [Collective::Uncompressed, Collective::P, Collective::Q] {
        check(&Kind::PerLayer(config(false, None)), START + 2, which);
    }
}

#[test]
fn a_failed_collective_of_the_batched_hook_fails_only_its_step() {
    for warm in [true, false] {
        for failed in [START, START + 2] {
            for which in [Collective::P, Collective::Q] {
                check(&Kind::Batched(config(warm, None)), failed, which);
            }
        }
    }
}
