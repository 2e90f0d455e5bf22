#include "cachestore/adaptive_policy.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace kvrelay::cachestore {

int ReplayRequestInto(BlockIndex& index, absl::Span<const BlockHash> chain, int64_t capacity,
                      int64_t* cached, int64_t* evictions) {
  const int hits = index.MatchPrefix(chain, /*touch=*/false, /*lease=*/false, nullptr);
  std::vector<BlockHash> leased;
  leased.reserve(chain.size());
  BlockHash parent;
  for (const BlockHash& h : chain) {
    if (index.Touch(h, /*lease=*/true)) {
      leased.push_back(h);
      parent = h;
      continue;
    }
    while (*cached >= capacity) {
      if (!index.EvictOne().has_value()) break;
      --*cached;
      ++*evictions;
    }
    // A request longer than the whole cache: the rest of it cannot be stored.
    if (*cached >= capacity) break;
    NewBlock block;
    block.hash = h;
    block.parent = parent;
    if (!index.Insert(block, BlockState::kCommitted, /*lease=*/true).ok()) break;
    ++*cached;
    leased.push_back(h);
    parent = h;
  }
  index.ReleaseLeases(leased);
  return hits;
}

struct AdaptivePolicy::Shadow {
  Shadow(std::unique_ptr<EvictionPolicy> p, int64_t cap)
      : policy(std::move(p)), capacity(cap), index([&] {
          BlockIndex::Options o;
          o.policy = policy.get();
          o.ghost_capacity = static_cast<size_t>(kGhostCaches * cap);
          return o;
        }()) {}
  std::unique_ptr<EvictionPolicy> policy;
  int64_t capacity;
  BlockIndex index;
  int64_t cached = 0;
  int64_t evictions = 0;
};

AdaptivePolicy::AdaptivePolicy(int64_t capacity_blocks)
    : fast_(kFastHalfLifeCaches * static_cast<double>(std::max<int64_t>(capacity_blocks, 1))),
      probation_(std::max<int64_t>(capacity_blocks, 1), kRefetchLagCaches) {
  absl::MutexLock lock(&mu_);
  ResetShadows(capacity_blocks);
}

AdaptivePolicy::~AdaptivePolicy() {
  {
    absl::MutexLock lock(&queue_mu_);
    stop_ = true;
  }
  if (learner_.joinable()) learner_.join();
}

void AdaptivePolicy::LearnInBackground() const {
  absl::MutexLock lock(&queue_mu_);
  if (background_.exchange(true, std::memory_order_acq_rel)) return;
  // The learner starts with every signal blocked, so SIGTERM / SIGINT always reach a thread
  // that handles them (a process that waits for signals in one thread would otherwise be killed
  // when the kernel picks this one).
  sigset_t all, previous;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &previous);
  learner_ = std::thread([this] { LearnerLoop(); });
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
}

