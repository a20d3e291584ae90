//! The f64 reference: the spec written as plainly as possible. It materializes the
//! log-softmax, writes the loss literally (generic over [`dual::Num`]) and takes exact
//! derivatives with dual numbers. It is the oracle of every test; it is checked itself
//! against central finite differences (tests/reference_fd.rs).

pub mod dual;
mod grpo;
mod softmax;

pub use grpo::{GrpoReference, grpo_reference};
pub use softmax::{RowSoftmax, row_softmax};

use crate::batch::LogitsLayout;
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
