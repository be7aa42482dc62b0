//! Regression (issue 15, "overlap as documented"): PowerSGD launched the uncompressed
//! tensors' all-reduce only after computing every `P = X Q`, although its docs said the
//! all-reduce overlapped the products. A backend that records, in one log, each
//! collective it launches and each product it computes shows the order; the tests assert
//! the order, not a time. On the old code the first compressed step logged
//! `[product, product, all-reduce(U), all-reduce(P), all-reduce(Q)]`.

use collectives::link::{Charge, Link, Linked};
use collectives::{run_local, ProcessGroup, ReduceOp, Work};
use ddp_hooks::{CommBackend, CommElement, CommHook, GradBucket, Layout, PowerSgd, PowerSgdConfig};
use lowrank::{Backend, CpuBackend, Dims, Element, NormalRng};
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the recording backend saw, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    /// A collective launched, with its buffer's length.
    AllReduce(usize),
    /// One first product `P = X Q` (fused with error feedback or not).
    Product,
}

/// The CPU backend, logging every launched all-reduce and every first product.
struct Recording {
    cpu: CpuBackend,
    log: Arc<Mutex<Vec<Event>>>,
}

impl Recording {
    fn push(&self, e: Event) {
        self.log.lock().unwrap().push(e);
    }
}

impl Backend for Recording {
    type Buffer<T: Element> = Vec<T>;
    type View<'a, T: Element> = &'a [T];
    type ViewMut<'a, T: Element> = &'a mut [T];
    const HOST_RESIDENT: bool = true;

    fn name(&self) -> String {
        format!("recording {}", self.cpu.name())
    }
    fn alloc<T: Element>(&self, len: usize) -> lowrank::Result<Vec<T>> {
        self.cpu.alloc(len)
    }
    fn upload<T: Element>(&self, host: &[T]) -> lowrank::Result<Vec<T>> {
        self.cpu.upload(host)
    }
    fn download<T: Element>(&self, src: &[T], dst: &mut [T]) -> lowrank::Result<()> {
        self.cpu.download(src, dst)
    }
    fn buffer_len<T: Element>(buf: &Vec<T>) -> usize {
        CpuBackend::buffer_len(buf)
    }
    fn view<T: Element>(buf: &Vec<T>, range: impl RangeBounds<usize>) -> lowrank::Result<&[T]> {
        CpuBackend::view(buf, range)
    }
    fn view_mut<T: Element>(
        buf: &mut Vec<T>,
        range: impl RangeBounds<usize>,
    ) -> lowrank::Result<&mut [T]> {
        CpuBackend::view_mut(buf, range)
    }
    fn synchronize(&self) -> lowrank::Result<()> {
        self.cpu.synchronize()
    }
    fn mq(&self, d: Dims, m: &[f32], q: &[f32], p: &mut [f32]) -> lowrank::Result<()> {
        self.push(Event::Product);
        self.cpu.mq(d, m, q, p)
    }
    fn mtp(&self, d: Dims, m: &[f32], p: &[f32], q: &mut [f32]) -> lowrank::Result<()> {
        self.cpu.mtp(d, m, p, q)
    }
    fn pqt(&self, d: Dims, p: &[f32], q: &[f32], m: &mut [f32]) -> lowrank::Result<()> {
        self.cpu.pqt(d, p, q, m)
    }
    fn add_mq(
        &self,
        d: Dims,
        g: &mut [f32],
        e: &[f32],
        q: &[f32],
        p: &mut [f32],
    ) -> lowrank::Result<()> {
        self.push(Event::Product);
        self.cpu.add_mq(d, g, e, q, p)
    }
    fn pqt_error(
        &self,
        d: Dims,
        p: &[f32],
        q: &[f32],
        m: &mut [f32],
        e: &mut [f32],
    ) -> lowrank::Result<()> {
        self.cpu.pqt_error(d, p, q, m, e)
    }
    fn pqt_error_unflagged(
        &self,
        d: Dims,
        p: &[f32],
        q: &[f32],
        m: &mut [f32],
        e: &mut [f32],
        flag: &[f32],
    ) -> lowrank::Result<()> {
        self.cpu.pqt_error_unflagged(d, p, q, m, e, flag)
    }
    fn flag_nonfinite(&self, x: &[f32], flag: &mut [f32]) -> lowrank::Result<()> {
        self.cpu.flag_nonfinite(x, flag)
    }
    fn copy_unflagged(&self, src: &[f32], dst: &mut [f32], flag: &[f32]) -> lowrank::Result<()> {
        self.cpu.copy_unflagged(src, dst, flag)
    }
    fn orthogonalize(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        x: &mut [f32],
        eps: f32,
    ) -> lowrank::Result<()> {
        self.cpu.orthogonalize(batch, n, r, x, eps)
    }
    fn orthogonalize_refill(
        &self,
        batch: usize,
        n: usize,
        r: usize,
        x: &mut [f32],
        eps: f32,
        key: u64,
    ) -> lowrank::Result<()> {
        self.cpu.orthogonalize_refill(batch, n, r, x, eps, key)
    }
    fn add(&self, y: &mut [f32], x: &[f32]) -> lowrank::Result<()> {
        self.cpu.add(y, x)
    }
    fn scale(&self, x: &mut [f32], alpha: f32) -> lowrank::Result<()> {
        self.cpu.scale(x, alpha)
    }
    fn copy<T: Element>(&self, src: &[T], dst: &mut [T]) -> lowrank::Result<()> {
        self.cpu.copy(src, dst)
    }
    fn zero<T: Element>(&self, x: &mut [T]) -> lowrank::Result<()> {
        self.cpu.zero(x)
    }
    fn cast<S: Element, D: Element>(&self, src: &[S], dst: &mut [D]) -> lowrank::Result<()> {
        self.cpu.cast(src, dst)
    }
    fn fill_normal(&self, rng: &mut NormalRng, x: &mut [f32]) -> lowrank::Result<()> {
        self.cpu.fill_normal(rng, x)
    }
}

