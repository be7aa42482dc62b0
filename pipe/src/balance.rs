//! Balancing (torchgpipe's `torchgpipe.balance`): how many consecutive layers each
//! partition gets, from each layer's cost measured on a sample.
//!
//! - [`balance_by_time`]: each layer's forward plus backward time on a sample batch, the
//!   median of a few repetitions.
//! - [`balance_by_size`]: each layer's activation bytes (what its forward saves for
//!   backward, and what it stashes) plus its parameter bytes times a scale, counted
//!   through [`Tensor::size_bytes`].
//! - [`block_partition`]: the partition of a cost sequence into consecutive blocks,
//!   exactly torchgpipe's `blockpartition.solve` (Bárány et al., "Block Partitions of
//!   Sequences"), so torchgpipe's expected results hold: costs 1 to 6 into two partitions
//!   give `[4, 2]`.
//!
//! ```
//! use pipe::balance::{balance_cost, block_partition};
//! assert_eq!(block_partition(&[1, 2, 3, 4, 5, 6], 2)?, vec![vec![1, 2, 3, 4], vec![5, 6]]);
//! assert_eq!(balance_cost(&[1, 2, 3, 4, 5, 6], 2)?, vec![4, 2]);
//! # Ok::<(), pipe::Error>(())
//! ```
//!
//! Profiling runs the layers themselves, in order, with one skip [`Tracker`] for the
//! sample, so layers that stash and pop work (torchgpipe#27 fails there). It leaves them
//! as it found them: every call is marked [`Context::is_profiling`], so batch norm does not
//! touch its running statistics, and parameter gradients are restored afterwards
//! (torchgpipe profiles deep copies instead, and refuses layers whose gradients are set).

use std::sync::Arc;
use std::time::{Duration, Instant};

use skip::{Declaration, Tracker};

use crate::error::Error;
use crate::layer::{Context, Layer, Phase, Saved};
use crate::microbatch::{Batch, MicroBatch};
use crate::portal::held_bytes;
use crate::tensor::Tensor;

/// Splits `sequence` into `partitions` consecutive non-empty blocks of similar sums:
/// torchgpipe's `blockpartition.solve`, step for step (min-max normalisation, equal
/// initial splits, the maximal block `p` and minimal block `q` found with Python's tuple
/// order, stop when `M ≤ m + 1`).
///
/// Errors as torchgpipe's: [`Error::Partitions`] for no partition,
/// [`Error::SequenceTooShort`] for fewer elements than partitions.
pub fn block_partition<C>(sequence: &[C], partitions: usize) -> Result<Vec<Vec<C>>, Error>
where
    C: Copy + Into<f64>,
{
    let splits = solve(sequence, partitions)?;
    let starts = std::iter::once(0).chain(splits.iter().copied());
    Ok(starts
        .zip(&splits)
        .map(|(start, &stop)| sequence[start..stop].to_vec())
        .collect())
}

/// The balance (layers per partition) of [`block_partition`] over per-layer costs:
/// torchgpipe's `balance_cost`.
pub fn balance_cost<C>(costs: &[C], partitions: usize) -> Result<Vec<usize>, Error>
where
    C: Copy + Into<f64>,
{
    let splits = solve(costs, partitions)?;
    let starts = std::iter::once(0).chain(splits.iter().copied());
    Ok(starts
        .zip(&splits)
        .map(|(start, &stop)| stop - start)
        .collect())
}

