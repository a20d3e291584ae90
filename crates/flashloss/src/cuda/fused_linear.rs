//! The fused LM-head passes on the GPU: logits exist only in a workspace of
//! `[block_rows, cols]` f32 (a `vocab_tile` for two-pass, the whole vocabulary for
//! single-pass) sized from the memory budget. Tile products go through cuBLAS
//! (`cublasGemmEx`, f32 or bf16 operands, f32 accumulation and output); the row
//! kernels of `softmax_rows.cu` merge each tile's softmax state (pass A) and turn a
//! tile into `dZ` (pass B, in place for f32 heads, into a bf16 tile for bf16 heads, the
//! operand of the bf16 products); `dH += dZ·W` and `dW += dZᵀ·H` accumulate in f32.
//! The per-row loss stages run on the host ([`crate::cpu::FusedPasses`]), so each loss
//! is written once for both backends.
//!
//! cuBLAS is column-major: a row-major `[r, c]` matrix with row stride `ld` is its
//! column-major transpose `[c, r]` with leading dimension `ld`. [`GemmShape`] maps each
//! row-major product onto those arguments.

use super::device::{DeviceBuffer, Gpu, GpuElement, device_error};
use super::grpo_logits::{KernelLayout, RowCoef, rows_launch};
use crate::batch::LinearInputs;
use crate::cpu::{
    FusedOptions, FusedPasses, GradsOf, LinearGrads, OnlineSoftmax, Plan, RowGrad, RowStats,
    check_grad_lens,
};
use crate::element::DType;
use crate::error::{Error, Result};
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::{CudaBlas, result as blas};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;
use std::ops::Range;

/// Bytes of the cuBLAS workspace the backend gives each handle (counted in its
/// memory; NVIDIA recommends 32 MiB on Hopper).
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// Widest vocabulary tile of a two-pass product.
const VOCAB_TILE_MAX: usize = 16_384;
/// Largest row block (the products are near peak well before it).
const MAX_BLOCK_ROWS: usize = 8192;
/// Single-pass blocks with fewer rows make thin products; auto mode then chooses
/// two-pass.
const MIN_SINGLE_PASS_ROWS: usize = 1024;

/// An LM head on the device: hidden states `[N, H]`, weight `[V, H]` (row-major, in
/// `E`), bias `[V]` (widened to f32).
pub struct GpuHead<E> {
    /// `[N, H]`.
    pub hidden: DeviceBuffer<E>,
    /// `[V, H]`.
    pub weight: DeviceBuffer<E>,
    /// `[V]`.
    pub bias: Option<DeviceBuffer<f32>>,
    /// N.
    pub tokens: usize,
    /// H.
    pub hidden_size: usize,
    /// V.
    pub vocab: usize,
}

impl<E: GpuElement> GpuHead<E> {
    /// Checks `inputs` on the host (shapes, finite values) and copies them to the device.
    pub fn upload(gpu: &Gpu, inputs: &LinearInputs<E>) -> Result<Self> {
        inputs.validate()?;
        let bias = match inputs.bias {
            Some(b) => Some(gpu.upload(&b.iter().map(|x| x.to_f32()).collect::<Vec<_>>())?),
            None => None,
        };
        Ok(GpuHead {
            hidden: gpu.upload(inputs.hidden)?,
            weight: gpu.upload(inputs.weight)?,
            bias,
            tokens: inputs.tokens,
            hidden_size: inputs.hidden_size,
            vocab: inputs.vocab,
        })
    }
}

/// Gradients of a head on the device, accumulated in f32.
pub struct GpuGrads {
    /// `dH` `[N, H]`.
    pub dhidden: DeviceBuffer<f32>,
    /// `dW` `[V, H]`.
    pub dweight: DeviceBuffer<f32>,
    /// `dbias` `[V]` (when the head has a bias).
    pub dbias: Option<DeviceBuffer<f32>>,
}

