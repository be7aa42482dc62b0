//! The test layers' backward passes against finite differences, and their contracts
//! (dropout's mask replay, batch norm's running statistics).

mod common;

use common::*;
use pipe::cpu::{BatchNorm, CpuTensor, Dropout, Linear, ReLU};
use pipe::{Batch, Context, Error, Layer, MicroBatch, Phase, Tensor};

/// `L = sum(w ⊙ layer(x))` for fixed weights `w`: its gradient is `backward(w)`.
fn loss(layer: &mut dyn Layer<CpuTensor>, x: &CpuTensor, w: &CpuTensor, ctx: &Context) -> f64 {
    let mut c = ctx.clone();
    let y = layer
        .forward(Batch::single(x.clone()), &mut c)
        .unwrap()
        .0
        .into_single()
        .unwrap();
    y.array()
        .iter()
        .zip(w.array())
        .map(|(a, b)| f64::from(a * b))
        .sum()
}

/// Checks the input gradient and every parameter gradient by central differences.
fn check(layer: &mut dyn Layer<CpuTensor>, x: CpuTensor, ctx: Context) {
    let y = layer
        .forward(Batch::single(x.clone()), &mut ctx.clone())
        .unwrap()
        .0
        .into_single()
        .unwrap();
    let w = data(y.shape()[0], y.array().len() / y.shape()[0], 99);
    let w = CpuTensor::from_shape_vec(y.shape(), w.to_vec()).unwrap();
    layer.zero_grad();
    let (_, saved) = layer
        .forward(Batch::single(x.clone()), &mut ctx.clone())
        .unwrap();
    let backward_ctx = ctx.clone().with_phase(Phase::Backward);
    let dx = layer
        .backward(Batch::single(w.clone()), saved, &mut backward_ctx.clone())
        .unwrap()
        .into_single()
        .unwrap();
    let h = 1e-2f32;
    let tolerance = |analytic: f32, numeric: f64| {
        (f64::from(analytic) - numeric).abs() <= 2e-3 * (1.0 + numeric.abs())
    };
    for k in 0..x.array().len() {
        let mut plus = x.clone();
        plus.array_mut().as_slice_mut().unwrap()[k] += h;
        let mut minus = x.clone();
        minus.array_mut().as_slice_mut().unwrap()[k] -= h;
        let numeric =
            (loss(layer, &plus, &w, &ctx) - loss(layer, &minus, &w, &ctx)) / f64::from(2.0 * h);
        let analytic = dx.array().as_slice().unwrap()[k];
        assert!(
            tolerance(analytic, numeric),
            "{}: input {k}: {analytic} vs {numeric}",
            layer.name()
        );
    }
    let analytic: Vec<Vec<f32>> = layer.parameters().iter().map(|p| p.grad.to_vec()).collect();
    for (p, grads) in analytic.iter().enumerate() {
        for (k, &g) in grads.iter().enumerate() {
            let nudge = |layer: &mut dyn Layer<CpuTensor>, delta: f32| {
                layer.parameters_mut()[p]
                    .value
                    .array_mut()
                    .as_slice_mut()
                    .unwrap()[k] += delta;
            };
            nudge(layer, h);
            let up = loss(layer, &x, &w, &ctx);
            nudge(layer, -2.0 * h);
            let down = loss(layer, &x, &w, &ctx);
            nudge(layer, h);
            let numeric = (up - down) / f64::from(2.0 * h);
            assert!(
                tolerance(g, numeric),
                "{}: parameter {p}[{k}]: {g} vs {numeric}",
                layer.name()
            );
        }
    }
}

fn ctx(rows: usize) -> Context {
    // Recompute phase: batch norm leaves its running statistics alone while probed.
    Context::new(true, 5, 3, rows)
        .with_layer(2)
        .with_phase(Phase::Recompute)
}

#[test]
fn linear_gradients() {
    check(&mut Linear::new(4, 3, 1), data(5, 4, 1), ctx(5));
}

/// A row's output and input gradient do not depend on the rows beside it: a 600-row
/// batch (past the row count where `Linear` switches the form of its products) gives
/// what its 100-row chunks give, bit for bit where the AVX-512 kernel runs, and the
/// weight gradients agree. This is what lets a pipeline's micro-batches reproduce the
/// whole batch.
#[test]
fn linear_rows_do_not_depend_on_the_batch() {
    let (rows, chunk) = (600, 100);
    let (x, dy) = (data(rows, 70, 3), data(rows, 50, 4));
    let mut whole = Linear::new(70, 50, 7);
    let (y, saved) = whole
        .forward(Batch::single(x.clone()), &mut ctx(rows))
        .unwrap();
    let dx = whole
        .backward(Batch::single(dy.clone()), saved, &mut ctx(rows))
        .unwrap()
        .into_single()
        .unwrap();
    let mut parts = Linear::new(70, 50, 7);
    let (mut ys, mut dxs) = (Vec::new(), Vec::new());
    let sizes = [chunk; 6];
    let (xs, dys) = (x.split(&sizes).unwrap(), dy.split(&sizes).unwrap());
    for (x, dy) in xs.into_iter().zip(dys) {
        let (y, saved) = parts.forward(Batch::single(x), &mut ctx(chunk)).unwrap();
        ys.push(y.into_single().unwrap());
        let dx = parts
            .backward(Batch::single(dy), saved, &mut ctx(chunk))
            .unwrap();
        dxs.push(dx.into_single().unwrap());
    }
    let (y, ys, dxs) = (y.into_single().unwrap(), cat(&ys), cat(&dxs));
    let exact = cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("avx512f");
    if exact {
        assert_eq!(y.array(), ys.array(), "forward");
        assert_eq!(dx.array(), dxs.array(), "input gradient");
    } else {
        assert!(relative(&ys, &y) <= 1e-6, "forward");
        assert!(relative(&dxs, &dx) <= 1e-6, "input gradient");
    }
    for (a, b) in whole.parameters().iter().zip(parts.parameters()) {
        let (a, b) = (a.grad, b.grad);
        assert!(relative(b, a) <= 1e-5, "parameter gradient");
    }
}

