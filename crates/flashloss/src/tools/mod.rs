//! Drivers of the command-line tool.
