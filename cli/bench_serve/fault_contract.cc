#include "cli/bench_serve/fault_contract.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"

namespace kvrelay::cli::bench_serve {
namespace {

bool IsStore(const std::string& node) { return node == "store"; }

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

}  // namespace

absl::StatusOr<FaultContract> ParseFaultContract(const std::string& text) {
  FaultContract c;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, '=');
    const absl::string_view key = absl::StripAsciiWhitespace(kv.first);
    const absl::string_view value = absl::StripAsciiWhitespace(kv.second);
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
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--fault-contract: unknown key '", key,
                       "' (want serve-again, hits-again or deadline-slack)"));
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
    const std::string name = absl::StrFormat("%.1fs %s", v.fault.start_s, v.fault.label);
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
    for (const RequestRecord& r : records) {
      if (!r.ok() || r.send_s < v.recovered_s) continue;
      const double after = r.end_s - v.recovered_s;
      if (IsStore(v.target) || on_node(r, v.target)) {
        if (v.served_again_s < 0 || after < v.served_again_s) v.served_again_s = after;
      }
      if (IsStore(v.target) && r.cached_tokens > 0 &&
          (v.hits_again_s < 0 || after < v.hits_again_s)) {
        v.hits_again_s = after;
      }
    }
    if (v.served_again_s < 0 || v.served_again_s > contract.serve_again_s) {
      v.violations.push_back(
          v.served_again_s < 0
              ? absl::StrCat(name, ": ", v.target, " never served a request after it was back")
              : absl::StrFormat("%s: %s served again %.1f s after it was back (limit %.1f s)", name,
                                v.target, v.served_again_s, contract.serve_again_s));
    }
    if (IsStore(v.target) && (v.hits_again_s < 0 || v.hits_again_s > contract.hits_again_s)) {
      v.violations.push_back(
          v.hits_again_s < 0
              ? absl::StrCat(name, ": no prefix hit after the store was back")
              : absl::StrFormat("%s: prefix hits came back %.1f s after the store (limit %.1f s)",
                                name, v.hits_again_s, contract.hits_again_s));
    }
  }

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
