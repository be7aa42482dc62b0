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
//!   Sequences") wherever that gives non-empty blocks, so torchgpipe's expected results
//!   hold: costs 1 to 6 into two partitions give `[4, 2]`. Where torchgpipe gives an empty
//!   block or never stops, a least-largest-block partition instead (see
//!   [`block_partition`]): the result is always a balance a pipe accepts.
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
use crate::layer::{Context, Layer, Saved};
use crate::microbatch::{Batch, MicroBatch};
use crate::portal::held_bytes;
use crate::tensor::Tensor;
use crate::vocab::Phase;

/// Splits `sequence` into `partitions` consecutive non-empty blocks of similar sums.
///
/// This is torchgpipe's `blockpartition.solve`, step for step (min-max normalisation,
/// equal initial splits, the maximal block `p` and minimal block `q` found with Python's
/// tuple order, stop when `M ≤ m + 1`, Python's slicing), wherever torchgpipe stops with
/// non-empty blocks: then the blocks are torchgpipe's. torchgpipe takes `q` as the
/// arg-min block rather than the minimal block closest to `p` (the paper's rule), so its
/// moves can empty or invert a block on the way, and it can end in one of two ways that
/// give no usable balance; both get the fallback below instead:
///
/// - it stops with an empty block (costs `[2, 10, 2, 100, 5]` into 4 give `[2, 2, 0, 1]`,
///   a balance the pipe builder rejects; here the fallback gives `[2, 1, 1, 1]`);
/// - it never stops (costs `[2, 2, 2, 2, 2, 10, 10]` into 5; the fallback gives
///   `[3, 1, 1, 1, 1]`). The loop is bounded at `4n² + 1024` moves for `n` elements, far
///   above the at most `n²/4` moves that torchgpipe's runs which stop took in our trials.
///
/// The fallback is the partition into `partitions` non-empty blocks whose largest sum of
/// the costs (as given, not normalised) is least, and among those the one whose earlier
/// blocks are as long as that bound allows. So every `Ok` holds exactly `partitions`
/// non-empty blocks that together are `sequence`, in order.
///
/// Errors as torchgpipe's: [`Error::Partitions`] for no partition,
/// [`Error::SequenceTooShort`] for fewer elements than partitions.
pub fn block_partition<C>(sequence: &[C], partitions: usize) -> Result<Vec<Vec<C>>, Error>
where
    C: Copy + Into<f64>,
{
    let ends = solve(sequence, partitions)?;
    let starts = std::iter::once(0).chain(ends.iter().copied());
    Ok(starts
        .zip(&ends)
        .map(|(start, &stop)| sequence[start..stop].to_vec())
        .collect())
}

/// The balance (layers per partition) of [`block_partition`] over per-layer costs:
/// torchgpipe's `balance_cost`, with the same fallback where torchgpipe gives an empty
/// partition or never stops. Every entry is at least 1 and they add up to `costs.len()`,
/// so the result is always a balance [`Pipe::builder`](crate::Pipe::builder) accepts.
///
/// ```
/// use pipe::balance::balance_cost;
/// // torchgpipe's own answers where they are balances:
/// assert_eq!(balance_cost(&[1, 1, 100, 100, 3, 100, 3], 4)?, vec![3, 1, 1, 2]);
/// // torchgpipe gives [2, 2, 0, 1] here, and never stops on the second:
/// assert_eq!(balance_cost(&[2, 10, 2, 100, 5], 4)?, vec![2, 1, 1, 1]);
/// assert_eq!(balance_cost(&[2, 2, 2, 2, 2, 10, 10], 5)?, vec![3, 1, 1, 1, 1]);
/// # Ok::<(), pipe::Error>(())
/// ```
pub fn balance_cost<C>(costs: &[C], partitions: usize) -> Result<Vec<usize>, Error>
where
    C: Copy + Into<f64>,
{
    let ends = solve(costs, partitions)?;
    let starts = std::iter::once(0).chain(ends.iter().copied());
    Ok(starts
        .zip(&ends)
        .map(|(start, &stop)| stop - start)
        .collect())
}

