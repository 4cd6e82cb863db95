// ks_paged_attention against an FP64 reference: GQA (query head h reads kv head
// h / (H / KVH)), non-identity (shuffled) block tables, block sizes 1 / 7 / 16, context
// lengths 0 (zero row), 1, exactly a block, longer than a block, the whole capacity;
// seq_ids NULL (decode) and given (causal prefill: one sequence's tokens with context
// lengths 1..T); scale; logits far outside fp16 range. Cache slots no token may see hold
// NaN, so reading past a context length shows.
// Tolerance: the seed's rtol/atol plus a first-order FP32 error bound of the documented
// computation, never tighter than docs/contracts.md's allowance for sums in an unspecified
// order (8 sqrt(K) u sum|a_k b_k|): per score, |scale| * max(u (sum|q_d k_d| + sum|partials|),
// 8 sqrt(D) u sum|q_d k_d|) + u |s_j|; propagated through exp (2 ulp allowed) and the
// normalisation as 2x the score error plus (L + 4) u + 8 sqrt(L) u, times sum_j p_j |v_j|.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "validation_harness.hpp"

namespace {

using namespace kstest::harness;

const char* kOp = "paged_attention";

struct PaConfig {
  DType dt = DType::F32;
  int64_t H = 8, KVH = 2, D = 64, bs = 16, extra_blocks = 3;
  std::vector<int32_t> ctx;  // one per query token
  std::vector<int32_t> seq;  // empty: seq_ids NULL (token t reads block_tables row t)
  int64_t num_seqs = -1;     // with seq: default max(seq) + 1
  int64_t max_blocks = -1;   // default: the most any sequence needs
  double scale = std::nan("");  // default 1/sqrt(D)
  size_t off = 0;
  int32_t pad = -2;          // unused block-table entries: -2 = a random valid block id
  bool nan_invisible = true;
  double qstd = 1.0, kstd = 1.0;
};

struct Dims {
  int64_t T, S, MB, NB;
  std::vector<int64_t> need;  // blocks per sequence
};

Dims dims_of(const PaConfig& c) {
  Dims d;
  d.T = int64_t(c.ctx.size());
  d.S = c.seq.empty() ? d.T : (c.num_seqs >= 0 ? c.num_seqs : 1 + *std::max_element(c.seq.begin(), c.seq.end()));
  d.need.assign(size_t(d.S), 0);
  for (int64_t t = 0; t < d.T; ++t) {
    const int64_t s = c.seq.empty() ? t : c.seq[size_t(t)];
    if (s < 0 || s >= d.S) continue;  // deliberately invalid cases
    const int64_t nb = c.bs > 0 ? (c.ctx[size_t(t)] + c.bs - 1) / c.bs : 0;
    d.need[size_t(s)] = std::max(d.need[size_t(s)], nb);
  }
  int64_t mx = 0, total = 0;
  for (auto n : d.need) mx = std::max(mx, n), total += n;
  d.MB = c.max_blocks >= 0 ? c.max_blocks : mx;
  d.NB = total + c.extra_blocks;
  return d;
}

struct Pa {
  PaConfig c;
  Dims d;
  Buf out, q, kc, vc, bt, sid, cl;
  double scale_arg;  // what is passed
  float scale;       // what the contract computes with: fp32(scale)

  explicit Pa(const PaConfig& cfg)
      : c(cfg),
        d(dims_of(cfg)),
        out(c.dt, {d.T, c.H, c.D}, c.off),
        q(c.dt, {d.T, c.H, c.D}, c.off + 1),
        kc(c.dt, {d.NB, c.bs, c.KVH, c.D}, c.off + 2),
        vc(c.dt, {d.NB, c.bs, c.KVH, c.D}, c.off + 3),
        bt(DType::I32, {d.S, d.MB}, c.off + 1),
        sid(DType::I32, {d.T}, c.off + 2),
        cl(DType::I32, {d.T}, c.off + 3) {
    scale_arg = std::isnan(c.scale) ? 1.0 / std::sqrt(double(c.D)) : c.scale;
    scale = float(scale_arg);
    kstest::fill_normal(q, c.qstd);
    kstest::fill_normal(kc, c.kstd);
    kstest::fill_normal(vc);
    std::vector<int32_t> pool(static_cast<size_t>(d.NB));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng());
    size_t next = 0;
    std::uniform_int_distribution<int32_t> any(0, int32_t(std::max<int64_t>(d.NB - 1, 0)));
    for (int64_t s = 0; s < d.S; ++s)
      for (int64_t b = 0; b < d.MB; ++b) {
        int32_t v;
        if (b < d.need[size_t(s)]) v = pool[next++];
        else v = c.pad == -2 ? any(rng()) : c.pad;
        set_i(bt, s * d.MB + b, v);
      }
    for (int64_t t = 0; t < d.T; ++t) {
      set_i(cl, t, c.ctx[size_t(t)]);
      set_i(sid, t, c.seq.empty() ? t : c.seq[size_t(t)]);
    }
    if (c.nan_invisible) {
      std::vector<char> vis(size_t(d.NB * c.bs), 0);
      for (int64_t t = 0; t < d.T; ++t)
        for (int64_t j = 0; j < c.ctx[size_t(t)]; ++j) vis[size_t(slot(t, j))] = 1;
      const int64_t row = c.KVH * c.D;
      for (int64_t sl = 0; sl < d.NB * c.bs; ++sl)
        if (!vis[size_t(sl)])
          for (int64_t e = 0; e < row; ++e) {
            kc.set(sl * row + e, std::nan(""));
            vc.set(sl * row + e, std::nan(""));
          }
    }
    out.poison();
  }
  int64_t seq_of(int64_t t) const { return c.seq.empty() ? t : c.seq[size_t(t)]; }
  int64_t slot(int64_t t, int64_t j) const {
    return int64_t(get_i(bt, seq_of(t) * d.MB + j / c.bs)) * c.bs + j % c.bs;
  }
  ks_status_t run(ks_backend_t be = KS_BACKEND_AUTO) {
    DLTensor o = out.dl(), qq = q.dl(), k = kc.dl(), v = vc.dl(), b = bt.dl(), s = sid.dl(), l = cl.dl();
    return ks_paged_attention(&o, &qq, &k, &v, &b, c.seq.empty() ? nullptr : &s, &l, scale_arg, be, nullptr);
  }
  // ks_paged_attention_after_append with fresh_keys (scale_arg unless sc is given; NaN: not given)
  ks_status_t run_after(int64_t fresh, double sc = std::nan("")) {
    DLTensor o = out.dl(), qq = q.dl(), k = kc.dl(), v = vc.dl(), b = bt.dl(), s = sid.dl(), l = cl.dl();
    return ks_paged_attention_after_append(&o, &qq, &k, &v, &b, c.seq.empty() ? nullptr : &s, &l,
                                           std::isnan(sc) ? scale_arg : sc, fresh, KS_BACKEND_AUTO, nullptr);
  }
};


