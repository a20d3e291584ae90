//! The fused LM-head passes on the GPU: logits exist only in a workspace of
//! `[block_rows, cols]` f32 (a `vocab_tile` for two-pass, the whole vocabulary for
//! single-pass) sized from the memory budget. Tile products go through cuBLAS
//! ([`super::blas`]); the row kernels of `softmax_rows.cu` merge each tile's softmax
//! state (pass A) and turn a tile into `dZ` (pass B, in place for f32 heads, into a
//! bf16 tile for bf16 heads, the operand of the bf16 products); `dH += dZ·W` and
//! `dW += dZᵀ·H` accumulate in f32. [`CudaHead`] is the GPU's [`Head`]: the loss
//! drivers of [`crate::fused`] run on it as on the CPU's.

use super::blas::{CUBLAS_WORKSPACE_BYTES, GemmShape, Operand, gemm};
use super::device::{DeviceBuffer, Gpu, GpuElement, device_error};
use super::head::{GpuGrads, GpuInputs, GpuWorkspace};
use super::launch::{KernelLayout, RowCoef, rows_launch};
use crate::batch::HeadShape;
use crate::collective::Collective;
use crate::element::DType;
use crate::error::{Error, Result};
use crate::fused::{
    Block, FusedOptions, FusedPasses, GradPart, GradsOf, Head, HeadGrad, Plan, PlanLimits, RowGrad,
    plan_blocks,
};
use crate::range::grad_out_of_range;
use crate::rows::{OnlineSoftmax, PartialStats, RowInputs, RowStats};
use cudarc::cublas::sys::cudaDataType_t;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ops::Range;

/// Widest vocabulary tile of a two-pass product.
const VOCAB_TILE_MAX: usize = 16_384;
/// Largest row block (the products are near peak well before it).
const MAX_BLOCK_ROWS: usize = 8192;
/// Single-pass blocks with fewer rows make thin products; auto mode then chooses
/// two-pass.
const MIN_SINGLE_PASS_ROWS: usize = 1024;

/// Bytes per logit of a plan's tiles: the f32 logits, and the bf16 `dZ` of bf16 heads.
fn tile_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 4,
        // f16 never reaches the GPU's passes (`run_on_borrowed` refuses it).
        DType::Bf16 | DType::F16 => 6,
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
    let limits = PlanLimits {
        reserve_bytes: CUBLAS_WORKSPACE_BYTES,
        reserve_name: format!("the cuBLAS workspace of {CUBLAS_WORKSPACE_BYTES} bytes"),
        vocab_tile: v.min(VOCAB_TILE_MAX),
        max_block_rows: MAX_BLOCK_ROWS,
        min_single_pass_rows: MIN_SINGLE_PASS_ROWS,
        half_rate_rows: 0.0,
        has_compact: false,
        extra_name: "",
    };
    let per = tile_bytes(dtype);
    plan_blocks(
        n,
        v,
        &limits,
        |rows, block| match block {
            Block::Tile => rows * limits.vocab_tile * per,
            Block::Whole | Block::Compact => rows * v * per,
        },
        opts,
        single_pass_allowed,
    )
}

/// The unfused baseline's plan: one block of all `n` rows over the whole vocabulary,
/// i.e. the `[N, V]` logits (f32) and their gradient (in place, or bf16) materialized.
pub fn materialized_plan(n: usize, v: usize, dtype: DType) -> Plan {
    Plan {
        single_pass: true,
        compact: false,
        block_rows: n,
        vocab_tile: v,
        workspace_bytes: n * v * tile_bytes(dtype),
        gemm_reserve_bytes: CUBLAS_WORKSPACE_BYTES,
        bf16_products: None,
        head_grad: HeadGrad::Full,
    }
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
struct GpuPasses<'a, E> {
    gpu: &'a Gpu,
    head: &'a GpuInputs<E>,
    rows: RowInputs<'a>,
    plan: Plan,
    ws: &'a mut GpuWorkspace,
    /// Where the gradients are added (none for a pass without gradients, e.g. log-probs).
    out: Option<&'a mut GpuGrads>,
    targets: DeviceBuffer<i64>,
    live: DeviceBuffer<u8>,
    states: DeviceStates,
}

