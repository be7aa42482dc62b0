//! Pipeline × data parallel (feature `pipe`): thread ranks each running a two-partition
//! pipe, gradients reduced per partition as soon as they are final.
//!
//! - Exactness: 2 ranks × 2 partitions, every checkpoint mode, GPipe and 1F1B, the
//!   all-reduce hook: the parameters after 5 SGD steps equal one unpipelined process
//!   trained on the concatenated batch.
//! - PowerSGD: a short training run's loss stays within 1% of the all-reduce run's.
//! - Hooks: every bucket's hook runs exactly once per synchronised step, none under
//!   `no_sync`; accumulation over pipelined mini-batches equals one step on all of them.
//! - Overlap: a partition's buckets are launched while partition 0 is still inside its
//!   backward pass (and, with the late launch, not).
//! - Failure: a rank whose pipe fails leaves no peer waiting.
#![cfg(feature = "pipe")]

mod common;

use accum::{no_sync, Accumulator, GradSync};
use collectives::{run_local, ProcessGroup, Work};
use common::pipeline::{allreduce, concat, model, mse, normal, rel, sgd, small, BALANCE, IN, OUT};
use ddp_hooks::pipeline::{DistributedPipe, Launch, PipelineError};
use ddp_hooks::{AllReduce, CommHook, GradBucket, PowerSgd, PowerSgdConfig, ReducerConfig};
use lowrank::CpuBackend;
use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::{Batch, Checkpoint, Context, Layer, Pipe, Saved, ScheduleKind};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const RANKS: usize = 2;
/// Samples per rank and step.
const N: usize = 8;
/// Rank `rank`'s inputs and targets at step `step`.
fn data(rank: usize, step: usize) -> (CpuTensor, CpuTensor) {
    common::pipeline::data(N, rank, step)
}

fn params(pipe: &Pipe<CpuTensor>) -> Vec<f32> {
    pipe.partitions()
        .iter()
        .flatten()
        .flat_map(|l| l.parameters().into_iter().flat_map(|p| p.value.to_vec()))
        .collect()
}

fn grads(pipe: &Pipe<CpuTensor>) -> Vec<f32> {
    pipe.partitions()
        .iter()
        .flatten()
        .flat_map(|l| l.parameters().into_iter().flat_map(|p| p.grad.to_vec()))
        .collect()
}

/// One process, no pipeline (one partition, one micro-batch), on every rank's batch at
/// once: the parameters after `steps` SGD steps.
fn reference(steps: usize) -> Vec<f32> {
    let mut pipe = Pipe::builder(small(), &[5]).build().unwrap();
    for step in 0..steps {
        let (xs, ts): (Vec<_>, Vec<_>) = (0..RANKS).map(|r| data(r, step)).unzip();
        let target = concat(&ts);
        pipe.step(Batch::single(concat(&xs)), |mb, y| {
            mse(&target, RANKS * N, 1.0, mb, y)
        })
        .unwrap();
        sgd(&mut pipe);
    }
    params(&pipe)
}

#[test]
fn every_checkpoint_mode_and_schedule_equals_one_process_on_the_concatenated_batch() {
    let steps = 5;
    let expected = reference(steps);
    for checkpoint in [
        Checkpoint::Always,
        Checkpoint::ExceptLast,
        Checkpoint::Never,
    ] {
        for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let out = run_local(RANKS, |g| {
                let rank = g.rank();
                let pipe = Pipe::builder(small(), &BALANCE)
                    .chunks(4)
                    .checkpoint(checkpoint)
                    .schedule(schedule)
                    .build()
                    .unwrap();
                let hook = allreduce(Arc::new(g));
                let config = ReducerConfig::default();
                let backend = Arc::new(CpuBackend::new());
                let mut ddp = DistributedPipe::new(pipe, backend, hook, config).unwrap();
                for step in 0..steps {
                    let (x, t) = data(rank, step);
                    ddp.step(Batch::single(x), |mb, y| mse(&t, N, 1.0, mb, y))
                        .unwrap();
                    sgd(ddp.pipe_mut());
                }
                params(ddp.pipe())
            })
            .unwrap();
            let got: Vec<Vec<f32>> = out.into_iter().map(Result::unwrap).collect();
            assert_eq!(got[0], got[1], "{checkpoint:?} {schedule:?}: ranks agree");
            let r = rel(&got[0], &expected);
            assert!(r <= 1e-5, "{checkpoint:?} {schedule:?}: relative error {r}");
        }
    }
}

