//! Where the backend's device memory comes from and what its host waits cost: the bytes
//! it allocates itself ([`DeviceMemory`]), memory another library's allocator lends a
//! call ([`DeviceAllocator`]: PyTorch's caching allocator), and the count of the host's
//! waits on the stream ([`HostSyncs`]).

use crate::error::Result;
use cudarc::driver::CudaSlice;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes the backend holds on the device: in use now, and the most at any time since
/// the last [`DeviceMemory::reset_peak`].
#[derive(Debug, Default)]
pub struct DeviceMemory {
    in_use: AtomicUsize,
    peak: AtomicUsize,
}

impl DeviceMemory {
    pub(super) fn allocated(&self, bytes: usize) {
        let now = self.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn freed(&self, bytes: usize) {
        self.in_use.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Bytes in use.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Relaxed)
    }

    /// Peak bytes in use.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Starts a new peak from the bytes in use now.
    pub fn reset_peak(&self) {
        self.peak.store(self.in_use(), Ordering::Relaxed);
    }
}

/// The host's waits on a GPU's streams since the GPU was opened (or the last
/// [`HostSyncs::reset`]): stream synchronizations (`cuStreamSynchronize`), and copies from
/// the device into pageable host memory (each returns only once the copy, and so all the
/// stream's work before it, is done: a wait too). A call's count is the difference of two
/// readings around it (calls on one device take turns).
#[derive(Debug, Default)]
pub struct HostSyncs {
    syncs: AtomicUsize,
    copies: AtomicUsize,
}

impl HostSyncs {
    pub(super) fn synced(&self) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn copied(&self) {
        self.copies.fetch_add(1, Ordering::Relaxed);
    }

    /// Stream synchronizations.
    pub fn syncs(&self) -> usize {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Device-to-host copies.
    pub fn copies_to_host(&self) -> usize {
        self.copies.load(Ordering::Relaxed)
    }

    /// Both counts from zero.
    pub fn reset(&self) {
        self.syncs.store(0, Ordering::Relaxed);
        self.copies.store(0, Ordering::Relaxed);
    }
}

/// Device memory lent by another library's allocator for one call, on the call's stream
/// (PyTorch's caching allocator, so its `memory_allocated` counts the call's buffers and
/// it reuses them after the call).
pub trait DeviceAllocator: Send + Sync {
    /// The address of `bytes` (> 0) bytes on the call's stream, aligned for any element
    /// type; an error (out of memory) names the bytes asked for.
    fn alloc(&self, bytes: usize) -> Result<u64>;

    /// Gives back what [`DeviceAllocator::alloc`] returned. Stream-ordered: work already
    /// issued on the call's stream may still read or write it, and the allocator reuses
    /// it only after that work (for work on the same stream).
    fn free(&self, ptr: u64);
}

/// Who frees a [`DeviceBuffer`].
pub(super) enum Owner {
    /// The backend: counted in its GPU's [`DeviceMemory`] until dropped.
    Counted(Arc<DeviceMemory>),
    /// Another library, which owns the memory ([`super::Gpu::borrow`]): neither counted
    /// nor freed here.
    Borrowed,
    /// Lent for the call by an allocator, given back to it when dropped.
    Lent(Arc<dyn DeviceAllocator>),
}

/// A device buffer counted in its GPU's [`DeviceMemory`] until dropped, a view of
/// memory another library owns ([`super::Gpu::borrow`]), or memory a
/// [`DeviceAllocator`] lent the call.
pub struct DeviceBuffer<T> {
    pub(super) slice: ManuallyDrop<CudaSlice<T>>,
    pub(super) owner: Owner,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let owner = match self.owner {
            Owner::Counted(_) => "counted",
            Owner::Borrowed => "borrowed",
            Owner::Lent(_) => "lent",
        };
        write!(f, "DeviceBuffer({} elements, {owner})", self.slice.len())
    }
}

impl<T> DeviceBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// The cudarc slice.
    pub fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The cudarc slice, mutably.
    pub fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is not used after this.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match &self.owner {
            Owner::Counted(memory) => {
                memory.freed(slice.num_bytes());
                drop(slice);
            }
            // Borrowed: its owner frees it.
            Owner::Borrowed => {
                slice.leak();
            }
            Owner::Lent(allocator) => allocator.free(slice.leak()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counts_add_up_and_reset() {
        let s = HostSyncs::default();
        s.synced();
        s.copied();
        s.copied();
        assert_eq!((s.syncs(), s.copies_to_host()), (1, 2));
        s.reset();
        assert_eq!((s.syncs(), s.copies_to_host()), (0, 0));
        let m = DeviceMemory::default();
        m.allocated(10);
        m.allocated(5);
        m.freed(10);
        assert_eq!((m.in_use(), m.peak()), (5, 15));
        m.reset_peak();
        assert_eq!(m.peak(), 5);
    }
}
