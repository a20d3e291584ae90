//! Top-p alone through pass A's histogram (`super::histogram`) against the f64
//! reference: one collecting pass on flat rows (any temperature, ragged tiles, masked
//! rows, ties split by index), none on peaked rows, and the fallbacks: a cut bin of more
//! than `COLLECT_MAX` keys, a cut in the underflow, a max beyond the exact grid.

use super::tests::{Rng, check_live, filters, run_support};
use crate::fused::key::{order_key, rel_mass, scaled};

/// `n` rows of `v` standard normal logits times `scale`.
fn normal_rows((n, v): (usize, usize), scale: f64, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..n * v).map(|_| (rng.normal() * scale) as f32).collect()
}

/// Checks top-p alone on every row of `z` against the reference; the extra passes.
fn top_p_alone(case: &str, z: &[f32], (n, v): (usize, usize), temperature: f64, p: f64) -> usize {
    let live = vec![true; n];
    let f = filters(None, Some(p), None);
    check_live(case, z.to_vec(), (n, v, &live), temperature, f, 1e-9)
}

#[test]
fn flat_rows_take_one_collecting_pass_at_any_temperature() {
    // V = 20011 is no multiple of the tiles (333 entries).
    let (n, v) = (4, 20_011);
    let z = normal_rows((n, v), 1.0, 11);
    for temperature in [1.0, 0.7, 1.6] {
        for p in [0.3, 0.5, 0.9, 0.99] {
            let case = format!("flat T={temperature} top_p={p}");
            assert_eq!(top_p_alone(&case, &z, (n, v), temperature, p), 1, "{case}");
        }
    }
}

#[test]
fn masked_rows_and_shifted_rows_take_one_pass() {
    let (n, v) = (6, 7001);
    let mut z = normal_rows((n, v), 2.0, 12);
    // Row 1 far below zero, row 4 far above (inside the exact grid, |s| < 2^17).
    z[v..2 * v].iter_mut().for_each(|x| *x -= 100_000.0);
    z[4 * v..5 * v].iter_mut().for_each(|x| *x += 90_000.0);
    let live = [true, true, false, true, true, false];
    let f = filters(None, Some(0.8), None);
    let extra = check_live("masked", z, (n, v, &live), 1.0, f, 1e-9);
    assert_eq!(extra, 1);
}

#[test]
fn peaked_rows_decide_from_the_buffer() {
    let (n, v) = (3, 20_000);
    let mut z = normal_rows((n, v), 1.0, 13);
    for i in 0..n {
        z[i * v + 997 * i] = 25.0;
    }
    assert_eq!(top_p_alone("peaked", &z, (n, v), 1.0, 0.9), 0);
    // One flat row among peaked ones: one pass for it, the others untouched.
    z[2 * v + 1994] = 0.0;
    assert_eq!(top_p_alone("peaked and flat", &z, (n, v), 1.0, 0.9), 1);
}

#[test]
fn ties_split_by_index_in_one_pass() {
    // Values in {0, 0.25, 0.5, 0.75}: thousands of ties in each of four bins.
    let (n, v) = (3, 12_007);
    let z: Vec<f32> = (0..n * v)
        .map(|x| ((x * 7 + x / v) % 4) as f32 / 4.0)
        .collect();
    for p in [0.3, 0.5, 0.9] {
        assert_eq!(top_p_alone(&format!("ties {p}"), &z, (n, v), 1.0, p), 1);
    }
}

#[test]
fn extreme_logits() {
    let (n, v) = (3, 9001);
    // Masking values far below every window: counted in the underflow, no mass.
    let mask = |mut z: Vec<f32>| {
        z.iter_mut().step_by(3).for_each(|x| *x = -1e30);
        z
    };
    let z = mask(normal_rows((n, v), 1.0, 14));
    assert_eq!(top_p_alone("masking values", &z, (n, v), 1.0, 0.7), 1);
    // A flat row beyond the exact grid (|s| ≥ 2^17) searches as before the histogram.
    let mut z = z;
    z[v..2 * v]
        .iter_mut()
        .for_each(|x| *x = 3e5 + x.max(-4.0) * 0.25);
    let extra = top_p_alone("off the grid", &z, (n, v), 1.0, 0.7);
    assert!(extra >= 2, "the row off the grid narrows: {extra}");
}

#[test]
fn an_overfull_cut_bin_is_narrowed() {
    // Logits of std 0.01: ~19000 keys a bin of 1/64, above COLLECT_MAX.
    let (n, v) = (2, 30_000);
    let z = normal_rows((n, v), 0.01, 15);
    let extra = top_p_alone("overfull", &z, (n, v), 1.0, 0.6);
    assert!((2..=3).contains(&extra), "{extra}");
}

/// The row sizes a top-p cut may have on `z` where the target is within `rel·M` of a
/// cumulative sum: `[lo, hi]`, from the sorted masses.
fn sizes_near_the_cut(z: &[f32], p: f64, rel: f64) -> (u64, u64) {
    let mut keys: Vec<u64> = (z.iter().enumerate())
        .map(|(j, &x)| order_key(scaled(x, 1.0), j))
        .collect();
    keys.sort_unstable_by(|a, b| b.cmp(a));
    let s_max = z.iter().copied().fold(f32::MIN, f32::max);
    let masses: Vec<f64> = (z.iter().copied().map(|x| rel_mass(x, s_max))).collect();
    let total: f64 = masses.iter().sum();
    let (target, tol) = (p * total, rel * total);
    let mut run = 0.0;
    let (mut lo, mut hi) = (u64::MAX, 0);
    for (k, &key) in keys.iter().enumerate() {
        let mass = masses[(key & 0xffff_ffff) as usize];
        // Size k + 1 is possible where the mass above stays below the target and the
        // mass through it reaches it, up to `tol`.
        if run < target + tol && run + mass >= target - tol {
            lo = lo.min(k as u64 + 1);
            hi = k as u64 + 1;
        }
        run += mass;
    }
    (lo, hi)
}

#[test]
fn a_cut_in_the_underflow_is_searched_below_the_window() {
    // One entry at 40 and the others near 6.5, below the window (32 units under the max's
    // bin); top-p keeps about half of their mass. Each holds ~3e-15 of the row's mass, so
    // the size is checked against the band of sizes within 1e-13 of the target.
    for (v, passes) in [(3001, 1..=1), (20_000, 2..=5)] {
        let mut z: Vec<f32> = (normal_rows((1, v), 0.3, 16).iter())
            .map(|&x| 6.5 + x.clamp(-1.2, 1.2))
            .collect();
        z[v / 2] = 40.0;
        let low: f64 = (z.iter().filter(|&&x| x < 40.0))
            .map(|&x| rel_mass(x, 40.0))
            .sum();
        let p = 1.0 - 0.5 * low / (1.0 + low);
        let live = [true];
        let f = filters(None, Some(p), None);
        let (got, extra, _) = run_support(z.clone(), (1, v, &live), 1.0, f);
        assert!(passes.contains(&extra), "V={v}: {extra} passes");
        let (lo, hi) = sizes_near_the_cut(&z, p, 1e-13);
        assert!(
            lo > v as u64 / 10 && hi < v as u64 * 9 / 10,
            "V={v}: [{lo}, {hi}]"
        );
        let size = got[0].size;
        assert!(
            lo <= size && size <= hi,
            "V={v}: size {size} outside [{lo}, {hi}]"
        );
        assert!((got[0].lse - 40.0).abs() < 1e-5);
    }
}
