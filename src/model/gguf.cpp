// Bounds-checked GGUF reader. See gguf.hpp for the format and the rules.
//
// Parsing strategy: a single forward cursor over the file image. Every read
// goes through Parser::need(), which compares against the bytes that remain;
// every count read from the file is compared against the remaining bytes
// divided by the smallest possible encoding of one element *before* any
// container is reserved, so a hostile count fails fast instead of allocating.
#include "model/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

namespace ks::model {

namespace {

constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;
constexpr uint32_t kMaxTypeId = static_cast<uint32_t>(GgufType::FLOAT64);
constexpr uint64_t kInt64Max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// Smallest encodings, used to bound counts before allocating.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;              // empty key (rejected later), type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // name len, n_dims, one ne, type, offset

// Overflow-checked arithmetic on uint64; false on overflow.
bool mul_ok(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_mul_overflow(a, b, &out); }
bool add_ok(uint64_t a, uint64_t b, uint64_t& out) { return !__builtin_add_overflow(a, b, &out); }


// Encoded size of one array element of type t: exact for fixed-size scalars,
// a lower bound for STRING (its length prefix) and ARRAY (type + count).
uint64_t min_elem_bytes(GgufType t) {
  switch (t) {
    case GgufType::UINT8: case GgufType::INT8: case GgufType::BOOL: return 1;
    case GgufType::UINT16: case GgufType::INT16: return 2;
    case GgufType::UINT32: case GgufType::INT32: case GgufType::FLOAT32: return 4;
    case GgufType::UINT64: case GgufType::INT64: case GgufType::FLOAT64: return 8;
    case GgufType::STRING: return 8;
    case GgufType::ARRAY: return 4 + 8;
  }
  return 1;  // unreachable: type ids are validated before use
}

bool is_signed_int(GgufType t) {
  return t == GgufType::INT8 || t == GgufType::INT16 || t == GgufType::INT32 || t == GgufType::INT64;
}

// Non-throwing geometry lookup: {elements per block, bytes per block}.
bool lookup_geometry(uint32_t type, int64_t& block, int64_t& bytes) {
  constexpr int64_t QK = 256;  // super-block size of the k-quants and most i-quants
  switch (type) {
    case 0: block = 1; bytes = 4; return true;     // F32
    case 1: block = 1; bytes = 2; return true;     // F16
    case 2: block = 32; bytes = 18; return true;   // Q4_0: f16 d + 16 nibble bytes
    case 3: block = 32; bytes = 20; return true;   // Q4_1: f16 d, m + 16
    case 6: block = 32; bytes = 22; return true;   // Q5_0: f16 d + 4 high bits + 16
    case 7: block = 32; bytes = 24; return true;   // Q5_1: f16 d, m + 4 + 16
    case 8: block = 32; bytes = 34; return true;   // Q8_0: f16 d + 32
    case 9: block = 32; bytes = 36; return true;   // Q8_1: f16 d, s + 32
    case 10: block = QK; bytes = 84; return true;  // Q2_K
    case 11: block = QK; bytes = 110; return true; // Q3_K
    case 12: block = QK; bytes = 144; return true; // Q4_K
    case 13: block = QK; bytes = 176; return true; // Q5_K
    case 14: block = QK; bytes = 210; return true; // Q6_K
    case 15: block = QK; bytes = 292; return true; // Q8_K: f32 d + 256 + 16 int16 sums
    case 16: block = QK; bytes = 66; return true;  // IQ2_XXS
    case 17: block = QK; bytes = 74; return true;  // IQ2_XS
    case 18: block = QK; bytes = 98; return true;  // IQ3_XXS
    case 19: block = QK; bytes = 50; return true;  // IQ1_S
    case 20: block = 32; bytes = 18; return true;  // IQ4_NL
    case 21: block = QK; bytes = 110; return true; // IQ3_S
    case 22: block = QK; bytes = 82; return true;  // IQ2_S
    case 23: block = QK; bytes = 136; return true; // IQ4_XS
    case 24: block = 1; bytes = 1; return true;    // I8
    case 25: block = 1; bytes = 2; return true;    // I16
    case 26: block = 1; bytes = 4; return true;    // I32
    case 27: block = 1; bytes = 8; return true;    // I64
    case 28: block = 1; bytes = 8; return true;    // F64
    case 29: block = QK; bytes = 56; return true;  // IQ1_M
    case 30: block = 1; bytes = 2; return true;    // BF16
    case 34: block = QK; bytes = 54; return true;  // TQ1_0
    case 35: block = QK; bytes = 66; return true;  // TQ2_0
    case 39: block = 32; bytes = 17; return true;  // MXFP4: e8m0 scale + 16
    default: return false;
  }
}

}  // namespace

// (gguf.hpp)
std::string gguf_quote(const std::string& s) {
  constexpr size_t kMax = 80;
  std::string out = "'";
  for (size_t k = 0; k < s.size() && k < kMax; ++k) {
    const unsigned char c = static_cast<unsigned char>(s[k]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (s.size() > kMax) out += "...";
  out += "'";
  return out;
}

// ---------------------------------------------------------------------------
// Free functions

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::UINT8: return "UINT8";
    case GgufType::INT8: return "INT8";
    case GgufType::UINT16: return "UINT16";
    case GgufType::INT16: return "INT16";
    case GgufType::UINT32: return "UINT32";
    case GgufType::INT32: return "INT32";
    case GgufType::FLOAT32: return "FLOAT32";
    case GgufType::BOOL: return "BOOL";
    case GgufType::STRING: return "STRING";
    case GgufType::ARRAY: return "ARRAY";
    case GgufType::UINT64: return "UINT64";
    case GgufType::INT64: return "INT64";
    case GgufType::FLOAT64: return "FLOAT64";
  }
  return "INVALID";
}

bool gguf_type_is_integer(GgufType t) {
  switch (t) {
    case GgufType::UINT8: case GgufType::INT8: case GgufType::UINT16: case GgufType::INT16:
    case GgufType::UINT32: case GgufType::INT32: case GgufType::UINT64: case GgufType::INT64:
      return true;
    default:
      return false;
  }
}

std::pair<int64_t, int64_t> ggml_block_geometry(uint32_t ggml_type) {
  int64_t block = 0, bytes = 0;
  if (!lookup_geometry(ggml_type, block, bytes)) {
    throw GgufError("gguf: unknown or unsupported ggml type id " + std::to_string(ggml_type));
  }
  return {block, bytes};
}

const char* ggml_type_name(uint32_t ggml_type) {
  switch (ggml_type) {
    case 0: return "F32";
    case 1: return "F16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 8: return "Q8_0";
    case 9: return "Q8_1";
    case 10: return "Q2_K";
    case 11: return "Q3_K";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    case 15: return "Q8_K";
    case 16: return "IQ2_XXS";
    case 17: return "IQ2_XS";
    case 18: return "IQ3_XXS";
    case 19: return "IQ1_S";
    case 20: return "IQ4_NL";
    case 21: return "IQ3_S";
    case 22: return "IQ2_S";
    case 23: return "IQ4_XS";
    case 24: return "I8";
    case 25: return "I16";
    case 26: return "I32";
    case 27: return "I64";
    case 28: return "F64";
    case 29: return "IQ1_M";
    case 30: return "BF16";
    case 34: return "TQ1_0";
    case 35: return "TQ2_0";
    case 39: return "MXFP4";
    default: return "unknown";
  }
}

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // cannot overflow: checked when parsed
  return n;
}

