//! Your own training loop, on GPUs or CPUs, started by `torchrun`, `launch` or `srun`: the
//! code the user's guide (`docs/guide.md`) walks through.
//!
//! A two-layer linear network (`y = W2 W1 x`) learns a teacher's weights. Its forward and
//! backward passes run on the training device through `lowrank`'s kernels (`P = M Q` is
//! a layer's forward for a batch of columns, `M = P Qᵀ` its weight gradient), standing
//! in for your framework's; everything around them is what a real job needs:
//!
//! 1. the process group from the launcher's variables (`NcclGroup::from_env` on GPUs,
//!    `TcpGroup::from_env` on CPUs), one rank per process;
//! 2. the compute backend on a stream of the group's CUDA context
//!    (`CudaBackend::from_stream`), or `CpuBackend`;
//! 3. the reducer with a hook from a spec in PyTorch's names, and DDP's broadcast of
//!    rank 0's parameters before the first step (`Reducer::broadcast_parameters`);
//! 4. gradient accumulation (`accum::Accumulator`: only the last micro-step of each
//!    optimizer step communicates);
//! 5. checkpoints that resume bit for bit: parameters, the hook's state
//!    (`CommHook::save_state`) and the bucket assignment (`Reducer::bucket_params`).
//!
//! ```sh
//! cargo build --release -p collectives --bin launch
//! cargo build --release -p ddp-hooks --example own_loop --features cuda   # GPUs
//! torchrun --no-python --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
//!     --rdzv-endpoint node0:29400 --rdzv-id job1 \
//!     target/release/examples/own_loop --backend cuda --checkpoint ckpt --save-every 100
//! # CPUs, four processes on this host:
//! cargo build --release -p ddp-hooks --example own_loop
//! target/release/launch -n 4 -- target/release/examples/own_loop --backend cpu
//! ```
//!
//! Every rank prints one line at the end with the digest of its parameters (equal
//! digests, identical models); the run fails (status 1) unless the held-out loss fell to
//! under a tenth of its start.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use accum::Accumulator;
use collectives::ProcessGroup;
use ddp_hooks::{CommBackend, CommHook, HookSpec, HookState, Reducer, ReducerConfig};
use lowrank::{Backend, Dims, NormalRng};
use serde::{Deserialize, Serialize};

/// Input, hidden and output widths, and the samples of one micro-batch (the columns of
/// `x`: at most `lowrank::MAX_RANK`).
const D: usize = 64;
const H: usize = 96;
const O: usize = 32;
const BATCH: usize = 32;
/// Parameter shapes in forward order: `W1` (`H x D`), `W2` (`O x H`), row-major.
const SHAPES: [[usize; 2]; 2] = [[H, D], [O, H]];

const USAGE: &str = "\
own_loop [--backend cpu|cuda] [--steps N] [--accumulate K] [--lr X] [--hook SPEC]
         [--checkpoint DIR [--save-every K] [--resume]]
  --backend     cuda: NCCL and the GPU of LOCAL_RANK (needs --features cuda); cpu: TCP
                (default: cuda when built with it, else cpu)
  --steps       optimizer steps (default 200)
  --accumulate  micro-steps per optimizer step (default 2)
  --lr          learning rate (default 0.05)
  --hook        a hook spec, PyTorch's names welcome
                (default powersgd:matrix_approximation_rank=2,start_powerSGD_iter=20)
  --checkpoint  folder of the checkpoints (rank<R>.json); --save-every K saves every K
                steps; --resume continues from the saved step when every rank has one
                (else starts afresh), as torchrun --max-restarts needs";

