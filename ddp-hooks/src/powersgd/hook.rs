//! The per-layer PowerSGD hook.

use super::plan::{Group, Memory, Plan, Source};
use super::progress::{
    count_nonfinite, in_flight, lock, observe_nonfinite, refill_key, warn_if_flagged, Progress,
};
use super::sequence::Sequencer;
use super::state::{layout_mismatch, same_layout, shapes_of, SavedBucket};
use super::{PowerSgdConfig, PowerSgdState};
use crate::{CommBackend, CommHook, CompressionStats, Error, GradBucket, HookState, Result};
use collectives::{ProcessGroup, ReduceOp, Work};
use lowrank::Backend;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

/// A bucket's warm-start factors, as the last completed step left them. A step works on
/// its own pair of buffers ([`Inner::work`]) and swaps them in only once it has
/// succeeded, so these are never in a collective and a failed step leaves them as they
/// were.
struct Factors<B: Backend> {
    len: usize,
    p: B::Buffer<f32>,
    q: B::Buffer<f32>,
}

/// A factor buffer (`P` or `Q`).
type Factor<B> = <B as Backend>::Buffer<f32>;

struct Inner<B: Backend> {
    progress: Progress,
    /// Error feedback per bucket: (bucket length, error of its compressed tensors).
    errors: BTreeMap<usize, (usize, B::Buffer<f32>)>,
    factors: BTreeMap<usize, Factors<B>>,
    /// The plan whose order a bucket's memories are in; absent: the saved order (a
    /// loaded state, not yet used).
    orders: BTreeMap<usize, Arc<Plan>>,
    /// The parameter shapes of the layout each bucket's memories were built for
    /// ([`SavedBucket::layout`]); a step whose bucket has other shapes while it holds
    /// memory is refused ([`check_memory`]). Absent for a bucket loaded from a state
    /// saved without it, until its next step records the layout it meets.
    layouts: BTreeMap<usize, Vec<Vec<usize>>>,
    /// Stacking buffers of the batches whose matrices are not contiguous in the bucket,
    /// kept from step to step (absent while a step is in flight); never saved.
    stacks: BTreeMap<usize, B::Buffer<f32>>,
    /// Each bucket's working `P` and `Q`, the buffers a step computes and all-reduces,
    /// kept from step to step (absent while a step is in flight, and after a failed
    /// step, which lost them in its collectives: reallocated then); never saved.
    work: BTreeMap<usize, (Factor<B>, Factor<B>)>,
    /// The buckets with a compressed step in flight: taken by `start`, released by the
    /// step's last continuation whether it succeeded or failed.
    busy: BTreeSet<usize>,
    /// Each bucket's non-finite flag, a one-element buffer a step lowers, raises when a
    /// reduced value is a NaN or an infinity, and reads (on the device) before it updates
    /// the memories; kept from step to step like [`Inner::work`]; never saved.
    flags: BTreeMap<usize, Factor<B>>,
    /// Each bucket's count of steps whose flag was raised, a one-element buffer on the
    /// backend (added to on the device, read when the statistics are asked for).
    counts: BTreeMap<usize, Factor<B>>,
}

/// The PowerSGD hook: owns its state (a [`PowerSgdState`] when saved) and reduces every
/// bucket it is given over its process group.
///
/// Each step calls each kernel once per tensor, or once per shape with
/// [`PowerSgdConfig::batch_tensors_with_same_shape`] (the same results; see that field
/// for the copies it may make and where it pays). Left unset, the flag takes the
/// backend's default, resolved when the hook is built ([`PowerSgd::batches_same_shape`]).
///
/// **A failed step fails alone.** When a collective fails (or a kernel fails between two
/// collectives), the step's work returns that error, and the bucket's memories are left
/// exactly as before the step: the error feedback is only updated by a step's last
/// continuation, and a step computes and all-reduces its own `P` and `Q` buffers, swapped
/// into the warm-start memory only when it succeeds. So the next step of the bucket
/// works, [`PowerSgd::save`] and [`CommHook::load_state`] work, and with warm start the
/// following steps are those of a run that never saw the failed step (its gradient is
/// dropped, as in PyTorch, whose memories keep their tensors when the hook raises). What
/// the failed step did change: its compression statistics are counted (PyTorch counts
/// them before communicating) and, at a bucket's first compressed step or without warm
/// start, its random draw of `Q` is consumed; without warm start the drawn `Q` is then
/// dropped, as after a completed step. The iteration is not counted, as in PyTorch (it
/// is counted after decompression). Every rank sees a failed collective fail, and every
/// rank recovers the same way, so the ranks stay consistent. (A kernel failure *during*
/// decompression, a bug rather than a communication failure, may leave the error of the
/// batches before it updated.)
///
/// **A non-finite step is held.** A step whose reduced values hold a NaN or an infinity
/// (any rank's gradient did: an overflow step of mixed-precision training) outputs
/// non-finite values, so a loss scaler sees the overflow and skips the optimizer step as
/// `torch.cuda.amp.GradScaler` does, and leaves the bucket's error feedback, `P` and `Q`
/// exactly as before the step: the next finite step compresses as if the held one had
/// never happened. (PyTorch's hook instead writes the NaN into its error memory, and every
/// later step's output is NaN.) The decision is made where the data is, from a flag the
/// step raises on the reduced `P̂`, `Q` and uncompressed means, which are the same on
/// every rank, so every rank holds the same steps; on a GPU the flag never leaves the
/// device within the step. What a held step still changes: its statistics and the
/// iteration are counted (the step happened; [`PowerSgd::iteration`] stays PyTorch's
/// count), and at a bucket's first compressed step or without warm start its random draw
/// of `Q` is consumed, as after a failed step. Each held step is counted
/// ([`CompressionStats::nonfinite_steps`]) and logged with a `tracing` warning: at once on
/// the CPU; on a device backend when the statistics are next read. The hold is per
/// bucket: buckets of the same step whose values were finite update their memories (a
/// bucket is reduced before the later buckets' gradients exist).
pub struct PowerSgd<B: CommBackend> {
    backend: Arc<B>,
    group: Arc<dyn ProcessGroup>,
    /// `batch_tensors_with_same_shape` resolved on `backend` at construction; loading a
    /// state does not change it.
    batch: bool,
    inner: Arc<Mutex<Inner<B>>>,
    sequence: Sequencer,
}

