//! The CUDA backend (feature `cuda`): the same losses on an NVIDIA GPU through `cudarc`,
//! with every CUDA library loaded at run time (the crate builds on a machine without
//! CUDA; without a driver, [`Gpu::new`] returns an error, never a panic).
//!
//! Kernels are CUDA C++ kept in `cuda/kernels/*.cu`, embedded with `include_str!` and
//! compiled once per process by NVRTC for the device's architecture ([`kernels`]); tile
//! products go through cuBLAS ([`blas`]). [`CudaHead`] is the backend's
//! [`crate::fused::Head`]: the backend-neutral drivers run the O(N) per-row stages
//! (policy, CE rows) on the host between the device passes, so each loss is written
//! once. Every device allocation goes through [`Gpu`], which counts bytes in use and
//! the peak ([`DeviceMemory`]).

pub mod blas;
mod candidates;
mod cuda_head;
mod device;
mod front;
mod grpo_logits;
mod head;
pub mod kernels;
mod launch;
mod memory;
mod nccl;
mod passes;
mod plan;
mod row_spans;
mod selective_log_softmax;
mod support;
mod watchdog;

pub use blas::{CUBLAS_WORKSPACE_BYTES, GemmShape};
pub use cuda_head::CudaHead;
pub use device::{Gpu, GpuElement, Scan, driver_present};
pub use front::BorrowedHead;
pub(crate) use front::{grpo_logits_host, run_on_borrowed, run_on_host_buffers};
pub use grpo_logits::{grpo_logits_backward, grpo_logits_forward};
pub use head::{GpuGrads, GpuInputs, GpuWorkspace, head_logits};
pub use memory::{DeviceAllocator, DeviceBuffer, DeviceMemory, HostSyncs};
pub use nccl::{Nccl, nccl_present};
pub use plan::{materialized_plan, plan};
pub use selective_log_softmax::selective_log_softmax;
