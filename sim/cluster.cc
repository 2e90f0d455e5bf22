#include "sim/cluster.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode/admission.h"
#include "kv/reuse_cost.h"
#include "prefill/admission.h"
#include "prefill/prefix_source.h"
#include "proto/grpc_status.h"

namespace kvrelay::sim {

using cachestore::CacheStore;
using gateway::WorkerSet;

namespace {

std::vector<kv::BlockHash> UnpackChain(const std::string& packed) {
  std::vector<kv::BlockHash> chain;
  for (size_t at = 0; at + 16 <= packed.size(); at += 16) {
    chain.push_back(kv::BlockHash::FromBytes(
        absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(packed.data()) + at, 16)));
  }
  return chain;
}

// Simulated gRPC: half the round trip before the call is handled, half after.
class RpcLeg {
 public:
  RpcLeg(Scheduler* s, absl::Duration rpc) : s_(s), half_(rpc / 2) {
    s_->SleepUntil(s_->Now() + half_);
  }
  ~RpcLeg() { s_->SleepUntil(s_->Now() + half_); }

 private:
  Scheduler* const s_;
  const absl::Duration half_;
};

}  // namespace

// --- A node's tiers --------------------------------------------------------------------------

// What a worker's StoreLink and DiskCache keep track of: which block each DRAM segment slot
// holds (so the block a new allocation overwrites is demoted, StoreLink::DemoteSlotLocked) and
// the disk tier's slots, least recently used first (DiskCache).
class SimCluster::NodeTiers {
 public:
  // Without a disk nothing is tracked (nothing is demoted).
  NodeTiers(int64_t dram_slots, int64_t disk_slots)
      : dram_(disk_slots > 0 ? static_cast<size_t>(dram_slots) : 0), disk_slots_(disk_slots) {}
  bool has_disk() const { return disk_slots_ > 0; }

  // DRAM slot `slot` now holds `hash`; returns the block it held before (zero: none, or the
  // same block).
  kv::BlockHash Place(int64_t slot, const kv::BlockHash& hash) {
    if (slot < 0 || slot >= static_cast<int64_t>(dram_.size())) return {};
    kv::BlockHash before = dram_[static_cast<size_t>(slot)];
    dram_[static_cast<size_t>(slot)] = hash;
    return before == hash ? kv::BlockHash{} : before;
  }
  // The disk slot `hash` is written to (-1: no disk, or it is there already).
  int64_t Demote(const kv::BlockHash& hash) {
    if (!has_disk() || hash == kv::BlockHash{} || slot_of_.contains(hash)) return -1;
    int64_t slot;
    if (static_cast<int64_t>(disk_.size()) < disk_slots_) {
      slot = static_cast<int64_t>(disk_.size());
      disk_.push_back({hash, lru_.end()});
    } else {
      slot = lru_.back();  // the least recently used block is overwritten
      lru_.pop_back();
      slot_of_.erase(disk_[static_cast<size_t>(slot)].hash);
      disk_[static_cast<size_t>(slot)].hash = hash;
    }
    lru_.push_front(slot);
    disk_[static_cast<size_t>(slot)].lru = lru_.begin();
    slot_of_[hash] = slot;
    return slot;
  }
  // How many blocks of chain[first, ...) the disk holds in an unbroken run; touches them.
  int64_t HeldRun(absl::Span<const kv::BlockHash> chain, int64_t first) {
    int64_t run = 0;
    for (size_t i = static_cast<size_t>(first); i < chain.size(); ++i) {
      auto it = slot_of_.find(chain[i]);
      if (it == slot_of_.end()) break;
      Disk& d = disk_[static_cast<size_t>(it->second)];
      lru_.splice(lru_.begin(), lru_, d.lru);
      ++run;
    }
    return run;
  }

 private:
  struct Disk {
    kv::BlockHash hash;
    std::list<int64_t>::iterator lru;
  };
  std::vector<kv::BlockHash> dram_;
  const int64_t disk_slots_;
  std::vector<Disk> disk_;
  std::list<int64_t> lru_;  // front: most recently used
  absl::flat_hash_map<kv::BlockHash, int64_t> slot_of_;
};

// --- Prefill ---------------------------------------------------------------------------------

