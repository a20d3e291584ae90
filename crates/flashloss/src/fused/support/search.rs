//! The streaming half of the truncated support ([`super`]): the histogram search of the
//! extra passes over the keys of [`super::key`] (pass A's visitor is `super::pass_a`).
//!
//! A [`Search`] finds, over the keys of one row in an open range `[lo, hi)` whose
//! entries above `hi` are tallied, either the tally of the range ([`Goal::Sum`]), the
//! k-th key from the top ([`Goal::Count`]), or the first key from the top at which the
//! cumulative mass `Σ exp(s - s_max)` reaches a target ([`Goal::Mass`], top-p). Each pass
//! either bins the range into [`BINS`] equal key ranges (count and f64 mass per bin) and
//! narrows it to the bin that holds the answer, or, once that bin holds at most
//! [`COLLECT_MAX`] entries, collects its keys and answers exactly. A search may start on
//! a range whose count is known (pass A's histogram of a top-p row,
//! `super::histogram`), and collect at once.

use crate::fused::key::{key_value, order_key, rel_mass, scaled};
use crate::fused::terms::TileVisitor;
use rayon::prelude::*;
use std::ops::Range;

/// Bins of a histogram pass.
pub(crate) const BINS: usize = 2048;
/// Largest range whose keys are collected instead of binned again.
pub(crate) const COLLECT_MAX: u64 = 4096;

/// Entries and their mass (relative to the row's largest).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Tally {
    pub(crate) count: u64,
    pub(crate) mass: f64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.count += other.count;
        self.mass += other.mass;
    }

    /// The tally of `keys` in a row of largest scaled logit `s_max`.
    pub(crate) fn of(keys: &[u64], s_max: f32) -> Tally {
        Tally {
            count: keys.len() as u64,
            mass: keys.iter().map(|&k| rel_mass(key_value(k), s_max)).sum(),
        }
    }
}

/// The entries of `all` at the ascending indices `ids`, in order.
pub(crate) fn pick<'a, T>(all: &'a mut [T], ids: &[usize]) -> Vec<&'a mut T> {
    let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
        return Vec::new();
    };
    let mut want = ids.iter().peekable();
    (all[first..=last].iter_mut().zip(first..))
        .filter_map(|(x, i)| want.next_if_eq(&&i).map(|_| x))
        .collect()
}

/// What a [`Search`] looks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Goal {
    /// The tally of the keys `≥ lo`.
    Sum,
    /// The k-th key from the top.
    Count(u64),
    /// The first key from the top whose cumulative mass (its own included) reaches
    /// `top_p·M`, `M` the mass of every key `≥ lo` (known, or summed by the first pass).
    Mass { top_p: f64, target: Option<f64> },
}

/// What a finished [`Search`] found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Found {
    /// [`Goal::Sum`]: the tally of the keys `≥ lo`.
    Sum(Tally),
    /// [`Goal::Count`]: the k-th key, or `None` where fewer than k keys are `≥ lo`.
    Kth(Option<u64>),
    /// [`Goal::Mass`]: the keys `≥ cut` are kept, with their tally.
    Cut { cut: u64, kept: Tally },
    /// [`Goal::Mass`] without a target: the keys `≥ hi` alone reach the `target` the
    /// first pass summed (the cut is among them, which the caller holds).
    Above { target: f64 },
}

/// One row's search over its keys in `[lo, hi)`, `above` the tally of its keys `≥ hi`.
#[derive(Debug, Clone)]
pub(crate) struct Search {
    lo: u64,
    hi: u64,
    above: Tally,
    goal: Goal,
    s_max: f32,
    /// The next pass collects the range's keys (else it bins them).
    collect: bool,
    /// The pass's tallies per bin (a histogram pass) or the range's keys (a collecting
    /// pass); vocabulary shards sum them (`super::shards`).
    pub(crate) bins: Vec<Tally>,
    pub(crate) keys: Vec<u64>,
}

impl Search {
    /// A search of `goal` over `[lo, hi)` with `above` the tally of the keys `≥ hi`, in a
    /// row of largest scaled logit `s_max`. A [`Goal::Sum`] takes one bin.
    pub(crate) fn new(goal: Goal, (lo, hi): (u64, u64), above: Tally, s_max: f32) -> Self {
        Search {
            lo,
            hi,
            above,
            goal,
            s_max,
            collect: false,
            bins: Vec::new(),
            keys: Vec::new(),
        }
    }

    /// The search with its range's `count` known: its first pass collects the range's
    /// keys where they are few enough.
    pub(crate) fn knowing_count(mut self, count: u64) -> Self {
        self.collect = count <= COLLECT_MAX;
        self
    }

    /// Whether the search is top-p's with a mass to sum first (its cut may lie above
    /// its range: [`Found::Above`]).
    pub(crate) fn sums_mass_first(&self) -> bool {
        matches!(self.goal, Goal::Mass { target: None, .. })
    }