kstest::AttnRef reference(const Pa& a) {
  return kstest::paged_attention_fp64(a.q.values(), a.kc.values(), a.vc.values(), a.d.T, a.c.H, a.c.KVH, a.c.D,
                                      std::vector<int64_t>(a.c.ctx.begin(), a.c.ctx.end()), double(a.scale),
                                      [&](int64_t t, int64_t j) { return a.slot(t, j); });
}

std::string describe(const Pa& a) {
  std::string s = dt_name(a.c.dt) + " H " + std::to_string(a.c.H) + " KVH " + std::to_string(a.c.KVH) + " D " +
                  std::to_string(a.c.D) + " bs " + std::to_string(a.c.bs) + " ctx [";
  for (size_t i = 0; i < a.c.ctx.size() && i < 12; ++i) s += (i ? "," : "") + std::to_string(a.c.ctx[i]);
  s += a.c.ctx.size() > 12 ? ",...]" : "]";
  s += a.c.seq.empty() ? " seq_ids NULL" : " seq_ids given";
  return s;
}

::testing::AssertionResult matches(const Pa& a) {
  return kstest::attention_matches(a.out, reference(a), std::vector<int64_t>(a.c.ctx.begin(), a.c.ctx.end()), a.c.H,
                                   a.c.D);
}

void run_and_check(Pa& a) {
  Snap in{&a.q, &a.kc, &a.vc, &a.bt, &a.sid, &a.cl};
  KS_RUN_OR_SKIP(a.run());
  EXPECT_TRUE(matches(a)) << describe(a);
  EXPECT_TRUE(a.out.guards_intact()) << "wrote outside out: " << describe(a);
  EXPECT_TRUE(in.same()) << "inputs modified: " << describe(a);
}

TEST(PagedAttention, GqaHeadConfigs) {
  const int64_t heads[][2] = {{8, 2}, {12, 3}, {4, 1}, {9, 3}, {4, 4}, {6, 1}, {16, 1}, {32, 2}, {34, 2}};
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes())
      for (auto& hk : heads) {
        PaConfig c;
        c.dt = dt;
        c.H = hk[0];
        c.KVH = hk[1];
        c.D = 64;
        c.bs = 16;
        c.ctx = {37, 1, 16, 50, 17};
        Pa a(c);
        run_and_check(a);
      }
  }
}

void head_mapping_case(int64_t H, int64_t KVH) {
  // Each kv head's V is a constant (its index + 1) and K is zero: every query head must
  // return 1 + h / (H / KVH). A mapping of h % KVH (or any other) shows at once.
  PaConfig c;
  c.H = H;
  c.KVH = KVH;
  c.D = 16;
  c.bs = 4;
  c.ctx = {5, 9};
  c.nan_invisible = false;
  Pa a(c);
  const int64_t row = KVH * c.D;
  for (int64_t i = 0; i < a.kc.numel(); ++i) {
    a.kc.set(i, 0.0);
    a.vc.set(i, double((i % row) / c.D + 1));
  }
  KS_RUN_OR_SKIP(a.run());
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t h = 0; h < H; ++h)
      EXPECT_NEAR(a.out.get((t * H + h) * c.D + 3), double(h / (H / KVH) + 1), 1e-5)
          << "H " << H << " KVH " << KVH << " h " << h;
}

TEST(PagedAttention, KvHeadMappingIsHOverGroup) {
  FOR_EACH_VARIANT(kOp) {
    for (auto [H, KVH] : {std::pair<int64_t, int64_t>{8, 2}, {12, 3}, {9, 3}, {4, 1}, {32, 2}}) head_mapping_case(H, KVH);
  }
}

