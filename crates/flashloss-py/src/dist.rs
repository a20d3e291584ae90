//! A vocab-parallel LM head over `torch.distributed`: [`PyCollective`] is a flashloss
//! [`Collective`] whose operations call back into Python (`flashloss._dist.GroupOps`,
//! which runs them on the caller's `ProcessGroup`: Gloo for CPU tensors, NCCL for CUDA
//! tensors), so the sharded drivers of the `flashloss` crate (merge of row statistics,
//! `dH` all-reduce, agreement on errors) run unchanged. The kernels run with the GIL
//! released; each collective takes it back for the length of the call.
//!
//! Each rank passes its contiguous block of the head's rows, in rank order; blocks may
//! differ in size. [`VocabGroup::shard`] gathers the block sizes (offset
//! `Σ_{r' < r} V_r'`, vocabulary `Σ_r V_r`) and checks that every rank passes the same
//! rows.

use crate::tensor::arg_error;
use flashloss::collective::{Collective, agree};
use flashloss::{Error, Shard};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A `ProcessGroup` seen through `flashloss._dist.GroupOps` (Python object `ops`).
pub(crate) struct PyCollective {
    ops: Py<PyAny>,
    rank: usize,
    world: usize,
}

fn collective_error(e: PyErr) -> Error {
    Error::Collective {
        reason: format!("torch.distributed: {e}"),
    }
}

impl PyCollective {
    /// Reads the rank and size of the group behind `ops`.
    pub(crate) fn new(ops: &Bound<'_, PyAny>) -> PyResult<Self> {
        let rank: usize = ops.getattr("rank")?.extract()?;
        let world: usize = ops.getattr("world_size")?.extract()?;
        Ok(PyCollective {
            ops: ops.clone().unbind(),
            rank,
            world,
        })
    }

    /// `buf ← op_ranks buf` by the group's own all-reduce (`dtype` names buf's type).
    fn all_reduce<T: Copy>(&self, buf: &mut [T], dtype: &str, op: &str) -> flashloss::Result<()> {
        // SAFETY: plain numbers viewed as their bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                buf.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(buf),
            )
        };
        Python::attach(|py| -> PyResult<()> {
            let out =
                self.ops
                    .call_method1(py, "all_reduce", (PyBytes::new(py, bytes), dtype, op))?;
            let out = out.bind(py).cast::<PyBytes>()?.as_bytes();
            if out.len() != bytes.len() {
                return Err(PyValueError::new_err(format!(
                    "all_reduce returned {} bytes for {}",
                    out.len(),
                    bytes.len()
                )));
            }
            bytes.copy_from_slice(out);
            Ok(())
        })
        .map_err(collective_error)
    }
}

impl Collective for PyCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather_bytes(&self, local: &[u8]) -> flashloss::Result<Vec<Vec<u8>>> {
        Python::attach(|py| {
            let out = self
                .ops
                .call_method1(py, "all_gather_bytes", (PyBytes::new(py, local),))?;
            out.extract::<Vec<Vec<u8>>>(py)
        })
        .map_err(collective_error)
    }

    fn split(&self, _color: usize, _key: usize) -> flashloss::Result<Box<dyn Collective>> {
        Err(Error::Collective {
            reason: "a torch.distributed group is not split by flashloss (pass the vocab-parallel group itself)"
                .into(),
        })
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> flashloss::Result<()> {
        self.all_reduce(buf, "float64", "sum")
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> flashloss::Result<()> {
        self.all_reduce(buf, "float32", "sum")
    }

    fn all_reduce_max_f32(&self, buf: &mut [f32]) -> flashloss::Result<()> {
        self.all_reduce(buf, "float32", "max")
    }
}

/// The vocab-parallel group of a call, if any.
pub(crate) struct VocabGroup(pub(crate) PyCollective);

impl VocabGroup {
    pub(crate) fn new(ops: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Self>> {
        ops.map(|o| PyCollective::new(o).map(VocabGroup))
            .transpose()
    }

    /// `local` (this rank's parsing of its arguments) agreed over the group: when any
    /// rank failed, every rank raises the lowest failing rank's error (so no rank
    /// waits in a collective its peers never reach).
    pub(crate) fn agree<T>(&self, py: Python<'_>, local: PyResult<T>) -> PyResult<T> {
        let status = match &local {
            Ok(_) => Ok(()),
            Err(e) => Err(Error::Collective {
                reason: e.value(py).to_string(),
            }),
        };
        // The GIL stays held: the collective's calls into Python take it again.
        match agree(&self.0, status) {
            Ok(()) => local,
            Err(Error::OnRank { rank, reason }) => Err(PyValueError::new_err(format!(
                "rank {rank}: {}",
                reason.strip_prefix("collective: ").unwrap_or(&reason)
            ))),
            Err(e) => Err(PyValueError::new_err(e.to_string())),
        }
    }

    /// This rank's [`Shard`]: its `vocab` rows follow those of the lower ranks. Every
    /// rank must pass the same `rows` of `hidden_size` (and the same `dtype` code).
    pub(crate) fn shard(
        &self,
        py: Python<'_>,
        vocab: usize,
        rows: usize,
        hidden_size: usize,
        dtype: u8,
    ) -> PyResult<Shard> {
        let mine = [vocab as f64, rows as f64, hidden_size as f64, dtype as f64];
        let all = py
            .detach(|| self.0.all_gather_f64(&mine))
            .map_err(|e| arg_error("vocab_parallel_group", e))?;
        for (r, theirs) in all.iter().enumerate() {
            for (k, (arg, what)) in [
                ("hidden", "rows"),
                ("hidden", "hidden size H"),
                ("weight", "dtype"),
            ]
            .into_iter()
            .enumerate()
            {
                if theirs[k + 1] != all[0][k + 1] {
                    return Err(arg_error(
                        arg,
                        format!(
                            "rank {r} of vocab_parallel_group has {what} {}, rank 0 has {}; every rank passes the same rows and its own block of the head",
                            theirs[k + 1],
                            all[0][k + 1]
                        ),
                    ));
                }
            }
        }
        let offset: f64 = all[..self.0.rank].iter().map(|t| t[0]).sum();
        let total: f64 = all.iter().map(|t| t[0]).sum();
        Ok(Shard {
            offset: offset as usize,
            vocab: total as usize,
        })
    }
}
