//! The MPI engine (feature `mpi`): ranks are processes started by `mpirun`, one
//! primitive, `MPI_Iallgatherv`, polled against a deadline.
//!
//! What MPI gives and what we add:
//! - a process that dies (signal, non-zero exit) makes `mpirun` kill the others;
//! - a panic in a rank aborts the job (`MPI_Abort`) from a panic hook, instead of
//!   unwinding into `MPI_Finalize` while its peers wait;
//! - a collective that waits past the timeout (a peer that hangs, or one that left
//!   cleanly while others still call collectives) prints which rank waited in what and
//!   aborts the job, so no rank waits forever.

use super::group::{Collective, split_bytes, split_members};
use crate::error::{Error, Result};
use mpi::Count;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator, CommunicatorCollectives};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Exit code of a job aborted by a rank's timeout or panic.
const ABORT_CODE: i32 = 3;

/// MPI, initialized for this process; finalizes when dropped. Create one, at the start
/// of `main`, before any [`Mpi`] group.
pub struct MpiRuntime {
    universe: Universe,
}

impl MpiRuntime {
    /// Initializes MPI (threads may call it one at a time) and installs a panic hook
    /// that aborts the whole job after printing the panic.
    pub fn init() -> Result<Self> {
        let fail = |reason: String| Err(Error::Collective { reason });
        let Some((universe, threading)) =
            mpi::initialize_with_threading(mpi::Threading::Serialized)
        else {
            return fail("MPI is already initialized in this process".into());
        };
        if threading < mpi::Threading::Serialized {
            return fail(format!(
                "the MPI library gives thread level {threading:?}; flashloss needs Serialized"
            ));
        }
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            eprintln!("flashloss: a rank panicked; aborting the MPI job");
            SimpleCommunicator::world().abort(ABORT_CODE);
        }));
        Ok(MpiRuntime { universe })
    }

    /// Processes of the job on this machine (they share its cores).
    pub fn local_ranks(&self) -> usize {
        self.universe.world().split_shared(0).size() as usize
    }

    /// The group of every process of the job, whose collectives wait at most `timeout`.
    pub fn world(&self, timeout: Duration) -> Mpi {
        Mpi::new(self.universe.world(), timeout)
    }
}

/// An MPI communicator. Every call holds the lock, so calls are serialized as the
/// thread level requires.
struct Comm(SimpleCommunicator);

// SAFETY: MPI is initialized with thread level Serialized (checked in `MpiRuntime::init`)
// and every use of the communicator goes through the `Mutex` in `Mpi`.
unsafe impl Send for Comm {}

/// One process's handle to an MPI group.
pub struct Mpi {
    comm: Mutex<Comm>,
    rank: usize,
    size: usize,
    timeout: Duration,
}

impl Mpi {
    fn new(comm: SimpleCommunicator, timeout: Duration) -> Self {
        Mpi {
            rank: comm.rank() as usize,
            size: comm.size() as usize,
            comm: Mutex::new(Comm(comm)),
            timeout,
        }
    }
}

/// Polls `request` until it completes; past `deadline`, aborts the job naming `what`.
fn wait_until<'a, R: ?Sized, S: mpi::request::Scope<'a>>(
    mut request: mpi::request::Request<'a, R, S>,
    comm: &SimpleCommunicator,
    deadline: Instant,
    what: &str,
) {
    let mut polls = 0u32;
    loop {
        match request.test() {
            Ok(_) => return,
            Err(pending) => request = pending,
        }
        if Instant::now() >= deadline {
            eprintln!(
                "flashloss: rank {} of {} waited past its timeout in {what}; a peer hung or left. Aborting the MPI job",
                comm.rank(),
                comm.size()
            );
            comm.abort(ABORT_CODE);
        }
        polls += 1;
        if polls < 1000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        let guard = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let comm = &guard.0;
        let deadline = Instant::now() + self.timeout;
        let len = [local.len() as u64];
        let mut lens = vec![0u64; self.size];
        mpi::request::scope(|scope| {
            let request = comm.immediate_all_gather_into(scope, &len[..], &mut lens[..]);
            wait_until(request, comm, deadline, "an all-gather of lengths");
        });
        let total: u64 = lens.iter().sum();
        if total > Count::MAX as u64 {
            return Err(Error::Collective {
                reason: format!(
                    "an all-gather of {total} bytes exceeds MPI's count limit of {}",
                    Count::MAX
                ),
            });
        }
        if total == 0 {
            return Ok(vec![Vec::new(); self.size]);
        }
        // An empty slice's dangling pointer (0x1) is Open MPI's MPI_IN_PLACE: send an
        // empty slice of a real buffer instead.
        let anchor = [0u8; 1];
        let local = if local.is_empty() {
            &anchor[..0]
        } else {
            local
        };
        let counts: Vec<Count> = lens.iter().map(|&l| l as Count).collect();
        let displs: Vec<Count> = counts
            .iter()
            .scan(0, |at, &c| {
                let start = *at;
                *at += c;
                Some(start)
            })
            .collect();
        let mut buf = vec![0u8; total as usize];
        {
            let mut partition = PartitionMut::new(&mut buf[..], &counts[..], &displs[..]);
            mpi::request::scope(|scope| {
                let request = comm.immediate_all_gather_varcount_into(scope, local, &mut partition);
                wait_until(request, comm, deadline, "an all-gather");
            });
        }
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| buf[d as usize..(d + c) as usize].to_vec())
            .collect())
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        // Meet first through the timed all-gather, so that MPI_Comm_split (which has
        // no timeout) only runs once every rank has arrived.
        let gathered = self.all_gather_bytes(&split_bytes(color, key))?;
        let members = split_members(&gathered, self.rank);
        let order = members.iter().position(|&m| m == self.rank).unwrap_or(0);
        let guard = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let sub = guard
            .0
            .split_by_color_with_key(Color::with_value(color as i32), order as i32)
            .ok_or_else(|| Error::Collective {
                reason: format!("MPI_Comm_split gave rank {} no group", self.rank),
            })?;
        Ok(Box::new(Mpi::new(sub, self.timeout)))
    }
}
