//! flashloss on candle: the fused losses as candle operations with backward
//! ([`ops`]), a differentiable Qwen2-architecture model ([`model`]), tokenizers
//! ([`tokenizer`]), the GSM8K-format math task ([`task`]), GRPO training with a YAML
//! switch between the candle-ops baseline and the fused loss ([`train`]), and A/B
//! reports ([`report`]).

#![warn(missing_docs)]

pub mod model;
pub mod ops;
pub mod report;
pub mod task;
pub mod tokenizer;
pub mod train;
