//! [`Linear`]: `y = x W + b`.

use ndarray::{Array2, Axis};

use super::{matrix, same_shape};
use crate::cpu::CpuTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::matmul::{gemm, View, ViewMut};
use crate::microbatch::Batch;
use crate::rng::Stream;

/// Up to this many rows the forward pass computes `yᵀ = Wᵀ xᵀ`, streaming the weight
/// through broadcasts and packing only `xᵀ`; beyond it, `y = x W` with the weight packed,
/// which is faster once enough rows share each packed block.
const TRANSPOSED_FORWARD_ROWS: usize = 64;
/// The same choice for the input gradient: `dxᵀ = W dyᵀ` up to this many rows, else
/// `dx = dy Wᵀ`.
const TRANSPOSED_BACKWARD_ROWS: usize = 64;

/// A fully connected layer, `y = x W + b` on `[batch, inputs]`, with `W` stored as
/// `[inputs, outputs]`. Saves its input for backward.
///
/// The products run on the crate's single-threaded kernel (AVX-512 where available, see
/// the `matmul` module), chosen so that a micro-batch of a few dozen rows runs nearly as
/// fast per row as a whole batch.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: CpuTensor,
    bias: CpuTensor,
    weight_grad: CpuTensor,
    bias_grad: CpuTensor,
}

impl Linear {
    /// A layer initialised uniformly in `±1/sqrt(inputs)` (PyTorch's default range) from
    /// `seed`: the same seed gives the same weights.
    pub fn new(inputs: usize, outputs: usize, seed: u64) -> Self {
        let bound = 1.0 / (inputs.max(1) as f32).sqrt();
        let rng = Stream::new(seed, 0, 0);
        let draw = |row: usize, col: usize| {
            (2.0 * rng.sample(row as u64).uniform(col as u64) - 1.0) * bound
        };
        let weight = Array2::from_shape_fn((inputs, outputs), |(i, o)| draw(i, o));
        let bias = Array2::from_shape_fn((1, outputs), |(_, o)| draw(inputs, o));
        Linear::with_zero_grads(weight, bias)
    }

    /// A layer with the given weight `[inputs, outputs]` and bias `[1, outputs]`.
    pub fn from_parts(weight: Array2<f32>, bias: Array2<f32>) -> Result<Self, Error> {
        same_shape("Linear bias", &[1, weight.ncols()], bias.shape())?;
        Ok(Linear::with_zero_grads(weight, bias))
    }

    fn with_zero_grads(weight: Array2<f32>, bias: Array2<f32>) -> Self {
        let (wg, bg) = (
            Array2::zeros(weight.raw_dim()),
            Array2::zeros(bias.raw_dim()),
        );
        Linear {
            weight: weight.into(),
            bias: bias.into(),
            weight_grad: wg.into(),
            bias_grad: bg.into(),
        }
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
        let w = View::row_major(contiguous(&self.weight, "Linear weight")?, inputs, outputs);
        let b = contiguous(&self.bias, "Linear bias")?;
        same_shape("Linear bias", &[outputs], &[b.len()])?;
        // y = 1 bᵀ + x W.
        let mut y = Vec::with_capacity(rows * outputs);
        for _ in 0..rows {
            y.extend_from_slice(b);
        }
        let out = ViewMut::row_major(&mut y, rows, outputs);
        let x_view = View::row_major(xs, rows, inputs);
        if rows <= TRANSPOSED_FORWARD_ROWS {
            // As yᵀ += Wᵀ xᵀ: the weight streams through broadcasts, xᵀ is packed.
            gemm(w.t(), x_view.t(), out.t(), true);
        } else {
            gemm(x_view, w, out, true);
        }
        let y = CpuTensor::from_shape_vec(&[rows, outputs], y)?;
        Ok((Batch::single(y), Saved::new(vec![x])))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CpuTensor>,
        saved: Saved<CpuTensor>,
        _ctx: &mut Context,
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
        // dW += xᵀ dy, straight into the accumulated gradient.
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
        let x_view = View::row_major(xs, rows, inputs);
        let dy_view = View::row_major(dys, rows, outputs);
        gemm(
            x_view.t(),
            dy_view,
            ViewMut::row_major(dw, inputs, outputs),
            true,
        );
        // dx = dy Wᵀ.
        let w = View::row_major(contiguous(&self.weight, "Linear weight")?, inputs, outputs);
        let mut dx = vec![0.0f32; rows * inputs];
        let out = ViewMut::row_major(&mut dx, rows, inputs);
        if rows <= TRANSPOSED_BACKWARD_ROWS {
            // As dxᵀ = W dyᵀ: the weight streams through broadcasts, dyᵀ is packed.
            gemm(w, dy_view.t(), out.t(), false);
        } else {
            gemm(dy_view, w.t(), out, false);
        }
        *self.bias_grad.array_mut() += &db.into_dyn();
        Ok(Batch::single(CpuTensor::from_shape_vec(
            &[rows, inputs],
            dx,
        )?))
    }

    fn parameters(&self) -> Vec<Param<'_, CpuTensor>> {
        super::weight_and_bias(
            (&self.weight, &self.weight_grad),
            (&self.bias, &self.bias_grad),
        )
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, CpuTensor>> {
        super::weight_and_bias_mut(
            (&mut self.weight, &mut self.weight_grad),
            (&mut self.bias, &mut self.bias_grad),
        )
    }

    fn zero_grad(&mut self) {
        self.weight_grad.array_mut().fill(0.0);
        self.bias_grad.array_mut().fill(0.0);
    }
}
