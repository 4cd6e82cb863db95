//! Safe Rust bindings of kernscope: LLM inference operators behind a C ABI over DLPack.
//!
//! Tensors are views over borrowed slices ([`Tensor`], [`TensorMut`]) carrying dtype, shape,
//! strides and device; every call returns [`Result`], whose [`Error`] holds the [`Status`]
//! and the library's message naming the op and the argument. Validation runs before any
//! write: after an error every output is unchanged.
//!
//! ```no_run
//! use kernscope::{Tensor, TensorMut};
//! let x = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.5, 2.0, 8.0];
//! let w = [1.0f32, 1.0, 0.5, 2.0];
//! let mut y = [0.0f32; 8];
//! kernscope::rms_norm(&mut TensorMut::f32(&mut y, &[2, 4])?, &Tensor::f32(&x, &[2, 4])?,
//!                     &Tensor::f32(&w, &[4])?, 1e-6)?;
//! # Ok::<(), kernscope::Error>(())
//! ```
//!
//! Ops use [`Backend::Auto`] and the default stream; [`Exec`] picks a backend or a CUDA stream.
//! The last error and [`force_variant`] pins are per OS thread, as in the C ABI.

mod error;
pub mod half;
mod tensor;

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;

pub use kernscope_sys as sys;

pub use error::{Error, Result, Status};
pub use tensor::{DType, Device, Element, Tensor, TensorMut};

use error::check;

/// Which backend runs a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    /// By the tensors' device, then the registry.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

impl Backend {
    fn raw(self) -> sys::ks_backend_t {
        match self {
            Backend::Auto => sys::KS_BACKEND_AUTO,
            Backend::Cpu => sys::KS_BACKEND_CPU,
            Backend::Cuda => sys::KS_BACKEND_CUDA,
        }
    }
}

/// Storage format of packed weight rows (GGUF block formats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QType {
    /// Not packed: a dense float tensor.
    None,
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl QType {
    fn raw(self) -> sys::ks_qtype_t {
        match self {
            QType::None => sys::KS_QTYPE_NONE,
            QType::F32 => sys::KS_QTYPE_F32,
            QType::F16 => sys::KS_QTYPE_F16,
            QType::BF16 => sys::KS_QTYPE_BF16,
            QType::Q4_0 => sys::KS_QTYPE_Q4_0,
            QType::Q4_1 => sys::KS_QTYPE_Q4_1,
            QType::Q8_0 => sys::KS_QTYPE_Q8_0,
        }
    }
}

// ---- library ---------------------------------------------------------------------------

fn static_str(p: *const c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    // Only used for strings the ABI documents as static storage.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

fn owned_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::new(Status::InvalidArgument, format!("{}: contains a NUL byte", what)))
}

/// "MAJOR.MINOR.PATCH" of the loaded library.
pub fn version() -> &'static str {
    static_str(unsafe { sys::ks_version() })
}

/// Message of the last failing kernscope call on this thread ("" after a success). The
/// crate's `Error` already carries it; this mirrors `ks_last_error()`.
pub fn last_error() -> String {
    owned_str(unsafe { sys::ks_last_error() })
}

/// Whether `backend` is compiled in and usable here (CUDA: a device exists).
pub fn backend_available(backend: Backend) -> bool {
    unsafe { sys::ks_backend_available(backend.raw()) != 0 }
}

/// Deterministic (batch-invariant) mode, process-wide: a row's result never depends on the
/// call's row count or the row's place (variants that cannot promise it are skipped).
pub fn set_deterministic(enabled: bool) -> Result<()> {
    check(unsafe { sys::ks_set_deterministic(enabled as c_int) })
}

/// Whether deterministic mode is on (`KS_DETERMINISTIC=1` turns it on at start).
pub fn deterministic() -> bool {
    unsafe { sys::ks_deterministic() != 0 }
}

/// (elements per block, bytes per block) of a packed format.
pub fn qtype_info(qtype: QType) -> Result<(i64, i64)> {
    let (mut size, mut bytes) = (0i64, 0i64);
    check(unsafe { sys::ks_qtype_info(qtype.raw(), &mut size, &mut bytes) })?;
    Ok((size, bytes))
}

/// One registered variant of an op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VariantInfo {
    pub op: &'static str,
    pub backend: &'static str,
    pub name: &'static str,
    /// Comma list, e.g. "fp16,bf16,fp32".
    pub dtypes: &'static str,
    pub summary: &'static str,
}

/// Every registered variant (every op, every backend).
pub fn variants() -> Result<Vec<VariantInfo>> {
    let n = unsafe { sys::ks_variant_count() };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut info = sys::ks_variant_info_t {
            op: ptr::null(),
            backend: ptr::null(),
            name: ptr::null(),
            dtypes: ptr::null(),
            summary: ptr::null(),
        };
        check(unsafe { sys::ks_variant_info(i, &mut info) })?;
        out.push(VariantInfo {
            op: static_str(info.op),
            backend: static_str(info.backend),
            name: static_str(info.name),
            dtypes: static_str(info.dtypes),
            summary: static_str(info.summary),
        });
    }
    Ok(out)
}

/// The variant the registry picks for (op, dtype, backend), and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub variant: String,
    pub reason: String,
}

