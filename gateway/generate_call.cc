#include "gateway/generate_call.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway {
namespace {

// A push smaller than this tells too little about the link (compute and set-up dominate).
constexpr int64_t kMeasurablePushBytes = 64 << 10;

// A decode worker that said "full" (no ErrorInfo, or FAILURE_OVERLOADED): not a failure.
bool IsOverload(const absl::Status& s) {
  if (!absl::IsResourceExhausted(s)) return false;
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  return !info.has_value() || info->reason() == kvrelay::v1::FAILURE_OVERLOADED;
}

// A worker that refused because it drains (SIGTERM): not a failure, go elsewhere.
bool IsDraining(const absl::Status& s) {
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  return info.has_value() && info->reason() == kvrelay::v1::FAILURE_DRAINING;
}

// Which role a refusal names: the decode node when its ErrorInfo says so (a prefill node
// reports its push target's refusals), else the node that was called.
bool NamesDecode(const absl::Status& s) {
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  return info.has_value() && info->role() == kvrelay::v1::ROLE_DECODE;
}

// `other_layout`: workers left out because they serve another layout than this gateway's.
absl::Status NoWorker(const std::string& role, size_t known, size_t failed, size_t other_layout) {
  return proto::Attribute(
      absl::UnavailableError(absl::StrCat(
          "no healthy ", role, " worker (", known, " known, ", failed, " failed for this request",
          other_layout == 0
              ? ""
              : absl::StrCat(", ", other_layout, " serving another KV layout, never paired"),
          ")")),
      kvrelay::v1::ROLE_GATEWAY, "", kvrelay::v1::FAILURE_UNREACHABLE);
}

std::string PackChain(const std::vector<kv::BlockHash>& chain) {
  std::string packed;
  packed.reserve(chain.size() * 16);
  for (const kv::BlockHash& h : chain) {
    const auto bytes = h.ToBytes();
    packed.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  return packed;
}

}  // namespace

GenerateCall::GenerateCall(const GenerateCallOptions& options, const GenerateCallDeps& deps,
                           GenerateCallRequest request, const GenerateSink& sink,
                           const std::function<bool()>& cancelled)
    : options_(options),
      deps_(deps),
      call_(std::move(request)),
      request_(*call_.request),
      sink_(sink),
      cancelled_(cancelled),
      layout_fingerprint_(deps_.layout->fingerprint().ToBytes()),
      prompt_(request_.tokens().begin(), request_.tokens().end()),
      eos_(request_.has_eos_token() ? request_.eos_token() : -1),
      last_error_(proto::Attribute(absl::UnavailableError("no usable worker pair"),
                                   kvrelay::v1::ROLE_GATEWAY, "",
                                   kvrelay::v1::FAILURE_UNREACHABLE)) {
  summary_.set_prompt_tokens(static_cast<int32_t>(prompt_.size()));
}

absl::Status GenerateCall::Run() {
  while (!done_ && failures_ < options_.max_attempts && deps_.clock->Now() < call_.deadline) {
    if (Cancelled()) {
      client_gone_ = true;
      break;
    }
    KV_ASSIGN_OR_RETURN(const bool again, Attempt());
    if (!again) break;
  }
  return Finish();
}

absl::StatusOr<bool> GenerateCall::Attempt() {
  WorkerSet::Snapshot nodes = deps_.workers->Nodes();
  keep_alive_.insert(keep_alive_.end(), nodes.prefill.begin(), nodes.prefill.end());
  keep_alive_.insert(keep_alive_.end(), nodes.decode.begin(), nodes.decode.end());
  // Workers of another layout (model, KV dtype, block size) are never paired with this one.
  const size_t all_decode = nodes.decode.size(), all_prefill = nodes.prefill.size();
  nodes.decode = deps_.workers->SameLayout(nodes.decode, call_.deadline);
  nodes.prefill = deps_.workers->SameLayout(nodes.prefill, call_.deadline);
  Pair pair;
  Plan plan;
  // When no decode node could take it, the plan (the store's QueryPrefix) is not made: a
  // refusal costs nothing.
  if (WorkerSet::AnyPickable(nodes.decode, Excluded(Blame::kDecode))) {
    plan = MakePlan();
    pair.decode = deps_.workers->PickDecode(nodes.decode, plan.held, plan.full_blocks,
                                            Excluded(Blame::kDecode), nullptr, &plan.disk);
  }
  // Nothing picked: overload when a usable node is busy (refused for capacity, here or for
  // another request a moment ago), else no healthy node is left.
  if (pair.decode == nullptr) {
    std::optional<absl::Duration> wait = WorkerSet::BusyWait(nodes.decode, failed_decode_);
    if (!busy_decode_.empty()) wait = std::min(wait.value_or(predicted_wait_), predicted_wait_);
    last_error_ = wait.has_value() ? AtCapacity(Blame::kDecode, *wait)
                                   : NoWorker("decode", nodes.decode.size(), failed_decode_.size(),
                                              all_decode - nodes.decode.size());
    return false;
  }
  pair.prefill = deps_.workers->PickPrefill(nodes.prefill, plan.held, plan.full_blocks,
                                            Excluded(Blame::kPrefill), call_.deadline, &pair.routed,
                                            &plan.disk);
  if (pair.prefill != nullptr && !plan.store_unreachable) {
    pair.promotions = deps_.workers->Promotions(nodes, plan.held, plan.disk, pair.prefill,
                                                pair.decode, plan.full_blocks);
  }
  if (pair.prefill == nullptr) {
    std::optional<absl::Duration> wait = WorkerSet::BusyWait(nodes.prefill, failed_prefill_);
    if (!busy_prefill_.empty()) wait = std::min(wait.value_or(predicted_wait_), predicted_wait_);
    last_error_ = wait.has_value()
                      ? AtCapacity(Blame::kPrefill, *wait)
                      : NoWorker("prefill", nodes.prefill.size(), failed_prefill_.size(),
                                 all_prefill - nodes.prefill.size());
    return false;
  }
  return RunPair(plan, pair);
}

GenerateCall::Plan GenerateCall::MakePlan() const {
  Plan plan = PlanTokens();
  WorkerSet::PrefixHoldings holdings = deps_.workers->Holdings(plan.chain, call_.deadline);
  plan.held = std::move(holdings.held);
  plan.disk = std::move(holdings.disk);
  plan.store_unreachable = holdings.store_unreachable;
  return plan;
}

GenerateCall::Plan GenerateCall::PlanTokens() const {
  Plan plan;
  plan.tokens = prompt_;
  plan.tokens.insert(plan.tokens.end(), generated_.begin(), generated_.end());
  plan.remaining = request_.max_tokens() - static_cast<int32_t>(generated_.size());
  // Who holds the prompt's leading blocks (prefill and decode nodes alike).
  const int32_t block_tokens = deps_.layout->block_tokens();
  plan.full_blocks = (static_cast<int64_t>(plan.tokens.size()) - 1) / block_tokens;
  if (plan.full_blocks > 0) {
    plan.chain = kv::HashChain(
        deps_.layout->fingerprint(), call_.tenant_salt,
        absl::MakeConstSpan(plan.tokens).subspan(0, plan.full_blocks * block_tokens), block_tokens);
  }
  return plan;
}

absl::StatusOr<bool> GenerateCall::RunPair(const Plan& plan, const Pair& pair) {
  ++attempts_;
  if (attempts_ > 1) deps_.metrics->failovers->Increment();
  attempt_start_ = deps_.clock->Now();
  attempt_streamed_ = false;
  const std::string request_id = absl::StrCat(call_.request_id_prefix, "-", attempts_);
  // The pickers rank by load: this attempt counts on both nodes until it ends.
  struct InFlight {
    Node* p;
    Node* d;
    ~InFlight() {
      p->in_flight.fetch_sub(1, std::memory_order_relaxed);
      d->in_flight.fetch_sub(1, std::memory_order_relaxed);
    }
  } in_flight{pair.prefill, pair.decode};
  pair.prefill->in_flight.fetch_add(1, std::memory_order_relaxed);
  pair.decode->in_flight.fetch_add(1, std::memory_order_relaxed);
  // Whether this attempt's push may be the first measure of the decode node's link (see
  // Node::LinkBeingMeasured): counted until its Prefill ends.
  struct MeasuringPush {
    Node* d = nullptr;
    void End() {
      if (d != nullptr) d->measuring_pushes.fetch_sub(1, std::memory_order_relaxed);
      d = nullptr;
    }
    ~MeasuringPush() { End(); }
  } measuring;
  const int64_t block_bytes =
      deps_.layout->BytesPerToken() * static_cast<int64_t>(deps_.layout->block_tokens());
  if (plan.full_blocks * block_bytes >= kMeasurablePushBytes &&
      !pair.decode->transfer_seconds_per_mib.Last().has_value()) {
    measuring.d = pair.decode;
    pair.decode->measuring_pushes.fetch_add(1, std::memory_order_relaxed);
  }

  // What Reserve books (prompt + remaining tokens) counts against the tenant's and the
  // client's reserved-KV quotas until the decode worker streams (or the attempt ends).
  const int64_t reserved_tokens = static_cast<int64_t>(plan.tokens.size()) + plan.remaining;
  KV_ASSIGN_OR_RETURN(QuotaTable::Lease tenant_lease,
                      deps_.tenant_reservations->Take(request_.tenant(), reserved_tokens));
  KV_ASSIGN_OR_RETURN(QuotaTable::Lease client_lease,
                      deps_.client_reservations->Take(call_.client, reserved_tokens));
  attempt_promoted_elsewhere_ = Promote(plan, pair, request_id);
  absl::StatusOr<kvrelay::v1::ReserveResponse> target = Reserve(plan, pair.decode, request_id);
  attempt_reserve_ = deps_.clock->Now() - attempt_start_;
  if (!target.ok()) {
    last_error_ = target.status();
    if (IsOverload(target.status())) return Busy(target.status(), pair.decode, Blame::kDecode);
    if (IsDraining(target.status())) return Drained(pair.decode, Blame::kDecode);
    return Failed(target.status(), Blame::kDecode, pair, nullptr);
  }
  pair.decode->SetNodeId(target->node_id());

  const absl::Time prefill_start = deps_.clock->Now();
  absl::StatusOr<kvrelay::v1::PrefillResponse> prefilled =
      Prefill(plan, pair.prefill, *target, request_id);
  if (prefilled.ok()) ObservePush(pair.decode, *prefilled, prefill_start);
  measuring.End();
  if (!prefilled.ok()) {
    pair.decode->decode->Release(request_id, target->reservation_token(),
                                 deps_.clock->Now() + absl::Seconds(1));
    last_error_ = prefilled.status();
    if (IsOverload(prefilled.status())) {
      // Full is whoever the refusal names: the prefill node (its queue), or the decode node
      // it pushes to.
      const bool decode_full = NamesDecode(prefilled.status());
      return Busy(prefilled.status(), decode_full ? pair.decode : pair.prefill,
                  decode_full ? Blame::kDecode : Blame::kPrefill);
    }
    if (IsDraining(prefilled.status())) {
      return NamesDecode(prefilled.status()) ? Drained(pair.decode, Blame::kDecode)
                                             : Drained(pair.prefill, Blame::kPrefill);
    }
    return Failed(prefilled.status(), Blame::kPrefill, pair, nullptr);
  }
  pair.prefill->breaker.RecordSuccess();
  RecordPrefill(pair, *prefilled, *target);

  bool stream_done = false;
  absl::Status s = Stream(plan, pair.decode, *prefilled, *target, request_id, &tenant_lease,
                          &client_lease, &stream_done);
  return AfterStream(std::move(s), stream_done, pair, request_id);
}

void GenerateCall::ObservePush(Node* decode, const kvrelay::v1::PrefillResponse& prefilled,
                               absl::Time prefill_start) const {
  // Too little to tell the link from compute.
  if (prefilled.pushed_bytes() < kMeasurablePushBytes) return;
  const double mib = static_cast<double>(prefilled.pushed_bytes()) / (1 << 20);
  decode->transfer_seconds_per_mib.Observe(
      absl::ToDoubleSeconds(deps_.clock->Now() - prefill_start) / mib, deps_.clock->Now());
}

absl::Status GenerateCall::Canary(Node* prefill, Node* decode) {
  Plan plan = PlanTokens();
  plan.canary = true;
  ++attempts_;
  const std::string request_id = absl::StrCat(call_.request_id_prefix, "-", attempts_);
  KV_ASSIGN_OR_RETURN(const kvrelay::v1::ReserveResponse target, Reserve(plan, decode, request_id));
  const absl::Time prefill_start = deps_.clock->Now();
  absl::StatusOr<kvrelay::v1::PrefillResponse> prefilled =
      Prefill(plan, prefill, target, request_id);
  if (prefilled.ok()) ObservePush(decode, *prefilled, prefill_start);
  decode->decode->Release(request_id, target.reservation_token(),
                          std::min(call_.deadline, deps_.clock->Now() + absl::Seconds(1)));
  return prefilled.status();
}

bool GenerateCall::Promote(const Plan& plan, const Pair& pair, const std::string& request_id) {
  bool elsewhere = false;
  for (const WorkerSet::Promotion& promotion : pair.promotions) {
    kvrelay::v1::PromoteRequest request;
    request.set_request_id(request_id);
    request.set_layout_fingerprint(layout_fingerprint_);
    *request.mutable_chain_packed() = PackChain(plan.chain);
    request.set_first(static_cast<int32_t>(promotion.first));
    const absl::Time deadline =
        std::min(call_.deadline, deps_.clock->Now() + options_.promote_timeout);
    Node* node = promotion.node;
    absl::StatusOr<kvrelay::v1::PromoteResponse> promoted =
        node->prefill != nullptr ? node->prefill->Promote(request, deadline)
                                 : node->decode->Promote(request, deadline);
    if (!promoted.ok()) {
      deps_.metrics->promotions_failed->Increment();
      deps_.workers->PromoteFailed(node);
      KV_LOG(WARNING) << "request " << request_id << ": promote at " << node->address()
                      << " failed (its disk-held blocks are recomputed): " << promoted.status();
      continue;
    }
    deps_.metrics->promotions_ok->Increment();
    deps_.metrics->promoted_blocks->Increment(static_cast<double>(promoted->promoted()));
    if (promoted->promoted() > 0 && node != pair.prefill) elsewhere = true;
  }
  return elsewhere;
}

absl::StatusOr<kvrelay::v1::ReserveResponse> GenerateCall::Reserve(const Plan& plan, Node* decode,
                                                                   const std::string& request_id) {
  kvrelay::v1::ReserveRequest reserve;
  reserve.set_request_id(request_id);
  reserve.set_model(options_.model_name);
  reserve.set_prompt_tokens(static_cast<int32_t>(plan.tokens.size()));
  reserve.set_max_tokens(plan.remaining);
  reserve.set_layout_fingerprint(layout_fingerprint_);
  reserve.set_layout_description(deps_.layout->Describe());
  *reserve.mutable_chain_packed() = PackChain(plan.chain);
  // The reservation lapses with the request: slots are not held for a request that gave up.
  if (call_.deadline != absl::InfiniteFuture()) {
    reserve.set_request_budget_ms(std::clamp<int64_t>(
        absl::ToInt64Milliseconds(call_.deadline - deps_.clock->Now()) + 1, 1, 3600 * 1000));
  }
  const absl::Time start = deps_.clock->Now();
  absl::StatusOr<kvrelay::v1::ReserveResponse> reserved = decode->decode->Reserve(
      reserve, std::min(call_.deadline, start + deps_.workers->ReserveTimeout()));
  // Any answer is a round trip (a refusal too); a timeout or a lost connection is not.
  if (reserved.ok() || proto::GetErrorInfo(reserved.status()).has_value()) {
    deps_.workers->ObserveReserve(deps_.clock->Now() - start);
  }
  return reserved;
}

absl::StatusOr<kvrelay::v1::PrefillResponse> GenerateCall::Prefill(
    const Plan& plan, Node* prefill, const kvrelay::v1::ReserveResponse& target,
    const std::string& request_id) {
  kvrelay::v1::PrefillRequest request;
  request.set_request_id(request_id);
  request.set_model(options_.model_name);
  *request.mutable_tokens() = {plan.tokens.begin(), plan.tokens.end()};
  request.set_tenant_salt(call_.tenant_salt);
  request.set_layout_fingerprint(layout_fingerprint_);
  request.set_layout_description(deps_.layout->Describe());
  *request.mutable_target() = target;
  request.set_skip_store_lookup(plan.store_unreachable || plan.canary);
  const absl::Time start = deps_.clock->Now();
  absl::StatusOr<kvrelay::v1::PrefillResponse> prefilled = prefill->prefill->Prefill(
      request, std::min(call_.deadline, deps_.clock->Now() + options_.prefill_timeout));
  if (prefilled.ok()) {
    // The cost model's inputs for routing (see WorkerSet::PickPrefill).
    const double seconds = absl::ToDoubleSeconds(deps_.clock->Now() - start);
    prefill->prefill_calls.Observe(1, seconds, deps_.clock->Now());
    if (prefilled->computed_tokens() > 0) {
      prefill->prefill_tokens.Observe(prefilled->computed_tokens(), seconds, deps_.clock->Now());
    }
  }
  std::optional<kvrelay::v1::ErrorInfo> error =
      prefilled.ok() ? std::nullopt : proto::GetErrorInfo(prefilled.status());
  if (error.has_value() && error->reason() == kvrelay::v1::FAILURE_CORRUPT) {
    // The decode worker refused corrupted KV (checksums); it computes the prompt itself.
    KV_LOG(WARNING) << "request " << request_id << ": pushed KV was corrupted ("
                    << prefilled.status() << "); the decode worker recomputes it";
    deps_.metrics->CountWorkerFailure(prefilled.status(), "decode");
    prefilled = kvrelay::v1::PrefillResponse();
  }
  return prefilled;
}

void GenerateCall::RecordPrefill(const Pair& pair, const kvrelay::v1::PrefillResponse& prefilled,
                                 const kvrelay::v1::ReserveResponse& target) {
  // The first attempt that prefilled says what was reused; bytes add up over attempts.
  if (summary_.prefill_worker().empty()) {
    summary_.set_prefix_hit_tokens(prefilled.prefix_hit_tokens());
  }
  summary_.set_transferred_bytes(summary_.transferred_bytes() + prefilled.pushed_bytes());
  summary_.set_fetched_bytes(summary_.fetched_bytes() + prefilled.fetched_bytes());
  summary_.set_prefill_worker(pair.prefill->address());
  summary_.set_decode_worker(pair.decode->address());
  summary_.set_prefix_source(pair.routed && prefilled.prefix_source() == "local" ? "routed"
                             : attempt_promoted_elsewhere_ && prefilled.prefix_source() == "pulled"
                                 ? "remote_disk"
                                 : prefilled.prefix_source());
  summary_.set_decode_held_blocks(target.held_blocks());
}

absl::Status GenerateCall::Stream(const Plan& plan, Node* decode,
                                  const kvrelay::v1::PrefillResponse& prefilled,
                                  const kvrelay::v1::ReserveResponse& target,
                                  const std::string& request_id, QuotaTable::Lease* tenant_lease,
                                  QuotaTable::Lease* client_lease, bool* stream_done) {
  kvrelay::v1::DecodeRequest request;
  request.set_request_id(request_id);
  *request.mutable_tokens() = {plan.tokens.begin(), plan.tokens.end()};
  request.set_max_tokens(plan.remaining);
  *request.mutable_sampling() = request_.sampling();
  request.set_pushed_tokens(prefilled.pushed_tokens());
  request.set_eos_token(eos_);
  request.set_tenant_salt(call_.tenant_salt);
  request.set_layout_fingerprint(layout_fingerprint_);
  request.set_layout_description(deps_.layout->Describe());
  request.set_reservation_token(target.reservation_token());
  int32_t computed_here = prefilled.computed_tokens();
  const absl::Time stream_start = deps_.clock->Now();
  absl::Status s = decode->decode->Generate(
      request, call_.deadline, options_.chunk_timeout, [&](const kvrelay::v1::DecodeChunk& chunk) {
        // Streaming: the decode worker has claimed the reservation.
        tenant_lease->Return();
        client_lease->Return();
        if (!attempt_streamed_ && chunk.tokens_size() > 0) {
          attempt_streamed_ = true;
          const absl::Time now = deps_.clock->Now();
          // The decode worker's own part: its Reserve and its first token once pushed (the
          // prefill's compute and the push are the prefill node's and the link's).
          decode->service.Observe(absl::ToDoubleSeconds(attempt_reserve_ + (now - stream_start)),
                                  now, attempt_start_);
        }
        return OnChunk(chunk, &computed_here, stream_done);
      });
  summary_.set_computed_prompt_tokens(summary_.computed_prompt_tokens() + computed_here);
  return s;
}

bool GenerateCall::OnChunk(const kvrelay::v1::DecodeChunk& chunk, int32_t* computed_here,
                           bool* stream_done) {
  if (chunk.tokens_size() > 0) {
    const absl::Time now = deps_.clock->Now();
    if (first_token_time_ == absl::InfiniteFuture()) {
      first_token_time_ = now;
      deps_.metrics->ttft_seconds->Observe(absl::ToDoubleSeconds(first_token_time_ - call_.start));
    } else {
      // One observation per arrival, as vLLM's per iteration (also across failovers).
      deps_.metrics->itl_seconds->Observe(absl::ToDoubleSeconds(now - last_token_time_));
    }
    last_token_time_ = now;
    deps_.metrics->generation_tokens->Increment(chunk.tokens_size());
    kvrelay::v1::GenerateResponse out;
    for (int32_t t : chunk.tokens()) {
      out.add_tokens(t);
      generated_.push_back(t);
    }
    if (!sink_(out)) {
      stop_requested_ = true;  // the caller has what it wants (e.g. a stop string)
      return false;
    }
  }
  if (chunk.done()) {
    *computed_here += chunk.computed_tokens();
    *stream_done = true;
  }
  return !Cancelled();
}

absl::StatusOr<bool> GenerateCall::AfterStream(absl::Status s, bool stream_done, const Pair& pair,
                                               const std::string& request_id) {
  if (Cancelled()) {
    client_gone_ = true;
    return false;
  }
  if (stop_requested_ || (s.ok() && stream_done)) {
    if (!stop_requested_) pair.decode->breaker.RecordSuccess();
    done_ = true;
    return false;
  }
  if (s.ok()) s = absl::UnavailableError("the decode stream ended early");
  last_error_ = s;
  // Refused at Generate (its batch queue filled since Reserve): busy, not failed.
  if (IsOverload(s)) return Busy(s, pair.decode, Blame::kDecode);
  if (IsDraining(s)) return Drained(pair.decode, Blame::kDecode);
  if (FinishedGenerating()) {
    done_ = true;  // every token arrived; only the closing message was lost
    return false;
  }
  return Failed(s, Blame::kDecode, pair, &request_id);
}

absl::StatusOr<bool> GenerateCall::Failed(const absl::Status& status, Blame called,
                                          const Pair& pair, const std::string* failover_of) {
  const Blame blame = Attribute(status, called);
  if (blame == Blame::kNone) return status;
  if (failover_of != nullptr) {
    KV_LOG(WARNING) << "request " << *failover_of << " fails over after " << generated_.size()
                    << " tokens: " << status;
  }
  if (blame == Blame::kPrefill) {
    pair.prefill->breaker.RecordFailure();
    deps_.metrics->breaker_opens_prefill->Increment();
    failed_prefill_.push_back(pair.prefill);
    deps_.metrics->CountWorkerFailure(status, "prefill");
  } else {
    // What the failure cost this request, believed at once (it decays back while idle).
    pair.decode->service.ObservePenalty(absl::ToDoubleSeconds(deps_.clock->Now() - attempt_start_),
                                        deps_.clock->Now());
    pair.decode->breaker.RecordFailure();
    deps_.metrics->breaker_opens_decode->Increment();
    failed_decode_.push_back(pair.decode);
    deps_.metrics->CountWorkerFailure(status, "decode");
  }
  ++failures_;
  return true;
}

bool GenerateCall::Busy(const absl::Status& status, Node* node, Blame role) {
  absl::Duration said = absl::ZeroDuration();
  if (std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status)) {
    said = absl::Milliseconds(info->retry_after_ms());
    if (!info->exhausted().empty()) exhausted_ = info->exhausted();
  }
  node->breaker.RecordBusy(said);
  predicted_wait_ = std::min(predicted_wait_, node->breaker.PredictedWait());
  (role == Blame::kPrefill ? busy_prefill_ : busy_decode_).push_back(node);
  return true;
}

