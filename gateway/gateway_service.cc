#include "gateway/gateway_service.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kv/block_hash.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway {
namespace {

constexpr int32_t kMaxPromptTokens = 32768;
constexpr int32_t kMaxGenerateTokens = 4096;
constexpr size_t kMaxTenantBytes = 128;

std::chrono::system_clock::time_point ToChrono(absl::Time t) { return absl::ToChronoTime(t); }

bool Retryable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsResourceExhausted(s) ||
         absl::IsCancelled(s) || absl::IsAborted(s) || absl::IsInternal(s) ||
         absl::IsDataLoss(s) || absl::IsUnknown(s);
}

}  // namespace

std::string DeriveTenantSalt(const std::string& secret, const std::string& tenant) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(tenant.data()), tenant.size(), digest, &length);
  return std::string(reinterpret_cast<char*>(digest), 16);
}

GatewayService::GatewayService(GatewayOptions options, MetricsRegistry* metrics,
                               kv::ModelConfig config)
    : options_(std::move(options)),
      metrics_(metrics),
      config_(std::move(config)),
      instance_id_(absl::StrCat(absl::ToUnixMicros(absl::Now()) % 1000000000)) {
  ttft_seconds_ = metrics_->GetHistogram("kvrelay_gateway_ttft_seconds", "Time to first token.",
                                         LatencyBucketsSeconds());
  tpot_seconds_ = metrics_->GetHistogram("kvrelay_gateway_time_per_output_token_seconds",
                                         "Mean time per output token after the first.",
                                         LatencyBucketsSeconds());
  prefix_query_tokens_ = metrics_->GetCounter("kvrelay_gateway_prompt_tokens_total",
                                              "Prompt tokens received.");
  prefix_hit_tokens_ = metrics_->GetCounter("kvrelay_gateway_prefix_hit_tokens_total",
                                            "Prompt tokens served from cached KV.");
  transferred_bytes_ = metrics_->GetCounter("kvrelay_gateway_transferred_kv_bytes_total",
                                            "KV bytes moved prefill -> decode.");
}

absl::StatusOr<std::unique_ptr<GatewayService>> GatewayService::Create(GatewayOptions options,
                                                                       MetricsRegistry* metrics) {
  if (options.prefill_addresses.empty() || options.decode_addresses.empty()) {
    return absl::InvalidArgumentError("at least one --prefill and one --decode worker is needed");
  }
  KV_ASSIGN_OR_RETURN(kv::ModelConfig config,
                      kv::LoadHfConfig(options.model_dir + "/config.json"));
  auto service = std::unique_ptr<GatewayService>(
      new GatewayService(std::move(options), metrics, std::move(config)));
  const GatewayOptions& o = service->options_;
  if (!o.cachestore_address.empty()) {
    service->store_ = kvrelay::v1::CacheStore::NewStub(
        grpc::CreateChannel(o.cachestore_address, grpc::InsecureChannelCredentials()));
  }
  for (const std::string& address : o.prefill_addresses) {
    auto w = std::make_unique<Worker>();
    w->address = address;
    w->prefill = kvrelay::v1::Prefill::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    service->prefills_.push_back(std::move(w));
  }
  for (const std::string& address : o.decode_addresses) {
    auto w = std::make_unique<Worker>();
    w->address = address;
    w->decode = kvrelay::v1::Decode::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    service->decodes_.push_back(std::move(w));
  }
  return service;
}

bool GatewayService::Healthy(const Worker& w) {
  absl::MutexLock lock(&w.mu);
  return absl::Now() >= w.unhealthy_until;
}

void GatewayService::MarkUnhealthy(Worker& w, absl::Duration backoff) {
  absl::MutexLock lock(&w.mu);
  w.unhealthy_until = absl::Now() + backoff;
}

