//! Every schedule kind runs through the one executor: on 4 stages (on 4, or on 2 workers
//! with 2 stages each), for several micro-batch counts, every checkpoint mode and a model
//! with a skip that crosses stages, outputs are bit-identical to GPipe's and every
//! gradient agrees with GPipe's within 1e-6 relative (the order of additions is the
//! schedule's own); the same schedule with its stages on thread ranks is bit-identical to
//! it in one process; names parse both ways; placements put each worker's stages
//! together.

mod common;

use std::sync::Arc;

use common::*;
use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::{AddSkip, Batch, Checkpoint, LocalTransport, Pipe, ScheduleKind, StashInput, Transport};

const KINDS: [ScheduleKind; 8] = ScheduleKind::ALL;

/// Four stages: Linear | Stash, Linear | ReLU, Linear | Add, Linear.
fn model() -> Layers {
    vec![
        Box::new(Linear::new(5, 6, 31)),
        Box::new(StashInput::new("skip")),
        Box::new(Linear::new(6, 6, 32)),
        Box::new(ReLU),
        Box::new(Linear::new(6, 6, 33)),
        Box::new(AddSkip::new("skip")),
        Box::new(Linear::new(6, 3, 34)),
    ]
}
const BALANCE: [usize; 4] = [1, 2, 2, 2];

struct Out {
    output: CpuTensor,
    input_grad: CpuTensor,
    grads: Vec<CpuTensor>,
}

fn step(kind: ScheduleKind, batch: usize, chunks: usize, mode: Checkpoint) -> Out {
    let mut pipe = Pipe::builder(model(), &BALANCE)
        .chunks(chunks)
        .checkpoint(mode)
        .schedule(kind)
        .seed(SEED)
        .build()
        .unwrap();
    let target = data(batch, 3, 8);
    let out = pipe
        .step(Batch::single(data(batch, 5, 7)), |mb, y| {
            mse(&target, mb, y)
        })
        .unwrap_or_else(|e| panic!("{kind}: {e}"));
    assert!(
        pipe.memory().iter().all(|m| m.deferred == 0),
        "{kind}: every W ran"
    );
    Out {
        output: out.output.into_single().unwrap(),
        input_grad: out.input_grad.into_single().unwrap(),
        grads: grads(&pipe.into_layers()),
    }
}

#[test]
fn every_schedule_computes_what_gpipe_computes() {
    for (batch, chunks) in [(8, 4), (13, 8), (16, 16)] {
        for mode in [
            Checkpoint::Always,
            Checkpoint::ExceptLast,
            Checkpoint::Never,
        ] {
            let want = step(ScheduleKind::GPipe, batch, chunks, mode);
            for kind in KINDS {
                let m = chunks.min(batch);
                if kind == ScheduleKind::DualPipeV && m < 4 {
                    continue;
                }
                let got = step(kind, batch, chunks, mode);
                assert_eq!(got.output, want.output, "{kind}, m {m}, {mode:?}: outputs");
                let close = |a: &CpuTensor, b: &CpuTensor| relative(a, b) <= 1e-6;
                assert!(
                    close(&got.input_grad, &want.input_grad),
                    "{kind}, m {m}: input gradient"
                );
                for (g, w) in got.grads.iter().zip(&want.grads) {
                    assert!(close(g, w), "{kind}, m {m}, {mode:?}: a parameter gradient");
                }
            }
        }
    }
}

