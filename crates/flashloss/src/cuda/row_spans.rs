//! Row blocks of the GPU's products that leave out the rows taking no part (masked or
//! ignored rows, or in pass B rows without a gradient), as the CPU's do
//! (`cpu/row_blocks.rs`), without copying the hidden states: a block is a run of at most
//! `nb` consecutive rows that starts and ends with a row that takes part, so the rows
//! between two blocks join no product; rows that take no part inside a block still do
//! (their `dZ` rows are zero). No more blocks than `⌈N/nb⌉`.

use std::ops::Range;

/// A block of the GPU's products: its `rows` (consecutive; empty only in the one block of
/// a call where no row takes part) and the rows `span` it stands for (its own and those
/// left out since the previous block; the last reaches the end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowSpan {
    pub(crate) rows: Range<usize>,
    pub(crate) span: Range<usize>,
}

/// The blocks of at most `nb` rows over the rows where `part` holds (see the module
/// header); their spans cover every row in order.
pub(crate) fn row_spans(part: &[bool], nb: usize) -> Vec<RowSpan> {
    let (n, nb) = (part.len(), nb.max(1));
    let mut out: Vec<RowSpan> = Vec::new();
    let (mut i, mut span_start) = (0, 0);
    while i < n {
        if !part[i] {
            i += 1;
            continue;
        }
        let end = (i + nb).min(n);
        let last = (i..end).rev().find(|&j| part[j]).unwrap_or(i);
        out.push(RowSpan {
            rows: i..last + 1,
            span: span_start..last + 1,
        });
        span_start = last + 1;
        i = end;
    }
    match out.last_mut() {
        Some(last) => last.span.end = n,
        None if n > 0 => out.push(RowSpan {
            rows: 0..0,
            span: 0..n,
        }),
        None => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_leave_out_runs_of_dead_rows_and_spans_cover_every_row() {
        let part = [
            false, true, true, false, true, false, false, false, true, false,
        ];
        let got = row_spans(&part, 3);
        let want = [(1..3, 0..3), (4..5, 3..5), (8..9, 5..10)];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (g, (rows, span)) in got.iter().zip(want) {
            assert_eq!((g.rows.clone(), g.span.clone()), (rows, span));
        }
        let all = row_spans(&[true; 7], 3);
        let ranges: Vec<_> = all.iter().map(|b| b.rows.clone()).collect();
        assert_eq!(ranges, [0..3, 3..6, 6..7]);
        assert_eq!(
            row_spans(&[false; 4], 2),
            [RowSpan {
                rows: 0..0,
                span: 0..4
            }]
        );
        assert!(row_spans(&[], 2).is_empty());
    }

    /// On random masks: every row that takes part is in exactly one block's rows, each
    /// block starts and ends with one and holds at most `nb` rows, the spans tile `0..n`,
    /// and there are no more blocks than the dense ones.
    #[test]
    fn random_masks_keep_every_part_row_once() {
        let mut state = 7u64;
        for case in 0..200 {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let n = (state >> 33) as usize % 40;
            let nb = 1 + (state >> 20) as usize % 6;
            let density = [0.1, 0.5, 0.9][case % 3];
            let part: Vec<bool> = (0..n)
                .map(|i| {
                    let h = (i as u64 + 1).wrapping_mul(state | 1) >> 40;
                    (h % 1000) as f64 / 1000.0 < density
                })
                .collect();
            let blocks = row_spans(&part, nb);
            let mut seen = vec![false; n];
            let mut next = 0;
            for b in &blocks {
                assert_eq!(b.span.start, next, "case {case}: {blocks:?}");
                next = b.span.end;
                assert!(b.rows.len() <= nb && b.span.start <= b.rows.start);
                if !b.rows.is_empty() {
                    assert!(part[b.rows.start] && part[b.rows.end - 1], "case {case}");
                }
                b.rows.clone().for_each(|i| seen[i] = true);
            }
            assert_eq!(next, n, "case {case}");
            assert!(blocks.len() <= n.div_ceil(nb).max(1));
            for i in 0..n {
                assert!(!part[i] || seen[i], "case {case}: row {i} left out");
            }
        }
    }
}
