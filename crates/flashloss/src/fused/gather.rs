//! Candidate sets of a log-prob call: `logp_ik = s_{i,k_ik} - lse_i` at `gather_ids`
//! `[N, K]`, gathered in pass A by a [`TileVisitor`] that checks each row's ids against
//! the tile's range (each row's ids sorted once, so a tile costs a binary search per
//! row; `O(N·K)` memory, never `[N, V]`), and finished like the target's `logp`
//! (`(z_k - μ)·inv_temp - log S` in f64) once the row's statistics are whole. A gradient
//! call gathers them in its single pass, where the plan is one. On a vocabulary
//! shard each rank gathers the ids it holds into a zero-filled `[N, K]` buffer and the
//! ranks sum it. The gradient for cotangents `c_ik`: `-(Σ_k c_ik)·p_j` joins the dense
//! [`super::RowGrad`] and `c_ik·1[j = k_ik]` is a [`SparseGrads`] term on the shard
//! holding `k_ik`.

use super::logp_request::GatherIds;
use super::passes::SparseGrads;
use super::terms::{DeviceGatherSink, DeviceSinks, TileVisitor};
use crate::rows::RowStats;
use std::ops::Range;

/// Gathers the raw logits `z_{i,k_ik}` of the ids a head holds, tile by tile.
pub(crate) struct GatherVisitor {
    k: usize,
    /// Per row, `(local id, slot)` sorted by id: rows' lists at `starts[i]..starts[i+1]`.
    order: Vec<(usize, usize)>,
    starts: Vec<usize>,
    /// `[N, K]` ids local to the head (-1: not gathered), for a backend that gathers on
    /// its device.
    local: Vec<i64>,
    /// Raw logits `[N, K]` (0 where not gathered on this head).
    pub(crate) z: Vec<f32>,
}

impl GatherVisitor {
    /// For the live rows of `ids` (of the whole vocabulary; checked in `[0, V)` where
    /// live), the ids a head holding vocabulary entries `range` sees.
    pub(crate) fn new(ids: &GatherIds, live: &[bool], range: &Range<usize>) -> Self {
        let (n, k) = (live.len(), ids.k);
        let mut order = Vec::with_capacity(n * k);
        let mut starts = Vec::with_capacity(n + 1);
        starts.push(0);
        for (i, row) in ids.ids.chunks(k).enumerate().take(n) {
            let first = order.len();
            if live[i] {
                let held = (row.iter().enumerate())
                    .map(|(slot, &id)| (id as usize, slot))
                    .filter(|(id, _)| range.contains(id))
                    .map(|(id, slot)| (id - range.start, slot));
                order.extend(held);
                order[first..].sort_unstable();
            }
            starts.push(order.len());
        }
        let mut local = vec![-1; n * k];
        for (i, w) in starts.windows(2).enumerate() {
            for &(j, slot) in &order[w[0]..w[1]] {
                local[i * k + slot] = j as i64;
            }
        }
        GatherVisitor {
            k,
            order,
            starts,
            local,
            z: vec![0.0; n * k],
        }
    }
}

impl TileVisitor for GatherVisitor {
    fn visit(&mut self, rows: &[usize], vocab: Range<usize>, z: &[f32], ld: usize) {
        for (r, &i) in rows.iter().enumerate() {
            let list = &self.order[self.starts[i]..self.starts[i + 1]];
            let from = list.partition_point(|&(j, _)| j < vocab.start);
            for &(j, slot) in list[from..].iter().take_while(|(j, _)| *j < vocab.end) {
                self.z[i * self.k + slot] = z[r * ld + j - vocab.start];
            }
        }
    }

    fn device_sinks(&mut self) -> DeviceSinks<'_> {
        DeviceSinks {
            gather: Some(DeviceGatherSink {
                k: self.k,
                local_ids: &self.local,
                z: &mut self.z,
            }),
            top: None,
        }
    }
}

