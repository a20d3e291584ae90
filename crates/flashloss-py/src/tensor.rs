//! A PyTorch tensor seen from Rust without linking libtorch: its dtype, shape, device
//! and data pointer are read through its Python attributes, and its memory is borrowed
//! as a slice (no copy). Every check names the argument, so a bad tensor becomes a
//! `ValueError` such as "argument `weight`: expected dtype float32 or bfloat16, got
//! torch.float16".

use half::{bf16, f16};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A `ValueError` about argument `arg`.
pub fn arg_error(arg: &str, reason: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("argument `{arg}`: {reason}"))
}

/// The element types the kernels read and write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    Bf16,
    F16,
    I64,
    Bool,
}

impl DType {
    fn parse(name: &str) -> Option<DType> {
        match name {
            "torch.float32" => Some(DType::F32),
            "torch.bfloat16" => Some(DType::Bf16),
            "torch.float16" => Some(DType::F16),
            "torch.int64" => Some(DType::I64),
            "torch.bool" => Some(DType::Bool),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::Bf16 => "bfloat16",
            DType::F16 => "float16",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }
}

/// A contiguous tensor borrowed from Python for the length of one call: on the CPU, or
/// (in a build with the `cuda` feature) on a GPU.
pub struct Tensor<'py> {
    /// The argument's name, for errors.
    pub arg: &'static str,
    /// Its element type.
    pub dtype: DType,
    /// Its sizes.
    pub shape: Vec<usize>,
    /// `None` on the CPU, else the CUDA device's ordinal.
    pub cuda: Option<usize>,
    ptr: usize,
    /// Keeps the Python object (and so its storage) alive while the slice is in use.
    _owner: Bound<'py, PyAny>,
}

impl<'py> Tensor<'py> {
    /// Reads `obj` (a `torch.Tensor`) as argument `arg`: it must be contiguous, on the
    /// CPU (or a GPU, in a build with the `cuda` feature), and of one of `allowed` dtypes.
    pub fn new(arg: &'static str, obj: &Bound<'py, PyAny>, allowed: &[DType]) -> PyResult<Self> {
        let not_tensor = |_| arg_error(arg, "expected a torch.Tensor");
        let dtype_name: String = obj.getattr("dtype").map_err(not_tensor)?.str()?.extract()?;
        let device = obj.getattr("device")?;
        let kind: String = device.getattr("type")?.extract()?;
        let cuda = match kind.as_str() {
            "cpu" => None,
            "cuda" if cfg!(feature = "cuda") => Some(
                device
                    .getattr("index")?
                    .extract::<Option<usize>>()?
                    .unwrap_or(0),
            ),
            _ => {
                return Err(arg_error(
                    arg,
                    format!(
                        "is on {kind}; this build of flashloss runs CPU tensors (CUDA tensors need the build with the `cuda` feature)"
                    ),
                ));
            }
        };
        let dtype = DType::parse(&dtype_name)
            .filter(|d| allowed.contains(d))
            .ok_or_else(|| {
                let names: Vec<_> = allowed.iter().map(|d| d.name()).collect();
                arg_error(
                    arg,
                    format!("expected dtype {}, got {dtype_name}", names.join(" or ")),
                )
            })?;
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(arg_error(arg, "must be contiguous (call .contiguous())"));
        }
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        Ok(Tensor {
            arg,
            dtype,
            shape,
            cuda,
            ptr,
            _owner: obj.clone(),
        })
    }

    /// [`Tensor::new`] for an optional argument.
    pub fn optional(
        arg: &'static str,
        obj: Option<&Bound<'py, PyAny>>,
        allowed: &[DType],
    ) -> PyResult<Option<Self>> {
        obj.map(|o| Tensor::new(arg, o, allowed)).transpose()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Fails unless the shape is `expected`.
    pub fn expect_shape(&self, expected: &[usize]) -> PyResult<()> {
        if self.shape == expected {
            Ok(())
        } else {
            Err(arg_error(
                self.arg,
                format!("expected shape {expected:?}, got {:?}", self.shape),
            ))
        }
    }

    /// The device address of a GPU tensor's first element.
    #[cfg(feature = "cuda")]
    pub fn device_ptr(&self) -> u64 {
        self.ptr as u64
    }

    fn slice_of<T>(&self, dtype: DType) -> PyResult<&[T]> {
        if let Some(ordinal) = self.cuda {
            return Err(arg_error(
                self.arg,
                format!("is on cuda:{ordinal}; expected a CPU tensor here"),
            ));
        }
        if self.dtype != dtype {
            return Err(arg_error(
                self.arg,
                format!("expected dtype {}, got {}", dtype.name(), self.dtype.name()),
            ));
        }
        if self.numel() == 0 {
            return Ok(&[]);
        }
        // SAFETY: the tensor is contiguous, on the CPU, of this element type (checked in
        // `new` and above), holds `numel` elements from `data_ptr`, and is kept alive by
        // `_owner` for as long as `self` borrows it.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.numel()) })
    }

    /// The elements as f32.
    pub fn f32s(&self) -> PyResult<&[f32]> {
        self.slice_of(DType::F32)
    }

    /// The elements as bf16.
    pub fn bf16s(&self) -> PyResult<&[bf16]> {
        self.slice_of(DType::Bf16)
    }

    /// The elements as f16.
    pub fn f16s(&self) -> PyResult<&[f16]> {
        self.slice_of(DType::F16)
    }

    /// The elements as i64.
    pub fn i64s(&self) -> PyResult<&[i64]> {
        self.slice_of(DType::I64)
    }

    /// A bool tensor's elements (PyTorch stores them as bytes 0 and 1).
    pub fn bools(&self) -> PyResult<Vec<bool>> {
        let bytes: &[u8] = self.slice_of(DType::Bool)?;
        Ok(bytes.iter().map(|&b| b != 0).collect())
    }

    /// The elements as f32, for writing.
    ///
    /// # Safety
    /// The caller must hold no other reference to this tensor's memory while the slice
    /// lives (the Python side passes freshly allocated output tensors).
    pub unsafe fn f32s_mut(&mut self) -> PyResult<&mut [f32]> {
        let s = self.f32s()?;
        // SAFETY: as in `slice_of`; exclusivity is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts_mut(s.as_ptr() as *mut f32, s.len()) })
    }

    /// The elements as bf16, for writing (see [`Tensor::f32s_mut`]).
    ///
    /// # Safety
    /// As [`Tensor::f32s_mut`].
    pub unsafe fn bf16s_mut(&mut self) -> PyResult<&mut [bf16]> {
        let s = self.bf16s()?;
        // SAFETY: as in `slice_of`; exclusivity is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts_mut(s.as_ptr() as *mut bf16, s.len()) })
    }

    /// The elements as f16, for writing (see [`Tensor::f32s_mut`]).
    ///
    /// # Safety
    /// As [`Tensor::f32s_mut`].
    pub unsafe fn f16s_mut(&mut self) -> PyResult<&mut [f16]> {
        let s = self.f16s()?;
        // SAFETY: as in `slice_of`; exclusivity is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts_mut(s.as_ptr() as *mut f16, s.len()) })
    }
}
