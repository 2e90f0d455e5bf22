#pragma once

// The one tokenizer interface text goes through: a model's real tokenizer (HfTokenizer, loaded
// from tokenizer.json) or the byte tokenizer of the tiny demo models (ByteTokenizer). The ids
// it produces are the ids the model sees and the ids prefix hashing runs on, so whoever serves
// a model must use that model's tokenizer.
//
// Implementations are immutable after loading; every method is const and thread-safe.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvrelay::tokenizer {

// Largest text Encode accepts (bytes); longer input is InvalidArgument.
inline constexpr size_t kMaxEncodeBytes = 64 << 20;

struct EncodeOptions {
  // Add what the tokenizer's post-processor adds (e.g. Gemma's <bos>), as Hugging Face's
  // `add_special_tokens=True` does.
  bool add_special_tokens = true;
};

struct DecodeOptions {
  // Leave special tokens (<bos>, <|eot_id|>, ...) out of the text.
  bool skip_special_tokens = false;
};

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text` (valid UTF-8, at most kMaxEncodeBytes). InvalidArgument names the byte
  // offset of invalid UTF-8.
  virtual absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                                      const EncodeOptions& options) const = 0;
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text) const {
    return Encode(text, EncodeOptions{});
  }

  // Text of `ids`; InvalidArgument names the first id outside the vocabulary. Ids that end in
  // the middle of a UTF-8 sequence decode to U+FFFD, as the reference implementations do.
  virtual absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                             const DecodeOptions& options) const = 0;
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids) const {
    return Decode(ids, DecodeOptions{});
  }

  // The prompt text a chat model expects for `messages` (role markers, BOS); see
  // chat_template.h for the supported subset. Unimplemented when the tokenizer has no template.
  virtual absl::StatusOr<std::string> ApplyChatTemplate(absl::Span<const ChatMessage> messages,
                                                        bool add_generation_prompt) const;

  // One more than the largest id Encode can return or Decode accepts.
  virtual int32_t vocab_size() const = 0;
  virtual std::optional<int32_t> bos_id() const { return std::nullopt; }
  virtual std::optional<int32_t> eos_id() const { return std::nullopt; }
  // For messages and logs: "byte" or the path it was loaded from.
  virtual std::string name() const = 0;
};

// "byte" (or empty) gives the byte tokenizer; anything else is a path: a directory holding
// tokenizer.json (or tokenizer.json.gz) and optionally tokenizer_config.json, or the path of a
// tokenizer.json[.gz] itself (its tokenizer_config.json is looked up beside it).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(std::string_view spec);

}  // namespace kvrelay::tokenizer
