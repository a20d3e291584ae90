//! The CUDA handlers of the fused losses (feature `cuda`; registered under the same
//! target names for platform "CUDA"): `flashloss_grpo_linear` and `flashloss_ce_linear`.
//! The LM head and its gradients stay in XLA's device buffers, borrowed for the call on
//! the stream XLA gives the call (`XLA_FFI_Stream_Get`), in the device of the current
//! CUDA context. The small per-token arguments are copied to the host ([`Staged`]), the
//! CPU handlers' readers run on a frame whose buffers point at those copies, and the
//! per-token results are copied back. The bias is read in f32 (a bf16 bias is widened
//! into a temporary device buffer). The weight is `[V, H]` or `[H, V]` (`weight_layout`
//! "vh" or "hv", its gradient laid out alike). Ran on an H200 at 429ab96 with `[V, H]`;
//! `[H, V]` is host-tested (the cuBLAS shapes), not yet run on a GPU.

use super::ffi::{self, Buffer, CallFrame, StreamGetArgs};
use super::frame::{Frame, Result, bad, handle};
use super::handlers::{
    Tokens, ce_outputs, ce_upstream, grpo_outputs, options, vocab_hidden, weight_layout,
};
use crate::device::gpu;
use cudarc::driver::{result as cu, sys};
use flashloss::cuda::BorrowedHead;
use flashloss::device::{CeCall, GrpoCall};
use flashloss::{CeConfig, CrossEntropy, GrpoLoss, GrpoLossConfig, HeadArgs};
use half::bf16;
use std::ffi::c_void;

fn cuda_error(what: &str, e: impl std::fmt::Debug) -> super::frame::HandlerError {
    super::frame::HandlerError {
        message: format!("cuda: {what}: {e:?}"),
        internal: true,
    }
}

/// Bytes per element of an XLA dtype the handlers take.
fn element_bytes(dtype: i32) -> usize {
    match dtype {
        ffi::dtype::PRED => 1,
        ffi::dtype::BF16 => 2,
        ffi::dtype::S32 | ffi::dtype::F32 => 4,
        _ => 8,
    }
}

/// The call's stream (`CUstream`), from XLA.
unsafe fn stream_of(frame: &CallFrame) -> Result<sys::CUstream> {
    // SAFETY: an execute-stage frame's API table.
    let api = unsafe { &*frame.api };
    let get = api
        .stream_get
        .ok_or_else(|| bad("stream", "XLA's API has no XLA_FFI_Stream_Get"))?;
    let mut args = StreamGetArgs {
        struct_size: size_of::<StreamGetArgs>(),
        extension_start: std::ptr::null_mut(),
        ctx: frame.ctx,
        stream: std::ptr::null_mut(),
    };
    // SAFETY: XLA's function with its argument struct; a non-null result is an error.
    if !unsafe { get(&mut args) }.is_null() {
        return Err(bad("stream", "XLA_FFI_Stream_Get failed"));
    }
    Ok(args.stream as sys::CUstream)
}

/// The ordinal of the current context's device (XLA's device for this call).
fn current_ordinal() -> Result<usize> {
    let mut device: sys::CUdevice = 0;
    // SAFETY: writes one int.
    let r = unsafe { sys::cuCtxGetDevice(&mut device) };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(device as usize),
        e => Err(cuda_error("cuCtxGetDevice", e)),
    }
}

/// A copy of XLA's frame whose small buffers are host copies: arguments other than
/// `device_args` are copied from the device, results other than `device_rets` are
/// host buffers copied back by [`Staged::finish`]; `device_rets` are zeroed on the device.
struct Staged {
    frame: CallFrame,
    _args: Vec<Buffer>,
    _arg_ptrs: Vec<*mut c_void>,
    rets: Vec<Buffer>,
    _ret_ptrs: Vec<*mut c_void>,
    _host: Vec<Vec<u8>>,
    /// (result index, device address, bytes) of each result to copy back.
    back: Vec<(usize, u64, usize)>,
    stream: sys::CUstream,
}