impl GpuGrads {
    /// Zeroed gradients for `head`'s shapes.
    pub fn zeros<E>(gpu: &Gpu, head: &GpuHead<E>) -> Result<Self> {
        let (n, h, v) = (head.tokens, head.hidden_size, head.vocab);
        Ok(GpuGrads {
            dhidden: gpu.zeros(n * h)?,
            dweight: gpu.zeros(v * h)?,
            dbias: match head.bias {
                Some(_) => Some(gpu.zeros(v)?),
                None => None,
            },
        })
    }

    /// Host copies.
    pub fn download(&self, gpu: &Gpu) -> Result<LinearGrads> {
        Ok(LinearGrads {
            dhidden: gpu.download(&self.dhidden)?,
            dweight: gpu.download(&self.dweight)?,
            dbias: match &self.dbias {
                Some(d) => Some(gpu.download(d)?),
                None => None,
            },
        })
    }

    /// Checks that the buffers match `head`'s shapes (and bias presence).
    pub fn check<E>(&self, head: &GpuHead<E>) -> Result<()> {
        check_grad_lens(
            (head.tokens, head.hidden_size, head.vocab),
            head.bias.is_some(),
            self.dhidden.len(),
            self.dweight.len(),
            self.dbias.as_ref().map(DeviceBuffer::len),
        )
    }
}

/// The cuBLAS handle with its (counted) workspace, and the logits and `dZ` tiles, kept
/// across calls as a training loop would. New tiles are poisoned with NaN.
pub struct GpuWorkspace {
    blas: CudaBlas,
    _blas_workspace: DeviceBuffer<u8>,
    logits: Option<DeviceBuffer<f32>>,
    dz: Option<DeviceBuffer<bf16>>,
}

impl GpuWorkspace {
    /// A cuBLAS handle on the GPU's stream with a workspace of
    /// [`CUBLAS_WORKSPACE_BYTES`] allocated through the GPU's accounting.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let blas =
            CudaBlas::new(gpu.stream().clone()).map_err(|e| device_error("cublasCreate", e))?;
        let workspace = gpu.zeros::<u8>(CUBLAS_WORKSPACE_BYTES)?;
        let addr = gpu.addr(&workspace, 0);
        // SAFETY: the workspace outlives the handle's use of it (both live in `self`,
        // and the handle is only used through `self`).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                addr as *mut std::ffi::c_void,
                CUBLAS_WORKSPACE_BYTES,
            )
        }
        .result()
        .map_err(|e| device_error("cublasSetWorkspace", e))?;
        Ok(GpuWorkspace {
            blas,
            _blas_workspace: workspace,
            logits: None,
            dz: None,
        })
    }

    /// Bytes of tiles held (the cuBLAS workspace aside).
    pub fn bytes(&self) -> usize {
        self.logits.as_ref().map_or(0, |b| 4 * b.len())
            + self.dz.as_ref().map_or(0, |b| 2 * b.len())
    }

    /// Tiles for `plan` (`[block_rows, cols]` f32 logits, and a bf16 `dZ` tile for bf16
    /// heads); buffers of another size are replaced by NaN-poisoned ones.
    fn prepare(&mut self, gpu: &Gpu, plan: &Plan, vocab: usize, bf16_dz: bool) -> Result<()> {
        let need = plan.block_rows
            * if plan.single_pass {
                vocab
            } else {
                plan.vocab_tile
            };
        if self.logits.as_ref().map(DeviceBuffer::len) != Some(need) {
            self.logits = None;
            self.logits = Some(gpu.nans(need)?);
        }
        let dz_need = if bf16_dz { Some(need) } else { None };
        if self.dz.as_ref().map(DeviceBuffer::len) != dz_need {
            self.dz = None;
            if bf16_dz {
                self.dz = Some(gpu.nans(need)?);
            }
        }
        Ok(())
    }
}

/// Bytes per logit of a plan's tiles: the f32 logits, and the bf16 `dZ` of bf16 heads.
fn tile_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 4,
        DType::Bf16 => 6,
    }
}