/// The end of each block.
fn solve<C: Copy + Into<f64>>(sequence: &[C], partitions: usize) -> Result<Vec<usize>, Error> {
    if partitions < 1 {
        return Err(Error::Partitions { partitions });
    }
    let n = sequence.len();
    if n < partitions {
        return Err(Error::SequenceTooShort { len: n, partitions });
    }
    let values: Vec<f64> = sequence.iter().map(|&c| c.into()).collect();
    let minimum = values.iter().copied().fold(f64::INFINITY, f64::min);
    let maximum = values.iter().copied().fold(f64::NEG_INFINITY, f64::max) - minimum;
    let normal: Vec<f64> = if maximum == 0.0 {
        vec![0.0; n]
    } else {
        values.iter().map(|x| (x - minimum) / maximum).collect()
    };

    let mut splits: Vec<usize> = (0..partitions - 1)
        .map(|x| n / partitions * (x + 1))
        .chain([n])
        .collect();
    let block_size = |splits: &[usize], i: usize| -> f64 {
        let start = if i > 0 { splits[i - 1] } else { 0 };
        normal[start..splits[i]].iter().sum()
    };
    // Python's `max(leaderboard())` over (size, index): the largest size, ties to the
    // larger index; `min` ties to the smaller index.
    let leader = |splits: &[usize]| -> (f64, usize) {
        (0..partitions).map(|i| (block_size(splits, i), i)).fold(
            (f64::NEG_INFINITY, 0),
            |best, cur| {
                if cur.0 > best.0 || (cur.0 == best.0 && cur.1 > best.1) {
                    cur
                } else {
                    best
                }
            },
        )
    };
    let trailer =
        |splits: &[usize]| -> (f64, usize) {
            (0..partitions).map(|i| (block_size(splits, i), i)).fold(
                (f64::INFINITY, 0),
                |best, cur| {
                    if cur.0 < best.0 {
                        cur
                    } else {
                        best
                    }
                },
            )
        };

    loop {
        // (1) Fix p with M(P) = b_p: B_p is a maximal block.
        let (max_size, p) = leader(&splits);
        loop {
            // (2) If M(P) <= m(P) + 1, stop.
            let (min_size, q) = trailer(&splits);
            if max_size <= min_size + 1.0 {
                return Ok(splits);
            }
            // (3) Move one element into the minimal block B_q from its neighbour B_h on
            // the side of B_p. As in torchgpipe, q is the arg-min, not the one closest
            // to p. B_h is never empty here (the paper's argument), so the moves stay in
            // range.
            let h = if p < q {
                splits[q - 1] -= 1;
                q - 1
            } else {
                splits[q] += 1;
                q + 1
            };
            if p == h {
                break;
            }
        }
    }
}

/// Per layer, the median over `repetitions` of its forward plus backward time on
/// `sample` (after one warm-up pass).
///
/// The layers run in order as one plain sequence in training mode, the forward of each
/// taking the previous one's output, then backward in reverse order from an output
/// gradient equal to the output (torchgpipe's `backward(outputs, outputs)`), with a skip
/// tracker lent to every layer that declares skips. Running statistics are left alone and
/// parameter gradients restored (see the [module docs](self)).
pub fn profile_times<T: Tensor>(
    layers: &mut [Box<dyn Layer<T>>],
    sample: &Batch<T>,
    repetitions: usize,
) -> Result<Vec<Duration>, Error> {
    if repetitions == 0 {
        return Err(Error::NoRepetitions);
    }
    let decls = declarations(layers)?;
    let grads = snapshot_grads(layers);
    let result = (|| {
        let mut times: Vec<Vec<Duration>> = vec![Vec::with_capacity(repetitions); layers.len()];
        for rep in 0..=repetitions {
            let pass = timed_pass(layers, &decls, sample)?;
            if rep > 0 {
                for (t, d) in times.iter_mut().zip(pass) {
                    t.push(d);
                }
            }
        }
        Ok(times.into_iter().map(median).collect())
    })();
    restore_grads(layers, grads);
    result
}

/// [`balance_cost`] of [`profile_times`] (in nanoseconds): the balance that evens out the
/// partitions' forward plus backward times (torchgpipe's `balance_by_time`).
pub fn balance_by_time<T: Tensor>(
    partitions: usize,
    layers: &mut [Box<dyn Layer<T>>],
    sample: &Batch<T>,
    repetitions: usize,
) -> Result<Vec<usize>, Error> {
    let times = profile_times(layers, sample, repetitions)?;
    let nanos: Vec<f64> = times.iter().map(|d| d.as_nanos() as f64).collect();
    balance_cost(&nanos, partitions)
}

/// Per layer, the bytes it costs: what its forward on `sample` saves for backward plus
/// what it stashes (through [`Tensor::size_bytes`]), plus `param_scale` times its
/// parameter bytes (torchgpipe's suggestions: 2 to 3 for SGD, 4 to 5 for Adam, counting
/// the gradient and the optimiser's state). Give a sample the size of one micro-batch.
///
/// One forward pass in training mode, marked as profiling; nothing runs backward.
pub fn profile_sizes<T: Tensor>(
    layers: &mut [Box<dyn Layer<T>>],
    sample: &Batch<T>,
    param_scale: f64,
) -> Result<Vec<f64>, Error> {
    let decls = declarations(layers)?;
    let mb = whole(sample)?;
    let mut tracker = Box::new(Tracker::<T>::new());
    let mut x = sample.clone();
    let mut sizes = Vec::with_capacity(layers.len());
    for (l, layer) in layers.iter_mut().enumerate() {
        let before = held_bytes(&tracker);
        let mut ctx = context(l, mb, Phase::Forward);
        let (y, saved) = call(&mut ctx, &decls[l], &mut tracker, |ctx| {
            layer.forward(x, ctx)
        })?;
        let stashed = held_bytes(&tracker).saturating_sub(before);
        let params: usize = layer
            .parameters()
            .iter()
            .map(|p| p.value.size_bytes())
            .sum();
        sizes.push((saved.size_bytes() + stashed) as f64 + param_scale * params as f64);
        x = y;
    }
    Ok(sizes)
}