void AdaptivePolicy::LearnerLoop() const {
  // Lookups first: replaying a chain into three shadows costs several lookups' worth of CPU,
  // and on a store whose cores are busy answering MatchPrefix the learner ran at their expense
  // (half the gRPC lookup rate on 2 cores). At the lowest priority it takes what the lookups
  // leave; when it falls behind, the bounded queue skips chains (sampling), as before. Learning
  // inline (trace-replay, tests) is unchanged. Linux: the nice value is per thread.
  // And SCHED_IDLE (issue 19): nice 19 still weighs 15 against 36 for a store run at nice 15,
  // and a 16-client lookup benchmark measured the learner at ~4 s of CPU in 7.5 s on 2 cores;
  // SCHED_IDLE runs it only on CPU time nothing else wants.
  bool idle_priority;
  {
    absl::MutexLock lock(&queue_mu_);
    idle_priority = idle_priority_;
  }
  if (idle_priority) {
    const pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
    (void)setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 19);
    const sched_param no_priority{};
    (void)sched_setscheduler(tid, SCHED_IDLE, &no_priority);
  }
  auto thread_cpu = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return absl::DurationFromTimespec(ts);
  };
  AdaptivePolicy* self = const_cast<AdaptivePolicy*>(this);
  absl::Time window_start = absl::Now();
  absl::Duration window_cpu_start = thread_cpu();
  int quiet_windows = 0;
  // One overrun alone may be noise (a page-fault burst, a vCPU descheduled while its thread's
  // clock ran: CI measured a refined learner flip back to coarse on its first judged window with
  // one 2-block chain in it). The learner always rests after an overrun; it samples coarser only
  // when the window before was over too.
  int overrun_windows = 0;
  // The window after a change of sampling is not judged: its first chains pay for the fresh
  // shadows' first touches, which would read as an overrun and coarsen again.
  bool grace = false;
  while (true) {
    Queued next;
    double share;
    absl::Duration window;
    {
      absl::MutexLock lock(&queue_mu_);
      queue_mu_.Await(absl::Condition(
          +[](AdaptivePolicy* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->queue_mu_) {
            return p->stop_ || !p->queue_.empty();
          },
          self));
      if (stop_) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      queued_.store(queue_.size(), std::memory_order_relaxed);
      share = budget_share_;
      window = budget_window_;
    }
    if (next.key_stats) NoteKeyStats(next.chain);
    if (next.learn) Learn(next.chain);
    const absl::Duration used = thread_cpu() - window_cpu_start;
    const absl::Duration budget = window * share;
    const absl::Time now = absl::Now();
    if (grace) {
      if (now - window_start < window) continue;
      grace = false;
    } else if (used > budget) {
      overruns_.fetch_add(1, std::memory_order_relaxed);
      quiet_windows = 0;
      if (++overrun_windows >= kOverrunWindowsBeforeCoarser && CoarserSampling()) {
        overrun_windows = 0;
        grace = true;
        KV_LOG(INFO) << "cachestore: adaptive policy learner over its CPU budget ("
                     << static_cast<int>(100 * share) << "% of a core): learning from 1 in "
                     << (uint64_t{1} << sample_shift()) << " chains";
      }
      // Rest until the window ends; what queues meanwhile was sampled at the old rate and is
      // dropped (lookups skip while the queue is full).
      std::deque<Queued> dropped;  // freed after the lock is released
      absl::MutexLock lock(&queue_mu_);
      queue_mu_.AwaitWithDeadline(absl::Condition(
                                      +[](AdaptivePolicy* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                                           p->queue_mu_) { return p->stop_; },
                                      self),
                                  std::max(now, window_start + window));
      if (stop_) return;
      dropped.swap(queue_);
      queued_.store(0, std::memory_order_relaxed);
    } else if (now - window_start < window) {
      continue;
    } else {
      overrun_windows = 0;
      if (used * 4 >= budget) {
        quiet_windows = 0;
      } else if (++quiet_windows >= kQuietWindowsBeforeFiner) {
        quiet_windows = 0;
        if (FinerSampling()) {
          refinements_.fetch_add(1, std::memory_order_relaxed);
          grace = true;
          KV_LOG(INFO) << "cachestore: adaptive policy learner under its CPU budget: learning "
                          "from 1 in "
                       << (uint64_t{1} << sample_shift()) << " chains";
        }
      }
    }
    window_start = absl::Now();
    window_cpu_start = thread_cpu();
  }
}

void AdaptivePolicy::SetLearnerBudget(double cpu_share_of_one_core, absl::Duration window) const {
  absl::MutexLock lock(&queue_mu_);
  budget_share_ = cpu_share_of_one_core;
  budget_window_ = window;
}

void AdaptivePolicy::SetLearnerIdlePriority(bool idle) const {
  absl::MutexLock lock(&queue_mu_);
  idle_priority_ = idle;
}

void AdaptivePolicy::SetBudgetSampling(int halvings) const {
  absl::MutexLock lock(&mu_);
  budget_shift_ = std::max(halvings, 0);
  ResetShadows(capacity_);
}

bool AdaptivePolicy::TakeForKeyStats(bool per_thread) const {
  if (sample_mask_.load(std::memory_order_relaxed) == 0) return false;
  if (per_thread) {
    thread_local uint32_t offered = 0;
    return ++offered % kKeyStatEvery == 0;
  }
  return offered_.fetch_add(1, std::memory_order_relaxed) % kKeyStatEvery == kKeyStatEvery - 1;
}

