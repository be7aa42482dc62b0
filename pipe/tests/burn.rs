//! `pipe::burn`: burn tensors as pipe tensors and burn modules as stages, against burn's own
//! autodiff on the whole model; parameters written back under the same ids; randomness
//! refused under checkpointing; a training run saved and resumed bit for bit.

use burn_core as burn;
use burn_core::module::{Module, Param};
use burn_tensor::backend::Backend;
use burn_tensor::{Distribution, Tensor as BTensor, TensorData};
use pipe::burn::{BurnError, BurnLayer, BurnTensor, CpuAutodiff};
use pipe::{Batch, Checkpoint, Context, Device, Error, Layer, Pipe, ScheduleKind, Tensor};

type Ad = CpuAutodiff;
type T = BurnTensor<Ad>;

/// `x w + b`.
#[derive(Module, Debug)]
struct Linear<B: Backend> {
    w: Param<BTensor<B, 2>>,
    b: Param<BTensor<B, 1>>,
}

impl<B: Backend> Linear<B> {
    fn new(inputs: usize, outputs: usize, salt: usize) -> Self {
        let d = Default::default();
        let w: Vec<f32> = (0..inputs * outputs)
            .map(|k| (((k * 37 + salt * 11) % 23) as f32 / 23.0 - 0.5) / (inputs as f32).sqrt())
            .collect();
        let b: Vec<f32> = (0..outputs)
            .map(|k| ((k * 5 + salt) % 7) as f32 / 70.0)
            .collect();
        Linear {
            w: Param::from_tensor(BTensor::from_data(
                TensorData::new(w, [inputs, outputs]),
                &d,
            )),
            b: Param::from_tensor(BTensor::from_data(TensorData::new(b, [outputs]), &d)),
        }
    }

    fn forward(&self, x: BTensor<B, 2>) -> BTensor<B, 2> {
        x.matmul(self.w.val()) + self.b.val().unsqueeze::<2>()
    }
}

fn data(rows: usize, cols: usize, salt: usize) -> BTensor<Ad, 2> {
    let v: Vec<f32> = (0..rows * cols)
        .map(|k| ((k * 13 + salt * 7) % 17) as f32 / 17.0 - 0.5)
        .collect();
    BTensor::from_data(TensorData::new(v, [rows, cols]), &Default::default())
}

fn values(t: &T) -> Vec<f32> {
    t.to_vec_f32()
}

fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let num = a
        .iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    num / b.iter().map(|b| b.abs()).fold(f32::MIN_POSITIVE, f32::max)
}

fn burn_error(e: &Error) -> Option<&BurnError> {
    match e {
        Error::Failed { source, .. } => burn_error(source),
        Error::Custom(source) => source.downcast_ref::<BurnError>(),
        _ => None,
    }
}

/// The model: linear + tanh, linear + tanh, linear (5 -> 8 -> 8 -> 3).
fn modules() -> Vec<Linear<Ad>> {
    vec![
        Linear::new(5, 8, 1),
        Linear::new(8, 8, 2),
        Linear::new(8, 3, 3),
    ]
}

fn stages(modules: Vec<Linear<Ad>>) -> Vec<Box<dyn Layer<T>>> {
    let n = modules.len();
    modules
        .into_iter()
        .enumerate()
        .map(|(i, m)| -> Box<dyn Layer<T>> {
            if i + 1 < n {
                Box::new(BurnLayer::new(m, |m: &Linear<Ad>, x| m.forward(x).tanh()))
            } else {
                Box::new(BurnLayer::new(m, |m: &Linear<Ad>, x| m.forward(x)))
            }
        })
        .collect()
}

fn whole(modules: &[Linear<Ad>], x: BTensor<Ad, 2>) -> BTensor<Ad, 2> {
    let mut h = x;
    for (i, m) in modules.iter().enumerate() {
        h = m.forward(h);
        if i + 1 < modules.len() {
            h = h.tanh();
        }
    }
    h
}