/// Chooses the mode and block sizes on the GPU: the largest blocks whose tiles fit the
/// budget less the cuBLAS workspace. `single_pass_allowed` is false for losses that
/// reduce over sequences.
pub fn plan(
    n: usize,
    v: usize,
    dtype: DType,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<Plan> {
    let budget = opts
        .budget_bytes
        .checked_sub(CUBLAS_WORKSPACE_BYTES)
        .ok_or_else(|| Error::InvalidArgument {
            arg: "budget_bytes",
            reason: format!(
                "{} bytes is below the cuBLAS workspace of {CUBLAS_WORKSPACE_BYTES} bytes",
                opts.budget_bytes
            ),
        })?;
    let per = tile_bytes(dtype);
    let vocab_tile = v.min(VOCAB_TILE_MAX);
    let largest = |cols: usize| (budget / (cols * per)).min(n).min(MAX_BLOCK_ROWS);
    let single_rows = largest(v);
    let single = opts.mode.single_pass(
        single_pass_allowed,
        single_rows >= MIN_SINGLE_PASS_ROWS.min(n),
    )?;
    let (rows, cols) = if single {
        (single_rows, v)
    } else {
        (largest(vocab_tile), vocab_tile)
    };
    if rows == 0 {
        return Err(Error::InvalidArgument {
            arg: "budget_bytes",
            reason: format!(
                "{} bytes (less the cuBLAS workspace of {CUBLAS_WORKSPACE_BYTES}) cannot hold one row of {cols} logits",
                opts.budget_bytes
            ),
        });
    }
    Ok(Plan {
        single_pass: single,
        block_rows: rows,
        vocab_tile,
        workspace_bytes: rows * cols * per,
        gemm_reserve_bytes: CUBLAS_WORKSPACE_BYTES,
    })
}

/// The unfused baseline's plan: one block of all `n` rows over the whole vocabulary,
/// i.e. the `[N, V]` logits (f32) and their gradient (in place, or bf16) materialized.
pub fn materialized_plan(n: usize, v: usize, dtype: DType) -> Plan {
    Plan {
        single_pass: true,
        block_rows: n,
        vocab_tile: v,
        workspace_bytes: n * v * tile_bytes(dtype),
        gemm_reserve_bytes: CUBLAS_WORKSPACE_BYTES,
    }
}

/// Column-major cuBLAS arguments `C[m, n] (ldc) = op(A)[m, k] (lda) · op(B)[k, n] (ldb)`
/// of a row-major product; `trans_a`/`trans_b` mean `op = ᵀ`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    /// `op(A) = Aᵀ`.
    pub trans_a: bool,
    /// `op(B) = Bᵀ`.
    pub trans_b: bool,
    /// Rows of `C` (column-major).
    pub m: usize,
    /// Columns of `C`.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Leading dimension of `A`.
    pub lda: usize,
    /// Leading dimension of `B`.
    pub ldb: usize,
    /// Leading dimension of `C`.
    pub ldc: usize,
}

impl GemmShape {
    /// `Z[rows, vt] (row stride ldz) = H[rows, h] · W[vt, h]ᵀ` with `A = W`, `B = H`:
    /// column-major `Zᵀ[vt, rows] = (W as [h, vt])ᵀ · (H as [h, rows])`.
    pub fn logits(rows: usize, vt: usize, h: usize, ldz: usize) -> Self {
        GemmShape {
            trans_a: true,
            trans_b: false,
            m: vt,
            n: rows,
            k: h,
            lda: h,
            ldb: h,
            ldc: ldz,
        }
    }

    /// `dH[rows, h] += dZ[rows, vt] (row stride ldz) · W[vt, h]` with `A = W`, `B = dZ`:
    /// column-major `dHᵀ[h, rows] = (W as [h, vt]) · (dZ as [vt, rows])`.
    pub fn dhidden(rows: usize, vt: usize, h: usize, ldz: usize) -> Self {
        GemmShape {
            trans_a: false,
            trans_b: false,
            m: h,
            n: rows,
            k: vt,
            lda: h,
            ldb: ldz,
            ldc: h,
        }
    }

