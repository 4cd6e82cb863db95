// embedding, rotary_embedding, kv_cache_append, paged_attention: validation,
// contract and dispatch. Index tensors on the host are range-checked here,
// before any output is written.
//
// embedding:        dense table rows are copied bit-exactly; packed rows are decoded
//                   in FP32 (ks_dequantize's contract) and rounded once to out's dtype.
// rotary_embedding: inv_freq[i] = fp32(theta^(-2i/rotary_dim)) (computed in FP64, rounded),
//                   angle = fp32(fp32(pos) * inv_freq[i]); c = cos(angle), s = sin(angle) in FP32;
//                   (a, b) -> (round(a*c - b*s), round(b*c + a*s)) with a, b the fp32 pair.
// kv_cache_append:  bit-exact copies; slot -1 skipped.
// paged_attention:  s_j = scale * sum_d fp32(q_d) * fp32(k_jd) (FP32); p = softmax(s) in FP32;
//                   out = round(sum_j p_j * fp32(v_j)). context_len 0 gives zeros.
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include "ops/args.hpp"
#include "registry/registry.hpp"

using namespace ks::detail;
using namespace ks::ops;

namespace ks::ops {
void check_packed(const char* op, const char* arg, const View& packed, ks_qtype_t qtype, int64_t cols,
                  const char* qtype_arg, const char* cols_what);
}


extern "C" ks_status_t ks_embedding(DLTensor* out, const DLTensor* ids, const DLTensor* table, ks_qtype_t table_format,
                                    ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "embedding";
  return guard(op, [&] {
    EmbeddingArgs a;
    a.ids = view_of(op, "ids", ids);
    // out = ids' shape + (hidden,) must fit the 16-dimension limit: checked before out is read,
    // so that 16-dimensional ids are named (Python sizes out from them, with 17 dimensions)
    if (a.ids.ndim() >= Shape::kMax)
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "ids must have at most " + std::to_string(Shape::kMax - 1) + " dimensions (out adds one); got " +
               std::to_string(a.ids.ndim()));
    a.table = view_of(op, "table", table);
    a.out = view_of(op, "out", out);
    require_dtype(op, "ids", a.ids, {DType::I32, DType::I64});
    require_dtype(op, "out", a.out, {DType::F16, DType::BF16, DType::F32});
    require_same_devices(op, {{"table", a.table}, {"ids", a.ids}}, "out", a.out);
    require_ndim(op, "table", a.table, 2);
    a.format = table_format;
    a.vocab = a.table.dim(0);
    require_min_ndim(op, "out", a.out, 1);
    a.hidden = a.out.cols();
    if (table_format == KS_QTYPE_NONE) {
      require_same_dtype(op, "table", a.table, "out", a.out);
      if (a.table.dim(1) != a.hidden)
        fail(KS_ERROR_INVALID_ARGUMENT, op, "table must have shape (vocab, " + std::to_string(a.hidden) +
                                                ") to match out's hidden size; got " + shape_str(a.table.shape));
    } else {
      check_packed(op, "table", a.table, table_format, a.hidden, "table_format", "out's hidden_size");
    }
    require_nonempty_last(op, "out", a.out);
    Shape oshape = a.ids.shape;
    oshape.push_back(a.hidden);
    require_shape(op, "out", a.out, oshape, "ids' shape + (hidden_size,)");
    require_no_overlap(op, "out", a.out, "table", a.table);
    require_no_overlap(op, "out", a.out, "ids", a.ids);
    const ks_backend_t be = resolve_backend(op, backend, a.out);
    a.num_ids = a.ids.numel;
    a.row_bytes = a.table.dim(1);
    if (on_host(a.ids))
      for (int64_t i = 0; i < a.num_ids; ++i) {
        const int64_t id = load_index(a.ids.data, a.ids.dtype, i);
        if (id < 0 || id >= a.vocab)
          fail(KS_ERROR_INVALID_ARGUMENT, op,
               "ids[" + std::to_string(i) + "] = " + std::to_string(id) + " is outside [0, " +
                   std::to_string(a.vocab) + ")");
      }
    if (a.num_ids == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.out.dtype, &a, stream);
  });
}

