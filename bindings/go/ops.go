package kernscope

/*
#include "ksgo.h"
*/
import "C"

import "unsafe"

type callConfig struct {
	backend Backend
	stream  uintptr
}

// Option configures one op call.
type Option func(*callConfig)

// WithBackend runs the call on b (default BackendAuto: by the tensors' device).
func WithBackend(b Backend) Option { return func(c *callConfig) { c.backend = b } }

// WithStream runs the call on a CUDA stream (a cudaStream_t; 0 is the default stream).
func WithStream(stream uintptr) Option { return func(c *callConfig) { c.stream = stream } }

func config(opts []Option) (C.int, C.uintptr_t) {
	c := callConfig{backend: BackendAuto}
	for _, o := range opts {
		o(&c)
	}
	return C.int(c.backend), C.uintptr_t(c.stream)
}

type arg struct {
	name string
	t    *Tensor
}

// describeAll fills one descriptor per argument; a nil tensor in an optional slot (named with
// a trailing '?') stays zero.
func describeAll(op string, d []C.ksgo_desc, args ...arg) error {
	for i, a := range args {
		if a.name[len(a.name)-1] == '?' {
			if a.t == nil {
				continue
			}
			a.name = a.name[:len(a.name)-1]
		}
		if err := a.t.describe(op, a.name, &d[i]); err != nil {
			return err
		}
	}
	return nil
}

func dataOf(t *Tensor) unsafe.Pointer {
	if t == nil {
		return nil
	}
	return t.data
}

func flag(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// RMSNorm: out[..., H] = x * rsqrt(mean(x^2) + eps) * weight. out may be x (in place).
func RMSNorm(out, x, weight *Tensor, eps float64, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("rms_norm", d[:], arg{"out", out}, arg{"x", x}, arg{"weight", weight}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_rms_norm(&d[0], out.data, x.data, weight.data, C.double(eps), b, s)
	})
}

// FusedAddRMSNorm, in place: s = x + residual; residual = s; x = rms_norm(s) * weight.
func FusedAddRMSNorm(x, residual, weight *Tensor, eps float64, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("fused_add_rms_norm", d[:], arg{"x", x}, arg{"residual", residual}, arg{"weight", weight}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_fused_add_rms_norm(&d[0], x.data, residual.data, weight.data, C.double(eps), b, s)
	})
}

// SiluAndMul: out[..., D] = silu(x[..., :D]) * x[..., D:].
func SiluAndMul(out, x *Tensor, opts ...Option) error {
	var d [2]C.ksgo_desc
	if err := describeAll("silu_and_mul", d[:], arg{"out", out}, arg{"x", x}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t { return C.ksgo_silu_and_mul(&d[0], out.data, x.data, b, s) })
}

// Gemv: out[n] = sum_h weight[n, h] * x[h].
func Gemv(out, x, weight *Tensor, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("gemv", d[:], arg{"out", out}, arg{"x", x}, arg{"weight", weight}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t { return C.ksgo_gemv(&d[0], out.data, x.data, weight.data, b, s) })
}

// Softmax along the last dim. out may be x (in place).
func Softmax(out, x *Tensor, opts ...Option) error {
	var d [2]C.ksgo_desc
	if err := describeAll("softmax", d[:], arg{"out", out}, arg{"x", x}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t { return C.ksgo_softmax(&d[0], out.data, x.data, b, s) })
}

// Embedding: out[..., hidden] = table[ids[...], :], dense (QTypeNone) or packed rows.
func Embedding(out, ids, table *Tensor, tableFormat QType, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("embedding", d[:], arg{"out", out}, arg{"ids", ids}, arg{"table", table}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_embedding(&d[0], out.data, ids.data, table.data, C.int(tableFormat), b, s)
	})
}

// Dequantize: out[rows, cols] = dequant(packed).
func Dequantize(out, packed *Tensor, qtype QType, opts ...Option) error {
	var d [2]C.ksgo_desc
	if err := describeAll("dequantize", d[:], arg{"out", out}, arg{"packed", packed}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t { return C.ksgo_dequantize(&d[0], out.data, packed.data, C.int(qtype), b, s) })
}

