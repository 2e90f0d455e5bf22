#include "tokenizer/byte_tokenizer.h"

#include "absl/strings/str_cat.h"

namespace kvrelay::tokenizer {

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
    if (ids[i] < 0 || ids[i] >= 256) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " at position ", i,
                                                     " is outside the byte vocabulary [0, 256)"));
    }
    text.push_back(static_cast<char>(ids[i]));
  }
  return text;
}

}  // namespace kvrelay::tokenizer
