//! Stages on ranks ([`PipeBuilder::on_ranks`]): a pipe whose partitions run on thread
//! ranks over an in-process transport computes bit for bit what the same pipe computes
//! in one process (outputs, input gradients, every parameter gradient, the evaluation
//! after the step), for GPipe, 1F1B and a split forward/backward, every checkpoint mode,
//! deferred weight gradients, micro-batches of different sizes, skips that cross ranks,
//! and several stages on one rank. Failures reach every rank, naming where they happened.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::{
    AddSkip, Batch, Checkpoint, Error, Layer, LocalTransport, Pipe, PipeBuilder, ScheduleKind,
    StashInput, Transport,
};

/// What one training step and one evaluation leave, gathered over the ranks.
#[derive(Debug, PartialEq)]
struct Outcome {
    output: CpuTensor,
    input_grad: CpuTensor,
    losses: Vec<f32>,
    grads: Vec<CpuTensor>,
    evaluated: CpuTensor,
}

#[derive(Debug, Clone, Copy)]
enum Drive {
    Step(ScheduleKind),
    Split,
}

#[derive(Clone, Copy)]
struct Setup {
    chunks: usize,
    mode: Checkpoint,
    drive: Drive,
    defer: bool,
    batch: usize,
}

fn configure(b: PipeBuilder<CpuTensor>, s: Setup) -> PipeBuilder<CpuTensor> {
    let b = b
        .chunks(s.chunks)
        .checkpoint(s.mode)
        .seed(SEED)
        .defer_weight_grads(s.defer);
    match s.drive {
        Drive::Step(kind) => b.schedule(kind),
        Drive::Split => b,
    }
}

/// One training step (and an evaluation forward) of `pipe`; `first` and `last` say
/// whether it holds stage 0 and the last stage (all of it in one process).
fn train(
    pipe: &mut Pipe<CpuTensor>,
    s: Setup,
    first: bool,
    last: bool,
) -> (
    Batch<CpuTensor>,
    Batch<CpuTensor>,
    Vec<f32>,
    Batch<CpuTensor>,
) {
    let x = data(s.batch, width_in(), 7);
    let target = data(s.batch, 3, 8);
    let input = if first {
        Batch::single(x.clone())
    } else {
        Batch::new(Vec::new())
    };
    let (output, input_grad, losses) = match s.drive {
        Drive::Step(_) => {
            let out = pipe.step(input, |mb, out| mse(&target, mb, out)).unwrap();
            (out.output, out.input_grad, out.losses)
        }
        Drive::Split => {
            let output = pipe.forward(input).unwrap();
            let grad = if last {
                let full = pipe::MicroBatch {
                    index: 0,
                    offset: 0,
                    len: s.batch,
                };
                let (loss, g) = mse(&target, full, &output).unwrap();
                let input_grad = pipe.backward(g).unwrap();
                return finish(pipe, output, input_grad, vec![loss], first, s);
            } else {
                Batch::new(Vec::new())
            };
            let input_grad = pipe.backward(grad).unwrap();
            (output, input_grad, Vec::new())
        }
    };
    finish(pipe, output, input_grad, losses, first, s)
}

fn finish(
    pipe: &mut Pipe<CpuTensor>,
    output: Batch<CpuTensor>,
    input_grad: Batch<CpuTensor>,
    losses: Vec<f32>,
    first: bool,
    s: Setup,
) -> (
    Batch<CpuTensor>,
    Batch<CpuTensor>,
    Vec<f32>,
    Batch<CpuTensor>,
) {
    pipe.eval();
    let input = if first {
        Batch::single(data(s.batch, width_in(), 9))
    } else {
        Batch::new(Vec::new())
    };
    let evaluated = pipe.forward(input).unwrap();
    pipe.train();
    (output, input_grad, losses, evaluated)
}

