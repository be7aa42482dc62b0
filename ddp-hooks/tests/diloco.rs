//! DiLoCo and Streaming DiLoCo on thread ranks: the outer Nesterov step on the averaged
//! pseudo-gradient at steps H, 2H, ...; lr 1 without momentum is periodic model
//! averaging; streaming fragments sync on their staggered steps and leave the others
//! alone; a saved state resumes bit for bit; bad configurations are errors; PowerSGD and
//! fp16 hooks reduce the pseudo-gradient with its shapes.

use collectives::{run_local, ProcessGroup, ThreadGroup};
use ddp_hooks::{
    CommHook, DiLoCo, DiLoCoConfig, DiLoCoState, Error, HookSpec, PeriodicModelAverager,
};
use lowrank::CpuBackend;
use std::sync::Arc;

type Hook = Box<dyn CommHook<CpuBackend>>;
type Params = Vec<Vec<f32>>;

/// Runs `f` on `n` thread ranks and unwraps every rank's result.
fn ranks<R: Send>(n: usize, f: impl Fn(ThreadGroup) -> R + Sync) -> Vec<R> {
    run_local(n, f)
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new().with_threads(1).unwrap())
}

fn hook(spec: &str, group: Arc<dyn ProcessGroup>) -> Hook {
    spec.parse::<HookSpec>()
        .unwrap()
        .build(backend(), group)
        .unwrap()
}

/// The same initial parameters on every rank, of the given lengths.
fn init(lens: &[usize]) -> Params {
    lens.iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|j| 0.5 * j as f32 - k as f32).collect())
        .collect()
}

/// One inner step of plain SGD (lr 0.1) on rank `rank`'s quadratic
/// `½·a·(x − c)²`, `a = 1 + rank/2`, `c` depending on the rank and the element.
fn inner_step(rank: usize, params: &mut Params) {
    let a = 1.0 + 0.5 * rank as f32;
    for (k, p) in params.iter_mut().enumerate() {
        for (j, x) in p.iter_mut().enumerate() {
            let c = rank as f32 + 0.25 * j as f32 - k as f32;
            *x -= 0.1 * a * (*x - c);
        }
    }
}

fn views(p: &mut Params) -> Vec<&mut [f32]> {
    p.iter_mut().map(|v| &mut v[..]).collect()
}

fn refs(p: &Params) -> Vec<&[f32]> {
    p.iter().map(|v| &v[..]).collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * x.abs().max(y.abs()).max(1.0))
}

/// Every rank's `(synced?, params)` after each of `steps` inner steps of DiLoCo.
fn trace(
    world: usize,
    spec: &str,
    config: &DiLoCoConfig,
    lens: &[usize],
    steps: u64,
) -> Vec<Vec<(bool, Params)>> {
    ranks(world, |group| {
        let rank = group.rank();
        let mut params = init(lens);
        let mut d = DiLoCo::new(
            config.clone(),
            hook(spec, Arc::new(group)),
            backend(),
            &refs(&params),
        )
        .unwrap();
        let mut out = Vec::new();
        for _ in 0..steps {
            inner_step(rank, &mut params);
            let synced = d.step(&mut views(&mut params)).unwrap();
            if synced {
                assert_eq!(d.original_params(), &params[..]);
            }
            out.push((synced, params.clone()));
        }
        assert_eq!(d.steps(), steps);
        out
    })
}

