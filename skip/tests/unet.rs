//! The U-Net-like stack written with `skip` against the same stack with its residuals
//! threaded by hand: outputs and every gradient identical, on a plain sequence and
//! pipelined (per (micro-batch, partition) trackers, values moved once along the layout's
//! copy policy, with and without checkpointing, on one thread and on one thread per
//! partition, as a pipeline engine would).

#[path = "../examples/model/mod.rs"]
#[allow(dead_code)]
mod model;

use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

use model::{
    backward_range, differences, forward_range, run_explicit, run_with_skip, Model, ParamGrads,
    Pass, Rng,
};
use skip::{Error, Moves, Namespace, SkipLayout, Tracker};

const WIDTH: usize = 5;

fn inputs(m: usize, seed: u64) -> Vec<Vec<f64>> {
    let mut rng = Rng::new(seed);
    (0..m).map(|_| rng.vec(WIDTH)).collect()
}

#[test]
fn plain_sequence_equals_explicit_residuals() {
    for seed in 0..5 {
        let model = Model::unet(WIDTH, seed);
        skip::verify(&model.decls()).unwrap();
        for x in inputs(3, 100 + seed) {
            let (with_skip, tracker) = run_with_skip(&model, x.clone()).unwrap();
            let explicit = run_explicit(&model, x);
            assert_eq!(differences(&with_skip, &explicit), Vec::<String>::new());
            assert_eq!(with_skip, explicit);
            assert!(tracker.is_empty());
        }
    }
}

/// The comparison can fail: decoders popping the wrong encoders (a valid declaration,
/// but not the nesting the explicit version threads) give different results.
#[test]
fn crossed_skips_differ_from_explicit_residuals() {
    let mut model = Model::unet(WIDTH, 3);
    let (a, c) = (model.layers[4].decl.clone(), model.layers[6].decl.clone());
    model.layers[4].decl = c;
    model.layers[6].decl = a;
    skip::verify(&model.decls()).unwrap();
    let x = inputs(1, 9).remove(0);
    let (with_skip, _) = run_with_skip(&model, x.clone()).unwrap();
    let diff = differences(&with_skip, &run_explicit(&model, x));
    assert!(diff.contains(&"output".to_owned()), "{diff:?}");
    assert!(diff.contains(&"layer 0 dw".to_owned()), "{diff:?}");
}

const BALANCES: &[&[usize]] = &[
    &[8],
    &[4, 4],
    &[3, 2, 3],
    &[2, 2, 2, 2],
    &[1, 3, 4],
    &[5, 1, 1, 1],
    &[1, 1, 1, 1, 1, 1, 1, 1],
];

/// Per micro-batch, per partition.
type Trackers = Vec<Vec<Tracker<Vec<f64>>>>;

/// GPipe on one thread: forward in clock order, moving each skip straight from its
/// stashing partition's tracker to its popping one's before the popping partition runs;
/// backward in reverse clock order, recomputing checkpointed micro-batches
/// (`i < checkpoint_stop`) first and moving skip gradients back. Returns each
/// micro-batch's results and each (micro-batch, partition) tracker.
fn run_gpipe(
    model: &Model,
    layout: &SkipLayout,
    xs: &[Vec<f64>],
    checkpoint_stop: usize,
) -> Result<(Vec<Pass>, Trackers), Error> {
    let (m, n) = (xs.len(), layout.num_partitions());
    let mut trackers: Trackers = (0..m)
        .map(|i| {
            (0..n)
                .map(|_| {
                    if i < checkpoint_stop {
                        Tracker::with_checkpointing()
                    } else {
                        Tracker::new()
                    }
                })
                .collect()
        })
        .collect();
    let mut acts = xs.to_vec();
    let mut part_inputs = vec![vec![Vec::new(); n]; m];
    let mut part_outputs = vec![vec![Vec::new(); n]; m];
    let mut saved = vec![vec![Vec::new(); n]; m];
    let clocks = |k: usize| (k.saturating_sub(m - 1)..n.min(k + 1)).map(move |j| (k - j, j));

    for k in 0..m + n - 1 {
        for (i, j) in clocks(k) {
            for r in layout.copy_policy(j) {
                let v = trackers[i][r.source].take_outgoing(r.ns, &r.name)?;
                trackers[i][j].insert_incoming(r.ns, &r.name, v)?;
            }
            part_inputs[i][j] = acts[i].clone();
            let (y, s) = forward_range(
                model,
                layout.layers(j),
                acts[i].clone(),
                &mut trackers[i][j],
                false,
            )?;
            if i >= checkpoint_stop {
                saved[i][j] = s; // checkpointed micro-batches keep only their inputs
            }
            part_outputs[i][j] = y.clone();
            acts[i] = y;
        }
    }

    let outputs = acts.clone();
    let mut gys = acts; // loss 0.5 |y|^2
    let mut params: Vec<Vec<ParamGrads>> = vec![Vec::new(); m];
    let mut part_params = vec![vec![Vec::new(); n]; m];
    for k in (0..m + n - 1).rev() {
        for (i, j) in clocks(k).collect::<Vec<_>>().into_iter().rev() {
            if i < checkpoint_stop {
                let x = part_inputs[i][j].clone();
                let (y, s) = forward_range(model, layout.layers(j), x, &mut trackers[i][j], true)?;
                assert_eq!(y, part_outputs[i][j], "recomputation is bit-identical");
                saved[i][j] = s;
            }
            let gy = std::mem::take(&mut gys[i]);
            let (gx, p) = backward_range(
                model,
                layout.layers(j),
                &saved[i][j],
                gy,
                &mut trackers[i][j],
            )?;
            for r in layout.copy_policy(j) {
                let g = trackers[i][j].take_outgoing_grad(r.ns, &r.name)?;
                trackers[i][r.source].insert_incoming_grad(r.ns, &r.name, g)?;
            }
            part_params[i][j] = p;
            gys[i] = gx;
        }
    }
    for i in 0..m {
        params[i] = part_params[i].concat();
    }
    let passes = (0..m)
        .map(|i| Pass {
            output: outputs[i].clone(),
            input_grad: gys[i].clone(),
            param_grads: params[i].clone(),
        })
        .collect();
    Ok((passes, trackers))
}

