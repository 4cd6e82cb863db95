// ks_kv_cache_append: bit-exact row copies into a paged cache by slot_mapping; slot -1
// skipped; the token count comes from slot_mapping (extra k/v rows ignored); any slot
// outside [-1, num_blocks * block_size) rejected before anything is written.
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

const char* kOp = "kv_cache_append";

ks_status_t run_append(Buf& kc, Buf& vc, Buf& k, Buf& v, Buf& slots, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor a = kc.dl(), b = vc.dl(), c = k.dl(), d = v.dl(), s = slots.dl();
  return ks_kv_cache_append(&a, &b, &c, &d, &s, be, nullptr);
}

struct KvCase {
  DType dt = DType::F16;
  DType sdt = DType::I64;
  int64_t blocks = 5, bs = 16, kvh = 2, hd = 64;
  int64_t tokens = 9, k_rows = 9;  // k_rows >= tokens: extra rows must be ignored
  int skipped = 2;                 // how many tokens get slot -1
  size_t off = 0;
};

void run_case_one(const KvCase& c) {
  Buf kc(c.dt, {c.blocks, c.bs, c.kvh, c.hd}, c.off), vc(c.dt, {c.blocks, c.bs, c.kvh, c.hd}, c.off + 1);
  Buf k(c.dt, {c.k_rows, c.kvh, c.hd}, c.off + 2), v(c.dt, {c.k_rows, c.kvh, c.hd}, c.off);
  Buf slots(c.sdt, {c.tokens}, c.off + 3);
  fill_bytes(kc);  // any bits: NaN payloads, sNaN, subnormals must survive the copy
  fill_bytes(vc);
  fill_bytes(k);
  fill_bytes(v);
  const int64_t nslots = c.blocks * c.bs;
  ASSERT_LE(c.tokens, nslots);
  std::vector<int64_t> perm(static_cast<size_t>(nslots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng());
  // Distinct slots; the very last slot goes first and slot 0 last.
  std::swap(perm[0], *std::find(perm.begin(), perm.end(), nslots - 1));
  if (c.tokens > 1) std::swap(perm[size_t(c.tokens - 1)], *std::find(perm.begin(), perm.end(), int64_t(0)));
  std::vector<int64_t> sm(perm.begin(), perm.begin() + c.tokens);
  for (int i = 0; i < c.skipped && i < c.tokens; ++i) sm[size_t((3 * i + 1) % c.tokens)] = -1;
  for (int64_t t = 0; t < c.tokens; ++t) set_i(slots, t, sm[size_t(t)]);
  const auto kc0 = kc.raw, vc0 = vc.raw;
  Snap in{&k, &v, &slots};
  KS_RUN_OR_SKIP(run_append(kc, vc, k, v, slots));
  // Expected cache: the original bytes with rows replaced at mapped slots.
  const size_t row = size_t(c.kvh * c.hd) * ks::dtype_size(c.dt);
  auto want_k = kc0, want_v = vc0;
  for (int64_t t = 0; t < c.tokens; ++t) {
    if (sm[size_t(t)] < 0) continue;
    std::memcpy(want_k.data() + kc.offset + size_t(sm[size_t(t)]) * row,
                static_cast<const uint8_t*>(k.data()) + size_t(t) * row, row);
    std::memcpy(want_v.data() + vc.offset + size_t(sm[size_t(t)]) * row,
                static_cast<const uint8_t*>(v.data()) + size_t(t) * row, row);
  }
  const std::string what = dt_name(c.dt) + " slots " + dt_name(c.sdt) + " blocks " + std::to_string(c.blocks) +
                           " bs " + std::to_string(c.bs) + " tokens " + std::to_string(c.tokens) + " k_rows " +
                           std::to_string(c.k_rows);
  for (int64_t s = 0; s < nslots; ++s) {
    EXPECT_EQ(0, std::memcmp(kc.raw.data() + kc.offset + size_t(s) * row, want_k.data() + kc.offset + size_t(s) * row, row))
        << "k_cache slot " << s << " " << what;
    EXPECT_EQ(0, std::memcmp(vc.raw.data() + vc.offset + size_t(s) * row, want_v.data() + vc.offset + size_t(s) * row, row))
        << "v_cache slot " << s << " " << what;
  }
  EXPECT_TRUE(kc.guards_intact() && vc.guards_intact()) << what;
  EXPECT_TRUE(in.same()) << "inputs modified: " << what;
}

// Every case runs under each CPU variant (automatic choice first).
void run_case(const KvCase& c) {
  FOR_EACH_VARIANT(kOp) run_case_one(c);
}

TEST(KvCacheAppend, BitExactCopiesAllDtypes) {
  for (DType dt : kFloatTypes())
    for (DType sdt : {DType::I32, DType::I64}) {
      KvCase c;
      c.dt = dt;
      c.sdt = sdt;
      run_case(c);
    }
}

TEST(KvCacheAppend, BlockSizes) {
  for (int64_t bs : {1, 7, 16})
    for (DType dt : kFloatTypes()) {
      KvCase c;
      c.dt = dt;
      c.bs = bs;
      c.blocks = bs == 1 ? 23 : 4;
      c.tokens = bs == 1 ? 20 : 11;
      c.k_rows = c.tokens;
      c.kvh = 3;
      c.hd = 40;
      run_case(c);
    }
}

TEST(KvCacheAppend, OddRowSizesAndMisalignedViews) {
  for (DType dt : kFloatTypes())
    for (int64_t hd : {1, 3, 17, 129}) {
      KvCase c;
      c.dt = dt;
      c.hd = hd;
      c.kvh = 1;
      c.off = 1;
      c.blocks = 3;
      c.bs = 7;
      c.tokens = 13;
      c.k_rows = 13;
      run_case(c);
    }
}

TEST(KvCacheAppend, TokenCountComesFromSlotMapping) {
  // k and v hold more rows than slot_mapping (e.g. a padded CUDA-graph batch): only the
  // first slot_mapping.size() rows are written, the padding rows go nowhere.
  for (DType dt : kFloatTypes())
    for (int64_t extra : {1, 5, 32}) {
      KvCase c;
      c.dt = dt;
      c.tokens = 6;
      c.k_rows = 6 + extra;
      run_case(c);
    }
}

TEST(KvCacheAppend, AllSkippedLeavesCacheUntouched) {
  for (DType sdt : {DType::I32, DType::I64}) {
    KvCase c;
    c.sdt = sdt;
    c.tokens = 4;
    c.k_rows = 4;
    c.skipped = 4;  // every token -1 (positions 1, 0, 3, 2)
    run_case(c);
  }
}

TEST(KvCacheAppend, EmptySlotMappingIsANoOp) {
  Buf kc(DType::F32, {2, 4, 2, 8}), vc(DType::F32, {2, 4, 2, 8}), k(DType::F32, {3, 2, 8}), v(DType::F32, {3, 2, 8});
  Buf slots(DType::I32, {0});
  kstest::fill_normal(kc);
  kstest::fill_normal(vc);
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  Snap s{&kc, &vc, &k, &v, &slots};
  EXPECT_EQ(run_append(kc, vc, k, v, slots), KS_SUCCESS) << ks_last_error();
  EXPECT_TRUE(s.same());
  // Zero tokens still validate: a cache with the wrong head_dim is rejected.
  Buf bad(DType::F32, {2, 4, 2, 9});
  Snap s2{&kc, &bad, &k, &v, &slots};
  EXPECT_TRUE(fails_cleanly(run_append(kc, bad, k, v, slots), KS_ERROR_INVALID_ARGUMENT, kOp, "v_cache", s2));
}

TEST(KvCacheAppend, OutOfRangeSlotRejectedNothingWritten) {
  const int64_t blocks = 3, bs = 4, nslots = blocks * bs;
  for (DType sdt : {DType::I32, DType::I64}) {
    std::vector<int64_t> bad{nslots, nslots + 1, -2, std::numeric_limits<int32_t>::min(),
                             std::numeric_limits<int32_t>::max()};
    if (sdt == DType::I64) {
      bad.push_back(int64_t(1) << 32);         // 0 if truncated to int32
      bad.push_back((int64_t(1) << 32) - 1);   // -1 if truncated to int32
      bad.push_back(std::numeric_limits<int64_t>::min());
      bad.push_back(std::numeric_limits<int64_t>::max());
    }
    for (int64_t b : bad)
      for (int at : {0, 4}) {  // first token, or after valid tokens
        Buf kc(DType::BF16, {blocks, bs, 2, 8}), vc(DType::BF16, {blocks, bs, 2, 8});
        Buf k(DType::BF16, {5, 2, 8}), v(DType::BF16, {5, 2, 8});
        Buf slots(sdt, {5});
        kstest::fill_normal(kc);
        kstest::fill_normal(vc);
        kstest::fill_normal(k);
        kstest::fill_normal(v);
        for (int t = 0; t < 5; ++t) set_i(slots, t, 2 * t + 1);
        set_i(slots, at, b);
        Snap s{&kc, &vc, &k, &v, &slots};
        EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), KS_ERROR_INVALID_ARGUMENT, kOp, "slot_mapping", s))
            << "slot " << b << " at token " << at << " (" << dt_name(sdt) << ")";
      }
  }
  // An invalid slot in a padding row of k (past slot_mapping's length) does not exist: the
  // check only concerns slot_mapping entries. A zero-block cache only accepts -1.
  Buf kc(DType::F16, {0, 4, 1, 8}), vc(DType::F16, {0, 4, 1, 8}), k(DType::F16, {2, 1, 8}), v(DType::F16, {2, 1, 8});
  Buf slots(DType::I64, {2});
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  set_i(slots, 0, -1);
  set_i(slots, 1, -1);
  EXPECT_EQ(run_append(kc, vc, k, v, slots), KS_SUCCESS) << ks_last_error();
  set_i(slots, 1, 0);
  Snap s{&kc, &vc, &k, &v, &slots};
  EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), KS_ERROR_INVALID_ARGUMENT, kOp, "slot_mapping", s));
}

