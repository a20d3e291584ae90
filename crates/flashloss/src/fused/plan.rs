//! How a fused LM-head step is cut into work: single-pass (a row block's logits over
//! the whole vocabulary kept at once, 6NHV FLOPs) or two-pass (statistics first, then a
//! recomputation for the gradients, 8NHV), and the largest row block and vocabulary
//! tile whose workspace fits the memory budget. The search is written once; a backend
//! gives its [`PlanLimits`] and what a block costs it. A frozen head ([`HeadGrad`])
//! drops the `dW = dZᵀ·H` product: 4NHV single-pass, 6NHV two-pass.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// How the fused kernel recomputes logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The plan the rate model ([`PlanLimits::half_rate_rows`]) finds fastest for the
    /// budget: two-pass, f32 single-pass, or compact single-pass, whose results carry a
    /// rounding (docs/spec/losses.md): the CPU's, of the probabilities to f16; the GPU's
    /// (bf16 heads), of the logits to bf16.
    #[default]
    Auto,
    /// [`Mode::Auto`] among the f32 plans only (two-pass or f32 single-pass).
    AutoF32,
    /// Logits of a row block kept whole: 6NHV (token-level losses only).
    SinglePass,
    /// Statistics first, then recompute: 8NHV, smallest workspace.
    TwoPass,
    /// Single-pass with a compact block. CPU: each `[rows, vocab_tile]` tile's
    /// `exp((z - μ_tile)/T)` kept in f16 with its per-row max `μ_tile`, instead of the
    /// f32 logits: about twice the rows per block at the same budget; the stored
    /// probabilities are rounded to f16 (relative 2^-11; see docs/spec/losses.md). GPU,
    /// bf16 heads: the block's logits in one bf16 chunk (rounded to bf16, relative
    /// 2^-9), overwritten by `dZ` in place: three times the rows of an f32 block.
    /// Backends without a compact block (f32 heads on the GPU) run it as
    /// [`Mode::SinglePass`].
    Compact,
}

impl Mode {
    /// Whether a plan keeps whole rows: as asked, or in auto mode when the loss allows
    /// it (`allowed`: false for losses that reduce over sequences) and the budget holds
    /// a useful row block (`rows_useful`, the backend's threshold). Asking for
    /// single-pass where the loss does not allow it is an error.
    pub fn keeps_whole_rows(self, allowed: bool, rows_useful: bool) -> Result<bool> {
        match self {
            Mode::SinglePass | Mode::Compact if !allowed => Err(Error::InvalidArgument {
                arg: "mode",
                reason: format!(
                    "{} needs a token-level loss without a truncated support (sequence-level ratios and vespo reduce over whole sequences first; top_k/top_p/min_p need each row's whole statistics); use two_pass or auto",
                    if self == Mode::Compact {
                        "compact"
                    } else {
                        "single_pass"
                    }
                ),
            }),
            Mode::SinglePass | Mode::Compact => Ok(true),
            Mode::TwoPass => Ok(false),
            Mode::Auto | Mode::AutoF32 => Ok(allowed && rows_useful),
        }
    }
}

/// How the CPU forms the products of a bf16 head (`Z = H·Wᵀ`, `dH = dZ·W`, `dW = dZᵀ·H`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Bf16Products {
    /// The faster on this CPU, chosen at run time: [`Bf16Products::Avx512Bf16`] where
    /// the CPU has AVX512-BF16 and a product measured once per process runs at least
    /// 1.1x as fast on it as [`Bf16Products::Widened`], which runs otherwise
    /// (`crate::cpu::bf16_choice`); the environment variable `FLASHLOSS_BF16_PRODUCTS`
    /// (`crate::cpu::BF16_PRODUCTS_ENV`) chooses instead where set, in every binding.
    #[default]
    Auto,
    /// Operands widened to f32 a block or a tile at a time, f32 products (`gemm`).
    Widened,
    /// bf16 operands on `vdpbf16ps` with f32 accumulation; `dZ` is rounded to bf16 for
    /// the two gradient products (docs/spec/losses.md, the bf16 tolerances). An error on
    /// a CPU without AVX512-BF16.
    #[serde(rename = "avx512bf16")]
    Avx512Bf16,
}

