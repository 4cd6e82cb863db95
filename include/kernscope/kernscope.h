/*
 * kernscope — LLM inference operators behind one C ABI.
 *
 * Plain C (C99). Every entry point returns ks_status_t. On failure a message
 * naming the op and the argument is kept in thread-local storage and returned
 * by ks_last_error(); no output has been written.
 *
 * Tensors are DLPack DLTensor (dlpack/dlpack.h). Argument order: outputs,
 * inputs, scalars, backend, stream. The stream is an opaque pointer (a
 * cudaStream_t for the CUDA backend, NULL = default stream; ignored on CPU).
 *
 * Shared rules, unless an op says otherwise (see docs/contracts.md):
 *  - float tensors are fp16 (kDLFloat,16), bf16 (kDLBfloat,16) or fp32
 *    (kDLFloat,32), lanes == 1; all float tensors of one call share a dtype;
 *  - tensors are contiguous (strides NULL or row-major compact; a size-1
 *    dimension's stride is ignored); data + byte_offset may have any alignment;
 *  - all tensors of one call live on one device;
 *  - zero leading dimensions are a no-op that still validates arguments;
 *  - arithmetic is FP32 with a single rounding to the output dtype.
 */
#ifndef KERNSCOPE_H_
#define KERNSCOPE_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define KS_API __declspec(dllexport)
#else
#define KS_API __attribute__((visibility("default")))
#endif

/* C++ sees the enums below with a fixed `int` underlying type (the type C gives
 * them on every supported ABI), so a caller's out-of-range value is a valid enum
 * value in C++ that validation can reject, not undefined behaviour. */
#ifdef __cplusplus
#define KS_ENUM_INT : int
#else
#define KS_ENUM_INT
#endif

#define KS_VERSION_MAJOR 0
#define KS_VERSION_MINOR 1
#define KS_VERSION_PATCH 0

typedef enum KS_ENUM_INT {
  KS_SUCCESS = 0,
  KS_ERROR_INVALID_ARGUMENT = 1,   /* bad shape, stride, eps, overlap, id out of range, ... */
  KS_ERROR_UNSUPPORTED_DTYPE = 2,  /* dtype not handled by the op, or mismatched dtypes */
  KS_ERROR_UNSUPPORTED_DEVICE = 3, /* tensor on a device the op/backend cannot use, or mixed devices */
  KS_ERROR_BACKEND_UNAVAILABLE = 4,/* backend not compiled in, or no device present */
  KS_ERROR_CUDA = 5,               /* a CUDA runtime call or launch failed */
  KS_ERROR_OUT_OF_MEMORY = 6,
  KS_ERROR_INTERNAL = 7
} ks_status_t;

typedef enum KS_ENUM_INT {
  KS_BACKEND_AUTO = 0, /* pick by the tensors' device, then the registry */
  KS_BACKEND_CPU = 1,  /* portable C++ reference and CPU fast paths */
  KS_BACKEND_CUDA = 2
} ks_backend_t;

/* Storage format of packed weight rows (GGUF block formats).
 * A packed tensor is uint8 [rows, row_bytes] with row_bytes = cols / block_size * block_bytes. */
typedef enum KS_ENUM_INT {
  KS_QTYPE_NONE = 0, /* not packed: a dense float tensor */
  KS_QTYPE_F32 = 1,  /* block 1, 4 bytes: IEEE binary32 */
  KS_QTYPE_F16 = 2,  /* block 1, 2 bytes: IEEE binary16 */
  KS_QTYPE_BF16 = 3, /* block 1, 2 bytes: bfloat16 */
  KS_QTYPE_Q4_0 = 4, /* block 32, 18 bytes: f16 d, 16 bytes of nibbles; w = d * (q - 8) */
  KS_QTYPE_Q4_1 = 5, /* block 32, 20 bytes: f16 d, f16 m, 16 bytes; w = d * q + m */
  KS_QTYPE_Q8_0 = 6  /* block 32, 34 bytes: f16 d, 32 int8; w = d * q */
} ks_qtype_t;

typedef void* ks_stream_t;

/* ---- library ---------------------------------------------------------- */

