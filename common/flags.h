#pragma once

// Per-subcommand flag parsing for the `kvrelay` binary. Abseil's flags are process-global, so
// two subcommands could not both own `--json`; each subcommand builds its own FlagSet instead.
//
//   FlagSet flags("layout", "Prints the KV-cache layout of a model.");
//   std::string preset;
//   flags.AddString("preset", &preset, "built-in model name");
//   KV_RETURN_IF_ERROR(flags.Parse(args));      // InvalidArgument naming the bad flag
//   if (flags.help_requested()) { std::cout << flags.Usage(); return 0; }

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace kvrelay {

class FlagSet {
 public:
  FlagSet(std::string command, std::string summary)
      : command_(std::move(command)), summary_(std::move(summary)) {}

  // Each target must outlive Parse(); its current value is the default shown in Usage().
  void AddString(const std::string& name, std::string* target, const std::string& help);
  void AddInt64(const std::string& name, int64_t* target, const std::string& help);
  void AddInt32(const std::string& name, int32_t* target, const std::string& help);
  void AddDouble(const std::string& name, double* target, const std::string& help);
  void AddBool(const std::string& name, bool* target, const std::string& help);
  void AddDuration(const std::string& name, absl::Duration* target, const std::string& help);

  // Accepts --name=value, --name value and, for booleans, --name / --name=true|false.
  // Positional arguments are an error unless AllowPositional() was called.
  absl::Status Parse(const std::vector<std::string>& args);
  void AllowPositional(std::string description) { positional_help_ = std::move(description); }

  bool help_requested() const { return help_requested_; }
  // True if the flag appeared on the command line.
  bool WasSet(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }
  std::string Usage() const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::string default_text;
    bool is_bool = false;
    std::function<absl::Status(const std::string&)> set;
  };
  void Add(Flag flag);

  std::string command_;
  std::string summary_;
  std::string positional_help_;
  std::vector<Flag> flags_;
  std::vector<std::string> set_flags_;
  std::vector<std::string> positional_;
  bool help_requested_ = false;
};

// Converts argv[first..argc) to strings.
std::vector<std::string> ArgsFrom(int argc, char** argv, int first);

}  // namespace kvrelay