// rotary_embedding's rules (also those of rotary_embedding_kv_append, under its name).
static void validate_rotary(const char* op, RotaryArgs& a, DLTensor* q, DLTensor* k, const DLTensor* positions,
                            int64_t rotary_dim, double theta, int is_neox) {
    // q and k may be strided views (e.g. slices of a fused qkv buffer): any token and
    // head strides that keep their elements distinct; the last dimension contiguous.
    const RowsView qr = rows_view_of(op, "q", q);
    a.q = qr.v;
    a.has_k = k != nullptr;
    RowsView kr;
    if (a.has_k) {
      kr = rows_view_of(op, "k", k);
      a.k = kr.v;
    }
    a.positions = view_of(op, "positions", positions);
    require_dtype(op, "q", a.q, {DType::F16, DType::BF16, DType::F32});
    require_dtype(op, "positions", a.positions, {DType::I32, DType::I64});
    require_same_device(op, "positions", a.positions, "q", a.q);
    require_ndim(op, "q", a.q, 3);
    require_ndim(op, "positions", a.positions, 1);
    a.num_tokens = a.q.dim(0);
    a.num_heads = a.q.dim(1);
    a.head_dim = a.q.dim(2);
    if (a.head_dim == 0) fail(KS_ERROR_INVALID_ARGUMENT, op, "q's head_dim must be > 0");
    require_shape(op, "positions", a.positions, {a.num_tokens}, "one position per token of q");
    a.num_kv_heads = 0;
    if (a.has_k) {
      require_like(op, {{"k", a.k}}, "q", a.q);
      require_ndim(op, "k", a.k, 3);
      if (a.k.dim(0) != a.num_tokens || a.k.dim(2) != a.head_dim)
        fail(KS_ERROR_INVALID_ARGUMENT, op, "k must have shape (num_tokens, num_kv_heads, head_dim) = (" +
                                                std::to_string(a.num_tokens) + ", *, " + std::to_string(a.head_dim) +
                                                "); got " + shape_str(a.k.shape));
      a.num_kv_heads = a.k.dim(1);
      require_rows_disjoint(op, "q", qr, "k", kr);
      require_rows_disjoint(op, "k", kr, "positions", as_rows(a.positions));
    }
    require_rows_disjoint(op, "q", qr, "positions", as_rows(a.positions));
    a.q_token_stride = qr.row_stride;
    a.q_head_stride = qr.head_stride;
    a.k_token_stride = a.has_k ? kr.row_stride : 0;
    a.k_head_stride = a.has_k ? kr.head_stride : 0;
    if (rotary_dim <= 0 || rotary_dim > a.head_dim || rotary_dim % 2 != 0)
      fail(KS_ERROR_INVALID_ARGUMENT, op, "rotary_dim must be even and in (0, head_dim=" + std::to_string(a.head_dim) +
                                              "]; got " + std::to_string(rotary_dim));
    if (!std::isfinite(theta) || !(theta > 1.0))
      fail(KS_ERROR_INVALID_ARGUMENT, op, "theta must be finite and > 1; got " + num_str(theta));
    a.rotary_dim = rotary_dim;
    a.theta = theta;
    a.neox = is_neox != 0;
}

extern "C" ks_status_t ks_rotary_embedding(DLTensor* q, DLTensor* k, const DLTensor* positions, int64_t rotary_dim,
                                           double theta, int is_neox, ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "rotary_embedding";
  return guard(op, [&] {
    RotaryArgs a;
    validate_rotary(op, a, q, k, positions, rotary_dim, theta, is_neox);
    const ks_backend_t be = resolve_backend(op, backend, a.q);
    if (a.num_tokens == 0 || a.num_heads + a.num_kv_heads == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.q.dtype, &a, stream);
  });
}

// Cache tensors: [num_blocks, block_size, num_kv_heads, head_dim].
static void check_cache(const char* op, const char* arg, const View& c, int64_t kvh, int64_t hd) {
  require_ndim(op, arg, c, 4);
  if (c.dim(2) != kvh || c.dim(3) != hd)
    fail(KS_ERROR_INVALID_ARGUMENT, op,
         std::string(arg) + " must have shape (num_blocks, block_size, " + std::to_string(kvh) + ", " +
             std::to_string(hd) + "); got " + shape_str(c.shape));
}