    fn width(&self) -> u64 {
        let bins = if self.goal == Goal::Sum {
            1
        } else {
            BINS as u64
        };
        (self.hi - self.lo - 1) / bins + 1
    }

    /// Prepares the next pass's tallies.
    fn start_pass(&mut self) {
        self.keys.clear();
        self.bins.clear();
        if !self.collect && self.hi > self.lo {
            let n = (self.hi - self.lo).div_ceil(self.width()) as usize;
            self.bins.resize(n, Tally::default());
        }
    }

    /// Sees one tile of the row's logits `z` at vocabulary entries from `start`.
    fn see(&mut self, z: &[f32], start: usize, inv_temp: f32) {
        if self.hi <= self.lo {
            return;
        }
        let width = self.width();
        for (o, &x) in z.iter().enumerate() {
            let s = scaled(x, inv_temp);
            let key = order_key(s, start + o);
            if key < self.lo || key >= self.hi {
                continue;
            }
            if self.collect {
                self.keys.push(key);
            } else {
                let bin = &mut self.bins[((key - self.lo) / width) as usize];
                bin.count += 1;
                bin.mass += rel_mass(s, self.s_max);
            }
        }
    }

    /// After a pass: the answer, or `None` when another pass is needed.
    fn advance(&mut self) -> Option<Found> {
        if self.collect {
            return Some(self.answer_from_keys());
        }
        let total = self.bins.iter().fold(Tally::default(), |mut t, b| {
            t.add(*b);
            t
        });
        let mut run = self.above;
        let reached: Box<dyn Fn(Tally, Tally) -> bool> = match &mut self.goal {
            Goal::Sum => {
                run.add(total);
                return Some(Found::Sum(run));
            }
            Goal::Count(k) => {
                let k = *k;
                if run.count + total.count < k {
                    return Some(Found::Kth(None));
                }
                Box::new(move |run: Tally, bin: Tally| run.count + bin.count >= k)
            }
            Goal::Mass { top_p, target } => {
                let fresh = target.is_none();
                let t = *target.get_or_insert(*top_p * (run.mass + total.mass));
                if fresh && run.mass >= t {
                    return Some(Found::Above { target: t });
                }
                Box::new(move |run: Tally, bin: Tally| bin.count > 0 && run.mass + bin.mass >= t)
            }
        };
        let Some(mut chosen) = self.bins.iter().position(|b| b.count > 0) else {
            // An empty range: the answer lies above it.
            return Some(match self.goal {
                Goal::Count(_) | Goal::Sum => Found::Kth(None),
                Goal::Mass { .. } => Found::Cut {
                    cut: self.hi,
                    kept: self.above,
                },
            });
        };
        for (b, bin) in self.bins.iter().enumerate().rev() {
            if reached(run, *bin) {
                chosen = b;
                break;
            }
            run.add(*bin);
        }
        // The tally above the chosen bin.
        let mut above = self.above;
        self.bins[chosen + 1..].iter().for_each(|b| above.add(*b));
        let width = self.width();
        self.lo += chosen as u64 * width;
        self.hi = self.hi.min(self.lo + width);
        self.above = above;
        self.collect = self.bins[chosen].count <= COLLECT_MAX || width == 1;
        None
    }

    /// The answer from the range's collected keys.
    fn answer_from_keys(&mut self) -> Found {
        self.keys.sort_unstable_by(|a, b| b.cmp(a));
        let mut run = self.above;
        match self.goal {
            Goal::Sum => {
                run.add(Tally::of(&self.keys, self.s_max));
                Found::Sum(run)
            }
            Goal::Count(k) => Found::Kth(
                (k.checked_sub(run.count + 1)).and_then(|i| self.keys.get(i as usize).copied()),
            ),
            Goal::Mass { target, .. } => {
                let target = target.unwrap_or(0.0);
                for (i, &key) in self.keys.iter().enumerate() {
                    run.add(Tally {
                        count: 1,
                        mass: rel_mass(key_value(key), self.s_max),
                    });
                    if run.mass >= target || i + 1 == self.keys.len() {
                        return Found::Cut {
                            cut: key,
                            kept: run,
                        };
                    }
                }
                Found::Cut {
                    cut: self.hi,
                    kept: run,
                }
            }
        }
    }
}

/// The searches of one extra pass, one per row that has one (`None`: no search), as
/// a tile visitor: [`SearchPass::see`] sees every tile of the pass.
pub(crate) struct SearchPass {
    pub(crate) inv_temp: f32,
    /// The head's first id in the whole vocabulary (a vocabulary shard's offset).
    pub(crate) offset: usize,
    pub(crate) rows: Vec<Option<Search>>,
}

impl SearchPass {
    /// Starts a pass over `rows`' searches.
    pub(crate) fn new(inv_temp: f32, offset: usize, mut rows: Vec<Option<Search>>) -> Self {
        rows.iter_mut().flatten().for_each(Search::start_pass);
        SearchPass {
            inv_temp,
            offset,
            rows,
        }
    }