impl<B: CommBackend> PowerSgd<B> {
    /// A hook with `config` (validated) over `group`. An unset
    /// `batch_tensors_with_same_shape` is resolved here, on `backend`
    /// ([`PowerSgdConfig::batches_with`]); [`PowerSgd::config`] still reports it unset.
    pub fn new(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        config: PowerSgdConfig,
    ) -> Result<Self> {
        config.validate()?;
        let batch = config.batches_with(&*backend);
        tracing::info!(?config, batch_same_shape = batch, "PowerSGD hook");
        Ok(PowerSgd {
            backend,
            group,
            batch,
            inner: Arc::new(Mutex::new(Inner {
                progress: Progress::new(config),
                errors: BTreeMap::new(),
                factors: BTreeMap::new(),
                orders: BTreeMap::new(),
                layouts: BTreeMap::new(),
                stacks: BTreeMap::new(),
                work: BTreeMap::new(),
                busy: BTreeSet::new(),
                flags: BTreeMap::new(),
                counts: BTreeMap::new(),
            })),
            sequence: Sequencer::default(),
        })
    }

    /// The hyperparameters, as given (an unset `batch_tensors_with_same_shape` stays
    /// `None`; [`PowerSgd::batches_same_shape`] says what it resolved to).
    pub fn config(&self) -> PowerSgdConfig {
        lock(&self.inner).progress.config.clone()
    }

    /// Whether this hook batches same-shape tensors: `batch_tensors_with_same_shape` as
    /// configured, or, unset, the backend's default ([`PowerSgdConfig::batches_on`]: on
    /// for CUDA, off on the CPU). Fixed when the hook is built; loading a state with
    /// [`CommHook::load_state`] keeps it.
    pub fn batches_same_shape(&self) -> bool {
        self.batch
    }

    /// Synchronised steps seen so far (PyTorch's `state.iter`).
    pub fn iteration(&self) -> u64 {
        lock(&self.inner).progress.iter
    }

    /// Elements before and after compression over all compressed steps, and their
    /// ratio (0 before the first compressed step), as PyTorch's `compression_stats()`;
    /// and the compressed bucket steps that met a NaN or an infinity and were held
    /// ([`CompressionStats::nonfinite_steps`], see [`PowerSgd`]). On a device backend the
    /// count is read from the device here (a wait for the work already issued).
    pub fn compression_stats(&self) -> CompressionStats {
        let mut g = lock(&self.inner);
        let g = &mut *g;
        let nonfinite = observe_nonfinite(&*self.backend, &mut g.progress, g.counts.values());
        CompressionStats {
            nonfinite_steps: nonfinite,
            ..g.progress.compression_stats()
        }
    }

    /// The whole state except the process group, on the host. A memory holding a NaN
    /// or an infinity (from a non-finite gradient) is [`Error::NonFinite`]: such a state
    /// is corrupt and would not load. A step still in flight is [`Error::Bucket`]; after
    /// a failed step (its work has returned the error) the state saves as it was before
    /// that step (see [`PowerSgd`]).
    pub fn save(&self) -> Result<PowerSgdState> {
        let g = lock(&self.inner);
        if let Some(&index) = g.busy.iter().next() {
            return Err(in_flight(index));
        }
        let be = &*self.backend;
        let host = |buf: &B::Buffer<f32>| -> Result<Vec<f32>> {
            let mut v = vec![0.0; B::buffer_len(buf)];
            be.download(B::view(buf, ..)?, &mut v)?;
            Ok(v)
        };
        // Memories are saved in the saved order, whatever the plan's (see `plan.rs`).
        let saved = |index: usize, memory: Memory, v: Vec<f32>| -> Result<Vec<f32>> {
            match g.orders.get(&index) {
                Some(plan) if !plan.in_saved_order() => Ok(plan.ours_to_saved(memory, &v)?),
                _ => Ok(v),
            }
        };
        let mut buckets = BTreeMap::new();
        for (&index, (len, e)) in &g.errors {
            buckets.insert(
                index,
                SavedBucket {
                    len: *len,
                    layout: g.layouts.get(&index).cloned(),
                    error: saved(index, Memory::Error, host(e)?)?,
                    p: Vec::new(),
                    q: Vec::new(),
                },
            );
        }
        for (&index, f) in &g.factors {
            let p = saved(index, Memory::P, host(&f.p)?)?;
            let q = saved(index, Memory::Q, host(&f.q)?)?;
            let entry = buckets.entry(index).or_insert_with(|| SavedBucket {
                len: f.len,
                layout: g.layouts.get(&index).cloned(),
                error: Vec::new(),
                p: Vec::new(),
                q: Vec::new(),
            });
            entry.p = p;
            entry.q = q;
        }
        let mut state = g.progress.to_state(buckets);
        state.nonfinite_steps = count_nonfinite(be, &g.progress, g.counts.values())?;
        state.validate()?;
        Ok(state)
    }

