// Tests for the bounds-checked GGUF reader (src/model/gguf.{hpp,cpp}).
//
// Small GGUF images are built in memory with the writer below, then parsed
// with GgufFile::from_bytes. Hostile-input tests corrupt specific fields of a
// valid image (using the field positions the writer records) or hand-assemble
// headers, and require a GgufError with a useful message, never a crash.
// Run under -fsanitize=address,undefined to catch out-of-bounds reads.
#include "model/gguf.hpp"
#include "model/generate.hpp"
#include "model/llama.hpp"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace {

using ks::model::ggml_block_geometry;
using ks::model::ggml_type_name;
using ks::model::GgufError;
using ks::model::GgufFile;
using ks::model::GgufTensorInfo;
using ks::model::GgufType;
using ks::model::GgufValue;
using Bytes = std::vector<uint8_t>;

constexpr uint64_t kHuge = uint64_t(1) << 62;
constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();

// ---------------------------------------------------------------------------
// Little-endian byte writer.

struct W {
  Bytes b;
  W& le(uint64_t v, int n) {
    for (int k = 0; k < n; ++k) b.push_back(static_cast<uint8_t>(v >> (8 * k)));
    return *this;
  }
  W& u8(uint8_t v) { return le(v, 1); }
  W& u16(uint16_t v) { return le(v, 2); }
  W& u32(uint32_t v) { return le(v, 4); }
  W& u64(uint64_t v) { return le(v, 8); }
  W& i8(int8_t v) { return le(static_cast<uint8_t>(v), 1); }
  W& i16(int16_t v) { return le(static_cast<uint16_t>(v), 2); }
  W& i32(int32_t v) { return le(static_cast<uint32_t>(v), 4); }
  W& i64(int64_t v) { return le(static_cast<uint64_t>(v), 8); }
  W& f32(float v) {
    uint32_t x;
    std::memcpy(&x, &v, 4);
    return u32(x);
  }
  W& f64(double v) {
    uint64_t x;
    std::memcpy(&x, &v, 8);
    return u64(x);
  }
  W& str(std::string_view s) {
    u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  W& type(GgufType t) { return u32(static_cast<uint32_t>(t)); }
  W& bytes(const Bytes& x) {
    b.insert(b.end(), x.begin(), x.end());
    return *this;
  }
  size_t size() const { return b.size(); }
};

void patch_u32(Bytes& b, size_t at, uint32_t v) {
  for (int k = 0; k < 4; ++k) b.at(at + k) = static_cast<uint8_t>(v >> (8 * k));
}
void patch_u64(Bytes& b, size_t at, uint64_t v) {
  for (int k = 0; k < 8; ++k) b.at(at + k) = static_cast<uint8_t>(v >> (8 * k));
}

// ---------------------------------------------------------------------------
// GGUF image builder. Each kv is a key plus a function that writes the value
// type id and the value. Tensors are placed in order at offsets aligned to
// `layout_alignment`; the last tensor's data ends exactly at the end of the
// file, so every strict prefix of a built image with tensors is invalid.

struct Layout {
  size_t version_at = 0, tensor_count_at = 0, kv_count_at = 0;
  std::vector<size_t> kv_at;         // start of each kv (its key length)
  std::vector<size_t> kv_value_at;   // start of each kv's value type id
  std::vector<size_t> tensor_at;     // start of each tensor info (name length)
  std::vector<size_t> ndims_at;      // each tensor's n_dims field
  std::vector<size_t> type_at;       // each tensor's ggml type field
  std::vector<size_t> offset_at;     // each tensor's offset field
  std::vector<uint64_t> offsets;     // each tensor's offset value
  size_t data_start = 0;
};

struct Builder {
  struct Kv {
    std::string key;
    std::function<void(W&)> value;
  };
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    Bytes data;
  };
  uint32_t version = 3;
  uint64_t layout_alignment = 32;
  std::vector<Kv> kvs;
  std::vector<Tensor> tensors;

  Builder& kv(std::string key, std::function<void(W&)> value) {
    kvs.push_back({std::move(key), std::move(value)});
    return *this;
  }
  Builder& kv_u32(std::string key, uint32_t v) {
    return kv(std::move(key), [v](W& w) { w.type(GgufType::UINT32).u32(v); });
  }
  Builder& kv_u64(std::string key, uint64_t v) {
    return kv(std::move(key), [v](W& w) { w.type(GgufType::UINT64).u64(v); });
  }
  Builder& kv_str(std::string key, std::string v) {
    return kv(std::move(key), [v](W& w) { w.type(GgufType::STRING).str(v); });
  }
  // Adds a tensor with deterministic content of the right size.
  Builder& tensor(std::string name, std::vector<uint64_t> ne, uint32_t type) {
    auto [block, bytes] = ggml_block_geometry(type);
    uint64_t n = ne[0] / block * bytes;
    for (size_t d = 1; d < ne.size(); ++d) n *= ne[d];
    Bytes data(n);
    for (size_t k = 0; k < n; ++k) data[k] = static_cast<uint8_t>(k * 7 + tensors.size() * 31 + 1);
    tensors.push_back({std::move(name), std::move(ne), type, std::move(data)});
    return *this;
  }

  Bytes build(Layout* layout_out = nullptr) const {
    Layout L;
    W w;
    w.b.insert(w.b.end(), {'G', 'G', 'U', 'F'});
    L.version_at = w.size();
    w.u32(version);
    L.tensor_count_at = w.size();
    w.u64(tensors.size());
    L.kv_count_at = w.size();
    w.u64(kvs.size());
    for (const Kv& kv : kvs) {
      L.kv_at.push_back(w.size());
      w.str(kv.key);
      L.kv_value_at.push_back(w.size());
      kv.value(w);
    }
    uint64_t off = 0;
    for (const Tensor& t : tensors) {
      off = (off + layout_alignment - 1) / layout_alignment * layout_alignment;
      L.tensor_at.push_back(w.size());
      w.str(t.name);
      L.ndims_at.push_back(w.size());
      w.u32(static_cast<uint32_t>(t.ne.size()));
      for (uint64_t d : t.ne) w.u64(d);
      L.type_at.push_back(w.size());
      w.u32(t.type);
      L.offset_at.push_back(w.size());
      w.u64(off);
      L.offsets.push_back(off);
      off += t.data.size();
    }
    if (!tensors.empty()) {
      while (w.size() % layout_alignment != 0) w.u8(0);
      L.data_start = w.size();
      for (size_t k = 0; k < tensors.size(); ++k) {
        while (w.size() < L.data_start + L.offsets[k]) w.u8(0);
        w.bytes(tensors[k].data);
      }
    }
    if (layout_out != nullptr) *layout_out = L;
    return w.b;
  }
};

// Expects parsing to fail with a GgufError whose message contains every
// string in `needles`. Returns the message.
std::string expect_error(const Bytes& bytes, std::initializer_list<std::string_view> needles = {}) {
  try {
    GgufFile f = GgufFile::from_bytes(bytes);
    ADD_FAILURE() << "parse succeeded, expected GgufError";
  } catch (const GgufError& e) {
    const std::string msg = e.what();
    for (std::string_view n : needles) {
      EXPECT_NE(msg.find(n), std::string::npos) << "message \"" << msg << "\" lacks \"" << n << "\"";
    }
    return msg;
  }
  return {};
}

