//! The collective layer of sharded runs: rank, world size and one primitive,
//! [`Collective::all_gather_bytes`]; every other operation (all-reduce sum and max,
//! all-gather, broadcast, barrier, agreement on errors) is built on it here, combining
//! contributions in rank order so that every rank gets bitwise the same result.
//! Engines: [`InProcess`] (ranks are threads), [`Mpi`] (feature `mpi`: processes under
//! `mpirun`), `cuda::Nccl` (feature `cuda`: one rank per GPU, with the CUDA backend)
//! and [`Solo`] (a group of one). An engine may override a provided operation with a native one (MPI's or
//! NCCL's all-reduce) as long as every rank gets the same result.

mod group;
mod in_process;
#[cfg(feature = "mpi")]
mod mpi;

pub use group::*;
pub use in_process::{InProcess, run_in_process};
#[cfg(feature = "mpi")]
pub use mpi::{Mpi, MpiRuntime};