    /// A hook that continues from `state` over `group` (which may differ from the group
    /// the state was saved with, as in PyTorch), with the state's configuration (an unset
    /// `batch_tensors_with_same_shape` is resolved on `backend`, as in [`PowerSgd::new`]).
    /// The state is checked first ([`PowerSgdState::validate`]): a NaN or an infinity is
    /// [`Error::NonFinite`]; a bucket whose recorded layout ([`SavedBucket::layout`]) does
    /// not give its saved length and memory sizes is [`Error::State`].
    /// [`CommHook::load_state`] instead loads into a hook whose configuration must match,
    /// except `batch_tensors_with_same_shape`, which it keeps.
    ///
    /// Each bucket's memories apply only to the layout they were built for: the first
    /// compressed step of a bucket whose parameter shapes differ from the recorded ones
    /// is [`Error::Bucket`] naming the bucket and both layouts, even at the same length
    /// and memory sizes (a state saved without a recorded layout is not checked).
    pub fn load(
        backend: Arc<B>,
        group: Arc<dyn ProcessGroup>,
        state: PowerSgdState,
    ) -> Result<Self> {
        let hook = PowerSgd::new(backend, group, state.config.clone())?;
        hook.restore(state)?;
        Ok(hook)
    }

    /// Replaces this hook's state with `state` (same configuration, except perhaps
    /// `batch_tensors_with_same_shape`, which the hook keeps: it changes no saved value),
    /// checked and uploaded before anything changes, so a failure leaves the hook as it
    /// was. Each bucket's recorded layout must fit its saved memories ([`Error::State`]
    /// otherwise, see [`check_saved_layout`]) and is kept: the bucket's next step checks
    /// it against the bucket it is given ([`check_memory`]).
    fn restore(&self, state: PowerSgdState) -> Result<()> {
        state.validate()?;
        let config = self.config();
        let batch = config.batch_tensors_with_same_shape;
        let comparable = PowerSgdConfig {
            batch_tensors_with_same_shape: batch,
            ..state.config.clone()
        };
        if comparable != config {
            return Err(Error::State(format!(
                "the state was saved with {:?}, this hook has {config:?}",
                state.config
            )));
        }
        let be = &*self.backend;
        let mut errors = BTreeMap::new();
        let mut factors = BTreeMap::new();
        let mut layouts = BTreeMap::new();
        for (&index, saved) in &state.buckets {
            if let Some(shapes) = &saved.layout {
                check_saved_layout(&config, index, saved, shapes)?;
                layouts.insert(index, shapes.clone());
            }
            if !saved.error.is_empty() {
                errors.insert(index, (saved.len, be.upload(&saved.error)?));
            }
            if !saved.p.is_empty() || !saved.q.is_empty() {
                let (p, q) = (be.upload(&saved.p)?, be.upload(&saved.q)?);
                factors.insert(
                    index,
                    Factors {
                        len: saved.len,
                        p,
                        q,
                    },
                );
            }
        }
        let mut g = lock(&self.inner);
        if let Some(&index) = g.busy.iter().next() {
            return Err(in_flight(index));
        }
        g.progress = Progress::from_state(&state);
        // The hook keeps its own setting (and `self.batch`, resolved from it).
        g.progress.config.batch_tensors_with_same_shape = batch;
        g.errors = errors;
        g.factors = factors;
        g.layouts = layouts;
        // The memories are in the saved order until each bucket's next step.
        g.orders.clear();
        g.stacks.clear();
        g.work.clear();
        g.flags.clear();
        g.counts.clear();
        Ok(())
    }

