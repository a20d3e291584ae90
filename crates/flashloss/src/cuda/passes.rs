//! The fused LM-head passes on the GPU: logits exist only in a workspace of
//! `[block_rows, cols]` f32 (a `vocab_tile` for two-pass, the whole vocabulary for
//! single-pass) sized from the memory budget. Tile products go through cuBLAS
//! ([`super::blas`]); the row kernels of `softmax_rows.cu` merge each tile's softmax
//! state (pass A) and turn a tile into `dZ` (pass B, in place for f32 heads, into a
//! bf16 tile for bf16 heads, the operand of the bf16 products); `dH += dZ·W` and
//! `dW += dZᵀ·H` accumulate in f32. [`super::CudaHead`] (`cuda_head.rs`) is the GPU's
//! [`crate::fused::Head`], making these passes: the loss drivers of [`crate::fused`] run on
//! it as on the CPU's.

use super::blas::{GemmShape, Operand, gemm};
use super::candidates::{DeviceGather, DeviceSparse, TileArgs, hook_unsupported, no_softcap};
use super::device::{DeviceBuffer, Gpu, GpuElement, device_error};
use super::head::{GpuGrads, GpuInputs, GpuWorkspace, no_grads};
use super::launch::{KernelLayout, RowCoef, rows_launch};
use super::row_spans::{RowSpan, row_spans};
use super::support::{DeviceTop, HostRows};
use crate::element::DType;
use crate::error::{Error, Result};
use crate::fused::{
    DeviceSinks, FusedPasses, GradsOf, Plan, RowGrad, SinglePassHooks, SparseGrads, TileVisitor,
};
use crate::rows::{OnlineSoftmax, PartialStats, RowInputs, RowStats};
use crate::weight_layout::WeightLayout;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ops::Range;

/// Per-row softmax state on the device `[N]` each (`row_states`' running arrays).
struct DeviceStates {
    mu: DeviceBuffer<f32>,
    s: DeviceBuffer<f32>,
    u: DeviceBuffer<f32>,
    target: DeviceBuffer<f32>,
    sum: DeviceBuffer<f32>,
    /// `S₂ = Σ exp(2(x - μ)/T)` (for `Σp² = S₂/S²`).
    s2: DeviceBuffer<f32>,
}

