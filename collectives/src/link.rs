//! A link model for benchmarks: charges each operation the time a network of a given
//! bandwidth and latency would take.
//!
//! Most users compress gradients because their network is slow, so benchmark step times
//! must be reported at realistic link speeds. [`Linked`] wraps any [`ProcessGroup`] and
//! charges every collective its ring-algorithm cost (the formulas of nccl-tests), either
//! by sleeping on the rank's progress thread after the real operation
//! ([`Charge::Sleep`], so overlap with compute is real) or by adding it to a counter
//! ([`Charge::Account`], so a benchmark adds it to measured compute time). Which one ran
//! is part of what a benchmark must report.

use crate::{Buffer, DType, Error, ProcessGroup, ReduceOp, Result, Work};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A network link: bandwidth per direction and per-message latency.
#[derive(Clone, Copy, Debug, PartialEq)]
///
/// The fields are private: a `Link` has a finite, positive bandwidth, so every cost is a
/// finite duration.
pub struct Link {
    bytes_per_s: f64,
    latency: Duration,
}

impl Link {
    /// A link of `gbit` Gbit/s with `latency`. The bandwidth must be finite and positive
    /// (zero would make every cost infinite, NaN or a negative one would make it free):
    /// anything else is [`Error::InvalidArgument`].
    pub fn gbit(gbit: f64, latency: Duration) -> Result<Link> {
        if !(gbit.is_finite() && gbit > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "a link needs a finite, positive bandwidth in Gbit/s, got {gbit}"
            )));
        }
        Ok(Link {
            bytes_per_s: gbit * 1e9 / 8.0,
            latency,
        })
    }

    /// Bytes per second, per direction.
    pub fn bytes_per_s(&self) -> f64 {
        self.bytes_per_s
    }

    /// Latency of one message.
    pub fn latency(&self) -> Duration {
        self.latency
    }

    fn time(&self, bytes: f64, messages: f64) -> Duration {
        // Finite for any finite sizes (the bandwidth is positive); saturates rather than
        // panics for absurd ones.
        let secs = (bytes / self.bytes_per_s + messages * self.latency.as_secs_f64()).max(0.0);
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
    }

    /// Ring all-reduce of `bytes` per rank on `n` ranks:
    /// `2(n-1)/n · bytes / bandwidth + 2(n-1) · latency`.
    pub fn all_reduce(&self, n: usize, bytes: usize) -> Duration {
        let k = n.saturating_sub(1) as f64;
        if n <= 1 {
            return Duration::ZERO;
        }
        self.time(2.0 * k / n as f64 * bytes as f64, 2.0 * k)
    }

    /// Ring all-gather of `bytes` per rank (output `n · bytes`):
    /// `(n-1) · bytes / bandwidth + (n-1) · latency`.
    pub fn all_gather(&self, n: usize, bytes: usize) -> Duration {
        let k = n.saturating_sub(1) as f64;
        self.time(k * bytes as f64, k)
    }

    /// Ring reduce-scatter of an input of `bytes` per rank:
    /// `(n-1)/n · bytes / bandwidth + (n-1) · latency`.
    pub fn reduce_scatter(&self, n: usize, bytes: usize) -> Duration {
        let k = n.saturating_sub(1) as f64;
        if n <= 1 {
            return Duration::ZERO;
        }
        self.time(k / n as f64 * bytes as f64, k)
    }

    /// Pipelined broadcast of `bytes`: `bytes / bandwidth + (n-1) · latency`.
    pub fn broadcast(&self, n: usize, bytes: usize) -> Duration {
        if n <= 1 {
            return Duration::ZERO;
        }
        self.time(bytes as f64, n as f64 - 1.0)
    }

    /// A barrier: an all-reduce of nothing, `2(n-1) · latency`.
    pub fn barrier(&self, n: usize) -> Duration {
        self.all_reduce(n, 0)
    }
}

/// How a [`Linked`] group charges the modelled time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charge {
    /// Sleep on the rank's progress thread after the real operation.
    Sleep,
    /// Only add to [`Linked::charged`].
    Account,
}

/// The kind and payload of one operation, as [`Linked`] records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkOp {
    /// All-reduce (also coalesced) of this many bytes per rank.
    AllReduce(usize),
    /// All-gather of this many bytes per rank.
    AllGather(usize),
    /// Reduce-scatter of an input of this many bytes per rank.
    ReduceScatter(usize),
    /// Broadcast of this many bytes.
    Broadcast(usize),
    /// Barrier.
    Barrier,
    /// A point-to-point send of this many bytes: latency plus bytes over the bandwidth.
    Send(usize),
    /// A point-to-point receive of this many bytes: charged as its send is (the data
    /// arrives that long after it left), and sends nothing.
    Recv(usize),
}

