//! Partitions on a GPU (feature `cuda`): the device layers against the CPU layers, two
//! partitions on two streams of one GPU bit for bit against one partition, device memory
//! by checkpoint mode, and the ordering rules under a delayed producer and a freed,
//! reused and poisoned buffer. Where no CUDA driver loads, each test prints one
//! `skipped:` line (and the missing-driver test checks the error is the clean one).
//!
//! Run with `--nocapture` for the memory figures; `cargo xtask gpu-check` bundles it.
#![cfg(feature = "cuda")]

use std::sync::{Arc, Mutex, MutexGuard};

use pipe::cpu::{self, CpuTensor};
use pipe::cuda::{BatchNorm, CudaTensor, Dropout, Gpu, GpuStream, Linear, ReLU};
use pipe::{
    Batch, Checkpoint, Context, Device, Error, Layer, MicroBatch, Phase, Pipe, Saved, ScheduleKind,
    Tensor,
};

/// The tests run one at a time: the device-wide memory figures count every stream.
static SERIAL: Mutex<()> = Mutex::new(());

/// The device (and the turn to use it), or `None` after printing why the test is skipped.
fn gpu(test: &str) -> Option<(Arc<Gpu>, MutexGuard<'static, ()>)> {
    let turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    match Gpu::new(0) {
        Ok(gpu) => Some((gpu, turn)),
        Err(Error::CudaUnavailable(why)) => {
            println!("skipped: no CUDA device ({test}: {why})");
            None
        }
        Err(e) => panic!("{test}: opening cuda:0 failed: {e}"),
    }
}

