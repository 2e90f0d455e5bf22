#pragma once

// UTF-8 helpers the tokenizer needs, with JavaScript's definitions where the reference
// implementation (transformers.js) uses them: its whitespace set (String.prototype.trim, \s)
// and the WHATWG TextDecoder's replacement of invalid sequences by U+FFFD.

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace kvrelay::tokenizer {

// Decodes the code point at `*pos` and advances `*pos`; false (pos unchanged) on invalid UTF-8
// (overlong, surrogate, > U+10FFFF, truncated).
bool NextCodePoint(std::string_view text, size_t* pos, char32_t* code_point);

// OK, or InvalidArgument naming the byte offset of the first invalid sequence.
absl::Status ValidateUtf8(std::string_view text);

void AppendUtf8(char32_t code_point, std::string* out);

// WHATWG "utf-8 decode without BOM": every maximal invalid subpart becomes U+FFFD.
// With `strip_bom`, a leading U+FEFF is dropped (TextDecoder's default).
std::string DecodeUtf8Lossy(std::string_view bytes, bool strip_bom = false);

// JavaScript's WhiteSpace + LineTerminator set (what \s and trim() use).
bool IsJsWhitespace(char32_t c);

// `text` without leading (`left`) and/or trailing (`right`) JavaScript whitespace.
// REQUIRES: valid UTF-8.
std::string_view TrimJsWhitespace(std::string_view text, bool left, bool right);

// Length in UTF-16 code units (JavaScript's String.length). REQUIRES: valid UTF-8.
size_t Utf16Length(std::string_view text);

// Number of code points. REQUIRES: valid UTF-8.
size_t CodePointCount(std::string_view text);

}  // namespace kvrelay::tokenizer
