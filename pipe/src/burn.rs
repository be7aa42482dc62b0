//! Burn embedding (feature `burn`): [`BurnTensor`], a burn float tensor of any rank as this
//! crate's [`Tensor`], and [`BurnLayer`], a stage around any burn module whose backward pass
//! is burn's autodiff.
//!
//! burn 0.20 (0.20.1), through its sub-crates (`burn-tensor`, `burn-core`,
//! `burn-autodiff`, `burn-ndarray`, std only), not the `burn` umbrella: the newest release
//! that builds with this workspace's MSRV (Rust 1.89; burn 0.21 needs 1.92 through
//! `cubecl-zspace` 0.10, burn 0.22 needs 1.95). [`CpuAutodiff`] (`Autodiff<NdArray<f32>>`)
//! is the CPU backend the example and tests use.
//!
//! # The tensor
//!
//! A burn [`Tensor`](burn_tensor::Tensor) carries its rank as a const parameter; a pipe
//! moves tensors of one type between stages, and a layer's parameters have several ranks
//! (a weight matrix, a bias vector). [`BurnTensor`] holds the backend's rank-free float
//! primitive instead: [`BurnTensor::from_tensor`] takes any rank (a quantized tensor is
//! dequantized), [`BurnTensor::to_tensor`] gives it back at the rank asked for, or
//! [`BurnError::Rank`]. The batch dimension is the first one. [`Tensor::split`] and
//! [`Tensor::concat`] work on a `[batch, rest]` view (`narrow` and `cat` along dimension 0)
//! and restore the other dimensions; [`Tensor::accumulate`] is an element-wise add;
//! [`Tensor::size_bytes`] is elements × the dtype's size. Every result is detached from
//! burn's autodiff graph. [`Tensor::to_device`] keeps a tensor where it is for a host
//! device ([`Device::Cpu`], [`Device::CpuCore`]) and refuses any other with
//! [`Error::Device`]: this adapter is for burn's CPU backends.
//!
//! # The stage
//!
//! [`BurnLayer`] wraps a burn module (`Module<B>` on an [`AutodiffBackend`] `B`) and a
//! forward function `Fn(&M, Tensor<B, DI>) -> Tensor<B, DO>` (a burn module's `forward`
//! is an inherent method, not a trait's). When the pipe keeps the micro-batch's state,
//! `forward` makes its input require a gradient, runs the function and keeps the output
//! with burn's graph in [`Saved`]; `backward` computes `sum(output · grad_output)`, calls
//! burn's `backward` on it, and reads the gradient with respect to the input (returned) and
//! to each float parameter of the module (added into the layer's gradients, which
//! [`Layer::parameters`] shows, in the module's visitor order). A checkpointed
//! micro-batch's first forward keeps nothing; its recompute builds the graph again. The
//! output passed on is detached, so no graph crosses a stage.
//!
//! # Limits
//!
//! - **Randomness.** A burn module draws random numbers (dropout) from the backend's own
//!   generator (`Backend::seed`, one per backend and process, shared by every
//!   partition's thread), not from [`Context::rng`]; a recompute would draw other numbers.
//!   Under checkpointing the layer refuses rather than return wrong gradients: a layer
//!   declared [`random`](BurnLayer::random) fails its first checkpointed forward with
//!   [`BurnError::RandomUnderCheckpoint`], and an undeclared one is caught at the
//!   recompute, whose output is compared bit for bit with a fingerprint of the first one
//!   ([`BurnError::NotReproducible`]). Use `checkpoint = never` for such a module.
//! - **Running statistics.** A module that updates state in its forward (batch norm)
//!   updates it again in a recompute; use `checkpoint = never` for it.
//! - **Memory.** [`Saved`] holds the input and the output; the graph's intermediate
//!   tensors, which burn's autodiff keeps out of reach, are not counted.
//! - **Skips.** Like candle's `CandleLayer` (feature `candle`), a stage takes and returns a single
//!   tensor ([`Batch::into_single`]): skip connections across stages are not supported.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;

use burn_core::module::{Module, ModuleMapper, ModuleVisitor, Param as BurnParam};
use burn_tensor::backend::{AutodiffBackend, Backend};
use burn_tensor::ops::FloatTensor;
use burn_tensor::{Shape, TensorData, TensorMetadata, TensorPrimitive};

use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;
use crate::tensor::Tensor;
use crate::vocab::Device;

