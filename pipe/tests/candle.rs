//! The candle embedding (feature `candle`): the tensor trait on `candle_core::Tensor`, and
//! `CandleLayer` stages checked against candle's own backward of the whole model.

use candle_core::{DType, Device as CandleDevice, Module, Tensor as CTensor, Var};
use pipe::candle::{CandleError, CandleLayer};
use pipe::{Batch, Checkpoint, Context, Device, Error, Layer, Pipe, ScheduleKind, Tensor};

/// `y = x wᵀ + b`, optionally followed by tanh: a candle module built from candle-core alone.
struct Linear {
    w: Var,
    b: Var,
    tanh: bool,
}

impl Linear {
    /// Deterministic weights (candle's CPU generator cannot be seeded).
    fn new(inputs: usize, outputs: usize, salt: usize, tanh: bool) -> Linear {
        let w: Vec<f32> = (0..inputs * outputs)
            .map(|k| (((k * 37 + salt * 11) % 23) as f32 / 23.0 - 0.5) / (inputs as f32).sqrt())
            .collect();
        let b: Vec<f32> = (0..outputs)
            .map(|k| ((k * 5 + salt) % 7) as f32 / 70.0)
            .collect();
        Linear {
            w: Var::from_vec(w, (outputs, inputs), &CandleDevice::Cpu).unwrap(),
            b: Var::from_vec(b, outputs, &CandleDevice::Cpu).unwrap(),
            tanh,
        }
    }

    fn vars(&self) -> Vec<Var> {
        vec![self.w.clone(), self.b.clone()]
    }
}

impl Module for Linear {
    fn forward(&self, x: &CTensor) -> candle_core::Result<CTensor> {
        let y = x.matmul(&self.w.t()?)?.broadcast_add(&self.b)?;
        if self.tanh {
            y.tanh()
        } else {
            Ok(y)
        }
    }
}

fn data(rows: usize, cols: usize, salt: usize) -> CTensor {
    let v: Vec<f32> = (0..rows * cols)
        .map(|k| ((k * 13 + salt * 7) % 17) as f32 / 8.5 - 1.0)
        .collect();
    CTensor::from_vec(v, (rows, cols), &CandleDevice::Cpu).unwrap()
}

fn values(t: &CTensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `max |a - b| / max |b|`.
fn rel_diff(a: &CTensor, b: &CTensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (values(a), values(b));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / b.iter().fold(f32::MIN_POSITIVE, |m, y| m.max(y.abs()))
}

fn candle_error(e: &Error) -> Option<&CandleError> {
    match e {
        Error::Failed { source, .. } => candle_error(source),
        Error::Custom(inner) => inner.downcast_ref::<CandleError>(),
        _ => None,
    }
}

#[test]
fn split_and_concat_round_trip_on_candle_tensors() {
    let t = data(5, 3, 1);
    let parts = Tensor::split(&t, &[2, 2, 1]).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.dims().to_vec()).collect::<Vec<_>>(),
        vec![vec![2, 3], vec![2, 3], vec![1, 3]]
    );
    assert_eq!(values(&parts[2]), values(&t)[12..15]);
    // Each part owns its storage: the bytes counted are the bytes held.
    assert_eq!(
        parts.iter().map(Tensor::size_bytes).sum::<usize>(),
        t.size_bytes()
    );
    assert_eq!(t.size_bytes(), 5 * 3 * 4);
    assert_eq!(t.to_dtype(DType::F64).unwrap().size_bytes(), 5 * 3 * 8);
    let back = <CTensor as Tensor>::concat(parts).unwrap();
    assert_eq!(back.dims(), t.dims());
    assert_eq!(values(&back), values(&t));
    assert_eq!(Tensor::batch_len(&t), 5);

    // A 3-d tensor too.
    let t3 = data(4, 6, 2).reshape((4, 2, 3)).unwrap();
    let parts = Tensor::split(&t3, &[3, 1]).unwrap();
    assert_eq!(
        values(&<CTensor as Tensor>::concat(parts).unwrap()),
        values(&t3)
    );

    assert!(matches!(
        Tensor::split(&t, &[2, 2]),
        Err(Error::SplitSizes { len: 5, .. })
    ));
    assert!(matches!(
        Tensor::split(&CTensor::new(1f32, &CandleDevice::Cpu).unwrap(), &[1]),
        Err(Error::SplitSizes { .. })
    ));
    assert!(matches!(
        <CTensor as Tensor>::concat(vec![t.clone(), data(1, 4, 0)]),
        Err(Error::Shape { op: "concat", .. })
    ));
    assert!(matches!(
        <CTensor as Tensor>::concat(vec![]),
        Err(Error::NothingToConcat)
    ));
}

