//! [`PipeBuilder`]: a [`Pipe`](crate::Pipe)'s settings, checked when it is built.

use std::time::Duration;

use skip::Declaration;

use crate::error::Error;
use crate::layer::Layer;
use crate::portal::SkipPlan;
use crate::schedule::ScheduleKind;
use crate::stage::Checkpoint;
use crate::tensor::Tensor;
use crate::vocab::Device;

/// The default bound on every wait between workers.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Builds a [`Pipe`](crate::Pipe); see [`Pipe::builder`](crate::Pipe::builder).
pub struct PipeBuilder<T: Tensor> {
    layers: Vec<Box<dyn Layer<T>>>,
    balance: Vec<usize>,
    devices: Option<Vec<Device>>,
    chunks: usize,
    checkpoint: Checkpoint,
    schedule: ScheduleKind,
    timeout: Duration,
    seed: u64,
    record: bool,
    deferred_batch_norm: bool,
    defer_weight_grads: bool,
}

impl<T: Tensor> PipeBuilder<T> {
    /// The defaults: one chunk, [`Checkpoint::default`], [`ScheduleKind::default`],
    /// [`DEFAULT_TIMEOUT`], seed 0, no recording, nothing deferred.
    pub(super) fn new(layers: Vec<Box<dyn Layer<T>>>, balance: &[usize]) -> Self {
        PipeBuilder {
            layers,
            balance: balance.to_vec(),
            devices: None,
            chunks: 1,
            checkpoint: Checkpoint::default(),
            schedule: ScheduleKind::default(),
            timeout: DEFAULT_TIMEOUT,
            seed: 0,
            record: false,
            deferred_batch_norm: false,
            defer_weight_grads: false,
        }
    }

    /// One device per partition (more are dropped; fewer is an error). Default: unpinned
    /// [`Device::Cpu`] for each.
    pub fn devices(mut self, devices: Vec<Device>) -> Self {
        self.devices = Some(devices);
        self
    }

    /// Micro-batches per mini-batch (at most; a smaller batch gets one per sample).
    /// Default 1.
    pub fn chunks(mut self, chunks: usize) -> Self {
        self.chunks = chunks;
        self
    }

    /// The checkpoint mode. Default [`Checkpoint::ExceptLast`].
    pub fn checkpoint(mut self, checkpoint: Checkpoint) -> Self {
        self.checkpoint = checkpoint;
        self
    }

    /// The schedule [`Pipe::step`](crate::Pipe::step) runs. Default [`ScheduleKind::GPipe`].
    pub fn schedule(mut self, schedule: ScheduleKind) -> Self {
        self.schedule = schedule;
        self
    }

    /// The bound on every wait between workers. Default [`DEFAULT_TIMEOUT`].
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The seed of the layers' random streams. Default 0.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Whether to record spans of every run (see
    /// [`Pipe::take_record`](crate::Pipe::take_record)). Default off.
    pub fn record(mut self, record: bool) -> Self {
        self.record = record;
        self
    }

    /// torchgpipe's `deferred_batch_norm`: when on, every batch-norm layer accumulates its
    /// running statistics over all micro-batches of a mini-batch and commits them once per
    /// mini-batch ([`Layer::defer_batch_norm`]), so they equal plain batch norm's over the
    /// whole batch. Normalisation itself still uses each micro-batch's statistics.
    /// Default off.
    pub fn deferred_batch_norm(mut self, on: bool) -> Self {
        self.deferred_batch_norm = on;
        self
    }

    /// Deferred weight gradients (the B/W split of zero-bubble schedules): a backward action
    /// computes only its input gradient and lets each layer keep what its weight gradient
    /// needs ([`Context::defers_weight_grads`](crate::Context::defers_weight_grads)); right
    /// after a partition's last backward action of a run, each of its layers adds them
    /// ([`Layer::flush_grads`]): [`Linear`](crate::cpu::Linear) as one product over every
    /// micro-batch's rows, about as fast per row as the whole batch, and off the pipeline's
    /// critical path (the bubble no longer waits for weight gradients). Gradients are the
    /// same sums, bit for bit on AVX-512. The cost is memory: a deferring layer holds its
    /// input and output gradient for every micro-batch until the flush, counted in
    /// [`Memory::deferred`](crate::Memory::deferred); this undoes what checkpointing and 1F1B
    /// save on activations, so leave it off where memory binds. Default off.
    pub fn defer_weight_grads(mut self, on: bool) -> Self {
        self.defer_weight_grads = on;
        self
    }

    /// [`build`](PipeBuilder::build)'s checks and split, in its order.
    pub(super) fn check(mut self) -> Result<Checked<T>, Error> {
        if self.chunks == 0 {
            return Err(Error::Chunks(self.chunks));
        }
        let sum: usize = self.balance.iter().sum();
        if sum != self.layers.len() {
            return Err(Error::BalanceLength {
                layers: self.layers.len(),
                sum,
            });
        }
        if self.balance.contains(&0) {
            return Err(Error::BalanceNotPositive {
                balance: self.balance,
            });
        }
        let n = self.balance.len();
        let mut devices = self.devices.unwrap_or_else(|| vec![Device::Cpu; n]);
        if devices.len() < n {
            return Err(Error::TooFewDevices {
                devices: devices.len(),
                partitions: n,
            });
        }
        devices.truncate(n);
        if self.timeout.is_zero() {
            return Err(Error::ZeroTimeout);
        }
        let decls: Vec<Declaration> = self.layers.iter().map(|l| l.skips()).collect();
        let skips = SkipPlan::new(decls, &self.balance)?;
        if self.deferred_batch_norm {
            for layer in &mut self.layers {
                layer.defer_batch_norm();
            }
        }
        let mut layers = self.layers.into_iter();
        let mut first_layer = Vec::with_capacity(n);
        let mut partitions = Vec::with_capacity(n);
        let mut next = 0;
        for &size in &self.balance {
            first_layer.push(next);
            partitions.push(layers.by_ref().take(size).collect());
            next += size;
        }
        Ok(Checked {
            partitions,
            first_layer,
            devices,
            skips,
            chunks: self.chunks,
            checkpoint: self.checkpoint,
            schedule: self.schedule,
            timeout: self.timeout,
            seed: self.seed,
            record: self.record,
            defer_weight_grads: self.defer_weight_grads,
        })
    }
}

/// A checked builder: the layers split into partitions, and the settings.
pub(super) struct Checked<T: Tensor> {
    pub partitions: Vec<Vec<Box<dyn Layer<T>>>>,
    pub first_layer: Vec<usize>,
    pub devices: Vec<Device>,
    pub skips: SkipPlan,
    pub chunks: usize,
    pub checkpoint: Checkpoint,
    pub schedule: ScheduleKind,
    pub timeout: Duration,
    pub seed: u64,
    pub record: bool,
    pub defer_weight_grads: bool,
}