/// The CPU backend the example and tests train on: burn's `NdArray` (`f32`) under
/// `Autodiff`.
pub type CpuAutodiff = burn_autodiff::Autodiff<burn_ndarray::NdArray<f32>>;

/// What the burn adapters add to this crate's errors; it reaches callers inside
/// [`Error::Custom`] (downcast the source to match on it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BurnError {
    /// A tensor asked for at another rank than its own.
    #[error("a burn tensor of rank {got} asked for at rank {expected}")]
    Rank {
        /// The rank asked for.
        expected: usize,
        /// The tensor's rank.
        got: usize,
    },
    /// A layer declared [`random`](BurnLayer::random) asked to checkpoint.
    #[error(
        "{name} is declared random, and burn's backend generator does not follow the pipe's \
         seed: a checkpointed micro-batch would be recomputed with other random numbers; use \
         checkpoint = never"
    )]
    RandomUnderCheckpoint {
        /// The layer's name.
        name: String,
    },
    /// A recomputed forward whose output differs from the first forward's: the module is
    /// not deterministic (randomness such as dropout), so checkpointing it is not exact.
    #[error(
        "{name}, step {step}, micro-batch {micro_batch}: the recomputed output differs from \
         the first forward's, so the module is not deterministic (randomness such as \
         dropout); use checkpoint = never"
    )]
    NotReproducible {
        /// The layer's name.
        name: String,
        /// The training step.
        step: u64,
        /// The micro-batch index.
        micro_batch: usize,
    },
}

/// A burn float tensor of any rank, on backend `B`. See the [module docs](self).
pub struct BurnTensor<B: Backend> {
    prim: FloatTensor<B>,
}

impl<B: Backend> Clone for BurnTensor<B> {
    fn clone(&self) -> Self {
        BurnTensor {
            prim: self.prim.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for BurnTensor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BurnTensor")
            .field("dims", &self.dims())
            .field("dtype", &self.prim.dtype())
            .finish()
    }
}

impl<B: Backend> BurnTensor<B> {
    /// Wraps a tensor of any rank (a quantized one is dequantized). It keeps its autodiff
    /// node, if it has one.
    pub fn from_tensor<const D: usize>(t: burn_tensor::Tensor<B, D>) -> Self {
        BurnTensor {
            prim: t.into_primitive().tensor(),
        }
    }

    /// The tensor at rank `D`: [`BurnError::Rank`] (in [`Error::Custom`]) if that is not its
    /// rank.
    pub fn to_tensor<const D: usize>(&self) -> Result<burn_tensor::Tensor<B, D>, Error> {
        self.clone().into_tensor()
    }

    /// [`BurnTensor::to_tensor`], consuming.
    pub fn into_tensor<const D: usize>(self) -> Result<burn_tensor::Tensor<B, D>, Error> {
        let got = self.prim.shape().num_dims();
        if got != D {
            return Err(Error::custom(BurnError::Rank { expected: D, got }));
        }
        Ok(burn_tensor::Tensor::from_primitive(TensorPrimitive::Float(
            self.prim,
        )))
    }

    /// The dimensions.
    pub fn dims(&self) -> Vec<usize> {
        self.prim.shape().dims
    }

    /// The elements, row-major, as burn's data.
    pub fn to_data(&self) -> TensorData {
        self.to_2d().into_data()
    }

    /// The elements as `f32`, row-major (converted from the tensor's float type).
    pub fn to_vec_f32(&self) -> Vec<f32> {
        self.to_data().iter::<f32>().collect()
    }

    /// A detached copy (no autodiff node).
    pub fn detach(&self) -> Self {
        BurnTensor {
            prim: B::float_detach(self.prim.clone()),
        }
    }

    /// A `[first, rest]` view (a scalar is `[1, 1]`).
    fn to_2d(&self) -> burn_tensor::Tensor<B, 2> {
        let dims = self.dims();
        let first = dims.first().copied().unwrap_or(1);
        let rest = dims.iter().skip(1).product::<usize>();
        burn_tensor::Tensor::from_primitive(TensorPrimitive::Float(B::float_reshape(
            self.prim.clone(),
            Shape::from(vec![first, rest]),
        )))
    }

    /// A `[first, rest]` tensor back at `dims` (the first dimension from the tensor), detached.
    fn from_2d(t: burn_tensor::Tensor<B, 2>, like: &[usize]) -> Self {
        let mut dims = like.to_vec();
        dims[0] = t.dims()[0];
        let prim = t.detach().into_primitive().tensor();
        BurnTensor {
            prim: B::float_reshape(prim, Shape::from(dims)),
        }
    }

