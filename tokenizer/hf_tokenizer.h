#pragma once

// A Hugging Face tokenizer loaded from tokenizer.json (+ tokenizer_config.json): the BPE family
// that serving models use — byte-level BPE (Llama 3, Qwen 2/3, DeepSeek V3: regex split +
// GPT-2 byte mapping) and SentencePiece-style BPE with byte fallback (Llama 2, Gemma: "▁" for
// spaces, <0xNN> tokens for bytes outside the vocabulary). Encode and decode follow the
// reference transformers.js (@lenml/tokenizers) step for step, which the golden tests check:
//   added-token split (leftmost-longest over all added tokens, lstrip/rstrip) -> per section:
//   normalizer -> pre-tokenizer -> BPE (merge ranks, ties leftmost; ignore_merges; byte
//   fallback; fuse_unk) -> post-processor (TemplateProcessing, ByteLevel) -> ids.
//   decode: ids -> tokens (skip specials) -> decoder chain (ByteLevel, Replace, ByteFallback,
//   Fuse, Strip) -> clean_up_tokenization_spaces.
// Components outside this set (WordPiece, Unigram, Metaspace, BERT normalizers, ...) make Load
// fail with Unimplemented naming the component; nothing is silently approximated.
//
// Immutable after Load; thread-safe. See README.md for the supported subset.

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kvrelay::tokenizer {

class HfTokenizer final : public Tokenizer {
 public:
  // `tokenizer_json` is the content of tokenizer.json; `config_json` that of
  // tokenizer_config.json or empty (defaults as the reference: clean-up on, no template).
  // `name` labels messages.
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> FromJson(std::string_view tokenizer_json,
                                                               std::string_view config_json,
                                                               std::string name);
  // A directory, or a tokenizer.json / tokenizer.json.gz path; see LoadTokenizer.
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> Load(const std::string& path);

  ~HfTokenizer() override;

  using Tokenizer::Decode;
  using Tokenizer::Encode;
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              const EncodeOptions& options) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     const DecodeOptions& options) const override;
  absl::StatusOr<std::string> ApplyChatTemplate(absl::Span<const ChatMessage> messages,
                                                bool add_generation_prompt) const override;
  int32_t vocab_size() const override;
  std::optional<int32_t> bos_id() const override;
  std::optional<int32_t> eos_id() const override;
  std::string name() const override;

  // The id of a token string (vocabulary or added token), if any.
  std::optional<int32_t> TokenToId(std::string_view token) const;

  struct Impl;

 private:
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrelay::tokenizer