impl Staged {
    /// # Safety
    /// `frame` is XLA's execute-stage frame of a CUDA call on `stream`.
    unsafe fn new(
        frame: &CallFrame,
        stream: sys::CUstream,
        device_args: &[usize],
        device_rets: &[usize],
    ) -> Result<Self> {
        let mut host = Vec::new();
        let mut copy = |buffers: *const *mut c_void, n: i64, keep: &[usize], from_device: bool| {
            let mut out = Vec::with_capacity(n as usize);
            let mut back = Vec::new();
            for i in 0..n as usize {
                // SAFETY: `n` buffers (the only argument and result type).
                let b = unsafe { &*(*buffers.add(i) as *const Buffer) };
                let mut staged = Buffer { ..*b };
                let numel: usize = (0..b.rank.max(0) as usize)
                    // SAFETY: `rank` dimensions.
                    .map(|d| unsafe { *b.dims.add(d) }.max(0) as usize)
                    .product();
                let bytes = numel * element_bytes(b.dtype);
                if keep.contains(&i) {
                    if !from_device && bytes > 0 {
                        // SAFETY: a result buffer of `bytes` bytes on this stream.
                        unsafe { cu::memset_d8_async(b.data as u64, 0, bytes, stream) }
                            .map_err(|e| cuda_error("cuMemsetD8Async", e))?;
                    }
                } else {
                    let mut h = vec![0u8; bytes.max(1)];
                    if from_device && bytes > 0 {
                        // SAFETY: an argument buffer of `bytes` bytes, read on its stream.
                        unsafe { cu::memcpy_dtoh_async(&mut h[..bytes], b.data as u64, stream) }
                            .map_err(|e| cuda_error("cuMemcpyDtoHAsync", e))?;
                    } else if bytes > 0 {
                        back.push((i, b.data as u64, bytes));
                    }
                    staged.data = h.as_mut_ptr().cast();
                    host.push(h);
                }
                out.push(staged);
            }
            Ok::<_, super::frame::HandlerError>((out, back))
        };
        let (args, _) = copy(frame.args.args, frame.args.size, device_args, true)?;
        let (rets, back) = copy(frame.rets.rets, frame.rets.size, device_rets, false)?;
        // SAFETY: the copies above were queued on this stream.
        unsafe { cu::stream::synchronize(stream) }
            .map_err(|e| cuda_error("cuStreamSynchronize", e))?;
        let mut staged = Staged {
            // SAFETY: a plain copy of XLA's frame; its buffer lists are replaced below.
            frame: unsafe { std::ptr::read(frame) },
            _args: args,
            _arg_ptrs: Vec::new(),
            rets,
            _ret_ptrs: Vec::new(),
            _host: host,
            back,
            stream,
        };
        staged._arg_ptrs = staged
            ._args
            .iter_mut()
            .map(|b| (b as *mut Buffer).cast())
            .collect();
        staged._ret_ptrs = staged
            .rets
            .iter_mut()
            .map(|b| (b as *mut Buffer).cast())
            .collect();
        staged.frame.args.args = staged._arg_ptrs.as_ptr();
        staged.frame.rets.rets = staged._ret_ptrs.as_ptr();
        Ok(staged)
    }

    /// Copies the host results back to XLA's buffers and waits for the stream.
    fn finish(self) -> Result<()> {
        for &(i, address, bytes) in &self.back {
            // SAFETY: the host copy of result `i` (`bytes` long) and its device buffer.
            let host = unsafe { std::slice::from_raw_parts(self.rets[i].data as *const u8, bytes) };
            unsafe { cu::memcpy_htod_async(address, host, self.stream) }
                .map_err(|e| cuda_error("cuMemcpyHtoDAsync", e))?;
        }
        // SAFETY: the copies above were queued on this stream; the host copies live until here.
        unsafe { cu::stream::synchronize(self.stream) }
            .map_err(|e| cuda_error("cuStreamSynchronize", e))
    }
}

/// A bf16 bias widened to f32 in a device buffer of the call's stream (freed on drop).
struct WideBias {
    address: u64,
    stream: sys::CUstream,
}

impl WideBias {
    /// # Safety
    /// `bias` holds `v` bf16 values on `stream`'s device.
    unsafe fn new(bias: u64, v: usize, stream: sys::CUstream) -> Result<Self> {
        let mut host = vec![bf16::ZERO; v];
        // SAFETY: the caller's promise; the host buffers outlive the synchronize below.
        unsafe {
            cu::memcpy_dtoh_async(&mut host, bias, stream)
                .map_err(|e| cuda_error("cuMemcpyDtoHAsync", e))?;
            cu::stream::synchronize(stream).map_err(|e| cuda_error("cuStreamSynchronize", e))?;
            let wide: Vec<f32> = host.iter().map(|x| x.to_f32()).collect();
            let address =
                cu::malloc_async(stream, v * 4).map_err(|e| cuda_error("cuMemAllocAsync", e))?;
            let out = WideBias { address, stream };
            cu::memcpy_htod_async(address, &wide, stream)
                .map_err(|e| cuda_error("cuMemcpyHtoDAsync", e))?;
            cu::stream::synchronize(stream).map_err(|e| cuda_error("cuStreamSynchronize", e))?;
            Ok(out)
        }
    }
}

impl Drop for WideBias {
    fn drop(&mut self) {
        // SAFETY: allocated on this stream by `new`, used only by the finished call.
        let _ = unsafe { cu::free_async(self.address, self.stream) };
    }
}