#[test]
fn pipelined_equals_explicit_residuals_for_every_balance_and_checkpoint_mode() {
    let model = Model::unet(WIDTH, 21);
    let xs = inputs(3, 22);
    let expected: Vec<Pass> = xs.iter().map(|x| run_explicit(&model, x.clone())).collect();
    for balance in BALANCES {
        let layout = SkipLayout::new(&model.decls(), balance).unwrap();
        let copies: usize = (0..layout.num_partitions())
            .map(|j| layout.copy_policy(j).len())
            .sum();
        for (mode, stop) in [("always", 3), ("except_last", 2), ("never", 0)] {
            let (passes, trackers) = run_gpipe(&model, &layout, &xs, stop).unwrap();
            for (i, (got, want)) in passes.iter().zip(&expected).enumerate() {
                let diff = differences(got, want);
                assert!(
                    diff.is_empty(),
                    "{balance:?} {mode} micro-batch {i}: {diff:?}"
                );
                assert!(
                    trackers[i].iter().all(Tracker::is_empty),
                    "{balance:?} {mode}: leftovers"
                );
                // Each crossing skip moved once each way; a checkpointed stashing
                // partition's recomputed stash was dropped, once per crossing skip.
                let moves: Moves = trackers[i].iter().map(Tracker::moves).sum();
                let dropped = if i < stop { copies } else { 0 };
                let want = Moves {
                    values_sent: copies,
                    values_received: copies,
                    grads_sent: copies,
                    grads_received: copies,
                    recomputed_stashes_dropped: dropped,
                };
                assert_eq!(moves, want, "{balance:?} {mode} micro-batch {i}");
            }
        }
    }
}

enum Msg {
    Act(usize, Vec<f64>),
    Grad(usize, Vec<f64>),
    Skip(usize, Namespace, String, Option<Vec<f64>>),
    SkipGrad(usize, Namespace, String, Option<Vec<f64>>),
}

/// A partition's inbox: messages from several senders arrive in any order; `take` waits
/// for the one wanted and keeps the others.
struct Inbox {
    rx: Receiver<Msg>,
    early: VecDeque<Msg>,
}

impl Inbox {
    fn take(&mut self, want: impl Fn(&Msg) -> bool) -> Msg {
        if let Some(pos) = self.early.iter().position(&want) {
            return self.early.remove(pos).unwrap();
        }
        loop {
            let msg = self
                .rx
                .recv_timeout(Duration::from_secs(60))
                .expect("a partition waited a minute: the pipeline is stuck");
            if want(&msg) {
                return msg;
            }
            self.early.push_back(msg);
        }
    }

    fn act(&mut self, i: usize) -> Vec<f64> {
        match self.take(|m| matches!(m, Msg::Act(k, _) if *k == i)) {
            Msg::Act(_, x) => x,
            _ => unreachable!(),
        }
    }

    fn grad(&mut self, i: usize) -> Vec<f64> {
        match self.take(|m| matches!(m, Msg::Grad(k, _) if *k == i)) {
            Msg::Grad(_, g) => g,
            _ => unreachable!(),
        }
    }

    fn skip(&mut self, i: usize, ns: Namespace, name: &str, grad: bool) -> Option<Vec<f64>> {
        let msg = self.take(|m| match m {
            Msg::Skip(k, n, s, _) if !grad => (*k, *n, s.as_str()) == (i, ns, name),
            Msg::SkipGrad(k, n, s, _) if grad => (*k, *n, s.as_str()) == (i, ns, name),
            _ => false,
        });
        match msg {
            Msg::Skip(.., v) | Msg::SkipGrad(.., v) => v,
            _ => unreachable!(),
        }
    }
}