TEST(PagedAttention, BlockSizesAndContextLengths) {
  FOR_EACH_VARIANT(kOp) {
    for (int64_t bs : {1, 7, 16})
      for (DType dt : kFloatTypes()) {
        PaConfig c;
        c.dt = dt;
        c.bs = bs;
        c.H = 4;
        c.KVH = 2;
        c.D = 32;
        const int32_t b = int32_t(bs);
        c.ctx = {0, 1, b - 1 > 0 ? b - 1 : 2, b, b + 1, 3 * b + 2, 0, 40, 15, 16, 17};
        Pa a(c);
        run_and_check(a);
      }
  }
}

TEST(PagedAttention, ContextFillsEveryBlockOfTheTable) {
  // context_len == max_blocks_per_seq * block_size (the capacity) is valid.
  FOR_EACH_VARIANT(kOp) {
    for (int64_t bs : {1, 7, 16}) {
      PaConfig c;
      c.bs = bs;
      c.H = 4;
      c.KVH = 1;
      c.D = 16;
      c.ctx = {int32_t(3 * bs), int32_t(2 * bs + 1)};
      c.max_blocks = 3;
      Pa a(c);
      run_and_check(a);
    }
  }
}

TEST(PagedAttention, ZeroContextGivesZeroRows) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) {
      PaConfig c;
      c.dt = dt;
      c.ctx = {0, 0, 0};
      Pa a(c);  // max_blocks_per_seq is 0 here: block_tables (3, 0)
      ASSERT_EQ(a.d.MB, 0);
      run_and_check(a);
      PaConfig c2 = c;
      c2.ctx = {0, 5, 0};
      Pa b(c2);
      run_and_check(b);
    }
  }
}

TEST(PagedAttention, PrefillWithSeqIds) {
  // Tokens of sequence 1 (a 19-token prompt, context lengths 1..19) interleaved with decode
  // tokens of sequences 0 and 2; sequence 3 has no tokens.
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes())
      for (int64_t bs : {1, 7, 16}) {
        PaConfig c;
        c.dt = dt;
        c.bs = bs;
        c.H = 12;
        c.KVH = 3;
        c.D = 64;
        for (int32_t i = 1; i <= 19; ++i) {
          c.ctx.push_back(i);
          c.seq.push_back(1);
          if (i == 5) c.ctx.push_back(33), c.seq.push_back(0);
          if (i == 12) c.ctx.push_back(8), c.seq.push_back(2);
        }
        c.num_seqs = 4;
        Pa a(c);
        run_and_check(a);
      }
  }
}

TEST(PagedAttention, SeqIdsGivenForDecode) {
  // seq_ids need not be the identity: tokens in reverse sequence order, repeats.
  FOR_EACH_VARIANT(kOp) {
    PaConfig c;
    c.H = 8;
    c.KVH = 2;
    c.ctx = {10, 20, 30, 20};
    c.seq = {2, 1, 0, 1};
    Pa a(c);
    run_and_check(a);
  }
}

void uniform_weights_case() {
  // scale 0: the output is exactly the mean of the visible V rows (uniform weights).
  PaConfig c;
  c.scale = 0.0;
  c.H = 1;
  c.KVH = 1;
  c.D = 16;
  c.bs = 4;
  c.ctx = {4};
  Pa a(c);
  for (int64_t i = 0; i < a.vc.numel(); ++i) a.vc.set(i, double((i / 16) % 4 * 4 + i % 4));  // row r: 4r + e%4
  KS_RUN_OR_SKIP(a.run());
  const int64_t blk = get_i(a.bt, 0);
  for (int e = 0; e < 16; ++e) {
    double mean = 0;
    for (int j = 0; j < 4; ++j) mean += a.vc.get((blk * 4 + j) * 16 + e) / 4.0;
    EXPECT_NEAR(a.out.get(e), mean, 1e-6) << "dim " << e;
  }
}

TEST(PagedAttention, ScaleIsApplied) {
  FOR_EACH_VARIANT(kOp) {
    for (double scale : {0.0, 2.5, -1.0, 1e-3, 0.1})
      for (DType dt : kFloatTypes()) {
        PaConfig c;
        c.dt = dt;
        c.scale = scale;
        c.H = 4;
        c.KVH = 2;
        c.D = 16;
        c.ctx = {9, 23};
        c.bs = 7;
        Pa a(c);
        run_and_check(a);
      }
    uniform_weights_case();
  }
}

