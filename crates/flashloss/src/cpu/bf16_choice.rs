//! Which products a bf16 head runs on this CPU ([`Bf16Products`]): `widened` (operands
//! widened to f32, `gemm`) or `avx512bf16` (`vdpbf16ps`), and why.
//!
//! An explicit `widened` or `avx512bf16` is kept (the latter an error on a CPU without
//! AVX512-BF16). `auto` takes [`BF16_PRODUCTS_ENV`] where it is set; otherwise, on a CPU
//! without AVX512-BF16, `widened`; on one with it, the faster of the two on this CPU,
//! measured once per process ([`measured_rates`], ~10 ms at the first bf16 plan):
//!
//! `avx512bf16` iff `rate(avx512bf16) ≥ AVX512BF16_MARGIN · rate(widened)`
//!
//! ([`choose`]). A tie goes to `widened`, whose gradients keep `dZ` in f32
//! (docs/spec/losses.md, flashloss addition 4); on a CPU where the two rates lie within
//! the margin of each other the choice may differ from process to process, and costs
//! little either way. Measured: AMD's Zen 4 (issue 24) ran `vdpbf16ps` at about twice
//! the f32 GEMM's rate, an Intel Xeon with AVX512-BF16 and AVX512-FP16 at 0.6x
//! (docs/results/cpu_bench.md).
//!
//! What is measured: a lane's logits product of the fused step, `Z = H·Wᵀ` for a block
//! of [`ROWS`] rows, `H` = [`K`] and [`COLS`] vocabulary entries, on bf16 operands: the
//! weight tile's conversion (widened to f32, or packed in pairs) and the product, with
//! the hidden block prepared beforehand (a step prepares it once per block for every
//! tile). It runs on one thread, the caller's (a lane of the single-pass block runs its
//! products on `1/LANES` of the pool's threads: on two cores, one thread each), timed by the
//! thread's CPU clock on Linux (time the thread was descheduled by other processes does
//! not count; elsewhere the wall clock). Each path runs once to warm up, then [`REPEATS`]
//! times, the two alternating; a rate is the FLOPs over the best time: about 10 ms in
//! all at this Xeon's single-core rates.

use super::bf16_gemm::{Avx512Bf16, PackedA, PackedB};
use super::matmul::{MatRef, matmul_on};
use super::simd;
use crate::error::{Error, Result};
use crate::fused::Bf16Products;
use half::bf16;
use serde::Serialize;
use std::sync::OnceLock;
use std::time::Instant;

/// The environment variable that chooses for [`Bf16Products::Auto`] in every binding
/// (`auto`, `widened`, `avx512bf16`; `auto` measures), as `ONEDNN_MAX_CPU_ISA` does for
/// oneDNN; an option other than `auto` wins over it.
pub const BF16_PRODUCTS_ENV: &str = "FLASHLOSS_BF16_PRODUCTS";

/// The factor by which `avx512bf16` must beat `widened` for `auto` to pick it.
pub const AVX512BF16_MARGIN: f64 = 1.1;
/// Rows of the measured block.
pub const ROWS: usize = 448;
/// Hidden size of the measured product.
pub const K: usize = 1024;
/// Vocabulary entries of the measured tile.
pub const COLS: usize = 128;
/// Timed runs of each path (after one warm-up run each).
pub const REPEATS: usize = 5;

/// The rates of the measured product on this CPU, GFLOP/s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Bf16Rates {
    /// Widened to f32, `gemm`.
    pub widened_gflops: f64,
    /// Packed bf16 pairs, `vdpbf16ps`.
    pub avx512bf16_gflops: f64,
}

/// What decided a bf16 head's products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bf16Reason {
    /// The option named them (`widened` or `avx512bf16`).
    Option,
    /// `auto`, and [`BF16_PRODUCTS_ENV`] named them.
    Environment,
    /// `auto` on a CPU without AVX512-BF16: `widened`.
    NoAvx512Bf16,
    /// `auto`: the faster of the two as measured ([`choose`] of the rates).
    Measured,
}

/// The products a bf16 head runs for an option on this CPU, and why.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Bf16Choice {
    /// What runs (never `Auto`).
    pub runs: Bf16Products,
    /// What decided.
    pub by: Bf16Reason,
    /// This process's measurement, where it decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rates: Option<Bf16Rates>,
}

/// `auto`'s choice given measured rates: `avx512bf16` iff it is at least
/// [`AVX512BF16_MARGIN`] times as fast as `widened` (a NaN rate: `widened`).
pub fn choose(rates: Bf16Rates) -> Bf16Products {
    match rates.avx512bf16_gflops >= AVX512BF16_MARGIN * rates.widened_gflops {
        true => Bf16Products::Avx512Bf16,
        false => Bf16Products::Widened,
    }
}