/* "MAJOR.MINOR.PATCH"; static storage. */
KS_API const char* ks_version(void);
/* Message of this thread's latest call that returns a ks_status_t, if that
 * call failed; "" if it succeeded (each such call clears the message first) or
 * if there was none. Calls that return no status (ks_version, ks_status_name,
 * ks_backend_available, ks_deterministic, ks_last_launch_config, ...)
 * leave it as it is. Valid until the next kernscope call on the same thread. */
KS_API const char* ks_last_error(void);
/* Stable name of a status code, e.g. "KS_ERROR_INVALID_ARGUMENT". */
KS_API const char* ks_status_name(ks_status_t status);
/* 1 if the backend is compiled in and usable here (CUDA: a device exists). */
KS_API int ks_backend_available(ks_backend_t backend);

/* Block geometry of a packed format: elements per block and bytes per block. */
KS_API ks_status_t ks_qtype_info(ks_qtype_t qtype, int64_t* block_size, int64_t* block_bytes);

/* ---- registry ---------------------------------------------------------- */

typedef struct {
  const char* op;      /* "rms_norm", ... */
  const char* backend; /* "cpu" | "cuda" */
  const char* name;    /* variant name, e.g. "cpu_reference" */
  const char* dtypes;  /* comma list: "fp16,bf16,fp32" */
  const char* summary; /* one line */
} ks_variant_info_t;

/* Number of registered variants (every op, every backend). */
KS_API size_t ks_variant_count(void);
/* Fill *info for variant index < ks_variant_count(); strings are static. */
KS_API ks_status_t ks_variant_info(size_t index, ks_variant_info_t* info);
/* The op whose registered variants the entry point `op` runs, for entry points without variants
 * of their own ("paged_attention" for paged_attention_after_append); NULL for any other name,
 * NULL included. A static string. ks_which, ks_force_variant and `ksctl` answer such an entry
 * point as that op. */
KS_API const char* ks_op_runs_variants_of(const char* op);
/* Where the routing key's cols (ks_which_shape, docs/routing.md#shape-keys-rows-cols) is a
 * product, its factors' names, e.g. "N x K (...)" for quant_matmul and the fused quant_matmul
 * ops, "max_blocks_per_seq x block_size (...)" for paged_attention (entry points answer as the op
 * they run); NULL where cols is one number, for an unknown op and for NULL. A static string. */
KS_API const char* ks_op_cols_factors(const char* op);
/* The variant chosen for (op, dtype, backend) on a representative shape, and
 * why. *variant and *reason are thread-local, valid until the next call.
 * dtype: "fp16" | "bf16" | "fp32", in any case, or torch's names "float16" / "half",
 * "bfloat16", "float32" / "float" (for packed-weight ops: the activation dtype, optionally
 * followed by the weights' block format, e.g. "bf16:q4_1", for the routing cells bound to one;
 * without it those cells are skipped). Another dtype: KS_ERROR_UNSUPPORTED_DTYPE; a bad block
 * format: KS_ERROR_INVALID_ARGUMENT. */
KS_API ks_status_t ks_which(const char* op, const char* dtype, ks_backend_t backend,
                            const char** variant, const char** reason);
/* The same for a call of a given shape: (rows, cols) as the routing table keys it
 * (docs/routing.md#shape-keys-rows-cols, e.g. paged_attention: num_tokens and the block table's
 * capacity), so the shape-bounded cell that such a call uses decides. The variant's
 * can_implement (alignment, size limits) still applies per call. rows, cols >= 0. */
KS_API ks_status_t ks_which_shape(const char* op, const char* dtype, ks_backend_t backend, int64_t rows,
                                  int64_t cols, const char** variant, const char** reason);

/* The active routing table (docs/routing.md) as one JSON document: {"schema":
 * "kernscope-routing-active/1", "files": [...], "cells": [{"op", "backend", "arch", "dtype",
 * "rows": [min, max|null], "cols": [...], "order": [variant, ...], "basis": "measured" |
 * "heuristic", "source", "why", "table", "index"}, ...]}, first matching cell wins. The
 * tables compiled in, or the files KS_ROUTING_TABLE names (':'-separated, in order; they
 * replace the compiled-in tables). *json is static, valid for the process. A table that does
 * not parse: KS_ERROR_INVALID_ARGUMENT naming file and field. */
KS_API ks_status_t ks_routing_table(const char** json);

