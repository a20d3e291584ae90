//! Kernel sources and their compilation with NVRTC. A source compiles with no log at
//! all: any warning is an error, as the CI check (which compiles every source for
//! `compute_90` and `compute_80` without a GPU) requires.

use crate::error::{Error, Result};
use cudarc::nvrtc::result as nvrtc;
use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::sync::{Mutex, OnceLock};

/// A CUDA C++ source kept in the repository and the `extern "C"` kernels it defines.
#[derive(Debug)]
pub struct KernelSource {
    /// File name under `cuda/kernels/`.
    pub name: &'static str,
    /// The source text.
    pub source: &'static str,
    /// Kernels to load from it.
    pub kernels: &'static [&'static str],
}

/// Row statistics and row gradients over logits (logits-level kernels, and the row
/// stage between the fused kernels' tile products), column sums (dbias), poison fills
/// and the finite scan.
pub const SOFTMAX_ROWS: KernelSource = KernelSource {
    name: "softmax_rows.cu",
    source: include_str!("kernels/softmax_rows.cu"),
    kernels: &[
        "row_states_f32",
        "row_states_bf16",
        "row_grad_f32",
        "row_grad_bf16",
        "row_grad_f32_to_bf16",
        "col_sums_f32",
        "col_sums_bf16",
        "fill_u32",
        "fill_u16",
        "first_non_finite_u32",
        "first_non_finite_u16",
    ],
};

/// Every source of the backend.
pub const SOURCES: &[KernelSource] = &[SOFTMAX_ROWS];

/// Whether NVRTC's library can be loaded (checked before any call: cudarc panics if
/// a library it needs is missing).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to load the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn device_error(reason: String) -> Error {
    Error::Device { reason }
}

/// The text of a NUL-terminated buffer from NVRTC (a log or the PTX), trimmed.
fn text_of(buf: Vec<c_char>) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// Compiles `src` for `arch` (e.g. `compute_90`) to PTX. Errors name the source and
/// carry NVRTC's log; a log on success (a warning) is an error too.
pub fn compile(src: &KernelSource, arch: &str) -> Result<String> {
    if !nvrtc_present() {
        return Err(device_error(
            "no NVRTC library found (libnvrtc.so): install the CUDA toolkit or the \
             nvidia-cuda-nvrtc wheel and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let code = CString::new(src.source).expect("kernel sources hold no NUL");
    let name = CString::new(src.name).expect("file names hold no NUL");
    let prog = nvrtc::create_program(&code, Some(&name))
        .map_err(|e| device_error(format!("{}: nvrtcCreateProgram: {e:?}", src.name)))?;
    let options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    // SAFETY: `prog` is a live program; it is destroyed below on every path.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    let log = unsafe { nvrtc::get_program_log(prog) }.map(text_of);
    let ptx = compiled.and_then(|_| unsafe { nvrtc::get_ptx(prog) });
    unsafe { nvrtc::destroy_program(prog) }
        .map_err(|e| device_error(format!("{}: nvrtcDestroyProgram: {e:?}", src.name)))?;
    let log = log.unwrap_or_default();
    match ptx {
        Err(e) => Err(device_error(format!(
            "{} does not compile for {arch} ({e:?}):\n{log}",
            src.name
        ))),
        Ok(_) if !log.is_empty() => Err(device_error(format!(
            "{} compiles for {arch} with warnings:\n{log}",
            src.name
        ))),
        Ok(ptx) => Ok(text_of(ptx)),
    }
}

/// [`compile`], once per process for each source and architecture.
pub fn compile_cached(src: &KernelSource, arch: &str) -> Result<String> {
    static CACHE: OnceLock<Mutex<HashMap<(&'static str, String), String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (src.name, arch.to_string());
    if let Some(ptx) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(ptx.clone());
    }
    let ptx = compile(src, arch)?;
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, ptx.clone());
    Ok(ptx)
}