// kv_cache_append's rules (also those of rotary_embedding_kv_append, under its name).
static void validate_kv_append(const char* op, KvCacheAppendArgs& a, DLTensor* k_cache, DLTensor* v_cache,
                               const DLTensor* k, const DLTensor* v, const DLTensor* slot_mapping) {
    a.k_cache = view_of(op, "k_cache", k_cache);
    a.v_cache = view_of(op, "v_cache", v_cache);
    a.k = view_of(op, "k", k);
    a.v = view_of(op, "v", v);
    a.slot_mapping = view_of(op, "slot_mapping", slot_mapping);
    require_dtype(op, "k", a.k, {DType::F16, DType::BF16, DType::F32});
    require_same_dtypes(op, {{"v", a.v}, {"k_cache", a.k_cache}, {"v_cache", a.v_cache}}, "k", a.k);
    require_dtype(op, "slot_mapping", a.slot_mapping, {DType::I32, DType::I64});
    require_same_devices(op, {{"v", a.v}, {"k_cache", a.k_cache}, {"v_cache", a.v_cache}, {"slot_mapping", a.slot_mapping}},
                         "k", a.k);
    require_ndim(op, "k", a.k, 3);
    require_nonempty_last(op, "k", a.k);  // head_dim > 0, as every op's feature dimension
    require_ndim(op, "slot_mapping", a.slot_mapping, 1);
    a.num_tokens = a.slot_mapping.dim(0);  // the token count comes from slot_mapping
    a.num_kv_heads = a.k.dim(1);
    a.head_dim = a.k.dim(2);
    if (a.k.dim(0) < a.num_tokens)
      fail(KS_ERROR_INVALID_ARGUMENT, op, "k has " + std::to_string(a.k.dim(0)) + " tokens but slot_mapping has " +
                                              std::to_string(a.num_tokens));
    require_shape(op, "v", a.v, a.k.shape, "same as k");
    check_cache(op, "k_cache", a.k_cache, a.num_kv_heads, a.head_dim);
    require_shape(op, "v_cache", a.v_cache, a.k_cache.shape, "same as k_cache");
    // (a cache with num_kv_heads 0 is empty, so its dims 0 and 1 are not bounded by its bytes)
    if (__builtin_mul_overflow(a.k_cache.dim(0), a.k_cache.dim(1), &a.num_slots))
      fail(KS_ERROR_INVALID_ARGUMENT, op, "k_cache's num_blocks * block_size overflows int64; got " +
                                              shape_str(a.k_cache.shape));
    require_no_overlap(op, "k_cache", a.k_cache, "v_cache", a.v_cache);
    for (auto [n, t] : {std::pair{"k", &a.k}, {"v", &a.v}, {"slot_mapping", &a.slot_mapping}}) {
      require_no_overlap(op, "k_cache", a.k_cache, n, *t);
      require_no_overlap(op, "v_cache", a.v_cache, n, *t);
    }
    if (on_host(a.slot_mapping))
      for (int64_t t = 0; t < a.num_tokens; ++t) {
        const int64_t s = load_index(a.slot_mapping.data, a.slot_mapping.dtype, t);
        if (s < -1 || s >= a.num_slots)
          fail(KS_ERROR_INVALID_ARGUMENT, op, "slot_mapping[" + std::to_string(t) + "] = " + std::to_string(s) +
                                                  " is outside [-1, " + std::to_string(a.num_slots) + ")");
      }
}

extern "C" ks_status_t ks_kv_cache_append(DLTensor* k_cache, DLTensor* v_cache, const DLTensor* k, const DLTensor* v,
                                          const DLTensor* slot_mapping, ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "kv_cache_append";
  return guard(op, [&] {
    KvCacheAppendArgs a;
    validate_kv_append(op, a, k_cache, v_cache, k, v, slot_mapping);
    const ks_backend_t be = resolve_backend(op, backend, a.k);
    if (a.num_tokens == 0 || a.num_kv_heads * a.head_dim == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.k.dtype, &a, stream);
  });
}

// rotary_embedding_kv_append's rules (also those of rotary_embedding_kv_append_paged_attention,
// under its name).
void validate_rope_kv_append(const char* op, RopeKvAppendArgs& a, DLTensor* q, DLTensor* k, const DLTensor* v,
                           const DLTensor* positions, int64_t rotary_dim, double theta, int is_neox,
                           DLTensor* k_cache, DLTensor* v_cache, const DLTensor* slot_mapping) {
  if (!k) fail(KS_ERROR_INVALID_ARGUMENT, op, "k is missing: its rotated rows go to k_cache");
  validate_rotary(op, a.rope, q, k, positions, rotary_dim, theta, is_neox);
  validate_kv_append(op, a.kv, k_cache, v_cache, k, v, slot_mapping);
  // One pass writes q, k and the caches while it reads v and positions: every pair that the
  // two-call sequence would order must not share memory (kv_cache_append's checks cover the
  // caches against k, v and slot_mapping; rotary_embedding's, q against k and positions).
  const RowsView qr = rows_view_of(op, "q", q);
  for (const char* c : {"k_cache", "v_cache"}) {
    const View& cv = c[0] == 'k' ? a.kv.k_cache : a.kv.v_cache;
    require_rows_disjoint(op, c, as_rows(cv), "q", qr);
    require_rows_disjoint(op, c, as_rows(cv), "positions", as_rows(a.rope.positions));
  }
  require_rows_disjoint(op, "v", as_rows(a.kv.v), "q", qr);
  require_no_overlap(op, "v", a.kv.v, "k", a.kv.k);
  // slot_mapping is read after the rotation wrote q and k (validated values must stay so)
  require_rows_disjoint(op, "slot_mapping", as_rows(a.kv.slot_mapping), "q", qr);
  require_no_overlap(op, "slot_mapping", a.kv.slot_mapping, "k", a.kv.k);
}