/* Pins `op` to the variant named `variant` for calls on this thread that run on
 * that variant's backend (calls on the other backend are routed as usual, so a CUDA
 * pin leaves the CPU reference usable; NULL variant: back to automatic selection;
 * NULL op and NULL variant: clear every pin; NULL op with a variant: KS_ERROR_INVALID_ARGUMENT). A pinned
 * variant that cannot run a call fails it with KS_ERROR_BACKEND_UNAVAILABLE and
 * the variant's reason. Used by tests, `ksctl check` and benchmarks to run every
 * variant, not only the selected one. Unknown op or variant names are
 * KS_ERROR_INVALID_ARGUMENT. An entry point without variants of its own pins the op it runs
 * (paged_attention_after_append: paged_attention's variants; so does ks_forced_variant). */
KS_API ks_status_t ks_force_variant(const char* op, const char* variant);
/* The variant pinned for `op` on this thread by ks_force_variant, in *variant (a static string,
 * valid for the process), or NULL when `op` is not pinned; e.g. to put a caller's pin back after
 * pinning another variant for a while. Unknown or NULL op, or NULL variant:
 * KS_ERROR_INVALID_ARGUMENT (and *variant is left as it was). */
KS_API ks_status_t ks_forced_variant(const char* op, const char** variant);

/* Deterministic (batch-invariant) mode, process-wide: when enabled, every op computes a
 * row's result in an order that depends only on that row's length (and pointer
 * alignment), never on how many rows the call holds or where the row sits, so a row
 * alone and the same row inside any batch are bitwise equal. Variants that cannot
 * promise it (cuBLASLt gemm, cluster-split attention) are skipped, and softmax keeps
 * to its row-group kernel. Starts enabled when the environment has KS_DETERMINISTIC=1.
 * Which ops are batch-invariant by default: docs/contracts.md ("Summation order"). */
KS_API ks_status_t ks_set_deterministic(int enabled);
KS_API int ks_deterministic(void);

/* The launch configuration (block shape, vector width, cluster size, ...) of
 * this thread's last CUDA launch of `op`, as text; "" if none. For benchmarks
 * and diagnostics; valid until the next call on this thread. */
KS_API const char* ks_last_launch_config(const char* op);

/* ---- the five core operators ------------------------------------------ */

/* out[..., H] = x * rsqrt(mean(x^2) + eps) * weight.
 * x: [..., H] (H > 0); weight: [H]; out: same shape as x. fp16/bf16/fp32.
 * out may be x itself (same data and shape) for in-place use; any other overlap
 * of out with x or weight is rejected. eps: finite, > 0 (after rounding to fp32). */
KS_API ks_status_t ks_rms_norm(DLTensor* out, const DLTensor* x, const DLTensor* weight,
                               double eps, ks_backend_t backend, ks_stream_t stream);

/* In place: s = x + residual (FP32); residual = round(s);
 * x = round(s * rsqrt(mean(s^2) + eps) * weight) using the unrounded s.
 * x, residual: [..., H], same shape; weight: [H]. The three must not overlap. */
KS_API ks_status_t ks_fused_add_rms_norm(DLTensor* x, DLTensor* residual, const DLTensor* weight,
                                         double eps, ks_backend_t backend, ks_stream_t stream);

/* out[..., D] = silu(x[..., :D]) * x[..., D:]. x: [..., 2D] (2D > 0, even);
 * out: [..., D]; out must not overlap x. */
KS_API ks_status_t ks_silu_and_mul(DLTensor* out, const DLTensor* x, ks_backend_t backend,
                                   ks_stream_t stream);

/* out[n] = sum_h weight[n, h] * x[h] (FP32 accumulation).
 * x: [H] (H > 0); weight: [N, H]; out: [N] (N may be 0). x and weight may share
 * storage (read-only); out must not overlap either. */
KS_API ks_status_t ks_gemv(DLTensor* out, const DLTensor* x, const DLTensor* weight,
                           ks_backend_t backend, ks_stream_t stream);

/* out = softmax(x) along the last dim, as torch.softmax on the fp32 upcast.
 * Rows with NaN or +inf, and rows all -inf, give NaN. x: [..., H] (H > 0);
 * out: same shape; out may be x itself, other overlap rejected. */
KS_API ks_status_t ks_softmax(DLTensor* out, const DLTensor* x, ks_backend_t backend,
                              ks_stream_t stream);

/* ---- model-path operators ---------------------------------------------- */

