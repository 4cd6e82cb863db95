// ks_embedding: dense tables (rows copied bit-exactly, whatever the bits), packed GGUF
// tables (decoded per an independent FP64 decoder, rounded once to out's dtype), ids int32
// and int64 of any shape, out-of-range ids rejected before anything is written, and every
// validation rule.
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
#include "gguf_blocks_fp64.hpp"

namespace {

using namespace kstest::harness;
using namespace kstest::gguf;

const char* kOp = "embedding";

ks_status_t run_emb(Buf& out, Buf& ids, Buf& table, ks_qtype_t fmt, ks_backend_t be = KS_BACKEND_AUTO) {
  DLTensor o = out.dl(), i = ids.dl(), t = table.dl();
  return ks_embedding(&o, &i, &t, fmt, be, nullptr);
}

std::vector<int64_t> with_hidden(std::vector<int64_t> s, int64_t h) {
  s.push_back(h);
  return s;
}

// Random ids in [0, vocab), always including 0 and vocab - 1 when there is room, and repeats.
void fill_ids(Buf& ids, int64_t vocab) {
  std::uniform_int_distribution<int64_t> d(0, vocab - 1);
  const int64_t n = ids.numel();
  for (int64_t i = 0; i < n; ++i) set_i(ids, i, d(rng()));
  if (n > 0) set_i(ids, 0, vocab - 1);
  if (n > 1) set_i(ids, n - 1, 0);
  if (n > 3) set_i(ids, 2, get_i(ids, 1));
}

// Dense: every output row must be the table row's bytes, exactly.
void check_dense(DType dt, DType idt, std::vector<int64_t> ids_shape, int64_t vocab, int64_t hidden, size_t off_out,
                 size_t off_ids, size_t off_table) {
  Buf table(dt, {vocab, hidden}, off_table);
  fill_bytes(table);  // NaN payloads, signaling NaNs, subnormals, infinities: all must survive
  Buf ids(idt, ids_shape, off_ids);
  fill_ids(ids, vocab);
  Buf out(dt, with_hidden(ids_shape, hidden), off_out);
  out.poison();
  Snap in{&table, &ids};
  KS_RUN_OR_SKIP(run_emb(out, ids, table, KS_QTYPE_NONE));
  const size_t row = size_t(hidden) * ks::dtype_size(dt);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int64_t id = get_i(ids, i);
    EXPECT_EQ(0, std::memcmp(static_cast<const uint8_t*>(out.data()) + size_t(i) * row,
                             static_cast<const uint8_t*>(table.data()) + size_t(id) * row, row))
        << dt_name(dt) << " ids " << dt_name(idt) << ": output row " << i << " (id " << id << ") is not bit-exact";
  }
  EXPECT_TRUE(out.guards_intact());
  EXPECT_TRUE(in.same()) << "inputs modified";
}

TEST(Embedding, DenseRowsAreBitExact) {
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes())
    for (DType idt : {DType::I32, DType::I64}) {
      check_dense(dt, idt, {5}, 11, 64, 0, 0, 0);
      check_dense(dt, idt, {2, 3}, 7, 33, 0, 0, 0);    // ids of shape (2, 3): out (2, 3, hidden)
      check_dense(dt, idt, {1}, 1, 1, 0, 0, 0);        // one row, one column
      check_dense(dt, idt, {37}, 50, 4099, 1, 3, 2);   // misaligned views, wide odd rows
      check_dense(dt, idt, {2, 2, 2}, 9, 17, 3, 1, 1); // 3-D ids
    }
}

TEST(Embedding, ScalarIdGivesOneRow) {
  // ids 0-d: out has shape (hidden,).
  FOR_EACH_VARIANT(kOp)
  for (DType idt : {DType::I32, DType::I64}) [&] {
    Buf table(DType::F32, {6, 10});
    kstest::fill_normal(table);
    Buf ids(idt, {});
    set_i(ids, 0, 4);
    Buf out(DType::F32, {10});
    out.poison();
    KS_RUN_OR_SKIP(run_emb(out, ids, table, KS_QTYPE_NONE));
    EXPECT_EQ(0, std::memcmp(out.data(), static_cast<const float*>(table.data()) + 40, 40));
    EXPECT_TRUE(out.guards_intact());
  }();
}

