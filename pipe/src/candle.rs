//! Candle embedding (feature `candle`): [`Tensor`] for `candle_core::Tensor`, and
//! [`CandleLayer`], a stage around any candle module whose backward pass is candle's autograd.
//!
//! # The tensor
//!
//! The batch dimension is the first one. [`Tensor::split`] copies each part out
//! (`narrow` + `force_contiguous`), so a micro-batch owns its storage and
//! [`Tensor::size_bytes`] (elements × the dtype's size) is what it holds;
//! [`Tensor::concat`] is `Tensor::cat` along dimension 0; [`Tensor::accumulate`] is an
//! element-wise add. [`Tensor::to_device`] keeps a tensor where it is when the device
//! matches (host memory for [`Device::Cpu`] and [`Device::CpuCore`], `cuda:i` for
//! [`Device::Cuda`]), moves a GPU tensor to the host, and refuses any other move with
//! [`Error::Device`]: this crate does not create candle CUDA devices. Every result is
//! detached from candle's autograd graph. Candle's own failures (a dtype mismatch) reach
//! the caller as [`Error::Custom`] holding a [`CandleError`].
//!
//! # The stage
//!
//! [`CandleLayer`] wraps a `candle_core::ModuleT` (every `Module` is one) and the
//! [`Var`]s it trains. When the pipe keeps the micro-batch's state, `forward` makes its
//! input a [`Var`], runs the module on it and keeps the output with candle's graph;
//! `backward` computes `sum(output · grad_output)`, calls candle's `backward` on it, and
//! reads the gradient with respect to the input (returned) and to each var (added into the
//! layer's gradients, which [`Layer::parameters`] shows). A checkpointed micro-batch's
//! first forward keeps nothing; its recompute builds the graph again. The output passed on
//! is detached, so no graph crosses a stage.
//!
//! # Limits
//!
//! - **Randomness.** Candle's CPU random generator cannot be seeded
//!   (`Device::Cpu.set_seed` fails), and a candle module draws from it, not from
//!   [`Context::rng`]. A module with randomness (dropout) is therefore exact only when its
//!   backward uses the graph of its own forward: `checkpoint = never`. Under checkpointing
//!   the layer refuses rather than return wrong gradients: a layer declared
//!   [`random`](CandleLayer::random) fails its first checkpointed forward with
//!   [`CandleError::RandomUnderCheckpoint`], and an undeclared one is caught at the
//!   recompute, whose output is compared with a fingerprint of the first one
//!   ([`CandleError::NotReproducible`]). A module's randomness still does not follow the
//!   pipe's seed, so its results depend on the chunking, unlike [`crate::cpu::Dropout`]'s.
//! - **Running statistics.** A module that updates state in its forward (candle-nn's batch
//!   norm) updates it again in a recompute; use `checkpoint = never` for it.
//! - **Threads.** Candle's CPU kernels (matrix products) run on rayon's global pool, shared
//!   by every partition's worker. Give each partition one core by setting
//!   `RAYON_NUM_THREADS=1` before candle is first used (at the top of `main`, before any
//!   thread starts).
//! - **Memory.** [`Saved`] holds the input, the output and the graph's intermediate
//!   tensors, each storage counted once at its largest non-broadcast view; storage shared
//!   with a var (a transposed weight) is a parameter's and is not counted.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

use candle_core::{DType, DeviceLocation, ModuleT, Var};

use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;
use crate::tensor::Tensor;
use crate::vocab::Device;

/// What the candle adapters add to this crate's errors; it reaches callers inside
/// [`Error::Custom`] (downcast the source to match on it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CandleError {
    /// Candle's own error.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A layer declared [`random`](CandleLayer::random) asked to checkpoint.
    #[error(
        "{name} is declared random, and candle's CPU random generator cannot be seeded: a \
         checkpointed micro-batch would be recomputed with other random numbers; use \
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
         dropout: candle's CPU random generator cannot be seeded); use checkpoint = never"
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

/// Candle's error as this crate's.
fn candle(e: candle_core::Error) -> Error {
    Error::custom(CandleError::Candle(e))
}

/// A candle result with this crate's error.
fn c<R>(r: candle_core::Result<R>) -> Result<R, Error> {
    r.map_err(candle)
}

