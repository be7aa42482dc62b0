//! [`PipeBuilder`]: a [`Pipe`](crate::Pipe)'s settings, checked when it is built.

use std::sync::Arc;
use std::time::Duration;

use skip::Declaration;

use crate::error::Error;
use crate::frame::{Control, DeclWire};
use crate::layer::Layer;
use crate::portal::SkipPlan;
use crate::ranks::Ranks;
use crate::schedule::ScheduleKind;
use crate::stage::Checkpoint;
use crate::tensor::Tensor;
use crate::transport::Transport;
use crate::vocab::Device;
use crate::wire::Wire;

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
    ranks: Option<Arc<Ranks<T>>>,
}

impl<T: Wire> PipeBuilder<T> {
    /// Stages on ranks: partition `j` runs on rank `stage_ranks[j]` of `transport`, and
    /// this rank builds only its own partitions' layers. The `layers` given to
    /// [`Pipe::builder`](crate::Pipe::builder) are this rank's partitions' layers, in
    /// order; the balance is the global one, the same on every rank, as are the other
    /// settings (checked when the pipe is built: [`Error::RankMismatch`]).
    ///
    /// [`build`](PipeBuilder::build) then meets every other rank of the pipe over the
    /// transport to exchange the layers' skip declarations (a skip may cross ranks: its
    /// value moves straight from the stashing rank to the popping one). Skips that cross
    /// ranks must name the same namespace on both sides: the default one, or
    /// [`skip::Namespace`]s created in the same order in each process.
    ///
    /// Each rank then calls the same [`Pipe`](crate::Pipe) methods in the same order:
    /// the rank of partition 0 passes the inputs, the others pass an empty batch
    /// (`Batch::new(Vec::new())`); the loss runs on the last partition's rank, and
    /// outputs, input gradients and losses come back where they are (elsewhere empty).
    pub fn on_ranks(mut self, transport: Arc<dyn Transport>, stage_ranks: &[usize]) -> Self {
        self.ranks = Some(Arc::new(Ranks::new(transport, stage_ranks.to_vec())));
        self
    }

    /// [`on_ranks`](PipeBuilder::on_ranks) with partition `j` on rank `j`.
    pub fn stages_on_ranks(self, transport: Arc<dyn Transport>) -> Self {
        let ranks: Vec<usize> = (0..self.balance.len()).collect();
        self.on_ranks(transport, &ranks)
    }
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
            ranks: None,
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
        let sum: usize = match &self.ranks {
            Some(ranks) => local_layers(ranks, &self.balance)?,
            None => self.balance.iter().sum(),
        };
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
        let config = self.config();
        let mut devices = self.devices.take().unwrap_or_else(|| vec![Device::Cpu; n]);
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
        let local: Vec<Declaration> = self.layers.iter().map(|l| l.skips()).collect();
        let decls = match &self.ranks {
            Some(ranks) => exchange(ranks, &config, &self.balance, local, self.timeout)?,
            None => local,
        };
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
        for (j, &size) in self.balance.iter().enumerate() {
            first_layer.push(next);
            let here = self.ranks.as_ref().is_none_or(|r| r.is_local(j));
            partitions.push(if here {
                layers.by_ref().take(size).collect()
            } else {
                Vec::new()
            });
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
            balance: self.balance,
            ranks: self.ranks,
        })
    }

    /// The settings every rank of a pipe on ranks must share, as text to compare.
    fn config(&self) -> String {
        format!(
            "balance {:?}, stages on ranks {:?}, chunks {}, checkpoint {:?}, schedule {:?}, \
             seed {}, deferred batch norm {}, deferred weight gradients {}",
            self.balance,
            self.ranks.as_ref().map(|r| r.stage_rank.clone()),
            self.chunks,
            self.checkpoint,
            self.schedule,
            self.seed,
            self.deferred_batch_norm,
            self.defer_weight_grads
        )
    }
}

