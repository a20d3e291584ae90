//! The truncated support over vocabulary shards (vocab-parallel): keys carry global ids,
//! so the order `(s_j, j)` is the whole vocabulary's on every rank. After pass A each
//! rank's top buffers are all-gathered and merged per row (the top `C` of the union
//! keeps the invariant: a rank's unseen keys lie below its own `C`-th, hence below the
//! union's); after each extra pass the histogram tallies are all-gathered and summed in
//! rank order and the collected keys concatenated, so every rank holds the same bits and
//! takes the same decisions and the same number of passes. Bytes per row: `8·C` keys
//! from each rank once, `16·2048` per histogram pass, the collected keys (≤ 4096).
//!
//! Top-p alone: each rank's pass-A histograms of its shard (an absolute grid of the
//! scaled logit, `super::histogram`) are all-gathered after pass A, in groups of
//! [`MERGE_ROWS`] rows, and merged per row in rank order (windows aligned to the largest
//! max, bins summed): every rank reduces the same histogram of the whole row to the same
//! cut bin. Bytes per row: at most `16·2048 + 56` from each rank, held from the row's
//! sweep to the merge (up to 32 KiB a row: the bins from the lowest non-empty one up).

use super::histogram::{BinCut, HistogramRow, RowHistogram};
use super::search::{SearchPass, Tally};
use crate::collective::Collective;
use crate::error::{Error, Result};

/// Every row's top keys (descending, and whether they are the whole row) merged over
/// `comm`'s shards: the top `cap` of their union.
pub(crate) fn merge_buffers(
    comm: &dyn Collective,
    rows: Vec<(Vec<u64>, bool)>,
    cap: usize,
) -> Result<Vec<(Vec<u64>, bool)>> {
    let mut bytes = Vec::new();
    for (keys, complete) in &rows {
        bytes.push(u8::from(*complete));
        put_keys(&mut bytes, keys);
    }
    let all = comm.all_gather_bytes(&bytes)?;
    let mut readers: Vec<Reader> = all.iter().map(|b| Reader { bytes: b, at: 0 }).collect();
    let mut out = Vec::with_capacity(rows.len());
    for _ in 0..rows.len() {
        let (mut union, mut complete) = (Vec::new(), true);
        for r in readers.iter_mut() {
            complete &= r.byte()? == 1;
            union.extend(r.keys()?);
        }
        union.sort_unstable_by(|a, b| b.cmp(a));
        complete &= union.len() <= cap;
        union.truncate(cap);
        out.push((union, complete));
    }
    Ok(out)
}

/// Rows whose histograms one all-gather carries.
const MERGE_ROWS: usize = 256;

/// Every row's cut bin for `top_p` from its shards' pass-A histograms `rows` (this
/// rank's), merged over `comm`'s shards.
pub(crate) fn merge_histograms(
    comm: &dyn Collective,
    mut rows: Vec<HistogramRow>,
    top_p: f64,
) -> Result<Vec<Option<BinCut>>> {
    let mut out = Vec::with_capacity(rows.len());
    for group in rows.chunks_mut(MERGE_ROWS) {
        let local: Vec<f64> = group.iter_mut().flat_map(|r| r.take_message()).collect();
        let all = comm.all_gather_f64(&local)?;
        let mut at = vec![0; all.len()];
        for _ in 0..group.len() {
            let mut whole = RowHistogram::default();
            for (values, at) in all.iter().zip(at.iter_mut()) {
                let part = RowHistogram::read(values, at).ok_or_else(|| mismatch("histograms"))?;
                whole.merge(&part);
            }
            out.push(whole.reduce(top_p));
        }
    }
    Ok(out)
}

/// Sums an extra pass's tallies over `comm`'s shards: each row's histogram bins (in rank
/// order) and collected keys (concatenated).
pub(crate) fn combine_pass(comm: &dyn Collective, pass: &mut SearchPass) -> Result<()> {
    let searches = || pass.rows.iter().flatten();
    let bins: Vec<f64> = searches()
        .flat_map(|s| s.bins.iter().flat_map(|b| [b.count as f64, b.mass]))
        .collect();
    let mut keys = Vec::new();
    searches().for_each(|s| put_keys(&mut keys, &s.keys));
    let all_bins = comm.all_gather_f64(&bins)?;
    let all_keys = comm.all_gather_bytes(&keys)?;
    if all_bins.iter().any(|b| b.len() != bins.len()) {
        return Err(mismatch("histogram bins"));
    }
    let mut readers: Vec<Reader> = all_keys
        .iter()
        .map(|b| Reader { bytes: b, at: 0 })
        .collect();
    let mut at = 0;
    for search in pass.rows.iter_mut().flatten() {
        for bin in search.bins.iter_mut() {
            *bin = Tally::default();
            for rank in &all_bins {
                bin.count += rank[at] as u64;
                bin.mass += rank[at + 1];
            }
            at += 2;
        }
        search.keys.clear();
        for r in readers.iter_mut() {
            search.keys.extend(r.keys()?);
        }
    }
    Ok(())
}

fn mismatch(what: &str) -> Error {
    Error::Collective {
        reason: format!("the vocabulary shards sent different truncated-support {what}"),
    }
}

/// `keys` as a little-endian count and keys.
fn put_keys(out: &mut Vec<u8>, keys: &[u64]) {
    out.extend((keys.len() as u64).to_le_bytes());
    keys.iter().for_each(|k| out.extend(k.to_le_bytes()));
}

/// Reads what [`put_keys`] wrote, in order.
struct Reader<'b> {
    bytes: &'b [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let out = self
            .bytes
            .get(self.at..self.at + n)
            .ok_or_else(|| mismatch("buffers"))?;
        self.at += n;
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn keys(&mut self) -> Result<Vec<u64>> {
        let n = self.u64()? as usize;
        (0..n).map(|_| self.u64()).collect()
    }
}
