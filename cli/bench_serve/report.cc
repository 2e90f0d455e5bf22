#include "cli/bench_serve/report.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvrelay::cli::bench_serve {
namespace {

std::string Ms(double v) { return std::isnan(v) ? "-" : absl::StrFormat("%.1f", v); }

std::string DistRow(const char* name, const Distribution& d) {
  return absl::StrFormat("  %-10s %9s %9s %9s %9s %9s %7d\n", name, Ms(d.mean), Ms(d.p50),
                         Ms(d.p90), Ms(d.p99), Ms(d.max), d.count);
}

std::string MiB(int64_t bytes) { return absl::StrFormat("%.1f MiB", bytes / 1048576.0); }

nlohmann::json DistJson(const Distribution& d) {
  auto num = [](double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); };
  return {{"count", d.count},  {"mean", num(d.mean)}, {"p50", num(d.p50)},
          {"p90", num(d.p90)}, {"p99", num(d.p99)},   {"max", num(d.max)}};
}

nlohmann::json Finite(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

std::string FormatRun(const ReportContext& c, const RunReport& run) {
  const Summary& s = run.summary;
  std::string out;
  if (run.rate) absl::StrAppend(&out, absl::StrFormat("--- request rate %.3g/s ---\n", *run.rate));
  absl::StrAppend(
      &out,
      absl::StrFormat(
          "requests        %d sent: %d ok, %d failed, %d cut by --max-duration; %d not sent%s\n",
          s.requests, s.ok, s.failed, s.cut, run.not_sent,
          run.stopped_by_duration ? " (--max-duration reached)" : ""));
  absl::StrAppend(
      &out, absl::StrFormat("duration        %.1f s%s\n", s.duration_s,
                            s.late_sends > 0 ? absl::StrCat("  (", s.late_sends,
                                                            " sent >100 ms late: client saturated, "
                                                            "raise --concurrency)")
                                             : ""));
  if (s.gateway_retries > 0) {
    absl::StrAppend(&out,
                    absl::StrFormat("gateway retries %d sends of %d requests went to the next "
                                    "gateway (one refused them before any token)\n",
                                    s.gateway_retries, s.retried_requests));
  }
  absl::StrAppend(&out, absl::StrFormat("throughput      %.2f req/s, %.1f output tok/s\n",
                                        s.request_rate, s.output_token_rate));
  absl::StrAppend(
      &out,
      absl::StrFormat(
          "goodput         %.2f req/s (%d of %d requests %s)\n", s.goodput, s.good, s.requests,
          c.slo_text.empty() ? "succeeded; no --slo" : absl::StrCat("met --slo ", c.slo_text)));
  absl::StrAppend(&out, absl::StrFormat("  %-10s %9s %9s %9s %9s %9s %7s\n", "ms", "mean", "p50",
                                        "p90", "p99", "max", "n"));
  absl::StrAppend(&out, DistRow("TTFT", s.ttft_ms), DistRow("TPOT", s.tpot_ms),
                  DistRow("ITL", s.itl_ms), DistRow("E2E", s.e2e_ms));
  absl::StrAppend(
      &out, absl::StrFormat("prompt tokens   %d: %d cached, %d computed; %d output tokens\n",
                            s.prompt_tokens, s.cached_tokens, s.computed_tokens, s.output_tokens));
  absl::StrAppend(
      &out, absl::StrFormat(
                "prefix hit rate %.3f of prompt tokens (ideal with an infinite cache: %.3f)\n",
                s.hit_rate, s.ideal_hit_rate));
  absl::StrAppend(&out, absl::StrFormat("KV bytes        %s pushed prefill->decode, %s fetched "
                                        "for reuse\n",
                                        MiB(s.transferred_bytes), MiB(s.fetched_bytes)));
  if (s.errors.empty()) {
    absl::StrAppend(&out, "errors          none\n");
  } else {
    for (const auto& [code, count] : s.errors) {
      absl::StrAppend(&out, absl::StrFormat("errors          %d %s, e.g. \"%s\"\n", count, code,
                                            s.error_example.at(code).substr(0, 120)));
    }
  }
  if (c.verify) {
    absl::StrAppend(
        &out,
        absl::StrFormat("wrong tokens    %d (%d requests compared with the co-located reference)\n",
                        s.wrong_tokens, s.verified));
  } else {
    absl::StrAppend(&out, "wrong tokens    not checked (pass --verify --model DIR)\n");
  }
  if (!run.faults.empty()) {
    absl::StrAppend(&out,
                    absl::StrFormat("faults  %7s  %-28s %6s %6s %6s %6s %10s %9s\n", "at", "what",
                                    "ended", "failed", "slow", "wrong", "p99 TTFT", "recovery"));
    for (const FaultCost& f : run.faults) {
      absl::StrAppend(
          &out, absl::StrFormat(
                    "        %6.1fs  %-28s %6d %6d %6d %6d %10s %9s\n", f.fault.start_s,
                    f.fault.label.substr(0, 28), f.requests, f.failed, f.slo_missed, f.wrong_tokens,
                    std::isnan(f.ttft_p99_ms) ? "-" : absl::StrFormat("%.0f ms", f.ttft_p99_ms),
                    f.recovery_s < 0 ? "never" : absl::StrFormat("%.1f s", f.recovery_s)));
    }
    for (const FaultCost& f : run.faults) {
      if (f.requests_during == 0) continue;
      absl::StrAppend(
          &out, absl::StrFormat("        %6.1fs  %-28s p99 TTFT %.0f ms over the %d "
                                "requests sent during it, %s before it\n",
                                f.fault.start_s, f.fault.label.substr(0, 28), f.ttft_p99_during_ms,
                                f.requests_during,
                                std::isnan(f.ttft_p99_before_ms)
                                    ? "none ended"
                                    : absl::StrFormat("%.0f ms", f.ttft_p99_before_ms)));
    }
    absl::StrAppend(&out,
                    "        (ended: requests that ended before the next fault; slow: ok "
                    "but missed the SLO;\n         recovery: until a request sent after "
                    "the last bad one completed well)\n");
  }
  if (run.contract.has_value()) {
    const ContractReport& k = *run.contract;
    absl::StrAppend(&out, absl::StrFormat("contract %6s  %-28s %9s %6s %11s %10s %12s %9s\n", "at",
                                          "what", "in flight", "failed", "serves again",
                                          "hits again", "p99 TTFT", "share"));
    auto seconds = [](double s) { return s < 0 ? std::string("-") : absl::StrFormat("%.1f s", s); };
    for (const FaultVerdict& v : k.verdicts) {
      const std::string p99 =
          v.window_ttft_p99_ms < 0 ? "-" : absl::StrFormat("%.0f ms", v.window_ttft_p99_ms);
      const std::string share =
          v.share < 0 ? "-" : absl::StrFormat("%.0f/%.0f%%", 100 * v.share, 100 * v.fair_share);
      absl::StrAppend(
          &out, absl::StrFormat("        %6.1fs  %-28s %4d/%-4d %6d %11s %10s %12s %9s\n",
                                v.fault.start_s, v.fault.label.substr(0, 28), v.in_flight_on_target,
                                v.in_flight, v.failed, seconds(v.served_again_s),
                                seconds(v.hits_again_s), p99, share));
    }
    absl::StrAppend(
        &out,
        absl::StrFormat("        (in flight: on the faulted node / in all; p99 TTFT: of the "
                        "requests sent while it was active, fault-free p99 %s over %d; "
                        "share: of its role's requests after it was back / fair; failed "
                        "without a fault: %d; longest request %.0f ms)\n",
                        k.steady_ttft_p99_ms < 0 ? std::string("-")
                                                 : absl::StrFormat("%.0f ms", k.steady_ttft_p99_ms),
                        k.steady_requests, k.failed_without_fault, k.max_e2e_ms));
    for (const FaultVerdict& v : k.verdicts) {
      for (const std::string& n : v.not_judged) {
        absl::StrAppend(&out, "contract        not judged: ", n, "\n");
      }
    }
    if (k.kept()) {
      absl::StrAppend(&out, "contract        kept\n");
    } else {
      for (const std::string& v : k.violations) {
        absl::StrAppend(&out, "contract        VIOLATED: ", v, "\n");
      }
    }
  }
  return out;
}

}  // namespace