/// The parsed arguments.
struct Args {
    cuda: bool,
    steps: usize,
    accumulate: usize,
    lr: f32,
    hook: String,
    checkpoint: Option<PathBuf>,
    save_every: Option<usize>,
    resume: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        cuda: cfg!(feature = "cuda"),
        steps: 200,
        accumulate: 2,
        lr: 0.05,
        hook: "powersgd:matrix_approximation_rank=2,start_powerSGD_iter=20".into(),
        checkpoint: None,
        save_every: None,
        resume: false,
    };
    let mut p = lexopt::Parser::from_env();
    let count = |p: &mut lexopt::Parser, name: &str| -> Result<usize, String> {
        let v = p.value().map_err(|e| e.to_string())?;
        let v = v.to_string_lossy();
        v.parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or(format!("{name} {v}: expected a positive integer"))
    };
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        use lexopt::Arg::Long;
        match arg {
            Long("backend") => {
                a.cuda = match p.value().map_err(|e| e.to_string())?.to_str() {
                    Some("cuda") => true,
                    Some("cpu") => false,
                    other => return Err(format!("--backend {other:?}: cpu or cuda")),
                }
            }
            Long("steps") => a.steps = count(&mut p, "--steps")?,
            Long("accumulate") => a.accumulate = count(&mut p, "--accumulate")?,
            Long("save-every") => a.save_every = Some(count(&mut p, "--save-every")?),
            Long("lr") => {
                let v = p.value().map_err(|e| e.to_string())?;
                a.lr = v
                    .to_str()
                    .and_then(|v| v.parse().ok())
                    .filter(|x: &f32| x.is_finite() && *x > 0.0)
                    .ok_or(format!("--lr {v:?}: expected a positive number"))?;
            }
            Long("hook") => {
                a.hook = p
                    .value()
                    .map_err(|e| e.to_string())?
                    .to_string_lossy()
                    .into()
            }
            Long("checkpoint") => a.checkpoint = Some(p.value().map_err(|e| e.to_string())?.into()),
            Long("resume") => a.resume = true,
            other => return Err(other.unexpected().to_string()),
        }
    }
    if (a.save_every.is_some() || a.resume) && a.checkpoint.is_none() {
        return Err("--save-every and --resume need --checkpoint DIR".into());
    }
    if a.cuda && !cfg!(feature = "cuda") {
        return Err("--backend cuda: build with --features cuda".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("own_loop: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("own_loop: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The timeout of the rendezvous and of every collective.
const TIMEOUT: Duration = Duration::from_secs(300);

fn run(args: &Args) -> Result<(), String> {
    let spec: HookSpec = args
        .hook
        .parse()
        .map_err(|e: ddp_hooks::Error| e.to_string())?;
    if args.cuda {
        return run_cuda(args, &spec);
    }
    // 1. One rank per process over TCP: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from
    //    launch, torchrun (its agent's store) or srun.
    let group = collectives::tcp::TcpGroup::from_env(TIMEOUT).map_err(|e| e.to_string())?;
    // 2. The compute backend.
    let backend = Arc::new(lowrank::CpuBackend::new());
    train(backend, Arc::new(group), &spec, args)
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &Args, spec: &HookSpec) -> Result<(), String> {
    use collectives::nccl::NcclGroup;
    // 1. NCCL on the GPU of LOCAL_RANK; the unique id goes through the store.
    let group = NcclGroup::from_env(TIMEOUT).map_err(|e| e.to_string())?;
    // 2. The backend's work on a stream of the group's own context: one context per device,
    //    so cudarc's cross-stream event tracking sees both sides. A framework would pass
    //    its own stream here instead.
    let stream = group
        .stream()
        .context()
        .new_stream()
        .map_err(|e| format!("creating a stream: {e}"))?;
    let backend = Arc::new(lowrank::CudaBackend::from_stream(stream).map_err(|e| e.to_string())?);
    train(backend, Arc::new(group), spec, args)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &Args, _: &HookSpec) -> Result<(), String> {
    unreachable!("parse refuses --backend cuda without the feature")
}

/// One rank's checkpoint.
#[derive(Serialize, Deserialize)]
struct Checkpoint {
    /// Optimizer steps done.
    step: usize,
    /// The parameters (host copies, row-major).
    params: Vec<Vec<f32>>,
    /// The hook's state (PowerSGD's error memories and `Q`s, its step and random state).
    hook: HookState,
    /// The reducer's bucket assignment, which the hook's state is keyed by.
    buckets: Vec<Vec<usize>>,
}

fn checkpoint_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank{rank}.json"))
}

/// The training loop, the same on every backend.
fn train<B: CommBackend>(
    be: Arc<B>,
    group: Arc<dyn ProcessGroup>,
    spec: &HookSpec,
    args: &Args,
) -> Result<(), String> {
    let e = |e: ddp_hooks::Error| e.to_string();
    let l = |e: lowrank::Error| e.to_string();
    let rank = group.rank();
    let shapes: Vec<Vec<usize>> = SHAPES.iter().map(|s| s.to_vec()).collect();
    // 3. The hook and the reducer (whose process group broadcasts rank 0's bucket order
    //    at the first rebuild and rank 0's parameters below).
    let hook = spec.build(be.clone(), group.clone()).map_err(e)?;
    let mut reducer = Reducer::new(be.clone(), &shapes, hook, ReducerConfig::default())
        .map_err(e)?
        .with_process_group(group.clone());

    // Each rank initialises differently, as separate processes would; DDP broadcasts
    // rank 0's parameters before the first step, or a resumed run loads its own.
    let mut host: Vec<Vec<f32>> = SHAPES
        .iter()
        .enumerate()
        .map(|(p, [rows, cols])| {
            let mut w = vec![0.0; rows * cols];
            NormalRng::new(1000 + rank as u64 * 10 + p as u64).fill(&mut w);
            let scale = 1.0 / (*cols as f32).sqrt();
            w.iter_mut().for_each(|x| *x *= scale);
            w
        })
        .collect();
    let mut start = 0;
    let saved = match (&args.checkpoint, args.resume) {
        (Some(dir), true) => resume_point(&*group, dir)?,
        _ => None,
    };
    match saved {
        Some(c) => {
            // 5. Resume: parameters, the bucket assignment, then the hook's state.
            if c.params.iter().map(Vec::len).ne(host.iter().map(Vec::len)) {
                return Err("the checkpoint's parameters have other shapes".into());
            }
            host = c.params;
            reducer.set_bucket_params(c.buckets).map_err(e)?;
            reducer.hook().load_state(c.hook).map_err(e)?;
            start = c.step;
        }
        None => {
            let mut views: Vec<&mut [f32]> = host.iter_mut().map(|w| w.as_mut_slice()).collect();
            reducer.broadcast_parameters(&mut views).map_err(e)?;
        }
    }
    let mut weights: Vec<B::Buffer<f32>> = host
        .iter()
        .map(|w| be.upload(w))
        .collect::<lowrank::Result<_>>()
        .map_err(l)?;

    // The teacher, the same on every rank; each rank draws its own samples.
    let teacher: Vec<B::Buffer<f32>> = SHAPES
        .iter()
        .enumerate()
        .map(|(p, [rows, cols])| {
            let mut w = vec![0.0; rows * cols];
            NormalRng::new(7 + p as u64).fill(&mut w);
            let scale = 1.0 / (*cols as f32).sqrt();
            w.iter_mut().for_each(|x| *x *= scale);
            be.upload(&w)
        })
        .collect::<lowrank::Result<_>>()
        .map_err(l)?;
    let mut s = Scratch::new(&*be).map_err(l)?;
    let held_out = u64::MAX; // a batch no rank trains on
    let initial = s.loss(&*be, &weights, &teacher, held_out).map_err(l)?;

    // 4. Accumulation: K micro-steps per optimizer step, only the last communicates.
    let mut acc = Accumulator::new(args.accumulate).map_err(|e| e.to_string())?;
    let k = args.accumulate;
    let mut step = start;
    let micro_seed = |micro: usize| ((rank as u64) << 40) ^ micro as u64;
    for (micro_step, micro) in acc.epoch(start * k..args.steps * k) {
        s.forward_backward(&*be, &weights, &teacher, micro_seed(micro))
            .map_err(l)?;
        {
            let mut r = micro_step.apply(&mut reducer);
            // Gradients are handed to the reducer in backward order, each bucket launched
            // as soon as its last gradient is marked.
            for p in (0..SHAPES.len()).rev() {
                be.scale(
                    B::view_mut(&mut s.grads[p], ..).map_err(l)?,
                    micro_step.loss_scale(),
                )
                .map_err(l)?;
                let g = r.grad_mut(p).map_err(e)?;
                be.add(g, B::view(&s.grads[p], ..).map_err(l)?).map_err(l)?;
                r.mark_ready(p).map_err(e)?;
            }
            r.finish().map_err(e)?;
        }
        if !micro_step.sync_gradients() {
            continue;
        }
        // SGD on the reduced (averaged) gradients.
        for (p, w) in weights.iter_mut().enumerate() {
            let g = reducer.grad(p).map_err(e)?;
            be.copy(g, B::view_mut(&mut s.grads[p], ..).map_err(l)?)
                .map_err(l)?;
            be.scale(B::view_mut(&mut s.grads[p], ..).map_err(l)?, -args.lr)
                .map_err(l)?;
            be.add(
                B::view_mut(w, ..).map_err(l)?,
                B::view(&s.grads[p], ..).map_err(l)?,
            )
            .map_err(l)?;
        }
        reducer.zero_grad().map_err(e)?;
        step += 1;
        if let (Some(dir), Some(every)) = (&args.checkpoint, args.save_every) {
            if step % every == 0 && step < args.steps {
                save(&*be, dir, rank, step, &weights, &reducer)?;
            }
        }
    }
    let fin = s.loss(&*be, &weights, &teacher, held_out).map_err(l)?;
    let host = download_all(&*be, &weights)?;
    println!(
        "own_loop: rank {rank} on {}: steps {start}..{}, held-out loss {initial:.6} -> {fin:.6}, digest {:016x}",
        be.name(),
        args.steps,
        digest(&host)
    );
    // Written so that a NaN loss fails too.
    let trained = fin < 0.1 * initial;
    if start == 0 && !trained {
        return Err(format!(
            "the loss fell from {initial} to {fin} only: not trained"
        ));
    }
    Ok(())
}

/// This rank's checkpoint, when every rank has one of the same step; `None` when no rank
/// has one (a fresh start); an error when the ranks' checkpoints disagree.
fn resume_point(group: &dyn ProcessGroup, dir: &Path) -> Result<Option<Checkpoint>, String> {
    let path = checkpoint_path(dir, group.rank());
    let mine = match std::fs::read_to_string(&path) {
        Ok(text) => Some(
            serde_json::from_str::<Checkpoint>(&text)
                .map_err(|e| format!("{}: {e}", path.display()))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let step = mine.as_ref().map_or(-1.0, |c| c.step as f64);
    let steps = group
        .all_gather(collectives::Buffer::F64(vec![step]))
        .wait_timeout(group.timeout())
        .map_err(|e| format!("agreeing on the step to resume from: {e}"))?
        .into_iter()
        .map(|b| Vec::<f64>::try_from(b).map(|v| v.first().copied().unwrap_or(f64::NAN)))
        .collect::<collectives::Result<Vec<f64>>>()
        .map_err(|e| e.to_string())?;
    match steps.iter().all(|&s| s == steps[0]) {
        true => Ok(mine),
        false => Err(format!(
            "{}: the ranks' checkpoints are of different steps ({steps:?}; -1: none)",
            dir.display()
        )),
    }
}

/// Writes this rank's checkpoint (to a temporary file, renamed into place).
fn save<B: CommBackend, H: CommHook<B>>(
    be: &B,
    dir: &Path,
    rank: usize,
    step: usize,
    weights: &[B::Buffer<f32>],
    reducer: &Reducer<B, H>,
) -> Result<(), String> {
    let c = Checkpoint {
        step,
        params: download_all(be, weights)?,
        hook: reducer.hook().save_state().map_err(|e| e.to_string())?,
        buckets: reducer.bucket_params(),
    };
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = checkpoint_path(dir, rank);
    let tmp = path.with_extension("json.tmp");
    let text = serde_json::to_string(&c).map_err(|e| e.to_string())?;
    std::fs::write(&tmp, text).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &path).map_err(|e| format!("{}: {e}", path.display()))
}

fn download_all<B: Backend>(be: &B, bufs: &[B::Buffer<f32>]) -> Result<Vec<Vec<f32>>, String> {
    bufs.iter()
        .map(|b| {
            let mut host = vec![0.0; B::buffer_len(b)];
            be.download(B::view(b, ..)?, &mut host)?;
            Ok(host)
        })
        .collect::<lowrank::Result<_>>()
        .map_err(|e| e.to_string())
}

/// FNV-1a over the parameters' bits.
fn digest(params: &[Vec<f32>]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in params
        .iter()
        .flatten()
        .flat_map(|x| x.to_bits().to_le_bytes())
    {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The device buffers of one micro-batch's forward and backward passes. Activations are
/// column-major, one sample a column, as `lowrank`'s thin factors are.
struct Scratch<B: Backend> {
    x: B::Buffer<f32>,
    y: B::Buffer<f32>,
    h: B::Buffer<f32>,
    r: B::Buffer<f32>,
    dh: B::Buffer<f32>,
    grads: Vec<B::Buffer<f32>>,
}

impl<B: Backend> Scratch<B> {
    fn new(be: &B) -> lowrank::Result<Self> {
        Ok(Scratch {
            x: be.alloc(D * BATCH)?,
            y: be.alloc(O * BATCH)?,
            h: be.alloc(H * BATCH)?,
            r: be.alloc(O * BATCH)?,
            dh: be.alloc(H * BATCH)?,
            grads: vec![be.alloc(H * D)?, be.alloc(O * H)?],
        })
    }

    /// Draws the batch `seed` and its teacher targets `y = T2 T1 x`, then the student's
    /// residual `r = W2 W1 x - y` (the gradient of half the squared error), leaving
    /// `W1 x` in `h`.
    fn forward(
        &mut self,
        be: &B,
        w: &[B::Buffer<f32>],
        teacher: &[B::Buffer<f32>],
        seed: u64,
    ) -> lowrank::Result<()> {
        be.fill_normal(&mut NormalRng::new(seed), B::view_mut(&mut self.x, ..)?)?;
        // Teacher: y = T2 (T1 x), through h; student: h = W1 x, r = W2 h; then r -= y.
        two_layers(be, teacher, &self.x, &mut self.h, &mut self.y)?;
        two_layers(be, w, &self.x, &mut self.h, &mut self.r)?;
        be.scale(B::view_mut(&mut self.y, ..)?, -1.0)?;
        be.add(B::view_mut(&mut self.r, ..)?, B::view(&self.y, ..)?)
    }

    /// The forward pass, then the weight gradients of the mean loss into `grads`:
    /// `dW2 = r hᵀ / n`, `dh = W2ᵀ r`, `dW1 = dh xᵀ / n`.
    fn forward_backward(
        &mut self,
        be: &B,
        w: &[B::Buffer<f32>],
        teacher: &[B::Buffer<f32>],
        seed: u64,
    ) -> lowrank::Result<()> {
        self.forward(be, w, teacher, seed)?;
        let (d1, d2) = (Dims::new(1, H, D, BATCH)?, Dims::new(1, O, H, BATCH)?);
        be.pqt(
            d2,
            B::view(&self.r, ..)?,
            B::view(&self.h, ..)?,
            B::view_mut(&mut self.grads[1], ..)?,
        )?;
        be.mtp(
            d2,
            B::view(&w[1], ..)?,
            B::view(&self.r, ..)?,
            B::view_mut(&mut self.dh, ..)?,
        )?;
        be.pqt(
            d1,
            B::view(&self.dh, ..)?,
            B::view(&self.x, ..)?,
            B::view_mut(&mut self.grads[0], ..)?,
        )?;
        let n = 1.0 / BATCH as f32;
        be.scale(B::view_mut(&mut self.grads[0], ..)?, n)?;
        be.scale(B::view_mut(&mut self.grads[1], ..)?, n)
    }

    /// Half the mean squared error on the batch `seed`.
    fn loss(
        &mut self,
        be: &B,
        w: &[B::Buffer<f32>],
        teacher: &[B::Buffer<f32>],
        seed: u64,
    ) -> lowrank::Result<f32> {
        self.forward(be, w, teacher, seed)?;
        let mut r = vec![0.0; O * BATCH];
        be.download(B::view(&self.r, ..)?, &mut r)?;
        Ok(r.iter().map(|x| x * x).sum::<f32>() / (2.0 * BATCH as f32))
    }
}

/// The network's forward pass with weights `w` on the batch `x`: `h = W1 x`, `out = W2 h`.
fn two_layers<B: Backend>(
    be: &B,
    w: &[B::Buffer<f32>],
    x: &B::Buffer<f32>,
    h: &mut B::Buffer<f32>,
    out: &mut B::Buffer<f32>,
) -> lowrank::Result<()> {
    let (d1, d2) = (Dims::new(1, H, D, BATCH)?, Dims::new(1, O, H, BATCH)?);
    be.mq(
        d1,
        B::view(&w[0], ..)?,
        B::view(x, ..)?,
        B::view_mut(h, ..)?,
    )?;
    be.mq(
        d2,
        B::view(&w[1], ..)?,
        B::view(h, ..)?,
        B::view_mut(out, ..)?,
    )
}
