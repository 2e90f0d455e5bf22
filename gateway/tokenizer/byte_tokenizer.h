#pragma once

// Byte-level tokenizer for the demo and the CLI: each byte of the UTF-8 text is one token id in
// [0, 256). The tiny test models have a vocabulary of 512, so every text encodes to valid ids;
// ids >= 256 (which a random-weight model may still generate) have no text and are shown as
// `<id>`.
//
// Stateless; thread-safe.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvrelay::gateway {

inline constexpr int32_t kByteVocabSize = 256;

// One token per byte. Never fails; an empty text gives no tokens.
std::vector<int32_t> EncodeBytes(std::string_view text);

// The bytes of `tokens`; InvalidArgument naming the first id outside [0, 256).
absl::StatusOr<std::string> DecodeBytes(absl::Span<const int32_t> tokens);

// Printable rendering for a terminal: printable ASCII and valid UTF-8 sequences as they are,
// \n and \t as they are, other bytes as \xNN, ids >= 256 (or negative) as <id>.
std::string DecodeForDisplay(absl::Span<const int32_t> tokens);

}  // namespace kvrelay::gateway
