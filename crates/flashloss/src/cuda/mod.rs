//! The CUDA backend (feature `cuda`): the same losses on an NVIDIA GPU through `cudarc`,
//! with every CUDA library loaded at run time (the crate builds on a machine without
//! CUDA; without a driver, [`Gpu::new`] returns an error, never a panic).
//!
//! Kernels are CUDA C++ kept in `cuda/kernels/*.cu`, embedded with `include_str!` and
//! compiled once per process by NVRTC for the device's architecture ([`kernels`]); tile
//! products go through cuBLAS. The O(N) per-row stages (policy, CE rows) run on the
//! host with the CPU backend's code, between the device passes over the logits, so the
//! math is written once. Every device allocation goes through [`Gpu`], which counts
//! bytes in use and the peak ([`DeviceMemory`]).

mod ce_linear;
mod device;
mod fused_linear;
mod grpo_linear;
mod grpo_logits;
pub mod kernels;
mod selective_log_softmax;

pub use ce_linear::{ce_linear_into, ce_linear_planned};
pub use device::{DeviceBuffer, DeviceMemory, Gpu, GpuElement, driver_present};
pub use fused_linear::{
    CUBLAS_WORKSPACE_BYTES, GemmShape, GpuGrads, GpuHead, GpuWorkspace, head_logits,
    materialized_plan, plan,
};
pub use grpo_linear::{grpo_linear_into, grpo_linear_planned};
pub use grpo_logits::{grpo_logits_backward, grpo_logits_forward};
pub use selective_log_softmax::selective_log_softmax;