/// A teacher-student run: 2 ranks, the pipe with the hook `make` builds; the training
/// loss of the first step, the mean of the last 5 steps', and what `report` says of the
/// hook at the end.
fn train<H, R>(
    steps: usize,
    make: impl Fn(Arc<dyn ProcessGroup>) -> H + Sync,
    report: impl Fn(&H) -> R + Sync,
) -> (f32, f32, R)
where
    H: CommHook<CpuBackend> + 'static,
    R: Send,
{
    const WIDE: [usize; 4] = [16, 32, 32, 8];
    const BATCH: usize = 16;
    let mut teacher = Pipe::builder(model(WIDE, 500), &[5]).build().unwrap();
    teacher.eval();
    let batches: Vec<Vec<(CpuTensor, CpuTensor)>> = (0..RANKS)
        .map(|r| {
            (0..steps)
                .map(|s| {
                    let x = normal(&[BATCH, WIDE[0]], (7919 * s + r) as u64);
                    let y = teacher.forward(Batch::single(x.clone())).unwrap();
                    (x, y.into_single().unwrap())
                })
                .collect()
        })
        .collect();
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let pipe = Pipe::builder(model(WIDE, 40), &BALANCE)
            .chunks(4)
            .checkpoint(Checkpoint::Always)
            .schedule(ScheduleKind::OneFOneB)
            .build()
            .unwrap();
        let backend = Arc::new(CpuBackend::new());
        let hook = make(Arc::new(g));
        let config = ReducerConfig::default();
        let mut ddp = DistributedPipe::new(pipe, backend, hook, config).unwrap();
        let mut losses = Vec::new();
        for (x, t) in &batches[rank] {
            let out = ddp
                .step(Batch::single(x.clone()), |mb, y| mse(t, BATCH, 1.0, mb, y))
                .unwrap();
            losses.push(out.losses.iter().sum::<f32>());
            sgd(ddp.pipe_mut());
        }
        let said = report(ddp.reducer().hook());
        (losses, said)
    })
    .unwrap();
    let (mut first, mut tail) = (0.0, 0.0);
    let mut said = None;
    for r in out {
        let (losses, s) = r.unwrap();
        first += losses[0] / RANKS as f32;
        tail += losses[losses.len() - 5..].iter().sum::<f32>() / 5.0 / RANKS as f32;
        said = Some(s);
    }
    (first, tail, said.expect("two ranks"))
}

#[test]
fn powersgd_training_loss_stays_within_one_percent_of_allreduce() {
    let steps = 60;
    let backend = Arc::new(CpuBackend::new());
    let (initial, exact, _) = train(steps, |g| AllReduce::new(backend.clone(), g), |_| ());
    assert!(exact < 0.5 * initial, "it trains: {initial} -> {exact}");
    let config = PowerSgdConfig {
        matrix_approximation_rank: 4,
        start_powersgd_iter: 2,
        ..PowerSgdConfig::default()
    };
    let (_, compressed, stats) = train(
        steps,
        |g| PowerSgd::new(backend.clone(), g, config.clone()).unwrap(),
        |h: &PowerSgd<CpuBackend>| h.compression_stats(),
    );
    let (before, after) = (stats.before, stats.after);
    eprintln!("PowerSGD {compressed} vs all-reduce {exact}; sent {after} of {before}");
    assert!(
        after < before,
        "PowerSGD compressed: {after} elements sent for {before}"
    );
    let gap = (compressed - exact).abs() / exact;
    assert!(
        gap <= 0.01,
        "PowerSGD loss {compressed} vs all-reduce {exact}: {:.2}% apart",
        100.0 * gap
    );
}

