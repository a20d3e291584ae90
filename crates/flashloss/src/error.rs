//! Typed errors: every one names the argument (or config key), and where it applies
//! the shape or index that is wrong.

use thiserror::Error;

/// Everything that can go wrong in flashloss. Bad input is always reported through
/// this type, never through a panic or a NaN.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum Error {
    /// A loss-configuration field has a bad value or conflicts with another field.
    #[error("invalid loss config: `{field}`: {reason}")]
    InvalidConfig {
        /// The offending field, e.g. `delta`.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
    /// A buffer has the wrong number of elements for its declared shape.
    #[error("argument `{arg}`: expected {expected} elements for shape {shape}, got {actual}")]
    ShapeMismatch {
        /// The argument name, e.g. `target_ids`.
        arg: &'static str,
        /// The shape it must have, e.g. `[B=3, T=17]`.
        shape: String,
        /// Elements required.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// A size or stride is impossible (zero, or rows that would overlap).
    #[error("argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The argument name.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A token id lies outside `[0, vocab)`.
    #[error(
        "argument `{arg}`: id {id} at index {index} (sequence {seq}, position {pos}) is outside [0, {vocab})"
    )]
    TokenOutOfRange {
        /// The argument name (`target_ids`).
        arg: &'static str,
        /// Flat index into the `[B, T]` buffer.
        index: usize,
        /// Sequence b.
        seq: usize,
        /// Position t.
        pos: usize,
        /// The bad id.
        id: i64,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A value that must be finite is NaN or infinite.
    #[error("argument `{arg}`: value {value} at index {index} is not finite")]
    NonFinite {
        /// The argument name, e.g. `advantages`.
        arg: &'static str,
        /// Flat index of the bad value.
        index: usize,
        /// The value found.
        value: f64,
    },
    /// The target token of a row has probability zero (its logit is `-inf` or the row
    /// is all `-inf`), so its log-probability and the loss are infinite.
    #[error("row {row} (sequence {seq}, position {pos}): target id {id} has a -inf logit")]
    ImpossibleTarget {
        /// Flat row index.
        row: usize,
        /// Sequence b.
        seq: usize,
        /// Position t.
        pos: usize,
        /// The target id.
        id: i64,
    },
    /// A valid input whose loss, gradient or statistic lies beyond the f32 range at a
    /// row (spec: "Numeric range"): the kernel stops before writing any gradient.
    #[error(
        "{quantity} = {value:e} at row {row}{} is beyond the f32 range (|x| <= 3.4e38); the policy is too far from its old/reference log-probs, or the logits, temperature or grad_output too extreme",
        position_text(*.position)
    )]
    OutOfRange {
        /// Flat token row (for `dweight` and `dbias`: the LM head's vocabulary row).
        row: usize,
        /// `(sequence b, position t)` of a token row.
        position: Option<(usize, usize)>,
        /// Which quantity: `loss`, `loss (running sum)`, `kl`, `dlogp`, `dentropy`,
        /// `dlogits`, `dhidden`, `dweight`, `dbias`.
        quantity: &'static str,
        /// Its value (f64, or the f32 it became).
        value: f64,
    },
    /// An allocation whose size the input decides cannot be served: more bytes than
    /// the machine has available, or than an address space holds.
    #[error("out of memory: {what} needs {bytes} bytes ({:.2} GiB), {}", *.bytes as f64 / 1073741824.0, available_text(*.available))]
    OutOfMemory {
        /// What was being allocated, e.g. `logits [B, T, V]`.
        what: String,
        /// Bytes asked (`u64::MAX` when the size overflows).
        bytes: u64,
        /// Bytes available (Linux `MemAvailable`, or the device's free memory), if known.
        available: Option<u64>,
    },
    /// The CUDA backend could not run: no driver or NVRTC library, a failed CUDA call, or
    /// a kernel that did not compile (what failed and why).
    #[error("cuda: {reason}")]
    Device {
        /// What failed, with the library's message.
        reason: String,
    },
    /// A collective operation failed: a peer left, timed out, or sent a mismatched
    /// buffer.
    #[error("collective: {reason}")]
    Collective {
        /// What happened, naming the ranks.
        reason: String,
    },
    /// A feature that this backend or build does not implement (yet).
    #[error("`{feature}` is not supported: {reason}")]
    Unsupported {
        /// The feature or argument, e.g. `gather_ids`.
        feature: &'static str,
        /// Which backend or build lacks it, and what to use instead.
        reason: String,
    },
    /// Some rank of a sharded run failed; every rank returns this same error.
    #[error("rank {rank}: {reason}")]
    OnRank {
        /// The lowest rank that failed.
        rank: usize,
        /// Its error.
        reason: String,
    },
}

fn position_text(position: Option<(usize, usize)>) -> String {
    match position {
        Some((b, t)) => format!(" (sequence {b}, position {t})"),
        None => " of the LM head".into(),
    }
}

fn available_text(available: Option<u64>) -> String {
    match available {
        Some(b) => format!("{b} bytes ({:.2} GiB) available", b as f64 / 1073741824.0),
        None => "available memory unknown".into(),
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