// Gemm: out[M, N] = a[M, K] @ b[N, K]^T. a may be [..., K] with out [..., N] (any leading dims, M
// their product, each row as in the 2-D reshape; a 1-D a gives out [N]).
func Gemm(out, a, bm *Tensor, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("gemm", d[:], arg{"out", out}, arg{"a", a}, arg{"b", bm}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t { return C.ksgo_gemm(&d[0], out.data, a.data, bm.data, b, s) })
}

// QuantMatmul: out[M, N] = x[M, K] @ dequant(weight)^T from the packed blocks. x may be [..., K]
// with out [..., N], as Gemm (QuantMatmulA8 too).
func QuantMatmul(out, x, weight *Tensor, qtype QType, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("quant_matmul", d[:], arg{"out", out}, arg{"x", x}, arg{"weight", weight}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_quant_matmul(&d[0], out.data, x.data, weight.data, C.int(qtype), b, s)
	})
}

// QuantMatmulA8 is W4A8 / W8A8: QuantMatmul with x quantized to int8 per block of 32 (llama.cpp's
// Q8_1 activations). x [M, K] (float32, or fp16 / bf16 bits; K a multiple of 32), weight packed
// [N, K/32*blockBytes] (uint8) in qtype, which must be QTypeQ4_0, QTypeQ4_1 or QTypeQ8_0; out
// [M, N] in x's dtype. Per block of x: d = max|x| / 127, codes rint(x * 127 / max|x|) (ties to
// even); each block's dot product with the weight's codes is an exact int32 sum, its value formed
// in FP32, the blocks summed in FP32 in one fixed order: every backend gives the same bits. The
// result differs from QuantMatmul by up to about 1/254 of each x block's largest value per
// element. A NaN or +-Inf in a block of x makes every output of its row NaN; a block with
// max|x| < 1.5e-36 counts as zero. weight is read-only, with QuantMatmul's rule on CUDA. Errors
// (nothing written): another qtype (the message names qtype), shapes, a K that is not whole
// blocks, out overlapping an input (ErrInvalidArgument); mismatched dtypes, or a weight that is
// not uint8 (ErrUnsupportedDtype). Contract: docs/contracts.md#quant_matmul_a8.
func QuantMatmulA8(out, x, weight *Tensor, qtype QType, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("quant_matmul_a8", d[:], arg{"out", out}, arg{"x", x}, arg{"weight", weight}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_quant_matmul_a8(&d[0], out.data, x.data, weight.data, C.int(qtype), b, s)
	})
}

// FusedAddRMSNormQuantMatmul is the decode-step fusion of the (fused add +) RMS norm of each row
// and QuantMatmul on it, in one kernel: residual [M, K] (or [..., K] with out [..., N]), normWeight [K], weight packed [N, row_bytes]
// in qtype, out [M, N]. With x ([M, K]): s = x + residual (FP32); residualOut ([M, K], required)
// = round(s); out = quant_matmul(round(rms_norm(s) * normWeight)), FusedAddRMSNorm's values then
// QuantMatmul, with x and residual left unchanged. x nil: out = quant_matmul(round(rms_norm(residual)
// * normWeight)), and residualOut must be nil too. Errors (nothing written): residualOut without x
// (or x without residualOut), shapes, eps, overlap (out and residualOut overlap no input nor each
// other) are ErrInvalidArgument; mismatched float dtypes (or a weight that is not uint8)
// ErrUnsupportedDtype.
func FusedAddRMSNormQuantMatmul(out, residualOut, x, residual, normWeight *Tensor, eps float64, weight *Tensor,
	qtype QType, opts ...Option) error {
	var d [6]C.ksgo_desc
	args := []arg{{"out", out}, {"residual_out?", residualOut}, {"x?", x}, {"residual", residual},
		{"norm_weight", normWeight}, {"weight", weight}}
	if err := describeAll("fused_add_rms_norm_quant_matmul", d[:], args...); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_fused_add_rms_norm_quant_matmul(&d[0], out.data, flag(residualOut != nil), dataOf(residualOut),
			flag(x != nil), dataOf(x), residual.data, normWeight.data, C.double(eps), weight.data, C.int(qtype), b, s)
	})
}

