/* cgo shim of the kernscope Go binding: builds DLTensors on the C side from descriptors that
 * hold no pointers plus data pointers passed as call arguments, as cgo's pointer rules
 * require (Go memory handed to C must not contain Go pointers). */
#ifndef KSGO_H_
#define KSGO_H_

#include <stdint.h>

#include <kernscope/kernscope.h>

#define KSGO_MAX_DIMS 8

typedef struct {
  int32_t ndim;
  int32_t has_strides;
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
  int32_t device_type;
  int32_t device_id;
  uint64_t byte_offset;
  uint64_t device_ptr; /* used when the data argument is NULL (device or raw memory) */
  int64_t shape[KSGO_MAX_DIMS];
  int64_t strides[KSGO_MAX_DIMS];
} ksgo_desc;

/* d[i] describes the i-th tensor argument, in the op's argument order. A NULL desc pointer
 * for an optional tensor (rotary k, paged_attention seq_ids, the fused norm's x and residual_out)
 * passes NULL. */
ks_status_t ksgo_rms_norm(ksgo_desc* d, void* out, void* x, void* weight, double eps, int backend, uintptr_t stream);
ks_status_t ksgo_fused_add_rms_norm(ksgo_desc* d, void* x, void* residual, void* weight, double eps, int backend,
                                    uintptr_t stream);
ks_status_t ksgo_silu_and_mul(ksgo_desc* d, void* out, void* x, int backend, uintptr_t stream);
ks_status_t ksgo_gemv(ksgo_desc* d, void* out, void* x, void* weight, int backend, uintptr_t stream);
ks_status_t ksgo_softmax(ksgo_desc* d, void* out, void* x, int backend, uintptr_t stream);
ks_status_t ksgo_embedding(ksgo_desc* d, void* out, void* ids, void* table, int table_format, int backend,
                           uintptr_t stream);
ks_status_t ksgo_dequantize(ksgo_desc* d, void* out, void* packed, int qtype, int backend, uintptr_t stream);
ks_status_t ksgo_gemm(ksgo_desc* d, void* out, void* a, void* b, int backend, uintptr_t stream);
ks_status_t ksgo_quant_matmul(ksgo_desc* d, void* out, void* x, void* weight, int qtype, int backend,
                              uintptr_t stream);
ks_status_t ksgo_quant_matmul_a8(ksgo_desc* d, void* out, void* x, void* weight, int qtype, int backend,
                                 uintptr_t stream);
ks_status_t ksgo_fused_add_rms_norm_quant_matmul(ksgo_desc* d, void* out, int has_residual_out, void* residual_out,
                                                int has_x, void* x, void* residual, void* norm_weight, double eps,
                                                void* weight, int qtype, int backend, uintptr_t stream);
ks_status_t ksgo_silu_and_mul_quant_matmul(ksgo_desc* d, void* out, void* gate_up, void* weight, int qtype, int backend,
                                           uintptr_t stream);
ks_status_t ksgo_rotary_embedding(ksgo_desc* d, void* q, int has_k, void* k, void* positions, int64_t rotary_dim,
                                  double theta, int is_neox, int backend, uintptr_t stream);
ks_status_t ksgo_kv_cache_append(ksgo_desc* d, void* k_cache, void* v_cache, void* k, void* v, void* slot_mapping,
                                 int backend, uintptr_t stream);
ks_status_t ksgo_rotary_embedding_kv_append(ksgo_desc* d, void* q, void* k, void* v, void* positions, int64_t rotary_dim,
                                            double theta, int is_neox, void* k_cache, void* v_cache, void* slot_mapping,
                                            int backend, uintptr_t stream);
ks_status_t ksgo_fused_add_rms_norm_quant_matmul_rope_kv_append(
    ksgo_desc* d, void* out, int has_residual_out, void* residual_out, int has_x, void* x, void* residual,
    void* norm_weight, double eps, void* weight, int qtype, int64_t num_heads, int64_t num_kv_heads, void* positions,
    int64_t rotary_dim, double theta, int is_neox, void* k_cache, void* v_cache, void* slot_mapping, int backend,
    uintptr_t stream);
ks_status_t ksgo_paged_attention(ksgo_desc* d, void* out, void* q, void* k_cache, void* v_cache, void* block_tables,
                                 int has_seq_ids, void* seq_ids, void* context_lens, double scale, int backend,
                                 uintptr_t stream);
ks_status_t ksgo_paged_attention_after_append(ksgo_desc* d, void* out, void* q, void* k_cache, void* v_cache,
                                              void* block_tables, int has_seq_ids, void* seq_ids, void* context_lens,
                                              double scale, int64_t fresh_keys, int backend, uintptr_t stream);
ks_status_t ksgo_rotary_embedding_kv_append_paged_attention(
    ksgo_desc* d, void* out, void* q, void* k, void* v, void* positions, int64_t rotary_dim, double theta, int is_neox,
    void* k_cache, void* v_cache, void* slot_mapping, void* block_tables, int has_seq_ids, void* seq_ids,
    void* context_lens, double scale, int backend, uintptr_t stream);
ks_status_t ksgo_argmax(ksgo_desc* d, void* out, void* x, int backend, uintptr_t stream);
ks_status_t ksgo_varlen_attention(ksgo_desc* d, void* out, void* q, void* k, void* v, void* cu_q, void* cu_k,
                                  double scale, int causal, int backend, uintptr_t stream);
ks_status_t ksgo_sample(ksgo_desc* d, void* out, int has_valid, void* valid, void* logits, void* seed_offset,
                        double temperature, int64_t top_k, double top_p, int backend, uintptr_t stream);

#endif /* KSGO_H_ */