extern "C" ks_status_t ks_rotary_embedding_kv_append(DLTensor* q, DLTensor* k, const DLTensor* v,
                                                     const DLTensor* positions, int64_t rotary_dim, double theta,
                                                     int is_neox, DLTensor* k_cache, DLTensor* v_cache,
                                                     const DLTensor* slot_mapping, ks_backend_t backend,
                                                     ks_stream_t stream) {
  static const char* op = "rotary_embedding_kv_append";
  return guard(op, [&] {
    RopeKvAppendArgs a;
    validate_rope_kv_append(op, a, q, k, v, positions, rotary_dim, theta, is_neox, k_cache, v_cache, slot_mapping);
    const ks_backend_t be = resolve_backend(op, backend, a.rope.q);
    if (a.rope.num_tokens == 0 || a.rope.num_heads + a.rope.num_kv_heads == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.rope.q.dtype, &a, stream);
  });
}

// fused_add_rms_norm_quant_matmul then rotary_embedding_kv_append on out's q / k / v slices, for
// one token. Every rule of the two, under this op's name, plus: one row (M = 1), out's columns
// (num_heads + 2 num_kv_heads) x head_dim, and the caches, positions and slot_mapping apart
// from everything the matmul reads or writes.
extern "C" ks_status_t ks_fused_add_rms_norm_quant_matmul_rope_kv_append(
    DLTensor* out, DLTensor* residual_out, const DLTensor* x, const DLTensor* residual, const DLTensor* norm_weight,
    double eps, const DLTensor* weight, ks_qtype_t qtype, int64_t num_heads, int64_t num_kv_heads,
    const DLTensor* positions, int64_t rotary_dim, double theta, int is_neox, DLTensor* k_cache, DLTensor* v_cache,
    const DLTensor* slot_mapping, ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "fused_add_rms_norm_quant_matmul_rope_kv_append";
  return guard(op, [&] {
    NormQmmRopeAppendArgs a;
    validate_norm_quant_matmul(op, a.mm, out, residual_out, x, residual, norm_weight, eps, weight, qtype,
                               /*leading_dims=*/false);
    if (a.mm.m > 1)
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "residual has " + std::to_string(a.mm.m) +
               " rows; this fusion is a one-token decode step (for more rows call fused_add_rms_norm_quant_matmul, "
               "then rotary_embedding_kv_append)");
    if (num_heads <= 0 || num_kv_heads <= 0)
      fail(KS_ERROR_INVALID_ARGUMENT, op, "num_heads and num_kv_heads must be > 0; got " + std::to_string(num_heads) +
                                              " and " + std::to_string(num_kv_heads));
    if (num_heads > (int64_t(1) << 40) || num_kv_heads > (int64_t(1) << 40))
      fail(KS_ERROR_INVALID_ARGUMENT, op, "num_heads and num_kv_heads must be at most 2^40");
    const int64_t heads = num_heads + 2 * num_kv_heads;
    if (a.mm.n % heads != 0 || a.mm.n == 0)
      fail(KS_ERROR_INVALID_ARGUMENT, op,
           "weight's " + std::to_string(a.mm.n) + " rows (out's columns) must be (num_heads + 2 num_kv_heads) x "
               "head_dim with num_heads=" + std::to_string(num_heads) + ", num_kv_heads=" + std::to_string(num_kv_heads));
    const int64_t D = a.mm.n / heads, M = a.mm.m;
    // (out is contiguous: view_of checked it)
    // q, k and v: out's column slices [0, H D), [H D, (H + KVH) D), [(H + KVH) D, N) as [M, heads, D]
    int64_t qs[3] = {M, num_heads, D}, ks[3] = {M, num_kv_heads, D}, vs[3] = {M, num_kv_heads, D};
    const uint64_t es = uint64_t(dtype_bytes(a.mm.out.dtype));
    DLTensor q = *out, k = *out, v = *out;
    q.ndim = k.ndim = v.ndim = 3;
    q.strides = k.strides = v.strides = nullptr;
    q.shape = qs;
    k.shape = ks;
    v.shape = vs;
    k.byte_offset += uint64_t(num_heads * D) * es;
    v.byte_offset += uint64_t((num_heads + num_kv_heads) * D) * es;
    try {
      validate_rotary(op, a.rkv.rope, &q, &k, positions, rotary_dim, theta, is_neox);
      validate_kv_append(op, a.rkv.kv, k_cache, v_cache, &k, &v, slot_mapping);
    } catch (const Failure& f) {  // the two ops' rules speak of q, k and v: say what they are here
      throw Failure{f.status, f.message + " (q, k and v: out's columns [0, " + std::to_string(num_heads * D) + "), [" +
                                  std::to_string(num_heads * D) + ", " + std::to_string((num_heads + num_kv_heads) * D) +
                                  ") and [" + std::to_string((num_heads + num_kv_heads) * D) + ", " +
                                  std::to_string(a.mm.n) + ") as [1, heads, head_dim=" + std::to_string(D) + "])"};
    }
    // the caches are written, and positions and slot_mapping read, while the matmul's inputs
    // are read and out / residual_out written (in no fixed order, in one kernel)
    const std::pair<const char*, const View*> mm_args[] = {{"residual", &a.mm.residual},
                                                           {"norm_weight", &a.mm.norm_weight},
                                                           {"weight", &a.mm.weight},
                                                           {"x", &a.mm.x},
                                                           {"residual_out", &a.mm.residual_out},
                                                           {"out", &a.mm.out}};
    for (const auto& [name, view] : mm_args) {
      if (!a.mm.has_x && (view == &a.mm.x || view == &a.mm.residual_out)) continue;
      require_no_overlap(op, "k_cache", a.rkv.kv.k_cache, name, *view);
      require_no_overlap(op, "v_cache", a.rkv.kv.v_cache, name, *view);
      if (view == &a.mm.out || view == &a.mm.residual_out) {
        require_no_overlap(op, name, *view, "positions", a.rkv.rope.positions);
        require_no_overlap(op, name, *view, "slot_mapping", a.rkv.kv.slot_mapping);
      }
    }
    require_no_overlap(op, "k_cache", a.rkv.kv.k_cache, "positions", a.rkv.rope.positions);
    require_no_overlap(op, "v_cache", a.rkv.kv.v_cache, "positions", a.rkv.rope.positions);
    const ks_backend_t be = resolve_backend(op, backend, a.mm.residual);
    if (M == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.mm.residual.dtype, &a, stream);
  });
}