// A header with the given counts followed by the bytes of `body`.
Bytes raw_file(uint64_t tensor_count, uint64_t kv_count, const W& body, uint32_t version = 3) {
  W w;
  w.b.insert(w.b.end(), {'G', 'G', 'U', 'F'});
  w.u32(version).u64(tensor_count).u64(kv_count);
  w.bytes(body.b);
  return w.b;
}

// A file exercising every value type, nested arrays, and several tensors.
Builder rich_builder() {
  Builder b;
  b.kv_str("general.architecture", "llama");
  b.kv("v.u8", [](W& w) { w.type(GgufType::UINT8).u8(255); });
  b.kv("v.i8", [](W& w) { w.type(GgufType::INT8).i8(-128); });
  b.kv("v.u16", [](W& w) { w.type(GgufType::UINT16).u16(65535); });
  b.kv("v.i16", [](W& w) { w.type(GgufType::INT16).i16(-32768); });
  b.kv("v.u32", [](W& w) { w.type(GgufType::UINT32).u32(0xFFFFFFFFu); });
  b.kv("v.i32", [](W& w) { w.type(GgufType::INT32).i32(std::numeric_limits<int32_t>::min()); });
  b.kv("v.f32", [](W& w) { w.type(GgufType::FLOAT32).f32(1.5f); });
  b.kv("v.bool_t", [](W& w) { w.type(GgufType::BOOL).u8(1); });
  b.kv("v.bool_f", [](W& w) { w.type(GgufType::BOOL).u8(0); });
  b.kv("v.str", [](W& w) { w.type(GgufType::STRING).str(std::string("he\0llo", 6)); });
  b.kv("v.str_empty", [](W& w) { w.type(GgufType::STRING).str(""); });
  b.kv("v.u64", [](W& w) { w.type(GgufType::UINT64).u64(kU64Max); });
  b.kv("v.i64", [](W& w) { w.type(GgufType::INT64).i64(std::numeric_limits<int64_t>::min()); });
  b.kv("v.f64", [](W& w) { w.type(GgufType::FLOAT64).f64(-2.25); });
  b.kv("a.u8", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::UINT8).u64(3).u8(0).u8(1).u8(255); });
  b.kv("a.i16", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::INT16).u64(2).i16(-5).i16(7); });
  b.kv("a.i32", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::INT32).u64(3).i32(-1).i32(0).i32(1 << 30); });
  b.kv("a.u64", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::UINT64).u64(2).u64(42).u64(kU64Max); });
  b.kv("a.f32", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::FLOAT32).u64(2).f32(0.5f).f32(-3.0f); });
  b.kv("a.f64", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::FLOAT64).u64(1).f64(1e300); });
  b.kv("a.bool", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::BOOL).u64(3).u8(1).u8(0).u8(1); });
  b.kv("a.str", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::STRING).u64(3).str("a").str("").str("<s>"); });
  b.kv("a.empty", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::INT32).u64(0); });
  // [[1, 2], [3]] of INT32
  b.kv("a.nested", [](W& w) {
    w.type(GgufType::ARRAY).type(GgufType::ARRAY).u64(2);
    w.type(GgufType::INT32).u64(2).i32(1).i32(2);
    w.type(GgufType::INT32).u64(1).i32(3);
  });
  // [[["x"]], []] : three levels, innermost strings
  b.kv("a.nested3", [](W& w) {
    w.type(GgufType::ARRAY).type(GgufType::ARRAY).u64(2);
    w.type(GgufType::ARRAY).u64(1);
    w.type(GgufType::STRING).u64(1).str("x");
    w.type(GgufType::FLOAT32).u64(0);
  });
  b.tensor("tok.weight", {64, 3}, 8);       // Q8_0: 2 blocks/row * 34 * 3 = 204 bytes
  b.tensor("norm.weight", {5}, 0);          // F32: 20 bytes
  b.tensor("w.f16", {8, 2, 2, 1}, 1);       // F16: 64 bytes
  b.tensor("w.q4_1", {32, 2}, 3);           // Q4_1: 40 bytes
  b.tensor("w.bf16", {3}, 30);              // BF16: 6 bytes
  return b;
}

// ---------------------------------------------------------------------------
// Round trips

TEST(Gguf, RoundTripScalars) {
  const GgufFile f = GgufFile::from_bytes(rich_builder().build());
  EXPECT_EQ(f.version(), 3u);
  const auto& md = f.metadata();
  EXPECT_EQ(md.size(), 26u);

  EXPECT_EQ(f.find("v.u8")->type, GgufType::UINT8);
  EXPECT_EQ(f.find("v.u8")->u, 255u);
  EXPECT_EQ(f.find("v.i8")->i, -128);
  EXPECT_EQ(f.find("v.u16")->u, 65535u);
  EXPECT_EQ(f.find("v.i16")->i, -32768);
  EXPECT_EQ(f.find("v.u32")->u, 0xFFFFFFFFu);
  EXPECT_EQ(f.find("v.i32")->i, std::numeric_limits<int32_t>::min());
  EXPECT_EQ(f.find("v.f32")->f, 1.5);
  EXPECT_TRUE(f.find("v.bool_t")->b);
  EXPECT_FALSE(f.find("v.bool_f")->b);
  EXPECT_EQ(f.find("v.str")->s, std::string("he\0llo", 6));
  EXPECT_EQ(f.find("v.str_empty")->s, "");
  EXPECT_EQ(f.find("v.u64")->u, kU64Max);
  EXPECT_EQ(f.find("v.i64")->i, std::numeric_limits<int64_t>::min());
  EXPECT_EQ(f.find("v.f64")->type, GgufType::FLOAT64);
  EXPECT_EQ(f.find("v.f64")->f, -2.25);
  EXPECT_EQ(f.find("missing"), nullptr);

  // Typed getters.
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_uint("v.u8"), 255u);
  EXPECT_EQ(f.get_uint("v.u16"), 65535u);
  EXPECT_EQ(f.get_uint("v.u32"), 0xFFFFFFFFu);
  EXPECT_EQ(f.get_uint("v.u64"), kU64Max);
  EXPECT_EQ(f.get_int("v.i8"), -128);
  EXPECT_EQ(f.get_int("v.i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(f.get_int("v.u32"), 0xFFFFFFFFll);
  EXPECT_EQ(f.get_float("v.f32"), 1.5);
  EXPECT_EQ(f.get_float("v.f64"), -2.25);
  EXPECT_EQ(f.get_float("v.u8"), 255.0);  // integers widen to float
  EXPECT_EQ(f.get_float("v.i8"), -128.0);
  EXPECT_TRUE(f.get_bool("v.bool_t", false));
  EXPECT_FALSE(f.get_bool("v.bool_f", true));

  // Defaults for absent keys.
  EXPECT_EQ(f.get_uint("nope", 7), 7u);
  EXPECT_EQ(f.get_int("nope", -7), -7);
  EXPECT_EQ(f.get_float("nope", 0.25), 0.25);
  EXPECT_TRUE(f.get_bool("nope", true));
  // Defaults do not hide a wrong type.
  EXPECT_THROW(f.get_uint("v.str", 7), GgufError);
  EXPECT_THROW(f.get_bool("v.u8", true), GgufError);
}

TEST(Gguf, GetterErrorsNameTheKey) {
  const GgufFile f = GgufFile::from_bytes(rich_builder().build());
  auto msg_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const GgufError& e) {
      return e.what();
    }
    return "(no exception)";
  };
  EXPECT_NE(msg_of([&] { f.get_uint("absent.key"); }).find("absent.key"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.get_string("v.u8"); }).find("v.u8"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.get_uint("v.i8"); }).find("negative"), std::string::npos);  // range check
  EXPECT_NE(msg_of([&] { f.get_int("v.u64"); }).find("v.u64"), std::string::npos);     // > INT64_MAX
  EXPECT_NE(msg_of([&] { f.get_float("v.str"); }).find("v.str"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.get_string_array("a.i32"); }).find("a.i32"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.get_int_array("a.str"); }).find("a.str"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.get_int_array("a.f32"); }).find("a.f32"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.get_int_array("a.bool"); }).find("a.bool"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.get_string("missing.str"); }).find("missing.str"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.get_string_array("missing.arr"); }).find("missing.arr"), std::string::npos);
  EXPECT_NE(msg_of([&] { f.require_tensor("no.such.tensor"); }).find("no.such.tensor"), std::string::npos);
  EXPECT_THROW(f.get_float("missing"), GgufError);
  EXPECT_THROW(f.get_uint("v.f32"), GgufError);
  EXPECT_THROW(f.get_uint("a.u8"), GgufError);
}

