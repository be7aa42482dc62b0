//! Criterion benchmarks of every primitive of the CPU backend (hot cache; the cold-cache
//! bandwidth table is `bandwidth.rs`). Run through `cargo xtask bench lowrank`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lowrank::{bf16, f16, Backend, CpuBackend, Dims, NormalRng};
use std::hint::black_box;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

/// Shapes: one 1024 x 1024 layer, and a batch of 16 ResNet-like 256 x 2304 conv weights.
fn shapes() -> Vec<(&'static str, Dims)> {
    let mut v = Vec::new();
    for r in [1, 4, 8] {
        v.push(("1x1024x1024", Dims::new(1, 1024, 1024, r).expect("shape")));
    }
    v.push(("16x256x2304", Dims::new(16, 256, 2304, 4).expect("shape")));
    v
}

fn products(c: &mut Criterion) {
    let be = CpuBackend::new();
    let mut group = c.benchmark_group("lowrank/products");
    for (name, d) in shapes() {
        let id = |op: &str| BenchmarkId::new(op, format!("{name} r={}", d.r()));
        let (m, q, p, e) = (
            random(d.m_len(), 1),
            random(d.q_len(), 2),
            random(d.p_len(), 3),
            random(d.m_len(), 4),
        );
        let (mut po, mut qo, mut mo, mut eo) = (
            vec![0.0; d.p_len()],
            vec![0.0; d.q_len()],
            m.clone(),
            vec![0.0; d.m_len()],
        );
        group.throughput(Throughput::Bytes((d.m_len() * 4) as u64));
        group.bench_function(id("mq"), |b| b.iter(|| be.mq(d, &m, &q, &mut po)));
        group.bench_function(id("mtp"), |b| b.iter(|| be.mtp(d, &m, &p, &mut qo)));
        group.bench_function(id("pqt"), |b| b.iter(|| be.pqt(d, &p, &q, &mut mo)));
        group.bench_function(id("add_mq"), |b| {
            b.iter(|| be.add_mq(d, &mut mo, &e, &q, &mut po))
        });
        group.bench_function(id("pqt_error"), |b| {
            b.iter(|| be.pqt_error(d, &p, &q, &mut mo, &mut eo))
        });
    }
    group.finish();
}

fn orthogonalize(c: &mut Criterion) {
    let be = CpuBackend::new();
    let mut group = c.benchmark_group("lowrank/orthogonalize");
    for (batch, n, r) in [(1, 4096, 4), (1, 16384, 8), (64, 256, 4)] {
        let x = random(batch * n * r, 5);
        let mut y = x.clone();
        group.throughput(Throughput::Bytes((x.len() * 4) as u64));
        group.bench_function(
            BenchmarkId::from_parameter(format!("{batch}x{n} r={r}")),
            |b| {
                b.iter(|| {
                    y.copy_from_slice(&x);
                    be.orthogonalize(batch, n, r, &mut y, 0.0)
                })
            },
        );
    }
    group.finish();
}

fn elementwise(c: &mut Criterion) {
    let be = CpuBackend::new();
    let len = 4 << 20;
    let (x, mut y) = (random(len, 6), random(len, 7));
    let (mut h, mut b16) = (vec![f16::ZERO; len], vec![bf16::ZERO; len]);
    let mut group = c.benchmark_group("lowrank/elementwise");
    group.throughput(Throughput::Bytes((len * 4) as u64));
    group.bench_function("add 4M", |b| b.iter(|| be.add(&mut y, &x)));
    group.bench_function("scale 4M", |b| b.iter(|| be.scale(&mut y, 0.5)));
    group.bench_function("copy 4M", |b| b.iter(|| be.copy(&x, &mut y)));
    group.bench_function("cast f32->f16 4M", |b| b.iter(|| be.cast(&x, &mut h)));
    group.bench_function("cast f16->f32 4M", |b| b.iter(|| be.cast(&h, &mut y)));
    group.bench_function("cast f32->bf16 4M", |b| b.iter(|| be.cast(&x, &mut b16)));
    group.bench_function("fill_normal 4M", |b| {
        let mut rng = NormalRng::new(1);
        b.iter(|| be.fill_normal(&mut rng, black_box(&mut y)))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(1))
        .sample_size(20);
    targets = products, orthogonalize, elementwise
}
criterion_main!(benches);
