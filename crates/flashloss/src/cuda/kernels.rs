//! Kernel sources and their compilation with NVRTC. A source compiles with no log at
//! all: any warning is an error, as the CI check (which compiles every source for
//! `compute_90` and `compute_80` without a GPU) requires. [`compile_cubin`] runs ptxas
//! too (real targets, CI's spill and shared-memory check) and reads its report.

use crate::error::{Error, Result};
use cudarc::nvrtc::result::{self as nvrtc, NvrtcError};
use cudarc::nvrtc::sys as nvrtc_sys;
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

/// Candidate sets (`gather_ids`): the logits at each row's candidate ids, gathered from
/// each tile as it is formed.
pub const GATHER_LOGITS: KernelSource = KernelSource {
    name: "gather_logits.cu",
    source: include_str!("kernels/gather_logits.cu"),
    kernels: &["gather_logits_f32", "gather_logits_bf16"],
};

/// The candidate sets' one-hot gradient terms, added into a `dZ` tile (f32 or bf16).
pub const SPARSE_GRADS: KernelSource = KernelSource {
    name: "sparse_grads.cu",
    source: include_str!("kernels/sparse_grads.cu"),
    kernels: &["sparse_add_f32", "sparse_add_bf16"],
};

/// A truncated support (`top_k`/`top_p`/`min_p`): pass A's per-row top keys selected from
/// each tile, and the rows an extra pass hands to the host.
pub const TOP_KEYS: KernelSource = KernelSource {
    name: "top_keys.cu",
    source: include_str!("kernels/top_keys.cu"),
    kernels: &["top_keys_f32", "rows_logits_f32"],
};

/// Every source of the backend.
pub const SOURCES: &[KernelSource] = &[SOFTMAX_ROWS, GATHER_LOGITS, SPARSE_GRADS, TOP_KEYS];

/// The headers every program gets (name as `#include`d, text), written once: the bf16
/// loads and stores, the logit's bias and soft-cap, the support's keys.
pub const HEADERS: &[(&str, &str)] = &[("flashloss.cuh", include_str!("kernels/flashloss.cuh"))];

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