// A cache of 0 kv heads is empty, so its num_blocks and block_size are not bounded by its bytes:
// num_blocks * block_size past int64 is refused by name (it was a signed overflow).
TEST(KvCacheAppend, SlotCountPastInt64Refused) {
  Buf kc(DType::F32, {2, int64_t(1) << 62, 0, 8}), vc(DType::F32, {2, int64_t(1) << 62, 0, 8});
  Buf k(DType::F32, {1, 0, 8}), v(DType::F32, {1, 0, 8}), slots(DType::I64, {1});
  set_i(slots, 0, 5);
  Snap s{&kc, &vc, &k, &v, &slots};
  EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache", s));
  EXPECT_NE(std::string(ks_last_error()).find("overflows int64"), std::string::npos) << ks_last_error();
}

TEST(KvCacheAppend, CommonTensorRules) {
  for (DType dt : kFloatTypes()) {
    Buf kc(dt, {3, 4, 2, 8}), vc(dt, {3, 4, 2, 8}), k(dt, {5, 2, 8}), v(dt, {5, 2, 8}), slots(DType::I64, {5});
    kstest::fill_normal(kc);
    kstest::fill_normal(vc);
    kstest::fill_normal(k);
    kstest::fill_normal(v);
    for (int t = 0; t < 5; ++t) set_i(slots, t, t == 2 ? -1 : 11 - 2 * t);
    check_common_rules(kOp,
                       {{"k_cache", &kc, false, {other_float(dt), kI32}},
                        {"v_cache", &vc, false, {other_float(dt), kU8}},
                        {"k", &k, false, {kI32, kU8}},
                        {"v", &v, false, {other_float(dt), kI16}},
                        {"slot_mapping", &slots, false, {kF32, kU32t, kI16, DLDataType{kDLFloat, 64, 1}}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_kv_cache_append(t[0], t[1], t[2], t[3], t[4], be, nullptr);
                       });
  }
}

TEST(KvCacheAppend, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf& kc, Buf& vc, Buf& k, Buf& v, Buf& slots, const char* arg, const char* what) {
    Snap s{&kc, &vc, &k, &v, &slots};
    EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), INV, kOp, arg, s)) << what;
  };
  const DType f = DType::F32;
  Buf kc(f, {3, 4, 2, 8}), vc(f, {3, 4, 2, 8}), k(f, {5, 2, 8}), v(f, {5, 2, 8}), slots(DType::I32, {5});
  for (Buf* b : {&kc, &vc, &k, &v}) kstest::fill_normal(*b);
  for (int t = 0; t < 5; ++t) set_i(slots, t, t);
  {
    Buf s6(DType::I32, {6});
    for (int t = 0; t < 6; ++t) set_i(s6, t, t);
    expect(kc, vc, k, v, s6, "k|slot_mapping", "6 slots for 5 rows of k");
    Buf s2(DType::I32, {5, 1});
    expect(kc, vc, k, v, s2, "slot_mapping", "slot_mapping 2-D");
  }
  {
    Buf v4(f, {4, 2, 8});
    expect(kc, vc, k, v4, slots, "v", "v has 4 rows, k 5");
    Buf vh(f, {5, 1, 8});
    expect(kc, vc, k, vh, slots, "v", "v heads");
    Buf vd(f, {5, 2, 4});
    expect(kc, vc, k, vd, slots, "v", "v head_dim");
  }
  {
    Buf k2(f, {5, 16});
    Buf v2(f, {5, 16});
    expect(kc, vc, k2, v2, slots, "k", "k 2-D");
  }
  {
    Buf kch(f, {3, 4, 1, 8});
    expect(kch, vc, k, v, slots, "k_cache", "k_cache heads");
    Buf kcd(f, {3, 4, 2, 16});
    expect(kcd, vc, k, v, slots, "k_cache", "k_cache head_dim");
    Buf kc3(f, {12, 2, 8});
    expect(kc3, vc, k, v, slots, "k_cache", "k_cache 3-D");
    Buf kc5(f, {1, 3, 4, 2, 8});
    expect(kc5, vc, k, v, slots, "k_cache", "k_cache 5-D");
    Buf vcb(f, {4, 3, 2, 8});  // same row size and count, different (blocks, block_size)
    expect(kc, vcb, k, v, slots, "v_cache", "v_cache (4, 3) vs k_cache (3, 4)");
    Buf vcn(f, {2, 4, 2, 8});
    expect(kc, vcn, k, v, slots, "v_cache", "v_cache fewer blocks");
  }
}

