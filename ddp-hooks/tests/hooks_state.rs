//! Every hook built from the registry is a first-class hook (issue 14): through
//! `Box<dyn CommHook>` alone it saves and loads its state (trivially when stateless),
//! reports its statistics and its iteration, wrappers (`fp16+`, `bf16+`) included. On
//! the old code the boxed hook had only `name` and `run`.

use collectives::{run_local, ProcessGroup};
use ddp_hooks::{CommHook, CompressionStats, GradBucket, HookSpec, HookState, Layout};
use lowrank::{CpuBackend, NormalRng};
use std::sync::Arc;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new().with_threads(1).unwrap())
}

/// Two buckets per step (a matrix with its bias, then a larger matrix) of the given spec.
struct Model {
    layouts: Vec<Arc<Layout>>,
}

impl Model {
    fn new() -> Model {
        Model {
            layouts: vec![
                Arc::new(Layout::packed(&[vec![24, 40], vec![24]]).unwrap()),
                Arc::new(Layout::packed(&[vec![48, 32]]).unwrap()),
            ],
        }
    }

    /// Runs steps `range` (the step number choosing the gradients) on `hook`.
    fn steps(
        &self,
        hook: &mut dyn CommHook<CpuBackend>,
        rank: usize,
        range: std::ops::Range<u64>,
    ) -> Vec<Vec<f32>> {
        let mut outs = Vec::new();
        for s in range {
            let works: Vec<_> = self
                .layouts
                .iter()
                .enumerate()
                .map(|(k, l)| {
                    let g = random(l.len(), s * 100 + (rank * 10 + k) as u64);
                    hook.run(GradBucket::new(k, 2, g, l.clone()).unwrap())
                })
                .collect();
            outs.extend(works.into_iter().map(|w| w.wait().unwrap()));
        }
        outs
    }
}

/// What a hook reports besides its outputs.
type Report = (Option<u64>, Option<CompressionStats>);

fn report(hook: &dyn CommHook<CpuBackend>) -> Report {
    (hook.iteration(), hook.compression_stats())
}

/// For every kind of spec: 3 steps, `save_state` through JSON, `load_state` into a new
/// hook built from the same string on a fresh group, 4 more steps: bit-identical to 7
/// uninterrupted steps, with the same iteration and statistics.
#[test]
fn every_registry_hook_saves_and_resumes_through_the_trait() {
    let model = Model::new();
    for (spec, stateful) in [
        ("allreduce", false),
        ("fp16", false),
        ("bf16", false),
        ("noop", false),
        ("powersgd:rank=2,start_iter=2", true),
        ("batched_powersgd:rank=2,start_iter=2", true),
        ("fp16+powersgd:rank=1,start_iter=2", true),
        ("bf16+batched_powersgd:start_iter=2,warm_start=false", true),
        ("fp16+allreduce", false),
    ] {
        let spec: HookSpec = spec.parse().unwrap();
        let full = run_local(2, |g| {
            let rank = g.rank();
            let mut hook = spec.build(backend(), Arc::new(g)).unwrap();
            let outs = model.steps(&mut *hook, rank, 0..7);
            (outs, report(&*hook))
        })
        .unwrap();
        let saved = run_local(2, |g| {
            let rank = g.rank();
            let mut hook = spec.build(backend(), Arc::new(g)).unwrap();
            model.steps(&mut *hook, rank, 0..3);
            serde_json::to_string(&(*hook).save_state().unwrap()).unwrap()
        })
        .unwrap();
        let resumed = run_local(2, |g| {
            let rank = g.rank();
            let g: Arc<dyn ProcessGroup> = Arc::new(g);
            let mut hook = spec.build(backend(), g).unwrap();
            let state: HookState = serde_json::from_str(saved[rank].as_ref().unwrap()).unwrap();
            (*hook).load_state(state).unwrap();
            let outs = model.steps(&mut *hook, rank, 3..7);
            (outs, report(&*hook))
        })
        .unwrap();
        for (rank, (full, resumed)) in full.into_iter().zip(resumed).enumerate() {
            let (full, resumed) = (full.unwrap(), resumed.unwrap());
            assert_eq!(resumed.0, full.0[6..], "{spec:?}: rank {rank} diverged");
            assert_eq!(resumed.1, full.1, "{spec:?}: rank {rank}");
            if stateful {
                let (iter, stats) = resumed.1;
                assert_eq!(iter, Some(7), "{spec:?}");
                let stats = stats.unwrap();
                assert!(
                    stats.before > stats.after && stats.ratio > 1.0,
                    "{spec:?}: {stats:?}"
                );
            } else {
                assert_eq!(resumed.1, (None, None), "{spec:?}");
            }
        }
    }
}

/// A stateless hook's state names the hook, and the JSON of every state is tagged by
/// its kind.
#[test]
fn saved_states_name_their_kind() {
    let out = run_local(1, |g| {
        let g: Arc<dyn ProcessGroup> = Arc::new(g);
        [
            "allreduce",
            "bf16+allreduce",
            "noop",
            "powersgd",
            "batched_powersgd",
        ]
        .map(|s| {
            let hook = s
                .parse::<HookSpec>()
                .unwrap()
                .build(backend(), g.clone())
                .unwrap();
            serde_json::to_value((*hook).save_state().unwrap()).unwrap()
        })
    })
    .unwrap()
    .remove(0)
    .unwrap();
    assert_eq!(out[0]["Stateless"]["hook"], "allreduce");
    // The wrapper is a process group (`HalfWire`): the hook it wraps is the hook, and
    // saves its own state.
    assert_eq!(out[1]["Stateless"]["hook"], "allreduce");
    assert_eq!(out[2]["Stateless"]["hook"], "noop");
    assert_eq!(out[3]["PowerSgd"]["iter"], 0);
    assert_eq!(out[4]["BatchedPowerSgd"]["iter"], 0);
}

/// A hook written outside the crate (only `name` and `run`) compiles unchanged; it
/// reports no statistics or iteration, and refuses to save or load rather than saving
/// nothing silently.
#[test]
fn an_external_hook_keeps_compiling_and_refuses_to_checkpoint() {
    struct Plain;
    impl CommHook<CpuBackend> for Plain {
        fn name(&self) -> String {
            "plain".into()
        }
        fn run(&mut self, bucket: GradBucket<CpuBackend>) -> collectives::Work<Vec<f32>> {
            collectives::Work::ready(Ok(bucket.into_buffer()))
        }
    }
    let hook = Plain;
    assert_eq!((hook.iteration(), hook.compression_stats()), (None, None));
    let e = hook.save_state().unwrap_err();
    assert!(
        matches!(&e, ddp_hooks::Error::State(m) if m.contains("`plain`")),
        "{e}"
    );
    let e = hook
        .load_state(HookState::Stateless {
            hook: "plain".into(),
        })
        .unwrap_err();
    assert!(matches!(e, ddp_hooks::Error::State(_)), "{e}");
}