impl<'a, E: GpuElement> GpuPasses<'a, E> {
    /// Uploads the per-row inputs, allocates the O(N) state and the plan's tiles.
    fn new(
        gpu: &'a Gpu,
        head: &'a GpuInputs<E>,
        rows: RowInputs<'a>,
        plan: Plan,
        ws: &'a mut GpuWorkspace,
        out: Option<&'a mut GpuGrads>,
    ) -> Result<Self> {
        if let Some(out) = &out {
            out.check(head, plan.head_grad)?;
        }
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
        self.rows
            .transform
            .softcap
            .map_or((0.0, 0.0), |c| (c, 1.0 / c))
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
            .arg(&self.rows.transform.inv_temp)
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

    /// The device states of `rows`, copied to the host (one synchronization).
    fn download_states(&self, rows: &Range<usize>) -> Result<PartialStats> {
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
        let inv_temp = self.rows.transform.inv_temp;
        Ok(PartialStats {
            states: (0..rows.len())
                .map(|r| OnlineSoftmax {
                    inv_temp,
                    max: mu[r],
                    sum: s[r] as f64,
                    weighted: u[r] as f64,
                    // The CUDA kernels do not form `S₂` (yet): `Σp²` is refused.
                    sum2: f64::NAN,
                })
                .collect(),
            target_logits: target,
            sums: sum.into_iter().map(f64::from).collect(),
        })
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
            .arg(&self.rows.transform.inv_temp)
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
        let out = self.out.as_deref().ok_or_else(no_grads)?;
        gemm(
            &self.ws.blas,
            GemmShape::dhidden(rows.len(), vocab.len(), h, ldz),
            Operand {
                addr: gpu.addr(&self.head.weight, vocab.start * h),
                dtype: E::BLAS_TYPE,
            },
            dz_op,
            gpu.addr(&out.dhidden, rows.start * h),
            1.0,
        )?;
        // A frozen head (`Plan::head_grad`) has no dW buffer: dH alone.
        if let Some(dweight) = &out.dweight {
            gemm(
                &self.ws.blas,
                GemmShape::dweight(rows.len(), vocab.len(), h, ldz),
                Operand {
                    addr: gpu.addr(&self.head.hidden, rows.start * h),
                    dtype: E::BLAS_TYPE,
                },
                dz_op,
                gpu.addr(dweight, vocab.start * h),
                1.0,
            )?;
        }
        if let Some(db) = &out.dbias {
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

    fn row_states(&mut self) -> Result<PartialStats> {
        let vt = self.plan.vocab_tile;
        for rows in self.row_blocks() {
            for (t, vocab) in self.vocab_tiles(vt).into_iter().enumerate() {
                self.logits_tile(&rows, &vocab, vocab.len())?;
                self.merge_states(&rows, &vocab, vocab.len(), t > 0)?;
            }
        }
        self.download_states(&(0..self.head.tokens))
    }

    fn accumulate_grads(&mut self, grads: &[RowGrad]) -> Result<()> {
        if grads.iter().any(|g| g.support.is_some()) {
            return Err(Error::Unsupported {
                feature: "top_k/top_p/min_p",
                reason:
                    "the CUDA backend does not support a truncated support yet; use the CPU backend"
                        .into(),
            });
        }
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
            let part = self.download_states(&rows)?;
            for (r, i) in rows.clone().enumerate() {
                stats[i] = part.finish_row(r, i, &self.rows, v);
            }
            let grads = grads_of(rows.clone(), &stats);
            let coefs = self.upload_coefs(&grads)?;
            self.grad_and_accumulate(&rows, &all, v, &coefs)?;
        }
        Ok(stats)
    }
}

/// The error of a pass that adds gradients on a head made without gradient buffers.
fn no_grads() -> Error {
    Error::InvalidArgument {
        arg: "grads",
        reason: "this head has no gradient buffers (a log-prob head)".into(),
    }
}

/// Checks that every entry of the device buffer `buf` (argument `arg`) is finite.
fn check_finite<T: GpuElement>(gpu: &Gpu, arg: &'static str, buf: &DeviceBuffer<T>) -> Result<()> {
    match gpu.first_non_finite(buf)? {
        Some(index) => Err(Error::NonFinite {
            arg,
            index,
            value: gpu.value_at(buf, index)?.to_f32() as f64,
        }),
        None => Ok(()),
    }
}

/// An LM head in device memory with its gradients (added into, in f32) and a
/// workspace kept across steps: the GPU's [`Head`]. The per-row inputs stay on the
/// host; the per-row loss stages run there between the device passes.
pub struct CudaHead<'a, E> {
    /// The GPU.
    pub gpu: &'a Gpu,
    /// Hidden states, weight, bias.
    pub head: &'a GpuInputs<E>,
    /// The cuBLAS handle and tiles.
    pub ws: &'a mut GpuWorkspace,
    /// Where the gradients are added (none for a loss without gradients, e.g. log-probs).
    pub grads: Option<&'a mut GpuGrads>,
    /// Run [`materialized_plan`] (the unfused baseline) instead of planning to the budget.
    pub materialized: bool,
}

impl<E: GpuElement> Head for CudaHead<'_, E> {
    fn shape(&self) -> HeadShape {
        self.head.shape()
    }