    fn zeros_like(&self) -> Self {
        let z =
            burn_tensor::Tensor::<B, 2>::zeros(self.to_2d().shape(), &B::float_device(&self.prim));
        BurnTensor::from_2d(z, &self.dims())
    }

    fn fingerprint(&self) -> u64 {
        let data = self.to_data();
        let mut h = DefaultHasher::new();
        self.dims().hash(&mut h);
        data.as_bytes().hash(&mut h);
        h.finish()
    }
}

impl<B: Backend> Tensor for BurnTensor<B> {
    fn batch_len(&self) -> usize {
        self.dims().first().copied().unwrap_or(0)
    }

    fn split(&self, sizes: &[usize]) -> Result<Vec<Self>, Error> {
        let dims = self.dims();
        let len = self.batch_len();
        if dims.is_empty() || sizes.iter().sum::<usize>() != len {
            return Err(Error::SplitSizes {
                sizes: sizes.to_vec(),
                len,
            });
        }
        let flat = self.to_2d();
        let mut start = 0;
        Ok(sizes
            .iter()
            .map(|&size| {
                let part = flat.clone().narrow(0, start, size);
                start += size;
                BurnTensor::from_2d(part, &dims)
            })
            .collect())
    }

    fn concat(mut parts: Vec<Self>) -> Result<Self, Error> {
        match parts.len() {
            0 => Err(Error::NothingToConcat),
            1 => Ok(parts.swap_remove(0).detach()),
            _ => {
                let first = parts[0].dims();
                let fits =
                    |d: &[usize]| !d.is_empty() && d.len() == first.len() && d[1..] == first[1..];
                if let Some(bad) = parts.iter().map(|p| p.dims()).find(|d| !fits(d)) {
                    return Err(Error::Shape {
                        op: "concat",
                        expected: first,
                        got: bad,
                    });
                }
                let views = parts.iter().map(|p| p.to_2d()).collect();
                Ok(BurnTensor::from_2d(
                    burn_tensor::Tensor::cat(views, 0),
                    &first,
                ))
            }
        }
    }

    fn size_bytes(&self) -> usize {
        self.prim.shape().num_elements() * self.prim.dtype().size()
    }

    fn accumulate(&mut self, other: &Self) -> Result<(), Error> {
        if self.dims() != other.dims() {
            return Err(Error::Shape {
                op: "accumulate",
                expected: self.dims(),
                got: other.dims(),
            });
        }
        self.prim = B::float_detach(B::float_add(self.prim.clone(), other.prim.clone()));
        Ok(())
    }

    fn to_device(self, device: &Device) -> Result<Self, Error> {
        if device.is_host() {
            Ok(self)
        } else {
            Err(Error::Device {
                tensor: "pipe::burn::BurnTensor",
                device: *device,
            })
        }
    }
}

/// Collects a module's float parameters (visitor order), detached.
struct Values<B: Backend>(Vec<BurnTensor<B>>);

impl<B: Backend> ModuleVisitor<B> for Values<B> {
    fn visit_float<const D: usize>(&mut self, param: &BurnParam<burn_tensor::Tensor<B, D>>) {
        self.0.push(BurnTensor::from_tensor(param.val().detach()));
    }
}

/// Collects each float parameter's gradient in `grads` (visitor order).
struct Grads<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    out: Vec<Option<BurnTensor<B>>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Grads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &BurnParam<burn_tensor::Tensor<B, D>>) {
        let g = param
            .val()
            .grad(self.grads)
            .map(|g| BurnTensor::from_tensor(burn_tensor::Tensor::<B, D>::from_inner(g)));
        self.out.push(g);
    }
}

/// Sets each float parameter (visitor order) to the given value, keeping its id and
/// whether it requires a gradient.
struct Assign<B: Backend> {
    values: std::vec::IntoIter<BurnTensor<B>>,
}

impl<B: Backend> ModuleMapper<B> for Assign<B> {
    fn map_float<const D: usize>(
        &mut self,
        param: BurnParam<burn_tensor::Tensor<B, D>>,
    ) -> BurnParam<burn_tensor::Tensor<B, D>> {
        let Some(value) = self.values.next() else {
            return param;
        };
        param.map(|t| match value.into_tensor::<D>() {
            Ok(v) => {
                let grad = t.is_require_grad();
                v.detach().set_require_grad(grad)
            }
            Err(_) => t, // shapes are checked before mapping
        })
    }
}

