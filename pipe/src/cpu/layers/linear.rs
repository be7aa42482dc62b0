//! [`Linear`]: `y = x W + b`.

use ndarray::{Array2, Axis};

use super::{matrix, same_shape};
use crate::cpu::matmul::{gemm, has_kernel, splits_exactly, transpose, View, ViewMut};
use crate::cpu::CpuTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;
use crate::rng::Stream;
use crate::storage;
use crate::tensor::Tensor;

/// Up to this many rows the forward pass computes `yᵀ = Wᵀ xᵀ`, streaming a transposed
/// copy of the weight (kept between calls) through broadcasts and packing only `xᵀ`;
/// beyond it, `y = x W` with the weight packed. On a `Linear(1024, 1024)` the first form
/// ran at 116–150 GFLOP/s from 48 to 512 rows against 91–139 for the second, and the two
/// met near 1024 rows (AVX-512, one core). Without the kernel (`ndarray`'s
/// `general_mat_mul`, matrixmultiply's) the first form ran at about 0.6 of the second's
/// speed at 32 rows (the bench's GEMM rows with `--isa avx2`), so there it is not used.
const TRANSPOSED_FORWARD_ROWS: usize = 512;
/// The same choice for the input gradient: `dxᵀ = W dyᵀ` up to this many rows, else
/// `dx = dy Wᵀ`.
const TRANSPOSED_BACKWARD_ROWS: usize = 512;

/// A fully connected layer, `y = x W + b` on `[batch, inputs]`, with `W` stored as
/// `[inputs, outputs]`. Saves its input for backward.
///
/// The products run on the crate's single-threaded kernel (AVX-512 where available, see
/// the `matmul` module), chosen so that a micro-batch of a few dozen rows runs nearly as
/// fast per row as a whole batch:
/// - the forward pass on at most 512 rows streams `Wᵀ` from a transposed copy of the
///   weight, made on the first such call after the weight changed (through
///   [`parameters_mut`](Layer::parameters_mut)) and kept: one more weight's worth of
///   memory, one transpose per optimizer step;
/// - where its context allows it ([`Context::defers_weight_grads`]), backward computes
///   only the input and bias gradients and keeps `(x, dy)`; [`flush_grads`](Layer::flush_grads)
///   then adds `dW += Xᵀ dY` as one product over every kept row (in the order the
///   backward calls came), which streams the weight gradient once instead of once per
///   micro-batch. With the AVX-512 kernel the result is bit-identical to adding each
///   call's product in turn.
#[derive(Clone)]
pub struct Linear {
    weight: CpuTensor,
    bias: CpuTensor,
    weight_grad: CpuTensor,
    bias_grad: CpuTensor,
    /// `Wᵀ`, row-major `[outputs, inputs]`, for the forward pass on few rows; empty until
    /// made, and emptied whenever the weight may have changed.
    weight_t: Vec<f32>,
    /// Per deferred backward call, in order: its input and output gradient.
    deferred: Vec<(CpuTensor, CpuTensor)>,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear")
            .field("weight", &self.weight)
            .field("bias", &self.bias)
            .field("weight_grad", &self.weight_grad)
            .field("bias_grad", &self.bias_grad)
            .field("weight_t", &!self.weight_t.is_empty())
            .field("deferred", &self.deferred.len())
            .finish()
    }
}