impl Link {
    /// The cost of `op` on `n` ranks.
    pub fn cost(&self, n: usize, op: LinkOp) -> Duration {
        match op {
            LinkOp::AllReduce(b) => self.all_reduce(n, b),
            LinkOp::AllGather(b) => self.all_gather(n, b),
            LinkOp::ReduceScatter(b) => self.reduce_scatter(n, b),
            LinkOp::Broadcast(b) => self.broadcast(n, b),
            LinkOp::Barrier => self.barrier(n),
            LinkOp::Send(b) | LinkOp::Recv(b) => self.time(b as f64, 1.0),
        }
    }
}

impl LinkOp {
    /// Payload bytes this rank sends into the operation.
    pub fn bytes(&self) -> usize {
        match *self {
            LinkOp::AllReduce(b)
            | LinkOp::AllGather(b)
            | LinkOp::ReduceScatter(b)
            | LinkOp::Broadcast(b)
            | LinkOp::Send(b) => b,
            LinkOp::Barrier | LinkOp::Recv(_) => 0,
        }
    }
}

/// A process group whose operations also cost what `link` would charge. It records
/// every operation ([`Linked::take_log`]), so a benchmark can price the same run at
/// several link speeds.
pub struct Linked<G> {
    inner: G,
    link: Link,
    charge: Charge,
    charged_ns: Arc<AtomicU64>,
    log: Arc<std::sync::Mutex<Vec<LinkOp>>>,
}

impl<G: ProcessGroup> Linked<G> {
    /// Wraps `inner`.
    pub fn new(inner: G, link: Link, charge: Charge) -> Self {
        Linked {
            inner,
            link,
            charge,
            charged_ns: Arc::new(AtomicU64::new(0)),
            log: Arc::default(),
        }
    }

