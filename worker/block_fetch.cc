#include "worker/block_fetch.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "kv/checksum.h"

namespace kvrelay::worker {

FetchQuarantine::FetchQuarantine(model::KvCache* cache)
    : cache_(cache), thread_([this] { Loop(); }) {}

FetchQuarantine::~FetchQuarantine() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void FetchQuarantine::Hold(transfer::TransferHandlePtr handle,
                           std::vector<std::vector<kv::SlotId>> slots,
                           transfer::MemoryRegionPtr scratch) {
  absl::MutexLock lock(&mu_);
  items_.push_back({std::move(handle), std::move(slots), std::move(scratch)});
}

size_t FetchQuarantine::held() const {
  absl::MutexLock lock(&mu_);
  return items_.size();
}

void FetchQuarantine::Loop() {
  // Each item is freed as soon as its transfer is terminal, in any order: a pull towards a
  // peer that was lost while it was unanswered stays in flight until the peer answers or is
  // replaced (transfer/transport.h), and must not hold up the items behind it.
  constexpr absl::Duration kPollEvery = absl::Milliseconds(20);
  constexpr absl::Duration kShutdownWait = absl::Seconds(2);
  absl::Time give_up = absl::InfiniteFuture();
  while (true) {
    std::vector<Item> ready;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&wake), kPollEvery);
      for (auto it = items_.begin(); it != items_.end();) {
        if (it->handle->Poll().has_value()) {
          ready.push_back(std::move(*it));
          it = items_.erase(it);
        } else {
          ++it;
        }
      }
      if (stopping_ && give_up == absl::InfiniteFuture()) give_up = absl::Now() + kShutdownWait;
      if (stopping_ && ready.empty() && (items_.empty() || absl::Now() >= give_up)) {
        if (!items_.empty()) {
          // The process is going down with a pull still unanswered: its slots are never
          // reused (nothing allocates from them again), and the handle is left behind rather
          // than waited on for ever.
          KV_LOG(WARNING) << items_.size()
                          << " pulls were still unanswered at shutdown; their slots stay held";
          for (Item& item : items_) (void)item.handle.release();
          items_.clear();
        }
        return;
      }
    }
    for (Item& item : ready) {
      item.handle.reset();
      for (size_t g = 0; g < item.slots.size(); ++g) {
        for (kv::SlotId s : item.slots[g]) (void)cache_->pool(static_cast<int>(g)).Release(s);
      }
      item.scratch.reset();
    }
  }
}

namespace {

using GroupSlots = std::vector<std::vector<kv::SlotId>>;

// Releases local[g][first..] in every group and drops them from `local`.
void ReleaseFrom(model::KvCache& cache, GroupSlots& local, size_t first) {
  for (size_t g = 0; g < local.size(); ++g) {
    for (size_t b = first; b < local[g].size(); ++b) {
      (void)cache.pool(static_cast<int>(g)).Release(local[g][b]);
    }
    local[g].resize(std::min(local[g].size(), first));
  }
}

// Fresh local slots for `n` blocks in every group; nothing held on failure.
absl::StatusOr<GroupSlots> AllocateLocal(model::KvCache& cache, int num_groups, size_t n) {
  GroupSlots local(static_cast<size_t>(num_groups));
  for (int g = 0; g < num_groups; ++g) {
    absl::StatusOr<std::vector<kv::SlotId>> got =
        cache.pool(g).AllocateMany(static_cast<int64_t>(n));
    if (!got.ok()) {
      ReleaseFrom(cache, local, 0);
      return got.status();
    }
    local[g] = *std::move(got);
  }
  return local;
}

// The get of every block: per block its group units (at their offsets in the holder's slot),
// then its slot entry into `scratch`.
transfer::TransferBatch FetchBatch(transfer::PeerId peer, uint64_t tag, const RemoteReplica& holder,
                                   absl::Span<const int64_t> slots, const kv::ModelLayout& layout,
                                   const RegisteredKvCache& kv, const GroupSlots& local,
                                   transfer::MemoryRegion* scratch) {
  const int num_groups = static_cast<int>(layout.groups().size());
  model::KvCache& cache = kv.cache();
  transfer::TransferBatch batch;
  batch.peer = peer;
  batch.direction = transfer::Direction::kGet;
  batch.tag = tag;
  batch.compute_checksums = false;  // checked here against the holder's slot entries
  for (size_t b = 0; b < slots.size(); ++b) {
    uint64_t group_offset = 0;
    for (int g = 0; g < num_groups; ++g) {
      transfer::BlockTransfer unit;
      unit.local = &kv.region(g);
      unit.local_offset = static_cast<uint64_t>(local[g][b]) * cache.pool(g).slot_stride();
      unit.remote_region = holder.region_id;
      unit.remote_offset = static_cast<uint64_t>(slots[b]) * holder.slot_stride + group_offset;
      unit.length = static_cast<uint64_t>(layout.BlockBytes(g));
      group_offset += unit.length;
      batch.blocks.push_back(unit);
    }
    transfer::BlockTransfer entry;
    entry.local = scratch;
    entry.local_offset = b * CacheSegment::kSlotEntryBytes;
    entry.remote_region = holder.table_region_id;
    entry.remote_offset = static_cast<uint64_t>(slots[b]) * CacheSegment::kSlotEntryBytes;
    entry.length = CacheSegment::kSlotEntryBytes;
    batch.blocks.push_back(entry);
  }
  return batch;
}

// How many leading blocks arrived whole, are named by their slot entry and match its checksum;
// `status` says why the next one did not (unchanged when all did).
size_t CountIntact(const std::vector<absl::Status>& per_block, const absl::Status& done,
                   const RemoteReplica& holder, absl::Span<const int64_t> slots,
                   absl::Span<const kv::BlockHash> hashes, const kv::ModelLayout& layout,
                   model::KvCache& cache, const GroupSlots& local,
                   const transfer::MemoryRegion& scratch, absl::Status& status) {
  const size_t n = hashes.size();
  const int num_groups = static_cast<int>(layout.groups().size());
  const size_t pieces = 1 + static_cast<size_t>(num_groups);
  size_t intact = 0;
  for (; intact < n; ++intact) {
    bool arrived = per_block.size() == n * pieces;
    for (size_t k = 0; arrived && k < pieces; ++k) arrived = per_block[intact * pieces + k].ok();
    if (!arrived) {
      status = done.ok()
                   ? absl::DataLossError(absl::StrCat("fetch: block ", intact, " did not arrive"))
                   : done;
      break;
    }
    CacheSegment::SlotEntry entry;
    std::memcpy(&entry, scratch.data() + intact * CacheSegment::kSlotEntryBytes, sizeof(entry));
    if (entry.hash_hi != hashes[intact].hi || entry.hash_lo != hashes[intact].lo) {
      status = absl::NotFoundError(absl::StrCat("fetch: the holder's slot ", slots[intact],
                                                " no longer holds block ", hashes[intact].ToHex()));
      break;
    }
    kv::BlockChecksummer sum;
    for (int g = 0; g < num_groups; ++g) {
      sum.Update(cache.pool(g).SlotAddress(local[g][intact]),
                 static_cast<size_t>(layout.BlockBytes(g)));
    }
    if (sum.Digest() != entry.checksum) {
      status = absl::DataLossError(absl::StrCat("fetch: block ", hashes[intact].ToHex(), " from ",
                                                holder.node_id, " failed its checksum"));
      break;
    }
  }
  return intact;
}

}  // namespace

