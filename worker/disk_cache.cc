#include "worker/disk_cache.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"

namespace kvrelay::worker {

struct DiskCache::ReadJob {
  std::vector<kv::BlockHash> hashes;
  std::vector<int64_t> slots;
  absl::Time deadline;
  // Filled by the tier thread before `done`: the leading blocks that verified.
  std::vector<std::vector<uint8_t>> out;
  absl::Status status;
  absl::Notification done;
};

struct DiskCache::StagedRead::Job {
  std::vector<kv::BlockHash> hashes;
  std::vector<int64_t> slots;
  std::vector<std::vector<kv::DiskTier::Destination>> destinations;
  absl::Time deadline;
  absl::Mutex mu;
  absl::CondVar changed;
  int stages_done ABSL_GUARDED_BY(mu) = 0;
  absl::Status failure ABSL_GUARDED_BY(mu);  // set once; no stage after it completes
  bool cancelled ABSL_GUARDED_BY(mu) = false;
};

DiskCache::StagedRead::~StagedRead() { Cancel(); }

int64_t DiskCache::StagedRead::blocks() const { return static_cast<int64_t>(job_->hashes.size()); }

int DiskCache::StagedRead::stages_done() const {
  absl::MutexLock lock(&job_->mu);
  return job_->stages_done;
}

absl::Status DiskCache::StagedRead::WaitForStage(int stage, absl::Time deadline) {
  absl::MutexLock lock(&job_->mu);
  while (job_->stages_done <= stage && job_->failure.ok()) {
    if (job_->changed.WaitWithDeadline(&job_->mu, deadline) && job_->stages_done <= stage &&
        job_->failure.ok()) {
      return absl::DeadlineExceededError(absl::StrCat("disk tier read of ", job_->hashes.size(),
                                                      " blocks: stage ", stage,
                                                      " not read by the deadline"));
    }
  }
  if (job_->stages_done > stage) return absl::OkStatus();
  return job_->failure;
}

void DiskCache::StagedRead::Cancel() {
  absl::MutexLock lock(&job_->mu);
  job_->cancelled = true;
}

kv::PullOrRecompute ChooseDiskOrRecompute(uint64_t bytes, int64_t tokens,
                                          double disk_bytes_per_second,
                                          double prefill_tokens_per_second) {
  return kv::ChoosePullOrRecompute({.bytes = bytes,
                                    .tokens = tokens,
                                    .link_bytes_per_second = disk_bytes_per_second,
                                    .link_latency_seconds = 0,
                                    .prefill_tokens_per_second = prefill_tokens_per_second});
}

DiskCache::DiskCache(DiskCacheOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<DiskCache>> DiskCache::Open(DiskCacheOptions options) {
  auto cache = std::unique_ptr<DiskCache>(new DiskCache(std::move(options)));
  const DiskCacheOptions& o = cache->options_;
  if (o.metrics != nullptr) {
    MetricsRegistry& m = *o.metrics;
    cache->up_gauge_ = m.GetGauge("kvrelay:disk_tier_up",
                                  "1 while the disk tier (--ssd-dir) takes blocks, 0 once it "
                                  "stopped (full disk, I/O error): serving goes on from DRAM",
                                  o.metric_labels);
    cache->blocks_gauge_ = m.GetGauge("kvrelay:disk_tier_blocks",
                                      "blocks the disk tier holds (verified)", o.metric_labels);
    cache->demoted_ =
        m.GetCounter("kvrelay:disk_tier_demoted_blocks_total",
                     "blocks written to the disk tier after leaving DRAM", o.metric_labels);
    cache->dropped_ = m.GetCounter(
        "kvrelay:disk_tier_dropped_blocks_total",
        "blocks leaving DRAM that the disk tier did not take (stopped, queue full, write failed)",
        o.metric_labels);
    cache->promoted_ =
        m.GetCounter("kvrelay:disk_tier_promoted_blocks_total",
                     "blocks read back from the disk tier and verified", o.metric_labels);
    cache->corrupt_ = m.GetCounter(
        "kvrelay:disk_tier_corrupt_blocks_total",
        "disk tier blocks that failed verification (recomputed, never used)", o.metric_labels);
  }
  kv::DiskTierOptions tier_options;
  tier_options.directory = o.directory;
  tier_options.capacity_bytes = o.capacity_bytes;
  tier_options.block_bytes = o.block_bytes;
  tier_options.layout = o.layout;
  tier_options.queue_depth = o.queue_depth;
  tier_options.stages = o.stages;
  tier_options.inject_result = o.inject_result;
  absl::StatusOr<std::unique_ptr<kv::DiskTier>> tier = kv::DiskTier::Open(tier_options);
  if (absl::IsResourceExhausted(tier.status())) {
    // A full disk is a fault the worker serves through, not bad usage.
    cache->NoteStopped(kv::DiskTierFailure::kFull, std::string(tier.status().message()));
  } else if (!tier.ok()) {
    return tier.status();
  } else {
    cache->tier_ = *std::move(tier);
    cache->path_ = cache->tier_->path();
    cache->num_slots_ = cache->tier_->num_slots();
    absl::StatusOr<std::vector<kv::DiskTier::StoredBlock>> scanned =
        cache->tier_->Scan(&cache->rejected_at_scan_);
    {
      absl::MutexLock lock(&cache->mu_);
      cache->slots_.resize(static_cast<size_t>(cache->num_slots_));
      if (scanned.ok()) {
        for (const kv::DiskTier::StoredBlock& b : *scanned) {
          if (cache->slot_of_.contains(b.hash)) continue;  // a duplicate: keep the first
          cache->ListLocked(b.hash, b.slot);
        }
        cache->scanned_blocks_ = static_cast<int64_t>(cache->slot_of_.size());
      }
      for (int64_t s = cache->num_slots_ - 1; s >= 0; --s) {
        if (!cache->slots_[static_cast<size_t>(s)].listed) cache->free_.push_back(s);
      }
    }
    if (!scanned.ok()) {
      const kv::DiskTierFailure failure = cache->tier_->failure();
      cache->NoteStopped(
          failure == kv::DiskTierFailure::kNone ? kv::DiskTierFailure::kIoError : failure,
          std::string(scanned.status().message()));
    }
  }
  if (cache->up_gauge_ != nullptr) cache->up_gauge_->Set(cache->up() ? 1 : 0);
  if (cache->blocks_gauge_ != nullptr) {
    cache->blocks_gauge_->Set(static_cast<double>(cache->listed_blocks()));
  }
  if (cache->tier_ != nullptr) {
    KV_LOG(INFO) << o.node_id << ": disk tier " << cache->path_ << ": " << cache->num_slots_
                 << " block slots, " << cache->scanned_blocks_ << " verified blocks found"
                 << (cache->rejected_at_scan_ > 0
                         ? absl::StrCat(", ", cache->rejected_at_scan_,
                                        " slots failed verification (not used)")
                         : "")
                 << (cache->tier_->direct_io() ? "" : " (no O_DIRECT on this file system)");
  }
  cache->thread_ = std::thread([c = cache.get()] { c->Loop(); });
  return cache;
}

DiskCache::~DiskCache() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    work_cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

bool DiskCache::up() const {
  absl::MutexLock lock(&mu_);
  return !stopped_ && tier_ != nullptr;
}

int64_t DiskCache::listed_blocks() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(slot_of_.size());
}

std::string DiskCache::stopped_reason() const {
  absl::MutexLock lock(&mu_);
  return stopped_reason_;
}

bool DiskCache::Demote(const kv::BlockHash& hash, absl::Span<const uint8_t> bytes) {
  absl::MutexLock lock(&mu_);
  const bool take = tier_ != nullptr && !stopped_ && !stop_ &&
                    bytes.size() == options_.block_bytes &&
                    (writes_.empty() ||
                     (writes_.size() + 1) * options_.block_bytes <= options_.max_queued_bytes) &&
                    !slot_of_.contains(hash);
  if (!take) {
    if (dropped_ != nullptr) dropped_->Increment();
    return false;
  }
  writes_.push_back(Write{hash, std::vector<uint8_t>(bytes.begin(), bytes.end())});
  ++writes_queued_;
  work_cv_.Signal();
  return true;
}

int64_t DiskCache::HeldRun(absl::Span<const kv::BlockHash> chain, int64_t first) const {
  absl::MutexLock lock(&mu_);
  int64_t run = 0;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(first, 0)); i < chain.size(); ++i) {
    if (!slot_of_.contains(chain[i])) break;
    ++run;
  }
  return run;
}

