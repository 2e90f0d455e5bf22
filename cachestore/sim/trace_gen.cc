#include "cachestore/sim/trace_gen.h"

#include <algorithm>
#include <cmath>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvrelay::cachestore::sim {

namespace {

// splitmix64: a tiny, fully specified generator (same stream everywhere).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi].
  int64_t Uniform(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Next() % static_cast<uint64_t>(hi - lo + 1));
  }
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Log-uniform in [lo, hi]: many short, some long, as prompt lengths are.
  int64_t LogUniform(int64_t lo, int64_t hi) {
    const double x =
        std::log(static_cast<double>(lo)) +
        Unit() * (std::log(static_cast<double>(hi)) - std::log(static_cast<double>(lo)));
    return std::clamp<int64_t>(static_cast<int64_t>(std::exp(x)), lo, hi);
  }
  // Zipf(1) over [0, n): rank r with weight 1 / (r + 1), by inverting the harmonic CDF.
  int64_t Zipf(int64_t n) {
    double h = 0;
    for (int64_t r = 0; r < n; ++r) h += 1.0 / static_cast<double>(r + 1);
    double u = Unit() * h;
    for (int64_t r = 0; r < n; ++r) {
      u -= 1.0 / static_cast<double>(r + 1);
      if (u <= 0) return r;
    }
    return n - 1;
  }
  bool Chance(double p) { return Unit() < p; }

 private:
  uint64_t state_;
};

// A growing token sequence: its full blocks have fixed ids; the trailing partial block gets a
// fresh id in every request that ends inside it.
struct Sequence {
  std::vector<uint64_t> full_blocks;
  int64_t tokens = 0;
};

class Builder {
 public:
  explicit Builder(uint64_t seed) : rng_(seed) {}
  Rng& rng() { return rng_; }
  uint64_t FreshId() { return next_id_++; }

  // Appends n tokens of new content to seq (new content = new ids for the blocks it fills).
  void Append(Sequence& seq, int64_t n) {
    const int64_t before_full = seq.tokens / kTraceBlockTokens;
    seq.tokens += n;
    const int64_t after_full = seq.tokens / kTraceBlockTokens;
    for (int64_t b = before_full; b < after_full; ++b) seq.full_blocks.push_back(FreshId());
  }
  // A request whose prompt is seq as it stands.
  void Emit(const Sequence& seq, int64_t output_tokens) {
    TraceRequest r;
    r.hash_ids = seq.full_blocks;
    if (seq.tokens % kTraceBlockTokens != 0) r.hash_ids.push_back(FreshId());
    r.input_length = seq.tokens;
    r.output_length = output_tokens;
    now_ms_ += rng_.Uniform(1, 400);  // ~5 requests/s, uniform gaps
    r.timestamp_ms = now_ms_;
    out_.push_back(std::move(r));
  }
  int64_t emitted() const { return static_cast<int64_t>(out_.size()); }
  std::vector<TraceRequest> Take() { return std::move(out_); }

 private:
  Rng rng_;
  uint64_t next_id_ = 1;
  int64_t now_ms_ = 0;
  std::vector<TraceRequest> out_;
};

std::vector<Sequence> MakePrompts(Builder& b, int n, int64_t lo_tokens, int64_t hi_tokens) {
  std::vector<Sequence> prompts(n);
  for (Sequence& p : prompts) b.Append(p, b.rng().LogUniform(lo_tokens, hi_tokens));
  return prompts;
}

// Chat: a pool of live conversations; each step either opens a new conversation or advances a
// random live one by a turn. Turns per conversation: geometric, mean ~5.
void MultiTurn(Builder& b, int64_t requests) {
  Rng& rng = b.rng();
  std::vector<Sequence> systems = MakePrompts(b, 24, 300, 2500);
  std::vector<Sequence> live;
  const int64_t end = b.emitted() + requests;
  while (b.emitted() < end) {
    if (live.size() < 8 || (live.size() < 64 && rng.Chance(0.25))) {
      Sequence c = systems[rng.Zipf(static_cast<int64_t>(systems.size()))];
      b.Append(c, rng.LogUniform(50, 6000));  // first user message
      b.Emit(c, rng.LogUniform(20, 800));
      live.push_back(std::move(c));
      continue;
    }
    const size_t i = rng.Uniform(0, static_cast<int64_t>(live.size()) - 1);
    Sequence& c = live[i];
    b.Append(c, rng.LogUniform(20, 800));   // the answer the model gave
    b.Append(c, rng.LogUniform(10, 1500));  // the next user message
    b.Emit(c, rng.LogUniform(20, 800));
    if (rng.Chance(0.2) || c.tokens > 100000) {
      std::swap(live[i], live.back());
      live.pop_back();
    }
  }
}