/// Records every bucket index it is called with (and tells a channel); delegates to
/// the all-reduce hook.
struct Counting {
    inner: AllReduce<CpuBackend>,
    calls: Arc<Mutex<Vec<usize>>>,
    tell: Option<Sender<usize>>,
}

impl CommHook<CpuBackend> for Counting {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn run(&mut self, bucket: GradBucket<CpuBackend>) -> Work<Vec<f32>> {
        self.calls.lock().unwrap().push(bucket.index());
        if let Some(tell) = &self.tell {
            let _ = tell.send(bucket.index());
        }
        self.inner.run(bucket)
    }
}

/// Every parameter in a bucket of its own.
fn tiny_buckets() -> ReducerConfig {
    ReducerConfig {
        bucket_cap_mb: 1e-6,
        first_bucket_mb: 1e-6,
        ..ReducerConfig::default()
    }
}

fn counted(
    g: collectives::ThreadGroup,
    pipe: Pipe<CpuTensor>,
    tell: Option<Sender<usize>>,
) -> (DistributedPipe<CpuTensor, Counting>, Arc<Mutex<Vec<usize>>>) {
    let backend = Arc::new(CpuBackend::new());
    let calls = Arc::new(Mutex::new(Vec::new()));
    let hook = Counting {
        inner: AllReduce::new(backend.clone(), Arc::new(g)),
        calls: calls.clone(),
        tell,
    };
    let ddp = DistributedPipe::new(pipe, backend, hook, tiny_buckets()).unwrap();
    (ddp, calls)
}

/// How many times each of `buckets` buckets was called.
fn per_bucket(calls: &Mutex<Vec<usize>>, buckets: usize) -> Vec<usize> {
    let mut count = vec![0; buckets];
    for &b in calls.lock().unwrap().iter() {
        count[b] += 1;
    }
    count
}

#[test]
fn every_bucket_hook_runs_once_per_synchronised_step_and_never_under_no_sync() {
    for checkpoint in [Checkpoint::Always, Checkpoint::Never] {
        let out = run_local(RANKS, |g| {
            let rank = g.rank();
            let pipe = Pipe::builder(small(), &BALANCE)
                .chunks(3)
                .checkpoint(checkpoint)
                .build()
                .unwrap();
            let (mut ddp, calls) = counted(g, pipe, None);
            let buckets = ddp.bucket_params().len();
            // Buckets in backward order: the last partition's last parameter first, and
            // no bucket holds parameters of two partitions.
            assert_eq!(buckets, 6);
            assert_eq!(
                ddp.bucket_params(),
                (0..6).rev().map(|p| vec![p]).collect::<Vec<_>>()
            );
            assert_eq!(ddp.bucket_partitions(), vec![1, 1, 1, 1, 0, 0]);
            assert_eq!(ddp.partition_params(0), 0..2);
            assert_eq!(ddp.partition_params(1), 2..6);
            let step = |ddp: &mut DistributedPipe<CpuTensor, Counting>, s: usize| {
                let (x, t) = data(rank, s);
                ddp.step(Batch::single(x), |mb, y| mse(&t, N, 1.0, mb, y))
                    .unwrap();
            };
            let mut seen = Vec::new();
            for s in 0..3 {
                step(&mut ddp, s);
                seen.push(per_bucket(&calls, buckets));
            }
            let times = ddp.last_step_times().unwrap();
            assert!(times.pipe > Duration::ZERO && times.tail > Duration::ZERO);
            {
                let mut guard = no_sync(&mut ddp);
                assert!(!guard.sync_enabled());
                step(&mut guard, 3);
                step(&mut guard, 4);
                assert_eq!(guard.last_step_times().unwrap().tail, Duration::ZERO);
            }
            seen.push(per_bucket(&calls, buckets));
            accum::with_no_sync(&mut ddp, |d| step(d, 5));
            seen.push(per_bucket(&calls, buckets));
            assert!(ddp.sync_enabled());
            step(&mut ddp, 6);
            seen.push(per_bucket(&calls, buckets));
            (seen, ddp.hook_calls())
        })
        .unwrap();
        for r in out {
            let (seen, hook_calls) = r.unwrap();
            let expect = |k: usize| vec![k; 6];
            assert_eq!(
                seen,
                vec![
                    expect(1),
                    expect(2),
                    expect(3),
                    expect(3),
                    expect(3),
                    expect(4)
                ],
                "{checkpoint:?}: once per bucket per synchronised step, never under no_sync"
            );
            assert_eq!(hook_calls, 24);
        }
    }
}

