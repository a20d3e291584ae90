//! One GPU: its context and stream, the compiled kernels, and the accounting of every
//! allocation the backend makes.

use super::kernels::{SOURCES, compile_cached};
// Re-exported: the backend's modules name it with the `Gpu` that makes it.
pub(crate) use super::memory::DeviceBuffer;
use super::memory::{DeviceAllocator, DeviceMemory, HostSyncs, Owner};
use crate::element::Element;
use crate::error::{Error, Result};
use cudarc::cublas::sys::cudaDataType_t;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use half::bf16;
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::Arc;

pub(crate) fn device_error(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Device {
        reason: format!("{what}: {e:?}"),
    }
}

/// Whether the CUDA driver library (`libcuda.so`) can be loaded (checked before any
/// driver call: cudarc panics if a library it needs is missing).
pub fn driver_present() -> bool {
    // SAFETY: only tries to load the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// A storage dtype the device kernels read: f32 or bf16.
pub trait GpuElement: Element + DeviceRepr + ValidAsZeroBits {
    /// Suffix of the kernels for this dtype (`row_states_f32`, ...).
    const SUFFIX: &'static str;
    /// Its cuBLAS data type.
    const BLAS_TYPE: cudaDataType_t;
}

impl GpuElement for f32 {
    const SUFFIX: &'static str = "f32";
    const BLAS_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
}

impl GpuElement for bf16 {
    const SUFFIX: &'static str = "bf16";
    const BLAS_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
}

/// A device buffer to scan for entries that are not finite ([`Gpu::first_non_finite_of`]).
#[derive(Debug, Clone, Copy)]
pub struct Scan {
    addr: u64,
    len: usize,
    /// Bytes an element.
    width: usize,
}

/// One GPU with the backend's kernels loaded.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: HashMap<&'static str, CudaFunction>,
    memory: Arc<DeviceMemory>,
    syncs: Arc<HostSyncs>,
    /// Where this call's buffers come from when another library lends them
    /// ([`Gpu::lending`]); else the stream's allocations (`cuMemAllocAsync`).
    lender: Option<Arc<dyn DeviceAllocator>>,
    arch: String,
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels (compiled for its architecture on
    /// first use in the process). Without a CUDA driver or NVRTC library, an error
    /// says which is missing.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(Error::Device {
                reason: "no CUDA driver found: libcuda.so could not be loaded (this machine \
                         has no NVIDIA driver)"
                    .into(),
            });
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| device_error(&format!("opening device {ordinal}"), e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| device_error("reading the compute capability", e))?;
        let arch = format!("compute_{major}{minor}");
        let stream = ctx.default_stream();
        let mut kernels = HashMap::new();
        for src in SOURCES {
            let ptx = compile_cached(src, &arch)?;
            let module = ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(|e| device_error(&format!("loading {}", src.name), e))?;
            for &name in src.kernels {
                let f = module
                    .load_function(name)
                    .map_err(|e| device_error(&format!("loading kernel {name}"), e))?;
                kernels.insert(name, f);
            }
        }
        Ok(Gpu {
            ctx,
            stream,
            kernels,
            memory: Arc::default(),
            syncs: Arc::default(),
            lender: None,
            arch,
        })
    }

    /// The architecture the kernels were compiled for (`compute_90` on Hopper).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The stream every operation of the backend runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> Result<String> {
        self.ctx
            .name()
            .map_err(|e| device_error("reading the device name", e))
    }

    /// Seconds `work` takes on the stream, between two CUDA events recorded around it
    /// (host stalls inside `work` count, as they do in a training step).
    pub fn timed(&self, work: impl FnOnce() -> Result<()>) -> Result<f64> {
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .stream
            .record_event(timing)
            .map_err(|e| device_error("recording an event", e))?;
        work()?;
        let end = self
            .stream
            .record_event(timing)
            .map_err(|e| device_error("recording an event", e))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| device_error("reading an event's time", e))?;
        Ok(ms as f64 / 1e3)
    }

    /// Sets every byte of `buf` to 0 (on the stream).
    pub fn fill_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        buf: &mut DeviceBuffer<T>,
    ) -> Result<()> {
        self.stream
            .memset_zeros(&mut *buf.slice)
            .map_err(|e| device_error("cuMemsetD8", e))
    }

    /// The backend's bytes on this device.
    pub fn memory(&self) -> &DeviceMemory {
        &self.memory
    }

    /// `(free, total)` bytes of the device (`cudaMemGetInfo`).
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| device_error("cuMemGetInfo", e))
    }

    /// A loaded kernel.
    pub(crate) fn kernel(&self, name: &str) -> Result<&CudaFunction> {
        self.kernels.get(name).ok_or_else(|| Error::Device {
            reason: format!("kernel {name} is not loaded"),
        })
    }

    /// The host's waits on this GPU's streams ([`HostSyncs`]).
    pub fn host_syncs(&self) -> &HostSyncs {
        &self.syncs
    }

    /// `len` elements, unset: lent by the call's allocator where it has one, else
    /// allocated on the stream and counted.
    fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = len * std::mem::size_of::<T>();
        if let Some(lender) = self.lender.as_ref().filter(|_| bytes > 0) {
            let ptr = lender.alloc(bytes)?;
            // SAFETY: the allocator lent `bytes` bytes on this GPU for the call.
            let slice = unsafe { self.stream.upgrade_device_ptr(ptr, len) };
            return Ok(DeviceBuffer {
                slice: ManuallyDrop::new(slice),
                owner: Owner::Lent(lender.clone()),
            });
        }
        // SAFETY: every caller writes the buffer before it is read.
        let slice = unsafe { self.stream.alloc::<T>(len) }
            .map_err(|e| device_error(&format!("allocating {len} elements"), e))?;
        self.memory.allocated(slice.num_bytes());
        Ok(DeviceBuffer {
            slice: ManuallyDrop::new(slice),
            owner: Owner::Counted(self.memory.clone()),
        })
    }

    /// A view of `len` elements of `T` at device address `ptr`, memory another library
    /// owns (a PyTorch tensor): never freed nor counted here.
    ///
    /// # Safety
    /// `ptr` must address `len` valid elements of `T` on this GPU, alive and not used by
    /// anything else while the view is in use.
    pub unsafe fn borrow<T>(&self, ptr: u64, len: usize) -> DeviceBuffer<T> {
        // SAFETY: the caller's promise.
        let slice = unsafe { self.stream.upgrade_device_ptr(ptr, len) };
        DeviceBuffer {
            slice: ManuallyDrop::new(slice),
            owner: Owner::Borrowed,
        }
    }

    /// This GPU's kernels and accounting on `stream`, a stream another library owns (e.g.
    /// PyTorch's current stream), so the work is ordered with that library's.
    ///
    /// # Safety
    /// `stream` must be a valid stream of this device's primary context, alive while
    /// the returned `Gpu` (or anything made with it) is in use.
    pub unsafe fn on_borrowed_stream(&self, stream: cudarc::driver::sys::CUstream) -> Gpu {
        Gpu {
            ctx: self.ctx.clone(),
            // SAFETY: the caller's promise.
            stream: unsafe { self.ctx.wrap_borrowed_stream(stream) },
            kernels: self.kernels.clone(),
            memory: self.memory.clone(),
            syncs: self.syncs.clone(),
            lender: self.lender.clone(),
            arch: self.arch.clone(),
        }
    }

    /// This GPU with every buffer it allocates from now on lent by `lender` (e.g.
    /// PyTorch's caching allocator on the call's stream), given back when dropped. Such a
    /// `Gpu` is for one call: nothing it allocates may outlive the call.
    pub fn lending(mut self, lender: Arc<dyn DeviceAllocator>) -> Gpu {
        self.lender = Some(lender);
        self
    }

    /// Whether this GPU's buffers are lent for the call ([`Gpu::lending`]).
    pub fn is_lending(&self) -> bool {
        self.lender.is_some()
    }

    /// A zeroed buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let mut buf = self.alloc(len)?;
        self.fill_zeros(&mut buf)?;
        Ok(buf)
    }

    /// A copy of `host` on the device.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<DeviceBuffer<T>> {
        let mut buf = self.alloc(host.len())?;
        self.stream
            .memcpy_htod(host, &mut *buf.slice)
            .map_err(|e| {
                device_error(&format!("copying {} elements to the device", host.len()), e)
            })?;
        Ok(buf)
    }

    /// A host copy of `buf` (waits for the stream: one copy to the host).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &DeviceBuffer<T>,
    ) -> Result<Vec<T>> {
        self.download_range(buf, 0..buf.len())
    }

    /// A host copy of elements `range` of `buf` (waits for the stream: one copy to the
    /// host, counted in [`Gpu::host_syncs`]).
    pub fn download_range<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &DeviceBuffer<T>,
        range: Range<usize>,
    ) -> Result<Vec<T>> {
        let n = range.len();
        let mut host = vec![T::default(); n];
        if n > 0 {
            self.syncs.copied();
            self.stream
                .memcpy_dtoh(&buf.slice.slice(range), &mut host)
                .map_err(|e| device_error(&format!("copying {n} elements to the host"), e))?;
        }
        Ok(host)
    }

    /// The device address of element `offset` of `buf` (for kernels and cuBLAS calls
    /// that take raw pointers; everything runs on the one stream, so no event is needed).
    pub(crate) fn addr<T>(&self, buf: &DeviceBuffer<T>, offset: usize) -> u64 {
        let (base, _sync) = buf.slice.device_ptr(&self.stream);
        base + (offset * std::mem::size_of::<T>()) as u64
    }

    /// A buffer of `len` elements, every one NaN (poison: elements a kernel does not
    /// write show). `T` is 4 or 2 bytes wide (f32, bf16).
    pub fn nans<T: DeviceRepr>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        // Every element is written by the fill below: no zeroing first.
        let buf = self.alloc::<T>(len)?;
        let (kernel, bits) = match std::mem::size_of::<T>() {
            4 => ("fill_u32", 0x7fc0_0000u32),
            2 => ("fill_u16", 0x7fc0u32),
            w => {
                return Err(Error::Device {
                    reason: format!("no NaN fill for {w}-byte elements"),
                });
            }
        };
        if len == 0 {
            return Ok(buf);
        }
        let (p, n) = (self.addr(&buf, 0), len as i64);
        let f = self.kernel(kernel)?;
        let mut launch = self.stream.launch_builder(f);
        launch.arg(&p).arg(&n);
        let bits16 = bits as u16;
        if kernel == "fill_u32" {
            launch.arg(&bits);
        } else {
            launch.arg(&bits16);
        }
        let blocks = len.div_ceil(256).min(65_535) as u32;
        // SAFETY: `p` holds `len` elements of the kernel's word width.
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { launch.launch(cfg) }
            .map_err(|e| device_error(&format!("launching {kernel}"), e))?;
        Ok(buf)
    }

    /// `buf` as [`Gpu::first_non_finite_of`] scans it.
    pub fn scan<T>(&self, buf: &DeviceBuffer<T>) -> Scan {
        Scan {
            addr: self.addr(buf, 0),
            len: buf.len(),
            width: std::mem::size_of::<T>(),
        }
    }

    /// For each of `scans`, the index of its first entry that is not finite (an infinity
    /// or a NaN; elements 4 or 2 bytes wide: f32, bf16), all scanned on the device before
    /// one copy of their answers to the host (none when every buffer is empty).
    pub fn first_non_finite_of(&self, scans: &[Scan]) -> Result<Vec<Option<usize>>> {
        let mut answers = vec![None; scans.len()];
        if scans.iter().all(|s| s.len == 0) {
            return Ok(answers);
        }
        // u64::MAX (every byte 0xff): no non-finite entry found.
        let first = self.alloc::<u64>(scans.len())?;
        let out0 = self.addr(&first, 0);
        self.bind_to_thread()?;
        // SAFETY: `first` holds `scans.len()` u64 on this GPU.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                out0,
                0xff,
                8 * scans.len(),
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| device_error("cuMemsetD8Async", e))?;
        for (k, scan) in scans.iter().enumerate().filter(|(_, s)| s.len > 0) {
            self.launch_scan(scan, out0 + 8 * k as u64)?;
        }
        let found = self.download(&first)?;
        for (answer, index) in answers.iter_mut().zip(found) {
            *answer = (index != u64::MAX).then_some(index as usize);
        }
        Ok(answers)
    }

    /// Launches the finite scan of `scan` (not empty), its answer into the u64 at `out`.
    fn launch_scan(&self, scan: &Scan, out: u64) -> Result<()> {
        let (p, n) = (scan.addr, scan.len as i64);
        let kernel = match scan.width {
            4 => "first_non_finite_u32",
            2 => "first_non_finite_u16",
            w => {
                return Err(Error::Device {
                    reason: format!("no finite scan for {w}-byte elements"),
                });
            }
        };
        let (mask32, mask16) = (0x7f80_0000u32, 0x7f80u16);
        let mut launch = self.stream.launch_builder(self.kernel(kernel)?);
        launch.arg(&p).arg(&n);
        if kernel == "first_non_finite_u32" {
            launch.arg(&mask32);
        } else {
            launch.arg(&mask16);
        }
        launch.arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (scan.len.div_ceil(256).min(65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `p` holds `len` elements of the kernel's word width; `out` one u64.
        unsafe { launch.launch(cfg) }
            .map(|_| ())
            .map_err(|e| device_error(&format!("launching {kernel}"), e))
    }

    /// Element `index` of `buf`, copied to the host (waits for the stream).
    pub fn value_at<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &DeviceBuffer<T>,
        index: usize,
    ) -> Result<T> {
        let host = self.download_range(buf, index..index + 1)?;
        Ok(host[0].clone())
    }

    /// Makes this GPU's context current on the calling thread (a thread that calls a
    /// CUDA library, e.g. NCCL, for this GPU).
    pub fn bind_to_thread(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| device_error("binding the GPU's context to a thread", e))
    }

    /// Waits for the stream; surfaces any error of the kernels launched on it.
    pub fn synchronize(&self) -> Result<()> {
        self.syncs.synced();
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronizing the stream", e))
    }
}
