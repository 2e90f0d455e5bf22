#pragma once

// Chat prompts without a Jinja engine: the chat_template of tokenizer_config.json is recognised
// by the role markers it contains and rendered by a fixed C++ formatter for that family. The
// supported subset (plain string contents, roles system/user/assistant, no tools, no images):
//   kLlama3    <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT(trimmed)<|eot_id|>, BOS first;
//              the assistant header at the end (always, if the template has no
//              add_generation_prompt switch, as Llama 3's own template does)
//   kDeepSeek  BOS SYSTEM(s joined by \n\n) <｜User｜>C <｜Assistant｜>C<｜end▁of▁sentence｜> ...,
//              <｜Assistant｜> as the generation prompt
//   kChatMl    <|im_start|>ROLE\nCONTENT<|im_end|>\n (Qwen); <|im_start|>assistant\n to generate
//              (no <think> handling of earlier assistant turns)
//   kGemma     BOS <start_of_turn>user\n(SYSTEM\n\n)CONTENT(trimmed)<end_of_turn>\n, assistant is
//              "model", roles must alternate; <start_of_turn>model\n to generate
// Anything else is Unimplemented at load time of the template (never a guessed format).

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tokenizer/tokenizer.h"

namespace kvrelay::tokenizer {

enum class ChatFormat { kLlama3, kDeepSeek, kChatMl, kGemma };

class ChatTemplate {
 public:
  // Recognises `jinja_template`; `bos_token` is the text of the BOS token ("" if none).
  static absl::StatusOr<ChatTemplate> Recognise(std::string_view jinja_template,
                                                std::string bos_token);

  // InvalidArgument for an unknown role, a message order the format forbids, or no messages.
  absl::StatusOr<std::string> Render(absl::Span<const ChatMessage> messages,
                                     bool add_generation_prompt) const;

  ChatFormat format() const { return format_; }

 private:
  ChatTemplate(ChatFormat format, std::string bos_token, bool always_generation_prompt)
      : format_(format),
        bos_token_(std::move(bos_token)),
        always_generation_prompt_(always_generation_prompt) {}

  ChatFormat format_;
  std::string bos_token_;
  bool always_generation_prompt_;
};

}  // namespace kvrelay::tokenizer
