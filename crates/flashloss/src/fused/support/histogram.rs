//! Pass A's histogram of a top-p row (`super`, top-p alone on one head): per row,
//! while its vocabulary sweep is in flight, the count and mass of its scaled logits `s`
//! in bins of an absolute grid, bin `b = ⌊64·s⌋` holding `s ∈ [b/64, (b+1)/64)`, over a
//! window of [`WINDOW`] bins ending at the bin of the running max (32 units of `s`
//! below it). Entries below the window, and the bins that fall out of it when the max
//! moves, are tallied in an underflow.
//!
//! A bin's mass is `Σ exp(s - b/64)` in f64: `d = s - b/64 ∈ [0, 1/64)` is exact and
//! `exp(d)` a degree-7 series (truncation `< d⁸/8! < 1e-19`, below f64 rounding), so a bin
//! is never rescaled when the max moves; the underflow's mass is relative to
//! `exp(bottom/64)` and rescaled when the window slides (as online softmax rescales).
//! The grid is exact in f32 while `|s_max| < 2^17` (`64·s` and every boundary `b/64` of
//! the window are exact); a row whose max leaves that range drops its histogram.
//!
//! Once the row's whole vocabulary is seen, the histogram is reduced to a [`BinCut`]:
//! with the masses relative to `exp(s_max)` and `M` their sum, the highest bin `c` at
//! which the descending cumulative mass reaches `top_p·M`. Its entries are the keys in
//! `[lo, hi)` with `lo` the smallest key of value `c/64` and `hi` that of `(c+1)/64`,
//! and the tally of the keys `≥ hi` is known: the state of a [`Search`] that one
//! collecting pass finishes (or, where the bin holds more than `COLLECT_MAX` keys or the
//! cut lies in the underflow, the histogram narrowing of the extra passes). Memory:
//! `12·WINDOW` bytes (24 KiB) per row in flight, 64 bytes per row after; binning costs
//! per entry a floor, a compare and the series (~12 flops).

use super::search::{Goal, Search, Tally};
use crate::fused::key::{scaled, value_floor};
use multiversion::multiversion;

/// Bins of a row's window.
pub(crate) const WINDOW: usize = 2048;
/// Bins per unit of the scaled logit, and a bin's width.
const PER_UNIT: f32 = 64.0;
const INV_UNIT: f64 = 1.0 / 64.0;
/// Bound on `|s_max|` under which every bin boundary of the window is exact in f32.
const EXACT_MAX: f32 = 131_072.0;

/// Where `64·s` is clamped: far below every window (whose bins are `> -2^24`).
const FAR_BELOW: f32 = -1_073_741_824.0;

/// The bin of scaled logit `s`, `⌊64·s⌋` (`64·s` is exact; the floor of its truncation
/// toward zero, as vector code does it), exact for `|s| < 2^17`; entries of
/// `64·s < -2^30` (`-inf` too) all get bin `-2^30`.
#[inline(always)]
fn bin_of(s: f32) -> i32 {
    let t = (s * PER_UNIT).max(FAR_BELOW);
    let b = t as i32;
    b - i32::from((b as f32) > t)
}

/// Entries binned at a time.
const CHUNK: usize = 64;

/// The bins of a chunk of logits `z` (before `1/T`) and their masses relative to their
/// bin's bottom, `exp(s - b/64)` (meaningless below every window); vectorized, and the
/// same bits on every target (no contraction, exact conversions).
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
fn bin_chunk(z: &[f32], inv_temp: f32, bins: &mut [i32; CHUNK], exps: &mut [f64; CHUNK]) {
    for ((&x, b), e) in z.iter().zip(bins.iter_mut()).zip(exps.iter_mut()) {
        let s = scaled(x, inv_temp);
        *b = bin_of(s);
        *e = exp_small(s as f64 - f64::from(*b) * INV_UNIT);
    }
}

/// The smallest key of bin `b`: every entry of bin `≥ b` has a key `≥` it.
fn bin_floor(b: i64) -> u64 {
    value_floor(b as f32 / PER_UNIT)
}

/// `exp(d)` for `d ∈ [0, 1/64)`: the Taylor series to degree 7, exact to f64 rounding.
#[inline(always)]
fn exp_small(d: f64) -> f64 {
    const C: [f64; 8] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
    ];
    C.iter().rev().fold(0.0, |acc, &c| acc * d + c)
}

/// `exp((b - base)/64)` in f64.
fn bin_scale(b: i64, base: i64) -> f64 {
    ((b - base) as f64 * INV_UNIT).exp()
}

