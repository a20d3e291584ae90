//! The ranks of a sharded run, built in one place for gradcheck and bench: `--ranks P`
//! threads of this process, every process of an `mpirun` job (`--collective mpi`), or
//! one rank on GPU 0 exchanging through NCCL (`--collective nccl`); and the thread
//! pools the ranks run on.

use clap::ValueEnum;
use flashloss::collective::Collective;
use std::time::Duration;

/// Which collective engine runs the ranks.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CollectiveKind {
    /// Ranks are threads of this process (`--ranks P`).
    InProcess,
    /// Ranks are the processes of an `mpirun` job.
    Mpi,
    /// One rank on GPU 0, exchanging through NCCL (a world of one).
    Nccl,
}

/// How a command runs, from `--collective` and `--ranks`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Ranks {
    /// Unsharded: no `--ranks`, in-process.
    Single,
    /// `--ranks P`: P ranks as threads of this process.
    InProcess(usize),
    /// This process is one rank of an `mpirun` job.
    Mpi,
    /// A world of one rank on GPU 0 whose collectives go through NCCL.
    Nccl,
}

impl Ranks {
    /// Checks `--ranks` against `--collective`; `Err` is the line to print (exit 2).
    pub fn new(kind: CollectiveKind, ranks: Option<usize>) -> Result<Self, String> {
        match (kind, ranks) {
            (CollectiveKind::InProcess, None) => Ok(Ranks::Single),
            (CollectiveKind::InProcess, Some(p)) => Ok(Ranks::InProcess(p)),
            (CollectiveKind::Mpi, Some(_)) => {
                Err("--ranks runs in-process ranks; under MPI the ranks are mpirun's -np".into())
            }
            (CollectiveKind::Mpi, None) => Ok(Ranks::Mpi),
            (CollectiveKind::Nccl, Some(p)) if p != 1 => {
                Err("--collective nccl runs a world of one rank (GPU 0)".into())
            }
            (CollectiveKind::Nccl, _) => Ok(Ranks::Nccl),
        }
    }
}

/// This process's rank of a world of processes (MPI, or NCCL's world of one).
pub struct World {
    /// The group; declared first, so it is dropped before the MPI runtime.
    comm: Box<dyn Collective>,
    /// MPI, finalized when the world is dropped.
    #[cfg(feature = "mpi")]
    mpi: Option<flashloss::collective::MpiRuntime>,
}

impl World {
    /// The group every rank of the world calls its collectives on.
    pub fn comm(&self) -> &dyn Collective {
        &*self.comm
    }

    /// Ranks of the world on this machine (they share its cores).
    pub fn local_ranks(&self) -> usize {
        #[cfg(feature = "mpi")]
        if let Some(runtime) = &self.mpi {
            return runtime.local_ranks();
        }
        1
    }
}

/// Joins the `mpirun` job as one of its ranks, whose collectives wait at most
/// `timeout`; `Err` is the line to print (exit 2).
#[cfg(feature = "mpi")]
pub fn mpi(timeout: Duration) -> Result<World, String> {
    let runtime = flashloss::collective::MpiRuntime::init().map_err(|e| e.to_string())?;
    Ok(World {
        comm: Box::new(runtime.world(timeout)),
        mpi: Some(runtime),
    })
}

/// Without feature `mpi`: the line saying so.
#[cfg(not(feature = "mpi"))]
pub fn mpi(_: Duration) -> Result<World, String> {
    Err("--collective mpi needs a build with `--features mpi`".into())
}

/// A world of one NCCL rank on GPU 0 whose collectives (and sub-groups') are aborted
/// when they outlive `timeout`. `Err` is the line to print (exit 2); the inner result
/// is the device's, which the run reports as its rank's error.
#[cfg(feature = "cuda")]
pub fn nccl(timeout: Duration) -> Result<flashloss::Result<World>, String> {
    let world = flashloss::cuda::Gpu::new(0)
        .map(std::sync::Arc::new)
        .and_then(flashloss::cuda::Nccl::solo)
        .map(|n| n.with_timeout(timeout));
    Ok(world.map(|comm| World {
        comm: Box::new(comm),
        #[cfg(feature = "mpi")]
        mpi: None,
    }))
}

/// Without feature `cuda`: the line saying so.
#[cfg(not(feature = "cuda"))]
pub fn nccl(_: Duration) -> Result<flashloss::Result<World>, String> {
    Err("--collective nccl needs a build with `--features cuda`".into())
}

/// Threads per rank when `ranks` ranks share this machine's cores.
pub fn threads_per_rank(threads: Option<usize>, ranks: usize) -> usize {
    threads.unwrap_or_else(|| (rayon::current_num_threads() / ranks.max(1)).max(1))
}

/// Runs `f` on a pool of `threads` threads (default: the global pool).
pub fn with_threads<T: Send>(threads: Option<usize>, f: impl FnOnce() -> T + Send) -> T {
    match threads {
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .expect("thread pool")
            .install(f),
        None => f(),
    }
}
