#pragma once

// DiskCache: a worker's disk tier (--ssd-dir, --ssd-bytes) behind its DRAM cache segment. Blocks
// that leave the segment (the store handed their slot to a new block) are demoted here instead
// of dropped; a later request on this node reads them back (promotion) when that is faster than
// recomputing them.
//
// One tier thread owns the kv::DiskTier (io_uring, O_DIRECT, each slot a verified header plus the
// block) and runs every disk operation: demotions queue (bounded; more are dropped and counted),
// reads are queued before them and waited for up to the request's deadline. The tier's own slots
// are kept least recently used first: a demotion into a full tier overwrites the oldest block.
//
// Nothing is trusted that does not verify: every read checks the slot's header (layout
// fingerprint, the block hash asked for, its checksums) and the payload's XXH3 (DiskTier), so a
// slot rewritten since it was listed, a torn write or a flipped byte reads as DataLoss and the
// block is recomputed. The block hash binds the tenant's salt and the layout fingerprint, and the
// file is named by the fingerprint: no other tenant's or layout's block can match. At open every
// slot is scanned and only blocks that verify completely are listed (a restart after kill -9).
//
// When the disk fills (ENOSPC at open or later) or fails (EIO), the tier stops taking blocks with
// one ERROR log line and kvrelay:disk_tier_up 0 plus kvrelay:disk_tier_stopped_total{reason};
// the worker serves on from DRAM.
//
// Thread-safe. Metrics (if any) must outlive the cache.

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/metrics.h"
#include "kv/block_hash.h"
#include "kv/disk/disk_tier.h"
#include "kv/model_layout.h"
#include "kv/reuse_cost.h"

namespace kvrelay::worker {

struct DiskCacheOptions {
  std::string directory;        // --ssd-dir (required)
  uint64_t capacity_bytes = 0;  // --ssd-bytes: the tier file's size (required)
  uint64_t block_bytes = 0;     // one whole block (CacheSegment::block_bytes())
  kv::LayoutFingerprint layout;
  std::string node_id;  // for log lines
  uint32_t queue_depth = 32;
  // How a block is cut into stages for layer-wise reads (kv::DiskTierOptions::stages; empty:
  // one stage). The worker cuts it by layers: DiskStagePlan.
  std::vector<std::vector<kv::PayloadRange>> stages;
  // Bytes of demotions waiting for the tier thread (at least one block is always taken); more
  // are dropped (counted) so a slow disk never holds copies without bound. Default 256 MiB.
  uint64_t max_queued_bytes = uint64_t{256} << 20;
  MetricsRegistry* metrics = nullptr;  // not owned; optional
  MetricLabels metric_labels;
  // Test hook, handed to kv::DiskTierOptions::inject_result (e.g. -EIO).
  std::function<int(bool is_write, int64_t slot, int result)> inject_result;
};

// Whether to read `blocks` blocks (`bytes`, `tokens` of prompt) back from a disk tier that reads
// at `disk_bytes_per_second` (0: not measured yet) or to recompute them at
// `prefill_tokens_per_second` (0: not measured yet): kv::ChoosePullOrRecompute with the disk as
// the link. A disk slower than recomputing is not read (kRecompute); unmeasured, it is read
// (that measures it).
kv::PullOrRecompute ChooseDiskOrRecompute(uint64_t bytes, int64_t tokens,
                                          double disk_bytes_per_second,
                                          double prefill_tokens_per_second);

class DiskCache {
 public:
  // Opens (or creates) the tier file, scans it and starts the tier thread. The tier's own errors
  // (kv::DiskTier::Open): InvalidArgument for bad options, FailedPrecondition when another
  // process holds the file. A directory whose file system cannot hold capacity_bytes
  // (ResourceExhausted) gives a cache that is stopped from the start (logged, exported): the
  // worker serves on from DRAM.
  static absl::StatusOr<std::unique_ptr<DiskCache>> Open(DiskCacheOptions options);
  ~DiskCache();  // stops the tier thread (queued demotions are dropped)
  DiskCache(const DiskCache&) = delete;
  DiskCache& operator=(const DiskCache&) = delete;