// ---------------------------------------------------------------------------
// Storage: the file bytes, either an owned vector or a read-only mapping.
// Held through unique_ptr so its address (and so every tensor data pointer)
// survives moves of the GgufFile.

struct GgufFile::Storage {
  const uint8_t* data = nullptr;
  size_t size = 0;
  std::vector<uint8_t> owned;
  void* map = nullptr;
  size_t map_len = 0;

  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (map != nullptr) ::munmap(map, map_len);
  }
};

// ---------------------------------------------------------------------------
// Parser

class GgufFile::Parser {
 public:
  Parser(const uint8_t* data, size_t size) : p_(data), n_(size) {}

  void run(GgufFile& f);

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  std::string ctx_ = "header";   // what is being parsed, for messages
  uint64_t nested_values_ = 0;   // arrays-inside-arrays seen so far
  uint64_t metadata_bytes_ = 0;  // the memory the parsed metadata takes so far (estimated)

  // Counts `count` parsed elements of `each` bytes of memory against metadata_budget, before
  // they are allocated.
  void charge(size_t at, uint64_t count, uint64_t each, const char* what) {
    const uint64_t budget = GgufFile::metadata_budget(n_);
    if (count > (budget - metadata_bytes_) / each)
      fail_at(at, std::to_string(count) + " " + what + " would take the parsed metadata past " +
                      std::to_string(budget >> 20) + " MiB of memory (4x the file's size plus 64 MiB)");
    metadata_bytes_ += count * each;
  }

