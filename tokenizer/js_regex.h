#pragma once

// The pre-tokenizer regexes of tokenizer.json files, run with RE2 but with the semantics of the
// reference (transformers.js, a JavaScript RegExp with the `u` flag):
//  - \s and \S mean JavaScript's whitespace set (RE2's \s is ASCII only);
//  - `(?i:'s|'t|...)` is rewritten exactly as transformers.js rewrites it (no Unicode folding);
//  - the one lookahead these patterns use, `\s+(?!\S)`, which RE2 lacks, is emulated exactly:
//    RE2 matches the whole whitespace run in a marked group; when the run is followed by a
//    non-whitespace character, a backtracking engine gives back the run's last character
//    (it then starts the next piece, e.g. " hello"), so FindAll shortens such a match by one
//    code point. A one-character run followed by text is the same in both (the `\s+`
//    alternative that follows takes it). Any other lookaround is Unimplemented.
//  - \uXXXX escapes become RE2's \x{XXXX}.
//
// Immutable after Compile; thread-safe.

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "re2/re2.h"

namespace kvrelay::tokenizer {

class JsRegex {
 public:
  static absl::StatusOr<std::unique_ptr<JsRegex>> Compile(std::string_view js_pattern);

  // Non-overlapping matches [begin, end) in byte offsets, left to right, as
  // String.prototype.matchAll gives them (empty matches are skipped).
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view text) const;

  const std::string& re2_pattern() const { return re2_pattern_; }

 private:
  JsRegex(std::string re2_pattern, std::unique_ptr<RE2> re, int lookahead_group)
      : re2_pattern_(std::move(re2_pattern)),
        re_(std::move(re)),
        lookahead_group_(lookahead_group) {}

  std::string re2_pattern_;
  std::unique_ptr<RE2> re_;
  int lookahead_group_;  // capture group of the emulated `\s+(?!\S)`, 0 if none
};

// The RE2 pattern for `js_pattern` (exposed for tests); see the class comment.
absl::StatusOr<std::string> TranslateJsRegex(std::string_view js_pattern);

}  // namespace kvrelay::tokenizer
