//! All-reduce bandwidth of the MPI backend, as `allreduce.rs` measures the thread backend:
//! run under `mpirun -np N` (`cargo xtask bench collectives` does, where Open MPI is
//! installed); rank 0 prints the rows. The memcpy reference runs on rank 0 with one
//! thread per rank while the other ranks wait.
//!
//! Arguments: `--quick`, `--json`.

#[path = "common/mod.rs"]
mod common;

use collectives::mpi::MpiGroup;
use collectives::{ProcessGroup, DEFAULT_TIMEOUT};

fn main() -> collectives::Result<()> {
    let argv: Vec<String> = std::env::args().collect();
    let quick = argv.iter().any(|a| a == "--quick");
    let json = argv.iter().any(|a| a == "--json");
    let reps = if quick { 3 } else { 5 };
    let g = MpiGroup::init(DEFAULT_TIMEOUT)?;
    let (rank, ranks) = (g.rank(), g.size());
    let memcpy = if rank == 0 {
        common::memcpy_reference(ranks, 7)
    } else {
        0.0
    };
    g.barrier().wait()?;
    if rank == 0 {
        common::header(json);
    }
    for bytes in common::sizes(quick) {
        let t = common::allreduce_time(&g, bytes, reps).as_secs_f64();
        if rank == 0 {
            common::row(json, "mpi", ranks, bytes, t, memcpy);
        }
    }
    Ok(())
}
