//! A two-stage pipe on two ranks, checked bit for bit against the same pipe in one process.
//!
//! ```text
//! cargo run -p pipe --features collectives --example stages_on_ranks [-- --steps N]
//! cargo build -p pipe --features mpi --example stages_on_ranks
//! mpirun -np 2 target/debug/examples/stages_on_ranks --mpi [--steps N]
//! ```
//!
//! The model (Linear, a skip stashed, ReLU, Dropout, Linear | Linear, the skip added,
//! Linear) runs with stage `j` on rank `j`: two thread ranks of this process by default
//! (`collectives::run_local`), or the two processes of `mpirun` with `--mpi` (feature `mpi`),
//! over `pipe::GroupTransport`. Every rank builds the whole model from seeds and also runs
//! it in one process. For GPipe, 1F1B and a split forward/backward, each in every
//! checkpoint mode, a few SGD steps of 13 samples in 4 micro-batches (4, 3, 3, 3), each rank
//! compares what it holds: outputs and losses (the last stage's rank), input gradients (the
//! first stage's), its own partitions' parameter gradients and, after the update, their
//! parameters. One line per configuration; on any difference the first one is printed and
//! the program exits with status 1. Bad flags exit with status 2.

use std::sync::Arc;
use std::time::Duration;

use collectives::ProcessGroup;
use pipe::cpu::{CpuTensor, Dropout, Linear, ReLU};
use pipe::ndarray::Axis;
use pipe::{
    AddSkip, Batch, Checkpoint, Error, GroupTransport, Layer, MicroBatch, Pipe, PipeBuilder,
    ScheduleKind, StashInput, Transport,
};

const USAGE: &str = "usage: stages_on_ranks [--mpi] [--steps N]";
const BALANCE: [usize; 2] = [5, 3];
const BATCH: usize = 13;
const CHUNKS: usize = 4;
const SEED: u64 = 42;
const LR: f32 = 0.05;
/// The bound on the verdicts' exchange (the pipe has its own timeout).
const WAIT: Duration = Duration::from_secs(300);

type Layers = Vec<Box<dyn Layer<CpuTensor>>>;

fn model() -> Layers {
    vec![
        Box::new(Linear::new(6, 8, 1)),
        Box::new(StashInput::new("skip")),
        Box::new(ReLU),
        Box::new(Dropout::new(0.25).expect("a valid probability")),
        Box::new(Linear::new(8, 8, 2)),
        Box::new(Linear::new(8, 8, 3)),
        Box::new(AddSkip::new("skip")),
        Box::new(Linear::new(8, 3, 4)),
    ]
}

/// A `[rows, cols]` tensor of deterministic values in about [-1, 1].
fn data(rows: usize, cols: usize, salt: u64) -> CpuTensor {
    let rng = pipe::Stream::new(salt, 0, 0);
    let values = (0..rows * cols)
        .map(|k| 2.0 * rng.sample((k / cols) as u64).uniform((k % cols) as u64) - 1.0)
        .collect();
    CpuTensor::from_shape_vec(&[rows, cols], values).expect("the shape fits")
}

/// Half the squared error against `target`'s rows of this micro-batch: loss and gradient.
fn mse(
    target: &CpuTensor,
    mb: MicroBatch,
    out: &Batch<CpuTensor>,
) -> Result<(f32, Batch<CpuTensor>), Error> {
    let rows = target
        .array()
        .slice_axis(Axis(0), (mb.offset..mb.offset + mb.len).into());
    let g = CpuTensor::new(out.tensor(0)?.array() - &rows);
    let loss = g.array().iter().map(|v| 0.5 * v * v).sum();
    Ok((loss, Batch::single(g)))
}

#[derive(Clone, Copy)]
enum Drive {
    Step(ScheduleKind),
    Split,
}

/// One training step: output, input gradient and losses (empty where this rank holds none).
type Ran = (Batch<CpuTensor>, Batch<CpuTensor>, Vec<f32>);