  [[noreturn]] void fail_at(size_t at, const std::string& msg) const {
    throw GgufError("gguf: " + ctx_ + ": " + msg + " (at byte offset " + std::to_string(at) + ")");
  }

  size_t remaining() const { return n_ - pos_; }

  void need(size_t k, const char* what) const {
    if (k > remaining()) {
      fail_at(pos_, std::string("truncated: ") + what + " needs " + std::to_string(k) + " bytes, only " +
                        std::to_string(remaining()) + " left");
    }
  }

  // Reads a k-byte little-endian unsigned integer (k <= 8).
  uint64_t read_le(size_t k, const char* what) {
    need(k, what);
    uint64_t v = 0;
    for (size_t b = 0; b < k; ++b) v |= static_cast<uint64_t>(p_[pos_ + b]) << (8 * b);
    pos_ += k;
    return v;
  }
  uint32_t u32(const char* what) { return static_cast<uint32_t>(read_le(4, what)); }
  uint64_t u64(const char* what) { return read_le(8, what); }

  std::string str(const char* what) {
    const size_t at = pos_;
    const uint64_t len = u64(what);
    if (len > remaining()) {
      fail_at(at, std::string(what) + " length " + std::to_string(len) + " exceeds the " +
                      std::to_string(remaining()) + " bytes left in the file");
    }
    if (len > 15) charge(at, len + 1, 1, "string bytes");  // (a short string lives inside std::string)
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return s;
  }

  GgufType type_id(const char* what) {
    const size_t at = pos_;
    const uint32_t t = u32(what);
    if (t > kMaxTypeId) fail_at(at, std::string("invalid ") + what + " " + std::to_string(t));
    return static_cast<GgufType>(t);
  }

  // Decodes one non-STRING, non-ARRAY value of type t into v (scalar fields).
  void scalar(GgufType t, GgufValue& v) {
    const size_t at = pos_;
    switch (t) {
      case GgufType::UINT8: case GgufType::UINT16: case GgufType::UINT32: case GgufType::UINT64: {
        v.u = read_le(min_elem_bytes(t), "unsigned integer value");
        v.i = v.u <= kInt64Max ? static_cast<int64_t>(v.u) : 0;
        return;
      }
      case GgufType::INT8: v.i = static_cast<int8_t>(read_le(1, "int8 value")); break;
      case GgufType::INT16: v.i = static_cast<int16_t>(read_le(2, "int16 value")); break;
      case GgufType::INT32: v.i = static_cast<int32_t>(read_le(4, "int32 value")); break;
      case GgufType::INT64: v.i = static_cast<int64_t>(read_le(8, "int64 value")); break;
      case GgufType::FLOAT32: v.f = std::bit_cast<float>(u32("float32 value")); return;
      case GgufType::FLOAT64: v.f = std::bit_cast<double>(u64("float64 value")); return;
      case GgufType::BOOL: {
        const uint64_t byte = read_le(1, "bool value");
        if (byte > 1) fail_at(at, "bool value byte is " + std::to_string(byte) + ", expected 0 or 1");
        v.b = byte != 0;
        return;
      }
      case GgufType::STRING: case GgufType::ARRAY:
        fail_at(at, "internal error: scalar() called for a non-scalar type");
    }
    v.u = v.i >= 0 ? static_cast<uint64_t>(v.i) : 0;  // signed cases
  }

  GgufValue value(GgufType t) {
    if (t == GgufType::ARRAY) return array(1);
    GgufValue v;
    v.type = t;
    if (t == GgufType::STRING) {
      v.s = str("string value");
    } else {
      scalar(t, v);
    }
    return v;
  }