// SiluAndMulQuantMatmul is the decode-step fusion of SiluAndMul of gateUp [M, 2K] or [..., 2K] (gate, then up)
// and QuantMatmul on it, in one kernel: out [M, N] = quant_matmul(round(silu(gate) * up), weight).
// Errors (nothing written): an odd last dim of gateUp, a K that is not whole blocks, bad shapes,
// out overlapping an input (ErrInvalidArgument).
func SiluAndMulQuantMatmul(out, gateUp, weight *Tensor, qtype QType, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("silu_and_mul_quant_matmul", d[:], arg{"out", out}, arg{"gate_up", gateUp},
		arg{"weight", weight}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_silu_and_mul_quant_matmul(&d[0], out.data, gateUp.data, weight.data, C.int(qtype), b, s)
	})
}

// RotaryEmbedding rotates q and (if not nil) k in place.
func RotaryEmbedding(q, k, positions *Tensor, rotaryDim int64, theta float64, isNeox bool, opts ...Option) error {
	var d [3]C.ksgo_desc
	if err := describeAll("rotary_embedding", d[:], arg{"q", q}, arg{"k?", k}, arg{"positions", positions}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_rotary_embedding(&d[0], q.data, flag(k != nil), dataOf(k), positions.data, C.int64_t(rotaryDim),
			C.double(theta), flag(isNeox), b, s)
	})
}

// KVCacheAppend writes k/v rows into a paged cache at slotMapping (slot -1 skipped).
func KVCacheAppend(kCache, vCache, k, v, slotMapping *Tensor, opts ...Option) error {
	var d [5]C.ksgo_desc
	if err := describeAll("kv_cache_append", d[:], arg{"k_cache", kCache}, arg{"v_cache", vCache}, arg{"k", k},
		arg{"v", v}, arg{"slot_mapping", slotMapping}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_kv_cache_append(&d[0], kCache.data, vCache.data, k.data, v.data, slotMapping.data, b, s)
	})
}

// RotaryEmbeddingKVAppend is the decode-step fusion of RotaryEmbedding of q and k, then
// KVCacheAppend of the rotated k and of v, in one pass (one kernel on CUDA): in place on q, k,
// kCache and vCache, bit for bit the two calls. q [num_tokens, num_heads, head_dim], k and v
// [num_tokens, num_kv_heads, head_dim] (k is required), positions int32/int64 [num_tokens], the
// caches [num_blocks, block_size, num_kv_heads, head_dim], slotMapping int32/int64 [n <= num_tokens]
// (slot -1 skipped). Errors (nothing written): every rule of the two ops, plus v overlapping q or k
// and a cache overlapping q or positions (ErrInvalidArgument); mismatched dtypes
// (ErrUnsupportedDtype).
func RotaryEmbeddingKVAppend(q, k, v, positions *Tensor, rotaryDim int64, theta float64, isNeox bool,
	kCache, vCache, slotMapping *Tensor, opts ...Option) error {
	var d [7]C.ksgo_desc
	if err := describeAll("rotary_embedding_kv_append", d[:], arg{"q", q}, arg{"k", k}, arg{"v", v},
		arg{"positions", positions}, arg{"k_cache", kCache}, arg{"v_cache", vCache},
		arg{"slot_mapping", slotMapping}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_rotary_embedding_kv_append(&d[0], q.data, k.data, v.data, positions.data, C.int64_t(rotaryDim),
			C.double(theta), flag(isNeox), kCache.data, vCache.data, slotMapping.data, b, s)
	})
}

