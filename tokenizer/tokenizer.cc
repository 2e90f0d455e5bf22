#include "tokenizer/tokenizer.h"

#include "absl/strings/str_cat.h"
#include "tokenizer/byte_tokenizer.h"
#include "tokenizer/hf_tokenizer.h"

namespace kvrelay::tokenizer {

absl::StatusOr<std::string> Tokenizer::ApplyChatTemplate(absl::Span<const ChatMessage>,
                                                         bool) const {
  return absl::UnimplementedError(
      absl::StrCat("tokenizer ", name(), " has no chat template; send a plain prompt"));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(std::string_view spec) {
  if (spec.empty() || spec == "byte") return std::unique_ptr<Tokenizer>(new ByteTokenizer());
  absl::StatusOr<std::unique_ptr<HfTokenizer>> hf = HfTokenizer::Load(std::string(spec));
  if (!hf.ok()) return hf.status();
  return std::unique_ptr<Tokenizer>(*std::move(hf));
}

}  // namespace kvrelay::tokenizer
