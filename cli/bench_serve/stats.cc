#include "cli/bench_serve/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"

namespace kvrelay::cli::bench_serve {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// "500ms", "2s", "1.5s", or a bare number of milliseconds.
absl::StatusOr<double> ParseMillis(absl::string_view text, absl::string_view key) {
  double ms = 0;
  if (absl::SimpleAtod(text, &ms)) {
    if (ms > 0) return ms;
  } else {
    absl::Duration d;
    if (absl::ParseDuration(text, &d) && d > absl::ZeroDuration()) {
      return absl::ToDoubleMilliseconds(d);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("--slo ", key, ": want a positive duration ",
                                                 "like 500ms or 2s, got '", text, "'"));
}

}  // namespace

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return kNaN;
  std::sort(values.begin(), values.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  const double frac = rank - static_cast<double>(lo);
  return values[lo] + (values[hi] - values[lo]) * frac;
}

Distribution Distribute(const std::vector<double>& values) {
  Distribution d;
  d.count = static_cast<int64_t>(values.size());
  if (values.empty()) {
    d.mean = d.p50 = d.p90 = d.p99 = d.max = kNaN;
    return d;
  }
  d.mean = std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
  d.p50 = Percentile(values, 50);
  d.p90 = Percentile(values, 90);
  d.p99 = Percentile(values, 99);
  d.max = *std::max_element(values.begin(), values.end());
  return d;
}

absl::StatusOr<Slo> ParseSlo(const std::string& text) {
  Slo slo;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, '=');
    const absl::string_view key = absl::StripAsciiWhitespace(kv.first);
    const absl::string_view value = absl::StripAsciiWhitespace(kv.second);
    absl::StatusOr<double> ms = ParseMillis(value, key);
    if (!ms.ok()) return ms.status();
    if (key == "ttft") {
      slo.ttft_ms = *ms;
    } else if (key == "tpot") {
      slo.tpot_ms = *ms;
    } else if (key == "e2e") {
      slo.e2e_ms = *ms;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--slo: unknown key '", key, "' (want ttft, tpot or e2e)"));
    }
  }
  return slo;
}

bool MeetsSlo(const RequestRecord& r, const Slo& slo) {
  if (!r.ok()) return false;
  if (slo.ttft_ms && !(r.ttft_ms >= 0 && r.ttft_ms <= *slo.ttft_ms)) return false;
  if (slo.tpot_ms && r.tpot_ms >= 0 && r.tpot_ms > *slo.tpot_ms) return false;
  if (slo.e2e_ms && r.e2e_ms > *slo.e2e_ms) return false;
  return true;
}

std::string CodeName(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);
  return name.empty() ? absl::StrCat("CODE_", static_cast<int>(code)) : name;
}

absl::StatusOr<std::vector<FaultEvent>> ParseFaultEvents(const std::string& text,
                                                         double run_start_unix, double run_end_s) {
  std::vector<FaultEvent> events;
  int line = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line;
    const absl::string_view l = absl::StripAsciiWhitespace(raw);
    if (l.empty() || l[0] == '#' || l[0] == '@') continue;  // '@node' lines: ParseNodeAddresses
    std::vector<absl::string_view> f = absl::StrSplit(l, absl::MaxSplits(' ', 2));
    double start = 0, end = 0;
    if (f.size() < 3 || !absl::SimpleAtod(f[0], &start) ||
        !(f[1] == "-" || absl::SimpleAtod(f[1], &end))) {
      return absl::InvalidArgumentError(
          absl::StrCat("fault events line ", line,
                       ": want '<start unix s> <end unix s|-> <label>', got '", l, "'"));
    }
    FaultEvent e;
    e.start_s = start - run_start_unix;
    e.end_s = f[1] == "-" ? run_end_s : std::max(end - run_start_unix, e.start_s);
    e.label = std::string(absl::StripAsciiWhitespace(f[2]));
    events.push_back(std::move(e));
  }
  std::stable_sort(events.begin(), events.end(),
                   [](const FaultEvent& a, const FaultEvent& b) { return a.start_s < b.start_s; });
  return events;
}