#[test]
fn accumulating_pipelined_mini_batches_equals_one_step_on_all_of_them() {
    let k = 3;
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let pipe = Pipe::builder(small(), &BALANCE)
            .chunks(2)
            .checkpoint(Checkpoint::ExceptLast)
            .schedule(ScheduleKind::OneFOneB)
            .build()
            .unwrap();
        let (mut ddp, calls) = counted(g, pipe, None);
        let mut acc = Accumulator::new(k).unwrap();
        for (step, j) in acc.epoch(0..k) {
            let (x, t) = data(rank, j);
            let mut model = step.apply(&mut ddp);
            let scale = step.loss_scale();
            model
                .step(Batch::single(x), |mb, y| mse(&t, N, scale, mb, y))
                .unwrap();
            assert_eq!(calls.lock().unwrap().is_empty(), !step.sync_gradients());
        }
        (grads(ddp.pipe()), ddp.hook_calls())
    })
    .unwrap();
    // Reference: every rank's k mini-batches as one batch, one process, no pipeline.
    let mut whole = Pipe::builder(small(), &[5]).build().unwrap();
    let (xs, ts): (Vec<_>, Vec<_>) = (0..RANKS)
        .flat_map(|r| (0..k).map(move |j| data(r, j)))
        .unzip();
    let target = concat(&ts);
    whole
        .step(Batch::single(concat(&xs)), |mb, y| {
            mse(&target, RANKS * k * N, 1.0, mb, y)
        })
        .unwrap();
    let expected = grads(&whole);
    for r in out {
        let (got, hook_calls) = r.unwrap();
        let e = rel(&got, &expected);
        assert!(e <= 1e-5, "relative error {e}");
        assert_eq!(hook_calls, 6, "one reduction: 6 buckets, once");
    }
}

/// An identity layer that, on its last backward call of each step (partition 0's last
/// action), counts the buckets launched in that step so far from the hook's channel.
/// Every step launches `buckets` buckets, all before the next step starts, so the
/// messages of earlier steps are told apart by counting. With `wait`, it waits (bounded)
/// for the step's first launch.
struct Gate {
    calls: usize,
    per_step: usize,
    buckets: usize,
    received: usize,
    wait: bool,
    launched: Receiver<usize>,
    seen: Arc<Mutex<Vec<bool>>>,
}

impl Layer<CpuTensor> for Gate {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), pipe::Error> {
        Ok((input, Saved::none()))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, pipe::Error> {
        self.calls += 1;
        if self.calls.is_multiple_of(self.per_step) {
            let earlier = self.buckets * (self.calls / self.per_step - 1);
            if self.wait {
                while self.received <= earlier {
                    match self.launched.recv_timeout(Duration::from_secs(20)) {
                        Ok(_) => self.received += 1,
                        Err(_) => break,
                    }
                }
            } else {
                while self.launched.try_recv().is_ok() {
                    self.received += 1;
                }
            }
            self.seen.lock().unwrap().push(self.received > earlier);
        }
        Ok(grad_output)
    }
}