    /// Starts one bucket's reduction; errors here mean nothing was communicated.
    ///
    /// Everything that can fail (the plan, the memory checks, allocations, the copy of
    /// the warm-start `Q` into the step's own buffer, its orthogonalisation and the
    /// redraw of its zero columns) runs first. Then the bucket's turn is taken in the
    /// [`Sequencer`]: when it comes, the uncompressed tensors' all-reduce is launched at
    /// once, and `P`'s once the products are done.
    /// The products run on this thread right after: when the turn has already come
    /// (every earlier bucket has issued its collectives), the uncompressed all-reduce is
    /// in flight while they run; otherwise they overlap the earlier buckets'
    /// communication, and the uncompressed all-reduce is launched the moment the turn
    /// comes.
    ///
    /// Every kernel runs once per batch of the plan ([`Plan::groups`]): one tensor each
    /// without `batch_tensors_with_same_shape`, every same-shape tensor of the bucket
    /// with it.
    ///
    /// The step computes and all-reduces its own `P` and `Q` ([`Inner::work`]); the
    /// warm-start memory ([`Factors`]) and the error feedback change only in
    /// [`decompress`], once every collective has succeeded, and the step's last
    /// continuation releases the bucket either way, so a failure anywhere after this
    /// returns leaves the bucket as it was before the step (see [`PowerSgd`]).
    fn start(&self, bucket: GradBucket<B>) -> Result<Work<B::Buffer<f32>>> {
        let (be, group) = (self.backend.clone(), self.group.clone());
        let (index, is_last) = (bucket.index(), bucket.is_last());
        let layout = bucket.layout().clone();
        let mut x = bucket.into_buffer();
        let mut guard = lock(&self.inner);
        let g = &mut *guard;
        if g.progress.vanilla() {
            g.progress.maybe_increase_iter(is_last);
            return Ok(self.sequence.next(move |issued| {
                let work = be.all_reduce(&*group, x, ReduceOp::Avg);
                issued.complete(Ok(()));
                work
            }));
        }
        if g.busy.contains(&index) {
            return Err(in_flight(index));
        }
        let cfg = g.progress.config.clone();
        let eps = cfg.orthogonalization_epsilon;
        let plan = Arc::new(Plan::new(
            &layout,
            cfg.matrix_approximation_rank,
            cfg.min_compression_rate,
            self.batch,
        )?);
        check_memory(g, index, &plan, &layout)?;
        // The memories are (or are about to be) this layout's.
        if !g
            .layouts
            .get(&index)
            .is_some_and(|shapes| same_layout(shapes, &layout))
        {
            g.layouts.insert(index, shapes_of(&layout));
        }
        let first_use = !g.orders.contains_key(&index);
        reorder(&*be, g, index, &plan)?;

        let mut u = be.alloc::<f32>(plan.u_len)?;
        let mut at = 0;
        for &(off, len) in &plan.uncompressed {
            be.copy(
                B::view(&x, off..off + len)?,
                B::view_mut(&mut u, at..at + len)?,
            )?;
            at += len;
        }
        if cfg.use_error_feedback && !g.errors.contains_key(&index) {
            tracing::info!(
                "A zero tensor of length {} that represents local error is created.",
                plan.e_len
            );
            g.errors
                .insert(index, (plan.len, zeroed(&*be, plan.e_len)?));
        }
        let randomize = !cfg.warm_start || !g.factors.contains_key(&index);
        if randomize {
            // Drawn in the saved order, so the values of every tensor's Q do not depend
            // on the batching.
            let mut q = vec![0.0; plan.q_len];
            g.progress.rng.fill(&mut q);
            let q = be.upload(&plan.saved_to_ours(Memory::Q, &q)?)?;
            let p = be.alloc(plan.p_len)?;
            g.factors.insert(
                index,
                Factors {
                    len: plan.len,
                    p,
                    q,
                },
            );
        }
        if first_use {
            if plan.stack_len > 0 {
                tracing::info!(
                    bucket = index,
                    batches = plan.groups.len(),
                    tensors = plan.compressed.len(),
                    stacked = plan.stack_len,
                    "PowerSGD batches same-shape tensors; {} elements not contiguous in the bucket are stacked by copy each step",
                    plan.stack_len
                );
            }
            g.orders.insert(index, plan.clone());
        }
        let factors = g.factors.get(&index).ok_or_else(|| no_factors(index))?;
        // The step's own P and Q: the memory's stay untouched until the step succeeds.
        let (mut p, mut q) = match g.work.remove(&index) {
            Some((p, q)) if B::buffer_len(&p) == plan.p_len && B::buffer_len(&q) == plan.q_len => {
                (p, q)
            }
            _ => (be.try_alloc(plan.p_len)?, be.try_alloc(plan.q_len)?),
        };
        be.copy(B::view(&factors.q, ..)?, B::view_mut(&mut q, ..)?)?;
        // A zero column of Q (from a zero or low-rank gradient) would stay zero under
        // warm start; it is refilled inside the orthogonalisation, with values keyed by
        // (seed, bucket, step): the same on every rank, whatever the batching.
        let key = refill_key(cfg.random_seed, index, g.progress.iter);
        for grp in &plan.groups {
            let (b, m, r) = (grp.dims.batch(), grp.dims.m(), grp.dims.r());
            be.orthogonalize_refill(b, m, r, B::view_mut(&mut q, grp.q_range())?, eps, key)?;
        }
        let mut stack = match (plan.stack_len, g.stacks.remove(&index)) {
            (0, _) => None,
            (len, Some(s)) if B::buffer_len(&s) == len => Some(s),
            (len, _) => Some(be.try_alloc(len)?),
        };
        let mut flag = match g.flags.remove(&index) {
            Some(f) => f,
            None => be.try_alloc(1)?,
        };
        be.zero(B::view_mut(&mut flag, ..)?)?;
        if let std::collections::btree_map::Entry::Vacant(slot) = g.counts.entry(index) {
            slot.insert(zeroed(&*be, 1)?);
        }
        // Nothing below returns early: the step's last continuation releases the bucket.
        g.busy.insert(index);
        g.progress.record(plan.before, plan.after, is_last);
        drop(guard);

        // Issue this bucket's collectives in the same order on every rank: the
        // uncompressed tensors first, then P (summed, not averaged: it is orthogonalised
        // next) once the products are done, then Q from P's continuation.
        let (products, products_done) = Work::<(Factor<B>, Factor<B>, Memories<B>)>::pending();
        let inner = self.inner.clone();
        let (plan0, plan1) = (plan.clone(), plan.clone());
        let work = self.sequence.next(move |issued| {
            let work_u = if plan.u_len > 0 {
                be.all_reduce(&*group, u, ReduceOp::Avg)
            } else {
                Work::ready(Ok(u))
            };
            let be1 = be.clone();
            let chain = products.and_then(move |(p, q, xs)| {
                let be2 = be1.clone();
                be1.all_reduce(&*group, p, ReduceOp::Sum)
                    .and_then(move |p| {
                        let work = match compute_q(&*be2, &plan1, eps, p, q, &xs) {
                            Ok((p, q)) => be2
                                .all_reduce(&*group, q, ReduceOp::Avg)
                                .then(move |q| Ok((p, q?, xs))),
                            Err(e) => Work::ready(Err(e.into())),
                        };
                        issued.complete(Ok(()));
                        work
                    })
            });
            // The step's last continuation: it runs whether the step succeeded or not,
            // and releases the bucket either way before the caller sees the result.
            chain.zip(work_u).then(move |r| {
                let done = match r {
                    Ok(((p, q, xs), u)) => {
                        decompress(&*be, &inner, index, is_last, &plan, p, q, xs, &u)
                            .map_err(Into::into)
                    }
                    Err(e) => Err(e),
                };
                if done.is_err() {
                    release_failed(&inner, index);
                }
                done
            })
        });
        // The products, on this thread; their result releases P's all-reduce. On failure
        // the step fails as a whole (its last continuation releases the bucket, whose
        // memories this step has not changed); its buffers are kept for the next step.
        match first_products(
            &*self.backend,
            &self.inner,
            index,
            &plan0,
            &cfg,
            &mut x,
            stack.as_mut(),
            &q,
            &mut p,
        ) {
            Ok(()) => products_done.complete(Ok((p, q, Memories { x, stack, flag }))),
            Err(e) => {
                {
                    let mut g = lock(&self.inner);
                    g.work.insert(index, (p, q));
                    g.flags.insert(index, flag);
                    if let Some(s) = stack {
                        g.stacks.insert(index, s);
                    }
                }
                products_done.complete(Err(e.into()));
            }
        }
        Ok(work)
    }
}