/// `dtype`: "fp16" | "bf16" | "fp32" (for packed-weight ops: the activation dtype).
pub fn which(op: &str, dtype: &str, backend: Backend) -> Result<Choice> {
    let (cop, cdt) = (c_string("which: op", op)?, c_string("which: dtype", dtype)?);
    let (mut variant, mut reason): (*const c_char, *const c_char) = (ptr::null(), ptr::null());
    check(unsafe { sys::ks_which(cop.as_ptr(), cdt.as_ptr(), backend.raw(), &mut variant, &mut reason) })?;
    // Thread-local strings: copied before the next call.
    Ok(Choice { variant: owned_str(variant), reason: owned_str(reason) })
}

/// The same for a call of shape (rows, cols) as the routing table keys it (`ks_which_shape`;
/// docs/routing.md#shape-keys). Errors: an unknown op, dtype or backend, or a negative rows or
/// cols (`Status::InvalidArgument`); a backend that is not available.
pub fn which_shape(op: &str, dtype: &str, backend: Backend, rows: i64, cols: i64) -> Result<Choice> {
    let (cop, cdt) = (c_string("which: op", op)?, c_string("which: dtype", dtype)?);
    let (mut variant, mut reason): (*const c_char, *const c_char) = (ptr::null(), ptr::null());
    check(unsafe {
        sys::ks_which_shape(cop.as_ptr(), cdt.as_ptr(), backend.raw(), rows, cols, &mut variant, &mut reason)
    })?;
    Ok(Choice { variant: owned_str(variant), reason: owned_str(reason) })
}

/// The active routing table as JSON (first matching cell wins; see `ks_routing_table`).
pub fn routing_table() -> Result<String> {
    let mut json: *const c_char = ptr::null();
    check(unsafe { sys::ks_routing_table(&mut json) })?;
    Ok(owned_str(json))
}

/// Pins `op` to `variant` for calls on this OS thread. `variant: None` returns `op` to automatic
/// selection; `op: None` clears every pin.
pub fn force_variant(op: Option<&str>, variant: Option<&str>) -> Result<()> {
    let cop = op.map(|s| c_string("force_variant: op", s)).transpose()?;
    let cvar = variant.map(|s| c_string("force_variant: variant", s)).transpose()?;
    check(unsafe {
        sys::ks_force_variant(
            cop.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
            cvar.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
        )
    })
}

/// The variant pinned for `op` on this OS thread by [`force_variant`], or `None`.
pub fn forced_variant(op: &str) -> Result<Option<String>> {
    let cop = c_string("forced_variant: op", op)?;
    let mut v: *const c_char = ptr::null();
    check(unsafe { sys::ks_forced_variant(cop.as_ptr(), &mut v) })?;
    Ok(if v.is_null() { None } else { Some(owned_str(v)) })
}

/// The launch configuration (block shape, vector width, cluster size, ...) of this OS thread's
/// last CUDA launch of `op`, as text; "" if none (always "" without the CUDA backend).
pub fn last_launch_config(op: &str) -> Result<String> {
    let cop = c_string("last_launch_config: op", op)?;
    Ok(owned_str(unsafe { sys::ks_last_launch_config(cop.as_ptr()) }))
}

/// The op whose variants the entry point `op` runs, for entry points without variants of their
/// own (`Some("paged_attention")` for "paged_attention_after_append"); `None` for any other name.
pub fn op_runs_variants_of(op: &str) -> Result<Option<String>> {
    op_static_str("op_runs_variants_of: op", op, sys::ks_op_runs_variants_of)
}

/// Where `op`'s routing key cols ([`which_shape`]) is a product, its factors' names
/// (`Some("N x K (...)")` for quant_matmul, `Some("max_blocks_per_seq x block_size (...)")` for
/// paged_attention); `None` where cols is one number.
pub fn op_cols_factors(op: &str) -> Result<Option<String>> {
    op_static_str("op_cols_factors: op", op, sys::ks_op_cols_factors)
}

// f(op): a static C string or null
fn op_static_str(what: &str, op: &str, f: unsafe extern "C" fn(*const c_char) -> *const c_char) -> Result<Option<String>> {
    let cop = c_string(what, op)?;
    let v = unsafe { f(cop.as_ptr()) };
    Ok(if v.is_null() { None } else { Some(owned_str(v)) })
}

// ---- ops -------------------------------------------------------------------------------

/// Where and how ops run: a backend and a stream (a `cudaStream_t` for CUDA; null is the
/// default stream). The free functions use `Exec::default()` (automatic backend).
#[derive(Debug, Clone, Copy)]
pub struct Exec {
    backend: Backend,
    stream: *mut c_void,
}

impl Default for Exec {
    fn default() -> Self {
        Exec::new(Backend::Auto)
    }
}

impl Exec {
    pub const fn new(backend: Backend) -> Exec {
        Exec { backend, stream: ptr::null_mut() }
    }

