//! The `train` example across processes on CPU, one rank per process over TCP
//! (`collectives::tcp::TcpGroup`, gloo's role): the loop the thread ranks run, started by
//! any launcher that sets torch.distributed's variables. Under `torchrun` the ranks meet
//! at the elastic agent's own store; with `--elastic DIR --save-every K` a run restarted
//! by `torchrun --max-restarts N` resumes from the newest checkpoint every rank saved.
//!
//! ```sh
//! cargo build --release -p collectives --bin launch
//! cargo build --release -p ddp-hooks --example train_dist
//! # our launcher, one node:
//! target/release/launch -n 4 -- target/release/examples/train_dist --steps 300 \
//!     --hook powersgd:rank=2,start_iter=10
//! # PyTorch's, with restarts after a failure:
//! torchrun --no-python --standalone --nproc-per-node 4 --max-restarts 3 \
//!     target/release/examples/train_dist --steps 300 --elastic ckpt --save-every 20
//! ```
//!
//! Arguments as `train`'s, less `--ranks` (the world's size) and `--compare`; rank 0
//! prints, and every rank ends with the digest of its final parameters (equal digests,
//! identical models).

#[path = "mlp/mod.rs"]
mod mlp;

use collectives::tcp::TcpGroup;
use collectives::{ProcessGroup, DEFAULT_TIMEOUT};
use mlp::{cli, trainer};
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(a) = args.iter().find(|a| *a == "--ranks" || *a == "--compare") {
        eprintln!(
            "train_dist: {a} is not for multi-process runs (the world's size is the rank count)"
        );
        return ExitCode::from(2);
    }
    let world = match TcpGroup::from_env(DEFAULT_TIMEOUT) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("train_dist: joining the job: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rank = world.rank();
    let c = match cli::parse(&args, world.size()) {
        Ok(c) => c,
        Err(e) => {
            if rank == 0 {
                eprintln!("train_dist: {e}\n\n{}", cli::USAGE);
            }
            return ExitCode::from(2);
        }
    };
    if rank == 0 {
        if let Some(note) = cli::start_iter_note(&c.config) {
            eprintln!("train_dist: {note}");
        }
        cli::print_start(c.json, &c.config, "tcp");
    }
    let json = c.json;
    match trainer::run_rank(world, &c.config, &c.plan, &|e| cli::print_event(json, e)) {
        Ok(out) => {
            if rank == 0 {
                cli::print_done(c.json, &c.config, &out);
            }
            println!(
                "train_dist: rank {rank} started at step {} digest {:016x}",
                out.start_step, out.digest
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("train_dist: rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}
