#pragma once

// Shared state behind a TransferHandle; implementations complete it. Internal to transfer/.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transfer/transport.h"

namespace kvrelay::transfer::internal {

// Thread-safe. Callbacks (cancel, on-done) run without the lock held.
class HandleState {
 public:
  HandleState(int64_t bytes, size_t num_blocks) : bytes_(bytes), num_blocks_(num_blocks) {}

  // Makes the handle terminal with `status`, once; later calls are ignored and return false.
  // `block_statuses` is either empty (every block gets `status`) or one per block.
  bool Complete(absl::Status status, std::vector<absl::Status> block_statuses = {});
  // Complete(SummarizeBlocks(blocks), blocks).
  bool CompleteBlocks(std::vector<absl::Status> blocks);
  std::optional<absl::Status> Poll() const;
  absl::Status Wait(absl::Time deadline) const;
  bool done() const;
  // Requests cancellation; runs the cancel function (once) if one is set.
  void Cancel();
  bool cancel_requested() const;
  // The function that Cancel() calls; called at once if Cancel() came first.
  void SetCancelFn(absl::AnyInvocable<void()> fn);
  // Runs `fn(status)` when terminal (at once if already terminal).
  void OnDone(absl::AnyInvocable<void(const absl::Status&)> fn);
  std::vector<absl::Status> block_statuses() const;
  int64_t bytes() const { return bytes_; }
  size_t num_blocks() const { return num_blocks_; }

 private:
  const int64_t bytes_;
  const size_t num_blocks_;
  mutable absl::Mutex mu_;
  std::optional<absl::Status> status_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> block_statuses_ ABSL_GUARDED_BY(mu_);
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool cancel_fn_called_ ABSL_GUARDED_BY(mu_) = false;
  absl::AnyInvocable<void()> cancel_fn_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::AnyInvocable<void(const absl::Status&)>> on_done_ ABSL_GUARDED_BY(mu_);
};

// A handle that is already terminal with `status`.
TransferHandlePtr MakeDoneHandle(absl::Status status, size_t num_blocks = 0);

// Validates `batch` and builds the plan. `is_local_region` says whether a region pointer is
// live and registered with the transport; `remote_region_size` gives the size of a peer's
// region or NotFound.
absl::StatusOr<TransferPlan> BuildPlan(
    const void* transport, const TransferBatch& batch,
    const std::function<bool(const MemoryRegion*)>& is_local_region,
    const std::function<absl::StatusOr<uint64_t>(RegionId)>& remote_region_size);

// A fresh transport incarnation: 64 random bits (std::random_device), never 0.
uint64_t NewIncarnation();
// A process-wide unique region id. Ids start at a random point (2^32 .. 2^62), so a region
// id learned from one process never names a region of the process restarted after it.
uint64_t NextRegionId();

// Checks a Post's arguments against the plan (InvalidArgument).
absl::Status CheckPost(const void* transport, const TransferPlan& plan, LayerRange layers);

// The blocks of `layers`, with checksums filled in from the local bytes for puts that ask for
// them. (Runs on the caller's thread so the progress thread never hashes.)
std::vector<BlockTransfer> BlocksForPost(const TransferPlan& plan, LayerRange layers);

// Verifies received/read bytes against a block's checksum: OK, or DataLoss naming the block.
absl::Status VerifyBlock(const uint8_t* data, uint64_t length, std::optional<uint64_t> checksum,
                         RegionId region, uint64_t offset);

// Whether a connecting peer's hello key opens a transport whose accept key is `accept_key`:
// always with no accept key, else only the same bytes (compared in constant time).
bool PeerKeyAccepted(const std::string& accept_key, std::string_view presented);

// Combines per-block results into a handle status: OK, or the first failure with a count.
absl::Status SummarizeBlocks(const std::vector<absl::Status>& blocks);

}  // namespace kvrelay::transfer::internal