/// A pipeline stage around a burn module: forward runs `forward(&module, input)`, backward
/// is burn's autodiff. See the [module docs](self) for how and for the limits.
///
/// Its parameters ([`Layer::parameters`]) are the module's float parameters in visitor
/// order, each named `"param"`, detached, with the gradients accumulated since the last
/// [`Layer::zero_grad`]. An optimizer can step through [`Layer::parameters_mut`]: a value
/// assigned there (same shape) is written into the module, under the same `ParamId`,
/// before the layer's next forward (or by [`sync_params`](BurnLayer::sync_params)).
pub struct BurnLayer<B: AutodiffBackend, M, F, const DI: usize, const DO: usize> {
    module: Option<M>,
    forward: F,
    values: Vec<BurnTensor<B>>,
    grads: Vec<BurnTensor<B>>,
    /// `parameters_mut` was called since the values were last written into the module.
    dirty: bool,
    name: String,
    random: bool,
    /// Fingerprints of the outputs of checkpointed first forwards, by (step, micro-batch),
    /// checked by their recompute.
    fingerprints: HashMap<(u64, usize), u64>,
    _backend: PhantomData<fn() -> B>,
}

impl<B: AutodiffBackend, M, F, const DI: usize, const DO: usize> std::fmt::Debug
    for BurnLayer<B, M, F, DI, DO>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BurnLayer")
            .field("name", &self.name)
            .field("params", &self.values.len())
            .field("random", &self.random)
            .finish_non_exhaustive()
    }
}

impl<B, M, F, const DI: usize, const DO: usize> BurnLayer<B, M, F, DI, DO>
where
    B: AutodiffBackend,
    M: Module<B>,
    F: Fn(&M, burn_tensor::Tensor<B, DI>) -> burn_tensor::Tensor<B, DO> + Send,
{
    /// Wraps `module` and its forward function. Its float parameters are the layer's
    /// parameters; gradients start at zero.
    pub fn new(module: M, forward: F) -> Self {
        let mut values = Values(Vec::new());
        module.visit(&mut values);
        let grads = values.0.iter().map(BurnTensor::zeros_like).collect();
        BurnLayer {
            module: Some(module),
            forward,
            values: values.0,
            grads,
            dirty: false,
            name: "BurnLayer".to_string(),
            random: false,
            fingerprints: HashMap::new(),
            _backend: PhantomData,
        }
    }

    /// Declares that the module draws random numbers (dropout): the layer then refuses
    /// checkpointing at the first forward ([`BurnError::RandomUnderCheckpoint`]) instead
    /// of at the recompute.
    pub fn random(mut self) -> Self {
        self.random = true;
        self
    }

    /// Names the layer in errors (default `BurnLayer`).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The module, with any value assigned through [`Layer::parameters_mut`] written in.
    pub fn module(&mut self) -> Result<&M, Error> {
        self.sync_params()?;
        self.module_ref()
    }

    /// The accumulated gradients, one per float parameter (visitor order).
    pub fn grads(&self) -> &[BurnTensor<B>] {
        &self.grads
    }

    /// The module, with any value assigned through [`Layer::parameters_mut`] written in.
    pub fn into_module(mut self) -> Result<M, Error> {
        self.sync_params()?;
        self.module.take().ok_or_else(lost)
    }

    fn module_ref(&self) -> Result<&M, Error> {
        self.module.as_ref().ok_or_else(lost)
    }

    /// Writes the values assigned through [`Layer::parameters_mut`] into the module (shapes
    /// must match: [`Error::Shape`] otherwise, and nothing is written). Forward does this
    /// itself.
    pub fn sync_params(&mut self) -> Result<(), Error> {
        if !self.dirty {
            return Ok(());
        }
        let mut current = Values(Vec::new());
        self.module_ref()?.visit(&mut current);
        for (value, now) in self.values.iter().zip(&current.0) {
            if value.dims() != now.dims() {
                return Err(Error::Shape {
                    op: "BurnLayer::sync_params",
                    expected: now.dims(),
                    got: value.dims(),
                });
            }
        }
        let module = self.module.take().ok_or_else(lost)?;
        let values: Vec<BurnTensor<B>> = self.values.iter().map(BurnTensor::detach).collect();
        self.module = Some(module.map(&mut Assign {
            values: values.into_iter(),
        }));
        self.dirty = false;
        Ok(())
    }
}

