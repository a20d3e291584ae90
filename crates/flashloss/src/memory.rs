//! Peak-memory measurement on the CPU: a global allocator that counts bytes in use and
//! their peak. A binary or test opts in with
//! `#[global_allocator] static A: flashloss::memory::TrackingAllocator = flashloss::memory::TrackingAllocator;`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting bytes in use and the peak since [`reset_peak`].
pub struct TrackingAllocator;

fn add(bytes: usize) {
    let now = IN_USE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to `System` unchanged; only counters are added.
unsafe impl GlobalAlloc for TrackingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ACTIVE.store(true, Ordering::Relaxed);
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ACTIVE.store(true, Ordering::Relaxed);
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            add(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            IN_USE.fetch_sub(layout.size(), Ordering::Relaxed);
            add(new_size);
        }
        p
    }
}

/// True once the tracking allocator has served an allocation (it is installed).
pub fn is_tracking() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// Bytes in use now.
pub fn in_use() -> usize {
    IN_USE.load(Ordering::Relaxed)
}

/// Peak bytes in use since the last [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak window at the bytes in use now.
pub fn reset_peak() {
    PEAK.store(in_use(), Ordering::Relaxed);
}