/// Deterministic data in about [-1, 1].
fn values(len: usize, salt: u64) -> Vec<f32> {
    (0..len as u64)
        .map(|i| {
            let z = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ salt.wrapping_mul(0xD1B5_4A32_D192_ED03);
            let z = (z ^ (z >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn cpu_tensor(shape: &[usize], salt: u64) -> CpuTensor {
    CpuTensor::from_shape_vec(shape, values(shape.iter().product(), salt)).unwrap()
}

/// `max |a - b| / max |b|`.
fn relative(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f32::max);
    if diff == 0.0 {
        0.0
    } else {
        diff / scale.max(f32::MIN_POSITIVE)
    }
}

fn host(t: &CudaTensor) -> Vec<f32> {
    t.to_host().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn without_a_driver_the_error_is_cuda_unavailable() {
    match Gpu::new(0) {
        // A device: an ordinal past the driver's count is the same clean error.
        Ok(_) => assert!(matches!(Gpu::new(4096), Err(Error::CudaUnavailable(_)))),
        Err(e) => assert!(matches!(e, Error::CudaUnavailable(_)), "{e}"),
    }
}

/// Forward and backward of one CPU layer and its device twin on the same input, output
/// gradient and context; returns the worst relative difference over the output, the
/// input gradient and every parameter gradient.
fn twin_difference(
    cpu: &mut dyn Layer<CpuTensor>,
    gpu: &mut dyn Layer<CudaTensor>,
    s: &Arc<GpuStream>,
    x: &CpuTensor,
    ctx: &Context,
) -> f32 {
    let (y, saved) = cpu
        .forward(Batch::single(x.clone()), &mut ctx.clone())
        .unwrap();
    let y = y.into_single().unwrap();
    let xd = CudaTensor::from_cpu(x, s).unwrap();
    let (yd, saved_d) = gpu.forward(Batch::single(xd), &mut ctx.clone()).unwrap();
    let yd = yd.into_single().unwrap();
    assert_eq!(yd.shape(), y.shape(), "{}", cpu.name());
    let mut worst = relative(&host(&yd), &y.to_vec());
    if !ctx.is_training() {
        return worst;
    }
    let dy = cpu_tensor(y.shape(), 77);
    let back = ctx.clone().with_phase(Phase::Backward);
    let dx = cpu
        .backward(Batch::single(dy.clone()), saved, &mut back.clone())
        .unwrap()
        .into_single()
        .unwrap();
    let dyd = CudaTensor::from_cpu(&dy, s).unwrap();
    let dxd = gpu
        .backward(Batch::single(dyd), saved_d, &mut back.clone())
        .unwrap()
        .into_single()
        .unwrap();
    worst = worst.max(relative(&host(&dxd), &dx.to_vec()));
    let (pc, pg) = (cpu.parameters(), gpu.parameters());
    assert_eq!(pc.len(), pg.len());
    for (a, b) in pg.iter().zip(&pc) {
        assert_eq!(a.name, b.name);
        worst = worst.max(relative(&host(a.value), &b.value.to_vec()));
        worst = worst.max(relative(&host(a.grad), &b.grad.to_vec()));
    }
    worst
}

fn context(train: bool, len: usize) -> Context {
    Context::new(train, 3, 2, len)
        .with_layer(5)
        .with_micro_batch(MicroBatch {
            index: 1,
            offset: 8,
            len,
        })
        .with_micro_batches(3)
}

#[test]
fn the_device_layers_match_the_cpu_layers() {
    let Some((gpu, _turn)) = gpu("the_device_layers_match_the_cpu_layers") else {
        return;
    };
    let s = gpu.stream().unwrap();
    let train = context(true, 16);

    let mut lc = cpu::Linear::new(24, 40, 7);
    let mut lg = Linear::from_cpu(&lc, &s).unwrap();
    let d = twin_difference(&mut lc, &mut lg, &s, &cpu_tensor(&[16, 24], 1), &train);
    assert!(d <= 1e-5, "Linear: {d}");
    // Gradients accumulate: a second backward adds to the first on both.
    let d = twin_difference(&mut lc, &mut lg, &s, &cpu_tensor(&[16, 24], 2), &train);
    assert!(d <= 1e-5, "Linear, accumulated: {d}");

    let d = twin_difference(
        &mut cpu::ReLU,
        &mut ReLU::new(&s),
        &s,
        &cpu_tensor(&[16, 40], 3),
        &train,
    );
    assert_eq!(d, 0.0, "ReLU is exact");

    // Dropout: the same mask bit for bit (the same counter-based stream), in both passes.
    let d = twin_difference(
        &mut cpu::Dropout::new(0.3).unwrap(),
        &mut Dropout::new(0.3, &s).unwrap(),
        &s,
        &cpu_tensor(&[16, 40], 4),
        &train,
    );
    assert_eq!(d, 0.0, "Dropout masks differ");

    // Batch norm on [n, c, l]: training (batch statistics, running statistics updated),
    // then evaluation on the running statistics.
    let mut bc = cpu::BatchNorm::new(6);
    let mut bg = BatchNorm::new(6, &s).unwrap();
    for salt in [5, 6] {
        let d = twin_difference(&mut bc, &mut bg, &s, &cpu_tensor(&[16, 6, 5], salt), &train);
        assert!(d <= 1e-5, "BatchNorm, training: {d}");
    }
    assert!(relative(&host(bg.running_mean()), &bc.running_mean().to_vec()) <= 1e-5);
    assert!(relative(&host(bg.running_var()), &bc.running_var().to_vec()) <= 1e-5);
    let d = twin_difference(
        &mut bc,
        &mut bg,
        &s,
        &cpu_tensor(&[16, 6, 5], 7),
        &context(false, 16),
    );
    assert!(d <= 1e-5, "BatchNorm, evaluation: {d}");

    // Deferred: the running statistics move once, over all micro-batches of the step.
    let mut bc = cpu::BatchNorm::deferred(6);
    let mut bg = BatchNorm::deferred(6, &s).unwrap();
    for (index, offset) in [(0usize, 0usize), (1, 8), (2, 16)] {
        let ctx = Context::new(true, 3, 2, 8)
            .with_micro_batch(MicroBatch {
                index,
                offset,
                len: 8,
            })
            .with_micro_batches(3);
        let d = twin_difference(
            &mut bc,
            &mut bg,
            &s,
            &cpu_tensor(&[8, 6], 10 + index as u64),
            &ctx,
        );
        assert!(d <= 1e-5, "deferred BatchNorm, micro-batch {index}: {d}");
    }
    let (mc, mg) = (bc.running_mean().to_vec(), host(bg.running_mean()));
    assert!(mc.iter().any(|&m| m != 0.0), "the statistics moved");
    assert!(relative(&mg, &mc) <= 1e-5);
    assert!(relative(&host(bg.running_var()), &bc.running_var().to_vec()) <= 1e-5);
}

/// A layer that enqueues a spin kernel on its stream before the wrapped layer's work, in
/// its forward passes (`forward`) or its backward passes: a consumer that did not wait
/// for it would read stale memory.
struct Slow {
    inner: Box<dyn Layer<CudaTensor>>,
    stream: Arc<GpuStream>,
    cycles: u64,
    forward: bool,
}

impl Layer<CudaTensor> for Slow {
    fn forward(
        &mut self,
        input: Batch<CudaTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CudaTensor>, Saved<CudaTensor>), Error> {
        if self.forward {
            self.stream.spin(self.cycles)?;
        }
        self.inner.forward(input, ctx)
    }

    fn backward(
        &mut self,
        grad_output: Batch<CudaTensor>,
        saved: Saved<CudaTensor>,
        ctx: &mut Context,
    ) -> Result<Batch<CudaTensor>, Error> {
        if !self.forward {
            self.stream.spin(self.cycles)?;
        }
        self.inner.backward(grad_output, saved, ctx)
    }

    fn parameters(&self) -> Vec<pipe::Param<'_, CudaTensor>> {
        self.inner.parameters()
    }

    fn parameters_mut(&mut self) -> Vec<pipe::ParamMut<'_, CudaTensor>> {
        self.inner.parameters_mut()
    }

    fn zero_grad(&mut self) {
        self.inner.zero_grad()
    }
}

/// Linear, ReLU, Dropout, BatchNorm (plain or deferred), Linear, ReLU, Linear: layer `i`
/// on `streams[i]`; each `(i, forward)` of `slow` makes layer `i` spin `cycles` first, in
/// its forward passes or its backward passes.
fn model(
    streams: &[Arc<GpuStream>],
    deferred: bool,
    slow: &[(usize, bool)],
    cycles: u64,
) -> Vec<Box<dyn Layer<CudaTensor>>> {
    let s = |i: usize| &streams[i];
    let bn = if deferred {
        BatchNorm::deferred(32, s(3))
    } else {
        BatchNorm::new(32, s(3))
    };
    let layers: Vec<Box<dyn Layer<CudaTensor>>> = vec![
        Box::new(Linear::new(16, 32, 1, s(0)).unwrap()),
        Box::new(ReLU::new(s(1))),
        Box::new(Dropout::new(0.25, s(2)).unwrap()),
        Box::new(bn.unwrap()),
        Box::new(Linear::new(32, 32, 2, s(4)).unwrap()),
        Box::new(ReLU::new(s(5))),
        Box::new(Linear::new(32, 8, 3, s(6)).unwrap()),
    ];
    layers
        .into_iter()
        .enumerate()
        .map(|(i, inner)| -> Box<dyn Layer<CudaTensor>> {
            if let Some(&(_, forward)) = slow.iter().find(|(at, _)| *at == i) {
                Box::new(Slow {
                    inner,
                    stream: streams[i].clone(),
                    cycles,
                    forward,
                })
            } else {
                inner
            }
        })
        .collect()
}

/// What a run produced, on the host: the output and input gradient of each of two
/// training steps, the evaluation output after them, and every parameter gradient.
#[derive(Debug, PartialEq)]
struct Run {
    steps: Vec<(Vec<u32>, Vec<u32>)>,
    eval: Vec<u32>,
    grads: Vec<Vec<u32>>,
}

fn run(mut pipe: Pipe<CudaTensor>, input: &Arc<GpuStream>) -> Run {
    let mut steps = Vec::new();
    for step in 0..2 {
        let x = CudaTensor::from_host(input, &[32, 16], &values(32 * 16, step)).unwrap();
        // Loss ½‖y‖²: the output gradient is the output itself (shared memory).
        let out = pipe
            .step(Batch::single(x), |_mb, out| {
                let y = out.tensor(0)?.clone();
                Ok((0.0f32, Batch::single(y)))
            })
            .unwrap();
        steps.push((
            bits(&host(&out.output.into_single().unwrap())),
            bits(&host(&out.input_grad.into_single().unwrap())),
        ));
    }
    pipe.eval();
    let x = CudaTensor::from_host(input, &[32, 16], &values(32 * 16, 9)).unwrap();
    let eval = bits(&host(
        &pipe
            .forward(Batch::single(x))
            .unwrap()
            .into_single()
            .unwrap(),
    ));
    let grads = pipe
        .partitions()
        .iter()
        .flatten()
        .flat_map(|l| {
            l.parameters()
                .iter()
                .map(|p| bits(&host(p.grad)))
                .collect::<Vec<_>>()
        })
        .collect();
    Run { steps, eval, grads }
}

fn build(
    layers: Vec<Box<dyn Layer<CudaTensor>>>,
    balance: &[usize],
    mode: Checkpoint,
    kind: ScheduleKind,
    deferred: bool,
) -> Pipe<CudaTensor> {
    Pipe::builder(layers, balance)
        .devices(vec![Device::Cuda(0); balance.len()])
        .chunks(4)
        .checkpoint(mode)
        .schedule(kind)
        .deferred_batch_norm(deferred)
        .seed(11)
        .build()
        .unwrap()
}

#[test]
fn two_partitions_on_two_streams_are_bit_identical_to_one() {
    let Some((gpu, _turn)) = gpu("two_partitions_on_two_streams_are_bit_identical_to_one") else {
        return;
    };
    let input = gpu.stream().unwrap();
    for deferred in [false, true] {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for mode in [
                Checkpoint::Always,
                Checkpoint::ExceptLast,
                Checkpoint::Never,
            ] {
                let one = gpu.stream().unwrap();
                let reference = run(
                    build(
                        model(&vec![one; 7], deferred, &[], 0),
                        &[7],
                        mode,
                        kind,
                        deferred,
                    ),
                    &input,
                );
                let (s0, s1) = (gpu.stream().unwrap(), gpu.stream().unwrap());
                let streams = [vec![s0; 4], vec![s1; 3]].concat();
                let two = run(
                    build(
                        model(&streams, deferred, &[], 0),
                        &[4, 3],
                        mode,
                        kind,
                        deferred,
                    ),
                    &input,
                );
                assert_eq!(
                    two, reference,
                    "{kind:?}, {mode}, deferred batch norm {deferred}"
                );
            }
        }
    }
}

#[test]
fn a_delayed_producer_is_waited_for() {
    let Some((gpu, _turn)) = gpu("a_delayed_producer_is_waited_for") else {
        return;
    };
    let input = gpu.stream().unwrap();
    let one = gpu.stream().unwrap();
    let mode = Checkpoint::ExceptLast;
    let kind = ScheduleKind::OneFOneB;
    let reference = run(
        build(model(&vec![one; 7], false, &[], 0), &[7], mode, kind, false),
        &input,
    );
    // Partition 0's last layer spins before writing each output (forward passes), and
    // partition 1's first layer before writing each input gradient (backward passes),
    // some 0.1 s a call; the consumers do not spin. A receiver that read before the
    // producer's event would see the memory's earlier contents.
    let (s0, s1) = (gpu.stream().unwrap(), gpu.stream().unwrap());
    let streams = [vec![s0; 4], vec![s1; 3]].concat();
    let slow = build(
        model(&streams, false, &[(3, true), (4, false)], 200_000_000),
        &[4, 3],
        mode,
        kind,
        false,
    );
    assert_eq!(run(slow, &input), reference);
}

#[test]
fn a_freed_buffer_reused_and_poisoned_while_the_consumer_stalls() {
    let Some((gpu, _turn)) = gpu("a_freed_buffer_reused_and_poisoned_while_the_consumer_stalls")
    else {
        return;
    };
    let n = 1 << 22;
    let want = values(n, 1);
    let relu: Vec<u32> = bits(&want.iter().map(|v| v.max(0.0)).collect::<Vec<_>>());
    let poison = vec![f32::NAN; n];
    // The consumer reads the producer's memory behind a long spin, while the producer's
    // last holder goes and the producer allocates memory of the same size and poisons it:
    // the memory must not be reused before the consumer's read. Two reads: a copy on
    // write (ReLU in place on a tensor someone else still holds) and a plain read (the
    // operand of an accumulation).
    for copy_on_write in [true, false] {
        let (producer, consumer) = (gpu.stream().unwrap(), gpu.stream().unwrap());
        let x = CudaTensor::from_host(&producer, &[n], &want).unwrap();
        let keep = x.clone();
        let y = x
            .to_device(&Device::Cuda(0))
            .unwrap()
            .on(&consumer)
            .unwrap();
        consumer.spin(200_000_000).unwrap(); // about 0.1 s
        let z = if copy_on_write {
            let mut layer = ReLU::new(&consumer);
            let (z, _) = layer
                .forward(Batch::single(y), &mut Context::new(true, 0, 0, n))
                .unwrap();
            z.into_single().unwrap()
        } else {
            let mut z = CudaTensor::zeros(&consumer, &[n]).unwrap();
            z.accumulate(&y).unwrap();
            drop(y);
            z
        };
        drop(keep);
        let poisoned: Vec<CudaTensor> = (0..4)
            .map(|_| CudaTensor::from_host(&producer, &[n], &poison).unwrap())
            .collect();
        let expected = if copy_on_write { &relu } else { &bits(&want) };
        assert_eq!(&bits(&host(&z)), expected, "copy on write {copy_on_write}");
        drop(poisoned);
    }
    // A read through `slice()` alone (Linear reads its input, writes only its output):
    // only the reader recorded by `on` keeps the producer's memory from reuse.
    let (producer, consumer) = (gpu.stream().unwrap(), gpu.stream().unwrap());
    let (rows, k) = (1024, 1024);
    let data = values(rows * k, 3);
    let mut linear = Linear::new(k, 64, 5, &consumer).unwrap();
    let mut ctx = Context::new(true, 0, 0, rows);
    let clean = CudaTensor::from_host(&consumer, &[rows, k], &data).unwrap();
    let (want_y, _) = linear.forward(Batch::single(clean), &mut ctx).unwrap();
    let want_y = bits(&host(&want_y.into_single().unwrap()));
    let x = CudaTensor::from_host(&producer, &[rows, k], &data).unwrap();
    let y = x.on(&consumer).unwrap();
    consumer.spin(200_000_000).unwrap();
    let (z, saved) = linear.forward(Batch::single(y), &mut ctx).unwrap();
    drop(saved); // the last holder of the producer's memory
    let poisoned: Vec<CudaTensor> = (0..4)
        .map(|_| CudaTensor::from_host(&producer, &[rows, k], &vec![f32::NAN; rows * k]).unwrap())
        .collect();
    assert_eq!(
        bits(&host(&z.into_single().unwrap())),
        want_y,
        "read through slice()"
    );
    drop(poisoned);

    // The same for a gradient accumulated from another stream: the reader stalls, the
    // writer frees its operand and poisons the memory.
    let (a_home, b_home) = (gpu.stream().unwrap(), gpu.stream().unwrap());
    let mut a = CudaTensor::from_host(&a_home, &[n], &want).unwrap();
    let b = CudaTensor::from_host(&b_home, &[n], &want).unwrap();
    a_home.spin(200_000_000).unwrap();
    a.accumulate(&b).unwrap();
    drop(b);
    let poisoned = CudaTensor::from_host(&b_home, &[n], &poison).unwrap();
    let twice: Vec<u32> = bits(&want.iter().map(|v| v + v).collect::<Vec<_>>());
    assert_eq!(bits(&host(&a)), twice);
    drop(poisoned);
}

#[test]
fn device_memory_by_checkpoint_mode() {
    let Some((gpu, _turn)) = gpu("device_memory_by_checkpoint_mode") else {
        return;
    };
    let input = gpu.stream().unwrap();
    let (batch, m, width) = (256, 8, 1024);
    let mib = |b: usize| b as f64 / 1048576.0;
    println!(
        "device memory, 2 partitions x [Linear({width}), ReLU] x 2 on one GPU, batch {batch}, \
         m = {m}, GPipe; allocator accounting, parameters and the output excluded:"
    );
    let (mut held, mut peaks, mut per_partition) = (Vec::new(), Vec::new(), Vec::new());
    for mode in [
        Checkpoint::Always,
        Checkpoint::ExceptLast,
        Checkpoint::Never,
    ] {
        let (s0, s1) = (gpu.stream().unwrap(), gpu.stream().unwrap());
        let mut layers: Vec<Box<dyn Layer<CudaTensor>>> = Vec::new();
        for (i, s) in [&s0, &s0, &s1, &s1].into_iter().enumerate() {
            layers.push(Box::new(Linear::new(width, width, i as u64, s).unwrap()));
            layers.push(Box::new(ReLU::new(s)));
        }
        let mut pipe = Pipe::builder(layers, &[4, 4])
            .devices(vec![Device::Cuda(0); 2])
            .chunks(m)
            .checkpoint(mode)
            .build()
            .unwrap();
        let x = CudaTensor::from_host(&input, &[batch, width], &values(batch * width, 1)).unwrap();
        gpu.synchronize().unwrap();
        let base = gpu.live_bytes() - x.size_bytes();
        gpu.reset_peak();
        let y = pipe
            .forward(Batch::single(x))
            .unwrap()
            .into_single()
            .unwrap();
        let after_forward = gpu.live_bytes() - base - y.size_bytes();
        let partitions: Vec<usize> = pipe.memory().iter().map(|p| p.held).collect();
        pipe.backward(Batch::single(y)).unwrap();
        let buried = gpu.buried_bytes();
        gpu.synchronize().unwrap();
        let peak = gpu.peak_bytes() - base;
        println!(
            "  {mode:<11} held after forward {:>6.1} MiB (per partition {:?} MiB), peak over the step {:>6.1} MiB ({:.1} MiB waiting for readers at the end)",
            mib(after_forward),
            partitions.iter().map(|&b| (mib(b) * 10.0).round() / 10.0).collect::<Vec<_>>(),
            mib(peak),
            mib(buried)
        );
        held.push(after_forward);
        peaks.push(peak);
        per_partition.push(partitions);
        drop(pipe);
        gpu.synchronize().unwrap();
        assert_eq!(gpu.live_bytes(), base - 4 * (width * width + width) * 4 * 2);
    }
    let (free, total) = gpu.memory().unwrap();
    println!(
        "  (cuMemGetInfo: {:.1} of {:.1} GiB free)",
        free as f64 / 1073741824.0,
        total as f64 / 1073741824.0
    );
    assert!(
        held[0] < held[1] && held[1] < held[2],
        "held after forward: {held:?}"
    );
    for p in 0..2 {
        let h: Vec<usize> = per_partition.iter().map(|r| r[p]).collect();
        assert!(h[0] < h[1] && h[1] < h[2], "partition {p}: {h:?}");
    }
    // `always` keeps only the micro-batch inputs, each once on the device (partition 1's
    // inputs are partition 0's outputs, read where they are).
    assert_eq!(
        held[0],
        2 * batch * width * 4,
        "always: one input per micro-batch and partition"
    );
    assert!(
        peaks[1] < peaks[2] && peaks[0] < peaks[2],
        "peaks: {peaks:?}"
    );
}

#[test]
fn tensor_operations_on_the_device() {
    let Some((gpu, _turn)) = gpu("tensor_operations_on_the_device") else {
        return;
    };
    let (s0, s1) = (gpu.stream().unwrap(), gpu.stream().unwrap());
    let data = values(10 * 3, 2);
    let t = CudaTensor::from_host(&s0, &[10, 3], &data).unwrap();
    assert_eq!(t.size_bytes(), 120);
    assert_eq!(s0.live_bytes(), 120);
    let parts = t.split(&[4, 0, 6]).unwrap();
    assert_eq!(parts[1].shape(), &[0, 3]);
    assert_eq!(host(&parts[2]), data[12..]);
    // Parts moved to another stream and gathered there come back equal.
    let moved: Vec<CudaTensor> = parts.into_iter().map(|p| p.on(&s1).unwrap()).collect();
    let back = CudaTensor::concat(moved).unwrap();
    assert!(Arc::ptr_eq(back.home(), &s1));
    assert_eq!(host(&back), data);
    let mut sum = back.clone();
    sum.accumulate(&t).unwrap();
    assert_eq!(host(&sum), data.iter().map(|v| v + v).collect::<Vec<_>>());
    assert_eq!(host(&back), data, "copy on write: the clone is unchanged");
    // Host devices are refused; the same ordinal is a no-op.
    assert!(matches!(
        t.clone().to_device(&Device::Cpu),
        Err(Error::Device { .. })
    ));
    assert!(Arc::ptr_eq(
        t.clone().to_device(&Device::Cuda(0)).unwrap().home(),
        &s0
    ));
    assert!(matches!(
        t.clone().split(&[3, 3]),
        Err(Error::SplitSizes { .. })
    ));
    let mut other = CudaTensor::zeros(&s1, &[3, 10]).unwrap();
    assert!(matches!(other.accumulate(&t), Err(Error::Shape { .. })));
    drop((t, back, sum, other));
    gpu.synchronize().unwrap(); // frees what waited for other streams' reads
    assert_eq!(
        s0.live_bytes() + s1.live_bytes(),
        0,
        "every byte is given back"
    );
}

/// A layer that fails once, at one micro-batch's forward.
struct FailOnce {
    at: usize,
    armed: bool,
}

impl Layer<CudaTensor> for FailOnce {
    fn forward(
        &mut self,
        input: Batch<CudaTensor>,
        ctx: &mut Context,
    ) -> Result<(Batch<CudaTensor>, Saved<CudaTensor>), Error> {
        if self.armed && ctx.micro_batch().index == self.at {
            self.armed = false;
            return Err(Error::Custom("injected".into()));
        }
        Ok((input, Saved::none()))
    }

    fn backward(
        &mut self,
        grad_output: Batch<CudaTensor>,
        _saved: Saved<CudaTensor>,
        _ctx: &mut Context,
    ) -> Result<Batch<CudaTensor>, Error> {
        Ok(grad_output)
    }
}

#[test]
fn a_failing_partition_fails_the_step_and_the_next_one_works() {
    let Some((gpu, _turn)) = gpu("a_failing_partition_fails_the_step_and_the_next_one_works")
    else {
        return;
    };
    let input = gpu.stream().unwrap();
    let (s0, s1) = (gpu.stream().unwrap(), gpu.stream().unwrap());
    let streams = [vec![s0; 4], vec![s1.clone(); 3]].concat();
    let mut layers = model(&streams, false, &[], 0);
    layers.insert(5, Box::new(FailOnce { at: 2, armed: true }));
    let mut pipe = build(
        layers,
        &[4, 4],
        Checkpoint::ExceptLast,
        ScheduleKind::OneFOneB,
        false,
    );
    let x = CudaTensor::from_host(&input, &[32, 16], &values(32 * 16, 0)).unwrap();
    let loss = |_mb: MicroBatch, out: &Batch<CudaTensor>| {
        Ok((0.0f32, Batch::single(out.tensor(0)?.clone())))
    };
    let err = pipe.step(Batch::single(x.clone()), loss).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("partition 1") && text.contains("micro-batch 2"),
        "{text}"
    );
    pipe.zero_grad();
    let out = pipe.step(Batch::single(x), loss).unwrap();
    assert!(host(&out.output.into_single().unwrap())
        .iter()
        .all(|v| v.is_finite()));
}