bool GenerateCall::Drained(Node* node, Blame role) {
  node->breaker.RecordDraining();
  (role == Blame::kPrefill ? draining_prefill_ : draining_decode_).push_back(node);
  return true;
}

absl::Status GenerateCall::AtCapacity(Blame role, absl::Duration wait) {
  const char* name = role == Blame::kPrefill ? "prefill" : "decode";
  const size_t refused = (role == Blame::kPrefill ? busy_prefill_ : busy_decode_).size();
  if (wait == absl::InfiniteDuration()) wait = absl::ZeroDuration();
  // Whole milliseconds, rounded up: a client told "0" would come straight back.
  const int64_t wait_ms = absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1)));
  deps_.metrics->CountShed(name, exhausted_.empty() ? "busy" : exhausted_);
  return proto::Overloaded(
      absl::StrCat("every ", name, " worker is at capacity (", refused, " refused this request",
                   exhausted_.empty() ? "" : absl::StrCat(", full: ", exhausted_),
                   "); predicted room in ", wait_ms, " ms"),
      kvrelay::v1::ROLE_GATEWAY, "", exhausted_, wait_ms);
}

std::vector<GenerateCall::Node*> GenerateCall::Excluded(Blame role) const {
  const bool prefill = role == Blame::kPrefill;
  std::vector<Node*> excluded = prefill ? failed_prefill_ : failed_decode_;
  const std::vector<Node*>& busy = prefill ? busy_prefill_ : busy_decode_;
  excluded.insert(excluded.end(), busy.begin(), busy.end());
  const std::vector<Node*>& draining = prefill ? draining_prefill_ : draining_decode_;
  excluded.insert(excluded.end(), draining.begin(), draining.end());
  return excluded;
}

