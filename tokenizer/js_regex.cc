#include "tokenizer/js_regex.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tokenizer/unicode.h"

namespace kvrelay::tokenizer {
namespace {

constexpr std::string_view kLookaheadGroupName = "kvrelay_ws_lookahead";
// JavaScript's \s as the body of an RE2 character class.
constexpr std::string_view kJsSpaceClassBody =
    R"(\t\n\x{0B}\f\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF})";

bool IsHexDigit(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

}  // namespace

absl::StatusOr<std::string> TranslateJsRegex(std::string_view js_pattern) {
  // transformers.js's own rewrites (createPattern + PROBLEMATIC_REGEX_MAP).
  std::string p =
      absl::StrReplaceAll(std::string(js_pattern), {{"\\#", "#"}, {"\\&", "&"}, {"\\~", "~"}});
  p = absl::StrReplaceAll(p, {{"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
                               "(?:'([sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))"}});
  const std::string lookahead_group =
      absl::StrCat("(?P<", std::string(kLookaheadGroupName), ">\\s+)");
  p = absl::StrReplaceAll(p, {{"\\s+(?!\\S)", lookahead_group}});
  if (p.find("(?=") != std::string::npos || p.find("(?!") != std::string::npos ||
      p.find("(?<=") != std::string::npos || p.find("(?<!") != std::string::npos) {
    return absl::UnimplementedError(
        absl::StrCat("pre-tokenizer regex uses a lookaround other than \\s+(?!\\S), which RE2 "
                     "cannot run: ",
                     std::string(js_pattern)));
  }
  std::string out;
  out.reserve(p.size() * 2);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 's') {
        if (in_class) {
          out.append(kJsSpaceClassBody);
        } else {
          out.append("[").append(kJsSpaceClassBody).append("]");
        }
        ++i;
      } else if (e == 'S') {
        if (in_class) {
          return absl::UnimplementedError(absl::StrCat(
              "\\S inside a character class is not supported: ", std::string(js_pattern)));
        }
        out.append("[^").append(kJsSpaceClassBody).append("]");
        ++i;
      } else if (e == 'u' && i + 5 < p.size() && IsHexDigit(p[i + 2]) && IsHexDigit(p[i + 3]) &&
                 IsHexDigit(p[i + 4]) && IsHexDigit(p[i + 5])) {
        out.append("\\x{").append(p.substr(i + 2, 4)).append("}");
        i += 5;
      } else {
        out.push_back(c);
        out.push_back(e);
        ++i;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

absl::StatusOr<std::unique_ptr<JsRegex>> JsRegex::Compile(std::string_view js_pattern) {
  absl::StatusOr<std::string> translated = TranslateJsRegex(js_pattern);
  if (!translated.ok()) return translated.status();
  RE2::Options options;
  options.set_log_errors(false);
  auto re = std::make_unique<RE2>(*translated, options);
  if (!re->ok()) {
    return absl::InvalidArgumentError(absl::StrCat("pre-tokenizer regex does not compile (",
                                                   re->error(), "): ", std::string(js_pattern)));
  }
  int group = 0;
  const std::map<std::string, int>& named = re->NamedCapturingGroups();
  if (auto it = named.find(std::string(kLookaheadGroupName)); it != named.end()) {
    group = it->second;
  }
  return std::unique_ptr<JsRegex>(new JsRegex(*std::move(translated), std::move(re), group));
}

std::vector<std::pair<size_t, size_t>> JsRegex::FindAll(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> matches;
  const int ngroups = lookahead_group_ + 1;
  std::vector<re2::StringPiece> groups(ngroups);
  const re2::StringPiece subject(text.data(), text.size());
  size_t pos = 0;
  while (pos <= text.size()) {
    if (!re_->Match(subject, pos, subject.size(), RE2::UNANCHORED, groups.data(), ngroups)) break;
    const size_t begin = groups[0].data() - subject.data();
    size_t end = begin + groups[0].size();
    if (lookahead_group_ > 0 && groups[lookahead_group_].data() != nullptr && end < text.size() &&
        CodePointCount(text.substr(begin, end - begin)) >= 2) {
      // `\s+(?!\S)` backtracks one code point when text follows the whitespace run.
      do {
        --end;
      } while ((static_cast<unsigned char>(text[end]) & 0xC0) == 0x80);
    }
    if (end == begin) {
      // Empty match: step over one code point, as matchAll does.
      size_t next = begin;
      char32_t cp;
      if (!NextCodePoint(text, &next, &cp)) next = begin + 1;
      pos = next;
      continue;
    }
    matches.emplace_back(begin, end);
    pos = end;
  }
  return matches;
}

}  // namespace kvrelay::tokenizer