/// `logp_ik = (z_ik - μ_i)·inv_temp - log S_i` from the gathered raw logits `z` `[N, K]`
/// at `ids` and the rows' statistics (0 where a row is not live); an id equal to the
/// row's target gives the target's `logp` itself.
pub(crate) fn finish_gathered(
    stats: &[RowStats],
    z: &[f32],
    (ids, targets): (&GatherIds, &[i64]),
    (inv_temp, live): (f32, &[bool]),
) -> Vec<f32> {
    let k = ids.k;
    let mut out = vec![0.0; z.len()];
    for (i, (o, zr)) in out.chunks_mut(k).zip(z.chunks(k)).enumerate() {
        if !live[i] {
            continue;
        }
        let st = &stats[i];
        let row_ids = &ids.ids[i * k..(i + 1) * k];
        for ((o, &zk), &id) in o.iter_mut().zip(zr).zip(row_ids) {
            *o = if id == targets[i] {
                st.logp
            } else {
                ((zk as f64 - st.max as f64) * inv_temp as f64 - st.log_sum as f64) as f32
            };
        }
    }
    out
}

/// The sparse terms of the cotangents `grads` `[N, K]` at `ids` (ids of the whole
/// vocabulary): `scale·c_ik` at `k_ik` for live rows (`scale = g/T`), nothing elsewhere.
pub(crate) fn sparse_terms(
    ids: &GatherIds,
    grads: &[f32],
    scale: f64,
    live: &[bool],
) -> SparseGrads {
    let k = ids.k;
    let keep = |at: usize| live[at / k];
    SparseGrads {
        k,
        ids: (ids.ids.iter().enumerate())
            .map(|(at, &id)| if keep(at) { id } else { -1 })
            .collect(),
        coefs: (grads.iter().enumerate())
            .map(|(at, &c)| {
                if keep(at) {
                    (scale * c as f64) as f32
                } else {
                    0.0
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `cuda/kernels/gather_logits.cu` does with a visitor's device ids, written on
    /// the host: out[r·k + slot] = tile[r, id - col0] where the id falls in the tile.
    fn gather_kernel_model(
        tile: (&[f32], usize, &[usize], Range<usize>),
        ids: &[i64],
        k: usize,
        out: &mut [f32],
    ) {
        let (z, ld, rows, vocab) = tile;
        for (r, &i) in rows.iter().enumerate() {
            for slot in 0..k {
                let id = ids[i * k + slot];
                if id >= 0 && vocab.contains(&(id as usize)) {
                    out[i * k + slot] = z[r * ld + id as usize - vocab.start];
                }
            }
        }
    }

    /// The device ids of a vocabulary shard (masked rows and other shards' ids -1,
    /// repeats kept) gather, tile by tile, exactly what `visit` gathers.
    #[test]
    fn device_ids_gather_what_visit_gathers() {
        let (n, k, range) = (5usize, 4usize, 7usize..29);
        let ids: Vec<i64> = (0..n * k).map(|a| ((a * 37 + 11) % 35) as i64).collect();
        let mut ids = ids;
        ids[2] = ids[1]; // a repeat
        let live = [true, false, true, true, true];
        let gather = GatherIds { ids: &ids, k };
        let mut visitor = GatherVisitor::new(&gather, &live, &range);
        let sink = visitor
            .device_sinks()
            .gather
            .expect("a candidate visitor gathers on a device");
        assert_eq!(sink.k, k);
        let local = sink.local_ids.to_vec();
        for (at, (&l, &id)) in local.iter().zip(&ids).enumerate() {
            let held = live[at / k] && range.contains(&(id as usize));
            let want = if held { id - range.start as i64 } else { -1 };
            assert_eq!(l, want, "slot {at}");
        }
        let v = range.len();
        let z: Vec<f32> = (0..n * v).map(|x| x as f32 * 0.5 - 3.0).collect();
        let mut device_z = vec![0.0f32; n * k];
        let live_rows: Vec<usize> = (0..n).filter(|&i| live[i]).collect();
        for tile in [0..6, 6..13, 13..v] {
            let zt: Vec<f32> = (live_rows.iter())
                .flat_map(|&i| z[i * v + tile.start..i * v + tile.end].to_vec())
                .collect();
            visitor.visit(&live_rows, tile.clone(), &zt, tile.len());
            gather_kernel_model(
                (&zt, tile.len(), &live_rows, tile),
                &local,
                k,
                &mut device_z,
            );
        }
        let mut sink_z = vec![0.0f32; n * k];
        for (at, &l) in local.iter().enumerate() {
            if l >= 0 {
                sink_z[at] = device_z[at];
            }
        }
        assert_eq!(sink_z, visitor.z);
        assert!(visitor.z.iter().any(|&x| x != 0.0));
    }
}