    /// `dW[vt, h] += dZ[rows, vt]ᵀ (row stride ldz) · H[rows, h]` with `A = H`,
    /// `B = dZ`: column-major `dWᵀ[h, vt] = (H as [h, rows]) · (dZ as [vt, rows])ᵀ`.
    pub fn dweight(rows: usize, vt: usize, h: usize, ldz: usize) -> Self {
        GemmShape {
            trans_a: false,
            trans_b: true,
            m: h,
            n: vt,
            k: rows,
            lda: h,
            ldb: ldz,
            ldc: h,
        }
    }
}

fn int_arg(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::InvalidArgument {
        arg: "hidden",
        reason: format!("{what} = {x} exceeds cuBLAS's 32-bit dimension limit"),
    })
}

/// An operand: its device address and cuBLAS type.
#[derive(Clone, Copy)]
struct Operand {
    addr: u64,
    dtype: cudaDataType_t,
}

/// `C (f32) = A·B + beta·C` as `shape` says, f32 accumulation.
fn gemm(
    blas: &CudaBlas,
    shape: GemmShape,
    a: Operand,
    b: Operand,
    c: u64,
    beta: f32,
) -> Result<()> {
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let alpha = 1.0f32;
    // SAFETY: the callers pass addresses of live buffers that hold the matrices the
    // shape describes; alpha and beta are host f32 (the handle's default pointer mode).
    unsafe {
        blas::gemm_ex(
            *blas.handle(),
            op(shape.trans_a),
            op(shape.trans_b),
            int_arg("m", shape.m)?,
            int_arg("n", shape.n)?,
            int_arg("k", shape.k)?,
            (&alpha as *const f32).cast(),
            a.addr as *const std::ffi::c_void,
            a.dtype,
            int_arg("lda", shape.lda)?,
            b.addr as *const std::ffi::c_void,
            b.dtype,
            int_arg("ldb", shape.ldb)?,
            (&beta as *const f32).cast(),
            c as *mut std::ffi::c_void,
            cudaDataType_t::CUDA_R_32F,
            int_arg("ldc", shape.ldc)?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| device_error("cublasGemmEx", e))
}

/// The whole `[N, V]` f32 logits `hidden · weightᵀ` of `head` into `out` (one cuBLAS
/// product: the GEMM rate the fused kernels are measured against).
pub fn head_logits<E: GpuElement>(
    gpu: &Gpu,
    head: &GpuHead<E>,
    ws: &GpuWorkspace,
    out: &mut DeviceBuffer<f32>,
) -> Result<()> {
    let (n, h, v) = (head.tokens, head.hidden_size, head.vocab);
    if out.len() != n * v {
        return Err(Error::ShapeMismatch {
            arg: "logits",
            shape: format!("[N={n}, V={v}]"),
            expected: n * v,
            actual: out.len(),
        });
    }
    gemm(
        &ws.blas,
        GemmShape::logits(n, v, h, v),
        Operand {
            addr: gpu.addr(&head.weight, 0),
            dtype: E::BLAS_TYPE,
        },
        Operand {
            addr: gpu.addr(&head.hidden, 0),
            dtype: E::BLAS_TYPE,
        },
        gpu.addr(out, 0),
        0.0,
    )
}

/// What a fused loss needs per row, on the host and the device.
pub(crate) struct RowInputs<'a> {
    /// Target ids `[N]` (host).
    pub(crate) targets: &'a [i64],
    /// Rows that take part `[N]` (host).
    pub(crate) live: &'a [bool],
    /// `1 / T_temp`.
    pub(crate) inv_temp: f32,
    /// Logit soft-cap (cross-entropy only).
    pub(crate) softcap: Option<f32>,
    /// Whether the mean logit is wanted (label smoothing).
    pub(crate) mean_logit: bool,
}

/// Per-row softmax state on the device `[N]` each (`row_states`' running arrays).
struct DeviceStates {
    mu: DeviceBuffer<f32>,
    s: DeviceBuffer<f32>,
    u: DeviceBuffer<f32>,
    target: DeviceBuffer<f32>,
    sum: DeviceBuffer<f32>,
}

