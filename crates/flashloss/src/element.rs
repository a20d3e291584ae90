//! Storage element types of logits, hidden states and weights: f32, bf16 and f16
//! (IEEE half, as V100/T4 users train in). All arithmetic is done in f32 (or wider)
//! whatever the storage type: bf16 and f16 are widened exactly on load.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// The bits of `x` rounded to bf16, to nearest even, branch-free (a loop of them
/// vectorizes); a NaN stays a quiet NaN. Equal to `half::bf16::from_f32` (tested).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        (b >> 16) as u16 | 0x40
    } else {
        rounded as u16
    }
}

/// The storage dtype of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// bfloat16: f32's exponent with an 8-bit mantissa.
    Bf16,
    /// IEEE half precision (float16): a 5-bit exponent, an 11-bit mantissa.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
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
    /// The mutable slice itself when the type is bf16.
    fn as_bf16_mut(slice: &mut [Self]) -> Option<&mut [bf16]>;
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
    fn as_bf16_mut(_: &mut [Self]) -> Option<&mut [bf16]> {
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
        bf16::from_bits(bf16_bits(x))
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
    fn as_bf16_mut(slice: &mut [Self]) -> Option<&mut [bf16]> {
        Some(slice)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    fn as_bf16(_: &[Self]) -> Option<&[bf16]> {
        None
    }
    fn as_bf16_mut(_: &mut [Self]) -> Option<&mut [bf16]> {
        None
    }
}