/// What a bf16 head runs for `asked` on this CPU ([`BF16_PRODUCTS_ENV`] read at every
/// call; the measurement once per process): an error where `avx512bf16` is asked for on
/// a CPU without AVX512-BF16, or the variable holds another value than a choice's name.
pub fn bf16_products_choice(asked: Bf16Products) -> Result<Bf16Choice> {
    let (asked, by) = match (asked, std::env::var(BF16_PRODUCTS_ENV)) {
        (Bf16Products::Auto, Ok(name)) => {
            let named = Bf16Products::from_name(&name).ok_or_else(|| Error::InvalidArgument {
                arg: BF16_PRODUCTS_ENV,
                reason: format!("{name:?} is not one of auto, widened, avx512bf16"),
            })?;
            (named, Bf16Reason::Environment)
        }
        _ => (asked, Bf16Reason::Option),
    };
    let choice = |runs, by, rates| Ok(Bf16Choice { runs, by, rates });
    match (asked, Avx512Bf16::detect()) {
        (Bf16Products::Avx512Bf16, None) => Err(no_avx512bf16()),
        (Bf16Products::Auto, None) => choice(Bf16Products::Widened, Bf16Reason::NoAvx512Bf16, None),
        (Bf16Products::Auto, Some(cpu)) => {
            let rates = measured_rates(cpu);
            choice(choose(rates), Bf16Reason::Measured, Some(rates))
        }
        (runs, _) => choice(runs, by, None),
    }
}

/// The error of bf16 products asked for on a CPU without AVX512-BF16.
pub(crate) fn no_avx512bf16() -> Error {
    Error::InvalidArgument {
        arg: "bf16_products",
        reason: "avx512bf16 asked for, and this CPU has no AVX512-BF16 (vdpbf16ps)".into(),
    }
}

/// This process's rates (measured on the first call, [`measure`]).
pub fn measured_rates(cpu: Avx512Bf16) -> Bf16Rates {
    static RATES: OnceLock<Bf16Rates> = OnceLock::new();
    *RATES.get_or_init(|| measure(cpu))
}

/// Measures the two paths' rates now (see the module's doc; not cached).
pub fn measure(cpu: Avx512Bf16) -> Bf16Rates {
    // Values of a few binades, none denormal.
    let value =
        |i: usize, s: usize| bf16::from_f32(((i * 37 + s) % 101) as f32 / 50.0 - 1.0 + 1.0 / 128.0);
    let hidden: Vec<bf16> = (0..ROWS * K).map(|i| value(i, 3)).collect();
    let weight: Vec<bf16> = (0..COLS * K).map(|i| value(i, 11)).collect();
    let mut hidden_wide = vec![0.0; ROWS * K];
    simd::load(&hidden, &mut hidden_wide);
    let hid = MatRef::row_major(&hidden_wide[..], ROWS, K);
    let mut hidden_packed = PackedA::default();
    hidden_packed.pack_a(MatRef::row_major(&hidden[..], ROWS, K), 1);
    let w = MatRef::row_major(&weight[..], COLS, K);
    let (mut weight_wide, mut weight_packed) = (vec![0.0; COLS * K], PackedB::default());
    let (mut z, mut z_packed) = (vec![0.0; ROWS * COLS], vec![0.0; ROWS * COLS]);
    let mut widened = || {
        let start = ThreadClock::now();
        simd::load(&weight, &mut weight_wide);
        let wt = MatRef::row_major(&weight_wide[..], COLS, K).t();
        matmul_on(&mut z, COLS, hid, wt, false, 1);
        start.elapsed()
    };
    let mut packed = || {
        let start = ThreadClock::now();
        weight_packed.pack_b(w.t(), 1);
        cpu.gemm(
            &mut z_packed,
            COLS,
            &hidden_packed,
            &weight_packed,
            false,
            1,
        );
        start.elapsed()
    };
    let (mut best_widened, mut best_packed) = (f64::INFINITY, f64::INFINITY);
    for k in 0..=REPEATS {
        let (tw, tp) = (widened(), packed());
        if k > 0 {
            best_widened = best_widened.min(tw);
            best_packed = best_packed.min(tp);
        }
    }
    let flops = (2 * ROWS * K * COLS) as f64;
    let rate = |t: f64| flops / t.max(1e-9) / 1e9;
    Bf16Rates {
        widened_gflops: rate(best_widened),
        avx512bf16_gflops: rate(best_packed),
    }
}

/// The calling thread's CPU clock (Linux), else the wall clock.
struct ThreadClock(f64);

impl ThreadClock {
    fn now() -> Self {
        ThreadClock(Self::seconds())
    }

    fn elapsed(&self) -> f64 {
        Self::seconds() - self.0
    }

    #[cfg(target_os = "linux")]
    fn seconds() -> f64 {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec to write; the clock id is a constant.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        if rc != 0 {
            return wall_seconds();
        }
        t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
    }

