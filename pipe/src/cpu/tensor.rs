//! [`CpuTensor`]: an `f32` n-d array in host memory, on `ndarray`.

use ndarray::{ArrayD, Axis, IxDyn};

use crate::error::Error;
use crate::storage;
use crate::tensor::Tensor;
use crate::vocab::Device;
use crate::wire::{Wire, WireMeta};

/// A dense `f32` array in host memory; the first axis is the batch dimension.
///
/// Cloning copies the data, so [`Tensor::size_bytes`] is an honest count of what each
/// holder keeps. [`Linear`](crate::cpu::Linear)'s products run on one thread (the crate's
/// AVX-512 kernel, or `ndarray`'s where AVX-512 is missing), so one worker per partition
/// uses one core.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    data: ArrayD<f32>,
}

impl CpuTensor {
    /// Wraps an array.
    pub fn new(data: ArrayD<f32>) -> Self {
        CpuTensor { data }
    }

    /// A tensor of the given shape from row-major data.
    pub fn from_shape_vec(shape: &[usize], data: Vec<f32>) -> Result<Self, Error> {
        let got = data.len();
        ArrayD::from_shape_vec(IxDyn(shape), data)
            .map(CpuTensor::new)
            .map_err(|_| Error::Shape {
                op: "from_shape_vec",
                expected: shape.to_vec(),
                got: vec![got],
            })
    }

    /// A tensor of zeros.
    ///
    /// # Panics
    /// If the shape's element count overflows or its storage cannot be allocated;
    /// [`try_zeros`](CpuTensor::try_zeros) returns those as errors.
    pub fn zeros(shape: &[usize]) -> Self {
        CpuTensor::try_zeros(shape).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A tensor of ones.
    ///
    /// # Panics
    /// As [`zeros`](CpuTensor::zeros); [`try_ones`](CpuTensor::try_ones) returns errors.
    pub fn ones(shape: &[usize]) -> Self {
        CpuTensor::try_ones(shape).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A tensor of zeros, or an error: [`Error::ShapeOverflow`] if the product of `shape`
    /// does not fit in `usize`, [`Error::Alloc`] if its elements exceed `isize::MAX`
    /// bytes or the allocator refuses them. The zeros come from the allocator's zeroed
    /// allocation (as ndarray's `zeros`): a large tensor's pages are mapped lazily.
    pub fn try_zeros(shape: &[usize]) -> Result<Self, Error> {
        let len = storage::element_count("CpuTensor::zeros", shape)?;
        CpuTensor::from_shape_vec(shape, storage::zeros("CpuTensor::zeros", len)?)
    }

    /// A tensor of ones, or an error, as [`try_zeros`](CpuTensor::try_zeros).
    pub fn try_ones(shape: &[usize]) -> Result<Self, Error> {
        let len = storage::element_count("CpuTensor::ones", shape)?;
        CpuTensor::from_shape_vec(shape, storage::filled("CpuTensor::ones", len, 1.0)?)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.data.shape()
    }

    /// The array.
    pub fn array(&self) -> &ArrayD<f32> {
        &self.data
    }

    /// The array, mutably.
    pub fn array_mut(&mut self) -> &mut ArrayD<f32> {
        &mut self.data
    }

    /// The array, by value.
    pub fn into_array(self) -> ArrayD<f32> {
        self.data
    }

    /// The elements in row-major order.
    pub fn to_vec(&self) -> Vec<f32> {
        self.data.iter().copied().collect()
    }

    /// `max |self - other|`, or `None` when the shapes differ.
    pub fn max_abs_diff(&self, other: &CpuTensor) -> Option<f32> {
        (self.shape() == other.shape()).then(|| {
            self.data
                .iter()
                .zip(other.data.iter())
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
        })
    }

    /// `max |self|`.
    pub fn max_abs(&self) -> f32 {
        self.data.iter().fold(0.0f32, |m, a| m.max(a.abs()))
    }
}

impl From<ArrayD<f32>> for CpuTensor {
    fn from(data: ArrayD<f32>) -> Self {
        CpuTensor::new(data)
    }
}

impl From<ndarray::Array2<f32>> for CpuTensor {
    fn from(data: ndarray::Array2<f32>) -> Self {
        CpuTensor::new(data.into_dyn())
    }
}

impl Tensor for CpuTensor {
    fn batch_len(&self) -> usize {
        self.data.shape().first().copied().unwrap_or(0)
    }

    fn split(&self, sizes: &[usize]) -> Result<Vec<Self>, Error> {
        let len = self.batch_len();
        let total = sizes.iter().try_fold(0usize, |t, &s| t.checked_add(s));
        if self.data.ndim() == 0 || total != Some(len) {
            return Err(Error::SplitSizes {
                sizes: sizes.to_vec(),
                len,
            });
        }
        let mut start = 0;
        Ok(sizes
            .iter()
            .map(|&size| {
                let part = self
                    .data
                    .slice_axis(Axis(0), (start..start + size).into())
                    .to_owned();
                start += size;
                CpuTensor::new(part)
            })
            .collect())
    }

    fn concat(mut parts: Vec<Self>) -> Result<Self, Error> {
        match parts.len() {
            0 => Err(Error::NothingToConcat),
            1 => Ok(parts.swap_remove(0)),
            _ => {
                let views: Vec<_> = parts.iter().map(|p| p.data.view()).collect();
                ndarray::concatenate(Axis(0), &views)
                    .map(CpuTensor::new)
                    .map_err(|_| {
                        let first = parts[0].shape().to_vec();
                        let got = parts
                            .iter()
                            .map(|p| p.shape().to_vec())
                            .find(|s| s.len() != first.len() || s[1..] != first[1..])
                            .unwrap_or_default();
                        Error::Shape {
                            op: "concat",
                            expected: first,
                            got,
                        }
                    })
            }
        }
    }

    fn size_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }

    fn accumulate(&mut self, other: &Self) -> Result<(), Error> {
        if self.shape() != other.shape() {
            return Err(Error::Shape {
                op: "accumulate",
                expected: self.shape().to_vec(),
                got: other.shape().to_vec(),
            });
        }
        self.data += &other.data;
        Ok(())
    }

    fn to_device(self, device: &Device) -> Result<Self, Error> {
        if device.is_host() {
            Ok(self)
        } else {
            Err(Error::Device {
                tensor: "CpuTensor",
                device: *device,
            })
        }
    }
}

/// The element type code of [`CpuTensor`] on the wire: `f32`.
const WIRE_F32: u8 = 0;

impl Wire for CpuTensor {
    fn write_wire(&self, out: &mut Vec<u8>) -> Result<WireMeta, Error> {
        let bytes = self.data.len() * size_of::<f32>();
        out.try_reserve(bytes).map_err(|_| Error::Alloc {
            op: "CpuTensor::write_wire",
            elements: self.data.len(),
            element_bytes: size_of::<f32>(),
        })?;
        match self.data.as_slice() {
            // Row-major and contiguous (every tensor the crate's layers make): one copy.
            Some(elements) => out.extend_from_slice(bytemuck::cast_slice(elements)),
            None => self
                .data
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        }
        Ok(WireMeta {
            dtype: WIRE_F32,
            shape: self.data.shape().to_vec(),
        })
    }

