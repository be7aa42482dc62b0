//! Skip connections through the pipe (§7 rows 28-30): torchgpipe's `1to3` and a U-Net-like
//! stack with nested skips, for several balances, every checkpoint mode, GPipe, 1F1B and a
//! split forward/backward:
//!
//! - outputs and every gradient bit-identical to the same model with its residual adds
//!   written out, run unpipelined in one thread over the same micro-batches, gradients
//!   accumulated in the schedule's backward order;
//! - each skip that crosses partitions moves once per micro-batch each way, straight from
//!   the stashing partition to the popping one (counted), and recomputation moves nothing;
//! - no skip value or gradient is held after a step (bytes counted through the tensor
//!   trait), and under checkpointing the popping partition holds the value exactly until
//!   its recomputation (torchgpipe's tensor life);
//! - stashing nothing works; mismatched declarations fail when the pipe is built.

mod common;

use std::collections::HashMap;

use common::*;
use pipe::cpu::{CpuTensor, Dropout, Linear, ReLU};
use pipe::skip::{Declaration, Moves, Namespace};
use pipe::{
    AddSkip, Batch, Checkpoint, Context, Error, Layer, MicroBatch, Pass, Phase, Pipe, Saved,
    Schedule, ScheduleKind, StashInput, Tensor,
};

const BATCH: usize = 7;
const CHUNKS: usize = 3;
const MODES: [Checkpoint; 3] = [
    Checkpoint::Always,
    Checkpoint::ExceptLast,
    Checkpoint::Never,
];

