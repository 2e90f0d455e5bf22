#include "cli/bench_serve/verify.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "cli/bench_serve/runner.h"
#include "cli/colocated.h"

namespace kvrelay::cli::bench_serve {

int64_t CountWrongTokens(const std::vector<int32_t>& streamed,
                         const std::vector<int32_t>& reference, bool complete) {
  const size_t common = std::min(streamed.size(), reference.size());
  int64_t wrong = 0;
  for (size_t i = 0; i < common; ++i) wrong += streamed[i] != reference[i] ? 1 : 0;
  if (streamed.size() > reference.size()) {
    wrong += static_cast<int64_t>(streamed.size() - reference.size());
  } else if (complete) {
    wrong += static_cast<int64_t>(reference.size() - streamed.size());
  }
  return wrong;
}

absl::Status VerifyRecords(const std::string& model_dir, int32_t threads, float temperature,
                           const std::vector<WorkloadRequest>& workload, int64_t sample,
                           std::vector<RequestRecord>* records) {
  std::vector<RequestRecord*> candidates;
  for (RequestRecord& r : *records) {
    if (!r.tokens.empty() || r.ok()) candidates.push_back(&r);
  }
  if (candidates.empty()) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<cli::ColocatedGenerator>> generator =
      cli::ColocatedGenerator::Load(model_dir, threads);
  if (!generator.ok()) {
    return absl::Status(
        generator.status().code(),
        absl::StrCat("--verify: --model ", model_dir, ": ", generator.status().message()));
  }
  const bool tty = isatty(STDERR_FILENO) == 1;
  const size_t n = candidates.size();
  const size_t want = sample <= 0 ? n : std::min<size_t>(n, static_cast<size_t>(sample));
  for (size_t k = 0; k < want; ++k) {
    RequestRecord* r = candidates[k * n / want];
    if (r->index < 0 || r->index >= static_cast<int64_t>(workload.size())) {
      return absl::InternalError(absl::StrCat("--verify: request ", r->index, " not in workload"));
    }
    const WorkloadRequest& w = workload[static_cast<size_t>(r->index)];
    absl::StatusOr<cli::GenerationResult> reference =
        (*generator)->Generate(MakeGenerationRequest(w, temperature));
    if (!reference.ok()) {
      return absl::Status(reference.status().code(),
                          absl::StrCat("--verify: reference for request ", r->index, ": ",
                                       reference.status().message()));
    }
    r->wrong_tokens = CountWrongTokens(r->tokens, reference->tokens, r->ok());
    if (tty || k + 1 == want || (k + 1) % 25 == 0) {
      std::fprintf(stderr, "%s[bench-serve verify] %zu/%zu%s", tty ? "\r" : "", k + 1, want,
                   tty && k + 1 < want ? "" : "\n");
    }
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::cli::bench_serve
