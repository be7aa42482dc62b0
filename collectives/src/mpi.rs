//! The MPI backend (feature `mpi`): placeholder until written.