    /// Returns and clears the operations recorded so far.
    pub fn take_log(&self) -> Vec<LinkOp> {
        std::mem::take(&mut *self.log.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A handle to the operation log that outlives the group (for groups moved into a
    /// hook).
    pub fn log_handle(&self) -> Arc<std::sync::Mutex<Vec<LinkOp>>> {
        self.log.clone()
    }

    /// The modelled link time charged so far (in both modes).
    pub fn charged(&self) -> Duration {
        Duration::from_nanos(self.charged_ns.load(Ordering::Relaxed))
    }

    /// The link.
    pub fn link(&self) -> Link {
        self.link
    }

    /// The wrapped group.
    pub fn inner(&self) -> &G {
        &self.inner
    }

    fn charge<T: Send + 'static>(&self, work: Work<T>, op: LinkOp) -> Work<T> {
        let cost = self.link.cost(self.inner.size(), op);
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(op);
        self.charged_ns
            .fetch_add(cost.as_nanos() as u64, Ordering::Relaxed);
        match self.charge {
            Charge::Account => work,
            Charge::Sleep => work.then(move |r| {
                std::thread::sleep(cost);
                r
            }),
        }
    }
}

fn bytes(b: &Buffer) -> usize {
    b.len() * b.dtype().size()
}

crate::forward_group! {
    impl[G: ProcessGroup] ProcessGroup for Linked<G> {
        inner: |s| &s.inner;
        fn all_reduce(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
            let rec = LinkOp::AllReduce(bytes(&buf));
            self.charge(self.inner.all_reduce(buf, op), rec)
        }
        fn all_reduce_wire(&self, buf: Buffer, wire: DType, op: ReduceOp) -> Work<Buffer> {
            // Charged at the wire's size: that is what a network would carry.
            let rec = LinkOp::AllReduce(buf.len() * wire.size());
            self.charge(self.inner.all_reduce_wire(buf, wire, op), rec)
        }
        fn all_reduce_coalesced(&self, bufs: Vec<Buffer>, op: ReduceOp) -> Work<Vec<Buffer>> {
            let rec = LinkOp::AllReduce(bufs.iter().map(bytes).sum());
            self.charge(self.inner.all_reduce_coalesced(bufs, op), rec)
        }
        #[cfg(feature = "cuda")]
        fn all_reduce_device(
            &self,
            buf: crate::DeviceBuffer,
            op: ReduceOp,
        ) -> Work<crate::DeviceBuffer> {
            let rec = LinkOp::AllReduce(buf.len() * buf.dtype().size());
            self.charge(self.inner.all_reduce_device(buf, op), rec)
        }
        #[cfg(feature = "cuda")]
        fn broadcast_device(
            &self,
            buf: crate::DeviceBuffer,
            root: usize,
        ) -> Work<crate::DeviceBuffer> {
            let rec = LinkOp::Broadcast(buf.len() * buf.dtype().size());
            self.charge(self.inner.broadcast_device(buf, root), rec)
        }
        #[cfg(feature = "cuda")]
        fn send_device(
            &self,
            buf: crate::DeviceBuffer,
            dst: usize,
            tag: u32,
        ) -> Work<crate::DeviceBuffer> {
            let rec = LinkOp::Send(buf.len() * buf.dtype().size());
            self.charge(self.inner.send_device(buf, dst, tag), rec)
        }
        #[cfg(feature = "cuda")]
        fn recv_device(
            &self,
            buf: crate::DeviceBuffer,
            src: usize,
            tag: u32,
        ) -> Work<crate::DeviceBuffer> {
            let rec = LinkOp::Recv(buf.len() * buf.dtype().size());
            self.charge(self.inner.recv_device(buf, src, tag), rec)
        }
        #[cfg(feature = "cuda")]
        fn batch_isend_irecv_device(
            &self,
            ops: Vec<crate::P2pOp<crate::DeviceBuffer>>,
        ) -> Vec<Work<crate::DeviceBuffer>> {
            let recs: Vec<LinkOp> = ops
                .iter()
                .map(|op| match op {
                    crate::P2pOp::Send { buf, .. } => LinkOp::Send(buf.len() * buf.dtype().size()),
                    crate::P2pOp::Recv { buf, .. } => LinkOp::Recv(buf.len() * buf.dtype().size()),
                })
                .collect();
            self.inner
                .batch_isend_irecv_device(ops)
                .into_iter()
                .zip(recs)
                .map(|(w, rec)| self.charge(w, rec))
                .collect()
        }
        /// `None`: a caller that narrowed on the device would hand the inner group's
        /// inner group the buffer, past this group's charge and log.
        fn narrowed(&self) -> Option<crate::Narrowed<'_>> {
            None
        }
        fn broadcast(&self, buf: Buffer, root: usize) -> Work<Buffer> {
            let rec = LinkOp::Broadcast(bytes(&buf));
            self.charge(self.inner.broadcast(buf, root), rec)
        }
        fn all_gather(&self, buf: Buffer) -> Work<Vec<Buffer>> {
            let rec = LinkOp::AllGather(bytes(&buf));
            self.charge(self.inner.all_gather(buf), rec)
        }
        fn reduce_scatter(&self, buf: Buffer, op: ReduceOp) -> Work<Buffer> {
            let rec = LinkOp::ReduceScatter(bytes(&buf));
            self.charge(self.inner.reduce_scatter(buf, op), rec)
        }
        fn barrier(&self) -> Work<()> {
            self.charge(self.inner.barrier(), LinkOp::Barrier)
        }
        fn send(&self, buf: Buffer, dst: usize, tag: u32) -> Work<Buffer> {
            let rec = LinkOp::Send(bytes(&buf));
            self.charge(self.inner.send(buf, dst, tag), rec)
        }
        fn recv(&self, buf: Buffer, src: usize, tag: u32) -> Work<Buffer> {
            let rec = LinkOp::Recv(bytes(&buf));
            self.charge(self.inner.recv(buf, src, tag), rec)
        }
        /// The inner group's batch (NCCL must group it), each work charged as a send or
        /// receive of its buffer.
        fn batch_isend_irecv(&self, ops: Vec<crate::P2pOp>) -> Vec<Work<Buffer>> {
            let recs: Vec<LinkOp> = ops
                .iter()
                .map(|op| match op {
                    crate::P2pOp::Send { buf, .. } => LinkOp::Send(bytes(buf)),
                    crate::P2pOp::Recv { buf, .. } => LinkOp::Recv(bytes(buf)),
                })
                .collect();
            self.inner
                .batch_isend_irecv(ops)
                .into_iter()
                .zip(recs)
                .map(|(w, rec)| self.charge(w, rec))
                .collect()
        }
        // The composed collectives run over this group's own operations, so that each of
        // their messages is charged (the inner group's would bypass the link).
        fn reduce(&self, buf: Buffer, root: usize, op: ReduceOp) -> Work<Buffer> {
            crate::compose::reduce(self, buf, root, op)
        }
        fn gather(&self, buf: Buffer, root: usize) -> Work<Vec<Buffer>> {
            crate::compose::gather(self, buf, root)
        }
        fn scatter(&self, chunks: Vec<Buffer>, out: Buffer, root: usize) -> Work<Buffer> {
            crate::compose::scatter(self, chunks, out, root)
        }
        fn all_to_all(&self, buf: Buffer) -> Work<Buffer> {
            crate::compose::all_to_all(self, buf)
        }
        fn all_to_all_split(
            &self,
            buf: Buffer,
            send_counts: Vec<usize>,
            recv_counts: Vec<usize>,
        ) -> Work<Buffer> {
            crate::compose::all_to_all_split(self, buf, send_counts, recv_counts)
        }
        fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
            // Subgroups inherit the link; their charges are accounted separately.
            Ok(self.inner.new_group(ranks)?.map(|g| {
                Box::new(Linked {
                    inner: g,
                    link: self.link,
                    charge: self.charge,
                    charged_ns: Arc::new(AtomicU64::new(0)),
                    log: Arc::default(),
                }) as Box<dyn ProcessGroup>
            }))
        }
    }
}

