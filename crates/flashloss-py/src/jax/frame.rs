//! Reading an XLA FFI call frame: the metadata probe, arguments and results as typed
//! slices checked against the dtype and shape the handler expects (errors name the
//! argument), attributes by name, and errors returned through `XLA_FFI_Error_Create`.
//! A panic never crosses the C boundary: [`handle`] catches it.

use super::ffi::{self, Buffer, CallFrame, dtype};
use std::ffi::{CString, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// A handler's error: the message (naming the argument) and whether it is the caller's.
pub struct HandlerError {
    pub message: String,
    pub internal: bool,
}

impl From<flashloss::Error> for HandlerError {
    fn from(e: flashloss::Error) -> Self {
        HandlerError {
            message: e.to_string(),
            internal: false,
        }
    }
}

impl From<crate::spec::ArgError> for HandlerError {
    fn from(e: crate::spec::ArgError) -> Self {
        bad(&e.arg, e.reason)
    }
}

/// An error naming `arg`.
pub fn bad(arg: &str, reason: impl std::fmt::Display) -> HandlerError {
    HandlerError {
        message: format!("argument `{arg}`: {reason}"),
        internal: false,
    }
}

pub type Result<T> = std::result::Result<T, HandlerError>;

/// Runs `body` on `frame`: answers the metadata probe, runs only the execute stage,
/// and turns an error or a panic into an `XLA_FFI_Error`.
///
/// # Safety
/// `frame` is the call frame XLA passes to a handler.
pub unsafe fn handle(
    frame: *mut CallFrame,
    body: impl FnOnce(&Frame) -> Result<()>,
) -> *mut c_void {
    // SAFETY: XLA passes a valid frame; the probe is answered before anything else.
    let frame = unsafe { &*frame };
    if unsafe { probe(frame) } {
        return std::ptr::null_mut();
    }
    if frame.stage != ffi::STAGE_EXECUTE {
        return std::ptr::null_mut();
    }
    let out = catch_unwind(AssertUnwindSafe(|| body(&Frame(frame))));
    let err = match out {
        Ok(Ok(())) => return std::ptr::null_mut(),
        // The core's argument names as the caller's (the spec's `names`).
        Ok(Err(e)) => match Frame(frame).spec() {
            Ok(spec) => HandlerError {
                message: spec.reword(&e.message),
                ..e
            },
            Err(_) => e,
        },
        Err(panic) => HandlerError {
            message: format!(
                "flashloss internal error (please report it): {}",
                panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default()
            ),
            internal: true,
        },
    };
    // SAFETY: the API pointer of an execute-stage frame is set by XLA.
    unsafe { create_error(frame, &err) }
}

/// Writes the API version into the metadata extension of a probe call.
unsafe fn probe(frame: &CallFrame) -> bool {
    let ext = frame.extension_start;
    // SAFETY: XLA's extension chain; the metadata extension carries a metadata pointer.
    unsafe {
        if ext.is_null() || (*ext).kind != ffi::EXTENSION_METADATA {
            return false;
        }
        let meta = (*(ext as *mut ffi::MetadataExtension)).metadata;
        (*meta).api_version.major_version = ffi::API_VERSION.0;
        (*meta).api_version.minor_version = ffi::API_VERSION.1;
        (*meta).traits = 0;
    }
    true
}

unsafe fn create_error(frame: &CallFrame, err: &HandlerError) -> *mut c_void {
    let message = CString::new(err.message.replace('\0', " ")).expect("no NUL left");
    let mut args = ffi::ErrorCreateArgs {
        struct_size: std::mem::size_of::<ffi::ErrorCreateArgs>(),
        extension_start: std::ptr::null_mut(),
        message: message.as_ptr(),
        errc: if err.internal {
            ffi::ERROR_INTERNAL
        } else {
            ffi::ERROR_INVALID_ARGUMENT
        },
    };
    // SAFETY: XLA copies the message; `args` lives for the call.
    unsafe {
        match (*frame.api).error_create {
            Some(create) => create(&mut args),
            None => std::ptr::null_mut(),
        }
    }
}

/// A call frame being read.
pub struct Frame<'a>(&'a CallFrame);

/// A buffer with the name of the argument or result it is.
pub struct Named<'a> {
    pub name: &'static str,
    buf: &'a Buffer,
}

impl<'a> Frame<'a> {
    /// A frame over `frame` (the CUDA handlers read a staged copy of XLA's).
    #[cfg(feature = "cuda")]
    pub fn new(frame: &'a CallFrame) -> Self {
        Frame(frame)
    }