std::string FormatTable(const ReportContext& c, const std::vector<RunReport>& runs) {
  std::string out =
      "============================ kvrelay bench-serve ============================\n";
  absl::StrAppend(&out, "workload        ", c.workload, "\n");
  if (c.truncated_prompts > 0) {
    absl::StrAppend(&out, "                ", c.truncated_prompts,
                    " prompts cut to --max-prompt-tokens\n");
  }
  if (c.trace_ideal_block_hit_rate >= 0) {
    absl::StrAppend(&out, absl::StrFormat("trace ideal     %.3f of trace blocks hit with an "
                                          "infinite cache (requests replayed)\n",
                                          c.trace_ideal_block_hit_rate));
  }
  for (const RunReport& run : runs) absl::StrAppend(&out, FormatRun(c, run));
  if (runs.size() > 1) {
    absl::StrAppend(&out,
                    "sweep     rate/s  ok req/s  goodput  TTFT p50   TTFT p99   TPOT p50   "
                    "TPOT p99  failed\n");
    for (const RunReport& run : runs) {
      const Summary& s = run.summary;
      absl::StrAppend(
          &out, absl::StrFormat("       %9.3g %9.2f %8.2f %9s %10s %10s %10s %7d\n",
                                run.rate.value_or(0), s.request_rate, s.goodput, Ms(s.ttft_ms.p50),
                                Ms(s.ttft_ms.p99), Ms(s.tpot_ms.p50), Ms(s.tpot_ms.p99), s.failed));
    }
  }
  absl::StrAppend(
      &out, "=============================================================================\n");
  return out;
}