// FusedAddRMSNormQuantMatmulRopeKVAppend is the decode-step fusion for one token of
// FusedAddRMSNormQuantMatmul into out, then RotaryEmbeddingKVAppend on out's column slices
// q = [:, 0 : H D], k = [:, H D : (H + KVH) D] and v = [:, (H + KVH) D :] seen as [1, H, D],
// [1, KVH, D], [1, KVH, D] (H = numHeads, KVH = numKVHeads, D = N / (H + 2 KVH)), in one kernel on
// CUDA where it can; bit for bit the two calls. residual [1, K] (one row; [0, K] does nothing), x,
// residualOut, normWeight, eps, weight and qtype as in FusedAddRMSNormQuantMatmul (x and residualOut
// both given or both nil); out [1, N] with N = weight's rows = (H + 2 KVH) D, its q and k rotated on
// return; positions, rotaryDim, theta, isNeox, kCache, vCache and slotMapping ([1] or [0]) as in
// RotaryEmbeddingKVAppend. Errors (nothing written): every rule of the two ops under this op's name,
// plus more than one row, numHeads or numKVHeads <= 0, N not a multiple of H + 2 KVH, and the caches,
// positions or slotMapping overlapping the matmul's tensors (ErrInvalidArgument); mismatched dtypes
// (ErrUnsupportedDtype).
func FusedAddRMSNormQuantMatmulRopeKVAppend(out, residualOut, x, residual, normWeight *Tensor, eps float64,
	weight *Tensor, qtype QType, numHeads, numKVHeads int64, positions *Tensor, rotaryDim int64, theta float64,
	isNeox bool, kCache, vCache, slotMapping *Tensor, opts ...Option) error {
	var d [10]C.ksgo_desc
	args := []arg{{"out", out}, {"residual_out?", residualOut}, {"x?", x}, {"residual", residual},
		{"norm_weight", normWeight}, {"weight", weight}, {"positions", positions}, {"k_cache", kCache},
		{"v_cache", vCache}, {"slot_mapping", slotMapping}}
	if err := describeAll("fused_add_rms_norm_quant_matmul_rope_kv_append", d[:], args...); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_fused_add_rms_norm_quant_matmul_rope_kv_append(&d[0], out.data, flag(residualOut != nil),
			dataOf(residualOut), flag(x != nil), dataOf(x), residual.data, normWeight.data, C.double(eps), weight.data,
			C.int(qtype), C.int64_t(numHeads), C.int64_t(numKVHeads), positions.data, C.int64_t(rotaryDim),
			C.double(theta), flag(isNeox), kCache.data, vCache.data, slotMapping.data, b, s)
	})
}

// PagedAttention: attention over a paged KV cache. seqIDs nil means sequence t for token t.
func PagedAttention(out, q, kCache, vCache, blockTables, seqIDs, contextLens *Tensor, scale float64, opts ...Option) error {
	var d [7]C.ksgo_desc
	if err := describeAll("paged_attention", d[:], arg{"out", out}, arg{"q", q}, arg{"k_cache", kCache},
		arg{"v_cache", vCache}, arg{"block_tables", blockTables}, arg{"seq_ids?", seqIDs},
		arg{"context_lens", contextLens}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_paged_attention(&d[0], out.data, q.data, kCache.data, vCache.data, blockTables.data,
			flag(seqIDs != nil), dataOf(seqIDs), contextLens.data, C.double(scale), b, s)
	})
}

// PagedAttentionAfterAppend is PagedAttention for the call right after the one that appended the
// step's keys on the same stream (KVCacheAppend, RotaryEmbeddingKVAppend or
// FusedAddRMSNormQuantMatmulRopeKVAppend). freshKeys >= 1 is the caller's promise that the kernel
// launched just before on this stream wrote, for every token t, no kCache or vCache row that t reads
// below contextLens[t] - freshKeys, and none of blockTables, seqIDs and contextLens: CUDA may then read
// the older keys before it ends (a broken promise may read a row before it is written). freshKeys 0
// makes no promise. The result is PagedAttention's, bit for bit, whatever freshKeys is. Errors
// (nothing written): PagedAttention's under this op's name (paged_attention_after_append), and
// freshKeys < 0 (ErrInvalidArgument).
func PagedAttentionAfterAppend(out, q, kCache, vCache, blockTables, seqIDs, contextLens *Tensor, scale float64,
	freshKeys int64, opts ...Option) error {
	var d [7]C.ksgo_desc
	if err := describeAll("paged_attention_after_append", d[:], arg{"out", out}, arg{"q", q}, arg{"k_cache", kCache},
		arg{"v_cache", vCache}, arg{"block_tables", blockTables}, arg{"seq_ids?", seqIDs},
		arg{"context_lens", contextLens}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_paged_attention_after_append(&d[0], out.data, q.data, kCache.data, vCache.data,
			blockTables.data, flag(seqIDs != nil), dataOf(seqIDs), contextLens.data, C.double(scale),
			C.int64_t(freshKeys), b, s)
	})
}