/// A zeroed buffer whose pages are written now, for a memory the hook reads before it
/// writes (the error).
///
/// The CPU backend's zeroed allocation maps fresh pages lazily: a page read first is the
/// kernel's shared zero page, and the first write to it then copies it and flushes the
/// TLB of every core the process runs on (an inter-processor interrupt per 4 KiB page,
/// dear in a virtual machine). The error memory is read by the first products before
/// decompression writes it, so its first step paid that per page: BERT-base's first
/// compressed step took 1.9-2.7 s instead of 0.42-0.46 s (AVX-512, 2 ranks, 2-core VM),
/// most of it in those flushes. Writing zeros first maps every page writable at once
/// (one pass, no flush).
pub(super) fn zeroed<B: Backend>(be: &B, len: usize) -> Result<B::Buffer<f32>> {
    let mut buf = be.alloc(len)?;
    be.zero(B::view_mut(&mut buf, ..)?)?;
    Ok(buf)
}

/// The factors of a bucket that has memory (`start` has just made them): a bug, reported
/// rather than a panic.
fn no_factors(index: usize) -> Error {
    Error::Bucket {
        index,
        why: "the PowerSGD factors of this bucket are missing".into(),
    }
}

/// After a failed step (a collective, or a kernel between two collectives): releases the
/// bucket. Its memories are as before the step (`decompress`, the only step that changes
/// them, has not run, or failed before changing the factors); the step's working buffers
/// are lost and reallocated by the next step. Without warm start the factors are dropped,
/// as a completed step drops them: the next step draws a new `Q`. Every rank sees the
/// collective fail and does the same, so the ranks stay consistent.
fn release_failed<B: Backend>(inner: &Mutex<Inner<B>>, index: usize) {
    let mut g = lock(inner);
    g.busy.remove(&index);
    if !g.progress.config.warm_start {
        g.factors.remove(&index);
    }
    tracing::warn!(
        bucket = index,
        "a PowerSGD step failed; the bucket keeps its memories from before the step"
    );
}

/// The bucket, when some batch is stacked its stacking buffer, and the step's non-finite
/// flag ([`Inner::flags`]), in flight.
struct Memories<B: Backend> {
    x: B::Buffer<f32>,
    stack: Option<B::Buffer<f32>>,
    flag: B::Buffer<f32>,
}

impl<B: Backend> Memories<B> {
    /// The buffer a batch's matrices are in.
    fn of(&self, grp: &Group) -> Result<&B::Buffer<f32>> {
        match (grp.x, &self.stack) {
            (Source::Bucket(_), _) => Ok(&self.x),
            (Source::Stack(_), Some(s)) => Ok(s),
            (Source::Stack(_), None) => Err(no_stack()),
        }
    }
}