class SimCluster::PrefillNode final : public gateway::PrefillEndpoint {
 public:
  PrefillNode(SimCluster* cluster, int index, int link)
      : cluster_(cluster),
        node_id_(absl::StrCat("prefill-", index)),
        address_(absl::StrCat("sim-prefill-", index, ":1")),
        incarnation_(static_cast<uint64_t>(index) + 1),
        link_(link),
        compute_(cluster->scheduler_),
        queue_(&rate_, node_id_) {
    usage_.node_id = node_id_;
    usage_.prefill = true;
    // The worker measures its rate on 4 blocks before it serves (MeasureComputeRate).
    const int64_t measured = 4 * int64_t{cluster->layout_.block_tokens()};
    rate_.Observe(static_cast<double>(measured),
                  absl::ToDoubleSeconds(cluster->profile_.PrefillTime(measured, 0)),
                  cluster->scheduler_->Now());
  }
  const std::string& address() const override { return address_; }
  const std::string& node_id() const { return node_id_; }
  uint64_t incarnation() const { return incarnation_; }
  const NodeUsage& usage() const { return usage_; }

  absl::StatusOr<kvrelay::v1::PrefillResponse> Prefill(const kvrelay::v1::PrefillRequest& request,
                                                       absl::Time deadline) override;
  absl::StatusOr<kvrelay::v1::PrefillStatusResponse> Status(absl::Time) override {
    kvrelay::v1::PrefillStatusResponse response;
    response.set_node_id(node_id_);
    return response;
  }
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time deadline) override {
    return cluster_->PromoteOn(node_id_, incarnation_, link_, request, deadline);
  }

 private:
  SimCluster* const cluster_;
  const std::string node_id_;
  const std::string address_;
  const uint64_t incarnation_;
  const int link_;
  SimMutex compute_;
  kv::RateMeter rate_;
  prefill::PrefillQueue queue_;
  NodeUsage usage_;
};