// paged_attention's rules (also those of rotary_embedding_kv_append_paged_attention, under its
// name): fills a, and for host context_lens checks every visible block table entry and finds
// the longest context.
void validate_paged_attention(const char* op, PagedAttentionArgs& a, const DLTensor* out, const DLTensor* q,
                              const DLTensor* k_cache, const DLTensor* v_cache, const DLTensor* block_tables,
                              const DLTensor* seq_ids, const DLTensor* context_lens, double scale) {
  a.out = view_of(op, "out", out);
  a.q = view_of(op, "q", q);
  a.k_cache = view_of(op, "k_cache", k_cache);
  a.v_cache = view_of(op, "v_cache", v_cache);
  a.block_tables = view_of(op, "block_tables", block_tables);
  a.has_seq_ids = seq_ids != nullptr;
  if (a.has_seq_ids) a.seq_ids = view_of(op, "seq_ids", seq_ids);
  a.context_lens = view_of(op, "context_lens", context_lens);
  require_dtype(op, "q", a.q, {DType::F16, DType::BF16, DType::F32});
  require_same_dtypes(op, {{"out", a.out}, {"k_cache", a.k_cache}, {"v_cache", a.v_cache}}, "q", a.q);
  require_dtype(op, "block_tables", a.block_tables, {DType::I32});
  require_dtype(op, "context_lens", a.context_lens, {DType::I32});
  if (a.has_seq_ids) require_dtype(op, "seq_ids", a.seq_ids, {DType::I32});
  require_same_devices(op,
                       {{"out", a.out}, {"k_cache", a.k_cache}, {"v_cache", a.v_cache},
                        {"block_tables", a.block_tables}, {"context_lens", a.context_lens}},
                       "q", a.q);
  if (a.has_seq_ids) require_same_device(op, "seq_ids", a.seq_ids, "q", a.q);
  require_ndim(op, "q", a.q, 3);
  a.num_tokens = a.q.dim(0);
  a.num_heads = a.q.dim(1);
  a.head_dim = a.q.dim(2);
  if (a.head_dim == 0 || a.num_heads == 0) fail(KS_ERROR_INVALID_ARGUMENT, op, "q must have num_heads > 0 and head_dim > 0");
  require_shape(op, "out", a.out, a.q.shape, "same as q");
  require_ndim(op, "k_cache", a.k_cache, 4);
  a.num_kv_heads = a.k_cache.dim(2);
  check_cache(op, "k_cache", a.k_cache, a.num_kv_heads, a.head_dim);
  require_shape(op, "v_cache", a.v_cache, a.k_cache.shape, "same as k_cache");
  if (a.num_kv_heads == 0 || a.num_heads % a.num_kv_heads != 0)
    fail(KS_ERROR_INVALID_ARGUMENT, op, "num_heads (" + std::to_string(a.num_heads) +
                                            ") must be a multiple of num_kv_heads (" +
                                            std::to_string(a.num_kv_heads) + ") (q's dim 1, k_cache's dim 2)");
  a.num_blocks = a.k_cache.dim(0);
  a.block_size = a.k_cache.dim(1);
  if (a.block_size == 0)
    fail(KS_ERROR_INVALID_ARGUMENT, op, "k_cache's block_size (dim 1) must be > 0; got shape " + shape_str(a.k_cache.shape));
  require_ndim(op, "block_tables", a.block_tables, 2);
  a.num_seqs = a.block_tables.dim(0);
  a.max_blocks_per_seq = a.block_tables.dim(1);
  require_shape(op, "context_lens", a.context_lens, {a.num_tokens}, "one per query token");
  if (a.has_seq_ids)
    require_shape(op, "seq_ids", a.seq_ids, {a.num_tokens}, "one per query token");
  else if (a.num_seqs != a.num_tokens)
    fail(KS_ERROR_INVALID_ARGUMENT, op, "without seq_ids, block_tables needs one row per query token (" +
                                            std::to_string(a.num_tokens) + "); got " + shape_str(a.block_tables.shape));
  if (!std::isfinite(scale) || !std::isfinite(float(scale)))
    fail(KS_ERROR_INVALID_ARGUMENT, op, "scale must be finite in fp32; got " + num_str(scale));
  a.scale = float(scale);
  for (auto [n, t] : {std::pair{"q", &a.q}, {"k_cache", &a.k_cache}, {"v_cache", &a.v_cache},
                      {"block_tables", &a.block_tables}, {"context_lens", &a.context_lens}})
    require_no_overlap(op, "out", a.out, n, *t);
  if (a.has_seq_ids) require_no_overlap(op, "out", a.out, "seq_ids", a.seq_ids);
  // the tables' capacity in keys; the block count of a key range is a division, not
  // (len + block_size - 1) / block_size, which overflows for a huge block_size (an empty cache's
  // dim 1 can be anything: 0 x 2^63 - 1 elements is a valid tensor)
  int64_t cap = 0;
  if (__builtin_mul_overflow(a.max_blocks_per_seq, a.block_size, &cap))
    fail(KS_ERROR_INVALID_ARGUMENT, op, "block_tables' max_blocks_per_seq (" + std::to_string(a.max_blocks_per_seq) +
                                            ") times k_cache's block_size (" + std::to_string(a.block_size) +
                                            ") overflows int64");
  a.max_context_len = cap;
  if (on_host(a.context_lens)) {
    a.max_context_len = 0;
    auto cl = [&](int64_t i) { return load_index(a.context_lens.data, DType::I32, i); };
    auto bt = [&](int64_t i) { return load_index(a.block_tables.data, DType::I32, i); };
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const int64_t s = a.has_seq_ids ? load_index(a.seq_ids.data, DType::I32, t) : t;
      if (s < 0 || s >= a.num_seqs)
        fail(KS_ERROR_INVALID_ARGUMENT, op, "seq_ids[" + std::to_string(t) + "] = " + std::to_string(s) +
                                                " is outside [0, " + std::to_string(a.num_seqs) + ")");
      if (cl(t) < 0 || cl(t) > cap)
        fail(KS_ERROR_INVALID_ARGUMENT, op, "context_lens[" + std::to_string(t) + "] = " + std::to_string(cl(t)) +
                                                " is outside [0, max_blocks_per_seq * block_size = " +
                                                std::to_string(cap) + "]");
      a.max_context_len = std::max(a.max_context_len, cl(t));
      const int64_t nb = cl(t) / a.block_size + (cl(t) % a.block_size != 0);
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t blk = bt(s * a.max_blocks_per_seq + b);
        if (blk < 0 || blk >= a.num_blocks)
          fail(KS_ERROR_INVALID_ARGUMENT, op, "block_tables[" + std::to_string(s) + ", " + std::to_string(b) +
                                                  "] = " + std::to_string(blk) + " is outside [0, " +
                                                  std::to_string(a.num_blocks) + ")");
      }
    }
  }
}