absl::Status GatewayService::Validate(const kvrelay::v1::GenerateRequest& request) const {
  if (!request.model().empty() && request.model() != options_.model_name) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: unknown model '", request.model(), "' (this gateway serves '",
                     options_.model_name, "')"));
  }
  if (request.tenant().empty() || request.tenant().size() > kMaxTenantBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tenant must be 1-", kMaxTenantBytes,
                                                   " bytes, got ", request.tenant().size()));
  }
  const int n = request.tokens_size();
  if (n == 0) return absl::InvalidArgumentError("tokens: the prompt is empty");
  int32_t limit = kMaxPromptTokens;
  if (config_.max_position_embeddings > 0) limit = std::min(limit, config_.max_position_embeddings);
  if (n > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: prompt of ", n, " tokens exceeds the maximum ", limit));
  }
  for (int i = 0; i < n; ++i) {
    if (request.tokens(i) < 0 || request.tokens(i) >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("tokens[", i, "] = ", request.tokens(i),
                                                     " is outside the vocabulary [0, ",
                                                     config_.vocab_size, ")"));
    }
  }
  if (request.max_tokens() < 1 || request.max_tokens() > kMaxGenerateTokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be in [1, ",
                                                   kMaxGenerateTokens, "], got ",
                                                   request.max_tokens()));
  }
  if (config_.max_position_embeddings > 0 &&
      n + request.max_tokens() > config_.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", n, ") + max_tokens (", request.max_tokens(),
                     ") exceeds the model's max_position_embeddings ",
                     config_.max_position_embeddings));
  }
  const float t = request.sampling().temperature();
  if (!(t >= 0 && t <= 100)) {
    return absl::InvalidArgumentError("sampling.temperature must be in [0, 100]");
  }
  return absl::OkStatus();
}

GatewayService::Worker* GatewayService::PickPrefill(const std::vector<int32_t>& prompt,
                                                    const std::string& salt,
                                                    const std::vector<Worker*>& excluded,
                                                    absl::Time deadline) {
  // Node ids of prefill workers, learned once each.
  for (auto& w : prefills_) {
    if (!w->node_id.empty()) continue;
    kvrelay::v1::PrefillStatusRequest request;
    kvrelay::v1::PrefillStatusResponse response;
    grpc::ClientContext context;
    context.set_deadline(ToChrono(std::min(deadline, absl::Now() + absl::Seconds(1))));
    if (w->prefill->Status(&context, request, &response).ok()) w->node_id = response.node_id();
  }
  std::vector<int32_t> matched(prefills_.size(), 0);
  const int32_t block_tokens = config_.layout.block_tokens();
  const int64_t full_blocks = (static_cast<int64_t>(prompt.size()) - 1) / block_tokens;
  if (store_ != nullptr && full_blocks > 0) {
    std::vector<kv::BlockHash> chain =
        kv::HashChain(config_.layout.fingerprint(), salt,
                      absl::MakeConstSpan(prompt).subspan(0, full_blocks * block_tokens),
                      block_tokens);
    kvrelay::v1::QueryPrefixRequest request;
    for (const kv::BlockHash& h : chain) {
      auto* p = request.add_chain();
      p->set_hi(h.hi);
      p->set_lo(h.lo);
    }
    kvrelay::v1::QueryPrefixResponse response;
    grpc::ClientContext context;
    context.set_deadline(ToChrono(std::min(deadline, absl::Now() + absl::Seconds(2))));
    if (store_->QueryPrefix(&context, request, &response).ok()) {
      for (const auto& node : response.nodes()) {
        for (size_t i = 0; i < prefills_.size(); ++i) {
          if (prefills_[i]->node_id == node.node_id()) matched[i] = node.matched();
        }
      }
    }
  }
  Worker* best = nullptr;
  int64_t best_score = std::numeric_limits<int64_t>::min();
  const uint64_t rr = round_robin_.fetch_add(1, std::memory_order_relaxed);
  for (size_t k = 0; k < prefills_.size(); ++k) {
    const size_t i = (rr + k) % prefills_.size();
    Worker* w = prefills_[i].get();
    if (std::find(excluded.begin(), excluded.end(), w) != excluded.end() || !Healthy(*w)) continue;
    // Longest prefix first; among equals, the least loaded.
    const int64_t score = int64_t{matched[i]} * 1000 - w->in_flight.load(std::memory_order_relaxed);
    if (score > best_score) {
      best_score = score;
      best = w;
    }
  }
  return best;
}

GatewayService::Worker* GatewayService::PickDecode(const std::vector<Worker*>& excluded) {
  Worker* best = nullptr;
  int32_t best_load = std::numeric_limits<int32_t>::max();
  const uint64_t rr = round_robin_.fetch_add(1, std::memory_order_relaxed);
  for (size_t k = 0; k < decodes_.size(); ++k) {
    Worker* w = decodes_[(rr + k) % decodes_.size()].get();
    if (std::find(excluded.begin(), excluded.end(), w) != excluded.end() || !Healthy(*w)) continue;
    const int32_t load = w->in_flight.load(std::memory_order_relaxed);
    if (load < best_load) {
      best_load = load;
      best = w;
    }
  }
  return best;
}

