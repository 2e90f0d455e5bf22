#pragma once

// A worker's disk tier: fixed-size block slots in one preallocated file on local NVMe, written
// and read with io_uring and O_DIRECT, queue_depth operations in flight.
//
// Each slot is a 4 KiB header followed by the block's bytes (rounded up to 4 KiB), written in
// one operation, so a block's identity travels with its bytes as in the DRAM segment's slot
// table.
//
// Layer-wise reads: the options may cut a block into stages (each a set of byte ranges of the
// block, e.g. the layer strips of a range of layers). On disk a block is stored stage after
// stage, so each stage is one contiguous read, and the header carries a checksum per stage:
// ReadStage hands a stage's bytes to the caller as soon as they verify, while later stages
// are still on the device (the prefill computes the first layers of its new tokens meanwhile).
// Nothing is trusted that does not verify: a read checks the header's magic, version and checksum,
// the layout fingerprint, the block hash it was asked for and the payload's XXH3. A torn or partial
// write fails one of them (the header and payload checksums cover both halves of an overwritten
// slot), so it reads as DataLoss: recompute, never serve.
//
// The block hash already binds the layout fingerprint and the tenant's salt (kv/block_hash.h),
// and the file is named by the layout fingerprint: a block of another layout or tenant cannot
// match a lookup. One file per layout, locked (flock) by the one process that uses it.
//
// A write that finds the disk full (ENOSPC) stops the tier taking blocks (reads of the blocks
// it holds go on); any I/O error (EIO, short transfers) stops it for good, reads included.
// Refused calls fail at once with Unavailable and disabled_reason() says why (the worker logs
// it, exports it, and goes on serving from DRAM).
//
// Not thread-safe: one thread owns the ring (the worker's tier thread); disabled() may be read
// from any thread.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/model_layout.h"

namespace kvrelay::kv {

// A byte range of a block (as it lies in memory).
struct PayloadRange {
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct DiskTierOptions {
  std::string directory;
  uint64_t capacity_bytes = 0;  // the file's size; num_slots = capacity / slot_bytes
  uint64_t block_bytes = 0;     // payload bytes per block (a whole block unit)
  LayoutFingerprint layout;
  uint32_t queue_depth = 32;
  // The block's stages, read in this order by ReadStage: every byte of the block in exactly one
  // range, at most kMaxStages stages. Empty: one stage, the whole block. Part of the format: a
  // slot written under another plan does not verify.
  std::vector<std::vector<PayloadRange>> stages;
  // Reserve the file's blocks at open (fallocate), so a full disk is found at start rather
  // than mid-run. Off: a sparse file, whose writes may meet ENOSPC later.
  bool preallocate = true;
  // Test hook: sees each completed operation's result (bytes or -errno) and returns the result
  // to act on, e.g. -EIO to inject a failing disk.
  std::function<int(bool is_write, int64_t slot, int result)> inject_result;
};

// Why a tier stopped taking blocks (structured, for logs and metrics).
enum class DiskTierFailure { kNone = 0, kFull, kIoError };
const char* DiskTierFailureName(DiskTierFailure failure);

class DiskTier {
 public:
  static constexpr uint64_t kAlignment = 4096;
  static constexpr uint64_t kHeaderBytes = 4096;
  static constexpr int kMaxStages = 16;

  // Creates or opens DIR/kvrelay-<layout fingerprint>.tier. InvalidArgument for bad options,
  // FailedPrecondition when another process holds the file, ResourceExhausted when the
  // directory's file system cannot hold capacity_bytes.
  static absl::StatusOr<std::unique_ptr<DiskTier>> Open(DiskTierOptions options);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  int64_t num_slots() const { return num_slots_; }
  uint64_t block_bytes() const { return options_.block_bytes; }
  uint64_t slot_bytes() const { return slot_bytes_; }  // header + payload, 4 KiB aligned
  const std::string& path() const { return path_; }
  bool direct_io() const { return direct_io_; }  // false where the file system refuses O_DIRECT
  bool disabled() const { return failure_.load() != DiskTierFailure::kNone; }
  DiskTierFailure failure() const { return failure_.load(); }
  std::string disabled_reason() const;

  struct BlockWrite {
    int64_t slot = 0;
    BlockHash hash;
    absl::Span<const uint8_t> data;  // block_bytes()
  };
  // Writes every block, queue_depth at a time; one status per write. OK means the block is on
  // the device (O_DIRECT) and will verify on read.
  std::vector<absl::Status> WriteBlocks(absl::Span<const BlockWrite> writes);