void large_logits_case(DType dt, int sign) {
  // q = 30 * sign pattern, k_j = alpha_j * sign pattern with distinct integer alpha_j: the dot
  // products reach 30 * 30 * 128 = 115200 (past fp16's 65504) and the scores, ~1e4, are
  // hundreds apart, so the softmax is one-hot: out = v of the best key, exactly. With all
  // alpha_j below -200 every score is about -2e4 (exp underflows without max subtraction).
  PaConfig c;
  c.dt = dt;
  c.H = 2;
  c.KVH = 1;
  c.D = 128;
  c.bs = 16;
  c.ctx = {40};
  c.nan_invisible = false;
  Pa a(c);
  std::vector<double> pat(128);
  for (auto& p : pat) p = (rng()() & 1) ? 1.0 : -1.0;
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t e = 0; e < 128; ++e) a.q.set(h * 128 + e, 30.0 * pat[size_t(e)]);
  std::vector<int> alpha(40);
  std::iota(alpha.begin(), alpha.end(), 1);
  std::shuffle(alpha.begin(), alpha.end(), rng());
  int64_t best = 0;
  for (int64_t j = 0; j < 40; ++j) {
    const double al = sign > 0 ? double(alpha[size_t(j)]) : -double(alpha[size_t(j)]) - 200.0;
    if ((sign > 0 && alpha[size_t(j)] == 40) || (sign < 0 && alpha[size_t(j)] == 1)) best = j;
    for (int64_t e = 0; e < 128; ++e) a.kc.set(a.slot(0, j) * 128 + e, al * pat[size_t(e)]);
  }
  KS_RUN_OR_SKIP(a.run());
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t e = 0; e < 128; ++e) {
      const double want = a.vc.get(a.slot(0, best) * 128 + e);
      ASSERT_EQ(a.out.get(h * 128 + e), want) << dt_name(dt) << " sign " << sign << " head " << h << " dim " << e;
    }
}

TEST(PagedAttention, LargeLogitsDoNotOverflow) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes())
      for (int sign : {1, -1}) large_logits_case(dt, sign);
  }
}

TEST(PagedAttention, HeadDims) {
  FOR_EACH_VARIANT(kOp) {
    for (int64_t D : {1, 3, 8, 16, 80, 128, 256, 272})
      for (DType dt : kFloatTypes()) {
        PaConfig c;
        c.dt = dt;
        c.D = D;
        c.H = 4;
        c.KVH = 2;
        c.bs = 7;
        c.ctx = {12, 3};
        Pa a(c);
        run_and_check(a);
      }
  }
}

TEST(PagedAttention, MisalignedViews) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes())
      for (size_t off : {size_t(1), size_t(2), size_t(5)}) {
        PaConfig c;
        c.dt = dt;
        c.off = off;
        c.H = 9;
        c.KVH = 3;
        c.D = off == 5 ? 64 : 40;
        c.bs = 7;
        c.ctx = {15, 1, 0, 22};
        Pa a(c);
        run_and_check(a);
      }
  }
}

TEST(PagedAttention, UnusedBlockTableEntriesAreNotRead) {
  // Entries past a sequence's context (and rows of sequences no token reads) may hold
  // padding such as -1: only the blocks covering keys 0..context_len-1 are used.
  FOR_EACH_VARIANT(kOp) {
    for (int32_t pad : {-1, 1 << 30}) {
      PaConfig c;
      c.pad = pad;
      c.H = 4;
      c.KVH = 2;
      c.D = 16;
      c.bs = 4;
      c.ctx = {5, 13, 2};
      c.seq = {0, 2, 0};
      c.num_seqs = 4;
      c.max_blocks = 6;
      Pa a(c);
      run_and_check(a);
    }
  }
}

TEST(PagedAttention, ManyTokensAndLongContexts) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : {DType::BF16, DType::F32}) {
      PaConfig c;
      c.dt = dt;
      c.H = 8;
      c.KVH = 2;
      c.D = 128;
      c.bs = 16;
      for (int i = 0; i < 72; ++i) c.ctx.push_back(int32_t(1 + (i * 97) % 300));  // T*H*D > 2^16: threaded paths
      Pa a(c);
      run_and_check(a);
    }
  }
}

TEST(PagedAttention, SharedPrefixBlocks) {
  // Two sequences whose tables point at the same physical blocks for a shared prefix.
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) {
      PaConfig c;
      c.dt = dt;
      c.H = 8;
      c.KVH = 2;
      c.D = 32;
      c.bs = 8;
      c.ctx = {20, 9, 17};
      c.seq = {0, 1, 1};
      Pa a(c);
      set_i(a.bt, 1 * a.d.MB + 0, get_i(a.bt, 0));  // seq 1 block 0 = seq 0 block 0
      set_i(a.bt, 1 * a.d.MB + 1, get_i(a.bt, 1));  // seq 1 block 1 = seq 0 block 1 (full for seq 0)
      for (int64_t e = 0; e < a.kc.numel(); ++e)    // seq 1's third block: make sure it is finite
        if (std::isnan(a.kc.get(e))) a.kc.set(e, 0.25), a.vc.set(e, -0.5);
      run_and_check(a);
    }
  }
}

void batch_invariance_case(DType dt) {
  // A token's output is the same alone or inside a batch, bit for bit (same variant).
  PaConfig c;
  c.dt = dt;
  c.H = 8;
  c.KVH = 2;
  c.D = 64;
  c.bs = 16;
  c.ctx = {37, 80, 5, 61, 16, 200, 1, 99};
  Pa a(c);
  KS_RUN_OR_SKIP(a.run());
  const size_t row = size_t(c.H * c.D) * ks::dtype_size(dt);
  for (int64_t t : {int64_t(1), int64_t(5), int64_t(7)}) {
    // The same query row, block-table row and context length, as a one-token call.
    Buf out1(dt, {1, c.H, c.D}, 1), q1(dt, {1, c.H, c.D}, 2), bt1(DType::I32, {1, a.d.MB}), cl1(DType::I32, {1});
    std::memcpy(q1.data(), static_cast<uint8_t*>(a.q.data()) + size_t(t) * row, row);
    for (int64_t b = 0; b < a.d.MB; ++b) set_i(bt1, b, get_i(a.bt, t * a.d.MB + b));
    set_i(cl1, 0, c.ctx[size_t(t)]);
    out1.poison();
    DLTensor o = out1.dl(), qq = q1.dl(), k = a.kc.dl(), v = a.vc.dl(), bb = bt1.dl(), l = cl1.dl();
    KS_RUN_OR_SKIP(ks_paged_attention(&o, &qq, &k, &v, &bb, nullptr, &l, a.scale_arg, KS_BACKEND_AUTO, nullptr));
    EXPECT_EQ(0, std::memcmp(out1.data(), static_cast<uint8_t*>(a.out.data()) + size_t(t) * row, row))
        << dt_name(dt) << " token " << t;
  }
}