/// [`balance_cost`] of [`profile_sizes`]: the balance that evens out the partitions'
/// memory (torchgpipe's `balance_by_size`).
pub fn balance_by_size<T: Tensor>(
    partitions: usize,
    layers: &mut [Box<dyn Layer<T>>],
    sample: &Batch<T>,
    param_scale: f64,
) -> Result<Vec<usize>, Error> {
    let sizes = profile_sizes(layers, sample, param_scale)?;
    balance_cost(&sizes, partitions)
}

/// The layers' declarations, verified as a pipe would.
fn declarations<T: Tensor>(
    layers: &[Box<dyn Layer<T>>],
) -> Result<Vec<Option<Arc<Declaration>>>, Error> {
    let decls: Vec<Declaration> = layers.iter().map(|l| l.skips()).collect();
    skip::verify(&decls)?;
    Ok(decls
        .into_iter()
        .map(|d| (!d.is_empty()).then(|| Arc::new(d)))
        .collect())
}

fn whole<T: Tensor>(sample: &Batch<T>) -> Result<MicroBatch, Error> {
    Ok(MicroBatch {
        index: 0,
        offset: 0,
        len: sample.batch_len()?,
    })
}

fn context(layer: usize, mb: MicroBatch, phase: Phase) -> Context {
    Context::new(true, 0, 0, mb.len)
        .with_layer(layer)
        .with_micro_batch(mb)
        .with_phase(phase)
        .with_profiling(true)
}

/// Runs one layer call with the tracker lent to it if the layer declares skips.
fn call<T: Tensor, R>(
    ctx: &mut Context,
    decl: &Option<Arc<Declaration>>,
    tracker: &mut Box<Tracker<T>>,
    f: impl FnOnce(&mut Context) -> Result<R, Error>,
) -> Result<R, Error> {
    let Some(decl) = decl else {
        return f(ctx);
    };
    let lent = std::mem::replace(tracker, Box::new(Tracker::new()));
    ctx.attach_skips(lent, Arc::clone(decl));
    let result = f(ctx);
    if let Some(back) = ctx.detach_skips::<T>() {
        *tracker = back;
    }
    result
}

/// One forward and backward pass over every layer: each layer's time.
fn timed_pass<T: Tensor>(
    layers: &mut [Box<dyn Layer<T>>],
    decls: &[Option<Arc<Declaration>>],
    sample: &Batch<T>,
) -> Result<Vec<Duration>, Error> {
    let mb = whole(sample)?;
    let mut tracker = Box::new(Tracker::<T>::new());
    let mut times = Vec::with_capacity(layers.len());
    let mut saved: Vec<Saved<T>> = Vec::with_capacity(layers.len());
    let mut x = sample.clone();
    for (l, layer) in layers.iter_mut().enumerate() {
        let mut ctx = context(l, mb, Phase::Forward);
        let start = Instant::now();
        let (y, state) = call(&mut ctx, &decls[l], &mut tracker, |ctx| {
            layer.forward(x, ctx)
        })?;
        times.push(start.elapsed());
        saved.push(state);
        x = y;
    }
    let mut g = x;
    for (l, layer) in layers.iter_mut().enumerate().rev() {
        let state = saved.pop().unwrap_or_else(Saved::none);
        let mut ctx = context(l, mb, Phase::Backward);
        let start = Instant::now();
        g = call(&mut ctx, &decls[l], &mut tracker, |ctx| {
            layer.backward(g, state, ctx)
        })?;
        times[l] += start.elapsed();
    }
    Ok(times)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn snapshot_grads<T: Tensor>(layers: &[Box<dyn Layer<T>>]) -> Vec<Vec<T>> {
    layers
        .iter()
        .map(|l| l.parameters().iter().map(|p| p.grad.clone()).collect())
        .collect()
}

fn restore_grads<T: Tensor>(layers: &mut [Box<dyn Layer<T>>], grads: Vec<Vec<T>>) {
    for (layer, grads) in layers.iter_mut().zip(grads) {
        for (p, g) in layer.parameters_mut().into_iter().zip(grads) {
            *p.grad = g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_costs_split_evenly_with_the_remainder_last() {
        assert_eq!(balance_cost(&[1.0; 7], 3).unwrap(), vec![2, 2, 3]);
        assert_eq!(balance_cost(&[5u32], 1).unwrap(), vec![1]);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        let d = Duration::from_millis;
        assert_eq!(median(vec![d(3), d(1), d(2)]), d(2));
        assert_eq!(median(vec![d(4), d(1), d(2), d(3)]), d(3));
    }
}