#[test]
fn relu_gradients() {
    // Keep inputs away from the kink at 0.
    let x = CpuTensor::new(
        data(4, 6, 2)
            .array()
            .mapv(|v| if v.abs() < 0.1 { v + 0.3 } else { v }),
    );
    check(&mut ReLU, x, ctx(4));
}

#[test]
fn dropout_gradients_replay_the_mask() {
    check(&mut Dropout::new(0.4).unwrap(), data(4, 6, 3), ctx(4));
    assert!(matches!(Dropout::new(1.0), Err(Error::Probability(_))));
    // In evaluation it is the identity.
    let x = data(2, 3, 1);
    let mut eval = Context::new(false, 5, 3, 2);
    let y = Dropout::new(0.5)
        .unwrap()
        .forward(Batch::single(x.clone()), &mut eval)
        .unwrap()
        .0;
    assert_eq!(y, Batch::single(x));
}

#[test]
fn batch_norm_gradients_on_2d_and_3d_inputs() {
    let mut bn = BatchNorm::new(3);
    for p in bn.parameters_mut() {
        // A scale and shift other than 1 and 0.
        let n = p.value.array().len();
        *p.value.array_mut() += &CpuTensor::from_shape_vec(&[n], vec![0.5; n])
            .unwrap()
            .into_array();
    }
    check(&mut bn, data(6, 3, 4), ctx(6));
    let x3 = CpuTensor::from_shape_vec(&[4, 3, 2], data(4, 6, 5).to_vec()).unwrap();
    check(&mut BatchNorm::new(3), x3, ctx(4));
}

#[test]
fn batch_norm_running_statistics() {
    let mut bn = BatchNorm::with(2, 0.5, 1e-5);
    let x =
        CpuTensor::from_shape_vec(&[4, 2], vec![1.0, 0.0, 3.0, 0.0, 5.0, 2.0, 7.0, 2.0]).unwrap();
    let mb = MicroBatch {
        index: 0,
        offset: 0,
        len: 4,
    };
    let train = Context::new(true, 0, 0, 4).with_micro_batch(mb);
    bn.forward(
        Batch::single(x.clone()),
        &mut train.clone().with_phase(Phase::Recompute),
    )
    .unwrap();
    assert_eq!(
        bn.running_mean().to_vec(),
        vec![0.0, 0.0],
        "recomputation leaves them alone"
    );
    bn.forward(Batch::single(x.clone()), &mut train.clone())
        .unwrap();
    // Means 4 and 1; unbiased variances 20/3 and 4/3; momentum 0.5 from 0 and 1.
    let mean = bn.running_mean().to_vec();
    let var = bn.running_var().to_vec();
    assert!(
        (mean[0] - 2.0).abs() < 1e-6 && (mean[1] - 0.5).abs() < 1e-6,
        "{mean:?}"
    );
    assert!(
        (var[0] - (0.5 + 10.0 / 3.0)).abs() < 1e-5 && (var[1] - (0.5 + 2.0 / 3.0)).abs() < 1e-5,
        "{var:?}"
    );
    // Evaluation normalises with them and keeps nothing.
    let (y, saved) = bn
        .forward(Batch::single(x), &mut Context::new(false, 0, 0, 4))
        .unwrap();
    assert_eq!(saved.size_bytes(), 0);
    let y = y.into_single().unwrap();
    assert!((y.array()[[0, 0]] - (1.0 - 2.0) / (var[0] + 1e-5).sqrt()).abs() < 1e-5);
    assert!(matches!(
        bn.forward(Batch::single(data(2, 3, 1)), &mut train.clone()),
        Err(Error::Shape { .. })
    ));
}

#[test]
fn linear_rejects_bad_shapes() {
    let mut l = Linear::new(3, 2, 0);
    let mut c = ctx(2).with_phase(Phase::Forward);
    assert!(matches!(
        l.forward(Batch::single(data(2, 4, 1)), &mut c),
        Err(Error::Shape { .. })
    ));
    let bias = pipe::ndarray::Array2::zeros((1, 3));
    assert!(Linear::from_parts(pipe::ndarray::Array2::zeros((3, 2)), bias).is_err());
    let (_, saved) = l.forward(Batch::single(data(2, 3, 1)), &mut c).unwrap();
    let err = l
        .backward(Batch::single(data(3, 2, 1)), saved, &mut c)
        .unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    assert_eq!(data(2, 3, 1).size_bytes(), 24);
}