/// One row's histogram while its sweep is in flight.
#[derive(Debug, Clone)]
pub(crate) struct RowHistogram {
    /// The window's lowest bin (the running max's bin `- WINDOW + 1`); `None` before
    /// the first finite entry.
    base: Option<i64>,
    /// The running max of the scaled logits.
    s_max: f32,
    /// Per bin of the window: entries, and `Σ exp(s - b/64)`.
    counts: Vec<u32>,
    sums: Vec<f64>,
    /// Entries below the window, their mass relative to `exp(base/64)`.
    under: Tally,
    /// Entries seen.
    seen: usize,
    /// Whether the grid is exact for the row (`|s_max| < 2^17`).
    exact: bool,
}

impl Default for RowHistogram {
    fn default() -> Self {
        RowHistogram {
            base: None,
            s_max: f32::NEG_INFINITY,
            counts: vec![0; WINDOW],
            sums: vec![0.0; WINDOW],
            under: Tally::default(),
            seen: 0,
            exact: true,
        }
    }
}

impl RowHistogram {
    /// Adds one tile of the row's logits `z` (before `1/T`).
    pub(crate) fn push_tile(&mut self, z: &[f32], inv_temp: f32) {
        self.seen += z.len();
        if !self.exact {
            return;
        }
        let tile_max = z
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| m.max(scaled(x, inv_temp)));
        if tile_max > self.s_max {
            if tile_max.abs() >= EXACT_MAX {
                *self = RowHistogram {
                    counts: Vec::new(),
                    sums: Vec::new(),
                    exact: false,
                    seen: self.seen,
                    ..RowHistogram::default()
                };
                return;
            }
            self.raise(tile_max);
        }
        let Some(base) = self.base else {
            // Every entry so far is -inf: no mass.
            self.under.count += z.len() as u64;
            return;
        };
        let bottom = base as f64 * INV_UNIT;
        let (mut bins, mut exps) = ([0; CHUNK], [0.0; CHUNK]);
        for chunk in z.chunks(CHUNK) {
            bin_chunk(chunk, inv_temp, &mut bins, &mut exps);
            for ((&x, &b), &e) in chunk.iter().zip(&bins).zip(&exps) {
                match usize::try_from(i64::from(b) - base) {
                    Ok(i) if i < WINDOW => {
                        self.counts[i] += 1;
                        self.sums[i] += e;
                    }
                    _ => {
                        self.under.count += 1;
                        self.under.mass += (scaled(x, inv_temp) as f64 - bottom).exp();
                    }
                }
            }
        }
    }

    /// The running max rises to `s_max` (finite, `|s_max| < 2^17`): the window slides up,
    /// its lowest bins folding into the underflow.
    fn raise(&mut self, s_max: f32) {
        let new_base = i64::from(bin_of(s_max)) - (WINDOW as i64 - 1);
        self.s_max = s_max;
        let Some(old) = self.base.replace(new_base) else {
            return;
        };
        let shift = (new_base - old) as usize;
        if shift == 0 {
            return;
        }
        self.under.mass *= bin_scale(old, new_base);
        for i in 0..shift.min(WINDOW) {
            if self.counts[i] > 0 {
                self.under.count += u64::from(self.counts[i]);
                self.under.mass += self.sums[i] * bin_scale(old + i as i64, new_base);
            }
        }
        if shift < WINDOW {
            self.counts.copy_within(shift.., 0);
            self.sums.copy_within(shift.., 0);
        }
        let fresh = WINDOW - shift.min(WINDOW);
        self.counts[fresh..].fill(0);
        self.sums[fresh..].fill(0.0);
    }

    /// After the row's whole vocabulary: the bin holding top-p's cut, or `None` where the
    /// grid is not exact for the row or no entry is finite.
    pub(crate) fn reduce(&self, top_p: f64) -> Option<BinCut> {
        let base = self.base.filter(|_| self.exact)?;
        let s_max = self.s_max;
        // Bin `b`'s mass relative to `exp(s_max)`.
        let rel = |b: i64| (b as f64 * INV_UNIT - s_max as f64).exp();
        let mass = |i: usize| self.sums[i] * rel(base + i as i64);
        let under = Tally {
            count: self.under.count,
            mass: self.under.mass * rel(base),
        };
        let total = (0..WINDOW).map(mass).sum::<f64>() + under.mass;
        let target = top_p * total;
        let mut above = Tally::default();
        for i in (0..WINDOW).rev().filter(|&i| self.counts[i] > 0) {
            let bin = Tally {
                count: u64::from(self.counts[i]),
                mass: mass(i),
            };
            if above.mass + bin.mass >= target {
                let b = base + i as i64;
                return Some(BinCut {
                    s_max,
                    total,
                    range: (bin_floor(b), bin_floor(b + 1)),
                    above,
                    inside: bin.count,
                });
            }
            above.count += bin.count;
            above.mass += bin.mass;
        }
        Some(BinCut {
            s_max,
            total,
            range: (0, bin_floor(base)),
            above,
            inside: under.count,
        })
    }
}