absl::StatusOr<kvrelay::v1::PrefillResponse> SimCluster::PrefillNode::Prefill(
    const kvrelay::v1::PrefillRequest& request, absl::Time deadline) {
  SimCluster& c = *cluster_;
  Scheduler& s = *c.scheduler_;
  RpcLeg rpc(&s, c.profile_.Rpc());
  const int32_t bt = c.layout_.block_tokens();
  const int64_t tokens = request.tokens_size();
  const int64_t full = tokens > 0 ? (tokens - 1) / bt : 0;
  const kvrelay::v1::ReserveResponse& target = request.target();
  const int64_t decode_held = std::min<int64_t>(target.held_blocks(), full);
  // The worker's own admission rule, with its own figures (prefill_worker.cc).
  const absl::Duration remaining = c.spec_.QueueBound(deadline - s.Now());
  absl::StatusOr<prefill::PrefillQueue::Ticket> ticket =
      queue_.Admit((full - decode_held) * bt, remaining);
  if (!ticket.ok()) {
    ++usage_.refused;
    return ticket.status();
  }
  if (full > 0 && decode_held >= full) {  // PrefillWorker::HeldByDecode: nothing to compute
    kvrelay::v1::PrefillResponse response;
    response.set_prefix_source("decode");
    response.set_prefix_hit_tokens(static_cast<int32_t>(full * bt));
    response.set_pushed_tokens(static_cast<int32_t>(full * bt));
    return response;
  }
  const absl::Time queued_at = s.Now();
  compute_.Lock();
  usage_.queued += s.Now() - queued_at;
  ++usage_.requests;

  const std::vector<kv::BlockHash> chain = kv::HashChain(
      c.layout_.fingerprint(), request.tenant_salt(),
      absl::MakeConstSpan(request.tokens().data(), static_cast<size_t>(full * bt)), bt);
  const cachestore::Caller caller{node_id_, incarnation_};
  ++c.store_calls_;
  c.store_blocks_ += static_cast<int64_t>(chain.size());
  absl::StatusOr<cachestore::MatchResult> match =
      c.store_->MatchPrefix(chain, absl::Seconds(60), caller);
  int64_t local = 0;
  int64_t disk = 0;
  int64_t remote = 0;
  int remote_link = -1;
  // Only DRAM replicas are read as they are: disk replicas are the holder's to promote.
  auto dram_holder = [&](const cachestore::MatchResult::Block& b, const std::string& want) {
    for (const auto& r : b.replicas) {
      const cachestore::Location& at = match->segments[r.segment];
      if (at.tier != cachestore::Tier::kSsd && (want.empty() || at.node_id == want)) {
        return at.node_id;
      }
    }
    return std::string();
  };
  if (match.ok()) {
    while (local < match->matched && !dram_holder(match->blocks[local], node_id_).empty()) ++local;
  }
  // The blocks after those that this node's own disk holds (PrefillWorker::PromoteFromDisk),
  // read when that beats recomputing them.
  NodeTiers& tiers = c.TiersOf(link_);
  if (tiers.has_disk() && local < full) {
    const int64_t run = std::min(tiers.HeldRun(chain, local), full - local);
    const kv::PullOrRecompute choice =
        kv::ChoosePullOrRecompute({.bytes = static_cast<uint64_t>(run) * c.block_bytes_,
                                   .tokens = run * bt,
                                   .link_bytes_per_second = c.profile_.disk_read_bytes_per_second,
                                   .link_latency_seconds = 0,
                                   .prefill_tokens_per_second = rate_.rate()});
    if (run > 0 && choice.choice == kv::ReuseChoice::kPull) disk = run;
  }
  if (match.ok() && local + disk < match->matched) {
    const std::string holder = dram_holder(match->blocks[local + disk], "");
    while (!holder.empty() && local + disk + remote < match->matched &&
           !dram_holder(match->blocks[local + disk + remote], holder).empty()) {
      ++remote;
    }
    if (!holder.empty()) remote_link = c.LinkOf(holder);
  }
  // Pull or recompute the run another node holds: the worker's own choice.
  int64_t pulled = 0;
  if (remote > 0 && remote_link >= 0 && c.spec_.pull_remote_prefix) {
    const kv::PullOrRecompute choice =
        kv::ChoosePullOrRecompute({.bytes = static_cast<uint64_t>(remote) * c.block_bytes_,
                                   .tokens = remote * bt,
                                   .link_bytes_per_second = c.profile_.network_bytes_per_second,
                                   .link_latency_seconds = c.profile_.network_latency_us / 1e6,
                                   .prefill_tokens_per_second = rate_.rate()});
    if (choice.choice == kv::ReuseChoice::kPull) {
      c.Transfer(remote_link, link_, static_cast<uint64_t>(remote) * c.block_bytes_);
      usage_.bytes_pulled += static_cast<uint64_t>(remote) * c.block_bytes_;
      pulled = remote;
    }
  }
  const int64_t cached = local + disk + pulled;
  const int64_t computed = tokens - cached * bt;
  const absl::Duration compute = c.profile_.PrefillTime(computed, cached * bt);
  // Layer-wise promotion: layer L computes once its stage is read, so the read and the compute
  // overlap but for one stage of either (the worker's 8 stages).
  const absl::Duration read = c.profile_.DiskRead(static_cast<uint64_t>(disk) * c.block_bytes_);
  const double stages = std::min<double>(8, c.layout_.num_layers());
  const absl::Duration until_computed =
      disk > 0 ? std::max(read + compute / stages, read / stages + compute) : compute;
  s.SleepUntil(s.Now() + until_computed);
  usage_.busy += compute;
  usage_.disk_blocks_read += disk;
  rate_.Observe(static_cast<double>(computed), absl::ToDoubleSeconds(compute), s.Now());
  c.CommitOn(node_id_, incarnation_, link_, chain, static_cast<size_t>(local));
  if (match.ok() && match->lease_id != 0) {
    ++c.store_calls_;
    (void)c.store_->ReleaseLease(match->lease_id, caller);
  }
  compute_.Unlock();

  // The push: every prompt token the decode node does not hold, over both links.
  const uint64_t pushed_bytes =
      static_cast<uint64_t>(tokens - decode_held * bt) * c.bytes_per_token_;
  const int decode_link = c.LinkOf(target.node_id());
  if (decode_link >= 0) c.Transfer(link_, decode_link, pushed_bytes);
  usage_.bytes_out += pushed_bytes;

  kvrelay::v1::PrefillResponse response;
  response.set_prefix_hit_tokens(static_cast<int32_t>(cached * bt));
  response.set_computed_tokens(static_cast<int32_t>(computed));
  response.set_pushed_bytes(static_cast<int64_t>(pushed_bytes));
  response.set_pushed_tokens(static_cast<int32_t>(tokens - decode_held * bt));
  response.set_fetched_bytes(static_cast<int64_t>(pulled) * static_cast<int64_t>(c.block_bytes_));
  response.set_fetched_tokens(static_cast<int32_t>(pulled * bt));
  response.set_committed_blocks(static_cast<int32_t>(full - local));
  response.set_prefix_source(prefill::PrefixSourceName({.matched = match.ok() ? match->matched : 0,
                                                        .hit_blocks = local,
                                                        .disk_blocks = disk,
                                                        .pulled_blocks = pulled,
                                                        .pull_attempted = remote > 0}));
  return response;
}

// --- Decode ----------------------------------------------------------------------------------

class SimCluster::DecodeNode final : public gateway::DecodeEndpoint {
 public:
  DecodeNode(SimCluster* cluster, int index, int link)
      : cluster_(cluster),
        link_(link),
        node_id_(absl::StrCat("decode-", index)),
        address_(absl::StrCat("sim-decode-", index, ":1")),
        incarnation_(static_cast<uint64_t>(index) + 1001),
        admission_({.max_batch = cluster->spec_.max_batch, .max_queued = cluster->spec_.max_queued},
                   node_id_),
        free_blocks_(cluster->spec_.decode_kv_blocks) {
    usage_.node_id = node_id_;
  }
  const std::string& address() const override { return address_; }
  const std::string& node_id() const { return node_id_; }
  uint64_t incarnation() const { return incarnation_; }
  const NodeUsage& usage() const { return usage_; }

