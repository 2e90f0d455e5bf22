#include "tokenizer/hf_tokenizer.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <functional>
#include <queue>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "tokenizer/js_regex.h"
#include "tokenizer/unicode.h"
#include "unicode/normalizer2.h"
#include "unicode/unistr.h"

namespace kvrelay::tokenizer {
namespace {

using Json = nlohmann::json;

// Heterogeneous lookups in Abseil's string maps take absl::string_view (not std's here).
absl::string_view Key(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Unsupported(std::string_view what, const Json& node) {
  const std::string type = node.is_object() && node.contains("type") && node["type"].is_string()
                               ? node["type"].get<std::string>()
                               : node.dump().substr(0, 80);
  return absl::UnimplementedError(
      absl::StrCat(std::string(what), " '", type, "' is not supported"));
}

// tokenizer.json fields are read only through these: a wrong type is InvalidArgument naming the
// field, never a nlohmann exception.
absl::StatusOr<std::string> GetString(const Json& node, std::string_view key) {
  auto it = node.find(key);
  if (it == node.end() || !it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("field '", std::string(key), "' must be a string"));
  }
  return it->get<std::string>();
}

bool GetBool(const Json& node, std::string_view key, bool fallback) {
  auto it = node.find(key);
  return it != node.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

// ---------------------------------------------------------------------------------------------
// GPT-2's byte <-> printable code point mapping (bytes_to_unicode).
struct ByteMap {
  std::array<std::string, 256> byte_to_text;
  absl::flat_hash_map<char32_t, uint8_t> code_point_to_byte;
  ByteMap() {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::array<char32_t, 256> cs{};
    std::vector<bool> direct(256, false);
    for (int b : bs) direct[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) cs[b] = direct[b] ? b : 256 + n++;
    for (int b = 0; b < 256; ++b) {
      AppendUtf8(cs[b], &byte_to_text[b]);
      code_point_to_byte[cs[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteMap& Bytes() {
  static const ByteMap* map = new ByteMap();
  return *map;
}

// ---------------------------------------------------------------------------------------------
// Normalizers.
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual absl::StatusOr<std::string> Normalize(std::string text) const = 0;
};
using NormalizerPtr = std::unique_ptr<Normalizer>;

class NfcNormalizer final : public Normalizer {
 public:
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
    if (U_FAILURE(status)) return absl::InternalError("ICU NFC normalizer is unavailable");
    icu::UnicodeString in =
        icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), text.size()));
    icu::UnicodeString normalized = nfc->normalize(in, status);
    if (U_FAILURE(status)) return absl::InternalError("ICU NFC normalization failed");
    std::string out;
    normalized.toUTF8String(out);
    return out;
  }
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::string pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    return absl::StrReplaceAll(text, {{pattern_, content_}});
  }

 private:
  std::string pattern_, content_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend) : prepend_(std::move(prepend)) {}
  absl::StatusOr<std::string> Normalize(std::string text) const override { return prepend_ + text; }

 private:
  std::string prepend_;
};

class NormalizerSequence final : public Normalizer {
 public:
  explicit NormalizerSequence(std::vector<NormalizerPtr> parts) : parts_(std::move(parts)) {}
  absl::StatusOr<std::string> Normalize(std::string text) const override {
    for (const NormalizerPtr& n : parts_) {
      KV_ASSIGN_OR_RETURN(text, n->Normalize(std::move(text)));
    }
    return text;
  }

 private:
  std::vector<NormalizerPtr> parts_;
};

absl::StatusOr<std::string> StringPattern(const Json& node, std::string_view what) {
  auto it = node.find("pattern");
  if (it == node.end() || !it->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), " needs a 'pattern' object"));
  }
  if (it->contains("String")) return GetString(*it, "String");
  return absl::UnimplementedError(
      absl::StrCat(std::string(what), " with a Regex pattern is not supported (only String)"));
}

absl::StatusOr<NormalizerPtr> MakeNormalizer(const Json& node) {
  if (node.is_null()) return NormalizerPtr();
  KV_ASSIGN_OR_RETURN(const std::string type, GetString(node, "type"));
  if (type == "NFC") return NormalizerPtr(std::make_unique<NfcNormalizer>());
  if (type == "Replace") {
    KV_ASSIGN_OR_RETURN(std::string pattern, StringPattern(node, "Replace normalizer"));
    KV_ASSIGN_OR_RETURN(std::string content, GetString(node, "content"));
    if (pattern.empty()) return absl::InvalidArgumentError("Replace pattern is empty");
    return NormalizerPtr(std::make_unique<ReplaceNormalizer>(pattern, content));
  }
  if (type == "Prepend") {
    KV_ASSIGN_OR_RETURN(std::string prepend, GetString(node, "prepend"));
    return NormalizerPtr(std::make_unique<PrependNormalizer>(prepend));
  }
  if (type == "Sequence") {
    auto it = node.find("normalizers");
    if (it == node.end() || !it->is_array()) {
      return absl::InvalidArgumentError("Sequence normalizer needs a 'normalizers' array");
    }
    std::vector<NormalizerPtr> parts;
    for (const Json& part : *it) {
      KV_ASSIGN_OR_RETURN(NormalizerPtr n, MakeNormalizer(part));
      if (n) parts.push_back(std::move(n));
    }
    return NormalizerPtr(std::make_unique<NormalizerSequence>(std::move(parts)));
  }
  return Unsupported("normalizer", node);
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers: each maps every piece to zero or more pieces.
class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void Split(std::string_view piece, std::vector<std::string>* out) const = 0;
  std::vector<std::string> Apply(const std::vector<std::string>& pieces) const {
    std::vector<std::string> out;
    for (const std::string& p : pieces) Split(p, &out);
    return out;
  }
};
using PreTokenizerPtr = std::unique_ptr<PreTokenizer>;