/// (a) The outer step is the hand-computed Nesterov SGD step on the mean pseudo-gradient,
/// exactly at steps H, 2H, ..., the same on every rank.
#[test]
fn outer_nesterov_step_at_every_h_th_step() {
    let lens = [6, 2];
    for world in [2, 4] {
        let h = 3u64;
        let config = DiLoCoConfig {
            inner_steps: h,
            ..Default::default()
        };
        let (lr, mu) = (0.7f32, 0.9f32);
        let got = trace(world, "allreduce", &config, &lens, 4 * h);

        // The same by hand: every rank's local trajectory from θ, then at each H-th step
        // g = mean(θ − x_r), m = g (first) or μ·m + g, θ −= lr·(g + μ·m).
        let mut theta = init(&lens);
        let mut m: Option<Params> = None;
        let mut local: Vec<Params> = vec![theta.clone(); world];
        for step in 1..=4 * h {
            for (r, x) in local.iter_mut().enumerate() {
                inner_step(r, x);
            }
            let sync = step % h == 0;
            if sync {
                let g: Params = (0..lens.len())
                    .map(|k| {
                        (0..lens[k])
                            .map(|j| {
                                let sum: f32 = local.iter().map(|x| theta[k][j] - x[k][j]).sum();
                                sum / world as f32
                            })
                            .collect()
                    })
                    .collect();
                let mm = match m.take() {
                    None => g.clone(),
                    Some(old) => old
                        .iter()
                        .zip(&g)
                        .map(|(o, g)| o.iter().zip(g).map(|(o, g)| mu * o + g).collect())
                        .collect(),
                };
                for k in 0..lens.len() {
                    for j in 0..lens[k] {
                        theta[k][j] -= lr * (g[k][j] + mu * mm[k][j]);
                    }
                }
                m = Some(mm);
                local = vec![theta.clone(); world];
            }
            for (r, rank_trace) in got.iter().enumerate() {
                let (synced, params) = &rank_trace[step as usize - 1];
                assert_eq!(*synced, sync, "world {world} step {step}");
                for (k, p) in params.iter().enumerate() {
                    assert!(
                        close(p, &local[r][k], 1e-5),
                        "world {world} rank {r} step {step} param {k}: {p:?} vs {:?}",
                        local[r][k]
                    );
                }
            }
            if sync {
                for r in 1..world {
                    assert_eq!(got[r][step as usize - 1].1, got[0][step as usize - 1].1);
                }
            } else {
                // Between syncs the ranks diverge.
                assert_ne!(got[1][step as usize - 1].1, got[0][step as usize - 1].1);
            }
        }
    }
}

/// (b) With outer lr 1 and no momentum, DiLoCo is periodic model averaging:
/// `θ − mean(θ − x_r) = mean(x_r)`, against `PeriodicModelAverager` (period H, warmup
/// H − 1: its steps count from 0).
#[test]
fn lr_one_no_momentum_is_periodic_averaging() {
    let lens = [6, 2];
    for world in [2, 4] {
        let h = 2u64;
        let config = DiLoCoConfig {
            inner_steps: h,
            outer_lr: 1.0,
            outer_momentum: 0.0,
            nesterov: false,
            ..Default::default()
        };
        ranks(world, |group| {
            let rank = group.rank();
            let group: Arc<dyn ProcessGroup> = Arc::new(group);
            let mut a = init(&lens);
            let mut b = init(&lens);
            let mut d = DiLoCo::new(
                config.clone(),
                hook("allreduce", group.clone()),
                backend(),
                &refs(&a),
            )
            .unwrap();
            let mut avg = PeriodicModelAverager::new(h, h - 1, group).unwrap();
            for step in 1..=5 * h {
                inner_step(rank, &mut a);
                inner_step(rank, &mut b);
                let synced = d.step(&mut views(&mut a)).unwrap();
                let averaged = avg.average_parameters(&mut views(&mut b)).unwrap();
                assert_eq!(synced, averaged, "step {step}");
                assert_eq!(synced, step % h == 0);
                for (x, y) in a.iter().zip(&b) {
                    assert!(close(x, y, 1e-6), "step {step}: {x:?} vs {y:?}");
                }
            }
        });
    }
}

