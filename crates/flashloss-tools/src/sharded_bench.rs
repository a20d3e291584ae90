//! `flashloss bench --ranks P` (in-process ranks) and `--collective mpi` (one process
//! per rank): the fused LM-head step sharded as the config's `parallel` says (token,
//! vocab, or a 2-D grid with `vocab_groups`), each rank on its own pool of `threads`
//! threads, against one rank with the same threads on the same inputs, in the same run.
//!
//! Per rank: step time (median of `repeat` after `warmup`), the bytes of the head it
//! holds (`W_r` and `dW_r`, as the tracking allocator counts them), and the peak bytes
//! in use during its steps above what was in use before its inputs were made. Under MPI
//! the peak is the rank's own process; in-process it is the one process of all ranks.
//! The one-rank run is rank 0's, before the sharded steps, while the others wait.

use crate::bench::inputs::on_policy_head_step;
use crate::bench::{BenchConfig, LossKind, Timing, time_steps};
use crate::inputs::{GrpoInputs, InputSpec};
use flashloss::GrpoLoss;
use flashloss::batch::LinearInputs;
use flashloss::collective::{Collective, agree, run_in_process};
use flashloss::cpu::{CpuHead, Workspace};
use flashloss::cross_entropy::CrossEntropy;
use flashloss::device::{CeCall, GrpoCall};
use flashloss::element::{DType, Element};
use flashloss::fused::{ce_linear, grpo_linear};
use flashloss::memory;
use flashloss::policy::Normalizers;
use flashloss::shard_range;
use flashloss::{Device, Grid, LinearGrads, Parallel, Shard};
use flashloss::{Error, Result};
use half::{bf16, f16};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::time::Duration;

/// How long a rank waits for its peers (rank 0's one-rank run included).
pub const TIMEOUT: Duration = Duration::from_secs(3600);

/// One rank's numbers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankBench {
    /// This rank.
    pub rank: usize,
    /// Ranks in the run.
    pub world_size: usize,
    /// The split.
    pub parallel: Parallel,
    /// `(token groups, vocab groups)`.
    pub grid: (usize, usize),
    /// `in_process` or `mpi`.
    pub engine: String,
    /// The loss.
    pub loss_kind: LossKind,
    /// N, H, V of the whole step.
    pub shape: (usize, usize, usize),
    /// Storage dtype.
    pub dtype: DType,
    /// Threads of this rank's pool (and of the one-rank run).
    pub threads: usize,
    /// This rank's sharded step.
    pub step_seconds: Timing,
    /// Rank 0's one-rank step (median) on the same inputs and threads.
    pub one_rank_seconds: f64,
    /// `one_rank_seconds / world_size`.
    pub ideal_seconds: f64,
    /// `step_seconds.median / ideal_seconds` (1 is perfect scaling).
    pub scaling: f64,
    /// The loss of the sharded step.
    pub loss: f64,
    /// The loss of the one-rank step.
    pub one_rank_loss: f64,
    /// Bytes of `W_r` and `dW_r` this rank holds.
    pub head_bytes: usize,
    /// Bytes of `W` and `dW` of the one-rank run.
    pub one_rank_head_bytes: usize,
    /// `head_bytes / (one_rank_head_bytes / world_size)` (1 is an exact 1/P share).
    pub head_share: f64,
    /// Peak bytes in use during the sharded steps above the bytes in use before the
    /// inputs were made (this process: all ranks when in-process).
    pub peak_bytes: usize,
    /// The same for the one-rank steps (rank 0's process).
    pub one_rank_peak_bytes: usize,
}

/// Runs the sharded bench on `ranks` in-process ranks of `threads` threads each.
pub fn run(cfg: &BenchConfig, ranks: usize, threads: usize) -> crate::Result<Vec<RankBench>> {
    // Checked before spawning: with no rank there would be nobody to say so.
    cfg.check_plan()?;
    cfg.parallel
        .grid_shape(ranks, cfg.vocab_groups, cfg.batch, cfg.vocab)?;
    let results = run_in_process(ranks, TIMEOUT, |comm| {
        run_rank(cfg, comm, threads, "in_process")
    });
    Ok(results.into_iter().collect::<Result<_>>()?)
}

/// Runs this rank's part over `comm`, a group of processes; returns every rank's
/// numbers (all-gathered), the same on every rank.
pub fn run_on(
    cfg: &BenchConfig,
    comm: &dyn Collective,
    threads: usize,
) -> crate::Result<Vec<RankBench>> {
    // The same config on every rank: the same verdict, no collective needed.
    cfg.validate()?;
    let mine = run_rank(cfg, comm, threads, "mpi")?;
    let json = serde_json::to_vec(&mine).expect("serializable");
    let gathered = comm.all_gather_bytes(&json)?;
    let benches = gathered
        .iter()
        .map(|b| {
            serde_json::from_slice(b).map_err(|e| Error::Collective {
                reason: format!("a peer's bench report: {e}"),
            })
        })
        .collect::<Result<_>>()?;
    Ok(benches)
}

