// The kvrelay binary: one executable, one subcommand per job. This table only dispatches: every
// command is declared in the command.h of the folder that owns it, in that folder's namespace:
// a server in `<module>/server/command.h`, an offline tool in `<module>/tools/command.h`, the
// client-side commands in `cli/command.h`, `cli/up/command.h`, `cli/bench_serve/command.h`.
// Adding a command touches its own folder and one line here.

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "cachestore/server/command.h"
#include "cachestore/tools/command.h"
#include "cli/bench_serve/command.h"
#include "cli/command.h"
#include "cli/up/command.h"
#include "common/flags.h"
#include "decode/server/command.h"
#include "gateway/server/command.h"
#include "model/tools/command.h"
#include "prefill/server/command.h"
#include "sim/tools/command.h"
#include "tokenizer/tools/command.h"
#include "transfer/ucx/tools/command.h"

namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

// Keep sorted by name.
constexpr Subcommand kSubcommands[] = {
    {"bench-serve", "load-test a gateway: trace replay or synthetic, latency/goodput/hit rate",
     kvrelay::cli::bench_serve::RunBenchServeCommand},
    {"cachestore", "run the cache store service (block index, placement, eviction)",
     kvrelay::cachestore::server::RunCacheStoreCommand},
    {"decode", "run a decode worker (receives KV, continuous-batching decode)",
     kvrelay::decode::server::RunDecodeCommand},
    {"gateway", "run the gateway (Generate with KV-aware routing)",
     kvrelay::gateway::server::RunGatewayCommand},
    {"generate", "generate tokens through a gateway, or co-located in this process",
     kvrelay::cli::RunGenerateCommand},
    {"health", "check a server's grpc.health.v1 status (exit 0 when SERVING)",
     kvrelay::cli::up::RunHealthCommand},
    {"layout", "KV-cache bytes of a model: per token, per block, per sequence",
     kvrelay::cli::RunLayoutCommand},
    {"make-test-model", "write a small random-weight model (config.json + safetensors)",
     kvrelay::model::tools::RunMakeTestModelCommand},
    {"plan", "capacity planner: hit rate, compute saved, bytes moved per memory size and model",
     kvrelay::cachestore::tools::RunPlanCommand},
    {"prefill", "run a prefill worker (computes or reuses KV, pushes it to decode)",
     kvrelay::prefill::server::RunPrefillCommand},
    {"simulate",
     "simulate a cluster serving a trace: the real routing and store on a simulated clock",
     kvrelay::sim::tools::RunSimulateCommand},
    {"status", "show the cluster: nodes, states, cache, hit rate, breakers, rates, store leader",
     kvrelay::cli::RunStatusCommand},
    {"token", "print a bearer token (JWT) naming a tenant, for gateway --tenant-token-keys",
     kvrelay::gateway::server::RunTokenCommand},
    {"tokenize", "encode text or decode ids with a model's tokenizer.json",
     kvrelay::tokenizer::tools::RunTokenizeCommand},
    {"trace-replay", "replay a request trace through the cache store's eviction code",
     kvrelay::cachestore::tools::RunTraceReplayCommand},
    {"trace-gen", "write a generated request trace (multiturn, agent, scan, shift)",
     kvrelay::cachestore::tools::RunTraceGenCommand},
    {"transfer-bench", "UCX block transfer bandwidth/latency between two local processes",
     kvrelay::transfer::ucx::tools::RunTransferBenchCommand},
    {"up", "start a local cluster (cache store, workers, gateway) on loopback",
     kvrelay::cli::up::RunUpCommand},
};

void PrintUsage(FILE* out) {
  std::fprintf(out,
               "kvrelay: a disaggregated KV-cache service for LLM serving.\n\n"
               "Usage: kvrelay <command> [flags]   (kvrelay <command> --help for its flags)\n\n"
               "Commands:\n");
  for (const Subcommand& c : kSubcommands) std::fprintf(out, "  %-16s %s\n", c.name, c.summary);
}

}  // namespace

int main(int argc, char** argv) {
#ifdef NDEBUG
  // Debian's Abseil is built without NDEBUG, so absl::Mutex checks for deadlocks on every
  // acquisition: a lookup in one process-wide graph under one global lock (GraphCycles), which
  // perf put at ~10% of the cache store's CPU under MatchPrefix load. Release binaries skip it;
  // the test binaries (their own main) keep it, so lock-order inversions still fail tests.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  if (argc < 2) {
    PrintUsage(stderr);
    return 2;
  }
  const char* name = argv[1];
  if (std::strcmp(name, "--help") == 0 || std::strcmp(name, "-h") == 0 ||
      std::strcmp(name, "help") == 0) {
    PrintUsage(stdout);
    return 0;
  }
  for (const Subcommand& c : kSubcommands) {
    if (std::strcmp(c.name, name) == 0) return c.run(kvrelay::ArgsFrom(argc, argv, 2));
  }
  std::fprintf(stderr, "kvrelay: unknown command '%s'\n\n", name);
  PrintUsage(stderr);
  return 2;
}
