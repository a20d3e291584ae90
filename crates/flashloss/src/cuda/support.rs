//! The sampler's truncated support (`top_k`/`top_p`/`min_p`) on the GPU: the device half
//! of what [`crate::fused`]'s support (`fused/support/`) runs through its pass hooks on
//! the CPU. The decisions are the CPU's own code, run on the host over what the device
//! hands it:
//! - pass A: `top_keys.cu` keeps per row, tile by tile, its top `C` keys of the support's
//!   order ([`DeviceTop`]: `C = clamp(top_k + 1, 256, 4096)`, `8·C` bytes a row on the
//!   device); they come down once after the pass (`8·C + 5` bytes a row: 2 KiB at
//!   `C = 256`, 16 MiB at N = 8192). No pass-A histogram is kept, and pass A's f32 sums
//!   are not cut by: a top-p row its buffer cannot decide sums its mass (f64) in its
//!   first extra pass;
//! - extra passes (rows the buffer cannot decide: flat rows under top-p, ties beyond the
//!   buffer, min-p or top-k cuts below it): each recomputes the logits tiles of the row
//!   blocks that hold a searching row and hands only those rows' logits (after bias and
//!   soft-cap, `rows_logits_f32`) to the host's search ([`HostRows`]: `4·V` bytes down a
//!   searching row and pass);
//! - pass B: each row's [`crate::fused::SupportTerm`] goes up in its `RowCoef` (the cut,
//!   `log_sum^K`, the coefficient, the head's offset) and `row_grad` adds
//!   `coef·p^K_j·[key_j ≥ cut]` with the key formed as `fused/support/key.rs` forms it.
//!
//! Compiled with NVRTC and checked by ptxas (sm_80, sm_90, sm_100); not run on a GPU.
//! The kernel's algorithm is tested on the host through its model
//! (`fused/support/device_top.rs`) under the CPU's decisions against the f64 reference.

use super::candidates::TileArgs;
use super::device::{DeviceBuffer, Gpu, device_error};
use super::launch::{cols_arg, rows_launch};
use crate::error::{Error, Result};
use crate::fused::DeviceTopSink;
use cudarc::driver::PushKernelArg;
use std::ops::Range;

/// Most keys a row's device buffer holds (`MAX_CAP` in `top_keys.cu`, the support's
/// largest buffer).
const MAX_CAP: usize = 4096;

/// Every row's top keys on the device: `[N, C]` keys (in no order), `[N]` counts and
/// dropped flags.
pub(crate) struct DeviceTop {
    cap: usize,
    offset: usize,
    keys: DeviceBuffer<u64>,
    count: DeviceBuffer<i32>,
    dropped: DeviceBuffer<u8>,
}

impl DeviceTop {
    /// Empty buffers of `sink.cap` keys for `n` rows.
    pub(crate) fn new(gpu: &Gpu, n: usize, sink: &DeviceTopSink) -> Result<Self> {
        let cap = check_cap(sink.cap)?;
        Ok(DeviceTop {
            cap,
            offset: sink.offset,
            keys: gpu.zeros(n * cap)?,
            count: gpu.zeros(n)?,
            dropped: gpu.zeros(n)?,
        })
    }

    /// Merges the f32 logits tile at `z` (rows `tile.rows` of the head, its vocabulary
    /// `tile.vocab`) into the rows' buffers; rows whose `live` flag (device address of
    /// the head's `[N]` flags) is 0 are skipped.
    pub(crate) fn tile(
        &self,
        gpu: &Gpu,
        z: u64,
        tile: &TileArgs,
        (inv_temp, live): (f32, u64),
    ) -> Result<()> {
        let rows = tile.rows;
        let (ldz, cols) = (tile.ld as i64, cols_arg(tile.vocab.len())?);
        let id0 = (self.offset + tile.vocab.start) as i64;
        let (cap, inv_cap) = tile.cap;
        let c = self.cap as i32;
        let live = live + rows.start as u64;
        let ptrs = [
            gpu.addr(&self.keys, rows.start * self.cap),
            gpu.addr(&self.count, rows.start),
            gpu.addr(&self.dropped, rows.start),
        ];
        let mut launch = gpu.stream().launch_builder(gpu.kernel("top_keys_f32")?);
        launch
            .arg(&z)
            .arg(&ldz)
            .arg(&cols)
            .arg(&id0)
            .arg(&tile.bias)
            .arg(&cap)
            .arg(&inv_cap)
            .arg(&inv_temp)
            .arg(&live)
            .arg(&ptrs[0])
            .arg(&ptrs[1])
            .arg(&ptrs[2])
            .arg(&c);
        // SAFETY: the arguments match `top_keys_f32`; the tile holds `rows` rows of `ld`
        // columns, the buffers `rows` rows of `cap` keys from the block's first row.
        unsafe { launch.launch(rows_launch(rows.len())?) }
            .map(|_| ())
            .map_err(|e| device_error("launching top_keys", e))
    }

    /// Every row's keys and whether they are the whole row, into `sink` (one
    /// synchronization; `8·C + 5` bytes a row).
    pub(crate) fn download(&self, gpu: &Gpu, sink: &mut DeviceTopSink) -> Result<()> {
        let keys = gpu.download(&self.keys)?;
        let count = gpu.download(&self.count)?;
        let dropped = gpu.download(&self.dropped)?;
        *sink.tops = Some(tops_of(&keys, &count, &dropped, self.cap));
        Ok(())
    }
}

