//! The keys of the strict total order `(s_j, j)` of a row's scaled logits
//! (docs/spec/losses.md, flashloss addition 12), a leaf: what a truncated support's cut
//! and every backend's comparison with it are written in.
//!
//! A key is `ord(s) << 32 | j` with `ord` the monotone u32 image of the f32 scaled logit
//! `s = fl(z·(1/T)) + 0` (`-0` made `+0`, so equal values have equal `ord`): keys compare
//! as `(s, j)` lexicographically, and a support is `{j : key_j ≥ cut}`.

/// The scaled logit that decides the support: `fl(z·inv_temp)`, `-0` as `+0`.
#[inline(always)]
pub(crate) fn scaled(z: f32, inv_temp: f32) -> f32 {
    z * inv_temp + 0.0
}

/// The key of entry `j` of scaled logit `s` (see the module header).
#[inline(always)]
pub(crate) fn order_key(s: f32, j: usize) -> u64 {
    let bits = s.to_bits();
    let ord = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    };
    (u64::from(ord) << 32) | j as u64
}

/// The key of entry `j` of raw logit `z` (before `1/T`): what a backend compares with a
/// [`crate::fused::SupportTerm`]'s cut.
#[inline(always)]
pub fn support_key(z: f32, inv_temp: f32, j: usize) -> u64 {
    order_key(scaled(z, inv_temp), j)
}

/// The scaled logit of `key`.
pub(crate) fn key_value(key: u64) -> f32 {
    let ord = (key >> 32) as u32;
    f32::from_bits(if ord >> 31 == 1 {
        ord & !(1 << 31)
    } else {
        !ord
    })
}

/// The smallest key of value `s` (every entry of value `≥ s` has a key `≥` it).
pub(crate) fn value_floor(s: f32) -> u64 {
    order_key(s, 0)
}

/// `exp(s - s_max)` in f64: an entry's mass relative to the row's largest.
#[inline(always)]
pub(crate) fn rel_mass(s: f32, s_max: f32) -> f64 {
    (s as f64 - s_max as f64).exp()
}