  // Reads an array body (element type, count, elements). depth is 1 for an
  // array that is a key's value, 2 for an array inside it, and so on.
  GgufValue array(int depth) {
    const size_t at = pos_;
    if (depth > kMaxArrayDepth) {
      fail_at(at, "arrays nested deeper than " + std::to_string(kMaxArrayDepth) + " levels");
    }
    GgufValue v;
    v.type = GgufType::ARRAY;
    v.elem_type = type_id("array element type");
    const size_t count_at = pos_;
    const uint64_t count = u64("array count");
    const uint64_t min = min_elem_bytes(v.elem_type);
    if (count > remaining() / min) {
      fail_at(count_at, "array count " + std::to_string(count) + " of " + gguf_type_name(v.elem_type) +
                            " cannot fit in the " + std::to_string(remaining()) + " bytes left in the file");
    }
    v.array_len = count;
    const size_t n = static_cast<size_t>(count);
    const uint64_t each = v.elem_type == GgufType::ARRAY    ? sizeof(GgufValue)
                          : v.elem_type == GgufType::STRING ? sizeof(std::string)
                                                            : 8;  // int64_t / double
    charge(count_at, count, each, "array elements");
    switch (v.elem_type) {
      case GgufType::ARRAY:
        if (count > kMaxNestedValues - nested_values_) {
          fail_at(count_at, "more than " + std::to_string(kMaxNestedValues) + " nested arrays in the file");
        }
        nested_values_ += count;
        v.aa.reserve(n);
        for (size_t k = 0; k < n; ++k) v.aa.push_back(array(depth + 1));
        break;
      case GgufType::STRING:
        v.as.reserve(n);
        for (size_t k = 0; k < n; ++k) v.as.push_back(str("string array element"));
        break;
      case GgufType::FLOAT32: case GgufType::FLOAT64: {
        v.af.reserve(n);
        GgufValue e;
        for (size_t k = 0; k < n; ++k) {
          scalar(v.elem_type, e);
          v.af.push_back(e.f);
        }
        break;
      }
      case GgufType::BOOL: {
        v.ai.reserve(n);
        GgufValue e;
        for (size_t k = 0; k < n; ++k) {
          scalar(v.elem_type, e);
          v.ai.push_back(e.b ? 1 : 0);
        }
        break;
      }
      default: {  // integers; UINT64 keeps its bit pattern
        v.ai.reserve(n);
        GgufValue e;
        for (size_t k = 0; k < n; ++k) {
          scalar(v.elem_type, e);
          v.ai.push_back(is_signed_int(v.elem_type) ? e.i : static_cast<int64_t>(e.u));
        }
        break;
      }
    }
    return v;
  }

  void header(GgufFile& f, uint64_t& tensor_count, uint64_t& kv_count);
  void metadata(GgufFile& f, uint64_t kv_count, size_t& alignment_at);
  void resolve_alignment(GgufFile& f, size_t alignment_at);
  void tensor_infos(GgufFile& f, uint64_t tensor_count, std::vector<size_t>& offset_at);
  void place_tensors(GgufFile& f, const std::vector<size_t>& offset_at);
};

void GgufFile::Parser::header(GgufFile& f, uint64_t& tensor_count, uint64_t& kv_count) {
  ctx_ = "header";
  need(4, "magic");
  if (std::memcmp(p_, "GGUF", 4) != 0) {
    static const char* hex = "0123456789abcdef";
    std::string got;
    for (int b = 0; b < 4; ++b) {
      got += hex[p_[b] >> 4];
      got += hex[p_[b] & 15];
    }
    fail_at(0, "bad magic: expected \"GGUF\" (47475546), got " + got);
  }
  pos_ = 4;
  const uint32_t version = u32("version");
  if (version != 2 && version != 3) {
    if (version == 0x02000000u || version == 0x03000000u) {
      fail_at(4, "big-endian GGUF files are not supported");
    }
    fail_at(4, "unsupported GGUF version " + std::to_string(version) + " (supported: 2, 3)");
  }
  f.version_ = version;
  const size_t tc_at = pos_;
  tensor_count = u64("tensor count");
  const size_t kc_at = pos_;
  kv_count = u64("metadata kv count");
  if (tensor_count > remaining() / kMinTensorInfoBytes) {
    fail_at(tc_at, "tensor count " + std::to_string(tensor_count) + " cannot fit in the " +
                       std::to_string(remaining()) + " bytes left in the file");
  }
  if (kv_count > remaining() / kMinKvBytes) {
    fail_at(kc_at, "metadata kv count " + std::to_string(kv_count) + " cannot fit in the " +
                       std::to_string(remaining()) + " bytes left in the file");
  }
  // Both products are <= remaining(), so the sum cannot overflow.
  if (tensor_count * kMinTensorInfoBytes + kv_count * kMinKvBytes > remaining()) {
    fail_at(tc_at, "tensor count " + std::to_string(tensor_count) + " and kv count " + std::to_string(kv_count) +
                       " together cannot fit in the " + std::to_string(remaining()) + " bytes left in the file");
  }
}

