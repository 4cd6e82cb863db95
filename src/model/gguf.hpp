// Bounds-checked reader for GGUF model files (format versions 2 and 3).
//
// A GGUF file is, in little-endian order:
//   magic "GGUF" | uint32 version | uint64 tensor_count | uint64 kv_count
//   kv_count  x { string key, uint32 value type, value }
//   tensor_count x { string name, uint32 n_dims, n_dims x uint64 ne,
//                    uint32 ggml type, uint64 offset }
//   padding up to `general.alignment` (default 32), then the data section.
// A string is a uint64 byte length followed by that many bytes (no NUL).
// An array value is uint32 element type, uint64 count, then the elements;
// arrays may nest.
//
// The file is treated as hostile input. Every count, length, dimension and
// type id read from it is checked against the bytes that remain before
// anything is allocated or read, all size arithmetic is overflow-checked, and
// every failure is reported as a GgufError whose message names the key or
// tensor involved and the byte offset of the offending field. Nothing in here
// aborts, reads out of bounds, or allocates memory out of proportion to the
// file size.
//
// Rules enforced beyond the raw layout:
//   * version must be 2 or 3;
//   * keys and tensor names must be unique;
//   * tensors have 1..4 dimensions; every ne[i] is >= 1 (zero-sized
//     dimensions are rejected: no model weight has one, and refusing them
//     keeps every tensor's data pointer pointing at real bytes);
//     ne[0] is a multiple of the type's block size; the element count and
//     byte size must fit in int64;
//   * general.alignment, if present, may be stored in any integer type and
//     must be a nonzero power of two;
//   * each tensor offset is a multiple of the alignment and the whole tensor
//     [offset, offset + nbytes) lies inside the file's data section.
//     Tensors are allowed to overlap each other (that cannot cause an
//     out-of-bounds read, and ggml writers never produce it anyway);
//   * nested arrays may be at most kMaxArrayDepth deep and the file may hold
//     at most kMaxNestedValues array-typed array elements in total (these
//     bounds stop hostile files from exhausting the stack or memory through
//     deep or wide nesting; real files do not nest at all);
//   * the parsed metadata may take at most metadata_budget(file size) bytes
//     of memory (4x the file plus 64 MiB): integer arrays widen to 64 bits
//     and strings carry a std::string each, so a crafted file of byte arrays
//     would otherwise need 8x its size; real files (tensors included, or a
//     vocabulary-only file) stay far below it;
//   * BOOL values must be the byte 0 or 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ks::model {

/// Thrown for every malformed file, I/O failure and failed metadata lookup.
class GgufError : public std::runtime_error {
 public:
  using runtime_error::runtime_error;
};

/// A file-controlled string (a key, a tensor name, a token) for messages: in single quotes, bytes
/// outside printable ASCII (and quotes, backslashes) as \xNN, cut after 80 bytes with "...".
std::string gguf_quote(const std::string& s);

/// Metadata value type ids, as stored in the file.
enum class GgufType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12
};

/// Upper-case name of a metadata type ("UINT32", "STRING", ...), or "INVALID".
const char* gguf_type_name(GgufType t);
/// True for the eight integer types (not BOOL).
bool gguf_type_is_integer(GgufType t);

/// One metadata value. Which members are meaningful depends on `type`:
///   integer types: `i` and `u` both hold the value where it is representable
///                  (a negative value leaves u == 0; a UINT64 above INT64_MAX
///                  leaves i == 0). Prefer the typed getters of GgufFile.
///   FLOAT32/64:    `f`.
///   BOOL:          `b`.
///   STRING:        `s` (raw bytes, not validated as UTF-8).
///   ARRAY:         `elem_type`, `array_len`, and the elements in
///                    `ai` for integer and BOOL elements (BOOL as 0/1; UINT64
///                        elements keep their bit pattern, cast back to
///                        uint64_t for values above INT64_MAX),
///                    `af` for FLOAT32/FLOAT64 elements,
///                    `as` for STRING elements,
///                    `aa` for ARRAY elements (nested arrays).
struct GgufValue {
  GgufType type = GgufType::UINT8;
  GgufType elem_type = GgufType::UINT8;  // for ARRAY
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
  bool b = false;
  std::string s;
  std::vector<int64_t> ai;
  std::vector<double> af;
  std::vector<std::string> as;
  uint64_t array_len = 0;
  std::vector<GgufValue> aa;  // extension: elements of an array of arrays
};