absl::StatusOr<std::vector<std::vector<uint8_t>>> DiskCache::Read(
    absl::Span<const kv::BlockHash> hashes, absl::Time deadline) {
  auto job = std::make_shared<ReadJob>();
  job->deadline = deadline;
  {
    absl::MutexLock lock(&mu_);
    if (tier_ == nullptr || tier_->failure() == kv::DiskTierFailure::kIoError) {
      return absl::UnavailableError(absl::StrCat("disk tier stopped: ", stopped_reason_));
    }
    for (const kv::BlockHash& h : hashes) {
      auto it = slot_of_.find(h);
      if (it == slot_of_.end()) break;
      job->hashes.push_back(h);
      job->slots.push_back(it->second);
      TouchLocked(it->second);
    }
    if (job->hashes.empty()) return std::vector<std::vector<uint8_t>>{};
    reads_.push_back(job);
    work_cv_.Signal();
  }
  // The tier thread keeps its own reference: a request that gives up leaves it a job to drop.
  if (!job->done.WaitForNotificationWithDeadline(deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("disk tier read of ", job->hashes.size(),
                                                    " blocks did not finish by the deadline"));
  }
  if (!job->status.ok()) return job->status;
  return std::move(job->out);
}

absl::StatusOr<std::unique_ptr<DiskCache::StagedRead>> DiskCache::ReadStaged(
    absl::Span<const kv::BlockHash> hashes,
    std::vector<std::vector<kv::DiskTier::Destination>> destinations, absl::Time deadline) {
  if (destinations.size() != hashes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("disk tier staged read: ", hashes.size(),
                                                   " blocks, ", destinations.size(),
                                                   " destination lists"));
  }
  auto job = std::make_shared<StagedRead::Job>();
  job->deadline = deadline;
  absl::MutexLock lock(&mu_);
  if (tier_ == nullptr || tier_->failure() == kv::DiskTierFailure::kIoError) {
    return absl::UnavailableError(absl::StrCat("disk tier stopped: ", stopped_reason_));
  }
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto it = slot_of_.find(hashes[i]);
    if (it == slot_of_.end()) break;
    job->hashes.push_back(hashes[i]);
    job->slots.push_back(it->second);
    job->destinations.push_back(std::move(destinations[i]));
    TouchLocked(it->second);
  }
  if (!job->hashes.empty()) {
    staged_.push_back(job);
    work_cv_.Signal();
  }
  return std::unique_ptr<StagedRead>(new StagedRead(std::move(job)));
}

