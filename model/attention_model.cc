#include "model/attention_model.h"

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/sampler.h"

namespace kvrelay::model {

std::string ComputeDevice::Label() const {
  return kind == DeviceKind::kCpu ? std::string("cpu") : absl::StrCat("cuda:", index);
}

absl::StatusOr<std::vector<int32_t>> AttentionModel::DecodeStepGreedy(
    absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens) const {
  absl::StatusOr<std::vector<float>> logits = DecodeStep(seqs, tokens);
  if (!logits.ok()) return logits.status();
  const int64_t vocab = config().vocab_size;
  std::vector<int32_t> next(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    next[i] = Greedy(absl::MakeConstSpan(*logits).subspan(i * vocab, vocab));
  }
  return next;
}

namespace {

absl::Status CheckLayout(const Sequence& seq, const kv::ModelLayout& layout) {
  const kv::ModelLayout& cache_layout = seq.cache().layout();
  if (cache_layout.fingerprint() == layout.fingerprint()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("runner: sequence's cache has layout ", cache_layout.model_id(), " (numerics '",
                   cache_layout.numerics_id(), "') but the model's is ", layout.model_id(),
                   " (numerics '", layout.numerics_id(), "')"));
}

absl::Status CheckToken(const char* what, size_t i, int32_t token, int32_t vocab) {
  if (token >= 0 && token < vocab) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": token ", i, " is ", token, ", outside [0, ", vocab, ")"));
}

}  // namespace

absl::Status CheckPrefillInput(const Sequence& seq, absl::Span<const int32_t> tokens,
                               const kv::ModelConfig& config) {
  if (tokens.empty()) return absl::InvalidArgumentError("prefill: no tokens");
  KV_RETURN_IF_ERROR(CheckLayout(seq, config.layout));
  for (size_t i = 0; i < tokens.size(); ++i) {
    KV_RETURN_IF_ERROR(CheckToken("prefill", i, tokens[i], config.vocab_size));
  }
  return absl::OkStatus();
}

absl::Status CheckDecodeInput(absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens,
                              const kv::ModelConfig& config) {
  if (seqs.empty()) return absl::InvalidArgumentError("decode: empty batch");
  if (seqs.size() != tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode: ", seqs.size(), " sequences but ", tokens.size(), " tokens"));
  }
  absl::flat_hash_set<const Sequence*> seen;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i] == nullptr || !seen.insert(seqs[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode: batch entry ", i, " is null or repeats a sequence"));
    }
    KV_RETURN_IF_ERROR(CheckLayout(*seqs[i], config.layout));
    KV_RETURN_IF_ERROR(CheckToken("decode", i, tokens[i], config.vocab_size));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::model