fn train(
    pipe: &mut Pipe<CpuTensor>,
    drive: Drive,
    step: u64,
    first: bool,
    last: bool,
) -> Result<Ran, Error> {
    let target = data(BATCH, 3, 200 + step);
    let input = held(first, Batch::single(data(BATCH, 6, 100 + step)));
    if let Drive::Step(_) = drive {
        let out = pipe.step(input, |mb, out| mse(&target, mb, out))?;
        return Ok((out.output, out.input_grad, out.losses));
    }
    let output = pipe.forward(input)?;
    let (losses, grad) = if last {
        let (loss, grad) = mse(&target, MicroBatch::plan(BATCH, 1)?[0], &output)?;
        (vec![loss], grad)
    } else {
        (Vec::new(), Batch::new(Vec::new()))
    };
    let input_grad = pipe.backward(grad)?;
    Ok((output, input_grad, losses))
}

/// `b` where this rank holds it, else the empty batch.
fn held(here: bool, b: Batch<CpuTensor>) -> Batch<CpuTensor> {
    if here {
        b
    } else {
        Batch::new(Vec::new())
    }
}

/// `got == want` bit for bit, or where they first differ.
fn same(what: String, got: &[CpuTensor], want: &[CpuTensor]) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let i = got.iter().zip(want).position(|(g, w)| g != w);
    let i = i.unwrap_or(got.len().min(want.len()));
    let diff = got
        .get(i)
        .zip(want.get(i))
        .and_then(|(g, w)| g.max_abs_diff(w));
    let (n, m) = (got.len(), want.len());
    Err(format!("{what} differs at tensor {i} ({n} tensors on ranks, {m} in one process): max |difference| {diff:?}"))
}

fn tensors(b: &Batch<CpuTensor>) -> Vec<CpuTensor> {
    (0..b.len())
        .map(|i| b.tensor(i).expect("a tensor").clone())
        .collect()
}

fn scalars(losses: Vec<f32>) -> Vec<CpuTensor> {
    vec![CpuTensor::from_shape_vec(&[losses.len()], losses).expect("a vector")]
}

/// A partition's parameter gradients (`grad`) or values.
fn params(layers: &[Box<dyn Layer<CpuTensor>>], grad: bool) -> Vec<CpuTensor> {
    let pick = |p: pipe::Param<'_, CpuTensor>| (if grad { p.grad } else { p.value }).clone();
    layers
        .iter()
        .flat_map(|l| l.parameters().into_iter().map(pick))
        .collect()
}

fn sgd(pipe: &mut Pipe<CpuTensor>) {
    for layer in pipe.partitions_mut().iter_mut().flatten() {
        for p in layer.parameters_mut() {
            p.value.array_mut().scaled_add(-LR, p.grad.array());
        }
    }
    pipe.zero_grad();
}

/// One configuration on this rank (stage `rank`): `steps` steps on ranks and in one
/// process, compared.
fn check(
    transport: &Arc<dyn Transport>,
    drive: Drive,
    mode: Checkpoint,
    steps: u64,
) -> Result<(), String> {
    let rank = transport.rank();
    let configure = |b: PipeBuilder<CpuTensor>| {
        let b = b.chunks(CHUNKS).checkpoint(mode).seed(SEED);
        match drive {
            Drive::Step(kind) => b.schedule(kind),
            Drive::Split => b,
        }
    };
    let before: usize = BALANCE[..rank].iter().sum();
    let mine = model().into_iter().skip(before);
    let mine = mine.take(BALANCE[rank]).collect();
    let fail = |e: Error| e.to_string();
    let mut local = configure(Pipe::builder(model(), &BALANCE))
        .build()
        .map_err(fail)?;
    let mut ranked = configure(Pipe::builder(mine, &BALANCE))
        .stages_on_ranks(transport.clone())
        .build()
        .map_err(fail)?;
    let (first, last) = (rank == 0, rank == BALANCE.len() - 1);
    for step in 0..steps {
        let at = |what: &str| format!("step {step}: {what}");
        let want = train(&mut local, drive, step, true, true)
            .map_err(|e| at(&format!("one process: {e}")))?;
        let got = train(&mut ranked, drive, step, first, last)
            .map_err(|e| at(&format!("on ranks: {e}")))?;
        let want_losses = if last { want.2 } else { Vec::new() };
        let part = |p: &Pipe<CpuTensor>, grad| params(&p.partitions()[rank], grad);
        let checks = [
            ("the output", tensors(&got.0), tensors(&held(last, want.0))),
            (
                "the input gradient",
                tensors(&got.1),
                tensors(&held(first, want.1)),
            ),
            ("the losses", scalars(got.2), scalars(want_losses)),
            ("the gradients", part(&ranked, true), part(&local, true)),
        ];
        for (what, got, want) in checks {
            same(at(what), &got, &want)?;
        }
        sgd(&mut ranked);
        sgd(&mut local);
        let (got, want) = (part(&ranked, false), part(&local, false));
        same(at("the parameters after the update"), &got, &want)?;
    }
    Ok(())
}