// RotaryEmbeddingKVAppendPagedAttention is the decode-step fusion of RotaryEmbeddingKVAppend(q, k,
// v, positions, rotaryDim, theta, isNeox, kCache, vCache, slotMapping), then PagedAttention(out, q,
// kCache, vCache, blockTables, seqIDs, contextLens, scale), in one kernel on CUDA where it can: q and
// k rotated in place, the caches given the new rows, out [num_tokens, num_heads, head_dim] the
// attention of the rotated q over the appended caches. seqIDs nil means sequence t for token t. Bit
// for bit the two calls when no token reads a cache slot that another token of the call appends (a
// decode step; the CPU is always the two calls). Errors (nothing written): every rule of the two ops
// under this op's name, plus out overlapping q, k, v, positions, slotMapping or the caches
// (ErrInvalidArgument); mismatched dtypes (ErrUnsupportedDtype).
func RotaryEmbeddingKVAppendPagedAttention(out, q, k, v, positions *Tensor, rotaryDim int64, theta float64,
	isNeox bool, kCache, vCache, slotMapping, blockTables, seqIDs, contextLens *Tensor, scale float64,
	opts ...Option) error {
	var d [11]C.ksgo_desc
	args := []arg{{"out", out}, {"q", q}, {"k", k}, {"v", v}, {"positions", positions}, {"k_cache", kCache},
		{"v_cache", vCache}, {"slot_mapping", slotMapping}, {"block_tables", blockTables}, {"seq_ids?", seqIDs},
		{"context_lens", contextLens}}
	if err := describeAll("rotary_embedding_kv_append_paged_attention", d[:], args...); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_rotary_embedding_kv_append_paged_attention(&d[0], out.data, q.data, k.data, v.data,
			positions.data, C.int64_t(rotaryDim), C.double(theta), flag(isNeox), kCache.data, vCache.data,
			slotMapping.data, blockTables.data, flag(seqIDs != nil), dataOf(seqIDs), contextLens.data,
			C.double(scale), b, s)
	})
}

// Argmax: out[r] (int64) = index of the maximum of x[r, :].
func Argmax(out, x *Tensor, opts ...Option) error {
	var d [2]C.ksgo_desc
	if err := describeAll("argmax", d[:], arg{"out", out}, arg{"x", x}); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t { return C.ksgo_argmax(&d[0], out.data, x.data, b, s) })
}

// VarlenAttention: attention over packed sequences (q [totalQ, heads, d], k/v [totalK, kvHeads, d],
// int32 offsets [numSeqs+1]); causal is the bottom-right aligned mask.
func VarlenAttention(out, q, k, v, cuSeqlensQ, cuSeqlensK *Tensor, scale float64, causal bool, opts ...Option) error {
	var d [6]C.ksgo_desc
	args := []arg{{"out", out}, {"q", q}, {"k", k}, {"v", v}, {"cu_seqlens_q", cuSeqlensQ}, {"cu_seqlens_k", cuSeqlensK}}
	if err := describeAll("varlen_attention", d[:], args...); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_varlen_attention(&d[0], out.data, q.data, k.data, v.data, cuSeqlensQ.data, cuSeqlensK.data,
			C.double(scale), flag(causal), b, s)
	})
}

// Sample: one token id per row of logits (int64 out): temperature, top-k (0: off), top-p
// (1: off), then a Philox4x32-10 draw keyed by seedOffset = [seed, offset] (int64 [2]).
// valid (uint8, may be nil) is set to 0 for a row without a distribution (its id is 0).
func Sample(out, valid, logits, seedOffset *Tensor, temperature float64, topK int64, topP float64,
	opts ...Option) error {
	var d [4]C.ksgo_desc
	args := []arg{{"out", out}, {"valid?", valid}, {"logits", logits}, {"seed_offset", seedOffset}}
	if err := describeAll("sample", d[:], args...); err != nil {
		return err
	}
	b, s := config(opts)
	return call(func() C.ks_status_t {
		return C.ksgo_sample(&d[0], out.data, flag(valid != nil), dataOf(valid), logits.data, seedOffset.data,
			C.double(temperature), C.int64_t(topK), C.double(topP), b, s)
	})
}