grpc::Status GatewayService::Generate(grpc::ServerContext* context,
                                      const kvrelay::v1::GenerateRequest* request,
                                      grpc::ServerWriter<kvrelay::v1::GenerateResponse>* writer) {
  if (absl::Status s = Validate(*request); !s.ok()) return proto::ToGrpcStatus(s);
  const absl::Time start = absl::Now();
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline > start + options_.default_deadline) deadline = start + options_.default_deadline;
  const std::string salt = DeriveTenantSalt(options_.tenant_secret, request->tenant());
  const std::vector<int32_t> prompt(request->tokens().begin(), request->tokens().end());
  const int32_t eos = request->has_eos_token() ? request->eos_token() : -1;
  prefix_query_tokens_->Increment(static_cast<double>(prompt.size()));

  std::vector<int32_t> generated;
  kvrelay::v1::GenerateSummary summary;
  summary.set_prompt_tokens(static_cast<int32_t>(prompt.size()));
  absl::Time first_token_time = absl::InfiniteFuture();
  std::vector<Worker*> failed_prefill, failed_decode;
  absl::Status last_error = absl::UnavailableError("no healthy worker pair");
  int32_t attempts = 0;
  bool done = false;

  while (!done && attempts < options_.max_attempts && absl::Now() < deadline) {
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    ++attempts;
    std::vector<int32_t> tokens = prompt;
    tokens.insert(tokens.end(), generated.begin(), generated.end());
    const int32_t remaining = request->max_tokens() - static_cast<int32_t>(generated.size());
    Worker* p = PickPrefill(tokens, salt, failed_prefill, deadline);
    Worker* d = PickDecode(failed_decode);
    if (p == nullptr || d == nullptr) {
      last_error = absl::UnavailableError(absl::StrCat("no healthy ", p == nullptr ? "prefill" : "decode",
                                                       " worker"));
      break;
    }
    const std::string request_id =
        absl::StrCat("gw", instance_id_, "-", next_request_.fetch_add(1), "-", attempts);
    p->in_flight.fetch_add(1, std::memory_order_relaxed);
    d->in_flight.fetch_add(1, std::memory_order_relaxed);
    struct InFlight {
      Worker* p;
      Worker* d;
      ~InFlight() {
        p->in_flight.fetch_sub(1, std::memory_order_relaxed);
        d->in_flight.fetch_sub(1, std::memory_order_relaxed);
      }
    } in_flight{p, d};

    // Reserve on decode.
    kvrelay::v1::ReserveRequest reserve;
    reserve.set_request_id(request_id);
    reserve.set_model(options_.model_name);
    reserve.set_prompt_tokens(static_cast<int32_t>(tokens.size()));
    reserve.set_max_tokens(remaining);
    kvrelay::v1::ReserveResponse target;
    {
      grpc::ClientContext c;
      c.set_deadline(ToChrono(deadline));
      absl::Status s = proto::FromGrpcStatus(d->decode->Reserve(&c, reserve, &target));
      if (!s.ok()) {
        last_error = absl::Status(s.code(), absl::StrCat("decode ", d->address, ": ", s.message()));
        if (!Retryable(s)) return proto::ToGrpcStatus(last_error);
        MarkUnhealthy(*d, options_.worker_backoff);
        failed_decode.push_back(d);
        continue;
      }
    }
    // Prefill pushes into the reserved slots.
    kvrelay::v1::PrefillRequest prefill;
    prefill.set_request_id(request_id);
    prefill.set_model(options_.model_name);
    *prefill.mutable_tokens() = {tokens.begin(), tokens.end()};
    prefill.set_tenant_salt(salt);
    *prefill.mutable_target() = target;
    kvrelay::v1::PrefillResponse prefilled;
    {
      grpc::ClientContext c;
      c.set_deadline(ToChrono(deadline));
      absl::Status s = proto::FromGrpcStatus(p->prefill->Prefill(&c, prefill, &prefilled));
      if (!s.ok()) {
        kvrelay::v1::ReleaseRequest release;
        release.set_request_id(request_id);
        kvrelay::v1::ReleaseResponse ignored;
        grpc::ClientContext rc;
        rc.set_deadline(ToChrono(absl::Now() + absl::Seconds(1)));
        d->decode->Release(&rc, release, &ignored);
        last_error = absl::Status(s.code(), absl::StrCat("prefill ", p->address, ": ", s.message()));
        if (!Retryable(s)) return proto::ToGrpcStatus(last_error);
        // A push failure may be the decode worker's fault as much as the prefill's.
        if (absl::IsUnavailable(s) && s.message().find("decode") != absl::string_view::npos) {
          MarkUnhealthy(*d, options_.worker_backoff);
          failed_decode.push_back(d);
        } else {
          MarkUnhealthy(*p, options_.worker_backoff);
          failed_prefill.push_back(p);
        }
        continue;
      }
    }
    if (attempts == 1 || summary.prefill_worker().empty()) {
      summary.set_prefix_hit_tokens(prefilled.prefix_hit_tokens());
    }
    summary.set_transferred_bytes(summary.transferred_bytes() + prefilled.pushed_bytes());
    summary.set_fetched_bytes(summary.fetched_bytes() + prefilled.fetched_bytes());
    summary.set_prefill_worker(p->address);
    summary.set_decode_worker(d->address);

    // Decode streams the tokens.
    kvrelay::v1::DecodeRequest decode;
    decode.set_request_id(request_id);
    *decode.mutable_tokens() = {tokens.begin(), tokens.end()};
    decode.set_max_tokens(remaining);
    *decode.mutable_sampling() = request->sampling();
    decode.set_pushed_tokens(prefilled.pushed_tokens());
    decode.set_eos_token(eos);
    decode.set_tenant_salt(salt);
    grpc::ClientContext c;
    c.set_deadline(ToChrono(deadline));
    std::unique_ptr<grpc::ClientReader<kvrelay::v1::DecodeChunk>> reader =
        d->decode->Generate(&c, decode);
    kvrelay::v1::DecodeChunk chunk;
    int32_t computed_here = prefilled.computed_tokens();
    while (reader->Read(&chunk)) {
      if (chunk.tokens_size() > 0) {
        if (first_token_time == absl::InfiniteFuture()) {
          first_token_time = absl::Now();
          ttft_seconds_->Observe(absl::ToDoubleSeconds(first_token_time - start));
        }
        kvrelay::v1::GenerateResponse out;
        for (int32_t t : chunk.tokens()) {
          out.add_tokens(t);
          generated.push_back(t);
        }
        if (!writer->Write(out)) {
          c.TryCancel();
          return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
        }
      }
      if (chunk.done()) {
        computed_here += chunk.computed_tokens();
        done = true;
      }
    }
    absl::Status s = proto::FromGrpcStatus(reader->Finish());
    summary.set_computed_prompt_tokens(summary.computed_prompt_tokens() + computed_here);
    if (done && s.ok()) break;
    done = false;
    last_error = absl::Status(s.ok() ? absl::StatusCode::kUnavailable : s.code(),
                              absl::StrCat("decode ", d->address, ": ",
                                           s.ok() ? "stream ended early" : s.message()));
    if (!s.ok() && !Retryable(s)) return proto::ToGrpcStatus(last_error);
    KV_LOG(WARNING) << "request " << request_id << " failed over after " << generated.size()
                    << " tokens: " << last_error;
    MarkUnhealthy(*d, options_.worker_backoff);
    failed_decode.push_back(d);
    if (static_cast<int32_t>(generated.size()) >= request->max_tokens() ||
        (eos >= 0 && !generated.empty() && generated.back() == eos)) {
      done = true;
    }
  }
  if (!done) {
    metrics_->GetCounter("kvrelay_gateway_failures_total", "Failed requests by reason.",
                         {{"reason", std::string(absl::StatusCodeToString(last_error.code()))}})
        ->Increment();
    return proto::ToGrpcStatus(last_error);
  }
  const absl::Time end = absl::Now();
  summary.set_attempts(attempts);
  summary.set_generated_tokens(static_cast<int32_t>(generated.size()));
  summary.set_ttft_ms(absl::ToDoubleMilliseconds(first_token_time - start));
  summary.set_total_ms(absl::ToDoubleMilliseconds(end - start));
  if (generated.size() > 1) {
    tpot_seconds_->Observe(absl::ToDoubleSeconds(end - first_token_time) /
                           static_cast<double>(generated.size() - 1));
  }
  prefix_hit_tokens_->Increment(summary.prefix_hit_tokens());
  transferred_bytes_->Increment(static_cast<double>(summary.transferred_bytes()));
  kvrelay::v1::GenerateResponse last;
  *last.mutable_summary() = summary;
  writer->Write(last);
  return grpc::Status::OK;
}

}  // namespace kvrelay::gateway