TEST(KvCacheAppend, RejectsMixedDtypes) {
  for (DType a : kFloatTypes())
    for (DType b : kFloatTypes()) {
      if (a == b) continue;
      for (int which = 0; which < 3; ++which) {  // v, k_cache, v_cache in dtype b
        Buf kc(which == 1 ? b : a, {2, 4, 1, 8}), vc(which == 2 ? b : a, {2, 4, 1, 8});
        Buf k(a, {3, 1, 8}), v(which == 0 ? b : a, {3, 1, 8}), slots(DType::I64, {3});
        for (int t = 0; t < 3; ++t) set_i(slots, t, t);
        Snap s{&kc, &vc, &k, &v, &slots};
        const char* arg = which == 0 ? "v" : which == 1 ? "k_cache" : "v_cache";
        EXPECT_TRUE(fails_cleanly(run_append(kc, vc, k, v, slots), KS_ERROR_UNSUPPORTED_DTYPE, kOp, arg, s))
            << dt_name(a) << " vs " << dt_name(b) << " in " << arg;
      }
    }
}

TEST(KvCacheAppend, RejectsOverlap) {
  const int64_t n = 2 * 4 * 1 * 8;  // one cache's elements
  Buf store(DType::F16, {3 * n});
  kstest::fill_normal(store);
  Buf k(DType::F16, {3, 1, 8}), v(DType::F16, {3, 1, 8}), slots(DType::I32, {3});
  kstest::fill_normal(k);
  kstest::fill_normal(v);
  for (int t = 0; t < 3; ++t) set_i(slots, t, t);
  auto cache_at = [&](int64_t elem) {
    Dl d(store);
    d.set_shape({2, 4, 1, 8});
    d.t.data = static_cast<uint16_t*>(store.data()) + elem;
    return d;
  };
  DLTensor kk = k.dl(), vv = v.dl(), ss = slots.dl();
  Snap s{&store, &k, &v, &slots};
  {
    Dl kc = cache_at(0), vc = cache_at(0);  // the same cache for k and v
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), &kk, &vv, &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache|v_cache", s));
  }
  {
    Dl kc = cache_at(0), vc = cache_at(n - 1);  // one element shared
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), &kk, &vv, &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache|v_cache", s));
  }
  {  // k inside k_cache; v inside v_cache; slot_mapping inside a cache
    Dl kc = cache_at(0), vc = cache_at(n);
    Dl kin(store);
    kin.set_shape({3, 1, 8});
    kin.t.data = static_cast<uint16_t*>(store.data()) + 8;
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), kin.p(), &vv, &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache|k", s));
    Dl vin(store);
    vin.set_shape({3, 1, 8});
    vin.t.data = static_cast<uint16_t*>(store.data()) + n + 40;
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), &kk, vin.p(), &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "v_cache|v", s));
    Dl kx(store);  // k inside v_cache
    kx.set_shape({3, 1, 8});
    kx.t.data = static_cast<uint16_t*>(store.data()) + n + 2;
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), kx.p(), &vv, &ss, KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "v_cache|k", s));
    Dl sin_(store);
    sin_.set_shape({3});
    sin_.t.dtype = kI32;
    sin_.t.data = static_cast<uint16_t*>(store.data()) + 4;
    EXPECT_TRUE(fails_cleanly(ks_kv_cache_append(kc.p(), vc.p(), &kk, &vv, sin_.p(), KS_BACKEND_AUTO, nullptr),
                              KS_ERROR_INVALID_ARGUMENT, kOp, "k_cache|slot_mapping", s));
  }
  {  // adjacent, disjoint caches are fine
    Dl kc = cache_at(0), vc = cache_at(n);
    EXPECT_EQ(ks_kv_cache_append(kc.p(), vc.p(), &kk, &vv, &ss, KS_BACKEND_AUTO, nullptr), KS_SUCCESS)
        << ks_last_error();
  }
}

TEST(KvCacheAppend, ManyTokens) {
  // A prefill-sized append: every row lands, nothing else moves.
  KvCase c;
  c.dt = DType::BF16;
  c.blocks = 40;
  c.bs = 16;
  c.kvh = 8;
  c.hd = 128;
  c.tokens = 600;
  c.k_rows = 611;
  c.skipped = 7;
  c.off = 1;
  run_case(c);
}

}  // namespace