impl Bf16Products {
    /// Every choice.
    pub const ALL: [Bf16Products; 3] = [
        Bf16Products::Auto,
        Bf16Products::Widened,
        Bf16Products::Avx512Bf16,
    ];

    /// The name configs use (`auto`, `widened`, `avx512bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Bf16Products::Auto => "auto",
            Bf16Products::Widened => "widened",
            Bf16Products::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The choice named `name` ([`Bf16Products::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// Which gradients of the LM head's own parameters a fused step forms (`dH` always).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HeadGrad {
    /// `dW = dZᵀ·H`, and `dbias = Σ_rows dZ` where the head has a bias.
    #[default]
    Full,
    /// A frozen head: neither `dW` nor `dbias`, no buffers for them and no product
    /// (`2NHV` FLOPs less; `dH` exactly as with [`HeadGrad::Full`]).
    Frozen,
}

impl HeadGrad {
    /// The gradient products per `NHV`: `dH` (2) and `dW` (2, a trainable head).
    pub fn product_flops(self) -> f64 {
        match self {
            HeadGrad::Full => 4.0,
            HeadGrad::Frozen => 2.0,
        }
    }

    /// Whether `dW` (and `dbias`) are formed.
    pub fn has_dweight(self) -> bool {
        self == HeadGrad::Full
    }
}

/// Options of the fused LM-head kernels.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedOptions {
    /// Recomputation strategy.
    pub mode: Mode,
    /// The CPU's products on a bf16 head (ignored for f32 heads and on the GPU).
    pub bf16_products: Bf16Products,
    /// Bytes the kernel's workspace may use (logit tiles, widened bf16 tiles, the
    /// backend's reserve); `None`, the default: the backend's own ([`FusedOptions::budget`]:
    /// the CPU's [`DEFAULT_BUDGET_MIB`]; the GPU's from the device's memory,
    /// `crate::gpu_plan::default_budget`).
    pub budget_bytes: Option<usize>,
    /// Upstream gradient `∂(outer loss)/∂L`.
    pub grad_output: f32,
    /// Which of the head's own gradients are formed.
    pub head_grad: HeadGrad,
}

impl FusedOptions {
    /// The options of a statistics-only (forward) call within `budget_bytes` (`None`: the
    /// backend's default): two-pass, `grad_output` 1, a trainable head.
    pub fn forward(budget_bytes: impl Into<Option<usize>>) -> FusedOptions {
        FusedOptions {
            bf16_products: Default::default(),
            mode: Mode::TwoPass,
            budget_bytes: budget_bytes.into(),
            grad_output: 1.0,
            head_grad: HeadGrad::Full,
        }
    }

    /// These options in mode two-pass (the split passes and the statistics-only drivers).
    pub fn two_pass(&self) -> FusedOptions {
        FusedOptions {
            mode: Mode::TwoPass,
            ..*self
        }
    }

    /// Options with a budget of `budget_mib` MiB (`2^20` bytes, fractions allowed;
    /// `None`: the backend's default).
    pub fn from_mib(mode: Mode, budget_mib: impl Into<Option<f64>>, grad_output: f32) -> Self {
        FusedOptions {
            mode,
            bf16_products: Bf16Products::Auto,
            budget_bytes: budget_mib.into().map(mib_to_bytes),
            grad_output,
            head_grad: HeadGrad::Full,
        }
    }

    /// The budget in bytes: the one given, else the CPU's default ([`DEFAULT_BUDGET_MIB`];
    /// the GPU resolves an unset budget from the device before it plans).
    pub fn budget(&self) -> usize {
        self.budget_bytes
            .unwrap_or_else(|| mib_to_bytes(DEFAULT_BUDGET_MIB))
    }

    /// These options with `budget_bytes` where they have none.
    pub fn or_budget(&self, budget_bytes: usize) -> FusedOptions {
        FusedOptions {
            budget_bytes: Some(self.budget_bytes.unwrap_or(budget_bytes)),
            ..*self
        }
    }
}

/// `mib` MiB (`2^20` bytes) in bytes, rounded down: the one conversion of the configs'
/// `budget_mib`.
pub fn mib_to_bytes(mib: f64) -> usize {
    (mib * (1u64 << 20) as f64) as usize
}

/// The CPU's workspace budget where a call gives none: 160 MiB. On the 2-core CPU of docs/bench/cpu.md it holds
/// an f32 single-pass block of ~265 rows at V = 151936, which auto mode prefers to
/// two-pass; 64 MiB (the earlier default) holds ~100 rows and falls back to two-pass.
pub const DEFAULT_BUDGET_MIB: f64 = 160.0;

impl Default for FusedOptions {
    /// Auto mode, the backend's default budget, `grad_output` 1, a trainable head.
    fn default() -> Self {
        Self::from_mib(Mode::Auto, None, 1.0)
    }
}

/// Block sizes chosen from the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// True when a row block's logits over the whole vocabulary are kept at once.
    pub single_pass: bool,
    /// Single-pass with the compact block of [`Mode::Compact`] (CPU: f16 exponentials;
    /// GPU: a bf16 logits chunk).
    pub compact: bool,
    /// Rows per block.
    pub block_rows: usize,
    /// Vocabulary entries per tile.
    pub vocab_tile: usize,
    /// Bytes of the kernel's own tiles and widened blocks.
    pub workspace_bytes: usize,
    /// Bytes the backend reserves before its tiles (CPU: `gemm`'s packing buffers;
    /// GPU: the cuBLAS workspace).
    pub gemm_reserve_bytes: usize,
    /// The products a bf16 head ran on the CPU (never `Auto`); `None` for f32 heads and
    /// on the GPU (cuBLAS takes bf16 operands).
    pub bf16_products: Option<Bf16Products>,
    /// Which of the head's own gradients the passes form.
    pub head_grad: HeadGrad,
}

impl Plan {
    /// FLOPs of the whole step: `2NHV` per logits computation, plus `4NHV` for dH, dW
    /// (`2NHV` for dH alone on a frozen head).
    pub fn flops(&self, n: usize, h: usize, v: usize) -> f64 {
        let nhv = n as f64 * h as f64 * v as f64;
        step_flops(self.single_pass, self.head_grad) * nhv
    }

    /// Columns of a block's logits: the whole vocabulary `v` (single-pass) or a tile.
    pub fn block_cols(&self, v: usize) -> usize {
        if self.single_pass { v } else { self.vocab_tile }
    }
}

/// What bounds a backend's plans.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanLimits {
    /// Bytes the backend holds besides its tiles, taken from the budget first.
    pub reserve_bytes: usize,
    /// What the reserve is, for error messages ("the cuBLAS workspace of 33554432").
    pub reserve_name: String,
    /// Vocabulary entries per tile.
    pub vocab_tile: usize,
    /// Largest row block (beyond it products gain nothing and the workspace grows).
    pub max_block_rows: usize,
    /// Fewest rows of a useful single-pass block (thinner blocks make poor products;
    /// auto mode then chooses two-pass).
    pub min_single_pass_rows: usize,
    /// The rate model of auto mode (0: none, the row threshold alone decides): a block
    /// of `k` rows runs its products at `k / (k + half_rate_rows)` of the plain GEMM
    /// rate, so a plan's time is its FLOPs (6NHV or 8NHV; 4NHV or 6NHV on a frozen head) times `1 + half_rate_rows/k`,
    /// and auto takes the faster of single-pass and two-pass for the budget.
    pub half_rate_rows: f64,
    /// Whether the backend has a compact block ([`Mode::Compact`]; without one, compact
    /// runs as f32 single-pass).
    pub has_compact: bool,
    /// What else a block holds, for error messages (" and a widened weight tile").
    pub extra_name: &'static str,
}

/// The blocks of a plan, which a backend prices for `rows` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// A `[rows, vocab_tile]` logits tile (two-pass).
    Tile,
    /// Whole rows of the vocabulary in f32 (single-pass).
    Whole,
    /// Whole rows in a compact block.
    Compact,
}

/// Chooses the mode and block sizes for `n` rows and `v` vocabulary entries: the
/// largest blocks whose bytes (`block_bytes(rows, block)`, increasing in `rows`) fit
/// the budget less the reserve. `single_pass_allowed` is false for losses that reduce
/// over sequences.
pub fn plan_blocks(
    n: usize,
    v: usize,
    limits: &PlanLimits,
    block_bytes: impl Fn(usize, Block) -> usize,
    opts: &FusedOptions,
    single_pass_allowed: bool,
) -> Result<Plan> {
    let budget = tile_budget(opts, limits)?;
    let largest_fit = |bytes: &dyn Fn(usize) -> usize| {
        let (mut lo, mut hi) = (0, n.min(limits.max_block_rows));
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if bytes(mid) <= budget {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    };
    let largest = |block: Block| largest_fit(&|rows| block_bytes(rows, block));
    let single_rows = largest(Block::Whole);
    let two_rows = largest(Block::Tile);
    let compact_rows = limits.has_compact.then(|| largest(Block::Compact));
    let min_rows = limits.min_single_pass_rows.min(n);
    let (single_flops, two_flops) = (
        step_flops(true, opts.head_grad),
        step_flops(false, opts.head_grad),
    );
    let (t_single, t_two) = (
        modelled_time(single_flops, single_rows, limits),
        modelled_time(two_flops, two_rows, limits),
    );
    let useful = single_rows >= min_rows && (limits.half_rate_rows == 0.0 || t_single <= t_two);
    // Auto takes the compact block only where the model says it is strictly faster (an
    // f32 block of the same rows is preferred), so never without a rate model.
    let compact_faster = opts.mode == Mode::Auto
        && limits.half_rate_rows > 0.0
        && compact_rows.is_some_and(|rows| {
            rows >= min_rows && modelled_time(single_flops, rows, limits) < t_single.min(t_two)
        });
    let single = opts
        .mode
        .keeps_whole_rows(single_pass_allowed, useful || compact_faster)?;
    let compact =
        single && (opts.mode == Mode::Compact || compact_faster) && compact_rows.is_some();
    let (rows, cols, block) = match (compact_rows, single) {
        (Some(rows), true) if compact => (rows, v, Block::Compact),
        (_, true) => (single_rows, v, Block::Whole),
        _ => (two_rows, limits.vocab_tile, Block::Tile),
    };
    if rows == 0 {
        return Err(Error::InvalidArgument {
            arg: "budget_mib",
            reason: format!(
                "{} (less {}) cannot hold one row of {cols} logits{}",
                budget_text(opts.budget()),
                limits.reserve_name,
                limits.extra_name
            ),
        });
    }
    Ok(Plan {
        single_pass: single,
        compact,
        block_rows: rows,
        vocab_tile: limits.vocab_tile,
        workspace_bytes: block_bytes(rows, block),
        gemm_reserve_bytes: limits.reserve_bytes,
        bf16_products: None,
        head_grad: opts.head_grad,
    })
}

/// FLOPs per `NHV` of a step: the logits once (single-pass) or twice (two-pass), then
/// the gradient products of `head_grad`.
fn step_flops(single_pass: bool, head_grad: HeadGrad) -> f64 {
    let logits = if single_pass { 2.0 } else { 4.0 };
    logits + head_grad.product_flops()
}

/// Auto mode's model of a plan's time, in units of `NHV` FLOPs at the plain GEMM rate:
/// `flops · (1 + half_rate_rows / rows)`.
fn modelled_time(flops: f64, rows: usize, limits: &PlanLimits) -> f64 {
    flops * (1.0 + limits.half_rate_rows / rows.max(1) as f64)
}

/// The budget left for tiles once the backend's reserve is taken (an unset budget is the
/// CPU's default, [`FusedOptions::budget`]).
pub fn tile_budget(opts: &FusedOptions, limits: &PlanLimits) -> Result<usize> {
    opts.budget()
        .checked_sub(limits.reserve_bytes)
        .ok_or_else(|| Error::InvalidArgument {
            arg: "budget_mib",
            reason: format!(
                "{} is below {}",
                budget_text(opts.budget()),
                limits.reserve_name
            ),
        })
}

/// A budget in an error: every front end (the configs, Python) passes it as `budget_mib`.
fn budget_text(bytes: usize) -> String {
    format!("{} MiB ({bytes} bytes)", bytes as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CPU-like backend (its blocks priced in [`plan`]).
    fn limits(half_rate_rows: f64) -> PlanLimits {
        PlanLimits {
            reserve_bytes: 0,
            reserve_name: "no reserve".into(),
            vocab_tile: 2048,
            max_block_rows: 512,
            min_single_pass_rows: 32,
            half_rate_rows,
            has_compact: true,
            extra_name: "",
        }
    }

    fn plan(n: usize, v: usize, mode: Mode, mib: f64, half_rate_rows: f64) -> Plan {
        let opts = FusedOptions::from_mib(mode, mib, 1.0);
        // 4 bytes per logit, compact rows at 2 bytes per entry and an f32 tile.
        let bytes = |rows: usize, block: Block| match block {
            Block::Tile => rows * 2048 * 4,
            Block::Whole => rows * v * 4,
            Block::Compact => rows * (v * 2 + 2048 * 4),
        };
        plan_blocks(n, v, &limits(half_rate_rows), bytes, &opts, true).unwrap()
    }

    /// An unset budget (the default options) plans as 160 MiB, today's CPU default.
    #[test]
    fn an_unset_budget_is_the_cpus_160_mib() {
        let unset = FusedOptions::default();
        assert_eq!(unset.budget_bytes, None);
        assert_eq!(unset.budget(), 160 << 20);
        let given = FusedOptions::from_mib(Mode::Auto, 160.0, 1.0);
        assert_eq!(given.budget_bytes, Some(160 << 20));
        assert_eq!(unset.or_budget(1 << 30).budget_bytes, Some(1 << 30));
        assert_eq!(given.or_budget(1 << 30).budget_bytes, Some(160 << 20));
        let v = 151_936;
        let bytes = |rows: usize, _: Block| rows * v * 4;
        let a = plan_blocks(2048, v, &limits(96.0), bytes, &unset, true).unwrap();
        let b = plan_blocks(2048, v, &limits(96.0), bytes, &given, true).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn auto_takes_compact_only_where_the_model_says_it_is_faster() {
        let v = 151_936;
        // 160 MiB: ~275 f32 rows, ~545 compact rows (capped at 512).
        let auto = plan(2048, v, Mode::Auto, 160.0, 96.0);
        assert!(auto.single_pass && auto.compact && auto.block_rows == 512);
        let f32_only = plan(2048, v, Mode::AutoF32, 160.0, 96.0);
        assert!(f32_only.single_pass && !f32_only.compact);
        assert!(f32_only.block_rows > 200 && f32_only.block_rows < 300);
        // Few rows: an f32 block holds them all, as compact would; f32 is kept.
        let few = plan(64, v, Mode::Auto, 160.0, 96.0);
        assert!(few.single_pass && !few.compact && few.block_rows == 64);
        // Without a rate model auto never takes compact; asked for, it is taken.
        assert!(!plan(2048, v, Mode::Auto, 160.0, 0.0).compact);
        assert!(plan(2048, v, Mode::Compact, 160.0, 0.0).compact);
        // A budget too small for a useful compact block: two-pass.
        let tight = plan(2048, v, Mode::Auto, 16.0, 96.0);
        assert!(!tight.single_pass && !tight.compact);
    }
}