impl Tensor for candle_core::Tensor {
    fn batch_len(&self) -> usize {
        self.dims().first().copied().unwrap_or(0)
    }

    fn split(&self, sizes: &[usize]) -> Result<Vec<Self>, Error> {
        let len = self.batch_len();
        if self.rank() == 0 || sizes.iter().sum::<usize>() != len {
            return Err(Error::SplitSizes {
                sizes: sizes.to_vec(),
                len,
            });
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&size| {
                let part = c(self
                    .narrow(0, start, size)
                    .and_then(|p| p.force_contiguous()))?;
                start += size;
                Ok(part.detach())
            })
            .collect()
    }

    fn concat(mut parts: Vec<Self>) -> Result<Self, Error> {
        match parts.len() {
            0 => Err(Error::NothingToConcat),
            1 => Ok(parts.swap_remove(0).detach()),
            _ => {
                let first = parts[0].dims().to_vec();
                let fits =
                    |d: &[usize]| !d.is_empty() && d.len() == first.len() && d[1..] == first[1..];
                if let Some(bad) = parts.iter().map(|p| p.dims()).find(|d| !fits(d)) {
                    return Err(Error::Shape {
                        op: "concat",
                        expected: first,
                        got: bad.to_vec(),
                    });
                }
                Ok(c(candle_core::Tensor::cat(&parts, 0))?.detach())
            }
        }
    }

    fn size_bytes(&self) -> usize {
        self.elem_count() * self.dtype().size_in_bytes()
    }

    fn accumulate(&mut self, other: &Self) -> Result<(), Error> {
        if self.dims() != other.dims() {
            return Err(Error::Shape {
                op: "accumulate",
                expected: self.dims().to_vec(),
                got: other.dims().to_vec(),
            });
        }
        *self = c(self.add(other))?.detach();
        Ok(())
    }

    fn to_device(self, device: &Device) -> Result<Self, Error> {
        let here = self.device().location();
        match (device, here) {
            (d, DeviceLocation::Cpu) if d.is_host() => Ok(self),
            (d, _) if d.is_host() => Ok(c(candle_core::Tensor::to_device(
                &self,
                &candle_core::Device::Cpu,
            ))?
            .detach()),
            (Device::Cuda(i), DeviceLocation::Cuda { gpu_id }) if *i == gpu_id => Ok(self),
            _ => Err(Error::Device {
                tensor: "candle_core::Tensor",
                device: *device,
            }),
        }
    }
}

/// A pipeline stage around a candle module: forward runs the module, backward is candle's
/// autograd. See the [module docs](self) for how and for the limits.
///
/// Its parameters ([`Layer::parameters`]) are the [`Var`]s given to [`CandleLayer::new`],
/// in that order, each named `"var"`, with the gradients accumulated since the last
/// [`Layer::zero_grad`]. An optimizer can step through [`vars`](CandleLayer::vars)
/// (`Var::set`, or candle's optimizers) or through [`Layer::parameters_mut`]: a tensor
/// assigned to a parameter's `value` there is written into its var before the layer's next
/// forward (or by [`sync_vars`](CandleLayer::sync_vars)).
pub struct CandleLayer<M> {
    module: M,
    vars: Vec<Var>,
    /// What `parameters_mut` hands out: each var's tensor until a new one is assigned.
    values: Vec<candle_core::Tensor>,
    grads: Vec<candle_core::Tensor>,
    name: String,
    random: bool,
    /// Fingerprints of the outputs of checkpointed first forwards, by (step, micro-batch),
    /// checked by their recompute.
    fingerprints: HashMap<(u64, usize), u64>,
    /// An error of `zero_grad` (which cannot return one), reported by the next forward.
    deferred: Option<candle_core::Error>,
}

impl<M> std::fmt::Debug for CandleLayer<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleLayer")
            .field("name", &self.name)
            .field("vars", &self.vars.len())
            .field("random", &self.random)
            .finish_non_exhaustive()
    }
}