#[test]
fn accumulate_and_devices() {
    let mut a = data(2, 3, 1);
    let b = data(2, 3, 2);
    let sum: Vec<f32> = values(&a)
        .iter()
        .zip(values(&b))
        .map(|(x, y)| x + y)
        .collect();
    a.accumulate(&b).unwrap();
    assert_eq!(values(&a), sum);
    assert!(matches!(
        a.accumulate(&data(3, 2, 0)),
        Err(Error::Shape {
            op: "accumulate",
            ..
        })
    ));
    // A dtype mismatch is candle's error, typed.
    let e = a.accumulate(&b.to_dtype(DType::F64).unwrap()).unwrap_err();
    assert!(
        matches!(candle_error(&e), Some(CandleError::Candle(_))),
        "{e}"
    );

    let on_core = Tensor::to_device(a.clone(), &Device::CpuCore(1)).unwrap();
    assert_eq!(on_core.id(), a.id(), "no copy when the device matches");
    assert!(matches!(
        Tensor::to_device(a, &Device::Cuda(0)),
        Err(Error::Device {
            device: Device::Cuda(0),
            ..
        })
    ));
}

/// The model as candle modules: two tanh layers and a linear one.
fn modules() -> Vec<Linear> {
    vec![
        Linear::new(5, 8, 1, true),
        Linear::new(8, 8, 2, true),
        Linear::new(8, 3, 3, false),
    ]
}

fn stages(modules: Vec<Linear>) -> Vec<Box<dyn Layer<CTensor>>> {
    modules
        .into_iter()
        .map(|m| {
            let vars = m.vars();
            Box::new(CandleLayer::new(m, vars).unwrap()) as Box<dyn Layer<CTensor>>
        })
        .collect()
}

#[test]
fn wrapped_modules_gradients_equal_candles_backward_of_the_whole_model() {
    let (x, g) = (data(10, 5, 3), data(10, 3, 4));

    // candle alone: the whole model, the input a Var, backward of sum(y · g).
    let reference = modules();
    let xv = Var::from_tensor(&x).unwrap();
    let mut y = xv.as_tensor().clone();
    for m in &reference {
        y = m.forward(&y).unwrap();
    }
    let grads = y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = grads.get(&xv).unwrap().clone();
    let dparams: Vec<CTensor> = reference
        .iter()
        .flat_map(|m| m.vars())
        .map(|v| grads.get(&v).unwrap().clone())
        .collect();

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
                .forward(Batch::single(x.clone()))
                .unwrap()
                .into_single()
                .unwrap();
            assert!(rel_diff(&out, &y) <= 1e-6, "{case}: output");
            let dx_pipe = pipe
                .backward(Batch::single(g.clone()))
                .unwrap()
                .into_single()
                .unwrap();
            assert!(rel_diff(&dx_pipe, &dx) <= 1e-6, "{case}: input gradient");
            let dparams_pipe: Vec<CTensor> = pipe
                .partitions()
                .iter()
                .flatten()
                .flat_map(|l| l.parameters().into_iter().map(|p| p.grad.clone()))
                .collect();
            assert_eq!(dparams_pipe.len(), dparams.len());
            for (i, (a, b)) in dparams_pipe.iter().zip(&dparams).enumerate() {
                let d = rel_diff(a, b);
                assert!(d <= 1e-5, "{case}: parameter {i} differs by {d}");
            }
        }
    }
}