// Agent loops: few agents with long shared prefixes; an episode appends tool I/O step by step,
// so each step re-sends everything before it.
void AgentLoops(Builder& b, int64_t requests) {
  Rng& rng = b.rng();
  std::vector<Sequence> agents = MakePrompts(b, 4, 8000, 24000);
  struct Episode {
    Sequence seq;
    int64_t steps_left;
  };
  std::vector<Episode> live;
  const int64_t end = b.emitted() + requests;
  while (b.emitted() < end) {
    if (live.size() < 16 && (live.size() < 4 || rng.Chance(0.3))) {
      Episode e{agents[rng.Zipf(static_cast<int64_t>(agents.size()))], rng.Uniform(5, 40)};
      b.Append(e.seq, rng.LogUniform(100, 2000));  // the task
      b.Emit(e.seq, rng.LogUniform(20, 300));
      live.push_back(std::move(e));
      continue;
    }
    const size_t i = rng.Uniform(0, static_cast<int64_t>(live.size()) - 1);
    Episode& e = live[i];
    b.Append(e.seq, rng.LogUniform(30, 300));   // the tool call
    b.Append(e.seq, rng.LogUniform(50, 3000));  // its output
    b.Emit(e.seq, rng.LogUniform(20, 300));
    if (--e.steps_left <= 0 || e.seq.tokens > 120000) {
      std::swap(live[i], live.back());
      live.pop_back();
    }
  }
}

// Scan-heavy: repeated short prompts (a hot set) and one-off long documents.
void ScanHeavy(Builder& b, int64_t requests) {
  Rng& rng = b.rng();
  std::vector<Sequence> hot = MakePrompts(b, 64, 500, 5000);
  const int64_t end = b.emitted() + requests;
  while (b.emitted() < end) {
    if (rng.Chance(0.5)) {
      Sequence doc;
      b.Append(doc, rng.LogUniform(10000, 60000));
      b.Emit(doc, rng.LogUniform(20, 500));
    } else {
      Sequence q = hot[rng.Zipf(static_cast<int64_t>(hot.size()))];
      b.Append(q, rng.LogUniform(20, 400));  // the question after the shared context
      b.Emit(q, rng.LogUniform(20, 500));
    }
  }
}

}  // namespace

std::vector<std::string> TraceShapeNames() { return {"multiturn", "agent", "scan", "shift"}; }

absl::StatusOr<std::vector<TraceRequest>> GenerateTrace(std::string_view shape, uint64_t seed,
                                                        int64_t requests) {
  if (requests < 1 || requests > 10'000'000) {
    return absl::InvalidArgumentError(absl::StrCat("requests: want 1..10000000, got ", requests));
  }
  Builder b(seed);
  if (shape == "multiturn") {
    MultiTurn(b, requests);
  } else if (shape == "agent") {
    AgentLoops(b, requests);
  } else if (shape == "scan") {
    ScanHeavy(b, requests);
  } else if (shape == "shift") {
    AgentLoops(b, requests / 2);
    MultiTurn(b, requests - requests / 2);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("shape: unknown trace shape '",
                                                   std::string(shape), "' (want ",
                                                   absl::StrJoin(TraceShapeNames(), ", "), ")"));
  }
  std::vector<TraceRequest> out = b.Take();
  out.resize(static_cast<size_t>(requests));  // a shape may overshoot by one request
  return out;
}

std::string TraceToJsonLines(const std::vector<TraceRequest>& trace) {
  std::string out;
  for (const TraceRequest& r : trace) {
    absl::StrAppend(&out, "{\"timestamp\": ", r.timestamp_ms,
                    ", \"input_length\": ", r.input_length,
                    ", \"output_length\": ", r.output_length, ", \"hash_ids\": [",
                    absl::StrJoin(r.hash_ids, ", "), "]}\n");
  }
  return out;
}

}  // namespace kvrelay::cachestore::sim