    fn validate(&self, grads: Option<HeadGrad>) -> Result<()> {
        let (gpu, head) = (self.gpu, self.head);
        check_finite(gpu, "hidden", &head.hidden)?;
        check_finite(gpu, "weight", &head.weight)?;
        if let Some(b) = &head.bias {
            check_finite(gpu, "bias", b)?;
        }
        match (&self.grads, grads) {
            (Some(g), Some(head_grad)) => g.check(head, head_grad),
            (None, Some(_)) => Err(no_grads()),
            (_, None) => Ok(()),
        }
    }

    fn check_grads(&self, seq_len: usize) -> Result<()> {
        let Some(g) = &self.grads else {
            return Ok(());
        };
        let h = self.head.hidden_size;
        for (quantity, buf) in std::iter::once(("dhidden", &g.dhidden))
            .chain(g.dweight.as_ref().map(|w| ("dweight", w)))
            .chain(g.dbias.as_ref().map(|b| ("dbias", b)))
        {
            if let Some(k) = self.gpu.first_non_finite(buf)? {
                let value = self.gpu.value_at(buf, k)?;
                return Err(grad_out_of_range(quantity, k, value, h, seq_len));
            }
        }
        Ok(())
    }

    fn plan(&self, opts: &FusedOptions, single_pass_allowed: bool) -> Result<Plan> {
        let (n, v) = (self.head.tokens, self.head.vocab);
        if self.materialized {
            return Ok(materialized_plan(n, v, E::DTYPE));
        }
        plan(n, v, E::DTYPE, opts, single_pass_allowed)
    }

    fn passes<'s>(
        &'s mut self,
        rows: RowInputs<'s>,
        plan: Plan,
    ) -> Result<Box<dyn FusedPasses + 's>> {
        let passes = GpuPasses::new(
            self.gpu,
            self.head,
            rows,
            plan,
            &mut *self.ws,
            self.grads.as_deref_mut(),
        )?;
        Ok(Box::new(passes))
    }

    fn all_reduce(&mut self, comm: &dyn Collective, part: GradPart) -> Result<()> {
        let gpu = self.gpu;
        let grads = self.grads.as_deref_mut().ok_or_else(no_grads)?;
        let bufs = match part {
            GradPart::Hidden => vec![&mut grads.dhidden],
            GradPart::Head => grads
                .dweight
                .iter_mut()
                .chain(grads.dbias.as_mut())
                .collect(),
        };
        for buf in bufs {
            let mut host = gpu.download(buf)?;
            comm.all_reduce_sum_f32(&mut host)?;
            gpu.stream()
                .memcpy_htod(&host, buf.slice_mut())
                .map_err(|e| device_error("copying summed gradients to the device", e))?;
        }
        gpu.synchronize()
    }
}
