//! Layers on [`CpuTensor`]: [`Linear`], [`ReLU`], [`Dropout`] and [`BatchNorm`]
//! (per-micro-batch statistics, as torchgpipe's plain batch norm, or deferred running
//! statistics).
//!
//! Each takes and returns a single chunked tensor.

mod activation;
mod batchnorm;
mod linear;

pub use activation::{Dropout, ReLU};
pub use batchnorm::BatchNorm;
pub use linear::Linear;

use ndarray::{ArrayView2, Ix2};

use crate::cpu::CpuTensor;
use crate::error::Error;

/// A 2-D view of `t`, whose second dimension must be `width` (0: any).
fn matrix<'a>(
    t: &'a CpuTensor,
    op: &'static str,
    width: usize,
) -> Result<ArrayView2<'a, f32>, Error> {
    let shape = t.shape();
    let fits = shape.len() == 2 && (width == 0 || shape[1] == width);
    if !fits {
        return Err(Error::Shape {
            op,
            expected: vec![0, width],
            got: shape.to_vec(),
        });
    }
    t.array()
        .view()
        .into_dimensionality::<Ix2>()
        .map_err(|_| Error::Shape {
            op,
            expected: vec![0, width],
            got: shape.to_vec(),
        })
}

/// Checks two shapes are equal.
fn same_shape(op: &'static str, expected: &[usize], got: &[usize]) -> Result<(), Error> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::Shape {
            op,
            expected: expected.to_vec(),
            got: got.to_vec(),
        })
    }
}

/// The `weight` and `bias` parameters of a layer that has both, each with its gradient.
fn weight_and_bias<'a>(
    weight: (&'a CpuTensor, &'a CpuTensor),
    bias: (&'a CpuTensor, &'a CpuTensor),
) -> Vec<crate::layer::Param<'a, CpuTensor>> {
    use crate::layer::Param;
    vec![
        Param {
            name: "weight",
            value: weight.0,
            grad: weight.1,
        },
        Param {
            name: "bias",
            value: bias.0,
            grad: bias.1,
        },
    ]
}

/// [`weight_and_bias`], mutable.
fn weight_and_bias_mut<'a>(
    weight: (&'a mut CpuTensor, &'a mut CpuTensor),
    bias: (&'a mut CpuTensor, &'a mut CpuTensor),
) -> Vec<crate::layer::ParamMut<'a, CpuTensor>> {
    use crate::layer::ParamMut;
    vec![
        ParamMut {
            name: "weight",
            value: weight.0,
            grad: weight.1,
        },
        ParamMut {
            name: "bias",
            value: bias.0,
            grad: bias.1,
        },
    ]
}
