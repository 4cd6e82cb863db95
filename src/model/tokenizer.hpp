// Byte-level BPE tokenizer (GPT-2 style) built from GGUF tokenizer metadata, as used by
// SmolLM2-135M-Instruct, plus a streaming detokenizer and the SmolLM2 (ChatML) chat template.
//
// Encoding pipeline (Tokenizer::encode):
//   1. Special tokens (optional): the exact text of control / user-defined tokens is cut out
//      of the input (leftmost, longest match) and becomes those ids.
//   2. Pre-tokenizer: every remaining span is split into pieces. For pre == "smollm" each
//      Unicode number character (\p{N}) is first made a piece of its own (HF Digits with
//      individual_digits=true); every other span is then split with the GPT-2 regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      where \s is the Oniguruma/HF definition (TAB..CR, U+0085 and category Z). Bytes that
//      are not valid UTF-8 are never matched by the regex; each becomes a one-byte piece.
//   3. Each piece's bytes are mapped through the GPT-2 byte-to-unicode table, then merged by
//      BPE (lowest merge rank first, leftmost on ties) and mapped to token ids.
//
// Fidelity to the reference (HF `tokenizers` with SmolLM2's tokenizer.json): identical ids for
// every code point assigned in Unicode 14 (checked exhaustively, in several contexts, and on
// random mixed text). Unicode categories come from the system PCRE2 (10.42: Unicode 14), so
// characters first assigned in Unicode 15/16 (e.g. CJK Extension H, Egyptian Hieroglyphs
// Extended-A) are seen as unassigned and may split differently from a newer engine.
//
// Bytes without a token: a vocabulary may lack some one-byte tokens (SmolLM2 has none for
// 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2 0xF5..0xFF). Such a byte becomes the
// unknown token (type 2) if the vocabulary has one; otherwise it is dropped before merging,
// exactly as the HF BPE model without unk_token does. All other bytes round-trip.
//
// The tokenizer is immutable after construction; encode/decode are safe to call from many
// threads at once. Copies share the (read-only) tables.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ks::model {

/// GGUF token types (tokenizer.ggml.token_type), as written by llama.cpp's converters.
enum class TokenType : int32_t {
  Normal = 1,
  Unknown = 2,
  Control = 3,
  UserDefined = 4,
  Unused = 5,
  Byte = 6,
};

class Tokenizer {
 public:
  /// Builds the tokenizer from GGUF metadata arrays.
  ///  - tokens: vocabulary strings; normal tokens are GPT-2 byte-to-unicode encoded (e.g. "Ġthe").
  ///  - token_types: one TokenType value per token (same length as tokens).
  ///  - merges: BPE merges "left right" in rank order (rank 0 first); if a pair repeats, its
  ///    first (best) rank is used.
  ///  - bos_id / eos_id: ids reported by bos_id()/eos_id(); -1 when the model has none.
  ///  - pre: the GGUF tokenizer.ggml.pre value: "smollm" (digit split + GPT-2 regex), or
  ///    "gpt2" / "default" (GPT-2 regex only).
  /// Throws std::invalid_argument on inconsistent input: empty vocabulary, length mismatch,
  /// bos/eos out of range, a malformed merge or one naming a string not in the vocabulary,
  /// or an unsupported pre-tokenizer.
  Tokenizer(std::vector<std::string> tokens, std::vector<int32_t> token_types,
            std::vector<std::string> merges, int32_t bos_id, int32_t eos_id, std::string pre);

  /// Encodes arbitrary bytes (UTF-8, possibly invalid) to token ids. BOS is never added.
  /// parse_special = true turns the exact text of control / user-defined tokens
  /// (e.g. "<|im_start|>") into those ids; false encodes such text as plain text.
  /// decode(encode(s)) == s, except that bytes without a one-byte token (see above) are
  /// dropped (or become the unknown token, if the vocabulary has one).
  /// Never throws (except std::bad_alloc when memory runs out).
  std::vector<int32_t> encode(std::string_view text, bool parse_special) const;

  /// Concatenates token_bytes() of every id: raw bytes, not necessarily valid UTF-8.
  /// Throws std::out_of_range for an id outside [0, n_vocab()).
  std::string decode(const std::vector<int32_t>& ids) const;

