#pragma once

// Fetching cached blocks from another node's cache segment over the data plane (a get from the
// holder: the holder's CPU does nothing, and over RDMA its NIC serves the read).
//
// Every block is checked before a byte of it is used: the holder's slot entry must name the
// block's chained hash (which covers the layout, the tenant and every earlier token), and the
// XXH3 of the bytes that arrived must equal the entry's checksum. The first block that fails
// (missing, other hash, corrupted, transfer error) ends the fetched prefix; the caller
// recomputes from there.

#include <cstdint>
#include <list>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/model_layout.h"
#include "transfer/transport.h"
#include "worker/kv_memory.h"

namespace kvrelay::worker {

// Transfers given up on (failed or past their deadline) may still be writing into their
// destination: their slots and scratch region are freed only once the transfer is terminal, on
// a thread of its own, so a request never waits for a stalled link to drain. Each is freed as
// soon as it is terminal, whatever the others do.
class FetchQuarantine {
 public:
  explicit FetchQuarantine(model::KvCache* cache);
  // Waits until every held transfer is terminal, at most 2 s; the slots of any still running
  // then stay held (a pull towards a lost peer that never answered).
  ~FetchQuarantine();
  FetchQuarantine(const FetchQuarantine&) = delete;
  FetchQuarantine& operator=(const FetchQuarantine&) = delete;
  void Hold(transfer::TransferHandlePtr handle, std::vector<std::vector<kv::SlotId>> slots,
            transfer::MemoryRegionPtr scratch);
  size_t held() const;

 private:
  struct Item {
    transfer::TransferHandlePtr handle;
    std::vector<std::vector<kv::SlotId>> slots;
    transfer::MemoryRegionPtr scratch;
  };
  void Loop();
  model::KvCache* const cache_;
  mutable absl::Mutex mu_;
  std::list<Item> items_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

struct FetchedPrefix {
  int64_t intact = 0;       // leading blocks that arrived and passed both checks
  uint64_t kv_bytes = 0;    // KV bytes of those blocks (the layout's bytes per block x intact)
  uint64_t wire_bytes = 0;  // everything read, slot entries and failed blocks included
  absl::Duration elapsed;
  // Why the fetch stopped before the last block (OK when every block is intact).
  absl::Status status;
};

// Reads `hashes.size()` blocks, block i from `holder` slot `slots[i]`, into freshly allocated
// slots of `kv`'s cache (appended to group_slots[g], one reference each for the caller; slots
// of blocks that failed are released). `scratch` (allocated from `transport`, at least
// hashes.size() x CacheSegment::kSlotEntryBytes) receives the slot entries. A transfer given
// up on goes to `quarantine` with its slots and the scratch region, and `scratch` is replaced
// by a fresh one (null if that allocation failed). REQUIRES: `peer` is connected to the holder
// and its incarnation was checked.
FetchedPrefix FetchBlocks(transfer::Transport& transport, transfer::PeerId peer,
                          const RemoteReplica& holder, absl::Span<const int64_t> slots,
                          absl::Span<const kv::BlockHash> hashes, const kv::ModelLayout& layout,
                          const RegisteredKvCache& kv, transfer::MemoryRegionPtr& scratch,
                          FetchQuarantine& quarantine, uint64_t tag, absl::Time deadline,
                          std::vector<std::vector<kv::SlotId>>& group_slots);

}  // namespace kvrelay::worker
