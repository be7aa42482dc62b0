//! Shared helpers: small models, data, a loss, and the unpipelined reference run.
#![allow(dead_code)]

use pipe::cpu::{BatchNorm, CpuTensor, Dropout, Linear, ReLU};

use pipe::{Batch, Context, Error, Layer, MicroBatch, Phase, Saved, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};

pub type Layers = Vec<Box<dyn Layer<CpuTensor>>>;

pub const SEED: u64 = 42;

/// Four layers without batch norm: Linear, ReLU, Dropout, Linear.
pub fn plain_model() -> Layers {
    vec![
        Box::new(Linear::new(5, 8, 1)),
        Box::new(ReLU),
        Box::new(Dropout::new(0.3).unwrap()),
        Box::new(Linear::new(8, 3, 2)),
    ]
}

/// Four layers with batch norm: Linear, BatchNorm, Dropout, Linear.
pub fn bn_model() -> Layers {
    vec![
        Box::new(Linear::new(5, 8, 3)),
        Box::new(BatchNorm::new(8)),
        Box::new(Dropout::new(0.3).unwrap()),
        Box::new(Linear::new(8, 3, 4)),
    ]
}

/// A `[rows, cols]` tensor of deterministic values in about [-1, 1].
pub fn data(rows: usize, cols: usize, salt: u64) -> CpuTensor {
    let rng = pipe::Stream::new(salt, 0, 0);
    CpuTensor::from_shape_vec(
        &[rows, cols],
        (0..rows * cols)
            .map(|k| 2.0 * rng.sample((k / cols) as u64).uniform((k % cols) as u64) - 1.0)
            .collect(),
    )
    .unwrap()
}

/// Rows `mb.offset .. mb.offset + mb.len` of `t`.
pub fn rows(t: &CpuTensor, mb: MicroBatch) -> CpuTensor {
    CpuTensor::new(
        t.array()
            .slice_axis(ndarray::Axis(0), (mb.offset..mb.offset + mb.len).into())
            .to_owned(),
    )
}

/// Half the squared error against `target`'s rows of this micro-batch: loss and gradient.
pub fn mse(
    target: &CpuTensor,
    mb: MicroBatch,
    out: &Batch<CpuTensor>,
) -> Result<(f32, Batch<CpuTensor>), Error> {
    let y = out.tensor(0)?;
    let t = rows(target, mb);
    let g = CpuTensor::new(y.array() - t.array());
    let loss = g.array().iter().map(|v| 0.5 * v * v).sum();
    Ok((loss, Batch::single(g)))
}

/// Every parameter gradient, in layer order.
pub fn grads(layers: &[Box<dyn Layer<CpuTensor>>]) -> Vec<CpuTensor> {
    layers
        .iter()
        .flat_map(|l| l.parameters().into_iter().map(|p| p.grad.clone()))
        .collect()
}

/// What the reference run produces.
pub struct Reference {
    pub outputs: Vec<CpuTensor>,
    pub input_grads: Vec<CpuTensor>,
    /// `saved_bytes[mb][layer]`: bytes each layer's forward saved.
    pub saved_bytes: Vec<Vec<usize>>,
    /// `input_bytes[mb][layer]`: bytes of each layer's input.
    pub input_bytes: Vec<Vec<usize>>,
}

/// Runs `layers` unpipelined, in one thread, over the micro-batches of `plan`: every
/// forward in micro-batch order, then the backwards in `backward_order`, with the loss
/// [`mse`] against `target`.
pub fn reference(
    layers: &mut [Box<dyn Layer<CpuTensor>>],
    x: &CpuTensor,
    target: &CpuTensor,
    plan: &[MicroBatch],
    backward_order: &[usize],
    step: u64,
) -> Reference {
    let mut outputs = Vec::new();
    let mut saved: Vec<Vec<Saved<CpuTensor>>> = Vec::new();
    let mut saved_bytes = Vec::new();
    let mut input_bytes = Vec::new();
    for &mb in plan {
        let mut b = Batch::single(rows(x, mb));
        let (mut states, mut sizes, mut ins) = (Vec::new(), Vec::new(), Vec::new());
        for (l, layer) in layers.iter_mut().enumerate() {
            let mut ctx = Context::new(true, SEED, step, mb.len)
                .with_layer(l)
                .with_micro_batch(mb);
            ins.push(b.size_bytes());
            let (y, s) = layer.forward(b, &mut ctx).unwrap();
            sizes.push(s.size_bytes());
            states.push(s);
            b = y;
        }
        outputs.push(b.into_single().unwrap());
        saved.push(states);
        saved_bytes.push(sizes);
        input_bytes.push(ins);
    }
    let mut input_grads: Vec<Option<CpuTensor>> = vec![None; plan.len()];
    for &i in backward_order {
        let mb = plan[i];
        let (_, mut g) = mse(target, mb, &Batch::single(outputs[i].clone())).unwrap();
        let mut states = std::mem::take(&mut saved[i]);
        for l in (0..layers.len()).rev() {
            let mut ctx = Context::new(true, SEED, step, mb.len)
                .with_layer(l)
                .with_micro_batch(mb)
                .with_phase(Phase::Backward);
            g = layers[l]
                .backward(g, states.pop().unwrap(), &mut ctx)
                .unwrap();
        }
        input_grads[i] = Some(g.into_single().unwrap());
    }
    Reference {
        outputs,
        input_grads: input_grads.into_iter().map(Option::unwrap).collect(),
        saved_bytes,
        input_bytes,
    }
}

