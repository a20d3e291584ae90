//! A `#[repr(C)]` mirror of the parts of XLA's FFI C API (`xla/ffi/api/c_api.h`, API
//! version 0.3, as jaxlib ships it) that a stateless handler uses: the call frame, its
//! buffers and attributes, the metadata probe and `XLA_FFI_Error_Create`. Sizes and
//! offsets are checked against the installed header by the test suite
//! (`tests/test_jax_abi.py` compiles the header with `cc` and compares with [`layout`]).

use std::ffi::{c_char, c_void};
use std::mem::{offset_of, size_of};

/// The API version this mirror follows (`XLA_FFI_API_MAJOR`, `XLA_FFI_API_MINOR`).
pub const API_VERSION: (i32, i32) = (0, 3);

/// `XLA_FFI_Extension_Type`: the metadata probe.
pub const EXTENSION_METADATA: i32 = 1;
/// `XLA_FFI_ExecutionStage_EXECUTE`.
pub const STAGE_EXECUTE: i32 = 3;
pub const ATTR_STRING: i32 = 4;
/// `XLA_FFI_Error_Code_INVALID_ARGUMENT` and `_INTERNAL`.
pub const ERROR_INVALID_ARGUMENT: i32 = 3;
pub const ERROR_INTERNAL: i32 = 13;

/// `XLA_FFI_DataType` values the handlers read.
pub mod dtype {
    pub const PRED: i32 = 1;
    pub const S32: i32 = 4;
    pub const S64: i32 = 5;
    pub const F16: i32 = 10;
    pub const F32: i32 = 11;
    pub const BF16: i32 = 16;
}

#[repr(C)]
pub struct ExtensionBase {
    pub struct_size: usize,
    pub kind: i32,
    pub next: *mut ExtensionBase,
}

#[repr(C)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub major_version: i32,
    pub minor_version: i32,
}

#[repr(C)]
pub struct Metadata {
    pub struct_size: usize,
    pub api_version: ApiVersion,
    pub traits: u32,
    pub state_type_id: i64,
}

#[repr(C)]
pub struct MetadataExtension {
    pub extension_base: ExtensionBase,
    pub metadata: *mut Metadata,
}

#[repr(C)]
pub struct ErrorCreateArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub message: *const c_char,
    pub errc: i32,
}

/// The first fields of `XLA_FFI_Api`, up to the functions used (`Error_Create`, and
/// `Stream_Get` for the CUDA handlers).
#[repr(C)]
pub struct Api {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api_version: ApiVersion,
    pub internal_api: *const c_void,
    pub error_create: Option<unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void>,
    pub error_get_message: *const c_void,
    pub error_destroy: *const c_void,
    pub handler_register: *const c_void,
    pub stream_get: Option<unsafe extern "C" fn(*mut StreamGetArgs) -> *mut c_void>,
}

/// `XLA_FFI_Stream_Get_Args`: the call's platform stream (a `CUstream` on CUDA).
#[repr(C)]
pub struct StreamGetArgs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub ctx: *mut c_void,
    pub stream: *mut c_void,
}

#[repr(C)]
pub struct Buffer {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub dtype: i32,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *const i64,
}

#[repr(C)]
pub struct Args {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *const i32,
    pub args: *const *mut c_void,
}

#[repr(C)]
pub struct Rets {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *const i32,
    pub rets: *const *mut c_void,
}

#[repr(C)]
pub struct Attrs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *const i32,
    pub names: *const *const ByteSpan,
    pub attrs: *const *mut c_void,
}

#[repr(C)]
pub struct CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub api: *const Api,
    pub ctx: *mut c_void,
    pub stage: i32,
    pub args: Args,
    pub rets: Rets,
    pub attrs: Attrs,
    pub future: *mut c_void,
}

#[repr(C)]
pub struct ByteSpan {
    pub ptr: *const c_char,
    pub len: usize,
}

#[repr(C)]
pub struct Scalar {
    pub dtype: i32,
    pub value: *mut c_void,
}

