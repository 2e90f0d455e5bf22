#include "tokenizer/unicode.h"

#include "absl/strings/str_cat.h"

namespace kvrelay::tokenizer {

bool NextCodePoint(std::string_view text, size_t* pos, char32_t* code_point) {
  const size_t i = *pos;
  if (i >= text.size()) return false;
  const auto b0 = static_cast<unsigned char>(text[i]);
  int len;
  char32_t cp;
  char32_t min;
  if (b0 < 0x80) {
    *code_point = b0;
    *pos = i + 1;
    return true;
  } else if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return false;
  }
  if (i + len > text.size()) return false;
  for (int k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(text[i + k]);
    if ((b & 0xC0) != 0x80) return false;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
  *code_point = cp;
  *pos = i + len;
  return true;
}

absl::Status ValidateUtf8(std::string_view text) {
  size_t pos = 0;
  char32_t cp;
  while (pos < text.size()) {
    if (!NextCodePoint(text, &pos, &cp)) {
      return absl::InvalidArgumentError(
          absl::StrCat("text is not valid UTF-8 at byte offset ", pos));
    }
  }
  return absl::OkStatus();
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string DecodeUtf8Lossy(std::string_view bytes, bool strip_bom) {
  // The WHATWG Encoding Standard's UTF-8 decoder, step by step.
  std::string out;
  out.reserve(bytes.size());
  int needed = 0, seen = 0;
  char32_t cp = 0;
  unsigned lower = 0x80, upper = 0xBF;
  size_t i = 0;
  while (i < bytes.size()) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    if (needed == 0) {
      ++i;
      if (b <= 0x7F) {
        out.push_back(static_cast<char>(b));
      } else if (b >= 0xC2 && b <= 0xDF) {
        needed = 1, cp = b & 0x1F;
      } else if (b >= 0xE0 && b <= 0xEF) {
        if (b == 0xE0) lower = 0xA0;
        if (b == 0xED) upper = 0x9F;
        needed = 2, cp = b & 0x0F;
      } else if (b >= 0xF0 && b <= 0xF4) {
        if (b == 0xF0) lower = 0x90;
        if (b == 0xF4) upper = 0x8F;
        needed = 3, cp = b & 0x07;
      } else {
        AppendUtf8(0xFFFD, &out);
      }
      continue;
    }
    if (b < lower || b > upper) {
      // The byte is not consumed: it starts the next sequence.
      needed = seen = 0, cp = 0, lower = 0x80, upper = 0xBF;
      AppendUtf8(0xFFFD, &out);
      continue;
    }
    ++i;
    lower = 0x80, upper = 0xBF;
    cp = (cp << 6) | (b & 0x3F);
    if (++seen == needed) {
      AppendUtf8(cp, &out);
      needed = seen = 0, cp = 0;
    }
  }
  if (needed != 0) AppendUtf8(0xFFFD, &out);
  if (strip_bom && out.size() >= 3 && out.compare(0, 3, "\xEF\xBB\xBF") == 0) out.erase(0, 3);
  return out;
}

bool IsJsWhitespace(char32_t c) {
  switch (c) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
    case 0xFEFF:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

std::string_view TrimJsWhitespace(std::string_view text, bool left, bool right) {
  size_t begin = 0, end = text.size();
  if (left) {
    size_t pos = 0;
    char32_t cp;
    while (pos < text.size()) {
      size_t next = pos;
      if (!NextCodePoint(text, &next, &cp) || !IsJsWhitespace(cp)) break;
      pos = next;
    }
    begin = pos;
  }
  if (right) {
    // Walk forward, remembering where the last non-whitespace code point ends.
    size_t pos = begin, last_end = begin;
    char32_t cp;
    while (pos < text.size() && NextCodePoint(text, &pos, &cp)) {
      if (!IsJsWhitespace(cp)) last_end = pos;
    }
    end = last_end;
  }
  return text.substr(begin, end - begin);
}

size_t Utf16Length(std::string_view text) {
  size_t pos = 0, n = 0;
  char32_t cp;
  while (pos < text.size() && NextCodePoint(text, &pos, &cp)) n += cp >= 0x10000 ? 2 : 1;
  return n;
}

size_t CodePointCount(std::string_view text) {
  size_t n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace kvrelay::tokenizer
