//! One GPU: its context and stream, the compiled kernels, and the accounting of every
//! allocation the backend makes.

use super::kernels::{SOURCES, compile_cached};
use crate::element::Element;
use crate::error::{Error, Result};
use cudarc::cublas::sys::cudaDataType_t;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use half::bf16;
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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

/// Bytes the backend holds on the device: in use now, and the most at any time since
/// the last [`DeviceMemory::reset_peak`].
#[derive(Debug, Default)]
pub struct DeviceMemory {
    in_use: AtomicUsize,
    peak: AtomicUsize,
}

impl DeviceMemory {
    fn allocated(&self, bytes: usize) {
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

/// A device buffer counted in its GPU's [`DeviceMemory`] until dropped, or a view of
/// memory another library owns ([`Gpu::borrow`]: neither counted nor freed here).
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    /// `None` for a borrowed view.
    memory: Option<Arc<DeviceMemory>>,
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
        match &self.memory {
            Some(memory) => {
                memory.freed(slice.num_bytes());
                drop(slice);
            }
            // Borrowed: its owner frees it.
            None => {
                slice.leak();
            }
        }
    }
}

/// One GPU with the backend's kernels loaded.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: HashMap<&'static str, CudaFunction>,
    memory: Arc<DeviceMemory>,
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
                         has no NVIDIA driver; use the CPU backend)"
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

    fn track<T>(&self, slice: CudaSlice<T>) -> DeviceBuffer<T> {
        self.memory.allocated(slice.num_bytes());
        DeviceBuffer {
            slice: ManuallyDrop::new(slice),
            memory: Some(self.memory.clone()),
        }
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
            memory: None,
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
            arch: self.arch.clone(),
        }
    }

    /// A zeroed buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let slice = self
            .stream
            .alloc_zeros(len)
            .map_err(|e| device_error(&format!("allocating {len} elements"), e))?;
        Ok(self.track(slice))
    }

    /// A copy of `host` on the device.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<DeviceBuffer<T>> {
        let slice = self.stream.clone_htod(host).map_err(|e| {
            device_error(&format!("copying {} elements to the device", host.len()), e)
        })?;
        Ok(self.track(slice))
    }

    /// A host copy of `buf` (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &DeviceBuffer<T>,
    ) -> Result<Vec<T>> {
        self.stream
            .clone_dtoh(&*buf.slice)
            .map_err(|e| device_error(&format!("copying {} elements to the host", buf.len()), e))
    }

    /// The device address of element `offset` of `buf` (for kernels and cuBLAS calls
    /// that take raw pointers; everything runs on the one stream, so no event is needed).
    pub(crate) fn addr<T>(&self, buf: &DeviceBuffer<T>, offset: usize) -> u64 {
        let (base, _sync) = buf.slice.device_ptr(&self.stream);
        base + (offset * std::mem::size_of::<T>()) as u64
    }

    /// A buffer of `len` elements, every one NaN (poison: elements a kernel does not
    /// write show). `T` is 4 or 2 bytes wide (f32, bf16).
    pub fn nans<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let buf = self.zeros::<T>(len)?;
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

    /// The index of the first entry of `buf` that is not finite (an infinity or a NaN),
    /// scanned on the device; `T` is 4 or 2 bytes wide (f32, bf16). Waits for the stream.
    pub fn first_non_finite<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        buf: &DeviceBuffer<T>,
    ) -> Result<Option<usize>> {
        let len = buf.len();
        if len == 0 {
            return Ok(None);
        }
        let first = self.upload(&[u64::MAX])?;
        let (p, n, out) = (self.addr(buf, 0), len as i64, self.addr(&first, 0));
        let kernel = match std::mem::size_of::<T>() {
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
            grid_dim: (len.div_ceil(256).min(65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `p` holds `len` elements of the kernel's word width; `out` one u64.
        unsafe { launch.launch(cfg) }
            .map_err(|e| device_error(&format!("launching {kernel}"), e))?;
        let index = self.download(&first)?[0];
        Ok((index != u64::MAX).then_some(index as usize))
    }

    /// Element `index` of `buf`, copied to the host (waits for the stream).
    pub fn value_at<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &DeviceBuffer<T>,
        index: usize,
    ) -> Result<T> {
        let one = buf.slice.slice(index..index + 1);
        let host = self
            .stream
            .clone_dtoh(&one)
            .map_err(|e| device_error(&format!("copying element {index} to the host"), e))?;
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
        self.stream
            .synchronize()
            .map_err(|e| device_error("synchronizing the stream", e))
    }
}