/// The NVRTC program of `src` with [`HEADERS`].
fn create_program(src: &KernelSource) -> Result<nvrtc_sys::nvrtcProgram> {
    let cstr = |s: &str| CString::new(s).expect("kernel sources and names hold no NUL");
    let (code, name) = (cstr(src.source), cstr(src.name));
    let texts: Vec<CString> = HEADERS.iter().map(|(_, text)| cstr(text)).collect();
    let names: Vec<CString> = HEADERS.iter().map(|(name, _)| cstr(name)).collect();
    let text_ptrs: Vec<*const c_char> = texts.iter().map(|t| t.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
    let mut prog = std::mem::MaybeUninit::uninit();
    // SAFETY: every pointer is to a NUL-terminated string alive for the call, the arrays
    // hold `HEADERS.len()` of them; NVRTC copies what it keeps.
    unsafe {
        nvrtc_sys::nvrtcCreateProgram(
            prog.as_mut_ptr(),
            code.as_ptr(),
            name.as_ptr(),
            HEADERS.len() as i32,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
        .result()
        .map_err(|e| device_error(format!("{}: nvrtcCreateProgram: {e:?}", src.name)))?;
        Ok(prog.assume_init())
    }
}

/// Runs NVRTC on `src` for `arch` with `extra` options; returns what `output` reads
/// from the compiled program (the PTX or the cubin) and the log. A failure names the
/// source and carries NVRTC's log.
fn run_nvrtc(
    src: &KernelSource,
    arch: &str,
    extra: &[&str],
    output: unsafe fn(nvrtc_sys::nvrtcProgram) -> std::result::Result<Vec<c_char>, NvrtcError>,
) -> Result<(Vec<c_char>, String)> {
    if !nvrtc_present() {
        return Err(device_error(
            "no NVRTC library found (libnvrtc.so): install the CUDA toolkit or the \
             nvidia-cuda-nvrtc wheel and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let prog = create_program(src)?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    options.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: `prog` is a live program; it is destroyed below on every path.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    let log = unsafe { nvrtc::get_program_log(prog) }.map(text_of);
    let out = compiled.and_then(|_| unsafe { output(prog) });
    unsafe { nvrtc::destroy_program(prog) }
        .map_err(|e| device_error(format!("{}: nvrtcDestroyProgram: {e:?}", src.name)))?;
    let log = log.unwrap_or_default();
    match out {
        Err(e) => Err(device_error(format!(
            "{} does not compile for {arch} ({e:?}):\n{log}",
            src.name
        ))),
        Ok(out) => Ok((out, log)),
    }
}

fn warnings(src: &KernelSource, arch: &str, log: &str) -> Error {
    device_error(format!(
        "{} compiles for {arch} with warnings:\n{log}",
        src.name
    ))
}

/// Compiles `src` for `arch` (e.g. `compute_90`) to PTX. Errors name the source and
/// carry NVRTC's log; a log on success (a warning) is an error too.
pub fn compile(src: &KernelSource, arch: &str) -> Result<String> {
    let (ptx, log) = run_nvrtc(src, arch, &[], nvrtc::get_ptx)?;
    if !log.is_empty() {
        return Err(warnings(src, arch, &log));
    }
    Ok(text_of(ptx))
}

/// The real architectures every kernel is compiled for in CI (cubin, so that ptxas
/// runs): Ampere, Hopper, Blackwell.
pub const CUBIN_ARCHS: &[&str] = &["sm_80", "sm_90", "sm_100"];

/// The static shared memory a block may hold on each of [`CUBIN_ARCHS`]: 48 KiB (the
/// larger opt-in limits apply to dynamic shared memory, which no kernel takes).
pub const STATIC_SMEM_LIMIT: u64 = 48 * 1024;

/// What ptxas reports for one kernel on one real architecture (`--ptxas-options=-v`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelUsage {
    /// The `extern "C"` name.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u64,
    /// Bytes spilled to local memory (stores and loads).
    pub spill_stores: u64,
    /// See `spill_stores`.
    pub spill_loads: u64,
    /// Stack frame bytes per thread.
    pub stack: u64,
    /// Static shared memory bytes per block.
    pub smem: u64,
}

impl KernelUsage {
    /// Why the kernel fails CI (a spill, or shared memory over [`STATIC_SMEM_LIMIT`]).
    pub fn violation(&self) -> Option<String> {
        let k = &self.kernel;
        if self.spill_stores > 0 || self.spill_loads > 0 {
            let (s, l) = (self.spill_stores, self.spill_loads);
            return Some(format!("{k} spills ({s} bytes stored, {l} bytes loaded)"));
        }
        (self.smem > STATIC_SMEM_LIMIT).then(|| {
            let (b, max) = (self.smem, STATIC_SMEM_LIMIT);
            format!("{k} uses {b} bytes of shared memory (at most {max})")
        })
    }
}

/// A source compiled for a real architecture: the cubin and ptxas's usage per kernel.
#[derive(Debug)]
pub struct Cubin {
    /// The ELF image.
    pub image: Vec<u8>,
    /// One entry per kernel, in ptxas's order.
    pub usage: Vec<KernelUsage>,
}

unsafe fn get_cubin(prog: nvrtc_sys::nvrtcProgram) -> std::result::Result<Vec<c_char>, NvrtcError> {
    let mut size = 0usize;
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut image = vec![0 as c_char; size];
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, image.as_mut_ptr()) }.result()?;
    Ok(image)
}

/// Compiles `src` for a real `arch` (e.g. `sm_90`) to a cubin with ptxas's verbose
/// report. A log line that is not ptxas's report (a warning) is an error.
pub fn compile_cubin(src: &KernelSource, arch: &str) -> Result<Cubin> {
    let (image, log) = run_nvrtc(src, arch, &["--ptxas-options=-v"], get_cubin)?;
    let usage = parse_ptxas_log(&log).ok_or_else(|| warnings(src, arch, &log))?;
    Ok(Cubin {
        image: image.into_iter().map(|c| c as u8).collect(),
        usage,
    })
}

/// The number before `unit` in one of `line`'s comma-separated fields.
fn field(line: &str, unit: &str) -> Option<u64> {
    line.split(',').find_map(|part| {
        let at = part.find(unit)?;
        part[..at].split_whitespace().last()?.parse().ok()
    })
}

/// ptxas's `-v` report per kernel; `None` if a line is not part of the report.
pub fn parse_ptxas_log(log: &str) -> Option<Vec<KernelUsage>> {
    let mut usage: Vec<KernelUsage> = Vec::new();
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next()?.to_string();
            usage.push(KernelUsage {
                kernel,
                ..Default::default()
            });
        } else if line.starts_with("ptxas info") {
            if let (Some(k), Some(r)) = (usage.last_mut(), field(line, " registers")) {
                k.registers = r;
                k.smem = field(line, " bytes smem").unwrap_or(0);
            }
        } else if line.starts_with("ptxas ") && line.contains("bytes stack frame") {
            // A kernel's properties, and those of the functions it calls.
            let k = usage.last_mut()?;
            k.stack = k.stack.max(field(line, " bytes stack frame")?);
            k.spill_stores += field(line, " bytes spill stores")?;
            k.spill_loads += field(line, " bytes spill loads")?;
        } else {
            return None;
        }
    }
    Some(usage)
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
