//! Storage element types of logits, hidden states and weights: f32 and bf16.
//! All arithmetic is done in f32 (or wider) whatever the storage type.

use half::bf16;
use serde::{Deserialize, Serialize};

/// The storage dtype of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16: f32's exponent with an 8-bit mantissa.
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }
}

/// A storage element: widened to f32 on load, rounded (to nearest even) on store.
pub trait Element: Copy + Send + Sync + Default + 'static {
    /// The dtype tag of this element type.
    const DTYPE: DType;
    /// Widens to f32 (exact).
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
    /// The slice itself when the type is f32 (kernels then read it without a copy).
    fn as_f32(slice: &[Self]) -> Option<&[f32]>;
    /// The mutable slice itself when the type is f32.
    fn as_f32_mut(slice: &mut [Self]) -> Option<&mut [f32]>;
    /// The slice itself when the type is bf16.
    fn as_bf16(slice: &[Self]) -> Option<&[bf16]>;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn as_f32(slice: &[Self]) -> Option<&[f32]> {
        Some(slice)
    }
    fn as_f32_mut(slice: &mut [Self]) -> Option<&mut [f32]> {
        Some(slice)
    }
    fn as_bf16(_: &[Self]) -> Option<&[bf16]> {
        None
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    fn as_bf16(slice: &[Self]) -> Option<&[bf16]> {
        Some(slice)
    }
}
