// PrefillWorker's Mamba path: the recurrent state instead of KV blocks.
//
// The cache keeps, under block i's chained hash, the state after block i's last token (a
// checkpoint, model/mamba_runner.h). A request hashes its full blocks as the KV path does,
// matches them, resumes from the deepest checkpoint this node holds among the matched blocks
// (any matched block is an ancestor of the prompt's, so any of them is exact), computes only the
// tokens after it, pushes the one state after its last full block into the decode worker's one
// reserved slot - layout.BlockBytes(0) bytes whatever the prompt length - and commits the
// checkpoints of the blocks it computed.

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kv/block_hash.h"
#include "prefill/prefill_worker.h"
#include "proto/grpc_status.h"

namespace kvrelay::prefill {

using ::kvrelay::proto::Attribute;

absl::StatusOr<kvrelay::v1::PrefillResponse> PrefillWorker::RunMamba(
    const kvrelay::v1::PrefillRequest& request, absl::Time deadline, absl::Time start) {
  const kv::ModelLayout& layout = model_config().layout;
  const int32_t block_tokens = layout.block_tokens();
  const int64_t full_blocks = request.target().full_blocks();
  const int64_t full_tokens = full_blocks * block_tokens;
  const std::vector<int32_t> tokens(request.tokens().begin(), request.tokens().end());
  kvrelay::v1::PrefillResponse response;
  response.set_pushed_tokens(static_cast<int32_t>(full_tokens));
  if (full_blocks == 0) return response;  // the decode worker computes short prompts itself
  KV_RETURN_IF_ERROR(CheckMambaTarget(request.target()));

  // 1. Which checkpoints are cached here.
  KV_ASSIGN_OR_RETURN(std::unique_ptr<PrefixLookup> lookup,
                      LookUpPrefix(request, layout, tokens, full_tokens, deadline));
  KV_ASSIGN_OR_RETURN(const auto resume, FindCheckpoint(lookup->match, full_blocks));
  const auto [resume_blocks, resume_slot] = resume;
  // 2. Resume there and compute the rest, keeping every new block's checkpoint.
  KV_ASSIGN_OR_RETURN(
      const MambaStates states,
      ComputeMamba(absl::MakeConstSpan(tokens).subspan(0, static_cast<size_t>(full_tokens)),
                   resume_blocks, resume_slot));
  // 3. The one state after the last full block into the decode worker's one reserved slot.
  KV_ASSIGN_OR_RETURN(const int64_t pushed, PushMambaState(request, states.final_state, deadline));
  // 4. Publish the checkpoints computed here, each under its block's hash.
  const int32_t committed = CommitCheckpoints(request.request_id(), *lookup, resume_blocks,
                                              full_blocks, states.checkpoints, tokens);

  // 5. Respond.
  const int64_t compute_from = resume_blocks * block_tokens;
  prefix_hit_tokens_->Increment(static_cast<double>(compute_from));
  computed_tokens_->Increment(static_cast<double>(full_tokens - compute_from));
  prefill_seconds_->Observe(absl::ToDoubleSeconds(core_->clock->Now() - start));
  response.set_prefix_hit_tokens(static_cast<int32_t>(compute_from));
  response.set_computed_tokens(static_cast<int32_t>(full_tokens - compute_from));
  response.set_pushed_bytes(pushed);
  response.set_committed_blocks(committed);
  return response;
}

absl::Status PrefillWorker::CheckMambaTarget(const kvrelay::v1::ReserveResponse& target) {
  // The decode worker wants exactly one state: the one after the last full block.
  const int64_t full_blocks = target.full_blocks();
  const auto& group_target = target.groups(0);
  for (int64_t b = 0; b + 1 < full_blocks; ++b) {
    if (group_target.slots(static_cast<int>(b)) >= 0) {
      return Attribute(absl::InvalidArgumentError(absl::StrCat(
                           "target.groups[0].slots[", b,
                           "]: a Mamba reservation holds only the state after its last block")),
                       kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_INVALID_REQUEST);
    }
  }
  if (group_target.slots(static_cast<int>(full_blocks - 1)) < 0) {
    return Attribute(absl::InvalidArgumentError(absl::StrCat(
                         "target.groups[0].slots[", full_blocks - 1,
                         "] is -1: a Mamba reservation must hold the state after its last block")),
                     kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_INVALID_REQUEST);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<int64_t, int64_t>> PrefillWorker::FindCheckpoint(
    const worker::PrefixMatch& match, int64_t full_blocks) const {
  // Any matched block is an ancestor of the prompt's, so the deepest one held here is exact (the
  // lease keeps it in the segment while it is read).
  int64_t resume_blocks = 0;
  int64_t resume_slot = -1;
  for (size_t b = 0; b < match.local_slots.size() && static_cast<int64_t>(b) < full_blocks; ++b) {
    if (match.local_slots[b] >= 0) {
      resume_blocks = static_cast<int64_t>(b) + 1;
      resume_slot = match.local_slots[b];
    }
  }
  if (resume_slot >= segment_->num_slots()) {
    return Own(absl::InternalError(absl::StrCat("cache store named segment slot ", resume_slot,
                                                " of ", segment_->num_slots())),
               kvrelay::v1::FAILURE_COMPUTE);
  }
  return std::make_pair(resume_blocks, resume_slot);
}

absl::StatusOr<PrefillWorker::MambaStates> PrefillWorker::ComputeMamba(
    absl::Span<const int32_t> tokens, int64_t resume_blocks, int64_t resume_slot) {
  const kv::ModelLayout& layout = model_config().layout;
  const int64_t state_bytes = layout.BlockBytes(0);
  const int64_t full_tokens = static_cast<int64_t>(tokens.size());
  const int64_t full_blocks = full_tokens / layout.block_tokens();
  const int64_t compute_from = resume_blocks * layout.block_tokens();
  MambaStates states;
  model::MambaSequence seq(layout);
  if (resume_blocks > 0) {
    const uint8_t* cached = segment_->GroupUnit(resume_slot, 0);
    states.final_state.assign(cached, cached + state_bytes);
    KV_RETURN_IF_ERROR(seq.Restore(states.final_state, compute_from));
  }
  if (compute_from >= full_tokens) return states;
  model::MambaPrefillOptions prefill_options;
  prefill_options.on_checkpoint = [&](int64_t block, absl::Span<const uint8_t> state) {
    KV_DCHECK(block == resume_blocks + static_cast<int64_t>(states.checkpoints.size()));
    states.checkpoints.emplace_back(state.begin(), state.end());
  };
  absl::MutexLock lock(&compute_mu_);
  absl::StatusOr<std::vector<float>> logits =
      mamba_->Prefill(seq, tokens.subspan(static_cast<size_t>(compute_from)), prefill_options);
  if (!logits.ok()) return Own(logits.status(), kvrelay::v1::FAILURE_COMPUTE);
  if (static_cast<int64_t>(states.checkpoints.size()) != full_blocks - resume_blocks) {
    return Own(absl::InternalError(absl::StrCat("mamba prefill produced ",
                                                states.checkpoints.size(), " checkpoints for ",
                                                full_blocks - resume_blocks, " blocks")),
               kvrelay::v1::FAILURE_COMPUTE);
  }
  states.final_state = states.checkpoints.back();
  return states;
}

absl::StatusOr<int64_t> PrefillWorker::PushMambaState(const kvrelay::v1::PrefillRequest& request,
                                                      const std::vector<uint8_t>& state,
                                                      absl::Time deadline) {
  const kv::ModelLayout& layout = kv_->cache().layout();
  const kvrelay::v1::ReserveResponse& target = request.target();
  const int64_t remote_slot = target.groups(0).slots(static_cast<int>(target.full_blocks() - 1));
  // The state into a registered slot (released after the session: its transfers read it).
  kv::BlockPool& pool = kv_->cache().pool(0);
  absl::StatusOr<kv::SlotId> local_slot = pool.Allocate();
  if (!local_slot.ok()) return Own(local_slot.status(), kvrelay::v1::FAILURE_OVERLOADED);
  struct SlotGuard {
    kv::BlockPool& pool;
    kv::SlotId slot;
    ~SlotGuard() { (void)pool.Release(slot); }
  } slot_guard{pool, *local_slot};
  std::memcpy(pool.SlotAddress(*local_slot), state.data(), state.size());

  KV_ASSIGN_OR_RETURN(std::unique_ptr<PushSession> push,
                      PushSession::Open(push_context(), request.request_id(), target, deadline));
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    const worker::LayerSlice slice = worker::SliceOfLayer(layout, kv_->cache(), layer);
    KV_DCHECK(slice.length == static_cast<uint64_t>(layout.groups()[0].state_bytes));
    KV_RETURN_IF_ERROR(
        push->AddSlice({.group = 0,
                        .local = &kv_->region(0),
                        .local_offset = static_cast<uint64_t>(*local_slot) * pool.slot_stride() +
                                        slice.offset_in_unit,
                        .remote_slot = remote_slot,
                        .offset_in_unit = slice.offset_in_unit,
                        .length = slice.length,
                        .layer = layer}));
  }
  KV_RETURN_IF_ERROR(push->Claim());
  push->Post(transfer::LayerRange::All());
  return push->Finish();
}

int32_t PrefillWorker::CommitCheckpoints(const std::string& request_id, const PrefixLookup& lookup,
                                         int64_t first, int64_t last,
                                         const std::vector<std::vector<uint8_t>>& checkpoints,
                                         absl::Span<const int32_t> tokens) {
  absl::StatusOr<int32_t> committed = lookup.store().CommitBlocksFrom(
      lookup.chain, first, last,
      [&](int64_t block, int64_t slot) -> absl::Status {
        const std::vector<uint8_t>& state = checkpoints[block - first];
        if (static_cast<uint64_t>(state.size()) != segment_->block_bytes()) {
          return absl::InternalError("mamba checkpoint size differs from the segment's slots");
        }
        std::memcpy(segment_->GroupUnit(slot, 0), state.data(), state.size());
        return absl::OkStatus();
      },
      lookup.deadline, /*keep_copies=*/false, tokens);
  if (!committed.ok()) {
    KV_LOG(WARNING) << request_id << ": commit failed: " << committed.status();
    return 0;
  }
  return *committed;
}

}  // namespace kvrelay::prefill