fn lost() -> Error {
    Error::custom(std::io::Error::other(
        "BurnLayer: the module was lost by an earlier failure",
    ))
}

impl<B, M, F, const DI: usize, const DO: usize> Layer<BurnTensor<B>> for BurnLayer<B, M, F, DI, DO>
where
    B: AutodiffBackend,
    M: Module<B>,
    F: Fn(&M, burn_tensor::Tensor<B, DI>) -> burn_tensor::Tensor<B, DO> + Send,
{
    fn forward(
        &mut self,
        input: Batch<BurnTensor<B>>,
        ctx: &mut Context,
    ) -> Result<(Batch<BurnTensor<B>>, Saved<BurnTensor<B>>), Error> {
        self.sync_params()?;
        let x = input.into_single()?.detach().into_tensor::<DI>()?;
        let key = (ctx.step(), ctx.micro_batch().index);
        if (ctx.is_checkpointing() || ctx.is_recomputing()) && self.random {
            return Err(Error::custom(BurnError::RandomUnderCheckpoint {
                name: self.name.clone(),
            }));
        }
        let module = self.module_ref()?;
        if !ctx.keeps_state() {
            let y = BurnTensor::from_tensor((self.forward)(module, x).detach());
            if ctx.is_checkpointing() {
                let step = ctx.step();
                self.fingerprints.retain(|(s, _), _| *s == step);
                self.fingerprints.insert(key, y.fingerprint());
            }
            return Ok((Batch::single(y), Saved::none()));
        }
        let x = x.require_grad();
        let y = (self.forward)(module, x.clone());
        let y = BurnTensor::from_tensor(y);
        if ctx.is_recomputing() {
            if let Some(expected) = self.fingerprints.remove(&key) {
                if y.fingerprint() != expected {
                    return Err(Error::custom(BurnError::NotReproducible {
                        name: self.name.clone(),
                        step: key.0,
                        micro_batch: key.1,
                    }));
                }
            }
        }
        let out = y.detach();
        let saved = Saved::new(vec![BurnTensor::from_tensor(x), y]);
        Ok((Batch::single(out), saved))
    }

    fn backward(
        &mut self,
        grad_output: Batch<BurnTensor<B>>,
        saved: Saved<BurnTensor<B>>,
        _ctx: &mut Context,
    ) -> Result<Batch<BurnTensor<B>>, Error> {
        let dy = grad_output.into_single()?;
        let got = saved.tensors().len();
        let mut saved = saved.into_tensors().into_iter();
        let (Some(x), Some(y)) = (saved.next(), saved.next()) else {
            return Err(Error::Arity { expected: 2, got });
        };
        if dy.dims() != y.dims() {
            return Err(Error::Shape {
                op: "BurnLayer::backward",
                expected: y.dims(),
                got: dy.dims(),
            });
        }
        let x = x.into_tensor::<DI>()?;
        let y = y.into_tensor::<DO>()?;
        let dy = dy.detach().into_tensor::<DO>()?;
        // d/dy sum(y · dy) = dy exactly, so burn's backward starts from the given gradient.
        let grads = (y * dy).sum().backward();
        let mut visitor = Grads {
            grads: &grads,
            out: Vec::new(),
        };
        self.module_ref()?.visit(&mut visitor);
        for (acc, g) in self.grads.iter_mut().zip(visitor.out) {
            if let Some(g) = g {
                acc.accumulate(&g)?;
            }
        }
        let dx = match x.grad(&grads) {
            Some(g) => BurnTensor::from_tensor(burn_tensor::Tensor::<B, DI>::from_inner(g)),
            None => BurnTensor::from_tensor(x.detach()).zeros_like(),
        };
        Ok(Batch::single(dx))
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn parameters(&self) -> Vec<Param<'_, BurnTensor<B>>> {
        self.values
            .iter()
            .zip(&self.grads)
            .map(|(value, grad)| Param {
                name: "param",
                value,
                grad,
            })
            .collect()
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, BurnTensor<B>>> {
        self.dirty = true;
        self.values
            .iter_mut()
            .zip(&mut self.grads)
            .map(|(value, grad)| ParamMut {
                name: "param",
                value,
                grad,
            })
            .collect()
    }

    fn zero_grad(&mut self) {
        for g in &mut self.grads {
            *g = g.zeros_like();
        }
    }
}
