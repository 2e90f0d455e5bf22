#include "cli/bench_serve/fault_contract.h"

#include <algorithm>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "cli/bench_serve/stats.h"

namespace kvrelay::cli::bench_serve {
namespace {

// The single store ("store") or a replica of an HA store set ("store-0", ...): every request
// asks the store set (its leader), so each is judged on every request.
bool IsStore(const std::string& node) { return node == "store" || node.rfind("store-", 0) == 0; }

// Actions after which the node is back (at the event's end) and must serve again.
bool ComesBack(const FaultVerdict& v, const std::vector<std::string>& words) {
  if (v.action == "stop" || v.action == "cut" || v.action == "restart" || v.action == "add" ||
      v.action == "drain") {
    return true;
  }
  return v.action == "kill" && words.size() >= 4 && words[2] == "for";  // kill ... for 3s
}

// Planned restarts and scale-in (SIGTERM drain; restarted with the same node id or not):
// nothing may fail.
bool Planned(const FaultVerdict& v) {
  return v.action == "drain" || v.action == "rollout" || v.action == "retire";
}

bool Contains(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

// The start of the first fault after `t` (infinity when none).
double NextFaultAfter(const std::vector<FaultEvent>& faults, double t) {
  double next = std::numeric_limits<double>::infinity();
  for (const FaultEvent& f : faults) {
    if (f.start_s > t) next = std::min(next, f.start_s);
  }
  return next;
}

std::string VerdictName(const FaultVerdict& v) {
  return absl::StrFormat("%.1fs %s", v.fault.start_s, v.fault.label);
}

// Until when a fault's effects count: `serve_again` after the node is back (or after the fault
// ended, for one that does not come back).
double ActiveUntil(const FaultVerdict& v, const FaultContract& contract) {
  const double back = v.recovered_s >= 0 ? v.recovered_s : std::max(v.fault.start_s, v.fault.end_s);
  return back + contract.serve_again_s;
}

bool HasTtft(const RequestRecord& r) { return r.ok() && r.ttft_ms >= 0; }

// The latency clause: requests sent while a fault is active, none in flight when it struck,
// against the requests no fault touched.
void CheckLatency(const std::vector<RequestRecord>& records, const FaultContract& contract,
                  ContractReport& report) {
  std::vector<double> steady;
  for (const RequestRecord& r : records) {
    if (!HasTtft(r)) continue;
    bool touched = false;
    for (const FaultVerdict& v : report.verdicts) {
      if (v.action == "dup") continue;
      touched |= r.send_s <= ActiveUntil(v, contract) && r.end_s >= v.fault.start_s;
    }
    if (!touched) steady.push_back(r.ttft_ms);
  }
  report.steady_requests = static_cast<int64_t>(steady.size());
  constexpr int64_t kMinBaseline = 10;
  if (report.steady_requests >= kMinBaseline) report.steady_ttft_p99_ms = Percentile(steady, 99);
  const double limit_ms =
      report.steady_ttft_p99_ms * contract.ttft_factor + contract.ttft_floor_s * 1e3;
  for (FaultVerdict& v : report.verdicts) {
    if (v.action == "dup") continue;
    std::vector<double> window;
    for (const RequestRecord& r : records) {
      if (HasTtft(r) && r.send_s >= v.fault.start_s && r.send_s <= ActiveUntil(v, contract)) {
        window.push_back(r.ttft_ms);
      }
    }
    v.window_requests = static_cast<int64_t>(window.size());
    if (window.empty()) continue;
    v.window_ttft_p99_ms = Percentile(window, 99);
    if (report.steady_ttft_p99_ms < 0) {
      v.not_judged.push_back(
          absl::StrFormat("%s: latency: %d requests no fault touched, too few for a baseline (%d)",
                          VerdictName(v), report.steady_requests, kMinBaseline));
    } else if (v.window_ttft_p99_ms > limit_ms) {
      v.violations.push_back(absl::StrFormat(
          "%s: p99 TTFT %.0f ms of the %d requests sent while it was active, above %.1fx the "
          "fault-free p99 %.0f ms + %.0f ms",
          VerdictName(v), v.window_ttft_p99_ms, v.window_requests, contract.ttft_factor,
          report.steady_ttft_p99_ms, contract.ttft_floor_s * 1e3));
    }
  }
}

// The fair-share clause: a worker back from a fault (or added) serves its share of its role's
// requests in the serve-again window that follows its own serve-again limit.
void CheckFairShare(const std::vector<RequestRecord>& records,
                    const std::vector<FaultEvent>& faults,
                    const std::map<std::string, std::vector<std::string>>& nodes,
                    const FaultContract& contract, ContractReport& report) {
  for (FaultVerdict& v : report.verdicts) {
    if (v.recovered_s < 0 || IsStore(v.target) || v.action == "dup") continue;
    const size_t dash = v.target.rfind('-');
    if (dash == std::string::npos) continue;
    const std::string role = v.target.substr(0, dash);  // "decode-0" -> "decode"
    const bool decode = role == "decode";
    if (!decode && role != "prefill") continue;
    const double from = v.recovered_s + contract.serve_again_s;
    const double to =
        std::min(from + contract.serve_again_s, NextFaultAfter(faults, v.recovered_s));
    if (to - from < contract.serve_again_s / 2) {
      v.not_judged.push_back(
          absl::StrCat(VerdictName(v), ": fair share: the next fault struck first"));
      continue;
    }
    std::map<std::string, int64_t> served;  // node of the role -> requests
    int64_t total = 0;
    for (const RequestRecord& r : records) {
      if (!r.ok() || r.send_s < from || r.send_s >= to) continue;
      const std::string& address = decode ? r.decode_worker : r.prefill_worker;
      for (const auto& [node, addresses] : nodes) {
        if (node.rfind(role + "-", 0) == 0 && Contains(addresses, address)) {
          ++served[node];
          ++total;
          break;
        }
      }
    }
    served.try_emplace(v.target, 0);
    const auto serving = static_cast<int64_t>(served.size());
    if (total < 2 * serving) {
      v.not_judged.push_back(
          absl::StrFormat("%s: fair share: %d %s requests in the window, too few for %d nodes",
                          VerdictName(v), total, role, serving));
      continue;
    }
    v.fair_share = 1.0 / static_cast<double>(serving);
    v.share = static_cast<double>(served[v.target]) / static_cast<double>(total);
    if (v.share < contract.fair_share * v.fair_share) {
      v.violations.push_back(absl::StrFormat(
          "%s: %s served %d of the %d %s requests sent %.1f-%.1f s after it was back (%.0f%%), "
          "below %.2f of its fair share %.0f%%",
          VerdictName(v), v.target, served[v.target], total, role, from - v.recovered_s,
          to - v.recovered_s, 100 * v.share, contract.fair_share, 100 * v.fair_share));
    }
  }
}

}  // namespace

absl::StatusOr<FaultContract> ParseFaultContract(const std::string& text) {
  FaultContract c;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, '=');
    const absl::string_view key = absl::StripAsciiWhitespace(kv.first);
    const absl::string_view value = absl::StripAsciiWhitespace(kv.second);
    if (key == "ttft-factor" || key == "fair-share") {
      double x = 0;
      if (!absl::SimpleAtod(value, &x) || !(x >= 0) || x > 1e6) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--fault-contract ", key, ": want a non-negative number like 3, got '", value, "'"));
      }
      (key == "ttft-factor" ? c.ttft_factor : c.fair_share) = x;
      continue;
    }
    absl::Duration d;
    if (!absl::ParseDuration(value, &d) || d < absl::ZeroDuration() ||
        d == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fault-contract ", key, ": want a duration like 5s or 500ms, got '", value, "'"));
    }
    const double s = absl::ToDoubleSeconds(d);
    if (key == "serve-again") {
      c.serve_again_s = s;
    } else if (key == "hits-again") {
      c.hits_again_s = s;
    } else if (key == "deadline-slack") {
      c.deadline_slack_s = s;
    } else if (key == "ttft-floor") {
      c.ttft_floor_s = s;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fault-contract: unknown key '", key,
          "' (want serve-again, hits-again, deadline-slack, ttft-factor, ttft-floor or "
          "fair-share)"));
    }
  }
  return c;
}