void GgufFile::Parser::metadata(GgufFile& f, uint64_t kv_count, size_t& alignment_at) {
  for (uint64_t k = 0; k < kv_count; ++k) {
    ctx_ = "metadata kv #" + std::to_string(k);
    const size_t key_at = pos_;
    std::string key = str("key");
    if (key.empty()) fail_at(key_at, "empty key");
    ctx_ = "key " + gguf_quote(key);
    if (f.metadata_.count(key) != 0) fail_at(key_at, "duplicate key");
    const GgufType t = type_id("value type");
    if (key == "general.alignment") alignment_at = pos_;
    GgufValue v = value(t);
    f.metadata_.emplace(std::move(key), std::move(v));
  }
}

void GgufFile::Parser::resolve_alignment(GgufFile& f, size_t alignment_at) {
  f.alignment_ = kDefaultAlignment;
  const GgufValue* a = f.find("general.alignment");
  if (a == nullptr) return;
  ctx_ = "key 'general.alignment'";
  if (!gguf_type_is_integer(a->type)) {
    fail_at(alignment_at, std::string("must be an integer, found ") + gguf_type_name(a->type));
  }
  if (is_signed_int(a->type) && a->i < 0) {
    fail_at(alignment_at, "must be positive, found " + std::to_string(a->i));
  }
  const uint64_t align = a->u;
  if (align == 0 || (align & (align - 1)) != 0) {
    fail_at(alignment_at, "must be a nonzero power of two, found " + std::to_string(align));
  }
  f.alignment_ = align;
}

void GgufFile::Parser::tensor_infos(GgufFile& f, uint64_t tensor_count, std::vector<size_t>& offset_at) {
  f.tensors_.reserve(static_cast<size_t>(tensor_count));  // bounded by the file size in header()
  offset_at.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t k = 0; k < tensor_count; ++k) {
    ctx_ = "tensor info #" + std::to_string(k);
    GgufTensorInfo t;
    const size_t name_at = pos_;
    t.name = str("tensor name");
    if (t.name.empty()) fail_at(name_at, "empty tensor name");
    ctx_ = "tensor " + gguf_quote(t.name);
    if (f.tensor_index_.count(t.name) != 0) fail_at(name_at, "duplicate tensor name");

    const size_t ndims_at = pos_;
    const uint32_t n_dims = u32("n_dims");
    if (n_dims == 0 || n_dims > kMaxDims) {
      fail_at(ndims_at, "n_dims " + std::to_string(n_dims) + " out of range [1, " + std::to_string(kMaxDims) + "]");
    }
    std::vector<size_t> ne_at(n_dims);
    t.ne.reserve(n_dims);
    uint64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      ne_at[d] = pos_;
      const uint64_t ne = u64("ne");
      const std::string which = "ne[" + std::to_string(d) + "]";
      if (ne == 0) fail_at(ne_at[d], which + " is 0 (zero-sized dimensions are not supported)");
      if (ne > kInt64Max) fail_at(ne_at[d], which + " = " + std::to_string(ne) + " exceeds INT64_MAX");
      if (!mul_ok(elements, ne, elements) || elements > kInt64Max) {
        fail_at(ne_at[d], "element count overflows int64 at " + which);
      }
      t.ne.push_back(static_cast<int64_t>(ne));
    }

    const size_t type_at = pos_;
    t.ggml_type = u32("ggml type");
    int64_t block = 0, block_bytes = 0;
    if (!lookup_geometry(t.ggml_type, block, block_bytes)) {
      fail_at(type_at, "unknown or unsupported ggml type id " + std::to_string(t.ggml_type));
    }
    if (t.ne[0] % block != 0) {
      fail_at(ne_at[0], "ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the " +
                            ggml_type_name(t.ggml_type) + " block size " + std::to_string(block));
    }
    // nbytes = (ne[0] / block) * block_bytes * ne[1] * ... * ne[n-1]
    uint64_t nbytes = 0;
    bool ok = mul_ok(static_cast<uint64_t>(t.ne[0] / block), static_cast<uint64_t>(block_bytes), nbytes);
    for (uint32_t d = 1; ok && d < n_dims; ++d) ok = mul_ok(nbytes, static_cast<uint64_t>(t.ne[d]), nbytes);
    if (!ok || nbytes > kInt64Max) fail_at(ne_at[0], "byte size overflows int64");
    t.nbytes = nbytes;

    offset_at.push_back(pos_);
    t.offset = u64("tensor data offset");

    f.tensor_index_.emplace(t.name, f.tensors_.size());
    f.tensors_.push_back(std::move(t));
  }
}