/// The borrowed head of arguments 0-2 (hidden, weight, bias) and results
/// `grads..grads + 3` (dhidden, dweight, dbias), and its element dtype.
fn borrowed(
    f: &Frame,
    stream: sys::CUstream,
    grads: usize,
    wide: &mut Option<WideBias>,
) -> Result<(BorrowedHead, i32)> {
    let (x, w, b) = (f.arg(0, "hidden")?, f.arg(1, "weight")?, f.arg(2, "bias")?);
    let dtype = x.dtype();
    if ![ffi::dtype::F32, ffi::dtype::BF16].contains(&dtype) || w.dtype() != dtype {
        return Err(bad(
            "hidden",
            "expected hidden and weight of one dtype, float32 or bfloat16",
        ));
    }
    let layout = weight_layout(f)?;
    let (v, h) = vocab_hidden(&x, &w, layout)?;
    let bias = match (b.numel(), b.dtype()) {
        (0, _) => None,
        (n, _) if n != v => {
            return Err(bad(
                "bias",
                format!("expected shape [V={v}], got {:?}", b.dims()),
            ));
        }
        (_, ffi::dtype::F32) => Some(b.address()),
        // SAFETY: the bias argument: `v` bf16 values on this call's device.
        (_, _) => Some(
            wide.insert(unsafe { WideBias::new(b.address(), v, stream)? })
                .address,
        ),
    };
    let (dh, dw, db) = (
        f.ret(grads, "dhidden")?,
        f.ret(grads + 1, "dweight")?,
        f.ret(grads + 2, "dbias")?,
    );
    // SAFETY: XLA's buffers of these sizes on this call's device, alive and untouched
    // by anything else until the handler returns; the gradient results are f32 and
    // were zeroed on the stream.
    let head = unsafe {
        BorrowedHead::new(
            stream as usize,
            x.address(),
            w.address(),
            bias,
            dh.address(),
            (dw.numel() > 0).then(|| dw.address()),
            (db.numel() > 0).then(|| db.address()),
            (x.numel() / h.max(1), h, v),
        )
        .with_layout(layout)
    };
    Ok((head, dtype))
}

/// Runs `body` on the staged frame of a CUDA call with the head borrowed (`grads`:
/// the index of the first gradient result).
unsafe fn run_cuda(
    frame: *mut CallFrame,
    grads: usize,
    body: impl FnOnce(&Frame, &flashloss::Device, BorrowedHead, i32) -> Result<()>,
) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        handle(frame, |f| {
            let stream = stream_of(f.raw())?;
            let device = gpu(current_ordinal()?).map_err(|e| bad("hidden", e))?;
            let staged = Staged::new(f.raw(), stream, &[0, 1, 2], &[grads, grads + 1, grads + 2])?;
            let g = Frame::new(&staged.frame);
            let mut wide = None;
            let (head, dtype) = borrowed(&g, stream, grads, &mut wide)?;
            body(&g, device, head, dtype)?;
            drop(wide);
            staged.finish()
        })
    }
}

/// GRPO from hidden states on a GPU: arguments, spec and results as the CPU
/// handler's (`handlers::grpo_linear`).
unsafe extern "C" fn grpo_linear(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        run_cuda(frame, 1, |f, device, head, dtype| {
            let loss = GrpoLoss::new(f.spec()?.config::<GrpoLossConfig>()?)?;
            let opts = options(f)?;
            let tokens = Tokens::read(f, 3)?;
            let batch = tokens.batch();
            let out = match dtype {
                ffi::dtype::F32 => device.grpo(
                    HeadArgs::<f32>::Cuda(head),
                    GrpoCall::new(&loss, &batch, &opts),
                )?,
                _ => device.grpo(
                    HeadArgs::<bf16>::Cuda(head),
                    GrpoCall::new(&loss, &batch, &opts),
                )?,
            };
            grpo_outputs(f, 4, out.loss, &out.metrics, &out.stats, &out.kl)
        })
    }
}

/// Cross-entropy from hidden states on a GPU: arguments, spec and results as the
/// CPU handler's (`handlers::ce_linear`).
unsafe extern "C" fn ce_linear(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA's frame.
    unsafe {
        run_cuda(frame, 1, |f, device, head, dtype| {
            let ce = CrossEntropy::new(f.spec()?.config::<CeConfig>()?)?;
            let opts = options(f)?;
            let targets = f.arg(3, "targets")?.ids()?;
            let upstream = ce_upstream(f, 4, targets.len())?;
            let out = match dtype {
                ffi::dtype::F32 => device.cross_entropy(
                    HeadArgs::<f32>::Cuda(head),
                    CeCall::new(&ce, &targets, &opts).upstream(upstream),
                )?,
                _ => device.cross_entropy(
                    HeadArgs::<bf16>::Cuda(head),
                    CeCall::new(&ce, &targets, &opts).upstream(upstream),
                )?,
            };
            ce_outputs(f, &out)
        })
    }
}

/// The CUDA handlers by target name.
pub fn targets() -> Vec<(&'static str, ffi::Handler)> {
    vec![
        ("flashloss_grpo_linear", grpo_linear),
        ("flashloss_ce_linear", ce_linear),
    ]
}