/// The GPU's [`FusedPasses`] over one head.
pub(crate) struct GpuPasses<'a, E> {
    gpu: &'a Gpu,
    head: &'a GpuHead<E>,
    rows: RowInputs<'a>,
    plan: Plan,
    ws: &'a mut GpuWorkspace,
    out: &'a mut GpuGrads,
    targets: DeviceBuffer<i64>,
    live: DeviceBuffer<u8>,
    states: DeviceStates,
}

impl<'a, E: GpuElement> GpuPasses<'a, E> {
    /// Uploads the per-row inputs, allocates the O(N) state and the plan's tiles.
    pub(crate) fn new(
        gpu: &'a Gpu,
        head: &'a GpuHead<E>,
        rows: RowInputs<'a>,
        plan: Plan,
        ws: &'a mut GpuWorkspace,
        out: &'a mut GpuGrads,
    ) -> Result<Self> {
        out.check(head)?;
        let n = head.tokens;
        ws.prepare(gpu, &plan, head.vocab, E::DTYPE == DType::Bf16)?;
        let live: Vec<u8> = rows.live.iter().map(|&l| u8::from(l)).collect();
        Ok(GpuPasses {
            targets: gpu.upload(rows.targets)?,
            live: gpu.upload(&live)?,
            states: DeviceStates {
                mu: gpu.zeros(n)?,
                s: gpu.zeros(n)?,
                u: gpu.zeros(n)?,
                target: gpu.zeros(n)?,
                sum: gpu.zeros(n)?,
            },
            gpu,
            head,
            rows,
            plan,
            ws,
            out,
        })
    }

    fn row_blocks(&self) -> Vec<Range<usize>> {
        let (n, nb) = (self.head.tokens, self.plan.block_rows);
        (0..n).step_by(nb).map(|s| s..(s + nb).min(n)).collect()
    }

    fn vocab_tiles(&self, vt: usize) -> Vec<Range<usize>> {
        let v = self.head.vocab;
        (0..v).step_by(vt).map(|s| s..(s + vt).min(v)).collect()
    }

    fn logits_addr(&self) -> Result<u64> {
        let z = self.ws.logits.as_ref().ok_or_else(|| Error::Device {
            reason: "the fused workspace has no logits tile".into(),
        })?;
        Ok(self.gpu.addr(z, 0))
    }

    /// The raw logits `H[rows]·W[vocab]ᵀ` into the tile (row stride `ldz`).
    fn logits_tile(&self, rows: &Range<usize>, vocab: &Range<usize>, ldz: usize) -> Result<()> {
        let h = self.head.hidden_size;
        gemm(
            &self.ws.blas,
            GemmShape::logits(rows.len(), vocab.len(), h, ldz),
            Operand {
                addr: self.gpu.addr(&self.head.weight, vocab.start * h),
                dtype: E::BLAS_TYPE,
            },
            Operand {
                addr: self.gpu.addr(&self.head.hidden, rows.start * h),
                dtype: E::BLAS_TYPE,
            },
            self.logits_addr()?,
            0.0,
        )
    }

    fn bias_addr(&self, vocab: &Range<usize>) -> u64 {
        self.head
            .bias
            .as_ref()
            .map_or(0, |b| self.gpu.addr(b, vocab.start))
    }

    fn cap_args(&self) -> (f32, f32) {
        self.rows.softcap.map_or((0.0, 0.0), |c| (c, 1.0 / c))
    }