bool DiskCache::Flush(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  const uint64_t target = writes_queued_;
  while (writes_done_ < target) {
    if (flushed_cv_.WaitWithDeadline(&mu_, deadline)) return writes_done_ >= target;
  }
  return true;
}

void DiskCache::Loop() {
  while (true) {
    std::shared_ptr<ReadJob> read;
    std::shared_ptr<StagedRead::Job> staged;
    std::vector<Write> writes;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && reads_.empty() && staged_.empty() && writes_.empty()) work_cv_.Wait(&mu_);
      if (stop_) {
        writes_done_ += writes_.size();
        writes_.clear();
        for (auto& r : reads_) {
          r->status = absl::UnavailableError("disk tier shutting down");
          r->done.Notify();
        }
        reads_.clear();
        for (auto& j : staged_) {
          absl::MutexLock job_lock(&j->mu);
          j->failure = absl::UnavailableError("disk tier shutting down");
          j->changed.SignalAll();
        }
        staged_.clear();
        flushed_cv_.SignalAll();
        return;
      }
      // Reads first: a request waits on them; demotions only fill the tier.
      if (!staged_.empty()) {
        staged = std::move(staged_.front());
        staged_.pop_front();
      } else if (!reads_.empty()) {
        read = std::move(reads_.front());
        reads_.pop_front();
      } else {
        const size_t n =
            std::min<size_t>(writes_.size(), std::max<uint32_t>(options_.queue_depth, 1));
        for (size_t i = 0; i < n; ++i) {
          writes.push_back(std::move(writes_.front()));
          writes_.pop_front();
        }
      }
    }
    // The tier's state is checked before the waiter hears back, so what it sees next (up(),
    // the metrics) already says whether the tier stopped.
    if (staged != nullptr) {
      RunStaged(*staged);
      CheckTier();
      NotifyChanges();
    } else if (read != nullptr) {
      RunRead(*read);
      CheckTier();
      NotifyChanges();
      read->done.Notify();
    } else {
      const size_t n = writes.size();
      RunWrites(std::move(writes));
      CheckTier();
      NotifyChanges();
      absl::MutexLock lock(&mu_);
      writes_done_ += n;
      flushed_cv_.SignalAll();
    }
  }
}