    /// The call frame itself.
    #[cfg(feature = "cuda")]
    pub fn raw(&self) -> &'a CallFrame {
        self.0
    }

    /// Argument `i`, called `name` in errors.
    pub fn arg(&self, i: usize, name: &'static str) -> Result<Named<'a>> {
        let a = &self.0.args;
        if i >= a.size as usize {
            return Err(bad(
                name,
                format!("missing (the call has {} arguments)", a.size),
            ));
        }
        // SAFETY: `i < size`; every argument is a buffer (the only argument type).
        let buf = unsafe { &*(*a.args.add(i) as *const Buffer) };
        Ok(Named { name, buf })
    }

    /// Result `i`, called `name` in errors.
    pub fn ret(&self, i: usize, name: &'static str) -> Result<Named<'a>> {
        let r = &self.0.rets;
        if i >= r.size as usize {
            return Err(bad(
                name,
                format!("missing (the call has {} results)", r.size),
            ));
        }
        // SAFETY: `i < size`; every result is a buffer.
        let buf = unsafe { &*(*r.rets.add(i) as *const Buffer) };
        Ok(Named { name, buf })
    }

    fn attr(&self, name: &str, kind: i32) -> Result<*mut c_void> {
        let a = &self.0.attrs;
        for i in 0..a.size as usize {
            // SAFETY: `i < size`; names are byte spans.
            let (span, t) = unsafe { (&**a.names.add(i), *a.types.add(i)) };
            // SAFETY: a span of `len` bytes.
            let key = unsafe { std::slice::from_raw_parts(span.ptr as *const u8, span.len) };
            if key == name.as_bytes() {
                if t != kind {
                    return Err(bad(name, "has the wrong attribute type"));
                }
                // SAFETY: `i < size`.
                return Ok(unsafe { *a.attrs.add(i) });
            }
        }
        Err(bad(name, "missing attribute"))
    }

    /// The call's spec: the attribute `spec`, parsed (see [`crate::spec::Spec`]).
    pub fn spec(&self) -> Result<crate::spec::Spec> {
        Ok(crate::spec::Spec::parse(self.attr_str("spec")?)?)
    }

    /// A string attribute (a byte span, not NUL-terminated).
    pub fn attr_str(&self, name: &str) -> Result<&'a str> {
        let p = self.attr(name, ffi::ATTR_STRING)? as *const ffi::ByteSpan;
        // SAFETY: a string attribute is a byte span.
        let bytes = unsafe { std::slice::from_raw_parts((*p).ptr as *const u8, (*p).len) };
        std::str::from_utf8(bytes).map_err(|e| bad(name, e))
    }
}

impl<'a> Named<'a> {
    /// The dimensions.
    pub fn dims(&self) -> &'a [i64] {
        let rank = self.buf.rank.max(0) as usize;
        if rank == 0 {
            return &[];
        }
        // SAFETY: `rank` dimensions.
        unsafe { std::slice::from_raw_parts(self.buf.dims, rank) }
    }

    /// Elements in all.
    pub fn numel(&self) -> usize {
        self.dims().iter().map(|&d| d.max(0) as usize).product()
    }

    /// The XLA dtype.
    pub fn dtype(&self) -> i32 {
        self.buf.dtype
    }

    /// The buffer's address (a device address in a CUDA handler).
    #[cfg(feature = "cuda")]
    pub fn address(&self) -> u64 {
        self.buf.data as u64
    }

    fn check(&self, want: i32, what: &str) -> Result<()> {
        if self.buf.dtype != want {
            return Err(bad(
                self.name,
                format!("expected dtype {what}, got XLA dtype {}", self.buf.dtype),
            ));
        }
        Ok(())
    }

    /// Checks the shape.
    pub fn expect_dims(&self, want: &[usize]) -> Result<()> {
        let got: Vec<usize> = self.dims().iter().map(|&d| d as usize).collect();
        if got != want {
            return Err(bad(
                self.name,
                format!("expected shape {want:?}, got {got:?}"),
            ));
        }
        Ok(())
    }

    /// The elements, of XLA dtype `want` (`T` of its width).
    ///
    /// # Safety
    /// `T` must be the element type of `want`.
    pub unsafe fn slice<T>(&self, want: i32, what: &str) -> Result<&'a [T]> {
        self.check(want, what)?;
        let n = self.numel();
        if n == 0 {
            return Ok(&[]);
        }
        // SAFETY: a buffer of `n` elements of this dtype, alive for the call.
        Ok(unsafe { std::slice::from_raw_parts(self.buf.data as *const T, n) })
    }

    /// A result's elements, for writing.
    ///
    /// # Safety
    /// As [`Named::slice`]; the buffer is a result, written by this handler only.
    pub unsafe fn slice_mut<T>(&self, want: i32, what: &str) -> Result<&'a mut [T]> {
        self.check(want, what)?;
        let n = self.numel();
        if n == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as above; results do not alias arguments.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.buf.data as *mut T, n) })
    }

    /// f32 elements.
    pub fn f32s(&self) -> Result<&'a [f32]> {
        // SAFETY: f32 is F32's element type.
        unsafe { self.slice(dtype::F32, "float32") }
    }

    /// f32 elements of a result, for writing.
    pub fn f32s_mut(&self) -> Result<&'a mut [f32]> {
        // SAFETY: f32 is F32's element type.
        unsafe { self.slice_mut(dtype::F32, "float32") }
    }

    /// Integer ids (int32 or int64) as i64.
    pub fn ids(&self) -> Result<Vec<i64>> {
        // SAFETY: the element types of S32 and S64.
        match self.buf.dtype {
            dtype::S32 => Ok(unsafe { self.slice::<i32>(dtype::S32, "int32")? }
                .iter()
                .map(|&x| x as i64)
                .collect()),
            _ => Ok(unsafe { self.slice::<i64>(dtype::S64, "int32 or int64")? }.to_vec()),
        }
    }

    /// A bool mask.
    pub fn bools(&self) -> Result<Vec<bool>> {
        // SAFETY: PRED is one byte per element.
        let bytes: &[u8] = unsafe { self.slice(dtype::PRED, "bool")? };
        Ok(bytes.iter().map(|&b| b != 0).collect())
    }
}
