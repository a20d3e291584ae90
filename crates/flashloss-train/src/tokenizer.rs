//! Tokenizers: a built-in character tokenizer for the default demo, and any Hugging
//! Face `tokenizer.json` through the `tokenizers` crate.

use candle_core::Result;
use std::path::Path;

/// The built-in alphabet: ids 0, 1, 2 are pad, end-of-sequence and unknown; then
/// these characters in order.
pub const CHARS: &str =
    " \n0123456789+-*/=().,:;?!#$%'\"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";

/// Text to token ids and back.
pub enum Tokenizer {
    /// One id per character of [`CHARS`].
    Chars,
    /// A Hugging Face tokenizer with its end-of-sequence and padding ids.
    HuggingFace {
        /// The loaded `tokenizer.json`.
        inner: Box<tokenizers::Tokenizer>,
        /// End-of-sequence id.
        eos: u32,
        /// Padding id.
        pad: u32,
    },
}

impl Tokenizer {
    /// Loads a `tokenizer.json`; `eos_token` (e.g. `<|endoftext|>`) must be in its
    /// vocabulary and also serves as padding.
    pub fn from_file(path: &Path, eos_token: &str) -> Result<Self> {
        // The tokenizers library panics on some malformed files (found by fuzzing, e.g.
        // a `decoder` it cannot deserialize): that is this file's error, not a crash.
        let loaded = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_file(path)).map_err(
            |panic| {
                let why = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("the tokenizers library panicked");
                candle_core::Error::msg(format!(
                    "{}: malformed tokenizer file ({why})",
                    path.display()
                ))
            },
        )?;
        let inner =
            loaded.map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
        let Some(eos) = inner.token_to_id(eos_token) else {
            candle_core::bail!(
                "tokenizer.eos_token: {eos_token:?} is not in {}",
                path.display()
            )
        };
        Ok(Tokenizer::HuggingFace {
            inner: Box::new(inner),
            eos,
            pad: eos,
        })
    }

    /// Ids the tokenizer can produce (the model's vocabulary may be larger).
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Chars => 3 + CHARS.chars().count(),
            Tokenizer::HuggingFace { inner, .. } => inner.get_vocab_size(true),
        }
    }

    /// End-of-sequence id.
    pub fn eos(&self) -> u32 {
        match self {
            Tokenizer::Chars => 1,
            Tokenizer::HuggingFace { eos, .. } => *eos,
        }
    }

    /// Padding id.
    pub fn pad(&self) -> u32 {
        match self {
            Tokenizer::Chars => 0,
            Tokenizer::HuggingFace { pad, .. } => *pad,
        }
    }

    /// Token ids of `text` (no special tokens added; unknown characters map to 2).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Chars => Ok(text
                .chars()
                .map(|c| {
                    CHARS
                        .chars()
                        .position(|a| a == c)
                        .map_or(2, |i| i as u32 + 3)
                })
                .collect()),
            Tokenizer::HuggingFace { inner, .. } => Ok(inner
                .encode(text, false)
                .map_err(|e| candle_core::Error::msg(format!("tokenizer: {e}")))?
                .get_ids()
                .to_vec()),
        }
    }

    /// The text of `ids`; special and out-of-alphabet ids are dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Tokenizer::Chars => Ok(ids
                .iter()
                .filter_map(|&i| CHARS.chars().nth((i as usize).checked_sub(3)?))
                .collect()),
            Tokenizer::HuggingFace { inner, .. } => inner
                .decode(ids, true)
                .map_err(|e| candle_core::Error::msg(format!("tokenizer: {e}"))),
        }
    }
}
