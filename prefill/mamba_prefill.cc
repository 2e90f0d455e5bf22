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

#include "absl/cleanup/cleanup.h"
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
  const kv::ModelLayout& layout = mamba_->layout();
  const int32_t block_tokens = layout.block_tokens();
  const int64_t state_bytes = layout.BlockBytes(0);
  const int64_t layer_state_bytes = layout.groups()[0].state_bytes;
  const kvrelay::v1::ReserveResponse& target = request.target();
  const int64_t full_blocks = target.full_blocks();
  const int64_t full_tokens = full_blocks * block_tokens;
  const std::vector<int32_t> tokens(request.tokens().begin(), request.tokens().end());
  kvrelay::v1::PrefillResponse response;
  response.set_pushed_tokens(static_cast<int32_t>(full_tokens));
  if (full_blocks == 0) return response;  // the decode worker computes short prompts itself

  // The decode worker wants exactly one state: the one after the last full block.
  const auto& group_target = target.groups(0);
  const int64_t remote_slot = group_target.slots(static_cast<int>(full_blocks - 1));
  for (int64_t b = 0; b + 1 < full_blocks; ++b) {
    if (group_target.slots(static_cast<int>(b)) >= 0) {
      return Attribute(absl::InvalidArgumentError(absl::StrCat(
                           "target.groups[0].slots[", b,
                           "]: a Mamba reservation holds only the state after its last block")),
                       kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_INVALID_REQUEST);
    }
  }
  if (remote_slot < 0) {
    return Attribute(absl::InvalidArgumentError(absl::StrCat(
                         "target.groups[0].slots[", full_blocks - 1,
                         "] is -1: a Mamba reservation must hold the state after its last block")),
                     kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_INVALID_REQUEST);
  }

  // 1. Which checkpoints are cached here.
  KV_ASSIGN_OR_RETURN(std::unique_ptr<PrefixLookup> lookup,
                      LookUpPrefix(request, layout, tokens, full_tokens, deadline));
  const worker::PrefixMatch& match = lookup->match;
  // The deepest matched block whose checkpoint is in this node's segment (the lease keeps it
  // there while it is read).
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

  // 2. Resume there and compute the rest, keeping every new block's checkpoint.
  std::vector<uint8_t> final_state;
  std::vector<std::vector<uint8_t>> checkpoints;  // blocks resume_blocks .. full_blocks - 1
  const int64_t compute_from = resume_blocks * block_tokens;
  {
    model::MambaSequence seq(layout);
    if (resume_blocks > 0) {
      const uint8_t* cached = segment_->GroupUnit(resume_slot, 0);
      final_state.assign(cached, cached + state_bytes);
      KV_RETURN_IF_ERROR(seq.Restore(final_state, compute_from));
    }
    if (compute_from < full_tokens) {
      model::MambaPrefillOptions prefill_options;
      prefill_options.on_checkpoint = [&](int64_t block, absl::Span<const uint8_t> state) {
        KV_DCHECK(block == resume_blocks + static_cast<int64_t>(checkpoints.size()));
        checkpoints.emplace_back(state.begin(), state.end());
      };
      absl::MutexLock lock(&compute_mu_);
      absl::StatusOr<std::vector<float>> logits = mamba_->Prefill(
          seq,
          absl::MakeConstSpan(tokens).subspan(static_cast<size_t>(compute_from),
                                              static_cast<size_t>(full_tokens - compute_from)),
          prefill_options);
      if (!logits.ok()) return Own(logits.status(), kvrelay::v1::FAILURE_COMPUTE);
      if (static_cast<int64_t>(checkpoints.size()) != full_blocks - resume_blocks) {
        return Own(absl::InternalError(absl::StrCat("mamba prefill produced ", checkpoints.size(),
                                                    " checkpoints for ",
                                                    full_blocks - resume_blocks, " blocks")),
                   kvrelay::v1::FAILURE_COMPUTE);
      }
      final_state = checkpoints.back();
    }
  }

  // 3. The state into a registered slot, then one put of it into the decode worker's slot.
  kv::BlockPool& pool = kv_->cache().pool(0);
  absl::StatusOr<kv::SlotId> local_slot = pool.Allocate();
  if (!local_slot.ok()) return Own(local_slot.status(), kvrelay::v1::FAILURE_OVERLOADED);
  struct SlotGuard {
    kv::BlockPool& pool;
    kv::SlotId slot;
    ~SlotGuard() { (void)pool.Release(slot); }
  } slot_guard{pool, *local_slot};
  std::memcpy(pool.SlotAddress(*local_slot), final_state.data(), final_state.size());

  KV_ASSIGN_OR_RETURN(const transfer::PeerId peer, ConnectDecode(target, deadline));
  std::vector<transfer::RegionId> imported;
  absl::Cleanup forget_imported = [&] {
    for (transfer::RegionId id : imported) (void)transport_->ForgetRegion(peer, id);
  };
  KV_RETURN_IF_ERROR(ImportTargetKeys(peer, target, imported));
  transfer::TransferBatch batch = PushBatch(peer, request);
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    KV_ASSIGN_OR_RETURN(transfer::BlockTransfer t,
                        PushSlice(target, /*g=*/0, *local_slot, remote_slot, layer));
    KV_DCHECK(t.length == static_cast<uint64_t>(layer_state_bytes));
    batch.blocks.push_back(t);
  }
  KV_ASSIGN_OR_RETURN(transfer::TransferPlan plan, PrepareClaimed(batch, request, deadline));
  transfer::PostOptions post_options;
  post_options.deadline = std::min(deadline, absl::Now() + options_.transfer_timeout);
  const absl::Time first_post = absl::Now();
  int64_t pushed = 0;
  absl::Status transfer_status;
  {
    absl::StatusOr<transfer::TransferHandlePtr> handle =
        transport_->Post(plan, transfer::LayerRange::All(), post_options);
    transfer_status = handle.status();
    if (handle.ok()) {
      transfer_status = (*handle)->Wait(deadline);
      pushed = (*handle)->bytes();
    }
  }
  transfer_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - first_post));
  if (!transfer_status.ok()) return PushFailure(target, std::move(transfer_status), deadline);
  pushed_bytes_->Increment(static_cast<double>(pushed));

  // 4. Publish the checkpoints computed here, each under its block's hash.
  absl::StatusOr<int32_t> committed = lookup->store().CommitBlocksFrom(
      lookup->chain, resume_blocks, full_blocks,
      [&](int64_t block, int64_t slot) -> absl::Status {
        const std::vector<uint8_t>& state = checkpoints[block - resume_blocks];
        if (static_cast<uint64_t>(state.size()) != segment_->block_bytes()) {
          return absl::InternalError("mamba checkpoint size differs from the segment's slots");
        }
        std::memcpy(segment_->GroupUnit(slot, 0), state.data(), state.size());
        return absl::OkStatus();
      },
      deadline);
  if (!committed.ok()) {
    KV_LOG(WARNING) << request.request_id() << ": commit failed: " << committed.status();
  }
  prefix_hit_tokens_->Increment(static_cast<double>(compute_from));
  computed_tokens_->Increment(static_cast<double>(full_tokens - compute_from));
  prefill_seconds_->Observe(absl::ToDoubleSeconds(core_->clock->Now() - start));
  response.set_prefix_hit_tokens(static_cast<int32_t>(compute_from));
  response.set_computed_tokens(static_cast<int32_t>(full_tokens - compute_from));
  response.set_pushed_bytes(pushed);
  response.set_committed_blocks(committed.ok() ? *committed : 0);
  return response;
}

}  // namespace kvrelay::prefill
