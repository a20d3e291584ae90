//! Drivers of the command-line tool, in the library so that they are tested and the
//! CLI only parses, calls and prints: YAML configs with `--set` overrides, random
//! inputs, gradcheck (single-rank and sharded) and bench.

pub mod bench;
pub mod config_file;
pub mod gpu_bench;
pub mod gradcheck;
pub mod inputs;
pub mod sharded_bench;
pub mod sharded_check;