  absl::StatusOr<kvrelay::v1::ReserveResponse> Reserve(const kvrelay::v1::ReserveRequest& request,
                                                       absl::Time deadline) override;
  absl::Status Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                        absl::Duration chunk_timeout,
                        const gateway::DecodeChunkSink& sink) override;
  void Release(const std::string& request_id, const std::string& /*token*/,
               absl::Time /*deadline*/) override {
    auto it = reservations_.find(request_id);
    if (it == reservations_.end() || it->second.generating) return;
    free_blocks_ += it->second.blocks;
    reservations_.erase(it);
  }
  absl::StatusOr<kvrelay::v1::DecodeStatusResponse> Status(absl::Time) override {
    kvrelay::v1::DecodeStatusResponse response;
    response.set_node_id(node_id_);
    return response;
  }
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time deadline) override {
    return cluster_->PromoteOn(node_id_, incarnation_, link_, request, deadline);
  }

 private:
  struct Reservation {
    int64_t blocks = 0;
    int32_t held = 0;  // leading prompt blocks this node held already (not committed again)
    bool generating = false;
  };
  struct Sequence {
    Scheduler::Process* process = nullptr;
    int64_t context = 0;    // tokens in its KV so far
    int32_t generated = 0;  // tokens handed out
    int32_t max_tokens = 0;
    absl::Time joined;  // when Generate queued it for the batch
  };
  // Admits waiting sequences up to max_batch and schedules the step's end (scheduler thread
  // or a process; idempotent while a step runs).
  // Steps run in runs: every step from one change of the batch to the next (a sequence's first
  // or last token, or a newcomer that fits), as one event instead of one per token.
  // StartRun admits waiting sequences up to max_batch and schedules the run's end (scheduler
  // thread or a process; idempotent while a run is scheduled); EndRun hands out the run's
  // tokens. A newcomer that fits cuts the run at the end of the step in progress.
  void StartRun();
  void EndRun(uint64_t run);
  void CutRunForNewcomer();

  SimCluster* const cluster_;
  const int link_;
  const std::string node_id_;
  const std::string address_;
  const uint64_t incarnation_;
  decode::DecodeAdmission admission_;
  int64_t free_blocks_;
  absl::flat_hash_map<std::string, Reservation> reservations_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;
  bool stepping_ = false;
  uint64_t run_ = 0;                       // the scheduled run (stale EndRun events differ)
  std::vector<absl::Time> run_step_ends_;  // the scheduled run's step end times, one per step
  NodeUsage usage_;
};

absl::StatusOr<kvrelay::v1::ReserveResponse> SimCluster::DecodeNode::Reserve(
    const kvrelay::v1::ReserveRequest& request, absl::Time deadline) {
  SimCluster& c = *cluster_;
  Scheduler& s = *c.scheduler_;
  RpcLeg rpc(&s, c.profile_.Rpc());
  const int32_t bt = c.layout_.block_tokens();
  // The worker's own admission rule (decode_worker.cc): sequences ahead against the wait.
  const int32_t ahead = static_cast<int32_t>(running_.size() + waiting_.size());
  const absl::Duration remaining = c.spec_.QueueBound(deadline - s.Now());
  absl::Status admitted = admission_.Check(ahead, remaining);
  if (!admitted.ok()) {
    ++usage_.refused;
    return admitted;
  }
  const int64_t blocks = (int64_t{request.prompt_tokens()} + request.max_tokens() + bt - 1) / bt;
  if (blocks > free_blocks_) {
    ++usage_.refused;
    return proto::Overloaded(
        absl::StrCat("decode worker ", node_id_, ": ", free_blocks_,
                     " KV blocks free, the request needs ", blocks),
        kvrelay::v1::ROLE_DECODE, node_id_, "kv_blocks",
        absl::ToInt64Milliseconds(admission_.NextDeparture(static_cast<int32_t>(running_.size()))));
  }
  const std::vector<kv::BlockHash> chain = UnpackChain(request.chain_packed());
  int32_t held = 0;
  if (!chain.empty()) {
    ++c.store_calls_;
    c.store_blocks_ += static_cast<int64_t>(chain.size());
    for (const cachestore::NodePrefix& n : c.store_->QueryPrefix(chain)) {
      if (n.node_id == node_id_) held = n.matched - n.disk_blocks;
    }
  }
  free_blocks_ -= blocks;
  reservations_[request.request_id()] = Reservation{.blocks = blocks, .held = std::max(0, held)};
  kvrelay::v1::ReserveResponse response;
  response.set_node_id(node_id_);
  response.set_incarnation(incarnation_);
  response.set_reservation_token(absl::StrCat("sim-", request.request_id()));
  response.set_full_blocks(request.prompt_tokens() > 0 ? (request.prompt_tokens() - 1) / bt : 0);
  response.set_block_tokens(bt);
  response.set_held_blocks(std::max(0, held));
  return response;
}