// paged_attention and paged_attention_after_append (op: the name errors carry); both dispatch
// as paged_attention, whose variants take fresh_keys as a permission only (the same bits).
static ks_status_t paged_attention_call(const char* op, DLTensor* out, const DLTensor* q, const DLTensor* k_cache,
                                        const DLTensor* v_cache, const DLTensor* block_tables,
                                        const DLTensor* seq_ids, const DLTensor* context_lens, double scale,
                                        int64_t fresh_keys, ks_backend_t backend, ks_stream_t stream) {
  return guard(op, [&] {
    if (fresh_keys < 0)
      fail(KS_ERROR_INVALID_ARGUMENT, op, "fresh_keys = " + std::to_string(fresh_keys) + " must be >= 0");
    PagedAttentionArgs a;
    validate_paged_attention(op, a, out, q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale);
    a.fresh_keys = fresh_keys;
    const ks_backend_t be = resolve_backend(op, backend, a.q);
    if (a.num_tokens == 0) return KS_SUCCESS;
    const char* alias = ks::registry::dispatch_alias(op);
    return ks::registry::dispatch(alias ? alias : op, be, a.q.dtype, &a, stream);
  });
}

extern "C" ks_status_t ks_paged_attention(DLTensor* out, const DLTensor* q, const DLTensor* k_cache,
                                          const DLTensor* v_cache, const DLTensor* block_tables,
                                          const DLTensor* seq_ids, const DLTensor* context_lens, double scale,
                                          ks_backend_t backend, ks_stream_t stream) {
  return paged_attention_call("paged_attention", out, q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale,
                              0, backend, stream);
}

