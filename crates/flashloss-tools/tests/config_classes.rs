//! The tools' configs as a user sets them (`--set key=value` over a config file): every
//! class of bad numeric value is a config error naming the key, and a size that cannot
//! fit in memory is an `OutOfMemory` error with the bytes asked and available, before
//! anything is drawn. Never a panic or an abort.

use flashloss_tools::bench::{self, BenchConfig};
use flashloss_tools::config_file;
use flashloss_tools::gradcheck::{self, GradcheckConfig};
use flashloss_tools::{Error, checks};

const GRADCHECK: &str = include_str!("../../../configs/gradcheck/default.yaml");
const GRADCHECK_LINEAR: &str = include_str!("../../../configs/gradcheck/linear_grpo.yaml");
const BENCH: &str = include_str!("../../../configs/bench/default.yaml");

fn gradcheck_with(text: &str, set: &[&str]) -> Result<GradcheckConfig, Error> {
    let overrides: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    config_file::parse(text, &overrides)
}

fn key_of(err: &Error) -> String {
    match err {
        Error::ConfigFile { key, .. } => key.clone(),
        e => panic!("expected a config error, got {e}"),
    }
}

#[test]
fn every_bad_numeric_class_names_its_key() {
    let cases: &[(&str, &str)] = &[
        ("batch=0", "batch"),
        ("seq_len=0", "seq_len"),
        ("vocab=0", "vocab"),
        ("hidden=0", "hidden"),
        ("vocab_groups=0", "vocab_groups"),
        ("masked_fraction=1.5", "masked_fraction"),
        ("masked_fraction=-0.1", "masked_fraction"),
        ("masked_fraction=.nan", "masked_fraction"),
        ("logit_std=0", "logit_std"),
        ("logit_std=-1", "logit_std"),
        ("logit_std=.inf", "logit_std"),
        ("grad_output=.inf", "grad_output"),
        ("budget_mib=-5", "budget_mib"),
        ("timeout_s=0", "timeout_s"),
        ("tolerance.loss_rel=-1", "tolerance.loss_rel"),
        ("tolerance.grad_atol=.nan", "tolerance.grad_atol"),
    ];
    for text in [GRADCHECK, GRADCHECK_LINEAR] {
        for (set, key) in cases {
            let cfg = gradcheck_with(text, &[set]).unwrap();
            let err = gradcheck::run(&cfg).unwrap_err();
            assert_eq!(key_of(&err), *key, "{set}: {err}");
            assert!(err.to_string().contains(key), "{set}: {err}");
        }
    }
    // A bad loss value is the loss config's own error.
    let cfg = gradcheck_with(GRADCHECK, &["loss.epsilon_low=2"]).unwrap();
    let err = gradcheck::run(&cfg).unwrap_err();
    assert!(err.to_string().contains("epsilon_low"), "{err}");
}

#[test]
fn sizes_that_cannot_fit_are_out_of_memory_before_drawing() {
    // 4·10^11 logits: terabytes.
    for text in [GRADCHECK, GRADCHECK_LINEAR] {
        let cfg = gradcheck_with(text, &["batch=1000", "seq_len=2000", "vocab=200000"]).unwrap();
        match gradcheck::run(&cfg).unwrap_err() {
            Error::Kernel(flashloss::Error::OutOfMemory {
                bytes, available, ..
            }) => {
                assert!(bytes > 1 << 40, "{bytes}");
                assert!(available.is_some_and(|a| a < bytes));
            }
            e => panic!("expected OutOfMemory, got {e}"),
        }
    }
    // A product that overflows usize is a config error.
    let cfg = gradcheck_with(
        GRADCHECK,
        &["batch=4294967296", "seq_len=4294967296", "vocab=16"],
    )
    .unwrap();
    let err = gradcheck::run(&cfg).unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");
}

fn bench_with(set: &[&str]) -> BenchConfig {
    let overrides: Vec<String> = set.iter().map(|s| s.to_string()).collect();
    config_file::parse(BENCH, &overrides).unwrap()
}

