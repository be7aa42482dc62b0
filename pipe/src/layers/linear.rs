//! [`Linear`]: `y = x W + b`.

use ndarray::{Array2, Axis};

use super::{matrix, same_shape};
use crate::cpu::CpuTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;
use crate::rng::Stream;

/// A fully connected layer, `y = x W + b` on `[batch, inputs]`, with `W` stored as
/// `[inputs, outputs]`. Saves its input for backward.
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

impl Layer<CpuTensor> for Linear {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let x = input.into_single()?;
        let y = {
            let xm = matrix(&x, "Linear::forward", self.inputs())?;
            let w = matrix(&self.weight, "Linear weight", self.outputs())?;
            let b = matrix(&self.bias, "Linear bias", self.outputs())?;
            xm.dot(&w) + b
        };
        Ok((Batch::single(y.into()), Saved::new(vec![x])))
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
        let xm = matrix(&x, "Linear saved input", self.inputs())?;
        let dym = matrix(&dy, "Linear::backward", self.outputs())?;
        same_shape(
            "Linear::backward",
            &[xm.nrows(), self.outputs()],
            dy.shape(),
        )?;
        let dw = xm.t().dot(&dym);
        let db = dym.sum_axis(Axis(0)).insert_axis(Axis(0));
        let dx = dym.dot(&matrix(&self.weight, "Linear weight", self.outputs())?.t());
        *self.weight_grad.array_mut() += &dw.into_dyn();
        *self.bias_grad.array_mut() += &db.into_dyn();
        Ok(Batch::single(dx.into()))
    }

    fn parameters(&self) -> Vec<Param<'_, CpuTensor>> {
        vec![
            Param {
                name: "weight",
                value: &self.weight,
                grad: &self.weight_grad,
            },
            Param {
                name: "bias",
                value: &self.bias,
                grad: &self.bias_grad,
            },
        ]
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, CpuTensor>> {
        vec![
            ParamMut {
                name: "weight",
                value: &mut self.weight,
                grad: &mut self.weight_grad,
            },
            ParamMut {
                name: "bias",
                value: &mut self.bias,
                grad: &mut self.bias_grad,
            },
        ]
    }

    fn zero_grad(&mut self) {
        self.weight_grad.array_mut().fill(0.0);
        self.bias_grad.array_mut().fill(0.0);
    }
}