// Split with a regex or a literal. transformers.js honours only `invert` and the "Removed"
// behaviour; every other behaviour splits like "Isolated" (pieces between matches and the
// matches themselves), and so does this.
class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<JsRegex> regex, std::string literal, bool invert, bool removed)
      : regex_(std::move(regex)),
        literal_(std::move(literal)),
        invert_(invert),
        removed_(removed) {}
  void Split(std::string_view piece, std::vector<std::string>* out) const override {
    std::vector<std::pair<size_t, size_t>> matches;
    if (regex_) {
      matches = regex_->FindAll(piece);
    } else {
      for (size_t pos = piece.find(literal_); pos != std::string_view::npos;
           pos = piece.find(literal_, pos + literal_.size())) {
        matches.emplace_back(pos, pos + literal_.size());
      }
    }
    if (invert_) {
      for (auto [b, e] : matches) out->emplace_back(piece.substr(b, e - b));
      return;
    }
    size_t prev = 0;
    for (auto [b, e] : matches) {
      if (prev < b) out->emplace_back(piece.substr(prev, b - prev));
      if (!removed_) out->emplace_back(piece.substr(b, e - b));
      prev = e;
    }
    if (prev < piece.size()) out->emplace_back(piece.substr(prev));
  }

 private:
  std::unique_ptr<JsRegex> regex_;
  std::string literal_;
  bool invert_;
  bool removed_;
};

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<JsRegex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}
  void Split(std::string_view piece, std::vector<std::string>* out) const override {
    // (std::string::insert(0, ...) trips GCC 12's -Wrestrict false positive.)
    std::string text = add_prefix_space_ && !piece.starts_with(' ') ? absl::StrCat(" ", Key(piece))
                                                                    : std::string(piece);
    auto emit = [&](std::string_view part) {
      std::string mapped;
      mapped.reserve(part.size() * 2);
      for (unsigned char b : part) mapped += Bytes().byte_to_text[b];
      out->push_back(std::move(mapped));
    };
    if (!regex_) {
      emit(text);
      return;
    }
    for (auto [b, e] : regex_->FindAll(text)) emit(std::string_view(text).substr(b, e - b));
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<JsRegex> regex_;  // null when use_regex is false
};

class PreTokenizerSequence final : public PreTokenizer {
 public:
  explicit PreTokenizerSequence(std::vector<PreTokenizerPtr> parts) : parts_(std::move(parts)) {}
  void Split(std::string_view piece, std::vector<std::string>* out) const override {
    std::vector<std::string> pieces{std::string(piece)};
    for (const PreTokenizerPtr& p : parts_) pieces = p->Apply(pieces);
    for (std::string& p : pieces) out->push_back(std::move(p));
  }

 private:
  std::vector<PreTokenizerPtr> parts_;
};

absl::StatusOr<PreTokenizerPtr> MakePreTokenizer(const Json& node) {
  if (node.is_null()) return PreTokenizerPtr();
  KV_ASSIGN_OR_RETURN(const std::string type, GetString(node, "type"));
  if (type == "Sequence") {
    auto it = node.find("pretokenizers");
    if (it == node.end() || !it->is_array()) {
      return absl::InvalidArgumentError("Sequence pre-tokenizer needs a 'pretokenizers' array");
    }
    std::vector<PreTokenizerPtr> parts;
    for (const Json& part : *it) {
      KV_ASSIGN_OR_RETURN(PreTokenizerPtr p, MakePreTokenizer(part));
      if (p) parts.push_back(std::move(p));
    }
    return PreTokenizerPtr(std::make_unique<PreTokenizerSequence>(std::move(parts)));
  }
  if (type == "Split") {
    auto pattern = node.find("pattern");
    if (pattern == node.end() || !pattern->is_object()) {
      return absl::InvalidArgumentError("Split pre-tokenizer needs a 'pattern' object");
    }
    const bool invert = GetBool(node, "invert", false);
    std::string behavior = node.contains("behavior") && node["behavior"].is_string()
                               ? node["behavior"].get<std::string>()
                               : "";
    std::transform(behavior.begin(), behavior.end(), behavior.begin(), ::tolower);
    const bool removed = behavior == "removed";
    if (pattern->contains("Regex")) {
      KV_ASSIGN_OR_RETURN(std::string regex, GetString(*pattern, "Regex"));
      KV_ASSIGN_OR_RETURN(std::unique_ptr<JsRegex> compiled, JsRegex::Compile(regex));
      return PreTokenizerPtr(
          std::make_unique<SplitPreTokenizer>(std::move(compiled), "", invert, removed));
    }
    KV_ASSIGN_OR_RETURN(std::string literal, GetString(*pattern, "String"));
    if (literal.empty()) return absl::InvalidArgumentError("Split String pattern is empty");
    return PreTokenizerPtr(std::make_unique<SplitPreTokenizer>(nullptr, literal, invert, removed));
  }
  if (type == "ByteLevel") {
    std::unique_ptr<JsRegex> regex;
    if (GetBool(node, "use_regex", true)) {
      KV_ASSIGN_OR_RETURN(regex, JsRegex::Compile(kGpt2Pattern));
    }
    return PreTokenizerPtr(std::make_unique<ByteLevelPreTokenizer>(
        GetBool(node, "add_prefix_space", false), std::move(regex)));
  }
  return Unsupported("pre-tokenizer", node);
}

