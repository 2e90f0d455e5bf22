#pragma once

// bench-serve's outputs: the human table, the JSON report, the per-request CSV and the PNG plot
// (drawn by matplotlib through Debian's /usr/bin/python3; see plot.cc).

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cli/bench_serve/fault_contract.h"
#include "cli/bench_serve/stats.h"

namespace kvrelay::cli::bench_serve {

// One load run: the whole workload once, or one rate of a sweep.
struct RunReport {
  std::optional<double> rate;  // set for a sweep step (requests/s)
  Summary summary;
  std::vector<FaultCost> faults;
  std::optional<ContractReport> contract;  // with --fault-contract
  std::vector<RequestRecord> records;
  int64_t not_sent = 0;
  bool stopped_by_duration = false;
  double start_unix = 0;
};

struct ReportContext {
  std::string workload;  // one line describing it
  std::string slo_text;  // as given to --slo ("" = none)
  bool verify = false;
  double trace_ideal_block_hit_rate = -1;  // trace mode: the trace's own definition, in blocks
  int64_t truncated_prompts = 0;
};

std::string FormatTable(const ReportContext& context, const std::vector<RunReport>& runs);
nlohmann::json ReportJson(const ReportContext& context, const std::vector<RunReport>& runs,
                          bool with_requests);
std::string RecordsCsv(const std::vector<RunReport>& runs);

// Writes `png` from the report JSON: per run, latency percentiles and prefix hit rate over time
// with the faults marked; for a sweep, TTFT and goodput against the request rate. Runs
// `python` (Debian's, which has matplotlib) on a script written next to the PNG.
absl::Status WritePlot(const std::string& png, const nlohmann::json& report,
                       const std::string& python);

}  // namespace kvrelay::cli::bench_serve