void AdaptivePolicy::NoteKeyStats(absl::Span<const BlockHash> chain) const {
  absl::MutexLock lock(&mu_);
  const size_t kept = std::min(chain.size(), static_cast<size_t>(kMaxSampleDepth) + 1);
  key_stats_.emplace_back(chain.begin(), chain.begin() + static_cast<std::ptrdiff_t>(kept));
  if (key_stats_.size() < kKeyStatChains) return;
  const size_t depth = static_cast<size_t>(sample_depth_.load(std::memory_order_relaxed));
  auto key_of = [depth](const std::vector<BlockHash>& c) {
    return c[std::min(depth, c.size() - 1)];
  };
  absl::flat_hash_map<BlockHash, size_t> heads;
  BlockHash top;
  size_t top_count = 0;
  for (const std::vector<BlockHash>& c : key_stats_) {
    const BlockHash key = key_of(c);
    if (const size_t n = ++heads[key]; n > top_count) {
      top_count = n;
      top = key;
    }
  }
  if (top_count * 4 > key_stats_.size()) {
    // Where the chains under the dominant key part: their longest common prefix.
    const std::vector<BlockHash>* first = nullptr;
    size_t common = 0;
    for (const std::vector<BlockHash>& c : key_stats_) {
      if (!(key_of(c) == top)) continue;
      if (first == nullptr) {
        first = &c;
        common = c.size();
        continue;
      }
      size_t i = 0;
      while (i < common && i < c.size() && c[i] == (*first)[i]) ++i;
      common = i;
    }
    const size_t deeper = std::min(common, static_cast<size_t>(kMaxSampleDepth));
    if (deeper > depth) {
      sample_depth_.store(static_cast<int>(deeper), std::memory_order_relaxed);
      ResetShadows(capacity_);
      KV_LOG(INFO) << "cachestore: adaptive policy: one prefix of " << deeper << " blocks heads "
                   << (100 * top_count / key_stats_.size())
                   << "% of chains; sampling them by their block at depth " << deeper;
    }
  }
  key_stats_.clear();
}

bool AdaptivePolicy::CoarserSampling() const {
  absl::MutexLock lock(&mu_);
  if (shadows_[0]->capacity / 2 < kMinShadowBlocks) return false;
  ++budget_shift_;
  ResetShadows(capacity_);
  return true;
}

bool AdaptivePolicy::FinerSampling() const {
  absl::MutexLock lock(&mu_);
  if (budget_shift_ == 0) return false;
  --budget_shift_;
  ResetShadows(capacity_);
  return true;
}

void AdaptivePolicy::ResetShadows(int64_t capacity_blocks) const {
  capacity_ = std::max<int64_t>(capacity_blocks, 1);
  int64_t shadow_capacity = capacity_;
  int shift = 0;
  while (shadow_capacity > kMaxShadowBlocks) {
    shadow_capacity /= 2;
    ++shift;
  }
  int budget_halvings = 0;
  while (budget_halvings < budget_shift_ && shadow_capacity / 2 >= kMinShadowBlocks) {
    shadow_capacity /= 2;
    ++shift;
    ++budget_halvings;
  }
  // A smaller capacity hint may leave room for fewer halvings: FinerSampling then undoes a real
  // one.
  budget_shift_ = budget_halvings;
  sample_mask_.store((uint64_t{1} << shift) - 1, std::memory_order_relaxed);
  const double cap = static_cast<double>(shadow_capacity);
  shadows_[0] =
      std::make_unique<Shadow>(std::make_unique<LruPolicy>(/*leaf_only=*/true), shadow_capacity);
  shadows_[1] = std::make_unique<Shadow>(std::make_unique<LrfuPolicy>(kFastHalfLifeCaches * cap),
                                         shadow_capacity);
  shadows_[2] = std::make_unique<Shadow>(
      std::make_unique<ProbationLruPolicy>(shadow_capacity, kRefetchLagCaches), shadow_capacity);
  lead_ = {};
  spread_ = {};
}

void AdaptivePolicy::OnInsert(AccessStats& stats, const BlockHash& hash, uint64_t tick,
                              const AccessStats* ghost) const {
  stats.crf =
      ghost == nullptr ? kFirstSightCrf : fast_.InsertedCrf(ghost->crf, ghost->last_tick, tick);
  probation_.OnInsert(stats, hash, tick, ghost);  // sets probation and last_tick
}

