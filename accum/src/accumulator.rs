//! `Accumulator`: which micro-steps synchronise, their loss scale, and the gates.

use crate::{Error, GradSync, SyncGuard};

/// How an [`Accumulator`] groups micro-steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Micro-steps per accumulation group (at least 1).
    pub num_steps: usize,
    /// Synchronise gradients on every micro-step (the optimizer still steps once per
    /// group). Costs communication; saves memory where the engine needs it (Accelerate's
    /// FSDP case).
    pub sync_each_batch: bool,
    /// The last micro-step of an epoch always synchronises and closes the group, so no
    /// gradients are carried across epochs (Accelerate's `sync_with_dataloader`).
    pub sync_at_end_of_data: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            num_steps: 1,
            sync_each_batch: false,
            sync_at_end_of_data: true,
        }
    }
}

/// What one micro-step does. Obtained from [`Accumulator::next_step`] before the
/// micro-step's forward pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    index: u64,
    position: usize,
    group_size: usize,
    sync: bool,
    communicate: bool,
    end_of_data: bool,
}

impl Step {
    /// Whether this micro-step closes its group: its gradients are the group's reduced
    /// sum, and the optimizer steps.
    pub fn sync_gradients(&self) -> bool {
        self.sync
    }

    /// Whether the backward pass of this micro-step communicates (on sync steps, and on
    /// every step with `sync_each_batch`).
    pub fn communicates(&self) -> bool {
        self.communicate
    }

    /// The factor to multiply this micro-step's loss by: `1 / group size`, where a short
    /// last group of an epoch counts its actual size, so every group's gradient is a mean.
    pub fn loss_scale(&self) -> f32 {
        1.0 / self.group_size as f32
    }

    /// Micro-steps in this step's group.
    pub fn group_size(&self) -> usize {
        self.group_size
    }

    /// 0-based position of this step in its group.
    pub fn position_in_group(&self) -> usize {
        self.position
    }

    /// Whether this is the last micro-step of the epoch.
    pub fn end_of_data(&self) -> bool {
        self.end_of_data
    }

    /// Micro-steps taken before this one, over the accumulator's life.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// Sets `target`'s synchronisation for this micro-step until the returned guard is
    /// dropped: off unless it [communicates](Self::communicates), and on a communicating
    /// step left as it is (Accelerate's `accumulate` enters `no_sync` or nothing, so an
    /// outer [`no_sync`](crate::no_sync) stays in force). Also tells the target whether
    /// gradients go on accumulating after this micro-step
    /// ([`GradSync::set_accumulating`]: every micro-step of a group but its last). Call it
    /// before the forward pass and keep the guard through the backward pass.
    pub fn apply<'a, S: GradSync + ?Sized>(&self, target: &'a mut S) -> SyncGuard<'a, S> {
        let on = self.communicate && target.sync_enabled();
        SyncGuard::with_accumulating(target, on, !self.sync)
    }

    /// Runs `f` on sync steps only; the gate for anything done once per group.
    pub fn on_sync<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.sync.then(f)
    }

    /// Gate for the optimizer step (same as [`on_sync`](Self::on_sync)).
    pub fn optimizer_step<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.on_sync(f)
    }

    /// Gate for zeroing gradients (same as [`on_sync`](Self::on_sync)): gradients must
    /// survive until the group's optimizer step.
    pub fn zero_grad<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.on_sync(f)
    }

    /// Gate for the learning-rate scheduler: it steps with the optimizer, once per group
    /// (same as [`on_sync`](Self::on_sync)), whatever the number of processes. Accelerate
    /// steps a prepared scheduler `num_processes` times per optimizer step when
    /// `split_batches` is off; size a schedule ported from it in optimizer steps (its
    /// total divided by the number of processes).
    pub fn scheduler_step<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.on_sync(f)
    }
}

#[derive(Clone, Copy, Debug)]
struct EpochState {
    len: usize,
    taken: usize,
    /// The length was known from the start (not a stream), so the last group's size is.
    sized: bool,
}

/// Decides, micro-step by micro-step, when gradients synchronise (Accelerate's
/// `accumulate`), with two corrections to it: the
/// short last group of an epoch is scaled by its actual size, and the scheduler is gated
/// with the optimizer.
///
/// Sync rule: a micro-step synchronises when it is the `num_steps`-th since the last
/// sync, or (with `sync_at_end_of_data`) the last of its epoch.
#[derive(Clone, Debug)]
pub struct Accumulator {
    config: Config,
    since_sync: usize,
    epoch: Option<EpochState>,
    taken: u64,
    last_sync: bool,
}

impl Accumulator {
    /// Groups of `num_steps` micro-steps, other settings default.
    pub fn new(num_steps: usize) -> Result<Self, Error> {
        Self::with_config(Config {
            num_steps,
            ..Config::default()
        })
    }