TEST(Embedding, PackedTablesAllFormats) {
  FOR_EACH_VARIANT(kOp) {
  int idx = 0;
  for (const auto& f : all_qfmts())
    for (DType dt : kFloatTypes())
      for (DType idt : {DType::I32, DType::I64}) [&] {
        const int64_t hidden = f.block == 1 ? (idx % 2 ? 33 : 96) : (idx % 2 ? 576 : 64);
        const int64_t vocab = 13;
        ++idx;
        Buf table = make_packed(f.q, vocab, hidden, nullptr, size_t(idx % 3), 0.5 + idx % 4);
        const auto ref = decode_all(f.q, table, hidden);
        std::vector<int64_t> ids_shape = idx % 3 == 0 ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{7};
        Buf ids(idt, ids_shape, size_t(idx % 2));
        fill_ids(ids, vocab);
        Buf out(dt, with_hidden(ids_shape, hidden), size_t(idx % 4));
        out.poison();
        Snap in{&table, &ids};
        KS_RUN_OR_SKIP(run_emb(out, ids, table, f.q));
        for (int64_t i = 0; i < ids.numel(); ++i) {
          const int64_t id = get_i(ids, i);
          for (int64_t j = 0; j < hidden; ++j) {
            const double want = round_to(dt, ref[size_t(id * hidden + j)]);
            const double got = out.get(i * hidden + j);
            ASSERT_EQ(got, want) << f.name << " -> " << dt_name(dt) << " ids " << dt_name(idt) << " row " << i
                                 << " (id " << id << ") col " << j;
          }
        }
        EXPECT_TRUE(out.guards_intact());
        EXPECT_TRUE(in.same());
      }();
  }
}

TEST(Embedding, PackedKnownQ8_0Row) {
  // One Q8_0 block per row, d = 0.5 (0x3800), q_j = j - 16 for row 0 and 16 - j for row 1.
  Buf table(DType::U8, {2, 34});
  auto* p = static_cast<uint8_t*>(table.data());
  for (int r = 0; r < 2; ++r) {
    p[34 * r] = 0x00;
    p[34 * r + 1] = 0x38;
    for (int j = 0; j < 32; ++j) p[34 * r + 2 + j] = uint8_t(int8_t(r == 0 ? j - 16 : 16 - j));
  }
  Buf ids(DType::I64, {3});
  set_i(ids, 0, 1);
  set_i(ids, 1, 0);
  set_i(ids, 2, 1);
  FOR_EACH_VARIANT(kOp)
  for (DType dt : kFloatTypes()) [&] {
    Buf out(dt, {3, 32}, 1);
    out.poison();
    KS_RUN_OR_SKIP(run_emb(out, ids, table, KS_QTYPE_Q8_0));
    for (int j = 0; j < 32; ++j) {
      EXPECT_EQ(out.get(j), 0.5 * (16 - j)) << dt_name(dt);
      EXPECT_EQ(out.get(32 + j), 0.5 * (j - 16)) << dt_name(dt);
      EXPECT_EQ(out.get(64 + j), 0.5 * (16 - j)) << dt_name(dt);
    }
  }();
}