/// A row's histogram reduced after its sweep: the key range `[lo, hi)` that holds the
/// cut of top-p over the whole row (`inside` keys), the tally of the keys `≥ hi`, and the
/// row's mass `total`, all relative to `exp(s_max)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct BinCut {
    pub(crate) s_max: f32,
    pub(crate) total: f64,
    range: (u64, u64),
    above: Tally,
    inside: u64,
}

impl BinCut {
    /// The search that finds the cut: its range's keys collected by one pass where they
    /// are few enough, else narrowed.
    pub(crate) fn search(&self, top_p: f64) -> Search {
        let goal = Goal::Mass {
            top_p,
            target: Some(top_p * self.total),
        };
        Search::new(goal, self.range, self.above, self.s_max).knowing_count(self.inside)
    }
}

/// A row's pass-A histogram: not started, in flight, reduced, or (on a vocabulary
/// shard) its message to the other shards.
#[derive(Debug, Clone, Default)]
pub(crate) enum HistogramRow {
    #[default]
    Waiting,
    Open(Box<RowHistogram>),
    Closed(Option<BinCut>),
    Sent(Vec<f64>),
}

impl HistogramRow {
    /// Adds one tile `z` of a row of `vocab` entries; after its last entry the row is
    /// reduced for `top_p`, or where `top_p` is `None` (a shard's) turned into its
    /// message, and its bins freed.
    pub(crate) fn push_tile(
        &mut self,
        z: &[f32],
        inv_temp: f32,
        (vocab, top_p): (usize, Option<f64>),
    ) {
        if matches!(self, HistogramRow::Waiting) {
            *self = HistogramRow::Open(Box::default());
        }
        let HistogramRow::Open(h) = self else { return };
        h.push_tile(z, inv_temp);
        if h.seen >= vocab {
            *self = match top_p {
                Some(top_p) => HistogramRow::Closed(h.reduce(top_p)),
                None => HistogramRow::Sent(h.message()),
            };
        }
    }

    /// The reduced histogram, where the row's sweep finished with an exact grid.
    pub(crate) fn cut(&self) -> Option<BinCut> {
        match self {
            HistogramRow::Closed(cut) => *cut,
            _ => None,
        }
    }

    /// A shard's message: its histogram's (none seen: an empty one's).
    pub(crate) fn take_message(&mut self) -> Vec<f64> {
        match std::mem::take(self) {
            HistogramRow::Sent(m) => m,
            HistogramRow::Waiting => RowHistogram::default().message(),
            _ => vec![INEXACT, 0.0],
        }
    }
}

/// A message's first value: the histogram's state.
const INEXACT: f64 = 0.0;
const NO_FINITE: f64 = 1.0;
const BINNED: f64 = 2.0;

impl RowHistogram {
    /// The histogram as f64 values (exact: counts, bins and `|s|` below 2^53):
    /// `[INEXACT, count]`, `[NO_FINITE, count]`, or `[BINNED, s_max, base, under count,
    /// under mass, first, k]` then the counts and masses of the `k` bins from `first`
    /// (the lowest non-empty) up.
    fn message(&self) -> Vec<f64> {
        let count = self.under.count as f64;
        let Some(base) = self.base.filter(|_| self.exact) else {
            let state = if self.exact { NO_FINITE } else { INEXACT };
            return vec![state, count + self.counts.iter().sum::<u32>() as f64];
        };
        let first = self.counts.iter().position(|&c| c > 0).unwrap_or(WINDOW);
        let mut out = vec![
            BINNED,
            self.s_max as f64,
            base as f64,
            count,
            self.under.mass,
            first as f64,
            (WINDOW - first) as f64,
        ];
        out.extend(self.counts[first..].iter().map(|&c| c as f64));
        out.extend(&self.sums[first..]);
        out
    }

