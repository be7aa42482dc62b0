//! Micro-batching (§7 rows 6, 12 and 13, "Our choices" #1): sizes, tuples, `NoChunk`, and
//! mismatched outputs.

mod common;

use common::*;
use pipe::cpu::{CpuTensor, ReLU};
use pipe::{Batch, Context, Error, Item, Layer, MicroBatch, Pipe, Saved, Tensor};

#[test]
fn min_chunks_batch_micro_batches_differing_by_at_most_one() {
    let sizes = |len, chunks| {
        MicroBatch::plan(len, chunks)
            .unwrap()
            .iter()
            .map(|m| m.len)
            .collect::<Vec<_>>()
    };
    // torch.chunk would give 3 micro-batches (2, 2, 1) for N = 5, chunks = 4.
    assert_eq!(sizes(5, 4), vec![2, 1, 1, 1]);
    assert_eq!(sizes(7, 4), vec![2, 2, 2, 1]); // test_batch_size_indivisible
    assert_eq!(sizes(2, 4), vec![1, 1]); // test_batch_size_small
    assert_eq!(sizes(8, 4), vec![2, 2, 2, 2]);
    for len in 1..20 {
        for chunks in 1..10 {
            let plan = MicroBatch::plan(len, chunks).unwrap();
            assert_eq!(plan.len(), chunks.min(len));
            let (lo, hi) = (
                plan.iter().map(|m| m.len).min().unwrap(),
                plan.iter().map(|m| m.len).max().unwrap(),
            );
            assert!(hi - lo <= 1);
            assert_eq!(plan.last().map(|m| m.offset + m.len), Some(len));
        }
    }
    assert!(matches!(MicroBatch::plan(0, 2), Err(Error::EmptyBatch)));
    assert!(matches!(MicroBatch::plan(3, 0), Err(Error::Chunks(0))));
}

#[test]
fn indivisible_and_tiny_batches_run() {
    for (len, micro_batches) in [(7, 4), (2, 2)] {
        let mut pipe = Pipe::builder(plain_model(), &[2, 2])
            .chunks(4)
            .build()
            .unwrap();
        let target = data(len, 3, 2);
        let out = pipe
            .step(Batch::single(data(len, 5, 1)), |mb, y| mse(&target, mb, y))
            .unwrap();
        assert_eq!(out.losses.len(), micro_batches);
        assert_eq!(out.output.tensor(0).unwrap().shape(), &[len, 3]);
    }
}

/// Adds its two inputs: `(a, b) -> a + b`; a no-chunk `b` is a row broadcast to the batch.
struct AddPair;

impl Layer<CpuTensor> for AddPair {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let items = input.into_items();
        let (Some(Item::Tensor(a)), Some(other)) = (items.first(), items.get(1)) else {
            return Err(Error::Arity {
                expected: 2,
                got: items.len(),
            });
        };
        let b = other.tensor().ok_or(Error::NotATensor {
            position: 1,
            got: other.kind(),
        })?;
        Ok((
            Batch::single(CpuTensor::new(a.array() + b.array())),
            Saved::none(),
        ))
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        let g = grad.into_single()?;
        Ok(Batch::new(vec![Item::Tensor(g.clone()), Item::Tensor(g)]))
    }
}

/// Passes its input on as a pair `(x, 2x)`, for tuple outputs across partitions.
struct Fork;

impl Layer<CpuTensor> for Fork {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let x = input.into_single()?;
        let twice = CpuTensor::new(x.array() * 2.0);
        Ok((
            Batch::new(vec![Item::Tensor(x), Item::Tensor(twice)]),
            Saved::none(),
        ))
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        let (a, b) = (grad.tensor(0)?, grad.tensor(1)?);
        Ok(Batch::single(CpuTensor::new(
            a.array() + &(b.array() * 2.0),
        )))
    }
}

#[test]
fn tuple_input_reaches_every_input_with_its_gradient() {
    // test_input_pair: a pair in, gradients for both out; a pair also crosses partitions.
    let layers: Vec<Box<dyn Layer<CpuTensor>>> =
        vec![Box::new(AddPair), Box::new(Fork), Box::new(AddPair)];
    let mut pipe = Pipe::builder(layers, &[1, 1, 1]).chunks(3).build().unwrap();
    let (a, b) = (data(5, 2, 1), data(5, 2, 2));
    let input = Batch::new(vec![Item::Tensor(a.clone()), Item::Tensor(b.clone())]);
    let out = pipe.step(input, sum_loss).unwrap();
    // y = (a + b) + 2 (a + b) = 3 (a + b); dy/da = dy/db = 3.
    let expected = CpuTensor::new((a.array() + b.array()) * 3.0);
    assert!(relative(out.output.tensor(0).unwrap(), &expected) < 1e-6);
    assert_eq!(out.input_grad.len(), 2);
    for k in 0..2 {
        assert_eq!(
            out.input_grad.tensor(k).unwrap(),
            &CpuTensor::new(CpuTensor::ones(&[5, 2]).array() * 3.0)
        );
    }
}

/// `(x, NoChunk(b)) -> x + b`, a row `b` broadcast over the batch; its gradient for `b` is
/// the column sums of the output gradient, as a no-chunk item.
struct AddBias;

