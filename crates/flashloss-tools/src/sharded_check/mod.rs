//! `flashloss gradcheck --ranks P` (in-process ranks) and `--collective mpi` (one
//! process per rank): the sharded fused LM-head kernel ([`linear`]) or logits-level
//! kernel ([`logits`]), token-parallel, vocab-parallel or on a 2-D grid, against a
//! single-rank run of the same inputs. Each rank compares what
//! it holds (loss, its dH rows or the full dH, the full dW or its shard) and reports
//! its own gates; sharding changes only summation order, so the gates are f32
//! rounding: 1e-5 relative to the largest entry.

use crate::gradcheck::{Backend, FaultKind, GradcheckConfig, Kernel};
use flashloss::collective::{Collective, agree, run_in_process};
use flashloss::element::DType;
use flashloss::{Error, Result};
use half::{bf16, f16};
use linear::Check;
use logits::LogitsCheck;

mod linear;
mod logits;
mod logprobs;
mod rank;

use rank::grid_shape;
pub use rank::{RankReport, timeout};

/// Runs the sharded check on `ranks` in-process ranks; one result per rank (a failure
/// on any rank is the same error on all).
pub fn run(cfg: &GradcheckConfig, ranks: usize) -> crate::Result<Vec<crate::Result<RankReport>>> {
    cfg.check_plan()?;
    check_ranks(cfg, ranks)?;
    let results = match (cfg.kernel, cfg.dtype) {
        (Kernel::Linear, DType::F32) => {
            let check = Check::<f32>::new(cfg)?;
            run_in_process(ranks, timeout(cfg), |comm| check.rank(comm))
        }
        (Kernel::Linear, DType::Bf16) => {
            let check = Check::<bf16>::new(cfg)?;
            run_in_process(ranks, timeout(cfg), |comm| check.rank(comm))
        }
        (Kernel::Logits, DType::F32) => {
            let check = LogitsCheck::<f32>::new(cfg)?;
            run_in_process(ranks, timeout(cfg), |comm| check.rank(comm))
        }
        (Kernel::Logits, DType::Bf16) => {
            let check = LogitsCheck::<bf16>::new(cfg)?;
            run_in_process(ranks, timeout(cfg), |comm| check.rank(comm))
        }
        (Kernel::Linear, DType::F16) => {
            let check = Check::<f16>::new(cfg)?;
            run_in_process(ranks, timeout(cfg), |comm| check.rank(comm))
        }
        (Kernel::Logits, DType::F16) => {
            let check = LogitsCheck::<f16>::new(cfg)?;
            run_in_process(ranks, timeout(cfg), |comm| check.rank(comm))
        }
    };
    Ok(results
        .into_iter()
        .map(|r| r.map_err(crate::Error::from))
        .collect())
}

/// Runs this rank's part of the sharded check over `comm`, a group of processes (every
/// rank of `comm` calls it; an injected `exit` fault ends this process). A bad config
/// is the same error on every rank.
pub fn run_on(cfg: &GradcheckConfig, comm: &dyn Collective) -> crate::Result<RankReport> {
    // The same config on every rank: the same verdict, no collective needed.
    cfg.validate()?;
    if cfg
        .fault
        .is_some_and(|f| f.rank == comm.rank() && f.kind == FaultKind::Exit)
    {
        eprintln!("flashloss: injected fault: rank {} exits", comm.rank());
        std::process::exit(1);
    }
    agree(comm, check_ranks(cfg, comm.world_size()))?;
    let report = match (cfg.kernel, cfg.dtype) {
        (Kernel::Linear, DType::F32) => Check::<f32>::new(cfg)?.rank(comm),
        (Kernel::Linear, DType::Bf16) => Check::<bf16>::new(cfg)?.rank(comm),
        (Kernel::Logits, DType::F32) => LogitsCheck::<f32>::new(cfg)?.rank(comm),
        (Kernel::Logits, DType::Bf16) => LogitsCheck::<bf16>::new(cfg)?.rank(comm),
        (Kernel::Linear, DType::F16) => Check::<f16>::new(cfg)?.rank(comm),
        (Kernel::Logits, DType::F16) => LogitsCheck::<f16>::new(cfg)?.rank(comm),
    };
    Ok(report?)
}

fn check_ranks(cfg: &GradcheckConfig, ranks: usize) -> Result<()> {
    if cfg.kernel == Kernel::Logits && cfg.device != Backend::Cpu {
        return Err(Error::InvalidArgument {
            arg: "device",
            reason: "the sharded logits-level kernel runs on the CPU backend".into(),
        });
    }
    grid_shape(cfg, ranks).map(|_| ())
}