    fn read_wire(meta: &WireMeta, bytes: &[u8], device: &Device) -> Result<Self, Error> {
        if meta.dtype != WIRE_F32 {
            return Err(Error::WireType {
                tensor: "CpuTensor",
                dtype: meta.dtype,
            });
        }
        let elements = storage::element_count("CpuTensor::read_wire", &meta.shape)?;
        if elements.checked_mul(size_of::<f32>()) != Some(bytes.len()) {
            return Err(Error::Shape {
                op: "CpuTensor::read_wire",
                expected: meta.shape.clone(),
                got: vec![bytes.len() / size_of::<f32>()],
            });
        }
        let mut data = storage::zeros("CpuTensor::read_wire", elements)?;
        bytemuck::cast_slice_mut::<f32, u8>(&mut data).copy_from_slice(bytes);
        CpuTensor::from_shape_vec(&meta.shape, data)?.to_device(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_then_concat_is_identity_and_bad_sizes_are_errors() {
        let t = CpuTensor::from_shape_vec(&[5, 2], (0..10).map(|v| v as f32).collect()).unwrap();
        let parts = t.split(&[2, 2, 1]).unwrap();
        assert_eq!(parts[2].to_vec(), vec![8.0, 9.0]);
        assert_eq!(CpuTensor::concat(parts).unwrap(), t);
        assert!(matches!(
            t.split(&[2, 2]),
            Err(Error::SplitSizes { len: 5, .. })
        ));
        let other = CpuTensor::zeros(&[1, 3]);
        assert!(matches!(
            CpuTensor::concat(vec![t.clone(), other]),
            Err(Error::Shape { op: "concat", .. })
        ));
        assert!(matches!(
            CpuTensor::concat(vec![]),
            Err(Error::NothingToConcat)
        ));
    }

    #[test]
    fn accumulate_checks_shapes_and_devices_are_checked() {
        let mut a = CpuTensor::ones(&[2, 2]);
        a.accumulate(&CpuTensor::ones(&[2, 2])).unwrap();
        assert_eq!(a.to_vec(), vec![2.0; 4]);
        assert!(a.accumulate(&CpuTensor::ones(&[4])).is_err());
        assert_eq!(a.size_bytes(), 16);
        assert!(a.clone().to_device(&Device::CpuCore(1)).is_ok());
        assert!(matches!(
            a.to_device(&Device::Cuda(0)),
            Err(Error::Device { .. })
        ));
    }
}
