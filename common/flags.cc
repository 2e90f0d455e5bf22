#include "common/flags.h"

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvrelay {
namespace {

absl::Status BadValue(const std::string& name, const std::string& value, const char* expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, ": expected ", expected, ", got '", value, "'"));
}

}  // namespace

void FlagSet::Add(Flag flag) { flags_.push_back(std::move(flag)); }

void FlagSet::AddString(const std::string& name, std::string* target, const std::string& help) {
  Add({name, help, *target, false, [target](const std::string& v) {
         *target = v;
         return absl::OkStatus();
       }});
}

void FlagSet::AddInt64(const std::string& name, int64_t* target, const std::string& help) {
  Add({name, help, absl::StrCat(*target), false, [name, target](const std::string& v) {
         int64_t parsed;
         if (!absl::SimpleAtoi(v, &parsed)) return BadValue(name, v, "an integer");
         *target = parsed;
         return absl::OkStatus();
       }});
}

void FlagSet::AddInt32(const std::string& name, int32_t* target, const std::string& help) {
  Add({name, help, absl::StrCat(*target), false, [name, target](const std::string& v) {
         int32_t parsed;
         if (!absl::SimpleAtoi(v, &parsed)) return BadValue(name, v, "a 32-bit integer");
         *target = parsed;
         return absl::OkStatus();
       }});
}

void FlagSet::AddDouble(const std::string& name, double* target, const std::string& help) {
  Add({name, help, absl::StrCat(*target), false, [name, target](const std::string& v) {
         double parsed;
         if (!absl::SimpleAtod(v, &parsed)) return BadValue(name, v, "a number");
         *target = parsed;
         return absl::OkStatus();
       }});
}

void FlagSet::AddBool(const std::string& name, bool* target, const std::string& help) {
  Add({name, help, *target ? "true" : "false", true, [name, target](const std::string& v) {
         bool parsed;
         if (!absl::SimpleAtob(v, &parsed)) return BadValue(name, v, "true or false");
         *target = parsed;
         return absl::OkStatus();
       }});
}

void FlagSet::AddDuration(const std::string& name, absl::Duration* target,
                          const std::string& help) {
  Add({name, help, absl::FormatDuration(*target), false, [name, target](const std::string& v) {
         absl::Duration parsed;
         if (!absl::ParseDuration(v, &parsed)) return BadValue(name, v, "a duration like 5s");
         *target = parsed;
         return absl::OkStatus();
       }});
}

absl::Status FlagSet::Parse(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      continue;
    }
    if (arg.size() < 3 || arg[0] != '-' || arg[1] != '-') {
      if (positional_help_.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(command_, ": unexpected argument '", arg, "' (see --help)"));
      }
      positional_.push_back(arg);
      continue;
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it =
        std::find_if(flags_.begin(), flags_.end(), [&](const Flag& f) { return f.name == name; });
    if (it == flags_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(command_, ": unknown flag --", name, " (see --help)"));
    }
    if (!has_value) {
      if (it->is_bool) {
        value = "true";
      } else {
        if (i + 1 >= args.size()) {
          return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
        }
        value = args[++i];
      }
    }
    if (absl::Status s = it->set(value); !s.ok()) return s;
    set_flags_.push_back(name);
  }
  return absl::OkStatus();
}

bool FlagSet::WasSet(const std::string& name) const {
  return std::find(set_flags_.begin(), set_flags_.end(), name) != set_flags_.end();
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("Usage: kvrelay ", command_, " [flags]",
                                 positional_help_.empty() ? "" : " " + positional_help_, "\n",
                                 summary_, "\n\nFlags:\n");
  for (const Flag& f : flags_) {
    absl::StrAppendFormat(&out, "  --%-22s %s", f.name, f.help);
    if (!f.default_text.empty()) absl::StrAppend(&out, " (default: ", f.default_text, ")");
    absl::StrAppend(&out, "\n");
  }
  absl::StrAppend(&out, "  --help                   show this help\n");
  return out;
}

std::vector<std::string> ArgsFrom(int argc, char** argv, int first) {
  std::vector<std::string> args;
  for (int i = first; i < argc; ++i) args.emplace_back(argv[i]);
  return args;
}

std::optional<int> ParseCommandLine(FlagSet& flags, const std::vector<std::string>& args) {
  if (absl::Status parsed = flags.Parse(args); !parsed.ok()) {
    return UsageError(flags.command(), parsed.message());
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  return std::nullopt;
}

int UsageError(absl::string_view command, absl::string_view message, int exit_code) {
  std::fprintf(stderr, "kvrelay %.*s: %.*s\n", static_cast<int>(command.size()), command.data(),
               static_cast<int>(message.size()), message.data());
  return exit_code;
}

int CommandFailed(absl::string_view command, const absl::Status& status) {
  const bool bad_input = absl::IsInvalidArgument(status) || absl::IsNotFound(status);
  return UsageError(command, status.message(), bad_input ? 2 : 1);
}

}  // namespace kvrelay