void GgufFile::Parser::place_tensors(GgufFile& f, const std::vector<size_t>& offset_at) {
  ctx_ = "data section";
  const uint64_t header_end = pos_;
  const uint64_t pad = (f.alignment_ - header_end % f.alignment_) % f.alignment_;
  uint64_t data_offset = 0;
  if (!add_ok(header_end, pad, data_offset)) {
    fail_at(pos_, "data section offset overflows with alignment " + std::to_string(f.alignment_));
  }
  f.data_offset_ = data_offset;
  if (f.tensors_.empty()) return;  // nothing to place; the padding may be absent
  if (data_offset > n_) {
    fail_at(pos_, "data section would start at byte " + std::to_string(data_offset) +
                      " (alignment " + std::to_string(f.alignment_) + "), past the end of the " +
                      std::to_string(n_) + "-byte file");
  }
  const uint64_t data_size = n_ - data_offset;
  for (size_t k = 0; k < f.tensors_.size(); ++k) {
    GgufTensorInfo& t = f.tensors_[k];
    ctx_ = "tensor " + gguf_quote(t.name);
    if (t.offset % f.alignment_ != 0) {
      fail_at(offset_at[k], "data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                                std::to_string(f.alignment_));
    }
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      fail_at(offset_at[k], "data [offset " + std::to_string(t.offset) + ", +" + std::to_string(t.nbytes) +
                                " bytes) extends past the " + std::to_string(data_size) +
                                "-byte data section that starts at byte " + std::to_string(data_offset));
    }
    t.data = p_ + data_offset + t.offset;
  }
}

void GgufFile::Parser::run(GgufFile& f) {
  uint64_t tensor_count = 0, kv_count = 0;
  header(f, tensor_count, kv_count);
  size_t alignment_at = 0;
  metadata(f, kv_count, alignment_at);
  resolve_alignment(f, alignment_at);
  std::vector<size_t> offset_at;
  tensor_infos(f, tensor_count, offset_at);
  place_tensors(f, offset_at);
}

// ---------------------------------------------------------------------------
// GgufFile

GgufFile::GgufFile() = default;
GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

GgufFile GgufFile::parse(std::unique_ptr<Storage> storage) {
  GgufFile f;
  Parser parser(storage->data, storage->size);
  parser.run(f);
  f.storage_ = std::move(storage);  // tensor data pointers already point into it
  return f;
}

GgufFile GgufFile::from_bytes(std::vector<uint8_t> bytes) {
  auto storage = std::make_unique<Storage>();
  storage->owned = std::move(bytes);
  storage->data = storage->owned.data();
  storage->size = storage->owned.size();
  return parse(std::move(storage));
}

GgufFile GgufFile::open(const std::string& path) {
  auto sys_error = [&](const char* what) {
    const int err = errno;
    return GgufError(path + ": " + what + ": " + std::strerror(err));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw sys_error("cannot open");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    GgufError e = sys_error("cannot stat");
    ::close(fd);
    throw e;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw GgufError(path + ": not a regular file");
  }
  if (st.st_size <= 0) {
    ::close(fd);
    throw GgufError(path + ": gguf: header: truncated: file is empty (at byte offset 0)");
  }
  auto storage = std::make_unique<Storage>();
  const size_t len = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, len, PROT_READ, MAP_PRIVATE, fd, 0);
  if (map == MAP_FAILED) {
    GgufError e = sys_error("cannot mmap");
    ::close(fd);
    throw e;
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  storage->map = map;
  storage->map_len = len;
  storage->data = static_cast<const uint8_t*>(map);
  storage->size = len;
  try {
    return parse(std::move(storage));
  } catch (const GgufError& e) {
    throw GgufError(path + ": " + e.what());
  }
}

uint64_t GgufFile::file_size() const { return storage_ ? storage_->size : 0; }

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

