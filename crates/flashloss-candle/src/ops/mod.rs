//! flashloss losses as candle operations with backward, so a candle model trains
//! through them with `loss.backward()`.
//!
//! - [`grpo_linear`] / [`ce_linear`]: the fused LM-head losses, a `CustomOp2` on
//!   `(hidden [N, H], weight [V, H])`. The forward runs the single-pass kernel, which
//!   yields the loss and `∂L/∂hidden`, `∂L/∂weight` together; the backward scales them
//!   by the upstream gradient. The `[N, V]` logits never exist.
//! - [`grpo_logits`]: the logits-level GRPO loss, a `CustomOp1` on `logits [N, V]`.
//! - [`baseline`]: the same losses written with candle's own ops (they materialize
//!   the logits): the A/B baseline of training and the oracle of this module's tests.
//!
//! What the ops do not differentiate (targets, mask, advantages, old/ref log-probs)
//! lives in the op. Every op runs on one CPU [`Device`] per process ([`device`]), whose
//! workspace is reused from one training step to the next.

pub mod baseline;
mod ce_linear;
mod grpo_linear;
mod grpo_logits;
mod head_op;

pub use ce_linear::ce_linear;
pub use grpo_linear::{GrpoStep, grpo_linear};
pub use grpo_logits::grpo_logits;
pub use head_op::{contiguous, device, wrap};
