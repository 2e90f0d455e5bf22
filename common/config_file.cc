#include "common/config_file.h"

#include <yaml-cpp/yaml.h>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"

namespace kvrelay {
namespace {

absl::StatusOr<std::vector<std::string>> FlagsFromYaml(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  std::vector<std::string> flags;
  // yaml-cpp reports errors by exception; they stop here.
  try {
    YAML::Node root = YAML::Load(*text);
    if (root.IsNull()) return flags;
    if (!root.IsMap()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": top level must be a map of flags"));
    }
    for (const auto& entry : root) {
      const std::string key = entry.first.as<std::string>();
      const YAML::Node& value = entry.second;
      std::string text_value;
      if (value.IsScalar()) {
        text_value = value.as<std::string>();
      } else if (value.IsSequence()) {
        for (size_t i = 0; i < value.size(); ++i) {
          if (!value[i].IsScalar()) {
            return absl::InvalidArgumentError(
                absl::StrCat(path, ": ", key, "[", i, "] must be a scalar"));
          }
          absl::StrAppend(&text_value, i == 0 ? "" : ",", value[i].as<std::string>());
        }
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": ", key, " must be a scalar or a list"));
      }
      flags.push_back(absl::StrCat("--", key, "=", text_value));
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  return flags;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandConfigFile(const std::vector<std::string>& args) {
  std::vector<std::string> rest;
  std::string path;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config") {
      if (i + 1 >= args.size()) return absl::InvalidArgumentError("--config: missing value");
      path = args[++i];
    } else if (args[i].rfind("--config=", 0) == 0) {
      path = args[i].substr(9);
    } else {
      rest.push_back(args[i]);
    }
  }
  if (path.empty()) return rest;
  absl::StatusOr<std::vector<std::string>> flags = FlagsFromYaml(path);
  if (!flags.ok()) return flags.status();
  flags->insert(flags->end(), rest.begin(), rest.end());
  return flags;
}

}  // namespace kvrelay