/// The end of each block: strictly increasing, the last one `sequence.len()`.
fn solve<C: Copy + Into<f64>>(sequence: &[C], partitions: usize) -> Result<Vec<usize>, Error> {
    if partitions < 1 {
        return Err(Error::Partitions { partitions });
    }
    let n = sequence.len();
    if n < partitions {
        return Err(Error::SequenceTooShort { len: n, partitions });
    }
    let values: Vec<f64> = sequence.iter().map(|&c| c.into()).collect();
    Ok(torchgpipe_ends(&values, partitions).unwrap_or_else(|| least_max_ends(&values, partitions)))
}

/// Python's index into a slice of `n` elements: negative counts from the end, then clamped
/// to `0..=n`.
fn py_index(i: isize, n: usize) -> usize {
    let n = n as isize;
    let i = if i < 0 { i + n } else { i };
    i.clamp(0, n) as usize
}

/// torchgpipe's `solve` on `values`, with Python's semantics (a split may leave `0..=n`
/// or pass the next one; slicing then gives an empty or clamped block): the ends of its
/// blocks, or `None` if it does not stop within the bound or stops with an empty block.
fn torchgpipe_ends(values: &[f64], partitions: usize) -> Option<Vec<usize>> {
    let n = values.len();
    let minimum = values.iter().copied().fold(f64::INFINITY, f64::min);
    let maximum = values.iter().copied().fold(f64::NEG_INFINITY, f64::max) - minimum;
    let normal: Vec<f64> = if maximum == 0.0 {
        vec![0.0; n]
    } else {
        values.iter().map(|x| (x - minimum) / maximum).collect()
    };

    let mut splits: Vec<isize> = (0..partitions - 1)
        .map(|x| (n / partitions * (x + 1)) as isize)
        .chain([n as isize])
        .collect();
    let block_size = |splits: &[isize], i: usize| -> f64 {
        let start = py_index(if i > 0 { splits[i - 1] } else { 0 }, n);
        let stop = py_index(splits[i], n);
        if start < stop {
            normal[start..stop].iter().sum()
        } else {
            0.0
        }
    };
    // Python's `max` and `min` over the (size, index) pairs: the first pair is kept unless
    // a later one compares greater (less); tuples compare their sizes first, their
    // indices only when the sizes are equal, so ties go to the larger index for `max`.
    let leader = |splits: &[isize]| -> (f64, usize) {
        (1..partitions).fold((block_size(splits, 0), 0), |best, i| {
            let size = block_size(splits, i);
            if size >= best.0 {
                (size, i)
            } else {
                best
            }
        })
    };
    let trailer = |splits: &[isize]| -> (f64, usize) {
        (1..partitions).fold((block_size(splits, 0), 0), |best, i| {
            let size = block_size(splits, i);
            if size < best.0 {
                (size, i)
            } else {
                best
            }
        })
    };

    let mut moves_left = n.saturating_mul(n).saturating_mul(4).saturating_add(1024);
    loop {
        // (1) Fix p with M(P) = b_p: B_p is a maximal block.
        let (max_size, p) = leader(&splits);
        loop {
            // (2) If M(P) <= m(P) + 1, stop.
            let (min_size, q) = trailer(&splits);
            if max_size <= min_size + 1.0 {
                return valid_ends(&splits, n);
            }
            if moves_left == 0 {
                return None;
            }
            moves_left -= 1;
            // (3) Move one element into the minimal block B_q from its neighbour B_h on
            // the side of B_p. As in torchgpipe, q is the arg-min, not the one closest
            // to p, so B_h may be empty or inverted (its split past its start): the move
            // still shifts the split by one, as Python does.
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

/// The blocks Python's slices `sequence[start:stop]` give for torchgpipe's splits, as
/// ends, if each is non-empty (then they are consecutive and cover `0..n`).
fn valid_ends(splits: &[isize], n: usize) -> Option<Vec<usize>> {
    let ends: Vec<usize> = splits.iter().map(|&s| py_index(s, n)).collect();
    let mut start = 0;
    for &end in &ends {
        if end <= start {
            return None;
        }
        start = end;
    }
    (start == n).then_some(ends)
}

/// The fallback of [`block_partition`]: of the partitions of `values` into `partitions`
/// non-empty consecutive blocks, one whose largest block sum is least, its earlier blocks
/// as long as that allows. `O(partitions · n²)`.
fn least_max_ends(values: &[f64], partitions: usize) -> Vec<usize> {
    let n = values.len();
    let k = partitions;
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(values.iter().scan(0.0, |sum, &v| {
            *sum += v;
            Some(*sum)
        }))
        .collect();
    let sum = |start: usize, stop: usize| prefix[stop] - prefix[start];
    // best[j][r]: the least largest block sum of values[r..] in j non-empty blocks, for
    // r <= n - j. (`f64::min` and `max` pass over NaN, so NaN costs only make a worse
    // partition, never an invalid one.)
    let mut best = vec![vec![f64::INFINITY; n + 1]; k + 1];
    for (r, b) in best[1].iter_mut().enumerate().take(n) {
        *b = sum(r, n);
    }
    for j in 2..=k {
        for r in 0..=n - j {
            let least = (r + 1..=n - (j - 1))
                .map(|e| sum(r, e).max(best[j - 1][e]))
                .fold(f64::INFINITY, f64::min);
            best[j][r] = least;
        }
    }
    let bound = best[k][0];
    let mut ends = Vec::with_capacity(k);
    let mut start = 0;
    for j in (2..=k).rev() {
        // The longest first block that leaves a rest within the bound.
        let end = (start + 1..=n - (j - 1))
            .rev()
            .find(|&e| sum(start, e) <= bound && best[j - 1][e] <= bound)
            .unwrap_or(start + 1);
        ends.push(end);
        start = end;
    }
    ends.push(n);
    ends
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

    /// torchgpipe passes through an empty and an inverted block here and still ends with
    /// `[3, 1, 1, 2]` (checked by running its `solve`); indexing those blocks panicked.
    #[test]
    fn transient_empty_blocks_end_as_torchgpipe_ends() {
        let costs = [1, 1, 100, 100, 3, 100, 3];
        assert_eq!(balance_cost(&costs, 4).unwrap(), vec![3, 1, 1, 2]);
        assert_eq!(
            block_partition(&costs, 4).unwrap(),
            vec![vec![1, 1, 100], vec![100], vec![3], vec![100, 3]]
        );
    }

    /// torchgpipe never stops here (its splits drift out of the sequence): the bounded
    /// loop gives up and the fallback answers.
    #[test]
    fn a_solve_that_never_stops_gets_the_fallback() {
        let costs = [2, 2, 2, 2, 2, 10, 10];
        assert_eq!(
            torchgpipe_ends(&[2.0, 2.0, 2.0, 2.0, 2.0, 10.0, 10.0], 5),
            None
        );
        assert_eq!(balance_cost(&costs, 5).unwrap(), vec![3, 1, 1, 1, 1]);
    }

    /// torchgpipe stops with `[2, 2, 0, 1]`, which no pipe accepts: the fallback, the least
    /// largest block (100) with the earlier blocks as long as possible.
    #[test]
    fn an_empty_block_from_torchgpipe_gets_the_fallback() {
        let costs = [2.0, 10.0, 2.0, 100.0, 5.0];
        assert_eq!(torchgpipe_ends(&costs, 4), None);
        assert_eq!(balance_cost(&costs, 4).unwrap(), vec![2, 1, 1, 1]);
    }

    /// SplitMix64, for seeded cost vectors without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Every composition of `n` into `k` positive parts, by brute force: the one with the
    /// least largest block sum, earlier blocks longest among those.
    fn brute_force(costs: &[f64], k: usize) -> Vec<usize> {
        fn walk(
            costs: &[f64],
            k: usize,
            lens: &mut Vec<usize>,
            best: &mut Option<(f64, Vec<usize>)>,
        ) {
            let used: usize = lens.iter().sum();
            if lens.len() + 1 == k {
                lens.push(costs.len() - used);
                let mut start = 0;
                let mut largest = f64::NEG_INFINITY;
                for &len in lens.iter() {
                    largest = largest.max(costs[start..start + len].iter().sum());
                    start += len;
                }
                // Lengths are tried longest first, so the first with the least bound wins.
                if best.as_ref().is_none_or(|(b, _)| largest < *b) {
                    *best = Some((largest, lens.clone()));
                }
                lens.pop();
                return;
            }
            let room = costs.len() - used - (k - lens.len() - 1);
            for len in (1..=room).rev() {
                lens.push(len);
                walk(costs, k, lens, best);
                lens.pop();
            }
        }
        let mut best = None;
        walk(costs, k, &mut Vec::new(), &mut best);
        best.map(|(_, lens)| lens).unwrap_or_default()
    }

    #[test]
    fn random_costs_always_give_a_valid_balance() {
        const CHOICES: [u32; 7] = [0, 1, 2, 3, 5, 10, 100];
        let mut rng = Rng(2024);
        let (mut torchgpipe, mut fallback) = (0, 0);
        for _ in 0..4000 {
            let n = 1 + rng.below(10);
            let k = 1 + rng.below(n);
            let costs: Vec<u32> = (0..n)
                .map(|_| match rng.below(8) {
                    7 => rng.below(1001) as u32,
                    c => CHOICES[c],
                })
                .collect();
            let values: Vec<f64> = costs.iter().map(|&c| f64::from(c)).collect();
            let balance = balance_cost(&costs, k).unwrap();
            assert_eq!(balance.len(), k, "{costs:?} into {k}");
            assert_eq!(balance.iter().sum::<usize>(), n, "{costs:?} into {k}");
            assert!(
                balance.iter().all(|&b| b >= 1),
                "{costs:?} into {k}: {balance:?}"
            );
            let blocks = block_partition(&costs, k).unwrap();
            assert_eq!(blocks.concat(), costs);
            assert_eq!(blocks.iter().map(Vec::len).collect::<Vec<_>>(), balance);
            match torchgpipe_ends(&values, k) {
                Some(ends) => {
                    torchgpipe += 1;
                    assert_eq!(balance_cost(&values, k).unwrap(), balance);
                    assert_eq!(*ends.last().unwrap(), n);
                }
                None => {
                    fallback += 1;
                    assert_eq!(balance, brute_force(&values, k), "{costs:?} into {k}");
                }
            }
        }
        // Both paths ran (about 2% of these vectors need the fallback).
        assert!(
            torchgpipe > 3000 && fallback > 20,
            "{torchgpipe} / {fallback}"
        );
    }

    /// Costs torchgpipe never sees (negative, infinite, NaN) still give a balance.
    #[test]
    fn odd_float_costs_never_panic() {
        let odd = [
            -3.0,
            0.0,
            1.5,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            1e300,
        ];
        let mut rng = Rng(7);
        for _ in 0..2000 {
            let n = 1 + rng.below(9);
            let k = 1 + rng.below(n);
            let costs: Vec<f64> = (0..n).map(|_| odd[rng.below(odd.len())]).collect();
            let balance = balance_cost(&costs, k).unwrap();
            assert_eq!(balance.len(), k);
            assert_eq!(balance.iter().sum::<usize>(), n);
            assert!(balance.iter().all(|&b| b >= 1), "{costs:?} into {k}");
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        let d = Duration::from_millis;
        assert_eq!(median(vec![d(3), d(1), d(2)]), d(2));
        assert_eq!(median(vec![d(4), d(1), d(2), d(3)]), d(3));
    }
}