/// One element of a model: a layer, or the two ends of a skip.
enum Op {
    Layer(Box<dyn Layer<CpuTensor>>),
    Stash(&'static str, Namespace),
    Add(&'static str, Namespace),
}

/// The model as pipe layers: the ends of each skip become [`StashInput`] and [`AddSkip`].
fn layers(ops: Vec<Op>) -> Layers {
    ops.into_iter()
        .map(|op| -> Box<dyn Layer<CpuTensor>> {
            match op {
                Op::Layer(layer) => layer,
                Op::Stash(name, ns) => Box::new(StashInput::new(name).isolate(ns)),
                Op::Add(name, ns) => Box::new(AddSkip::new(name).isolate(ns)),
            }
        })
        .collect()
}

/// torchgpipe's `1to3`: the first layer stashes its input, three linear layers, the last
/// adds the stash to its output. Input width 4.
fn one_to_three() -> Vec<Op> {
    let ns = Namespace::DEFAULT;
    vec![
        Op::Stash("1to3", ns),
        Op::Layer(Box::new(Linear::new(4, 4, 11))),
        Op::Layer(Box::new(Linear::new(4, 4, 12))),
        Op::Layer(Box::new(Linear::new(4, 4, 13))),
        Op::Add("1to3", ns),
    ]
}

/// A U-Net-like stack: two nested skips with the same name in two namespaces (an
/// encoder/decoder pair each), dropout inside. Input width 4, output width 3.
fn unet() -> Vec<Op> {
    let (outer, inner) = (Namespace::new(), Namespace::new());
    vec![
        Op::Layer(Box::new(Linear::new(4, 6, 21))),
        Op::Stash("skip", outer),
        Op::Layer(Box::new(Linear::new(6, 6, 22))),
        Op::Layer(Box::new(ReLU)),
        Op::Stash("skip", inner),
        Op::Layer(Box::new(Linear::new(6, 6, 23))),
        Op::Layer(Box::new(Dropout::new(0.25).unwrap())),
        Op::Add("skip", inner),
        Op::Layer(Box::new(Linear::new(6, 6, 24))),
        Op::Add("skip", outer),
        Op::Layer(Box::new(Linear::new(6, 3, 25))),
    ]
}

struct Model {
    build: fn() -> Vec<Op>,
    out: usize,
    balances: &'static [&'static [usize]],
}

const ONE_TO_THREE: Model = Model {
    build: one_to_three,
    out: 4,
    balances: &[&[5], &[2, 3], &[3, 2], &[2, 1, 2], &[1, 1, 1, 1, 1]],
};

const UNET: Model = Model {
    build: unet,
    out: 3,
    balances: &[&[11], &[6, 5], &[2, 3, 3, 3], &[3, 2, 4, 2], &[1; 11]],
};

#[derive(Debug, Clone, Copy)]
enum Drive {
    Step(ScheduleKind),
    Split,
}

const DRIVES: [Drive; 3] = [
    Drive::Step(ScheduleKind::GPipe),
    Drive::Step(ScheduleKind::OneFOneB),
    Drive::Split,
];

/// What a run produces, pipelined or not.
#[derive(Debug, PartialEq)]
struct Results {
    output: CpuTensor,
    input_grad: CpuTensor,
    grads: Vec<CpuTensor>,
}

type Key = (Namespace, &'static str);

/// The model with its residual adds written out, unpipelined, one thread, over the
/// micro-batches of `plan`: forwards in micro-batch order, backwards in `order`. Each
/// global layer index (skip ends included) keys the same random stream as in the pipe.
fn explicit(
    ops: &mut [Op],
    x: &CpuTensor,
    target: &CpuTensor,
    plan: &[MicroBatch],
    order: &[usize],
) -> Results {
    let mut outputs = Vec::new();
    let mut saved: Vec<Vec<Option<Saved<CpuTensor>>>> = Vec::new();
    for &mb in plan {
        let mut h = rows(x, mb);
        let mut stashed: HashMap<Key, CpuTensor> = HashMap::new();
        let mut states = Vec::new();
        for (l, op) in ops.iter_mut().enumerate() {
            let mut state = None;
            match op {
                Op::Layer(layer) => {
                    let mut ctx = Context::new(true, SEED, 0, mb.len)
                        .with_layer(l)
                        .with_micro_batch(mb)
                        .with_micro_batches(plan.len());
                    let (y, s) = layer.forward(Batch::single(h), &mut ctx).unwrap();
                    h = y.into_single().unwrap();
                    state = Some(s);
                }
                Op::Stash(name, ns) => {
                    stashed.insert((*ns, *name), h.clone());
                }
                Op::Add(name, ns) => h
                    .accumulate(&stashed.remove(&(*ns, *name)).unwrap())
                    .unwrap(),
            }
            states.push(state);
        }
        outputs.push(h);
        saved.push(states);
    }
    let mut input_grads: Vec<Option<CpuTensor>> = vec![None; plan.len()];
    for &i in order {
        let mb = plan[i];
        let (_, g) = mse(target, mb, &Batch::single(outputs[i].clone())).unwrap();
        let mut g = g.into_single().unwrap();
        let mut skip_grads: HashMap<Key, CpuTensor> = HashMap::new();
        for (l, op) in ops.iter_mut().enumerate().rev() {
            match op {
                Op::Layer(layer) => {
                    let mut ctx = Context::new(true, SEED, 0, mb.len)
                        .with_layer(l)
                        .with_micro_batch(mb)
                        .with_phase(Phase::Backward);
                    let state = saved[i][l].take().unwrap();
                    g = layer
                        .backward(Batch::single(g), state, &mut ctx)
                        .unwrap()
                        .into_single()
                        .unwrap();
                }
                Op::Add(name, ns) => {
                    skip_grads.insert((*ns, *name), g.clone());
                }
                Op::Stash(name, ns) => g
                    .accumulate(&skip_grads.remove(&(*ns, *name)).unwrap())
                    .unwrap(),
            }
        }
        input_grads[i] = Some(g);
    }
    let grads = ops
        .iter()
        .filter_map(|op| match op {
            Op::Layer(layer) => Some(layer.parameters().into_iter().map(|p| p.grad.clone())),
            _ => None,
        })
        .flatten()
        .collect();
    Results {
        output: cat(&outputs),
        input_grad: cat(&input_grads
            .into_iter()
            .map(Option::unwrap)
            .collect::<Vec<_>>()),
        grads,
    }
}

fn pipe_for(model: &Model, balance: &[usize], mode: Checkpoint) -> Pipe<CpuTensor> {
    Pipe::builder(layers((model.build)()), balance)
        .chunks(CHUNKS)
        .checkpoint(mode)
        .seed(SEED)
        .build()
        .unwrap()
}

/// Runs the pipe; returns its results and the backward order of its schedule.
fn pipelined(pipe: &mut Pipe<CpuTensor>, model: &Model, drive: Drive) -> (Results, Vec<usize>) {
    let (x, target) = (data(BATCH, 4, 7), data(BATCH, model.out, 8));
    let n = pipe.partitions().len();
    let m = pipe.micro_batches(BATCH).unwrap().len();
    let (output, input_grad, schedule) = match drive {
        Drive::Step(kind) => {
            let schedule = kind.generate(m, n).unwrap();
            let out = pipe
                .step_with(&schedule, Batch::single(x), |mb, y| mse(&target, mb, y))
                .unwrap();
            (out.output, out.input_grad, schedule)
        }
        Drive::Split => {
            let output = pipe.forward(Batch::single(x)).unwrap();
            let whole = MicroBatch {
                index: 0,
                offset: 0,
                len: BATCH,
            };
            let (_, g) = mse(&target, whole, &output).unwrap();
            let input_grad = pipe.backward(g).unwrap();
            (output, input_grad, Schedule::gpipe(m, n).unwrap())
        }
    };
    let grads = pipe
        .partitions()
        .iter()
        .flatten()
        .flat_map(|l| l.parameters().into_iter().map(|p| p.grad.clone()))
        .collect();
    let order = schedule.workers()[0]
        .iter()
        .filter(|a| a.pass == Pass::Backward)
        .map(|a| a.micro_batch)
        .collect();
    let results = Results {
        output: output.into_single().unwrap(),
        input_grad: input_grad.into_single().unwrap(),
        grads,
    };
    (results, order)
}

/// Skips crossing partitions under `balance`, from the layer declarations.
fn crossing(model: &Model, balance: &[usize]) -> usize {
    let decls: Vec<Declaration> = layers((model.build)()).iter().map(|l| l.skips()).collect();
    let layout = pipe::skip::SkipLayout::new(&decls, balance).unwrap();
    layout.routes().filter(|r| r.requires_copy()).count()
}

fn check_model(model: &Model) {
    for &balance in model.balances {
        let crossing = crossing(model, balance);
        for mode in MODES {
            for drive in DRIVES {
                let case = format!("balance {balance:?}, {mode}, {drive:?}");
                let mut pipe = pipe_for(model, balance, mode);
                let (got, order) = pipelined(&mut pipe, model, drive);
                let plan = MicroBatch::plan(BATCH, CHUNKS).unwrap();
                let mut ops = (model.build)();
                let want = explicit(
                    &mut ops,
                    &data(BATCH, 4, 7),
                    &data(BATCH, model.out, 8),
                    &plan,
                    &order,
                );
                assert_eq!(got.output, want.output, "output, {case}");
                assert_eq!(got.input_grad, want.input_grad, "input gradient, {case}");
                assert_eq!(got.grads.len(), want.grads.len());
                for (k, (a, b)) in got.grads.iter().zip(&want.grads).enumerate() {
                    assert_eq!(a, b, "parameter gradient {k}, {case}");
                }
                // Once per micro-batch each way; every checkpointed micro-batch drops one
                // recomputed stash per crossing skip instead of moving it again.
                let m = plan.len();
                let expected = Moves {
                    values_sent: m * crossing,
                    values_received: m * crossing,
                    grads_sent: m * crossing,
                    grads_received: m * crossing,
                    recomputed_stashes_dropped: mode.stop(m) * crossing,
                };
                assert_eq!(pipe.skip_moves(), expected, "moves, {case}");
                assert!(
                    pipe.memory()
                        .iter()
                        .all(|mem| mem.skips == 0 && mem.held == 0),
                    "nothing held after the step, {case}: {:?}",
                    pipe.memory()
                );
            }
        }
    }
}

#[test]
fn one_to_three_equals_explicit_residual_adds() {
    check_model(&ONE_TO_THREE);
}

#[test]
fn unet_equals_explicit_residual_adds() {
    check_model(&UNET);
}

/// The skip from partition 0 to partition 2 of `1to3` under `[2, 1, 2]`: partition 1 never
/// holds it; partition 2 holds each micro-batch's value from its arrival until its
/// recomputation under checkpointing, and not at all without.
#[test]
fn tensor_life_of_a_skip_across_two_partitions() {
    let value_bytes: usize = MicroBatch::plan(BATCH, CHUNKS)
        .unwrap()
        .iter()
        .map(|mb| mb.len * 4 * std::mem::size_of::<f32>())
        .sum();
    for (mode, held) in [(Checkpoint::Always, value_bytes), (Checkpoint::Never, 0)] {
        let mut pipe = pipe_for(&ONE_TO_THREE, &[2, 1, 2], mode);
        let y = pipe.forward(Batch::single(data(BATCH, 4, 7))).unwrap();
        let skips: Vec<usize> = pipe.memory().iter().map(|m| m.skips).collect();
        assert_eq!(skips, vec![0, 0, held], "{mode}: after forward");
        let moves = pipe.skip_moves();
        assert_eq!(
            moves,
            Moves::default(),
            "{mode}: counted when the trackers retire"
        );
        pipe.backward(Batch::single(CpuTensor::ones(y.tensor(0).unwrap().shape())))
            .unwrap();
        assert!(
            pipe.memory().iter().all(|m| m.skips == 0),
            "{mode}: released by backward"
        );
        assert_eq!(pipe.skip_moves().values_sent, CHUNKS);
        assert_eq!(pipe.skip_moves().grads_sent, CHUNKS);
    }
}

#[test]
fn evaluation_moves_values_once_and_holds_nothing() {
    let mut pipe = pipe_for(&UNET, &[2, 3, 3, 3], Checkpoint::Always);
    pipe.eval();
    let x = data(BATCH, 4, 7);
    let y = pipe.forward(Batch::single(x.clone())).unwrap();
    assert!(pipe.memory().iter().all(|m| m.held == 0 && m.skips == 0));
    let moves = pipe.skip_moves();
    assert_eq!(moves.values_sent, 2 * CHUNKS, "both skips cross partitions");
    assert_eq!((moves.grads_sent, moves.recomputed_stashes_dropped), (0, 0));
    // The same as the whole model evaluated unpipelined, micro-batch by micro-batch.
    let mut ops = unet();
    let plan = MicroBatch::plan(BATCH, CHUNKS).unwrap();
    let parts: Vec<CpuTensor> = plan
        .iter()
        .map(|&mb| {
            let mut h = rows(&x, mb);
            let mut stashed: HashMap<Key, CpuTensor> = HashMap::new();
            for (l, op) in ops.iter_mut().enumerate() {
                match op {
                    Op::Layer(layer) => {
                        let mut ctx = Context::new(false, SEED, 0, mb.len)
                            .with_layer(l)
                            .with_micro_batch(mb);
                        h = layer
                            .forward(Batch::single(h), &mut ctx)
                            .unwrap()
                            .0
                            .into_single()
                            .unwrap();
                    }
                    Op::Stash(name, ns) => {
                        stashed.insert((*ns, *name), h.clone());
                    }
                    Op::Add(name, ns) => h
                        .accumulate(&stashed.remove(&(*ns, *name)).unwrap())
                        .unwrap(),
                }
            }
            h
        })
        .collect();
    assert_eq!(y.into_single().unwrap(), cat(&parts));
}

/// Stashes nothing (torchgpipe's `stash(name, None)`): the pop gets nothing, no gradient
/// flows back, and the (empty) move still happens once each way.
struct StashNothing;

impl Layer<CpuTensor> for StashNothing {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let skips = ctx.skips::<CpuTensor>()?;
        skips.stash("none", None)?;
        skips.finish()?;
        Ok((input, Saved::none()))
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        let mut grads = ctx.skip_grads::<CpuTensor>()?;
        assert!(grads.take_grad("none")?.is_none());
        grads.finish()?;
        Ok(grad)
    }

    fn skips(&self) -> Declaration {
        Declaration::new().stash(["none"])
    }
}

#[test]
fn stashing_nothing_works_through_the_pipe() {
    let model = || -> Layers {
        vec![
            Box::new(StashNothing),
            Box::new(Linear::new(4, 5, 1)),
            Box::new(Linear::new(5, 4, 2)),
            Box::new(AddSkip::new("none")),
        ]
    };
    let plain = || -> Layers {
        vec![
            Box::new(Linear::new(4, 5, 1)),
            Box::new(Linear::new(5, 4, 2)),
        ]
    };
    let (x, target) = (data(BATCH, 4, 7), data(BATCH, 4, 8));
    for mode in MODES {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let run = |layers: Layers, balance: &[usize]| {
                let mut pipe = Pipe::builder(layers, balance)
                    .chunks(CHUNKS)
                    .checkpoint(mode)
                    .schedule(kind)
                    .build()
                    .unwrap();
                let out = pipe
                    .step(Batch::single(x.clone()), |mb, y| mse(&target, mb, y))
                    .unwrap();
                let grads = grads(&pipe.into_layers());
                (out.output, out.input_grad, grads)
            };
            let mut pipe = Pipe::builder(model(), &[1, 2, 1])
                .chunks(CHUNKS)
                .checkpoint(mode)
                .schedule(kind)
                .build()
                .unwrap();
            pipe.step(Batch::single(x.clone()), |mb, y| mse(&target, mb, y))
                .unwrap();
            let moves = pipe.skip_moves();
            assert_eq!(
                (moves.values_sent, moves.grads_sent),
                (CHUNKS, CHUNKS),
                "{mode} {kind}"
            );
            assert_eq!(
                run(model(), &[1, 2, 1]),
                run(plain(), &[1, 1]),
                "{mode} {kind}"
            );
        }
    }
}

