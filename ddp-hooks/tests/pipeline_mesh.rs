//! Pipeline × data parallel on a mesh (feature `pipe`): 4 thread ranks as 2 stages × 2
//! replicas (world rank = stage * 2 + replica), stages on ranks over
//! `pipe::GroupTransport`, each stage's gradients reduced over its replicas.
//!
//! - Exactness: with the all-reduce hook, every parameter gradient (gathered from the
//!   stage ranks) equals one unpipelined process's on the concatenated batch, step after
//!   step of SGD (GPipe; 1F1B with every stage checkpointed), and the two replicas of
//!   each stage hold the same gradients.
//! - PowerSGD: at a rank no smaller than any matrix's smaller side it is exact (within
//!   float error) once compressing; at rank 1 the gradients are finite, of the right
//!   shape, and the same on both replicas.
//! - Failure: a layer that fails on one rank is an error on every rank, within the
//!   pipe's timeout; a mesh that does not fit the world group is an error on every rank.
#![cfg(feature = "pipe")]

mod common;

use collectives::{run_local, ProcessGroup};
use common::pipeline::{allreduce, concat, mse, rel, sgd, small, BALANCE, HIDDEN};
use ddp_hooks::pipeline::{DistributedPipe, Mesh, MeshError, PipelineError};
use ddp_hooks::{CommHook, HookSpec, PowerSgd, PowerSgdConfig, ReducerConfig};
use lowrank::CpuBackend;
use pipe::cpu::CpuTensor;
use pipe::{Batch, Checkpoint, Context, Layer, Pipe, PipeBuilder, Saved, ScheduleKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

const STAGES: usize = 2;
const REPLICAS: usize = 2;
/// Samples per replica and step.
const N: usize = 6;

/// The layers of `stage` (the same model, cut by [`BALANCE`]).
fn stage_layers(stage: usize) -> Vec<Box<dyn Layer<CpuTensor>>> {
    let first: usize = BALANCE[..stage].iter().sum();
    small()
        .into_iter()
        .skip(first)
        .take(BALANCE[stage])
        .collect()
}

/// Replica `replica`'s half of the batch of step `step`: inputs and targets.
fn data(replica: usize, step: usize) -> (CpuTensor, CpuTensor) {
    common::pipeline::data(N, replica, step)
}

/// Every gradient this pipe holds (this rank's partitions), forward order, flattened,
/// with each parameter's shape.
fn grads(pipe: &Pipe<CpuTensor>) -> (Vec<f32>, Vec<Vec<usize>>) {
    let mut values = Vec::new();
    let mut shapes = Vec::new();
    for layer in pipe.partitions().iter().flatten() {
        for p in layer.parameters() {
            values.extend(p.grad.to_vec());
            shapes.push(p.grad.shape().to_vec());
        }
    }
    (values, shapes)
}

/// One process, no pipeline, on both replicas' halves at once with the loss the mean
/// over all `2N` samples (the replicas' means, averaged by the hook): the gradients of
/// each of `steps` SGD steps, and their shapes.
fn reference(steps: usize) -> (Vec<Vec<f32>>, Vec<Vec<usize>>) {
    let mut pipe = Pipe::builder(small(), &[5]).build().unwrap();
    let mut out = Vec::new();
    let mut shapes = Vec::new();
    for step in 0..steps {
        let (xs, ts): (Vec<_>, Vec<_>) = (0..REPLICAS).map(|d| data(d, step)).unzip();
        let target = concat(&ts);
        pipe.step(Batch::single(concat(&xs)), |mb, y| {
            mse(&target, REPLICAS * N, 1.0, mb, y)
        })
        .unwrap();
        let (g, s) = grads(&pipe);
        out.push(g);
        shapes = s;
        sgd(&mut pipe);
    }
    (out, shapes)
}

fn configure(b: PipeBuilder<CpuTensor>) -> PipeBuilder<CpuTensor> {
    b.chunks(3).timeout(Duration::from_secs(30))
}

/// 1F1B, every stage checkpointed, a micro-batch per sample.
fn one_f_one_b(b: PipeBuilder<CpuTensor>) -> PipeBuilder<CpuTensor> {
    configure(b)
        .chunks(N)
        .schedule(ScheduleKind::OneFOneB)
        .checkpoint(Checkpoint::Always)
}

/// What one rank saw: its stage and replica, its gradients after each step (and their
/// shapes), and what `report` said of its hook at the end.
struct RankRun<R> {
    stage: usize,
    replica: usize,
    grads: Vec<Vec<f32>>,
    shapes: Vec<Vec<usize>>,
    said: R,
}

/// `steps` SGD steps on the 2 × 2 mesh, the pipe's settings `setup` makes, the hook `make` builds over each stage's
/// data-parallel group; each rank's record, by world rank.
fn mesh_run<H, R>(
    steps: usize,
    setup: fn(PipeBuilder<CpuTensor>) -> PipeBuilder<CpuTensor>,
    make: impl Fn(Arc<dyn ProcessGroup>) -> H + Sync,
    report: impl Fn(&H) -> R + Sync,
) -> Vec<RankRun<R>>
where
    H: CommHook<CpuBackend> + 'static,
    R: Send,
{
    let out = run_local(STAGES * REPLICAS, |world| {
        let rank = world.rank();
        let (stage, replica) = (rank / REPLICAS, rank % REPLICAS);
        let builder = setup(Pipe::builder(stage_layers(stage), &BALANCE));
        let mut ddp = DistributedPipe::on_mesh_with(
            builder,
            Mesh::new(STAGES, REPLICAS),
            Arc::new(world),
            Arc::new(CpuBackend::new()),
            |data| Ok(make(data)),
            ReducerConfig::default(),
        )
        .unwrap();
        let groups = ddp.mesh_groups().unwrap();
        assert_eq!((groups.stage, groups.replica), (stage, replica));
        assert_eq!(ddp.mesh(), Some(Mesh::new(STAGES, REPLICAS)));
        // Only this rank's stage holds layers here.
        let held: Vec<usize> = ddp.pipe().partitions().iter().map(Vec::len).collect();
        let mut want = vec![0; STAGES];
        want[stage] = BALANCE[stage];
        assert_eq!(held, want);
        let mut record = Vec::new();
        let mut shapes = Vec::new();
        for step in 0..steps {
            let (x, t) = data(replica, step);
            let input = if stage == 0 {
                Batch::single(x)
            } else {
                Batch::new(Vec::new())
            };
            let out = ddp.step(input, |mb, y| mse(&t, N, 1.0, mb, y)).unwrap();
            // Losses only on the last stage's ranks.
            assert_eq!(out.losses.is_empty(), stage != STAGES - 1);
            let (g, s) = grads(ddp.pipe());
            record.push(g);
            shapes = s;
            sgd(ddp.pipe_mut());
        }
        let said = report(ddp.reducer().hook());
        RankRun {
            stage,
            replica,
            grads: record,
            shapes,
            said,
        }
    })
    .unwrap();
    out.into_iter().map(Result::unwrap).collect()
}

/// The gradients of `replica`'s whole model at `step`, gathered from its stage ranks,
/// and their shapes.
fn gathered<R>(runs: &[RankRun<R>], replica: usize, step: usize) -> (Vec<f32>, Vec<Vec<usize>>) {
    let mut values = Vec::new();
    let mut shapes = Vec::new();
    for stage in 0..STAGES {
        let r = &runs[stage * REPLICAS + replica];
        assert_eq!((r.stage, r.replica), (stage, replica));
        values.extend(&r.grads[step]);
        shapes.extend(r.shapes.iter().cloned());
    }
    (values, shapes)
}

#[test]
fn allreduce_on_a_two_by_two_mesh_equals_one_process_on_the_concatenated_batch() {
    let steps = 3;
    let (expected, shapes) = reference(steps);
    for (name, setup) in [
        ("gpipe", configure as fn(_) -> _),
        ("1f1b, checkpoint always", one_f_one_b),
    ] {
        let runs = mesh_run(steps, setup, allreduce, |_| ());
        for (step, expected) in expected.iter().enumerate() {
            for replica in 0..REPLICAS {
                let (got, got_shapes) = gathered(&runs, replica, step);
                assert_eq!(got_shapes, shapes);
                let r = rel(&got, expected);
                assert!(
                    r <= 1e-6,
                    "{name}, step {step}, replica {replica}: relative error {r}"
                );
            }
            for stage in 0..STAGES {
                let a = &runs[stage * REPLICAS].grads[step];
                let b = &runs[stage * REPLICAS + 1].grads[step];
                assert!(!a.is_empty());
                assert_eq!(a, b, "{name}, step {step}: stage {stage}'s replicas agree");
            }
        }
    }
}

#[test]
fn the_on_mesh_constructor_with_a_spec_gives_the_same_gradients() {
    let (expected, _) = reference(1);
    let out = run_local(STAGES * REPLICAS, |world| {
        let rank = world.rank();
        let (stage, replica) = (rank / REPLICAS, rank % REPLICAS);
        let builder = configure(Pipe::builder(stage_layers(stage), &BALANCE));
        let mesh = Mesh::new(STAGES, REPLICAS);
        let mut ddp =
            DistributedPipe::on_mesh(builder, mesh, Arc::new(world), &HookSpec::AllReduce).unwrap();
        let (x, t) = data(replica, 0);
        let input = if stage == 0 {
            Batch::single(x)
        } else {
            Batch::new(Vec::new())
        };
        let out = ddp.step(input, |mb, y| mse(&t, N, 1.0, mb, y)).unwrap();
        // Input gradients only on stage 0's ranks, outputs only on the last stage's.
        assert_eq!(out.input_grad.is_empty(), stage != 0);
        assert_eq!(out.output.is_empty(), stage != STAGES - 1);
        grads(ddp.pipe()).0
    })
    .unwrap();
    let got: Vec<Vec<f32>> = out.into_iter().map(Result::unwrap).collect();
    for replica in 0..REPLICAS {
        let whole: Vec<f32> = (0..STAGES)
            .flat_map(|s| got[s * REPLICAS + replica].clone())
            .collect();
        let r = rel(&whole, &expected[0]);
        assert!(r <= 1e-6, "replica {replica}: relative error {r}");
    }
}

fn powersgd(rank: usize) -> impl Fn(Arc<dyn ProcessGroup>) -> PowerSgd<CpuBackend> + Sync {
    move |g| {
        let config = PowerSgdConfig {
            matrix_approximation_rank: rank,
            start_powersgd_iter: 2,
            // Compress every matrix, even where the rank saves nothing.
            min_compression_rate: 0.01,
            ..PowerSgdConfig::default()
        };
        PowerSgd::new(Arc::new(CpuBackend::new()), g, config).unwrap()
    }
}

#[test]
fn powersgd_at_full_rank_on_the_mesh_is_exact_and_at_rank_one_finite() {
    let steps = 4;
    let (expected, shapes) = reference(steps);
    // Rank 8: no smaller than any weight's smaller side (6 or 8, 3 for the last), so the
    // low-rank factors span each gradient; exact up to float error.
    let runs = mesh_run(steps, configure, powersgd(HIDDEN), |h| {
        h.compression_stats()
    });
    for r in &runs {
        assert!(
            r.said.after > 0,
            "stage {} replica {}: PowerSGD compressed",
            r.stage,
            r.replica
        );
    }
    for (step, expected) in expected.iter().enumerate() {
        for replica in 0..REPLICAS {
            let (got, got_shapes) = gathered(&runs, replica, step);
            assert_eq!(got_shapes, shapes);
            let r = rel(&got, expected);
            assert!(
                r <= 1e-4,
                "full-rank PowerSGD, step {step}, replica {replica}: relative error {r}"
            );
        }
    }
    // Rank 1: an approximation, but finite, shaped as the parameters, and the same on
    // both replicas of each stage.
    let runs = mesh_run(steps, configure, powersgd(1), |h| h.compression_stats());
    for (step, expected) in expected.iter().enumerate() {
        for replica in 0..REPLICAS {
            let (got, got_shapes) = gathered(&runs, replica, step);
            assert_eq!(got_shapes, shapes);
            assert_eq!(got.len(), expected.len());
            assert!(got.iter().all(|g| g.is_finite()), "step {step}: finite");
        }
        for stage in 0..STAGES {
            assert_eq!(
                runs[stage * REPLICAS].grads[step],
                runs[stage * REPLICAS + 1].grads[step],
                "rank-1 PowerSGD, step {step}: stage {stage}'s replicas agree"
            );
        }
    }
    assert!(
        runs[0].said.after < runs[0].said.before,
        "rank 1 compresses"
    );
}

/// Fails its forward pass on world rank `fail_on` in the pipe's step 1; an identity
/// otherwise.
struct FailOn {
    rank: usize,
    fail_on: usize,
}

impl Layer<CpuTensor> for FailOn {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), pipe::Error> {
        if self.rank == self.fail_on && ctx.step() == 1 {
            return Err(pipe::Error::custom("injected failure"));
        }
        Ok((input, Saved::none()))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, pipe::Error> {
        Ok(grad_output)
    }
}

#[test]
fn a_layer_failure_on_one_rank_is_an_error_on_every_rank_without_a_hang() {
    // World rank 1: stage 0 of replica 1. Its pipeline peer (rank 3) hears of it through
    // the pipe; the replicas of the other pipeline (ranks 0 and 2) through the agreement.
    let timeout = Duration::from_secs(20);
    let started = Instant::now();
    let out = run_local(STAGES * REPLICAS, |world| {
        let rank = world.rank();
        let (stage, replica) = (rank / REPLICAS, rank % REPLICAS);
        let mut layers = stage_layers(stage);
        if stage == 0 {
            layers.insert(0, Box::new(FailOn { rank, fail_on: 1 }));
        }
        let balance = [BALANCE[0] + 1, BALANCE[1]];
        let builder = Pipe::builder(layers, &balance).chunks(2).timeout(timeout);
        let mesh = Mesh::new(STAGES, REPLICAS);
        let mut ddp =
            DistributedPipe::on_mesh(builder, mesh, Arc::new(world), &HookSpec::AllReduce).unwrap();
        let mut results = Vec::new();
        for step in 0..2 {
            let (x, t) = data(replica, step);
            let input = if stage == 0 {
                Batch::single(x)
            } else {
                Batch::new(Vec::new())
            };
            results.push(ddp.step(input, |mb, y| mse(&t, N, 1.0, mb, y)).map(|_| ()));
            ddp.zero_grad();
        }
        results
    })
    .unwrap();
    assert!(
        started.elapsed() < timeout,
        "every rank returned within the timeout: {:?}",
        started.elapsed()
    );
    let out: Vec<Vec<Result<(), PipelineError>>> = out.into_iter().map(Result::unwrap).collect();
    for (rank, results) in out.iter().enumerate() {
        assert!(results[0].is_ok(), "rank {rank}, step 0: {:?}", results[0]);
        let e = results[1].as_ref().expect_err("step 1 fails everywhere");
        match rank {
            1 => assert!(
                matches!(e, PipelineError::Pipe(_)) && e.to_string().contains("injected failure"),
                "rank 1: {e}"
            ),
            // Its pipeline peer: the pipe's remote failure.
            3 => assert!(matches!(e, PipelineError::Pipe(_)), "rank 3: {e}"),
            _ => assert!(
                matches!(e, PipelineError::PeersFailed { ranks } if *ranks == vec![1, 3]),
                "rank {rank}: {e}"
            ),
        }
    }
}

#[test]
fn a_mesh_that_does_not_fit_the_world_is_an_error_on_every_rank() {
    let out = run_local(4, |world| {
        let builder = Pipe::builder(stage_layers(0), &BALANCE);
        DistributedPipe::on_mesh(
            builder,
            Mesh::new(3, 2),
            Arc::new(world),
            &HookSpec::AllReduce,
        )
        .map(|_| ())
    })
    .unwrap();
    for r in out {
        match r.unwrap() {
            Err(PipelineError::Mesh(MeshError::Size { world: 4, .. })) => {}
            other => panic!("{other:?}"),
        }
    }
    let mesh = Mesh::new(2, 3);
    assert_eq!(mesh.rank(1, 2), Some(5));
    assert_eq!(mesh.coords(4), Some((1, 1)));
    assert_eq!(mesh.pipeline_ranks(1), vec![1, 4]);
    assert_eq!(mesh.data_parallel_ranks(1), vec![3, 4, 5]);
    assert_eq!(mesh.coords(6), None);
}
