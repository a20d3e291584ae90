//! The NCCL engine (feature `cuda`): one rank per GPU. Bytes cross ranks through device
//! buffers on the GPU's stream: [`Collective::all_gather_bytes`] gathers every rank's
//! length, then the payloads padded to the longest, with `ncclAllGather`. A
//! communicator is bootstrapped over another group ([`Nccl::over`]: rank 0 makes the
//! NCCL id and the group shares it), so any engine that can start the processes or
//! threads (MPI, in-process) can start NCCL; a group of one needs none ([`Nccl::solo`]).

use super::Collective;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use cudarc::driver::CudaStream;
use cudarc::nccl::{Comm, Id};
use std::sync::{Arc, Mutex};

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Collective {
        reason: format!("NCCL {what}: {e:?}"),
    }
}

/// Whether NCCL's library (`libnccl.so`) can be loaded (checked before any call:
/// cudarc panics if a library it needs is missing).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to load the library.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// A communicator that may move between threads: NCCL allows a communicator to be used
/// from any thread as long as calls on it do not overlap, which the mutex guarantees.
struct SendComm(Comm);

// SAFETY: see above; every use goes through `Nccl::comm`'s mutex.
unsafe impl Send for SendComm {}

/// A group of ranks, one GPU each, that exchange data with NCCL.
pub struct Nccl {
    comm: Mutex<SendComm>,
    stream: Arc<CudaStream>,
    gpu: Arc<Gpu>,
    rank: usize,
    world_size: usize,
}

impl Nccl {
    /// A group of one rank on `gpu` (what a single-GPU machine checks).
    pub fn solo(gpu: Arc<Gpu>) -> Result<Self> {
        Self::from_id(gpu, 0, 1, None)
    }

    /// The ranks of `parent`, one per GPU (`gpu` is this rank's), with a communicator
    /// whose id rank 0 makes and `parent` shares. Every rank of `parent` must call it.
    pub fn over(parent: &dyn Collective, gpu: Arc<Gpu>) -> Result<Self> {
        let local = if parent.rank() == 0 {
            id_bytes(&new_id()?)
        } else {
            Vec::new()
        };
        let gathered = parent.all_gather_bytes(&local)?;
        let id = id_from(&gathered[0])?;
        Self::from_id(gpu, parent.rank(), parent.world_size(), Some(id))
    }

    fn from_id(gpu: Arc<Gpu>, rank: usize, world_size: usize, id: Option<Id>) -> Result<Self> {
        if !nccl_present() {
            return Err(Error::Collective {
                reason: "no NCCL library found (libnccl.so): install the nvidia-nccl wheel, \
                         put its lib folder on LD_LIBRARY_PATH and link libnccl.so to its \
                         libnccl.so.2"
                    .into(),
            });
        }
        let id = match id {
            Some(id) => id,
            None => new_id()?,
        };
        let stream = gpu.stream().clone();
        let comm = Comm::from_rank(stream.clone(), rank, world_size, id).map_err(|e| {
            nccl_error(
                &format!("ncclCommInitRank (rank {rank} of {world_size})"),
                e,
            )
        })?;
        Ok(Nccl {
            comm: Mutex::new(SendComm(comm)),
            stream,
            gpu,
            rank,
            world_size,
        })
    }

    /// `ncclAllGather` of `local` (the same length on every rank).
    fn all_gather_equal(&self, local: &[u8]) -> Result<Vec<u8>> {
        let send = self.gpu.upload(local)?;
        let mut recv = self.gpu.zeros::<u8>(local.len() * self.world_size)?;
        {
            let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
            comm.0
                .all_gather(send.slice(), recv.slice_mut())
                .map_err(|e| nccl_error("ncclAllGather", e))?;
        }
        self.stream
            .synchronize()
            .map_err(|e| nccl_error("synchronizing after ncclAllGather", e))?;
        self.gpu.download(&recv)
    }
}

fn new_id() -> Result<Id> {
    Id::new().map_err(|e| nccl_error("ncclGetUniqueId", e))
}

fn id_bytes(id: &Id) -> Vec<u8> {
    id.internal().iter().map(|&c| c as u8).collect()
}

fn id_from(bytes: &[u8]) -> Result<Id> {
    let internal: [std::ffi::c_char; 128] =
        std::array::from_fn(|i| bytes.get(i).copied().unwrap_or_default() as std::ffi::c_char);
    if bytes.len() != 128 {
        return Err(Error::Collective {
            reason: format!("an NCCL id has 128 bytes, rank 0 sent {}", bytes.len()),
        });
    }
    Ok(Id::uninit(internal))
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        let lens = self.all_gather_equal(&(local.len() as u64).to_le_bytes())?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if longest == 0 {
            return Ok(vec![Vec::new(); self.world_size]);
        }
        let mut padded = local.to_vec();
        padded.resize(longest, 0);
        let all = self.all_gather_equal(&padded)?;
        Ok(all
            .chunks_exact(longest)
            .zip(&lens)
            .map(|(chunk, &len)| chunk[..len].to_vec())
            .collect())
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        let gathered = self.all_gather_bytes(&super::split_bytes(color, key))?;
        let members = super::split_members(&gathered, self.rank);
        let sub_rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("a rank is a member of its own group");
        // The group's first member makes its id; every rank sends one (empty if none).
        let local = if sub_rank == 0 {
            id_bytes(&new_id()?)
        } else {
            Vec::new()
        };
        let ids = self.all_gather_bytes(&local)?;
        let id = id_from(&ids[members[0]])?;
        Ok(Box::new(Self::from_id(
            self.gpu.clone(),
            sub_rank,
            members.len(),
            Some(id),
        )?))
    }
}