/* out[..., hidden] = table[ids[...], :]. ids: int32 or int64, any shape;
 * table_format KS_QTYPE_NONE: table is dense [vocab, hidden] in out's dtype
 * (rows copied exactly); otherwise table is uint8 [vocab, row_bytes] in that
 * packed format and rows are dequantized (FP32) then rounded to out's dtype.
 * An id < 0 or >= vocab is KS_ERROR_INVALID_ARGUMENT (nothing written). */
KS_API ks_status_t ks_embedding(DLTensor* out, const DLTensor* ids, const DLTensor* table,
                                ks_qtype_t table_format, ks_backend_t backend,
                                ks_stream_t stream);

/* out[rows, cols] = dequant(packed) rounded to out's dtype (fp16/bf16/fp32).
 * packed: uint8 [rows, row_bytes], row_bytes = cols / block_size * block_bytes. */
KS_API ks_status_t ks_dequantize(DLTensor* out, const DLTensor* packed, ks_qtype_t qtype,
                                 ks_backend_t backend, ks_stream_t stream);

/* out[M, N] = a[M, K] @ b[N, K]^T (b in nn.Linear layout), FP32 accumulation.
 * a may be [..., K] with out [..., N] (any leading dims, 16 dims at most, M their product, as
 * torch.nn.functional.linear; each row as in the 2-D reshape).
 * a, b, out: same float dtype; out must not overlap a or b. */
KS_API ks_status_t ks_gemm(DLTensor* out, const DLTensor* a, const DLTensor* b,
                           ks_backend_t backend, ks_stream_t stream);

/* out[M, N] = x[M, K] @ dequant(weight)^T, computed from the packed blocks.
 * x may be [..., K] with out [..., N] (any leading dims, M their product; also for
 * ks_quant_matmul_a8 and the two fused forms below, not for the RoPE fusion).
 * weight: uint8 [N, row_bytes] in qtype; x, out: same float dtype.
 * Each weight element is dequantized in FP32 (contract in docs/contracts.md),
 * products and sums in FP32, one rounding to out's dtype.
 * weight is read-only and, on CUDA with programmatic dependent launch, may be read before the
 * kernel queued just before this call on the stream finishes: do not write it with that
 * kernel (also for the two fused forms below; docs/contracts.md, quant_matmul). */
KS_API ks_status_t ks_quant_matmul(DLTensor* out, const DLTensor* x, const DLTensor* weight,
                                   ks_qtype_t qtype, ks_backend_t backend, ks_stream_t stream);

/* W4A8 / W8A8 GEMV/GEMM: out[M, N] = x[M, K] @ dequant(weight)^T with x quantized to int8 per
 * block of 32 (llama.cpp's Q8_1 activations): per block d = max|x| / 127, codes
 * rint(x * (127 / max|x|)) (the factor rounded to FP32 first; ties to even), so x is read as
 * d * code (an absolute error of up to max|x| / 254 of its block per element). Each block's dot product is an exact int32 sum of code products; its value
 * d_w * d * S (+ m_w * d * Q for Q4_1) is formed in FP32, the blocks are summed in FP32 in a fixed
 * order (every backend and variant gives the same bits, NaN payloads aside), one rounding to out's dtype. A block of x holding NaN or +-inf makes its row's
 * outputs NaN; blocks with max|x| < 1.5e-36 count as zero.
 * x, out: same float dtype (fp32/fp16/bf16), x [M, K], out [M, N]; weight: uint8 [N, row_bytes] in
 * qtype, which must be Q4_0, Q4_1 or Q8_0 (else KS_ERROR_INVALID_ARGUMENT naming qtype). Other
 * checks and the read-only-weights rule as ks_quant_matmul.
 * Contract: docs/contracts.md#quant_matmul_a8. */
KS_API ks_status_t ks_quant_matmul_a8(DLTensor* out, const DLTensor* x, const DLTensor* weight,
                                      ks_qtype_t qtype, ks_backend_t backend, ks_stream_t stream);