std::string describe_type(const GgufValue& v) {
  std::string s = gguf_type_name(v.type);
  if (v.type == GgufType::ARRAY) s += std::string(" of ") + gguf_type_name(v.elem_type);
  return s;
}

[[noreturn]] void wrong_type(const std::string& key, const GgufValue& v, const char* expected) {
  throw GgufError("gguf: key " + gguf_quote(key) + " has type " + describe_type(v) + ", expected " + expected);
}

uint64_t as_uint(const std::string& key, const GgufValue& v) {
  if (!gguf_type_is_integer(v.type)) wrong_type(key, v, "an integer");
  if (is_signed_int(v.type)) {
    if (v.i < 0) {
      throw GgufError("gguf: key " + gguf_quote(key) + " value " + std::to_string(v.i) +
                      " is negative, expected an unsigned integer");
    }
    return static_cast<uint64_t>(v.i);
  }
  return v.u;
}

int64_t as_int(const std::string& key, const GgufValue& v) {
  if (!gguf_type_is_integer(v.type)) wrong_type(key, v, "an integer");
  if (!is_signed_int(v.type)) {
    if (v.u > kInt64Max) {
      throw GgufError("gguf: key " + gguf_quote(key) + " value " + std::to_string(v.u) + " does not fit in int64");
    }
    return static_cast<int64_t>(v.u);
  }
  return v.i;
}

double as_float(const std::string& key, const GgufValue& v) {
  if (v.type == GgufType::FLOAT32 || v.type == GgufType::FLOAT64) return v.f;
  if (gguf_type_is_integer(v.type)) {
    return is_signed_int(v.type) ? static_cast<double>(v.i) : static_cast<double>(v.u);
  }
  wrong_type(key, v, "a float");
}

}  // namespace

const GgufValue& GgufFile::require_value(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) throw GgufError("gguf: key " + gguf_quote(key) + " not found");
  return *v;
}

uint64_t GgufFile::get_uint(const std::string& key) const { return as_uint(key, require_value(key)); }

uint64_t GgufFile::get_uint(const std::string& key, uint64_t dflt) const {
  const GgufValue* v = find(key);
  return v == nullptr ? dflt : as_uint(key, *v);
}

int64_t GgufFile::get_int(const std::string& key) const { return as_int(key, require_value(key)); }

int64_t GgufFile::get_int(const std::string& key, int64_t dflt) const {
  const GgufValue* v = find(key);
  return v == nullptr ? dflt : as_int(key, *v);
}

double GgufFile::get_float(const std::string& key) const { return as_float(key, require_value(key)); }

double GgufFile::get_float(const std::string& key, double dflt) const {
  const GgufValue* v = find(key);
  return v == nullptr ? dflt : as_float(key, *v);
}

std::string GgufFile::get_string(const std::string& key) const {
  const GgufValue& v = require_value(key);
  if (v.type != GgufType::STRING) wrong_type(key, v, "STRING");
  return v.s;
}

bool GgufFile::get_bool(const std::string& key, bool dflt) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return dflt;
  if (v->type != GgufType::BOOL) wrong_type(key, *v, "BOOL");
  return v->b;
}

const std::vector<std::string>& GgufFile::get_string_array(const std::string& key) const {
  const GgufValue& v = require_value(key);
  if (v.type != GgufType::ARRAY || v.elem_type != GgufType::STRING) wrong_type(key, v, "ARRAY of STRING");
  return v.as;
}

const std::vector<int64_t>& GgufFile::get_int_array(const std::string& key) const {
  const GgufValue& v = require_value(key);
  if (v.type != GgufType::ARRAY || !gguf_type_is_integer(v.elem_type)) wrong_type(key, v, "ARRAY of integers");
  return v.ai;
}

const std::vector<double>& GgufFile::get_float_array(const std::string& key) const {
  const GgufValue& v = require_value(key);
  if (v.type != GgufType::ARRAY || (v.elem_type != GgufType::FLOAT32 && v.elem_type != GgufType::FLOAT64)) {
    wrong_type(key, v, "ARRAY of FLOAT32 or FLOAT64");
  }
  return v.af;
}

const GgufTensorInfo* GgufFile::tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensorInfo& GgufFile::require_tensor(const std::string& name) const {
  const GgufTensorInfo* t = tensor(name);
  if (t == nullptr) throw GgufError("gguf: tensor " + gguf_quote(name) + " not found");
  return *t;
}

}  // namespace ks::model