#[test]
fn split_concat_accumulate_and_devices_on_burn_tensors() {
    let x = BTensor::<Ad, 3>::from_data(
        TensorData::new((0..24).map(|v| v as f32).collect::<Vec<f32>>(), [4, 3, 2]),
        &Default::default(),
    );
    let t = BurnTensor::from_tensor(x);
    assert_eq!(t.batch_len(), 4);
    assert_eq!(t.size_bytes(), 24 * 4);
    let parts = t.split(&[1, 3]).unwrap();
    assert_eq!(parts[0].dims(), vec![1, 3, 2]);
    assert_eq!(parts[1].dims(), vec![3, 3, 2]);
    assert_eq!(values(&parts[1])[0], 6.0);
    let back = T::concat(parts.clone()).unwrap();
    assert_eq!(back.dims(), vec![4, 3, 2]);
    assert_eq!(values(&back), (0..24).map(|v| v as f32).collect::<Vec<_>>());
    // Bad sizes, nothing to concat, mismatched shapes.
    assert!(matches!(t.split(&[1, 2]), Err(Error::SplitSizes { .. })));
    assert!(matches!(T::concat(vec![]), Err(Error::NothingToConcat)));
    let other = BurnTensor::from_tensor(data(2, 5, 0));
    assert!(matches!(
        T::concat(vec![parts[0].clone(), other.clone()]),
        Err(Error::Shape { .. })
    ));
    // Accumulate adds; shapes must match.
    let mut acc = parts[0].clone();
    acc.accumulate(&parts[0]).unwrap();
    assert_eq!(
        values(&acc),
        values(&parts[0])
            .iter()
            .map(|v| 2.0 * v)
            .collect::<Vec<_>>()
    );
    assert!(matches!(acc.accumulate(&other), Err(Error::Shape { .. })));
    // Host devices keep it; a GPU is refused.
    assert_eq!(
        values(&t.clone().to_device(&Device::Cpu).unwrap()),
        values(&t)
    );
    assert!(matches!(
        t.clone().to_device(&Device::Cuda(0)),
        Err(Error::Device { .. })
    ));
    // The rank is checked when the tensor is taken back.
    assert!(t.to_tensor::<3>().is_ok());
    let e = t.to_tensor::<2>().unwrap_err();
    assert!(matches!(
        burn_error(&e),
        Some(BurnError::Rank {
            expected: 2,
            got: 3
        })
    ));
}

#[test]
fn wrapped_modules_gradients_equal_burns_backward_of_the_whole_model() {
    let (x, g) = (data(10, 5, 3), data(10, 3, 4));
    // burn alone: the whole model, the input requiring a gradient, backward of sum(y · g).
    let reference = modules();
    let xr = x.clone().require_grad();
    let y = whole(&reference, xr.clone());
    let grads = (y.clone() * g.clone()).sum().backward();
    let dx = BurnTensor::from_tensor(BTensor::<Ad, 2>::from_inner(xr.grad(&grads).unwrap()));
    let dparams: Vec<Vec<f32>> = reference
        .iter()
        .flat_map(|m| {
            [
                m.w.val().grad(&grads).unwrap().into_data(),
                m.b.val().grad(&grads).unwrap().into_data(),
            ]
        })
        .map(|d| d.to_vec::<f32>().unwrap())
        .collect();
    let y = BurnTensor::from_tensor(y.detach());

    for checkpoint in [
        Checkpoint::Never,
        Checkpoint::ExceptLast,
        Checkpoint::Always,
    ] {
        for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let case = format!("{checkpoint}, {schedule:?}");
            let mut pipe = Pipe::builder(stages(modules()), &[2, 1])
                .chunks(3)
                .checkpoint(checkpoint)
                .schedule(schedule)
                .build()
                .unwrap();
            let out = pipe
                .forward(Batch::single(BurnTensor::from_tensor(x.clone())))
                .unwrap()
                .into_single()
                .unwrap();
            assert!(
                rel_diff(&values(&out), &values(&y)) <= 1e-6,
                "{case}: output"
            );
            let dx_pipe = pipe
                .backward(Batch::single(BurnTensor::from_tensor(g.clone())))
                .unwrap()
                .into_single()
                .unwrap();
            let d = rel_diff(&values(&dx_pipe), &values(&dx));
            assert!(d <= 1e-6, "{case}: input gradient differs by {d}");
            let dparams_pipe: Vec<Vec<f32>> = pipe
                .partitions()
                .iter()
                .flatten()
                .flat_map(|l| l.parameters().into_iter().map(|p| values(p.grad)))
                .collect();
            assert_eq!(dparams_pipe.len(), dparams.len());
            for (i, (a, b)) in dparams_pipe.iter().zip(&dparams).enumerate() {
                let d = rel_diff(a, b);
                assert!(d <= 1e-6, "{case}: parameter {i} differs by {d}");
            }
        }
    }
}