/// What one partition's thread returns: per micro-batch, its output (last partition),
/// its input gradient (first partition), its layers' parameter gradients; and its
/// trackers.
type Worker = (
    Vec<Vec<f64>>,
    Vec<Vec<f64>>,
    Vec<Vec<ParamGrads>>,
    Vec<Tracker<Vec<f64>>>,
);

/// One partition on its own thread: forward for micro-batches 0..m, then backward for
/// m-1..0, exchanging activations, gradients, skips and skip gradients by message.
#[allow(clippy::too_many_arguments)]
fn partition(
    j: usize,
    model: &Model,
    layout: &SkipLayout,
    xs: &[Vec<f64>],
    checkpoint_stop: usize,
    mut inbox: Inbox,
    txs: Vec<Sender<Msg>>,
) -> Result<Worker, Error> {
    let (m, n) = (xs.len(), layout.num_partitions());
    let layers = layout.layers(j);
    let outgoing: Vec<_> = layout
        .routes()
        .filter(|r| r.source == j && r.requires_copy())
        .cloned()
        .collect();
    let mut trackers: Vec<Tracker<Vec<f64>>> = (0..m)
        .map(|i| {
            if i < checkpoint_stop {
                Tracker::with_checkpointing()
            } else {
                Tracker::new()
            }
        })
        .collect();
    let mut kept_inputs = vec![Vec::new(); m];
    let mut saved = vec![Vec::new(); m];
    let mut outputs = vec![Vec::new(); m];

    for i in 0..m {
        let x = if j == 0 { xs[i].clone() } else { inbox.act(i) };
        for r in layout.copy_policy(j) {
            let v = inbox.skip(i, r.ns, &r.name, false);
            trackers[i].insert_incoming(r.ns, &r.name, v)?;
        }
        kept_inputs[i] = x.clone();
        let (y, s) = forward_range(model, layers.clone(), x, &mut trackers[i], false)?;
        if i >= checkpoint_stop {
            saved[i] = s;
        }
        for r in &outgoing {
            let v = trackers[i].take_outgoing(r.ns, &r.name)?;
            txs[r.dest]
                .send(Msg::Skip(i, r.ns, r.name.clone(), v))
                .unwrap();
        }
        if j + 1 < n {
            txs[j + 1].send(Msg::Act(i, y)).unwrap();
        } else {
            outputs[i] = y;
        }
    }

    let mut input_grads = vec![Vec::new(); m];
    let mut params = vec![Vec::new(); m];
    for i in (0..m).rev() {
        let gy = if j + 1 == n {
            outputs[i].clone()
        } else {
            inbox.grad(i)
        };
        for r in &outgoing {
            let g = inbox.skip(i, r.ns, &r.name, true);
            trackers[i].insert_incoming_grad(r.ns, &r.name, g)?;
        }
        if i < checkpoint_stop {
            let x = kept_inputs[i].clone();
            saved[i] = forward_range(model, layers.clone(), x, &mut trackers[i], true)?.1;
        }
        let (gx, p) = backward_range(model, layers.clone(), &saved[i], gy, &mut trackers[i])?;
        for r in layout.copy_policy(j) {
            let g = trackers[i].take_outgoing_grad(r.ns, &r.name)?;
            txs[r.source]
                .send(Msg::SkipGrad(i, r.ns, r.name.clone(), g))
                .unwrap();
        }
        params[i] = p;
        if j > 0 {
            txs[j - 1].send(Msg::Grad(i, gx)).unwrap();
        } else {
            input_grads[i] = gx;
        }
    }
    Ok((outputs, input_grads, params, trackers))
}

/// One thread per partition, trackers living on their partition's thread, skip values
/// and gradients sent between threads: the shape of the `pipe` engine.
#[test]
fn one_thread_per_partition_equals_explicit_residuals() {
    let model = Model::unet(WIDTH, 31);
    let xs = inputs(4, 32);
    for balance in [&[3, 2, 3][..], &[1, 1, 1, 1, 1, 1, 1, 1], &[4, 4]] {
        let layout = SkipLayout::new(&model.decls(), balance).unwrap();
        let n = layout.num_partitions();
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..n).map(|_| channel()).unzip();
        let results: Vec<Worker> = std::thread::scope(|s| {
            let handles: Vec<_> = rxs
                .into_iter()
                .enumerate()
                .map(|(j, rx)| {
                    let inbox = Inbox {
                        rx,
                        early: VecDeque::new(),
                    };
                    let (model, layout, xs, txs) = (&model, &layout, &xs, txs.clone());
                    s.spawn(move || partition(j, model, layout, xs, 3, inbox, txs))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        for (i, x) in xs.iter().enumerate() {
            let got = Pass {
                output: results[n - 1].0[i].clone(),
                input_grad: results[0].1[i].clone(),
                param_grads: results.iter().flat_map(|r| r.2[i].clone()).collect(),
            };
            let diff = differences(&got, &run_explicit(&model, x.clone()));
            assert!(diff.is_empty(), "{balance:?} micro-batch {i}: {diff:?}");
        }
        assert!(results.iter().all(|r| r.3.iter().all(Tracker::is_empty)));
    }
}
