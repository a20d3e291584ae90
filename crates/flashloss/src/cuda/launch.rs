//! What every row-kernel launch shares: the row addressing (`Layout` in
//! `kernels/softmax_rows.cu`), a row's gradient coefficients (`RowCoef`), one block of
//! [`BLOCK`] threads per row on a 1-D grid, and the kernels' `int` column count.

use crate::batch::LogitsLayout;
use crate::error::{Error, Result};
use crate::fused::RowGrad;
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// Threads per block of the row kernels (`BLOCK` in `softmax_rows.cu`).
const BLOCK: u32 = 256;

/// Row addressing of the kernels (`Layout` in `softmax_rows.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelLayout {
    seq_len: i64,
    row_stride: i64,
    seq_stride: i64,
}

// SAFETY: plain old data with the layout of the kernels' struct.
unsafe impl DeviceRepr for KernelLayout {}

impl KernelLayout {
    pub(crate) fn of(layout: &LogitsLayout) -> Self {
        KernelLayout {
            seq_len: layout.seq_len.max(1) as i64,
            row_stride: layout.row_stride as i64,
            seq_stride: layout.seq_stride as i64,
        }
    }

    /// A dense `[rows, ld]` matrix.
    pub(crate) fn dense(rows: usize, ld: usize) -> Self {
        KernelLayout {
            seq_len: rows.max(1) as i64,
            row_stride: ld as i64,
            seq_stride: (rows * ld) as i64,
        }
    }
}

/// A row's gradient coefficients (`RowCoef` in `softmax_rows.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RowCoef {
    pub(crate) max: f32,
    pub(crate) log_sum: f32,
    pub(crate) entropy: f32,
    pub(crate) coef_p: f32,
    pub(crate) coef_h: f32,
    pub(crate) coef_uniform: f32,
    pub(crate) coef_target: f32,
    /// Vocabulary id of the target (-1: none).
    pub(crate) target: i64,
    /// A truncated support's term ([`crate::fused::SupportTerm`]; `sup_coef` 0: none).
    pub(crate) sup_coef: f32,
    pub(crate) sup_log_sum: f32,
    pub(crate) cut: u64,
    /// The head's first id in the whole vocabulary.
    pub(crate) sup_offset: i64,
}

// SAFETY: plain old data with the layout of the kernels' struct.
unsafe impl DeviceRepr for RowCoef {}

impl RowCoef {
    /// The kernels' coefficients of a row's gradient (its support term, where it has one).
    pub(crate) fn of(g: &RowGrad) -> Self {
        let sup = g.support.unwrap_or_default();
        RowCoef {
            max: g.stats.max,
            log_sum: g.stats.log_sum,
            entropy: g.stats.entropy,
            coef_p: g.coef_p,
            coef_h: g.coef_h,
            coef_uniform: g.coef_uniform,
            coef_target: g.coef_target,
            target: g.target as i64,
            sup_coef: sup.coef,
            sup_log_sum: sup.log_sum,
            cut: sup.cut,
            sup_offset: sup.offset as i64,
        }
    }
}

/// One block per row: the launch of `rows` rows (at most 2^31 - 1).
pub(crate) fn rows_launch(rows: usize) -> Result<LaunchConfig> {
    if rows > i32::MAX as usize {
        return Err(Error::InvalidArgument {
            arg: "logits",
            reason: format!("{rows} rows exceed the grid limit of {}", i32::MAX),
        });
    }
    Ok(LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `vocab` as the kernels' `int` column count.
pub(crate) fn cols_arg(vocab: usize) -> Result<i32> {
    i32::try_from(vocab).map_err(|_| Error::InvalidArgument {
        arg: "vocab",
        reason: format!("{vocab} exceeds the kernels' column limit of {}", i32::MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// `RowCoef` has the layout of the kernels' struct (`softmax_rows.cu`): seven f32, the
    /// i64 target at 32, the support's two f32 at 40 and 44, its u64 cut at 48 and i64
    /// offset at 56: 64 bytes.
    #[test]
    fn row_coef_has_the_kernels_layout() {
        assert_eq!(offset_of!(RowCoef, target), 32);
        assert_eq!(offset_of!(RowCoef, sup_coef), 40);
        assert_eq!(offset_of!(RowCoef, sup_log_sum), 44);
        assert_eq!(offset_of!(RowCoef, cut), 48);
        assert_eq!(offset_of!(RowCoef, sup_offset), 56);
        assert_eq!(size_of::<RowCoef>(), 64);
    }
}