impl Layer<CpuTensor> for AddBias {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        let x = input.tensor(0)?;
        let Some(Item::NoChunk(b)) = input.items().get(1) else {
            return Err(Error::Arity {
                expected: 2,
                got: input.len(),
            });
        };
        // Every micro-batch sees the whole bias.
        assert_eq!(
            b.shape(),
            &[1, 4],
            "micro-batch {}",
            ctx.micro_batch().index
        );
        Ok((
            Batch::single(CpuTensor::new(x.array() + b.array())),
            Saved::none(),
        ))
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        let g = grad.into_single()?;
        let db = CpuTensor::new(
            g.array()
                .sum_axis(ndarray::Axis(0))
                .insert_axis(ndarray::Axis(0)),
        );
        Ok(Batch::new(vec![Item::Tensor(g), Item::NoChunk(db)]))
    }
}

#[test]
fn no_chunk_inputs_are_replicated_and_their_gradients_summed() {
    let layers: Vec<Box<dyn Layer<CpuTensor>>> = vec![Box::new(AddBias), Box::new(ReLU)];
    let mut pipe = Pipe::builder(layers, &[1, 1]).chunks(3).build().unwrap();
    let bias = CpuTensor::ones(&[1, 4]);
    let x = CpuTensor::ones(&[6, 4]);
    let input = Batch::new(vec![Item::Tensor(x), Item::NoChunk(bias.clone())]);
    let seen = std::sync::Mutex::new(Vec::new());
    let out = pipe
        .step(input, |mb, y| {
            seen.lock().unwrap().push(mb.len);
            sum_loss(mb, y)
        })
        .unwrap();
    assert_eq!(seen.into_inner().unwrap(), vec![2, 2, 2]);
    assert_eq!(
        out.output.tensor(0).unwrap(),
        &CpuTensor::new(CpuTensor::ones(&[6, 4]).array() * 2.0)
    );
    // Three micro-batches of two rows, each contributing column sums of 2: 6 in all.
    assert_eq!(
        out.input_grad.items()[1],
        Item::NoChunk(CpuTensor::new(CpuTensor::ones(&[1, 4]).array() * 6.0))
    );
    assert_eq!(out.input_grad.tensor(0).unwrap(), &CpuTensor::ones(&[6, 4]));
    // Gathering outputs takes a replicated item once; gathering gradients sums it.
    let parts = Batch::new(vec![
        Item::Tensor(data(6, 1, 1)),
        Item::NoChunk(bias.clone()),
    ])
    .scatter(3)
    .unwrap()
    .1;
    assert!(parts
        .iter()
        .all(|p| p.items()[1] == Item::NoChunk(bias.clone())));
    assert_eq!(
        Batch::gather(parts).unwrap().items()[1],
        Item::NoChunk(bias)
    );
}

#[test]
fn inputs_without_tensors_or_of_different_lengths_are_errors() {
    let mut pipe = Pipe::builder(plain_model(), &[4]).build().unwrap();
    let none = Batch::new(vec![Item::NoChunk(data(2, 5, 1)), Item::None]);
    assert!(matches!(pipe.forward(none), Err(Error::NoTensor)));
    let ragged = Batch::new(vec![
        Item::Tensor(data(2, 5, 1)),
        Item::Tensor(data(3, 5, 1)),
    ]);
    assert!(matches!(
        pipe.forward(ragged),
        Err(Error::BatchLengthMismatch {
            first: 2,
            second: 3
        })
    ));
    let wrong = Batch::single(data(2, 4, 1));
    let err = pipe.forward(wrong).unwrap_err();
    assert_eq!(err.to_string(), "partition 0, layer 0 (Linear), micro-batch 0, forward: Linear::forward: shape [2, 4] does not fit [0, 5]");
}

/// Returns a tensor for micro-batch 0 and nothing for the others.
struct Uneven;

impl Layer<CpuTensor> for Uneven {
    fn forward(
        &mut self,
        input: Batch<CpuTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CpuTensor>, Saved<CpuTensor>), Error> {
        Ok(if ctx.micro_batch().index == 0 {
            (input, Saved::none())
        } else {
            (Batch::new(vec![Item::None]), Saved::none())
        })
    }

    fn backward(
        &mut self,
        grad: Batch<CpuTensor>,
        _saved: Saved<CpuTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CpuTensor>, Error> {
        Ok(grad)
    }
}

#[test]
fn outputs_of_different_kinds_are_an_error() {
    // test_non_tensor: the Rust types rule out non-tensors; what remains is micro-batches
    // disagreeing about what an output position holds.
    let mut pipe = Pipe::builder(vec![Box::new(Uneven) as Box<dyn Layer<CpuTensor>>], &[1])
        .chunks(2)
        .build()
        .unwrap();
    let err = pipe.forward(Batch::single(data(2, 1, 1))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "types of micro-batch outputs do not match at position 0: a tensor and none"
    );
    assert_eq!(Batch::single(data(3, 2, 1)).size_bytes(), 24);
    assert_eq!(data(3, 2, 1).batch_len(), 3);
}
