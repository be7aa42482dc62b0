//! [`GradTensor`]: what the reducer needs from a pipe's tensor type.

use pipe::cpu::CpuTensor;
use pipe::Tensor;

/// What the reducer needs from a pipe's tensor type: its shape, and copies of its
/// elements (row-major, `f32`) into and out of host memory. Implemented for
/// [`CpuTensor`].
pub trait GradTensor: Tensor {
    /// The shape.
    fn dims(&self) -> Vec<usize>;

    /// Copies the elements, row-major, into `out`, whose length is the element count
    /// (another length is an error).
    fn copy_to(&self, out: &mut [f32]) -> Result<(), pipe::Error>;

    /// Overwrites the elements, row-major, from `src`, whose length is the element count
    /// (another length is an error).
    fn copy_from(&mut self, src: &[f32]) -> Result<(), pipe::Error>;
}

impl GradTensor for CpuTensor {
    fn dims(&self) -> Vec<usize> {
        self.shape().to_vec()
    }

    fn copy_to(&self, out: &mut [f32]) -> Result<(), pipe::Error> {
        same_len("copy_to", self, out.len())?;
        match self.array().as_slice() {
            Some(values) => out.copy_from_slice(values),
            None => out
                .iter_mut()
                .zip(self.array().iter())
                .for_each(|(o, v)| *o = *v),
        }
        Ok(())
    }

    fn copy_from(&mut self, src: &[f32]) -> Result<(), pipe::Error> {
        same_len("copy_from", self, src.len())?;
        match self.array_mut().as_slice_mut() {
            Some(values) => values.copy_from_slice(src),
            None => self
                .array_mut()
                .iter_mut()
                .zip(src)
                .for_each(|(v, s)| *v = *s),
        }
        Ok(())
    }
}

fn same_len(op: &'static str, t: &CpuTensor, len: usize) -> Result<(), pipe::Error> {
    if t.array().len() == len {
        Ok(())
    } else {
        Err(pipe::Error::Shape {
            op,
            expected: t.shape().to_vec(),
            got: vec![len],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipe::cpu::CpuTensor;

    #[test]
    fn cpu_tensors_copy_in_and_out_and_refuse_other_lengths() {
        let mut t = CpuTensor::from_shape_vec(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let mut out = vec![0.0; 4];
        t.copy_to(&mut out).unwrap();
        assert_eq!(out, vec![1.0, 2.0, 3.0, 4.0]);
        t.copy_from(&[5.0, 6.0, 7.0, 8.0]).unwrap();
        assert_eq!(t.to_vec(), vec![5.0, 6.0, 7.0, 8.0]);
        assert!(t.copy_to(&mut [0.0; 3]).is_err());
        assert!(t.copy_from(&[0.0; 5]).is_err());
        // A transposed (non-contiguous) view copies in logical row-major order.
        let tr = CpuTensor::new(t.array().clone().reversed_axes());
        tr.copy_to(&mut out).unwrap();
        assert_eq!(out, vec![5.0, 7.0, 6.0, 8.0]);
    }
}
