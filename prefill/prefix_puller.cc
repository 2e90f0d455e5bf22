#include "prefill/prefix_puller.h"

#include <algorithm>

#include "common/logging.h"
#include "common/status_macros.h"
#include "proto/limits.h"

namespace kvrelay::prefill {

absl::StatusOr<std::unique_ptr<PrefixPuller>> PrefixPuller::Create(PrefixPullerOptions options,
                                                                   Deps deps) {
  auto puller = std::unique_ptr<PrefixPuller>(new PrefixPuller(options, std::move(deps)));
  absl::MutexLock lock(&puller->fetch_mu_);
  KV_ASSIGN_OR_RETURN(puller->scratch_, puller->deps_.transport->AllocateMemory(
                                            static_cast<size_t>(limits::kMaxChainBlocks) *
                                            worker::CacheSegment::kSlotEntryBytes));
  return puller;
}

PrefixPuller::PrefixPuller(PrefixPullerOptions options, Deps deps)
    : options_(options),
      deps_(std::move(deps)),
      fetched_bytes_(deps_.metrics->GetCounter("kvrelay:prefill_fetched_kv_bytes_total",
                                               "KV bytes pulled from other nodes' caches.",
                                               deps_.labels)),
      fetched_tokens_(deps_.metrics->GetCounter(
          "kvrelay:prefill_fetched_tokens_total",
          "Prompt tokens whose KV was pulled from another node.", deps_.labels)),
      quarantine_(std::make_unique<worker::FetchQuarantine>(&deps_.kv->cache())) {}

PulledPrefix PrefixPuller::Pull(const worker::PrefixMatch& match,
                                const std::vector<kv::BlockHash>& chain, int64_t first,
                                int64_t wanted_end, const std::string& request_id,
                                absl::Time deadline, std::vector<std::vector<kv::SlotId>>& slots) {
  PulledPrefix out;
  const int64_t end = std::min<int64_t>(match.matched, wanted_end);
  if (!options_.enabled || first >= end || first >= static_cast<int64_t>(match.remote.size()) ||
      match.remote[first].empty()) {
    return out;
  }
  HolderRun run = FindHolderRun(match, first, end);
  kv::RateMeter& link = LinkMeter(run.holder->transport_address);
  // Read before the decision is counted, as the link's age is when it is judged.
  const bool reprobe = absl::Now() - link.last_observed() > options_.reprobe_interval;
  kv::PullOrRecompute decision = Decide(run, link);
  if (decision.choice == kv::ReuseChoice::kRecompute) {
    if (!reprobe) {
      out.decision = decision;
      return out;
    }
    // A re-probe reads a quarter of the run: enough to measure the link past a burst allowance,
    // without betting the whole request on it.
    run.slots.resize(std::max<size_t>(1, run.slots.size() / 4));
  }
  out = Fetch(run, chain, first, request_id, deadline, link, slots);
  out.decision = decision;
  return out;
}

PrefixPuller::HolderRun PrefixPuller::FindHolderRun(const worker::PrefixMatch& match, int64_t first,
                                                    int64_t end) {
  // One holder: the first readable replica of the first missing block, for as long a run of
  // blocks as it holds.
  HolderRun run;
  run.holder = &match.remote[first][0];
  for (int64_t b = first; b < end && b < static_cast<int64_t>(match.remote.size()); ++b) {
    auto it = std::find_if(match.remote[b].begin(), match.remote[b].end(),
                           [&](const worker::RemoteReplica& r) {
                             return r.node_id == run.holder->node_id &&
                                    r.transport_address == run.holder->transport_address;
                           });
    if (it == match.remote[b].end()) break;
    run.slots.push_back(it->slot);
  }
  return run;
}

kv::PullOrRecompute PrefixPuller::Decide(const HolderRun& run, const kv::RateMeter& link) {
  const int64_t blocks = static_cast<int64_t>(run.slots.size());
  const double compute_rate = deps_.compute_rate->rate();
  // The link's rate is measured over whole pulls, so it already includes their latency.
  kv::PullOrRecompute decision = kv::ChoosePullOrRecompute(
      {.bytes = deps_.segment->block_bytes() * static_cast<uint64_t>(blocks),
       .tokens = blocks * deps_.kv->cache().layout().block_tokens(),
       .link_bytes_per_second = link.rate(),
       .prefill_tokens_per_second = compute_rate});
  // The cost model's inputs, as it saw them.
  deps_.metrics
      ->GetGauge("kvrelay:prefill_link_bytes_per_second",
                 "Measured pull rate from each holder (0 until measured).",
                 WithLabel("holder", run.holder->node_id))
      ->Set(link.rate());
  deps_.metrics
      ->GetGauge("kvrelay:prefill_compute_tokens_per_second",
                 "Measured prompt tokens per second of compute on this node.", deps_.labels)
      ->Set(compute_rate);
  deps_.metrics
      ->GetCounter("kvrelay:prefill_reuse_decisions_total",
                   "Prefixes held on another node, by what the cost model chose.",
                   WithLabel("choice", kv::ReuseChoiceName(decision.choice)))
      ->Increment();
  return decision;
}

PulledPrefix PrefixPuller::Fetch(const HolderRun& run, const std::vector<kv::BlockHash>& chain,
                                 int64_t first, const std::string& request_id, absl::Time deadline,
                                 kv::RateMeter& link, std::vector<std::vector<kv::SlotId>>& slots) {
  PulledPrefix out;
  out.attempted = true;
  const worker::RemoteReplica& holder = *run.holder;
  const absl::Time fetch_deadline = std::min(deadline, absl::Now() + options_.fetch_timeout);
  absl::StatusOr<transfer::PeerId> peer =
      deps_.peers->Get(holder.transport_address, holder.data_plane_key, fetch_deadline);
  if (!peer.ok()) {
    KV_LOG(WARNING) << request_id << ": cannot reach holder " << holder.node_id << " at "
                    << holder.transport_address << " (" << peer.status() << "); recomputing";
    CountFailure("unreachable");
    return out;
  }
  absl::StatusOr<transfer::PeerStatus> peer_status = deps_.transport->GetPeerStatus(*peer);
  if (!peer_status.ok() || peer_status->incarnation != holder.transport_incarnation) {
    // Another process answers at the holder's address: its memory is not the holder's.
    KV_LOG(WARNING) << request_id << ": the process at " << holder.transport_address
                    << " is not the incarnation the store named for " << holder.node_id;
    CountFailure("identity");
    return out;
  }
  const kv::ModelLayout& layout = deps_.kv->cache().layout();
  absl::MutexLock lock(&fetch_mu_);
  worker::FetchedPrefix fetched = worker::FetchBlocks(
      *deps_.transport, *peer, holder, run.slots,
      absl::MakeConstSpan(chain).subspan(static_cast<size_t>(first), run.slots.size()), layout,
      *deps_.kv, scratch_, *quarantine_, worker::RequestTag(request_id), fetch_deadline, slots);
  if (fetched.wire_bytes > 0 && fetched.status.ok()) {
    link.Observe(static_cast<double>(fetched.wire_bytes), absl::ToDoubleSeconds(fetched.elapsed),
                 absl::Now());
  } else if (!fetched.status.ok()) {
    // A pull that failed or ran out of time says the link is at most this fast.
    link.ObserveCeiling(static_cast<double>(deps_.segment->block_bytes() * run.slots.size()),
                        std::max(1e-3, absl::ToDoubleSeconds(fetched.elapsed)), absl::Now());
    KV_LOG(WARNING) << request_id << ": pulled " << fetched.intact << " of " << run.slots.size()
                    << " blocks from " << holder.node_id << " (" << fetched.status
                    << "); recomputing the rest";
    CountFailure(absl::IsDataLoss(fetched.status)           ? "corrupt"
                 : absl::IsNotFound(fetched.status)         ? "moved"
                 : absl::IsDeadlineExceeded(fetched.status) ? "timeout"
                                                            : "transfer");
  }
  out.blocks = fetched.intact;
  out.bytes = fetched.kv_bytes;
  fetched_bytes_->Increment(static_cast<double>(fetched.kv_bytes));
  fetched_tokens_->Increment(static_cast<double>(fetched.intact * layout.block_tokens()));
  return out;
}

kv::RateMeter& PrefixPuller::LinkMeter(const std::string& address) {
  absl::MutexLock lock(&meters_mu_);
  std::unique_ptr<kv::RateMeter>& meter = link_meters_[address];
  if (meter == nullptr) meter = std::make_unique<kv::RateMeter>();
  return *meter;
}

std::vector<std::pair<std::string, double>> PrefixPuller::LinkRates() const {
  std::vector<std::pair<std::string, double>> rates;
  absl::MutexLock lock(&meters_mu_);
  for (const auto& [address, meter] : link_meters_) {
    if (const double rate = meter->rate(); rate > 0) rates.emplace_back(address, rate);
  }
  std::sort(rates.begin(), rates.end());
  return rates;
}

void PrefixPuller::CountFailure(const std::string& reason) {
  deps_.metrics
      ->GetCounter("kvrelay:prefill_fetch_failures_total",
                   "Pulls from other nodes that did not deliver every block, by reason.",
                   WithLabel("reason", reason))
      ->Increment();
}

MetricLabels PrefixPuller::WithLabel(const std::string& name, const std::string& value) const {
  MetricLabels labels = deps_.labels;
  labels[name] = value;
  return labels;
}

}  // namespace kvrelay::prefill