    /// Merges (or, when `merge_into` is false, starts) the running states of `rows`
    /// with the tile (row stride `ldz`) holding vocabulary `vocab`.
    fn merge_states(
        &self,
        rows: &Range<usize>,
        vocab: &Range<usize>,
        ldz: usize,
        merge_into: bool,
    ) -> Result<()> {
        let gpu = self.gpu;
        let f = gpu.kernel("row_states_f32")?;
        let z = self.logits_addr()?;
        let lz = KernelLayout::dense(rows.len(), ldz);
        let cols = i32::try_from(vocab.len()).map_err(|_| Error::InvalidArgument {
            arg: "vocab",
            reason: format!(
                "a tile of {} columns exceeds the kernels' limit",
                vocab.len()
            ),
        })?;
        let col_offset = vocab.start as i64;
        let bias = self.bias_addr(vocab);
        let (cap, inv_cap) = self.cap_args();
        let merge = i32::from(merge_into);
        let r0 = rows.start;
        let st = &self.states;
        let ptrs = [
            gpu.addr(&self.targets, r0),
            gpu.addr(&self.live, r0),
            gpu.addr(&st.mu, r0),
            gpu.addr(&st.s, r0),
            gpu.addr(&st.u, r0),
            gpu.addr(&st.target, r0),
            gpu.addr(&st.sum, r0),
        ];
        let mut launch = gpu.stream().launch_builder(f);
        launch
            .arg(&z)
            .arg(&lz)
            .arg(&cols)
            .arg(&col_offset)
            .arg(&bias)
            .arg(&self.rows.inv_temp)
            .arg(&cap)
            .arg(&inv_cap)
            .arg(&ptrs[0])
            .arg(&ptrs[1])
            .arg(&merge)
            .arg(&ptrs[2])
            .arg(&ptrs[3])
            .arg(&ptrs[4])
            .arg(&ptrs[5])
            .arg(&ptrs[6]);
        // SAFETY: the arguments match `row_states_f32`; the tile holds `rows` rows of
        // `ldz` columns, the per-row arrays hold N entries from row 0.
        unsafe { launch.launch(rows_launch(rows.len())?) }
            .map(|_| ())
            .map_err(|e| device_error("launching row_states", e))
    }

    /// Final statistics of `rows` from the device states.
    fn finish_rows(&self, rows: &Range<usize>, stats: &mut [RowStats]) -> Result<()> {
        let st = &self.states;
        let get = |b: &DeviceBuffer<f32>| -> Result<Vec<f32>> {
            let mut host = vec![0.0f32; rows.len()];
            self.gpu
                .stream()
                .memcpy_dtoh(&b.slice().slice(rows.clone()), &mut host)
                .map_err(|e| device_error("copying row statistics to the host", e))?;
            Ok(host)
        };
        let (mu, s, u, target, sum) = (
            get(&st.mu)?,
            get(&st.s)?,
            get(&st.u)?,
            get(&st.target)?,
            get(&st.sum)?,
        );
        self.gpu.synchronize()?;
        for (r, i) in rows.clone().enumerate() {
            if !self.rows.live[i] {
                stats[i] = RowStats::default();
                continue;
            }
            let state = OnlineSoftmax {
                inv_temp: self.rows.inv_temp,
                max: mu[r],
                sum: s[r] as f64,
                weighted: u[r] as f64,
            };
            let mut row = RowStats::finish(&state, target[r]);
            if self.rows.mean_logit {
                row.mean_logit =
                    (sum[r] as f64 / self.head.vocab as f64 * self.rows.inv_temp as f64) as f32;
            }
            stats[i] = row;
        }
        Ok(())
    }