  // Queues a copy of one block leaving DRAM (`bytes`: block_bytes, checked by the caller against
  // its slot entry). False when not queued: the tier is stopped, the queue is full, or the block
  // is listed already.
  bool Demote(const kv::BlockHash& hash, absl::Span<const uint8_t> bytes);

  // How many blocks of `chain`, from `first` on, the tier lists in an unbroken run (no I/O).
  int64_t HeldRun(absl::Span<const kv::BlockHash> chain, int64_t first) const;

  // Reads and verifies `hashes` in order; returns the bytes of the leading blocks that verified
  // (fewer when one failed: it is unlisted and counted as corrupt). DeadlineExceeded when the tier
  // thread did not finish by `deadline` (nothing is returned; the read is dropped), Unavailable
  // when the tier is stopped for reads.
  absl::StatusOr<std::vector<std::vector<uint8_t>>> Read(absl::Span<const kv::BlockHash> hashes,
                                                         absl::Time deadline);

  // A layer-wise read in progress (ReadStaged): the tier thread reads every block's stage 0,
  // then stage 1, ..., and copies each stage's bytes into the caller's memory as soon as they
  // verify; the caller waits for the stage it needs next.
  class StagedRead {
   public:
    ~StagedRead();  // Cancel()
    StagedRead(const StagedRead&) = delete;
    StagedRead& operator=(const StagedRead&) = delete;
    // Blocks (leading ones of those asked for) being read.
    int64_t blocks() const;
    // Stages in place so far, without waiting.
    int stages_done() const;
    // Waits until stage `stage` of every block is in place. DataLoss when a block failed
    // verification (it is unlisted: recompute), Unavailable when the tier failed or shut down,
    // DeadlineExceeded when neither happened by `deadline`. A failed read fails every later
    // stage too.
    absl::Status WaitForStage(int stage, absl::Time deadline);
    // From its return on, nothing more is written into the destinations (they may be freed).
    void Cancel();

   private:
    friend class DiskCache;
    struct Job;
    explicit StagedRead(std::shared_ptr<Job> job) : job_(std::move(job)) {}
    std::shared_ptr<Job> job_;
  };
  int num_stages() const { return tier_ != nullptr ? tier_->num_stages() : 1; }
  // Starts a layer-wise read of `hashes`; block i's bytes go to `destinations[i]` (where each
  // byte range of the block lies in memory; they must stay valid until the read is cancelled
  // or destroyed). Reads the leading run the tier still lists (StagedRead::blocks(), maybe 0);
  // Unavailable when the tier is stopped for reads.
  absl::StatusOr<std::unique_ptr<StagedRead>> ReadStaged(
      absl::Span<const kv::BlockHash> hashes,
      std::vector<std::vector<kv::DiskTier::Destination>> destinations, absl::Time deadline);

  // Blocks until every demotion queued before the call is written (or dropped), or `deadline`.
  // For tests and orderly shutdown.
  bool Flush(absl::Time deadline);

  // What each slot holds, for the cache store: `hash` listed in `slot`, or a zero hash when the
  // slot was unlisted (overwritten, failed verification, or the tier stopped on an I/O error).
  using Listener = std::function<void(int64_t slot, const kv::BlockHash& hash)>;
  // Installs `listener` and calls it at once with every listed (slot, block), then with every
  // change after them, in order (on the tier thread; never two calls at once; it must be cheap
  // and must not call back into the cache). Empty: none from now on; after Listen({}) returns
  // no call of an earlier listener is running or will run.
  void Listen(Listener listener) ABSL_LOCKS_EXCLUDED(notify_mu_, mu_);
  std::vector<std::pair<int64_t, kv::BlockHash>> Listed() const;

