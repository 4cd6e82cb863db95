// Byte-level BPE tokenizer: see tokenizer.hpp for the pipeline and the contract.
#include "model/tokenizer.hpp"

#include "model/gguf.hpp"  // gguf_quote: file bytes in messages

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <limits>
#include <stdexcept>
#include <unordered_map>
#include <regex>
#include <string_view>
#include <utility>

namespace ks::model {
namespace {

// ---------------------------------------------------------------------------------------
// UTF-8 helpers
// ---------------------------------------------------------------------------------------

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

/// Number of bytes in the UTF-8 sequence a lead byte starts (2..4), or 0 when the byte
/// cannot start a multi-byte sequence (ASCII, continuation, C0/C1, F5..FF).
int utf8_seq_len(unsigned char lead) {
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

/// Whether `second` may follow `lead` (rejects overlongs, surrogates and > U+10FFFF).
bool utf8_second_ok(unsigned char lead, unsigned char second) {
  switch (lead) {
    case 0xE0: return second >= 0xA0 && second <= 0xBF;
    case 0xED: return second >= 0x80 && second <= 0x9F;
    case 0xF0: return second >= 0x90 && second <= 0xBF;
    case 0xF4: return second >= 0x80 && second <= 0x8F;
    default: return second >= 0x80 && second <= 0xBF;
  }
}

bool is_cont(unsigned char c) { return (c & 0xC0) == 0x80; }

/// Decodes one code point at s[i] and advances i. Returns -1 (advancing one byte) when
/// the bytes at i are not a valid UTF-8 sequence.
int32_t next_code_point(std::string_view s, size_t& i) {
  const auto c0 = static_cast<unsigned char>(s[i]);
  if (c0 < 0x80) {
    ++i;
    return c0;
  }
  const int n = utf8_seq_len(c0);
  if (n == 0 || i + n > s.size() || !utf8_second_ok(c0, static_cast<unsigned char>(s[i + 1]))) {
    ++i;
    return -1;
  }
  uint32_t cp = c0 & (0x7F >> n);
  for (int k = 1; k < n; ++k) {
    const auto c = static_cast<unsigned char>(s[i + k]);
    if (!is_cont(c)) {
      ++i;
      return -1;
    }
    cp = (cp << 6) | (c & 0x3F);
  }
  i += n;
  return int32_t(cp);
}

// ---------------------------------------------------------------------------------------
// GPT-2 byte <-> unicode table
// ---------------------------------------------------------------------------------------

/// GPT-2 maps every byte to a printable code point: bytes '!'..'~', 0xA1..0xAC and
/// 0xAE..0xFF map to themselves; the other 68 bytes map, in increasing byte order, to
/// U+0100, U+0101, ... (so the space 0x20 becomes U+0120 'Ġ'). All targets are < U+0200.
struct ByteUnicode {
  std::array<std::string, 256> utf8{};  // byte -> UTF-8 of its code point
  std::array<int16_t, 512> byte_of{};   // code point -> byte, -1 when not a target

  ByteUnicode() {
    byte_of.fill(-1);
    uint32_t next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const uint32_t cp = printable ? uint32_t(b) : next_extra++;
      append_utf8(utf8[b], cp);
      byte_of[cp] = int16_t(b);
    }
  }
};

const ByteUnicode& byte_unicode() {
  static const ByteUnicode table;
  return table;
}

// ---------------------------------------------------------------------------------------
// PCRE2 wrappers
// ---------------------------------------------------------------------------------------

/// Owns a compiled pattern (JIT-compiled when available). Matching with a compiled pattern
/// is thread-safe; each caller brings its own match data.
class Regex {
 public:
  explicit Regex(const char* pattern) {
    int err = 0;
    PCRE2_SIZE err_off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_off,
                          nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw std::logic_error(std::string("tokenizer: regex compile failed at offset ") +
                             std::to_string(err_off) + ": " + reinterpret_cast<char*>(msg));
    }
    // JIT is an optimisation only: on failure pcre2_match falls back to the interpreter.
    (void)pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// Finds the first match in subject[offset, size). Returns false when there is none or
  /// when PCRE2 reports an error (e.g. a resource limit); *error is set in the latter case.
  bool find(std::string_view subject, size_t offset, pcre2_match_data* md, size_t* begin,
            size_t* end, bool* error) const {
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()),
                               subject.size(), offset, 0, md, nullptr);
    *error = rc < 0 && rc != PCRE2_ERROR_NOMATCH;
    if (rc < 0) return false;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    *begin = ov[0];
    *end = ov[1];
    return *begin >= offset && *end >= *begin && *end <= subject.size();
  }