// docs/contracts.md#paged_attention_after_append
extern "C" ks_status_t ks_paged_attention_after_append(DLTensor* out, const DLTensor* q, const DLTensor* k_cache,
                                                       const DLTensor* v_cache, const DLTensor* block_tables,
                                                       const DLTensor* seq_ids, const DLTensor* context_lens,
                                                       double scale, int64_t fresh_keys, ks_backend_t backend,
                                                       ks_stream_t stream) {
  return paged_attention_call("paged_attention_after_append", out, q, k_cache, v_cache, block_tables, seq_ids,
                              context_lens, scale, fresh_keys, backend, stream);
}

// rotary_embedding_kv_append, then paged_attention on the rotated q and the appended caches:
// every rule of the two under this op's name, plus out apart from what the first step reads
// and writes (the fused kernel writes out while it reads q, k, v, positions and slot_mapping),
// and block_tables, seq_ids and context_lens apart from what it writes (q, k, the caches).
extern "C" ks_status_t ks_rotary_embedding_kv_append_paged_attention(
    DLTensor* out, DLTensor* q, DLTensor* k, const DLTensor* v, const DLTensor* positions, int64_t rotary_dim,
    double theta, int is_neox, DLTensor* k_cache, DLTensor* v_cache, const DLTensor* slot_mapping,
    const DLTensor* block_tables, const DLTensor* seq_ids, const DLTensor* context_lens, double scale,
    ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "rotary_embedding_kv_append_paged_attention";
  return guard(op, [&] {
    RopeKvAppendAttentionArgs a;
    validate_rope_kv_append(op, a.rkv, q, k, v, positions, rotary_dim, theta, is_neox, k_cache, v_cache, slot_mapping);
    validate_paged_attention(op, a.attn, out, q, k_cache, v_cache, block_tables, seq_ids, context_lens, scale);
    require_no_overlap(op, "out", a.attn.out, "k", a.rkv.kv.k);
    require_no_overlap(op, "out", a.attn.out, "v", a.rkv.kv.v);
    require_no_overlap(op, "out", a.attn.out, "positions", a.rkv.rope.positions);
    require_no_overlap(op, "out", a.attn.out, "slot_mapping", a.rkv.kv.slot_mapping);
    // the attention's index tensors are range-checked above (host values) and read after the
    // first step wrote q, k and the caches (on CUDA while they are written): apart from them
    for (auto [name, view] : {std::pair{"q", &a.attn.q}, {"k", &a.rkv.kv.k}, {"k_cache", &a.rkv.kv.k_cache},
                              {"v_cache", &a.rkv.kv.v_cache}}) {
      require_no_overlap(op, "block_tables", a.attn.block_tables, name, *view);
      require_no_overlap(op, "context_lens", a.attn.context_lens, name, *view);
      if (a.attn.has_seq_ids) require_no_overlap(op, "seq_ids", a.attn.seq_ids, name, *view);
    }
    const ks_backend_t be = resolve_backend(op, backend, a.rkv.rope.q);
    if (a.attn.num_tokens == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.rkv.rope.q.dtype, &a, stream);
  });
}