impl<M: ModuleT + Send> CandleLayer<M> {
    /// Wraps `module`, whose trainable variables are `vars` (any order; it is the order of
    /// [`Layer::parameters`]). Tensors the module uses that are not among `vars` are
    /// constants; a var it does not use keeps a zero gradient. Gradients start at zero.
    pub fn new(module: M, vars: Vec<Var>) -> Result<Self, Error> {
        let grads = vars
            .iter()
            .map(|v| c(v.zeros_like()))
            .collect::<Result<Vec<_>, _>>()?;
        let values = vars.iter().map(|v| v.as_tensor().clone()).collect();
        Ok(CandleLayer {
            module,
            vars,
            values,
            grads,
            name: "CandleLayer".to_string(),
            random: false,
            fingerprints: HashMap::new(),
            deferred: None,
        })
    }

    /// Declares that the module draws random numbers (dropout): the layer then refuses
    /// checkpointing at the first forward ([`CandleError::RandomUnderCheckpoint`]) instead
    /// of at the recompute.
    pub fn random(mut self) -> Self {
        self.random = true;
        self
    }

    /// Names the layer in errors (default `CandleLayer`).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The module.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The trained variables, in the order of [`Layer::parameters`].
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The accumulated gradients, one per var.
    pub fn grads(&self) -> &[candle_core::Tensor] {
        &self.grads
    }

    /// The module and its vars.
    pub fn into_parts(self) -> (M, Vec<Var>) {
        (self.module, self.vars)
    }

    /// Writes each tensor assigned through [`Layer::parameters_mut`] into its var (shapes
    /// must match). Forward does this itself.
    pub fn sync_vars(&mut self) -> Result<(), Error> {
        for (var, value) in self.vars.iter().zip(&mut self.values) {
            if value.id() != var.id() {
                c(var.set(value))?;
                *value = var.as_tensor().clone();
            }
        }
        Ok(())
    }

    /// The tensors the graph of `output` (computed from `input`) holds, for [`Saved`]:
    /// the input, the output, then one tensor per other storage (its largest
    /// non-broadcast view), leaving out storage shared with a var.
    fn graph_state(
        &self,
        input: &candle_core::Tensor,
        output: &candle_core::Tensor,
    ) -> Vec<candle_core::Tensor> {
        let mut seen: HashSet<usize> = self.vars.iter().map(|v| storage_key(v)).collect();
        seen.insert(storage_key(input));
        seen.insert(storage_key(output));
        let mut largest: HashMap<usize, &candle_core::Tensor> = HashMap::new();
        for node in output.sorted_nodes() {
            let key = storage_key(node);
            let broadcast = node.layout().stride().contains(&0) && node.elem_count() > 1;
            if node.is_variable() || broadcast || seen.contains(&key) {
                continue;
            }
            let entry = largest.entry(key).or_insert(node);
            if node.elem_count() > entry.elem_count() {
                *entry = node;
            }
        }
        let mut state = vec![input.clone(), output.clone()];
        state.extend(largest.into_values().cloned());
        state
    }
}

/// An address unique to the storage `t` shares (while `t` lives).
fn storage_key(t: &candle_core::Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    std::ptr::from_ref::<candle_core::Storage>(&*storage).addr()
}

/// A hash of the shape and every element's bits.
fn fingerprint(t: &candle_core::Tensor) -> Result<u64, Error> {
    let values = c(t
        .flatten_all()
        .and_then(|f| f.to_dtype(DType::F64))
        .and_then(|f| f.to_vec1::<f64>()))?;
    let mut h = DefaultHasher::new();
    t.dims().hash(&mut h);
    values.iter().for_each(|v| v.to_bits().hash(&mut h));
    Ok(h.finish())
}

impl<M: ModuleT + Send> Layer<candle_core::Tensor> for CandleLayer<M> {
    fn forward(
        &mut self,
        input: Batch<candle_core::Tensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<candle_core::Tensor>, Saved<candle_core::Tensor>), Error> {
        if let Some(e) = self.deferred.take() {
            return Err(candle(e));
        }
        self.sync_vars()?;
        let x = input.into_single()?;
        let train = ctx.is_training();
        let key = (ctx.step(), ctx.micro_batch().index);
        if (ctx.is_checkpointing() || ctx.is_recomputing()) && self.random {
            return Err(Error::custom(CandleError::RandomUnderCheckpoint {
                name: self.name.clone(),
            }));
        }
        if !ctx.keeps_state() {
            let y = c(self.module.forward_t(&x, train))?.detach();
            if ctx.is_checkpointing() {
                let step = ctx.step();
                self.fingerprints.retain(|(s, _), _| *s == step);
                self.fingerprints.insert(key, fingerprint(&y)?);
            }
            return Ok((Batch::single(y), Saved::none()));
        }
        let x = c(Var::from_tensor(&x))?.into_inner();
        let y = c(self.module.forward_t(&x, train))?;
        if ctx.is_recomputing() {
            if let Some(expected) = self.fingerprints.remove(&key) {
                if fingerprint(&y)? != expected {
                    return Err(Error::custom(CandleError::NotReproducible {
                        name: self.name.clone(),
                        step: key.0,
                        micro_batch: key.1,
                    }));
                }
            }
        }
        let saved = Saved::new(self.graph_state(&x, &y));
        Ok((Batch::single(y.detach()), saved))
    }

