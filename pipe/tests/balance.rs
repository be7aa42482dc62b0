//! Balancing (§7 row 23): torchgpipe's block partition with its exact results and errors,
//! `balance_by_time` on layers of known costs (also with skips, which torchgpipe#27 could
//! not profile), `balance_by_size`, and profiling that leaves the layers as it found them.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pipe::balance::{
    balance_by_size, balance_by_time, balance_cost, block_partition, profile_times,
};
use pipe::cpu::{BatchNorm, CpuTensor, Linear, ReLU};
use pipe::{AddSkip, Batch, Context, Error, Layer, Saved, StashInput};

#[test]
fn blockpartition() {
    assert_eq!(
        block_partition(&[1, 2, 3, 4, 5, 6], 2).unwrap(),
        vec![vec![1, 2, 3, 4], vec![5, 6]]
    );
}

#[test]
fn blockpartition_zeros() {
    assert_eq!(block_partition(&[0, 0], 2).unwrap(), vec![vec![0], vec![0]]);
}

#[test]
fn blockpartition_non_positive_partitions() {
    let err = block_partition(&[42], 0).unwrap_err();
    assert!(matches!(err, Error::Partitions { partitions: 0 }));
    assert_eq!(
        err.to_string(),
        "partitions must be a positive integer (0 < 1)"
    );
}

#[test]
fn blockpartition_short_sequence() {
    let err = block_partition::<i32>(&[], 1).unwrap_err();
    assert_eq!(
        err.to_string(),
        "sequence is shorter than intended partitions (0 < 1)"
    );
    let err = block_partition(&[42], 2).unwrap_err();
    assert!(matches!(
        err,
        Error::SequenceTooShort {
            len: 1,
            partitions: 2
        }
    ));
    assert_eq!(
        err.to_string(),
        "sequence is shorter than intended partitions (1 < 2)"
    );
}

#[test]
fn balance_cost_is_the_block_lengths() {
    assert_eq!(balance_cost(&[1, 2, 3, 4, 5, 6], 2).unwrap(), vec![4, 2]);
    assert_eq!(balance_cost(&[6, 5, 4, 3, 2, 1], 2).unwrap(), vec![2, 4]);
    assert_eq!(balance_cost(&[1.0, 1.0, 1.0, 1.0], 4).unwrap(), vec![1; 4]);
    let blocks = block_partition(&[3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0], 3).unwrap();
    assert_eq!(blocks.iter().map(Vec::len).sum::<usize>(), 7);
    assert!(blocks.iter().all(|b| !b.is_empty()));
}

/// An identity layer whose forward and backward each busy-wait for a known time
/// (torchgpipe's `Delay`, which sleeps): its cost does not depend on the machine's speed,
/// and a wait measured in wall time stays close to it on a busy machine.
struct Spin(Duration);

fn spin(d: Duration) {
    let start = Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}

impl Layer<CpuTensor> for Spin {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        spin(self.0);
        Ok((input, Saved::none()))
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        spin(self.0);
        Ok(grad)
    }
}

fn delays(units: &[u32]) -> Layers {
    units
        .iter()
        .map(|&u| Box::new(Spin(Duration::from_micros(300) * u)) as Box<dyn Layer<CpuTensor>>)
        .collect()
}

/// The balance minimising the slowest partition of `costs` (brute force over all splits
/// into `k` non-empty blocks).
fn best_balance(costs: &[u32], k: usize) -> Vec<usize> {
    fn go(costs: &[u32], k: usize) -> (u32, Vec<usize>) {
        if k == 1 {
            return (costs.iter().sum(), vec![costs.len()]);
        }
        (1..=costs.len() - (k - 1))
            .map(|first| {
                let (rest, mut balance) = go(&costs[first..], k - 1);
                balance.insert(0, first);
                (rest.max(costs[..first].iter().sum()), balance)
            })
            .min()
            .unwrap()
    }
    go(costs, k).1
}

#[test]
fn balance_by_time_minimises_the_slowest_partition() {
    let sample = Batch::single(data(2, 3, 1));
    // torchgpipe's test: delays 1 to 6 into two partitions give [4, 2]; then more costs
    // whose best balance is clear of timing noise.
    for (costs, k, want) in [
        (&[1, 2, 3, 4, 5, 6][..], 2, vec![4, 2]),
        (&[6, 5, 4, 3, 2, 1], 2, vec![2, 4]),
        (&[1, 2, 4, 8], 2, vec![3, 1]),
        (&[1, 2, 3, 4, 5, 6, 7, 8, 9], 3, vec![5, 2, 2]),
    ] {
        assert_eq!(best_balance(costs, k), want, "{costs:?}");
        // The answer holds for costs within 10% of the true ones; a busy machine can
        // stretch a measurement further, so a few attempts are allowed.
        let attempts: Vec<Vec<usize>> = (0..3)
            .map(|_| balance_by_time(k, &mut delays(costs), &sample, 5).unwrap())
            .take_while(|b| *b != want)
            .collect();
        assert!(attempts.len() < 3, "{costs:?}: {attempts:?}, want {want:?}");
    }
}