// varlen_attention: packed sequences without a cache (docs/contracts.md#varlen_attention).
extern "C" ks_status_t ks_varlen_attention(DLTensor* out, const DLTensor* q, const DLTensor* k, const DLTensor* v,
                                           const DLTensor* cu_seqlens_q, const DLTensor* cu_seqlens_k, double scale,
                                           int causal, ks_backend_t backend, ks_stream_t stream) {
  static const char* op = "varlen_attention";
  return guard(op, [&] {
    VarlenAttentionArgs a;
    a.out = view_of(op, "out", out);
    a.q = view_of(op, "q", q);
    a.k = view_of(op, "k", k);
    a.v = view_of(op, "v", v);
    a.cu_q = view_of(op, "cu_seqlens_q", cu_seqlens_q);
    a.cu_k = view_of(op, "cu_seqlens_k", cu_seqlens_k);
    require_dtype(op, "q", a.q, {DType::F16, DType::BF16, DType::F32});
    require_same_dtypes(op, {{"out", a.out}, {"k", a.k}, {"v", a.v}}, "q", a.q);
    require_dtype(op, "cu_seqlens_q", a.cu_q, {DType::I32});
    require_dtype(op, "cu_seqlens_k", a.cu_k, {DType::I32});
    require_same_devices(op, {{"out", a.out}, {"k", a.k}, {"v", a.v}, {"cu_seqlens_q", a.cu_q}, {"cu_seqlens_k", a.cu_k}},
                         "q", a.q);
    require_ndim(op, "q", a.q, 3);
    require_ndim(op, "k", a.k, 3);
    a.total_q = a.q.dim(0);
    a.num_heads = a.q.dim(1);
    a.head_dim = a.q.dim(2);
    if (a.num_heads == 0 || a.head_dim == 0) fail(KS_ERROR_INVALID_ARGUMENT, op, "q must have num_heads > 0 and head_dim > 0");
    require_shape(op, "out", a.out, a.q.shape, "same as q");
    a.total_k = a.k.dim(0);
    a.num_kv_heads = a.k.dim(1);
    if (a.k.dim(2) != a.head_dim)
      fail(KS_ERROR_INVALID_ARGUMENT, op, "k must have head_dim " + std::to_string(a.head_dim) + " (q's); got shape " +
                                              shape_str(a.k.shape));
    require_shape(op, "v", a.v, a.k.shape, "same as k");
    if (a.num_kv_heads == 0 || a.num_heads % a.num_kv_heads != 0)
      fail(KS_ERROR_INVALID_ARGUMENT, op, "num_heads (" + std::to_string(a.num_heads) +
                                              ") must be a multiple of num_kv_heads (" + std::to_string(a.num_kv_heads) +
                                              ") (q's dim 1, k's dim 1)");
    require_ndim(op, "cu_seqlens_q", a.cu_q, 1);
    if (a.cu_q.dim(0) < 1) fail(KS_ERROR_INVALID_ARGUMENT, op, "cu_seqlens_q must have num_seqs + 1 >= 1 entries");
    a.num_seqs = a.cu_q.dim(0) - 1;
    require_shape(op, "cu_seqlens_k", a.cu_k, a.cu_q.shape, "same as cu_seqlens_q (num_seqs + 1)");
    if (!std::isfinite(float(scale))) fail(KS_ERROR_INVALID_ARGUMENT, op, "scale must be finite in fp32; got " + num_str(scale));
    for (auto [n, t] : {std::pair{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"cu_seqlens_q", &a.cu_q}, {"cu_seqlens_k", &a.cu_k}})
      require_no_overlap(op, "out", a.out, n, *t);
    const ks_backend_t be = resolve_backend(op, backend, a.q);
    // host offsets: 0, non-decreasing, ending at the totals (device offsets: clamped by the kernel)
    for (auto [n, t, total] : {std::tuple{"cu_seqlens_q", &a.cu_q, a.total_q}, {"cu_seqlens_k", &a.cu_k, a.total_k}}) {
      if (a.num_seqs == 0 && total != 0)
        fail(KS_ERROR_INVALID_ARGUMENT, op,
             std::string(n) + " holds no sequence (shape [1]) but there are " + std::to_string(total) +
                 (std::string(n) == "cu_seqlens_q" ? " query rows" : " key rows"));
      if (!on_host(*t)) continue;
      int64_t prev = 0;
      for (int64_t i = 0; i <= a.num_seqs; ++i) {
        const int64_t x = load_index(t->data, DType::I32, i);
        if ((i == 0 && x != 0) || x < prev || (i == a.num_seqs && x != total))
          fail(KS_ERROR_INVALID_ARGUMENT, op,
               std::string(n) + "[" + std::to_string(i) + "] = " + std::to_string(x) +
                   ": offsets must start at 0, never decrease and end at " + std::to_string(total));
        prev = x;
      }
    }
    a.scale = float(scale);
    a.causal = causal != 0;
    if (a.total_q == 0) return KS_SUCCESS;
    return ks::registry::dispatch(op, be, a.q.dtype, &a, stream);
  });
}