fn run_rank(
    cfg: &BenchConfig,
    comm: &dyn Collective,
    threads: usize,
    engine: &'static str,
) -> Result<RankBench> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| Error::InvalidArgument {
            arg: "threads",
            reason: e.to_string(),
        })?;
    let checked = (|| {
        if !memory::is_tracking() {
            return Err(Error::InvalidArgument {
                arg: "bench",
                reason: "the tracking allocator is not installed in this binary".into(),
            });
        }
        if cfg.batch == 0 || !cfg.tokens.is_multiple_of(cfg.batch) {
            return Err(Error::InvalidArgument {
                arg: "batch",
                reason: format!("must divide tokens = {}, got {}", cfg.tokens, cfg.batch),
            });
        }
        cfg.parallel
            .grid_shape(comm.world_size(), cfg.vocab_groups, cfg.batch, cfg.vocab)
    })();
    let shape = agree(comm, checked)?;
    pool.install(|| match cfg.dtype {
        DType::F32 => rank_typed::<f32>(cfg, comm, shape, engine),
        DType::Bf16 => rank_typed::<bf16>(cfg, comm, shape, engine),
        DType::F16 => rank_typed::<f16>(cfg, comm, shape, engine),
    })
}

/// Rows `rows` of a `[_, width]` matrix of normal draws times `scale`: row `r` comes
/// from its own ChaCha8 stream, so any rank draws its shard alone, identical to the
/// same rows of the whole matrix.
fn normal_rows<E: Element>(
    seed: u64,
    stream: u64,
    rows: Range<usize>,
    width: usize,
    scale: f32,
) -> Vec<E> {
    let mut out = vec![E::default(); rows.len() * width];
    let normal = Normal::new(0.0f32, 1.0).expect("valid");
    out.par_chunks_mut(width.max(1))
        .zip(rows)
        .for_each(|(row, r)| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(stream + r as u64);
            row.iter_mut()
                .for_each(|x| *x = E::from_f32(normal.sample(&mut rng) * scale));
        });
    out
}

/// One rank's inputs: hidden rows, head rows, and its sequences.
struct RankInputs<E> {
    hidden: Vec<E>,
    weight: Vec<E>,
    tokens: GrpoInputs,
    n: usize,
    vocab: Range<usize>,
}

impl<E: Element> RankInputs<E> {
    fn new(cfg: &BenchConfig, loss: &GrpoLoss, seqs: Range<usize>, vocab: Range<usize>) -> Self {
        let (h, t) = (cfg.hidden, cfg.tokens / cfg.batch);
        let rows = seqs.start * t..seqs.end * t;
        let spec = InputSpec {
            batch: cfg.batch,
            seq_len: t,
            vocab: cfg.vocab,
            masked_fraction: 0.0,
            draw_logits: false,
            ..InputSpec::default()
        };
        let mut all = GrpoInputs::random(&spec, cfg.seed);
        on_policy_head_step(&mut all, loss);
        RankInputs {
            hidden: normal_rows(cfg.seed, 0, rows.clone(), h, 1.0),
            weight: normal_rows(cfg.seed, 1 << 40, vocab.clone(), h, 2.0 / (h as f32).sqrt()),
            tokens: all.sequences(seqs),
            n: rows.len(),
            vocab,
        }
    }

    fn linear(&self, h: usize) -> LinearInputs<'_, E> {
        LinearInputs {
            hidden: &self.hidden,
            weight: &self.weight,
            layout: flashloss::WeightLayout::VocabMajor,
            bias: None,
            tokens: self.n,
            hidden_size: h,
            vocab: self.vocab.len(),
        }
    }

    /// Bytes of the weight buffer and of a dW buffer of `dweight_len` f32.
    fn head_bytes(&self, dweight_len: usize) -> usize {
        self.weight.capacity() * E::DTYPE.size() + dweight_len * 4
    }
}

/// A step's loss and the length of the dW it returned.
type StepOut = (f64, usize);

/// Times `step`; returns the timing, the last loss and dW length, and the peak bytes in
/// use above `base` (read after a barrier, so in-process it covers every rank).
fn timed(
    cfg: &BenchConfig,
    comm: &dyn Collective,
    base: usize,
    reset: bool,
    step: &mut dyn FnMut() -> Result<StepOut>,
) -> Result<(Timing, StepOut, usize)> {
    let mut last = (0.0, 0);
    if reset {
        memory::reset_peak();
    }
    comm.barrier()?;
    let timing = time_steps(
        cfg.warmup,
        cfg.repeat,
        || {
            last = step()?;
            Ok(())
        },
        &mut |_, _| {},
    );
    let timing = agree(comm, timing)?;
    Ok((timing, last, memory::peak().saturating_sub(base)))
}