/// (c) Streaming DiLoCo with F = 2, H = 4: fragment 0 (parameter 0) syncs at steps 2, 6,
/// 10, fragment 1 (parameters 1 and 2) at 4, 8, 12; a sync leaves the other fragment's
/// parameters and outer parameters untouched.
#[test]
fn streaming_fragments_sync_on_staggered_steps() {
    let lens = [6, 2, 3];
    for world in [2, 4] {
        let config = DiLoCoConfig {
            inner_steps: 4,
            fragments: 2,
            ..Default::default()
        };
        let traces = ranks(world, |group| {
            let rank = group.rank();
            let mut params = init(&lens);
            let mut d = DiLoCo::new(
                config.clone(),
                hook("allreduce", Arc::new(group)),
                backend(),
                &refs(&params),
            )
            .unwrap();
            assert_eq!(d.fragment_params(0), Some(0..1));
            assert_eq!(d.fragment_params(1), Some(1..3));
            assert_eq!(d.fragment_params(2), None);
            let mut out = Vec::new();
            for step in 1..=12u64 {
                let (at, fragment) = d.next_sync();
                assert_eq!(at, step.div_ceil(2) * 2);
                assert_eq!(fragment, ((at / 2 - 1) % 2) as usize);
                inner_step(rank, &mut params);
                let before = params.clone();
                let theta_before = d.original_params().to_vec();
                let synced = d.step(&mut views(&mut params)).unwrap();
                assert_eq!(synced, step % 2 == 0, "step {step}");
                let touched = if synced {
                    d.fragment_params(fragment)
                } else {
                    None
                };
                for k in 0..lens.len() {
                    if touched.as_ref().is_some_and(|t| t.contains(&k)) {
                        assert_eq!(params[k], d.original_params()[k]);
                        assert_ne!(params[k], before[k]);
                    } else {
                        assert_eq!(params[k], before[k], "step {step} param {k}");
                        assert_eq!(d.original_params()[k], theta_before[k]);
                    }
                }
                out.push((touched, params.clone()));
            }
            out
        });
        for step in 0..12 {
            let (touched, p0) = &traces[0][step];
            for (r, t) in traces.iter().enumerate().skip(1) {
                assert_eq!(&t[step].0, touched);
                for (k, (mine, first)) in t[step].1.iter().zip(p0).enumerate() {
                    let synced_now = touched.as_ref().is_some_and(|t| t.contains(&k));
                    if synced_now {
                        assert_eq!(mine, first, "rank {r} step {step} param {k}");
                    } else {
                        assert_ne!(mine, first, "rank {r} step {step} param {k}");
                    }
                }
            }
        }
        // Fragment 0 at steps 2, 6, 10; fragment 1 at 4, 8, 12.
        let schedule: Vec<_> = traces[0].iter().map(|(t, _)| t.clone()).collect();
        for (i, t) in schedule.iter().enumerate() {
            let step = i + 1;
            let want = match step % 4 {
                2 => Some(0..1),
                0 => Some(1..3),
                _ => None,
            };
            assert_eq!(t, &want, "step {step}");
        }
    }
}

/// Runs `steps` inner steps of rank `rank` on `params` and DiLoCo `d`.
fn run_steps(d: &mut DiLoCo<Hook>, rank: usize, params: &mut Params, steps: u64) {
    for _ in 0..steps {
        inner_step(rank, params);
        d.step(&mut views(params)).unwrap();
    }
}

