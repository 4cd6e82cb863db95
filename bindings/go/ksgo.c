#include "ksgo.h"

#include <stddef.h>

static DLTensor mk(ksgo_desc* d, void* data) {
  DLTensor t;
  t.data = data != NULL ? data : (void*)(uintptr_t)d->device_ptr;
  t.device.device_type = (DLDeviceType)d->device_type;
  t.device.device_id = d->device_id;
  t.ndim = d->ndim;
  t.dtype.code = d->code;
  t.dtype.bits = d->bits;
  t.dtype.lanes = d->lanes;
  t.shape = d->shape;
  t.strides = d->has_strides ? d->strides : NULL;
  t.byte_offset = d->byte_offset;
  return t;
}

#define BK (ks_backend_t) backend
#define ST (ks_stream_t) stream

ks_status_t ksgo_rms_norm(ksgo_desc* d, void* out, void* x, void* weight, double eps, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), xt = mk(&d[1], x), w = mk(&d[2], weight);
  return ks_rms_norm(&o, &xt, &w, eps, BK, ST);
}

ks_status_t ksgo_fused_add_rms_norm(ksgo_desc* d, void* x, void* residual, void* weight, double eps, int backend,
                                    uintptr_t stream) {
  DLTensor xt = mk(&d[0], x), r = mk(&d[1], residual), w = mk(&d[2], weight);
  return ks_fused_add_rms_norm(&xt, &r, &w, eps, BK, ST);
}

ks_status_t ksgo_silu_and_mul(ksgo_desc* d, void* out, void* x, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), xt = mk(&d[1], x);
  return ks_silu_and_mul(&o, &xt, BK, ST);
}

ks_status_t ksgo_gemv(ksgo_desc* d, void* out, void* x, void* weight, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), xt = mk(&d[1], x), w = mk(&d[2], weight);
  return ks_gemv(&o, &xt, &w, BK, ST);
}

ks_status_t ksgo_softmax(ksgo_desc* d, void* out, void* x, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), xt = mk(&d[1], x);
  return ks_softmax(&o, &xt, BK, ST);
}

ks_status_t ksgo_embedding(ksgo_desc* d, void* out, void* ids, void* table, int table_format, int backend,
                           uintptr_t stream) {
  DLTensor o = mk(&d[0], out), i = mk(&d[1], ids), t = mk(&d[2], table);
  return ks_embedding(&o, &i, &t, (ks_qtype_t)table_format, BK, ST);
}

ks_status_t ksgo_dequantize(ksgo_desc* d, void* out, void* packed, int qtype, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), p = mk(&d[1], packed);
  return ks_dequantize(&o, &p, (ks_qtype_t)qtype, BK, ST);
}

ks_status_t ksgo_gemm(ksgo_desc* d, void* out, void* a, void* b, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), at = mk(&d[1], a), bt = mk(&d[2], b);
  return ks_gemm(&o, &at, &bt, BK, ST);
}

ks_status_t ksgo_quant_matmul(ksgo_desc* d, void* out, void* x, void* weight, int qtype, int backend,
                              uintptr_t stream) {
  DLTensor o = mk(&d[0], out), xt = mk(&d[1], x), w = mk(&d[2], weight);
  return ks_quant_matmul(&o, &xt, &w, (ks_qtype_t)qtype, BK, ST);
}

ks_status_t ksgo_quant_matmul_a8(ksgo_desc* d, void* out, void* x, void* weight, int qtype, int backend,
                                 uintptr_t stream) {
  DLTensor o = mk(&d[0], out), xt = mk(&d[1], x), w = mk(&d[2], weight);
  return ks_quant_matmul_a8(&o, &xt, &w, (ks_qtype_t)qtype, BK, ST);
}

ks_status_t ksgo_fused_add_rms_norm_quant_matmul(ksgo_desc* d, void* out, int has_residual_out, void* residual_out,
                                                int has_x, void* x, void* residual, void* norm_weight, double eps,
                                                void* weight, int qtype, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), ro = mk(&d[1], residual_out), xt = mk(&d[2], x), r = mk(&d[3], residual),
           nw = mk(&d[4], norm_weight), w = mk(&d[5], weight);
  return ks_fused_add_rms_norm_quant_matmul(&o, has_residual_out ? &ro : NULL, has_x ? &xt : NULL, &r, &nw, eps, &w,
                                            (ks_qtype_t)qtype, BK, ST);
}

ks_status_t ksgo_silu_and_mul_quant_matmul(ksgo_desc* d, void* out, void* gate_up, void* weight, int qtype, int backend,
                                           uintptr_t stream) {
  DLTensor o = mk(&d[0], out), g = mk(&d[1], gate_up), w = mk(&d[2], weight);
  return ks_silu_and_mul_quant_matmul(&o, &g, &w, (ks_qtype_t)qtype, BK, ST);
}

ks_status_t ksgo_rotary_embedding(ksgo_desc* d, void* q, int has_k, void* k, void* positions, int64_t rotary_dim,
                                  double theta, int is_neox, int backend, uintptr_t stream) {
  DLTensor qt = mk(&d[0], q), kt = mk(&d[1], k), p = mk(&d[2], positions);
  return ks_rotary_embedding(&qt, has_k ? &kt : NULL, &p, rotary_dim, theta, is_neox, BK, ST);
}

ks_status_t ksgo_kv_cache_append(ksgo_desc* d, void* k_cache, void* v_cache, void* k, void* v, void* slot_mapping,
                                 int backend, uintptr_t stream) {
  DLTensor kc = mk(&d[0], k_cache), vc = mk(&d[1], v_cache), kt = mk(&d[2], k), vt = mk(&d[3], v),
           s = mk(&d[4], slot_mapping);
  return ks_kv_cache_append(&kc, &vc, &kt, &vt, &s, BK, ST);
}