TEST(PagedAttention, TokenResultIndependentOfBatch) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes()) batch_invariance_case(dt);
  }
}

TEST(PagedAttention, PinnedVariantThatCannotRunWritesNothing) {
  // ks_force_variant: a pinned variant that declines a call fails it with
  // BACKEND_UNAVAILABLE naming the op, and writes nothing.
  for (const std::string& v : variants_of(kOp)) {
    if (v.empty() || v == "cpu_reference") continue;
    PaConfig c;
    c.dt = DType::F16;  // the reference takes every dtype; a fast path may not
    c.D = 24;
    c.ctx = {5, 9};
    Pa a(c);
    ASSERT_EQ(ks_force_variant(kOp, v.c_str()), KS_SUCCESS) << ks_last_error();
    Snap s{&a.out, &a.q, &a.kc, &a.vc, &a.bt, &a.cl};
    const ks_status_t st = a.run();
    const std::string msg = ks_last_error();
    ks_force_variant(kOp, nullptr);
    if (st == KS_SUCCESS) {
      EXPECT_TRUE(matches(a)) << v;
    } else {
      EXPECT_EQ(st, KS_ERROR_BACKEND_UNAVAILABLE) << v << ": " << msg;
      EXPECT_NE(msg.find(kOp), std::string::npos) << msg;
      EXPECT_TRUE(s.same()) << v << " declined but wrote";
    }
  }
}

TEST(PagedAttention, ScaleThatOverflowsFp32) {
  // 1e39 is finite as a double but fp32(1e39) = inf, and the contract computes scale * q.k
  // in FP32: the call must be rejected like a non-finite scale (nothing written), or at
  // least give a finite result -- never NaN rows.
  for (double sc : {1e39, -1e39}) {
    PaConfig c = PaConfig{};
    c.H = 2;
    c.KVH = 1;
    c.D = 8;
    c.bs = 4;
    c.ctx = {6};
    c.scale = sc;
    Pa a(c);
    Snap s{&a.out, &a.q, &a.kc, &a.vc, &a.bt, &a.cl};
    const ks_status_t st = a.run();
    if (st == KS_SUCCESS) {
      for (int64_t i = 0; i < a.out.numel(); ++i)
        ASSERT_TRUE(std::isfinite(a.out.get(i))) << "scale " << sc << " accepted but out[" << i << "] = " << a.out.get(i);
    } else {
      EXPECT_TRUE(fails_cleanly(st, KS_ERROR_INVALID_ARGUMENT, kOp, "scale", s)) << "scale " << sc;
    }
  }
}

// ---- validation -----------------------------------------------------------------------

PaConfig small_cfg(DType dt = DType::F32) {
  PaConfig c;
  c.dt = dt;
  c.H = 4;
  c.KVH = 2;
  c.D = 8;
  c.bs = 4;
  c.ctx = {5, 3, 7};
  c.seq = {0, 1, 0};
  c.num_seqs = 2;
  c.max_blocks = 2;
  c.nan_invisible = false;
  return c;
}

TEST(PagedAttention, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Pa a(small_cfg(dt));
    check_common_rules(kOp,
                       {{"out", &a.out, false, {other_float(dt), kI32}},
                        {"q", &a.q, false, {kI32, kU8}},
                        {"k_cache", &a.kc, false, {other_float(dt), kI16}},
                        {"v_cache", &a.vc, false, {other_float(dt), kI32}},
                        {"block_tables", &a.bt, false, {kF32, kU32t, kI64, kI16}},
                        {"seq_ids", &a.sid, true, {kF32, kU32t, kI64}},
                        {"context_lens", &a.cl, false, {kF32, kU32t, kI64, kI16}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_paged_attention(t[0], t[1], t[2], t[3], t[4], t[5], t[6], 0.3, be, nullptr);
                       });
  }
}

// Runs a with one DLTensor mutated (or replaced), expecting a clean failure.
void expect_fail(Pa& a, ks_status_t want, const char* arg, const std::string& what,
                 const std::function<void(std::vector<Dl>&, double&, bool&)>& mut) {
  std::vector<Dl> d;
  d.reserve(7);
  for (Buf* b : {&a.out, &a.q, &a.kc, &a.vc, &a.bt, &a.sid, &a.cl}) d.emplace_back(*b);
  double scale = 0.5;
  bool has_seq = !a.c.seq.empty();
  mut(d, scale, has_seq);
  Snap s{&a.out, &a.q, &a.kc, &a.vc, &a.bt, &a.sid, &a.cl};
  const ks_status_t st = ks_paged_attention(d[0].p(), d[1].p(), d[2].p(), d[3].p(), d[4].p(),
                                            has_seq ? d[5].p() : nullptr, d[6].p(), scale, KS_BACKEND_AUTO, nullptr);
  EXPECT_TRUE(fails_cleanly(st, want, kOp, arg, s)) << what;
}