/// Every configuration on this rank of `group`'s two; rank 0 prints each verdict (the
/// ranks exchange theirs). Returns whether both agreed with one process throughout.
fn run(group: Arc<dyn ProcessGroup>, steps: u64) -> Result<bool, String> {
    let transport: Arc<dyn Transport> = Arc::new(GroupTransport::new(group.clone()));
    let tag = pipe::group_transport::DEFAULT_TAG - 1;
    let verdicts = GroupTransport::new(group)
        .with_tag(tag)
        .map_err(|e| e.to_string())?;
    let (rank, peer) = (verdicts.rank(), 1 - verdicts.rank());
    let drives = [
        ("gpipe", Drive::Step(ScheduleKind::GPipe)),
        ("1f1b", Drive::Step(ScheduleKind::OneFOneB)),
        ("split", Drive::Split),
    ];
    let modes = [
        ("always", Checkpoint::Always),
        ("except-last", Checkpoint::ExceptLast),
        ("never", Checkpoint::Never),
    ];
    for (drive_name, drive) in drives {
        for (mode_name, mode) in modes {
            let mine = check(&transport, drive, mode, steps)
                .err()
                .unwrap_or_default();
            let error = |e: pipe::TransportError| format!("the verdicts' exchange: {e}");
            verdicts
                .send(peer, mine.clone().into_bytes())
                .map_err(error)?;
            let theirs =
                String::from_utf8_lossy(&verdicts.recv(peer, WAIT).map_err(error)?).into_owned();
            verdicts.flush(WAIT).map_err(error)?;
            let name = format!("{drive_name} {mode_name}");
            let mut both = [mine, theirs];
            both.swap(0, rank); // now in rank order
            if let Some((r, why)) = both.iter().enumerate().find(|(_, v)| !v.is_empty()) {
                if rank == 0 {
                    println!("FAILED {name}: rank {r}: {why}");
                }
                return Ok(false);
            }
            if rank == 0 {
                println!(
                    "ok {name} ({steps} steps, batch {BATCH} in {CHUNKS} micro-batches, 2 ranks)"
                );
            }
        }
    }
    Ok(true)
}

#[cfg(feature = "mpi")]
fn mpi_run(steps: u64) -> Result<bool, String> {
    let world = collectives::mpi::MpiGroup::world().map_err(|e| format!("MPI: {e}"))?;
    if world.size() != 2 {
        return Err(format!(
            "--mpi needs 2 processes (mpirun -np 2), got {}",
            world.size()
        ));
    }
    run(Arc::new(world), steps)
}

#[cfg(not(feature = "mpi"))]
fn mpi_run(_steps: u64) -> Result<bool, String> {
    unreachable!("`args` refuses --mpi without the `mpi` feature")
}

fn args() -> Result<(bool, u64), lexopt::Error> {
    use lexopt::prelude::*;
    let (mut mpi, mut steps) = (false, 3);
    let mut p = lexopt::Parser::from_env();
    while let Some(arg) = p.next()? {
        match arg {
            Long("mpi") if cfg!(feature = "mpi") => mpi = true,
            Long("mpi") => return Err("--mpi needs the `mpi` feature (--features mpi)".into()),
            Long("steps") => steps = p.value()?.parse()?,
            Long("help") | Short('h') => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(other.unexpected()),
        }
    }
    match steps {
        0 => Err("--steps: expected a positive integer".into()),
        _ => Ok((mpi, steps)),
    }
}

fn main() {
    let (mpi, steps) = args().unwrap_or_else(|why| {
        eprintln!("stages_on_ranks: {why}\n{USAGE}");
        std::process::exit(2)
    });
    let result = if mpi {
        mpi_run(steps)
    } else {
        let ranks =
            collectives::run_local(2, |g| run(Arc::new(g), steps)).map_err(|e| e.to_string());
        ranks.and_then(|all| {
            all.into_iter()
                .try_fold(true, |ok, r| Ok(r.map_err(|e| e.to_string())?? && ok))
        })
    };
    match result {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(why) => {
            eprintln!("stages_on_ranks: {why}");
            std::process::exit(1)
        }
    }
}