    /// Turns the tile (row stride `ldz`, rows `rows`, vocabulary `vocab`) into `dZ`
    /// with `coefs` (one per row of the block) and adds its products into the gradients.
    fn grad_and_accumulate(
        &self,
        rows: &Range<usize>,
        vocab: &Range<usize>,
        ldz: usize,
        coefs: &DeviceBuffer<RowCoef>,
    ) -> Result<()> {
        let gpu = self.gpu;
        let h = self.head.hidden_size;
        let z = self.logits_addr()?;
        let (dz, dz_type, kernel) = match &self.ws.dz {
            Some(d) if E::DTYPE == DType::Bf16 => (
                gpu.addr(d, 0),
                cudaDataType_t::CUDA_R_16BF,
                "row_grad_f32_to_bf16",
            ),
            _ => (z, cudaDataType_t::CUDA_R_32F, "row_grad_f32"),
        };
        let lz = KernelLayout::dense(rows.len(), ldz);
        let cols = vocab.len() as i32;
        let col_offset = vocab.start as i64;
        let bias = self.bias_addr(vocab);
        let (cap, inv_cap) = self.cap_args();
        let mut launch = gpu.stream().launch_builder(gpu.kernel(kernel)?);
        launch
            .arg(&z)
            .arg(&lz)
            .arg(&cols)
            .arg(&col_offset)
            .arg(&bias)
            .arg(&self.rows.inv_temp)
            .arg(&cap)
            .arg(&inv_cap)
            .arg(coefs.slice())
            .arg(&dz)
            .arg(&lz);
        // SAFETY: the arguments match `row_grad_*`; `coefs` holds one entry per row of
        // the block, the tiles `rows` rows of `ldz` columns.
        unsafe { launch.launch(rows_launch(rows.len())?) }
            .map_err(|e| device_error(&format!("launching {kernel}"), e))?;
        let dz_op = Operand {
            addr: dz,
            dtype: dz_type,
        };
        gemm(
            &self.ws.blas,
            GemmShape::dhidden(rows.len(), vocab.len(), h, ldz),
            Operand {
                addr: gpu.addr(&self.head.weight, vocab.start * h),
                dtype: E::BLAS_TYPE,
            },
            dz_op,
            gpu.addr(&self.out.dhidden, rows.start * h),
            1.0,
        )?;
        gemm(
            &self.ws.blas,
            GemmShape::dweight(rows.len(), vocab.len(), h, ldz),
            Operand {
                addr: gpu.addr(&self.head.hidden, rows.start * h),
                dtype: E::BLAS_TYPE,
            },
            dz_op,
            gpu.addr(&self.out.dweight, vocab.start * h),
            1.0,
        )?;
        if let Some(db) = &self.out.dbias {
            let sums = if dz_type == cudaDataType_t::CUDA_R_16BF {
                "col_sums_bf16"
            } else {
                "col_sums_f32"
            };
            let (ld, nrows, out) = (ldz as i64, rows.len() as i32, gpu.addr(db, vocab.start));
            let mut launch = gpu.stream().launch_builder(gpu.kernel(sums)?);
            launch.arg(&dz).arg(&ld).arg(&nrows).arg(&cols).arg(&out);
            let cfg = LaunchConfig {
                grid_dim: (vocab.len().div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: `dz` holds the block's rows of `ldz` columns; `out` the tile's
            // `cols` entries of dbias.
            unsafe { launch.launch(cfg) }.map_err(|e| device_error("launching col_sums", e))?;
        }
        Ok(())
    }

    /// The device coefficients of `grads` (one per row of a block).
    fn upload_coefs(&self, grads: &[RowGrad]) -> Result<DeviceBuffer<RowCoef>> {
        let coefs: Vec<RowCoef> = grads
            .iter()
            .map(|g| RowCoef {
                max: g.stats.max,
                log_sum: g.stats.log_sum,
                entropy: g.stats.entropy,
                coef_p: g.coef_p,
                coef_h: g.coef_h,
                coef_uniform: g.coef_uniform,
                coef_target: g.coef_target,
                target: g.target as i64,
            })
            .collect();
        self.gpu.upload(&coefs)
    }
}

impl<E: GpuElement> FusedPasses for GpuPasses<'_, E> {
    fn plan(&self) -> Plan {
        self.plan
    }

    fn row_stats(&mut self) -> Result<Vec<RowStats>> {
        let vt = self.plan.vocab_tile;
        let mut stats = vec![RowStats::default(); self.head.tokens];
        for rows in self.row_blocks() {
            for (t, vocab) in self.vocab_tiles(vt).into_iter().enumerate() {
                self.logits_tile(&rows, &vocab, vocab.len())?;
                self.merge_states(&rows, &vocab, vocab.len(), t > 0)?;
            }
            self.finish_rows(&rows, &mut stats)?;
        }
        Ok(stats)
    }

    fn accumulate_grads(&mut self, grads: &[RowGrad]) -> Result<()> {
        let vt = self.plan.vocab_tile;
        for rows in self.row_blocks() {
            if grads[rows.clone()].iter().all(RowGrad::is_zero) {
                continue;
            }
            let coefs = self.upload_coefs(&grads[rows.clone()])?;
            for vocab in self.vocab_tiles(vt) {
                self.logits_tile(&rows, &vocab, vocab.len())?;
                self.grad_and_accumulate(&rows, &vocab, vocab.len(), &coefs)?;
            }
        }
        Ok(())
    }

    fn single_pass(&mut self, grads_of: &mut GradsOf) -> Result<Vec<RowStats>> {
        let v = self.head.vocab;
        let all = 0..v;
        let mut stats = vec![RowStats::default(); self.head.tokens];
        for rows in self.row_blocks() {
            self.logits_tile(&rows, &all, v)?;
            self.merge_states(&rows, &all, v, false)?;
            self.finish_rows(&rows, &mut stats)?;
            let grads = grads_of(rows.clone(), &stats);
            let coefs = self.upload_coefs(&grads)?;
            self.grad_and_accumulate(&rows, &all, v, &coefs)?;
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::GemmShape;

    /// `C = op(A)·op(B) + C` on column-major host buffers, as cuBLAS computes it.
    fn column_major_gemm(s: GemmShape, a: &[f64], b: &[f64], c: &mut [f64]) {
        let at = |i: usize, p: usize| {
            if s.trans_a {
                a[p + i * s.lda]
            } else {
                a[i + p * s.lda]
            }
        };
        let bt = |p: usize, j: usize| {
            if s.trans_b {
                b[j + p * s.ldb]
            } else {
                b[p + j * s.ldb]
            }
        };
        for j in 0..s.n {
            for i in 0..s.m {
                let dot: f64 = (0..s.k).map(|p| at(i, p) * bt(p, j)).sum();
                c[i + j * s.ldc] += dot;
            }
        }
    }

    fn matrix(len: usize, seed: usize) -> Vec<f64> {
        (0..len)
            .map(|i| ((i * 7 + seed * 13) % 11) as f64 - 5.0)
            .collect()
    }

    /// Each shape, run as cuBLAS would on the row-major buffers, is the row-major
    /// product it names; a logits tile with row stride wider than the tile (single
    /// pass) leaves the other columns alone.
    #[test]
    fn gemm_shapes_compute_the_row_major_products() {
        let (rows, vt, h, ldz) = (5, 3, 4, 7);
        let hidden = matrix(rows * h, 1);
        let weight = matrix(vt * h, 2);
        let dz = matrix(rows * ldz, 3);

        let mut z = vec![100.0; rows * ldz];
        column_major_gemm(
            GemmShape::logits(rows, vt, h, ldz),
            &weight,
            &hidden,
            &mut z,
        );
        for r in 0..rows {
            for c in 0..ldz {
                let want = if c < vt {
                    100.0
                        + (0..h)
                            .map(|p| hidden[r * h + p] * weight[c * h + p])
                            .sum::<f64>()
                } else {
                    100.0
                };
                assert_eq!(z[r * ldz + c], want, "z[{r}, {c}]");
            }
        }

        let mut dh = vec![0.0; rows * h];
        column_major_gemm(GemmShape::dhidden(rows, vt, h, ldz), &weight, &dz, &mut dh);
        for r in 0..rows {
            for c in 0..h {
                let want: f64 = (0..vt).map(|j| dz[r * ldz + j] * weight[j * h + c]).sum();
                assert_eq!(dh[r * h + c], want, "dh[{r}, {c}]");
            }
        }

        let mut dw = vec![0.0; vt * h];
        column_major_gemm(GemmShape::dweight(rows, vt, h, ldz), &hidden, &dz, &mut dw);
        for j in 0..vt {
            for c in 0..h {
                let want: f64 = (0..rows).map(|r| dz[r * ldz + j] * hidden[r * h + c]).sum();
                assert_eq!(dw[j * h + c], want, "dw[{j}, {c}]");
            }
        }
    }
}
