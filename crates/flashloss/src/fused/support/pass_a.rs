//! Pass A's visitor of a truncated support ([`super`]): per row its top `C`
//! keys (a [`TopBuffer`], keys of `super::key`), and for a call whose only
//! filter is top-p on a whole vocabulary the row's histogram
//! (`super::histogram`), reduced to the bin of top-p's cut once the row's sweep
//! is done. Memory: `8·C` bytes a row once its tiles are seen, `8·2C` while they are;
//! a histogram's 24 KiB only while the row's sweep is in flight.

use super::histogram::HistogramRow;
use super::search::pick;
use crate::fused::key::{order_key, scaled};
use crate::fused::terms::{DeviceSinks, DeviceTopSink, TileVisitor};
use rayon::prelude::*;
use std::ops::Range;

/// A row's largest keys, filled tile by tile in pass A: keys above `floor` are appended;
/// at `2·cap` entries the buffer keeps its top `cap` and the floor rises to their
/// smallest. Invariant: every key seen and not held is below the smallest held.
#[derive(Debug, Clone, Default)]
pub(crate) struct TopBuffer {
    keys: Vec<u64>,
    floor: u64,
    /// Whether a key was ever dropped (else the buffer holds the whole row).
    dropped: bool,
}

impl TopBuffer {
    /// Adds one tile of the row's logits `z` at vocabulary entries from `start`.
    pub(crate) fn push_tile(&mut self, z: &[f32], start: usize, inv_temp: f32, cap: usize) {
        for (o, &x) in z.iter().enumerate() {
            let key = order_key(scaled(x, inv_temp), start + o);
            if key > self.floor {
                self.keys.push(key);
                if self.keys.len() >= 2 * cap {
                    self.shrink(cap);
                }
            }
        }
    }

    /// After the row's last tile: its top `cap` keys, in no more memory than they need.
    fn settle(&mut self, cap: usize) {
        self.shrink(cap);
        self.keys.shrink_to_fit();
    }

    fn shrink(&mut self, cap: usize) {
        if self.keys.len() > cap {
            let cut = self.keys.len() - cap;
            self.keys.select_nth_unstable(cut);
            self.keys.drain(..cut);
            self.floor = self.keys.iter().copied().min().unwrap_or(0);
            self.dropped = true;
        }
    }

    /// The top `cap` keys, descending, and whether they are the whole row.
    pub(crate) fn finish(mut self, cap: usize) -> (Vec<u64>, bool) {
        self.shrink(cap);
        self.keys.sort_unstable_by(|a, b| b.cmp(a));
        (self.keys, !self.dropped)
    }
}

/// The rows' pass-A histograms of a call whose only filter is `top_p`, each reduced
/// after its sweep (a whole vocabulary) or, on a vocabulary `shard`, kept as its message.
pub(crate) struct Histograms {
    pub(crate) top_p: f64,
    pub(crate) shard: bool,
    pub(crate) rows: Vec<HistogramRow>,
}

/// The top buffers of pass A, one per row, and where the call builds them, the rows'
/// histograms, as a tile visitor.
pub(crate) struct BufferPass {
    pub(crate) inv_temp: f32,
    pub(crate) cap: usize,
    /// The head's first id in the whole vocabulary, and its entries.
    pub(crate) offset: usize,
    pub(crate) vocab: usize,
    pub(crate) rows: Vec<TopBuffer>,
    pub(crate) histograms: Option<Histograms>,
    /// Every row's top keys as a device selected them (`TileVisitor::device_sinks`):
    /// then `rows` stay empty and no histogram is kept.
    device_tops: Option<Vec<(Vec<u64>, bool)>>,
    /// Whether the pass ran on a device, whose pass-A sums are f32 (`__expf`): the
    /// decisions then take no mass from them (`super::decide`).
    on_device: bool,
}

