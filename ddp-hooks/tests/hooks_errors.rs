//! Regression (issue 14): a hook's own errors (`Bucket`, `Config`, ...) reached the user
//! after `wait()` as `collectives::Error::Backend(String)`, so they could not be matched.
//! They now travel typed in `collectives::Error::Hook` and come back as `ddp_hooks::Error`
//! variants (`Error::from_comm`, `From`), through the reducer too; a collective's own
//! failure stays the collective's variant. On the old code `Error::from(e)` gave
//! `Error::Comm(Backend(..))` for every one of them.

use collectives::{run_local, ProcessGroup, Work};
use ddp_hooks::{
    AllReduce, CommHook, Error, GradBucket, Layout, PowerSgd, PowerSgdConfig, Reducer,
    ReducerConfig,
};
use lowrank::CpuBackend;
use std::error::Error as _;
use std::sync::Arc;

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new().with_threads(1).unwrap())
}

/// A bucket whose length changes while PowerSGD holds memory for it: the error after
/// `wait()` is `Error::Bucket`, matchable, printed as itself, and equal to its clones.
#[test]
fn a_hook_error_is_typed_after_wait() {
    let cfg = PowerSgdConfig {
        start_powersgd_iter: 2,
        ..PowerSgdConfig::default()
    };
    let out = run_local(2, |g| {
        let mut hook = PowerSgd::new(backend(), Arc::new(g), cfg.clone()).unwrap();
        for len in [256, 256, 256] {
            let layout = Arc::new(Layout::packed(&[vec![16, len / 16]]).unwrap());
            let b = GradBucket::new(0, 1, vec![1.0; len], layout).unwrap();
            hook.run(b).wait().unwrap();
        }
        let layout = Arc::new(Layout::packed(&[vec![16, 17]]).unwrap());
        let b = GradBucket::new(0, 1, vec![1.0; 272], layout).unwrap();
        hook.run(b).wait().unwrap_err()
    })
    .unwrap();
    for e in out {
        let e = e.unwrap();
        assert!(matches!(e, collectives::Error::Hook(_)), "{e:?}");
        let typed = Error::from_comm(&e).expect("a hook error");
        assert!(
            matches!(typed, Error::Bucket { index: 0, why } if why.contains("length changed")),
            "{typed:?}"
        );
        assert_eq!(e.to_string(), typed.to_string());
        assert!(e.source().is_none(), "a bucket error has no source");
        assert!(matches!(
            Error::from(e.clone()),
            Error::Bucket { index: 0, .. }
        ));
        assert_eq!(e.clone(), e);
    }
}

/// A collective's failure (here ranks reducing buffers of different lengths) stays a
/// collective error: `Error::Comm` holding the collective's variant, not a hook error.
#[test]
fn a_collective_error_stays_the_collectives() {
    let out = run_local(2, |g| {
        let len = 8 + g.rank();
        let layout = Arc::new(Layout::packed(&[vec![len]]).unwrap());
        let mut hook = AllReduce::new(backend(), Arc::new(g));
        hook.run(GradBucket::new(0, 1, vec![1.0; len], layout).unwrap())
            .wait()
            .unwrap_err()
    })
    .unwrap();
    for e in out {
        let e = e.unwrap();
        assert!(Error::from_comm(&e).is_none(), "{e:?}");
        assert!(
            matches!(Error::from(e), Error::Comm(collectives::Error::Mismatch(_))),
            "a mismatch stays a mismatch"
        );
    }
}

/// A hook that fails every bucket with a configuration error, as a hook written outside
/// the crate would (`ddp_hooks::Error` into the work's error).
struct Failing;

impl CommHook<CpuBackend> for Failing {
    fn name(&self) -> String {
        "failing".into()
    }
    fn run(&mut self, _: GradBucket<CpuBackend>) -> Work<Vec<f32>> {
        Work::ready(Err(
            Error::Config("rank = 0: must be at least 1".into()).into()
        ))
    }
}

/// Through the reducer: `finish` returns the hook's own error, typed.
#[test]
fn the_reducer_returns_the_hooks_error_typed() {
    let out = run_local(1, |_| {
        let shapes = vec![vec![4, 3], vec![4]];
        let mut r = Reducer::new(backend(), &shapes, Failing, ReducerConfig::default()).unwrap();
        for p in (0..shapes.len()).rev() {
            r.mark_ready(p).unwrap();
        }
        r.finish()
    })
    .unwrap();
    let e = out.into_iter().next().unwrap().unwrap().unwrap_err();
    assert_eq!(e, Error::Config("rank = 0: must be at least 1".into()));
}