// ---------------------------------------------------------------------------------------------
// Decoders: each maps the token strings to new strings; the results are joined at the end.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const = 0;
};
using DecoderPtr = std::unique_ptr<Decoder>;

class ByteLevelDecoder final : public Decoder {
 public:
  explicit ByteLevelDecoder(const absl::flat_hash_set<std::string>* added_tokens)
      : added_tokens_(added_tokens) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    // Added tokens are copied as they are; runs of other tokens map code points back to bytes.
    std::vector<std::string> out;
    std::string bytes;
    bool have_run = false;
    auto flush = [&] {
      if (have_run) out.push_back(DecodeUtf8Lossy(bytes));
      bytes.clear();
      have_run = false;
    };
    for (std::string& token : tokens) {
      if (added_tokens_->contains(token)) {
        flush();
        out.push_back(std::move(token));
        continue;
      }
      have_run = true;
      size_t pos = 0;
      char32_t cp;
      while (pos < token.size() && NextCodePoint(token, &pos, &cp)) {
        auto it = Bytes().code_point_to_byte.find(cp);
        // transformers.js writes `undefined` into a Uint8Array, which stores 0.
        bytes.push_back(it == Bytes().code_point_to_byte.end() ? '\0'
                                                               : static_cast<char>(it->second));
      }
    }
    flush();
    return out;
  }

 private:
  const absl::flat_hash_set<std::string>* added_tokens_;  // owned by the tokenizer
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(std::string pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (std::string& t : tokens) t = absl::StrReplaceAll(t, {{pattern_, content_}});
    return tokens;
  }

 private:
  std::string pattern_, content_;
};

class ByteFallbackDecoder final : public Decoder {
 public:
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    std::vector<std::string> out;
    std::string bytes;
    auto flush = [&] {
      // TextDecoder() with its defaults: replacement, and a leading BOM is dropped.
      if (!bytes.empty()) out.push_back(DecodeUtf8Lossy(bytes, /*strip_bom=*/true));
      bytes.clear();
    };
    for (std::string& t : tokens) {
      int value = -1;
      if (Utf16Length(t) == 6 && absl::StartsWith(t, "<0x") && absl::EndsWith(t, ">")) {
        value = ParseHexPrefix(std::string_view(t).substr(3, 2));
      }
      if (value >= 0) {
        bytes.push_back(static_cast<char>(value));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    return out;
  }

 private:
  // parseInt(s, 16): the longest hex prefix, -1 (NaN) if none.
  static int ParseHexPrefix(std::string_view s) {
    int value = -1;
    for (char c : s) {
      int d;
      if (c >= '0' && c <= '9') {
        d = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        d = c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        d = c - 'A' + 10;
      } else {
        break;
      }
      value = (value < 0 ? 0 : value * 16) + d;
    }
    return value;
  }
};

class FuseDecoder final : public Decoder {
 public:
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    return {std::move(all)};
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(std::string content, int start, int stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (std::string& t : tokens) {
      std::string_view v = t;
      for (int i = 0; i < start_ && v.starts_with(content_); ++i) {
        v.remove_prefix(content_.size());
      }
      for (int i = 0; i < stop_ && v.ends_with(content_); ++i) {
        v.remove_suffix(content_.size());
      }
      t = std::string(v);
    }
    return tokens;
  }

 private:
  std::string content_;
  int start_, stop_;
};

class DecoderSequence final : public Decoder {
 public:
  explicit DecoderSequence(std::vector<DecoderPtr> parts) : parts_(std::move(parts)) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (const DecoderPtr& d : parts_) tokens = d->DecodeChain(std::move(tokens));
    return tokens;
  }

 private:
  std::vector<DecoderPtr> parts_;
};

absl::StatusOr<DecoderPtr> MakeDecoder(const Json& node,
                                       const absl::flat_hash_set<std::string>* added_tokens) {
  if (node.is_null()) return DecoderPtr();
  KV_ASSIGN_OR_RETURN(const std::string type, GetString(node, "type"));
  if (type == "ByteLevel") return DecoderPtr(std::make_unique<ByteLevelDecoder>(added_tokens));
  if (type == "ByteFallback") return DecoderPtr(std::make_unique<ByteFallbackDecoder>());
  if (type == "Fuse") return DecoderPtr(std::make_unique<FuseDecoder>());
  if (type == "Replace") {
    KV_ASSIGN_OR_RETURN(std::string pattern, StringPattern(node, "Replace decoder"));
    KV_ASSIGN_OR_RETURN(std::string content, GetString(node, "content"));
    if (pattern.empty()) return absl::InvalidArgumentError("Replace pattern is empty");
    return DecoderPtr(std::make_unique<ReplaceDecoder>(pattern, content));
  }
  if (type == "Strip") {
    KV_ASSIGN_OR_RETURN(std::string content, GetString(node, "content"));
    auto get_int = [&](const char* key) {
      auto it = node.find(key);
      return it != node.end() && it->is_number_integer() ? it->get<int>() : 0;
    };
    if (content.empty()) return absl::InvalidArgumentError("Strip decoder content is empty");
    return DecoderPtr(std::make_unique<StripDecoder>(content, get_int("start"), get_int("stop")));
  }
  if (type == "Sequence") {
    auto it = node.find("decoders");
    if (it == node.end() || !it->is_array()) {
      return absl::InvalidArgumentError("Sequence decoder needs a 'decoders' array");
    }
    std::vector<DecoderPtr> parts;
    for (const Json& part : *it) {
      KV_ASSIGN_OR_RETURN(DecoderPtr d, MakeDecoder(part, added_tokens));
      if (d) parts.push_back(std::move(d));
    }
    return DecoderPtr(std::make_unique<DecoderSequence>(std::move(parts)));
  }
  return Unsupported("decoder", node);
}