/// A buffer size the kernel takes (`1..=MAX_CAP`).
fn check_cap(cap: usize) -> Result<usize> {
    match cap {
        1..=MAX_CAP => Ok(cap),
        _ => Err(Error::InvalidArgument {
            arg: "top_k",
            reason: format!("a support buffer of {cap} keys (the device holds 1 to {MAX_CAP})"),
        }),
    }
}

/// The rows' downloaded buffers (`[N, cap]` keys, `[N]` counts and dropped flags) as
/// the support's decisions take them: row `i`'s first `count[i]` keys, and whether they
/// are the whole row.
fn tops_of(keys: &[u64], count: &[i32], dropped: &[u8], cap: usize) -> Vec<(Vec<u64>, bool)> {
    (keys.chunks(cap).zip(count).zip(dropped))
        .map(|((row, &n), &d)| (row[..(n.max(0) as usize).min(cap)].to_vec(), d == 0))
        .collect()
}

/// The rows of an extra pass that go to the host, per row block: their indices within
/// the block (uploaded once per block) and a staging buffer of `[rows, vocab_tile]` f32.
pub(crate) struct HostRows {
    /// Per block: its global rows that are wanted (ascending).
    pub(crate) picked: Vec<Vec<usize>>,
    staging: DeviceBuffer<f32>,
}

impl HostRows {
    /// The wanted rows of each of `blocks` (`wanted`: `[N]` flags), with a staging
    /// buffer for the largest block's wanted rows of `vocab_tile` entries.
    pub(crate) fn new(
        gpu: &Gpu,
        blocks: &[Range<usize>],
        wanted: &[bool],
        vocab_tile: usize,
    ) -> Result<Self> {
        let picked = picked_rows(blocks, wanted);
        let most = picked.iter().map(Vec::len).max().unwrap_or(0);
        Ok(HostRows {
            staging: gpu.zeros((most * vocab_tile).max(1))?,
            picked,
        })
    }

    /// The wanted rows `picked` (global, of the block `tile.rows`) of the f32 tile at
    /// `z`, as the loss sees them (bias and soft-cap), on the host: `[picked, cols]`
    /// (one copy to the host).
    pub(crate) fn tile(
        &self,
        gpu: &Gpu,
        z: u64,
        tile: &TileArgs,
        picked: &[usize],
    ) -> Result<Vec<f32>> {
        let local: Vec<i32> = picked
            .iter()
            .map(|&i| (i - tile.rows.start) as i32)
            .collect();
        let local = gpu.upload(&local)?;
        let cols = tile.vocab.len();
        let (ldz, ncols) = (tile.ld as i64, cols_arg(cols)?);
        let (cap, inv_cap) = tile.cap;
        let (rows, out) = (gpu.addr(&local, 0), gpu.addr(&self.staging, 0));
        let mut launch = gpu.stream().launch_builder(gpu.kernel("rows_logits_f32")?);
        launch
            .arg(&z)
            .arg(&ldz)
            .arg(&ncols)
            .arg(&tile.bias)
            .arg(&cap)
            .arg(&inv_cap)
            .arg(&rows)
            .arg(&out);
        // SAFETY: the arguments match `rows_logits_f32`; `rows` holds `picked.len()`
        // rows of the tile, the staging buffer room for them at `cols` entries each.
        unsafe { launch.launch(rows_launch(picked.len())?) }
            .map_err(|e| device_error("launching rows_logits", e))?;
        // A copy into pageable host memory returns once done: no synchronization after it.
        gpu.download_range(&self.staging, 0..picked.len() * cols)
    }
}

/// Per block, its rows whose `wanted` flag is set.
fn picked_rows(blocks: &[Range<usize>], wanted: &[bool]) -> Vec<Vec<usize>> {
    (blocks.iter())
        .map(|b| b.clone().filter(|&i| wanted[i]).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downloaded_buffers_become_the_rows_keys() {
        let cap = 3;
        let keys = [9, 7, 8, 5, 0, 0, 0, 0, 0];
        let tops = tops_of(&keys, &[3, 1, 0], &[1, 0, 0], cap);
        assert_eq!(tops[0], (vec![9, 7, 8], false));
        assert_eq!(tops[1], (vec![5], true));
        assert_eq!(tops[2], (vec![], true));
    }

    #[test]
    fn buffer_sizes_outside_the_kernels_range_are_refused() {
        assert_eq!(check_cap(256).unwrap(), 256);
        assert_eq!(check_cap(MAX_CAP).unwrap(), MAX_CAP);
        for bad in [0, MAX_CAP + 1] {
            let err = check_cap(bad).unwrap_err().to_string();
            assert!(err.contains("top_k"), "{err}");
        }
    }

    #[test]
    fn the_rows_an_extra_pass_wants_per_block() {
        let blocks = [0..3, 3..6, 6..7];
        let wanted = [false, true, true, false, false, false, true];
        assert_eq!(
            picked_rows(&blocks, &wanted),
            vec![vec![1, 2], vec![], vec![6]]
        );
    }
}