 private:
  pcre2_code* code_ = nullptr;
};

struct MatchDataDeleter {
  void operator()(pcre2_match_data* md) const { pcre2_match_data_free(md); }
};
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

// Whitespace as Oniguruma (the HF tokenizers regex engine) defines \s under Unicode:
// TAB..CR, U+0085 and the separator categories Zs/Zl/Zp. PCRE2's own \s differs (it also
// matches U+180E), so the class is spelled out.
#define KS_WS "\\t\\n\\x{0B}\\f\\r\\x{85}\\p{Z}"

/// GPT-2 split regex with \s made explicit.
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" KS_WS "\\p{L}\\p{N}]+"
    "|[" KS_WS "]+(?![^" KS_WS "])|[" KS_WS "]+";

/// One Unicode number character (HF Digits pre-tokenizer, individual_digits = true).
constexpr const char* kDigitPattern = "\\p{N}";

#undef KS_WS

// ---------------------------------------------------------------------------------------
// Merge table: open addressing on the (left id, right id) pair
// ---------------------------------------------------------------------------------------

class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    int32_t result = 0;
  };

  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 1) cap *= 2;
    slots_.assign(cap, Entry{});
    mask_ = cap - 1;
  }

  /// Inserts unless the pair is already present (the lower rank wins).
  void insert(int32_t left, int32_t right, int32_t rank, int32_t result) {
    const uint64_t key = make_key(left, right);
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return;
      if (slots_[i].key == kEmpty) {
        slots_[i] = Entry{key, rank, result};
        return;
      }
    }
  }

  /// The merge of (left, right), or nullptr. Ids < 0 never match.
  const Entry* find(int32_t left, int32_t right) const {
    if (left < 0 || right < 0 || slots_.empty()) return nullptr;
    const uint64_t key = make_key(left, right);
    for (size_t i = hash(key) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return &slots_[i];
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // unreachable: ids are < 2^31
  static uint64_t make_key(int32_t l, int32_t r) {
    return (uint64_t(uint32_t(l)) << 32) | uint32_t(r);
  }
  static size_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return size_t(k);
  }
  std::vector<Entry> slots_;
  size_t mask_ = 0;
};

/// Symbol id marking a symbol that was merged into its left neighbour.
constexpr int32_t kDead = -1;

/// Per-thread working memory for BPE, reused across pieces to avoid allocations.
struct BpeScratch {
  struct Candidate {
    int32_t rank;
    int32_t left;      // symbol index of the left half (its start position orders ties)
    int32_t right;     // symbol index of the right half
    int32_t left_id;   // ids at push time, to detect stale candidates
    int32_t right_id;
    int32_t result;
  };
  // std heap functions build a max-heap; "greater" puts the lowest (rank, left) on top.
  static bool later(const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
  }
  std::vector<int32_t> id, prev, next;
  std::vector<Candidate> heap;
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Tokenizer::Impl
// ---------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::vector<std::string> text;    // vocabulary strings as stored in the GGUF
  std::vector<int32_t> type;        // raw GGUF token types
  std::vector<std::string> bytes;   // decoded bytes per token
  std::unordered_map<std::string_view, int32_t> index;  // text -> first id (views into text)
  std::array<int32_t, 256> byte_token{};                // byte -> id of its one-byte token
  MergeTable merges;
  /// Control / user-defined token texts in a byte trie: node 0 the root, the edge from node n by
  /// byte b at special_edges[n * 256 + b], special_id[n] the token whose text ends there (or -1).
  /// longest_special walks it from a position: the longest special there in O(its length),
  /// however many specials share a prefix (a bucket per first byte, compared one by one, took
  /// 20 s on a crafted file with thousands of specials starting with '<').
  std::vector<int32_t> special_id{-1};
  std::unordered_map<uint64_t, uint32_t> special_edges;
  int32_t bos = -1, eos = -1, unk = -1;
  bool split_digits = false;
  std::unique_ptr<Regex> digit_re, word_re;

