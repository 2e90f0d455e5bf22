#include "sim/profile.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvrelay::sim {

absl::Duration HardwareProfile::PrefillTime(int64_t new_tokens, int64_t cached_tokens) const {
  if (new_tokens <= 0) return absl::Milliseconds(prefill_fixed_ms);
  const double n = static_cast<double>(new_tokens);
  const double ms =
      prefill_fixed_ms + 1e3 * n / prefill_tokens_per_second +
      prefill_attention_ms_per_mtoken2 * n * (static_cast<double>(cached_tokens) + n / 2) / 1e6;
  return absl::Microseconds(static_cast<int64_t>(ms * 1e3));
}

absl::Duration HardwareProfile::DecodeStep(int64_t batch, int64_t context_tokens) const {
  const double ms = decode_fixed_ms + decode_per_sequence_ms * static_cast<double>(batch) +
                    decode_per_ktoken_context_ms * static_cast<double>(context_tokens) / 1e3;
  return absl::Microseconds(static_cast<int64_t>(ms * 1e3));
}

absl::Duration HardwareProfile::Transfer(uint64_t bytes) const {
  const double us =
      network_latency_us + 1e6 * static_cast<double>(bytes) / network_bytes_per_second;
  return absl::Microseconds(static_cast<int64_t>(us));
}

absl::Duration HardwareProfile::DiskRead(uint64_t bytes) const {
  return absl::Microseconds(
      static_cast<int64_t>(1e6 * static_cast<double>(bytes) / disk_read_bytes_per_second));
}

namespace {

using nlohmann::json;

absl::Status ReadSection(const json& root, const char* section,
                         std::initializer_list<std::pair<const char*, double*>> fields,
                         bool positive) {
  if (!root.contains(section)) return absl::OkStatus();
  const json& s = root.at(section);
  if (!s.is_object()) return absl::InvalidArgumentError(absl::StrCat(section, ": want an object"));
  for (const auto& [key, value] : s.items()) {
    double* target = nullptr;
    for (const auto& [name, field] : fields) {
      if (key == name) target = field;
    }
    if (target == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(section, ".", key, ": unknown key"));
    }
    if (!value.is_number()) {
      return absl::InvalidArgumentError(absl::StrCat(section, ".", key, ": want a number"));
    }
    *target = value.get<double>();
    if (*target < 0 || (positive && *target == 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(section, ".", key, ": want a positive number, got ", value.dump()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HardwareProfile> ParseProfile(const std::string& json_text) {
  json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError("profile: not a JSON object");
  }
  HardwareProfile p;
  for (const auto& [key, value] : root.items()) {
    if (key == "name") {
      if (!value.is_string()) return absl::InvalidArgumentError("name: want a string");
      p.name = value.get<std::string>();
    } else if (key == "sources") {
      if (!value.is_array()) return absl::InvalidArgumentError("sources: want a list of strings");
      for (const json& s : value) {
        if (!s.is_string()) return absl::InvalidArgumentError("sources: want a list of strings");
        p.sources.push_back(s.get<std::string>());
      }
    } else if (key == "rpc_ms") {
      if (!value.is_number() || value.get<double>() < 0) {
        return absl::InvalidArgumentError("rpc_ms: want a number >= 0");
      }
      p.rpc_ms = value.get<double>();
    } else if (key != "prefill" && key != "decode" && key != "network" && key != "disk") {
      return absl::InvalidArgumentError(absl::StrCat(key, ": unknown key"));
    }
  }
  absl::Status st = ReadSection(root, "prefill",
                                {{"fixed_ms", &p.prefill_fixed_ms},
                                 {"tokens_per_second", &p.prefill_tokens_per_second},
                                 {"attention_ms_per_mtoken2", &p.prefill_attention_ms_per_mtoken2}},
                                false);
  if (st.ok()) {
    st = ReadSection(root, "decode",
                     {{"fixed_ms", &p.decode_fixed_ms},
                      {"per_sequence_ms", &p.decode_per_sequence_ms},
                      {"per_ktoken_context_ms", &p.decode_per_ktoken_context_ms}},
                     false);
  }
  if (st.ok()) {
    st = ReadSection(
        root, "network",
        {{"bytes_per_second", &p.network_bytes_per_second}, {"latency_us", &p.network_latency_us}},
        false);
  }
  if (st.ok()) {
    st =
        ReadSection(root, "disk", {{"read_bytes_per_second", &p.disk_read_bytes_per_second}}, true);
  }
  if (!st.ok()) return st;
  if (p.prefill_tokens_per_second <= 0) {
    return absl::InvalidArgumentError("prefill.tokens_per_second: want a positive number");
  }
  if (p.network_bytes_per_second <= 0) {
    return absl::InvalidArgumentError("network.bytes_per_second: want a positive number");
  }
  return p;
}

absl::StatusOr<HardwareProfile> LoadProfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("profile ", path, ": cannot open"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<HardwareProfile> p = ParseProfile(text.str());
  if (!p.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("profile ", path, ": ", p.status().message()));
  }
  return p;
}

}  // namespace kvrelay::sim