impl CommBackend for Recording {
    fn all_reduce<T: CommElement>(
        &self,
        pg: &dyn ProcessGroup,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        self.push(Event::AllReduce(buf.len()));
        self.cpu.all_reduce(pg, buf, op)
    }
}

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0.0; len];
    NormalRng::new(seed).fill(&mut v);
    v
}

fn config(rank: usize) -> PowerSgdConfig {
    PowerSgdConfig {
        matrix_approximation_rank: rank,
        start_powersgd_iter: 2,
        ..PowerSgdConfig::default()
    }
}

/// One bucket per step, waited for, over a link that sleeps (so the uncompressed
/// all-reduce really is in flight while the products run): every compressed step logs
/// the uncompressed all-reduce first, then both products, then `P` and `Q`.
#[test]
fn the_uncompressed_all_reduce_is_launched_before_the_products() {
    // Two compressed matrices, a bias and a matrix too small to compress.
    let layout =
        Arc::new(Layout::packed(&[vec![32, 48], vec![32], vec![24, 40], vec![3, 2]]).unwrap());
    let (u, p, q) = (32 + 6, (32 + 24) * 2, (48 + 40) * 2);
    let out = run_local(2, |g| {
        let rank = g.rank();
        let log = Arc::new(Mutex::new(Vec::new()));
        let be = Arc::new(Recording {
            cpu: CpuBackend::new().with_threads(1).unwrap(),
            log: log.clone(),
        });
        let link = Link::gbit(10.0, Duration::from_millis(2)).unwrap();
        let group = Arc::new(Linked::new(g, link, Charge::Sleep));
        let mut hook = PowerSgd::new(be, group, config(2)).unwrap();
        let mut steps = Vec::new();
        for s in 0..4 {
            let b = GradBucket::new(
                0,
                1,
                random(layout.len(), (rank * 10 + s) as u64),
                layout.clone(),
            )
            .unwrap();
            hook.run(b).wait().unwrap();
            steps.push(std::mem::take(&mut *log.lock().unwrap()));
        }
        steps
    })
    .unwrap();
    for (rank, steps) in out.into_iter().enumerate() {
        let steps = steps.unwrap();
        for (s, events) in steps.iter().enumerate() {
            let want = if s < 2 {
                vec![Event::AllReduce(layout.len())]
            } else {
                vec![
                    Event::AllReduce(u),
                    Event::Product,
                    Event::Product,
                    Event::AllReduce(p),
                    Event::AllReduce(q),
                ]
            };
            assert_eq!(events, &want, "rank {rank}, step {s}");
        }
    }
}

/// Several buckets in flight at once (launched without waiting): every rank launches the
/// collectives in the same order (`U0 P0 Q0 U1 P1 Q1 ...`); the first bucket, whose turn
/// has come, launches its uncompressed all-reduce before its products; every bucket
/// launches its uncompressed all-reduce before its `P`, and `P` only after its product.
#[test]
fn buckets_in_flight_keep_one_order_and_the_first_overlaps() {
    // Bucket k: a (16 + 8k) x 20 matrix (P: 16 + 8k at rank 1, Q: 20) and a bias of
    // 5 + k: every launch names its bucket by its length.
    let layouts: Vec<Arc<Layout>> = (0..3)
        .map(|k| Arc::new(Layout::packed(&[vec![16 + 8 * k, 20], vec![5 + k]]).unwrap()))
        .collect();
    let out = run_local(2, |g| {
        let rank = g.rank();
        let log = Arc::new(Mutex::new(Vec::new()));
        let be = Arc::new(Recording {
            cpu: CpuBackend::new().with_threads(1).unwrap(),
            log: log.clone(),
        });
        let mut hook = PowerSgd::new(be, Arc::new(g), config(1)).unwrap();
        let mut logs = Vec::new();
        for s in 0..4u64 {
            let works: Vec<_> = layouts
                .iter()
                .enumerate()
                .map(|(k, l)| {
                    let grad = random(l.len(), s * 100 + (rank * 10 + k) as u64);
                    hook.run(GradBucket::new(k, 3, grad, l.clone()).unwrap())
                })
                .collect();
            for w in works {
                w.wait().unwrap();
            }
            logs.push(std::mem::take(&mut *log.lock().unwrap()));
        }
        logs
    })
    .unwrap();
    for (rank, logs) in out.into_iter().enumerate() {
        for (s, events) in logs.unwrap().into_iter().enumerate().skip(2) {
            let launches: Vec<usize> = events
                .iter()
                .filter_map(|e| match e {
                    Event::AllReduce(n) => Some(*n),
                    Event::Product => None,
                })
                .collect();
            assert_eq!(
                launches,
                vec![5, 16, 20, 6, 24, 20, 7, 32, 20],
                "rank {rank}, step {s}: {events:?}"
            );
            assert_eq!(
                &events[..2],
                &[Event::AllReduce(5), Event::Product],
                "rank {rank}, step {s}: bucket 0's uncompressed all-reduce goes first: {events:?}"
            );
            // Bucket k's product precedes its P: the k-th product comes before the
            // launch of P_k.
            let products: Vec<usize> = (0..events.len())
                .filter(|&i| events[i] == Event::Product)
                .collect();
            for (k, p_len) in [16, 24, 32].into_iter().enumerate() {
                let p_at = events
                    .iter()
                    .position(|e| *e == Event::AllReduce(p_len))
                    .unwrap();
                assert!(products[k] < p_at, "rank {rank}, step {s}: {events:?}");
            }
        }
    }
}
