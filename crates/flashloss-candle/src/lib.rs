//! flashloss on candle: the fused losses as candle operations with backward
//! ([`ops`]), so a candle model trains through them with `loss.backward()`, and the
//! same losses written with candle's own ops (`ops::baseline`), the A/B baseline and
//! the tests' oracle. The integration only: the model and training that use it live in
//! the `flashloss-train` crate.

#![warn(missing_docs)]

pub mod ops;
