//! Peak-memory measurement on the CPU: a global allocator that counts bytes in use and
//! their peak. A binary or test opts in with
//! `#[global_allocator] static A: flashloss::memory::TrackingAllocator = flashloss::memory::TrackingAllocator;`.

use crate::error::{Error, Result};
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

/// Bytes the OS says are available for new allocations (Linux `MemAvailable` of
/// `/proc/meminfo`), if known.
pub fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `count` elements of `elem` bytes, as bytes (`u64::MAX` when it overflows).
pub fn bytes_of(count: u128, elem: usize) -> u64 {
    u64::try_from(count.saturating_mul(elem as u128)).unwrap_or(u64::MAX)
}

/// Checks that `bytes` for `what` fit in the memory available now: an
/// [`Error::OutOfMemory`] with the bytes asked and available otherwise. Unknown
/// availability passes (the allocation itself is still fallible).
pub fn check_fits(what: &str, bytes: u64) -> Result<()> {
    let available = available_bytes();
    let fits = bytes < u64::MAX && available.is_none_or(|a| bytes <= a);
    if fits {
        Ok(())
    } else {
        Err(Error::OutOfMemory {
            what: what.to_string(),
            bytes,
            available,
        })
    }
}

/// An empty vector with room for exactly `len` elements, through the fallible path:
/// [`check_fits`], then `try_reserve_exact`.
pub fn try_with_capacity<T>(what: &str, len: usize) -> Result<Vec<T>> {
    let bytes = bytes_of(len as u128, std::mem::size_of::<T>());
    check_fits(what, bytes)?;
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        what: what.to_string(),
        bytes,
        available: available_bytes(),
    })?;
    Ok(v)
}

/// Resizes `buf` to `len` elements (new ones `value`) through the fallible path.
pub fn try_resize<T: Clone>(buf: &mut Vec<T>, what: &str, len: usize, value: T) -> Result<()> {
    if len > buf.capacity() {
        let bytes = bytes_of(len as u128, std::mem::size_of::<T>());
        check_fits(
            what,
            bytes.saturating_sub(bytes_of(buf.capacity() as u128, std::mem::size_of::<T>())),
        )?;
        buf.try_reserve_exact(len - buf.len())
            .map_err(|_| Error::OutOfMemory {
                what: what.to_string(),
                bytes,
                available: available_bytes(),
            })?;
    }
    buf.resize(len, value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_typed_errors() {
        let err = try_with_capacity::<f64>("huge", usize::MAX / 2).unwrap_err();
        match err {
            Error::OutOfMemory { what, bytes, .. } => {
                assert_eq!(what, "huge");
                assert_eq!(bytes, u64::MAX);
            }
            e => panic!("{e}"),
        }
        let mut v = vec![1u8; 3];
        assert!(try_resize(&mut v, "v", 1 << 62, 0).is_err());
        assert_eq!(v, [1, 1, 1]);
        try_resize(&mut v, "v", 5, 0).unwrap();
        assert_eq!(v, [1, 1, 1, 0, 0]);
        assert_eq!(bytes_of(u128::MAX, 2), u64::MAX);
        assert!(available_bytes().is_some_and(|a| a > 0));
    }
}
