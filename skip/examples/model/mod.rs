//! A small U-Net-like stack of element-wise layers, written twice: once with `skip`
//! (encoders stash, decoders pop) and once with the residuals threaded explicitly through
//! every layer's output. Shared by `examples/unet.rs` and `tests/unet.rs`.
//!
//! Layers on vectors of `f64`, each with an explicit backward pass:
//! - plain: `y = w*x + b`;
//! - encoder: the same, and it stashes its output `y` (which also feeds the next layer,
//!   so its backward pass adds the skip's gradient to the one coming down the stack);
//! - decoder: pops the matching encoder's output `e` and returns `y = w*x + b + s*e`.
//!
//! Both versions call the same arithmetic in the same order, so their results must be
//! identical to the bit; any difference is a skip routed to the wrong layer, or a gradient
//! lost or added twice.

use std::ops::Range;

use skip::{Declaration, Error, Grads, Namespace, Skips, Tracker};

/// What a layer does with skips.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// No skip.
    Plain,
    /// Stashes its output under "skip".
    Encoder,
    /// Pops "skip" and adds it, scaled, to its output.
    Decoder,
}

/// One layer: its weights and its skip declaration.
#[derive(Clone, Debug)]
pub struct Layer {
    /// What it does with skips.
    pub kind: Kind,
    w: Vec<f64>,
    b: Vec<f64>,
    s: Vec<f64>,
    /// The declaration the `skip` version uses.
    pub decl: Declaration,
}

/// A sequence of layers.
#[derive(Clone, Debug)]
pub struct Model {
    /// The layers, in order.
    pub layers: Vec<Layer>,
}

/// What a layer's forward pass keeps for its backward pass.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    x: Vec<f64>,
    skip: Option<Vec<f64>>,
}

/// The gradients of one layer's parameters: `w`, `b`, `s` (zeros for layers without `s`).
pub type ParamGrads = [Vec<f64>; 3];

/// Everything one micro-batch produces: the output, the gradient of the loss
/// `0.5 * |y|^2` with respect to the input, and every parameter gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct Pass {
    /// The model's output.
    pub output: Vec<f64>,
    /// Gradient with respect to the input.
    pub input_grad: Vec<f64>,
    /// Per layer.
    pub param_grads: Vec<ParamGrads>,
}

/// A deterministic stream of numbers in [-1, 1) (xorshift64*).
pub struct Rng(u64);

impl Rng {
    /// A stream from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next number in [-1, 1).
    pub fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        bits as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    /// `n` numbers in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.next_f64()).collect()
    }
}

impl Model {
    /// The U-Net-like stack: three encoders (each its own namespace, one block type used
    /// three times), a plain bottleneck, three decoders popping in reverse order (nested
    /// skips 2->4, 1->5, 0->6), a plain head: 8 layers of `width` elements.
    pub fn unet(width: usize, seed: u64) -> Model {
        let mut rng = Rng::new(seed);
        let ns: Vec<Namespace> = (0..3).map(|_| Namespace::new()).collect();
        let mut layer = |kind: Kind, ns: Option<Namespace>| {
            let decl = match kind {
                Kind::Plain => Declaration::new(),
                Kind::Encoder => Declaration::new().stash(["skip"]),
                Kind::Decoder => Declaration::new().pop(["skip"]),
            };
            let decl = match ns {
                Some(ns) => decl.isolate(ns),
                None => decl,
            };
            Layer {
                kind,
                w: rng.vec(width),
                b: rng.vec(width),
                s: if kind == Kind::Decoder {
                    rng.vec(width)
                } else {
                    vec![0.0; width]
                },
                decl,
            }
        };
        let layers = vec![
            layer(Kind::Encoder, Some(ns[0])),
            layer(Kind::Encoder, Some(ns[1])),
            layer(Kind::Encoder, Some(ns[2])),
            layer(Kind::Plain, None),
            layer(Kind::Decoder, Some(ns[2])),
            layer(Kind::Decoder, Some(ns[1])),
            layer(Kind::Decoder, Some(ns[0])),
            layer(Kind::Plain, None),
        ];
        Model { layers }
    }