/// A stacked batch without a stacking buffer: a bug, reported rather than a panic.
fn no_stack() -> Error {
    Error::Kernel("a stacked PowerSGD batch has no stacking buffer".into())
}

/// Puts a bucket's memories into the order of `plan`, if they are in another (a loaded
/// state is in the saved order; the batching may differ). Runs once per load, through
/// the host.
///
/// Memories move by the position of each compressed tensor, so they only move between
/// plans of the same compressed matrices (`n x m`, rank `r`, in bucket order): a plan
/// whose matrices differ from those of the plan the memories are in is [`Error::Bucket`]
/// and nothing moves. [`check_memory`] has already refused a bucket whose layout differs
/// from its memories' recorded one; this guards the move itself. A bucket without
/// memory (none yet, or none kept without error feedback and warm start) takes any plan.
fn reorder<B: CommBackend>(be: &B, g: &mut Inner<B>, index: usize, plan: &Arc<Plan>) -> Result<()> {
    if !g.errors.contains_key(&index) && !g.factors.contains_key(&index) {
        // No memory (none yet, or none kept without error feedback and warm start):
        // nothing to move, and any layout may come.
        g.orders.insert(index, plan.clone());
        return Ok(());
    }
    if let Some(old) = g.orders.get(&index) {
        if matrices(old) != matrices(plan) {
            return Err(Error::Bucket {
                index,
                why: format!(
                    "the compressed matrices changed (the memories are for {}, the bucket now has {}): the PowerSGD state cannot be applied",
                    matrices_str(old),
                    matrices_str(plan)
                ),
            });
        }
    }
    let same = match g.orders.get(&index) {
        Some(old) => old.same_order(plan),
        None => plan.in_saved_order(),
    };
    if same {
        return Ok(());
    }
    let old = g.orders.get(&index).cloned();
    let convert = |memory: Memory, buf: &mut B::Buffer<f32>| -> Result<()> {
        let mut v = vec![0.0; B::buffer_len(buf)];
        be.download(B::view(buf, ..)?, &mut v)?;
        if let Some(old) = &old {
            v = old.ours_to_saved(memory, &v)?;
        }
        *buf = be.upload(&plan.saved_to_ours(memory, &v)?)?;
        Ok(())
    };
    if let Some((_, e)) = g.errors.get_mut(&index) {
        convert(Memory::Error, e)?;
    }
    if let Some(f) = g.factors.get_mut(&index) {
        convert(Memory::P, &mut f.p)?;
        convert(Memory::Q, &mut f.q)?;
    }
    g.orders.insert(index, plan.clone());
    Ok(())
}

/// The compressed matrices of a plan, in bucket order: what its memories' layout
/// depends on.
fn matrices(plan: &Plan) -> Vec<(usize, usize, usize)> {
    plan.compressed.iter().map(|m| (m.n, m.m, m.r)).collect()
}

/// A plan's compressed matrices for an error message (at most 8 shown).
fn matrices_str(plan: &Plan) -> String {
    let mut parts: Vec<String> = plan
        .compressed
        .iter()
        .take(8)
        .map(|m| format!("{}x{} (rank {})", m.n, m.m, m.r))
        .collect();
    if plan.compressed.len() > 8 {
        parts.push("…".into());
    }
    format!("[{}]", parts.join(", "))
}

/// Error feedback and the first product of every batch: `X = G + E` in place, `P = X Q`
/// (or `P = G Q` without error feedback), with the step's orthogonalised `q`. A stacked
/// batch's matrices are copied into the stack first. The error memory is only read.
#[allow(clippy::too_many_arguments)]
fn first_products<B: CommBackend>(
    be: &B,
    inner: &Mutex<Inner<B>>,
    index: usize,
    plan: &Plan,
    cfg: &PowerSgdConfig,
    x: &mut B::Buffer<f32>,
    mut stack: Option<&mut B::Buffer<f32>>,
    q: &B::Buffer<f32>,
    p: &mut B::Buffer<f32>,
) -> Result<()> {
    let g = lock(inner);
    for grp in &plan.groups {
        let d = grp.dims;
        let src: &mut B::Buffer<f32> = match grp.x {
            Source::Bucket(_) => &mut *x,
            Source::Stack(at) => {
                let s = stack.as_deref_mut().ok_or_else(no_stack)?;
                let mut to = at;
                for &k in &grp.members {
                    let mat = &plan.compressed[k];
                    let nm = mat.n * mat.m;
                    be.copy(
                        B::view(x, mat.offset..mat.offset + nm)?,
                        B::view_mut(s, to..to + nm)?,
                    )?;
                    to += nm;
                }
                s
            }
        };
        let (xs, ps, qs) = (grp.x_range(), grp.p_range(), grp.q_range());
        match g.errors.get(&index) {
            Some((_, e)) if cfg.use_error_feedback => {
                be.add_mq(
                    d,
                    B::view_mut(src, xs)?,
                    B::view(e, grp.e_range())?,
                    B::view(q, qs)?,
                    B::view_mut(p, ps)?,
                )?;
            }
            _ => be.mq(d, B::view(src, xs)?, B::view(q, qs)?, B::view_mut(p, ps)?)?,
        }
    }
    Ok(())
}

