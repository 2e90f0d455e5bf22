#include <cstdio>
#include <iostream>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "nlohmann/json.hpp"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tools/command.h"

namespace kvrelay::tokenizer::tools {
namespace {

int Fail(const absl::Status& s) { return CommandFailed("tokenize", s); }

}  // namespace

int RunTokenizeCommand(const std::vector<std::string>& args) {
  std::string spec = "byte", text, ids_text, user, system;
  bool no_special = false, generation_prompt = true, skip_special = false;
  FlagSet flags("tokenize",
                "Encodes text (or a one-turn chat prompt) to token ids, or decodes ids, with a "
                "model's tokenizer.json.");
  flags.AddString("tokenizer", &spec,
                  "byte, or a directory holding tokenizer.json[.gz] (+ tokenizer_config.json), "
                  "or the file itself");
  flags.AddString("text", &text, "text to encode");
  flags.AddString("ids", &ids_text, "ids to decode, comma-separated");
  flags.AddString("user", &user, "encode a chat prompt with this user message");
  flags.AddString("system", &system, "system message of the chat prompt (with --user)");
  flags.AddBool("no-special-tokens", &no_special, "with --text: add no BOS/EOS");
  flags.AddBool("generation-prompt", &generation_prompt,
                "with --user: end with the assistant's header");
  flags.AddBool("skip-special-tokens", &skip_special, "with --ids: leave special tokens out");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  const int modes = flags.WasSet("text") + flags.WasSet("ids") + flags.WasSet("user");
  if (modes != 1)
    return Fail(absl::InvalidArgumentError("give exactly one of --text, --ids, --user"));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(spec);
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  nlohmann::json out = {{"tokenizer", (*tokenizer)->name()}};
  if (flags.WasSet("ids")) {
    std::vector<int32_t> ids;
    for (absl::string_view part : absl::StrSplit(ids_text, ',', absl::SkipWhitespace())) {
      int32_t id;
      if (!absl::SimpleAtoi(part, &id)) {
        return Fail(absl::InvalidArgumentError(absl::StrCat("--ids: '", part, "' is not an id")));
      }
      ids.push_back(id);
    }
    absl::StatusOr<std::string> decoded =
        (*tokenizer)->Decode(ids, {.skip_special_tokens = skip_special});
    if (!decoded.ok()) return Fail(decoded.status());
    out["text"] = *decoded;
  } else {
    std::string input = text;
    bool add_special = !no_special;
    if (flags.WasSet("user")) {
      std::vector<ChatMessage> messages;
      if (!system.empty()) messages.push_back({"system", system});
      messages.push_back({"user", user});
      absl::StatusOr<std::string> prompt =
          (*tokenizer)->ApplyChatTemplate(messages, generation_prompt);
      if (!prompt.ok()) return Fail(prompt.status());
      input = *prompt;
      add_special = false;  // the template already holds BOS
      out["prompt"] = input;
    }
    absl::StatusOr<std::vector<int32_t>> ids =
        (*tokenizer)->Encode(input, {.add_special_tokens = add_special});
    if (!ids.ok()) return Fail(ids.status());
    out["ids"] = *ids;
  }
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace kvrelay::tokenizer::tools