// A boxed or shared group is a group: every operation goes to the group inside (so a
// `Linked` can wrap one group shared by several hooks, each with its own log).
crate::forward_group! {
    impl ProcessGroup for Box<dyn ProcessGroup> {
        inner: |s| &**s;
    }
}
crate::forward_group! {
    impl ProcessGroup for Arc<dyn ProcessGroup> {
        inner: |s| &**s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_local;

    /// Regression: `gbit(0.0, ..)` gave costs that panicked
    /// (`Duration::from_secs_f64(inf)`), and NaN or negative bandwidths cost nothing.
    #[test]
    fn bad_bandwidths_are_errors() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(
                matches!(
                    Link::gbit(bad, Duration::ZERO),
                    Err(Error::InvalidArgument(_))
                ),
                "{bad}"
            );
        }
        let slow = Link::gbit(1e-300, Duration::MAX).unwrap();
        assert_eq!(slow.all_reduce(4, usize::MAX), Duration::MAX);
    }

    #[test]
    fn ring_costs() {
        let l = Link::gbit(8.0, Duration::from_micros(10)).unwrap(); // 1 GB/s
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        // 2 ranks, 1 MB: 2·1/2·1e6 B / 1e9 B/s = 1 ms, plus 2 messages of 10 us.
        assert!((ms(l.all_reduce(2, 1_000_000)) - 1.02).abs() < 1e-9);
        assert!((ms(l.all_reduce(4, 1_000_000)) - (1.5 + 0.06)).abs() < 1e-9);
        assert!((ms(l.all_gather(4, 1_000_000)) - (3.0 + 0.03)).abs() < 1e-9);
        assert!((ms(l.reduce_scatter(4, 1_000_000)) - (0.75 + 0.03)).abs() < 1e-9);
        assert!((ms(l.broadcast(4, 1_000_000)) - (1.0 + 0.03)).abs() < 1e-9);
        assert_eq!(l.all_reduce(1, 1_000_000), Duration::ZERO);
    }

    #[test]
    fn linked_groups_charge_and_still_reduce() {
        let link = Link::gbit(1.0, Duration::from_micros(50)).unwrap();
        let out = run_local(2, |g| {
            let g = Linked::new(g, link, Charge::Sleep);
            let t = std::time::Instant::now();
            let b = g
                .all_reduce(Buffer::F32(vec![1.0; 25_000]), ReduceOp::Sum)
                .wait()
                .unwrap();
            let took = t.elapsed();
            (b, took, g.charged(), g.take_log())
        })
        .unwrap();
        for r in out {
            let (b, took, charged, log) = r.unwrap();
            assert_eq!(b, Buffer::F32(vec![2.0; 25_000]));
            // 100 kB over 1 Gbit/s: 0.8 ms + 0.1 ms latency.
            assert_eq!(charged, link.all_reduce(2, 100_000));
            assert!(
                took >= charged,
                "sleep mode waits for the link: {took:?} < {charged:?}"
            );
            assert_eq!(log, vec![LinkOp::AllReduce(100_000)]);
        }
    }
}
