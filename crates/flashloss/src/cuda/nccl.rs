//! The NCCL engine (feature `cuda`): one rank per GPU. Bytes cross ranks through device
//! buffers on the GPU's stream: [`Collective::all_gather_bytes`] gathers every rank's
//! length, then the payloads padded to the longest, with `ncclAllGather`. A
//! communicator is bootstrapped over another group ([`Nccl::over`]: rank 0 makes the
//! NCCL id and the group shares it), so any engine that can start the processes or
//! threads (MPI, in-process) can start NCCL; a group of one needs none ([`Nccl::solo`]).
//!
//! A dead or hung peer cannot block a rank forever: with a timeout
//! ([`Nccl::with_timeout`]), a watchdog ([`super::watchdog`]) arms with each collective
//! and, when the collective outlives the timeout, aborts the communicator
//! (`ncclCommAbort`, which ends the collective's kernels); the collective returns
//! [`Error::Collective`] with the same message on every live rank (each rank's own
//! watchdog fires on the same missing peer) and the communicator refuses further use. A
//! collective that completed keeps its result. Joining a communicator
//! (`ncclCommInitRank`, which waits for every rank) is bounded by the same timeout, on a
//! thread bound to the rank's GPU.

use super::device::Gpu;
use super::watchdog::Watchdog;
use crate::collective::{Collective, split_bytes, split_members};
use crate::error::{Error, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{Id, result, sys};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

/// An NCCL communicator by its raw handle (cudarc's `Comm` keeps its handle private),
/// with the [`Watchdog`] that may abort it from another thread while a collective
/// blocks on it. Aborted (and so freed) once: by the watchdog, or on drop.
struct RawComm {
    comm: sys::ncclComm_t,
    watchdog: Arc<Watchdog>,
}

// SAFETY: NCCL allows a communicator to be used from any thread as long as calls on it
// do not overlap (the `Nccl::busy` mutex orders collectives), and `ncclCommAbort` is
// meant to be called from another thread while an operation blocks; the watchdog calls
// it once, and only while a collective runs or on drop.
unsafe impl Send for RawComm {}
unsafe impl Sync for RawComm {}

impl RawComm {
    /// `ncclCommInitRank` on `gpu`; it waits for every rank, so with a `timeout` it runs
    /// on a helper thread (bound to the GPU's context, so the communicator is made on
    /// this GPU) and the timeout bounds the wait (the helper stays blocked until the
    /// process ends).
    fn init(
        gpu: &Arc<Gpu>,
        rank: usize,
        world_size: usize,
        id: &Id,
        timeout: Option<Duration>,
    ) -> Result<Self> {
        let unique = sys::ncclUniqueId {
            internal: *id.internal(),
        };
        let what = format!("ncclCommInitRank (rank {rank} of {world_size})");
        let gpu = gpu.clone();
        let join = move || -> Result<usize> {
            gpu.bind_to_thread()?;
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is written by NCCL on success.
            unsafe { result::comm_init_rank(&mut comm, world_size as i32, unique, rank as i32) }
                .map_err(|e| {
                    nccl_error(
                        &format!("ncclCommInitRank (rank {rank} of {world_size})"),
                        e,
                    )
                })?;
            Ok(comm as usize)
        };
        let handle = match timeout {
            None => join()?,
            Some(t) => {
                let (tx, rx) = mpsc::channel();
                std::thread::spawn(move || {
                    let _ = tx.send(join());
                });
                match rx.recv_timeout(t) {
                    Ok(r) => r?,
                    Err(_) => {
                        return Err(Error::Collective {
                            reason: format!(
                                "NCCL {what}: not every rank joined within {:.1} s (a peer died or hangs)",
                                t.as_secs_f64()
                            ),
                        });
                    }
                }
            }
        };
        let watchdog = Watchdog::new(move || {
            // SAFETY: the watchdog calls this once, while the handle is live.
            let _ = unsafe { result::comm_abort(handle as sys::ncclComm_t) };
        });
        Ok(RawComm {
            comm: handle as sys::ncclComm_t,
            watchdog,
        })
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        self.watchdog.abort_now();
    }
}

/// A group of ranks, one GPU each, that exchange data with NCCL.
pub struct Nccl {
    comm: Arc<RawComm>,
    /// Held for the length of a collective: calls on a communicator must not overlap.
    busy: Mutex<()>,
    timeout: Option<Duration>,
    stream: Arc<CudaStream>,
    gpu: Arc<Gpu>,
    rank: usize,
    world_size: usize,
}

impl Nccl {
    /// A group of one rank on `gpu` (what a single-GPU machine checks).
    pub fn solo(gpu: Arc<Gpu>) -> Result<Self> {
        Self::from_id(gpu, 0, 1, None, None)
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
        Self::from_id(gpu, parent.rank(), parent.world_size(), Some(id), None)
    }

    fn from_id(
        gpu: Arc<Gpu>,
        rank: usize,
        world_size: usize,
        id: Option<Id>,
        timeout: Option<Duration>,
    ) -> Result<Self> {
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
        let comm = RawComm::init(&gpu, rank, world_size, &id, timeout)?;
        Ok(Nccl {
            comm: Arc::new(comm),
            busy: Mutex::new(()),
            timeout,
            stream,
            gpu,
            rank,
            world_size,
        })
    }

    /// The same group with a watchdog: a collective (or the joining of a sub-group made
    /// by `split`) that outlives `timeout` aborts the communicator and is an error.
    /// (A zero timeout means none.)
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout).filter(|t| !t.is_zero());
        self
    }

    /// Runs `f` (one collective: its calls and the wait for them) under the watchdog.
    fn guarded<T>(&self, what: &str, f: impl FnOnce(sys::ncclComm_t) -> Result<T>) -> Result<T> {
        let _busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        let aborted = || Error::Collective {
            reason: format!(
                "NCCL {what}: a collective did not complete within {:.1} s and the communicator was aborted (ncclCommAbort): a peer died or hangs",
                self.timeout.unwrap_or_default().as_secs_f64()
            ),
        };
        let comm = self.comm.comm;
        self.comm.watchdog.run(self.timeout, aborted, || f(comm))
    }

    /// `ncclAllGather` of `local` (the same length on every rank).
    fn all_gather_equal(&self, local: &[u8]) -> Result<Vec<u8>> {
        let send = self.gpu.upload(local)?;
        let mut recv = self.gpu.zeros::<u8>(local.len() * self.world_size)?;
        self.guarded("ncclAllGather", |comm| {
            {
                let (src, _src_sync) = send.slice().device_ptr(&self.stream);
                let (dst, _dst_sync) = recv.slice_mut().device_ptr_mut(&self.stream);
                // SAFETY: both buffers live on this rank's GPU for the call, with the
                // lengths NCCL reads and writes; the stream is this GPU's.
                unsafe {
                    result::all_gather(
                        src as _,
                        dst as _,
                        local.len(),
                        sys::ncclDataType_t::ncclUint8,
                        comm,
                        self.stream.cu_stream() as _,
                    )
                }
                .map_err(|e| nccl_error("ncclAllGather", e))?;
            }
            // Under the watchdog: a peer that never joins hangs here, not in the copy.
            self.gpu.host_syncs().synced();
            self.stream
                .synchronize()
                .map_err(|e| nccl_error("synchronizing after ncclAllGather", e))
        })?;
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
        let gathered = self.all_gather_bytes(&split_bytes(color, key))?;
        let members = split_members(&gathered, self.rank);
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
            self.timeout,
        )?))
    }
}
