//! flashloss-tools: the drivers of the `flashloss` command-line tool, in a library so
//! that they are tested and the CLI only parses, calls and prints. A gradcheck puts a
//! kernel's loss and gradients next to the f64 reference (`docs/spec/losses.md`)
//! on random inputs and gates the differences at the spec's tolerances; a bench times
//! the fused kernels against the plain path that materializes the `[tokens × vocab]`
//! logits.
//!
//! Modules: YAML configs with `--set` overrides ([`config_file`]), seeded random inputs
//! ([`inputs`]), [`gradcheck`] and its sharded form ([`sharded_check`]), [`bench`] with
//! its GPU ([`gpu_bench`]) and sharded ([`sharded_bench`]) forms. Errors are
//! [`Error`]: the kernels' [`flashloss::Error`] or a bad config file.

#![warn(missing_docs)]

pub mod bench;
pub mod checks;
pub mod config_file;
pub mod error;
pub mod gpu_bench;
pub mod gradcheck;
pub mod inputs;
pub mod sharded_bench;
pub mod sharded_check;

pub use error::{Error, Result};
