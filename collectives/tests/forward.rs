//! `forward_group!`: a wrapper built with it forwards every `ProcessGroup` method it does
//! not write itself, `device_native`, `narrowed` and (feature `cuda`) the device methods
//! included, and uses the ones it writes.

use collectives::{
    forward_group, Buffer, DType, HalfWire, Narrowed, ProcessGroup, ReduceOp, Result, Work,
};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A group that answers every method at once and logs which was called; it claims a
/// device-native path, so a wrapper that drops `device_native` is seen.
#[derive(Default)]
struct Fake {
    log: Mutex<Vec<&'static str>>,
}

impl Fake {
    fn called(&self, name: &'static str) {
        self.log.lock().unwrap().push(name);
    }
    fn take(&self) -> Vec<&'static str> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

impl ProcessGroup for Fake {
    fn rank(&self) -> usize {
        self.called("rank");
        3
    }
    fn size(&self) -> usize {
        self.called("size");
        5
    }
    fn backend(&self) -> &'static str {
        self.called("backend");
        "fake"
    }
    fn timeout(&self) -> Duration {
        self.called("timeout");
        Duration::from_secs(7)
    }
    fn all_reduce(&self, buf: Buffer, _op: ReduceOp) -> Work<Buffer> {
        self.called("all_reduce");
        Work::ready(Ok(buf))
    }
    fn all_reduce_wire(&self, buf: Buffer, _wire: DType, _op: ReduceOp) -> Work<Buffer> {
        self.called("all_reduce_wire");
        Work::ready(Ok(buf))
    }
    #[cfg(feature = "cuda")]
    fn all_reduce_device(
        &self,
        buf: collectives::DeviceBuffer,
        _op: ReduceOp,
    ) -> Work<collectives::DeviceBuffer> {
        self.called("all_reduce_device");
        Work::ready(Ok(buf))
    }
    #[cfg(feature = "cuda")]
    fn broadcast_device(
        &self,
        buf: collectives::DeviceBuffer,
        _root: usize,
    ) -> Work<collectives::DeviceBuffer> {
        self.called("broadcast_device");
        Work::ready(Ok(buf))
    }
    fn device_native(&self) -> bool {
        self.called("device_native");
        true
    }
    fn narrowed(&self) -> Option<Narrowed<'_>> {
        self.called("narrowed");
        Some(Narrowed {
            wire: DType::BF16,
            inner: self,
        })
    }
    fn all_reduce_coalesced(&self, bufs: Vec<Buffer>, _op: ReduceOp) -> Work<Vec<Buffer>> {
        self.called("all_reduce_coalesced");
        Work::ready(Ok(bufs))
    }
    fn broadcast(&self, buf: Buffer, _root: usize) -> Work<Buffer> {
        self.called("broadcast");
        Work::ready(Ok(buf))
    }
    fn all_gather(&self, buf: Buffer) -> Work<Vec<Buffer>> {
        self.called("all_gather");
        Work::ready(Ok(vec![buf]))
    }
    fn reduce_scatter(&self, buf: Buffer, _op: ReduceOp) -> Work<Buffer> {
        self.called("reduce_scatter");
        Work::ready(Ok(buf))
    }
    fn barrier(&self) -> Work<()> {
        self.called("barrier");
        Work::ready(Ok(()))
    }
    fn new_group(&self, _ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        self.called("new_group");
        Ok(None)
    }
}

/// Writes `barrier` (and counts it); forwards everything else.
struct Wrapper<G> {
    inner: G,
    barriers: Mutex<usize>,
}

forward_group! {
    impl[G: ProcessGroup] ProcessGroup for Wrapper<G> {
        inner: |s| &s.inner;
        /// Counted, and not forwarded.
        fn barrier(&self) -> Work<()> {
            *self.barriers.lock().unwrap() += 1;
            Work::ready(Ok(()))
        }
    }
}

/// A wrapper without generics, holding a shared group.
struct Shared(Arc<Fake>);

forward_group! {
    impl ProcessGroup for Shared {
        inner: |s| &*s.0;
    }
}