/// A bucket with memory whose length changed, or whose layout no longer fits its memory,
/// is [`Error::Bucket`] (PyTorch fails with an opaque shape error, or, at the same
/// sizes, none at all): a changed length names both lengths; memory sizes that differ
/// name the memory and both sizes; and at the same sizes, parameter shapes that differ
/// from those the memory was built for ([`Inner::layouts`], [`SavedBucket::layout`])
/// name both layouts and the first parameter that differs. Same-shape parameters that
/// trade places are not detected; a bucket loaded without a recorded layout is checked
/// for its sizes only (its step then records the layout).
fn check_memory<B: Backend>(
    g: &Inner<B>,
    index: usize,
    plan: &Plan,
    layout: &crate::Layout,
) -> Result<()> {
    let error = |why: String| {
        Err(Error::Bucket {
            index,
            why: format!("{why}: the PowerSGD state cannot be applied"),
        })
    };
    let error_memory = g.errors.get(&index);
    let factors = g.factors.get(&index);
    let lens = error_memory.map(|(len, _)| *len).into_iter();
    for len in lens.chain(factors.map(|f| f.len)) {
        if len != plan.len {
            return error(format!(
                "the bucket length changed (was {len} elements, now {})",
                plan.len
            ));
        }
    }
    let mut memories = Vec::new();
    if let Some((_, e)) = error_memory {
        memories.push(("error-feedback memory", e, plan.e_len));
    }
    if let Some(f) = factors {
        memories.push(("factor P", &f.p, plan.p_len));
        memories.push(("factor Q", &f.q, plan.q_len));
    }
    for (what, buffer, needs) in memories {
        let has = B::buffer_len(buffer);
        if has != needs {
            return error(format!(
                "the layout changed at the same length ({} elements): the {what} holds {has} elements, the new layout needs {needs}",
                plan.len
            ));
        }
    }
    if error_memory.is_some() || factors.is_some() {
        if let Some(shapes) = g.layouts.get(&index) {
            if !same_layout(shapes, layout) {
                return error(layout_mismatch(shapes, layout));
            }
        }
    }
    Ok(())
}

/// A saved bucket's recorded layout must give its saved length and memory sizes under
/// `config` (the plan the memories were built with), else [`Error::State`]: a state
/// whose layout does not describe its memories is corrupt.
fn check_saved_layout(
    config: &PowerSgdConfig,
    index: usize,
    saved: &SavedBucket,
    shapes: &[Vec<usize>],
) -> Result<()> {
    let bad = |why: String| {
        Error::State(format!(
            "bucket {index}: the recorded layout of {} parameters {why}",
            shapes.len()
        ))
    };
    let layout = crate::Layout::packed(shapes).map_err(|e| bad(format!("is invalid ({e})")))?;
    let plan = Plan::new(
        &layout,
        config.matrix_approximation_rank,
        config.min_compression_rate,
        false,
    )
    .map_err(|e| bad(format!("has no PowerSGD plan ({e})")))?;
    if plan.len != saved.len {
        return Err(bad(format!(
            "holds {} elements, the saved bucket {}",
            plan.len, saved.len
        )));
    }
    for (what, has, needs) in [
        ("error", saved.error.len(), plan.e_len),
        ("p", saved.p.len(), plan.p_len),
        ("q", saved.q.len(), plan.q_len),
    ] {
        if has != 0 && has != needs {
            return Err(bad(format!(
                "needs {needs} elements of {what}, the state holds {has}"
            )));
        }
    }
    Ok(())
}

/// Orthogonalises the summed `P` in place and computes `Q = Xᵀ P̂` into the step's `q`
/// (whose orthogonalised input the first products no longer need); returns both. The
/// memory is not touched.
fn compute_q<B: CommBackend>(
    be: &B,
    plan: &Plan,
    eps: f32,
    mut p: B::Buffer<f32>,
    mut q: B::Buffer<f32>,
    xs: &Memories<B>,
) -> Result<(B::Buffer<f32>, B::Buffer<f32>)> {
    for grp in &plan.groups {
        let (d, ps) = (grp.dims, grp.p_range());
        be.orthogonalize(
            d.batch(),
            d.n(),
            d.r(),
            B::view_mut(&mut p, ps.clone())?,
            eps,
        )?;
        be.mtp(
            d,
            B::view(xs.of(grp)?, grp.x_range())?,
            B::view(&p, ps)?,
            B::view_mut(&mut q, grp.q_range())?,
        )?;
    }
    Ok((p, q))
}