// ---------------------------------------------------------------------------------------------
// BPE.
constexpr int32_t kUnknownId = -1;  // a token with no id; becomes unk_token_id or an error

class BpeModel {
 public:
  // `token_to_id` includes the added tokens (the reference looks them up too); it must outlive
  // this model.
  static absl::StatusOr<std::unique_ptr<BpeModel>> Create(
      const Json& model, const absl::flat_hash_map<std::string, int32_t>* token_to_id) {
    auto m = std::unique_ptr<BpeModel>(new BpeModel(token_to_id));
    m->byte_fallback_ = GetBool(model, "byte_fallback", false);
    m->ignore_merges_ = GetBool(model, "ignore_merges", false);
    m->fuse_unk_ = GetBool(model, "fuse_unk", false);
    if (model.contains("dropout") && !model["dropout"].is_null()) {
      return absl::UnimplementedError("BPE dropout is not supported");
    }
    for (const char* key : {"end_of_word_suffix", "continuing_subword_suffix"}) {
      if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty()) {
        return absl::UnimplementedError(absl::StrCat("BPE ", key, " is not supported"));
      }
    }
    auto merges = model.find("merges");
    if (merges == model.end() || !merges->is_array()) {
      return absl::InvalidArgumentError("model.merges must be an array");
    }
    m->merges_.reserve(merges->size());
    int32_t rank = 0;
    for (const Json& merge : *merges) {
      std::string left, right;
      if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      } else if (merge.is_string()) {
        // Old format "a b": split(" ", 2) keeps the first two fields.
        const std::string s = merge.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) {
          return absl::InvalidArgumentError(
              absl::StrCat("model.merges[", rank, "] has no space: '", s, "'"));
        }
        left = s.substr(0, sp);
        const size_t sp2 = s.find(' ', sp + 1);
        right = s.substr(sp + 1, sp2 == std::string::npos ? std::string::npos : sp2 - sp - 1);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("model.merges[", rank, "] must be \"a b\" or [\"a\", \"b\"]"));
      }
      const int32_t l = m->Intern(left), r = m->Intern(right);
      const int32_t result = m->Intern(left + right);
      // A repeated pair takes its last rank, as the reference's Map built in order does.
      m->merges_.insert_or_assign(PairKey(l, r), Merge{rank, result});
      ++rank;
    }
    return m;
  }

  // Appends the ids of one pre-tokenized word; kUnknownId for unknown pieces.
  void EncodeWord(std::string_view word, std::vector<int32_t>* ids) const {
    if (word.empty()) return;
    if (ignore_merges_) {
      if (auto it = token_to_id_->find(Key(word)); it != token_to_id_->end()) {
        ids->push_back(it->second);
        return;
      }
    }
    // Symbols: one per code point; a code point no merge mentions gets symbol -1 and keeps its
    // text in `raw`.
    struct Node {
      int32_t symbol;
      std::string_view raw;
      int32_t prev, next;
      int32_t bias;  // original position of the leftmost character: ties go left
      bool alive;
    };
    std::vector<Node> nodes;
    size_t pos = 0;
    char32_t cp;
    while (pos < word.size()) {
      const size_t begin = pos;
      if (!NextCodePoint(word, &pos, &cp)) pos = begin + 1;  // callers pass valid UTF-8
      const std::string_view ch = word.substr(begin, pos - begin);
      auto it = symbol_ids_.find(Key(ch));
      const int32_t n = static_cast<int32_t>(nodes.size());
      nodes.push_back(Node{it == symbol_ids_.end() ? -1 : it->second, ch, n - 1, n + 1, n, true});
    }
    nodes.back().next = -1;
    // (rank, bias, left node, right node): the lowest rank first, then the leftmost pair.
    using Entry = std::tuple<int32_t, int32_t, int32_t, int32_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
    auto push_pair = [&](int32_t left) {
      const int32_t right = nodes[left].next;
      if (right < 0 || nodes[left].symbol < 0 || nodes[right].symbol < 0) return;
      auto it = merges_.find(PairKey(nodes[left].symbol, nodes[right].symbol));
      if (it != merges_.end()) queue.emplace(it->second.rank, nodes[left].bias, left, right);
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(nodes.size()); ++i) push_pair(i);
    while (!queue.empty()) {
      auto [rank, bias, left, right] = queue.top();
      queue.pop();
      Node& l = nodes[left];
      if (!l.alive || l.next != right || !nodes[right].alive) continue;
      auto it = merges_.find(PairKey(l.symbol, nodes[right].symbol));
      if (it == merges_.end() || it->second.rank != rank) continue;  // stale entry
      // Merge right into left; left keeps its bias (position).
      l.symbol = it->second.result;
      nodes[right].alive = false;
      l.next = nodes[right].next;
      if (l.next >= 0) nodes[l.next].prev = left;
      if (l.prev >= 0) push_pair(l.prev);
      push_pair(left);
    }
    for (int32_t i = 0; i >= 0; i = nodes[i].next) {
      const Node& n = nodes[i];
      const std::string_view text = n.symbol >= 0 ? std::string_view(symbols_[n.symbol]) : n.raw;
      if (auto it = token_to_id_->find(Key(text)); it != token_to_id_->end()) {
        ids->push_back(it->second);
        continue;
      }
      if (byte_fallback_) {
        std::vector<int32_t> byte_ids;
        for (unsigned char b : text) {
          auto bit = token_to_id_->find(absl::StrFormat("<0x%02X>", b));
          if (bit == token_to_id_->end()) break;
          byte_ids.push_back(bit->second);
        }
        if (byte_ids.size() == text.size()) {
          ids->insert(ids->end(), byte_ids.begin(), byte_ids.end());
          continue;
        }
      }
      ids->push_back(kUnknownId);
    }
  }

  bool fuse_unk() const { return fuse_unk_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  explicit BpeModel(const absl::flat_hash_map<std::string, int32_t>* token_to_id)
      : token_to_id_(token_to_id) {}
  static uint64_t PairKey(int32_t l, int32_t r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }
  int32_t Intern(const std::string& s) {
    auto [it, inserted] = symbol_ids_.try_emplace(s, static_cast<int32_t>(symbols_.size()));
    if (inserted) symbols_.push_back(s);
    return it->second;
  }

  const absl::flat_hash_map<std::string, int32_t>* token_to_id_;
  std::vector<std::string> symbols_;  // every string a merge mentions
  absl::flat_hash_map<std::string, int32_t> symbol_ids_;
  absl::flat_hash_map<uint64_t, Merge> merges_;  // (left, right) symbol -> rank, result
  bool byte_fallback_ = false, ignore_merges_ = false, fuse_unk_ = false;
};

