//! What every sharded check shares: a rank's report, the gate, the grid of ranks and the
//! injected faults (a leaf below [`super`]'s kernels).

use crate::gradcheck::{FaultKind, GradcheckConfig, GradcheckReport};
use flashloss::collective::Collective;
use flashloss::{Error, Parallel, Result};
use serde::Serialize;
use std::time::Duration;

/// Relative gate of sharded vs single-rank values (f32 rounding).
pub(super) const SHARDED_REL: f64 = 1e-5;

/// One rank's result.
#[derive(Debug, Clone, Serialize)]
pub struct RankReport {
    /// This rank.
    pub rank: usize,
    /// Ranks in the run.
    pub world_size: usize,
    /// The split.
    pub parallel: Parallel,
    /// Gates against the single-rank run (`loss_ref` is the single-rank loss).
    #[serde(flatten)]
    pub report: GradcheckReport,
}

/// How long a rank waits for its peers in one collective (config `timeout_s`).
pub fn timeout(cfg: &GradcheckConfig) -> Duration {
    Duration::from_secs_f64(cfg.timeout_s.max(0.0))
}

/// `(token groups, vocab groups)` of `ranks` in the config's mode, checked.
pub(super) fn grid_shape(cfg: &GradcheckConfig, ranks: usize) -> Result<(usize, usize)> {
    cfg.parallel
        .grid_shape(ranks, cfg.vocab_groups, cfg.batch, cfg.vocab)
}

/// Runs the fault that hits this rank before its step, if any.
pub(super) fn before_step(cfg: &GradcheckConfig, comm: &dyn Collective) -> Result<()> {
    let Some(fault) = cfg.fault.filter(|f| f.rank == comm.rank()) else {
        return Ok(());
    };
    match fault.kind {
        FaultKind::Panic => panic!("injected fault: rank {} panics", fault.rank),
        FaultKind::Hang => std::thread::sleep(2 * timeout(cfg)),
        FaultKind::Exit => {
            return Err(Error::InvalidArgument {
                arg: "fault",
                reason: format!("injected: rank {} exits", fault.rank),
            });
        }
        FaultKind::Nan | FaultKind::Perturb => {}
    }
    Ok(())
}
