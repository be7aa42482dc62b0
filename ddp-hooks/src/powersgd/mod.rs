//! PowerSGD (Vogels et al., 2019) as a DDP communication hook, per layer: the behaviour
//! of PyTorch's `powerSGD_hook`; where ours differs (zero columns, the fused passes)
//! the list below says so.
//!
//! One compressed step of a bucket, for each tensor `M` (`n x m`) that passes the
//! compression test:
//!
//! 1. `Q` (the previous step's under warm start, else a random one) is orthogonalised,
//!    and any zero column it has is refilled with counter-based values
//!    ([`lowrank::refill_value`]), the same on every rank, and orthogonalised again;
//! 2. the uncompressed tensors' all-reduce is launched before the products, so it
//!    overlaps them (when earlier buckets are still issuing their collectives, it is
//!    launched as soon as they are done, and the products overlap their communication);
//! 3. error feedback and the first product in one pass: `X = G + E`, `P = X Q`;
//! 4. `P` is summed over the ranks, then orthogonalised;
//! 5. `Q = Xᵀ P̂`, averaged over the ranks;
//! 6. decompression and the error update in one pass: `M̂ = P̂ Qᵀ`, `E = X - M̂`;
//! 7. `Q` is kept for the next step (warm start).
//!
//! With `batch_tensors_with_same_shape`, each step runs once per shape instead of once
//! per tensor: the same-shape tensors of a bucket form one batch of `lowrank`'s kernels
//! (in place when they lie one after another in the bucket, else stacked by copy), with
//! the same results, random draws and saved state as without (see
//! [`PowerSgdConfig::batch_tensors_with_same_shape`]).
//!
//! Iterations before `start_powersgd_iter` use the exact all-reduce. Error feedback
//! covers compressed tensors only (uncompressed ones are exact and carry no error), and a
//! zero column never becomes NaN.
//!
//! **Zero columns recover.** Gram-Schmidt sets a column of `P` or `Q` that depends on the
//! others to exactly zero (an all-zero gradient, say from a layer unused in a step, or
//! one of lower rank than `r`). Under warm start a zero column of `Q` would give a zero
//! column of `P` and again of `Q`, forever: the approximation would keep fewer than `r`
//! directions, none after an all-zero step. So a zero column of `Q` is refilled before it
//! is used ([`lowrank::Backend::orthogonalize_refill`]), with counter-based values keyed
//! by bucket and step ([`lowrank::refill_value`]): every rank holds the same `Q`, so every
//! rank refills the same columns with the same bits, on every backend, and nothing is
//! drawn from the random stream (which PyTorch's `torch.randn` state corresponds to), so
//! a refill never shifts later draws. A column whose norm after Gram-Schmidt is at most
//! `8 ε` of its norm before counts as zero (PyTorch would normalise that remainder, noise
//! included). The batched hook does the same.

mod batched;
mod config;
mod core;
mod hook;
mod memory;
mod plan;
mod progress;
mod state;
mod step;

pub use batched::BatchedPowerSgd;
pub use config::PowerSgdConfig;
pub use hook::PowerSgd;
pub use state::{PowerSgdState, SavedBucket};
