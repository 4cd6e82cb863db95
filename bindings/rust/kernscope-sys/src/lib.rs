//! Raw declarations of the kernscope C ABI (`include/kernscope/kernscope.h`) and of the
//! DLPack 0.6 structs it takes (`dlpack/dlpack.h`), written by hand: no bindgen, no
//! external crates. Everything here is `unsafe` to call; the `kernscope` crate wraps it.
//!
//! Keep in step with the header: `scripts/check_abi_symbols.sh` fails when a `KS_API`
//! function has no `fn` here, and the layout tests below pin the struct sizes.
#![allow(non_camel_case_types, non_upper_case_globals)]

use std::os::raw::{c_char, c_int, c_void};

// ---- DLPack (dlpack.h, DLPACK_VERSION 60) ---------------------------------------------

/// `DLDeviceType` (a C enum: `int`-sized).
pub type DLDeviceType = c_int;
pub const kDLCPU: DLDeviceType = 1;
pub const kDLCUDA: DLDeviceType = 2;
pub const kDLCUDAHost: DLDeviceType = 3;
pub const kDLOpenCL: DLDeviceType = 4;
pub const kDLVulkan: DLDeviceType = 7;
pub const kDLMetal: DLDeviceType = 8;
pub const kDLVPI: DLDeviceType = 9;
pub const kDLROCM: DLDeviceType = 10;
pub const kDLROCMHost: DLDeviceType = 11;
pub const kDLExtDev: DLDeviceType = 12;
pub const kDLCUDAManaged: DLDeviceType = 13;