/// Runs `f(rank, its layers, its transport)` on one thread per part, the ranks of one
/// in-process transport; the results in rank order.
fn per_rank<R: Send>(
    parts: Vec<Layers>,
    f: impl Fn(usize, Layers, Arc<dyn Transport>) -> R + Sync,
) -> Vec<R> {
    let transports = LocalTransport::create(parts.len());
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = parts
            .into_iter()
            .zip(transports)
            .enumerate()
            .map(|(rank, (layers, t))| {
                scope.spawn(move || f(rank, layers, Arc::new(t) as Arc<dyn Transport>))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn width_in() -> usize {
    5
}

/// Linear, ReLU, a skip around two Linears (crossing whatever partitions), Linear.
fn skip_model() -> Layers {
    vec![
        Box::new(Linear::new(5, 6, 21)),
        Box::new(StashInput::new("around")),
        Box::new(ReLU),
        Box::new(Linear::new(6, 6, 22)),
        Box::new(Linear::new(6, 6, 23)),
        Box::new(AddSkip::new("around")),
        Box::new(Linear::new(6, 3, 24)),
    ]
}

fn one_process(model: fn() -> Layers, balance: &[usize], s: Setup) -> Outcome {
    let mut pipe = configure(Pipe::builder(model(), balance), s)
        .build()
        .unwrap();
    let (output, input_grad, losses, evaluated) = train(&mut pipe, s, true, true);
    Outcome {
        output: output.into_single().unwrap(),
        input_grad: input_grad.into_single().unwrap(),
        losses,
        grads: grads(&pipe.into_layers()),
        evaluated: evaluated.into_single().unwrap(),
    }
}

/// The same pipe with partition `j` on rank `stage_ranks[j]` of `ranks` threads, each
/// building only its own layers (split off one model, so namespaces match).
fn on_ranks(
    model: fn() -> Layers,
    balance: &[usize],
    stage_ranks: &[usize],
    ranks: usize,
    s: Setup,
) -> Outcome {
    let mut all = model().into_iter();
    let mut mine: Vec<Layers> = (0..ranks).map(|_| Vec::new()).collect();
    for (j, &size) in balance.iter().enumerate() {
        mine[stage_ranks[j]].extend(all.by_ref().take(size));
    }
    let n = balance.len();
    let transports = LocalTransport::create(ranks);
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = mine
            .into_iter()
            .zip(transports)
            .enumerate()
            .map(|(rank, (layers, transport))| {
                scope.spawn(move || {
                    let transport: Arc<dyn Transport> = Arc::new(transport);
                    let mut pipe = configure(Pipe::builder(layers, balance), s)
                        .on_ranks(transport, stage_ranks)
                        .build()
                        .unwrap();
                    let first = stage_ranks[0] == rank;
                    let last = stage_ranks[n - 1] == rank;
                    let out = train(&mut pipe, s, first, last);
                    (out, grads(&pipe.into_layers()))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (first, last) = (stage_ranks[0], stage_ranks[n - 1]);
    // Each rank's layers are its partitions' in stage order; put them back in model order.
    let mut per_rank: Vec<std::vec::IntoIter<CpuTensor>> =
        results.iter().map(|(_, g)| g.clone().into_iter()).collect();
    let mut grads = Vec::new();
    for (j, _) in balance.iter().enumerate() {
        let r = stage_ranks[j];
        let layers = model();
        let start: usize = balance[..j].iter().sum();
        let count: usize = grads_len(&layers[start..start + balance[j]]);
        grads.extend(per_rank[r].by_ref().take(count));
    }
    for (rank, ((output, input_grad, losses, evaluated), _)) in results.iter().enumerate() {
        if rank != last {
            assert!(
                output.is_empty() && losses.is_empty() && evaluated.is_empty(),
                "rank {rank} holds no output"
            );
        }
        if rank != first {
            assert!(input_grad.is_empty(), "rank {rank} holds no input gradient");
        }
    }
    let take = |b: &Batch<CpuTensor>| b.clone().into_single().unwrap();
    Outcome {
        output: take(&results[last].0 .0),
        input_grad: take(&results[first].0 .1),
        losses: results[last].0 .2.clone(),
        grads,
        evaluated: take(&results[last].0 .3),
    }
}

/// How many gradient tensors `grads` returns for these layers.
fn grads_len(layers: &[Box<dyn Layer<CpuTensor>>]) -> usize {
    grads(layers).len()
}

fn check(model: fn() -> Layers, balance: &[usize], stage_ranks: &[usize], ranks: usize, s: Setup) {
    let want = one_process(model, balance, s);
    let got = on_ranks(model, balance, stage_ranks, ranks, s);
    assert_eq!(
        got, want,
        "balance {balance:?} on ranks {stage_ranks:?}, {:?} {:?}",
        s.drive, s.mode
    );
}

const DRIVES: [Drive; 3] = [
    Drive::Step(ScheduleKind::GPipe),
    Drive::Step(ScheduleKind::OneFOneB),
    Drive::Split,
];
const MODES: [Checkpoint; 3] = [
    Checkpoint::Always,
    Checkpoint::ExceptLast,
    Checkpoint::Never,
];

#[test]
fn two_ranks_are_bit_identical_to_one_process() {
    for drive in DRIVES {
        for mode in MODES {
            for defer in [false, true] {
                // 11 samples in 4 micro-batches: sizes 3, 3, 3, 2.
                let s = Setup {
                    chunks: 4,
                    mode,
                    drive,
                    defer,
                    batch: 11,
                };
                check(plain_model, &[2, 2], &[0, 1], 2, s);
                check(bn_model, &[1, 3], &[0, 1], 2, s);
            }
        }
    }
}

#[test]
fn four_ranks_are_bit_identical_to_one_process() {
    for drive in DRIVES {
        for mode in MODES {
            let s = Setup {
                chunks: 5,
                mode,
                drive,
                defer: false,
                batch: 13,
            };
            check(plain_model, &[1, 1, 1, 1], &[0, 1, 2, 3], 4, s);
            check(bn_model, &[1, 1, 1, 1], &[0, 1, 2, 3], 4, s);
        }
    }
}

#[test]
fn skips_across_ranks_are_bit_identical() {
    for drive in DRIVES {
        for mode in MODES {
            let s = Setup {
                chunks: 3,
                mode,
                drive,
                defer: false,
                batch: 7,
            };
            // The skip leaves rank 0 and lands on rank 1; then on rank 2 past rank 1.
            check(skip_model, &[2, 3, 2], &[0, 1, 1], 2, s);
            check(skip_model, &[2, 2, 3], &[0, 1, 2], 3, s);
        }
    }
}

#[test]
fn several_stages_on_one_rank_and_stages_out_of_rank_order() {
    let s = Setup {
        chunks: 3,
        mode: Checkpoint::ExceptLast,
        drive: Drive::Step(ScheduleKind::OneFOneB),
        defer: false,
        batch: 9,
    };
    check(plain_model, &[1, 1, 1, 1], &[1, 1, 0, 0], 2, s);
    check(plain_model, &[1, 1, 1, 1], &[2, 0, 1, 0], 3, s);
}

#[test]
fn shapes_may_change_between_steps() {
    let balance = [2, 2];
    let mut all = plain_model().into_iter();
    let parts: Vec<Layers> = vec![all.by_ref().take(2).collect(), all.collect()];
    let mut reference = Pipe::builder(plain_model(), &balance)
        .chunks(3)
        .seed(SEED)
        .build()
        .unwrap();
    let want: Vec<CpuTensor> = [7usize, 12, 1]
        .iter()
        .map(|&b| {
            let target = data(b, 3, 8);
            reference
                .step(Batch::single(data(b, 5, 7)), |mb, out| {
                    mse(&target, mb, out)
                })
                .unwrap()
                .output
                .into_single()
                .unwrap()
        })
        .collect();
    let got = per_rank(parts, |rank, layers, t| {
        let mut pipe = Pipe::builder(layers, &balance)
            .chunks(3)
            .seed(SEED)
            .stages_on_ranks(t)
            .build()
            .unwrap();
        [7usize, 12, 1]
            .iter()
            .map(|&b| {
                let target = data(b, 3, 8);
                let input = if rank == 0 {
                    Batch::single(data(b, 5, 7))
                } else {
                    Batch::new(Vec::new())
                };
                pipe.step(input, |mb, out| mse(&target, mb, out))
                    .unwrap()
                    .output
            })
            .collect::<Vec<_>>()
    });
    let outputs: Vec<CpuTensor> = got[1]
        .iter()
        .map(|b| b.clone().into_single().unwrap())
        .collect();
    assert_eq!(outputs, want);
}

/// A layer that fails (or panics) in the forward pass of one micro-batch.
struct Faulty {
    mb: usize,
    panic: bool,
}

impl Layer<CpuTensor> for Faulty {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut pipe::Context,
    ) -> Result<(Batch<CpuTensor>, pipe::Saved<CpuTensor>), Error> {
        if ctx.micro_batch().index == self.mb {
            if self.panic {
                panic!("faulty layer");
            }
            return Err(Error::custom("faulty layer"));
        }
        Ok((input, pipe::Saved::none()))
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: pipe::Saved<CpuTensor>,
        _ctx: &mut pipe::Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        Ok(grad)
    }

    fn name(&self) -> &str {
        "Faulty"
    }
}

#[test]
fn a_failure_on_one_rank_reaches_every_rank_naming_where() {
    for panic in [false, true] {
        let balance = [1, 2, 1];
        let parts: Vec<Layers> = vec![
            vec![Box::new(Linear::new(5, 5, 1))],
            vec![Box::new(ReLU), Box::new(Faulty { mb: 2, panic })],
            vec![Box::new(Linear::new(5, 3, 2))],
        ];
        let start = Instant::now();
        let errors = per_rank(parts, |rank, layers, t| {
            let mut pipe = Pipe::builder(layers, &balance)
                .chunks(4)
                .timeout(Duration::from_secs(20))
                .stages_on_ranks(t)
                .build()
                .unwrap();
            let target = data(8, 3, 8);
            let input = if rank == 0 {
                Batch::single(data(8, 5, 7))
            } else {
                Batch::new(Vec::new())
            };
            let err = pipe
                .step(input, |mb, out| mse(&target, mb, out))
                .unwrap_err();
            // The pipe is usable again on every rank (the streams stayed aligned),
            // unless the failure was a panic, which poisons the pipe that had it.
            pipe.clear_poison();
            pipe.eval();
            let input = if rank == 0 {
                Batch::single(data(8, 5, 7))
            } else {
                Batch::new(Vec::new())
            };
            let again = pipe.forward(input);
            (err, again.is_err())
        });
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "no rank waited for its timeout"
        );
        for (rank, (err, again_failed)) in errors.iter().enumerate() {
            let site = match err {
                Error::Remote { rank: 1, site, .. } => site.clone(),
                Error::Failed { site, .. } | Error::Panicked { site, .. } if rank == 1 => {
                    Some(site.clone())
                }
                other => panic!("rank {rank}: {other}"),
            };
            let site = site.expect("a site");
            assert_eq!(
                (site.partition, site.micro_batch),
                (1, Some(2)),
                "rank {rank}: {err}"
            );
            assert_eq!(
                site.layer.as_ref().map(|l| l.0),
                Some(2),
                "rank {rank}: {err}"
            );
            // Evaluation after the failure: mb 2 of 4 fails again in Faulty (eval mode runs it too).
            assert!(
                again_failed,
                "rank {rank}: the faulty layer fails evaluation too"
            );
        }
    }
}

#[test]
fn ranks_that_disagree_fail_instead_of_hanging() {
    let balance = [2, 2];
    // Settings differ: chunks.
    let mut all = plain_model().into_iter();
    let parts: Vec<Layers> = vec![all.by_ref().take(2).collect(), all.collect()];
    let built = per_rank(parts, |rank, layers, t| {
        Pipe::builder(layers, &balance)
            .chunks(2 + rank)
            .timeout(Duration::from_secs(10))
            .stages_on_ranks(t)
            .build()
            .err()
    });
    for e in built {
        assert!(matches!(e, Some(Error::RankMismatch { .. })), "{e:?}");
    }

    // Runs differ: rank 0 steps while rank 1 evaluates.
    let mut all = plain_model().into_iter();
    let parts: Vec<Layers> = vec![all.by_ref().take(2).collect(), all.collect()];
    let start = Instant::now();
    let ran = per_rank(parts, |rank, layers, t| {
        let mut pipe = Pipe::builder(layers, &balance)
            .chunks(2)
            .timeout(Duration::from_secs(20))
            .stages_on_ranks(t)
            .build()
            .unwrap();
        let target = data(4, 3, 8);
        if rank == 0 {
            pipe.step(Batch::single(data(4, 5, 7)), |mb, out| {
                mse(&target, mb, out)
            })
            .err()
        } else {
            pipe.eval();
            pipe.forward(Batch::new(Vec::new())).err()
        }
    });
    assert!(start.elapsed() < Duration::from_secs(15));
    assert!(
        matches!(&ran[1], Some(Error::RankMismatch { .. })),
        "{:?}",
        ran[1]
    );
    assert!(
        matches!(&ran[0], Some(Error::Remote { rank: 1, .. })),
        "{:?}",
        ran[0]
    );
}

#[test]
fn deferred_batch_norm_and_the_gradients_final_callback_work_on_ranks() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let balance = [1, 3];
    let s = Setup {
        chunks: 3,
        mode: Checkpoint::ExceptLast,
        drive: Drive::Step(ScheduleKind::OneFOneB),
        defer: true,
        batch: 10,
    };
    // One process: deferred batch norm, then evaluation (which uses the running stats).
    let mut one = configure(Pipe::builder(bn_model(), &balance), s)
        .deferred_batch_norm(true)
        .build()
        .unwrap();
    let (_, _, _, want) = train(&mut one, s, true, true);
    let mut all = bn_model().into_iter();
    let parts: Vec<Layers> = vec![all.by_ref().take(1).collect(), all.collect()];
    let got = per_rank(parts, |rank, layers, t| {
        let mut pipe = configure(Pipe::builder(layers, &balance), s)
            .deferred_batch_norm(true)
            .record(true)
            .stages_on_ranks(t)
            .build()
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        pipe.on_gradients_final(move |stage, layers| {
            assert_eq!(stage, rank, "only this rank's stage reports");
            assert!(!layers.is_empty());
            seen.fetch_add(1, Ordering::Relaxed);
        });
        let (_, _, _, evaluated) = train(&mut pipe, s, rank == 0, rank == 1);
        // Spans were recorded for this rank's stage only.
        let record = pipe.take_record().unwrap();
        let spans: usize = record.workers().iter().map(Vec::len).sum();
        assert!(spans > 0);
        (evaluated, calls.load(Ordering::Relaxed))
    });
    assert_eq!(got[0].1, 1);
    assert_eq!(got[1].1, 1);
    assert_eq!(got[1].0, want);
}
