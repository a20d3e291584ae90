//! A host model of `cuda/kernels/top_keys.cu`'s `top_keys_f32`, one row at a time: what
//! the device keeps of each tile for a truncated support's pass A (`super::pass_a`'s
//! [`super::pass_a::TopBuffer`] on the host). Tests run the support's decisions on it
//! (`super::tests`: the device's path against the f64 reference) and check it against
//! sorting; the kernel is written step for step as this model (compiled, not run on a
//! GPU).

/// A row's device buffer: `cap` slots of which `held` are keys (in no order), and whether
/// a key was ever dropped.
#[derive(Debug, Clone)]
pub(crate) struct DeviceRow {
    pub(crate) slots: Vec<u64>,
    pub(crate) held: usize,
    pub(crate) dropped: bool,
}

impl DeviceRow {
    pub(crate) fn new(cap: usize) -> Self {
        DeviceRow {
            slots: vec![0; cap],
            held: 0,
            dropped: false,
        }
    }

    /// The row's keys and whether they are the whole row (the download's form).
    pub(crate) fn keys(&self) -> (Vec<u64>, bool) {
        (self.slots[..self.held].to_vec(), !self.dropped)
    }

    /// One tile's keys (distinct from the held ones: ids differ), as the kernel merges
    /// them: keys at or below the floor (a full buffer's smallest) are skipped; the rest
    /// are appended while they fit, else the `cap`-th largest key `t` of the buffer and
    /// the rest is found by an MSB-first radix select (8-bit digits, stopping where the
    /// chosen digit's bin is exactly what is wanted), and the buffer's slots below `t`
    /// take the tile's keys `≥ t`.
    pub(crate) fn push_tile(&mut self, tile: &[u64]) {
        let cap = self.slots.len();
        let held = self.held;
        if held + tile.len() > cap {
            self.dropped = true;
        }
        let floor = match held == cap {
            true => self.slots.iter().copied().min().unwrap_or(0),
            false => 0,
        };
        let fresh = tile.iter().filter(|&&k| k > floor).count();
        if fresh == 0 {
            return;
        }
        if held + fresh <= cap {
            let mut at = held;
            for &k in tile.iter().filter(|&&k| k > floor) {
                self.slots[at] = k;
                at += 1;
            }
            self.held = at;
            return;
        }
        let (mut prefix, mut mask, mut want) = (0u64, 0u64, cap as u64);
        for shift in (0..8).rev().map(|d| d * 8) {
            let mut hist = [0u64; 256];
            let matching = (self.slots[..held].iter())
                .chain(tile.iter().filter(|&&k| k > floor))
                .filter(|&&k| k & mask == prefix);
            for &k in matching {
                hist[((k >> shift) & 255) as usize] += 1;
            }
            let (mut acc, mut d) = (0u64, 255usize);
            while d > 0 && acc + hist[d] < want {
                acc += hist[d];
                d -= 1;
            }
            want -= acc;
            prefix |= (d as u64) << shift;
            mask |= 255u64 << shift;
            if hist[d] == want {
                break;
            }
        }
        let t = prefix;
        let holes: Vec<usize> = (0..cap)
            .filter(|&i| i >= held || self.slots[i] < t)
            .collect();
        let mut next = holes.into_iter();
        for &k in tile.iter().filter(|&&k| k > floor && k >= t) {
            let slot = next.next().expect("as many holes as entering keys");
            self.slots[slot] = k;
        }
        self.held = cap;
    }
}

#[cfg(test)]
mod tests {
    use super::super::pass_a::TopBuffer;
    use super::super::tests::Rng;
    use super::*;
    use crate::fused::key::order_key;

    /// The model keeps what the host's [`TopBuffer`] keeps (the top `cap` keys of the row,
    /// and whether they are all of it) on rows with many ties, peaked rows, flat rows and
    /// tiles narrower and wider than the buffer.
    #[test]
    fn device_model_keeps_the_top_buffers_keys() {
        let mut rng = Rng(41);
        for case in 0..60 {
            let v = 1 + (rng.uniform() * 9000.0) as usize;
            let cap = [256, 300, 4096][case % 3];
            let tile = [97, 256, 1000, 5000][case % 4];
            let z: Vec<f32> = (0..v)
                .map(|j| match case % 5 {
                    0 => (j % 4) as f32,
                    1 => 0.5,
                    2 => {
                        if j == v / 2 {
                            40.0
                        } else {
                            (rng.normal() * 0.1) as f32
                        }
                    }
                    _ => (rng.normal() * 3.0) as f32,
                })
                .collect();
            let (mut host, mut device) = (TopBuffer::default(), DeviceRow::new(cap));
            for start in (0..v).step_by(tile) {
                let end = (start + tile).min(v);
                host.push_tile(&z[start..end], start, 0.7, cap);
                let keys: Vec<u64> = (start..end)
                    .map(|j| order_key(z[j] * 0.7 + 0.0, j))
                    .collect();
                device.push_tile(&keys);
            }
            let (want, whole) = host.finish(cap);
            let (mut got, complete) = device.keys();
            got.sort_unstable_by(|a, b| b.cmp(a));
            assert_eq!(got, want, "case {case} v={v} cap={cap} tile={tile}");
            assert_eq!(complete, whole, "case {case}");
        }
    }
}