/// `DLDataTypeCode` values (stored in `DLDataType::code` as `u8`).
pub const kDLInt: u8 = 0;
pub const kDLUInt: u8 = 1;
pub const kDLFloat: u8 = 2;
pub const kDLOpaqueHandle: u8 = 3;
pub const kDLBfloat: u8 = 4;
pub const kDLComplex: u8 = 5;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDevice {
    pub device_type: DLDeviceType,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

// ---- kernscope.h ----------------------------------------------------------------------

pub const KS_VERSION_MAJOR: u32 = 0;
pub const KS_VERSION_MINOR: u32 = 1;
pub const KS_VERSION_PATCH: u32 = 0;

/// `ks_status_t` (a C enum: `int`-sized).
pub type ks_status_t = c_int;
pub const KS_SUCCESS: ks_status_t = 0;
pub const KS_ERROR_INVALID_ARGUMENT: ks_status_t = 1;
pub const KS_ERROR_UNSUPPORTED_DTYPE: ks_status_t = 2;
pub const KS_ERROR_UNSUPPORTED_DEVICE: ks_status_t = 3;
pub const KS_ERROR_BACKEND_UNAVAILABLE: ks_status_t = 4;
pub const KS_ERROR_CUDA: ks_status_t = 5;
pub const KS_ERROR_OUT_OF_MEMORY: ks_status_t = 6;
pub const KS_ERROR_INTERNAL: ks_status_t = 7;

/// `ks_backend_t`.
pub type ks_backend_t = c_int;
pub const KS_BACKEND_AUTO: ks_backend_t = 0;
pub const KS_BACKEND_CPU: ks_backend_t = 1;
pub const KS_BACKEND_CUDA: ks_backend_t = 2;

/// `ks_qtype_t`.
pub type ks_qtype_t = c_int;
pub const KS_QTYPE_NONE: ks_qtype_t = 0;
pub const KS_QTYPE_F32: ks_qtype_t = 1;
pub const KS_QTYPE_F16: ks_qtype_t = 2;
pub const KS_QTYPE_BF16: ks_qtype_t = 3;
pub const KS_QTYPE_Q4_0: ks_qtype_t = 4;
pub const KS_QTYPE_Q4_1: ks_qtype_t = 5;
pub const KS_QTYPE_Q8_0: ks_qtype_t = 6;

/// `ks_stream_t`: a `cudaStream_t` for the CUDA backend, null for the default stream.
pub type ks_stream_t = *mut c_void;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ks_variant_info_t {
    pub op: *const c_char,
    pub backend: *const c_char,
    pub name: *const c_char,
    pub dtypes: *const c_char,
    pub summary: *const c_char,
}

extern "C" {
    // library
    pub fn ks_version() -> *const c_char;
    pub fn ks_last_error() -> *const c_char;
    pub fn ks_status_name(status: ks_status_t) -> *const c_char;
    pub fn ks_backend_available(backend: ks_backend_t) -> c_int;
    pub fn ks_set_deterministic(enabled: c_int) -> ks_status_t;
    pub fn ks_deterministic() -> c_int;
    pub fn ks_qtype_info(qtype: ks_qtype_t, block_size: *mut i64, block_bytes: *mut i64) -> ks_status_t;

    // registry
    pub fn ks_variant_count() -> usize;
    pub fn ks_variant_info(index: usize, info: *mut ks_variant_info_t) -> ks_status_t;
    pub fn ks_which(
        op: *const c_char,
        dtype: *const c_char,
        backend: ks_backend_t,
        variant: *mut *const c_char,
        reason: *mut *const c_char,
    ) -> ks_status_t;
    pub fn ks_which_shape(
        op: *const c_char,
        dtype: *const c_char,
        backend: ks_backend_t,
        rows: i64,
        cols: i64,
        variant: *mut *const c_char,
        reason: *mut *const c_char,
    ) -> ks_status_t;
    pub fn ks_force_variant(op: *const c_char, variant: *const c_char) -> ks_status_t;
    pub fn ks_forced_variant(op: *const c_char, variant: *mut *const c_char) -> ks_status_t;
    pub fn ks_routing_table(json: *mut *const c_char) -> ks_status_t;
    pub fn ks_last_launch_config(op: *const c_char) -> *const c_char;
    pub fn ks_op_runs_variants_of(op: *const c_char) -> *const c_char;
    pub fn ks_op_cols_factors(op: *const c_char) -> *const c_char;

    // the five core operators
    pub fn ks_rms_norm(
        out: *mut DLTensor,
        x: *const DLTensor,
        weight: *const DLTensor,
        eps: f64,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_fused_add_rms_norm(
        x: *mut DLTensor,
        residual: *mut DLTensor,
        weight: *const DLTensor,
        eps: f64,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_silu_and_mul(
        out: *mut DLTensor,
        x: *const DLTensor,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_gemv(
        out: *mut DLTensor,
        x: *const DLTensor,
        weight: *const DLTensor,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_softmax(
        out: *mut DLTensor,
        x: *const DLTensor,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;

    // model-path operators
    pub fn ks_embedding(
        out: *mut DLTensor,
        ids: *const DLTensor,
        table: *const DLTensor,
        table_format: ks_qtype_t,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_dequantize(
        out: *mut DLTensor,
        packed: *const DLTensor,
        qtype: ks_qtype_t,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_gemm(
        out: *mut DLTensor,
        a: *const DLTensor,
        b: *const DLTensor,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_quant_matmul(
        out: *mut DLTensor,
        x: *const DLTensor,
        weight: *const DLTensor,
        qtype: ks_qtype_t,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    /// `qtype` must be `KS_QTYPE_Q4_0`, `KS_QTYPE_Q4_1` or `KS_QTYPE_Q8_0`.
    pub fn ks_quant_matmul_a8(
        out: *mut DLTensor,
        x: *const DLTensor,
        weight: *const DLTensor,
        qtype: ks_qtype_t,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    /// `x` and `residual_out` may be null (then `out` = quant_matmul of rms_norm(residual)).
    pub fn ks_fused_add_rms_norm_quant_matmul(
        out: *mut DLTensor,
        residual_out: *mut DLTensor,
        x: *const DLTensor,
        residual: *const DLTensor,
        norm_weight: *const DLTensor,
        eps: f64,
        weight: *const DLTensor,
        qtype: ks_qtype_t,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_silu_and_mul_quant_matmul(
        out: *mut DLTensor,
        gate_up: *const DLTensor,
        weight: *const DLTensor,
        qtype: ks_qtype_t,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_rotary_embedding(
        q: *mut DLTensor,
        k: *mut DLTensor,
        positions: *const DLTensor,
        rotary_dim: i64,
        theta: f64,
        is_neox: c_int,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_kv_cache_append(
        k_cache: *mut DLTensor,
        v_cache: *mut DLTensor,
        k: *const DLTensor,
        v: *const DLTensor,
        slot_mapping: *const DLTensor,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    /// `k` must not be null: it is rotated in place and its rotated rows are what `k_cache` receives.
    pub fn ks_rotary_embedding_kv_append(
        q: *mut DLTensor,
        k: *mut DLTensor,
        v: *const DLTensor,
        positions: *const DLTensor,
        rotary_dim: i64,
        theta: f64,
        is_neox: c_int,
        k_cache: *mut DLTensor,
        v_cache: *mut DLTensor,
        slot_mapping: *const DLTensor,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    /// `x` and `residual_out` may be null together (then the plain rms_norm of `residual` feeds
    /// the matmul); `residual` holds one row. q, k and v are `out`'s column slices.
    pub fn ks_fused_add_rms_norm_quant_matmul_rope_kv_append(
        out: *mut DLTensor,
        residual_out: *mut DLTensor,
        x: *const DLTensor,
        residual: *const DLTensor,
        norm_weight: *const DLTensor,
        eps: f64,
        weight: *const DLTensor,
        qtype: ks_qtype_t,
        num_heads: i64,
        num_kv_heads: i64,
        positions: *const DLTensor,
        rotary_dim: i64,
        theta: f64,
        is_neox: c_int,
        k_cache: *mut DLTensor,
        v_cache: *mut DLTensor,
        slot_mapping: *const DLTensor,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_paged_attention(
        out: *mut DLTensor,
        q: *const DLTensor,
        k_cache: *const DLTensor,
        v_cache: *const DLTensor,
        block_tables: *const DLTensor,
        seq_ids: *const DLTensor,
        context_lens: *const DLTensor,
        scale: f64,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    /// `ks_paged_attention` right after the call that appended the step's keys on the same
    /// stream; `fresh_keys >= 1` promises that call wrote, for every token t, no cache row that t
    /// reads below `context_lens[t] - fresh_keys` (0: no promise). The same bits as
    /// `ks_paged_attention`.
    pub fn ks_paged_attention_after_append(
        out: *mut DLTensor,
        q: *const DLTensor,
        k_cache: *const DLTensor,
        v_cache: *const DLTensor,
        block_tables: *const DLTensor,
        seq_ids: *const DLTensor,
        context_lens: *const DLTensor,
        scale: f64,
        fresh_keys: i64,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    /// `ks_rotary_embedding_kv_append`, then `ks_paged_attention` on the rotated `q` and the
    /// appended caches; `k` must not be null, `seq_ids` may be (sequence t for token t).
    pub fn ks_rotary_embedding_kv_append_paged_attention(
        out: *mut DLTensor,
        q: *mut DLTensor,
        k: *mut DLTensor,
        v: *const DLTensor,
        positions: *const DLTensor,
        rotary_dim: i64,
        theta: f64,
        is_neox: c_int,
        k_cache: *mut DLTensor,
        v_cache: *mut DLTensor,
        slot_mapping: *const DLTensor,
        block_tables: *const DLTensor,
        seq_ids: *const DLTensor,
        context_lens: *const DLTensor,
        scale: f64,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_argmax(out: *mut DLTensor, x: *const DLTensor, backend: ks_backend_t, stream: ks_stream_t)
        -> ks_status_t;
    pub fn ks_varlen_attention(
        out: *mut DLTensor,
        q: *const DLTensor,
        k: *const DLTensor,
        v: *const DLTensor,
        cu_seqlens_q: *const DLTensor,
        cu_seqlens_k: *const DLTensor,
        scale: f64,
        causal: c_int,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
    pub fn ks_sample(
        out: *mut DLTensor,
        valid: *mut DLTensor,
        logits: *const DLTensor,
        seed_offset: *const DLTensor,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        backend: ks_backend_t,
        stream: ks_stream_t,
    ) -> ks_status_t;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;
    use std::mem::{align_of, size_of};

    #[test]
    fn layouts_match_c() {
        // x86-64 / aarch64 LP64 sizes of the C structs.
        assert_eq!(size_of::<DLDevice>(), 8);
        assert_eq!(size_of::<DLDataType>(), 4);
        assert_eq!(size_of::<DLTensor>(), 48);
        assert_eq!(align_of::<DLTensor>(), 8);
        assert_eq!(size_of::<ks_variant_info_t>(), 5 * size_of::<*const c_char>());
    }

    #[test]
    fn version_links() {
        let v = unsafe { CStr::from_ptr(ks_version()) }.to_str().unwrap();
        assert_eq!(v, format!("{}.{}.{}", KS_VERSION_MAJOR, KS_VERSION_MINOR, KS_VERSION_PATCH));
    }
}