void DiskCache::RunWrites(std::vector<Write> writes) {
  std::vector<kv::DiskTier::BlockWrite> ops;
  std::vector<size_t> of_op;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < writes.size(); ++i) {
      if (stopped_ || slot_of_.contains(writes[i].hash)) {
        if (dropped_ != nullptr) dropped_->Increment();
        continue;
      }
      // Unlisted before the write starts: a concurrent read of the old block finds it gone, or
      // reads the new header and fails verification (DataLoss), never the new bytes as old.
      const int64_t slot = TakeSlotLocked();
      if (slot < 0) break;
      ops.push_back({slot, writes[i].hash, absl::MakeConstSpan(writes[i].bytes)});
      of_op.push_back(i);
    }
  }
  if (ops.empty()) return;
  const std::vector<absl::Status> statuses = tier_->WriteBlocks(ops);
  absl::MutexLock lock(&mu_);
  for (size_t k = 0; k < ops.size(); ++k) {
    if (statuses[k].ok() && !slot_of_.contains(ops[k].hash)) {
      ListLocked(ops[k].hash, ops[k].slot);
      if (demoted_ != nullptr) demoted_->Increment();
    } else {
      free_.push_back(ops[k].slot);
      if (dropped_ != nullptr) dropped_->Increment();
    }
  }
  if (blocks_gauge_ != nullptr) blocks_gauge_->Set(static_cast<double>(slot_of_.size()));
}

void DiskCache::RunRead(ReadJob& job) {
  if (absl::Now() >= job.deadline) {
    job.status = absl::DeadlineExceededError("disk tier read: the request's deadline passed");
    return;
  }
  std::vector<std::vector<uint8_t>> buffers(job.hashes.size(),
                                            std::vector<uint8_t>(options_.block_bytes));
  std::vector<kv::DiskTier::BlockRead> ops;
  for (size_t i = 0; i < job.hashes.size(); ++i) {
    ops.push_back({job.slots[i], job.hashes[i], absl::MakeSpan(buffers[i])});
  }
  const absl::Time start = absl::Now();
  const std::vector<absl::Status> statuses = tier_->ReadBlocks(ops);
  const absl::Duration took = absl::Now() - start;
  size_t good = 0;
  while (good < statuses.size() && statuses[good].ok()) ++good;
  if (good > 0 && took > absl::ZeroDuration()) {
    read_rate_.Observe(static_cast<double>(good * options_.block_bytes),
                       absl::ToDoubleSeconds(took), absl::Now());
  }
  if (good < statuses.size() && absl::IsDataLoss(statuses[good])) {
    DropCorrupt(job.slots[good], job.hashes[good], statuses[good]);
  }
  if (good == 0 && good < statuses.size() && !absl::IsDataLoss(statuses[good])) {
    job.status = statuses[good];
    return;
  }
  buffers.resize(good);
  if (promoted_ != nullptr) promoted_->Increment(static_cast<double>(good));
  job.out = std::move(buffers);
}

void DiskCache::DropCorrupt(int64_t slot, const kv::BlockHash& hash, const absl::Status& why) {
  KV_LOG(WARNING) << options_.node_id << ": disk tier block in slot " << slot
                  << " failed verification (" << why.message() << "); recomputing it";
  absl::MutexLock lock(&mu_);
  auto it = slot_of_.find(hash);
  if (it != slot_of_.end() && it->second == slot) {
    UnlistLocked(slot);
    free_.push_back(slot);
  }
  if (corrupt_ != nullptr) corrupt_->Increment();
  if (blocks_gauge_ != nullptr) blocks_gauge_->Set(static_cast<double>(slot_of_.size()));
}

void DiskCache::RunStaged(StagedRead::Job& job) {
  std::vector<kv::DiskTier::StageChecksums> sums(job.hashes.size());
  std::vector<kv::DiskTier::StagedRead> ops;
  for (size_t i = 0; i < job.hashes.size(); ++i) {
    ops.push_back({job.slots[i], job.hashes[i], &sums[i]});
  }
  auto fail = [&job](absl::Status why) {
    absl::MutexLock lock(&job.mu);
    job.failure = std::move(why);
    job.changed.SignalAll();
  };
  const absl::Time start = absl::Now();
  for (int stage = 0; stage < tier_->num_stages(); ++stage) {
    {
      absl::MutexLock lock(&job.mu);
      if (job.cancelled) return;
    }
    if (absl::Now() >= job.deadline) {
      return fail(absl::DeadlineExceededError("disk tier read: the request's deadline passed"));
    }
    const std::vector<absl::Status> statuses =
        tier_->ReadStage(ops, stage, [&](size_t i, absl::Span<const uint8_t> bytes) {
          // Under the job's lock: once Cancel() returns, nothing is copied into memory the
          // caller may have freed.
          absl::MutexLock lock(&job.mu);
          if (!job.cancelled) tier_->ScatterStage(stage, bytes, job.destinations[i]);
        });
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (statuses[i].ok()) continue;
      if (absl::IsDataLoss(statuses[i])) DropCorrupt(job.slots[i], job.hashes[i], statuses[i]);
      return fail(statuses[i]);
    }
    if (stage + 1 == tier_->num_stages()) {
      // Counted before the waiter hears of the last stage, so what it reads next is current.
      const absl::Duration took = absl::Now() - start;
      if (took > absl::ZeroDuration()) {
        read_rate_.Observe(static_cast<double>(job.hashes.size() * options_.block_bytes),
                           absl::ToDoubleSeconds(took), absl::Now());
      }
      if (promoted_ != nullptr) promoted_->Increment(static_cast<double>(job.hashes.size()));
    }
    absl::MutexLock lock(&job.mu);
    job.stages_done = stage + 1;
    job.changed.SignalAll();
  }
}