    /// The histogram a message at `values[*at..]` holds (`at` moves past it), or `None`
    /// where it is malformed.
    pub(crate) fn read(values: &[f64], at: &mut usize) -> Option<RowHistogram> {
        let mut take = |n: usize| {
            let part = values.get(*at..*at + n)?;
            *at += n;
            Some(part)
        };
        let head = take(2)?;
        let mut h = RowHistogram::default();
        h.under.count = head[1] as u64;
        if head[0] != BINNED {
            h.exact = head[0] == NO_FINITE;
            return Some(h);
        }
        let rest = take(5)?;
        let (first, k) = (rest[3] as usize, rest[4] as usize);
        if first + k != WINDOW {
            return None;
        }
        let (counts, sums) = take(2 * k)?.split_at(k);
        h.s_max = head[1] as f32;
        h.base = Some(rest[0] as i64);
        h.under = Tally {
            count: rest[1] as u64,
            mass: rest[2],
        };
        for (i, (&c, &m)) in counts.iter().zip(sums).enumerate() {
            h.counts[first + i] = c as u32;
            h.sums[first + i] = m;
        }
        Some(h)
    }

    /// Adds `other` (the same row's histogram on another vocabulary shard): the window
    /// slides to the larger max, and `other`'s bins add to the same bins (an absolute
    /// grid) or, below the window, to the underflow.
    pub(crate) fn merge(&mut self, other: &RowHistogram) {
        if !(self.exact && other.exact) {
            self.exact = false;
            return;
        }
        self.under.count += other.under.count;
        let Some(other_base) = other.base else {
            return;
        };
        if other.s_max > self.s_max {
            self.raise(other.s_max);
        }
        let base = self.base.unwrap_or(other_base);
        self.under.mass += other.under.mass * bin_scale(other_base, base);
        for (i, (&c, &m)) in other.counts.iter().zip(&other.sums).enumerate() {
            let b = other_base + i as i64;
            match usize::try_from(b - base) {
                _ if c == 0 => {}
                Ok(at) if at < WINDOW => {
                    self.counts[at] += c;
                    self.sums[at] += m;
                }
                _ => {
                    self.under.count += u64::from(c);
                    self.under.mass += m * bin_scale(b, base);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::key::{key_value, order_key};

    #[test]
    fn the_series_is_exp_to_rounding() {
        for k in 0..=1000 {
            let d = k as f64 / 1000.0 / 64.0;
            let (got, want) = (exp_small(d), d.exp());
            assert!((got - want).abs() <= 2.0 * f64::EPSILON * want, "{d}");
        }
    }

    #[test]
    fn bins_are_key_ranges() {
        for s in [
            -3.0f32,
            -1.0 / 64.0,
            -1e-30,
            0.0,
            1e-30,
            0.015625,
            0.7,
            31.99,
        ] {
            let b = i64::from(bin_of(scaled(s, 1.0)));
            let key = order_key(scaled(s, 1.0), 12_345);
            assert!(bin_floor(b) <= key && key < bin_floor(b + 1), "{s}");
        }
    }

    /// Tiles of `tile` entries of `z` through a histogram, reduced for `top_p`.
    fn reduce(z: &[f32], tile: usize, inv_temp: f32, top_p: f64) -> Option<BinCut> {
        let mut row = HistogramRow::default();
        for chunk in z.chunks(tile) {
            row.push_tile(chunk, inv_temp, (z.len(), Some(top_p)));
        }
        row.cut()
    }

    /// The tally of `z`'s keys in `[lo, hi)` and of those `≥ hi`, by sorting.
    fn tallies(z: &[f32], inv_temp: f32, (lo, hi): (u64, u64)) -> (Tally, Tally) {
        let keys: Vec<u64> = (z.iter().enumerate())
            .map(|(j, &x)| order_key(scaled(x, inv_temp), j))
            .collect();
        let s_max = keys.iter().map(|&k| key_value(k)).fold(f32::MIN, f32::max);
        let of = |keep: &dyn Fn(u64) -> bool| {
            let kept: Vec<u64> = keys.iter().copied().filter(|&k| keep(k)).collect();
            Tally::of(&kept, s_max)
        };
        (of(&|k| lo <= k && k < hi), of(&|k| k >= hi))
    }

    #[test]
    fn the_cut_bin_holds_the_cut_as_sorting_finds_it() {
        // A rising max (the window slides), values far below it and temperature 0.7.
        let v = 40_000;
        let z: Vec<f32> = (0..v)
            .map(|j| match j % 5 {
                0 => (j as f32 / v as f32) * 30.0,
                1 => -60.0 + (j % 97) as f32 / 7.0,
                _ => ((j * 7919) % 1013) as f32 / 101.0,
            })
            .collect();
        for top_p in [1e-9, 0.3, 0.9, 0.999_999] {
            let cut = reduce(&z, 333, 1.0 / 0.7, top_p).unwrap();
            let inv_temp = 1.0 / 0.7f32;
            let (inside, above) = tallies(&z, inv_temp, cut.range);
            assert_eq!(inside.count, cut.inside, "top_p {top_p}");
            assert_eq!(above.count, cut.above.count, "top_p {top_p}");
            assert!((above.mass - cut.above.mass).abs() <= 1e-12 * cut.total);
            let (all, _) = tallies(&z, inv_temp, (0, u64::MAX));
            assert!((all.mass - cut.total).abs() <= 1e-12 * all.mass);
            // The cut: the keys above the bin fall short of the target, with it they reach.
            let target = top_p * cut.total;
            assert!(above.mass < target && above.mass + inside.mass >= target);
            let s_max = z.iter().copied().fold(f32::MIN, f32::max) * inv_temp;
            assert_eq!(cut.s_max, s_max);
        }
    }

    #[test]
    fn shards_merge_to_the_whole_rows_histogram() {
        // Three shards: one with the max, one 20 below it (its window shifts into the
        // merged one), one 50 below (folded into the underflow), one of -inf only.
        let v = 9000;
        let z: Vec<f32> = (0..v)
            .map(|j| match j / 3000 {
                0 => ((j * 7919) % 1013) as f32 / 101.0,
                1 => -20.0 + ((j * 13) % 997) as f32 / 97.0,
                _ => -50.0 + (j % 89) as f32 / 8.0,
            })
            .collect();
        let parts = [
            &z[..3000],
            &z[3000..6000],
            &z[6000..],
            &[f32::NEG_INFINITY; 5],
        ];
        for top_p in [0.2, 0.9, 1.0 - 1e-12] {
            let mut merged = RowHistogram::default();
            for part in parts.iter().rev() {
                let mut row = HistogramRow::default();
                for chunk in part.chunks(700) {
                    row.push_tile(chunk, 0.9, (part.len(), None));
                }
                let message = row.take_message();
                let mut at = 0;
                let read = RowHistogram::read(&message, &mut at).unwrap();
                assert_eq!(at, message.len());
                merged.merge(&read);
            }
            let mut whole = z.clone();
            whole.extend([f32::NEG_INFINITY; 5]);
            let want = reduce(&whole, 1000, 0.9, top_p).unwrap();
            let got = merged.reduce(top_p).unwrap();
            assert_eq!((got.s_max, got.range), (want.s_max, want.range), "{top_p}");
            assert_eq!(
                (got.inside, got.above.count),
                (want.inside, want.above.count)
            );
            assert!((got.total - want.total).abs() <= 1e-13 * want.total);
            assert!((got.above.mass - want.above.mass).abs() <= 1e-13 * want.total);
        }
        // A shard off the exact grid makes the merged row's histogram none.
        let mut off = HistogramRow::default();
        off.push_tile(&[3e5], 1.0, (1, None));
        let mut merged = RowHistogram::default();
        merged.merge(&RowHistogram::read(&off.take_message(), &mut 0).unwrap());
        assert_eq!(merged.reduce(0.5), None);
    }

    #[test]
    fn the_cut_may_lie_in_the_underflow() {
        // One entry 40 above thousands of others: they lie below the window.
        let mut z = vec![0.0f32; 9000];
        z[4321] = 40.0;
        let cut = reduce(&z, 1000, 1.0, 1.0 - 1e-15).unwrap();
        assert_eq!(cut.inside, 8999);
        assert_eq!(cut.range.0, 0);
        assert_eq!(cut.above.count, 1);
        let cut = reduce(&z, 1000, 1.0, 0.5).unwrap();
        assert_eq!((cut.inside, cut.above.count), (1, 0));
    }

    #[test]
    fn rows_beyond_the_exact_grid_or_without_finite_entries_have_none() {
        assert_eq!(reduce(&[1.0, 2e5, 3.0], 2, 1.0, 0.5), None);
        assert_eq!(reduce(&[-2e5, -2e5], 1, 1.0, 0.5), None);
        assert_eq!(reduce(&[f32::NEG_INFINITY; 4], 3, 1.0, 0.5), None);
        // -inf entries before the first finite one count, without mass.
        let cut = reduce(&[f32::NEG_INFINITY, f32::NEG_INFINITY, 1.0], 1, 1.0, 0.5).unwrap();
        assert_eq!((cut.inside, cut.above.count, cut.total), (1, 0, 1.0));
    }
}
