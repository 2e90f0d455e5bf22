#include "gateway/tokenizer/byte_tokenizer.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvrelay::gateway {
namespace {

// Length of the UTF-8 sequence that starts with `lead`, or 0 if `lead` cannot start one.
int Utf8Length(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

bool IsByte(int32_t id) { return id >= 0 && id < kByteVocabSize; }

}  // namespace

std::vector<int32_t> EncodeBytes(std::string_view text) {
  std::vector<int32_t> tokens;
  tokens.reserve(text.size());
  for (char c : text) tokens.push_back(static_cast<uint8_t>(c));
  return tokens;
}

absl::StatusOr<std::string> DecodeBytes(absl::Span<const int32_t> tokens) {
  std::string text;
  text.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!IsByte(tokens[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", i, " is ", tokens[i], ", which is not a byte token (ids 0-255)"));
    }
    text.push_back(static_cast<char>(tokens[i]));
  }
  return text;
}

std::string DecodeForDisplay(absl::Span<const int32_t> tokens) {
  std::string out;
  size_t i = 0;
  while (i < tokens.size()) {
    const int32_t id = tokens[i];
    if (!IsByte(id)) {
      absl::StrAppend(&out, "<", id, ">");
      ++i;
      continue;
    }
    const uint8_t b = static_cast<uint8_t>(id);
    if (b == '\n' || b == '\t' || (b >= 0x20 && b < 0x7F)) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    }
    // A multi-byte UTF-8 sequence is shown as text only when every continuation byte is there.
    const int len = Utf8Length(b);
    bool valid = len > 1 && i + len <= tokens.size();
    for (int k = 1; valid && k < len; ++k) {
      valid = IsByte(tokens[i + k]) && (tokens[i + k] & 0xC0) == 0x80;
    }
    if (valid) {
      for (int k = 0; k < len; ++k) out.push_back(static_cast<char>(tokens[i + k]));
      i += len;
    } else {
      absl::StrAppend(&out, absl::StrFormat("\\x%02x", b));
      ++i;
    }
  }
  return out;
}

}  // namespace kvrelay::gateway