    /// # Safety
    /// `stream` must be a valid `cudaStream_t` (or null) for as long as calls use it.
    pub unsafe fn with_stream(self, stream: *mut c_void) -> Exec {
        Exec { stream, ..self }
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// `out = x * rsqrt(mean(x^2) + eps) * weight` over the last dim.
    pub fn rms_norm(&self, out: &mut TensorMut, x: &Tensor, weight: &Tensor, eps: f64) -> Result<()> {
        let (mut o, xt, w) = (out.raw(), x.raw(), weight.raw());
        check(unsafe { sys::ks_rms_norm(&mut o, &xt, &w, eps, self.backend.raw(), self.stream) })
    }

    /// rms_norm with `out` = `x` (in place).
    pub fn rms_norm_in_place(&self, x: &mut TensorMut, weight: &Tensor, eps: f64) -> Result<()> {
        let (mut o, w) = (x.raw(), weight.raw());
        let xt = o;
        check(unsafe { sys::ks_rms_norm(&mut o, &xt, &w, eps, self.backend.raw(), self.stream) })
    }

    /// In place: `s = x + residual`; `residual = s`; `x = rms_norm(s) * weight`.
    pub fn fused_add_rms_norm(
        &self,
        x: &mut TensorMut,
        residual: &mut TensorMut,
        weight: &Tensor,
        eps: f64,
    ) -> Result<()> {
        let (mut xt, mut r, w) = (x.raw(), residual.raw(), weight.raw());
        check(unsafe { sys::ks_fused_add_rms_norm(&mut xt, &mut r, &w, eps, self.backend.raw(), self.stream) })
    }

    /// `out[..., D] = silu(x[..., :D]) * x[..., D:]`.
    pub fn silu_and_mul(&self, out: &mut TensorMut, x: &Tensor) -> Result<()> {
        let (mut o, xt) = (out.raw(), x.raw());
        check(unsafe { sys::ks_silu_and_mul(&mut o, &xt, self.backend.raw(), self.stream) })
    }

    /// `out[n] = sum_h weight[n, h] * x[h]`.
    pub fn gemv(&self, out: &mut TensorMut, x: &Tensor, weight: &Tensor) -> Result<()> {
        let (mut o, xt, w) = (out.raw(), x.raw(), weight.raw());
        check(unsafe { sys::ks_gemv(&mut o, &xt, &w, self.backend.raw(), self.stream) })
    }

    /// Softmax along the last dim.
    pub fn softmax(&self, out: &mut TensorMut, x: &Tensor) -> Result<()> {
        let (mut o, xt) = (out.raw(), x.raw());
        check(unsafe { sys::ks_softmax(&mut o, &xt, self.backend.raw(), self.stream) })
    }

    /// Softmax with `out` = `x` (in place).
    pub fn softmax_in_place(&self, x: &mut TensorMut) -> Result<()> {
        let mut o = x.raw();
        let xt = o;
        check(unsafe { sys::ks_softmax(&mut o, &xt, self.backend.raw(), self.stream) })
    }

    /// `out[..., hidden] = table[ids[...], :]`, dense (`QType::None`) or packed rows.
    pub fn embedding(&self, out: &mut TensorMut, ids: &Tensor, table: &Tensor, table_format: QType) -> Result<()> {
        let (mut o, i, t) = (out.raw(), ids.raw(), table.raw());
        check(unsafe { sys::ks_embedding(&mut o, &i, &t, table_format.raw(), self.backend.raw(), self.stream) })
    }

    /// `out[rows, cols] = dequant(packed)`.
    pub fn dequantize(&self, out: &mut TensorMut, packed: &Tensor, qtype: QType) -> Result<()> {
        let (mut o, p) = (out.raw(), packed.raw());
        check(unsafe { sys::ks_dequantize(&mut o, &p, qtype.raw(), self.backend.raw(), self.stream) })
    }

    /// `out[M, N] = a[M, K] @ b[N, K]^T`. `a` may be `[..., K]` with `out` `[..., N]` (any leading
    /// dims, M their product, each row as in the 2-D reshape; a 1-D `a` gives `out` `[N]`).
    pub fn gemm(&self, out: &mut TensorMut, a: &Tensor, b: &Tensor) -> Result<()> {
        let (mut o, at, bt) = (out.raw(), a.raw(), b.raw());
        check(unsafe { sys::ks_gemm(&mut o, &at, &bt, self.backend.raw(), self.stream) })
    }

    /// `out[M, N] = x[M, K] @ dequant(weight)^T` from the packed blocks. `x` may be `[..., K]` with
    /// `out` `[..., N]`, as [`Exec::gemm`] (`quant_matmul_a8` too).
    pub fn quant_matmul(&self, out: &mut TensorMut, x: &Tensor, weight: &Tensor, qtype: QType) -> Result<()> {
        let (mut o, xt, w) = (out.raw(), x.raw(), weight.raw());
        check(unsafe { sys::ks_quant_matmul(&mut o, &xt, &w, qtype.raw(), self.backend.raw(), self.stream) })
    }

    /// W4A8 / W8A8: [`Exec::quant_matmul`] with `x` quantized to int8 per block of 32 (llama.cpp's
    /// Q8_1 activations). `x` `[M, K]` (f32, or f16 / bf16 bits; K a multiple of 32), `weight`
    /// packed `[N, K / 32 * block_bytes]` (u8) in `qtype`, which must be `QType::Q4_0`, `Q4_1` or
    /// `Q8_0`; `out` `[M, N]` in `x`'s dtype. Per block of x: `d = max|x| / 127`, codes
    /// `rint(x * 127 / max|x|)` (ties to even); each block's dot product with the weight's codes
    /// is an exact int32 sum, its value formed in FP32, the blocks summed in FP32 in one fixed
    /// order: every backend gives the same bits. The result differs from `quant_matmul` by up to
    /// about 1/254 of each x block's largest value per element. A NaN or ±inf in a block of x
    /// makes every output of its row NaN; a block with `max|x| < 1.5e-36` counts as zero.
    /// `weight` is read-only, with `quant_matmul`'s rule on CUDA. Errors (nothing written):
    /// another `qtype` (the message names qtype), shapes, a K that is not whole blocks, `out`
    /// overlapping an input (`Status::InvalidArgument`); mismatched dtypes, or `weight` not u8
    /// (`Status::UnsupportedDtype`). Contract: docs/contracts.md#quant_matmul_a8.
    pub fn quant_matmul_a8(&self, out: &mut TensorMut, x: &Tensor, weight: &Tensor, qtype: QType) -> Result<()> {
        let (mut o, xt, w) = (out.raw(), x.raw(), weight.raw());
        check(unsafe { sys::ks_quant_matmul_a8(&mut o, &xt, &w, qtype.raw(), self.backend.raw(), self.stream) })
    }

    /// Decode-step fusion: the (fused add +) RMS norm of each row, then [`Exec::quant_matmul`] on
    /// it, in one kernel. `residual` `[M, K]` (or `[..., K]` with `out` `[..., N]`), `norm_weight` `[K]`, `weight` packed `[N, row_bytes]`
    /// in `qtype`, `out` `[M, N]`. With `x` (`[M, K]`): `s = x + residual` (FP32);
    /// `residual_out` (`[M, K]`, required) = round(s); `out` = quant_matmul(round(rms_norm(s) *
    /// norm_weight)), i.e. [`Exec::fused_add_rms_norm`]'s values then quant_matmul, with `x` and
    /// `residual` left unchanged. `x: None`: `out` = quant_matmul(round(rms_norm(residual) *
    /// norm_weight)); `residual_out` must then be `None` too. Errors (nothing written):
    /// `residual_out` without `x` (or `x` without it), shapes, eps, overlap (`out` and
    /// `residual_out` overlap no input nor each other) are `Status::InvalidArgument`; mismatched
    /// float dtypes (or `weight` not u8) `Status::UnsupportedDtype`.
    #[allow(clippy::too_many_arguments)]
    pub fn fused_add_rms_norm_quant_matmul(
        &self,
        out: &mut TensorMut,
        residual_out: Option<&mut TensorMut>,
        x: Option<&Tensor>,
        residual: &Tensor,
        norm_weight: &Tensor,
        eps: f64,
        weight: &Tensor,
        qtype: QType,
    ) -> Result<()> {
        let mut o = out.raw();
        let mut ro = residual_out.map(|t| t.raw());
        let rop = ro.as_mut().map_or(ptr::null_mut(), |t| t as *mut sys::DLTensor);
        let xt = x.map(|t| t.raw());
        let xp = xt.as_ref().map_or(ptr::null(), |t| t as *const sys::DLTensor);
        let (r, nw, w) = (residual.raw(), norm_weight.raw(), weight.raw());
        check(unsafe {
            sys::ks_fused_add_rms_norm_quant_matmul(
                &mut o,
                rop,
                xp,
                &r,
                &nw,
                eps,
                &w,
                qtype.raw(),
                self.backend.raw(),
                self.stream,
            )
        })
    }

    /// Decode-step fusion: [`Exec::silu_and_mul`] of `gate_up` `[M, 2K]` or `[..., 2K]` (gate, then up), then
    /// [`Exec::quant_matmul`] on it, in one kernel: `out[M, N]` = quant_matmul(round(silu(gate) *
    /// up), weight). Errors (nothing written): an odd last dim of `gate_up`, a K that is not
    /// whole blocks, bad shapes, `out` overlapping an input (`Status::InvalidArgument`).
    pub fn silu_and_mul_quant_matmul(
        &self,
        out: &mut TensorMut,
        gate_up: &Tensor,
        weight: &Tensor,
        qtype: QType,
    ) -> Result<()> {
        let (mut o, g, w) = (out.raw(), gate_up.raw(), weight.raw());
        check(unsafe {
            sys::ks_silu_and_mul_quant_matmul(&mut o, &g, &w, qtype.raw(), self.backend.raw(), self.stream)
        })
    }

    /// Rotary position embedding in place on `q` and (optionally) `k`.
    pub fn rotary_embedding(
        &self,
        q: &mut TensorMut,
        k: Option<&mut TensorMut>,
        positions: &Tensor,
        rotary_dim: i64,
        theta: f64,
        is_neox: bool,
    ) -> Result<()> {
        let mut qt = q.raw();
        let mut kt = k.map(|k| k.raw());
        let p = positions.raw();
        let kp = kt.as_mut().map_or(ptr::null_mut(), |k| k as *mut sys::DLTensor);
        check(unsafe {
            sys::ks_rotary_embedding(
                &mut qt,
                kp,
                &p,
                rotary_dim,
                theta,
                is_neox as i32,
                self.backend.raw(),
                self.stream,
            )
        })
    }

    /// Writes k/v rows into a paged cache at `slot_mapping` (slot -1 skipped).
    pub fn kv_cache_append(
        &self,
        k_cache: &mut TensorMut,
        v_cache: &mut TensorMut,
        k: &Tensor,
        v: &Tensor,
        slot_mapping: &Tensor,
    ) -> Result<()> {
        let (mut kc, mut vc, kt, vt, s) = (k_cache.raw(), v_cache.raw(), k.raw(), v.raw(), slot_mapping.raw());
        check(unsafe { sys::ks_kv_cache_append(&mut kc, &mut vc, &kt, &vt, &s, self.backend.raw(), self.stream) })
    }

    /// Decode-step fusion: [`Exec::rotary_embedding`] of `q` and `k`, then
    /// [`Exec::kv_cache_append`] of the rotated `k` and of `v`, in one pass (one kernel on
    /// CUDA); in place on `q`, `k`, `k_cache` and `v_cache`, bit for bit the two calls. `q`
    /// `[num_tokens, num_heads, head_dim]`, `k`/`v` `[num_tokens, num_kv_heads, head_dim]`
    /// (`k` required), `positions` int32/int64 `[num_tokens]`, caches `[num_blocks,
    /// block_size, num_kv_heads, head_dim]`, `slot_mapping` int32/int64 `[n <= num_tokens]`
    /// (slot -1 skipped). Errors (nothing written): every rule of the two ops, plus `v`
    /// overlapping `q` or `k` and a cache overlapping `q` or `positions`
    /// (`Status::InvalidArgument`); mismatched dtypes (`Status::UnsupportedDtype`).
    #[allow(clippy::too_many_arguments)]
    pub fn rotary_embedding_kv_append(
        &self,
        q: &mut TensorMut,
        k: &mut TensorMut,
        v: &Tensor,
        positions: &Tensor,
        rotary_dim: i64,
        theta: f64,
        is_neox: bool,
        k_cache: &mut TensorMut,
        v_cache: &mut TensorMut,
        slot_mapping: &Tensor,
    ) -> Result<()> {
        let (mut qt, mut kt, vt, p) = (q.raw(), k.raw(), v.raw(), positions.raw());
        let (mut kc, mut vc, s) = (k_cache.raw(), v_cache.raw(), slot_mapping.raw());
        check(unsafe {
            sys::ks_rotary_embedding_kv_append(
                &mut qt,
                &mut kt,
                &vt,
                &p,
                rotary_dim,
                theta,
                is_neox as i32,
                &mut kc,
                &mut vc,
                &s,
                self.backend.raw(),
                self.stream,
            )
        })
    }

    /// Decode-step fusion for one token: [`Exec::fused_add_rms_norm_quant_matmul`] into `out`,
    /// then [`Exec::rotary_embedding_kv_append`] on `out`'s column slices q = `[:, 0 : H D]`,
    /// k = `[:, H D : (H + KVH) D]` and v = `[:, (H + KVH) D :]` seen as `[1, H, D]`, `[1, KVH, D]`,
    /// `[1, KVH, D]` (H = `num_heads`, KVH = `num_kv_heads`, D = N / (H + 2 KVH)), in one kernel on
    /// CUDA where it can; bit for bit the two calls. `residual` `[1, K]` (one row; `[0, K]` does
    /// nothing), `x`, `residual_out`, `norm_weight`, `eps`, `weight` and `qtype` as in
    /// [`Exec::fused_add_rms_norm_quant_matmul`] (`x` and `residual_out` given or `None`
    /// together); `out` `[1, N]` with N = weight's rows = (H + 2 KVH) D, its q and k rotated on
    /// return; `positions`, `rotary_dim`, `theta`, `is_neox`, `k_cache`, `v_cache` and
    /// `slot_mapping` (`[1]` or `[0]`) as in [`Exec::rotary_embedding_kv_append`]. Errors
    /// (nothing written): every rule of the two ops under this op's name, plus more than one
    /// row, `num_heads` or `num_kv_heads` <= 0, N not a multiple of H + 2 KVH, and the caches,
    /// `positions` or `slot_mapping` overlapping the matmul's tensors (`Status::InvalidArgument`);
    /// mismatched dtypes (`Status::UnsupportedDtype`).
    #[allow(clippy::too_many_arguments)]
    pub fn fused_add_rms_norm_quant_matmul_rope_kv_append(
        &self,
        out: &mut TensorMut,
        residual_out: Option<&mut TensorMut>,
        x: Option<&Tensor>,
        residual: &Tensor,
        norm_weight: &Tensor,
        eps: f64,
        weight: &Tensor,
        qtype: QType,
        num_heads: i64,
        num_kv_heads: i64,
        positions: &Tensor,
        rotary_dim: i64,
        theta: f64,
        is_neox: bool,
        k_cache: &mut TensorMut,
        v_cache: &mut TensorMut,
        slot_mapping: &Tensor,
    ) -> Result<()> {
        let mut o = out.raw();
        let mut ro = residual_out.map(|t| t.raw());
        let rop = ro.as_mut().map_or(ptr::null_mut(), |t| t as *mut sys::DLTensor);
        let xt = x.map(|t| t.raw());
        let xp = xt.as_ref().map_or(ptr::null(), |t| t as *const sys::DLTensor);
        let (r, nw, w, p) = (residual.raw(), norm_weight.raw(), weight.raw(), positions.raw());
        let (mut kc, mut vc, s) = (k_cache.raw(), v_cache.raw(), slot_mapping.raw());
        check(unsafe {
            sys::ks_fused_add_rms_norm_quant_matmul_rope_kv_append(
                &mut o,
                rop,
                xp,
                &r,
                &nw,
                eps,
                &w,
                qtype.raw(),
                num_heads,
                num_kv_heads,
                &p,
                rotary_dim,
                theta,
                is_neox as i32,
                &mut kc,
                &mut vc,
                &s,
                self.backend.raw(),
                self.stream,
            )
        })
    }

    /// Attention over a paged KV cache. `seq_ids: None` means sequence t for token t.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        out: &mut TensorMut,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        block_tables: &Tensor,
        seq_ids: Option<&Tensor>,
        context_lens: &Tensor,
        scale: f64,
    ) -> Result<()> {
        self.paged_attention_call(out, q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale, None)
    }