  void encode_span(std::string_view s, pcre2_match_data* md, std::vector<int32_t>& out) const;
  void encode_words(std::string_view s, pcre2_match_data* md, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void add_special(const std::string& t, int32_t id) {
    uint32_t n = 0;
    for (unsigned char b : t) {
      const auto [it, fresh] = special_edges.try_emplace(uint64_t(n) * 256 + b, uint32_t(special_id.size()));
      if (fresh) special_id.push_back(-1);
      n = it->second;
    }
    if (special_id[n] < 0) special_id[n] = id;
  }
  /// The special token whose text is the longest one starting at text[i], or -1.
  int32_t longest_special(std::string_view text, size_t i) const {
    int32_t hit = -1;
    uint32_t n = 0;
    for (; i < text.size(); ++i) {
      const auto it = special_edges.find(uint64_t(n) * 256 + static_cast<unsigned char>(text[i]));
      if (it == special_edges.end()) break;
      n = it->second;
      if (special_id[n] >= 0) hit = special_id[n];
    }
    return hit;
  }
  void check_id(int32_t id) const {
    if (id < 0 || size_t(id) >= text.size()) {
      throw std::out_of_range("tokenizer: token id " + std::to_string(id) + " out of range [0, " +
                              std::to_string(text.size()) + ")");
    }
  }
};

/// Pre-tokenizes one span (free of special tokens) and appends the BPE ids of its pieces.
void Tokenizer::Impl::encode_span(std::string_view s, pcre2_match_data* md,
                                  std::vector<int32_t>& out) const {
  if (!split_digits) {
    encode_words(s, md, out);
    return;
  }
  // Each number character is a piece; the text between them goes through the word regex.
  size_t pos = 0;
  while (pos < s.size()) {
    size_t b = 0, e = 0;
    bool error = false;
    if (!digit_re->find(s, pos, md, &b, &e, &error) || e == b) {
      encode_words(s.substr(pos), md, out);
      return;
    }
    if (b > pos) encode_words(s.substr(pos, b - pos), md, out);
    encode_piece(s.substr(b, e - b), out);
    pos = e;
  }
}

/// Splits s with the GPT-2 regex. The regex is matched against s alone, so its lookahead
/// sees the end of s as the end of the text. Bytes no match covers (only invalid UTF-8 can
/// be uncovered) become one-byte pieces.
void Tokenizer::Impl::encode_words(std::string_view s, pcre2_match_data* md,
                                   std::vector<int32_t>& out) const {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t b = 0, e = 0;
    bool error = false;
    if (!word_re->find(s, pos, md, &b, &e, &error)) {
      if (error) {
        // Resource limit inside PCRE2: keep the output lossless by encoding the rest whole.
        encode_piece(s.substr(pos), out);
      } else {
        for (; pos < s.size(); ++pos) encode_piece(s.substr(pos, 1), out);
      }
      return;
    }
    for (; pos < b; ++pos) encode_piece(s.substr(pos, 1), out);
    if (e == b) {  // cannot happen with this pattern; guard against looping forever
      encode_piece(s.substr(b, 1), out);
      pos = b + 1;
      continue;
    }
    encode_piece(s.substr(b, e - b), out);
    pos = e;
  }
}

