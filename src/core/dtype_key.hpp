// The dtype argument of ks_which / ks_which_shape (and ksctl which --dtype) in its canonical form,
// header-only so that ksctl, outside the library's exported symbols, reads it the same way.
#pragma once

#include <cctype>
#include <string>

namespace ks {

// Lower case, with torch's names of the three float dtypes (float16 / half, bfloat16, float32 /
// float) as fp16, bf16, fp32; a block format after ':' kept, in lower case ("BFloat16:Q4_1" ->
// "bf16:q4_1"). Nothing is checked here: ks_which refuses what it does not know.
inline std::string canonical_dtype_key(std::string v) {
  for (char& c : v) c = char(std::tolower(static_cast<unsigned char>(c)));
  const size_t colon = v.find(':');
  const std::string base = v.substr(0, colon), rest = colon == std::string::npos ? "" : v.substr(colon);
  static const std::pair<const char*, const char*> kAliases[] = {
      {"float16", "fp16"}, {"half", "fp16"}, {"bfloat16", "bf16"}, {"float32", "fp32"}, {"float", "fp32"}};
  for (const auto& [alias, name] : kAliases)
    if (base == alias) return name + rest;
  return v;
}

}  // namespace ks