    fn backward(
        &mut self,
        grad_output: Batch<candle_core::Tensor>,
        saved: Saved<candle_core::Tensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<candle_core::Tensor>, Error> {
        let dy = grad_output.into_single()?;
        let got = saved.tensors().len();
        let mut saved = saved.into_tensors().into_iter();
        let (Some(x), Some(y)) = (saved.next(), saved.next()) else {
            return Err(Error::Arity { expected: 2, got });
        };
        if dy.dims() != y.dims() {
            return Err(Error::Shape {
                op: "CandleLayer::backward",
                expected: y.dims().to_vec(),
                got: dy.dims().to_vec(),
            });
        }
        // d/dy sum(y · dy) = dy exactly, so candle's backward starts from the given gradient.
        let grads = c(y
            .mul(&dy)
            .and_then(|o| o.sum_all())
            .and_then(|o| o.backward()))?;
        for (var, acc) in self.vars.iter().zip(&mut self.grads) {
            if let Some(g) = grads.get(var) {
                *acc = c(acc.add(g))?.detach();
            }
        }
        let dx = match grads.get(&x) {
            Some(g) => g.detach(),
            None => c(x.zeros_like())?,
        };
        Ok(Batch::single(dx))
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn parameters(&self) -> Vec<Param<'_, candle_core::Tensor>> {
        self.values
            .iter()
            .zip(&self.grads)
            .map(|(value, grad)| Param {
                name: "var",
                value,
                grad,
            })
            .collect()
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, candle_core::Tensor>> {
        self.values
            .iter_mut()
            .zip(&mut self.grads)
            .map(|(value, grad)| ParamMut {
                name: "var",
                value,
                grad,
            })
            .collect()
    }

    fn zero_grad(&mut self) {
        for g in &mut self.grads {
            match g.zeros_like() {
                Ok(z) => *g = z,
                Err(e) => {
                    self.deferred.get_or_insert(e);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Crossing ranks.

/// The wire codes of candle's element types (the [`WireMeta::dtype`](crate::WireMeta) of
/// a candle tensor). Other candle types (`I16`, `I32`, the 8-, 6- and 4-bit floats) do
/// not cross ranks: [`Wire::write_wire`](crate::Wire::write_wire) refuses them with
/// candle's `UnsupportedDTypeForOp` (as [`Error::Custom`]).
///
/// | code | dtype  |
/// |------|--------|
/// | 0    | `F32` (the code [`CpuTensor`](crate::cpu::CpuTensor) uses for its `f32`) |
/// | 1    | `F64`  |
/// | 2    | `F16`  |
/// | 3    | `BF16` |
/// | 4    | `U8`   |
/// | 5    | `U32`  |
/// | 6    | `I64`  |
pub const WIRE_DTYPES: [(u8, DType); 7] = [
    (0, DType::F32),
    (1, DType::F64),
    (2, DType::F16),
    (3, DType::BF16),
    (4, DType::U8),
    (5, DType::U32),
    (6, DType::I64),
];

/// Appends each of `values` as its `N` little-endian bytes (`le`).
fn put_le<T: Copy, const N: usize>(values: &[T], out: &mut Vec<u8>, le: impl Fn(T) -> [u8; N]) {
    for &v in values {
        out.extend_from_slice(&le(v));
    }
}

/// Appends `values`, plain old data, little-endian: one copy on a little-endian machine.
fn put_pod<T: bytemuck::Pod, const N: usize>(
    values: &[T],
    out: &mut Vec<u8>,
    le: impl Fn(T) -> [u8; N],
) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        put_le(values, out, le);
    }
}

/// A candle tensor crosses ranks as its elements in row-major order, little-endian, with
/// its dtype as one of the codes of [`WIRE_DTYPES`]; it arrives in host memory
/// ([`Device::Cpu`] or [`Device::CpuCore`]). A receiving [`Device::Cuda`] is
/// [`Error::Device`], as for [`Tensor::to_device`]: this crate makes no candle CUDA
/// devices. A tensor on a GPU is copied to the host to be written.
impl crate::wire::Wire for candle_core::Tensor {
    fn write_wire(&self, out: &mut Vec<u8>) -> Result<crate::wire::WireMeta, Error> {
        let dtype = self.dtype();
        let code = WIRE_DTYPES
            .iter()
            .find(|(_, d)| *d == dtype)
            .map(|(code, _)| *code)
            .ok_or_else(|| {
                candle(candle_core::Error::UnsupportedDTypeForOp(
                    dtype,
                    "write_wire",
                ))
            })?;
        // Row-major and contiguous, in host memory.
        let flat = c(self
            .flatten_all()
            .and_then(|t| candle_core::Tensor::to_device(&t, &candle_core::Device::Cpu))
            .and_then(|t| t.contiguous()))?;
        let elements = flat.elem_count();
        let size = dtype.size_in_bytes();
        out.try_reserve(elements * size).map_err(|_| Error::Alloc {
            op: "candle_core::Tensor::write_wire",
            elements,
            element_bytes: size,
        })?;
        let (storage, layout) = flat.storage_and_layout();
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            candle(candle_core::Error::Msg(
                "write_wire: a contiguous tensor without contiguous offsets".into(),
            ))
        })?;
        use candle_core::{CpuStorage as S, Storage};
        match &*storage {
            Storage::Cpu(S::F32(v)) => put_pod(&v[start..end], out, f32::to_le_bytes),
            Storage::Cpu(S::F64(v)) => put_pod(&v[start..end], out, f64::to_le_bytes),
            Storage::Cpu(S::U8(v)) => out.extend_from_slice(&v[start..end]),
            Storage::Cpu(S::U32(v)) => put_pod(&v[start..end], out, u32::to_le_bytes),
            Storage::Cpu(S::I64(v)) => put_pod(&v[start..end], out, i64::to_le_bytes),
            // `half`'s bytemuck support is not enabled through candle: through the bits.
            Storage::Cpu(S::F16(v)) => put_le(&v[start..end], out, |x| x.to_bits().to_le_bytes()),
            Storage::Cpu(S::BF16(v)) => put_le(&v[start..end], out, |x| x.to_bits().to_le_bytes()),
            _ => {
                return Err(candle(candle_core::Error::UnsupportedDTypeForOp(
                    dtype,
                    "write_wire (storage not in host memory)",
                )))
            }
        }
        Ok(crate::wire::WireMeta {
            dtype: code,
            shape: self.dims().to_vec(),
        })
    }

    fn read_wire(
        meta: &crate::wire::WireMeta,
        bytes: &[u8],
        device: &Device,
    ) -> Result<Self, Error> {
        if !device.is_host() {
            return Err(Error::Device {
                tensor: "candle_core::Tensor",
                device: *device,
            });
        }
        let dtype = WIRE_DTYPES
            .iter()
            .find(|(code, _)| *code == meta.dtype)
            .map(|(_, d)| *d)
            .ok_or(Error::WireType {
                tensor: "candle_core::Tensor",
                dtype: meta.dtype,
            })?;
        let size = dtype.size_in_bytes();
        let elements = meta.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        if elements.and_then(|n| n.checked_mul(size)) != Some(bytes.len()) {
            return Err(Error::Shape {
                op: "candle_core::Tensor::read_wire",
                expected: meta.shape.clone(),
                got: vec![bytes.len() / size],
            });
        }
        // Candle reads the machine's own byte order.
        let native: std::borrow::Cow<'_, [u8]> = if cfg!(target_endian = "little") {
            bytes.into()
        } else {
            bytes
                .chunks_exact(size)
                .flat_map(|e| e.iter().rev().copied())
                .collect::<Vec<u8>>()
                .into()
        };
        Ok(c(candle_core::Tensor::from_raw_buffer(
            &native,
            dtype,
            &meta.shape,
            &candle_core::Device::Cpu,
        ))?
        .detach())
    }
}