/// The GPU's [`FusedPasses`] over one head.
pub(super) struct GpuPasses<'a, E> {
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
    pub(super) fn new(
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
                s2: gpu.zeros(n)?,
            },
            gpu,
            head,
            rows,
            plan,
            ws,
            out,
        })
    }

    /// The blocks of the rows that take part (`cuda/row_spans.rs`): pass A's, the extra
    /// passes', the single pass's, and pass B's under a truncated support (its keys
    /// compare logits recomputed in blocks of the same shapes, bitwise the same).
    fn row_blocks(&self) -> Vec<RowSpan> {
        row_spans(self.rows.live, self.plan.block_rows)
    }

    fn vocab_tiles(&self, vt: usize) -> Vec<Range<usize>> {
        let v = self.head.vocab;
        (0..v).step_by(vt).map(|s| s..(s + vt).min(v)).collect()
    }

    /// The f32 logits tile (every plan but a compact one).
    fn logits_addr(&self) -> Result<u64> {
        let z = self.ws.logits.as_ref().ok_or_else(|| Error::Device {
            reason: "the fused workspace has no f32 logits tile".into(),
        })?;
        Ok(self.gpu.addr(z, 0))
    }

    /// Where a block's logits go: the f32 tile, or a compact plan's bf16 chunk (which
    /// then holds `dZ` in place).
    fn block_logits(&self) -> Result<Operand> {
        if !self.plan.compact {
            return Ok(Operand::f32(self.logits_addr()?));
        }
        let chunk = self.ws.dz.as_ref().ok_or_else(|| Error::Device {
            reason: "the fused workspace has no bf16 logits chunk".into(),
        })?;
        Ok(Operand::bf16(self.gpu.addr(chunk, 0)))
    }

    /// The raw logits `H[rows]·W[vocab]ᵀ` into the block's logits (row stride `ldz`),
    /// rounded to bf16 in a compact plan.
    fn logits_tile(&self, rows: &Range<usize>, vocab: &Range<usize>, ldz: usize) -> Result<()> {
        let head = self.head;
        gemm(
            &self.ws.blas,
            head.logits_shape(rows.len(), vocab.len(), ldz),
            head.weight_from(self.gpu, vocab.start),
            head.hidden_from(self.gpu, rows.start),
            self.block_logits()?,
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
        let logits = self.block_logits()?;
        let f = gpu.kernel(match logits.is_bf16() {
            true => "row_states_bf16",
            false => "row_states_f32",
        })?;
        let z = logits.addr;
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
            gpu.addr(&st.s2, r0),
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
            .arg(&ptrs[6])
            .arg(&ptrs[7]);
        // SAFETY: the arguments match `row_states_*`; the tile holds `rows` rows of
        // `ldz` columns, the per-row arrays hold N entries from row 0.
        unsafe { launch.launch(rows_launch(rows.len())?) }
            .map(|_| ())
            .map_err(|e| device_error("launching row_states", e))
    }

    /// The device states of `rows`, copied to the host: six copies into pageable
    /// memory, each of which returns once done (a wait, counted in `Gpu::host_syncs`).
    fn download_states(&self, rows: &Range<usize>) -> Result<PartialStats> {
        let st = &self.states;
        let get = |b: &DeviceBuffer<f32>| self.gpu.download_range(b, rows.clone());
        let (mu, s, u, target, sum, s2) = (
            get(&st.mu)?,
            get(&st.s)?,
            get(&st.u)?,
            get(&st.target)?,
            get(&st.sum)?,
            get(&st.s2)?,
        );
        let inv_temp = self.rows.transform.inv_temp;
        Ok(PartialStats {
            states: (0..rows.len())
                .map(|r| OnlineSoftmax {
                    inv_temp,
                    max: mu[r],
                    sum: s[r] as f64,
                    weighted: u[r] as f64,
                    sum2: s2[r] as f64,
                })
                .collect(),
            target_logits: target,
            sums: sum.into_iter().map(f64::from).collect(),
        })
    }

    /// The tile of `rows` × `vocab` (row stride `ld`) as the candidate kernels take it.
    fn tile_args<'r>(
        &self,
        rows: &'r Range<usize>,
        vocab: &'r Range<usize>,
        ld: usize,
    ) -> TileArgs<'r> {
        TileArgs {
            rows,
            vocab,
            ld,
            bias: self.bias_addr(vocab),
            cap: self.cap_args(),
        }
    }

    /// Turns the tile (row stride `ldz`, rows `rows`, vocabulary `vocab`) into `dZ`
    /// with `coefs` (one per row of the block) and the `sparse` terms, and adds its
    /// products into the gradients.
    fn grad_and_accumulate(
        &self,
        (rows, vocab, ldz): (&Range<usize>, &Range<usize>, usize),
        coefs: &DeviceBuffer<RowCoef>,
        sparse: Option<&DeviceSparse>,
    ) -> Result<()> {
        let gpu = self.gpu;
        let h = self.head.hidden_size;
        let logits = self.block_logits()?;
        let z = logits.addr;
        // dZ in place (the f32 tile, or a compact plan's bf16 chunk), or into the bf16
        // tile of a bf16 head, the operand of its bf16 products.
        let (dz_op, kernel) = match &self.ws.dz {
            _ if logits.is_bf16() => (logits, "row_grad_bf16"),
            Some(d) if E::DTYPE == DType::Bf16 => {
                (Operand::bf16(gpu.addr(d, 0)), "row_grad_f32_to_bf16")
            }
            _ => (logits, "row_grad_f32"),
        };
        let dz = dz_op.addr;
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
        if let Some(sp) = sparse {
            sp.add(
                gpu,
                (dz, dz_op.is_bf16()),
                &self.tile_args(rows, vocab, ldz),
            )?;
        }
        let out = self.out.as_deref().ok_or_else(no_grads)?;
        let head = self.head;
        gemm(
            &self.ws.blas,
            head.dhidden_shape(rows.len(), vocab.len(), ldz),
            head.weight_from(gpu, vocab.start),
            dz_op,
            Operand::f32(gpu.addr(&out.dhidden, rows.start * h)),
            1.0,
        )?;
        // A frozen head (`Plan::head_grad`) has no dW buffer: dH alone. dW is laid out
        // as the weight: `dWᵀ` of `[V, H]` is `(H as A)·(dZ as B)ᵀ`, `[H, V]`'s block
        // `(dZ as A)·(H as B)ᵀ`.
        if let Some(dweight) = &out.dweight {
            let (r, vt, x) = (rows.len(), vocab.len(), head.hidden_from(gpu, rows.start));
            let (shape, a, b, at) = match head.layout {
                WeightLayout::VocabMajor => {
                    (GemmShape::dweight(r, vt, h, ldz), x, dz_op, vocab.start * h)
                }
                WeightLayout::HiddenMajor => {
                    let shape = GemmShape::dweight_hv(r, vt, h, ldz, head.vocab);
                    (shape, dz_op, x, vocab.start)
                }
            };
            let c = Operand::f32(gpu.addr(dweight, at));
            gemm(&self.ws.blas, shape, a, b, c, 1.0)?;
        }
        if let Some(db) = &out.dbias {
            let sums = if dz_op.is_bf16() {
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
        let coefs: Vec<RowCoef> = grads.iter().map(RowCoef::of).collect();
        self.gpu.upload(&coefs)
    }
}

impl<E: GpuElement> GpuPasses<'_, E> {
    /// Pass A, gathering the candidates of `gather` and keeping the top keys of `top`
    /// from each tile.
    fn states_pass(
        &mut self,
        (gather, top): (Option<&DeviceGather>, Option<&DeviceTop>),
    ) -> Result<PartialStats> {
        let vt = self.plan.vocab_tile;
        let hooks = (self.rows.transform.inv_temp, self.gpu.addr(&self.live, 0));
        for RowSpan { rows, .. } in self.row_blocks() {
            for (t, vocab) in self.vocab_tiles(vt).into_iter().enumerate() {
                self.logits_tile(&rows, &vocab, vocab.len())?;
                self.merge_states(&rows, &vocab, vocab.len(), t > 0)?;
                let (z, tile) = (
                    self.logits_addr()?,
                    self.tile_args(&rows, &vocab, vocab.len()),
                );
                if let Some(g) = gather {
                    g.tile(self.gpu, Operand::f32(z), &tile)?;
                }
                if let Some(top) = top {
                    top.tile(self.gpu, z, &tile, hooks)?;
                }
            }
        }
        self.download_states(&(0..self.head.tokens))
    }

    /// An extra pass of a truncated support: the logits tiles of the row blocks that
    /// hold a row `visitor` wants, those rows' alone handed to it on the host.
    fn host_rows_pass(&mut self, visitor: &mut dyn TileVisitor) -> Result<()> {
        let wanted = visitor.rows_wanted().ok_or_else(hook_unsupported)?;
        let vt = self.plan.vocab_tile;
        let blocks: Vec<Range<usize>> = self.row_blocks().into_iter().map(|b| b.rows).collect();
        let host = HostRows::new(self.gpu, &blocks, &wanted, vt)?;
        for (rows, picked) in blocks.iter().zip(&host.picked) {
            if picked.is_empty() {
                continue;
            }
            for vocab in self.vocab_tiles(vt) {
                self.logits_tile(rows, &vocab, vocab.len())?;
                let (z, tile) = (
                    self.logits_addr()?,
                    self.tile_args(rows, &vocab, vocab.len()),
                );
                let logits = host.tile(self.gpu, z, &tile, picked)?;
                visitor.visit(picked, vocab.clone(), &logits, vocab.len());
            }
        }
        Ok(())
    }

    /// Pass B with the `sparse` terms added to each `dZ` tile, over the blocks of the rows
    /// with a gradient (pass A's blocks under a truncated support).
    fn grads_pass(&mut self, grads: &[RowGrad], sparse: Option<&DeviceSparse>) -> Result<()> {
        let vt = self.plan.vocab_tile;
        let blocks = match grads.iter().any(|g| g.support.is_some()) {
            true => self.row_blocks(),
            false => {
                let with_gradient: Vec<bool> = (grads.iter().enumerate())
                    .map(|(i, g)| !g.is_zero() || sparse.is_some_and(|s| !s.row_is_zero(i)))
                    .collect();
                row_spans(&with_gradient, self.plan.block_rows)
            }
        };
        for RowSpan { rows, .. } in blocks {
            if rows.is_empty() {
                continue;
            }
            let sparse_zero = sparse.is_none_or(|s| s.rows_are_zero(&rows));
            if grads[rows.clone()].iter().all(RowGrad::is_zero) && sparse_zero {
                continue;
            }
            let coefs = self.upload_coefs(&grads[rows.clone()])?;
            for vocab in self.vocab_tiles(vt) {
                self.logits_tile(&rows, &vocab, vocab.len())?;
                self.grad_and_accumulate((&rows, &vocab, vocab.len()), &coefs, sparse)?;
            }
        }
        Ok(())
    }

    /// Single pass, gathering the candidates of `gather` from each block and adding the
    /// `sparse` terms to its `dZ`.
    fn single_pass_with(
        &mut self,
        grads_of: &mut GradsOf,
        gather: Option<&DeviceGather>,
        sparse: Option<&DeviceSparse>,
    ) -> Result<Vec<RowStats>> {
        let v = self.head.vocab;
        let all = 0..v;
        let mut stats = vec![RowStats::default(); self.head.tokens];
        for RowSpan { rows, span } in self.row_blocks() {
            if rows.is_empty() {
                grads_of(span, &stats);
                continue;
            }
            self.logits_tile(&rows, &all, v)?;
            self.merge_states(&rows, &all, v, false)?;
            if let Some(g) = gather {
                g.tile(
                    self.gpu,
                    self.block_logits()?,
                    &self.tile_args(&rows, &all, v),
                )?;
            }
            let part = self.download_states(&rows)?;
            for (r, i) in rows.clone().enumerate() {
                stats[i] = part.finish_row(r, i, &self.rows, v);
            }
            // The span's rows left out take no part: their gradients are zero.
            let grads = grads_of(span.clone(), &stats);
            let own = rows.start - span.start..rows.end - span.start;
            let coefs = self.upload_coefs(&grads[own])?;
            self.grad_and_accumulate((&rows, &all, v), &coefs, sparse)?;
        }
        Ok(stats)
    }

    /// `sparse` on the device (no soft-cap: its slope is not applied).
    fn upload_sparse(&self, sparse: &SparseGrads) -> Result<DeviceSparse> {
        if self.rows.transform.softcap.is_some() {
            return Err(no_softcap());
        }
        DeviceSparse::upload(self.gpu, sparse, self.head.tokens, self.head.vocab)
    }
}