#[test]
fn a_layer_alone_matches_burn_and_accumulates_until_zero_grad() {
    let (x, g) = (data(4, 5, 5), data(4, 8, 6));
    let m = Linear::<Ad>::new(5, 8, 7);
    let xr = x.clone().require_grad();
    let grads = (m.forward(xr.clone()).tanh() * g.clone()).sum().backward();
    let want_dx: Vec<f32> = xr.grad(&grads).unwrap().into_data().to_vec().unwrap();
    let once: Vec<Vec<f32>> = [
        m.w.val().grad(&grads).unwrap().into_data(),
        m.b.val().grad(&grads).unwrap().into_data(),
    ]
    .into_iter()
    .map(|d| d.to_vec().unwrap())
    .collect();

    let mut layer = BurnLayer::new(m, |m: &Linear<Ad>, x| m.forward(x).tanh());
    let mut ctx = Context::new(true, 0, 0, 4);
    for round in 1..=2 {
        let input = Batch::single(BurnTensor::from_tensor(x.clone()));
        let (_, saved) = layer.forward(input, &mut ctx).unwrap();
        let dx = layer
            .backward(
                Batch::single(BurnTensor::from_tensor(g.clone())),
                saved,
                &mut ctx,
            )
            .unwrap();
        assert_eq!(values(&dx.into_single().unwrap()), want_dx);
        for (acc, once) in layer.grads().iter().zip(&once) {
            let want: Vec<f32> = once.iter().map(|v| v * round as f32).collect();
            assert_eq!(values(acc), want, "round {round}: gradients accumulate");
        }
    }
    layer.zero_grad();
    assert!(layer
        .grads()
        .iter()
        .all(|g| values(g).iter().all(|v| *v == 0.0)));

    // A gradient whose shape differs from the output's is an error, as is a missing state.
    let input = Batch::single(BurnTensor::from_tensor(x.clone()));
    let (_, saved) = layer.forward(input, &mut ctx).unwrap();
    let bad = Batch::single(BurnTensor::from_tensor(data(4, 3, 0)));
    assert!(matches!(
        layer.backward(bad, saved, &mut ctx),
        Err(Error::Shape { .. })
    ));
    let dy = Batch::single(BurnTensor::from_tensor(g.clone()));
    assert!(matches!(
        layer.backward(dy, pipe::Saved::none(), &mut ctx),
        Err(Error::Arity { .. })
    ));
    // An input of another rank is a typed error.
    let x3 = BTensor::<Ad, 3>::zeros([4, 5, 1], &Default::default());
    let e = layer
        .forward(Batch::single(BurnTensor::from_tensor(x3)), &mut ctx)
        .unwrap_err();
    assert!(matches!(
        burn_error(&e),
        Some(BurnError::Rank {
            expected: 2,
            got: 3
        })
    ));
    // A checkpointed first forward keeps nothing.
    let mut ckpt = Context::new(true, 0, 0, 4).with_checkpointing(true);
    let input = Batch::single(BurnTensor::from_tensor(x));
    let (_, saved) = layer.forward(input, &mut ckpt).unwrap();
    assert_eq!(saved.size_bytes(), 0);
}

