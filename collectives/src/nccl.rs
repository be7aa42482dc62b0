//! The NCCL backend (feature `cuda`): placeholder until written.