TEST(Embedding, OutOfRangeIdsRejectedNothingWritten) {
  const int64_t vocab = 10, hidden = 32;
  for (DType idt : {DType::I32, DType::I64})
    for (ks_qtype_t fmt : {KS_QTYPE_NONE, KS_QTYPE_Q4_1}) {
      std::vector<int64_t> bad{-1, vocab, vocab + 1, std::numeric_limits<int32_t>::min(),
                               std::numeric_limits<int32_t>::max()};
      if (idt == DType::I64) {
        bad.push_back((int64_t(1) << 32) + 1);  // truncates to 1 as int32: must still be rejected
        bad.push_back(std::numeric_limits<int64_t>::min());
        bad.push_back(std::numeric_limits<int64_t>::max());
        bad.push_back(-(int64_t(1) << 32));     // truncates to 0 as int32
      }
      for (int64_t b : bad)
        for (int pos : {0, 5}) {  // first id, or the last id after valid ones
          Buf table = fmt == KS_QTYPE_NONE ? Buf(DType::F16, {vocab, hidden}) : make_packed(fmt, vocab, hidden);
          if (fmt == KS_QTYPE_NONE) kstest::fill_normal(table);
          Buf ids(idt, {2, 3});
          fill_ids(ids, vocab);
          set_i(ids, pos, b);
          Buf out(DType::F16, {2, 3, hidden});
          out.poison();
          Snap s{&out, &ids, &table};
          EXPECT_TRUE(fails_cleanly(run_emb(out, ids, table, fmt), KS_ERROR_INVALID_ARGUMENT, kOp, "ids", s))
              << "id " << b << " at " << pos << " (" << dt_name(idt) << ", format " << int(fmt) << ")";
        }
    }
}

TEST(Embedding, EmptyIdsIsANoOp) {
  for (ks_qtype_t fmt : {KS_QTYPE_NONE, KS_QTYPE_Q8_0}) {
    Buf table = fmt == KS_QTYPE_NONE ? Buf(DType::BF16, {4, 32}) : make_packed(fmt, 4, 32);
    Buf ids(DType::I32, {0});
    Buf out(DType::BF16, {0, 32});
    Snap s{&out, &table, &ids};
    EXPECT_EQ(run_emb(out, ids, table, fmt), KS_SUCCESS) << ks_last_error();
    EXPECT_TRUE(s.same());
    // Empty table (vocab 0) and no ids.
    Buf t0 = fmt == KS_QTYPE_NONE ? Buf(DType::BF16, {0, 32}) : Buf(DType::U8, {0, 34});
    EXPECT_EQ(run_emb(out, ids, t0, fmt), KS_SUCCESS) << ks_last_error();
    // Zero ids still validate: a table/out dtype mismatch is rejected.
    if (fmt == KS_QTYPE_NONE) {
      Buf out32(DType::F32, {0, 32});
      EXPECT_TRUE(fails_cleanly(run_emb(out32, ids, table, fmt), KS_ERROR_UNSUPPORTED_DTYPE, kOp, "table|out", s));
    }
  }
  // Any id into an empty table is out of range.
  Buf t0(DType::F32, {0, 8});
  Buf ids(DType::I64, {1});
  set_i(ids, 0, 0);
  Buf out(DType::F32, {1, 8});
  out.poison();
  Snap s{&out};
  EXPECT_TRUE(fails_cleanly(run_emb(out, ids, t0, KS_QTYPE_NONE), KS_ERROR_INVALID_ARGUMENT, kOp, "ids", s));
}

TEST(Embedding, CommonTensorRulesDense) {
  for (DType dt : kFloatTypes())
    for (DType idt : {DType::I32, DType::I64}) {
      Buf table(dt, {9, 16});
      kstest::fill_normal(table);
      Buf ids(idt, {2, 3});
      fill_ids(ids, 9);
      Buf out(dt, {2, 3, 16});
      out.poison();
      check_common_rules(kOp,
                         {{"out", &out, false, {kI32, other_float(dt), kU8}},
                          {"ids", &ids, false, {kF32, kU8, kI16, kU32t, kF16}},
                          {"table", &table, false, {other_float(dt), kU8}}},
                         [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                           return ks_embedding(t[0], t[1], t[2], KS_QTYPE_NONE, be, nullptr);
                         });
    }
}