TEST(Gguf, RoundTripArrays) {
  const GgufFile f = GgufFile::from_bytes(rich_builder().build());
  EXPECT_EQ(f.get_int_array("a.u8"), (std::vector<int64_t>{0, 1, 255}));
  EXPECT_EQ(f.get_int_array("a.i16"), (std::vector<int64_t>{-5, 7}));
  EXPECT_EQ(f.get_int_array("a.i32"), (std::vector<int64_t>{-1, 0, 1 << 30}));
  const auto& u64s = f.get_int_array("a.u64");
  ASSERT_EQ(u64s.size(), 2u);
  EXPECT_EQ(u64s[0], 42);
  EXPECT_EQ(static_cast<uint64_t>(u64s[1]), kU64Max);  // bit pattern kept
  EXPECT_EQ(f.get_float_array("a.f32"), (std::vector<double>{0.5, -3.0}));
  EXPECT_EQ(f.get_float_array("a.f64"), (std::vector<double>{1e300}));
  const GgufValue* bools = f.find("a.bool");
  ASSERT_NE(bools, nullptr);
  EXPECT_EQ(bools->elem_type, GgufType::BOOL);
  EXPECT_EQ(bools->ai, (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(f.get_string_array("a.str"), (std::vector<std::string>{"a", "", "<s>"}));
  EXPECT_EQ(f.find("a.str")->array_len, 3u);
  EXPECT_TRUE(f.get_int_array("a.empty").empty());
  EXPECT_EQ(f.find("a.empty")->array_len, 0u);

  const GgufValue* n = f.find("a.nested");
  ASSERT_NE(n, nullptr);
  EXPECT_EQ(n->type, GgufType::ARRAY);
  EXPECT_EQ(n->elem_type, GgufType::ARRAY);
  EXPECT_EQ(n->array_len, 2u);
  ASSERT_EQ(n->aa.size(), 2u);
  EXPECT_EQ(n->aa[0].elem_type, GgufType::INT32);
  EXPECT_EQ(n->aa[0].ai, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(n->aa[1].ai, (std::vector<int64_t>{3}));

  const GgufValue* n3 = f.find("a.nested3");
  ASSERT_NE(n3, nullptr);
  ASSERT_EQ(n3->aa.size(), 2u);
  ASSERT_EQ(n3->aa[0].elem_type, GgufType::ARRAY);
  ASSERT_EQ(n3->aa[0].aa.size(), 1u);
  EXPECT_EQ(n3->aa[0].aa[0].as, (std::vector<std::string>{"x"}));
  EXPECT_EQ(n3->aa[1].elem_type, GgufType::FLOAT32);
  EXPECT_EQ(n3->aa[1].array_len, 0u);
  EXPECT_THROW(f.get_int_array("a.nested"), GgufError);
}

TEST(Gguf, Version2Accepted) {
  Builder b = rich_builder();
  b.version = 2;
  const GgufFile f = GgufFile::from_bytes(b.build());
  EXPECT_EQ(f.version(), 2u);
  EXPECT_EQ(f.tensors().size(), 5u);
}

TEST(Gguf, NoTensorsNoPadding) {
  Builder b;
  b.kv_str("general.name", "x");
  b.kv_u32("general.alignment", 4096);
  const Bytes bytes = b.build();
  const GgufFile f = GgufFile::from_bytes(bytes);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.alignment(), 4096u);
  EXPECT_EQ(f.file_size(), bytes.size());

  const GgufFile empty = GgufFile::from_bytes(raw_file(0, 0, W{}));
  EXPECT_TRUE(empty.metadata().empty());
}

// ---------------------------------------------------------------------------
// Tensors

TEST(Gguf, TensorLookupAndData) {
  Layout L;
  const Builder b = rich_builder();
  const Bytes bytes = b.build(&L);
  const GgufFile f = GgufFile::from_bytes(bytes);
  ASSERT_EQ(f.tensors().size(), 5u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset(), L.data_start);
  EXPECT_EQ(f.data_offset() % 32, 0u);

  const GgufTensorInfo& tok = f.require_tensor("tok.weight");
  EXPECT_EQ(tok.ggml_type, 8u);
  EXPECT_EQ(tok.ne, (std::vector<int64_t>{64, 3}));
  EXPECT_EQ(tok.nbytes, 2u * 34 * 3);
  EXPECT_EQ(tok.n_elements(), 192);
  EXPECT_EQ(f.tensor("norm.weight")->nbytes, 20u);
  EXPECT_EQ(f.tensor("w.f16")->nbytes, 64u);
  EXPECT_EQ(f.tensor("w.f16")->ne, (std::vector<int64_t>{8, 2, 2, 1}));
  EXPECT_EQ(f.tensor("w.q4_1")->nbytes, 40u);
  EXPECT_EQ(f.tensor("w.bf16")->nbytes, 6u);
  EXPECT_EQ(f.tensor("missing"), nullptr);
  EXPECT_THROW(f.require_tensor("missing"), GgufError);

  // File order is kept; data pointers point at the right bytes of the image.
  for (size_t k = 0; k < b.tensors.size(); ++k) {
    const GgufTensorInfo& t = f.tensors()[k];
    EXPECT_EQ(t.name, b.tensors[k].name);
    EXPECT_EQ(t.offset, L.offsets[k]);
    EXPECT_EQ(t.offset % 32, 0u);
    EXPECT_EQ(f.tensor(t.name), &t);
    ASSERT_EQ(t.nbytes, b.tensors[k].data.size());
    EXPECT_EQ(std::memcmp(t.data, b.tensors[k].data.data(), t.nbytes), 0) << t.name;
  }
  // The last tensor ends exactly at the end of the file.
  const GgufTensorInfo& last = f.tensors().back();
  EXPECT_EQ(f.data_offset() + last.offset + last.nbytes, bytes.size());
}

TEST(Gguf, MovePreservesDataPointers) {
  GgufFile a = GgufFile::from_bytes(rich_builder().build());
  const uint8_t* p = a.require_tensor("norm.weight").data;
  const uint8_t first = p[0];
  GgufFile b = std::move(a);
  EXPECT_EQ(b.require_tensor("norm.weight").data, p);
  EXPECT_EQ(b.require_tensor("norm.weight").data[0], first);
  GgufFile c = GgufFile::from_bytes(raw_file(0, 0, W{}));
  c = std::move(b);
  EXPECT_EQ(c.require_tensor("norm.weight").data, p);
  EXPECT_EQ(c.get_string("general.architecture"), "llama");
}

TEST(Gguf, BlockGeometry) {
  EXPECT_EQ(ggml_block_geometry(0), (std::pair<int64_t, int64_t>{1, 4}));
  EXPECT_EQ(ggml_block_geometry(1), (std::pair<int64_t, int64_t>{1, 2}));
  EXPECT_EQ(ggml_block_geometry(2), (std::pair<int64_t, int64_t>{32, 18}));
  EXPECT_EQ(ggml_block_geometry(3), (std::pair<int64_t, int64_t>{32, 20}));
  EXPECT_EQ(ggml_block_geometry(6), (std::pair<int64_t, int64_t>{32, 22}));
  EXPECT_EQ(ggml_block_geometry(7), (std::pair<int64_t, int64_t>{32, 24}));
  EXPECT_EQ(ggml_block_geometry(8), (std::pair<int64_t, int64_t>{32, 34}));
  EXPECT_EQ(ggml_block_geometry(9), (std::pair<int64_t, int64_t>{32, 36}));
  EXPECT_EQ(ggml_block_geometry(10), (std::pair<int64_t, int64_t>{256, 84}));
  EXPECT_EQ(ggml_block_geometry(11), (std::pair<int64_t, int64_t>{256, 110}));
  EXPECT_EQ(ggml_block_geometry(12), (std::pair<int64_t, int64_t>{256, 144}));
  EXPECT_EQ(ggml_block_geometry(13), (std::pair<int64_t, int64_t>{256, 176}));
  EXPECT_EQ(ggml_block_geometry(14), (std::pair<int64_t, int64_t>{256, 210}));
  EXPECT_EQ(ggml_block_geometry(15), (std::pair<int64_t, int64_t>{256, 292}));
  EXPECT_EQ(ggml_block_geometry(30), (std::pair<int64_t, int64_t>{1, 2}));
  for (uint32_t bad : {4u, 5u, 31u, 32u, 33u, 36u, 40u, 1000u, 0xFFFFFFFFu}) {
    EXPECT_THROW(ggml_block_geometry(bad), GgufError) << bad;
    EXPECT_STREQ(ggml_type_name(bad), "unknown") << bad;
  }
  EXPECT_STREQ(ggml_type_name(0), "F32");
  EXPECT_STREQ(ggml_type_name(8), "Q8_0");
  EXPECT_STREQ(ggml_type_name(12), "Q4_K");
  EXPECT_STREQ(ggml_type_name(30), "BF16");
  // Every named type has a geometry and vice versa.
  for (uint32_t t = 0; t < 64; ++t) {
    const bool named = std::strcmp(ggml_type_name(t), "unknown") != 0;
    bool has_geometry = true;
    try {
      ggml_block_geometry(t);
    } catch (const GgufError&) {
      has_geometry = false;
    }
    EXPECT_EQ(named, has_geometry) << t;
  }
}

// ---------------------------------------------------------------------------
// Alignment

Builder aligned_builder(std::function<void(W&)> alignment_value, uint64_t layout_alignment) {
  Builder b;
  b.layout_alignment = layout_alignment;
  b.kv_str("general.architecture", "llama");
  b.kv("general.alignment", std::move(alignment_value));
  b.tensor("a", {3}, 0);   // 12 bytes: forces padding before the next tensor
  b.tensor("b", {32}, 8);  // 34 bytes
  b.tensor("c", {5}, 1);
  return b;
}

void check_aligned(const GgufFile& f, uint64_t align) {
  EXPECT_EQ(f.alignment(), align);
  EXPECT_EQ(f.data_offset() % align, 0u);
  for (const GgufTensorInfo& t : f.tensors()) EXPECT_EQ(t.offset % align, 0u) << t.name;
  EXPECT_EQ(f.tensor("b")->offset, (12 + align - 1) / align * align);  // tensor "a" holds 12 bytes
}

TEST(Gguf, AlignmentAsUint32) {
  const GgufFile f =
      GgufFile::from_bytes(aligned_builder([](W& w) { w.type(GgufType::UINT32).u32(64); }, 64).build());
  check_aligned(f, 64);
}

TEST(Gguf, AlignmentAsUint64) {
  const GgufFile f =
      GgufFile::from_bytes(aligned_builder([](W& w) { w.type(GgufType::UINT64).u64(128); }, 128).build());
  check_aligned(f, 128);
}

TEST(Gguf, AlignmentAsOtherIntegerTypes) {
  check_aligned(GgufFile::from_bytes(aligned_builder([](W& w) { w.type(GgufType::UINT8).u8(16); }, 16).build()),
                16);
  check_aligned(GgufFile::from_bytes(aligned_builder([](W& w) { w.type(GgufType::INT16).i16(256); }, 256).build()),
                256);
  check_aligned(GgufFile::from_bytes(aligned_builder([](W& w) { w.type(GgufType::INT64).i64(8); }, 8).build()), 8);
  check_aligned(GgufFile::from_bytes(aligned_builder([](W& w) { w.type(GgufType::UINT32).u32(1); }, 1).build()), 1);
}

TEST(Gguf, BadAlignmentValues) {
  auto bad = [](std::function<void(W&)> v, std::string_view needle) {
    expect_error(aligned_builder(std::move(v), 32).build(), {"general.alignment", needle, "byte offset"});
  };
  bad([](W& w) { w.type(GgufType::UINT32).u32(0); }, "power of two");
  bad([](W& w) { w.type(GgufType::UINT32).u32(48); }, "power of two");
  bad([](W& w) { w.type(GgufType::UINT64).u64(kU64Max); }, "power of two");
  bad([](W& w) { w.type(GgufType::INT32).i32(-32); }, "positive");
  bad([](W& w) { w.type(GgufType::STRING).str("32"); }, "integer");
  bad([](W& w) { w.type(GgufType::FLOAT32).f32(32.0f); }, "integer");
  bad([](W& w) { w.type(GgufType::BOOL).u8(1); }, "integer");
}

TEST(Gguf, AlignmentMismatchDetected) {
  // Laid out with 32-byte alignment but declaring 64: the second tensor's
  // offset (32) is not a multiple of 64.
  expect_error(aligned_builder([](W& w) { w.type(GgufType::UINT32).u32(64); }, 32).build(),
               {"tensor 'b'", "not a multiple", "byte offset"});
}

TEST(Gguf, HugeAlignmentFailsCleanly) {
  // 2^63 is a power of two; the data section would start far past the end.
  expect_error(aligned_builder([](W& w) { w.type(GgufType::UINT64).u64(uint64_t(1) << 63); }, 32).build(),
               {"data section"});
}

// ---------------------------------------------------------------------------
// Truncation and corruption

TEST(Gguf, EveryTruncationFails) {
  const Bytes full = rich_builder().build();
  ASSERT_NO_THROW(GgufFile::from_bytes(full));
  for (size_t n = 0; n < full.size(); ++n) {
    Bytes prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    try {
      GgufFile f = GgufFile::from_bytes(std::move(prefix));
      ADD_FAILURE() << "prefix of " << n << " of " << full.size() << " bytes parsed";
    } catch (const GgufError& e) {
      EXPECT_NE(std::string(e.what()).find("byte offset"), std::string::npos) << e.what();
    }
  }
}

TEST(Gguf, EveryTruncationFailsWithoutTensors) {
  // Without tensors the file ends right after the last kv, so every strict
  // prefix is a truncated kv (or header).
  Builder b = rich_builder();
  b.tensors.clear();
  const Bytes full = b.build();
  ASSERT_NO_THROW(GgufFile::from_bytes(full));
  for (size_t n = 0; n < full.size(); ++n) {
    EXPECT_THROW(GgufFile::from_bytes(Bytes(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n))),
                 GgufError)
        << n;
  }
}

TEST(Gguf, BadMagic) {
  Bytes b = rich_builder().build();
  b[0] = 'g';
  expect_error(b, {"magic", "byte offset 0"});
  expect_error(Bytes{'G', 'G', 'U'}, {"truncated"});
  expect_error(Bytes{}, {"truncated"});
  Bytes ggml = rich_builder().build();
  std::memcpy(ggml.data(), "lmgg", 4);
  expect_error(ggml, {"magic"});
}

TEST(Gguf, BadVersion) {
  Layout L;
  const Bytes good = rich_builder().build(&L);
  for (uint32_t v : {0u, 1u, 4u, 0xFFFFFFFFu}) {
    Bytes b = good;
    patch_u32(b, L.version_at, v);
    expect_error(b, {"version", std::to_string(v), "byte offset 4"});
  }
  Bytes be = good;
  patch_u32(be, L.version_at, 0x03000000u);
  expect_error(be, {"big-endian"});
}

TEST(Gguf, OversizedCounts) {
  Layout L;
  const Bytes good = rich_builder().build(&L);
  for (uint64_t c : {kHuge, kU64Max, uint64_t(1) << 32, uint64_t(good.size())}) {
    Bytes b = good;
    patch_u64(b, L.tensor_count_at, c);
    expect_error(b, {"tensor count", "byte offset 8"});
    b = good;
    patch_u64(b, L.kv_count_at, c);
    expect_error(b, {"kv count", "byte offset 16"});
  }
  // Counts that individually fit but together do not.
  {
    Bytes b = good;
    const uint64_t rem = good.size() - 24;
    patch_u64(b, L.tensor_count_at, rem / 32);
    patch_u64(b, L.kv_count_at, rem / 13);
    expect_error(b, {"together"});
  }
  // A kv count one too large runs into the tensor infos and fails there.
  {
    Bytes b = good;
    patch_u64(b, L.kv_count_at, 27);
    expect_error(b);
  }
}

TEST(Gguf, OversizedArrayCounts) {
  for (GgufType et : {GgufType::UINT8, GgufType::INT32, GgufType::UINT64, GgufType::FLOAT64, GgufType::BOOL,
                      GgufType::STRING, GgufType::ARRAY}) {
    for (uint64_t c : {kHuge, kU64Max, uint64_t(1) << 31}) {
      W body;
      body.str("big.array").type(GgufType::ARRAY).type(et).u64(c).u64(0).u64(0);
      expect_error(raw_file(0, 1, body), {"big.array", "array count", "byte offset 49"});
    }
  }
  // Count just one past what the remaining bytes hold.
  W body;
  body.str("k").type(GgufType::ARRAY).type(GgufType::INT32).u64(3).i32(1).i32(2).i32(3);
  EXPECT_NO_THROW(GgufFile::from_bytes(raw_file(0, 1, body)));
  patch_u64(body.b, 8 + 1 + 4 + 4, 4);
  expect_error(raw_file(0, 1, body), {"'k'", "array count 4"});
}

TEST(Gguf, OversizedStringLengths) {
  for (uint64_t len : {kHuge, kU64Max, uint64_t(1) << 32, uint64_t(100)}) {
    {  // key length
      W body;
      body.u64(len).b.insert(body.b.end(), 40, 'k');
      expect_error(raw_file(0, 1, body), {"kv #0", "key length", "byte offset 24"});
    }
    {  // string value length
      W body;
      body.str("general.name").type(GgufType::STRING).u64(len).str("abcdefgh");
      expect_error(raw_file(0, 1, body), {"general.name", "string value length", "byte offset 48"});
    }
    {  // string array element length
      W body;
      body.str("tok").type(GgufType::ARRAY).type(GgufType::STRING).u64(2).str("a").u64(len).str("xyz");
      expect_error(raw_file(0, 1, body), {"'tok'", "string array element length"});
    }
    {  // tensor name length
      W body;
      body.u64(len).u32(1).u64(32).u32(0).u64(0).u64(0).u64(0);
      expect_error(raw_file(1, 0, body), {"tensor info #0", "tensor name length", "byte offset 24"});
    }
  }
}

TEST(Gguf, BadValueTypeIds) {
  for (uint32_t t : {13u, 100u, 0xFFFFFFFFu}) {
    W body;
    body.str("key.x").type(static_cast<GgufType>(t)).u64(0).u64(0);
    expect_error(raw_file(0, 1, body), {"key.x", "invalid value type", std::to_string(t), "byte offset 37"});
    W arr;
    arr.str("key.y").type(GgufType::ARRAY).u32(t).u64(0).u64(0);
    expect_error(raw_file(0, 1, arr), {"key.y", "invalid array element type", "byte offset 41"});
    W nested;
    nested.str("key.z").type(GgufType::ARRAY).type(GgufType::ARRAY).u64(1).u32(t).u64(0);
    expect_error(raw_file(0, 1, nested), {"key.z", "invalid array element type"});
  }
}

TEST(Gguf, BadBoolByte) {
  W body;
  body.str("flag").type(GgufType::BOOL).u8(2);
  expect_error(raw_file(0, 1, body), {"'flag'", "bool"});
  W arr;
  arr.str("flags").type(GgufType::ARRAY).type(GgufType::BOOL).u64(2).u8(1).u8(0xFF);
  expect_error(raw_file(0, 1, arr), {"'flags'", "bool"});
}

TEST(Gguf, BadGgmlTypeIds) {
  Layout L;
  const Bytes good = rich_builder().build(&L);
  for (uint32_t t : {4u, 5u, 31u, 36u, 1000u, 0xFFFFFFFFu}) {
    Bytes b = good;
    patch_u32(b, L.type_at[1], t);
    expect_error(b, {"tensor 'norm.weight'", "ggml type id " + std::to_string(t),
                     "byte offset " + std::to_string(L.type_at[1])});
  }
}

TEST(Gguf, TensorOffsetsOutOfRange) {
  Layout L;
  const Bytes good = rich_builder().build(&L);
  const size_t last = L.offset_at.size() - 1;
  const uint64_t data_size = good.size() - L.data_start;
  for (uint64_t off : {L.offsets[last] + 32, uint64_t(data_size + 32) / 32 * 32, kU64Max - 31, kHuge}) {
    Bytes b = good;
    patch_u64(b, L.offset_at[last], off);
    expect_error(b, {"tensor 'w.bf16'", "extends past", "byte offset " + std::to_string(L.offset_at[last])});
  }
  // Tensor 0 moved so that it ends one block past the end of the file.
  {
    Bytes b = good;
    const uint64_t end_aligned = (data_size - 204 + 32) / 32 * 32;
    patch_u64(b, L.offset_at[0], end_aligned);
    expect_error(b, {"tensor 'tok.weight'", "extends past"});
  }
  // Misaligned offsets.
  for (uint64_t off : {uint64_t(1), uint64_t(4), uint64_t(16), uint64_t(33)}) {
    Bytes b = good;
    patch_u64(b, L.offset_at[1], off);
    expect_error(b, {"tensor 'norm.weight'", "not a multiple of the alignment 32"});
  }
  // Overlapping but in-range offsets are accepted.
  {
    Bytes b = good;
    patch_u64(b, L.offset_at[1], 0);
    const GgufFile f = GgufFile::from_bytes(b);
    EXPECT_EQ(f.tensor("norm.weight")->data, f.tensor("tok.weight")->data);
  }
}

TEST(Gguf, BadDimensionCounts) {
  Layout L;
  const Bytes good = rich_builder().build(&L);
  for (uint32_t nd : {0u, 5u, 64u, 0xFFFFFFFFu}) {
    Bytes b = good;
    patch_u32(b, L.ndims_at[0], nd);
    expect_error(b, {"tensor 'tok.weight'", "n_dims " + std::to_string(nd),
                     "byte offset " + std::to_string(L.ndims_at[0])});
  }
}

// One tensor info with the given dims and type, offset 0, and no data.
Bytes one_tensor(const std::vector<uint64_t>& ne, uint32_t type) {
  W body;
  body.str("t").u32(static_cast<uint32_t>(ne.size()));
  for (uint64_t d : ne) body.u64(d);
  body.u32(type).u64(0);
  body.b.resize(body.b.size() + 64);  // room so counts are not the first failure
  return raw_file(1, 0, body);
}

TEST(Gguf, DimensionOverflowAndInvalidDims) {
  // Element count overflow.
  expect_error(one_tensor({uint64_t(1) << 32, uint64_t(1) << 32}, 0), {"'t'", "element count overflows"});
  expect_error(one_tensor({uint64_t(1) << 62, 2, 2}, 0), {"'t'", "overflows"});
  expect_error(one_tensor({3, uint64_t(1) << 40, uint64_t(1) << 40, 1}, 0), {"'t'", "overflows"});
  // Element count fits in int64, byte size does not.
  expect_error(one_tensor({uint64_t(1) << 62}, 0), {"'t'", "byte size overflows"});
  expect_error(one_tensor({uint64_t(1) << 61, 2}, 1), {"'t'", "byte size overflows"});
  // Element count fits, byte size fits, but far larger than the file.
  expect_error(one_tensor({uint64_t(1) << 40}, 8), {"'t'", "extends past"});
  // ne above INT64_MAX.
  expect_error(one_tensor({uint64_t(1) << 63}, 0), {"'t'", "ne[0]", "INT64_MAX"});
  expect_error(one_tensor({4, kU64Max}, 0), {"'t'", "ne[1]"});
  // Zero-sized dimensions are rejected (documented).
  expect_error(one_tensor({0}, 0), {"'t'", "ne[0] is 0"});
  expect_error(one_tensor({4, 0}, 0), {"'t'", "ne[1] is 0"});
  // ne[0] must be a multiple of the block size.
  expect_error(one_tensor({33}, 8), {"'t'", "not a multiple", "Q8_0", "32"});
  expect_error(one_tensor({128}, 12), {"'t'", "Q4_K", "256"});
  // Sanity: a valid header of the same shape parses when the data exists.
  Builder ok;
  ok.tensor("t", {256, 2}, 12);
  EXPECT_EQ(GgufFile::from_bytes(ok.build()).require_tensor("t").nbytes, 2u * 144);
}

TEST(Gguf, DuplicateKeysAndTensors) {
  Builder dk;
  dk.kv_u32("dup", 1).kv_str("other", "x").kv_u32("dup", 2);
  expect_error(dk.build(), {"'dup'", "duplicate key", "byte offset"});

  Builder dt;
  dt.tensor("w", {4}, 0).tensor("v", {4}, 0).tensor("w", {8}, 0);
  expect_error(dt.build(), {"'w'", "duplicate tensor name", "byte offset"});
}

TEST(Gguf, EmptyNamesRejected) {
  Builder ek;
  ek.kv_u32("", 1);
  expect_error(ek.build(), {"empty key"});
  Builder et;
  et.tensor("", {4}, 0);
  expect_error(et.build(), {"empty tensor name"});
}

TEST(Gguf, NestingDepthLimit) {
  auto nested = [](int depth) {
    W body;
    body.str("deep").type(GgufType::ARRAY);
    for (int d = 1; d < depth; ++d) body.type(GgufType::ARRAY).u64(1);
    body.type(GgufType::INT32).u64(1).i32(7);
    return raw_file(0, 1, body);
  };
  const GgufFile ok = GgufFile::from_bytes(nested(GgufFile::kMaxArrayDepth));
  const GgufValue* v = ok.find("deep");
  for (int d = 1; d < GgufFile::kMaxArrayDepth; ++d) {
    ASSERT_EQ(v->aa.size(), 1u);
    v = &v->aa[0];
  }
  EXPECT_EQ(v->ai, (std::vector<int64_t>{7}));
  expect_error(nested(GgufFile::kMaxArrayDepth + 1), {"'deep'", "nested deeper"});

  // Deep nesting attempted with a chain of huge file-controlled depth: fails
  // at the limit, no stack exhaustion.
  W body;
  body.str("bomb").type(GgufType::ARRAY);
  for (int d = 0; d < 100000; ++d) body.type(GgufType::ARRAY).u64(1);
  expect_error(raw_file(0, 1, body), {"'bomb'", "nested deeper"});
}

TEST(Gguf, NestedValueBudget) {
  // Many empty nested arrays: allowed up to the budget, refused past it.
  auto wide = [](uint64_t n) {
    W body;
    body.str("wide").type(GgufType::ARRAY).type(GgufType::ARRAY).u64(n);
    for (uint64_t k = 0; k < n; ++k) body.type(GgufType::UINT8).u64(0);
    return raw_file(0, 1, body);
  };
  EXPECT_EQ(GgufFile::from_bytes(wide(1000)).find("wide")->aa.size(), 1000u);
  expect_error(wide(GgufFile::kMaxNestedValues + 1), {"'wide'", "nested arrays"});
}

TEST(Gguf, MetadataMemoryBudget) {
  // A byte array widens to 8 bytes per element in memory: 20 MiB of them (160 MiB parsed) pass
  // the budget of a 20 MiB file (4x + 64 MiB = 144 MiB), refused before anything is allocated;
  // 10 MiB of them (80 of 104 MiB) parse. Long strings count their bytes too.
  auto bytes_array = [](uint64_t n) {
    W body;
    body.str("blob").type(GgufType::ARRAY).type(GgufType::UINT8).u64(n);
    body.b.resize(body.b.size() + n, 1);
    return raw_file(0, 1, body);
  };
  const uint64_t mib = uint64_t(1) << 20;
  EXPECT_EQ(GgufFile::from_bytes(bytes_array(10 * mib)).find("blob")->ai.size(), 10 * mib);
  expect_error(bytes_array(20 * mib), {"'blob'", "past 144 MiB of memory"});
  W strings;  // 2^20 strings of 40 bytes: 48 bytes each in the file, 32 + 41 in memory (73 MiB < 256)
  strings.str("tokens").type(GgufType::ARRAY).type(GgufType::STRING).u64(mib);
  for (uint64_t k = 0; k < mib; ++k) strings.str(std::string(40, char('a' + k % 26)));
  EXPECT_EQ(GgufFile::from_bytes(raw_file(0, 1, strings)).find("tokens")->as.size(), mib);
  // the real model's metadata (its 49152 tokens and merges) is far below its file's budget: RealModelFile
}

TEST(Gguf, ErrorMessagesEscapeHostileNames) {
  W body;
  body.str(std::string("bad\x01\n\xff", 6)).type(static_cast<GgufType>(99));
  const std::string msg = expect_error(raw_file(0, 1, body), {"bad\\x01\\x0a\\xff"});
  EXPECT_EQ(msg.find('\n'), std::string::npos);
}

// Random corruption of a valid image: the parser must either succeed or throw
// GgufError, and never touch memory outside the image (checked under ASan).
TEST(Gguf, RandomCorruptionNeverCrashes) {
  const Bytes good = rich_builder().build();
  std::mt19937_64 rng(12345);
  int parsed = 0, rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    Bytes b = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % b.size();
      switch (rng() % 4) {
        case 0: b[at] = static_cast<uint8_t>(rng()); break;
        case 1: b[at] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 2: b[at] = 0xFF; break;
        case 3: b.resize(at); break;
      }
      if (b.empty()) break;
    }
    try {
      const GgufFile f = GgufFile::from_bytes(b);
      ++parsed;
      // Whatever parsed must be self-consistent.
      for (const GgufTensorInfo& t : f.tensors()) {
        ASSERT_LE(f.data_offset() + t.offset + t.nbytes, f.file_size());
        ASSERT_EQ(t.offset % f.alignment(), 0u);
        volatile uint8_t sink = 0;
        for (uint64_t k = 0; k < t.nbytes; k += 7) sink = sink + t.data[k];
        if (t.nbytes > 0) sink = sink + t.data[t.nbytes - 1];
      }
    } catch (const GgufError&) {
      ++rejected;
    }
  }
  EXPECT_GT(parsed, 0);
  EXPECT_GT(rejected, 0);
}

