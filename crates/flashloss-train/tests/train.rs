//! Training: the task, the A/B agreement of the loss paths, resume with no lost step,
//! and the report.

use flashloss_train::task::{Arithmetic, Problem, extract_answer, load_gsm8k, reward};
use flashloss_train::train::{LossImpl, StepMetrics, TrainConfig, Trainer};
use rand::SeedableRng;
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("flashloss_train_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn small(out_dir: &Path, implementation: LossImpl) -> TrainConfig {
    let mut c = TrainConfig {
        steps: 5,
        out_dir: out_dir.to_path_buf(),
        checkpoint_every: 2,
        ..TrainConfig::default()
    };
    c.sft.steps = 2;
    c.sft.batch_size = 6;
    c.grpo.prompts_per_step = 3;
    c.grpo.group_size = 3;
    c.grpo.num_iterations = 2;
    c.grpo.sampling.max_new_tokens = 8;
    c.model.config.hidden_size = 32;
    c.model.config.intermediate_size = 48;
    c.loss.implementation = implementation;
    c
}

fn run(cfg: TrainConfig) -> Vec<StepMetrics> {
    let mut steps = Vec::new();
    Trainer::new(cfg)
        .unwrap()
        .run(|m| steps.push(m.clone()))
        .unwrap();
    steps
}