/* Decode-step fusion: the (fused add +) RMS norm of a row, then quant_matmul on it, in one
 * kernel (no normalized copy goes through memory).
 *   residual: [M, K]; norm_weight: [K]; weight: uint8 [N, row_bytes] in qtype; out: [M, N].
 *   (residual, x and residual_out may be [..., K] with out [..., N]: M = the leading dims' product.)
 *   x == NULL:  h = round(rms_norm(residual, norm_weight, eps)); residual_out must be NULL.
 *   x != NULL:  [M, K]; residual_out is required; s = fp32(x) + fp32(residual);
 *               residual_out[M, K] = round(s);
 *               h = round(s * rsqrt(mean(s^2) + eps) * fp32(norm_weight))   (s unrounded),
 *               exactly fused_add_rms_norm's values, written to residual_out instead of in place.
 *   out = quant_matmul(h, weight): FP32 products and sums, one rounding to out's dtype.
 * Equals rms_norm / fused_add_rms_norm followed by ks_quant_matmul up to the FP32 summation
 * order of the sum of squares. Same float dtype for x, residual, norm_weight, out and
 * residual_out. out and residual_out must not overlap any input or each other (residual_out
 * is a second buffer: other rows' blocks still read residual while it is written).
 * Contract: docs/contracts.md#fused_add_rms_norm_quant_matmul.
 * Errors (nothing written): KS_ERROR_INVALID_ARGUMENT for shapes, weight's bytes per row
 * for K, an unknown qtype, eps, x without residual_out or residual_out without x, and
 * overlaps; KS_ERROR_UNSUPPORTED_DTYPE for residual not fp16/bf16/fp32 or a mismatched
 * dtype; KS_ERROR_UNSUPPORTED_DEVICE for mixed devices; KS_ERROR_BACKEND_UNAVAILABLE when
 * the backend cannot take the call (CUDA: element-aligned data; every qtype, the dense ones on the
 * default variant only). */
KS_API ks_status_t ks_fused_add_rms_norm_quant_matmul(DLTensor* out, DLTensor* residual_out, const DLTensor* x,
                                                      const DLTensor* residual, const DLTensor* norm_weight,
                                                      double eps, const DLTensor* weight, ks_qtype_t qtype,
                                                      ks_backend_t backend, ks_stream_t stream);

/* Decode-step fusion: silu_and_mul of a gate/up row, then quant_matmul on it, in one kernel.
 *   gate_up: [M, 2K] (gate = [:, :K], up = [:, K:]); weight: uint8 [N, row_bytes] in qtype;
 *   out: [M, N] (gate_up may be [..., 2K] with out [..., N]: M = the leading dims' product).
 *   h = round(silu_and_mul(gate_up)) (ks_silu_and_mul's values);
 *   out = quant_matmul(h, weight). Equals ks_silu_and_mul followed by ks_quant_matmul.
 *   out must not overlap gate_up or weight.
 * Contract: docs/contracts.md#silu_and_mul_quant_matmul.
 * Errors (nothing written): KS_ERROR_INVALID_ARGUMENT for shapes (gate_up's columns odd or
 * not twice weight's K), an unknown qtype and overlaps; KS_ERROR_UNSUPPORTED_DTYPE for
 * gate_up not fp16/bf16/fp32 or out of another dtype; KS_ERROR_UNSUPPORTED_DEVICE for mixed
 * devices; KS_ERROR_BACKEND_UNAVAILABLE as ks_fused_add_rms_norm_quant_matmul. */
KS_API ks_status_t ks_silu_and_mul_quant_matmul(DLTensor* out, const DLTensor* gate_up, const DLTensor* weight,
                                                ks_qtype_t qtype, ks_backend_t backend, ks_stream_t stream);

/* Rotary position embedding, in place on q and (optionally) k.
 * q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim] or NULL;
 * positions: int32/int64 [num_tokens]. The first rotary_dim (even, 0 < rotary_dim
 * <= head_dim) features of each head rotate; the rest pass through.
 * inv_freq[i] = fp32(theta^(-2i/rotary_dim)); angle = fp32(pos) * inv_freq[i] in FP32.
 * is_neox != 0: pairs (i, i + rotary_dim/2); else interleaved pairs (2i, 2i+1). */
KS_API ks_status_t ks_rotary_embedding(DLTensor* q, DLTensor* k, const DLTensor* positions,
                                       int64_t rotary_dim, double theta, int is_neox,
                                       ks_backend_t backend, ks_stream_t stream);

/* Write k/v rows into a paged cache: for token t with slot = slot_mapping[t] >= 0,
 * k_cache[slot] = k[t], v_cache[slot] = v[t]; slot -1 is skipped.
 * k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: int32/int64 [num_tokens];
 * k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (slot = block *
 * block_size + offset). A slot >= num_blocks * block_size or < -1 is rejected. */