absl::Status SimCluster::DecodeNode::Generate(const kvrelay::v1::DecodeRequest& request,
                                              absl::Time /*deadline*/,
                                              absl::Duration /*chunk_timeout*/,
                                              const gateway::DecodeChunkSink& sink) {
  SimCluster& c = *cluster_;
  Scheduler& s = *c.scheduler_;
  auto it = reservations_.find(request.request_id());
  if (it == reservations_.end()) {
    return proto::Attribute(
        absl::FailedPreconditionError(absl::StrCat("no reservation for ", request.request_id())),
        kvrelay::v1::ROLE_DECODE, node_id_, kvrelay::v1::FAILURE_UNREACHABLE);
  }
  it->second.generating = true;
  const int64_t blocks = it->second.blocks;
  const size_t held = static_cast<size_t>(it->second.held);
  Sequence seq{
      .process = s.Current(), .context = request.tokens_size(), .max_tokens = request.max_tokens()};
  const absl::Time joined = s.Now();
  seq.joined = joined;
  waiting_.push_back(&seq);
  if (stepping_) {
    CutRunForNewcomer();
  } else {
    StartRun();
  }
  bool stopped = false;
  std::vector<int32_t> tokens(request.tokens().begin(), request.tokens().end());
  int32_t delivered = 0;
  while (delivered < seq.max_tokens && !stopped) {
    s.Park();  // until EndRun hands this sequence its first token, then its last
    kvrelay::v1::DecodeChunk chunk;
    for (; delivered < seq.generated; ++delivered) {
      const int32_t token = 1000 + static_cast<int32_t>(tokens.size());
      tokens.push_back(token);
      chunk.add_tokens(token);
    }
    if (delivered == seq.max_tokens) chunk.set_done(true);
    stopped = !sink(chunk);
  }
  // Leaves the batch (a sequence stopped early is still in it).
  std::erase(running_, &seq);
  admission_.ObserveResidency(s.Now() - joined);
  ++usage_.requests;
  // What the decode worker keeps: the whole sequence, committed on its own segment from the
  // blocks it did not hold already (DecodeWorker::CommitSequence).
  const int32_t bt = c.layout_.block_tokens();
  const size_t full = tokens.size() / static_cast<size_t>(bt) * static_cast<size_t>(bt);
  c.CommitOn(node_id_, incarnation_, link_,
             kv::HashChain(c.layout_.fingerprint(), request.tenant_salt(),
                           absl::MakeConstSpan(tokens.data(), full), bt),
             held);
  free_blocks_ += blocks;
  reservations_.erase(request.request_id());
  return absl::OkStatus();
}

void SimCluster::DecodeNode::StartRun() {
  if (stepping_) return;
  Scheduler& s = *cluster_->scheduler_;
  while (!waiting_.empty() && static_cast<int32_t>(running_.size()) < cluster_->spec_.max_batch) {
    usage_.queued += s.Now() - waiting_.front()->joined;
    running_.push_back(waiting_.front());
    waiting_.pop_front();
  }
  if (running_.empty()) return;
  // The run ends at the first step that wakes a sequence: a newcomer's first token, or some
  // sequence's last.
  int32_t steps = std::numeric_limits<int32_t>::max();
  int64_t context = 0;
  for (const Sequence* q : running_) {
    steps = std::min(steps, q->generated == 0 ? 1 : q->max_tokens - q->generated);
    context += q->context + q->generated;
  }
  const int64_t batch = static_cast<int64_t>(running_.size());
  run_step_ends_.clear();
  absl::Time at = s.Now();
  absl::Duration busy;
  for (int32_t k = 0; k < steps; ++k) {
    const absl::Duration step = cluster_->profile_.DecodeStep(batch, context);
    at += step;
    busy += step;
    run_step_ends_.push_back(at);
    context += batch;  // every sequence's next token joins its context
  }
  // Busy as a share of the batch: a step of one sequence uses 1/max_batch of the node.
  usage_.busy += busy * static_cast<double>(batch) / static_cast<double>(cluster_->spec_.max_batch);
  usage_.peak_batch = std::max<int64_t>(usage_.peak_batch, batch);
  stepping_ = true;
  const uint64_t run = ++run_;
  s.At(run_step_ends_.back(), [this, run] { EndRun(run); });
}

