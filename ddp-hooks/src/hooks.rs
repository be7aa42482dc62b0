//! The `CommHook` trait and the simple hooks: allreduce, fp16/bf16 compression, noop.

use crate::{CommBackend, CommElement, GradBucket};
use collectives::{ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};
use lowrank::Backend;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// A DDP communication hook: called once per bucket per synchronised step, it returns
/// at once a work that completes with the bucket's reduced gradients (the mean over the
/// ranks, or an approximation of it). Stateful hooks own their state.
pub trait CommHook<B: Backend>: Send {
    /// The hook's name, as the registry spells it.
    fn name(&self) -> String;
    /// Starts reducing `bucket`.
    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>>;
}

/// Averages the bucket exactly over the ranks (PyTorch's `allreduce_hook`, which DDP
/// without a hook also does).
pub struct AllReduce<B> {
    backend: Arc<B>,
    group: Arc<dyn ProcessGroup>,
}

impl<B: CommBackend> AllReduce<B> {
    /// The hook over `group`.
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>) -> Self {
        AllReduce { backend, group }
    }
}

impl<B: CommBackend> CommHook<B> for AllReduce<B> {
    fn name(&self) -> String {
        "allreduce".into()
    }
    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        self.backend
            .all_reduce(&*self.group, bucket.into_buffer(), ReduceOp::Avg)
    }
}

/// A 16-bit format for [`Compress`].
pub trait HalfFormat: CommElement {
    /// The registry's name of the hook (`"fp16"`, `"bf16"`).
    const HOOK: &'static str;
}

impl HalfFormat for f16 {
    const HOOK: &'static str = "fp16";
}

impl HalfFormat for bf16 {
    const HOOK: &'static str = "bf16";
}

/// Sends the bucket in a 16-bit format and averages it (PyTorch's `fp16_compress_hook`
/// and `bf16_compress_hook`): half the bytes, within that format's precision. The thread
/// backend accumulates the sum in `f32` and rounds once, so it never overflows where
/// PyTorch pre-divides to avoid that.
pub struct Compress<B: Backend, H: HalfFormat> {
    backend: Arc<B>,
    group: Arc<dyn ProcessGroup>,
    /// The 16-bit buffer of the last call, reused so steady state allocates nothing.
    spare: Arc<Mutex<Option<B::Buffer<H>>>>,
}

impl<B: CommBackend, H: HalfFormat> Compress<B, H> {
    /// The hook over `group`.
    pub fn new(backend: Arc<B>, group: Arc<dyn ProcessGroup>) -> Self {
        Compress {
            backend,
            group,
            spare: Arc::default(),
        }
    }
}

impl<B: CommBackend, H: HalfFormat> CommHook<B> for Compress<B, H> {
    fn name(&self) -> String {
        H::HOOK.into()
    }

    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        let be = self.backend.clone();
        let mut full = bucket.into_buffer();
        let len = B::buffer_len(&full);
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).take();
        let half = match spare {
            Some(h) if B::buffer_len(&h) == len => Ok(h),
            _ => be.alloc::<H>(len),
        };
        let half = half.and_then(|mut h| {
            be.cast::<f32, H>(B::view(&full, ..)?, B::view_mut(&mut h, ..)?)?;
            Ok(h)
        });
        let half = match half {
            Ok(h) => h,
            Err(e) => return Work::ready(Err(collectives::Error::Backend(e.to_string()))),
        };
        be.clone()
            .all_reduce(&*self.group, half, ReduceOp::Avg)
            .then(move |r| {
                let h = r?;
                let mut widen = || be.cast::<H, f32>(B::view(&h, ..)?, B::view_mut(&mut full, ..)?);
                widen().map_err(|e| collectives::Error::Backend(e.to_string()))?;
                Ok(full)
            })
    }
}

/// Returns the bucket unchanged, communicating nothing (PyTorch's `noop_hook`): for
/// measuring how much of a step is communication.
pub struct Noop<B>(PhantomData<fn() -> B>);

impl<B> Noop<B> {
    /// The hook.
    pub fn new() -> Self {
        Noop(PhantomData)
    }
}

impl<B> Default for Noop<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> CommHook<B> for Noop<B> {
    fn name(&self) -> String {
        "noop".into()
    }
    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        Work::ready(Ok(bucket.into_buffer()))
    }
}
