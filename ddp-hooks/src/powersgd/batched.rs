//! Batched PowerSGD (PyTorch's `batched_powerSGD_hook`): the whole bucket as one square
//! matrix, zero-padded to `side x side` with `side = ceil(sqrt(len))`.
//!
//! Much cheaper than per-layer PowerSGD (two small collectives per bucket, one pair of
//! products), at a large cost in accuracy unless the rank is 1, because concatenating
//! unrelated tensors destroys their low-rank structure. PyTorch's version fails its own
//! 3-D assertion on the first compressed step; this one works and is tested there.
//! Error feedback covers the padded matrix, as in PyTorch (so the pad carries error).
//! Without warm start the factor buffers are kept and `Q` is re-drawn each step.
//!
//! A failed step (a collective, or a kernel between two collectives) fails alone, as in
//! the per-layer hook ([`super::PowerSgd`]): the step works on its own padded matrix, `P`
//! and `Q`, and changes the bucket's memories (error, `P`, `Q`) only once both
//! collectives have succeeded, so they stay as they were before the step, the next step
//! works and the state saves and loads. Its statistics are counted and, at the bucket's
//! first compressed step or without warm start, its random draw of `Q` is consumed (the
//! drawn `Q` stays in the memory, and the next step starts from it or redraws); its
//! iteration is not counted. A step refused before it communicates (a changed length or
//! layout, an allocation or kernel failure) counts no statistics, as in the per-layer
//! hook.
//!
//! A step whose reduced `P̂` or `Q` holds a NaN or an infinity is held as in the per-layer
//! hook: its output is non-finite (for the loss scaler), the error, `P` and `Q` stay as
//! before it, decided on the device from a flag, and it is counted in
//! [`CompressionStats::nonfinite_steps`].
//!
//! **The memory belongs to one layout.** Its sizes depend only on the bucket's length,
//! but its values are positional: the error at element `i` (and the rows of `P`) belong
//! to whichever parameter lies at element `i`. So, as for the per-layer hook
//! ([`SavedBucket`]), a bucket whose parameter shapes differ from those its memory was
//! built for (recorded in [`SavedBucket::layout`]) is refused at its step with
//! [`Error::Bucket`] naming both layouts, even at the same length (with error feedback or
//! warm start; without both nothing kept depends on the layout); same-shape parameters
//! that trade places are not detected, and a state saved without a recorded layout is
//! checked for its length only.

use super::config::PowerSgdConfig;
use super::core::{comm_hook, zeroed, Core, Lease, Memory};
use super::plan::{layout_mismatch, same_layout, shapes_of};
use super::progress::refill_key;
use super::state::{PowerSgdState, SavedBucket};
use crate::{CommBackend, CompressionStats, Error, GradBucket, Result};
use collectives::{ProcessGroup, ReduceOp, Work};
use lowrank::{Backend, Dims};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// One bucket's memory: its error and the factors as the last completed step left them,
/// and the buffers a step works in.
struct BatchedMemory<B: Backend> {
    len: usize,
    /// The parameter shapes of the layout the memory was built for; `None` after loading
    /// a state saved without them, until the next step records the layout it meets.
    layout: Option<Vec<Vec<usize>>>,
    error: Option<B::Buffer<f32>>,
    p: B::Buffer<f32>,
    q: B::Buffer<f32>,
    /// The padded matrix, kept from step to step (absent while a step is in flight, and
    /// after a failed step lost it: reallocated then).
    padded: Option<B::Buffer<f32>>,
    /// The step's own `P` and `Q`, the buffers it all-reduces, copied into `p` and `q`
    /// when it succeeds with finite values; kept like `padded`.
    work: Option<(B::Buffer<f32>, B::Buffer<f32>)>,
    /// The step's non-finite flag (one element; see the per-layer hook's), kept like
    /// `padded`.
    flag: Option<B::Buffer<f32>>,
}

