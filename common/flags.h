#pragma once

// Per-subcommand flag parsing for the `kvrelay` binary. Abseil's flags are process-global, so
// two subcommands could not both own `--json`; each subcommand builds its own FlagSet instead.
//
// A subcommand is a declaration of its flags plus its body:
//
//   FlagSet flags("layout", "Prints the KV-cache layout of a model.");
//   std::string preset;
//   flags.AddString("preset", &preset, "built-in model name");
//   if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
//   if (preset.empty()) return UsageError(flags.command(), "--preset is required");
//   ...
//
// Server subcommands use server::ParseCommandLine (common/server/server_flags.h), which adds
// --config FILE.yaml and the TLS flags' rules on top of this.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
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

  const std::string& command() const { return command_; }
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

// The parse step every subcommand shares: parses `args` and answers --help. Returns the exit
// code to return at once (0 after --help, with the usage on stdout; 2 after a bad command line,
// with "kvrelay <command>: <message>" on stderr), or nullopt to go on with the command's body.
std::optional<int> ParseCommandLine(FlagSet& flags, const std::vector<std::string>& args);

// Prints "kvrelay <command>: <message>" on stderr and returns `exit_code` (2: bad usage).
int UsageError(absl::string_view command, absl::string_view message, int exit_code = 2);

// For a step that failed: prints "kvrelay <command>: <message>" and returns 2 when the status
// says the input was wrong (InvalidArgument, NotFound: a bad flag value or a missing file), else 1.
int CommandFailed(absl::string_view command, const absl::Status& status);

}  // namespace kvrelay