ks_status_t ksgo_rotary_embedding_kv_append(ksgo_desc* d, void* q, void* k, void* v, void* positions, int64_t rotary_dim,
                                            double theta, int is_neox, void* k_cache, void* v_cache, void* slot_mapping,
                                            int backend, uintptr_t stream) {
  DLTensor qt = mk(&d[0], q), kt = mk(&d[1], k), vt = mk(&d[2], v), p = mk(&d[3], positions), kc = mk(&d[4], k_cache),
           vc = mk(&d[5], v_cache), s = mk(&d[6], slot_mapping);
  return ks_rotary_embedding_kv_append(&qt, &kt, &vt, &p, rotary_dim, theta, is_neox, &kc, &vc, &s, BK, ST);
}

ks_status_t ksgo_fused_add_rms_norm_quant_matmul_rope_kv_append(
    ksgo_desc* d, void* out, int has_residual_out, void* residual_out, int has_x, void* x, void* residual,
    void* norm_weight, double eps, void* weight, int qtype, int64_t num_heads, int64_t num_kv_heads, void* positions,
    int64_t rotary_dim, double theta, int is_neox, void* k_cache, void* v_cache, void* slot_mapping, int backend,
    uintptr_t stream) {
  DLTensor o = mk(&d[0], out), ro = mk(&d[1], residual_out), xt = mk(&d[2], x), r = mk(&d[3], residual),
           nw = mk(&d[4], norm_weight), w = mk(&d[5], weight), p = mk(&d[6], positions), kc = mk(&d[7], k_cache),
           vc = mk(&d[8], v_cache), s = mk(&d[9], slot_mapping);
  return ks_fused_add_rms_norm_quant_matmul_rope_kv_append(&o, has_residual_out ? &ro : NULL, has_x ? &xt : NULL, &r,
                                                           &nw, eps, &w, (ks_qtype_t)qtype, num_heads, num_kv_heads,
                                                           &p, rotary_dim, theta, is_neox, &kc, &vc, &s, BK, ST);
}

ks_status_t ksgo_paged_attention(ksgo_desc* d, void* out, void* q, void* k_cache, void* v_cache, void* block_tables,
                                 int has_seq_ids, void* seq_ids, void* context_lens, double scale, int backend,
                                 uintptr_t stream) {
  DLTensor o = mk(&d[0], out), qt = mk(&d[1], q), kc = mk(&d[2], k_cache), vc = mk(&d[3], v_cache),
           bt = mk(&d[4], block_tables), si = mk(&d[5], seq_ids), cl = mk(&d[6], context_lens);
  return ks_paged_attention(&o, &qt, &kc, &vc, &bt, has_seq_ids ? &si : NULL, &cl, scale, BK, ST);
}

ks_status_t ksgo_paged_attention_after_append(ksgo_desc* d, void* out, void* q, void* k_cache, void* v_cache,
                                              void* block_tables, int has_seq_ids, void* seq_ids, void* context_lens,
                                              double scale, int64_t fresh_keys, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), qt = mk(&d[1], q), kc = mk(&d[2], k_cache), vc = mk(&d[3], v_cache),
           bt = mk(&d[4], block_tables), si = mk(&d[5], seq_ids), cl = mk(&d[6], context_lens);
  return ks_paged_attention_after_append(&o, &qt, &kc, &vc, &bt, has_seq_ids ? &si : NULL, &cl, scale, fresh_keys, BK,
                                         ST);
}

ks_status_t ksgo_rotary_embedding_kv_append_paged_attention(
    ksgo_desc* d, void* out, void* q, void* k, void* v, void* positions, int64_t rotary_dim, double theta, int is_neox,
    void* k_cache, void* v_cache, void* slot_mapping, void* block_tables, int has_seq_ids, void* seq_ids,
    void* context_lens, double scale, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), qt = mk(&d[1], q), kt = mk(&d[2], k), vt = mk(&d[3], v), p = mk(&d[4], positions),
           kc = mk(&d[5], k_cache), vc = mk(&d[6], v_cache), s = mk(&d[7], slot_mapping), bt = mk(&d[8], block_tables),
           si = mk(&d[9], seq_ids), cl = mk(&d[10], context_lens);
  return ks_rotary_embedding_kv_append_paged_attention(&o, &qt, &kt, &vt, &p, rotary_dim, theta, is_neox, &kc, &vc, &s,
                                                       &bt, has_seq_ids ? &si : NULL, &cl, scale, BK, ST);
}

ks_status_t ksgo_argmax(ksgo_desc* d, void* out, void* x, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), xt = mk(&d[1], x);
  return ks_argmax(&o, &xt, BK, ST);
}

ks_status_t ksgo_varlen_attention(ksgo_desc* d, void* out, void* q, void* k, void* v, void* cu_q, void* cu_k,
                                  double scale, int causal, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), qt = mk(&d[1], q), kt = mk(&d[2], k), vt = mk(&d[3], v), cq = mk(&d[4], cu_q),
           ck = mk(&d[5], cu_k);
  return ks_varlen_attention(&o, &qt, &kt, &vt, &cq, &ck, scale, causal, BK, ST);
}

ks_status_t ksgo_sample(ksgo_desc* d, void* out, int has_valid, void* valid, void* logits, void* seed_offset,
                        double temperature, int64_t top_k, double top_p, int backend, uintptr_t stream) {
  DLTensor o = mk(&d[0], out), v = mk(&d[1], valid), l = mk(&d[2], logits), so = mk(&d[3], seed_offset);
  return ks_sample(&o, has_valid ? &v : NULL, &l, &so, temperature, top_k, top_p, BK, ST);
}
