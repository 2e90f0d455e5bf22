#pragma once

// The byte tokenizer of the tiny demo models behind the Tokenizer interface: every byte of the
// UTF-8 text is one id in [0, 256); decoding gives the bytes back (ids of a 512-token test
// model's upper half have no text and are InvalidArgument). Same ids as gateway/tokenizer's
// EncodeBytes, so callers can switch to the interface without changing a single token.

#include "tokenizer/tokenizer.h"

namespace kvrelay::tokenizer {

class ByteTokenizer final : public Tokenizer {
 public:
  using Tokenizer::Decode;
  using Tokenizer::Encode;
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              const EncodeOptions& options) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     const DecodeOptions& options) const override;
  int32_t vocab_size() const override { return 256; }
  std::string name() const override { return "byte"; }
};

}  // namespace kvrelay::tokenizer