TEST(Embedding, CommonTensorRulesPacked) {
  for (DType dt : kFloatTypes()) {
    Buf table = make_packed(KS_QTYPE_Q4_0, 9, 64);
    Buf ids(DType::I64, {4});
    fill_ids(ids, 9);
    Buf out(dt, {4, 64});
    out.poison();
    check_common_rules(kOp,
                       {{"out", &out, false, {kI32, kU8}},
                        {"ids", &ids, false, {kF32, kU8, kU32t}},
                        {"table", &table, false, {kF16, DLDataType{kDLInt, 8, 1}}}},
                       [&](std::vector<DLTensor*>& t, ks_backend_t be) {
                         return ks_embedding(t[0], t[1], t[2], KS_QTYPE_Q4_0, be, nullptr);
                       });
  }
}

TEST(Embedding, RejectsBadShapes) {
  const ks_status_t INV = KS_ERROR_INVALID_ARGUMENT;
  auto expect = [&](Buf& out, Buf& ids, Buf& table, ks_qtype_t fmt, ks_status_t want, const char* arg,
                    const char* what) {
    out.poison();
    Snap s{&out, &ids, &table};
    EXPECT_TRUE(fails_cleanly(run_emb(out, ids, table, fmt), want, kOp, arg, s)) << what;
  };
  Buf ids(DType::I32, {2, 3});
  fill_ids(ids, 5);
  {  // out flattened to (6, H) instead of ids.shape + (H,)
    Buf table(DType::F32, {5, 8});
    kstest::fill_normal(table);
    Buf out(DType::F32, {6, 8});
    expect(out, ids, table, KS_QTYPE_NONE, INV, "out", "out (6, 8) for ids (2, 3)");
    Buf out2(DType::F32, {2, 3, 9});
    expect(out2, ids, table, KS_QTYPE_NONE, INV, "table|out", "hidden 9 vs table 8");
    Buf out3(DType::F32, {3, 2, 8});
    expect(out3, ids, table, KS_QTYPE_NONE, INV, "out", "out (3, 2, 8)");
  }
  {  // table not 2-D
    Buf t1(DType::F32, {40});
    Buf t3(DType::F32, {5, 1, 8});
    Buf out(DType::F32, {2, 3, 8});
    expect(out, ids, t1, KS_QTYPE_NONE, INV, "table", "table 1-D");
    expect(out, ids, t3, KS_QTYPE_NONE, INV, "table", "table 3-D");
  }
  {  // out 0-d
    Buf table(DType::F32, {5, 1});
    Buf ids0(DType::I32, {});
    set_i(ids0, 0, 1);
    Buf out(DType::F32, {});
    expect(out, ids0, table, KS_QTYPE_NONE, INV, "out", "out 0-d");
  }
  {  // hidden 0
    Buf table(DType::F32, {5, 0});
    Buf out(DType::F32, {2, 3, 0});
    expect(out, ids, table, KS_QTYPE_NONE, INV, "out|table", "hidden 0");
  }
  {  // dense table dtype differs from out
    Buf table(DType::BF16, {5, 8});
    kstest::fill_normal(table);
    Buf out(DType::F16, {2, 3, 8});
    expect(out, ids, table, KS_QTYPE_NONE, KS_ERROR_UNSUPPORTED_DTYPE, "table|out", "bf16 table, fp16 out");
  }
  {  // packed: hidden not a multiple of 32, wrong bytes per row, float table
    Buf t(DType::U8, {5, 34});
    Buf out(DType::F32, {2, 3, 48});
    expect(out, ids, t, KS_QTYPE_Q8_0, INV, "table|out", "Q8_0 hidden 48");
    for (const auto& f : all_qfmts()) {
      Buf tb(DType::U8, {5, q_row_bytes(f.q, 64) + 1});
      Buf o(DType::F32, {2, 3, 64});
      expect(o, ids, tb, f.q, INV, "table", f.name);
    }
    Buf tf(DType::F32, {5, 17});  // 68 bytes would be Q8_0 64 columns, but the dtype is float
    Buf o(DType::F32, {2, 3, 64});
    expect(o, ids, tf, KS_QTYPE_Q8_0, KS_ERROR_UNSUPPORTED_DTYPE, "table", "float table for Q8_0");
  }
}

