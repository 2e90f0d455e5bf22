#include "tokenizer/chat_template.h"

#include "absl/strings/str_cat.h"
#include "tokenizer/unicode.h"

namespace kvrelay::tokenizer {
namespace {

absl::Status CheckRole(const ChatMessage& m, size_t index) {
  if (m.role == "system" || m.role == "user" || m.role == "assistant") return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "messages[", index, "].role must be system, user or assistant, got '", m.role, "'"));
}

// Jinja's `| trim` (Python str.strip) on the texts of these tests; JavaScript's set, as the
// reference renders it.
std::string Trim(std::string_view s) { return std::string(TrimJsWhitespace(s, true, true)); }

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::Recognise(std::string_view t, std::string bos_token) {
  const bool has_generation_switch = (t.find("add_generation_prompt") != std::string_view::npos);
  if ((t.find("<|start_header_id|>") != std::string_view::npos)) {
    return ChatTemplate(ChatFormat::kLlama3, std::move(bos_token), !has_generation_switch);
  }
  if ((t.find("<｜User｜>") != std::string_view::npos)) {
    return ChatTemplate(ChatFormat::kDeepSeek, std::move(bos_token), false);
  }
  if ((t.find("<|im_start|>") != std::string_view::npos)) {
    return ChatTemplate(ChatFormat::kChatMl, std::move(bos_token), false);
  }
  if ((t.find("<start_of_turn>") != std::string_view::npos)) {
    return ChatTemplate(ChatFormat::kGemma, std::move(bos_token), false);
  }
  return absl::UnimplementedError(
      "chat_template is not one of the supported families (Llama 3, DeepSeek V3, ChatML, "
      "Gemma); see tokenizer/README.md");
}

absl::StatusOr<std::string> ChatTemplate::Render(absl::Span<const ChatMessage> messages,
                                                 bool add_generation_prompt) const {
  if (messages.empty()) return absl::InvalidArgumentError("messages must not be empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    if (absl::Status s = CheckRole(messages[i], i); !s.ok()) return s;
  }
  const bool generate = add_generation_prompt || always_generation_prompt_;
  std::string out;
  switch (format_) {
    case ChatFormat::kLlama3:
      out = bos_token_;
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|start_header_id|>", m.role, "<|end_header_id|>\n\n",
                        Trim(m.content), "<|eot_id|>");
      }
      if (generate) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      return out;
    case ChatFormat::kDeepSeek: {
      std::string system;
      bool first_system = true;
      for (const ChatMessage& m : messages) {
        if (m.role != "system") continue;
        absl::StrAppend(&system, first_system ? "" : "\n\n", m.content);
        first_system = false;
      }
      out = absl::StrCat(bos_token_, system);
      for (const ChatMessage& m : messages) {
        if (m.role == "user") absl::StrAppend(&out, "<｜User｜>", m.content);
        if (m.role == "assistant") {
          absl::StrAppend(&out, "<｜Assistant｜>", m.content, "<｜end▁of▁sentence｜>");
        }
      }
      if (generate) out += "<｜Assistant｜>";
      return out;
    }
    case ChatFormat::kChatMl:
      for (const ChatMessage& m : messages) {
        absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
      }
      if (generate) out += "<|im_start|>assistant\n";
      return out;
    case ChatFormat::kGemma: {
      out = bos_token_;
      std::string first_user_prefix;
      size_t begin = 0;
      if (messages[0].role == "system") {
        first_user_prefix = absl::StrCat(messages[0].content, "\n\n");
        begin = 1;
      }
      for (size_t i = begin; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        const bool expect_user = (i - begin) % 2 == 0;
        if ((m.role == "user") != expect_user || m.role == "system") {
          return absl::InvalidArgumentError(
              absl::StrCat("messages[", i,
                           "]: Gemma conversations must alternate user/assistant after an "
                           "optional first system message, got role '",
                           m.role, "'"));
        }
        absl::StrAppend(&out, "<start_of_turn>", m.role == "assistant" ? "model" : m.role, "\n",
                        i == begin ? first_user_prefix : "", Trim(m.content), "<end_of_turn>\n");
      }
      if (generate) out += "<start_of_turn>model\n";
      return out;
    }
  }
  return absl::InternalError("unknown chat format");
}

}  // namespace kvrelay::tokenizer