// ---------------------------------------------------------------------------------------------
// Added-token matching: a byte trie, leftmost-longest like the reference's DictionarySplitter.
class AddedTokenTrie {
 public:
  void Insert(std::string_view token, int32_t index) {
    int32_t node = 0;
    for (unsigned char c : token) {
      auto [it, inserted] = nodes_[node].children.try_emplace(c, nodes_.size());
      if (inserted) nodes_.emplace_back();
      node = it->second;
    }
    nodes_[node].token = index;
  }
  // The index and length of the longest token starting at `pos`, or {-1, 0}.
  std::pair<int32_t, size_t> LongestAt(std::string_view text, size_t pos) const {
    std::pair<int32_t, size_t> best{-1, 0};
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      auto it = nodes_[node].children.find(static_cast<unsigned char>(text[i]));
      if (it == nodes_[node].children.end()) break;
      node = it->second;
      if (nodes_[node].token >= 0) best = {nodes_[node].token, i + 1 - pos};
    }
    return best;
  }

 private:
  struct Node {
    absl::flat_hash_map<unsigned char, int32_t> children;
    int32_t token = -1;
  };
  std::vector<Node> nodes_{1};
};

struct AddedToken {
  std::string content;
  int32_t id;
  bool lstrip, rstrip, special;
};

// TemplateProcessing's single-sequence template; empty = identity (ByteLevel or none).
struct PostProcessor {
  struct Item {
    bool is_sequence;
    std::string special_token;  // when !is_sequence
  };
  std::vector<Item> single;
};

absl::Status AddPostProcessor(const Json& node, PostProcessor* out) {
  if (node.is_null()) return absl::OkStatus();
  KV_ASSIGN_OR_RETURN(const std::string type, GetString(node, "type"));
  if (type == "ByteLevel") return absl::OkStatus();  // no effect on ids
  if (type == "Sequence") {
    auto it = node.find("processors");
    if (it == node.end() || !it->is_array()) {
      return absl::InvalidArgumentError("Sequence post-processor needs a 'processors' array");
    }
    for (const Json& p : *it) KV_RETURN_IF_ERROR(AddPostProcessor(p, out));
    return absl::OkStatus();
  }
  if (type == "TemplateProcessing") {
    if (!out->single.empty()) {
      return absl::UnimplementedError("more than one TemplateProcessing post-processor");
    }
    auto it = node.find("single");
    if (it == node.end() || !it->is_array()) {
      return absl::InvalidArgumentError("TemplateProcessing needs a 'single' array");
    }
    for (const Json& item : *it) {
      if (item.contains("SpecialToken")) {
        KV_ASSIGN_OR_RETURN(std::string id, GetString(item["SpecialToken"], "id"));
        out->single.push_back({false, id});
      } else if (item.contains("Sequence")) {
        KV_ASSIGN_OR_RETURN(std::string id, GetString(item["Sequence"], "id"));
        // The reference only appends sequence A for a single text.
        if (id == "A") out->single.push_back({true, ""});
      } else {
        return absl::InvalidArgumentError(
            "TemplateProcessing item must be SpecialToken or Sequence");
      }
    }
    return absl::OkStatus();
  }
  return Unsupported("post-processor", node);
}

