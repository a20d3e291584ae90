//! Candidate sets (`gather_ids`) on the GPU: the device half of the pass hooks that
//! [`crate::fused::gather`] runs through a [`TileVisitor`] on the CPU. Instead of handing
//! each logits tile to the host, the visitor's ids go to the device once
//! ([`DeviceGather`]: `[N, K]` ids local to the head, 8·N·K bytes up) and
//! `gather_logits.cu` picks the candidates' logits out of each tile as it is formed; the
//! `[N, K]` f32 logits come back once at the end of the pass (4·N·K bytes down). The
//! gradient's one-hot terms ([`SparseGrads`]) go up once per pass ([`DeviceSparse`]:
//! 12·N·K bytes) and `sparse_grads.cu` adds them into each `dZ` tile before its
//! products. Compiled with NVRTC and checked by ptxas in CI; not run on a device yet.
//! The truncated support's device half is `support.rs`.

use super::blas::Operand;
use super::device::{DeviceBuffer, Gpu, device_error};
use super::launch::{cols_arg, rows_launch};
use crate::error::{Error, Result};
use crate::fused::{DeviceGatherSink, SparseGrads};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ops::Range;

/// Threads per block of `sparse_add_*` (`BLOCK` in `sparse_grads.cu`): one per row.
const SPARSE_BLOCK: u32 = 256;
/// Threads per block of `gather_logits_f32` (`BLOCK` in `gather_logits.cu`): one block
/// per row, its threads over the row's slots.
const GATHER_BLOCK: u32 = 64;

/// The launch of `gather_logits_f32` over `rows` rows (at most 2^31 - 1, as every row
/// kernel's).
pub(crate) fn gather_launch(rows: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        block_dim: (GATHER_BLOCK, 1, 1),
        ..rows_launch(rows)?
    })
}

/// The launch of `sparse_add_*` over `rows` rows: one thread per row.
pub(crate) fn sparse_launch(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(SPARSE_BLOCK as usize).max(1) as u32, 1, 1),
        block_dim: (SPARSE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `k` as the kernels' `int` slot count.
fn k_arg(k: usize) -> Result<i32> {
    i32::try_from(k).map_err(|_| Error::InvalidArgument {
        arg: "gather_ids",
        reason: format!(
            "{k} candidates per row exceed the kernels' limit of {}",
            i32::MAX
        ),
    })
}

/// What the logits tile holds for a gather or a sparse add: its rows of the head (the
/// block), row stride, vocabulary entries (of the head), bias address at the tile's
/// first entry (0: none) and soft-cap `(cap, 1/cap)` (`(0, 0)`: none).
pub(crate) struct TileArgs<'r> {
    pub(crate) rows: &'r Range<usize>,
    pub(crate) vocab: &'r Range<usize>,
    pub(crate) ld: usize,
    pub(crate) bias: u64,
    pub(crate) cap: (f32, f32),
}

/// A visitor's candidate ids on the device and the logits gathered so far.
pub(crate) struct DeviceGather {
    k: usize,
    ids: DeviceBuffer<i64>,
    z: DeviceBuffer<f32>,
}

impl DeviceGather {
    /// Uploads `sink`'s ids (`[N, K]`, local to the head, -1: not gathered).
    pub(crate) fn upload(gpu: &Gpu, sink: &DeviceGatherSink) -> Result<Self> {
        Ok(DeviceGather {
            k: sink.k,
            ids: gpu.upload(sink.local_ids)?,
            z: gpu.zeros(sink.local_ids.len())?,
        })
    }

    /// Gathers the candidates of `tile.rows` that fall in the f32 tile at `z`.
    pub(crate) fn tile(&self, gpu: &Gpu, logits: Operand, tile: &TileArgs) -> Result<()> {
        let (rows, k) = (tile.rows, self.k);
        let (cols, kk) = (cols_arg(tile.vocab.len())?, k_arg(k)?);
        let (ld, col0) = (tile.ld as i64, tile.vocab.start as i64);
        let (ids, out) = (
            gpu.addr(&self.ids, rows.start * k),
            gpu.addr(&self.z, rows.start * k),
        );
        let (cap, inv_cap) = tile.cap;
        let kernel = match logits.is_bf16() {
            true => "gather_logits_bf16",
            false => "gather_logits_f32",
        };
        let z = logits.addr;
        let mut launch = gpu.stream().launch_builder(gpu.kernel(kernel)?);
        launch
            .arg(&z)
            .arg(&ld)
            .arg(&col0)
            .arg(&cols)
            .arg(&tile.bias)
            .arg(&cap)
            .arg(&inv_cap)
            .arg(&ids)
            .arg(&kk)
            .arg(&out);
        // SAFETY: the arguments match `gather_logits_*`; the tile holds `rows` rows of
        // `ld` columns, `ids` and `out` the block's `rows · k` entries from its first row.
        unsafe { launch.launch(gather_launch(rows.len())?) }
            .map(|_| ())
            .map_err(|e| device_error("launching gather_logits", e))
    }

