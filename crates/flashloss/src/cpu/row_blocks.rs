//! Blocks of rows for the CPU's products: a row that takes no part (masked, or ignored)
//! joins no product, and the blocks' spans still cover every row in order.

use std::ops::Range;

/// The fewest blocks of at most `nb` of the rows where `live` holds, in order, of even
/// size (a short last block runs its products slowly). A row that takes no part
/// (masked, or ignored) has no logits and a zero gradient, so it joins no product; the
/// blocks' spans still cover every row in order (the last reaches the end; without
/// live rows, one empty block spans them all).
pub(crate) fn live_row_blocks(live: &[bool], nb: usize) -> Vec<RowBlock> {
    let n = live.len();
    let ids: Vec<usize> = (0..n).filter(|&i| live[i]).collect();
    let count = ids.len().div_ceil(nb.max(1));
    let even = ids.len().div_ceil(count.max(1)).max(1);
    let mut blocks = Vec::with_capacity(count);
    let mut start = 0;
    for chunk in ids.chunks(even) {
        let end = chunk[chunk.len() - 1] + 1;
        blocks.push(RowBlock {
            ids: chunk.to_vec(),
            span: start..end,
        });
        start = end;
    }
    match blocks.last_mut() {
        Some(last) => last.span.end = n,
        None if n > 0 => blocks.push(RowBlock {
            ids: Vec::new(),
            span: 0..n,
        }),
        None => {}
    }
    blocks
}

/// A block of rows `ids` (ascending; live rows, or rows with a gradient), and the rows
/// `span` it stands for: its own and the rows left out between the previous block's and
/// its last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowBlock {
    pub(crate) ids: Vec<usize>,
    pub(crate) span: Range<usize>,
}

impl RowBlock {
    /// Its rows as a range where they are consecutive.
    pub(crate) fn range(&self) -> Option<Range<usize>> {
        let (first, last) = (*self.ids.first()?, *self.ids.last()?);
        (last - first + 1 == self.ids.len()).then_some(first..last + 1)
    }

    /// Its rows of `all` (rows of `width` entries, `[N, width]`), in order.
    pub(crate) fn rows_of<'a, T>(&self, all: &'a mut [T], width: usize) -> Vec<&'a mut [T]> {
        let Some(&first) = self.ids.first() else {
            return Vec::new();
        };
        let mut ids = self.ids.iter().peekable();
        (all[first * width..].chunks_mut(width).zip(first..))
            .filter(|(_, i)| ids.next_if_eq(&i).is_some())
            .map(|(row, _)| row)
            .collect()
    }

    /// Its entries of `all` (`[N]`), in order.
    pub(crate) fn entries_of<'a, T>(&self, all: &'a mut [T]) -> Vec<&'a mut T> {
        let rows = self.rows_of(all, 1).into_iter();
        rows.map(|r| &mut r[0]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{RowBlock, live_row_blocks};

    #[test]
    fn live_row_blocks_leave_out_dead_rows_and_span_every_row() {
        let live = [false, true, true, false, true, false, false, true, false];
        let blocks = live_row_blocks(&live, 2);
        let want = [(vec![1, 2], 0..3), (vec![4, 7], 3..9)];
        assert_eq!(blocks.len(), want.len());
        for (b, (ids, span)) in blocks.iter().zip(want) {
            assert_eq!((&b.ids, &b.span), (&ids, &span));
        }
        assert_eq!(blocks[0].range(), Some(1..3));
        assert_eq!(blocks[1].range(), None);
        let all = live_row_blocks(&[true; 5], 2);
        let spans: Vec<_> = all.iter().map(|b| b.span.clone()).collect();
        assert_eq!(spans, [0..2, 2..4, 4..5]);
        let even = live_row_blocks(&[true; 9], 4);
        let sizes: Vec<_> = even.iter().map(|b| b.ids.len()).collect();
        assert_eq!(sizes, [3, 3, 3]);
        assert!(all.iter().all(|b| b.range() == Some(b.span.clone())));
        let mut all_rows: Vec<u32> = (0..27).collect();
        let picked: Vec<Vec<u32>> = (blocks[1].rows_of(&mut all_rows, 3).into_iter())
            .map(|r| r.to_vec())
            .collect();
        assert_eq!(picked, [vec![12, 13, 14], vec![21, 22, 23]]);
        let none = live_row_blocks(&[false; 3], 2);
        assert_eq!(
            none,
            [RowBlock {
                ids: vec![],
                span: 0..3
            }]
        );
        assert!(live_row_blocks(&[], 4).is_empty());
    }
}
