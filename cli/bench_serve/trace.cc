#include "cli/bench_serve/trace.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace kvrelay::cli::bench_serve {
namespace {

using Json = nlohmann::json;

absl::Status LineError(absl::string_view source, int64_t line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(source, " line ", line, ": ", what));
}

// A JSON number that is a whole number (Mooncake writes ints; some converters write 12.0).
bool AsInt64(const Json& v, int64_t* out) {
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return true;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d != static_cast<double>(static_cast<int64_t>(d))) return false;
    *out = static_cast<int64_t>(d);
    return true;
  }
  return false;
}

absl::StatusOr<int64_t> PositiveField(const Json& j, const char* name, absl::string_view source,
                                      int64_t line) {
  auto it = j.find(name);
  if (it == j.end()) return LineError(source, line, absl::StrCat("missing field '", name, "'"));
  int64_t value = 0;
  if (!AsInt64(*it, &value)) {
    return LineError(source, line,
                     absl::StrCat("'", name, "' must be an integer, got ", it->dump()));
  }
  if (value < 1) {
    return LineError(source, line, absl::StrCat("'", name, "' must be >= 1, got ", value));
  }
  return value;
}

absl::StatusOr<TraceEntry> ParseLine(absl::string_view text, absl::string_view source,
                                     int64_t line) {
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return LineError(source, line, "not valid JSON");
  if (!j.is_object()) return LineError(source, line, "not a JSON object");
  TraceEntry entry;
  entry.line = line;
  auto ts = j.find("timestamp");
  if (ts == j.end()) return LineError(source, line, "missing field 'timestamp'");
  if (!ts->is_number()) {
    return LineError(source, line, absl::StrCat("'timestamp' must be a number, got ", ts->dump()));
  }
  entry.timestamp_ms = ts->get<double>();
  if (!(entry.timestamp_ms >= 0)) {
    return LineError(source, line,
                     absl::StrCat("'timestamp' must be >= 0, got ", entry.timestamp_ms));
  }
  KV_ASSIGN_OR_RETURN(entry.input_length, PositiveField(j, "input_length", source, line));
  KV_ASSIGN_OR_RETURN(entry.output_length, PositiveField(j, "output_length", source, line));
  auto ids = j.find("hash_ids");
  if (ids == j.end()) return LineError(source, line, "missing field 'hash_ids'");
  if (!ids->is_array() || ids->empty()) {
    return LineError(source, line, "'hash_ids' must be a non-empty array of integers");
  }
  entry.hash_ids.reserve(ids->size());
  for (size_t i = 0; i < ids->size(); ++i) {
    int64_t id = 0;
    if (!AsInt64((*ids)[i], &id) || id < 0) {
      return LineError(
          source, line,
          absl::StrCat("hash_ids[", i, "] must be an integer >= 0, got ", (*ids)[i].dump()));
    }
    entry.hash_ids.push_back(id);
  }
  return entry;
}

}  // namespace

absl::StatusOr<std::vector<TraceEntry>> ParseMooncakeTrace(absl::string_view text,
                                                           absl::string_view source) {
  std::vector<TraceEntry> entries;
  int64_t line = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == absl::string_view::npos) end = text.size();
    const absl::string_view one = text.substr(pos, end - pos);
    pos = end + 1;
    ++line;
    if (one.find_first_not_of(" \t\r") == absl::string_view::npos) continue;
    KV_ASSIGN_OR_RETURN(TraceEntry entry, ParseLine(one, source, line));
    entries.push_back(std::move(entry));
  }
  if (entries.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no requests in the trace"));
  }
  std::stable_sort(entries.begin(), entries.end(), [](const TraceEntry& a, const TraceEntry& b) {
    return a.timestamp_ms < b.timestamp_ms;
  });
  return entries;
}

absl::StatusOr<std::vector<TraceEntry>> LoadMooncakeTrace(const std::string& path) {
  KV_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseMooncakeTrace(text, path);
}

}  // namespace kvrelay::cli::bench_serve