TEST(PagedAttention, RejectsMixedDtypes) {
  for (DType a_ : kFloatTypes())
    for (DType b_ : kFloatTypes()) {
      if (a_ == b_) continue;
      Pa a(small_cfg(a_));
      const DLDataType other = ks::to_dl(b_);
      expect_fail(a, KS_ERROR_UNSUPPORTED_DTYPE, "out", "out " + dt_name(b_), [&](auto& d, auto&, auto&) { d[0].t.dtype = other; });
      expect_fail(a, KS_ERROR_UNSUPPORTED_DTYPE, "k_cache", "k_cache", [&](auto& d, auto&, auto&) { d[2].t.dtype = other; });
      expect_fail(a, KS_ERROR_UNSUPPORTED_DTYPE, "v_cache", "v_cache", [&](auto& d, auto&, auto&) { d[3].t.dtype = other; });
    }
}

TEST(PagedAttention, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  Pa a(small_cfg());
  // q / out
  expect_fail(a, INV, "q", "q 2-D", [](auto& d, auto&, auto&) { d[1].set_shape({3, 32}); d[0].set_shape({3, 32}); });
  expect_fail(a, INV, "q", "q 4-D", [](auto& d, auto&, auto&) { d[1].set_shape({3, 4, 1, 8}); d[0].set_shape({3, 4, 1, 8}); });
  expect_fail(a, INV, "q|num_heads", "num_heads 0", [](auto& d, auto&, auto&) { d[1].set_shape({3, 0, 8}); d[0].set_shape({3, 0, 8}); });
  expect_fail(a, INV, "q|head_dim", "head_dim 0", [](auto& d, auto&, auto&) {
    d[1].set_shape({3, 4, 0});
    d[0].set_shape({3, 4, 0});
    d[2].set_shape({3, 4, 2, 0});
    d[3].set_shape({3, 4, 2, 0});
  });
  expect_fail(a, INV, "out", "out (3, 8, 4)", [](auto& d, auto&, auto&) { d[0].set_shape({3, 8, 4}); });
  expect_fail(a, INV, "out", "out (2, 4, 8)", [](auto& d, auto&, auto&) { d[0].set_shape({2, 4, 8}); });
  // caches
  expect_fail(a, INV, "k_cache", "k_cache 3-D", [](auto& d, auto&, auto&) { d[2].set_shape({12, 2, 8}); });
  expect_fail(a, INV, "k_cache", "k_cache head_dim 4", [](auto& d, auto&, auto&) { d[2].set_shape({3, 4, 4, 4}); d[3].set_shape({3, 4, 4, 4}); });
  expect_fail(a, INV, "v_cache", "v_cache shape", [](auto& d, auto&, auto&) { d[3].set_shape({4, 3, 2, 8}); });
  expect_fail(a, INV, "v_cache", "v_cache fewer blocks", [](auto& d, auto&, auto&) { d[3].set_shape({2, 4, 2, 8}); });
  expect_fail(a, INV, "num_heads|num_kv_heads", "4 heads, 3 kv heads",
              [](auto& d, auto&, auto&) { d[2].set_shape({2, 4, 3, 8}); d[3].set_shape({2, 4, 3, 8}); });
  expect_fail(a, INV, "num_heads|num_kv_heads", "4 heads, 8 kv heads",
              [](auto& d, auto&, auto&) { d[2].set_shape({1, 4, 8, 8}); d[3].set_shape({1, 4, 8, 8}); });
  expect_fail(a, INV, "num_heads|num_kv_heads", "0 kv heads",
              [](auto& d, auto&, auto&) { d[2].set_shape({3, 4, 0, 8}); d[3].set_shape({3, 4, 0, 8}); });
  // index tensors
  expect_fail(a, INV, "block_tables", "block_tables 1-D", [](auto& d, auto&, auto&) { d[4].set_shape({4}); });
  expect_fail(a, INV, "block_tables", "block_tables 3-D", [](auto& d, auto&, auto&) { d[4].set_shape({2, 2, 1}); });
  expect_fail(a, INV, "context_lens", "context_lens 2 for 3 tokens", [](auto& d, auto&, auto&) { d[6].set_shape({2}); });
  expect_fail(a, INV, "context_lens", "context_lens 2-D", [](auto& d, auto&, auto&) { d[6].set_shape({3, 1}); });
  expect_fail(a, INV, "seq_ids", "seq_ids 2 for 3 tokens", [](auto& d, auto&, auto&) { d[5].set_shape({2}); });
  expect_fail(a, INV, "seq_ids", "seq_ids 2-D", [](auto& d, auto&, auto&) { d[5].set_shape({1, 3}); });
  expect_fail(a, INV, "block_tables|seq_ids", "NULL seq_ids with 2 sequences for 3 tokens",
              [](auto&, auto&, bool& has) { has = false; });
}

TEST(PagedAttention, RejectsBadScale) {
  Pa a(small_cfg());
  for (double s : {std::nan(""), double(INFINITY), -double(INFINITY)})
    expect_fail(a, KS_ERROR_INVALID_ARGUMENT, "scale", "scale " + std::to_string(s), [&](auto&, double& sc, auto&) { sc = s; });
}