/// Description of one tensor. `data` points into the file's bytes and stays
/// valid for the lifetime of the GgufFile it came from (including after the
/// GgufFile is moved).
struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // ggml order: ne[0] is the fastest-varying (row length)
  uint32_t ggml_type = 0;   // 0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, 30 BF16, ...
  uint64_t offset = 0;      // relative to the data section
  uint64_t nbytes = 0;      // from ne and the type's block geometry
  const uint8_t* data = nullptr;

  /// Product of ne (fits in int64, checked at parse time).
  int64_t n_elements() const;
};

/// A parsed GGUF file. Movable, not copyable; unmaps the file on destruction.
class GgufFile {
 public:
  /// Nested arrays deeper than this (counting the outermost array as 1) are rejected.
  static constexpr int kMaxArrayDepth = 8;
  /// Total number of array-typed elements (arrays inside arrays) allowed per file.
  static constexpr uint64_t kMaxNestedValues = uint64_t(1) << 16;
  /// The memory the parsed metadata of a file of `file_bytes` bytes may take (bytes).
  static constexpr uint64_t metadata_budget(uint64_t file_bytes) { return 4 * file_bytes + (uint64_t(64) << 20); }

  /// Memory-maps `path` read-only (POSIX mmap) and parses it. Errors name the path.
  static GgufFile open(const std::string& path);
  /// Parses an in-memory image; the bytes are kept alive by the returned object.
  static GgufFile from_bytes(std::vector<uint8_t> bytes);

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;
  ~GgufFile();

  uint32_t version() const { return version_; }
  /// Alignment of the data section and tensor offsets (general.alignment or 32).
  uint64_t alignment() const { return alignment_; }
  /// Byte offset of the data section from the start of the file.
  uint64_t data_offset() const { return data_offset_; }
  /// Total size of the file image in bytes.
  uint64_t file_size() const;

  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  /// The value stored under `key`, or nullptr if absent.
  const GgufValue* find(const std::string& key) const;

  // Typed getters. Each throws GgufError naming the key when it is absent
  // (for the overloads without a default) or holds the wrong type.
  // The integer getters accept any of the eight integer types and check that
  // the value is representable in the result type.
  // get_float accepts FLOAT32, FLOAT64 and (converted) any integer type.

  uint64_t get_uint(const std::string& key) const;
  uint64_t get_uint(const std::string& key, uint64_t dflt) const;
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t dflt) const;
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double dflt) const;
  std::string get_string(const std::string& key) const;
  bool get_bool(const std::string& key, bool dflt) const;
  /// ARRAY of STRING.
  const std::vector<std::string>& get_string_array(const std::string& key) const;
  /// ARRAY of any integer type (UINT64 elements keep their bit pattern).
  const std::vector<int64_t>& get_int_array(const std::string& key) const;
  /// ARRAY of FLOAT32 or FLOAT64.
  const std::vector<double>& get_float_array(const std::string& key) const;

  /// All tensors in file order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr if absent.
  const GgufTensorInfo* tensor(const std::string& name) const;
  /// The tensor called `name`; throws GgufError naming it if absent.
  const GgufTensorInfo& require_tensor(const std::string& name) const;

 private:
  struct Storage;  // owns the bytes (mapping or vector); address-stable
  class Parser;

  GgufFile();
  static GgufFile parse(std::unique_ptr<Storage> storage);
  const GgufValue& require_value(const std::string& key) const;

  std::unique_ptr<Storage> storage_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

/// Block geometry of a ggml type id: {elements per block, bytes per block}.
/// Throws GgufError for unknown or retired type ids (4, 5, 31-33, ...).
/// Supported: F32 F16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1 Q2_K..Q6_K Q8_K, the IQ*
/// family (16-23, 29), I8 I16 I32 I64 F64 (24-28), BF16 (30), TQ1_0 TQ2_0
/// (34, 35) and MXFP4 (39).
std::pair<int64_t, int64_t> ggml_block_geometry(uint32_t ggml_type);

/// Name of a ggml type id ("Q8_0", "BF16", ...), or "unknown". Never throws.
const char* ggml_type_name(uint32_t ggml_type);

}  // namespace ks::model