/// A handler: `XLA_FFI_Error* (*)(XLA_FFI_CallFrame*)`, null on success.
pub type Handler = unsafe extern "C" fn(*mut CallFrame) -> *mut c_void;

/// A mirrored struct's C name, size and `(field, offset)`s.
pub type StructLayout = (&'static str, usize, Vec<(&'static str, usize)>);

/// The layout of every mirrored struct, for the ABI test.
pub fn layout() -> Vec<StructLayout> {
    vec![
        (
            "XLA_FFI_Buffer",
            size_of::<Buffer>(),
            vec![
                ("dtype", offset_of!(Buffer, dtype)),
                ("data", offset_of!(Buffer, data)),
                ("rank", offset_of!(Buffer, rank)),
                ("dims", offset_of!(Buffer, dims)),
            ],
        ),
        (
            "XLA_FFI_Args",
            size_of::<Args>(),
            vec![
                ("size", offset_of!(Args, size)),
                ("types", offset_of!(Args, types)),
                ("args", offset_of!(Args, args)),
            ],
        ),
        (
            "XLA_FFI_Rets",
            size_of::<Rets>(),
            vec![
                ("size", offset_of!(Rets, size)),
                ("rets", offset_of!(Rets, rets)),
            ],
        ),
        (
            "XLA_FFI_Attrs",
            size_of::<Attrs>(),
            vec![
                ("size", offset_of!(Attrs, size)),
                ("types", offset_of!(Attrs, types)),
                ("names", offset_of!(Attrs, names)),
                ("attrs", offset_of!(Attrs, attrs)),
            ],
        ),
        (
            "XLA_FFI_CallFrame",
            size_of::<CallFrame>(),
            vec![
                ("api", offset_of!(CallFrame, api)),
                ("ctx", offset_of!(CallFrame, ctx)),
                ("stage", offset_of!(CallFrame, stage)),
                ("args", offset_of!(CallFrame, args)),
                ("rets", offset_of!(CallFrame, rets)),
                ("attrs", offset_of!(CallFrame, attrs)),
                ("future", offset_of!(CallFrame, future)),
            ],
        ),
        (
            "XLA_FFI_Api",
            // Only a prefix is mirrored: its size is not the header's.
            0,
            vec![
                ("XLA_FFI_Error_Create", offset_of!(Api, error_create)),
                ("XLA_FFI_Stream_Get", offset_of!(Api, stream_get)),
            ],
        ),
        (
            "XLA_FFI_Stream_Get_Args",
            size_of::<StreamGetArgs>(),
            vec![
                ("ctx", offset_of!(StreamGetArgs, ctx)),
                ("stream", offset_of!(StreamGetArgs, stream)),
            ],
        ),
        (
            "XLA_FFI_Error_Create_Args",
            size_of::<ErrorCreateArgs>(),
            vec![
                ("message", offset_of!(ErrorCreateArgs, message)),
                ("errc", offset_of!(ErrorCreateArgs, errc)),
            ],
        ),
        (
            "XLA_FFI_Metadata",
            size_of::<Metadata>(),
            vec![
                ("api_version", offset_of!(Metadata, api_version)),
                ("traits", offset_of!(Metadata, traits)),
                ("state_type_id", offset_of!(Metadata, state_type_id)),
            ],
        ),
        (
            "XLA_FFI_Metadata_Extension",
            size_of::<MetadataExtension>(),
            vec![("metadata", offset_of!(MetadataExtension, metadata))],
        ),
        (
            "XLA_FFI_Extension_Base",
            size_of::<ExtensionBase>(),
            vec![
                ("type", offset_of!(ExtensionBase, kind)),
                ("next", offset_of!(ExtensionBase, next)),
            ],
        ),
        (
            "XLA_FFI_ByteSpan",
            size_of::<ByteSpan>(),
            vec![("len", offset_of!(ByteSpan, len))],
        ),
        (
            "XLA_FFI_Scalar",
            size_of::<Scalar>(),
            vec![("value", offset_of!(Scalar, value))],
        ),
    ]
}