fn wrapped() -> Wrapper<Fake> {
    Wrapper {
        inner: Fake::default(),
        barriers: Mutex::new(0),
    }
}

#[test]
fn every_host_method_is_forwarded() {
    let g = wrapped();
    let buf = Buffer::F32(vec![1.0, 2.0]);
    assert_eq!(g.rank(), 3);
    assert_eq!(g.size(), 5);
    assert_eq!(g.backend(), "fake");
    assert_eq!(g.timeout(), Duration::from_secs(7));
    assert_eq!(
        g.all_reduce(buf.clone(), ReduceOp::Sum).wait(),
        Ok(buf.clone())
    );
    assert_eq!(
        g.all_reduce_wire(buf.clone(), DType::F16, ReduceOp::Sum)
            .wait(),
        Ok(buf.clone())
    );
    assert_eq!(
        g.all_reduce_coalesced(vec![buf.clone()], ReduceOp::Sum)
            .wait(),
        Ok(vec![buf.clone()])
    );
    assert_eq!(g.broadcast(buf.clone(), 0).wait(), Ok(buf.clone()));
    assert_eq!(g.all_gather(buf.clone()).wait(), Ok(vec![buf.clone()]));
    assert_eq!(g.reduce_scatter(buf.clone(), ReduceOp::Sum).wait(), Ok(buf));
    assert!(g.new_group(&[0]).unwrap().is_none());
    assert_eq!(
        g.inner.take(),
        [
            "rank",
            "size",
            "backend",
            "timeout",
            "all_reduce",
            "all_reduce_wire",
            "all_reduce_coalesced",
            "broadcast",
            "all_gather",
            "reduce_scatter",
            "new_group",
        ]
    );
}

#[test]
fn device_native_and_narrowed_are_forwarded() {
    let g = wrapped();
    assert!(
        g.device_native(),
        "a wrapper must keep the NCCL device path"
    );
    let n = g.narrowed().expect("the inner group narrows");
    assert_eq!(n.wire, DType::BF16);
    assert_eq!(g.inner.take(), ["device_native", "narrowed"]);
    let shared = Shared(Arc::new(Fake::default()));
    assert!(shared.device_native());
    assert_eq!(shared.0.take(), ["device_native"]);
}

#[test]
fn written_methods_are_used_not_forwarded() {
    let g = wrapped();
    g.barrier().wait().unwrap();
    g.barrier().wait().unwrap();
    assert_eq!(*g.barriers.lock().unwrap(), 2);
    assert!(g.inner.take().is_empty());
}

#[test]
fn boxed_shared_and_half_wire_groups_forward() {
    let boxed: Box<dyn ProcessGroup> = Box::new(wrapped());
    assert!(boxed.device_native());
    let shared: Arc<dyn ProcessGroup> = Arc::new(wrapped());
    assert!(shared.device_native());
    assert_eq!(shared.backend(), "fake");
    // The narrowing group answers for its inner group's device path and names it.
    let half = HalfWire::<half::f16>::new(Arc::new(Fake::default()));
    assert!(half.device_native());
    let n = half.narrowed().expect("HalfWire narrows");
    assert_eq!(n.wire, DType::F16);
    assert_eq!(n.inner.backend(), "fake");
}

/// The cuda-only methods are forwarded too (they need a device buffer, so a GPU).
#[cfg(feature = "cuda")]
#[test]
fn device_methods_are_forwarded() {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library's names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("skipped: no CUDA driver");
        return;
    }
    let ctx = match cudarc::driver::CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("skipped: no CUDA device ({e:?})");
            return;
        }
    };
    let stream = ctx.default_stream();
    let g = wrapped();
    let buf = collectives::DeviceBuffer::from(stream.clone_htod(&[1.0f32, 2.0]).unwrap());
    let buf = g.all_reduce_device(buf, ReduceOp::Sum).wait().unwrap();
    let buf = g.broadcast_device(buf, 0).wait().unwrap();
    assert_eq!(buf.len(), 2);
    assert_eq!(g.inner.take(), ["all_reduce_device", "broadcast_device"]);
}