void SimCluster::DecodeNode::CutRunForNewcomer() {
  const int32_t steps = static_cast<int32_t>(run_step_ends_.size());
  if (static_cast<int32_t>(running_.size()) >= cluster_->spec_.max_batch || steps <= 1) {
    return;  // it waits for a slot (a run ends when one frees), or the run ends at the next step
  }
  Scheduler& s = *cluster_->scheduler_;
  // The step in progress finishes; the newcomer joins the next one.
  int32_t done = 0;
  while (done < steps && run_step_ends_[static_cast<size_t>(done)] <= s.Now()) ++done;
  const int32_t keep = std::min(steps, done + 1);
  if (keep == steps) return;
  // Give back the busy time of the steps that will not run.
  const int64_t batch = static_cast<int64_t>(running_.size());
  const absl::Duration dropped =
      run_step_ends_.back() - run_step_ends_[static_cast<size_t>(keep - 1)];
  usage_.busy -=
      dropped * static_cast<double>(batch) / static_cast<double>(cluster_->spec_.max_batch);
  run_step_ends_.resize(static_cast<size_t>(keep));
  const uint64_t run = ++run_;
  s.At(run_step_ends_.back(), [this, run] { EndRun(run); });
}

void SimCluster::DecodeNode::EndRun(uint64_t run) {
  if (run != run_) return;  // a run cut short: its later end is void
  stepping_ = false;
  Scheduler& s = *cluster_->scheduler_;
  std::vector<Sequence*> still;
  for (Sequence* q : running_) {
    const bool first = q->generated == 0;
    q->generated += static_cast<int32_t>(run_step_ends_.size());
    // Woken for its first token (TTFT) and its last (the rest arrive in that one chunk, at the
    // times the steps say): two hand-offs per sequence instead of one per token.
    if (first || q->generated == q->max_tokens) s.Wake(q->process);
    if (q->generated < q->max_tokens) still.push_back(q);
  }
  running_.swap(still);
  // The next run starts after the woken sequences took their tokens (same instant, later).
  s.At(s.Now(), [this] { StartRun(); });
}

// --- The cluster -----------------------------------------------------------------------------

SimCluster::SimCluster(const ClusterSpec& spec, const HardwareProfile& profile,
                       const kv::ModelLayout& layout, Scheduler* scheduler)
    : spec_(spec), profile_(profile), layout_(layout), scheduler_(scheduler) {}

SimCluster::~SimCluster() = default;

absl::StatusOr<std::unique_ptr<SimCluster>> SimCluster::Create(const ClusterSpec& spec,
                                                               const HardwareProfile& profile,
                                                               const kv::ModelLayout& layout,
                                                               Scheduler* scheduler) {
  if (spec.prefill_nodes < 1 || spec.decode_nodes < 1) {
    return absl::InvalidArgumentError("a cluster needs at least one prefill and one decode node");
  }
  if (spec.cache_blocks < 1 || spec.decode_kv_blocks < 1 || spec.max_batch < 1) {
    return absl::InvalidArgumentError("cache blocks, decode KV blocks and max batch must be >= 1");
  }
  std::unique_ptr<SimCluster> c(new SimCluster(spec, profile, layout, scheduler));
  KV_RETURN_IF_ERROR(c->Init());
  return c;
}