impl<B: Backend + 'static> Memory<B> for BatchedMemory<B> {
    /// Nothing to drop: without warm start `Q` is redrawn into the memory by every step.
    fn after_failure(&mut self, _config: &PowerSgdConfig) {}

    fn save(&self, be: &B, _index: usize) -> Result<Option<SavedBucket>> {
        let host = |b: &B::Buffer<f32>| -> Result<Vec<f32>> {
            let mut v = vec![0.0; B::buffer_len(b)];
            be.download(B::view(b, ..)?, &mut v)?;
            Ok(v)
        };
        Ok(Some(SavedBucket {
            len: self.len,
            layout: self.layout.clone(),
            error: match &self.error {
                Some(e) => host(e)?,
                None => Vec::new(),
            },
            p: host(&self.p)?,
            q: host(&self.q)?,
        }))
    }

    fn keep_flag(&mut self, flag: B::Buffer<f32>) {
        self.flag = Some(flag);
    }
}

/// The batched PowerSGD hook. Same configuration and statistics as [`super::PowerSgd`];
/// `batch_tensors_with_same_shape` and `min_compression_rate` do not apply.
pub struct BatchedPowerSgd<B: CommBackend> {
    core: Core<B, BatchedMemory<B>>,
}

/// `side = ceil(sqrt(len))`, exactly, for every `len` (squares in `u128`: a saved state
/// may claim any length).
fn side_of(len: usize) -> usize {
    let square = |s: usize| (s as u128) * (s as u128);
    let mut s = (len as f64).sqrt() as usize;
    while square(s) < len as u128 {
        s += 1;
    }
    while s > 0 && square(s - 1) >= len as u128 {
        s -= 1;
    }
    s
}

impl<B: CommBackend> BatchedPowerSgd<B> {
    /// The name in hook specs and [`CommHook::name`](crate::CommHook::name).
    const SPEC_NAME: &'static str = "batched_powersgd";