  bool up() const;  // takes blocks (not stopped)
  uint64_t slot_bytes() const { return tier_ != nullptr ? tier_->slot_bytes() : 0; }
  int64_t listed_blocks() const;
  int64_t num_slots() const { return num_slots_; }
  // Blocks that verified at open (the restart scan) and slots that held a header of this layout
  // but failed a check.
  int64_t scanned_blocks() const { return scanned_blocks_; }
  int64_t rejected_at_scan() const { return rejected_at_scan_; }
  // Bytes per second of verified reads, measured online (0 until the first read).
  double read_bytes_per_second() const { return read_rate_.rate(); }
  const std::string& path() const { return path_; }
  // Why the tier stopped ("" while up).
  std::string stopped_reason() const;

 private:
  struct Write {
    kv::BlockHash hash;
    std::vector<uint8_t> bytes;
  };
  struct ReadJob;

  explicit DiskCache(DiskCacheOptions options);
  void Loop();
  void RunWrites(std::vector<Write> writes);
  void RunRead(ReadJob& job);
  void RunStaged(StagedRead::Job& job);
  // Unlists a block that failed verification (if `slot` still holds it) and counts it.
  void DropCorrupt(int64_t slot, const kv::BlockHash& hash, const absl::Status& why);
  // Logs once and exports that the tier stopped; with an I/O error every listing goes too.
  void NoteStopped(kv::DiskTierFailure failure, const std::string& reason);
  void CheckTier();
  // A slot for a new block: a free one, else the least recently used block's (unlisted first).
  int64_t TakeSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ListLocked(const kv::BlockHash& hash, int64_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnlistLocked(int64_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TouchLocked(int64_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hands the changes recorded since the last call to the listener (outside mu_).
  void NotifyChanges() ABSL_LOCKS_EXCLUDED(notify_mu_, mu_);
  void DeliverChanges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(notify_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  const DiskCacheOptions options_;
  std::unique_ptr<kv::DiskTier> tier_;  // null when the tier could not be opened (full disk)
  std::string path_;
  int64_t num_slots_ = 0;
  int64_t scanned_blocks_ = 0;
  int64_t rejected_at_scan_ = 0;
  kv::RateMeter read_rate_{0.3};

  Gauge* up_gauge_ = nullptr;
  Gauge* blocks_gauge_ = nullptr;
  Counter* demoted_ = nullptr;
  Counter* dropped_ = nullptr;
  Counter* promoted_ = nullptr;
  Counter* corrupt_ = nullptr;

  // Lock order: notify_mu_ (held while the listener runs) -> mu_.
  absl::Mutex notify_mu_;
  mutable absl::Mutex mu_;
  absl::CondVar work_cv_;
  absl::CondVar flushed_cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;  // the tier stopped taking blocks
  std::string stopped_reason_ ABSL_GUARDED_BY(mu_);
  std::deque<Write> writes_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<ReadJob>> reads_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<StagedRead::Job>> staged_ ABSL_GUARDED_BY(mu_);
  uint64_t writes_queued_ ABSL_GUARDED_BY(mu_) = 0;  // demotions ever queued
  uint64_t writes_done_ ABSL_GUARDED_BY(mu_) = 0;    // of those, written or dropped
  absl::flat_hash_map<kv::BlockHash, int64_t> slot_of_ ABSL_GUARDED_BY(mu_);
  // Per slot: the block it holds (listed) and its place in lru_ (front: most recent).
  struct SlotState {
    bool listed = false;
    kv::BlockHash hash;
    std::list<int64_t>::iterator lru;
  };
  std::vector<SlotState> slots_ ABSL_GUARDED_BY(mu_);
  std::list<int64_t> lru_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> free_ ABSL_GUARDED_BY(mu_);
  Listener listener_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int64_t, kv::BlockHash>> changes_ ABSL_GUARDED_BY(mu_);  // for listener_
  std::thread thread_;  // last: started after everything above exists, joined first
};

}  // namespace kvrelay::worker
