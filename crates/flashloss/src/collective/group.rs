//! The [`Collective`] trait and what is built on its one primitive (all-reduces, gathers,
//! broadcast, barrier, [`agree`]), [`Solo`], and the split helpers the engines share: a
//! leaf that the engines (`in_process`, `mpi`) import and `collective/mod.rs` re-exports.

use crate::error::{Error, Result};

/// Elements per round of the provided all-reduces: bounds the gathered copies to
/// `world_size × REDUCE_CHUNK` elements however large the buffer.
const REDUCE_CHUNK: usize = 1 << 20;

/// A group of ranks that exchange data. Every rank must call the same operations in the
/// same order; an operation returns an error (never hangs) when a peer has gone.
pub trait Collective: Send + Sync {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// Every rank's `local`, in rank order (sizes may differ).
    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// A sub-group: the ranks that pass the same `color`, ordered by `(key, rank)`.
    /// Every rank of this group must call it (collective).
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>>;

    /// `buf ← Σ_ranks buf` (f64), summed in rank order.
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        reduce(self, buf, |a, b| a + b)
    }

    /// `buf ← Σ_ranks buf` (f32), summed in rank order.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        reduce(self, buf, |a, b| a + b)
    }

    /// `buf ← max_ranks buf` (f32).
    fn all_reduce_max_f32(&self, buf: &mut [f32]) -> Result<()> {
        reduce(self, buf, f32::max)
    }

    /// Every rank's `local` f64 values, in rank order.
    fn all_gather_f64(&self, local: &[f64]) -> Result<Vec<Vec<f64>>> {
        let gathered = self.all_gather_bytes(&to_bytes(local))?;
        Ok(gathered.iter().map(|b| from_bytes(b)).collect())
    }

    /// `buf ← buf of rank root`.
    fn broadcast_f64(&self, buf: &mut [f64], root: usize) -> Result<()> {
        let local = if self.rank() == root {
            to_bytes(buf)
        } else {
            Vec::new()
        };
        let gathered = self.all_gather_bytes(&local)?;
        let values: Vec<f64> = from_bytes(&gathered[root]);
        if values.len() != buf.len() {
            return Err(Error::Collective {
                reason: format!(
                    "broadcast from rank {root}: {} values, rank {} expected {}",
                    values.len(),
                    self.rank(),
                    buf.len()
                ),
            });
        }
        buf.copy_from_slice(&values);
        Ok(())
    }

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_gather_bytes(&[]).map(|_| ())
    }
}

/// Agreement on errors: every rank passes its local result; if any rank failed, every
/// rank returns the same [`Error::OnRank`] naming the lowest failing rank and its
/// error, so a bad input on one rank stops all of them with the same message.
pub fn agree<T>(comm: &(impl Collective + ?Sized), local: Result<T>) -> Result<T> {
    let message = match &local {
        Ok(_) => Vec::new(),
        Err(e) => {
            let mut m = vec![1u8];
            m.extend(e.to_string().bytes());
            m
        }
    };
    let gathered = comm.all_gather_bytes(&message)?;
    match gathered.iter().position(|m| !m.is_empty()) {
        None => local,
        Some(rank) => Err(Error::OnRank {
            rank,
            reason: String::from_utf8_lossy(&gathered[rank][1..]).into_owned(),
        }),
    }
}

/// The members of `rank`'s sub-group when every rank passed `(color, key)` (as
/// gathered, in rank order): their ranks in this group, ordered by `(key, rank)`.
pub(crate) fn split_members(gathered: &[Vec<u8>], rank: usize) -> Vec<usize> {
    let pair = |r: usize| -> (u64, u64) {
        let b = &gathered[r];
        (
            u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        )
    };
    let color = pair(rank).0;
    let mut members: Vec<usize> = (0..gathered.len())
        .filter(|&r| pair(r).0 == color)
        .collect();
    members.sort_by_key(|&r| (pair(r).1, r));
    members
}

/// The bytes a rank contributes to a split: `color` and `key` as little-endian u64.
pub(crate) fn split_bytes(color: usize, key: usize) -> Vec<u8> {
    let mut b = (color as u64).to_le_bytes().to_vec();
    b.extend((key as u64).to_le_bytes());
    b
}

/// A borrowed group is the group.
impl<C: Collective + ?Sized> Collective for &C {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        (**self).all_gather_bytes(local)
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        (**self).split(color, key)
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        (**self).all_reduce_sum_f64(buf)
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        (**self).all_reduce_sum_f32(buf)
    }

    fn all_reduce_max_f32(&self, buf: &mut [f32]) -> Result<()> {
        (**self).all_reduce_max_f32(buf)
    }

    fn all_gather_f64(&self, local: &[f64]) -> Result<Vec<Vec<f64>>> {
        (**self).all_gather_f64(local)
    }

    fn broadcast_f64(&self, buf: &mut [f64], root: usize) -> Result<()> {
        (**self).broadcast_f64(buf, root)
    }

    fn barrier(&self) -> Result<()> {
        (**self).barrier()
    }
}

/// A group of one rank: every collective returns its input. What a sharded kernel
/// gets on an axis that is not split.
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![local.to_vec()])
    }

    fn split(&self, _color: usize, _key: usize) -> Result<Box<dyn Collective>> {
        Ok(Box::new(Solo))
    }
}

/// A plain value that crosses ranks as little-endian bytes.
pub trait Wire: Copy {
    /// Bytes per value.
    const SIZE: usize;
    /// Appends the bytes of `self`.
    fn put(self, out: &mut Vec<u8>);
    /// Reads a value from `SIZE` bytes.
    fn get(bytes: &[u8]) -> Self;
}

impl Wire for f32 {
    const SIZE: usize = 4;
    fn put(self, out: &mut Vec<u8>) {
        out.extend(self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        f32::from_le_bytes(bytes.try_into().expect("4 bytes"))
    }
}

impl Wire for f64 {
    const SIZE: usize = 8;
    fn put(self, out: &mut Vec<u8>) {
        out.extend(self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        f64::from_le_bytes(bytes.try_into().expect("8 bytes"))
    }
}

fn to_bytes<T: Wire>(values: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * T::SIZE);
    values.iter().for_each(|v| v.put(&mut out));
    out
}

fn from_bytes<T: Wire>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(T::SIZE).map(T::get).collect()
}

/// All-reduce by gathering chunks and folding them in rank order.
fn reduce<T: Wire, C: Collective + ?Sized>(
    comm: &C,
    buf: &mut [T],
    op: impl Fn(T, T) -> T,
) -> Result<()> {
    // Agree on the length first, so that mismatched buffers are an error on every rank.
    let lens = comm.all_gather_bytes(&(buf.len() as u64).to_le_bytes())?;
    if let Some(r) = lens
        .iter()
        .position(|l| l[..] != (buf.len() as u64).to_le_bytes())
    {
        return Err(Error::Collective {
            reason: format!(
                "all-reduce of buffers of different lengths: rank {} has {}, rank {r} has {}",
                comm.rank(),
                buf.len(),
                u64::from_le_bytes(lens[r][..8].try_into().expect("8 bytes"))
            ),
        });
    }
    for chunk in buf.chunks_mut(REDUCE_CHUNK) {
        let gathered = comm.all_gather_bytes(&to_bytes(chunk))?;
        let mut acc: Vec<T> = from_bytes(&gathered[0]);
        for other in &gathered[1..] {
            for (a, b) in acc.iter_mut().zip(other.chunks_exact(T::SIZE)) {
                *a = op(*a, T::get(b));
            }
        }
        chunk.copy_from_slice(&acc);
    }
    Ok(())
}