TEST(PagedAttention, RejectsBadIndexValuesNothingWritten) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  // Each bad value sits in the last token's data, after valid tokens.
  for (int32_t bad : {-1, 2, 1000, std::numeric_limits<int32_t>::min()}) {
    Pa a(small_cfg());
    set_i(a.sid, 2, bad);
    expect_fail(a, INV, "seq_ids", "seq_ids[2] = " + std::to_string(bad), [](auto&, auto&, auto&) {});
  }
  for (int32_t bad : {-1, 9, std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()}) {
    Pa a(small_cfg());  // capacity 2 blocks * 4 = 8
    set_i(a.cl, 2, bad);
    expect_fail(a, INV, "context_lens", "context_lens[2] = " + std::to_string(bad), [](auto&, auto&, auto&) {});
  }
  for (int32_t bad : {-1, -2, 1 << 30, std::numeric_limits<int32_t>::min(), 6, 7}) {
    Pa a(small_cfg());  // 6 blocks (3 used + 3 spare); token 2 (seq 0, context 7) uses both of seq 0's entries
    ASSERT_EQ(a.d.NB, 6);
    set_i(a.bt, 0 * 2 + 1, bad);
    expect_fail(a, INV, "block_tables", "block_tables[0, 1] = " + std::to_string(bad), [](auto&, auto&, auto&) {});
  }
  {  // without seq_ids: token t uses row t
    PaConfig c = small_cfg();
    c.seq.clear();
    c.num_seqs = -1;
    c.max_blocks = -1;
    Pa a(c);
    set_i(a.bt, 2 * a.d.MB + 1, -1);
    expect_fail(a, INV, "block_tables", "block_tables[2, 1] = -1 (no seq_ids)", [](auto&, auto&, auto&) {});
  }
}

TEST(PagedAttention, RejectsOverlap) {
  // out sharing storage with each input in turn.
  Pa a(small_cfg());
  const char* names[] = {"q", "k_cache", "v_cache", "block_tables", "seq_ids", "context_lens"};
  for (int which = 1; which <= 6; ++which) {
    expect_fail(a, KS_ERROR_INVALID_ARGUMENT, (std::string("out|") + names[which - 1]).c_str(),
                std::string("out overlapping ") + names[which - 1], [&](std::vector<Dl>& d, auto&, auto&) {
                  // point out's data at the input's data (out is as large as q; the inputs'
                  // Bufs have padding, and nothing is written if validation holds)
                  d[0].t.data = d[size_t(which)].t.data;
                });
  }
}

TEST(PagedAttention, ZeroTokensIsANoOpButValidates) {
  PaConfig c = small_cfg();
  c.ctx.clear();
  c.seq.clear();
  c.num_seqs = -1;
  c.max_blocks = 2;
  c.extra_blocks = 3;
  Pa a(c);
  ASSERT_EQ(a.d.T, 0);
  Snap s{&a.out, &a.q, &a.kc, &a.vc, &a.bt, &a.cl};
  EXPECT_EQ(a.run(), KS_SUCCESS) << ks_last_error();
  EXPECT_TRUE(s.same());
  expect_fail(a, KS_ERROR_INVALID_ARGUMENT, "num_heads|num_kv_heads", "0 tokens, 4 heads over 3 kv heads",
              [](auto& d, auto&, auto&) { d[2].set_shape({3, 4, 3, 8}); d[3].set_shape({3, 4, 3, 8}); });
  expect_fail(a, KS_ERROR_INVALID_ARGUMENT, "scale", "0 tokens, NaN scale", [](auto&, double& sc, auto&) { sc = std::nan(""); });
}

// Body of the death-test child: 0 when the call returned a correct result or a clean error.
int zero_block_size_child() {
  Buf out(DType::F32, {2, 4, 8}), q(DType::F32, {2, 4, 8}), kc(DType::F32, {3, 0, 2, 8}), vc(DType::F32, {3, 0, 2, 8}),
      bt(DType::I32, {2, 2}), cl(DType::I32, {2});
  kstest::fill_normal(q);
  for (int i = 0; i < 4; ++i) set_i(bt, i, i % 3);
  set_i(cl, 0, 0);
  set_i(cl, 1, 0);
  out.poison();
  DLTensor o = out.dl(), qq = q.dl(), k = kc.dl(), v = vc.dl(), b = bt.dl(), l = cl.dl();
  const ks_status_t st = ks_paged_attention(&o, &qq, &k, &v, &b, nullptr, &l, 0.5, KS_BACKEND_AUTO, nullptr);
  bool ok = st == KS_ERROR_INVALID_ARGUMENT;
  if (st == KS_SUCCESS) {
    ok = true;
    for (int64_t i = 0; i < out.numel(); ++i) ok = ok && out.get(i) == 0.0;
  }
  return ok ? 0 : 3;
}