    // ks_paged_attention (fresh_keys None) or ks_paged_attention_after_append
    #[allow(clippy::too_many_arguments)]
    fn paged_attention_call(
        &self,
        out: &mut TensorMut,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        block_tables: &Tensor,
        seq_ids: Option<&Tensor>,
        context_lens: &Tensor,
        scale: f64,
        fresh_keys: Option<i64>,
    ) -> Result<()> {
        let mut o = out.raw();
        let (qt, kc, vc, bt, cl) = (q.raw(), k_cache.raw(), v_cache.raw(), block_tables.raw(), context_lens.raw());
        let si = seq_ids.map(|s| s.raw());
        let sp = si.as_ref().map_or(ptr::null(), |s| s as *const sys::DLTensor);
        let (be, st) = (self.backend.raw(), self.stream);
        check(unsafe {
            match fresh_keys {
                None => sys::ks_paged_attention(&mut o, &qt, &kc, &vc, &bt, sp, &cl, scale, be, st),
                Some(f) => sys::ks_paged_attention_after_append(&mut o, &qt, &kc, &vc, &bt, sp, &cl, scale, f, be, st),
            }
        })
    }

    /// [`Exec::paged_attention`] for the call right after the one that appended the step's keys
    /// on the same stream (`kv_cache_append`, `rotary_embedding_kv_append` or
    /// `fused_add_rms_norm_quant_matmul_rope_kv_append`). `fresh_keys >= 1` is the caller's
    /// promise that the kernel launched just before on this stream wrote, for every token t, no
    /// `k_cache` or `v_cache` row that t reads below `context_lens[t] - fresh_keys`, and none of
    /// `block_tables`, `seq_ids` and `context_lens`: CUDA may then read the older keys before it
    /// ends (a broken promise may read a row before it is written). `fresh_keys = 0` makes no
    /// promise. The result is `paged_attention`'s, bit for bit, whatever `fresh_keys` is.
    /// Errors (nothing written): `paged_attention`'s under this op's name
    /// (`paged_attention_after_append`), and `fresh_keys < 0` (`Status::InvalidArgument`).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_after_append(
        &self,
        out: &mut TensorMut,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        block_tables: &Tensor,
        seq_ids: Option<&Tensor>,
        context_lens: &Tensor,
        scale: f64,
        fresh_keys: i64,
    ) -> Result<()> {
        let fresh = Some(fresh_keys);
        self.paged_attention_call(out, q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale, fresh)
    }

    /// Decode-step fusion: [`Exec::rotary_embedding_kv_append`] of `q`, `k`, `v` into the
    /// caches, then [`Exec::paged_attention`] of the rotated `q` over them into `out`, in one
    /// kernel on CUDA where it can; `q`, `k` and the caches in place as after the first call,
    /// `out` `[num_tokens, num_heads, head_dim]` as after the second (`seq_ids: None` means
    /// sequence t for token t). Bit for bit the two calls when no token reads a cache slot that
    /// another token of the call appends (a decode step; the CPU is always the two calls).
    /// Errors (nothing written): every rule of the two ops under this op's name, plus `out`
    /// overlapping `q`, `k`, `v`, `positions`, `slot_mapping` or the caches
    /// (`Status::InvalidArgument`); mismatched dtypes (`Status::UnsupportedDtype`).
    #[allow(clippy::too_many_arguments)]
    pub fn rotary_embedding_kv_append_paged_attention(
        &self,
        out: &mut TensorMut,
        q: &mut TensorMut,
        k: &mut TensorMut,
        v: &Tensor,
        positions: &Tensor,
        rotary_dim: i64,
        theta: f64,
        is_neox: bool,
        k_cache: &mut TensorMut,
        v_cache: &mut TensorMut,
        slot_mapping: &Tensor,
        block_tables: &Tensor,
        seq_ids: Option<&Tensor>,
        context_lens: &Tensor,
        scale: f64,
    ) -> Result<()> {
        let (mut o, mut qt, mut kt, vt, p) = (out.raw(), q.raw(), k.raw(), v.raw(), positions.raw());
        let (mut kc, mut vc, s) = (k_cache.raw(), v_cache.raw(), slot_mapping.raw());
        let (bt, cl) = (block_tables.raw(), context_lens.raw());
        let si = seq_ids.map(|s| s.raw());
        let sp = si.as_ref().map_or(ptr::null(), |s| s as *const sys::DLTensor);
        check(unsafe {
            sys::ks_rotary_embedding_kv_append_paged_attention(
                &mut o,
                &mut qt,
                &mut kt,
                &vt,
                &p,
                rotary_dim,
                theta,
                is_neox as i32,
                &mut kc,
                &mut vc,
                &s,
                &bt,
                sp,
                &cl,
                scale,
                self.backend.raw(),
                self.stream,
            )
        })
    }

    /// `out[r]` (int64) = index of the maximum of `x[r, :]`.
    pub fn argmax(&self, out: &mut TensorMut, x: &Tensor) -> Result<()> {
        let (mut o, xt) = (out.raw(), x.raw());
        check(unsafe { sys::ks_argmax(&mut o, &xt, self.backend.raw(), self.stream) })
    }

    /// Attention over packed sequences: q `[total_q, heads, d]`, k/v `[total_k, kv_heads, d]`,
    /// int32 offsets `[num_seqs + 1]`; `causal`: bottom-right aligned mask.
    #[allow(clippy::too_many_arguments)]
    pub fn varlen_attention(
        &self,
        out: &mut TensorMut,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_seqlens_q: &Tensor,
        cu_seqlens_k: &Tensor,
        scale: f64,
        causal: bool,
    ) -> Result<()> {
        let (mut o, qt, kt, vt) = (out.raw(), q.raw(), k.raw(), v.raw());
        let (cq, ck) = (cu_seqlens_q.raw(), cu_seqlens_k.raw());
        check(unsafe {
            sys::ks_varlen_attention(&mut o, &qt, &kt, &vt, &cq, &ck, scale, causal as c_int, self.backend.raw(), self.stream)
        })
    }

    /// One token id per row of `logits` (int64 `out`): temperature, top-k (0: off),
    /// top-p (1: off), then a Philox4x32-10 draw keyed by `seed_offset` = [seed, offset]
    /// (int64 [2]); `valid` (u8, optional) is 0 for a row without a distribution.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        out: &mut TensorMut,
        valid: Option<&mut TensorMut>,
        logits: &Tensor,
        seed_offset: &Tensor,
        temperature: f64,
        top_k: i64,
        top_p: f64,
    ) -> Result<()> {
        let (mut o, lt, so) = (out.raw(), logits.raw(), seed_offset.raw());
        let mut v = valid.map(|t| t.raw());
        let vp = v.as_mut().map_or(ptr::null_mut(), |t| t as *mut sys::DLTensor);
        check(unsafe {
            sys::ks_sample(&mut o, vp, &lt, &so, temperature, top_k, top_p, self.backend.raw(), self.stream)
        })
    }
}

