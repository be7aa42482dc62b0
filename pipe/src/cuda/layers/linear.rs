//! [`Linear`] on cuBLAS.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;

use super::super::device::GpuStream;
use super::super::tensor::CudaTensor;
use crate::error::Error;
use crate::layer::{Context, Layer, Param, ParamMut, Saved};
use crate::microbatch::Batch;
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};

use super::{gemm, input, shape_error, weight_and_bias, weight_and_bias_mut};
use crate::cpu;

/// `y = x W + b` on `[batch, inputs]`, `W` stored `[inputs, outputs]`: the products are
/// cuBLAS SGEMMs in full f32 (pedantic math: no TF32), on the layer's stream with its own
/// handle. Saves its input for backward. Weight gradients are never deferred.
pub struct Linear {
    stream: Arc<GpuStream>,
    weight: CudaTensor,
    bias: CudaTensor,
    weight_grad: CudaTensor,
    bias_grad: CudaTensor,
    fault: Option<Error>,
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear")
            .field("weight", &self.weight.shape())
            .finish_non_exhaustive()
    }
}

impl Linear {
    /// The layer [`cpu::Linear::try_new`] makes from the same arguments, on `stream`.
    pub fn new(
        inputs: usize,
        outputs: usize,
        seed: u64,
        stream: &Arc<GpuStream>,
    ) -> Result<Self, Error> {
        Linear::from_cpu(&cpu::Linear::try_new(inputs, outputs, seed)?, stream)
    }

    /// A copy of a CPU layer's parameters on `stream` (gradients zero).
    pub fn from_cpu(layer: &cpu::Linear, stream: &Arc<GpuStream>) -> Result<Self, Error> {
        let (w, b) = (layer.weight(), layer.bias());
        Ok(Linear {
            stream: stream.clone(),
            weight: CudaTensor::from_cpu(w, stream)?,
            bias: CudaTensor::from_cpu(b, stream)?,
            weight_grad: CudaTensor::zeros(stream, w.shape())?,
            bias_grad: CudaTensor::zeros(stream, b.shape())?,
            fault: None,
        })
    }

    /// The weight, `[inputs, outputs]`.
    pub fn weight(&self) -> &CudaTensor {
        &self.weight
    }

    /// The bias, `[1, outputs]`.
    pub fn bias(&self) -> &CudaTensor {
        &self.bias
    }

    /// Brings the parameters and gradients to the layer's stream (a caller may have put
    /// tensors of another stream in through `parameters_mut`).
    fn settle(&mut self) -> Result<(), Error> {
        let s = self.stream.clone();
        for t in [
            &mut self.weight,
            &mut self.bias,
            &mut self.weight_grad,
            &mut self.bias_grad,
        ] {
            t.bring(&s)?;
        }
        Ok(())
    }

    fn dims(&self) -> (usize, usize) {
        (self.weight.shape()[0], self.weight.shape()[1])
    }
}

impl Layer<CudaTensor> for Linear {
    fn forward(
        &mut self,
        input_batch: Batch<CudaTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CudaTensor>, Saved<CudaTensor>), Error> {
        if let Some(e) = self.fault.take() {
            return Err(e);
        }
        self.settle()?;
        let s = &self.stream;
        let x = input(input_batch, s)?;
        let (inputs, outputs) = self.dims();
        if x.shape().len() != 2 || x.shape()[1] != inputs {
            return Err(shape_error("Linear::forward", vec![0, inputs], x.shape()));
        }
        let rows = x.shape()[0];
        let mut y = CudaTensor::uninit(s, &[rows, outputs])?;
        if rows * outputs > 0 {
            let (r, o) = (rows as u64, outputs as u64);
            let cfg = s.gpu().elementwise(rows * outputs);
            launch!(
                s,
                fill_rows,
                cfg,
                [y.slice_mut()?, self.bias.slice(), &r, &o]
            )?;
            if inputs > 0 {
                // Row-major y = x W is column-major yᵀ = Wᵀ xᵀ.
                let (w, xs) = (self.weight.slice(), x.slice());
                gemm(
                    s,
                    (CUBLAS_OP_N, CUBLAS_OP_N),
                    (outputs, rows, inputs),
                    w,
                    outputs,
                    xs,
                    inputs,
                    1.0,
                    y.slice_mut()?,
                    outputs,
                )?;
            }
        }
        Ok((Batch::single(y), Saved::new(vec![x])))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CudaTensor>,
        saved: Saved<CudaTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CudaTensor>, Error> {
        if let Some(e) = self.fault.take() {
            return Err(e);
        }
        self.settle()?;
        let s = self.stream.clone();
        let dy = input(grad_output, &s)?;
        let x = saved
            .into_tensors()
            .into_iter()
            .next()
            .ok_or(Error::Arity {
                expected: 1,
                got: 0,
            })?
            .on(&s)?;
        let (inputs, outputs) = self.dims();
        let rows = x.shape()[0];
        if dy.shape() != [rows, outputs] {
            return Err(shape_error(
                "Linear::backward",
                vec![rows, outputs],
                dy.shape(),
            ));
        }
        let mut dx = CudaTensor::zeros(&s, &[rows, inputs])?;
        if rows * inputs * outputs > 0 {
            // dx = dy Wᵀ: column-major dxᵀ = W dyᵀ.
            gemm(
                &s,
                (CUBLAS_OP_T, CUBLAS_OP_N),
                (inputs, rows, outputs),
                self.weight.slice(),
                outputs,
                dy.slice(),
                outputs,
                0.0,
                dx.slice_mut()?,
                inputs,
            )?;
            // dW += xᵀ dy: column-major dWᵀ += dyᵀ x.
            gemm(
                &s,
                (CUBLAS_OP_N, CUBLAS_OP_T),
                (outputs, inputs, rows),
                dy.slice(),
                outputs,
                x.slice(),
                inputs,
                1.0,
                self.weight_grad.slice_mut()?,
                outputs,
            )?;
        }
        if outputs > 0 {
            let (r, o, acc) = (rows as u64, outputs as u64, 1i32);
            let cfg = s.gpu().elementwise(outputs);
            launch!(
                &s,
                col_sum,
                cfg,
                [self.bias_grad.slice_mut()?, dy.slice(), &r, &o, &acc]
            )?;
        }
        Ok(Batch::single(dx))
    }

    fn parameters(&self) -> Vec<Param<'_, CudaTensor>> {
        weight_and_bias(
            (&self.weight, &self.weight_grad),
            (&self.bias, &self.bias_grad),
        )
    }

    fn parameters_mut(&mut self) -> Vec<ParamMut<'_, CudaTensor>> {
        weight_and_bias_mut(
            (&mut self.weight, &mut self.weight_grad),
            (&mut self.bias, &mut self.bias_grad),
        )
    }

    fn zero_grad(&mut self) {
        let zeroed = CudaTensor::zeros(&self.stream, self.weight.shape())
            .and_then(|w| Ok((w, CudaTensor::zeros(&self.stream, self.bias.shape())?)));
        match zeroed {
            Ok((w, b)) => (self.weight_grad, self.bias_grad) = (w, b),
            // The trait gives no error path: the next call reports it.
            Err(e) => self.fault = Some(e),
        }
    }
}