/// (d) A state saved mid-period (with momentum and, under PowerSGD, error feedback),
/// serialised, loaded into a fresh `DiLoCo` and continued, gives the uninterrupted run's
/// parameters bit for bit.
#[test]
fn save_and_load_resume_bit_identically() {
    let shapes = vec![vec![8, 6], vec![6], vec![4, 5]];
    let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    for (world, spec, fragments) in [
        (2, "allreduce", 1),
        (4, "allreduce", 3),
        (2, "powersgd:rank=1,start_iter=2", 1),
        (4, "powersgd:rank=1,start_iter=2", 3),
    ] {
        let config = DiLoCoConfig {
            inner_steps: 3,
            fragments,
            ..Default::default()
        };
        ranks(world, |group| {
            let rank = group.rank();
            let group: Arc<dyn ProcessGroup> = Arc::new(group);
            let make = |params: &Params| {
                DiLoCo::with_shapes(
                    config.clone(),
                    hook(spec, group.clone()),
                    backend(),
                    &refs(params),
                    &shapes,
                )
                .unwrap()
            };
            // Uninterrupted: 20 steps.
            let mut full = init(&lens);
            let mut d = make(&full);
            run_steps(&mut d, rank, &mut full, 20);

            // Interrupted after 10 (mid-period for F = 1; PowerSGD compressed at step 9,
            // so its error feedback is saved too).
            let mut params = init(&lens);
            let mut d = make(&params);
            run_steps(&mut d, rank, &mut params, 10);
            let state = d.state().unwrap();
            let json = serde_json::to_string(&state).unwrap();
            let back: DiLoCoState = serde_json::from_str(&json).unwrap();
            assert_eq!(back, state);
            drop(d);
            let mut fresh = make(&init(&lens));
            fresh.load_state(back).unwrap();
            assert_eq!(fresh.steps(), 10);
            assert_eq!(fresh.original_params(), &state.original[..]);
            run_steps(&mut fresh, rank, &mut params, 10);
            assert_eq!(params, full, "{spec} world {world} F {fragments}");
        });
    }
}

/// (e) Bad configurations, shapes, parameters and states are typed errors that change
/// nothing.
#[test]
fn bad_configs_are_errors() {
    ranks(1, |group| {
        let group: Arc<dyn ProcessGroup> = Arc::new(group);
        let params = init(&[4, 2, 3]);
        let build = |config: DiLoCoConfig| {
            DiLoCo::new(
                config,
                hook("allreduce", group.clone()),
                backend(),
                &refs(&params),
            )
        };
        let base = DiLoCoConfig::default();
        let bad = [
            DiLoCoConfig {
                inner_steps: 0,
                ..base.clone()
            },
            DiLoCoConfig {
                outer_lr: f32::NAN,
                ..base.clone()
            },
            DiLoCoConfig {
                outer_lr: f32::INFINITY,
                ..base.clone()
            },
            DiLoCoConfig {
                outer_lr: -0.1,
                ..base.clone()
            },
            DiLoCoConfig {
                outer_momentum: f32::NAN,
                ..base.clone()
            },
            DiLoCoConfig {
                outer_momentum: -0.5,
                ..base.clone()
            },
            DiLoCoConfig {
                outer_momentum: 0.0,
                nesterov: true,
                ..base.clone()
            },
            DiLoCoConfig {
                fragments: 0,
                ..base.clone()
            },
            DiLoCoConfig {
                fragments: 4, // 3 parameters
                inner_steps: 8,
                ..base.clone()
            },
            DiLoCoConfig {
                fragments: 2,
                inner_steps: 3, // not a multiple of 2
                ..base.clone()
            },
            DiLoCoConfig {
                fragments: 3,
                inner_steps: 1, // fewer steps than fragments
                ..base.clone()
            },
        ];
        for config in bad {
            let e = build(config.clone()).err();
            assert!(matches!(e, Some(Error::Config(_))), "{config:?}: {e:?}");
        }
        assert!(build(DiLoCoConfig {
            fragments: 3,
            inner_steps: 6,
            ..base.clone()
        })
        .is_ok());
        assert!(matches!(
            DiLoCo::new(
                base.clone(),
                hook("allreduce", group.clone()),
                backend(),
                &[]
            )
            .err(),
            Some(Error::Config(_))
        ));

        // Shapes: one per parameter, of its element count.
        let with = |shapes: &[Vec<usize>]| {
            DiLoCo::with_shapes(
                base.clone(),
                hook("allreduce", group.clone()),
                backend(),
                &refs(&params),
                shapes,
            )
            .err()
        };
        assert!(matches!(with(&[vec![4], vec![2]]), Some(Error::Config(_))));
        assert!(matches!(
            with(&[vec![2, 3], vec![2], vec![3]]),
            Some(Error::Config(_))
        ));
        assert!(with(&[vec![2, 2], vec![2], vec![3, 1]]).is_none());

        // Parameters of other counts or lengths, and states that do not fit.
        let config = DiLoCoConfig {
            inner_steps: 1,
            ..base.clone()
        };
        let mut d = build(config).unwrap();
        let before = d.state().unwrap();
        let mut fewer = params[..2].to_vec();
        assert!(matches!(
            d.step(&mut views(&mut fewer)),
            Err(Error::Config(_))
        ));
        let mut shorter = params.clone();
        shorter[1].pop();
        assert!(matches!(
            d.step(&mut views(&mut shorter)),
            Err(Error::Config(_))
        ));
        assert_eq!(d.state().unwrap(), before);
        let mut wrong = before.clone();
        wrong.original.pop();
        assert!(matches!(d.load_state(wrong), Err(Error::State(_))));
        let mut wrong = before.clone();
        wrong.momentum[0] = Some(vec![0.0; 3]);
        assert!(matches!(d.load_state(wrong), Err(Error::State(_))));
        let mut wrong = before.clone();
        wrong.hook = ddp_hooks::HookState::Stateless {
            hook: "fp16".into(),
        };
        wrong.step = 5;
        assert!(matches!(d.load_state(wrong), Err(Error::State(_))));
        assert_eq!(d.state().unwrap(), before);
    });
}

