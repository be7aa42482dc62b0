//! `GradBucket`: one flat gradient buffer and where each parameter lives in it.

use crate::{Error, Result};
use lowrank::Backend;
use std::sync::Arc;

/// Where one parameter's gradient lives in a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSlot {
    /// First element in the bucket buffer.
    pub offset: usize,
    /// Number of elements (the product of `shape`).
    pub len: usize,
    /// The parameter's shape (`[]` for a scalar).
    pub shape: Vec<usize>,
}

impl ParamSlot {
    /// The matrix view PowerSGD compresses: `shape[0] x (len / shape[0])` (a vector of
    /// `k` is `k x 1`, a scalar `1 x 1`; a conv weight `O x I x kh x kw` is `O x I·kh·kw`).
    pub fn matrix(&self) -> (usize, usize) {
        match self.shape.first() {
            Some(&n) if n > 0 => (n, self.len / n),
            _ => (1, self.len),
        }
    }
}

/// The layout of a bucket: its parameters, in order, packed one after another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    params: Vec<ParamSlot>,
    len: usize,
}

impl Layout {
    /// Packs parameters of the given shapes one after another. Errors
    /// ([`Error::Overflow`]) if a shape's element count, or the total, does not fit in
    /// `usize`, or if an `f32` buffer of the total would exceed `isize::MAX` bytes (no
    /// allocation could hold it): a product never wraps around.
    pub fn packed(shapes: &[Vec<usize>]) -> Result<Layout> {
        let mut offset = 0usize;
        let mut params = Vec::with_capacity(shapes.len());
        for (i, s) in shapes.iter().enumerate() {
            let len = element_count(s).ok_or_else(|| {
                Error::Overflow(format!("parameter {i} of shape {}", shape_str(s)))
            })?;
            params.push(ParamSlot {
                offset,
                len,
                shape: s.clone(),
            });
            offset = offset
                .checked_add(len)
                .filter(|&total| f32_bytes(total).is_some())
                .ok_or_else(|| {
                    Error::Overflow(format!(
                        "the {} parameters of shapes {}",
                        i + 1,
                        shapes_excerpt(&shapes[..=i])
                    ))
                })?;
        }
        Ok(Layout {
            params,
            len: offset,
        })
    }

    /// The parameters.
    pub fn params(&self) -> &[ParamSlot] {
        &self.params
    }

    /// Total elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the bucket holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// How the reducer lays out the gradients of a bucket in its buffer
/// ([`ReducerConfig::layout`](crate::ReducerConfig::layout)). Which parameters share a
/// bucket, and when it launches, do not depend on it: only where each gradient lies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BucketLayout {
    /// In the bucket's launch order, as DDP's buckets.
    #[default]
    Launch,
    /// Laid out for PowerSGD: the tensors of two or more dimensions first, grouped by the
    /// matrix view PowerSGD compresses ([`ParamSlot::matrix`]; the views in order of
    /// first appearance, each group in launch order), then the 1-D tensors, scalars and
    /// empty tensors, in launch order. Same-shape matrices then lie one after another, so
    /// `batch_tensors_with_same_shape` reads every batch in place (no stacking copies),
    /// and the tensors PowerSGD leaves uncompressed (biases, norms) are one run at the
    /// end of the bucket. A saved PowerSGD state records its layout's shapes, so a state
    /// saved under one layout is refused under the other ([`Error::Bucket`]).
    ByShape,
}

impl BucketLayout {
    /// The order in which this layout places the parameters of `shapes` (one bucket's,
    /// in launch order): indices into `shapes`, a permutation. Applying it to shapes it
    /// has already arranged changes nothing.
    pub fn arrange(self, shapes: &[Vec<usize>]) -> Vec<usize> {
        match self {
            BucketLayout::Launch => (0..shapes.len()).collect(),
            BucketLayout::ByShape => {
                let mut groups: Vec<((usize, usize), Vec<usize>)> = Vec::new();
                let mut rest = Vec::new();
                for (i, s) in shapes.iter().enumerate() {
                    let view = match s.split_first() {
                        Some((&n, tail)) if !tail.is_empty() && n > 0 => {
                            // An overflowing element count fails `Layout::packed` later;
                            // here it only needs some key.
                            Some((n, element_count(tail).unwrap_or(usize::MAX)))
                        }
                        _ => None,
                    };
                    match view.filter(|&(_, m)| m > 0) {
                        Some(key) => match groups.iter_mut().find(|(k, _)| *k == key) {
                            Some((_, members)) => members.push(i),
                            None => groups.push((key, vec![i])),
                        },
                        None => rest.push(i),
                    }
                }
                groups
                    .into_iter()
                    .flat_map(|(_, m)| m)
                    .chain(rest)
                    .collect()
            }
        }
    }
}

/// The number of elements of a tensor of `shape`, if it fits in `usize`.
pub(crate) fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// The bytes of `len` `f32`s, if a buffer of them could exist (at most `isize::MAX`).
pub(crate) fn f32_bytes(len: usize) -> Option<usize> {
    len.checked_mul(size_of::<f32>())
        .filter(|&b| b <= isize::MAX as usize)
}

/// At most the first `max` items, then `…`: error messages stay short whatever the input.
fn excerpt<T>(items: &[T], max: usize, show: impl Fn(&T) -> String) -> String {
    let mut parts: Vec<String> = items.iter().take(max).map(show).collect();
    if items.len() > max {
        parts.push("…".into());
    }
    parts.join(", ")
}

/// A shape for an error message (at most 8 dimensions shown).
pub(crate) fn shape_str(shape: &[usize]) -> String {
    format!("[{}]", excerpt(shape, 8, |d| d.to_string()))
}

/// Shapes for an error message (at most 4 shown).
fn shapes_excerpt(shapes: &[Vec<usize>]) -> String {
    excerpt(shapes, 4, |s| shape_str(s))
}

/// A bucket of gradients handed to a communication hook: one contiguous buffer on the
/// backend `B` plus each parameter's offset and shape. As PyTorch's `GradBucket`, its
/// `index` counts buckets in the order the reducer launches them, and the last one
/// (`is_last`) holds the first layers of the forward pass.
pub struct GradBucket<B: Backend> {
    index: usize,
    count: usize,
    buffer: B::Buffer<f32>,
    layout: Arc<Layout>,
}

impl<B: Backend> GradBucket<B> {
    /// A bucket; errors unless `buffer` holds exactly `layout.len()` elements and
    /// `index < count`.
    pub fn new(
        index: usize,
        count: usize,
        buffer: B::Buffer<f32>,
        layout: Arc<Layout>,
    ) -> Result<Self> {
        if index >= count {
            return Err(Error::Bucket {
                index,
                why: format!("index {index} is not below the bucket count {count}"),
            });
        }
        let len = B::buffer_len(&buffer);
        if len != layout.len() {
            return Err(Error::Bucket {
                index,
                why: format!("buffer has {len} elements, the layout {}", layout.len()),
            });
        }
        Ok(GradBucket {
            index,
            count,
            buffer,
            layout,
        })
    }

    /// Position in launch order.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Number of buckets per step.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Whether this is the last bucket of the step.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// The flat gradient buffer.
    pub fn buffer(&self) -> &B::Buffer<f32> {
        &self.buffer
    }

    /// The flat gradient buffer, mutably.
    pub fn buffer_mut(&mut self) -> &mut B::Buffer<f32> {
        &mut self.buffer
    }

    /// The layout.
    pub fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// Takes the buffer out.
    pub fn into_buffer(self) -> B::Buffer<f32> {
        self.buffer
    }
}