absl::Status SimCluster::Init() {
  for (size_t g = 0; g < layout_.groups().size(); ++g) {
    block_bytes_ += static_cast<uint64_t>(layout_.BlockBytes(static_cast<int>(g)));
  }
  bytes_per_token_ = block_bytes_ / static_cast<uint64_t>(layout_.block_tokens());
  cachestore::CacheStoreOptions options;
  options.policy = spec_.policy;
  options.clock = scheduler_->clock();
  options.block_tokens = layout_.block_tokens();
  KV_ASSIGN_OR_RETURN(store_, CacheStore::Create(options));

  gateway::WorkerSetOptions wo;
  wo.prefix_routing = spec_.prefix_routing;
  wo.block_tokens = layout_.block_tokens();
  wo.block_bytes = static_cast<int64_t>(block_bytes_);
  // What every worker would measure and report with its heartbeats (the simulated nodes send
  // no loads): the profile's disk read rate.
  wo.disk_read_bytes_per_second = profile_.disk_read_bytes_per_second;
  wo.metrics = &metrics_;
  wo.query_prefix = [this](const std::vector<kv::BlockHash>& chain) {
    ++store_calls_;
    store_blocks_ += static_cast<int64_t>(chain.size());
    kvrelay::v1::QueryPrefixResponse answer;
    for (const cachestore::NodePrefix& n : store_->QueryPrefix(chain)) {
      auto* node = answer.add_nodes();
      node->set_node_id(n.node_id);
      node->set_matched(n.matched);
      node->set_disk_blocks(n.disk_blocks);
    }
    return answer;
  };
  workers_ = std::make_unique<WorkerSet>(
      wo, spec_.gateway_clock != nullptr ? spec_.gateway_clock : scheduler_->clock(), nullptr,
      gateway::WorkerFactories{});
  auto register_node = [&](const std::string& id, uint64_t incarnation, cachestore::NodeRole role,
                           const std::string& address) -> absl::Status {
    cachestore::NodeSpec node;
    node.node_id = id;
    node.incarnation = incarnation;
    node.role = role;
    node.grpc_address = address;
    node.transport_kind = "sim";
    node.transport_address = address;
    node.segments.push_back(cachestore::SegmentSpec{.segment_id = id + "/dram",
                                                    .tier = cachestore::Tier::kHost,
                                                    .capacity_slots = spec_.cache_blocks,
                                                    .slot_bytes = block_bytes_});
    if (spec_.disk_blocks > 0) {
      // The worker's disk tier: the store never places there, the worker announces it.
      node.segments.push_back(cachestore::SegmentSpec{.segment_id = id + "/disk",
                                                      .tier = cachestore::Tier::kSsd,
                                                      .capacity_slots = spec_.disk_blocks,
                                                      .slot_bytes = block_bytes_});
    }
    tiers_.push_back(std::make_unique<NodeTiers>(spec_.cache_blocks, spec_.disk_blocks));
    return store_->RegisterNode(node).status();
  };
  int link = 0;
  for (int i = 0; i < spec_.prefill_nodes; ++i) {
    auto node = std::make_unique<PrefillNode>(this, i, link++);
    prefills_.push_back(node.get());
    KV_RETURN_IF_ERROR(register_node(node->node_id(), node->incarnation(),
                                     cachestore::NodeRole::kPrefill, node->address()));
    workers_->AddFixed(std::unique_ptr<gateway::PrefillEndpoint>(std::move(node)));
  }
  for (int i = 0; i < spec_.decode_nodes; ++i) {
    auto node = std::make_unique<DecodeNode>(this, i, link++);
    decodes_.push_back(node.get());
    KV_RETURN_IF_ERROR(register_node(node->node_id(), node->incarnation(),
                                     cachestore::NodeRole::kDecode, node->address()));
    workers_->AddFixed(std::unique_ptr<gateway::DecodeEndpoint>(std::move(node)));
  }
  for (int i = 0; i < link; ++i) links_.push_back(std::make_unique<SimMutex>(scheduler_));
  link_busy_.assign(static_cast<size_t>(link), absl::ZeroDuration());
  // Node ids as a worker's Status would tell the gateway.
  const WorkerSet::Snapshot nodes = workers_->Nodes();
  for (const auto& n : nodes.prefill) {
    for (PrefillNode* p : prefills_) {
      if (p->address() == n->address()) n->SetNodeId(p->node_id());
    }
  }
  for (const auto& n : nodes.decode) {
    for (DecodeNode* d : decodes_) {
      if (d->address() == n->address()) n->SetNodeId(d->node_id());
    }
  }
  return absl::OkStatus();
}

int SimCluster::LinkOf(const std::string& node_id) const {
  for (size_t i = 0; i < prefills_.size(); ++i) {
    if (prefills_[i]->node_id() == node_id) return static_cast<int>(i);
  }
  for (size_t j = 0; j < decodes_.size(); ++j) {
    if (decodes_[j]->node_id() == node_id) return static_cast<int>(prefills_.size() + j);
  }
  return -1;
}

void SimCluster::Transfer(int link_a, int link_b, uint64_t bytes) {
  if (bytes == 0) return;
  SimMutex& first = *links_[static_cast<size_t>(std::min(link_a, link_b))];
  SimMutex& second = *links_[static_cast<size_t>(std::max(link_a, link_b))];
  first.Lock();
  if (link_a != link_b) second.Lock();
  const absl::Duration t = profile_.Transfer(bytes);
  scheduler_->SleepUntil(scheduler_->Now() + t);
  link_busy_[static_cast<size_t>(link_a)] += t;
  if (link_a != link_b) link_busy_[static_cast<size_t>(link_b)] += t;
  if (link_a != link_b) second.Unlock();
  first.Unlock();
}