impl Linear {
    /// A layer initialised uniformly in `±1/sqrt(inputs)` (PyTorch's default range) from
    /// `seed`: the same seed gives the same weights.
    ///
    /// # Panics
    /// If `inputs * outputs` overflows or the weights cannot be allocated;
    /// [`try_new`](Linear::try_new) returns those as errors.
    pub fn new(inputs: usize, outputs: usize, seed: u64) -> Self {
        Linear::try_new(inputs, outputs, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`new`](Linear::new), or an error: [`Error::ShapeOverflow`] if `inputs * outputs`
    /// does not fit in `usize`, [`Error::Alloc`] if the weights exceed `isize::MAX` bytes
    /// or the allocator refuses them.
    pub fn try_new(inputs: usize, outputs: usize, seed: u64) -> Result<Self, Error> {
        const OP: &str = "Linear::new";
        let bound = 1.0 / (inputs.max(1) as f32).sqrt();
        let rng = Stream::new(seed, 0, 0);
        let draw = |row: usize, col: usize| {
            (2.0 * rng.sample(row as u64).uniform(col as u64) - 1.0) * bound
        };
        let len = storage::element_count(OP, &[inputs, outputs])?;
        let weight = (0..inputs).flat_map(|i| (0..outputs).map(move |o| (i, o)));
        let weight = storage::collect(OP, len, weight.map(|(i, o)| draw(i, o)))?;
        let bias = storage::collect(OP, outputs, (0..outputs).map(|o| draw(inputs, o)))?;
        Linear::with_zero_grads(
            matrix_of(inputs, outputs, weight)?,
            matrix_of(1, outputs, bias)?,
        )
    }

    /// A layer with the given weight `[inputs, outputs]` and bias `[1, outputs]`.
    pub fn from_parts(weight: Array2<f32>, bias: Array2<f32>) -> Result<Self, Error> {
        same_shape("Linear bias", &[1, weight.ncols()], bias.shape())?;
        Linear::with_zero_grads(weight, bias)
    }

    fn with_zero_grads(weight: Array2<f32>, bias: Array2<f32>) -> Result<Self, Error> {
        let zeros = |a: &Array2<f32>| {
            matrix_of(
                a.nrows(),
                a.ncols(),
                storage::zeros("Linear gradient", a.len())?,
            )
        };
        let (wg, bg) = (zeros(&weight)?, zeros(&bias)?);
        Ok(Linear {
            weight: weight.into(),
            bias: bias.into(),
            weight_grad: wg.into(),
            bias_grad: bg.into(),
            weight_t: Vec::new(),
            deferred: Vec::new(),
        })
    }

    /// The weight, `[inputs, outputs]`.
    pub fn weight(&self) -> &CpuTensor {
        &self.weight
    }

    /// The bias, `[1, outputs]`.
    pub fn bias(&self) -> &CpuTensor {
        &self.bias
    }

    fn outputs(&self) -> usize {
        self.weight.shape()[1]
    }

    fn inputs(&self) -> usize {
        self.weight.shape()[0]
    }

    /// `Wᵀ`, row-major `[outputs, inputs]`, made if missing.
    fn weight_t(&mut self) -> Result<&[f32], Error> {
        let (inputs, outputs) = (self.inputs(), self.outputs());
        if self.weight_t.len() != inputs * outputs {
            let w = contiguous(&self.weight, "Linear weight")?;
            self.weight_t = storage::zeros("Linear weight transpose", w.len())?;
            transpose(w, inputs, outputs, &mut self.weight_t, inputs);
        }
        Ok(&self.weight_t)
    }

    /// Adds the weight gradient of one deferred call, `x` and `dy`, as its backward would
    /// have (one product).
    fn add_deferred(&mut self, x: &CpuTensor, dy: &CpuTensor) -> Result<(), Error> {
        let (rows, inputs) = (x.shape()[0], self.inputs());
        let (xs, dys) = (
            x.array().as_standard_layout(),
            dy.array().as_standard_layout(),
        );
        let (Some(xs), Some(dys)) = (xs.as_slice(), dys.as_slice()) else {
            return Err(Error::Shape {
                op: "Linear::flush_grads",
                expected: vec![rows, inputs],
                got: x.shape().to_vec(),
            });
        };
        self.add_weight_grad(xs, dys, rows)
    }

    /// `dW += xᵀ dy` over `rows` rows, from the row-major `x` (`[rows, inputs]`).
    fn add_weight_grad(&mut self, xs: &[f32], dys: &[f32], rows: usize) -> Result<(), Error> {
        same_shape(
            "Linear weight gradient",
            &[rows * self.inputs()],
            &[xs.len()],
        )?;
        let xt = View::row_major(xs, rows, self.inputs()).t();
        self.add_weight_grad_t(xt, dys)
    }

    /// `dW += xᵀ dy`, from `xᵀ` (`[inputs, rows]`) and the row-major `dy`.
    fn add_weight_grad_t(&mut self, xt: View<'_>, dys: &[f32]) -> Result<(), Error> {
        let rows = xt.cols;
        let (inputs, outputs) = (self.inputs(), self.outputs());
        let shape = self.weight_grad.shape().to_vec();
        let dw = self.weight_grad.array_mut();
        let dw = match dw.as_slice_mut() {
            Some(dw) if shape == [inputs, outputs] => dw,
            _ => {
                return Err(Error::Shape {
                    op: "Linear weight gradient",
                    expected: vec![inputs, outputs],
                    got: shape,
                })
            }
        };
        same_shape(
            "Linear weight gradient",
            &[inputs, rows * outputs],
            &[xt.rows, dys.len()],
        )?;
        gemm(
            xt,
            View::row_major(dys, rows, outputs),
            ViewMut::row_major(dw, inputs, outputs),
            true,
        );
        Ok(())
    }
}

/// A `rows x cols` matrix of row-major `data` (which has `rows * cols` elements).
fn matrix_of(rows: usize, cols: usize, data: Vec<f32>) -> Result<Array2<f32>, Error> {
    let got = data.len();
    Array2::from_shape_vec((rows, cols), data).map_err(|_| Error::Shape {
        op: "Linear",
        expected: vec![rows, cols],
        got: vec![got],
    })
}

/// The elements of a standard-layout tensor, in order.
fn contiguous<'t>(t: &'t CpuTensor, op: &'static str) -> Result<&'t [f32], Error> {
    t.array().as_slice().ok_or_else(|| Error::Shape {
        op,
        expected: t.shape().to_vec(),
        got: t.shape().to_vec(),
    })
}

impl Layer<CpuTensor> for Linear {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let x = input.into_single()?;
        let (inputs, outputs) = (self.inputs(), self.outputs());
        let rows = matrix(&x, "Linear::forward", inputs)?.nrows();
        let xs = x.array().as_standard_layout();
        let xs = xs.as_slice().ok_or(Error::Shape {
            op: "Linear::forward",
            expected: vec![0, inputs],
            got: x.shape().to_vec(),
        })?;
        let b = contiguous(&self.bias, "Linear bias")?;
        same_shape("Linear bias", &[outputs], &[b.len()])?;
        // y = 1 bᵀ + x W.
        let len = storage::element_count("Linear::forward", &[rows, outputs])?;
        let mut y = storage::with_capacity("Linear::forward", len)?;
        for _ in 0..rows {
            y.extend_from_slice(b);
        }
        let out = ViewMut::row_major(&mut y, rows, outputs);
        let x_view = View::row_major(xs, rows, inputs);
        if rows <= TRANSPOSED_FORWARD_ROWS && has_kernel() {
            // As yᵀ += Wᵀ xᵀ: Wᵀ streams through broadcasts along its rows, xᵀ is packed.
            let wt = View::row_major(self.weight_t()?, outputs, inputs);
            gemm(wt, x_view.t(), out.t(), true);
        } else {
            let w = View::row_major(contiguous(&self.weight, "Linear weight")?, inputs, outputs);
            gemm(x_view, w, out, true);
        }
        let y = CpuTensor::from_shape_vec(&[rows, outputs], y)?;
        Ok((Batch::single(y), Saved::new(vec![x])))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CpuTensor>,
        saved: Saved<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        let dy = grad_output.into_single()?;
        let [x] = <[CpuTensor; 1]>::try_from(saved.into_tensors()).map_err(|v| Error::Arity {
            expected: 1,
            got: v.len(),
        })?;
        let (inputs, outputs) = (self.inputs(), self.outputs());
        let rows = matrix(&x, "Linear saved input", inputs)?.nrows();
        let dym = matrix(&dy, "Linear::backward", outputs)?;
        same_shape("Linear::backward", &[rows, outputs], dy.shape())?;
        let db = dym.sum_axis(Axis(0)).insert_axis(Axis(0));
        let defer = ctx.defers_weight_grads();
        let dx = {
            let (xs, dys) = (
                x.array().as_standard_layout(),
                dy.array().as_standard_layout(),
            );
            let (Some(xs), Some(dys)) = (xs.as_slice(), dys.as_slice()) else {
                return Err(Error::Shape {
                    op: "Linear::backward",
                    expected: vec![rows, outputs],
                    got: dy.shape().to_vec(),
                });
            };
            if !defer {
                // dW += xᵀ dy, straight into the accumulated gradient.
                self.add_weight_grad(xs, dys, rows)?;
            }
            // dx = dy Wᵀ.
            let w = View::row_major(contiguous(&self.weight, "Linear weight")?, inputs, outputs);
            let dy_view = View::row_major(dys, rows, outputs);
            let len = storage::element_count("Linear::backward", &[rows, inputs])?;
            let mut dx = storage::zeros("Linear::backward", len)?;
            let out = ViewMut::row_major(&mut dx, rows, inputs);
            if rows <= TRANSPOSED_BACKWARD_ROWS {
                // As dxᵀ = W dyᵀ: the weight streams through broadcasts, dyᵀ is packed.
                gemm(w, dy_view.t(), out.t(), false);
            } else {
                gemm(dy_view, w.t(), out, false);
            }
            dx
        };
        *self.bias_grad.array_mut() += &db.into_dyn();
        if defer {
            // Kept for `flush_grads`.
            self.deferred.push((x, dy));
        }
        Ok(Batch::single(CpuTensor::from_shape_vec(
            &[rows, inputs],
            dx,
        )?))
    }

