//! Batches as tuples of tensors, and scatter/gather into and out of micro-batches.
//!
//! A batch of `N` samples becomes `min(chunks, N)` micro-batches whose sizes differ by at
//! most one, the larger ones first (`tensor_split`'s rule, not `chunk`'s: `chunk` can
//! silently return fewer pieces, N = 5 with chunks = 4 gives 3). Every chunked tensor of a
//! tuple is split the same way; [`Item::NoChunk`] tensors are replicated whole into each
//! micro-batch; [`Item::None`] stays a placeholder.

use crate::error::Error;
use crate::storage;
use crate::tensor::Tensor;
use crate::vocab::Device;

/// One position of a batch tuple.
#[derive(Debug, Clone, PartialEq)]
pub enum Item<T> {
    /// A tensor split along its first (batch) dimension.
    Tensor(T),
    /// A tensor given whole to every micro-batch (PyTorch's `NoChunk`): a mask, a table.
    /// Its gradient is the sum of the micro-batches' gradients.
    NoChunk(T),
    /// No value: an optional input left out, or no gradient for this position.
    None,
}

impl<T> Item<T> {
    /// The kind, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Item::Tensor(_) => "a tensor",
            Item::NoChunk(_) => "a no-chunk tensor",
            Item::None => "none",
        }
    }

    /// The tensor, chunked or not.
    pub fn tensor(&self) -> Option<&T> {
        match self {
            Item::Tensor(t) | Item::NoChunk(t) => Some(t),
            Item::None => None,
        }
    }

    fn same_kind(&self, other: &Item<T>) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// A tuple of [`Item`]s: a layer's input or output, or their gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch<T> {
    items: Vec<Item<T>>,
}

impl<T> From<T> for Batch<T> {
    fn from(tensor: T) -> Self {
        Batch::single(tensor)
    }
}

impl<T> Batch<T> {
    /// A tuple of items.
    pub fn new(items: Vec<Item<T>>) -> Self {
        Batch { items }
    }

    /// One chunked tensor: what most layers take and return.
    pub fn single(tensor: T) -> Self {
        Batch {
            items: vec![Item::Tensor(tensor)],
        }
    }

    /// The items.
    pub fn items(&self) -> &[Item<T>] {
        &self.items
    }

    /// The items, mutably.
    pub fn items_mut(&mut self) -> &mut [Item<T>] {
        &mut self.items
    }

    /// The items, by value.
    pub fn into_items(self) -> Vec<Item<T>> {
        self.items
    }

    /// Number of items in the tuple.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the tuple has no items.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The one chunked tensor of a single-item batch.
    pub fn into_single(self) -> Result<T, Error> {
        let got = self.items.len();
        match <[Item<T>; 1]>::try_from(self.items) {
            Ok([Item::Tensor(t)]) => Ok(t),
            Ok([other]) => Err(Error::NotATensor {
                position: 0,
                got: other.kind(),
            }),
            Err(_) => Err(Error::Arity { expected: 1, got }),
        }
    }

    /// The chunked tensor at `position`.
    pub fn tensor(&self, position: usize) -> Result<&T, Error> {
        match self.items.get(position) {
            Some(Item::Tensor(t)) => Ok(t),
            Some(other) => Err(Error::NotATensor {
                position,
                got: other.kind(),
            }),
            None => Err(Error::Arity {
                expected: position + 1,
                got: self.items.len(),
            }),
        }
    }
}

impl<T: Tensor> Batch<T> {
    /// The common batch length of the chunked tensors.
    pub fn batch_len(&self) -> Result<usize, Error> {
        let mut lens = self.items.iter().filter_map(|item| match item {
            Item::Tensor(t) => Some(t.batch_len()),
            _ => None,
        });
        let first = lens.next().ok_or(Error::NoTensor)?;
        match lens.find(|&len| len != first) {
            Some(second) => Err(Error::BatchLengthMismatch { first, second }),
            None => Ok(first),
        }
    }

    /// Bytes held by all the tensors of the tuple.
    pub fn size_bytes(&self) -> usize {
        self.items
            .iter()
            .filter_map(Item::tensor)
            .map(Tensor::size_bytes)
            .sum()
    }

    /// Moves every tensor to `device`.
    pub fn to_device(self, device: &Device) -> Result<Self, Error> {
        let items = self
            .items
            .into_iter()
            .map(|item| {
                Ok(match item {
                    Item::Tensor(t) => Item::Tensor(t.to_device(device)?),
                    Item::NoChunk(t) => Item::NoChunk(t.to_device(device)?),
                    Item::None => Item::None,
                })
            })
            .collect::<Result<_, Error>>()?;
        Ok(Batch { items })
    }

    /// Splits into micro-batches: `min(chunks, N)` of them, sizes differing by at most one.
    pub fn scatter(self, chunks: usize) -> Result<(Vec<MicroBatch>, Vec<Batch<T>>), Error> {
        let plan = MicroBatch::plan(self.batch_len()?, chunks)?;
        let parts = self.split_as(&plan)?;
        Ok((plan, parts))
    }