// tokenizer_config.json's token fields: a string or {"__type": "AddedToken", "content": ...}.
std::optional<std::string> ConfigToken(const Json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return std::nullopt;
  if (it->is_string() && !it->get<std::string>().empty()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return std::nullopt;
}

// transformers.js's clean_up_tokenization.
std::string CleanUpTokenization(std::string s) {
  return absl::StrReplaceAll(s, {{" .", "."},
                                 {" ?", "?"},
                                 {" !", "!"},
                                 {" ,", ","},
                                 {" ' ", "'"},
                                 {" n't", "n't"},
                                 {" 'm", "'m"},
                                 {" 's", "'s"},
                                 {" 've", "'ve"},
                                 {" 're", "'re"}});
}

absl::StatusOr<std::string> ReadMaybeGzip(const std::string& path) {
  if (!absl::EndsWith(path, ".gz")) return ReadFileToString(path);
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::string out;
  std::array<char, 1 << 16> buf;
  int n;
  while ((n = gzread(f, buf.data(), buf.size())) > 0) out.append(buf.data(), n);
  int err = 0;
  const char* msg = gzerror(f, &err);
  const std::string message = msg == nullptr ? "" : msg;
  gzclose(f);
  if (n < 0 || (err != Z_OK && err != Z_STREAM_END)) {
    return absl::DataLossError(absl::StrCat("cannot decompress ", path, ": ", message));
  }
  return out;
}

bool FileExists(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  std::fclose(f);
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
struct HfTokenizer::Impl {
  std::string name;
  absl::flat_hash_map<std::string, int32_t> token_to_id;  // vocabulary + added tokens
  std::vector<std::string> id_to_token;                   // "" for holes
  std::vector<bool> id_present;
  std::vector<AddedToken> added_tokens;
  absl::flat_hash_map<std::string, int32_t> added_by_content;  // -> index in added_tokens
  absl::flat_hash_set<std::string> added_contents;
  absl::flat_hash_set<std::string> special_tokens;  // skipped by skip_special_tokens
  AddedTokenTrie trie;
  NormalizerPtr normalizer;
  PreTokenizerPtr pre_tokenizer;
  std::unique_ptr<BpeModel> model;
  PostProcessor post_processor;
  DecoderPtr decoder;
  std::optional<int32_t> unk_id, bos_id, eos_id;
  bool clean_up_tokenization_spaces = true;
  bool remove_space = false;
  std::optional<ChatTemplate> chat_template;
  absl::Status chat_template_error = absl::UnimplementedError("no chat_template");

  absl::Status EncodeSection(std::string text, std::vector<int32_t>* ids) const {
    if (remove_space) {
      // x.trim().split(/\s+/).join(" ")
      std::string_view t = TrimJsWhitespace(text, true, true);
      std::string joined;
      size_t pos = 0;
      bool in_space = false;
      while (pos < t.size()) {
        const size_t begin = pos;
        char32_t cp;
        NextCodePoint(t, &pos, &cp);
        if (IsJsWhitespace(cp)) {
          in_space = true;
          continue;
        }
        if (in_space) joined.push_back(' ');
        in_space = false;
        joined.append(t.substr(begin, pos - begin));
      }
      text = std::move(joined);
    }
    if (normalizer) {
      KV_ASSIGN_OR_RETURN(text, normalizer->Normalize(std::move(text)));
    }
    if (text.empty()) return absl::OkStatus();
    std::vector<std::string> words;
    if (pre_tokenizer) {
      pre_tokenizer->Split(text, &words);
    } else {
      words.push_back(std::move(text));
    }
    const size_t first = ids->size();
    for (const std::string& w : words) model->EncodeWord(w, ids);
    if (model->fuse_unk()) {
      // Consecutive unknown tokens become one.
      auto is_unk = [&](int32_t id) { return id == kUnknownId || (unk_id && id == *unk_id); };
      size_t out = first;
      for (size_t i = first; i < ids->size(); ++i) {
        if (is_unk((*ids)[i]) && out > first && is_unk((*ids)[out - 1])) continue;
        (*ids)[out++] = (*ids)[i];
      }
      ids->resize(out);
    }
    for (size_t i = first; i < ids->size(); ++i) {
      if ((*ids)[i] != kUnknownId) continue;
      if (!unk_id) {
        return absl::InvalidArgumentError(
            absl::StrCat("text contains a piece the vocabulary of ", name,
                         " cannot represent and the tokenizer has no unk_token"));
      }
      (*ids)[i] = *unk_id;
    }
    return absl::OkStatus();
  }
};

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::FromJson(std::string_view tokenizer_json,
                                                                   std::string_view config_json,
                                                                   std::string name) {
  Json root = Json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": tokenizer.json is not a JSON object"));
  }
  Json config = Json::object();
  if (!config_json.empty()) {
    config = Json::parse(config_json, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": tokenizer_config.json is not a JSON object"));
    }
  }
  auto prefix = [&name](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(name, ": ", s.message()));
  };
  auto impl = std::make_unique<Impl>();
  impl->name = name;
  static const Json* const kNullJson = new Json();
  auto field = [&root](const char* key) -> const Json& {
    auto it = root.find(key);
    return it == root.end() ? *kNullJson : *it;
  };

  const Json& model = field("model");
  if (!model.is_object()) return prefix(absl::InvalidArgumentError("'model' must be an object"));
  if (!model.contains("type") || !model["type"].is_string() || model["type"] != "BPE") {
    return prefix(Unsupported("model", model));
  }
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return prefix(absl::InvalidArgumentError("model.vocab must be an object"));
  }
  int32_t max_id = -1;
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (1 << 30)) {
      return prefix(absl::InvalidArgumentError(
          absl::StrCat("model.vocab['", token, "'] must be an id in [0, 2^30)")));
    }
    impl->token_to_id[token] = id.get<int32_t>();
    max_id = std::max(max_id, id.get<int32_t>());
  }
  if (const Json& added = field("added_tokens"); added.is_array()) {
    for (const Json& t : added) {
      auto content = GetString(t, "content");
      if (!content.ok() || !t.contains("id") || !t["id"].is_number_integer() ||
          t["id"].get<int64_t>() < 0 || t["id"].get<int64_t>() >= (1 << 30) || content->empty()) {
        return prefix(absl::InvalidArgumentError(
            "each added_tokens entry needs a non-empty 'content' and an 'id' in [0, 2^30)"));
      }
      AddedToken a{*content, t["id"].get<int32_t>(), GetBool(t, "lstrip", false),
                   GetBool(t, "rstrip", false), GetBool(t, "special", false)};
      impl->token_to_id[a.content] = a.id;
      max_id = std::max(max_id, a.id);
      impl->added_by_content[a.content] = static_cast<int32_t>(impl->added_tokens.size());
      impl->trie.Insert(a.content, static_cast<int32_t>(impl->added_tokens.size()));
      impl->added_contents.insert(a.content);
      if (a.special) impl->special_tokens.insert(a.content);
      impl->added_tokens.push_back(std::move(a));
    }
  }
  impl->id_to_token.assign(max_id + 1, "");
  impl->id_present.assign(max_id + 1, false);
  for (const auto& [token, id] : model["vocab"].items()) {
    impl->id_to_token[id.get<int32_t>()] = token;
    impl->id_present[id.get<int32_t>()] = true;
  }
  for (const AddedToken& a : impl->added_tokens) {
    impl->id_to_token[a.id] = a.content;
    impl->id_present[a.id] = true;
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    if (auto it = impl->token_to_id.find(model["unk_token"].get<std::string>());
        it != impl->token_to_id.end()) {
      impl->unk_id = it->second;
    }
  }
  if (auto it = config.find("additional_special_tokens"); it != config.end() && it->is_array()) {
    for (const Json& s : *it) {
      if (s.is_string()) impl->special_tokens.insert(s.get<std::string>());
    }
  }
  if (config.contains("do_lowercase_and_remove_accent") &&
      GetBool(config, "do_lowercase_and_remove_accent", false)) {
    return prefix(absl::UnimplementedError("do_lowercase_and_remove_accent is not supported"));
  }
  if (auto cls = config.find("tokenizer_class");
      cls != config.end() && cls->is_string() &&
      absl::StartsWith(cls->get<std::string>(), "LlamaTokenizer") &&
      !GetBool(config, "legacy", true)) {
    return prefix(absl::UnimplementedError(
        "LlamaTokenizer with legacy=false (Metaspace pre-tokenizer) is not supported"));
  }
  impl->remove_space = GetBool(config, "remove_space", false);
  impl->clean_up_tokenization_spaces = GetBool(config, "clean_up_tokenization_spaces", true);

  {
    auto n = MakeNormalizer(field("normalizer"));
    if (!n.ok()) return prefix(n.status());
    impl->normalizer = *std::move(n);
    auto p = MakePreTokenizer(field("pre_tokenizer"));
    if (!p.ok()) return prefix(p.status());
    impl->pre_tokenizer = *std::move(p);
    auto m = BpeModel::Create(model, &impl->token_to_id);
    if (!m.ok()) return prefix(m.status());
    impl->model = *std::move(m);
    absl::Status s = AddPostProcessor(field("post_processor"), &impl->post_processor);
    if (!s.ok()) return prefix(s);
    for (const PostProcessor::Item& item : impl->post_processor.single) {
      if (!item.is_sequence && !impl->token_to_id.contains(item.special_token)) {
        return prefix(absl::InvalidArgumentError(absl::StrCat(
            "post-processor special token '", item.special_token, "' is not in the vocabulary")));
      }
    }
    auto d = MakeDecoder(field("decoder"), &impl->added_contents);
    if (!d.ok()) return prefix(d.status());
    impl->decoder = *std::move(d);
  }

  std::optional<std::string> bos = ConfigToken(config, "bos_token");
  std::optional<std::string> eos = ConfigToken(config, "eos_token");
  if (bos) {
    if (auto it = impl->token_to_id.find(*bos); it != impl->token_to_id.end()) {
      impl->bos_id = it->second;
    }
  }
  if (eos) {
    if (auto it = impl->token_to_id.find(*eos); it != impl->token_to_id.end()) {
      impl->eos_id = it->second;
    }
  }
  if (auto t = config.find("chat_template"); t != config.end() && t->is_string()) {
    absl::StatusOr<ChatTemplate> tmpl =
        ChatTemplate::Recognise(t->get<std::string>(), bos.value_or(""));
    if (tmpl.ok()) {
      impl->chat_template = *std::move(tmpl);
    } else {
      impl->chat_template_error = prefix(tmpl.status());
    }
  } else {
    impl->chat_template_error =
        prefix(absl::UnimplementedError("tokenizer_config.json has no chat_template (a string)"));
  }
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::Load(const std::string& path) {
  std::string json_path, dir;
  if (absl::EndsWith(path, ".json") || absl::EndsWith(path, ".json.gz")) {
    json_path = path;
    const size_t slash = path.rfind('/');
    dir = slash == std::string::npos ? "." : path.substr(0, slash);
  } else {
    dir = path;
    json_path = dir + "/tokenizer.json";
    if (!FileExists(json_path) && FileExists(json_path + ".gz")) json_path += ".gz";
  }
  if (!FileExists(json_path)) {
    return absl::NotFoundError(absl::StrCat("no tokenizer.json or tokenizer.json.gz at ", path));
  }
  KV_ASSIGN_OR_RETURN(std::string json, ReadMaybeGzip(json_path));
  std::string config;
  if (const std::string config_path = dir + "/tokenizer_config.json"; FileExists(config_path)) {
    KV_ASSIGN_OR_RETURN(config, ReadFileToString(config_path));
  }
  return FromJson(json, config, path);
}