    /// Copies the gathered logits into `sink.z` where its ids are on this head (one
    /// synchronization).
    pub(crate) fn download(&self, gpu: &Gpu, sink: &mut DeviceGatherSink) -> Result<()> {
        let z = gpu.download(&self.z)?;
        copy_gathered(sink, &z);
        Ok(())
    }
}

/// `sink.z[at] = z[at]` where `sink.local_ids[at] ≥ 0` (the others keep their values: a
/// vocabulary shard's zeros, summed over the shards).
pub(crate) fn copy_gathered(sink: &mut DeviceGatherSink, z: &[f32]) {
    for ((out, &id), &v) in sink.z.iter_mut().zip(sink.local_ids).zip(z) {
        if id >= 0 {
            *out = v;
        }
    }
}

/// Sparse gradient terms on the device, with the rows that add nothing.
pub(crate) struct DeviceSparse {
    k: usize,
    ids: DeviceBuffer<i64>,
    coefs: DeviceBuffer<f32>,
    zero_rows: Vec<bool>,
}

impl DeviceSparse {
    /// Uploads `sparse` (checked against a head of `n` rows and `vocab` entries).
    pub(crate) fn upload(gpu: &Gpu, sparse: &SparseGrads, n: usize, vocab: usize) -> Result<Self> {
        sparse.check(n, vocab)?;
        Ok(DeviceSparse {
            k: sparse.k,
            ids: gpu.upload(&sparse.ids)?,
            coefs: gpu.upload(&sparse.coefs)?,
            zero_rows: (0..n).map(|i| sparse.row_is_zero(i)).collect(),
        })
    }

    /// Whether row `i` adds nothing.
    pub(crate) fn row_is_zero(&self, i: usize) -> bool {
        self.zero_rows[i]
    }

    /// Whether every row of `rows` adds nothing.
    pub(crate) fn rows_are_zero(&self, rows: &Range<usize>) -> bool {
        self.zero_rows[rows.clone()].iter().all(|&z| z)
    }

    /// Adds the terms of `tile.rows` that fall in the `dZ` tile at `dz` (bf16 when
    /// `bf16`). `tile.cap` must be none (the slope is not applied).
    pub(crate) fn add(&self, gpu: &Gpu, (dz, bf16): (u64, bool), tile: &TileArgs) -> Result<()> {
        if tile.cap != (0.0, 0.0) {
            return Err(no_softcap());
        }
        let (rows, k) = (tile.rows, self.k);
        let (nrows, cols, kk) = (
            cols_arg(rows.len())?,
            cols_arg(tile.vocab.len())?,
            k_arg(k)?,
        );
        let (ld, col0) = (tile.ld as i64, tile.vocab.start as i64);
        let ids = gpu.addr(&self.ids, rows.start * k);
        let coefs = gpu.addr(&self.coefs, rows.start * k);
        let kernel = if bf16 {
            "sparse_add_bf16"
        } else {
            "sparse_add_f32"
        };
        let mut launch = gpu.stream().launch_builder(gpu.kernel(kernel)?);
        launch
            .arg(&dz)
            .arg(&ld)
            .arg(&nrows)
            .arg(&col0)
            .arg(&cols)
            .arg(&ids)
            .arg(&coefs)
            .arg(&kk);
        // SAFETY: the arguments match `sparse_add_*`; `dz` holds `rows` rows of `ld`
        // columns, `ids` and `coefs` the block's `rows · k` entries from its first row.
        unsafe { launch.launch(sparse_launch(rows.len())) }
            .map(|_| ())
            .map_err(|e| device_error(&format!("launching {kernel}"), e))
    }
}

/// The error of sparse terms with a soft-cap (whose slope the `dZ` tile no longer
/// holds; a log-prob call has no soft-cap).
pub(crate) fn no_softcap() -> Error {
    Error::InvalidArgument {
        arg: "softcap",
        reason: "candidate sets' gradient terms on CUDA take no soft-cap".into(),
    }
}

/// The error of a pass hook the GPU does not run: a visitor that needs every tile on the
/// host (the GPU runs candidate sets' gathers and a truncated support's top keys on the
/// device, and hands the host only the rows an extra pass names).
pub(crate) fn hook_unsupported() -> Error {
    Error::Unsupported {
        feature: "pass hooks",
        reason: "the CUDA backend hands the host only the rows a pass names, not every \
                 logits tile (candidate sets and truncated supports run on the device)"
            .into(),
    }
}
