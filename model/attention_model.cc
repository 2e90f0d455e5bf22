#include "model/attention_model.h"

#include "absl/strings/str_cat.h"
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

}  // namespace kvrelay::model