nlohmann::json ReportJson(const ReportContext& c, const std::vector<RunReport>& runs,
                          bool with_requests) {
  nlohmann::json j;
  j["workload"] = c.workload;
  j["slo"] = c.slo_text;
  j["verify"] = c.verify;
  j["truncated_prompts"] = c.truncated_prompts;
  if (c.trace_ideal_block_hit_rate >= 0) {
    j["trace_ideal_block_hit_rate"] = c.trace_ideal_block_hit_rate;
  }
  j["runs"] = nlohmann::json::array();
  for (const RunReport& run : runs) {
    const Summary& s = run.summary;
    nlohmann::json r;
    r["rate"] = run.rate ? nlohmann::json(*run.rate) : nlohmann::json();
    r["start_unix"] = run.start_unix;
    r["not_sent"] = run.not_sent;
    r["stopped_by_duration"] = run.stopped_by_duration;
    nlohmann::json errors = nlohmann::json::object();
    for (const auto& [code, count] : s.errors) {
      errors[code] = {{"count", count}, {"example", s.error_example.at(code)}};
    }
    r["summary"] = {{"duration_s", s.duration_s},
                    {"requests", s.requests},
                    {"ok", s.ok},
                    {"failed", s.failed},
                    {"cut", s.cut},
                    {"good", s.good},
                    {"request_rate", s.request_rate},
                    {"output_token_rate", s.output_token_rate},
                    {"goodput", s.goodput},
                    {"ttft_ms", DistJson(s.ttft_ms)},
                    {"tpot_ms", DistJson(s.tpot_ms)},
                    {"itl_ms", DistJson(s.itl_ms)},
                    {"e2e_ms", DistJson(s.e2e_ms)},
                    {"prompt_tokens", s.prompt_tokens},
                    {"cached_tokens", s.cached_tokens},
                    {"computed_tokens", s.computed_tokens},
                    {"output_tokens", s.output_tokens},
                    {"hit_rate", s.hit_rate},
                    {"ideal_hit_rate", s.ideal_hit_rate},
                    {"transferred_bytes", s.transferred_bytes},
                    {"fetched_bytes", s.fetched_bytes},
                    {"errors", errors},
                    {"verified", s.verified},
                    {"wrong_tokens", s.wrong_tokens},
                    {"late_sends", s.late_sends},
                    {"gateway_retries", s.gateway_retries},
                    {"retried_requests", s.retried_requests}};
    r["faults"] = nlohmann::json::array();
    for (const FaultCost& f : run.faults) {
      r["faults"].push_back({{"label", f.fault.label},
                             {"start_s", f.fault.start_s},
                             {"end_s", f.fault.end_s},
                             {"window_end_s", f.window_end_s},
                             {"requests", f.requests},
                             {"failed", f.failed},
                             {"slo_missed", f.slo_missed},
                             {"wrong_tokens", f.wrong_tokens},
                             {"ttft_p99_ms", Finite(f.ttft_p99_ms)},
                             {"requests_during", f.requests_during},
                             {"ttft_p99_during_ms", Finite(f.ttft_p99_during_ms)},
                             {"ttft_p99_before_ms", Finite(f.ttft_p99_before_ms)},
                             {"recovery_s", f.recovery_s}});
    }
    if (run.contract.has_value()) {
      const ContractReport& k = *run.contract;
      nlohmann::json verdicts = nlohmann::json::array();
      for (const FaultVerdict& v : k.verdicts) {
        verdicts.push_back({{"label", v.fault.label},
                            {"action", v.action},
                            {"target", v.target},
                            {"start_s", v.fault.start_s},
                            {"recovered_s", v.recovered_s},
                            {"in_flight", v.in_flight},
                            {"in_flight_on_target", v.in_flight_on_target},
                            {"failed", v.failed},
                            {"served_again_s", v.served_again_s},
                            {"hits_again_s", v.hits_again_s},
                            {"window_requests", v.window_requests},
                            {"window_ttft_p99_ms", v.window_ttft_p99_ms},
                            {"share", v.share},
                            {"fair_share", v.fair_share},
                            {"violations", v.violations},
                            {"not_judged", v.not_judged}});
      }
      r["contract"] = {{"kept", k.kept()},
                       {"faults", verdicts},
                       {"failed_without_fault", k.failed_without_fault},
                       {"over_deadline", k.over_deadline},
                       {"max_e2e_ms", k.max_e2e_ms},
                       {"steady_requests", k.steady_requests},
                       {"steady_ttft_p99_ms", k.steady_ttft_p99_ms},
                       {"violations", k.violations}};
    }
    if (with_requests) {
      nlohmann::json reqs = nlohmann::json::array();
      for (const RequestRecord& q : run.records) {
        reqs.push_back({{"index", q.index},
                        {"send_s", q.send_s},
                        {"end_s", q.end_s},
                        {"code", CodeName(q.code)},
                        {"cut", q.cut},
                        {"ttft_ms", q.ttft_ms},
                        {"tpot_ms", q.tpot_ms},
                        {"e2e_ms", q.e2e_ms},
                        {"prompt_tokens", q.prompt_tokens},
                        {"cached_tokens", q.cached_tokens},
                        {"ideal_cached_tokens", q.ideal_cached_tokens},
                        {"output_tokens", q.output_tokens},
                        {"wrong_tokens", q.wrong_tokens}});
      }
      r["requests"] = std::move(reqs);
    }
    j["runs"].push_back(std::move(r));
  }
  return j;
}