void SimCluster::CommitOn(const std::string& node_id, uint64_t incarnation, int link,
                          const std::vector<kv::BlockHash>& chain, size_t first, size_t last) {
  if (last == 0 || last > chain.size()) last = chain.size();
  if (first >= last) return;
  cachestore::AllocateArgs args;
  args.caller = cachestore::Caller{node_id, incarnation};
  args.preferred_tier = cachestore::Tier::kHost;
  args.replicas = 1;
  args.add_local_replicas = true;
  for (size_t i = first; i < last; ++i) {
    args.blocks.push_back({.hash = chain[i],
                           .parent = i > 0 ? chain[i - 1] : kv::BlockHash(),
                           .size_bytes = block_bytes_});
  }
  ++store_calls_;
  store_blocks_ += static_cast<int64_t>(args.blocks.size());
  absl::StatusOr<cachestore::AllocateResult> allocated =
      store_->Allocate(args, scheduler_->Now() + absl::Seconds(1));
  if (!allocated.ok()) return;
  std::vector<kv::BlockHash> hashes;
  for (const auto& b : allocated->blocks) hashes.push_back(b.hash);
  // The blocks these slots held leave DRAM: to the node's disk tier, announced in one batch
  // (the worker's StoreLink sends its disk changes every ~100 ms).
  NodeTiers& tiers = TiersOf(link);
  std::vector<cachestore::AnnouncedBlock> demoted;
  for (const auto& b : allocated->blocks) {
    if (b.already_committed || !tiers.has_disk()) continue;
    for (const cachestore::Location& at : b.replicas) {
      if (at.node_id != node_id || at.tier == cachestore::Tier::kSsd) continue;
      const kv::BlockHash left = tiers.Place(at.slot, b.hash);
      const int64_t disk_slot = tiers.Demote(left);
      if (disk_slot >= 0) {
        demoted.push_back(
            {.hash = left, .slot = static_cast<uint32_t>(disk_slot), .size_bytes = block_bytes_});
      }
    }
  }
  ++store_calls_;
  store_blocks_ += static_cast<int64_t>(hashes.size());
  (void)store_->Commit(allocated->allocation_id, hashes, args.caller);
  if (!demoted.empty()) {
    ++store_calls_;
    store_blocks_ += static_cast<int64_t>(demoted.size());
    (void)store_->AnnounceBlocks(args.caller, node_id + "/disk", demoted);
  }
}

kvrelay::v1::PromoteResponse SimCluster::PromoteOn(const std::string& node_id, uint64_t incarnation,
                                                   int link,
                                                   const kvrelay::v1::PromoteRequest& request,
                                                   absl::Time deadline) {
  RpcLeg rpc(scheduler_, profile_.Rpc());
  kvrelay::v1::PromoteResponse response;
  if (link < 0 || !TiersOf(link).has_disk()) return response;
  const std::vector<kv::BlockHash> chain = UnpackChain(request.chain_packed());
  // Each run the disk holds is read and committed to DRAM (blocks in DRAM or nowhere here are
  // stepped over), as WorkerCore::Promote does.
  // Reads of at most ~64 MiB; one that cannot finish by the deadline is given up (the worker's
  // DiskCache::Read returns nothing then).
  const int64_t per_read =
      std::max<int64_t>(1, (int64_t{64} << 20) / static_cast<int64_t>(block_bytes_));
  for (int64_t i = std::max(0, request.first()); i < static_cast<int64_t>(chain.size());) {
    const int64_t run = std::min(TiersOf(link).HeldRun(chain, i), per_read);
    if (run == 0) {
      ++i;
      continue;
    }
    const absl::Time read_end =
        scheduler_->Now() + profile_.DiskRead(static_cast<uint64_t>(run) * block_bytes_);
    if (read_end > deadline) {
      scheduler_->SleepUntil(std::max(scheduler_->Now(), deadline));
      break;
    }
    scheduler_->SleepUntil(read_end);
    CommitOn(node_id, incarnation, link, chain, static_cast<size_t>(i),
             static_cast<size_t>(i + run));
    response.set_promoted(response.promoted() + static_cast<int32_t>(run));
    promoted_blocks_ += run;
    i += run;
  }
  return response;
}

void SimCluster::StartHousekeeping(std::function<bool()> active) {
  scheduler_->At(scheduler_->Now() + absl::Seconds(1),
                 [this, active = std::move(active)] { Housekeeping(active); });
}

void SimCluster::Housekeeping(std::function<bool()> active) {
  for (PrefillNode* p : prefills_) (void)store_->Heartbeat(p->node_id(), p->incarnation());
  for (DecodeNode* d : decodes_) (void)store_->Heartbeat(d->node_id(), d->incarnation());
  store_->Tick();
  if (active()) StartHousekeeping(std::move(active));
}

std::vector<NodeUsage> SimCluster::Usage() const {
  std::vector<NodeUsage> out;
  for (size_t i = 0; i < prefills_.size(); ++i) {
    out.push_back(prefills_[i]->usage());
    out.back().link_busy = link_busy_[i];
  }
  for (size_t j = 0; j < decodes_.size(); ++j) {
    out.push_back(decodes_[j]->usage());
    out.back().link_busy = link_busy_[prefills_.size() + j];
  }
  return out;
}

}  // namespace kvrelay::sim