/// torchgpipe's algorithm stops once the largest block exceeds the smallest by at most one
/// normalised element, so it is not always optimal; ported exactly, it keeps that.
#[test]
fn block_partition_is_torchgpipes_heuristic_not_an_optimum() {
    assert_eq!(balance_cost(&[1, 1, 1, 1, 1, 8], 2).unwrap(), vec![3, 3]);
    assert_eq!(best_balance(&[1, 1, 1, 1, 1, 8], 2), vec![5, 1]);
    assert_eq!(balance_cost(&[2, 2, 2, 2, 8, 8], 2).unwrap(), vec![5, 1]);
    assert_eq!(balance_cost(&[4, 1, 1, 1, 1, 4], 3).unwrap(), vec![2, 2, 2]);
}

/// torchgpipe#27: profiling a model whose layers stash and pop failed with "'k' has not
/// been stashed"; here the profiler lends the layers a tracker.
#[test]
fn balance_by_time_profiles_layers_with_skips() {
    let ns = pipe::skip::Namespace::new();
    let mut layers: Layers = vec![
        Box::new(Linear::new(3, 4, 1)),
        Box::new(StashInput::new("k").isolate(ns)),
        Box::new(Spin(Duration::from_millis(2))),
        Box::new(ReLU),
        Box::new(AddSkip::new("k").isolate(ns)),
        Box::new(Linear::new(4, 2, 2)),
    ];
    let sample = Batch::single(data(4, 3, 1));
    let times = profile_times(&mut layers, &sample, 2).unwrap();
    assert_eq!(times.len(), 6);
    assert!(times[2] >= Duration::from_millis(4), "{times:?}");
    let balance = balance_by_time(2, &mut layers, &sample, 2).unwrap();
    assert_eq!(balance.iter().sum::<usize>(), 6);
}

#[test]
fn profiling_leaves_running_statistics_and_gradients_alone() {
    let mut layers: Layers = vec![Box::new(Linear::new(3, 4, 1)), Box::new(BatchNorm::new(4))];
    // Some gradient already accumulated, as after a step.
    let mut ctx = Context::new(true, 0, 0, 5);
    let x = Batch::single(data(5, 3, 2));
    let (y, saved) = layers[0].forward(x.clone(), &mut ctx).unwrap();
    layers[0]
        .backward(y, saved, &mut ctx.clone().with_phase(pipe::Phase::Backward))
        .unwrap();
    let before = grads(&layers);
    let eval = |layers: &mut Layers| {
        let mut ctx = Context::new(false, 0, 0, 5);
        let h = layers[0].forward(x.clone(), &mut ctx).unwrap().0;
        layers[1]
            .forward(h, &mut ctx)
            .unwrap()
            .0
            .into_single()
            .unwrap()
    };
    let evaluated = eval(&mut layers);
    balance_by_time(1, &mut layers, &x, 2).unwrap();
    balance_by_size(1, &mut layers, &x, 2.0).unwrap();
    assert_eq!(grads(&layers), before, "gradients restored");
    assert_eq!(eval(&mut layers), evaluated, "running statistics untouched");
}

#[test]
fn balance_by_size_weighs_parameters_and_activations() {
    // torchgpipe's test_balance_by_size_param: parameters dominate with param_scale 100.
    let increasing = || -> Layers {
        (0..6)
            .map(|i| Box::new(Linear::new(i + 1, i + 2, i as u64)) as Box<dyn Layer<CpuTensor>>)
            .collect()
    };
    let sample = Batch::single(data(7, 1, 1));
    assert_eq!(
        balance_by_size(2, &mut increasing(), &sample, 100.0).unwrap(),
        vec![4, 2]
    );
    let decreasing = || -> Layers {
        (0..6)
            .rev()
            .map(|i| Box::new(Linear::new(i + 2, i + 1, i as u64)) as Box<dyn Layer<CpuTensor>>)
            .collect()
    };
    let sample = Batch::single(data(1, 7, 1));
    assert_eq!(
        balance_by_size(2, &mut decreasing(), &sample, 100.0).unwrap(),
        vec![2, 4]
    );
    // Activations alone: a stash holds its value until the pop, counted at the stash.
    let sizes = pipe::balance::profile_sizes(
        &mut [
            Box::new(StashInput::new("s")) as Box<dyn Layer<CpuTensor>>,
            Box::new(ReLU),
            Box::new(AddSkip::new("s")),
        ],
        &Batch::single(data(3, 4, 1)),
        0.0,
    )
    .unwrap();
    let bytes = (3 * 4 * std::mem::size_of::<f32>()) as f64;
    assert_eq!(sizes, vec![bytes, bytes, 0.0]);
}

#[test]
fn profiling_needs_a_repetition_and_valid_declarations() {
    let sample = Batch::single(data(2, 3, 1));
    assert!(matches!(
        profile_times(&mut delays(&[1]), &sample, 0),
        Err(Error::NoRepetitions)
    ));
    let mut layers: Layers = vec![Box::new(AddSkip::new("nowhere"))];
    assert!(matches!(
        balance_by_time(1, &mut layers, &sample, 1),
        Err(Error::Skip(_))
    ));
}