KS_API ks_status_t ks_kv_cache_append(DLTensor* k_cache, DLTensor* v_cache, const DLTensor* k,
                                      const DLTensor* v, const DLTensor* slot_mapping,
                                      ks_backend_t backend, ks_stream_t stream);

/* Decode-step fusion: ks_rotary_embedding on q and k, then ks_kv_cache_append of the rotated
 * k and of v, in one pass (one kernel on CUDA). Arguments as in those two functions (k must be
 * given, and is both rotated in place and the appended key rows); the result is theirs, in
 * that order. v must not overlap q or k, and the caches must not overlap q or positions
 * (the one pass reads and writes them in no fixed order); slot_mapping must not overlap q
 * or k. Contract: docs/contracts.md#rotary_embedding_kv_append.
 * Errors (nothing written): every error of the two functions (KS_ERROR_INVALID_ARGUMENT,
 * KS_ERROR_UNSUPPORTED_DTYPE, KS_ERROR_UNSUPPORTED_DEVICE), KS_ERROR_INVALID_ARGUMENT for k
 * NULL and the overlaps above; KS_ERROR_BACKEND_UNAVAILABLE on CUDA for rotary_dim > 1024. */
KS_API ks_status_t ks_rotary_embedding_kv_append(DLTensor* q, DLTensor* k, const DLTensor* v,
                                                 const DLTensor* positions, int64_t rotary_dim, double theta,
                                                 int is_neox, DLTensor* k_cache, DLTensor* v_cache,
                                                 const DLTensor* slot_mapping, ks_backend_t backend,
                                                 ks_stream_t stream);

/* Decode-step fusion for one token: ks_fused_add_rms_norm_quant_matmul into out, then
 * ks_rotary_embedding_kv_append on out's column slices q = [:, 0 : H D], k = [:, H D : (H + KVH) D]
 * and v = [:, (H + KVH) D :] seen as [1, H, D], [1, KVH, D], [1, KVH, D] (H = num_heads,
 * KVH = num_kv_heads, D = head_dim = N / (H + 2 KVH)), in one kernel on CUDA where it can.
 *   residual, x, residual_out, norm_weight, eps, weight, qtype: as in
 *   ks_fused_add_rms_norm_quant_matmul, with one row (M = 1; M = 0 does nothing);
 *   out: [1, N], N = weight's rows = (H + 2 KVH) D; on return q and k in out are rotated;
 *   positions, rotary_dim, theta, is_neox, k_cache, v_cache, slot_mapping: as in
 *   ks_rotary_embedding_kv_append (slot_mapping: [1] or [0]).
 * The result is bit for bit the two calls' (each value rounded to out's dtype after the
 * matmul, then rotated in FP32 and rounded again). Contract:
 * docs/contracts.md#fused_add_rms_norm_quant_matmul_rope_kv_append.
 * Errors (nothing written): every error of the two functions, named under this one;
 * KS_ERROR_INVALID_ARGUMENT for more than one row, num_heads or num_kv_heads <= 0 or > 2^40,
 * N not a multiple of H + 2 KVH, the caches overlapping the matmul's tensors or positions, and
 * positions or slot_mapping overlapping out or residual_out. CUDA runs one fused kernel for
 * interleaved pairs (is_neox = 0), an even head_dim, K <= 2720, 16-byte aligned rows and
 * rotary_dim <= 1024, and the two calls otherwise. */
KS_API ks_status_t ks_fused_add_rms_norm_quant_matmul_rope_kv_append(
    DLTensor* out, DLTensor* residual_out, const DLTensor* x, const DLTensor* residual, const DLTensor* norm_weight,
    double eps, const DLTensor* weight, ks_qtype_t qtype, int64_t num_heads, int64_t num_kv_heads,
    const DLTensor* positions, int64_t rotary_dim, double theta, int is_neox, DLTensor* k_cache, DLTensor* v_cache,
    const DLTensor* slot_mapping, ks_backend_t backend, ks_stream_t stream);

