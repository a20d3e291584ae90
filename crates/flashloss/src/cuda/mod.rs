//! The CUDA backend (feature `cuda`): the same losses on an NVIDIA GPU through `cudarc`,
//! with every CUDA library loaded at run time (the crate builds on a machine without
//! CUDA; without a driver, [`Gpu::new`] returns an error, never a panic).
//!
//! Kernels are CUDA C++ kept in `cuda/kernels/*.cu`, embedded with `include_str!` and
//! compiled once per process by NVRTC for the device's architecture ([`kernels`]). The
//! O(N) policy stage runs on the host with the CPU backend's code, between the device
//! passes over the logits, so the math is written once. Every device allocation goes
//! through [`Gpu`], which counts bytes in use and the peak ([`DeviceMemory`]).

mod device;
mod grpo_logits;
pub mod kernels;

pub use device::{DeviceBuffer, DeviceMemory, Gpu, GpuElement, driver_present};
pub use grpo_logits::{grpo_logits_backward, grpo_logits_forward};