// ks_paged_attention_after_append: paged_attention's bits for every fresh_keys (its promise is a
// permission for CUDA's loads, never a change of result; GPU: Cuda.AttentionAfterAppendSameBits),
// decode tokens (one per sequence, contexts of 0 to 200) and a prefill with seq_ids; errors carry
// its own name, and fresh_keys < 0 is refused by name with nothing written.
TEST(PagedAttention, AfterAppendGivesTheSameBits) {
  FOR_EACH_VARIANT(kOp) {
    for (DType dt : kFloatTypes())
      for (bool prefill : {false, true}) {
        PaConfig c;
        c.dt = dt;
        c.H = 9;
        c.KVH = 3;
        c.D = 64;
        c.bs = 16;
        if (prefill) {
          for (int32_t i = 1; i <= 20; ++i) c.ctx.push_back(i), c.seq.push_back(0);
          c.num_seqs = 1;
        } else {
          c.ctx = {1, 64, 65, 200, 0, 17};
        }
        Pa a(c);
        KS_RUN_OR_SKIP(a.run());
        ASSERT_TRUE(matches(a)) << describe(a);
        const Buf want = a.out;
        for (int64_t fresh : {int64_t(0), int64_t(1), int64_t(5), std::numeric_limits<int64_t>::max()}) {
          a.out.poison();
          ASSERT_EQ(a.run_after(fresh), KS_SUCCESS) << ks_last_error();
          EXPECT_EQ(0, std::memcmp(a.out.data(), want.data(), a.out.nbytes()))
              << "fresh_keys " << fresh << ": " << describe(a);
          EXPECT_TRUE(a.out.guards_intact()) << "fresh_keys " << fresh;
        }
      }
  }
}

TEST(PagedAttention, AfterAppendRejectsNegativeFreshKeysNothingWritten) {
  const char* op = "paged_attention_after_append";
  Pa a(small_cfg());
  for (int64_t bad : {int64_t(-1), int64_t(-7), std::numeric_limits<int64_t>::min()}) {
    Snap s{&a.out, &a.q, &a.kc, &a.vc, &a.bt, &a.sid, &a.cl};
    EXPECT_TRUE(fails_cleanly(a.run_after(bad), KS_ERROR_INVALID_ARGUMENT, op, "fresh_keys", s)) << bad;
    EXPECT_NE(std::string(ks_last_error()).find(std::to_string(bad)), std::string::npos) << ks_last_error();
  }
  // paged_attention's own rules, under this name
  Snap s{&a.out, &a.q, &a.kc, &a.vc, &a.bt, &a.sid, &a.cl};
  EXPECT_TRUE(fails_cleanly(a.run_after(1, double(INFINITY)), KS_ERROR_INVALID_ARGUMENT, op, "scale", s));
  set_i(a.cl, 2, 9);  // past the capacity of 8
  Snap s2{&a.out, &a.q, &a.kc, &a.vc, &a.bt, &a.sid, &a.cl};
  EXPECT_TRUE(fails_cleanly(a.run_after(1), KS_ERROR_INVALID_ARGUMENT, op, "context_lens", s2));
}

TEST(PagedAttention, ZeroBlockSizeDoesNotCrash) {
  // k_cache (num_blocks, 0, kvh, d): capacity 0, so only context length 0 can be valid. The
  // call must return (zeros, or INVALID_ARGUMENT with nothing written) -- never crash.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(zero_block_size_child()), ::testing::ExitedWithCode(0), "");
}

// An empty cache may have any block_size (0 blocks x 2^63 - 1 keys is a valid tensor). A context
// of 3 keys then needs block_tables' first entry in [0, 0): refused by name, nothing written. The
// block count was (len + block_size - 1) / block_size, which overflowed to a negative count, so
// the entries went unchecked and the kernels read past the caches (an adversarial review's find;
// a segfault at block id 100000). And a capacity max_blocks_per_seq * block_size past int64 is
// refused by name instead of overflowing.
TEST(PagedAttention, HugeBlockSizeOfAnEmptyCacheIsChecked) {
  // one token, 1 head of 16, an empty cache of that block_size, a table row of these entries and
  // this context length: refused with `why` in the error, out untouched
  auto refused = [](int64_t block_size, const std::vector<int32_t>& entries, int32_t len, const std::string& why) {
    Buf out(DType::F32, {1, 1, 16}), q(DType::F32, {1, 1, 16}), kc(DType::F32, {0, block_size, 1, 16}),
        vc(DType::F32, {0, block_size, 1, 16}), bt(DType::I32, {1, int64_t(entries.size())}), cl(DType::I32, {1});
    kstest::fill_normal(q);
    for (size_t i = 0; i < entries.size(); ++i) set_i(bt, int64_t(i), entries[i]);
    set_i(cl, 0, len);
    out.poison();
    const std::vector<uint8_t> before = out.raw;
    DLTensor o = out.dl(), qq = q.dl(), k = kc.dl(), v = vc.dl(), b = bt.dl(), l = cl.dl();
    EXPECT_EQ(ks_paged_attention(&o, &qq, &k, &v, &b, nullptr, &l, 0.25, KS_BACKEND_CPU, nullptr),
              KS_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(ks_last_error()).find(why), std::string::npos) << ks_last_error();
    EXPECT_TRUE(out.raw == before) << "out was written";
  };
  for (int32_t blk : {0, 1, 100000})
    refused(std::numeric_limits<int64_t>::max(), {blk}, 3, "block_tables[0, 0] = " + std::to_string(blk));
  // 2 blocks of 2^62 keys: the capacity 2^63 overflows int64 (even at length 0)
  refused(int64_t(1) << 62, {0, 0}, 0, "times k_cache's block_size");
}

}  // namespace
