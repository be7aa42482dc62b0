//! PowerSGD (Vogels et al., 2019) as a DDP communication hook, per layer: the behaviour
//! of PyTorch's `powerSGD_hook` with the choices of
//! `../shared/reference/powersgd.md` ("Our choices").
//!
//! One compressed step of a bucket, for each tensor `M` (`n x m`) that passes the
//! compression test:
//!
//! 1. the uncompressed tensors are all-reduced first, overlapping the compression work;
//! 2. error feedback and the first product in one pass: `X = G + E`, `P = X Q`;
//! 3. `P` is summed over the ranks, then orthogonalised;
//! 4. `Q = Xᵀ P̂`, averaged over the ranks;
//! 5. decompression and the error update in one pass: `M̂ = P̂ Qᵀ`, `E = X - M̂`;
//! 6. `Q` is kept for the next step (warm start).
//!
//! Iterations before `start_powersgd_iter` use the exact all-reduce. Error feedback
//! covers compressed tensors only (uncompressed ones are exact and carry no error), and a
//! zero column never becomes NaN.

mod batched;
mod config;
mod hook;
mod plan;
mod progress;
mod sequence;
mod state;

pub use batched::BatchedPowerSgd;
pub use config::PowerSgdConfig;
pub use hook::PowerSgd;
pub use state::PowerSgdState;