    fn flush_grads(&mut self) -> Result<(), Error> {
        let deferred = std::mem::take(&mut self.deferred);
        let (inputs, outputs) = (self.inputs(), self.outputs());
        if deferred.len() == 1 || !splits_exactly() {
            // One product per call, as backward would have added them.
            for (x, dy) in &deferred {
                self.add_deferred(x, dy)?;
            }
            return Ok(());
        }
        // One product over every kept row: the same sums (the kernel splits k exactly),
        // with the weight gradient read and written once. Xᵀ is gathered transposed, so
        // that the kernel's broadcasts run along its rows.
        const OP: &str = "Linear::flush_grads";
        let rows = deferred
            .iter()
            .try_fold(0usize, |n, (x, _)| n.checked_add(x.shape()[0]))
            .ok_or(Error::ShapeOverflow {
                op: OP,
                shape: deferred.iter().map(|(x, _)| x.shape()[0]).collect(),
            })?;
        let mut xt = storage::zeros(OP, storage::element_count(OP, &[inputs, rows])?)?;
        let mut dys = storage::with_capacity(OP, storage::element_count(OP, &[rows, outputs])?)?;
        let mut r0 = 0;
        for (x, dy) in &deferred {
            let len = x.shape()[0];
            let xs = x.array().as_standard_layout();
            let xs = xs.as_slice().ok_or(Error::Shape {
                op: "Linear::flush_grads",
                expected: vec![len, inputs],
                got: x.shape().to_vec(),
            })?;
            same_shape("Linear::flush_grads", &[len * inputs], &[xs.len()])?;
            transpose(xs, len, inputs, &mut xt[r0..], rows);
            dys.extend(dy.array().iter());
            r0 += len;
        }
        self.add_weight_grad_t(View::row_major(&xt, inputs, rows), &dys)
    }

    fn flush_first_grad(&mut self) -> Result<(), Error> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        let (x, dy) = self.deferred.remove(0);
        self.add_deferred(&x, &dy)
    }

    fn deferred_bytes(&self) -> usize {
        self.deferred
            .iter()
            .map(|(x, dy)| x.size_bytes() + dy.size_bytes())
            .sum()
    }

    fn parameters(&self) -> Vec<Param<'_, CpuTensor>> {
        super::weight_and_bias(
            (&self.weight, &self.weight_grad),
            (&self.bias, &self.bias_grad),
        )
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, CpuTensor>> {
        // The weight may change: the transposed copy is made again when next needed.
        self.weight_t = Vec::new();
        super::weight_and_bias_mut(
            (&mut self.weight, &mut self.weight_grad),
            (&mut self.bias, &mut self.bias_grad),
        )
    }

    fn zero_grad(&mut self) {
        self.weight_grad.array_mut().fill(0.0);
        self.bias_grad.array_mut().fill(0.0);
        self.deferred.clear();
    }
}