GenerateCall::Blame GenerateCall::Attribute(const absl::Status& status, Blame called) const {
  if (status.ok()) return Blame::kNone;
  // The caller's own deadline or cancellation is never a worker's fault.
  if ((absl::IsDeadlineExceeded(status) || absl::IsCancelled(status)) &&
      deps_.clock->Now() >= call_.deadline) {
    return Blame::kNone;
  }
  if (std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status)) {
    switch (info->role()) {
      case kvrelay::v1::ROLE_CLIENT:
        return Blame::kNone;
      case kvrelay::v1::ROLE_PREFILL:
        return Blame::kPrefill;
      case kvrelay::v1::ROLE_DECODE:
        return Blame::kDecode;
      default:
        break;
    }
  }
  // No detail (the call did not reach kvrelay code: connection refused, per-attempt timeout):
  // the node that was called.
  if (absl::IsInvalidArgument(status)) return Blame::kNone;
  return called;
}

bool GenerateCall::FinishedGenerating() const {
  return static_cast<int32_t>(generated_.size()) >= request_.max_tokens() ||
         (eos_ >= 0 && !generated_.empty() && generated_.back() == eos_);
}

absl::Status GenerateCall::Finish() {
  if (client_gone_) {
    return proto::Attribute(absl::CancelledError("client went away"), kvrelay::v1::ROLE_CLIENT, "",
                            kvrelay::v1::FAILURE_CALLER_DEADLINE);
  }
  if (!done_) {
    if (deps_.clock->Now() >= call_.deadline && last_error_.ok()) {
      last_error_ = absl::DeadlineExceededError("the request's deadline passed");
    }
    deps_.metrics->CountRequestFailure(last_error_);
    return last_error_;
  }
  const absl::Time end = deps_.clock->Now();
  summary_.set_attempts(attempts_);
  summary_.set_generated_tokens(static_cast<int32_t>(generated_.size()));
  summary_.set_ttft_ms(absl::ToDoubleMilliseconds(first_token_time_ - call_.start));
  summary_.set_total_ms(absl::ToDoubleMilliseconds(end - call_.start));
  deps_.metrics->e2e_seconds->Observe(absl::ToDoubleSeconds(end - call_.start));
  // "length" when max_tokens ended it, as vLLM's FinishReason; EOS and stop strings are "stop".
  (!stop_requested_ && static_cast<int32_t>(generated_.size()) >= request_.max_tokens()
       ? deps_.metrics->success_length
       : deps_.metrics->success_stop)
      ->Increment();
  deps_.metrics->prefix_hit_tokens->Increment(summary_.prefix_hit_tokens());
  deps_.metrics->transferred_bytes->Increment(static_cast<double>(summary_.transferred_bytes()));
  kvrelay::v1::GenerateResponse last;
  *last.mutable_summary() = summary_;
  sink_(last);
  return absl::OkStatus();
}

}  // namespace kvrelay::gateway