FetchedPrefix FetchBlocks(transfer::Transport& transport, transfer::PeerId peer,
                          const RemoteReplica& holder, absl::Span<const int64_t> slots,
                          absl::Span<const kv::BlockHash> hashes, const kv::ModelLayout& layout,
                          const RegisteredKvCache& kv, transfer::MemoryRegionPtr& scratch,
                          FetchQuarantine& quarantine, uint64_t tag, absl::Time deadline,
                          std::vector<std::vector<kv::SlotId>>& group_slots) {
  FetchedPrefix out;
  const absl::Time start = absl::Now();
  const size_t n = hashes.size();
  model::KvCache& cache = kv.cache();
  if (n == 0) return out;
  if (slots.size() != n || scratch == nullptr ||
      scratch->size_bytes() < n * CacheSegment::kSlotEntryBytes) {
    out.status = absl::InvalidArgumentError("fetch: slots, hashes and scratch do not match");
    return out;
  }
  absl::StatusOr<GroupSlots> local =
      AllocateLocal(cache, static_cast<int>(layout.groups().size()), n);
  if (!local.ok()) {
    out.status = local.status();
    return out;
  }
  absl::StatusOr<transfer::TransferPlan> plan =
      transport.Prepare(FetchBatch(peer, tag, holder, slots, layout, kv, *local, scratch.get()));
  if (!plan.ok()) {
    ReleaseFrom(cache, *local, 0);
    out.status = plan.status();
    return out;
  }
  transfer::PostOptions post;
  post.deadline = deadline;
  absl::StatusOr<transfer::TransferHandlePtr> handle =
      transport.Post(*plan, transfer::LayerRange::All(), post);
  absl::Status done = handle.ok() ? (*handle)->Wait(deadline) : handle.status();
  std::vector<absl::Status> per_block;
  if (handle.ok() && !done.ok()) {
    // Failed or late: nothing of it is used. It may still be writing into the slots and the
    // scratch region, so they go to the quarantine with it; the request goes on at once.
    (*handle)->Cancel();
    out.elapsed = absl::Now() - start;
    out.status = done;
    const size_t entry_bytes = scratch->size_bytes();
    quarantine.Hold(*std::move(handle), *std::move(local), std::move(scratch));
    absl::StatusOr<transfer::MemoryRegionPtr> fresh = transport.AllocateMemory(entry_bytes);
    if (fresh.ok()) scratch = *std::move(fresh);
    return out;
  }
  if (handle.ok()) {
    per_block = (*handle)->block_statuses();
    out.wire_bytes = static_cast<uint64_t>((*handle)->bytes());
    handle->reset();
  }
  out.elapsed = absl::Now() - start;
  // Each block: every piece arrived, the entry names it, and its bytes are the entry's.
  const size_t intact = CountIntact(per_block, done, holder, slots, hashes, layout, cache, *local,
                                    *scratch, out.status);
  ReleaseFrom(cache, *local, intact);
  group_slots.resize(local->size());
  for (size_t g = 0; g < local->size(); ++g) {
    group_slots[g].insert(group_slots[g].end(), (*local)[g].begin(), (*local)[g].end());
  }
  uint64_t unit_bytes = 0;  // one block in every group
  for (size_t g = 0; g < local->size(); ++g) {
    unit_bytes += static_cast<uint64_t>(layout.BlockBytes(static_cast<int>(g)));
  }
  out.intact = static_cast<int64_t>(intact);
  out.kv_bytes = static_cast<uint64_t>(intact) * unit_bytes;
  return out;
}

}  // namespace kvrelay::worker