/// Byte-level BPE on one piece: start from one symbol per byte and repeatedly merge the
/// adjacent pair with the lowest merge rank (leftmost on ties) until no pair merges.
/// A heap of candidate pairs with lazy invalidation keeps this O(n log n).
void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t len = piece.size();
  if (len == 0) return;
  if (len == 1) {
    const int32_t t = byte_token[static_cast<unsigned char>(piece[0])];
    if (t >= 0 || unk >= 0) out.push_back(t >= 0 ? t : unk);
    return;
  }
  if (len > size_t(std::numeric_limits<int32_t>::max())) {  // indexes are int32_t below
    encode_piece(piece.substr(0, len / 2), out);
    encode_piece(piece.substr(len / 2), out);
    return;
  }

  thread_local BpeScratch scratch;
  auto& id = scratch.id;
  auto& prev = scratch.prev;
  auto& next = scratch.next;
  auto& heap = scratch.heap;
  // One symbol per byte. A byte without a one-byte token becomes the unknown token when the
  // vocabulary has one; otherwise it is dropped before merging, so that its neighbours become
  // adjacent. Both match the HF BPE model (with and without unk_token).
  id.clear();
  for (size_t i = 0; i < len; ++i) {
    const int32_t t = byte_token[static_cast<unsigned char>(piece[i])];
    if (t >= 0) {
      id.push_back(t);
    } else if (unk >= 0) {
      id.push_back(unk);
    }
  }
  const size_t n = id.size();
  if (n == 0) return;
  prev.resize(n);
  next.resize(n);
  heap.clear();
  for (size_t i = 0; i < n; ++i) {
    prev[i] = int32_t(i) - 1;
    next[i] = i + 1 < n ? int32_t(i + 1) : -1;
  }
  auto push_pair = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    if (const MergeTable::Entry* m = merges.find(id[l], id[r])) {
      heap.push_back({m->rank, l, r, id[l], id[r], m->result});
      std::push_heap(heap.begin(), heap.end(), BpeScratch::later);
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) push_pair(int32_t(i), int32_t(i + 1));

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), BpeScratch::later);
    const BpeScratch::Candidate c = heap.back();
    heap.pop_back();
    // Stale if either side has since merged with something else.
    if (id[c.left] != c.left_id || id[c.right] != c.right_id || next[c.left] != c.right) continue;
    id[c.left] = c.result;
    id[c.right] = kDead;
    next[c.left] = next[c.right];
    if (next[c.left] >= 0) prev[next[c.left]] = c.left;
    push_pair(prev[c.left], c.left);
    push_pair(c.left, next[c.left]);
  }
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(id[i]);
  if (n > (size_t(1) << 16)) {  // do not keep a huge piece's buffers alive in every thread
    scratch = BpeScratch{};
  }
}