void AdaptivePolicy::OnAccess(AccessStats& stats, const BlockHash& hash, uint64_t tick) const {
  stats.crf = fast_.AccessedCrf(stats.crf, stats.last_tick, tick);
  probation_.OnAccess(stats, hash, tick);  // clears probation, sets last_tick
}

double AdaptivePolicy::Priority(const AccessStats& stats) const {
  switch (ranking_.load(std::memory_order_relaxed)) {
    case 1:
      return fast_.PriorityOf(stats.crf, stats.last_tick);
    case 2:
      return probation_.Priority(stats);
    default:
      return lru_.Priority(stats);
  }
}

void AdaptivePolicy::SetCapacityHint(int64_t capacity_blocks) const {
  if (capacity_blocks <= 0) return;
  fast_.SetHalfLife(kFastHalfLifeCaches * static_cast<double>(capacity_blocks));
  probation_.SetCapacityHint(capacity_blocks);
  absl::MutexLock lock(&mu_);
  if (capacity_blocks != capacity_) ResetShadows(capacity_blocks);
}

void AdaptivePolicy::OnRequest(absl::Span<const BlockHash> chain) const {
  if (chain.empty()) return;
  if (background_.load(std::memory_order_acquire)) {
    // Outside the sample (relaxed: a stale mask or depth lets Learn re-check it) and not taken
    // for the key statistics, or the queue is full (a stale count only lets one chain more or
    // less in): nothing to do.
    const bool learn = InSample(chain);
    const bool key_stats = TakeForKeyStats(/*per_thread=*/true);
    if ((!learn && !key_stats) || queued_.load(std::memory_order_relaxed) >= kMaxQueuedRequests) {
      return;
    }
    absl::MutexLock lock(&queue_mu_);
    if (queue_.size() < kMaxQueuedRequests) {
      queue_.push_back(Queued{{chain.begin(), chain.end()}, learn, key_stats});
      queued_.store(queue_.size(), std::memory_order_relaxed);
    }
    return;
  }
  if (TakeForKeyStats(/*per_thread=*/false)) NoteKeyStats(chain);
  Learn(chain);
}

void AdaptivePolicy::Learn(absl::Span<const BlockHash> chain) const {
  absl::MutexLock lock(&mu_);
  // Counted once the lock is released (after the ranking decision), whatever the path out.
  struct CountOnExit {
    std::atomic<int64_t>& n;
    ~CountOnExit() { n.fetch_add(1, std::memory_order_release); }
  } count{learned_};
  const int64_t shadow_capacity = shadows_[0]->capacity;
  // Sample whole chains by their key block so shared prefixes stay together.
  if (!InSample(chain)) return;
  sampled_.fetch_add(1, std::memory_order_relaxed);
  std::array<double, kRankings> hits{};
  for (int i = 0; i < kRankings; ++i) {
    Shadow& s = *shadows_[i];
    hits[i] = ReplayRequestInto(s.index, chain, s.capacity, &s.cached, &s.evictions);
  }
  const double keep = std::exp2(-static_cast<double>(chain.size()) /
                                (kScoreMemoryCaches * static_cast<double>(shadow_capacity)));
  for (int a = 0; a < kRankings; ++a) {
    for (int b = 0; b < kRankings; ++b) {
      const double d = hits[a] - hits[b];
      lead_[a][b] = lead_[a][b] * keep + d;
      spread_[a][b] = spread_[a][b] * keep + d * d;
    }
  }
  // Move to the ranking with the most significant lead over the current one, if any.
  const int current = ranking_.load(std::memory_order_relaxed);
  int best = current;
  double best_z = kSwitchZ;
  for (int c = 0; c < kRankings; ++c) {
    if (c == current || spread_[c][current] <= 0) continue;
    const double z = lead_[c][current] / std::sqrt(spread_[c][current]);
    if (z > best_z) {
      best_z = z;
      best = c;
    }
  }
  if (best != current) {
    ranking_.store(best, std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace kvrelay::cachestore