    /// A hook with `config` (validated) over `group`.
    pub fn new(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        config: PowerSgdConfig,
    ) -> Result<Self> {
        config.validate()?;
        Ok(BatchedPowerSgd {
            core: Core::new(backend, group, config),
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> PowerSgdConfig {
        self.core.config()
    }

    /// Synchronised steps seen so far.
    pub fn iteration(&self) -> u64 {
        self.core.iteration()
    }

    /// The statistics as PyTorch counts them for the batched hook: the bucket length
    /// before, `2 · side · rank` (the unclamped rank) after; held steps (non-finite
    /// values) are counted as by the per-layer hook.
    pub fn compression_stats(&self) -> CompressionStats {
        self.core.compression_stats()
    }

    /// A hook that continues from `state` (saved by [`BatchedPowerSgd::save`]) over
    /// `group`, which may differ from the group it was saved with. The state is checked
    /// first: a NaN or an infinity is [`Error::NonFinite`]; memories whose sizes do not
    /// fit their bucket's padded matrix, or a recorded layout ([`SavedBucket::layout`])
    /// whose parameters do not add up to the bucket's length, are [`Error::State`]. A
    /// bucket's memory then applies only to the layout it was recorded with: its next
    /// step with other parameter shapes, even at the same length, is [`Error::Bucket`].
    pub fn load(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        state: PowerSgdState,
    ) -> Result<Self> {
        let hook = BatchedPowerSgd::new(backend, group, state.config.clone())?;
        hook.restore(state)?;
        Ok(hook)
    }

    /// Replaces this hook's state with `state` (same configuration, except perhaps
    /// `batch_tensors_with_same_shape`, which does not apply here and which the hook
    /// keeps), checked and uploaded before anything changes, so a failure leaves the hook
    /// as it was.
    fn restore(&self, state: PowerSgdState) -> Result<()> {
        self.core.restore(state, |be, config, state| {
            let mut memory = BTreeMap::new();
            for (&index, saved) in &state.buckets {
                check_saved(config, index, saved)?;
                let side = side_of(saved.len);
                let error = if config.use_error_feedback {
                    Some(be.upload(&saved.error)?)
                } else {
                    None
                };
                let padded = be.try_alloc(side.saturating_mul(side))?;
                memory.insert(
                    index,
                    BatchedMemory {
                        len: saved.len,
                        layout: saved.layout.clone(),
                        error,
                        p: be.upload(&saved.p)?,
                        q: be.upload(&saved.q)?,
                        padded: Some(padded),
                        work: None,
                        flag: None,
                    },
                );
            }
            Ok(memory)
        })
    }

    /// The whole state except the process group (same format as [`super::PowerSgd`]'s).
    /// A memory holding a NaN or an infinity is [`Error::NonFinite`]. A step still in
    /// flight is [`Error::Bucket`]; after a failed step (its work has returned the error)
    /// the memories save as they were before that step.
    pub fn save(&self) -> Result<PowerSgdState> {
        self.core.save()
    }

    /// Starts one bucket's reduction; errors here mean nothing was communicated (and the
    /// bucket's memory is as it was: the lease puts it back).
    ///
    /// A bucket with memory whose length, or at the same length whose parameter shapes,
    /// differ from those the memory was built for is [`Error::Bucket`] (the shapes only
    /// with error feedback or warm start: without both, nothing kept depends on them). The
    /// statistics are counted once everything that can fail before the collectives has
    /// succeeded, so a refused step counts nothing.
    ///
    /// The step works on its own padded matrix, `P` and `Q` (the memory's `Q` is copied,
    /// then orthogonalised); the bucket's memories change only in the step's last
    /// continuation, once both collectives have succeeded, and that continuation ends the
    /// lease either way (see the module's documentation).
    fn start(&self, bucket: GradBucket<B>) -> Result<Work<B::Buffer<f32>>> {
        let bucket = match self.core.vanilla(bucket) {
            Ok(work) => return Ok(work),
            Err(bucket) => bucket,
        };
        let (index, is_last) = (bucket.index(), bucket.is_last());
        let layout = bucket.layout().clone();
        let x = bucket.into_buffer();
        let len = B::buffer_len(&x);
        let (mut lease, cfg, iter) = self.core.lease(index, is_last)?;
        let be = self.core.backend.clone();
        let (side, r) = (side_of(len), cfg.matrix_approximation_rank);
        let dims = Dims::new(1, side, side, r)?;
        if let Some(m) = lease.memory_mut() {
            if m.len != len {
                return Err(Error::Bucket {
                    index,
                    why: format!("the bucket length changed (was {}, now {len}): the PowerSGD state cannot be applied", m.len),
                });
            }
            // Without error feedback and warm start nothing kept depends on the layout
            // (`Q` is redrawn each step).
            let keeps = cfg.use_error_feedback || cfg.warm_start;
            match &m.layout {
                Some(shapes) if same_layout(shapes, &layout) => {}
                Some(shapes) if keeps => {
                    return Err(Error::Bucket {
                        index,
                        why: format!(
                            "{}: the PowerSGD state cannot be applied",
                            layout_mismatch(shapes, &layout)
                        ),
                    });
                }
                // Loaded without a recorded layout, or nothing kept depends on it: the
                // memory is this layout's from now.
                _ => m.layout = Some(shapes_of(&layout)),
            }
        }
        let randomize = !cfg.warm_start || lease.memory().is_none();
        let m = match lease.memory_mut() {
            Some(m) => m,
            None => {
                let error = if cfg.use_error_feedback {
                    Some(zeroed(&*be, side * side)?)
                } else {
                    None
                };
                lease.set_memory(BatchedMemory {
                    len,
                    layout: Some(shapes_of(&layout)),
                    error,
                    p: be.alloc(side * r)?,
                    q: be.alloc(side * r)?,
                    padded: Some(be.alloc(side * side)?),
                    work: None,
                    flag: None,
                })
            }
        };
        let mut xp = match m.padded.take() {
            Some(b) if B::buffer_len(&b) == side * side => b,
            _ => be.try_alloc(side * side)?,
        };
        let (mut p, mut q) = match m.work.take() {
            Some((p, q)) if B::buffer_len(&p) == side * r && B::buffer_len(&q) == side * r => {
                (p, q)
            }
            _ => (be.try_alloc(side * r)?, be.try_alloc(side * r)?),
        };
        let mut flag = match m.flag.take() {
            Some(f) => f,
            None => be.try_alloc(1)?,
        };
        be.zero(B::view_mut(&mut flag, ..)?)?;
        be.copy(B::view(&x, ..)?, B::view_mut(&mut xp, ..len)?)?;
        be.zero(B::view_mut(&mut xp, len..)?)?;
        if randomize {
            // Into the memory (a failed step leaves the drawn `Q` there), under the
            // hook's lock, in the order the buckets start.
            let mut rng = self.core.lock();
            be.fill_normal(&mut rng.progress.rng, B::view_mut(&mut m.q, ..)?)?;
        }
        be.copy(B::view(&m.q, ..)?, B::view_mut(&mut q, ..)?)?;
        // PyTorch orthogonalises Q here without epsilon. A zero column would stay zero
        // under warm start: refilled inside the orthogonalisation (see `refill_key`).
        let key = refill_key(cfg.random_seed, index, iter);
        be.orthogonalize_refill(1, side, r, B::view_mut(&mut q, ..)?, 0.0, key)?;
        match &m.error {
            Some(e) => be.add_mq(
                dims,
                B::view_mut(&mut xp, ..)?,
                B::view(e, ..)?,
                B::view(&q, ..)?,
                B::view_mut(&mut p, ..)?,
            )?,
            None => be.mq(
                dims,
                B::view(&xp, ..)?,
                B::view(&q, ..)?,
                B::view_mut(&mut p, ..)?,
            )?,
        }
        // Counted only now that nothing before the collectives can fail (PyTorch counts
        // before communicating; a refused step counts nothing). Nothing below returns
        // early: from here a failure is a failed step.
        lease.issue(len as u64, (2 * side * r) as u64);
        let held: Held<B> = Arc::new(Mutex::new(Some(lease)));
        let step = Step { p, q, xp, flag };
        Ok(self.issue(index, len, dims, step, x, held))
    }

    /// The bucket's two collectives, in the order they run, issued in one order on every
    /// rank (see `sequence.rs`): `P` (summed), then `Q = Xᵀ P̂` and its mean, then
    /// decompression. The last continuation runs whether the step succeeded or not, and
    /// ends the lease either way before the caller sees the result.
    fn issue(
        &self,
        index: usize,
        len: usize,
        dims: Dims,
        step: Step<B>,
        x: B::Buffer<f32>,
        held: Held<B>,
    ) -> Work<B::Buffer<f32>> {
        let (be, group) = (self.core.backend.clone(), self.core.group.clone());
        let (side, r) = (dims.n(), dims.r());
        self.core.sequence.next(move |issued| {
            let Step { p, q, xp, flag } = step;
            let be1 = be.clone();
            let chain = be.all_reduce(&*group, p, ReduceOp::Sum).and_then(move |p| {
                // `Q = Xᵀ P̂` into the step's `q` (its orthogonalised input is no longer
                // needed); the memory is not touched.
                let product = |mut p: B::Buffer<f32>, mut q: B::Buffer<f32>| -> Result<_> {
                    be1.orthogonalize(1, side, r, B::view_mut(&mut p, ..)?, 0.0)?;
                    be1.mtp(
                        dims,
                        B::view(&xp, ..)?,
                        B::view(&p, ..)?,
                        B::view_mut(&mut q, ..)?,
                    )?;
                    Ok((p, q))
                };
                let work = match product(p, q) {
                    Ok((p, q)) => be1
                        .all_reduce(&*group, q, ReduceOp::Avg)
                        .then(move |q| Ok(Step { p, q: q?, xp, flag })),
                    Err(e) => Work::ready(Err(e.into())),
                };
                issued.complete(Ok(()));
                work
            });
            chain.then(move |r| {
                let Some(lease) = hold(&held).take() else {
                    return Err(Error::Bucket {
                        index,
                        why: "the batched PowerSGD step lost its memory lease".into(),
                    }
                    .into());
                };
                match r {
                    Ok(step) => decompress(&*be, lease, len, dims, step, x).map_err(Into::into),
                    // The lease puts the memories back as they were.
                    Err(e) => Err(e),
                }
            })
        })
    }
}

/// The step's lease, held by its last continuation (dropped with it if a collective
/// fails before it runs: the lease then puts the memory back).
type Held<B> = Arc<Mutex<Option<Lease<B, BatchedMemory<B>>>>>;

fn hold<B: Backend + 'static>(
    held: &Held<B>,
) -> MutexGuard<'_, Option<Lease<B, BatchedMemory<B>>>> {
    held.lock().unwrap_or_else(|p| p.into_inner())
}

/// A saved bucket fits the batched hook under `config`: its recorded layout adds up to
/// its length, and its memories have the padded matrix's sizes; else [`Error::State`].
fn check_saved(config: &PowerSgdConfig, index: usize, saved: &SavedBucket) -> Result<()> {
    if let Some(shapes) = &saved.layout {
        let total = crate::Layout::packed(shapes).map(|l| l.len());
        if total.as_ref().ok() != Some(&saved.len) {
            return Err(Error::State(format!(
                "bucket {index} of {} elements: its recorded layout of {} parameters {}",
                saved.len,
                shapes.len(),
                match total {
                    Ok(t) => format!("holds {t} elements"),
                    Err(e) => format!("is invalid ({e})"),
                }
            )));
        }
    }
    let side = side_of(saved.len);
    let square = side.checked_mul(side);
    let thin = side.checked_mul(config.matrix_approximation_rank);
    let error_len = if config.use_error_feedback {
        square
    } else {
        Some(0)
    };
    for (what, has, needs) in [
        ("error", saved.error.len(), error_len),
        ("p", saved.p.len(), thin),
        ("q", saved.q.len(), thin),
    ] {
        if Some(has) != needs {
            return Err(Error::State(format!(
                "bucket {index} of {} elements: the saved {what} holds {has} elements, the batched hook needs {}",
                saved.len,
                needs.map_or("more than fit in memory".into(), |n| n.to_string())
            )));
        }
    }
    Ok(())
}

/// A step's own buffers: the factors, the padded matrix and the non-finite flag.
struct Step<B: Backend> {
    p: B::Buffer<f32>,
    q: B::Buffer<f32>,
    xp: B::Buffer<f32>,
    flag: B::Buffer<f32>,
}

/// `M̂ = P̂ Qᵀ` into the padded matrix with the error update, the bucket's part copied
/// into `x`; then the step's factors copied into the memory (the step's buffers stay its
/// working buffers), all three memories left as they were when the reduced factors hold
/// a NaN or an infinity (on the device, from the flag), the padded matrix kept, and the
/// lease ended (the bucket released, the iteration counted). The error is the only
/// memory written before the last kernel.
fn decompress<B: CommBackend>(
    be: &B,
    mut lease: Lease<B, BatchedMemory<B>>,
    len: usize,
    dims: Dims,
    step: Step<B>,
    mut x: B::Buffer<f32>,
) -> Result<B::Buffer<f32>> {
    let Step {
        p,
        q,
        mut xp,
        mut flag,
    } = step;
    // The same reduced values on every rank: every rank holds the same steps.
    be.flag_nonfinite(B::view(&p, ..)?, B::view_mut(&mut flag, ..)?)?;
    be.flag_nonfinite(B::view(&q, ..)?, B::view_mut(&mut flag, ..)?)?;
    let index = lease.index();
    // `start` made the memory, and nothing takes it while the step holds the lease.
    let m = lease.memory_mut().ok_or_else(|| Error::Bucket {
        index,
        why: "the batched PowerSGD memory of this bucket is missing".into(),
    })?;
    match m.error.as_mut() {
        Some(e) => be.pqt_error_unflagged(
            dims,
            B::view(&p, ..)?,
            B::view(&q, ..)?,
            B::view_mut(&mut xp, ..)?,
            B::view_mut(e, ..)?,
            B::view(&flag, ..)?,
        )?,
        None => be.pqt(
            dims,
            B::view(&p, ..)?,
            B::view(&q, ..)?,
            B::view_mut(&mut xp, ..)?,
        )?,
    }
    be.copy(B::view(&xp, ..len)?, B::view_mut(&mut x, ..)?)?;
    be.copy_unflagged(
        B::view(&p, ..)?,
        B::view_mut(&mut m.p, ..)?,
        B::view(&flag, ..)?,
    )?;
    be.copy_unflagged(
        B::view(&q, ..)?,
        B::view_mut(&mut m.q, ..)?,
        B::view(&flag, ..)?,
    )?;
    m.work = Some((p, q));
    m.padded = Some(xp);
    lease.finish(be, flag)?;
    Ok(x)
}

comm_hook!(BatchedPowerSgd, BatchedPowerSgd, "a batched PowerSGD hook");

#[cfg(test)]
mod tests {
    #[test]
    fn side_is_the_ceiling_square_root() {
        for (len, side) in [
            (0, 0),
            (1, 1),
            (2, 2),
            (4, 2),
            (5, 3),
            (9, 3),
            (10, 4),
            (1_000_000, 1000),
            (1_000_001, 1001),
            (usize::MAX, 1 << (usize::BITS / 2)),
        ] {
            assert_eq!(super::side_of(len), side, "len {len}");
        }
    }
}