#[test]
fn a_partition_buckets_launch_while_earlier_partitions_still_compute_backward() {
    let m = 4;
    for (launch, schedule) in [
        (Launch::PerPartition, ScheduleKind::GPipe),
        (Launch::PerPartition, ScheduleKind::OneFOneB),
        (Launch::AfterBackward, ScheduleKind::GPipe),
    ] {
        let out = run_local(RANKS, |g| {
            let rank = g.rank();
            let (tell, launched) = channel();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let gate = Gate {
                calls: 0,
                per_step: m,
                buckets: 6,
                received: 0,
                wait: launch == Launch::PerPartition,
                launched,
                seen: seen.clone(),
            };
            // Partition 0: the gate first, so its last backward call is partition 0's
            // last action of the step.
            let mut layers: Vec<Box<dyn Layer<CpuTensor>>> = vec![Box::new(gate)];
            layers.extend(small());
            let pipe = Pipe::builder(layers, &[3, 3])
                .chunks(m)
                .checkpoint(Checkpoint::Always)
                .schedule(schedule)
                .build()
                .unwrap();
            let (ddp, _) = counted(g, pipe, Some(tell));
            let mut ddp = ddp.with_launch(launch);
            for s in 0..2 {
                let (x, t) = data(rank, s);
                ddp.step(Batch::single(x), |mb, y| mse(&t, N, 1.0, mb, y))
                    .unwrap();
            }
            let seen = seen.lock().unwrap().clone();
            seen
        })
        .unwrap();
        for r in out {
            let expected = launch == Launch::PerPartition;
            assert_eq!(
                r.unwrap(),
                vec![expected; 2],
                "{launch:?} {schedule:?}: partition 1's buckets launched before partition 0's backward ended"
            );
        }
    }
}

/// On rank `fail_on`, fails its backward pass once, in the pipe's step 1; an identity
/// otherwise.
struct FailOnce {
    rank: usize,
    fail_on: usize,
    failed: bool,
}

impl Layer<CpuTensor> for FailOnce {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), pipe::Error> {
        Ok((input, Saved::none()))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, pipe::Error> {
        if self.rank == self.fail_on && ctx.step() == 1 && !self.failed {
            self.failed = true;
            return Err(pipe::Error::custom("injected failure"));
        }
        Ok(grad_output)
    }
}

#[test]
fn a_rank_whose_pipe_fails_leaves_no_peer_waiting() {
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let mut layers: Vec<Box<dyn Layer<CpuTensor>>> = vec![Box::new(FailOnce {
            rank,
            fail_on: 1,
            failed: false,
        })];
        layers.extend(small());
        let pipe = Pipe::builder(layers, &[3, 3])
            .chunks(2)
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let (mut ddp, _) = counted(g, pipe, None);
        let mut results = Vec::new();
        for s in 0..3 {
            let (x, t) = data(rank, s);
            let r = ddp.step(Batch::single(x), |mb, y| mse(&t, N, 1.0, mb, y));
            results.push(match r {
                Ok(_) => "ok".to_string(),
                Err(PipelineError::Pipe(e)) => format!("pipe: {e}"),
                Err(e) => format!("other: {e}"),
            });
            ddp.zero_grad();
        }
        (results, ddp.hook_calls())
    })
    .unwrap();
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(out[0].0, vec!["ok", "ok", "ok"]);
    assert_eq!(out[1].0[0], "ok");
    assert!(
        out[1].0[1].starts_with("pipe: ") && out[1].0[1].contains("injected failure"),
        "{:?}",
        out[1].0
    );
    assert_eq!(out[1].0[2], "ok", "the pipe stays usable");
    // Every bucket reduced in every step on both ranks, the failed one included.
    assert_eq!(out[0].1, 18);
    assert_eq!(out[1].1, 18);
}

#[test]
fn a_partition_without_parameters_gets_no_bucket() {
    // Partition 1 holds only a ReLU: no buckets of its own.
    let out = run_local(RANKS, |g| {
        let rank = g.rank();
        let layers: Vec<Box<dyn Layer<CpuTensor>>> =
            vec![Box::new(Linear::new(IN, OUT, 3)), Box::new(ReLU)];
        let pipe = Pipe::builder(layers, &[1, 1]).chunks(2).build().unwrap();
        let (mut ddp, _) = counted(g, pipe, None);
        assert_eq!(ddp.bucket_partitions(), vec![0, 0]);
        assert_eq!(ddp.partition_params(1), 2..2);
        let (x, t) = data(rank, 0);
        ddp.step(Batch::single(x), |mb, y| mse(&t, N, 1.0, mb, y))
            .unwrap();
        grads(ddp.pipe())
    })
    .unwrap();
    let got: Vec<Vec<f32>> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(got[0], got[1]);
}