    #[cfg(not(target_os = "linux"))]
    fn seconds() -> f64 {
        wall_seconds()
    }
}

/// Seconds since the first call (the wall clock).
fn wall_seconds() -> f64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates(widened_gflops: f64, avx512bf16_gflops: f64) -> Bf16Rates {
        Bf16Rates {
            widened_gflops,
            avx512bf16_gflops,
        }
    }

    /// `avx512bf16` only from the margin up; ties, losses and NaN go to `widened`.
    #[test]
    fn choose_takes_avx512bf16_only_beyond_the_margin() {
        assert_eq!(choose(rates(376.0, 219.0)), Bf16Products::Widened);
        assert_eq!(choose(rates(200.0, 420.0)), Bf16Products::Avx512Bf16);
        assert_eq!(choose(rates(300.0, 300.0)), Bf16Products::Widened);
        assert_eq!(choose(rates(300.0, 329.0)), Bf16Products::Widened);
        assert_eq!(choose(rates(300.0, 330.0)), Bf16Products::Avx512Bf16);
        assert_eq!(choose(rates(300.0, f64::NAN)), Bf16Products::Widened);
        assert_eq!(choose(rates(f64::NAN, 300.0)), Bf16Products::Widened);
    }

    /// Without the environment variable (the env-var cases are in
    /// `bf16_products_environment`, a process of their own): explicit options keep
    /// their meaning, `auto` runs an available path, and the measured choice is the
    /// same on every call (one measurement per process).
    #[test]
    fn options_override_and_auto_is_cached() {
        if std::env::var(BF16_PRODUCTS_ENV).is_ok() {
            return;
        }
        let widened = bf16_products_choice(Bf16Products::Widened).unwrap();
        assert_eq!(
            (widened.runs, widened.by),
            (Bf16Products::Widened, Bf16Reason::Option)
        );
        let auto = bf16_products_choice(Bf16Products::Auto).unwrap();
        assert_ne!(auto.runs, Bf16Products::Auto);
        match Avx512Bf16::detect() {
            Some(cpu) => {
                let bf = bf16_products_choice(Bf16Products::Avx512Bf16).unwrap();
                assert_eq!(
                    (bf.runs, bf.by),
                    (Bf16Products::Avx512Bf16, Bf16Reason::Option)
                );
                let r = auto.rates.expect("measured");
                assert_eq!(auto.by, Bf16Reason::Measured);
                assert!(r.widened_gflops > 0.0 && r.avx512bf16_gflops > 0.0, "{r:?}");
                assert!(r.widened_gflops.is_finite() && r.avx512bf16_gflops.is_finite());
                assert_eq!(auto.runs, choose(r));
                assert_eq!(measured_rates(cpu), r, "cached");
                assert_eq!(bf16_products_choice(Bf16Products::Auto).unwrap(), auto);
            }
            None => {
                assert_eq!(
                    (auto.runs, auto.by),
                    (Bf16Products::Widened, Bf16Reason::NoAvx512Bf16)
                );
                assert!(bf16_products_choice(Bf16Products::Avx512Bf16).is_err());
            }
        }
    }

    /// Both measured paths form the same logits (bf16 products are exact in f32; only
    /// the order of the sums differs), so the rates are of the same work.
    #[test]
    fn the_two_measured_paths_agree() {
        let Some(cpu) = Avx512Bf16::detect() else {
            return;
        };
        let (m, k, n) = (29, 67, 45);
        let a: Vec<bf16> = (0..m * k)
            .map(|i| bf16::from_f32((i % 13) as f32 / 7.0 - 0.9))
            .collect();
        let b: Vec<bf16> = (0..n * k)
            .map(|i| bf16::from_f32((i % 11) as f32 / 5.0 - 1.1))
            .collect();
        let (mut aw, mut bw) = (vec![0.0; m * k], vec![0.0; n * k]);
        simd::load(&a, &mut aw);
        simd::load(&b, &mut bw);
        let (mut z0, mut z1) = (vec![0.0; m * n], vec![0.0; m * n]);
        let bt = MatRef::row_major(&bw[..], n, k).t();
        matmul_on(&mut z0, n, MatRef::row_major(&aw[..], m, k), bt, false, 2);
        let (mut pa, mut pb) = (PackedA::default(), PackedB::default());
        pa.pack_a(MatRef::row_major(&a[..], m, k), 2);
        pb.pack_b(MatRef::row_major(&b[..], n, k).t(), 2);
        cpu.gemm(&mut z1, n, &pa, &pb, false, 2);
        for (x, y) in z0.iter().zip(&z1) {
            assert!((x - y).abs() <= 1e-4 * (1.0 + x.abs()), "{x} {y}");
        }
    }
}
