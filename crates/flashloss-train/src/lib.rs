//! GRPO training on candle, an application of the flashloss candle ops
//! (`flashloss_candle::ops`): a differentiable Qwen2-architecture model ([`model`]),
//! tokenizers ([`tokenizer`]), the GSM8K-format math task ([`task`]), GRPO training
//! with a YAML switch between the candle-ops baseline and the fused loss ([`train`]),
//! and A/B reports ([`report`]). The `flashloss train` and `flashloss report` commands
//! call it.

#![warn(missing_docs)]

pub mod model;
pub mod report;
pub mod task;
pub mod tokenizer;
pub mod train;