/// Checks a placement of stages on ranks and returns the number of layers this rank's
/// partitions hold.
fn local_layers<T>(ranks: &Ranks<T>, balance: &[usize]) -> Result<usize, Error> {
    let n = balance.len();
    let size = ranks.transport.ranks();
    if ranks.stage_rank.len() != n {
        return Err(Error::Placement(format!(
            "{} ranks given for {n} partitions",
            ranks.stage_rank.len()
        )));
    }
    if let Some(&r) = ranks.stage_rank.iter().find(|&&r| r >= size) {
        return Err(Error::Placement(format!(
            "rank {r} is not one of the transport's {size} ranks"
        )));
    }
    if ranks.rank() >= size {
        return Err(Error::Placement(format!(
            "the transport's rank {} is not below its size {size}",
            ranks.rank()
        )));
    }
    Ok((0..n)
        .filter(|&j| ranks.is_local(j))
        .map(|j| balance[j])
        .sum())
}

/// Sends this rank's settings and skip declarations (`local`, its layers' in order) to
/// every other rank of the pipe and receives theirs: every layer's declaration, by
/// global index, the same on every rank.
fn exchange<T>(
    ranks: &Ranks<T>,
    config: &str,
    balance: &[usize],
    local: Vec<Declaration>,
    timeout: Duration,
) -> Result<Vec<Declaration>, Error> {
    let total: usize = balance.iter().sum();
    let mut all = vec![Declaration::new(); total];
    let mut mine = Vec::new();
    let mut local = local.into_iter();
    let mut next = 0;
    for (j, &size) in balance.iter().enumerate() {
        let here = ranks.is_local(j);
        for (layer, slot) in all.iter_mut().enumerate().skip(next).take(size) {
            if !here {
                continue;
            }
            let decl = local.next().unwrap_or_default();
            if !decl.is_empty() {
                mine.push(DeclWire {
                    layer,
                    stash: decl.stash_names().to_vec(),
                    pop: decl.pop_names().to_vec(),
                    namespaces: decl
                        .stash_names()
                        .iter()
                        .chain(decl.pop_names())
                        .map(|n| (n.clone(), decl.namespace(n).id()))
                        .filter(|(_, ns)| *ns != 0)
                        .collect(),
                });
            }
            *slot = decl;
        }
        next += size;
    }
    let hello = Control::Decls {
        config: config.to_string(),
        decls: mine,
    };
    let peers = ranks.peers();
    for &peer in &peers {
        ranks.send_control(peer, &hello)?;
    }
    for &peer in &peers {
        match ranks.recv_control(peer, timeout)? {
            Control::Decls {
                config: theirs,
                decls,
            } => {
                if theirs != config {
                    return Err(Error::RankMismatch {
                        rank: ranks.rank(),
                        other: peer,
                        why: format!("settings {config} here, {theirs} there"),
                    });
                }
                for d in decls {
                    let Some(slot) = all.get_mut(d.layer) else {
                        return Err(Error::Frame(format!(
                            "rank {peer} declared skips for layer {}, of {total}",
                            d.layer
                        )));
                    };
                    let mut decl = Declaration::new().stash(d.stash).pop(d.pop);
                    for (name, ns) in d.namespaces {
                        decl = decl.isolate_only(skip::Namespace::from_id(ns), [name]);
                    }
                    *slot = decl;
                }
            }
            other => {
                return Err(Error::Frame(format!(
                    "rank {peer} sent {other:?} while the pipe was being built"
                )))
            }
        }
    }
    ranks
        .transport
        .flush(timeout)
        .map_err(|source| Error::Transport {
            rank: ranks.rank(),
            peer: ranks.rank(),
            source,
        })?;
    Ok(all)
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
    /// Layers per partition, over every rank.
    pub balance: Vec<usize>,
    pub ranks: Option<Arc<Ranks<T>>>,
}
