//! The tools' errors: a kernel error, or a config file that cannot be read or parsed.

use thiserror::Error;

/// Everything that can go wrong in a tool run.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum Error {
    /// An error of the kernels (bad input, a device or collective failure), with its
    /// message unchanged.
    #[error(transparent)]
    Kernel(#[from] flashloss::Error),
    /// A config file could not be read or parsed; `key` is the dotted path.
    #[error("config {key}: {reason}")]
    ConfigFile {
        /// Dotted path of the offending key (`<file>` when the whole file is bad).
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// The tools' result type.
pub type Result<T> = std::result::Result<T, Error>;