#[test]
fn a_v_schedule_on_thread_ranks_is_bit_identical_to_one_process() {
    for kind in [
        ScheduleKind::Zbv,
        ScheduleKind::Interleaved1F1B {
            stages_per_worker: 2,
        },
    ] {
        let (batch, chunks) = (9, 4);
        let want = step(kind, batch, chunks, Checkpoint::ExceptLast);
        let placement = kind.placement(4).unwrap();
        let mut parts: Vec<Layers> = vec![Vec::new(), Vec::new()];
        let mut all = model().into_iter();
        for (j, &size) in BALANCE.iter().enumerate() {
            parts[placement[j]].extend(all.by_ref().take(size));
        }
        let transports = LocalTransport::create(2);
        let placement = &placement;
        let results: Vec<(Batch<CpuTensor>, Batch<CpuTensor>, Vec<CpuTensor>)> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = parts
                    .into_iter()
                    .zip(transports)
                    .enumerate()
                    .map(|(rank, (layers, t))| {
                        scope.spawn(move || {
                            let mut pipe = Pipe::builder(layers, &BALANCE)
                                .chunks(chunks)
                                .checkpoint(Checkpoint::ExceptLast)
                                .schedule(kind)
                                .seed(SEED)
                                .on_ranks(Arc::new(t) as Arc<dyn Transport>, placement)
                                .build()
                                .unwrap();
                            let target = data(batch, 3, 8);
                            let input = if rank == placement[0] {
                                Batch::single(data(batch, 5, 7))
                            } else {
                                Batch::new(Vec::new())
                            };
                            let out = pipe.step(input, |mb, y| mse(&target, mb, y)).unwrap();
                            (out.output, out.input_grad, grads(&pipe.into_layers()))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
        let (first, last) = (placement[0], placement[3]);
        assert_eq!(
            results[last].0.clone().into_single().unwrap(),
            want.output,
            "{kind}"
        );
        assert_eq!(
            results[first].1.clone().into_single().unwrap(),
            want.input_grad,
            "{kind}"
        );
        // Each rank's gradients are its stages' layers' in stage order; the model's order
        // per stage is the same, so gather stage by stage.
        let layer_grads: Vec<usize> = {
            let layers = model();
            let mut at = 0;
            BALANCE
                .iter()
                .map(|&size| {
                    let n = grads(&layers[at..at + size]).len();
                    at += size;
                    n
                })
                .collect()
        };
        let mut per_rank: Vec<std::vec::IntoIter<CpuTensor>> =
            results.iter().map(|r| r.2.clone().into_iter()).collect();
        let mut got = Vec::new();
        for (j, &count) in layer_grads.iter().enumerate() {
            got.extend(per_rank[placement[j]].by_ref().take(count));
        }
        assert_eq!(got, want.grads, "{kind}: gradients");
    }
}

#[test]
fn names_parse_both_ways_and_placements_group_each_worker() {
    for kind in KINDS {
        let again: ScheduleKind = kind.to_string().parse().unwrap();
        assert_eq!(again, kind);
        let placement = kind.placement(4).unwrap();
        let schedule = kind.generate(8, 4).unwrap();
        for (s, &r) in placement.iter().enumerate() {
            assert_eq!(schedule.worker_of(s), Some(r), "{kind}: stage {s}");
        }
    }
    for (name, kind) in [
        (
            "Interleaved1F1B",
            ScheduleKind::Interleaved1F1B {
                stages_per_worker: 2,
            },
        ),
        ("ZBVZeroBubble", ScheduleKind::Zbv),
        ("dualpipev", ScheduleKind::DualPipeV),
        (
            "looped_bfs:4",
            ScheduleKind::LoopedBfs {
                stages_per_worker: 4,
            },
        ),
    ] {
        assert_eq!(name.parse::<ScheduleKind>().unwrap(), kind);
    }
    assert!("zbv:3".parse::<ScheduleKind>().is_err());
    assert!("interleaved_1f1b:0".parse::<ScheduleKind>().is_err());
    assert!(matches!(
        ScheduleKind::Zbv.generate(8, 3),
        Err(pipe::Error::ScheduleShape { .. })
    ));
}

/// The unpipelined reference of a schedule: `plain_model` one layer per stage, every
/// forward in micro-batch order, then stage by stage from the last, each stage's
/// backwards in the order its weight gradients are added under `schedule` (its B and W
/// actions; an I adds none).
fn reference_in_schedule_order(
    schedule: &pipe::Schedule,
    x: &CpuTensor,
    target: &CpuTensor,
    plan: &[pipe::MicroBatch],
) -> (Vec<CpuTensor>, Vec<CpuTensor>, Vec<CpuTensor>) {
    use pipe::{Context, Pass, Phase};
    let mut layers = plain_model();
    let n = layers.len();
    let mut saved: Vec<Vec<Option<pipe::Saved<CpuTensor>>>> = Vec::new();
    let mut outputs = Vec::new();
    for &mb in plan {
        let mut b = Batch::single(rows(x, mb));
        let mut states = Vec::new();
        for (l, layer) in layers.iter_mut().enumerate() {
            let mut ctx = Context::new(true, SEED, 0, mb.len)
                .with_layer(l)
                .with_micro_batch(mb);
            let (y, s) = layer.forward(b, &mut ctx).unwrap();
            states.push(Some(s));
            b = y;
        }
        outputs.push(b.into_single().unwrap());
        saved.push(states);
    }
    // grads[mb]: the gradient flowing into the stage being processed.
    let mut flowing: Vec<Option<Batch<CpuTensor>>> = plan
        .iter()
        .map(|&mb| {
            Some(
                mse(target, mb, &Batch::single(outputs[mb.index].clone()))
                    .unwrap()
                    .1,
            )
        })
        .collect();
    for stage in (0..n).rev() {
        let w = schedule.worker_of(stage).unwrap();
        let order: Vec<usize> = schedule.workers()[w]
            .iter()
            .filter(|a| a.stage == stage && matches!(a.pass, Pass::Backward | Pass::WeightGrad))
            .map(|a| a.micro_batch)
            .collect();
        for i in order {
            let mb = plan[i];
            let mut ctx = Context::new(true, SEED, 0, mb.len)
                .with_layer(stage)
                .with_micro_batch(mb)
                .with_phase(Phase::Backward);
            let g = flowing[i].take().unwrap();
            let s = saved[i][stage].take().unwrap();
            flowing[i] = Some(layers[stage].backward(g, s, &mut ctx).unwrap());
        }
    }
    let input_grads = flowing
        .into_iter()
        .map(|g| g.unwrap().into_single().unwrap())
        .collect();
    (outputs, input_grads, grads(&layers))
}

#[test]
fn every_schedule_is_bit_identical_to_the_unpipelined_model_in_its_own_order() {
    let balance = [1, 1, 1, 1];
    for (batch, chunks) in [(8, 4), (11, 8)] {
        for mode in [Checkpoint::Always, Checkpoint::Never] {
            for kind in KINDS {
                let Ok(schedule) = kind.generate(chunks.min(batch), 4) else {
                    continue;
                };
                let (x, target) = (data(batch, 5, 7), data(batch, 3, 8));
                let mut pipe = Pipe::builder(plain_model(), &balance)
                    .chunks(chunks)
                    .checkpoint(mode)
                    .schedule(kind)
                    .seed(SEED)
                    .build()
                    .unwrap();
                let plan = pipe.micro_batches(batch).unwrap();
                let out = pipe
                    .step(Batch::single(x.clone()), |mb, y| mse(&target, mb, y))
                    .unwrap();
                let (outputs, input_grads, want) =
                    reference_in_schedule_order(&schedule, &x, &target, &plan);
                assert_eq!(
                    out.output.into_single().unwrap(),
                    cat(&outputs),
                    "{kind}: outputs"
                );
                assert_eq!(
                    out.input_grad.into_single().unwrap(),
                    cat(&input_grads),
                    "{kind}: input gradients"
                );
                assert_eq!(
                    grads(&pipe.into_layers()),
                    want,
                    "{kind}, m {}, {mode:?}",
                    plan.len()
                );
            }
        }
    }
}

#[test]
fn a_schedule_written_in_pytorchs_csv_runs() {
    // The 1F1B example of PyTorch's `_dump_csv` (2 ranks, 4 micro-batches, a leading bubble
    // on rank 1), as a user would load it.
    let csv = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\r\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\r\n";
    let schedule = pipe::Order::from_csv(csv).unwrap().to_schedule().unwrap();
    let run = |schedule: &pipe::Schedule| {
        let mut pipe = Pipe::builder(plain_model(), &[2, 2])
            .chunks(4)
            .seed(SEED)
            .build()
            .unwrap();
        let target = data(8, 3, 8);
        let out = pipe
            .step_with(schedule, Batch::single(data(8, 5, 7)), |mb, y| {
                mse(&target, mb, y)
            })
            .unwrap();
        (out.output, grads(&pipe.into_layers()))
    };
    assert_eq!(
        run(&schedule),
        run(&pipe::Schedule::one_f_one_b(4, 2).unwrap())
    );
    // And ours out in the same format, back in, to the same lists.
    let zbv = pipe::zbv(4, 2).unwrap();
    let again = pipe::Order::from_csv(&zbv.to_csv()).unwrap();
    assert_eq!(again.to_schedule().unwrap(), zbv.to_schedule().unwrap());
}

#[test]
fn memory_held_per_stage_stays_within_each_schedules_bound() {
    // In micro-batches held between a stage's forward and the end of its backward (an I
    // keeps its state for the W), following each worker's list.
    let (m, n) = (8, 4);
    for j in 0..n {
        // 1F1B: n − j on stage j; GPipe: all m.
        assert_eq!(
            ScheduleKind::OneFOneB
                .generate(m, n)
                .unwrap()
                .max_in_flight(j),
            n - j
        );
        assert_eq!(
            ScheduleKind::GPipe.generate(m, n).unwrap().max_in_flight(j),
            m
        );
    }
    // Zero bubble (PyTorch's ZB1P with one stage per rank): stage r runs n − 1 − r
    // warm-up forwards and puts off each W by r actions, so it holds (n − 1 − r) + 1 + r:
    // n micro-batches on every stage (1F1B's stage 0 figure everywhere).
    for n in [2, 4] {
        let zb = ScheduleKind::ZeroBubble.generate(m, n).unwrap();
        for j in 0..n {
            assert_eq!(zb.max_in_flight(j), n, "zb stage {j}");
        }
    }
    // Interleaved 1F1B on w workers with v stages each holds, per stage, at most its
    // warm-up: (v − 1)·w + 2(w − 1 − r) + 1 forwards before the first backward frees one.
    let (w, v) = (2, 2);
    let kind = ScheduleKind::Interleaved1F1B {
        stages_per_worker: v,
    };
    let s = kind.generate(m, w * v).unwrap();
    for stage in 0..w * v {
        let r = stage % w;
        let bound = (v - 1) * w + 2 * (w - 1 - r) + 1;
        assert!(
            s.max_in_flight(stage) <= bound,
            "stage {stage}: {} > {bound}",
            s.max_in_flight(stage)
        );
    }
}