    /// An accumulator with the given configuration.
    pub fn with_config(config: Config) -> Result<Self, Error> {
        if config.num_steps == 0 {
            return Err(Error::InvalidNumSteps(0));
        }
        Ok(Accumulator {
            config,
            since_sync: 0,
            epoch: None,
            taken: 0,
            last_sync: true,
        })
    }

    /// The configuration.
    pub fn config(&self) -> Config {
        self.config
    }

    /// Announces an epoch of `len` micro-steps, so the accumulator knows which one is last
    /// and how long the last group is. Use [`epoch`](Self::epoch) to do this from an
    /// iterator.
    pub fn start_epoch(&mut self, len: usize) {
        self.epoch = Some(EpochState {
            len,
            taken: 0,
            sized: len != usize::MAX,
        });
    }

    /// Decides the next micro-step. Call before its forward pass.
    pub fn next_step(&mut self) -> Result<Step, Error> {
        let epoch = self.epoch.as_mut().ok_or(Error::NoEpoch)?;
        if epoch.taken == epoch.len {
            return Err(Error::EpochOver { len: epoch.len });
        }
        let remaining = epoch.len - epoch.taken; // including this step
        epoch.taken += 1;
        let n = self.config.num_steps;
        let position = self.since_sync;
        let end_of_data = remaining == 1;
        let (group_size, sync) = if self.config.sync_at_end_of_data {
            (
                if epoch.sized {
                    n.min(position + remaining)
                } else {
                    n
                },
                position + 1 == n || end_of_data,
            )
        } else {
            (n, position + 1 == n)
        };
        self.since_sync = if sync { 0 } else { position + 1 };
        self.last_sync = sync;
        let step = Step {
            index: self.taken,
            position,
            group_size,
            sync,
            communicate: sync || self.config.sync_each_batch,
            end_of_data,
        };
        self.taken += 1;
        Ok(step)
    }

    /// Whether the most recent micro-step synchronised (true before the first).
    pub fn sync_gradients(&self) -> bool {
        self.last_sync
    }

    /// An epoch of unknown length, until the next [`start_epoch`](Self::start_epoch):
    /// micro-steps synchronise every `num_steps` (Accelerate's rule outside a prepared
    /// dataloader) and none is the end of the data. To have the last batch of a stream
    /// close its group, iterate it with [`stream`](Self::stream).
    pub fn start_unbounded(&mut self) {
        self.start_epoch(usize::MAX);
    }

    /// Iterates `batches`, of a length not known in advance (an iterable dataset), as
    /// one epoch, pairing each batch with its [`Step`]. It looks one batch ahead, as
    /// Accelerate's dataloader does for iterable datasets, so the last batch is the end of
    /// the data: with `sync_at_end_of_data` it synchronises and closes its group. The
    /// size of that last group is not known before it ends, so every step of a stream
    /// reports [`group_size`](Step::group_size) `num_steps` (Accelerate's loss scale):
    /// a short last group is scaled by `1 / num_steps`, not by its own size.
    pub fn stream<I: Iterator>(&mut self, batches: I) -> Stream<'_, I> {
        self.start_unbounded();
        Stream {
            acc: self,
            batches: batches.peekable(),
        }
    }

    /// Iterates `batches` as one epoch, pairing each batch with its [`Step`]. An iterator
    /// that yields more items than its `len()` promised is cut at `len()`.
    pub fn epoch<I: ExactSizeIterator>(&mut self, batches: I) -> Epoch<'_, I> {
        self.start_epoch(batches.len());
        Epoch { acc: self, batches }
    }
}

/// An epoch of batches paired with their steps; see [`Accumulator::epoch`].
pub struct Epoch<'a, I> {
    acc: &'a mut Accumulator,
    batches: I,
}

/// A stream of batches paired with their steps; see [`Accumulator::stream`].
pub struct Stream<'a, I: Iterator> {
    acc: &'a mut Accumulator,
    batches: std::iter::Peekable<I>,
}

impl<I: Iterator> Iterator for Stream<'_, I> {
    type Item = (Step, I::Item);

    fn next(&mut self) -> Option<Self::Item> {
        let batch = self.batches.next()?;
        if self.batches.peek().is_none() {
            // The last batch: the epoch ends with it.
            if let Some(epoch) = self.acc.epoch.as_mut() {
                epoch.len = epoch.taken + 1;
            }
        }
        let step = self.acc.next_step().ok()?;
        Some((step, batch))
    }
}

impl<I: Iterator> Iterator for Epoch<'_, I> {
    type Item = (Step, I::Item);

    fn next(&mut self) -> Option<Self::Item> {
        let batch = self.batches.next()?;
        let step = self.acc.next_step().ok()?;
        Some((step, batch))
    }
}