void DiskCache::CheckTier() {
  if (tier_ == nullptr || !tier_->disabled()) return;
  NoteStopped(tier_->failure(), tier_->disabled_reason());
}

void DiskCache::NoteStopped(kv::DiskTierFailure failure, const std::string& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stopped_reason_ = absl::StrCat(kv::DiskTierFailureName(failure), ": ", reason);
    if (failure == kv::DiskTierFailure::kIoError) {
      // Reads are refused from now on: nothing stays listed.
      for (int64_t s = 0; s < static_cast<int64_t>(slots_.size()); ++s) {
        if (slots_[static_cast<size_t>(s)].listed) UnlistLocked(s);
      }
    }
    if (blocks_gauge_ != nullptr) blocks_gauge_->Set(static_cast<double>(slot_of_.size()));
  }
  KV_LOG(ERROR) << options_.node_id << ": disk tier stopped taking blocks ("
                << kv::DiskTierFailureName(failure) << "): " << reason
                << "; serving goes on from DRAM";
  if (up_gauge_ != nullptr) up_gauge_->Set(0);
  if (options_.metrics != nullptr) {
    MetricLabels labels = options_.metric_labels;
    labels["reason"] = kv::DiskTierFailureName(failure);
    options_.metrics
        ->GetCounter("kvrelay:disk_tier_stopped_total",
                     "times the disk tier stopped taking blocks, by reason (full, io_error)",
                     labels)
        ->Increment();
  }
}

int64_t DiskCache::TakeSlotLocked() {
  if (!free_.empty()) {
    const int64_t slot = free_.back();
    free_.pop_back();
    return slot;
  }
  if (lru_.empty()) return -1;
  const int64_t victim = lru_.back();
  UnlistLocked(victim);
  return victim;
}

void DiskCache::ListLocked(const kv::BlockHash& hash, int64_t slot) {
  if (listener_) changes_.push_back({slot, hash});
  SlotState& s = slots_[static_cast<size_t>(slot)];
  s.listed = true;
  s.hash = hash;
  lru_.push_front(slot);
  s.lru = lru_.begin();
  slot_of_[hash] = slot;
}

void DiskCache::UnlistLocked(int64_t slot) {
  SlotState& s = slots_[static_cast<size_t>(slot)];
  if (!s.listed) return;
  if (listener_) changes_.push_back({slot, kv::BlockHash{}});
  auto it = slot_of_.find(s.hash);
  if (it != slot_of_.end() && it->second == slot) slot_of_.erase(it);
  lru_.erase(s.lru);
  s.listed = false;
}

void DiskCache::Listen(Listener listener) {
  absl::MutexLock notify(&notify_mu_);
  {
    absl::MutexLock lock(&mu_);
    listener_ = std::move(listener);
    changes_.clear();
    if (listener_) {
      for (const auto& [hash, slot] : slot_of_) changes_.push_back({slot, hash});
    }
  }
  DeliverChanges();
}

std::vector<std::pair<int64_t, kv::BlockHash>> DiskCache::Listed() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<int64_t, kv::BlockHash>> out;
  for (const auto& [hash, slot] : slot_of_) out.push_back({slot, hash});
  return out;
}

void DiskCache::NotifyChanges() {
  absl::MutexLock notify(&notify_mu_);
  DeliverChanges();
}

void DiskCache::DeliverChanges() {
  Listener listener;
  std::vector<std::pair<int64_t, kv::BlockHash>> changes;
  {
    absl::MutexLock lock(&mu_);
    if (changes_.empty() || !listener_) return;
    listener = listener_;
    changes.swap(changes_);
  }
  for (const auto& [slot, hash] : changes) listener(slot, hash);
}

void DiskCache::TouchLocked(int64_t slot) {
  SlotState& s = slots_[static_cast<size_t>(slot)];
  if (!s.listed) return;
  lru_.splice(lru_.begin(), lru_, s.lru);
}

}  // namespace kvrelay::worker