std::vector<FaultCost> CostOfFaults(const std::vector<RequestRecord>& records,
                                    const std::vector<FaultEvent>& faults, const Slo& slo,
                                    double run_end_s) {
  std::vector<FaultCost> costs;
  for (size_t i = 0; i < faults.size(); ++i) {
    FaultCost c;
    c.fault = faults[i];
    c.window_end_s = i + 1 < faults.size() ? faults[i + 1].start_s : run_end_s;
    std::vector<double> ttft;
    double last_bad_send = -1;
    for (const RequestRecord& r : records) {
      if (r.end_s < c.fault.start_s || r.end_s >= c.window_end_s) continue;
      ++c.requests;
      const bool failed = !r.ok() && !r.cut;
      if (failed) ++c.failed;
      if (r.ok() && !MeetsSlo(r, slo)) ++c.slo_missed;
      if (r.wrong_tokens > 0) c.wrong_tokens += r.wrong_tokens;
      if (r.ok() && r.ttft_ms >= 0) ttft.push_back(r.ttft_ms);
      if (failed || (r.ok() && !MeetsSlo(r, slo)))
        last_bad_send = std::max(last_bad_send, r.send_s);
    }
    c.ttft_p99_ms = Percentile(ttft, 99);
    std::vector<double> during, before;
    for (const RequestRecord& r : records) {
      if (!r.ok() || r.ttft_ms < 0) continue;
      if (r.end_s < c.fault.start_s) before.push_back(r.ttft_ms);
      if (c.fault.end_s > c.fault.start_s && r.send_s >= c.fault.start_s &&
          r.send_s <= c.fault.end_s) {
        during.push_back(r.ttft_ms);
      }
    }
    c.requests_during = static_cast<int64_t>(during.size());
    c.ttft_p99_during_ms = Percentile(during, 99);
    c.ttft_p99_before_ms = Percentile(before, 99);
    if (last_bad_send >= 0) {
      double first_good_end = -1;
      for (const RequestRecord& r : records) {
        // A good completion before the fault (of a request sent before it) says nothing.
        if (r.send_s > last_bad_send && r.end_s >= c.fault.start_s && MeetsSlo(r, slo) &&
            (first_good_end < 0 || r.end_s < first_good_end)) {
          first_good_end = r.end_s;
        }
      }
      c.recovery_s = first_good_end < 0 ? -1 : first_good_end - c.fault.start_s;
    }
    costs.push_back(std::move(c));
  }
  return costs;
}

Summary Summarize(const std::vector<RequestRecord>& records, const Slo& slo) {
  Summary s;
  std::vector<double> ttft, tpot, itl, e2e;
  double first_send = std::numeric_limits<double>::infinity(), last_end = 0;
  for (const RequestRecord& r : records) {
    ++s.requests;
    first_send = std::min(first_send, r.send_s);
    last_end = std::max(last_end, r.end_s);
    if (r.send_s - r.scheduled_s > 0.1) ++s.late_sends;
    s.gateway_retries += r.gateway_retries;
    if (r.gateway_retries > 0) ++s.retried_requests;
    if (r.wrong_tokens >= 0) {
      ++s.verified;
      s.wrong_tokens += r.wrong_tokens;
    }
    if (r.cut) {
      ++s.cut;
      continue;
    }
    if (!r.ok()) {
      ++s.failed;
      const std::string name = CodeName(r.code);
      if (s.errors[name]++ == 0) s.error_example[name] = r.error;
      continue;
    }
    ++s.ok;
    if (MeetsSlo(r, slo)) ++s.good;
    if (r.ttft_ms >= 0) ttft.push_back(r.ttft_ms);
    if (r.tpot_ms >= 0) tpot.push_back(r.tpot_ms);
    itl.insert(itl.end(), r.itl_ms.begin(), r.itl_ms.end());
    e2e.push_back(r.e2e_ms);
    s.prompt_tokens += r.prompt_tokens;
    s.cached_tokens += r.cached_tokens;
    s.computed_tokens += r.computed_tokens;
    s.ideal_cached_tokens += r.ideal_cached_tokens;
    s.output_tokens += r.output_tokens;
    s.transferred_bytes += r.transferred_bytes;
    s.fetched_bytes += r.fetched_bytes;
  }
  s.duration_s = s.requests > 0 ? std::max(last_end - first_send, 1e-9) : 0;
  if (s.duration_s > 0) {
    s.request_rate = static_cast<double>(s.ok) / s.duration_s;
    s.output_token_rate = static_cast<double>(s.output_tokens) / s.duration_s;
    s.goodput = static_cast<double>(s.good) / s.duration_s;
  }
  s.ttft_ms = Distribute(ttft);
  s.tpot_ms = Distribute(tpot);
  s.itl_ms = Distribute(itl);
  s.e2e_ms = Distribute(e2e);
  if (s.prompt_tokens > 0) {
    s.hit_rate = static_cast<double>(s.cached_tokens) / static_cast<double>(s.prompt_tokens);
    s.ideal_hit_rate =
        static_cast<double>(s.ideal_cached_tokens) / static_cast<double>(s.prompt_tokens);
  }
  return s;
}

}  // namespace kvrelay::cli::bench_serve