    /// The declarations, for `skip::verify` and `skip::SkipLayout::new`.
    pub fn decls(&self) -> Vec<Declaration> {
        self.layers.iter().map(|l| l.decl.clone()).collect()
    }
}

// The arithmetic, shared by both versions.

fn affine(l: &Layer, x: &[f64]) -> Vec<f64> {
    x.iter()
        .zip(&l.w)
        .zip(&l.b)
        .map(|((x, w), b)| w * x + b)
        .collect()
}

fn add_scaled(y: &mut [f64], s: &[f64], e: &[f64]) {
    for ((y, s), e) in y.iter_mut().zip(s).zip(e) {
        *y += s * e;
    }
}

fn add(a: &mut [f64], b: &[f64]) {
    for (a, b) in a.iter_mut().zip(b) {
        *a += b;
    }
}

fn mul(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, b)| a * b).collect()
}

/// Gradients of `y = w*x + b (+ s*skip)` given `gy`: (`gx`, parameter gradients).
fn affine_backward(l: &Layer, saved: &Saved, gy: &[f64]) -> (Vec<f64>, ParamGrads) {
    let ds = match &saved.skip {
        Some(skip) => mul(gy, skip),
        None => vec![0.0; gy.len()],
    };
    (mul(&l.w, gy), [mul(gy, &saved.x), gy.to_vec(), ds])
}

// The `skip` version.

fn forward_layer(
    l: &Layer,
    x: Vec<f64>,
    skips: &Skips<'_, Vec<f64>>,
) -> Result<(Vec<f64>, Saved), Error> {
    let mut y = affine(l, &x);
    let mut skip = None;
    match l.kind {
        Kind::Plain => {}
        Kind::Encoder => skips.stash("skip", y.clone())?,
        Kind::Decoder => {
            // A stash of nothing contributes nothing.
            if let Some(e) = skips.pop("skip")? {
                add_scaled(&mut y, &l.s, e);
                skip = Some(e.clone()); // kept for ds in the backward pass
            }
        }
    }
    Ok((y, Saved { x, skip }))
}

fn backward_layer(
    l: &Layer,
    saved: &Saved,
    mut gy: Vec<f64>,
    grads: &mut Grads<'_, Vec<f64>>,
) -> Result<(Vec<f64>, ParamGrads), Error> {
    match l.kind {
        Kind::Plain => {}
        // The stashed output also fed the next layer: both gradients count.
        Kind::Encoder => {
            if let Some(g) = grads.take_grad("skip")? {
                add(&mut gy, &g);
            }
        }
        Kind::Decoder => {
            if saved.skip.is_some() {
                grads.put_grad("skip", mul(&l.s, &gy))?;
            }
        }
    }
    Ok(affine_backward(l, saved, &gy))
}

/// Runs layers `range` forward on `tracker`: the first pass, or (`recompute`) the
/// recomputation of a checkpointed partition. Returns the output and the saved states.
pub fn forward_range(
    model: &Model,
    range: Range<usize>,
    mut x: Vec<f64>,
    tracker: &mut Tracker<Vec<f64>>,
    recompute: bool,
) -> Result<(Vec<f64>, Vec<Saved>), Error> {
    let mut saved = Vec::with_capacity(range.len());
    for i in range {
        let l = &model.layers[i];
        let skips = if recompute {
            tracker.recompute(i, &l.decl)?
        } else {
            tracker.forward(i, &l.decl)?
        };
        let (y, s) = forward_layer(l, x, &skips)?;
        skips.finish()?;
        saved.push(s);
        x = y;
    }
    Ok((x, saved))
}