absl::StatusOr<std::vector<int32_t>> HfTokenizer::Encode(std::string_view text,
                                                         const EncodeOptions& options) const {
  const Impl& m = *impl_;
  if (text.size() > kMaxEncodeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("text is ", text.size(), " bytes, more than the limit ", kMaxEncodeBytes));
  }
  KV_RETURN_IF_ERROR(ValidateUtf8(text));
  // Sections: added tokens (leftmost-longest) and the text between them.
  std::vector<std::string> sections;
  size_t start = 0, i = 0;
  while (i < text.size()) {
    auto [index, length] = m.trie.LongestAt(text, i);
    if (index < 0) {
      ++i;
      continue;
    }
    if (i > start) sections.emplace_back(text.substr(start, i - start));
    sections.emplace_back(m.added_tokens[index].content);
    i += length;
    start = i;
  }
  if (start < text.size()) sections.emplace_back(text.substr(start));
  for (size_t s = 0; s < sections.size(); ++s) {
    auto it = m.added_by_content.find(sections[s]);
    if (it == m.added_by_content.end()) continue;
    const AddedToken& a = m.added_tokens[it->second];
    if (a.lstrip && s > 0)
      sections[s - 1] = std::string(TrimJsWhitespace(sections[s - 1], false, true));
    if (a.rstrip && s + 1 < sections.size()) {
      sections[s + 1] = std::string(TrimJsWhitespace(sections[s + 1], true, false));
    }
  }
  std::vector<int32_t> body;
  for (std::string& section : sections) {
    if (section.empty()) continue;
    if (auto it = m.added_by_content.find(section); it != m.added_by_content.end()) {
      body.push_back(m.added_tokens[it->second].id);
      continue;
    }
    KV_RETURN_IF_ERROR(m.EncodeSection(std::move(section), &body));
  }
  if (m.post_processor.single.empty()) return body;
  std::vector<int32_t> ids;
  ids.reserve(body.size() + 4);
  for (const PostProcessor::Item& item : m.post_processor.single) {
    if (item.is_sequence) {
      ids.insert(ids.end(), body.begin(), body.end());
    } else if (options.add_special_tokens) {
      ids.push_back(m.token_to_id.at(item.special_token));  // checked at load
    }
  }
  return ids;
}