// ---------------------------------------------------------------------------
// Files on disk

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "gguf_test_" + std::to_string(::getpid()) + "_" + name;
}

void write_file(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

TEST(Gguf, OpenMapsFile) {
  const std::string path = temp_path("ok.gguf");
  const Bytes bytes = rich_builder().build();
  write_file(path, bytes);
  {
    GgufFile f = GgufFile::open(path);
    EXPECT_EQ(f.file_size(), bytes.size());
    EXPECT_EQ(f.get_string("general.architecture"), "llama");
    const GgufTensorInfo& t = f.require_tensor("tok.weight");
    EXPECT_EQ(std::memcmp(t.data, bytes.data() + f.data_offset() + t.offset, t.nbytes), 0);
    GgufFile moved = std::move(f);  // mapping survives the move
    EXPECT_EQ(moved.require_tensor("tok.weight").data, t.data);
    EXPECT_EQ(moved.require_tensor("tok.weight").data[5], bytes[moved.data_offset() + t.offset + 5]);
  }
  std::remove(path.c_str());
}

TEST(Gguf, OpenErrorsNameThePath) {
  const std::string missing = temp_path("does_not_exist.gguf");
  try {
    GgufFile::open(missing);
    ADD_FAILURE() << "opened a missing file";
  } catch (const GgufError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  EXPECT_THROW(GgufFile::open(::testing::TempDir()), GgufError);  // a directory

  const std::string empty = temp_path("empty.gguf");
  write_file(empty, {});
  EXPECT_THROW(GgufFile::open(empty), GgufError);
  std::remove(empty.c_str());

  const std::string trunc = temp_path("trunc.gguf");
  Bytes bytes = rich_builder().build();
  bytes.resize(bytes.size() - 1);
  write_file(trunc, bytes);
  try {
    GgufFile::open(trunc);
    ADD_FAILURE() << "opened a truncated file";
  } catch (const GgufError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(trunc), std::string::npos) << msg;
    EXPECT_NE(msg.find("w.bf16"), std::string::npos) << msg;
  }
  std::remove(trunc.c_str());
}

// LlamaConfig::from_gguf: a small llama header loads; what the loader does not implement (RoPE
// scaling by type or factor, RoPE frequency factors, mixtures of experts) is refused with the
// key or tensor named, rather than run with wrong results; an unscaled type ('none', factor 1)
// still loads.
TEST(Gguf, LlamaConfigRefusesWhatItDoesNotImplement) {
  auto base = [](const char* arch = "llama") {
    Builder b;
    b.kv_str("general.architecture", arch);
    b.kv_u32("llama.block_count", 2).kv_u32("llama.embedding_length", 64).kv_u32("llama.feed_forward_length", 128);
    b.kv_u32("llama.attention.head_count", 4).kv_u32("llama.attention.head_count_kv", 2);
    b.tensor("token_embd.weight", {64, 10}, 0);
    b.tensor("blk.1.attn_norm.weight", {64}, 0);  // (the last layer's first tensor: block_count is checked by it)
    return b;
  };
  auto config = [](Builder b) { return ks::model::LlamaConfig::from_gguf(GgufFile::from_bytes(b.build())); };
  const ks::model::LlamaConfig c = config(base());
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.vocab_size, 10);
  EXPECT_EQ(c.rotary_dim, 16);
  auto refused = [&](Builder b, const std::string& named) {
    try {
      config(std::move(b));
      ADD_FAILURE() << "loaded; expected a refusal naming " << named;
    } catch (const GgufError& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  };
  refused(base().kv_str("llama.rope.scaling.type", "yarn"), "llama.rope.scaling.type");
  refused(base().kv_str("llama.rope.scaling.type", "linear"), "'linear'");
  refused(base().kv("llama.rope.scaling.factor", [](W& w) { w.type(GgufType::FLOAT32).f32(8.f); }),
          "llama.rope.scaling.factor");
  refused(base().tensor("rope_freqs.weight", {8}, 0), "rope_freqs.weight");
  refused(base().kv_u32("llama.expert_count", 8), "llama.expert_count");
  refused(base("qwen2"), "only 'llama' is supported");
  EXPECT_NO_THROW(config(base().kv_str("llama.rope.scaling.type", "none")));
  EXPECT_NO_THROW(config(base().kv("llama.rope.scaling.factor", [](W& w) { w.type(GgufType::FLOAT32).f32(1.f); })));
  EXPECT_NO_THROW(config(base().kv_u32("llama.expert_count", 0)));
}

// Counts the model is sized by are bounded before anything is allocated (the fuzzing run of
// 2026-12-05: llama.block_count 10^7 in a 5 MB file took 16 GB for the layer table before a
// missing tensor was noticed; llama.context_length 0 built an empty cache, 2^63 a negative one).
TEST(Gguf, LlamaConfigBoundsItsCounts) {
  auto with = [](uint64_t blocks, std::optional<uint64_t> ctx) {
    Builder b;
    b.kv_str("general.architecture", "llama");
    b.kv_u64("llama.block_count", blocks).kv_u32("llama.embedding_length", 64).kv_u32("llama.feed_forward_length", 128);
    b.kv_u32("llama.attention.head_count", 4);
    if (ctx) b.kv_u64("llama.context_length", *ctx);
    b.tensor("token_embd.weight", {64, 10}, 0).tensor("blk.0.attn_norm.weight", {64}, 0).tensor("blk.1.attn_norm.weight", {64}, 0);
    return ks::model::LlamaConfig::from_gguf(GgufFile::from_bytes(b.build()));
  };
  auto refused = [&](uint64_t blocks, std::optional<uint64_t> ctx, const std::string& named) {
    try {
      with(blocks, ctx);
      ADD_FAILURE() << "loaded; expected a refusal naming " << named;
    } catch (const GgufError& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  };
  EXPECT_EQ(with(2, std::nullopt).context_length, 2048);  // (the key's default)
  EXPECT_EQ(with(1, uint64_t(1) << 30).context_length, int64_t(1) << 30);
  refused(0, std::nullopt, "llama.block_count is 0");
  refused(uint64_t(1) << 40, std::nullopt, "llama.block_count is 1099511627776; expected 1 to 65536");
  refused(kU64Max, std::nullopt, "llama.block_count");
  refused(3, std::nullopt, "no tensor 'blk.2.attn_norm.weight'");  // more layers than the file holds
  refused(2, 0, "llama.context_length is 0");
  refused(2, (uint64_t(1) << 30) + 1, "llama.context_length");
  refused(2, uint64_t(1) << 63, "llama.context_length is 9223372036854775808");
}

// tokenizer_from_gguf refuses ids and types past their ranges naming the key (they were cut to 32
// bits: a bos id of 2^32 + 1 read as 1), and a vocabulary whose size differs from the embedding's
// rows (it failed only when a prompt or the model reached a missing id).
TEST(Gguf, TokenizerFromGgufChecksItsIds) {
  auto make = [](std::vector<std::string> toks, int64_t rows, std::function<void(Builder&)> extra) {
    Builder b;
    b.kv_str("tokenizer.ggml.model", "gpt2");
    b.kv("tokenizer.ggml.tokens", [toks](W& w) {
      w.type(GgufType::ARRAY).type(GgufType::STRING).u64(toks.size());
      for (const auto& t : toks) w.str(t);
    });
    b.kv("tokenizer.ggml.merges", [](W& w) { w.type(GgufType::ARRAY).type(GgufType::STRING).u64(1).str("a b"); });
    extra(b);
    if (rows > 0) b.tensor("token_embd.weight", {32, uint64_t(rows)}, 0);
    return ks::model::tokenizer_from_gguf(GgufFile::from_bytes(b.build()));
  };
  const std::vector<std::string> toks{"a", "b", "ab", "c"};
  EXPECT_NO_THROW(make(toks, 4, [](Builder& b) { b.kv_u32("tokenizer.ggml.eos_token_id", 3); }));
  EXPECT_NO_THROW(make(toks, 0, [](Builder&) {}));  // (no embedding in the file: nothing to match)
  auto refused = [&](int64_t rows, std::function<void(Builder&)> extra, const std::string& named) {
    try {
      make(toks, rows, std::move(extra));
      ADD_FAILURE() << "loaded; expected a refusal naming " << named;
    } catch (const GgufError& e) {
      EXPECT_NE(std::string(e.what()).find(named), std::string::npos) << e.what();
    }
  };
  refused(4, [](Builder& b) { b.kv_u64("tokenizer.ggml.bos_token_id", (uint64_t(1) << 32) + 1); },
          "tokenizer.ggml.bos_token_id is 4294967297; the vocabulary has 4 tokens");
  refused(4, [](Builder& b) { b.kv_u32("tokenizer.ggml.eos_token_id", 4); }, "tokenizer.ggml.eos_token_id is 4");
  refused(4, [](Builder& b) {
    b.kv("tokenizer.ggml.token_type", [](W& w) {
      w.type(GgufType::ARRAY).type(GgufType::INT32).u64(4).i32(1).i32(1).i32(7).i32(1);
    });
  }, "tokenizer.ggml.token_type[2] is 7; expected 0 to 6");
  refused(5, [](Builder&) {}, "tokenizer.ggml.tokens has 4 entries but token_embd.weight has 5 rows");
  refused(3, [](Builder&) {}, "tokenizer.ggml.tokens has 4 entries but token_embd.weight has 3 rows");
}

// The real model, when available (KS_MODEL_PATH).
TEST(Gguf, RealModelFile) {
  const char* path = std::getenv("KS_MODEL_PATH");
  if (path == nullptr || *path == '\0' || ::access(path, R_OK) != 0) {
    GTEST_SKIP() << "KS_MODEL_PATH not set or not readable";
  }
  const GgufFile f = GgufFile::open(path);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.tensors().size(), 272u);
  EXPECT_EQ(f.get_uint("llama.embedding_length"), 576u);
  const GgufTensorInfo& emb = f.require_tensor("token_embd.weight");
  EXPECT_EQ(emb.ggml_type, 8u);
  EXPECT_STREQ(ggml_type_name(emb.ggml_type), "Q8_0");
  EXPECT_EQ(emb.ne, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(emb.nbytes, uint64_t(576) / 32 * 34 * 49152);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_GT(f.get_float("llama.rope.freq_base"), 0.0);
  uint64_t total = 0;
  for (const GgufTensorInfo& t : f.tensors()) {
    EXPECT_EQ(t.offset % f.alignment(), 0u) << t.name;
    EXPECT_LE(f.data_offset() + t.offset + t.nbytes, f.file_size()) << t.name;
    total += t.nbytes;
  }
  EXPECT_LE(total, f.file_size());
}

}  // namespace