#[test]
fn bench_classes_and_memory() {
    let mut notes = Vec::new();
    let cases: &[(&str, &str)] = &[
        ("tokens=0", "tokens"),
        ("vocab=0", "vocab"),
        ("hidden=0", "hidden"),
        ("repeat=0", "repeat"),
        ("batch=0", "batch"),
        ("batch=3", "batch"),
        ("budget_mib=0", "budget_mib"),
        ("budget_mib=.nan", "budget_mib"),
        ("gather_k=4", "gather_k"),
    ];
    for (set, key) in cases {
        let cfg = bench_with(&[set]);
        let err = bench::run(&cfg, &mut |l, _, _| notes.push(l.to_string())).unwrap_err();
        assert_eq!(key_of(&err), *key, "{set}: {err}");
    }
    // A truncated support is timed on log-probs and on the fused GRPO step only.
    for (set, other, key) in [
        ("top_k=4", "loss=ce", "top_k"),
        ("min_p=0.1", "loss=ce", "min_p"),
        ("top_p=0.5", "level=logits", "top_p"),
    ] {
        let cfg = bench_with(&[set, other]);
        let err = bench::run(&cfg, &mut |l, _, _| notes.push(l.to_string())).unwrap_err();
        assert_eq!(key_of(&err), key, "{set} {other}: {err}");
    }
    let cfg = bench_with(&["loss=logprobs", "level=logits"]);
    let err = bench::run(&cfg, &mut |l, _, _| notes.push(l.to_string())).unwrap_err();
    assert_eq!(key_of(&err), "loss", "{err}");
    for (set, key) in [
        ("top_k=0", "top_k"),
        ("top_p=1.5", "top_p"),
        ("min_p=-1", "min_p"),
    ] {
        let cfg = bench_with(&["loss=logprobs", "level=linear", set]);
        let err = bench::run(&cfg, &mut |l, _, _| notes.push(l.to_string())).unwrap_err();
        assert_eq!(key_of(&err), key, "{set}: {err}");
    }
    // Candidate sets belong to the log-prob bench (on either device).
    let cfg = bench_with(&["loss=ce", "gather_k=4", "device=cuda"]);
    let err = bench::run(&cfg, &mut |l, _, _| notes.push(l.to_string())).unwrap_err();
    assert_eq!(key_of(&err), "gather_k", "{err}");
    let cfg = bench_with(&["loss=ce", "level=linear", "top_k=50"]);
    let err = bench::run(&cfg, &mut |l, _, _| notes.push(l.to_string())).unwrap_err();
    assert_eq!(key_of(&err), "top_k", "{err}");
    for level in ["level=logits", "level=linear"] {
        let cfg = bench_with(&[level, "tokens=131072", "vocab=151936000", "hidden=4096"]);
        match bench::run(&cfg, &mut |l, _, _| notes.push(l.to_string())).unwrap_err() {
            Error::Kernel(flashloss::Error::OutOfMemory { bytes, .. }) => {
                assert!(bytes > 1 << 40)
            }
            e => panic!("expected OutOfMemory, got {e}"),
        }
    }
    // Nothing was drawn, so no stage was announced.
    assert!(notes.is_empty(), "{notes:?}");
}

#[test]
fn a_run_says_what_it_does_first() {
    let cfg = gradcheck_with(GRADCHECK, &["vocab=101"]).unwrap();
    let mut notes = Vec::new();
    let report = gradcheck::run_with(&cfg, &mut |n| notes.push(n.to_string())).unwrap();
    assert!(report.passed);
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].contains("V=101"), "{notes:?}");
    let cfg = bench_with(&["tokens=8", "vocab=64", "repeat=1", "warmup=0"]);
    let mut stages = Vec::new();
    // (This test binary has no tracking allocator, so the CPU bench stops after its
    // first note with an error saying so.)
    let _ = bench::run(&cfg, &mut |l, _, total| {
        if total == 0 {
            stages.push(l.to_string())
        }
    });
    assert!(stages[0].contains("drawing inputs"), "{stages:?}");
    assert!(checks::positive("x", 1.0).is_ok());
}

/// A bench without `budget_mib` (or `--set budget_mib=null`) leaves the budget unset: the
/// device's default (the CPU's 160 MiB; on CUDA from its memory); a number sets it.
#[test]
fn a_bench_without_a_budget_takes_the_devices_default() {
    let text = "level: linear\ntokens: 8\nhidden: 4\nvocab: 16\n";
    let omitted: BenchConfig = config_file::parse(text, &[]).unwrap();
    assert_eq!(omitted.budget_mib, None);
    assert_eq!(omitted.fused_options().budget_bytes, None);
    assert_eq!(omitted.fused_options().budget(), 160 << 20);
    let nulled = bench_with(&["budget_mib=null"]);
    assert_eq!(nulled.budget_mib, None);
    let given = bench_with(&["budget_mib=192"]);
    assert_eq!(given.fused_options().budget_bytes, Some(192 << 20));
}