// ---------------------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::vector<std::string> tokens, std::vector<int32_t> token_types,
                     std::vector<std::string> merges, int32_t bos_id, int32_t eos_id,
                     std::string pre) {
  if (tokens.empty()) throw std::invalid_argument("tokenizer: empty vocabulary");
  if (tokens.size() > size_t(std::numeric_limits<int32_t>::max())) {
    throw std::invalid_argument("tokenizer: vocabulary too large");
  }
  if (token_types.size() != tokens.size()) {
    throw std::invalid_argument("tokenizer: " + std::to_string(token_types.size()) +
                                " token types for " + std::to_string(tokens.size()) + " tokens");
  }
  const auto n_vocab = int32_t(tokens.size());
  for (const auto& [name, v] : {std::pair{"bos", bos_id}, std::pair{"eos", eos_id}}) {
    if (v < -1 || v >= n_vocab) {
      throw std::invalid_argument(std::string("tokenizer: ") + name + " id " + std::to_string(v) +
                                  " out of range");
    }
  }

  auto impl = std::make_shared<Impl>();
  if (pre == "smollm") {
    impl->split_digits = true;
  } else if (pre == "gpt2" || pre == "default") {
    impl->split_digits = false;
  } else {
    throw std::invalid_argument("tokenizer: unsupported pre-tokenizer " + gguf_quote(pre));
  }
  impl->digit_re = std::make_unique<Regex>(kDigitPattern);
  impl->word_re = std::make_unique<Regex>(kGpt2Pattern);
  impl->bos = bos_id;
  impl->eos = eos_id;
  impl->text = std::move(tokens);
  impl->type = std::move(token_types);

  // Lookup index (first occurrence wins) and decoded bytes of every token.
  const ByteUnicode& bu = byte_unicode();
  impl->index.reserve(impl->text.size());
  impl->bytes.resize(impl->text.size());
  for (int32_t i = 0; i < n_vocab; ++i) {
    const std::string& t = impl->text[i];
    impl->index.emplace(std::string_view(t), i);
    const auto ty = TokenType(impl->type[i]);
    if (ty == TokenType::Unknown && impl->unk < 0) impl->unk = i;
    std::string& out = impl->bytes[i];
    if (ty == TokenType::Control || ty == TokenType::UserDefined) {
      out = t;
      continue;
    }
    if (ty == TokenType::Byte && t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
      const std::string hex = t.substr(3, 2);
      if (std::isxdigit(static_cast<unsigned char>(hex[0])) &&
          std::isxdigit(static_cast<unsigned char>(hex[1]))) {
        out = char(std::stoi(hex, nullptr, 16));
        continue;
      }
    }
    // Byte-level form: map each code point back to its byte; anything that is not a
    // byte-level code point (or not valid UTF-8) is kept verbatim.
    for (size_t p = 0; p < t.size();) {
      const size_t start = p;
      const int32_t cp = next_code_point(t, p);
      if (cp >= 0 && cp < 512 && bu.byte_of[cp] >= 0) {
        out += char(bu.byte_of[cp]);
      } else {
        out.append(t, start, p - start);
      }
    }
  }

  // Ids of the 256 one-byte tokens.
  impl->byte_token.fill(-1);
  for (int b = 0; b < 256; ++b) {
    auto it = impl->index.find(bu.utf8[b]);
    if (it != impl->index.end()) impl->byte_token[b] = it->second;
  }

  // Merges, in rank order.
  impl->merges.reserve(merges.size());
  std::string joined;
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    const size_t sp = m.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 >= m.size() ||
        m.find(' ', sp + 1) != std::string::npos) {
      throw std::invalid_argument("tokenizer: malformed merge #" + std::to_string(r) + ": " + gguf_quote(m));
    }
    const std::string_view left(m.data(), sp), right(m.data() + sp + 1, m.size() - sp - 1);
    joined.assign(left);
    joined.append(right);
    const auto l = impl->index.find(left), rr = impl->index.find(right);
    const auto j = impl->index.find(joined);
    if (l == impl->index.end() || rr == impl->index.end() || j == impl->index.end()) {
      throw std::invalid_argument("tokenizer: merge #" + std::to_string(r) + " " + gguf_quote(m) +
                                  " names a string not in the vocabulary");
    }
    if (r > size_t(std::numeric_limits<int32_t>::max())) {
      throw std::invalid_argument("tokenizer: too many merges");
    }
    impl->merges.insert(l->second, rr->second, int32_t(r), j->second);
  }

  // Special tokens that parse_special recognises (a text's first id when ids share it).
  for (int32_t i = 0; i < n_vocab; ++i) {
    const auto ty = TokenType(impl->type[i]);
    if ((ty == TokenType::Control || ty == TokenType::UserDefined) && !impl->text[i].empty() &&
        impl->index.at(impl->text[i]) == i) {
      impl->add_special(impl->text[i], i);
    }
  }
  impl_ = std::move(impl);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  const Impl& im = *impl_;
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  MatchData md(pcre2_match_data_create(1, nullptr));
  if (!md) throw std::bad_alloc();

  if (!parse_special) {
    im.encode_span(text, md.get(), out);
    return out;
  }
  // Leftmost-longest scan for special-token text; the spans between are plain text.
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    const int32_t hit = im.longest_special(text, i);
    if (hit < 0) {
      ++i;
      continue;
    }
    if (i > start) im.encode_span(text.substr(start, i - start), md.get(), out);
    out.push_back(hit);
    i += im.text[hit].size();
    start = i;
  }
  if (start < text.size()) im.encode_span(text.substr(start), md.get(), out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    impl_->check_id(id);
    out += impl_->bytes[size_t(id)];
  }
  return out;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  impl_->check_id(id);
  return impl_->bytes[size_t(id)];
}

int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::n_vocab() const { return int32_t(impl_->text.size()); }

int32_t Tokenizer::find_token(std::string_view text) const {
  const auto it = impl_->index.find(text);
  return it == impl_->index.end() ? -1 : it->second;
}

bool Tokenizer::is_control(int32_t id) const {
  return id >= 0 && size_t(id) < impl_->type.size() &&
         impl_->type[size_t(id)] == int32_t(TokenType::Control);
}

TokenType Tokenizer::token_type(int32_t id) const {
  impl_->check_id(id);
  return TokenType(impl_->type[size_t(id)]);
}

// ---------------------------------------------------------------------------------------
// Streaming decode
// ---------------------------------------------------------------------------------------

size_t utf8_incomplete_tail(std::string_view s) {
  // Walk back over at most three continuation bytes to the lead byte.
  for (size_t k = 1; k <= 4 && k <= s.size(); ++k) {
    const auto c = static_cast<unsigned char>(s[s.size() - k]);
    if (is_cont(c)) continue;
    const int need = utf8_seq_len(c);
    if (need == 0 || size_t(need) <= k) return 0;  // ASCII, invalid lead, or complete
    if (k >= 2 && !utf8_second_ok(c, static_cast<unsigned char>(s[s.size() - k + 1]))) return 0;
    return k;
  }
  return 0;  // only continuation bytes: nothing can complete them
}