    /// Splits along the micro-batches of an earlier [`scatter`](Batch::scatter) (an output
    /// gradient along its forward's micro-batches).
    pub fn split_as(self, plan: &[MicroBatch]) -> Result<Vec<Batch<T>>, Error> {
        const OP: &str = "Batch::split_as";
        let mut sizes = storage::with_capacity(OP, plan.len())?;
        sizes.extend(plan.iter().map(|mb| mb.len));
        let mut parts: Vec<Vec<Item<T>>> = storage::with_capacity(OP, plan.len())?;
        for _ in 0..plan.len() {
            parts.push(storage::with_capacity(OP, self.items.len())?);
        }
        for item in self.items {
            match item {
                Item::Tensor(t) => {
                    for (part, piece) in parts.iter_mut().zip(t.split(&sizes)?) {
                        part.push(Item::Tensor(piece));
                    }
                }
                Item::NoChunk(t) => {
                    for part in parts.iter_mut() {
                        part.push(Item::NoChunk(t.clone()));
                    }
                }
                Item::None => parts.iter_mut().for_each(|part| part.push(Item::None)),
            }
        }
        Ok(parts.into_iter().map(Batch::new).collect())
    }

    /// Joins micro-batch outputs back into one batch: chunked tensors are concatenated in
    /// order; a no-chunk tensor, replicated by definition, is taken from the first
    /// micro-batch. Items must agree in number and kind across micro-batches.
    pub fn gather(parts: Vec<Batch<T>>) -> Result<Batch<T>, Error> {
        gather(parts, false)
    }

    /// Joins micro-batch input gradients: like [`gather`](Batch::gather), except that the
    /// gradients of a no-chunk input are summed, since every micro-batch used it whole.
    pub fn gather_gradients(parts: Vec<Batch<T>>) -> Result<Batch<T>, Error> {
        gather(parts, true)
    }
}

fn gather<T: Tensor>(parts: Vec<Batch<T>>, sum_no_chunk: bool) -> Result<Batch<T>, Error> {
    let Some(first) = parts.first() else {
        return Err(Error::NothingToConcat);
    };
    let arity = first.len();
    if let Some(odd) = parts.iter().find(|p| p.len() != arity) {
        return Err(Error::Arity {
            expected: arity,
            got: odd.len(),
        });
    }
    let mut columns: Vec<Vec<Item<T>>> = (0..arity)
        .map(|_| Vec::with_capacity(parts.len()))
        .collect();
    for part in parts {
        for (column, item) in columns.iter_mut().zip(part.items) {
            column.push(item);
        }
    }
    let mut items = Vec::with_capacity(arity);
    for (position, column) in columns.into_iter().enumerate() {
        if let Some(odd) = column.iter().find(|item| !item.same_kind(&column[0])) {
            return Err(Error::OutputMismatch {
                position,
                first: column[0].kind(),
                second: odd.kind(),
            });
        }
        let mut values = column.into_iter();
        items.push(match values.next() {
            Some(Item::Tensor(t)) => Item::Tensor(T::concat(
                std::iter::once(t)
                    .chain(values.filter_map(|i| match i {
                        Item::Tensor(t) => Some(t),
                        _ => None,
                    }))
                    .collect(),
            )?),
            Some(Item::NoChunk(mut t)) => {
                if sum_no_chunk {
                    for item in values {
                        if let Item::NoChunk(other) = item {
                            t.accumulate(&other)?;
                        }
                    }
                }
                Item::NoChunk(t)
            }
            Some(Item::None) | None => Item::None,
        });
    }
    Ok(Batch { items })
}

/// Where a micro-batch lies in its mini-batch: samples `offset .. offset + len`.
///
/// The loss function of [`Pipe::step`](crate::Pipe::step) gets this, to slice its targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MicroBatch {
    /// Its index, 0-based, in forward order.
    pub index: usize,
    /// Global index of its first sample.
    pub offset: usize,
    /// Its number of samples.
    pub len: usize,
}

impl MicroBatch {
    /// The micro-batches of a batch of `len` samples split into at most `chunks`:
    /// `min(chunks, len)` of them, the first `len % m` one sample longer.
    pub fn plan(len: usize, chunks: usize) -> Result<Vec<MicroBatch>, Error> {
        if chunks == 0 {
            return Err(Error::Chunks(chunks));
        }
        if len == 0 {
            return Err(Error::EmptyBatch);
        }
        let m = chunks.min(len);
        let (base, extra) = (len / m, len % m);
        let mut offset = 0;
        // `m` can be as large as the batch (a tensor of zero-width samples holds any
        // number of them): the plan is allocated fallibly.
        let mut plan = storage::with_capacity("MicroBatch::plan", m)?;
        plan.extend((0..m).map(|index| {
            let len = base + usize::from(index < extra);
            let mb = MicroBatch { index, offset, len };
            offset += len;
            mb
        }));
        Ok(plan)
    }

    /// The global sample indices.
    pub fn samples(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}