/// The hooks run on the device: candidate sets (their ids up once, their logits down
/// once, `cuda/candidates.rs`), a truncated support's top keys (down once) and its extra
/// passes (the searching rows' logits down, `cuda/support.rs`); a visitor that needs
/// every tile on the host is refused ([`hook_unsupported`]).
impl<E: GpuElement> FusedPasses for GpuPasses<'_, E> {
    fn plan(&self) -> Plan {
        self.plan
    }

    fn row_states(&mut self) -> Result<PartialStats> {
        self.states_pass((None, None))
    }

    fn accumulate_grads(&mut self, grads: &[RowGrad]) -> Result<()> {
        self.grads_pass(grads, None)
    }

    fn row_states_visiting(&mut self, visitor: &mut dyn TileVisitor) -> Result<PartialStats> {
        let DeviceSinks { gather, top } = visitor.device_sinks();
        let (mut gather_sink, mut top_sink) = (gather, top);
        if gather_sink.is_none() && top_sink.is_none() {
            return Err(hook_unsupported());
        }
        let (gpu, n) = (self.gpu, self.head.tokens);
        let gather = (gather_sink.as_ref())
            .map(|s| DeviceGather::upload(gpu, s))
            .transpose()?;
        let top = (top_sink.as_ref())
            .map(|s| DeviceTop::new(gpu, n, s))
            .transpose()?;
        let states = self.states_pass((gather.as_ref(), top.as_ref()))?;
        if let (Some(g), Some(s)) = (&gather, gather_sink.as_mut()) {
            g.download(gpu, s)?;
        }
        if let (Some(t), Some(s)) = (&top, top_sink.as_mut()) {
            t.download(gpu, s)?;
        }
        Ok(states)
    }

    fn visit_tiles(&mut self, visitor: &mut dyn TileVisitor) -> Result<()> {
        self.host_rows_pass(visitor)
    }

    fn accumulate_grads_sparse(&mut self, grads: &[RowGrad], sparse: &SparseGrads) -> Result<()> {
        let sparse = self.upload_sparse(sparse)?;
        self.grads_pass(grads, Some(&sparse))
    }

    fn single_pass(&mut self, grads_of: &mut GradsOf) -> Result<Vec<RowStats>> {
        self.single_pass_with(grads_of, None, None)
    }

    fn single_pass_hooked(
        &mut self,
        grads_of: &mut GradsOf,
        hooks: SinglePassHooks,
    ) -> Result<Vec<RowStats>> {
        let mut sink = match hooks.visitor {
            Some(v) => Some(v.device_sinks().gather.ok_or_else(hook_unsupported)?),
            None => None,
        };
        let gather = (sink.as_ref())
            .map(|s| DeviceGather::upload(self.gpu, s))
            .transpose()?;
        let sparse = hooks.sparse.map(|s| self.upload_sparse(s)).transpose()?;
        let stats = self.single_pass_with(grads_of, gather.as_ref(), sparse.as_ref())?;
        if let (Some(g), Some(s)) = (&gather, sink.as_mut()) {
            g.download(self.gpu, s)?;
        }
        Ok(stats)
    }
}