#[test]
fn a_value_assigned_through_parameters_mut_reaches_the_module_under_the_same_id() {
    let m = Linear::<Ad>::new(3, 2, 1);
    let ids = (m.w.id, m.b.id);
    let before: Vec<f32> = m.b.val().into_data().to_vec().unwrap();
    let mut layer = BurnLayer::new(m, |m: &Linear<Ad>, x| m.forward(x));
    for p in layer.parameters_mut() {
        let t = p
            .value
            .to_vec_f32()
            .iter()
            .map(|v| v + 1.0)
            .collect::<Vec<f32>>();
        let dims = p.value.dims();
        *p.value = if dims.len() == 2 {
            BurnTensor::from_tensor(BTensor::<Ad, 2>::from_data(
                TensorData::new(t, [dims[0], dims[1]]),
                &Default::default(),
            ))
        } else {
            BurnTensor::from_tensor(BTensor::<Ad, 1>::from_data(
                TensorData::new(t, [dims[0]]),
                &Default::default(),
            ))
        };
    }
    // Written into the module by the next forward, under the same ids, requiring grads.
    let input = Batch::single(BurnTensor::from_tensor(data(2, 3, 0)));
    let (y, _) = layer
        .forward(input, &mut Context::new(true, 0, 0, 2))
        .unwrap();
    let m = layer.module().unwrap();
    assert_eq!((m.w.id, m.b.id), ids);
    assert!(m.b.val().is_require_grad());
    let after: Vec<f32> = m.b.val().into_data().to_vec().unwrap();
    assert_eq!(after, before.iter().map(|v| v + 1.0).collect::<Vec<_>>());
    let want = m
        .forward(data(2, 3, 0))
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(values(&y.into_single().unwrap()), want);
    // A value of another shape is refused, and nothing is written.
    for p in layer.parameters_mut() {
        *p.value = BurnTensor::from_tensor(data(1, 1, 0));
    }
    let input = Batch::single(BurnTensor::from_tensor(data(2, 3, 0)));
    assert!(matches!(
        layer.forward(input, &mut Context::new(true, 0, 0, 2)),
        Err(Error::Shape { .. })
    ));
}

/// Dropout with p = 1/2 from burn's backend generator: `x · mask · 2`.
fn dropout(_: &Linear<Ad>, x: BTensor<Ad, 2>) -> BTensor<Ad, 2> {
    let mask = x.random_like(Distribution::Bernoulli(0.5));
    (x * mask).mul_scalar(2.0)
}

type DropoutFn = fn(&Linear<Ad>, BTensor<Ad, 2>) -> BTensor<Ad, 2>;

fn dropout_pipe(
    layer: BurnLayer<Ad, Linear<Ad>, DropoutFn, 2, 2>,
    checkpoint: Checkpoint,
) -> Pipe<T> {
    let identity = Linear::<Ad>::new(16, 16, 0);
    let stages: Vec<Box<dyn Layer<T>>> = vec![
        Box::new(BurnLayer::new(identity, |m: &Linear<Ad>, x| m.forward(x))),
        Box::new(layer),
    ];
    Pipe::builder(stages, &[1, 1])
        .chunks(2)
        .checkpoint(checkpoint)
        .build()
        .unwrap()
}

#[test]
fn random_modules_are_refused_under_checkpointing_and_exact_without() {
    let f: DropoutFn = dropout;
    let ones = || BurnTensor::from_tensor(BTensor::<Ad, 2>::ones([8, 16], &Default::default()));
    let unused = || Linear::<Ad>::new(1, 1, 0);

    // Undeclared: the recompute draws another mask, and the layer says so.
    let mut pipe = dropout_pipe(BurnLayer::new(unused(), f), Checkpoint::Always);
    pipe.forward(Batch::single(ones())).unwrap();
    let e = pipe.backward(Batch::single(ones())).unwrap_err();
    assert!(
        matches!(burn_error(&e), Some(BurnError::NotReproducible { .. })),
        "{e}"
    );

    // Declared random: refused at the first checkpointed forward.
    let layer = BurnLayer::new(unused(), f).random().named("dropout");
    let mut pipe = dropout_pipe(layer, Checkpoint::ExceptLast);
    let e = pipe.forward(Batch::single(ones())).unwrap_err();
    assert!(
        matches!(burn_error(&e), Some(BurnError::RandomUnderCheckpoint { name }) if name == "dropout"),
        "{e}"
    );

    // checkpoint = never: backward uses the forward's own mask. With input and output
    // gradient all ones, the input gradient of `x · mask · 2` equals the output.
    let layer = BurnLayer::new(unused(), f).random();
    let mut pipe = Pipe::builder(vec![Box::new(layer) as Box<dyn Layer<T>>], &[1])
        .chunks(2)
        .checkpoint(Checkpoint::Never)
        .build()
        .unwrap();
    let y = pipe
        .forward(Batch::single(ones()))
        .unwrap()
        .into_single()
        .unwrap();
    let dx = pipe
        .backward(Batch::single(ones()))
        .unwrap()
        .into_single()
        .unwrap();
    assert_eq!(values(&dx), values(&y));
    let kept = values(&y).iter().filter(|v| **v == 2.0).count();
    assert!(
        kept > 0 && kept < 8 * 16,
        "a mask was drawn ({kept} of 128 kept)"
    );
}