fn rank_typed<E: Element>(
    cfg: &BenchConfig,
    comm: &dyn Collective,
    (token_groups, vocab_groups): (usize, usize),
    engine: &'static str,
) -> Result<RankBench> {
    let (p, h, v) = (comm.world_size(), cfg.hidden, cfg.vocab);
    let loss = GrpoLoss::new(cfg.grpo.clone())?;
    let ce = CrossEntropy::new(cfg.ce.clone())?;
    let opts = cfg.fused_options();
    let in_process = engine == "in_process";

    // One rank, on rank 0, while the others wait in the barrier inside `timed`.
    let mut one = [0.0f64; 4];
    if comm.rank() == 0 {
        let base = memory::in_use();
        let inputs = RankInputs::<E>::new(cfg, &loss, 0..cfg.batch, 0..v);
        let mut ws = Workspace::new();
        let mut grads = LinearGrads::zeros_for(&inputs.linear(h), opts.head_grad);
        let batch = inputs.tokens.batch();
        let norm = Normalizers::local(&batch);
        let (timing, (value, _), peak) =
            timed(cfg, &flashloss::collective::Solo, base, true, &mut || {
                grads.dhidden.fill(0.0);
                grads.dweight.fill(0.0);
                let lin = inputs.linear(h);
                let head = &mut CpuHead {
                    inputs: &lin,
                    ws: &mut ws,
                    grads: grads.view(),
                };
                let value = match cfg.loss {
                    LossKind::Grpo => grpo_linear(head, &loss, &batch, norm, &opts)?.loss,
                    LossKind::Ce => ce_linear(head, &ce, batch.target_ids, None, &opts)?.loss,
                    LossKind::Logprobs => return Err(logprobs_unsharded()),
                };
                Ok((value, grads.dweight.len()))
            })?;
        one = [
            timing.median,
            value,
            inputs.head_bytes(grads.dweight.len()) as f64,
            peak as f64,
        ];
    }
    comm.broadcast_f64(&mut one, 0)?;
    let [one_seconds, one_loss, one_head, one_peak] = one;

    // This rank's share: every rank reads the bytes in use before any draws its inputs.
    comm.barrier()?;
    let base = memory::in_use();
    comm.barrier()?;
    let (tg, vg) = (comm.rank() / vocab_groups, comm.rank() % vocab_groups);
    let seqs = shard_range(cfg.batch, token_groups, tg);
    let vocab = shard_range(v, vocab_groups, vg);
    let inputs = RankInputs::<E>::new(cfg, &loss, seqs, vocab.clone());
    let grid = Grid::of(comm, cfg.parallel, vocab_groups)?;
    let batch = inputs.tokens.batch();
    comm.barrier()?;
    let reset = !in_process || comm.rank() == 0;
    let device = Device::cpu();
    let (timing, (value, dweight_len), peak) = timed(cfg, comm, base, reset, &mut || {
        let lin = inputs.linear(h);
        let shard = Shard {
            offset: vocab.start,
            vocab: v,
        };
        let (value, grads) = match cfg.loss {
            LossKind::Grpo => {
                let o = device.with_host_grads(
                    &lin,
                    GrpoCall::new(&loss, &batch, &opts).sharded(&grid, shard),
                )?;
                (o.loss, o.grads)
            }
            LossKind::Logprobs => return Err(logprobs_unsharded()),
            LossKind::Ce => {
                let targets = batch.target_ids;
                let o = device.with_host_grads(
                    &lin,
                    CeCall::new(&ce, targets, &opts).sharded(&grid, shard),
                )?;
                (o.loss, o.grads)
            }
        };
        Ok((value, grads.dweight.len()))
    })?;
    comm.barrier()?;
    let head_bytes = inputs.head_bytes(dweight_len);
    let ideal = one_seconds / p as f64;
    Ok(RankBench {
        rank: comm.rank(),
        world_size: p,
        parallel: cfg.parallel,
        grid: (token_groups, vocab_groups),
        engine: engine.into(),
        loss_kind: cfg.loss,
        shape: (cfg.tokens, h, v),
        dtype: cfg.dtype,
        threads: rayon::current_num_threads(),
        step_seconds: timing,
        one_rank_seconds: one_seconds,
        ideal_seconds: ideal,
        scaling: timing.median / ideal,
        loss: value,
        one_rank_loss: one_loss,
        head_bytes,
        one_rank_head_bytes: one_head as usize,
        head_share: head_bytes as f64 / (one_head / p as f64),
        peak_bytes: peak,
        one_rank_peak_bytes: one_peak as usize,
    })
}

/// The sharded bench times GRPO and CE only.
fn logprobs_unsharded() -> Error {
    Error::InvalidArgument {
        arg: "loss",
        reason: "logprobs is benchmarked on one rank (no --ranks)".into(),
    }
}