  struct BlockRead {
    int64_t slot = 0;
    BlockHash hash;           // the block the caller expects in the slot
    absl::Span<uint8_t> out;  // block_bytes()
  };
  // Reads and verifies every block; one status per read: DataLoss when the slot holds another
  // block or fails a check (recompute it; the tier stays up), Unavailable when the tier is
  // disabled or the read failed.
  std::vector<absl::Status> ReadBlocks(absl::Span<const BlockRead> reads);

  int num_stages() const { return static_cast<int>(stages_.size()); }

  // A layer-wise read of one block: `stage_checksums` is filled by stage 0 (which also checks
  // the header: layout, block hash, slot) and checks every later stage of the same read. The
  // caller keeps the slot from being rewritten between its stages (the tier thread runs them
  // back to back).
  struct StageChecksums {
    uint64_t sums[kMaxStages] = {};
  };
  struct StagedRead {
    int64_t slot = 0;
    BlockHash hash;
    StageChecksums* checksums = nullptr;
  };
  // Reads stage `stage` of every block; one status per read (as ReadBlocks). `deliver(i,
  // bytes)` is called for each read that verified, with the stage's bytes in stage order
  // (ScatterStage puts them where they belong), before the next completion is looked at.
  std::vector<absl::Status> ReadStage(
      absl::Span<const StagedRead> reads, int stage,
      const std::function<void(size_t, absl::Span<const uint8_t>)>& deliver);
  // Copies a stage's bytes (as ReadStage delivers them) to their places in a block laid out in
  // memory as `block` (block_bytes()).
  struct Destination {
    uint64_t offset = 0;  // in the block
    uint64_t length = 0;
    uint8_t* memory = nullptr;
  };
  void ScatterStage(int stage, absl::Span<const uint8_t> bytes,
                    absl::Span<const Destination> block) const;

  struct StoredBlock {
    int64_t slot = 0;
    BlockHash hash;
  };
  // Reads every slot and returns the blocks that verify completely (header and payload): what
  // a restarted worker re-announces. `rejected` (optional) counts slots that held a header of
  // this layout but failed a check (torn writes, flipped bytes).
  absl::StatusOr<std::vector<StoredBlock>> Scan(int64_t* rejected = nullptr);

 private:
  struct Ring;
  struct Op;
  explicit DiskTier(DiskTierOptions options);
  absl::Status Init();
  // Where operation i goes: `slot` (for the test hook), and the file range.
  struct OpRange {
    int64_t slot = 0;
    uint64_t offset = 0;
    uint32_t length = 0;
  };
  OpRange WholeSlot(int64_t slot) const;
  // Runs `count` operations through the ring: prepare(i, buffer) fills a write's buffer;
  // complete(i, buffer, result) sees each result (the buffer holds the op's range).
  void RunOps(size_t count, bool is_write, const std::function<OpRange(size_t)>& op_of,
              const std::function<void(size_t, uint8_t*)>& prepare,
              const std::function<void(size_t, uint8_t*, int)>& complete);
  // Whether the tier takes no more operations of this kind (writes: after any failure;
  // reads: after an I/O error, not after the disk filled).
  bool Refuses(bool is_write) const;
  // After each operation's own checks (`statuses`): all refused when the tier takes no more of
  // this kind, else the indices of those that passed.
  std::vector<size_t> Runnable(std::vector<absl::Status>& statuses, bool is_write) const;
  void Disable(DiskTierFailure failure, const std::string& reason);
  absl::Status DisabledStatus() const;
  // Checks a slot image read from disk (its header, and its payload unless `header_only`);
  // payload out (in block order) when `out` is non-empty, stage checksums out when given.
  absl::Status VerifySlot(const uint8_t* image, int64_t slot, const BlockHash* expected,
                          BlockHash* found, absl::Span<uint8_t> out, bool header_only = false,
                          StageChecksums* checksums = nullptr) const;
  // Lays a block out in stage order (disk) or back (memory).
  void ToDiskOrder(const uint8_t* block, uint8_t* disk) const;
  void FromDiskOrder(const uint8_t* disk, uint8_t* block) const;

  DiskTierOptions options_;
  std::string path_;
  int fd_ = -1;
  bool direct_io_ = true;
  uint64_t slot_bytes_ = 0;
  uint64_t io_bytes_ = 0;  // bytes per operation: header + payload rounded up
  int64_t num_slots_ = 0;
  std::vector<std::vector<PayloadRange>> stages_;  // never empty after Init
  std::vector<uint64_t> stage_begin_;              // each stage's offset in the disk payload
  std::vector<uint64_t> stage_length_;
  uint64_t stage_plan_ = 0;  // checksum of stages_, kept in every header
  std::unique_ptr<Ring> ring_;
  std::atomic<DiskTierFailure> failure_{DiskTierFailure::kNone};
  mutable absl::Mutex reason_mu_;
  std::string disabled_reason_ ABSL_GUARDED_BY(reason_mu_);
};

}  // namespace kvrelay::kv