/* Attention of each query row over a paged KV cache (decode; also causal prefill
 * by giving each prompt token its own context length).
 * out, q: [num_tokens, num_heads, head_dim]; k_cache, v_cache: as in
 * ks_kv_cache_append; block_tables: int32 [num_seqs, max_blocks_per_seq];
 * seq_ids: int32 [num_tokens] (token t reads block_tables[seq_ids[t]]), or NULL
 * meaning seq t for token t (num_seqs == num_tokens); context_lens: int32
 * [num_tokens], keys 0..context_lens[t]-1 are visible (0 gives a zero output row).
 * GQA: query head h reads kv head h / (num_heads / num_kv_heads).
 * scores = scale * q.k in FP32, FP32 softmax, FP32 weighted sum of V. */
KS_API ks_status_t ks_paged_attention(DLTensor* out, const DLTensor* q, const DLTensor* k_cache,
                                      const DLTensor* v_cache, const DLTensor* block_tables,
                                      const DLTensor* seq_ids, const DLTensor* context_lens,
                                      double scale, ks_backend_t backend, ks_stream_t stream);

/* ks_paged_attention for the call right after the one that appended the step's keys on the
 * same stream (a decode step's ks_kv_cache_append, ks_rotary_embedding_kv_append or
 * ks_fused_add_rms_norm_quant_matmul_rope_kv_append), with the caller's promise, for
 * fresh_keys >= 1: for every token t, the kernel launched just before this call on `stream`
 * writes no k_cache or v_cache row that t reads at a position below
 * context_lens[t] - fresh_keys, and none of block_tables, seq_ids and context_lens (and the
 * kernels before it finished their writes before it let its dependents launch, as every
 * kernscope kernel does). CUDA may then read those tensors and the older keys before that
 * kernel has finished (programmatic dependent launch); q and the fresh keys are read after it.
 * fresh_keys = 0 makes no promise (ks_paged_attention exactly).
 * The result is bit for bit ks_paged_attention's whatever fresh_keys is; if the promise is
 * broken, CUDA may read a row, a length or a block-table entry before it is written (wrong rows;
 * for cuda_mma_cluster also a hung launch or a split counter left wrong for later calls: the
 * contract's "A broken promise"). Arguments and errors as in
 * ks_paged_attention, validated under this function's name (the dispatch, its errors, pins and
 * launch records are paged_attention's), and KS_ERROR_INVALID_ARGUMENT for
 * fresh_keys < 0. Contract: docs/contracts.md#paged_attention_after_append. */
KS_API ks_status_t ks_paged_attention_after_append(DLTensor* out, const DLTensor* q, const DLTensor* k_cache,
                                                   const DLTensor* v_cache, const DLTensor* block_tables,
                                                   const DLTensor* seq_ids, const DLTensor* context_lens,
                                                   double scale, int64_t fresh_keys, ks_backend_t backend,
                                                   ks_stream_t stream);

/* Decode-step fusion: ks_rotary_embedding_kv_append(q, k, v, positions, rotary_dim, theta,
 * is_neox, k_cache, v_cache, slot_mapping), then ks_paged_attention(out, q, k_cache, v_cache,
 * block_tables, seq_ids, context_lens, scale): one kernel on CUDA where it can, which rotates
 * each token's q and new key in registers and reads that key from them instead of the cache.
 *   out: [num_tokens, num_heads, head_dim]; q, k, v, positions, rotary_dim, theta, is_neox,
 *   k_cache, v_cache, slot_mapping: as in ks_rotary_embedding_kv_append (on return q and k are
 *   rotated and the caches hold the new rows, as after that call); block_tables, seq_ids,
 *   context_lens, scale: as in ks_paged_attention.
 * The result is bit for bit the two calls' (on CUDA: with paged_attention's cuda_gqa_cluster;
 * automatic routing may send 16-bit attention to cuda_mma_cluster) when no token reads a cache
 * slot that another token of the call appends (a decode step: each token is the newest
 * position of its own sequence). Otherwise the CPU's result is still the two calls', and
 * CUDA's fused kernel may read such a slot before or after it is written.
 * Contract: docs/contracts.md#rotary_embedding_kv_append_paged_attention.
 * Errors (nothing written): every error of the two functions, named under this one;
 * KS_ERROR_INVALID_ARGUMENT for out overlapping q, k, v, positions, slot_mapping or the
 * caches, and block_tables, seq_ids or context_lens overlapping q, k or the caches. CUDA runs
 * the fused kernel where cuda_gqa_cluster serves the attention (head_dim a multiple of 16
 * bytes' elements and at most 32 of them, num_heads / num_kv_heads <= 8, 16-byte aligned q,
 * out and caches, sm_90), v is 16-byte aligned, slot_mapping has one entry per token and
 * rotary_dim <= 1024, and the two calls otherwise. */