absl::StatusOr<std::string> HfTokenizer::Decode(absl::Span<const int32_t> ids,
                                                const DecodeOptions& options) const {
  const Impl& m = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= static_cast<int32_t>(m.id_to_token.size()) || !m.id_present[id]) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " at position ", i,
                                                     " is not in the vocabulary of ", m.name));
    }
    const std::string& token = m.id_to_token[id];
    if (options.skip_special_tokens && m.special_tokens.contains(token)) continue;
    tokens.push_back(token);
  }
  std::string text;
  if (m.decoder) {
    for (const std::string& part : m.decoder->DecodeChain(std::move(tokens))) text += part;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) absl::StrAppend(&text, i ? " " : "", tokens[i]);
  }
  if (m.clean_up_tokenization_spaces) text = CleanUpTokenization(std::move(text));
  return text;
}

absl::StatusOr<std::string> HfTokenizer::ApplyChatTemplate(absl::Span<const ChatMessage> messages,
                                                           bool add_generation_prompt) const {
  if (!impl_->chat_template) return impl_->chat_template_error;
  return impl_->chat_template->Render(messages, add_generation_prompt);
}

int32_t HfTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_to_token.size()); }
std::optional<int32_t> HfTokenizer::bos_id() const { return impl_->bos_id; }
std::optional<int32_t> HfTokenizer::eos_id() const { return impl_->eos_id; }
std::string HfTokenizer::name() const { return impl_->name; }

std::optional<int32_t> HfTokenizer::TokenToId(std::string_view token) const {
  auto it = impl_->token_to_id.find(Key(token));
  if (it == impl_->token_to_id.end()) return std::nullopt;
  return it->second;
}

}  // namespace kvrelay::tokenizer