impl BufferPass {
    /// Empty buffers of `cap` keys for `n` rows of a head of `vocab` entries whose first
    /// id is `offset`, with histograms for `top_p` (on a shard or not) where it is given.
    pub(crate) fn new(
        n: usize,
        inv_temp: f32,
        cap: usize,
        (offset, vocab): (usize, usize),
        top_p: Option<(f64, bool)>,
    ) -> Self {
        BufferPass {
            inv_temp,
            cap,
            offset,
            vocab,
            rows: vec![TopBuffer::default(); n],
            histograms: top_p.map(|(top_p, shard)| Histograms {
                top_p,
                shard,
                rows: vec![HistogramRow::default(); n],
            }),
            device_tops: None,
            on_device: false,
        }
    }

    /// Whether pass A's masses are exact to f64 rounding (the CPU's pass; not a
    /// device's f32 sums).
    pub(crate) fn pass_a_mass_exact(&self) -> bool {
        !self.on_device
    }

    /// Every row's top keys (descending, and whether they are the whole row), and the
    /// histograms.
    pub(crate) fn finish(self) -> (Vec<(Vec<u64>, bool)>, Option<Histograms>) {
        let cap = self.cap;
        if let Some(tops) = self.device_tops {
            return (device_tops(tops, cap), self.histograms);
        }
        let tops = (self.rows.into_par_iter())
            .map(|buf| buf.finish(cap))
            .collect();
        (tops, self.histograms)
    }
}

/// A device's top keys (any order, at most `cap`; more are a device's fault and are cut
/// to the largest `cap`, marked incomplete) in [`TopBuffer::finish`]'s form.
fn device_tops(tops: Vec<(Vec<u64>, bool)>, cap: usize) -> Vec<(Vec<u64>, bool)> {
    (tops.into_par_iter())
        .map(|(mut keys, complete)| {
            keys.sort_unstable_by(|a, b| b.cmp(a));
            let complete = complete && keys.len() <= cap;
            keys.truncate(cap);
            (keys, complete)
        })
        .collect()
}

/// Each tile's rows go to their buffers and histograms (in parallel over the rows); a
/// row's buffer settles after the head's last tile, its histogram after its last entry.
impl TileVisitor for BufferPass {
    fn visit(&mut self, rows: &[usize], vocab: Range<usize>, z: &[f32], ld: usize) {
        let (inv_temp, cap, cols) = (self.inv_temp, self.cap, vocab.len());
        let (start, last) = (vocab.start + self.offset, vocab.end == self.vocab);
        let buffers = (pick(&mut self.rows, rows).into_par_iter()).zip(z.par_chunks(ld));
        let to_buffer = |buf: &mut TopBuffer, row: &[f32]| {
            buf.push_tile(&row[..cols], start, inv_temp, cap);
            if last {
                buf.settle(cap);
            }
        };
        match self.histograms.as_mut() {
            None => buffers.for_each(|(buf, row)| to_buffer(buf, row)),
            Some(h) => {
                let close = (self.vocab, (!h.shard).then_some(h.top_p));
                (buffers.zip(pick(&mut h.rows, rows))).for_each(|((buf, row), hist)| {
                    to_buffer(buf, row);
                    hist.push_tile(&row[..cols], inv_temp, close);
                });
            }
        }
    }

    /// On a device: the top keys are selected there; the histograms are not kept (a
    /// top-p row its buffer cannot decide sums its mass in its first extra pass).
    fn device_sinks(&mut self) -> DeviceSinks<'_> {
        self.histograms = None;
        self.on_device = true;
        let (cap, offset) = (self.cap, self.offset);
        DeviceSinks {
            gather: None,
            top: Some(DeviceTopSink {
                cap,
                offset,
                tops: &mut self.device_tops,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_buffer_keeps_the_largest_keys() {
        let v = 5000;
        let z: Vec<f32> = (0..v).map(|j| ((j * 7919) % 613) as f32 / 8.0).collect();
        let mut buf = TopBuffer::default();
        for start in (0..v).step_by(300) {
            let end = (start + 300).min(v);
            buf.push_tile(&z[start..end], start, 1.0, 64);
        }
        let (keys, complete) = buf.finish(64);
        let mut sorted: Vec<u64> = (0..v).map(|j| order_key(z[j], j)).collect();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(keys, sorted[..64]);
        assert!(!complete);
        let mut small = TopBuffer::default();
        small.push_tile(&z[..10], 0, 1.0, 64);
        assert!(small.finish(64).1);
    }
}