/// SGD steps of the pipe on a fixed batch, starting from `start` (or the fresh model).
fn train(steps: usize, start: Option<Vec<T>>) -> Vec<T> {
    let mut pipe = Pipe::builder(stages(modules()), &[2, 1])
        .chunks(4)
        .checkpoint(Checkpoint::ExceptLast)
        .schedule(ScheduleKind::OneFOneB)
        .build()
        .unwrap();
    if let Some(start) = start {
        let mut start = start.into_iter();
        for layer in pipe.partitions_mut().iter_mut().flatten() {
            for p in layer.parameters_mut() {
                *p.value = start.next().unwrap();
            }
        }
    }
    let (x, target) = (data(8, 5, 1), data(8, 3, 2));
    for _ in 0..steps {
        pipe.step(
            Batch::single(BurnTensor::from_tensor(x.clone())),
            |mb, out| {
                let out = out.tensor(0)?.to_tensor::<2>()?;
                let rows = target.clone().narrow(0, mb.offset, mb.len);
                let diff = out - rows;
                let loss = diff.clone().powi_scalar(2).sum().into_scalar() * 0.5 / 8.0;
                Ok((
                    loss,
                    Batch::single(BurnTensor::from_tensor(diff.div_scalar(8.0))),
                ))
            },
        )
        .unwrap();
        for layer in pipe.partitions_mut().iter_mut().flatten() {
            for p in layer.parameters_mut() {
                let mut step = p.grad.clone();
                let scaled: Vec<f32> = step.to_vec_f32().iter().map(|g| -0.1 * g).collect();
                step = with_values(&step, scaled);
                p.value.accumulate(&step).unwrap();
            }
        }
        pipe.zero_grad();
    }
    pipe.partitions()
        .iter()
        .flatten()
        .flat_map(|l| l.parameters().into_iter().map(|p| p.value.clone()))
        .collect()
}

/// A tensor of `like`'s shape (rank 1 or 2) holding `v`.
fn with_values(like: &T, v: Vec<f32>) -> T {
    let d = like.dims();
    let device = Default::default();
    if d.len() == 2 {
        BurnTensor::from_tensor(BTensor::<Ad, 2>::from_data(
            TensorData::new(v, [d[0], d[1]]),
            &device,
        ))
    } else {
        BurnTensor::from_tensor(BTensor::<Ad, 1>::from_data(
            TensorData::new(v, [d[0]]),
            &device,
        ))
    }
}

#[test]
fn a_run_saved_and_resumed_equals_the_straight_run_bit_for_bit() {
    let straight = train(6, None);
    // Save after 3 steps as plain data (what a checkpoint on disk holds), resume.
    let saved: Vec<(Vec<usize>, Vec<f32>)> = train(3, None)
        .iter()
        .map(|t| (t.dims(), t.to_vec_f32()))
        .collect();
    let restored: Vec<T> = saved
        .into_iter()
        .map(|(dims, v)| {
            let device = Default::default();
            if dims.len() == 2 {
                BurnTensor::from_tensor(BTensor::<Ad, 2>::from_data(
                    TensorData::new(v, [dims[0], dims[1]]),
                    &device,
                ))
            } else {
                BurnTensor::from_tensor(BTensor::<Ad, 1>::from_data(
                    TensorData::new(v, [dims[0]]),
                    &device,
                ))
            }
        })
        .collect();
    let resumed = train(3, Some(restored));
    assert_eq!(straight.len(), resumed.len());
    for (i, (a, b)) in straight.iter().zip(&resumed).enumerate() {
        assert_eq!(values(a), values(b), "parameter {i}");
    }
    // Training moved the parameters (the comparison is not of untouched weights).
    let fresh = train(0, None);
    assert_ne!(values(&fresh[0]), values(&straight[0]));
}
