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
use collectives::DEFAULT_TIMEOUT;
use std::process::ExitCode;

fn main() -> ExitCode {
    mlp::cli::process_main(
        "train_dist",
        "tcp",
        || TcpGroup::from_env(DEFAULT_TIMEOUT).map_err(|e| e.to_string()),
        true,
    )
}