std::map<std::string, std::vector<std::string>> ParseNodeAddresses(const std::string& text) {
  std::map<std::string, std::vector<std::string>> nodes;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (!absl::ConsumePrefix(&line, "@node ")) continue;
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (words.size() < 2) continue;
    std::vector<std::string>& addresses = nodes[words[0]];
    for (absl::string_view a : absl::StrSplit(words[1], ',', absl::SkipWhitespace())) {
      addresses.emplace_back(a);
    }
  }
  return nodes;
}

ContractReport CheckFaultContract(const std::vector<RequestRecord>& records,
                                  const std::vector<FaultEvent>& faults,
                                  const std::map<std::string, std::vector<std::string>>& nodes,
                                  const FaultContract& contract, double timeout_s) {
  ContractReport report;
  std::vector<std::vector<std::string>> words_of(faults.size());
  for (size_t i = 0; i < faults.size(); ++i) {
    FaultVerdict v;
    v.fault = faults[i];
    words_of[i] = absl::StrSplit(faults[i].label, ' ', absl::SkipWhitespace());
    if (!words_of[i].empty()) v.action = words_of[i][0];
    if (words_of[i].size() >= 2) v.target = words_of[i][1];
    if (ComesBack(v, words_of[i])) v.recovered_s = faults[i].end_s;
    report.verdicts.push_back(std::move(v));
  }

  // Was `r` on `node`? The gateway names the pair that served a request by address, and a failed
  // request's structured error names the node (or address) that failed.
  auto on_node = [&](const RequestRecord& r, const std::string& node) {
    if (IsStore(node)) return true;  // every request asks the store
    if (!r.error_node_id.empty() && r.error_node_id == node) return true;
    auto it = nodes.find(node);
    if (it == nodes.end()) return false;
    return Contains(it->second, r.prefill_worker) || Contains(it->second, r.decode_worker) ||
           (!r.gateway.empty() && Contains(it->second, r.gateway)) ||
           (!r.error_address.empty() && Contains(it->second, r.error_address));
  };
  auto in_flight_at = [](const RequestRecord& r, double t) { return r.send_s <= t && r.end_s > t; };

  for (size_t i = 0; i < report.verdicts.size(); ++i) {
    FaultVerdict& v = report.verdicts[i];
    for (const RequestRecord& r : records) {
      if (!in_flight_at(r, v.fault.start_s)) continue;
      ++v.in_flight;
      if (on_node(r, v.target)) ++v.in_flight_on_target;
    }
  }

  // Each failed request goes to the latest fault that struck before it ended while it was in
  // flight on the faulted node; else to the latest fault that struck before it ended.
  for (const RequestRecord& r : records) {
    if (r.ok() || r.cut) continue;
    int chosen = -1, latest = -1;
    for (size_t i = 0; i < report.verdicts.size(); ++i) {
      const FaultVerdict& v = report.verdicts[i];
      if (v.fault.start_s > r.end_s) continue;
      if (latest < 0 || v.fault.start_s >= report.verdicts[latest].fault.start_s) {
        latest = static_cast<int>(i);
      }
      if (in_flight_at(r, v.fault.start_s) && on_node(r, v.target) &&
          (chosen < 0 || v.fault.start_s >= report.verdicts[chosen].fault.start_s)) {
        chosen = static_cast<int>(i);
      }
    }
    if (chosen < 0) chosen = latest;
    if (chosen < 0) {
      ++report.failed_without_fault;
    } else {
      ++report.verdicts[chosen].failed;
    }
  }

  for (size_t i = 0; i < report.verdicts.size(); ++i) {
    FaultVerdict& v = report.verdicts[i];
    const std::string name = VerdictName(v);
    if (v.action == "dup") {
      if (words_of[i].size() < 3 || words_of[i][2] != "refused") {
        v.violations.push_back(absl::StrCat(name,
                                            ": a second process with the same node id "
                                            "was not refused"));
      }
      continue;
    }
    if (Planned(v) && v.failed > 0) {
      v.violations.push_back(
          absl::StrFormat("%s: %d requests failed; a drain may fail none", name, v.failed));
    } else if (v.failed > v.in_flight_on_target) {
      v.violations.push_back(
          absl::StrFormat("%s: %d requests failed, more than the %d in flight on %s when it struck",
                          name, v.failed, v.in_flight_on_target, v.target));
    }
    if (v.recovered_s < 0) continue;
    // Only requests sent before the next fault struck speak for this one's recovery.
    const double next_fault_s = NextFaultAfter(faults, v.recovered_s);
    bool could_hit = false;
    for (const RequestRecord& r : records) {
      if (!r.ok() || r.send_s < v.recovered_s || r.send_s >= next_fault_s) continue;
      const double after = r.end_s - v.recovered_s;
      if (IsStore(v.target) || on_node(r, v.target)) {
        if (v.served_again_s < 0 || after < v.served_again_s) v.served_again_s = after;
      }
      could_hit |= r.ideal_cached_tokens > 0;
      if (IsStore(v.target) && r.cached_tokens > 0 &&
          (v.hits_again_s < 0 || after < v.hits_again_s)) {
        v.hits_again_s = after;
      }
    }
    const bool cut_short = next_fault_s - v.recovered_s < contract.serve_again_s;
    if (v.served_again_s < 0 && cut_short) {
      v.not_judged.push_back(
          absl::StrFormat("%s: serves again: the next fault struck %.1f s after it was back", name,
                          next_fault_s - v.recovered_s));
    } else if (v.served_again_s < 0 || v.served_again_s > contract.serve_again_s) {
      v.violations.push_back(
          v.served_again_s < 0
              ? absl::StrCat(name, ": ", v.target, " never served a request after it was back")
              : absl::StrFormat("%s: %s served again %.1f s after it was back (limit %.1f s)", name,
                                v.target, v.served_again_s, contract.serve_again_s));
    }
    if (IsStore(v.target) && v.hits_again_s < 0 && (!could_hit || cut_short)) {
      v.not_judged.push_back(
          absl::StrCat(name, ": hits again: ",
                       cut_short ? "the next fault struck first"
                                 : "no request that could hit was sent after the store was back"));
    } else if (IsStore(v.target) &&
               (v.hits_again_s < 0 || v.hits_again_s > contract.hits_again_s)) {
      v.violations.push_back(
          v.hits_again_s < 0
              ? absl::StrCat(name, ": no prefix hit after the store was back")
              : absl::StrFormat("%s: prefix hits came back %.1f s after the store (limit %.1f s)",
                                name, v.hits_again_s, contract.hits_again_s));
    }
  }

  CheckLatency(records, contract, report);
  CheckFairShare(records, faults, nodes, contract, report);

  for (const RequestRecord& r : records) {
    report.max_e2e_ms = std::max(report.max_e2e_ms, r.e2e_ms);
    if (r.e2e_ms > (timeout_s + contract.deadline_slack_s) * 1e3) ++report.over_deadline;
  }
  if (report.failed_without_fault > 0) {
    report.violations.push_back(
        absl::StrCat(report.failed_without_fault, " requests failed before any fault struck"));
  }
  if (report.over_deadline > 0) {
    report.violations.push_back(absl::StrFormat(
        "%d requests outlived their %.1f s deadline by more than %.1f s (longest %.0f ms)",
        report.over_deadline, timeout_s, contract.deadline_slack_s, report.max_e2e_ms));
  }
  for (const FaultVerdict& v : report.verdicts) {
    report.violations.insert(report.violations.end(), v.violations.begin(), v.violations.end());
  }
  return report;
}

}  // namespace kvrelay::cli::bench_serve