#[test]
fn a_layer_alone_matches_candle_and_accumulates_until_zero_grad() {
    let (x, g) = (data(4, 5, 5), data(4, 8, 6));
    let m = Linear::new(5, 8, 7, true);
    let vars = m.vars();
    let xv = Var::from_tensor(&x).unwrap();
    let grads = m
        .forward(&xv)
        .unwrap()
        .mul(&g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    let mut layer = CandleLayer::new(m, vars.clone()).unwrap();
    let mut ctx = Context::new(true, 0, 0, 4);
    for round in 1..=2 {
        let (_, saved) = layer.forward(Batch::single(x.clone()), &mut ctx).unwrap();
        let dx = layer
            .backward(Batch::single(g.clone()), saved, &mut ctx)
            .unwrap();
        assert_eq!(
            values(&dx.into_single().unwrap()),
            values(grads.get(&xv).unwrap())
        );
        for (acc, var) in layer.grads().iter().zip(&vars) {
            let once = values(grads.get(var).unwrap());
            let want: Vec<f32> = once.iter().map(|v| v * round as f32).collect();
            assert_eq!(values(acc), want, "round {round}: gradients accumulate");
        }
    }
    layer.zero_grad();
    assert!(layer
        .grads()
        .iter()
        .all(|g| values(g).iter().all(|v| *v == 0.0)));

    // A gradient whose shape differs from the output's is an error.
    let (_, saved) = layer.forward(Batch::single(x.clone()), &mut ctx).unwrap();
    assert!(matches!(
        layer.backward(Batch::single(data(4, 3, 0)), saved, &mut ctx),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn saved_state_counts_the_graph_once_and_not_the_parameters() {
    // relu(x wᵀ + b): the graph holds the input, the product, the sum and the output;
    // the transposed weight and the broadcast bias are views of parameters.
    let (n, d, h) = (6, 5, 7);
    let lin = Linear::new(d, h, 1, false);
    let vars = lin.vars();
    let module = move |x: &CTensor| lin.forward(x)?.relu();
    let mut layer = CandleLayer::new(module, vars).unwrap();
    let (_, saved) = layer
        .forward(
            Batch::single(data(n, d, 2)),
            &mut Context::new(true, 0, 0, n),
        )
        .unwrap();
    assert_eq!(saved.size_bytes(), 4 * (n * d + 3 * n * h));

    // A checkpointed first forward keeps nothing.
    let mut ctx = Context::new(true, 0, 0, n).with_checkpointing(true);
    let (_, saved) = layer
        .forward(Batch::single(data(n, d, 2)), &mut ctx)
        .unwrap();
    assert_eq!(saved.size_bytes(), 0);
}

#[test]
fn a_value_assigned_through_parameters_mut_reaches_the_var() {
    let m = Linear::new(3, 2, 1, false);
    let vars = m.vars();
    let mut layer = CandleLayer::new(m, vars.clone()).unwrap();
    let before = values(&vars[1]);
    for p in layer.parameters_mut() {
        *p.value = p.value.affine(1.0, 1.0).unwrap();
    }
    // Written into the var by the next forward.
    layer
        .forward(
            Batch::single(data(2, 3, 0)),
            &mut Context::new(true, 0, 0, 2),
        )
        .unwrap();
    let after = values(&vars[1]);
    assert_eq!(after, before.iter().map(|v| v + 1.0).collect::<Vec<_>>());
    assert_eq!(values(layer.parameters()[1].value), after);
}

/// Dropout with p = 1/2 from candle's unseedable CPU generator: `x · mask · 2`.
fn dropout(x: &CTensor) -> candle_core::Result<CTensor> {
    let keep = x.rand_like(0.0, 1.0)?.ge(0.5)?.to_dtype(x.dtype())?;
    x.mul(&keep)?.affine(2.0, 0.0)
}

fn dropout_pipe(
    layer: CandleLayer<fn(&CTensor) -> candle_core::Result<CTensor>>,
    checkpoint: Checkpoint,
) -> Pipe<CTensor> {
    let identity = Linear::new(16, 16, 0, false);
    let vars = identity.vars();
    let stages: Vec<Box<dyn Layer<CTensor>>> = vec![
        Box::new(CandleLayer::new(identity, vars).unwrap()),
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
    let f: fn(&CTensor) -> candle_core::Result<CTensor> = dropout;
    let x = CTensor::ones((8, 16), DType::F32, &CandleDevice::Cpu).unwrap();

    // Undeclared: the recompute draws another mask, and the layer says so.
    let mut pipe = dropout_pipe(CandleLayer::new(f, vec![]).unwrap(), Checkpoint::Always);
    let y = pipe
        .forward(Batch::single(x.clone()))
        .unwrap()
        .into_single()
        .unwrap();
    let e = pipe
        .backward(Batch::single(y.ones_like().unwrap()))
        .unwrap_err();
    assert!(
        matches!(candle_error(&e), Some(CandleError::NotReproducible { .. })),
        "{e}"
    );

    // Declared random: refused at the first checkpointed forward.
    let layer = CandleLayer::new(f, vec![])
        .unwrap()
        .random()
        .named("dropout");
    let mut pipe = dropout_pipe(layer, Checkpoint::ExceptLast);
    let e = pipe.forward(Batch::single(x.clone())).unwrap_err();
    assert!(
        matches!(candle_error(&e), Some(CandleError::RandomUnderCheckpoint { name }) if name == "dropout"),
        "{e}"
    );

    // checkpoint = never: backward uses the forward's own mask. With input and output
    // gradient all ones, the input gradient of `x · mask · 2` equals the output.
    let layer = CandleLayer::new(f, vec![]).unwrap().random();
    let mut pipe = Pipe::builder(vec![Box::new(layer) as Box<dyn Layer<CTensor>>], &[1])
        .chunks(2)
        .checkpoint(Checkpoint::Never)
        .build()
        .unwrap();
    let y = pipe
        .forward(Batch::single(x.clone()))
        .unwrap()
        .into_single()
        .unwrap();
    let dx = pipe
        .backward(Batch::single(y.ones_like().unwrap()))
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

#[test]
fn wire_round_trips_every_dtype() {
    use pipe::{Wire, WireMeta};
    let x = CTensor::from_vec(
        (0..24).map(|v| v as f32 - 7.0).collect::<Vec<f32>>(),
        (2, 3, 4),
        &CandleDevice::Cpu,
    )
    .unwrap();
    let as_f64 = |t: &CTensor| {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
    };
    let mut codes = Vec::new();
    for dtype in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::U8,
        DType::U32,
        DType::I64,
    ] {
        // Unsigned types get non-negative values.
        let src = if matches!(dtype, DType::U8 | DType::U32) {
            x.abs().unwrap()
        } else {
            x.clone()
        };
        let t = src.to_dtype(dtype).unwrap();
        // A transposed (non-contiguous) view travels in row-major order too.
        for t in [t.clone(), t.transpose(1, 2).unwrap()] {
            let mut frame = vec![0xAB];
            let meta = t.write_wire(&mut frame).unwrap();
            assert_eq!(meta.shape, t.dims());
            assert_eq!(frame.len(), 1 + t.elem_count() * dtype.size_in_bytes());
            let back = CTensor::read_wire(&meta, &frame[1..], &Device::CpuCore(0)).unwrap();
            assert_eq!(back.dtype(), dtype);
            assert_eq!(back.dims(), t.dims());
            assert_eq!(as_f64(&back), as_f64(&t), "{dtype:?}");
            codes.push(meta.dtype);
        }
    }
    codes.dedup();
    assert_eq!(codes, vec![0, 1, 2, 3, 4, 5, 6]);

    // Little-endian bytes on the wire.
    let one = CTensor::from_vec(vec![1u32, 258], 2, &CandleDevice::Cpu).unwrap();
    let mut frame = Vec::new();
    one.write_wire(&mut frame).unwrap();
    assert_eq!(frame, [1, 0, 0, 0, 2, 1, 0, 0]);

    // Errors, not panics.
    let meta = WireMeta {
        dtype: 0,
        shape: vec![2, 2],
    };
    assert!(matches!(
        CTensor::read_wire(&meta, &[0; 15], &Device::Cpu),
        Err(Error::Shape { .. })
    ));
    let huge = WireMeta {
        dtype: 1,
        shape: vec![usize::MAX, 2],
    };
    assert!(matches!(
        CTensor::read_wire(&huge, &[0; 16], &Device::Cpu),
        Err(Error::Shape { .. })
    ));
    let unknown = WireMeta {
        dtype: 99,
        shape: vec![1],
    };
    assert!(matches!(
        CTensor::read_wire(&unknown, &[0; 4], &Device::Cpu),
        Err(Error::WireType { dtype: 99, .. })
    ));
    assert!(matches!(
        CTensor::read_wire(&meta, &[0; 16], &Device::Cuda(0)),
        Err(Error::Device { .. })
    ));
    let back = CTensor::read_wire(&meta, &[0; 16], &Device::Cpu).unwrap();
    assert_eq!(back.dims(), [2, 2]);
    let i32s = x.to_dtype(DType::I32).unwrap();
    assert!(i32s.write_wire(&mut Vec::new()).is_err());
}
