#include "tokenizer/byte_tokenizer.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvrelay::tokenizer {
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

absl::StatusOr<std::vector<int32_t>> ByteTokenizer::Encode(std::string_view text,
                                                           const EncodeOptions&) const {
  if (text.size() > kMaxEncodeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("text is ", text.size(), " bytes, more than the limit ", kMaxEncodeBytes));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

absl::StatusOr<std::string> ByteTokenizer::Decode(absl::Span<const int32_t> ids,
                                                  const DecodeOptions&) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!IsByte(ids[i])) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " at position ", i,
                                                     " is outside the byte vocabulary [0, 256)"));
    }
    text.push_back(static_cast<char>(ids[i]));
  }
  return text;
}

absl::StatusOr<std::string> ByteTokenizer::ApplyChatTemplate(absl::Span<const ChatMessage> messages,
                                                             bool add_generation_prompt) const {
  std::string text;
  for (const ChatMessage& m : messages)
    absl::StrAppend(&text, "<|", m.role, "|>\n", m.content, "\n");
  if (add_generation_prompt) absl::StrAppend(&text, "<|assistant|>\n");
  return text;
}

std::string DecodeBytesForDisplay(absl::Span<const int32_t> ids) {
  std::string out;
  size_t i = 0;
  while (i < ids.size()) {
    const int32_t id = ids[i];
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
    bool valid = len > 1 && i + len <= ids.size();
    for (int k = 1; valid && k < len; ++k) {
      valid = IsByte(ids[i + k]) && (ids[i + k] & 0xC0) == 0x80;
    }
    if (valid) {
      for (int k = 0; k < len; ++k) out.push_back(static_cast<char>(ids[i + k]));
      i += len;
    } else {
      absl::StrAppend(&out, absl::StrFormat("\\x%02x", b));
      ++i;
    }
  }
  return out;
}

}  // namespace kvrelay::tokenizer