/// `max |a - b| / max |b|`.
pub fn relative(a: &CpuTensor, b: &CpuTensor) -> f32 {
    a.max_abs_diff(b).expect("shapes differ") / b.max_abs().max(f32::MIN_POSITIVE)
}

/// Concatenates micro-batch tensors.
pub fn cat(parts: &[CpuTensor]) -> CpuTensor {
    CpuTensor::concat(parts.to_vec()).unwrap()
}

/// One layer call seen by a [`Probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub tag: usize,
    pub micro_batch: usize,
    pub phase: Phase,
    pub checkpointing: bool,
    pub recomputing: bool,
}

pub type Log = std::sync::Arc<std::sync::Mutex<Vec<Event>>>;

pub fn new_log() -> Log {
    Log::default()
}

pub fn events(log: &Log) -> Vec<Event> {
    log.lock().unwrap().clone()
}

/// What a [`Probe`] does at one call.
pub type Hook = Box<dyn Fn(&Event) -> Result<(), Error> + Send>;

/// An identity layer that logs every call, and can fail, panic or block on demand.
pub struct Probe {
    pub tag: usize,
    pub log: Log,
    pub hook: Option<Hook>,
}

impl Probe {
    pub fn new(tag: usize, log: &Log) -> Self {
        Probe {
            tag,
            log: log.clone(),
            hook: None,
        }
    }

    pub fn with(
        tag: usize,
        log: &Log,
        hook: impl Fn(&Event) -> Result<(), Error> + Send + 'static,
    ) -> Self {
        Probe {
            tag,
            log: log.clone(),
            hook: Some(Box::new(hook)),
        }
    }

    fn call(&self, ctx: &Context) -> Result<(), Error> {
        let event = Event {
            tag: self.tag,
            micro_batch: ctx.micro_batch().index,
            phase: ctx.phase(),
            checkpointing: ctx.is_checkpointing(),
            recomputing: ctx.is_recomputing(),
        };
        self.log.lock().unwrap().push(event);
        match &self.hook {
            Some(hook) => hook(&event),
            None => Ok(()),
        }
    }
}

impl Layer<CpuTensor> for Probe {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        self.call(ctx)?;
        Ok((input, Saved::none()))
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        self.call(ctx)?;
        Ok(grad)
    }
}

/// A loss whose gradient is all ones (the loss is the sum of the first output).
pub fn sum_loss(_mb: MicroBatch, out: &Batch<CpuTensor>) -> Result<(f32, Batch<CpuTensor>), Error> {
    let y = out.tensor(0)?;
    Ok((y.array().sum(), Batch::single(CpuTensor::ones(y.shape()))))
}

/// A user layer's own error type.
#[derive(Debug, thiserror::Error)]
#[error("probe failed on purpose")]
pub struct OnPurpose;

/// A batch norm the test can look into while the pipe owns it.
#[derive(Clone)]
pub struct Watched(pub Arc<Mutex<BatchNorm>>);

impl Watched {
    pub fn new(bn: BatchNorm) -> Self {
        Watched(Arc::new(Mutex::new(bn)))
    }

    pub fn get(&self) -> MutexGuard<'_, BatchNorm> {
        self.0.lock().unwrap()
    }

    /// The running mean and variance.
    pub fn stats(&self) -> (Vec<f32>, Vec<f32>) {
        let bn = self.get();
        (bn.running_mean().to_vec(), bn.running_var().to_vec())
    }
}

impl Layer<CpuTensor> for Watched {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        self.get().forward(input, ctx)
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        saved: Saved<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        self.get().backward(grad, saved, ctx)
    }

    fn defer_batch_norm(&mut self) -> bool {
        self.get().defer_batch_norm()
    }
}
