//! The f64 reference: the spec written as plainly as possible. It materializes the
//! log-softmax, writes the loss literally (generic over [`dual::Num`]) and takes exact
//! derivatives with dual numbers. It is the oracle of every test; it is checked itself
//! against central finite differences (tests/reference_fd.rs).

mod cross_entropy;
pub mod dual;
mod grpo;
mod logp;
mod softmax;
mod support;

pub use cross_entropy::{CeReference, ce_reference, ce_reference_lse};
pub use grpo::{GrpoReference, grpo_reference, grpo_reference_loss, grpo_reference_per_token};
pub use logp::{LogpRefRows, LogpRefUpstream, LogpReference, logp_reference};
pub use softmax::{RowSoftmax, row_softmax};
pub use support::{SupportRow, support_row};

use crate::batch::{LinearInputs, LogitsLayout};
use crate::element::Element;

/// Copies the rows of a strided logits buffer into a dense f64 `[N, V]` matrix.
pub fn dense_f64<E: Element>(data: &[E], layout: &LogitsLayout) -> Vec<f64> {
    let mut out = Vec::with_capacity(layout.rows() * layout.vocab);
    for row in 0..layout.rows() {
        let start = layout.offset(row);
        out.extend(
            data[start..start + layout.vocab]
                .iter()
                .map(|x| x.to_f32() as f64),
        );
    }
    out
}

/// Dense f64 logits `z_ij = Σ_k hidden_ik·W_jk + bias_j` `[N, V]` of an LM head (its
/// weight in either layout).
pub fn linear_logits<E: Element>(inputs: &LinearInputs<E>) -> Vec<f64> {
    let (n, h, v) = (inputs.tokens, inputs.hidden_size, inputs.vocab);
    let at = |j: usize, k: usize| inputs.layout.index(j, k, v, h);
    let hid: Vec<f64> = inputs.hidden.iter().map(|x| x.to_f32() as f64).collect();
    let w: Vec<f64> = inputs.weight.iter().map(|x| x.to_f32() as f64).collect();
    let mut z = vec![0.0; n * v];
    for i in 0..n {
        for j in 0..v {
            let dot: f64 = (0..h).map(|k| hid[i * h + k] * w[at(j, k)]).sum();
            z[i * v + j] = dot + inputs.bias.map_or(0.0, |b| b[j].to_f32() as f64);
        }
    }
    z
}

/// The LM head's gradients from dense `dlogits` `[N, V]`: `dH = dZ·W` `[N, H]`,
/// `dW = dZᵀ·H` (`[V, H]` or `[H, V]`, as the weight), `dbias = Σ_rows dZ` `[V]`.
pub fn linear_grads<E: Element>(
    inputs: &LinearInputs<E>,
    dlogits: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (n, h, v) = (inputs.tokens, inputs.hidden_size, inputs.vocab);
    let at = |j: usize, k: usize| inputs.layout.index(j, k, v, h);
    let hid: Vec<f64> = inputs.hidden.iter().map(|x| x.to_f32() as f64).collect();
    let w: Vec<f64> = inputs.weight.iter().map(|x| x.to_f32() as f64).collect();
    let mut dh = vec![0.0; n * h];
    let mut dw = vec![0.0; v * h];
    let mut db = vec![0.0; v];
    for i in 0..n {
        for j in 0..v {
            let g = dlogits[i * v + j];
            if g == 0.0 {
                continue;
            }
            db[j] += g;
            for k in 0..h {
                dh[i * h + k] += g * w[at(j, k)];
                dw[at(j, k)] += g * hid[i * h + k];
            }
        }
    }
    (dh, dw, db)
}