/// [`Exec::rms_norm`] on the automatic backend.
pub fn rms_norm(out: &mut TensorMut, x: &Tensor, weight: &Tensor, eps: f64) -> Result<()> {
    Exec::default().rms_norm(out, x, weight, eps)
}
/// [`Exec::rms_norm_in_place`] on the automatic backend.
pub fn rms_norm_in_place(x: &mut TensorMut, weight: &Tensor, eps: f64) -> Result<()> {
    Exec::default().rms_norm_in_place(x, weight, eps)
}
/// [`Exec::fused_add_rms_norm`] on the automatic backend.
pub fn fused_add_rms_norm(x: &mut TensorMut, residual: &mut TensorMut, weight: &Tensor, eps: f64) -> Result<()> {
    Exec::default().fused_add_rms_norm(x, residual, weight, eps)
}
/// [`Exec::silu_and_mul`] on the automatic backend.
pub fn silu_and_mul(out: &mut TensorMut, x: &Tensor) -> Result<()> {
    Exec::default().silu_and_mul(out, x)
}
/// [`Exec::gemv`] on the automatic backend.
pub fn gemv(out: &mut TensorMut, x: &Tensor, weight: &Tensor) -> Result<()> {
    Exec::default().gemv(out, x, weight)
}
/// [`Exec::softmax`] on the automatic backend.
pub fn softmax(out: &mut TensorMut, x: &Tensor) -> Result<()> {
    Exec::default().softmax(out, x)
}
/// [`Exec::softmax_in_place`] on the automatic backend.
pub fn softmax_in_place(x: &mut TensorMut) -> Result<()> {
    Exec::default().softmax_in_place(x)
}
/// [`Exec::embedding`] on the automatic backend.
pub fn embedding(out: &mut TensorMut, ids: &Tensor, table: &Tensor, table_format: QType) -> Result<()> {
    Exec::default().embedding(out, ids, table, table_format)
}
/// [`Exec::dequantize`] on the automatic backend.
pub fn dequantize(out: &mut TensorMut, packed: &Tensor, qtype: QType) -> Result<()> {
    Exec::default().dequantize(out, packed, qtype)
}
/// [`Exec::gemm`] on the automatic backend.
pub fn gemm(out: &mut TensorMut, a: &Tensor, b: &Tensor) -> Result<()> {
    Exec::default().gemm(out, a, b)
}
/// [`Exec::quant_matmul`] on the automatic backend.
pub fn quant_matmul(out: &mut TensorMut, x: &Tensor, weight: &Tensor, qtype: QType) -> Result<()> {
    Exec::default().quant_matmul(out, x, weight, qtype)
}
/// [`Exec::quant_matmul_a8`] on the automatic backend.
pub fn quant_matmul_a8(out: &mut TensorMut, x: &Tensor, weight: &Tensor, qtype: QType) -> Result<()> {
    Exec::default().quant_matmul_a8(out, x, weight, qtype)
}
/// [`Exec::fused_add_rms_norm_quant_matmul`] on the automatic backend.
#[allow(clippy::too_many_arguments)]
pub fn fused_add_rms_norm_quant_matmul(
    out: &mut TensorMut,
    residual_out: Option<&mut TensorMut>,
    x: Option<&Tensor>,
    residual: &Tensor,
    norm_weight: &Tensor,
    eps: f64,
    weight: &Tensor,
    qtype: QType,
) -> Result<()> {
    Exec::default().fused_add_rms_norm_quant_matmul(out, residual_out, x, residual, norm_weight, eps, weight, qtype)
}
/// [`Exec::silu_and_mul_quant_matmul`] on the automatic backend.
pub fn silu_and_mul_quant_matmul(out: &mut TensorMut, gate_up: &Tensor, weight: &Tensor, qtype: QType) -> Result<()> {
    Exec::default().silu_and_mul_quant_matmul(out, gate_up, weight, qtype)
}
/// [`Exec::rotary_embedding`] on the automatic backend.
pub fn rotary_embedding(
    q: &mut TensorMut,
    k: Option<&mut TensorMut>,
    positions: &Tensor,
    rotary_dim: i64,
    theta: f64,
    is_neox: bool,
) -> Result<()> {
    Exec::default().rotary_embedding(q, k, positions, rotary_dim, theta, is_neox)
}
/// [`Exec::kv_cache_append`] on the automatic backend.
pub fn kv_cache_append(
    k_cache: &mut TensorMut,
    v_cache: &mut TensorMut,
    k: &Tensor,
    v: &Tensor,
    slot_mapping: &Tensor,
) -> Result<()> {
    Exec::default().kv_cache_append(k_cache, v_cache, k, v, slot_mapping)
}
/// [`Exec::rotary_embedding_kv_append`] on the automatic backend.
#[allow(clippy::too_many_arguments)]
pub fn rotary_embedding_kv_append(
    q: &mut TensorMut,
    k: &mut TensorMut,
    v: &Tensor,
    positions: &Tensor,
    rotary_dim: i64,
    theta: f64,
    is_neox: bool,
    k_cache: &mut TensorMut,
    v_cache: &mut TensorMut,
    slot_mapping: &Tensor,
) -> Result<()> {
    Exec::default().rotary_embedding_kv_append(
        q,
        k,
        v,
        positions,
        rotary_dim,
        theta,
        is_neox,
        k_cache,
        v_cache,
        slot_mapping,
    )
}
/// [`Exec::fused_add_rms_norm_quant_matmul_rope_kv_append`] on the automatic backend.
#[allow(clippy::too_many_arguments)]
pub fn fused_add_rms_norm_quant_matmul_rope_kv_append(
    out: &mut TensorMut,
    residual_out: Option<&mut TensorMut>,
    x: Option<&Tensor>,
    residual: &Tensor,
    norm_weight: &Tensor,
    eps: f64,
    weight: &Tensor,
    qtype: QType,
    num_heads: i64,
    num_kv_heads: i64,
    positions: &Tensor,
    rotary_dim: i64,
    theta: f64,
    is_neox: bool,
    k_cache: &mut TensorMut,
    v_cache: &mut TensorMut,
    slot_mapping: &Tensor,
) -> Result<()> {
    Exec::default().fused_add_rms_norm_quant_matmul_rope_kv_append(
        out,
        residual_out,
        x,
        residual,
        norm_weight,
        eps,
        weight,
        qtype,
        num_heads,
        num_kv_heads,
        positions,
        rotary_dim,
        theta,
        is_neox,
        k_cache,
        v_cache,
        slot_mapping,
    )
}
/// [`Exec::paged_attention`] on the automatic backend.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    out: &mut TensorMut,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    seq_ids: Option<&Tensor>,
    context_lens: &Tensor,
    scale: f64,
) -> Result<()> {
    Exec::default().paged_attention(out, q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale)
}
/// [`Exec::paged_attention_after_append`] on the automatic backend.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_after_append(
    out: &mut TensorMut,
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    block_tables: &Tensor,
    seq_ids: Option<&Tensor>,
    context_lens: &Tensor,
    scale: f64,
    fresh_keys: i64,
) -> Result<()> {
    Exec::default().paged_attention_after_append(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_ids,
        context_lens,
        scale,
        fresh_keys,
    )
}
/// [`Exec::rotary_embedding_kv_append_paged_attention`] on the automatic backend.
#[allow(clippy::too_many_arguments)]
pub fn rotary_embedding_kv_append_paged_attention(
    out: &mut TensorMut,
    q: &mut TensorMut,
    k: &mut TensorMut,
    v: &Tensor,
    positions: &Tensor,
    rotary_dim: i64,
    theta: f64,
    is_neox: bool,
    k_cache: &mut TensorMut,
    v_cache: &mut TensorMut,
    slot_mapping: &Tensor,
    block_tables: &Tensor,
    seq_ids: Option<&Tensor>,
    context_lens: &Tensor,
    scale: f64,
) -> Result<()> {
    Exec::default().rotary_embedding_kv_append_paged_attention(
        out,
        q,
        k,
        v,
        positions,
        rotary_dim,
        theta,
        is_neox,
        k_cache,
        v_cache,
        slot_mapping,
        block_tables,
        seq_ids,
        context_lens,
        scale,
    )
}
/// [`Exec::varlen_attention`] on the automatic backend.
#[allow(clippy::too_many_arguments)]
pub fn varlen_attention(
    out: &mut TensorMut,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens_q: &Tensor,
    cu_seqlens_k: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<()> {
    Exec::default().varlen_attention(out, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
}
/// [`Exec::argmax`] on the automatic backend.
pub fn argmax(out: &mut TensorMut, x: &Tensor) -> Result<()> {
    Exec::default().argmax(out, x)
}

/// [`Exec::sample`] on the automatic backend.
pub fn sample(
    out: &mut TensorMut,
    valid: Option<&mut TensorMut>,
    logits: &Tensor,
    seed_offset: &Tensor,
    temperature: f64,
    top_k: i64,
    top_p: f64,
) -> Result<()> {
    Exec::default().sample(out, valid, logits, seed_offset, temperature, top_k, top_p)
}
