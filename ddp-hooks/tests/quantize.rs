//! The 8-bit quantisation hooks (`quantize_per_tensor`, `quantize_per_channel`) on thread
//! ranks with the CPU backend, bit for bit against a naive scalar transcription of
//! PyTorch's `quantization_hooks.py` written here (the padded `[C, bucket_size]` matrix
//! materialised, as PyTorch does), plus hand-known values, the error bound, and the typed
//! error of a NaN bucket on every rank.

use collectives::{run_local_with_timeout, ProcessGroup};
use ddp_hooks::{
    CommHook, Error, GradBucket, HookSpec, HookState, Layout, QuantizePerChannel, QuantizePerTensor,
};
use lowrank::CpuBackend;
use std::sync::Arc;
use std::time::Duration;

/// Which hook a test runs.
#[derive(Clone, Copy, Debug)]
enum Kind {
    PerTensor,
    PerChannel(usize),
}

/// A rank's result and its hook's statistics `(before, after)`.
type RankResult = (Result<Vec<f32>, Error>, (u64, u64));

/// Runs one step of the hook on `inputs.len()` thread ranks, rank `r` with `inputs[r]`;
/// each rank's result and its hook's compression statistics `(before, after)`.
fn run(kind: Kind, inputs: &[Vec<f32>]) -> Vec<RankResult> {
    run_local_with_timeout(inputs.len(), Duration::from_secs(20), |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let mut hook: Box<dyn CommHook<CpuBackend>> = match kind {
            Kind::PerTensor => Box::new(QuantizePerTensor::new(be, group)),
            Kind::PerChannel(bs) => Box::new(QuantizePerChannel::new(be, group, bs).unwrap()),
        };
        let x = inputs[rank].clone();
        let layout = Arc::new(Layout::packed(&[vec![x.len()]]).unwrap());
        let bucket = GradBucket::new(0, 1, x, layout).unwrap();
        let out = hook.run(bucket).wait().map_err(Error::from);
        let s = hook.compression_stats().unwrap();
        (out, (s.before, s.after))
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

/// Every rank's output, checked identical bit for bit on every rank.
fn outputs(kind: Kind, inputs: &[Vec<f32>]) -> Vec<f32> {
    let res = run(kind, inputs);
    let outs: Vec<Vec<f32>> = res
        .into_iter()
        .map(|(o, _)| o.expect("the step succeeds"))
        .collect();
    for o in &outs[1..] {
        assert_eq!(bits(o), bits(&outs[0]), "ranks disagree");
    }
    outs.into_iter().next().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

// ---- The reference: PyTorch's hooks, one scalar at a time. ----

/// MinMaxObserver (quint8, per-tensor affine) on `xs`: `(scale, zero_point)`.
fn ref_qparams(xs: &[f32]) -> (f32, f32) {
    if xs.is_empty() {
        return (1.0, 0.0); // the observer's uninitialised range
    }
    let mut min = xs[0];
    let mut max = xs[0];
    for &x in xs {
        if x < min {
            min = x;
        }
        if x > max {
            max = x;
        }
    }
    let lo = if min < 0.0 { min } else { 0.0 };
    let hi = if max > 0.0 { max } else { 0.0 };
    let mut scale = (hi - lo) / 255.0f32;
    if scale < f32::EPSILON {
        scale = f32::EPSILON;
    }
    let mut zp = -((lo / scale).round_ties_even() as i64);
    zp = zp.clamp(0, 255);
    (scale, zp as f32)
}

fn ref_quantize(x: f32, scale: f32, zp: f32) -> u8 {
    let y = (x / scale).round_ties_even() + zp;
    y.clamp(0.0, 255.0) as u8
}

fn ref_dequantize(q: u8, scale: f32, zp: f32) -> f32 {
    scale * (q as f32 - zp)
}

/// `quantization_pertensor_hook`: the output, and each rank's scale.
fn ref_per_tensor(inputs: &[Vec<f32>]) -> (Vec<f32>, Vec<f32>) {
    let w = inputs.len();
    let params: Vec<(f32, f32)> = inputs.iter().map(|x| ref_qparams(x)).collect();
    let qs: Vec<Vec<u8>> = inputs
        .iter()
        .zip(&params)
        .map(|(x, &(s, z))| x.iter().map(|&v| ref_quantize(v, s, z)).collect())
        .collect();
    let n = inputs[0].len();
    let mut agg = vec![0.0f32; n];
    for (q, &(s, z)) in qs.iter().zip(&params) {
        for i in 0..n {
            agg[i] += ref_dequantize(q[i], s, z);
        }
    }
    let out = agg.iter().map(|a| a / w as f32).collect();
    (out, params.iter().map(|p| p.0).collect())
}

/// `quantization_perchannel_hook(bucket_size)`: the padded `[C, bucket_size]` matrix,
/// per-row observer, all of it quantised and dequantised, flattened and truncated.
fn ref_per_channel(inputs: &[Vec<f32>], bs: usize) -> (Vec<f32>, Vec<f32>) {
    let w = inputs.len();
    let n = inputs[0].len();
    let pad = bs - n % bs;
    let rows = (n + pad) / bs;
    let mut scales = Vec::new();
    let mut agg = vec![0.0f32; rows * bs];
    for x in inputs {
        let mut padded = x.clone();
        padded.resize(n + pad, 0.0);
        for c in 0..rows {
            let row = &padded[c * bs..(c + 1) * bs];
            let (s, z) = ref_qparams(row);
            scales.push(s);
            for (j, &v) in row.iter().enumerate() {
                let q = ref_quantize(v, s, z);
                agg[c * bs + j] += ref_dequantize(q, s, z);
            }
        }
    }
    let out = agg[..n].iter().map(|a| a / w as f32).collect();
    (out, scales)
}

/// A deterministic pseudo-random bucket in `[-amp, amp)`.
fn noise(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

/// Runs both hooks on `inputs` and checks them bit for bit against the reference.
fn check_against_reference(inputs: &[Vec<f32>], bucket_sizes: &[usize]) {
    let (want, _) = ref_per_tensor(inputs);
    let got = outputs(Kind::PerTensor, inputs);
    assert_eq!(bits(&got), bits(&want), "per tensor: {got:?} vs {want:?}");
    for &bs in bucket_sizes {
        let (want, _) = ref_per_channel(inputs, bs);
        let got = outputs(Kind::PerChannel(bs), inputs);
        assert_eq!(
            bits(&got),
            bits(&want),
            "per channel {bs}: {got:?} vs {want:?}"
        );
    }
}

// ---- Hand-known values. ----

/// 0..=255: scale 1, zero point 0, every value exact; the mean of a ramp and its mirror
/// is 127.5 everywhere (exact in f32), on 2 and 3 ranks.
#[test]
fn a_byte_ramp_is_exact() {
    let ramp: Vec<f32> = (0..=255).map(|v| v as f32).collect();
    assert_eq!(ref_qparams(&ramp), (1.0, 0.0));
    let mirror: Vec<f32> = ramp.iter().map(|v| 255.0 - v).collect();
    let out = outputs(Kind::PerTensor, &[ramp.clone(), mirror.clone()]);
    assert_eq!(out, vec![127.5; 256]);
    let out = outputs(Kind::PerTensor, &[ramp.clone(), ramp.clone(), ramp.clone()]);
    assert_eq!(out, ramp);
    // Per channel with one row of 256 holding it all (plus a padding row: 256 % 256 == 0).
    let out = outputs(Kind::PerChannel(256), &[ramp.clone(), mirror.clone()]);
    assert_eq!(out, vec![127.5; 256]);
    check_against_reference(&[ramp, mirror], &[1, 3, 256, 512]);
}

/// All negative: the range is `[lo, 0]`, the zero point 255; `-255..=-1` is exact.
#[test]
fn an_all_negative_bucket() {
    let neg: Vec<f32> = (1..=255).map(|v| -(v as f32)).collect();
    assert_eq!(ref_qparams(&neg), (1.0, 255.0));
    let out = outputs(Kind::PerTensor, &[neg.clone(), neg.clone()]);
    assert_eq!(out, neg);
    let frac: Vec<f32> = (0..100).map(|i| -0.013 * i as f32 - 0.5).collect();
    check_against_reference(&[frac.clone(), neg[..100].to_vec()], &[1, 7, 100, 512]);
    check_against_reference(&[frac.clone(), frac.clone(), neg[..100].to_vec()], &[9]);
}

/// A constant bucket: zeros take the `eps` scale (and come back exactly 0); a positive
/// constant `c` has scale `c / 255` and every element the top byte.
#[test]
fn constant_buckets() {
    let zeros = vec![0.0f32; 33];
    assert_eq!(ref_qparams(&zeros), (f32::EPSILON, 0.0));
    let out = outputs(Kind::PerTensor, &[zeros.clone(), zeros.clone()]);
    assert_eq!(bits(&out), bits(&zeros));
    let out = outputs(
        Kind::PerChannel(4),
        &[zeros.clone(), zeros.clone(), zeros.clone()],
    );
    assert_eq!(bits(&out), bits(&zeros));
    let c = vec![0.3f32; 33];
    let (s, z) = ref_qparams(&c);
    assert_eq!((s, z), (0.3 / 255.0, 0.0));
    assert_eq!(ref_quantize(0.3, s, z), 255);
    check_against_reference(&[c.clone(), zeros.clone()], &[1, 4, 33, 64]);
    check_against_reference(&[c.clone(), c.clone(), c], &[5]);
}

/// `x / scale` exactly `k + 0.5` rounds to the even `k` or `k + 1` (scale 1: the bucket
/// spans exactly 0..=255).
#[test]
fn ties_round_to_even() {
    let x = vec![0.0, 255.0, 0.5, 1.5, 2.5, 3.5, 100.5, 253.5, 254.5];
    let want = vec![0.0, 255.0, 0.0, 2.0, 2.0, 4.0, 100.0, 254.0, 254.0];
    assert_eq!(ref_qparams(&x), (1.0, 0.0));
    assert_eq!(outputs(Kind::PerTensor, &[x.clone(), x.clone()]), want);
    assert_eq!(
        outputs(Kind::PerTensor, &[x.clone(), x.clone(), x.clone()]),
        want
    );
    // One row holds them all: the same scale, the same bytes.
    assert_eq!(outputs(Kind::PerChannel(16), &[x.clone(), x.clone()]), want);
    // Negative ties with zero point 255 (range -255..=0): -0.5 → -0 + 255 → 255 → 0,
    // -1.5 → -2, -2.5 → -2.
    let x = vec![-255.0, 0.0, -0.5, -1.5, -2.5];
    assert_eq!(ref_qparams(&x), (1.0, 255.0));
    let out = outputs(Kind::PerTensor, &[x.clone(), x]);
    assert_eq!(out, vec![-255.0, 0.0, 0.0, -2.0, -2.0]);
}

/// One huge value takes the whole range: the small values collapse onto the zero point,
/// the huge one is kept (within its scale), as in PyTorch.
#[test]
fn one_huge_value() {
    let mut x = noise(40, 3, 1.0);
    x[17] = 1e30;
    let y = noise(40, 4, 1.0);
    check_against_reference(&[x.clone(), y.clone()], &[1, 8, 40, 41]);
    let out = outputs(Kind::PerTensor, &[x.clone(), y.clone()]);
    let (s, _) = ref_qparams(&x);
    assert!((out[17] - 0.5e30).abs() <= s, "{}", out[17]);
    check_against_reference(&[x, y, noise(40, 5, 1e-3)], &[6]);
}

/// Per channel, the padding when `bucket_size` divides numel (a whole extra row) and
/// when it does not; rows of 1; a row longer than the bucket; an empty bucket.
#[test]
fn per_channel_padding_and_row_lengths() {
    for n in [12usize, 10, 1, 0] {
        let a = noise(n, 11, 2.0);
        let b: Vec<f32> = noise(n, 12, 0.5).iter().map(|v| v - 0.25).collect();
        let c = noise(n, 13, 1e4);
        for inputs in [vec![a.clone(), b.clone()], vec![a.clone(), b, c]] {
            let sizes: &[usize] = &[1, 2, 3, 4, 6, 12, 13, 512, 100_000];
            check_against_reference(&inputs, sizes);
        }
    }
    // Rows of 4 over 8 values: rows [.., ..], and an all-padding third row.
    let x: Vec<f32> = vec![1.0, 2.0, 3.0, 255.0, -10.0, 0.0, 0.0, 0.0];
    let (_, scales) = ref_per_channel(std::slice::from_ref(&x), 4);
    assert_eq!(scales, vec![1.0, 10.0 / 255.0, f32::EPSILON]);
    // The first row is exact at scale 1.
    let out = outputs(Kind::PerChannel(4), &[x.clone(), x.clone()]);
    assert_eq!(out[..4], x[..4]);
    // A row of 1: every value is its own row, quantised to the top or bottom byte.
    let x = vec![0.7f32, -3.0, 0.0, 1e-20];
    let out = outputs(Kind::PerChannel(1), &[x.clone(), x.clone(), x.clone()]);
    let (want, _) = ref_per_channel(&[x.clone(), x.clone(), x], 1);
    assert_eq!(bits(&out), bits(&want));
}

/// Varied buckets on 2 and 3 ranks, bit for bit, and within the provable bound: each
/// rank's dequantised value is within `scale_r / 2` of its `x` (the nearest multiple of
/// the scale, inside the byte range since the range holds every `x`), so the mean is
/// within `max_r scale_r / 2` of the exact mean, up to the f32 rounding of the ops.
#[test]
fn within_half_the_largest_scale_of_the_mean() {
    for world in [2usize, 3] {
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| noise(1000, 20 + r as u64, [1.0, 5e-3, 300.0][r]))
            .collect();
        check_against_reference(&inputs, &[1, 7, 512, 1000, 4096]);
        let exact: Vec<f64> = (0..1000)
            .map(|i| inputs.iter().map(|x| x[i] as f64).sum::<f64>() / world as f64)
            .collect();
        let amax = inputs
            .iter()
            .flatten()
            .fold(0.0f64, |m, &v| m.max(v.abs() as f64));
        let slack = 16.0 * f32::EPSILON as f64 * amax;
        let (_, scales) = ref_per_tensor(&inputs);
        let bound = scales.iter().fold(0.0f32, |m, &s| m.max(s)) as f64 / 2.0;
        let out = outputs(Kind::PerTensor, &inputs);
        for (o, e) in out.iter().zip(&exact) {
            assert!((*o as f64 - e).abs() <= bound + slack, "{o} vs {e}");
        }
        for bs in [7usize, 512] {
            let (_, scales) = ref_per_channel(&inputs, bs);
            let rows = 1000 / bs + 1;
            let out = outputs(Kind::PerChannel(bs), &inputs);
            for (i, (o, e)) in out.iter().zip(&exact).enumerate() {
                let c = i / bs;
                let bound =
                    (0..world).fold(0.0f32, |m, r| m.max(scales[r * rows + c])) as f64 / 2.0;
                assert!((*o as f64 - e).abs() <= bound + slack, "{bs}: {o} vs {e}");
            }
        }
    }
}

/// A NaN, an infinity, or a range that overflows f32 on one rank: every rank's work
/// fails with `Error::Bucket` naming that rank, and none waits for the others.
#[test]
fn a_nonfinite_bucket_is_a_typed_error_on_every_rank() {
    let mut nan = noise(20, 1, 1.0);
    nan[5] = f32::NAN;
    let mut inf = noise(20, 2, 1.0);
    inf[19] = f32::NEG_INFINITY;
    let mut wide = noise(20, 3, 1.0);
    (wide[0], wide[1]) = (f32::MAX, -f32::MAX);
    for (bad, why) in [
        (nan, "NaN at element 5"),
        (inf, "-inf at element 19"),
        (wide, ""),
    ] {
        for world in [2usize, 3] {
            let mut inputs: Vec<Vec<f32>> =
                (0..world).map(|r| noise(20, 9 + r as u64, 1.0)).collect();
            inputs[1] = bad.clone();
            for kind in [Kind::PerTensor, Kind::PerChannel(8), Kind::PerChannel(512)] {
                for (rank, (out, _)) in run(kind, &inputs).into_iter().enumerate() {
                    let e = out.unwrap_err();
                    let Error::Bucket { index: 0, why: msg } = &e else {
                        panic!("{kind:?}: rank {rank}: {e:?}")
                    };
                    assert!(msg.contains("rank 1's bucket"), "{kind:?}: {msg}");
                    if rank == 1 {
                        assert!(msg.contains(why), "{kind:?}: {msg}");
                    }
                }
            }
        }
    }
}

/// Ranks whose buckets differ in length fail (typed) instead of misreading each other.
#[test]
fn buckets_of_different_lengths_fail_on_every_rank() {
    let inputs = vec![vec![1.0; 8], vec![1.0; 9]];
    for kind in [Kind::PerTensor, Kind::PerChannel(4), Kind::PerChannel(100)] {
        for (out, _) in run(kind, &inputs) {
            assert!(out.is_err(), "{kind:?}");
        }
    }
}

/// Elements before, and bytes / 4 plus the parameters after, per step.
#[test]
fn compression_stats_count_bytes_as_quarter_elements() {
    let inputs = vec![noise(10, 1, 1.0), noise(10, 2, 1.0)];
    for (_, s) in run(Kind::PerTensor, &inputs) {
        assert_eq!(s, (10, 3 + 2));
    }
    for (_, s) in run(Kind::PerChannel(4), &inputs) {
        assert_eq!(s, (10, 3 + 2 * 3));
    }
    for (_, s) in run(Kind::PerChannel(5), &inputs) {
        assert_eq!(s, (10, 3 + 2 * 3)); // 10 % 5 == 0: a whole padding row
    }
}

/// The registry builds the same hooks: the same bits, and several steps accumulate the
/// statistics.
#[test]
fn hooks_built_by_name_match() {
    let inputs = vec![noise(100, 7, 1.0), noise(100, 8, 3.0)];
    let (want, _) = ref_per_channel(&inputs, 16);
    let out = run_local_with_timeout(2, Duration::from_secs(20), |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let spec: HookSpec = "QUANTIZE_PER_CHANNEL:bucket_size=16".parse().unwrap();
        let mut hook = spec.build(Arc::new(CpuBackend::new()), group).unwrap();
        let layout = Arc::new(Layout::packed(&[vec![10, 10]]).unwrap());
        let mut last = Vec::new();
        for _ in 0..3 {
            let b = GradBucket::new(0, 1, inputs[rank].clone(), layout.clone()).unwrap();
            last = hook.run(b).wait().unwrap();
        }
        (last, hook.compression_stats().unwrap())
    })
    .unwrap();
    for r in out {
        let (o, s) = r.unwrap();
        assert_eq!(bits(&o), bits(&want));
        assert_eq!((s.before, s.after), (300, 3 * (25 + 2 * 7)));
    }
}

// ---- Error feedback (beyond PyTorch): `+ef`. ----

/// What each rank saw over a run: its output at every step, and its state at the end.
type EfRun = Vec<(Vec<Vec<f32>>, HookState)>;

/// Runs the hook of `spec` on 2 thread ranks for `steps.len()` steps, rank `r` with
/// `steps[t][r]` at step `t` (bucket 0), after loading `load[r]` when given.
fn run_ef(spec: &str, steps: &[Vec<Vec<f32>>], load: Option<&[HookState]>) -> EfRun {
    run_local_with_timeout(2, Duration::from_secs(30), |g| {
        let rank = g.rank();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let be = Arc::new(CpuBackend::new().with_threads(1).unwrap());
        let mut hook = spec.parse::<HookSpec>().unwrap().build(be, group).unwrap();
        if let Some(states) = load {
            hook.load_state(states[rank].clone()).unwrap();
        }
        let mut outs = Vec::new();
        for inputs in steps {
            let x = inputs[rank].clone();
            let layout = Arc::new(Layout::packed(&[vec![x.len()]]).unwrap());
            let bucket = GradBucket::new(0, 1, x, layout).unwrap();
            outs.push(hook.run(bucket).wait().unwrap());
        }
        (outs, hook.save_state().unwrap())
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

/// The memory of bucket 0 in a saved `+ef` state.
fn memory(state: &HookState) -> Vec<f32> {
    let HookState::Quantize { buckets, .. } = state else {
        panic!("not a quantisation state: {state:?}")
    };
    buckets[&0].clone()
}

/// This rank's own dequantised values of `y` (PyTorch's arithmetic, one scalar at a
/// time): per tensor (`bs = None`) or in padded rows of `bs`.
fn ref_own(y: &[f32], bs: Option<usize>) -> Vec<f32> {
    let n = y.len();
    let bs = bs.unwrap_or(n.max(1) + 1);
    let mut padded = y.to_vec();
    padded.resize(n + bs - n % bs, 0.0);
    let mut own = Vec::new();
    for row in padded.chunks(bs) {
        let (s, z) = ref_qparams(row);
        own.extend(
            row.iter()
                .map(|&v| ref_dequantize(ref_quantize(v, s, z), s, z)),
        );
    }
    own.truncate(n);
    own
}

/// One step of error feedback in scalars: every rank quantises `x + e`; the output, and
/// each rank's new `e = (x + e) − dequant_own`.
fn ref_ef_step(xs: &[Vec<f32>], es: &[Vec<f32>], bs: Option<usize>) -> (Vec<f32>, Vec<Vec<f32>>) {
    let ys: Vec<Vec<f32>> = xs
        .iter()
        .zip(es)
        .map(|(x, e)| x.iter().zip(e).map(|(x, e)| x + e).collect())
        .collect();
    let (out, _) = match bs {
        None => ref_per_tensor(&ys),
        Some(bs) => ref_per_channel(&ys, bs),
    };
    let new_es = ys
        .iter()
        .map(|y| {
            let own = ref_own(y, bs);
            y.iter().zip(&own).map(|(y, d)| y - d).collect()
        })
        .collect();
    (out, new_es)
}

const EF_SPECS: [(&str, Option<usize>); 3] = [
    ("quantize_per_tensor+ef", None),
    ("quantize_per_channel+ef:bucket_size=16", Some(16)),
    (
        "quantize_per_channel:bucket_size=7,error_feedback=true",
        Some(7),
    ),
];

/// Error feedback off is the existing hook, bit for bit, and `error_feedback=false` is
/// that hook; its state stays stateless.
#[test]
fn error_feedback_off_is_the_plain_hook() {
    let step = vec![noise(50, 1, 1.0), noise(50, 2, 0.3)];
    let steps = vec![step.clone(), step.clone()];
    for (spec, bs) in [
        ("quantize_per_tensor:error_feedback=false", None),
        (
            "quantize_per_channel:bucket_size=16,error_feedback=false",
            Some(16),
        ),
    ] {
        let (want, _) = match bs {
            None => ref_per_tensor(&step),
            Some(bs) => ref_per_channel(&step, bs),
        };
        for (outs, state) in run_ef(spec, &steps, None) {
            for o in &outs {
                assert_eq!(bits(o), bits(&want), "{spec}");
            }
            assert!(matches!(state, HookState::Stateless { .. }), "{spec}");
        }
    }
}

/// After one step the memory is `x − dequant_own(x)` exactly; the second step quantises
/// `x + e` (output and memory against the scalar reimplementation).
#[test]
fn error_feedback_memory_and_second_step() {
    let step1 = vec![noise(40, 3, 1.0), noise(40, 4, 2.5)];
    let step2 = vec![noise(40, 5, 0.8), noise(40, 6, 0.1)];
    for (spec, bs) in EF_SPECS {
        let res = run_ef(spec, std::slice::from_ref(&step1), None);
        for (r, (outs, state)) in res.iter().enumerate() {
            let own = ref_own(&step1[r], bs);
            let want: Vec<f32> = step1[r].iter().zip(&own).map(|(x, d)| x - d).collect();
            assert_eq!(bits(&memory(state)), bits(&want), "{spec}: rank {r}");
            assert!(want.iter().any(|&e| e != 0.0), "{spec}: a trivial memory");
            // The first step's output is the plain hook's (e = 0).
            let (plain, _) = match bs {
                None => ref_per_tensor(&step1),
                Some(bs) => ref_per_channel(&step1, bs),
            };
            assert_eq!(bits(&outs[0]), bits(&plain), "{spec}");
        }
        let zeros = vec![vec![0.0; 40]; 2];
        let (out1, es1) = ref_ef_step(&step1, &zeros, bs);
        let (out2, es2) = ref_ef_step(&step2, &es1, bs);
        let res = run_ef(spec, &[step1.clone(), step2.clone()], None);
        for (r, (outs, state)) in res.iter().enumerate() {
            assert_eq!(bits(&outs[0]), bits(&out1), "{spec}: step 1");
            assert_eq!(bits(&outs[1]), bits(&out2), "{spec}: step 2");
            assert_eq!(bits(&memory(state)), bits(&es2[r]), "{spec}: rank {r}");
        }
        // The second step differs from the plain hook's on `step2`.
        let (plain2, _) = match bs {
            None => ref_per_tensor(&step2),
            Some(bs) => ref_per_channel(&step2, bs),
        };
        assert_ne!(bits(&out2), bits(&plain2), "{spec}");
    }
}

/// A constant bucket whose values are not representable: the plain hook's output has the
/// same bias at every step; with error feedback the running average over 50 steps
/// converges to the exact mean (its error < 10% of the plain hook's).
#[test]
fn error_feedback_removes_the_bias() {
    let step = vec![noise(100, 31, 1.0), noise(100, 32, 0.7)];
    let exact: Vec<f64> = (0..100)
        .map(|i| (step[0][i] as f64 + step[1][i] as f64) / 2.0)
        .collect();
    let steps = vec![step.clone(); 50];
    let mean_err = |outs: &[Vec<f32>]| {
        let t = outs.len() as f64;
        (0..100)
            .map(|i| (outs.iter().map(|o| o[i] as f64).sum::<f64>() / t - exact[i]).abs())
            .sum::<f64>()
            / 100.0
    };
    for (ef, plain) in [
        ("quantize_per_tensor+ef", "quantize_per_tensor"),
        (
            "quantize_per_channel+ef:bucket_size=16",
            "quantize_per_channel:bucket_size=16",
        ),
    ] {
        let e_ef = mean_err(&run_ef(ef, &steps, None)[0].0);
        let e_plain = mean_err(&run_ef(plain, &steps, None)[0].0);
        assert!(e_plain > 0.0, "{plain}: exact");
        assert!(e_ef < 0.1 * e_plain, "{ef}: {e_ef} vs {plain}: {e_plain}");
    }
}

/// Saved after 3 steps and loaded into fresh hooks, the run continues bit for bit; a
/// state of another configuration, of another bucket length, or non-finite, is refused
/// (`Error::State`) and leaves the hook unchanged.
#[test]
fn error_feedback_state_round_trip_and_refusals() {
    let steps: Vec<Vec<Vec<f32>>> = (0..6)
        .map(|t| vec![noise(30, 40 + t, 1.0), noise(30, 50 + t, 0.4)])
        .collect();
    for (spec, _) in EF_SPECS {
        let whole = run_ef(spec, &steps, None);
        let first = run_ef(spec, &steps[..3], None);
        let saved: Vec<HookState> = first.iter().map(|(_, s)| s.clone()).collect();
        // Through JSON, as a checkpoint would.
        let saved: Vec<HookState> = saved
            .iter()
            .map(|s| serde_json::from_str(&serde_json::to_string(s).unwrap()).unwrap())
            .collect();
        let rest = run_ef(spec, &steps[3..], Some(&saved));
        for r in 0..2 {
            for t in 0..3 {
                assert_eq!(bits(&first[r].0[t]), bits(&whole[r].0[t]), "{spec}");
                assert_eq!(bits(&rest[r].0[t]), bits(&whole[r].0[t + 3]), "{spec}");
            }
            assert_eq!(rest[r].1, whole[r].1, "{spec}");
        }
    }
    // Refusals, on one rank.
    let groups = collectives::ThreadGroup::create(1, Duration::from_secs(10)).unwrap();
    let group: Arc<dyn ProcessGroup> = Arc::new(groups.into_iter().next().unwrap());
    let be = Arc::new(CpuBackend::new());
    let build = |s: &str| {
        s.parse::<HookSpec>()
            .unwrap()
            .build(be.clone(), group.clone())
            .unwrap()
    };
    let mut h = build("quantize_per_channel+ef:bucket_size=16");
    let layout = Arc::new(Layout::packed(&[vec![30]]).unwrap());
    h.run(GradBucket::new(0, 1, noise(30, 9, 1.0), layout.clone()).unwrap())
        .wait()
        .unwrap();
    let before = h.save_state().unwrap();
    assert_eq!(memory(&before).len(), 30);
    let state = |hook: &str, len: usize, v: f32| HookState::Quantize {
        hook: hook.into(),
        buckets: [(0, vec![v; len])].into_iter().collect(),
    };
    for bad in [
        state("quantize_per_channel+ef:bucket_size=8", 30, 0.0),
        state("quantize_per_tensor+ef", 30, 0.0),
        state("quantize_per_channel+ef:bucket_size=16", 29, 0.0),
        state("quantize_per_channel+ef:bucket_size=16", 30, f32::NAN),
        HookState::Stateless {
            hook: "quantize_per_channel:bucket_size=16".into(),
        },
    ] {
        assert!(
            matches!(h.load_state(bad.clone()), Err(Error::State(_))),
            "{bad:?}"
        );
        assert_eq!(h.save_state().unwrap(), before, "{bad:?}: the hook changed");
    }
    // The plain hook refuses an error-feedback state.
    let plain = build("quantize_per_channel:bucket_size=16");
    assert!(matches!(
        plain.load_state(before.clone()),
        Err(Error::State(_))
    ));
    // A fresh hook cannot see the bucket: the mismatch is the bucket's next step
    // (`Error::Bucket`, before any collective), and the memory stays.
    let mut fresh = build("quantize_per_channel+ef:bucket_size=16");
    fresh
        .load_state(state("quantize_per_channel+ef:bucket_size=16", 29, 0.5))
        .unwrap();
    let e = fresh
        .run(GradBucket::new(0, 1, noise(30, 9, 1.0), layout).unwrap())
        .wait()
        .map_err(Error::from)
        .unwrap_err();
    assert!(matches!(e, Error::Bucket { index: 0, .. }), "{e:?}");
    assert_eq!(memory(&fresh.save_state().unwrap()), vec![0.5; 29]);
}

/// Many buckets in flight at once, as the reducer launches them: each bucket's second
/// all-gather is issued from a continuation, and the hooks keep every rank's collectives
/// in one order (without it the ranks' all-gathers would cross: a mismatch or a hang).
/// Each bucket's result is the one it gets alone.
#[test]
fn buckets_in_flight_together_keep_one_order() {
    for spec in [
        "quantize_per_tensor",
        "quantize_per_channel:bucket_size=16",
        "quantize_per_channel+ef",
    ] {
        let sizes = [100usize, 7, 4096, 1, 513, 64, 2000, 33];
        let inputs = |rank: usize| -> Vec<Vec<f32>> {
            sizes
                .iter()
                .enumerate()
                .map(|(b, &n)| noise(n, (rank * 10 + b) as u64, 1.0 + b as f32))
                .collect()
        };
        let out = run_local_with_timeout(3, Duration::from_secs(20), |g| {
            let rank = g.rank();
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            let parsed: HookSpec = spec.parse().unwrap();
            let mut hook = parsed.build(Arc::new(CpuBackend::new()), group).unwrap();
            let xs = inputs(rank);
            // Launch every bucket before waiting for any.
            let works: Vec<_> = xs
                .iter()
                .enumerate()
                .map(|(b, x)| {
                    let layout = Arc::new(Layout::packed(&[vec![x.len()]]).unwrap());
                    hook.run(GradBucket::new(b, sizes.len(), x.clone(), layout).unwrap())
                })
                .collect();
            works
                .into_iter()
                .map(|w| w.wait().unwrap())
                .collect::<Vec<_>>()
        })
        .unwrap();
        let outs: Vec<Vec<Vec<f32>>> = out.into_iter().map(Result::unwrap).collect();
        for (b, &n) in sizes.iter().enumerate() {
            let per_rank: Vec<Vec<f32>> = (0..3).map(|r| inputs(r)[b].clone()).collect();
            let want = match spec {
                "quantize_per_tensor" => ref_per_tensor(&per_rank).0,
                "quantize_per_channel:bucket_size=16" => ref_per_channel(&per_rank, 16).0,
                // The first step of error feedback quantises x + 0: the plain hook's.
                _ => ref_per_channel(&per_rank, 512).0,
            };
            for o in &outs {
                assert_eq!(o[b].len(), n);
                assert_eq!(bits(&o[b]), bits(&want), "{spec}: bucket {b}");
            }
        }
    }
}
