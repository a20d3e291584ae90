//! How an LM head's weight `W` lies in memory. The logits are `z_ij = Σ_k H_ik·W_jk`
//! (`j` a vocabulary entry, `k` a hidden unit) whichever way `W` is stored: `[V, H]`
//! (PyTorch's `nn.Linear`, a tied embedding: entry `(j, k)` at `j·H + k`) or `[H, V]`
//! (a Flax kernel, `'BTD,DV->BTV'`: entry `(j, k)` at `k·V + j`). A vocabulary tile is
//! a block of rows of the first and a block of columns (rows `V` apart) of the second,
//! so every product of a fused step is the same product on views with the strides
//! swapped; no transposed copy is made. `dW` is written in the weight's own layout.

use crate::error::{Error, Result};

/// How an LM head's weight (and its gradient `dW`) lies in memory, both row-major.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum WeightLayout {
    /// `[V, H]`: one row per vocabulary entry (`"vh"`).
    #[default]
    VocabMajor,
    /// `[H, V]`: one column per vocabulary entry (`"hv"`).
    HiddenMajor,
}

impl WeightLayout {
    /// The layout of a name: `"vh"` (`[V, H]`) or `"hv"` (`[H, V]`).
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "vh" => Ok(WeightLayout::VocabMajor),
            "hv" => Ok(WeightLayout::HiddenMajor),
            _ => Err(Error::InvalidArgument {
                arg: "weight_layout",
                reason: format!("{name:?} is not one of \"vh\" ([V, H]) or \"hv\" ([H, V])"),
            }),
        }
    }

    /// Its name, `"vh"` or `"hv"`.
    pub fn name(self) -> &'static str {
        match self {
            WeightLayout::VocabMajor => "vh",
            WeightLayout::HiddenMajor => "hv",
        }
    }

    /// Elements between vocabulary entries and between hidden units of a `v × h`
    /// weight: `(h, 1)` for `[V, H]`, `(1, v)` for `[H, V]`.
    pub fn strides(self, v: usize, h: usize) -> (usize, usize) {
        match self {
            WeightLayout::VocabMajor => (h, 1),
            WeightLayout::HiddenMajor => (1, v),
        }
    }

    /// Where entry `(j, k)` (vocabulary entry `j`, hidden unit `k`) of a `v × h` weight
    /// lies.
    pub fn index(self, j: usize, k: usize, v: usize, h: usize) -> usize {
        let (sv, sh) = self.strides(v, h);
        j * sv + k * sh
    }

    /// `(V, H)` of a weight of dimensions `dims` in this layout.
    pub fn vocab_hidden(self, [rows, cols]: [usize; 2]) -> (usize, usize) {
        match self {
            WeightLayout::VocabMajor => (rows, cols),
            WeightLayout::HiddenMajor => (cols, rows),
        }
    }

    /// The shape of a `v × h` weight as errors name it: `[V=v, H=h]` or `[H=h, V=v]`.
    pub fn shape(self, v: usize, h: usize) -> String {
        match self {
            WeightLayout::VocabMajor => format!("[V={v}, H={h}]"),
            WeightLayout::HiddenMajor => format!("[H={h}, V={v}]"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WeightLayout;

    #[test]
    fn names_strides_and_shapes_agree() {
        for layout in [WeightLayout::VocabMajor, WeightLayout::HiddenMajor] {
            assert_eq!(WeightLayout::from_name(layout.name()).ok(), Some(layout));
            let (v, h) = (5, 3);
            let dims = match layout {
                WeightLayout::VocabMajor => [v, h],
                WeightLayout::HiddenMajor => [h, v],
            };
            assert_eq!(layout.vocab_hidden(dims), (v, h));
            // Row-major in `dims`: every entry once.
            let mut seen: Vec<usize> = (0..v)
                .flat_map(|j| (0..h).map(move |k| layout.index(j, k, v, h)))
                .collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..v * h).collect::<Vec<_>>());
        }
        assert_eq!(WeightLayout::HiddenMajor.index(2, 1, 5, 3), 7);
        assert!(WeightLayout::from_name("VH").is_err());
    }
}