KS_API ks_status_t ks_rotary_embedding_kv_append_paged_attention(
    DLTensor* out, DLTensor* q, DLTensor* k, const DLTensor* v, const DLTensor* positions, int64_t rotary_dim,
    double theta, int is_neox, DLTensor* k_cache, DLTensor* v_cache, const DLTensor* slot_mapping,
    const DLTensor* block_tables, const DLTensor* seq_ids, const DLTensor* context_lens, double scale,
    ks_backend_t backend, ks_stream_t stream);

/* Attention over packed variable-length sequences (the varlen layout: no cache, no padding):
 * q [total_q, num_heads, head_dim], k and v [total_k, num_kv_heads, head_dim], out like q;
 * cu_seqlens_q / cu_seqlens_k int32 [num_seqs + 1], non-decreasing from 0 to total_q / total_k:
 * sequence s owns query rows cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1 and key rows likewise.
 * causal != 0: query i of a sequence with len_q queries and len_k keys sees keys
 * j <= i + len_k - len_q (bottom-right aligned, so the last query sees every key); a query
 * that sees no key gets a zero row. GQA: query head h reads kv head h / (num_heads / num_kv_heads).
 * scores = scale * q.k in FP32, FP32 softmax, FP32 weighted sum of V, one rounding.
 * Errors (nothing written): KS_ERROR_INVALID_ARGUMENT for shapes, num_heads not a multiple of
 * num_kv_heads, host offsets that do not start at 0, decrease or miss the totals, a scale not
 * finite in fp32, out overlapping an input; KS_ERROR_UNSUPPORTED_DTYPE for q not
 * fp16/bf16/fp32, k/v/out not q's dtype, cu_seqlens not int32. Contract: docs/contracts.md. */
KS_API ks_status_t ks_varlen_attention(DLTensor* out, const DLTensor* q, const DLTensor* k, const DLTensor* v,
                                       const DLTensor* cu_seqlens_q, const DLTensor* cu_seqlens_k, double scale,
                                       int causal, ks_backend_t backend, ks_stream_t stream);

/* out[...] = index of the maximum of x[..., :] (x: [..., V], V > 0, any number of leading
 * dims; int64 out: x's shape without its last dim, so [rows] for [rows, V] and a 0-d index for
 * x: [V], as torch.argmax(x, dim=-1)). Ties: the lowest index. A row holding NaN returns the
 * index of its first NaN (as torch.argmax). */
KS_API ks_status_t ks_argmax(DLTensor* out, const DLTensor* x, ks_backend_t backend,
                             ks_stream_t stream);

/* Samples one token id per row of logits (temperature, then top-k, then top-p), the
 * same ids on every backend and every replay for the same (seed, offset)
 * (docs/contracts.md#sample):
 *   logits [..., vocab] fp16/bf16/fp32, vocab > 0 (any number of leading dims; rows = their
 *     product, row r the r-th in row-major order); out int64 [...] (logits' shape without its
 *     last dim: [rows] for [rows, vocab], 0-d for [vocab]);
 *   valid uint8 [...] (out's shape) or NULL: 1, or 0 for a row without a distribution: NaN or +inf,
 *     only -inf, a finite logit whose logit / temperature overflows to +inf (a tiny
 *     temperature), or finite logits whose quotients all round to -inf (its out is 0, the
 *     placeholder id; other rows are unaffected);
 *   seed_offset int64 [2] = {seed, offset} on logits' device, read only: the row r
 *     draw is Philox4x32-10(key = seed, counter = (offset, r)); advance offset between
 *     steps (a CUDA graph replays the same tensor, so updating it changes the draw);
 *   temperature finite, > 0; top_k >= 0 (0, or >= vocab: off); top_p in (0, 1] (1: off).
 * Ties at the top-k and top-p cut-offs keep the lower index. */
KS_API ks_status_t ks_sample(DLTensor* out, DLTensor* valid, const DLTensor* logits,
                             const DLTensor* seed_offset, double temperature, int64_t top_k,
                             double top_p, ks_backend_t backend, ks_stream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KERNSCOPE_H_ */