/// `M̂ = P̂ Qᵀ` into the bucket (with the error update; a stacked batch is copied back),
/// the uncompressed means copied back, the step's factors swapped into the memory for
/// warm start (the memory's old buffers become the next step's working buffers), the
/// stack kept for the next step, the bucket released, and the iteration counted.
#[allow(clippy::too_many_arguments)]
fn decompress<B: CommBackend>(
    be: &B,
    inner: &Mutex<Inner<B>>,
    index: usize,
    is_last: bool,
    plan: &Plan,
    p: B::Buffer<f32>,
    q: B::Buffer<f32>,
    xs: Memories<B>,
    u: &B::Buffer<f32>,
) -> Result<B::Buffer<f32>> {
    let Memories {
        mut x,
        mut stack,
        mut flag,
    } = xs;
    // The reduced values are the same on every rank, so every rank raises the flag
    // alike. A NaN or an infinity in any rank's gradient reaches them: `P = X Q` of a
    // non-finite `X` is non-finite, and the orthogonalisation turns that matrix into NaN
    // (so `Q = Xᵀ P̂` is NaN too); the uncompressed means carry it as they are.
    be.flag_nonfinite(B::view(&p, ..)?, B::view_mut(&mut flag, ..)?)?;
    be.flag_nonfinite(B::view(&q, ..)?, B::view_mut(&mut flag, ..)?)?;
    be.flag_nonfinite(B::view(u, ..)?, B::view_mut(&mut flag, ..)?)?;
    let mut guard = lock(inner);
    let g = &mut *guard;
    let ef = g.progress.config.use_error_feedback;
    for grp in &plan.groups {
        let (d, ps, qs, xr) = (grp.dims, grp.p_range(), grp.q_range(), grp.x_range());
        let src: &mut B::Buffer<f32> = match grp.x {
            Source::Bucket(_) => &mut x,
            Source::Stack(_) => stack.as_mut().ok_or_else(no_stack)?,
        };
        match g.errors.get_mut(&index) {
            Some((_, e)) if ef => {
                be.pqt_error_unflagged(
                    d,
                    B::view(&p, ps)?,
                    B::view(&q, qs)?,
                    B::view_mut(src, xr)?,
                    B::view_mut(e, grp.e_range())?,
                    B::view(&flag, ..)?,
                )?;
            }
            _ => be.pqt(d, B::view(&p, ps)?, B::view(&q, qs)?, B::view_mut(src, xr)?)?,
        }
        if let (Source::Stack(mut from), Some(s)) = (grp.x, &stack) {
            for &k in &grp.members {
                let mat = &plan.compressed[k];
                let nm = mat.n * mat.m;
                be.copy(
                    B::view(s, from..from + nm)?,
                    B::view_mut(&mut x, mat.offset..mat.offset + nm)?,
                )?;
                from += nm;
            }
        }
    }
    let mut at = 0;
    for &(off, len) in &plan.uncompressed {
        be.copy(
            B::view(u, at..at + len)?,
            B::view_mut(&mut x, off..off + len)?,
        )?;
        at += len;
    }
    if g.progress.config.warm_start {
        // The warm-start memory takes the step's factors unless the flag is raised (a
        // device-side copy: no host wait). The step's buffers stay its working buffers.
        let f = g.factors.get_mut(&index).ok_or_else(|| no_factors(index))?;
        be.copy_unflagged(
            B::view(&p, ..)?,
            B::view_mut(&mut f.p, ..)?,
            B::view(&flag, ..)?,
        )?;
        be.copy_unflagged(
            B::view(&q, ..)?,
            B::view_mut(&mut f.q, ..)?,
            B::view(&flag, ..)?,
        )?;
    } else {
        g.factors.remove(&index);
    }
    g.work.insert(index, (p, q));
    if let Some(count) = g.counts.get_mut(&index) {
        be.add(B::view_mut(count, ..)?, B::view(&flag, ..)?)?;
    }
    if B::HOST_RESIDENT {
        warn_if_flagged(be, &flag, index, g.progress.iter)?;
    }
    g.flags.insert(index, flag);
    if let Some(s) = stack {
        g.stacks.insert(index, s);
    }
    g.busy.remove(&index);
    g.progress.maybe_increase_iter(is_last);
    Ok(x)
}

impl<B: CommBackend> CommHook<B> for PowerSgd<B> {
    fn name(&self) -> String {
        let c = self.config();
        format!(
            "powersgd:rank={},start_iter={}",
            c.matrix_approximation_rank, c.start_powersgd_iter
        )
    }

    fn run(&mut self, bucket: GradBucket<B>) -> Work<B::Buffer<f32>> {
        match self.start(bucket) {
            Ok(work) => work,
            Err(e) => Work::ready(Err(e.into())),
        }
    }

    /// [`HookState::PowerSgd`] holding [`PowerSgd::save`]'s state.
    fn save_state(&self) -> Result<HookState> {
        Ok(HookState::PowerSgd(Box::new(self.save()?)))
    }

    /// Loads a [`HookState::PowerSgd`] saved with the same configuration, except perhaps
    /// `batch_tensors_with_same_shape`: the hook keeps its own (the saved memories do
    /// not depend on it). As with [`PowerSgd::load`], each bucket's memories apply only
    /// to the parameter shapes they were recorded with: a bucket of another layout, even
    /// of the same length, is refused at its next step ([`Error::Bucket`]).
    fn load_state(&self, state: HookState) -> Result<()> {
        match state {
            HookState::PowerSgd(s) => self.restore(*s),
            other => Err(other.mismatch("a PowerSGD hook")),
        }
    }

    fn compression_stats(&self) -> Option<CompressionStats> {
        Some(PowerSgd::compression_stats(self))
    }

    fn iteration(&self) -> Option<u64> {
        Some(PowerSgd::iteration(self))
    }
}