/// (f) PowerSGD per layer (`start_iter=0` without error feedback or warm start, as
/// PyTorch requires; `start_iter=2` with them), compressing the matrices of the
/// pseudo-gradient, and fp16 reduce it: finite results of the right shapes, the same on
/// every rank at a sync.
#[test]
fn runs_through_powersgd_and_fp16() {
    let shapes = vec![vec![16, 12], vec![12], vec![8, 10]];
    let lens: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    for spec in [
        // PyTorch refuses `start_iter` < 2 with error feedback or warm start.
        "powersgd:rank=1,start_iter=0,error_feedback=false,warm_start=false",
        "powersgd:rank=1,start_iter=2",
        "fp16",
        "fp16+powersgd:rank=1,start_iter=2",
    ] {
        for (world, fragments) in [(2, 1), (4, 3)] {
            let config = DiLoCoConfig {
                inner_steps: 3,
                fragments,
                ..Default::default()
            };
            let out = ranks(world, |group| {
                let rank = group.rank();
                let mut params = init(&lens);
                let mut d = DiLoCo::with_shapes(
                    config.clone(),
                    hook(spec, Arc::new(group)),
                    backend(),
                    &refs(&params),
                    &shapes,
                )
                .unwrap();
                let mut synced = Vec::new();
                for _ in 0..12 {
                    inner_step(rank, &mut params);
                    let s = d.step(&mut views(&mut params)).unwrap();
                    synced.push(s);
                    for (p, &n) in params.iter().zip(&lens) {
                        assert_eq!(p.len(), n);
                        assert!(p.iter().all(|x| x.is_finite()), "{spec}: {p:?}");
                    }
                }
                if spec.contains("powersgd") {
                    let stats = d.hook().compression_stats().unwrap();
                    assert!(stats.before > stats.after, "{spec}: {stats:?}");
                    assert!(d.hook().iteration().unwrap() > 0);
                }
                (synced, params, d.original_params().to_vec())
            });
            let interval = 3 / fragments;
            for (synced, _, theta) in &out {
                let want: Vec<bool> = (1..=12).map(|s| s % interval == 0).collect();
                assert_eq!(synced, &want);
                assert_eq!(theta, &out[0].2, "{spec}: θ differs between ranks");
                // The outer step moved θ towards the ranks' minima.
                assert_ne!(theta, &init(&lens));
            }
            // The last step (12) synced the last fragment: its parameters are θ on every
            // rank.
            let last = (lens.len() * (fragments - 1) / fragments)..lens.len();
            for (_, params, theta) in &out {
                for k in last.clone() {
                    assert_eq!(params[k], theta[k]);
                }
            }
        }
    }
}
