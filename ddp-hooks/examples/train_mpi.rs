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
use collectives::DEFAULT_TIMEOUT;
use std::process::ExitCode;

fn main() -> ExitCode {
    mlp::cli::process_main(
        "train_mpi",
        "mpi",
        || MpiGroup::init(DEFAULT_TIMEOUT).map_err(|e| format!("MPI: {e}")),
        false,
    )
}