TEST(Embedding, RejectsUnknownTableFormat) {
  Buf table = make_packed(KS_QTYPE_Q8_0, 4, 32);
  Buf ids(DType::I32, {2});
  fill_ids(ids, 4);
  Buf out(DType::F32, {2, 32});
  out.poison();
  for (int fmt : {7, -1, 99}) {
    Snap s{&out, &ids, &table};
    EXPECT_TRUE(fails_cleanly(run_emb(out, ids, table, static_cast<ks_qtype_t>(fmt)), KS_ERROR_INVALID_ARGUMENT, kOp,
                              "table_format", s))
        << "table_format " << fmt;
  }
}

TEST(Embedding, RejectsOverlap) {
  // out inside the table
  Buf store(DType::F32, {64});
  kstest::fill_normal(store);
  Buf ids(DType::I32, {2});
  set_i(ids, 0, 1);
  set_i(ids, 1, 2);
  DLTensor t = store.dl(), o = store.dl(), i = ids.dl();
  int64_t ts[2] = {8, 4}, os[2] = {2, 4};
  t.ndim = 2;
  t.shape = ts;
  o.ndim = 2;
  o.shape = os;
  o.data = static_cast<float*>(store.data()) + 28;  // overlaps table row 7
  Snap s{&store, &ids};
  EXPECT_TRUE(fails_cleanly(ks_embedding(&o, &i, &t, KS_QTYPE_NONE, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "out|table", s));
  // out just past the table is fine.
  o.data = static_cast<float*>(store.data()) + 32;
  EXPECT_EQ(ks_embedding(&o, &i, &t, KS_QTYPE_NONE, KS_BACKEND_AUTO, nullptr), KS_SUCCESS) << ks_last_error();
  EXPECT_EQ(0, std::memcmp(static_cast<float*>(store.data()) + 32, static_cast<float*>(store.data()) + 4, 32));
  // out overlapping ids
  Buf both(DType::I32, {16});
  set_i(both, 0, 0);
  set_i(both, 1, 1);
  DLTensor ii = both.dl(), oo = both.dl(), tt = store.dl();
  int64_t is[1] = {2}, oos[2] = {2, 4};
  ii.shape = is;
  oo.ndim = 2;
  oo.shape = oos;
  oo.dtype = kF32;
  oo.data = static_cast<int32_t*>(both.data()) + 1;
  tt.ndim = 2;
  tt.shape = ts;
  Snap s2{&store, &both};
  EXPECT_TRUE(fails_cleanly(ks_embedding(&oo, &ii, &tt, KS_QTYPE_NONE, KS_BACKEND_AUTO, nullptr),
                            KS_ERROR_INVALID_ARGUMENT, kOp, "out|ids", s2));
}

// A batch big enough for threaded paths: every row still exact.
void large_batch_case() {
  const int64_t vocab = 257, hidden = 1536, n = 300;
  Buf table = make_packed(KS_QTYPE_Q4_0, vocab, hidden);
  const auto ref = decode_all(KS_QTYPE_Q4_0, table, hidden);
  Buf ids(DType::I64, {n});
  fill_ids(ids, vocab);
  Buf out(DType::BF16, {n, hidden}, 2);
  out.poison();
  KS_RUN_OR_SKIP(run_emb(out, ids, table, KS_QTYPE_Q4_0));
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 5; ++i)
    for (int64_t j = 0; j < hidden; ++j) {
      const double want = round_to(DType::BF16, ref[size_t(get_i(ids, i) * hidden + j)]);
      if (out.get(i * hidden + j) != want) {
        ADD_FAILURE() << "row " << i << " col " << j << ": got " << out.get(i * hidden + j) << " want " << want;
        ++bad;
        break;
      }
    }
  EXPECT_TRUE(out.guards_intact());
}

TEST(Embedding, LargeBatchPacked) {
  FOR_EACH_VARIANT(kOp) large_batch_case();
}

}  // namespace