/// Runs layers `range` backward on `tracker`, from the output gradient `gy`; returns the
/// input gradient and the parameter gradients of those layers, in layer order.
pub fn backward_range(
    model: &Model,
    range: Range<usize>,
    saved: &[Saved],
    mut gy: Vec<f64>,
    tracker: &mut Tracker<Vec<f64>>,
) -> Result<(Vec<f64>, Vec<ParamGrads>), Error> {
    let start = range.start;
    let mut params = vec![[Vec::new(), Vec::new(), Vec::new()]; range.len()];
    for i in range.rev() {
        let l = &model.layers[i];
        let mut grads = tracker.backward(i, &l.decl)?;
        let (gx, p) = backward_layer(l, &saved[i - start], gy, &mut grads)?;
        grads.finish()?;
        params[i - start] = p;
        gy = gx;
    }
    Ok((gy, params))
}

/// One micro-batch through the whole model with `skip` on a plain sequence (one tracker),
/// loss `0.5 * |y|^2`. Also checks the tracker holds nothing afterwards.
pub fn run_with_skip(model: &Model, x: Vec<f64>) -> Result<(Pass, Tracker<Vec<f64>>), Error> {
    let mut tracker = Tracker::new();
    let n = model.layers.len();
    let (output, saved) = forward_range(model, 0..n, x, &mut tracker, false)?;
    let (input_grad, param_grads) =
        backward_range(model, 0..n, &saved, output.clone(), &mut tracker)?;
    let pass = Pass {
        output,
        input_grad,
        param_grads,
    };
    Ok((pass, tracker))
}

// The explicit version: pending residuals ride along in every layer's output.

/// One micro-batch through the whole model with the residuals threaded by hand.
pub fn run_explicit(model: &Model, x: Vec<f64>) -> Pass {
    // Forward: each layer maps (x, residuals) to (y, residuals).
    let mut carried: Vec<Vec<f64>> = Vec::new();
    let mut saved = Vec::new();
    let mut x = x;
    for l in &model.layers {
        let mut y = affine(l, &x);
        let mut skip = None;
        match l.kind {
            Kind::Plain => {}
            Kind::Encoder => carried.push(y.clone()),
            Kind::Decoder => {
                let e = carried.pop().unwrap_or_default();
                add_scaled(&mut y, &l.s, &e);
                skip = Some(e);
            }
        }
        saved.push(Saved { x, skip });
        x = y;
    }
    let output = x;

    // Backward: each layer maps (gy, residual gradients) to (gx, residual gradients).
    let mut gy = output.clone();
    let mut carried_grads: Vec<Vec<f64>> = Vec::new();
    let mut param_grads = vec![[Vec::new(), Vec::new(), Vec::new()]; model.layers.len()];
    for (i, l) in model.layers.iter().enumerate().rev() {
        match l.kind {
            Kind::Plain => {}
            Kind::Encoder => {
                let g = carried_grads.pop().unwrap_or_default();
                add(&mut gy, &g);
            }
            Kind::Decoder => carried_grads.push(mul(&l.s, &gy)),
        }
        let (gx, p) = affine_backward(l, &saved[i], &gy);
        param_grads[i] = p;
        gy = gx;
    }
    Pass {
        output,
        input_grad: gy,
        param_grads,
    }
}

/// The names of the quantities where two passes differ (empty when identical).
pub fn differences(a: &Pass, b: &Pass) -> Vec<String> {
    let mut out = Vec::new();
    if a.output != b.output {
        out.push("output".to_owned());
    }
    if a.input_grad != b.input_grad {
        out.push("input gradient".to_owned());
    }
    for (i, (pa, pb)) in a.param_grads.iter().zip(&b.param_grads).enumerate() {
        for (k, name) in ["w", "b", "s"].iter().enumerate() {
            if pa[k] != pb[k] {
                out.push(format!("layer {i} d{name}"));
            }
        }
    }
    if a.param_grads.len() != b.param_grads.len() {
        out.push("number of layers".to_owned());
    }
    out
}
