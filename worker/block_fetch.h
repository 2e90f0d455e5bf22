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
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/model_layout.h"
#include "transfer/transport.h"
#include "worker/kv_memory.h"

namespace kvrelay::worker {

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
// of blocks that failed are released). `scratch` (registered with `transport`, at least
// hashes.size() x CacheSegment::kSlotEntryBytes) receives the slot entries. REQUIRES:
// `peer` is connected to the holder and its incarnation was checked.
FetchedPrefix FetchBlocks(transfer::Transport& transport, transfer::PeerId peer,
                          const RemoteReplica& holder, absl::Span<const int64_t> slots,
                          absl::Span<const kv::BlockHash> hashes, const kv::ModelLayout& layout,
                          const RegisteredKvCache& kv, const transfer::MemoryRegion& scratch,
                          uint64_t tag, absl::Time deadline,
                          std::vector<std::vector<kv::SlotId>>& group_slots);

}  // namespace kvrelay::worker