StreamDecoder::StreamDecoder(const Tokenizer& tok) : tok_(&tok) {}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_->token_bytes(id);
  const size_t ready = pending_.size() - utf8_incomplete_tail(pending_);
  std::string out = pending_.substr(0, ready);
  pending_.erase(0, ready);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

// ---------------------------------------------------------------------------------------
// Chat template
// ---------------------------------------------------------------------------------------

namespace {
// A Jinja template cut into what its output can hold: raw text between tags, and the string
// literals inside {{ }} / {% %} tags, decoded (\n \t \r \' \" \\; another escape marks the
// literal undecoded). `after`: the tag code that follows the piece up to the next literal or
// the tag's end (raw text: the next tag's code). {# comments #} are dropped.
struct JinjaPiece {
  std::string text, after;
  bool decoded = true;
};
// unterminated: set where a string literal or a tag runs to the end of the template.
std::vector<JinjaPiece> jinja_pieces(const std::string& t, bool* unterminated) {
  *unterminated = false;
  std::vector<JinjaPiece> out(1);  // (an empty first piece: the code before any literal is its `after`)
  size_t i = 0;
  auto code_until = [&](size_t from, size_t end) { return t.substr(from, end - from); };
  while (i < t.size()) {
    const size_t tag = t.find('{', i);
    const bool is_tag = tag != std::string::npos && tag + 1 < t.size() &&
                        (t[tag + 1] == '{' || t[tag + 1] == '%' || t[tag + 1] == '#');
    if (!is_tag) {  // raw text to the next tag (or past a lone '{')
      const size_t end = tag == std::string::npos ? t.size() : tag + 1;
      out.push_back({t.substr(i, end - i), ""});
      i = end;
      continue;
    }
    if (tag > i) out.push_back({t.substr(i, tag - i), ""});
    const char kind = t[tag + 1];
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    size_t k = tag + 2;
    if (kind == '#') {  // a comment: dropped
      const size_t e = t.find(close, k);
      i = e == std::string::npos ? t.size() : e + 2;
      continue;
    }
    size_t code_from = k;
    JinjaPiece* last = &out.back();
    while (k < t.size() && t.compare(k, 2, close) != 0) {
      const char c = t[k];
      if (c != '\'' && c != '"') {
        ++k;
        continue;
      }
      last->after += code_until(code_from, k);
      JinjaPiece lit;
      for (++k; k < t.size() && t[k] != c; ++k) {
        if (t[k] == '\\' && k + 1 < t.size()) {
          const char n = t[++k];
          if (n == 'n') lit.text += '\n';
          else if (n == 't') lit.text += '\t';
          else if (n == 'r') lit.text += '\r';
          else if (n == '\'' || n == '"' || n == '\\') lit.text += n;
          else lit.decoded = false, lit.text += n;
        } else {
          lit.text += t[k];
        }
      }
      if (k < t.size()) ++k;  // the closing quote
      else *unterminated = true;
      out.push_back(std::move(lit));
      last = &out.back();
      code_from = k;
    }
    if (k >= t.size()) *unterminated = true;  // (no closing }} / %})
    last->after += code_until(std::min(code_from, t.size()), std::min(k, t.size()));
    i = std::min(k + 2, t.size());
  }
  return out;
}
}  // namespace

// The largest chat template chat_format_from_template reads (SmolLM2's is 0.6 KB, ChatML templates
// with tool instructions a few KB).
constexpr size_t kMaxChatTemplateBytes = 8192;