#[test]
fn mismatched_declarations_fail_when_the_pipe_is_built() {
    let layers: Layers = vec![
        Box::new(AddSkip::new("early")),
        Box::new(StashInput::new("late")),
        Box::new(ReLU),
    ];
    let err = Pipe::builder(layers, &[1, 2]).build().err().unwrap();
    assert!(
        matches!(err, Error::Skip(pipe::skip::Error::Mismatch(_))),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.starts_with("one or more pairs of stash and pop do not match"),
        "{message}"
    );
    assert!(
        message.contains("'early' as poppable but it was not stashed"),
        "{message}"
    );
    assert!(
        message.contains("no module declared 'late' as poppable but stashed"),
        "{message}"
    );
}

/// A layer that pops without handing its handle back leaves the value behind: the run
/// fails at once, naming the partition, the layer and the micro-batch.
struct ForgetfulPop;

impl Layer<CpuTensor> for ForgetfulPop {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let skips = ctx.skips::<CpuTensor>()?;
        skips.pop("x")?;
        drop(skips); // no finish: the pop is not committed
        Ok((input, Saved::none()))
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        Ok(grad)
    }

    fn skips(&self) -> Declaration {
        Declaration::new().pop(["x"])
    }
}

#[test]
fn a_skip_left_behind_fails_the_run() {
    let layers: Layers = vec![
        Box::new(StashInput::new("x")),
        Box::new(ReLU),
        Box::new(ForgetfulPop),
    ];
    let mut pipe = Pipe::builder(layers, &[1, 2])
        .chunks(2)
        .checkpoint(Checkpoint::Never)
        .build()
        .unwrap();
    pipe.eval();
    let err = pipe.forward(Batch::single(data(4, 3, 1))).unwrap_err();
    assert!(
        matches!(
            err,
            Error::SkipsLeftBehind {
                partition: 1,
                micro_batch: 0,
                held: 1
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_layer_without_a_tracker_gets_a_typed_error() {
    let mut layer = StashInput::new("x");
    let mut ctx = Context::new(true, 0, 0, 2);
    let err = Layer::<CpuTensor>::forward(&mut layer, Batch::single(data(2, 3, 1)), &mut ctx)
        .unwrap_err();
    assert!(matches!(err, Error::NoSkipTracker { layer: 0 }), "{err:?}");
}