/// The metrics that must repeat exactly (not times or memory).
fn key(m: &StepMetrics) -> String {
    let mut m = m.clone();
    (
        m.step_time_s,
        m.generate_time_s,
        m.update_time_s,
        m.peak_bytes,
    ) = (0.0, 0.0, 0.0, None);
    serde_json::to_string(&m).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn read_metrics(dir: &Path) -> Vec<StepMetrics> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn gsm8k_lines_load_and_rewards_score_the_final_number() {
    let path = tmp("gsm8k").with_extension("jsonl");
    std::fs::write(
        &path,
        "{\"question\": \"Tom has 3 apples and buys 1,200 more.\", \"answer\": \"3+1200=1203\\n#### 1,203\"}\n\n{\"question\": \"q\", \"answer\": \"#### -4\"}\n",
    )
    .unwrap();
    let problems = load_gsm8k(&path).unwrap();
    assert_eq!(problems.len(), 2);
    assert_eq!(problems[0].final_answer(), Some(1203.0));
    assert_eq!(reward("so #### 1203", &problems[0], 0.1), (1.1, true));
    assert_eq!(reward("#### 12", &problems[0], 0.1), (0.1, false));
    assert_eq!(reward("1203", &problems[0], 0.1), (0.0, false));
    assert_eq!(extract_answer("#### $5.50 dollars"), Some(5.5));
    std::fs::write(&path, "{\"question\": \"q\", \"answer\": \"no final\"}\n").unwrap();
    let e = load_gsm8k(&path).unwrap_err().to_string();
    assert!(e.contains(":1: answer has no `#### N`"), "{e}");
    std::fs::remove_file(&path).unwrap();

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    for _ in 0..50 {
        let p: Problem = Arithmetic { max_operand: 9 }.sample(&mut rng);
        let (a, rest) = p.question.split_at(1);
        let b: i64 = rest[1..].parse().unwrap();
        let a: i64 = a.parse().unwrap();
        let c = if rest.starts_with('+') { a + b } else { a - b };
        assert_eq!(p.final_answer(), Some(c as f64), "{p:?}");
        assert_eq!(reward(&p.answer, &p, 0.1), (1.1, true));
    }
}

#[test]
fn fused_and_baseline_agree_on_the_first_steps() {
    let dirs = [tmp("ab_fused"), tmp("ab_base")];
    let fused = run(small(&dirs[0], LossImpl::Fused));
    let base = run(small(&dirs[1], LossImpl::Baseline));
    assert_eq!(fused.len(), 7);
    // The warm-up (identical batches) and the first GRPO step (identical weights only
    // to rounding, so identical samples) agree to f32 rounding.
    for (f, b) in fused.iter().zip(&base).take(2) {
        let rel = (f.loss - b.loss).abs() / b.loss.abs();
        assert!(rel < 1e-5, "step {}: {} vs {}", f.step, f.loss, b.loss);
    }
    assert_eq!(fused[2].reward_mean, base[2].reward_mean);
    assert!(
        (fused[2].loss - base[2].loss).abs() < 1e-5,
        "{} vs {}",
        fused[2].loss,
        base[2].loss
    );
    for d in dirs {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn an_interrupted_run_resumes_with_no_lost_step() {
    let whole = tmp("whole");
    let reference = run(small(&whole, LossImpl::Fused));
    assert_eq!(read_metrics(&whole).len(), 7);

    // Interrupt after step 5 (index 4): the last checkpoint is after 4 steps, and
    // metrics.jsonl already has a fifth line.
    let cut = tmp("cut");
    let saved = tmp("cut_saved");
    let mut trainer = Trainer::new(small(&cut, LossImpl::Fused)).unwrap();
    trainer
        .run(|m| {
            if m.step == 4 {
                copy_dir(&cut, &saved);
            }
        })
        .unwrap();
    assert_eq!(read_metrics(&saved).len(), 5);
    let resumed = Trainer::new(small(&saved, LossImpl::Fused)).unwrap();
    assert_eq!(resumed.done, 4, "resumes from the checkpoint after 4 steps");
    drop(resumed);
    run(small(&saved, LossImpl::Fused));
    let after = read_metrics(&saved);
    assert_eq!(after.len(), 7);
    for (a, b) in reference.iter().zip(&after) {
        assert_eq!(key(a), key(b), "step {}", a.step);
    }
    // A finished run has nothing left to do.
    assert!(run(small(&whole, LossImpl::Fused)).is_empty());
    for d in [whole, cut, saved] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn the_report_draws_charts_and_a_summary() {
    let dirs = [tmp("rep_a"), tmp("rep_b")];
    let mut a = small(&dirs[0], LossImpl::Fused);
    a.steps = 2;
    let mut b = small(&dirs[1], LossImpl::Logits);
    b.steps = 2;
    run(a);
    run(b);
    let out = tmp("rep_out");
    let md = flashloss_train::report::report(&dirs, &out).unwrap();
    assert!(md.contains("time/train/step_avg_last10_s"), "{md}");
    assert!(md.contains("(fused)") && md.contains("(logits)"), "{md}");
    for png in ["reward.png", "loss.png", "kl.png", "step_time.png"] {
        let bytes = std::fs::read(out.join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 2000, "{png}");
    }
    let e = flashloss_train::report::report(&[out.join("nope")], &out)
        .err()
        .unwrap();
    assert!(e.to_string().contains("metrics.jsonl"), "{e}");
    for d in dirs.into_iter().chain([out]) {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn bad_configs_are_errors_naming_the_key() {
    let e =
        flashloss_tools::config_file::parse::<TrainConfig>("loss: {impl: fast}", &[]).unwrap_err();
    assert!(e.to_string().contains("loss.impl"), "{e}");
    let e = flashloss_tools::config_file::parse::<TrainConfig>("grpo: {group_sise: 2}", &[])
        .unwrap_err();
    assert!(e.to_string().contains("group_sise"), "{e}");
    let mut c = small(&tmp("bad"), LossImpl::Fused);
    c.model.config.vocab_size = 10;
    let e = Trainer::new(c).err().unwrap().to_string();
    assert!(e.contains("vocab_size"), "{e}");
}

#[test]
fn a_resume_refuses_a_config_that_changes_the_run() {
    let dir = tmp("config_check");
    run(small(&dir, LossImpl::Fused));
    let mut changed = small(&dir, LossImpl::Fused);
    changed.steps += 2;
    changed.loss.grpo.beta = 0.1;
    let e = Trainer::new(changed).err().unwrap().to_string();
    assert!(e.contains("`loss.grpo.beta`"), "{e}");
    let mut changed = small(&dir, LossImpl::Fused);
    changed.grpo.lr *= 2.0;
    let e = Trainer::new(changed).err().unwrap().to_string();
    assert!(e.contains("`grpo.lr`"), "{e}");
    // More steps, another checkpoint interval: the same run, continued.
    let mut longer = small(&dir, LossImpl::Fused);
    longer.steps += 2;
    longer.checkpoint_every = 3;
    let more = run(longer);
    assert_eq!(more.len(), 2);
    assert_eq!(read_metrics(&dir).len(), 9);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_damaged_checkpoint_is_an_error_and_the_previous_one_is_kept() {
    let dir = tmp("damaged");
    run(small(&dir, LossImpl::Fused));
    let files = || {
        let mut f: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect();
        f.sort();
        f
    };
    // The last checkpoint (7 steps) and the previous one (6 steps) are both there.
    let before = files();
    assert!(
        before.contains(&"checkpoint-7.safetensors".to_string()),
        "{before:?}"
    );
    assert!(
        before.contains(&"checkpoint-6.safetensors".to_string()),
        "{before:?}"
    );
    assert!(
        before.contains(&"checkpoint.prev.json".to_string()),
        "{before:?}"
    );
    let last = dir.join("checkpoint-7.safetensors");
    let good = std::fs::read(&last).unwrap();
    type Damage<'a> = Box<dyn Fn() + 'a>;
    let cases: Vec<(&str, Damage)> = vec![
        (
            "is corrupted: checksum",
            Box::new(|| {
                let mut b = good.clone();
                let k = b.len() / 2;
                b[k] ^= 0x40;
                std::fs::write(&last, b).unwrap();
            }),
        ),
        (
            "is truncated or damaged",
            Box::new(|| std::fs::write(&last, &good[..good.len() / 3]).unwrap()),
        ),
        (
            "checkpoint.json is corrupted",
            Box::new(|| {
                std::fs::write(&last, &good).unwrap();
                std::fs::write(dir.join("checkpoint.json"), b"{\"done\": 7, \"adam_t").unwrap();
            }),
        ),
    ];
    for (msg, damage) in cases {
        damage();
        let e = Trainer::new(small(&dir, LossImpl::Fused))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(msg), "{msg}: {e}");
        assert!(e.contains("previous checkpoint (after 6 steps)"), "{e}");
        assert_eq!(files(), before, "{msg}: nothing removed");
    }
    // The previous checkpoint resumes: the steps after it run again, as before.
    std::fs::copy(
        dir.join("checkpoint.prev.json"),
        dir.join("checkpoint.json"),
    )
    .unwrap();
    let resumed = Trainer::new(small(&dir, LossImpl::Fused)).unwrap();
    assert_eq!(resumed.done, 6);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Found by the kill test (`flashloss-cli/tests/kill_resume.rs`): a run killed after
/// writing a step's metrics but before its first checkpoint resumed from step 0 and
/// appended, doubling the step. A run from step 0 now starts its metrics over (and so
/// does `resume: false`).
#[test]
fn a_run_from_step_0_starts_its_metrics_over() {
    let dir = tmp("restart");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("metrics.jsonl"), "{\"step\":0}\n{\"ste").unwrap();
    run(small(&dir, LossImpl::Fused));
    let lines = read_metrics(&dir);
    assert_eq!(lines.len(), 7);
    assert!(lines.iter().enumerate().all(|(i, m)| m.step == i));
    let mut again = small(&dir, LossImpl::Fused);
    again.resume = false;
    run(again);
    assert_eq!(read_metrics(&dir).len(), 7);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Found by fuzzing (`fuzz/regressions/loaders/tokenizer-decoder-panic`): a
/// tokenizer.json whose `decoder` the tokenizers library cannot deserialize made it
/// panic; it is now this file's error.
#[test]
fn a_malformed_tokenizer_file_is_an_error_not_a_panic() {
    let crash = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/regressions/loaders/tokenizer-decoder-panic"),
    )
    .unwrap();
    let path = tmp("bad_tokenizer").with_extension("json");
    std::fs::write(&path, &crash[1..]).unwrap();
    let e = flashloss_train::tokenizer::Tokenizer::from_file(&path, "<|endoftext|>")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("malformed tokenizer file"), "{e}");
    std::fs::remove_file(path).unwrap();
}