std::string RecordsCsv(const std::vector<RunReport>& runs) {
  std::string out =
      "rate,index,trace_line,scheduled_s,send_s,end_s,outcome,cut,ttft_ms,tpot_ms,e2e_ms,"
      "itl_mean_ms,prompt_tokens,cached_tokens,computed_tokens,ideal_cached_tokens,max_tokens,"
      "output_tokens,transferred_bytes,fetched_bytes,attempts,prefill_worker,decode_worker,"
      "wrong_tokens,prefix_source,gateway,gateway_retries,error\n";
  for (const RunReport& run : runs) {
    for (const RequestRecord& r : run.records) {
      double itl = 0;
      for (double v : r.itl_ms) itl += v;
      if (!r.itl_ms.empty()) itl /= static_cast<double>(r.itl_ms.size());
      std::string error = r.error;
      for (char& ch : error) {
        if (ch == '"') ch = '\'';
        if (ch == '\n') ch = ' ';
      }
      absl::StrAppend(
          &out, absl::StrFormat(
                    "%s,%d,%d,%.4f,%.4f,%.4f,%s,%d,%.3f,%.3f,%.3f,%.3f,%d,%d,%d,%d,%d,%d,%d,%"
                    "d,%d,%s,%s,%d,%s,%s,%d,"
                    "\"%s\"\n",
                    run.rate ? absl::StrFormat("%g", *run.rate) : "", r.index, r.trace_line,
                    r.scheduled_s, r.send_s, r.end_s, CodeName(r.code), r.cut ? 1 : 0, r.ttft_ms,
                    r.tpot_ms, r.e2e_ms, itl, r.prompt_tokens, r.cached_tokens, r.computed_tokens,
                    r.ideal_cached_tokens, r.max_tokens, r.output_tokens, r.transferred_bytes,
                    r.fetched_bytes, r.attempts, r.prefill_worker, r.decode_worker, r.wrong_tokens,
                    r.prefix_source, r.gateway, r.gateway_retries, error));
    }
  }
  return out;
}

}  // namespace kvrelay::cli::bench_serve