    /// After the pass: each row's answer where its search finished (the others stay
    /// for the next pass).
    pub(crate) fn finish(mut self) -> (Vec<Option<Found>>, Vec<Option<Search>>) {
        let found = self
            .rows
            .iter_mut()
            .map(|s| s.as_mut().and_then(Search::advance))
            .collect::<Vec<_>>();
        for (row, f) in self.rows.iter_mut().zip(&found) {
            if f.is_some() {
                *row = None;
            }
        }
        (found, self.rows)
    }
}

/// Each tile's rows go to their searches (in parallel over the rows).
impl TileVisitor for SearchPass {
    fn visit(&mut self, rows: &[usize], vocab: Range<usize>, z: &[f32], ld: usize) {
        let (inv_temp, start, cols) = (self.inv_temp, vocab.start + self.offset, vocab.len());
        (pick(&mut self.rows, rows).into_par_iter())
            .zip(z.par_chunks(ld))
            .for_each(|(search, row)| {
                if let Some(search) = search {
                    search.see(&row[..cols], start, inv_temp);
                }
            });
    }

    /// The rows still searching.
    fn rows_wanted(&self) -> Option<Vec<bool>> {
        Some(self.rows.iter().map(Option::is_some).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::key::value_floor;

    #[test]
    fn keys_order_values_then_ids() {
        let values = [f32::NEG_INFINITY, -3.5, -1e-30, 0.0, 1e-30, 2.0, f32::MAX];
        for w in values.windows(2) {
            assert!(order_key(w[0], 7) < order_key(w[1], 0), "{w:?}");
        }
        for &s in &values {
            assert!(order_key(s, 3) < order_key(s, 4));
            assert_eq!(key_value(order_key(s, 9)), s);
        }
        assert_eq!(order_key(scaled(-0.0, 1.0), 1), order_key(0.0, 1));
    }

    /// Runs `goal` over `z`'s keys `≥ lo`, tiles of 7 entries: what it found and after how
    /// many passes.
    fn run_search(z: &[f32], goal: Goal, lo: u64) -> (Found, usize) {
        let s_max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut rows = vec![Some(Search::new(
            goal,
            (lo, u64::MAX),
            Tally::default(),
            s_max,
        ))];
        for pass in 1.. {
            let mut p = SearchPass::new(1.0, 0, rows);
            for start in (0..z.len()).step_by(7) {
                let end = (start + 7).min(z.len());
                p.visit(&[0], start..end, &z[start..end], end - start);
            }
            let (found, next) = p.finish();
            if let Some(f) = found[0] {
                return (f, pass);
            }
            rows = next;
        }
        unreachable!()
    }

    #[test]
    fn searches_find_what_sorting_finds() {
        // Many ties (values in 0..4) and a spread tail: the histogram narrows onto ids.
        let v = 20_000;
        let z: Vec<f32> = (0..v)
            .map(|j| {
                if j % 3 == 0 {
                    (j % 4) as f32
                } else {
                    -((j % 1000) as f32) / 64.0
                }
            })
            .collect();
        let s_max = 3.0;
        let mut sorted: Vec<u64> = (0..v).map(|j| order_key(z[j], j)).collect();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        for k in [1, 5, 1700, 5000, 19_999, 20_000] {
            let (found, _) = run_search(&z, Goal::Count(k), 0);
            assert_eq!(found, Found::Kth(Some(sorted[k as usize - 1])), "k={k}");
        }
        assert_eq!(run_search(&z, Goal::Count(20_001), 0).0, Found::Kth(None));
        let lo = value_floor(-2.0);
        let want = Tally::of(
            &sorted
                .iter()
                .copied()
                .filter(|&k| k >= lo)
                .collect::<Vec<_>>(),
            s_max,
        );
        let Found::Sum(got) = run_search(&z, Goal::Sum, lo).0 else {
            panic!()
        };
        assert_eq!(got.count, want.count);
        assert!((got.mass - want.mass).abs() < 1e-9 * want.mass);
        for top_p in [1e-6, 0.3, 0.5, 0.9, 0.999] {
            let total = Tally::of(&sorted, s_max).mass;
            let (found, passes) = run_search(
                &z,
                Goal::Mass {
                    top_p,
                    target: None,
                },
                0,
            );
            let Found::Cut { cut, kept } = found else {
                panic!()
            };
            // The first key from the top whose inclusive cumulative mass reaches top_p·M.
            let mut run = 0.0;
            let i = sorted
                .iter()
                .position(|&k| {
                    run += rel_mass(key_value(k), s_max);
                    run >= top_p * total
                })
                .unwrap();
            assert_eq!(cut, sorted[i], "top_p={top_p}");
            assert_eq!(kept.count, i as u64 + 1);
            assert!(passes >= 2, "top_p={top_p}: {passes} passes");
        }
    }
}