  /// The bytes one token stands for. Normal tokens are decoded from the byte-to-unicode
  /// form; control and user-defined tokens render as their text; byte tokens "<0xHH>" as
  /// that byte. Throws std::out_of_range for an id outside [0, n_vocab()).
  std::string token_bytes(int32_t id) const;

  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t n_vocab() const;

  /// Id of the vocabulary entry whose stored string is exactly `text` (byte-level form for
  /// normal tokens, e.g. "Ġthe"; plain text for special tokens, e.g. "<|im_end|>").
  /// Returns -1 if absent.
  int32_t find_token(std::string_view text) const;

  /// True when id is a control token (type 3). False for out-of-range ids.
  bool is_control(int32_t id) const;

  /// The token's type; TokenType::Normal semantics are assumed for unknown values.
  /// Throws std::out_of_range for an id outside [0, n_vocab()).
  TokenType token_type(int32_t id) const;


 private:
  struct Impl;  // immutable tables and compiled regexes, defined in tokenizer.cpp
  std::shared_ptr<const Impl> impl_;
};

/// Streaming detokenizer: feed generated ids one at a time and get printable text back.
/// Bytes that form an incomplete-but-so-far-valid UTF-8 sequence at the end are held back
/// until a later token completes them; bytes that can never become valid UTF-8 are passed
/// through as-is (never held indefinitely). The Tokenizer must outlive the decoder.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok);

  /// Appends the token's bytes and returns everything that is ready to print.
  /// Throws std::out_of_range for a bad id (the decoder state is then unchanged).
  std::string push(int32_t id);

  /// Returns whatever is still held back (possibly an incomplete sequence) and resets.
  std::string flush();

 private:
  const Tokenizer* tok_;
  std::string pending_;
};

/// Length (0..3) of the trailing bytes of s that are a proper prefix of a valid UTF-8
/// sequence, i.e. that a following byte could still complete. 0 when s ends on a complete
/// character or on bytes that can never become valid.
size_t utf8_incomplete_tail(std::string_view s);

/// One chat turn.
struct ChatMessage {
  std::string role, content;
};

/// What kernscope renders of a model's chat template: ChatML turns, and the system turn the
/// template inserts when the first message is not a "system" message (has_default_system).
struct ChatFormat {
  bool has_default_system = true;
  // the template inserts a system turn kernscope cannot read without evaluating it (several
  // different defaults, e.g. a tools branch; one built from a variable or several pieces): a
  // system message must be given (ksctl: --system)
  bool default_unknown = false;
  std::string default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";  // SmolLM2's
};

/// The ChatFormat of a GGUF's tokenizer.chat_template (a Jinja source), which kernscope does not
/// evaluate but reads: comments dropped, its string literals decoded. It must render each turn
/// as '<|im_start|>' + message role + newline + message content + '<|im_end|>' and have the
/// generation prompt '<|im_start|>assistant' + newline as a literal of its own, and must not use
/// bos_token, <|im_sep|> or <think>; otherwise std::invalid_argument says so. The default system
/// turn is the text between "<|im_start|>system" + newline and "<|im_end|>" inside one literal (or
/// raw text) when the template has exactly one such text; several, or a system turn built
/// otherwise than from the system message, set default_unknown. (SmolLM2-Instruct's template
/// gives the defaults above.)
ChatFormat chat_format_from_template(const std::string& jinja);

/// Renders messages in ChatML as `format` says (the default: SmolLM2-Instruct's template, the
/// GGUF's tokenizer.chat_template): when the first message is not a "system" message and the
/// format has a default system turn, "<|im_start|>system\n" + default_system + "<|im_end|>\n"
/// is prepended; each message renders as "<|im_start|>" + role + "\n" + content +
/// "<|im_end|>\n"; with add_generation_prompt, "<|im_start|>assistant\n" follows.
/// An empty message list renders only the generation prompt (as the Jinja template does).
/// The result is meant to be encoded with parse_special = true.
std::string apply_chat_template(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true,
                                const ChatFormat& format = ChatFormat{});

}  // namespace ks::model