ChatFormat chat_format_from_template(const std::string& jinja) {
  const auto refuse = [](const std::string& why) {
    throw std::invalid_argument("chat template: the model's tokenizer.chat_template " + why +
                                "; kernscope renders plain ChatML only: leave out --chat and give the formatted prompt");
  };
  // (a bound well above ChatML templates' few KB: the regular expressions below recurse once per
  // character they consume, so an unbounded run of spaces overflowed the stack; 2026-12-05)
  if (jinja.size() > kMaxChatTemplateBytes)
    refuse("is " + std::to_string(jinja.size()) + " bytes, more than the " + std::to_string(kMaxChatTemplateBytes) +
           " kernscope reads");
  bool unterminated = false;
  const std::vector<JinjaPiece> pieces = jinja_pieces(jinja, &unterminated);
  if (unterminated) refuse("has a string literal or a tag that is never closed");
  std::string code;  // the template without its comments
  for (const JinjaPiece& p : pieces) code += p.text + "\x01" + p.after;
  // the turn kernscope renders, "<|im_start|>" + role + "\n" + content + "<|im_end|>", and the
  // generation prompt "<|im_start|>assistant\n" alone in its literal
  // (code: each piece's text, \x01, the code after it; so message['role'] reads message[role\x01])
  static const std::regex turn(
      R"(<\|im_start\|>\x01\s*\+\s*message(\s*\[\s*role\x01\s*\]|\.role)\s*\+\s*\n\x01\s*\+\s*)"
      R"(message(\s*\[\s*content\x01\s*\]|\.content)(\s*\|\s*trim)?\s*\+\s*<\|im_end\|>)");
  static const std::regex gen(R"(<\|im_start\|>assistant\n\x01)");
  if (!std::regex_search(code, turn))
    refuse("does not render turns as '<|im_start|>' + role + newline + content + '<|im_end|>' (not ChatML)");
  if (!std::regex_search(code, gen)) refuse("has no generation prompt '<|im_start|>assistant' + newline alone");
  for (const char* extra : {"bos_token", "<|im_sep|>", "<think>"})
    if (code.find(extra) != std::string::npos) refuse(std::string("uses ") + extra);
  // the default system turn: text between "<|im_start|>system\n" and "<|im_end|>" in one piece
  // (several different ones, e.g. a tools branch, or one built from several pieces or a variable,
  // cannot be told apart without evaluating the template: default_unknown)
  ChatFormat f;
  f.has_default_system = false;
  f.default_system.clear();
  std::vector<std::string> found;
  bool unreadable = false;
  const std::string head = "<|im_start|>system\n";
  // what may follow a piece that ends right after the system turn's head: a system message's
  // content (messages[0]['content'], message.content, ...)
  static const std::regex content_next(
      R"(^[\s+\-]*(\}\}[\s\-]*\{\{[\s\-]*)?(messages\s*\[\s*0\s*\]|message|system_message)\s*(\[\s*$|\.content\b))");
  for (size_t pi = 0; pi < pieces.size(); ++pi) {
    const JinjaPiece& p = pieces[pi];
    for (size_t at = p.text.find(head); at != std::string::npos; at = p.text.find(head, at + 1)) {
      const std::string_view rest = std::string_view(p.text).substr(at + head.size());  // (no copy per match)
      const size_t e = rest.find("<|im_end|>");
      if (e != std::string_view::npos) {
        const std::string text(rest.substr(0, e));
        if (!p.decoded || text.find("{{") != std::string::npos || text.find("{%") != std::string::npos)
          unreadable = true;
        else if (std::find(found.begin(), found.end(), text) == found.end())
          found.push_back(text);
        continue;
      }
      // the piece ends inside the turn: a system message's content may follow; anything else
      // (another literal, a variable) is a default kernscope does not read
      const size_t last = p.after.find_last_not_of(" \t\n");
      const bool subscript = last != std::string::npos && p.after[last] == '[';  // message['content']
      const bool content = rest.empty() && std::regex_search(p.after, content_next) &&
                           (!subscript || (pi + 1 < pieces.size() && pieces[pi + 1].text == "content"));
      if (!content) unreadable = true;
    }
  }
  if (found.size() == 1) {
    f.has_default_system = true;
    f.default_system = found[0];
  } else if (found.size() > 1 || unreadable) {
    f.default_unknown = true;
  }
  return f;
}

std::string apply_chat_template(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                const ChatFormat& format) {
  std::string out;
  if (!messages.empty() && messages.front().role != "system" && format.has_default_system)
    out += "<|im_start|>system\n" + format.default_system + "<|im_end|>\n";
  for (const ChatMessage& m : messages) {
    out += "<|im_start|>";
    out += m.role;
    out += '\n';
    out += m.content;
    out += "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace ks::model
