//! The crate's integration tests in one binary: each file of `tests/` is a module here
//! (its name the filter: `cargo test -p flashloss-tools --test kernels prop_kernels`), so
//! the kernels' generics are compiled and linked once rather than once per file.
//! `fused_budget` stays a binary of its own (its tracking allocator counts the process).
//! A new test file is added to the list below; `every_test_file_is_a_module` checks it.

mod common;
mod support_common;

#[path = "ce_linear.rs"]
mod ce_linear;
#[path = "config_classes.rs"]
mod config_classes;
#[path = "device.rs"]
mod device;
#[path = "edge_cases.rs"]
mod edge_cases;
#[path = "gradcheck_linear.rs"]
mod gradcheck_linear;
#[path = "gradcheck_logprobs.rs"]
mod gradcheck_logprobs;
#[path = "grpo_linear.rs"]
mod grpo_linear;
#[path = "grpo_logits_matrix.rs"]
mod grpo_logits_matrix;
#[path = "grpo_support.rs"]
mod grpo_support;
#[path = "head_grad.rs"]
mod head_grad;
#[path = "layout_and_threads.rs"]
mod layout_and_threads;
#[path = "logp_request.rs"]
mod logp_request;
#[path = "logp_request_checks.rs"]
mod logp_request_checks;
#[path = "logp_support.rs"]
mod logp_support;
#[path = "logp_support_split.rs"]
mod logp_support_split;
#[path = "numeric_range.rs"]
mod numeric_range;
#[path = "pass_hooks.rs"]
mod pass_hooks;
#[path = "prop_kernels.rs"]
mod prop_kernels;
#[path = "prop_validation.rs"]
mod prop_validation;
#[path = "reference_fd.rs"]
mod reference_fd;
#[path = "row_invariance.rs"]
mod row_invariance;
#[path = "sharded_check.rs"]
mod sharded_check;
#[path = "sharded_linear.rs"]
mod sharded_linear;
#[path = "validation.rs"]
mod validation;
#[path = "weight_layout.rs"]
mod weight_layout;

/// The test files of this folder that this binary compiles (all but `fused_budget.rs`).
const MODULES: &[&str] = &[
    "ce_linear",
    "config_classes",
    "device",
    "edge_cases",
    "gradcheck_linear",
    "gradcheck_logprobs",
    "grpo_linear",
    "grpo_logits_matrix",
    "grpo_support",
    "head_grad",
    "layout_and_threads",
    "logp_request",
    "logp_request_checks",
    "logp_support",
    "logp_support_split",
    "numeric_range",
    "pass_hooks",
    "prop_kernels",
    "prop_validation",
    "reference_fd",
    "row_invariance",
    "sharded_check",
    "sharded_linear",
    "validation",
    "weight_layout",
];

#[test]
fn every_test_file_is_a_module() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let stem = name.strip_suffix(".rs")?.to_string();
            (stem != "kernels" && stem != "fused_budget").then_some(stem)
        })
        .collect();
    found.sort();
    assert_eq!(
        found, MODULES,
        "a file in tests/ is not a module of tests/kernels.rs"
    );
}
