//! The `train` example across processes: one rank per process under `mpirun`, over the
//! MPI process group (`collectives::mpi`), so a CPU cluster runs exactly the loop the
//! thread ranks run. `cargo xtask train --backend mpi` builds it, runs it under
//! `mpirun -np N` and checks its final loss against the thread backend's.
//!
//! ```sh
//! cargo build --release -p ddp-hooks --example train_mpi --features collectives/mpi
//! mpirun -np 4 target/release/examples/train_mpi --steps 300 --hook powersgd:rank=2,start_iter=10
//! ```
//!
//! Arguments as `train`'s, less `--ranks` (the world's size) and `--compare`; rank 0
//! prints.

#[path = "mlp/mod.rs"]
mod mlp;

use collectives::mpi::MpiGroup;
use collectives::{ProcessGroup, DEFAULT_TIMEOUT};
use mlp::{cli, trainer};
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(a) = args.iter().find(|a| *a == "--ranks" || *a == "--compare") {
        eprintln!("train_mpi: {a} is not for MPI runs (the world's size is the rank count)");
        return ExitCode::from(2);
    }
    let world = match MpiGroup::init(DEFAULT_TIMEOUT) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("train_mpi: MPI: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rank = world.rank();
    let c = match cli::parse(&args, world.size()) {
        Ok(c) => c,
        Err(e) => {
            if rank == 0 {
                eprintln!("train_mpi: {e}\n\n{}", cli::USAGE);
            }
            return ExitCode::from(2);
        }
    };
    if rank == 0 {
        if let Some(note) = cli::start_iter_note(&c.config) {
            eprintln!("train_mpi: {note}");
        }
        cli::print_start(c.json, &c.config, "mpi");
    }
    let json = c.json;
    // The group moves into the run and is dropped (MPI finalised) when it ends.
    match trainer::run_rank(world, &c.config, &c.plan, &|e| cli::print_event(json, e)) {
        Ok(out) => {
            if rank == 0 {
                cli::print_done(c.json, &c.config, &out);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("train_mpi: rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}
