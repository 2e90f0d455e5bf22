#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "tokenizer/byte_tokenizer.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/hf_tokenizer.h"
#include "tokenizer/js_regex.h"
#include "tokenizer/unicode.h"

namespace kvrelay::tokenizer {
namespace {

using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Pieces = std::vector<std::string>;

Pieces Split(const JsRegex& re, std::string_view text) {
  Pieces out;
  for (auto [b, e] : re.FindAll(text)) out.emplace_back(text.substr(b, e - b));
  return out;
}

TEST(UnicodeTest, LossyDecodingFollowsWhatwg) {
  EXPECT_EQ(DecodeUtf8Lossy("abc"), "abc");
  EXPECT_EQ(DecodeUtf8Lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");  // truncated emoji: one
  EXPECT_EQ(DecodeUtf8Lossy("\xF0\x9F\x98"
                            "a"),
            "\xEF\xBF\xBD"
            "a");                                                      // U+FFFD, then 'a'
  EXPECT_EQ(DecodeUtf8Lossy("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong: two
  EXPECT_EQ(DecodeUtf8Lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(DecodeUtf8Lossy("\xEF\xBB\xBFx", /*strip_bom=*/true), "x");
  EXPECT_EQ(DecodeUtf8Lossy("\xEF\xBB\xBFx", /*strip_bom=*/false), "\xEF\xBB\xBFx");
}

TEST(UnicodeTest, ValidationNamesTheOffset) {
  EXPECT_THAT(ValidateUtf8("ok \xE6\x97\xA5"), IsOk());
  EXPECT_THAT(ValidateUtf8("ab\xFF"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("byte offset 2")));
  EXPECT_EQ(TrimJsWhitespace("\xE3\x80\x80 x\xC2\xA0", true, true), "x");  // U+3000, U+00A0
}

TEST(JsRegexTest, LookaheadGivesBackTheLastWhitespace) {
  auto re = JsRegex::Compile(R"( ?\p{L}+|\s+(?!\S)|\s+)");
  ASSERT_THAT(re, IsOk());
  // "   hello": the run keeps two spaces, the third starts " hello".
  EXPECT_THAT(Split(**re, "a   hello"), ElementsAre("a", "  ", " hello"));
  EXPECT_THAT(Split(**re, "a hello"), ElementsAre("a", " hello"));
  EXPECT_THAT(Split(**re, "a   "), ElementsAre("a", "   "));  // run at the end
  EXPECT_THAT(Split(**re, "a\t1"), ElementsAre("a", "\t"));   // one char: \s+ takes it
  // Multi-byte whitespace (U+3000) is given back whole; " ?" takes only an ASCII space, so the
  // given-back U+3000 stands alone.
  EXPECT_THAT(Split(**re,
                    "a\xE3\x80\x80\xE3\x80\x80"
                    "b"),
              ElementsAre("a", "\xE3\x80\x80", "\xE3\x80\x80", "b"));
}

TEST(JsRegexTest, BackslashSIsJavaScriptWhitespace) {
  auto re = JsRegex::Compile(R"(\s+|[^\s]+)");
  ASSERT_THAT(re, IsOk());
  EXPECT_THAT(Split(**re,
                    "a\xC2\xA0"
                    "b"),
              ElementsAre("a", "\xC2\xA0", "b"));  // U+00A0
}

TEST(JsRegexTest, CaseInsensitiveContractionsAreRewrittenLikeTheReference) {
  auto re = JsRegex::Compile(R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{L}+)");
  ASSERT_THAT(re, IsOk());
  EXPECT_THAT(Split(**re, "it'S"), ElementsAre("it", "'S"));
}

TEST(JsRegexTest, UnsupportedLookaroundIsRefused) {
  EXPECT_THAT(JsRegex::Compile(R"(a(?=b))"), StatusIs(absl::StatusCode::kUnimplemented));
  EXPECT_THAT(JsRegex::Compile(R"(\p{Nope})"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ByteTokenizerTest, OneIdPerByte) {
  ByteTokenizer t;
  auto ids = t.Encode("h\xC3\xA9");
  ASSERT_THAT(ids, IsOk());
  EXPECT_THAT(*ids, ElementsAre('h', 0xC3, 0xA9));
  EXPECT_EQ(*t.Decode(*ids), "h\xC3\xA9");
  EXPECT_THAT(t.Decode({1, 300}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("300 at position 1")));
  EXPECT_THAT(t.Decode({-1}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(t.Encode("")->empty());
  EXPECT_EQ(t.vocab_size(), 256);
}

TEST(ByteTokenizerTest, RoundTripsUtf8) {
  ByteTokenizer t;
  const std::string text = "h\xC3\xA9llo, w\xC3\xB6rld \xF0\x9F\x99\x82\n";
  KV_ASSERT_OK_AND_ASSIGN(std::vector<int32_t> ids, t.Encode(text));
  EXPECT_EQ(ids.size(), text.size());
  EXPECT_EQ(t.Encode("\xff")->at(0), 255);
  EXPECT_EQ(*t.Decode(ids), text);
  EXPECT_EQ(DecodeBytesForDisplay(ids), text);
}

TEST(ByteTokenizerTest, DisplayEscapesWhatIsNotText) {
  // 0x01 control byte, a lone continuation byte, a truncated 2-byte sequence, an id >= 256.
  EXPECT_EQ(DecodeBytesForDisplay({'a', 0x01, 0x80, 'b', 0xC3, 'c', 511}),
            "a\\x01\\x80b\\xc3c<511>");
}

// The demo models' chat format (the OpenAI HTTP API's /v1/chat/completions uses it for them).
TEST(ByteTokenizerTest, PlainChatTemplate) {
  ByteTokenizer t;
  EXPECT_EQ(*t.ApplyChatTemplate({{"system", "S"}, {"user", "U"}}, true),
            "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n");
  EXPECT_EQ(*t.ApplyChatTemplate({{"user", "U"}}, false), "<|user|>\nU\n");
}

// A tiny hand-written tokenizer.json: byte-level BPE over "ab" with one merge.
constexpr std::string_view kTinyByteLevel = R"({
  "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "c": 4},
            "merges": ["a b"]},
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
  "decoder": {"type": "ByteLevel"},
  "added_tokens": [{"id": 5, "content": "<eos>", "special": true}]
})";

TEST(HfTokenizerTest, TinyByteLevelEncodesAndDecodes) {
  auto t = HfTokenizer::FromJson(kTinyByteLevel, "", "tiny");
  ASSERT_THAT(t, IsOk());
  auto ids = (*t)->Encode("ab ab<eos>");
  ASSERT_THAT(ids, IsOk());
  EXPECT_THAT(*ids, ElementsAre(2, 3, 2, 5));
  EXPECT_EQ(*(*t)->Decode(*ids), "ab ab<eos>");
  EXPECT_EQ(*(*t)->Decode(*ids, {.skip_special_tokens = true}), "ab ab");
  EXPECT_EQ((*t)->vocab_size(), 6);
}

TEST(HfTokenizerTest, BadInputIsRefusedWithAClearStatus) {
  auto t = HfTokenizer::FromJson(kTinyByteLevel, "", "tiny");
  ASSERT_THAT(t, IsOk());
  EXPECT_THAT((*t)->Encode("a\xFF"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("UTF-8 at byte offset 1")));
  // 'z' has no token and there is no unk_token.
  EXPECT_THAT((*t)->Encode("z"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot represent")));
  EXPECT_THAT((*t)->Decode({0, 6}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id 6 at position 1")));
  EXPECT_THAT((*t)->Decode({-1}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT((*t)->ApplyChatTemplate({{"user", "x"}}, true),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("no chat_template")));
}

TEST(HfTokenizerTest, MalformedOrUnsupportedFilesAreRefused) {
  EXPECT_THAT(HfTokenizer::FromJson("{not json", "", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a JSON object")));
  EXPECT_THAT(HfTokenizer::FromJson(R"({"model": {"type": "WordPiece", "vocab": {}}})", "", "x"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("WordPiece")));
  EXPECT_THAT(HfTokenizer::FromJson(R"({"model": {"type": "BPE", "vocab": {"a": "x"},
                                      "merges": []}})",
                                    "", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.vocab['a']")));
  EXPECT_THAT(HfTokenizer::FromJson(R"({"model": {"type": "BPE", "vocab": {"a": 0},
                                      "merges": [7]}})",
                                    "", "x"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("merges[0]")));
  EXPECT_THAT(HfTokenizer::FromJson(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                                      "normalizer": {"type": "BertNormalizer"}})",
                                    "", "x"),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("BertNormalizer")));
  EXPECT_THAT(LoadTokenizer("/nonexistent/dir"), StatusIs(absl::StatusCode::kNotFound));
  auto byte = LoadTokenizer("byte");
  ASSERT_THAT(byte, IsOk());
  EXPECT_EQ((*byte)->name(), "byte");
}

TEST(ChatTemplateTest, UnknownFamiliesAndRolesAreRefused) {
  EXPECT_THAT(ChatTemplate::Recognise("{{ messages }}", ""),
              StatusIs(absl::StatusCode::kUnimplemented));
  auto chatml = ChatTemplate::Recognise("{{'<|im_start|>' + message.role}}", "");
  ASSERT_THAT(chatml, IsOk());
  EXPECT_EQ(*chatml->Render({{"system", "S"}, {"user", "U"}}, true),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_THAT(chatml->Render({{"tool", "x"}}, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("messages[0].role")));
  EXPECT_THAT(chatml->Render({}, true), StatusIs(absl::StatusCode::kInvalidArgument));
  auto gemma = ChatTemplate::Recognise("<start_of_turn>", "<bos>");
  ASSERT_THAT(gemma, IsOk());
  EXPECT_EQ(*gemma->Render({{"system", "S"}, {"user", " U "}}, true),
            "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_THAT(gemma->Render({{"user", "a"}, {"user", "b"}}, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("alternate")));
}

}  // namespace
}  // namespace kvrelay::tokenizer
