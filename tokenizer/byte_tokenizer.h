#pragma once

// The byte tokenizer of the tiny demo models behind the Tokenizer interface: every byte of the
// UTF-8 text is one id in [0, 256); decoding gives the bytes back (ids of a 512-token test
// model's upper half have no text and are InvalidArgument). Its chat template is the demo
// models' plain one: "<|role|>\ncontent\n" per message, then "<|assistant|>\n".
//
// Stateless; thread-safe.

#include <cstdint>
#include <string>

#include "absl/types/span.h"
#include "tokenizer/tokenizer.h"

namespace kvrelay::tokenizer {

inline constexpr int32_t kByteVocabSize = 256;

class ByteTokenizer final : public Tokenizer {
 public:
  using Tokenizer::Decode;
  using Tokenizer::Encode;
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              const EncodeOptions& options) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     const DecodeOptions& options) const override;
  absl::StatusOr<std::string> ApplyChatTemplate(absl::Span<const ChatMessage> messages,
                                                bool add_generation_prompt) const override;
  int32_t vocab_size() const override { return kByteVocabSize; }
  std::string name() const override { return "byte"; }
};

// Printable rendering of byte-tokenizer ids for a terminal: printable ASCII and valid UTF-8
// sequences as they are, \n and \t as they are, other bytes as \xNN, ids outside [0, 256) as
// <id>. Never fails.
std::string DecodeBytesForDisplay(absl::Span<const int32_t> ids);

}  // namespace kvrelay::tokenizer
