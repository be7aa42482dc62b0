//! One compressed step of the per-layer hook, in the order it runs: [`start`] prepares
//! everything that can fail before communicating and leases the bucket's memory;
//! [`issue`] chains the collectives (the uncompressed means, `P`, `Q`) and the kernels
//! between them; [`first_products`] feeds the chain `P = X Q`; [`decompress`] ends the
//! step and returns the memory.

use super::config::PowerSgdConfig;
use super::core::{Core, Lease};
use super::memory::{Factor, Factors, LayerMemory};
use super::plan::{check_memory, same_layout, shapes_of, Group, Memory, Plan, Source};
use super::progress::refill_key;
use crate::{CommBackend, Error, GradBucket, Result};
use collectives::{Completer, ReduceOp, Work};
use lowrank::Backend;
use std::sync::{Arc, Mutex, MutexGuard};

/// The step's lease, shared by its caller-thread products and its last continuation (a
/// lock private to the step: the two never contend, as the last continuation runs only
/// once the products are done). Whichever holder goes last without finishing the lease
/// (a failed collective drops the continuations that held it) puts the memory back.
type Held<B> = Arc<Mutex<Option<Lease<B, LayerMemory<B>>>>>;

fn hold<B: Backend + 'static>(held: &Held<B>) -> MutexGuard<'_, Option<Lease<B, LayerMemory<B>>>> {
    held.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the products hand the chain, and the chain decompression: the step's factors and
/// the matrices they came from.
type Products<B> = (Factor<B>, Factor<B>, Matrices<B>);

/// The bucket, when some batch is stacked its stacking buffer, and the step's non-finite
/// flag, in flight.
pub(super) struct Matrices<B: Backend> {
    x: B::Buffer<f32>,
    stack: Option<B::Buffer<f32>>,
    flag: B::Buffer<f32>,
}

impl<B: Backend> Matrices<B> {
    /// The buffer a batch's matrices are in.
    fn of(&self, grp: &Group) -> Result<&B::Buffer<f32>> {
        match (grp.x, &self.stack) {
            (Source::Bucket(_), _) => Ok(&self.x),
            (Source::Stack(_), Some(s)) => Ok(s),
            (Source::Stack(_), None) => Err(no_stack()),
        }
    }
}

/// Starts one bucket's reduction; errors here mean nothing was communicated (and the
/// bucket's memory is as it was: the lease puts it back).
///
/// Everything that can fail (the plan, the memory checks, allocations, the copy of the
/// warm-start `Q` into the step's own buffer, its orthogonalisation and the redraw of
/// its zero columns) runs first. Then the collectives are chained ([`issue`]): when the
/// bucket's turn comes in the sequencer (every earlier bucket has issued its
/// collectives), the uncompressed tensors' all-reduce is launched at once, and `P`'s
/// once the products are done. The products run on this thread right after: when the
/// turn has already come the uncompressed all-reduce is in flight while they run;
/// otherwise they overlap the earlier buckets' communication.
///
/// Every kernel runs once per batch of the plan ([`Plan::groups`]): one tensor each
/// without `batch_tensors_with_same_shape`, every same-shape tensor of the bucket with
/// it. The step computes and all-reduces its own `P` and `Q`; the warm-start memory and
/// the error feedback change only in [`decompress`], once every collective has
/// succeeded (and not at all when the reduced values are not finite).
pub(super) fn start<B: CommBackend>(
    core: &Core<B, LayerMemory<B>>,
    batch: bool,
    bucket: GradBucket<B>,
) -> Result<Work<B::Buffer<f32>>> {
    let bucket = match core.vanilla(bucket) {
        Ok(work) => return Ok(work),
        Err(bucket) => bucket,
    };
    let (index, is_last) = (bucket.index(), bucket.is_last());
    let layout = bucket.layout().clone();
    let mut x = bucket.into_buffer();
    let (mut lease, cfg, iter) = core.lease(index, is_last)?;
    let be = core.backend.clone();
    let eps = cfg.orthogonalization_epsilon;
    let plan = Arc::new(Plan::new(
        &layout,
        cfg.matrix_approximation_rank,
        cfg.min_compression_rate,
        batch,
    )?);
    if let Some(m) = lease.memory() {
        let sizes = [
            ("error-feedback memory", m.error.as_ref(), plan.e_len),
            ("factor P", m.factors.as_ref().map(|f| &f.p), plan.p_len),
            ("factor Q", m.factors.as_ref().map(|f| &f.q), plan.q_len),
        ]
        .map(|(what, buf, needs)| (what, buf.map(B::buffer_len), needs));
        check_memory(index, m.len, &sizes, m.layout.as_deref(), &plan, &layout)?;
    }
    let m = match lease.memory_mut() {
        Some(m) => m,
        None => lease.set_memory(LayerMemory::empty(plan.len)),
    };
    m.len = plan.len;
    // The memories are (or are about to be) this layout's.
    if !m.layout.as_ref().is_some_and(|s| same_layout(s, &layout)) {
        m.layout = Some(shapes_of(&layout));
    }
    let first_use = m.order.is_none();
    reorder(&*be, index, m, &plan)?;

    // The uncompressed tensors gathered for their all-reduce, into the buffer the last
    // step left (one run to copy under `BucketLayout::ByShape`).
    let mut u = match m.u.take() {
        Some(u) if B::buffer_len(&u) == plan.u_len => u,
        _ => be.try_alloc::<f32>(plan.u_len)?,
    };
    let mut at = 0;
    for &(off, len) in &plan.uncompressed {
        be.copy(
            B::view(&x, off..off + len)?,
            B::view_mut(&mut u, at..at + len)?,
        )?;
        at += len;
    }
    if cfg.use_error_feedback && m.error.is_none() {
        tracing::info!(
            "A zero tensor of length {} that represents local error is created.",
            plan.e_len
        );
        m.error = Some(super::core::zeroed(&*be, plan.e_len)?);
    }
    if !cfg.warm_start || m.factors.is_none() {
        // Drawn in the saved order, so the values of every tensor's Q do not depend on
        // the batching; under the hook's lock, in the order the buckets start.
        let mut q = vec![0.0; plan.q_len];
        core.lock().progress.rng.fill(&mut q);
        m.factors = Some(Factors {
            p: be.alloc(plan.p_len)?,
            q: be.upload(&plan.saved_to_ours(Memory::Q, &q)?)?,
        });
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
        m.order = Some(plan.clone());
    }
    let factors = m.factors.as_ref().ok_or_else(|| no_factors(index))?;
    // The step's own P and Q: the memory's stay untouched until the step succeeds.
    let (mut p, mut q) = match m.work.take() {
        Some((p, q)) if B::buffer_len(&p) == plan.p_len && B::buffer_len(&q) == plan.q_len => {
            (p, q)
        }
        _ => (be.try_alloc(plan.p_len)?, be.try_alloc(plan.q_len)?),
    };
    be.copy(B::view(&factors.q, ..)?, B::view_mut(&mut q, ..)?)?;
    // A zero column of Q (from a zero or low-rank gradient) would stay zero under warm
    // start; it is refilled inside the orthogonalisation, with values keyed by (seed,
    // bucket, step): the same on every rank, whatever the batching.
    let key = refill_key(cfg.random_seed, index, iter);
    for grp in &plan.groups {
        let (b, n, r) = (grp.dims.batch(), grp.dims.m(), grp.dims.r());
        be.orthogonalize_refill(b, n, r, B::view_mut(&mut q, grp.q_range())?, eps, key)?;
    }
    let mut stack = match (plan.stack_len, m.stack.take()) {
        (0, _) => None,
        (len, Some(s)) if B::buffer_len(&s) == len => Some(s),
        (len, _) => Some(be.try_alloc(len)?),
    };
    let mut flag = match m.flag.take() {
        Some(f) => f,
        None => be.try_alloc(1)?,
    };
    be.zero(B::view_mut(&mut flag, ..)?)?;
    // Nothing below returns early: from here a failure is a failed step.
    lease.issue(plan.before, plan.after);
    let held: Held<B> = Arc::new(Mutex::new(Some(lease)));

    let (products, products_done) = Work::<Products<B>>::pending();
    let work = issue(core, index, &plan, &cfg, u, products, held.clone());
    // The products, on this thread; their result releases P's all-reduce. On failure the
    // step fails as a whole (the memories have not changed); its buffers are kept for the
    // next step.
    let done = {
        let lease = hold(&held);
        let error = lease
            .as_ref()
            .and_then(|l| l.memory())
            .and_then(|m| m.error.as_ref())
            .filter(|_| cfg.use_error_feedback);
        first_products(&*be, &plan, error, &mut x, stack.as_mut(), &q, &mut p)
    };
    match done {
        Ok(()) => products_done.complete(Ok((p, q, Matrices { x, stack, flag }))),
        Err(e) => {
            if let Some(m) = hold(&held).as_mut().and_then(|l| l.memory_mut()) {
                m.work = Some((p, q));
                m.stack = stack;
                m.flag = Some(flag);
            }
            products_done.complete(Err(e.into()));
        }
    }
    Ok(work)
}

/// The bucket's collectives, in the order they run, issued in the same order on every
/// rank: when the bucket's turn comes, the uncompressed tensors' mean; once the products
/// are done, `P` (summed, not averaged: it is orthogonalised next); then `Q = Xᵀ P̂` and
/// its mean; then decompression. The last continuation runs whether the step succeeded
/// or not, and ends the lease either way before the caller sees the result.
fn issue<B: CommBackend>(
    core: &Core<B, LayerMemory<B>>,
    index: usize,
    plan: &Arc<Plan>,
    cfg: &PowerSgdConfig,
    u: B::Buffer<f32>,
    products: Work<Products<B>>,
    held: Held<B>,
) -> Work<B::Buffer<f32>> {
    let (be, group, plan) = (core.backend.clone(), core.group.clone(), plan.clone());
    let (eps, warm_start) = (cfg.orthogonalization_epsilon, cfg.warm_start);
    core.sequence.next(move |issued: Completer<()>| {
        // 1. The uncompressed means.
        let work_u = if plan.u_len > 0 {
            be.all_reduce(&*group, u, ReduceOp::Avg)
        } else {
            Work::ready(Ok(u))
        };
        // 2. P, once the products have computed it; 3. Q.
        let (be1, plan1) = (be.clone(), plan.clone());
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
        // 4. Decompression, and the end of the lease.
        chain.zip(work_u).then(move |r| {
            let lease = hold(&held).take();
            let Some(lease) = lease else {
                return Err(Error::Bucket {
                    index,
                    why: "the PowerSGD step lost its memory lease".into(),
                }
                .into());
            };
            match r {
                Ok(((p, q, xs), u)) => {
                    decompress(&*be, lease, warm_start, &plan, (p, q, xs), u).map_err(Into::into)
                }
                // The lease puts the memories back as they were.
                Err(e) => Err(e),
            }
        })
    })
}

/// Error feedback and the first product of every batch: `X = G + E` in place, `P = X Q`
/// (or `P = G Q` without error feedback, `error` then `None`), with the step's
/// orthogonalised `q`. A stacked batch's matrices are copied into the stack first. The
/// error memory is only read.
fn first_products<B: CommBackend>(
    be: &B,
    plan: &Plan,
    error: Option<&B::Buffer<f32>>,
    x: &mut B::Buffer<f32>,
    mut stack: Option<&mut B::Buffer<f32>>,
    q: &B::Buffer<f32>,
    p: &mut B::Buffer<f32>,
) -> Result<()> {
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
        match error {
            Some(e) => be.add_mq(
                d,
                B::view_mut(src, xs)?,
                B::view(e, grp.e_range())?,
                B::view(q, qs)?,
                B::view_mut(p, ps)?,
            )?,
            None => be.mq(d, B::view(src, xs)?, B::view(q, qs)?, B::view_mut(p, ps)?)?,
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
    xs: &Matrices<B>,
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
/// the uncompressed means copied back, the step's factors copied into the memory for
/// warm start; all of it unless the reduced values are not finite, when only the
/// non-finite output is written (decided on the device, from the flag). The step's
/// buffers are kept for the next step, and the lease ends: the memory goes back, the
/// bucket is released and the iteration counted.
fn decompress<B: CommBackend>(
    be: &B,
    mut lease: Lease<B, LayerMemory<B>>,
    warm_start: bool,
    plan: &Plan,
    reduced: Products<B>,
    u: B::Buffer<f32>,
) -> Result<B::Buffer<f32>> {
    let (p, q, xs) = reduced;
    let Matrices {
        mut x,
        mut stack,
        mut flag,
    } = xs;
    // The reduced values are the same on every rank, so every rank raises the flag
    // alike. A NaN or an infinity in any rank's gradient reaches them: `P = X Q` of a
    // non-finite `X` is non-finite, and the orthogonalisation turns that matrix into NaN
    // (so `Q = Xᵀ P̂` is NaN too); the uncompressed means carry it as they are.
    for v in [&p, &q, &u] {
        be.flag_nonfinite(B::view(v, ..)?, B::view_mut(&mut flag, ..)?)?;
    }
    let index = lease.index();
    let m = lease.memory_mut().ok_or_else(|| no_memory(plan))?;
    for grp in &plan.groups {
        let (d, ps, qs, xr) = (grp.dims, grp.p_range(), grp.q_range(), grp.x_range());
        let src: &mut B::Buffer<f32> = match grp.x {
            Source::Bucket(_) => &mut x,
            Source::Stack(_) => stack.as_mut().ok_or_else(no_stack)?,
        };
        match m.error.as_mut() {
            Some(e) => be.pqt_error_unflagged(
                d,
                B::view(&p, ps)?,
                B::view(&q, qs)?,
                B::view_mut(src, xr)?,
                B::view_mut(e, grp.e_range())?,
                B::view(&flag, ..)?,
            )?,
            None => be.pqt(d, B::view(&p, ps)?, B::view(&q, qs)?, B::view_mut(src, xr)?)?,
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
            B::view(&u, at..at + len)?,
            B::view_mut(&mut x, off..off + len)?,
        )?;
        at += len;
    }
    if warm_start {
        // The memory takes the step's factors unless the flag is raised (a device-side
        // copy: no host wait).
        let f = m.factors.as_mut().ok_or_else(|| no_factors(index))?;
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
        // Without warm start the next step draws a new Q.
        m.factors = None;
    }
    m.work = Some((p, q));
    m.stack = stack;
    m.u = Some(u);
    lease.finish(be, flag)?;
    Ok(x)
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
fn reorder<B: CommBackend>(
    be: &B,
    index: usize,
    m: &mut LayerMemory<B>,
    plan: &Arc<Plan>,
) -> Result<()> {
    if m.error.is_none() && m.factors.is_none() {
        m.order = Some(plan.clone());
        return Ok(());
    }
    if let Some(old) = &m.order {
        if old.matrices() != plan.matrices() {
            return Err(Error::Bucket {
                index,
                why: format!(
                    "the compressed matrices changed (the memories are for {}, the bucket now has {}): the PowerSGD state cannot be applied",
                    old.matrices_str(),
                    plan.matrices_str()
                ),
            });
        }
    }
    let same = match &m.order {
        Some(old) => old.same_order(plan),
        None => plan.in_saved_order(),
    };
    if same {
        return Ok(());
    }
    let old = m.order.clone();
    let convert = |memory: Memory, buf: &mut B::Buffer<f32>| -> Result<()> {
        let mut v = vec![0.0; B::buffer_len(buf)];
        be.download(B::view(buf, ..)?, &mut v)?;
        if let Some(old) = &old {
            v = old.ours_to_saved(memory, &v)?;
        }
        *buf = be.upload(&plan.saved_to_ours(memory, &v)?)?;
        Ok(())
    };
    if let Some(e) = m.error.as_mut() {
        convert(Memory::Error, e)?;
    }
    if let Some(f) = m.factors.as_mut() {
        convert(Memory::P, &mut f.p)?;
        convert(Memory::Q, &mut f.q)?;
    }
    m.order = Some(plan.clone());
    Ok(())
}

/// The factors of a bucket that has memory (`start` has just made them): a bug, reported
/// rather than a panic.
fn no_factors(index: usize) -> Error {
    Error::Bucket {
        index,
        why: "the PowerSGD factors of this bucket are missing".into(),
    }
}

/// A lease without memory at decompression (`start` made it): a bug, reported.
fn no_memory(plan: &Plan) -> Error {
    Error::Kernel(format!(
        "a PowerSGD step of {} elements lost its bucket memory",
        plan.len
    ))
}

/// A stacked batch without a stacking buffer: a bug, reported rather than a panic.
fn no_stack() -> Error {
    Error::Kernel("a stacked PowerSGD batch has no stacking buffer".into())
}
